//! The deployment files in `deploy/` agree with the binary, with the example config and with
//! each other.
//!
//! - Every file under `deploy/` must be of a kind this test knows ([`Kind`]): a new file cannot
//!   land unchecked.
//! - `deploy/envoy.yaml` and the Istio filters are read with Envoy's own schema (the protos
//!   envoy-types ships), so an unknown field, `@type` or enum name fails as it would in Envoy.
//!   The descriptors Envoy would send are computed from those messages and must land on limits
//!   of `examples/three-layer.yaml`. For `deploy/rlqs/`, the bucket ids Envoy's quota filter
//!   would build must land on the `quota_buckets:` items of `deploy/rlqs/web.yaml` written for
//!   them, and a running rlsd must assign each one.
//! - The Kubernetes manifests are checked against `rlsd serve`'s clap command: flags, `RLSD_*`
//!   variables, default ports, probes, the config mount and what it holds.
//! - Every metric the Grafana dashboard queries must be in the exposition of a real rlsd
//!   process, and every gRPC health service a probe names must answer SERVING there.
//!
//! This module walks the files and reads rlsd's own flags and config; [`envoy`], [`rlqs`],
//! [`kubernetes`], [`image`] and [`grafana`] check each kind.

mod envoy;
mod grafana;
mod image;
mod kubernetes;
mod rlqs;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rlsd::config::{Domain, Level, Node};
use serde_json::Value;

use self::envoy::check_envoy_bootstrap;
use self::grafana::{check_dashboard_shape, dashboard};
use self::image::check_dockerfile;
use self::kubernetes::{check_kubernetes_file, check_prometheus_config};

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
    /// An rlsd config (a file with `domain:`), for an Envoy file beside it.
    RlsdConfig,
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
            } else if has("domain") {
                Kind::RlsdConfig
            } else if has("scrape_configs") {
                Kind::PrometheusConfig
            } else if has("apiVersion") && has("kind") {
                Kind::Kubernetes
            } else {
                panic!(
                    "{relative}: YAML that is neither an Envoy bootstrap, an rlsd config, a Prometheus config nor Kubernetes objects; teach tests/it/deploy/ about it"
                )
            }
        }
        _ => panic!("{relative}: unknown kind of file; teach tests/it/deploy/ to check it"),
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
            Kind::EnvoyBootstrap => check_envoy_bootstrap(file),
            Kind::RlsdConfig => rlqs::check_rlsd_config(file),
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

/// `rlsd serve`'s flags, each with its long name (`--config`), from rlsd's clap command.
fn serve_flags() -> &'static [(String, clap::Arg)] {
    static FLAGS: OnceLock<Vec<(String, clap::Arg)>> = OnceLock::new();
    FLAGS.get_or_init(|| {
        let mut command = <rlsd::cli::Cli as clap::CommandFactory>::command();
        // Building propagates the global flags (`--log-level`) into `serve`.
        command.build();
        let serve = command
            .find_subcommand("serve")
            .expect("a serve subcommand");
        let long = |arg: &clap::Arg| Some((format!("--{}", arg.get_long()?), arg.clone()));
        serve.get_arguments().filter_map(long).collect()
    })
}

fn flag(name: &str) -> &'static clap::Arg {
    let found = serve_flags().iter().find(|(long, _)| long == name);
    &found
        .unwrap_or_else(|| panic!("`rlsd serve` has no {name}"))
        .1
}

fn flag_for_env(env: &str) -> Option<&'static (String, clap::Arg)> {
    let mut flags = serve_flags().iter();
    flags.find(|(_, arg)| arg.get_env().is_some_and(|e| e == env))
}

fn port_of(addr: &str) -> u16 {
    addr.parse::<SocketAddr>()
        .unwrap_or_else(|e| panic!("{addr}: {e}"))
        .port()
}

fn default_port(flag_name: &str) -> u16 {
    let default = flag(flag_name).get_default_values().first();
    let default = default.and_then(|value| value.to_str());
    port_of(default.unwrap_or_else(|| panic!("{flag_name} has no default")))
}

#[test]
fn the_flags_are_read_from_rlsd() {
    assert_eq!(default_port("--grpc-addr"), 8081);
    assert_eq!(default_port("--http-addr"), 8080);
    assert!(
        flag("--config")
            .get_env()
            .is_some_and(|env| env == "RLSD_CONFIG")
    );
    assert!(flag("--config").get_action().takes_values());
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
        for node in nodes.all() {
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
