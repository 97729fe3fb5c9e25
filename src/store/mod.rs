//! Where counters live. A store decides every check of one request atomically: all or nothing.

pub mod memory;

use std::future::Future;

use crate::algorithm::{Hits, Params, Verdict};

pub use memory::{MemoryStore, MemoryStoreStats};

/// One limit to check for one request: the store sees keys and numbers, never descriptors.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    /// The state key (`<prefix>:<layer>:<domain>:<algorithm>:<period>:<entries>`).
    pub key: String,
    /// The algorithm and its numbers.
    pub params: Params,
    /// Hits to take, peek or refund.
    pub hits: Hits,
    /// Shadow mode: evaluated and reported, never denies.
    pub shadow: bool,
}

/// The store's answer for one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// What this limit says. When another limit denied the request, `allowed` still says
    /// whether this one would have passed, with `remaining` unconsumed.
    pub verdict: Verdict,
}

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The in-process store holds as many keys as it may; new keys cannot be tracked.
    #[error("in-process store is full ({capacity} live keys)")]
    Full {
        /// The configured cap.
        capacity: usize,
    },
}

/// A place to decide checks. Implementations: [`MemoryStore`] (default).
pub trait Store: Send + Sync + 'static {
    /// Decides `checks` together: each check is evaluated in order (a key that appears twice
    /// sees the first one's hits), and state changes only if every non-shadow check allows.
    /// Returns one outcome per check, in order.
    fn decide(
        &self,
        checks: &[Check],
    ) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send;
}

/// Whether a request whose checks produced `outcomes` is allowed: every enforced check passed.
pub fn request_allowed(checks: &[Check], outcomes: &[Outcome]) -> bool {
    checks
        .iter()
        .zip(outcomes)
        .all(|(check, outcome)| check.shadow || outcome.verdict.allowed)
}
