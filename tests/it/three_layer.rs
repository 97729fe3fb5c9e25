//! The example three-layer policy over gRPC: every layer must pass, and a request denied by one
//! layer costs nothing in the others.

use crate::common;

use common::{TestServer, descriptor, request};
use rlsd::pb::RateLimitRequest;
use rlsd::pb::rate_limit_response::Code;

const POLICY: &str = include_str!("../../examples/three-layer.yaml");

fn layered(ip: &str, plan: &str, key: &str, endpoint: &str) -> RateLimitRequest {
    request(
        "edge-proxy",
        vec![
            descriptor(&[("remote_address", ip)]),
            descriptor(&[("plan", plan), ("api_key", key)]),
            descriptor(&[("endpoint", endpoint), ("api_key", key)]),
        ],
    )
}

#[tokio::test]
async fn an_endpoint_denial_leaves_plan_and_edge_quota_untouched() {
    let server = TestServer::start(POLICY).await;
    let mut client = server.client().await;
    for i in 0..12 {
        let response = client
            .should_rate_limit(layered("10.0.0.1", "free", "k1", "export"))
            .await
            .expect("answer")
            .into_inner();
        let expected = if i < 5 { Code::Ok } else { Code::OverLimit };
        assert_eq!(response.overall_code, expected as i32, "request {i}");
        let [edge, plan, endpoint] = &response.statuses[..] else {
            panic!("three statuses")
        };
        // Only the five allowed requests were charged to the edge and plan layers.
        let charged = (i + 1).min(5);
        assert_eq!(edge.limit_remaining, 1000 - charged, "edge after {i}");
        assert_eq!(plan.limit_remaining, 60 - charged, "plan after {i}");
        assert_eq!(edge.code, Code::Ok as i32);
        assert_eq!(plan.code, Code::Ok as i32);
        let endpoint_code = if i < 5 { Code::Ok } else { Code::OverLimit };
        assert_eq!(endpoint.code, endpoint_code as i32);
    }
    server.stop().await;
}

#[tokio::test]
async fn plans_differ_and_the_edge_spans_api_keys() {
    let server = TestServer::start(POLICY).await;
    let mut client = server.client().await;
    let plan_remaining =
        |response: &rlsd::pb::RateLimitResponse| response.statuses[1].limit_remaining;
    let free = client
        .should_rate_limit(layered("10.0.0.2", "free", "free-key", "search"))
        .await
        .expect("answer")
        .into_inner();
    let pro = client
        .should_rate_limit(layered("10.0.0.2", "pro", "pro-key", "search"))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(plan_remaining(&free), 59);
    assert_eq!(plan_remaining(&pro), 599);
    // Both keys came from one IP: the edge layer counted both.
    assert_eq!(pro.statuses[0].limit_remaining, 998);
    server.stop().await;
}

#[tokio::test]
async fn the_plan_table_decides_when_envoy_sends_only_the_api_key() {
    let server = TestServer::start(POLICY).await;
    let mut client = server.client().await;
    let plan_of = |key: &str| request("edge-proxy", vec![descriptor(&[("api_key", key)])]);
    let listed = client
        .should_rate_limit(plan_of("k-acme-prod"))
        .await
        .expect("answer")
        .into_inner();
    let unlisted = client
        .should_rate_limit(plan_of("k-unknown"))
        .await
        .expect("answer")
        .into_inner();
    let limit =
        |r: &rlsd::pb::RateLimitResponse| r.statuses[0].current_limit.clone().expect("limited");
    assert_eq!(limit(&listed).name, "plan-pro");
    assert_eq!(listed.statuses[0].limit_remaining, 599);
    assert_eq!(limit(&unlisted).name, "plan-free");
    assert_eq!(unlisted.statuses[0].limit_remaining, 59);
    // The table and Envoy's own plan entry share one counter.
    let explicit = client
        .should_rate_limit(request(
            "edge-proxy",
            vec![descriptor(&[("plan", "pro"), ("api_key", "k-acme-prod")])],
        ))
        .await
        .expect("answer")
        .into_inner();
    assert_eq!(explicit.statuses[0].limit_remaining, 598);
    server.stop().await;
}

#[tokio::test]
async fn each_layer_is_its_own_key_namespace() {
    use rlsd::engine::{Descriptor, KeySettings, Request};
    let domain = rlsd::config::load_str("three-layer.yaml", POLICY).expect("valid");
    let mut config = rlsd::config::Config::default();
    config.domains.insert(domain.name.clone(), domain);
    let entries = |pairs: &[(&str, &str)]| Descriptor {
        entries: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    let request = Request {
        domain: "edge-proxy".to_owned(),
        descriptors: vec![
            entries(&[("remote_address", "10.0.0.1")]),
            entries(&[("plan", "free"), ("api_key", "k")]),
            entries(&[("endpoint", "search"), ("api_key", "k")]),
        ],
        hits_addend: 0,
    };
    let plan = rlsd::engine::plan(&config, &request, &KeySettings::default());
    let layers: Vec<&str> = plan
        .checks
        .iter()
        .map(|c| c.key.split(':').nth(1).expect("layer"))
        .collect();
    assert_eq!(layers, ["edge", "plan", "endpoint"]);
}
