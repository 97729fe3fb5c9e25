//! Envoy's Rate Limit Quota Service against a running rlsd, driven by an Envoy-like client
//! written from Envoy's filter (the facts of `../shared/rlqs.md`, not rlsd's code): it reports
//! every interval (a parameter: 1 s here instead of Envoy's 5 s), sends a new bucket's report at
//! once with `time_elapsed` 0, applies assignments as Envoy does (a token bucket starts full on
//! every change, whole-second fill intervals, TTL expiry, then the no-assignment behaviour
//! ALLOW_ALL), reconnects at its next tick, and counts what it admits.
//!
//! The fleet's error per window and the convergence time are printed (`--nocapture`); the
//! assertions are loose bounds on admitted rates, never on timings.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common;

use common::process::Rlsd;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use rlsd::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use rlsd::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use rlsd_testkit::cluster::RedisCluster;
use rlsd_testkit::redis::RedisServer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, ClientTlsConfig};

/// The report interval of these tests.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);
/// The shared limit, requests per second.
const LIMIT: f64 = 200.0;
/// How often the client's traffic is stepped.
const TICK: Duration = Duration::from_millis(5);

fn config() -> String {
    format!(
        "domain: web\nquota_buckets:\n  - bucket: {{name: shared}}\n    rate_limit: {{unit: second, requests_per_unit: {LIMIT}}}\n  - bucket: {{name: open}}\n    rate_limit: {{unlimited: true}}\n  - bucket: {{name: closed}}\n    rate_limit: {{unit: second, requests_per_unit: 0}}\n"
    )
}

/// rlsd with [`config`] and `extra` flags, reporting every [`INTERVAL`].
fn start(extra: &[String]) -> (Rlsd, tempfile::TempDir) {
    start_with(&config(), extra)
}

/// rlsd with `config` as its one domain file and `extra` flags, reporting every [`INTERVAL`].
pub(crate) fn start_with(config: &str, extra: &[String]) -> (Rlsd, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, config).expect("write");
    let mut args = vec![
        "--config".to_owned(),
        file.display().to_string(),
        "--rlqs-report-interval-ms".to_owned(),
        INTERVAL.as_millis().to_string(),
        "--debug-addr".to_owned(),
        "127.0.0.1:0".to_owned(),
    ];
    args.extend(extra.iter().cloned());
    (Rlsd::serve(args), dir)
}

/// The flags that put rlsd on `cluster`.
fn cluster_flags(cluster: &RedisCluster) -> [String; 4] {
    [
        "--redis-mode".to_owned(),
        "cluster".to_owned(),
        "--redis-url".to_owned(),
        cluster.urls().join(","),
    ]
}

fn bucket_id(name: &str) -> BucketId {
    BucketId {
        bucket: [("name".to_owned(), name.to_owned())].into_iter().collect(),
    }
}

/// What Envoy holds for one bucket.
#[derive(Default)]
struct Held {
    assignment: Option<Assignment>,
    expires: Option<Instant>,
    /// A token bucket's tokens and when they were last refilled.
    tokens: f64,
    refilled: Option<Instant>,
    allowed: u64,
    denied: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Assignment {
    AllowAll,
    DenyAll,
    /// Envoy's TokenBucketImpl: `max_tokens`, and the refill rate from `tokens_per_fill` over
    /// the whole seconds of `fill_interval` (0 s: no limit) and its nanos, which alone are
    /// compared when deciding whether a bucket changed.
    Tokens {
        max: u32,
        per_fill: u32,
        fill_seconds: i64,
        fill_nanos: i32,
    },
}

/// One Envoy: its buckets, what it admitted, what it was told.
#[derive(Default)]
struct EnvoyState {
    buckets: BTreeMap<String, Held>,
    abandons: u64,
    errors: Vec<tonic::Code>,
    /// Reports sent that hold buckets (each is answered while every bucket has a rule).
    reports: u64,
    /// Answers received.
    answers: u64,
}

pub(crate) struct Envoy {
    state: Arc<Mutex<EnvoyState>>,
    /// Requests per second this Envoy receives, per bucket (as f64 bits).
    demand: Arc<Mutex<HashMap<String, f64>>>,
    admitted: Arc<AtomicU64>,
    /// The rlsd it talks to; changed to follow a restart.
    target: Arc<Mutex<std::net::SocketAddr>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Envoy {
    pub(crate) fn start(
        target: std::net::SocketAddr,
        domain: &str,
        demand: &[(&str, f64)],
    ) -> Envoy {
        Envoy::start_tls(target, domain, demand, None)
    }

    /// As [`Envoy::start`], over TLS configured by `tls` when given (Envoy's
    /// `UpstreamTlsContext`).
    fn start_tls(
        target: std::net::SocketAddr,
        domain: &str,
        demand: &[(&str, f64)],
        tls: Option<ClientTlsConfig>,
    ) -> Envoy {
        let state = Arc::new(Mutex::new(EnvoyState::default()));
        let demand = Arc::new(Mutex::new(
            demand
                .iter()
                .map(|(name, rate)| ((*name).to_owned(), *rate))
                .collect::<HashMap<_, _>>(),
        ));
        let admitted = Arc::new(AtomicU64::new(0));
        let target = Arc::new(Mutex::new(target));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(run_envoy(
            domain.to_owned(),
            Arc::clone(&state),
            Arc::clone(&demand),
            Arc::clone(&admitted),
            Arc::clone(&target),
            Arc::clone(&stop),
            tls,
        ));
        Envoy {
            state,
            demand,
            admitted,
            target,
            stop,
            task,
        }
    }

    fn set_demand(&self, bucket: &str, rate: f64) {
        self.demand
            .lock()
            .expect("demand")
            .insert(bucket.to_owned(), rate);
    }

    pub(crate) fn admitted(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    pub(crate) async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
    }
}

/// A stream to rlsd: where reports go; its answers land in `state`.
struct Stream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    alive: Arc<AtomicBool>,
}

async fn open_stream(
    addr: std::net::SocketAddr,
    state: Arc<Mutex<EnvoyState>>,
    tls: Option<&ClientTlsConfig>,
) -> Option<Stream> {
    let channel = match tls {
        None => Channel::from_shared(format!("http://{addr}")).ok()?,
        Some(tls) => Channel::from_shared(format!("https://{addr}"))
            .ok()?
            .tls_config(tls.clone())
            .ok()?,
    };
    let mut client = RateLimitQuotaServiceClient::new(channel.connect().await.ok()?);
    let (reports, receiver) = mpsc::channel(16);
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .ok()?
        .into_inner();
    let alive = Arc::new(AtomicBool::new(true));
    let still = Arc::clone(&alive);
    tokio::spawn(async move {
        loop {
            match answers.message().await {
                Ok(Some(answer)) => apply(&state, answer),
                Ok(None) => break,
                Err(status) => {
                    state.lock().expect("state").errors.push(status.code());
                    break;
                }
            }
        }
        still.store(false, Ordering::Relaxed);
    });
    Some(Stream { reports, alive })
}

/// Envoy's `onQuotaResponseImpl`: actions for buckets it holds, by bucket id.
fn apply(state: &Mutex<EnvoyState>, answer: RateLimitQuotaResponse) {
    let now = Instant::now();
    let mut state = state.lock().expect("state");
    state.answers += 1;
    for action in answer.bucket_action {
        let Some(id) = action.bucket_id else { continue };
        let Some(name) = id.bucket.get("name").cloned() else {
            continue;
        };
        match action.bucket_action {
            Some(Action::AbandonAction(_)) if state.buckets.remove(&name).is_some() => {
                state.abandons += 1;
            }
            Some(Action::AbandonAction(_)) => {}
            Some(Action::QuotaAssignmentAction(assign)) => {
                let Some(held) = state.buckets.get_mut(&name) else {
                    continue;
                };
                let strategy = assign.rate_limit_strategy.and_then(|s| s.strategy);
                let next = match strategy {
                    Some(Strategy::BlanketRule(rule)) if rule == BlanketRule::DenyAll as i32 => {
                        Assignment::DenyAll
                    }
                    Some(Strategy::BlanketRule(_)) => Assignment::AllowAll,
                    Some(Strategy::TokenBucket(tb)) => {
                        let fill = tb.fill_interval.unwrap_or_default();
                        Assignment::Tokens {
                            max: tb.max_tokens,
                            per_fill: tb.tokens_per_fill.unwrap_or(0),
                            fill_seconds: fill.seconds,
                            fill_nanos: fill.nanos,
                        }
                    }
                    // requests_per_time_unit: "not yet supported", skipped.
                    _ => continue,
                };
                let same_bucket = match (held.assignment, next) {
                    (
                        Some(Assignment::Tokens {
                            max: a,
                            per_fill: b,
                            fill_nanos: c,
                            ..
                        }),
                        Assignment::Tokens {
                            max: x,
                            per_fill: y,
                            fill_nanos: z,
                            ..
                        },
                    ) => a == x && b == y && c == z,
                    _ => false,
                };
                if !same_bucket {
                    // A new or changed token bucket starts full.
                    if let Assignment::Tokens { max, .. } = next {
                        held.tokens = f64::from(max);
                        held.refilled = Some(now);
                    }
                    held.assignment = Some(next);
                }
                let ttl = assign
                    .assignment_time_to_live
                    .map_or(0, |ttl| ttl.seconds.max(0));
                held.expires = Some(now + Duration::from_secs(ttl as u64));
            }
            None => {}
        }
    }
}

/// Whether `held` admits one request at `now`, as Envoy's filter decides it.
fn admit(held: &mut Held, now: Instant) -> bool {
    if held.expires.is_some_and(|at| at <= now) {
        // Expired: no fallback configured, so the no-assignment behaviour (ALLOW_ALL).
        held.assignment = None;
        held.expires = None;
    }
    match held.assignment {
        None | Some(Assignment::AllowAll) => true,
        Some(Assignment::DenyAll) => false,
        Some(Assignment::Tokens {
            max,
            per_fill,
            fill_seconds,
            ..
        }) => {
            if fill_seconds <= 0 {
                return true;
            }
            let rate = f64::from(per_fill) / fill_seconds as f64;
            let last = held.refilled.unwrap_or(now);
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            held.tokens = (held.tokens + elapsed * rate).min(f64::from(max));
            // A bucket replaced after a request arrived but before it was decided: its fill
            // starts at the replacement.
            held.refilled = Some(now.max(last));
            if held.tokens >= 1.0 {
                held.tokens -= 1.0;
                true
            } else {
                false
            }
        }
    }
}

async fn run_envoy(
    domain: String,
    state: Arc<Mutex<EnvoyState>>,
    demand: Arc<Mutex<HashMap<String, f64>>>,
    admitted: Arc<AtomicU64>,
    target: Arc<Mutex<std::net::SocketAddr>>,
    stop: Arc<AtomicBool>,
    tls: Option<ClientTlsConfig>,
) {
    let mut stream: Option<Stream> = None;
    let mut carry: HashMap<String, f64> = HashMap::new();
    let mut last_tick = Instant::now();
    let mut last_report = Instant::now();
    let mut next_report = Instant::now() + INTERVAL;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(TICK).await;
        let now = Instant::now();
        let dt = now.duration_since(last_tick).as_secs_f64();
        last_tick = now;
        let wanted: Vec<(String, f64)> = demand
            .lock()
            .expect("demand")
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let mut initial = Vec::new();
        {
            let mut state = state.lock().expect("state");
            for (name, rate) in wanted {
                let due = carry.entry(name.clone()).or_default();
                *due += rate * dt;
                while *due >= 1.0 {
                    *due -= 1.0;
                    let created = !state.buckets.contains_key(&name);
                    let held = state.buckets.entry(name.clone()).or_default();
                    if created {
                        // The first request of a bucket: no assignment yet (ALLOW_ALL), and a
                        // report of it alone, at once, with time_elapsed 0.
                        admitted.fetch_add(1, Ordering::Relaxed);
                        initial.push(BucketQuotaUsage {
                            bucket_id: Some(bucket_id(&name)),
                            time_elapsed: Some(prost_types::Duration::default()),
                            num_requests_allowed: 1,
                            num_requests_denied: 0,
                        });
                        continue;
                    }
                    // Decided at its own arrival time, not when this loop woke up: a stall
                    // of the test's runtime is not a clump of traffic at Envoy.
                    let arrived = now
                        .checked_sub(Duration::from_secs_f64((*due / rate).min(dt)))
                        .unwrap_or(now);
                    if admit(held, arrived) {
                        held.allowed += 1;
                        admitted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        held.denied += 1;
                    }
                }
            }
        }
        let periodic = now >= next_report;
        if initial.is_empty() && !periodic {
            continue;
        }
        if stream
            .as_ref()
            .is_none_or(|s| !s.alive.load(Ordering::Relaxed))
        {
            // No backoff: a closed stream is reopened when there is something to send.
            let addr = *target.lock().expect("target");
            let started = Instant::now();
            // Bounded, so a handshake that never ends cannot keep the Envoy from stopping.
            stream = tokio::time::timeout(
                INTERVAL * 5,
                open_stream(addr, Arc::clone(&state), tls.as_ref()),
            )
            .await
            .ok()
            .flatten();
            if std::env::var("RLQS_TRACE").is_ok() {
                eprintln!(
                    "TRACE open {addr}: {} after {:?}",
                    stream.is_some(),
                    started.elapsed()
                );
            }
        }
        let mut reports = Vec::new();
        if !initial.is_empty() {
            reports.push(initial);
        }
        if periodic {
            next_report += INTERVAL;
            let elapsed = now.duration_since(last_report).as_secs() as i64;
            last_report = now;
            let mut state = state.lock().expect("state");
            // Every bucket, idle ones as 0/0; counters reset whether or not it is sent.
            let usages = state
                .buckets
                .iter_mut()
                .map(|(name, held)| {
                    let usage = BucketQuotaUsage {
                        bucket_id: Some(bucket_id(name)),
                        time_elapsed: Some(prost_types::Duration {
                            seconds: elapsed,
                            nanos: 0,
                        }),
                        num_requests_allowed: held.allowed,
                        num_requests_denied: held.denied,
                    };
                    held.allowed = 0;
                    held.denied = 0;
                    usage
                })
                .collect();
            reports.push(usages);
        }
        if let Some(open) = &stream {
            for usages in reports {
                if !usages.is_empty() {
                    // Counted before it goes, so its answer never comes first.
                    state.lock().expect("state").reports += 1;
                }
                let _ = open
                    .reports
                    .send(RateLimitQuotaUsageReports {
                        domain: domain.clone(),
                        bucket_quota_usages: usages,
                    })
                    .await;
            }
        }
    }
}

/// The fleet's admitted rate per window for `windows` windows of [`INTERVAL`]: (rate, each
/// Envoy's rate).
async fn measure(envoys: &[&Envoy], windows: usize) -> Vec<(f64, Vec<f64>)> {
    let mut out = Vec::new();
    let mut before: Vec<u64> = envoys.iter().map(|e| e.admitted()).collect();
    let mut at = Instant::now();
    for _ in 0..windows {
        tokio::time::sleep(INTERVAL).await;
        let now = Instant::now();
        let seconds = now.duration_since(at).as_secs_f64();
        let after: Vec<u64> = envoys.iter().map(|e| e.admitted()).collect();
        let each: Vec<f64> = after
            .iter()
            .zip(&before)
            .map(|(a, b)| (a - b) as f64 / seconds)
            .collect();
        if std::env::var("RLQS_TRACE").is_ok() {
            for e in envoys {
                let st = e.state.lock().expect("state");
                let v: Vec<String> = st
                    .buckets
                    .iter()
                    .map(|(k, h)| {
                        format!(
                            "{k}:{:?} exp {:?}",
                            h.assignment,
                            h.expires.map(|x| x.saturating_duration_since(now))
                        )
                    })
                    .collect();
                eprintln!("TRACE {v:?} errors {:?}", st.errors);
            }
        }
        out.push((each.iter().sum(), each));
        before = after;
        at = now;
    }
    out
}

/// Time for rlsd to take in a report and answer it, and for peers to recompute after it.
const SLACK: Duration = Duration::from_millis(250);

/// Each Envoy's token bucket rate for `shared` (requests per second) at `at`.
async fn rates_at(envoys: &[&Envoy], at: Instant) -> Vec<f64> {
    tokio::time::sleep_until(at.into()).await;
    envoys
        .iter()
        .enumerate()
        .map(|(i, envoy)| {
            let state = envoy.state.lock().expect("state");
            match state.buckets.get("shared").and_then(|held| held.assignment) {
                Some(Assignment::Tokens {
                    per_fill,
                    fill_seconds,
                    ..
                }) => f64::from(per_fill) / fill_seconds.max(1) as f64,
                other => panic!("Envoy {i} holds {other:?}"),
            }
        })
        .collect()
}

/// Prints each window's error against [`LIMIT`] and the first window from which every later
/// one is within 10 %; returns the errors.
fn report(what: &str, windows: &[(f64, Vec<f64>)]) -> Vec<f64> {
    let errors: Vec<f64> = windows.iter().map(|(rate, _)| rate / LIMIT - 1.0).collect();
    for (i, ((rate, each), error)) in windows.iter().zip(&errors).enumerate() {
        let each: Vec<String> = each.iter().map(|r| format!("{r:.0}")).collect();
        eprintln!(
            "{what}: window {i} ({}s): fleet {rate:.1}/s, error {:+.1} %, per Envoy [{}]",
            i + 1,
            error * 100.0,
            each.join(", ")
        );
    }
    let converged = (0..errors.len()).find(|&i| errors[i..].iter().all(|e| e.abs() <= 0.10));
    match converged {
        Some(i) => eprintln!(
            "{what}: within ±10 % from window {i} on ({} s after the start of measuring, interval {INTERVAL:?})",
            i
        ),
        None => eprintln!("{what}: never within ±10 % for good"),
    }
    errors
}

/// Starts four Envoys wanting 5 / 15 / 30 / 50 % of three times the limit, on `targets` in
/// turn; checks the fleet is within ±10 % of the limit per window once the first reports are
/// in, then shifts the demand and checks the shares follow.
async fn four_envoys_share(what: &str, targets: &[std::net::SocketAddr]) -> Vec<Envoy> {
    let demands = [0.05, 0.15, 0.30, 0.50].map(|part| part * 3.0 * LIMIT);
    let envoys: Vec<Envoy> = demands
        .iter()
        .enumerate()
        .map(|(i, d)| Envoy::start(targets[i % targets.len()], "web", &[("shared", *d)]))
        .collect();
    let refs: Vec<&Envoy> = envoys.iter().collect();
    // The first reports: the initial one, then two intervals for rates to be measured.
    let warmup = measure(&refs, 3).await;
    report(&format!("{what} warm-up"), &warmup);
    let steady = measure(&refs, 6).await;
    let errors = report(&format!("{what} steady"), &steady);
    for error in &errors {
        assert!(
            error.abs() <= 0.10,
            "{what}: a window off by {:+.1} %",
            error * 100.0
        );
    }
    // Max-min: the smallest Envoy gets (nearly) all it asks; the largest no more than an
    // equal share of the rest.
    let mean = |i: usize| steady.iter().map(|(_, each)| each[i]).sum::<f64>() / steady.len() as f64;
    assert!(
        mean(0) >= demands[0] * 0.85,
        "smallest Envoy got {:.1}/s",
        mean(0)
    );
    assert!(
        mean(3) <= (LIMIT - demands[0]) / 3.0 * 1.1,
        "largest Envoy got {:.1}/s",
        mean(3)
    );

    // The largest and the smallest swap demand.
    let shifted = Instant::now();
    envoys[0].set_demand("shared", demands[3]);
    envoys[3].set_demand("shared", demands[0]);
    // Max-min fair shares after the shift, worked out here from the demands (not by rlsd's
    // code): the smallest is served whole, the three others are above the level and split
    // the rest.
    let rest = (LIMIT - demands[0]) / 3.0;
    let fair = [rest, rest, rest, demands[0]];
    // Each Envoy's second report after the shift, within two intervals, is the first to carry
    // a whole interval of its new demand; the last of them wakes every peer's stream, which
    // recomputes at once (docs/rlqs.md, "Reaction time").
    let (shift, assigned) = tokio::join!(
        measure(&refs, 6),
        rates_at(&refs, shifted + INTERVAL * 2 + SLACK)
    );
    let errors = report(&format!("{what} after the shift"), &shift);
    for (i, fair) in fair.iter().enumerate() {
        let off = assigned[i] / fair - 1.0;
        eprintln!(
            "{what}: Envoy {i} after the shift: fair share {fair:.1}/s; assigned 2 intervals later {:.0}/s ({:+.1} %)",
            assigned[i],
            off * 100.0
        );
        assert!(
            off.abs() <= 0.10,
            "{what}: Envoy {i} two intervals after the shift: {:.1}/s for a fair {fair:.1}/s",
            assigned[i]
        );
    }
    // Windows are not aligned with reports: the first holds the shift and every Envoy's first
    // report after it (a straddling window, and the grown Envoy still on its small bucket
    // until then), the second the time before the second reports, on shares worked out from
    // straddling windows (−2 % to −12 % measured, docs/rlqs.md); from the third on the fleet
    // is within bounds.
    for error in &errors[2..] {
        assert!(
            error.abs() <= 0.10,
            "{what}: after the shift a window off by {:+.1} %",
            error * 100.0
        );
    }
    let late = &shift[1..];
    let mean = |i: usize| late.iter().map(|(_, each)| each[i]).sum::<f64>() / late.len() as f64;
    assert!(
        mean(0) >= rest * 0.85,
        "the grown Envoy got {:.1}/s",
        mean(0)
    );
    assert!(
        mean(3) >= demands[0] * 0.85,
        "the shrunk Envoy got {:.1}/s",
        mean(3)
    );
    envoys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_envoy_over_its_limit_is_held_to_it() {
    let (rlsd, _dir) = start(&[]);
    let envoy = Envoy::start(rlsd.grpc, "web", &[("shared", 3.0 * LIMIT)]);
    report("one Envoy warm-up", &measure(&[&envoy], 2).await);
    let errors = report("one Envoy", &measure(&[&envoy], 5).await);
    for error in errors {
        assert!(
            error.abs() <= 0.10,
            "a window off by {:+.1} %",
            error * 100.0
        );
    }
    envoy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_envoys_share_one_limit_in_process() {
    let (rlsd, _dir) = start(&[]);
    let envoys = four_envoys_share("in process", &[rlsd.grpc]).await;
    let debug = rlsd.serving("debug").expect("debug port");
    let (status, body) = common::http_get(debug, "/rlqs").await;
    assert_eq!(status, 200);
    assert!(body.contains("tokens_per_fill"), "{body}");
    let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
    assert!(
        metrics.contains("rlsd_rlqs_bucket_envoys{bucket=\"name=shared\",domain=\"web\"} 4"),
        "{metrics}"
    );
    for envoy in envoys {
        envoy.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_envoys_share_one_limit_across_two_replicas_on_redis() {
    let redis = RedisServer::start();
    let flags = ["--redis-url".to_owned(), redis.url()];
    let (one, _a) = start(&flags);
    let (two, _b) = start(&flags);
    for envoy in four_envoys_share("two replicas on Redis", &[one.grpc, two.grpc]).await {
        envoy.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_bursts_no_more_than_the_limit() {
    let (mut rlsd, dir) = start(&[]);
    let envoys = [
        Envoy::start(rlsd.grpc, "web", &[("shared", 1.5 * LIMIT)]),
        Envoy::start(rlsd.grpc, "web", &[("shared", 1.5 * LIMIT)]),
    ];
    let refs: Vec<&Envoy> = envoys.iter().collect();
    report("restart warm-up", &measure(&refs, 3).await);
    rlsd.terminate(Duration::from_secs(15));
    let file = dir.path().join("web.yaml").display().to_string();
    let again = Rlsd::serve([
        "--config",
        &file,
        "--rlqs-report-interval-ms",
        &INTERVAL.as_millis().to_string(),
    ]);
    for envoy in &envoys {
        *envoy.target.lock().expect("target") = again.grpc;
    }
    let errors = report("across the restart", &measure(&refs, 6).await);
    for error in errors {
        assert!(
            error <= 0.10,
            "a window {:+.1} % over the limit",
            error * 100.0
        );
    }
    // Each stream was ended (UNAVAILABLE, or the connection closing under it), so each Envoy
    // reconnected to the new rlsd.
    for envoy in &envoys {
        let told = envoy.state.lock().expect("state").errors.clone();
        assert!(!told.is_empty(), "a stream outlived its server");
    }
    for envoy in envoys {
        envoy.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blanket_rules_and_idle_buckets_are_abandoned() {
    let (rlsd, _dir) = start(&["--rlqs-idle-after-ms".to_owned(), "1500".to_owned()]);
    let envoy = Envoy::start(
        rlsd.grpc,
        "web",
        &[("open", 50.0), ("closed", 50.0), ("shared", 20.0)],
    );
    tokio::time::sleep(INTERVAL * 3).await;
    {
        let state = envoy.state.lock().expect("state");
        assert_eq!(state.buckets["open"].assignment, Some(Assignment::AllowAll));
        assert_eq!(
            state.buckets["closed"].assignment,
            Some(Assignment::DenyAll)
        );
    }
    envoy.set_demand("shared", 0.0);
    tokio::time::sleep(INTERVAL * 5).await;
    {
        let state = envoy.state.lock().expect("state");
        assert_eq!(state.abandons, 1, "the idle bucket is abandoned once");
        assert!(!state.buckets.contains_key("shared"));
        assert!(state.buckets.contains_key("open"));
    }
    envoy.stop().await;
}

/// A raw stream: sends `reports` one by one, returns each answer or the status that ended it.
pub(crate) async fn raw(
    addr: std::net::SocketAddr,
    reports: Vec<RateLimitQuotaUsageReports>,
) -> Result<Vec<RateLimitQuotaResponse>, tonic::Status> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (sender, receiver) = mpsc::channel(16);
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await?
        .into_inner();
    let mut out = Vec::new();
    for report in reports {
        let empty = report.bucket_quota_usages.is_empty();
        sender.send(report).await.expect("send");
        if empty {
            continue;
        }
        match tokio::time::timeout(Duration::from_secs(5), answers.message()).await {
            Ok(Ok(Some(answer))) => out.push(answer),
            Ok(Ok(None)) => break,
            Ok(Err(status)) => return Err(status),
            Err(_) => panic!("no answer within 5 s"),
        }
    }
    Ok(out)
}

/// The token rate of the only action of `answer`, requests per second.
fn answered_rate(answer: &RateLimitQuotaResponse) -> f64 {
    match answer.bucket_action.as_slice() {
        [rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction {
            bucket_action: Some(Action::QuotaAssignmentAction(assign)),
            ..
        }] => match assign.rate_limit_strategy.as_ref().and_then(|s| s.strategy.as_ref()) {
            Some(Strategy::TokenBucket(bucket)) => {
                f64::from(bucket.tokens_per_fill.unwrap_or(0))
                    / bucket
                        .fill_interval
                        .as_ref()
                        .map_or(1, |d| d.seconds.max(1)) as f64
            }
            other => panic!("not a token bucket: {other:?}"),
        },
        other => panic!("not one assignment: {other:?}"),
    }
}

/// Opens a stream to `addr` that sends what goes into the returned sender.
async fn open_raw(
    addr: std::net::SocketAddr,
) -> (
    mpsc::Sender<RateLimitQuotaUsageReports>,
    tonic::Streaming<RateLimitQuotaResponse>,
) {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (sender, receiver) = mpsc::channel(16);
    let answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .expect("stream")
        .into_inner();
    (sender, answers)
}

/// The next answer on `answers`; waiting is bounded as a hang detector only.
async fn next_answer(
    what: &str,
    answers: &mut tonic::Streaming<RateLimitQuotaResponse>,
) -> RateLimitQuotaResponse {
    match tokio::time::timeout(INTERVAL * 5, answers.message()).await {
        Ok(Ok(Some(answer))) => answer,
        other => panic!("{what}: no answer: {other:?}"),
    }
}

/// A stream on `one` holds the bucket alone; a second, on `two`, joins: the first is sent its
/// halved share without reporting again; the second leaves: the first gets the whole back.
async fn peers_change_reaches_a_stream_between_its_reports(
    what: &str,
    one: std::net::SocketAddr,
    two: std::net::SocketAddr,
) {
    let (first, mut first_answers) = open_raw(one).await;
    first
        .send(reports("web", vec![usage("shared", 1, 0)]))
        .await
        .expect("send");
    let alone = answered_rate(&next_answer(what, &mut first_answers).await);
    let (second, mut second_answers) = open_raw(two).await;
    second
        .send(reports("web", vec![usage("shared", 1, 0)]))
        .await
        .expect("send");
    let joined = answered_rate(&next_answer(what, &mut second_answers).await);
    // The first stream sent nothing more: this answer is the push.
    let pushed = answered_rate(&next_answer(what, &mut first_answers).await);
    eprintln!("{what}: alone {alone}/s; a peer joins: {joined}/s, and pushed {pushed}/s");
    assert!(
        (pushed - joined).abs() <= 1.0 && pushed < alone * 0.6,
        "{what}: alone {alone}, joined {joined}, pushed {pushed}"
    );
    drop(second);
    drop(second_answers);
    let back = answered_rate(&next_answer(what, &mut first_answers).await);
    eprintln!("{what}: the peer leaves: pushed {back}/s");
    assert_eq!(back, alone, "{what}: the whole share back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_change_reaches_other_streams_between_their_reports() {
    let (rlsd, _dir) = start(&[]);
    peers_change_reaches_a_stream_between_its_reports("in process", rlsd.grpc, rlsd.grpc).await;
    let redis = RedisServer::start();
    let flags = ["--redis-url".to_owned(), redis.url()];
    let (one, _a) = start(&flags);
    let (two, _b) = start(&flags);
    peers_change_reaches_a_stream_between_its_reports("two replicas on Redis", one.grpc, two.grpc)
        .await;
    let cluster = RedisCluster::start();
    let flags = cluster_flags(&cluster);
    let (one, _c) = start(&flags);
    let (two, _d) = start(&flags);
    peers_change_reaches_a_stream_between_its_reports(
        "two replicas on a Redis Cluster",
        one.grpc,
        two.grpc,
    )
    .await;
}

pub(crate) fn usage(name: &str, allowed: u64, seconds: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(bucket_id(name)),
        time_elapsed: Some(prost_types::Duration { seconds, nanos: 0 }),
        num_requests_allowed: allowed,
        num_requests_denied: 0,
    }
}

pub(crate) fn reports(domain: &str, usages: Vec<BucketQuotaUsage>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.to_owned(),
        bucket_quota_usages: usages,
    }
}

#[tokio::test]
async fn bad_input_ends_only_its_own_stream_with_a_clear_error() {
    let (rlsd, _dir) = start(&[
        "--rlqs-max-buckets-per-stream".to_owned(),
        "2".to_owned(),
        "--rlqs-first-report-timeout-ms".to_owned(),
        "300".to_owned(),
    ]);
    let addr = rlsd.grpc;
    // Empty reports (Envoy's, every interval with no bucket) and a zero time_elapsed are fine.
    let fine = raw(
        addr,
        vec![
            reports("web", vec![]),
            reports("web", vec![usage("shared", 1, 0)]),
        ],
    )
    .await
    .expect("answered");
    assert_eq!(fine.len(), 1);
    let cases: Vec<(&str, Vec<RateLimitQuotaUsageReports>, tonic::Code, &str)> = vec![
        (
            "no domain",
            vec![reports("", vec![usage("shared", 1, 0)])],
            tonic::Code::InvalidArgument,
            "no domain",
        ),
        (
            "domain changed",
            vec![
                reports("web", vec![usage("shared", 1, 0)]),
                reports("api", vec![usage("shared", 1, 1)]),
            ],
            tonic::Code::InvalidArgument,
            "domain changed",
        ),
        (
            "empty bucket id",
            vec![reports(
                "web",
                vec![BucketQuotaUsage {
                    bucket_id: Some(BucketId::default()),
                    ..usage("x", 1, 0)
                }],
            )],
            tonic::Code::InvalidArgument,
            "empty",
        ),
        (
            "too many buckets",
            vec![reports(
                "web",
                vec![usage("a", 1, 0), usage("b", 1, 0), usage("c", 1, 0)],
            )],
            tonic::Code::ResourceExhausted,
            "buckets",
        ),
    ];
    // A healthy stream beside them all.
    let healthy = Envoy::start(addr, "web", &[("shared", 10.0)]);
    for (what, sent, code, says) in cases {
        let status = raw(addr, sent).await.expect_err(what);
        assert_eq!(status.code(), code, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?}");
    }
    // A stream that never sends is ended by the first-report deadline.
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (_silent, receiver) = mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .expect("opened")
        .into_inner();
    let ended = tokio::time::timeout(Duration::from_secs(5), answers.message())
        .await
        .expect("ended in time");
    assert_eq!(
        ended.expect_err("deadline").code(),
        tonic::Code::DeadlineExceeded
    );
    tokio::time::sleep(INTERVAL * 2).await;
    {
        let state = healthy.state.lock().expect("state");
        assert!(state.errors.is_empty(), "{:?}", state.errors);
        assert!(state.buckets["shared"].assignment.is_some());
    }
    healthy.stop().await;
}

#[tokio::test]
async fn no_rlqs_turns_the_service_off() {
    let (rlsd, _dir) = start(&["--no-rlqs".to_owned()]);
    let status = raw(rlsd.grpc, vec![reports("web", vec![usage("shared", 1, 0)])])
        .await
        .expect_err("off");
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
}

/// The token bucket rate an Envoy holds for `bucket`, if it holds one.
fn per_fill(envoy: &Envoy, bucket: &str) -> Option<u32> {
    match envoy
        .state
        .lock()
        .expect("state")
        .buckets
        .get(bucket)?
        .assignment
    {
        Some(Assignment::Tokens { per_fill, .. }) => Some(per_fill),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_assignments_at_the_next_report_without_dropping_streams() {
    let (rlsd, dir) = start(&["--reload-interval-ms".to_owned(), "200".to_owned()]);
    let envoy = Envoy::start(rlsd.grpc, "web", &[("shared", 3.0 * LIMIT)]);
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(per_fill(&envoy, "shared"), Some(190));
    let halved = config().replace("requests_per_unit: 200}", "requests_per_unit: 100}");
    assert_ne!(halved, config());
    std::fs::write(dir.path().join("web.yaml"), halved).expect("write");
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(per_fill(&envoy, "shared"), Some(95));
    let errors = envoy.state.lock().expect("state").errors.clone();
    assert!(errors.is_empty(), "a stream was dropped: {errors:?}");
    envoy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_store_down_the_failure_mode_decides_what_envoys_are_told() {
    for mode in ["deny", "allow", "error"] {
        let mut redis = RedisServer::start();
        let (rlsd, _dir) = start(&[
            "--redis-url".to_owned(),
            redis.url(),
            "--failure-mode".to_owned(),
            mode.to_owned(),
        ]);
        let envoy = Envoy::start(rlsd.grpc, "web", &[("shared", 50.0)]);
        tokio::time::sleep(INTERVAL * 3).await;
        assert!(
            per_fill(&envoy, "shared").is_some(),
            "{mode}: no token bucket"
        );
        redis.kill();
        tokio::time::sleep(INTERVAL * 4).await;
        let held = envoy.state.lock().expect("state").buckets["shared"].assignment;
        match mode {
            "deny" => assert_eq!(held, Some(Assignment::DenyAll), "{mode}"),
            "allow" => assert_eq!(held, Some(Assignment::AllowAll), "{mode}"),
            // Nothing sent: the held bucket stays until its TTL.
            _ => assert!(
                matches!(held, Some(Assignment::Tokens { .. })),
                "{mode}: {held:?}"
            ),
        }
        let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
        assert!(
            metrics.contains(&format!(
                "rlsd_rlqs_failure_mode_answers_total{{mode=\"{mode}\"}}"
            )),
            "{mode}"
        );
        envoy.stop().await;
    }
}

#[tokio::test]
async fn served_on_the_unix_socket_and_listed_by_grpc_health() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let sockets = tempfile::tempdir().expect("tempdir");
    let socket = sockets.path().join("rlsd.sock");
    let (rlsd, _dir) = start(&[
        "--grpc-unix-socket".to_owned(),
        socket.display().to_string(),
    ]);
    let channel = tonic::transport::Endpoint::from_static("http://rlsd.local")
        .connect_with_connector(crate::unix_socket::UnixConnector(Arc::new(socket)))
        .await
        .expect("connect over the unix socket");
    let mut client = RateLimitQuotaServiceClient::new(channel);
    let (sender, receiver) = mpsc::channel(1);
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .expect("opened")
        .into_inner();
    sender
        .send(reports("web", vec![usage("shared", 1, 0)]))
        .await
        .expect("send");
    let answer = answers.message().await.expect("answer").expect("one");
    assert!(matches!(
        answer.bucket_action[0].bucket_action,
        Some(Action::QuotaAssignmentAction(_))
    ));
    let mut health = HealthClient::new(
        tonic::transport::Channel::from_shared(format!("http://{}", rlsd.grpc))
            .expect("uri")
            .connect()
            .await
            .expect("connect"),
    );
    let status = health
        .check(HealthCheckRequest {
            service: "envoy.service.rate_limit_quota.v3.RateLimitQuotaService".to_owned(),
        })
        .await
        .expect("known to health")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test]
async fn bucket_id_report_and_stream_bounds_end_only_the_stream_over_them() {
    let (rlsd, _dir) = start(&[
        "--rlqs-max-bucket-entries".to_owned(),
        "2".to_owned(),
        "--rlqs-max-bucket-bytes".to_owned(),
        "64".to_owned(),
        "--rlqs-max-report-bytes".to_owned(),
        "2048".to_owned(),
        "--rlqs-max-streams".to_owned(),
        "1".to_owned(),
    ]);
    let addr = rlsd.grpc;
    let id = |pairs: &[(&str, String)]| BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
        }),
        ..usage("x", 1, 0)
    };
    let cases: Vec<(&str, Vec<BucketQuotaUsage>, tonic::Code, &str)> = vec![
        (
            "three entries",
            vec![id(&[
                ("a", "1".into()),
                ("b", "2".into()),
                ("c", "3".into()),
            ])],
            tonic::Code::InvalidArgument,
            "entries",
        ),
        (
            "a long value",
            vec![id(&[("name", "v".repeat(100))])],
            tonic::Code::InvalidArgument,
            "bytes",
        ),
        (
            "a large report",
            (0..100)
                .map(|i| usage(&format!("bucket-{i:04}"), 1, 1))
                .collect(),
            tonic::Code::OutOfRange,
            "",
        ),
    ];
    for (what, usages, code, says) in cases {
        let status = raw(addr, vec![reports("web", usages)])
            .await
            .expect_err(what);
        assert_eq!(status.code(), code, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?}");
    }
    // One stream at a time: a second is refused while the first is open.
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (first, receiver) = mpsc::channel(1);
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .expect("the first stream")
        .into_inner();
    first
        .send(reports("web", vec![usage("shared", 1, 0)]))
        .await
        .expect("send");
    answers.message().await.expect("answer").expect("one");
    let refused = raw(addr, vec![reports("web", vec![usage("shared", 1, 0)])])
        .await
        .expect_err("over --rlqs-max-streams");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_envoys_share_one_limit_across_two_replicas_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let flags = cluster_flags(&cluster);
    let (one, _a) = start(&flags);
    let (two, _b) = start(&flags);
    let envoys = four_envoys_share("two replicas on a Redis Cluster", &[one.grpc, two.grpc]).await;
    // The demands met on the cluster: the bucket's hash holds all four Envoys' streams.
    let key = "rlqs:3:web:4:name6:shared";
    let held: Vec<String> = cluster
        .masters()
        .into_iter()
        .filter_map(|port| cluster.cli(port, &["HLEN", key]))
        .filter(|answer| !answer.starts_with("MOVED"))
        .collect();
    assert_eq!(held, ["4"], "the board's hash on its one master");
    for envoy in envoys {
        envoy.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_over_tls_and_mutual_tls_are_held_to_the_limit() {
    use common::pki::{Leaf, Pki};
    use tonic::transport::{Certificate, Identity};
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let clients_ca = pki.ca("clients-ca");
    let serving = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let envoy_cert = pki.issue(&clients_ca, "envoy", Leaf::Client, 20);
    // Envoy's UpstreamTlsContext: rlsd's CA, its name, and for mutual TLS a certificate.
    let trust = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.cert_pem()))
        .domain_name("localhost");
    let with_certificate = trust.clone().identity(Identity::from_pem(
        envoy_cert.cert_pem(),
        envoy_cert.key_pem(),
    ));
    for mutual in [false, true] {
        let what = if mutual { "mutual TLS" } else { "TLS" };
        let mut flags = vec![
            "--tls-cert".to_owned(),
            serving.cert.display().to_string(),
            "--tls-key".to_owned(),
            serving.key.display().to_string(),
        ];
        if mutual {
            flags.extend([
                "--tls-client-ca".to_owned(),
                clients_ca.cert.display().to_string(),
            ]);
        }
        let (rlsd, _dir) = start(&flags);
        let tls = if mutual {
            with_certificate.clone()
        } else {
            trust.clone()
        };
        let envoy = Envoy::start_tls(rlsd.grpc, "web", &[("shared", 3.0 * LIMIT)], Some(tls));
        // Plain text on the TLS port, and under mutual TLS an Envoy without a certificate:
        // no stream, so no assignment (they fall back to the no-assignment behaviour).
        let stranger = Envoy::start_tls(
            rlsd.grpc,
            "web",
            &[("shared", 10.0)],
            mutual.then(|| trust.clone()),
        );
        report(&format!("{what} warm-up"), &measure(&[&envoy], 2).await);
        let errors = report(what, &measure(&[&envoy], 4).await);
        for error in errors {
            assert!(
                error.abs() <= 0.10,
                "{what}: a window off by {:+.1} %",
                error * 100.0
            );
        }
        assert!(per_fill(&envoy, "shared").is_some(), "{what}");
        {
            let state = stranger.state.lock().expect("state");
            assert_eq!(
                state.answers, 0,
                "{what}: a stream without TLS or a certificate"
            );
            assert_eq!(state.buckets["shared"].assignment, None, "{what}");
        }
        envoy.stop().await;
        stranger.stop().await;
    }
}

/// Lines of `/metrics` that are series of `bucket` (`name=...`).
fn bucket_series<'a>(metrics: &'a str, bucket: &str) -> Vec<&'a str> {
    let label = format!("bucket=\"name={bucket}\"");
    metrics
        .lines()
        .filter(|line| line.starts_with("rlsd_rlqs_bucket_") && line.contains(&label))
        .collect()
}

/// Waits (10 s at most: a hang detector) until `/metrics` satisfies `done`; returns it.
async fn metrics_until(rlsd: &Rlsd, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
        if done(&metrics) {
            return metrics;
        }
        assert!(Instant::now() < deadline, "{what}:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_series_go_when_no_stream_holds_the_bucket() {
    let (rlsd, dir) = start(&[
        "--reload-interval-ms".to_owned(),
        "200".to_owned(),
        "--rlqs-idle-after-ms".to_owned(),
        "1500".to_owned(),
    ]);
    let one = Envoy::start(rlsd.grpc, "web", &[("shared", 20.0), ("open", 20.0)]);
    // Buckets no rule matches get no series, however many a client makes up.
    let strays: Vec<String> = (0..40).map(|i| format!("stray-{i}")).collect();
    let mut wanted: Vec<(&str, f64)> = strays.iter().map(|name| (name.as_str(), 2.0)).collect();
    wanted.extend([("shared", 20.0), ("closed", 20.0)]);
    let two = Envoy::start(rlsd.grpc, "web", &wanted);
    let metrics = metrics_until(&rlsd, "every bucket with a rule has series", |m| {
        ["shared", "open", "closed"]
            .iter()
            .all(|b| !bucket_series(m, b).is_empty())
            && m.contains("rlsd_rlqs_bucket_envoys{bucket=\"name=shared\",domain=\"web\"} 2")
    })
    .await;
    assert!(
        metrics.contains("rlsd_rlqs_skipped_total{reason=\"no_rule\"}"),
        "the strays were reported"
    );
    assert!(!metrics.contains("stray-"), "{metrics}");

    // Stream end: `closed` was held by the second Envoy alone; `shared` stays for the first.
    two.stop().await;
    metrics_until(&rlsd, "closed's series go with the stream", |m| {
        bucket_series(m, "closed").is_empty() && m.contains("rlsd_rlqs_streams 1")
    })
    .await;
    let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
    assert!(!bucket_series(&metrics, "shared").is_empty(), "{metrics}");

    // Abandon: `open` goes idle and is abandoned.
    one.set_demand("open", 0.0);
    metrics_until(&rlsd, "open's series go with the abandon", |m| {
        bucket_series(m, "open").is_empty()
    })
    .await;
    assert_eq!(one.state.lock().expect("state").abandons, 1);

    // A reload that removes `shared`'s rule, the stream still open and reporting it.
    let without = config().replace(
        &format!(
            "  - bucket: {{name: shared}}\n    rate_limit: {{unit: second, requests_per_unit: {LIMIT}}}\n"
        ),
        "",
    );
    assert_ne!(without, config());
    std::fs::write(dir.path().join("web.yaml"), without).expect("write");
    let metrics = metrics_until(&rlsd, "shared's series go with its rule", |m| {
        bucket_series(m, "shared").is_empty()
    })
    .await;
    assert!(
        !metrics
            .lines()
            .any(|line| line.starts_with("rlsd_rlqs_bucket_")),
        "{metrics}"
    );
    {
        let state = one.state.lock().expect("state");
        assert!(state.errors.is_empty(), "{:?}", state.errors);
        assert!(state.buckets.contains_key("shared"), "still reported");
    }
    one.stop().await;
}
