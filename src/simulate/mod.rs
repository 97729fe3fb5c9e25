//! `rlsd simulate`: what each algorithm does to a descriptor's traffic, as a table and a picture.
//!
//! The simulation runs the serving path itself, not a model of it: the config is loaded with
//! [`config::load_path`], the descriptor is matched with [`engine::plan`], and every request is
//! decided by a [`MemoryStore`] through the [`Store`] trait. Only the clock is simulated (a
//! [`ManualClock`] set to each request's time), so a two-minute trace replays in milliseconds.
//! For each algorithm the matched limits are cloned with that algorithm (L, P and burst kept)
//! and decided in a fresh store.

pub mod stats;
pub mod svg;
pub mod traffic;

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::algorithm::Params;
use crate::clock::ManualClock;
use crate::config::{self, Config};
use crate::engine::{self, Decision, Descriptor, KeySettings, Request};
use crate::limit::{Algorithm, Limit};
use crate::store::memory::DEFAULT_MAX_KEYS;
use crate::store::{Check, MemoryStore, Outcome, Store, request_allowed};

pub use traffic::Pattern;

/// A simulation problem, worded for the command line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

/// 2026-01-01 00:00:00 UTC. Simulated time starts at the first boundary of the limit's period at
/// or after it: windows are epoch aligned, so offset 0 is the start of a window.
const ORIGIN_FLOOR_US: u64 = 1_767_225_600 * 1_000_000;

/// Simulated time for a generated pattern when `--duration` is not given.
pub const DEFAULT_DURATION_US: u64 = 120 * 1_000_000;

/// Command line of `rlsd simulate`.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["traffic", "pattern"])))]
pub struct Args {
    /// A YAML file, or a directory: every file below it is read (one domain each).
    #[arg(long, env = "RLSD_CONFIG")]
    pub config: PathBuf,
    /// How the directory is read.
    #[command(flatten)]
    pub read: crate::cli::ConfigReadArgs,
    /// The request's domain.
    #[arg(long)]
    pub domain: String,
    /// The request descriptor, `key=value[,key=value...]`.
    #[arg(long)]
    pub descriptor: String,
    /// A CSV of request times, one per line: seconds from the start (`1.25`) or milliseconds
    /// (`1250ms`); a header line is allowed.
    #[arg(long)]
    pub traffic: Option<PathBuf>,
    /// Generated traffic: `steady:R` (R per second), `burst:N@T` (N at once at T), `edge:N` (N
    /// either side of a window boundary), `poisson:R` (random, R per second); join with `+`.
    #[arg(long)]
    pub pattern: Option<String>,
    /// Simulated time (`120s`, `500ms`, `2m`); default 120s for a pattern, to the trace's last
    /// second for a file.
    #[arg(long)]
    pub duration: Option<String>,
    /// `all`, or a comma list: fixed_window, sliding_window_log, sliding_window_counter,
    /// token_bucket, gcra.
    #[arg(long, default_value = "all")]
    pub algorithms: String,
    /// Seed of the `poisson` pattern's random arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write the SVG picture.
    #[arg(long)]
    pub out: PathBuf,
}

/// Where a simulation's requests come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Traffic {
    /// Generated patterns.
    Patterns {
        /// The `--pattern` text, for titles.
        text: String,
        /// What it says.
        patterns: Vec<Pattern>,
    },
    /// Request times read from a file.
    Trace {
        /// The file, for titles.
        source: String,
        /// Offsets from the start in microseconds, ascending.
        times_us: Vec<u64>,
    },
}

/// One simulation, parsed and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// The request's domain.
    pub domain: String,
    /// The descriptor's entries.
    pub entries: Vec<(String, String)>,
    /// The requests.
    pub traffic: Traffic,
    /// Simulated time; `None`: [`DEFAULT_DURATION_US`] for patterns, the trace's length for a file.
    pub duration_us: Option<u64>,
    /// Algorithms to compare, in panel order.
    pub algorithms: Vec<Algorithm>,
    /// Seed of random patterns.
    pub seed: u64,
}

/// What the client saw for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Whether every limit allowed it.
    pub allowed: bool,
    /// Denied: the largest `reset` among the limits that denied, what `Retry-After` says. 0 when
    /// allowed.
    pub retry_after_us: u64,
    /// The smallest `remaining` over the limits.
    pub remaining: u64,
}

impl Answer {
    /// Folds one request's store outcomes into what the client sees.
    pub fn of(checks: &[Check], outcomes: &[Outcome]) -> Answer {
        let allowed = request_allowed(checks, outcomes);
        let retry_after_us = if allowed {
            0
        } else {
            checks
                .iter()
                .zip(outcomes)
                .filter(|(check, outcome)| !check.shadow && !outcome.verdict.allowed)
                .map(|(_, outcome)| outcome.verdict.reset_us)
                .max()
                .unwrap_or(0)
        };
        Answer {
            allowed,
            retry_after_us,
            remaining: outcomes
                .iter()
                .map(|outcome| outcome.verdict.remaining)
                .min()
                .unwrap_or(0),
        }
    }
}

/// The figures of one algorithm's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Requests allowed.
    pub allowed: usize,
    /// Requests denied.
    pub denied: usize,
    /// The most requests admitted in any window as long as the limit's period (sliding).
    pub max_in_window: usize,
    /// The largest `retry_after_us` of a denied request.
    pub longest_retry_after_us: u64,
}

/// One algorithm's replay.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The limits as simulated: the matched ones with this algorithm.
    pub limits: Vec<Limit>,
    /// One per request of [`Report::times_us`].
    pub answers: Vec<Answer>,
    /// Totals.
    pub summary: Summary,
}

/// A finished simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The request's domain.
    pub domain: String,
    /// The descriptor's entries.
    pub entries: Vec<(String, String)>,
    /// The limits the descriptor matched, as configured (at least one).
    pub limits: Vec<Limit>,
    /// The traffic, for titles.
    pub traffic_label: String,
    /// Simulated time.
    pub duration_us: u64,
    /// The clock reading at offset 0 (a window boundary of the first limit's period).
    pub origin_us: u64,
    /// Request times, offsets from `origin_us`, ascending.
    pub times_us: Vec<u64>,
    /// Trace requests at or after the end of the simulation, not replayed.
    pub ignored: usize,
    /// One per algorithm, in the order asked.
    pub runs: Vec<Run>,
}

impl Report {
    /// The first matched limit, which the window figures and the picture refer to.
    pub fn limit(&self) -> &Limit {
        &self.limits[0]
    }

    /// P of [`Report::limit`] in microseconds.
    pub fn window_us(&self) -> u64 {
        self.limit().period.micros().max(1)
    }

    /// `domain key=value,...`.
    pub fn title(&self) -> String {
        format!(
            "rlsd simulate: {} {}",
            self.domain,
            format_entries(&self.entries)
        )
    }
}

/// Runs `rlsd simulate`: prints the table to stdout and writes the SVG.
pub fn run(args: &Args) -> Result<(), Error> {
    let scenario = scenario(args)?;
    let config = config::load_path(&args.config, args.read.options()).map_err(|errors| {
        Error(format!(
            "invalid config {}:\n{errors}",
            args.config.display()
        ))
    })?;
    let report = simulate(&config, &scenario)?;
    std::fs::write(&args.out, svg::render(&report))
        .map_err(|error| Error(format!("writing {}: {error}", args.out.display())))?;
    print!("{}", table(&report));
    println!("picture: {}", args.out.display());
    Ok(())
}

/// Parses and checks the command line (reading `--traffic`), before any config is loaded.
pub fn scenario(args: &Args) -> Result<Scenario, Error> {
    let traffic = match (&args.traffic, &args.pattern) {
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .map_err(|error| Error(format!("reading {}: {error}", path.display())))?;
            let source = path.display().to_string();
            Traffic::Trace {
                times_us: traffic::parse_trace(&text, &source)?,
                source,
            }
        }
        (None, Some(text)) => Traffic::Patterns {
            patterns: traffic::parse_patterns(text)?,
            text: text.clone(),
        },
        _ => {
            return Err(Error(
                "give exactly one of --traffic FILE and --pattern".to_owned(),
            ));
        }
    };
    let duration_us = match &args.duration {
        None => None,
        Some(text) => match traffic::parse_duration(text) {
            Ok(0) => return Err(Error("--duration must be more than 0".to_owned())),
            Ok(us) => Some(us),
            Err(error) => return Err(Error(format!("--duration {error}"))),
        },
    };
    Ok(Scenario {
        domain: args.domain.clone(),
        entries: parse_descriptor(&args.descriptor)?,
        traffic,
        duration_us,
        algorithms: parse_algorithms(&args.algorithms)?,
        seed: args.seed,
    })
}

/// Parses `key=value[,key=value...]`.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, Error> {
    text.split(',')
        .map(|entry| match entry.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                Ok((key.trim().to_owned(), value.trim().to_owned()))
            }
            _ => Err(Error(format!(
                "--descriptor '{text}': '{entry}' is not key=value (expected key=value[,key=value...])"
            ))),
        })
        .collect()
}

/// Parses `all` or a comma list of algorithm names, dropping repeats.
pub fn parse_algorithms(text: &str) -> Result<Vec<Algorithm>, Error> {
    if text.trim() == "all" {
        return Ok(Algorithm::ALL.to_vec());
    }
    let mut algorithms = Vec::new();
    for name in text.split(',').map(str::trim) {
        let algorithm = Algorithm::parse(name).ok_or_else(|| {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            Error(format!(
                "--algorithms: unknown algorithm '{name}' (expected all, or a comma list of {})",
                names.join(", ")
            ))
        })?;
        if !algorithms.contains(&algorithm) {
            algorithms.push(algorithm);
        }
    }
    Ok(algorithms)
}

/// `limit` as simulated under `algorithm`: L, P and burst kept (token bucket and GCRA fall back
/// to their default burst when none is configured), and enforced, since a shadow limit would
/// show nothing.
pub fn substitute(limit: &Limit, algorithm: Algorithm) -> Limit {
    let mut simulated = limit.clone();
    simulated.algorithm = algorithm;
    simulated.shadow = false;
    simulated
}

/// Replays the scenario's traffic against the limits its descriptor matches in `config`, once
/// per algorithm.
pub fn simulate(config: &Config, scenario: &Scenario) -> Result<Report, Error> {
    let keys = KeySettings::default();
    let request = Request {
        domain: scenario.domain.clone(),
        descriptors: vec![Descriptor {
            entries: scenario.entries.clone(),
            ..Descriptor::default()
        }],
        hits_addend: 1,
    };
    let plan = engine::plan(config, &request, &keys);
    let described = || format!("'{}'", format_entries(&scenario.entries));
    let range = match plan.decisions.first() {
        Some(Decision::Checks(range)) => range.clone(),
        _ if !config.domains.contains_key(&scenario.domain) => {
            let mut known: Vec<&str> = config.domains.keys().map(String::as_str).collect();
            known.sort_unstable();
            return Err(Error(format!(
                "unknown domain '{}' (the config has: {})",
                scenario.domain,
                known.join(", ")
            )));
        }
        Some(Decision::Unlimited) => {
            return Err(Error(format!(
                "descriptor {} is unlimited in domain '{}': every request is allowed, nothing to simulate",
                described(),
                scenario.domain
            )));
        }
        _ => {
            return Err(Error(format!(
                "descriptor {} matches no limit in domain '{}' (rlsd check --config ... lists the limits)",
                described(),
                scenario.domain
            )));
        }
    };
    let checks = &plan.checks[range.clone()];
    let limits: Vec<Limit> = plan.limits[range]
        .iter()
        .map(|planned| Limit::clone(&planned.limit))
        .collect();
    let window_us = limits[0].period.micros().max(1);

    let (times_us, duration_us, ignored, traffic_label) = resolve_traffic(scenario, window_us)?;
    let origin_us = ORIGIN_FLOOR_US
        .div_ceil(window_us)
        .checked_mul(window_us)
        .filter(|origin| origin.checked_add(duration_us).is_some())
        .ok_or_else(|| Error("the limit's period is too long to simulate".to_owned()))?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|error| Error(format!("starting the simulation runtime: {error}")))?;
    let runs = scenario
        .algorithms
        .iter()
        .map(|&algorithm| {
            let simulated: Vec<Limit> = limits
                .iter()
                .map(|limit| substitute(limit, algorithm))
                .collect();
            let checks: Vec<Check> = checks
                .iter()
                .zip(&simulated)
                .map(|(check, limit)| {
                    let mut check = check.clone();
                    check.key = key_for(&check.key, algorithm);
                    check.params = Params::of(limit);
                    check.shadow = limit.shadow;
                    check
                })
                .collect();
            let answers = runtime.block_on(replay(&checks, origin_us, &times_us))?;
            let summary = summarize(&times_us, &answers, window_us);
            Ok(Run {
                algorithm,
                limits: simulated,
                answers,
                summary,
            })
        })
        .collect::<Result<Vec<Run>, Error>>()?;

    Ok(Report {
        domain: scenario.domain.clone(),
        entries: scenario.entries.clone(),
        limits,
        traffic_label,
        duration_us,
        origin_us,
        times_us,
        ignored,
        runs,
    })
}

/// The engine's `key` with its algorithm tag set to `algorithm`: the key the engine builds when
/// the config names that algorithm. Keys are `<prefix>:<layer>:<domain>:<algorithm>:...` with
/// `:` escaped inside components, so the fourth component is always the tag.
fn key_for(key: &str, algorithm: Algorithm) -> String {
    let parts: Vec<&str> = key.splitn(5, ':').collect();
    match parts.as_slice() {
        [prefix, layer, domain, _, rest] => {
            format!("{prefix}:{layer}:{domain}:{}:{rest}", algorithm.key_tag())
        }
        // Not the documented shape: still give each algorithm a key of its own.
        _ => format!("{key}#{}", algorithm.key_tag()),
    }
}

/// Decides `checks` once per request time, in a fresh store on a clock set to each time.
async fn replay(checks: &[Check], origin_us: u64, times_us: &[u64]) -> Result<Vec<Answer>, Error> {
    let clock = ManualClock::at(origin_us);
    let store = MemoryStore::with_clock(DEFAULT_MAX_KEYS, clock.clone());
    let mut answers = Vec::with_capacity(times_us.len());
    for &t in times_us {
        clock.set(origin_us + t);
        let outcomes = store
            .decide(checks)
            .await
            .map_err(|error| Error(format!("simulated store: {error}")))?;
        answers.push(Answer::of(checks, &outcomes));
    }
    Ok(answers)
}

/// The request times, the simulated time, how many trace requests fell past it, and a label.
fn resolve_traffic(
    scenario: &Scenario,
    window_us: u64,
) -> Result<(Vec<u64>, u64, usize, String), Error> {
    match &scenario.traffic {
        Traffic::Patterns { text, patterns } => {
            let duration = scenario.duration_us.unwrap_or(DEFAULT_DURATION_US);
            let times = traffic::generate(patterns, duration, window_us, scenario.seed)?;
            Ok((times, duration, 0, text.clone()))
        }
        Traffic::Trace { source, times_us } => {
            // By default the simulation ends after the trace's last whole second.
            let last = times_us.last().copied().unwrap_or(0);
            let duration = scenario
                .duration_us
                .unwrap_or((last / 1_000_000 + 1) * 1_000_000);
            let kept: Vec<u64> = times_us.iter().copied().filter(|&t| t < duration).collect();
            let ignored = times_us.len() - kept.len();
            Ok((kept, duration, ignored, format!("trace {source}")))
        }
    }
}

fn summarize(times_us: &[u64], answers: &[Answer], window_us: u64) -> Summary {
    let admitted: Vec<u64> = times_us
        .iter()
        .zip(answers)
        .filter(|(_, answer)| answer.allowed)
        .map(|(&t, _)| t)
        .collect();
    Summary {
        allowed: admitted.len(),
        denied: answers.len() - admitted.len(),
        max_in_window: stats::max_in_window(&admitted, window_us),
        longest_retry_after_us: answers
            .iter()
            .map(|answer| answer.retry_after_us)
            .max()
            .unwrap_or(0),
    }
}

/// The table printed to stdout: one row per algorithm, with what each column means.
pub fn table(report: &Report) -> String {
    let window = traffic::format_duration(report.window_us());
    let l = report.limit().requests_per_unit;
    let mut out = String::new();
    let _ = writeln!(out, "{}", report.title());
    let _ = writeln!(out, "limit:   {}", report.limit());
    let _ = writeln!(
        out,
        "traffic: {}, {} requests in {} (simulated clock)",
        report.traffic_label,
        report.times_us.len(),
        traffic::format_duration(report.duration_us)
    );
    if report.limits.len() > 1 {
        let _ = writeln!(
            out,
            "note:    the descriptor has {} limits; all are enforced together under each \
             algorithm, and L and the window below are the first one's",
            report.limits.len()
        );
    }
    if report.limits.iter().any(|limit| limit.shadow) {
        let _ = writeln!(
            out,
            "note:    shadow mode is ignored: the simulation enforces the limit"
        );
    }
    if report.ignored > 0 {
        let _ = writeln!(
            out,
            "note:    {} requests of the trace at or after --duration were not replayed",
            report.ignored
        );
    }
    let max_header = format!("max in any {window}");
    let _ = writeln!(
        out,
        "\n{:<32} {:>8} {:>8} {:>16} {:>20}",
        "algorithm", "allowed", "denied", max_header, "longest retry-after"
    );
    for run in &report.runs {
        let mut name = run.algorithm.name().to_owned();
        if let Some(limit) = run.limits.first()
            && run.algorithm.takes_burst()
        {
            let _ = write!(name, " (burst {})", limit.effective_burst());
        }
        if run.algorithm == report.limit().algorithm {
            name.push_str(" *");
        }
        let summary = &run.summary;
        let max = format!(
            "{} ({})",
            summary.max_in_window,
            times_limit(summary.max_in_window, l)
        );
        let _ = writeln!(
            out,
            "{name:<32} {:>8} {:>8} {max:>16} {:>20}",
            summary.allowed,
            summary.denied,
            format_wait(summary.longest_retry_after_us)
        );
    }
    let _ = writeln!(
        out,
        "\n* the configured algorithm.\n\
         max in any {window}: the most requests admitted in any window as long as the limit's \
         period, sliding over every start time (not per aligned window).\n\
         longest retry-after: the largest reset (what Retry-After says) returned to a denied \
         request: the longest a client that honours it is told to wait."
    );
    out
}

/// `2.0 L`: a count as a multiple of the limit.
fn times_limit(count: usize, limit: u32) -> String {
    match limit {
        0 => "L = 0".to_owned(),
        l => format!("{:.1} L", count as f64 / f64::from(l)),
    }
}

/// A wait for people: `-` for none, `250ms`, `59.4s`, `2h 5m`.
fn format_wait(us: u64) -> String {
    let ms = us.div_ceil(1_000);
    match ms {
        0 => "-".to_owned(),
        1..1_000 => format!("{ms}ms"),
        1_000..3_600_000 => {
            let seconds = format!("{:.3}", ms as f64 / 1_000.0);
            format!("{}s", seconds.trim_end_matches('0').trim_end_matches('.'))
        }
        _ => format!("{}h {}m", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

/// `k=v,k2=v2`.
fn format_entries(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_parse_strictly() {
        assert_eq!(
            parse_descriptor("endpoint=search,api_key=k1").unwrap(),
            vec![
                ("endpoint".to_owned(), "search".to_owned()),
                ("api_key".to_owned(), "k1".to_owned())
            ]
        );
        assert_eq!(
            parse_descriptor("a=b=c").unwrap(),
            vec![("a".to_owned(), "b=c".to_owned())]
        );
        for bad in ["", "a", "a=b,", "=b", "a=b,,c=d"] {
            assert!(parse_descriptor(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn algorithms_parse_all_or_a_list() {
        assert_eq!(parse_algorithms("all").unwrap(), Algorithm::ALL.to_vec());
        assert_eq!(
            parse_algorithms("gcra, fixed_window,gcra").unwrap(),
            vec![Algorithm::Gcra, Algorithm::FixedWindow]
        );
        let error = parse_algorithms("gcra,leaky").unwrap_err().0;
        assert!(error.contains("'leaky'") && error.contains("sliding_window_log"));
    }

    #[test]
    fn substitution_keeps_l_p_and_burst_and_enforces() {
        let mut limit = Limit::fixed(10, crate::limit::Unit::Minute);
        limit.shadow = true;
        let gcra = substitute(&limit, Algorithm::Gcra);
        assert_eq!(gcra.algorithm, Algorithm::Gcra);
        assert_eq!(gcra.effective_burst(), 1);
        assert!(!gcra.shadow);
        assert_eq!(
            substitute(&limit, Algorithm::TokenBucket).effective_burst(),
            10
        );
        limit.burst = std::num::NonZeroU32::new(4);
        assert_eq!(substitute(&limit, Algorithm::Gcra).effective_burst(), 4);
    }

    #[test]
    fn keys_are_the_engines_keys_for_the_config_naming_the_algorithm() {
        let plan_key = |yaml: &str| {
            let domain = config::load_str("t.yaml", yaml).unwrap();
            let mut loaded = Config::default();
            loaded.domains.insert(domain.name.clone(), domain);
            let request = Request {
                domain: "d:1".to_owned(),
                descriptors: vec![Descriptor {
                    entries: vec![("k".to_owned(), "a:b=c".to_owned())],
                    ..Descriptor::default()
                }],
                hits_addend: 1,
            };
            engine::plan(&loaded, &request, &KeySettings::default()).checks[0]
                .key
                .clone()
        };
        let base = "domain: 'd:1'\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n";
        let fixed = plan_key(base);
        for algorithm in Algorithm::ALL {
            let named = plan_key(&format!("{base}      algorithm: {}\n", algorithm.name()));
            assert_eq!(key_for(&fixed, algorithm), named, "{algorithm}");
        }
    }

    #[test]
    fn waits_read_well() {
        assert_eq!(format_wait(0), "-");
        assert_eq!(format_wait(250_000), "250ms");
        assert_eq!(format_wait(59_400_000), "59.4s");
        assert_eq!(format_wait(60_000_000), "60s");
        assert_eq!(format_wait(7_500_000_000), "2h 5m");
    }
}
