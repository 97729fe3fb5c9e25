//! rlsd over real gRPC on loopback, against a do-nothing tonic server in the same run.
//!
//! Two servers live in one process: rlsd (`server::run` with `MemoryStore::new`, system clock,
//! default settings incl. `x-ratelimit-*` headers, high limits so every request is allowed) and a
//! baseline implementing the same `RateLimitService` trait that answers OK per descriptor at once
//! (built with the same tonic `Server` settings: TCP_NODELAY, 30 s HTTP/2 keepalive). Both are
//! driven by the same tonic client code:
//!
//! 1. peak: closed loop, `RLSD_BENCH_CONNECTIONS` (4) channels x `RLSD_BENCH_INFLIGHT` (16)
//!    requests in flight each, for 3-descriptor (three-layer) and 1-descriptor requests; rounds
//!    alternate baseline / rlsd (`RLSD_BENCH_ROUNDS`, 2) and the median round is shown;
//! 2. open loop at half of rlsd's measured 3-descriptor peak, the same rate for both servers: a
//!    pacer thread releases each request at its scheduled time (it sleeps with `std::thread::sleep`,
//!    ~60 µs granularity, since tokio timers tick in whole ms) as its own task, and latency runs
//!    from the *scheduled* time, so a stalled server cannot hide queueing (no coordinated
//!    omission); "lag" is how late requests actually started;
//! 3. one request in flight (one channel, closed loop).
//!
//! Each phase lasts `RLSD_BENCH_SECONDS` (3) after 0.5 s of warm-up; every latency is kept (µs).
//!
//! Threads: the servers run on their own tokio runtime (`RLSD_BENCH_SERVER_THREADS` workers,
//! thread name `bench-server`), the clients on another (`RLSD_BENCH_CLIENT_THREADS`, `bench-client`).
//! `RLSD_BENCH_SHARED=1` puts both on one runtime of `RLSD_BENCH_CLIENT_THREADS` workers instead.
//! The default is 2 server + 2 client workers on this 2-core machine: tried on 2026-era 2-core
//! runners, 1+1 left the server at ~60 % of a core (the tonic client costs about as much CPU per
//! request as the server, so with one core it could not saturate it), 2+1 likewise client-bound,
//! and a shared 2-worker runtime gave the same req/s as 2+2 within noise but no way to tell server
//! CPU from client CPU. 2+2 lets the kernel give each side what it needs, as h2load and the server
//! did in PERF.md, and still reports server and client CPU separately (from
//! `/proc/self/task/*/stat`, 10 ms ticks). Because the client is not free here, req/s is bound by
//! the two cores together; the figure that carries over is the server CPU per request, and the
//! rlsd / baseline ratio, which both see the same client.
//!
//! Answers are checked: OK (every status OK, one per descriptor), OVER_LIMIT, other (wrong
//! shape) and gRPC errors are counted and printed; any error or wrong answer is reported loudly.
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
use rlsd::service::{RateLimiter, ServiceSettings};
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
            seconds: Duration::from_secs_f64(var("RLSD_BENCH_SECONDS", 3.0)),
            rounds: var("RLSD_BENCH_ROUNDS", 2_usize).max(1),
            connections: var("RLSD_BENCH_CONNECTIONS", 4_usize).max(1),
            inflight: var("RLSD_BENCH_INFLIGHT", 16_usize).max(1),
            server_threads: var("RLSD_BENCH_SERVER_THREADS", 2_usize).max(1),
            client_threads: var("RLSD_BENCH_CLIENT_THREADS", 2_usize).max(1),
            shared: var("RLSD_BENCH_SHARED", 0_u8) == 1,
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

/// Starts rlsd on the current runtime; returns its gRPC address.
async fn start_rlsd() -> SocketAddr {
    let domain = config::load_str("grpc-bench.yaml", CONFIG)
        .unwrap_or_else(|e| panic!("bench config: {e:?}"));
    let mut loaded = Config::default();
    loaded.domains.insert(domain.name.clone(), domain);
    let config = Arc::new(ArcSwap::from_pointee(loaded));
    let store = Arc::new(MemoryStore::new(rlsd::store::memory::DEFAULT_MAX_KEYS));
    let limiter = RateLimiter::new(Arc::clone(&config), store, ServiceSettings::default());
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

/// Starts the baseline with the same tonic settings as `server::run`.
async fn start_baseline() -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.expect("bind baseline");
    let addr = listener.local_addr().expect("baseline address");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(RateLimitServiceServer::new(Baseline))
            .serve_with_incoming(incoming)
            .await
            .expect("baseline serves");
    });
    addr
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
        "| {:<28} | {:<8} | {:>9} | {:>7} | {:>7} | {:>7} | {:>7} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>13} | {:>13} |",
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
        "|{:-<30}|{:-<10}|{:->11}|{:->9}|{:->9}|{:->9}|{:->9}|{:->9}|{:->11}|{:->8}|{:->7}|{:->8}|{:->15}|{:->15}|",
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
            "| {:<28} | {:<8} | {:>9.0} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>14} | {:>14} |",
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
    let rlsd_addr = server_handle.block_on(start_rlsd());
    let baseline_addr = server_handle.block_on(start_baseline());

    let (rlsd_clients, baseline_clients) = client_rt.block_on(async {
        (
            connect(rlsd_addr, opts.connections).await,
            connect(baseline_addr, opts.connections).await,
        )
    });
    let servers: [(&'static str, &[Client]); 2] =
        [("baseline", &baseline_clients), ("rlsd", &rlsd_clients)];
    let three = pool(3);
    let one = pool(1);

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

    // Phase 1: peak, alternating servers.
    let shapes = [("3 descriptors", &three), ("1 descriptor", &one)];
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
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for (s, (shape, _)) in shapes.iter().enumerate() {
        let medians: Vec<Phase> = peaks[s].iter().map(|p| median(p)).collect();
        ratios.push((*shape, medians[1].rate() / medians[0].rate()));
        for (v, (server, _)) in servers.iter().enumerate() {
            rows.push(Row {
                phase: format!("peak, {shape}, {}x{}", opts.connections, opts.inflight),
                server,
                result: medians[v].clone(),
            });
        }
    }
    let rlsd_peak = rows
        .iter()
        .find(|r| r.server == "rlsd")
        .map_or(1000.0, |r| r.result.rate());

    // Phase 2: open loop at half of rlsd's 3-descriptor peak, the same rate for both.
    let half = rlsd_peak / 2.0;
    for (server, clients) in servers {
        eprintln!("open loop {server} at {half:.0}/s");
        let phase = open_loop(
            client_rt.handle(),
            clients,
            Arc::clone(&three),
            half,
            opts.seconds,
        );
        rows.push(Row {
            phase: format!("open loop {half:.0}/s, 3 desc"),
            server,
            result: phase,
        });
    }

    // Phase 3: one request in flight.
    for (shape, requests) in shapes {
        for (server, clients) in servers {
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

    println!();
    print_rows(&rows, opts.shared);
    println!();
    for (shape, ratio) in ratios {
        println!(
            "rlsd / baseline peak throughput, {shape}: {ratio:.2} (target >= 0.90: {})",
            if ratio >= 0.9 { "met" } else { "NOT met" }
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

    drop(rlsd_clients);
    drop(baseline_clients);
    client_rt.shutdown_timeout(Duration::from_secs(1));
    if let Some(rt) = server_rt {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}
