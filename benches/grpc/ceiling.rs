//! The Redis ceiling: `redis-benchmark` on the store's own script with rlsd's keys.

use std::process::Command;
use std::time::{Duration, Instant};

use rlsd_testkit::redis::RedisServer;
use rlsd_testkit::workload::{self, Shape};

/// `redis-benchmark -c 50` on the Redis store's script with the keys and arguments rlsd sends
/// for one request of `shape` (each key's value a random client of 1000): the one EVALSHA per
/// request ceiling. With `requests_per_call` above 1, the same for calls as the coalescing
/// store sends them: what the script costs Redis per decision, without rlsd.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ceiling {
    pub(crate) calls_per_second: f64,
    pub(crate) redis_us_per_call: f64,
    pub(crate) requests_per_call: usize,
}

/// Whose keys the ceiling's calls carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CeilingKeys {
    /// Each key's client one of 1000 at random, as the tonic client cycles through them.
    Random,
    /// Client 0's, as the h2load phase sends (one fixed body).
    OneClient,
}

pub(crate) fn redis_benchmark(
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

pub(crate) fn median_ceiling(rounds: &[Ceiling]) -> Ceiling {
    let mut sorted = rounds.to_vec();
    sorted.sort_by(|a, b| a.calls_per_second.total_cmp(&b.calls_per_second));
    sorted[sorted.len() / 2]
}
