//! Where counters live. A store decides every check of one request atomically: all or nothing.

pub mod any;
pub mod cache;
pub mod cluster;
pub mod deadline;
pub mod memory;
pub mod redis;

use std::future::Future;
use std::time::Instant;

use crate::algorithm::{Hits, Params, Verdict};

pub use any::{AnyStore, StoreSettings, connect};
pub use cache::OverLimitCache;
pub use cluster::{ClusterSettings, ClusterStore};
pub use memory::{MemoryStore, MemoryStoreStats};
pub use redis::{ClientIdentity, RedisSettings, RedisStore};

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
    /// Quota mode: denies only with every other quota-mode check of the request (see
    /// [`request_allowed`]).
    pub quota_mode: bool,
}

/// The store's answer for one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// What this limit says. When another limit denied the request, `allowed` still says
    /// whether this one would have passed, with `remaining` unconsumed.
    pub verdict: Verdict,
}

/// Why a store could not decide.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The in-process store holds as many keys as it may; new keys cannot be tracked.
    #[error("in-process store is full ({capacity} live keys)")]
    Full {
        /// The configured cap.
        capacity: usize,
    },
    /// The store could not be reached or refused the command.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store did not answer in time.
    #[error("store did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The store answered something rlsd cannot read.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// The store cannot be set up as configured.
    #[error("{0}")]
    Config(String),
}

impl StoreError {
    /// A short stable name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Full { .. } => "full",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Timeout(_) => "timeout",
            StoreError::Protocol(_) => "protocol",
            StoreError::Config(_) => "config",
        }
    }
}

/// A place to decide checks. Implementations: [`MemoryStore`] (default), [`RedisStore`].
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and metric labels (`memory`, `redis`).
    fn name(&self) -> &'static str;

    /// Whether the store can answer right now (health checks).
    fn healthy(&self) -> impl Future<Output = bool> + Send;

    /// Publishes the store's own gauges (the in-process store's key counts).
    fn report(&self, _metrics: &crate::metrics::Metrics) {}

    /// Runs once on each serving lane's thread before the lane serves (see [`crate::lane`]): a
    /// store with state per lane opens it here, within its own connect timeout, so the lane's
    /// first requests do not pay for it inside their command timeout.
    fn open_lane(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// Decides `checks` together: each check is evaluated in order (a key that appears twice
    /// sees the first one's hits), and state changes only if every non-shadow check allows.
    /// Returns one outcome per check, in order. Waits as long as the store's own timeout.
    fn decide(
        &self,
        checks: &[Check],
    ) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send {
        self.decide_by(checks, None)
    }

    /// [`Store::decide`] for a caller that stops waiting at `deadline` (`None`: the store's own
    /// timeout). A store that cannot answer in time answers [`StoreError::Timeout`], and then
    /// nothing of the call is counted.
    fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send;
}

/// The checks that give back what a committed request took: its allowed takes (a shadow check
/// that said no took nothing).
pub fn refunds(checks: &[Check], outcomes: &[Outcome]) -> Vec<Check> {
    checks
        .iter()
        .zip(outcomes)
        .filter_map(|(check, outcome)| match check.hits {
            Hits::Take(n) if outcome.verdict.allowed => Some(Check {
                hits: Hits::Refund(n),
                ..check.clone()
            }),
            _ => None,
        })
        .collect()
}

/// Whether a request whose checks produced `outcomes` is allowed: every enforced check passed,
/// and [`quotas_pass`]. A refund never denies: hits given back must land, even on a key over
/// its limit (one a charge left in debt).
pub fn request_allowed(checks: &[Check], outcomes: &[Outcome]) -> bool {
    checks.iter().zip(outcomes).all(|(check, outcome)| {
        check.shadow || check.quota_mode || refunds_only(check) || outcome.verdict.allowed
    }) && quotas_pass(checks, outcomes)
}

fn refunds_only(check: &Check) -> bool {
    matches!(check.hits, Hits::Refund(_))
}

/// Whether the request's quota-mode checks (shadow ones aside) let it through: it has none, or
/// one of them passed.
pub fn quotas_pass(checks: &[Check], outcomes: &[Outcome]) -> bool {
    let mut quotas = checks
        .iter()
        .zip(outcomes)
        .filter(|(check, _)| check.quota_mode && !check.shadow && !refunds_only(check))
        .peekable();
    quotas.peek().is_none() || quotas.any(|(_, outcome)| outcome.verdict.allowed)
}
