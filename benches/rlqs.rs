//! The quota service's cost: usage reports per second per core, and heap per (bucket x Envoy),
//! against an in-process server on loopback (the client in the same process: its CPU and heap
//! are counted too, so both figures are upper bounds on rlsd's own).
//!
//! Run: `cargo bench --bench rlqs` (`RLSD_BENCH_ENVOYS`, default 20 streams;
//! `RLSD_BENCH_BUCKETS`, default 500 buckets per stream; `RLSD_BENCH_SECONDS`, default 5).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use rlsd::config;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use rlsd::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use rlsd::server::{self, Listeners, ServeOptions};
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::MemoryStore;
use rlsd_testkit::counting_alloc::{CountingAlloc, count_during};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Counts net heap bytes while the streams are opened.
#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const CONFIG: &str = "domain: bench\nquota_buckets:\n  - bucket: {tenant: '*'}\n    rate_limit: {unit: second, requests_per_unit: 1000}\n";

fn report(buckets: usize, allowed: u64) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "bench".to_owned(),
        bucket_quota_usages: (0..buckets)
            .map(|b| BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: [("tenant".to_owned(), format!("tenant-{b:06}"))]
                        .into_iter()
                        .collect(),
                }),
                time_elapsed: Some(prost_types::Duration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: allowed,
                num_requests_denied: 0,
            })
            .collect(),
    }
}

/// One Envoy's stream: where its reports go, where its answers come from.
struct Stream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: tonic::Streaming<RateLimitQuotaResponse>,
}

async fn open(addr: std::net::SocketAddr) -> Stream {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (reports, receiver) = mpsc::channel(2);
    let answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .expect("stream")
        .into_inner();
    Stream { reports, answers }
}

fn main() {
    let envoys = env("RLSD_BENCH_ENVOYS", 20);
    let buckets = env("RLSD_BENCH_BUCKETS", 500);
    let seconds = env("RLSD_BENCH_SECONDS", 5) as u64;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let addr = runtime.block_on(async {
        let config = Arc::new(ArcSwap::from_pointee(
            config::load_sources(
                [("bench.yaml".to_owned(), Ok(CONFIG.to_owned()))],
                config::LoadOptions::default(),
            )
            .expect("config"),
        ));
        let store = Arc::new(MemoryStore::new(1000));
        let limiter = RateLimiter::new(Arc::clone(&config), store, ServiceSettings::default());
        let loopback = "127.0.0.1:0".parse().expect("address");
        let listeners = Listeners::bind(loopback, loopback).await.expect("bind");
        let addr = listeners.grpc.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = server::run_with(
                limiter,
                config,
                listeners,
                ServeOptions::default(),
                std::future::pending(),
            )
            .await;
        });
        addr
    });
    // Memory: every stream reports each of its buckets as new; the heap left is what the
    // server (and the client) hold for them.
    let (mut streams, counted) = count_during(|| {
        runtime.block_on(async {
            let mut streams = Vec::new();
            for _ in 0..envoys {
                let mut stream = open(addr).await;
                // As Envoy creates buckets: each alone, 1 allowed, time_elapsed 0.
                for bucket in 0..buckets {
                    let mut first = report(buckets, 1);
                    let usage = first.bucket_quota_usages.swap_remove(bucket);
                    first.bucket_quota_usages = vec![BucketQuotaUsage {
                        time_elapsed: Some(prost_types::Duration::default()),
                        ..usage
                    }];
                    stream.reports.send(first).await.expect("send");
                    stream.answers.message().await.expect("answer");
                }
                streams.push(stream);
            }
            streams
        })
    });
    let pairs = (envoys * buckets) as f64;
    println!(
        "rlqs memory: {envoys} Envoys x {buckets} buckets: {:.0} bytes of heap per (bucket x Envoy), client included",
        counted.net_bytes as f64 / pairs
    );
    // Throughput: each stream sends its next report as soon as the last was answered.
    let done = Arc::new(AtomicU64::new(0));
    let cpu_before = rlsd_testkit::cpu::cpu_time_of("/proc/self/stat");
    let started = Instant::now();
    runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let tasks: Vec<_> = streams
            .drain(..)
            .map(|mut stream| {
                let done = Arc::clone(&done);
                tokio::spawn(async move {
                    let next = report(buckets, 10);
                    while Instant::now() < deadline {
                        if stream.reports.send(next.clone()).await.is_err() {
                            break;
                        }
                        if !matches!(stream.answers.message().await, Ok(Some(_))) {
                            break;
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = (rlsd_testkit::cpu::cpu_time_of("/proc/self/stat") - cpu_before).as_secs_f64();
    let reports = done.load(Ordering::Relaxed) as f64;
    println!(
        "rlqs throughput: {:.0} reports/s ({:.0} bucket reports/s) over {elapsed:.1} s, {cpu:.1} CPU-seconds: {:.0} reports per CPU-second ({:.0} bucket reports), client included",
        reports / elapsed,
        reports * buckets as f64 / elapsed,
        reports / cpu.max(1e-9),
        reports * buckets as f64 / cpu.max(1e-9),
    );
}
