//! `deploy/envoy.yaml` and the Istio filters, read with Envoy's own schema (its protos, as
//! envoy-types ships them) into Envoy's messages, and the descriptors Envoy would send from them
//! checked against `examples/three-layer.yaml`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use envoy_types::pb::envoy::config::bootstrap::v3 as bootstrap;
use envoy_types::pb::envoy::config::cluster::v3 as cluster;
use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::listener::v3 as listener;
use envoy_types::pb::envoy::config::ratelimit::v3::RateLimitServiceConfig;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::filters::http::rate_limit_quota::v3::RateLimitQuotaFilterConfig;
use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3 as rl_filter;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::envoy::extensions::upstreams::http::v3 as upstream_http;
use envoy_types::pb::envoy::r#type::matcher::v3 as matcher;
use envoy_types::pb::google::protobuf as wkt;
use prost::{Message, Name};
use prost_reflect::{DescriptorPool, DynamicMessage};
use serde_json::Value;

use super::kubernetes::RlsdSettings;
use super::rlqs::{QUOTA_FILTER, quota_bootstrap, quota_filter};
use super::{EXAMPLE, ROOT, Tree, default_port, example_domain, limited_node, limited_paths, read};

// === Envoy's schema ==============================================================================
//
// The files are read as Envoy reads them: the proto3 JSON mapping of its own messages, with
// unknown fields, unknown `@type`s, misspelt enum names and malformed durations refused.

/// The proto files declaring every message our files write, `Any` payloads included.
const PROTOS: [&str; 7] = [
    "envoy/config/bootstrap/v3/bootstrap.proto",
    "envoy/extensions/filters/network/http_connection_manager/v3/http_connection_manager.proto",
    "envoy/extensions/filters/http/ratelimit/v3/rate_limit.proto",
    "envoy/extensions/filters/http/rate_limit_quota/v3/rate_limit_quota.proto",
    "envoy/type/matcher/v3/http_inputs.proto",
    "envoy/extensions/filters/http/router/v3/router.proto",
    "envoy/extensions/upstreams/http/v3/http_protocol_options.proto",
];

/// Where envoy-types keeps the protos its types were generated from, as cargo resolved it for
/// the platform this was built for (other platforms' crates were never downloaded).
fn envoy_types_protos() -> PathBuf {
    let output = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version=1",
            "--offline",
            "--filter-platform",
            env!("RLSD_BUILD_TARGET"),
            "--manifest-path",
        ])
        .arg(format!("{ROOT}/Cargo.toml"))
        .output()
        .expect("cargo metadata");
    assert!(output.status.success(), "cargo metadata: {output:?}");
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("metadata JSON");
    let package = metadata
        .seq("packages")
        .iter()
        .find(|p| p.str("name") == Some("envoy-types"))
        .expect("envoy-types among the packages");
    let manifest = PathBuf::from(package.str("manifest_path").expect("manifest_path"));
    manifest.parent().expect("crate dir").join("proto")
}

fn schema() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let protos = envoy_types_protos();
        let out = tempfile::NamedTempFile::new().expect("temp file");
        let mut protoc = Command::new(protoc_bin_vendored::protoc_bin_path().expect("protoc"));
        protoc
            .arg("--include_imports")
            .arg(format!("--descriptor_set_out={}", out.path().display()))
            .arg("-I")
            .arg(protoc_bin_vendored::include_path().expect("well-known protos"));
        for dir in ["data-plane-api", "xds", "protoc-gen-validate", "googleapis"] {
            protoc.arg("-I").arg(protos.join(dir));
        }
        let status = protoc.args(PROTOS).status().expect("protoc runs");
        assert!(status.success(), "protoc failed on envoy-types' protos");
        let set = std::fs::read(out.path()).expect("descriptor set");
        DescriptorPool::decode(set.as_slice()).expect("a descriptor pool")
    })
}

/// Reads `value` as Envoy reads a `M` from YAML.
pub(super) fn envoy_message<M: Message + Name + Default>(what: &str, value: &Value) -> M {
    assert_failure_mode_written(what, value);
    let descriptor = schema()
        .get_message_by_name(&M::full_name())
        .unwrap_or_else(|| panic!("{} is not in the schema", M::full_name()));
    let dynamic = DynamicMessage::deserialize(descriptor, value)
        .unwrap_or_else(|e| panic!("{what}: Envoy would refuse this {}: {e}", M::NAME));
    dynamic.transcode_to().expect("the same message")
}

/// Failing open or closed is a choice to write down, not a default to fall into.
fn assert_failure_mode_written(what: &str, value: &Value) {
    match value {
        Value::Object(map) => {
            if value.str("@type") == Some(&rl_filter::RateLimit::type_url()) {
                assert!(
                    map.contains_key("failure_mode_deny"),
                    "{what}: the rate limit filter must say failure_mode_deny"
                );
            }
            map.values()
                .for_each(|v| assert_failure_mode_written(what, v));
        }
        Value::Array(items) => items
            .iter()
            .for_each(|v| assert_failure_mode_written(what, v)),
        _ => {}
    }
}

/// An `Any`'s payload, which must be a `M`.
pub(super) fn unpack<M: Message + Name + Default>(what: &str, any: &wkt::Any) -> M {
    assert_eq!(any.type_url, M::type_url(), "{what}: the wrong @type");
    M::decode(any.value.as_slice()).expect("encoded by the schema")
}

pub(super) fn as_std(d: &wkt::Duration) -> Duration {
    Duration::new(
        u64::try_from(d.seconds).expect("non-negative"),
        u32::try_from(d.nanos).expect("non-negative"),
    )
}

/// Asserts a message sets no field but those named: a field that changes what Envoy sends, and
/// that these checks do not model, must fail them rather than pass unread.
macro_rules! only {
    ($what:expr, $message:expr, $ty:ty { $($field:ident),* $(,)? }) => {{
        let message: &$ty = &$message;
        let mut modelled = <$ty>::default();
        $(modelled.$field = message.$field.clone();)*
        assert_eq!(
            *message,
            modelled,
            "{}: only {} of a {} are modelled by tests/it/deploy/",
            $what,
            stringify!($($field),*),
            stringify!($ty)
        );
    }};
}
pub(super) use only;

// === Envoy: the bootstrap ========================================================================

/// An Envoy bootstrap file, as parsed YAML and what it says about rate limiting.
pub(super) fn envoy_bootstrap(relative: &str) -> (Value, EnvoyRateLimiting) {
    envoy_bootstrap_text(relative, &read(relative))
}

pub(super) fn envoy_bootstrap_text(what: &str, text: &str) -> (Value, EnvoyRateLimiting) {
    let (yaml, built) = bootstrap_text(what, text);
    (yaml, rate_limiting(&built))
}

/// Checks one Envoy bootstrap of `deploy/`: with the quota filter as an RLQS client of rlsd,
/// otherwise as a client of its `ShouldRateLimit`.
pub(super) fn check_envoy_bootstrap(relative: &str) {
    let (_, built) = bootstrap_text(relative, &read(relative));
    let managers = connection_managers(&built);
    let filters = managers.iter().flat_map(|m| &m.http_filters);
    if filters.clone().any(|f| f.name == QUOTA_FILTER) {
        drop(quota_bootstrap(relative));
    } else {
        drop(envoy_bootstrap(relative));
    }
}

/// A bootstrap, parsed and read into Envoy's message, its clusters checked.
pub(super) fn bootstrap_text(what: &str, text: &str) -> (Value, bootstrap::Bootstrap) {
    let yaml: Value = serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    let built: bootstrap::Bootstrap = envoy_message(what, &yaml);
    only!(
        what,
        built,
        bootstrap::Bootstrap {
            admin,
            static_resources
        }
    );
    let resources = built.static_resources.as_ref().expect("static_resources");
    only!(
        what,
        *resources,
        bootstrap::bootstrap::StaticResources {
            listeners,
            clusters
        }
    );
    for c in &resources.clusters {
        #[rustfmt::skip]
        only!(c.name, *c, cluster::Cluster {
            name, connect_timeout, cluster_discovery_type, typed_extension_protocol_options,
            load_assignment,
        });
        let assignment = c.load_assignment.as_ref().expect("load_assignment");
        assert_eq!(assignment.cluster_name, c.name, "{what}: {}", c.name);
    }
    (yaml, built)
}

/// The HTTP filters modelled here, each with its config.
pub(super) enum Filter {
    /// `envoy.filters.http.ratelimit`: `ShouldRateLimit` per request.
    RateLimit(Box<rl_filter::RateLimit>),
    /// `envoy.filters.http.rate_limit_quota`: an RLQS client.
    Quota(Box<RateLimitQuotaFilterConfig>),
    /// `envoy.filters.http.router`.
    Router,
}

/// The rate limit filter's config, or `None` for the router; any other filter is not modelled.
pub(super) fn rate_limit_filter(what: &str, f: &hcm::HttpFilter) -> Option<rl_filter::RateLimit> {
    match http_filter(what, f) {
        Filter::RateLimit(filter) => Some(*filter),
        Filter::Router => None,
        Filter::Quota(_) => panic!("{what}: {QUOTA_FILTER} where the ratelimit filter belongs"),
    }
}

/// An HTTP filter, read and checked; a filter not modelled here fails.
pub(super) fn http_filter(what: &str, f: &hcm::HttpFilter) -> Filter {
    only!(what, *f, hcm::HttpFilter { name, config_type });
    let Some(hcm::http_filter::ConfigType::TypedConfig(any)) = &f.config_type else {
        panic!("{what}: HTTP filter {} without typed_config", f.name);
    };
    match f.name.as_str() {
        QUOTA_FILTER => Filter::Quota(Box::new(quota_filter(what, any))),
        "envoy.filters.http.ratelimit" => {
            let filter: rl_filter::RateLimit = unpack(what, any);
            #[rustfmt::skip]
            only!(what, filter, rl_filter::RateLimit {
                domain, timeout, failure_mode_deny, enable_x_ratelimit_headers, rate_limit_service,
            });
            let service = filter
                .rate_limit_service
                .as_ref()
                .expect("rate_limit_service");
            #[rustfmt::skip]
            only!(what, *service, RateLimitServiceConfig { grpc_service, transport_api_version });
            let v3 = core::ApiVersion::V3 as i32;
            assert_eq!(
                service.transport_api_version, v3,
                "{what}: rlsd speaks v3 only"
            );
            let grpc = service.grpc_service.as_ref().expect("grpc_service");
            only!(
                what,
                *grpc,
                core::GrpcService {
                    target_specifier,
                    timeout
                }
            );
            only!(
                what,
                *rlsd_target(&filter),
                core::grpc_service::EnvoyGrpc {
                    cluster_name,
                    authority
                }
            );
            Filter::RateLimit(Box::new(filter))
        }
        "envoy.filters.http.router" => {
            let _: Router = unpack(what, any);
            Filter::Router
        }
        other => panic!("{what}: HTTP filter {other} is not modelled by tests/it/deploy/"),
    }
}

/// What the Envoy config says about rate limiting, from the real messages.
pub(super) struct EnvoyRateLimiting {
    pub(super) filter: rl_filter::RateLimit,
    /// The `rate_limits` of the (single) virtual host or route that carries them.
    pub(super) entries: Vec<route::RateLimit>,
    pub(super) use_remote_address: bool,
}

/// Every HTTP connection manager of a built bootstrap, through the encoded `Any`s, checked for
/// what every file here must be: listeners, filters and routes of the modelled kinds, the
/// router last, routes to clusters that exist.
pub(super) fn connection_managers(built: &bootstrap::Bootstrap) -> Vec<hcm::HttpConnectionManager> {
    let resources = built.static_resources.as_ref().expect("static_resources");
    let clusters: BTreeSet<&str> = resources.clusters.iter().map(|c| c.name.as_str()).collect();
    let mut filters = Vec::new();
    for l in &resources.listeners {
        only!(
            l.name,
            *l,
            listener::Listener {
                name,
                address,
                filter_chains
            }
        );
        for chain in &l.filter_chains {
            only!(l.name, *chain, listener::FilterChain { filters });
            filters.extend(&chain.filters);
        }
    }
    let mut managers = Vec::new();
    for f in filters {
        only!(f.name, *f, listener::Filter { name, config_type });
        let Some(listener::filter::ConfigType::TypedConfig(any)) = &f.config_type else {
            panic!("filter {} without typed_config", f.name);
        };
        assert_eq!(f.name, "envoy.filters.network.http_connection_manager");
        let manager: hcm::HttpConnectionManager = unpack(&f.name, any);
        #[rustfmt::skip]
        only!(f.name, manager, hcm::HttpConnectionManager {
            stat_prefix, codec_type, use_remote_address, http_filters, route_specifier,
        });
        assert_eq!(
            manager.http_filters.last().map(|f| f.name.as_str()),
            Some("envoy.filters.http.router"),
            "the router must be the last HTTP filter"
        );
        let routes = route_config(&manager);
        #[rustfmt::skip]
        only!(routes.name, *routes, route::RouteConfiguration { name, virtual_hosts });
        for v in &routes.virtual_hosts {
            #[rustfmt::skip]
            only!(v.name, *v, route::VirtualHost { name, domains, routes, rate_limits });
            for r in &v.routes {
                only!(v.name, *r, route::Route { r#match, action });
                let action = route_action(&v.name, r);
                only!(
                    v.name,
                    *action,
                    route::RouteAction {
                        cluster_specifier,
                        rate_limits
                    }
                );
                let Some(route::route_action::ClusterSpecifier::Cluster(cluster)) =
                    &action.cluster_specifier
                else {
                    panic!("{}: a route without a cluster", v.name);
                };
                assert!(clusters.contains(cluster.as_str()), "no cluster {cluster}");
            }
        }
        managers.push(manager);
    }
    managers
}

/// A connection manager's inline route config.
pub(super) fn route_config(manager: &hcm::HttpConnectionManager) -> &route::RouteConfiguration {
    use hcm::http_connection_manager::RouteSpecifier;
    let Some(RouteSpecifier::RouteConfig(routes)) = &manager.route_specifier else {
        panic!("{}: an inline route_config", manager.stat_prefix);
    };
    routes
}

fn route_action<'r>(host: &str, r: &'r route::Route) -> &'r route::RouteAction {
    let Some(route::route::Action::Route(action)) = &r.action else {
        panic!("{host}: a route without a cluster");
    };
    action
}

/// Unpacks what matters for rate limiting from a built bootstrap.
fn rate_limiting(built: &bootstrap::Bootstrap) -> EnvoyRateLimiting {
    let mut found = Vec::new();
    for manager in connection_managers(built) {
        let mut rate_limit_filters: Vec<rl_filter::RateLimit> = manager
            .http_filters
            .iter()
            .filter_map(|f| rate_limit_filter(&manager.stat_prefix, f))
            .collect();
        assert_eq!(rate_limit_filters.len(), 1, "one rate limit filter");
        let filter = rate_limit_filters.remove(0);
        let mut carriers: Vec<&Vec<route::RateLimit>> = Vec::new();
        for v in &route_config(&manager).virtual_hosts {
            carriers.push(&v.rate_limits);
            for r in &v.routes {
                carriers.push(&route_action(&v.name, r).rate_limits);
            }
        }
        carriers.retain(|entries| !entries.is_empty());
        assert_eq!(
            carriers.len(),
            1,
            "all rate_limits on one virtual host or route, so they go in one request"
        );
        found.push(EnvoyRateLimiting {
            filter,
            entries: carriers[0].clone(),
            use_remote_address: manager.use_remote_address.is_some_and(|b| b.value),
        });
    }
    assert_eq!(
        found.len(),
        1,
        "one HTTP connection manager with rate limiting"
    );
    found.pop().expect("one")
}

/// The cluster the rate limit filter calls.
pub(super) fn rlsd_target(filter: &rl_filter::RateLimit) -> &core::grpc_service::EnvoyGrpc {
    let target = filter
        .rate_limit_service
        .as_ref()
        .and_then(|s| s.grpc_service.as_ref())
        .and_then(|g| g.target_specifier.as_ref());
    let Some(core::grpc_service::TargetSpecifier::EnvoyGrpc(grpc)) = target else {
        panic!("envoy_grpc");
    };
    grpc
}

/// The cluster of a bootstrap named `name`.
pub(super) fn cluster_named<'y>(y: &'y Value, name: &str) -> &'y Value {
    let clusters = y.seq("static_resources.clusters");
    let found = clusters.iter().find(|c| c.str("name") == Some(name));
    found.unwrap_or_else(|| panic!("no cluster {name}"))
}

/// A cluster's one endpoint, as host and port.
pub(super) fn only_endpoint(c: &Value) -> (&str, i64) {
    let localities = c.seq("load_assignment.endpoints");
    let endpoints: Vec<&Value> = localities
        .iter()
        .flat_map(|l| l.seq("lb_endpoints"))
        .collect();
    assert_eq!(
        endpoints.len(),
        1,
        "cluster {:?}: one endpoint",
        c.str("name")
    );
    let socket = endpoints[0].at("endpoint.address.socket_address");
    (
        socket.str("address").expect("an address"),
        socket.int("port_value").expect("a port"),
    )
}

/// gRPC needs HTTP/2 to the cluster, which Envoy speaks only when told.
pub(super) fn assert_http2(c: &Value) {
    let name = upstream_http::HttpProtocolOptions::full_name();
    let options = c.at("typed_extension_protocol_options").get(&name);
    let options = options.unwrap_or_else(|| panic!("{:?}: no {name}", c.str("name")));
    assert_eq!(
        options.str("@type"),
        Some(&*upstream_http::HttpProtocolOptions::type_url())
    );
    assert!(
        options
            .find("explicit_http_config.http2_protocol_options")
            .is_some(),
        "cluster {:?}: gRPC needs http2_protocol_options",
        c.str("name")
    );
}

/// Envoy's rate limit headers, or rlsd's `--headers`: exactly one side adds them.
pub(super) fn assert_headers_from_one_side(
    what: &str,
    filter: &rl_filter::RateLimit,
    rlsd: &RlsdSettings,
) {
    let envoy_adds = filter.enable_x_ratelimit_headers
        == rl_filter::rate_limit::XRateLimitHeadersRfcVersion::DraftVersion03 as i32;
    assert_eq!(
        rlsd.get("--headers") == Some("off"),
        envoy_adds,
        "{what}: Envoy's enable_x_ratelimit_headers and rlsd's --headers must not both add headers (nor neither)"
    );
}

// === Envoy: the descriptors it sends =============================================================

/// A request as the rate limit filter sees it.
pub(super) struct Sample<'a> {
    pub(super) client: &'a str,
    pub(super) path: &'a str,
    pub(super) headers: &'a [(&'a str, &'a str)],
}

impl<'a> Sample<'a> {
    pub(super) fn new(
        client: &'a str,
        path: &'a str,
        headers: &'a [(&'a str, &'a str)],
    ) -> Sample<'a> {
        Sample {
            client,
            path,
            headers,
        }
    }

    pub(super) fn header(&self, name: &str) -> Option<&str> {
        if name == ":path" {
            return Some(self.path);
        }
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    }
}

pub(super) fn header_matches(m: &route::HeaderMatcher, request: &Sample<'_>) -> bool {
    use matcher::string_matcher::MatchPattern;
    use route::header_matcher::HeaderMatchSpecifier;
    let Some(HeaderMatchSpecifier::StringMatch(s)) = &m.header_match_specifier else {
        panic!("header match {m:?} is not modelled");
    };
    let Some(MatchPattern::Prefix(prefix)) = &s.match_pattern else {
        panic!("string match {s:?} is not modelled");
    };
    only!(
        m.name,
        *m,
        route::HeaderMatcher {
            name,
            header_match_specifier
        }
    );
    only!(m.name, *s, matcher::StringMatcher { match_pattern });
    request
        .header(&m.name)
        .is_some_and(|v| v.starts_with(prefix.as_str()))
}

/// The descriptor Envoy sends for one `rate_limits` entry (rate_limit_filter.rst); `None` when
/// an action cannot produce its value, which drops the entry whole.
pub(super) fn descriptor(
    entry: &route::RateLimit,
    request: &Sample<'_>,
) -> Option<Vec<(String, String)>> {
    use route::rate_limit::action::ActionSpecifier;
    only!("a rate_limits entry", *entry, route::RateLimit { actions });
    // Per action: `Some(None)` adds nothing, `None` drops the whole entry.
    let pair = |key: &str, value: &str| Some(Some((key.to_owned(), value.to_owned())));
    let entries: Option<Vec<Option<(String, String)>>> = entry
        .actions
        .iter()
        .map(
            |action| match action.action_specifier.as_ref().expect("an action") {
                ActionSpecifier::RemoteAddress(_) => pair("remote_address", request.client),
                ActionSpecifier::RequestHeaders(h) => match request.header(&h.header_name) {
                    Some(value) => pair(&h.descriptor_key, value),
                    None if h.skip_if_absent => Some(None),
                    None => None,
                },
                ActionSpecifier::HeaderValueMatch(m) => {
                    #[rustfmt::skip]
                    only!("header_value_match", *m, route::rate_limit::action::HeaderValueMatch {
                        descriptor_value, descriptor_key, expect_match, headers,
                    });
                    assert!(!m.headers.is_empty(), "header_value_match needs headers");
                    let key = match m.descriptor_key.as_str() {
                        "" => "header_match",
                        key => key,
                    };
                    let all = m.headers.iter().all(|h| header_matches(h, request));
                    if all == m.expect_match.as_ref().is_none_or(|b| b.value) {
                        pair(key, &m.descriptor_value)
                    } else {
                        None
                    }
                }
                other => panic!("action {other:?} is not modelled by tests/it/deploy/"),
            },
        )
        .collect();
    Some(entries?.into_iter().flatten().collect())
}

/// The descriptors of one request: one per entry that produces one.
pub(super) fn envoy_descriptors(
    rl: &EnvoyRateLimiting,
    request: &Sample<'_>,
) -> Vec<Vec<(String, String)>> {
    rl.entries
        .iter()
        .filter_map(|entry| descriptor(entry, request))
        .collect()
}

pub(super) fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Requests covering every path and plan the example distinguishes.
pub(super) const PATHS: [&str; 3] = ["/search?q=rust", "/export/all.csv", "/"];
pub(super) const PLANS: [&str; 2] = ["free", "pro"];

/// Checks an Envoy rate limit setup against the example config: domain, timeout, and that every
/// descriptor it produces lands on a limit, and every limit of the example is reached.
pub(super) fn check_against_example(what: &str, rl: &EnvoyRateLimiting) {
    let domain = example_domain();
    assert_eq!(
        rl.filter.domain, domain.name,
        "{what}: the filter's domain must be the `domain:` of {EXAMPLE}"
    );
    let timeout = rl.filter.timeout.as_ref().map(as_std).unwrap_or_default();
    assert!(
        timeout > Duration::ZERO && timeout <= Duration::from_secs(1),
        "{what}: timeout {timeout:?} must be set, and at most 1 s"
    );
    assert!(
        rl.use_remote_address,
        "{what}: use_remote_address, or remote_address is the previous hop, not the client"
    );
    let mut reached = BTreeSet::new();
    for (i, entry) in rl.entries.iter().enumerate() {
        let mut produced = false;
        for (path, plan) in PATHS.iter().flat_map(|p| PLANS.map(|plan| (*p, plan))) {
            let headers = [("x-plan", plan), ("x-api-key", "k-test")];
            // With every header, and with each one missing: what is sent must meet a limit.
            let subsets = [&headers[..], &headers[..1], &headers[1..]];
            for sample in subsets.map(|h| Sample::new("203.0.113.7", path, h)) {
                let Some(descriptor) = descriptor(entry, &sample) else {
                    continue;
                };
                assert!(
                    !descriptor.is_empty(),
                    "{what}: entry {i} sends an empty descriptor"
                );
                produced = true;
                reached.insert(limited_node(&domain, &descriptor).path.clone());
            }
        }
        assert!(
            produced,
            "{what}: rate_limits entry {i} never produces a descriptor"
        );
    }
    let mut all = BTreeSet::new();
    limited_paths(&domain.root, &mut all);
    assert_eq!(
        reached, all,
        "{what}: every limit of {EXAMPLE} must be reachable from the Envoy actions"
    );
}

#[test]
fn envoy_yaml_sends_the_three_layers_in_one_request() {
    let (y, rl) = envoy_bootstrap("deploy/envoy.yaml");
    check_against_example("deploy/envoy.yaml", &rl);

    // A search by a free key: one request, the three layers, in the config's order.
    let headers = [
        ("x-plan", "free"),
        ("x-api-key", "k-1"),
        ("user-agent", "t"),
    ];
    let search = Sample::new("198.51.100.4", "/search?q=envoy", &headers);
    let expected = vec![
        pairs(&[("remote_address", "198.51.100.4")]),
        pairs(&[("plan", "free"), ("api_key", "k-1")]),
        pairs(&[("endpoint", "search"), ("api_key", "k-1")]),
    ];
    assert_eq!(envoy_descriptors(&rl, &search), expected);
    let domain = example_domain();
    let limits: BTreeSet<&String> = expected
        .iter()
        .map(|d| &limited_node(&domain, d).path)
        .collect();
    assert_eq!(
        limits.len(),
        3,
        "three layers, three different limits: {limits:?}"
    );

    // An export by a pro key, and a plain page: the endpoint layer only where it applies.
    let headers = [("x-plan", "pro"), ("x-api-key", "k-2")];
    let export = Sample::new("198.51.100.5", "/export", &headers);
    assert_eq!(
        envoy_descriptors(&rl, &export)[2],
        pairs(&[("endpoint", "export"), ("api_key", "k-2")])
    );
    let page = Sample::new("198.51.100.5", "/about", &headers);
    assert_eq!(envoy_descriptors(&rl, &page).len(), 2);
    // No key: only the edge layer (the plan and endpoint entries are dropped whole).
    let anonymous = Sample::new("198.51.100.6", "/search", &[]);
    assert_eq!(
        envoy_descriptors(&rl, &anonymous),
        vec![pairs(&[("remote_address", "198.51.100.6")])]
    );

    // Headers come from Envoy, so rlsd must add none (sidecar.yaml runs it with --headers off).
    assert_eq!(
        rl.filter.enable_x_ratelimit_headers,
        rl_filter::rate_limit::XRateLimitHeadersRfcVersion::DraftVersion03 as i32
    );
    assert!(!rl.filter.failure_mode_deny, "envoy.yaml fails open");

    // The filter's cluster is rlsd's gRPC port on loopback, over HTTP/2.
    let rlsd_cluster = cluster_named(&y, &rlsd_target(&rl.filter).cluster_name);
    assert_http2(rlsd_cluster);
    let (host, port) = only_endpoint(rlsd_cluster);
    assert_eq!(
        port,
        i64::from(default_port("--grpc-addr")),
        "Envoy must call rlsd's default gRPC port"
    );
    assert!(
        host == "127.0.0.1" || host == "::1",
        "rlsd is a loopback sidecar"
    );

    // The admin interface is loopback only; the listener is 10000.
    assert_eq!(
        y.str("admin.address.socket_address.address"),
        Some("127.0.0.1")
    );
    assert_eq!(y.int("admin.address.socket_address.port_value"), Some(9901));
    let listeners = y.seq("static_resources.listeners");
    assert_eq!(
        listeners[0].int("address.socket_address.port_value"),
        Some(10000)
    );
}

#[test]
fn the_schema_and_the_model_refuse_what_they_cannot_read() {
    let read = |value: &Value| {
        std::panic::catch_unwind(|| {
            let filter: hcm::HttpFilter = envoy_message("test", value);
            rate_limit_filter("test", &filter)
        })
    };
    let good = serde_json::json!({
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": rl_filter::RateLimit::type_url(),
            "domain": "d",
            "timeout": "0.02s",
            "failure_mode_deny": false,
            "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
            "rate_limit_service": {
                "transport_api_version": "V3",
                "grpc_service": { "envoy_grpc": { "cluster_name": "rlsd" } },
            },
        },
    });
    let rate_limit = read(&good)
        .expect("well formed")
        .expect("a rate limit filter");
    let twenty_ms = wkt::Duration {
        seconds: 0,
        nanos: 20_000_000,
    };
    assert_eq!(rate_limit.timeout, Some(twenty_ms));
    let spoiled = |pointer: &str, value: Option<Value>| {
        let mut spoiled = good.clone();
        let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
        let parent = spoiled.pointer_mut(parent).and_then(Value::as_object_mut);
        let parent = parent.expect("an object of the filter");
        match value {
            Some(value) => parent.insert(key.to_owned(), value),
            None => parent.remove(key),
        };
        spoiled
    };
    let config = "/typed_config";
    for (pointer, value) in [
        // Envoy's schema: a misspelt field, a duration, an enum name, a type.
        (format!("{config}/domian"), Some("d".into())),
        (format!("{config}/timeout"), Some("20ms".into())),
        (
            format!("{config}/enable_x_ratelimit_headers"),
            Some("V3".into()),
        ),
        (
            format!("{config}/@type"),
            Some("type.googleapis.com/RateLimit".into()),
        ),
        // What these checks refuse, or do not model.
        (format!("{config}/failure_mode_deny"), None),
        (format!("{config}/stage"), Some(1.into())),
        ("/disabled".to_owned(), Some(true.into())),
        (
            format!("{config}/rate_limit_service/transport_api_version"),
            Some("V2".into()),
        ),
        (
            format!("{config}/rate_limit_service/grpc_service/envoy_grpc/skip_envoy_headers"),
            Some(true.into()),
        ),
    ] {
        let bad = spoiled(&pointer, value);
        assert!(read(&bad).is_err(), "accepted {pointer}: {bad}");
    }
}
