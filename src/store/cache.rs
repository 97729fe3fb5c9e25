//! The local over-limit cache: a key known to stay over its limit until T is denied in process
//! until T, without a round trip to Redis.
//!
//! Why it is safe: a denied check's `reset` is the earliest time the same request could pass if
//! no other traffic came, and other traffic only ever takes (it never gives back), so until then
//! the answer cannot change, for every algorithm. The entry remembers the hits that were
//! denied and the limit's exact parameters: a request asking for no more is denied, one asking
//! for fewer, or for a limit whose numbers changed (a reload), goes to the store. Two things can
//! still free quota early and are handled: a refund (`is_negative_hits`) through this rlsd drops
//! the entry; refunds sent through *other* replicas are not seen here, so their quota comes back
//! for this replica only at T (never over-admitting). T is measured from before the call left,
//! on this process's clock, so the entry never outlives the store's own reset.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::algorithm::{Hits, Params, Verdict};
use crate::clock::{Clock, SystemClock};
use crate::metrics::Metrics;

use super::{Check, Outcome, Store, StoreError};

/// Shards of the cache map.
const SHARDS: usize = 64;

type Hasher = foldhash::fast::RandomState;

#[derive(Clone, Copy)]
struct Known {
    params: Params,
    /// The fewest hits known to be denied.
    hits: u64,
    /// Until when (µs on the cache's clock).
    until: u64,
}

/// A [`Store`] wrapper that answers known denials locally.
pub struct OverLimitCache<S, C: Clock = SystemClock> {
    inner: S,
    clock: C,
    shards: Box<[Mutex<HashMap<String, Known, Hasher>>]>,
    hasher: Hasher,
    capacity: usize,
    capacity_per_shard: usize,
    hits: AtomicU64,
    reported_hits: AtomicU64,
}

impl<S: Store> OverLimitCache<S, SystemClock> {
    /// Caches at most `capacity` denied keys in front of `inner` (0: none, a pass-through).
    pub fn new(inner: S, capacity: usize) -> Self {
        OverLimitCache::with_clock(inner, capacity, SystemClock)
    }
}

impl<S: Store, C: Clock> OverLimitCache<S, C> {
    /// A cache reading time from `clock`.
    pub fn with_clock(inner: S, capacity: usize, clock: C) -> Self {
        OverLimitCache {
            inner,
            clock,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: Hasher::default(),
            capacity,
            capacity_per_shard: capacity.div_ceil(SHARDS).max(1),
            hits: AtomicU64::new(0),
            reported_hits: AtomicU64::new(0),
        }
    }

    /// Requests answered from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Denied keys held now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no denied key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Known, Hasher>> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    /// The time a check asking for `want` hits is known to stay denied until, if it is.
    fn known_denied(&self, check: &Check, want: u64, now: u64) -> Option<u64> {
        let shard = self
            .shard(&check.key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let known = shard.get(&check.key)?;
        (known.params == check.params && want >= known.hits && now < known.until)
            .then_some(known.until)
    }

    fn remember(&self, check: &Check, want: u64, verdict: &Verdict, start: u64) {
        // The store rounds reset up to a whole millisecond: take that back off, so the entry
        // ends no later than the store's own answer would change.
        let until = start.saturating_add(verdict.reset_us.saturating_sub(1_000));
        let mut shard = self
            .shard(&check.key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if shard.len() >= self.capacity_per_shard && !shard.contains_key(&check.key) {
            shard.retain(|_, known| known.until > start);
            if shard.len() >= self.capacity_per_shard {
                // Full of live denials: this one is simply not cached.
                return;
            }
        }
        let entry = shard.entry(check.key.clone()).or_insert(Known {
            params: check.params,
            hits: want,
            until,
        });
        if entry.params != check.params || entry.until <= start {
            *entry = Known {
                params: check.params,
                hits: want,
                until,
            };
        } else {
            entry.hits = entry.hits.min(want);
            entry.until = entry.until.min(until);
        }
    }

    fn forget(&self, key: &str) {
        self.shard(key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }
}

impl<S: Store, C: Clock> Store for OverLimitCache<S, C> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn healthy(&self) -> bool {
        self.inner.healthy().await
    }

    async fn open_lane(&self) {
        self.inner.open_lane().await;
    }

    fn report(&self, metrics: &Metrics) {
        self.inner.report(metrics);
        let hits = self.hits();
        let before = self.reported_hits.swap(hits, Ordering::Relaxed);
        metrics
            .over_limit_cache_hits
            .inc_by(hits.saturating_sub(before));
    }

    async fn decide(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        if self.capacity == 0 {
            return self.inner.decide(checks).await;
        }
        let now = self.clock.now_us();
        let wants = wants(checks);
        let denied: Vec<Option<u64>> = checks
            .iter()
            .zip(&wants)
            .map(|(check, want)| match want {
                // A quota check's denial alone does not deny its request.
                Some(want) if !check.shadow && !check.quota_mode => {
                    self.known_denied(check, *want, now)
                }
                _ => None,
            })
            .collect();
        if denied.iter().any(Option::is_some) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            // Denied without asking the store; the other limits were not looked at, so they
            // report nothing left rather than a guess.
            return Ok(denied
                .iter()
                .map(|until| Outcome {
                    verdict: match until {
                        Some(until) => Verdict {
                            allowed: false,
                            remaining: 0,
                            reset_us: crate::algorithm::round_up_to_ms(until - now),
                        },
                        None => Verdict {
                            allowed: true,
                            remaining: 0,
                            reset_us: 0,
                        },
                    },
                })
                .collect());
        }
        for check in checks {
            if matches!(check.hits, Hits::Refund(_)) {
                self.forget(&check.key);
            }
        }
        let outcomes = self.inner.decide(checks).await?;
        for check in checks {
            // Again after the call: a denial cached by a request that raced this refund is stale.
            if matches!(check.hits, Hits::Refund(_)) {
                self.forget(&check.key);
            }
        }
        for ((check, outcome), want) in checks.iter().zip(&outcomes).zip(&wants) {
            if let (false, false, Some(want)) = (outcome.verdict.allowed, check.shadow, want) {
                self.remember(check, *want, &outcome.verdict, now);
            }
        }
        Ok(outcomes)
    }
}

/// For each check, the hits it asks for; `None` where the cache must stay out: a key the
/// request checks twice (its answer depends on the other check's outcome) or refunds.
fn wants(checks: &[Check]) -> Vec<Option<u64>> {
    checks
        .iter()
        .map(|check| {
            if checks.iter().filter(|other| other.key == check.key).count() > 1 {
                return None;
            }
            match check.hits {
                Hits::Take(n) => Some(n),
                Hits::Peek => Some(1),
                Hits::Refund(_) => None,
            }
        })
        .collect()
}
