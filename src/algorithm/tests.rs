//! Each algorithm against the worked semantics of `docs/algorithms.md`, on a fake clock.

use super::*;

const MS: u64 = 1_000;
const S: u64 = 1_000_000;

/// One key driven through a sequence of requests, committing what is allowed.
struct Key {
    params: Params,
    state: Option<State>,
}

impl Key {
    fn new(algorithm: Algorithm, limit: u64, period_us: u64, burst: u64) -> Key {
        Key {
            params: Params {
                algorithm,
                limit,
                period_us,
                burst,
            },
            state: None,
        }
    }

    fn hit(&mut self, now: u64, hits: Hits) -> Verdict {
        let assessment = assess(&self.params, self.state.as_ref(), now, hits);
        if assessment.verdict.allowed
            && let Some(update) = assessment.update
        {
            self.state = Some(update.state);
        }
        assessment.verdict
    }

    fn take(&mut self, now: u64) -> Verdict {
        self.hit(now, Hits::Take(1))
    }

    fn allowed_count(&mut self, now: u64, tries: u64) -> u64 {
        (0..tries).filter(|_| self.take(now).allowed).count() as u64
    }
}

fn all_algorithms(limit: u64, period_us: u64) -> Vec<Key> {
    Algorithm::ALL
        .into_iter()
        // Burst = L everywhere, so every algorithm holds the same L hits at once.
        .map(|algorithm| Key::new(algorithm, limit, period_us, limit))
        .collect()
}

#[test]
fn gcra_worked_example_even_spacing() {
    let mut key = Key::new(Algorithm::Gcra, 10, S, 1);
    let first = key.take(0);
    assert!(first.allowed);
    assert_eq!(first.reset_us, 100 * MS);
    let early = key.take(50 * MS);
    assert!(!early.allowed);
    assert_eq!(early.reset_us, 50 * MS);
    assert_eq!(early.remaining, 0);
    assert!(key.take(100 * MS).allowed);
}

#[test]
fn gcra_worked_example_burst_of_five() {
    let mut key = Key::new(Algorithm::Gcra, 10, S, 5);
    let passes: Vec<bool> = (0..6).map(|_| key.take(0).allowed).collect();
    assert_eq!(passes, [true, true, true, true, true, false]);
    // One emission interval later exactly one more fits.
    assert!(key.take(100 * MS).allowed);
    assert!(!key.take(100 * MS).allowed);
}

#[test]
fn gcra_remaining_counts_down_the_burst() {
    let mut key = Key::new(Algorithm::Gcra, 10, S, 5);
    let remaining: Vec<u64> = (0..5).map(|_| key.take(0).remaining).collect();
    assert_eq!(remaining, [4, 3, 2, 1, 0]);
}

#[test]
fn fixed_window_allows_two_limits_across_an_edge() {
    let mut key = Key::new(Algorithm::FixedWindow, 10, 60 * S, 10);
    // Ten just before the minute turns, ten just after: 20 within two milliseconds.
    assert_eq!(key.allowed_count(60 * S - MS, 11), 10);
    assert_eq!(key.allowed_count(60 * S + MS, 11), 10);
}

#[test]
fn fixed_window_counts_remaining_and_reset() {
    let mut key = Key::new(Algorithm::FixedWindow, 3, 60 * S, 3);
    let v = key.take(15 * S);
    assert_eq!((v.allowed, v.remaining, v.reset_us), (true, 2, 45 * S));
    key.take(16 * S);
    key.take(17 * S);
    let denied = key.take(18 * S);
    assert_eq!(
        (denied.allowed, denied.remaining, denied.reset_us),
        (false, 0, 42 * S)
    );
    assert!(key.take(60 * S).allowed);
}

#[test]
fn sliding_log_is_exact() {
    let mut key = Key::new(Algorithm::SlidingWindowLog, 3, 10 * S, 3);
    for t in [0, S, 2 * S] {
        assert!(key.take(t).allowed);
    }
    let denied = key.take(3 * S);
    assert!(!denied.allowed);
    // The oldest member (t = 0) leaves at 10 s: seven seconds from now.
    assert_eq!(denied.reset_us, 7 * S);
    assert!(!key.take(10 * S - 1).allowed);
    assert!(key.take(10 * S).allowed);
    // At 10 s the window holds 1 s, 2 s and 10 s: full again.
    assert!(!key.take(10 * S).allowed);
    // No sliding window ever holds more than L.
    let mut log = Key::new(Algorithm::SlidingWindowLog, 5, S, 5);
    let mut allowed_at = Vec::new();
    for t in (0..40).map(|i| i * 77 * MS) {
        if log.take(t).allowed {
            allowed_at.push(t);
        }
    }
    for (i, start) in allowed_at.iter().enumerate() {
        let within = allowed_at[i..]
            .iter()
            .take_while(|t| **t < start + S)
            .count();
        assert!(within <= 5, "{within} hits within a second from {start}");
    }
}

#[test]
fn sliding_log_denied_reset_waits_for_enough_members_to_leave() {
    let mut key = Key::new(Algorithm::SlidingWindowLog, 4, 10 * S, 4);
    for t in [0, S, 2 * S, 3 * S] {
        assert!(key.take(t).allowed);
    }
    // Three hits need the three oldest (0, 1 s, 2 s) to leave: at 12 s.
    let denied = key.hit(5 * S, Hits::Take(3));
    assert!(!denied.allowed);
    assert_eq!(denied.reset_us, 7 * S);
    assert!(key.hit(12 * S, Hits::Take(3)).allowed);
}

#[test]
fn sliding_counter_weights_the_previous_window() {
    let mut key = Key::new(Algorithm::SlidingWindowCounter, 10, 60 * S, 10);
    assert_eq!(key.allowed_count(30 * S, 10), 10);
    // 15 s into the next window the previous one weighs 0.75: estimate 7.5, so 2 more pass.
    assert_eq!(key.allowed_count(75 * S, 5), 2);
    let denied = key.take(75 * S);
    assert!(!denied.allowed);
    assert_eq!(denied.remaining, 0);
    // estimate = 10 * (1 - f) + 2 <= 9 needs f >= 0.3: at 78 s, three seconds away.
    assert_eq!(denied.reset_us, 3 * S);
    assert!(!key.take(78 * S - MS).allowed);
    assert!(key.take(78 * S).allowed);
}

#[test]
fn token_bucket_refills_continuously() {
    let mut key = Key::new(Algorithm::TokenBucket, 10, S, 5);
    assert_eq!(key.allowed_count(0, 6), 5);
    let denied = key.take(0);
    assert_eq!((denied.allowed, denied.remaining), (false, 0));
    assert_eq!(denied.reset_us, 100 * MS);
    // 250 ms later, 2.5 tokens are back.
    let v = key.take(250 * MS);
    assert_eq!((v.allowed, v.remaining), (true, 1));
    assert_eq!(v.reset_us, 350 * MS);
    assert!(key.take(250 * MS).allowed);
    assert!(!key.take(250 * MS).allowed);
    // A long pause never gives more than the capacity.
    assert_eq!(key.allowed_count(100 * S, 10), 5);
}

#[test]
fn multiple_hits_are_taken_together_or_not_at_all() {
    for mut key in all_algorithms(10, 60 * S) {
        let name = key.params.algorithm;
        let v = key.hit(0, Hits::Take(7));
        assert!(v.allowed, "{name}");
        assert_eq!(v.remaining, 3, "{name}");
        let denied = key.hit(0, Hits::Take(4));
        assert!(!denied.allowed, "{name}");
        assert_eq!(
            denied.remaining, 3,
            "{name}: a denied request takes nothing"
        );
        assert!(key.hit(0, Hits::Take(3)).allowed, "{name}");
        assert!(!key.take(0).allowed, "{name}");
    }
}

#[test]
fn more_hits_than_capacity_never_pass() {
    for mut key in all_algorithms(10, 60 * S) {
        let name = key.params.algorithm;
        let v = key.hit(0, Hits::Take(11));
        assert!(!v.allowed, "{name}");
        assert_eq!(v.remaining, 10, "{name}: nothing consumed");
        assert!(v.reset_us > 0, "{name}");
        assert_eq!(key.allowed_count(0, 20), 10, "{name}");
    }
}

#[test]
fn zero_hits_is_a_pure_check() {
    for mut key in all_algorithms(2, 60 * S) {
        let name = key.params.algorithm;
        for _ in 0..5 {
            let v = key.hit(0, Hits::Peek);
            assert!(v.allowed, "{name}");
            assert_eq!(v.remaining, 2, "{name}: a peek consumes nothing");
        }
        assert_eq!(key.allowed_count(0, 2), 2, "{name}");
        let v = key.hit(0, Hits::Peek);
        assert!(
            !v.allowed,
            "{name}: a client at its limit is told OVER_LIMIT"
        );
        assert_eq!(v.remaining, 0, "{name}");
    }
}

#[test]
fn refunds_give_hits_back_but_never_beyond_fresh() {
    for mut key in all_algorithms(5, 60 * S) {
        let name = key.params.algorithm;
        assert_eq!(key.allowed_count(0, 5), 5, "{name}");
        let v = key.hit(0, Hits::Refund(2));
        assert!(v.allowed, "{name}");
        assert_eq!(v.remaining, 2, "{name}");
        assert_eq!(key.allowed_count(0, 5), 2, "{name}");
        key.hit(0, Hits::Refund(100));
        assert_eq!(
            key.allowed_count(0, 10),
            5,
            "{name}: refunds never exceed a fresh state"
        );
    }
}

#[test]
fn zero_limit_denies_everything() {
    for mut key in all_algorithms(0, 60 * S) {
        let v = key.take(0);
        assert!(!v.allowed, "{}", key.params.algorithm);
        assert_eq!(v.remaining, 0);
        assert!(key.state.is_none(), "L = 0 never touches state");
        // 10.5 s into a minute: a fixed window ends in 49.5 s, the others say a period.
        let v = key.take(70 * S + S / 2);
        let never = match key.params.algorithm {
            Algorithm::FixedWindow => 49 * S + S / 2,
            _ => 60 * S,
        };
        assert_eq!(v.reset_us, never, "{}", key.params.algorithm);
    }
}

#[test]
fn a_clock_stepping_back_never_grants_anything() {
    for mut key in all_algorithms(5, 60 * S) {
        let name = key.params.algorithm;
        let at = 130 * S;
        assert_eq!(key.allowed_count(at, 5), 5, "{name}");
        // Back by a whole window and then some: still exhausted.
        for back in [S, 60 * S, 90 * S] {
            assert!(!key.take(at - back).allowed, "{name} at -{back}us");
        }
    }
}

#[test]
fn reset_is_rounded_up_to_a_millisecond() {
    let mut key = Key::new(Algorithm::FixedWindow, 5, S, 5);
    let v = key.take(1);
    assert_eq!(v.reset_us, S);
    let mut key = Key::new(Algorithm::Gcra, 3, S, 1);
    // T = 333_333 us, reported as 334 ms.
    assert_eq!(key.take(0).reset_us, 334 * MS);
}

#[test]
fn unconsumed_remaining_is_what_is_left_without_this_request() {
    let params = Params {
        algorithm: Algorithm::FixedWindow,
        limit: 10,
        period_us: 60 * S,
        burst: 10,
    };
    let a = assess(&params, None, 0, Hits::Take(3));
    assert_eq!((a.verdict.remaining, a.unconsumed_remaining), (7, 10));
}
