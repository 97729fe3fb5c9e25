//! The Kubernetes, Istio, Envoy Gateway and Prometheus manifests, checked against `rlsd serve`'s
//! clap command and against each other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3 as rl_filter;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use serde_json::Value;

use super::envoy::{
    EnvoyRateLimiting, assert_headers_from_one_side, check_against_example, cluster_named,
    envoy_bootstrap_text, envoy_message, only, only_endpoint, rate_limit_filter, rlsd_target,
};
use super::image::{dockerfile, dockerfile_entrypoint, dockerfile_final_stage};
use super::{
    EXAMPLE, Tree, default_port, flag_for_env, is_yaml, load_config, port_of, read, serve_flags,
    yaml_documents,
};

// === Kubernetes ==================================================================================

/// The (apiVersion, kind) pairs the manifests may use.
pub(super) const KNOWN_KINDS: &[(&str, &str)] = &[
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("policy/v1", "PodDisruptionBudget"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
];

pub(super) fn kind(doc: &Value) -> (&str, &str) {
    let api = doc.str("apiVersion").unwrap_or_default();
    (api, doc.str("kind").unwrap_or_default())
}

pub(super) fn name(doc: &Value) -> &str {
    doc.str("metadata.name").expect("metadata.name")
}

pub(super) fn namespace(doc: &Value) -> &str {
    doc.str("metadata.namespace").unwrap_or("default")
}

pub(super) fn labels(v: &Value) -> BTreeMap<String, String> {
    let entries = v.as_object().into_iter().flatten();
    entries
        .map(|(k, v)| (k.clone(), v.text().unwrap_or_default()))
        .collect()
}

pub(super) fn selects(
    selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The object of `docs` of kind `k` named `n`.
pub(super) fn object<'d>(docs: &'d [Value], k: &str, n: &str) -> Option<&'d Value> {
    docs.iter().find(|d| kind(d).1 == k && name(d) == n)
}

/// The Deployment of `docs` whose pods `selector` selects.
pub(super) fn selected_deployment<'d>(
    what: &str,
    docs: &'d [Value],
    selector: &Value,
) -> &'d Value {
    let selector = labels(selector);
    docs.iter()
        .filter(|d| kind(d).1 == "Deployment")
        .find(|d| selects(&selector, &labels(d.at("spec.template.metadata.labels"))))
        .unwrap_or_else(|| panic!("{what}: selects no Deployment of the file"))
}

/// The item of a list (volumes, ports, env) whose `name` is `n`.
pub(super) fn named_item<'v>(list: &'v [Value], n: &str) -> Option<&'v Value> {
    item_where(list, "name", n)
}

pub(super) fn item_where<'v>(list: &'v [Value], key: &str, value: &str) -> Option<&'v Value> {
    list.iter().find(|v| v.str(key) == Some(value))
}

/// The volume of `pod` that container `c` mounts at `dir`.
pub(super) fn mounted_volume<'p>(what: &str, pod: &'p Value, c: &Value, dir: &str) -> &'p Value {
    let mount = item_where(c.seq("volumeMounts"), "mountPath", dir)
        .unwrap_or_else(|| panic!("{what}: nothing is mounted at {dir}"));
    named_item(pod.seq("volumes"), mount.str("name").expect("name")).expect("volume")
}

pub(super) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Bytes in a Kubernetes memory quantity (`64Mi`, `1Gi`, `500M`).
pub(super) fn bytes(quantity: &str) -> u64 {
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

pub(super) fn containers(deployment: &Value) -> &[Value] {
    deployment.seq("spec.template.spec.containers")
}

pub(super) fn is_rlsd(container: &Value) -> bool {
    let image = container.str("image").unwrap_or_default();
    let repository = image.rsplit('/').next().unwrap_or_default();
    repository == "rlsd" || repository.starts_with("rlsd:") || repository.starts_with("rlsd@")
}

/// The container port a probe or Service names (by number or by name).
pub(super) fn resolve_port(container_ports: &[Value], port: &Value) -> Option<i64> {
    match port {
        Value::String(port_name) => named_item(container_ports, port_name)?.int("containerPort"),
        _ => container_ports
            .iter()
            .filter_map(|p| p.int("containerPort"))
            .find(|p| Some(*p) == port.as_i64()),
    }
}

/// A Service port's `targetPort`, which defaults to its `port`.
pub(super) fn target_port(service_port: &Value) -> &Value {
    service_port
        .get("targetPort")
        .unwrap_or(service_port.at("port"))
}

/// The image's defaults, from deploy/Dockerfile's ENV lines.
pub(super) fn image_env() -> BTreeMap<String, String> {
    dockerfile_final_stage()
        .iter()
        .filter(|(op, _)| op == "ENV")
        .filter_map(|(_, rest)| {
            let (k, v) = rest.split_once(['=', ' '])?;
            Some((k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
        })
        .collect()
}

/// The rlsd configs the ConfigMaps hold, by key: each a verbatim copy of a checked file.
pub(super) const CONFIG_COPIES: [(&str, &str); 2] = [
    ("three-layer.yaml", EXAMPLE),
    ("web.yaml", "deploy/rlqs/web.yaml"),
];

/// How one rlsd container is configured, as `rlsd serve`'s own parser reads it: flags after
/// `rlsd serve`, then `RLSD_*` env, then the image's ENV, then the binary's defaults.
pub(super) struct RlsdSettings {
    pub(super) values: BTreeMap<String, String>,
}

impl RlsdSettings {
    pub(super) fn of(container: &Value, what: &str) -> RlsdSettings {
        let mut env: BTreeMap<String, String> = image_env();
        for e in container.seq("env") {
            let name = e.str("name").expect("env name");
            if name.starts_with("RLSD_") {
                assert!(
                    e.get("valueFrom").is_none(),
                    "{what}: {name}: valueFrom is not modelled"
                );
                let value = e.str("value");
                let value = value
                    .unwrap_or_else(|| panic!("{what}: {name} must be a string (quote numbers)"));
                env.insert(name.to_owned(), value.to_owned());
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
            let arg =
                arg.unwrap_or_else(|| panic!("{what}: arg {a:?} must be a string (quote it)"));
            args.push(arg.to_owned());
        }
        // The environment as flags, below the command line's own.
        let given: BTreeSet<&str> = args
            .iter()
            .map(|a| a.split('=').next().unwrap_or(a))
            .collect();
        let mut argv = vec!["rlsd".to_owned(), "serve".to_owned()];
        for (name, value) in env.iter().filter(|(name, _)| name.starts_with("RLSD_")) {
            let Some((flag_name, arg)) = flag_for_env(name) else {
                panic!("{what}: {name} is not a variable of an `rlsd serve` flag");
            };
            if given.contains(flag_name.as_str()) {
                continue;
            }
            match (arg.get_action().takes_values(), value.as_str()) {
                (true, _) => argv.push(format!("{flag_name}={value}")),
                (false, "true") => argv.push(flag_name.clone()),
                (false, "false") => {}
                (false, _) => panic!("{what}: {name}={value}: rlsd reads only true or false"),
            }
        }
        argv.extend(args);
        // The manifest's environment only: clap would read this test's own `RLSD_*` variables.
        let unset = |arg: clap::Arg| arg.env(None::<&'static str>);
        let command = <rlsd::cli::Cli as clap::CommandFactory>::command()
            .mut_args(unset)
            .mut_subcommand("serve", |serve| serve.mut_args(unset));
        let matches = command.clone().try_get_matches_from(&argv);
        let matches = matches.unwrap_or_else(|e| panic!("{what}: rlsd refuses {argv:?}: {e}"));
        let serve = matches.subcommand_matches("serve").expect("serve");
        let mut values = BTreeMap::new();
        for (long, arg) in serve_flags() {
            if let Ok(Some(raw)) = serve.try_get_raw(arg.get_id().as_str()) {
                let raw: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
                values.insert(long.clone(), raw.join(","));
            }
        }
        RlsdSettings { values }
    }

    pub(super) fn get(&self, flag_name: &str) -> Option<&str> {
        self.values.get(flag_name).map(String::as_str)
    }

    pub(super) fn port(&self, flag_name: &str) -> i64 {
        let addr = self.get(flag_name);
        i64::from(port_of(addr.unwrap_or_else(|| panic!("no {flag_name}"))))
    }
}

/// Checks one manifest file: every object is known and well formed on its own and against
/// the other objects of the same file; rlsd containers against the binary.
pub(super) fn check_kubernetes_file(file: &str) {
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
pub(super) fn envoy_filter_patches(
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
                let filter: hcm::HttpFilter = envoy_message(what, value);
                let rate_limit = rate_limit_filter(what, &filter);
                filters.push(rate_limit.unwrap_or_else(|| panic!("{what}: the rate limit filter")));
            }
            ("VIRTUAL_HOST", "MERGE") => {
                let v: route::VirtualHost = envoy_message(what, value);
                assert!(!v.rate_limits.is_empty(), "{what}: no rate_limits");
                only!(what, v, route::VirtualHost { rate_limits });
                entries.extend(v.rate_limits);
            }
            other => panic!("{what}: patch {other:?} is not modelled"),
        }
    }
    (filters, entries)
}

pub(super) fn check_deployment(what: &str, doc: &Value, docs: &[Value]) {
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
pub(super) fn check_rlsd_container(
    what: &str,
    c: &Value,
    pod: &Value,
    docs: &[Value],
) -> (f64, f64) {
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
        let copy = CONFIG_COPIES.iter().find(|(copy, _)| copy == key);
        let (_, file) = copy.unwrap_or_else(|| {
            panic!("{what}: ConfigMap {cm_name} {key} is a copy of no file of the repository")
        });
        assert_eq!(
            text,
            read(file),
            "{what}: ConfigMap {cm_name} {key} must be {file} verbatim"
        );
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

pub(super) fn check_service(what: &str, doc: &Value, docs: &[Value]) {
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
pub(super) fn rlsd_in(file: &str) -> (Vec<Value>, Value, Value) {
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
    let (y, rl) = envoy_bootstrap_text(&format!("{file}: {cm_name}"), text);
    assert_headers_from_one_side(file, &rl.filter, &settings);
    // Envoy's rlsd cluster is this rlsd's gRPC port; its listener is the Envoy container's port.
    let (_, port) = only_endpoint(cluster_named(&y, &rlsd_target(&rl.filter).cluster_name));
    assert_eq!(
        port,
        settings.port("--grpc-addr"),
        "{file}: Envoy must call the sidecar's gRPC port"
    );
    let listener_port = y.seq("static_resources.listeners")[0]
        .int("address.socket_address.port_value")
        .expect("a listener port");
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

pub(super) fn check_prometheus_config(file: &str) {
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
