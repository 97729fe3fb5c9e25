//! One budget for RLS and RLQS: a quota bucket that names an RLS descriptor (`descriptor:`)
//! is held to that descriptor's limit, on the descriptor's own counter. `ShouldRateLimit`
//! callers and Envoys reporting over RLQS (the Envoy-like client of [`super::rlqs`]) draw on it
//! together, in process and with two rlsd replicas on one Redis.
//!
//! Each window's admissions are printed (`--nocapture`); the assertions are the bound
//! `docs/rlqs.md` states, never timings.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common;
use crate::rlqs::{Envoy, INTERVAL, raw, reports, usage};

use common::descriptor;
use common::process::Rlsd;
use rlsd::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlsd::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use rlsd::pb::rate_limit_response::Code;
use rlsd::pb::{RateLimitRequest, RateLimitServiceClient};
use rlsd_testkit::redis::RedisServer;
use tonic::transport::Channel;

/// The shared limit: [`LIMIT`] requests per [`PERIOD`] (a fixed window), 200 a second.
const LIMIT: u64 = 1000;
const PERIOD: Duration = Duration::from_secs(5);
/// Requests per second the `ShouldRateLimit` caller sends.
const RLS_RATE: u64 = 100;
/// Requests per second each of the two Envoys receives: with the caller, twice the limit.
const ENVOY_RATE: f64 = 150.0;

fn config() -> String {
    format!(
        "domain: web
descriptors:
  - key: generic_key
    value: checkout
    rate_limit: {{unit: second, unit_multiplier: {}, requests_per_unit: {LIMIT}}}
  - key: generic_key
    value: daily
    rate_limit: {{unit: day, requests_per_unit: 1000}}
  - key: generic_key
    value: small
    rate_limit: {{unit: day, requests_per_unit: 10}}
  - key: generic_key
    value: open
    rate_limit: {{unlimited: true}}
  - key: generic_key
    value: closed
    rate_limit: {{unit: day, requests_per_unit: 0}}
  - key: name
    rate_limit: {{unit: day, requests_per_unit: 100}}
quota_buckets:
  - bucket: {{name: checkout}}
    descriptor: [{{key: generic_key, value: checkout}}]
  - bucket: {{name: daily}}
    descriptor: [{{key: generic_key, value: daily}}]
  - bucket: {{name: small}}
    descriptor: [{{key: generic_key, value: small}}]
  - bucket: {{name: open}}
    descriptor: [{{key: generic_key, value: open}}]
  - bucket: {{name: closed}}
    descriptor: [{{key: generic_key, value: closed}}]
  - bucket: {{name: 'tenant-*'}}
    descriptor: [{{key: name}}]
",
        PERIOD.as_secs()
    )
}

fn start(extra: &[String]) -> (Rlsd, tempfile::TempDir) {
    crate::rlqs::start_with(&config(), extra)
}

async fn client(rlsd: &Rlsd) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect")
}

/// `ShouldRateLimit` on `[key=value]` taking `hits` (0: a peek): the code and what remains.
async fn rls(
    client: &mut RateLimitServiceClient<Channel>,
    key: &str,
    value: &str,
    hits: u64,
) -> (Code, u64) {
    let mut d = descriptor(&[(key, value)]);
    d.hits_addend = Some(hits);
    let answer = client
        .should_rate_limit(RateLimitRequest {
            domain: "web".to_owned(),
            descriptors: vec![d],
            hits_addend: 0,
        })
        .await
        .expect("ShouldRateLimit")
        .into_inner();
    let status = &answer.statuses[0];
    (
        Code::try_from(answer.overall_code).unwrap_or(Code::Unknown),
        u64::from(status.limit_remaining),
    )
}

/// What rlsd told the Envoy of `bucket` last in `answers`.
fn told(answers: &[RateLimitQuotaResponse], bucket: &str) -> Option<Strategy> {
    answers
        .iter()
        .flat_map(|answer| &answer.bucket_action)
        .filter(|action| {
            action
                .bucket_id
                .as_ref()
                .is_some_and(|id| id.bucket.get("name").map(String::as_str) == Some(bucket))
        })
        .filter_map(|action| match &action.bucket_action {
            Some(Action::QuotaAssignmentAction(assign)) => {
                assign.rate_limit_strategy.as_ref().and_then(|s| s.strategy)
            }
            _ => None,
        })
        .next_back()
}

/// An Envoy's stream for `bucket`: the report of the bucket it just created (1 allowed), then
/// a periodic one with `allowed - 1` more, as Envoy sends them.
async fn envoy_reports(rlsd: &Rlsd, bucket: &str, allowed: u64) -> Option<Strategy> {
    let answers = raw(
        rlsd.grpc,
        vec![
            reports("web", vec![usage(bucket, 1, 0)]),
            reports("web", vec![usage(bucket, allowed - 1, 1)]),
        ],
    )
    .await
    .expect("stream");
    told(&answers, bucket)
}

#[tokio::test]
async fn what_an_envoy_reports_is_charged_to_the_descriptor_and_rls_usage_shapes_its_assignment() {
    let (rlsd, _dir) = start(&[]);
    let mut rls_client = client(&rlsd).await;

    // An Envoy reports 40 allowed: a ShouldRateLimit caller sees 40 fewer remaining.
    let (_, before) = rls(&mut rls_client, "generic_key", "daily", 0).await;
    let strategy = envoy_reports(&rlsd, "daily", 40).await;
    assert!(
        matches!(strategy, Some(Strategy::TokenBucket(_))),
        "{strategy:?}"
    );
    let (_, after) = rls(&mut rls_client, "generic_key", "daily", 0).await;
    assert_eq!((before, after), (1000, 960));

    // ShouldRateLimit takes 4 of 10, the Envoy reports 6: nothing is left for either.
    assert_eq!(
        rls(&mut rls_client, "generic_key", "small", 4).await,
        (Code::Ok, 6)
    );
    let strategy = envoy_reports(&rlsd, "small", 6).await;
    assert_eq!(
        strategy,
        Some(Strategy::BlanketRule(BlanketRule::DenyAll as i32))
    );
    assert_eq!(
        rls(&mut rls_client, "generic_key", "small", 1).await.0,
        Code::OverLimit
    );

    // The descriptor's unlimited and zero limits are blanket rules.
    assert_eq!(
        envoy_reports(&rlsd, "open", 3).await,
        Some(Strategy::BlanketRule(BlanketRule::AllowAll as i32))
    );
    assert_eq!(
        envoy_reports(&rlsd, "closed", 3).await,
        Some(Strategy::BlanketRule(BlanketRule::DenyAll as i32))
    );

    // An entry without a value takes the bucket id's: each tenant its own counter.
    envoy_reports(&rlsd, "tenant-a", 30).await;
    assert_eq!(rls(&mut rls_client, "name", "tenant-a", 0).await.1, 70);
    assert_eq!(rls(&mut rls_client, "name", "tenant-b", 0).await.1, 100);

    // The charges show in the limit's own metrics, as ShouldRateLimit's hits do (the peeks
    // count none).
    let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
    let hits = metrics.lines().find_map(|line| {
        let rest = line.strip_prefix("ratelimit_service_rate_limit_total_hits{")?;
        let (labels, value) = rest.split_once("} ")?;
        labels
            .contains("descriptor=\"web.generic_key_daily\"")
            .then(|| value.to_owned())
    });
    assert_eq!(hits.as_deref(), Some("40"), "{metrics}");
}

/// A `ShouldRateLimit` caller at [`RLS_RATE`] a second, on `clients` in turn; counts what it
/// was allowed.
fn rls_traffic(
    clients: Vec<RateLimitServiceClient<Channel>>,
    stop: Arc<AtomicBool>,
) -> (Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let allowed = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&allowed);
    let task = tokio::spawn(async move {
        let mut clients = clients;
        let mut tick = tokio::time::interval(Duration::from_secs(1) / RLS_RATE as u32);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut turn = 0;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let n = clients.len();
            let client = &mut clients[turn % n];
            turn += 1;
            let mut d = descriptor(&[("generic_key", "checkout")]);
            d.hits_addend = Some(1);
            let request = RateLimitRequest {
                domain: "web".to_owned(),
                descriptors: vec![d],
                hits_addend: 0,
            };
            // A store slower than its timeout answers UNAVAILABLE: nothing admitted.
            if let Ok(answer) = client.should_rate_limit(request).await
                && answer.into_inner().overall_code == Code::Ok as i32
            {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    (allowed, task)
}

/// Sleeps until the next start of a [`PERIOD`] window on the Unix clock (rlsd's windows).
async fn next_window() {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_micros();
    let period = PERIOD.as_micros();
    let wait = period - now % period;
    tokio::time::sleep(Duration::from_micros(
        u64::try_from(wait).expect("wait") + 2_000,
    ))
    .await;
}

/// Two Envoys and a `ShouldRateLimit` caller on one shared budget, for `windows` whole windows
/// after a warm-up: each window's admissions (caller, Envoys) are printed, and held to the
/// bound of `docs/rlqs.md`: at most the limit plus what the Envoys may admit in one report
/// interval (their assigned rate, at most the limit's, plus each one's token bucket capacity).
async fn one_budget(what: &str, replicas: &[&Rlsd]) {
    let mut clients = Vec::new();
    for rlsd in replicas {
        clients.push(client(rlsd).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (rls_allowed, rls_task) = rls_traffic(clients, Arc::clone(&stop));
    let envoys: Vec<Envoy> = (0..2)
        .map(|i| {
            let target = replicas[i % replicas.len()].grpc;
            Envoy::start(target, "web", &[("checkout", ENVOY_RATE)])
        })
        .collect();
    let admitted = || {
        (
            rls_allowed.load(Ordering::Relaxed),
            envoys.iter().map(Envoy::admitted).sum::<u64>(),
        )
    };
    // The first reports, and the window they land in.
    tokio::time::sleep(3 * INTERVAL).await;
    next_window().await;
    let mut before = admitted();
    let windows = 4;
    let rate = LIMIT as f64 / PERIOD.as_secs_f64();
    // Per Envoy, the capacity of the largest bucket it can be sent (a quarter second of the
    // whole rate, `BURST_SECONDS`).
    let bound =
        LIMIT as f64 + rate * INTERVAL.as_secs_f64() + envoys.len() as f64 * (rate / 4.0).ceil();
    let mut totals = Vec::new();
    for window in 0..windows {
        next_window().await;
        let now = admitted();
        let (by_rls, by_envoys) = (now.0 - before.0, now.1 - before.1);
        before = now;
        let total = by_rls + by_envoys;
        eprintln!(
            "{what}: window {window}: {total} admitted of {LIMIT} ({:+.1} %): ShouldRateLimit {by_rls}, Envoys {by_envoys}; bound {bound:.0}",
            (total as f64 / LIMIT as f64 - 1.0) * 100.0
        );
        assert!(
            total as f64 <= bound,
            "{what}: window {window} admitted {total}, over the bound {bound:.0}"
        );
        // Both sides draw on it: the caller is not starved, nor are the Envoys.
        assert!(by_rls >= LIMIT / 5, "{what}: ShouldRateLimit got {by_rls}");
        assert!(by_envoys >= LIMIT / 5, "{what}: the Envoys got {by_envoys}");
        totals.push(total);
    }
    // Demand is twice the limit: the budget is used, not left idle by the late charges.
    let mean = totals.iter().sum::<u64>() as f64 / totals.len() as f64;
    eprintln!(
        "{what}: mean {mean:.0} a window ({:+.1} %)",
        (mean / LIMIT as f64 - 1.0) * 100.0
    );
    assert!(mean >= 0.85 * LIMIT as f64, "{what}: mean {mean:.0}");
    stop.store(true, Ordering::Relaxed);
    let _ = rls_task.await;
    for envoy in envoys {
        envoy.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_callers_and_envoys_share_one_budget_in_process() {
    let (rlsd, _dir) = start(&[]);
    one_budget("in process", &[&rlsd]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_callers_and_envoys_share_one_budget_across_two_replicas_on_redis() {
    let redis = RedisServer::start();
    // A debug build on a busy machine: the default 20 ms would fail calls, not test sharing.
    let flags = [
        "--redis-url".to_owned(),
        redis.url(),
        "--redis-command-timeout-ms".to_owned(),
        "1000".to_owned(),
    ];
    let (one, _a) = start(&flags);
    let (two, _b) = start(&flags);
    one_budget("two replicas on Redis", &[&one, &two]).await;
}

#[test]
fn check_reports_a_shared_descriptor_it_cannot_find_with_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("web.yaml");
    std::fs::write(
        &file,
        "domain: web\ndescriptors:\n  - key: generic_key\n    value: checkout\n    rate_limit: {unit: second, requests_per_unit: 10}\nquota_buckets:\n  - bucket: {name: cart}\n    descriptor: [{key: generic_key, value: cart}]\n  - bucket: {name: any}\n    descriptor: [{key: tenant}]\n",
    )
    .expect("write");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_rlsd"))
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .expect("run rlsd check");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("web.yaml:8:") && stderr.contains("matches no descriptor of domain 'web'"),
        "{stderr}"
    );
    assert!(
        stderr.contains("web.yaml:10:") && stderr.contains("has no entry 'tenant'"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_store_failing_on_the_charge_answers_by_the_failure_mode() {
    // The in-process store full (one key, taken by a ShouldRateLimit call): the charge of a new
    // bucket cannot be recorded, while the demand board (in process) still works.
    for (mode, rule) in [
        ("deny", BlanketRule::DenyAll),
        ("allow", BlanketRule::AllowAll),
    ] {
        let flags = [
            "--max-keys".to_owned(),
            "1".to_owned(),
            "--failure-mode".to_owned(),
            mode.to_owned(),
        ];
        let (rlsd, _dir) = start(&flags);
        let mut rls_client = client(&rlsd).await;
        assert_eq!(
            rls(&mut rls_client, "generic_key", "daily", 1).await,
            (Code::Ok, 999)
        );
        let answers = raw(
            rlsd.grpc,
            vec![reports("web", vec![usage("checkout", 1, 0)])],
        )
        .await
        .expect("stream");
        assert_eq!(
            told(&answers, "checkout"),
            Some(Strategy::BlanketRule(rule as i32)),
            "--failure-mode {mode}"
        );
        let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
        assert!(
            metrics.contains(&format!(
                "rlsd_rlqs_failure_mode_answers_total{{mode=\"{mode}\"}} 1"
            )),
            "{metrics}"
        );
    }
}
