//! The local over-limit cache: a request whose every check is a denial known to hold until T is
//! answered in process until T, without a round trip to Redis, exactly as the store would answer.
//!
//! Why the answer is the store's: only denials with nothing left (`remaining: 0`) are remembered.
//! From there other traffic only ever takes (never gives back), so until the denial's reset the
//! check stays denied with nothing left, and its reset counts down to the same instant. A request
//! made only of such checks changes nothing in the store either (denied checks commit nothing), so
//! answering it locally is exact; a request with any other check goes to the store, which decides
//! all of its checks together. A fixed window's reset is its window's end whatever the hits; the
//! other algorithms' reset depends on how many hits are asked for, so for them only single hits
//! (and peeks) are remembered and answered. The entry also remembers the limit's exact parameters:
//! a limit whose numbers changed (a reload) goes to the store. A refund (`is_negative_hits`)
//! through this rlsd drops the entry; refunds sent through *other* replicas (and the hits given back
//! for answers no caller used) are not seen here, so an entry is answered from for at most one
//! second: such quota comes back for this replica within that second (never over-admitting). T is measured from
//! before the call left, on this process's clock, so the entry never outlives the store's reset.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::algorithm::{Hits, Params, Verdict, round_up_to_ms};
use crate::clock::{Clock, SystemClock};
use crate::limit::Algorithm;
use crate::metrics::Metrics;

use super::{Check, Outcome, Store, StoreError};

/// Shards of the cache map.
const SHARDS: usize = 64;

/// The store reports resets rounded up to a whole millisecond, so the true instant lies up to this
/// much before the rounded one.
const RESET_ROUNDING_US: u64 = 1_000;

/// The longest a denial is answered from the cache: quota given back meanwhile (a refund, or
/// the hits of an answer no caller used, through any replica) is seen again within this.
const MAX_AGE_US: u64 = 1_000_000;

type Hasher = foldhash::fast::RandomState;

#[derive(Clone, Copy)]
struct Known {
    params: Params,
    /// The denial's reset as the store reported it (µs on the cache's clock): the store keeps
    /// denying until at least `reset_at - RESET_ROUNDING_US`.
    reset_at: u64,
    /// When the entry stops being answered from, at most [`MAX_AGE_US`] after it was learned.
    expires_at: u64,
}

impl Known {
    /// Whether the denial certainly still holds at `now`.
    fn holds(&self, now: u64) -> bool {
        now < self.reset_at.saturating_sub(RESET_ROUNDING_US) && now < self.expires_at
    }
}

/// A [`Store`] wrapper that answers requests made only of known denials locally.
pub struct OverLimitCache<S, C: Clock = SystemClock> {
    inner: S,
    clock: C,
    shards: Box<[Mutex<HashMap<String, Known, Hasher>>]>,
    hasher: Hasher,
    capacity: usize,
    capacity_per_shard: usize,
    hits: AtomicU64,
    reported_hits: AtomicU64,
    /// Bumped after every call that refunds: a denial learned by a call that overlapped a refund
    /// may already be stale, so it is not remembered.
    refunds: AtomicU64,
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
            refunds: AtomicU64::new(0),
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

    /// The store's answer for `check` at `now`, if it is a denial known to hold.
    fn known_denial(&self, check: &Check, now: u64) -> Option<Verdict> {
        let shard = self
            .shard(&check.key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let known = shard.get(&check.key)?;
        (known.params == check.params && known.holds(now)).then(|| Verdict {
            allowed: false,
            remaining: 0,
            reset_us: round_up_to_ms(known.reset_at - now),
        })
    }

    fn remember(&self, check: &Check, verdict: &Verdict, start: u64, refunds_before: u64) {
        let known = Known {
            params: check.params,
            reset_at: start.saturating_add(verdict.reset_us),
            expires_at: start.saturating_add(MAX_AGE_US),
        };
        if !known.holds(start) {
            return;
        }
        let mut shard = self
            .shard(&check.key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Under the shard's lock, which a refund's `forget` takes after its bump.
        if self.refunds.load(Ordering::Acquire) != refunds_before {
            return;
        }
        if shard.len() >= self.capacity_per_shard && !shard.contains_key(&check.key) {
            shard.retain(|_, known| known.holds(start));
            if shard.len() >= self.capacity_per_shard {
                // Full of live denials: this one is simply not cached.
                return;
            }
        }
        let entry = shard.entry(check.key.clone()).or_insert(known);
        if entry.params != known.params || !entry.holds(start) {
            *entry = known;
        } else {
            entry.reset_at = entry.reset_at.min(known.reset_at);
            entry.expires_at = entry.expires_at.max(known.expires_at);
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

    async fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<std::time::Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        if self.capacity == 0 {
            return self.inner.decide_by(checks, deadline).await;
        }
        let now = self.clock.now_us();
        let cacheable = cacheable(checks);
        if cacheable.iter().all(|&yes| yes) {
            let known: Option<Vec<Outcome>> = checks
                .iter()
                .map(|check| {
                    self.known_denial(check, now)
                        .map(|verdict| Outcome { verdict })
                })
                .collect();
            if let Some(outcomes) = known {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(outcomes);
            }
        }
        let refunds_before = self.refunds.load(Ordering::Acquire);
        let outcomes = self.inner.decide_by(checks, deadline).await?;
        if checks
            .iter()
            .any(|check| matches!(check.hits, Hits::Refund(_)))
        {
            // After the call, so a denial learned before the refund landed is dropped, and one
            // being learned concurrently sees the bump and is not stored.
            self.refunds.fetch_add(1, Ordering::AcqRel);
            for check in checks {
                if matches!(check.hits, Hits::Refund(_)) {
                    self.forget(&check.key);
                }
            }
            return Ok(outcomes);
        }
        for ((check, outcome), cacheable) in checks.iter().zip(&outcomes).zip(cacheable) {
            let verdict = &outcome.verdict;
            if cacheable && !verdict.allowed && verdict.remaining == 0 {
                self.remember(check, verdict, now, refunds_before);
            }
        }
        Ok(outcomes)
    }
}

/// For each check, whether a denial of it with nothing left stays the same answer until its reset
/// (see the module comment); never for a key the request checks twice (its answer depends on the
/// other check), refunds, or limits whose denial is not a countdown (a zero limit, more hits than
/// the capacity: no time makes them pass).
fn cacheable(checks: &[Check]) -> Vec<bool> {
    checks
        .iter()
        .map(|check| {
            let params = &check.params;
            if params.limit == 0 || checks.iter().filter(|other| other.key == check.key).count() > 1
            {
                return false;
            }
            match check.hits {
                Hits::Peek => true,
                Hits::Take(n) if n > params.capacity() => false,
                Hits::Take(n) => n == 1 || params.algorithm == Algorithm::FixedWindow,
                // Both must reach the store: one gives hits back, the other records them.
                Hits::Refund(_) | Hits::Charge(_) => false,
            }
        })
        .collect()
}
