//! Instructions and allocations per request on the service's own path, counted by callgrind.
//!
//! One request here is what rlsd's server does between HTTP/2 framing and the wire: decode the
//! protobuf `RateLimitRequest`, `RateLimiter::decide` (validate, match, build keys, decide on an
//! in-process `MemoryStore`, record metrics, assemble statuses and `x-ratelimit-*` headers), and
//! encode the `RateLimitResponse`. Shapes: 1, 3 (three layers) and 10 descriptors per request
//! (`support/workload.rs`), over 1000 distinct clients whose keys already exist, fixed-window
//! limits that never fill, on a clock that does not move.
//!
//! callgrind counts instructions, not time, so the figures repeat whatever else this shared
//! machine is doing. Each shape runs in a child process under `valgrind --tool=callgrind` twice,
//! with `LOW` and `HIGH` measured requests after the same warm-up; the difference of the two
//! totals divided by `HIGH - LOW` is the cost of one request, free of start-up and set-up.
//! Allocations per request are counted natively, with a counting global allocator.
//!
//! Run: `cargo bench --bench instructions` (needs `valgrind`; prints a note and stops if absent).

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use arc_swap::ArcSwap;
use prost::Message;
use rlsd::clock::ManualClock;
use rlsd::pb::RateLimitRequest;
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::MemoryStore;

#[path = "support/workload.rs"]
mod workload;

use workload::Shape;

struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to `System` unchanged.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const CLIENTS: usize = 1000;
const LOW: usize = 2_000;
const HIGH: usize = 12_000;
const CHILD_VAR: &str = "RLSD_INSTRUCTIONS_CHILD";
/// A fixed instant (2026-12-02): limits never roll over while measuring.
const T0: u64 = 1_796_223_600_000_000;

/// Drives a future that must be ready at once (`MemoryStore` never waits).
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the in-process path was not ready on its first poll"),
    }
}

/// The service and the encoded requests of every client, with every client seen once.
struct Rig {
    limiter: RateLimiter<MemoryStore<ManualClock>>,
    wire: Vec<Vec<u8>>,
}

impl Rig {
    fn new(shape: Shape) -> Rig {
        let config = Arc::new(ArcSwap::from_pointee(workload::config("fixed_window")));
        let store = Arc::new(MemoryStore::with_clock(1_000_000, ManualClock::at(T0)));
        let limiter = RateLimiter::new(config, store, ServiceSettings::default());
        let wire = shape
            .requests(CLIENTS)
            .iter()
            .map(RateLimitRequest::encode_to_vec)
            .collect();
        let rig = Rig { limiter, wire };
        rig.run(CLIENTS);
        rig
    }

    /// `count` requests, cycling through the clients; panics on a wrong answer.
    fn run(&self, count: usize) {
        for i in 0..count {
            let bytes = &self.wire[i % self.wire.len()];
            let request = RateLimitRequest::decode(bytes.as_slice()).expect("decodes");
            let response = ready(self.limiter.decide(request)).expect("answered");
            assert_eq!(response.overall_code, 1, "every request is allowed");
            black_box(response.encode_to_vec());
        }
    }
}

fn shape_named(name: &str) -> Shape {
    Shape::ALL
        .into_iter()
        .find(|s| format!("{s:?}") == name)
        .unwrap_or_else(|| panic!("unknown shape {name}"))
}

/// Total instructions callgrind counted for a child measuring `count` requests of `shape`.
fn callgrind_total(shape: Shape, count: usize) -> Result<u64, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let output = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(&exe)
        .env(CHILD_VAR, format!("{shape:?}:{count}"))
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

fn allocations_per_request(shape: Shape) -> f64 {
    let rig = Rig::new(shape);
    ALLOCS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    rig.run(LOW);
    COUNTING.store(false, Ordering::Relaxed);
    ALLOCS.load(Ordering::Relaxed) as f64 / LOW as f64
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        let (name, count) = spec.split_once(':').expect("shape:count");
        let rig = Rig::new(shape_named(name));
        rig.run(count.parse().expect("count"));
        return;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("valgrind is not installed: no instruction counts (apt-get install valgrind)");
        return;
    }
    println!(
        "# rlsd instructions per request (callgrind, decode -> decide -> encode, in-process store)\n"
    );
    println!(
        "| {:<16} | {:>12} | {:>15} | {:>9} | {:>8} |",
        "shape", "instr/req", "instr/descr", "vs 1 desc", "alloc/r"
    );
    println!(
        "|{:-<18}|{:->14}|{:->17}|{:->11}|{:->10}|",
        "", "", "", "", ""
    );
    let mut one = None;
    for shape in Shape::ALL {
        let per_request = match (callgrind_total(shape, LOW), callgrind_total(shape, HIGH)) {
            (Ok(low), Ok(high)) => high.saturating_sub(low) as f64 / (HIGH - LOW) as f64,
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("{}: {e}", shape.label());
                continue;
            }
        };
        let base = *one.get_or_insert(per_request);
        println!(
            "| {:<16} | {:>12.0} | {:>15.0} | {:>8.2}x | {:>8.1} |",
            shape.label(),
            per_request,
            per_request / shape.descriptors() as f64,
            per_request / base,
            allocations_per_request(shape),
        );
    }
}
