//! The in-process store (the default): sharded maps behind short-lived locks.
//!
//! A request locks every shard its keys live in, in ascending shard order (so two requests on
//! overlapping keys can never deadlock), evaluates all checks, and commits only if all pass.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;

use crate::algorithm::{self, Hits, State, Update};
use crate::clock::{Clock, SystemClock};

use super::{Check, Outcome, Store, StoreError, request_allowed};

/// Shards of the key map; a power of two well above the core count keeps lock contention rare.
const SHARDS: usize = 256;

/// Default cap on live keys: about 250 MB at worst with the longest keys, more with sliding logs
/// of high limits (docs/stores.md).
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

type Hasher = foldhash::fast::RandomState;

struct Entry {
    key: Box<str>,
    state: State,
    expires_at: u64,
}

/// One shard's keys. A table rather than a map, so a request hashes each key once and uses
/// that hash for its shard, for finding the key, and for spotting a key repeated in the request.
#[derive(Default)]
struct Shard {
    entries: HashTable<Entry>,
}

impl Shard {
    fn get(&self, hash: u64, key: &str) -> Option<&Entry> {
        self.entries.find(hash, is_entry_of(key))
    }

    fn get_mut(&mut self, hash: u64, key: &str) -> Option<&mut Entry> {
        self.entries.find_mut(hash, is_entry_of(key))
    }
}

fn is_entry_of(key: &str) -> impl Fn(&Entry) -> bool + '_ {
    move |entry| *entry.key == *key
}

/// A check's key hash and the shard it selects.
#[derive(Clone, Copy)]
struct Located {
    hash: u64,
    shard: usize,
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
    key_hasher: Hasher,
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
            key_hasher: Hasher::default(),
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

    /// Every key held now (expired ones until reclaimed), for inspection: locks each shard in
    /// turn, so it costs a pass over the whole store.
    pub fn keys(&self) -> Vec<String> {
        self.shards
            .iter()
            .flat_map(|shard| {
                lock(shard)
                    .entries
                    .iter()
                    .map(|entry| entry.key.to_string())
                    .collect::<Vec<_>>()
            })
            .collect()
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
        shard.entries.retain(|entry| entry.expires_at > now);
        let purged = before - shard.entries.len();
        self.live_keys.fetch_sub(purged, Ordering::Relaxed);
        purged
    }

    fn locate(&self, key: &str) -> Located {
        let hash = self.key_hasher.hash_one(key);
        // The table picks buckets with the hash's low bits and tags them with its top seven, so
        // the shard comes from bits in between: keys of one shard must not share either.
        Located {
            hash,
            shard: (hash >> 32) as usize & (SHARDS - 1),
        }
    }

    fn key_hash(&self, entry: &Entry) -> u64 {
        self.key_hasher.hash_one(&*entry.key)
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
        let located: Vec<Located> = checks.iter().map(|check| self.locate(&check.key)).collect();
        let mut order: Vec<usize> = located.iter().map(|at| at.shard).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> = order
            .iter()
            .map(|&index| (index, lock(&self.shards[index])))
            .collect();
        let guard_of = |shard: usize| order.binary_search(&shard).unwrap_or(0);

        let mut assessments = Vec::with_capacity(checks.len());
        for (i, (check, at)) in checks.iter().zip(&located).enumerate() {
            // A key seen earlier in this request is evaluated after the latest earlier check
            // of it that changed its state.
            let earlier = (0..i).rev().find_map(|j| {
                repeats(checks, &located, j, i)
                    .then(|| assessments_update(&assessments, j))
                    .flatten()
            });
            let stored = || {
                guards[guard_of(at.shard)]
                    .1
                    .get(at.hash, &check.key)
                    .filter(|entry| entry.expires_at > now)
                    .map(|entry| &entry.state)
            };
            let state = earlier.map(|update| &update.state).or_else(stored);
            assessments.push(algorithm::assess(&check.params, state, now, check.hits));
        }

        let mut outcomes: Vec<Outcome> = assessments
            .iter()
            .map(|a| Outcome { verdict: a.verdict })
            .collect();
        let allowed = request_allowed(checks, &outcomes);
        // A denied request commits nothing but its charges, which are recorded whatever the
        // answer; its other checks report what they still have.
        let commits = |check: &Check| allowed || matches!(check.hits, Hits::Charge(_));
        if !allowed {
            for ((check, assessment), outcome) in checks.iter().zip(&assessments).zip(&mut outcomes)
            {
                if outcome.verdict.allowed && !commits(check) {
                    outcome.verdict.remaining = assessment.unconsumed_remaining;
                }
            }
            if !checks.iter().any(commits) {
                return Ok(outcomes);
            }
            // Its charges are recorded again on what is stored, so none carries the hits of an
            // earlier check of the same key that the denial leaves uncommitted.
            for i in 0..checks.len() {
                let Hits::Charge(n) = checks[i].hits else {
                    continue;
                };
                let at = located[i];
                let earlier = (0..i).rev().find_map(|j| {
                    (repeats(checks, &located, j, i) && matches!(checks[j].hits, Hits::Charge(_)))
                        .then(|| assessments_update(&assessments, j))
                        .flatten()
                });
                let stored = guards[guard_of(at.shard)]
                    .1
                    .get(at.hash, &checks[i].key)
                    .filter(|entry| entry.expires_at > now)
                    .map(|entry| &entry.state);
                let state = earlier.map(|update| &update.state).or(stored);
                // The answer stays the one decided with the request (as Redis Cluster, which
                // commits by slot and refunds, reports it).
                assessments[i].update =
                    algorithm::assess(&checks[i].params, state, now, Hits::Charge(n)).update;
            }
        }

        self.ensure_room(checks, &located, &mut guards, &guard_of, now)?;
        for ((check, assessment), at) in checks.iter().zip(assessments).zip(&located) {
            let Some(Update { state, ttl_us }) = assessment.update.filter(|_| commits(check))
            else {
                continue;
            };
            let expires_at = now.saturating_add(ttl_us);
            let shard = &mut guards[guard_of(at.shard)].1;
            match shard.get_mut(at.hash, &check.key) {
                Some(entry) => {
                    entry.state = state;
                    entry.expires_at = expires_at;
                }
                None => {
                    shard.entries.insert_unique(
                        at.hash,
                        Entry {
                            key: check.key.as_str().into(),
                            state,
                            expires_at,
                        },
                        |entry| self.key_hash(entry),
                    );
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
        located: &[Located],
        guards: &mut [(usize, MutexGuard<'_, Shard>)],
        guard_of: &impl Fn(usize) -> usize,
        now: u64,
    ) -> Result<(), StoreError> {
        let count_new = |guards: &[(usize, MutexGuard<'_, Shard>)]| {
            checks
                .iter()
                .enumerate()
                .filter(|&(i, check)| {
                    let at = located[i];
                    guards[guard_of(at.shard)]
                        .1
                        .get(at.hash, &check.key)
                        .is_none()
                        && !(0..i).any(|j| repeats(checks, located, j, i))
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

/// Whether check `j` has the same key as check `i`; the hashes differ for almost every pair,
/// which saves comparing the keys.
fn repeats(checks: &[Check], located: &[Located], j: usize, i: usize) -> bool {
    located[j].hash == located[i].hash && checks[j].key == checks[i].key
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

    async fn decide_by(
        &self,
        checks: &[Check],
        _deadline: Option<std::time::Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        // Decided at once, in process: no wait for a deadline to bound.
        self.decide_now(checks)
    }
}

#[cfg(test)]
mod tests;
