//! The same calls to rlsd and to the reference, envoyproxy/ratelimit (f2fb157, runnable in
//! `../shared/peers/envoyproxy-ratelimit`), each on its own redis-server: where rlsd answers as
//! the reference does (a descriptor with an empty key or no entries), where it refuses as it does
//! (an empty domain or descriptor list), and the reference's bugs rlsd does not copy. The
//! reference half of each test is skipped, saying so, when `../shared` is absent; rlsd's half
//! always runs.

use crate::common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{descriptor, request, spawn_server};
use rlsd::pb::rate_limit_descriptor::RateLimitOverride;
use rlsd::pb::rate_limit_response::Code;
use rlsd::pb::{
    RateLimitDescriptor, RateLimitRequest, RateLimitResponse, RateLimitServiceClient, RateLimitUnit,
};
use rlsd::service::ServiceSettings;
use rlsd::store::{RedisSettings, RedisStore};
use rlsd_testkit::redis::RedisServer;
use tonic::transport::Channel;

/// `run.sh` of the reference, found in a `shared/peers` directory beside the checkout or one of
/// its parents (a worktree sits a level deeper than the main checkout).
fn reference_script() -> Option<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let found = here
        .ancestors()
        .skip(1)
        .map(|dir| dir.join("shared/peers/envoyproxy-ratelimit/run.sh"))
        .find(|script| script.is_file() && script.with_file_name("bin/ratelimit").is_file());
    if found.is_none() {
        eprintln!(
            "skipping the reference half: ../shared/peers/envoyproxy-ratelimit is absent (a plain clone)"
        );
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// The reference serving one config file, on its own redis-server; killed when dropped.
pub struct Reference {
    child: Child,
    _redis: RedisServer,
    _dir: tempfile::TempDir,
    /// Its gRPC address.
    pub grpc: SocketAddr,
}

impl Reference {
    /// The reference serving `yaml` with `env` added to run.sh's, or `None` when it is absent.
    pub fn start(yaml: &str, env: &[(&str, &str)]) -> Option<Reference> {
        let script = reference_script()?;
        let dir = tempfile::tempdir().expect("a config directory");
        let config = dir.path().join("config");
        std::fs::create_dir(&config).expect("config dir");
        std::fs::write(config.join("config.yaml"), yaml).expect("config file");
        let redis = RedisServer::start();
        let (grpc, http, debug) = (free_port(), free_port(), free_port());
        let mut command = Command::new(script);
        command
            .arg(&config)
            .arg(format!("127.0.0.1:{}", redis.port))
            .args([grpc, http, debug].map(|port| port.to_string()))
            .args(env.iter().map(|(name, value)| format!("{name}={value}")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = command.spawn().expect("run the reference");
        let reference = Reference {
            child,
            _redis: redis,
            _dir: dir,
            grpc: SocketAddr::from(([127, 0, 0, 1], grpc)),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(reference.grpc).is_err() {
            assert!(Instant::now() < deadline, "the reference never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(reference)
    }

    /// A client of it.
    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect to the reference")
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// rlsd serving `yaml` on a real Redis, as the reference does; a client and what keeps it up.
async fn rlsd(yaml: &str) -> (RateLimitServiceClient<Channel>, impl Drop) {
    let redis = RedisServer::start();
    let mut settings = RedisSettings::new(redis.url());
    settings.command_timeout = Duration::from_secs(2);
    let store = Arc::new(RedisStore::connect(settings).await.expect("connect"));
    let (grpc, _http, stop, _task) = spawn_server(yaml, store, ServiceSettings::default()).await;
    let client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    /// Stops the server, then the Redis under it.
    struct Up(Option<tokio::sync::oneshot::Sender<()>>, RedisServer);
    impl Drop for Up {
        fn drop(&mut self) {
            if let Some(stop) = self.0.take() {
                let _ = stop.send(());
            }
            self.1.kill();
        }
    }
    (client, Up(Some(stop), redis))
}

/// One answer, or the gRPC code of the refusal.
async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> Result<RateLimitResponse, tonic::Code> {
    client
        .should_rate_limit(request)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| status.code())
}

fn code(value: i32) -> Code {
    Code::try_from(value).expect("a known code")
}

/// A config with the shapes the reference's bugs need.
const LIMITS: &str = r#"
domain: probe
descriptors:
  - key: k
    metadata: {team: kay, nested: {a: 1}}
    rate_limit: {unit: hour, requests_per_unit: 200}
  - key: m
    metadata: {owner: edge, nested: {b: 2}}
    rate_limit: {unit: hour, requests_per_unit: 200}
  - key: ab
    value: x_y
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: wild
    value: "foo*"
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: w
    value: "a*"
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: w
    value: "ab*"
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: small
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: big
    rate_limit: {unit: hour, requests_per_unit: 100}
"#;

/// rlsd on Redis and, when it is here, the reference, each serving [`LIMITS`] with
/// `reference_env`.
async fn both(
    reference_env: &[(&str, &str)],
) -> (
    RateLimitServiceClient<Channel>,
    impl Drop,
    Option<(RateLimitServiceClient<Channel>, Reference)>,
) {
    let (rlsd, up) = rlsd(LIMITS).await;
    let reference = match Reference::start(LIMITS, reference_env) {
        Some(reference) => Some((reference.client().await, reference)),
        None => None,
    };
    (rlsd, up, reference)
}

/// The overall code, and each status's code, remaining and whether it carries a limit.
type Shape = (Code, Vec<(Code, u32, bool)>);

fn shape(response: &RateLimitResponse) -> Shape {
    (
        code(response.overall_code),
        response
            .statuses
            .iter()
            .map(|s| (code(s.code), s.limit_remaining, s.current_limit.is_some()))
            .collect(),
    )
}

fn overridden(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    let mut d = descriptor(entries);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 3,
        unit: RateLimitUnit::Hour as i32,
    });
    d
}

/// A descriptor with an empty key, or with no entries, is answered OK without a limit, by
/// both, and the rest of the call is decided as usual; an override still applies to one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_without_a_key_are_answered_as_the_reference_answers_them() {
    let (mut rlsd, _up, mut reference) = both(&[]).await;
    let unlimited = (Code::Ok, 0, false);
    let cases: [(RateLimitRequest, Shape); 6] = [
        (
            request("probe", vec![descriptor(&[("", "x")])]),
            (Code::Ok, vec![unlimited]),
        ),
        (
            request("probe", vec![descriptor(&[("k", "v"), ("", "x")])]),
            (Code::Ok, vec![unlimited]),
        ),
        (
            request("probe", vec![descriptor(&[])]),
            (Code::Ok, vec![unlimited]),
        ),
        (
            request(
                "probe",
                vec![
                    descriptor(&[("k", "v")]),
                    descriptor(&[("", "x")]),
                    descriptor(&[]),
                ],
            ),
            (Code::Ok, vec![(Code::Ok, 199, true), unlimited, unlimited]),
        ),
        (
            request("probe", vec![overridden(&[])]),
            (Code::Ok, vec![(Code::Ok, 2, true)]),
        ),
        (
            request("probe", vec![overridden(&[("", "x")])]),
            (Code::Ok, vec![(Code::Ok, 2, true)]),
        ),
    ];
    for (req, want) in cases {
        let got = ask(&mut rlsd, req.clone()).await.map(|r| shape(&r));
        assert_eq!(got, Ok(want.clone()), "rlsd: {req:?}");
        if let Some((reference, _)) = &mut reference {
            let theirs = ask(reference, req.clone()).await.map(|r| shape(&r));
            assert_eq!(theirs, Ok(want), "reference: {req:?}");
        }
    }
}

/// An empty domain or an empty descriptor list is refused by both: rlsd says INVALID_ARGUMENT,
/// the reference UNKNOWN; Envoy treats the two alike (its failure mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_domain_or_descriptor_list_is_refused_by_both() {
    let (mut rlsd, _up, mut reference) = both(&[]).await;
    for req in [
        request("", vec![descriptor(&[("k", "v")])]),
        request("probe", vec![]),
    ] {
        assert_eq!(
            ask(&mut rlsd, req.clone()).await.map(|r| shape(&r)),
            Err(tonic::Code::InvalidArgument)
        );
        if let Some((reference, _)) = &mut reference {
            assert_eq!(
                ask(reference, req).await.map(|r| shape(&r)),
                Err(tonic::Code::Unknown)
            );
        }
    }
}

/// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true` is not rlsd's all or nothing: the reference
/// still increments the key that goes over (only the request's other keys are spared), so hits
/// of a denied request stay counted there; rlsd counts none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_cache_key_increment_still_counts_the_key_that_went_over() {
    let (mut rlsd, _up, mut reference) =
        both(&[("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "true")]).await;
    let with_hits = |hits, descriptors| {
        let mut req = request("probe", descriptors);
        req.hits_addend = hits;
        req
    };
    let pair = || vec![descriptor(&[("small", "s")]), descriptor(&[("big", "s")])];
    let small = || request("probe", vec![descriptor(&[("small", "s")])]);
    let big = || request("probe", vec![descriptor(&[("big", "s")])]);
    // 8 of 10, then 5 more: denied by `small`, which rlsd leaves at 8 (2 remaining).
    let first = with_hits(8, pair());
    let second = with_hits(5, pair());
    let ok_first = (Code::Ok, vec![(Code::Ok, 2, true), (Code::Ok, 92, true)]);
    assert_eq!(
        ask(&mut rlsd, first.clone()).await.map(|r| shape(&r)),
        Ok(ok_first.clone())
    );
    assert_eq!(
        ask(&mut rlsd, second.clone()).await.map(|r| shape(&r)),
        Ok((
            Code::OverLimit,
            vec![(Code::OverLimit, 2, true), (Code::Ok, 92, true)]
        ))
    );
    // `big` was spared; `small` kept its 8, so one more passes.
    assert_eq!(
        ask(&mut rlsd, big()).await.map(|r| shape(&r)),
        Ok((Code::Ok, vec![(Code::Ok, 91, true)]))
    );
    assert_eq!(
        ask(&mut rlsd, small()).await.map(|r| shape(&r)),
        Ok((Code::Ok, vec![(Code::Ok, 1, true)])),
        "rlsd counted none of the denied request's hits"
    );
    if let Some((reference, _)) = &mut reference {
        assert_eq!(ask(reference, first).await.map(|r| shape(&r)), Ok(ok_first));
        // `small` at 13 of 10 there.
        assert_eq!(
            ask(reference, second).await.map(|r| shape(&r)),
            Ok((
                Code::OverLimit,
                vec![(Code::OverLimit, 0, true), (Code::Ok, 92, true)]
            ))
        );
        assert_eq!(
            ask(reference, big()).await.map(|r| shape(&r)),
            Ok((Code::Ok, vec![(Code::Ok, 91, true)])),
            "the reference spared `big` too"
        );
        assert_eq!(
            ask(reference, small()).await.map(|r| shape(&r)),
            Ok((Code::OverLimit, vec![(Code::OverLimit, 0, true)])),
            "the reference counted the 5 hits on `small`, the key that went over"
        );
    }
}

// The reference's bugs, each a test that fails if rlsd copied it. Where the reference is here,
// each also shows the bug is real.

/// Bug 1: the reference looks an entry up as `key_value`, so `[ab_x=y]` finds
/// `{key: ab, value: x_y}` and shares its counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bug_key_value_lookup_is_not_copied() {
    let (mut rlsd, _up, mut reference) = both(&[]).await;
    let exact = request("probe", vec![descriptor(&[("ab", "x_y")])]);
    let lookalike = request("probe", vec![descriptor(&[("ab_x", "y")])]);
    assert_eq!(
        ask(&mut rlsd, exact.clone()).await.map(|r| shape(&r)),
        Ok((Code::Ok, vec![(Code::Ok, 0, true)]))
    );
    assert_eq!(
        ask(&mut rlsd, lookalike.clone()).await.map(|r| shape(&r)),
        Ok((Code::Ok, vec![(Code::Ok, 0, false)])),
        "another key: no limit, and not ab=x_y's counter"
    );
    if let Some((reference, _)) = &mut reference {
        ask(reference, exact).await.expect("answered");
        assert_eq!(
            ask(reference, lookalike).await.map(|r| shape(&r)),
            Ok((Code::OverLimit, vec![(Code::OverLimit, 0, true)])),
            "the reference shares the counter"
        );
    }
}

/// Bug 2: the reference matches a wildcard value across the key: `[wild_foo=bar]` matches
/// `{key: wild, value: "foo*"}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bug_wildcards_across_keys_are_not_copied() {
    let (mut rlsd, _up, mut reference) = both(&[]).await;
    let across = request("probe", vec![descriptor(&[("wild_foo", "bar")])]);
    assert_eq!(
        ask(&mut rlsd, across.clone()).await.map(|r| shape(&r)),
        Ok((Code::Ok, vec![(Code::Ok, 0, false)]))
    );
    if let Some((reference, _)) = &mut reference {
        assert_eq!(
            ask(reference, across).await.map(|r| shape(&r)),
            Ok((Code::Ok, vec![(Code::Ok, 0, true)])),
            "the reference applies wild=foo*'s limit"
        );
    }
}

/// Bug 3: a request value that is literally a config pattern (`ab*`) beats config order there:
/// the reference finds the `ab*` node as an exact value; rlsd matches wildcards in config order,
/// so `a*` (1 an hour) applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bug_a_literal_star_beating_config_order_is_not_copied() {
    let (mut rlsd, _up, mut reference) = both(&[]).await;
    let star = request("probe", vec![descriptor(&[("w", "ab*")])]);
    let limit_of = |r: &RateLimitResponse| {
        r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit)
    };
    assert_eq!(
        ask(&mut rlsd, star.clone()).await.map(|r| limit_of(&r)),
        Ok(Some(1))
    );
    if let Some((reference, _)) = &mut reference {
        assert_eq!(
            ask(reference, star).await.map(|r| limit_of(&r)),
            Ok(Some(100)),
            "the reference takes ab* as an exact value"
        );
    }
}

/// Bug 4: the reference merges one request's dynamic metadata into the config's own Structs,
/// so it leaks into later answers: after `[k], [m]`, `[k]` alone carries `m`'s `nested.b`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bug_dynamic_metadata_leaking_is_not_copied() {
    let redis = RedisServer::start();
    let mut settings = RedisSettings::new(redis.url());
    settings.command_timeout = Duration::from_secs(2);
    let store = Arc::new(RedisStore::connect(settings).await.expect("connect"));
    let service = ServiceSettings {
        dynamic_metadata: true,
        ..Default::default()
    };
    let (grpc, _http, stop, _task) = spawn_server(LIMITS, store, service).await;
    let mut rlsd = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let mut reference = match Reference::start(LIMITS, &[("RESPONSE_DYNAMIC_METADATA", "true")]) {
        Some(reference) => Some((reference.client().await, reference)),
        None => None,
    };
    let both_limits = request(
        "probe",
        vec![descriptor(&[("k", "v")]), descriptor(&[("m", "v")])],
    );
    let k = request("probe", vec![descriptor(&[("k", "v")])]);
    // `nested`'s keys in the answer's `metadata`.
    let nested = |r: RateLimitResponse| -> Vec<String> {
        use prost_types::value::Kind;
        let metadata = r
            .dynamic_metadata
            .and_then(|m| m.fields.get("metadata").cloned());
        let Some(Kind::StructValue(metadata)) = metadata.and_then(|v| v.kind) else {
            return Vec::new();
        };
        let Some(Kind::StructValue(nested)) =
            metadata.fields.get("nested").and_then(|v| v.kind.clone())
        else {
            return Vec::new();
        };
        let mut keys: Vec<String> = nested.fields.keys().cloned().collect();
        keys.sort();
        keys
    };
    assert_eq!(
        ask(&mut rlsd, both_limits.clone()).await.map(nested),
        Ok(vec!["a".to_owned(), "b".to_owned()])
    );
    assert_eq!(
        ask(&mut rlsd, k.clone()).await.map(nested),
        Ok(vec!["a".to_owned()]),
        "k's own metadata only"
    );
    if let Some((reference, _)) = &mut reference {
        ask(reference, both_limits).await.expect("answered");
        assert_eq!(
            ask(reference, k).await.map(nested),
            Ok(vec!["a".to_owned(), "b".to_owned()]),
            "the reference leaks m's metadata into k's"
        );
    }
    let _ = stop.send(());
}

/// Bug 5: a descriptor `limit` override with unit `UNKNOWN` panics the reference's whole
/// process, so any client can take it down; rlsd refuses that call and serves the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bug_an_unknown_unit_override_does_not_take_rlsd_down() {
    let (mut rlsd, _up, mut reference) = both(&[]).await;
    let mut bad = descriptor(&[("k", "v")]);
    bad.limit = Some(RateLimitOverride {
        requests_per_unit: 3,
        unit: RateLimitUnit::Unknown as i32,
    });
    let bad = request("probe", vec![bad]);
    let good = request("probe", vec![descriptor(&[("k", "v")])]);
    assert_eq!(
        ask(&mut rlsd, bad.clone()).await.map(|r| shape(&r)),
        Err(tonic::Code::InvalidArgument)
    );
    assert_eq!(
        ask(&mut rlsd, good.clone()).await.map(|r| shape(&r)),
        Ok((Code::Ok, vec![(Code::Ok, 199, true)])),
        "still serving"
    );
    if let Some((reference, mut process)) = reference.take() {
        let mut client = reference;
        assert!(ask(&mut client, bad).await.is_err());
        let status = process.child.wait().expect("the reference exited");
        assert!(
            !status.success(),
            "the reference died of the call: {status}"
        );
        assert!(ask(&mut client, good).await.is_err(), "nobody answers");
    }
}
