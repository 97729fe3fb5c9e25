//! gRPC on a Unix domain socket, for an Envoy on the same host or in the same pod: no TCP stack
//! on either side of each call (Envoy's cluster address is then a `pipe`).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};

/// Why a Unix socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum UnixSocketError {
    /// Another process accepts connections on the path.
    #[error("{0}: another process is serving on this socket")]
    InUse(PathBuf),
    /// The path holds a file that is not a socket; rlsd never deletes one.
    #[error("{0}: exists and is not a socket (remove it or choose another path)")]
    NotASocket(PathBuf),
    /// Binding, or clearing a stale socket, failed.
    #[error("{path}: {source}")]
    Io {
        /// The socket's path.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: io::Error,
    },
}

/// Default permissions of the socket file: owner and group may connect. In Kubernetes, a pod's
/// `fsGroup` owns a shared `emptyDir` and is a group of every container, Envoy's included.
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;

/// A listening Unix socket; its file is removed when this is dropped, if it is still the one
/// rlsd bound.
#[derive(Debug)]
pub struct UnixSocket {
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file rlsd created, so a file another process put at the
    /// path since is never removed.
    identity: (u64, u64),
}

impl UnixSocket {
    /// Binds `path` with permissions `mode` (connecting needs write permission). A socket file
    /// left by a process that died (nothing accepts on it) is replaced; a live socket or any
    /// other kind of file is an error and is left alone.
    ///
    /// # Errors
    /// See [`UnixSocketError`].
    pub fn bind(path: &Path, mode: u32) -> Result<UnixSocket, UnixSocketError> {
        let io_error = |source| UnixSocketError::Io {
            path: path.to_owned(),
            source,
        };
        // Two rlsd starting at once on one stale path could each find it dead, and the second
        // remove the socket the first had just bound. Checking, clearing and binding under a
        // lock on the directory makes the second find the first's socket live instead.
        let _directory_lock = lock_directory_of(path);
        match std::fs::symlink_metadata(path) {
            Ok(metadata) if !metadata.file_type().is_socket() => {
                return Err(UnixSocketError::NotASocket(path.to_owned()));
            }
            Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(UnixSocketError::InUse(path.to_owned())),
                Err(error) if error.kind() == io::ErrorKind::ConnectionRefused => {
                    // Gone already: another process cleared it first (unlocked, see below).
                    if let Err(error) = std::fs::remove_file(path)
                        && error.kind() != io::ErrorKind::NotFound
                    {
                        return Err(io_error(error));
                    }
                }
                Err(error) => return Err(io_error(error)),
            },
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(io_error(error)),
        }
        let listener = UnixListener::bind(path).map_err(io_error)?;
        let metadata = std::fs::symlink_metadata(path).map_err(io_error)?;
        // Owned from here, so a failure below removes the file.
        let socket = UnixSocket {
            listener,
            path: path.to_owned(),
            identity: (metadata.dev(), metadata.ino()),
        };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_error)?;
        Ok(socket)
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Longest wait for the directory lock: another rlsd holds it for a few system calls, but any
/// other program may hold a lock on a shared directory such as `/run` for as long as it likes.
const DIRECTORY_LOCK_WAIT: Duration = Duration::from_secs(1);

/// An exclusive `flock` on the directory holding `path`, held until the file is dropped; none
/// (binding goes on unlocked, as before the lock) when the directory cannot be opened for
/// reading, the filesystem has no locks, or the lock stays taken for [`DIRECTORY_LOCK_WAIT`].
#[expect(unsafe_code, reason = "an flock call on a file it owns")]
fn lock_directory_of(path: &Path) -> Option<std::fs::File> {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let unlocked = |why: &dyn std::fmt::Display| {
        tracing::debug!(directory = %directory.display(), %why, "binding the unix socket unlocked");
        None
    };
    let file = match std::fs::File::open(directory) {
        Ok(file) => file,
        Err(error) => return unlocked(&error),
    };
    let deadline = std::time::Instant::now() + DIRECTORY_LOCK_WAIT;
    loop {
        // SAFETY: flock only takes a lock on the open file descriptor it is given.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Some(file);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::WouldBlock {
            return unlocked(&error);
        }
        if std::time::Instant::now() >= deadline {
            return unlocked(&"the directory's lock stayed taken");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|metadata| (metadata.dev(), metadata.ino()) == self.identity);
        if ours && let Err(error) = std::fs::remove_file(&self.path) {
            tracing::debug!(path = %self.path.display(), %error, "cannot remove the unix socket");
        }
    }
}

/// The next connection on `socket`, or never when there is none; accept errors are logged and
/// retried as on the TCP port.
pub(crate) async fn accept(socket: Option<&UnixSocket>) -> UnixStream {
    let Some(socket) = socket else {
        return std::future::pending().await;
    };
    let mut errors = super::accept::AcceptErrors::default();
    loop {
        match socket.listener.accept().await {
            Ok((stream, _)) => {
                errors.recovered();
                return stream;
            }
            Err(error) => errors.pause(&error).await,
        }
    }
}
