//! What rlsd's integration tests and benches share, so nothing is copied or included by path:
//!
//! - [`redis`], [`cluster`], [`sentinel`]: private Redis deployments on free loopback ports,
//!   started by the caller and killed when dropped.
//! - [`rawh2`]: a lean hand-written HTTP/2 gRPC client that paces requests to within µs;
//!   [`h2load`]: nghttp2's load generator as a second client.
//! - [`workload`]: the requests and config the gRPC-level benches use.
//! - [`stalls`]: how much the machine itself takes CPUs away during a run; [`cpu`]: a
//!   process's or thread's CPU time.
//! - [`counting_alloc`]: a global allocator that counts allocations and net bytes;
//!   [`ready`]: polling a future that never waits without an executor.

pub mod cluster;
pub mod counting_alloc;
pub mod cpu;
pub mod h2load;
pub mod rawh2;
pub mod ready;
pub mod redis;
pub mod sentinel;
pub mod stalls;
pub mod workload;
