//! `deploy/envoy.yaml` and the Istio filters, decoded into mirror structs that reject unknown
//! fields, rebuilt as Envoy's own messages (`envoy-types`), and the descriptors Envoy would send
//! from them checked against `examples/three-layer.yaml`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use envoy_types::pb::envoy::config::bootstrap::v3 as bootstrap;
use envoy_types::pb::envoy::config::cluster::v3 as cluster;
use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::endpoint::v3 as endpoint;
use envoy_types::pb::envoy::config::listener::v3 as listener;
use envoy_types::pb::envoy::config::ratelimit::v3::RateLimitServiceConfig;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3 as rl_filter;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::envoy::extensions::upstreams::http::v3 as upstream_http;
use envoy_types::pb::envoy::r#type::matcher::v3 as matcher;
use envoy_types::pb::google::protobuf as wkt;
use prost::{Message, Name};
use serde::Deserialize;
use serde_json::Value;

use super::kubernetes::RlsdSettings;
use super::{EXAMPLE, decode, default_port, example_domain, limited_node, limited_paths, read};

// === Envoy: mirror structs =======================================================================
//
// The parts of Envoy's schema our files use, field for field. `deny_unknown_fields` means a
// field this test does not model (and so does not check) is an error, not a silent pass.

macro_rules! mirrors {
    ($($(#[$meta:meta])* struct $name:ident { $($(#[$field_meta:meta])* $field:ident: $ty:ty,)* })*) => {$(
        $(#[$meta])*
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(super) struct $name { $($(#[$field_meta])* pub(super) $field: $ty,)* }
    )*};
}

mirrors! {
    struct BootstrapY { admin: AdminY, static_resources: StaticResourcesY, }
    struct AdminY { address: AddressY, }
    struct AddressY { socket_address: SocketAddressY, }
    struct SocketAddressY { address: String, port_value: u32, }
    struct StaticResourcesY { listeners: Vec<ListenerY>, clusters: Vec<ClusterY>, }
    struct ListenerY { name: String, address: AddressY, filter_chains: Vec<FilterChainY>, }
    struct FilterChainY { filters: Vec<NetworkFilterY>, }
    struct NetworkFilterY { name: String, typed_config: HcmY, }
    struct HcmY {
        #[serde(rename = "@type")] type_url: String,
        stat_prefix: String,
        codec_type: Option<String>,
        use_remote_address: Option<bool>,
        route_config: RouteConfigY,
        http_filters: Vec<HttpFilterY>,
    }
    struct RouteConfigY { name: String, virtual_hosts: Vec<VirtualHostY>, }
    struct VirtualHostY {
        name: String,
        domains: Vec<String>,
        routes: Vec<RouteY>,
        #[serde(default)] rate_limits: Vec<RateLimitY>,
    }
    struct RouteY { #[serde(rename = "match")] route_match: RouteMatchY, route: RouteActionY, }
    struct RouteMatchY { prefix: String, }
    struct RouteActionY { cluster: String, #[serde(default)] rate_limits: Vec<RateLimitY>, }
    /// A route or virtual host `rate_limits` entry.
    struct RateLimitY { actions: Vec<ActionY>, }
    struct EmptyY {}
    struct RequestHeadersY { header_name: String, descriptor_key: String, }
    struct HeaderValueMatchY {
        #[serde(default)] descriptor_key: String,
        descriptor_value: String,
        headers: Vec<HeaderMatcherY>,
    }
    struct HeaderMatcherY { name: String, string_match: StringMatchY, }
    struct StringMatchY { prefix: String, }
    /// `typed_config` is decoded by `name`, into [`RateLimitFilterY`] or [`RouterY`].
    struct HttpFilterY { name: String, typed_config: Value, }
    struct RouterY { #[serde(rename = "@type")] type_url: String, }
    struct RateLimitFilterY {
        #[serde(rename = "@type")] type_url: String,
        domain: String,
        timeout: Option<String>,
        // Required: failing open or closed is a choice to write down, not a default.
        failure_mode_deny: bool,
        enable_x_ratelimit_headers: Option<String>,
        rate_limit_service: RateLimitServiceY,
    }
    struct RateLimitServiceY { transport_api_version: String, grpc_service: GrpcServiceY, }
    struct GrpcServiceY { envoy_grpc: EnvoyGrpcY, timeout: Option<String>, }
    struct EnvoyGrpcY { cluster_name: String, authority: Option<String>, }
    struct ClusterY {
        name: String,
        #[serde(rename = "type")] discovery: String,
        connect_timeout: String,
        #[serde(default)] typed_extension_protocol_options: BTreeMap<String, HttpProtocolOptionsY>,
        load_assignment: LoadAssignmentY,
    }
    struct HttpProtocolOptionsY {
        #[serde(rename = "@type")] type_url: String,
        explicit_http_config: ExplicitHttpConfigY,
    }
    struct ExplicitHttpConfigY { http2_protocol_options: EmptyY, }
    struct LoadAssignmentY { cluster_name: String, endpoints: Vec<LocalityEndpointsY>, }
    struct LocalityEndpointsY { lb_endpoints: Vec<LbEndpointY>, }
    struct LbEndpointY { endpoint: EndpointY, }
    struct EndpointY { address: AddressY, }
    /// The value of an Istio VIRTUAL_HOST MERGE patch.
    struct VirtualHostPatchY { rate_limits: Vec<RateLimitY>, }
}

/// `RateLimit.Action`, a oneof: a map with exactly one of these keys.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub(super) enum ActionY {
    RemoteAddress(EmptyY),
    RequestHeaders(RequestHeadersY),
    HeaderValueMatch(HeaderValueMatchY),
}

// === Envoy: the real messages ====================================================================

/// Packs a message as Envoy's `Any`, checking the `@type` written in the file is its type URL.
pub(super) fn any<M: Message + Name>(written: &str, message: &M) -> wkt::Any {
    assert_eq!(
        written,
        M::type_url(),
        "@type must be type.googleapis.com/{}",
        M::full_name()
    );
    wkt::Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

/// An Envoy enum written by its name.
pub(super) fn named<E>(field: &str, name: &str, from_str_name: fn(&str) -> Option<E>) -> E {
    from_str_name(name).unwrap_or_else(|| panic!("{field}: no `{name}`"))
}

/// An Envoy duration (`0.02s`): decimal seconds, at most nanosecond precision.
pub(super) fn duration(text: &str) -> wkt::Duration {
    let seconds = text
        .strip_suffix('s')
        .unwrap_or_else(|| panic!("duration `{text}` must end in `s`"));
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, ""));
    assert!(
        fraction.len() <= 9 && fraction.bytes().all(|b| b.is_ascii_digit()),
        "duration `{text}`"
    );
    let nanos = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse::<i32>().expect("digits")
    };
    wkt::Duration {
        seconds: whole
            .parse()
            .unwrap_or_else(|e| panic!("duration `{text}`: {e}")),
        nanos,
    }
}

pub(super) fn as_std(d: &wkt::Duration) -> Duration {
    Duration::new(
        u64::try_from(d.seconds).expect("non-negative"),
        u32::try_from(d.nanos).expect("non-negative"),
    )
}

pub(super) fn address(a: &AddressY) -> core::Address {
    core::Address {
        address: Some(core::address::Address::SocketAddress(core::SocketAddress {
            address: a.socket_address.address.clone(),
            port_specifier: Some(core::socket_address::PortSpecifier::PortValue(
                a.socket_address.port_value,
            )),
            ..Default::default()
        })),
    }
}

pub(super) fn rate_limit_entry(entry: &RateLimitY) -> route::RateLimit {
    use route::rate_limit::action::{self, ActionSpecifier};
    assert!(
        !entry.actions.is_empty(),
        "a rate_limits entry needs actions"
    );
    let specifier = |a: &ActionY| match a {
        ActionY::RemoteAddress(EmptyY {}) => {
            ActionSpecifier::RemoteAddress(action::RemoteAddress {})
        }
        ActionY::RequestHeaders(h) => {
            assert!(!h.header_name.is_empty() && !h.descriptor_key.is_empty());
            ActionSpecifier::RequestHeaders(action::RequestHeaders {
                header_name: h.header_name.clone(),
                descriptor_key: h.descriptor_key.clone(),
                skip_if_absent: false,
            })
        }
        ActionY::HeaderValueMatch(m) => {
            assert!(!m.headers.is_empty(), "header_value_match needs headers");
            ActionSpecifier::HeaderValueMatch(action::HeaderValueMatch {
                descriptor_key: m.descriptor_key.clone(),
                descriptor_value: m.descriptor_value.clone(),
                headers: m.headers.iter().map(header_matcher).collect(),
                ..Default::default()
            })
        }
    };
    route::RateLimit {
        actions: entry
            .actions
            .iter()
            .map(|a| route::rate_limit::Action {
                action_specifier: Some(specifier(a)),
            })
            .collect(),
        ..Default::default()
    }
}

pub(super) fn header_matcher(h: &HeaderMatcherY) -> route::HeaderMatcher {
    use matcher::string_matcher::MatchPattern;
    let prefix = matcher::StringMatcher {
        match_pattern: Some(MatchPattern::Prefix(h.string_match.prefix.clone())),
        ..Default::default()
    };
    route::HeaderMatcher {
        name: h.name.clone(),
        header_match_specifier: Some(route::header_matcher::HeaderMatchSpecifier::StringMatch(
            prefix,
        )),
        ..Default::default()
    }
}

/// An HTTP filter as Envoy's message, with the rate limit filter's config (`None` for the router).
pub(super) fn http_filter(f: &HttpFilterY) -> (hcm::HttpFilter, Option<rl_filter::RateLimit>) {
    let what = format!("HTTP filter {}", f.name);
    let (any, rate_limit) = match f.name.as_str() {
        "envoy.filters.http.ratelimit" => {
            let c: RateLimitFilterY = decode(&what, &f.typed_config);
            let message = rate_limit_filter(&c);
            (any(&c.type_url, &message), Some(message))
        }
        "envoy.filters.http.router" => {
            let c: RouterY = decode(&what, &f.typed_config);
            (any(&c.type_url, &Router::default()), None)
        }
        other => panic!("HTTP filter {other} is not modelled by tests/it/deploy/"),
    };
    let filter = hcm::HttpFilter {
        name: f.name.clone(),
        config_type: Some(hcm::http_filter::ConfigType::TypedConfig(any)),
        ..Default::default()
    };
    (filter, rate_limit)
}

pub(super) fn rate_limit_filter(c: &RateLimitFilterY) -> rl_filter::RateLimit {
    use core::grpc_service::{EnvoyGrpc, TargetSpecifier};
    let headers = c.enable_x_ratelimit_headers.as_deref().map_or(0, |name| {
        let from = rl_filter::rate_limit::XRateLimitHeadersRfcVersion::from_str_name;
        named("enable_x_ratelimit_headers", name, from) as i32
    });
    let service = &c.rate_limit_service;
    let api = named(
        "transport_api_version",
        &service.transport_api_version,
        core::ApiVersion::from_str_name,
    );
    assert_eq!(api, core::ApiVersion::V3, "rlsd speaks the v3 API only");
    let grpc = &service.grpc_service.envoy_grpc;
    let grpc_service = core::GrpcService {
        timeout: service.grpc_service.timeout.as_deref().map(duration),
        target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
            cluster_name: grpc.cluster_name.clone(),
            authority: grpc.authority.clone().unwrap_or_default(),
            ..Default::default()
        })),
        ..Default::default()
    };
    rl_filter::RateLimit {
        domain: c.domain.clone(),
        timeout: c.timeout.as_deref().map(duration),
        failure_mode_deny: c.failure_mode_deny,
        enable_x_ratelimit_headers: headers,
        rate_limit_service: Some(RateLimitServiceConfig {
            grpc_service: Some(grpc_service),
            transport_api_version: api as i32,
        }),
        ..Default::default()
    }
}

pub(super) fn cluster(c: &ClusterY) -> cluster::Cluster {
    use upstream_http::http_protocol_options::{ExplicitHttpConfig, UpstreamProtocolOptions};
    let discovery = cluster::cluster::DiscoveryType::from_str_name(&c.discovery)
        .unwrap_or_else(|| panic!("cluster {}: no discovery type `{}`", c.name, c.discovery));
    let mut options = HashMap::new();
    for (name, o) in &c.typed_extension_protocol_options {
        assert_eq!(
            *name,
            upstream_http::HttpProtocolOptions::full_name(),
            "cluster {}: the extension is named by its message",
            c.name
        );
        let EmptyY {} = o.explicit_http_config.http2_protocol_options;
        let http2 = upstream_http::http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(Default::default());
        let message = upstream_http::HttpProtocolOptions {
            upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(http2),
                },
            )),
            ..Default::default()
        };
        options.insert(name.clone(), any(&o.type_url, &message));
    }
    assert_eq!(c.load_assignment.cluster_name, c.name);
    let lb_endpoint = |e: &LbEndpointY| endpoint::LbEndpoint {
        host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
            endpoint::Endpoint {
                address: Some(address(&e.endpoint.address)),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let endpoints = c
        .load_assignment
        .endpoints
        .iter()
        .map(|l| endpoint::LocalityLbEndpoints {
            lb_endpoints: l.lb_endpoints.iter().map(lb_endpoint).collect(),
            ..Default::default()
        })
        .collect();
    cluster::Cluster {
        name: c.name.clone(),
        connect_timeout: Some(duration(&c.connect_timeout)),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            discovery as i32,
        )),
        typed_extension_protocol_options: options,
        load_assignment: Some(endpoint::ClusterLoadAssignment {
            cluster_name: c.load_assignment.cluster_name.clone(),
            endpoints,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Decodes an Envoy bootstrap file into the mirror and into Envoy's `Bootstrap`.
pub(super) fn envoy_bootstrap(relative: &str) -> (BootstrapY, bootstrap::Bootstrap) {
    envoy_bootstrap_text(relative, &read(relative))
}

pub(super) fn envoy_bootstrap_text(what: &str, text: &str) -> (BootstrapY, bootstrap::Bootstrap) {
    let y: BootstrapY = serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    let network_filter = |f: &NetworkFilterY| {
        assert_eq!(f.name, "envoy.filters.network.http_connection_manager");
        let manager = http_connection_manager(&f.typed_config);
        listener::Filter {
            name: f.name.clone(),
            config_type: Some(listener::filter::ConfigType::TypedConfig(any(
                &f.typed_config.type_url,
                &manager,
            ))),
        }
    };
    let listener = |l: &ListenerY| listener::Listener {
        name: l.name.clone(),
        address: Some(address(&l.address)),
        filter_chains: l
            .filter_chains
            .iter()
            .map(|chain| listener::FilterChain {
                filters: chain.filters.iter().map(network_filter).collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let built = bootstrap::Bootstrap {
        admin: Some(bootstrap::Admin {
            address: Some(address(&y.admin.address)),
            ..Default::default()
        }),
        static_resources: Some(bootstrap::bootstrap::StaticResources {
            listeners: y.static_resources.listeners.iter().map(listener).collect(),
            clusters: y.static_resources.clusters.iter().map(cluster).collect(),
            ..Default::default()
        }),
        ..Default::default()
    };
    (y, built)
}

pub(super) fn http_connection_manager(m: &HcmY) -> hcm::HttpConnectionManager {
    use hcm::http_connection_manager::{CodecType, RouteSpecifier};
    let codec = m.codec_type.as_deref().map_or(0, |name| {
        named("codec_type", name, CodecType::from_str_name) as i32
    });
    assert_eq!(
        m.http_filters.last().map(|f| f.name.as_str()),
        Some("envoy.filters.http.router"),
        "the router must be the last HTTP filter"
    );
    let route = |r: &RouteY| route::Route {
        r#match: Some(route::RouteMatch {
            path_specifier: Some(route::route_match::PathSpecifier::Prefix(
                r.route_match.prefix.clone(),
            )),
            ..Default::default()
        }),
        action: Some(route::route::Action::Route(route::RouteAction {
            cluster_specifier: Some(route::route_action::ClusterSpecifier::Cluster(
                r.route.cluster.clone(),
            )),
            rate_limits: r.route.rate_limits.iter().map(rate_limit_entry).collect(),
            ..Default::default()
        })),
        ..Default::default()
    };
    let virtual_host = |v: &VirtualHostY| route::VirtualHost {
        name: v.name.clone(),
        domains: v.domains.clone(),
        rate_limits: v.rate_limits.iter().map(rate_limit_entry).collect(),
        routes: v.routes.iter().map(route).collect(),
        ..Default::default()
    };
    hcm::HttpConnectionManager {
        stat_prefix: m.stat_prefix.clone(),
        codec_type: codec,
        use_remote_address: m.use_remote_address.map(|value| wkt::BoolValue { value }),
        http_filters: m.http_filters.iter().map(|f| http_filter(f).0).collect(),
        route_specifier: Some(RouteSpecifier::RouteConfig(route::RouteConfiguration {
            name: m.route_config.name.clone(),
            virtual_hosts: m
                .route_config
                .virtual_hosts
                .iter()
                .map(virtual_host)
                .collect(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// What the Envoy config says about rate limiting, from the real messages.
pub(super) struct EnvoyRateLimiting {
    pub(super) filter: rl_filter::RateLimit,
    /// The `rate_limits` of the (single) virtual host or route that carries them.
    pub(super) entries: Vec<route::RateLimit>,
    pub(super) use_remote_address: bool,
}

/// Unpacks what matters for rate limiting from a built bootstrap, through the encoded `Any`s.
pub(super) fn rate_limiting(built: &bootstrap::Bootstrap) -> EnvoyRateLimiting {
    use hcm::http_connection_manager::RouteSpecifier;
    let resources = built.static_resources.as_ref().expect("static_resources");
    let mut found = Vec::new();
    for f in resources
        .listeners
        .iter()
        .flat_map(|l| &l.filter_chains)
        .flat_map(|chain| &chain.filters)
    {
        let Some(listener::filter::ConfigType::TypedConfig(any)) = &f.config_type else {
            panic!("filter {} without typed_config", f.name);
        };
        let manager = hcm::HttpConnectionManager::decode(any.value.as_slice())
            .expect("an HttpConnectionManager");
        let filter = manager
            .http_filters
            .iter()
            .find(|f| f.name == "envoy.filters.http.ratelimit")
            .and_then(|f| match &f.config_type {
                Some(hcm::http_filter::ConfigType::TypedConfig(any)) => {
                    Some(rl_filter::RateLimit::decode(any.value.as_slice()).expect("RateLimit"))
                }
                _ => None,
            })
            .expect("the rate limit filter");
        let Some(RouteSpecifier::RouteConfig(routes)) = &manager.route_specifier else {
            panic!("an inline route_config");
        };
        let mut carriers: Vec<&Vec<route::RateLimit>> = Vec::new();
        for v in &routes.virtual_hosts {
            carriers.push(&v.rate_limits);
            for r in &v.routes {
                if let Some(route::route::Action::Route(action)) = &r.action {
                    carriers.push(&action.rate_limits);
                }
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

pub(super) fn cluster_named<'b>(
    built: &'b bootstrap::Bootstrap,
    name: &str,
) -> &'b cluster::Cluster {
    let resources = built.static_resources.as_ref().expect("resources");
    resources
        .clusters
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no cluster {name}"))
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
    assert!(!s.ignore_case && !m.invert_match, "{m:?} is not modelled");
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
    let pair = |key: &str, value: &str| Some((key.to_owned(), value.to_owned()));
    entry
        .actions
        .iter()
        .map(
            |action| match action.action_specifier.as_ref().expect("an action") {
                ActionSpecifier::RemoteAddress(_) => pair("remote_address", request.client),
                ActionSpecifier::RequestHeaders(h) => {
                    pair(&h.descriptor_key, request.header(&h.header_name)?)
                }
                ActionSpecifier::HeaderValueMatch(m) => {
                    let all = m.headers.iter().all(|h| header_matches(h, request));
                    if all != m.expect_match.as_ref().is_none_or(|b| b.value) {
                        return None;
                    }
                    let key = if m.descriptor_key.is_empty() {
                        "header_match"
                    } else {
                        &m.descriptor_key
                    };
                    pair(key, &m.descriptor_value)
                }
                other => panic!("action {other:?} is not modelled by tests/it/deploy/"),
            },
        )
        .collect()
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
            if let Some(descriptor) = descriptor(entry, &Sample::new("203.0.113.7", path, &headers))
            {
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
    let (y, built) = envoy_bootstrap("deploy/envoy.yaml");
    let rl = rate_limiting(&built);
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
    let rlsd_cluster = cluster_named(&built, &rlsd_target(&rl.filter).cluster_name);
    assert_http2(rlsd_cluster);
    let (host, port) = only_endpoint(rlsd_cluster);
    assert_eq!(
        port,
        u32::from(default_port("--grpc-addr")),
        "Envoy must call rlsd's default gRPC port"
    );
    assert!(
        host == "127.0.0.1" || host == "::1",
        "rlsd is a loopback sidecar"
    );

    // The admin interface is loopback only; the listener is 10000.
    assert_eq!(y.admin.address.socket_address.address, "127.0.0.1");
    assert_eq!(y.admin.address.socket_address.port_value, 9901);
    let listeners = &y.static_resources.listeners;
    assert_eq!(listeners[0].address.socket_address.port_value, 10000);
    let routes = listeners
        .iter()
        .flat_map(|l| &l.filter_chains)
        .flat_map(|chain| &chain.filters)
        .flat_map(|f| &f.typed_config.route_config.virtual_hosts)
        .flat_map(|v| &v.routes);
    for r in routes {
        cluster_named(&built, &r.route.cluster);
    }
}

pub(super) fn assert_http2(c: &cluster::Cluster) {
    use upstream_http::http_protocol_options::UpstreamProtocolOptions;
    use upstream_http::http_protocol_options::explicit_http_config::ProtocolConfig;
    let any = c
        .typed_extension_protocol_options
        .get(&upstream_http::HttpProtocolOptions::full_name())
        .unwrap_or_else(|| panic!("cluster {}: no HttpProtocolOptions, so HTTP/1.1", c.name));
    assert_eq!(any.type_url, upstream_http::HttpProtocolOptions::type_url());
    let options = upstream_http::HttpProtocolOptions::decode(any.value.as_slice()).expect("decode");
    let Some(UpstreamProtocolOptions::ExplicitHttpConfig(explicit)) =
        options.upstream_protocol_options
    else {
        panic!("cluster {}: explicit_http_config", c.name);
    };
    assert!(
        matches!(
            explicit.protocol_config,
            Some(ProtocolConfig::Http2ProtocolOptions(_))
        ),
        "cluster {}: gRPC needs http2_protocol_options",
        c.name
    );
}

pub(super) fn only_endpoint(c: &cluster::Cluster) -> (String, u32) {
    let assignment = c.load_assignment.as_ref().expect("load_assignment");
    let endpoints: Vec<&endpoint::LbEndpoint> = assignment
        .endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .collect();
    assert_eq!(endpoints.len(), 1, "cluster {}: one endpoint", c.name);
    let Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(e)) = &endpoints[0].host_identifier
    else {
        panic!("an endpoint");
    };
    let Some(core::address::Address::SocketAddress(socket)) =
        e.address.as_ref().and_then(|a| a.address.as_ref())
    else {
        panic!("a socket address");
    };
    let Some(core::socket_address::PortSpecifier::PortValue(port)) = socket.port_specifier else {
        panic!("a port");
    };
    (socket.address.clone(), port)
}

#[test]
fn durations_read_as_envoy_writes_them() {
    let (seconds, nanos) = (0, 20_000_000);
    assert_eq!(duration("0.02s"), wkt::Duration { seconds, nanos });
    let (seconds, nanos) = (10, 0);
    assert_eq!(duration("10s"), wkt::Duration { seconds, nanos });
}
