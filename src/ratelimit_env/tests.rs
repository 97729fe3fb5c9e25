use super::*;

/// `serve_flags` over exactly these variables.
fn read(vars: &[(&str, &str)]) -> Result<ServeFlags, EnvError> {
    serve_flags(|name| {
        vars.iter()
            .find(|(variable, _)| *variable == name)
            .map(|(_, value)| (*value).to_owned())
    })
}

/// The value given to `--name`, if the flags have it.
fn value<'f>(flags: &'f ServeFlags, name: &str) -> Option<&'f str> {
    let flag = format!("--{name}=");
    flags
        .args
        .iter()
        .find_map(|arg| arg.strip_prefix(flag.as_str()))
}

#[test]
fn istio_samples_variables_mean_the_same_config_redis_and_ports() {
    // The env of Istio's samples/ratelimit/rate-limit-service.yaml.
    let flags = read(&[
        ("LOG_LEVEL", "debug"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis.default.svc.cluster.local:6379"),
        ("USE_STATSD", "false"),
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
    ])
    .expect("supported");
    assert_eq!(value(&flags, "config"), Some("/data/ratelimit/config"));
    assert_eq!(
        value(&flags, "redis-url"),
        Some("redis://redis.default.svc.cluster.local:6379")
    );
    assert_eq!(value(&flags, "redis-mode"), None);
    assert_eq!(value(&flags, "grpc-addr"), Some("0.0.0.0:8081"));
    assert_eq!(value(&flags, "http-addr"), Some("0.0.0.0:8080"));
    assert_eq!(value(&flags, "log-level"), Some("debug"));
    // envoyproxy/ratelimit adds no headers unless LIMIT_RESPONSE_HEADERS_ENABLED.
    assert_eq!(value(&flags, "headers"), Some("off"));
    assert!(flags.notes.is_empty(), "{:?}", flags.notes);
}

#[test]
fn unset_variables_take_envoyproxy_ratelimits_defaults() {
    let flags = read(&[]).expect("supported");
    assert_eq!(
        value(&flags, "config"),
        Some("/srv/runtime_data/current/config")
    );
    assert_eq!(
        value(&flags, "redis-url"),
        Some("redis+unix:///var/run/nutcracker/ratelimit.sock")
    );
    assert_eq!(value(&flags, "log-level"), None);
    assert_eq!(value(&flags, "debug-addr"), Some("0.0.0.0:6070"));
    let flags = read(&[("DEBUG_HOST", "127.0.0.1"), ("DEBUG_PORT", "6071")]).expect("supported");
    assert_eq!(value(&flags, "debug-addr"), Some("127.0.0.1:6071"));
    let error = read(&[("DEBUG_PORT", "debug")]).expect_err("not a port");
    assert!(error.to_string().contains("DEBUG_PORT"), "{error}");
}

#[test]
fn dotfiles_and_domain_merging_as_goruntime_and_the_loader_read_them() {
    let has = |vars: &[(&str, &str)], flag: &str| {
        read(vars)
            .expect("supported")
            .args
            .iter()
            .any(|arg| arg == flag)
    };
    // goruntime reads dot names unless RUNTIME_IGNOREDOTFILES=true.
    assert!(has(&[], "--config-dotfiles"));
    assert!(has(
        &[("RUNTIME_IGNOREDOTFILES", "false")],
        "--config-dotfiles"
    ));
    assert!(!has(
        &[("RUNTIME_IGNOREDOTFILES", "true")],
        "--config-dotfiles"
    ));
    assert!(!has(&[], "--merge-domain-config"));
    assert!(has(
        &[("MERGE_DOMAIN_CONFIG", "true")],
        "--merge-domain-config"
    ));
    assert!(!has(
        &[("MERGE_DOMAIN_CONFIG", "false")],
        "--merge-domain-config"
    ));
    // Both reach an xDS config too (resources of one domain merge).
    let xds = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "127.0.0.1:18000"),
        ("MERGE_DOMAIN_CONFIG", "true"),
    ];
    assert!(has(&xds, "--merge-domain-config"));
}

#[test]
fn ports_hosts_and_the_unix_socket() {
    let flags = read(&[
        ("HOST", "127.0.0.1"),
        ("PORT", "9080"),
        ("GRPC_HOST", "::1"),
        ("GRPC_PORT", "9081"),
        ("GRPC_UDS", "/run/rl.sock"),
        ("RUNTIME_APPDIRECTORY", "limits"),
    ])
    .expect("supported");
    assert_eq!(value(&flags, "http-addr"), Some("127.0.0.1:9080"));
    // Theirs serves gRPC on the socket alone: TCP moves to a random loopback port.
    assert_eq!(value(&flags, "grpc-addr"), Some("127.0.0.1:0"));
    assert_eq!(value(&flags, "grpc-unix-socket"), Some("/run/rl.sock"));
    assert_eq!(
        value(&flags, "config"),
        Some("/srv/runtime_data/current/limits")
    );
    // GRPC_UDS, and statsd (on unless USE_STATSD says otherwise).
    assert_eq!(flags.notes.len(), 2, "{:?}", flags.notes);
    let tcp = read(&[
        ("GRPC_HOST", "::1"),
        ("GRPC_PORT", "9081"),
        ("HOST", "localhost"),
    ])
    .expect("supported");
    assert_eq!(value(&tcp, "grpc-addr"), Some("[::1]:9081"));
    assert_eq!(value(&tcp, "http-addr"), Some("127.0.0.1:8080"));
    assert_eq!(
        read(&[("HOST", "ratelimit.example")]),
        Err(EnvError::Invalid {
            variable: "HOST",
            value: "ratelimit.example".into(),
            expected: "an IP address or localhost"
        })
    );
    assert_eq!(
        read(&[("GRPC_PORT", "80a")]),
        Err(EnvError::Invalid {
            variable: "GRPC_PORT",
            value: "80a".into(),
            expected: "a port number"
        })
    );
}

#[test]
fn redis_auth_tls_cluster_and_sentinel() {
    let single = read(&[
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis:6380"),
        ("REDIS_AUTH", "rl:p@ss/word"),
        ("REDIS_TLS", "true"),
        ("REDIS_TLS_CACERT", "/etc/ca.pem"),
    ])
    .expect("supported");
    assert_eq!(
        value(&single, "redis-url"),
        Some("rediss://rl:p%40ss%2Fword@redis:6380")
    );
    assert_eq!(value(&single, "redis-ca"), Some("/etc/ca.pem"));
    let password_only = read(&[
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis:6379"),
        ("REDIS_AUTH", "secret"),
    ])
    .expect("supported");
    assert_eq!(
        value(&password_only, "redis-url"),
        Some("redis://:secret@redis:6379")
    );
    let unix =
        read(&[("REDIS_URL", "/run/redis.sock"), ("REDIS_AUTH", "secret")]).expect("supported");
    assert_eq!(
        value(&unix, "redis-url"),
        Some("redis+unix:///run/redis.sock?pass=secret")
    );
    let odd_path = read(&[("REDIS_URL", "/run/a b?#%.sock")]).expect("supported");
    assert_eq!(
        value(&odd_path, "redis-url"),
        Some("redis+unix:///run/a%20b%3F%23%25.sock")
    );
    // A URL is taken as it is.
    let url = read(&[
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis://:pw@redis:6379/2"),
    ])
    .expect("supported");
    assert_eq!(value(&url, "redis-url"), Some("redis://:pw@redis:6379/2"));
    // Theirs dials TCP for a cluster or Sentinel whatever REDIS_SOCKET_TYPE (unix by default).
    let cluster =
        read(&[("REDIS_TYPE", "cluster"), ("REDIS_URL", "a:7000, b:7001")]).expect("supported");
    assert_eq!(value(&cluster, "redis-mode"), Some("cluster"));
    assert_eq!(
        value(&cluster, "redis-url"),
        Some("redis://a:7000,redis://b:7001")
    );
    let sentinel = read(&[
        ("REDIS_TYPE", "SENTINEL"),
        ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
    ])
    .expect("supported");
    assert_eq!(value(&sentinel, "redis-mode"), Some("sentinel"));
    assert_eq!(value(&sentinel, "redis-master-name"), Some("mymaster"));
    assert_eq!(
        value(&sentinel, "redis-url"),
        Some("redis://s1:26379,redis://s2:26379")
    );
}

#[test]
fn headers_follow_limit_response_headers_enabled() {
    let on = read(&[("LIMIT_RESPONSE_HEADERS_ENABLED", "true")]).expect("supported");
    assert_eq!(value(&on, "headers"), Some("ratelimit"));
    let default_names = read(&[
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "1"),
        ("LIMIT_LIMIT_HEADER", "RateLimit-Limit"),
    ])
    .expect("supported");
    assert_eq!(value(&default_names, "headers"), Some("ratelimit"));
    let custom = read(&[
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("LIMIT_LIMIT_HEADER", "X-Quota"),
        ("LIMIT_REMAINING_HEADER", "X-Left"),
        ("LIMIT_RESET_HEADER", "X-Again"),
    ])
    .expect("supported");
    assert_eq!(value(&custom, "limit-header"), Some("X-Quota"));
    assert_eq!(value(&custom, "remaining-header"), Some("X-Left"));
    assert_eq!(value(&custom, "reset-header"), Some("X-Again"));
    assert!(matches!(
        read(&[("LIMIT_RESET_HEADER", "no spaces")]),
        Err(EnvError::Invalid {
            variable: "LIMIT_RESET_HEADER",
            ..
        })
    ));
}

#[test]
fn expiry_jitter_and_readonly_reconnects_are_read() {
    let flags = read(&[
        ("EXPIRATION_JITTER_MAX_SECONDS", "300"),
        ("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR", "true"),
        ("USE_STATSD", "false"),
    ])
    .expect("supported");
    assert_eq!(value(&flags, "redis-expiry-jitter-seconds"), Some("300"));
    assert!(flags.notes.is_empty(), "{:?}", flags.notes);
    // Unset: none (theirs adds up to 300 s).
    let unset = read(&[]).expect("supported");
    assert_eq!(value(&unset, "redis-expiry-jitter-seconds"), None);
    for (variable, value) in [
        ("EXPIRATION_JITTER_MAX_SECONDS", "-1"),
        ("EXPIRATION_JITTER_MAX_SECONDS", "5m"),
        ("REDIS_CLOSE_CONNECTION_ON_READONLY_ERROR", "sometimes"),
    ] {
        assert!(
            matches!(read(&[(variable, value)]), Err(EnvError::Invalid { variable: v, .. }) if v == variable),
            "{variable}={value}"
        );
    }
}

#[test]
fn tuning_variables_map_to_flags() {
    let flags = read(&[
        ("NEAR_LIMIT_RATIO", "0.9"),
        ("CACHE_KEY_PREFIX", "-edge_"),
        ("SHADOW_MODE", "true"),
        ("LOG_LEVEL", "WARNING"),
        ("LOG_FORMAT", "json"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/tls/cert.pem"),
        ("GRPC_SERVER_TLS_KEY", "/tls/key.pem"),
        ("GRPC_CLIENT_TLS_CACERT", "/tls/ca.pem"),
        ("USE_STATSD", "true"),
        ("REDIS_PERSECOND", "true"),
    ])
    .expect("supported");
    assert_eq!(value(&flags, "near-limit-ratio"), Some("0.9"));
    // One argument each, so a value starting with `-` is not taken for a flag.
    assert!(flags.args.iter().any(|arg| arg == "--key-prefix=-edge_"));
    assert!(flags.args.iter().any(|arg| arg == "--shadow-mode"));
    assert_eq!(value(&flags, "log-level"), Some("warn"));
    assert_eq!(value(&flags, "log-format"), Some("json"));
    assert_eq!(value(&flags, "tls-cert"), Some("/tls/cert.pem"));
    assert_eq!(value(&flags, "tls-key"), Some("/tls/key.pem"));
    assert_eq!(value(&flags, "tls-client-ca"), Some("/tls/ca.pem"));
    assert_eq!(flags.notes.len(), 2, "{:?}", flags.notes);
}

#[test]
fn what_would_change_the_answers_is_refused_by_name() {
    let refused = |vars: &[(&str, &str)]| match read(vars) {
        Err(error @ (EnvError::Unsupported { .. } | EnvError::Invalid { .. })) => error.to_string(),
        Ok(flags) => panic!("{vars:?} accepted: {flags:?}"),
    };
    for (vars, variable) in [
        (&[("CONFIG_TYPE", "GRPC_XDS_DELTA")][..], "CONFIG_TYPE"),
        (
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "soon"),
            ],
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
        ),
        (
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_NODE_METADATA", "no-separator"),
            ],
            "CONFIG_GRPC_XDS_NODE_METADATA",
        ),
        (
            &[("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", "9090")],
            "PROMETHEUS_ADDR",
        ),
        (
            &[("USE_PROMETHEUS", "true"), ("PROMETHEUS_PATH", "metrics")],
            "PROMETHEUS_PATH",
        ),
        (
            &[("REDIS_TLS_CLIENT_KEY", "/k.pem")],
            "REDIS_TLS_CLIENT_KEY",
        ),
        (&[("MERGE_DOMAIN_CONFIG", "maybe")], "MERGE_DOMAIN_CONFIG"),
        (
            &[("RUNTIME_IGNOREDOTFILES", "maybe")],
            "RUNTIME_IGNOREDOTFILES",
        ),
        (&[("BACKEND_TYPE", "memcache")], "BACKEND_TYPE"),
        (
            &[("REDIS_TLS_CLIENT_CERT", "/c.pem")],
            "REDIS_TLS_CLIENT_CERT",
        ),
        (&[("GRPC_SERVER_USE_TLS", "true")], "GRPC_SERVER_USE_TLS"),
        (&[("REDIS_TYPE", "ring")], "REDIS_TYPE"),
        (&[("REDIS_SOCKET_TYPE", "udp")], "REDIS_SOCKET_TYPE"),
        (&[("SHADOW_MODE", "yes")], "SHADOW_MODE"),
        (&[("LOG_LEVEL", "loud")], "LOG_LEVEL"),
        (&[("NEAR_LIMIT_RATIO", "1.5")], "NEAR_LIMIT_RATIO"),
        (
            &[
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", "m,s1:26379"),
                ("REDIS_TLS", "true"),
            ],
            "REDIS_TLS",
        ),
        (
            &[
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "only-a-name"),
            ],
            "REDIS_URL",
        ),
    ] {
        let message = refused(vars);
        assert!(message.starts_with(variable), "{vars:?}: {message}");
    }
    // A Sentinel password is refused without being printed.
    let message = refused(&[
        ("REDIS_TYPE", "SENTINEL"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "m,s1:26379"),
        ("REDIS_AUTH", "hunter2"),
    ]);
    assert!(
        message.starts_with("REDIS_AUTH") && !message.contains("hunter2"),
        "{message}"
    );
    // Empty is unset, as envconfig reads it.
    assert!(read(&[("CONFIG_TYPE", ""), ("SHADOW_MODE", "")]).is_ok());
}

/// The environment Envoy Gateway gives the ratelimit container (its
/// `internal/infrastructure/kubernetes/ratelimit`), with TLS, Redis over TLS and Prometheus on.
const ENVOY_GATEWAY: &[(&str, &str)] = &[
    ("RUNTIME_ROOT", "/data"),
    ("RUNTIME_SUBDIRECTORY", "ratelimit"),
    ("RUNTIME_IGNOREDOTFILES", "true"),
    ("RUNTIME_WATCH_ROOT", "false"),
    ("LOG_LEVEL", "info"),
    ("USE_STATSD", "false"),
    ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
    (
        "CONFIG_GRPC_XDS_SERVER_URL",
        "envoy-gateway.envoy-gateway-system.svc.cluster.local:18001",
    ),
    ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ("REDIS_SOCKET_TYPE", "tcp"),
    ("REDIS_URL", "redis.redis-system.svc.cluster.local:6379"),
    ("REDIS_TLS", "true"),
    ("REDIS_TLS_CLIENT_CERT", "/redis-certs/tls.crt"),
    ("REDIS_TLS_CLIENT_KEY", "/redis-certs/tls.key"),
    ("GRPC_SERVER_USE_TLS", "true"),
    ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
    ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
    ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
    ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
    ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
    ("USE_PROMETHEUS", "true"),
    ("PROMETHEUS_ADDR", ":19001"),
    ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
];

#[test]
fn envoy_gateways_variables_mean_xds_over_tls_redis_over_tls_and_a_metrics_port() {
    let flags = read(ENVOY_GATEWAY).expect("supported");
    assert_eq!(value(&flags, "config"), None);
    assert_eq!(
        value(&flags, "config-xds"),
        Some("envoy-gateway.envoy-gateway-system.svc.cluster.local:18001")
    );
    assert_eq!(value(&flags, "xds-node-id"), Some("envoy-ratelimit"));
    assert!(flags.args.iter().any(|arg| arg == "--xds-tls"));
    assert!(flags.args.iter().any(|arg| arg == "--xds-force-start"));
    assert_eq!(value(&flags, "xds-tls-ca"), Some("/certs/ca.crt"));
    assert_eq!(value(&flags, "xds-tls-cert"), Some("/certs/tls.crt"));
    assert_eq!(value(&flags, "xds-tls-key"), Some("/certs/tls.key"));
    assert_eq!(value(&flags, "tls-cert"), Some("/certs/tls.crt"));
    assert_eq!(value(&flags, "tls-key"), Some("/certs/tls.key"));
    assert_eq!(value(&flags, "tls-client-ca"), None);
    assert_eq!(
        value(&flags, "redis-url"),
        Some("rediss://redis.redis-system.svc.cluster.local:6379")
    );
    assert_eq!(
        value(&flags, "redis-tls-cert"),
        Some("/redis-certs/tls.crt")
    );
    assert_eq!(value(&flags, "redis-tls-key"), Some("/redis-certs/tls.key"));
    assert_eq!(value(&flags, "metrics-addr"), Some("0.0.0.0:19001"));
    assert_eq!(value(&flags, "log-level"), Some("info"));
    // The statsd mapping is noted; the server's own CA (GRPC_SERVER_TLS_CA_CERT, which
    // envoyproxy/ratelimit reads no more than rlsd) is accepted without a word, and checks no
    // client certificate.
    assert_eq!(flags.notes.len(), 1, "{:?}", flags.notes);
    assert!(
        flags.notes[0].starts_with("PROMETHEUS_MAPPER_YAML"),
        "{:?}",
        flags.notes
    );
    assert_eq!(value(&flags, "tls-client-ca"), None);
}

#[test]
fn xds_variables_take_envoyproxy_ratelimits_defaults_and_go_durations() {
    let flags = read(&[("CONFIG_TYPE", "grpc_xds_sotw")]).expect("supported");
    assert_eq!(value(&flags, "config-xds"), Some("localhost:18000"));
    assert_eq!(value(&flags, "xds-node-id"), Some("default"));
    assert_eq!(value(&flags, "xds-retry-jitter"), None);
    assert!(!flags.args.iter().any(|arg| arg.starts_with("--xds-tls")));
    assert!(!flags.args.iter().any(|arg| arg == "--xds-force-start"));

    let flags = read(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "zone:a,team=edge"),
        ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "x-token:abc"),
        ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "1m1.5s"),
        // Without USE_TLS, the TLS files are not used (as by envoyproxy/ratelimit).
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/ca.pem"),
    ])
    .expect("supported");
    assert_eq!(value(&flags, "xds-node-metadata"), Some("zone:a,team=edge"));
    assert_eq!(value(&flags, "xds-headers"), Some("x-token:abc"));
    assert_eq!(value(&flags, "xds-retry-interval-ms"), Some("61500"));
    assert_eq!(value(&flags, "xds-tls-ca"), None);

    // The backoff's own variables: its initial interval wins over the connect retry's.
    let backoff = [
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3s"),
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "10s"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "2m"),
        ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "0.25"),
    ];
    let flags = read(&backoff).expect("supported");
    let retry: Vec<&String> = flags
        .args
        .iter()
        .filter(|a| a.starts_with("--xds-retry"))
        .collect();
    assert_eq!(
        retry,
        [
            "--xds-retry-interval-ms=10000",
            "--xds-retry-max-ms=120000",
            "--xds-retry-jitter=0.25"
        ]
    );
    let flags = read(&[
        backoff[0],
        backoff[4],
        ("XDS_CLIENT_BACKOFF_JITTER", "false"),
    ]);
    assert_eq!(
        value(&flags.expect("supported"), "xds-retry-jitter"),
        Some("0")
    );
    for bad in [
        ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "2"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "1"),
    ] {
        let error = read(&[backoff[0], bad]).expect_err("refused");
        assert!(error.to_string().contains(bad.0), "{error}");
        // Checked even when the jitter is off.
        let off = ("XDS_CLIENT_BACKOFF_JITTER", "false");
        assert!(read(&[backoff[0], off, bad]).is_err(), "{bad:?}");
    }

    for (text, millis) in [
        ("3s", Some(3000)),
        ("250ms", Some(250)),
        ("1h", Some(3_600_000)),
        ("0", Some(0)),
        ("1500us", Some(1)),
        ("", None),
        ("3", None),
        ("s", None),
        ("3x", None),
        ("-1s", None),
    ] {
        assert_eq!(go_duration(text).map(|d| d.as_millis()), millis, "{text:?}");
    }
    for (text, addr) in [
        (":19001", Some("0.0.0.0:19001")),
        ("127.0.0.1:9090", Some("127.0.0.1:9090")),
        ("localhost:9090", Some("127.0.0.1:9090")),
        ("[::1]:9090", Some("[::1]:9090")),
        ("9090", None),
        ("host.example:9090", None),
    ] {
        assert_eq!(
            go_listen_addr(text).map(|a| a.to_string()).as_deref(),
            addr,
            "{text:?}"
        );
    }
}

#[test]
fn tracing_variables_turn_tracing_on_with_envoy_gateways_settings() {
    let flags = read(&[
        ("TRACING_ENABLED", "true"),
        ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
        ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system"),
        ("TRACING_SERVICE_INSTANCE_ID", "envoy-ratelimit-7d9c-x2"),
        ("TRACING_SAMPLING_RATE", "0.5"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://otel-svc.observability:4318",
        ),
    ])
    .expect("supported");
    assert!(flags.args.iter().any(|arg| arg == "--tracing"));
    assert_eq!(
        value(&flags, "tracing-service-name"),
        Some("envoy-ratelimit")
    );
    assert_eq!(
        value(&flags, "tracing-service-namespace"),
        Some("envoy-gateway-system")
    );
    assert_eq!(
        value(&flags, "tracing-service-instance-id"),
        Some("envoy-ratelimit-7d9c-x2")
    );
    assert_eq!(value(&flags, "tracing-sampling-rate"), Some("0.5"));
    assert_eq!(
        value(&flags, "otlp-endpoint"),
        Some("http://otel-svc.observability:4318")
    );
    // envoyproxy/ratelimit's default exporter is OTLP over HTTP, as is rlsd's.
    assert_eq!(value(&flags, "otlp-protocol"), None);
    let grpc = read(&[
        ("TRACING_ENABLED", "true"),
        ("TRACING_EXPORTER_PROTOCOL", "grpc"),
    ])
    .expect("supported");
    assert_eq!(value(&grpc, "otlp-protocol"), Some("grpc"));
}

#[test]
fn tracing_off_reads_no_tracing_variable_and_bad_values_are_named() {
    let off = read(&[
        ("TRACING_ENABLED", "false"),
        ("TRACING_SAMPLING_RATE", "7"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
    ])
    .expect("tracing off");
    assert!(
        off.args
            .iter()
            .all(|arg| !arg.contains("tracing") && !arg.contains("otlp")),
        "{:?}",
        off.args
    );
    for (vars, variable) in [
        (&[("TRACING_ENABLED", "yes")][..], "TRACING_ENABLED"),
        (
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_SAMPLING_RATE", "1.5"),
            ][..],
            "TRACING_SAMPLING_RATE",
        ),
        (
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "zipkin"),
            ][..],
            "TRACING_EXPORTER_PROTOCOL",
        ),
    ] {
        match read(vars) {
            Err(EnvError::Invalid {
                variable: named, ..
            }) => assert_eq!(named, variable),
            other => panic!("{vars:?}: {other:?}"),
        }
    }
}

/// envoyproxy/ratelimit's variables, as `tests/fixtures/envoyproxy-ratelimit/` lists them.
fn upstream_variables() -> Vec<&'static str> {
    include_str!("../../tests/fixtures/envoyproxy-ratelimit/settings-variables.txt")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .collect()
}

/// Every variable [`mapped_flags`] asks for, over environments that reach each branch.
fn variables_read() -> std::collections::BTreeSet<String> {
    let asked = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let environments: &[&[(&str, &str)]] = &[
        &[],
        &[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/c.pem"),
            ("GRPC_SERVER_TLS_KEY", "/k.pem"),
            ("USE_PROMETHEUS", "true"),
            ("TRACING_ENABLED", "true"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
        ],
        &[
            ("REDIS_TYPE", "SENTINEL"),
            ("REDIS_URL", "mymaster,s1:26379"),
        ],
    ];
    for environment in environments {
        let flags = mapped_flags(&|name: &str| {
            asked.borrow_mut().insert(name.to_owned());
            environment
                .iter()
                .find(|(variable, _)| *variable == name)
                .map(|(_, value)| (*value).to_owned())
        });
        assert!(flags.is_ok(), "{environment:?}: {flags:?}");
    }
    asked.into_inner()
}

#[test]
fn every_upstream_variable_is_read_or_ignored_with_a_reason() {
    let upstream = upstream_variables();
    assert!(upstream.len() >= 100, "{} variables", upstream.len());
    let read = variables_read();
    let ignored: Vec<&str> = IGNORED
        .iter()
        .flat_map(|(variables, _)| variables.iter().copied())
        .collect();
    for variable in &upstream {
        let is_read = read.contains(*variable);
        let is_ignored = ignored.contains(variable);
        assert!(
            is_read || is_ignored,
            "{variable}: neither read nor in IGNORED; map it, refuse it, or say why it is ignored"
        );
        assert!(
            !(is_read && is_ignored),
            "{variable}: read, and yet listed in IGNORED"
        );
    }
    for variable in &ignored {
        assert!(
            upstream.contains(variable),
            "{variable}: in IGNORED but not one of envoyproxy/ratelimit's variables"
        );
    }
}

#[test]
fn every_upstream_variable_is_in_the_docs_table() {
    let docs = include_str!("../../docs/cli.md");
    for variable in upstream_variables() {
        assert!(
            docs.contains(&format!("| `{variable}` |")),
            "{variable}: no row in docs/cli.md"
        );
    }
}

#[test]
fn ignored_variables_are_named_in_one_line_with_their_reasons() {
    let flags = read(&[
        ("REDIS_POOL_SIZE", "20"),
        ("REDIS_PIPELINE_WINDOW", "150us"),
        ("LOCAL_CACHE_SIZE_IN_BYTES", "1048576"),
        ("REDIS_STARTUP_MAX_ELAPSED_TIME", "1m"),
        ("MEMCACHE_HOST_PORT", ""),
    ])
    .expect("supported");
    let ignored: Vec<&String> = flags
        .notes
        .iter()
        .filter(|note| note.starts_with("ignored: "))
        .collect();
    assert_eq!(ignored.len(), 1, "{:?}", flags.notes);
    let line = ignored[0];
    for named in [
        "REDIS_POOL_SIZE, REDIS_PIPELINE_WINDOW, because rlsd keeps one multiplexed",
        "LOCAL_CACHE_SIZE_IN_BYTES, because",
        "REDIS_STARTUP_MAX_ELAPSED_TIME, because rlsd starts without waiting for Redis",
    ] {
        assert!(line.contains(named), "{named}: {line}");
    }
    // Empty is unset.
    assert!(!line.contains("MEMCACHE"), "{line}");
    // Nothing set, nothing said.
    let quiet = read(&[("USE_STATSD", "false")]).expect("supported");
    assert!(quiet.notes.is_empty(), "{:?}", quiet.notes);
}

#[test]
fn quota_mode_dynamic_metadata_timeouts_and_stats_map_to_flags() {
    let flags = read(&[
        ("QUOTA_MODE", "true"),
        ("RESPONSE_DYNAMIC_METADATA", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis:6379"),
        ("REDIS_TIMEOUT", "1.5ms"),
        ("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "true"),
        ("RUNTIME_WATCH_ROOT", "true"),
        ("USE_STATSD", "false"),
    ])
    .expect("supported");
    assert!(flags.args.iter().any(|arg| arg == "--quota-mode"));
    assert!(
        flags
            .args
            .iter()
            .any(|arg| arg == "--response-dynamic-metadata")
    );
    assert!(flags.args.iter().any(|arg| arg == "--latency-milliseconds"));
    // Rounded up: a timeout never shrinks to nothing.
    assert_eq!(value(&flags, "redis-command-timeout-ms"), Some("2"));
    assert!(flags.notes.is_empty(), "{:?}", flags.notes);
    // Off by default, as theirs.
    let plain = read(&[]).expect("supported");
    for flag in [
        "--quota-mode",
        "--response-dynamic-metadata",
        "--latency-milliseconds",
    ] {
        assert!(!plain.args.iter().any(|arg| arg == flag), "{flag}");
    }
    assert_eq!(value(&plain, "redis-command-timeout-ms"), None);
    // 0 is no timeout in theirs: rlsd keeps its own, and says so.
    let unbounded = read(&[("REDIS_TIMEOUT", "0")]).expect("supported");
    assert_eq!(value(&unbounded, "redis-command-timeout-ms"), None);
    assert!(
        unbounded
            .notes
            .iter()
            .any(|note| note.starts_with("REDIS_TIMEOUT=0")),
        "{:?}",
        unbounded.notes
    );

    // DISABLE_STATS wins over USE_PROMETHEUS, as in theirs: no metrics port.
    let no_stats = read(&[
        ("DISABLE_STATS", "true"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", ":19001"),
    ])
    .expect("supported");
    assert_eq!(value(&no_stats, "metrics-addr"), None);
    assert_eq!(no_stats.notes.len(), 1, "{:?}", no_stats.notes);
    assert!(no_stats.notes[0].starts_with("DISABLE_STATS"));

    let xds = read(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "4194304"),
    ])
    .expect("supported");
    assert_eq!(value(&xds, "xds-max-message-bytes"), Some("4194304"));
    let default = read(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "0"),
    ])
    .expect("supported");
    assert_eq!(value(&default, "xds-max-message-bytes"), None);

    for (vars, variable) in [
        (&[("QUOTA_MODE", "sometimes")][..], "QUOTA_MODE"),
        (
            &[("RESPONSE_DYNAMIC_METADATA", "yes")],
            "RESPONSE_DYNAMIC_METADATA",
        ),
        (&[("REDIS_TIMEOUT", "10")], "REDIS_TIMEOUT"),
        (&[("DISABLE_STATS", "no")], "DISABLE_STATS"),
        (&[("RUNTIME_WATCH_ROOT", "maybe")], "RUNTIME_WATCH_ROOT"),
        (
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "4MB"),
            ],
            "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
        ),
    ] {
        let error = read(vars).expect_err("malformed");
        assert!(error.to_string().starts_with(variable), "{error}");
    }
}

#[test]
fn connection_age_variables_become_the_age_flags_in_seconds() {
    let flags = read(&[
        ("GRPC_MAX_CONNECTION_AGE", "1h30m"),
        ("GRPC_MAX_CONNECTION_AGE_GRACE", "90s"),
    ])
    .expect("supported");
    assert_eq!(
        value(&flags, "grpc-max-connection-age-seconds"),
        Some("5400")
    );
    assert_eq!(
        value(&flags, "grpc-max-connection-age-grace-seconds"),
        Some("90")
    );
    let command_line = ["rlsd".to_owned(), "serve".to_owned()]
        .into_iter()
        .chain(flags.args.iter().cloned());
    let cli = <crate::cli::Cli as clap::Parser>::try_parse_from(command_line).expect("rlsd flags");
    let crate::cli::Command::Serve(args) = cli.command else {
        panic!("not serve");
    };
    let limits = args.serve_options(None).expect("valid").limits;
    assert_eq!(
        limits.max_connection_age,
        Some(std::time::Duration::from_secs(5400))
    );
    assert_eq!(
        limits.max_connection_age_grace,
        std::time::Duration::from_secs(90)
    );
    assert_eq!(
        read(&[("GRPC_MAX_CONNECTION_AGE", "a day")]),
        Err(invalid(
            "GRPC_MAX_CONNECTION_AGE",
            "a day",
            "a duration such as 24h or 30m"
        ))
    );
}
