//! rlsd with the Redis store, over real gRPC and a real redis-server the test starts: exactness
//! across replicas, TTLs, NOSCRIPT recovery, and outages.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{allowed_of, descriptor, request, spawn_server};
use rlsd::engine::KeySettings;
use rlsd::limit::Algorithm;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::service::{FailureMode, HeaderStyle, ServiceSettings};
use rlsd::store::{RedisSettings, RedisStore};
use rlsd_testkit::redis::RedisServer;
use tonic::transport::Channel;

const EXACT: &str = r#"
domain: exact
descriptors:
  - key: algorithm
    value: fixed_window
    rate_limit: {unit: day, requests_per_unit: 500, algorithm: fixed_window}
  - key: algorithm
    value: sliding_window_log
    rate_limit: {unit: day, requests_per_unit: 500, algorithm: sliding_window_log}
  - key: algorithm
    value: sliding_window_counter
    rate_limit: {unit: day, requests_per_unit: 500, algorithm: sliding_window_counter}
  - key: algorithm
    value: token_bucket
    rate_limit: {unit: day, requests_per_unit: 500, algorithm: token_bucket}
  - key: algorithm
    value: gcra
    rate_limit: {unit: day, requests_per_unit: 500, algorithm: gcra, burst: 500}
"#;

struct Rlsd {
    grpc: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Rlsd {
    async fn start(
        yaml: &str,
        url: &str,
        failure_mode: FailureMode,
        command_timeout: Duration,
    ) -> Rlsd {
        let mut redis = RedisSettings::new(url);
        redis.command_timeout = command_timeout;
        redis.connect_timeout = Duration::from_millis(200);
        redis.lanes = common::LANES;
        let store = Arc::new(RedisStore::connect(redis).await.expect("valid url"));
        let settings = ServiceSettings {
            keys: KeySettings::default(),
            headers: HeaderStyle::XRatelimit,
            failure_mode,
            shadow_mode: false,
            limits: Default::default(),
            ..Default::default()
        };
        let (grpc, _http, stop, task) = spawn_server(yaml, store, settings).await;
        Rlsd { grpc, stop, task }
    }

    /// [`EXACT`] on `redis`, answering errors, with time enough for any call.
    async fn exact(redis: &RedisServer) -> Rlsd {
        Rlsd::start(
            EXACT,
            &redis.url(),
            FailureMode::Error,
            Duration::from_secs(2),
        )
        .await
    }

    /// [`EXACT`] on `redis`, answering errors, with the store's default timeouts.
    async fn exact_by_default(redis: &RedisServer) -> Rlsd {
        Rlsd::start(
            EXACT,
            &redis.url(),
            FailureMode::Error,
            rlsd::store::redis::DEFAULT_COMMAND_TIMEOUT,
        )
        .await
    }

    async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect")
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("server task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_admit_exactly_the_limit_for_every_algorithm() {
    let redis = RedisServer::start();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Rlsd::exact(&redis).await);
    }
    let mut clients = Vec::new();
    for replica in &replicas {
        clients.push(replica.client().await);
    }
    for algorithm in Algorithm::ALL {
        let descriptors = vec![descriptor(&[("algorithm", algorithm.name())])];
        let allowed = allowed_of(&clients, "exact", 100, 10, descriptors).await;
        assert_eq!(
            allowed, 500,
            "{algorithm}: 1000 requests from 100 clients over 3 replicas"
        );
    }

    // Every key the run wrote has an expiry.
    let keys = redis.cli(&["--scan"]).expect("scan");
    let keys: Vec<&str> = keys.lines().collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    for key in keys {
        let ttl: i64 = redis
            .cli(&["PTTL", key])
            .expect("pttl")
            .parse()
            .expect("number");
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
        // The longest-lived is the sliding counter's: two periods plus a second.
        assert!(
            ttl <= 2 * 86_400_000 + 1_000,
            "{key}: TTL {ttl} ms is longer than any algorithm needs"
        );
    }
    for replica in replicas {
        replica.stop().await;
    }
}

/// Two limits of different periods, as in the over-limit cache's bug report.
const TWO_PERIODS: &str = r#"
domain: two
descriptors:
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;

/// Every response to `requests`, from rlsd serving [`TWO_PERIODS`] on `store`.
async fn responses<S: rlsd::store::Store>(
    store: Arc<S>,
    requests: &[Vec<rlsd::pb::RateLimitDescriptor>],
) -> Vec<rlsd::pb::RateLimitResponse> {
    let settings = ServiceSettings {
        keys: KeySettings::default(),
        headers: HeaderStyle::XRatelimit,
        failure_mode: FailureMode::Error,
        shadow_mode: false,
        limits: Default::default(),
        ..Default::default()
    };
    let (grpc, _http, stop, task) = spawn_server(TWO_PERIODS, store, settings).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let mut answers = Vec::new();
    for descriptors in requests {
        answers.push(
            client
                .should_rate_limit(request("two", descriptors.clone()))
                .await
                .expect("answer")
                .into_inner(),
        );
    }
    let _ = stop.send(());
    task.await.expect("server task");
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_over_limit_cache_every_response_is_what_redis_alone_answers() {
    let redis = RedisServer::start();
    let clock = rlsd::clock::ManualClock::at(common::T0 + 17_000_000);
    let store = || {
        let mut settings = RedisSettings::new(redis.url());
        settings.fixed_clock = Some(Arc::new(clock.clone()));
        settings.command_timeout = Duration::from_secs(2);
        settings.lanes = common::LANES;
        RedisStore::connect(settings)
    };
    let both = vec![descriptor(&[("key2", "a")]), descriptor(&[("key3", "a")])];
    let mut requests = vec![both; 13];
    requests.push(vec![descriptor(&[("key3", "a")])]);
    let alone = responses(Arc::new(store().await.expect("connect")), &requests).await;
    redis.cli(&["FLUSHALL"]).expect("flush");
    let cache = Arc::new(rlsd::store::OverLimitCache::with_clock(
        store().await.expect("connect"),
        100,
        clock.clone(),
    ));
    let cached = responses(Arc::clone(&cache), &requests).await;
    for (i, (alone, cached)) in alone.iter().zip(&cached).enumerate() {
        assert_eq!(alone, cached, "call {}", i + 1);
    }
    // Calls 11 to 13 are denied by key3; key2 has taken nothing since call 10.
    let key2 = &cached[12].statuses[0];
    assert_eq!(cached[12].overall_code, Code::OverLimit as i32);
    assert_eq!((key2.code, key2.limit_remaining), (Code::Ok as i32, 10));
    // Only the last request, key3 alone, was a known denial through and through.
    assert_eq!(cache.hits(), 1);
}

/// Asks once and says how long the answer took.
async fn timed_ask(
    client: &mut RateLimitServiceClient<Channel>,
) -> (Result<Code, tonic::Code>, Duration) {
    let started = Instant::now();
    let req = request("exact", vec![descriptor(&[("algorithm", "fixed_window")])]);
    let answer = client
        .should_rate_limit(req)
        .await
        .map(|response| Code::try_from(response.into_inner().overall_code).expect("known code"))
        .map_err(|status| status.code());
    (answer, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_gets_the_failure_mode_answer_and_service_resumes_after_restart() {
    let mut redis = RedisServer::start();
    let timeout = Duration::from_millis(100);
    let modes = [
        (FailureMode::Error, Err(tonic::Code::Unavailable)),
        (FailureMode::Allow, Ok(Code::Ok)),
        (FailureMode::Deny, Ok(Code::OverLimit)),
    ];
    let mut servers = Vec::new();
    for (mode, expected) in modes {
        let rlsd = Rlsd::start(EXACT, &redis.url(), mode, timeout).await;
        let mut client = rlsd.client().await;
        assert_eq!(
            timed_ask(&mut client).await.0,
            Ok(Code::Ok),
            "{mode:?} before the outage"
        );
        servers.push((rlsd, client, expected, mode));
    }

    redis.kill();
    for (_, client, expected, mode) in &mut servers {
        for _ in 0..5 {
            let (answer, took) = timed_ask(client).await;
            assert_eq!(answer, *expected, "{mode:?} while redis is down");
            // A hang detector, not a speed claim: the bound is ten times the timeout.
            assert!(took < timeout * 10, "{mode:?}: answer took {took:?}");
        }
    }

    redis.restart();
    for (_, client, _, mode) in &mut servers {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if timed_ask(client).await.0 == Ok(Code::Ok) {
                // Answered by Redis again, not by the failure mode: the counter moved.
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{mode:?}: service did not resume after restart"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let keys = redis.cli(&["--scan"]).expect("scan");
    assert!(!keys.is_empty(), "state is written to the restarted redis");
    for (rlsd, ..) in servers {
        rlsd.stop().await;
    }
}

/// How many times Redis has served `command` (lower case, as in `cmdstat_evalsha`), from
/// INFO commandstats; scripts' own calls count too.
fn command_calls(redis: &RedisServer, command: &str) -> u64 {
    let stats = redis.cli(&["INFO", "commandstats"]).expect("info");
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .and_then(|calls| calls.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_coalesced_and_stay_exact() {
    let redis = RedisServer::start();
    let rlsd = Rlsd::exact(&redis).await;
    let client = rlsd.client().await;
    let before = command_calls(&redis, "evalsha");
    let sets_before = command_calls(&redis, "set");
    let descriptors = vec![
        descriptor(&[("algorithm", "sliding_window_log")]),
        descriptor(&[("algorithm", "token_bucket")]),
    ];
    let allowed = allowed_of(&[client], "exact", 64, 20, descriptors).await;
    assert_eq!(allowed, 500, "1280 two-limit requests, both limits 500");
    let calls = command_calls(&redis, "evalsha") - before;
    assert!(
        calls < 1280,
        "{calls} EVALSHA calls for 1280 concurrent requests: nothing was coalesced"
    );
    // The token bucket's key is the one string key every request shares: each call writes it
    // once, however many of its requests took from it (the log's writes are ZADDs).
    let sets = command_calls(&redis, "set") - sets_before;
    assert!(
        sets <= calls,
        "{sets} SETs of one shared key in {calls} calls deciding 500 allowed requests"
    );
    rlsd.stop().await;
}

/// Connections served on different lanes reach Redis through each lane's own connection, and
/// their requests still count against one limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lane_opens_its_own_connection_and_the_limit_stays_exact() {
    let redis = RedisServer::start();
    let rlsd = Rlsd::exact(&redis).await;
    // Each lane connects before it serves, so its first requests need not fit a connect into
    // their command timeout.
    let rlsd_connections = || {
        let list = redis.cli(&["CLIENT", "LIST"]).expect("client list");
        // redis-cli's own connection is listed too.
        (list.lines().count() - 1, list)
    };
    // The server starts on its own task: wait for it, still sending nothing.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (before_traffic, list) = rlsd_connections();
        if before_traffic == 1 + common::LANES {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "one shared connection (script load, health) and one per lane, before any \
             request; found:\n{list}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Connections go to the lanes in turn: four of them reach both lanes.
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(rlsd.client().await);
    }
    let descriptors = vec![descriptor(&[("algorithm", "gcra")])];
    let allowed = allowed_of(&clients, "exact", 40, 20, descriptors).await;
    assert_eq!(
        allowed, 500,
        "800 requests over four connections, limit 500"
    );
    let (after_traffic, list) = rlsd_connections();
    assert_eq!(
        after_traffic,
        1 + common::LANES,
        "no more after traffic:\n{list}"
    );
    rlsd.stop().await;
}

#[test]
fn one_call_writes_a_shared_key_once_with_its_final_state() {
    let redis = RedisServer::start();
    let yaml = "domain: t\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: token_bucket}\n";
    let domain = rlsd::config::load_str("t.yaml", yaml).expect("config");
    let mut config = rlsd::config::Config::default();
    config.domains.insert(domain.name.clone(), domain);
    let request = rlsd::engine::Request {
        domain: "t".to_owned(),
        descriptors: vec![rlsd::engine::Descriptor {
            entries: vec![("k".to_owned(), "v".to_owned())],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    let plan = rlsd::engine::plan(&config, &request, &KeySettings::default());
    let checks = plan.checks.as_slice();
    redis
        .cli(&["SCRIPT", "LOAD", rlsd::store::redis::SCRIPT])
        .expect("script loads");
    let mut connection = redis::Client::open(redis.url())
        .and_then(|client| client.get_connection())
        .expect("connect");
    let remaining = |reply: String| -> Vec<u64> {
        // The reply starts with the script's clock.
        let numbers: Vec<u64> = reply
            .split(' ')
            .skip(1)
            .map(|n| n.parse().expect("a number"))
            .collect();
        numbers.chunks(3).map(|check| check[1]).collect()
    };

    // Three requests on one key in one call: each sees the one before, and the key is
    // written once.
    let sets = command_calls(&redis, "set");
    let reply: String = rlsd::store::redis::script_command(&[checks, checks, checks], None)
        .query(&mut connection)
        .expect("one call");
    assert_eq!(remaining(reply), [9, 8, 7]);
    assert_eq!(command_calls(&redis, "set") - sets, 1);

    // What was written is the last request's state, with a TTL.
    let reply: String = rlsd::store::redis::script_command(&[checks], None)
        .query(&mut connection)
        .expect("a second call");
    assert_eq!(remaining(reply), [6]);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&checks[0].key)
        .query(&mut connection)
        .expect("pttl");
    assert!(ttl > 0, "the key expires: PTTL {ttl}");
}

/// `request` with Envoy's deadline: `grpc-timeout` set to `timeout` (tonic's client also gives
/// up then, as Envoy does).
fn within(
    req: rlsd::pb::RateLimitRequest,
    timeout: Duration,
) -> tonic::Request<rlsd::pb::RateLimitRequest> {
    let mut req = tonic::Request::new(req);
    let value = format!("{}m", timeout.as_millis());
    req.metadata_mut()
        .insert("grpc-timeout", value.parse().expect("ascii"));
    req
}

/// Asks for one hit of `algorithm` in [`EXACT`]: the verdict and remaining, or the gRPC error.
async fn ask_exact(
    client: &mut RateLimitServiceClient<Channel>,
    algorithm: Algorithm,
    timeout: impl Into<Option<Duration>>,
) -> Result<(Code, u32), tonic::Code> {
    let req = request(
        "exact",
        vec![descriptor(&[("algorithm", algorithm.name())])],
    );
    let req = match timeout.into() {
        Some(timeout) => within(req, timeout),
        None => tonic::Request::new(req),
    };
    let response = client
        .should_rate_limit(req)
        .await
        .map_err(|status| status.code())?
        .into_inner();
    Ok((
        Code::try_from(response.overall_code).expect("known code"),
        response.statuses[0].limit_remaining,
    ))
}

fn signal_redis(redis: &RedisServer, signal: &str) {
    let sent = std::process::Command::new("kill")
        .args([signal, &redis.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success(), "kill {signal}");
}

/// Calls that time out while Redis is stopped are answered by the failure mode; when Redis
/// resumes and runs their queued scripts, those write nothing: the answer was not used, so the
/// quota is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_timed_out_while_redis_was_stopped_leave_no_trace() {
    let redis = RedisServer::start();
    let rlsd = Rlsd::exact_by_default(&redis).await;
    let mut client = rlsd.client().await;
    let envoy = Duration::from_millis(200);
    for algorithm in Algorithm::ALL {
        for _ in 0..3 {
            let answer = ask_exact(&mut client, algorithm, Duration::from_secs(2)).await;
            assert_eq!(answer.map(|a| a.0), Ok(Code::Ok), "{algorithm}");
        }
    }
    signal_redis(&redis, "-STOP");
    let stopped: Vec<_> = Algorithm::ALL
        .into_iter()
        .flat_map(|algorithm| std::iter::repeat_n(algorithm, 20))
        .map(|algorithm| {
            let mut client = client.clone();
            tokio::spawn(async move { ask_exact(&mut client, algorithm, envoy).await })
        })
        .collect();
    tokio::time::sleep(envoy * 2).await;
    for call in stopped {
        // UNAVAILABLE from rlsd's failure mode, or CANCELLED if even that came too late.
        let answer = call.await.expect("task");
        assert!(
            answer.is_err(),
            "no answer while Redis is stopped: {answer:?}"
        );
    }
    signal_redis(&redis, "-CONT");
    // Redis now runs the 100 scripts queued on the connection, each past its deadline.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for algorithm in Algorithm::ALL {
        let answer = ask_exact(&mut client, algorithm, Duration::from_secs(2)).await;
        assert_eq!(
            answer,
            Ok((Code::Ok, 500 - 4)),
            "{algorithm}: only the 4 answered calls count"
        );
    }
    rlsd.stop().await;
}

/// The same exactness as above, with Envoy's budget on every call, while the machine is
/// loaded on purpose (threads spinning on every core): three rlsd processes on one Redis,
/// hundreds of calls in flight, each algorithm admits exactly its limit, and what Redis counted
/// is what was admitted, whichever calls ran out of time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_a_loaded_machine_admit_exactly_the_limit() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const LIMIT: usize = 100;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut yaml = String::from("domain: exact\ndescriptors:\n");
    for algorithm in Algorithm::ALL {
        let burst = if algorithm.takes_burst() {
            format!(", burst: {LIMIT}")
        } else {
            String::new()
        };
        yaml.push_str(&format!(
            "  - key: algorithm\n    value: {0}\n    rate_limit: {{unit: day, requests_per_unit: {LIMIT}, algorithm: {0}{burst}}}\n",
            algorithm.name()
        ));
    }
    std::fs::write(dir.path().join("exact.yaml"), yaml).expect("config");
    let config = dir.path().display().to_string();
    // The callers send no deadline (so this busy test client never gives up on its own), and
    // rlsd gives each call 5 ms, as tight as the old default: many run out of time.
    let replicas: Vec<common::process::Rlsd> = (0..3)
        .map(|_| {
            common::process::Rlsd::serve([
                "--config",
                &config,
                "--redis-url",
                &redis.url(),
                "--redis-command-timeout-ms",
                "5",
            ])
        })
        .collect();
    let mut clients = Vec::new();
    for replica in &replicas {
        clients.push(
            RateLimitServiceClient::connect(format!("http://{}", replica.grpc))
                .await
                .expect("connect"),
        );
    }
    let spinning = Arc::new(AtomicBool::new(true));
    let spinners: Vec<_> = (0..std::thread::available_parallelism().map_or(2, |n| n.get()))
        .map(|_| {
            let spinning = Arc::clone(&spinning);
            std::thread::spawn(move || {
                let mut x = 0_u64;
                while spinning.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005) + 1);
                }
            })
        })
        .collect();
    let mut failed = 0;
    for algorithm in Algorithm::ALL {
        let calls: Vec<_> = (0..300)
            .map(|i| {
                let mut client = clients[i % clients.len()].clone();
                tokio::spawn(async move {
                    let (mut admitted, mut failed) = (0, 0);
                    // Until a denial says the limit is used up.
                    for _ in 0..200 {
                        match ask_exact(&mut client, algorithm, None).await {
                            Ok((Code::Ok, _)) => admitted += 1,
                            Ok(_) => break,
                            Err(_) => failed += 1,
                        }
                    }
                    (admitted, failed)
                })
            })
            .collect();
        let mut admitted = 0;
        for call in calls {
            let (a, f) = call.await.expect("task");
            admitted += a;
            failed += f;
        }
        // Then one at a time until denied: hits of answers that came too late are given back
        // in the background, so wait a little for any still on their way.
        let settled = Instant::now() + Duration::from_secs(2);
        loop {
            match ask_exact(&mut clients[0], algorithm, Duration::from_secs(2)).await {
                Ok((Code::Ok, _)) => admitted += 1,
                Ok(_) if admitted >= LIMIT || Instant::now() > settled => break,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        assert_eq!(
            admitted, LIMIT,
            "{algorithm}: admitted, and counted in Redis, under load"
        );
    }
    spinning.store(false, Ordering::Relaxed);
    for spinner in spinners {
        spinner.join().expect("spinner");
    }
    eprintln!("calls answered by the failure mode under load: {failed}");
}

/// After `SCRIPT FLUSH`, the script goes again with its body in the same call: a caller with a
/// budget still gets its answer, never the failure mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_stays_within_the_callers_budget() {
    let redis = RedisServer::start();
    let rlsd = Rlsd::exact_by_default(&redis).await;
    let client = rlsd.client().await;
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut failed = 0;
                for _ in 0..100 {
                    let answer =
                        ask_exact(&mut client, Algorithm::Gcra, Duration::from_millis(250)).await;
                    failed += usize::from(answer.is_err());
                }
                failed
            })
        })
        .collect();
    for _ in 0..10 {
        assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]).as_deref(), Some("OK"));
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let mut failed = 0;
    for call in calls {
        failed += call.await.expect("task");
    }
    assert_eq!(
        failed, 0,
        "calls answered by the failure mode across 10 flushes"
    );
    rlsd.stop().await;
}

/// A sliding log costs one sorted-set member per request, however many hits it takes; a request
/// larger than the whole limit is answered without writing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_hits_addend_on_a_sliding_log_writes_one_member() {
    let redis = RedisServer::start();
    let yaml = "domain: big\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 100000, algorithm: sliding_window_log}\n";
    let rlsd = Rlsd::start(
        yaml,
        &redis.url(),
        FailureMode::Error,
        Duration::from_secs(2),
    )
    .await;
    let mut client = rlsd.client().await;
    // The request's hits: plain counting (a descriptor's own would be a charge).
    let mut ask = async |value: &str, hits: u32| {
        let mut req = request("big", vec![descriptor(&[("k", value)])]);
        req.hits_addend = hits;
        let response = client
            .should_rate_limit(req)
            .await
            .expect("answer")
            .into_inner();
        (
            Code::try_from(response.overall_code).expect("known code"),
            response.statuses[0].limit_remaining,
        )
    };
    let key = |value: &str| format!("rlsd:_:big:swlc:3600:k={value}");
    assert_eq!(ask("a", 100_000).await, (Code::Ok, 0));
    assert_eq!(redis.cli(&["ZCARD", &key("a")]).as_deref(), Some("1"));
    assert_eq!(ask("a", 1).await, (Code::OverLimit, 0));
    // Over the whole limit: never passes, and nothing is written.
    assert_eq!(ask("b", 100_001).await.0, Code::OverLimit);
    assert_eq!(redis.cli(&["EXISTS", &key("b")]).as_deref(), Some("0"));
    // Requests of several hits each stay one member per request, and count exactly.
    for _ in 0..10 {
        assert_eq!(ask("c", 7_000).await.0, Code::Ok);
    }
    assert_eq!(redis.cli(&["ZCARD", &key("c")]).as_deref(), Some("10"));
    assert_eq!(ask("c", 30_001).await.0, Code::OverLimit);
    assert_eq!(ask("c", 30_000).await, (Code::Ok, 0));
    rlsd.stop().await;
}

/// A TCP forwarder on loopback to the port in `target`, read at each new connection: what a
/// DNS name or a proxy that follows a failover looks like to rlsd.
async fn forwarder(target: Arc<std::sync::atomic::AtomicU16>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let port = target.load(std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    addr
}

/// A master demoted with REPLICAOF keeps its clients connected and answers their writes
/// READONLY; rlsd drops that connection and reconnects, reaching the new master the address
/// now leads to. Without it, every call would fail until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_turned_replica_is_left_for_the_new_master() {
    use rlsd::algorithm::{Hits, Params};
    use rlsd::store::{Check, Store};
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let target = Arc::new(std::sync::atomic::AtomicU16::new(old.port));
    let addr = forwarder(Arc::clone(&target)).await;
    let mut settings = RedisSettings::new(format!("redis://{addr}"));
    settings.command_timeout = Duration::from_secs(2);
    let store = RedisStore::connect(settings).await.expect("connect");
    let check = Check {
        key: "readonly".to_owned(),
        params: Params {
            algorithm: Algorithm::FixedWindow,
            limit: 1_000,
            period_us: 86_400_000_000,
            burst: 1_000,
        },
        hits: Hits::Take(1),
        shadow: false,
        quota_mode: false,
    };
    let decide = || store.decide(std::slice::from_ref(&check));
    for _ in 0..5 {
        decide().await.expect("the master answers");
    }
    // Failover: the new master takes over, the old one follows it, the address moves.
    assert_eq!(new.cli(&["REPLICAOF", "NO", "ONE"]).as_deref(), Some("OK"));
    let port = new.port.to_string();
    assert_eq!(
        old.cli(&["REPLICAOF", "127.0.0.1", &port]).as_deref(),
        Some("OK")
    );
    target.store(new.port, std::sync::atomic::Ordering::SeqCst);
    let mut failed = 0;
    let mut answered = 0;
    // Traffic goes on: calls on the demoted master fail until rlsd has reconnected.
    for _ in 0..200 {
        match decide().await {
            Ok(_) => answered += 1,
            Err(_) => failed += 1,
        }
        if answered == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(answered, 5, "never reconnected ({failed} calls failed)");
    // The call that met READONLY fails, and perhaps one met the old master still loading
    // the new master's (empty) data; never many.
    assert!(failed <= 10, "{failed} calls failed before the reconnect");
    assert_eq!(
        new.cli(&["EXISTS", "readonly"]).as_deref(),
        Some("1"),
        "the new master holds the counter"
    );
}

/// `--redis-expiry-jitter-seconds` (EXPIRATION_JITTER_MAX_SECONDS): each call adds a random
/// 0..N s to the TTL of the keys it writes, so the keys of one window expire spread out; the
/// answers, reset times included, are those of a store without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_jitter_spreads_ttls_within_its_bound_and_changes_no_answer() {
    use rlsd::algorithm::{Hits, Params};
    use rlsd::clock::ManualClock;
    use rlsd::store::{Check, Store};
    const JITTER_S: u64 = 100;
    let clock = ManualClock::at(common::T0 + 7_000_000);
    let store = |redis: &RedisServer, jitter: u64| {
        let mut settings = RedisSettings::new(redis.url());
        settings.command_timeout = Duration::from_secs(2);
        settings.fixed_clock = Some(Arc::new(clock.clone()));
        settings.max_batch = 1;
        settings.expiry_jitter = Duration::from_secs(jitter);
        RedisStore::connect(settings)
    };
    let (jittered_redis, plain_redis) = (RedisServer::start(), RedisServer::start());
    let jittered = store(&jittered_redis, JITTER_S).await.expect("connect");
    let plain = store(&plain_redis, 0).await.expect("connect");
    let hour = 3_600_000_000;
    let check = |key: String, algorithm: Algorithm| Check {
        key,
        params: Params {
            algorithm,
            limit: 5,
            period_us: hour,
            burst: 5,
        },
        hits: Hits::Take(2),
        shadow: false,
        quota_mode: false,
    };
    for algorithm in Algorithm::ALL {
        for i in 0..4 {
            let checks = [
                check(format!("{algorithm}-{i}"), algorithm),
                check(format!("{algorithm}-{i}"), algorithm),
            ];
            assert_eq!(
                jittered.decide(&checks).await.expect("answer"),
                plain.decide(&checks).await.expect("answer"),
                "{algorithm}"
            );
        }
    }
    // Fixed windows of an hour, 7 s in: 3593 s to the window's end, plus the 1 s of slack.
    let base_ms = 3_594_000;
    let mut ttls: Vec<u64> = Vec::new();
    for i in 0..20 {
        let key = format!("ttl-{i}");
        let one = check(key.clone(), Algorithm::FixedWindow);
        jittered
            .decide(std::slice::from_ref(&one))
            .await
            .expect("answer");
        ttls.push(
            jittered_redis
                .cli(&["PTTL", &key])
                .and_then(|ttl| ttl.parse().ok())
                .expect("a TTL"),
        );
    }
    // Real time passes while the test runs, and PTTL counts down with it.
    for ttl in &ttls {
        assert!(
            (base_ms - 10_000..=base_ms + JITTER_S * 1_000).contains(ttl),
            "{ttl} ms outside the bound: {ttls:?}"
        );
    }
    let spread = ttls.iter().max().unwrap_or(&0) - ttls.iter().min().unwrap_or(&0);
    assert!(spread > 5_000, "TTLs barely vary: {ttls:?}");
    plain
        .decide(&[check("plain-ttl".to_owned(), Algorithm::FixedWindow)])
        .await
        .expect("answer");
    let plain_ttl: u64 = plain_redis
        .cli(&["PTTL", "plain-ttl"])
        .and_then(|ttl| ttl.parse().ok())
        .expect("a TTL");
    assert!(
        (base_ms - 10_000..=base_ms).contains(&plain_ttl),
        "{plain_ttl}"
    );
}

/// A one-hit check of a fixed window of `limit` a day on `key`, or a peek at it.
fn day_check(key: &str, limit: u64, hits: rlsd::algorithm::Hits) -> rlsd::store::Check {
    rlsd::store::Check {
        key: key.to_owned(),
        params: rlsd::algorithm::Params {
            algorithm: Algorithm::FixedWindow,
            limit,
            period_us: 86_400_000_000,
            burst: 0,
        },
        hits,
        shadow: false,
        quota_mode: false,
    }
}

/// The store's late-call gauges as `/metrics` publishes them: requests awaited after their
/// callers stopped waiting, and requests let go past the bound.
fn late_gauges(store: &impl rlsd::store::Store) -> (i64, i64) {
    let metrics = rlsd::metrics::Metrics::new(0.8);
    store.report(&metrics);
    (
        metrics.redis_late_requests.get(),
        metrics.redis_late_requests_let_go.get(),
    )
}

/// Waits (up to 10 s, polling) until `done` holds; says whether it did.
async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() > until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// A caller dropped while its call is in flight (its client cancelled) leaves nothing counted:
/// the call is handed to the background, and what Redis committed once it ran is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_dropped_mid_call_has_what_the_call_committed_given_back() {
    use rlsd::algorithm::Hits;
    use rlsd::store::Store;
    let redis = RedisServer::start();
    let mut settings = RedisSettings::new(redis.url());
    settings.timeout_cap = Duration::from_secs(10);
    settings.max_batch = 1;
    let store = Arc::new(RedisStore::connect(settings).await.expect("connect"));
    let take = [day_check("dropped", 10, Hits::Take(1))];
    let peek = [day_check("dropped", 10, Hits::Peek)];
    let remaining = |answer: Result<Vec<rlsd::store::Outcome>, _>| {
        answer.expect("answered")[0].verdict.remaining
    };
    let long = || Some(Instant::now() + Duration::from_secs(10));
    assert_eq!(remaining(store.decide_by(&take, long()).await), 9);
    signal_redis(&redis, "-STOP");
    {
        // Polled once at least, so its call is sent; then its caller goes away.
        let call = store.decide_by(&take, long());
        tokio::pin!(call);
        let waited = tokio::time::timeout(Duration::from_millis(200), &mut call).await;
        assert!(waited.is_err(), "no answer while Redis is stopped");
    }
    assert_eq!(late_gauges(&*store), (1, 0), "the call is awaited");
    signal_redis(&redis, "-CONT");
    // Redis runs it within its deadline, so it commits; the reply comes back to nobody.
    assert!(
        eventually(|| late_gauges(&*store).0 == 0).await,
        "the late call's reply was read"
    );
    // The refund goes out right after the reply: one more round trip at most.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let left = remaining(store.decide_by(&peek, long()).await);
        if left == 9 {
            break;
        }
        assert!(
            Instant::now() < until,
            "the dropped caller's hit stayed counted: {left} left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// With Redis stopped, callers that run out of time leave their calls to the background only
/// up to `max_late_requests`: the rest are let go and counted, and the bound holds however many
/// give up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_late_bound_calls_are_let_go_and_counted() {
    use rlsd::algorithm::Hits;
    use rlsd::store::Store;
    const BOUND: usize = 3;
    const CALLERS: usize = 40;
    let redis = RedisServer::start();
    let mut settings = RedisSettings::new(redis.url());
    settings.command_timeout = Duration::from_millis(100);
    settings.timeout_cap = Duration::from_secs(30);
    settings.max_late_requests = BOUND;
    // Every request its own call, so each one that gives up is one late call.
    settings.max_batch = 1;
    let store = Arc::new(RedisStore::connect(settings).await.expect("connect"));
    let take = [day_check("bounded", 1000, Hits::Take(1))];
    assert!(store.decide_by(&take, None).await.is_ok());
    signal_redis(&redis, "-STOP");
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let store = Arc::clone(&store);
            let take = take.clone();
            tokio::spawn(async move { store.decide_by(&take, None).await })
        })
        .collect();
    for caller in callers {
        let answer = caller.await.expect("task");
        assert!(
            matches!(answer, Err(rlsd::store::StoreError::Timeout(_))),
            "{answer:?}"
        );
    }
    let (held, let_go) = late_gauges(&*store);
    signal_redis(&redis, "-CONT");
    assert_eq!(
        (held, let_go),
        (BOUND as i64, (CALLERS - BOUND) as i64),
        "awaited up to the bound, the rest let go"
    );
    assert!(
        eventually(|| late_gauges(&*store).0 == 0).await,
        "the awaited calls' replies were read"
    );
    // Redis ran every call past its deadline: none of them counted.
    let peek = [day_check("bounded", 1000, Hits::Peek)];
    let outcomes = store.decide_by(&peek, None).await.expect("answered");
    assert_eq!(outcomes[0].verdict.remaining, 999);
}
