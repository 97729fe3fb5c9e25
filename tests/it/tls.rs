//! TLS over real sockets: the gRPC port with TLS and mutual TLS, certificate reloads, a port a
//! plain-text client cannot use, and the Redis store over `rediss://` with an ACL user.
//!
//! Certificates are made by the `openssl` CLI in a temporary directory, per test.

use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pki::{Issued, Leaf, Pki};
use common::{descriptor, request, spawn_server_with};
use rlsd::algorithm::{Hits, Params};
use rlsd::limit::Algorithm;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::server::ServeOptions;
use rlsd::service::ServiceSettings;
use rlsd::store::{
    Check, ClientIdentity, ClusterSettings, ClusterStore, MemoryStore, RedisSettings, RedisStore,
    Store, StoreError,
};
use rlsd::tls::{TlsError, TlsFiles, TlsReload, TlsSettings};
use rlsd_testkit::cluster::{ClusterTls, RedisCluster};
use rlsd_testkit::redis::{RedisServer, RedisTls};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const CONFIG: &str = r#"
domain: tls
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100}
"#;

/// How often test servers look at their TLS files.
const RELOAD: Duration = Duration::from_millis(100);

/// Replaces `to`'s contents with `from`'s the way a secret update does: a new file renamed over.
fn replace_file(from: &Path, to: &Path) {
    let staged = to.with_extension("staged");
    std::fs::copy(from, &staged).expect("copy");
    std::fs::rename(&staged, to).expect("rename");
}

/// The files a server is started from, in their own directory so tests can rewrite them.
fn serving_files(pki: &Pki, server: &Issued, client_ca: Option<&Issued>) -> TlsFiles {
    let files = TlsFiles {
        cert: pki.path("serving.crt"),
        key: pki.path("serving.key"),
        client_ca: client_ca.map(|_| pki.path("serving-client-ca.crt")),
    };
    std::fs::copy(&server.cert, &files.cert).expect("copy cert");
    std::fs::copy(&server.key, &files.key).expect("copy key");
    if let (Some(ca), Some(path)) = (client_ca, &files.client_ca) {
        std::fs::copy(&ca.cert, path).expect("copy client ca");
    }
    files
}

fn settings() -> ServiceSettings {
    ServiceSettings::default()
}

struct TlsServer {
    grpc: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsServer {
    /// Serves on lanes, as the binary does: each lane does its connections' handshakes.
    async fn start(tls: TlsSettings) -> TlsServer {
        TlsServer::start_on(tls, common::LANES).await
    }

    /// Serves with `lanes` (0: handshakes and connections on the test's runtime).
    async fn start_on(tls: TlsSettings, lanes: usize) -> TlsServer {
        let store = Arc::new(MemoryStore::new(1000));
        let options = ServeOptions {
            tls: Some(Arc::new(tls)),
            lanes,
            ..ServeOptions::default()
        };
        let (grpc, _http, stop, task, _) =
            spawn_server_with(CONFIG, store, settings(), options).await;
        TlsServer { grpc, stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("server stops")
            .expect("server task");
    }
}

/// A gRPC client over TLS trusting `ca`, presenting `identity` if given.
async fn tls_client(
    addr: SocketAddr,
    ca: &Issued,
    identity: Option<&Issued>,
) -> Result<RateLimitServiceClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.cert_pem()))
        .domain_name("localhost");
    if let Some(identity) = identity {
        tls = tls.identity(Identity::from_pem(identity.cert_pem(), identity.key_pem()));
    }
    let channel = Channel::from_shared(format!("https://{addr}"))
        .expect("uri")
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await?;
    Ok(RateLimitServiceClient::new(channel))
}

/// One ShouldRateLimit over TLS: the answer's code, or why there was none.
async fn ask(addr: SocketAddr, ca: &Issued, identity: Option<&Issued>) -> Result<Code, String> {
    let mut client = tls_client(addr, ca, identity)
        .await
        .map_err(|error| format!("connect: {error:?}"))?;
    let response = client
        .should_rate_limit(request("tls", vec![descriptor(&[("user", "u")])]))
        .await
        .map_err(|status| format!("call: {status:?}"))?;
    Ok(response.into_inner().overall_code())
}

fn client_config(ca: &Issued) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    roots.add(ca.der()).expect("CA");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    config
}

/// A fresh TLS handshake with the server: the certificate it presented and the ALPN protocol.
async fn handshake(addr: SocketAddr, ca: &Issued) -> (CertificateDer<'static>, Option<Vec<u8>>) {
    let tcp = TcpStream::connect(addr).await.expect("tcp connect");
    let name = ServerName::try_from("localhost").expect("server name");
    let tls = TlsConnector::from(Arc::new(client_config(ca)))
        .connect(name, tcp)
        .await
        .expect("tls handshake");
    let session = tls.get_ref().1;
    let leaf = session
        .peer_certificates()
        .and_then(|certs| certs.first())
        .expect("server certificate")
        .clone()
        .into_owned();
    (leaf, session.alpn_protocol().map(<[u8]>::to_vec))
}

/// Waits until `condition` holds, for up to 10 s.
async fn wait_for<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_gets_an_answer_over_h2() {
    for lanes in [common::LANES, 0] {
        a_tls_client_gets_an_answer_over_h2_on(lanes).await;
    }
}

async fn a_tls_client_gets_an_answer_over_h2_on(lanes: usize) {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let tls = TlsSettings::load(serving_files(&pki, &server_cert, None)).expect("valid files");
    assert!(!tls.mutual());
    let server = TlsServer::start_on(tls, lanes).await;

    assert_eq!(ask(server.grpc, &ca, None).await, Ok(Code::Ok));
    let (leaf, alpn) = handshake(server.grpc, &ca).await;
    assert_eq!(leaf, server_cert.der());
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_text_client_cannot_talk_to_the_tls_port() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let tls = TlsSettings::load(serving_files(&pki, &server_cert, None)).expect("valid files");
    let server = TlsServer::start(tls).await;

    let plain = async {
        let channel = Channel::from_shared(format!("http://{}", server.grpc))
            .expect("uri")
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|error| format!("{error:?}"))?;
        RateLimitServiceClient::new(channel)
            .should_rate_limit(request("tls", vec![descriptor(&[("user", "u")])]))
            .await
            .map_err(|status| format!("{status:?}"))
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), plain)
        .await
        .expect("the plain-text client is refused promptly");
    assert!(answer.is_err(), "plain text got an answer: {answer:?}");

    // A client that is not TLS at all (raw bytes) gets the socket closed, not an answer.
    let mut raw = TcpStream::connect(server.grpc).await.expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut raw, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the server closes a non-TLS connection");
    assert!(
        !buf.windows(4).any(|w| w == b"HTTP") && buf.len() < 64,
        "no HTTP/2 answer, at most a TLS alert: {buf:?}"
    );

    // The port still serves TLS clients.
    assert_eq!(ask(server.grpc, &ca, None).await, Ok(Code::Ok));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_accepts_only_clients_with_a_certificate_from_the_ca() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let clients_ca = pki.ca("clients-ca");
    let other_ca = pki.ca("other-ca");
    let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let envoy = pki.issue(&clients_ca, "envoy", Leaf::Client, 20);
    let stranger = pki.issue(&other_ca, "stranger", Leaf::Client, 30);
    let tls = TlsSettings::load(serving_files(&pki, &server_cert, Some(&clients_ca)))
        .expect("valid files");
    assert!(tls.mutual());
    let server = TlsServer::start(tls).await;

    assert_eq!(ask(server.grpc, &ca, Some(&envoy)).await, Ok(Code::Ok));
    let anonymous = ask(server.grpc, &ca, None).await;
    assert!(anonymous.is_err(), "no certificate: {anonymous:?}");
    let foreign = ask(server.grpc, &ca, Some(&stranger)).await;
    assert!(foreign.is_err(), "certificate from another CA: {foreign:?}");
    // Refusals do not disturb the port.
    assert_eq!(ask(server.grpc, &ca, Some(&envoy)).await, Ok(Code::Ok));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_certificate_is_served_to_new_connections_without_restart() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let first = pki.issue(&ca, "rlsd-first", Leaf::Server, 100);
    let second = pki.issue(&ca, "rlsd-second", Leaf::Server, 200);
    let files = serving_files(&pki, &first, None);
    let tls = TlsSettings::load(files.clone())
        .expect("valid files")
        .with_reload_interval(RELOAD);
    let server = TlsServer::start(tls).await;
    assert_eq!(handshake(server.grpc, &ca).await.0, first.der());
    // A connection opened before the swap keeps working after it.
    let mut before = tls_client(server.grpc, &ca, None).await.expect("connect");

    replace_file(&second.key, &files.key);
    replace_file(&second.cert, &files.cert);
    wait_for("the new certificate", || async {
        handshake(server.grpc, &ca).await.0 == second.der()
    })
    .await;
    assert_eq!(ask(server.grpc, &ca, None).await, Ok(Code::Ok));
    let answer = before
        .should_rate_limit(request("tls", vec![descriptor(&[("user", "u")])]))
        .await;
    assert!(answer.is_ok(), "old connection: {answer:?}");

    // Broken files are rejected: the last good certificate stays.
    std::fs::write(&files.cert, "not a certificate").expect("write");
    tokio::time::sleep(RELOAD * 5).await;
    assert_eq!(handshake(server.grpc, &ca).await.0, second.der());
    assert_eq!(ask(server.grpc, &ca, None).await, Ok(Code::Ok));
    // A certificate whose key is the other one's is rejected too.
    replace_file(&first.cert, &files.cert);
    tokio::time::sleep(RELOAD * 5).await;
    assert_eq!(handshake(server.grpc, &ca).await.0, second.der());
    // And fixing the files takes effect.
    replace_file(&first.key, &files.key);
    wait_for("the first certificate again", || async {
        handshake(server.grpc, &ca).await.0 == first.der()
    })
    .await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_client_ca_applies_to_new_connections() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let old_ca = pki.ca("old-clients");
    let new_ca = pki.ca("new-clients");
    let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let old_client = pki.issue(&old_ca, "old-envoy", Leaf::Client, 20);
    let new_client = pki.issue(&new_ca, "new-envoy", Leaf::Client, 30);
    let files = serving_files(&pki, &server_cert, Some(&old_ca));
    let client_ca = files.client_ca.clone().expect("client ca");
    let tls = TlsSettings::load(files)
        .expect("valid files")
        .with_reload_interval(RELOAD);
    let server = TlsServer::start(tls).await;
    assert_eq!(ask(server.grpc, &ca, Some(&old_client)).await, Ok(Code::Ok));
    assert!(ask(server.grpc, &ca, Some(&new_client)).await.is_err());

    replace_file(&new_ca.cert, &client_ca);
    wait_for("the new client CA", || async {
        ask(server.grpc, &ca, Some(&new_client)).await == Ok(Code::Ok)
    })
    .await;
    assert!(ask(server.grpc, &ca, Some(&old_client)).await.is_err());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_neither_blocks_others_nor_lingers() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let tls = TlsSettings::load(serving_files(&pki, &server_cert, None))
        .expect("valid files")
        .with_handshake_timeout(Duration::from_secs(3));
    let server = TlsServer::start(tls).await;

    // Connections that never send a ClientHello.
    let mut silent = Vec::new();
    for _ in 0..5 {
        silent.push(TcpStream::connect(server.grpc).await.expect("connect"));
    }
    let started = Instant::now();
    assert_eq!(ask(server.grpc, &ca, None).await, Ok(Code::Ok));
    // Well before the silent handshakes time out: they did not hold up the accept loop.
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "served at once"
    );
    for mut socket in silent {
        let mut buf = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut buf))
            .await
            .expect("the server closes a stalled handshake");
        assert!(closed.is_ok_and(|n| n == 0) || buf.is_empty());
    }
    server.stop().await;
}

/// A client that connects and never sends its ClientHello (a TCP probe, a stuck client) does not
/// hold up shutdown, on lanes or off them, however long the handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_does_not_hold_up_shutdown() {
    for lanes in [common::LANES, 0] {
        let pki = Pki::new();
        let ca = pki.ca("ca");
        let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
        let tls = TlsSettings::load(serving_files(&pki, &server_cert, None))
            .expect("valid files")
            .with_handshake_timeout(Duration::from_secs(60));
        let server = TlsServer::start_on(tls, lanes).await;
        let silent = TcpStream::connect(server.grpc).await.expect("connect");
        // The server has taken the connection and is waiting in its handshake.
        assert_eq!(ask(server.grpc, &ca, None).await, Ok(Code::Ok));
        let started = Instant::now();
        server.stop().await;
        // The shutdown grace (10 s) would end the wait too; the handshake must not last that long.
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{lanes} lanes: stopping took {:?}",
            started.elapsed()
        );
        drop(silent);
    }
}

#[test]
fn invalid_files_are_errors_naming_the_file() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let good = pki.issue(&ca, "good", Leaf::Server, 1);
    let other = pki.issue(&ca, "other", Leaf::Server, 2);
    let garbage = pki.path("garbage.pem");
    std::fs::write(&garbage, "not PEM at all").expect("write");
    let missing = pki.path("missing.pem");
    let load = |cert: &Path, key: &Path, client_ca: Option<&Path>| {
        TlsSettings::load(TlsFiles {
            cert: cert.to_owned(),
            key: key.to_owned(),
            client_ca: client_ca.map(Path::to_owned),
        })
        .map(|_| ())
    };

    let error = load(&garbage, &good.key, None).expect_err("garbage cert");
    assert!(matches!(error, TlsError::Invalid { ref path, .. } if *path == garbage));
    assert!(error.to_string().contains("garbage.pem"), "{error}");
    let error = load(&good.cert, &garbage, None).expect_err("garbage key");
    assert!(error.to_string().contains("garbage.pem"), "{error}");
    let error = load(&missing, &good.key, None).expect_err("missing cert");
    assert!(matches!(error, TlsError::Read { .. }));
    assert!(error.to_string().contains("missing.pem"), "{error}");
    let error = load(&good.cert, &other.key, None).expect_err("mismatched key");
    assert!(matches!(error, TlsError::Pair { .. }), "{error}");
    assert!(error.to_string().contains("other.key"), "{error}");
    let error = load(&good.cert, &good.key, Some(&garbage)).expect_err("garbage client CA");
    assert!(error.to_string().contains("garbage.pem"), "{error}");
    assert!(load(&good.cert, &good.key, Some(&ca.cert)).is_ok());
}

#[test]
fn reload_reports_what_it_did() {
    let pki = Pki::new();
    let ca = pki.ca("ca");
    let first = pki.issue(&ca, "first", Leaf::Server, 1);
    let second = pki.issue(&ca, "second", Leaf::Server, 2);
    let files = serving_files(&pki, &first, None);
    let tls = TlsSettings::load(files.clone()).expect("valid");
    assert!(matches!(tls.reload_if_changed(), TlsReload::Unchanged));
    std::fs::write(&files.cert, "broken").expect("write");
    assert!(matches!(tls.reload_if_changed(), TlsReload::Rejected(_)));
    // One rejection per change, not one per poll.
    assert!(matches!(tls.reload_if_changed(), TlsReload::Unchanged));
    std::fs::remove_file(&files.cert).expect("remove");
    assert!(matches!(
        tls.reload_if_changed(),
        TlsReload::Rejected(TlsError::Read { .. })
    ));
    replace_file(&second.cert, &files.cert);
    replace_file(&second.key, &files.key);
    assert!(matches!(tls.reload_if_changed(), TlsReload::Swapped));
    assert!(matches!(tls.reload_if_changed(), TlsReload::Unchanged));
}

/// A redis-server on TLS only, its CA, and the ACL user `rlsd` / `s3cret`.
fn tls_redis(pki: &Pki) -> (RedisServer, Issued) {
    let ca = pki.ca("redis-ca");
    let cert = pki.issue(&ca, "redis", Leaf::Server, 7);
    let redis = RedisServer::start_tls(RedisTls {
        cert: cert.cert,
        key: cert.key,
        ca: ca.cert.clone(),
        user: "rlsd".to_owned(),
        password: "s3cret".to_owned(),
        client_cert: None,
    });
    (redis, ca)
}

fn check(key: &str) -> Check {
    Check {
        key: key.to_owned(),
        params: Params {
            algorithm: Algorithm::FixedWindow,
            limit: 2,
            period_us: 60_000_000,
            burst: 2,
        },
        hits: Hits::Take(1),
        shadow: false,
        quota_mode: false,
    }
}

async fn redis_store(url: String, ca: Option<&Issued>) -> Result<RedisStore, StoreError> {
    redis_store_as(url, ca, None).await
}

async fn redis_store_as(
    url: String,
    ca: Option<&Issued>,
    identity: Option<&Issued>,
) -> Result<RedisStore, StoreError> {
    let mut settings = RedisSettings::new(url);
    settings.command_timeout = Duration::from_secs(2);
    settings.connect_timeout = Duration::from_secs(2);
    settings.ca_file = ca.map(|ca| ca.cert.clone());
    settings.client_identity = identity.map(|identity| ClientIdentity {
        cert: identity.cert.clone(),
        key: identity.key.clone(),
    });
    RedisStore::connect(settings).await
}

/// A Redis that wants client certificates (`tls-auth-clients yes`, as Envoy Gateway's
/// `REDIS_TLS_CLIENT_CERT/KEY` are for): rlsd decides presenting one its CA signed, and is
/// turned away without one or with one another CA signed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_presents_a_client_certificate_when_redis_wants_one() {
    let pki = Pki::new();
    let ca = pki.ca("mtls-redis-ca");
    let server = pki.issue(&ca, "redis", Leaf::Server, 11);
    let client = pki.issue(&ca, "rlsd-client", Leaf::Client, 12);
    let stranger_ca = pki.ca("stranger-ca");
    let stranger = pki.issue(&stranger_ca, "stranger", Leaf::Client, 13);
    let redis = RedisServer::start_tls(RedisTls {
        cert: server.cert,
        key: server.key,
        ca: ca.cert.clone(),
        user: "rlsd".to_owned(),
        password: "s3cret".to_owned(),
        client_cert: Some((client.cert.clone(), client.key.clone())),
    });

    let store = redis_store_as(redis.url(), Some(&ca), Some(&client))
        .await
        .expect("url");
    for expected in [true, true, false] {
        let outcomes = store.decide(&[check("mtls:k")]).await.expect("decided");
        assert_eq!(outcomes[0].verdict.allowed, expected);
    }
    for (name, identity) in [("none", None), ("stranger", Some(&stranger))] {
        let key = format!("mtls:{name}");
        let refused = redis_store_as(redis.url(), Some(&ca), identity)
            .await
            .expect("url");
        let outcome = refused.decide(&[check(&key)]).await;
        assert!(outcome.is_err(), "{name}: {outcome:?}");
        assert_eq!(redis.cli(&["EXISTS", &key]).as_deref(), Some("0"));
    }
    assert_eq!(redis.cli(&["EXISTS", "mtls:k"]).as_deref(), Some("1"));

    // A key file holding no key is a config error naming it.
    let mut settings = RedisSettings::new(redis.url());
    settings.client_identity = Some(ClientIdentity {
        cert: client.cert.clone(),
        key: client.cert.clone(),
    });
    let error = RedisStore::connect(settings).await.err().expect("refused");
    assert!(matches!(error, StoreError::Config(_)), "{error}");
    assert!(error.to_string().contains("client key"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_decides_over_rediss_with_an_acl_user() {
    let pki = Pki::new();
    let (redis, ca) = tls_redis(&pki);

    let store = redis_store(redis.url(), Some(&ca)).await.expect("url");
    assert!(store.ping().await);
    for expected in [true, true, false] {
        let outcomes = store.decide(&[check("tls:k")]).await.expect("decided");
        assert_eq!(outcomes[0].verdict.allowed, expected);
    }
    assert_eq!(redis.cli(&["EXISTS", "tls:k"]).as_deref(), Some("1"));

    // A wrong password is refused.
    let wrong = redis_store(redis.tls_url("rlsd", "wrong"), Some(&ca))
        .await
        .expect("url");
    assert!(!wrong.ping().await);
    let refused = wrong.decide(&[check("tls:wrong")]).await;
    assert!(refused.is_err(), "wrong password: {refused:?}");
    // Without --redis-ca, the private CA is not trusted.
    let untrusted = redis_store(redis.url(), None).await.expect("url");
    let refused = untrusted.decide(&[check("tls:untrusted")]).await;
    assert!(refused.is_err(), "untrusted CA: {refused:?}");
    assert_eq!(redis.cli(&["EXISTS", "tls:wrong"]).as_deref(), Some("0"));
    assert_eq!(
        redis.cli(&["EXISTS", "tls:untrusted"]).as_deref(),
        Some("0")
    );
}

/// A Redis Cluster on TLS only (clients, replication, bus), under a private CA: the cluster
/// store decides with `--redis-ca`, and cannot connect without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_store_decides_over_rediss_with_a_private_ca() {
    let pki = Pki::new();
    let ca = pki.ca("cluster-ca");
    let cert = pki.issue(&ca, "redis-cluster", Leaf::Server, 8);
    let node = pki.issue(&ca, "redis-cluster-node", Leaf::Client, 9);
    let cluster = RedisCluster::start_tls(ClusterTls {
        cert: cert.cert,
        key: cert.key,
        ca: ca.cert.clone(),
        client_cert: node.cert,
        client_key: node.key,
    });
    let settings = |ca_file: Option<PathBuf>| {
        let mut settings = ClusterSettings::new(cluster.urls());
        settings.connect_timeout = Duration::from_secs(2);
        settings.command_timeout = Duration::from_secs(2);
        settings.ca_file = ca_file;
        settings
    };
    let store = ClusterStore::connect(settings(Some(ca.cert.clone())))
        .await
        .expect("connects over TLS");
    for expected in [true, true, false] {
        let outcomes = store.decide(&[check("tls:c")]).await.expect("decided");
        assert_eq!(outcomes[0].verdict.allowed, expected);
    }
    let master = cluster.master_of("tls:c").expect("a master holds the key");
    assert_eq!(
        cluster.cli(master, &["EXISTS", "tls:c"]).as_deref(),
        Some("1")
    );
    // Without the CA, the nodes' certificates are not trusted.
    let untrusted = ClusterStore::connect(settings(None)).await;
    assert!(untrusted.is_err(), "connected without the CA");
}

#[tokio::test]
async fn a_bad_redis_ca_is_a_config_error_naming_the_file() {
    let pki = Pki::new();
    let garbage = pki.path("garbage-ca.pem");
    std::fs::write(&garbage, "nothing here").expect("write");
    let mut settings = RedisSettings::new("rediss://127.0.0.1:1");
    settings.ca_file = Some(garbage);
    let error = RedisStore::connect(settings).await.err().expect("refused");
    assert!(matches!(error, StoreError::Config(_)), "{error}");
    assert!(error.to_string().contains("garbage-ca.pem"), "{error}");

    let ca = pki.ca("ca");
    let mut settings = RedisSettings::new("redis://127.0.0.1:1");
    settings.ca_file = Some(ca.cert);
    let error = RedisStore::connect(settings)
        .await
        .err()
        .expect("a CA needs rediss://");
    assert!(error.to_string().contains("rediss://"), "{error}");
}

const RLSD: &str = env!("CARGO_BIN_EXE_rlsd");

use common::process::Rlsd;

#[test]
fn serve_refuses_to_start_on_invalid_tls_files() {
    let pki = Pki::new();
    let garbage = pki.path("bad-cert.pem");
    std::fs::write(&garbage, "nothing").expect("write");
    let output = Command::new(RLSD)
        .args(["serve", "--config", "examples/three-layer.yaml"])
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .arg("--tls-cert")
        .arg(&garbage)
        .arg("--tls-key")
        .arg(&garbage)
        .output()
        .expect("run rlsd");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad-cert.pem"), "{stderr}");

    // --tls-key without --tls-cert is a usage error.
    let output = Command::new(RLSD)
        .args(["serve", "--config", "examples/three-layer.yaml"])
        .arg("--tls-key")
        .arg(&garbage)
        .output()
        .expect("run rlsd");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--tls-cert"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_mutual_tls_on_a_redis_store_over_tls() {
    let pki = Pki::new();
    let (redis, redis_ca) = tls_redis(&pki);
    let ca = pki.ca("ca");
    let server_cert = pki.issue(&ca, "rlsd", Leaf::Server, 10);
    let envoy = pki.issue(&ca, "envoy", Leaf::Client, 11);
    let url = redis.url();
    let rlsd = Rlsd::serve_with(
        [
            "--config".as_ref(),
            "examples/three-layer.yaml".as_ref(),
            "--key-prefix".as_ref(),
            "tls-e2e".as_ref(),
            "--redis-command-timeout-ms".as_ref(),
            "2000".as_ref(),
            "--tls-cert".as_ref(),
            server_cert.cert.as_os_str(),
            "--tls-key".as_ref(),
            server_cert.key.as_os_str(),
            "--tls-client-ca".as_ref(),
            ca.cert.as_os_str(),
            "--redis-ca".as_ref(),
            redis_ca.cert.as_os_str(),
        ],
        |command: &mut Command| {
            command.env("RLSD_REDIS_URL", &url);
        },
    );
    let grpc = rlsd.grpc;
    let mut client = tls_client(grpc, &ca, Some(&envoy))
        .await
        .unwrap_or_else(|error| panic!("no TLS session: {error:?}\n{}", rlsd.log()));
    let response = client
        .should_rate_limit(request(
            "edge-proxy",
            vec![descriptor(&[("remote_address", "10.0.0.1")])],
        ))
        .await
        .expect("an answer over mutual TLS");
    assert_eq!(response.into_inner().overall_code(), Code::Ok);
    let keys = redis.cli(&["KEYS", "tls-e2e:*"]).expect("keys");
    assert!(!keys.is_empty(), "the decision was kept in redis");
    assert!(ask(grpc, &ca, None).await.is_err(), "no client certificate");
}
