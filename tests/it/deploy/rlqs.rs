//! `deploy/rlqs/`: Envoy's `rate_limit_quota` filter read with Envoy's schema, the bucket ids its
//! matchers build for sample requests (as the filter builds them), each checked against the
//! `quota_buckets:` item of `deploy/rlqs/web.yaml` meant for it, and answered by a running rlsd.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig as CoreExtension;
use envoy_types::pb::envoy::extensions::filters::http::rate_limit_quota::v3 as quota;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::envoy::r#type::matcher::v3::HttpRequestHeaderMatchInput;
use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy as FallbackStrategy;
use envoy_types::pb::google::protobuf as wkt;
use envoy_types::pb::xds::core::v3::TypedExtensionConfig;
use envoy_types::pb::xds::r#type::matcher::v3 as xds;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlsd::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use rlsd::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use rlsd::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use rlsd::rlqs::{BucketRule, Quota, ValueMatch};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::envoy::{
    Filter, Sample, as_std, assert_http2, bootstrap_text, cluster_named, connection_managers,
    envoy_message, http_filter, only, only_endpoint, unpack,
};
use super::kubernetes::{RlsdSettings, mounted_volume, object, rlsd_in};
use super::{Tree, default_port, flag, load_config, path, read};
use crate::common::process::{Rlsd, command};

/// The filter's name in Envoy's HTTP filter chain.
pub(super) const QUOTA_FILTER: &str = "envoy.filters.http.rate_limit_quota";
const ENVOY: &str = "deploy/rlqs/envoy.yaml";
const RLSD: &str = "deploy/rlqs/web.yaml";

/// A bucket id, as rlsd's rules read it.
type Bucket = BTreeMap<String, String>;

// === The filter ==================================================================================

/// The quota filter's config, checked for what Envoy's validation (its protoc-gen-validate rules,
/// which the schema alone does not apply) refuses, and for fields these checks do not model.
pub(super) fn quota_filter(what: &str, any: &wkt::Any) -> quota::RateLimitQuotaFilterConfig {
    let filter: quota::RateLimitQuotaFilterConfig = unpack(what, any);
    #[rustfmt::skip]
    only!(what, filter, quota::RateLimitQuotaFilterConfig { rlqs_server, domain, bucket_matchers });
    assert!(!filter.domain.is_empty(), "{what}: domain is required");
    let server = filter
        .rlqs_server
        .as_ref()
        .expect("rlqs_server is required");
    only!(
        what,
        *server,
        envoy_types::pb::envoy::config::core::v3::GrpcService { target_specifier }
    );
    rlqs_cluster(&filter);
    let matchers = filter
        .bucket_matchers
        .as_ref()
        .expect("bucket_matchers is required");
    check_matcher(what, matchers);
    filter
}

/// The cluster the quota filter streams to.
fn rlqs_cluster(filter: &quota::RateLimitQuotaFilterConfig) -> &str {
    use envoy_types::pb::envoy::config::core::v3::grpc_service::TargetSpecifier;
    let target = filter
        .rlqs_server
        .as_ref()
        .and_then(|s| s.target_specifier.as_ref());
    let Some(TargetSpecifier::EnvoyGrpc(grpc)) = target else {
        panic!("rlqs_server: envoy_grpc");
    };
    only!(
        "rlqs_server",
        *grpc,
        envoy_types::pb::envoy::config::core::v3::grpc_service::EnvoyGrpc { cluster_name }
    );
    &grpc.cluster_name
}

/// Checks a matcher tree as Envoy's factory would build it: a list of field matchers, each
/// with a predicate on request headers and a bucket settings action, and an optional
/// `on_no_match`.
fn check_matcher(what: &str, m: &xds::Matcher) {
    only!(
        what,
        *m,
        xds::Matcher {
            matcher_type,
            on_no_match
        }
    );
    let Some(xds::matcher::MatcherType::MatcherList(list)) = &m.matcher_type else {
        panic!("{what}: only a matcher_list is modelled");
    };
    only!(what, *list, xds::matcher::MatcherList { matchers });
    assert!(!list.matchers.is_empty(), "{what}: matchers: at least one");
    for field in &list.matchers {
        only!(
            what,
            *field,
            xds::matcher::matcher_list::FieldMatcher {
                predicate,
                on_match
            }
        );
        check_predicate(
            what,
            field.predicate.as_ref().expect("predicate is required"),
        );
        bucket_settings(what, field.on_match.as_ref().expect("on_match is required"));
    }
    if let Some(on_no_match) = &m.on_no_match {
        bucket_settings(what, on_no_match);
    }
}

/// Checks a predicate: evaluating it once walks every branch (lists evaluate all their items).
fn check_predicate(what: &str, p: &xds::matcher::matcher_list::Predicate) {
    predicate_matches(what, p, &Sample::new("192.0.2.1", "/", &[]));
}

/// An `on_match`: the bucket settings of its action. A nested matcher, or `keep_matching`
/// (which the filter treats as a preview that counts but never limits), is not modelled.
fn bucket_settings(
    what: &str,
    on_match: &xds::matcher::OnMatch,
) -> quota::RateLimitQuotaBucketSettings {
    only!(what, *on_match, xds::matcher::OnMatch { on_match });
    let Some(xds::matcher::on_match::OnMatch::Action(action)) = &on_match.on_match else {
        panic!("{what}: on_match must be an action (nested matchers are not modelled)");
    };
    let any = extension(what, action);
    let settings: quota::RateLimitQuotaBucketSettings = unpack(what, any);
    #[rustfmt::skip]
    only!(what, settings, quota::RateLimitQuotaBucketSettings {
        bucket_id_builder, reporting_interval, no_assignment_behavior,
        expired_assignment_behavior,
    });
    let interval = settings
        .reporting_interval
        .as_ref()
        .map(as_std)
        .unwrap_or_else(|| panic!("{what}: reporting_interval is required"));
    assert!(
        interval > Duration::from_millis(100),
        "{what}: Envoy refuses a reporting_interval of 0.1 s or less"
    );
    // Without a builder Envoy never reports the bucket: rlsd could not limit it.
    let builder = settings
        .bucket_id_builder
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: no bucket_id_builder: never reported to rlsd"));
    assert!(
        !builder.bucket_id_builder.is_empty(),
        "{what}: bucket_id_builder needs an entry"
    );
    for (key, value) in &builder.bucket_id_builder {
        use quota::rate_limit_quota_bucket_settings::bucket_id_builder::value_builder::ValueSpecifier;
        match value.value_specifier.as_ref() {
            Some(ValueSpecifier::StringValue(v)) => {
                assert!(!v.is_empty(), "{what}: {key}: rlsd refuses an empty value");
            }
            Some(ValueSpecifier::CustomValue(input)) => drop(header_value_input(what, input)),
            None => panic!("{what}: {key}: a value_specifier is required"),
        }
    }
    // Before the first assignment: a fallback written down, and one Envoy applies.
    let no_assignment = settings
        .no_assignment_behavior
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: write no_assignment_behavior down"));
    use quota::rate_limit_quota_bucket_settings::no_assignment_behavior::NoAssignmentBehavior;
    let Some(NoAssignmentBehavior::FallbackRateLimit(fallback)) =
        &no_assignment.no_assignment_behavior
    else {
        panic!("{what}: no_assignment_behavior needs fallback_rate_limit");
    };
    check_fallback(what, fallback);
    // After an assignment expires: a fallback, for a while (unset, Envoy drops the bucket at
    // once; reuse_last_assignment is not implemented and acts as no fallback).
    let expired = settings
        .expired_assignment_behavior
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: write expired_assignment_behavior down"));
    let timeout = expired
        .expired_assignment_behavior_timeout
        .as_ref()
        .map(as_std)
        .unwrap_or_default();
    assert!(
        timeout >= Duration::from_secs(1),
        "{what}: expired_assignment_behavior_timeout: whole seconds, at least 1"
    );
    use quota::rate_limit_quota_bucket_settings::expired_assignment_behavior::ExpiredAssignmentBehavior;
    let Some(ExpiredAssignmentBehavior::FallbackRateLimit(fallback)) =
        &expired.expired_assignment_behavior
    else {
        panic!(
            "{what}: expired_assignment_behavior needs fallback_rate_limit (Envoy ignores reuse_last_assignment)"
        );
    };
    check_fallback(what, fallback);
    settings
}

/// A fallback strategy Envoy applies: a blanket rule (requests_per_time_unit is skipped by Envoy,
/// a token bucket fallback is not modelled here).
fn check_fallback(what: &str, strategy: &RateLimitStrategy) {
    assert!(
        matches!(strategy.strategy, Some(FallbackStrategy::BlanketRule(_))),
        "{what}: only a blanket_rule fallback is modelled: {strategy:?}"
    );
}

/// A typed extension's payload; Envoy requires its `name`.
fn extension<'e>(what: &str, e: &'e TypedExtensionConfig) -> &'e wkt::Any {
    payload(what, &e.name, e.typed_config.as_ref())
}

/// A typed extension's payload (xds' or Envoy's message); Envoy requires its `name`.
fn payload<'e>(what: &str, name: &str, typed_config: Option<&'e wkt::Any>) -> &'e wkt::Any {
    assert!(!name.is_empty(), "{what}: a typed extension needs a name");
    typed_config.unwrap_or_else(|| panic!("{what}: {name} without typed_config"))
}

/// The request header a data input reads (a `custom_value`, in Envoy's own message).
fn header_value_input(what: &str, input: &CoreExtension) -> String {
    let header: HttpRequestHeaderMatchInput = unpack(
        what,
        payload(what, &input.name, input.typed_config.as_ref()),
    );
    only!(what, header, HttpRequestHeaderMatchInput { header_name });
    assert!(!header.header_name.is_empty(), "{what}: header_name");
    header.header_name
}

/// The request header a data input reads.
fn header_input(what: &str, input: &TypedExtensionConfig) -> String {
    let header: HttpRequestHeaderMatchInput = unpack(what, extension(what, input));
    only!(what, header, HttpRequestHeaderMatchInput { header_name });
    assert!(!header.header_name.is_empty(), "{what}: header_name");
    header.header_name
}

// === Which bucket a request lands in ============================================================

/// Whether a predicate matches `request`. A header the request lacks matches no value.
fn predicate_matches(
    what: &str,
    p: &xds::matcher::matcher_list::Predicate,
    request: &Sample<'_>,
) -> bool {
    use xds::matcher::matcher_list::predicate::MatchType;
    use xds::matcher::matcher_list::predicate::single_predicate::Matcher;
    only!(
        what,
        *p,
        xds::matcher::matcher_list::Predicate { match_type }
    );
    let all = |list: &xds::matcher::matcher_list::predicate::PredicateList| {
        assert!(list.predicate.len() >= 2, "{what}: a list of two or more");
        let each: Vec<bool> = list
            .predicate
            .iter()
            .map(|p| predicate_matches(what, p, request))
            .collect();
        each
    };
    match p.match_type.as_ref().expect("match_type is required") {
        MatchType::SinglePredicate(single) => {
            #[rustfmt::skip]
            only!(what, *single, xds::matcher::matcher_list::predicate::SinglePredicate {
                input, matcher,
            });
            let header = header_input(what, single.input.as_ref().expect("input is required"));
            let Some(Matcher::ValueMatch(value_match)) = &single.matcher else {
                panic!("{what}: only value_match is modelled");
            };
            let matches = string_matches(what, value_match);
            request.header(&header).is_some_and(matches)
        }
        MatchType::AndMatcher(list) => all(list).into_iter().all(|m| m),
        MatchType::OrMatcher(list) => all(list).into_iter().any(|m| m),
        MatchType::NotMatcher(inner) => !predicate_matches(what, inner, request),
    }
}

/// A string matcher as a test on a value.
fn string_matches<'m>(what: &str, m: &'m xds::StringMatcher) -> impl Fn(&str) -> bool + 'm {
    use xds::string_matcher::MatchPattern;
    only!(what, *m, xds::StringMatcher { match_pattern });
    let pattern = m.match_pattern.as_ref().expect("a match pattern");
    match pattern {
        MatchPattern::Prefix(p) => assert!(!p.is_empty(), "{what}: an empty prefix"),
        MatchPattern::Exact(_) => {}
        MatchPattern::SafeRegex(r) => {
            only!(what, *r, xds::RegexMatcher { engine_type, regex });
            assert!(r.engine_type.is_some(), "{what}: google_re2 is required");
            // Envoy matches the whole value; only "any non-empty value" is modelled.
            assert_eq!(r.regex, ".+", "{what}: regex {} is not modelled", r.regex);
        }
        other => panic!("{what}: {other:?} is not modelled"),
    }
    move |value: &str| match pattern {
        MatchPattern::Prefix(p) => value.starts_with(p.as_str()),
        MatchPattern::Exact(e) => value == e,
        _ => !value.is_empty(),
    }
}

/// The bucket id the settings build for `request`: `None` where Envoy cannot (a `custom_value`
/// header missing), and then lets the request pass unreported. A header present but empty
/// leaves its key out (the filter's `generateBucketId`).
fn build_bucket_id(
    what: &str,
    settings: &quota::RateLimitQuotaBucketSettings,
    request: &Sample<'_>,
) -> Option<Bucket> {
    use quota::rate_limit_quota_bucket_settings::bucket_id_builder::value_builder::ValueSpecifier;
    let builder = settings.bucket_id_builder.as_ref().expect("checked");
    let mut bucket = Bucket::new();
    for (key, value) in &builder.bucket_id_builder {
        match value.value_specifier.as_ref().expect("checked") {
            ValueSpecifier::StringValue(v) => {
                bucket.insert(key.clone(), v.clone());
            }
            ValueSpecifier::CustomValue(input) => {
                let found = request.header(&header_value_input(what, input))?;
                if !found.is_empty() {
                    bucket.insert(key.clone(), found.to_owned());
                }
            }
        }
    }
    Some(bucket)
}

/// Where the filter puts `request`: the first matcher whose predicate matches, else
/// `on_no_match`; `(index of the matcher or None for on_no_match, bucket id)`. `None` when the
/// request passes unreported.
fn bucket_of(
    what: &str,
    m: &xds::Matcher,
    request: &Sample<'_>,
) -> Option<(Option<usize>, Option<Bucket>)> {
    let Some(xds::matcher::MatcherType::MatcherList(list)) = &m.matcher_type else {
        unreachable!("checked");
    };
    for (i, field) in list.matchers.iter().enumerate() {
        let predicate = field.predicate.as_ref().expect("checked");
        if predicate_matches(what, predicate, request) {
            let on_match = field.on_match.as_ref().expect("checked");
            let settings = bucket_settings(what, on_match);
            return Some((Some(i), build_bucket_id(what, &settings, request)));
        }
    }
    let on_no_match = m.on_no_match.as_ref()?;
    let settings = bucket_settings(what, on_no_match);
    Some((None, build_bucket_id(what, &settings, request)))
}

// === The files ===================================================================================

/// The quota filter of an Envoy bootstrap (one connection manager, one quota filter), and the
/// parsed YAML.
pub(super) fn quota_bootstrap(relative: &str) -> (Value, quota::RateLimitQuotaFilterConfig) {
    quota_bootstrap_text(relative, &read(relative))
}

fn quota_bootstrap_text(relative: &str, text: &str) -> (Value, quota::RateLimitQuotaFilterConfig) {
    let (yaml, built) = bootstrap_text(relative, text);
    let managers = connection_managers(&built);
    assert_eq!(managers.len(), 1, "{relative}: one HTTP connection manager");
    let mut quota_filters: Vec<quota::RateLimitQuotaFilterConfig> = Vec::new();
    for f in &managers[0].http_filters {
        match http_filter(relative, f) {
            Filter::Quota(filter) => quota_filters.push(*filter),
            Filter::Router => {}
            Filter::RateLimit(_) => panic!("{relative}: both rate limit filters"),
        }
    }
    assert_eq!(quota_filters.len(), 1, "{relative}: one quota filter");
    let filter = quota_filters.remove(0);
    // The stream's cluster: rlsd's gRPC port on loopback, over HTTP/2.
    let cluster = cluster_named(&yaml, rlqs_cluster(&filter));
    assert_http2(cluster);
    let (host, port) = only_endpoint(cluster);
    assert_eq!(port, i64::from(default_port("--grpc-addr")), "{relative}");
    assert!(host == "127.0.0.1" || host == "::1", "{relative}: loopback");
    (yaml, filter)
}

/// An rlsd config of `deploy/`: rlsd's loader and `rlsd check` accept it.
pub(super) fn check_rlsd_config(relative: &str) {
    load_config(relative, relative, &read(relative));
    let output = command()
        .arg("check")
        .arg("--config")
        .arg(path(relative))
        .output()
        .expect("rlsd check runs");
    assert!(
        output.status.success(),
        "rlsd check refuses {relative}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Sample requests, the bucket Envoy puts each in, and the `quota_buckets:` item written for it
/// (by its entries as written; empty for the default item).
#[allow(clippy::type_complexity)]
const CASES: &[(&str, &[(&str, &str)], &[(&str, &str)], &[(&str, &str)])] = &[
    // Any /checkout request, whatever its tenant: the one checkout budget.
    (
        "/checkout/pay",
        &[],
        &[("name", "checkout")],
        &[("name", "checkout")],
    ),
    (
        "/checkout",
        &[("x-tenant", "acme")],
        &[("name", "checkout")],
        &[("name", "checkout")],
    ),
    // /api/ by tenant.
    (
        "/api/orders",
        &[("x-tenant", "gold-7")],
        &[("name", "api"), ("tenant", "gold-7")],
        &[("name", "api"), ("tenant", "gold-*")],
    ),
    (
        "/api/orders",
        &[("x-tenant", "blocked")],
        &[("name", "api"), ("tenant", "blocked")],
        &[("name", "api"), ("tenant", "blocked")],
    ),
    (
        "/api/orders?page=2",
        &[("x-tenant", "acme")],
        &[("name", "api"), ("tenant", "acme")],
        &[("name", "api")],
    ),
    // /api/ without a tenant, or an empty one: not the api matcher (nor unreported).
    ("/api/orders", &[], &[("name", "other")], &[]),
    (
        "/api/orders",
        &[("x-tenant", "")],
        &[("name", "other")],
        &[],
    ),
    ("/", &[("x-tenant", "acme")], &[("name", "other")], &[]),
];

fn owned(pairs: &[(&str, &str)]) -> Bucket {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A rule's entries as written.
fn written(rule: &BucketRule) -> Bucket {
    let value = |m: &ValueMatch| match m {
        ValueMatch::Exact(v) => v.clone(),
        ValueMatch::Pattern(p) => p.pattern.clone(),
    };
    rule.entries
        .iter()
        .map(|(k, m)| (k.clone(), value(m)))
        .collect()
}

/// Every bucket id of [`CASES`], checked against the Envoy file and the rlsd config, with the
/// rule each lands on.
fn checked_buckets() -> Vec<(Bucket, BucketRule)> {
    checked_buckets_of(&read(ENVOY), &read(RLSD))
}

/// [`checked_buckets`] of an Envoy file and an rlsd config given as text.
fn checked_buckets_of(envoy: &str, rlsd: &str) -> Vec<(Bucket, BucketRule)> {
    let (_, filter) = quota_bootstrap_text(ENVOY, envoy);
    let domain = load_config(RLSD, RLSD, rlsd);
    assert_eq!(
        filter.domain, domain.name,
        "{ENVOY}: the filter's domain must be the `domain:` of {RLSD}"
    );
    let matchers = filter.bucket_matchers.as_ref().expect("checked");
    let mut out = Vec::new();
    let (mut matched, mut rules) = (BTreeSet::new(), BTreeSet::new());
    for (path, headers, bucket, intended) in CASES {
        let request = Sample::new("192.0.2.1", path, headers);
        let what = format!("{ENVOY}: {path} {headers:?}");
        let (matcher, built) = bucket_of(&what, matchers, &request)
            .unwrap_or_else(|| panic!("{what}: no matcher, so unlimited and unreported"));
        let built = built.unwrap_or_else(|| panic!("{what}: no bucket id, so unlimited"));
        assert_eq!(built, owned(bucket), "{what}: the bucket id");
        assert!(!built.is_empty() && built.values().all(|v| !v.is_empty()));
        let rule = domain
            .quota
            .find(&built)
            .unwrap_or_else(|| panic!("{what}: {built:?} meets no item of {RLSD}"));
        assert_eq!(
            written(rule),
            owned(intended),
            "{what}: {built:?} meets the item of line {} of {RLSD}",
            rule.line
        );
        matched.insert(matcher);
        rules.insert(rule.line);
        out.push((built, rule.clone()));
    }
    // Every matcher, on_no_match and item is shown by some case.
    let Some(xds::matcher::MatcherType::MatcherList(list)) = &matchers.matcher_type else {
        unreachable!("checked");
    };
    let mut all: BTreeSet<Option<usize>> = (0..list.matchers.len()).map(Some).collect();
    if matchers.on_no_match.is_some() {
        all.insert(None);
    }
    assert_eq!(matched, all, "{ENVOY}: a matcher no case reaches");
    let lines: BTreeSet<u64> = domain.quota.rules.iter().map(|r| r.line).collect();
    assert_eq!(rules, lines, "{RLSD}: an item no case reaches");
    out
}

#[test]
fn envoy_rlqs_bucket_ids_meet_the_items_written_for_them() {
    let buckets = checked_buckets();
    // The three kinds of answer are all shown.
    let quotas: Vec<Quota> = buckets.iter().map(|(_, rule)| rule.quota.clone()).collect();
    assert!(quotas.contains(&Quota::Unlimited) && quotas.contains(&Quota::Zero));
    assert!(quotas.iter().any(|q| matches!(q, Quota::PerSecond(_))));
}

#[test]
fn a_bucket_id_off_its_item_or_unreported_fails_the_check() {
    let (envoy, rlsd) = (read(ENVOY), read(RLSD));
    let fails = |envoy: &str, rlsd: &str| {
        std::panic::catch_unwind(|| checked_buckets_of(envoy, rlsd)).is_err()
    };
    assert!(!fails(&envoy, &rlsd), "the files as they are pass");
    let replace = |text: &str, from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        text.replacen(from, to, 1)
    };
    for (from, to) in [
        // A bucket id key rlsd's items do not name: gold and blocked tenants would get 50/s.
        (
            "                                        tenant:\n",
            "                                        team:\n",
        ),
        // A misspelt prefix: checkout requests land in {name: other}.
        ("prefix: /checkout", "prefix: /check0ut"),
        // The bucket id from a header the predicate does not require: unreported without it.
        (
            "                                              header_name: x-tenant\n",
            "                                              header_name: x-tenant-id\n",
        ),
    ] {
        assert!(
            fails(&replace(&envoy, from, to), &rlsd),
            "{ENVOY}: {from} -> {to} passes"
        );
    }
    // No on_no_match: the rest passes unreported.
    let start = envoy
        .find("                        on_no_match:")
        .expect("on_no_match");
    let end = envoy
        .find("                  - name: envoy.filters.http.router")
        .expect("router");
    let without = format!("{}{}", &envoy[..start], &envoy[end..]);
    assert!(
        fails(&without, &rlsd),
        "{ENVOY}: without on_no_match passes"
    );
    for (from, to) in [
        ("tenant: \"gold-*\"", "tenant: \"gold*x\""),
        ("name: api, tenant: blocked", "name: api, tenant: block"),
        ("bucket: {name: checkout}", "bucket: {name: check-out}"),
    ] {
        assert!(
            fails(&envoy, &replace(&rlsd, from, to)),
            "{RLSD}: {from} -> {to} passes"
        );
    }
}

#[test]
fn the_quota_filter_model_refuses_what_envoy_refuses_or_ignores() {
    let yaml: Value = serde_saphyr::from_str(&read(ENVOY)).expect("YAML");
    let manager = "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config";
    let good = yaml
        .pointer(&format!("{manager}/http_filters/0"))
        .expect("the quota filter")
        .clone();
    let read_filter = |value: &Value| {
        std::panic::catch_unwind(|| {
            let filter: hcm::HttpFilter = envoy_message("test", value);
            matches!(http_filter("test", &filter), Filter::Quota(_))
        })
    };
    assert!(read_filter(&good).expect("well formed"));
    let config = "/typed_config";
    let first = format!("{config}/bucket_matchers/matcher_list/matchers/0");
    let action = format!("{first}/on_match/action");
    let settings = format!("{action}/typed_config");
    let spoiled = |pointer: &str, value: Option<Value>| {
        let mut spoiled = good.clone();
        let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
        let parent = spoiled.pointer_mut(parent).and_then(Value::as_object_mut);
        let parent = parent.unwrap_or_else(|| panic!("no {pointer}"));
        match value {
            Some(value) => parent.insert(key.to_owned(), value),
            None => parent.remove(key),
        };
        spoiled
    };
    let blanket =
        |rule: &str| serde_json::json!({ "fallback_rate_limit": { "blanket_rule": rule } });
    for (pointer, value) in [
        // Envoy's schema: a misspelt field, an enum name, a type, a duration.
        (format!("{config}/domian"), Some("web".into())),
        (format!("{settings}/no_assignment_behavior"), Some(blanket("ALLOW"))),
        (format!("{settings}/@type"), Some("type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.BucketSettings".into())),
        (format!("{settings}/reporting_interval"), Some("5 s".into())),
        // Envoy's validation rules.
        (format!("{config}/domain"), None),
        (format!("{config}/rlqs_server"), None),
        (format!("{settings}/reporting_interval"), Some("0.1s".into())),
        (format!("{settings}/bucket_id_builder/bucket_id_builder"), Some(serde_json::json!({}))),
        (format!("{action}/name"), None),
        (format!("{first}/predicate/single_predicate/input/name"), None),
        (format!("{first}/predicate/single_predicate/value_match"), Some(serde_json::json!({ "prefix": "" }))),
        // What Envoy ignores or would not report, and what these checks do not model.
        (format!("{settings}/bucket_id_builder"), None),
        (format!("{settings}/no_assignment_behavior"), None),
        (format!("{settings}/expired_assignment_behavior"), None),
        (
            format!("{settings}/expired_assignment_behavior"),
            Some(serde_json::json!({
                "reuse_last_assignment": {},
                "expired_assignment_behavior_timeout": "60s",
            })),
        ),
        (
            format!("{settings}/no_assignment_behavior"),
            Some(serde_json::json!({
                "fallback_rate_limit": { "requests_per_time_unit": { "requests_per_time_unit": 10, "time_unit": "SECOND" } },
            })),
        ),
        (format!("{first}/on_match/keep_matching"), Some(true.into())),
        (format!("{config}/filter_enforced"), Some(serde_json::json!({ "default_value": { "numerator": 0 } }))),
        (format!("{config}/rlqs_server/timeout"), Some("1s".into())),
    ] {
        let bad = spoiled(&pointer, value);
        assert!(read_filter(&bad).is_err(), "accepted {pointer}: {bad}");
    }
}

/// docs/rlqs.md's snippet is a quota filter Envoy reads, with the file's first matcher.
#[test]
fn the_docs_snippet_is_the_files_filter() {
    let docs = read("docs/rlqs.md");
    let section = &docs[docs.find("\n## Envoy\n").expect("an Envoy section")..];
    let start = section.find("```yaml\n").expect("a YAML snippet") + "```yaml\n".len();
    let snippet = &section[start..][..section[start..].find("```").expect("its end")];
    let items: Vec<Value> = serde_saphyr::from_str(snippet).expect("YAML");
    let filter: hcm::HttpFilter = envoy_message("docs/rlqs.md", &items[0]);
    let Filter::Quota(documented) = http_filter("docs/rlqs.md", &filter) else {
        panic!("docs/rlqs.md: not the quota filter");
    };
    let (_, file) = quota_bootstrap(ENVOY);
    assert_eq!(documented.domain, file.domain);
    let first = |m: &quota::RateLimitQuotaFilterConfig| {
        let Some(xds::matcher::MatcherType::MatcherList(list)) = m
            .bucket_matchers
            .as_ref()
            .and_then(|m| m.matcher_type.as_ref())
        else {
            unreachable!("checked");
        };
        list.matchers[0].clone()
    };
    assert_eq!(
        first(&documented),
        first(&file),
        "docs/rlqs.md: the first matcher"
    );
}

/// The shared rlsd of `kubernetes/standalone.yaml` serves this domain too, RLQS on: Envoys
/// anywhere in the cluster point their `rlsd` cluster at its Service.
#[test]
fn the_standalone_rlsd_serves_the_rlqs_domain() {
    let file = "deploy/kubernetes/standalone.yaml";
    let (docs, deployment, container) = rlsd_in(file);
    let settings = RlsdSettings::of(&container, file);
    assert_ne!(flag("--no-rlqs").get_long(), None);
    assert_ne!(
        settings.get("--no-rlqs"),
        Some("true"),
        "{file}: RLQS is off"
    );
    let config = settings.get("--config").expect("--config");
    let pod = deployment.at("spec.template.spec");
    let volume = mounted_volume(file, pod, &container, config);
    let cm = object(
        &docs,
        "ConfigMap",
        volume.str("configMap.name").expect("a ConfigMap"),
    );
    let data = cm.expect("the ConfigMap").at("data");
    let copies = data
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(key, text)| {
            let text = text.as_str().expect("a string");
            (text == read(RLSD)).then_some(key)
        });
    assert_eq!(copies.count(), 1, "{file}: one copy of {RLSD}");
}

/// The answer rlsd must give a bucket held to `quota`.
fn expected_strategy(quota: &Quota, strategy: &Strategy) -> bool {
    match (quota, strategy) {
        (Quota::Unlimited, Strategy::BlanketRule(rule)) => *rule == BlanketRule::AllowAll as i32,
        (Quota::Zero, Strategy::BlanketRule(rule)) => *rule == BlanketRule::DenyAll as i32,
        (Quota::PerSecond(limit), Strategy::TokenBucket(bucket)) => {
            let tokens = bucket.tokens_per_fill.unwrap_or(0);
            let seconds = bucket.fill_interval.as_ref().map_or(0, |d| d.seconds);
            // One Envoy reporting: its share is the whole limit, less rlsd's margin for bursts.
            seconds >= 1 && {
                let rate = f64::from(tokens) / seconds as f64;
                rate > 0.8 * limit && rate <= *limit
            }
        }
        _ => false,
    }
}

#[tokio::test]
async fn rlsd_answers_every_bucket_id_of_the_envoy_file() {
    let buckets = checked_buckets();
    let rlsd = Rlsd::serve(["--config", path(RLSD).to_str().expect("utf-8")]);
    let domain = quota_bootstrap(ENVOY).1.domain;
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");
    let (sender, receiver) = mpsc::channel(4);
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(receiver))
        .await
        .expect("the stream opens")
        .into_inner();
    // As Envoy: one stream; a new bucket is reported at once, alone, 1 allowed, 0 s elapsed.
    for (bucket, rule) in buckets {
        let id = BucketId {
            bucket: bucket.clone().into_iter().collect(),
        };
        let usage = BucketQuotaUsage {
            bucket_id: Some(id.clone()),
            time_elapsed: Some(prost_types::Duration::default()),
            num_requests_allowed: 1,
            num_requests_denied: 0,
        };
        let report = RateLimitQuotaUsageReports {
            domain: domain.clone(),
            bucket_quota_usages: vec![usage],
        };
        sender.send(report).await.expect("send");
        let answer = tokio::time::timeout(Duration::from_secs(5), answers.message())
            .await
            .unwrap_or_else(|_| panic!("{bucket:?}: no answer within 5 s"))
            .unwrap_or_else(|status| panic!("{bucket:?}: {status:?}"))
            .unwrap_or_else(|| panic!("{bucket:?}: the stream ended"));
        let action = answer
            .bucket_action
            .iter()
            .find(|a| a.bucket_id.as_ref() == Some(&id))
            .unwrap_or_else(|| panic!("{bucket:?}: no action for it in {answer:?}"));
        let Some(Action::QuotaAssignmentAction(assignment)) = &action.bucket_action else {
            panic!("{bucket:?}: not an assignment: {action:?}");
        };
        let strategy = assignment
            .rate_limit_strategy
            .as_ref()
            .and_then(|s| s.strategy.as_ref())
            .unwrap_or_else(|| panic!("{bucket:?}: no strategy"));
        assert!(
            expected_strategy(&rule.quota, strategy),
            "{bucket:?}, held to {:?} (line {} of {RLSD}), was assigned {strategy:?}",
            rule.quota,
            rule.line
        );
        let ttl = assignment
            .assignment_time_to_live
            .as_ref()
            .map_or(0, |d| d.seconds);
        assert!(
            ttl > 5,
            "{bucket:?}: a TTL above Envoy's 5 s reports: {ttl} s"
        );
    }
}
