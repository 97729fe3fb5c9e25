//! Bounds on request bodies that are still arriving: each must end within a deadline, and all of
//! them together may hold at most a budget of bytes.
//!
//! tonic reads a request body as it comes and keeps it until the message is whole, which hands
//! HTTP/2's flow-control window back to the client at once: windows bound what sits unread in
//! h2, not what tonic holds. A client that opened 1,024 streams per connection and sent 60 KB of
//! each message, never the rest, held 59 MB per connection for as long as it liked. Here a body
//! that waits for more is charged to a budget shared by every connection, and refused when the
//! budget is spent; and it has a deadline, past which it is refused too. A body that arrives
//! whole before it is first read (every request Envoy sends) never waits: it costs no atomic
//! operation and no timer.

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

/// The deadline and the shared budget every request body of the server is held to.
#[derive(Debug)]
pub(crate) struct BodyLimits {
    timeout: Duration,
    budget: usize,
    /// Bytes received on bodies that were waiting for more when last read.
    held: AtomicUsize,
    /// Set from the first refusal until the bytes held fall under half the budget, so that an
    /// episode of refusals is logged once.
    refusing: AtomicBool,
}

impl BodyLimits {
    /// Bodies must end within `timeout` of their first wait, and waiting bodies may hold
    /// `budget` bytes in all.
    pub(crate) fn new(timeout: Duration, budget: usize) -> Arc<BodyLimits> {
        Arc::new(BodyLimits {
            timeout,
            budget,
            held: AtomicUsize::new(0),
            refusing: AtomicBool::new(false),
        })
    }

    /// Bytes now charged to the budget.
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

/// One connection's handle on the [`BodyLimits`] every connection shares. The bodies of its
/// requests count their references on the handle, so that requests on different serving
/// threads write to no common cache line unless a body has to wait. Each clone is a new handle:
/// clone it once per connection.
pub(crate) struct BodyGuard(Arc<Handle>);

/// What a [`BodyGuard`]'s bodies share with it.
struct Handle {
    limits: Arc<BodyLimits>,
}

impl BodyGuard {
    /// A handle on `limits`.
    pub(crate) fn new(limits: &Arc<BodyLimits>) -> BodyGuard {
        BodyGuard(Arc::new(Handle {
            limits: Arc::clone(limits),
        }))
    }

    /// `body`, held to the limits.
    pub(crate) fn guard<B>(&self, body: B) -> GuardedBody<B> {
        GuardedBody {
            inner: body,
            handle: Arc::clone(&self.0),
            received: 0,
            charged: 0,
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

/// A request body held to [`BodyLimits`]: each time it has to wait for more, the bytes it has
/// received so far are charged to the budget, and its deadline runs from its first wait. It
/// gives its charge back when it ends or is dropped.
pub(crate) struct GuardedBody<B> {
    inner: B,
    handle: Arc<Handle>,
    /// DATA bytes received so far.
    received: usize,
    /// Of those, the bytes charged to the budget.
    charged: usize,
    /// Armed at the first wait: a body that never waits needs no timer.
    deadline: Option<Pin<Box<Sleep>>>,
    /// The body ended or was refused; it yields nothing more.
    ended: bool,
}

impl<B> GuardedBody<B> {
    fn end(&mut self) {
        self.ended = true;
        self.deadline = None;
        self.handle
            .limits
            .release(std::mem::take(&mut self.charged));
    }

    fn refuse(&mut self, refused: BodyRefused) -> tonic::Status {
        tracing::debug!(%refused, received = self.received, "request body refused");
        self.end();
        refused.into()
    }
}

impl<B> Drop for GuardedBody<B> {
    fn drop(&mut self) {
        self.handle.limits.release(self.charged);
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
                let uncharged = this.received - this.charged;
                if uncharged > 0 {
                    if let Err(refused) = this.handle.limits.charge(uncharged) {
                        return Poll::Ready(Some(Err(this.refuse(refused))));
                    }
                    this.charged = this.received;
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
        let limits = BodyLimits::new(Duration::from_secs(5), 10);
        let mut body = BodyGuard::new(&limits).guard(chunks(&[100, 100], true));
        let (read, error, ended) = read_until_wait(&mut body);
        assert_eq!((read, error.is_none(), ended), (200, true, true));
        assert_eq!(limits.held(), 0);
    }

    #[tokio::test]
    async fn waiting_bodies_are_charged_until_the_budget_then_refused_and_give_it_back() {
        let limits = BodyLimits::new(Duration::from_secs(5), 250);
        // Two connections: the budget is theirs together.
        let (one, other) = (BodyGuard::new(&limits), BodyGuard::new(&limits));
        let mut first = one.guard(chunks(&[100], false));
        let mut second = other.guard(chunks(&[100], false));
        let mut third = one.clone().guard(chunks(&[100], false));
        assert!(read_until_wait(&mut first).1.is_none());
        assert!(read_until_wait(&mut second).1.is_none());
        assert_eq!(limits.held(), 200);
        let refused = read_until_wait(&mut third).1.expect("over the budget");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert_eq!(limits.held(), 200, "a refused body holds nothing");
        drop(first);
        assert_eq!(limits.held(), 100);
        let mut fourth = other.guard(chunks(&[100], false));
        assert!(read_until_wait(&mut fourth).1.is_none(), "room again");
        drop((second, fourth));
        assert_eq!(limits.held(), 0);
    }

    #[tokio::test]
    async fn a_body_that_stops_short_is_refused_at_its_deadline() {
        let timeout = Duration::from_millis(50);
        let limits = BodyLimits::new(timeout, 1 << 20);
        let mut body = BodyGuard::new(&limits).guard(chunks(&[100], false));
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
}
