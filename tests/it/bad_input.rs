//! Request limits over a real gRPC socket: each bound passes, one over it is INVALID_ARGUMENT
//! naming the limit and the value, oversized messages are refused, and a rejected request
//! counts nothing.

use crate::common;

use common::{TestServer, descriptor, request};
use prost::Message;
use rlsd::pb::rate_limit_descriptor::Entry;
use rlsd::pb::rate_limit_response::Code;
use rlsd::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use rlsd::service::{RequestLimits, ServiceSettings};

const LIMITS: &str = r#"
domain: shop
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: free
    rate_limit:
      unlimited: true
"#;

async fn ask(
    server: &TestServer,
    req: RateLimitRequest,
) -> Result<RateLimitResponse, tonic::Status> {
    server
        .client()
        .await
        .should_rate_limit(req)
        .await
        .map(tonic::Response::into_inner)
}

/// Asserts `req` is answered (not refused).
async fn passes(server: &TestServer, req: RateLimitRequest, what: &str) -> RateLimitResponse {
    match ask(server, req).await {
        Ok(response) => response,
        Err(status) => panic!("{what}: refused with {status:?}"),
    }
}

/// Asserts `req` is INVALID_ARGUMENT with exactly `message`.
async fn invalid(server: &TestServer, req: RateLimitRequest, message: &str) {
    let status = ask(server, req).await.expect_err(message);
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{message}");
    assert_eq!(status.message(), message);
}

/// The remaining count of `user=<user>` after one more hit.
async fn remaining_after_hit(server: &TestServer, user: &str) -> u32 {
    let response = passes(
        server,
        request("shop", vec![descriptor(&[("user", user)])]),
        "counter probe",
    )
    .await;
    response.statuses[0].limit_remaining
}

/// `n` descriptors matching nothing, after a counted `user=ann`.
fn with_descriptors(n: usize) -> RateLimitRequest {
    let mut descriptors = vec![descriptor(&[("user", "ann")])];
    descriptors.extend((1..n).map(|_| descriptor(&[("other", "x")])));
    request("shop", descriptors)
}

/// A counted `user=ann` descriptor, then `second`.
fn after_ann(second: RateLimitDescriptor) -> RateLimitRequest {
    request("shop", vec![descriptor(&[("user", "ann")]), second])
}

fn entries(n: usize) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: (0..n)
            .map(|i| Entry {
                key: format!("k{i}"),
                value: "v".to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn default_limits_pass_at_the_bound_and_refuse_one_over() {
    let server = TestServer::start(LIMITS).await;
    let limits = RequestLimits::default();
    assert_eq!(
        limits,
        RequestLimits {
            max_descriptors: 64,
            max_entries: 32,
            max_key_bytes: 256,
            max_value_bytes: 16_384,
            max_hits_addend: 1_000_000_000,
            max_message_bytes: 65_536,
        }
    );

    // Descriptors per request.
    let at = passes(&server, with_descriptors(64), "64 descriptors").await;
    assert_eq!(at.statuses.len(), 64);
    invalid(
        &server,
        with_descriptors(65),
        "request has 65 descriptors; at most 64 are allowed (--max-descriptors)",
    )
    .await;

    // Entries per descriptor.
    passes(&server, request("shop", vec![entries(32)]), "32 entries").await;
    invalid(
        &server,
        after_ann(entries(33)),
        "descriptor 1 has 33 entries; at most 32 are allowed (--max-entries)",
    )
    .await;

    // Key length, in bytes (not characters): 128 two-byte characters are 256 bytes.
    let key = "é".repeat(128);
    passes(
        &server,
        request("shop", vec![descriptor(&[(&key, "v")])]),
        "256-byte key",
    )
    .await;
    invalid(
        &server,
        after_ann(descriptor(&[("a", "b"), (&format!("{key}x"), "v")])),
        "descriptor 1 entry 1 key is 257 bytes; at most 256 are allowed (--max-key-bytes)",
    )
    .await;

    // Value length, in bytes: a long URL as Envoy sends `:path` passes.
    let path = format!("/search?q={}", "v".repeat(16_384 - 10));
    passes(
        &server,
        request("shop", vec![descriptor(&[("other", &path)])]),
        "16 KiB :path value",
    )
    .await;
    invalid(
        &server,
        after_ann(descriptor(&[("other", &format!("{path}é"))])),
        "descriptor 1 entry 0 value is 16386 bytes; at most 16384 are allowed (--max-value-bytes)",
    )
    .await;

    // The request's hits_addend.
    let mut big = request("shop", vec![descriptor(&[("free", "x")])]);
    big.hits_addend = 1_000_000_000;
    passes(&server, big, "request hits_addend 1e9").await;
    for hits in [1_000_000_001, u32::MAX] {
        let mut over = request("shop", vec![descriptor(&[("user", "ann")])]);
        over.hits_addend = hits;
        invalid(
            &server,
            over,
            &format!(
                "request hits_addend is {hits}; at most 1000000000 is allowed (--max-hits-addend)"
            ),
        )
        .await;
    }

    // A descriptor's hits_addend.
    let mut big = descriptor(&[("user", "bob")]);
    big.hits_addend = Some(1_000_000_000);
    let over_limit = passes(&server, request("shop", vec![big]), "descriptor 1e9").await;
    assert_eq!(over_limit.overall_code, Code::OverLimit as i32);
    for hits in [1_000_000_001, u64::MAX] {
        let mut over = descriptor(&[("user", "ann")]);
        over.hits_addend = Some(hits);
        invalid(
            &server,
            after_ann(over),
            &format!(
                "descriptor 1 hits_addend is {hits}; at most 1000000000 is allowed (--max-hits-addend)"
            ),
        )
        .await;
    }

    // Only the 64-descriptor request counted ann; every rejected one left her alone.
    assert_eq!(remaining_after_hit(&server, "ann").await, 1);
    server.stop().await;
}

/// A request whose encoded size is exactly `bytes`: an unknown domain padded to size, or (with
/// `counted`) `user=ann` in `shop` followed by a descriptor with a padded value.
fn of_size(bytes: usize, counted: bool) -> RateLimitRequest {
    let mut req = if counted {
        after_ann(descriptor(&[("other", "")]))
    } else {
        request("", vec![descriptor(&[("user", "ann")])])
    };
    let pad = |req: &mut RateLimitRequest, n: usize| {
        let text = "d".repeat(n);
        if counted {
            req.descriptors[1].entries[0].value = text;
        } else {
            req.domain = text;
        }
    };
    // The padding's length prefix grows with it; adjust until the total is exact.
    let mut n = bytes - req.encoded_len();
    loop {
        pad(&mut req, n);
        match req.encoded_len() {
            len if len == bytes => return req,
            len if len > bytes => n -= len - bytes,
            len => n += bytes - len,
        }
    }
}

#[tokio::test]
async fn oversized_messages_are_refused_by_tonic_with_out_of_range() {
    let server = TestServer::start(LIMITS).await;
    let at = of_size(65_536, false);
    assert_eq!(at.encoded_len(), 65_536);
    let answered = passes(&server, at, "a 64 KiB message").await;
    assert_eq!(answered.overall_code, Code::Ok as i32);

    for bytes in [65_537, 1 << 20] {
        let oversized = of_size(bytes, true);
        assert_eq!(oversized.domain, "shop");
        let status = ask(&server, oversized)
            .await
            .expect_err("oversized message");
        // tonic's own check, before the message is decoded: OUT_OF_RANGE, not INVALID_ARGUMENT.
        assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
        assert_eq!(
            status.message(),
            format!(
                "Error, decoded message length too large: found {bytes} bytes, the limit is: 65536 bytes"
            )
        );
    }
    // The refused messages carried a counted `user=ann`: nothing was counted.
    assert_eq!(remaining_after_hit(&server, "ann").await, 2);
    server.stop().await;
}

#[tokio::test]
async fn configured_limits_apply_and_are_named() {
    let settings = ServiceSettings {
        limits: RequestLimits {
            max_descriptors: 2,
            max_entries: 2,
            max_key_bytes: 4,
            max_value_bytes: 3,
            max_hits_addend: 10,
            max_message_bytes: 200,
        },
        ..Default::default()
    };
    let server = TestServer::start_settings(LIMITS, settings, 100).await;
    let cases: [(RateLimitRequest, &str); 6] = [
        (
            with_descriptors(3),
            "request has 3 descriptors; at most 2 are allowed (--max-descriptors)",
        ),
        (
            after_ann(entries(3)),
            "descriptor 1 has 3 entries; at most 2 are allowed (--max-entries)",
        ),
        (
            after_ann(descriptor(&[("abcde", "v")])),
            "descriptor 1 entry 0 key is 5 bytes; at most 4 are allowed (--max-key-bytes)",
        ),
        (
            after_ann(descriptor(&[("user", "abcd")])),
            "descriptor 1 entry 0 value is 4 bytes; at most 3 are allowed (--max-value-bytes)",
        ),
        (
            RateLimitRequest {
                hits_addend: 11,
                ..with_descriptors(1)
            },
            "request hits_addend is 11; at most 10 is allowed (--max-hits-addend)",
        ),
        (
            after_ann(RateLimitDescriptor {
                hits_addend: Some(11),
                ..descriptor(&[("user", "ann")])
            }),
            "descriptor 1 hits_addend is 11; at most 10 is allowed (--max-hits-addend)",
        ),
    ];
    for (req, message) in cases {
        invalid(&server, req, message).await;
    }
    // Every configured bound at once: 2 descriptors of 2 entries, a 4-byte key, a 3-byte value,
    // a request hits_addend of 10 and a descriptor's of 2 (so eve has 1 left).
    let mut at = request(
        "shop",
        vec![
            descriptor(&[("free", "abc"), ("abcd", "v")]),
            descriptor(&[("user", "eve")]),
        ],
    );
    at.hits_addend = 10;
    at.descriptors[1].hits_addend = Some(2);
    let answered = passes(&server, at, "every bound at once").await;
    assert_eq!(answered.statuses[1].limit_remaining, 1);

    let status = ask(&server, of_size(201, true))
        .await
        .expect_err("201 bytes");
    assert_eq!(status.code(), tonic::Code::OutOfRange);
    assert!(status.message().contains("the limit is: 200 bytes"));
    passes(&server, of_size(200, false), "200 bytes").await;

    // None of the rejected requests counted ann.
    assert_eq!(remaining_after_hit(&server, "ann").await, 2);
    server.stop().await;
}

#[tokio::test]
async fn the_json_endpoint_applies_the_same_limits() {
    let server = TestServer::start(LIMITS).await;
    let entries: Vec<String> = (0..33)
        .map(|i| format!(r#"{{"key":"k{i}","value":"v"}}"#))
        .collect();
    let body = format!(
        r#"{{"domain":"shop","descriptors":[{{"entries":[{{"key":"user","value":"ann"}}]}},{{"entries":[{}]}}]}}"#,
        entries.join(",")
    );
    let (status, text) = common::http_post(server.http, "/json", &body).await;
    assert_eq!(status, 400, "{text}");
    assert_eq!(
        text,
        "descriptor 1 has 33 entries; at most 32 are allowed (--max-entries)"
    );
    assert_eq!(remaining_after_hit(&server, "ann").await, 2);
    server.stop().await;
}

/// Kills the spawned `rlsd` when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_takes_limits_from_flags_and_environment() {
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("free port")
    };
    let (grpc, http) = (free(), free());
    let _child = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_rlsd"))
            .args(["serve", "--config", "examples/three-layer.yaml"])
            .args(["--max-entries", "2", "--max-message-bytes", "300"])
            .env("RLSD_GRPC_ADDR", grpc.to_string())
            .env("RLSD_HTTP_ADDR", http.to_string())
            .env("RLSD_MAX_HITS_ADDEND", "5")
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn rlsd"),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut client = loop {
        if let Ok(client) =
            rlsd::pb::RateLimitServiceClient::connect(format!("http://{grpc}")).await
        {
            break client;
        }
        assert!(std::time::Instant::now() < deadline, "rlsd did not come up");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let mut ask = async |req: RateLimitRequest| {
        client
            .should_rate_limit(req)
            .await
            .map(tonic::Response::into_inner)
    };
    let edge = || descriptor(&[("remote_address", "10.0.0.1")]);

    let three = request("edge-proxy", vec![entries(3)]);
    let status = ask(three).await.expect_err("3 entries");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "descriptor 0 has 3 entries; at most 2 are allowed (--max-entries)"
    );

    let mut six = request("edge-proxy", vec![edge()]);
    six.hits_addend = 6;
    let status = ask(six).await.expect_err("hits 6");
    assert_eq!(
        status.message(),
        "request hits_addend is 6; at most 5 is allowed (--max-hits-addend)"
    );

    let status = ask(of_size(301, false)).await.expect_err("301 bytes");
    assert_eq!(status.code(), tonic::Code::OutOfRange);
    assert!(status.message().contains("the limit is: 300 bytes"));

    let mut five = request("edge-proxy", vec![edge()]);
    five.hits_addend = 5;
    let answered = ask(five).await.expect("at every bound");
    assert_eq!(answered.statuses[0].limit_remaining, 995);
    ask(of_size(300, false)).await.expect("300 bytes");
}
