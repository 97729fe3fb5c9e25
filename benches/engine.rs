//! The decision engine alone, on one core: no gRPC, no threads.
//!
//! Each measured request goes through what `RateLimiter::decide` does after decoding: build an
//! `engine::Request` (owned strings, as prost decoding allocates them), `engine::plan`, then
//! `MemoryStore::decide` on the plan's checks. One decision = one check.
//!
//! `Store::decide` is an `async fn` whose future is ready on its first poll for `MemoryStore`, so
//! it is driven by polling once with `Waker::noop()` (see `ready`). The "executor" rows compare
//! that with a current-thread tokio runtime: `block_on` per request, and one `block_on` around a
//! batch that `.await`s each decision. Polling once is the cheapest, so every other row uses it.
//!
//! Time: stores run on a `ManualClock` that moves 1 µs every `BATCH` requests (so windows never
//! roll over and every limit is far from full: the measured path includes commits), except the
//! row marked "system clock" and the sliding-log rows, whose log is first filled with N distinct
//! timestamps and whose clock then stays put (the log's cost grows with its length).
//!
//! Rates are per second of this thread's on-CPU time (`/proc/thread-self/schedstat`), so other
//! jobs on this shared 2-core machine taking the core do not count; "on-CPU" shows the share of
//! wall time the thread got. Cases alternate over `RLSD_BENCH_ROUNDS` rounds (default 3) of
//! `RLSD_BENCH_SECONDS` each (default 0.6) and the median round is printed, as
//! `/work/shared/PERF.md` asks. `RLSD_BENCH_KEYS` (default 100000) sets the distinct-key count;
//! `RLSD_BENCH_FILTER` keeps only cases whose name contains it (handy under `perf record`).
//! A counting global allocator reports allocations per request (counted in a separate pass, so
//! the timed loops pay one relaxed load per allocation). Figures only: nothing asserts a timing.
//!
//! Run: `cargo bench --bench engine` (or `RLSD_BENCH_SECONDS=3 cargo bench --bench engine`).

use std::hash::BuildHasher;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rlsd::clock::{Clock, ManualClock, SystemClock};
use rlsd::config::{self, Config};
use rlsd::engine::{self, Descriptor, KeySettings, Request};
use rlsd::store::{MemoryStore, Store, request_allowed};

use rlsd_testkit::counting_alloc::{self, CountingAlloc};
use rlsd_testkit::ready::ready;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Start of a second: 2026-12-02 15:00:00 UTC.
const T0: u64 = 1_796_223_600_000_000;
/// Requests between clock and deadline checks.
const BATCH: u64 = 1024;
/// Requests of the allocation-counting pass after each timed run.
const COUNT_PASS: u64 = 4096;
/// Key cap: never reached here.
const MAX_KEYS: usize = 10_000_000;

/// High limits (u32::MAX is 4_294_967_295): everything is allowed, every check commits.
const CONFIG: &str = r#"
domain: bench
descriptors:
  # One descriptor, fixed window, one hot key.
  - key: hot
    rate_limit:
      unit: second
      requests_per_unit: 4000000000
  # Many users, one key each.
  - key: user
    rate_limit:
      unit: second
      requests_per_unit: 4000000000
  # Mostly denied: 1000 per minute on one hot key.
  - key: denied
    rate_limit:
      unit: minute
      requests_per_unit: 1000
  # Three layers, as examples/three-layer.yaml, with high limits.
  - key: remote_address
    rate_limit:
      name: edge
      unit: second
      requests_per_unit: 4000000000
  - key: plan
    value: pro
    descriptors:
      - key: api_key
        rate_limit:
          name: plan-pro
          unit: second
          requests_per_unit: 4000000000
  - key: endpoint
    value: search
    descriptors:
      - key: api_key
        rate_limit:
          name: endpoint-search
          unit: second
          requests_per_unit: 4000000000
  # One limit per algorithm, as examples/algorithms.yaml, with high limits.
  - key: algorithm
    value: fixed_window
    descriptors:
      - key: user
        rate_limit:
          unit: second
          requests_per_unit: 4000000000
          algorithm: fixed_window
  - key: algorithm
    value: sliding_window_log
    descriptors:
      - key: user
        rate_limit:
          unit: second
          # The config caps sliding logs at 100 000 entries; past that the cases measure denials.
          requests_per_unit: 100000
          algorithm: sliding_window_log
  - key: algorithm
    value: sliding_window_counter
    descriptors:
      - key: user
        rate_limit:
          unit: second
          requests_per_unit: 4000000000
          algorithm: sliding_window_counter
  - key: algorithm
    value: token_bucket
    descriptors:
      - key: user
        rate_limit:
          unit: second
          requests_per_unit: 4000000000
          algorithm: token_bucket
          burst: 4000000000
  - key: algorithm
    value: gcra
    descriptors:
      - key: user
        rate_limit:
          unit: second
          requests_per_unit: 4000000000
          algorithm: gcra
          burst: 4000000000
"#;

/// examples/three-layer.yaml's real limits: a hot api key is soon denied by `endpoint-search`.
const REAL_THREE_LAYER: &str = r#"
domain: edge-proxy
descriptors:
  - key: remote_address
    rate_limit:
      name: edge
      unit: minute
      requests_per_unit: 1000
  - key: plan
    value: pro
    descriptors:
      - key: api_key
        rate_limit:
          name: plan-pro
          unit: minute
          requests_per_unit: 600
  - key: endpoint
    value: search
    descriptors:
      - key: api_key
        rate_limit:
          name: endpoint-search
          unit: minute
          requests_per_unit: 10
"#;

struct Opts {
    seconds: Duration,
    rounds: usize,
    keys: usize,
}

impl Opts {
    fn from_env() -> Opts {
        let var = |name: &str| std::env::var(name).ok();
        let seconds = var("RLSD_BENCH_SECONDS")
            .map(|s| {
                s.parse::<f64>()
                    .expect("RLSD_BENCH_SECONDS is a number of seconds")
            })
            .unwrap_or(0.6);
        Opts {
            seconds: Duration::from_secs_f64(seconds),
            rounds: var("RLSD_BENCH_ROUNDS")
                .map(|s| s.parse().expect("RLSD_BENCH_ROUNDS is a count"))
                .unwrap_or(3)
                .max(1),
            keys: var("RLSD_BENCH_KEYS")
                .map(|s| s.parse().expect("RLSD_BENCH_KEYS is a count"))
                .unwrap_or(100_000)
                .max(1),
        }
    }
}

/// What one run of a case did.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    requests: u64,
    checks: u64,
    allowed: u64,
    denied: u64,
    errors: u64,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    tally: Tally,
    /// Wall time of the timed loop.
    wall: Duration,
    /// Time this thread was on a CPU meanwhile (`wall` if unknown).
    elapsed: Duration,
    allocs_per_request: f64,
}

impl Sample {
    fn requests_per_second(&self) -> f64 {
        self.tally.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// Nanoseconds this thread has spent on a CPU (`/proc/thread-self/schedstat`), so other
/// processes on this shared machine taking the core do not count against the engine.
fn thread_cpu() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Wall and on-CPU time since `wall0` / `cpu0`.
fn times(wall0: Instant, cpu0: Option<Duration>) -> (Duration, Duration) {
    let wall = wall0.elapsed();
    let cpu = cpu0
        .zip(thread_cpu())
        .map_or(wall, |(a, b)| b.saturating_sub(a));
    (wall, cpu)
}

/// Runs `step` for `budget` (or `max` requests), calling `tick` every `BATCH` requests, then
/// counts allocations over `COUNT_PASS` more requests.
fn measure(
    budget: Duration,
    max: u64,
    mut tick: impl FnMut(),
    mut step: impl FnMut(u64, &mut Tally),
) -> Sample {
    let mut tally = Tally::default();
    let cpu0 = thread_cpu();
    let start = Instant::now();
    let mut i = 0;
    while i < max {
        let end = (i + BATCH).min(max);
        while i < end {
            step(i, &mut tally);
            i += 1;
        }
        tick();
        if start.elapsed() >= budget {
            break;
        }
    }
    let (wall, elapsed) = times(start, cpu0);
    tally.requests = i;

    let mut scratch = Tally::default();
    let allocs = counting_alloc::allocations_during(|| {
        for j in i..i + COUNT_PASS {
            step(j, &mut scratch);
        }
    });
    let allocs_per_request = allocs as f64 / COUNT_PASS as f64;
    Sample {
        tally,
        wall,
        elapsed,
        allocs_per_request,
    }
}

/// Plans `request` and decides its checks, tallying the answer.
fn decide_one<S: Store>(
    config: &Config,
    keys: &KeySettings,
    store: &S,
    request: &Request,
    tally: &mut Tally,
) {
    let plan = engine::plan(config, request, keys);
    tally.checks += plan.checks.len() as u64;
    if plan.checks.is_empty() {
        return;
    }
    match ready(store.decide(&plan.checks)) {
        Ok(outcomes) if request_allowed(&plan.checks, &outcomes) => tally.allowed += 1,
        Ok(_) => tally.denied += 1,
        Err(_) => tally.errors += 1,
    }
}

fn descriptor(entries: &[(&str, &str)]) -> Descriptor {
    Descriptor {
        entries: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<Descriptor>) -> Request {
    Request {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

fn one_hot() -> Request {
    request("bench", vec![descriptor(&[("hot", "k")])])
}

fn three_layer(domain: &str, ip: &str, api_key: &str) -> Request {
    request(
        domain,
        vec![
            descriptor(&[("remote_address", ip)]),
            descriptor(&[("plan", "pro"), ("api_key", api_key)]),
            descriptor(&[("endpoint", "search"), ("api_key", api_key)]),
        ],
    )
}

/// `n` descriptors on the `user` limit, one user each: cost growth with descriptors per request.
fn user_descriptors(n: usize) -> Request {
    request(
        "bench",
        (0..n)
            .map(|i| descriptor(&[("user", format!("u{i}").as_str())]))
            .collect(),
    )
}

fn algorithm(name: &str) -> Request {
    request(
        "bench",
        vec![descriptor(&[("algorithm", name), ("user", "alice")])],
    )
}

/// A fresh store on a manual clock, and a tick that moves that clock 1 µs.
fn manual_store() -> (MemoryStore<ManualClock>, impl FnMut()) {
    let clock = ManualClock::at(T0);
    let store = MemoryStore::with_clock(MAX_KEYS, clock.clone());
    (store, move || clock.advance(1))
}

/// The full pipeline on a fresh manual-clock store.
fn pipeline(
    config: &Config,
    budget: Duration,
    max: u64,
    mut make: impl FnMut(u64) -> Request,
) -> Sample {
    let keys = KeySettings::default();
    let (store, tick) = manual_store();
    measure(budget, max, tick, |i, tally| {
        decide_one(config, &keys, &store, &make(i), tally);
    })
}

/// A hot sliding-window-log key whose log holds `entries` distinct timestamps (1 µs apart, all
/// inside the window), then a frozen clock so the log keeps that length.
fn sliding_log_with(config: &Config, entries: u64, budget: Duration) -> Sample {
    let keys = KeySettings::default();
    let clock = ManualClock::at(T0);
    let store = MemoryStore::with_clock(MAX_KEYS, clock.clone());
    let mut warm = Tally::default();
    for _ in 1..entries {
        decide_one(
            config,
            &keys,
            &store,
            &algorithm("sliding_window_log"),
            &mut warm,
        );
        clock.advance(1);
    }
    measure(
        budget,
        u64::MAX / 2,
        || {},
        |_, tally| {
            decide_one(
                config,
                &keys,
                &store,
                &algorithm("sliding_window_log"),
                tally,
            );
        },
    )
}

/// `count` distinct strings `<prefix><n>`.
fn names(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|n| format!("{prefix}{n:07}")).collect()
}

type Run<'a> = Box<dyn Fn(Duration) -> Sample + 'a>;

struct Case<'a> {
    name: String,
    run: Run<'a>,
    samples: Vec<Sample>,
}

impl<'a> Case<'a> {
    fn new(name: impl Into<String>, run: impl Fn(Duration) -> Sample + 'a) -> Case<'a> {
        Case {
            name: name.into(),
            run: Box::new(run),
            samples: Vec::new(),
        }
    }

    /// The median round by requests/s, and the spread.
    fn median(&self) -> (Sample, f64, f64) {
        let mut sorted = self.samples.clone();
        sorted.sort_by(|a, b| a.requests_per_second().total_cmp(&b.requests_per_second()));
        let low = sorted.first().map_or(0.0, Sample::requests_per_second);
        let high = sorted.last().map_or(0.0, Sample::requests_per_second);
        (sorted[sorted.len() / 2], low, high)
    }
}

/// Keeps the cases whose name contains `RLSD_BENCH_FILTER` (all when unset).
fn filtered(cases: Vec<Case<'_>>) -> Vec<Case<'_>> {
    match std::env::var("RLSD_BENCH_FILTER") {
        Ok(filter) => cases
            .into_iter()
            .filter(|c| c.name.contains(&filter))
            .collect(),
        Err(_) => cases,
    }
}

fn run_rounds(cases: &mut [Case<'_>], rounds: usize, budget: Duration) {
    if cases.is_empty() {
        return;
    }
    for round in 0..rounds {
        eprint!("round {}/{rounds}:", round + 1);
        for case in cases.iter_mut() {
            let sample = (case.run)(budget);
            case.samples.push(sample);
            eprint!(".");
        }
        eprintln!();
    }
}

fn print_table(title: &str, cases: &[Case<'_>]) {
    if cases.is_empty() {
        return;
    }
    println!("\n## {title}\n");
    println!(
        "| {:<54} | {:>5} | {:>9} | {:>11} | {:>6} | {:>6} | {:>7} | {:>7} | {:>6} | {:>19} |",
        "case",
        "chk/r",
        "req/s",
        "decisions/s",
        "ns/req",
        "ns/dec",
        "allowed",
        "alloc/r",
        "on-CPU",
        "req/s min..max"
    );
    println!(
        "|{:-<56}|{:->7}|{:->11}|{:->13}|{:->8}|{:->8}|{:->9}|{:->9}|{:->8}|{:->21}|",
        "", "", "", "", "", "", "", "", "", ""
    );
    for case in cases {
        let (sample, low, high) = case.median();
        let t = sample.tally;
        let secs = sample.elapsed.as_secs_f64();
        let per_request = t.checks as f64 / t.requests.max(1) as f64;
        let decided = t.allowed + t.denied + t.errors;
        let allowed = if decided == 0 {
            "-".to_owned()
        } else {
            format!("{:.1}%", 100.0 * t.allowed as f64 / decided as f64)
        };
        let ns_per_decision = if t.checks == 0 {
            "-".to_owned()
        } else {
            format!("{:.0}", secs * 1e9 / t.checks as f64)
        };
        let decisions = if t.checks == 0 {
            "-".to_owned()
        } else {
            si(t.checks as f64 / secs)
        };
        println!(
            "| {:<54} | {:>5.1} | {:>9} | {:>11} | {:>6.0} | {:>6} | {:>7} | {:>7.1} | {:>5.0}% | {:>19} |",
            case.name,
            per_request,
            si(sample.requests_per_second()),
            decisions,
            secs * 1e9 / t.requests.max(1) as f64,
            ns_per_decision,
            allowed,
            sample.allocs_per_request,
            100.0 * secs / sample.wall.as_secs_f64(),
            format!("{}..{}", si(low), si(high)),
        );
        if t.errors > 0 {
            println!(
                "!!! {}: {} STORE ERRORS: the figures above are not valid",
                case.name, t.errors
            );
        }
    }
}

fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not supported (run everything).
    let opts = Opts::from_env();
    let mut config = Config::default();
    for (file, yaml) in [
        ("bench.yaml", CONFIG),
        ("three-layer.yaml", REAL_THREE_LAYER),
    ] {
        let domain = config::load_str(file, yaml)
            .unwrap_or_else(|errors| panic!("bench config is invalid: {errors:?}"));
        config.domains.insert(domain.name.clone(), domain);
    }
    let config = &config;
    let keys = KeySettings::default();
    let users = names("user-", opts.keys);
    let ips = names("10.0.", opts.keys);
    let api_keys = names("key-", opts.keys);
    let n = opts.keys as u64;
    let unbounded = u64::MAX / 2;

    println!(
        "# rlsd engine bench: one thread, {} round(s) x {:.2} s per case, median round shown",
        opts.rounds,
        opts.seconds.as_secs_f64()
    );
    println!("# one decision = one check; allowed = requests whose every check passed");
    println!(
        "# sizes: Check {} B, State {} B, Outcome {} B, Request {} B, Descriptor {} B",
        std::mem::size_of::<rlsd::store::Check>(),
        std::mem::size_of::<rlsd::algorithm::State>(),
        std::mem::size_of::<rlsd::store::Outcome>(),
        std::mem::size_of::<Request>(),
        std::mem::size_of::<Descriptor>(),
    );
    println!(
        "# rates use this thread's on-CPU time (on-CPU = its share of wall time; the rest went to"
    );
    println!(
        "# other processes on this shared machine); alloc/r counted over {COUNT_PASS} more requests"
    );

    // Warm up caches, the allocator and the CPU clock.
    let _ = pipeline(config, Duration::from_millis(300), unbounded, |_| one_hot());

    let main_cases = vec![
        Case::new("(a) 1 descriptor, fixed window, hot key", |budget| {
            pipeline(config, budget, unbounded, |_| one_hot())
        }),
        Case::new("(a) same, system clock", |budget| {
            let store = MemoryStore::new(MAX_KEYS);
            let keys = KeySettings::default();
            measure(
                budget,
                unbounded,
                || {},
                |_, tally| {
                    decide_one(config, &keys, &store, &one_hot(), tally);
                },
            )
        }),
        Case::new("(b) 3 layers (3 descriptors), hot keys", |budget| {
            pipeline(config, budget, unbounded, |_| {
                three_layer("bench", "10.0.0.1", "key-1")
            })
        }),
        Case::new("(f) 1 descriptor [user], hot key", |budget| {
            pipeline(config, budget, unbounded, |_| user_descriptors(1))
        }),
        Case::new("(f) 10 descriptors [user] in one request", |budget| {
            pipeline(config, budget, unbounded, |_| user_descriptors(10))
        }),
        Case::new("(c) fixed_window [algorithm, user]", |budget| {
            pipeline(config, budget, unbounded, |_| algorithm("fixed_window"))
        }),
        Case::new("(c) sliding_window_counter [algorithm, user]", |budget| {
            pipeline(config, budget, unbounded, |_| {
                algorithm("sliding_window_counter")
            })
        }),
        Case::new("(c) token_bucket [algorithm, user]", |budget| {
            pipeline(config, budget, unbounded, |_| algorithm("token_bucket"))
        }),
        Case::new("(c) gcra [algorithm, user]", |budget| {
            pipeline(config, budget, unbounded, |_| algorithm("gcra"))
        }),
        Case::new(
            "(c) sliding_window_log, clock frozen (1 log entry)",
            |budget| {
                let store = MemoryStore::with_clock(MAX_KEYS, ManualClock::at(T0));
                measure(
                    budget,
                    unbounded,
                    || {},
                    |_, tally| {
                        decide_one(
                            config,
                            &keys,
                            &store,
                            &algorithm("sliding_window_log"),
                            tally,
                        );
                    },
                )
            },
        ),
        Case::new("(c) sliding_window_log, 100 live log entries", |budget| {
            sliding_log_with(config, 100, budget)
        }),
        Case::new("(c) sliding_window_log, 1000 live log entries", |budget| {
            sliding_log_with(config, 1000, budget)
        }),
        Case::new(
            format!("(d) {n} users round robin: first pass (inserts)"),
            |budget| {
                pipeline(config, budget.max(Duration::from_secs(60)), n, |i| {
                    request(
                        "bench",
                        vec![descriptor(&[("user", &users[(i % n) as usize])])],
                    )
                })
            },
        ),
        Case::new(
            format!("(d) {n} users round robin: steady (lookups)"),
            |budget| {
                let (store, mut tick) = manual_store();
                let keys = KeySettings::default();
                let make = |i: u64| {
                    request(
                        "bench",
                        vec![descriptor(&[("user", &users[(i % n) as usize])])],
                    )
                };
                let mut warm = Tally::default();
                for i in 0..n {
                    decide_one(config, &keys, &store, &make(i), &mut warm);
                }
                tick();
                measure(budget, unbounded, tick, |i, tally| {
                    decide_one(config, &keys, &store, &make(i), tally);
                })
            },
        ),
        Case::new(
            format!("(d) 3 layers, {n} clients round robin: steady"),
            |budget| {
                let (store, mut tick) = manual_store();
                let keys = KeySettings::default();
                let make = |i: u64| {
                    let c = (i % n) as usize;
                    three_layer("bench", &ips[c], &api_keys[c])
                };
                let mut warm = Tally::default();
                for i in 0..n {
                    decide_one(config, &keys, &store, &make(i), &mut warm);
                }
                tick();
                measure(budget, unbounded, tick, |i, tally| {
                    decide_one(config, &keys, &store, &make(i), tally);
                })
            },
        ),
        Case::new(
            "(e) mostly denied: 1 descriptor, 1000/min, hot key",
            |budget| {
                pipeline(config, budget, unbounded, |_| {
                    request("bench", vec![descriptor(&[("denied", "k")])])
                })
            },
        ),
        Case::new(
            "(e) mostly denied: 3 layers, real limits (10/min)",
            |budget| {
                pipeline(config, budget, unbounded, |_| {
                    three_layer("edge-proxy", "10.0.0.1", "key-1")
                })
            },
        ),
    ];
    let mut main_cases = filtered(main_cases);
    run_rounds(&mut main_cases, opts.rounds, opts.seconds);
    print_table(
        "Engine: build request + plan + MemoryStore::decide, one thread",
        &main_cases,
    );

    // Where the time goes: each stage alone, and a few primitives. One round each.
    let budget = opts.seconds;
    let hot_plan_checks = engine::plan(config, &one_hot(), &keys).checks;
    let three_request = three_layer("bench", "10.0.0.1", "key-1");
    let three_plan = engine::plan(config, &three_request, &keys);
    let three_checks = three_plan.checks.clone();
    let hasher = foldhash::fast::RandomState::default();
    let shard = Mutex::new(0_u64);
    let stages = vec![
        Case::new("1 desc: build Request only", |budget| {
            measure(budget, unbounded, || {}, |_, _| drop(black_box(one_hot())))
        }),
        Case::new("1 desc: build + plan", |budget| {
            measure(
                budget,
                unbounded,
                || {},
                |_, tally| {
                    tally.checks += black_box(engine::plan(config, &one_hot(), &keys))
                        .checks
                        .len() as u64;
                },
            )
        }),
        Case::new("1 desc: decide only (checks planned once)", |budget| {
            let (store, tick) = manual_store();
            measure(budget, unbounded, tick, |_, tally| {
                tally.checks += hot_plan_checks.len() as u64;
                match ready(store.decide(&hot_plan_checks)) {
                    Ok(_) => tally.allowed += 1,
                    Err(_) => tally.errors += 1,
                }
            })
        }),
        Case::new("3 layers: build Request only", |budget| {
            measure(
                budget,
                unbounded,
                || {},
                |_, _| drop(black_box(three_layer("bench", "10.0.0.1", "key-1"))),
            )
        }),
        Case::new("3 layers: build + plan", |budget| {
            measure(
                budget,
                unbounded,
                || {},
                |_, tally| {
                    let request = three_layer("bench", "10.0.0.1", "key-1");
                    tally.checks += black_box(engine::plan(config, &request, &keys))
                        .checks
                        .len() as u64;
                },
            )
        }),
        Case::new("3 layers: plan only (request built once)", |budget| {
            measure(
                budget,
                unbounded,
                || {},
                |_, tally| {
                    tally.checks +=
                        black_box(engine::plan(config, black_box(&three_request), &keys))
                            .checks
                            .len() as u64;
                },
            )
        }),
        Case::new("3 layers: decide only (checks planned once)", |budget| {
            let (store, tick) = manual_store();
            measure(budget, unbounded, tick, |_, tally| {
                tally.checks += three_checks.len() as u64;
                match ready(store.decide(&three_checks)) {
                    Ok(_) => tally.allowed += 1,
                    Err(_) => tally.errors += 1,
                }
            })
        }),
        Case::new("primitive: key::encode, 2-entry descriptor", |budget| {
            let limit = &three_plan.limits[1].limit;
            let entries = &three_request.descriptors[1].entries;
            measure(
                budget,
                unbounded,
                || {},
                |_, _| {
                    drop(black_box(engine::key::encode(
                        &keys,
                        "_",
                        "bench",
                        limit,
                        black_box(entries),
                    )));
                },
            )
        }),
        Case::new(
            format!(
                "primitive: foldhash of a {}-byte key",
                three_checks[1].key.len()
            ),
            |budget| {
                let key = three_checks[1].key.as_str();
                measure(
                    budget,
                    unbounded,
                    || {},
                    |_, _| {
                        black_box(hasher.hash_one(black_box(key)));
                    },
                )
            },
        ),
        Case::new("primitive: uncontended Mutex lock + unlock", |budget| {
            measure(
                budget,
                unbounded,
                || {},
                |_, _| {
                    *black_box(&shard).lock().expect("not poisoned") += 1;
                },
            )
        }),
        Case::new("primitive: SystemClock::now_us", |budget| {
            measure(
                budget,
                unbounded,
                || {},
                |_, _| {
                    black_box(SystemClock.now_us());
                },
            )
        }),
    ];
    let mut stages = filtered(stages);
    run_rounds(&mut stages, 1, budget);
    print_table(
        "Where the time goes (one round each; decisions here = checks planned)",
        &stages,
    );

    // How to drive the store's future: poll once vs a tokio current-thread runtime.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let executors = vec![
        Case::new("(a) with Waker::noop() poll once (used above)", |budget| {
            pipeline(config, budget, unbounded, |_| one_hot())
        }),
        Case::new("(a) with tokio block_on per request", |budget| {
            let (store, tick) = manual_store();
            measure(budget, unbounded, tick, |_, tally| {
                let request = one_hot();
                let plan = engine::plan(config, &request, &keys);
                tally.checks += plan.checks.len() as u64;
                match runtime.block_on(store.decide(&plan.checks)) {
                    Ok(o) if request_allowed(&plan.checks, &o) => tally.allowed += 1,
                    Ok(_) => tally.denied += 1,
                    Err(_) => tally.errors += 1,
                }
            })
        }),
        Case::new(
            "(a) with tokio block_on per batch of 1024, .await each",
            |budget| {
                let (store, mut tick) = manual_store();
                let mut tally = Tally::default();
                let cpu0 = thread_cpu();
                let start = Instant::now();
                while start.elapsed() < budget {
                    runtime.block_on(async {
                        for _ in 0..BATCH {
                            let request = one_hot();
                            let plan = engine::plan(config, &request, &keys);
                            tally.checks += plan.checks.len() as u64;
                            match store.decide(&plan.checks).await {
                                Ok(o) if request_allowed(&plan.checks, &o) => tally.allowed += 1,
                                Ok(_) => tally.denied += 1,
                                Err(_) => tally.errors += 1,
                            }
                        }
                    });
                    tally.requests += BATCH;
                    tick();
                }
                let (wall, elapsed) = times(start, cpu0);
                Sample {
                    tally,
                    wall,
                    elapsed,
                    allocs_per_request: f64::NAN,
                }
            },
        ),
    ];
    let mut executors = filtered(executors);
    run_rounds(&mut executors, opts.rounds, opts.seconds);
    print_table("Driving MemoryStore::decide's future", &executors);

    let rate = |s: &Sample| s.tally.checks as f64 / s.elapsed.as_secs_f64();
    for prefix in ["(a) 1 descriptor", "(b) 3 layers", "(d) 3 layers"] {
        if let Some(case) = main_cases.iter().find(|c| c.name.starts_with(prefix)) {
            let (sample, _, _) = case.median();
            println!(
                "Target >= 2 M decisions/s per core, {}: {} decisions/s [{}]",
                case.name,
                si(rate(&sample)),
                if rate(&sample) >= 2e6 {
                    "met"
                } else {
                    "NOT met"
                },
            );
        }
    }
}
