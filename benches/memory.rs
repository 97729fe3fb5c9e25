//! Memory per live key, for each algorithm: in process (live heap bytes over N keys) and
//! in Redis (`used_memory` growth over M keys, plus `MEMORY USAGE` of one key), the keys written
//! through the real stores with the real key layout.
//!
//! Run: `cargo bench --bench memory` (`RLSD_BENCH_KEYS`, default 1 000 000 in process;
//! `RLSD_BENCH_REDIS_KEYS`, default 100 000 in Redis; `RLSD_BENCH_VALUE_BYTES` pads each
//! descriptor value to that length: 87 gives the longest plain key, anything above 87 a
//! digested one).

use std::sync::Arc;
use std::time::Duration;

use rlsd::algorithm::{Hits, Params};
use rlsd::engine::{self, KeySettings};
use rlsd::limit::{Algorithm, Limit, Unit};
use rlsd::store::{Check, MemoryStore, RedisSettings, RedisStore, Store};
use rlsd_testkit::counting_alloc::{CountingAlloc, count_during};
use rlsd_testkit::ready::ready;
use rlsd_testkit::redis::RedisServer;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Counts net heap bytes, so each store's own memory is measured whatever the allocator reuses.
#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

fn check(algorithm: Algorithm, i: usize, value_bytes: usize) -> Check {
    let mut limit = Limit::fixed(600, Unit::Day);
    limit.algorithm = algorithm;
    let mut value = format!("key-{i:08}");
    value.push_str(&"x".repeat(value_bytes.saturating_sub(value.len())));
    Check {
        // A real key: `rlsd:plan:edge-proxy:<tag>:86400:api_key=<value>`, as the engine builds it.
        key: engine::key::encode(
            &KeySettings::default(),
            "plan",
            "edge-proxy",
            &limit,
            &[("api_key".to_owned(), value)],
        ),
        // A day-long period keeps every key alive (and measured) through the run.
        params: Params {
            algorithm,
            limit: 600,
            period_us: 86_400_000_000,
            burst: if algorithm == Algorithm::Gcra {
                10
            } else {
                600
            },
        },
        hits: Hits::Take(1),
        shadow: false,
        quota_mode: false,
    }
}

fn main() {
    let keys = env("RLSD_BENCH_KEYS", 1_000_000);
    let redis_keys = env("RLSD_BENCH_REDIS_KEYS", 100_000);
    let value_bytes = env("RLSD_BENCH_VALUE_BYTES", 0);
    println!("# memory per live key, written through the real stores (one hit each)");
    println!();
    println!(
        "Keys like `{}` ({} bytes).",
        check(Algorithm::FixedWindow, 0, value_bytes).key,
        check(Algorithm::FixedWindow, 0, value_bytes).key.len()
    );
    println!();
    println!(
        "| algorithm | in process, bytes/key ({keys} keys) | Redis used_memory, bytes/key ({redis_keys} keys) | Redis MEMORY USAGE of one key |"
    );
    println!("|---|---|---|---|");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let redis = RedisServer::start_for_bench(&[]);
    for algorithm in Algorithm::ALL {
        let (store, counted) = count_during(|| {
            let store = MemoryStore::new(keys + 1);
            for i in 0..keys {
                ready(store.decide(&[check(algorithm, i, value_bytes)])).expect("decide");
            }
            store
        });
        let in_process = counted.net_bytes as f64 / keys as f64;
        drop(store);

        redis.cli(&["FLUSHALL"]);
        let before = redis.used_memory();
        runtime.block_on(async {
            let mut settings = RedisSettings::new(format!("redis://127.0.0.1:{}", redis.port));
            settings.command_timeout = Duration::from_secs(5);
            let store = Arc::new(RedisStore::connect(settings).await.expect("connect"));
            let workers: Vec<_> = (0..32)
                .map(|w| {
                    let store = Arc::clone(&store);
                    tokio::spawn(async move {
                        for i in (w..redis_keys).step_by(32) {
                            store
                                .decide(&[check(algorithm, i, value_bytes)])
                                .await
                                .expect("decide");
                        }
                    })
                })
                .collect();
            for worker in workers {
                worker.await.expect("worker");
            }
        });
        let in_redis = (redis.used_memory() - before) as f64 / redis_keys as f64;
        let one = redis
            .cli(&["MEMORY", "USAGE", &check(algorithm, 0, value_bytes).key])
            .unwrap_or_default();
        println!("| {algorithm} | {in_process:.0} | {in_redis:.0} | {one} |");
    }
    println!();
    println!(
        "In process: live heap bytes held by the store (keys, state, map slack), from a counting allocator. Redis: growth of used_memory after FLUSHALL."
    );
}
