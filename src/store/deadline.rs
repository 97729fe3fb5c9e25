//! Deadlines on Redis's clock: a script call carries, for each request, the instant on Redis's own
//! clock after which its caller will have stopped waiting, and the script writes nothing for a
//! request it reaches later. A call that timed out on rlsd's side then leaves no trace.
//!
//! rlsd learns how Redis's clock relates to its own from every script reply (the script answers
//! with the `TIME` it read): a reply received at local instant `t1` that carries Redis time `r`
//! was read at or before `t1`, so `r - t1` is a lower bound of the offset, and deadlines built
//! on it are never later than the truth. The tightest bound of the last second is kept; one older
//! than [`FRESH_FOR_US`] (after a quiet spell) is read again with `TIME` before it is used, so a
//! Redis clock that stepped meanwhile is seen. Nodes of a Redis Cluster are taken to share one
//! clock (NTP keeps them within a millisecond or so); an answer that comes too late anyway has its
//! hits given back (see the Redis store).
//!
//! A call still in flight when its caller stops waiting is awaited in the background, for at
//! most the timeout cap, and [`LateCalls`] bounds how many requests such calls carry at once.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::clock::Clock;

/// How long a learned offset is used before it is read again.
const FRESH_FOR_US: u64 = 10_000_000;

/// How long the tightest offset is kept before any newer reply replaces it.
const TIGHTEST_FOR_US: u64 = 1_000_000;

/// Longer than any wait: what a timeout too large for the clock means.
const YEAR: Duration = Duration::from_secs(365 * 86_400);

/// The least a request keeps for its reply to travel back after the script ran.
const MIN_REPLY_MARGIN: Duration = Duration::from_millis(1);

/// The share of a request's budget kept for the reply's way back: the script must run within
/// the first three quarters.
const REPLY_MARGIN_DIVISOR: u32 = 4;

/// What one store call may take, from its start and its caller's deadline.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// When the call started.
    pub started: Instant,
    /// When the caller stops waiting for the store.
    pub deadline: Instant,
    /// The last instant at which the script may still decide the request and have its answer
    /// back in time.
    pub script_deadline: Instant,
}

impl Budget {
    /// The budget of a call starting at `started`: until the caller's `deadline` (`None`: the
    /// store's `default` timeout), never longer than `cap`.
    pub fn new(
        started: Instant,
        deadline: Option<Instant>,
        default: Duration,
        cap: Duration,
    ) -> Budget {
        let wait = match deadline {
            Some(deadline) => deadline.saturating_duration_since(started),
            None => default,
        }
        .min(cap);
        let margin = (wait / REPLY_MARGIN_DIVISOR).max(MIN_REPLY_MARGIN);
        // Saturating: a timeout flag of any size must not overflow the clock.
        let after = |wait: Duration| started.checked_add(wait).unwrap_or(started + YEAR);
        Budget {
            started,
            deadline: after(wait),
            script_deadline: after(wait.saturating_sub(margin)),
        }
    }

    /// The budget of a call starting now; see [`Budget::new`].
    pub fn from_now(deadline: Option<Instant>, default: Duration, cap: Duration) -> Budget {
        Budget::new(Instant::now(), deadline, default, cap)
    }

    /// The whole wait this budget allows.
    pub fn total(&self) -> Duration {
        self.deadline.saturating_duration_since(self.started)
    }

    /// The error of a call that ran out of this budget.
    pub fn exceeded(&self) -> super::StoreError {
        super::StoreError::Timeout(self.total())
    }
}

/// Default bound on requests whose calls are awaited after their callers stopped waiting, per
/// serving lane (per store on a Cluster).
pub const DEFAULT_MAX_LATE_REQUESTS: usize = 1_000;

/// Requests whose calls are still awaited after their callers stopped waiting (to give back
/// what a late reply committed), held to a bound: past it a call is let go, and what it
/// commits stays counted.
pub(super) struct LateCalls {
    held: AtomicUsize,
    let_go: AtomicU64,
    bound: usize,
}

/// Room for some requests among the [`LateCalls`], given back when dropped.
pub(super) struct LateHold {
    calls: Arc<LateCalls>,
    requests: usize,
}

impl LateCalls {
    /// Room for at most `bound` requests at once.
    pub(super) fn new(bound: usize) -> Arc<LateCalls> {
        Arc::new(LateCalls {
            held: AtomicUsize::new(0),
            let_go: AtomicU64::new(0),
            bound,
        })
    }

    /// Room for `requests` more, or `None` (and they are counted as let go) past the bound.
    pub(super) fn hold(self: &Arc<Self>, requests: usize) -> Option<LateHold> {
        let room = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(requests)
                    .filter(|&total| total <= self.bound)
            });
        match room {
            Ok(_) => Some(LateHold {
                calls: Arc::clone(self),
                requests,
            }),
            Err(_) => {
                self.let_go.fetch_add(
                    u64::try_from(requests).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                None
            }
        }
    }

    /// Requests awaited now.
    pub(super) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Requests let go past the bound since start.
    pub(super) fn let_go(&self) -> u64 {
        self.let_go.load(Ordering::Relaxed)
    }
}

impl Drop for LateHold {
    fn drop(&mut self) {
        self.calls.held.fetch_sub(self.requests, Ordering::AcqRel);
    }
}

/// What rlsd knows of Redis's clock.
pub(super) struct RedisClock {
    epoch: Instant,
    bound: Mutex<Option<Bound>>,
    /// Tests: the clock whose reading is passed to the script instead of Redis `TIME`.
    fixed: Option<Arc<dyn Clock>>,
}

#[derive(Clone, Copy)]
struct Bound {
    /// Redis µs minus local µs (since `epoch`), at most.
    offset_us: i64,
    /// Local µs when it was learned.
    learned_us: u64,
    /// When it is to be read again ([`FRESH_FOR_US`] after it was learned).
    stale_at: Instant,
}

impl RedisClock {
    /// A clock that knows nothing yet; with `fixed`, the script runs on that clock instead.
    pub(super) fn new(fixed: Option<Arc<dyn Clock>>) -> RedisClock {
        RedisClock {
            epoch: Instant::now(),
            bound: Mutex::new(None),
            fixed,
        }
    }

    fn local_us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }

    /// Learns from a reply received at `received` that carried Redis time `redis_us`.
    pub(super) fn observe(&self, redis_us: u64, received: Instant) {
        if self.fixed.is_some() {
            return;
        }
        let local = self.local_us(received);
        let sample = i64::try_from(redis_us)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(local).unwrap_or(i64::MAX));
        let mut bound = self.bound.lock().unwrap_or_else(PoisonError::into_inner);
        let replace = bound.is_none_or(|known| {
            sample >= known.offset_us || local.saturating_sub(known.learned_us) >= TIGHTEST_FOR_US
        });
        if replace {
            *bound = Some(Bound {
                offset_us: sample,
                learned_us: local,
                stale_at: received
                    .checked_add(Duration::from_micros(FRESH_FOR_US))
                    .unwrap_or(received),
            });
        }
    }

    /// `at` on Redis's clock, never later than the truth; `None` before anything was learned,
    /// or when what was learned is too old to trust.
    pub(super) fn redis_us(&self, at: Instant) -> Option<u64> {
        self.redis_us_as_of(at, Instant::now())
    }

    /// [`RedisClock::redis_us`] for a caller that read the local clock at `now` an instant ago
    /// (a clock read saved per request).
    pub(super) fn redis_us_as_of(&self, at: Instant, now: Instant) -> Option<u64> {
        if let Some(fixed) = &self.fixed {
            let ahead = at.saturating_duration_since(now).as_micros();
            let ahead = u64::try_from(ahead).unwrap_or(u64::MAX);
            let behind =
                u64::try_from(now.saturating_duration_since(at).as_micros()).unwrap_or(u64::MAX);
            return Some(fixed.now_us().saturating_add(ahead).saturating_sub(behind));
        }
        let bound = (*self.bound.lock().unwrap_or_else(PoisonError::into_inner))?;
        if now >= bound.stale_at {
            return None;
        }
        let local = i64::try_from(self.local_us(at)).unwrap_or(i64::MAX);
        u64::try_from(local.saturating_add(bound.offset_us)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_keeps_a_quarter_for_the_reply_and_never_exceeds_the_cap() {
        let start = Instant::now();
        let ms = Duration::from_millis;
        let b = Budget::new(start, Some(start + ms(20)), ms(5), ms(1000));
        assert_eq!(b.deadline, start + ms(20));
        assert_eq!(b.script_deadline, start + ms(15));
        let b = Budget::new(start, None, ms(8), ms(1000));
        assert_eq!(
            (b.deadline, b.script_deadline),
            (start + ms(8), start + ms(6))
        );
        let b = Budget::new(start, Some(start + ms(3_600_000)), ms(8), ms(1000));
        assert_eq!(b.deadline, start + ms(1000));
        let b = Budget::new(start, Some(start + ms(2)), ms(8), ms(1000));
        assert_eq!(
            b.script_deadline,
            start + ms(1),
            "at least 1 ms for the reply"
        );
    }

    #[test]
    fn late_calls_hold_at_most_their_bound_and_count_what_they_let_go() {
        let late = LateCalls::new(5);
        let first = late.hold(3).expect("room for 3");
        assert!(late.hold(3).is_none(), "3 more would pass 5");
        let second = late.hold(2).expect("room for 2 more");
        assert!(late.hold(1).is_none());
        assert_eq!((late.held(), late.let_go()), (5, 4));
        drop(first);
        assert_eq!(late.held(), 2);
        drop(second);
        assert_eq!(late.held(), 0);
        assert!(late.hold(6).is_none(), "never more than the bound at once");
        assert_eq!(late.let_go(), 10);
    }

    #[test]
    fn the_offset_is_the_tightest_lower_bound() {
        let clock = RedisClock::new(None);
        let received = Instant::now();
        assert_eq!(clock.redis_us(received), None);
        let local = clock.local_us(received);
        // A reply carrying Redis time local + 5 s: Redis is at least 5 s ahead.
        clock.observe(local + 5_000_000, received);
        // A slower reply (read earlier than it arrived) gives a lower bound: ignored.
        clock.observe(local + 4_000_000, received);
        assert_eq!(clock.redis_us(received), Some(local + 5_000_000));
        // One learned long ago is not trusted: it is read again.
        let Some(long_ago) = received.checked_sub(Duration::from_micros(FRESH_FOR_US + 1)) else {
            return;
        };
        let stale = RedisClock {
            epoch: long_ago,
            ..RedisClock::new(None)
        };
        stale.observe(5_000_000, long_ago);
        assert_eq!(stale.redis_us(Instant::now()), None);
    }
}
