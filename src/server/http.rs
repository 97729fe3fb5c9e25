//! The HTTP/1 ports: admin, `--debug-addr` and `--metrics-addr`, on one accept and connection
//! path with deadlines a slow client cannot stretch.
//!
//! `axum::serve` gives hyper no timer, so hyper's header read timeout never ran: 200 connections
//! that sent one header line every 5 s, and 200 that sent nothing, were all still open after 37
//! s, each holding a descriptor. Here each request head must arrive within a deadline, counted
//! from when the connection starts waiting for it (after connecting, or after the previous
//! answer on a kept-alive connection), and request bodies are held to the same
//! [`BodyLimits`] as gRPC's.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tonic::codegen::BoxFuture;

use super::accept;
use super::body::{BodyGuard, BodyLimits, BodyShape};
use super::shed::{self, Registration, Tracked};

/// A router whose requests' bodies are held to [`BodyLimits`]; clone it once per connection.
#[derive(Clone)]
pub(super) struct Guarded {
    router: TowerToHyperService<Router>,
    bodies: BodyGuard,
    /// The connection's state for shedding: a request in flight or not.
    tracked: Option<Arc<Tracked>>,
}

impl Guarded {
    /// `router`, its request bodies held to `bodies`.
    pub(super) fn new(router: Router, bodies: Arc<BodyLimits>) -> Guarded {
        Guarded {
            router: TowerToHyperService::new(router),
            bodies: BodyGuard::new(&bodies),
            tracked: None,
        }
    }

    /// This router for the connection `registration` holds.
    fn for_connection(&self, registration: &Registration) -> Guarded {
        Guarded {
            tracked: Some(Arc::clone(registration.tracked())),
            ..self.clone()
        }
    }
}

impl hyper::service::Service<::http::Request<Incoming>> for Guarded {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = BoxFuture<axum::response::Response, Infallible>;

    fn call(&self, request: ::http::Request<Incoming>) -> Self::Future {
        // HTTP/1: one request at a time on the connection.
        let tracked = self.tracked.clone();
        if let Some(tracked) = &tracked {
            tracked.busy(true);
        }
        let answer = self
            .router
            .call(request.map(|body| self.bodies.guard(body, BodyShape::Opaque)));
        Box::pin(async move {
            let answer = answer.await;
            if let Some(tracked) = tracked {
                tracked.busy(false);
            }
            answer
        })
    }
}

/// Serves `service` on `listener` until `signal`; then stops accepting, shuts each connection
/// down gracefully (an idle one closes at once) and returns when the last has ended or `grace`
/// has passed.
pub(super) async fn serve(
    listener: TcpListener,
    service: Guarded,
    header_timeout: Duration,
    signal: impl Future<Output = ()>,
    grace: Duration,
) {
    let (closing, closing_rx) = watch::channel(false);
    let mut signal = pin!(signal);
    loop {
        tokio::select! {
            () = &mut signal => break,
            (socket, _) = accept::tcp(&listener) => {
                let registration = Registration::new(shed::Port::Http);
                let service = service.for_connection(&registration);
                tokio::spawn(connection(socket, registration, service, header_timeout, closing_rx.clone()));
            }
        }
    }
    drop(listener);
    super::close_connections(closing, closing_rx, grace, "HTTP connections").await;
}

/// One HTTP/1 connection, kept alive between requests, each request head due within
/// `header_timeout`; holds `closing` until it ends.
async fn connection(
    socket: TcpStream,
    registration: Registration,
    service: Guarded,
    header_timeout: Duration,
    mut closing: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    let mut connection = pin!(builder.serve_connection(TokioIo::new(socket), service));
    let closed_early = tokio::select! {
        result = connection.as_mut() => Some(result),
        _ = closing.wait_for(|closing| *closing) => None,
        () = registration.tracked().shed() => return,
    };
    let result = match closed_early {
        Some(result) => result,
        None => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "HTTP connection ended with an error");
    }
    drop(closing);
}
