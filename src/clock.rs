//! Time sources. Stores read `now` through [`Clock`] so tests can drive time by hand.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of Unix time in microseconds.
pub trait Clock: Send + Sync + 'static {
    /// Microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        // A system clock before 1970 is treated as the epoch rather than failing a request.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_micros() as u64)
    }
}

/// A clock that moves only when told to, for tests.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `now_us`.
    pub fn at(now_us: u64) -> ManualClock {
        ManualClock {
            now: Arc::new(AtomicU64::new(now_us)),
        }
    }

    /// Sets the reading (it may go back, as real clocks do).
    pub fn set(&self, now_us: u64) {
        self.now.store(now_us, Ordering::SeqCst);
    }

    /// Moves the reading forward.
    pub fn advance(&self, by_us: u64) {
        self.now.fetch_add(by_us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}
