//! The bench tool's lean gRPC client: HTTP/2 written by hand on non-blocking sockets, one OS
//! thread, `ppoll` with a 1 µs timer slack for pacing.
//!
//! Why not tonic: its client costs about as much CPU per request as the server it drives, and on
//! two shared cores that CPU comes out of rlsd's and Redis's. In an open loop it also falls
//! milliseconds behind its own schedule (tokio timers tick in whole ms; a pacer thread hands
//! every request to a runtime). h2load is lean but sends one body, and its `--rps` releases
//! requests in bursts. This client sends every request at its scheduled time to within a few µs,
//! cycles through many bodies, and decodes every answer.
//!
//! What it does of HTTP/2: the preface and SETTINGS (the server's
//! `SETTINGS_MAX_CONCURRENT_STREAMS` is honoured), windows of 2^31-1 for what it receives,
//! the server's connection window for what it sends, PING and SETTINGS acknowledgements,
//! GOAWAY and RST_STREAM as errors. Each request is one HEADERS frame (a header block encoded
//! once, without the dynamic table, so it is the same bytes every time) and one DATA frame with
//! END_STREAM. It never decodes a response header block: the answer is the DATA (one gRPC
//! message, decoded with prost), and a stream that ends without one is a gRPC error (tonic sends
//! an error status as trailers only). That assumes a server never sends a message and then a
//! non-zero `grpc-status` in the trailers, which a unary tonic service does not do. Any GOAWAY
//! ends the run with an error, graceful or not: a bench server never shuts down mid-phase.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use prost::Message as _;
use rlsd::pb::RateLimitResponse;

/// The gRPC method every request calls.
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Frame type DATA.
pub const DATA: u8 = 0x0;
/// Frame type HEADERS.
pub const HEADERS: u8 = 0x1;
/// Frame type RST_STREAM.
pub const RST_STREAM: u8 = 0x3;
/// Frame type SETTINGS.
pub const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
/// Frame type GOAWAY.
pub const GOAWAY: u8 = 0x7;
/// Frame type WINDOW_UPDATE.
pub const WINDOW_UPDATE: u8 = 0x8;

/// Flag END_STREAM (DATA, HEADERS).
pub const END_STREAM: u8 = 0x1;
/// Flag ACK (SETTINGS, PING).
pub const ACK: u8 = 0x1;
/// Flag END_HEADERS (HEADERS).
pub const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;

const SETTINGS_ENABLE_PUSH: u16 = 0x2;
/// SETTINGS parameter: the peer's limit on open streams.
pub const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// SETTINGS parameter: each new stream's flow-control window.
pub const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;

/// The largest flow-control window HTTP/2 allows.
pub const MAX_WINDOW: u32 = (1 << 31) - 1;
/// A connection's default window, before any WINDOW_UPDATE.
const DEFAULT_WINDOW: i64 = 65_535;
/// Received DATA bytes after which the connection window is topped up again.
const REFILL_AFTER: u32 = 1 << 30;
/// Size of each connection's read buffer: far more than one frame (16 KiB by default).
const READ_BUFFER: usize = 1 << 20;
/// How long after the last scheduled request the answers still in flight are awaited.
const DRAIN: Duration = Duration::from_secs(10);

/// How to drive the server.
#[derive(Clone, Debug)]
pub struct Load {
    /// HTTP/2 connections.
    pub connections: usize,
    /// Requests in flight per connection: that many in a closed loop, at most that many in an
    /// open loop, where the rest wait their turn; both capped by the server's
    /// SETTINGS_MAX_CONCURRENT_STREAMS.
    pub streams: usize,
    /// `None`: closed loop. `Some(r)`: open loop, one request every 1/r s from the start,
    /// whatever the answers do.
    pub rate: Option<f64>,
    /// Run before measuring; its requests are sent and answered but not reported.
    pub warmup: Duration,
    /// The measured time.
    pub seconds: Duration,
}

/// One measured request, answered.
pub struct Done {
    /// Index of its body in the bodies given to `run`.
    pub request: usize,
    /// From its scheduled time (open loop) or its send time (closed loop) to its answer.
    pub latency_us: u32,
    /// How late it was written to its connection's buffer after its scheduled time (open
    /// loop; 0 when closed); the write to the socket follows in the same turn of the loop.
    pub lag_us: u32,
    /// The decoded answer, or why there is none.
    pub answer: Result<RateLimitResponse, String>,
}

/// What a run saw besides the answers.
pub struct Run<T> {
    /// `snapshot()` when measuring began.
    pub begin: T,
    /// `snapshot()` when measuring ended.
    pub end: T,
    /// Requests scheduled in the measured time but never answered.
    pub unanswered: usize,
    /// Most requests scheduled and not yet answered at one time, backlog included.
    pub max_outstanding: usize,
}

/// `body` (a gRPC message: a zero byte, a 4-byte big-endian length, the protobuf) as one
/// request's frames, with a zero stream id for `Request::write` to fill in.
struct Request {
    frames: Vec<u8>,
    data_at: usize,
    data_len: i64,
}

impl Request {
    fn new(block: &[u8], body: &[u8]) -> Request {
        // One frame each, within the default SETTINGS_MAX_FRAME_SIZE and stream window, which
        // this client does not track.
        assert!(
            block.len() <= 16_384 && body.len() <= 16_384,
            "a request of one HEADERS and one DATA frame of at most 16 KiB"
        );
        let mut frames = Vec::with_capacity(18 + block.len() + body.len());
        frame_header(&mut frames, block.len(), HEADERS, END_HEADERS, 0);
        frames.extend_from_slice(block);
        let data_at = frames.len();
        frame_header(&mut frames, body.len(), DATA, END_STREAM, 0);
        frames.extend_from_slice(body);
        Request {
            frames,
            data_at,
            data_len: body.len() as i64,
        }
    }

    fn write(&self, out: &mut Vec<u8>, stream: u32) {
        let at = out.len();
        out.extend_from_slice(&self.frames);
        let id = stream.to_be_bytes();
        out[at + 5..at + 9].copy_from_slice(&id);
        out[at + self.data_at + 5..at + self.data_at + 9].copy_from_slice(&id);
    }
}

/// One whole frame off the front of `pending`, as (type, flags, stream, payload); `None` until
/// it has all arrived. For tests that read a connection by hand.
pub fn take_frame(pending: &mut Vec<u8>) -> Option<(u8, u8, u32, Vec<u8>)> {
    let header = pending.get(..9)?;
    let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
    let (kind, flags) = (header[3], header[4]);
    let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & !(1 << 31);
    let payload = pending.get(9..9 + len)?.to_vec();
    pending.drain(..9 + len);
    Some((kind, flags, stream, payload))
}

/// Appends a frame header (length, type, flags, stream) to `out`.
pub fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = u32::try_from(len).expect("a frame under 16 MiB");
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// An HPACK integer (RFC 7541 §5.1) whose first byte carries `first` above a `prefix`-bit
/// field.
fn hpack_integer(out: &mut Vec<u8>, first: u8, prefix: u32, value: usize) {
    let max = (1_usize << prefix) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// An HPACK string literal, not Huffman-coded.
fn hpack_string(out: &mut Vec<u8>, text: &str) {
    hpack_integer(out, 0, 7, text.len());
    out.extend_from_slice(text.as_bytes());
}

/// The request header block: static-table entries and literals without indexing, so no
/// dynamic table state and the same bytes for every request.
pub fn header_block(authority: &str) -> Vec<u8> {
    let mut block = vec![
        0x83, // :method: POST (static index 3)
        0x86, // :scheme: http (static index 6)
    ];
    for (name_index, value) in [
        (4, PATH),                // :path
        (1, authority),           // :authority
        (31, "application/grpc"), // content-type
    ] {
        hpack_integer(&mut block, 0x00, 4, name_index);
        hpack_string(&mut block, value);
    }
    block.push(0x00); // a literal name
    hpack_string(&mut block, "te");
    hpack_string(&mut block, "trailers");
    block
}

/// A request on the wire, not yet answered.
struct Stream {
    request: usize,
    /// Where its latency counts from.
    at: Instant,
    lag_us: u32,
    measured: bool,
    message: Vec<u8>,
}

/// `RLSD_BENCH_UNIX=1`: rlsd servers also listen on a Unix socket and the lean client uses it
/// where one exists (the tonic baseline has none and stays on TCP).
pub fn unix_enabled() -> bool {
    std::env::var("RLSD_BENCH_UNIX").is_ok_and(|value| value == "1")
}

/// The Unix socket of the server whose TCP port is `addr`, one per bench process and server.
pub fn unix_path(addr: SocketAddr) -> PathBuf {
    std::env::temp_dir().join(format!(
        "rlsd-bench-{}-{}.sock",
        std::process::id(),
        addr.port()
    ))
}

/// The client's side of a connection: TCP, or the server's Unix socket.
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn connect(addr: SocketAddr) -> std::io::Result<Socket> {
        let path = unix_path(addr);
        if unix_enabled() && path.exists() {
            return UnixStream::connect(path).map(Socket::Unix);
        }
        let socket = TcpStream::connect(addr)?;
        socket.set_nodelay(true)?;
        Ok(Socket::Tcp(socket))
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        match self {
            Socket::Tcp(socket) => socket.set_read_timeout(timeout),
            Socket::Unix(socket) => socket.set_read_timeout(timeout),
        }
    }

    fn set_nonblocking(&self, nonblocking: bool) -> std::io::Result<()> {
        match self {
            Socket::Tcp(socket) => socket.set_nonblocking(nonblocking),
            Socket::Unix(socket) => socket.set_nonblocking(nonblocking),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Socket::Tcp(socket) => socket.read(buf),
            Socket::Unix(socket) => socket.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Socket::Tcp(socket) => socket.write(buf),
            Socket::Unix(socket) => socket.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Socket::Tcp(socket) => socket.as_raw_fd(),
            Socket::Unix(socket) => socket.as_raw_fd(),
        }
    }
}

struct Connection {
    socket: Socket,
    out: Vec<u8>,
    written: usize,
    input: Box<[u8]>,
    start: usize,
    end: usize,
    next_stream: u32,
    streams: HashMap<u32, Stream>,
    max_streams: usize,
    send_window: i64,
    received: u32,
}

impl Connection {
    fn open(addr: SocketAddr) -> Result<Connection, String> {
        let socket = Socket::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
        let mut connection = Connection {
            socket,
            out: Vec::with_capacity(1 << 16),
            written: 0,
            input: vec![0; READ_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
            next_stream: 1,
            streams: HashMap::new(),
            max_streams: usize::MAX,
            send_window: DEFAULT_WINDOW,
            received: 0,
        };
        connection.out.extend_from_slice(PREFACE);
        frame_header(&mut connection.out, 12, SETTINGS, 0, 0);
        for (id, value) in [
            (SETTINGS_ENABLE_PUSH, 0),
            (SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW),
        ] {
            connection.out.extend_from_slice(&id.to_be_bytes());
            connection.out.extend_from_slice(&value.to_be_bytes());
        }
        connection.window_update(MAX_WINDOW - DEFAULT_WINDOW as u32);
        connection.flush()?;
        // The server's SETTINGS come first; wait for them, so the first burst of requests
        // already knows how many streams it may open.
        connection
            .socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut settled = false;
        while !settled {
            let n = connection
                .socket
                .read(&mut connection.input[connection.end..])
                .map_err(|e| format!("waiting for the server's SETTINGS: {e}"))?;
            if n == 0 {
                return Err("the server closed the connection before its SETTINGS".to_owned());
            }
            connection.end += n;
            settled = connection.frames(Instant::now(), &mut |_| {}, true)?;
        }
        // What came with the SETTINGS (a connection WINDOW_UPDATE, say) counts from the start.
        connection.frames(Instant::now(), &mut |_| {}, false)?;
        connection.flush()?;
        connection
            .socket
            .set_nonblocking(true)
            .map_err(|e| e.to_string())?;
        Ok(connection)
    }

    fn window_update(&mut self, increment: u32) {
        frame_header(&mut self.out, 4, WINDOW_UPDATE, 0, 0);
        self.out.extend_from_slice(&increment.to_be_bytes());
    }

    fn can_send(&self, request: &Request, cap: usize) -> bool {
        self.streams.len() < cap.min(self.max_streams) && self.send_window >= request.data_len
    }

    fn send(
        &mut self,
        request: &Request,
        index: usize,
        (at, now): (Instant, Instant),
        measured: bool,
    ) {
        let id = self.next_stream;
        self.next_stream += 2;
        self.send_window -= request.data_len;
        request.write(&mut self.out, id);
        self.streams.insert(
            id,
            Stream {
                request: index,
                at,
                lag_us: micros(now.saturating_duration_since(at)),
                measured,
                message: Vec::new(),
            },
        );
    }

    fn wants_write(&self) -> bool {
        self.written < self.out.len()
    }

    fn flush(&mut self) -> Result<(), String> {
        while self.written < self.out.len() {
            match self.socket.write(&self.out[self.written..]) {
                Ok(0) => return Err("the server closed the connection".to_owned()),
                Ok(n) => self.written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("write: {e}")),
            }
        }
        if self.written == self.out.len() {
            self.out.clear();
            self.written = 0;
        } else if self.written >= 1 << 16 {
            // A socket that stays full: keep only what is still to be written.
            self.out.drain(..self.written);
            self.written = 0;
        }
        Ok(())
    }

    /// Reads what the socket holds and handles every whole frame in it.
    fn receive(&mut self, now: Instant, done: &mut dyn FnMut(Done)) -> Result<(), String> {
        loop {
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            } else if self.input.len() - self.end < READ_BUFFER / 4 {
                self.input.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            match self.socket.read(&mut self.input[self.end..]) {
                Ok(0) => return Err("the server closed the connection".to_owned()),
                Ok(n) => {
                    self.end += n;
                    self.frames(now, done, false)?;
                    if self.end < self.input.len() {
                        // A short read: the socket is empty, and another read would only
                        // say so.
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read: {e}")),
            }
        }
    }

    /// Handles the whole frames in the read buffer; true once a SETTINGS frame (not an ACK)
    /// was among them.
    fn frames(
        &mut self,
        now: Instant,
        done: &mut dyn FnMut(Done),
        until_settings: bool,
    ) -> Result<bool, String> {
        let mut settings_seen = false;
        while self.end - self.start >= 9 {
            let header = &self.input[self.start..self.start + 9];
            let len =
                usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
            if self.end - self.start < 9 + len {
                break;
            }
            let (kind, flags) = (header[3], header[4]);
            let stream =
                u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & MAX_WINDOW;
            let payload_at = self.start + 9;
            self.start += 9 + len;
            let payload = payload_at..payload_at + len;
            match kind {
                DATA => {
                    self.received += len as u32;
                    let mut body = &self.input[payload];
                    if flags & PADDED != 0 && !body.is_empty() {
                        let pad = usize::from(body[0]);
                        body = &body[1..body.len().saturating_sub(pad).max(1)];
                    }
                    if let Some(open) = self.streams.get_mut(&stream) {
                        open.message.extend_from_slice(body);
                    }
                    if flags & END_STREAM != 0 {
                        self.finish(stream, now, None, done);
                    }
                }
                HEADERS if flags & END_STREAM != 0 => self.finish(stream, now, None, done),
                RST_STREAM => {
                    let code = self.input[payload]
                        .get(..4)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    self.finish(
                        stream,
                        now,
                        Some(format!("RST_STREAM, error code {code}")),
                        done,
                    );
                }
                SETTINGS if flags & ACK == 0 => {
                    for setting in self.input[payload].chunks_exact(6) {
                        let id = u16::from_be_bytes([setting[0], setting[1]]);
                        let value =
                            u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
                        if id == SETTINGS_MAX_CONCURRENT_STREAMS {
                            self.max_streams = value as usize;
                        }
                    }
                    frame_header(&mut self.out, 0, SETTINGS, ACK, 0);
                    settings_seen = true;
                }
                PING if flags & ACK == 0 => {
                    let opaque: Vec<u8> = self.input[payload].to_vec();
                    frame_header(&mut self.out, opaque.len(), PING, ACK, 0);
                    self.out.extend_from_slice(&opaque);
                }
                GOAWAY => {
                    let p = &self.input[payload];
                    let word = |at: usize| {
                        p.get(at..at + 4)
                            .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                    };
                    return Err(format!(
                        "GOAWAY: last stream {}, error code {}",
                        word(0) & MAX_WINDOW,
                        word(4)
                    ));
                }
                WINDOW_UPDATE if stream == 0 => {
                    let p = &self.input[payload];
                    if p.len() == 4 {
                        self.send_window +=
                            i64::from(u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & MAX_WINDOW);
                    }
                }
                _ => {}
            }
            if until_settings && settings_seen {
                break;
            }
        }
        if self.received >= REFILL_AFTER {
            self.window_update(self.received);
            self.received = 0;
        }
        Ok(settings_seen)
    }

    fn finish(
        &mut self,
        stream: u32,
        now: Instant,
        error: Option<String>,
        done: &mut dyn FnMut(Done),
    ) {
        let Some(open) = self.streams.remove(&stream) else {
            return;
        };
        if !open.measured {
            return;
        }
        let answer = match error {
            Some(error) => Err(error),
            None => decode(&open.message),
        };
        done(Done {
            request: open.request,
            latency_us: micros(now.saturating_duration_since(open.at)),
            lag_us: open.lag_us,
            answer,
        });
    }
}

fn decode(message: &[u8]) -> Result<RateLimitResponse, String> {
    let Some((prefix, protobuf)) = message.split_at_checked(5) else {
        return Err("no message: the stream ended with trailers only (a gRPC error)".to_owned());
    };
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if prefix[0] != 0 || len != protobuf.len() {
        return Err(format!(
            "not one uncompressed gRPC message: flag {}, length {len} of {}",
            prefix[0],
            protobuf.len()
        ));
    }
    RateLimitResponse::decode(protobuf).map_err(|e| format!("undecodable answer: {e}"))
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Drives `addr` with `bodies` (in turn, each a gRPC message) as `load` says, on the calling
/// thread, and calls `done` for every measured answer. `snapshot` is called when measuring
/// begins and ends (the caller's CPU counters).
#[expect(unsafe_code, reason = "prctl timer slack and ppoll")]
pub fn run<T>(
    addr: SocketAddr,
    bodies: &[Vec<u8>],
    load: &Load,
    mut snapshot: impl FnMut() -> T,
    mut done: impl FnMut(Done),
) -> Result<Run<T>, String> {
    // Wake-ups to within 1 µs of the asked time instead of the default 50 µs slack.
    // SAFETY: PR_SET_TIMERSLACK only sets a number on the calling thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1_u64);
    }
    let block = header_block(&addr.to_string());
    let requests: Vec<Request> = bodies.iter().map(|b| Request::new(&block, b)).collect();
    let mut connections = (0..load.connections.max(1))
        .map(|_| Connection::open(addr))
        .collect::<Result<Vec<_>, _>>()?;
    let interval = load.rate.map(|rate| Duration::from_secs_f64(1.0 / rate));
    let start = Instant::now();
    let begin = start + load.warmup;
    let end = begin + load.seconds;
    let (mut begin_snapshot, mut end_snapshot) = (None, None);
    // Open loop: requests due and not yet on the wire, with their scheduled times.
    let mut backlog: VecDeque<(usize, Instant)> = VecDeque::new();
    let mut next: usize = 0;
    let mut next_connection = 0;
    let mut max_outstanding = 0;
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(connections.len());
    loop {
        let now = Instant::now();
        if begin_snapshot.is_none() && now >= begin {
            begin_snapshot = Some(snapshot());
        }
        if end_snapshot.is_none() && now >= end {
            end_snapshot = Some(snapshot());
        }
        match interval {
            Some(interval) => {
                loop {
                    let at = start + interval * u32::try_from(next).unwrap_or(u32::MAX);
                    if at > now || at >= end {
                        break;
                    }
                    backlog.push_back((next, at));
                    next += 1;
                }
                // Oldest first, each to the next connection with room.
                'send: while let Some(&(index, at)) = backlog.front() {
                    let request = &requests[index % requests.len()];
                    for _ in 0..connections.len() {
                        let c = next_connection;
                        next_connection = (next_connection + 1) % connections.len();
                        if connections[c].can_send(request, load.streams) {
                            let measured = at >= begin && at < end;
                            connections[c].send(
                                request,
                                index % requests.len(),
                                (at, now),
                                measured,
                            );
                            backlog.pop_front();
                            continue 'send;
                        }
                    }
                    break;
                }
            }
            None if now < end => {
                for connection in &mut connections {
                    while connection.streams.len() < load.streams {
                        let request = &requests[next % requests.len()];
                        if !connection.can_send(request, load.streams) {
                            break;
                        }
                        connection.send(request, next % requests.len(), (now, now), now >= begin);
                        next += 1;
                    }
                }
            }
            None => {}
        }
        let in_flight: usize = connections.iter().map(|c| c.streams.len()).sum();
        max_outstanding = max_outstanding.max(in_flight + backlog.len());
        for connection in &mut connections {
            connection.flush()?;
        }
        let scheduling = interval.is_some() && now < end;
        if !scheduling && (in_flight + backlog.len() == 0 || now >= end + DRAIN) {
            break;
        }
        let timeout = match interval {
            Some(interval) if now < end => {
                let at = start + interval * u32::try_from(next).unwrap_or(u32::MAX);
                at.saturating_duration_since(now)
            }
            _ if now < end => end - now,
            _ => Duration::from_millis(10),
        };
        fds.clear();
        fds.extend(connections.iter().map(|c| libc::pollfd {
            fd: c.socket.as_raw_fd(),
            events: libc::POLLIN | if c.wants_write() { libc::POLLOUT } else { 0 },
            revents: 0,
        }));
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfds, and the timeout
        // a valid timespec; ppoll writes only `revents`.
        let ready = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &timeout,
                std::ptr::null(),
            )
        };
        if ready < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() != ErrorKind::Interrupted {
                return Err(format!("ppoll: {error}"));
            }
            continue;
        }
        let woke = Instant::now();
        for (connection, fd) in connections.iter_mut().zip(&fds) {
            if fd.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
                connection.receive(woke, &mut done)?;
            }
        }
    }
    let unanswered = connections
        .iter()
        .flat_map(|c| c.streams.values())
        .filter(|s| s.measured)
        .count()
        + backlog.iter().filter(|(_, at)| *at >= begin).count();
    let end_snapshot = end_snapshot.unwrap_or_else(&mut snapshot);
    let begin_snapshot = begin_snapshot.unwrap_or_else(&mut snapshot);
    Ok(Run {
        begin: begin_snapshot,
        end: end_snapshot,
        unanswered,
        max_outstanding,
    })
}
