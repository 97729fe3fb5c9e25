//! The integration tests, in one binary so the suite links once: each module drives the rlsd
//! binary or the library over real gRPC, HTTP and Redis (servers it starts itself).

mod common;

mod admin_json;
mod bad_input;
mod behaviour;
mod bench_client;
mod charges;
mod cli;
mod cluster;
mod config_health;
mod connection_limits;
mod deploy;
mod envoy_wire;
mod grpc;
mod http2_limits;
mod key_size;
mod operations;
mod over_limit_cache;
mod properties;
mod ratelimit_env;
mod redis;
mod reference;
mod reference_config;
mod reload;
mod rlqs;
mod rlqs_shared;
mod sentinel;
mod simulate;
mod three_layer;
mod tls;
mod traces;
mod unix_socket;
mod upstream_answers;
mod xds;
