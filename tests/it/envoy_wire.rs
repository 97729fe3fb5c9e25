//! Wire compatibility: a client built from Envoy's own generated API (the `envoy-types` crate)
//! calls rlsd and reads every field rlsd promises.

use crate::common;

use common::{T0, TestServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor,
    rate_limit_descriptor::{Entry, RateLimitOverride},
};
use envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest,
    rate_limit_response::{Code, rate_limit::Unit},
    rate_limit_service_client::RateLimitServiceClient,
};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::UInt64Value;

const CONFIG: &str = r#"
domain: envoy
descriptors:
  - key: remote_address
    rate_limit:
      name: edge
      unit: week
      requests_per_unit: 4
"#;

fn descriptor(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![Entry {
            key: key.to_owned(),
            value: value.to_owned(),
        }],
        ..Default::default()
    }
}

#[tokio::test]
async fn envoys_own_client_speaks_to_rlsd() {
    let server = TestServer::start(CONFIG).await;
    server.clock.set(T0);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("connect");

    let mut two_hits = descriptor("remote_address", "10.0.0.1");
    two_hits.hits_addend = Some(UInt64Value { value: 2 });
    let mut overridden = descriptor("anything", "x");
    overridden.limit = Some(RateLimitOverride {
        requests_per_unit: 9,
        unit: RateLimitUnit::Minute as i32,
    });
    let response = client
        .should_rate_limit(RateLimitRequest {
            domain: "envoy".to_owned(),
            descriptors: vec![two_hits.clone(), overridden, descriptor("unknown", "y")],
            hits_addend: 1,
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(response.overall_code(), Code::Ok);
    assert_eq!(response.statuses.len(), 3);
    let edge = &response.statuses[0];
    assert_eq!(edge.code(), Code::Ok);
    assert_eq!(edge.limit_remaining, 2);
    let limit = edge.current_limit.as_ref().expect("current_limit");
    assert_eq!(limit.name, "edge");
    assert_eq!(limit.requests_per_unit, 4);
    assert_eq!(limit.unit(), Unit::Week);
    let reset = edge.duration_until_reset.expect("duration_until_reset");
    assert!(
        reset.seconds > 0 && reset.seconds <= 7 * 86_400,
        "{reset:?}"
    );
    let over = &response.statuses[1];
    assert_eq!(
        over.current_limit
            .as_ref()
            .map(|l| (l.requests_per_unit, l.unit())),
        Some((9, Unit::Minute))
    );
    assert_eq!(over.limit_remaining, 8);
    assert!(response.statuses[2].current_limit.is_none());
    assert!(
        response
            .response_headers_to_add
            .iter()
            .any(|h| h.key == "x-ratelimit-remaining")
    );

    // Two more hits use the quota up; then a refund (is_negative_hits) gives one back.
    client
        .should_rate_limit(RateLimitRequest {
            domain: "envoy".to_owned(),
            descriptors: vec![two_hits],
            hits_addend: 0,
        })
        .await
        .expect("answer");
    let denied = client
        .should_rate_limit(RateLimitRequest {
            domain: "envoy".to_owned(),
            descriptors: vec![descriptor("remote_address", "10.0.0.1")],
            hits_addend: 0,
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(denied.overall_code(), Code::OverLimit);
    assert!(
        denied
            .response_headers_to_add
            .iter()
            .any(|h| h.key == "retry-after")
    );
    let mut refund = descriptor("remote_address", "10.0.0.1");
    refund.hits_addend = Some(UInt64Value { value: 1 });
    refund.is_negative_hits = true;
    let refunded = client
        .should_rate_limit(RateLimitRequest {
            domain: "envoy".to_owned(),
            descriptors: vec![refund],
            hits_addend: 0,
        })
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(refunded.statuses[0].limit_remaining, 1);

    let invalid = client
        .should_rate_limit(RateLimitRequest {
            domain: String::new(),
            descriptors: vec![descriptor("a", "b")],
            hits_addend: 0,
        })
        .await
        .expect_err("empty domain");
    assert_eq!(invalid.code(), tonic::Code::InvalidArgument);
    server.stop().await;
}
