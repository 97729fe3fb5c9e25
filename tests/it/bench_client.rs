//! The bench tool's lean HTTP/2 client (`rlsd_testkit::rawh2`) against a real rlsd over
//! loopback: its figures are only as good as its framing, its answers and its schedule. With
//! the client's framing, also what rlsd's answers look like on the wire.

use crate::common;

use rlsd_testkit::{h2load, rawh2};

use std::time::Duration;

use common::{TestServer, descriptor, request};
use rlsd::pb::rate_limit_response::Code;

const CONFIG: &str = r#"
domain: bench
descriptors:
  - key: client
    rate_limit:
      name: per-client
      unit: day
      requests_per_unit: 5
"#;

/// Every answer the client decoded: (body index, overall code), or the error in its place.
type Answers = Vec<(usize, Result<i32, String>)>;

async fn drive(server: &TestServer, bodies: Vec<Vec<u8>>, load: rawh2::Load) -> (Answers, usize) {
    let addr = server.grpc;
    tokio::task::spawn_blocking(move || {
        let mut answers = Vec::new();
        let run = rawh2::run(
            addr,
            &bodies,
            &load,
            || (),
            |done| answers.push((done.request, done.answer.map(|a| a.overall_code))),
        )
        .expect("the lean client runs");
        (answers, run.unanswered)
    })
    .await
    .expect("client thread")
}

fn closed(connections: usize, streams: usize, seconds: f64) -> rawh2::Load {
    rawh2::Load {
        connections,
        streams,
        rate: None,
        warmup: Duration::ZERO,
        seconds: Duration::from_secs_f64(seconds),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decodes_every_answer_and_the_limit_holds_across_its_streams() {
    let server = TestServer::start(CONFIG).await;
    // Two clients, on two connections with eight streams each: each gets exactly 5 OKs a
    // day, however the client interleaves them, and every answer after that is OVER_LIMIT.
    let bodies: Vec<Vec<u8>> = ["a", "b"]
        .iter()
        .map(|client| h2load::grpc_body(&request("bench", vec![descriptor(&[("client", client)])])))
        .collect();
    let (answers, unanswered) = drive(&server, bodies, closed(2, 8, 0.3)).await;
    assert_eq!(unanswered, 0);
    assert!(
        answers.len() > 20,
        "only {} answers in 0.3 s",
        answers.len()
    );
    for client in 0..2 {
        let codes: Vec<i32> = answers
            .iter()
            .filter(|(body, _)| *body == client)
            .map(|(_, code)| code.clone().expect("a decoded answer"))
            .collect();
        let ok = codes.iter().filter(|c| **c == i32::from(Code::Ok)).count();
        let over = codes
            .iter()
            .filter(|c| **c == i32::from(Code::OverLimit))
            .count();
        assert_eq!(ok, 5, "client {client}: {codes:?}");
        assert_eq!(ok + over, codes.len(), "client {client}: {codes:?}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_error_is_an_error_not_an_answer() {
    let server = TestServer::start(CONFIG).await;
    // No domain: rlsd answers INVALID_ARGUMENT, as trailers only.
    let invalid = h2load::grpc_body(&request("", vec![descriptor(&[("client", "a")])]));
    let (answers, unanswered) = drive(&server, vec![invalid], closed(1, 1, 0.1)).await;
    assert_eq!(unanswered, 0);
    assert!(!answers.is_empty());
    for (_, answer) in &answers {
        let error = answer
            .as_ref()
            .expect_err("no answer to an invalid request");
        assert!(error.contains("trailers only"), "{error}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_loop_sends_exactly_its_schedule() {
    let server = TestServer::start(CONFIG).await;
    // 1000 distinct clients, so every answer is OK; one request every ms for 0.3 s measured,
    // after 0.1 s of warm-up whose answers are not reported.
    let bodies: Vec<Vec<u8>> = (0..1000)
        .map(|c| {
            let client = format!("client-{c}");
            h2load::grpc_body(&request("bench", vec![descriptor(&[("client", &client)])]))
        })
        .collect();
    let load = rawh2::Load {
        connections: 2,
        streams: 100,
        rate: Some(1000.0),
        warmup: Duration::from_millis(100),
        seconds: Duration::from_millis(300),
    };
    let (answers, unanswered) = drive(&server, bodies, load).await;
    assert_eq!(unanswered, 0);
    assert_eq!(answers.len(), 300, "one per scheduled ms");
    // The measured requests are the 100th to the 399th scheduled, in order of their bodies.
    let mut bodies_seen: Vec<usize> = answers.iter().map(|(body, _)| *body).collect();
    bodies_seen.sort_unstable();
    assert_eq!(bodies_seen, (100..400).collect::<Vec<_>>());
    assert!(
        answers
            .iter()
            .all(|(_, code)| code.as_ref().ok() == Some(&i32::from(Code::Ok)))
    );
    server.stop().await;
}

/// The frames of stream 1 in one read from the socket: (type, flags, payload length).
type FramesOfRead = Vec<(u8, u8, usize)>;

/// Sends one request on a fresh connection, by hand, and returns the frames of stream 1 that
/// each read brought, until the stream ended.
fn one_request_by_hand(addr: std::net::SocketAddr, body: &[u8]) -> Vec<FramesOfRead> {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(addr).expect("connect");
    socket.set_nodelay(true).expect("nodelay");
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut out = rawh2::PREFACE.to_vec();
    rawh2::frame_header(&mut out, 0, rawh2::SETTINGS, 0, 0);
    let block = rawh2::header_block(&addr.to_string());
    rawh2::frame_header(&mut out, block.len(), rawh2::HEADERS, rawh2::END_HEADERS, 1);
    out.extend_from_slice(&block);
    rawh2::frame_header(&mut out, body.len(), rawh2::DATA, rawh2::END_STREAM, 1);
    out.extend_from_slice(body);
    socket.write_all(&out).expect("send");
    let (mut pending, mut reads) = (Vec::new(), Vec::new());
    let mut buf = [0_u8; 65_536];
    loop {
        let n = socket.read(&mut buf).expect("read");
        assert!(
            n > 0,
            "the server closed before the stream ended: {reads:?}"
        );
        pending.extend_from_slice(&buf[..n]);
        let mut frames = Vec::new();
        let mut ended = false;
        while let Some((kind, flags, stream, payload)) = rawh2::take_frame(&mut pending) {
            if stream == 1 {
                frames.push((kind, flags, payload.len()));
                ended |= flags & rawh2::END_STREAM != 0;
            }
        }
        if !frames.is_empty() {
            reads.push(frames);
        }
        if ended {
            return reads;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_leaves_in_one_write() {
    // h2 flushes before a chained DATA payload's next frame; rlsd's answers are small enough
    // to be copied instead, so HEADERS, DATA and the trailers go out together. Were they two
    // writes, this client, blocked in `read`, would wake for the first.
    let server = TestServer::start(CONFIG).await;
    let addr = server.grpc;
    for round in 0..3 {
        // Four descriptors: an answer of four statuses and their headers, a DATA payload
        // above the 256 bytes h2 would chain.
        let descriptors = (0..4)
            .map(|d| descriptor(&[("client", &format!("c{round}-{d}"))]))
            .collect();
        let body = h2load::grpc_body(&request("bench", descriptors));
        let reads = tokio::task::spawn_blocking(move || one_request_by_hand(addr, &body))
            .await
            .expect("client thread");
        let kinds: Vec<Vec<(u8, u8)>> = reads
            .iter()
            .map(|read| read.iter().map(|&(kind, flags, _)| (kind, flags)).collect())
            .collect();
        assert_eq!(
            kinds,
            vec![vec![
                (rawh2::HEADERS, rawh2::END_HEADERS),
                (rawh2::DATA, 0),
                (rawh2::HEADERS, rawh2::END_HEADERS | rawh2::END_STREAM),
            ]],
            "the answer's frames, by read"
        );
        let data = reads[0][1].2;
        assert!(data > 256, "a DATA payload of {data} bytes tests nothing");
    }
    server.stop().await;
}

use rlsd_testkit::stalls;

/// The stall probe counts the time a CPU runs something else: with a second busy thread on
/// one of its CPUs, the scheduler takes about half of that CPU away, in slices far above 50 µs.
#[test]
fn the_stall_probe_sees_a_cpu_shared_with_a_busy_thread() {
    let span = Duration::from_millis(400);
    let shared_cpu = stalls::allowed_cpus()[0];
    let probed = std::thread::scope(|scope| {
        scope.spawn(|| stalls::spin_on(shared_cpu, span));
        stalls::probe(span)
    });
    let summary = stalls::line(&probed);
    let shared = probed
        .iter()
        .find(|stalls| stalls.cpu() == shared_cpu)
        .unwrap_or_else(|| panic!("no cpu{shared_cpu} in {summary}"));
    assert!(shared.lost_share() > 0.3, "{summary}");
}

/// The bench's floor: a handler of its own served on rlsd's stack by `server::serve_unary`.
struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

#[tonic::async_trait]
impl rlsd::pb::RateLimitService for Counted {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<rlsd::pb::RateLimitRequest>,
    ) -> Result<tonic::Response<rlsd::pb::RateLimitResponse>, tonic::Status> {
        use rlsd::pb::rate_limit_response::DescriptorStatus;
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let status = DescriptorStatus {
            code: Code::Ok.into(),
            ..Default::default()
        };
        Ok(tonic::Response::new(rlsd::pb::RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses: vec![status; request.get_ref().descriptors.len()],
            ..Default::default()
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_unary_serves_another_handler_on_the_lanes_until_shutdown() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(rlsd::server::serve_unary(
        Counted(std::sync::Arc::clone(&calls)),
        listener,
        2,
        async move {
            let _ = stopped.await;
        },
    ));
    let three = request(
        "anything",
        vec![
            descriptor(&[("a", "1")]),
            descriptor(&[("b", "2")]),
            descriptor(&[("c", "3")]),
        ],
    );
    let bodies = vec![h2load::grpc_body(&three)];
    let (answers, unanswered) = tokio::task::spawn_blocking(move || {
        let mut answers = Vec::new();
        let run = rawh2::run(
            addr,
            &bodies,
            &closed(2, 4, 0.2),
            || (),
            |done| answers.push(done.answer.map(|a| (a.overall_code, a.statuses.len()))),
        )
        .expect("the lean client runs");
        (answers, run.unanswered)
    })
    .await
    .expect("client thread");
    assert_eq!(unanswered, 0);
    assert!(!answers.is_empty());
    for answer in &answers {
        assert_eq!(answer.as_ref().ok(), Some(&(i32::from(Code::Ok), 3)));
    }
    // Every answer came from the handler (warm-up and in-flight calls add a few more).
    assert!(calls.load(std::sync::atomic::Ordering::SeqCst) >= answers.len());
    stop.send(()).expect("still serving");
    served
        .await
        .expect("the server task")
        .expect("serve_unary stops cleanly");
}
