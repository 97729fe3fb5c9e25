//! The integration tests, in one binary so the suite links once: each module drives the rlsd
//! binary or the library over real gRPC, HTTP and Redis (servers it starts itself).

mod common;
// The bench tool's own HTTP/2 client and probes, tested here against a real rlsd.
#[path = "../../benches/support/h2load.rs"]
mod h2load;
#[path = "../../benches/support/rawh2.rs"]
mod rawh2;
#[path = "../../benches/support/stalls.rs"]
mod stalls;

mod bad_input;
mod behaviour;
mod bench_client;
mod cli;
mod cluster;
mod deploy;
mod envoy_wire;
mod grpc;
mod http2_limits;
mod operations;
mod over_limit_cache;
mod properties;
mod ratelimit_env;
mod redis;
mod reload;
mod sentinel;
mod simulate;
mod three_layer;
mod tls;
mod traces;
mod unix_socket;
mod xds;
