//! The servers the bench drives: the baseline, rlsd on each store, diagnostics.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use rlsd::config::Config;
use rlsd::metrics::Metrics;
use rlsd::pb::rate_limit_response::{Code, DescriptorStatus};
use rlsd::pb::{
    RateLimitRequest, RateLimitResponse, RateLimitService, RateLimitServiceClient,
    RateLimitServiceServer,
};
use rlsd::server::{self, Listeners, ServeOptions};
use rlsd::service::{HeaderStyle, RateLimiter, ServiceSettings};
use rlsd::store::{MemoryStore, RedisSettings, RedisStore, Store};
use rlsd::telemetry::{OtlpProtocol, Telemetry, TracingSettings};
use rlsd_testkit::rawh2;
use rlsd_testkit::redis::RedisServer;
use rlsd_testkit::workload::{self, Shape};
use tokio::net::TcpListener;
use tokio::runtime::{Handle, Runtime};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

use crate::CLIENTS;
use crate::opts::Opts;
use crate::phases::runtime;
use crate::pooled::PooledStore;

pub(crate) type Client = RateLimitServiceClient<Channel>;

/// The do-nothing server: one OK per descriptor, nothing else. Served by tonic (`baseline`) and
/// on rlsd's own stack (`floor`).
pub(crate) struct Baseline;

#[tonic::async_trait]
impl RateLimitService for Baseline {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let statuses = vec![
            DescriptorStatus {
                code: Code::Ok.into(),
                ..Default::default()
            };
            request.get_ref().descriptors.len()
        ];
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses,
            ..Default::default()
        }))
    }
}

pub(crate) fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

pub(crate) type Limiter = RateLimiter<MemoryStore>;

/// The bench config, shared by every rlsd server of the run.
pub(crate) fn bench_config(algorithm: &str) -> Arc<ArcSwap<Config>> {
    Arc::new(ArcSwap::from_pointee(workload::config(algorithm)))
}

/// rlsd's service on the bench config and a system-clock `MemoryStore`.
pub(crate) fn limiter_with(
    algorithm: &str,
    settings: ServiceSettings,
) -> (Limiter, Arc<ArcSwap<Config>>) {
    let config = bench_config(algorithm);
    let store = Arc::new(MemoryStore::new(rlsd::store::memory::DEFAULT_MAX_KEYS));
    let limiter = RateLimiter::new(Arc::clone(&config), store, settings);
    (limiter, config)
}

/// A server's gRPC address, and its counters when it is rlsd.
pub(crate) type Served = (SocketAddr, Option<Arc<Metrics>>);

/// Starts `limiter` under `server::run_with` (as the binary does) on the current runtime, its
/// connections served on `lanes` of its own (0: on this runtime); returns its gRPC address and
/// counters.
pub(crate) async fn start_server<S: Store>(
    limiter: RateLimiter<S>,
    config: Arc<ArcSwap<Config>>,
    lanes: usize,
) -> Served {
    let metrics = limiter.metrics();
    let listeners = Listeners::bind(loopback(), loopback())
        .await
        .expect("bind rlsd");
    let addr = listeners.grpc.local_addr().expect("rlsd address");
    let listeners = if rawh2::unix_enabled() {
        listeners
            .with_grpc_unix(&rawh2::unix_path(addr), server::DEFAULT_SOCKET_MODE)
            .expect("bind rlsd's unix socket")
    } else {
        listeners
    };
    tokio::spawn(async move {
        let options = ServeOptions {
            lanes,
            ..ServeOptions::default()
        };
        server::run_with(limiter, config, listeners, options, std::future::pending())
            .await
            .expect("rlsd serves");
    });
    (addr, Some(metrics))
}

/// rlsd on the Redis store at `port`: `max_batch` 1 is one EVALSHA per request.
pub(crate) async fn start_redis_rlsd(
    algorithm: &str,
    port: u16,
    max_batch: usize,
    pipelines: usize,
    lanes: usize,
) -> Served {
    let mut settings = RedisSettings::new(format!("redis://127.0.0.1:{port}"));
    settings.command_timeout = Duration::from_secs(1);
    settings.max_batch = max_batch;
    settings.pipelines = pipelines;
    settings.lanes = lanes;
    let store = Arc::new(
        RedisStore::connect(settings)
            .await
            .expect("connect to redis"),
    );
    let config = bench_config(algorithm);
    let limiter = RateLimiter::new(Arc::clone(&config), store, ServiceSettings::default());
    start_server(limiter, config, lanes).await
}

/// Serves `service` on rlsd's own gRPC stack (`server::serve_unary`: lanes, connections, codec)
/// in the rate limiter's place, on `lanes` lanes.
pub(crate) async fn start_unary<T: RateLimitService>(service: T, lanes: usize) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        server::serve_unary(service, listener, lanes, std::future::pending())
            .await
            .expect("floor serves");
    });
    addr
}

/// rlsd on the bench's deadpool-redis store at `port` (see [`crate::pooled`]).
pub(crate) async fn start_pooled_rlsd(
    algorithm: &str,
    port: u16,
    max_batch: usize,
    lanes: usize,
) -> Served {
    let store = PooledStore::new(
        &format!("redis://127.0.0.1:{port}"),
        Duration::from_secs(1),
        max_batch,
    );
    println!(
        "# pool{}: deadpool-redis, {} connections (its default size)",
        if max_batch > 1 { "" } else { "-1" },
        store.max_size()
    );
    let config = bench_config(algorithm);
    let limiter = RateLimiter::new(
        Arc::clone(&config),
        Arc::new(store),
        ServiceSettings::default(),
    );
    start_server(limiter, config, lanes).await
}

/// Serves `service` with the same tonic settings as `server::run`.
pub(crate) async fn start_service<T: RateLimitService>(service: T) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .max_concurrent_streams(Some(server::MAX_CONCURRENT_STREAMS))
            .add_service(RateLimitServiceServer::new(service))
            .serve_with_incoming(incoming)
            .await
            .expect("server serves");
    });
    addr
}

/// An OTLP/gRPC collector that counts the spans it receives, on a thread of its own so its CPU
/// is not counted as the server's.
pub(crate) struct OtlpSink {
    pub(crate) addr: SocketAddr,
    pub(crate) spans: Arc<AtomicU64>,
    pub(crate) _runtime: Runtime,
}

#[derive(Clone)]
pub(crate) struct SpanCounter(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for SpanCounter {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

impl OtlpSink {
    pub(crate) fn start() -> OtlpSink {
        let runtime = runtime(1, "otlp-sink");
        let listener = runtime
            .block_on(TcpListener::bind(loopback()))
            .expect("bind the OTLP sink");
        let addr = listener.local_addr().expect("sink address");
        let spans = Arc::new(AtomicU64::new(0));
        let counter = SpanCounter(Arc::clone(&spans));
        runtime.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(counter))
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
                .expect("the OTLP sink serves");
        });
        OtlpSink {
            addr,
            spans,
            _runtime: runtime,
        }
    }
}

/// Replays fixed answers: rlsd's, captured at start, so the bytes on the wire are the same.
pub(crate) struct Canned {
    /// rlsd's answer by descriptors per request.
    pub(crate) answers: Vec<(usize, RateLimitResponse)>,
}

#[tonic::async_trait]
impl RateLimitService for Canned {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let descriptors = request.get_ref().descriptors.len();
        self.answers
            .iter()
            .find(|(n, _)| *n == descriptors)
            .map(|(_, answer)| Response::new(answer.clone()))
            .ok_or_else(|| Status::invalid_argument("no canned answer for this shape"))
    }
}

/// `count` clients, each on its own HTTP/2 connection.
pub(crate) async fn connect(addr: SocketAddr, count: usize) -> Vec<Client> {
    let mut clients = Vec::with_capacity(count);
    for _ in 0..count {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        clients.push(RateLimitServiceClient::new(channel));
    }
    clients
}

/// The requests of `CLIENTS` distinct clients in `shape`.
pub(crate) fn pool(shape: Shape) -> Arc<Vec<RateLimitRequest>> {
    Arc::new(shape.requests(CLIENTS))
}

/// A traced rlsd's exporter and the sink it exports to.
pub(crate) type Traced = (Telemetry, OtlpSink);

/// Starts every server `opts` asks for; with tracing, also the exporter and the sink it
/// exports to, which must live until the end.
pub(crate) fn start_servers(
    opts: &Opts,
    server_handle: &Handle,
    client_rt: &Runtime,
    pools: &[(Shape, Arc<Vec<RateLimitRequest>>)],
    redis: Option<&RedisServer>,
) -> (Vec<(&'static str, Served)>, Option<Traced>) {
    let algorithm = opts.algorithm.as_str();
    let (limiter, config) = limiter_with(algorithm, ServiceSettings::default());
    let mut addrs: Vec<(&'static str, Served)> = vec![
        (
            "baseline",
            (server_handle.block_on(start_service(Baseline)), None),
        ),
        (
            "rlsd",
            server_handle.block_on(start_server(limiter, config, opts.lanes)),
        ),
        (
            "floor",
            (
                server_handle.block_on(start_unary(Baseline, opts.lanes)),
                None,
            ),
        ),
    ];
    if let Some(redis) = redis {
        let (batch, pipelines) = (opts.max_batch, opts.pipelines);
        addrs.push((
            "redis",
            server_handle.block_on(start_redis_rlsd(
                algorithm, redis.port, batch, pipelines, opts.lanes,
            )),
        ));
        addrs.push((
            "redis-1",
            server_handle.block_on(start_redis_rlsd(algorithm, redis.port, 1, 1, opts.lanes)),
        ));
        if opts.pool {
            addrs.push((
                "pool",
                server_handle.block_on(start_pooled_rlsd(
                    algorithm,
                    redis.port,
                    opts.max_batch,
                    opts.lanes,
                )),
            ));
            addrs.push((
                "pool-1",
                server_handle.block_on(start_pooled_rlsd(algorithm, redis.port, 1, opts.lanes)),
            ));
        }
    }
    if opts.extra {
        // rlsd's own answers, captured once, replayed by a server that does nothing else.
        let rlsd = addrs[1].1.0;
        let answers = client_rt.block_on(async {
            let mut client = connect(rlsd, 1).await.remove(0);
            let mut answers = Vec::new();
            for (shape, requests) in pools {
                let answer = client
                    .should_rate_limit(requests[0].clone())
                    .await
                    .expect("rlsd answers")
                    .into_inner();
                answers.push((shape.descriptors(), answer));
            }
            answers
        });
        addrs.push((
            "canned",
            (
                server_handle.block_on(start_service(Canned { answers })),
                None,
            ),
        ));
        let (limiter, _) = limiter_with(algorithm, ServiceSettings::default());
        addrs.push((
            "rlsd-svc",
            (server_handle.block_on(start_service(limiter)), None),
        ));
        let no_headers = ServiceSettings {
            headers: HeaderStyle::Off,
            ..ServiceSettings::default()
        };
        let (limiter, _) = limiter_with(algorithm, no_headers);
        addrs.push((
            "rlsd-nohdr",
            (server_handle.block_on(start_service(limiter)), None),
        ));
    }
    let mut traced = None;
    if opts.tracing {
        let sink = OtlpSink::start();
        let endpoint = format!("http://{}", sink.addr);
        let telemetry = server_handle.block_on(async {
            Telemetry::start(&TracingSettings {
                service_name: "rlsd-bench".to_owned(),
                service_namespace: String::new(),
                service_instance_id: String::new(),
                sampling_rate: 1.0,
                endpoint: Some(endpoint),
                protocol: OtlpProtocol::Grpc,
            })
            .expect("start tracing")
        });
        let (limiter, config) = limiter_with(algorithm, ServiceSettings::default());
        let limiter = limiter.with_tracing(telemetry.tracer());
        addrs.push((
            "rlsd-traced",
            server_handle.block_on(start_server(limiter, config, opts.lanes)),
        ));
        traced = Some((telemetry, sink));
    }
    if let Some(only) = &opts.only {
        addrs.retain(|(name, _)| only.iter().any(|o| o == name));
    }
    (addrs, traced)
}
