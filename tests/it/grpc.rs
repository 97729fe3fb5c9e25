//! rlsd over a real gRPC socket with the in-process store: statuses, headers, errors, config
//! features and concurrency.

use crate::common;

use common::{T0, TestServer, descriptor, request};
use rlsd::pb::rate_limit_descriptor::RateLimitOverride;
use rlsd::pb::rate_limit_response::{Code, DescriptorStatus, rate_limit::Unit};
use rlsd::pb::{RateLimitResponse, RateLimitUnit};
use rlsd::service::HeaderStyle;

const LIMITS: &str = r#"
domain: shop
descriptors:
  - key: user
    rate_limit:
      name: per-user
      unit: minute
      requests_per_unit: 3
  - key: path
    value: /health
  - key: path
    value: /free
    rate_limit:
      unlimited: true
  - key: path
    value: /api/*
    rate_limit:
      unit: second
      requests_per_unit: 2
  - key: tenant
    descriptors:
      - key: user
        rate_limit:
          name: tenant-user
          unit: hour
          requests_per_unit: 5
          replaces:
            - name: per-user
  - key: shadowed
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: bucket
    rate_limit:
      unit: second
      requests_per_unit: 10
      algorithm: token_bucket
      burst: 4
"#;

fn code(status: &DescriptorStatus) -> Code {
    Code::try_from(status.code).expect("known code")
}

fn header<'a>(response: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    response
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

async fn ask(
    server: &TestServer,
    req: rlsd::pb::RateLimitRequest,
) -> Result<RateLimitResponse, tonic::Status> {
    server
        .client()
        .await
        .should_rate_limit(req)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn a_limit_counts_down_then_denies_with_headers() {
    let server = TestServer::start(LIMITS).await;
    server.clock.set(T0 + 20_000_000);
    let mut client = server.client().await;
    for expected in [2, 1, 0] {
        let response = client
            .should_rate_limit(request("shop", vec![descriptor(&[("user", "ann")])]))
            .await
            .expect("answer")
            .into_inner();
        assert_eq!(response.overall_code, Code::Ok as i32);
        let status = &response.statuses[0];
        assert_eq!(code(status), Code::Ok);
        assert_eq!(status.limit_remaining, expected);
        let limit = status.current_limit.as_ref().expect("current_limit");
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit),
            ("per-user", 3)
        );
        assert_eq!(limit.unit, Unit::Minute as i32);
        let reset = status.duration_until_reset.expect("reset");
        assert_eq!((reset.seconds, reset.nanos), (40, 0));
        assert_eq!(
            header(&response, "x-ratelimit-limit"),
            Some("3, 3;w=60;name=\"per-user\"")
        );
        assert_eq!(
            header(&response, "x-ratelimit-remaining"),
            Some(expected.to_string().as_str())
        );
        assert_eq!(header(&response, "x-ratelimit-reset"), Some("40"));
        assert_eq!(header(&response, "retry-after"), None);
    }
    server.clock.set(T0 + 45_500_000);
    let denied = client
        .should_rate_limit(request("shop", vec![descriptor(&[("user", "ann")])]))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(denied.overall_code, Code::OverLimit as i32);
    assert_eq!(code(&denied.statuses[0]), Code::OverLimit);
    assert_eq!(denied.statuses[0].limit_remaining, 0);
    let reset = denied.statuses[0].duration_until_reset.expect("reset");
    assert_eq!((reset.seconds, reset.nanos), (14, 500_000_000));
    assert_eq!(header(&denied, "x-ratelimit-reset"), Some("15"));
    assert_eq!(header(&denied, "retry-after"), Some("15"));
    // Another user has their own counter.
    let other = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "bob")])]),
    )
    .await
    .expect("answer");
    assert_eq!(other.statuses[0].limit_remaining, 2);
    // The next window starts fresh.
    server.clock.set(T0 + 60_000_000);
    let fresh = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("answer");
    assert_eq!(fresh.overall_code, Code::Ok as i32);
    server.stop().await;
}

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    let server = TestServer::start(LIMITS).await;
    let mut override_unknown = descriptor(&[("user", "ann")]);
    override_unknown.limit = Some(RateLimitOverride {
        requests_per_unit: 5,
        unit: RateLimitUnit::Unknown as i32,
    });
    let cases = [
        (
            request("", vec![descriptor(&[("user", "a")])]),
            "domain must not be empty",
        ),
        (request("shop", vec![]), "descriptor list must not be empty"),
        (
            request("shop", vec![override_unknown]),
            "limit override has unit UNKNOWN",
        ),
    ];
    for (req, message) in cases {
        let status = ask(&server, req).await.expect_err("rejected");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{message}");
        assert!(
            status.message().contains(message),
            "{:?} lacks {message:?}",
            status.message()
        );
    }
    // Nothing was counted by the rejected requests.
    let ok = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("answer");
    assert_eq!(ok.statuses[0].limit_remaining, 2);
    server.stop().await;
}

#[tokio::test]
async fn unknown_domains_descriptors_and_whitelists_are_ok_without_a_limit() {
    let server = TestServer::start(LIMITS).await;
    let cases = [
        request("nope", vec![descriptor(&[("user", "ann")])]),
        request("shop", vec![descriptor(&[("unknown", "x")])]),
        request("shop", vec![descriptor(&[("path", "/health")])]),
        // Deeper than the tree: no limit (the last-entry rule).
        request("shop", vec![descriptor(&[("user", "ann"), ("extra", "1")])]),
        // A parent without its own limit.
        request("shop", vec![descriptor(&[("tenant", "t1")])]),
    ];
    for req in cases {
        let response = ask(&server, req.clone()).await.expect("answer");
        assert_eq!(response.overall_code, Code::Ok as i32, "{req:?}");
        assert_eq!(response.statuses.len(), 1);
        assert_eq!(
            response.statuses[0],
            DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            },
            "{req:?}"
        );
        assert!(response.response_headers_to_add.is_empty());
    }
    assert_eq!(
        server.store.stats().live_keys,
        0,
        "nothing touched the store"
    );
    server.stop().await;
}

/// A descriptor with an empty key, or with no entries, is answered OK without a limit, as
/// envoyproxy/ratelimit answers it (refusing the call turned an allowed request into Envoy's
/// failure mode), and counted; the rest of the call is decided as usual.
#[tokio::test]
async fn descriptors_without_a_key_are_ok_without_a_limit_and_counted() {
    let server = TestServer::start(LIMITS).await;
    let req = request(
        "shop",
        vec![
            descriptor(&[("user", "ann")]),
            descriptor(&[("", "x")]),
            descriptor(&[]),
            descriptor(&[("tenant", "t1"), ("", "x")]),
        ],
    );
    for remaining in [2, 1, 0] {
        let response = ask(&server, req.clone()).await.expect("answered");
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(response.statuses[0].limit_remaining, remaining);
        for status in &response.statuses[1..] {
            assert_eq!(
                status,
                &DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                }
            );
        }
    }
    let denied = ask(&server, req).await.expect("answered");
    assert_eq!(
        denied.overall_code,
        Code::OverLimit as i32,
        "the user limit"
    );
    let (_, metrics) = server.http_get("/metrics").await;
    for line in [
        "rlsd_descriptors_skipped_total{reason=\"empty_key\"} 8",
        "rlsd_descriptors_skipped_total{reason=\"no_entries\"} 4",
        "rlsd_invalid_requests_total 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }
    server.stop().await;
}

#[tokio::test]
async fn unlimited_wildcards_and_statuses_in_request_order() {
    let server = TestServer::start(LIMITS).await;
    let req = request(
        "shop",
        vec![
            descriptor(&[("path", "/free")]),
            descriptor(&[("path", "/api/orders")]),
            descriptor(&[("unknown", "x")]),
        ],
    );
    for round in 0..3 {
        let response = ask(&server, req.clone()).await.expect("answer");
        assert_eq!(response.statuses.len(), 3);
        let [free, api, unknown] = &response.statuses[..] else {
            panic!("three statuses")
        };
        assert_eq!(code(free), Code::Ok);
        assert_eq!(free.limit_remaining, u32::MAX);
        assert!(free.current_limit.is_none());
        assert!(unknown.current_limit.is_none());
        let api_limit = api.current_limit.as_ref().expect("wildcard matched");
        assert_eq!(
            (api_limit.requests_per_unit, api_limit.unit),
            (2, Unit::Second as i32)
        );
        let expected = if round < 2 { Code::Ok } else { Code::OverLimit };
        assert_eq!(code(api), expected, "round {round}");
        assert_eq!(response.overall_code, expected as i32);
    }
    server.stop().await;
}

#[tokio::test]
async fn replaces_drops_the_replaced_limit() {
    let server = TestServer::start(LIMITS).await;
    let req = request(
        "shop",
        vec![
            descriptor(&[("user", "ann")]),
            descriptor(&[("tenant", "t1"), ("user", "ann")]),
        ],
    );
    for expected in [4, 3, 2, 1, 0] {
        let response = ask(&server, req.clone()).await.expect("answer");
        // per-user (3/min) is replaced by tenant-user (5/hour): not counted, empty OK status.
        assert_eq!(
            response.statuses[0],
            DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            }
        );
        assert_eq!(response.statuses[1].limit_remaining, expected);
    }
    let alone = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("answer");
    assert_eq!(
        alone.statuses[0].limit_remaining, 2,
        "per-user was never charged"
    );
    server.stop().await;
}

#[tokio::test]
async fn shadow_mode_reports_ok_with_zero_remaining() {
    let server = TestServer::start(LIMITS).await;
    let req = request(
        "shop",
        vec![
            descriptor(&[("shadowed", "x")]),
            descriptor(&[("user", "ann")]),
        ],
    );
    let first = ask(&server, req.clone()).await.expect("answer");
    assert_eq!(first.statuses[0].limit_remaining, 0);
    for _ in 0..2 {
        let over = ask(&server, req.clone()).await.expect("answer");
        assert_eq!(over.overall_code, Code::Ok as i32);
        assert_eq!(code(&over.statuses[0]), Code::Ok);
        assert_eq!(over.statuses[0].limit_remaining, 0);
    }
    // The user limit was charged each time: the shadow limit never blocked the request.
    let after = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("answer");
    assert_eq!(code(&after.statuses[0]), Code::OverLimit);
    server.stop().await;
}

#[tokio::test]
async fn hits_addend_per_request_per_descriptor_and_refunds() {
    let server = TestServer::start(LIMITS).await;
    let bucket = || descriptor(&[("bucket", "b")]);
    let mut req = request("shop", vec![bucket()]);
    req.hits_addend = 3;
    let response = ask(&server, req).await.expect("answer");
    assert_eq!(response.statuses[0].limit_remaining, 1);
    // A descriptor's hits_addend of 0 is a pure check.
    let mut peek = bucket();
    peek.hits_addend = Some(0);
    let mut req = request("shop", vec![peek]);
    req.hits_addend = 7;
    let response = ask(&server, req).await.expect("answer");
    assert_eq!(
        (response.overall_code, response.statuses[0].limit_remaining),
        (Code::Ok as i32, 1)
    );
    // The descriptor's own hits win over the request's; they are a charge, recorded even when
    // over (the bucket owes one token), and answered with what they leave: nothing.
    let mut two = bucket();
    two.hits_addend = Some(2);
    let response = ask(&server, request("shop", vec![two]))
        .await
        .expect("answer");
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(response.statuses[0].limit_remaining, 0);
    // is_negative_hits gives hits back.
    let mut refund = bucket();
    refund.hits_addend = Some(2);
    refund.is_negative_hits = true;
    let response = ask(&server, request("shop", vec![refund]))
        .await
        .expect("answer");
    assert_eq!(
        (response.overall_code, response.statuses[0].limit_remaining),
        (Code::Ok as i32, 1)
    );
    server.stop().await;
}

#[tokio::test]
async fn an_envoy_limit_override_is_honoured_when_the_domain_exists() {
    let server = TestServer::start(LIMITS).await;
    let mut overridden = descriptor(&[("anything", "x")]);
    overridden.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: RateLimitUnit::Hour as i32,
    });
    let first = ask(&server, request("shop", vec![overridden.clone()]))
        .await
        .expect("answer");
    let limit = first.statuses[0]
        .current_limit
        .as_ref()
        .expect("override limit");
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (1, Unit::Hour as i32)
    );
    let second = ask(&server, request("shop", vec![overridden.clone()]))
        .await
        .expect("answer");
    assert_eq!(second.overall_code, Code::OverLimit as i32);
    let unknown_domain = ask(&server, request("nope", vec![overridden]))
        .await
        .expect("answer");
    assert!(unknown_domain.statuses[0].current_limit.is_none());
    server.stop().await;
}

#[tokio::test]
async fn header_names_are_configurable_and_can_be_off() {
    for (style, expected) in [
        (HeaderStyle::Ratelimit, Some("ratelimit-remaining")),
        (HeaderStyle::Off, None),
    ] {
        let server = TestServer::start_with(LIMITS, style, 100).await;
        let response = ask(
            &server,
            request("shop", vec![descriptor(&[("user", "ann")])]),
        )
        .await
        .expect("answer");
        match expected {
            Some(name) => {
                assert_eq!(header(&response, name), Some("2"));
                assert_eq!(header(&response, "x-ratelimit-remaining"), None);
            }
            None => assert!(response.response_headers_to_add.is_empty()),
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn headers_follow_the_most_restrictive_status() {
    // user has 2 left of 3/min, bucket 3 of 4: the user status is closest to its limit. Envoy's
    // form lists every policy; envoyproxy/ratelimit's sends the closest limit as a bare number.
    for (style, prefix, limit) in [
        (
            HeaderStyle::XRatelimit,
            "x-ratelimit-",
            "3, 10;w=1, 3;w=60;name=\"per-user\"",
        ),
        (HeaderStyle::Ratelimit, "ratelimit-", "3"),
    ] {
        let server = TestServer::start_with(LIMITS, style, 100).await;
        server.clock.set(T0 + 30_000_000);
        let req = request(
            "shop",
            vec![
                descriptor(&[("bucket", "b")]),
                descriptor(&[("user", "ann")]),
            ],
        );
        let response = ask(&server, req).await.expect("answer");
        let named = |name: &str| header(&response, &format!("{prefix}{name}")).map(str::to_owned);
        assert_eq!(named("remaining").as_deref(), Some("2"), "{style:?}");
        assert_eq!(named("limit").as_deref(), Some(limit), "{style:?}");
        assert_eq!(named("reset").as_deref(), Some("30"), "{style:?}");
        server.stop().await;
    }
}

/// `--limit-header`, `--remaining-header`, `--reset-header` (envoyproxy/ratelimit's
/// `LIMIT_*_HEADER`) rename the three headers, in lower case as HTTP/2 sends them.
#[tokio::test]
async fn header_names_can_be_chosen() {
    let settings = rlsd::service::ServiceSettings {
        headers: HeaderStyle::Ratelimit,
        header_names: rlsd::service::HeaderNames {
            limit: Some(http::HeaderName::from_static("x-quota")),
            remaining: Some(http::HeaderName::from_static("x-left")),
            reset: None,
        },
        ..Default::default()
    };
    let server = TestServer::start_settings(LIMITS, settings, 100).await;
    server.clock.set(T0 + 30_000_000);
    let response = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("answer");
    let names: Vec<&str> = response
        .response_headers_to_add
        .iter()
        .map(|h| h.key.as_str())
        .collect();
    assert_eq!(names, ["x-quota", "x-left", "ratelimit-reset"]);
    assert_eq!(header(&response, "x-left"), Some("2"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_on_one_key_get_exactly_the_limit() {
    const CONFIG: &str = "domain: c\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: hour\n      requests_per_unit: 1000\n";
    let server = TestServer::start(CONFIG).await;
    let client = server.client().await;
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move {
                let mut ok = 0;
                for _ in 0..100 {
                    let response = client
                        .should_rate_limit(request("c", vec![descriptor(&[("k", "v")])]))
                        .await
                        .expect("answer")
                        .into_inner();
                    ok += usize::from(response.overall_code == Code::Ok as i32);
                }
                ok
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("task");
    }
    assert_eq!(total, 1000);
    server.stop().await;
}

#[tokio::test]
async fn a_full_store_answers_unavailable_and_changes_nothing() {
    let server = TestServer::start_with(LIMITS, HeaderStyle::XRatelimit, 1).await;
    ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("room for one");
    let status = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "bob")])]),
    )
    .await
    .expect_err("full");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(status.message().contains("full"), "{}", status.message());
    let ann = ask(
        &server,
        request("shop", vec![descriptor(&[("user", "ann")])]),
    )
    .await
    .expect("existing key");
    assert_eq!(ann.statuses[0].limit_remaining, 1);
    server.stop().await;
}

#[tokio::test]
async fn global_shadow_mode_counts_and_reports_but_never_denies() {
    let settings = rlsd::service::ServiceSettings {
        shadow_mode: true,
        ..Default::default()
    };
    let server = TestServer::start_settings(LIMITS, settings, 100).await;
    for (expected_remaining, expected_code) in [
        (2, Code::Ok),
        (1, Code::Ok),
        (0, Code::Ok),
        // As envoyproxy/ratelimit: the status says the limit is over, the answer is OK.
        (0, Code::OverLimit),
        (0, Code::OverLimit),
    ] {
        let response = ask(
            &server,
            request("shop", vec![descriptor(&[("user", "ann")])]),
        )
        .await
        .expect("answer");
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(code(&response.statuses[0]), expected_code);
        assert_eq!(response.statuses[0].limit_remaining, expected_remaining);
        assert_eq!(header(&response, "retry-after"), None);
    }
    server.stop().await;
}

/// envoyproxy/ratelimit's `quota_mode` and `metadata`: quota-mode limits deny only when every
/// one of the request's is over; metadata comes back only when asked for (see
/// `upstream_answers`).
const QUOTAS: &str = r#"
domain: ai
descriptors:
  - key: model
    value: small
    quota_mode: true
    metadata: {tier: small, cost: 1, tags: [cheap, fast]}
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: model
    value: large
    quota_mode: true
    metadata: {tier: large}
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 100}
"#;

#[tokio::test]
async fn quota_mode_limits_deny_together() {
    let server = TestServer::start(QUOTAS).await;
    server.clock.set(T0);
    let both = || {
        request(
            "ai",
            vec![
                descriptor(&[("model", "small")]),
                descriptor(&[("model", "large")]),
                descriptor(&[("user", "ann")]),
            ],
        )
    };
    let mut answers = Vec::new();
    for _ in 0..5 {
        let response = ask(&server, both()).await.expect("answer");
        answers.push((
            Code::try_from(response.overall_code).expect("code"),
            response.statuses.iter().map(code).collect::<Vec<_>>(),
            response.statuses[2].limit_remaining,
        ));
    }
    use Code::{Ok as Pass, OverLimit as Over};
    assert_eq!(
        answers,
        [
            (Pass, vec![Pass, Pass, Pass], 99),
            (Pass, vec![Pass, Pass, Pass], 98),
            // small is spent, large still has quota: allowed, small reported over (as
            // envoyproxy/ratelimit does: its status, not the answer).
            (Pass, vec![Over, Pass, Pass], 97),
            // Both spent: denied, and nothing is counted (user keeps 97).
            (Over, vec![Over, Over, Pass], 97),
            (Over, vec![Over, Over, Pass], 97),
        ]
    );
    let response = ask(&server, both()).await.expect("answer");
    assert_eq!(response.statuses[0].limit_remaining, 0);
    // A quota-mode limit on its own denies once it is over.
    let alone = ask(
        &server,
        request("ai", vec![descriptor(&[("model", "small")])]),
    )
    .await
    .expect("answer");
    assert_eq!(alone.overall_code, Code::OverLimit as i32);

    // No metadata unless asked for, as envoyproxy/ratelimit.
    assert_eq!(response.dynamic_metadata, None);
}
