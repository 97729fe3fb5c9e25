//! Connections given up under file descriptor pressure, cheapest first.
//!
//! Every accepted connection, on every port, holds a descriptor. When accepting fails because
//! the process or the system has none left, waiting for idle connections' own deadlines would
//! leave a new client unanswered for seconds: instead the accept loop closes a few of the
//! connections that cost least to lose, those that have never sent a request (oldest first),
//! then those between requests, and accepts again at once. Envoy's overload manager does the
//! same with `reduce_timeouts`. A connection with a request in flight is never shed.
//!
//! Descriptors are the process's, so the register is too: one for every server in it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use prometheus::IntCounterVec;
use tokio::sync::Notify;

/// Connections shed at each failed accept: enough that a queue of hundreds drains in a few dozen
/// rounds, few enough that a burst costs little more than it must.
const BATCH: usize = 16;

/// Which kind of port a connection came in on, for the metric.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Port {
    /// gRPC, over TCP or the Unix socket.
    Grpc,
    /// The admin, debug and metrics ports.
    Http,
}

impl Port {
    fn label(self) -> &'static str {
        match self {
            Port::Grpc => "grpc",
            Port::Http => "http",
        }
    }
}

/// Has not sent a request yet.
const FRESH: u8 = 0;
/// Has a request in flight.
const BUSY: u8 = 1;
/// Has sent requests, none in flight.
const IDLE: u8 = 2;

/// A connection as the register sees it.
#[derive(Debug)]
pub(crate) struct Tracked {
    port: Port,
    state: AtomicU8,
    /// Picked for shedding; set once.
    picked: AtomicBool,
    shed: Notify,
}

impl Tracked {
    fn new(port: Port) -> Tracked {
        Tracked {
            port,
            state: AtomicU8::new(FRESH),
            picked: AtomicBool::new(false),
            shed: Notify::new(),
        }
    }

    /// Notes whether the connection has a request in flight.
    pub(crate) fn busy(&self, busy: bool) {
        let state = if busy { BUSY } else { IDLE };
        // A load first: a connection's every poll must not dirty the line when nothing changed.
        if self.state.load(Ordering::Relaxed) != state {
            self.state.store(state, Ordering::Relaxed);
        }
    }

    /// Resolves once the connection has been picked for shedding: close it then.
    pub(crate) async fn shed(&self) {
        let notified = self.shed.notified();
        if self.picked.load(Ordering::Acquire) {
            return;
        }
        notified.await;
    }
}

/// A connection's state held by no register, for tests of what notes it.
#[cfg(test)]
pub(crate) fn untracked() -> Arc<Tracked> {
    Arc::new(Tracked::new(Port::Grpc))
}

/// A connection's place in the register, for as long as it is held.
#[derive(Debug)]
pub(crate) struct Registration {
    register: &'static Register,
    id: u64,
    tracked: Arc<Tracked>,
}

impl Registration {
    /// Registers a connection just accepted on `port`.
    pub(crate) fn new(port: Port) -> Registration {
        REGISTER.add(port)
    }

    /// What the connection's tasks note their state on, and wait on.
    pub(crate) fn tracked(&self) -> &Arc<Tracked> {
        &self.tracked
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.register.held().remove(&self.id);
    }
}

/// Every connection held, by age.
#[derive(Debug, Default)]
struct Register {
    /// Ids only grow, so the map's order is the connections' age.
    next: AtomicU64,
    held: Mutex<BTreeMap<u64, Arc<Tracked>>>,
}

impl Register {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Tracked>>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn add(&'static self, port: Port) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let tracked = Arc::new(Tracked::new(port));
        self.held().insert(id, Arc::clone(&tracked));
        Registration {
            register: self,
            id,
            tracked,
        }
    }

    /// Picks up to [`BATCH`] connections to close, those that never sent a request first,
    /// oldest first, then those between requests; tells each to close. Returns how many.
    fn shed(&self) -> usize {
        let mut picked = Vec::with_capacity(BATCH);
        {
            let held = self.held();
            for wanted in [FRESH, IDLE] {
                let candidates = held.values().filter(|tracked| {
                    tracked.state.load(Ordering::Relaxed) == wanted
                        && !tracked.picked.load(Ordering::Relaxed)
                });
                for tracked in candidates.take(BATCH - picked.len()) {
                    tracked.picked.store(true, Ordering::Release);
                    picked.push((Arc::clone(tracked), wanted));
                }
            }
        }
        for (tracked, state) in &picked {
            let state = if *state == FRESH { "fresh" } else { "idle" };
            SHED_TOTAL
                .with_label_values(&[tracked.port.label(), state])
                .inc();
            tracked.shed.notify_one();
        }
        picked.len()
    }
}

/// Descriptors are the process's: one register for every server in it.
static REGISTER: LazyLock<Register> = LazyLock::new(Register::default);

/// `rlsd_connections_shed_total{port, state}`: registered with every server's metrics.
pub(crate) static SHED_TOTAL: LazyLock<IntCounterVec> = LazyLock::new(|| {
    IntCounterVec::new(
        prometheus::Opts::new(
            "rlsd_connections_shed_total",
            "Connections closed to free file descriptors for new ones, by port and by what \
             they were doing (fresh: no request yet; idle: between requests)",
        ),
        &["port", "state"],
    )
    .unwrap_or_else(|error| unreachable!("the metric is well-formed: {error}"))
});

/// Closes up to a few of the process's connections that cost least to lose (see
/// [`Register::shed`]); how many.
pub(crate) fn shed_some() -> usize {
    REGISTER.shed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fresh_connections_go_first_oldest_first_then_idle_ones_never_busy_ones() {
        let register: &'static Register = Box::leak(Box::default());
        let connections: Vec<Registration> = (0..40).map(|_| register.add(Port::Grpc)).collect();
        for (index, connection) in connections.iter().enumerate() {
            match index % 4 {
                0 => connection.tracked().busy(true),
                1 => connection.tracked().busy(false),
                _ => {}
            }
        }
        let picked =
            |connection: &Registration| connection.tracked().picked.load(Ordering::Relaxed);
        while connections.iter().filter(|c| picked(c)).count() < 30 {
            assert!(register.shed() > 0, "nothing left to shed");
        }
        assert!(
            connections.iter().step_by(4).all(|c| !picked(c)),
            "a busy connection was shed"
        );
        // The 20 fresh ones went before any idle one, and the oldest idle ones first.
        let picked_at = |index: usize| picked(&connections[index]);
        assert!((0..40).filter(|i| i % 4 >= 2).all(picked_at));
        let idle: Vec<bool> = (0..40).filter(|i| i % 4 == 1).map(picked_at).collect();
        assert!(idle.windows(2).all(|pair| pair[0] >= pair[1]), "{idle:?}");
        assert_eq!(register.shed(), 0, "only busy ones are left");
        // A picked connection's wait resolves, even if it starts waiting afterwards.
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            connections[2].tracked().shed(),
        )
        .await
        .expect("told to close");
    }
}
