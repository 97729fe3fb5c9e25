//! The arithmetic of each algorithm, as pure functions of `(state, now, params, hits)`.
//!
//! Exactly `docs/algorithms.md`. Every store runs these (the Lua scripts mirror them), so the
//! float operations are written in the order the scripts use, to give bit-identical answers.

use std::collections::VecDeque;

use crate::limit::{Algorithm, Limit, MICROS_PER_SECOND};

/// Extra life a key gets past the moment its state stops mattering.
const EXPIRY_SLACK_US: u64 = MICROS_PER_SECOND;

/// The most debt a charge leaves a token bucket or GCRA: ten years to drain, the longest period
/// a limit may have, which keeps every sum exact in Lua's doubles.
const MAX_DEBT_US: u64 = 10 * 365 * 86_400 * MICROS_PER_SECOND;

/// The numbers one check is decided with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Which algorithm.
    pub algorithm: Algorithm,
    /// L: requests per period.
    pub limit: u64,
    /// P in microseconds (never 0).
    pub period_us: u64,
    /// B: token bucket capacity or GCRA burst; equal to L for the window algorithms.
    pub burst: u64,
}

impl Params {
    /// The parameters of a configured limit.
    pub fn of(limit: &Limit) -> Params {
        Params {
            algorithm: limit.algorithm,
            limit: u64::from(limit.requests_per_unit),
            period_us: limit.period.micros().max(1),
            burst: u64::from(limit.effective_burst()),
        }
    }

    /// The most one request can ever take: L for windows, B for token bucket and GCRA.
    pub fn capacity(&self) -> u64 {
        if self.algorithm.takes_burst() {
            self.burst
        } else {
            self.limit
        }
    }

    /// GCRA emission interval T = P / L in whole microseconds (at least 1).
    fn emission_interval(&self) -> u64 {
        (self.period_us / self.limit.max(1)).max(1)
    }
}

/// How many hits a check asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hits {
    /// Take `n` hits (n >= 1).
    Take(u64),
    /// A pure check (`hits_addend: 0`): decided as one hit, nothing committed.
    Peek,
    /// `is_negative_hits`: give `n` hits back, never beyond a fresh state.
    Refund(u64),
    /// A charge for work already done (a response's cost): decided as taking `n`, and recorded
    /// whatever the answer, past the limit if need be (a token bucket or GCRA carries the excess
    /// as debt), so the next requests are denied until it drains.
    Charge(u64),
}

/// Stored state of one key.
#[derive(Clone, Debug, PartialEq)]
pub enum State {
    /// Fixed window: hits counted in `window` (= floor(now / P)).
    Window {
        /// Window index.
        window: u64,
        /// Hits counted.
        count: u64,
    },
    /// Sliding window log: allowed hits as `(timestamp, how many)`, oldest first.
    Log {
        /// Timestamps in ascending order, each with the hits taken at that instant.
        entries: VecDeque<(u64, u64)>,
    },
    /// Sliding window counter: the current window's and the previous window's counts.
    Sliding {
        /// Index of the current window.
        window: u64,
        /// Hits in `window`.
        current: u64,
        /// Hits in `window - 1`.
        previous: u64,
    },
    /// Token bucket: tokens left at `updated`.
    Bucket {
        /// Tokens (fractional while refilling).
        tokens: f64,
        /// When `tokens` was computed (never moves back).
        updated: u64,
    },
    /// GCRA: the theoretical arrival time.
    Gcra {
        /// TAT in microseconds.
        tat: u64,
    },
}

/// What one check answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether this limit lets the request through.
    pub allowed: bool,
    /// Single hits that would still pass right now, after this request.
    pub remaining: u64,
    /// Allowed: until the limit is fully available. Denied: until this request would pass.
    /// Rounded up to a whole millisecond.
    pub reset_us: u64,
}

/// A check's evaluation: the verdict, and what to store if the whole request is allowed.
#[derive(Clone, Debug, PartialEq)]
pub struct Assessment {
    /// The answer if the request goes through.
    pub verdict: Verdict,
    /// `remaining` to report when another limit denies the request and nothing is consumed.
    pub unconsumed_remaining: u64,
    /// New state and its time to live; `None` when nothing changes.
    pub update: Option<Update>,
}

/// State to store for a key, and how long it stays relevant.
#[derive(Clone, Debug, PartialEq)]
pub struct Update {
    /// The new state.
    pub state: State,
    /// Time to live from `now`, in microseconds.
    pub ttl_us: u64,
}

/// Rounds a duration up to the next whole millisecond, as `duration_until_reset` reports it.
pub fn round_up_to_ms(us: u64) -> u64 {
    us.div_ceil(1_000) * 1_000
}

/// Decides one check against the key's current `state` (`None`: fresh or expired) at `now`.
pub fn assess(params: &Params, state: Option<&State>, now: u64, hits: Hits) -> Assessment {
    if params.limit == 0 {
        // L = 0 denies everything and never touches the store.
        let verdict = Verdict {
            allowed: matches!(hits, Hits::Refund(_)),
            remaining: 0,
            reset_us: round_up_to_ms(never_reset_us(params, now)),
        };
        return Assessment {
            verdict,
            unconsumed_remaining: 0,
            update: None,
        };
    }
    match hits {
        Hits::Take(n) if n > params.capacity() => impossible(params, state, now),
        Hits::Take(n) => run(params, state, now, n, n),
        Hits::Peek => run(params, state, now, 1, 0),
        Hits::Refund(n) => refund(params, state, now, n),
        Hits::Charge(n) => charge(params, state, now, n),
    }
}

/// The reset of a request that never passes (`L = 0`, or more hits than the capacity): there is
/// no time at which it would. A fixed window reports its end, as it does for every answer (and as
/// envoyproxy/ratelimit does); the others one period, when any state has certainly drained.
fn never_reset_us(params: &Params, now: u64) -> u64 {
    match params.algorithm {
        Algorithm::FixedWindow => params.period_us - now % params.period_us,
        _ => params.period_us,
    }
}

/// A request larger than the capacity never passes; see [`never_reset_us`].
fn impossible(params: &Params, state: Option<&State>, now: u64) -> Assessment {
    let idle = run(params, state, now, 0, 0).verdict;
    Assessment {
        verdict: Verdict {
            allowed: false,
            remaining: idle.remaining,
            reset_us: round_up_to_ms(never_reset_us(params, now)),
        },
        unconsumed_remaining: idle.remaining,
        update: None,
    }
}

/// Evaluates asking for `want` hits and, if allowed, taking `take` (`take <= want`).
fn run(params: &Params, state: Option<&State>, now: u64, want: u64, take: u64) -> Assessment {
    decide(params, state, now, want, take, false)
}

/// Takes `n` whatever the answer, and the state with them taken. One that fits answers as a take;
/// one recorded past the limit answers the state it leaves (nothing remaining, the reset a check
/// right after it reports), since the hits were taken all the same.
fn charge(params: &Params, state: Option<&State>, now: u64, n: u64) -> Assessment {
    let mut assessment = decide(params, state, now, n, n, true);
    if n > params.capacity() {
        assessment.unconsumed_remaining = impossible(params, state, now).unconsumed_remaining;
    } else if assessment.verdict.allowed {
        return assessment;
    }
    let after = assessment
        .update
        .as_ref()
        .map_or(state, |update| Some(&update.state));
    let next = run(params, after, now, 1, 0).verdict;
    assessment.verdict = Verdict {
        allowed: false,
        remaining: 0,
        reset_us: next.reset_us,
    };
    assessment
}

/// [`run`], committing the take even when denied if `force`.
fn decide(
    params: &Params,
    state: Option<&State>,
    now: u64,
    want: u64,
    take: u64,
    force: bool,
) -> Assessment {
    let step = Step { want, take, force };
    let raw = match params.algorithm {
        Algorithm::FixedWindow => fixed_window(params, state, now, step),
        Algorithm::SlidingWindowLog => sliding_log(params, state, now, step),
        Algorithm::SlidingWindowCounter => sliding_counter(params, state, now, step),
        Algorithm::TokenBucket => token_bucket(params, state, now, step),
        Algorithm::Gcra => gcra(params, state, now, step),
    };
    let allowed = raw.verdict.allowed;
    Assessment {
        verdict: Verdict {
            reset_us: round_up_to_ms(raw.verdict.reset_us),
            ..raw.verdict
        },
        unconsumed_remaining: if allowed {
            raw.verdict.remaining + take
        } else {
            raw.verdict.remaining
        },
        // Nothing to store when denied (unless forced) or when nothing is taken (a peek).
        update: raw.update.filter(|_| (allowed || force) && take > 0),
    }
}

/// What one evaluation asks: `want` hits decide, `take` are taken if allowed, or whatever the
/// answer when `force`.
#[derive(Clone, Copy)]
struct Step {
    want: u64,
    take: u64,
    force: bool,
}

/// Gives `n` hits back; never beyond a fresh state.
fn refund(params: &Params, state: Option<&State>, now: u64, n: u64) -> Assessment {
    let before = run(params, state, now, 0, 0).verdict;
    let refunded = state.and_then(|state| refunded_state(params, state, now, n));
    let after = run(params, refunded.as_ref().map(|u| &u.state), now, 0, 0);
    Assessment {
        verdict: after.verdict,
        unconsumed_remaining: before.remaining,
        update: refunded,
    }
}

fn refunded_state(params: &Params, state: &State, now: u64, n: u64) -> Option<Update> {
    let p = params.period_us;
    let update = match state {
        State::Window { .. } => {
            // Hits come back to the window in force now, as the next check will see it.
            let (window, count) = fixed_window_now(params, Some(state), now);
            let end = (window + 1) * p;
            Update {
                state: State::Window {
                    window,
                    count: count.saturating_sub(n),
                },
                ttl_us: end.saturating_sub(now) + EXPIRY_SLACK_US,
            }
        }
        State::Log { entries } => {
            // The newest hits go back first.
            let mut entries = entries.clone();
            let mut left = n;
            while left > 0 {
                let Some(last) = entries.back_mut() else {
                    break;
                };
                let give = last.1.min(left);
                last.1 -= give;
                left -= give;
                if last.1 == 0 {
                    entries.pop_back();
                }
            }
            // State ahead of a clock that stepped back lives as long as it matters.
            let ahead = entries.back().map_or(0, |(ts, _)| ts.saturating_sub(now));
            Update {
                state: State::Log { entries },
                ttl_us: p + EXPIRY_SLACK_US + ahead,
            }
        }
        State::Sliding { .. } => {
            // Hits come back to the current window, after rolling the state forward to now.
            let (at, window, current, previous) = sliding_now(params, Some(state), now);
            Update {
                state: State::Sliding {
                    window,
                    current: current.saturating_sub(n),
                    previous,
                },
                ttl_us: 2 * p + EXPIRY_SLACK_US + (at - now),
            }
        }
        State::Bucket { .. } => {
            let (tokens, updated) = refilled_bucket(params, Some(state), now);
            let burst = params.burst as f64;
            let tokens = (tokens + n as f64).min(burst);
            Update {
                state: State::Bucket { tokens, updated },
                ttl_us: bucket_ttl(params, tokens) + updated.saturating_sub(now),
            }
        }
        State::Gcra { tat } => {
            let back = n.saturating_mul(params.emission_interval());
            let tat = tat.saturating_sub(back).max(now);
            Update {
                state: State::Gcra { tat },
                ttl_us: tat - now + EXPIRY_SLACK_US,
            }
        }
    };
    Some(update)
}

/// An assessment before rounding and before the denied/peek filter of [`run`].
struct Raw {
    verdict: Verdict,
    update: Option<Update>,
}

/// The fixed window in force at `now` and its count.
fn fixed_window_now(params: &Params, state: Option<&State>, now: u64) -> (u64, u64) {
    let window = now / params.period_us;
    match state {
        // A clock that stepped back keeps using the newer window it already counted in.
        Some(State::Window {
            window: stored,
            count,
        }) if *stored >= window => (*stored, *count),
        _ => (window, 0),
    }
}

fn fixed_window(params: &Params, state: Option<&State>, now: u64, step: Step) -> Raw {
    let (l, p) = (params.limit, params.period_us);
    let Step { want, take, force } = step;
    let (window, count) = fixed_window_now(params, state, now);
    let reset = ((window + 1) * p).saturating_sub(now);
    if count + want <= l {
        let count = count + take;
        Raw {
            verdict: Verdict {
                allowed: true,
                remaining: l - count,
                reset_us: reset,
            },
            update: Some(Update {
                state: State::Window { window, count },
                ttl_us: reset + EXPIRY_SLACK_US,
            }),
        }
    } else {
        Raw {
            verdict: Verdict {
                allowed: false,
                remaining: l.saturating_sub(count),
                reset_us: reset,
            },
            update: force.then_some(Update {
                state: State::Window {
                    window,
                    count: count.saturating_add(take),
                },
                ttl_us: reset + EXPIRY_SLACK_US,
            }),
        }
    }
}

fn sliding_log(params: &Params, state: Option<&State>, now: u64, step: Step) -> Raw {
    let (l, p) = (params.limit, params.period_us);
    let Step { want, take, force } = step;
    let empty = VecDeque::new();
    let entries = match state {
        Some(State::Log { entries }) => entries,
        _ => &empty,
    };
    // Members with ts <= now - P have left the window.
    let horizon = now.saturating_sub(p);
    let live = || {
        entries
            .iter()
            .filter(move |(ts, _)| now < p || *ts > horizon)
    };
    let n: u64 = live().map(|(_, count)| count).sum();
    // The live entries with `take` hits added at now.
    let taken = || {
        let newest = entries.back().map(|(ts, _)| *ts);
        let mut kept: VecDeque<(u64, u64)> = live().copied().collect();
        // Timestamps never move back, so the log stays sorted when the clock does.
        let at = newest.map_or(now, |ts| ts.max(now));
        if take > 0 {
            match kept.back_mut() {
                Some(last) if last.0 == at => last.1 += take,
                _ => kept.push_back((at, take)),
            }
        }
        kept
    };
    let update = |kept: VecDeque<(u64, u64)>| {
        let ahead = kept.back().map_or(0, |(ts, _)| ts.saturating_sub(now));
        Update {
            state: State::Log { entries: kept },
            ttl_us: p + EXPIRY_SLACK_US + ahead,
        }
    };
    if n + want <= l {
        let kept = taken();
        let reset = kept
            .back()
            .map_or(0, |(ts, _)| (ts + p).saturating_sub(now));
        Raw {
            verdict: Verdict {
                allowed: true,
                remaining: l - n - take,
                reset_us: reset,
            },
            update: Some(update(kept)),
        }
    } else {
        // The request passes once the (n + want - L)-th oldest member leaves the window.
        let mut needed = n + want - l;
        let mut reset = 0;
        for (ts, count) in live() {
            reset = (ts + p).saturating_sub(now);
            if *count >= needed {
                break;
            }
            needed -= count;
        }
        Raw {
            verdict: Verdict {
                allowed: false,
                remaining: l.saturating_sub(n),
                reset_us: reset,
            },
            update: force.then(|| update(taken())),
        }
    }
}

/// The sliding counter rolled forward to `now`: the instant used (never before the stored
/// window), the current window, and its current and previous counts.
fn sliding_now(params: &Params, state: Option<&State>, now: u64) -> (u64, u64, u64, u64) {
    let p = params.period_us;
    let window = now / p;
    match state {
        Some(State::Sliding {
            window: stored,
            current,
            previous,
        }) if *stored >= window => {
            // Clock stepped back: stay at the start of the newer window (full previous weight).
            (now.max(stored * p), *stored, *current, *previous)
        }
        Some(State::Sliding {
            window: stored,
            current,
            ..
        }) if *stored + 1 == window => (now, window, 0, *current),
        _ => (now, window, 0, 0),
    }
}

fn sliding_counter(params: &Params, state: Option<&State>, clock_now: u64, step: Step) -> Raw {
    let (l, p) = (params.limit, params.period_us);
    let Step { want, take, force } = step;
    let (now, window, current, previous) = sliding_now(params, state, clock_now);
    let elapsed = now - window * p;
    let (lf, pf) = (l as f64, p as f64);
    let weight = (pf - elapsed as f64) / pf;
    let estimate = previous as f64 * weight + current as f64;
    let window_end = (window + 1) * p;
    if estimate + want as f64 <= lf {
        let current = current + take;
        let reset = if current > 0 {
            window_end + p - now
        } else if previous > 0 {
            window_end - now
        } else {
            0
        };
        Raw {
            verdict: Verdict {
                allowed: true,
                remaining: (lf - estimate - take as f64).floor() as u64,
                reset_us: reset,
            },
            update: Some(Update {
                state: State::Sliding {
                    window,
                    current,
                    previous,
                },
                ttl_us: 2 * p + EXPIRY_SLACK_US + (now - clock_now),
            }),
        }
    } else {
        let reset = sliding_counter_wait(l, p, now, window, current, previous, want).max(1);
        Raw {
            verdict: Verdict {
                allowed: false,
                remaining: (lf - estimate).max(0.0).floor() as u64,
                reset_us: reset,
            },
            update: force.then_some(Update {
                state: State::Sliding {
                    window,
                    current: current.saturating_add(take),
                    previous,
                },
                ttl_us: 2 * p + EXPIRY_SLACK_US + (now - clock_now),
            }),
        }
    }
}

/// Earliest wait after which `want` more hits pass, with no other traffic.
fn sliding_counter_wait(
    l: u64,
    p: u64,
    now: u64,
    window: u64,
    current: u64,
    previous: u64,
    want: u64,
) -> u64 {
    let pf = p as f64;
    // Solve weight * count + base <= L for the elapsed time within a window whose previous
    // count is `count`: elapsed >= P - (L - base) * P / count.
    let solve = |count: u64, base: u64| -> Option<f64> {
        let room = l.checked_sub(base)?;
        if count == 0 {
            return Some(0.0);
        }
        Some((pf - room as f64 * pf / count as f64).max(0.0))
    };
    if let Some(elapsed) = solve(previous, current + want)
        && elapsed < pf
    {
        let at = window * p + elapsed.ceil() as u64;
        return at.saturating_sub(now);
    }
    if let Some(elapsed) = solve(current, want)
        && elapsed < pf
    {
        let at = (window + 1) * p + elapsed.ceil() as u64;
        return at.saturating_sub(now);
    }
    (window + 2) * p - now
}

/// Tokens after refilling up to `now`, and the refill time stored with them.
fn refilled_bucket(params: &Params, state: Option<&State>, now: u64) -> (f64, u64) {
    let burst = params.burst as f64;
    match state {
        Some(State::Bucket { tokens, updated }) => {
            let elapsed = now.saturating_sub(*updated);
            let refill = elapsed as f64 * params.limit as f64 / params.period_us as f64;
            ((tokens + refill).min(burst), now.max(*updated))
        }
        _ => (burst, now),
    }
}

fn bucket_ttl(params: &Params, tokens: f64) -> u64 {
    let missing = (params.burst as f64 - tokens).max(0.0);
    (missing * params.period_us as f64 / params.limit as f64).ceil() as u64 + EXPIRY_SLACK_US
}

fn token_bucket(params: &Params, state: Option<&State>, now: u64, step: Step) -> Raw {
    let Step { want, take, force } = step;
    let (tokens, updated) = refilled_bucket(params, state, now);
    let rate_inverse = params.period_us as f64 / params.limit as f64;
    if tokens >= want as f64 {
        let tokens = tokens - take as f64;
        let missing = (params.burst as f64 - tokens).max(0.0);
        Raw {
            verdict: Verdict {
                allowed: true,
                remaining: tokens.floor() as u64,
                reset_us: (missing * rate_inverse).ceil() as u64,
            },
            update: Some(Update {
                state: State::Bucket { tokens, updated },
                ttl_us: bucket_ttl(params, tokens) + updated.saturating_sub(now),
            }),
        }
    } else {
        // A charge leaves the bucket in debt (negative tokens), at most MAX_DEBT_US to refill.
        let floor = params.burst as f64
            - MAX_DEBT_US as f64 * params.limit as f64 / params.period_us as f64;
        // Never above what it had (a bucket already deeper in debt than the cap stays so).
        let owed = (tokens - take as f64).max(floor).min(tokens);
        Raw {
            verdict: Verdict {
                allowed: false,
                remaining: tokens.max(0.0).floor() as u64,
                reset_us: ((want as f64 - tokens) * rate_inverse).ceil() as u64,
            },
            update: force.then(|| Update {
                state: State::Bucket {
                    tokens: owed,
                    updated,
                },
                ttl_us: bucket_ttl(params, owed) + updated.saturating_sub(now),
            }),
        }
    }
}

fn gcra(params: &Params, state: Option<&State>, now: u64, step: Step) -> Raw {
    let Step { want, take, force } = step;
    let t = params.emission_interval();
    let tau = params.burst.saturating_sub(1) * t;
    let tat0 = match state {
        Some(State::Gcra { tat }) => (*tat).max(now),
        _ => now,
    };
    // allow_at = tat0 + want*T - tau - T; written to stay in unsigned arithmetic.
    let allowed = now + tau + t >= tat0.saturating_add(want.saturating_mul(t));
    if allowed {
        let new_tat = tat0 + take * t;
        Raw {
            verdict: Verdict {
                allowed: true,
                remaining: (now + tau + t - new_tat) / t,
                reset_us: new_tat - now,
            },
            update: Some(Update {
                state: State::Gcra { tat: new_tat },
                ttl_us: new_tat - now + EXPIRY_SLACK_US,
            }),
        }
    } else {
        let allow_at = tat0.saturating_add(want.saturating_mul(t)) - tau - t;
        let remaining = (now + tau + t).saturating_sub(tat0) / t;
        // A charge moves the arrival time on as debt, at most MAX_DEBT_US ahead.
        let owed = tat0
            .saturating_add(take.saturating_mul(t))
            .min(now + MAX_DEBT_US)
            .max(tat0);
        Raw {
            verdict: Verdict {
                allowed: false,
                remaining: remaining.min(params.burst),
                reset_us: allow_at - now,
            },
            update: force.then_some(Update {
                state: State::Gcra { tat: owed },
                ttl_us: owed - now + EXPIRY_SLACK_US,
            }),
        }
    }
}

#[cfg(test)]
mod tests;
