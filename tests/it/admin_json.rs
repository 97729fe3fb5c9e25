//! The admin port's `/json` against a running rlsd: a dry run by default, so whoever reaches
//! port 8080 can neither refill nor exhaust a quota; writes only with `--admin-json-writes`.

use crate::common;

use common::process::Rlsd;
use common::{descriptor, http_get, http_post, request};
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd_testkit::redis::RedisServer;

/// Five a day, as a token bucket refilling one hit every 4.8 hours: no window boundary can
/// give the quota back while a test runs.
const CONFIG: &str = "domain: api\ndescriptors:\n  - key: key\n    rate_limit: {unit: day, \
                      requests_per_unit: 5, algorithm: token_bucket, burst: 5}\n";

/// rlsd serving [`CONFIG`] with `extra` flags; the temporary directory lives as long as it.
fn start(extra: &[&str]) -> (Rlsd, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("api.yaml");
    std::fs::write(&file, CONFIG).expect("write");
    let mut args = vec!["--config".to_owned(), file.display().to_string()];
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    (Rlsd::serve(args), dir)
}

/// One gRPC hit on `key`: the overall code and what remains.
async fn grpc_hit(rlsd: &Rlsd, key: &str) -> (Code, u32) {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");
    let answer = client
        .should_rate_limit(request("api", vec![descriptor(&[("key", key)])]))
        .await
        .unwrap_or_else(|status| panic!("no answer: {status:?}"))
        .into_inner();
    let code = Code::try_from(answer.overall_code).expect("a known code");
    (code, answer.statuses[0].limit_remaining)
}

/// `/json` for `key` with the descriptor's `hitsAddend` and `isNegativeHits`.
async fn json(rlsd: &Rlsd, key: &str, hits: u64, refund: bool) -> (u16, String) {
    let body = format!(
        r#"{{"domain":"api","descriptors":[{{"entries":[{{"key":"key","value":"{key}"}}],"hitsAddend":"{hits}","isNegativeHits":{refund}}}]}}"#
    );
    http_post(rlsd.http, "/json", &body).await
}

/// `total_hits` of the `api.key` limit, 0 before it has a series.
async fn total_hits(rlsd: &Rlsd) -> f64 {
    let (_, text) = http_get(rlsd.http, "/metrics").await;
    text.lines()
        .find_map(|line| {
            let rest = line.strip_prefix("ratelimit_service_rate_limit_total_hits{")?;
            let (labels, value) = rest.split_once("} ")?;
            labels
                .contains("descriptor=\"api.key\"")
                .then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// Uses up `key`'s five hits over gRPC and checks that the sixth is denied.
async fn exhaust(rlsd: &Rlsd, key: &str) {
    for left in (0..5).rev() {
        assert_eq!(grpc_hit(rlsd, key).await, (Code::Ok, left));
    }
    assert_eq!(grpc_hit(rlsd, key).await.0, Code::OverLimit);
}

#[tokio::test]
async fn json_cannot_give_back_a_quota_used_up_over_grpc() {
    // Redis, as a shared deployment runs: the peek goes through the store's script too.
    let redis = RedisServer::start();
    // A generous command timeout: this machine is shared, and a slow call is not the point.
    let url = redis.url();
    let (rlsd, _dir) = start(&["--redis-url", &url, "--redis-command-timeout-ms", "2000"]);
    exhaust(&rlsd, "k1").await;

    let (status, answer) = json(&rlsd, "k1", 5, true).await;
    // The dry run reports the state as it is: over, with envoyproxy/ratelimit's 429.
    assert_eq!(status, 429, "{answer}");
    assert!(answer.contains("\"OVER_LIMIT\""), "{answer}");
    assert_eq!(
        grpc_hit(&rlsd, "k1").await.0,
        Code::OverLimit,
        "the refund over /json must not reopen the quota"
    );
}

#[tokio::test]
async fn json_cannot_use_up_a_quota_nor_count_hits() {
    let (rlsd, _dir) = start(&[]);
    // The whole quota at once, and far more than it: each a look, never a take.
    for hits in [5, 1_000_000_000] {
        let (status, answer) = json(&rlsd, "k2", hits, false).await;
        assert_eq!(status, 200, "hitsAddend {hits}: {answer}");
        assert!(answer.contains("\"limitRemaining\":5"), "{answer}");
    }
    assert_eq!(total_hits(&rlsd).await, 0.0, "a dry run counts no hits");
    assert_eq!(grpc_hit(&rlsd, "k2").await, (Code::Ok, 4));
    assert_eq!(total_hits(&rlsd).await, 1.0);
    // Malformed is still 400.
    let (status, _) = http_post(rlsd.http, "/json", "{not json").await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn with_admin_json_writes_json_takes_and_gives_back_hits() {
    let (rlsd, _dir) = start(&["--admin-json-writes"]);
    let (status, answer) = json(&rlsd, "k3", 5, false).await;
    assert_eq!(status, 200, "{answer}");
    // Logged as the admin port is set up, so before it answered.
    assert!(
        rlsd.log().contains("--admin-json-writes"),
        "the start warns that the admin port can change quotas: {}",
        rlsd.log()
    );
    assert_eq!(grpc_hit(&rlsd, "k3").await.0, Code::OverLimit);
    let (status, answer) = json(&rlsd, "k3", 2, true).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(grpc_hit(&rlsd, "k3").await, (Code::Ok, 1));
    // Written hits count as gRPC hits do: 5 over /json, 2 over gRPC (one denied).
    assert_eq!(total_hits(&rlsd).await, 7.0);
}
