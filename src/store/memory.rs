//! The in-process store (the default): sharded maps behind short-lived locks.
//!
//! A request locks every shard its keys live in, in ascending shard order (so two requests on
//! overlapping keys can never deadlock), evaluates all checks, and commits only if all pass.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::algorithm::{self, State, Update};
use crate::clock::{Clock, SystemClock};

use super::{Check, Outcome, Store, StoreError, request_allowed};

/// Shards of the key map; a power of two well above the core count keeps lock contention rare.
const SHARDS: usize = 256;

/// Default cap on live keys: roughly 200 MB of state at worst.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

type Hasher = foldhash::fast::RandomState;

struct Entry {
    state: State,
    expires_at: u64,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<Box<str>, Entry, Hasher>,
}

/// Counters an operator can read to see the store's memory use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStoreStats {
    /// Keys currently held (expired ones count until reclaimed).
    pub live_keys: usize,
    /// The cap on live keys.
    pub capacity: usize,
    /// Requests refused because the cap was reached.
    pub full_rejections: u64,
}

/// State in this process's memory: nothing else to run.
pub struct MemoryStore<C: Clock = SystemClock> {
    shards: Box<[Mutex<Shard>]>,
    shard_hasher: Hasher,
    clock: C,
    live_keys: AtomicUsize,
    capacity: usize,
    full_rejections: AtomicU64,
    full_reported: AtomicBool,
    /// When a refused request last swept the whole store (µs).
    last_full_sweep: AtomicU64,
}

impl MemoryStore<SystemClock> {
    /// A store on the system clock holding at most `capacity` keys.
    pub fn new(capacity: usize) -> Self {
        MemoryStore::with_clock(capacity, SystemClock)
    }
}

impl<C: Clock> MemoryStore<C> {
    /// A store reading time from `clock`.
    pub fn with_clock(capacity: usize, clock: C) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            shard_hasher: Hasher::default(),
            clock,
            live_keys: AtomicUsize::new(0),
            capacity,
            full_rejections: AtomicU64::new(0),
            full_reported: AtomicBool::new(false),
            last_full_sweep: AtomicU64::new(0),
        }
    }

    /// Memory use, for metrics and logs.
    pub fn stats(&self) -> MemoryStoreStats {
        MemoryStoreStats {
            live_keys: self.live_keys.load(Ordering::Relaxed),
            capacity: self.capacity,
            full_rejections: self.full_rejections.load(Ordering::Relaxed),
        }
    }

    /// Drops every key whose state no longer matters; returns how many went.
    pub fn purge_expired(&self) -> usize {
        let now = self.clock.now_us();
        let purged: usize = self
            .shards
            .iter()
            .map(|shard| self.purge_shard(&mut lock(shard), now))
            .sum();
        if self.live_keys.load(Ordering::Relaxed) < self.capacity
            && self.full_reported.swap(false, Ordering::Relaxed)
        {
            tracing::info!(
                live_keys = self.live_keys.load(Ordering::Relaxed),
                "in-process store has room again"
            );
        }
        purged
    }

    fn purge_shard(&self, shard: &mut Shard, now: u64) -> usize {
        let before = shard.entries.len();
        shard.entries.retain(|_, entry| entry.expires_at > now);
        let purged = before - shard.entries.len();
        self.live_keys.fetch_sub(purged, Ordering::Relaxed);
        purged
    }

    fn shard_of(&self, key: &str) -> usize {
        // SHARDS is a power of two, so the mask keeps the low bits of the hash.
        (self.shard_hasher.hash_one(key) as usize) & (SHARDS - 1)
    }

    fn decide_now(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        match self.try_decide(checks) {
            // Expired keys may sit in shards this request did not lock: reclaim them all
            // (holding no lock, so lock order is kept) and try once more. At most every 100 ms,
            // so a store kept full does not pay a full sweep per refused request.
            Err(StoreError::Full { .. }) if self.sweep_allowed() && self.purge_expired() > 0 => {
                self.try_decide(checks)
            }
            result => result,
        }
        .inspect_err(|_| self.report_full())
    }

    fn sweep_allowed(&self) -> bool {
        let now = self.clock.now_us();
        let last = self.last_full_sweep.load(Ordering::Relaxed);
        now.saturating_sub(last) >= 100_000
            && self
                .last_full_sweep
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    fn report_full(&self) {
        self.full_rejections.fetch_add(1, Ordering::Relaxed);
        if !self.full_reported.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                capacity = self.capacity,
                "in-process store is full: requests needing new keys are refused until keys expire"
            );
        }
    }

    fn try_decide(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        let now = self.clock.now_us();
        let shard_of: Vec<usize> = checks
            .iter()
            .map(|check| self.shard_of(&check.key))
            .collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> = order
            .iter()
            .map(|&index| (index, lock(&self.shards[index])))
            .collect();
        let guard_of = |shard: usize| order.binary_search(&shard).unwrap_or(0);

        let mut assessments = Vec::with_capacity(checks.len());
        for (i, check) in checks.iter().enumerate() {
            // A key seen earlier in this request is evaluated after that earlier check's hits.
            let earlier = (0..i).rev().find_map(|j| {
                (checks[j].key == check.key)
                    .then(|| assessments_update(&assessments, j))
                    .flatten()
            });
            let stored = || {
                guards[guard_of(shard_of[i])]
                    .1
                    .entries
                    .get(check.key.as_str())
                    .filter(|entry| entry.expires_at > now)
                    .map(|entry| &entry.state)
            };
            let state = earlier.map(|update| &update.state).or_else(stored);
            assessments.push(algorithm::assess(&check.params, state, now, check.hits));
        }

        let outcomes: Vec<Outcome> = assessments
            .iter()
            .map(|a| Outcome { verdict: a.verdict })
            .collect();
        if !request_allowed(checks, &outcomes) {
            return Ok(checks
                .iter()
                .zip(&assessments)
                .map(|(_, a)| {
                    let mut verdict = a.verdict;
                    if verdict.allowed {
                        verdict.remaining = a.unconsumed_remaining;
                    }
                    Outcome { verdict }
                })
                .collect());
        }

        self.ensure_room(checks, &shard_of, &mut guards, &guard_of, now)?;
        for ((check, assessment), shard) in checks.iter().zip(assessments).zip(&shard_of) {
            let Some(Update { state, ttl_us }) = assessment.update else {
                continue;
            };
            let entry = Entry {
                state,
                expires_at: now.saturating_add(ttl_us),
            };
            let entries = &mut guards[guard_of(*shard)].1.entries;
            match entries.get_mut(check.key.as_str()) {
                Some(slot) => *slot = entry,
                None => {
                    entries.insert(check.key.as_str().into(), entry);
                    self.live_keys.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(outcomes)
    }

    /// Refuses the request, changing nothing, if its new keys would pass the cap even after
    /// reclaiming expired keys in the shards it holds.
    fn ensure_room(
        &self,
        checks: &[Check],
        shard_of: &[usize],
        guards: &mut [(usize, MutexGuard<'_, Shard>)],
        guard_of: &impl Fn(usize) -> usize,
        now: u64,
    ) -> Result<(), StoreError> {
        let count_new = |guards: &[(usize, MutexGuard<'_, Shard>)]| {
            checks
                .iter()
                .enumerate()
                .filter(|(i, check)| {
                    !guards[guard_of(shard_of[*i])]
                        .1
                        .entries
                        .contains_key(check.key.as_str())
                        && !checks[..*i].iter().any(|earlier| earlier.key == check.key)
                })
                .count()
        };
        let fits = |new: usize| self.live_keys.load(Ordering::Relaxed) + new <= self.capacity;
        // Far from the cap (the usual case) there is nothing to count.
        if fits(checks.len()) || fits(count_new(guards)) {
            return Ok(());
        }
        for (_, guard) in guards.iter_mut() {
            self.purge_shard(guard, now);
        }
        if fits(count_new(guards)) {
            return Ok(());
        }
        Err(StoreError::Full {
            capacity: self.capacity,
        })
    }
}

fn assessments_update(assessments: &[algorithm::Assessment], j: usize) -> Option<&Update> {
    assessments[j].update.as_ref()
}

/// Locks a shard. A panic while holding a lock cannot leave a half-written request behind (all
/// writes happen after every evaluation), so a poisoned lock is still safe to use.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<C: Clock> Store for MemoryStore<C> {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn healthy(&self) -> bool {
        true
    }

    fn report(&self, metrics: &crate::metrics::Metrics) {
        let stats = self.stats();
        let as_gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        metrics
            .memory_live_keys
            .set(as_gauge(stats.live_keys as u64));
        metrics.memory_capacity.set(as_gauge(stats.capacity as u64));
        metrics
            .memory_full_rejections
            .set(as_gauge(stats.full_rejections));
    }

    async fn decide(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        self.decide_now(checks)
    }
}

#[cfg(test)]
mod tests;
