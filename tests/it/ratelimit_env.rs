//! The binary run as `ratelimit` (the image's `/bin/ratelimit`, envoyproxy/ratelimit's path)
//! takes its settings from envoyproxy/ratelimit's environment variables, as a Deployment written
//! for that image sets them.

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::process::{Rlsd, command_at};
use common::{descriptor, request};
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd_testkit::redis::RedisServer;

/// A directory with the binary linked as `bin/ratelimit`, and `config` written as
/// envoyproxy/ratelimit finds it: `data/ratelimit/config/` (RUNTIME_ROOT=data,
/// RUNTIME_SUBDIRECTORY=ratelimit).
fn installed(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::create_dir_all(dir.path().join("bin")).expect("bin");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_rlsd"), dir.path().join("bin/ratelimit"))
        .expect("link the binary as ratelimit");
    let configs = dir.path().join("data/ratelimit/config");
    std::fs::create_dir_all(&configs).expect("config directory");
    std::fs::write(configs.join("ratelimit.yaml"), config).expect("config file");
    dir
}

fn ratelimit(dir: &Path) -> std::process::Command {
    let mut command = command_at(dir.join("bin/ratelimit"));
    command
        .env("RUNTIME_ROOT", dir.join("data"))
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("RUNTIME_IGNOREDOTFILES", "true")
        .env("USE_STATSD", "false")
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("GRPC_HOST", "127.0.0.1")
        .env("GRPC_PORT", "0")
        .env("DEBUG_HOST", "127.0.0.1")
        .env("DEBUG_PORT", "0")
        .env("LOG_LEVEL", "info")
        // The image's own default, which the mapped RUNTIME_* config must win over.
        .env("RLSD_CONFIG", "/etc/rlsd-not-here");
    command
}

const PRODUCTPAGE: &str = r#"
domain: productpage-ratelimit
descriptors:
  - key: PATH
    value: "/productpage"
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: PATH
    rate_limit:
      unit: minute
      requests_per_unit: 100
"#;

// Multi-threaded, so the dropped client's connection closes while this thread waits for the
// exit in `terminate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_sample_environment_serves_its_config_from_its_redis_without_headers() {
    let redis = RedisServer::start();
    let dir = installed(PRODUCTPAGE);
    let mut command = ratelimit(dir.path());
    command
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port));
    let mut rlsd = Rlsd::start(command);

    let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");
    let mut answers = Vec::new();
    for _ in 0..2 {
        let response = client
            .should_rate_limit(request(
                "productpage-ratelimit",
                vec![descriptor(&[("PATH", "/productpage")])],
            ))
            .await
            .expect("answer")
            .into_inner();
        // envoyproxy/ratelimit adds no headers unless LIMIT_RESPONSE_HEADERS_ENABLED.
        assert!(
            response.response_headers_to_add.is_empty(),
            "{:?}",
            response.response_headers_to_add
        );
        answers.push(Code::try_from(response.overall_code).expect("a code"));
    }
    assert_eq!(answers, [Code::Ok, Code::OverLimit]);
    // The debug port serves /rlconfig, as envoyproxy/ratelimit's does, the same as the HTTP port.
    let debug = rlsd.serving("debug").expect("a debug port");
    let (status, limits) = common::http_get(debug, "/rlconfig").await;
    assert_eq!(status, 200);
    assert!(limits.contains("productpage-ratelimit"), "{limits}");
    assert_eq!(common::http_get(rlsd.http, "/rlconfig").await.1, limits);
    let (status, _) = common::http_post(debug, "/json", "{}").await;
    assert_eq!(status, 404, "the debug port changes nothing");
    // The counter is in REDIS_URL's Redis.
    let keys = redis.cli(&["DBSIZE"]).expect("dbsize");
    assert_ne!(keys, "0", "no key in Redis");
    drop(client);

    let status = rlsd.terminate(Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    let log = rlsd.log();
    assert!(log.contains("store=\"redis\""), "{log}");
    assert!(log.contains("data/ratelimit/config"), "{log}");
}

#[test]
fn settings_it_cannot_honour_stop_the_start_by_name() {
    let dir = installed(PRODUCTPAGE);
    for (variable, value, said) in [
        ("BACKEND_TYPE", "memcache", "BACKEND_TYPE=memcache"),
        (
            "LIMIT_LIMIT_HEADER",
            "X Limit",
            "LIMIT_LIMIT_HEADER=X Limit",
        ),
    ] {
        let output = exit_of(ratelimit(dir.path()).env(variable, value));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{variable}: started\n{stderr}");
        assert!(
            stderr.starts_with("ratelimit: ") && stderr.contains(said),
            "{variable}: {stderr}"
        );
    }
}

/// Runs `command` to its exit, which must come within 20 s (a refusal that broke would leave
/// rlsd serving): killed and failed otherwise.
fn exit_of(command: &mut std::process::Command) -> std::process::Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ratelimit");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("child status").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "still running after 20 s:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

const EDGE: &str = r#"
domain: edge
descriptors:
  - key: user
    metadata: {team: users}
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: route
    metadata: {team: routes, tier: gold}
    rate_limit: {unit: hour, requests_per_unit: 100}
"#;

/// One `[user=<user>], [route=/]` request to `rlsd`.
async fn ask_edge(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    user: &str,
) -> Result<rlsd::pb::RateLimitResponse, tonic::Status> {
    client
        .should_rate_limit(request(
            "edge",
            vec![descriptor(&[("user", user)]), descriptor(&[("route", "/")])],
        ))
        .await
        .map(tonic::Response::into_inner)
}

/// The overall code and each status's code.
fn codes(response: &rlsd::pb::RateLimitResponse) -> (Code, Vec<Code>) {
    let code = |value| Code::try_from(value).expect("a code");
    (
        code(response.overall_code),
        response.statuses.iter().map(|s| code(s.code)).collect(),
    )
}

/// `metadata.<key>` of the response's dynamic metadata, as an access log's
/// `%DYNAMIC_METADATA(envoy.filters.http.ratelimit:metadata:<key>)%` reads it.
fn metadata_field(response: &rlsd::pb::RateLimitResponse, key: &str) -> Option<String> {
    use prost_types::value::Kind;
    let metadata = response.dynamic_metadata.as_ref()?.fields.get("metadata")?;
    let Some(Kind::StructValue(metadata)) = &metadata.kind else {
        return None;
    };
    match &metadata.fields.get(key)?.kind {
        Some(Kind::StringValue(value)) => Some(value.clone()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_mode_dynamic_metadata_and_tuning_variables_act_as_in_envoyproxy_ratelimit() {
    let redis = RedisServer::start();
    let dir = installed(EDGE);
    let mut command = ratelimit(dir.path());
    command
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("QUOTA_MODE", "true")
        .env("RESPONSE_DYNAMIC_METADATA", "true")
        .env("REDIS_TIMEOUT", "10s")
        .env("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "true")
        .env("REDIS_POOL_SIZE", "20")
        .env("REDIS_PIPELINE_WINDOW", "150us")
        .env("LOCAL_CACHE_SIZE_IN_BYTES", "1048576");
    let rlsd = Rlsd::start(command);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");

    let first = ask_edge(&mut client, "ann").await.expect("answer");
    assert_eq!(codes(&first), (Code::Ok, vec![Code::Ok, Code::Ok]));
    assert_eq!(metadata_field(&first, "team").as_deref(), Some("users"));
    assert_eq!(metadata_field(&first, "tier").as_deref(), Some("gold"));
    // The user is over; the route, another quota, has room: allowed. The metadata is the
    // route's alone.
    let second = ask_edge(&mut client, "ann").await.expect("answer");
    assert_eq!(codes(&second), (Code::Ok, vec![Code::OverLimit, Code::Ok]));
    assert_eq!(metadata_field(&second, "team").as_deref(), Some("routes"));

    // REDIS_TIMEOUT=10s: a Redis stalled for 300 ms is waited for (rlsd's own 5 ms would give up).
    assert_eq!(
        redis.cli(&["CLIENT", "PAUSE", "300", "ALL"]).as_deref(),
        Some("OK")
    );
    let waited = ask_edge(&mut client, "bob").await;
    assert!(waited.is_ok(), "{waited:?}\n{}", rlsd.log());

    // PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS: the latency histogram is in milliseconds.
    let (_, metrics) = common::http_get(rlsd.http, "/metrics").await;
    assert!(
        metrics.contains("ratelimit_service_should_rate_limit_duration_milliseconds_count 3"),
        "{metrics}"
    );
    // What is ignored is named, with why, in one line.
    let log = rlsd.log();
    let ignored: Vec<&str> = log.lines().filter(|l| l.contains("ignored: ")).collect();
    assert_eq!(ignored.len(), 1, "{log}");
    for named in [
        "REDIS_POOL_SIZE, REDIS_PIPELINE_WINDOW, because",
        "LOCAL_CACHE_SIZE_IN_BYTES, because",
    ] {
        assert!(ignored[0].contains(named), "{named}: {log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_keeps_each_status_and_disable_stats_opens_no_metrics_port() {
    let redis = RedisServer::start();
    let dir = installed(EDGE);
    // Held: with a metrics port to open there, rlsd could not start.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let mut command = ratelimit(dir.path());
    command
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("REDIS_TIMEOUT", "2s")
        .env("SHADOW_MODE", "true")
        .env("DISABLE_STATS", "true")
        .env("USE_PROMETHEUS", "true")
        .env(
            "PROMETHEUS_ADDR",
            taken.local_addr().expect("its address").to_string(),
        );
    let rlsd = Rlsd::start(command);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");
    let mut answers = Vec::new();
    for _ in 0..3 {
        let response = ask_edge(&mut client, "cat").await.expect("answer");
        // Without RESPONSE_DYNAMIC_METADATA, none, as envoyproxy/ratelimit.
        assert_eq!(response.dynamic_metadata, None);
        answers.push(codes(&response));
    }
    assert_eq!(
        answers,
        [
            (Code::Ok, vec![Code::Ok, Code::Ok]),
            // Envoy's own headers still show which limit would fire.
            (Code::Ok, vec![Code::OverLimit, Code::Ok]),
            (Code::Ok, vec![Code::OverLimit, Code::Ok]),
        ]
    );
    assert!(rlsd.log().contains("DISABLE_STATS"), "{}", rlsd.log());
}

/// A ConfigMap key of the merged test: one half of domain `split`, with YAML 1.1 scalars.
const SPLIT_ONE: &str = "domain: split\ndescriptors:\n  - key: k\n    value: yes\n    metadata: {x: 1, y: 2}\n    rate_limit: {unit: hour, requests_per_unit: 01}\n";
/// The other half.
const SPLIT_TWO: &str = "domain: split\ndescriptors:\n  - key: m\n    rate_limit: {unit: hour, requests_per_unit: 0x2}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_of_one_domain_in_two_keys_loads_with_merge_domain_config_and_dotfiles_read() {
    use std::os::unix::fs::symlink;
    let redis = RedisServer::start();
    let dir = installed(PRODUCTPAGE);
    // The config directory as a ConfigMap volume, keys without a .yaml name.
    let configs = dir.path().join("data/ratelimit/config");
    std::fs::remove_file(configs.join("ratelimit.yaml")).expect("remove");
    let stamp = configs.join("..2026_12_07_21_00_00.1");
    std::fs::create_dir(&stamp).expect("mkdir");
    std::fs::write(stamp.join("split-one.conf"), SPLIT_ONE).expect("write");
    std::fs::write(stamp.join("split-two"), SPLIT_TWO).expect("write");
    symlink("..2026_12_07_21_00_00.1", configs.join("..data")).expect("symlink");
    for name in ["split-one.conf", "split-two"] {
        symlink(format!("..data/{name}"), configs.join(name)).expect("symlink");
    }
    let mut command = ratelimit(dir.path());
    // Unset, as in most Deployments: goruntime's default reads dot names.
    command
        .env_remove("RUNTIME_IGNOREDOTFILES")
        .env("MERGE_DOMAIN_CONFIG", "true")
        .env("RESPONSE_DYNAMIC_METADATA", "true")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port));
    let rlsd = Rlsd::start(command);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");
    let mut ask = async |key: &str, value: &str| {
        client
            .should_rate_limit(request("split", vec![descriptor(&[(key, value)])]))
            .await
            .expect("answer")
            .into_inner()
    };
    // `value: yes` is the string "yes", as envoyproxy/ratelimit reads it: `k=true` has no limit.
    let first = ask("k", "yes").await;
    assert_eq!(codes(&first), (Code::Ok, vec![Code::Ok]));
    assert_eq!(
        first.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(1)
    );
    assert_eq!(codes(&ask("k", "yes").await).0, Code::OverLimit);
    let other = ask("k", "true").await;
    assert!(other.statuses[0].current_limit.is_none(), "{other:?}");
    // `metadata: {x: 1, y: 2}`: `y` is a key spelled y, holding the number 2.
    use prost_types::value::Kind;
    let metadata = first
        .dynamic_metadata
        .as_ref()
        .and_then(|metadata| metadata.fields.get("metadata"))
        .and_then(|metadata| match &metadata.kind {
            Some(Kind::StructValue(fields)) => Some(fields.clone()),
            _ => None,
        })
        .expect("metadata");
    assert_eq!(metadata.fields["y"].kind, Some(Kind::NumberValue(2.0)));
    // The second key's half of the domain: requests_per_unit 0x2.
    let m = ask("m", "any").await;
    assert_eq!(
        m.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(2)
    );
    let log = rlsd.log();
    assert!(!log.contains("ERROR"), "{log}");
}
