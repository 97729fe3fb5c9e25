//! The one accept path: connections from the TCP and Unix listeners, each handed to a lane (or
//! a task on this runtime without lanes), where the TLS handshake, if any, runs before
//! [`connection::serve`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::watch;

use super::unix::{self, UnixSocket};
use super::{GrpcRoutes, connection, lanes};
use crate::store::Store;
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
pub(super) fn dispatch<S: Store>(
    accepted: Accepted,
    lanes: Option<&lanes::Lanes>,
    tls: Option<Arc<TlsSettings>>,
    routes: GrpcRoutes<S>,
    closing: watch::Receiver<bool>,
) {
    let Some(lanes) = lanes else {
        tokio::spawn(serve(accepted, tls, routes, closing));
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
            Ok(accepted) => serve(accepted, tls, routes, closing).await,
            Err(error) => tracing::debug!(%error, "cannot register a connection on its lane"),
        }
    });
}

/// The TLS handshake when the TCP port has TLS, then the connection.
async fn serve<S: Store>(
    accepted: Accepted,
    tls: Option<Arc<TlsSettings>>,
    routes: GrpcRoutes<S>,
    mut closing: watch::Receiver<bool>,
) {
    match (accepted, tls) {
        (Accepted::Unix(socket), _) => connection::serve(socket, routes, closing).await,
        (Accepted::Tcp(socket, _), None) => connection::serve(socket, routes, closing).await,
        (Accepted::Tcp(socket, peer), Some(tls)) => {
            let handshake =
                crate::tls::handshake(socket, peer, tls.acceptor(), tls.handshake_timeout);
            // A client that never finishes its handshake must not hold up shutdown.
            let handshaken = tokio::select! {
                handshaken = handshake => handshaken,
                _ = closing.wait_for(|closing| *closing) => None,
            };
            if let Some(tls_connection) = handshaken {
                connection::serve(tls_connection, routes, closing).await;
            }
        }
    }
}

/// The next connection on `listener`, with `TCP_NODELAY` set; accept errors are logged and
/// retried (after a pause when they are not about the one connection).
async fn tcp(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((socket, peer)) => {
                if let Err(error) = socket.set_nodelay(true) {
                    tracing::debug!(%peer, %error, "cannot set TCP_NODELAY");
                }
                return (socket, peer);
            }
            Err(error) if per_connection(&error) => {
                tracing::debug!(%error, "accept failed");
            }
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(%error, "accept failed; retrying shortly");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether an accept error concerns only the one connection being accepted.
pub(super) fn per_connection(error: &std::io::Error) -> bool {
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
