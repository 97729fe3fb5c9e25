//! Request traces: generated patterns and CSV files, as sorted offsets in microseconds from the
//! start of the simulation.

use super::Error;

/// Microseconds per millisecond.
const US_PER_MS: f64 = 1_000.0;
/// Microseconds per second.
const US_PER_S: u64 = 1_000_000;

/// Longest simulated time: a year, far from any overflow in store arithmetic.
pub const MAX_DURATION_US: u64 = 366 * 86_400 * US_PER_S;

/// Most requests one simulation replays, so a typo (`steady:1e9`) cannot exhaust memory.
pub const MAX_REQUESTS: usize = 1_000_000;

/// One generated traffic shape.
#[derive(Clone, Debug, PartialEq)]
pub enum Pattern {
    /// `steady:R`: R requests per second, evenly spaced, from the start.
    Steady {
        /// R.
        per_second: f64,
    },
    /// `burst:N@T`: N requests at the same instant T.
    Burst {
        /// N.
        requests: u64,
        /// T, from the start.
        at_us: u64,
    },
    /// `edge:N`: N requests just before a window boundary of the limit's period, N just after.
    Edge {
        /// N.
        requests: u64,
    },
    /// `poisson:R`: random arrivals at R per second on average (seeded, so repeatable).
    Poisson {
        /// R.
        per_second: f64,
    },
}

/// The accepted pattern spellings, for error messages.
const PATTERN_HELP: &str = "steady:R, burst:N@T, edge:N or poisson:R, joined with '+' to combine";

/// Parses `--pattern`: one pattern, or several joined with `+` (`steady:2+burst:50@10s`).
pub fn parse_patterns(text: &str) -> Result<Vec<Pattern>, Error> {
    text.split('+')
        .map(|part| parse_pattern(part.trim()))
        .collect()
}

fn parse_pattern(text: &str) -> Result<Pattern, Error> {
    let bad = |why: &str| Error(format!("--pattern '{text}': {why}"));
    let Some((kind, arg)) = text.split_once(':') else {
        return Err(bad(&format!("expected {PATTERN_HELP}")));
    };
    match kind {
        "steady" => Ok(Pattern::Steady {
            per_second: parse_rate(arg).map_err(|why| bad(&why))?,
        }),
        "poisson" => Ok(Pattern::Poisson {
            per_second: parse_rate(arg).map_err(|why| bad(&why))?,
        }),
        "edge" => Ok(Pattern::Edge {
            requests: parse_count(arg).map_err(|why| bad(&why))?,
        }),
        "burst" => {
            let Some((count, at)) = arg.split_once('@') else {
                return Err(bad("expected burst:N@T, e.g. burst:50@10s"));
            };
            Ok(Pattern::Burst {
                requests: parse_count(count).map_err(|why| bad(&why))?,
                at_us: parse_duration(at).map_err(|error| bad(&error.0))?,
            })
        }
        other => Err(bad(&format!(
            "unknown pattern '{other}'; expected {PATTERN_HELP}"
        ))),
    }
}

fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(rate),
        _ => Err(format!(
            "'{text}' is not a rate (requests per second, more than 0, like 5 or 0.5)"
        )),
    }
}

fn parse_count(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(count) if count > 0 => Ok(count),
        _ => Err(format!(
            "'{text}' is not a request count (a whole number, at least 1)"
        )),
    }
}

/// Parses a duration: a number with a unit `ms`, `s`, `m`, `h` or `d` (`500ms`, `120s`, `2m`).
pub fn parse_duration(text: &str) -> Result<u64, Error> {
    let bad = || {
        Error(format!(
            "'{text}' is not a duration (a number and a unit: 500ms, 120s, 2m, 1h, 1d)"
        ))
    };
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .ok_or_else(bad)?;
    let (number, unit) = text.split_at(split);
    let scale = match unit {
        "ms" => US_PER_MS,
        "s" => US_PER_S as f64,
        "m" => 60.0 * US_PER_S as f64,
        "h" => 3_600.0 * US_PER_S as f64,
        "d" => 86_400.0 * US_PER_S as f64,
        _ => return Err(bad()),
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    if !value.is_finite() || value < 0.0 {
        return Err(bad());
    }
    let us = (value * scale).round();
    if us > MAX_DURATION_US as f64 {
        return Err(Error(format!("'{text}' is longer than a year")));
    }
    Ok(us as u64)
}

/// Request times of `patterns` in `[0, duration_us)`, sorted. `period_us` places `edge`.
pub fn generate(
    patterns: &[Pattern],
    duration_us: u64,
    period_us: u64,
    seed: u64,
) -> Result<Vec<u64>, Error> {
    let mut times = Vec::new();
    let mut random = SplitMix64(seed);
    for pattern in patterns {
        match *pattern {
            Pattern::Steady { per_second } => {
                check_volume(per_second, duration_us, times.len())?;
                let gap = US_PER_S as f64 / per_second;
                // Multiplying instead of summing the gap keeps rounding from drifting.
                times.extend(
                    (0u64..)
                        .map(|i| (i as f64 * gap).round() as u64)
                        .take_while(|&t| t < duration_us),
                );
            }
            Pattern::Poisson { per_second } => {
                check_volume(per_second, duration_us, times.len())?;
                let mean_gap = US_PER_S as f64 / per_second;
                let mut at = 0.0;
                loop {
                    // Exponential inter-arrival times; unit() is never 0, so ln() is finite.
                    at += -random.unit().ln() * mean_gap;
                    let t = at.round();
                    if t >= duration_us as f64 {
                        break;
                    }
                    times.push(t as u64);
                    if times.len() > MAX_REQUESTS {
                        return Err(too_many());
                    }
                }
            }
            Pattern::Burst { requests, at_us } => {
                if at_us >= duration_us {
                    return Err(Error(format!(
                        "burst at {} is not before the end of the simulation ({}); pass a longer --duration",
                        format_duration(at_us),
                        format_duration(duration_us)
                    )));
                }
                push_many(&mut times, requests, |_| at_us)?;
            }
            Pattern::Edge { requests } => {
                let (boundary, spread) = edge_placement(duration_us, period_us)?;
                // N evenly spread over the `spread` before the boundary, N over the one after.
                push_many(&mut times, requests, |i| {
                    boundary - spread + i * spread / requests
                })?;
                push_many(&mut times, requests, |i| boundary + i * spread / requests)?;
            }
        }
    }
    times.sort_unstable();
    Ok(times)
}

/// Where `edge` goes: the first window boundary at or past the middle of the simulation, with
/// requests spread over a tenth of the period (at most 1 s) on each side, well inside one period.
pub fn edge_placement(duration_us: u64, period_us: u64) -> Result<(u64, u64), Error> {
    let period_us = period_us.max(1);
    let spread = (period_us / 10).clamp(1, US_PER_S);
    let boundary = (duration_us / 2)
        .div_ceil(period_us)
        .max(1)
        .saturating_mul(period_us);
    if boundary.saturating_add(spread) > duration_us {
        return Err(Error(format!(
            "edge needs a window boundary of the limit's period ({}) inside the simulation, \
             with {} after it; pass --duration {} or more",
            format_duration(period_us),
            format_duration(spread),
            format_duration(period_us.saturating_mul(2))
        )));
    }
    Ok((boundary, spread))
}

fn check_volume(per_second: f64, duration_us: u64, already: usize) -> Result<(), Error> {
    let expected = per_second * duration_us as f64 / US_PER_S as f64;
    if expected + already as f64 > MAX_REQUESTS as f64 {
        return Err(too_many());
    }
    Ok(())
}

fn push_many(times: &mut Vec<u64>, n: u64, at: impl Fn(u64) -> u64) -> Result<(), Error> {
    if times.len() as u64 + n > MAX_REQUESTS as u64 {
        return Err(too_many());
    }
    times.extend((0..n).map(at));
    Ok(())
}

fn too_many() -> Error {
    Error(format!(
        "the traffic has more than {MAX_REQUESTS} requests; lower the rate or the --duration"
    ))
}

/// Parses a trace: one timestamp per line, seconds (`1.25`) or milliseconds (`1250ms`), offsets
/// from the start, in order. A header on the first line and blank lines are skipped.
pub fn parse_trace(text: &str, source: &str) -> Result<Vec<u64>, Error> {
    let mut times: Vec<u64> = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let number = index + 1;
        if line.is_empty() {
            continue;
        }
        let at = match parse_timestamp(line) {
            Some(at) => at,
            // A header names the column; a number can never start with a letter.
            None if index == 0 && line.starts_with(|c: char| c.is_ascii_alphabetic()) => continue,
            None => {
                return Err(Error(format!(
                    "{source}:{number}: '{line}' is not a timestamp \
                     (seconds like 1.25, or milliseconds like 1250ms, one per line)"
                )));
            }
        };
        if at >= MAX_DURATION_US {
            return Err(Error(format!(
                "{source}:{number}: '{line}' is more than a year after the start; timestamps \
                 are offsets from the start of the trace, not Unix times"
            )));
        }
        if let Some(&last) = times.last()
            && at < last
        {
            return Err(Error(format!(
                "{source}:{number}: '{line}' is earlier than the line before it; timestamps must \
                 not decrease (sort the file, e.g. sort -g)"
            )));
        }
        if times.len() >= MAX_REQUESTS {
            return Err(Error(format!(
                "{source}:{number}: more than {MAX_REQUESTS} requests"
            )));
        }
        times.push(at);
    }
    if times.is_empty() {
        return Err(Error(format!("{source}: no timestamps")));
    }
    Ok(times)
}

fn parse_timestamp(text: &str) -> Option<u64> {
    let (number, scale) = match text.strip_suffix("ms") {
        Some(ms) => (ms.trim_end(), US_PER_MS),
        None => (text, US_PER_S as f64),
    };
    // Only plain decimals: f64's parser would also take `inf` and `NaN`.
    if !number
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+'))
    {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    (value.is_finite() && value >= 0.0).then(|| (value * scale).round() as u64)
}

/// Formats microseconds in the largest unit that divides them (`2m`, `90s`, `500ms`, `1.5ms`).
pub fn format_duration(us: u64) -> String {
    const UNITS: [(u64, &str); 5] = [
        (86_400 * US_PER_S, "d"),
        (3_600 * US_PER_S, "h"),
        (60 * US_PER_S, "m"),
        (US_PER_S, "s"),
        (1_000, "ms"),
    ];
    if us == 0 {
        return "0s".to_owned();
    }
    for (size, name) in UNITS {
        if us.is_multiple_of(size) {
            return format!("{}{name}", us / size);
        }
    }
    if us >= US_PER_S {
        return format!("{:.3}s", us as f64 / US_PER_S as f64);
    }
    format!("{:.3}ms", us as f64 / 1_000.0)
}

/// SplitMix64: tiny, fast and good enough to jitter arrivals; fixed seeds make runs repeatable.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: never 0, so `ln` stays finite.
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = US_PER_S;

    #[test]
    fn durations_take_ms_s_m_h_d() {
        assert_eq!(parse_duration("500ms").unwrap(), 500_000);
        assert_eq!(parse_duration("120s").unwrap(), 120 * S);
        assert_eq!(parse_duration("1.5s").unwrap(), 1_500_000);
        assert_eq!(parse_duration("2m").unwrap(), 120 * S);
        assert_eq!(parse_duration("1h").unwrap(), 3_600 * S);
        assert_eq!(parse_duration("1d").unwrap(), 86_400 * S);
        for bad in ["", "10", "s", "10x", "-1s", "1.2.3s", "infs", "400d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn patterns_parse_and_combine() {
        assert_eq!(
            parse_patterns("steady:2+burst:50@10s + edge:3+poisson:0.5").unwrap(),
            vec![
                Pattern::Steady { per_second: 2.0 },
                Pattern::Burst {
                    requests: 50,
                    at_us: 10 * S
                },
                Pattern::Edge { requests: 3 },
                Pattern::Poisson { per_second: 0.5 },
            ]
        );
        for bad in [
            "steady",
            "steady:0",
            "steady:-1",
            "steady:fast",
            "burst:50",
            "burst:0@1s",
            "burst:5@soon",
            "edge:1.5",
            "wave:3",
            "",
        ] {
            let error = parse_patterns(bad).unwrap_err().0;
            assert!(error.contains("--pattern"), "{bad}: {error}");
        }
    }

    #[test]
    fn steady_is_evenly_spaced_and_stops_before_the_end() {
        let times = generate(&[Pattern::Steady { per_second: 4.0 }], 2 * S, S, 1).unwrap();
        assert_eq!(
            times,
            vec![
                0, 250_000, 500_000, 750_000, S, 1_250_000, 1_500_000, 1_750_000
            ]
        );
    }

    #[test]
    fn burst_is_one_instant_and_must_fit() {
        let burst = Pattern::Burst {
            requests: 3,
            at_us: 5 * S,
        };
        assert_eq!(
            generate(std::slice::from_ref(&burst), 10 * S, S, 1).unwrap(),
            vec![5 * S; 3]
        );
        assert!(generate(&[burst], 5 * S, S, 1).is_err());
    }

    #[test]
    fn edge_straddles_the_boundary_nearest_the_middle() {
        let times = generate(&[Pattern::Edge { requests: 4 }], 120 * S, 60 * S, 1).unwrap();
        assert_eq!(times.len(), 8);
        assert!(times[..4].iter().all(|&t| (59 * S..60 * S).contains(&t)));
        assert!(times[4..].iter().all(|&t| (60 * S..61 * S).contains(&t)));
        // A one-second period puts the boundary mid-run.
        let (boundary, spread) = edge_placement(120 * S, S).unwrap();
        assert_eq!((boundary, spread), (60 * S, 100_000));
        // No boundary fits: a clear error naming a duration that works.
        let error = edge_placement(120 * S, 3_600 * S).unwrap_err().0;
        assert!(error.contains("--duration 2h"), "{error}");
    }

    #[test]
    fn poisson_is_seeded_and_near_its_rate() {
        let pattern = [Pattern::Poisson { per_second: 10.0 }];
        let a = generate(&pattern, 1_000 * S, S, 7).unwrap();
        let b = generate(&pattern, 1_000 * S, S, 7).unwrap();
        let c = generate(&pattern, 1_000 * S, S, 8).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!((9_500..10_500).contains(&a.len()), "{}", a.len());
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn volume_is_capped() {
        let error = generate(&[Pattern::Steady { per_second: 1e9 }], 10 * S, S, 1)
            .unwrap_err()
            .0;
        assert!(error.contains("more than"), "{error}");
    }

    #[test]
    fn traces_take_seconds_and_milliseconds_with_a_header() {
        let text = "timestamp\n0\n0.5\n\n750ms\n1.25\r\n2000 ms\n";
        assert_eq!(
            parse_trace(text, "t.csv").unwrap(),
            vec![0, 500_000, 750_000, 1_250_000, 2 * S]
        );
    }

    #[test]
    fn traces_are_strict_with_line_numbers() {
        let cases = [
            ("0\n1\nsoon\n", "t.csv:3:", "not a timestamp"),
            ("0\nts\n", "t.csv:2:", "not a timestamp"),
            ("1\n0.5\n", "t.csv:2:", "earlier than"),
            ("0\n-1\n", "t.csv:2:", "not a timestamp"),
            ("inf\n", "t.csv: no timestamps", ""),
            ("0\nNaN\n", "t.csv:2:", "not a timestamp"),
            ("1767225600\n", "t.csv:1:", "not Unix times"),
            ("1,2\n", "t.csv:1:", "not a timestamp"),
            ("header\n", "t.csv: no timestamps", ""),
        ];
        for (text, place, why) in cases {
            let error = parse_trace(text, "t.csv").unwrap_err().0;
            assert!(
                error.contains(place) && error.contains(why),
                "{text:?}: {error}"
            );
        }
    }

    #[test]
    fn durations_format_in_the_largest_exact_unit() {
        assert_eq!(format_duration(0), "0s");
        assert_eq!(format_duration(120 * S), "2m");
        assert_eq!(format_duration(90 * S), "90s");
        assert_eq!(format_duration(500_000), "500ms");
        assert_eq!(format_duration(1_500), "1.500ms");
        assert_eq!(format_duration(3_600 * S), "1h");
    }
}
