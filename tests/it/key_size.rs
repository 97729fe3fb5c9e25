//! Store keys stay short whatever a request's values: 3 000 requests over real gRPC, each with
//! its own 16 000-byte value, leave 3 000 keys of a bounded length in process and in a real
//! redis-server, and each value still has a counter of its own.

use crate::common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{TestServer, descriptor, request, spawn_server};
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::service::ServiceSettings;
use rlsd::store::{RedisSettings, RedisStore};
use rlsd_testkit::redis::RedisServer;
use tonic::transport::Channel;

/// A bare key: every value matches, and each value is counted on its own key.
const LONG: &str = r#"
domain: long
descriptors:
  - key: path
    rate_limit: {unit: day, requests_per_unit: 2}
"#;

/// Requests sent, each with a distinct value.
const REQUESTS: usize = 3_000;

/// Bytes in each value: under `--max-value-bytes` (16 KiB), as a long URL would be.
const VALUE_BYTES: usize = 16_000;

/// `rlsd:_:long:fw:86400` (20 bytes) and at most 96 bytes of entries, plain or digested.
const MAX_KEY_BYTES: usize = 20 + 96;

/// The `i`-th value: distinct in its first bytes, and full of characters the keys escape.
fn value(i: usize) -> String {
    let mut value = format!("/files/{i:05}?q=");
    while value.len() < VALUE_BYTES {
        value.push_str("a:b=c{d}%");
    }
    value.truncate(VALUE_BYTES);
    value
}

/// Sends one hit on `path=value(i)`; its overall code.
async fn hit(client: &mut RateLimitServiceClient<Channel>, i: usize) -> i32 {
    client
        .should_rate_limit(request("long", vec![descriptor(&[("path", &value(i))])]))
        .await
        .expect("answered")
        .into_inner()
        .overall_code
}

/// One hit on each of the [`REQUESTS`] values, all allowed; then value 0 runs out on its own.
async fn hit_every_value_and_exhaust_one(client: &mut RateLimitServiceClient<Channel>) {
    for i in 0..REQUESTS {
        assert_eq!(hit(client, i).await, Code::Ok as i32, "value {i}");
    }
    assert_eq!(
        hit(client, 0).await,
        Code::Ok as i32,
        "second hit on value 0"
    );
    assert_eq!(
        hit(client, 0).await,
        Code::OverLimit as i32,
        "third hit on value 0"
    );
    assert_eq!(
        hit(client, 1).await,
        Code::Ok as i32,
        "value 1 has its own counter"
    );
}

/// Asserts `keys` are [`REQUESTS`] distinct keys of at most [`MAX_KEY_BYTES`], brace-free.
fn assert_bounded(keys: &[String]) {
    let distinct: HashSet<&String> = keys.iter().collect();
    assert_eq!(distinct.len(), REQUESTS, "one key per value");
    for key in keys {
        assert!(
            key.len() <= MAX_KEY_BYTES && !key.contains('{') && !key.contains('}'),
            "a key of {} bytes: {}...",
            key.len(),
            &key[..key.len().min(120)]
        );
    }
}

/// The longest of `keys` and their bytes in all.
fn lengths(keys: &[String]) -> (usize, usize) {
    let lengths = keys.iter().map(String::len);
    (lengths.clone().max().unwrap_or(0), lengths.sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_values_make_bounded_keys_in_process() {
    let server = TestServer::start(LONG).await;
    let mut client = server.client().await;
    hit_every_value_and_exhaust_one(&mut client).await;
    let keys = server.store.keys();
    let (longest, total) = lengths(&keys);
    println!(
        "{} keys in process, the longest {longest} bytes, {total} key bytes in all",
        keys.len()
    );
    assert_bounded(&keys);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_values_make_bounded_keys_in_redis() {
    let redis = RedisServer::start();
    let mut settings = RedisSettings::new(redis.url());
    settings.command_timeout = Duration::from_secs(2);
    settings.lanes = common::LANES;
    let store = Arc::new(RedisStore::connect(settings).await.expect("valid url"));
    let (grpc, _http, stop, task) = spawn_server(LONG, store, ServiceSettings::default()).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    // A first call loads the script and opens the connections, so only keys count below.
    let warm = request("long", vec![descriptor(&[("path", "warm-up")])]);
    client.should_rate_limit(warm).await.expect("warm-up");
    let before = redis.used_memory();

    hit_every_value_and_exhaust_one(&mut client).await;

    let grown = redis.used_memory().saturating_sub(before);
    let scan = redis.cli(&["--scan", "--pattern", "rlsd:_:long:*"]);
    let keys: Vec<String> = scan
        .expect("redis-cli --scan")
        .lines()
        .filter(|key| !key.ends_with(":path=warm-up"))
        .map(str::to_owned)
        .collect();
    let (longest, _) = lengths(&keys);
    let per_key = grown / REQUESTS as u64;
    println!(
        "{} keys in Redis, the longest {longest} bytes; used_memory grew {grown} bytes, {per_key} per key",
        keys.len()
    );
    assert_bounded(&keys);
    // A fixed window's key, its counter and its TTL: a few hundred bytes, not the value's 16 000.
    assert!(per_key < 512, "used_memory grew {per_key} bytes per key");
    let _ = stop.send(());
    task.await.expect("server task");
}
