//! gRPC on a Unix domain socket (`--grpc-unix-socket`): real clients over the socket, with lanes
//! and without, counting against the same store as the TCP port; the socket file's life.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::process::Rlsd;
use common::{LANES, allowed_of, descriptor, live_config, request};
use hyper_util::rt::TokioIo;
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::server::{self, Listeners, ServeOptions};
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::MemoryStore;
use tonic::codegen::Service;
use tonic::transport::{Channel, Endpoint, Uri};

const CONFIG: &str = "domain: pipe\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 25}\n";

/// Connects tonic to a Unix socket: the URI's authority is ignored.
#[derive(Clone)]
pub(crate) struct UnixConnector(pub(crate) Arc<PathBuf>);

impl Service<Uri> for UnixConnector {
    type Response = TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let path = Arc::clone(&self.0);
        Box::pin(async move { Ok(TokioIo::new(tokio::net::UnixStream::connect(&*path).await?)) })
    }
}

async fn unix_client(path: &Path) -> RateLimitServiceClient<Channel> {
    let channel = Endpoint::from_static("http://rlsd.local")
        .connect_with_connector(UnixConnector(Arc::new(path.to_owned())))
        .await
        .expect("connect over the unix socket");
    RateLimitServiceClient::new(channel)
}

async fn tcp_client(address: std::net::SocketAddr) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{address}"))
        .await
        .expect("connect over TCP")
}

/// A library server on the TCP port and `socket`, with `lanes` serving lanes (0: none).
async fn serve(
    socket: &Path,
    lanes: usize,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let config = live_config(CONFIG);
    let store = Arc::new(MemoryStore::new(10_000));
    let limiter = RateLimiter::new(Arc::clone(&config), store, ServiceSettings::default());
    let loopback = "127.0.0.1:0".parse().expect("address");
    let listeners = Listeners::bind(loopback, loopback)
        .await
        .expect("bind")
        .with_grpc_unix(socket, server::DEFAULT_SOCKET_MODE)
        .expect("bind the unix socket");
    let grpc = listeners.grpc.local_addr().expect("grpc address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = ServeOptions {
        lanes,
        ..ServeOptions::default()
    };
    let task = tokio::spawn(async move {
        server::run_with(limiter, config, listeners, options, async {
            let _ = stopped.await;
        })
        .await
        .expect("server runs");
    });
    (grpc, stop, task)
}

#[tokio::test]
async fn the_unix_socket_and_the_tcp_port_share_one_exact_count_with_and_without_lanes() {
    for lanes in [0, LANES] {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("rlsd.sock");
        let (grpc, stop, task) = serve(&socket, lanes).await;
        assert_eq!(mode_of(&socket), 0o660, "owner and group may connect");
        // Four connections over the socket and two over TCP, 40 requests on a limit of 25.
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(unix_client(&socket).await);
        }
        for _ in 0..2 {
            clients.push(tcp_client(grpc).await);
        }
        let allowed =
            allowed_of(&clients, "pipe", 8, 5, vec![descriptor(&[("user", "ann")])]).await;
        assert_eq!(allowed, 25, "lanes {lanes}");

        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("the server stops")
            .expect("server task");
        assert!(
            !socket.exists(),
            "the socket file is removed at shutdown (lanes {lanes})"
        );
    }
}

/// The permission bits of the file at `path`.
fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path)
        .expect("the socket file")
        .permissions()
        .mode()
        & 0o777
}

/// One request for user `bo`, which must be allowed: the remaining count.
async fn remaining_for_bo(client: &mut RateLimitServiceClient<Channel>) -> u32 {
    let answer = client
        .should_rate_limit(request("pipe", vec![descriptor(&[("user", "bo")])]))
        .await
        .expect("an answer over the socket")
        .into_inner();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    answer.statuses[0].limit_remaining
}

/// `rlsd serve` with `args` on free TCP ports, which must fail: its stderr. Should it start
/// after all, the test fails instead of waiting on it.
fn refused(args: Vec<std::ffi::OsString>) -> String {
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let mut child = common::process::command()
        .arg("serve")
        .args(args)
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .stderr(log.reopen().expect("the log file"))
        .spawn()
        .expect("run rlsd");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("child status") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rlsd started and kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(log.path()).expect("the log");
    assert!(!status.success(), "rlsd exited 0:\n{stderr}");
    stderr
}

#[tokio::test]
async fn the_binary_serves_the_socket_and_replaces_only_a_dead_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).expect("write config");
    let socket = dir.path().join("rlsd.sock");
    // A socket file left by a process that died: nothing accepts on it.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("stale socket"));
    assert!(socket.exists());

    let serve_args = |socket: &Path| {
        vec![
            "--config".into(),
            config.clone().into_os_string(),
            "--grpc-unix-socket".into(),
            socket.as_os_str().to_owned(),
            "--grpc-unix-socket-mode".into(),
            "600".into(),
        ]
    };
    let mut rlsd = Rlsd::serve(serve_args(&socket));
    assert!(
        rlsd.log().contains(&socket.display().to_string()),
        "the serving line names the socket:\n{}",
        rlsd.log()
    );
    assert_eq!(mode_of(&socket), 0o600, "--grpc-unix-socket-mode");
    let mut client = unix_client(&socket).await;
    assert_eq!(remaining_for_bo(&mut client).await, 24);

    // A second rlsd on the live socket is refused, and the first one keeps it.
    let stderr = refused(serve_args(&socket));
    assert!(
        stderr.contains("another process is serving on this socket"),
        "{stderr}"
    );
    assert_eq!(remaining_for_bo(&mut client).await, 23, "still answering");

    // Any other kind of file is never deleted.
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "keep me").expect("write file");
    let stderr = refused(serve_args(&file));
    assert!(stderr.contains("exists and is not a socket"), "{stderr}");
    assert!(stderr.contains("notes.txt"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&file).expect("file"), "keep me");

    // The channel closes its connection from a task of this runtime, so wait off it.
    drop(client);
    let stopped = tokio::task::spawn_blocking(move || rlsd.terminate(Duration::from_secs(5)))
        .await
        .expect("terminate");
    assert!(stopped.success());
    assert!(!socket.exists(), "the socket file is removed at shutdown");
}

/// Eight starts at once on one path where a dead rlsd left its socket: one binds, every other
/// finds that socket live, and the file that stays is the one that is served. The race is
/// run 100 times, as a start that loses it unlocked does not lose it every time.
#[test]
fn concurrent_starts_on_a_stale_socket_leave_one_server_and_its_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rlsd.sock");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    for attempt in 0..100 {
        // A socket file nothing accepts on, as a killed process leaves it.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
        let start = std::sync::Barrier::new(8);
        let outcomes: Vec<_> = std::thread::scope(|scope| {
            let starts: Vec<_> = (0..8)
                .map(|_| {
                    scope.spawn(|| {
                        let _context = runtime.enter();
                        start.wait();
                        server::UnixSocket::bind(&path, server::DEFAULT_SOCKET_MODE)
                    })
                })
                .collect();
            starts
                .into_iter()
                .map(|start| start.join().expect("bind thread"))
                .collect()
        });
        let bound = outcomes.iter().filter(|o| o.is_ok()).count();
        assert_eq!(bound, 1, "attempt {attempt}: {outcomes:?}");
        for outcome in &outcomes {
            if let Err(error) = outcome {
                assert!(
                    matches!(error, server::UnixSocketError::InUse(_)),
                    "attempt {attempt}: {error}"
                );
            }
        }
        assert!(
            std::os::unix::net::UnixStream::connect(&path).is_ok(),
            "attempt {attempt}: the socket file left is the bound one"
        );
        // Dropping the winner removes its file; the next attempt starts from a stale one again.
        drop(outcomes);
        assert!(
            !path.exists(),
            "attempt {attempt}: the file outlived its socket"
        );
    }
}
