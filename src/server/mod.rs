//! Listeners, the gRPC routes, the admin HTTP port, and shutdown. `main` calls [`run_with`]; tests too.

mod accept;
mod body;
mod connection;
mod http;
mod lanes;
pub(crate) mod shed;
mod unix;

pub use connection::MAX_CONCURRENT_STREAMS;
pub use unix::{DEFAULT_SOCKET_MODE, UnixSocket, UnixSocketError};

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic::server::NamedService;
use tonic::service::Routes;

use crate::admin::{self, AdminState};
use crate::config::Config;
use crate::health::Health;
use crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use crate::pb::{RateLimitService, RateLimitServiceServer};
use crate::rlqs::{DemandBoard, MemoryBoard, QuotaService, RlqsSettings};
use crate::service::{Effect, RateLimiter};
use crate::store::Store;
use crate::tls::TlsSettings;

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The reflection service could not be built from the embedded descriptors.
    #[error("grpc reflection: {0}")]
    Reflection(String),
    /// A serving lane's thread or runtime could not be started.
    #[error("starting serving lanes: {0}")]
    Lanes(#[source] std::io::Error),
}

/// The sockets rlsd serves on, bound before the config is trusted to serve.
pub struct Listeners {
    /// gRPC `RateLimitService` (Envoy's port, 8081 by default).
    pub grpc: TcpListener,
    /// Admin HTTP: `/healthcheck`, `/metrics`, `/rlconfig` (8080 by default).
    pub http: TcpListener,
    /// gRPC on a Unix domain socket as well, plaintext (TLS covers the TCP port only).
    pub grpc_unix: Option<UnixSocket>,
    /// A second HTTP port serving only the metrics, and the path it serves them on.
    pub metrics: Option<(TcpListener, String)>,
    /// An HTTP port serving `/rlconfig` and `/metrics` only (envoyproxy/ratelimit's debug port).
    pub debug: Option<TcpListener>,
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
            grpc_unix: None,
            metrics: None,
            debug: None,
        })
    }

    /// Serves `/rlconfig` and `/metrics` on `addr` too.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn with_debug(mut self, addr: SocketAddr) -> std::io::Result<Listeners> {
        self.debug = Some(TcpListener::bind(addr).await?);
        Ok(self)
    }

    /// Serves the metrics at `path` on `addr` too (Prometheus scraping a port of its own).
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn with_metrics(
        mut self,
        addr: SocketAddr,
        path: String,
    ) -> std::io::Result<Listeners> {
        self.metrics = Some((TcpListener::bind(addr).await?, path));
        Ok(self)
    }

    /// Serves gRPC on the Unix socket at `path` too, with permissions `mode` (see
    /// [`UnixSocket::bind`]).
    ///
    /// # Errors
    /// When the socket cannot be bound.
    pub fn with_grpc_unix(
        mut self,
        path: &std::path::Path,
        mode: u32,
    ) -> Result<Listeners, UnixSocketError> {
        self.grpc_unix = Some(UnixSocket::bind(path, mode)?);
        Ok(self)
    }
}

/// Server behaviour beyond the sockets.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// After the shutdown signal: how long to keep answering, with health NOT_SERVING, so
    /// load balancers and Envoy stop sending before the listeners close.
    pub drain: Duration,
    /// After the listeners close: the longest wait for connections to finish their calls. A
    /// stream that never ends by itself (a health `Watch`, a client that stopped reading)
    /// would otherwise keep the process alive until it is killed.
    pub shutdown_grace: Duration,
    /// TLS (and mutual TLS) on the gRPC port, reloaded from its files; `None`: plain TCP.
    pub tls: Option<Arc<TlsSettings>>,
    /// Threads that serve gRPC connections, each on a runtime of its own, connections handed to
    /// them in turn (see [`crate::lane`]); 0 serves them as tasks of the caller's runtime.
    pub lanes: usize,
    /// Let the admin port's `/json` take and give back hits (`--admin-json-writes`); without
    /// it every `/json` request is a dry run.
    pub admin_json_writes: bool,
    /// Report unhealthy, on `/healthcheck` and gRPC health, while the config has no domain
    /// (`--healthy-with-at-least-one-config-loaded`).
    pub health_needs_config: bool,
    /// What one client may hold of the server, in time and memory.
    pub limits: ConnectionLimits,
    /// Envoy's Rate Limit Quota Service on the gRPC listeners too; `None`: off (`--no-rlqs`).
    pub rlqs: Option<RlqsOptions>,
}

/// The quota service's settings and where its demands meet.
#[derive(Clone)]
pub struct RlqsOptions {
    /// Bounds and behaviour.
    pub settings: RlqsSettings,
    /// The demand board: in process, or the store's (Redis) so replicas agree.
    pub board: Arc<dyn DemandBoard>,
}

impl std::fmt::Debug for RlqsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlqsOptions")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Default for RlqsOptions {
    fn default() -> Self {
        RlqsOptions {
            settings: RlqsSettings::default(),
            board: Arc::new(MemoryBoard::default()),
        }
    }
}

/// Bounds on what clients can hold of the server: how long a connection or a request may take
/// to arrive, how long a gRPC connection lives, and the memory unfinished requests may hold.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// A gRPC connection that has not sent its first request this long after it was accepted
    /// (after its TLS handshake, with TLS) is closed.
    pub first_request_timeout: Duration,
    /// A request body, gRPC or HTTP, that has not ended this long after it first waited for
    /// more is refused: DEADLINE_EXCEEDED on gRPC, and its buffer is freed.
    pub request_body_timeout: Duration,
    /// Bytes that request bodies still arriving may hold in all, on every port and connection;
    /// a body that would wait for more beyond it is refused: RESOURCE_EXHAUSTED on gRPC.
    pub max_buffered_request_bytes: usize,
    /// Bytes of request bodies still arriving that each connection may hold of its own before
    /// drawing on `max_buffered_request_bytes`, so that its ordinary calls are answered however
    /// their frames arrive while other connections hold the shared budget.
    pub connection_body_reserve_bytes: usize,
    /// A gRPC connection is sent GOAWAY after this long, give or take 10 %, so that clients
    /// reconnect and spread over replicas; `None`: never.
    pub max_connection_age: Option<Duration>,
    /// After that GOAWAY, how long the calls in flight have before the connection is closed.
    pub max_connection_age_grace: Duration,
    /// On the HTTP ports, how long a client has to send each request head: the first after it
    /// connects, each next after the previous answer (so also the longest idle keep-alive).
    pub http_header_timeout: Duration,
}

impl ConnectionLimits {
    /// Default [`ConnectionLimits::first_request_timeout`].
    pub const DEFAULT_FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
    /// Default [`ConnectionLimits::request_body_timeout`]: Envoy gives a whole call 20 ms.
    pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(5);
    /// Default [`ConnectionLimits::max_buffered_request_bytes`]: a thousand partial requests of
    /// the default `--max-message-bytes`.
    pub const DEFAULT_MAX_BUFFERED_REQUEST_BYTES: usize = 64 << 20;
    /// Default [`ConnectionLimits::connection_body_reserve_bytes`]: one HTTP/2 frame of the
    /// default size, far more than an Envoy request.
    pub const DEFAULT_CONNECTION_BODY_RESERVE_BYTES: usize = 16 << 10;
    /// Default [`ConnectionLimits::max_connection_age`], envoyproxy/ratelimit's.
    pub const DEFAULT_MAX_CONNECTION_AGE: Duration = Duration::from_secs(24 * 3600);
    /// Default [`ConnectionLimits::max_connection_age_grace`], envoyproxy/ratelimit's.
    pub const DEFAULT_MAX_CONNECTION_AGE_GRACE: Duration = Duration::from_secs(3600);
    /// Default [`ConnectionLimits::http_header_timeout`].
    pub const DEFAULT_HTTP_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            first_request_timeout: Self::DEFAULT_FIRST_REQUEST_TIMEOUT,
            request_body_timeout: Self::DEFAULT_REQUEST_BODY_TIMEOUT,
            max_buffered_request_bytes: Self::DEFAULT_MAX_BUFFERED_REQUEST_BYTES,
            connection_body_reserve_bytes: Self::DEFAULT_CONNECTION_BODY_RESERVE_BYTES,
            max_connection_age: Some(Self::DEFAULT_MAX_CONNECTION_AGE),
            max_connection_age_grace: Self::DEFAULT_MAX_CONNECTION_AGE_GRACE,
            http_header_timeout: Self::DEFAULT_HTTP_HEADER_TIMEOUT,
        }
    }
}

/// Default [`ServeOptions::shutdown_grace`]: far longer than any call (a Redis call is bounded by
/// its command timeout), and well inside Kubernetes' default 30 s termination grace period.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            drain: Duration::ZERO,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            tls: None,
            lanes: 0,
            admin_json_writes: false,
            health_needs_config: false,
            limits: ConnectionLimits::default(),
            rlqs: Some(RlqsOptions::default()),
        }
    }
}

/// Serves `limiter` until `shutdown` completes, with no drain period.
///
/// # Errors
/// When a listener fails.
pub async fn run<S: Store>(
    limiter: RateLimiter<S>,
    config: Arc<ArcSwap<Config>>,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    run_with(
        limiter,
        config,
        listeners,
        ServeOptions::default(),
        shutdown,
    )
    .await
}

/// Serves `limiter` until `shutdown` completes; then turns health NOT_SERVING, keeps answering
/// for `options.drain`, stops accepting, and lets in-flight calls finish, waiting at most
/// `options.shutdown_grace` for them.
///
/// # Errors
/// When a listener fails.
pub async fn run_with<S: Store>(
    limiter: RateLimiter<S>,
    config: Arc<ArcSwap<Config>>,
    listeners: Listeners,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let required_config = options.health_needs_config.then(|| Arc::clone(&config));
    let health = Arc::new(Health::new(reporter, required_config).await);
    let metrics = limiter.metrics();
    let store = limiter.store();
    let max_message_bytes = limiter.limits().max_message_bytes;
    let limiter = Arc::new(limiter);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        // An error means the sender is gone, which also means stop.
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let prober = health.spawn_prober(store, Arc::clone(&metrics));
    {
        let health = Arc::clone(&health);
        tokio::spawn(async move {
            shutdown.await;
            health.start_draining().await;
            if !options.drain.is_zero() {
                tracing::info!(drain = ?options.drain, "draining: health is NOT_SERVING, still answering");
                tokio::time::sleep(options.drain).await;
            }
            tracing::info!("closing listeners; waiting for calls in flight");
            let _ = stop_tx.send(true);
        });
    }

    let quota = options.rlqs.as_ref().map(|rlqs| {
        QuotaService::new(
            Arc::clone(&config),
            Arc::clone(&rlqs.board),
            Arc::clone(&limiter) as Arc<dyn crate::service::ChargeDescriptor>,
            rlqs.settings.clone(),
            crate::rlqs::metrics::RlqsMetrics::new(metrics.registry()),
            stop_rx.clone(),
        )
    });
    let mut reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    if quota.is_some() {
        reflection =
            reflection.register_encoded_file_descriptor_set(crate::pb::RLQS_FILE_DESCRIPTOR_SET);
        health
            .report_also(RateLimitQuotaServiceServer::<QuotaService>::NAME)
            .await;
    }
    let reflection = reflection
        .build_v1()
        .map_err(|error| ServerError::Reflection(error.to_string()))?;
    let tls_watcher = options
        .tls
        .as_ref()
        .map(|tls| tokio::spawn(Arc::clone(tls).watch()));
    let bodies = body::BodyLimits::new(
        options.limits.request_body_timeout,
        options.limits.max_buffered_request_bytes,
        options.limits.connection_body_reserve_bytes,
    );
    let routes = GrpcRoutes {
        // Oversized requests are refused by tonic with OUT_OF_RANGE before decoding.
        rate_limit: RateLimitServiceServer::from_arc(Arc::clone(&limiter))
            .max_decoding_message_size(max_message_bytes),
        quota: quota.as_ref().map(|quota| {
            let max = quota.max_report_bytes();
            RateLimitQuotaServiceServer::new(quota.clone()).max_decoding_message_size(max)
        }),
        others: Routes::new(health_service)
            .add_service(reflection)
            .prepare(),
        bodies: body::BodyGuard::new(&bodies),
    };
    let lanes = match options.lanes {
        0 => None,
        count => {
            let store = limiter.store();
            let open = move || {
                let store = Arc::clone(&store);
                async move { store.open_lane().await }
            };
            Some(
                lanes::Lanes::start(count, open)
                    .await
                    .map_err(ServerError::Lanes)?,
            )
        }
    };
    let grpc = serve_grpc(
        routes,
        (listeners.grpc, listeners.grpc_unix),
        options.tls.clone(),
        lanes,
        connection::Times::from(&options.limits),
        stopped(stop_rx.clone()),
        options.shutdown_grace,
    );
    // The HTTP ports stop with the gRPC port, and get as long to finish.
    let http = |listener: TcpListener, router: axum::Router| {
        http::serve(
            listener,
            http::Guarded::new(router, Arc::clone(&bodies)),
            options.limits.http_header_timeout,
            stopped(stop_rx.clone()),
            options.shutdown_grace,
        )
    };
    let metrics_only = listeners.metrics.map(|(listener, path)| {
        tokio::spawn(http(
            listener,
            admin::metrics_router(&path, Arc::clone(&metrics)),
        ))
    });
    let admin_state = AdminState {
        config,
        metrics,
        health,
        limiter,
        json: if options.admin_json_writes {
            Effect::Apply
        } else {
            Effect::DryRun
        },
    };
    let quota_view = quota.as_ref().map(QuotaService::view);
    let debug = listeners.debug.map(|listener| {
        let mut router = admin::debug_router(admin_state.clone());
        if let Some(view) = quota_view {
            router = router.route(
                "/rlqs",
                axum::routing::get(move || {
                    let view = Arc::clone(&view);
                    async move {
                        (
                            [(::http::header::CONTENT_TYPE, "application/json")],
                            view.render(),
                        )
                    }
                }),
            );
        }
        tokio::spawn(http(listener, router))
    });
    let admin = http(listeners.http, admin::router(admin_state));
    tokio::join!(grpc, admin);
    for task in [metrics_only, debug].into_iter().flatten() {
        if let Err(error) = task.await {
            tracing::warn!(%error, "metrics or debug port task failed");
        }
    }
    prober.abort();
    if let Some(watcher) = tls_watcher {
        watcher.abort();
    }
    Ok(())
}

/// Serves `service` in the rate limiter's place on rlsd's own gRPC stack (lanes, connections,
/// body bounds, codec) with the default limits, health and no admin port, until `shutdown`.
/// For the benches' do-nothing floor: what the stack costs without rlsd's work.
///
/// # Errors
/// When the lanes cannot be started.
#[doc(hidden)]
pub async fn serve_unary<T: RateLimitService>(
    service: T,
    listener: TcpListener,
    lanes: usize,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let (_, health_service) = tonic_health::server::health_reporter();
    let limits = ConnectionLimits::default();
    let bodies = body::BodyLimits::new(
        limits.request_body_timeout,
        limits.max_buffered_request_bytes,
        limits.connection_body_reserve_bytes,
    );
    let routes = GrpcRoutes {
        rate_limit: RateLimitServiceServer::new(service)
            .max_decoding_message_size(crate::service::RequestLimits::DEFAULT_MAX_MESSAGE_BYTES),
        quota: None,
        others: Routes::new(health_service).prepare(),
        bodies: body::BodyGuard::new(&bodies),
    };
    let lanes = match lanes {
        0 => None,
        count => Some(
            lanes::Lanes::start(count, || async {})
                .await
                .map_err(ServerError::Lanes)?,
        ),
    };
    serve_grpc(
        routes,
        (listener, None),
        None,
        lanes,
        connection::Times::from(&limits),
        shutdown,
        DEFAULT_SHUTDOWN_GRACE,
    )
    .await;
    Ok(())
}

/// Whether the gRPC request `path` (`/package.Service/Method`) calls a method of `service`.
fn calls_service(path: &str, service: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|path| path.strip_prefix(service))
        .is_some_and(|method| method.starts_with('/'))
}

/// gRPC health's one unary method; its `Watch` streams.
const HEALTH_CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

/// The gRPC services: `RateLimitService` called directly, the rest (health, reflection) through
/// tonic's router, which boxes and matches every call. Unlike tonic's own server this does not
/// cut a call off at its `grpc-timeout`: every store call has its own bound
/// (`--redis-command-timeout-ms`), and a client past its deadline has stopped listening.
struct GrpcRoutes<T: RateLimitService> {
    rate_limit: RateLimitServiceServer<T>,
    /// `StreamRateLimitQuotas`, unless `--no-rlqs`.
    quota: Option<RateLimitQuotaServiceServer<QuotaService>>,
    others: Routes,
    /// Every request body is held to these (a clone is a handle for another connection).
    bodies: body::BodyGuard,
}

impl<T: RateLimitService> Clone for GrpcRoutes<T> {
    fn clone(&self) -> Self {
        GrpcRoutes {
            rate_limit: self.rate_limit.clone(),
            quota: self.quota.clone(),
            others: self.others.clone(),
            bodies: self.bodies.clone(),
        }
    }
}

impl<T: RateLimitService> hyper::service::Service<::http::Request<Incoming>> for GrpcRoutes<T> {
    type Response = ::http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<::http::Response<Body>, Infallible>;

    fn call(&self, request: ::http::Request<Incoming>) -> Self::Future {
        let path = request.uri().path();
        let rate_limit = calls_service(path, RateLimitServiceServer::<T>::NAME);
        let quota = self
            .quota
            .as_ref()
            .filter(|_| calls_service(path, RateLimitQuotaServiceServer::<QuotaService>::NAME));
        // A quota stream is Streaming: it holds nothing between reports, so it lives as long as
        // Envoy keeps it, while a report left half-sent is held to the deadline and budget.
        let shape = if rate_limit || path == HEALTH_CHECK_PATH {
            body::BodyShape::Unary
        } else {
            body::BodyShape::Streaming
        };
        let request = request.map(|body| self.bodies.guard(body, shape));
        if let Some(quota) = quota {
            return quota.clone().call(request.map(Body::new));
        }
        // Both services are always ready (tonic's generated servers and router say so), so
        // `call` needs no `poll_ready` first.
        if rate_limit {
            self.rate_limit.clone().call(request.map(Body::new))
        } else {
            let mut others = self.others.clone();
            Box::pin(others.call(request))
        }
    }
}

/// Serves `routes` on `listener`, plain TCP or TLS (handshakes done off the accept loop), and
/// plaintext on `unix` if there is one, on `lanes` or else on this runtime, each connection held
/// to `times`, until `signal`; then closes the listeners, shuts each connection down gracefully,
/// and returns when the last one has ended or `grace` has passed, whichever is first. The lanes
/// stop when this returns.
async fn serve_grpc<T: RateLimitService>(
    routes: GrpcRoutes<T>,
    (listener, unix): (TcpListener, Option<UnixSocket>),
    tls: Option<Arc<TlsSettings>>,
    lanes: Option<lanes::Lanes>,
    times: connection::Times,
    signal: impl Future<Output = ()>,
    grace: Duration,
) {
    let (closing, closing_rx) = tokio::sync::watch::channel(false);
    let mut signal = pin!(signal);
    loop {
        tokio::select! {
            () = &mut signal => break,
            accepted = accept::next(&listener, unix.as_ref()) => {
                accept::dispatch(accepted, lanes.as_ref(), tls.clone(), routes.clone(), times, closing_rx.clone());
            }
        }
    }
    drop(listener);
    // The socket file goes with the listener: new clients fail at once instead of queueing.
    drop(unix);
    close_connections(closing, closing_rx, grace, "connections").await;
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when the
/// future is first polled: a signal that comes as soon as rlsd says it is serving must stop it
/// gracefully, not kill it. Call it inside the runtime.
pub fn termination_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let listen = |kind: SignalKind, name: &'static str| {
        let installed = signal(kind);
        async move {
            match installed {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(error) => {
                    tracing::error!(%error, "cannot listen for {name}");
                    std::future::pending::<()>().await;
                }
            }
        }
    };
    let interrupt = listen(SignalKind::interrupt(), "SIGINT");
    let terminate = listen(SignalKind::terminate(), "SIGTERM");
    async move {
        tokio::select! {
            () = interrupt => tracing::info!("SIGINT received, stopping"),
            () = terminate => tracing::info!("SIGTERM received, stopping"),
        }
    }
}

/// Turns transparent huge pages off for this process, as Redis does by default (`disable-thp`).
///
/// mimalloc asks for huge pages on its arenas and later gives freed memory back; touching it
/// again faults in and zeroes a whole 2 MiB page, which stalls a serving thread for
/// milliseconds in some VMs (measured in `docs/benchmark-log.md`). `--transparent-huge-pages`
/// keeps them, for large in-process stores that gain from fewer TLB misses. A `prctl` because
/// mimalloc reads its own `allow_thp` option before `main` runs, out of reach of a flag.
///
/// # Errors
/// When the kernel refuses `prctl(PR_SET_THP_DISABLE)` (before Linux 3.15, or a seccomp filter).
#[expect(unsafe_code, reason = "a prctl call; the kernel owns the flag")]
pub fn disable_transparent_huge_pages() -> std::io::Result<()> {
    // prctl reads its arguments as unsigned longs.
    let (on, unused): (libc::c_ulong, libc::c_ulong) = (1, 0);
    // SAFETY: PR_SET_THP_DISABLE only sets a flag on this process's memory map.
    let result = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, on, unused, unused, unused) };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Raises the soft limit on open file descriptors to the hard limit, as Go's runtime does, and
/// returns the new limit. Each connection is a descriptor; a soft limit of 1024 (a common
/// default) or 256 lets a few hundred idle connections lock every new client out. The hard
/// limit is what an administrator meant to allow; the soft one is rarely set on purpose.
///
/// # Errors
/// When the limit cannot be read or set.
#[expect(
    unsafe_code,
    reason = "getrlimit and setrlimit on this process's own limit"
)]
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit = raised;
    }
    Ok(limit.rlim_cur)
}

/// Tells every connection holding a receiver of `closing` to close, and waits up to `grace` for
/// them to go; `what` names them in the warning when some do not.
pub(super) async fn close_connections(
    closing: tokio::sync::watch::Sender<bool>,
    closing_rx: tokio::sync::watch::Receiver<bool>,
    grace: std::time::Duration,
    what: &str,
) {
    let _ = closing.send(true);
    drop(closing_rx);
    if tokio::time::timeout(grace, closing.closed()).await.is_err() {
        tracing::warn!(
            connections = closing.receiver_count(),
            ?grace,
            "{what} still open after the shutdown grace period; closing them"
        );
    }
}
