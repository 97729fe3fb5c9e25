//! How a bucket's limit is split between the Envoys that report it: max-min fair shares of the
//! rate, then each share turned into the token bucket Envoy enforces. Pure functions: every
//! replica that sees the same demands computes the same split.

use crate::algorithm::{Params, Verdict};
use crate::limit::Algorithm;

/// The part of a share handed out as the token bucket's capacity rather than its rate: Envoy
/// starts every new or changed bucket full, so over one report interval an Envoy admits at most
/// `capacity + rate x interval`; a capacity of this part of one interval's share, taken out of
/// the rate, keeps that within its share at any report interval.
pub const BURST_SHARE: f64 = 0.05;

/// How far the held rate may be below the new one and still be kept (a change is a fresh full
/// bucket in Envoy, so small moves are not worth one): with the rate at 95 % of the share, a
/// kept rate is at least 92 % of the share, to a token, so assigned rates stay within 10 % of
/// the shares.
pub const KEEP_BELOW: f64 = 0.03;

/// How far the held rate may be above the new one and still be kept: small, so kept rates never
/// sum to more than the limit by more than this (less [`BURST_SHARE`], which is larger).
pub const KEEP_ABOVE: f64 = 0.02;

/// The share an Envoy needs to be allowed `demand` requests per second: its rate is the share
/// less [`BURST_SHARE`], so an Envoy asking less than the fair level is not held below its
/// demand. Infinite (not known yet) stays infinite.
pub fn share_wanted(demand: f64) -> f64 {
    demand / (1.0 - BURST_SHARE)
}

/// Max-min fair shares of `limit` (requests per second) for `demands` (requests per second each,
/// `f64::INFINITY` for an Envoy whose demand is not known yet): every Envoy gets what it asks
/// for when that is below the fair level, the rest split the remainder equally, and what no one
/// asks for is spread equally over all of them so that it is there when demand grows. The
/// shares sum to `limit` (to rounding) whenever there is at least one demand.
pub fn max_min_shares(limit: f64, demands: &[f64]) -> Vec<f64> {
    let limit = if limit.is_finite() {
        limit.max(0.0)
    } else {
        0.0
    };
    let mut shares = vec![0.0; demands.len()];
    if demands.is_empty() {
        return shares;
    }
    // Ascending demand, ties by position, so the same input always gives the same split.
    let mut order: Vec<usize> = (0..demands.len()).collect();
    let demand = |i: usize| {
        let d = demands[i];
        if d.is_nan() { 0.0 } else { d.max(0.0) }
    };
    order.sort_by(|&a, &b| demand(a).total_cmp(&demand(b)).then(a.cmp(&b)));
    let mut left = limit;
    for (served, &i) in order.iter().enumerate() {
        let level = left / (demands.len() - served) as f64;
        let give = demand(i).min(level);
        shares[i] = give;
        left -= give;
    }
    if left > 0.0 {
        let spare = left / demands.len() as f64;
        for share in &mut shares {
            *share += spare;
        }
    }
    shares
}

/// A token bucket as Envoy is sent it: `tokens_per_fill` every `fill_interval` (whole seconds,
/// fixed at one: Envoy ignores a change of seconds alone), at most `max_tokens` held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Tokens added each `fill_seconds`.
    pub tokens_per_fill: u32,
    /// Envoy's `fill_interval`, whole seconds: fixed for a limit (Envoy ignores a change of the
    /// seconds alone), long enough that a small limit still splits into whole tokens.
    pub fill_seconds: u32,
    /// Capacity, and the burst a new bucket starts with.
    pub max_tokens: u32,
}

/// The token bucket for a share of `share` requests per second, reported every `interval`
/// seconds: [`BURST_SHARE`] of one interval's share as capacity (at least two tokens, or a rate
/// near the arrival rate loses half its requests to rounding), and the share less
/// [`BURST_SHARE`] as the rate, rounded down, so that over one interval a fresh bucket admits no
/// more than the share whatever the interval (to the two-token floor).
pub fn bucket_for(share: f64, fill_seconds: u32, interval: f64) -> Bucket {
    let share = if share.is_finite() {
        share.max(0.0)
    } else {
        0.0
    };
    let interval = if interval.is_finite() {
        interval.max(0.0)
    } else {
        0.0
    };
    let fill_seconds = fill_seconds.max(1);
    // The nudge keeps a whole rate computed through `share_wanted` from rounding to one below.
    let rate = (share * (1.0 - BURST_SHARE) * f64::from(fill_seconds) + 1e-9).floor();
    let capacity = (share * BURST_SHARE * interval).round();
    Bucket {
        tokens_per_fill: clamp_u32(rate),
        fill_seconds,
        max_tokens: clamp_u32(capacity).max(2),
    }
}

/// Tokens a whole limit refills with per fill interval, at least: with fewer, shares of a small
/// limit round down to nothing (60 a minute over four Envoys is 0.25 a second each).
const FILL_TOKENS: f64 = 100.0;
/// The longest fill interval: Envoy's refill is continuous, so a long one only sets the grain.
const MAX_FILL_SECONDS: f64 = 3600.0;

/// The fill interval, in whole seconds, for every token bucket of a limit of `limit` requests
/// per second: 1 s from 100 a second up, longer below, up to an hour.
pub fn fill_seconds_for(limit: f64) -> u32 {
    if !(limit.is_finite() && limit > 0.0) {
        return 1;
    }
    clamp_u32((FILL_TOKENS / limit).ceil().clamp(1.0, MAX_FILL_SECONDS))
}

/// Whether an Envoy holding `held` should keep it rather than be sent `new`: the rates are
/// within [`KEEP_BELOW`] under and [`KEEP_ABOVE`] over the new one.
pub fn keep(held: Bucket, new: Bucket) -> bool {
    let (held_rate, new_rate) = (
        f64::from(held.tokens_per_fill),
        f64::from(new.tokens_per_fill),
    );
    held == new
        || (held.fill_seconds == new.fill_seconds
            && held_rate >= new_rate * (1.0 - KEEP_BELOW)
            && held_rate <= new_rate * (1.0 + KEEP_ABOVE))
}

/// What a budget shared with RLS gives the fleet for the next report interval of `interval`
/// seconds, from each limit's numbers and its counter's answer after the fleet's usage was
/// charged: what the counter has left spread over the time to its reset, never more than the
/// limit's own rate; the tightest limit decides. Returns the rate (requests per second, 0 when
/// nothing is left) and the fill interval of the tightest limit.
pub fn budget_rate(limits: &[(Params, Verdict)], interval: f64) -> (f64, u32) {
    let interval = if interval.is_finite() {
        interval.max(0.001)
    } else {
        1.0
    };
    let mut tightest: Option<(f64, f64)> = None;
    for (params, verdict) in limits {
        let rate = params.limit as f64 / (params.period_us.max(1) as f64 / 1e6);
        let reset = verdict.reset_us as f64 / 1e6;
        let remaining = verdict.remaining as f64;
        let available = match params.algorithm {
            // Refilled continuously: the limit's rate while anything is left, and once in debt
            // what refills after the reset.
            Algorithm::TokenBucket | Algorithm::Gcra if remaining > 0.0 => rate * interval,
            Algorithm::TokenBucket | Algorithm::Gcra => rate * (interval - reset).max(0.0),
            // Windows: what is left spread to the reset; past it, the next window's rate.
            _ if reset >= interval => remaining * interval / reset,
            _ => remaining + rate * (interval - reset),
        };
        let given = (available / interval).clamp(0.0, rate);
        if tightest.is_none_or(|(least, _)| given < least) {
            tightest = Some((given, rate));
        }
    }
    tightest.map_or((0.0, 1), |(given, rate)| (given, fill_seconds_for(rate)))
}

fn clamp_u32(value: f64) -> u32 {
    // `as` saturates, and NaN was ruled out by the callers.
    value as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn uneven_demand_is_split_max_min() {
        // 5/15/30/50 % of 3 x 100: 15 is served whole, the other three split the rest.
        let shares = max_min_shares(100.0, &[15.0, 45.0, 90.0, 150.0]);
        assert!(close(shares[0], 15.0));
        for share in &shares[1..] {
            assert!(close(*share, 85.0 / 3.0), "{shares:?}");
        }
    }

    #[test]
    fn unknown_demand_takes_an_equal_share_and_spare_is_spread() {
        let shares = max_min_shares(100.0, &[f64::INFINITY, f64::INFINITY]);
        assert_eq!(shares, vec![50.0, 50.0]);
        let shares = max_min_shares(100.0, &[10.0, 20.0]);
        assert!(
            close(shares[0], 45.0) && close(shares[1], 55.0),
            "{shares:?}"
        );
        assert!(max_min_shares(100.0, &[]).is_empty());
        assert_eq!(max_min_shares(0.0, &[5.0]), vec![0.0]);
    }

    #[test]
    fn buckets_keep_their_burst_inside_the_share_at_any_interval() {
        for interval in [1.0, 5.0] {
            let bucket = bucket_for(100.0, 1, interval);
            assert_eq!(bucket.tokens_per_fill, 95);
            assert_eq!(f64::from(bucket.max_tokens), 5.0 * interval);
            // A fresh bucket over one interval: its capacity plus its rate, within the share.
            assert!(
                f64::from(bucket.max_tokens) + interval * f64::from(bucket.tokens_per_fill)
                    <= 100.0 * interval
            );
        }
        assert_eq!(bucket_for(0.0, 1, 5.0).max_tokens, 2);
        assert_eq!(bucket_for(10.0, 1, 1.0).max_tokens, 2, "the floor");
        assert_eq!(bucket_for(f64::NAN, 1, 5.0).tokens_per_fill, 0);
        assert_eq!(bucket_for(100.0, 1, f64::NAN).max_tokens, 2);
    }

    #[test]
    fn an_envoy_below_the_fair_level_gets_a_rate_of_its_whole_demand() {
        let wanted: Vec<f64> = [30.0, 300.0].iter().map(|d| share_wanted(*d)).collect();
        let shares = max_min_shares(200.0, &wanted);
        assert_eq!(bucket_for(shares[0], 1, 1.0).tokens_per_fill, 30);
        assert_eq!(bucket_for(shares[1], 1, 1.0).tokens_per_fill, 160);
        assert!(share_wanted(f64::INFINITY).is_infinite());
    }

    #[test]
    fn small_moves_keep_the_held_bucket() {
        let held = bucket_for(100.0, 1, 5.0);
        assert!(keep(held, bucket_for(102.0, 1, 5.0)));
        assert!(keep(held, bucket_for(99.0, 1, 5.0)));
        assert!(keep(held, bucket_for(100.0, 1, 1.0)), "the capacity alone");
        assert!(!keep(held, bucket_for(105.0, 1, 5.0)));
        assert!(!keep(held, bucket_for(90.0, 1, 5.0)));
    }

    proptest! {
        #[test]
        fn shares_never_exceed_the_limit_and_are_max_min_fair(
            limit in 0.0f64..1e6,
            demands in prop::collection::vec(prop_oneof![Just(f64::INFINITY), 0.0f64..1e6], 0..12),
        ) {
            let shares = max_min_shares(limit, &demands);
            let total: f64 = shares.iter().sum();
            prop_assert!(total <= limit * (1.0 + 1e-9) + 1e-9);
            if !demands.is_empty() {
                prop_assert!(close(total, limit), "shares {shares:?} sum {total}, limit {limit}");
            }
            // Max-min: an Envoy that got less than it asked for has no less than anyone else
            // (before the spread of spare, which only happens when everyone is served).
            for (i, share) in shares.iter().enumerate() {
                if *share < demands[i] * (1.0 - 1e-9) - 1e-9 {
                    for other in &shares {
                        prop_assert!(*share >= *other * (1.0 - 1e-9) - 1e-9);
                    }
                }
            }
            // Buckets from shares never sum to more than the limit per second.
            let rates: u64 = shares.iter().map(|s| u64::from(bucket_for(*s, 1, 5.0).tokens_per_fill)).sum();
            prop_assert!(rates as f64 <= limit + 1e-6);
        }
    }

    #[test]
    fn a_small_limit_splits_into_whole_tokens_over_a_longer_fill_interval() {
        // 60 a minute over four Envoys: a quarter of a request a second each.
        let fill = fill_seconds_for(1.0);
        assert_eq!(fill, 100);
        let bucket = bucket_for(0.25, fill, 5.0);
        assert_eq!(bucket.tokens_per_fill, 23, "0.95 x 0.25 x 100");
        let rate = f64::from(bucket.tokens_per_fill) / f64::from(bucket.fill_seconds);
        assert!(rate > 0.2 && rate <= 0.25, "{rate}");
        assert_eq!(fill_seconds_for(200.0), 1);
        assert_eq!(fill_seconds_for(1.0 / 3600.0), 3600);
        assert_eq!(fill_seconds_for(0.0), 1);
        assert!(
            !keep(bucket_for(0.25, 100, 5.0), bucket_for(0.25, 1, 5.0)),
            "another interval is a change"
        );
    }

    fn params(algorithm: Algorithm, limit: u64, period_s: u64) -> Params {
        Params {
            algorithm,
            limit,
            period_us: period_s * 1_000_000,
            burst: limit,
        }
    }

    fn verdict(remaining: u64, reset_s: f64) -> Verdict {
        Verdict {
            allowed: remaining > 0,
            remaining,
            reset_us: (reset_s * 1e6) as u64,
        }
    }

    #[test]
    fn a_shared_budget_spreads_what_is_left_to_the_reset() {
        let window = params(Algorithm::FixedWindow, 600, 60);
        // Half the minute's 600 used with 50 s to go: 300 over 50 s.
        let (rate, fill) = budget_rate(&[(window, verdict(300, 50.0))], 5.0);
        assert!(close(rate, 6.0), "{rate}");
        assert_eq!(fill, fill_seconds_for(10.0));
        // A fresh window: the limit's own rate, never more.
        assert!(close(
            budget_rate(&[(window, verdict(600, 60.0))], 5.0).0,
            10.0
        ));
        assert!(close(
            budget_rate(&[(window, verdict(100, 1.0))], 5.0).0,
            10.0
        ));
        // Nothing left, reset in 2 s of a 5 s interval: the next window's rate for 3 s of 5.
        assert!(close(budget_rate(&[(window, verdict(0, 2.0))], 5.0).0, 6.0));
        assert!(close(
            budget_rate(&[(window, verdict(0, 30.0))], 5.0).0,
            0.0
        ));
        // A token bucket in debt for 4 s of 5: a fifth of its rate; with tokens, all of it.
        let bucket = params(Algorithm::TokenBucket, 100, 1);
        assert!(close(
            budget_rate(&[(bucket, verdict(0, 4.0))], 5.0).0,
            20.0
        ));
        assert!(close(
            budget_rate(&[(bucket, verdict(3, 0.5))], 5.0).0,
            100.0
        ));
        // The tightest limit decides; a zero limit gives nothing.
        let both = [(bucket, verdict(3, 0.5)), (window, verdict(300, 50.0))];
        assert!(close(budget_rate(&both, 5.0).0, 6.0));
        let zero = params(Algorithm::FixedWindow, 0, 1);
        assert!(close(budget_rate(&[(zero, verdict(0, 1.0))], 5.0).0, 0.0));
    }
}
