//! Configuration: YAML files compatible with envoyproxy/ratelimit, validated into [`model`] types.

pub mod model;

pub use model::{Config, Domain, KeyNodes, Level, Node, Policy, Wildcard};
