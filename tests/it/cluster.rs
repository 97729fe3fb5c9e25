//! rlsd on a real Redis Cluster (3 masters + 3 replicas on loopback) over gRPC: exactness
//! across replicas with keys spread over slots, and a master killed under load.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{allowed_of, descriptor, request, spawn_server_with};
use rlsd::engine::KeySettings;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::server::ServeOptions;
use rlsd::service::{FailureMode, HeaderStyle, ServiceSettings};
use rlsd::store::{ClusterSettings, ClusterStore};
use rlsd_testkit::cluster::RedisCluster;
use tonic::transport::Channel;

const CONFIG: &str = r#"
domain: c
descriptors:
  - key: a
    rate_limit: {unit: day, requests_per_unit: 300, algorithm: sliding_window_log}
  - key: b
    rate_limit: {unit: day, requests_per_unit: 1000, algorithm: gcra, burst: 1000}
  - key: c
    rate_limit: {unit: day, requests_per_unit: 1000000}
"#;

async fn rlsd(
    cluster: &RedisCluster,
    failure_mode: FailureMode,
    timeout: Duration,
) -> RateLimitServiceClient<Channel> {
    let mut settings = ClusterSettings::new(cluster.urls());
    settings.command_timeout = timeout;
    let store = Arc::new(ClusterStore::connect(settings).await.expect("connect"));
    let service = ServiceSettings {
        keys: KeySettings::default(),
        headers: HeaderStyle::XRatelimit,
        failure_mode,
        shadow_mode: false,
        limits: Default::default(),
        ..Default::default()
    };
    // On the multi-thread runtime, as the binary serves Cluster (no lanes: one shared connection).
    let (grpc, _http, stop, _task, _) =
        spawn_server_with(CONFIG, store, service, ServeOptions::default()).await;
    // The server lives as long as the test; the sender is leaked so it never stops early.
    std::mem::forget(stop);
    RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_a_cluster_admit_exactly_the_limit() {
    let cluster = RedisCluster::start();
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(rlsd(&cluster, FailureMode::Error, Duration::from_secs(2)).await);
    }
    // Three limits whose keys live in different slots: all or nothing across them.
    let descriptors = vec![
        descriptor(&[("a", "x")]),
        descriptor(&[("b", "y")]),
        descriptor(&[("c", "z")]),
    ];
    let allowed = allowed_of(&clients, "c", 60, 10, descriptors).await;
    assert_eq!(allowed, 300, "600 requests, the tightest limit 300");
    // Denied requests were refunded in the other slots: b and c counted only the 300.
    let mut client = clients[0].clone();
    let response = client
        .should_rate_limit(request(
            "c",
            vec![descriptor(&[("b", "y")]), descriptor(&[("c", "z")])],
        ))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(response.statuses[0].limit_remaining, 1000 - 301);
    assert_eq!(response.statuses[1].limit_remaining, 1_000_000 - 301);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_under_load_is_survived() {
    let mut cluster = RedisCluster::start();
    let timeout = Duration::from_millis(300);
    let mut client = rlsd(&cluster, FailureMode::Error, timeout).await;
    let ask = |mut client: RateLimitServiceClient<Channel>| async move {
        let started = Instant::now();
        let answer = client
            .should_rate_limit(request(
                "c",
                vec![descriptor(&[("c", "load")]), descriptor(&[("b", "load")])],
            ))
            .await;
        if let Err(status) = &answer
            && std::env::var_os("RLSD_TRACE").is_some()
        {
            eprintln!("{:?} {}", started.elapsed(), status.message());
        }
        (
            answer
                .map(|r| r.into_inner().overall_code)
                .map_err(|s| s.code()),
            started.elapsed(),
        )
    };
    for _ in 0..20 {
        assert_eq!(ask(client.clone()).await.0, Ok(Code::Ok as i32));
    }
    // The master holding one of the request's keys.
    let victim = cluster
        .master_of("rlsd:_:c:fw:86400:c=load")
        .expect("a master holds the key");
    cluster.kill(victim);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut failures = 0;
    loop {
        let (answer, took) = ask(client.clone()).await;
        // A hang detector, not a speed claim: several command timeouts at most.
        assert!(took < timeout * 10, "answer took {took:?}");
        match answer {
            Ok(code) => {
                assert_eq!(code, Code::Ok as i32);
                if failures > 0 {
                    break;
                }
            }
            Err(code) => {
                assert_eq!(
                    code,
                    tonic::Code::Unavailable,
                    "failure mode error answers UNAVAILABLE"
                );
                failures += 1;
            }
        }
        assert!(
            Instant::now() < deadline,
            "service did not resume after the failover"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.wait_until_ok();
    for _ in 0..20 {
        let (answer, _) = ask(client.clone()).await;
        assert_eq!(
            answer,
            Ok(Code::Ok as i32),
            "after promotion every call is decided"
        );
    }
    client = client.clone();
    drop(client);
}
