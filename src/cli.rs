//! The command line: `rlsd serve`, `check` and `simulate`, their flags (each also an `RLSD_*`
//! variable), and the settings of each part of the server that the flags make.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::engine::KeySettings;
use crate::metrics::DEFAULT_NEAR_LIMIT_RATIO;
use crate::rlqs::RlqsSettings;
use crate::server::{self, ConnectionLimits, RlqsOptions, ServeOptions};
use crate::service::{FailureMode, HeaderNames, HeaderStyle, RequestLimits, ServiceSettings};
use crate::store::memory::DEFAULT_MAX_KEYS;
use crate::store::redis::SentinelTarget;
use crate::store::{ClientIdentity, ClusterSettings, RedisSettings, StoreSettings};
use crate::telemetry::{OtlpProtocol, TracingSettings};
use crate::tls::{TlsError, TlsFiles, TlsSettings};
use crate::xds::{XdsSettings, XdsTls};

/// Flags that make sense one by one but not together.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// Sentinel connections are not built with a private CA: taken silently, the flag would
    /// leave them trusting the public roots instead.
    #[error(
        "--redis-ca applies to --redis-mode single and cluster; with sentinel, rlsd cannot yet \
         trust a private CA"
    )]
    SentinelCa,
    /// Sentinel connections present no client certificate.
    #[error(
        "--redis-tls-cert applies to --redis-mode single and cluster; with sentinel, rlsd \
         cannot yet present a client certificate"
    )]
    SentinelClientCert,
    /// A number of seconds that is negative or not finite.
    #[error("--{flag} must be a non-negative number of seconds")]
    Seconds {
        /// The flag, without its dashes.
        flag: &'static str,
    },
}

/// A rate limit service for Envoy.
#[derive(Parser)]
#[command(version, about)]
pub struct Cli {
    /// Log level (`error`, `warn`, `info`, `debug`, `trace`); `RLSD_LOG` takes a full filter.
    #[arg(long, global = true, env = "RLSD_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Log format.
    #[arg(long, global = true, env = "RLSD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// Which Redis topology `--redis-url` names.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RedisMode {
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
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// What `rlsd` does.
#[derive(Subcommand)]
pub enum Command {
    /// Serve Envoy's RateLimitService over gRPC.
    Serve(Box<ServeArgs>),
    /// Validate a config, print the limits it defines, exit 1 on errors.
    Check {
        /// A YAML file, or a directory: every file below it is read (one domain each).
        #[arg(long, env = "RLSD_CONFIG")]
        config: PathBuf,
        /// How the directory is read.
        #[command(flatten)]
        read: ConfigReadArgs,
    },
    /// Replay traffic against a descriptor's limit under each algorithm; print a table, draw an SVG.
    Simulate(crate::simulate::Args),
}

/// How a config directory is read: `serve`, `check` and `simulate` alike.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct ConfigReadArgs {
    /// Also read the files and directories below `--config` whose names start with `.`
    /// (envoyproxy/ratelimit's `RUNTIME_IGNOREDOTFILES=false`). A file reached twice, as in a
    /// Kubernetes ConfigMap mount, is read once all the same.
    #[arg(long, env = "RLSD_CONFIG_DOTFILES")]
    pub config_dotfiles: bool,
    /// Let several files give one domain: each adds its top-level descriptors to it, and two
    /// files giving the same descriptor are an error (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG=true`). Without it, a second file of a domain is an error.
    #[arg(long, env = "RLSD_MERGE_DOMAIN_CONFIG")]
    pub merge_domain_config: bool,
}

impl ConfigReadArgs {
    /// The loader's options.
    pub fn options(&self) -> crate::config::LoadOptions {
        crate::config::LoadOptions {
            dotfiles: self.config_dotfiles,
            merge_domains: self.merge_domain_config,
        }
    }
}

/// `rlsd serve`'s flags.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// A YAML file, or a directory: every file below it is read (one domain each).
    #[arg(
        long,
        env = "RLSD_CONFIG",
        required_unless_present = "config_xds",
        conflicts_with = "config_xds"
    )]
    pub config: Option<PathBuf>,
    /// How the config directory is read, and how files (or xDS resources) of one domain combine.
    #[command(flatten)]
    pub read: ConfigReadArgs,
    /// Take the config from this xDS management server instead (`host:port`, `http://` or
    /// `https://`), as Envoy Gateway pushes it: ADS state of the world, `RateLimitConfig`.
    #[arg(long, env = "RLSD_CONFIG_XDS", value_name = "ADDR")]
    pub config_xds: Option<String>,
    /// `node.id` sent to the xDS server.
    #[arg(
        long,
        env = "RLSD_XDS_NODE_ID",
        default_value = "rlsd",
        requires = "config_xds"
    )]
    pub xds_node_id: String,
    /// `node.metadata` sent to the xDS server: `k1:v1,k2=v2`.
    #[arg(long, env = "RLSD_XDS_NODE_METADATA", value_name = "PAIRS", value_parser = pairs, requires = "config_xds")]
    pub xds_node_metadata: Option<Pairs>,
    /// Extra gRPC metadata on the xDS stream: `k1:v1,k2=v2` (an `authorization` token, say:
    /// its value is never shown, in `--help` or in errors).
    #[arg(
        long,
        env = "RLSD_XDS_HEADERS",
        hide_env_values = true,
        value_name = "PAIRS",
        value_parser = SecretPairs,
        requires = "config_xds"
    )]
    pub xds_headers: Option<Pairs>,
    /// Wait after a lost xDS stream before reconnecting, in milliseconds; it doubles with
    /// each further loss in a row, up to `--xds-retry-max-ms`.
    #[arg(long, env = "RLSD_XDS_RETRY_INTERVAL_MS", default_value_t = 3000)]
    pub xds_retry_interval_ms: u64,
    /// The longest wait between xDS reconnects, in milliseconds.
    #[arg(long, env = "RLSD_XDS_RETRY_MAX_MS", default_value_t = 60_000)]
    pub xds_retry_max_ms: u64,
    /// Spread of each xDS reconnect wait, as a fraction of it (0 to 1), so that replicas do not
    /// redial in step.
    #[arg(long, env = "RLSD_XDS_RETRY_JITTER", default_value_t = 0.5, value_parser = ratio)]
    pub xds_retry_jitter: f64,
    /// Connect to the xDS server over TLS.
    #[arg(long, env = "RLSD_XDS_TLS", requires = "config_xds")]
    pub xds_tls: bool,
    /// PEM CA certificates that sign the xDS server's certificate (default: public roots).
    #[arg(
        long,
        env = "RLSD_XDS_TLS_CA",
        value_name = "PATH",
        requires = "xds_tls"
    )]
    pub xds_tls_ca: Option<PathBuf>,
    /// PEM client certificate for the xDS server (mutual TLS; with `--xds-tls-key`).
    #[arg(long, env = "RLSD_XDS_TLS_CERT", value_name = "PATH", requires_all = ["xds_tls", "xds_tls_key"])]
    pub xds_tls_cert: Option<PathBuf>,
    /// The PEM key of `--xds-tls-cert`.
    #[arg(long, env = "RLSD_XDS_TLS_KEY", value_name = "PATH", requires_all = ["xds_tls", "xds_tls_cert"])]
    pub xds_tls_key: Option<PathBuf>,
    /// The name the xDS server's certificate must carry (default: the address's host).
    #[arg(
        long,
        env = "RLSD_XDS_TLS_SAN",
        value_name = "NAME",
        requires = "xds_tls"
    )]
    pub xds_tls_san: Option<String>,
    /// Largest xDS response accepted, in bytes; a larger one fails the stream, which is then
    /// reopened.
    #[arg(long, env = "RLSD_XDS_MAX_MESSAGE_BYTES", default_value_t = crate::xds::DEFAULT_MAX_RESPONSE_BYTES, value_parser = at_least_one)]
    pub xds_max_message_bytes: usize,
    /// With `--config-xds`: serve at once, every domain unknown, instead of waiting for the
    /// first config to arrive before opening any port.
    #[arg(long, env = "RLSD_XDS_FORCE_START", requires = "config_xds")]
    pub xds_force_start: bool,
    /// gRPC listen address (Envoy's `rate_limit_service`).
    #[arg(long, env = "RLSD_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address (`/healthcheck`, `/metrics`, `/rlconfig`, `/json`).
    #[arg(long, env = "RLSD_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Let `POST /json` on the admin port take and give back hits as a gRPC call does, a
    /// debugging aid: whoever reaches the port can then exhaust or refill any quota. Without
    /// it, `/json` is a dry run that changes nothing.
    #[arg(long, env = "RLSD_ADMIN_JSON_WRITES")]
    pub admin_json_writes: bool,
    /// Report unhealthy (`/healthcheck` 500, gRPC health NOT_SERVING) while no config with at
    /// least one domain is loaded: an empty config directory at start, xDS before its first
    /// push or after one that dropped every domain.
    #[arg(long, env = "RLSD_HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")]
    pub healthy_with_at_least_one_config_loaded: bool,
    /// Also serve `/rlconfig` and `/metrics`, read-only, on this address (envoyproxy/ratelimit's
    /// debug port, 6070 when run as `/bin/ratelimit`).
    #[arg(long, env = "RLSD_DEBUG_ADDR")]
    pub debug_addr: Option<SocketAddr>,
    /// Also serve the metrics, and only them, on this address (a port Prometheus scrapes).
    #[arg(long, env = "RLSD_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// The path of the metrics on `--metrics-addr`.
    #[arg(
        long,
        env = "RLSD_METRICS_PATH",
        default_value = "/metrics",
        value_parser = url_path,
        requires = "metrics_addr"
    )]
    pub metrics_path: String,
    /// Trace every ShouldRateLimit call with OpenTelemetry, exported over OTLP: a server span,
    /// child of the `traceparent` or B3 context Envoy sends, with the store call as its child.
    #[arg(long, env = "RLSD_TRACING")]
    pub tracing: bool,
    /// `service.name` of the exported spans.
    #[arg(long, env = "RLSD_TRACING_SERVICE_NAME", default_value = "RateLimit")]
    pub tracing_service_name: String,
    /// `service.namespace` of the exported spans (none when empty).
    #[arg(long, env = "RLSD_TRACING_SERVICE_NAMESPACE", default_value = "")]
    pub tracing_service_namespace: String,
    /// `service.instance.id` of the exported spans (none when empty).
    #[arg(long, env = "RLSD_TRACING_SERVICE_INSTANCE_ID", default_value = "")]
    pub tracing_service_instance_id: String,
    /// Share of new traces sampled, 0 to 1; a caller's sampling decision is always followed.
    #[arg(long, env = "RLSD_TRACING_SAMPLING_RATE", default_value_t = 1.0)]
    pub tracing_sampling_rate: f64,
    /// The OTLP collector (`http://host:port`; with `http`, spans go to `<endpoint>/v1/traces`);
    /// default: localhost on 4318 (`http`) or 4317 (`grpc`).
    #[arg(long, env = "RLSD_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// OTLP over `http` (protobuf bodies) or `grpc`.
    #[arg(long, env = "RLSD_OTLP_PROTOCOL", value_enum, default_value_t = OtlpProtocol::Http)]
    pub otlp_protocol: OtlpProtocol,
    /// Also serve gRPC, plaintext, on this Unix domain socket (for an Envoy on the same host or
    /// in the same pod: its cluster address is then `pipe: {path: ...}`).
    #[arg(long, env = "RLSD_GRPC_UNIX_SOCKET", value_name = "PATH")]
    pub grpc_unix_socket: Option<PathBuf>,
    /// Permissions of the socket file, in octal (connecting needs write permission).
    #[arg(long, env = "RLSD_GRPC_UNIX_SOCKET_MODE", value_name = "OCTAL", default_value = "660", value_parser = octal_mode)]
    pub grpc_unix_socket_mode: u32,
    /// Most keys the in-process store holds; requests needing more get UNAVAILABLE.
    #[arg(long, env = "RLSD_MAX_KEYS", default_value_t = DEFAULT_MAX_KEYS)]
    pub max_keys: usize,
    /// First component of every store key.
    #[arg(long, env = "RLSD_KEY_PREFIX", default_value = "rlsd")]
    pub key_prefix: String,
    /// Rate limit headers added to responses.
    #[arg(long, env = "RLSD_HEADERS", value_enum, default_value_t = HeaderStyle::XRatelimit)]
    pub headers: HeaderStyle,
    /// Name of the limit header instead of the style's (`LIMIT_LIMIT_HEADER`).
    #[arg(long, env = "RLSD_LIMIT_HEADER", value_name = "NAME", value_parser = header_name)]
    pub limit_header: Option<http::HeaderName>,
    /// Name of the remaining header instead of the style's (`LIMIT_REMAINING_HEADER`).
    #[arg(long, env = "RLSD_REMAINING_HEADER", value_name = "NAME", value_parser = header_name)]
    pub remaining_header: Option<http::HeaderName>,
    /// Name of the reset header instead of the style's (`LIMIT_RESET_HEADER`).
    #[arg(long, env = "RLSD_RESET_HEADER", value_name = "NAME", value_parser = header_name)]
    pub reset_header: Option<http::HeaderName>,
    /// Which hits are charges (recorded whatever the answer) for limits that do not say:
    /// `descriptor_hits`, `always` (envoyproxy/ratelimit's counting, xDS limits too) or `never`.
    #[arg(long, env = "RLSD_DEFAULT_CHARGE", value_name = "MODE", default_value = "descriptor_hits", value_parser = crate::limit::parse_charge)]
    pub default_charge: crate::limit::Charge,
    /// Keep state in Redis (`redis://[user:pass@]host:port[/db]`, `rediss://` for TLS) instead
    /// of in process, so replicas share it. Set it in the environment rather than here: a
    /// command line is visible to every process on the host.
    #[arg(long, env = "RLSD_REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// `single`: one Redis (or a primary behind a proxy); `cluster`: Redis Cluster, with
    /// `--redis-url` a comma-separated list of seed nodes; `sentinel`: the master that Redis
    /// Sentinel names, with `--redis-url` the comma-separated Sentinels.
    #[arg(long, env = "RLSD_REDIS_MODE", value_enum, default_value_t = RedisMode::Single)]
    pub redis_mode: RedisMode,
    /// Most seconds added at random to the expiry of each Redis key a call writes, so the keys
    /// of one window do not all expire at once (`EXPIRATION_JITTER_MAX_SECONDS`); answers and
    /// reset times are unchanged. 0 (the default): none. At most one day.
    #[arg(long, env = "RLSD_REDIS_EXPIRY_JITTER_SECONDS", value_name = "SECONDS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub redis_expiry_jitter_seconds: u64,
    /// Denials remembered in process: a request whose every limit is a denial known to hold
    /// until T is answered until T without a Redis round trip, exactly as Redis would (0: off).
    #[arg(long, env = "RLSD_OVER_LIMIT_CACHE", default_value_t = 100_000)]
    pub over_limit_cache: usize,
    /// The master name Sentinel monitors (`--redis-mode sentinel`).
    #[arg(long, env = "RLSD_REDIS_MASTER_NAME", default_value = "mymaster")]
    pub redis_master_name: String,
    /// A PEM file of CA certificates to trust for `rediss://` (instead of the built-in roots);
    /// not with `--redis-mode sentinel`.
    #[arg(long, env = "RLSD_REDIS_CA", value_name = "PATH")]
    pub redis_ca: Option<PathBuf>,
    /// A PEM client certificate to present to Redis over `rediss://` (with `--redis-tls-key`);
    /// not with `--redis-mode sentinel`.
    #[arg(
        long,
        env = "RLSD_REDIS_TLS_CERT",
        value_name = "PATH",
        requires = "redis_tls_key"
    )]
    pub redis_tls_cert: Option<PathBuf>,
    /// The PEM key of `--redis-tls-cert`.
    #[arg(
        long,
        env = "RLSD_REDIS_TLS_KEY",
        value_name = "PATH",
        requires = "redis_tls_cert"
    )]
    pub redis_tls_key: Option<PathBuf>,
    /// Longest wait for a Redis connection, in milliseconds.
    #[arg(long, env = "RLSD_REDIS_CONNECT_TIMEOUT_MS", default_value_t = 1000)]
    pub redis_connect_timeout_ms: u64,
    /// Longest wait for Redis, in milliseconds, for a call whose caller sent no `grpc-timeout`
    /// (a caller that sends one gets its own, less a margin to answer). Past it the call gets
    /// the failure-mode answer and nothing of it is counted.
    #[arg(long, env = "RLSD_REDIS_COMMAND_TIMEOUT_MS", default_value_t = 20)]
    pub redis_command_timeout_ms: u64,
    /// Longest wait for Redis, in milliseconds, whatever `grpc-timeout` a caller sent.
    #[arg(long, env = "RLSD_REDIS_TIMEOUT_CAP_MS", default_value_t = 1000)]
    pub redis_timeout_cap_ms: u64,
    /// Most requests, per serving lane (per store on a Cluster), whose Redis calls are still
    /// awaited after their callers stopped waiting, so that what a late reply committed is
    /// given back; past it such a call is let go and what it commits stays counted.
    #[arg(long, env = "RLSD_REDIS_MAX_LATE_REQUESTS", default_value_t = crate::store::deadline::DEFAULT_MAX_LATE_REQUESTS)]
    pub redis_max_late_requests: usize,
    /// Most concurrent requests coalesced into one Redis EVALSHA (1: no coalescing).
    #[arg(long, env = "RLSD_REDIS_MAX_BATCH", default_value_t = crate::store::redis::DEFAULT_MAX_BATCH)]
    pub redis_max_batch: usize,
    /// Coalesced Redis calls in flight at once, per serving lane.
    #[arg(long, env = "RLSD_REDIS_PIPELINES", default_value_t = crate::store::redis::DEFAULT_PIPELINES)]
    pub redis_pipelines: usize,
    /// The answer when the store fails: `error` (gRPC UNAVAILABLE; Envoy's
    /// `failure_mode_deny` decides), `allow` or `deny`.
    #[arg(long, env = "RLSD_FAILURE_MODE", value_enum, default_value_t = FailureMode::Error)]
    pub failure_mode: FailureMode,
    /// Run every limit in shadow mode: evaluated, counted and reported (an over limit's status
    /// stays OVER_LIMIT), while every answer is OK.
    #[arg(long, env = "RLSD_SHADOW_MODE")]
    pub shadow_mode: bool,
    /// Run every limit in quota mode: a request is denied by its quotas only when every one of
    /// them is over (envoyproxy/ratelimit's QUOTA_MODE).
    #[arg(long, env = "RLSD_QUOTA_MODE")]
    pub quota_mode: bool,
    /// Send envoyproxy/ratelimit's dynamic metadata with each answer: the domain, the request's
    /// descriptors, and the merged `metadata:` of the descriptors that passed.
    #[arg(long, env = "RLSD_RESPONSE_DYNAMIC_METADATA")]
    pub response_dynamic_metadata: bool,
    /// Keep transparent huge pages on for rlsd's memory (off by default: faulting in a fresh
    /// 2 MiB page stalls the thread that touches it, for milliseconds in some VMs).
    #[arg(long, env = "RLSD_TRANSPARENT_HUGE_PAGES")]
    pub transparent_huge_pages: bool,
    /// How often to look for config changes, in milliseconds (0: only on SIGHUP).
    #[arg(long, env = "RLSD_RELOAD_INTERVAL_MS", default_value_t = 1000)]
    pub reload_interval_ms: u64,
    /// Threads that serve requests (default: one per core the process may use). In process and
    /// with one Redis server each is a lane of its own: it serves the connections handed to it,
    /// with its own Redis connection, and nothing crosses threads.
    #[arg(long, env = "RLSD_WORKER_THREADS")]
    pub worker_threads: Option<std::num::NonZeroUsize>,
    /// On SIGTERM/SIGINT: seconds to keep answering with health NOT_SERVING before closing.
    #[arg(long, env = "RLSD_DRAIN_SECONDS", default_value_t = 0.0)]
    pub drain_seconds: f64,
    /// After the drain: the longest wait, in seconds, for open calls and connections to finish
    /// (a health `Watch` stream never does) before rlsd exits anyway.
    #[arg(long, env = "RLSD_SHUTDOWN_GRACE_SECONDS", default_value_t = server::DEFAULT_SHUTDOWN_GRACE.as_secs_f64())]
    pub shutdown_grace_seconds: f64,
    /// Record ShouldRateLimit latency in milliseconds, as
    /// `ratelimit_service_should_rate_limit_duration_milliseconds`, instead of in seconds.
    #[arg(long, env = "RLSD_LATENCY_MILLISECONDS")]
    pub latency_milliseconds: bool,
    /// Close a gRPC connection that has sent no request this many milliseconds after it was
    /// accepted (after its TLS handshake, with TLS).
    #[arg(long, env = "RLSD_GRPC_FIRST_REQUEST_TIMEOUT_MS", value_name = "MS", default_value_t = millis(ConnectionLimits::DEFAULT_FIRST_REQUEST_TIMEOUT), value_parser = at_least_one_ms)]
    pub grpc_first_request_timeout_ms: u64,
    /// Send a gRPC connection GOAWAY after this many seconds, give or take 10 %, so that clients
    /// reconnect and spread over replicas (0: never).
    #[arg(long, env = "RLSD_GRPC_MAX_CONNECTION_AGE_SECONDS", value_name = "SECONDS", default_value_t = ConnectionLimits::DEFAULT_MAX_CONNECTION_AGE.as_secs_f64())]
    pub grpc_max_connection_age_seconds: f64,
    /// After that GOAWAY: seconds the calls in flight have before the connection is closed.
    #[arg(long, env = "RLSD_GRPC_MAX_CONNECTION_AGE_GRACE_SECONDS", value_name = "SECONDS", default_value_t = ConnectionLimits::DEFAULT_MAX_CONNECTION_AGE_GRACE.as_secs_f64())]
    pub grpc_max_connection_age_grace_seconds: f64,
    /// Refuse a request body (gRPC: DEADLINE_EXCEEDED) that has not ended this many
    /// milliseconds after it first waited for more.
    #[arg(long, env = "RLSD_REQUEST_BODY_TIMEOUT_MS", value_name = "MS", default_value_t = millis(ConnectionLimits::DEFAULT_REQUEST_BODY_TIMEOUT), value_parser = at_least_one_ms)]
    pub request_body_timeout_ms: u64,
    /// Most bytes that request bodies still arriving may hold, over every connection and port;
    /// a body that would wait for more beyond it is refused (gRPC: RESOURCE_EXHAUSTED).
    #[arg(long, env = "RLSD_MAX_BUFFERED_REQUEST_BYTES", value_name = "BYTES", default_value_t = ConnectionLimits::DEFAULT_MAX_BUFFERED_REQUEST_BYTES, value_parser = at_least_one)]
    pub max_buffered_request_bytes: usize,
    /// Bytes of request bodies still arriving that each connection may hold before drawing on
    /// `--max-buffered-request-bytes`, so its ordinary calls are answered while that is spent.
    #[arg(long, env = "RLSD_CONNECTION_BODY_RESERVE_BYTES", value_name = "BYTES", default_value_t = ConnectionLimits::DEFAULT_CONNECTION_BODY_RESERVE_BYTES)]
    pub connection_body_reserve_bytes: usize,
    /// On the HTTP ports (admin, debug, metrics): milliseconds a client has to send each
    /// request head, after connecting or after the previous answer, before it is disconnected.
    #[arg(long, env = "RLSD_HTTP_HEADER_TIMEOUT_MS", value_name = "MS", default_value_t = millis(ConnectionLimits::DEFAULT_HTTP_HEADER_TIMEOUT), value_parser = at_least_one_ms)]
    pub http_header_timeout_ms: u64,
    /// Usage ratio (0 to 1) above which allowed hits also count in `near_limit`.
    #[arg(long, env = "RLSD_NEAR_LIMIT_RATIO", default_value_t = DEFAULT_NEAR_LIMIT_RATIO, value_parser = ratio)]
    pub near_limit_ratio: f64,
    /// Serve gRPC over TLS with this PEM certificate chain (with `--tls-key`).
    #[arg(long, env = "RLSD_TLS_CERT", value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "RLSD_TLS_KEY", value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: require client certificates signed by a CA in this PEM file.
    #[arg(
        long,
        env = "RLSD_TLS_CLIENT_CA",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// How often to look for changed TLS files, in milliseconds (0: never).
    #[arg(long, env = "RLSD_TLS_RELOAD_INTERVAL_MS", default_value_t = 5000)]
    pub tls_reload_interval_ms: u64,
    /// Most descriptors in one request; more is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_DESCRIPTORS",
        default_value_t = RequestLimits::DEFAULT_MAX_DESCRIPTORS,
        value_parser = at_least_one
    )]
    pub max_descriptors: usize,
    /// Most entries in one descriptor; more is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_ENTRIES",
        default_value_t = RequestLimits::DEFAULT_MAX_ENTRIES,
        value_parser = at_least_one
    )]
    pub max_entries: usize,
    /// Longest descriptor entry key, in bytes; longer is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_KEY_BYTES",
        default_value_t = RequestLimits::DEFAULT_MAX_KEY_BYTES,
        value_parser = at_least_one
    )]
    pub max_key_bytes: usize,
    /// Longest descriptor entry value, in bytes; longer is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_VALUE_BYTES",
        default_value_t = RequestLimits::DEFAULT_MAX_VALUE_BYTES
    )]
    pub max_value_bytes: usize,
    /// Largest `hits_addend` of a request or descriptor; larger is INVALID_ARGUMENT.
    #[arg(
        long,
        env = "RLSD_MAX_HITS_ADDEND",
        default_value_t = RequestLimits::DEFAULT_MAX_HITS_ADDEND
    )]
    pub max_hits_addend: u64,
    /// Largest encoded gRPC request, in bytes; larger is refused by tonic with OUT_OF_RANGE.
    #[arg(
        long,
        env = "RLSD_MAX_MESSAGE_BYTES",
        default_value_t = RequestLimits::DEFAULT_MAX_MESSAGE_BYTES,
        value_parser = at_least_one
    )]
    pub max_message_bytes: usize,
    /// Do not serve Envoy's Rate Limit Quota Service (`StreamRateLimitQuotas`), on by default
    /// on the same gRPC listeners as `ShouldRateLimit` (see docs/rlqs.md).
    #[arg(long, env = "RLSD_NO_RLQS")]
    pub no_rlqs: bool,
    /// RLQS: the report interval assumed for a bucket until its own is measured (Envoy's is
    /// 5 s), in milliseconds; TTLs are three intervals, departed Envoys are forgotten after 2.5.
    #[arg(long, env = "RLSD_RLQS_REPORT_INTERVAL_MS", default_value_t = 5000, value_parser = at_least_one_ms)]
    pub rlqs_report_interval_ms: u64,
    /// RLQS: a bucket an Envoy reports as 0 allowed / 0 denied for this long is abandoned, in
    /// milliseconds.
    #[arg(long, env = "RLSD_RLQS_IDLE_AFTER_MS", default_value_t = 60_000, value_parser = at_least_one_ms)]
    pub rlqs_idle_after_ms: u64,
    /// RLQS: most buckets one stream may report; a report beyond it ends the stream with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "RLSD_RLQS_MAX_BUCKETS_PER_STREAM", default_value_t = 1_000, value_parser = at_least_one)]
    pub rlqs_max_buckets_per_stream: usize,
    /// RLQS: most streams open at once on this server; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "RLSD_RLQS_MAX_STREAMS", default_value_t = 10_000, value_parser = at_least_one)]
    pub rlqs_max_streams: usize,
    /// RLQS: most entries in one bucket id; more ends the stream with INVALID_ARGUMENT.
    #[arg(long, env = "RLSD_RLQS_MAX_BUCKET_ENTRIES", default_value_t = 16, value_parser = at_least_one)]
    pub rlqs_max_bucket_entries: usize,
    /// RLQS: most bytes of one bucket id's keys and values (and of the domain); more ends the
    /// stream with INVALID_ARGUMENT.
    #[arg(long, env = "RLSD_RLQS_MAX_BUCKET_BYTES", default_value_t = 1_024, value_parser = at_least_one)]
    pub rlqs_max_bucket_bytes: usize,
    /// RLQS: largest report message, in bytes; larger ends the stream with OUT_OF_RANGE.
    #[arg(long, env = "RLSD_RLQS_MAX_REPORT_BYTES", default_value_t = 1 << 20, value_parser = at_least_one)]
    pub rlqs_max_report_bytes: usize,
    /// RLQS: a stream that sends no report this long after it opens is ended, in milliseconds
    /// (Envoy opens it with its first bucket's report).
    #[arg(long, env = "RLSD_RLQS_FIRST_REPORT_TIMEOUT_MS", default_value_t = 10_000, value_parser = at_least_one_ms)]
    pub rlqs_first_report_timeout_ms: u64,
}

impl Cli {
    /// The command line; or, run as `ratelimit` (the image's `/bin/ratelimit`) with no
    /// arguments, `rlsd serve` with the flags envoyproxy/ratelimit's environment variables
    /// mean, and notes to log about them.
    pub fn from_process() -> Result<(Cli, Vec<String>), String> {
        let mut args = std::env::args_os();
        let program = args.next().unwrap_or_default();
        let as_ratelimit = std::path::Path::new(&program)
            .file_name()
            .is_some_and(|name| name == crate::ratelimit_env::PROGRAM);
        if !as_ratelimit || args.next().is_some() {
            return Ok((Cli::parse(), Vec::new()));
        }
        let flags = crate::ratelimit_env::serve_flags(|name| std::env::var(name).ok())
            .map_err(|error| error.to_string())?;
        let command_line = ["rlsd".to_owned(), "serve".to_owned()]
            .into_iter()
            .chain(flags.args.iter().cloned());
        // The flags came from the environment: say so, and which flags, when one is refused
        // (not the values of those that may hold credentials).
        let cli = Cli::try_parse_from(command_line).map_err(|error| {
            let shown: Vec<String> = flags
                .args
                .iter()
                .map(
                    |arg| match SECRET_FLAGS.iter().find(|flag| is_flag(arg, flag)) {
                        Some(flag) => format!("--{flag}=(hidden)"),
                        None => arg.clone(),
                    },
                )
                .collect();
            format!(
                "the environment's settings as rlsd flags ({}) were refused: {error}",
                shown.join(" ")
            )
        })?;
        Ok((cli, flags.notes))
    }

    /// Logs to stderr at `--log-level` (or the `RLSD_LOG` filter), as `--log-format` says.
    pub fn init_logs(&self) {
        let filter = tracing_subscriber::EnvFilter::try_from_env("RLSD_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&self.log_level));
        let logs = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        match self.log_format {
            LogFormat::Text => logs
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .init(),
            LogFormat::Json => logs.json().init(),
        }
    }
}

impl ServeArgs {
    /// The store the flags name: in process without `--redis-url`.
    pub fn store_settings(&self) -> Result<StoreSettings, SettingsError> {
        if self.redis_mode == RedisMode::Sentinel {
            if self.redis_ca.is_some() {
                return Err(SettingsError::SentinelCa);
            }
            if self.redis_tls_cert.is_some() {
                return Err(SettingsError::SentinelClientCert);
            }
        }
        let Some(url) = &self.redis_url else {
            return Ok(StoreSettings::Memory {
                max_keys: self.max_keys,
            });
        };
        let identity = self
            .redis_tls_cert
            .clone()
            .zip(self.redis_tls_key.clone())
            .map(|(cert, key)| ClientIdentity { cert, key });
        let urls = || {
            url.split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let connect_timeout = Duration::from_millis(self.redis_connect_timeout_ms);
        let command_timeout = Duration::from_millis(self.redis_command_timeout_ms);
        let timeout_cap = Duration::from_millis(self.redis_timeout_cap_ms).max(command_timeout);
        if self.redis_mode == RedisMode::Cluster {
            let mut cluster = ClusterSettings::new(urls());
            cluster.connect_timeout = connect_timeout;
            cluster.command_timeout = command_timeout;
            cluster.timeout_cap = timeout_cap;
            cluster.expiry_jitter = Duration::from_secs(self.redis_expiry_jitter_seconds);
            cluster.max_late_requests = self.redis_max_late_requests;
            cluster.ca_file.clone_from(&self.redis_ca);
            cluster.client_identity = identity;
            return Ok(StoreSettings::Cluster(cluster));
        }
        let mut redis = RedisSettings::new(url.clone());
        redis.connect_timeout = connect_timeout;
        redis.command_timeout = command_timeout;
        redis.timeout_cap = timeout_cap;
        redis.expiry_jitter = Duration::from_secs(self.redis_expiry_jitter_seconds);
        redis.max_late_requests = self.redis_max_late_requests;
        redis.max_batch = self.redis_max_batch.max(1);
        redis.pipelines = self.redis_pipelines.max(1);
        redis.ca_file.clone_from(&self.redis_ca);
        redis.client_identity = identity;
        redis.lanes = self.serving_lanes();
        if self.redis_mode == RedisMode::Sentinel {
            redis.sentinel = Some(SentinelTarget {
                sentinels: urls(),
                master_name: self.redis_master_name.clone(),
            });
        }
        Ok(StoreSettings::Redis {
            redis,
            over_limit_cache: self.over_limit_cache,
        })
    }

    /// How the service answers: keys, headers, failures, shadow mode, request bounds.
    pub fn service_settings(&self) -> ServiceSettings {
        ServiceSettings {
            keys: KeySettings {
                prefix: self.key_prefix.clone(),
                default_charge: self.default_charge,
            },
            headers: self.headers,
            header_names: HeaderNames {
                limit: self.limit_header.clone(),
                remaining: self.remaining_header.clone(),
                reset: self.reset_header.clone(),
            },
            failure_mode: self.failure_mode,
            shadow_mode: self.shadow_mode,
            quota_mode: self.quota_mode,
            dynamic_metadata: self.response_dynamic_metadata,
            limits: RequestLimits {
                max_descriptors: self.max_descriptors,
                max_entries: self.max_entries,
                max_key_bytes: self.max_key_bytes,
                max_value_bytes: self.max_value_bytes,
                max_hits_addend: self.max_hits_addend,
                max_message_bytes: self.max_message_bytes,
            },
        }
    }

    /// The tracing exporter's settings; `None` without `--tracing`.
    pub fn tracing_settings(&self) -> Option<TracingSettings> {
        self.tracing.then(|| TracingSettings {
            service_name: self.tracing_service_name.clone(),
            service_namespace: self.tracing_service_namespace.clone(),
            service_instance_id: self.tracing_service_instance_id.clone(),
            sampling_rate: self.tracing_sampling_rate,
            endpoint: self.otlp_endpoint.clone(),
            protocol: self.otlp_protocol,
        })
    }

    /// The xDS client's settings; `None` without `--config-xds`.
    pub fn xds_settings(&self) -> Option<XdsSettings> {
        let server = self.config_xds.clone()?;
        Some(XdsSettings {
            server,
            node_id: self.xds_node_id.clone(),
            node_metadata: self
                .xds_node_metadata
                .clone()
                .map(|pairs| pairs.0)
                .unwrap_or_default(),
            retry_interval: Duration::from_millis(self.xds_retry_interval_ms),
            retry_max: Duration::from_millis(self.xds_retry_max_ms),
            retry_jitter: self.xds_retry_jitter,
            headers: self
                .xds_headers
                .clone()
                .map(|pairs| pairs.0)
                .unwrap_or_default(),
            tls: self.xds_tls.then(|| XdsTls {
                ca: self.xds_tls_ca.clone(),
                cert: self.xds_tls_cert.clone(),
                key: self.xds_tls_key.clone(),
                san: self.xds_tls_san.clone(),
            }),
            max_response_bytes: self.xds_max_message_bytes,
            merge_domains: self.read.merge_domain_config,
        })
    }

    /// The gRPC port's TLS from `--tls-*`, loaded and validated; `None` without `--tls-cert`.
    pub fn tls_settings(&self) -> Result<Option<Arc<TlsSettings>>, TlsError> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let files = TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: self.tls_client_ca.clone(),
        };
        let tls = TlsSettings::load(files)?
            .with_reload_interval(Duration::from_millis(self.tls_reload_interval_ms));
        Ok(Some(Arc::new(tls)))
    }

    /// How the server drains, stops, spreads and bounds connections, with the gRPC port's `tls`.
    pub fn serve_options(
        &self,
        tls: Option<Arc<TlsSettings>>,
    ) -> Result<ServeOptions, SettingsError> {
        let seconds = |value: f64, flag| {
            Duration::try_from_secs_f64(value).map_err(|_| SettingsError::Seconds { flag })
        };
        let age = seconds(
            self.grpc_max_connection_age_seconds,
            "grpc-max-connection-age-seconds",
        )?;
        Ok(ServeOptions {
            drain: seconds(self.drain_seconds, "drain-seconds")?,
            shutdown_grace: seconds(self.shutdown_grace_seconds, "shutdown-grace-seconds")?,
            tls,
            lanes: self.serving_lanes(),
            admin_json_writes: self.admin_json_writes,
            health_needs_config: self.healthy_with_at_least_one_config_loaded,
            limits: ConnectionLimits {
                first_request_timeout: Duration::from_millis(self.grpc_first_request_timeout_ms),
                request_body_timeout: Duration::from_millis(self.request_body_timeout_ms),
                max_buffered_request_bytes: self.max_buffered_request_bytes,
                connection_body_reserve_bytes: self.connection_body_reserve_bytes,
                max_connection_age: (!age.is_zero()).then_some(age),
                max_connection_age_grace: seconds(
                    self.grpc_max_connection_age_grace_seconds,
                    "grpc-max-connection-age-grace-seconds",
                )?,
                http_header_timeout: Duration::from_millis(self.http_header_timeout_ms),
            },
            rlqs: (!self.no_rlqs).then(|| RlqsOptions {
                settings: RlqsSettings {
                    report_interval: Duration::from_millis(self.rlqs_report_interval_ms),
                    idle_after: Duration::from_millis(self.rlqs_idle_after_ms),
                    max_buckets_per_stream: self.rlqs_max_buckets_per_stream,
                    max_streams: self.rlqs_max_streams,
                    max_bucket_entries: self.rlqs_max_bucket_entries,
                    max_bucket_bytes: self.rlqs_max_bucket_bytes,
                    max_report_bytes: self.rlqs_max_report_bytes,
                    first_report_timeout: Duration::from_millis(self.rlqs_first_report_timeout_ms),
                    failure_mode: self.failure_mode,
                },
                ..RlqsOptions::default()
            }),
        })
    }

    /// Threads that serve requests: `--worker-threads`, else one per core the process may use.
    pub fn serving_threads(&self) -> usize {
        self.worker_threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            std::num::NonZeroUsize::get,
        )
    }

    /// Serving lanes: one per serving thread, except with Redis Cluster or Sentinel, whose
    /// stores keep one shared connection that every thread would reach across threads; those
    /// serve on the multi-thread runtime instead.
    pub fn serving_lanes(&self) -> usize {
        match (&self.redis_url, self.redis_mode) {
            (Some(_), RedisMode::Cluster | RedisMode::Sentinel) => 0,
            _ => self.serving_threads(),
        }
    }
}

/// The `rlsd serve` flags whose values may hold credentials: `--help` shows their variables
/// without values (`hide_env_values`), and no error repeats them.
pub const SECRET_FLAGS: [&str; 2] = ["redis-url", "xds-headers"];

/// Whether `arg` (`--name=value`) sets the flag `name`.
fn is_flag(arg: &str, name: &str) -> bool {
    arg.strip_prefix("--")
        .and_then(|rest| rest.strip_prefix(name))
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
}

/// `k1:v1,k2=v2` pairs, as one flag value.
#[derive(Clone, Debug)]
pub struct Pairs(pub Vec<(String, String)>);

fn pairs(text: &str) -> Result<Pairs, String> {
    crate::xds::parse_pairs(text).map(Pairs)
}

/// Parses [`Pairs`] whose values may be credentials: a malformed value is refused without
/// repeating it, where clap's own message would quote it whole.
#[derive(Clone, Copy, Debug)]
struct SecretPairs;

impl clap::builder::TypedValueParser for SecretPairs {
    type Value = Pairs;

    fn parse_ref(
        &self,
        command: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Pairs, clap::Error> {
        let flag = arg.and_then(clap::Arg::get_long).unwrap_or("xds-headers");
        let refused = || {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!(
                    "invalid value for '--{flag}' (not shown, it may hold credentials): each \
                     pair must be key:value or key=value, with a key\n"
                ),
            )
            .with_cmd(command)
        };
        let text = value.to_str().ok_or_else(refused)?;
        crate::xds::parse_pairs(text)
            .map(Pairs)
            .map_err(|_| refused())
    }
}

fn url_path(text: &str) -> Result<String, String> {
    if text.starts_with('/') {
        Ok(text.to_owned())
    } else {
        Err("a path starting with /".into())
    }
}

/// Parses file permissions in octal (`660`, `0600`).
/// Parses a response header name; HTTP/2 sends names in lower case, so it is lowered.
fn header_name(text: &str) -> Result<http::HeaderName, String> {
    http::HeaderName::from_bytes(text.to_ascii_lowercase().as_bytes())
        .map_err(|_| format!("not an HTTP header name: {text:?}"))
}

fn octal_mode(text: &str) -> Result<u32, String> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        Ok(_) => Err("permissions go up to 777".to_owned()),
        Err(error) => Err(format!("not an octal mode: {error}")),
    }
}

/// Parses a ratio from 0 to 1 (NaN or a negative ratio would count every hit as near the limit).
pub(crate) fn ratio(text: &str) -> Result<f64, String> {
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

/// Parses a number of milliseconds that must be at least 1 (a zero timeout would refuse all).
fn at_least_one_ms(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(error) => Err(error.to_string()),
    }
}

/// A default duration as a flag's milliseconds.
const fn millis(duration: Duration) -> u64 {
    duration.as_millis() as u64
}
