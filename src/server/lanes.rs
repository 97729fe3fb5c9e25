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

/// The running lanes; dropping them stops their threads (tasks still on them are dropped).
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    next: AtomicUsize,
}

struct Lane {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
}

impl Lanes {
    /// Starts `count` lanes, threads named `rlsd-lane-<i>`.
    ///
    /// # Errors
    /// When a runtime or a thread cannot be created.
    pub(crate) fn start(count: usize) -> std::io::Result<Lanes> {
        let mut lanes = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("rlsd-lane-{index}"))
                .spawn(move || {
                    crate::lane::enter(index);
                    // A dropped sender stops the lane as well as a sent stop.
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            lanes.push(Lane {
                handle,
                stop: Some(stop),
            });
        }
        Ok(Lanes {
            lanes,
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
