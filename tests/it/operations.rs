//! Operations over real sockets: exact metrics, health that follows the store and the drain,
//! and calls in flight at shutdown.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{T0, descriptor, http_get, request, spawn_server_with};
use rlsd::clock::ManualClock;
use rlsd::engine::KeySettings;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::server::ServeOptions;
use rlsd::service::{FailureMode, HeaderStyle, ServiceSettings};
use rlsd::store::{MemoryStore, RedisSettings, RedisStore};
use rlsd_testkit::redis::RedisServer;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const CONFIG: &str = r#"
domain: ops
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: tenant
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: bucket
    rate_limit: {unit: minute, requests_per_unit: 100, algorithm: token_bucket, burst: 10}
"#;

fn settings() -> ServiceSettings {
    ServiceSettings {
        keys: KeySettings::default(),
        headers: HeaderStyle::XRatelimit,
        failure_mode: FailureMode::Error,
        shadow_mode: false,
        limits: Default::default(),
        ..Default::default()
    }
}

/// The value of `name` with exactly these labels in a scrape.
fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| {
            s.metric == name
                && labels.len() == s.labels.iter().count()
                && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
        })
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(ref buckets) => {
                buckets.last().map_or(0.0, |b| b.count)
            }
            prometheus_parse::Value::Summary(_) => f64::NAN,
        })
}

#[tokio::test]
async fn metrics_after_traffic_have_exact_values() {
    let store = Arc::new(MemoryStore::with_clock(100, ManualClock::at(T0)));
    let (grpc, http, stop, task, _) =
        spawn_server_with(CONFIG, store, settings(), ServeOptions::default()).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    for _ in 0..5 {
        client
            .should_rate_limit(request("ops", vec![descriptor(&[("user", "u")])]))
            .await
            .expect("answer");
    }
    for _ in 0..2 {
        let response = client
            .should_rate_limit(request("ops", vec![descriptor(&[("trial", "t")])]))
            .await
            .expect("answer")
            .into_inner();
        assert_eq!(
            response.overall_code,
            Code::Ok as i32,
            "shadow never denies"
        );
    }
    // The clock stands still, so the bucket's 10 tokens go one by one.
    for _ in 0..10 {
        client
            .should_rate_limit(request("ops", vec![descriptor(&[("bucket", "b")])]))
            .await
            .expect("answer");
    }
    let mut heavy = request("ops", vec![descriptor(&[("tenant", "acme")])]);
    heavy.hits_addend = 4;
    client.should_rate_limit(heavy).await.expect("answer");
    client
        .should_rate_limit(request("", vec![]))
        .await
        .expect_err("invalid");

    let (status, body) = http_get(http, "/metrics").await;
    assert_eq!(status, 200);
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .expect("valid exposition");
    let user = [("domain", "ops"), ("descriptor", "ops.user")];
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_total_hits", &user),
        Some(5.0)
    );
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_within_limit", &user),
        Some(3.0)
    );
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_over_limit", &user),
        Some(2.0)
    );
    // floor(0.8 x 3) = 2: only the third request took usage past it while allowed.
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_near_limit", &user),
        Some(1.0)
    );
    // Near the limit counts against the burst for a token bucket: floor(0.8 x 10) = 8, so the
    // 9th and 10th tokens, not every hit of a limit of 100.
    let bucket = [("domain", "ops"), ("descriptor", "ops.bucket")];
    assert_eq!(
        sample(
            &scrape,
            "ratelimit_service_rate_limit_within_limit",
            &bucket
        ),
        Some(10.0)
    );
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_near_limit", &bucket),
        Some(2.0)
    );
    let trial = [("domain", "ops"), ("descriptor", "ops.trial")];
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_shadow_mode", &trial),
        Some(1.0)
    );
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_within_limit", &trial),
        Some(1.0)
    );
    // detailed_metric: the request's own value is in the label.
    let tenant = [("domain", "ops"), ("descriptor", "ops.tenant_acme")];
    assert_eq!(
        sample(&scrape, "ratelimit_service_rate_limit_total_hits", &tenant),
        Some(4.0)
    );
    assert_eq!(
        sample(&scrape, "rlsd_invalid_requests_total", &[]),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "ratelimit_service_should_rate_limit_duration_seconds_count",
            &[]
        ),
        Some(19.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "rlsd_store_call_duration_seconds_count",
            &[("store", "memory")]
        ),
        Some(18.0)
    );
    let _ = stop.send(());
    task.await.expect("server");
}

/// A gRPC channel to the server at `grpc`.
async fn channel(grpc: std::net::SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

async fn grpc_health(grpc: std::net::SocketAddr, service: &str) -> ServingStatus {
    let channel = channel(grpc).await;
    let mut client = HealthClient::new(channel);
    let response = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .expect("health answers")
        .into_inner();
    ServingStatus::try_from(response.status).expect("known status")
}

async fn wait_for<F: std::future::Future<Output = bool>>(what: &str, mut probe: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !probe().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_redis_and_the_drain() {
    let mut redis = RedisServer::start();
    let mut redis_settings = RedisSettings::new(redis.url());
    redis_settings.command_timeout = Duration::from_millis(200);
    let store = Arc::new(RedisStore::connect(redis_settings).await.expect("url"));
    let options = ServeOptions {
        drain: Duration::from_millis(800),
        ..ServeOptions::default()
    };
    let (grpc, http, stop, task, _) = spawn_server_with(CONFIG, store, settings(), options).await;
    assert_eq!(http_get(http, "/healthcheck").await, (200, "OK".to_owned()));
    for service in ["", "ratelimit"] {
        assert_eq!(grpc_health(grpc, service).await, ServingStatus::Serving);
    }

    redis.kill();
    wait_for("/healthcheck to fail", || async {
        http_get(http, "/healthcheck").await == (500, "store unreachable".to_owned())
    })
    .await;
    assert_eq!(
        grpc_health(grpc, "ratelimit").await,
        ServingStatus::NotServing
    );
    redis.restart();
    wait_for("/healthcheck to recover", || async {
        http_get(http, "/healthcheck").await.0 == 200
    })
    .await;
    assert_eq!(grpc_health(grpc, "").await, ServingStatus::Serving);

    // The shutdown signal: health turns at once, answers go on through the drain.
    let _ = stop.send(());
    wait_for("draining", || async {
        http_get(http, "/healthcheck").await == (500, "draining".to_owned())
    })
    .await;
    assert_eq!(grpc_health(grpc, "").await, ServingStatus::NotServing);
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let during = client
        .should_rate_limit(request("ops", vec![descriptor(&[("user", "d")])]))
        .await;
    assert!(during.is_ok(), "answered while draining: {during:?}");
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops after the drain")
        .expect("server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_at_shutdown_all_complete() {
    let redis = RedisServer::start();
    let mut redis_settings = RedisSettings::new(redis.url());
    redis_settings.command_timeout = Duration::from_secs(5);
    redis_settings.lanes = common::LANES;
    let store = Arc::new(RedisStore::connect(redis_settings).await.expect("url"));
    // On lanes, as the binary serves: the wait at shutdown covers calls on every lane.
    let options = ServeOptions {
        lanes: common::LANES,
        ..ServeOptions::default()
    };
    let (grpc, _http, stop, task, _) = spawn_server_with(CONFIG, store, settings(), options).await;
    let client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    // Redis stalls for a moment, so these calls are all waiting inside rlsd when the stop comes.
    let stall = std::thread::spawn({
        let port = redis.port;
        move || {
            std::process::Command::new("redis-cli")
                .args(["-p", &port.to_string(), "DEBUG", "SLEEP", "0.7"])
                .output()
                .expect("redis-cli")
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .should_rate_limit(request(
                        "ops",
                        vec![descriptor(&[("user", &format!("u{i}"))])],
                    ))
                    .await
                    .map(|r| r.into_inner().overall_code)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = stop.send(());
    for call in calls {
        let answer = call.await.expect("task");
        assert_eq!(answer.expect("in-flight call completes"), Code::Ok as i32);
    }
    task.await.expect("server");
    stall.join().expect("stall thread");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_never_ends_holds_shutdown_only_for_the_grace_period() {
    let store = Arc::new(MemoryStore::with_clock(100, ManualClock::at(T0)));
    let grace = Duration::from_millis(500);
    let options = ServeOptions {
        shutdown_grace: grace,
        lanes: common::LANES,
        ..ServeOptions::default()
    };
    let (grpc, _http, stop, task, _) = spawn_server_with(CONFIG, store, settings(), options).await;
    // A health Watch, as Kubernetes' gRPC probes and Envoy's health checker hold one open.
    let channel = channel(grpc).await;
    let mut watch = HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("watch starts")
        .into_inner();
    let first = watch
        .message()
        .await
        .expect("watch answers")
        .expect("a status");
    assert_eq!(first.status, ServingStatus::Serving as i32);

    let stopped_at = Instant::now();
    let _ = stop.send(());
    // The watcher hears NOT_SERVING first, while the server waits for the stream to end.
    let next = watch
        .message()
        .await
        .expect("still streaming")
        .expect("a status");
    assert_eq!(next.status, ServingStatus::NotServing as i32);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the server stops though the watch stream never ends")
        .expect("server");
    assert!(
        stopped_at.elapsed() >= grace,
        "the open stream was given its grace period, not cut at once: {:?}",
        stopped_at.elapsed()
    );
}

#[tokio::test]
async fn the_json_endpoint_answers_200_429_and_400() {
    let store = Arc::new(MemoryStore::with_clock(100, ManualClock::at(T0)));
    // Writes on, so the second request finds the first one's hits.
    let options = ServeOptions {
        admin_json_writes: true,
        ..ServeOptions::default()
    };
    let (_grpc, http, stop, task, _) = spawn_server_with(CONFIG, store, settings(), options).await;
    let body = r#"{"domain":"ops","descriptors":[{"entries":[{"key":"user","value":"j"}]}],"hitsAddend":2}"#;
    let (status, answer) = common::http_post(http, "/json", body).await;
    assert_eq!(status, 200, "{answer}");
    let answer: serde_json::Value = serde_json::from_str(&answer).expect("json");
    assert_eq!(answer["overallCode"], "OK");
    assert_eq!(answer["statuses"][0]["limitRemaining"], 1);
    assert_eq!(answer["statuses"][0]["currentLimit"]["unit"], "MINUTE");
    assert_eq!(answer["statuses"][0]["durationUntilReset"], "60s");
    let (status, answer) = common::http_post(http, "/json", body).await;
    assert_eq!(status, 429, "{answer}");
    assert!(answer.contains("\"OVER_LIMIT\""), "{answer}");
    for bad in [
        "{not json",
        r#"{"domain":"ops","descriptors":[],"colour":1}"#,
        r#"{"domain":"","descriptors":[{"entries":[{"key":"a"}]}]}"#,
    ] {
        let (status, answer) = common::http_post(http, "/json", bad).await;
        assert_eq!(status, 400, "{bad}: {answer}");
        assert!(!answer.is_empty());
    }
    // Timed as gRPC calls are: the two answers and the empty domain, not what did not parse.
    let (_, text) = common::http_get(http, "/metrics").await;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .expect("an exposition");
    let latency = "ratelimit_service_should_rate_limit_duration_seconds_count";
    assert_eq!(sample(&scrape, latency, &[]), Some(3.0), "{text}");
    let _ = stop.send(());
    task.await.expect("server");
}

#[tokio::test]
async fn grpc_reflection_lists_the_services() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let store = Arc::new(MemoryStore::with_clock(100, ManualClock::at(T0)));
    let (grpc, _http, stop, task, _) =
        spawn_server_with(CONFIG, store, settings(), ServeOptions::default()).await;
    let channel = channel(grpc).await;
    let mut client = ServerReflectionClient::new(channel);
    let ask = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([ask]))
        .await
        .expect("reflection answers")
        .into_inner();
    let answer = answers
        .message()
        .await
        .expect("stream")
        .expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("unexpected answer {answer:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"envoy.service.ratelimit.v3.RateLimitService".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );
    let _ = stop.send(());
    task.await.expect("server");
}

/// envoyproxy/ratelimit's `share_threshold` (every value a wildcard matches draws on one
/// counter) and `value_to_metric` (a default node's metrics carry the value), over gRPC.
#[tokio::test]
async fn share_threshold_counts_matching_values_together_and_value_to_metric_labels_them() {
    const SHARED: &str = r#"
domain: files
descriptors:
  - key: path
    value: files/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: own/*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: user
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 5}
"#;
    let store = Arc::new(MemoryStore::with_clock(100, ManualClock::at(T0)));
    let (grpc, http, stop, task, _) =
        spawn_server_with(SHARED, store, settings(), ServeOptions::default()).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let mut codes = Vec::new();
    for path in [
        "files/a.pdf",
        "files/b.csv",
        "files/c.txt",
        "own/a",
        "own/b",
        "own/c",
    ] {
        let response = client
            .should_rate_limit(request("files", vec![descriptor(&[("path", path)])]))
            .await
            .expect("answer")
            .into_inner();
        codes.push(Code::try_from(response.overall_code).expect("a code"));
    }
    // Two per minute for all of files/* together; each own/* value has two of its own.
    assert_eq!(
        codes,
        [
            Code::Ok,
            Code::Ok,
            Code::OverLimit,
            Code::Ok,
            Code::Ok,
            Code::Ok
        ]
    );
    for user in ["alice", "alice", "bob"] {
        client
            .should_rate_limit(request("files", vec![descriptor(&[("user", user)])]))
            .await
            .expect("answer");
    }

    let (status, body) = http_get(http, "/metrics").await;
    assert_eq!(status, 200);
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .expect("valid exposition");
    let hits = |path: &str| {
        sample(
            &scrape,
            "ratelimit_service_rate_limit_total_hits",
            &[("domain", "files"), ("descriptor", path)],
        )
    };
    assert_eq!(hits("files.path_files/*"), Some(3.0));
    assert_eq!(
        sample(
            &scrape,
            "ratelimit_service_rate_limit_over_limit",
            &[("domain", "files"), ("descriptor", "files.path_files/*")],
        ),
        Some(1.0)
    );
    assert_eq!(hits("files.path_own/*"), Some(3.0));
    assert_eq!(hits("files.user_alice"), Some(2.0));
    assert_eq!(hits("files.user_bob"), Some(1.0));
    assert_eq!(hits("files.user"), None);
    let _ = stop.send(());
    task.await.expect("server");
}
