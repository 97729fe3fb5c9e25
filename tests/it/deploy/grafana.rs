//! The Grafana dashboard: every metric it queries is in a real rlsd's exposition.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use super::envoy::{Sample, envoy_bootstrap, envoy_descriptors};
use super::kubernetes::rlsd_in;
use super::{EXAMPLE, Kind, Tree, deploy_files, kind_of, parse_json, path, read};
use crate::common::http_get;
use crate::common::process::Rlsd;

// === Grafana =====================================================================================

pub(super) fn dashboard(file: &str) -> Value {
    parse_json(&read(file)).unwrap_or_else(|e| panic!("{file}: not JSON: {e}"))
}

/// Every PromQL expression of a dashboard: panel `expr`s and template `label_values(...)`.
pub(super) fn expressions(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(entries) => {
            for (k, v) in entries {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    ("query" | "definition", Value::String(q))
                        if q.starts_with("label_values(") =>
                    {
                        out.push(q.clone());
                    }
                    _ => expressions(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| expressions(i, out)),
        _ => {}
    }
}

/// The metric names a PromQL expression reads: identifiers that are not functions,
/// aggregations, keywords, numbers, Grafana variables or grouping labels.
pub(super) fn metric_names(expr: &str) -> Vec<String> {
    const GROUPING: &str = "by without on ignoring group_left group_right";
    const KEYWORDS: &str = "bool and or unless offset sum min max avg group stddev stdvar count \
        count_values bottomk topk quantile limitk limit_ratio atan2 inf nan";
    let expr = match expr.strip_prefix("label_values(") {
        Some(rest) => rest.split(',').next().unwrap_or_default(),
        None => expr,
    };
    // Blank out strings, `{...}` matchers and `[...]` ranges.
    let mut plain = String::new();
    let mut closers: Vec<char> = Vec::new();
    let mut chars = expr.chars();
    while let Some(c) = chars.next() {
        let in_string = closers.last().is_some_and(|q| "\"'`".contains(*q));
        match c {
            '\\' if in_string => drop(chars.next()),
            c if closers.last() == Some(&c) => drop(closers.pop()),
            '"' | '\'' | '`' if !in_string => closers.push(c),
            '{' | '[' if !in_string => closers.push(if c == '{' { '}' } else { ']' }),
            c if closers.is_empty() => plain.push(c),
            _ => {}
        }
        if !closers.is_empty() || "}]\"'`".contains(c) {
            plain.push(' ');
        }
    }
    let is_word = |c: char| c.is_ascii_alphanumeric() || "_:$".contains(c);
    let (mut names, mut grouping, mut in_labels) = (Vec::new(), false, false);
    let mut rest = plain.as_str();
    while let Some(c) = rest.chars().next() {
        let len = rest.find(|c| !is_word(c)).unwrap_or(rest.len());
        if len == 0 {
            match c {
                '(' if grouping => (grouping, in_labels) = (false, true),
                ')' => in_labels = false,
                _ => {}
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let (word, after) = rest.split_at(len);
        rest = after;
        let lower = word.to_ascii_lowercase();
        let is = |list: &str| list.split_whitespace().any(|w| w == lower);
        // A call, or the label list of a grouping word (`group_left` may stand alone).
        let opens = after.trim_start().starts_with('(');
        grouping = is(GROUPING) && opens;
        let numeric_or_variable = word.starts_with(|c: char| c == '$' || c.is_ascii_digit());
        if !(is(GROUPING) || in_labels || is(KEYWORDS) || opens || numeric_or_variable) {
            names.push(word.to_owned());
        }
    }
    names
}

#[test]
fn metric_names_reads_promql() {
    assert_eq!(
        metric_names(
            r#"histogram_quantile(0.99, sum by (le, store) (rate(rlsd_store_call_duration_seconds_bucket{a="}"}[$__rate_interval])))"#
        ),
        ["rlsd_store_call_duration_seconds_bucket"]
    );
    assert_eq!(
        metric_names("sum by (descriptor) (rate(a_total[1m])) / sum(rate(b_total[1m]))"),
        ["a_total", "b_total"]
    );
    assert_eq!(
        metric_names("label_values(ratelimit_service_rate_limit_total_hits, domain)"),
        ["ratelimit_service_rate_limit_total_hits"]
    );
    let expr = "topk($n, x_total offset 5m) * on(le) group_left(a) y:ratio > 1e3";
    assert_eq!(metric_names(expr), ["x_total", "y:ratio"]);
    let expr = "a * on(x) group_left b + rate(c[5m]) atan2 d";
    assert_eq!(metric_names(expr), ["a", "b", "c", "d"]);
}

pub(super) fn check_dashboard_shape(file: &str, d: &Value) {
    for key in ["uid", "title", "schemaVersion", "panels", "templating"] {
        assert!(d.get(key).is_some(), "{file}: no {key}");
    }
    let variables: Vec<&str> = d
        .seq("templating.list")
        .iter()
        .filter_map(|v| v.str("name"))
        .collect();
    let panels = d.seq("panels");
    assert!(!panels.is_empty(), "{file}: no panels");
    let mut ids = BTreeSet::new();
    for p in panels {
        let title = p.str("title").unwrap_or_default();
        assert!(!title.is_empty(), "{file}: a panel without a title");
        assert!(ids.insert(p.int("id").expect("id")), "{file}: id");
        assert!(p.get("gridPos").is_some(), "{file}: {title}: gridPos");
        let targets = p.seq("targets");
        assert!(!targets.is_empty(), "{file}: {title}: no queries");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(refs.insert(t.str("refId").expect("refId")));
            let expr = t.str("expr").expect("expr");
            // Every $variable it uses is defined (Grafana's own start with `__`).
            for var in expr.split('$').skip(1) {
                let var: String = var
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    var.starts_with("__") || variables.contains(&var.as_str()),
                    "{file}: {title}: undefined ${var}"
                );
            }
        }
        let ds = p.str("datasource.uid").unwrap_or_default();
        assert!(
            ds.starts_with("${") && variables.contains(&&ds[2..ds.len() - 1]),
            "{file}: {title}: datasource through a variable, so any Prometheus works"
        );
    }
}

// === A real rlsd =================================================================================

/// `rlsd serve` on the example config with `extra` flags, healthy.
pub(super) async fn start_rlsd(extra: &[&str]) -> Rlsd {
    let config = path(EXAMPLE).display().to_string();
    let rlsd = Rlsd::serve([&["--config", config.as_str()], extra].concat());
    let (status, body) = http_get(rlsd.http, "/healthcheck").await;
    assert_eq!((status, body.trim()), (200, "OK"), "{}", rlsd.log());
    rlsd
}

pub(super) fn descriptor_of(entries: &[(String, String)]) -> rlsd::pb::RateLimitDescriptor {
    let entry = |(key, value): &(String, String)| rlsd::pb::rate_limit_descriptor::Entry {
        key: key.clone(),
        value: value.clone(),
    };
    rlsd::pb::RateLimitDescriptor {
        entries: entries.iter().map(entry).collect(),
        ..Default::default()
    }
}

/// The metric families of a text exposition, by name, with their TYPE.
pub(super) fn exposition_types(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (name, kind) = l.split_once(' ')?;
            Some((name.to_owned(), kind.trim().to_owned()))
        })
        .collect()
}

#[tokio::test]
async fn the_dashboard_and_probes_match_a_running_rlsd() {
    // Three keys at most: the first request (three descriptors) fits, the second needs three
    // more and is refused, so the store-error and failure-mode series exist too.
    let rlsd = start_rlsd(&["--max-keys", "3", "--headers", "off"]).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", rlsd.grpc))
        .expect("endpoint")
        .connect()
        .await
        .expect("gRPC connects");
    let mut client = rlsd::pb::RateLimitServiceClient::new(channel.clone());

    // The request deploy/envoy.yaml sends for a search by a free key.
    let (_, rl) = envoy_bootstrap("deploy/envoy.yaml");
    let request_for = |client_ip: &str, key: &str| {
        let headers = [("x-plan", "free"), ("x-api-key", key)];
        let descriptors = envoy_descriptors(&rl, &Sample::new(client_ip, "/search", &headers));
        rlsd::pb::RateLimitRequest {
            domain: rl.filter.domain.clone(),
            descriptors: descriptors.iter().map(|d| descriptor_of(d)).collect(),
            ..Default::default()
        }
    };
    let first = client
        .should_rate_limit(request_for("192.0.2.1", "k-1"))
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(first.statuses.len(), 3);
    assert_eq!(
        first.overall_code,
        rlsd::pb::rate_limit_response::Code::Ok as i32
    );
    assert!(
        first.statuses.iter().all(|s| s.current_limit.is_some()),
        "every descriptor Envoy sends hits a limit: {first:?}"
    );
    assert!(
        first.response_headers_to_add.is_empty(),
        "--headers off adds no headers"
    );
    let refused = client
        .should_rate_limit(request_for("192.0.2.2", "k-2"))
        .await
        .expect_err("the store is full");
    assert_eq!(refused.code(), tonic::Code::Unavailable);

    // Every gRPC health service a probe names answers SERVING.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut services = BTreeSet::new();
    for file in [
        "deploy/kubernetes/sidecar.yaml",
        "deploy/kubernetes/standalone.yaml",
    ] {
        let (_, _, c) = rlsd_in(file);
        for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
            if let Some(g) = c.at(probe).find("grpc") {
                services.insert(g.at("service").text().unwrap_or_default());
            }
        }
    }
    assert!(!services.is_empty(), "some probe uses gRPC health");
    for service in services {
        let request = tonic_health::pb::HealthCheckRequest {
            service: service.clone(),
        };
        let status = health
            .check(request)
            .await
            .unwrap_or_else(|e| panic!("health of `{service}`: {e}"))
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "`{service}`"
        );
    }

    // Let the store prober publish its gauges, then scrape like Prometheus.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, text) = http_get(rlsd.http, "/metrics").await;
    assert_eq!(status, 200);
    let types = exposition_types(&text);
    let mut expressions_found = Vec::new();
    let files: Vec<String> = deploy_files()
        .into_iter()
        .filter(|f| kind_of(f) == Kind::GrafanaDashboard)
        .collect();
    assert!(!files.is_empty());
    for file in &files {
        expressions(&dashboard(file), &mut expressions_found);
    }
    let type_of = |name: &str| types.get(name).map(String::as_str);
    let mut used = BTreeSet::new();
    for expr in &expressions_found {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "`{expr}` reads no metric");
        for metric in names {
            let known = type_of(&metric).is_some()
                || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                    metric.strip_suffix(suffix).is_some_and(|base| {
                        type_of(base) == Some("histogram")
                            || (*suffix != "_bucket" && type_of(base) == Some("summary"))
                    })
                });
            assert!(
                known,
                "the dashboard queries `{metric}` (in `{expr}`), which rlsd does not export; it exports {:?}",
                types.keys().collect::<Vec<_>>()
            );
            used.insert(metric);
        }
    }
    // The per-limit series carry the domain and descriptor labels the dashboard groups by.
    assert!(
        text.lines().any(
            |l| l.starts_with("ratelimit_service_rate_limit_total_hits{")
                && l.contains("descriptor=\"edge-proxy.")
                && l.contains("domain=\"edge-proxy\"")
        ),
        "{text}"
    );
    assert!(
        used.len() >= 10,
        "the dashboard charts most metrics: {used:?}"
    );
}
