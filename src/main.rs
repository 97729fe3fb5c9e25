//! The `rlsd` binary: parse the command line, load the config, serve until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use clap::{Parser, Subcommand};
use rlsd::config;
use rlsd::engine::KeySettings;

use rlsd::metrics::{DEFAULT_NEAR_LIMIT_RATIO, Metrics};
use rlsd::reload::Reloader;
use rlsd::server::{self, Listeners, ServeOptions};
use rlsd::service::{FailureMode, HeaderStyle, RateLimiter, RequestLimits, ServiceSettings};
use rlsd::store::memory::DEFAULT_MAX_KEYS;
use rlsd::store::redis::SentinelTarget;
use rlsd::store::{
    ClientIdentity, ClusterSettings, ClusterStore, MemoryStore, OverLimitCache, RedisSettings,
    RedisStore, Store,
};
use rlsd::telemetry::{OtlpProtocol, Telemetry, TracingSettings};
use rlsd::tls::{TlsFiles, TlsSettings};
use rlsd::xds::{XdsClient, XdsSettings, XdsTls};

/// mimalloc instead of glibc's malloc: a request allocates dozens of short-lived strings
/// (protobuf decoding, keys, the response), and callgrind counts malloc and free as about a
/// fifth of rlsd's instructions per request under glibc (`cargo bench --bench instructions`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A rate limit service for Envoy.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Log level (`error`, `warn`, `info`, `debug`, `trace`); `RLSD_LOG` takes a full filter.
    #[arg(long, global = true, env = "RLSD_LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Log format.
    #[arg(long, global = true, env = "RLSD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// Which Redis topology `--redis-url` names.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RedisMode {
    /// One Redis server.
    Single,
    /// A Redis Cluster, reached through seed nodes.
    Cluster,
    /// The master Redis Sentinel names, followed through failovers; `--redis-url` lists the
    /// Sentinels.
    Sentinel,
}

/// How log lines are written to stderr.
#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve Envoy's RateLimitService over gRPC.
    Serve(Box<ServeArgs>),
    /// Validate a config, print the limits it defines, exit 1 on errors.
    Check {
        /// A YAML file, or a directory of `*.yaml` files (one domain each).
        #[arg(long, env = "RLSD_CONFIG")]
        config: PathBuf,
    },
    /// Replay traffic against a descriptor's limit under each algorithm; print a table, draw an SVG.
    Simulate(rlsd::simulate::Args),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A YAML file, or a directory of `*.yaml` files (one domain each).
    #[arg(
        long,
        env = "RLSD_CONFIG",
        required_unless_present = "config_xds",
        conflicts_with = "config_xds"
    )]
    config: Option<PathBuf>,
    /// Take the config from this xDS management server instead (`host:port`, `http://` or
    /// `https://`), as Envoy Gateway pushes it: ADS state of the world, `RateLimitConfig`.
    #[arg(long, env = "RLSD_CONFIG_XDS", value_name = "ADDR")]
    config_xds: Option<String>,
    /// `node.id` sent to the xDS server.
    #[arg(
        long,
        env = "RLSD_XDS_NODE_ID",
        default_value = "rlsd",
        requires = "config_xds"
    )]
    xds_node_id: String,
    /// `node.metadata` sent to the xDS server: `k1:v1,k2=v2`.
    #[arg(long, env = "RLSD_XDS_NODE_METADATA", value_name = "PAIRS", value_parser = pairs, requires = "config_xds")]
    xds_node_metadata: Option<Pairs>,
    /// Extra gRPC metadata on the xDS stream: `k1:v1,k2=v2`.
    #[arg(long, env = "RLSD_XDS_HEADERS", value_name = "PAIRS", value_parser = pairs, requires = "config_xds")]
    xds_headers: Option<Pairs>,
    /// Wait after a lost xDS stream before reconnecting, in milliseconds.
    #[arg(long, env = "RLSD_XDS_RETRY_INTERVAL_MS", default_value_t = 3000)]
    xds_retry_interval_ms: u64,
    /// Connect to the xDS server over TLS.
    #[arg(long, env = "RLSD_XDS_TLS", requires = "config_xds")]
    xds_tls: bool,
    /// PEM CA certificates that sign the xDS server's certificate (default: public roots).
    #[arg(
        long,
        env = "RLSD_XDS_TLS_CA",
        value_name = "PATH",
        requires = "xds_tls"
    )]
    xds_tls_ca: Option<PathBuf>,
    /// PEM client certificate for the xDS server (mutual TLS; with `--xds-tls-key`).
    #[arg(long, env = "RLSD_XDS_TLS_CERT", value_name = "PATH", requires_all = ["xds_tls", "xds_tls_key"])]
    xds_tls_cert: Option<PathBuf>,
    /// The PEM key of `--xds-tls-cert`.
    #[arg(long, env = "RLSD_XDS_TLS_KEY", value_name = "PATH", requires_all = ["xds_tls", "xds_tls_cert"])]
    xds_tls_key: Option<PathBuf>,
    /// The name the xDS server's certificate must carry (default: the address's host).
    #[arg(
        long,
        env = "RLSD_XDS_TLS_SAN",
        value_name = "NAME",
        requires = "xds_tls"
    )]
    xds_tls_san: Option<String>,
    /// With `--config-xds`: serve at once, every domain unknown, instead of waiting for the
    /// first config to arrive before opening any port.
    #[arg(long, env = "RLSD_XDS_FORCE_START", requires = "config_xds")]
    xds_force_start: bool,
    /// gRPC listen address (Envoy's `rate_limit_service`).
    #[arg(long, env = "RLSD_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Admin HTTP listen address (`/healthcheck`, `/metrics`, `/rlconfig`, `/json`).
    #[arg(long, env = "RLSD_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Also serve the metrics, and only them, on this address (a port Prometheus scrapes).
    #[arg(long, env = "RLSD_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// The path of the metrics on `--metrics-addr`.
    #[arg(
        long,
        env = "RLSD_METRICS_PATH",
        default_value = "/metrics",
        value_parser = url_path,
        requires = "metrics_addr"
    )]
    metrics_path: String,
    /// Trace every ShouldRateLimit call with OpenTelemetry, exported over OTLP: a server span,
    /// child of the `traceparent` or B3 context Envoy sends, with the store call as its child.
    #[arg(long, env = "RLSD_TRACING")]
    tracing: bool,
    /// `service.name` of the exported spans.
    #[arg(long, env = "RLSD_TRACING_SERVICE_NAME", default_value = "RateLimit")]
    tracing_service_name: String,
    /// `service.namespace` of the exported spans (none when empty).
    #[arg(long, env = "RLSD_TRACING_SERVICE_NAMESPACE", default_value = "")]
    tracing_service_namespace: String,
    /// `service.instance.id` of the exported spans (none when empty).
    #[arg(long, env = "RLSD_TRACING_SERVICE_INSTANCE_ID", default_value = "")]
    tracing_service_instance_id: String,
    /// Share of new traces sampled, 0 to 1; a caller's sampling decision is always followed.
    #[arg(long, env = "RLSD_TRACING_SAMPLING_RATE", default_value_t = 1.0)]
    tracing_sampling_rate: f64,
    /// The OTLP collector (`http://host:port`; with `http`, spans go to `<endpoint>/v1/traces`);
    /// default: localhost on 4318 (`http`) or 4317 (`grpc`).
    #[arg(long, env = "RLSD_OTLP_ENDPOINT", value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// OTLP over `http` (protobuf bodies) or `grpc`.
    #[arg(long, env = "RLSD_OTLP_PROTOCOL", value_enum, default_value_t = OtlpProtocol::Http)]
    otlp_protocol: OtlpProtocol,
    /// Also serve gRPC, plaintext, on this Unix domain socket (for an Envoy on the same host or
    /// in the same pod: its cluster address is then `pipe: {path: ...}`).
    #[arg(long, env = "RLSD_GRPC_UNIX_SOCKET", value_name = "PATH")]
    grpc_unix_socket: Option<PathBuf>,
    /// Permissions of the socket file, in octal (connecting needs write permission).
    #[arg(long, env = "RLSD_GRPC_UNIX_SOCKET_MODE", value_name = "OCTAL", default_value = "660", value_parser = octal_mode)]
    grpc_unix_socket_mode: u32,
    /// Most keys the in-process store holds; requests needing more get UNAVAILABLE.
    #[arg(long, env = "RLSD_MAX_KEYS", default_value_t = DEFAULT_MAX_KEYS)]
    max_keys: usize,
    /// First component of every store key.
    #[arg(long, env = "RLSD_KEY_PREFIX", default_value = "rlsd")]
    key_prefix: String,
    /// Rate limit headers added to responses.
    #[arg(long, env = "RLSD_HEADERS", value_enum, default_value_t = HeaderStyle::XRatelimit)]
    headers: HeaderStyle,
    /// Keep state in Redis (`redis://[user:pass@]host:port[/db]`, `rediss://` for TLS) instead
    /// of in process, so replicas share it.
    #[arg(long, env = "RLSD_REDIS_URL")]
    redis_url: Option<String>,
    /// `single`: one Redis (or a primary behind a proxy); `cluster`: Redis Cluster, with
    /// `--redis-url` a comma-separated list of seed nodes; `sentinel`: the master that Redis
    /// Sentinel names, with `--redis-url` the comma-separated Sentinels.
    #[arg(long, env = "RLSD_REDIS_MODE", value_enum, default_value_t = RedisMode::Single)]
    redis_mode: RedisMode,
    /// Denials remembered in process: a request whose every limit is a denial known to hold
    /// until T is answered until T without a Redis round trip, exactly as Redis would (0: off).
    #[arg(long, env = "RLSD_OVER_LIMIT_CACHE", default_value_t = 100_000)]
    over_limit_cache: usize,
    /// The master name Sentinel monitors (`--redis-mode sentinel`).
    #[arg(long, env = "RLSD_REDIS_MASTER_NAME", default_value = "mymaster")]
    redis_master_name: String,
    /// A PEM file of CA certificates to trust for `rediss://` (instead of the built-in roots);
    /// not with `--redis-mode sentinel`.
    #[arg(long, env = "RLSD_REDIS_CA", value_name = "PATH")]
    redis_ca: Option<PathBuf>,
    /// A PEM client certificate to present to Redis over `rediss://` (with `--redis-tls-key`);
    /// not with `--redis-mode sentinel`.
    #[arg(
        long,
        env = "RLSD_REDIS_TLS_CERT",
        value_name = "PATH",
        requires = "redis_tls_key"
    )]
    redis_tls_cert: Option<PathBuf>,
    /// The PEM key of `--redis-tls-cert`.
    #[arg(
        long,
        env = "RLSD_REDIS_TLS_KEY",
        value_name = "PATH",
        requires = "redis_tls_cert"
    )]
    redis_tls_key: Option<PathBuf>,
    /// Longest wait for a Redis connection, in milliseconds.
    #[arg(long, env = "RLSD_REDIS_CONNECT_TIMEOUT_MS", default_value_t = 1000)]
    redis_connect_timeout_ms: u64,
    /// Longest wait for one Redis call, in milliseconds (Envoy waits 20 ms for the whole call).
    #[arg(long, env = "RLSD_REDIS_COMMAND_TIMEOUT_MS", default_value_t = 5)]
    redis_command_timeout_ms: u64,
    /// Most concurrent requests coalesced into one Redis EVALSHA (1: no coalescing).
    #[arg(long, env = "RLSD_REDIS_MAX_BATCH", default_value_t = rlsd::store::redis::DEFAULT_MAX_BATCH)]
    redis_max_batch: usize,
    /// Coalesced Redis calls in flight at once, per serving lane.
    #[arg(long, env = "RLSD_REDIS_PIPELINES", default_value_t = rlsd::store::redis::DEFAULT_PIPELINES)]
    redis_pipelines: usize,
    /// The answer when the store fails: `error` (gRPC UNAVAILABLE; Envoy's
    /// `failure_mode_deny` decides), `allow` or `deny`.
    #[arg(long, env = "RLSD_FAILURE_MODE", value_enum, default_value_t = FailureMode::Error)]
    failure_mode: FailureMode,
    /// Run every limit in shadow mode: evaluated, counted and reported, never denying.
    #[arg(long, env = "RLSD_SHADOW_MODE")]
    shadow_mode: bool,
    /// Keep transparent huge pages on for rlsd's memory (off by default: faulting in a fresh
    /// 2 MiB page stalls the thread that touches it, for milliseconds in some VMs).
    #[arg(long, env = "RLSD_TRANSPARENT_HUGE_PAGES")]
    transparent_huge_pages: bool,
    /// How often to look for config changes, in milliseconds (0: only on SIGHUP).
    #[arg(long, env = "RLSD_RELOAD_INTERVAL_MS", default_value_t = 1000)]
    reload_interval_ms: u64,
    /// Threads that serve requests (default: one per core the process may use). In process and
    /// with one Redis server each is a lane of its own: it serves the connections handed to it,
    /// with its own Redis connection, and nothing crosses threads.
    #[arg(long, env = "RLSD_WORKER_THREADS")]
    worker_threads: Option<std::num::NonZeroUsize>,
    /// On SIGTERM/SIGINT: seconds to keep answering with health NOT_SERVING before closing.
    #[arg(long, env = "RLSD_DRAIN_SECONDS", default_value_t = 0.0)]
    drain_seconds: f64,
    /// After the drain: the longest wait, in seconds, for open calls and connections to finish
    /// (a health `Watch` stream never does) before rlsd exits anyway.
    #[arg(long, env = "RLSD_SHUTDOWN_GRACE_SECONDS", default_value_t = server::DEFAULT_SHUTDOWN_GRACE.as_secs_f64())]
    shutdown_grace_seconds: f64,
    /// Usage ratio (0 to 1) above which allowed hits also count in `near_limit`.
    #[arg(long, env = "RLSD_NEAR_LIMIT_RATIO", default_value_t = DEFAULT_NEAR_LIMIT_RATIO, value_parser = ratio)]
    near_limit_ratio: f64,
    /// Serve gRPC over TLS with this PEM certificate chain (with `--tls-key`).
    #[arg(long, env = "RLSD_TLS_CERT", value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "RLSD_TLS_KEY", value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: require client certificates signed by a CA in this PEM file.
    #[arg(
        long,
        env = "RLSD_TLS_CLIENT_CA",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    tls_client_ca: Option<PathBuf>,
    /// How often to look for changed TLS files, in milliseconds (0: never).
    #[arg(long, env = "RLSD_TLS_RELOAD_INTERVAL_MS", default_value_t = 5000)]
    tls_reload_interval_ms: u64,
    /// Most descriptors in one request; more is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_DESCRIPTORS",
        default_value_t = RequestLimits::DEFAULT_MAX_DESCRIPTORS,
        value_parser = at_least_one
    )]
    max_descriptors: usize,
    /// Most entries in one descriptor; more is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_ENTRIES",
        default_value_t = RequestLimits::DEFAULT_MAX_ENTRIES,
        value_parser = at_least_one
    )]
    max_entries: usize,
    /// Longest descriptor entry key, in bytes; longer is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_KEY_BYTES",
        default_value_t = RequestLimits::DEFAULT_MAX_KEY_BYTES,
        value_parser = at_least_one
    )]
    max_key_bytes: usize,
    /// Longest descriptor entry value, in bytes; longer is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_VALUE_BYTES",
        default_value_t = RequestLimits::DEFAULT_MAX_VALUE_BYTES
    )]
    max_value_bytes: usize,
    /// Largest `hits_addend` of a request or descriptor; larger is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_HITS_ADDEND",
        default_value_t = RequestLimits::DEFAULT_MAX_HITS_ADDEND
    )]
    max_hits_addend: u64,
    /// Largest encoded gRPC request, in bytes; larger is refused by tonic with OUT_OF_RANGE.
    #[arg(
        long,
        env = "RLSD_MAX_MESSAGE_BYTES",
        default_value_t = RequestLimits::DEFAULT_MAX_MESSAGE_BYTES,
        value_parser = at_least_one
    )]
    max_message_bytes: usize,
}

fn main() -> ExitCode {
    let (cli, notes) = match parse_command_line() {
        Ok(parsed) => parsed,
        Err(error) => {
            eprintln!("{}: {error}", rlsd::ratelimit_env::PROGRAM);
            return ExitCode::FAILURE;
        }
    };
    init_logs(&cli);
    for note in notes {
        tracing::warn!("{note}");
    }
    let result = match cli.command {
        Command::Check { config } => return check(&config),
        Command::Serve(args) => serve(*args),
        Command::Simulate(args) => rlsd::simulate::run(&args).map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rlsd: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The command line; or, run as `ratelimit` (the image's `/bin/ratelimit`), `rlsd serve` with
/// the flags envoyproxy/ratelimit's environment variables mean, and notes to log about them.
fn parse_command_line() -> Result<(Cli, Vec<String>), String> {
    let mut args = std::env::args_os();
    let program = args.next().unwrap_or_default();
    let as_ratelimit = std::path::Path::new(&program)
        .file_name()
        .is_some_and(|name| name == rlsd::ratelimit_env::PROGRAM);
    if !as_ratelimit || args.next().is_some() {
        return Ok((Cli::parse(), Vec::new()));
    }
    let flags = rlsd::ratelimit_env::serve_flags(|name| std::env::var(name).ok())
        .map_err(|error| error.to_string())?;
    let command_line = ["rlsd".to_owned(), "serve".to_owned()]
        .into_iter()
        .chain(flags.args.iter().cloned());
    // The flags came from the environment: say so, and which flags, when one is refused (the
    // Redis URL may hold a password, so not that one).
    let cli = Cli::try_parse_from(command_line).map_err(|error| {
        let shown: Vec<&str> = flags
            .args
            .iter()
            .map(|arg| {
                if arg.starts_with("--redis-url=") {
                    "--redis-url=(hidden)"
                } else {
                    arg
                }
            })
            .collect();
        format!(
            "the environment's settings as rlsd flags ({}) were refused: {error}",
            shown.join(" ")
        )
    })?;
    Ok((cli, flags.notes))
}

fn init_logs(cli: &Cli) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("RLSD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log_level));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => logs.json().init(),
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    match config::load_path(path) {
        Ok(config) => {
            config::warn_about_unread(path, &config);
            print!("{}", rlsd::http::describe(&config));
            println!("{}: {} domain(s) OK", path.display(), config.domains.len());
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if !args.transparent_huge_pages
        && let Err(error) = server::disable_transparent_huge_pages()
    {
        tracing::warn!(%error, "cannot turn transparent huge pages off");
    }
    // Sentinel's connections are not built with a private CA: taken silently, the flag would
    // leave them trusting the public roots instead.
    if args.redis_ca.is_some() && args.redis_mode == RedisMode::Sentinel {
        anyhow::bail!(
            "--redis-ca applies to --redis-mode single and cluster; with sentinel, rlsd \
             cannot yet trust a private CA"
        );
    }
    if args.redis_tls_cert.is_some() && args.redis_mode == RedisMode::Sentinel {
        anyhow::bail!(
            "--redis-tls-cert applies to --redis-mode single and cluster; with sentinel, rlsd \
             cannot yet present a client certificate"
        );
    }
    let redis_identity = args
        .redis_tls_cert
        .clone()
        .zip(args.redis_tls_key.clone())
        .map(|(cert, key)| ClientIdentity { cert, key });
    let loaded = match &args.config {
        // Refuse a bad config before opening any port.
        Some(path) => {
            let loaded = config::load_path(path)
                .map_err(|errors| anyhow::anyhow!("invalid config, not starting:\n{errors}"))?;
            tracing::info!(path = %path.display(), domains = loaded.domains.len(), "config loaded");
            config::warn_about_unread(path, &loaded);
            loaded
        }
        None => config::Config::default(),
    };
    let tls = tls_settings(&args)?;
    let threads = serving_threads(&args);
    let lanes = serving_lanes(&args);
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    // With lanes, this runtime only accepts connections and runs the admin port and the
    // background work: one worker is plenty.
    runtime.worker_threads(if lanes > 0 { 1 } else { threads });
    let runtime = runtime
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let config = Arc::new(ArcSwap::from_pointee(loaded));
        let metrics = Arc::new(Metrics::new(args.near_limit_ratio));
        start_xds(&args, &config, &metrics).await?;
        let listeners = Listeners::bind(args.grpc_addr, args.http_addr)
            .await
            .with_context(|| format!("binding {} and {}", args.grpc_addr, args.http_addr))?;
        let listeners = match &args.grpc_unix_socket {
            None => listeners,
            Some(path) => listeners
                .with_grpc_unix(path, args.grpc_unix_socket_mode)
                .context("binding --grpc-unix-socket")?,
        };
        let listeners = match args.metrics_addr {
            None => listeners,
            Some(addr) => listeners
                .with_metrics(addr, args.metrics_path.clone())
                .await
                .with_context(|| format!("binding --metrics-addr {addr}"))?,
        };
        let settings = ServiceSettings {
            keys: KeySettings {
                prefix: args.key_prefix.clone(),
            },
            headers: args.headers,
            failure_mode: args.failure_mode,
            shadow_mode: args.shadow_mode,
            limits: RequestLimits {
                max_descriptors: args.max_descriptors,
                max_entries: args.max_entries,
                max_key_bytes: args.max_key_bytes,
                max_value_bytes: args.max_value_bytes,
                max_hits_addend: args.max_hits_addend,
                max_message_bytes: args.max_message_bytes,
            },
        };
        match &args.redis_url {
            Some(urls) if args.redis_mode == RedisMode::Cluster => {
                let nodes = urls
                    .split(',')
                    .map(str::trim)
                    .filter(|u| !u.is_empty())
                    .map(str::to_owned)
                    .collect();
                let mut cluster = ClusterSettings::new(nodes);
                cluster.connect_timeout = Duration::from_millis(args.redis_connect_timeout_ms);
                cluster.command_timeout = Duration::from_millis(args.redis_command_timeout_ms);
                cluster.ca_file.clone_from(&args.redis_ca);
                cluster.client_identity.clone_from(&redis_identity);
                // No over-limit cache here: the cluster store refunds cross-slot denials, so quota
                // can come back before a denial's reset, which the cache's exactness relies on.
                let store = Arc::new(ClusterStore::connect(cluster).await?);
                serve_with(store, config, metrics, settings, listeners, tls, &args).await
            }
            Some(url) => {
                let mut redis = RedisSettings::new(url.clone());
                redis.connect_timeout = Duration::from_millis(args.redis_connect_timeout_ms);
                redis.command_timeout = Duration::from_millis(args.redis_command_timeout_ms);
                redis.max_batch = args.redis_max_batch.max(1);
                redis.pipelines = args.redis_pipelines.max(1);
                redis.ca_file.clone_from(&args.redis_ca);
                redis.client_identity.clone_from(&redis_identity);
                redis.lanes = serving_lanes(&args);
                if args.redis_mode == RedisMode::Sentinel {
                    redis.sentinel = Some(SentinelTarget {
                        sentinels: url
                            .split(',')
                            .map(str::trim)
                            .filter(|u| !u.is_empty())
                            .map(str::to_owned)
                            .collect(),
                        master_name: args.redis_master_name.clone(),
                    });
                }
                let store = RedisStore::connect(redis).await?;
                let store = Arc::new(OverLimitCache::new(store, args.over_limit_cache));
                serve_with(store, config, metrics, settings, listeners, tls, &args).await
            }
            None => {
                let store = Arc::new(MemoryStore::new(args.max_keys));
                spawn_reclaimer(Arc::clone(&store));
                serve_with(store, config, metrics, settings, listeners, tls, &args).await
            }
        }
    })
}

async fn serve_with<S: Store>(
    store: Arc<S>,
    config: Arc<ArcSwap<config::Config>>,
    metrics: Arc<Metrics>,
    settings: ServiceSettings,
    listeners: Listeners,
    tls: Option<Arc<TlsSettings>>,
    args: &ServeArgs,
) -> anyhow::Result<()> {
    if let Some(path) = &args.config {
        metrics.config_load_success.inc();
        let reloader = Arc::new(Reloader::new(
            path.clone(),
            Arc::clone(&config),
            Arc::clone(&metrics),
        ));
        tokio::spawn(reloader.watch(Duration::from_millis(args.reload_interval_ms)));
    }
    let store_name = store.name();
    let mut limiter = RateLimiter::new(Arc::clone(&config), store, settings).with_metrics(metrics);
    let telemetry = match args.tracing {
        false => None,
        true => {
            let telemetry = Telemetry::start(&TracingSettings {
                service_name: args.tracing_service_name.clone(),
                service_namespace: args.tracing_service_namespace.clone(),
                service_instance_id: args.tracing_service_instance_id.clone(),
                sampling_rate: args.tracing_sampling_rate,
                endpoint: args.otlp_endpoint.clone(),
                protocol: args.otlp_protocol,
            })?;
            limiter = limiter.with_tracing(telemetry.tracer());
            Some(telemetry)
        }
    };
    let options = ServeOptions {
        drain: Duration::try_from_secs_f64(args.drain_seconds)
            .context("--drain-seconds must be a non-negative number")?,
        shutdown_grace: Duration::try_from_secs_f64(args.shutdown_grace_seconds)
            .context("--shutdown-grace-seconds must be a non-negative number")?,
        tls: tls.clone(),
        lanes: serving_lanes(args),
    };
    let grpc_tls = match &tls {
        None => "off",
        Some(tls) if tls.mutual() => "mutual",
        Some(_) => "on",
    };
    let threads = serving_threads(args);
    // The bound addresses, not the requested ones: with port 0 the log is where the port is found.
    let (grpc_addr, http_addr) = (
        listeners.grpc.local_addr().unwrap_or(args.grpc_addr),
        listeners.http.local_addr().unwrap_or(args.http_addr),
    );
    let grpc_unix = listeners
        .grpc_unix
        .as_ref()
        .map(|socket| socket.path().display().to_string());
    let stop = server::termination_signal();
    tracing::info!(grpc = %grpc_addr, http = %http_addr, grpc_unix, store = store_name, tls = grpc_tls, threads, lanes = options.lanes, "serving");
    let served = server::run_with(limiter, config, listeners, options, stop).await;
    if let Some(telemetry) = telemetry {
        telemetry.shutdown().await;
    }
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// With `--config-xds`, starts the config client and, unless forced to start without it,
/// waits for the first config it accepts.
async fn start_xds(
    args: &ServeArgs,
    config: &Arc<ArcSwap<config::Config>>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<()> {
    let Some(server) = &args.config_xds else {
        return Ok(());
    };
    let settings = XdsSettings {
        server: server.clone(),
        node_id: args.xds_node_id.clone(),
        node_metadata: args
            .xds_node_metadata
            .clone()
            .map(|pairs| pairs.0)
            .unwrap_or_default(),
        retry_interval: Duration::from_millis(args.xds_retry_interval_ms),
        headers: args
            .xds_headers
            .clone()
            .map(|pairs| pairs.0)
            .unwrap_or_default(),
        tls: args.xds_tls.then(|| XdsTls {
            ca: args.xds_tls_ca.clone(),
            cert: args.xds_tls_cert.clone(),
            key: args.xds_tls_key.clone(),
            san: args.xds_tls_san.clone(),
        }),
    };
    let (client, mut applied) = XdsClient::new(settings, Arc::clone(config), Arc::clone(metrics))?;
    tokio::spawn(client.run());
    if args.xds_force_start {
        tracing::info!(server = %server, "starting before any config arrives over xDS: every domain is unknown until then");
        return Ok(());
    }
    tracing::info!(server = %server, "waiting for the first config over xDS");
    applied
        .wait_for(Option::is_some)
        .await
        .context("the xDS client stopped")?;
    Ok(())
}

/// The gRPC port's TLS from `--tls-*`, loaded and validated; `None` without `--tls-cert`.
fn tls_settings(args: &ServeArgs) -> anyhow::Result<Option<Arc<TlsSettings>>> {
    let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else {
        return Ok(None);
    };
    let files = TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: args.tls_client_ca.clone(),
    };
    let tls = TlsSettings::load(files)
        .context("invalid TLS files, not starting")?
        .with_reload_interval(Duration::from_millis(args.tls_reload_interval_ms));
    Ok(Some(Arc::new(tls)))
}

/// Threads that serve requests: `--worker-threads`, else one per core the process may use.
fn serving_threads(args: &ServeArgs) -> usize {
    args.worker_threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        std::num::NonZeroUsize::get,
    )
}

/// Serving lanes: one per serving thread, except with Redis Cluster or Sentinel, whose stores
/// keep one shared connection that every thread would reach across threads; those serve on the
/// multi-thread runtime instead.
fn serving_lanes(args: &ServeArgs) -> usize {
    match (&args.redis_url, args.redis_mode) {
        (Some(_), RedisMode::Cluster | RedisMode::Sentinel) => 0,
        _ => serving_threads(args),
    }
}

/// Parses file permissions in octal (`660`, `0600`).
/// `k1:v1,k2=v2` pairs, as one flag value.
#[derive(Clone)]
struct Pairs(Vec<(String, String)>);

fn pairs(text: &str) -> Result<Pairs, String> {
    rlsd::xds::parse_pairs(text).map(Pairs)
}

fn url_path(text: &str) -> Result<String, String> {
    if text.starts_with('/') {
        Ok(text.to_owned())
    } else {
        Err("a path starting with /".into())
    }
}

fn octal_mode(text: &str) -> Result<u32, String> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        Ok(_) => Err("permissions go up to 777".to_owned()),
        Err(error) => Err(format!("not an octal mode: {error}")),
    }
}

/// Parses a ratio from 0 to 1 (NaN or a negative ratio would count every hit as near the limit).
fn ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        Ok(_) => Err("must be from 0 to 1".to_owned()),
        Err(error) => Err(error.to_string()),
    }
}

/// Parses a count that must be at least 1 (a limit of 0 would refuse every request).
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(error) => Err(error.to_string()),
    }
}

/// Reclaims expired keys every second, off the async workers.
fn spawn_reclaimer(store: Arc<MemoryStore>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let store = Arc::clone(&store);
            if let Err(error) = tokio::task::spawn_blocking(move || store.purge_expired()).await {
                tracing::error!(%error, "key reclaimer failed");
            }
        }
    });
}
