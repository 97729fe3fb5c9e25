//! Matching and planning, table-driven over one config.

use super::*;
use crate::config::{Config, load_str};
use crate::limit::Algorithm;

const TREE: &str = r#"
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1, name: default-k}
  - key: k
    value: exact
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k
    value: pre*
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    value: "*fix"
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: k
    value: a*b*c
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: parent
    value: p
    descriptors:
      - key: child
        rate_limit: {unit: minute, requests_per_unit: 6}
      - key: child
        value: special
        descriptors:
          - key: grandchild
            rate_limit: {unit: hour, requests_per_unit: 7}
  - key: parent
    descriptors:
      - key: child
        rate_limit: {unit: minute, requests_per_unit: 8}
  - key: white
    value: listed
  - key: multi
    rate_limits:
      - {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}
      - {unit: hour, requests_per_unit: 1000, algorithm: sliding_window_counter}
  - key: twin
    rate_limits:
      - {unit: minute, requests_per_unit: 10}
      - {unit: minute, requests_per_unit: 5, shadow_mode: true}
"#;

fn config() -> Config {
    config_of(TREE)
}

/// A config of the one domain `yaml` defines.
fn config_of(yaml: &str) -> Config {
    let domain = load_str("test.yaml", yaml).expect("valid config");
    let mut config = Config::default();
    config.domains.insert(domain.name.clone(), domain);
    config
}

fn entries(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The requests_per_unit of each limit a descriptor lands on; empty for no limit.
fn limits_for(config: &Config, pairs: &[(&str, &str)]) -> Vec<u32> {
    let root = &config.domains["d"].root;
    match matcher::find(root, &entries(pairs)).and_then(|node| node.policy.as_ref()) {
        Some(Policy::Limits(limits)) => limits.iter().map(|l| l.requests_per_unit).collect(),
        _ => Vec::new(),
    }
}

#[test]
fn matching_follows_exact_then_wildcards_then_default_and_the_last_entry_rule() {
    let config = config();
    type Row = (&'static [(&'static str, &'static str)], &'static [u32]);
    let table: &[Row] = &[
        (&[("k", "exact")], &[2]),
        (&[("k", "prefix")], &[3]),
        (&[("k", "pre")], &[3]),
        (&[("k", "suffix")], &[4]),
        (&[("k", "fix")], &[4]),
        (&[("k", "a--b--c")], &[5]),
        (&[("k", "abc")], &[5]),
        (&[("k", "a--c--b")], &[1]),
        (&[("k", "anything")], &[1]),
        (&[("k", "")], &[1]),
        (&[("nokey", "x")], &[]),
        // Last-entry rule: the parent has no limit of its own.
        (&[("parent", "p")], &[]),
        (&[("parent", "p"), ("child", "c")], &[6]),
        (&[("parent", "other"), ("child", "c")], &[8]),
        (&[("parent", "p"), ("child", "special")], &[]),
        (
            &[("parent", "p"), ("child", "special"), ("grandchild", "g")],
            &[7],
        ),
        // Deeper than the tree.
        (&[("parent", "p"), ("child", "c"), ("extra", "e")], &[]),
        (&[("k", "exact"), ("extra", "e")], &[]),
        // Exact match at a level wins even if it leads nowhere; no fallback to the default.
        (&[("parent", "p"), ("nochild", "c")], &[]),
        (&[("white", "listed")], &[]),
        (&[("multi", "m")], &[10, 1000]),
    ];
    for (request, expected) in table {
        assert_eq!(limits_for(&config, request), *expected, "{request:?}");
    }
}

fn plan_one(config: &Config, descriptor: Descriptor, request_hits: u32) -> Plan<'_> {
    let request = Request {
        domain: "d".to_owned(),
        descriptors: vec![descriptor],
        hits_addend: request_hits,
    };
    plan(config, &request, &KeySettings::default())
}

#[test]
fn several_limits_on_one_descriptor_become_several_checks() {
    let config = config();
    let descriptor = Descriptor {
        entries: entries(&[("multi", "m")]),
        ..Default::default()
    };
    let plan = plan_one(&config, descriptor, 0);
    assert_eq!(plan.decisions, [Decision::Checks(0..2)]);
    let algorithms: Vec<_> = plan.checks.iter().map(|c| c.params.algorithm).collect();
    assert_eq!(
        algorithms,
        [Algorithm::TokenBucket, Algorithm::SlidingWindowCounter]
    );
    assert_eq!(plan.checks[0].params.burst, 20);
    assert_ne!(plan.checks[0].key, plan.checks[1].key);
}

#[test]
fn limits_sharing_algorithm_and_period_have_separate_keys() {
    let config = config();
    let descriptor = Descriptor {
        entries: entries(&[("twin", "t")]),
        ..Default::default()
    };
    let plan = plan_one(&config, descriptor, 0);
    let keys: Vec<&str> = plan.checks.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(keys, ["rlsd:_:d:fw:60:twin=t", "rlsd:_:d:fw:60~1:twin=t"]);
}

#[test]
fn hits_come_from_the_descriptor_then_the_request_then_one() {
    let config = config();
    let with = |hits_addend, refund, request_hits| {
        let descriptor = Descriptor {
            entries: entries(&[("k", "exact")]),
            hits_addend,
            refund,
            ..Default::default()
        };
        plan_one(&config, descriptor, request_hits).checks[0].hits
    };
    assert_eq!(with(None, false, 0), Hits::Take(1));
    assert_eq!(with(None, false, 4), Hits::Take(4));
    // A descriptor's own hits are a charge (the limit's default `charge: descriptor_hits`).
    assert_eq!(with(Some(2), false, 4), Hits::Charge(2));
    assert_eq!(with(Some(0), false, 4), Hits::Peek);
    assert_eq!(with(Some(3), true, 0), Hits::Refund(3));
    assert_eq!(with(None, true, 5), Hits::Refund(5));
}

#[test]
fn keys_are_injective_and_free_of_hash_tags() {
    let config = config();
    let key_of = |pairs: &[(&str, &str)]| {
        let descriptor = Descriptor {
            entries: entries(pairs),
            limit_override: Some(LimitOverride {
                requests_per_unit: 1,
                unit: Unit::Second,
            }),
            ..Default::default()
        };
        plan_one(&config, descriptor, 0).checks[0].key.clone()
    };
    let a = key_of(&[("a", "b:c")]);
    let b = key_of(&[("a", "b"), ("c", "")]);
    let c = key_of(&[("a=b", "c")]);
    let d = key_of(&[("a", "b=c")]);
    let all = [&a, &b, &c, &d];
    for (i, x) in all.iter().enumerate() {
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
    let tagged = key_of(&[("user", "{victim}")]);
    assert!(!tagged.contains('{') && !tagged.contains('}'), "{tagged}");
    assert!(a.starts_with("rlsd:_:d:fw:1:"), "{a}");
}

#[test]
fn unknown_domains_plan_nothing() {
    let config = config();
    let request = Request {
        domain: "other".to_owned(),
        descriptors: vec![Descriptor::default(); 2],
        hits_addend: 0,
    };
    let plan = plan(&config, &request, &KeySettings::default());
    assert!(plan.checks.is_empty());
    assert_eq!(plan.decisions, [Decision::NoLimit, Decision::NoLimit]);
}

/// envoyproxy/ratelimit's `share_threshold` and `value_to_metric`, with `detailed_metric` beside.
const SHARING: &str = r#"
domain: d
descriptors:
  - key: path
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: path
    value: models/*
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: path
    value: shared*detailed
    share_threshold: true
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: path
    value: exact
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: path
    value_to_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: tenant
    value: t-*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: user
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: model
    value: gpt-*
    value_to_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: group
    value: g*
    share_threshold: true
    descriptors:
      - key: member
        detailed_metric: true
        rate_limit: {unit: hour, requests_per_unit: 100}
  - key: route
    value_to_metric: true
    descriptors:
      - key: method
        descriptors:
          - key: user
            value: u*
            rate_limit: {unit: minute, requests_per_unit: 60}
"#;

/// The store key and metric path of the one check a descriptor of `SHARING` plans.
fn key_and_path(pairs: &[(&str, &str)]) -> (String, String) {
    let config = config_of(SHARING);
    let descriptor = Descriptor {
        entries: entries(pairs),
        ..Default::default()
    };
    let plan = plan_one(&config, descriptor, 0);
    assert_eq!(plan.checks.len(), 1, "{pairs:?}");
    let path = plan.limits[0].path.as_deref().expect("a config path");
    (plan.checks[0].key.clone(), path.to_owned())
}

#[test]
fn share_threshold_keys_every_value_its_wildcard_matches_as_the_pattern() {
    let (a, a_path) = key_and_path(&[("path", "files/a.pdf")]);
    let (b, b_path) = key_and_path(&[("path", "files/b.csv")]);
    assert_eq!(a, "rlsd:_:d:fw:3600:path=files/*");
    assert_eq!(b, a);
    assert_eq!(
        (a_path.as_str(), b_path.as_str()),
        ("d.path_files/*", "d.path_files/*")
    );
    // Without share_threshold each value keeps a counter of its own.
    let (m, m_path) = key_and_path(&[("path", "models/x")]);
    let (n, _) = key_and_path(&[("path", "models/y")]);
    assert_eq!(m, "rlsd:_:d:fw:3600:path=models/x");
    assert_ne!(m, n);
    assert_eq!(m_path, "d.path_models/*");
    // A shared parent: the child's key carries the pattern for the parent's entry, and
    // value_to_metric on the shared node still shows the pattern (a shared threshold has one
    // series), while the child's own value_to_metric shows its value.
    let (t1, t1_path) = key_and_path(&[("tenant", "t-1"), ("user", "alice")]);
    let (t2, _) = key_and_path(&[("tenant", "t-2"), ("user", "alice")]);
    let (t3, _) = key_and_path(&[("tenant", "t-2"), ("user", "bob")]);
    assert_eq!(t1, "rlsd:_:d:fw:60:tenant=t-*:user=alice");
    assert_eq!(t2, t1);
    assert_ne!(t3, t1);
    assert_eq!(t1_path, "d.tenant_t-*.user_alice");
    // detailed_metric with share_threshold: the pattern, not the value; and then, as theirs
    // writes it, an empty value as the bare key.
    let (_, detailed) = key_and_path(&[("path", "shared-x-detailed")]);
    assert_eq!(detailed, "d.path_shared*detailed");
    let (key, detailed) = key_and_path(&[("group", "g7"), ("member", "")]);
    assert_eq!(key, "rlsd:_:d:fw:3600:group=g*:member=");
    assert_eq!(detailed, "d.group_g*.member");
}

#[test]
fn value_to_metric_puts_the_values_it_names_in_the_metric_path() {
    // A default node: the value instead of the bare key; the key itself is unchanged.
    let (key, path) = key_and_path(&[("path", "/api/v1")]);
    assert_eq!(key, "rlsd:_:d:fw:3600:path=/api/v1");
    assert_eq!(path, "d.path_/api/v1");
    // An exact node is already labelled with its value.
    assert_eq!(key_and_path(&[("path", "exact")]).1, "d.path_exact");
    // A wildcard that is not shared shows the value when asked to.
    assert_eq!(key_and_path(&[("model", "gpt-5")]).1, "d.model_gpt-5");
    // Only the levels that ask: route's value, method as the bare key, user's pattern.
    let (_, path) = key_and_path(&[("route", "/login"), ("method", "POST"), ("user", "u42")]);
    assert_eq!(path, "d.route_/login.method.user_u*");
}

#[test]
fn detailed_metric_paths_carry_the_requests_own_entries() {
    // With a plans table the descriptor is matched as [plan, api_key], but the detailed path
    // stays the request's own entries (an empty value keeps its `_`, as theirs writes it).
    let config = config_of(
        r#"
domain: d
plans: {from: api_key, entry: plan, default: pro, keys: {k1: pro}}
descriptors:
  - key: plan
    value: pro
    descriptors:
      - key: api_key
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tenant
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
"#,
    );
    let path_of = |pairs: &[(&str, &str)]| {
        let descriptor = Descriptor {
            entries: entries(pairs),
            ..Default::default()
        };
        let plan = plan_one(&config, descriptor, 0);
        plan.limits[0].path.as_deref().map(str::to_owned)
    };
    assert_eq!(
        path_of(&[("api_key", "k1")]).as_deref(),
        Some("d.api_key_k1")
    );
    assert_eq!(path_of(&[("tenant", "")]).as_deref(), Some("d.tenant_"));
}

#[test]
fn the_default_charge_applies_to_limits_that_do_not_say() {
    let config = config_of(
        "domain: d\ndescriptors:\n  - key: unset\n    rate_limit: {unit: hour, requests_per_unit: 5}\n  - key: never\n    rate_limit: {unit: hour, requests_per_unit: 5, charge: never}\n",
    );
    let hits = |key: &str, default_charge| {
        let request = Request {
            domain: "d".to_owned(),
            descriptors: vec![Descriptor {
                entries: entries(&[(key, "v")]),
                ..Default::default()
            }],
            hits_addend: 3,
        };
        let keys = KeySettings {
            default_charge,
            ..KeySettings::default()
        };
        plan(&config, &request, &keys).checks[0].hits
    };
    assert_eq!(hits("unset", Charge::DescriptorHits), Hits::Take(3));
    assert_eq!(hits("unset", Charge::Always), Hits::Charge(3));
    // A limit's own `charge:` wins.
    assert_eq!(hits("never", Charge::Always), Hits::Take(3));
    // Envoy's override, which carries no mode, takes the default too.
    let request = Request {
        domain: "d".to_owned(),
        descriptors: vec![Descriptor {
            entries: entries(&[("other", "v")]),
            limit_override: Some(LimitOverride {
                requests_per_unit: 1,
                unit: Unit::Hour,
            }),
            ..Default::default()
        }],
        hits_addend: 2,
    };
    let keys = KeySettings {
        default_charge: Charge::Always,
        ..KeySettings::default()
    };
    assert_eq!(
        plan(&config, &request, &keys).checks[0].hits,
        Hits::Charge(2)
    );
}
