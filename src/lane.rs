//! Which serving lane the current thread is: a thread with a runtime of its own that serves the
//! connections handed to it (`server::ServeOptions::lanes`). Stores that keep state per thread
//! (the Redis store's connection and batcher) read it, so that a request, its store call and
//! the reply never cross threads.

use std::cell::Cell;

thread_local! {
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The lane this thread serves; `None` on any other thread.
pub fn current() -> Option<usize> {
    LANE.with(Cell::get)
}

/// Marks this thread as lane `index`, for the rest of its life.
pub(crate) fn enter(index: usize) {
    LANE.with(|lane| lane.set(Some(index)));
}
