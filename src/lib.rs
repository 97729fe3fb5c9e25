//! rlsd: a rate limit service for Envoy (`envoy.service.ratelimit.v3.RateLimitService`).
//!
//! # Layout
//! - [`pb`]: generated Envoy wire types; only [`service`] uses them.
//! - [`config`]: YAML loading and validation into an immutable [`config::Config`].
//! - [`limit`]: units, periods, algorithms and limits, shared by every module.
//! - [`engine`]: matching a request's descriptors against the config and planning store checks.
//! - [`algorithm`]: the pure arithmetic of each algorithm.
//! - [`store`]: where counters live; decides all checks of a request atomically.
//! - [`service`]: the tonic service; wire types in, wire types out.
//! - [`server`]: listeners, signals and shutdown.
//! - [`simulate`]: `rlsd simulate`, replaying traffic through the engine under each algorithm.
//! - [`tls`]: TLS and mutual TLS on the gRPC port, with certificates reloaded from their files.

pub mod admin;
pub mod algorithm;
pub mod cli;
pub mod clock;
pub mod codec;
pub mod config;
pub mod engine;
pub mod health;
pub mod json;
pub mod lane;
pub mod limit;
pub mod metrics;
pub mod pb;
pub mod ratelimit_env;
pub mod reload;
pub mod server;
pub mod service;
pub mod simulate;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod xds;
