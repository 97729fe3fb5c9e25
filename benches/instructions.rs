//! Instructions and allocations per request on the service's own path, counted by callgrind.
//!
//! One request here is what rlsd's server does between HTTP/2 framing and the wire: decode the
//! protobuf `RateLimitRequest`, `RateLimiter::decide` (validate, match, build keys, decide on an
//! in-process `MemoryStore`, record metrics, assemble statuses and `x-ratelimit-*` headers), and
//! encode the `RateLimitResponse` with the service's codec (`rlsd::codec`). Shapes: 1, 3 (three layers) and 10 descriptors per request
//! (`rlsd_testkit::workload`), over 1000 distinct clients whose keys already exist, fixed-window
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
//! Redis's side is counted the same way with redis-server itself under callgrind: the store's
//! script calls for each shape (built by `script_command`, on Redis's clock), with 1 and with 16
//! requests per call (the coalescing store sends about 14 under load), `SCRIPT_LOW` and
//! `SCRIPT_HIGH` calls after a warm-up that creates every client's keys. An empty script sent
//! the same arguments gives EVALSHA's own cost, which no script can save.
//!
//! Run: `cargo bench --bench instructions` (needs `valgrind`; prints a note and stops if absent).
//! `RLSD_INSTRUCTIONS_PARTS` (`rlsd,redis`) selects rlsd's side, Redis's side or both.

use std::hint::black_box;
use std::process::Command;
use std::sync::Arc;

use arc_swap::ArcSwap;
use prost::Message;
use rlsd::clock::ManualClock;
use rlsd::pb::RateLimitRequest;
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::{Check, MemoryStore, RedisSettings, RedisStore};

use rlsd_testkit::counting_alloc::{self, CountingAlloc};
use rlsd_testkit::ready::ready;
use rlsd_testkit::redis::RedisServer;
use rlsd_testkit::workload::{self, Shape};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const CLIENTS: usize = 1000;
const LOW: usize = 2_000;
const HIGH: usize = 12_000;
/// Fewer for Redis: each request is a real round trip.
const REDIS_LOW: usize = 500;
const REDIS_HIGH: usize = 3_000;
const CHILD_VAR: &str = "RLSD_INSTRUCTIONS_CHILD";
/// Script calls measured on Redis's side (redis-server runs under callgrind).
const SCRIPT_LOW: usize = 100;
const SCRIPT_HIGH: usize = 400;
/// Requests per script call on Redis's side: none coalesced, and a batch as under load.
const REQUESTS_PER_CALL: [usize; 2] = [1, 16];
/// The limits' algorithm in every row.
const ALGORITHM: &str = "fixed_window";
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
        _redis: Box<RedisServer>,
    },
}

impl Rig {
    fn new(shape: Shape, backend: Backend) -> Rig {
        let config = Arc::new(ArcSwap::from_pointee(workload::config(ALGORITHM)));
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
                let redis = RedisServer::start_for_bench(&[]);
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let mut settings = RedisSettings::new(format!("redis://127.0.0.1:{}", redis.port));
                // valgrind slows rlsd's side of each call many times over.
                settings.command_timeout = std::time::Duration::from_secs(10);
                settings.timeout_cap = settings.command_timeout;
                let store = runtime
                    .block_on(RedisStore::connect(settings))
                    .expect("connect to redis");
                let limiter = RateLimiter::new(config, Arc::new(store), ServiceSettings::default());
                Rig::Redis {
                    limiter,
                    wire,
                    runtime,
                    _redis: Box::new(redis),
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
            // As the server's codec writes it, into a buffer that has room (tonic's has 8 KiB).
            let mut wire = Vec::with_capacity(1024);
            rlsd::codec::encode_response(&response, &mut wire);
            black_box(wire);
        }
    }
}

fn decode(wire: &[Vec<u8>], i: usize) -> RateLimitRequest {
    rlsd::codec::decode_request(&wire[i % wire.len()]).expect("decodes")
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

/// What Redis runs for each call on its side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScriptBody {
    /// The store's script.
    Store,
    /// A script that only returns: what EVALSHA costs with the same arguments.
    Empty,
}

/// redis-server's own instruction total, under callgrind, for `calls` script calls of
/// `per_call` requests of `shape` each, after warm-up calls that create every client's keys.
fn redis_side_total(
    shape: Shape,
    per_call: usize,
    calls: usize,
    body: ScriptBody,
) -> Result<u64, String> {
    let log = std::env::temp_dir().join(format!(
        "rlsd-callgrind-redis-{}-{calls}.log",
        std::process::id()
    ));
    let log_arg = format!("--log-file={}", log.display());
    let redis = RedisServer::start_for_bench(&[
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        &log_arg,
    ]);
    let mut connection = redis::Client::open(format!("redis://127.0.0.1:{}", redis.port))
        .and_then(|client| client.get_connection())
        .map_err(|e| format!("connect: {e}"))?;
    let script = match body {
        ScriptBody::Store => rlsd::store::redis::SCRIPT,
        ScriptBody::Empty => "return ''",
    };
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query(&mut connection)
        .map_err(|e| format!("SCRIPT LOAD: {e}"))?;
    let config = workload::config(ALGORITHM);
    let checks: Vec<Vec<Check>> = (0..CLIENTS).map(|c| shape.checks(&config, c)).collect();
    // The store's own call for `count` consecutive clients, naming the script loaded above.
    let mut call = |first: usize, count: usize| -> Result<(), String> {
        let requests: Vec<&[Check]> = (first..first + count)
            .map(|i| checks[i % CLIENTS].as_slice())
            .collect();
        let stored = rlsd::store::redis::script_command(&requests, None);
        let mut command = redis::cmd("EVALSHA");
        command.arg(&sha);
        for arg in stored.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                command.arg(bytes);
            }
        }
        let reply: String = command
            .query(&mut connection)
            .map_err(|e| format!("EVALSHA: {e}"))?;
        // The script's clock comes first, then three numbers per check.
        let allowed = reply
            .split(' ')
            .skip(1)
            .step_by(3)
            .all(|verdict| verdict == "1");
        if body == ScriptBody::Store && !allowed {
            return Err(format!("a request was not allowed: {reply}"));
        }
        Ok(())
    };
    for first in (0..CLIENTS).step_by(16) {
        call(first, 16)?;
    }
    for i in 0..calls {
        call(i * per_call, per_call)?;
    }
    redis.shutdown();
    let text = std::fs::read_to_string(&log).map_err(|e| format!("valgrind log: {e}"))?;
    let _ = std::fs::remove_file(&log);
    text.lines()
        .find_map(|line| {
            let (_, total) = line.split_once("Collected :")?;
            total.trim().replace(',', "").parse().ok()
        })
        .ok_or_else(|| format!("no total in callgrind's log: {text}"))
}

/// Redis's instructions per script call of `per_call` requests of `shape`.
fn redis_side_per_call(shape: Shape, per_call: usize, body: ScriptBody) -> Result<f64, String> {
    let low = redis_side_total(shape, per_call, SCRIPT_LOW, body)?;
    let high = redis_side_total(shape, per_call, SCRIPT_HIGH, body)?;
    Ok(high.saturating_sub(low) as f64 / (SCRIPT_HIGH - SCRIPT_LOW) as f64)
}

/// A table's title, then its column names (`left` ones left-aligned, then `right` ones) and
/// the Markdown rule under them, each column `width` wide.
fn table_header(title: &str, left: &[(&str, usize)], right: &[(&str, usize)]) {
    println!("{title}\n");
    let mut names = String::from("|");
    let mut rule = String::from("|");
    for (i, (name, width)) in left.iter().chain(right).enumerate() {
        if i < left.len() {
            names.push_str(&format!(" {name:<width$} |"));
        } else {
            names.push_str(&format!(" {name:>width$} |"));
        }
        rule.push_str(&"-".repeat(width + 2));
        rule.push('|');
    }
    println!("{names}\n{rule}");
}

/// The Redis-side table: what redis-server spends per script call and per request.
fn print_redis_side() {
    table_header(
        &format!(
            "\n# Redis's instructions per script call (callgrind on redis-server; {ALGORITHM} limits, keys existing)"
        ),
        &[("shape", 16)],
        &[
            ("req/call", 9),
            ("instr/call", 11),
            ("instr/req", 12),
            ("empty script", 13),
            ("script/req", 13),
        ],
    );
    for shape in Shape::ALL {
        for per_call in REQUESTS_PER_CALL {
            let (store, empty) = match (
                redis_side_per_call(shape, per_call, ScriptBody::Store),
                redis_side_per_call(shape, per_call, ScriptBody::Empty),
            ) {
                (Ok(store), Ok(empty)) => (store, empty),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("{} x{per_call}: {e}", shape.label());
                    continue;
                }
            };
            println!(
                "| {:<16} | {:>9} | {:>11.0} | {:>12.0} | {:>13.0} | {:>13.0} |",
                shape.label(),
                per_call,
                store,
                store / per_call as f64,
                empty,
                (store - empty) / per_call as f64,
            );
        }
    }
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
    let parts = std::env::var("RLSD_INSTRUCTIONS_PARTS").unwrap_or_else(|_| "rlsd,redis".into());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    if part("rlsd") {
        print_rlsd_side(redis);
    }
    if redis && part("redis") {
        print_redis_side();
    } else if !redis {
        println!("redis-server is not installed: no Redis rows");
    }
}

/// The rlsd-side table: instructions and allocations per request, per store and shape.
fn print_rlsd_side(redis: bool) {
    table_header(
        "# rlsd instructions per request (callgrind, decode -> decide -> encode; rlsd's own, not Redis's)",
        &[("store", 7), ("shape", 16)],
        &[
            ("instr/req", 12),
            ("instr/descr", 15),
            ("vs 1 desc", 9),
            ("alloc/r", 8),
        ],
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
