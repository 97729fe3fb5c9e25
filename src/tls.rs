//! TLS and mutual TLS on the gRPC port, with certificates reloaded when their files change.
//!
//! The accept loop never waits on a handshake: each connection's task (on its lane) runs
//! [`handshake`] under a timeout with an acceptor made from the current [`ServerConfig`]. A
//! failed handshake is logged at debug and the socket dropped.
//!
//! Reloads work like [`crate::reload`]: the contents of the certificate, key and client CA files
//! are hashed every interval; when they change and still make a valid config, new connections
//! get it, while connections already open keep theirs. Invalid files leave the previous config
//! in place, with a warning.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

/// How often the TLS files are checked for changes unless told otherwise.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(5);

/// Longest a client may take to finish its TLS handshake unless told otherwise.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The only application protocol the gRPC port speaks.
const ALPN_H2: &[u8] = b"h2";

/// Where the gRPC port's TLS material is read from (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server certificate chain, leaf first.
    pub cert: PathBuf,
    /// The server certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// For mutual TLS: the CA certificates client certificates must chain to.
    pub client_ca: Option<PathBuf>,
}

/// Why TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {}: {error}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What reading it said.
        error: io::Error,
    },
    /// A file does not hold what it should.
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The certificate and key cannot serve together (a mismatch, or a key rustls rejects).
    #[error("certificate {} with key {}: {error}", cert.display(), key.display())]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        error: rustls::Error,
    },
}

/// What [`TlsSettings::reload_if_changed`] did.
#[derive(Debug)]
pub enum TlsReload {
    /// New connections get the new certificates.
    Swapped,
    /// The files did not change since the last attempt.
    Unchanged,
    /// The new files are invalid; the previous certificates stay.
    Rejected(TlsError),
}

/// The gRPC port's live TLS config, kept in step with its files.
pub struct TlsSettings {
    files: TlsFiles,
    config: ArcSwap<ServerConfig>,
    /// Fingerprint of the files last loaded (or last rejected), so one change is tried once.
    seen: Mutex<u64>,
    reload_interval: Duration,
    pub(crate) handshake_timeout: Duration,
}

impl std::fmt::Debug for TlsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSettings")
            .field("files", &self.files)
            .field("reload_interval", &self.reload_interval)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl TlsSettings {
    /// Loads and validates `files`, with the default reload interval and handshake timeout.
    ///
    /// # Errors
    /// When a file cannot be read or is not valid, naming the file.
    pub fn load(files: TlsFiles) -> Result<TlsSettings, TlsError> {
        let contents = Contents::read(&files)?;
        let config = build_config(&files, &contents)?;
        Ok(TlsSettings {
            seen: Mutex::new(contents.fingerprint()),
            files,
            config: ArcSwap::from_pointee(config),
            reload_interval: DEFAULT_RELOAD_INTERVAL,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        })
    }

    /// How often [`TlsSettings::watch`] checks the files (never, if zero).
    #[must_use]
    pub fn with_reload_interval(mut self, interval: Duration) -> TlsSettings {
        self.reload_interval = interval;
        self
    }

    /// Longest a client may take to finish its handshake before its socket is dropped.
    #[must_use]
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> TlsSettings {
        self.handshake_timeout = timeout;
        self
    }

    /// The files this config is read from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Whether clients must present a certificate (mutual TLS).
    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }

    /// The config new connections get now.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.config.load_full()
    }

    /// An acceptor for one new connection, from the current config.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config())
    }

    /// Re-reads the files; swaps a new config in if they changed and are valid.
    pub fn reload_if_changed(&self) -> TlsReload {
        let read = Contents::read(&self.files);
        let now = match &read {
            Ok(contents) => contents.fingerprint(),
            Err(error) => fingerprint_of(&error.to_string()),
        };
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *seen == now {
                return TlsReload::Unchanged;
            }
            *seen = now;
        }
        match read.and_then(|contents| build_config(&self.files, &contents)) {
            Ok(config) => {
                self.config.store(Arc::new(config));
                tracing::info!(cert = %self.files.cert.display(), "tls certificates reloaded");
                TlsReload::Swapped
            }
            Err(error) => {
                tracing::warn!(%error, "tls reload rejected, keeping the previous certificates");
                TlsReload::Rejected(error)
            }
        }
    }

    /// Checks the files for changes every reload interval, forever (never, if it is zero).
    pub async fn watch(self: Arc<Self>) {
        if self.reload_interval.is_zero() {
            return;
        }
        let mut tick = tokio::time::interval(self.reload_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let this = Arc::clone(&self);
            if let Err(error) = tokio::task::spawn_blocking(move || this.reload_if_changed()).await
            {
                tracing::error!(%error, "tls reload task failed");
            }
        }
    }
}

/// The bytes of the TLS files, read once so the hash and the config come from the same bytes.
#[derive(Hash)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Contents {
    fn read(files: &TlsFiles) -> Result<Contents, TlsError> {
        Ok(Contents {
            cert: read(&files.cert)?,
            key: read(&files.key)?,
            client_ca: files.client_ca.as_deref().map(read).transpose()?,
        })
    }

    fn fingerprint(&self) -> u64 {
        fingerprint_of(self)
    }
}

fn fingerprint_of(value: &(impl Hash + ?Sized)) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|error| TlsError::Read {
        path: path.to_owned(),
        error,
    })
}

fn invalid(path: &Path, reason: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| invalid(path, format!("invalid PEM certificate: {error}")))?;
    if certs.is_empty() {
        return Err(invalid(
            path,
            "no PEM certificate (BEGIN CERTIFICATE) found",
        ));
    }
    Ok(certs)
}

/// A rustls server config from file contents: ring, TLS 1.2 and 1.3, ALPN `h2`, and client
/// certificates required when there is a client CA.
fn build_config(files: &TlsFiles, contents: &Contents) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates(&files.cert, &contents.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&contents.key)
        .map_err(|error| invalid(&files.key, format!("no usable PEM private key: {error}")))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|error| TlsError::Pair {
            cert: files.cert.clone(),
            key: files.key.clone(),
            error,
        })?;
    let builder = match (&files.client_ca, &contents.client_ca) {
        (Some(path), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates(path, pem)? {
                roots
                    .add(cert)
                    .map_err(|error| invalid(path, format!("not a usable CA: {error}")))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|error| invalid(path, format!("not a usable client CA: {error}")))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|error| TlsError::Pair {
            cert: files.cert.clone(),
            key: files.key.clone(),
            error,
        })?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(config)
}

/// One client connection on the gRPC port, after a successful handshake.
pub struct TlsConnection(tokio_rustls::server::TlsStream<TcpStream>);

impl TlsConnection {
    /// The certificates the client presented (mutual TLS), leaf first.
    pub fn peer_certificates(&self) -> Option<&[CertificateDer<'static>]> {
        self.0.get_ref().1.peer_certificates()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// The TLS handshake on `socket`, bounded by `timeout`; failures are logged and give `None`.
pub(crate) async fn handshake(
    socket: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    timeout: Duration,
) -> Option<TlsConnection> {
    match tokio::time::timeout(timeout, acceptor.accept(socket)).await {
        Ok(Ok(stream)) => Some(TlsConnection(stream)),
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "tls handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, ?timeout, "tls handshake timed out");
            None
        }
    }
}
