//! Bounds on what a client can hold of rlsd: request bodies that never end, connections that
//! never send a request, HTTP clients that trickle or say nothing, descriptors, and connections
//! that live forever. Each test drives a real server over real sockets, the abusive side with
//! hand-written HTTP/2 frames or raw HTTP/1 bytes.

use crate::common;

use std::collections::HashSet;
use std::future::Future;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use common::process::{Rlsd, command};
use common::{descriptor, live_config, request};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use rlsd::server::{self, ConnectionLimits, Listeners, ServeOptions};
use rlsd::service::{RateLimiter, ServiceSettings};
use rlsd::store::MemoryStore;
use rlsd_testkit::rawh2;
use tonic::transport::Endpoint;

const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: client
    rate_limit: {unit: day, requests_per_unit: 1000000}
"#;

/// The longest any read in these tests waits: far past every deadline a test sets.
const READ_TIMEOUT: Duration = Duration::from_secs(20);

/// The largest gRPC message these requests declare: under the default `--max-message-bytes`, so
/// tonic waits for the rest instead of refusing it outright.
const DECLARED: u32 = 60_000;

/// A library server on every port: gRPC, admin, metrics and debug.
struct Server {
    grpc: SocketAddr,
    http: SocketAddr,
    metrics: SocketAddr,
    debug: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(limits: ConnectionLimits) -> Server {
        let config = live_config(CONFIG);
        let store = Arc::new(MemoryStore::new(10_000));
        let limiter = RateLimiter::new(Arc::clone(&config), store, ServiceSettings::default());
        let loopback: SocketAddr = "127.0.0.1:0".parse().expect("address");
        let listeners = Listeners::bind(loopback, loopback)
            .await
            .expect("bind")
            .with_metrics(loopback, "/metrics".to_owned())
            .await
            .expect("bind metrics")
            .with_debug(loopback)
            .await
            .expect("bind debug");
        let address = |listener: &tokio::net::TcpListener| listener.local_addr().expect("address");
        let (grpc, http) = (address(&listeners.grpc), address(&listeners.http));
        let metrics = address(&listeners.metrics.as_ref().expect("metrics").0);
        let debug = address(listeners.debug.as_ref().expect("debug"));
        let options = ServeOptions {
            lanes: common::LANES,
            shutdown_grace: Duration::from_secs(1),
            limits,
            ..ServeOptions::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            server::run_with(limiter, config, listeners, options, async {
                let _ = stopped.await;
            })
            .await
            .expect("server runs");
        });
        Server {
            grpc,
            http,
            metrics,
            debug,
            stop,
            task,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("server task");
    }
}

/// One complete `ShouldRateLimit` call from tonic's client: it must be answered OK.
async fn answered(grpc: SocketAddr) {
    let mut client = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let response = client
        .should_rate_limit(request("edge", vec![descriptor(&[("client", "c")])]))
        .await
        .expect("an answer")
        .into_inner();
    assert_eq!(response.overall_code, Code::Ok as i32);
}

/// One HTTP/2 frame as read: type, flags, stream and payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// An HTTP/2 connection written by hand, past the handshake: it sends whatever frames a test
/// says, and reads what the server sends.
struct RawH2 {
    socket: TcpStream,
    pending: Vec<u8>,
    authority: String,
}

impl RawH2 {
    /// Connects, exchanges SETTINGS (this side's windows as large as HTTP/2 allows), and waits
    /// for the server's connection window, so that what the test sends stays inside it.
    fn open(addr: SocketAddr) -> RawH2 {
        let socket = TcpStream::connect(addr).expect("connect");
        socket.set_nodelay(true).expect("nodelay");
        socket
            .set_read_timeout(Some(READ_TIMEOUT))
            .expect("timeout");
        let mut raw = RawH2 {
            socket,
            pending: Vec::new(),
            authority: addr.to_string(),
        };
        let mut hello = rawh2::PREFACE.to_vec();
        rawh2::frame_header(&mut hello, 6, rawh2::SETTINGS, 0, 0);
        hello.extend_from_slice(&rawh2::SETTINGS_INITIAL_WINDOW_SIZE.to_be_bytes());
        hello.extend_from_slice(&rawh2::MAX_WINDOW.to_be_bytes());
        rawh2::frame_header(&mut hello, 4, rawh2::WINDOW_UPDATE, 0, 0);
        hello.extend_from_slice(&(rawh2::MAX_WINDOW - 65_535).to_be_bytes());
        raw.send(&hello);
        let (mut settings, mut window) = (false, false);
        while !(settings && window) {
            let (kind, flags, stream, _) = raw.frame().expect("the server's SETTINGS");
            if kind == rawh2::SETTINGS && flags & rawh2::ACK == 0 {
                settings = true;
                let mut ack = Vec::new();
                rawh2::frame_header(&mut ack, 0, rawh2::SETTINGS, rawh2::ACK, 0);
                raw.send(&ack);
            }
            window |= kind == rawh2::WINDOW_UPDATE && stream == 0;
        }
        raw
    }

    fn send(&mut self, bytes: &[u8]) {
        self.socket.write_all(bytes).expect("write");
    }

    /// The next frame; `None` once the server has closed the connection.
    fn frame(&mut self) -> Option<Frame> {
        let mut buf = [0_u8; 65_536];
        loop {
            if let Some(frame) = rawh2::take_frame(&mut self.pending) {
                return Some(frame);
            }
            match self.socket.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(error) if error.kind() == ErrorKind::ConnectionReset => return None,
                Err(error)
                    if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                {
                    panic!("nothing from the server in {READ_TIMEOUT:?}")
                }
                Err(error) => panic!("reading from the server: {error}"),
            }
        }
    }

    /// A `ShouldRateLimit` call on `stream` (higher than any before: HTTP/2 requires it) whose
    /// body stops after `sent` bytes (at most one frame's 16 KiB) of a message that declares
    /// [`DECLARED`] bytes; the stream stays open.
    fn partial_call(&mut self, stream: u32, sent: usize) {
        assert!((5..=16_384).contains(&sent));
        let block = rawh2::header_block(&self.authority);
        let mut frames = Vec::new();
        rawh2::frame_header(
            &mut frames,
            block.len(),
            rawh2::HEADERS,
            rawh2::END_HEADERS,
            stream,
        );
        frames.extend_from_slice(&block);
        rawh2::frame_header(&mut frames, sent, rawh2::DATA, 0, stream);
        frames.push(0);
        frames.extend_from_slice(&DECLARED.to_be_bytes());
        frames.resize(frames.len() + sent - 5, 0);
        self.send(&frames);
    }

    /// A whole `ShouldRateLimit` call on `stream`, as tonic's client sends one: it must be
    /// answered with a message, not reset.
    fn call(&mut self, stream: u32) {
        self.call_in_parts(stream, Split::Whole);
    }

    /// A whole `ShouldRateLimit` call on `stream`, its frames sent as `split` says with a pause
    /// between the writes, so that the server reads them apart: it must be answered with a
    /// message, not reset.
    fn call_in_parts(&mut self, stream: u32, split: Split) {
        let body = rlsd_testkit::h2load::grpc_body(&request(
            "edge",
            vec![descriptor(&[("client", "raw")])],
        ));
        let block = rawh2::header_block(&self.authority);
        let mut frames = Vec::new();
        rawh2::frame_header(
            &mut frames,
            block.len(),
            rawh2::HEADERS,
            rawh2::END_HEADERS,
            stream,
        );
        frames.extend_from_slice(&block);
        let mut writes = Vec::new();
        match split {
            Split::Whole => {
                rawh2::frame_header(
                    &mut frames,
                    body.len(),
                    rawh2::DATA,
                    rawh2::END_STREAM,
                    stream,
                );
                frames.extend_from_slice(&body);
            }
            Split::EndStreamLater => {
                rawh2::frame_header(&mut frames, body.len(), rawh2::DATA, 0, stream);
                frames.extend_from_slice(&body);
                let mut end = Vec::new();
                rawh2::frame_header(&mut end, 0, rawh2::DATA, rawh2::END_STREAM, stream);
                writes.push(end);
            }
            Split::MessageInTwo => {
                let (head, tail) = body.split_at(body.len() / 2);
                rawh2::frame_header(&mut frames, head.len(), rawh2::DATA, 0, stream);
                frames.extend_from_slice(head);
                let mut rest = Vec::new();
                rawh2::frame_header(
                    &mut rest,
                    tail.len(),
                    rawh2::DATA,
                    rawh2::END_STREAM,
                    stream,
                );
                rest.extend_from_slice(tail);
                writes.push(rest);
            }
        }
        self.send(&frames);
        for write in writes {
            std::thread::sleep(Duration::from_millis(100));
            self.send(&write);
        }
        let mut answered = false;
        loop {
            let (kind, flags, on, payload) = self.frame().expect("an answer");
            if on != stream {
                continue;
            }
            assert_ne!(kind, rawh2::RST_STREAM, "stream {stream} reset");
            answered |= kind == rawh2::DATA && payload.len() > 5;
            if flags & rawh2::END_STREAM != 0 && (kind == rawh2::HEADERS || kind == rawh2::DATA) {
                assert!(answered, "stream {stream} ended without an answer");
                return;
            }
        }
    }

    /// Reads until `count` more of `open` have been ended by the server (a response with
    /// END_STREAM, or RST_STREAM), removing them; panics if the connection closes first.
    fn await_ended(&mut self, open: &mut HashSet<u32>, count: usize) {
        let mut ended = 0;
        while ended < count {
            let (kind, flags, stream, payload) = self.frame().unwrap_or_else(|| {
                panic!("the connection closed with {} streams open", open.len())
            });
            assert_ne!(
                kind,
                rawh2::GOAWAY,
                "GOAWAY: {:?}",
                String::from_utf8_lossy(payload.get(8..).unwrap_or_default())
            );
            let ends = kind == rawh2::RST_STREAM
                || (flags & rawh2::END_STREAM != 0
                    && (kind == rawh2::HEADERS || kind == rawh2::DATA));
            if ends && open.remove(&stream) {
                ended += 1;
            }
        }
    }
}

/// How a whole call's frames reach the server.
#[derive(Clone, Copy)]
enum Split {
    /// HEADERS, then DATA with the message and END_STREAM, in one write.
    Whole,
    /// HEADERS and DATA with the message; END_STREAM on an empty DATA frame in a later write,
    /// as tonic's and hyper's clients often send it.
    EndStreamLater,
    /// HEADERS and DATA with half the message; the other half with END_STREAM later.
    MessageInTwo,
}

/// A request body that sends its one chunk, then nothing more, ever.
struct Partial(Option<Bytes>);

impl http_body::Body for Partial {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        match self.0.take() {
            Some(chunk) => Poll::Ready(Some(Ok(http_body::Frame::data(chunk)))),
            None => Poll::Pending,
        }
    }
}

/// The gRPC status of a `ShouldRateLimit` call whose body stops after its first `sent` bytes,
/// sent on a connection of its own by hyper's HTTP/2 client (which decodes the answer).
async fn partial_call_status(grpc: SocketAddr, sent: usize) -> tonic::Code {
    let socket = tokio::net::TcpStream::connect(grpc).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(socket))
            .await
            .expect("handshake");
    let connection = tokio::spawn(connection);
    let mut chunk = vec![0_u8];
    chunk.extend_from_slice(&DECLARED.to_be_bytes());
    chunk.resize(sent, 0);
    let call = http::Request::post(format!(
        "http://{grpc}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(Partial(Some(Bytes::from(chunk))))
    .expect("request");
    let response = tokio::time::timeout(READ_TIMEOUT, sender.send_request(call))
        .await
        .expect("answered in time")
        .expect("answered");
    connection.abort();
    let status = response
        .headers()
        .get("grpc-status")
        .and_then(|value| value.to_str().ok()?.parse::<i32>().ok())
        .expect("a trailers-only answer with grpc-status");
    tonic::Code::from(status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_that_stop_short_are_refused_at_their_deadline() {
    let server = Server::start(ConnectionLimits {
        request_body_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    })
    .await;
    let grpc = server.grpc;
    // 200 streams, 4 KB of a 60 KB message each: they end only if the server ends them.
    let started = Instant::now();
    let ended = tokio::task::spawn_blocking(move || {
        let mut raw = RawH2::open(grpc);
        let streams: Vec<u32> = (0..200).map(|i| 2 * i + 1).collect();
        for &stream in &streams {
            raw.partial_call(stream, 4_000);
        }
        let mut open = streams.into_iter().collect();
        raw.await_ended(&mut open, 200);
        let ended = started.elapsed();
        // The deadline ends streams, not their connection.
        raw.call(401);
        ended
    })
    .await
    .expect("client thread");
    assert!(
        ended >= Duration::from_secs(1),
        "ended {ended:?} after they were sent, before the deadline"
    );
    assert_eq!(
        partial_call_status(grpc, 1000).await,
        tonic::Code::DeadlineExceeded
    );
    answered(grpc).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_buffer_budget_partial_bodies_are_refused_and_whole_requests_still_answered() {
    // The connection's 16 KiB reserve and 16 frames of 16 KiB fill it exactly: of 40 such
    // partial calls, 23 are refused at once, 17 wait until the deadline.
    const FRAME: usize = 16_384;
    let server = Server::start(ConnectionLimits {
        request_body_timeout: Duration::from_secs(4),
        max_buffered_request_bytes: 16 * FRAME,
        connection_body_reserve_bytes: FRAME,
        ..ConnectionLimits::default()
    })
    .await;
    let grpc = server.grpc;
    let (mut raw, mut open) = tokio::task::spawn_blocking(move || {
        let mut raw = RawH2::open(grpc);
        let streams: Vec<u32> = (0..40).map(|i| 2 * i + 1).collect();
        for &stream in &streams {
            raw.partial_call(stream, FRAME);
        }
        let mut open: HashSet<u32> = streams.into_iter().collect();
        raw.await_ended(&mut open, 23);
        (raw, open)
    })
    .await
    .expect("client thread");
    // The budget is spent: a new partial call past its own connection's reserve is refused at
    // once, not held...
    assert_eq!(
        partial_call_status(grpc, FRAME + 4_000).await,
        tonic::Code::ResourceExhausted
    );
    // ...while whole requests, however their frames arrive, are answered: in one write (every
    // one Envoy sends), with END_STREAM in a later frame (tonic's client), or with the message
    // itself split. Each on its connection, which stays open for the next.
    answered(grpc).await;
    tokio::task::spawn_blocking(move || {
        let mut other = RawH2::open(grpc);
        other.call_in_parts(1, Split::EndStreamLater);
        other.call_in_parts(3, Split::MessageInTwo);
        other.call_in_parts(5, Split::EndStreamLater);
        other.call_in_parts(7, Split::Whole);
    })
    .await
    .expect("client thread");
    // The 17 that were let in end at their deadline and give their bytes back (had more been
    // let in, some would have had to reach their deadline for 23 to end, and the budget would
    // have had room for the call above).
    let raw = tokio::task::spawn_blocking(move || {
        raw.await_ended(&mut open, 17);
        raw
    })
    .await
    .expect("client thread");
    drop(raw);
    answered(grpc).await;
    assert_eq!(
        partial_call_status(grpc, FRAME + 4_000).await,
        tonic::Code::DeadlineExceeded,
        "the budget was not given back"
    );
    server.stop().await;
}

/// Whether the server closes `socket` within [`READ_TIMEOUT`]; `poke` runs between reads (a
/// trickle of bytes, say) until it returns false.
fn closed_by_server(socket: &mut TcpStream, mut poke: impl FnMut(&mut TcpStream) -> bool) -> bool {
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let deadline = Instant::now() + READ_TIMEOUT;
    let mut buf = [0_u8; 4096];
    let mut poking = true;
    while Instant::now() < deadline {
        match socket.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
        if poking {
            poking = poke(socket);
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_connection_that_sends_no_request_is_closed_at_its_deadline() {
    let server = Server::start(ConnectionLimits {
        first_request_timeout: Duration::from_millis(500),
        ..ConnectionLimits::default()
    })
    .await;
    let grpc = server.grpc;
    tokio::task::spawn_blocking(move || {
        // Nothing at all, and the preface and SETTINGS but no request.
        let mut silent = TcpStream::connect(grpc).expect("connect");
        assert!(closed_by_server(&mut silent, |_| true), "silent connection");
        let mut preface_only = RawH2::open(grpc);
        assert!(
            closed_by_server(&mut preface_only.socket, |_| true),
            "a connection that sent only its preface"
        );
        // A connection that has sent a request stays open past the deadline for the next.
        let mut used = RawH2::open(grpc);
        used.call(1);
        std::thread::sleep(Duration::from_secs(1));
        used.call(3);
    })
    .await
    .expect("client thread");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_clients_that_trickle_idle_or_say_nothing_are_disconnected() {
    let server = Server::start(ConnectionLimits {
        http_header_timeout: Duration::from_millis(500),
        request_body_timeout: Duration::from_millis(500),
        ..ConnectionLimits::default()
    })
    .await;
    let ports = [server.http, server.metrics, server.debug];
    let clients = tokio::task::spawn_blocking(move || {
        let mut checks = Vec::new();
        for port in ports {
            checks.push(std::thread::spawn(move || {
                let connect = || TcpStream::connect(port).expect("connect");
                let silent = closed_by_server(&mut connect(), |_| true);
                // One header line every 100 ms, never the blank line that ends the head.
                let mut trickle = connect();
                trickle
                    .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
                    .expect("request line");
                let trickled = closed_by_server(&mut trickle, |socket| {
                    socket.write_all(b"X-Slow: 1\r\n").is_ok()
                });
                // A kept-alive connection that asks for nothing more after its answer.
                let mut idle = connect();
                idle.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
                    .expect("request");
                let idled = closed_by_server(&mut idle, |_| true);
                // A body that never arrives in full.
                let mut body = connect();
                body.write_all(
                    b"POST /json HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{",
                )
                .expect("request");
                let bodied = closed_by_server(&mut body, |_| true);
                (port, [silent, trickled, idled, bodied])
            }));
        }
        checks
            .into_iter()
            .map(|check| check.join().expect("client"))
            .collect::<Vec<_>>()
    });
    // Meanwhile the ports still answer.
    for _ in 0..5 {
        assert_eq!(
            common::http_get(server.http, "/healthcheck").await,
            (200, "OK".to_owned())
        );
        let (status, _) = common::http_get(server.metrics, "/metrics").await;
        assert_eq!(status, 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (port, [silent, trickled, idled, bodied]) in clients.await.expect("clients") {
        assert!(silent, "{port}: a silent connection stayed open");
        assert!(trickled, "{port}: a trickling request head stayed open");
        assert!(idled, "{port}: an idle kept-alive connection stayed open");
        // Only the admin port has a route that reads a body.
        if port == server.http {
            assert!(
                bodied,
                "{port}: a request body that stopped short stayed open"
            );
        }
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_rotated_at_their_age_without_failing_a_call() {
    let server = Server::start(ConnectionLimits {
        max_connection_age: Some(Duration::from_secs(2)),
        max_connection_age_grace: Duration::from_secs(1),
        request_body_timeout: Duration::from_secs(30),
        ..ConnectionLimits::default()
    })
    .await;
    let grpc = server.grpc;

    // A raw connection: GOAWAY after its age, then closed after the grace even though a call
    // is still open on it (a body that never ends, under a 30 s body deadline).
    let raw = tokio::task::spawn_blocking(move || {
        let opened = Instant::now();
        let mut raw = RawH2::open(grpc);
        raw.partial_call(1, 100);
        let mut goaway = None;
        while let Some((kind, _, _, payload)) = raw.frame() {
            if kind == rawh2::GOAWAY && goaway.is_none() {
                let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                assert_eq!(code, 0, "GOAWAY NO_ERROR");
                goaway = Some(opened.elapsed());
            }
        }
        (goaway, opened.elapsed())
    });

    // Envoy's side: a channel that reconnects by itself, calls from 4 tasks for 8 s. Like
    // Envoy, a caller sends again a call its client never sent: hyper's client drops the calls
    // queued for a connection once that connection has received a GOAWAY.
    let connections = Arc::new(AtomicUsize::new(0));
    let channel = {
        let connections = Arc::clone(&connections);
        Endpoint::from_shared(format!("http://{grpc}"))
            .expect("endpoint")
            .connect_with_connector_lazy(CountingConnector { grpc, connections })
    };
    let until = Instant::now() + Duration::from_secs(8);
    let callers: Vec<_> = (0..4)
        .map(|caller| {
            let mut client = RateLimitServiceClient::new(channel.clone());
            tokio::spawn(async move {
                let (mut calls, mut resent) = (0, 0);
                while Instant::now() < until {
                    let call = request("edge", vec![descriptor(&[("client", "envoy")])]);
                    match client.should_rate_limit(call.clone()).await {
                        Ok(_) => {}
                        Err(status) if never_sent(&status) && resent < 100 => {
                            resent += 1;
                            continue;
                        }
                        Err(status) => panic!("caller {caller}, call {calls} failed: {status:?}"),
                    }
                    calls += 1;
                }
                (calls, resent)
            })
        })
        .collect();
    let (mut calls, mut resent) = (0, 0);
    for caller in callers {
        let (answered, again) = caller.await.expect("every call answered");
        calls += answered;
        resent += again;
    }
    let connections = connections.load(Ordering::SeqCst);
    assert!(
        connections >= 3,
        "{connections} connections over 8 s with a 2 s age ({calls} calls)"
    );
    // The server counted exactly the calls that were answered: none was cut off after it
    // arrived, and none that was sent again had arrived the first time.
    let mut client = RateLimitServiceClient::new(channel);
    let last = client
        .should_rate_limit(request("edge", vec![descriptor(&[("client", "envoy")])]))
        .await
        .expect("an answer")
        .into_inner();
    let counted = 1_000_000 - u64::from(last.statuses[0].limit_remaining);
    assert_eq!(counted, calls + 1, "{resent} calls sent again");
    eprintln!("{calls} calls over {connections} connections, {resent} sent again");

    let (goaway, closed) = raw.await.expect("raw client");
    let goaway = goaway.expect("a GOAWAY");
    assert!(
        goaway >= Duration::from_millis(1800),
        "GOAWAY after {goaway:?}"
    );
    assert!(
        closed >= goaway + Duration::from_millis(900),
        "closed {closed:?}, before the grace after the GOAWAY at {goaway:?}"
    );
    server.stop().await;
}

/// Connects tonic's channel to `grpc`, counting the connections it opens.
#[derive(Clone)]
struct CountingConnector {
    grpc: SocketAddr,
    connections: Arc<AtomicUsize>,
}

impl tonic::codegen::Service<http::Uri> for CountingConnector {
    type Response = TokioIo<tokio::net::TcpStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        self.connections.fetch_add(1, Ordering::SeqCst);
        let grpc = self.grpc;
        Box::pin(async move { Ok(TokioIo::new(tokio::net::TcpStream::connect(grpc).await?)) })
    }
}

/// Whether a call failed in the client before rlsd could process it: hyper's client cancels the
/// calls still queued for a connection that is going away, and h2 refuses a stream opened as the
/// GOAWAY arrives.
fn never_sent(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(error) = error.downcast_ref::<hyper::Error>()
            && error.is_canceled()
        {
            return true;
        }
        // A stream the client opened as the GOAWAY came: refused by it, so never processed
        // (RFC 9113 §6.8: safe to send again).
        if let Some(error) = error.downcast_ref::<h2::Error>() {
            return error.is_go_away()
                && error.is_remote()
                && error.reason() == Some(h2::Reason::NO_ERROR);
        }
        source = error.source();
    }
    false
}

/// `rlsd serve` with its open files limit set to `soft` and `hard` before it starts.
fn rlsd_with_open_files(soft: u64, hard: u64, args: &[&str]) -> Rlsd {
    let config = tempfile::NamedTempFile::new().expect("config file");
    std::fs::write(config.path(), CONFIG).expect("write config");
    let mut command = command();
    command
        .arg("serve")
        .arg("--config")
        .arg(config.path())
        .args(args)
        .env("RLSD_GRPC_ADDR", "127.0.0.1:0")
        .env("RLSD_HTTP_ADDR", "127.0.0.1:0");
    set_open_files_limit(&mut command, soft, hard);
    let rlsd = Rlsd::start(command);
    // Read once at start; the file may go now.
    drop(config);
    rlsd
}

#[expect(unsafe_code, reason = "setrlimit in the child between fork and exec")]
fn set_open_files_limit(command: &mut std::process::Command, soft: u64, hard: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe and touches only the child's own limits.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// The soft and hard open files limits of process `pid`, from `/proc/<pid>/limits`.
fn open_files_limit(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("an open files line");
    let numbers: Vec<u64> = line
        .split_whitespace()
        .filter_map(|word| word.parse().ok())
        .collect();
    (numbers[0], numbers[1])
}

#[test]
fn rlsd_raises_its_open_files_soft_limit_to_the_hard_limit() {
    let rlsd = rlsd_with_open_files(256, 4096, &[]);
    assert_eq!(open_files_limit(rlsd.id()), (4096, 4096));
    assert!(
        rlsd.log().contains("limit=4096"),
        "the limit is logged:\n{}",
        rlsd.log()
    );
}

/// Opens `count` TCP connections to `addr` that never send a byte.
fn idle_connections(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    (0..count)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect()
}

/// Waits until `done` holds, for at most [`READ_TIMEOUT`]; whether it did.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + READ_TIMEOUT;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Descriptors process `pid` has open.
fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_past_the_soft_limit_leave_room_for_a_client() {
    // The first-request deadline is far off: only a raised limit lets rlsd hold every idle
    // connection and still accept the client.
    let rlsd = rlsd_with_open_files(256, 4096, &["--grpc-first-request-timeout-ms", "60000"]);
    let idle = idle_connections(rlsd.grpc, 300);
    assert!(
        eventually(|| descriptors(rlsd.id()) > 300),
        "rlsd holds only {} descriptors:\n{}",
        descriptors(rlsd.id()),
        rlsd.log()
    );
    tokio::time::timeout(READ_TIMEOUT, answered(rlsd.grpc))
        .await
        .expect("the client was locked out");
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_hard_limit_the_first_request_deadline_makes_room_for_a_client() {
    // No room to raise: the idle connections take every descriptor, accept fails, and only
    // their first-request deadline can free descriptors for the client. (A deadline of a few
    // seconds: connections that overflow the listen backlog are retried by the kernel 1 s
    // later, and must find the first ones still open.)
    let rlsd = rlsd_with_open_files(256, 256, &["--grpc-first-request-timeout-ms", "3000"]);
    let idle = idle_connections(rlsd.grpc, 300);
    assert!(
        eventually(|| rlsd.log().contains("accept failed")),
        "the descriptors never ran out:\n{}",
        rlsd.log()
    );
    tokio::time::timeout(READ_TIMEOUT, answered(rlsd.grpc))
        .await
        .expect("the client was locked out");
    // Meanwhile the accept loop paused between attempts (doubling up to 1 s) instead of
    // spinning on EMFILE.
    let log = rlsd.log();
    let failures: u32 = log
        .lines()
        .filter_map(|line| line.split("failures=").nth(1)?.trim().parse::<u32>().ok())
        .sum();
    assert!(
        (1..100).contains(&failures),
        "{failures} failed accepts:\n{log}"
    );
    drop(idle);
}

/// Whether the other side has closed `socket`: what it sent is read, without waiting.
fn closed_by_peer(mut socket: &TcpStream) -> bool {
    socket.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0_u8; 4096];
    loop {
        match socket.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(error) => return error.kind() != ErrorKind::WouldBlock,
        }
    }
}

/// The sum of `rlsd_connections_shed_total` series in `metrics` whose labels contain `labels`.
fn shed_total(metrics: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .filter(|line| line.starts_with("rlsd_connections_shed_total{") && line.contains(labels))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_idle_connections_are_shed_for_a_new_client() {
    // Every descriptor taken by connections that never send a byte, on both ports, and their
    // own deadline a minute off: only shedding them can let the client in.
    let rlsd = rlsd_with_open_files(256, 256, &["--grpc-first-request-timeout-ms", "60000"]);
    // A client that has called once and sits between calls: shed only after every silent one.
    let mut kept = RateLimitServiceClient::connect(format!("http://{}", rlsd.grpc))
        .await
        .expect("connect");
    let call = || request("edge", vec![descriptor(&[("client", "kept")])]);
    kept.should_rate_limit(call()).await.expect("an answer");
    let idle_grpc = idle_connections(rlsd.grpc, 300);
    let idle_http = idle_connections(rlsd.http, 300);
    assert!(
        eventually(|| rlsd.log().contains("accept failed")),
        "the descriptors never ran out:\n{}",
        rlsd.log()
    );
    let started = Instant::now();
    tokio::time::timeout(READ_TIMEOUT, answered(rlsd.grpc))
        .await
        .expect("the client was locked out");
    let took = started.elapsed();
    eprintln!("a new gRPC client answered {took:?} after the descriptors ran out");
    let (status, metrics) =
        tokio::time::timeout(READ_TIMEOUT, common::http_get(rlsd.http, "/metrics"))
            .await
            .expect("the admin port was locked out");
    assert_eq!(status, 200);
    let (grpc, http) = (
        shed_total(&metrics, r#"port="grpc""#),
        shed_total(&metrics, r#"port="http""#),
    );
    eprintln!("shed: {grpc} gRPC and {http} HTTP connections");
    assert!(grpc > 0.0 && http > 0.0, "nothing shed:\n{metrics}");
    assert_eq!(
        shed_total(&metrics, r#"state="idle""#),
        0.0,
        "a connection between calls went before the silent ones"
    );
    kept.should_rate_limit(call())
        .await
        .expect("the kept client still answered");
    // The silent connections are the ones closed: the server's side of some has gone.
    let closed = idle_grpc
        .iter()
        .chain(&idle_http)
        .filter(|socket| closed_by_peer(socket))
        .count();
    eprintln!("{closed} of the 600 silent connections closed by rlsd");
    assert!(closed > 0, "no silent connection was closed");
    drop((idle_grpc, idle_http));
}
