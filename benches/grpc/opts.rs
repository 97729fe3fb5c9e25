//! The bench's settings, read from `RLSD_BENCH_*` variables (docs/benchmarks.md lists them),
//! and the load generators it can drive.

use std::path::PathBuf;
use std::time::Duration;

use rlsd_testkit::workload::Shape;

use crate::ceiling::CeilingKeys;

/// What one run measures and how, from the environment.
pub(crate) struct Opts {
    pub(crate) seconds: Duration,
    /// How long `stalls::probe` spins before and after the phases (0: not at all).
    pub(crate) stall_probe: Duration,
    pub(crate) rounds: usize,
    pub(crate) connections: usize,
    pub(crate) inflight: usize,
    pub(crate) server_threads: usize,
    pub(crate) lanes: usize,
    pub(crate) client_threads: usize,
    pub(crate) shared: bool,
    pub(crate) extra: bool,
    pub(crate) pool: bool,
    pub(crate) tracing: bool,
    pub(crate) phases: Vec<String>,
    pub(crate) open_rate: Option<f64>,
    pub(crate) open_fractions: Vec<f64>,
    pub(crate) only: Option<Vec<String>>,
    pub(crate) shapes: Vec<Shape>,
    pub(crate) algorithm: String,
    pub(crate) redis: bool,
    pub(crate) max_batch: usize,
    pub(crate) pipelines: usize,
    pub(crate) plot: PathBuf,
}

impl Opts {
    /// Reads every setting, with its default where it is unset.
    pub(crate) fn from_env() -> Opts {
        fn var<T: std::str::FromStr>(name: &str, default: T) -> T {
            std::env::var(name)
                .ok()
                .map(|s| {
                    s.parse()
                        .unwrap_or_else(|_| panic!("{name}: cannot parse {s:?}"))
                })
                .unwrap_or(default)
        }
        Opts {
            seconds: Duration::from_secs_f64(var("RLSD_BENCH_SECONDS", 2.0)),
            stall_probe: Duration::from_secs_f64(var("RLSD_BENCH_STALL_PROBE", 2.0)),
            rounds: var("RLSD_BENCH_ROUNDS", 3_usize).max(1),
            connections: var("RLSD_BENCH_CONNECTIONS", 4_usize).max(1),
            inflight: var("RLSD_BENCH_INFLIGHT", 16_usize).max(1),
            server_threads: var("RLSD_BENCH_SERVER_THREADS", 2_usize).max(1),
            lanes: var(
                "RLSD_BENCH_LANES",
                var("RLSD_BENCH_SERVER_THREADS", 2_usize).max(1),
            ),
            client_threads: var("RLSD_BENCH_CLIENT_THREADS", 2_usize).max(1),
            shared: var("RLSD_BENCH_SHARED", 0_u8) == 1,
            extra: var("RLSD_BENCH_EXTRA", 0_u8) == 1,
            pool: var("RLSD_BENCH_POOL", 0_u8) == 1,
            tracing: var("RLSD_BENCH_TRACING", 0_u8) == 1,
            phases: var(
                "RLSD_BENCH_PHASES",
                "peak,h2load,raw,open,raw-open,single,raw-single".to_owned(),
            )
            .split(',')
            .map(|p| p.trim().to_owned())
            .collect(),
            open_rate: std::env::var("RLSD_BENCH_OPEN_RATE")
                .ok()
                .map(|s| s.parse().expect("RLSD_BENCH_OPEN_RATE is requests/s")),
            open_fractions: var("RLSD_BENCH_OPEN_FRACTIONS", "0.5,0.25".to_owned())
                .split(',')
                .map(|f| {
                    f.trim()
                        .parse()
                        .expect("RLSD_BENCH_OPEN_FRACTIONS: numbers")
                })
                .collect(),
            only: std::env::var("RLSD_BENCH_ONLY")
                .ok()
                .map(|s| s.split(',').map(|p| p.trim().to_owned()).collect()),
            shapes: var("RLSD_BENCH_SHAPES", "1,3,10".to_owned())
                .split(',')
                .map(|n| {
                    let n: usize = n.trim().parse().expect("RLSD_BENCH_SHAPES: 1, 3 or 10");
                    Shape::ALL
                        .into_iter()
                        .find(|s| s.descriptors() == n)
                        .expect("RLSD_BENCH_SHAPES: 1, 3 or 10")
                })
                .collect(),
            algorithm: var("RLSD_BENCH_ALGORITHM", "gcra".to_owned()),
            redis: var("RLSD_BENCH_REDIS", 1_u8) == 1,
            max_batch: var(
                "RLSD_BENCH_MAX_BATCH",
                rlsd::store::redis::DEFAULT_MAX_BATCH,
            )
            .max(2),
            pipelines: var(
                "RLSD_BENCH_PIPELINES",
                rlsd::store::redis::DEFAULT_PIPELINES,
            )
            .max(1),
            plot: PathBuf::from(var(
                "RLSD_BENCH_PLOT",
                concat!(env!("CARGO_MANIFEST_DIR"), "/target/rlsd-bench.svg").to_owned(),
            )),
        }
    }
}

/// The load generators the peak and open-loop phases run with, in the order tables and the
/// plot show them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Driver {
    /// The bench's own tonic clients.
    Tonic,
    /// nghttp2's h2load (C), one fixed body per shape.
    H2load,
    /// The lean hand-written HTTP/2 client of `rlsd_testkit::rawh2`.
    Raw,
}

impl Driver {
    pub(crate) const ALL: [Driver; 3] = [Driver::Tonic, Driver::H2load, Driver::Raw];

    /// Its peak phase's name in `RLSD_BENCH_PHASES` and in tables.
    pub(crate) fn phase(self) -> &'static str {
        match self {
            Driver::Tonic => "peak",
            Driver::H2load => "h2load",
            Driver::Raw => "raw",
        }
    }

    /// Its open-loop phase's name, when it has one (h2load's `--rps` sends in bursts).
    pub(crate) fn open_phase(self) -> Option<&'static str> {
        match self {
            Driver::Tonic => Some("open"),
            Driver::H2load => None,
            Driver::Raw => Some("raw-open"),
        }
    }

    /// Its one-request-in-flight phase's name, when it has one.
    pub(crate) fn single_phase(self) -> Option<&'static str> {
        match self {
            Driver::Tonic => Some("single"),
            Driver::H2load => None,
            Driver::Raw => Some("raw-single"),
        }
    }

    /// Whose keys its ceiling carries: the keys its requests carry.
    pub(crate) fn ceiling_keys(self) -> CeilingKeys {
        match self {
            Driver::H2load => CeilingKeys::OneClient,
            Driver::Tonic | Driver::Raw => CeilingKeys::Random,
        }
    }

    pub(crate) fn ceiling_name(self) -> &'static str {
        match self.ceiling_keys() {
            CeilingKeys::Random => "redis-benchmark",
            CeilingKeys::OneClient => "redis-benchmark, same keys",
        }
    }

    /// How the plot names the client.
    pub(crate) fn title(self) -> &'static str {
        match self {
            Driver::Tonic => "tonic client",
            Driver::H2load => "h2load client (C, one client's keys; ceiling on the same keys)",
            Driver::Raw => "lean client (hand-written HTTP/2, one thread)",
        }
    }
}
