//! Tests of the config loader and of wildcard matching.

use std::num::NonZeroU32;
use std::path::Path;

use super::{
    ConfigError, ConfigErrors, Domain, Level, LoadOptions, Node, Policy, Wildcard, load_path,
    load_str,
};
use crate::limit::{Algorithm, Limit, Period, Unit};

const ENVOY_EXAMPLE: &str = include_str!("../../tests/fixtures/config/envoy_example.yaml");
const RLSD_EXTENSIONS: &str = include_str!("../../tests/fixtures/config/rlsd_extensions.yaml");

/// Strips the common indentation (and a leading newline), so YAML can be written indented.
fn dedent(text: &str) -> String {
    let text = text.strip_prefix('\n').unwrap_or(text);
    let indent = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.len() - line.trim_start().len())
        .min()
        .unwrap_or(0);
    let mut out = String::new();
    for line in text.lines() {
        out.push_str(line.get(indent..).unwrap_or(""));
        out.push('\n');
    }
    out
}

fn load(yaml: &str) -> Domain {
    match load_str("test.yaml", &dedent(yaml)) {
        Ok(domain) => domain,
        Err(errors) => panic!("unexpected errors:\n{}", ConfigErrors(errors)),
    }
}

fn errors(yaml: &str) -> Vec<ConfigError> {
    match load_str("test.yaml", &dedent(yaml)) {
        Ok(domain) => panic!("expected errors, loaded {domain:?}"),
        Err(errors) => {
            assert!(!errors.is_empty());
            errors
        }
    }
}

/// Asserts the file has exactly one error, at `line`, containing `reason`.
#[track_caller]
fn one_error(yaml: &str, line: u64, reason: &str) -> ConfigError {
    let errors = errors(yaml);
    assert_eq!(
        errors.len(),
        1,
        "expected one error, got:\n{}",
        ConfigErrors(errors.clone())
    );
    let error = errors.into_iter().next().unwrap();
    assert!(
        error.reason.contains(reason),
        "{error} does not contain {reason:?}"
    );
    assert_eq!(error.line, line, "wrong line: {error}");
    assert_eq!(error.file, "test.yaml");
    error
}

fn exact<'a>(level: &'a Level, key: &str, value: &str) -> &'a Node {
    level.keys[key]
        .exact
        .get(value)
        .unwrap_or_else(|| panic!("no {key}={value}"))
}

fn default<'a>(level: &'a Level, key: &str) -> &'a Node {
    level.keys[key]
        .default
        .as_deref()
        .unwrap_or_else(|| panic!("no default {key}"))
}

fn limits(node: &Node) -> &[Limit] {
    match &node.policy {
        Some(Policy::Limits(limits)) => limits,
        other => panic!("{}: not limits: {other:?}", node.path),
    }
}

fn only_limit(node: &Node) -> &Limit {
    let limits = limits(node);
    assert_eq!(limits.len(), 1, "{}", node.path);
    &limits[0]
}

fn named(limit: Limit, name: &str) -> Limit {
    Limit {
        name: Some(name.to_owned()),
        ..limit
    }
}

// ---- good files ----

#[test]
fn envoy_example_loads_into_the_expected_tree() {
    let domain = match load_str("fixtures/envoy_example.yaml", ENVOY_EXAMPLE) {
        Ok(domain) => domain,
        Err(errors) => panic!("{}", ConfigErrors(errors)),
    };
    assert_eq!(domain.name, "mongo_cps");
    assert_eq!(domain.source, "fixtures/envoy_example.yaml");
    let root = &domain.root;
    let mut keys: Vec<_> = root.keys.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "client_id",
            "database",
            "destination_cluster",
            "path",
            "remote_address",
            "status"
        ]
    );

    let users = exact(root, "database", "users");
    assert_eq!(users.path, "mongo_cps.database_users");
    assert_eq!(
        *only_limit(users),
        named(Limit::fixed(500, Unit::Second), "users_db")
    );
    assert!(!users.detailed_metric);
    assert!(users.children.keys.is_empty());
    let db_default = exact(root, "database", "default");
    assert_eq!(db_default.path, "mongo_cps.database_default");
    assert_eq!(*only_limit(db_default), Limit::fixed(500, Unit::Second));
    assert!(root.keys["database"].default.is_none());

    let any_ip = default(root, "remote_address");
    assert_eq!(any_ip.path, "mongo_cps.remote_address");
    assert_eq!(*only_limit(any_ip), Limit::fixed(10, Unit::Minute));
    let blocked = exact(root, "remote_address", "50.0.0.5");
    assert_eq!(blocked.path, "mongo_cps.remote_address_50.0.0.5");
    assert_eq!(only_limit(blocked).requests_per_unit, 0);

    let paths = &root.keys["path"];
    assert!(paths.exact.is_empty() && paths.default.is_none());
    let patterns: Vec<_> = paths
        .wildcards
        .iter()
        .map(|(w, _)| w.pattern.as_str())
        .collect();
    assert_eq!(patterns, ["/api/v1/*", "/api/*/users", "*"]);
    let (_, v1) = &paths.wildcards[0];
    assert_eq!(v1.path, "mongo_cps.path_/api/v1/*");
    assert_eq!(*only_limit(v1), Limit::fixed(1000, Unit::Hour));
    let (star, any_path) = &paths.wildcards[2];
    assert!(star.matches("anything"));
    assert!(any_path.detailed_metric);
    assert_eq!(*only_limit(any_path), Limit::fixed(5, Unit::Day));

    let mock = exact(root, "destination_cluster", "mock");
    assert_eq!(mock.path, "mongo_cps.destination_cluster_mock");
    assert_eq!(
        mock.policy, None,
        "a node without rate_limit is a whitelist node"
    );
    let proxy = exact(&mock.children, "source_cluster", "proxy");
    assert_eq!(
        proxy.path,
        "mongo_cps.destination_cluster_mock.source_cluster_proxy"
    );
    let expected = Limit {
        shadow: true,
        ..named(Limit::fixed(100, Unit::Minute), "proxy_limit")
    };
    assert_eq!(
        *only_limit(proxy),
        expected,
        "descriptor shadow_mode applies to its limit"
    );
    let other_sources = default(&mock.children, "source_cluster");
    assert_eq!(
        other_sources.path,
        "mongo_cps.destination_cluster_mock.source_cluster"
    );
    assert_eq!(
        other_sources.policy,
        Some(Policy::Unlimited {
            name: Some("unlimited_sources".to_owned()),
            replaces: Vec::new(),
        })
    );

    let foo = exact(root, "client_id", "foo");
    assert_eq!(foo.policy, None);
    let foo_bar = exact(&foo.children, "path", "/foo/bar");
    assert_eq!(foo_bar.path, "mongo_cps.client_id_foo.path_/foo/bar");
    assert_eq!(
        *only_limit(foo_bar),
        Limit {
            replaces: vec!["client_default".to_owned()],
            ..named(Limit::fixed(10, Unit::Minute), "foo_bar")
        }
    );
    let any_client = default(root, "client_id");
    let any_path = default(&any_client.children, "path");
    assert_eq!(any_path.path, "mongo_cps.client_id.path");
    assert_eq!(
        *only_limit(any_path),
        named(Limit::fixed(1000, Unit::Minute), "client_default")
    );

    let ok = exact(root, "status", "200");
    assert_eq!(ok.path, "mongo_cps.status_200");
    assert_eq!(*only_limit(ok), Limit::fixed(u32::MAX, Unit::Year));
}

#[test]
fn rlsd_extensions_load() {
    let domain = match load_str("ext.yaml", RLSD_EXTENSIONS) {
        Ok(domain) => domain,
        Err(errors) => panic!("{}", ConfigErrors(errors)),
    };
    let root = &domain.root;
    let five_minutes = Period {
        unit: Unit::Minute,
        multiplier: NonZeroU32::new(5).unwrap(),
    };
    assert_eq!(
        limits(default(root, "user")),
        [
            Limit {
                name: Some("user_burst".to_owned()),
                requests_per_unit: 10,
                period: Period::of(Unit::Second),
                algorithm: Algorithm::TokenBucket,
                burst: NonZeroU32::new(20),
                shadow: true,
                replaces: vec![],
                quota_mode: false,
                variant: 0,
                charge: Default::default(),
            },
            Limit {
                name: Some("user_sustained".to_owned()),
                requests_per_unit: 1000,
                period: five_minutes,
                algorithm: Algorithm::SlidingWindowCounter,
                burst: None,
                shadow: true,
                replaces: vec![],
                quota_mode: false,
                variant: 0,
                charge: Default::default(),
            },
        ]
    );
    assert_eq!(five_minutes.seconds(), 300);
    assert_eq!(
        *only_limit(default(root, "tenant")),
        Limit {
            algorithm: Algorithm::Gcra,
            burst: NonZeroU32::new(5),
            shadow: true,
            ..Limit::fixed(50, Unit::Second)
        }
    );
    assert_eq!(
        *only_limit(default(root, "login")),
        Limit {
            algorithm: Algorithm::SlidingWindowLog,
            ..Limit::fixed(3, Unit::Hour)
        }
    );
    assert_eq!(
        *only_limit(default(root, "report")),
        Limit {
            algorithm: Algorithm::Gcra,
            ..Limit::fixed(1, Unit::Day)
        },
        "a one-entry rate_limits list"
    );
}

#[test]
fn per_limit_shadow_is_ored_with_the_descriptor() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: a
            shadow_mode: false
            rate_limits:
              - {unit: second, requests_per_unit: 1, shadow_mode: true}
              - {unit: second, requests_per_unit: 2}
        ",
    );
    let shadows: Vec<_> = limits(default(&domain.root, "a"))
        .iter()
        .map(|l| l.shadow)
        .collect();
    assert_eq!(shadows, [true, false]);
}

#[test]
fn quota_mode_and_metadata_load_as_envoyproxy_ratelimit_writes_them() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: a
            quota_mode: true
            metadata:
              owner: team-a
              nested: {weight: 2.5, enabled: true, none: null}
            rate_limits:
              - {unit: second, requests_per_unit: 1}
              - {unit: hour, requests_per_unit: 9}
          - key: b
            rate_limit: {unit: second, requests_per_unit: 1}
        ",
    );
    let a = default(&domain.root, "a");
    assert!(limits(a).iter().all(|limit| limit.quota_mode));
    assert!(!only_limit(default(&domain.root, "b")).quota_mode);
    let metadata = a.metadata.as_ref().expect("metadata");
    assert_eq!(
        metadata.fields["owner"].kind,
        Some(prost_types::value::Kind::StringValue("team-a".into()))
    );
    let Some(prost_types::value::Kind::StructValue(nested)) = &metadata.fields["nested"].kind
    else {
        panic!("{metadata:?}");
    };
    assert_eq!(nested.fields.len(), 3);
    assert_eq!(default(&domain.root, "b").metadata, None);
}

#[test]
fn bad_quota_mode_or_metadata_is_an_error_at_its_line() {
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            quota_mode: sometimes
            rate_limit: {unit: second, requests_per_unit: 1}
        ",
        4,
        "quota_mode must be true or false",
    );
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            metadata: [not, a, mapping]
        ",
        4,
        "metadata must be a mapping",
    );
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            metadata:
              ? [1]
              : one
        ",
        5,
        "metadata keys must be scalars, found a list",
    );
}

#[test]
fn scalar_keys_values_and_names_keep_their_spelling() {
    let domain = load(
        "
        domain: 42
        descriptors:
          - key: 7
            value: 0x10
            rate_limit: {unit: second, requests_per_unit: 1, name: 1.50}
          - key: flag
            value: yes
          - key: flag
            value: 'no'
          - key: code
            value: 200
            rate_limit: {unit: second, requests_per_unit: 0x10}
        ",
    );
    assert_eq!(domain.name, "42");
    let node = exact(&domain.root, "7", "0x10");
    assert_eq!(node.path, "42.7_0x10");
    assert_eq!(only_limit(node).name.as_deref(), Some("1.50"));
    exact(&domain.root, "flag", "yes");
    exact(&domain.root, "flag", "no");
    assert_eq!(
        only_limit(exact(&domain.root, "code", "200")).requests_per_unit,
        16
    );
}

#[test]
fn empty_or_null_value_is_the_default() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: a
            value: ''
          - key: b
            value:
          - key: c
            value: ~
            shadow_mode:
            rate_limit:
        ",
    );
    for key in ["a", "b", "c"] {
        let node = default(&domain.root, key);
        assert_eq!(node.path, format!("d.{key}"));
        assert_eq!(node.policy, None);
    }
}

#[test]
fn descriptors_are_optional() {
    assert!(load("domain: d\n").root.keys.is_empty());
    assert!(load("domain: d\ndescriptors: []\n").root.keys.is_empty());
    assert!(load("domain: d\ndescriptors:\n").root.keys.is_empty());
}

#[test]
fn unlimited_false_is_an_ordinary_limit() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: a
            rate_limit: {unlimited: false, unit: second, requests_per_unit: 3}
          - key: b
            rate_limits: [{unlimited: true}]
        ",
    );
    assert_eq!(
        *only_limit(default(&domain.root, "a")),
        Limit::fixed(3, Unit::Second)
    );
    assert_eq!(
        default(&domain.root, "b").policy,
        Some(Policy::Unlimited {
            name: None,
            replaces: Vec::new()
        })
    );
}

#[test]
fn replaces_may_target_limits_anywhere_in_the_domain() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: a
            descriptors:
              - key: b
                rate_limit:
                  unit: second
                  requests_per_unit: 1
                  replaces: [{name: later}, {name: free}]
          - key: c
            rate_limit: {unit: minute, requests_per_unit: 1, name: later}
          - key: e
            rate_limit: {unlimited: true, name: free}
        ",
    );
    let b = default(&default(&domain.root, "a").children, "b");
    assert_eq!(only_limit(b).replaces, ["later", "free"]);
}

// ---- errors, one per case ----

#[test]
fn empty_domain() {
    one_error(
        "domain: ''\ndescriptors: []\n",
        1,
        "config file cannot have empty domain",
    );
    one_error(
        "descriptors: []\ndomain:\n",
        2,
        "config file cannot have empty domain",
    );
}

#[test]
fn missing_domain() {
    let error = one_error("# comment\n\ndescriptors: []\n", 3, "missing key 'domain'");
    assert!(
        error
            .reason
            .contains("config file cannot have empty domain")
    );
}

#[test]
fn domain_must_be_a_string() {
    one_error("domain: [a]\n", 1, "domain must be a string, found a list");
}

#[test]
fn empty_file() {
    one_error("", 1, "config file is empty");
    one_error("\n# nothing here\n", 1, "config file is empty");
    one_error("~\n", 1, "config file is empty");
}

#[test]
fn file_that_is_not_a_mapping() {
    one_error(
        "- domain: d\n",
        1,
        "config file must be a mapping, found a list",
    );
    one_error(
        "just text\n",
        1,
        "config file must be a mapping, found the string 'just text'",
    );
}

#[test]
fn descriptor_has_empty_key() {
    let yaml = "
        domain: d
        descriptors:
          - key: ''
            value: v
        ";
    one_error(yaml, 3, "descriptor has empty key");
    let yaml = "
        domain: d
        descriptors:
          - value: v
        ";
    one_error(yaml, 3, "descriptor has empty key (missing 'key')");
}

#[test]
fn duplicate_exact_value() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            value: v
          - key: k
            value: v
        ";
    one_error(yaml, 6, "duplicate descriptor composite key 'd.k_v'");
}

#[test]
fn duplicate_default() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: k
        ";
    one_error(yaml, 5, "duplicate descriptor composite key 'd.k'");
}

#[test]
fn duplicate_wildcard_and_nested_path() {
    let yaml = "
        domain: d
        descriptors:
          - key: a
            value: x
            descriptors:
              - key: p
                value: foo*
              - key: p
                value: foo*
              - key: p
                value: foo
        ";
    one_error(yaml, 9, "duplicate descriptor composite key 'd.a_x.p_foo*'");
}

#[test]
fn same_key_and_value_at_different_levels_is_fine() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: k
            value: v
            descriptors:
              - key: k
                value: v
        ",
    );
    let inner = exact(&exact(&domain.root, "k", "v").children, "k", "v");
    assert_eq!(inner.path, "d.k_v.k_v");
}

#[test]
fn invalid_unit() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: fortnight
              requests_per_unit: 1
        ";
    let error = one_error(yaml, 5, "invalid rate limit unit 'fortnight'");
    assert!(
        error
            .reason
            .contains("second, minute, hour, day, week, month, year")
    );
    assert_eq!(error.column, 13);
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: 5, requests_per_unit: 1}
        ";
    one_error(yaml, 4, "invalid rate limit unit '5'");
}

#[test]
fn replaces_own_name() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              name: mine
              unit: second
              requests_per_unit: 1
              replaces:
                - name: mine
        ";
    one_error(
        yaml,
        9,
        "replaces should not contain name of same descriptor",
    );
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limits:
              - {name: a, unit: second, requests_per_unit: 1}
              - {name: b, unit: second, requests_per_unit: 1, replaces: [{name: a}]}
        ";
    one_error(
        yaml,
        6,
        "replaces should not contain name of same descriptor ('a')",
    );
}

#[test]
fn empty_replaces_entry() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: ''
                - {}
        ";
    let errors = errors(yaml);
    assert_eq!(errors.len(), 2, "{}", ConfigErrors(errors.clone()));
    for (error, line) in errors.iter().zip([8, 9]) {
        assert!(
            error
                .reason
                .contains("should not have an empty replaces entry"),
            "{error}"
        );
        assert_eq!(error.line, line, "{error}");
    }
}

#[test]
fn replaces_entry_must_be_a_mapping() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces: [other]
        ";
    one_error(
        yaml,
        7,
        "replaces entry must be a mapping, found the string 'other'",
    );
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1, replaces: other}
        ";
    one_error(yaml, 4, "replaces must be a list, found the string 'other'");
}

#[test]
fn replaces_unknown_limit_name() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: nowhere
          - key: j
            rate_limit: {unit: second, requests_per_unit: 1, name: somewhere}
        ";
    one_error(yaml, 8, "replaces unknown limit name 'nowhere'");
}

#[test]
fn unknown_keys_each_at_its_own_line() {
    let yaml = "
        domain: d
        domian: typo
        descriptors:
          - key: k
            vaule: v
            rate_limit:
              unit: second
              request_per_unit: 1
              requests_per_unit: 1
              replaces:
                - name: x
                  nmae: y
          - key: x
            rate_limit: {unit: second, requests_per_unit: 1, name: x, extra: 1}
        ";
    let errors = errors(yaml);
    let found: Vec<_> = errors.iter().map(|e| (e.line, e.reason.as_str())).collect();
    assert_eq!(errors.len(), 5, "{}", ConfigErrors(errors.clone()));
    let expected = [
        (2, "unknown key 'domian' in config file"),
        (5, "unknown key 'vaule' in descriptor"),
        (8, "unknown key 'request_per_unit' in rate_limit"),
        (12, "unknown key 'nmae' in replaces entry"),
        (14, "unknown key 'extra' in rate_limit"),
    ];
    for ((line, reason), (want_line, want)) in found.iter().zip(expected) {
        assert_eq!(*line, want_line, "{reason}");
        assert!(reason.contains(want), "{reason} does not contain {want}");
    }
    assert!(
        errors[1]
            .reason
            .contains("valid keys: key, value, layer, rate_limit")
    );
    assert_eq!(errors[1].column, 5);
}

#[test]
fn unlimited_with_unit() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unlimited: true
              unit: second
        ";
    one_error(yaml, 6, "should not specify rate limit unit when unlimited");
}

#[test]
fn unlimited_with_an_empty_or_unknown_unit_loads() {
    // envoyproxy/ratelimit reads both as no unit; files written from Go structs carry `unit: ""`.
    for unit in ["\"\"", "unknown", "UNKNOWN"] {
        let domain = load(&format!(
            "
            domain: d
            descriptors:
              - key: k
                rate_limit:
                  unlimited: true
                  unit: {unit}
                  requests_per_unit: 0
            "
        ));
        let node = domain.root.keys["k"].default.as_deref().expect("the node");
        assert!(
            matches!(node.policy, Some(Policy::Unlimited { .. })),
            "unit {unit}: {:?}",
            node.policy
        );
    }
}

#[test]
fn unlimited_with_a_unit_that_is_not_one_says_so() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unlimited: true
              unit: fortnight
        ";
    one_error(yaml, 6, "invalid rate limit unit 'fortnight'");
}

#[test]
fn share_threshold_and_value_to_metric_load() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: path
            value: files/*
            share_threshold: true
            rate_limit: {unit: hour, requests_per_unit: 100}
          - key: route
            value_to_metric: true
            descriptors:
              - key: user
                rate_limit: {unit: minute, requests_per_unit: 60}
        ",
    );
    assert!(domain.shares_thresholds && domain.values_in_metrics);
    let (wildcard, shared) = &domain.root.keys["path"].wildcards[0];
    assert_eq!(wildcard.pattern, "files/*");
    assert_eq!(shared.shared_value.as_deref(), Some("files/*"));
    let route = domain.root.keys["route"].default.as_deref().expect("route");
    assert!(route.value_to_metric && route.shared_value.is_none());
    // Neither option: the domain says so, and matching takes the plain path.
    let plain = load(
        "
        domain: d
        descriptors:
          - key: path
            value: files/*
            share_threshold: false
            rate_limit: {unit: hour, requests_per_unit: 100}
        ",
    );
    assert!(!plain.shares_thresholds && !plain.values_in_metrics);
    assert_eq!(plain.root.keys["path"].wildcards[0].1.shared_value, None);
}

#[test]
fn share_threshold_needs_a_wildcard_value() {
    for value in ["", "value: files/a.pdf"] {
        let yaml = format!(
            "
            domain: d
            descriptors:
              - key: path
                {value}
                share_threshold: true
                rate_limit: {{unit: hour, requests_per_unit: 100}}
            "
        );
        one_error(
            &yaml,
            5,
            "share_threshold can only be used with wildcard values (containing '*')",
        );
    }
}

#[test]
fn unlimited_with_other_limit_keys() {
    // Like envoyproxy/ratelimit, requests_per_unit is ignored and replaces allowed; keys that
    // only shape a counted limit are errors.
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unlimited: true
              requests_per_unit: 5
              algorithm: gcra
              replaces: [{name: x}]
        ";
    let errors = errors(yaml);
    let lines: Vec<_> = errors.iter().map(|e| e.line).collect();
    assert_eq!(lines, [7], "{}", ConfigErrors(errors.clone()));
    assert!(
        errors[0]
            .reason
            .contains("should not specify algorithm when unlimited")
    );
}

#[test]
fn unlimited_keeps_its_replaces() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit: {unlimited: true, requests_per_unit: 5, replaces: [{name: other}]}
          - key: j
            rate_limit: {unit: second, requests_per_unit: 1, name: other}
        ";
    let domain = load_str("u.yaml", yaml).expect("valid");
    let node = domain.root.keys["k"]
        .default
        .as_deref()
        .expect("default node");
    assert_eq!(
        node.policy,
        Some(Policy::Unlimited {
            name: None,
            replaces: vec!["other".to_owned()]
        })
    );
}

#[test]
fn limits_sharing_algorithm_and_period_get_their_own_counters() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: k
            rate_limits:
              - {unit: minute, requests_per_unit: 10}
              - {unit: minute, requests_per_unit: 5, shadow_mode: true}
              - {unit: minute, requests_per_unit: 100, algorithm: gcra}
              - {unit: minute, requests_per_unit: 3, shadow_mode: true}
        ",
    );
    let variants: Vec<_> = limits(default(&domain.root, "k"))
        .iter()
        .map(|l| l.variant)
        .collect();
    assert_eq!(variants, [0, 1, 0, 2]);
}

#[test]
fn unlimited_cannot_be_combined() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limits:
              - unit: second
                requests_per_unit: 1
              - unlimited: true
        ";
    one_error(
        yaml,
        7,
        "an unlimited limit cannot be combined with other limits",
    );
}

#[test]
fn missing_unit_and_requests_per_unit() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              requests_per_unit: 1
        ";
    one_error(yaml, 4, "rate_limit is missing 'unit'");
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
        ";
    one_error(yaml, 4, "rate_limit is missing 'requests_per_unit'");
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limits:
              - unit: second
              - requests_per_unit: 1
        ";
    let errors = errors(yaml);
    assert_eq!(errors.len(), 2);
    assert_eq!((errors[0].line, errors[1].line), (5, 6));
    assert!(
        errors[0]
            .reason
            .contains("rate_limits entry is missing 'requests_per_unit'")
    );
    assert!(
        errors[1]
            .reason
            .contains("rate_limits entry is missing 'unit'")
    );
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit: {}
        ";
    assert_eq!(self::errors(yaml).len(), 2);
}

#[test]
fn invalid_algorithm() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              algorithm: leaky_bucket
        ";
    let error = one_error(yaml, 7, "invalid algorithm 'leaky_bucket'");
    assert!(
        error.reason.contains(
            "fixed_window, sliding_window_log, sliding_window_counter, token_bucket, gcra"
        ),
        "{error}"
    );
}

#[test]
fn burst_on_an_algorithm_without_burst() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              burst: 3
        ";
    one_error(
        yaml,
        7,
        "burst is only for token_bucket and gcra, not fixed_window",
    );
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              algorithm: sliding_window_log
              burst: 3
              requests_per_unit: 1
        ";
    one_error(yaml, 7, "not sliding_window_log");
}

#[test]
fn burst_zero() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              algorithm: token_bucket
              burst: 0
        ";
    one_error(
        yaml,
        8,
        "burst must be an integer from 1 to 4294967295, found 0",
    );
}

#[test]
fn unit_multiplier_zero() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: minute
              unit_multiplier: 0
              requests_per_unit: 1
        ";
    one_error(
        yaml,
        6,
        "unit_multiplier must be an integer from 1 to 4294967295, found 0",
    );
}

#[test]
fn rate_limit_and_rate_limits_together() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1}
            rate_limits:
              - {unit: minute, requests_per_unit: 10}
        ";
    one_error(yaml, 5, "rate_limit and rate_limits cannot both be given");
}

#[test]
fn empty_rate_limits() {
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limits: []
        ";
    one_error(yaml, 4, "rate_limits must not be an empty list");
    let yaml = "
        domain: d
        descriptors:
          - key: k
            rate_limits: {unit: second}
        ";
    one_error(yaml, 4, "rate_limits must be a list, found a mapping");
}

#[test]
fn wrong_types() {
    one_error(
        "domain: d\ndescriptors: {key: a}\n",
        2,
        "descriptors must be a list, found a mapping",
    );
    one_error(
        "domain: d\ndescriptors: nope\n",
        2,
        "descriptors must be a list, found the string 'nope'",
    );
    one_error(
        "domain: d\ndescriptors: [a]\n",
        2,
        "descriptor must be a mapping, found the string 'a'",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: [a]\n",
        3,
        "key must be a string, found a list",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    value: {b: c}\n",
        4,
        "value must be a string, found a mapping",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: 5\n",
        4,
        "rate_limit must be a mapping, found 5",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limits: [5]\n",
        4,
        "rate_limits entry must be a mapping, found 5",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: \"yes\"\n",
        4,
        "shadow_mode must be true or false, found the string 'yes'",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    detailed_metric: 1\n",
        4,
        "detailed_metric must be true or false, found 1",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: 'true'}\n",
        4,
        "unlimited must be true or false, found the string 'true'",
    );
}

#[test]
fn requests_per_unit_must_be_a_u32() {
    for (value, found) in [
        ("-1", "found -1"),
        ("1.5", "found 1.5"),
        ("'5'", "found the string '5'"),
        ("4294967296", "found 4294967296"),
        ("[1]", "found a list"),
        ("true", "found true"),
    ] {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: {value}\n"
        );
        let errors = load_str("test.yaml", &yaml).unwrap_err();
        assert_eq!(errors.len(), 1, "{}", ConfigErrors(errors.clone()));
        let reason = &errors[0].reason;
        assert!(
            reason.contains("requests_per_unit must be an integer from 0 to 4294967295")
                && reason.contains(found),
            "{reason}"
        );
        assert_eq!((errors[0].line, errors[0].column), (6, 26));
    }
}

#[test]
fn yaml_syntax_error() {
    let error = one_error("domain: d\ndescriptors: [\n  - key: a\n", 3, "invalid YAML");
    assert!(error.column > 0);
    let error = one_error(
        "domain: d\ndomain: e\n",
        2,
        "invalid YAML: duplicate mapping key",
    );
    assert!(!error.reason.contains("line 2"), "{error}");
    one_error("domain: d\n  x: y\n", 2, "invalid YAML");
}

#[test]
fn keys_must_be_strings() {
    one_error(
        "domain: d\n[a]: b\n",
        2,
        "keys in config file must be strings, found a list",
    );
}

#[test]
fn all_errors_of_a_file_at_once() {
    let yaml = "
        domain: d
        descriptors:
          - key: a
            rate_limit:
              unit: fortnight
              requests_per_unit: -1
              algorithm: magic
          - key: a
          - key: a
          - value: x
          - key: b
            shadow_mode: maybe
            descriptors:
              - key: c
                rate_limit:
                  unlimited: true
                  unit: second
                  name: c
                  replaces: [{name: c}]
              - key: d
                typo: 1
                rate_limits: []
        ";
    let errors = errors(yaml);
    let lines: Vec<_> = errors.iter().map(|e| e.line).collect();
    assert_eq!(
        lines,
        [5, 6, 7, 8, 9, 10, 12, 17, 21, 22],
        "{}",
        ConfigErrors(errors.clone())
    );
    let expected = [
        "invalid rate limit unit 'fortnight'",
        "requests_per_unit must be an integer",
        "invalid algorithm 'magic'",
        "duplicate descriptor composite key 'd.a'",
        "duplicate descriptor composite key 'd.a'",
        "descriptor has empty key",
        "shadow_mode must be true or false",
        "should not specify rate limit unit when unlimited",
        "unknown key 'typo' in descriptor",
        "rate_limits must not be an empty list",
    ];
    for (error, want) in errors.iter().zip(expected) {
        assert!(
            error.reason.contains(want),
            "{error} does not contain {want}"
        );
    }
}

#[test]
fn error_display() {
    let error = ConfigError {
        file: "a.yaml".to_owned(),
        line: 3,
        column: 5,
        reason: "descriptor has empty key".to_owned(),
    };
    assert_eq!(error.to_string(), "a.yaml:3:5: descriptor has empty key");
    let both = ConfigErrors(vec![error.clone(), ConfigError { line: 4, ..error }]);
    assert_eq!(
        both.to_string(),
        "a.yaml:3:5: descriptor has empty key\na.yaml:4:5: descriptor has empty key"
    );
}

// ---- files and directories ----

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

fn load_dir_errors(path: &Path) -> Vec<ConfigError> {
    match load_path(path, LoadOptions::default()) {
        Ok(config) => panic!("expected errors, loaded {config:?}"),
        Err(ConfigErrors(errors)) => errors,
    }
}

#[test]
fn single_file_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.txt");
    write(&file, "domain: one\n");
    let config = load_path(&file, LoadOptions::default()).unwrap();
    assert_eq!(config.domains.len(), 1);
    assert_eq!(config.domains["one"].source, file.display().to_string());
}

fn domain_names(config: &crate::config::Config) -> Vec<String> {
    let mut names: Vec<_> = config.domains.keys().cloned().collect();
    names.sort();
    names
}

const SKIP_DOTS: LoadOptions = LoadOptions {
    dotfiles: false,
    merge_domains: false,
};
const READ_DOTS: LoadOptions = LoadOptions {
    dotfiles: true,
    merge_domains: false,
};
const MERGE: LoadOptions = LoadOptions {
    dotfiles: false,
    merge_domains: true,
};

#[test]
fn every_file_below_the_directory_is_read_whatever_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    write(&path("a.yaml"), "domain: a\ndescriptors: [{key: k}]\n");
    write(&path("limits.conf"), "domain: conf\n");
    std::fs::create_dir_all(path("sub/deeper")).unwrap();
    write(&path("sub/x.txt"), "domain: x\n");
    write(&path("sub/deeper/y"), "domain: y\n");
    write(&path(".hidden.yaml"), "domain: hidden\n");
    std::fs::create_dir(path(".git")).unwrap();
    write(&path(".git/HEAD"), "domain: git\n");
    let config = load_path(dir.path(), SKIP_DOTS).unwrap();
    assert_eq!(domain_names(&config), ["a", "conf", "x", "y"]);
    assert_eq!(
        config.domains["y"].source,
        path("sub/deeper/y").display().to_string()
    );
    let config = load_path(dir.path(), READ_DOTS).unwrap();
    assert_eq!(
        domain_names(&config),
        ["a", "conf", "git", "hidden", "x", "y"]
    );
    // Depth first in name order, as goruntime walks.
    let files: Vec<String> = super::config_files(dir.path(), READ_DOTS)
        .unwrap()
        .iter()
        .map(|file| file.strip_prefix(dir.path()).unwrap().display().to_string())
        .collect();
    assert_eq!(
        files,
        [
            ".git/HEAD",
            ".hidden.yaml",
            "a.yaml",
            "limits.conf",
            "sub/deeper/y",
            "sub/x.txt"
        ]
    );
}

#[test]
fn a_file_below_the_directory_that_is_not_a_config_is_an_error_at_its_line() {
    // envoyproxy/ratelimit refuses both too ("yaml: line 3: mapping values are not allowed",
    // "cannot unmarshal !!str `just words`").
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), "domain: a\n");
    std::fs::create_dir(dir.path().join("docs")).unwrap();
    write(
        &dir.path().join("docs/README.md"),
        "This is a readme.\n\nIt: says things\n",
    );
    write(&dir.path().join("notes.txt"), "just words\n");
    let errors = load_dir_errors(dir.path());
    let summary: Vec<(String, u64)> = errors
        .iter()
        .map(|error| {
            let file = Path::new(&error.file).strip_prefix(dir.path()).unwrap();
            (file.display().to_string(), error.line)
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("docs/README.md".to_owned(), 3),
            ("notes.txt".to_owned(), 1)
        ],
        "{}",
        ConfigErrors(errors.clone())
    );
    assert!(
        errors[0].reason.starts_with("invalid YAML"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1]
            .reason
            .contains("must be a mapping, found the string 'just words'"),
        "{}",
        errors[1]
    );
}

/// A Kubernetes ConfigMap volume as the kubelet writes it: the files in a timestamped dot
/// directory, `..data` a symlink to it, and each key a top-level symlink into `..data`.
#[cfg(unix)]
fn configmap(dir: &Path, stamp: &str, files: &[(&str, &str)]) {
    use std::os::unix::fs::symlink;
    let real = dir.join(stamp);
    std::fs::create_dir(&real).unwrap();
    for (name, text) in files {
        write(&real.join(name), text);
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(format!("..data/{name}"), link).unwrap();
        }
    }
    // Swapped atomically, as the kubelet does.
    let staged = dir.join("..data_tmp");
    symlink(stamp, &staged).unwrap();
    std::fs::rename(&staged, dir.join("..data")).unwrap();
}

#[cfg(unix)]
#[test]
fn kubernetes_configmap_layout_loads_each_file_once_with_or_without_dotfiles() {
    let dir = tempfile::tempdir().unwrap();
    configmap(
        dir.path(),
        "..2026_12_07_20_54_23.1",
        &[("a.yaml", "domain: a\n"), ("limits.conf", "domain: b\n")],
    );
    for options in [SKIP_DOTS, READ_DOTS, MERGE] {
        let files = super::config_files(dir.path(), options).unwrap();
        assert_eq!(
            files,
            [dir.path().join("a.yaml"), dir.path().join("limits.conf")],
            "{options:?}"
        );
        let config = load_path(dir.path(), options).unwrap();
        assert_eq!(domain_names(&config), ["a", "b"], "{options:?}");
        assert_eq!(
            config.domains["b"].source,
            dir.path().join("limits.conf").display().to_string()
        );
        // `..data` is read through its target: nothing to warn about.
        assert!(super::unread_files(dir.path(), options).is_empty());
    }
    // Mid-update: the new version is live and the old one not yet removed. Only the live one
    // is read, dot names or not.
    configmap(
        dir.path(),
        "..2026_12_07_21_10_00.2",
        &[("a.yaml", "domain: a2\n"), ("limits.conf", "domain: b2\n")],
    );
    for options in [SKIP_DOTS, READ_DOTS] {
        let config = load_path(dir.path(), options).unwrap();
        assert_eq!(domain_names(&config), ["a2", "b2"], "{options:?}");
    }
}

#[cfg(unix)]
#[test]
fn symlinks_to_directories_are_not_followed_and_are_named_as_unread() {
    let outside = tempfile::tempdir().unwrap();
    write(&outside.path().join("o.yaml"), "domain: outside\n");
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), "domain: a\n");
    std::os::unix::fs::symlink(outside.path(), dir.path().join("linked")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("o.yaml"), dir.path().join("o.yaml")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("a.yaml"), dir.path().join(".alias")).unwrap();
    assert_eq!(
        load_path(dir.path(), READ_DOTS).unwrap().domains["a"].source,
        dir.path().join("a.yaml").display().to_string(),
        "a file two names reach is read once, under the visible one"
    );
    let config = load_path(dir.path(), SKIP_DOTS).unwrap();
    // goruntime reads the symlinked file, not the symlinked directory.
    assert_eq!(domain_names(&config), ["a", "outside"]);
    assert_eq!(
        super::unread_files(dir.path(), SKIP_DOTS),
        [dir.path().join("linked")]
    );
    assert!(super::unread_files(&dir.path().join("a.yaml"), SKIP_DOTS).is_empty());
}

#[test]
fn duplicate_domain_across_files() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("a.yaml"), "domain: same\n");
    write(&dir.path().join("b.yaml"), "# second\n\ndomain: same\n");
    let errors = load_dir_errors(dir.path());
    assert_eq!(errors.len(), 1, "{}", ConfigErrors(errors.clone()));
    let error = &errors[0];
    assert!(
        error
            .reason
            .contains("duplicate domain 'same' in config file"),
        "{error}"
    );
    assert!(
        error.reason.contains("a.yaml"),
        "names the first file: {error}"
    );
    assert_eq!(error.file, dir.path().join("b.yaml").display().to_string());
    assert_eq!(error.line, 3);
}

#[test]
fn errors_of_every_file_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.yaml"),
        "domain: a\ndescriptors: [{key: ''}]\n",
    );
    write(&dir.path().join("b.yaml"), "domain: b\n");
    write(&dir.path().join("c.yaml"), "domain: a\nbogus: 1\n");
    write(&dir.path().join("d.yaml"), "domain: [\n");
    let errors = load_dir_errors(dir.path());
    let summary: Vec<_> = errors
        .iter()
        .map(|e| {
            let file = Path::new(&e.file)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (file, e.line)
        })
        .collect();
    let expect = |file: &str, line| (file.to_owned(), line);
    assert_eq!(
        summary,
        [
            expect("a.yaml", 2),
            expect("c.yaml", 1),
            expect("c.yaml", 2),
            expect("d.yaml", 1)
        ],
        "{}",
        ConfigErrors(errors.clone())
    );
    assert!(errors[1].reason.contains("duplicate domain 'a'"));
}

#[test]
fn unreadable_path_is_line_zero() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.yaml");
    let errors = load_dir_errors(&missing);
    assert_eq!(errors.len(), 1);
    assert_eq!((errors[0].line, errors[0].column), (0, 0));
    assert_eq!(errors[0].file, missing.display().to_string());
    assert!(errors[0].reason.contains("cannot read"), "{}", errors[0]);
}

#[test]
fn non_utf8_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), b"domain: \xff\n").unwrap();
    let errors = load_dir_errors(dir.path());
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].line, 0);
}

#[cfg(unix)]
#[test]
fn broken_symlink_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("nowhere.yaml", dir.path().join("a.yaml")).unwrap();
    let errors = load_dir_errors(dir.path());
    assert_eq!(errors.len(), 1);
    assert!(errors[0].reason.contains("cannot read"), "{}", errors[0]);
}

#[test]
fn empty_directory_is_an_empty_config() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        load_path(dir.path(), LoadOptions::default())
            .unwrap()
            .domains
            .is_empty()
    );
}

#[test]
fn only_a_config_without_domains_is_an_empty_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let empty = load_path(dir.path(), LoadOptions::default()).unwrap();
    let error = super::empty_config_error(dir.path(), &empty).expect("an error");
    assert_eq!(error.file, dir.path().display().to_string());
    // A domain without descriptors is how "no limits" is said on purpose.
    write(&dir.path().join("open.yaml"), "domain: open\n");
    let open = load_path(dir.path(), LoadOptions::default()).unwrap();
    assert_eq!(open.domains.len(), 1);
    assert!(open.domains["open"].root.keys.is_empty());
    assert_eq!(super::empty_config_error(dir.path(), &open), None);
}

// ---- wildcards ----

#[test]
fn wildcard_matches() {
    let table: &[(&str, &str, bool)] = &[
        // prefix
        ("foo*", "foo", true),
        ("foo*", "foobar", true),
        ("foo*", "fo", false),
        ("foo*", "xfoo", false),
        ("foo*", "", false),
        // suffix
        ("*bar", "bar", true),
        ("*bar", "foobar", true),
        ("*bar", "barx", false),
        // middle
        ("bar*b", "barb", true),
        ("bar*b", "bar-xyz-b", true),
        ("bar*b", "bar", false),
        ("bar*b", "barbx", false),
        ("a*a", "a", false),
        ("a*a", "aa", true),
        // several stars
        ("foo*bar*baz", "foobarbaz", true),
        ("foo*bar*baz", "foo1bar2baz", true),
        ("foo*bar*baz", "foobazbar", false),
        ("foo*bar*baz", "foo1bar2baz3", false),
        ("a*b*b", "ab", false),
        ("a*b*b", "abb", true),
        ("a**b", "ab", true),
        ("*a*", "xay", true),
        ("*a*", "xy", false),
        // star alone
        ("*", "anything", true),
        ("*", "", true),
        ("**", "", true),
        // empty value
        ("x*", "", false),
        ("*x", "", false),
    ];
    for &(pattern, value, want) in table {
        let wildcard = Wildcard::new(pattern).unwrap();
        assert_eq!(wildcard.matches(value), want, "{pattern:?} vs {value:?}");
        assert_eq!(wildcard.pattern, pattern);
    }
    assert_eq!(Wildcard::new("plain"), None);
    assert_eq!(Wildcard::new(""), None);
}

#[test]
fn anchors_aliases_and_merge_keys() {
    let domain = load(
        "
        domain: d
        descriptors:
          - key: a
            rate_limit: &lim {unit: second, requests_per_unit: 7}
          - key: b
            rate_limit: *lim
          - key: c
            rate_limit:
              <<: *lim
              name: c
        ",
    );
    let root = &domain.root;
    assert_eq!(
        *only_limit(default(root, "a")),
        Limit::fixed(7, Unit::Second)
    );
    assert_eq!(
        *only_limit(default(root, "b")),
        Limit::fixed(7, Unit::Second)
    );
    assert_eq!(
        *only_limit(default(root, "c")),
        named(Limit::fixed(7, Unit::Second), "c")
    );
    let yaml = "
        domain: d
        descriptors:
          - key: a
            rate_limit: &lim {unit: fortnight, requests_per_unit: 7}
          - key: b
            rate_limit: *lim
        ";
    let errors = errors(yaml);
    let lines: Vec<_> = errors.iter().map(|e| e.line).collect();
    assert_eq!(lines, [4, 6], "{}", ConfigErrors(errors.clone()));
}

#[test]
fn truncated_and_mangled_files_never_panic_and_always_have_lines() {
    let mut inputs = Vec::new();
    for source in [ENVOY_EXAMPLE, RLSD_EXTENSIONS] {
        for (at, _) in source.char_indices().step_by(5) {
            inputs.push(source[..at].to_owned());
            let mut mangled = source.to_owned();
            mangled.replace_range(at..=at, ":");
            inputs.push(mangled);
        }
    }
    for input in inputs {
        if let Err(errors) = load_str("fuzz.yaml", &input) {
            assert!(!errors.is_empty());
            for error in errors {
                assert!(
                    error.line >= 1 && error.column >= 1,
                    "{error} for {input:?}"
                );
            }
        }
    }
}

#[test]
fn layers_are_declared_inherited_and_checked() {
    let domain = load(
        "
        domain: d
        layers: [edge, plan]
        descriptors:
          - key: ip
            layer: edge
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: plan
            layer: plan
            descriptors:
              - key: api_key
                rate_limit: {unit: second, requests_per_unit: 1}
          - key: other
            rate_limit: {unit: second, requests_per_unit: 1}
        ",
    );
    let root = &domain.root;
    assert_eq!(default(root, "ip").layer.as_deref(), Some("edge"));
    let plan = default(root, "plan");
    assert_eq!(
        default(&plan.children, "api_key").layer.as_deref(),
        Some("plan")
    );
    assert_eq!(default(root, "other").layer, None);

    let errors = errors(
        "
        domain: d
        layers: [edge, edge, '']
        descriptors:
          - key: ip
            layer: egde
            rate_limit: {unit: second, requests_per_unit: 1}
        ",
    );
    let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
    let lines: Vec<u64> = errors.iter().map(|e| e.line).collect();
    assert_eq!(lines, [2, 2, 5], "{reasons:?}");
    assert!(reasons[0].contains("duplicate layer 'edge'"));
    assert!(reasons[1].contains("layer names must not be empty"));
    assert!(reasons[2].contains("unknown layer 'egde' (declared layers: edge)"));
}

#[test]
fn plan_tables_load_and_every_plan_must_have_a_descriptor() {
    let domain = load(
        "
        domain: d
        plans:
          from: api_key
          entry: plan
          default: free
          keys: {k1: pro}
        descriptors:
          - key: plan
            value: free
          - key: plan
            value: pro
        ",
    );
    let plans = domain.plans.expect("plans");
    assert_eq!(
        (plans.plan_of("k1"), plans.plan_of("nobody")),
        ("pro", "free")
    );

    let errors = errors(
        "
        domain: d
        plans:
          from: api_key
          default: gold
          keys: {k1: silver}
          colour: red
        descriptors:
          - key: plan
            value: free
        ",
    );
    let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(errors.len(), 2, "{reasons:?}");
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("unknown key 'colour' in plans")),
        "{reasons:?}"
    );
    let errors = errors_of_missing_entry();
    assert!(
        errors
            .iter()
            .any(|e| e.reason.contains("plans is missing 'entry'"))
    );
}

fn errors_of_missing_entry() -> Vec<ConfigError> {
    errors(
        "
        domain: d
        plans: {from: api_key, default: free}
        descriptors:
          - key: plan
            value: free
        ",
    )
}

#[test]
fn plans_naming_plans_without_descriptors_are_errors() {
    let errors = errors(
        "
        domain: d
        plans: {from: api_key, entry: plan, default: gold, keys: {k1: silver, k2: free}}
        descriptors:
          - key: plan
            value: free
        ",
    );
    let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(errors.len(), 2, "{reasons:?}");
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("plan 'silver' has no top-level descriptor 'plan: silver'"))
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("plan 'gold' has no top-level descriptor"))
    );
}

#[test]
fn deeply_nested_descriptors_are_an_error_not_a_crash() {
    let mut yaml = String::from("domain: d\ndescriptors:\n");
    for depth in 0..60 {
        let indent = "  ".repeat(depth * 2);
        yaml.push_str(&format!(
            "{indent}- key: k{depth}\n{indent}  descriptors:\n"
        ));
    }
    // A 2 MiB thread, as tokio's blocking pool and the default test threads have.
    let loaded = std::thread::Builder::new()
        .stack_size(2 * 1024 * 1024)
        .spawn(move || load_str("deep.yaml", &yaml).map(|_| ()))
        .expect("thread")
        .join()
        .expect("no stack overflow");
    let errors = loaded.expect_err("deeper than the parser allows");
    assert!(
        errors.iter().all(|e| e.line >= 1 && !e.reason.is_empty()),
        "{errors:?}"
    );
}

#[test]
fn limits_too_large_to_decide_exactly_are_errors() {
    let errors = errors(
        "
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: year, unit_multiplier: 11, requests_per_unit: 1}
          - key: b
            rate_limit: {unit: second, requests_per_unit: 100001, algorithm: sliding_window_log}
          - key: c
            rate_limit: {unit: year, requests_per_unit: 1, algorithm: gcra, burst: 20}
          - key: ok
            rate_limit: {unit: year, unit_multiplier: 10, requests_per_unit: 100000, algorithm: sliding_window_log}
        ",
    );
    let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(errors.len(), 3, "{reasons:?}");
    assert!(reasons[0].contains("longer than ten years"), "{reasons:?}");
    assert!(
        reasons[1].contains("sliding_window_log keeps one entry per hit"),
        "{reasons:?}"
    );
    assert!(reasons[2].contains("gcra burst 20"), "{reasons:?}");
}

// ---- one domain across files (MERGE_DOMAIN_CONFIG) ----

#[test]
fn merged_files_add_their_top_level_descriptors_to_one_domain() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("one.yaml"),
        "domain: m\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 3, name: three}\n  - key: w\n    value: x*\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
    );
    write(
        &dir.path().join("two.yaml"),
        "domain: m\ndescriptors:\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 4, replaces: [{name: three}]}\n  - key: a\n    value: v\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    );
    write(&dir.path().join("other.yaml"), "domain: o\n");
    let config = load_path(dir.path(), MERGE).unwrap();
    assert_eq!(domain_names(&config), ["m", "o"]);
    let m = &config.domains["m"];
    assert_eq!(only_limit(default(&m.root, "a")).requests_per_unit, 3);
    assert_eq!(only_limit(exact(&m.root, "a", "v")).requests_per_unit, 5);
    assert_eq!(only_limit(default(&m.root, "b")).replaces, ["three"]);
    assert_eq!(m.root.keys["w"].wildcards.len(), 1);
    assert_eq!(
        m.source,
        format!(
            "{}, {}",
            dir.path().join("one.yaml").display(),
            dir.path().join("two.yaml").display()
        )
    );
    // Without merging, the second file of a domain is refused, as before.
    let errors = load_dir_errors(dir.path());
    assert!(
        errors
            .iter()
            .any(|error| error.reason.contains("duplicate domain 'm'")),
        "{}",
        ConfigErrors(errors.clone())
    );
}

#[test]
fn a_descriptor_two_merged_files_give_is_an_error_at_its_line_naming_the_first_file() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("one.yaml"),
        "domain: m\ndescriptors:\n  - key: a\n  - key: w\n    value: x*\n  - key: e\n    value: v\n",
    );
    write(
        &dir.path().join("two.yaml"),
        "domain: m\ndescriptors:\n  - key: a\n    descriptors: []\n  - key: e\n    value: other\n",
    );
    write(
        &dir.path().join("three.yaml"),
        "domain: m\n\ndescriptors:\n  - key: w\n    value: x*\n",
    );
    let errors = match load_path(dir.path(), MERGE) {
        Ok(config) => panic!("loaded {config:?}"),
        Err(ConfigErrors(errors)) => errors,
    };
    let one = dir.path().join("one.yaml").display().to_string();
    let summary: Vec<(String, u64, String)> = errors
        .iter()
        .map(|e| {
            let file = Path::new(&e.file).file_name().unwrap().to_string_lossy();
            (file.into_owned(), e.line, e.reason.clone())
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "three.yaml".to_owned(),
                5,
                format!("duplicate descriptor composite key 'm.w_x*' (already defined in {one})")
            ),
            (
                "two.yaml".to_owned(),
                3,
                format!("duplicate descriptor composite key 'm.a' (already defined in {one})")
            ),
        ],
        "{}",
        ConfigErrors(errors.clone())
    );
}

#[test]
fn merged_files_keep_plans_in_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let plans = "plans: {from: api_key, entry: plan, default: free}\n";
    write(
        &dir.path().join("a.yaml"),
        &format!("domain: m\ndescriptors:\n  - key: plan\n    value: free\n{plans}"),
    );
    write(
        &dir.path().join("b.yaml"),
        "domain: m\ndescriptors: [{key: b}]\n",
    );
    let config = load_path(dir.path(), MERGE).unwrap();
    assert!(
        config.domains["m"].plans.is_some(),
        "kept through the merge"
    );
    write(&dir.path().join("c.yaml"), &format!("domain: m\n{plans}"));
    let errors = match load_path(dir.path(), MERGE) {
        Ok(config) => panic!("loaded {config:?}"),
        Err(ConfigErrors(errors)) => errors,
    };
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].line, 2);
    assert!(
        errors[0].reason.contains(&format!(
            "already given in {}",
            dir.path().join("a.yaml").display()
        )),
        "{}",
        errors[0]
    );
}

#[test]
fn merged_files_keep_quota_buckets_in_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let quota = "quota_buckets:\n  - rate_limit: {unit: second, requests_per_unit: 10}\n";
    write(&dir.path().join("a.yaml"), &format!("domain: m\n{quota}"));
    write(
        &dir.path().join("b.yaml"),
        "domain: m\ndescriptors: [{key: b}]\n",
    );
    let config = load_path(dir.path(), MERGE).unwrap();
    assert_eq!(
        config.domains["m"].quota.rules.len(),
        1,
        "kept through the merge"
    );
    write(&dir.path().join("c.yaml"), &format!("domain: m\n{quota}"));
    let errors = match load_path(dir.path(), MERGE) {
        Ok(config) => panic!("loaded {config:?}"),
        Err(ConfigErrors(errors)) => errors,
    };
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].line, 2);
    assert!(
        errors[0]
            .reason
            .contains("quota_buckets of domain 'm' are already given in"),
        "{}",
        errors[0]
    );
}

// ---- YAML 1.1 scalars, as envoyproxy/ratelimit's yaml.v2 reads them ----

#[test]
fn yaml_1_1_scalars_load_with_the_reference_meaning() {
    // Every meaning below is what envoyproxy/ratelimit f2fb157 did with this file: matched
    // `k=yes` (not `k=true`), `o=010` at 8 per minute, `b=on` at 2, `u=1_000` at 10, and
    // answered this metadata.
    let domain = load(
        "
        domain: d
        descriptors:
          - key: k
            value: yes
            rate_limit: {unit: minute, requests_per_unit: 1}
            metadata: {x: 1, y: 2, on: off, n: {y: 1, 0x10: 2.5, ~: t}, s: 010, f: 1e3}
          - key: o
            value: 010
            rate_limit: {unit: minute, requests_per_unit: 010}
          - key: b
            value: on
            shadow_mode: off
            quota_mode: No
            rate_limit: {unit: minute, requests_per_unit: 0x2, unlimited: n}
          - key: u
            value: 1_000
            detailed_metric: Y
            rate_limit: {unit: minute, requests_per_unit: 1_0}
        ",
    );
    let k = exact(&domain.root, "k", "yes");
    assert_eq!(
        only_limit(exact(&domain.root, "o", "010")).requests_per_unit,
        8
    );
    let b = only_limit(exact(&domain.root, "b", "on"));
    assert_eq!(
        (b.requests_per_unit, b.shadow, b.quota_mode),
        (2, false, false)
    );
    let u = exact(&domain.root, "u", "1_000");
    assert_eq!(only_limit(u).requests_per_unit, 10);
    assert!(u.detailed_metric);
    let json = serde_json::to_value(struct_json(k.metadata.as_ref().expect("metadata"))).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "x": 1.0, "y": 2.0, "on": false, "s": 8.0, "f": 1000.0,
            "n": {"true": 1.0, "16": 2.5, "<nil>": "t"}
        })
    );
}

/// A protobuf Struct as JSON, for comparing with what the reference answered.
fn struct_json(fields: &prost_types::Struct) -> serde_json::Value {
    use prost_types::value::Kind;
    fn value(of: &prost_types::Value) -> serde_json::Value {
        match &of.kind {
            Some(Kind::NullValue(_)) | None => serde_json::Value::Null,
            Some(Kind::BoolValue(b)) => (*b).into(),
            Some(Kind::NumberValue(n)) => (*n).into(),
            Some(Kind::StringValue(s)) => s.clone().into(),
            Some(Kind::ListValue(list)) => list.values.iter().map(value).collect(),
            Some(Kind::StructValue(inner)) => struct_json(inner),
        }
    }
    fields
        .fields
        .iter()
        .map(|(key, v)| (key.clone(), value(v)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

#[test]
fn yaml_1_1_scalars_both_refuse_are_errors_at_their_line() {
    // envoyproxy/ratelimit refuses each too: a boolean or a float where a count goes, a
    // number where a flag goes.
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: minute, requests_per_unit: yes}
        ",
        4,
        "requests_per_unit must be an integer from 0 to 4294967295, found yes",
    );
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: minute, requests_per_unit: 08}
        ",
        4,
        "requests_per_unit must be an integer from 0 to 4294967295, found 08",
    );
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            shadow_mode: 1
        ",
        4,
        "shadow_mode must be true or false, found 1",
    );
    one_error(
        "
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: on, requests_per_unit: 1}
        ",
        4,
        "invalid rate limit unit 'on'",
    );
}

#[test]
fn a_merged_replaces_may_name_a_limit_of_any_file_of_its_domain() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.yaml"),
        "domain: m\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 3, replaces: [{name: later}]}\n",
    );
    write(
        &dir.path().join("b.yaml"),
        "domain: m\ndescriptors:\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 4, name: later}\n",
    );
    let config = load_path(dir.path(), MERGE).unwrap();
    assert_eq!(
        only_limit(default(&config.domains["m"].root, "a")).replaces,
        ["later"]
    );
    // A name no file of the domain gives is still an error at its line.
    write(
        &dir.path().join("c.yaml"),
        "domain: m\ndescriptors:\n  - key: c\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1\n      replaces: [{name: nowhere}]\n",
    );
    let errors = match load_path(dir.path(), MERGE) {
        Ok(config) => panic!("loaded {config:?}"),
        Err(ConfigErrors(errors)) => errors,
    };
    assert_eq!(errors.len(), 1, "{}", ConfigErrors(errors.clone()));
    assert_eq!(
        (errors[0].file.as_str(), errors[0].line),
        (dir.path().join("c.yaml").to_str().unwrap(), 7)
    );
    assert!(
        errors[0]
            .reason
            .contains("replaces unknown limit name 'nowhere'"),
        "{}",
        errors[0]
    );
}
