//! Envoy's Rate Limit Quota Service (`StreamRateLimitQuotas`): usage reports in, per-Envoy
//! token buckets out, a bucket's limit split max-min fair over every Envoy that reports it,
//! across replicas through the store. `docs/rlqs.md` says what it guarantees.
//!
//! - [`rules`]: which limit a bucket id gets (`quota_buckets:` in a domain file).
//! - [`alloc`]: the split, as pure functions.
//! - [`board`]: where demands meet (in process, or Redis with `lua/rlqs.lua`).
//! - [`service`]: the streams.

pub mod alloc;
pub mod board;
pub mod metrics;
pub mod rules;
pub mod service;

pub use board::{DemandBoard, MemoryBoard, StoreBoard};
pub use rules::{BucketRule, Quota, QuotaRules, SharedDescriptor, ValueMatch};
pub use service::{QuotaService, RlqsSettings, View};
