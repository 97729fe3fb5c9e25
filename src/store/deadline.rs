//! Deadlines on Redis's clock: a script call carries, for each request, the instant on Redis's own
//! clock after which its caller will have stopped waiting, and the script writes nothing for a
//! request it reaches later. A call that timed out on rlsd's side then leaves no trace.
//!
//! rlsd learns how Redis's clock relates to its own from every script reply (the script answers
//! with the `TIME` it read): a reply received at local instant `t1` that carries Redis time `r`
//! was read at or before `t1`, so `r - t1` is a lower bound of the offset. Deadlines use the
//! largest bound seen, lowered by 1 ms per second since it was seen, so a Redis clock that steps
//! back cannot make a deadline later than the truth for more than a moment, while fresh replies
//! keep the bound tight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::clock::Clock;

/// How fast an old offset bound loses trust: 1 µs per ms, 1 ms per second.
const DECAY_DIVISOR: u64 = 1_000;

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
        let deadline = deadline
            .unwrap_or(started + default)
            .min(started + cap)
            .max(started);
        let margin = (deadline.saturating_duration_since(started) / REPLY_MARGIN_DIVISOR)
            .max(MIN_REPLY_MARGIN);
        Budget {
            started,
            deadline,
            script_deadline: deadline.checked_sub(margin).unwrap_or(started),
        }
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

/// What rlsd knows of Redis's clock, per source: one for a single server, one per hash slot for
/// a cluster (its nodes' clocks may differ).
pub(super) struct RedisClock {
    epoch: Instant,
    bounds: Mutex<HashMap<u64, Bound>>,
    /// Tests: the clock whose reading is passed to the script instead of Redis `TIME`.
    fixed: Option<Arc<dyn Clock>>,
}

#[derive(Clone, Copy)]
struct Bound {
    /// Redis µs minus local µs (since `epoch`), at most.
    offset_us: i64,
    /// Local µs when it was learned.
    learned_us: u64,
}

impl Bound {
    fn at(self, local_us: u64) -> i64 {
        let age = local_us.saturating_sub(self.learned_us) / DECAY_DIVISOR;
        self.offset_us
            .saturating_sub(i64::try_from(age).unwrap_or(i64::MAX))
    }
}

impl RedisClock {
    /// A clock that knows nothing yet; with `fixed`, the script runs on that clock instead.
    pub(super) fn new(fixed: Option<Arc<dyn Clock>>) -> RedisClock {
        RedisClock {
            epoch: Instant::now(),
            bounds: Mutex::new(HashMap::new()),
            fixed,
        }
    }

    fn local_us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_micros()).unwrap_or(u64::MAX)
    }

    /// Learns from a reply of `source` received at `received` that carried Redis time `redis_us`.
    pub(super) fn observe(&self, source: u64, redis_us: u64, received: Instant) {
        if self.fixed.is_some() {
            return;
        }
        let local = self.local_us(received);
        let sample = i64::try_from(redis_us)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(local).unwrap_or(i64::MAX));
        let mut bounds = self.bounds.lock().unwrap_or_else(PoisonError::into_inner);
        let learned = Bound {
            offset_us: sample,
            learned_us: local,
        };
        let bound = bounds.entry(source).or_insert(learned);
        if sample >= bound.at(local) {
            *bound = learned;
        }
    }

    /// `at` on `source`'s Redis clock, never later than the truth; `None` before anything was
    /// learned from it.
    pub(super) fn redis_us(&self, source: u64, at: Instant) -> Option<u64> {
        let now = Instant::now();
        if let Some(fixed) = &self.fixed {
            let ahead = at.saturating_duration_since(now).as_micros();
            let ahead = u64::try_from(ahead).unwrap_or(u64::MAX);
            let behind =
                u64::try_from(now.saturating_duration_since(at).as_micros()).unwrap_or(u64::MAX);
            return Some(fixed.now_us().saturating_add(ahead).saturating_sub(behind));
        }
        let bound = self
            .bounds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&source)
            .copied();
        let offset = bound?.at(self.local_us(now));
        let local = i64::try_from(self.local_us(at)).unwrap_or(i64::MAX);
        u64::try_from(local.saturating_add(offset)).ok()
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
    fn the_offset_is_the_tightest_lower_bound_and_decays() {
        let clock = RedisClock::new(None);
        let received = Instant::now();
        assert_eq!(clock.redis_us(0, received), None);
        let local = clock.local_us(received);
        // A reply carrying Redis time local + 5 s: Redis is at least 5 s ahead.
        clock.observe(0, local + 5_000_000, received);
        // A slower reply (read earlier than it arrived) gives a lower bound: ignored.
        clock.observe(0, local + 4_000_000, received);
        let at = clock.redis_us(0, received).expect("known");
        assert!(
            (local + 5_000_000 - 1_000..=local + 5_000_000).contains(&at),
            "{at} vs {}",
            local + 5_000_000
        );
        // Another source knows nothing yet.
        let cluster = RedisClock::new(None);
        cluster.observe(0, local, received);
        assert_eq!(cluster.redis_us(1, received), None);
    }
}
