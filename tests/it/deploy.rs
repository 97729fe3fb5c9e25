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
use std::fmt;
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
use rlsd::config::{Level, Node};
use serde::Deserialize;
use serde::de::value::{Error as DeError, MapDeserializer, SeqDeserializer};
use serde::de::{self, IntoDeserializer, Visitor};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const EXAMPLE: &str = "examples/three-layer.yaml";

fn path(relative: &str) -> PathBuf {
    Path::new(ROOT).join(relative)
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(path(relative)).unwrap_or_else(|e| panic!("reading {relative}: {e}"))
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
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let entry = entry.expect("directory entry");
            let kind = entry.file_type().expect("file type");
            if kind.is_dir() {
                walk(&entry.path(), out);
            } else {
                out.push(entry.path());
            }
        }
    }
    let mut files = Vec::new();
    walk(&path("deploy"), &mut files);
    let mut names: Vec<String> = files
        .iter()
        .map(|p| {
            p.strip_prefix(ROOT)
                .expect("under the crate")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

fn kind_of(relative: &str) -> Kind {
    let name = Path::new(relative)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if name == "README.md" {
        return Kind::Readme;
    }
    if name == "Dockerfile" {
        return Kind::Dockerfile;
    }
    if name.ends_with(".json") && relative.starts_with("deploy/grafana/") {
        return Kind::GrafanaDashboard;
    }
    if name.ends_with(".yaml") || name.ends_with(".yml") {
        let docs = yaml_documents(relative);
        let has = |key: &str| docs.iter().all(|d| d.get(key).is_some());
        if has("static_resources") {
            return Kind::EnvoyBootstrap;
        }
        if has("scrape_configs") {
            return Kind::PrometheusConfig;
        }
        if has("apiVersion") && has("kind") {
            return Kind::Kubernetes;
        }
        panic!(
            "{relative}: YAML that is neither an Envoy bootstrap, a Prometheus config nor Kubernetes objects; teach tests/it/deploy.rs about it"
        );
    }
    panic!("{relative}: unknown kind of file; teach tests/it/deploy.rs to check it");
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
            Kind::GrafanaDashboard => {
                check_dashboard_shape(file, &dashboard(file));
            }
        }
        // Every file is documented.
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
    for file in deploy_files() {
        if !(file.ends_with(".yaml") || file.ends_with(".yml")) {
            continue;
        }
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

// === A YAML/JSON value tree ======================================================================

/// A parsed YAML (or JSON) node, for documents whose shape is open (Kubernetes objects).
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Seq(Vec<Value>),
    Map(Vec<(String, Value)>),
}

impl Value {
    fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// `a.b.c`: nested map keys (keys with dots need [`Value::get`]).
    fn at(&self, path: &str) -> Option<&Value> {
        path.split('.').try_fold(self, |v, key| v.get(key))
    }

    fn str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    fn int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    fn seq(&self) -> &[Value] {
        match self {
            Value::Seq(items) => items,
            _ => &[],
        }
    }

    fn map(&self) -> &[(String, Value)] {
        match self {
            Value::Map(entries) => entries,
            _ => &[],
        }
    }

    /// A string, or a number written as one (a port, a count).
    fn text(&self) -> Option<String> {
        match self {
            Value::Str(s) => Some(s.clone()),
            Value::Int(i) => Some(i.to_string()),
            Value::Float(f) => Some(f.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            _ => None,
        }
    }

    /// Decodes this node into a typed mirror (which may reject unknown fields).
    fn decode<T: de::DeserializeOwned>(&self, what: &str) -> T {
        T::deserialize(self.clone()).unwrap_or_else(|e| panic!("{what}: {e}"))
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Value, D::Error> {
        struct ValueVisitor;
        impl<'de> Visitor<'de> for ValueVisitor {
            type Value = Value;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
                Ok(Value::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
                Ok(Value::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
                Ok(i64::try_from(v).map_or(Value::Float(v as f64), Value::Int))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
                Ok(Value::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Value, E> {
                Ok(Value::Str(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Value, E> {
                Ok(Value::Str(v))
            }
            fn visit_unit<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_none<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
                Value::deserialize(d)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Value::Seq(items))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
                let mut entries: Vec<(String, Value)> = Vec::new();
                while let Some(key) = map.next_key::<Value>()? {
                    let key = key
                        .text()
                        .ok_or_else(|| de::Error::custom("a map key that is not a scalar"))?;
                    if entries.iter().any(|(k, _)| *k == key) {
                        return Err(de::Error::custom(format!("duplicate key `{key}`")));
                    }
                    entries.push((key, map.next_value()?));
                }
                Ok(Value::Map(entries))
            }
        }
        deserializer.deserialize_any(ValueVisitor)
    }
}

/// So a subtree can be decoded into a typed mirror.
impl<'de> de::Deserializer<'de> for Value {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(b),
            Value::Int(i) => visitor.visit_i64(i),
            Value::Float(f) => visitor.visit_f64(f),
            Value::Str(s) => visitor.visit_string(s),
            Value::Seq(items) => {
                let mut seq = SeqDeserializer::new(items.into_iter());
                let value = visitor.visit_seq(&mut seq)?;
                seq.end()?;
                Ok(value)
            }
            Value::Map(entries) => {
                let mut map = MapDeserializer::new(entries.into_iter());
                let value = visitor.visit_map(&mut map)?;
                map.end()?;
                Ok(value)
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self {
            Value::Null => visitor.visit_none(),
            other => visitor.visit_some(other),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

impl IntoDeserializer<'_, DeError> for Value {
    type Deserializer = Value;
    fn into_deserializer(self) -> Value {
        self
    }
}

/// Every document of a YAML file.
fn yaml_documents(relative: &str) -> Vec<Value> {
    let text = read(relative);
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{relative}: {e}"));
    let docs: Vec<Value> = docs.into_iter().filter(|d| *d != Value::Null).collect();
    assert!(!docs.is_empty(), "{relative}: no YAML document");
    docs
}

/// Strict JSON (RFC 8259: no comments, no trailing commas; [`Value`] refuses duplicate keys),
/// so a dashboard that only a YAML parser would accept fails here.
fn parse_json(text: &str) -> Result<Value, String> {
    serde_json::from_str(text).map_err(|error| error.to_string())
}

#[test]
fn the_json_parser_is_strict() {
    assert!(parse_json(r#"{"a": [1, 2.5, -3e2, "x\u00e9\ud83d\ude00", true, null]}"#).is_ok());
    for bad in [
        r#"{"a": 1,}"#,
        r#"[1, 2,]"#,
        r#"{a: 1}"#,
        r#"{"a": 1} // c"#,
        r#"{"a": 1, "a": 2}"#,
        r#"{"a": 01}"#,
        "{\"a\": \"x\ty\"}",
        r#"{"a": 'x'}"#,
    ] {
        assert!(parse_json(bad).is_err(), "accepted {bad}");
    }
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
                let long = arg.get_long()?;
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
                Some((format!("--{long}"), flag))
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
    port_of(
        flag(flag_name)
            .default
            .as_deref()
            .unwrap_or_else(|| panic!("{flag_name} has no default")),
    )
}

#[test]
fn the_flags_are_read_from_rlsd() {
    assert_eq!(default_port("--grpc-addr"), 8081);
    assert_eq!(default_port("--http-addr"), 8080);
    assert_eq!(flag("--config").env.as_deref(), Some("RLSD_CONFIG"));
    assert!(flag("--headers").possible.iter().any(|v| v == "off"));
    assert!(flag("--config").takes_value);
}

/// The example config, loaded as rlsd loads it.
fn example_domain() -> rlsd::config::Domain {
    rlsd::config::load_str(EXAMPLE, &read(EXAMPLE)).unwrap_or_else(|errors| {
        panic!(
            "{EXAMPLE} does not load: {}",
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        )
    })
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

fn limited_node<'c>(domain: &'c rlsd::config::Domain, entries: &[(String, String)]) -> &'c Node {
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BootstrapY {
    admin: AdminY,
    static_resources: StaticResourcesY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminY {
    address: AddressY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddressY {
    socket_address: SocketAddressY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SocketAddressY {
    address: String,
    port_value: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticResourcesY {
    listeners: Vec<ListenerY>,
    clusters: Vec<ClusterY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerY {
    name: String,
    address: AddressY,
    filter_chains: Vec<FilterChainY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterChainY {
    filters: Vec<NetworkFilterY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkFilterY {
    name: String,
    typed_config: HcmY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HcmY {
    #[serde(rename = "@type")]
    type_url: String,
    stat_prefix: String,
    codec_type: Option<String>,
    use_remote_address: Option<bool>,
    xff_num_trusted_hops: Option<u32>,
    route_config: RouteConfigY,
    http_filters: Vec<HttpFilterY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteConfigY {
    name: String,
    virtual_hosts: Vec<VirtualHostY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VirtualHostY {
    name: String,
    domains: Vec<String>,
    routes: Vec<RouteY>,
    #[serde(default)]
    rate_limits: Vec<RateLimitY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteY {
    #[serde(rename = "match")]
    route_match: RouteMatchY,
    route: RouteActionY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteMatchY {
    prefix: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteActionY {
    cluster: String,
    #[serde(default)]
    rate_limits: Vec<RateLimitY>,
}

/// A route or virtual host `rate_limits` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitY {
    stage: Option<u32>,
    actions: Vec<ActionY>,
}

/// `RateLimit.Action`, a oneof: exactly one field is set.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionY {
    remote_address: Option<EmptyY>,
    request_headers: Option<RequestHeadersY>,
    header_value_match: Option<HeaderValueMatchY>,
    generic_key: Option<GenericKeyY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EmptyY {}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestHeadersY {
    header_name: String,
    descriptor_key: String,
    skip_if_absent: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderValueMatchY {
    descriptor_key: Option<String>,
    descriptor_value: String,
    expect_match: Option<bool>,
    headers: Vec<HeaderMatcherY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderMatcherY {
    name: String,
    string_match: Option<StringMatchY>,
    present_match: Option<bool>,
    invert_match: Option<bool>,
}

/// `StringMatcher`: one pattern field set.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StringMatchY {
    exact: Option<String>,
    prefix: Option<String>,
    suffix: Option<String>,
    contains: Option<String>,
    ignore_case: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenericKeyY {
    descriptor_key: Option<String>,
    descriptor_value: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpFilterY {
    name: String,
    typed_config: HttpFilterConfigY,
}

/// The `typed_config` of an HTTP filter: the rate limit filter's fields, all optional so the
/// router's (which has none) fits too; which must be set is checked against `@type`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpFilterConfigY {
    #[serde(rename = "@type")]
    type_url: String,
    domain: Option<String>,
    stage: Option<u32>,
    timeout: Option<String>,
    failure_mode_deny: Option<bool>,
    enable_x_ratelimit_headers: Option<String>,
    rate_limit_service: Option<RateLimitServiceY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitServiceY {
    transport_api_version: String,
    grpc_service: GrpcServiceY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrpcServiceY {
    envoy_grpc: EnvoyGrpcY,
    timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvoyGrpcY {
    cluster_name: String,
    authority: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterY {
    name: String,
    #[serde(rename = "type")]
    discovery: String,
    connect_timeout: String,
    #[serde(default)]
    typed_extension_protocol_options: BTreeMap<String, HttpProtocolOptionsY>,
    load_assignment: LoadAssignmentY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpProtocolOptionsY {
    #[serde(rename = "@type")]
    type_url: String,
    explicit_http_config: ExplicitHttpConfigY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplicitHttpConfigY {
    http_protocol_options: Option<EmptyY>,
    http2_protocol_options: Option<EmptyY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadAssignmentY {
    cluster_name: String,
    endpoints: Vec<LocalityEndpointsY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LocalityEndpointsY {
    lb_endpoints: Vec<LbEndpointY>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LbEndpointY {
    endpoint: EndpointY,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointY {
    address: AddressY,
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

fn string_matcher(m: &StringMatchY) -> matcher::StringMatcher {
    use matcher::string_matcher::MatchPattern;
    let patterns: Vec<MatchPattern> = [
        m.exact.clone().map(MatchPattern::Exact),
        m.prefix.clone().map(MatchPattern::Prefix),
        m.suffix.clone().map(MatchPattern::Suffix),
        m.contains.clone().map(MatchPattern::Contains),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert_eq!(patterns.len(), 1, "a string_match sets one pattern: {m:?}");
    matcher::StringMatcher {
        ignore_case: m.ignore_case.unwrap_or(false),
        match_pattern: patterns.into_iter().next(),
    }
}

fn rate_limit_entry(entry: &RateLimitY) -> route::RateLimit {
    use route::rate_limit::action::{self, ActionSpecifier};
    assert!(
        !entry.actions.is_empty(),
        "a rate_limits entry needs actions"
    );
    let actions = entry
        .actions
        .iter()
        .map(|a| {
            let mut set: Vec<ActionSpecifier> = Vec::new();
            if a.remote_address.is_some() {
                set.push(ActionSpecifier::RemoteAddress(action::RemoteAddress {}));
            }
            if let Some(h) = &a.request_headers {
                assert!(!h.header_name.is_empty() && !h.descriptor_key.is_empty());
                set.push(ActionSpecifier::RequestHeaders(action::RequestHeaders {
                    header_name: h.header_name.clone(),
                    descriptor_key: h.descriptor_key.clone(),
                    skip_if_absent: h.skip_if_absent.unwrap_or(false),
                }));
            }
            if let Some(m) = &a.header_value_match {
                assert!(!m.headers.is_empty(), "header_value_match needs headers");
                set.push(ActionSpecifier::HeaderValueMatch(
                    action::HeaderValueMatch {
                        descriptor_key: m.descriptor_key.clone().unwrap_or_default(),
                        descriptor_value: m.descriptor_value.clone(),
                        expect_match: m.expect_match.map(|value| wkt::BoolValue { value }),
                        headers: m
                            .headers
                            .iter()
                            .map(|h| {
                                use route::header_matcher::HeaderMatchSpecifier;
                                let specifier = match (&h.string_match, h.present_match) {
                                    (Some(s), None) => {
                                        Some(HeaderMatchSpecifier::StringMatch(string_matcher(s)))
                                    }
                                    (None, Some(p)) => Some(HeaderMatchSpecifier::PresentMatch(p)),
                                    (None, None) => None,
                                    (Some(_), Some(_)) => panic!("{h:?}: one match specifier"),
                                };
                                route::HeaderMatcher {
                                    name: h.name.clone(),
                                    invert_match: h.invert_match.unwrap_or(false),
                                    header_match_specifier: specifier,
                                    ..Default::default()
                                }
                            })
                            .collect(),
                        ..Default::default()
                    },
                ));
            }
            if let Some(g) = &a.generic_key {
                set.push(ActionSpecifier::GenericKey(action::GenericKey {
                    descriptor_key: g.descriptor_key.clone().unwrap_or_default(),
                    descriptor_value: g.descriptor_value.clone(),
                    ..Default::default()
                }));
            }
            assert_eq!(set.len(), 1, "an action sets exactly one kind: {a:?}");
            route::rate_limit::Action {
                action_specifier: set.pop(),
            }
        })
        .collect();
    route::RateLimit {
        stage: entry.stage.map(|value| wkt::UInt32Value { value }),
        actions,
        ..Default::default()
    }
}

/// The rate limit filter's config as Envoy's message; `None` for the router.
fn http_filter(f: &HttpFilterY) -> (hcm::HttpFilter, Option<rl_filter::RateLimit>) {
    let c = &f.typed_config;
    let (any, rate_limit) = match f.name.as_str() {
        "envoy.filters.http.ratelimit" => {
            let headers = c.enable_x_ratelimit_headers.as_deref().map_or(0, |name| {
                rl_filter::rate_limit::XRateLimitHeadersRfcVersion::from_str_name(name)
                    .unwrap_or_else(|| panic!("enable_x_ratelimit_headers: no `{name}`"))
                    as i32
            });
            let service = c
                .rate_limit_service
                .as_ref()
                .expect("the rate limit filter needs rate_limit_service");
            let api = core::ApiVersion::from_str_name(&service.transport_api_version)
                .unwrap_or_else(|| {
                    panic!(
                        "transport_api_version: no `{}`",
                        service.transport_api_version
                    )
                });
            assert_eq!(api, core::ApiVersion::V3, "rlsd speaks the v3 API only");
            let grpc = &service.grpc_service.envoy_grpc;
            let message = rl_filter::RateLimit {
                domain: c
                    .domain
                    .clone()
                    .expect("the rate limit filter needs a domain"),
                stage: c.stage.unwrap_or(0),
                timeout: c.timeout.as_deref().map(duration),
                failure_mode_deny: c
                    .failure_mode_deny
                    .expect("failure_mode_deny must be chosen, not defaulted"),
                enable_x_ratelimit_headers: headers,
                rate_limit_service: Some(RateLimitServiceConfig {
                    grpc_service: Some(core::GrpcService {
                        timeout: service.grpc_service.timeout.as_deref().map(duration),
                        target_specifier: Some(core::grpc_service::TargetSpecifier::EnvoyGrpc(
                            core::grpc_service::EnvoyGrpc {
                                cluster_name: grpc.cluster_name.clone(),
                                authority: grpc.authority.clone().unwrap_or_default(),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }),
                    transport_api_version: api as i32,
                }),
                ..Default::default()
            };
            (any(&c.type_url, &message), Some(message))
        }
        "envoy.filters.http.router" => {
            assert!(
                c.domain.is_none()
                    && c.stage.is_none()
                    && c.timeout.is_none()
                    && c.failure_mode_deny.is_none()
                    && c.enable_x_ratelimit_headers.is_none()
                    && c.rate_limit_service.is_none(),
                "the router takes none of the rate limit filter's fields"
            );
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

fn cluster(c: &ClusterY) -> cluster::Cluster {
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
        use upstream_http::http_protocol_options::explicit_http_config::ProtocolConfig;
        let protocol = match (
            &o.explicit_http_config.http_protocol_options,
            &o.explicit_http_config.http2_protocol_options,
        ) {
            (None, Some(_)) => ProtocolConfig::Http2ProtocolOptions(Default::default()),
            (Some(_), None) => ProtocolConfig::HttpProtocolOptions(Default::default()),
            _ => panic!("cluster {}: explicit_http_config sets one protocol", c.name),
        };
        let message = upstream_http::HttpProtocolOptions {
            upstream_protocol_options: Some(
                upstream_http::http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                    upstream_http::http_protocol_options::ExplicitHttpConfig {
                        protocol_config: Some(protocol),
                    },
                ),
            ),
            ..Default::default()
        };
        options.insert(name.clone(), any(&o.type_url, &message));
    }
    assert_eq!(c.load_assignment.cluster_name, c.name);
    cluster::Cluster {
        name: c.name.clone(),
        connect_timeout: Some(duration(&c.connect_timeout)),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            discovery as i32,
        )),
        typed_extension_protocol_options: options,
        load_assignment: Some(endpoint::ClusterLoadAssignment {
            cluster_name: c.load_assignment.cluster_name.clone(),
            endpoints: c
                .load_assignment
                .endpoints
                .iter()
                .map(|l| endpoint::LocalityLbEndpoints {
                    lb_endpoints: l
                        .lb_endpoints
                        .iter()
                        .map(|e| endpoint::LbEndpoint {
                            host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                                endpoint::Endpoint {
                                    address: Some(address(&e.endpoint.address)),
                                    ..Default::default()
                                },
                            )),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
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

/// Decodes an Envoy bootstrap file into the mirror and into Envoy's `Bootstrap`.
fn envoy_bootstrap(relative: &str) -> (BootstrapY, bootstrap::Bootstrap) {
    envoy_bootstrap_text(relative, &read(relative))
}

fn envoy_bootstrap_text(what: &str, text: &str) -> (BootstrapY, bootstrap::Bootstrap) {
    let y: BootstrapY = serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    let listeners =
        y.static_resources
            .listeners
            .iter()
            .map(|l| listener::Listener {
                name: l.name.clone(),
                address: Some(address(&l.address)),
                filter_chains: l
                    .filter_chains
                    .iter()
                    .map(|chain| listener::FilterChain {
                        filters: chain
                            .filters
                            .iter()
                            .map(|f| {
                                assert_eq!(f.name, "envoy.filters.network.http_connection_manager");
                                let manager = http_connection_manager(&f.typed_config);
                                listener::Filter {
                                    name: f.name.clone(),
                                    config_type: Some(listener::filter::ConfigType::TypedConfig(
                                        any(&f.typed_config.type_url, &manager),
                                    )),
                                }
                            })
                            .collect(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
    let built = bootstrap::Bootstrap {
        admin: Some(bootstrap::Admin {
            address: Some(address(&y.admin.address)),
            ..Default::default()
        }),
        static_resources: Some(bootstrap::bootstrap::StaticResources {
            listeners,
            clusters: y.static_resources.clusters.iter().map(cluster).collect(),
            ..Default::default()
        }),
        ..Default::default()
    };
    (y, built)
}

fn http_connection_manager(m: &HcmY) -> hcm::HttpConnectionManager {
    let codec = m.codec_type.as_deref().map_or(0, |name| {
        hcm::http_connection_manager::CodecType::from_str_name(name)
            .unwrap_or_else(|| panic!("codec_type: no `{name}`")) as i32
    });
    let filters: Vec<hcm::HttpFilter> = m.http_filters.iter().map(|f| http_filter(f).0).collect();
    assert_eq!(
        m.http_filters.last().map(|f| f.name.as_str()),
        Some("envoy.filters.http.router"),
        "the router must be the last HTTP filter"
    );
    let virtual_hosts = m
        .route_config
        .virtual_hosts
        .iter()
        .map(|v| route::VirtualHost {
            name: v.name.clone(),
            domains: v.domains.clone(),
            rate_limits: v.rate_limits.iter().map(rate_limit_entry).collect(),
            routes: v
                .routes
                .iter()
                .map(|r| route::Route {
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
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    hcm::HttpConnectionManager {
        stat_prefix: m.stat_prefix.clone(),
        codec_type: codec,
        use_remote_address: m.use_remote_address.map(|value| wkt::BoolValue { value }),
        xff_num_trusted_hops: m.xff_num_trusted_hops.unwrap_or(0),
        http_filters: filters,
        route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::RouteConfig(
            route::RouteConfiguration {
                name: m.route_config.name.clone(),
                virtual_hosts,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

/// Unpacks what matters for rate limiting from a built bootstrap, through the encoded `Any`s.
fn rate_limiting(built: &bootstrap::Bootstrap) -> EnvoyRateLimiting {
    let resources = built.static_resources.as_ref().expect("static_resources");
    let mut found = Vec::new();
    for l in &resources.listeners {
        for chain in &l.filter_chains {
            for f in &chain.filters {
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
                        Some(hcm::http_filter::ConfigType::TypedConfig(any)) => Some(
                            rl_filter::RateLimit::decode(any.value.as_slice()).expect("RateLimit"),
                        ),
                        _ => None,
                    })
                    .expect("the rate limit filter");
                let Some(hcm::http_connection_manager::RouteSpecifier::RouteConfig(routes)) =
                    &manager.route_specifier
                else {
                    panic!("an inline route_config");
                };
                let mut carriers: Vec<Vec<route::RateLimit>> = Vec::new();
                for v in &routes.virtual_hosts {
                    if !v.rate_limits.is_empty() {
                        carriers.push(v.rate_limits.clone());
                    }
                    for r in &v.routes {
                        if let Some(route::route::Action::Route(action)) = &r.action
                            && !action.rate_limits.is_empty()
                        {
                            carriers.push(action.rate_limits.clone());
                        }
                    }
                }
                assert_eq!(
                    carriers.len(),
                    1,
                    "all rate_limits on one virtual host or route, so they go in one request"
                );
                found.push(EnvoyRateLimiting {
                    filter,
                    entries: carriers.pop().expect("one"),
                    use_remote_address: manager.use_remote_address.is_some_and(|b| b.value),
                });
            }
        }
    }
    assert_eq!(
        found.len(),
        1,
        "one HTTP connection manager with rate limiting"
    );
    found.pop().expect("one")
}

// === Envoy: the descriptors it sends =============================================================

/// A request as the rate limit filter sees it.
struct Sample<'a> {
    client: &'a str,
    path: &'a str,
    headers: &'a [(&'a str, &'a str)],
}

impl Sample<'_> {
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
    let value = request.header(&m.name);
    let matched = match (&m.header_match_specifier, value) {
        (None, v) => v.is_some(),
        (Some(HeaderMatchSpecifier::PresentMatch(present)), v) => v.is_some() == *present,
        (Some(HeaderMatchSpecifier::StringMatch(s)), Some(v)) => {
            let (v, fold) = if s.ignore_case {
                (v.to_ascii_lowercase(), true)
            } else {
                (v.to_owned(), false)
            };
            let norm = |p: &str| {
                if fold {
                    p.to_ascii_lowercase()
                } else {
                    p.to_owned()
                }
            };
            match &s.match_pattern {
                Some(MatchPattern::Exact(p)) => v == norm(p),
                Some(MatchPattern::Prefix(p)) => v.starts_with(&norm(p)),
                Some(MatchPattern::Suffix(p)) => v.ends_with(&norm(p)),
                Some(MatchPattern::Contains(p)) => v.contains(&norm(p)),
                other => panic!("string match {other:?} is not modelled"),
            }
        }
        (Some(HeaderMatchSpecifier::StringMatch(_)), None) => false,
        (other, _) => panic!("header match {other:?} is not modelled"),
    };
    matched != m.invert_match
}

/// The descriptors Envoy sends for `request` (rate_limit_filter.rst): one per entry of the
/// filter's stage; an entry whose action cannot produce its value is dropped whole.
fn envoy_descriptors(rl: &EnvoyRateLimiting, request: &Sample<'_>) -> Vec<Vec<(String, String)>> {
    use route::rate_limit::action::ActionSpecifier;
    let mut descriptors = Vec::new();
    'entries: for entry in &rl.entries {
        if entry.stage.as_ref().map_or(0, |s| s.value) != rl.filter.stage {
            continue;
        }
        let mut entries = Vec::new();
        for action in &entry.actions {
            let pair = match action.action_specifier.as_ref().expect("an action") {
                ActionSpecifier::RemoteAddress(_) => {
                    ("remote_address".to_owned(), request.client.to_owned())
                }
                ActionSpecifier::RequestHeaders(h) => match request.header(&h.header_name) {
                    Some(v) => (h.descriptor_key.clone(), v.to_owned()),
                    None if h.skip_if_absent => continue,
                    None => continue 'entries,
                },
                ActionSpecifier::HeaderValueMatch(m) => {
                    let all = m.headers.iter().all(|h| header_matches(h, request));
                    if all != m.expect_match.as_ref().is_none_or(|b| b.value) {
                        continue 'entries;
                    }
                    let key = if m.descriptor_key.is_empty() {
                        "header_match".to_owned()
                    } else {
                        m.descriptor_key.clone()
                    };
                    (key, m.descriptor_value.clone())
                }
                ActionSpecifier::GenericKey(g) => {
                    let key = if g.descriptor_key.is_empty() {
                        "generic_key".to_owned()
                    } else {
                        g.descriptor_key.clone()
                    };
                    (key, g.descriptor_value.clone())
                }
                other => panic!("action {other:?} is not modelled by tests/it/deploy.rs"),
            };
            entries.push(pair);
        }
        if !entries.is_empty() {
            descriptors.push(entries);
        }
    }
    descriptors
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

/// Checks an Envoy rate limit setup against the example config: domain, stage, and that every
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
        for path in PATHS {
            for plan in PLANS {
                let headers = [("x-plan", plan), ("x-api-key", "k-test")];
                let request = Sample {
                    client: "203.0.113.7",
                    path,
                    headers: &headers,
                };
                let one = EnvoyRateLimiting {
                    filter: rl.filter.clone(),
                    entries: vec![entry.clone()],
                    use_remote_address: rl.use_remote_address,
                };
                for descriptor in envoy_descriptors(&one, &request) {
                    produced = true;
                    reached.insert(limited_node(&domain, &descriptor).path.clone());
                }
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
    let search = Sample {
        client: "198.51.100.4",
        path: "/search?q=envoy",
        headers: &headers,
    };
    let expected = vec![
        pairs(&[("remote_address", "198.51.100.4")]),
        pairs(&[("plan", "free"), ("api_key", "k-1")]),
        pairs(&[("endpoint", "search"), ("api_key", "k-1")]),
    ];
    assert_eq!(envoy_descriptors(&rl, &search), expected);
    let domain = example_domain();
    let limits: BTreeSet<String> = expected
        .iter()
        .map(|d| limited_node(&domain, d).path.clone())
        .collect();
    assert_eq!(
        limits.len(),
        3,
        "three layers, three different limits: {limits:?}"
    );

    // An export by a pro key, and a plain page: the endpoint layer only where it applies.
    let headers = [("x-plan", "pro"), ("x-api-key", "k-2")];
    let export = Sample {
        client: "198.51.100.5",
        path: "/export",
        headers: &headers,
    };
    assert_eq!(
        envoy_descriptors(&rl, &export)[2],
        pairs(&[("endpoint", "export"), ("api_key", "k-2")])
    );
    let page = Sample {
        client: "198.51.100.5",
        path: "/about",
        headers: &headers,
    };
    assert_eq!(envoy_descriptors(&rl, &page).len(), 2);
    // No key: only the edge layer (the plan and endpoint entries are dropped whole).
    let anonymous = Sample {
        client: "198.51.100.6",
        path: "/search",
        headers: &[],
    };
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
    let service = rl.filter.rate_limit_service.as_ref().expect("service");
    let Some(core::grpc_service::TargetSpecifier::EnvoyGrpc(grpc)) = service
        .grpc_service
        .as_ref()
        .and_then(|g| g.target_specifier.as_ref())
    else {
        panic!("envoy_grpc");
    };
    let resources = built.static_resources.as_ref().expect("resources");
    let rlsd_cluster = resources
        .clusters
        .iter()
        .find(|c| c.name == grpc.cluster_name)
        .unwrap_or_else(|| panic!("no cluster {}", grpc.cluster_name));
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
    assert_eq!(
        y.static_resources.listeners[0]
            .address
            .socket_address
            .port_value,
        10000
    );
    // Every route goes to a defined cluster.
    let clusters: BTreeSet<&str> = resources.clusters.iter().map(|c| c.name.as_str()).collect();
    for l in &y.static_resources.listeners {
        for chain in &l.filter_chains {
            for f in &chain.filters {
                for v in &f.typed_config.route_config.virtual_hosts {
                    for r in &v.routes {
                        assert!(clusters.contains(r.route.cluster.as_str()));
                    }
                }
            }
        }
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
fn type_urls_are_envoys_own() {
    // The names the mirror checks against come from envoy-types itself.
    assert_eq!(
        rl_filter::RateLimit::type_url(),
        "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
    );
    assert_eq!(
        upstream_http::HttpProtocolOptions::full_name(),
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    );
    assert_eq!(
        duration("0.02s"),
        wkt::Duration {
            seconds: 0,
            nanos: 20_000_000
        }
    );
    assert_eq!(
        duration("10s"),
        wkt::Duration {
            seconds: 10,
            nanos: 0
        }
    );
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
    (
        doc.get("apiVersion")
            .and_then(Value::str)
            .unwrap_or_default(),
        doc.get("kind").and_then(Value::str).unwrap_or_default(),
    )
}

fn name(doc: &Value) -> &str {
    doc.at("metadata.name")
        .and_then(Value::str)
        .expect("metadata.name")
}

fn namespace(doc: &Value) -> &str {
    doc.at("metadata.namespace")
        .and_then(Value::str)
        .unwrap_or("default")
}

fn labels(v: Option<&Value>) -> BTreeMap<String, String> {
    v.map(Value::map)
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| (k.clone(), v.text().unwrap_or_default()))
        .collect()
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
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
    deployment
        .at("spec.template.spec.containers")
        .map(Value::seq)
        .unwrap_or_default()
}

fn is_rlsd(container: &Value) -> bool {
    let image = container
        .get("image")
        .and_then(Value::str)
        .unwrap_or_default();
    let repository = image.rsplit('/').next().unwrap_or_default();
    repository == "rlsd" || repository.starts_with("rlsd:") || repository.starts_with("rlsd@")
}

/// The container port a probe or Service names (by number or by name).
fn resolve_port(container_ports: &[Value], port: &Value) -> Option<i64> {
    match port {
        Value::Int(n) => container_ports
            .iter()
            .filter_map(|p| p.get("containerPort").and_then(Value::int))
            .find(|p| p == n),
        Value::Str(name) => container_ports
            .iter()
            .find(|p| p.get("name").and_then(Value::str) == Some(name))
            .and_then(|p| p.get("containerPort").and_then(Value::int)),
        _ => None,
    }
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
        for e in container.get("env").map(Value::seq).unwrap_or_default() {
            let env = e.get("name").and_then(Value::str).expect("env name");
            if !env.starts_with("RLSD_") {
                continue;
            }
            let value = e
                .get("value")
                .and_then(Value::str)
                .unwrap_or_else(|| panic!("{what}: {env} must be a string (quote numbers)"));
            apply_env(&mut values, env, value);
        }
        // `command`, when set, must run `rlsd serve`; otherwise the image's entrypoint does.
        let mut args: Vec<String> = Vec::new();
        if let Some(command) = container.get("command") {
            let command: Vec<String> = command.seq().iter().filter_map(Value::text).collect();
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
        for a in container.get("args").map(Value::seq).unwrap_or_default() {
            args.push(
                a.str()
                    .unwrap_or_else(|| panic!("{what}: arg {a:?} must be a string (quote it)"))
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
                let data = doc.get("data").expect("ConfigMap data");
                assert!(!data.map().is_empty(), "{what}: empty");
                for (key, value) in data.map() {
                    assert!(value.str().is_some(), "{what}: {key} is not a string");
                }
            }
            "PodDisruptionBudget" => {
                let selector = labels(doc.at("spec.selector.matchLabels"));
                let target = docs
                    .iter()
                    .filter(|d| kind(d).1 == "Deployment")
                    .find(|d| selects(&selector, &labels(d.at("spec.template.metadata.labels"))))
                    .unwrap_or_else(|| panic!("{what}: selects no Deployment of the file"));
                let replicas = target.at("spec.replicas").and_then(Value::int).unwrap_or(1);
                let max = doc.at("spec.maxUnavailable").and_then(Value::int);
                let min = doc.at("spec.minAvailable").and_then(Value::int);
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
                let endpoints = doc.at("spec.endpoints").map(Value::seq).unwrap_or_default();
                assert!(!endpoints.is_empty(), "{what}: no endpoints");
                for e in endpoints {
                    assert_eq!(
                        e.get("path").and_then(Value::str),
                        Some("/metrics"),
                        "{what}: path"
                    );
                    assert_eq!(e.get("port").and_then(Value::str), Some("http"), "{what}");
                }
                assert!(!labels(doc.at("spec.selector.matchLabels")).is_empty());
            }
            "EnvoyFilter" => {
                let patches = doc
                    .at("spec.configPatches")
                    .map(Value::seq)
                    .unwrap_or_default();
                assert!(!patches.is_empty(), "{what}: no configPatches");
                for p in patches {
                    let apply = p.get("applyTo").and_then(Value::str).unwrap_or_default();
                    let op = p
                        .at("patch.operation")
                        .and_then(Value::str)
                        .unwrap_or_default();
                    let value = p.at("patch.value").expect("patch.value");
                    match (apply, op) {
                        ("HTTP_FILTER", "INSERT_BEFORE") => {
                            assert_eq!(
                                p.at("match.listener.filterChain.filter.subFilter.name")
                                    .and_then(Value::str),
                                Some("envoy.filters.http.router"),
                                "{what}: insert before the router"
                            );
                            let f: HttpFilterY = value.decode(&what);
                            let (_, rate_limit) = http_filter(&f);
                            assert!(rate_limit.is_some(), "{what}: the rate limit filter");
                        }
                        ("VIRTUAL_HOST", "MERGE") => {
                            let v: VirtualHostPatchY = value.decode(&what);
                            assert!(!v.rate_limits.is_empty(), "{what}: no rate_limits");
                            for entry in &v.rate_limits {
                                let _ = rate_limit_entry(entry).encode_to_vec();
                            }
                        }
                        other => panic!("{what}: patch {other:?} is not modelled"),
                    }
                }
            }
            _ => unreachable!("known kinds"),
        }
    }
}

/// The value of a VIRTUAL_HOST MERGE patch.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VirtualHostPatchY {
    rate_limits: Vec<RateLimitY>,
}

fn check_deployment(what: &str, doc: &Value, docs: &[Value]) {
    let selector = labels(doc.at("spec.selector.matchLabels"));
    let pod_labels = labels(doc.at("spec.template.metadata.labels"));
    assert!(
        selects(&selector, &pod_labels),
        "{what}: selector misses its own pods"
    );
    let pod = doc.at("spec.template.spec").expect("pod spec");
    let pod_non_root = pod.at("securityContext.runAsNonRoot") == Some(&Value::Bool(true));
    let volumes = pod.get("volumes").map(Value::seq).unwrap_or_default();
    assert!(!containers(doc).is_empty(), "{what}: no containers");
    let grace = pod
        .get("terminationGracePeriodSeconds")
        .and_then(Value::int)
        .unwrap_or(30);
    let mut port_names = BTreeSet::new();
    for c in containers(doc) {
        for p in c.get("ports").map(Value::seq).unwrap_or_default() {
            if let Some(port_name) = p.get("name").and_then(Value::str) {
                assert!(
                    port_name.len() <= 15 && is_dns_label(port_name),
                    "{what}: port name {port_name}"
                );
                assert!(
                    port_names.insert(port_name.to_owned()),
                    "{what}: port name {port_name} twice in the pod"
                );
            }
        }
    }
    let mut rlsd_drain: Option<f64> = None;
    let mut other_pre_stop = 0;
    for c in containers(doc) {
        let cname = c.get("name").and_then(Value::str).expect("container name");
        let what = format!("{what}, container {cname}");
        assert!(is_dns_label(cname), "{what}: name");
        let image = c.get("image").and_then(Value::str).unwrap_or_default();
        assert!(
            image.contains(':') && !image.ends_with(":latest"),
            "{what}: pin the image tag"
        );
        // Locked down.
        let sc = c.get("securityContext").expect("securityContext");
        assert!(
            pod_non_root || sc.get("runAsNonRoot") == Some(&Value::Bool(true)),
            "{what}: runAsNonRoot"
        );
        assert_ne!(sc.get("runAsUser").and_then(Value::int), Some(0), "{what}");
        assert_eq!(
            sc.get("readOnlyRootFilesystem"),
            Some(&Value::Bool(true)),
            "{what}"
        );
        assert_eq!(
            sc.get("allowPrivilegeEscalation"),
            Some(&Value::Bool(false)),
            "{what}"
        );
        assert!(
            sc.at("capabilities.drop")
                .map(Value::seq)
                .unwrap_or_default()
                .iter()
                .any(|d| d.str() == Some("ALL")),
            "{what}: drop ALL capabilities"
        );
        // Sized.
        let requests = c.at("resources.requests").expect("resources.requests");
        assert!(requests.get("cpu").is_some(), "{what}: cpu request");
        let request_memory = requests
            .get("memory")
            .and_then(Value::text)
            .expect("memory");
        let limit_memory = c
            .at("resources.limits.memory")
            .and_then(Value::text)
            .unwrap_or_else(|| panic!("{what}: memory limit"));
        assert!(
            bytes(&request_memory) <= bytes(&limit_memory),
            "{what}: memory"
        );
        // Mounts name declared volumes; ConfigMap volumes name ConfigMaps of the file.
        for m in c.get("volumeMounts").map(Value::seq).unwrap_or_default() {
            let vname = m.get("name").and_then(Value::str).expect("mount name");
            let volume = volumes
                .iter()
                .find(|v| v.get("name").and_then(Value::str) == Some(vname))
                .unwrap_or_else(|| panic!("{what}: mount of undeclared volume {vname}"));
            if let Some(cm) = volume.at("configMap.name").and_then(Value::str) {
                assert!(
                    docs.iter()
                        .any(|d| kind(d).1 == "ConfigMap" && name(d) == cm),
                    "{what}: ConfigMap {cm} is not in the file"
                );
                assert!(
                    m.get("subPath").is_none(),
                    "{what}: a subPath ConfigMap mount never sees updates"
                );
            }
        }
        let ports = c.get("ports").map(Value::seq).unwrap_or_default();
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
            if let Some(s) = c.at("lifecycle.preStop.sleep.seconds").and_then(Value::int) {
                other_pre_stop = other_pre_stop.max(s);
            }
            for probe in ["readinessProbe", "livenessProbe"] {
                if let Some(p) = c.get(probe) {
                    let port = p
                        .at("tcpSocket.port")
                        .or_else(|| p.at("httpGet.port"))
                        .or_else(|| p.at("grpc.port"));
                    if let Some(port) = port {
                        assert!(resolve_port(ports, port).is_some(), "{what}: {probe} port");
                    }
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
    let ports = c.get("ports").map(Value::seq).unwrap_or_default();
    let grpc = i64::from(port_of(settings.get("--grpc-addr").expect("grpc addr")));
    let http = i64::from(port_of(settings.get("--http-addr").expect("http addr")));
    assert_eq!(
        grpc,
        i64::from(default_port("--grpc-addr")),
        "{what}: keep 8081"
    );
    assert_eq!(
        http,
        i64::from(default_port("--http-addr")),
        "{what}: keep 8080"
    );
    assert_eq!(
        resolve_port(ports, &Value::Str("grpc".into())),
        Some(grpc),
        "{what}: port grpc"
    );
    assert_eq!(
        resolve_port(ports, &Value::Str("http".into())),
        Some(http),
        "{what}: port http"
    );

    // Probes: /healthcheck, gRPC health for a service rlsd answers, or a TCP connect.
    let redis = settings.get("--redis-url").is_some();
    for probe in ["readinessProbe", "livenessProbe"] {
        let p = c.get(probe).unwrap_or_else(|| panic!("{what}: no {probe}"));
        if let Some(get) = p.get("httpGet") {
            assert_eq!(
                get.get("path").and_then(Value::str),
                Some("/healthcheck"),
                "{what}"
            );
            let port = resolve_port(ports, get.get("port").expect("port"));
            assert_eq!(port, Some(http), "{what}: {probe} on the admin port");
        } else if let Some(g) = p.get("grpc") {
            assert_eq!(
                g.get("port").and_then(Value::int),
                Some(grpc),
                "{what}: {probe}"
            );
            let service = g.get("service").and_then(Value::str).unwrap_or_default();
            assert!(
                ["", "ratelimit"].contains(&service),
                "{what}: {probe} service {service}"
            );
        } else if let Some(t) = p.get("tcpSocket") {
            let port = resolve_port(ports, t.get("port").expect("port"));
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
    let mount = c
        .get("volumeMounts")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .find(|m| m.get("mountPath").and_then(Value::str) == Some(config))
        .unwrap_or_else(|| panic!("{what}: nothing is mounted at --config {config}"));
    assert!(
        mount.get("subPath").is_none(),
        "{what}: mount the directory, not a subPath"
    );
    let vname = mount.get("name").and_then(Value::str).expect("name");
    let volume = pod
        .get("volumes")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .find(|v| v.get("name").and_then(Value::str) == Some(vname))
        .expect("volume");
    assert!(
        volume.at("configMap.items").is_none(),
        "{what}: items would hide new files"
    );
    let cm_name = volume
        .at("configMap.name")
        .and_then(Value::str)
        .unwrap_or_else(|| panic!("{what}: --config is not a ConfigMap"));
    let cm = docs
        .iter()
        .find(|d| kind(d).1 == "ConfigMap" && name(d) == cm_name)
        .expect("ConfigMap");
    let mut domains = BTreeSet::new();
    for (key, text) in cm.get("data").map(Value::map).unwrap_or_default() {
        if !(key.ends_with(".yaml") || key.ends_with(".yml")) {
            continue;
        }
        let text = text.str().expect("string");
        let domain = rlsd::config::load_str(key, text).unwrap_or_else(|errors| {
            panic!(
                "{what}: ConfigMap {cm_name} {key} does not load: {}",
                errors
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        });
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
        let target = docs
            .iter()
            .find(|d| kind(d).1 == "Service" && name(d) == service)
            .unwrap_or_else(|| panic!("{what}: no Service {service} for {url}"));
        assert!(
            target
                .at("spec.ports")
                .map(Value::seq)
                .unwrap_or_default()
                .iter()
                .any(|p| p.get("port").and_then(Value::int) == Some(port)),
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
    let selector = labels(doc.at("spec.selector"));
    let backend = docs
        .iter()
        .filter(|d| kind(d).1 == "Deployment")
        .find(|d| selects(&selector, &labels(d.at("spec.template.metadata.labels"))))
        .unwrap_or_else(|| panic!("{what}: selects no Deployment of the file"));
    let container_ports: Vec<Value> = containers(backend)
        .iter()
        .flat_map(|c| c.get("ports").map(Value::seq).unwrap_or_default())
        .cloned()
        .collect();
    let ports = doc.at("spec.ports").map(Value::seq).unwrap_or_default();
    assert!(!ports.is_empty(), "{what}: no ports");
    for p in ports {
        let port = p.get("port").and_then(Value::int).expect("port");
        let target = p.get("targetPort").cloned().unwrap_or(Value::Int(port));
        assert!(
            resolve_port(&container_ports, &target).is_some(),
            "{what}: targetPort {target:?} is no container port of {}",
            name(backend)
        );
        assert!(
            p.get("name").and_then(Value::str).is_some(),
            "{what}: name every port"
        );
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
            c.get("image")
                .and_then(Value::str)
                .is_some_and(|i| i.starts_with("envoyproxy/envoy"))
        })
        .expect("an Envoy container");
    // Envoy's config file, through its mount, is deploy/envoy.yaml verbatim.
    let args: Vec<String> = envoy
        .get("args")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .filter_map(Value::text)
        .collect();
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
    let mount = envoy
        .get("volumeMounts")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .find(|m| m.get("mountPath").and_then(Value::str) == Some(dir))
        .cloned()
        .expect("Envoy's config directory is mounted");
    let vname = mount.get("name").and_then(Value::str).expect("name");
    let cm_name = deployment
        .at("spec.template.spec.volumes")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .find(|v| v.get("name").and_then(Value::str) == Some(vname))
        .and_then(|v| v.at("configMap.name").and_then(Value::str))
        .expect("a ConfigMap volume")
        .to_owned();
    let cm = docs
        .iter()
        .find(|d| kind(d).1 == "ConfigMap" && name(d) == cm_name)
        .expect("the Envoy ConfigMap");
    let text = cm
        .get("data")
        .and_then(|d| d.get(key))
        .and_then(Value::str)
        .unwrap_or_else(|| panic!("ConfigMap {cm_name} has no {key}"));
    assert_eq!(
        text,
        read("deploy/envoy.yaml"),
        "ConfigMap {cm_name} {key} must be deploy/envoy.yaml verbatim"
    );
    let (y, built) = envoy_bootstrap_text(&format!("{file}: {cm_name}"), text);
    let rl = rate_limiting(&built);

    // Headers from one side only.
    let envoy_headers = rl.filter.enable_x_ratelimit_headers
        == rl_filter::rate_limit::XRateLimitHeadersRfcVersion::DraftVersion03 as i32;
    assert_eq!(
        settings.get("--headers") == Some("off"),
        envoy_headers,
        "{file}: Envoy's enable_x_ratelimit_headers and rlsd's --headers must not both add headers (nor neither)"
    );
    // Envoy's rlsd cluster is this rlsd's gRPC port; its listener is the Envoy container's port.
    let service = rl.filter.rate_limit_service.as_ref().expect("service");
    let Some(core::grpc_service::TargetSpecifier::EnvoyGrpc(grpc)) = service
        .grpc_service
        .as_ref()
        .and_then(|g| g.target_specifier.as_ref())
    else {
        panic!("envoy_grpc");
    };
    let resources = built.static_resources.as_ref().expect("resources");
    let c = resources
        .clusters
        .iter()
        .find(|c| c.name == grpc.cluster_name)
        .expect("cluster");
    let (_, port) = only_endpoint(c);
    assert_eq!(
        port,
        u32::from(port_of(settings.get("--grpc-addr").expect("grpc"))),
        "{file}: Envoy must call the sidecar's gRPC port"
    );
    let listener_port = i64::from(
        y.static_resources.listeners[0]
            .address
            .socket_address
            .port_value,
    );
    let ports = envoy.get("ports").map(Value::seq).unwrap_or_default();
    assert!(
        resolve_port(ports, &Value::Int(listener_port)).is_some(),
        "{file}: the Envoy container must expose its listener port {listener_port}"
    );
}

#[test]
fn istio_filters_point_at_the_standalone_rlsd() {
    let file = "deploy/istio/envoyfilter.yaml";
    let filters = yaml_documents(file);
    let (standalone, _, rlsd) = rlsd_in("deploy/kubernetes/standalone.yaml");
    let settings = RlsdSettings::of(&rlsd, "standalone rlsd");
    let mut filter: Option<rl_filter::RateLimit> = None;
    let mut entries: Vec<route::RateLimit> = Vec::new();
    for doc in &filters {
        for p in doc
            .at("spec.configPatches")
            .map(Value::seq)
            .unwrap_or_default()
        {
            assert_eq!(p.at("match.context").and_then(Value::str), Some("GATEWAY"));
            let value = p.at("patch.value").expect("value");
            match p.get("applyTo").and_then(Value::str) {
                Some("HTTP_FILTER") => {
                    let f: HttpFilterY = value.decode(file);
                    assert!(filter.is_none(), "one rate limit filter");
                    filter = http_filter(&f).1;
                }
                Some("VIRTUAL_HOST") => {
                    let v: VirtualHostPatchY = value.decode(file);
                    entries.extend(v.rate_limits.iter().map(rate_limit_entry));
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let rl = EnvoyRateLimiting {
        filter: filter.expect("an HTTP_FILTER patch"),
        entries,
        use_remote_address: true, // Istio gateways set it.
    };
    check_against_example("deploy/istio/envoyfilter.yaml", &rl);

    // outbound|<port>||<service>.<namespace>.svc.cluster.local is the standalone Service's
    // gRPC port.
    let service = rl.filter.rate_limit_service.as_ref().expect("service");
    let Some(core::grpc_service::TargetSpecifier::EnvoyGrpc(grpc)) = service
        .grpc_service
        .as_ref()
        .and_then(|g| g.target_specifier.as_ref())
    else {
        panic!("envoy_grpc");
    };
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
        .at("spec.ports")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .find(|p| p.get("port").and_then(Value::int) == Some(port))
        .cloned()
        .unwrap_or_else(|| panic!("Service {} has no port {port}", host[0]));
    // Istio picks the protocol from appProtocol, else from the port name's prefix.
    let port_name = svc_port
        .get("name")
        .and_then(Value::str)
        .unwrap_or_default();
    let grpc_port = match svc_port.get("appProtocol").and_then(Value::str) {
        Some(protocol) => ["grpc", "http2", "kubernetes.io/h2c"].contains(&protocol),
        None => port_name == "grpc" || port_name.starts_with("grpc-"),
    };
    assert!(
        grpc_port,
        "Istio must know the Service port is gRPC (HTTP/2)"
    );
    let target = svc_port
        .get("targetPort")
        .cloned()
        .unwrap_or(Value::Int(port));
    assert_eq!(
        resolve_port(
            rlsd.get("ports").map(Value::seq).unwrap_or_default(),
            &target
        ),
        Some(i64::from(port_of(
            settings.get("--grpc-addr").expect("grpc")
        ))),
        "the Service's gRPC port must reach rlsd's --grpc-addr"
    );
    // Headers from one side only.
    let envoy_headers = rl.filter.enable_x_ratelimit_headers
        == rl_filter::rate_limit::XRateLimitHeadersRfcVersion::DraftVersion03 as i32;
    assert_eq!(
        settings.get("--headers") == Some("off"),
        envoy_headers,
        "the gateway's enable_x_ratelimit_headers and rlsd's RLSD_HEADERS must not both add headers"
    );
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
        rlsd.get("env")
            .map(Value::seq)
            .unwrap_or_default()
            .iter()
            .any(|e| e.get("name").and_then(Value::str) == Some("RLSD_REDIS_URL")),
        "the Redis URL comes from RLSD_REDIS_URL"
    );
    assert_eq!(deployment.at("spec.replicas").and_then(Value::int), Some(3));
    assert!(docs.iter().any(|d| kind(d).1 == "PodDisruptionBudget"));

    // The ServiceMonitor selects the rlsd Service, whose `http` port is rlsd's admin port.
    let monitor = &yaml_documents("deploy/prometheus/servicemonitor.yaml")[0];
    let selector = labels(monitor.at("spec.selector.matchLabels"));
    let namespaces: Vec<String> = monitor
        .at("spec.namespaceSelector.matchNames")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .filter_map(Value::text)
        .collect();
    let services: Vec<&Value> = docs
        .iter()
        .filter(|d| kind(d).1 == "Service" && selects(&selector, &labels(d.at("metadata.labels"))))
        .collect();
    assert_eq!(
        services.len(),
        1,
        "the ServiceMonitor selects the rlsd Service only"
    );
    assert!(namespaces.iter().any(|n| n == namespace(services[0])));
    let port_name = monitor
        .at("spec.endpoints")
        .map(Value::seq)
        .and_then(|e| e.first())
        .and_then(|e| e.get("port"))
        .and_then(Value::str)
        .expect("port");
    let svc_port = services[0]
        .at("spec.ports")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .find(|p| p.get("name").and_then(Value::str) == Some(port_name))
        .cloned()
        .expect("the Service port the ServiceMonitor names");
    let target = svc_port.get("targetPort").cloned().expect("targetPort");
    assert_eq!(
        resolve_port(
            rlsd.get("ports").map(Value::seq).unwrap_or_default(),
            &target
        ),
        Some(i64::from(port_of(
            settings.get("--http-addr").expect("http")
        ))),
        "the monitored port must be rlsd's --http-addr"
    );
}

// === Prometheus ==================================================================================

fn check_prometheus_config(file: &str) {
    let doc = &yaml_documents(file)[0];
    let jobs = doc
        .get("scrape_configs")
        .map(Value::seq)
        .unwrap_or_default();
    let job = jobs
        .iter()
        .find(|j| j.get("job_name").and_then(Value::str) == Some("rlsd"))
        .unwrap_or_else(|| panic!("{file}: no job rlsd"));
    assert_eq!(
        job.get("metrics_path").and_then(Value::str),
        Some("/metrics"),
        "{file}"
    );
    let http = default_port("--http-addr").to_string();
    let keeps: Vec<(String, String)> = job
        .get("relabel_configs")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .filter(|r| r.get("action").and_then(Value::str) == Some("keep"))
        .map(|r| {
            let source = r
                .get("source_labels")
                .map(Value::seq)
                .unwrap_or_default()
                .iter()
                .filter_map(Value::text)
                .collect::<Vec<_>>()
                .join(";");
            (
                source,
                r.get("regex").and_then(Value::text).unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        keeps
            .iter()
            .any(
                |(s, r)| (s == "__meta_kubernetes_pod_container_port_number" && *r == http)
                    || (s == "__meta_kubernetes_pod_container_port_name" && r == "http")
            ),
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
            let cname = c.get("name").and_then(Value::str).expect("name");
            assert_eq!(
                cname, regex,
                "{file}: {manifest}'s rlsd container would not be kept"
            );
        }
    }
}

// === Dockerfile ==================================================================================

/// The instructions of deploy/Dockerfile: (INSTRUCTION, rest), continuations joined.
fn dockerfile() -> Vec<(String, String)> {
    let text = read("deploy/Dockerfile");
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if pending.is_empty() && (trimmed.starts_with('#') || trimmed.is_empty()) {
            continue;
        }
        if trimmed.starts_with('#') {
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
    let array: Value = serde_saphyr::from_str(rest).expect("ENTRYPOINT in exec (JSON) form");
    array.seq().iter().filter_map(Value::text).collect()
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
    // The build reads lua/ (embedded) and proto/ (build.rs); both must be copied.
    for needed in ["src", "proto", "lua", "Cargo.lock", "build.rs"] {
        assert!(
            all.iter().any(|(op, r)| op == "COPY"
                && r.split_whitespace()
                    .any(|w| w.trim_end_matches('/') == needed)),
            "{file}: the build needs {needed}"
        );
    }
    let stage = dockerfile_final_stage();
    let base = &stage[0].1;
    let user = stage
        .iter()
        .rfind(|(op, _)| op == "USER")
        .map(|(_, u)| u.clone());
    let non_root = match &user {
        Some(u) => {
            let who = u.split(':').next().unwrap_or_default();
            who != "0" && who != "root"
        }
        None => base.ends_with(":nonroot"),
    };
    assert!(
        non_root,
        "{file}: the runtime stage runs as a non-root user"
    );
    let exposed: BTreeSet<String> = stage
        .iter()
        .filter(|(op, _)| op == "EXPOSE")
        .flat_map(|(_, r)| r.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .collect();
    for port in [default_port("--http-addr"), default_port("--grpc-addr")] {
        assert!(exposed.contains(&port.to_string()), "{file}: EXPOSE {port}");
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
    assert!(
        stage.iter().any(|(op, r)| op == "COPY"
            && r.split_whitespace()
                .last()
                .is_some_and(|d| d.starts_with(config.as_str()))),
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
        Value::Map(entries) => {
            for (k, v) in entries {
                match (k.as_str(), v) {
                    ("expr", Value::Str(e)) => out.push(e.clone()),
                    ("query" | "definition", Value::Str(q)) if q.starts_with("label_values(") => {
                        out.push(q.clone());
                    }
                    _ => expressions(v, out),
                }
            }
        }
        Value::Seq(items) => items.iter().for_each(|i| expressions(i, out)),
        _ => {}
    }
}

/// The metric names a PromQL expression reads: identifiers that are not functions,
/// aggregations, keywords, label names or grouping labels. Strings, `{...}` matchers and
/// `[...]` ranges are skipped.
fn metric_names(expr: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "inf",
        "nan",
    ];
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
                if [
                    "by",
                    "without",
                    "on",
                    "ignoring",
                    "group_left",
                    "group_right",
                ]
                .contains(&lower.as_str())
                {
                    skip_group = true;
                } else if !(is_call || KEYWORDS.contains(&lower.as_str())) {
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
        .at("templating.list")
        .map(Value::seq)
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.get("name").and_then(Value::str))
        .collect();
    let panels = d.get("panels").map(Value::seq).unwrap_or_default();
    assert!(!panels.is_empty(), "{file}: no panels");
    let mut ids = BTreeSet::new();
    for p in panels {
        let title = p.get("title").and_then(Value::str).unwrap_or_default();
        assert!(!title.is_empty(), "{file}: a panel without a title");
        assert!(
            ids.insert(p.get("id").and_then(Value::int).expect("id")),
            "{file}: id"
        );
        assert!(p.get("gridPos").is_some(), "{file}: {title}: gridPos");
        let targets = p.get("targets").map(Value::seq).unwrap_or_default();
        assert!(!targets.is_empty(), "{file}: {title}: no queries");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(refs.insert(t.get("refId").and_then(Value::str).expect("refId")));
            let expr = t.get("expr").and_then(Value::str).expect("expr");
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
        let ds = p
            .at("datasource.uid")
            .and_then(Value::str)
            .unwrap_or_default();
        assert!(
            ds.starts_with("${") && variables.contains(&&ds[2..ds.len() - 1]),
            "{file}: {title}: datasource through a variable, so any Prometheus works"
        );
    }
}

// === A real rlsd =================================================================================

use crate::common::process;

use process::Rlsd;

async fn http_get(addr: SocketAddr, target: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {target} HTTP/1.1\r\nHost: rlsd\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_owned()))
}

/// `rlsd serve` on the example config with `extra` flags, healthy.
async fn start_rlsd(extra: &[&str]) -> Rlsd {
    let config = path(EXAMPLE);
    let args = ["--config".as_ref(), config.as_os_str()]
        .into_iter()
        .chain(extra.iter().map(|arg| arg.as_ref()));
    let rlsd = Rlsd::serve(args.collect::<Vec<&std::ffi::OsStr>>());
    let (status, body) = http_get(rlsd.http, "/healthcheck")
        .await
        .expect("healthcheck");
    assert_eq!((status, body.trim()), (200, "OK"), "{}", rlsd.log());
    rlsd
}

fn descriptor_of(entries: &[(String, String)]) -> rlsd::pb::RateLimitDescriptor {
    rlsd::pb::RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| rlsd::pb::rate_limit_descriptor::Entry {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
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
        let sample = Sample {
            client: client_ip,
            path: "/search",
            headers: &headers,
        };
        rlsd::pb::RateLimitRequest {
            domain: rl.filter.domain.clone(),
            descriptors: envoy_descriptors(&rl, &sample)
                .iter()
                .map(|d| descriptor_of(d))
                .collect(),
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
            if let Some(g) = c.get(probe).and_then(|p| p.get("grpc")) {
                services.insert(g.get("service").and_then(Value::text).unwrap_or_default());
            }
        }
    }
    assert!(!services.is_empty(), "some probe uses gRPC health");
    for service in services {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.clone(),
            })
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
    let mut used = BTreeSet::new();
    for expr in &expressions_found {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "`{expr}` reads no metric");
        for metric in names {
            let known = match types.get(&metric) {
                Some(_) => true,
                None => ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                    metric.strip_suffix(suffix).is_some_and(|base| {
                        types.get(base).map(String::as_str) == Some("histogram")
                            || (*suffix != "_bucket"
                                && types.get(base).map(String::as_str) == Some("summary"))
                    })
                }),
            };
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
    assert_eq!(
        map.at("metadata.namespace").and_then(Value::str),
        Some("envoy-gateway-system")
    );
    let text = map
        .at("data")
        .and_then(|data| data.get("envoy-gateway.yaml"))
        .and_then(Value::str)
        .unwrap_or_else(|| panic!("{file}: no envoy-gateway.yaml"));
    let config: Value = serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{file}: {e}"));
    assert_eq!(
        kind(&config),
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyGateway")
    );
    assert_eq!(
        config.at("provider.type").and_then(Value::str),
        Some("Kubernetes")
    );
    let container = config
        .at("provider.kubernetes.rateLimitDeployment.container")
        .unwrap_or_else(|| panic!("{file}: no rateLimitDeployment.container"));
    assert!(is_rlsd(container), "{file}: the image is not rlsd's");
    // Envoy Gateway sets the command and env itself; a config here would be overridden or clash.
    let keys: Vec<&str> = container.map().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["image"], "{file}: only the image changes");
    assert_eq!(
        config.at("rateLimit.backend.type").and_then(Value::str),
        Some("Redis")
    );
    let url = config
        .at("rateLimit.backend.redis.url")
        .and_then(Value::str)
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
