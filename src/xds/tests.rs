use prost::Message as _;

use super::*;
use crate::config::LoadOptions;
use crate::pb::ratelimit::config::ratelimit::v3::RateLimitReplace;

fn descriptor(key: &str, value: &str, unit: RateLimitUnit, per_unit: u32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.to_owned(),
        value: value.to_owned(),
        rate_limit: Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: per_unit,
            ..RateLimitPolicy::default()
        }),
        ..RateLimitDescriptor::default()
    }
}

fn response(version: &str, resources: &[RateLimitConfig]) -> DiscoveryResponse {
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
        nonce: "n1".to_owned(),
        ..DiscoveryResponse::default()
    }
}

fn resource(name: &str, domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitConfig {
    RateLimitConfig {
        name: name.to_owned(),
        domain: domain.to_owned(),
        descriptors,
    }
}

#[test]
fn a_pushed_set_loads_like_the_files_it_stands_for() {
    let mut nested = descriptor("remote_address", "", RateLimitUnit::Second, 5);
    nested.descriptors = vec![descriptor("path", "/a \"b\": c", RateLimitUnit::Week, 7)];
    let mut named = descriptor("plan", "gold", RateLimitUnit::Hour, 100);
    if let Some(policy) = &mut named.rate_limit {
        policy.name = "gold".to_owned();
        policy.replaces = vec![RateLimitReplace {
            name: "other".to_owned(),
        }];
    }
    named.shadow_mode = true;
    let mut other = descriptor("plan", "silver", RateLimitUnit::Minute, 10);
    if let Some(policy) = &mut other.rate_limit {
        policy.name = "other".to_owned();
    }
    let set = response(
        "v7",
        &[
            resource("edge", "edge", vec![nested]),
            resource("", "plans", vec![named, other]),
        ],
    );
    let config = load_response(&set, LoadOptions::default()).unwrap();
    assert_eq!(config.domains.len(), 2);
    assert_eq!(config.domains["edge"].source, "xds:edge version v7");
    assert_eq!(config.domains["plans"].source, "xds:plans version v7");
    let described = crate::admin::describe(&config);
    assert!(
        described.contains("edge.remote_address: 5 per second (fixed_window)"),
        "{described}"
    );
    assert!(
        described.contains("edge.remote_address.path_/a \"b\": c: 7 per week"),
        "{described}"
    );
    assert!(
        described.contains("plans.plan_gold: 100 per hour (fixed_window) name \"gold\" [shadow] replaces [\"other\"]"),
        "{described}"
    );
}

#[test]
fn a_bad_set_is_refused_with_the_loaders_reason_named_by_resource() {
    let bad = descriptor("k", "v", RateLimitUnit::Unknown, 10);
    let error = load_response(
        &response("2", &[resource("bad-one", "d", vec![bad])]),
        LoadOptions::default(),
    )
    .err()
    .unwrap();
    assert!(error.starts_with("xds:bad-one:"), "{error}");
    assert!(error.contains("unit"), "{error}");

    let twice = response(
        "3",
        &[resource("a", "same", vec![]), resource("b", "same", vec![])],
    );
    let error = load_response(&twice, LoadOptions::default()).err().unwrap();
    assert!(error.contains("duplicate domain 'same'"), "{error}");

    let no_domain = response("4", &[resource("x", "", vec![])]);
    assert!(load_response(&no_domain, LoadOptions::default()).is_err());
}

#[test]
fn a_wrong_type_or_garbage_resource_is_refused() {
    let mut wrong = response("1", &[resource("a", "a", vec![])]);
    wrong.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_owned();
    let error = load_response(&wrong, LoadOptions::default()).err().unwrap();
    assert!(error.contains("envoy.config.cluster.v3.Cluster"), "{error}");

    let mut inner = response("1", &[resource("a", "a", vec![])]);
    inner.resources[0].type_url = "type.googleapis.com/google.protobuf.Empty".to_owned();
    assert!(load_response(&inner, LoadOptions::default()).is_err());

    let mut garbage = response("1", &[]);
    garbage.resources.push(prost_types::Any {
        type_url: TYPE_URL.to_owned(),
        value: vec![0xff, 0xff, 0xff, 0xff],
    });
    let error = load_response(&garbage, LoadOptions::default())
        .err()
        .unwrap();
    assert!(error.contains("not a RateLimitConfig"), "{error}");
}

#[test]
fn no_resources_is_an_empty_config() {
    let config = load_response(&response("9", &[]), LoadOptions::default()).unwrap();
    assert!(config.domains.is_empty());
}

#[test]
fn pairs_take_either_separator() {
    assert_eq!(
        parse_pairs("a:1, b=2,c:x=y,").unwrap(),
        vec![
            ("a".to_owned(), "1".to_owned()),
            ("b".to_owned(), "2".to_owned()),
            ("c".to_owned(), "x=y".to_owned()),
        ]
    );
    assert!(parse_pairs("novalue").is_err());
    assert!(parse_pairs(":v").is_err());
    assert!(parse_pairs("").unwrap().is_empty());
}

#[test]
fn quota_mode_and_metadata_come_over_xds_as_in_files() {
    use prost_types::value::Kind;
    let mut quota = descriptor("model", "small", RateLimitUnit::Hour, 2);
    quota.quota_mode = true;
    quota.metadata = Some(prost_types::Struct {
        fields: [
            (
                "tier".to_owned(),
                prost_types::Value {
                    kind: Some(Kind::StringValue("small \"s\"".to_owned())),
                },
            ),
            (
                "cost".to_owned(),
                prost_types::Value {
                    kind: Some(Kind::NumberValue(1.5)),
                },
            ),
        ]
        .into(),
    });
    let config = load_response(
        &response("1", &[resource("ai", "ai", vec![quota])]),
        LoadOptions::default(),
    )
    .unwrap();
    let described = crate::admin::describe(&config);
    assert!(
        described.contains("ai.model_small: 2 per hour (fixed_window) [quota]"),
        "{described}"
    );
    let node = &config.domains["ai"].root.keys["model"].exact["small"];
    let metadata = node.metadata.as_ref().expect("metadata");
    assert_eq!(metadata.fields.len(), 2);
    assert_eq!(
        metadata.fields["tier"].kind,
        Some(Kind::StringValue("small \"s\"".to_owned()))
    );
    assert_eq!(metadata.fields["cost"].kind, Some(Kind::NumberValue(1.5)));
}

fn retry_settings(jitter: f64) -> XdsSettings {
    XdsSettings {
        server: "localhost:18000".to_owned(),
        node_id: "n".to_owned(),
        node_metadata: Vec::new(),
        retry_interval: Duration::from_secs(3),
        retry_max: Duration::from_secs(60),
        retry_jitter: jitter,
        headers: Vec::new(),
        tls: None,
        max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        merge_domains: false,
    }
}

#[test]
fn reconnects_back_off_from_the_interval_to_the_ceiling() {
    let settings = retry_settings(0.0);
    let waits: Vec<u64> = (0..8)
        .map(|losses| backoff(&settings, losses, 0.3).as_secs())
        .collect();
    // After a stream that brought a response, and after the first loss: the interval.
    assert_eq!(waits, [3, 3, 6, 12, 24, 48, 60, 60]);
    assert_eq!(backoff(&settings, u32::MAX, 0.3), Duration::from_secs(60));
    // A ceiling below the interval leaves the interval.
    let settings = XdsSettings {
        retry_max: Duration::from_secs(1),
        ..settings
    };
    assert_eq!(backoff(&settings, 5, 0.3), Duration::from_secs(3));
}

#[test]
fn jitter_spreads_each_wait_over_its_fraction() {
    let settings = retry_settings(0.5);
    assert_eq!(backoff(&settings, 3, 0.0), Duration::from_secs(6));
    assert_eq!(backoff(&settings, 3, 0.5), Duration::from_secs(12));
    assert_eq!(backoff(&settings, 3, 1.0), Duration::from_secs(18));
    assert_eq!(
        backoff(&retry_settings(0.0), 3, 1.0),
        Duration::from_secs(12)
    );
    // Near the ceiling the spread only shortens; a zero interval still waits.
    assert_eq!(backoff(&settings, 7, 1.0), Duration::from_secs(60));
    assert_eq!(backoff(&settings, 7, 0.0), Duration::from_secs(30));
    let zero = XdsSettings {
        retry_interval: Duration::ZERO,
        ..retry_settings(0.0)
    };
    assert_eq!(backoff(&zero, 1, 0.0), MIN_RETRY);
}
