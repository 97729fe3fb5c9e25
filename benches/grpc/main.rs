//! The gRPC bench: rlsd over real gRPC on loopback, in process and on Redis, against a
//! do-nothing tonic server (`baseline`) and `redis-benchmark` on the same Redis, in one run.
//!
//! [docs/benchmarks.md](../../docs/benchmarks.md) says what it measures and how, and lists every
//! `RLSD_BENCH_*` setting ([`opts`]). The servers it drives are in [`servers`], the load
//! generators and their loops in [`phases`], the `redis-benchmark` ceiling in [`ceiling`], the
//! tables and ratios in [`report`] and the SVG in [`plot`].
//!
//! Run: `cargo bench --bench grpc`.

mod ceiling;
mod opts;
mod phases;
mod plot;
mod pooled;
mod report;
mod servers;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rlsd::pb::RateLimitRequest;
use rlsd_testkit::redis::RedisServer;
use rlsd_testkit::workload::Shape;
use rlsd_testkit::{h2load, rawh2, stalls};
use tokio::runtime::Runtime;

use crate::ceiling::{Ceiling, median_ceiling, redis_benchmark};
use crate::opts::{Driver, Opts};
use crate::phases::{
    Phase, REDIS_PID, closed_loop, h2load_phase, lean_load, open_loop, raw_phase, runtime,
    sample_evalsha_calls,
};
use crate::plot::plot;
use crate::report::{Row, peak_results, print_rows};
use crate::servers::{Client, Served, connect, pool, start_servers};

/// The binary's allocator, so the servers here run as `rlsd serve` does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Distinct clients (IP + API key) the requests cycle through.
const CLIENTS: usize = 1000;
const WARMUP: Duration = Duration::from_millis(500);

fn uses_redis(server: &str) -> bool {
    server.starts_with("redis") || server.starts_with("pool")
}

/// A peak phase's measurements, by shape: every server's rounds, the ceiling's rounds and
/// (with the tonic client) the rounds of `redis-benchmark` with coalesced-size calls.
struct PeakRounds {
    runs: Vec<Vec<Vec<Phase>>>,
    ceilings: Vec<Vec<Ceiling>>,
    batched: Vec<Vec<Ceiling>>,
}

/// Runs `opts.rounds` rounds of `driver`'s peak phase: in each round and for each shape, the
/// ceiling on the keys that client sends, then `drive(shape, server)` for every server.
fn peak_rounds(
    driver: Driver,
    (shapes, servers): (&[Shape], usize),
    redis: Option<&RedisServer>,
    opts: &Opts,
    mut drive: impl FnMut(usize, usize) -> Phase,
) -> PeakRounds {
    let mut rounds = PeakRounds {
        runs: vec![vec![Vec::new(); servers]; shapes.len()],
        ceilings: vec![Vec::new(); shapes.len()],
        batched: vec![Vec::new(); shapes.len()],
    };
    for round in 0..opts.rounds {
        eprintln!("{} round {}/{}", driver.phase(), round + 1, opts.rounds);
        for (s, shape) in shapes.iter().enumerate() {
            if let Some(redis) = redis {
                let (algorithm, seconds, keys) =
                    (&opts.algorithm, opts.seconds, driver.ceiling_keys());
                rounds.ceilings[s].push(redis_benchmark(
                    redis,
                    (*shape, 1),
                    algorithm,
                    seconds,
                    keys,
                ));
                if driver == Driver::Tonic {
                    // As large a call as the coalescing store sends for this shape.
                    let per_call = opts
                        .max_batch
                        .min(rlsd::store::redis::MAX_BATCH_CHECKS / shape.descriptors())
                        .max(1);
                    rounds.batched[s].push(redis_benchmark(
                        redis,
                        (*shape, per_call),
                        algorithm,
                        seconds,
                        keys,
                    ));
                }
            }
            for v in 0..servers {
                rounds.runs[s][v].push(drive(s, v));
            }
        }
    }
    rounds
}

/// What the plot shows of one server.
struct Plotted {
    server: &'static str,
    /// Peak req/s by driver, then by shape in `opts.shapes` order (0 where not measured).
    peaks: Vec<Vec<f64>>,
    /// By driver: p50, p99 and p999 (ms) in the open loop at the first open fraction of its
    /// own peak.
    open: Vec<Option<[f64; 3]>>,
}

/// What every phase drives: the client runtime, the requests by shape and the servers.
struct Bench {
    opts: Opts,
    client_rt: Runtime,
    pools: Vec<(Shape, Arc<Vec<RateLimitRequest>>)>,
    shapes: Vec<Shape>,
    /// Each server's address, and rlsd's counters (how the h2load phase checks answers).
    addrs: Vec<(&'static str, Served)>,
    /// Each server's tonic clients, in `addrs` order.
    servers: Vec<(&'static str, Vec<Client>)>,
    names: Vec<&'static str>,
    redis: Option<RedisServer>,
    /// The shape the open-loop phases use: three layers when measured.
    open_shape: usize,
}

/// What the phases found, for the tables, the summary lines and the plot.
struct Results {
    rows: Vec<Row>,
    summary: Vec<String>,
    plotted: Vec<Plotted>,
    /// By driver: each server's peak on the open-loop shape.
    own_peak: Vec<Vec<Option<f64>>>,
    /// By driver and shape: the median ceiling.
    ceilings: Vec<Vec<Option<Ceiling>>>,
    /// redis-benchmark with coalesced-size calls: Redis's cost per decision without rlsd.
    batched: Vec<Option<Ceiling>>,
}

fn main() {
    // As `rlsd serve` does (the servers' lanes run in this process); `RLSD_BENCH_THP=1` keeps
    // transparent huge pages on, as `--transparent-huge-pages` does.
    if std::env::var("RLSD_BENCH_THP").as_deref() != Ok("1") {
        rlsd::server::disable_transparent_huge_pages().expect("prctl(PR_SET_THP_DISABLE)");
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("RLSD_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let opts = Opts::from_env();
    // Before anything of the bench runs: the machine's own stalls.
    let stalls_before = (!opts.stall_probe.is_zero()).then(|| stalls::probe(opts.stall_probe));
    let client_rt = runtime(opts.client_threads, "bench-client");
    let server_rt = (!opts.shared).then(|| runtime(opts.server_threads, "bench-server"));
    let server_handle = server_rt
        .as_ref()
        .map_or_else(|| client_rt.handle().clone(), |rt| rt.handle().clone());
    let pools: Vec<(Shape, Arc<Vec<RateLimitRequest>>)> = opts
        .shapes
        .iter()
        .map(|&shape| (shape, pool(shape)))
        .collect();
    let redis_installed = Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok();
    if opts.redis && !redis_installed {
        println!(
            "note: redis-server is not installed: the Redis store and its ceiling are skipped"
        );
    }
    let redis = (opts.redis && redis_installed).then(|| RedisServer::start_for_bench(&[]));
    if let Some(redis) = &redis {
        let _ = REDIS_PID.set((redis.pid(), redis.port));
        sample_evalsha_calls(redis.port);
    }
    let (addrs, traced) = start_servers(&opts, &server_handle, &client_rt, &pools, redis.as_ref());
    let servers: Vec<(&'static str, Vec<Client>)> = client_rt.block_on(async {
        let mut servers = Vec::new();
        for (name, (addr, _)) in &addrs {
            servers.push((*name, connect(*addr, opts.connections).await));
        }
        servers
    });
    print_header(&opts, stalls_before.as_deref());

    let shapes: Vec<Shape> = pools.iter().map(|(shape, _)| *shape).collect();
    let open_shape = pools
        .iter()
        .position(|(shape, _)| *shape == Shape::ThreeLayer)
        .unwrap_or(0);
    let bench = Bench {
        names: servers.iter().map(|(name, _)| *name).collect(),
        opts,
        client_rt,
        pools,
        shapes,
        addrs,
        servers,
        redis,
        open_shape,
    };
    let mut results = Results {
        rows: Vec::new(),
        summary: Vec::new(),
        plotted: bench
            .names
            .iter()
            .map(|server| Plotted {
                server,
                peaks: vec![vec![0.0; bench.shapes.len()]; Driver::ALL.len()],
                open: vec![None; Driver::ALL.len()],
            })
            .collect(),
        own_peak: vec![vec![None; bench.servers.len()]; Driver::ALL.len()],
        ceilings: vec![vec![None; bench.shapes.len()]; Driver::ALL.len()],
        batched: vec![None; bench.shapes.len()],
    };
    bench.peak_phases(&mut results);
    bench.open_phases(&mut results);
    bench.single_phases(&mut results);
    print_results(&bench, &results, stalls_before.as_deref());

    let Bench {
        servers, client_rt, ..
    } = bench;
    drop(servers);
    if let Some((telemetry, sink)) = traced {
        server_handle.block_on(telemetry.shutdown());
        println!(
            "rlsd-traced: {} spans received by the OTLP sink (two per request exported; the \
             batch processor drops spans when its queue of 2048 is full)",
            sink.spans.load(Ordering::Relaxed)
        );
    }
    client_rt.shutdown_timeout(Duration::from_secs(1));
    if let Some(rt) = server_rt {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}

/// What the run is, before its tables.
fn print_header(opts: &Opts, stalls_before: Option<&[stalls::CpuStalls]>) {
    println!(
        "# rlsd gRPC bench: {} connections x {} in flight, {:.1} s per phase, {} round(s), {} limits, {}",
        opts.connections,
        opts.inflight,
        opts.seconds.as_secs_f64(),
        opts.rounds,
        opts.algorithm,
        if opts.shared {
            format!("one shared runtime of {} workers", opts.client_threads)
        } else {
            format!(
                "server runtime {} workers, rlsd on {} lanes each, client runtime {} workers",
                opts.server_threads, opts.lanes, opts.client_threads
            )
        }
    );
    println!(
        "# servers: baseline = tonic server that answers OK and does nothing else; rlsd = in-process store; \
         floor = the baseline's handler on rlsd's own HTTP/2 stack (lanes, connections, codec); \
         redis = Redis store, coalescing; redis-1 = Redis store, one EVALSHA per request"
    );
    if opts.pool {
        println!(
            "# RLSD_BENCH_POOL=1: pool = rlsd on a deadpool-redis pool, coalescing as the store does; \
             pool-1 = the same pool, one EVALSHA per request"
        );
    }
    println!("# CPU columns: µs of CPU per request (and % of one core over the phase)");
    if let Some(stalls) = stalls_before {
        println!(
            "# machine stalls before the phases (a pinned thread per CPU reading the clock for {:.1} s): {}",
            opts.stall_probe.as_secs_f64(),
            stalls::line(stalls)
        );
    }
    if rawh2::unix_enabled() {
        println!(
            "# RLSD_BENCH_UNIX=1: the lean client reaches every rlsd over a Unix socket (the baseline, tonic's clients and h2load over TCP)"
        );
    }
    if opts.extra {
        println!(
            "# extra servers: canned = replays rlsd's captured response (same bytes, no work); \
             rlsd-svc = rlsd's RateLimiter on the baseline's tonic setup instead of server::run; \
             rlsd-nohdr = rlsd-svc without x-ratelimit headers"
        );
    }
}

impl Bench {
    fn runs(&self, phase: &str) -> bool {
        self.opts.phases.iter().any(|p| p == phase)
    }

    /// The peak phases: closed loop, servers (and the redis-benchmark ceiling) alternating
    /// within each round, once per load generator.
    fn peak_phases(&self, results: &mut Results) {
        let (opts, pools, shapes, servers) = (&self.opts, &self.pools, &self.shapes, &self.servers);
        let h2load_dir = std::env::temp_dir().join(format!("rlsd-bench-{}", std::process::id()));
        for (d, driver) in Driver::ALL.into_iter().enumerate() {
            if !self.runs(driver.phase()) {
                continue;
            }
            let redis = self.redis.as_ref();
            let rounds = match driver {
                Driver::Tonic => {
                    peak_rounds(driver, (shapes, servers.len()), redis, opts, |s, v| {
                        self.client_rt.block_on(closed_loop(
                            &servers[v].1,
                            opts.inflight,
                            Arc::clone(&pools[s].1),
                            opts.seconds,
                        ))
                    })
                }
                Driver::H2load if !h2load::installed() => {
                    println!(
                        "note: h2load is not installed (Debian package nghttp2-client): the h2load phase is skipped"
                    );
                    continue;
                }
                Driver::H2load => {
                    std::fs::create_dir_all(&h2load_dir).expect("bench temp dir");
                    let log = h2load_dir.join("h2load.log");
                    let bodies: Vec<PathBuf> = pools
                        .iter()
                        .map(|(shape, requests)| {
                            let path = h2load_dir.join(format!("body-{}.bin", shape.descriptors()));
                            std::fs::write(&path, h2load::grpc_body(&requests[0]))
                                .expect("body file");
                            path
                        })
                        .collect();
                    peak_rounds(driver, (shapes, servers.len()), redis, opts, |s, v| {
                        let (addr, metrics) = &self.addrs[v].1;
                        h2load_phase(
                            *addr,
                            metrics.as_deref(),
                            &bodies[s],
                            shapes[s].descriptors(),
                            opts,
                            &log,
                        )
                    })
                }
                Driver::Raw => peak_rounds(driver, (shapes, servers.len()), redis, opts, |s, v| {
                    let load = lean_load(opts, (opts.connections, opts.inflight), None);
                    raw_phase(self.addrs[v].1.0, &pools[s].1, load)
                }),
            };
            for (s, shape) in shapes.iter().enumerate() {
                let medians = peak_results(
                    (driver.phase(), *shape, &self.names),
                    &rounds.runs[s],
                    (driver.ceiling_name(), &rounds.ceilings[s]),
                    opts,
                    (&mut results.summary, &mut results.rows),
                );
                if !rounds.ceilings[s].is_empty() {
                    results.ceilings[d][s] = Some(median_ceiling(&rounds.ceilings[s]));
                }
                if !rounds.batched[s].is_empty() {
                    results.batched[s] = Some(median_ceiling(&rounds.batched[s]));
                }
                for (v, phase) in medians.iter().enumerate() {
                    results.plotted[v].peaks[d][s] = phase.rate();
                    if s == self.open_shape {
                        results.own_peak[d][v] = Some(phase.rate());
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&h2load_dir);
    }

    /// Open loops at fractions of each server's own peak with that client (or a fixed rate),
    /// on the three-layer shape: the tonic client with a pacer thread of its own (counted as
    /// client CPU), and the lean client pacing itself.
    fn open_phases(&self, results: &mut Results) {
        let (opts, servers) = (&self.opts, &self.servers);
        for (d, driver) in Driver::ALL.into_iter().enumerate() {
            let Some(phase_name) = driver.open_phase() else {
                continue;
            };
            if !self.runs(phase_name) {
                continue;
            }
            let (shape, requests) = &self.pools[self.open_shape];
            for (f, fraction) in opts.open_fractions.iter().enumerate() {
                // Each server's rate: its own peak with this client, else with the tonic client.
                let rates: Vec<(f64, Option<f64>, &str)> = (0..servers.len())
                    .map(|v| {
                        let (peak, of) = match results.own_peak[d][v] {
                            Some(peak) => (Some(peak), driver.phase()),
                            None => (results.own_peak[0][v], Driver::Tonic.phase()),
                        };
                        let rate = match (opts.open_rate, peak) {
                            (Some(rate), _) => rate,
                            (None, Some(peak)) => peak * fraction,
                            (None, None) => 5_000.0,
                        };
                        (rate, peak, of)
                    })
                    .collect();
                // Rounds alternate the servers, as the peak phases do: one run's p99 swings
                // several fold on these shared cores, so the row is the run with the median p99.
                let mut runs: Vec<Vec<Phase>> = vec![Vec::new(); servers.len()];
                for round in 0..opts.rounds {
                    for (v, (server, clients)) in servers.iter().enumerate() {
                        let rate = rates[v].0;
                        eprintln!(
                            "{phase_name} {server} at {rate:.0}/s, round {}/{}",
                            round + 1,
                            opts.rounds
                        );
                        runs[v].push(match driver {
                            Driver::Raw => {
                                let load = lean_load(opts, (opts.connections, 1000), Some(rate));
                                raw_phase(self.addrs[v].1.0, requests, load)
                            }
                            _ => {
                                let handle = self.client_rt.handle().clone();
                                let requests = Arc::clone(requests);
                                let seconds = opts.seconds;
                                std::thread::scope(|scope| {
                                    std::thread::Builder::new()
                                        .name("bench-client-pacer".to_owned())
                                        .spawn_scoped(scope, || {
                                            open_loop(&handle, clients, requests, rate, seconds)
                                        })
                                        .expect("pacer thread")
                                        .join()
                                        .expect("pacer")
                                })
                            }
                        });
                    }
                }
                for (v, (server, _)) in servers.iter().enumerate() {
                    let (rate, peak, of) = rates[v];
                    let mut by_p99: Vec<(f64, Phase)> = std::mem::take(&mut runs[v])
                        .into_iter()
                        .map(|phase| (Phase::percentile(&phase.latencies_us, 0.99), phase))
                        .collect();
                    by_p99.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let spread = match (by_p99.first(), by_p99.last()) {
                        (Some(low), Some(high)) if by_p99.len() > 1 => {
                            format!(
                                ", median p99 of {}: {:.2}-{:.2} ms",
                                by_p99.len(),
                                low.0,
                                high.0
                            )
                        }
                        _ => String::new(),
                    };
                    let phase = by_p99.swap_remove(by_p99.len() / 2).1;
                    if f == 0 {
                        let l = &phase.latencies_us;
                        results.plotted[v].open[d] =
                            Some([0.5, 0.99, 0.999].map(|q| Phase::percentile(l, q)));
                    }
                    let share = peak.map_or(String::new(), |peak| {
                        format!(" ({:.0}% {of} pk)", 100.0 * rate / peak)
                    });
                    results.rows.push(Row {
                        phase: format!(
                            "{phase_name} {rate:.0}/s{share}{spread}, {}",
                            shape.label()
                        ),
                        server,
                        result: phase,
                    });
                }
            }
        }
    }

    /// One request in flight, with each client that has such a phase.
    fn single_phases(&self, results: &mut Results) {
        for driver in Driver::ALL {
            let Some(phase_name) = driver.single_phase() else {
                continue;
            };
            if !self.runs(phase_name) {
                continue;
            }
            for (shape, requests) in &self.pools {
                for (v, (server, clients)) in self.servers.iter().enumerate() {
                    eprintln!("{phase_name} {server} {}", shape.label());
                    let phase = match driver {
                        Driver::Raw => {
                            let load = lean_load(&self.opts, (1, 1), None);
                            raw_phase(self.addrs[v].1.0, requests, load)
                        }
                        _ => self.client_rt.block_on(closed_loop(
                            &clients[..1],
                            1,
                            Arc::clone(requests),
                            self.opts.seconds,
                        )),
                    };
                    let client = if driver == Driver::Raw { ", lean" } else { "" };
                    results.rows.push(Row {
                        phase: format!("1 in flight{client}, {}", shape.label()),
                        server,
                        result: phase,
                    });
                }
            }
        }
    }
}

/// The tables, the ceilings, the summary lines, the stalls, the verdict on the answers and the
/// plot.
fn print_results(bench: &Bench, results: &Results, stalls_before: Option<&[stalls::CpuStalls]>) {
    let (opts, shapes) = (&bench.opts, &bench.shapes);
    println!();
    print_rows(&results.rows, opts.shared);
    println!();
    for (d, driver) in Driver::ALL.into_iter().enumerate() {
        for (s, shape) in shapes.iter().enumerate() {
            if let Some(c) = results.ceilings[d][s] {
                println!(
                    "{:<26} ({:<6} rounds) {:<15}: {:>8.0} calls/s, Redis CPU {:.1} µs/call",
                    driver.ceiling_name(),
                    driver.phase(),
                    shape.label(),
                    c.calls_per_second,
                    c.redis_us_per_call
                );
            }
        }
    }
    for (s, shape) in shapes.iter().enumerate() {
        if let (Some(b), Some(c)) = (results.batched[s], results.ceilings[0][s]) {
            let per_decision = b.redis_us_per_call / b.requests_per_call as f64;
            println!(
                "redis-benchmark, {} requests per call,  {:<15}: {:>8.0} decisions/s, Redis CPU {:.1} µs/decision ({:.2}x of one request per call)",
                b.requests_per_call,
                shape.label(),
                b.calls_per_second * b.requests_per_call as f64,
                per_decision,
                per_decision / c.redis_us_per_call
            );
        }
    }
    for line in &results.summary {
        println!("{line}");
    }
    if let Some(before) = stalls_before {
        // Again with the servers idle: how the host behaved over the run, at both ends.
        println!(
            "machine stalls before the phases: {}\nmachine stalls after the phases:  {}",
            stalls::line(before),
            stalls::line(&stalls::probe(opts.stall_probe))
        );
    }
    let failed = results.rows.iter().any(|r| {
        r.result.counts.errors > 0 || r.result.counts.wrong > 0 || r.result.counts.over_limit > 0
    });
    if failed {
        println!(
            "!!!!!! SOME REQUESTS FAILED OR WERE ANSWERED WRONGLY: see above; figures are suspect"
        );
    } else {
        println!("all answers correct: every request OK with one OK status per descriptor");
    }
    let plotted = &results.plotted;
    if plotted
        .iter()
        .any(|p| p.peaks.iter().flatten().any(|r| *r > 0.0))
    {
        let svg = plot(opts, (shapes, bench.open_shape), &results.ceilings, plotted);
        match std::fs::write(&opts.plot, svg) {
            Ok(()) => println!("plot: {}", opts.plot.display()),
            Err(error) => println!("plot not written to {}: {error}", opts.plot.display()),
        }
    }
}
