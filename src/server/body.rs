//! Bounds on request bodies that are still arriving: each must end within a deadline, and all of
//! them together may hold at most a budget of bytes.
//!
//! tonic reads a request body as it comes and keeps it until the message is whole, which hands
//! HTTP/2's flow-control window back to the client at once: windows bound what sits unread in
//! h2, not what tonic holds. A client that opened 1,024 streams per connection and sent 60 KB of
//! each message, never the rest, held 59 MB per connection for as long as it liked. Here a body
//! that waits in the middle of a message is charged for that message's bytes: first to a small
//! reserve of its own connection, then to a budget shared by every connection, and refused when
//! both are spent; and it has a deadline, past which it is refused too. The reserve is what keeps
//! a connection's ordinary calls answered while other connections hold the shared budget, however
//! their frames arrive. A unary call whose message is whole is ended there: tonic would otherwise
//! wait for the client's END_STREAM, which may come in a later frame. A body that arrives whole
//! before it is first read (every request Envoy sends) never waits: it costs no atomic operation
//! and no timer.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use hyper::body::Bytes;
use tokio::time::Sleep;

/// Why a request body was cut off before its end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyRefused {
    /// The body did not end within the deadline.
    #[error("request body not complete within {0:?} (--request-body-timeout-ms)")]
    TimedOut(Duration),
    /// Waiting for the rest would take the bytes held for unfinished bodies past the budget.
    #[error(
        "request bodies still arriving already hold {0} bytes or more \
         (--max-buffered-request-bytes); try again"
    )]
    OverBudget(usize),
}

impl From<BodyRefused> for tonic::Status {
    fn from(refused: BodyRefused) -> Self {
        // Not CANCELLED: tonic reads a CANCELLED request body as one that ended normally.
        match refused {
            BodyRefused::TimedOut(_) => tonic::Status::deadline_exceeded(refused.to_string()),
            BodyRefused::OverBudget(_) => tonic::Status::resource_exhausted(refused.to_string()),
        }
    }
}

/// How a request body is read, which decides what of it is held while it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyShape {
    /// A gRPC unary call: one message, then the end. Whole once its message is.
    Unary,
    /// A gRPC stream: messages for as long as it likes. Between messages it holds nothing and
    /// has no deadline (a service bounds its own idle streams); inside one it is held as any
    /// body is.
    Streaming,
    /// Not gRPC (the HTTP ports): every byte received is held until the end.
    Opaque,
}

/// The deadline, the shared budget and the per-connection reserve every request body of the
/// server is held to.
#[derive(Debug)]
pub(crate) struct BodyLimits {
    timeout: Duration,
    budget: usize,
    /// Bytes each connection may hold of its own before it draws on the shared budget.
    reserve: usize,
    /// Bytes received on bodies that were waiting for more when last read, past their
    /// connections' reserves.
    held: AtomicUsize,
    /// Set from the first refusal until the bytes held fall under half the budget, so that an
    /// episode of refusals is logged once.
    refusing: AtomicBool,
}

impl BodyLimits {
    /// Bodies must end within `timeout` of their first wait; waiting bodies may hold `reserve`
    /// bytes per connection and `budget` bytes in all beyond that.
    pub(crate) fn new(timeout: Duration, budget: usize, reserve: usize) -> Arc<BodyLimits> {
        Arc::new(BodyLimits {
            timeout,
            budget,
            reserve,
            held: AtomicUsize::new(0),
            refusing: AtomicBool::new(false),
        })
    }

    /// Bytes now charged to the shared budget.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn charge(&self, bytes: usize) -> Result<(), BodyRefused> {
        let before = self.held.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) <= self.budget {
            return Ok(());
        }
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        if !self.refusing.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                budget = self.budget,
                "request bodies still arriving fill --max-buffered-request-bytes; refusing more"
            );
        }
        Err(BodyRefused::OverBudget(self.budget))
    }

    fn release(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let after = self.held.fetch_sub(bytes, Ordering::Relaxed) - bytes;
        if after < self.budget / 2
            && self.refusing.load(Ordering::Relaxed)
            && self.refusing.swap(false, Ordering::Relaxed)
        {
            tracing::info!(
                held = after,
                "request bodies still arriving are under half the budget"
            );
        }
    }
}

/// One connection's handle on the [`BodyLimits`] every connection shares, with the
/// connection's own reserve. The bodies of its requests count their references on the handle,
/// so that requests on different serving threads write to no common cache line unless a body
/// has to wait past the reserve. Each clone is a new handle: clone it once per connection.
pub(crate) struct BodyGuard(Arc<Handle>);

/// What a [`BodyGuard`]'s bodies share with it.
struct Handle {
    limits: Arc<BodyLimits>,
    /// Bytes of the connection's reserve that its waiting bodies hold.
    reserved: AtomicUsize,
}

impl Handle {
    /// Takes up to `bytes` of the connection's reserve; returns what it took.
    fn reserve(&self, bytes: usize) -> usize {
        let mut taken = 0;
        let _ = self
            .reserved
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                taken = bytes.min(self.limits.reserve.saturating_sub(held));
                (taken > 0).then_some(held + taken)
            });
        taken
    }
}

impl BodyGuard {
    /// A handle on `limits`.
    pub(crate) fn new(limits: &Arc<BodyLimits>) -> BodyGuard {
        BodyGuard(Arc::new(Handle {
            limits: Arc::clone(limits),
            reserved: AtomicUsize::new(0),
        }))
    }

    /// `body`, read as `shape`, held to the limits.
    pub(crate) fn guard<B>(&self, body: B, shape: BodyShape) -> GuardedBody<B> {
        GuardedBody {
            inner: body,
            handle: Arc::clone(&self.0),
            shape,
            framing: Framing::default(),
            received: 0,
            charged: Charge::default(),
            deadline: None,
            ended: false,
        }
    }
}

impl Clone for BodyGuard {
    fn clone(&self) -> Self {
        BodyGuard::new(&self.0.limits)
    }
}

/// Where a gRPC body stands in its length-prefixed messages.
#[derive(Debug, Default)]
struct Framing {
    /// Messages received whole.
    messages: u64,
    /// Bytes received of the message in progress, its 5-byte prefix included.
    partial: usize,
    /// The prefix of the message in progress, as far as it has arrived.
    prefix: [u8; 5],
    /// The whole length of the message in progress, once its prefix is in.
    length: Option<usize>,
}

impl Framing {
    const PREFIX: usize = 5;

    /// Follows `data` through the messages it completes and the one it leaves in progress.
    fn advance(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let length = match self.length {
                Some(length) => length,
                None => {
                    let take = (Self::PREFIX - self.partial).min(data.len());
                    self.prefix[self.partial..self.partial + take].copy_from_slice(&data[..take]);
                    self.partial += take;
                    data = &data[take..];
                    if self.partial < Self::PREFIX {
                        return;
                    }
                    let [_, a, b, c, d] = self.prefix;
                    let length =
                        Self::PREFIX.saturating_add(u32::from_be_bytes([a, b, c, d]) as usize);
                    self.length = Some(length);
                    length
                }
            };
            let take = (length - self.partial).min(data.len());
            self.partial += take;
            data = &data[take..];
            if self.partial == length {
                self.messages += 1;
                self.partial = 0;
                self.length = None;
            }
        }
    }
}

/// What a waiting body holds of its connection's reserve and of the shared budget.
#[derive(Debug, Default)]
struct Charge {
    reserve: usize,
    shared: usize,
}

impl Charge {
    fn total(&self) -> usize {
        self.reserve + self.shared
    }
}

/// A request body held to [`BodyLimits`]: each time it has to wait for more, the bytes it holds
/// (of the message in progress, or everything for an opaque body) are charged, and its deadline
/// runs from its first wait. It gives its charge back when the message completes, when it ends
/// or when it is dropped.
pub(crate) struct GuardedBody<B> {
    inner: B,
    handle: Arc<Handle>,
    shape: BodyShape,
    framing: Framing,
    /// DATA bytes received so far.
    received: usize,
    /// What the bytes held are charged to.
    charged: Charge,
    /// Armed at the first wait: a body that never waits needs no timer.
    deadline: Option<Pin<Box<Sleep>>>,
    /// The body ended or was refused; it yields nothing more.
    ended: bool,
}

impl<B> GuardedBody<B> {
    fn release(&mut self) {
        let Charge { reserve, shared } = std::mem::take(&mut self.charged);
        if reserve > 0 {
            self.handle.reserved.fetch_sub(reserve, Ordering::Relaxed);
        }
        self.handle.limits.release(shared);
    }

    fn end(&mut self) {
        self.ended = true;
        self.deadline = None;
        self.release();
    }

    fn refuse(&mut self, refused: BodyRefused) -> tonic::Status {
        tracing::debug!(%refused, received = self.received, "request body refused");
        self.end();
        refused.into()
    }

    /// Bytes the body holds while it waits.
    fn holding(&self) -> usize {
        match self.shape {
            BodyShape::Opaque => self.received,
            BodyShape::Unary | BodyShape::Streaming => self.framing.partial,
        }
    }

    /// Whether a wait now needs a deadline: in the middle of something, not between messages
    /// of a stream.
    fn waits_inside(&self) -> bool {
        match self.shape {
            BodyShape::Opaque => true,
            BodyShape::Unary => self.framing.messages == 0 || self.framing.partial > 0,
            BodyShape::Streaming => self.framing.partial > 0,
        }
    }

    /// Charges what the body holds beyond its charge, the connection's reserve first.
    fn charge(&mut self) -> Result<(), BodyRefused> {
        let more = self.holding().saturating_sub(self.charged.total());
        if more == 0 {
            return Ok(());
        }
        let reserved = self.handle.reserve(more);
        self.charged.reserve += reserved;
        if more > reserved {
            self.handle.limits.charge(more - reserved)?;
            self.charged.shared += more - reserved;
        }
        Ok(())
    }
}

impl<B> Drop for GuardedBody<B> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received = this.received.saturating_add(data.len());
                    if this.shape != BodyShape::Opaque {
                        let before = this.framing.messages;
                        this.framing.advance(data);
                        if this.framing.messages > before {
                            // What tonic held of the finished message is its to keep now, as
                            // for a body that never waited.
                            this.release();
                            if this.shape == BodyShape::Streaming {
                                this.deadline = None;
                            }
                        }
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                this.end();
                Poll::Ready(Some(Err(tonic::Status::from_error(error.into()))))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if !this.waits_inside() {
                    if this.shape == BodyShape::Unary {
                        // The one message is whole: the END_STREAM still to come adds nothing.
                        this.end();
                        return Poll::Ready(None);
                    }
                    return Poll::Pending;
                }
                if let Err(refused) = this.charge() {
                    return Poll::Ready(Some(Err(this.refuse(refused))));
                }
                let timeout = this.handle.limits.timeout;
                let deadline = this
                    .deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Some(Err(this.refuse(BodyRefused::TimedOut(timeout)))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.ended {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// A body that yields its chunks, then waits forever (a client that stopped sending), or
    /// ends when `ends` is set.
    struct Chunks {
        chunks: VecDeque<Bytes>,
        ends: bool,
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            match self.chunks.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None if self.ends => Poll::Ready(None),
                None => Poll::Pending,
            }
        }
    }

    fn chunks(sizes: &[usize], ends: bool) -> Chunks {
        Chunks {
            chunks: sizes.iter().map(|&n| Bytes::from(vec![0; n])).collect(),
            ends,
        }
    }

    /// Reads `body` until it waits or ends: the data frames' total, and the error if any.
    fn read_until_wait<B: Body<Data = Bytes> + Unpin>(
        body: &mut B,
    ) -> (usize, Option<B::Error>, bool) {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut read = 0;
        loop {
            match Pin::new(&mut *body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => read += frame.data_ref().map_or(0, Bytes::len),
                Poll::Ready(Some(Err(error))) => return (read, Some(error), false),
                Poll::Ready(None) => return (read, None, true),
                Poll::Pending => return (read, None, false),
            }
        }
    }

    #[tokio::test]
    async fn a_body_that_arrives_whole_is_never_charged() {
        let limits = BodyLimits::new(Duration::from_secs(5), 10, 0);
        let mut body = BodyGuard::new(&limits).guard(chunks(&[100, 100], true), BodyShape::Opaque);
        let (read, error, ended) = read_until_wait(&mut body);
        assert_eq!((read, error.is_none(), ended), (200, true, true));
        assert_eq!(limits.held(), 0);
    }

    #[tokio::test]
    async fn waiting_bodies_are_charged_until_the_budget_then_refused_and_give_it_back() {
        let limits = BodyLimits::new(Duration::from_secs(5), 250, 0);
        // Two connections: the budget is theirs together.
        let (one, other) = (BodyGuard::new(&limits), BodyGuard::new(&limits));
        let mut first = one.guard(chunks(&[100], false), BodyShape::Opaque);
        let mut second = other.guard(chunks(&[100], false), BodyShape::Opaque);
        let mut third = one.clone().guard(chunks(&[100], false), BodyShape::Opaque);
        assert!(read_until_wait(&mut first).1.is_none());
        assert!(read_until_wait(&mut second).1.is_none());
        assert_eq!(limits.held(), 200);
        let refused = read_until_wait(&mut third).1.expect("over the budget");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(limits.held(), 200, "a refused body holds nothing");
        drop(first);
        assert_eq!(limits.held(), 100);
        let mut fourth = other.guard(chunks(&[100], false), BodyShape::Opaque);
        assert!(read_until_wait(&mut fourth).1.is_none(), "room again");
        drop((second, fourth));
        assert_eq!(limits.held(), 0);
    }

    #[tokio::test]
    async fn a_body_that_stops_short_is_refused_at_its_deadline() {
        let timeout = Duration::from_millis(50);
        let limits = BodyLimits::new(timeout, 1 << 20, 0);
        let mut body = BodyGuard::new(&limits).guard(chunks(&[100], false), BodyShape::Opaque);
        let first = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        assert!(matches!(first, Some(Ok(_))));
        let started = tokio::time::Instant::now();
        let refused = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        let status = refused.and_then(Result::err).expect("refused");
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert!(started.elapsed() >= timeout);
        assert_eq!(limits.held(), 0);
        assert!(Pin::new(&mut body).is_end_stream());
    }

    /// A gRPC message of `length` bytes after its 5-byte prefix.
    fn message(length: usize) -> Vec<u8> {
        let mut bytes = vec![0, 0, 0, 0, 0];
        bytes[1..].copy_from_slice(&u32::try_from(length).expect("length").to_be_bytes());
        bytes.resize(5 + length, 7);
        bytes
    }

    /// A body that yields `parts` as its chunks, then waits.
    fn parts(parts: Vec<Vec<u8>>) -> Chunks {
        Chunks {
            chunks: parts.into_iter().map(Bytes::from).collect(),
            ends: false,
        }
    }

    #[tokio::test]
    async fn a_unary_message_that_is_whole_ends_the_body_without_its_end_stream() {
        // The budget is spent (0 bytes): a body that waited for its END_STREAM was refused.
        let limits = BodyLimits::new(Duration::from_secs(5), 0, 0);
        let mut body = BodyGuard::new(&limits).guard(parts(vec![message(300)]), BodyShape::Unary);
        let (read, error, ended) = read_until_wait(&mut body);
        assert_eq!((read, error.is_none(), ended), (305, true, true));
        // Split anywhere, prefix included, the same.
        let whole = message(300);
        let split = vec![
            whole[..3].to_vec(),
            whole[3..100].to_vec(),
            whole[100..].to_vec(),
        ];
        let limits = BodyLimits::new(Duration::from_secs(5), 0, 1024);
        let guard = BodyGuard::new(&limits);
        let mut body = guard.guard(parts(split), BodyShape::Unary);
        let (read, error, ended) = read_until_wait(&mut body);
        assert_eq!((read, error.is_none(), ended), (305, true, true));
        assert_eq!(guard.0.reserved.load(Ordering::Relaxed), 0);
    }

    /// Polls `body` once: the data it yields, or whether it waits, ends or fails.
    fn poll_once<B: Body<Data = Bytes> + Unpin>(
        body: &mut B,
    ) -> Poll<Option<Result<usize, B::Error>>> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(body).poll_frame(&mut cx).map(|frame| {
            frame.map(|frame| frame.map(|frame| frame.data_ref().map_or(0, Bytes::len)))
        })
    }

    #[tokio::test]
    async fn a_split_message_waits_on_its_connections_reserve_while_the_budget_is_spent() {
        let limits = BodyLimits::new(Duration::from_secs(5), 100, 1000);
        let (busy, quiet) = (BodyGuard::new(&limits), BodyGuard::new(&limits));
        // One connection holds its reserve and the whole shared budget...
        let mut hog = busy.guard(
            parts(vec![message(2000)[..1100].to_vec()]),
            BodyShape::Unary,
        );
        assert!(read_until_wait(&mut hog).1.is_none());
        assert_eq!(
            (busy.0.reserved.load(Ordering::Relaxed), limits.held()),
            (1000, 100)
        );
        // ...and its next partial call is refused...
        let mut more = busy.guard(parts(vec![message(500)[..10].to_vec()]), BodyShape::Unary);
        let refused = read_until_wait(&mut more).1.expect("refused");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        // ...while another connection's call, split in two, waits on its own reserve.
        let whole = message(600);
        let mut split = quiet.guard(parts(vec![whole[..300].to_vec()]), BodyShape::Unary);
        let (read, error, ended) = read_until_wait(&mut split);
        assert_eq!((read, error.is_none(), ended), (300, true, false));
        assert_eq!(quiet.0.reserved.load(Ordering::Relaxed), 300);
        split
            .inner
            .chunks
            .push_back(Bytes::from(whole[300..].to_vec()));
        let (read, error, ended) = read_until_wait(&mut split);
        assert_eq!((read, error.is_none(), ended), (305, true, true));
        assert_eq!(quiet.0.reserved.load(Ordering::Relaxed), 0, "given back");
        drop(hog);
        assert_eq!(
            (busy.0.reserved.load(Ordering::Relaxed), limits.held()),
            (0, 0)
        );
    }

    #[tokio::test]
    async fn a_stream_holds_nothing_between_messages_and_is_charged_inside_one() {
        let limits = BodyLimits::new(Duration::from_millis(20), 1 << 20, 0);
        let mut stream =
            BodyGuard::new(&limits).guard(parts(vec![message(50)]), BodyShape::Streaming);
        assert!(matches!(poll_once(&mut stream), Poll::Ready(Some(Ok(55)))));
        assert!(poll_once(&mut stream).is_pending());
        assert!(stream.deadline.is_none(), "no deadline between messages");
        // Idle far past the deadline: still open.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(poll_once(&mut stream).is_pending());
        // Inside a message it is charged, and released when the message completes.
        let next = message(80);
        stream
            .inner
            .chunks
            .push_back(Bytes::from(next[..40].to_vec()));
        assert!(matches!(poll_once(&mut stream), Poll::Ready(Some(Ok(40)))));
        assert!(poll_once(&mut stream).is_pending());
        assert_eq!(limits.held(), 40);
        stream
            .inner
            .chunks
            .push_back(Bytes::from(next[40..].to_vec()));
        assert!(matches!(poll_once(&mut stream), Poll::Ready(Some(Ok(45)))));
        assert_eq!(limits.held(), 0);
        assert!(poll_once(&mut stream).is_pending());
        // A message left half-sent meets the deadline.
        stream
            .inner
            .chunks
            .push_back(Bytes::from(message(10)[..3].to_vec()));
        assert!(matches!(poll_once(&mut stream), Poll::Ready(Some(Ok(3)))));
        let refused = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_frame(cx)).await;
        let status = refused.and_then(Result::err).expect("refused");
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert_eq!(limits.held(), 0);
    }
}
