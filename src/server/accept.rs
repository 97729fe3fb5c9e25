//! The one accept path: connections from the TCP and Unix listeners, each handed to a lane (or
//! a task on this runtime without lanes), where the TLS handshake, if any, runs before
//! [`connection::serve`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::watch;

use super::shed::{self, Registration};
use super::unix::{self, UnixSocket};
use super::{GrpcRoutes, connection, lanes};
use crate::pb::RateLimitService;
use crate::tls::TlsSettings;

/// An accepted connection, before any handshake.
pub(super) enum Accepted {
    /// On the TCP port: TLS applies when configured.
    Tcp(TcpStream, SocketAddr),
    /// On the Unix socket: always plaintext.
    Unix(UnixStream),
}

/// The same connection as a std socket, registered with no runtime's reactor yet.
enum Detached {
    Tcp(std::net::TcpStream, SocketAddr),
    Unix(std::os::unix::net::UnixStream),
}

/// The next connection on either listener.
pub(super) async fn next(listener: &TcpListener, unix: Option<&UnixSocket>) -> Accepted {
    tokio::select! {
        (socket, peer) = tcp(listener) => Accepted::Tcp(socket, peer),
        socket = unix::accept(unix) => Accepted::Unix(socket),
    }
}

/// Serves `accepted` on the next lane, or in a task of this runtime without lanes.
pub(super) fn dispatch<T: RateLimitService>(
    accepted: Accepted,
    lanes: Option<&lanes::Lanes>,
    tls: Option<Arc<TlsSettings>>,
    routes: GrpcRoutes<T>,
    times: connection::Times,
    closing: watch::Receiver<bool>,
) {
    let registration = Registration::new(shed::Port::Grpc);
    let Some(lanes) = lanes else {
        tokio::spawn(serve(accepted, registration, tls, routes, times, closing));
        return;
    };
    // Registered with this runtime's reactor, the socket would wake this runtime's threads for
    // every read; as a std socket it is registered afresh on the lane.
    let detached = match accepted {
        Accepted::Tcp(socket, peer) => socket.into_std().map(|socket| Detached::Tcp(socket, peer)),
        Accepted::Unix(socket) => socket.into_std().map(Detached::Unix),
    };
    let detached = match detached {
        Ok(detached) => detached,
        Err(error) => {
            tracing::debug!(%error, "cannot hand a connection to a lane");
            return;
        }
    };
    lanes.spawn(async move {
        let attached = match detached {
            Detached::Tcp(socket, peer) => {
                TcpStream::from_std(socket).map(|socket| Accepted::Tcp(socket, peer))
            }
            Detached::Unix(socket) => UnixStream::from_std(socket).map(Accepted::Unix),
        };
        match attached {
            Ok(accepted) => serve(accepted, registration, tls, routes, times, closing).await,
            Err(error) => tracing::debug!(%error, "cannot register a connection on its lane"),
        }
    });
}

/// The TLS handshake when the TCP port has TLS, then the connection.
async fn serve<T: RateLimitService>(
    accepted: Accepted,
    registration: Registration,
    tls: Option<Arc<TlsSettings>>,
    routes: GrpcRoutes<T>,
    times: connection::Times,
    mut closing: watch::Receiver<bool>,
) {
    match (accepted, tls) {
        (Accepted::Unix(socket), _) => {
            connection::serve(socket, registration, routes, times, closing).await;
        }
        (Accepted::Tcp(socket, _), None) => {
            connection::serve(socket, registration, routes, times, closing).await;
        }
        (Accepted::Tcp(socket, peer), Some(tls)) => {
            let handshake =
                crate::tls::handshake(socket, peer, tls.acceptor(), tls.handshake_timeout);
            // A client that never finishes its handshake must not hold up shutdown, nor keep
            // its descriptor when others need one.
            let handshaken = tokio::select! {
                handshaken = handshake => handshaken,
                _ = closing.wait_for(|closing| *closing) => None,
                () = registration.tracked().shed() => None,
            };
            if let Some(tls_connection) = handshaken {
                connection::serve(tls_connection, registration, routes, times, closing).await;
            }
        }
    }
}

/// The next connection on `listener`, with `TCP_NODELAY` set; accept errors are logged and
/// retried, after a pause when they are not about the one connection (see [`AcceptErrors`]).
pub(super) async fn tcp(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    let mut errors = AcceptErrors::default();
    loop {
        match listener.accept().await {
            Ok((socket, peer)) => {
                errors.recovered();
                if let Err(error) = socket.set_nodelay(true) {
                    tracing::debug!(%peer, %error, "cannot set TCP_NODELAY");
                }
                return (socket, peer);
            }
            Err(error) => errors.pause(&error).await,
        }
    }
}

/// Shortest pause after an accept error that is not about one connection.
const MIN_ACCEPT_PAUSE: Duration = Duration::from_millis(5);
/// Pause after shedding connections, before accepting again.
const SHED_PAUSE: Duration = Duration::from_millis(2);
/// Longest pause: once descriptors are free again, connections wait at most this long.
const MAX_ACCEPT_PAUSE: Duration = Duration::from_secs(1);

/// A run of accept errors. One about the listener rather than one connection (out of file
/// descriptors, above all) fails again at once if retried at once, and the connection stays
/// queued: so the loop pauses, doubling from 5 ms to 1 s as Go's `net/http` does, instead of
/// spinning, and logs a warning once per run, not per attempt. Out of descriptors, it first
/// sheds connections that cost least to lose ([`shed`]) and tries again after a short pause.
#[derive(Default)]
pub(super) struct AcceptErrors {
    failures: u32,
    pause: Duration,
}

impl AcceptErrors {
    /// Logs `error` and pauses, unless it concerns only the connection being accepted.
    pub(super) async fn pause(&mut self, error: &std::io::Error) {
        if per_connection(error) {
            tracing::debug!(%error, "accept failed");
            return;
        }
        self.failures += 1;
        if out_of_descriptors(error) && shed::shed_some() > 0 {
            if self.failures == 1 {
                tracing::warn!(%error, "accept failed; closing connections that sent no request or are idle, to make room");
            }
            // Long enough for the shed connections' tasks to close their sockets.
            tokio::time::sleep(SHED_PAUSE).await;
            return;
        }
        self.pause = (self.pause * 2).clamp(MIN_ACCEPT_PAUSE, MAX_ACCEPT_PAUSE);
        if self.failures == 1 {
            tracing::warn!(%error, "accept failed; retrying, pausing up to 1 s between attempts");
        } else {
            tracing::debug!(%error, failures = self.failures, pause = ?self.pause, "accept failed again");
        }
        tokio::time::sleep(self.pause).await;
    }

    /// Logs the end of a run of failures, if there was one.
    pub(super) fn recovered(&self) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "accepting connections again");
        }
    }
}

/// Whether an accept error says the process or the system has no file descriptor left.
fn out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Whether an accept error concerns only the one connection being accepted.
fn per_connection(error: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        error.kind(),
        ErrorKind::ConnectionAborted
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionRefused
            | ErrorKind::Interrupted
            | ErrorKind::WouldBlock
            | ErrorKind::TimedOut
    )
}
