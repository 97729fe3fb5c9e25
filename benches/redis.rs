//! rlsd with the Redis store over real gRPC, against `redis-benchmark` running the same entry
//! script on the same Redis in the same run (the one-call-per-request ceiling).
//!
//! Phases, each `RLSD_BENCH_SECONDS` (3) long, printed as a table:
//! 1. `redis-benchmark -c 50` on the entry script with 1 and 3 keys (random keys from a pool of
//!    1000, `-r 1000`): calls/s unpipelined, Redis CPU per call.
//! 2. rlsd (Redis store, coalescing on and off) driven by tonic clients, 4 connections x 16 in
//!    flight, 1 and 3 descriptors per request over 1000 clients: requests/s, p50/p99/p999,
//!    Redis CPU per request, and the ratio to the redis-benchmark ceiling.
//! 3. Latency at half of the measured peak (open loop, latency from the scheduled send time so
//!    queueing is not hidden) and with one request in flight.
//!
//! The servers (rlsd, Redis) and the clients share the machine's cores: read the ratios, not the
//! absolute figures. Run: `cargo bench --bench redis`.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[path = "support/redis_server.rs"]
mod redis_server;

use redis_server::Redis;
use rlsd::engine::KeySettings;
use rlsd::pb::rate_limit_descriptor::Entry;
use rlsd::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitServiceClient};
use rlsd::server::{self, Listeners};
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::{RedisSettings, RedisStore};
use tokio::runtime::Runtime;
use tonic::transport::Channel;

const CONFIG: &str = r#"
domain: bench
descriptors:
  - key: edge
    rate_limit: {unit: second, requests_per_unit: 4000000000, algorithm: gcra, burst: 4000000000}
  - key: plan
    rate_limit: {unit: second, requests_per_unit: 4000000000, algorithm: gcra, burst: 4000000000}
  - key: endpoint
    rate_limit: {unit: second, requests_per_unit: 4000000000, algorithm: gcra, burst: 4000000000}
"#;
const CLIENTS: usize = 1000;
const CONNECTIONS: usize = 4;
const IN_FLIGHT: usize = 16;

fn seconds() -> Duration {
    let secs = std::env::var("RLSD_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(secs)
}

/// `redis-benchmark` on the entry script with `keys` random keys per call: calls/s.
fn redis_benchmark(redis: &Redis, keys: usize) -> (f64, f64) {
    let sha = redis
        .cli(&["SCRIPT", "LOAD", rlsd::store::redis::SCRIPT])
        .expect("load script");
    let mut args: Vec<String> = vec!["EVALSHA".into(), sha, keys.to_string()];
    for i in 0..keys {
        args.push(format!("rlsd:_:bench:gcra:1:k{i}=__rand_int__"));
    }
    args.extend(["".into(), "1".into(), keys.to_string()]);
    for _ in 0..keys {
        args.extend(
            ["gcra", "4000000000", "1000000", "4000000000", "t", "1", "0"].map(String::from),
        );
    }
    let total = 200_000;
    let cpu = redis.cpu_us();
    let started = Instant::now();
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &redis.port.to_string(),
            "-c",
            "50",
            "-n",
            &total.to_string(),
            "-r",
            "1000",
            "-q",
        ])
        .args(&args)
        .output()
        .expect("redis-benchmark");
    let elapsed = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = text
        .split_whitespace()
        .zip(text.split_whitespace().skip(1))
        .find(|(_, next)| *next == "requests")
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or(total as f64 / elapsed);
    let cpu_per_call = (redis.cpu_us() - cpu) as f64 / total as f64;
    (rps, cpu_per_call)
}

fn descriptor(key: &str, value: String) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![Entry {
            key: key.to_owned(),
            value,
        }],
        ..Default::default()
    }
}

fn requests(descriptors: usize) -> Arc<Vec<RateLimitRequest>> {
    Arc::new(
        (0..CLIENTS)
            .map(|i| RateLimitRequest {
                domain: "bench".to_owned(),
                descriptors: ["edge", "plan", "endpoint"][..descriptors]
                    .iter()
                    .map(|key| descriptor(key, format!("client-{i}")))
                    .collect(),
                hits_addend: 0,
            })
            .collect(),
    )
}

async fn start_rlsd(redis: &Redis, max_batch: usize) -> SocketAddr {
    let mut settings = RedisSettings::new(format!("redis://127.0.0.1:{}", redis.port));
    settings.command_timeout = Duration::from_secs(1);
    settings.max_batch = max_batch;
    let store = Arc::new(RedisStore::connect(settings).await.expect("connect"));
    let domain = rlsd::config::load_str("bench.yaml", CONFIG).expect("config");
    let mut config = rlsd::config::Config::default();
    config.domains.insert(domain.name.clone(), domain);
    let config = Arc::new(arc_swap::ArcSwap::from_pointee(config));
    let service = ServiceSettings {
        keys: KeySettings::default(),
        ..Default::default()
    };
    let limiter = RateLimiter::new(Arc::clone(&config), store, service);
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let listeners = Listeners::bind(loopback, loopback).await.expect("bind");
    let addr = listeners.grpc.local_addr().expect("addr");
    tokio::spawn(server::run(
        limiter,
        config,
        listeners,
        std::future::pending(),
    ));
    addr
}

struct Result {
    rps: f64,
    latencies: Vec<u32>,
    errors: u64,
    over: u64,
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[index]) / 1000.0
}

async fn clients(addr: SocketAddr, count: usize) -> Vec<RateLimitServiceClient<Channel>> {
    let mut out = Vec::new();
    for _ in 0..count {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        out.push(RateLimitServiceClient::new(channel));
    }
    out
}

/// Closed loop: `connections` x `in_flight` workers sending back to back for `duration`.
async fn closed_loop(
    addr: SocketAddr,
    pool: Arc<Vec<RateLimitRequest>>,
    connections: usize,
    in_flight: usize,
    duration: Duration,
) -> Result {
    let clients = clients(addr, connections).await;
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..connections * in_flight)
        .map(|w| {
            let mut client = clients[w % connections].clone();
            let (pool, next) = (Arc::clone(&pool), Arc::clone(&next));
            tokio::spawn(async move {
                let (mut latencies, mut errors, mut over) = (Vec::new(), 0, 0);
                while started.elapsed() < duration {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize % pool.len();
                    let sent = Instant::now();
                    match client.should_rate_limit(pool[i].clone()).await {
                        Ok(r) => over += u64::from(r.into_inner().overall_code != 1),
                        Err(_) => errors += 1,
                    }
                    latencies.push(sent.elapsed().as_micros() as u32);
                }
                (latencies, errors, over)
            })
        })
        .collect();
    let mut result = Result {
        rps: 0.0,
        latencies: Vec::new(),
        errors: 0,
        over: 0,
    };
    for worker in workers {
        let (latencies, errors, over) = worker.await.expect("worker");
        result.latencies.extend(latencies);
        result.errors += errors;
        result.over += over;
    }
    result.rps = result.latencies.len() as f64 / started.elapsed().as_secs_f64();
    result.latencies.sort_unstable();
    result
}

/// Open loop at `rate` requests/s; latency counts from each request's scheduled time.
async fn open_loop(
    addr: SocketAddr,
    pool: Arc<Vec<RateLimitRequest>>,
    rate: f64,
    duration: Duration,
) -> Result {
    let clients = clients(addr, CONNECTIONS).await;
    let started = Instant::now();
    let total = (rate * duration.as_secs_f64()) as u64;
    let mut tasks = Vec::with_capacity(total as usize);
    for n in 0..total {
        let scheduled = started + Duration::from_secs_f64(n as f64 / rate);
        let now = Instant::now();
        if scheduled > now {
            tokio::time::sleep_until(scheduled.into()).await;
        }
        let mut client = clients[n as usize % CONNECTIONS].clone();
        let request = pool[n as usize % pool.len()].clone();
        tasks.push(tokio::spawn(async move {
            let answer = client.should_rate_limit(request).await;
            (scheduled.elapsed().as_micros() as u32, answer.is_err())
        }));
    }
    let mut result = Result {
        rps: 0.0,
        latencies: Vec::new(),
        errors: 0,
        over: 0,
    };
    for task in tasks {
        let (latency, error) = task.await.expect("task");
        result.latencies.push(latency);
        result.errors += u64::from(error);
    }
    result.rps = total as f64 / started.elapsed().as_secs_f64();
    result.latencies.sort_unstable();
    result
}

fn main() {
    let duration = seconds();
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("bench-server")
        .build()
        .expect("runtime");
    let client_rt: Runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("bench-client")
        .build()
        .expect("runtime");
    let redis = Redis::start();

    println!(
        "rlsd Redis store vs redis-benchmark on the same Redis (127.0.0.1:{}), {:?} per phase",
        redis.port, duration
    );
    println!();
    let mut ceilings = Vec::new();
    for keys in [1, 3] {
        let (rps, cpu) = redis_benchmark(&redis, keys);
        println!(
            "redis-benchmark -c 50, entry script, {keys} key(s): {rps:>9.0} calls/s, Redis CPU {cpu:.1} µs/call"
        );
        ceilings.push(rps);
    }
    println!();
    println!(
        "{:<34} {:>9} {:>7} {:>8} {:>8} {:>8} {:>9} {:>7}",
        "rlsd (4 conns x 16 in flight)",
        "req/s",
        "ratio",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "redis µs",
        "errors"
    );
    for (coalesce, max_batch) in [
        ("coalescing", rlsd::store::redis::DEFAULT_MAX_BATCH),
        ("one EVALSHA per request", 1),
    ] {
        let addr = server_rt.block_on(start_rlsd(&redis, max_batch));
        for (d, ceiling) in [(1usize, ceilings[0]), (3, ceilings[1])] {
            let pool = requests(d);
            let _warm = client_rt.block_on(closed_loop(
                addr,
                Arc::clone(&pool),
                CONNECTIONS,
                IN_FLIGHT,
                Duration::from_millis(300),
            ));
            let cpu = redis.cpu_us();
            let r = client_rt.block_on(closed_loop(
                addr,
                Arc::clone(&pool),
                CONNECTIONS,
                IN_FLIGHT,
                duration,
            ));
            let redis_us = (redis.cpu_us() - cpu) as f64 / r.latencies.len().max(1) as f64;
            println!(
                "{:<34} {:>9.0} {:>6.2}x {:>8.3} {:>8.3} {:>8.3} {:>9.1} {:>7}",
                format!("{coalesce}, {d} descr."),
                r.rps,
                r.rps / ceiling,
                percentile(&r.latencies, 0.5),
                percentile(&r.latencies, 0.99),
                percentile(&r.latencies, 0.999),
                redis_us,
                r.errors + r.over
            );
            if d == 3 {
                let half =
                    client_rt.block_on(open_loop(addr, Arc::clone(&pool), r.rps / 2.0, duration));
                println!(
                    "{:<34} {:>9.0} {:>7} {:>8.3} {:>8.3} {:>8.3} {:>9} {:>7}",
                    "  at half of that peak (open loop)",
                    half.rps,
                    "",
                    percentile(&half.latencies, 0.5),
                    percentile(&half.latencies, 0.99),
                    percentile(&half.latencies, 0.999),
                    "",
                    half.errors
                );
                let one = client_rt.block_on(closed_loop(addr, Arc::clone(&pool), 1, 1, duration));
                println!(
                    "{:<34} {:>9.0} {:>7} {:>8.3} {:>8.3} {:>8.3} {:>9} {:>7}",
                    "  one request in flight",
                    one.rps,
                    "",
                    percentile(&one.latencies, 0.5),
                    percentile(&one.latencies, 0.99),
                    percentile(&one.latencies, 0.999),
                    "",
                    one.errors + one.over
                );
            }
        }
    }
    println!();
    println!(
        "ratio = rlsd req/s / redis-benchmark calls/s with the same keys per call; errors counts gRPC errors and OVER_LIMIT answers (all requests are under their limits)"
    );
}
