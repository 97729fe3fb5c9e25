//! The bench tool: rlsd over real gRPC on loopback, with the in-process and the Redis store,
//! against a do-nothing tonic server and against `redis-benchmark` in the same run.
//!
//! Servers in this process, all driven by the same tonic client code (HTTP/2, one connection per
//! channel, many streams each):
//! - `baseline`: implements the same `RateLimitService` trait and answers OK with one OK status
//!   per descriptor at once, served by tonic with `server::run`'s settings (TCP_NODELAY, 30 s
//!   HTTP/2 keepalive, 1024 concurrent streams);
//! - `rlsd`: `server::run` with `MemoryStore::new` on the system clock;
//! - `redis`: `server::run` with the Redis store, coalescing concurrent requests (default
//!   `max_batch`), on a private redis-server the bench starts on a free loopback port;
//!   `RLSD_BENCH_MAX_BATCH` and `RLSD_BENCH_PIPELINES` set its `--redis-max-batch` and
//!   `--redis-pipelines`;
//! - `redis-1`: the same with one EVALSHA per request (`max_batch` 1).
//!
//! Every server uses default `ServiceSettings` (so `x-ratelimit-*` headers are on) and the config
//! of `rlsd_testkit::workload`: limits so high that every request is allowed, on
//! `RLSD_BENCH_ALGORITHM` (gcra), requests of 1, 3 (three layers) or 10 descriptors
//! (`RLSD_BENCH_SHAPES`, default `1,3,10`) over 1000 distinct clients. `RLSD_BENCH_REDIS=0`
//! leaves Redis out. `RLSD_BENCH_EXTRA=1` adds diagnostic servers: `canned` replays rlsd's own
//! captured answers (same bytes on the wire, no work), `rlsd-svc` serves rlsd's `RateLimiter`
//! with the baseline's setup instead of `server::run`, `rlsd-nohdr` is that with
//! `HeaderStyle::Off` (no `x-ratelimit-*` headers).
//!
//! The ceiling: in every round and for every shape, `redis-benchmark -c 50` calls the Redis
//! store's script on the same Redis with the keys and arguments rlsd sends for one request of
//! that shape (each key's value one of 1000 random clients). `redis` and `redis-1` are quoted as
//! a ratio of it, the in-process store as a ratio of `baseline`.
//!
//! The machine's own stalls, in every tail: before the phases and after them, a pinned thread
//! per CPU reads the clock for `RLSD_BENCH_STALL_PROBE` seconds (default 2; 0 skips), and the
//! bench prints the share of each CPU's time taken away in gaps of 50 µs or more, how many gaps
//! a second reached 1 ms, and the longest. `RLSD_BENCH_THP=1` leaves transparent huge pages on
//! in the bench's process (where the servers run), as `rlsd serve --transparent-huge-pages`.
//!
//! Phases (each `RLSD_BENCH_SECONDS`, default 2, after 0.5 s of warm-up; every latency kept):
//! 1. peak: closed loop, `RLSD_BENCH_CONNECTIONS` (4) channels x `RLSD_BENCH_INFLIGHT` (16)
//!    requests in flight each, for every shape; servers alternate within each of
//!    `RLSD_BENCH_ROUNDS` (3) rounds and the median round is shown (PERF.md: quote medians of
//!    alternating rounds);
//! 2. h2load: the peak again, driven by `h2load` (nghttp2's load generator, in C; Debian
//!    package `nghttp2-client`; skipped with a note when it is missing) with the same
//!    connections and streams. The tonic client costs about as much CPU as the server, and
//!    here it shares the two cores with rlsd and Redis, while the ceiling's load generator is
//!    nearly free; h2load costs a third as much. It sends one fixed body per shape (client
//!    0's), so this phase's ceiling is `redis-benchmark` on client 0's keys. h2load sees only
//!    HTTP status, so rlsd's answers are checked against its own counters: one hit counted
//!    per descriptor of every answered request, no over-limit, failure-mode or invalid answer;
//! 3. raw: the peak again, driven by the bench's lean client (`rlsd_testkit::rawh2`: HTTP/2 by
//!    hand, one thread, non-blocking sockets, every answer decoded and checked) with the same
//!    connections and streams, cycling through all 1000 clients like the tonic client. It
//!    costs a fifth of the tonic client's CPU per request, so its ceiling is the ordinary one;
//! 4. open loops on the three-layer shape at `RLSD_BENCH_OPEN_FRACTIONS` (0.5,0.25) of each
//!    server's own peak with that client (or `RLSD_BENCH_OPEN_RATE` req/s for all), with
//!    latency from the *scheduled* time, so a server that stalls cannot hide the queueing it
//!    causes (no coordinated omission); "lag p99" is how late requests actually left. Each
//!    runs `RLSD_BENCH_ROUNDS` times, servers alternating, and the row is the run with the
//!    median p99 (its label gives the range of the rounds' p99s): on these shared cores one
//!    run's p99 swings several fold;
//!    - `open`, the tonic client: a pacer thread releases each request as its own task (it
//!      sleeps with `std::thread::sleep`, ~60 µs granularity, because tokio timers tick in
//!      whole ms);
//!    - `raw-open`, the lean client: it paces itself with `ppoll` and a 1 µs timer slack,
//!      sending on `RLSD_BENCH_CONNECTIONS` connections round robin;
//!
//!    With `RLSD_BENCH_UNIX=1` every rlsd also listens on a Unix socket (`--grpc-unix-socket`)
//!    and the lean client's phases reach it there; the rest stays on TCP.
//!    `RLSD_BENCH_TRACE=<file>` appends, for each phase of the lean client, a `#` line naming
//!    it, then a line per answer: when it came (µs since the client started, warm-up first),
//!    its latency and its pacing lag (µs), to find stalls.
//! 5. one request in flight (one channel, closed loop), p50/p99/p999, for every shape: `single`
//!    with the tonic client, `raw-single` with the lean one.
//!
//! `RLSD_BENCH_PHASES` (peak,h2load,raw,open,raw-open,single,raw-single) and `RLSD_BENCH_ONLY` (e.g. `rlsd,redis`) select. The
//! tool prints a table of every phase (req/s, p50/p99/p999/max, answers by kind, server and
//! client CPU per request), the ceilings, one summary line per server and shape (ratio, server
//! CPU and Redis CPU per request), and writes an SVG plot of peak req/s by shape and latency at
//! the first open-loop fraction to `RLSD_BENCH_PLOT` (default `target/rlsd-bench.svg`).
//!
//! Threads: the servers run on their own tokio runtime (`RLSD_BENCH_SERVER_THREADS`, default 2,
//! threads named `bench-server`), and each rlsd serves its connections on lanes of its own
//! (`RLSD_BENCH_LANES`, default the server threads; 0 serves them on the server runtime, as
//! before lanes; lane threads count as server CPU), the clients on another runtime
//! (`RLSD_BENCH_CLIENT_THREADS`, default 2, `bench-client`); `RLSD_BENCH_SHARED=1` puts both on one runtime.
//! 2+2 is the default: like rlsd in production (its own process, a worker per core) and like
//! PERF.md (server and load generator sharing both cores); 1+1 caps each side at one core, so
//! the heavier side bounds both (`docs/benchmark-log.md` has the variants measured). The shared
//! runtime runs client and server tasks on the same workers (cheap hand-offs a separate process
//! never gets) and cannot tell server CPU from client CPU. Since the tonic client costs about as much CPU per
//! request as the server, req/s here is bound by the two cores together: the figure that carries
//! over is the server's CPU per request (from `/proc/self/task/*/stat`, 10 ms ticks), and what
//! rlsd adds to the baseline's.
//!
//! Answers are checked: OK (overall OK and one OK status per descriptor), OVER_LIMIT, wrong
//! (anything else) and gRPC errors are counted and printed; any of the last three is reported
//! loudly, as is a request never answered.
//!
//! `RLSD_BENCH_TRACING=1` adds `rlsd-traced`: `rlsd` with OpenTelemetry tracing on, every request
//! sampled (the bench sends no trace context, so each is a new trace), exported over OTLP/gRPC
//! to a span-counting collector on a thread of its own.
//!
//! `RLSD_LOG` (a `tracing` filter, e.g. `rlsd=debug,h2=debug`) logs what the servers in this
//! process log, to stderr: why a connection ended, say.
//!
//! Run: `cargo bench --bench grpc`.

mod ceiling;
mod phases;
mod plot;
mod report;
mod servers;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rlsd::pb::RateLimitRequest;
use rlsd::service::{HeaderStyle, ServiceSettings};
use rlsd::telemetry::{OtlpProtocol, Telemetry, TracingSettings};
use rlsd_testkit::redis::RedisServer;
use rlsd_testkit::workload::Shape;
use rlsd_testkit::{h2load, rawh2, stalls};

use crate::ceiling::{Ceiling, CeilingKeys, median_ceiling, redis_benchmark};
use crate::phases::{
    Phase, REDIS_PID, closed_loop, h2load_phase, lean_load, open_loop, raw_phase, runtime,
    sample_evalsha_calls,
};
use crate::plot::plot;
use crate::report::{Row, peak_results, print_rows};
use crate::servers::{
    Baseline, Canned, Client, OtlpSink, Served, connect, limiter_with, pool, start_redis_rlsd,
    start_server, start_service,
};

/// The binary's allocator, so the servers here run as `rlsd serve` does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Distinct clients (IP + API key) the requests cycle through.
const CLIENTS: usize = 1000;
const WARMUP: Duration = Duration::from_millis(500);

struct Opts {
    seconds: Duration,
    /// How long [`stalls::probe`] spins before and after the phases (0: not at all).
    stall_probe: Duration,
    rounds: usize,
    connections: usize,
    inflight: usize,
    server_threads: usize,
    lanes: usize,
    client_threads: usize,
    shared: bool,
    extra: bool,
    tracing: bool,
    phases: Vec<String>,
    open_rate: Option<f64>,
    open_fractions: Vec<f64>,
    only: Option<Vec<String>>,
    shapes: Vec<Shape>,
    algorithm: String,
    redis: bool,
    max_batch: usize,
    pipelines: usize,
    plot: PathBuf,
}

impl Opts {
    fn from_env() -> Opts {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
            std::env::var(name)
                .ok()
                .map(|s| {
                    s.parse()
                        .unwrap_or_else(|_| panic!("{name}: cannot parse {s:?}"))
                })
                .unwrap_or(default)
        }
        Opts {
            seconds: Duration::from_secs_f64(var("RLSD_BENCH_SECONDS", 2.0)),
            stall_probe: Duration::from_secs_f64(var("RLSD_BENCH_STALL_PROBE", 2.0)),
            rounds: var("RLSD_BENCH_ROUNDS", 3_usize).max(1),
            connections: var("RLSD_BENCH_CONNECTIONS", 4_usize).max(1),
            inflight: var("RLSD_BENCH_INFLIGHT", 16_usize).max(1),
            server_threads: var("RLSD_BENCH_SERVER_THREADS", 2_usize).max(1),
            lanes: var(
                "RLSD_BENCH_LANES",
                var("RLSD_BENCH_SERVER_THREADS", 2_usize).max(1),
            ),
            client_threads: var("RLSD_BENCH_CLIENT_THREADS", 2_usize).max(1),
            shared: var("RLSD_BENCH_SHARED", 0_u8) == 1,
            extra: var("RLSD_BENCH_EXTRA", 0_u8) == 1,
            tracing: var("RLSD_BENCH_TRACING", 0_u8) == 1,
            phases: var(
                "RLSD_BENCH_PHASES",
                "peak,h2load,raw,open,raw-open,single,raw-single".to_owned(),
            )
            .split(',')
            .map(|p| p.trim().to_owned())
            .collect(),
            open_rate: std::env::var("RLSD_BENCH_OPEN_RATE")
                .ok()
                .map(|s| s.parse().expect("RLSD_BENCH_OPEN_RATE is requests/s")),
            open_fractions: var("RLSD_BENCH_OPEN_FRACTIONS", "0.5,0.25".to_owned())
                .split(',')
                .map(|f| {
                    f.trim()
                        .parse()
                        .expect("RLSD_BENCH_OPEN_FRACTIONS: numbers")
                })
                .collect(),
            only: std::env::var("RLSD_BENCH_ONLY")
                .ok()
                .map(|s| s.split(',').map(|p| p.trim().to_owned()).collect()),
            shapes: var("RLSD_BENCH_SHAPES", "1,3,10".to_owned())
                .split(',')
                .map(|n| {
                    let n: usize = n.trim().parse().expect("RLSD_BENCH_SHAPES: 1, 3 or 10");
                    Shape::ALL
                        .into_iter()
                        .find(|s| s.descriptors() == n)
                        .expect("RLSD_BENCH_SHAPES: 1, 3 or 10")
                })
                .collect(),
            algorithm: var("RLSD_BENCH_ALGORITHM", "gcra".to_owned()),
            redis: var("RLSD_BENCH_REDIS", 1_u8) == 1,
            max_batch: var(
                "RLSD_BENCH_MAX_BATCH",
                rlsd::store::redis::DEFAULT_MAX_BATCH,
            )
            .max(2),
            pipelines: var(
                "RLSD_BENCH_PIPELINES",
                rlsd::store::redis::DEFAULT_PIPELINES,
            )
            .max(1),
            plot: PathBuf::from(var(
                "RLSD_BENCH_PLOT",
                concat!(env!("CARGO_MANIFEST_DIR"), "/target/rlsd-bench.svg").to_owned(),
            )),
        }
    }
}

fn uses_redis(server: &str) -> bool {
    server.starts_with("redis")
}

/// The load generators the peak and open-loop phases run with, in the order tables and the
/// plot show them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Driver {
    /// The bench's own tonic clients.
    Tonic,
    /// nghttp2's h2load (C), one fixed body per shape.
    H2load,
    /// The lean hand-written HTTP/2 client of `rlsd_testkit::rawh2`.
    Raw,
}

impl Driver {
    const ALL: [Driver; 3] = [Driver::Tonic, Driver::H2load, Driver::Raw];

    /// Its peak phase's name in `RLSD_BENCH_PHASES` and in tables.
    fn phase(self) -> &'static str {
        match self {
            Driver::Tonic => "peak",
            Driver::H2load => "h2load",
            Driver::Raw => "raw",
        }
    }

    /// Its open-loop phase's name, when it has one (h2load's `--rps` sends in bursts).
    fn open_phase(self) -> Option<&'static str> {
        match self {
            Driver::Tonic => Some("open"),
            Driver::H2load => None,
            Driver::Raw => Some("raw-open"),
        }
    }

    /// Its one-request-in-flight phase's name, when it has one.
    fn single_phase(self) -> Option<&'static str> {
        match self {
            Driver::Tonic => Some("single"),
            Driver::H2load => None,
            Driver::Raw => Some("raw-single"),
        }
    }

    /// Whose keys its ceiling carries: the keys its requests carry.
    fn ceiling_keys(self) -> CeilingKeys {
        match self {
            Driver::H2load => CeilingKeys::OneClient,
            Driver::Tonic | Driver::Raw => CeilingKeys::Random,
        }
    }

    fn ceiling_name(self) -> &'static str {
        match self.ceiling_keys() {
            CeilingKeys::Random => "redis-benchmark",
            CeilingKeys::OneClient => "redis-benchmark, same keys",
        }
    }

    /// How the plot names the client.
    fn title(self) -> &'static str {
        match self {
            Driver::Tonic => "tonic client",
            Driver::H2load => "h2load client (C, one client's keys; ceiling on the same keys)",
            Driver::Raw => "lean client (hand-written HTTP/2, one thread)",
        }
    }
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

    let algorithm = opts.algorithm.as_str();
    let (limiter, config) = limiter_with(algorithm, ServiceSettings::default());
    // Each server's address, and rlsd's counters (how the h2load phase checks answers).
    let mut addrs: Vec<(&'static str, Served)> = vec![
        (
            "baseline",
            (server_handle.block_on(start_service(Baseline)), None),
        ),
        (
            "rlsd",
            server_handle.block_on(start_server(limiter, config, opts.lanes)),
        ),
    ];
    if let Some(redis) = &redis {
        let (batch, pipelines) = (opts.max_batch, opts.pipelines);
        addrs.push((
            "redis",
            server_handle.block_on(start_redis_rlsd(
                algorithm, redis.port, batch, pipelines, opts.lanes,
            )),
        ));
        addrs.push((
            "redis-1",
            server_handle.block_on(start_redis_rlsd(algorithm, redis.port, 1, 1, opts.lanes)),
        ));
    }
    if opts.extra {
        // rlsd's own answers, captured once, replayed by a server that does nothing else.
        let rlsd = addrs[1].1.0;
        let answers = client_rt.block_on(async {
            let mut client = connect(rlsd, 1).await.remove(0);
            let mut answers = Vec::new();
            for (shape, requests) in &pools {
                let answer = client
                    .should_rate_limit(requests[0].clone())
                    .await
                    .expect("rlsd answers")
                    .into_inner();
                answers.push((shape.descriptors(), answer));
            }
            answers
        });
        addrs.push((
            "canned",
            (
                server_handle.block_on(start_service(Canned { answers })),
                None,
            ),
        ));
        let (limiter, _) = limiter_with(algorithm, ServiceSettings::default());
        addrs.push((
            "rlsd-svc",
            (server_handle.block_on(start_service(limiter)), None),
        ));
        let no_headers = ServiceSettings {
            headers: HeaderStyle::Off,
            ..ServiceSettings::default()
        };
        let (limiter, _) = limiter_with(algorithm, no_headers);
        addrs.push((
            "rlsd-nohdr",
            (server_handle.block_on(start_service(limiter)), None),
        ));
    }
    // Kept alive until the end: the traced server's exporter and the sink it exports to.
    let mut traced = None;
    if opts.tracing {
        let sink = OtlpSink::start();
        let endpoint = format!("http://{}", sink.addr);
        let telemetry = server_handle.block_on(async {
            Telemetry::start(&TracingSettings {
                service_name: "rlsd-bench".to_owned(),
                service_namespace: String::new(),
                service_instance_id: String::new(),
                sampling_rate: 1.0,
                endpoint: Some(endpoint),
                protocol: OtlpProtocol::Grpc,
            })
            .expect("start tracing")
        });
        let (limiter, config) = limiter_with(algorithm, ServiceSettings::default());
        let limiter = limiter.with_tracing(telemetry.tracer());
        addrs.push((
            "rlsd-traced",
            server_handle.block_on(start_server(limiter, config, opts.lanes)),
        ));
        traced = Some((telemetry, sink));
    }
    if let Some(only) = &opts.only {
        addrs.retain(|(name, _)| only.iter().any(|o| o == name));
    }
    let servers: Vec<(&'static str, Vec<Client>)> = client_rt.block_on(async {
        let mut servers = Vec::new();
        for (name, (addr, _)) in &addrs {
            servers.push((*name, connect(*addr, opts.connections).await));
        }
        servers
    });

    let names: Vec<&'static str> = servers.iter().map(|(name, _)| *name).collect();
    println!(
        "# rlsd gRPC bench: {} connections x {} in flight, {:.1} s per phase, {} round(s), {} limits, {}",
        opts.connections,
        opts.inflight,
        opts.seconds.as_secs_f64(),
        opts.rounds,
        algorithm,
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
         redis = Redis store, coalescing; redis-1 = Redis store, one EVALSHA per request"
    );
    println!("# CPU columns: µs of CPU per request (and % of one core over the phase)");
    if let Some(stalls) = &stalls_before {
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

    let mut rows = Vec::new();
    let mut summary = Vec::new();
    let shapes: Vec<Shape> = pools.iter().map(|(shape, _)| *shape).collect();
    let mut plotted: Vec<Plotted> = servers
        .iter()
        .map(|(server, _)| Plotted {
            server,
            peaks: vec![vec![0.0; pools.len()]; Driver::ALL.len()],
            open: vec![None; Driver::ALL.len()],
        })
        .collect();
    // The shape the open-loop and latency phases use: three layers when measured.
    let open_shape = pools
        .iter()
        .position(|(shape, _)| *shape == Shape::ThreeLayer)
        .unwrap_or(0);
    // By driver: each server's peak on the open-loop shape, and the ceiling by shape.
    let mut own_peak: Vec<Vec<Option<f64>>> = vec![vec![None; servers.len()]; Driver::ALL.len()];
    let mut ceilings: Vec<Vec<Option<Ceiling>>> = vec![vec![None; pools.len()]; Driver::ALL.len()];
    // redis-benchmark with coalesced-size calls: Redis's cost per decision without rlsd.
    let mut batched: Vec<Option<Ceiling>> = vec![None; pools.len()];

    // The peak phases: closed loop, servers (and the redis-benchmark ceiling) alternating
    // within each round, once per load generator.
    let h2load_dir = std::env::temp_dir().join(format!("rlsd-bench-{}", std::process::id()));
    for (d, driver) in Driver::ALL.into_iter().enumerate() {
        if !opts.phases.iter().any(|p| p == driver.phase()) {
            continue;
        }
        let redis = redis.as_ref();
        let rounds = match driver {
            Driver::Tonic => peak_rounds(driver, (&shapes, servers.len()), redis, &opts, |s, v| {
                client_rt.block_on(closed_loop(
                    &servers[v].1,
                    opts.inflight,
                    Arc::clone(&pools[s].1),
                    opts.seconds,
                ))
            }),
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
                        std::fs::write(&path, h2load::grpc_body(&requests[0])).expect("body file");
                        path
                    })
                    .collect();
                peak_rounds(driver, (&shapes, servers.len()), redis, &opts, |s, v| {
                    let (addr, metrics) = &addrs[v].1;
                    h2load_phase(
                        *addr,
                        metrics.as_deref(),
                        &bodies[s],
                        shapes[s].descriptors(),
                        &opts,
                        &log,
                    )
                })
            }
            Driver::Raw => peak_rounds(driver, (&shapes, servers.len()), redis, &opts, |s, v| {
                let load = lean_load(&opts, (opts.connections, opts.inflight), None);
                raw_phase(addrs[v].1.0, &pools[s].1, load)
            }),
        };
        for (s, shape) in shapes.iter().enumerate() {
            let medians = peak_results(
                (driver.phase(), *shape, &names),
                &rounds.runs[s],
                (driver.ceiling_name(), &rounds.ceilings[s]),
                &opts,
                (&mut summary, &mut rows),
            );
            if !rounds.ceilings[s].is_empty() {
                ceilings[d][s] = Some(median_ceiling(&rounds.ceilings[s]));
            }
            if !rounds.batched[s].is_empty() {
                batched[s] = Some(median_ceiling(&rounds.batched[s]));
            }
            for (v, phase) in medians.iter().enumerate() {
                plotted[v].peaks[d][s] = phase.rate();
                if s == open_shape {
                    own_peak[d][v] = Some(phase.rate());
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&h2load_dir);

    // Open loops at fractions of each server's own peak with that client (or a fixed rate),
    // on the three-layer shape: the tonic client with a pacer thread of its own (counted as
    // client CPU), and the lean client pacing itself.
    for (d, driver) in Driver::ALL.into_iter().enumerate() {
        let Some(phase_name) = driver.open_phase() else {
            continue;
        };
        if !opts.phases.iter().any(|p| p == phase_name) {
            continue;
        }
        let (shape, requests) = &pools[open_shape];
        for (f, fraction) in opts.open_fractions.iter().enumerate() {
            // Each server's rate: its own peak with this client, else with the tonic client.
            let rates: Vec<(f64, Option<f64>, &str)> = (0..servers.len())
                .map(|v| {
                    let (peak, of) = match own_peak[d][v] {
                        Some(peak) => (Some(peak), driver.phase()),
                        None => (own_peak[0][v], Driver::Tonic.phase()),
                    };
                    let rate = match (opts.open_rate, peak) {
                        (Some(rate), _) => rate,
                        (None, Some(peak)) => peak * fraction,
                        (None, None) => 5_000.0,
                    };
                    (rate, peak, of)
                })
                .collect();
            // Rounds alternate the servers, as the peak phases do: one run's p99 swings several
            // fold on these shared cores, so the row is the run with the median p99.
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
                            let load = lean_load(&opts, (opts.connections, 1000), Some(rate));
                            raw_phase(addrs[v].1.0, requests, load)
                        }
                        _ => {
                            let handle = client_rt.handle().clone();
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
                    plotted[v].open[d] = Some([0.5, 0.99, 0.999].map(|q| Phase::percentile(l, q)));
                }
                let share = peak.map_or(String::new(), |peak| {
                    format!(" ({:.0}% {of} pk)", 100.0 * rate / peak)
                });
                rows.push(Row {
                    phase: format!("{phase_name} {rate:.0}/s{share}{spread}, {}", shape.label()),
                    server,
                    result: phase,
                });
            }
        }
    }

    // One request in flight, with each client that has such a phase.
    for driver in Driver::ALL {
        let Some(phase_name) = driver.single_phase() else {
            continue;
        };
        if !opts.phases.iter().any(|p| p == phase_name) {
            continue;
        }
        for (shape, requests) in &pools {
            for (v, (server, clients)) in servers.iter().enumerate() {
                eprintln!("{phase_name} {server} {}", shape.label());
                let phase = match driver {
                    Driver::Raw => {
                        let load = lean_load(&opts, (1, 1), None);
                        raw_phase(addrs[v].1.0, requests, load)
                    }
                    _ => client_rt.block_on(closed_loop(
                        &clients[..1],
                        1,
                        Arc::clone(requests),
                        opts.seconds,
                    )),
                };
                let client = if driver == Driver::Raw { ", lean" } else { "" };
                rows.push(Row {
                    phase: format!("1 in flight{client}, {}", shape.label()),
                    server,
                    result: phase,
                });
            }
        }
    }

    println!();
    print_rows(&rows, opts.shared);
    println!();
    for (d, driver) in Driver::ALL.into_iter().enumerate() {
        for (s, shape) in shapes.iter().enumerate() {
            if let Some(c) = ceilings[d][s] {
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
        if let (Some(b), Some(c)) = (batched[s], ceilings[0][s]) {
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
    for line in &summary {
        println!("{line}");
    }
    if let Some(before) = &stalls_before {
        // Again with the servers idle: how the host behaved over the run, at both ends.
        println!(
            "machine stalls before the phases: {}\nmachine stalls after the phases:  {}",
            stalls::line(before),
            stalls::line(&stalls::probe(opts.stall_probe))
        );
    }
    let failed = rows.iter().any(|r| {
        r.result.counts.errors > 0 || r.result.counts.wrong > 0 || r.result.counts.over_limit > 0
    });
    if failed {
        println!(
            "!!!!!! SOME REQUESTS FAILED OR WERE ANSWERED WRONGLY: see above; figures are suspect"
        );
    } else {
        println!("all answers correct: every request OK with one OK status per descriptor");
    }
    if plotted
        .iter()
        .any(|p| p.peaks.iter().flatten().any(|r| *r > 0.0))
    {
        let svg = plot(&opts, (&shapes, open_shape), &ceilings, &plotted);
        match std::fs::write(&opts.plot, svg) {
            Ok(()) => println!("plot: {}", opts.plot.display()),
            Err(error) => println!("plot not written to {}: {error}", opts.plot.display()),
        }
    }

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
