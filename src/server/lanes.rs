//! Serving lanes: threads that each drive a current-thread runtime of their own, with gRPC
//! connections handed to them in turn.
//!
//! On tokio's multi-thread runtime a request, the store call it makes and the reply often run
//! on different workers: each hand-off wakes another thread (a futex wake, and on a virtual
//! machine an interrupt to another CPU), and an idle worker is woken to steal work it then gives
//! back. On a lane everything a connection does stays on one thread, and a store that keeps
//! state per lane (the Redis store's connection and batchers, see [`crate::lane`]) keeps it there
//! too.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The running lanes. Dropping them tells their threads to stop; the threads then drop the
/// tasks still on them (connections past the shutdown grace) by themselves, unjoined.
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    next: AtomicUsize,
}

struct Lane {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
}

impl Lanes {
    /// Starts `count` lanes, threads named `rlsd-lane-<i>`, and returns once each has run
    /// `open` (the store's per-lane set-up) and is ready to serve.
    ///
    /// # Errors
    /// When a thread or its runtime cannot be created.
    pub(crate) async fn start<F, O>(count: usize, open: F) -> std::io::Result<Lanes>
    where
        F: Fn() -> O + Clone + Send + 'static,
        O: Future<Output = ()>,
    {
        let mut lanes = Vec::with_capacity(count);
        let mut opening = Vec::with_capacity(count);
        for index in 0..count {
            let (stop, stopped) = oneshot::channel::<()>();
            let (ready, started) = oneshot::channel::<std::io::Result<Handle>>();
            let open = open.clone();
            std::thread::Builder::new()
                .name(format!("rlsd-lane-{index}"))
                .spawn(move || {
                    crate::lane::enter(index);
                    // Built here, so that no runtime is ever dropped inside another's context.
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(error) => {
                            let _ = ready.send(Err(error));
                            return;
                        }
                    };
                    runtime.block_on(async {
                        open().await;
                        if ready.send(Ok(Handle::current())).is_err() {
                            return;
                        }
                        // A dropped sender stops the lane as well as a sent stop.
                        let _ = stopped.await;
                    });
                })?;
            lanes.push(stop);
            opening.push(started);
        }
        let mut started = Vec::with_capacity(count);
        for (stop, opened) in lanes.into_iter().zip(opening) {
            let handle = opened
                .await
                .map_err(|_| std::io::Error::other("a serving lane stopped while starting"))??;
            started.push(Lane {
                handle,
                stop: Some(stop),
            });
        }
        Ok(Lanes {
            lanes: started,
            next: AtomicUsize::new(0),
        })
    }

    /// Runs `task` on the next lane, round robin.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        self.lanes[index].handle.spawn(task);
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            if let Some(stop) = lane.stop.take() {
                let _ = stop.send(());
            }
        }
    }
}
