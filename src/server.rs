//! Listeners, the admin HTTP port, and shutdown. `main` calls [`run`]; tests call it too.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::config::Config;
use crate::http;
use crate::pb::RateLimitServiceServer;
use crate::service::RateLimiter;
use crate::store::Store;

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The admin HTTP server failed.
    #[error("http server: {0}")]
    Http(#[source] std::io::Error),
}

/// The sockets rlsd serves on, bound before the config is trusted to serve.
pub struct Listeners {
    /// gRPC `RateLimitService` (Envoy's port, 8081 by default).
    pub grpc: TcpListener,
    /// Admin HTTP: `/healthcheck`, `/rlconfig` (8080 by default).
    pub http: TcpListener,
}

impl Listeners {
    /// Binds both ports.
    ///
    /// # Errors
    /// When either address cannot be bound.
    pub async fn bind(grpc: SocketAddr, http: SocketAddr) -> std::io::Result<Listeners> {
        Ok(Listeners {
            grpc: TcpListener::bind(grpc).await?,
            http: TcpListener::bind(http).await?,
        })
    }
}

/// Serves `limiter` until `shutdown` completes, then stops accepting and lets in-flight calls end.
///
/// # Errors
/// When a listener fails.
pub async fn run<S: Store>(
    limiter: RateLimiter<S>,
    config: Arc<ArcSwap<Config>>,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        // An error means the sender is gone, which also means stop.
        let _ = rx.wait_for(|stop| *stop).await;
    };
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    let incoming = TcpIncoming::from(listeners.grpc).with_nodelay(Some(true));
    let grpc = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(RateLimitServiceServer::new(limiter))
        .serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone()));
    let admin =
        axum::serve(listeners.http, http::router(config)).with_graceful_shutdown(stopped(stop_rx));
    let (grpc, admin) = tokio::join!(grpc, admin);
    grpc?;
    admin.map_err(ServerError::Http)?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn termination_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received, stopping"),
        () = terminate => tracing::info!("SIGTERM received, stopping"),
    }
}
