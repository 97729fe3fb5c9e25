//! Health that waits for a config (`--healthy-with-at-least-one-config-loaded`, envoyproxy/
//! ratelimit's `HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED`), over real HTTP and gRPC health.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::http_get;
use common::process::{Rlsd, command_at};
use rlsd_testkit::redis::RedisServer;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const LIMITS: &str = "domain: live\ndescriptors:\n  - key: user\n    rate_limit: {unit: day, requests_per_unit: 3}\n";

/// What the gRPC health service says about `service` ("" is the whole server).
pub async fn grpc_health(grpc: SocketAddr, service: &str) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut client = HealthClient::new(channel);
    let response = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .expect("health answers")
        .into_inner();
    ServingStatus::try_from(response.status).expect("a known status")
}

/// `/healthcheck` and the gRPC health of "" and "ratelimit", once they agree on `serving`;
/// panics with what they said if they do not within the deadline.
pub async fn wait_for_health(rlsd: &Rlsd, serving: bool) {
    let (http, grpc) = if serving {
        (200, ServingStatus::Serving)
    } else {
        (500, ServingStatus::NotServing)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = (
            http_get(rlsd.http, "/healthcheck").await.0,
            grpc_health(rlsd.grpc, "").await,
            grpc_health(rlsd.grpc, "ratelimit").await,
        );
        if now == (http, grpc, grpc) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "health never turned {grpc:?}: {now:?}\n{}",
            rlsd.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn serve(dir: &Path, extra: &[&str]) -> Rlsd {
    let mut args = vec![
        "--config".to_owned(),
        dir.display().to_string(),
        "--reload-interval-ms".to_owned(),
        "100".to_owned(),
    ];
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    Rlsd::serve(args)
}

#[tokio::test]
async fn an_empty_directory_is_unhealthy_until_a_domain_loads_when_health_needs_a_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rlsd = serve(dir.path(), &["--healthy-with-at-least-one-config-loaded"]);
    // Unhealthy from the first answer: no window in which a probe could pass.
    assert_eq!(
        http_get(rlsd.http, "/healthcheck").await,
        (500, "no config loaded".to_owned())
    );
    for service in [
        "",
        "ratelimit",
        "envoy.service.ratelimit.v3.RateLimitService",
    ] {
        assert_eq!(
            grpc_health(rlsd.grpc, service).await,
            ServingStatus::NotServing
        );
    }

    std::fs::write(dir.path().join("live.yaml"), LIMITS).expect("write");
    wait_for_health(&rlsd, true).await;
    assert_eq!(
        http_get(rlsd.http, "/healthcheck").await,
        (200, "OK".to_owned())
    );

    // Emptied again: the reload is refused, the config kept, and health with it.
    std::fs::remove_file(dir.path().join("live.yaml")).expect("remove");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !rlsd.log().contains("config reload rejected") {
        assert!(Instant::now() < deadline, "never reloaded:\n{}", rlsd.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_for_health(&rlsd, true).await;
}

#[tokio::test]
async fn an_empty_directory_is_healthy_by_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rlsd = serve(dir.path(), &[]);
    assert_eq!(
        http_get(rlsd.http, "/healthcheck").await,
        (200, "OK".to_owned())
    );
    assert_eq!(grpc_health(rlsd.grpc, "").await, ServingStatus::Serving);
}

#[tokio::test]
async fn ratelimit_honours_healthy_with_at_least_one_config_loaded() {
    // The binary as envoyproxy/ratelimit's image runs it, with its config directory empty.
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("bin")).expect("bin");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_rlsd"), dir.path().join("bin/ratelimit"))
        .expect("link the binary as ratelimit");
    let configs = dir.path().join("data/ratelimit/config");
    std::fs::create_dir_all(&configs).expect("config directory");
    let mut command = command_at(dir.path().join("bin/ratelimit"));
    command
        .env("RUNTIME_ROOT", dir.path().join("data"))
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("USE_STATSD", "false")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", "0")
        .env("DEBUG_HOST", "127.0.0.1")
        .env("DEBUG_PORT", "0")
        .env("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "true");
    let rlsd = Rlsd::start(command);
    wait_for_health(&rlsd, false).await;
    std::fs::write(configs.join("live.yaml"), LIMITS).expect("write");
    wait_for_health(&rlsd, true).await;
}
