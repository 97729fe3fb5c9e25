//! Instructions and allocations per request on the service's own path, counted by callgrind.
//!
//! One request here is what rlsd's server does between HTTP/2 framing and the wire: decode the
//! protobuf `RateLimitRequest`, `RateLimiter::decide` (validate, match, build keys, decide on an
//! in-process `MemoryStore`, record metrics, assemble statuses and `x-ratelimit-*` headers), and
//! encode the `RateLimitResponse`. Shapes: 1, 3 (three layers) and 10 descriptors per request
//! (`support/workload.rs`), over 1000 distinct clients whose keys already exist, fixed-window
//! limits that never fill, on a clock that does not move.
//!
//! The Redis rows run the same path on the Redis store (coalescing on, one request at a time on a
//! current-thread tokio runtime, against a private redis-server started by the child): they
//! count rlsd's instructions per request, including tokio, redis-rs and the coalescer, not
//! Redis's own (redis-server runs outside valgrind).
//!
//! callgrind counts instructions, not time, so the figures repeat whatever else this shared
//! machine is doing. Each shape runs in a child process under `valgrind --tool=callgrind` twice,
//! with `LOW` and `HIGH` measured requests after the same warm-up; the difference of the two
//! totals divided by `HIGH - LOW` is the cost of one request, free of start-up and set-up.
//! Allocations per request are counted natively, with a counting global allocator.
//!
//! Run: `cargo bench --bench instructions` (needs `valgrind`; prints a note and stops if absent).

use std::hint::black_box;
use std::process::Command;
use std::sync::Arc;

use arc_swap::ArcSwap;
use prost::Message;
use rlsd::clock::ManualClock;
use rlsd::pb::RateLimitRequest;
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::{MemoryStore, RedisSettings, RedisStore};

#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/workload.rs"]
mod workload;

use workload::Shape;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
#[path = "support/ready.rs"]
mod ready;

use counting_alloc::CountingAlloc;
use ready::ready;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const CLIENTS: usize = 1000;
const LOW: usize = 2_000;
const HIGH: usize = 12_000;
/// Fewer for Redis: each request is a real round trip.
const REDIS_LOW: usize = 500;
const REDIS_HIGH: usize = 3_000;
const CHILD_VAR: &str = "RLSD_INSTRUCTIONS_CHILD";
/// A fixed instant (2026-12-02): limits never roll over while measuring.
const T0: u64 = 1_796_223_600_000_000;

/// Where the rig keeps its counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Memory,
    Redis,
}

/// The service and the encoded requests of every client, with every client seen once.
enum Rig {
    Memory {
        limiter: RateLimiter<MemoryStore<ManualClock>>,
        wire: Vec<Vec<u8>>,
    },
    Redis {
        limiter: RateLimiter<RedisStore>,
        wire: Vec<Vec<u8>>,
        runtime: tokio::runtime::Runtime,
        _redis: redis_server::Redis,
    },
}

impl Rig {
    fn new(shape: Shape, backend: Backend) -> Rig {
        let config = Arc::new(ArcSwap::from_pointee(workload::config("fixed_window")));
        let wire = shape
            .requests(CLIENTS)
            .iter()
            .map(RateLimitRequest::encode_to_vec)
            .collect();
        let rig = match backend {
            Backend::Memory => {
                let store = Arc::new(MemoryStore::with_clock(1_000_000, ManualClock::at(T0)));
                let limiter = RateLimiter::new(config, store, ServiceSettings::default());
                Rig::Memory { limiter, wire }
            }
            Backend::Redis => {
                let redis = redis_server::Redis::start();
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let mut settings = RedisSettings::new(format!("redis://127.0.0.1:{}", redis.port));
                // valgrind slows rlsd's side of each call many times over.
                settings.command_timeout = std::time::Duration::from_secs(10);
                let store = runtime
                    .block_on(RedisStore::connect(settings))
                    .expect("connect to redis");
                let limiter = RateLimiter::new(config, Arc::new(store), ServiceSettings::default());
                Rig::Redis {
                    limiter,
                    wire,
                    runtime,
                    _redis: redis,
                }
            }
        };
        rig.run(CLIENTS);
        rig
    }

    /// `count` requests, cycling through the clients; panics on a wrong answer.
    fn run(&self, count: usize) {
        for i in 0..count {
            let response = match self {
                Rig::Memory { limiter, wire } => ready(limiter.decide(decode(wire, i))),
                Rig::Redis {
                    limiter,
                    wire,
                    runtime,
                    ..
                } => runtime.block_on(limiter.decide(decode(wire, i))),
            }
            .expect("answered");
            assert_eq!(response.overall_code, 1, "every request is allowed");
            black_box(response.encode_to_vec());
        }
    }
}

fn decode(wire: &[Vec<u8>], i: usize) -> RateLimitRequest {
    RateLimitRequest::decode(wire[i % wire.len()].as_slice()).expect("decodes")
}

fn shape_named(name: &str) -> Shape {
    Shape::ALL
        .into_iter()
        .find(|s| format!("{s:?}") == name)
        .unwrap_or_else(|| panic!("unknown shape {name}"))
}

/// Total instructions callgrind counted for a child measuring `count` requests of `shape`.
fn callgrind_total(shape: Shape, backend: Backend, count: usize) -> Result<u64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let output = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(&exe)
        .env(CHILD_VAR, format!("{shape:?}:{backend:?}:{count}"))
        .output()
        .map_err(|e| format!("valgrind: {e}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("child failed: {stderr}"));
    }
    stderr
        .lines()
        .find_map(|line| {
            let (_, total) = line.split_once("Collected :")?;
            total.trim().parse().ok()
        })
        .ok_or_else(|| format!("no total in callgrind's output: {stderr}"))
}

fn allocations_per_request(shape: Shape, backend: Backend) -> f64 {
    let rig = Rig::new(shape, backend);
    counting_alloc::allocations_during(|| rig.run(LOW)) as f64 / LOW as f64
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        let mut parts = spec.split(':');
        let (Some(shape), Some(backend), Some(count)) = (parts.next(), parts.next(), parts.next())
        else {
            panic!("{CHILD_VAR} is shape:backend:count");
        };
        let backend = match backend {
            "Memory" => Backend::Memory,
            _ => Backend::Redis,
        };
        let rig = Rig::new(shape_named(shape), backend);
        rig.run(count.parse().expect("count"));
        return;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("valgrind is not installed: no instruction counts (apt-get install valgrind)");
        return;
    }
    let redis = Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok();
    println!(
        "# rlsd instructions per request (callgrind, decode -> decide -> encode; rlsd's own, not Redis's)\n"
    );
    println!(
        "| {:<7} | {:<16} | {:>12} | {:>15} | {:>9} | {:>8} |",
        "store", "shape", "instr/req", "instr/descr", "vs 1 desc", "alloc/r"
    );
    println!(
        "|{:-<9}|{:-<18}|{:->14}|{:->17}|{:->11}|{:->10}|",
        "", "", "", "", "", ""
    );
    let backends: &[Backend] = if redis {
        &[Backend::Memory, Backend::Redis]
    } else {
        &[Backend::Memory]
    };
    for &backend in backends {
        let (low, high) = match backend {
            Backend::Memory => (LOW, HIGH),
            Backend::Redis => (REDIS_LOW, REDIS_HIGH),
        };
        let mut one = None;
        for shape in Shape::ALL {
            let per_request = match (
                callgrind_total(shape, backend, low),
                callgrind_total(shape, backend, high),
            ) {
                (Ok(a), Ok(b)) => b.saturating_sub(a) as f64 / (high - low) as f64,
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("{}: {e}", shape.label());
                    continue;
                }
            };
            if shape == Shape::One {
                one = Some(per_request);
            }
            let versus_one = one.map_or("-".to_owned(), |one| format!("{:.2}x", per_request / one));
            println!(
                "| {:<7} | {:<16} | {:>12.0} | {:>15.0} | {:>9} | {:>8.1} |",
                format!("{backend:?}").to_lowercase(),
                shape.label(),
                per_request,
                per_request / shape.descriptors() as f64,
                versus_one,
                allocations_per_request(shape, backend),
            );
        }
    }
}
