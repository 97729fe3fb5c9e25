//! Driving futures that never wait (the in-process store's) without an executor.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// Polls `future` once; it must be ready then (`MemoryStore` never waits).
pub fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the in-process store's future was not ready on its first poll"),
    }
}
