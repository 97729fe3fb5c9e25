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
use rlsd::server::{self, Listeners};
use rlsd::service::{HeaderStyle, RateLimiter, ServiceSettings};
use rlsd::store::MemoryStore;
use rlsd::store::memory::DEFAULT_MAX_KEYS;

/// A rate limit service for Envoy.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve Envoy's RateLimitService over gRPC.
    Serve(ServeArgs),
    /// Validate a config, print the limits it defines, exit 1 on errors.
    Check {
        /// A YAML file, or a directory of `*.yaml` files (one domain each).
        #[arg(long, env = "RLSD_CONFIG")]
        config: PathBuf,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A YAML file, or a directory of `*.yaml` files (one domain each).
    #[arg(long, env = "RLSD_CONFIG")]
    config: PathBuf,
    /// gRPC listen address (Envoy's `rate_limit_service`).
    #[arg(long, env = "RLSD_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// Admin HTTP listen address (`/healthcheck`, `/rlconfig`).
    #[arg(long, env = "RLSD_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Most keys the in-process store holds; requests needing more get UNAVAILABLE.
    #[arg(long, env = "RLSD_MAX_KEYS", default_value_t = DEFAULT_MAX_KEYS)]
    max_keys: usize,
    /// First component of every store key.
    #[arg(long, env = "RLSD_KEY_PREFIX", default_value = "rlsd")]
    key_prefix: String,
    /// Rate limit headers added to responses.
    #[arg(long, env = "RLSD_HEADERS", value_enum, default_value_t = HeaderStyle::XRatelimit)]
    headers: HeaderStyle,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RLSD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { config } => return check(&config),
        Command::Serve(args) => serve(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rlsd: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    match config::load_path(path) {
        Ok(config) => {
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
    // Refuse a bad config before opening any port.
    let loaded = config::load_path(&args.config)
        .map_err(|errors| anyhow::anyhow!("invalid config, not starting:\n{errors}"))?;
    tracing::info!(path = %args.config.display(), domains = loaded.domains.len(), "config loaded");
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let listeners = Listeners::bind(args.grpc_addr, args.http_addr)
            .await
            .with_context(|| format!("binding {} and {}", args.grpc_addr, args.http_addr))?;
        let config = Arc::new(ArcSwap::from_pointee(loaded));
        let store = Arc::new(MemoryStore::new(args.max_keys));
        spawn_reclaimer(Arc::clone(&store));
        let settings = ServiceSettings {
            keys: KeySettings {
                prefix: args.key_prefix,
            },
            headers: args.headers,
        };
        let limiter = RateLimiter::new(Arc::clone(&config), store, settings);
        tracing::info!(grpc = %args.grpc_addr, http = %args.http_addr, store = "memory", "serving");
        server::run(limiter, config, listeners, server::termination_signal()).await?;
        tracing::info!("stopped");
        Ok(())
    })
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
