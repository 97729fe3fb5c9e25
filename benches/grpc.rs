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

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use rlsd::config::Config;
use rlsd::metrics::Metrics;
use rlsd::pb::rate_limit_response::{Code, DescriptorStatus};
use rlsd::pb::{
    RateLimitRequest, RateLimitResponse, RateLimitService, RateLimitServiceClient,
    RateLimitServiceServer,
};
use rlsd::server::{self, Listeners, ServeOptions};
use rlsd::service::{HeaderStyle, RateLimiter, ServiceSettings};
use rlsd::store::{MemoryStore, RedisSettings, RedisStore, Store};
use rlsd::telemetry::{OtlpProtocol, Telemetry, TracingSettings};
use rlsd_testkit::redis::{RedisServer, evalsha_calls};
use rlsd_testkit::workload::{self, Shape};
use rlsd_testkit::{h2load, rawh2, stalls};
use tokio::net::TcpListener;
use tokio::runtime::{Handle, Runtime};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

/// The binary's allocator, so the servers here run as `rlsd serve` does.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Distinct clients (IP + API key) the requests cycle through.
const CLIENTS: usize = 1000;
const WARMUP: Duration = Duration::from_millis(500);
/// Clock ticks per second of `/proc/*/stat` times (`getconf CLK_TCK` on Linux).
const CLK_TCK: f64 = 100.0;

type Client = RateLimitServiceClient<Channel>;

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

/// The do-nothing server: one OK per descriptor, nothing else.
struct Baseline;

#[tonic::async_trait]
impl RateLimitService for Baseline {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let statuses = vec![
            DescriptorStatus {
                code: Code::Ok.into(),
                ..Default::default()
            };
            request.get_ref().descriptors.len()
        ];
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses,
            ..Default::default()
        }))
    }
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

type Limiter = RateLimiter<MemoryStore>;

/// The bench config, shared by every rlsd server of the run.
fn bench_config(algorithm: &str) -> Arc<ArcSwap<Config>> {
    Arc::new(ArcSwap::from_pointee(workload::config(algorithm)))
}

/// rlsd's service on the bench config and a system-clock `MemoryStore`.
fn limiter_with(algorithm: &str, settings: ServiceSettings) -> (Limiter, Arc<ArcSwap<Config>>) {
    let config = bench_config(algorithm);
    let store = Arc::new(MemoryStore::new(rlsd::store::memory::DEFAULT_MAX_KEYS));
    let limiter = RateLimiter::new(Arc::clone(&config), store, settings);
    (limiter, config)
}

/// A server's gRPC address, and its counters when it is rlsd.
type Served = (SocketAddr, Option<Arc<Metrics>>);

/// Starts `limiter` under `server::run_with` (as the binary does) on the current runtime, its
/// connections served on `lanes` of its own (0: on this runtime); returns its gRPC address and
/// counters.
async fn start_server<S: Store>(
    limiter: RateLimiter<S>,
    config: Arc<ArcSwap<Config>>,
    lanes: usize,
) -> Served {
    let metrics = limiter.metrics();
    let listeners = Listeners::bind(loopback(), loopback())
        .await
        .expect("bind rlsd");
    let addr = listeners.grpc.local_addr().expect("rlsd address");
    let listeners = if rawh2::unix_enabled() {
        listeners
            .with_grpc_unix(&rawh2::unix_path(addr), server::DEFAULT_SOCKET_MODE)
            .expect("bind rlsd's unix socket")
    } else {
        listeners
    };
    tokio::spawn(async move {
        let options = ServeOptions {
            lanes,
            ..ServeOptions::default()
        };
        server::run_with(limiter, config, listeners, options, std::future::pending())
            .await
            .expect("rlsd serves");
    });
    (addr, Some(metrics))
}

/// rlsd on the Redis store at `port`: `max_batch` 1 is one EVALSHA per request.
async fn start_redis_rlsd(
    algorithm: &str,
    port: u16,
    max_batch: usize,
    pipelines: usize,
    lanes: usize,
) -> Served {
    let mut settings = RedisSettings::new(format!("redis://127.0.0.1:{port}"));
    settings.command_timeout = Duration::from_secs(1);
    settings.max_batch = max_batch;
    settings.pipelines = pipelines;
    settings.lanes = lanes;
    let store = Arc::new(
        RedisStore::connect(settings)
            .await
            .expect("connect to redis"),
    );
    let config = bench_config(algorithm);
    let limiter = RateLimiter::new(Arc::clone(&config), store, ServiceSettings::default());
    start_server(limiter, config, lanes).await
}

/// Serves `service` with the same tonic settings as `server::run`.
async fn start_service<T: RateLimitService>(service: T) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .max_concurrent_streams(Some(server::MAX_CONCURRENT_STREAMS))
            .add_service(RateLimitServiceServer::new(service))
            .serve_with_incoming(incoming)
            .await
            .expect("server serves");
    });
    addr
}

/// An OTLP/gRPC collector that counts the spans it receives, on a thread of its own so its CPU
/// is not counted as the server's.
struct OtlpSink {
    addr: SocketAddr,
    spans: Arc<AtomicU64>,
    _runtime: Runtime,
}

#[derive(Clone)]
struct SpanCounter(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for SpanCounter {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

impl OtlpSink {
    fn start() -> OtlpSink {
        let runtime = runtime(1, "otlp-sink");
        let listener = runtime
            .block_on(TcpListener::bind(loopback()))
            .expect("bind the OTLP sink");
        let addr = listener.local_addr().expect("sink address");
        let spans = Arc::new(AtomicU64::new(0));
        let counter = SpanCounter(Arc::clone(&spans));
        runtime.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(counter))
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
                .expect("the OTLP sink serves");
        });
        OtlpSink {
            addr,
            spans,
            _runtime: runtime,
        }
    }
}

/// Replays fixed answers: rlsd's, captured at start, so the bytes on the wire are the same.
struct Canned {
    /// rlsd's answer by descriptors per request.
    answers: Vec<(usize, RateLimitResponse)>,
}

#[tonic::async_trait]
impl RateLimitService for Canned {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let descriptors = request.get_ref().descriptors.len();
        self.answers
            .iter()
            .find(|(n, _)| *n == descriptors)
            .map(|(_, answer)| Response::new(answer.clone()))
            .ok_or_else(|| Status::invalid_argument("no canned answer for this shape"))
    }
}

/// `count` clients, each on its own HTTP/2 connection.
async fn connect(addr: SocketAddr, count: usize) -> Vec<Client> {
    let mut clients = Vec::with_capacity(count);
    for _ in 0..count {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        clients.push(RateLimitServiceClient::new(channel));
    }
    clients
}

/// The requests of `CLIENTS` distinct clients in `shape`.
fn pool(shape: Shape) -> Arc<Vec<RateLimitRequest>> {
    Arc::new(shape.requests(CLIENTS))
}

/// Answers by kind.
#[derive(Clone, Debug, Default)]
struct Counts {
    ok: u64,
    over_limit: u64,
    wrong: u64,
    errors: u64,
    first_problem: Option<String>,
}

impl Counts {
    fn record(&mut self, descriptors: usize, result: &Result<Response<RateLimitResponse>, Status>) {
        match result {
            Ok(response) => self.record_answer(descriptors, Ok(response.get_ref())),
            Err(status) => self.record_answer(descriptors, Err(status)),
        }
    }

    /// One answer (or the error in its place) to a request of `descriptors` descriptors.
    fn record_answer(
        &mut self,
        descriptors: usize,
        answer: Result<&RateLimitResponse, &dyn std::fmt::Display>,
    ) {
        match answer {
            Ok(r) => {
                let all_ok = r.statuses.len() == descriptors
                    && r.statuses.iter().all(|s| s.code == i32::from(Code::Ok));
                if r.overall_code == i32::from(Code::Ok) && all_ok {
                    self.ok += 1;
                } else if r.overall_code == i32::from(Code::OverLimit) {
                    self.over_limit += 1;
                } else {
                    self.wrong += 1;
                    self.first_problem
                        .get_or_insert_with(|| format!("wrong answer: {r:?}"));
                }
            }
            Err(error) => {
                self.errors += 1;
                self.first_problem
                    .get_or_insert_with(|| format!("error: {error}"));
            }
        }
    }

    fn merge(&mut self, other: &Counts) {
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.wrong += other.wrong;
        self.errors += other.errors;
        if self.first_problem.is_none() {
            self.first_problem.clone_from(&other.first_problem);
        }
    }
}

/// CPU seconds of this process's threads, by name prefix.
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    server: f64,
    client: f64,
    total: f64,
    /// The bench's redis-server, when there is one.
    redis: f64,
    /// Not CPU: the EVALSHA calls that redis-server ran, so a phase knows its requests per call.
    evalsha: f64,
}

impl Cpu {
    /// What was used from `begin` to `self`.
    fn since(self, begin: Cpu) -> Cpu {
        Cpu {
            server: self.server - begin.server,
            client: self.client - begin.client,
            total: self.total - begin.total,
            redis: self.redis - begin.redis,
            evalsha: self.evalsha - begin.evalsha,
        }
    }
}

/// The redis-server whose CPU (and calls) the phases count: its pid and port.
static REDIS_PID: OnceLock<(u32, u16)> = OnceLock::new();

/// The EVALSHA calls that redis-server has run (an f64's bits; NaN when unknown), as a
/// sampler thread last read them. Reading INFO takes a round trip to a busy Redis, up to a
/// millisecond, which would stall a client's loop at the phase's edges; the sample is at most
/// `EVALSHA_SAMPLE` old, about 1 % of a 2 s phase's calls.
static EVALSHA_CALLS: AtomicU64 = AtomicU64::new(0x7ff8_0000_0000_0000);
const EVALSHA_SAMPLE: Duration = Duration::from_millis(20);

/// Starts the thread that keeps `EVALSHA_CALLS` fresh, for as long as the bench runs.
fn sample_evalsha_calls(port: u16) {
    std::thread::Builder::new()
        .name("evalsha-sampler".to_owned())
        .spawn(move || {
            loop {
                let calls = evalsha_calls(port).map_or(f64::NAN, |n| n as f64);
                EVALSHA_CALLS.store(calls.to_bits(), Ordering::Relaxed);
                std::thread::sleep(EVALSHA_SAMPLE);
            }
        })
        .expect("sampler thread");
}

fn cpu_now() -> Cpu {
    let mut cpu = Cpu::default();
    let ticks = |stat: &str| -> f64 {
        // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        let field = |n: usize| {
            fields
                .get(n - 3)
                .and_then(|f| f.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (field(14) + field(15)) / CLK_TCK
    };
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        cpu.total = ticks(&stat);
    }
    if let Some(&(pid, _)) = REDIS_PID.get() {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            cpu.redis = ticks(&stat);
        }
        // NaN until the sampler has read it once: a phase then prints no calls figure.
        cpu.evalsha = f64::from_bits(EVALSHA_CALLS.load(Ordering::Relaxed));
    }
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return cpu;
    };
    for task in tasks.flatten() {
        let path = task.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("stat")),
        ) else {
            continue;
        };
        if comm.starts_with("bench-server") || comm.starts_with("rlsd-lane") {
            cpu.server += ticks(&stat);
        } else if comm.starts_with("bench-client") {
            cpu.client += ticks(&stat);
        }
    }
    cpu
}

/// One measured phase.
#[derive(Clone, Debug)]
struct Phase {
    latencies_us: Vec<u32>,
    lag_us: Vec<u32>,
    counts: Counts,
    wall: Duration,
    cpu: Cpu,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.latencies_us.len() as f64 / self.wall.as_secs_f64()
    }

    fn percentile(sorted: &[u32], q: f64) -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        f64::from(sorted[rank - 1]) / 1000.0
    }

    fn sort(&mut self) {
        self.latencies_us.sort_unstable();
        self.lag_us.sort_unstable();
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Closed loop: `inflight` workers per client, each sending as soon as its answer arrives.
async fn closed_loop(
    clients: &[Client],
    inflight: usize,
    requests: Arc<Vec<RateLimitRequest>>,
    seconds: Duration,
) -> Phase {
    let begin = Instant::now() + WARMUP;
    let end = begin + seconds;
    let mut workers = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        for w in 0..inflight {
            let mut client = client.clone();
            let requests = Arc::clone(&requests);
            let mut next = (c * inflight + w) * 37;
            workers.push(tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(1 << 16);
                let mut counts = Counts::default();
                loop {
                    let request = requests[next % requests.len()].clone();
                    next += 1;
                    let descriptors = request.descriptors.len();
                    let sent = Instant::now();
                    if sent >= end {
                        break;
                    }
                    let result = client.should_rate_limit(request).await;
                    let done = Instant::now();
                    if sent >= begin {
                        latencies.push(micros(done - sent));
                        counts.record(descriptors, &result);
                    }
                }
                (latencies, counts)
            }));
        }
    }
    tokio::time::sleep_until(begin.into()).await;
    let cpu_begin = cpu_now();
    tokio::time::sleep_until(end.into()).await;
    let cpu_end = cpu_now();
    let mut phase = Phase {
        latencies_us: Vec::new(),
        lag_us: Vec::new(),
        counts: Counts::default(),
        wall: seconds,
        cpu: cpu_end.since(cpu_begin),
    };
    for worker in workers {
        let (latencies, counts) = worker.await.expect("worker");
        phase.latencies_us.extend(latencies);
        phase.counts.merge(&counts);
    }
    phase.sort();
    phase
}

/// Open loop at `rate` requests/s: each request starts at its scheduled time on its own task;
/// latency is measured from the schedule.
fn open_loop(
    handle: &Handle,
    clients: &[Client],
    requests: Arc<Vec<RateLimitRequest>>,
    rate: f64,
    seconds: Duration,
) -> Phase {
    #[derive(Default)]
    struct Shared {
        latencies: Vec<u32>,
        lags: Vec<u32>,
        counts: Counts,
    }
    let shared = Arc::new(Mutex::new(Shared::default()));
    let outstanding = Arc::new(AtomicU64::new(0));
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let begin = start + WARMUP;
    let end = begin + seconds;
    let mut cpu_begin = None;
    let mut k: u32 = 0;
    let mut scheduled = start;
    let mut max_outstanding = 0;
    'pace: loop {
        let now = Instant::now();
        while scheduled <= now {
            if scheduled >= end {
                break 'pace;
            }
            if scheduled >= begin && cpu_begin.is_none() {
                cpu_begin = Some(cpu_now());
            }
            let measured = scheduled >= begin;
            let mut client = clients[k as usize % clients.len()].clone();
            let request = requests[k as usize % requests.len()].clone();
            let shared = Arc::clone(&shared);
            let outstanding = Arc::clone(&outstanding);
            max_outstanding = max_outstanding.max(outstanding.fetch_add(1, Ordering::Relaxed) + 1);
            let at = scheduled;
            handle.spawn(async move {
                let started = Instant::now();
                let descriptors = request.descriptors.len();
                let result = client.should_rate_limit(request).await;
                let done = Instant::now();
                if measured {
                    let mut shared = shared.lock().expect("results lock");
                    shared.latencies.push(micros(done - at));
                    shared
                        .lags
                        .push(micros(started.saturating_duration_since(at)));
                    shared.counts.record(descriptors, &result);
                }
                outstanding.fetch_sub(1, Ordering::Relaxed);
            });
            k += 1;
            scheduled = start + interval * k;
        }
        std::thread::sleep(scheduled.saturating_duration_since(Instant::now()));
    }
    let cpu_end = cpu_now();
    let cpu_begin = cpu_begin.unwrap_or(cpu_end);
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    while outstanding.load(Ordering::Relaxed) > 0 && Instant::now() < drain_deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut shared = shared.lock().expect("results lock");
    let left = outstanding.load(Ordering::Relaxed);
    if left > 0 {
        shared.counts.errors += left;
        shared
            .counts
            .first_problem
            .get_or_insert_with(|| format!("{left} requests never answered"));
    }
    if max_outstanding > 1000 {
        println!(
            "note: open loop at {rate:.0}/s reached {max_outstanding} requests outstanding (server fell behind)"
        );
    }
    let mut phase = Phase {
        latencies_us: std::mem::take(&mut shared.latencies),
        lag_us: std::mem::take(&mut shared.lags),
        counts: shared.counts.clone(),
        wall: seconds,
        cpu: cpu_end.since(cpu_begin),
    };
    phase.sort();
    phase
}

struct Row {
    phase: String,
    server: &'static str,
    result: Phase,
}

fn print_rows(rows: &[Row], shared_runtime: bool) {
    println!(
        "| {:<30} | {:<10} | {:>9} | {:>7} | {:>7} | {:>7} | {:>7} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>13} | {:>13} | {:>22} |",
        "phase",
        "server",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "max ms",
        "lag p99",
        "OK",
        "OVER",
        "wrong",
        "errors",
        "srv CPU µs/req",
        "cli CPU µs/req",
        "Redis CPU µs/req, /call"
    );
    println!(
        "|{:-<32}|{:-<12}|{:->11}|{:->9}|{:->9}|{:->9}|{:->9}|{:->9}|{:->11}|{:->8}|{:->7}|{:->8}|{:->15}|{:->15}|{:->24}|",
        "", "", "", "", "", "", "", "", "", "", "", "", "", "", ""
    );
    for row in rows {
        let r = &row.result;
        let l = &r.latencies_us;
        let n = l.len().max(1) as f64;
        let cpu_cell = |cpu: f64, share: f64| {
            if shared_runtime {
                "-".to_owned()
            } else {
                format!("{:.1} ({:.0}%)", cpu * 1e6 / n, 100.0 * cpu / share)
            }
        };
        let wall = r.wall.as_secs_f64();
        // Redis's CPU, and requests per EVALSHA call: at moderate rates a call carries fewer
        // requests, so Redis's cost per request, and how busy it is, rise as the rate falls.
        let redis = if r.cpu.redis > 0.0 {
            let calls = if r.cpu.evalsha >= 1.0 {
                format!("{:.1}", n / r.cpu.evalsha)
            } else {
                "n/a".to_owned()
            };
            format!("{} {calls}", cpu_cell(r.cpu.redis, wall))
        } else {
            "-".to_owned()
        };
        let lag = if r.lag_us.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.3}", Phase::percentile(&r.lag_us, 0.99))
        };
        println!(
            "| {:<30} | {:<10} | {:>9.0} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>14} | {:>14} | {:>22} |",
            row.phase,
            row.server,
            r.rate(),
            Phase::percentile(l, 0.50),
            Phase::percentile(l, 0.99),
            Phase::percentile(l, 0.999),
            Phase::percentile(l, 1.0),
            lag,
            r.counts.ok,
            r.counts.over_limit,
            r.counts.wrong,
            r.counts.errors,
            cpu_cell(r.cpu.server, wall),
            cpu_cell(r.cpu.client, wall),
            redis,
        );
        if shared_runtime {
            println!("|   process CPU {:.1} µs/req", r.cpu.total * 1e6 / n);
        }
    }
    for row in rows {
        let c = &row.result.counts;
        if c.errors > 0 || c.wrong > 0 || c.over_limit > 0 {
            println!(
                "!!!!!! {} / {}: {} errors, {} wrong answers, {} OVER_LIMIT (expected none): {}",
                row.phase,
                row.server,
                c.errors,
                c.wrong,
                c.over_limit,
                c.first_problem.as_deref().unwrap_or("-")
            );
        }
    }
}

/// The median of `phases` by req/s.
fn median(phases: &[Phase]) -> Phase {
    let mut sorted: Vec<&Phase> = phases.iter().collect();
    sorted.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    sorted[sorted.len() / 2].clone()
}

fn runtime(threads: usize, name: &str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `redis-benchmark -c 50` on the Redis store's script with the keys and arguments rlsd sends
/// for one request of `shape` (each key's value a random client of 1000): the one EVALSHA per
/// request ceiling. With `requests_per_call` above 1, the same for calls as the coalescing
/// store sends them: what the script costs Redis per decision, without rlsd.
#[derive(Clone, Copy, Debug, Default)]
struct Ceiling {
    calls_per_second: f64,
    redis_us_per_call: f64,
    requests_per_call: usize,
}

/// Whose keys the ceiling's calls carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CeilingKeys {
    /// Each key's client one of 1000 at random, as the tonic client cycles through them.
    Random,
    /// Client 0's, as the h2load phase sends (one fixed body).
    OneClient,
}

fn redis_benchmark(
    redis: &RedisServer,
    (shape, requests_per_call): (Shape, usize),
    algorithm: &str,
    seconds: Duration,
    keys: CeilingKeys,
) -> Ceiling {
    let sha = redis
        .cli(&["SCRIPT", "LOAD", rlsd::store::redis::SCRIPT])
        .expect("load script");
    let checks = shape.checks(&workload::config(algorithm), 0);
    let requests = vec![checks.as_slice(); requests_per_call];
    let command = rlsd::store::redis::script_command(&requests, None);
    let mut args: Vec<String> = command
        .args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            _ => unreachable!("EVALSHA takes plain arguments"),
        })
        .collect();
    assert_eq!(args[1], sha, "the store's script is the one loaded");
    if keys == CeilingKeys::Random {
        for arg in &mut args[3..3 + checks.len() * requests_per_call] {
            // The last entry's value (the client) varies: the same key layout and length
            // class as rlsd's keys, over 1000 values per key.
            let (stem, _) = arg.rsplit_once('=').expect("keys end in =value");
            *arg = format!("{stem}=__rand_int__");
        }
    }
    let run = |calls: u64| {
        let cpu = redis.cpu_us();
        let started = Instant::now();
        let out = Command::new("redis-benchmark")
            .args([
                "-p",
                &redis.port.to_string(),
                "-c",
                "50",
                "-r",
                "1000",
                "-q",
            ])
            .args(["-n", &calls.to_string()])
            .args(&args)
            .output()
            .expect("redis-benchmark runs");
        let elapsed = started.elapsed().as_secs_f64();
        // redis-benchmark stops at the first error reply, so a failed call would otherwise
        // look like a very fast ceiling.
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && !stdout.contains("ERR") && !stderr.contains("rror"),
            "redis-benchmark's script call failed: {stdout} {stderr}"
        );
        Ceiling {
            calls_per_second: calls as f64 / elapsed,
            redis_us_per_call: (redis.cpu_us() - cpu) as f64 / calls as f64,
            requests_per_call,
        }
    };
    // A short run sizes the measured one to about `seconds`.
    let probe = run((5_000 / requests_per_call as u64).max(100));
    run(((probe.calls_per_second * seconds.as_secs_f64()) as u64).max(200))
}

fn median_ceiling(rounds: &[Ceiling]) -> Ceiling {
    let mut sorted = rounds.to_vec();
    sorted.sort_by(|a, b| a.calls_per_second.total_cmp(&b.calls_per_second));
    sorted[sorted.len() / 2]
}

/// Servers whose throughput is compared with the Redis ceiling rather than the baseline.
/// The medians of a peak phase's rounds on `shape`, one per server (named in `names`), with a
/// table row and a summary line each.
fn peak_results(
    (phase, shape, names): (&str, Shape, &[&'static str]),
    rounds: &[Vec<Phase>],
    ceiling: (&str, &[Ceiling]),
    opts: &Opts,
    (summary, rows): (&mut Vec<String>, &mut Vec<Row>),
) -> Vec<Phase> {
    let medians: Vec<Phase> = rounds.iter().map(|r| median(r)).collect();
    let baseline = names.iter().position(|server| *server == "baseline");
    for (v, server) in names.iter().enumerate() {
        let reference = reference_rates(server, ceiling, baseline.map(|b| rounds[b].as_slice()));
        if let Some((against, reference)) = reference {
            summary.push(summary_line(
                (phase, server, shape),
                &rounds[v],
                (against, &reference),
                baseline.map(|b| per_request(&medians[b], medians[b].cpu.server)),
            ));
        }
        rows.push(Row {
            phase: format!(
                "{phase}, {}, {}x{}",
                shape.label(),
                opts.connections,
                opts.inflight
            ),
            server,
            result: medians[v].clone(),
        });
    }
    medians
}

/// What `server`'s req/s is a ratio of, round by round: the Redis ceiling (`ceiling`, named)
/// for the Redis store, the baseline's rounds for the in-process store, nothing for the
/// baseline itself.
fn reference_rates<'a>(
    server: &str,
    (ceiling_name, ceiling): (&'a str, &[Ceiling]),
    baseline: Option<&[Phase]>,
) -> Option<(&'a str, Vec<f64>)> {
    if uses_redis(server) {
        (!ceiling.is_empty()).then(|| {
            (
                ceiling_name,
                ceiling.iter().map(|c| c.calls_per_second).collect(),
            )
        })
    } else if server != "baseline" {
        baseline.map(|rounds| ("baseline", rounds.iter().map(Phase::rate).collect()))
    } else {
        None
    }
}

/// One summary line for `server` on `shape` in `phase`: its median req/s over the rounds, and
/// its ratio to the reference (`against`, whose req/s in each round is given), taken round by
/// round so both sides of a ratio ran within seconds of each other (the machine drifts more
/// than that between rounds): the median ratio and the range. Then the median round's server
/// CPU per request, and Redis's (or what rlsd adds to the baseline's).
fn summary_line(
    (phase, server, shape): (&str, &str, Shape),
    rounds: &[Phase],
    (against, reference): (&str, &[f64]),
    baseline_cpu: Option<f64>,
) -> String {
    let middle = median(rounds);
    let mut ratios: Vec<f64> = rounds
        .iter()
        .zip(reference)
        .map(|(round, reference)| round.rate() / reference)
        .collect();
    ratios.sort_by(f64::total_cmp);
    let cpu = per_request(&middle, middle.cpu.server);
    let mut reference = reference.to_vec();
    reference.sort_by(f64::total_cmp);
    format!(
        "{server:<10} {:<15} {phase:<6} {:>8.0} req/s = {:.2}x {against} (rounds {:.2}-{:.2}x; its median {:.0}/s); server CPU {cpu:.1} µs/req{}",
        shape.label(),
        middle.rate(),
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        reference[reference.len() / 2],
        match (uses_redis(server), baseline_cpu) {
            (true, _) => format!(
                ", Redis CPU {:.1} µs/req, {}",
                per_request(&middle, middle.cpu.redis),
                if middle.cpu.evalsha >= 1.0 {
                    format!(
                        "{:.1} req/call",
                        middle.latencies_us.len() as f64 / middle.cpu.evalsha
                    )
                } else {
                    "req/call n/a".to_owned()
                }
            ),
            // What carries over: the CPU rlsd adds to a server that does nothing.
            (false, Some(base)) => format!(" (+{:.1} µs over the baseline's)", cpu - base),
            (false, None) => String::new(),
        }
    )
}

/// `cpu` seconds over the phase, in µs per answered request.
fn per_request(phase: &Phase, cpu: f64) -> f64 {
    cpu * 1e6 / phase.latencies_us.len().max(1) as f64
}

/// rlsd's own counters at one moment: how the h2load phase, which sees only HTTP status,
/// checks that every request was decided and allowed.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    answered: f64,
    hits: f64,
    over_limit: f64,
    failure_answers: f64,
    store_errors: f64,
    invalid: f64,
}

impl Tally {
    fn of(metrics: &Metrics) -> Tally {
        let text = metrics.render();
        let sum = |name: &str| -> f64 {
            text.lines()
                .filter(|line| {
                    line.strip_prefix(name)
                        .is_some_and(|rest| rest.starts_with(['{', ' ']))
                })
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        Tally {
            answered: sum("ratelimit_service_should_rate_limit_duration_seconds_count"),
            hits: sum("ratelimit_service_rate_limit_total_hits"),
            over_limit: sum("ratelimit_service_rate_limit_over_limit"),
            failure_answers: sum("rlsd_failure_mode_answers_total"),
            store_errors: sum("rlsd_store_errors_total"),
            invalid: sum("rlsd_invalid_requests_total"),
        }
    }
}

/// One h2load peak run on `addr` (after a short warm-up run), as a `Phase`: h2load's
/// latencies and its own CPU as the client's; answers checked against rlsd's counters when
/// the server is rlsd (`metrics`).
fn h2load_phase(
    addr: SocketAddr,
    metrics: Option<&Metrics>,
    body: &std::path::Path,
    descriptors: usize,
    opts: &Opts,
    log: &std::path::Path,
) -> Phase {
    let (connections, streams) = (opts.connections, opts.inflight);
    h2load::run(addr, body, connections, streams, WARMUP, log);
    let before = metrics.map(Tally::of);
    let cpu_begin = cpu_now();
    let run = h2load::run(addr, body, connections, streams, opts.seconds, log);
    let cpu_end = cpu_now();
    let after = metrics.map(Tally::of);
    let mut counts = Counts {
        errors: run.failed + run.done.saturating_sub(run.status_2xx),
        ..Counts::default()
    };
    if counts.errors > 0 {
        counts.first_problem = Some(format!(
            "h2load: {} failed, {} of {} answers not 2xx",
            run.failed,
            run.done.saturating_sub(run.status_2xx),
            run.done
        ));
    }
    match before.zip(after) {
        None => counts.ok = run.status_2xx,
        Some((before, after)) => {
            let delta = |f: fn(&Tally) -> f64| (f(&after) - f(&before)) as u64;
            let answered = delta(|t| t.answered);
            let hits = delta(|t| t.hits);
            let failures = delta(|t| t.failure_answers) + delta(|t| t.store_errors);
            let invalid = delta(|t| t.invalid);
            counts.over_limit = delta(|t| t.over_limit);
            counts.errors += failures + invalid;
            // Every answered request counted one hit per descriptor; h2load may have given up
            // on the few still in flight when its time ran out.
            let in_flight = (connections * streams) as u64;
            if hits != answered * descriptors as u64
                || answered < run.done
                || answered > run.done + in_flight
            {
                counts.wrong += 1;
                counts.first_problem.get_or_insert_with(|| {
                    format!(
                        "rlsd counted {hits} hits for {answered} answers of {descriptors} descriptors; h2load saw {} answers",
                        run.done
                    )
                });
            }
            if failures + invalid > 0 {
                counts.first_problem.get_or_insert_with(|| {
                    format!("rlsd: {failures} store failures, {invalid} invalid requests")
                });
            }
            counts.ok = run
                .status_2xx
                .saturating_sub(failures + invalid + counts.over_limit);
        }
    }
    let mut latencies_us = run.latencies_us;
    latencies_us.sort_unstable();
    Phase {
        latencies_us,
        lag_us: Vec::new(),
        counts,
        wall: Duration::from_secs_f64(run.seconds),
        cpu: Cpu {
            client: run.cpu_seconds,
            ..cpu_end.since(cpu_begin)
        },
    }
}

/// The lean client's load for a phase: `connections` x `streams`, closed loop or paced at
/// `rate`, after the usual warm-up, for `opts.seconds`.
fn lean_load(
    opts: &Opts,
    (connections, streams): (usize, usize),
    rate: Option<f64>,
) -> rawh2::Load {
    rawh2::Load {
        connections,
        streams,
        rate,
        warmup: WARMUP,
        seconds: opts.seconds,
    }
}

/// One run of the lean client (`rlsd_testkit::rawh2`) on `addr`, on a thread of its own named as
/// a client thread (so its CPU is the client's), sending `pool` in turn.
fn raw_phase(addr: SocketAddr, pool: &[RateLimitRequest], load: rawh2::Load) -> Phase {
    let bodies: Vec<Vec<u8>> = pool.iter().map(h2load::grpc_body).collect();
    let mut latencies_us = Vec::with_capacity(1 << 20);
    let mut lag_us = Vec::new();
    let mut counts = Counts::default();
    let paced = load.rate.is_some();
    let trace_to = std::env::var("RLSD_BENCH_TRACE").ok();
    let mut trace: Vec<(u32, u32, u32)> = Vec::new();
    let trace_start = Instant::now();
    let run = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("bench-client-raw".to_owned())
            .spawn_scoped(scope, || {
                rawh2::run(addr, &bodies, &load, cpu_now, |done| {
                    latencies_us.push(done.latency_us);
                    if trace_to.is_some() {
                        trace.push((
                            trace_start.elapsed().as_micros() as u32,
                            done.latency_us,
                            done.lag_us,
                        ));
                    }
                    if paced {
                        lag_us.push(done.lag_us);
                    }
                    let descriptors = pool[done.request].descriptors.len();
                    match &done.answer {
                        Ok(answer) => counts.record_answer(descriptors, Ok(answer)),
                        Err(error) => counts.record_answer(descriptors, Err(error)),
                    }
                })
            })
            .expect("raw client thread")
            .join()
            .expect("raw client")
    })
    .unwrap_or_else(|error| panic!("raw client on {addr}: {error}"));
    if let Some(path) = &trace_to {
        use std::fmt::Write as _;
        use std::io::Write as _;
        let mut text = format!(
            "# {addr}, {}, {} connections x {} streams, {} descriptors per request; \
             µs since the client started (the first {:.1} s are warm-up), latency µs, lag µs\n",
            load.rate
                .map_or_else(|| "closed loop".to_owned(), |r| format!("{r:.0} req/s")),
            load.connections,
            load.streams,
            pool.first().map_or(0, |r| r.descriptors.len()),
            load.warmup.as_secs_f64(),
        );
        for (at, us, lag) in &trace {
            let _ = writeln!(text, "{at} {us} {lag}");
        }
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .unwrap_or_else(|error| panic!("RLSD_BENCH_TRACE {path}: {error}"));
    }
    if run.unanswered > 0 {
        counts.errors += run.unanswered as u64;
        counts
            .first_problem
            .get_or_insert_with(|| format!("{} requests never answered", run.unanswered));
    }
    if paced && run.max_outstanding > 1000 {
        println!(
            "note: raw open loop reached {} requests outstanding (server fell behind)",
            run.max_outstanding
        );
    }
    let mut phase = Phase {
        latencies_us,
        lag_us,
        counts,
        wall: load.seconds,
        cpu: run.end.since(run.begin),
    };
    phase.sort();
    phase
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

/// A plot series: its legend and one value per shape.
type Series = (String, Vec<f64>);

const PLOT_COLORS: [&str; 7] = [
    "#9a9a9a", "#3866c4", "#d64541", "#e8923a", "#2e9d4a", "#8e5bb5", "#444444",
];

/// Hand-written SVG: peak req/s per shape for every server and the Redis ceiling, one panel per
/// client that measured it; latency at the first open-loop fraction of each server's own peak.
fn plot(
    opts: &Opts,
    (shapes, open_shape): (&[Shape], usize),
    ceilings: &[Vec<Option<Ceiling>>],
    plotted: &[Plotted],
) -> String {
    let (width, left, top, panel_h) = (900.0, 70.0, 84.0, 260.0);
    let plot_w = width - left - 30.0;
    let panels: Vec<(Driver, Vec<Series>)> = Driver::ALL
        .into_iter()
        .enumerate()
        .filter(|(d, _)| plotted.iter().any(|p| p.peaks[*d].iter().any(|r| *r > 0.0)))
        .map(|(d, driver)| {
            let mut series: Vec<(String, Vec<f64>)> = plotted
                .iter()
                .map(|p| (p.server.to_owned(), p.peaks[d].clone()))
                .collect();
            let ceiling: Vec<f64> = ceilings[d]
                .iter()
                .map(|c| c.map_or(0.0, |c| c.calls_per_second))
                .collect();
            if ceiling.iter().any(|c| *c > 0.0) {
                series.push(("redis-benchmark (1 EVALSHA/req)".to_owned(), ceiling));
            }
            (driver, series)
        })
        .collect();
    let panel_step = panel_h + 110.0;
    let latency_top = top + panel_step * panels.len() as f64;
    let height = latency_top + panel_h + 70.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{left}" y="24" font-size="16" font-weight="bold">rlsd over gRPC: peak throughput ({}x{} in flight, {} limits)</text>
<text x="{left}" y="42" fill="#666">cargo bench --bench grpc; median of {} round(s); redis = Redis store, coalesced; redis-1 = one EVALSHA per request; all share 2 cores</text>
"##,
        opts.connections, opts.inflight, opts.algorithm, opts.rounds
    );
    for (p, (driver, series)) in panels.iter().enumerate() {
        let panel_top = top + panel_step * p as f64;
        let _ = writeln!(
            svg,
            r#"<text x="{left}" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
            panel_top - 6.0,
            driver.title()
        );
        bar_panel(&mut svg, (left, panel_top, plot_w, panel_h), shapes, series);
    }

    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="{:.1}" font-size="16" font-weight="bold">Latency at {:.0}% of each server's own peak with that client, {}, open loop</text>"#,
        latency_top - 20.0,
        100.0 * opts.open_fractions.first().copied().unwrap_or(0.5),
        shapes[open_shape].label()
    );
    let measured: Vec<(String, [f64; 3])> = Driver::ALL
        .into_iter()
        .enumerate()
        .flat_map(|(d, driver)| {
            plotted.iter().filter_map(move |p| {
                let name = match driver {
                    Driver::Raw => format!("{} (lean)", p.server),
                    _ => format!("{} (tonic)", p.server),
                };
                p.open[d].map(|o| (name, o))
            })
        })
        .collect();
    let max_ms = measured
        .iter()
        .flat_map(|(_, o)| o.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.1, f64::max);
    let scale = nice_ceiling(max_ms);
    axis(&mut svg, left, latency_top, plot_w, panel_h, scale, "ms");
    if !measured.is_empty() {
        let group_w = plot_w / measured.len() as f64;
        let bar_w = group_w * 0.8 / 3.0;
        for (g, (server, percentiles)) in measured.iter().enumerate() {
            let x0 = left + group_w * g as f64 + group_w * 0.1;
            for (k, ms) in percentiles.iter().enumerate() {
                let h = panel_h * ms.min(scale) / scale;
                let x = x0 + bar_w * k as f64;
                let _ = writeln!(
                    svg,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{ms:.2}</text>"#,
                    latency_top + panel_h - h,
                    bar_w * 0.9,
                    ["#9fc3e7", "#3866c4", "#1b2f66"][k],
                    x + bar_w * 0.45,
                    latency_top + panel_h - h - 3.0,
                );
            }
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{server}</text>"#,
                left + group_w * (g as f64 + 0.5),
                latency_top + panel_h + 18.0
            );
        }
    }
    let percentiles = [
        ("p50".to_owned(), Vec::new()),
        ("p99".to_owned(), Vec::new()),
        ("p999".to_owned(), Vec::new()),
    ];
    legend_colors(
        &mut svg,
        left,
        latency_top + panel_h + 40.0,
        &percentiles,
        &["#9fc3e7", "#3866c4", "#1b2f66"],
    );
    svg.push_str("</svg>\n");
    svg
}

/// Bars of req/s per shape, one per series, with the axis and legend, in the box
/// `(left, top, width, height)`.
fn bar_panel(
    svg: &mut String,
    (left, top, plot_w, panel_h): (f64, f64, f64, f64),
    shapes: &[Shape],
    series: &[(String, Vec<f64>)],
) {
    let max_rate = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(1.0, f64::max);
    let scale = nice_ceiling(max_rate);
    axis(svg, left, top, plot_w, panel_h, scale, "req/s");
    let group_w = plot_w / shapes.len() as f64;
    let bar_w = (group_w * 0.8) / series.len() as f64;
    for (s, shape) in shapes.iter().enumerate() {
        let x0 = left + group_w * s as f64 + group_w * 0.1;
        for (k, (_, values)) in series.iter().enumerate() {
            let h = panel_h * values[s] / scale;
            let x = x0 + bar_w * k as f64;
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"><title>{:.0}</title></rect>"#,
                top + panel_h - h,
                bar_w * 0.9,
                PLOT_COLORS[k % PLOT_COLORS.len()],
                values[s]
            );
            if values[s] > 0.0 {
                let _ = writeln!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{:.1}k</text>"#,
                    x + bar_w * 0.45,
                    top + panel_h - h - 3.0,
                    values[s] / 1000.0
                );
            }
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            left + group_w * (s as f64 + 0.5),
            top + panel_h + 18.0,
            shape.label()
        );
    }
    legend(svg, left, top + panel_h + 40.0, series);
}

/// The smallest 1, 2 or 5 times a power of ten at or above `value`.
fn nice_ceiling(value: f64) -> f64 {
    let power = 10f64.powf(value.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|v| *v >= value)
        .unwrap_or(10.0 * power)
}

fn axis(svg: &mut String, left: f64, top: f64, width: f64, height: f64, scale: f64, unit: &str) {
    for i in 0..=5 {
        let y = top + height - height * f64::from(i) / 5.0;
        let value = scale * f64::from(i) / 5.0;
        let label = if value >= 1000.0 {
            format!("{:.0}k", value / 1000.0)
        } else {
            // Rounded: steps like 0.02 are not exact in binary.
            format!("{}", (value * 1000.0).round() / 1000.0)
        };
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e6e6e6"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#666">{label}</text>"##,
            left + width,
            left - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="14" y="{:.1}" fill="#666" transform="rotate(-90 14 {:.1})" text-anchor="middle">{unit}</text>"##,
        top + height / 2.0,
        top + height / 2.0
    );
}

fn legend(svg: &mut String, left: f64, y: f64, series: &[(String, Vec<f64>)]) {
    legend_colors(svg, left, y, series, &PLOT_COLORS);
}

fn legend_colors(
    svg: &mut String,
    left: f64,
    y: f64,
    series: &[(String, Vec<f64>)],
    colors: &[&str],
) {
    let mut x = left;
    for (k, (name, _)) in series.iter().enumerate() {
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{y:.1}">{}</text>"#,
            y - 10.0,
            colors[k % colors.len()],
            x + 16.0,
            rlsd::simulate::svg::escape(name)
        );
        x += 26.0 + 7.0 * name.len() as f64;
    }
}
