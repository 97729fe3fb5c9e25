//! envoyproxy/ratelimit's environment variables, read as `rlsd serve` flags.
//!
//! The image ships the binary a second time as `/bin/ratelimit`, the path envoyproxy/ratelimit's
//! image uses, so a Deployment written for that image (Istio's sample: `command:
//! ["/bin/ratelimit"]`, `RUNTIME_ROOT`, `REDIS_URL`, ...) runs rlsd with the same config
//! directory, Redis and ports. A variable that would change what rlsd answers and that it cannot
//! honour stops the start with an error naming it; one that only tunes envoyproxy/ratelimit's
//! own machinery is ignored, and named with the reason in one start-up line ([`IGNORED`]).
//! Every variable of theirs is one or the other: `tests/fixtures/envoyproxy-ratelimit/` holds
//! their list, and a test checks each is read here or in [`IGNORED`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

/// The file name under which the binary reads these variables instead of its arguments.
pub const PROGRAM: &str = "ratelimit";

/// A variable rlsd cannot honour, or cannot read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvError {
    /// Set to something rlsd does not do; running anyway would answer differently.
    #[error("{variable}={value}: {reason}")]
    Unsupported {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What rlsd does instead, or what to use.
        reason: &'static str,
    },
    /// Not a value of the variable's type.
    #[error("{variable}={value}: expected {expected}")]
    Invalid {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
}

/// What the variables say: `rlsd serve` flags, and notes to log once logging is up.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ServeFlags {
    /// Flags for `rlsd serve`, in order.
    pub args: Vec<String>,
    /// Variables read with a caveat, one line each.
    pub notes: Vec<String>,
}

impl ServeFlags {
    /// Appends `--name=value`: one argument, so a value starting with `-` stays a value.
    fn flag(&mut self, name: &str, value: String) {
        self.args.push(format!("--{name}={value}"));
    }
}

/// envoyproxy/ratelimit's variables that tune only its own machinery, which rlsd does not have
/// (or has always on), each group with the reason; named in one line at start when set.
pub const IGNORED: &[(&[&str], &str)] = &[
    (
        &[
            "USE_DOG_STATSD",
            "USE_DOG_STATSD_MOGRIFIERS",
            "STATSD_HOST",
            "STATSD_PORT",
            "STATS_FLUSH_INTERVAL",
        ],
        "rlsd sends no statsd; Prometheus reads its metrics from /metrics when it scrapes",
    ),
    (
        &["EXTRA_TAGS"],
        "rlsd's metrics carry no extra labels; add them in the scrape config",
    ),
    (
        &["LOCAL_CACHE_SIZE_IN_BYTES"],
        "rlsd's over-limit cache is on by default and sized in entries (RLSD_OVER_LIMIT_CACHE)",
    ),
    (
        &["STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT"],
        "rlsd counts none of a denied request's hits (theirs, with this set, still counts the \
         key that went over); charges are recorded either way",
    ),
    (
        &[
            "REDIS_POOL_SIZE",
            "REDIS_POOL_ON_EMPTY_BEHAVIOR",
            "REDIS_PIPELINE_WINDOW",
            "REDIS_PIPELINE_LIMIT",
        ],
        "rlsd keeps one multiplexed Redis connection per serving thread and batches requests \
         itself (RLSD_REDIS_MAX_BATCH, RLSD_REDIS_PIPELINES)",
    ),
    (
        &["REDIS_CLUSTER_PIPELINE_PARALLELISM"],
        "rlsd sends a request's Redis Cluster slots in parallel",
    ),
    (
        &["REDIS_HEALTH_CHECK_ACTIVE_CONNECTION"],
        "rlsd's health always follows Redis (a PING every second)",
    ),
    (
        &[
            "REDIS_STARTUP_INITIAL_INTERVAL",
            "REDIS_STARTUP_MAX_INTERVAL",
            "REDIS_STARTUP_MAX_ELAPSED_TIME",
        ],
        "rlsd starts without waiting for Redis and connects on first use (a Redis Cluster must \
         answer at start)",
    ),
    (
        &[
            "REDIS_PERSECOND_SOCKET_TYPE",
            "REDIS_PERSECOND_TYPE",
            "REDIS_PERSECOND_URL",
            "REDIS_PERSECOND_POOL_SIZE",
            "REDIS_PERSECOND_AUTH",
            "REDIS_PERSECOND_TLS",
            "REDIS_PERSECOND_SENTINEL_AUTH",
            "REDIS_PERSECOND_PIPELINE_WINDOW",
            "REDIS_PERSECOND_PIPELINE_LIMIT",
            "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
            "REDIS_PERSECOND_TIMEOUT",
            "REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR",
        ],
        "REDIS_URL's Redis holds every limit, per-second ones too",
    ),
    (
        &[
            "MEMCACHE_HOST_PORT",
            "MEMCACHE_MAX_IDLE_CONNS",
            "MEMCACHE_SRV",
            "MEMCACHE_SRV_REFRESH",
            "MEMCACHE_TLS",
            "MEMCACHE_TLS_CLIENT_CERT",
            "MEMCACHE_TLS_CLIENT_KEY",
            "MEMCACHE_TLS_CACERT",
            "MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION",
        ],
        "they apply only with BACKEND_TYPE=memcache, which rlsd refuses",
    ),
];

/// Reads envoyproxy/ratelimit's variables through `var` and returns the `rlsd serve` flags that
/// mean the same, with a note naming the [`IGNORED`] ones that are set. An empty variable counts
/// as unset (theirs refuses some empty values; taking the default is the kinder reading).
///
/// # Errors
/// When a variable asks for something rlsd does not do, or has a malformed value.
pub fn serve_flags(var: impl Fn(&str) -> Option<String>) -> Result<ServeFlags, EnvError> {
    let mut flags = mapped_flags(&var)?;
    flags.notes.extend(ignored_note(&var));
    Ok(flags)
}

/// One line naming every [`IGNORED`] variable that is set, each group with its reason.
fn ignored_note(var: &impl Fn(&str) -> Option<String>) -> Option<String> {
    let groups: Vec<String> = IGNORED
        .iter()
        .filter_map(|(variables, reason)| {
            let set: Vec<&str> = variables
                .iter()
                .copied()
                .filter(|variable| var(variable).is_some_and(|value| !value.is_empty()))
                .collect();
            (!set.is_empty()).then(|| format!("{}, because {reason}", set.join(", ")))
        })
        .collect();
    (!groups.is_empty()).then(|| format!("ignored: {}", groups.join("; ")))
}

/// The flags and notes of every variable rlsd reads.
fn mapped_flags(var: &impl Fn(&str) -> Option<String>) -> Result<ServeFlags, EnvError> {
    let get = |name: &str| var(name).filter(|value| !value.is_empty());
    let mut flags = ServeFlags::default();

    // The config directory: RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY.
    let mut config =
        PathBuf::from(get("RUNTIME_ROOT").unwrap_or("/srv/runtime_data/current".into()));
    for part in [
        get("RUNTIME_SUBDIRECTORY"),
        Some(get("RUNTIME_APPDIRECTORY").unwrap_or("config".into())),
    ]
    .into_iter()
    .flatten()
    {
        config.push(part);
    }
    match get("CONFIG_TYPE") {
        None => flags.flag("config", config.display().to_string()),
        Some(kind) if kind.eq_ignore_ascii_case("FILE") => {
            flags.flag("config", config.display().to_string());
        }
        Some(kind) if kind.eq_ignore_ascii_case("GRPC_XDS_SOTW") => xds(&get, &mut flags)?,
        Some(kind) => {
            return Err(invalid("CONFIG_TYPE", &kind, "FILE or GRPC_XDS_SOTW"));
        }
    }
    // rlsd reloads when a config file's content changes, which watching the root or the
    // directory alone both see.
    boolean("RUNTIME_WATCH_ROOT", get("RUNTIME_WATCH_ROOT"))?;
    // goruntime reads dot names unless told not to (its default, and rlsd's
    // `--config-dotfiles`); rlsd reads a ConfigMap's files once either way.
    if !boolean("RUNTIME_IGNOREDOTFILES", get("RUNTIME_IGNOREDOTFILES"))? {
        flags.args.push("--config-dotfiles".into());
    }

    let host_port = |host_variable: &'static str, port: &'static str, default_port: &str| {
        let ip = match get(host_variable) {
            None => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            // rlsd binds addresses, not names; this one name means loopback everywhere.
            Some(name) if name.eq_ignore_ascii_case("localhost") => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Some(host) => host
                .trim_matches(['[', ']'])
                .parse()
                .map_err(|_| invalid(host_variable, &host, "an IP address or localhost"))?,
        };
        let number = get(port).unwrap_or(default_port.into());
        let number: u16 = number
            .parse()
            .map_err(|_| invalid(port, &number, "a port number"))?;
        // Display brackets an IPv6 address before the port.
        Ok(SocketAddr::new(ip, number).to_string())
    };
    flags.flag("http-addr", host_port("HOST", "PORT", "8080")?);
    match get("GRPC_UDS") {
        // Theirs then serves gRPC on the socket alone. rlsd always has a TCP listener too, so
        // it gets a random loopback port, not GRPC_HOST:GRPC_PORT on the network.
        Some(path) => {
            flags.flag("grpc-unix-socket", path);
            flags.flag("grpc-addr", "127.0.0.1:0".into());
            flags.notes.push(
                "GRPC_UDS: gRPC is also served on a random loopback port (rlsd always listens on TCP)"
                    .into(),
            );
        }
        None => flags.flag("grpc-addr", host_port("GRPC_HOST", "GRPC_PORT", "8081")?),
    }

    if let Some(level) = get("LOG_LEVEL") {
        let level = match level.to_ascii_lowercase().as_str() {
            "trace" => "trace",
            "debug" => "debug",
            "info" => "info",
            "warn" | "warning" => "warn",
            "error" | "fatal" | "panic" => "error",
            _ => return Err(invalid("LOG_LEVEL", &level, "debug, info, warn or error")),
        };
        flags.flag("log-level", level.to_owned());
    }
    if let Some(format) = get("LOG_FORMAT") {
        match format.to_ascii_lowercase().as_str() {
            "text" => flags.flag("log-format", "text".into()),
            "json" => flags.flag("log-format", "json".into()),
            _ => return Err(invalid("LOG_FORMAT", &format, "text or json")),
        }
    }

    if boolean("MERGE_DOMAIN_CONFIG", get("MERGE_DOMAIN_CONFIG"))? {
        flags.args.push("--merge-domain-config".into());
    }
    refuse_unless(
        "BACKEND_TYPE",
        get("BACKEND_TYPE"),
        "redis",
        "rlsd keeps state in Redis or in process, not in memcache",
    )?;

    redis(&get, &mut flags)?;

    if let Some(ratio) = get("NEAR_LIMIT_RATIO") {
        if !ratio.parse::<f64>().is_ok_and(|r| (0.0..=1.0).contains(&r)) {
            return Err(invalid("NEAR_LIMIT_RATIO", &ratio, "a number from 0 to 1"));
        }
        flags.flag("near-limit-ratio", ratio);
    }
    if let Some(prefix) = get("CACHE_KEY_PREFIX") {
        flags.flag("key-prefix", prefix);
    }
    // Unset, theirs adds up to 300 s; rlsd adds none unless asked (its keys already expire a
    // second after their window).
    if let Some(seconds) = get("EXPIRATION_JITTER_MAX_SECONDS") {
        match seconds.parse::<u64>() {
            Ok(n) if n <= 86_400 => flags.flag("redis-expiry-jitter-seconds", n.to_string()),
            _ => {
                return Err(invalid(
                    "EXPIRATION_JITTER_MAX_SECONDS",
                    &seconds,
                    "whole seconds from 0 to 86400",
                ));
            }
        }
    }
    // Added upstream after f2fb157 (#1191): rlsd always drops a connection that answers
    // READONLY (a master turned replica) and reconnects; either value is accepted.
    boolean(
        "REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR",
        get("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR"),
    )?;
    for (variable, flag) in [
        ("SHADOW_MODE", "--shadow-mode"),
        ("QUOTA_MODE", "--quota-mode"),
        ("RESPONSE_DYNAMIC_METADATA", "--response-dynamic-metadata"),
    ] {
        if boolean(variable, get(variable))? {
            flags.args.push(flag.into());
        }
    }
    if boolean(
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        get("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED"),
    )? {
        flags
            .args
            .push("--healthy-with-at-least-one-config-loaded".into());
    }
    // envoyproxy/ratelimit adds no headers unless asked, and then only the RateLimit-* set.
    let headers = boolean(
        "LIMIT_RESPONSE_HEADERS_ENABLED",
        get("LIMIT_RESPONSE_HEADERS_ENABLED"),
    )?;
    for (variable, flag) in [
        ("LIMIT_LIMIT_HEADER", "limit-header"),
        ("LIMIT_REMAINING_HEADER", "remaining-header"),
        ("LIMIT_RESET_HEADER", "reset-header"),
    ] {
        if let Some(name) = get(variable) {
            if http::HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).is_err() {
                return Err(invalid(variable, &name, "an HTTP header name"));
            }
            flags.flag(flag, name);
        }
    }
    flags.flag(
        "headers",
        if headers { "ratelimit" } else { "off" }.to_owned(),
    );

    if boolean("GRPC_SERVER_USE_TLS", get("GRPC_SERVER_USE_TLS"))? {
        let (Some(cert), Some(key)) = (get("GRPC_SERVER_TLS_CERT"), get("GRPC_SERVER_TLS_KEY"))
        else {
            return Err(invalid(
                "GRPC_SERVER_USE_TLS",
                "true",
                "GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY set as well",
            ));
        };
        flags.flag("tls-cert", cert);
        flags.flag("tls-key", key);
        if let Some(ca) = get("GRPC_CLIENT_TLS_CACERT") {
            flags.flag("tls-client-ca", ca);
        }
        // Envoy Gateway sets GRPC_SERVER_TLS_CA_CERT to the CA of the server's own certificate
        // (its `ca.crt` beside `tls.crt`); envoyproxy/ratelimit reads no such variable and
        // checks no client certificate with it, so neither does rlsd, and that is no news.
        if let Some(san) = get("GRPC_CLIENT_TLS_SAN") {
            return Err(unsupported(
                "GRPC_CLIENT_TLS_SAN",
                san,
                "rlsd accepts any client certificate its CA signed",
            ));
        }
    }

    // Theirs then sends and serves no metrics at all.
    let stats = !boolean("DISABLE_STATS", get("DISABLE_STATS"))?;
    if !stats {
        flags.notes.push(
            "DISABLE_STATS: no metrics port is opened; /metrics on the HTTP and debug ports \
             still answers"
                .into(),
        );
    }
    for (variable, flag) in [
        ("GRPC_MAX_CONNECTION_AGE", "grpc-max-connection-age-seconds"),
        (
            "GRPC_MAX_CONNECTION_AGE_GRACE",
            "grpc-max-connection-age-grace-seconds",
        ),
    ] {
        if let Some(text) = get(variable) {
            let duration = go_duration(&text)
                .ok_or_else(|| invalid(variable, &text, "a duration such as 24h or 30m"))?;
            flags.flag(flag, duration.as_secs_f64().to_string());
        }
    }

    // Theirs sends statsd unless told not to.
    if stats && (get("USE_STATSD").is_none() || boolean("USE_STATSD", get("USE_STATSD"))?) {
        flags
            .notes
            .push("USE_STATSD: rlsd sends no statsd; Prometheus metrics are on /metrics".into());
    }
    if boolean(
        "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
        get("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS"),
    )? {
        flags.args.push("--latency-milliseconds".into());
    }
    if stats && boolean("USE_PROMETHEUS", get("USE_PROMETHEUS"))? {
        let addr = get("PROMETHEUS_ADDR").unwrap_or(":9090".into());
        let listen = go_listen_addr(&addr)
            .ok_or_else(|| invalid("PROMETHEUS_ADDR", &addr, "[IP]:port, such as :9090"))?;
        flags.flag("metrics-addr", listen.to_string());
        if let Some(path) = get("PROMETHEUS_PATH") {
            if !path.starts_with('/') {
                return Err(invalid("PROMETHEUS_PATH", &path, "a path starting with /"));
            }
            flags.flag("metrics-path", path);
        }
        if get("PROMETHEUS_MAPPER_YAML").is_some() {
            flags.notes.push(
                "PROMETHEUS_MAPPER_YAML: not read; rlsd's metrics are native Prometheus, named \
                 ratelimit_service_* as the default mapping names envoyproxy/ratelimit's"
                    .into(),
            );
        }
    }
    tracing(&get, &mut flags)?;
    // Theirs always opens its debug port; ours serves /rlconfig and /metrics there.
    flags.flag("debug-addr", host_port("DEBUG_HOST", "DEBUG_PORT", "6070")?);
    Ok(flags)
}

/// TRACING_* and OTEL_EXPORTER_OTLP_ENDPOINT as `--tracing` and its flags; with tracing off,
/// the others are not read (nor are they by envoyproxy/ratelimit).
fn tracing(get: &impl Fn(&str) -> Option<String>, flags: &mut ServeFlags) -> Result<(), EnvError> {
    if !boolean("TRACING_ENABLED", get("TRACING_ENABLED"))? {
        return Ok(());
    }
    flags.args.push("--tracing".into());
    for (variable, flag) in [
        ("TRACING_SERVICE_NAME", "tracing-service-name"),
        ("TRACING_SERVICE_NAMESPACE", "tracing-service-namespace"),
        ("TRACING_SERVICE_INSTANCE_ID", "tracing-service-instance-id"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "otlp-endpoint"),
    ] {
        if let Some(value) = get(variable) {
            flags.flag(flag, value);
        }
    }
    if let Some(rate) = get("TRACING_SAMPLING_RATE") {
        if !rate.parse::<f64>().is_ok_and(|r| (0.0..=1.0).contains(&r)) {
            return Err(invalid(
                "TRACING_SAMPLING_RATE",
                &rate,
                "a number from 0 to 1",
            ));
        }
        flags.flag("tracing-sampling-rate", rate);
    }
    match get("TRACING_EXPORTER_PROTOCOL") {
        None => {}
        Some(protocol) if protocol.eq_ignore_ascii_case("http") => {
            flags.flag("otlp-protocol", "http".into());
        }
        Some(protocol) if protocol.eq_ignore_ascii_case("grpc") => {
            flags.flag("otlp-protocol", "grpc".into());
        }
        Some(protocol) => {
            return Err(invalid(
                "TRACING_EXPORTER_PROTOCOL",
                &protocol,
                "http or grpc",
            ));
        }
    }
    if get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some() {
        flags.notes.push(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: not read; spans go to OTEL_EXPORTER_OTLP_ENDPOINT"
                .into(),
        );
    }
    Ok(())
}

/// CONFIG_GRPC_XDS_* as `--config-xds` and the `--xds-*` flags.
fn xds(get: &impl Fn(&str) -> Option<String>, flags: &mut ServeFlags) -> Result<(), EnvError> {
    flags.flag(
        "config-xds",
        get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or("localhost:18000".into()),
    );
    // envoyproxy/ratelimit's default node id, which a control plane may key its snapshot on.
    let node_id = get("CONFIG_GRPC_XDS_NODE_ID").unwrap_or("default".into());
    flags.flag("xds-node-id", node_id);
    for (variable, flag) in [
        ("CONFIG_GRPC_XDS_NODE_METADATA", "xds-node-metadata"),
        ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "xds-headers"),
    ] {
        if let Some(pairs) = get(variable) {
            crate::xds::parse_pairs(&pairs)
                .map_err(|_| invalid(variable, &pairs, "key:value pairs, comma-separated"))?;
            flags.flag(flag, pairs);
        }
    }
    let mut duration_flag = |variable: &'static str, flag: &str| -> Result<(), EnvError> {
        if let Some(text) = get(variable) {
            let duration = go_duration(&text)
                .ok_or_else(|| invalid(variable, &text, "a duration such as 3s or 500ms"))?;
            flags.flag(flag, duration.as_millis().to_string());
        }
        Ok(())
    };
    // Theirs retries a connect at one interval and backs off lost streams from another; ours
    // backs off from one: the backoff's when it is set.
    let initial = match get("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL") {
        Some(_) => "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
        None => "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    };
    duration_flag(initial, "xds-retry-interval-ms")?;
    duration_flag("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "xds-retry-max-ms")?;
    let jitter = match get("XDS_CLIENT_BACKOFF_JITTER") {
        Some(value) => boolean("XDS_CLIENT_BACKOFF_JITTER", Some(value))?,
        None => true,
    };
    let variable = "XDS_CLIENT_BACKOFF_RANDOM_FACTOR";
    if let Some(factor) = get(variable) {
        crate::cli::ratio(&factor)
            .map_err(|_| invalid(variable, &factor, "a number from 0 to 1"))?;
        flags.flag("xds-retry-jitter", if jitter { factor } else { "0".into() });
    } else if !jitter {
        flags.flag("xds-retry-jitter", "0".into());
    }
    if boolean(
        "CONFIG_GRPC_XDS_SERVER_USE_TLS",
        get("CONFIG_GRPC_XDS_SERVER_USE_TLS"),
    )? {
        flags.args.push("--xds-tls".into());
        for (variable, flag) in [
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "xds-tls-ca"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "xds-tls-cert"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "xds-tls-key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "xds-tls-san"),
        ] {
            if let Some(value) = get(variable) {
                flags.flag(flag, value);
            }
        }
    }
    let variable = "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES";
    if let Some(bytes) = get(variable) {
        // 0 is gRPC's own default in theirs; rlsd's own default stands then.
        match bytes.parse::<u32>() {
            Ok(0) => {}
            Ok(bytes) => flags.flag("xds-max-message-bytes", bytes.to_string()),
            Err(_) => return Err(invalid(variable, &bytes, "a number of bytes")),
        }
    }
    if boolean(
        "FORCE_START_WITHOUT_INITIAL_CONFIG",
        get("FORCE_START_WITHOUT_INITIAL_CONFIG"),
    )? {
        flags.args.push("--xds-force-start".into());
    }
    Ok(())
}

/// A Go listen address (`:9090`, `0.0.0.0:9090`, `localhost:9090`, `[::1]:9090`).
fn go_listen_addr(text: &str) -> Option<SocketAddr> {
    let (host, port) = text.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let ip = match host.trim_matches(['[', ']']) {
        "" => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        name if name.eq_ignore_ascii_case("localhost") => IpAddr::V4(Ipv4Addr::LOCALHOST),
        address => address.parse().ok()?,
    };
    Some(SocketAddr::new(ip, port))
}

/// A Go `time.Duration` string (`3s`, `1m30s`, `250ms`, `1.5s`).
fn go_duration(text: &str) -> Option<std::time::Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    if rest == "0" {
        return Some(std::time::Duration::ZERO);
    }
    let mut total = 0.0_f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&end| end > 0)?;
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += number * seconds;
        rest = &rest[unit_end..];
    }
    std::time::Duration::try_from_secs_f64(total).ok()
}

/// REDIS_* as `--redis-url` and `--redis-mode`.
fn redis(get: &impl Fn(&str) -> Option<String>, flags: &mut ServeFlags) -> Result<(), EnvError> {
    let tls = boolean("REDIS_TLS", get("REDIS_TLS"))?;
    let scheme = if tls { "rediss" } else { "redis" };
    let socket = get("REDIS_SOCKET_TYPE").unwrap_or("unix".into());
    let url = get("REDIS_URL").unwrap_or("/var/run/nutcracker/ratelimit.sock".into());
    let auth = get("REDIS_AUTH");
    match (get("REDIS_TLS_CLIENT_CERT"), get("REDIS_TLS_CLIENT_KEY")) {
        (None, None) => {}
        (Some(cert), Some(key)) => {
            flags.flag("redis-tls-cert", cert);
            flags.flag("redis-tls-key", key);
        }
        (Some(cert), None) => {
            return Err(invalid(
                "REDIS_TLS_CLIENT_CERT",
                &cert,
                "REDIS_TLS_CLIENT_KEY set as well",
            ));
        }
        (None, Some(key)) => {
            return Err(invalid(
                "REDIS_TLS_CLIENT_KEY",
                &key,
                "REDIS_TLS_CLIENT_CERT set as well",
            ));
        }
    }
    if boolean(
        "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
        get("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"),
    )? {
        return Err(unsupported(
            "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            "true",
            "rlsd always verifies Redis's certificate; give its CA with REDIS_TLS_CACERT",
        ));
    }
    if let Some(ca) = get("REDIS_TLS_CACERT") {
        flags.flag("redis-ca", ca);
    }
    if boolean("REDIS_PERSECOND", get("REDIS_PERSECOND"))? {
        flags.notes.push(
            "REDIS_PERSECOND: per-second limits are kept in REDIS_URL's Redis with the rest".into(),
        );
    }
    if let Some(text) = get("REDIS_TIMEOUT") {
        let timeout = go_duration(&text)
            .ok_or_else(|| invalid("REDIS_TIMEOUT", &text, "a duration such as 10s or 50ms"))?;
        if timeout.is_zero() {
            // Theirs then waits without end; rlsd always bounds a Redis call.
            flags
                .notes
                .push("REDIS_TIMEOUT=0 (no timeout): rlsd keeps its Redis command timeout".into());
        } else {
            let ms = timeout.as_micros().div_ceil(1000).max(1);
            flags.flag("redis-command-timeout-ms", ms.to_string());
        }
    }
    let userinfo = auth.as_deref().map(userinfo).unwrap_or_default();
    let kind = get("REDIS_TYPE").unwrap_or("SINGLE".into());
    // A REDIS_URL with a scheme is a URL already (theirs accepts those too).
    let with_scheme = |node: &str| {
        if node.contains("://") {
            node.to_owned()
        } else {
            format!("{scheme}://{userinfo}{node}")
        }
    };
    let kind = kind.to_ascii_uppercase();
    let socket = socket.to_ascii_lowercase();
    match (kind.as_str(), socket.as_str()) {
        ("SINGLE", "tcp") => flags.flag("redis-url", with_scheme(&url)),
        ("SINGLE", "unix") => {
            if tls {
                return Err(invalid(
                    "REDIS_TLS",
                    "true",
                    "false with REDIS_SOCKET_TYPE=unix",
                ));
            }
            let query = match auth.as_deref().map(|auth| auth.split_once(':')) {
                None => String::new(),
                Some(None) => format!("?pass={}", encode(auth.as_deref().unwrap_or_default())),
                Some(Some((user, pass))) => format!("?user={}&pass={}", encode(user), encode(pass)),
            };
            flags.flag(
                "redis-url",
                format!("redis+unix://{}{query}", encode_path(&url)),
            );
        }
        // Theirs dials TCP for a cluster or Sentinel whatever REDIS_SOCKET_TYPE says.
        ("CLUSTER", _) => {
            let nodes: Vec<String> = url
                .split(',')
                .map(str::trim)
                .filter(|node| !node.is_empty())
                .map(with_scheme)
                .collect();
            flags.flag("redis-mode", "cluster".into());
            flags.flag("redis-url", nodes.join(","));
        }
        ("SENTINEL", _) => {
            if tls {
                // Theirs speaks TLS to the master and plain TCP to the Sentinels; rlsd's
                // Sentinel link cannot yet be told that.
                return Err(unsupported(
                    "REDIS_TLS",
                    "true",
                    "rlsd reaches a Sentinel-managed master without TLS",
                ));
            }
            for (variable, value) in [
                ("REDIS_AUTH", auth.as_deref()),
                ("REDIS_SENTINEL_AUTH", get("REDIS_SENTINEL_AUTH").as_deref()),
            ] {
                if value.is_some() {
                    // A password stays out of the logs.
                    return Err(unsupported(
                        variable,
                        "(set)",
                        "rlsd reaches Sentinel without passwords",
                    ));
                }
            }
            let mut parts = url
                .split(',')
                .map(str::trim)
                .filter(|part| !part.is_empty());
            let master = parts.next().unwrap_or_default().to_owned();
            let sentinels: Vec<String> = parts.map(with_scheme).collect();
            if master.is_empty() || sentinels.is_empty() {
                // A URL with userinfo holds a password, which stays out of the logs.
                let shown = if url.contains('@') { "(hidden)" } else { &url };
                return Err(invalid(
                    "REDIS_URL",
                    shown,
                    "<master name>,<sentinel host:port>[,...] with REDIS_TYPE=SENTINEL",
                ));
            }
            flags.flag("redis-mode", "sentinel".into());
            flags.flag("redis-master-name", master);
            flags.flag("redis-url", sentinels.join(","));
        }
        ("SINGLE", _) => return Err(invalid("REDIS_SOCKET_TYPE", &socket, "tcp or unix")),
        _ => return Err(invalid("REDIS_TYPE", &kind, "SINGLE, CLUSTER or SENTINEL")),
    }
    Ok(())
}

/// The `user:password@` of a URL from REDIS_AUTH (`password` or `user:password`).
fn userinfo(auth: &str) -> String {
    match auth.split_once(':') {
        Some((user, password)) => format!("{}:{}@", encode(user), encode(password)),
        None => format!(":{}@", encode(auth)),
    }
}

/// A socket path for a `redis+unix://` URL: `%`, `?`, `#` and spaces percent-encoded, so the URL
/// parser reads them as part of the path.
fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        match c {
            '%' | '?' | '#' | ' ' => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes all but RFC 3986's unreserved characters, for a URL's userinfo or query.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// A boolean as Go's strconv.ParseBool reads it; unset is false.
fn boolean(variable: &'static str, value: Option<String>) -> Result<bool, EnvError> {
    match value.as_deref() {
        None => Ok(false),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Ok(true),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Ok(false),
        Some(other) => Err(invalid(variable, other, "true or false")),
    }
}

/// Refuses `value` of `variable` unless it is `supported` (case-insensitive) or unset.
fn refuse_unless(
    variable: &'static str,
    value: Option<String>,
    supported: &str,
    reason: &'static str,
) -> Result<(), EnvError> {
    match value {
        Some(value) if !value.eq_ignore_ascii_case(supported) => {
            Err(unsupported(variable, value, reason))
        }
        _ => Ok(()),
    }
}

fn unsupported(variable: &'static str, value: impl Into<String>, reason: &'static str) -> EnvError {
    EnvError::Unsupported {
        variable,
        value: value.into(),
        reason,
    }
}

fn invalid(variable: &'static str, value: &str, expected: &'static str) -> EnvError {
    EnvError::Invalid {
        variable,
        value: value.to_owned(),
        expected,
    }
}

#[cfg(test)]
mod tests;
