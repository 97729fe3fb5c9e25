//! The `rlsd` binary: parse the command line, load the config, serve until a signal.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use rlsd::cli::{Cli, Command, ServeArgs};
use rlsd::config;
use rlsd::metrics::{LatencyUnit, Metrics};
use rlsd::reload::Reloader;
use rlsd::server::{self, Listeners};
use rlsd::service::RateLimiter;
use rlsd::store::{self, Store};
use rlsd::telemetry::Telemetry;
use rlsd::xds::XdsClient;

/// mimalloc instead of glibc's malloc: a request allocates dozens of short-lived strings
/// (protobuf decoding, keys, the response), and malloc and free are a large share of a
/// request's instructions under glibc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let (cli, notes) = match Cli::from_process() {
        Ok(parsed) => parsed,
        Err(error) => {
            eprintln!("{}: {error}", rlsd::ratelimit_env::PROGRAM);
            return ExitCode::FAILURE;
        }
    };
    cli.init_logs();
    for note in notes {
        tracing::warn!("{note}");
    }
    let result = match cli.command {
        Command::Check { config, read } => return check(&config, read.options()),
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

fn check(path: &std::path::Path, options: config::LoadOptions) -> ExitCode {
    match config::load_path(path, options) {
        Ok(config) => {
            config::warn_about_unread(path, options);
            // What a reload would refuse fails the check too.
            if let Some(error) = config::empty_config_error(path, &config) {
                eprintln!("{error}");
                return ExitCode::FAILURE;
            }
            print!("{}", rlsd::admin::describe(&config));
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
    match server::raise_open_files_limit() {
        Ok(limit) => tracing::info!(limit, "open file descriptor limit"),
        Err(error) => tracing::warn!(%error, "cannot raise the open file descriptor limit"),
    }
    // Everything the flags can get wrong is refused before any port opens.
    let store_settings = args.store_settings()?;
    let loaded = match &args.config {
        Some(path) => {
            let loaded = config::load_path(path, args.read.options())
                .map_err(|errors| anyhow::anyhow!("invalid config, not starting:\n{errors}"))?;
            config::warn_about_unread(path, args.read.options());
            // Nothing earlier to keep: serve without limits, as envoyproxy/ratelimit does, and
            // say so as the error it most likely is.
            match config::empty_config_error(path, &loaded) {
                Some(error) => tracing::error!("{error}; serving without limits until one loads"),
                None => {
                    tracing::info!(path = %path.display(), domains = loaded.domains.len(), "config loaded");
                }
            }
            loaded
        }
        None => config::Config::default(),
    };
    let tls = args
        .tls_settings()
        .context("invalid TLS files, not starting")?;
    let options = args.serve_options(tls.clone())?;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    // With lanes, this runtime only accepts connections and runs the admin port and the
    // background work: one worker is plenty.
    runtime.worker_threads(if options.lanes > 0 {
        1
    } else {
        args.serving_threads()
    });
    let runtime = runtime
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let config = Arc::new(ArcSwap::from_pointee(loaded));
        let latency_unit = if args.latency_milliseconds {
            LatencyUnit::Milliseconds
        } else {
            LatencyUnit::Seconds
        };
        let metrics = Arc::new(Metrics::with_latency_unit(args.near_limit_ratio, latency_unit));
        if let Some(xds) = args.xds_settings() {
            XdsClient::start(xds, args.xds_force_start, Arc::clone(&config), Arc::clone(&metrics))
                .await?;
        }
        let listeners = bind(&args).await?;
        let store = Arc::new(store::connect(store_settings).await?);
        let mut options = options;
        if let Some(rlqs) = &mut options.rlqs {
            // Demands meet in the store, so replicas on one Redis split limits alike.
            rlqs.board = Arc::new(rlsd::rlqs::StoreBoard::new(Arc::clone(&store)));
        }
        if let Some(path) = &args.config {
            if config.load().domains.is_empty() {
                metrics.config_load_error.inc();
            } else {
                metrics.config_load_success.inc();
            }
            let reloader = Reloader::new(
                path.clone(),
                args.read.options(),
                Arc::clone(&config),
                Arc::clone(&metrics),
            );
            tokio::spawn(Arc::new(reloader).watch(Duration::from_millis(args.reload_interval_ms)));
        }
        let store_name = store.name();
        let mut limiter = RateLimiter::new(Arc::clone(&config), store, args.service_settings())
            .with_metrics(metrics);
        let telemetry = args
            .tracing_settings()
            .map(|settings| Telemetry::start(&settings))
            .transpose()?;
        if let Some(telemetry) = &telemetry {
            limiter = limiter.with_tracing(telemetry.tracer());
        }
        let grpc_tls = match &tls {
            None => "off",
            Some(tls) if tls.mutual() => "mutual",
            Some(_) => "on",
        };
        // The bound addresses, not the requested ones: with port 0 the log is where the port is
        // found.
        let (grpc, http) = (
            listeners.grpc.local_addr().unwrap_or(args.grpc_addr),
            listeners.http.local_addr().unwrap_or(args.http_addr),
        );
        let grpc_unix = listeners
            .grpc_unix
            .as_ref()
            .map(|socket| socket.path().display().to_string());
        let debug_addr = listeners.debug.as_ref().and_then(|l| Some(l.local_addr().ok()?.to_string()));
        let threads = args.serving_threads();
        tracing::info!(%grpc, %http, grpc_unix, debug = debug_addr, store = store_name, tls = grpc_tls, threads, lanes = options.lanes, "serving");
        let served =
            server::run_with(limiter, config, listeners, options, server::termination_signal())
                .await;
        if let Some(telemetry) = telemetry {
            telemetry.shutdown().await;
        }
        served?;
        tracing::info!("stopped");
        Ok(())
    })
}

/// Binds the gRPC, admin, and optional Unix socket and metrics listeners.
async fn bind(args: &ServeArgs) -> anyhow::Result<Listeners> {
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
    Ok(match args.debug_addr {
        None => listeners,
        Some(addr) => listeners
            .with_debug(addr)
            .await
            .with_context(|| format!("binding --debug-addr {addr}"))?,
    })
}
