//! rlsd: a rate limit service for Envoy (`envoy.service.ratelimit.v3.RateLimitService`).
//!
//! The binary (`src/main.rs`) is a thin shell over these modules; `docs/architecture.md` follows
//! a request through them.
//!
//! # Modules
//! - [`admin`]: the admin HTTP port: `/healthcheck`, `/metrics`, `/rlconfig` and `/json`.
//! - [`algorithm`]: the arithmetic of each algorithm, as pure functions of
//!   `(state, now, params, hits)`.
//! - [`cli`]: the command line (`rlsd serve`, `check`, `simulate`), its flags and `RLSD_*`
//!   variables, and the settings they make.
//! - [`clock`]: time sources; stores read `now` through one, so tests can drive time by hand.
//! - [`codec`]: the gRPC codec of `RateLimitService`: prost's, with the response encoded and the
//!   usual request decoded by hand.
//! - [`config`]: YAML files compatible with envoyproxy/ratelimit, loaded and validated into an
//!   immutable [`config::Config`].
//! - [`engine`]: from a request's descriptors to store checks: matching, `replaces`, hits, keys.
//! - [`health`]: whether the server is draining and its store answering, as `/healthcheck` and
//!   gRPC health report it, and the prober that keeps it current.
//! - [`json`]: proto3 JSON for the admin `/json` endpoint.
//! - [`lane`]: which serving lane the current thread is, for stores that keep state per lane.
//! - [`limit`]: the validated limit vocabulary shared by config, engine and stores: units,
//!   periods, algorithms.
//! - [`metrics`]: Prometheus metrics, envoyproxy/ratelimit's `ratelimit_service_*` names plus
//!   rlsd's own `rlsd_*`.
//! - [`pb`]: the generated Envoy wire types (`RateLimitService`, and the xDS client's).
//! - [`ratelimit_env`]: envoyproxy/ratelimit's environment variables, read as `rlsd serve` flags
//!   when the binary runs as `/bin/ratelimit`.
//! - [`reload`]: hot reload: re-read the config when its files change or on SIGHUP, swap it in
//!   only when valid.
//! - [`rlqs`]: Envoy's Rate Limit Quota Service: reports in, per-Envoy token buckets out, each
//!   bucket's limit split max-min fair across Envoys and replicas.
//! - [`server`]: listeners, serving lanes, HTTP/2 connections, the gRPC routes, and shutdown.
//! - [`service`]: the `RateLimitService` itself: validate, match, decide, assemble the answer.
//! - [`simulate`]: `rlsd simulate`: what each algorithm does to a descriptor's traffic, as a
//!   table and a picture.
//! - [`store`]: where counters live (in process, Redis, Redis Cluster); each decides every check
//!   of one request atomically, all or nothing.
//! - [`svg`]: hand-written SVG shared by `simulate`'s picture and the bench plots.
//! - [`telemetry`]: OpenTelemetry tracing: a server span per `ShouldRateLimit`, under the trace
//!   context Envoy sends, exported over OTLP.
//! - [`tls`]: TLS and mutual TLS on the gRPC port, with certificates reloaded when their files
//!   change.
//! - [`xds`]: config from an xDS management server, as Envoy Gateway delivers it.

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
pub mod rlqs;
pub mod server;
pub mod service;
pub mod simulate;
pub mod store;
pub mod svg;
pub mod telemetry;
pub mod tls;
pub mod xds;
