//! Answers as envoyproxy/ratelimit (f2fb157) gives them, over real gRPC, with the in-process
//! store and with a real Redis (whose Lua script decides on its own): quota mode, global and
//! per-limit, global shadow mode, and the response's dynamic metadata.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{T0, descriptor, request, spawn_server};
use rlsd::clock::ManualClock;
use rlsd::pb::rate_limit_descriptor::RateLimitOverride;
use rlsd::pb::rate_limit_response::Code;
use rlsd::pb::{RateLimitRequest, RateLimitResponse, RateLimitServiceClient, RateLimitUnit};
use rlsd::service::{FailureMode, ServiceSettings};
use rlsd::store::{MemoryStore, RedisSettings, RedisStore};
use rlsd_testkit::redis::RedisServer;
use serde_json::json;

const LIMITS: &str = r#"
domain: answers
descriptors:
  - key: user
    metadata: {team: users, limits: {user: 2}}
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: route
    metadata: {team: routes, owner: edge, limits: {route: 100}}
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: free
    metadata: {team: free}
    rate_limit: {unlimited: true}
  - key: trial
    shadow_mode: true
    metadata: {trial: true}
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: gpu
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: spot
    quota_mode: true
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

/// Where a test server keeps its counters.
#[derive(Clone, Copy, Debug)]
enum Backend {
    Memory,
    Redis,
}

/// [`LIMITS`] served with `settings` on `backend`, its clock stopped at [`T0`].
struct Server {
    grpc: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
    redis: Option<RedisServer>,
}

impl Server {
    async fn start(backend: Backend, settings: ServiceSettings) -> Server {
        let clock = ManualClock::at(T0);
        let (grpc, redis, stop, task) = match backend {
            Backend::Memory => {
                let store = Arc::new(MemoryStore::with_clock(1_000, clock));
                let (grpc, _http, stop, task) = spawn_server(LIMITS, store, settings).await;
                (grpc, None, stop, task)
            }
            Backend::Redis => {
                let redis = RedisServer::start();
                let mut redis_settings = RedisSettings::new(redis.url());
                // Generous: debug builds on a loaded machine; timeouts are tested elsewhere.
                redis_settings.command_timeout = Duration::from_secs(2);
                redis_settings.fixed_clock = Some(Arc::new(clock));
                redis_settings.lanes = common::LANES;
                let store = Arc::new(RedisStore::connect(redis_settings).await.expect("connect"));
                let (grpc, _http, stop, task) = spawn_server(LIMITS, store, settings).await;
                (grpc, Some(redis), stop, task)
            }
        };
        Server {
            grpc,
            stop,
            task,
            redis,
        }
    }

    async fn ask(&self, request: RateLimitRequest) -> RateLimitResponse {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect")
            .should_rate_limit(request)
            .await
            .expect("answer")
            .into_inner()
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("server task");
    }
}

fn code(value: i32) -> Code {
    Code::try_from(value).expect("a known code")
}

/// The overall code and each status's code.
fn codes(response: &RateLimitResponse) -> (Code, Vec<Code>) {
    (
        code(response.overall_code),
        response.statuses.iter().map(|s| code(s.code)).collect(),
    )
}

fn remaining(response: &RateLimitResponse) -> Vec<u32> {
    response
        .statuses
        .iter()
        .map(|s| s.limit_remaining)
        .collect()
}

fn header<'r>(response: &'r RateLimitResponse, name: &str) -> Option<&'r str> {
    response
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

use Code::{Ok as Pass, OverLimit as Over};

/// `QUOTA_MODE=true`: every descriptor is a quota, and quotas deny only when all are over. A
/// descriptor no limit applies to counts as a quota with room, as in envoyproxy/ratelimit.
async fn every_limit_in_quota_mode(backend: Backend) {
    let settings = ServiceSettings {
        quota_mode: true,
        ..Default::default()
    };
    let server = Server::start(backend, settings).await;
    let both = || {
        request(
            "answers",
            vec![
                descriptor(&[("user", "ann")]),
                descriptor(&[("route", "/a")]),
            ],
        )
    };
    let mut answers = Vec::new();
    for _ in 0..3 {
        let response = server.ask(both()).await;
        answers.push((codes(&response), remaining(&response)));
    }
    assert_eq!(
        answers,
        [
            ((Pass, vec![Pass, Pass]), vec![1, 99]),
            ((Pass, vec![Pass, Pass]), vec![0, 98]),
            // The user is over, the route still has room: allowed, and counted on the route.
            ((Pass, vec![Over, Pass]), vec![0, 97]),
        ],
        "{backend:?}"
    );
    // Every quota over: denied, and nothing is counted.
    let alone = server
        .ask(request("answers", vec![descriptor(&[("user", "ann")])]))
        .await;
    assert_eq!(codes(&alone), (Over, vec![Over]), "{backend:?}");
    // The user over beside a descriptor no limit applies to: allowed.
    let unmatched = server
        .ask(request(
            "answers",
            vec![
                descriptor(&[("user", "ann")]),
                descriptor(&[("nothing", "here")]),
            ],
        ))
        .await;
    assert_eq!(codes(&unmatched), (Pass, vec![Over, Pass]), "{backend:?}");
    // Nothing denies, so nothing says to retry.
    assert_eq!(header(&unmatched, "retry-after"), None);
    let after = server.ask(both()).await;
    assert_eq!(remaining(&after), vec![0, 96], "{backend:?}");
    server.stop().await;
}

/// A shadow quota limit counts as a quota with room: the other quotas then deny nothing.
async fn a_shadow_quota_lets_the_other_quotas_through(backend: Backend) {
    let server = Server::start(backend, ServiceSettings::default()).await;
    let both = || {
        request(
            "answers",
            vec![descriptor(&[("gpu", "a")]), descriptor(&[("spot", "b")])],
        )
    };
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(codes(&server.ask(both()).await));
    }
    assert_eq!(
        answers,
        [
            (Pass, vec![Pass, Pass]),
            // Both over; the shadow one reports OK and so has room.
            (Pass, vec![Over, Pass]),
            (Pass, vec![Over, Pass]),
        ],
        "{backend:?}"
    );
    // Alone, the quota denies once it is over.
    let alone = server
        .ask(request("answers", vec![descriptor(&[("gpu", "a")])]))
        .await;
    assert_eq!(codes(&alone), (Over, vec![Over]), "{backend:?}");
    server.stop().await;
}

/// `SHADOW_MODE=true`: every answer is OK, each status still says which limit is over.
async fn global_shadow_mode_keeps_each_status(backend: Backend) {
    let settings = ServiceSettings {
        shadow_mode: true,
        ..Default::default()
    };
    let server = Server::start(backend, settings).await;
    let mut answers = Vec::new();
    for _ in 0..4 {
        let response = server
            .ask(request(
                "answers",
                vec![
                    descriptor(&[("user", "bob")]),
                    descriptor(&[("route", "/b")]),
                    descriptor(&[("trial", "t")]),
                ],
            ))
            .await;
        assert_eq!(header(&response, "retry-after"), None, "{backend:?}");
        answers.push((
            codes(&response),
            remaining(&response),
            header(&response, "x-ratelimit-remaining").map(str::to_owned),
        ));
    }
    let some = |n: &str| Some(n.to_owned());
    assert_eq!(
        answers,
        [
            ((Pass, vec![Pass, Pass, Pass]), vec![1, 99, 0], some("0")),
            ((Pass, vec![Pass, Pass, Pass]), vec![0, 98, 0], some("0")),
            // Over, and counted all the same (the route keeps counting); the trial limit is in
            // shadow mode in the config, so its status stays OK.
            ((Pass, vec![Over, Pass, Pass]), vec![0, 97, 0], some("0")),
            ((Pass, vec![Over, Pass, Pass]), vec![0, 96, 0], some("0")),
        ],
        "{backend:?}"
    );
    server.stop().await;
}

/// A `prost_types::Struct` as JSON, to compare with `json!`.
fn to_json(value: &prost_types::Struct) -> serde_json::Value {
    use prost_types::value::Kind;
    fn one(value: &prost_types::Value) -> serde_json::Value {
        match &value.kind {
            None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
            Some(Kind::NumberValue(n)) => json!(n),
            Some(Kind::StringValue(s)) => json!(s),
            Some(Kind::BoolValue(b)) => json!(b),
            Some(Kind::StructValue(s)) => to_json(s),
            Some(Kind::ListValue(l)) => l.values.iter().map(one).collect(),
        }
    }
    value
        .fields
        .iter()
        .map(|(key, value)| (key.clone(), one(value)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// `RESPONSE_DYNAMIC_METADATA=true`: the request's domain and descriptors, and the `metadata:` of
/// the descriptors that passed, merged first-wins with Structs merged.
async fn dynamic_metadata_as_envoyproxy_ratelimit_sends_it(backend: Backend) {
    let settings = ServiceSettings {
        dynamic_metadata: true,
        ..Default::default()
    };
    let server = Server::start(backend, settings).await;
    let ask = || {
        let mut overridden = descriptor(&[("route", "/d")]);
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 10,
            unit: RateLimitUnit::Minute as i32,
        });
        overridden.hits_addend = Some(1);
        let mut request = request(
            "answers",
            vec![
                descriptor(&[("user", "cat")]),
                descriptor(&[("route", "/c")]),
                descriptor(&[("free", "yes")]),
                descriptor(&[("nothing", "here")]),
                descriptor(&[("trial", "t")]),
                overridden,
            ],
        );
        request.hits_addend = 1;
        request
    };
    let descriptors = json!([
        {"entries": ["user=cat"]},
        {"entries": ["route=/c"]},
        {"entries": ["free=yes"]},
        {"entries": ["nothing=here"]},
        {"entries": ["trial=t"]},
        {"entries": ["route=/d"], "limit": "requests_per_unit:10 unit:MINUTE", "hitsAddend": 1.0},
    ]);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let response = server.ask(ask()).await;
        seen.push((
            code(response.overall_code),
            to_json(&response.dynamic_metadata.expect("dynamic_metadata")),
        ));
    }
    assert_eq!(
        seen,
        [
            (
                Pass,
                json!({
                    "domain": "answers",
                    "descriptors": descriptors,
                    "hitsAddend": 1.0,
                    // The user's team (first), the route's owner; both limits merged. The
                    // unlimited descriptor adds nothing.
                    "metadata": {
                        "team": "users",
                        "owner": "edge",
                        "limits": {"user": 2.0, "route": 100.0},
                        "trial": true,
                    },
                })
            ),
            (
                Pass,
                json!({
                    "domain": "answers",
                    "descriptors": descriptors,
                    "hitsAddend": 1.0,
                    // The trial limit is over, but in shadow mode: it passed.
                    "metadata": {
                        "team": "users",
                        "owner": "edge",
                        "limits": {"user": 2.0, "route": 100.0},
                        "trial": true,
                    },
                })
            ),
            (
                Over,
                json!({
                    "domain": "answers",
                    "descriptors": descriptors,
                    "hitsAddend": 1.0,
                    // The user is over: only what passed.
                    "metadata": {
                        "team": "routes",
                        "owner": "edge",
                        "limits": {"route": 100.0},
                        "trial": true,
                    },
                })
            ),
        ],
        "{backend:?}"
    );
    server.stop().await;

    // Off (envoyproxy/ratelimit's default): none, though the config has metadata.
    let server = Server::start(backend, ServiceSettings::default()).await;
    let response = server
        .ask(request("answers", vec![descriptor(&[("user", "dan")])]))
        .await;
    assert_eq!(response.dynamic_metadata, None, "{backend:?}");
    server.stop().await;
}

/// `--shadow-mode` with `--failure-mode deny`: a store that fails marks every limit over, and
/// still denies nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_shadow_mode_denies_nothing_when_the_store_fails() {
    let settings = ServiceSettings {
        shadow_mode: true,
        failure_mode: FailureMode::Deny,
        ..Default::default()
    };
    let mut server = Server::start(Backend::Redis, settings).await;
    let ask = || request("answers", vec![descriptor(&[("user", "eve")])]);
    assert_eq!(codes(&server.ask(ask()).await), (Pass, vec![Pass]));
    server.redis.as_mut().expect("a redis").kill();
    assert_eq!(codes(&server.ask(ask()).await), (Pass, vec![Over]));
    server.stop().await;
}

#[tokio::test]
async fn every_limit_in_quota_mode_memory() {
    every_limit_in_quota_mode(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_limit_in_quota_mode_redis() {
    every_limit_in_quota_mode(Backend::Redis).await;
}

#[tokio::test]
async fn a_shadow_quota_lets_the_other_quotas_through_memory() {
    a_shadow_quota_lets_the_other_quotas_through(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_quota_lets_the_other_quotas_through_redis() {
    a_shadow_quota_lets_the_other_quotas_through(Backend::Redis).await;
}

#[tokio::test]
async fn global_shadow_mode_keeps_each_status_memory() {
    global_shadow_mode_keeps_each_status(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_shadow_mode_keeps_each_status_redis() {
    global_shadow_mode_keeps_each_status(Backend::Redis).await;
}

#[tokio::test]
async fn dynamic_metadata_as_envoyproxy_ratelimit_sends_it_memory() {
    dynamic_metadata_as_envoyproxy_ratelimit_sends_it(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_metadata_as_envoyproxy_ratelimit_sends_it_redis() {
    dynamic_metadata_as_envoyproxy_ratelimit_sends_it(Backend::Redis).await;
}
