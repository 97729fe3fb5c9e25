//! Config over xDS: the rlsd binary against a real ADS management server (tonic, our own
//! protos), with traffic over real gRPC: first push, update, a refused push, a server restart.

use crate::common;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::pki::{Leaf, Pki};
use common::process::{Rlsd, command_at};
use common::{descriptor, http_get, request};
use prost::Message as _;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use rlsd::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use rlsd::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use rlsd::xds::TYPE_URL;
use rlsd_testkit::redis::{RedisServer, RedisTls};
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, ServerTlsConfig};

const WAIT: Duration = Duration::from_secs(20);
const OK: i32 = 1;
const OVER_LIMIT: i32 = 2;

/// What the management server holds and has heard.
#[derive(Default)]
struct State {
    /// The response every stream gets now (its nonce is the version).
    current: Option<DiscoveryResponse>,
    /// Every request received, with the stream's `x-token` header.
    requests: Vec<(DiscoveryRequest, Option<String>)>,
}

#[derive(Clone)]
struct Ads {
    state: Arc<Mutex<State>>,
    pushed: watch::Sender<u64>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<Responses>, tonic::Status> {
        let token = request
            .metadata()
            .get("x-token")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let mut incoming = request.into_inner();
        let (out, responses) = mpsc::channel(4);
        let ads = self.clone();
        tokio::spawn(async move {
            let mut pushed = ads.pushed.subscribe();
            let mut sent: Option<String> = None;
            loop {
                let due = {
                    let state = ads.state.lock().unwrap();
                    state
                        .current
                        .clone()
                        .filter(|current| sent.as_deref() != Some(current.nonce.as_str()))
                };
                if let Some(response) = due {
                    sent = Some(response.nonce.clone());
                    if out.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    message = incoming.message() => match message {
                        Ok(Some(message)) => {
                            ads.state.lock().unwrap().requests.push((message, token.clone()));
                        }
                        _ => return,
                    },
                    changed = pushed.changed() => if changed.is_err() { return },
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(
            responses,
        ))))
    }
}

/// An ADS server on its own runtime, so stopping it closes every connection, as a restart does.
struct AdsServer {
    ads: Ads,
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl AdsServer {
    fn start(addr: SocketAddr, state: Arc<Mutex<State>>) -> AdsServer {
        AdsServer::start_with(addr, state, None)
    }

    /// Serves over TLS (`tls` holds its identity and, for mutual TLS, the client CA).
    fn start_with(
        addr: SocketAddr,
        state: Arc<Mutex<State>>,
        tls: Option<ServerTlsConfig>,
    ) -> AdsServer {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let ads = Ads {
            state,
            pushed: watch::channel(0).0,
        };
        let listener = runtime.block_on(async {
            let deadline = Instant::now() + WAIT;
            loop {
                match tokio::net::TcpListener::bind(addr).await {
                    Ok(listener) => break listener,
                    Err(error) if Instant::now() < deadline => {
                        eprintln!("binding {addr}: {error}; again");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(error) => panic!("binding {addr}: {error}"),
                }
            }
        });
        let addr = listener.local_addr().unwrap();
        let service = AggregatedDiscoveryServiceServer::new(ads.clone());
        runtime.spawn(async move {
            let mut builder = tonic::transport::Server::builder();
            if let Some(tls) = tls {
                builder = builder.tls_config(tls).unwrap();
            }
            builder
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        AdsServer {
            ads,
            addr,
            runtime: Some(runtime),
        }
    }

    fn push(&self, version: &str, resources: Vec<RateLimitConfig>) {
        self.push_response(response(version, resources));
    }

    fn push_response(&self, response: DiscoveryResponse) {
        self.ads.state.lock().unwrap().current = Some(response);
        self.ads.pushed.send_modify(|count| *count += 1);
    }

    /// Waits for a request matching `wanted`, and returns it.
    fn wait_for(
        &self,
        what: &str,
        wanted: impl Fn(&DiscoveryRequest) -> bool,
    ) -> (DiscoveryRequest, Option<String>) {
        let deadline = Instant::now() + WAIT;
        loop {
            {
                let state = self.ads.state.lock().unwrap();
                if let Some(found) = state.requests.iter().find(|(request, _)| wanted(request)) {
                    return found.clone();
                }
                assert!(
                    Instant::now() < deadline,
                    "no {what} within {WAIT:?}; requests: {:#?}",
                    state.requests
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server: every connection closes.
    fn stop(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

fn response(version: &str, resources: Vec<RateLimitConfig>) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: version.to_owned(),
        resources: resources
            .iter()
            .map(|resource| prost_types::Any {
                type_url: TYPE_URL.to_owned(),
                value: resource.encode_to_vec(),
            })
            .collect(),
        type_url: TYPE_URL.to_owned(),
        nonce: format!("nonce-{version}"),
        ..DiscoveryResponse::default()
    }
}

/// Domain `xds` with `key` limited to `per_minute` (unit UNKNOWN: a refused config).
fn limits(key: &str, per_minute: u32, unit: RateLimitUnit) -> Vec<RateLimitConfig> {
    vec![RateLimitConfig {
        name: "xds-limits".to_owned(),
        domain: "xds".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            key: key.to_owned(),
            rate_limit: Some(RateLimitPolicy {
                unit: unit as i32,
                requests_per_unit: per_minute,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }],
    }]
}

fn is_ack(version: &str) -> impl Fn(&DiscoveryRequest) -> bool {
    let version = version.to_owned();
    move |request| {
        request.version_info == version
            && request.response_nonce == format!("nonce-{version}")
            && request.error_detail.is_none()
    }
}

/// The codes of `count` calls for `key=v` in domain `xds`.
fn codes(rlsd: &Rlsd, key: &str, count: usize) -> Vec<i32> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
            .await
            .expect("connect");
        let mut codes = Vec::new();
        for _ in 0..count {
            let answer = client
                .should_rate_limit(request("xds", vec![descriptor(&[(key, "v")])]))
                .await
                .expect("answer")
                .into_inner();
            codes.push(answer.overall_code);
        }
        codes
    })
}

fn rlconfig(rlsd: &Rlsd) -> String {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(http_get(rlsd.http, "/rlconfig")).1
}

/// Polls until rlsd's log contains `needle`.
fn wait_for_log(rlsd: &Rlsd, needle: &str) {
    let deadline = Instant::now() + WAIT;
    while !rlsd.log().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "log never showed {needle:?}:\n{}",
            rlsd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn pushed_limits_are_enforced_updated_refused_and_kept_across_a_server_restart() {
    let server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    server.push("1", limits("first", 2, RateLimitUnit::Minute));
    let addr = server.addr.to_string();
    let rlsd = Rlsd::serve([
        "--config-xds",
        &addr,
        "--xds-node-id",
        "test-node",
        "--xds-node-metadata",
        "zone:a,team=edge",
        "--xds-headers",
        "x-token:secret",
        "--xds-retry-interval-ms",
        "200",
    ]);

    // First push: subscribed as the node it was told to be, ACKed, enforced.
    let (subscribe, token) = server.wait_for("subscription", |request| {
        request.version_info.is_empty() && request.response_nonce.is_empty()
    });
    assert_eq!(subscribe.type_url, TYPE_URL);
    let node = subscribe.node.expect("a node");
    assert_eq!(node.id, "test-node");
    let metadata = node.metadata.expect("node metadata");
    let zone = metadata.fields.get("zone").and_then(|v| v.kind.clone());
    assert_eq!(
        zone,
        Some(prost_types::value::Kind::StringValue("a".to_owned()))
    );
    assert!(metadata.fields.contains_key("team"));
    assert_eq!(token.as_deref(), Some("secret"));
    server.wait_for("ACK of version 1", is_ack("1"));
    assert_eq!(codes(&rlsd, "first", 3), [OK, OK, OVER_LIMIT]);
    let shown = rlconfig(&rlsd);
    assert!(shown.contains("xds.first: 2 per minute"), "{shown}");
    assert!(
        shown.starts_with("# xds: xds:xds-limits version 1\n"),
        "{shown}"
    );

    // An update replaces the whole config.
    server.push("2", limits("second", 1, RateLimitUnit::Minute));
    server.wait_for("ACK of version 2", is_ack("2"));
    assert_eq!(codes(&rlsd, "second", 2), [OK, OVER_LIMIT]);
    assert_eq!(codes(&rlsd, "first", 3), [OK, OK, OK], "first is gone");

    // A bad push is NACKed with the reason, and version 2 keeps serving.
    server.push("3", limits("third", 1, RateLimitUnit::Unknown));
    let (nack, _) = server.wait_for("NACK of version 3", |request| {
        request.response_nonce == "nonce-3" && request.error_detail.is_some()
    });
    assert_eq!(nack.version_info, "2", "a NACK names the last good version");
    let reason = nack.error_detail.unwrap().message;
    assert!(reason.contains("xds:xds-limits"), "{reason}");
    assert_eq!(codes(&rlsd, "second", 1), [OVER_LIMIT]);
    assert_eq!(codes(&rlsd, "third", 3), [OK, OK, OK]);

    // Garbage and a wrong type are refused the same way, and change nothing.
    let mut wrong = response("4", limits("fourth", 1, RateLimitUnit::Minute));
    wrong.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_owned();
    server.push_response(wrong);
    server.wait_for("NACK of a wrong type", |request| {
        request.response_nonce == "nonce-4" && request.error_detail.is_some()
    });
    let mut garbage = response("5", Vec::new());
    garbage.resources.push(prost_types::Any {
        type_url: TYPE_URL.to_owned(),
        value: vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
    });
    server.push_response(garbage);
    server.wait_for("NACK of garbage", |request| {
        request.response_nonce == "nonce-5" && request.error_detail.is_some()
    });
    assert_eq!(codes(&rlsd, "second", 1), [OVER_LIMIT]);

    // The server goes away: rlsd keeps its config, and resubscribes with version 2 when the
    // server is back on the same address.
    let addr = server.addr;
    server.stop();
    wait_for_log(&rlsd, "xDS stream lost");
    assert_eq!(codes(&rlsd, "second", 1), [OVER_LIMIT]);
    let server = AdsServer::start(addr, Arc::default());
    server.wait_for("resubscription with version 2", |request| {
        request.version_info == "2" && request.response_nonce.is_empty()
    });
    server.push("6", limits("sixth", 1, RateLimitUnit::Hour));
    server.wait_for("ACK of version 6", is_ack("6"));
    assert_eq!(codes(&rlsd, "sixth", 2), [OK, OVER_LIMIT]);
    wait_for_log(&rlsd, "version=6");
    server.stop();
}

#[test]
fn rlsd_waits_for_the_first_config_unless_forced_to_start() {
    let server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    let addr = server.addr.to_string();
    let pusher = {
        let server_state = Arc::clone(&server.ads.state);
        let pushed = server.ads.pushed.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            server_state.lock().unwrap().current =
                Some(response("1", limits("late", 1, RateLimitUnit::Minute)));
            pushed.send_modify(|count| *count += 1);
        })
    };
    let started = Instant::now();
    let rlsd = Rlsd::serve(["--config-xds", &addr]);
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "serving before the first config arrived:\n{}",
        rlsd.log()
    );
    pusher.join().unwrap();
    assert_eq!(codes(&rlsd, "late", 2), [OK, OVER_LIMIT]);

    // Forced: serving at once with every domain unknown, limits once they arrive.
    let forced_server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    let addr = forced_server.addr.to_string();
    let forced = Rlsd::serve(["--config-xds", &addr, "--xds-force-start"]);
    assert_eq!(codes(&forced, "late", 3), [OK, OK, OK]);
    forced_server.push("1", limits("late", 1, RateLimitUnit::Minute));
    forced_server.wait_for("ACK of version 1", is_ack("1"));
    assert_eq!(codes(&forced, "late", 2), [OK, OVER_LIMIT]);
    server.stop();
    forced_server.stop();
}

/// `ratelimit` with exactly the environment Envoy Gateway gives it: limits over xDS with mutual
/// TLS, gRPC served over TLS, Redis over TLS with a client certificate, metrics on
/// PROMETHEUS_ADDR. One `tls.crt` serves and connects, as Envoy Gateway mounts one secret.
/// Only addresses (loopback, free ports) and the Redis ACL user and CA are the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_serves_with_envoy_gateways_environment_over_tls() {
    let pki = Pki::new();
    let ca = pki.ca("envoy-gateway-ca");
    let own = pki.issue(&ca, "envoy-ratelimit", Leaf::ServerAndClient, 2);
    let control_plane = pki.issue(&ca, "envoy-gateway", Leaf::Server, 3);
    let redis_cert = pki.issue(&ca, "redis", Leaf::Server, 4);
    let redis = RedisServer::start_tls(RedisTls {
        cert: redis_cert.cert.clone(),
        key: redis_cert.key.clone(),
        ca: ca.cert.clone(),
        user: "rlsd".to_owned(),
        password: "s3cret".to_owned(),
        client_cert: Some((own.cert.clone(), own.key.clone())),
    });
    let state = Arc::new(Mutex::new(State::default()));
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(
            control_plane.cert_pem(),
            control_plane.key_pem(),
        ))
        .client_ca_root(Certificate::from_pem(ca.cert_pem()));
    let server = tokio::task::block_in_place(|| {
        AdsServer::start_with("127.0.0.1:0".parse().unwrap(), state, Some(tls))
    });
    server.push("1", limits("gateway", 2, RateLimitUnit::Minute));

    let bin = tempfile::tempdir().unwrap();
    let ratelimit = bin.path().join("ratelimit");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_rlsd"), &ratelimit).unwrap();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .unwrap()
        .port();
    let (cert, key, ca_cert) = (
        own.cert.display().to_string(),
        own.key.display().to_string(),
        ca.cert.display().to_string(),
    );
    let mut command = command_at(&ratelimit);
    command.env_clear().envs([
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "false"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", &server.addr.to_string()),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", &format!("127.0.0.1:{}", redis.port)),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CLIENT_CERT", &cert),
        ("REDIS_TLS_CLIENT_KEY", &key),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", &cert),
        ("GRPC_SERVER_TLS_KEY", &key),
        ("GRPC_SERVER_TLS_CA_CERT", &ca_cert),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", &cert),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", &key),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", &ca_cert),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", &format!("127.0.0.1:{metrics_port}")),
        ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
        // The test's own: loopback, free ports, the Redis user and its private CA.
        ("HOST", "127.0.0.1"),
        ("PORT", "0"),
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_PORT", "0"),
        ("DEBUG_HOST", "127.0.0.1"),
        ("DEBUG_PORT", "0"),
        ("REDIS_AUTH", "rlsd:s3cret"),
        ("REDIS_TLS_CACERT", &ca_cert),
    ]);
    let mut rlsd = tokio::task::block_in_place(|| Rlsd::start(command));
    tokio::task::block_in_place(|| {
        server.wait_for("ACK of version 1", is_ack("1"));
        let (request, _) = server.wait_for("the subscription", |_| true);
        assert_eq!(request.node.expect("node").id, "envoy-ratelimit");
    });

    let channel = Channel::from_shared(format!("https://{}", rlsd.grpc))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca.cert_pem()))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .expect("TLS connect");
    let mut client = RateLimitServiceClient::new(channel);
    // No warm-up: every serving lane connects to Redis (TLS, AUTH, script) before it serves,
    // so the first call is already Redis's.
    let mut answers = Vec::new();
    for _ in 0..3 {
        let answer = client
            .should_rate_limit(request("xds", vec![descriptor(&[("gateway", "v")])]))
            .await
            .expect("answer")
            .into_inner();
        answers.push(answer.overall_code);
    }
    assert_eq!(answers, [OK, OK, OVER_LIMIT]);
    assert_ne!(
        redis.cli(&["DBSIZE"]).as_deref(),
        Some("0"),
        "no key in Redis"
    );

    let metrics_addr: SocketAddr = format!("127.0.0.1:{metrics_port}").parse().unwrap();
    let (status, metrics) = http_get(metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("ratelimit_service_rate_limit_over_limit"),
        "{metrics}"
    );
    let (status, _) = http_get(rlsd.http, "/healthcheck").await;
    assert_eq!(status, 200);
    let (_, shown) = http_get(rlsd.http, "/rlconfig").await;
    assert!(shown.contains("xds.gateway: 2 per minute"), "{shown}");
    drop(client);

    let log = rlsd.log();
    // Envoy Gateway's GRPC_SERVER_TLS_CA_CERT is accepted without a word.
    assert!(!log.contains("GRPC_SERVER_TLS_CA_CERT"), "{log}");
    let status = tokio::task::block_in_place(|| rlsd.terminate(Duration::from_secs(10)));
    assert!(status.success(), "{status:?}");
    server.stop();
}

/// A management server rlsd cannot verify (another CA, or not the pinned name) never sees a
/// subscription and never configures rlsd; rlsd keeps retrying and keeps serving meanwhile.
#[test]
fn an_xds_server_that_fails_verification_configures_nothing() {
    let pki = Pki::new();
    let ca = pki.ca("control-plane-ca");
    let other_ca = pki.ca("another-ca");
    let control_plane = pki.issue(&ca, "envoy-gateway", Leaf::Server, 2);
    let tls = ServerTlsConfig::new().identity(Identity::from_pem(
        control_plane.cert_pem(),
        control_plane.key_pem(),
    ));
    let server = AdsServer::start_with("127.0.0.1:0".parse().unwrap(), Arc::default(), Some(tls));
    server.push("1", limits("guarded", 1, RateLimitUnit::Minute));
    let addr = server.addr.to_string();
    let serve = |ca: &std::path::Path, san: Option<&str>| {
        let mut args = vec![
            "--config-xds".to_owned(),
            addr.clone(),
            "--xds-tls".to_owned(),
            "--xds-tls-ca".to_owned(),
            ca.display().to_string(),
            "--xds-force-start".to_owned(),
            "--xds-retry-interval-ms".to_owned(),
            "100".to_owned(),
        ];
        if let Some(san) = san {
            args.extend(["--xds-tls-san".to_owned(), san.to_owned()]);
        }
        Rlsd::serve(args)
    };

    for (ca, san) in [(&other_ca.cert, None), (&ca.cert, Some("envoy-gateway"))] {
        let rlsd = serve(ca, san);
        // Two failures: the first attempt and a retry after it.
        let deadline = Instant::now() + WAIT;
        while rlsd.log().matches("xDS stream lost").count() < 2 {
            assert!(Instant::now() < deadline, "no retries:\n{}", rlsd.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = rlsd.log();
        assert!(log.to_lowercase().contains("certificate"), "{log}");
        assert_eq!(codes(&rlsd, "guarded", 3), [OK, OK, OK]);
        assert!(
            server.ads.state.lock().unwrap().requests.is_empty(),
            "an unverified server got a subscription (CA {}, SAN {san:?})",
            ca.display()
        );
    }

    // The right CA and a name the certificate has: subscribed and enforced.
    let rlsd = serve(&ca.cert, Some("localhost"));
    server.wait_for("ACK of version 1", is_ack("1"));
    assert_eq!(codes(&rlsd, "guarded", 2), [OK, OVER_LIMIT]);
    server.stop();
}

/// The waits rlsd logged before its reconnects so far, in milliseconds.
fn reconnect_waits(rlsd: &Rlsd) -> Vec<u64> {
    let log = rlsd.log();
    let waits = log.lines().filter(|line| line.contains("xDS reconnect"));
    let wait = |line: &str| {
        line.split("wait_ms=")
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    waits.filter_map(wait).collect()
}

/// While the management server is away the waits double up to the ceiling, and a stream that
/// brought a config starts them again from the interval.
#[test]
fn reconnects_back_off_while_the_server_is_away_and_start_over_after_a_config() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let rlsd = Rlsd::serve([
        "--config-xds",
        &port.to_string(),
        "--xds-force-start",
        "--xds-retry-interval-ms",
        "40",
        "--xds-retry-max-ms",
        "160",
        "--xds-retry-jitter",
        "0",
    ]);
    let deadline = Instant::now() + WAIT;
    while reconnect_waits(&rlsd).len() < 5 {
        assert!(Instant::now() < deadline, "no retries:\n{}", rlsd.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(reconnect_waits(&rlsd)[..5], [40, 80, 160, 160, 160]);

    // The server comes up on that port, configures rlsd, and goes away again.
    let server = AdsServer::start(port, Arc::default());
    server.push("1", limits("back", 1, RateLimitUnit::Minute));
    server.wait_for("ACK of version 1", is_ack("1"));
    let before = reconnect_waits(&rlsd).len();
    server.stop();
    while reconnect_waits(&rlsd).len() < before + 3 {
        assert!(Instant::now() < deadline, "no retries:\n{}", rlsd.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        reconnect_waits(&rlsd)[before..before + 3],
        [40, 40, 80],
        "{}",
        rlsd.log()
    );
}

#[test]
fn health_that_needs_a_config_waits_for_a_pushed_domain_and_turns_when_all_are_dropped() {
    use crate::config_health::wait_for_health;
    let server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    let addr = server.addr.to_string();
    let rlsd = Rlsd::serve([
        "--config-xds",
        &addr,
        "--xds-force-start",
        "--healthy-with-at-least-one-config-loaded",
    ]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(wait_for_health(&rlsd, false));
    server.push("1", limits("late", 1, RateLimitUnit::Minute));
    server.wait_for("ACK of version 1", is_ack("1"));
    runtime.block_on(wait_for_health(&rlsd, true));
    // An empty push is the control plane saying "no limits": every domain goes, as in
    // envoyproxy/ratelimit, and health turns with it.
    server.push("2", Vec::new());
    server.wait_for("ACK of version 2", is_ack("2"));
    runtime.block_on(wait_for_health(&rlsd, false));
    assert_eq!(codes(&rlsd, "late", 2), [OK, OK]);
    server.stop();
}

/// `--xds-max-message-bytes` (envoyproxy/ratelimit's `XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES`): a
/// response larger than it fails the stream and configures nothing; the default takes it.
#[test]
fn a_response_over_the_message_size_configures_nothing() {
    let server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    server.push("1", limits("sized", 1, RateLimitUnit::Minute));
    let size = response("1", limits("sized", 1, RateLimitUnit::Minute)).encoded_len();
    let addr = server.addr.to_string();
    let small = (size - 1).to_string();
    let refusing = Rlsd::serve([
        "--config-xds",
        &addr,
        "--xds-force-start",
        "--xds-max-message-bytes",
        &small,
    ]);
    wait_for_log(&refusing, "xDS stream lost");
    assert!(
        refusing.log().contains("message length too large"),
        "{}",
        refusing.log()
    );
    assert_eq!(codes(&refusing, "sized", 2), [OK, OK], "not configured");
    let fitting = size.to_string();
    let taking = Rlsd::serve(["--config-xds", &addr, "--xds-max-message-bytes", &fitting]);
    assert_eq!(codes(&taking, "sized", 2), [OK, OVER_LIMIT]);
    server.stop();
}

/// Envoy Gateway's response costs over xDS, where the config cannot say anything rlsd-specific:
/// the descriptor's own `hits_addend` is a charge, recorded past the limit, so the next check
/// is over (the sequence AI Gateway's token budgets send).
#[test]
fn a_charge_past_a_limit_pushed_over_xds_is_recorded() {
    let server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    server.push("1", limits("user", 1000, RateLimitUnit::Hour));
    let addr = server.addr.to_string();
    let rlsd = Rlsd::serve(["--config-xds", &addr]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answers = runtime.block_on(async {
        let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
            .await
            .expect("connect");
        let mut answers = Vec::new();
        for cost in [0, 800, 0, 500, 0] {
            let mut d = descriptor(&[("user", "u")]);
            d.hits_addend = Some(cost);
            let answer = client
                .should_rate_limit(request("xds", vec![d]))
                .await
                .expect("answer")
                .into_inner();
            answers.push((answer.overall_code, answer.statuses[0].limit_remaining));
        }
        answers
    });
    assert_eq!(
        answers,
        [
            (OK, 1000),
            (OK, 200),
            (OK, 200),
            (OVER_LIMIT, 0),
            (OVER_LIMIT, 0)
        ]
    );
    server.stop();
}

/// `--default-charge always` (`RLSD_DEFAULT_CHARGE`) gives limits pushed over xDS, which cannot
/// say `charge:`, envoyproxy/ratelimit's counting: a denied request's hits are recorded too.
/// Without it, the denied request takes nothing.
#[test]
fn the_default_charge_applies_to_limits_pushed_over_xds() {
    let server = AdsServer::start("127.0.0.1:0".parse().unwrap(), Arc::default());
    server.push("1", limits("user", 10, RateLimitUnit::Hour));
    let addr = server.addr.to_string();
    let remaining = |rlsd: &Rlsd| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
                .await
                .expect("connect");
            let mut answers = Vec::new();
            for hits in [8, 5, 1] {
                let mut req = request("xds", vec![descriptor(&[("user", "u")])]);
                req.hits_addend = hits;
                let answer = client
                    .should_rate_limit(req)
                    .await
                    .expect("answer")
                    .into_inner();
                answers.push((answer.overall_code, answer.statuses[0].limit_remaining));
            }
            answers
        })
    };
    let always = Rlsd::serve(["--config-xds", &addr, "--default-charge", "always"]);
    assert_eq!(
        remaining(&always),
        [(OK, 2), (OVER_LIMIT, 0), (OVER_LIMIT, 0)],
        "the 5 were recorded"
    );
    let default = Rlsd::serve_with(["--config-xds", &addr], |command| {
        command.env("RLSD_DEFAULT_CHARGE", "descriptor_hits");
    });
    assert_eq!(
        remaining(&default),
        [(OK, 2), (OVER_LIMIT, 2), (OK, 1)],
        "all or nothing: the 5 took nothing"
    );
    server.stop();
}
