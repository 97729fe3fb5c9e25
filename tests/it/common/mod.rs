//! Starts a real rlsd server (and, for Redis tests, a real redis-server) on loopback ports.
#![allow(dead_code)]

pub mod pki;
pub mod process;

use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rlsd::clock::ManualClock;
use rlsd::config;
use rlsd::engine::KeySettings;
use rlsd::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitServiceClient};
use rlsd::server::{self, Listeners, ServeOptions};
use rlsd::service::{HeaderStyle, RateLimiter, ServiceSettings};
use rlsd::store::{MemoryStore, Store};
pub use rlsd_testkit::workload::descriptor;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// Serving lanes of the servers tests start, as the binary runs one per core.
pub const LANES: usize = 2;

/// Start of a minute, so fixed windows in tests start fresh: 2026-12-02 15:00:00 UTC.
pub const T0: u64 = 1_796_223_600_000_000;

/// A running server and the handles a test drives it with.
pub struct TestServer {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    pub clock: ManualClock,
    /// The in-process store, when the server runs on one.
    pub store: Arc<MemoryStore<ManualClock>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Parses one config file's text into a live config.
pub fn live_config(yaml: &str) -> Arc<ArcSwap<config::Config>> {
    let domain = config::load_str("test.yaml", yaml).expect("test config is valid");
    let mut loaded = config::Config::default();
    loaded.domains.insert(domain.name.clone(), domain);
    Arc::new(ArcSwap::from_pointee(loaded))
}

/// Serves `yaml` from `store` on loopback ports, on [`LANES`] lanes; returns the addresses and a
/// stop handle.
pub async fn spawn_server<S: Store>(
    yaml: &str,
    store: Arc<S>,
    settings: ServiceSettings,
) -> (
    SocketAddr,
    SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let options = ServeOptions {
        lanes: LANES,
        ..ServeOptions::default()
    };
    let (grpc, http, stop, task, _) = spawn_server_with(yaml, store, settings, options).await;
    (grpc, http, stop, task)
}

/// [`spawn_server`] with server options; also returns the server's metrics.
pub async fn spawn_server_with<S: Store>(
    yaml: &str,
    store: Arc<S>,
    settings: ServiceSettings,
    options: ServeOptions,
) -> (
    SocketAddr,
    SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    Arc<rlsd::metrics::Metrics>,
) {
    let config = live_config(yaml);
    let limiter = RateLimiter::new(Arc::clone(&config), store, settings);
    let metrics = limiter.metrics();
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("address");
    let listeners = Listeners::bind(loopback, loopback).await.expect("bind");
    let grpc = listeners.grpc.local_addr().expect("grpc addr");
    let http = listeners.http.local_addr().expect("http addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        server::run_with(limiter, config, listeners, options, async {
            let _ = stopped.await;
        })
        .await
        .expect("server runs");
    });
    (grpc, http, stop, task, metrics)
}

impl TestServer {
    /// Serves one config file's text with the default settings.
    pub async fn start(yaml: &str) -> TestServer {
        TestServer::start_with(yaml, HeaderStyle::XRatelimit, 10_000).await
    }

    /// Serves `yaml` with the given header style and key cap.
    pub async fn start_with(yaml: &str, headers: HeaderStyle, max_keys: usize) -> TestServer {
        let settings = ServiceSettings {
            keys: KeySettings::default(),
            headers,
            failure_mode: Default::default(),
            shadow_mode: false,
            limits: Default::default(),
            ..Default::default()
        };
        TestServer::start_settings(yaml, settings, max_keys).await
    }

    /// Serves `yaml` with `settings` on an in-process store of `max_keys` keys.
    pub async fn start_settings(
        yaml: &str,
        settings: ServiceSettings,
        max_keys: usize,
    ) -> TestServer {
        let clock = ManualClock::at(T0);
        let store = Arc::new(MemoryStore::with_clock(max_keys, clock.clone()));
        let (grpc, http, stop, task) = spawn_server(yaml, Arc::clone(&store), settings).await;
        TestServer {
            grpc,
            http,
            clock,
            store,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// A client of our own generated types.
    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect")
    }

    /// `GET path` on the admin port: status code and body.
    pub async fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.http, path).await
    }

    /// Stops the server and waits for it to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("server task");
        }
    }
}

/// A request for `domain` with `descriptors`.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

/// `GET path` on an admin port over a plain HTTP/1.1 socket: status code and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    http_request(addr, &request).await
}

/// `POST path` with a JSON body: status code and body.
pub async fn http_post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    http_request(addr, &request).await
}

async fn http_request(addr: SocketAddr, request: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect admin port");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Sends `per_task` requests of `descriptors` in `domain` from each of `tasks` concurrent tasks,
/// task `i` on `clients[i % clients.len()]`; how many were allowed.
pub async fn allowed_of(
    clients: &[RateLimitServiceClient<Channel>],
    domain: &str,
    tasks: usize,
    per_task: usize,
    descriptors: Vec<RateLimitDescriptor>,
) -> usize {
    let tasks: Vec<_> = (0..tasks)
        .map(|i| {
            let mut client = clients[i % clients.len()].clone();
            let (domain, descriptors) = (domain.to_owned(), descriptors.clone());
            tokio::spawn(async move {
                let mut ok = 0;
                for _ in 0..per_task {
                    let response = client
                        .should_rate_limit(request(&domain, descriptors.clone()))
                        .await
                        .expect("answer")
                        .into_inner();
                    ok += usize::from(
                        response.overall_code == rlsd::pb::rate_limit_response::Code::Ok as i32,
                    );
                }
                ok
            })
        })
        .collect();
    let mut allowed = 0;
    for task in tasks {
        allowed += task.await.expect("task");
    }
    allowed
}
