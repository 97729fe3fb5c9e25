//! The deployment files in `deploy/` agree with the binary, with the example config and with
//! each other.
//!
//! - Every file under `deploy/` must be of a kind this test knows ([`Kind`]): a new file cannot
//!   land unchecked.
//! - `deploy/envoy.yaml` and the Istio filters are decoded into mirror structs that reject
//!   unknown fields, rebuilt as Envoy's own protobuf messages (`envoy-types`) whose type URLs
//!   must be the `@type`s written, and encoded. The descriptors Envoy would send are computed
//!   from those messages and must land on limits of `examples/three-layer.yaml`.
//! - The Kubernetes manifests are checked against `rlsd serve`'s clap command: flags, `RLSD_*`
//!   variables, default ports, probes, the config mount and what it holds.
//! - Every metric the Grafana dashboard queries must be in the exposition of a real rlsd
//!   process, and every gRPC health service a probe names must answer SERVING there.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
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
use rlsd::config::{Domain, Level, Node};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::common::process::Rlsd;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const EXAMPLE: &str = "examples/three-layer.yaml";

fn path(relative: &str) -> PathBuf {
    Path::new(ROOT).join(relative)
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(path(relative)).unwrap_or_else(|e| panic!("reading {relative}: {e}"))
}

fn is_yaml(file: &str) -> bool {
    file.ends_with(".yaml") || file.ends_with(".yml")
}

// === The files ===================================================================================

/// What a file under `deploy/` is, decided by its name and, for YAML, its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Readme,
    Dockerfile,
    EnvoyBootstrap,
    PrometheusConfig,
    Kubernetes,
    GrafanaDashboard,
}

/// Every file under `deploy/`, relative to the crate root, sorted.
fn deploy_files() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let entry = entry.expect("directory entry");
            if entry.file_type().expect("file type").is_dir() {
                walk(&entry.path(), out);
            } else {
                let relative = entry
                    .path()
                    .strip_prefix(ROOT)
                    .expect("under the crate")
                    .to_owned();
                out.push(relative.to_string_lossy().into_owned());
            }
        }
    }
    let mut files = Vec::new();
    walk(&path("deploy"), &mut files);
    files.sort();
    files
}

fn kind_of(relative: &str) -> Kind {
    let name = Path::new(relative)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    match name {
        "README.md" => Kind::Readme,
        "Dockerfile" => Kind::Dockerfile,
        _ if name.ends_with(".json") && relative.starts_with("deploy/grafana/") => {
            Kind::GrafanaDashboard
        }
        _ if is_yaml(name) => {
            let docs = yaml_documents(relative);
            let has = |key: &str| docs.iter().all(|d| d.get(key).is_some());
            if has("static_resources") {
                Kind::EnvoyBootstrap
            } else if has("scrape_configs") {
                Kind::PrometheusConfig
            } else if has("apiVersion") && has("kind") {
                Kind::Kubernetes
            } else {
                panic!(
                    "{relative}: YAML that is neither an Envoy bootstrap, a Prometheus config nor Kubernetes objects; teach tests/it/deploy.rs about it"
                )
            }
        }
        _ => panic!("{relative}: unknown kind of file; teach tests/it/deploy.rs to check it"),
    }
}

#[test]
fn every_file_in_deploy_is_of_a_known_kind_and_valid() {
    let files = deploy_files();
    assert!(!files.is_empty(), "deploy/ is empty");
    let readme = read("deploy/README.md");
    for file in &files {
        let kind = kind_of(file);
        match kind {
            Kind::Readme => assert!(readme.len() > 200, "{file} says next to nothing"),
            Kind::Dockerfile => check_dockerfile(file),
            Kind::EnvoyBootstrap => {
                let (_, built) = envoy_bootstrap(file);
                // The rebuilt bootstrap survives the wire: every field is a real Envoy field.
                let bytes = built.encode_to_vec();
                let decoded = bootstrap::Bootstrap::decode(bytes.as_slice()).expect("decodes");
                assert_eq!(decoded, built, "{file}: bootstrap round trip");
            }
            Kind::PrometheusConfig => check_prometheus_config(file),
            Kind::Kubernetes => check_kubernetes_file(file),
            Kind::GrafanaDashboard => check_dashboard_shape(file, &dashboard(file)),
        }
        let short = file.strip_prefix("deploy/").expect("under deploy/");
        if kind != Kind::Readme {
            assert!(
                readme.contains(short),
                "deploy/README.md does not mention {short}"
            );
        }
    }
}

#[test]
fn yaml_has_no_bare_yes_no_on_off() {
    // Kubernetes (YAML 1.1 rules) and Envoy (yaml-cpp) read a bare `off`, `on`, `yes` or `no`
    // as a boolean: `--headers off` would reach rlsd as `false`. They must be quoted.
    for file in deploy_files().into_iter().filter(|f| is_yaml(f)) {
        for (n, line) in read(&file).lines().enumerate() {
            let code = line.split(" #").next().unwrap_or_default().trim();
            if code.starts_with('#') {
                continue;
            }
            // The scalar in value position: after `- ` and after the last `: `.
            let mut value = code;
            while let Some(rest) = value.strip_prefix("- ") {
                value = rest.trim_start();
            }
            if let Some((_, after)) = value.rsplit_once(": ") {
                value = after.trim();
            }
            for item in value.trim_matches(['[', ']', '{', '}']).split(',') {
                let item = item.trim();
                assert!(
                    !["on", "off", "yes", "no", "y", "n"]
                        .iter()
                        .any(|b| item.eq_ignore_ascii_case(b)),
                    "{file}:{}: quote `{item}`: YAML 1.1 reads it as a boolean",
                    n + 1
                );
            }
        }
    }
}

// === Parsed YAML and JSON ========================================================================

/// Dotted-path access into a parsed document (keys with dots need `Value::get`).
trait Tree {
    fn find(&self, path: &str) -> Option<&Value>;
    /// A string, or a number or boolean written as one (a port, a count).
    fn text(&self) -> Option<String>;

    /// Null when absent.
    fn at(&self, path: &str) -> &Value {
        self.find(path).unwrap_or(&Value::Null)
    }
    fn str(&self, path: &str) -> Option<&str> {
        self.at(path).as_str()
    }
    fn int(&self, path: &str) -> Option<i64> {
        self.at(path).as_i64()
    }
    fn is(&self, path: &str, value: bool) -> bool {
        self.at(path).as_bool() == Some(value)
    }
    /// Empty when absent.
    fn seq(&self, path: &str) -> &[Value] {
        self.at(path).as_array().map_or(&[], Vec::as_slice)
    }
    fn texts(&self, path: &str) -> Vec<String> {
        self.seq(path).iter().filter_map(Value::text).collect()
    }
}

impl Tree for Value {
    fn find(&self, path: &str) -> Option<&Value> {
        path.split('.').try_fold(self, |v, key| v.get(key))
    }

    fn text(&self) -> Option<String> {
        match self {
            Value::String(s) => Some(s.clone()),
            Value::Number(_) | Value::Bool(_) => Some(self.to_string()),
            _ => None,
        }
    }
}

/// Decodes a subtree into a typed mirror, which rejects unknown fields.
fn decode<T: DeserializeOwned>(what: &str, value: &Value) -> T {
    T::deserialize(value).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Every document of a YAML file; serde-saphyr refuses duplicate keys.
fn yaml_documents(relative: &str) -> Vec<Value> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&read(relative)).unwrap_or_else(|e| panic!("{relative}: {e}"));
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    assert!(!docs.is_empty(), "{relative}: no YAML document");
    docs
}

/// Strict JSON without duplicate keys: serde_json alone would keep the last one silently, so
/// serde-saphyr (JSON is YAML) checks for them first.
fn parse_json(text: &str) -> Result<Value, String> {
    serde_saphyr::from_str::<serde::de::IgnoredAny>(text).map_err(|e| e.to_string())?;
    serde_json::from_str(text).map_err(|e| e.to_string())
}

#[test]
fn json_with_duplicate_keys_is_refused() {
    assert!(parse_json(r#"{"a": {"b": [1, 2.5]}, "c": "x\u00e9"}"#).is_ok());
    assert!(parse_json(r#"{"a": {"b": 1, "b": 2}}"#).is_err());
    assert!(parse_json(r#"{"a": 1,}"#).is_err());
}

// === rlsd itself =================================================================================

/// A flag of `rlsd serve`, as its clap command defines it.
#[derive(Debug, Clone)]
struct Flag {
    takes_value: bool,
    env: Option<String>,
    default: Option<String>,
    /// Empty when any value goes.
    possible: Vec<String>,
}

/// `rlsd serve`'s flags by long name (`--config`), read from the clap command itself.
fn serve_flags() -> &'static BTreeMap<String, Flag> {
    static FLAGS: OnceLock<BTreeMap<String, Flag>> = OnceLock::new();
    FLAGS.get_or_init(|| {
        let command = <rlsd::cli::Cli as clap::CommandFactory>::command();
        let serve = command
            .find_subcommand("serve")
            .expect("a serve subcommand");
        // The global flags (`--log-level`) are defined on the top command.
        command
            .get_arguments()
            .chain(serve.get_arguments())
            .filter_map(|arg| {
                let flag = Flag {
                    takes_value: arg.get_action().takes_values(),
                    env: arg.get_env().map(|env| env.to_string_lossy().into_owned()),
                    default: arg
                        .get_default_values()
                        .first()
                        .map(|value| value.to_string_lossy().into_owned()),
                    possible: arg
                        .get_possible_values()
                        .iter()
                        .map(|value| value.get_name().to_owned())
                        .collect(),
                };
                Some((format!("--{}", arg.get_long()?), flag))
            })
            .collect()
    })
}

fn flag(name: &str) -> &'static Flag {
    serve_flags()
        .get(name)
        .unwrap_or_else(|| panic!("`rlsd serve` has no {name}"))
}

fn flag_for_env(env: &str) -> Option<(&'static String, &'static Flag)> {
    serve_flags()
        .iter()
        .find(|(_, f)| f.env.as_deref() == Some(env))
}

fn port_of(addr: &str) -> u16 {
    addr.parse::<SocketAddr>()
        .unwrap_or_else(|e| panic!("{addr}: {e}"))
        .port()
}

fn default_port(flag_name: &str) -> u16 {
    let default = flag(flag_name).default.as_deref();
    port_of(default.unwrap_or_else(|| panic!("{flag_name} has no default")))
}

#[test]
fn the_flags_are_read_from_rlsd() {
    assert_eq!(default_port("--grpc-addr"), 8081);
    assert_eq!(default_port("--http-addr"), 8080);
    assert_eq!(flag("--config").env.as_deref(), Some("RLSD_CONFIG"));
    assert!(flag("--headers").possible.iter().any(|v| v == "off"));
    assert!(flag("--config").takes_value);
}

/// A config, loaded as rlsd loads it.
fn load_config(what: &str, file_name: &str, text: &str) -> Domain {
    rlsd::config::load_str(file_name, text).unwrap_or_else(|errors| {
        let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
        panic!("{what} does not load: {}", errors.join("; "))
    })
}

fn example_domain() -> Domain {
    load_config(EXAMPLE, EXAMPLE, &read(EXAMPLE))
}

/// Every node of a domain's tree that carries a limit, by path.
fn limited_paths(level: &Level, out: &mut BTreeSet<String>) {
    for nodes in level.keys.values() {
        let children = nodes
            .exact
            .values()
            .chain(nodes.wildcards.iter().map(|(_, node)| node))
            .chain(nodes.default.as_deref());
        for node in children {
            if node.policy.is_some() {
                out.insert(node.path.clone());
            }
            limited_paths(&node.children, out);
        }
    }
}

fn limited_node<'c>(domain: &'c Domain, entries: &[(String, String)]) -> &'c Node {
    let node = rlsd::engine::matcher::find(&domain.root, entries)
        .unwrap_or_else(|| panic!("{entries:?} matches nothing in {EXAMPLE}"));
    assert!(
        node.policy.is_some(),
        "{entries:?} lands on {}, which has no limit (a whitelist)",
        node.path
    );
    node
}

// === Envoy: mirror structs =======================================================================
//
// The parts of Envoy's schema our files use, field for field. `deny_unknown_fields` means a
// field this test does not model (and so does not check) is an error, not a silent pass.

macro_rules! mirrors {
    ($($(#[$meta:meta])* struct $name:ident { $($(#[$field_meta:meta])* $field:ident: $ty:ty,)* })*) => {$(
        $(#[$meta])*
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name { $($(#[$field_meta])* $field: $ty,)* }
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
enum ActionY {
    RemoteAddress(EmptyY),
    RequestHeaders(RequestHeadersY),
    HeaderValueMatch(HeaderValueMatchY),
}

// === Envoy: the real messages ====================================================================

/// Packs a message as Envoy's `Any`, checking the `@type` written in the file is its type URL.
fn any<M: Message + Name>(written: &str, message: &M) -> wkt::Any {
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
fn named<E>(field: &str, name: &str, from_str_name: fn(&str) -> Option<E>) -> E {
    from_str_name(name).unwrap_or_else(|| panic!("{field}: no `{name}`"))
}

/// An Envoy duration (`0.02s`): decimal seconds, at most nanosecond precision.
fn duration(text: &str) -> wkt::Duration {
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

fn as_std(d: &wkt::Duration) -> Duration {
    Duration::new(
        u64::try_from(d.seconds).expect("non-negative"),
        u32::try_from(d.nanos).expect("non-negative"),
    )
}

fn address(a: &AddressY) -> core::Address {
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

fn rate_limit_entry(entry: &RateLimitY) -> route::RateLimit {
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

fn header_matcher(h: &HeaderMatcherY) -> route::HeaderMatcher {
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
fn http_filter(f: &HttpFilterY) -> (hcm::HttpFilter, Option<rl_filter::RateLimit>) {
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
        other => panic!("HTTP filter {other} is not modelled by tests/it/deploy.rs"),
    };
    let filter = hcm::HttpFilter {
        name: f.name.clone(),
        config_type: Some(hcm::http_filter::ConfigType::TypedConfig(any)),
        ..Default::default()
    };
    (filter, rate_limit)
}

fn rate_limit_filter(c: &RateLimitFilterY) -> rl_filter::RateLimit {
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

fn cluster(c: &ClusterY) -> cluster::Cluster {
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
fn envoy_bootstrap(relative: &str) -> (BootstrapY, bootstrap::Bootstrap) {
    envoy_bootstrap_text(relative, &read(relative))
}

fn envoy_bootstrap_text(what: &str, text: &str) -> (BootstrapY, bootstrap::Bootstrap) {
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

fn http_connection_manager(m: &HcmY) -> hcm::HttpConnectionManager {
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
struct EnvoyRateLimiting {
    filter: rl_filter::RateLimit,
    /// The `rate_limits` of the (single) virtual host or route that carries them.
    entries: Vec<route::RateLimit>,
    use_remote_address: bool,
}

/// Unpacks what matters for rate limiting from a built bootstrap, through the encoded `Any`s.
fn rate_limiting(built: &bootstrap::Bootstrap) -> EnvoyRateLimiting {
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
fn rlsd_target(filter: &rl_filter::RateLimit) -> &core::grpc_service::EnvoyGrpc {
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

fn cluster_named<'b>(built: &'b bootstrap::Bootstrap, name: &str) -> &'b cluster::Cluster {
    let resources = built.static_resources.as_ref().expect("resources");
    resources
        .clusters
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no cluster {name}"))
}

/// Envoy's rate limit headers, or rlsd's `--headers`: exactly one side adds them.
fn assert_headers_from_one_side(what: &str, filter: &rl_filter::RateLimit, rlsd: &RlsdSettings) {
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
struct Sample<'a> {
    client: &'a str,
    path: &'a str,
    headers: &'a [(&'a str, &'a str)],
}

impl<'a> Sample<'a> {
    fn new(client: &'a str, path: &'a str, headers: &'a [(&'a str, &'a str)]) -> Sample<'a> {
        Sample {
            client,
            path,
            headers,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        if name == ":path" {
            return Some(self.path);
        }
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    }
}

fn header_matches(m: &route::HeaderMatcher, request: &Sample<'_>) -> bool {
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
fn descriptor(entry: &route::RateLimit, request: &Sample<'_>) -> Option<Vec<(String, String)>> {
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
                other => panic!("action {other:?} is not modelled by tests/it/deploy.rs"),
            },
        )
        .collect()
}

/// The descriptors of one request: one per entry that produces one.
fn envoy_descriptors(rl: &EnvoyRateLimiting, request: &Sample<'_>) -> Vec<Vec<(String, String)>> {
    rl.entries
        .iter()
        .filter_map(|entry| descriptor(entry, request))
        .collect()
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Requests covering every path and plan the example distinguishes.
const PATHS: [&str; 3] = ["/search?q=rust", "/export/all.csv", "/"];
const PLANS: [&str; 2] = ["free", "pro"];

/// Checks an Envoy rate limit setup against the example config: domain, timeout, and that every
/// descriptor it produces lands on a limit, and every limit of the example is reached.
fn check_against_example(what: &str, rl: &EnvoyRateLimiting) {
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

fn assert_http2(c: &cluster::Cluster) {
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

fn only_endpoint(c: &cluster::Cluster) -> (String, u32) {
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

// === Kubernetes ==================================================================================

/// The (apiVersion, kind) pairs the manifests may use.
const KNOWN_KINDS: &[(&str, &str)] = &[
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("policy/v1", "PodDisruptionBudget"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
];

fn kind(doc: &Value) -> (&str, &str) {
    let api = doc.str("apiVersion").unwrap_or_default();
    (api, doc.str("kind").unwrap_or_default())
}

fn name(doc: &Value) -> &str {
    doc.str("metadata.name").expect("metadata.name")
}

fn namespace(doc: &Value) -> &str {
    doc.str("metadata.namespace").unwrap_or("default")
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    let entries = v.as_object().into_iter().flatten();
    entries
        .map(|(k, v)| (k.clone(), v.text().unwrap_or_default()))
        .collect()
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The object of `docs` of kind `k` named `n`.
fn object<'d>(docs: &'d [Value], k: &str, n: &str) -> Option<&'d Value> {
    docs.iter().find(|d| kind(d).1 == k && name(d) == n)
}

/// The Deployment of `docs` whose pods `selector` selects.
fn selected_deployment<'d>(what: &str, docs: &'d [Value], selector: &Value) -> &'d Value {
    let selector = labels(selector);
    docs.iter()
        .filter(|d| kind(d).1 == "Deployment")
        .find(|d| selects(&selector, &labels(d.at("spec.template.metadata.labels"))))
        .unwrap_or_else(|| panic!("{what}: selects no Deployment of the file"))
}

/// The item of a list (volumes, ports, env) whose `name` is `n`.
fn named_item<'v>(list: &'v [Value], n: &str) -> Option<&'v Value> {
    item_where(list, "name", n)
}

fn item_where<'v>(list: &'v [Value], key: &str, value: &str) -> Option<&'v Value> {
    list.iter().find(|v| v.str(key) == Some(value))
}

/// The volume of `pod` that container `c` mounts at `dir`.
fn mounted_volume<'p>(what: &str, pod: &'p Value, c: &Value, dir: &str) -> &'p Value {
    let mount = item_where(c.seq("volumeMounts"), "mountPath", dir)
        .unwrap_or_else(|| panic!("{what}: nothing is mounted at {dir}"));
    named_item(pod.seq("volumes"), mount.str("name").expect("name")).expect("volume")
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Bytes in a Kubernetes memory quantity (`64Mi`, `1Gi`, `500M`).
fn bytes(quantity: &str) -> u64 {
    let units = [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("K", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ];
    for (suffix, scale) in units {
        if let Some(n) = quantity.strip_suffix(suffix) {
            return n.parse::<u64>().expect("a number") * scale;
        }
    }
    quantity.parse().expect("a memory quantity")
}

fn containers(deployment: &Value) -> &[Value] {
    deployment.seq("spec.template.spec.containers")
}

fn is_rlsd(container: &Value) -> bool {
    let image = container.str("image").unwrap_or_default();
    let repository = image.rsplit('/').next().unwrap_or_default();
    repository == "rlsd" || repository.starts_with("rlsd:") || repository.starts_with("rlsd@")
}

/// The container port a probe or Service names (by number or by name).
fn resolve_port(container_ports: &[Value], port: &Value) -> Option<i64> {
    match port {
        Value::String(port_name) => named_item(container_ports, port_name)?.int("containerPort"),
        _ => container_ports
            .iter()
            .filter_map(|p| p.int("containerPort"))
            .find(|p| Some(*p) == port.as_i64()),
    }
}

/// A Service port's `targetPort`, which defaults to its `port`.
fn target_port(service_port: &Value) -> &Value {
    service_port
        .get("targetPort")
        .unwrap_or(service_port.at("port"))
}

/// The image's defaults, from deploy/Dockerfile's ENV lines.
fn image_env() -> BTreeMap<String, String> {
    dockerfile_final_stage()
        .iter()
        .filter(|(op, _)| op == "ENV")
        .filter_map(|(_, rest)| {
            let (k, v) = rest.split_once(['=', ' '])?;
            Some((k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
        })
        .collect()
}

/// How one rlsd container is configured: flags after `rlsd serve`, then env, then the image's
/// ENV, then the binary's defaults; every name and value checked against `rlsd serve`'s flags.
struct RlsdSettings {
    values: BTreeMap<String, String>,
}

impl RlsdSettings {
    fn of(container: &Value, what: &str) -> RlsdSettings {
        let mut values = BTreeMap::new();
        for (name, f) in serve_flags() {
            if let Some(default) = &f.default {
                values.insert(name.clone(), default.clone());
            }
        }
        let check_value = |flag_name: &str, value: &str| {
            let f = flag(flag_name);
            assert!(
                f.possible.is_empty() || f.possible.iter().any(|p| p == value),
                "{what}: {flag_name} {value}: not one of {:?}",
                f.possible
            );
        };
        let apply_env = |values: &mut BTreeMap<String, String>, env: &str, value: &str| {
            let Some((flag_name, _)) = flag_for_env(env) else {
                panic!("{what}: {env} is not a variable of an `rlsd serve` flag");
            };
            check_value(flag_name, value);
            values.insert(flag_name.clone(), value.to_owned());
        };
        for (env, value) in image_env() {
            if env.starts_with("RLSD_") {
                apply_env(&mut values, &env, &value);
            }
        }
        for e in container.seq("env") {
            let env = e.str("name").expect("env name");
            if env.starts_with("RLSD_") {
                let value = e
                    .str("value")
                    .unwrap_or_else(|| panic!("{what}: {env} must be a string (quote numbers)"));
                apply_env(&mut values, env, value);
            }
        }
        // `command`, when set, must run `rlsd serve`; otherwise the image's entrypoint does.
        let mut args: Vec<String> = Vec::new();
        if container.get("command").is_some() {
            let command = container.texts("command");
            assert!(
                command.first().is_some_and(|c| c.ends_with("rlsd"))
                    && command.get(1).map(String::as_str) == Some("serve"),
                "{what}: command must be `rlsd serve ...`, is {command:?}"
            );
            args.extend(command.into_iter().skip(2));
        } else {
            assert_eq!(
                dockerfile_entrypoint().get(1).map(String::as_str),
                Some("serve"),
                "the image's entrypoint runs `rlsd serve`, so args are serve flags"
            );
        }
        for a in container.seq("args") {
            let arg = a.as_str();
            args.push(
                arg.unwrap_or_else(|| panic!("{what}: arg {a:?} must be a string (quote it)"))
                    .to_owned(),
            );
        }
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let (flag_name, inline) = match arg.split_once('=') {
                Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
                None => (arg.clone(), None),
            };
            assert!(
                flag_name.starts_with("--"),
                "{what}: `{arg}` is not a flag; `rlsd serve` takes no positional arguments"
            );
            let f = serve_flags()
                .get(&flag_name)
                .unwrap_or_else(|| panic!("{what}: {flag_name} is not an `rlsd serve` flag"));
            let value = if f.takes_value {
                inline
                    .or_else(|| args.next())
                    .unwrap_or_else(|| panic!("{what}: {flag_name} needs a value"))
            } else {
                assert!(inline.is_none(), "{what}: {flag_name} takes no value");
                "true".to_owned()
            };
            check_value(&flag_name, &value);
            values.insert(flag_name, value);
        }
        RlsdSettings { values }
    }

    fn get(&self, flag_name: &str) -> Option<&str> {
        self.values.get(flag_name).map(String::as_str)
    }

    fn port(&self, flag_name: &str) -> i64 {
        let addr = self.get(flag_name);
        i64::from(port_of(addr.unwrap_or_else(|| panic!("no {flag_name}"))))
    }
}

/// Checks one manifest file: every object is known and well formed on its own and against
/// the other objects of the same file; rlsd containers against the binary.
fn check_kubernetes_file(file: &str) {
    let docs = yaml_documents(file);
    for doc in &docs {
        let (api, k) = kind(doc);
        assert!(
            KNOWN_KINDS.contains(&(api, k)),
            "{file}: unknown apiVersion/kind {api}/{k}"
        );
        let n = name(doc);
        let what = format!("{file}: {k} {n}");
        assert!(
            n.len() <= 253 && n.split('.').all(is_dns_label),
            "{what}: not a DNS subdomain name"
        );
        match k {
            "Deployment" => check_deployment(&what, doc, &docs),
            "Service" => check_service(&what, doc, &docs),
            "ConfigMap" => {
                let data = doc.get("data").expect("ConfigMap data").as_object();
                let data = data.filter(|d| !d.is_empty());
                for (key, value) in data.unwrap_or_else(|| panic!("{what}: empty")) {
                    assert!(value.is_string(), "{what}: {key} is not a string");
                }
            }
            "PodDisruptionBudget" => {
                let target = selected_deployment(&what, &docs, doc.at("spec.selector.matchLabels"));
                let replicas = target.int("spec.replicas").unwrap_or(1);
                let max = doc.int("spec.maxUnavailable");
                let min = doc.int("spec.minAvailable");
                assert!(
                    max.is_some() != min.is_some(),
                    "{what}: one of max/minAvailable"
                );
                if let Some(max) = max {
                    assert!(max >= 1 && max < replicas, "{what}: maxUnavailable {max}");
                }
                if let Some(min) = min {
                    assert!(
                        min < replicas,
                        "{what}: minAvailable {min} blocks every drain"
                    );
                }
            }
            "ServiceMonitor" => {
                let endpoints = doc.seq("spec.endpoints");
                assert!(!endpoints.is_empty(), "{what}: no endpoints");
                for e in endpoints {
                    assert_eq!(e.str("path"), Some("/metrics"), "{what}: path");
                    assert_eq!(e.str("port"), Some("http"), "{what}");
                }
                assert!(!labels(doc.at("spec.selector.matchLabels")).is_empty());
            }
            "EnvoyFilter" => {
                envoy_filter_patches(&what, doc);
            }
            _ => unreachable!("known kinds"),
        }
    }
}

/// The rate limit filters and `rate_limits` entries an Istio EnvoyFilter patches in.
fn envoy_filter_patches(
    what: &str,
    doc: &Value,
) -> (Vec<rl_filter::RateLimit>, Vec<route::RateLimit>) {
    let patches = doc.seq("spec.configPatches");
    assert!(!patches.is_empty(), "{what}: no configPatches");
    let (mut filters, mut entries) = (Vec::new(), Vec::new());
    for p in patches {
        let value = p.find("patch.value").expect("patch.value");
        let apply = p.str("applyTo").unwrap_or_default();
        match (apply, p.str("patch.operation").unwrap_or_default()) {
            ("HTTP_FILTER", "INSERT_BEFORE") => {
                assert_eq!(
                    p.str("match.listener.filterChain.filter.subFilter.name"),
                    Some("envoy.filters.http.router"),
                    "{what}: insert before the router"
                );
                let (_, rate_limit) = http_filter(&decode(what, value));
                filters.push(rate_limit.unwrap_or_else(|| panic!("{what}: the rate limit filter")));
            }
            ("VIRTUAL_HOST", "MERGE") => {
                let v: VirtualHostPatchY = decode(what, value);
                assert!(!v.rate_limits.is_empty(), "{what}: no rate_limits");
                entries.extend(v.rate_limits.iter().map(rate_limit_entry));
            }
            other => panic!("{what}: patch {other:?} is not modelled"),
        }
    }
    (filters, entries)
}

fn check_deployment(what: &str, doc: &Value, docs: &[Value]) {
    let selector = labels(doc.at("spec.selector.matchLabels"));
    let pod_labels = labels(doc.at("spec.template.metadata.labels"));
    assert!(
        selects(&selector, &pod_labels),
        "{what}: selector misses its own pods"
    );
    let pod = doc.find("spec.template.spec").expect("pod spec");
    let pod_non_root = pod.is("securityContext.runAsNonRoot", true);
    let volumes = pod.seq("volumes");
    assert!(!containers(doc).is_empty(), "{what}: no containers");
    let grace = pod.int("terminationGracePeriodSeconds").unwrap_or(30);
    let mut port_names = BTreeSet::new();
    for p in containers(doc).iter().flat_map(|c| c.seq("ports")) {
        if let Some(port_name) = p.str("name") {
            assert!(
                port_name.len() <= 15 && is_dns_label(port_name),
                "{what}: port name {port_name}"
            );
            assert!(
                port_names.insert(port_name),
                "{what}: port name {port_name} twice in the pod"
            );
        }
    }
    let mut rlsd_drain: Option<f64> = None;
    let mut other_pre_stop = 0;
    for c in containers(doc) {
        let cname = c.str("name").expect("container name");
        let what = format!("{what}, container {cname}");
        assert!(is_dns_label(cname), "{what}: name");
        let image = c.str("image").unwrap_or_default();
        assert!(
            image.contains(':') && !image.ends_with(":latest"),
            "{what}: pin the image tag"
        );
        // Locked down.
        let sc = c.find("securityContext").expect("securityContext");
        assert!(
            pod_non_root || sc.is("runAsNonRoot", true),
            "{what}: runAsNonRoot"
        );
        assert_ne!(sc.int("runAsUser"), Some(0), "{what}");
        assert!(
            sc.is("readOnlyRootFilesystem", true),
            "{what}: readOnlyRootFilesystem"
        );
        assert!(
            sc.is("allowPrivilegeEscalation", false),
            "{what}: allowPrivilegeEscalation"
        );
        assert!(
            sc.seq("capabilities.drop").iter().any(|d| d == "ALL"),
            "{what}: drop ALL capabilities"
        );
        // Sized.
        let requests = c.find("resources.requests").expect("resources.requests");
        assert!(requests.get("cpu").is_some(), "{what}: cpu request");
        let request_memory = requests.at("memory").text().expect("memory");
        let limit_memory = c
            .at("resources.limits.memory")
            .text()
            .unwrap_or_else(|| panic!("{what}: memory limit"));
        assert!(
            bytes(&request_memory) <= bytes(&limit_memory),
            "{what}: memory"
        );
        // Mounts name declared volumes; ConfigMap volumes name ConfigMaps of the file.
        for m in c.seq("volumeMounts") {
            let vname = m.str("name").expect("mount name");
            let volume = named_item(volumes, vname)
                .unwrap_or_else(|| panic!("{what}: mount of undeclared volume {vname}"));
            if let Some(cm) = volume.str("configMap.name") {
                assert!(
                    object(docs, "ConfigMap", cm).is_some(),
                    "{what}: ConfigMap {cm} is not in the file"
                );
                assert!(
                    m.get("subPath").is_none(),
                    "{what}: a subPath ConfigMap mount never sees updates"
                );
            }
        }
        if is_rlsd(c) {
            let (drain, shutdown_grace) = check_rlsd_container(&what, c, pod, docs);
            rlsd_drain = Some(drain);
            // Kubernetes kills the pod at its grace period: rlsd's drain and its wait for open
            // calls must both fit, or its last answers are cut off.
            assert!(
                (grace as f64) > drain + shutdown_grace,
                "{what}: terminationGracePeriodSeconds {grace} must exceed --drain-seconds {drain} plus --shutdown-grace-seconds {shutdown_grace}"
            );
        } else {
            if let Some(s) = c.int("lifecycle.preStop.sleep.seconds") {
                other_pre_stop = other_pre_stop.max(s);
            }
            for probe in ["readinessProbe", "livenessProbe"] {
                let port = ["tcpSocket.port", "httpGet.port", "grpc.port"]
                    .iter()
                    .find_map(|port| c.at(probe).find(port));
                if let Some(port) = port {
                    let resolved = resolve_port(c.seq("ports"), port);
                    assert!(resolved.is_some(), "{what}: {probe} port");
                }
            }
        }
    }
    if let Some(drain) = rlsd_drain {
        assert!(
            (other_pre_stop as f64) < drain,
            "{what}: rlsd must drain longer ({drain} s) than the proxy's preStop ({other_pre_stop} s), so it outlives the proxy's last requests"
        );
    }
}

/// Checks an rlsd container against the binary; returns its drain and shutdown grace seconds.
fn check_rlsd_container(what: &str, c: &Value, pod: &Value, docs: &[Value]) -> (f64, f64) {
    let settings = RlsdSettings::of(c, what);
    let ports = c.seq("ports");
    let grpc = settings.port("--grpc-addr");
    let http = settings.port("--http-addr");
    for (port, flag_name, port_name) in
        [(grpc, "--grpc-addr", "grpc"), (http, "--http-addr", "http")]
    {
        let default = default_port(flag_name);
        assert_eq!(port, i64::from(default), "{what}: keep {default}");
        let named = resolve_port(ports, &Value::from(port_name));
        assert_eq!(named, Some(port), "{what}: port {port_name}");
    }

    // Probes: /healthcheck, gRPC health for a service rlsd answers, or a TCP connect.
    let redis = settings.get("--redis-url").is_some();
    for probe in ["readinessProbe", "livenessProbe"] {
        let p = c
            .find(probe)
            .unwrap_or_else(|| panic!("{what}: no {probe}"));
        if let Some(get) = p.find("httpGet") {
            assert_eq!(get.str("path"), Some("/healthcheck"), "{what}");
            let port = resolve_port(ports, get.find("port").expect("port"));
            assert_eq!(port, Some(http), "{what}: {probe} on the admin port");
        } else if let Some(g) = p.find("grpc") {
            assert_eq!(g.int("port"), Some(grpc), "{what}: {probe}");
            let service = g.str("service").unwrap_or_default();
            assert!(
                ["", "ratelimit"].contains(&service),
                "{what}: {probe} service {service}"
            );
        } else if let Some(t) = p.find("tcpSocket") {
            let port = resolve_port(ports, t.find("port").expect("port"));
            assert!(
                port == Some(grpc) || port == Some(http),
                "{what}: {probe} port"
            );
        } else {
            panic!("{what}: {probe} must be httpGet, grpc or tcpSocket");
        }
        if probe == "livenessProbe" && redis {
            assert!(
                p.get("tcpSocket").is_some(),
                "{what}: with Redis, /healthcheck and gRPC health fail while Redis is down; a liveness probe on them restarts every replica during a Redis outage"
            );
        }
    }

    // The config: a ConfigMap mounted as the --config directory, holding configs rlsd loads.
    let config = settings
        .get("--config")
        .unwrap_or_else(|| panic!("{what}: no --config / RLSD_CONFIG"));
    // A subPath mount is refused for every ConfigMap volume, in check_deployment.
    let volume = mounted_volume(what, pod, c, config);
    assert!(
        volume.find("configMap.items").is_none(),
        "{what}: items would hide new files"
    );
    let cm_name = volume
        .str("configMap.name")
        .unwrap_or_else(|| panic!("{what}: --config is not a ConfigMap"));
    let cm = object(docs, "ConfigMap", cm_name).expect("ConfigMap");
    let mut domains = BTreeSet::new();
    for (key, text) in cm.at("data").as_object().into_iter().flatten() {
        if !is_yaml(key) {
            continue;
        }
        let text = text.as_str().expect("string");
        let domain = load_config(&format!("{what}: ConfigMap {cm_name} {key}"), key, text);
        assert!(
            domains.insert(domain.name.clone()),
            "{what}: duplicate domain"
        );
        if key == "three-layer.yaml" {
            assert_eq!(
                text,
                read(EXAMPLE),
                "{what}: ConfigMap {cm_name} {key} must be {EXAMPLE} verbatim"
            );
        }
    }
    assert!(
        !domains.is_empty(),
        "{what}: ConfigMap {cm_name} has no *.yaml config"
    );

    // Redis: the URL names a Service of the file, on its port.
    if let Some(url) = settings.get("--redis-url") {
        let rest = url
            .strip_prefix("redis://")
            .or_else(|| url.strip_prefix("rediss://"))
            .unwrap_or_else(|| panic!("{what}: {url}"));
        let authority = rest.split('/').next().unwrap_or_default();
        let hostport = authority.rsplit('@').next().unwrap_or_default();
        let (host, port) = hostport.split_once(':').unwrap_or((hostport, "6379"));
        let service = host.split('.').next().unwrap_or_default();
        let port: i64 = port.parse().expect("port");
        let target = object(docs, "Service", service)
            .unwrap_or_else(|| panic!("{what}: no Service {service} for {url}"));
        assert!(
            target
                .seq("spec.ports")
                .iter()
                .any(|p| p.int("port") == Some(port)),
            "{what}: Service {service} has no port {port}"
        );
    }
    let seconds = |flag: &str, default: f64| {
        settings
            .get(flag)
            .map_or(Ok(default), str::parse::<f64>)
            .unwrap_or_else(|error| panic!("{what}: {flag}: {error}"))
    };
    (
        seconds("--drain-seconds", 0.0),
        seconds(
            "--shutdown-grace-seconds",
            rlsd::server::DEFAULT_SHUTDOWN_GRACE.as_secs_f64(),
        ),
    )
}

fn check_service(what: &str, doc: &Value, docs: &[Value]) {
    let backend = selected_deployment(what, docs, doc.at("spec.selector"));
    let container_ports: Vec<Value> = containers(backend)
        .iter()
        .flat_map(|c| c.seq("ports"))
        .cloned()
        .collect();
    let ports = doc.seq("spec.ports");
    assert!(!ports.is_empty(), "{what}: no ports");
    for p in ports {
        assert!(p.int("port").is_some(), "{what}: a port without a number");
        let target = target_port(p);
        assert!(
            resolve_port(&container_ports, target).is_some(),
            "{what}: targetPort {target:?} is no container port of {}",
            name(backend)
        );
        assert!(p.str("name").is_some(), "{what}: name every port");
    }
}

/// The pod of a file's Deployment that runs rlsd, and that container.
fn rlsd_in(file: &str) -> (Vec<Value>, Value, Value) {
    let docs = yaml_documents(file);
    let (deployment, container) = docs
        .iter()
        .filter(|d| kind(d).1 == "Deployment")
        .find_map(|d| {
            containers(d)
                .iter()
                .find(|c| is_rlsd(c))
                .map(|c| (d.clone(), c.clone()))
        })
        .unwrap_or_else(|| panic!("{file}: no rlsd container"));
    (docs, deployment, container)
}

#[test]
fn sidecar_envoy_runs_deploy_envoy_yaml_against_its_rlsd() {
    let file = "deploy/kubernetes/sidecar.yaml";
    let (docs, deployment, rlsd) = rlsd_in(file);
    let settings = RlsdSettings::of(&rlsd, file);
    let envoy = containers(&deployment)
        .iter()
        .find(|c| {
            c.str("image")
                .is_some_and(|i| i.starts_with("envoyproxy/envoy"))
        })
        .expect("an Envoy container");
    // Envoy's config file, through its mount, is deploy/envoy.yaml verbatim.
    let args = envoy.texts("args");
    let at = args
        .iter()
        .position(|a| a == "-c" || a == "--config-path")
        .expect("-c / --config-path");
    let config_path = Path::new(&args[at + 1]);
    let dir = config_path.parent().and_then(Path::to_str).expect("dir");
    let key = config_path
        .file_name()
        .and_then(|f| f.to_str())
        .expect("file");
    let volume = mounted_volume(file, deployment.at("spec.template.spec"), envoy, dir);
    let cm_name = volume.str("configMap.name").expect("a ConfigMap volume");
    let cm = object(&docs, "ConfigMap", cm_name).expect("the Envoy ConfigMap");
    let text = cm
        .at("data")
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("ConfigMap {cm_name} has no {key}"));
    assert_eq!(
        text,
        read("deploy/envoy.yaml"),
        "ConfigMap {cm_name} {key} must be deploy/envoy.yaml verbatim"
    );
    let (y, built) = envoy_bootstrap_text(&format!("{file}: {cm_name}"), text);
    let rl = rate_limiting(&built);
    assert_headers_from_one_side(file, &rl.filter, &settings);
    // Envoy's rlsd cluster is this rlsd's gRPC port; its listener is the Envoy container's port.
    let (_, port) = only_endpoint(cluster_named(&built, &rlsd_target(&rl.filter).cluster_name));
    assert_eq!(
        i64::from(port),
        settings.port("--grpc-addr"),
        "{file}: Envoy must call the sidecar's gRPC port"
    );
    let listener_port = y.static_resources.listeners[0]
        .address
        .socket_address
        .port_value;
    assert!(
        resolve_port(envoy.seq("ports"), &Value::from(listener_port)).is_some(),
        "{file}: the Envoy container must expose its listener port {listener_port}"
    );
}

#[test]
fn istio_filters_point_at_the_standalone_rlsd() {
    let file = "deploy/istio/envoyfilter.yaml";
    let (standalone, _, rlsd) = rlsd_in("deploy/kubernetes/standalone.yaml");
    let settings = RlsdSettings::of(&rlsd, "standalone rlsd");
    let (mut filters, mut entries) = (Vec::new(), Vec::new());
    for doc in &yaml_documents(file) {
        for p in doc.seq("spec.configPatches") {
            assert_eq!(p.str("match.context"), Some("GATEWAY"));
        }
        let (f, e) = envoy_filter_patches(file, doc);
        filters.extend(f);
        entries.extend(e);
    }
    assert_eq!(filters.len(), 1, "one rate limit filter");
    let rl = EnvoyRateLimiting {
        filter: filters.remove(0),
        entries,
        use_remote_address: true, // Istio gateways set it.
    };
    check_against_example(file, &rl);

    // outbound|<port>||<service>.<namespace>.svc.cluster.local is the standalone Service's
    // gRPC port.
    let grpc = rlsd_target(&rl.filter);
    let parts: Vec<&str> = grpc.cluster_name.split('|').collect();
    assert_eq!(parts.len(), 4, "{}", grpc.cluster_name);
    assert_eq!(parts[0], "outbound");
    let port: i64 = parts[1].parse().expect("port");
    let host: Vec<&str> = parts[3].split('.').collect();
    assert_eq!(&host[2..], ["svc", "cluster", "local"], "{}", parts[3]);
    assert_eq!(grpc.authority, parts[3], "authority is the Service's name");
    let svc = standalone
        .iter()
        .find(|d| kind(d).1 == "Service" && name(d) == host[0] && namespace(d) == host[1])
        .unwrap_or_else(|| panic!("no Service {}.{} in standalone.yaml", host[0], host[1]));
    let svc_port = svc
        .seq("spec.ports")
        .iter()
        .find(|p| p.int("port") == Some(port))
        .unwrap_or_else(|| panic!("Service {} has no port {port}", host[0]));
    // Istio picks the protocol from appProtocol, else from the port name's prefix.
    let port_name = svc_port.str("name").unwrap_or_default();
    let grpc_port = match svc_port.str("appProtocol") {
        Some(protocol) => ["grpc", "http2", "kubernetes.io/h2c"].contains(&protocol),
        None => port_name == "grpc" || port_name.starts_with("grpc-"),
    };
    assert!(
        grpc_port,
        "Istio must know the Service port is gRPC (HTTP/2)"
    );
    assert_eq!(
        resolve_port(rlsd.seq("ports"), target_port(svc_port)),
        Some(settings.port("--grpc-addr")),
        "the Service's gRPC port must reach rlsd's --grpc-addr"
    );
    assert_headers_from_one_side(file, &rl.filter, &settings);
}

#[test]
fn standalone_rlsd_shares_redis_and_is_monitored() {
    let (docs, deployment, rlsd) = rlsd_in("deploy/kubernetes/standalone.yaml");
    let settings = RlsdSettings::of(&rlsd, "standalone rlsd");
    assert!(
        settings.get("--redis-url").is_some(),
        "replicas share their counts only through Redis"
    );
    assert!(
        named_item(rlsd.seq("env"), "RLSD_REDIS_URL").is_some(),
        "the Redis URL comes from RLSD_REDIS_URL"
    );
    assert_eq!(deployment.int("spec.replicas"), Some(3));
    assert!(docs.iter().any(|d| kind(d).1 == "PodDisruptionBudget"));

    // The ServiceMonitor selects the rlsd Service, whose `http` port is rlsd's admin port.
    let monitor = &yaml_documents("deploy/prometheus/servicemonitor.yaml")[0];
    let selector = labels(monitor.at("spec.selector.matchLabels"));
    let services: Vec<&Value> = docs
        .iter()
        .filter(|d| kind(d).1 == "Service" && selects(&selector, &labels(d.at("metadata.labels"))))
        .collect();
    assert_eq!(
        services.len(),
        1,
        "the ServiceMonitor selects the rlsd Service only"
    );
    let namespaces = monitor.texts("spec.namespaceSelector.matchNames");
    assert!(namespaces.iter().any(|n| n == namespace(services[0])));
    let port_name = monitor
        .seq("spec.endpoints")
        .first()
        .and_then(|e| e.str("port"))
        .expect("port");
    let svc_port = named_item(services[0].seq("spec.ports"), port_name)
        .expect("the Service port the ServiceMonitor names");
    assert_eq!(
        resolve_port(
            rlsd.seq("ports"),
            svc_port.get("targetPort").expect("targetPort")
        ),
        Some(settings.port("--http-addr")),
        "the monitored port must be rlsd's --http-addr"
    );
}

// === Prometheus ==================================================================================

fn check_prometheus_config(file: &str) {
    let doc = &yaml_documents(file)[0];
    let job = doc
        .seq("scrape_configs")
        .iter()
        .find(|j| j.str("job_name") == Some("rlsd"))
        .unwrap_or_else(|| panic!("{file}: no job rlsd"));
    assert_eq!(job.str("metrics_path"), Some("/metrics"), "{file}");
    let http = default_port("--http-addr").to_string();
    let keeps: Vec<(String, String)> = job
        .seq("relabel_configs")
        .iter()
        .filter(|r| r.str("action") == Some("keep"))
        .map(|r| {
            let regex = r.at("regex").text().unwrap_or_default();
            (r.texts("source_labels").join(";"), regex)
        })
        .collect();
    assert!(
        keeps.iter().any(|(s, r)| {
            (s == "__meta_kubernetes_pod_container_port_number" && *r == http)
                || (s == "__meta_kubernetes_pod_container_port_name" && r == "http")
        }),
        "{file}: keep only rlsd's admin port ({http} / http): {keeps:?}"
    );
    // The container-name filter matches the rlsd containers of the manifests.
    if let Some((_, regex)) = keeps
        .iter()
        .find(|(s, _)| s == "__meta_kubernetes_pod_container_name")
    {
        for manifest in [
            "deploy/kubernetes/sidecar.yaml",
            "deploy/kubernetes/standalone.yaml",
        ] {
            let (_, _, c) = rlsd_in(manifest);
            assert_eq!(
                c.str("name").expect("name"),
                regex,
                "{file}: {manifest}'s rlsd container would not be kept"
            );
        }
    }
}

// === Dockerfile ==================================================================================

/// The instructions of deploy/Dockerfile: (INSTRUCTION, rest), continuations joined.
fn dockerfile() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in read("deploy/Dockerfile").lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (pending.is_empty() && trimmed.is_empty()) {
            continue;
        }
        if let Some(part) = trimmed.strip_suffix('\\') {
            pending.push_str(part);
            pending.push(' ');
            continue;
        }
        pending.push_str(trimmed);
        let (op, rest) = pending.split_once(' ').unwrap_or((&pending, ""));
        out.push((op.to_ascii_uppercase(), rest.trim().to_owned()));
        pending.clear();
    }
    out
}

fn dockerfile_final_stage() -> Vec<(String, String)> {
    let all = dockerfile();
    let last_from = all.iter().rposition(|(op, _)| op == "FROM").expect("FROM");
    all[last_from..].to_vec()
}

fn dockerfile_entrypoint() -> Vec<String> {
    let stage = dockerfile_final_stage();
    let (_, rest) = stage
        .iter()
        .rfind(|(op, _)| op == "ENTRYPOINT")
        .expect("ENTRYPOINT in the final stage");
    serde_json::from_str(rest).expect("ENTRYPOINT in exec (JSON) form")
}

fn check_dockerfile(file: &str) {
    let all = dockerfile();
    let froms: Vec<&String> = all
        .iter()
        .filter(|(op, _)| op == "FROM")
        .map(|(_, r)| r)
        .collect();
    assert!(
        froms.len() >= 2,
        "{file}: multi-stage (a builder and a runtime)"
    );
    assert!(
        froms[0].starts_with("rust:"),
        "{file}: builds in an official Rust image"
    );
    assert!(
        all.iter()
            .any(|(op, r)| op == "RUN" && r.contains("cargo build --release --locked")),
        "{file}: cargo build --release --locked"
    );
    // Every COPY from the context names a path of the crate (the context is the crate root).
    for (op, rest) in &all {
        if op != "COPY" || rest.contains("--from=") {
            continue;
        }
        let words: Vec<&str> = rest
            .split_whitespace()
            .filter(|w| !w.starts_with("--"))
            .collect();
        for source in &words[..words.len() - 1] {
            assert!(
                path(source).exists(),
                "{file}: COPY {source}: no such path in the crate"
            );
        }
    }
    // The build reads lua/ (embedded) and proto/ (build.rs); cargo loads the manifest only with
    // every bench it declares and every workspace member present.
    for needed in ["src", "proto", "lua", "Cargo.lock", "build.rs", "benches", "testkit"] {
        let copied = |r: &String| {
            r.split_whitespace()
                .any(|w| w.trim_end_matches('/') == needed)
        };
        assert!(
            all.iter().any(|(op, r)| op == "COPY" && copied(r)),
            "{file}: the build needs {needed}"
        );
    }
    let stage = dockerfile_final_stage();
    let non_root = match stage.iter().rfind(|(op, _)| op == "USER") {
        Some((_, user)) => !["0", "root"].contains(&user.split(':').next().unwrap_or_default()),
        None => stage[0].1.ends_with(":nonroot"),
    };
    assert!(
        non_root,
        "{file}: the runtime stage runs as a non-root user"
    );
    let exposed: BTreeSet<&str> = stage
        .iter()
        .filter(|(op, _)| op == "EXPOSE")
        .flat_map(|(_, r)| r.split_whitespace())
        .collect();
    for port in [default_port("--http-addr"), default_port("--grpc-addr")] {
        assert!(
            exposed.contains(port.to_string().as_str()),
            "{file}: EXPOSE {port}"
        );
    }
    let entrypoint = dockerfile_entrypoint();
    assert!(
        entrypoint
            .first()
            .is_some_and(|e| e.ends_with("/rlsd") || e == "rlsd")
            && entrypoint.get(1).map(String::as_str) == Some("serve"),
        "{file}: ENTRYPOINT runs `rlsd serve`: {entrypoint:?}"
    );
    // Image defaults are real rlsd variables, and the config directory holds a config.
    let env = image_env();
    for key in env.keys().filter(|k| k.starts_with("RLSD_")) {
        assert!(
            flag_for_env(key).is_some(),
            "{file}: ENV {key} is unknown to rlsd"
        );
    }
    let config = env.get("RLSD_CONFIG").expect("ENV RLSD_CONFIG");
    let ships = |r: &String| {
        r.split_whitespace()
            .last()
            .is_some_and(|d| d.starts_with(config.as_str()))
    };
    assert!(
        stage.iter().any(|(op, r)| op == "COPY" && ships(r)),
        "{file}: the image ships a config under {config}"
    );
}

// === Grafana =====================================================================================

fn dashboard(file: &str) -> Value {
    parse_json(&read(file)).unwrap_or_else(|e| panic!("{file}: not JSON: {e}"))
}

/// Every PromQL expression of a dashboard: panel `expr`s and template `label_values(...)`.
fn expressions(v: &Value, out: &mut Vec<String>) {
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
/// aggregations, keywords, label names or grouping labels. Strings, `{...}` matchers and
/// `[...]` ranges are skipped.
fn metric_names(expr: &str) -> Vec<String> {
    const GROUPING: &str = "by without on ignoring group_left group_right";
    const KEYWORDS: &str = "bool and or unless offset sum min max avg group stddev stdvar count \
        count_values bottomk topk quantile limitk limit_ratio inf nan";
    let label_values = expr.strip_prefix("label_values(");
    let expr = label_values
        .and_then(|rest| rest.split(',').next())
        .unwrap_or(expr);
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    let mut skip_group = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            i += if chars[i] == '\\' { 2 } else { 1 };
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if skip_group => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                skip_group = false;
                i += 1;
            }
            c if c.is_ascii_digit() => {
                // A number (`0.99`, `1e3`), not a name.
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j] == ' ' {
                    j += 1;
                }
                let is_call = chars.get(j) == Some(&'(');
                let lower = word.to_ascii_lowercase();
                let is = |list: &str| list.split_whitespace().any(|w| w == lower);
                if is(GROUPING) {
                    skip_group = true;
                } else if !(is_call || is(KEYWORDS)) {
                    names.push(word);
                }
            }
            '$' => {
                // A Grafana variable outside a matcher: skip its name.
                i += 1;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            _ => i += 1,
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
}

fn check_dashboard_shape(file: &str, d: &Value) {
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

async fn http_get(addr: SocketAddr, target: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {target} HTTP/1.1\r\nHost: rlsd\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    Ok((status.unwrap_or(0), body.to_owned()))
}

/// `rlsd serve` on the example config with `extra` flags, healthy.
async fn start_rlsd(extra: &[&str]) -> Rlsd {
    let config = path(EXAMPLE).display().to_string();
    let rlsd = Rlsd::serve([&["--config", config.as_str()], extra].concat());
    let (status, body) = http_get(rlsd.http, "/healthcheck")
        .await
        .expect("healthcheck");
    assert_eq!((status, body.trim()), (200, "OK"), "{}", rlsd.log());
    rlsd
}

fn descriptor_of(entries: &[(String, String)]) -> rlsd::pb::RateLimitDescriptor {
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
fn exposition_types(text: &str) -> BTreeMap<String, String> {
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
    let (_, built) = envoy_bootstrap("deploy/envoy.yaml");
    let rl = rate_limiting(&built);
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
    let (status, text) = http_get(rlsd.http, "/metrics").await.expect("scrape");
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

/// The Envoy Gateway config swaps only the rate limit image, to one whose `/bin/ratelimit` is
/// rlsd (Envoy Gateway runs that path with envoyproxy/ratelimit's variables), and names a
/// Redis backend as Envoy Gateway requires before it deploys any rate limit service.
#[test]
fn envoy_gateway_config_runs_rlsd_as_its_rate_limit_service() {
    let file = "deploy/envoy-gateway/envoy-gateway-config.yaml";
    let docs = yaml_documents(file);
    let map = docs
        .iter()
        .find(|d| kind(d) == ("v1", "ConfigMap"))
        .unwrap_or_else(|| panic!("{file}: no ConfigMap"));
    // The name and namespace Envoy Gateway's Helm chart reads its config from.
    assert_eq!(name(map), "envoy-gateway-config");
    assert_eq!(map.str("metadata.namespace"), Some("envoy-gateway-system"));
    let text = map
        .at("data")
        .get("envoy-gateway.yaml")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{file}: no envoy-gateway.yaml"));
    let config: Value = serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_eq!(
        kind(&config),
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyGateway")
    );
    assert_eq!(config.str("provider.type"), Some("Kubernetes"));
    let container = config
        .find("provider.kubernetes.rateLimitDeployment.container")
        .unwrap_or_else(|| panic!("{file}: no rateLimitDeployment.container"));
    assert!(is_rlsd(container), "{file}: the image is not rlsd's");
    // Envoy Gateway sets the command and env itself; a config here would be overridden or clash.
    let keys: Vec<&String> = container
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .collect();
    assert_eq!(keys, ["image"], "{file}: only the image changes");
    assert_eq!(config.str("rateLimit.backend.type"), Some("Redis"));
    let url = config
        .str("rateLimit.backend.redis.url")
        .unwrap_or_default();
    assert!(
        url.rsplit_once(':')
            .is_some_and(|(_, port)| port.parse::<u16>().is_ok()),
        "{url}"
    );
    // The image has rlsd where Envoy Gateway runs it.
    assert!(
        dockerfile()
            .iter()
            .any(|(op, r)| op == "COPY" && r.ends_with(" /bin/ratelimit")),
        "deploy/Dockerfile: no /bin/ratelimit"
    );
}
