//! One HTTP/2 connection, served with its streams polled inside the connection's own task.
//!
//! tonic's server has hyper spawn every stream as a task of its own. On a multi-thread runtime
//! the stream's task and the connection's task then wake each other across workers for every
//! request: a futex wake, often a context switch on each side. Here hyper's executor queues a
//! connection's streams for the connection's own task, which polls them beside the connection,
//! and a wake that arrives while that task is polling sends it round once more instead of
//! through the runtime: a request the store answers at once is answered in the poll that read
//! it. Off the serving lanes, connections still spread over the workers; on them, each stays on
//! the lane it was handed to. The socket is also shown to h2 as unable to
//! write vectored, so that an answer leaves in one write (see [`UnvectoredWrites`]).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::task::AtomicWaker;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

/// How often an idle connection is pinged, as tonic's server was told to.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// Rounds one poll makes at most before it yields, so one busy connection cannot hold a worker.
const MAX_ROUNDS: usize = 16;

/// Streams a client may have open on one connection (SETTINGS_MAX_CONCURRENT_STREAMS). h2 closes
/// a connection with GOAWAY ENHANCE_YOUR_CALM ("too_many_data_frames") once the small DATA
/// frames it holds unread cost more than half its connection window (hyper's 1 MiB) in framing,
/// up to 255 bytes each; every gRPC request from tonic is one such frame until it is read. With
/// no limit, a burst of a few thousand ordinary requests (a client's backlog after a stall) closed
/// the connection on all of them. 1024 streams stay inside the budget whatever the request, and
/// match Envoy's default circuit breaker of 1024 requests in flight to a cluster.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;

type StreamTask = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How long a connection may wait for its first request, and live.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Times {
    first_request: Duration,
    max_age: Option<Duration>,
    age_grace: Duration,
}

impl From<&super::ConnectionLimits> for Times {
    fn from(limits: &super::ConnectionLimits) -> Self {
        Times {
            first_request: limits.first_request_timeout,
            max_age: limits.max_connection_age,
            age_grace: limits.max_connection_age_grace,
        }
    }
}

/// Spread of each connection's age around the configured one, as gRPC's own servers do, so that
/// connections opened together (every Envoy after a deploy) are not closed together.
const AGE_JITTER: f64 = 0.1;

/// `age` spread by `draw` (from 0 to 1) over `age * (1 ± AGE_JITTER)`.
fn jittered(age: Duration, draw: f64) -> Duration {
    age.mul_f64(1.0 + AGE_JITTER * (2.0 * draw.clamp(0.0, 1.0) - 1.0))
}

/// A draw from 0 to 1, different for each connection.
fn draw() -> f64 {
    let seed = foldhash::fast::RandomState::default();
    let bits = std::hash::BuildHasher::hash_one(&seed, std::time::SystemTime::now());
    bits as f64 / u64::MAX as f64
}

/// How the wait on a connection ended.
enum Ended<T> {
    /// The connection ended by itself.
    Served(T),
    /// The server is shutting down.
    Closing,
    /// The connection reached its age.
    Aged,
}

/// Serves `io` as one HTTP/2 connection until the peer leaves or `closing` turns true (or its
/// sender goes): then the connection is shut down gracefully, letting the streams in flight
/// finish. Holds `closing` until the connection has ended. A connection that sends no request
/// within `times.first_request` is closed; one that reaches its age (`times.max_age` ± 10 %) is
/// shut down gracefully too, and closed if its calls take longer than `times.age_grace`.
pub(crate) async fn serve<I, S, B>(
    io: I,
    registration: super::shed::Registration,
    service: S,
    times: Times,
    mut closing: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<::http::Request<Incoming>, Response = ::http::Response<B>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let queue = StreamQueue::default();
    let connection = {
        let mut builder = hyper::server::conn::http2::Builder::new(queue.clone());
        builder
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEPALIVE_INTERVAL)
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            // gRPC clients have no use for a `date` header; it would be encoded into every answer.
            .auto_date_header(false);
        builder.serve_connection(TokioIo::new(UnvectoredWrites(io)), service)
    };
    let tracked = registration.tracked();
    let mut served = Served::new(queue, connection, Arc::clone(tracked));
    let first_request = tokio::time::sleep(times.first_request);
    let mut awaiting_first = true;
    let age = times.max_age.map(|age| jittered(age, draw()));
    let aged = async move {
        match age {
            Some(age) => tokio::time::sleep(age).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(first_request, aged);
    let ended = loop {
        tokio::select! {
            result = &mut served => break Ended::Served(result),
            _ = closing.wait_for(|closing| *closing) => break Ended::Closing,
            () = &mut aged => break Ended::Aged,
            () = tracked.shed() => {
                tracing::debug!("out of file descriptors; closing a connection with no call in flight");
                return;
            }
            () = &mut first_request, if awaiting_first => {
                if !served.started {
                    // Nothing in flight to finish: no GOAWAY, which a silent peer would never
                    // acknowledge.
                    tracing::debug!(timeout = ?times.first_request, "no request in time; closing the connection");
                    return;
                }
                awaiting_first = false;
            }
        }
    };
    let result = match ended {
        Ended::Served(result) => result,
        Ended::Closing => {
            served.connection().graceful_shutdown();
            served.await
        }
        Ended::Aged => {
            tracing::debug!(?age, "connection reached its age; sending GOAWAY");
            served.connection().graceful_shutdown();
            match tokio::time::timeout(times.age_grace, &mut served).await {
                Ok(result) => result,
                Err(_) => {
                    tracing::debug!(grace = ?times.age_grace, "calls outlasted the connection's age grace; closing it");
                    return;
                }
            }
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection ended with an error");
    }
    drop(closing);
}

/// Reports the socket as without vectored writes, so that h2 copies DATA payloads of up to
/// 1 KiB into its write buffer (256 bytes with vectored writes). A bigger payload is chained
/// instead, and h2 flushes before it encodes the next frame: every answer of rlsd's, HEADERS,
/// DATA of about 300 bytes and trailers, then took two `writev` calls, and two wake-ups of the
/// client. Now it takes one write.
struct UnvectoredWrites<I>(I);

impl<I: AsyncRead + Unpin> AsyncRead for UnvectoredWrites<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for UnvectoredWrites<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// hyper's executor for one connection: queues each stream for the connection's own task.
#[derive(Clone, Default)]
struct StreamQueue(Arc<Shared>);

impl<F: Future<Output = ()> + Send + 'static> hyper::rt::Executor<F> for StreamQueue {
    fn execute(&self, stream: F) {
        // A panic in one stream's handler ends that stream (hyper resets it when the future is
        // dropped), not the connection's other streams, as it would with a task per stream.
        let stream = AssertUnwindSafe(stream).catch_unwind().map(|result| {
            if result.is_err() {
                tracing::error!("a request handler panicked; its stream is reset");
            }
        });
        self.0
            .queued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Box::pin(stream));
        self.0.wake_by_ref();
    }
}

/// What a connection's task shares with its executor and with whatever wakes it.
#[derive(Default)]
struct Shared {
    /// Streams hyper handed over since the task last looked.
    queued: Mutex<Vec<StreamTask>>,
    /// The runtime's waker for the task, called only for wakes that come while it is not polling.
    task: AtomicWaker,
    /// Set while the task polls: a wake then only sets `woken`.
    polling: AtomicBool,
    /// A wake came since the current round began.
    woken: AtomicBool,
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // SeqCst on both flags: either the polling task sees `woken`, or this sees it has
        // stopped polling and wakes it through the runtime.
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

/// A connection and the streams it spawned, polled together by one task.
struct Served<C> {
    connection: Pin<Box<C>>,
    /// Whether the connection has spawned a stream yet.
    started: bool,
    /// Where the connection notes whether it has calls in flight, for shedding.
    tracked: Arc<super::shed::Tracked>,
    streams: FuturesUnordered<StreamTask>,
    /// Where queued streams are moved to under the lock, kept to reuse its allocation.
    adopted: Vec<StreamTask>,
    shared: Arc<Shared>,
    /// The waker the connection and the streams see: it wakes through [`Shared`].
    waker: Waker,
}

impl<C: Future> Served<C> {
    fn new(queue: StreamQueue, connection: C, tracked: Arc<super::shed::Tracked>) -> Self {
        let shared = queue.0;
        Served {
            connection: Box::pin(connection),
            started: false,
            tracked,
            streams: FuturesUnordered::new(),
            adopted: Vec::new(),
            waker: Waker::from(Arc::clone(&shared)),
            shared,
        }
    }

    fn connection(&mut self) -> Pin<&mut C> {
        self.connection.as_mut()
    }
}

impl<C: Future> Future for Served<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let Served {
            connection,
            started,
            tracked,
            streams,
            adopted,
            shared,
            waker,
        } = self.get_mut();
        shared.task.register(cx.waker());
        let mut inner = Context::from_waker(waker);
        shared.polling.store(true, Ordering::SeqCst);
        shared.woken.store(false, Ordering::SeqCst);
        for _ in 0..MAX_ROUNDS {
            // The connection first: it reads new requests (queueing their streams) and writes
            // what the streams answered in the previous round.
            if let Poll::Ready(output) = connection.as_mut().poll(&mut inner) {
                shared.polling.store(false, Ordering::SeqCst);
                return Poll::Ready(output);
            }
            std::mem::swap(
                adopted,
                &mut shared.queued.lock().unwrap_or_else(PoisonError::into_inner),
            );
            *started |= !adopted.is_empty();
            streams.extend(adopted.drain(..));
            while let Poll::Ready(Some(())) = streams.poll_next_unpin(&mut inner) {}
            if *started {
                tracked.busy(!streams.is_empty());
            }
            // Taking the flag (not a blind reset at the top of the round) keeps a wake that
            // lands between rounds, with the ordering the waker's store gave it.
            if !shared.woken.swap(false, Ordering::SeqCst) {
                shared.polling.store(false, Ordering::SeqCst);
                // A wake between the swap and this store saw `polling` still set.
                if !shared.woken.swap(false, Ordering::SeqCst) {
                    return Poll::Pending;
                }
                shared.polling.store(true, Ordering::SeqCst);
            }
            // With tokio's budget for this poll spent, its resources answer Pending and wake
            // at once: more rounds would only spin.
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        shared.polling.store(false, Ordering::SeqCst);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use hyper::rt::Executor;

    use super::*;

    /// Stands in for the runtime: counts how often the task was woken through it.
    #[derive(Default)]
    struct RuntimeWaker(AtomicUsize);

    impl Wake for RuntimeWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Stands in for hyper's connection: on its first poll it spawns one stream, which waits
    /// for `answer`, then marks the connection answered and wakes it; it ends once answered.
    fn connection_with_one_stream(
        queue: StreamQueue,
        answer: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + Unpin {
        let answered = Arc::new(AtomicBool::new(false));
        let mut answer = Some(Box::pin(answer));
        std::future::poll_fn(move |cx| {
            if answered.load(Ordering::SeqCst) {
                return Poll::Ready(());
            }
            if let Some(answer) = answer.take() {
                let (answered, waker) = (Arc::clone(&answered), cx.waker().clone());
                queue.execute(async move {
                    answer.await;
                    answered.store(true, Ordering::SeqCst);
                    waker.wake();
                });
            }
            Poll::Pending
        })
    }

    fn poll_once<F: Future + Unpin>(
        future: &mut F,
        runtime: &Arc<RuntimeWaker>,
    ) -> Poll<F::Output> {
        let waker = Waker::from(Arc::clone(runtime));
        Pin::new(future).poll(&mut Context::from_waker(&waker))
    }

    #[test]
    fn a_connections_age_is_spread_ten_percent_either_way() {
        let age = Duration::from_secs(100);
        assert_eq!(jittered(age, 0.0), Duration::from_secs(90));
        assert_eq!(jittered(age, 0.5), age);
        assert_eq!(jittered(age, 1.0), Duration::from_secs(110));
        let draws: Vec<f64> = (0..100).map(|_| draw()).collect();
        assert!(draws.iter().all(|draw| (0.0..=1.0).contains(draw)));
        assert!(
            draws.iter().any(|&draw| draw != draws[0]),
            "the same draw every time"
        );
    }

    #[test]
    fn a_stream_that_answers_at_once_is_answered_in_the_poll_that_spawned_it() {
        let queue = StreamQueue::default();
        let connection = connection_with_one_stream(queue.clone(), std::future::ready(()));
        let mut served = Served::new(queue, connection, super::super::shed::untracked());
        let runtime = Arc::new(RuntimeWaker::default());
        assert!(poll_once(&mut served, &runtime).is_ready());
        assert_eq!(
            runtime.0.load(Ordering::SeqCst),
            0,
            "woken through the runtime"
        );
    }

    #[test]
    fn a_panicking_stream_leaves_the_connections_other_streams_running() {
        let queue = StreamQueue::default();
        queue.execute(async { panic!("a handler's bug") });
        let connection = connection_with_one_stream(queue.clone(), std::future::ready(()));
        let mut served = Served::new(queue, connection, super::super::shed::untracked());
        let runtime = Arc::new(RuntimeWaker::default());
        assert!(poll_once(&mut served, &runtime).is_ready());
    }

    #[test]
    fn a_wake_while_idle_goes_through_the_runtime_and_the_next_poll_finishes() {
        let queue = StreamQueue::default();
        let (send, receive) = tokio::sync::oneshot::channel::<()>();
        let connection = connection_with_one_stream(queue.clone(), async move {
            let _ = receive.await;
        });
        let mut served = Served::new(queue, connection, super::super::shed::untracked());
        let runtime = Arc::new(RuntimeWaker::default());
        assert!(poll_once(&mut served, &runtime).is_pending());
        assert_eq!(runtime.0.load(Ordering::SeqCst), 0);
        send.send(()).expect("the stream waits");
        assert_eq!(
            runtime.0.load(Ordering::SeqCst),
            1,
            "the answer must wake the task"
        );
        assert!(poll_once(&mut served, &runtime).is_ready());
    }

    #[test]
    fn a_connection_that_keeps_waking_itself_yields_to_the_runtime() {
        let rounds = Arc::new(AtomicUsize::new(0));
        let connection = {
            let rounds = Arc::clone(&rounds);
            std::future::poll_fn(move |cx| {
                rounds.fetch_add(1, Ordering::SeqCst);
                cx.waker().wake_by_ref();
                Poll::<()>::Pending
            })
        };
        let mut served = Served::new(
            StreamQueue::default(),
            connection,
            super::super::shed::untracked(),
        );
        let runtime = Arc::new(RuntimeWaker::default());
        assert!(poll_once(&mut served, &runtime).is_pending());
        assert_eq!(rounds.load(Ordering::SeqCst), MAX_ROUNDS);
        assert_eq!(
            runtime.0.load(Ordering::SeqCst),
            1,
            "it must ask to be polled again"
        );
    }
}
