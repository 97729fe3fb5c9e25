//! One measured phase: the loops that drive a server, and what each phase counts.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rlsd::metrics::Metrics;
use rlsd::pb::rate_limit_response::Code;
use rlsd::pb::{RateLimitRequest, RateLimitResponse};
use rlsd_testkit::cpu::cpu_time;
use rlsd_testkit::redis::evalsha_calls;
use rlsd_testkit::{h2load, rawh2};
use tokio::runtime::{Handle, Runtime};
use tonic::{Response, Status};

use crate::WARMUP;
use crate::opts::Opts;
use crate::servers::Client;

/// Answers by kind.
#[derive(Clone, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) ok: u64,
    pub(crate) over_limit: u64,
    pub(crate) wrong: u64,
    pub(crate) errors: u64,
    pub(crate) first_problem: Option<String>,
}

impl Counts {
    pub(crate) fn record(
        &mut self,
        descriptors: usize,
        result: &Result<Response<RateLimitResponse>, Status>,
    ) {
        match result {
            Ok(response) => self.record_answer(descriptors, Ok(response.get_ref())),
            Err(status) => self.record_answer(descriptors, Err(status)),
        }
    }

    /// One answer (or the error in its place) to a request of `descriptors` descriptors.
    pub(crate) fn record_answer(
        &mut self,
        descriptors: usize,
        answer: Result<&RateLimitResponse, &dyn std::fmt::Display>,
    ) {
        match answer {
            Ok(r) => {
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
            Err(error) => {
                self.errors += 1;
                self.first_problem
                    .get_or_insert_with(|| format!("error: {error}"));
            }
        }
    }

    pub(crate) fn merge(&mut self, other: &Counts) {
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
pub(crate) struct Cpu {
    pub(crate) server: f64,
    pub(crate) client: f64,
    pub(crate) total: f64,
    /// The bench's redis-server, when there is one.
    pub(crate) redis: f64,
    /// Not CPU: the EVALSHA calls that redis-server ran, so a phase knows its requests per call.
    pub(crate) evalsha: f64,
}

impl Cpu {
    /// What was used from `begin` to `self`.
    pub(crate) fn since(self, begin: Cpu) -> Cpu {
        Cpu {
            server: self.server - begin.server,
            client: self.client - begin.client,
            total: self.total - begin.total,
            redis: self.redis - begin.redis,
            evalsha: self.evalsha - begin.evalsha,
        }
    }
}

/// The redis-server whose CPU (and calls) the phases count: its pid and port.
pub(crate) static REDIS_PID: OnceLock<(u32, u16)> = OnceLock::new();

/// The EVALSHA calls that redis-server has run (an f64's bits; NaN when unknown), as a
/// sampler thread last read them. Reading INFO takes a round trip to a busy Redis, up to a
/// millisecond, which would stall a client's loop at the phase's edges; the sample is at most
/// `EVALSHA_SAMPLE` old, about 1 % of a 2 s phase's calls.
pub(crate) static EVALSHA_CALLS: AtomicU64 = AtomicU64::new(0x7ff8_0000_0000_0000);
pub(crate) const EVALSHA_SAMPLE: Duration = Duration::from_millis(20);

/// Starts the thread that keeps `EVALSHA_CALLS` fresh, for as long as the bench runs.
pub(crate) fn sample_evalsha_calls(port: u16) {
    std::thread::Builder::new()
        .name("evalsha-sampler".to_owned())
        .spawn(move || {
            loop {
                let calls = evalsha_calls(port).map_or(f64::NAN, |n| n as f64);
                EVALSHA_CALLS.store(calls.to_bits(), Ordering::Relaxed);
                std::thread::sleep(EVALSHA_SAMPLE);
            }
        })
        .expect("sampler thread");
}

pub(crate) fn cpu_now() -> Cpu {
    let mut cpu = Cpu::default();
    let seconds = |stat: &str| cpu_time(stat).as_secs_f64();
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        cpu.total = seconds(&stat);
    }
    if let Some(&(pid, _)) = REDIS_PID.get() {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            cpu.redis = seconds(&stat);
        }
        // NaN until the sampler has read it once: a phase then prints no calls figure.
        cpu.evalsha = f64::from_bits(EVALSHA_CALLS.load(Ordering::Relaxed));
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
        if comm.starts_with("bench-server") || comm.starts_with("rlsd-lane") {
            cpu.server += seconds(&stat);
        } else if comm.starts_with("bench-client") {
            cpu.client += seconds(&stat);
        }
    }
    cpu
}

/// One measured phase.
#[derive(Clone, Debug)]
pub(crate) struct Phase {
    pub(crate) latencies_us: Vec<u32>,
    pub(crate) lag_us: Vec<u32>,
    pub(crate) counts: Counts,
    pub(crate) wall: Duration,
    pub(crate) cpu: Cpu,
}

impl Phase {
    pub(crate) fn rate(&self) -> f64 {
        self.latencies_us.len() as f64 / self.wall.as_secs_f64()
    }

    pub(crate) fn percentile(sorted: &[u32], q: f64) -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        f64::from(sorted[rank - 1]) / 1000.0
    }

    pub(crate) fn sort(&mut self) {
        self.latencies_us.sort_unstable();
        self.lag_us.sort_unstable();
    }
}

pub(crate) fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Closed loop: `inflight` workers per client, each sending as soon as its answer arrives.
pub(crate) async fn closed_loop(
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
        cpu: cpu_end.since(cpu_begin),
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
pub(crate) fn open_loop(
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
        cpu: cpu_end.since(cpu_begin),
    };
    phase.sort();
    phase
}

/// The median of `phases` by req/s.
pub(crate) fn median(phases: &[Phase]) -> Phase {
    let mut sorted: Vec<&Phase> = phases.iter().collect();
    sorted.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    sorted[sorted.len() / 2].clone()
}

pub(crate) fn runtime(threads: usize, name: &str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// rlsd's own counters at one moment: how the h2load phase, which sees only HTTP status,
/// checks that every request was decided and allowed.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Tally {
    pub(crate) answered: f64,
    pub(crate) hits: f64,
    pub(crate) over_limit: f64,
    pub(crate) failure_answers: f64,
    pub(crate) store_errors: f64,
    pub(crate) invalid: f64,
}

impl Tally {
    pub(crate) fn of(metrics: &Metrics) -> Tally {
        let text = metrics.render();
        let sum = |name: &str| -> f64 {
            text.lines()
                .filter(|line| {
                    line.strip_prefix(name)
                        .is_some_and(|rest| rest.starts_with(['{', ' ']))
                })
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        Tally {
            answered: sum("ratelimit_service_should_rate_limit_duration_seconds_count"),
            hits: sum("ratelimit_service_rate_limit_total_hits"),
            over_limit: sum("ratelimit_service_rate_limit_over_limit"),
            failure_answers: sum("rlsd_failure_mode_answers_total"),
            store_errors: sum("rlsd_store_errors_total"),
            invalid: sum("rlsd_invalid_requests_total"),
        }
    }
}

/// One h2load peak run on `addr` (after a short warm-up run), as a `Phase`: h2load's
/// latencies and its own CPU as the client's; answers checked against rlsd's counters when
/// the server is rlsd (`metrics`).
pub(crate) fn h2load_phase(
    addr: SocketAddr,
    metrics: Option<&Metrics>,
    body: &std::path::Path,
    descriptors: usize,
    opts: &Opts,
    log: &std::path::Path,
) -> Phase {
    let (connections, streams) = (opts.connections, opts.inflight);
    h2load::run(addr, body, connections, streams, WARMUP, log);
    let before = metrics.map(Tally::of);
    let cpu_begin = cpu_now();
    let run = h2load::run(addr, body, connections, streams, opts.seconds, log);
    let cpu_end = cpu_now();
    let after = metrics.map(Tally::of);
    let mut counts = Counts {
        errors: run.failed + run.done.saturating_sub(run.status_2xx),
        ..Counts::default()
    };
    if counts.errors > 0 {
        counts.first_problem = Some(format!(
            "h2load: {} failed, {} of {} answers not 2xx",
            run.failed,
            run.done.saturating_sub(run.status_2xx),
            run.done
        ));
    }
    match before.zip(after) {
        None => counts.ok = run.status_2xx,
        Some((before, after)) => {
            let delta = |f: fn(&Tally) -> f64| (f(&after) - f(&before)) as u64;
            let answered = delta(|t| t.answered);
            let hits = delta(|t| t.hits);
            let failures = delta(|t| t.failure_answers) + delta(|t| t.store_errors);
            let invalid = delta(|t| t.invalid);
            counts.over_limit = delta(|t| t.over_limit);
            counts.errors += failures + invalid;
            // Every answered request counted one hit per descriptor; h2load may have given up
            // on the few still in flight when its time ran out.
            let in_flight = (connections * streams) as u64;
            if hits != answered * descriptors as u64
                || answered < run.done
                || answered > run.done + in_flight
            {
                counts.wrong += 1;
                counts.first_problem.get_or_insert_with(|| {
                    format!(
                        "rlsd counted {hits} hits for {answered} answers of {descriptors} descriptors; h2load saw {} answers",
                        run.done
                    )
                });
            }
            if failures + invalid > 0 {
                counts.first_problem.get_or_insert_with(|| {
                    format!("rlsd: {failures} store failures, {invalid} invalid requests")
                });
            }
            counts.ok = run
                .status_2xx
                .saturating_sub(failures + invalid + counts.over_limit);
        }
    }
    let mut latencies_us = run.latencies_us;
    latencies_us.sort_unstable();
    Phase {
        latencies_us,
        lag_us: Vec::new(),
        counts,
        wall: Duration::from_secs_f64(run.seconds),
        cpu: Cpu {
            client: run.cpu_seconds,
            ..cpu_end.since(cpu_begin)
        },
    }
}

/// The lean client's load for a phase: `connections` x `streams`, closed loop or paced at
/// `rate`, after the usual warm-up, for `opts.seconds`.
pub(crate) fn lean_load(
    opts: &Opts,
    (connections, streams): (usize, usize),
    rate: Option<f64>,
) -> rawh2::Load {
    rawh2::Load {
        connections,
        streams,
        rate,
        warmup: WARMUP,
        seconds: opts.seconds,
    }
}

/// One run of the lean client (`rlsd_testkit::rawh2`) on `addr`, on a thread of its own named as
/// a client thread (so its CPU is the client's), sending `pool` in turn.
pub(crate) fn raw_phase(addr: SocketAddr, pool: &[RateLimitRequest], load: rawh2::Load) -> Phase {
    let bodies: Vec<Vec<u8>> = pool.iter().map(h2load::grpc_body).collect();
    let mut latencies_us = Vec::with_capacity(1 << 20);
    let mut lag_us = Vec::new();
    let mut counts = Counts::default();
    let paced = load.rate.is_some();
    let trace_to = std::env::var("RLSD_BENCH_TRACE").ok();
    let mut trace: Vec<(u32, u32, u32)> = Vec::new();
    let trace_start = Instant::now();
    let run = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("bench-client-raw".to_owned())
            .spawn_scoped(scope, || {
                rawh2::run(addr, &bodies, &load, cpu_now, |done| {
                    latencies_us.push(done.latency_us);
                    if trace_to.is_some() {
                        trace.push((
                            trace_start.elapsed().as_micros() as u32,
                            done.latency_us,
                            done.lag_us,
                        ));
                    }
                    if paced {
                        lag_us.push(done.lag_us);
                    }
                    let descriptors = pool[done.request].descriptors.len();
                    match &done.answer {
                        Ok(answer) => counts.record_answer(descriptors, Ok(answer)),
                        Err(error) => counts.record_answer(descriptors, Err(error)),
                    }
                })
            })
            .expect("raw client thread")
            .join()
            .expect("raw client")
    })
    .unwrap_or_else(|error| panic!("raw client on {addr}: {error}"));
    if let Some(path) = &trace_to {
        use std::fmt::Write as _;
        use std::io::Write as _;
        let mut text = format!(
            "# {addr}, {}, {} connections x {} streams, {} descriptors per request; \
             µs since the client started (the first {:.1} s are warm-up), latency µs, lag µs\n",
            load.rate
                .map_or_else(|| "closed loop".to_owned(), |r| format!("{r:.0} req/s")),
            load.connections,
            load.streams,
            pool.first().map_or(0, |r| r.descriptors.len()),
            load.warmup.as_secs_f64(),
        );
        for (at, us, lag) in &trace {
            let _ = writeln!(text, "{at} {us} {lag}");
        }
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .unwrap_or_else(|error| panic!("RLSD_BENCH_TRACE {path}: {error}"));
    }
    if run.unanswered > 0 {
        counts.errors += run.unanswered as u64;
        counts
            .first_problem
            .get_or_insert_with(|| format!("{} requests never answered", run.unanswered));
    }
    if paced && run.max_outstanding > 1000 {
        println!(
            "note: raw open loop reached {} requests outstanding (server fell behind)",
            run.max_outstanding
        );
    }
    let mut phase = Phase {
        latencies_us,
        lag_us,
        counts,
        wall: load.seconds,
        cpu: run.end.since(run.begin),
    };
    phase.sort();
    phase
}
