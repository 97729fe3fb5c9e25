//! h2load (nghttp2's HTTP/2 load generator, written in C) as the bench tool's second client.
//!
//! The tonic client costs about as much CPU per request as the server it drives, and on two
//! shared cores that CPU is taken from rlsd and Redis. `redis-benchmark`, the ceiling's load
//! generator, is C and nearly free. h2load is the same kind of tool for gRPC (PERF.md measures
//! this machine's speed of light with it): one fixed request body, many streams on a few
//! connections, and a log line per request.
//!
//! h2load only sees HTTP status, never `grpc-status`, so the caller checks the answers some
//! other way (the bench reads the server's own counters).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use prost::Message as _;
use rlsd::pb::RateLimitRequest;

/// The gRPC method h2load calls.
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Whether `h2load` is on the PATH.
pub fn installed() -> bool {
    Command::new("h2load").arg("--version").output().is_ok()
}

/// `request` as one gRPC message on the wire: a zero byte (not compressed), its length as four
/// big-endian bytes, then the protobuf encoding.
pub fn grpc_body(request: &RateLimitRequest) -> Vec<u8> {
    let message = request.encode_to_vec();
    let length = u32::try_from(message.len()).expect("a bench request fits in a gRPC frame");
    let mut body = Vec::with_capacity(5 + message.len());
    body.push(0);
    body.extend_from_slice(&length.to_be_bytes());
    body.extend_from_slice(&message);
    body
}

/// What one h2load run saw.
#[derive(Clone, Debug, Default)]
pub struct Run {
    /// Requests answered.
    pub done: u64,
    /// Requests answered with HTTP 2xx.
    pub status_2xx: u64,
    /// Requests h2load counts as failed, errored or timed out.
    pub failed: u64,
    /// h2load's own measured time (after its warm-up).
    pub seconds: f64,
    /// Every answered request's latency, in µs.
    pub latencies_us: Vec<u32>,
    /// CPU seconds h2load used (user + system).
    pub cpu_seconds: f64,
}

/// CPU seconds of this process's waited-for children so far.
#[expect(unsafe_code, reason = "getrusage")]
fn children_cpu() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage);
        usage
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Drives `addr` with `body` on `connections` connections x `streams` streams each for
/// `duration`, on one h2load thread. Everything h2load does counts, so a caller that wants a
/// warm-up runs a short one first.
pub fn run(
    addr: SocketAddr,
    body: &Path,
    connections: usize,
    streams: usize,
    duration: Duration,
    log: &Path,
) -> Run {
    // h2load appends to its log.
    let _ = std::fs::remove_file(log);
    let cpu_before = children_cpu();
    let out = Command::new("h2load")
        .args([
            "-c",
            &connections.to_string(),
            "-m",
            &streams.to_string(),
            "-t",
            "1",
        ])
        .args(["-D", &format!("{}ms", duration.as_millis().max(1))])
        .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
        .arg("-d")
        .arg(body)
        .arg(format!("--log-file={}", log.display()))
        .arg(format!("http://{addr}{PATH}"))
        .output()
        .expect("h2load runs");
    let cpu_seconds = children_cpu() - cpu_before;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "h2load failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "finished in 2.00s, 27014.20 req/s, 8.83MB/s" (or "501.06ms")
    let seconds = after(&stdout, "finished in ")
        .and_then(|rest| rest.split(',').next())
        .and_then(|took| {
            let (number, scale) = if let Some(ms) = took.strip_suffix("ms") {
                (ms, 1e-3)
            } else if let Some(us) = took.strip_suffix("us") {
                (us, 1e-6)
            } else {
                (took.strip_suffix('s')?, 1.0)
            };
            number.parse::<f64>().ok().map(|n| n * scale)
        })
        .expect("h2load prints how long it ran");
    // "requests: 135071 total, 135135 started, 135071 done, 135071 succeeded, 0 failed, 0 errored, 0 timeout"
    let count = |label: &str| -> u64 {
        let line = after(&stdout, "requests: ").expect("h2load prints its request counts");
        let line = line.lines().next().unwrap_or_default();
        line.split(", ")
            .find_map(|part| part.strip_suffix(label))
            .and_then(|n| n.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("h2load's request counts name {label:?}: {line}"))
    };
    let status_2xx = after(&stdout, "status codes: ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("h2load prints status codes");
    let latencies_us = std::fs::read_to_string(log)
        .expect("h2load wrote its log")
        .lines()
        .filter_map(|line| line.split('\t').nth(2))
        .filter_map(|us| us.trim().parse::<u64>().ok())
        .map(|us| u32::try_from(us).unwrap_or(u32::MAX))
        .collect();
    Run {
        done: count(" done"),
        status_2xx,
        failed: count(" failed") + count(" errored") + count(" timeout"),
        seconds,
        latencies_us,
        cpu_seconds,
    }
}

fn after<'a>(text: &'a str, marker: &str) -> Option<&'a str> {
    text.find(marker).map(|at| &text[at + marker.len()..])
}
