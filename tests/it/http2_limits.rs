//! The HTTP/2 limits rlsd advertises, and what a client that stays inside them gets: every
//! answer, even when its whole window of requests lands at once, as Envoy's backlog does after
//! a stall.

use crate::common;

use rlsd_testkit::{h2load, rawh2};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::{TestServer, descriptor, request};
use prost::Message as _;
use rlsd::pb::RateLimitResponse;
use rlsd::pb::rate_limit_response::Code;

const CONFIG: &str = r#"
domain: bench
descriptors:
  - key: client
    rate_limit: {unit: day, requests_per_unit: 1000000}
"#;

/// Streams a client opens when the server sets no limit: enough to find out whether it copes.
const UNLIMITED: usize = 8000;

/// What one burst came to: the server's advertised stream limit, and how its streams ended.
#[derive(Debug)]
struct Burst {
    advertised: Option<u32>,
    sent: usize,
    ok_answers: usize,
}

/// One HTTP/2 frame as read: type, flags, stream and payload.
type Frame = (u8, u8, u32, Vec<u8>);

fn read_frame(socket: &mut TcpStream, pending: &mut Vec<u8>) -> Frame {
    let mut buf = [0_u8; 65_536];
    loop {
        if let Some(frame) = rawh2::take_frame(pending) {
            return frame;
        }
        let n = socket.read(&mut buf).expect("read");
        assert!(n > 0, "the server closed the connection");
        pending.extend_from_slice(&buf[..n]);
    }
}

/// Opens a connection, waits for the server's SETTINGS, then writes as many requests as they
/// allow in one go, each the way tonic's client sends one (HEADERS, DATA with the message,
/// an empty DATA with END_STREAM), and reads every answer. A GOAWAY or RST_STREAM panics.
fn burst(addr: SocketAddr, body: &[u8]) -> Burst {
    let mut socket = TcpStream::connect(addr).expect("connect");
    socket.set_nodelay(true).expect("nodelay");
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut hello = rawh2::PREFACE.to_vec();
    rawh2::frame_header(&mut hello, 6, rawh2::SETTINGS, 0, 0);
    hello.extend_from_slice(&rawh2::SETTINGS_INITIAL_WINDOW_SIZE.to_be_bytes());
    hello.extend_from_slice(&rawh2::MAX_WINDOW.to_be_bytes());
    rawh2::frame_header(&mut hello, 4, rawh2::WINDOW_UPDATE, 0, 0);
    hello.extend_from_slice(&(rawh2::MAX_WINDOW - 65_535).to_be_bytes());
    socket.write_all(&hello).expect("hello");

    let mut pending = Vec::new();
    let mut advertised = None;
    loop {
        let (kind, flags, _, payload) = read_frame(&mut socket, &mut pending);
        if kind == rawh2::SETTINGS && flags & rawh2::ACK == 0 {
            for setting in payload.chunks_exact(6) {
                if u16::from_be_bytes([setting[0], setting[1]])
                    == rawh2::SETTINGS_MAX_CONCURRENT_STREAMS
                {
                    advertised = Some(u32::from_be_bytes([
                        setting[2], setting[3], setting[4], setting[5],
                    ]));
                }
            }
            break;
        }
    }
    let sent = advertised.map_or(UNLIMITED, |limit| limit as usize);
    let block = rawh2::header_block(&addr.to_string());
    let mut requests = Vec::new();
    rawh2::frame_header(&mut requests, 0, rawh2::SETTINGS, rawh2::ACK, 0);
    for stream in (0..sent).map(|i| 2 * i as u32 + 1) {
        rawh2::frame_header(
            &mut requests,
            block.len(),
            rawh2::HEADERS,
            rawh2::END_HEADERS,
            stream,
        );
        requests.extend_from_slice(&block);
        rawh2::frame_header(&mut requests, body.len(), rawh2::DATA, 0, stream);
        requests.extend_from_slice(body);
        rawh2::frame_header(&mut requests, 0, rawh2::DATA, rawh2::END_STREAM, stream);
    }
    // Written from a thread of its own: the answers must be read while the requests go out.
    let mut writer = socket.try_clone().expect("clone");
    let writing = std::thread::spawn(move || writer.write_all(&requests).expect("requests"));

    let (mut ended, mut ok_answers) = (0, 0);
    while ended < sent {
        let (kind, flags, stream, payload) = read_frame(&mut socket, &mut pending);
        match kind {
            rawh2::GOAWAY => panic!(
                "GOAWAY after {ended} of {sent} answers (advertised limit {advertised:?}): {:?}",
                String::from_utf8_lossy(payload.get(8..).unwrap_or_default())
            ),
            rawh2::RST_STREAM => panic!("stream {stream} reset after {ended} of {sent} answers"),
            rawh2::DATA if stream != 0 && payload.len() > 5 => {
                let answer = RateLimitResponse::decode(&payload[5..]).expect("an answer");
                if answer.overall_code == Code::Ok as i32 {
                    ok_answers += 1;
                }
            }
            _ => {}
        }
        if stream != 0
            && flags & rawh2::END_STREAM != 0
            && (kind == rawh2::HEADERS || kind == rawh2::DATA)
        {
            ended += 1;
        }
    }
    writing.join().expect("writer");
    Burst {
        advertised,
        sent,
        ok_answers,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_that_fills_the_advertised_stream_limit_is_answered_in_full() {
    // h2 closes a connection (GOAWAY ENHANCE_YOUR_CALM, "too_many_data_frames") once the small
    // DATA frames it holds unread pass a budget of half its connection window; a server that
    // let a client open streams without limit was closed on by the next burst of ordinary
    // requests. The stream limit it advertises must keep a full burst inside that budget.
    let server = TestServer::start(CONFIG).await;
    let addr = server.grpc;
    let body = h2load::grpc_body(&request("bench", vec![descriptor(&[("client", "burst")])]));
    for _ in 0..3 {
        let body = body.clone();
        let burst = tokio::task::spawn_blocking(move || burst(addr, &body))
            .await
            .expect("client thread");
        assert_eq!(burst.ok_answers, burst.sent, "{burst:?}");
        assert!(
            burst.advertised.is_some_and(|limit| limit >= 100),
            "a limit too low to be of use: {burst:?}"
        );
    }
    server.stop().await;
}
