//! rlsd over real gRPC on loopback, against a do-nothing tonic server in the same run.
//!
//! Servers in this process: rlsd (`server::run` with `MemoryStore::new` on the system clock,
//! default `ServiceSettings` so `x-ratelimit-*` headers are on, high limits so every request is
//! allowed, 1000 distinct clients = 3000 keys), and a baseline implementing the same
//! `RateLimitService` trait that answers OK with one OK status per descriptor at once, served with
//! the same tonic settings as `server::run` (TCP_NODELAY, 30 s HTTP/2 keepalive). All are driven
//! by the same tonic client code. `RLSD_BENCH_EXTRA=1` adds two diagnostic servers: `canned`
//! replays rlsd's own captured answers (same bytes on the wire, no work) and `rlsd-svc` serves
//! rlsd's `RateLimiter` with the baseline's setup instead of `server::run`; `rlsd-nohdr` is that
//! with `HeaderStyle::Off` (no `x-ratelimit-*` headers).
//!
//! Phases (each `RLSD_BENCH_SECONDS`, default 2, after 0.5 s of warm-up; every latency kept):
//! 1. peak: closed loop, `RLSD_BENCH_CONNECTIONS` (4) channels (one HTTP/2 connection each) x
//!    `RLSD_BENCH_INFLIGHT` (16) requests in flight each, for 3-descriptor (three-layer) and
//!    1-descriptor requests; servers alternate within each of `RLSD_BENCH_ROUNDS` (3) rounds and
//!    the median round is shown (PERF.md: quote medians of alternating rounds);
//! 2. open loop at `RLSD_BENCH_OPEN_FRACTIONS` (0.5,0.25) of rlsd's measured 3-descriptor peak
//!    (or `RLSD_BENCH_OPEN_RATE` req/s), the same rate for every server. A pacer thread releases
//!    each request at its scheduled time as its own task (it sleeps with `std::thread::sleep`,
//!    ~60 µs granularity, because tokio timers tick in whole ms), and latency runs from the
//!    *scheduled* time, so a server that stalls cannot hide the queueing it causes (no coordinated
//!    omission). "lag p99" is how late requests actually started on the client runtime;
//! 3. one request in flight (one channel, closed loop), p50/p99.
//!
//! `RLSD_BENCH_PHASES` (peak,open,single) and `RLSD_BENCH_ONLY` (e.g. `rlsd`) select.
//!
//! Threads: the servers run on their own tokio runtime (`RLSD_BENCH_SERVER_THREADS`, default 2,
//! threads named `bench-server`), the clients on another (`RLSD_BENCH_CLIENT_THREADS`, default 2,
//! `bench-client`); `RLSD_BENCH_SHARED=1` puts both on one runtime. Variants tried on this
//! 2-core machine (peak, 3 rounds, rlsd / baseline): 1+1 gave 0.77 (3 desc) / 0.81 (1 desc) and
//! 0.79 / 0.95, 2+2 gave 0.69 / 0.80, 0.73 / 0.82 and 0.78 / 1.08, one shared 2-worker runtime
//! 0.86 / 1.00 and 0.79 / 0.91 (other jobs were loading the machine: spread is ±10 %). 2+2 is the
//! default: like rlsd in production (its own process, a worker per core) and like PERF.md (server
//! and load generator sharing both cores, the kernel giving each what it asks for). 1+1 caps each
//! side at one core, so whichever side is heavier bounds both, and with 1+1 the baseline was
//! client-bound (client ~97 % of its core), flattering the ratio. The shared runtime runs client
//! and server tasks on the same workers (cheap hand-offs a separate process never gets) and
//! cannot tell server CPU from client CPU. Since the tonic client costs about as much CPU per
//! request as the server, req/s here is bound by the two cores together: the figure that carries
//! over is the server's CPU per request (from `/proc/self/task/*/stat`, 10 ms ticks); the
//! baseline's (~17-22 µs) matches PERF.md's h2load figure for the same do-nothing server (16-19).
//!
//! Answers are checked: OK (overall OK and one OK status per descriptor), OVER_LIMIT, wrong
//! (anything else) and gRPC errors are counted and printed; any of the last three is reported
//! loudly, as is a request never answered.
//!
//! Run: `cargo bench --bench grpc`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use rlsd::config::{self, Config};
use rlsd::pb::rate_limit_descriptor::Entry;
use rlsd::pb::rate_limit_response::{Code, DescriptorStatus};
use rlsd::pb::{
    RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitService,
    RateLimitServiceClient, RateLimitServiceServer,
};
use rlsd::server::{self, Listeners};
use rlsd::service::{HeaderStyle, RateLimiter, ServiceSettings};
use rlsd::store::MemoryStore;
use tokio::net::TcpListener;
use tokio::runtime::{Handle, Runtime};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

/// High limits: everything is allowed (u32::MAX is 4_294_967_295).
const CONFIG: &str = r#"
domain: edge-proxy
descriptors:
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
"#;

/// Distinct clients (IP + API key) the requests cycle through.
const CLIENTS: usize = 1000;
const WARMUP: Duration = Duration::from_millis(500);
/// Clock ticks per second of `/proc/*/stat` times (`getconf CLK_TCK` on Linux).
const CLK_TCK: f64 = 100.0;

type Client = RateLimitServiceClient<Channel>;

struct Opts {
    seconds: Duration,
    rounds: usize,
    connections: usize,
    inflight: usize,
    server_threads: usize,
    client_threads: usize,
    shared: bool,
    extra: bool,
    phases: Vec<String>,
    open_rate: Option<f64>,
    open_fractions: Vec<f64>,
    only: Option<Vec<String>>,
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
            rounds: var("RLSD_BENCH_ROUNDS", 3_usize).max(1),
            connections: var("RLSD_BENCH_CONNECTIONS", 4_usize).max(1),
            inflight: var("RLSD_BENCH_INFLIGHT", 16_usize).max(1),
            server_threads: var("RLSD_BENCH_SERVER_THREADS", 2_usize).max(1),
            client_threads: var("RLSD_BENCH_CLIENT_THREADS", 2_usize).max(1),
            shared: var("RLSD_BENCH_SHARED", 0_u8) == 1,
            extra: var("RLSD_BENCH_EXTRA", 0_u8) == 1,
            phases: var("RLSD_BENCH_PHASES", "peak,open,single".to_owned())
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

/// rlsd's service on the bench config, a system-clock `MemoryStore` and default settings.
fn limiter() -> (Limiter, Arc<ArcSwap<Config>>) {
    limiter_with(ServiceSettings::default())
}

/// rlsd's service on the bench config and a system-clock `MemoryStore`.
fn limiter_with(settings: ServiceSettings) -> (Limiter, Arc<ArcSwap<Config>>) {
    let domain = config::load_str("grpc-bench.yaml", CONFIG)
        .unwrap_or_else(|e| panic!("bench config: {e:?}"));
    let mut loaded = Config::default();
    loaded.domains.insert(domain.name.clone(), domain);
    let config = Arc::new(ArcSwap::from_pointee(loaded));
    let store = Arc::new(MemoryStore::new(rlsd::store::memory::DEFAULT_MAX_KEYS));
    let limiter = RateLimiter::new(Arc::clone(&config), store, settings);
    (limiter, config)
}

/// Starts rlsd (`server::run`) on the current runtime; returns its gRPC address.
async fn start_rlsd() -> SocketAddr {
    let (limiter, config) = limiter();
    let listeners = Listeners::bind(loopback(), loopback())
        .await
        .expect("bind rlsd");
    let addr = listeners.grpc.local_addr().expect("rlsd address");
    tokio::spawn(async move {
        server::run(limiter, config, listeners, std::future::pending())
            .await
            .expect("rlsd serves");
    });
    addr
}

/// Serves `service` with the same tonic settings as `server::run`.
async fn start_service<T: RateLimitService>(service: T) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(RateLimitServiceServer::new(service))
            .serve_with_incoming(incoming)
            .await
            .expect("server serves");
    });
    addr
}

/// rlsd's `RateLimiter` served by `start_service` rather than `server::run`.
async fn start_rlsd_service() -> SocketAddr {
    let (limiter, _) = limiter();
    start_service(limiter).await
}

/// Replays fixed answers: rlsd's, captured at start, so the bytes on the wire are the same.
struct Canned {
    three: RateLimitResponse,
    one: RateLimitResponse,
}

#[tonic::async_trait]
impl RateLimitService for Canned {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let answer = if request.get_ref().descriptors.len() == 1 {
            &self.one
        } else {
            &self.three
        };
        Ok(Response::new(answer.clone()))
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

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Requests for `CLIENTS` distinct clients with `descriptors` (3 = three layers, 1 = edge only).
fn pool(descriptors: usize) -> Arc<Vec<RateLimitRequest>> {
    let requests = (0..CLIENTS)
        .map(|c| {
            let ip = format!("10.0.{}.{}", c / 256, c % 256);
            let key = format!("key-{c:05}");
            let mut all = vec![
                descriptor(&[("remote_address", &ip)]),
                descriptor(&[("plan", "pro"), ("api_key", &key)]),
                descriptor(&[("endpoint", "search"), ("api_key", &key)]),
            ];
            all.truncate(descriptors);
            RateLimitRequest {
                domain: "edge-proxy".to_owned(),
                descriptors: all,
                hits_addend: 0,
            }
        })
        .collect();
    Arc::new(requests)
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
            Ok(response) => {
                let r = response.get_ref();
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
            Err(status) => {
                self.errors += 1;
                self.first_problem
                    .get_or_insert_with(|| format!("error: {status}"));
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
        if comm.starts_with("bench-server") {
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
        cpu: Cpu {
            server: cpu_end.server - cpu_begin.server,
            client: cpu_end.client - cpu_begin.client,
            total: cpu_end.total - cpu_begin.total,
        },
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
        cpu: Cpu {
            server: cpu_end.server - cpu_begin.server,
            client: cpu_end.client - cpu_begin.client,
            total: cpu_end.total - cpu_begin.total,
        },
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
        "| {:<30} | {:<10} | {:>9} | {:>7} | {:>7} | {:>7} | {:>7} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>13} | {:>13} |",
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
        "cli CPU µs/req"
    );
    println!(
        "|{:-<32}|{:-<12}|{:->11}|{:->9}|{:->9}|{:->9}|{:->9}|{:->9}|{:->11}|{:->8}|{:->7}|{:->8}|{:->15}|{:->15}|",
        "", "", "", "", "", "", "", "", "", "", "", "", "", ""
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
        let lag = if r.lag_us.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.3}", Phase::percentile(&r.lag_us, 0.99))
        };
        println!(
            "| {:<30} | {:<10} | {:>9.0} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>14} | {:>14} |",
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

fn main() {
    let opts = Opts::from_env();
    let client_rt = runtime(opts.client_threads, "bench-client");
    let server_rt = (!opts.shared).then(|| runtime(opts.server_threads, "bench-server"));
    let server_handle = server_rt
        .as_ref()
        .map_or_else(|| client_rt.handle().clone(), |rt| rt.handle().clone());
    let three = pool(3);
    let one = pool(1);

    let mut addrs: Vec<(&'static str, SocketAddr)> = vec![
        ("baseline", server_handle.block_on(start_service(Baseline))),
        ("rlsd", server_handle.block_on(start_rlsd())),
    ];
    if opts.extra {
        // rlsd's own answers, captured once, replayed by a server that does nothing else.
        let rlsd = addrs[1].1;
        let (three_answer, one_answer) = client_rt.block_on(async {
            let mut client = connect(rlsd, 1).await.remove(0);
            let mut ask = async |request: &RateLimitRequest| {
                client
                    .should_rate_limit(request.clone())
                    .await
                    .expect("rlsd answers")
                    .into_inner()
            };
            (ask(&three[0]).await, ask(&one[0]).await)
        });
        let canned = Canned {
            three: three_answer,
            one: one_answer,
        };
        addrs.push(("canned", server_handle.block_on(start_service(canned))));
        addrs.push(("rlsd-svc", server_handle.block_on(start_rlsd_service())));
        let no_headers = ServiceSettings {
            headers: HeaderStyle::Off,
            ..ServiceSettings::default()
        };
        let (limiter, _) = limiter_with(no_headers);
        addrs.push(("rlsd-nohdr", server_handle.block_on(start_service(limiter))));
    }
    if let Some(only) = &opts.only {
        addrs.retain(|(name, _)| only.iter().any(|o| o == name));
    }
    let servers: Vec<(&'static str, Vec<Client>)> = client_rt.block_on(async {
        let mut servers = Vec::new();
        for (name, addr) in &addrs {
            servers.push((*name, connect(*addr, opts.connections).await));
        }
        servers
    });

    println!(
        "# rlsd gRPC bench: {} connections x {} in flight, {:.1} s per phase, {} round(s), {}",
        opts.connections,
        opts.inflight,
        opts.seconds.as_secs_f64(),
        opts.rounds,
        if opts.shared {
            format!("one shared runtime of {} workers", opts.client_threads)
        } else {
            format!(
                "server runtime {} workers, client runtime {} workers",
                opts.server_threads, opts.client_threads
            )
        }
    );
    println!("# CPU columns: µs of CPU per request (and % of one core over the phase)");
    if opts.extra {
        println!(
            "# extra servers: canned = replays rlsd's captured response (same bytes, no work); \
             rlsd-svc = rlsd's RateLimiter on the baseline's tonic setup instead of server::run; \
             rlsd-nohdr = rlsd-svc without x-ratelimit headers"
        );
    }

    let shapes = [("3 descriptors", &three), ("1 descriptor", &one)];
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    let mut rlsd_peak = None;

    // Phase 1: peak, servers alternating within each round.
    if opts.phases.iter().any(|p| p == "peak") {
        let mut peaks: Vec<Vec<Vec<Phase>>> = vec![vec![Vec::new(); servers.len()]; shapes.len()];
        for round in 0..opts.rounds {
            eprintln!("peak round {}/{}", round + 1, opts.rounds);
            for (s, (_, requests)) in shapes.iter().enumerate() {
                for (v, (_, clients)) in servers.iter().enumerate() {
                    let phase = client_rt.block_on(closed_loop(
                        clients,
                        opts.inflight,
                        Arc::clone(requests),
                        opts.seconds,
                    ));
                    peaks[s][v].push(phase);
                }
            }
        }
        for (s, (shape, _)) in shapes.iter().enumerate() {
            let medians: Vec<Phase> = peaks[s].iter().map(|p| median(p)).collect();
            let rate_of = |name: &str| {
                servers
                    .iter()
                    .position(|(server, _)| *server == name)
                    .map(|v| medians[v].rate())
            };
            let cpu_of = |name: &str| {
                servers
                    .iter()
                    .position(|(server, _)| *server == name)
                    .map(|v| {
                        medians[v].cpu.server * 1e6 / medians[v].latencies_us.len().max(1) as f64
                    })
            };
            if let (Some(rlsd), Some(baseline)) = (rate_of("rlsd"), rate_of("baseline")) {
                let cpu = cpu_of("rlsd").zip(cpu_of("baseline"));
                ratios.push((*shape, rlsd / baseline, cpu));
            }
            if s == 0 {
                rlsd_peak = rate_of("rlsd");
            }
            for (v, (server, _)) in servers.iter().enumerate() {
                rows.push(Row {
                    phase: format!("peak, {shape}, {}x{}", opts.connections, opts.inflight),
                    server,
                    result: medians[v].clone(),
                });
            }
        }
    }

    // Phase 2: open loop at fractions of rlsd's 3-descriptor peak, the same rate for every
    // server; the pacer is a thread of its own, counted as client CPU.
    if opts.phases.iter().any(|p| p == "open") {
        let rates: Vec<f64> = match (opts.open_rate, rlsd_peak) {
            (Some(rate), _) => vec![rate],
            (None, Some(peak)) => opts.open_fractions.iter().map(|f| peak * f).collect(),
            (None, None) => vec![10_000.0],
        };
        for rate in rates {
            for (server, clients) in &servers {
                eprintln!("open loop {server} at {rate:.0}/s");
                let handle = client_rt.handle().clone();
                let requests = Arc::clone(&three);
                let seconds = opts.seconds;
                let phase = std::thread::scope(|scope| {
                    std::thread::Builder::new()
                        .name("bench-client-pacer".to_owned())
                        .spawn_scoped(scope, || {
                            open_loop(&handle, clients, requests, rate, seconds)
                        })
                        .expect("pacer thread")
                        .join()
                        .expect("pacer")
                });
                let fraction = rlsd_peak.map_or(String::new(), |peak| {
                    format!(" ({:.0}% pk)", 100.0 * rate / peak)
                });
                rows.push(Row {
                    phase: format!("open {rate:.0}/s{fraction}, 3 desc"),
                    server,
                    result: phase,
                });
            }
        }
    }

    // Phase 3: one request in flight.
    if opts.phases.iter().any(|p| p == "single") {
        for (shape, requests) in shapes {
            for (server, clients) in &servers {
                eprintln!("1 in flight {server} {shape}");
                let phase = client_rt.block_on(closed_loop(
                    &clients[..1],
                    1,
                    Arc::clone(requests),
                    opts.seconds,
                ));
                rows.push(Row {
                    phase: format!("1 in flight, {shape}"),
                    server,
                    result: phase,
                });
            }
        }
    }

    println!();
    print_rows(&rows, opts.shared);
    println!();
    for (shape, ratio, cpu) in ratios {
        println!(
            "rlsd / baseline peak throughput, {shape}: {ratio:.2} (target >= 0.90: {})",
            if ratio >= 0.9 { "met" } else { "NOT met" }
        );
        if let (Some((rlsd, baseline)), false) = (cpu, opts.shared) {
            println!(
                "  server CPU per request at peak, {shape}: rlsd {rlsd:.1} µs, baseline {baseline:.1} µs \
                 (rlsd adds {:.1} µs; CPU-normalised ratio {:.2}, less sensitive to other load)",
                rlsd - baseline,
                baseline / rlsd
            );
        }
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

    drop(servers);
    client_rt.shutdown_timeout(Duration::from_secs(1));
    if let Some(rt) = server_rt {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}
