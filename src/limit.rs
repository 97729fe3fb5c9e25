//! Validated limit vocabulary shared by config, engine and stores: units, periods, algorithms.

use std::fmt;
use std::num::NonZeroU32;

/// Microseconds per second; all store arithmetic is in microseconds.
pub const MICROS_PER_SECOND: u64 = 1_000_000;

/// A time unit of a limit, as envoyproxy/ratelimit names them (month = 30 days, year = 365 days).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// One second.
    Second,
    /// 60 seconds.
    Minute,
    /// 3,600 seconds.
    Hour,
    /// 86,400 seconds.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Parses a unit name case-insensitively (`minute`, `MINUTE`, `Minute`).
    pub fn parse(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|unit| unit.name().eq_ignore_ascii_case(name))
    }

    /// The lowercase config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// Length of one unit in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A limit's period: a unit times a multiplier (`5 x minute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Period {
    /// The base unit, reported on the wire as `current_limit.unit`.
    pub unit: Unit,
    /// How many units one period spans; 1 for plain envoyproxy/ratelimit configs.
    pub multiplier: NonZeroU32,
}

impl Period {
    /// A period of exactly one unit.
    pub fn of(unit: Unit) -> Period {
        Period {
            unit,
            multiplier: NonZeroU32::MIN,
        }
    }

    /// Length in whole seconds.
    pub fn seconds(self) -> u64 {
        self.unit.seconds() * u64::from(self.multiplier.get())
    }

    /// Length in microseconds.
    pub fn micros(self) -> u64 {
        self.seconds() * MICROS_PER_SECOND
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.multiplier.get() {
            1 => write!(f, "{}", self.unit),
            n => write!(f, "{n} x {}", self.unit),
        }
    }
}

/// The rate limiting algorithm of one limit (`docs/algorithms.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Counter per epoch-aligned window; up to 2L across an edge.
    #[default]
    FixedWindow,
    /// Exact: a log of allowed hits' timestamps.
    SlidingWindowLog,
    /// Weighted estimate from the current and previous windows.
    SlidingWindowCounter,
    /// Capacity `burst`, refilled continuously at L per P.
    TokenBucket,
    /// Generic cell rate algorithm: evenly spaced requests with a burst tolerance.
    Gcra,
}

impl Algorithm {
    /// Every algorithm, in documentation order.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ];

    /// Parses the config spelling (`fixed_window`, `gcra`, ...).
    pub fn parse(name: &str) -> Option<Algorithm> {
        Algorithm::ALL
            .into_iter()
            .find(|algorithm| algorithm.name() == name)
    }

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
        }
    }

    /// The short tag used inside store keys.
    pub fn key_tag(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fw",
            Algorithm::SlidingWindowLog => "swlc",
            Algorithm::SlidingWindowCounter => "swc",
            Algorithm::TokenBucket => "tb",
            Algorithm::Gcra => "gcra",
        }
    }

    /// Whether `burst` means anything for this algorithm.
    pub fn takes_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }

    /// Burst used when the config gives none: L for token bucket, 1 for GCRA, L otherwise.
    pub fn default_burst(self, requests_per_unit: u32) -> u32 {
        match self {
            Algorithm::Gcra => 1,
            _ => requests_per_unit,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One enforceable limit: `requests_per_unit` per `period` under `algorithm`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    /// `name`, reported as `current_limit.name` and the target of `replaces`.
    pub name: Option<String>,
    /// L; 0 denies every request.
    pub requests_per_unit: u32,
    /// P.
    pub period: Period,
    /// Which algorithm decides.
    pub algorithm: Algorithm,
    /// B for token bucket and GCRA; `None` means the algorithm's default.
    pub burst: Option<NonZeroU32>,
    /// Evaluated and reported, never denies.
    pub shadow: bool,
    /// `quota_mode`: one of the request's quotas, which deny only when every quota-mode limit
    /// of the request is over.
    pub quota_mode: bool,
    /// Names of limits this one replaces when both match one request.
    pub replaces: Vec<String>,
    /// Tells apart limits of one descriptor that share algorithm and period, so each keeps its
    /// own counter; 0 for the first.
    pub variant: u32,
    /// Which hits are charges for work already done, recorded whatever the answer.
    pub charge: Charge,
}

/// Which hits of a limit are charges: costs of work already done (a response's tokens), recorded
/// whatever the answer, where other hits are taken only when the whole request is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Charge {
    /// Not set on the limit (a YAML limit without `charge:`, every xDS limit, an Envoy
    /// override): the service's default, `--default-charge` (`descriptor_hits` unless set).
    #[default]
    Default,
    /// A descriptor's own `hits_addend` is a charge; the request's hits are not. This is how
    /// Envoy (and Envoy Gateway's `responseCost`, AI Gateway's token costs) sends costs, so it
    /// needs nothing in the config, which over xDS could not say it anyway.
    DescriptorHits,
    /// Every hit is a charge, as envoyproxy/ratelimit counts every hit.
    Always,
    /// No hit is: a denied request takes nothing, whatever it carries.
    Never,
}

impl Charge {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Charge::Default => "default",
            Charge::DescriptorHits => "descriptor_hits",
            Charge::Always => "always",
            Charge::Never => "never",
        }
    }

    /// Parses the config spelling (`default` is not one: a limit either sets a mode or not).
    pub fn parse(name: &str) -> Option<Charge> {
        [Charge::DescriptorHits, Charge::Always, Charge::Never]
            .into_iter()
            .find(|charge| charge.name() == name)
    }

    /// This mode, or `default` when it is [`Charge::Default`].
    pub fn or(self, default: Charge) -> Charge {
        match self {
            Charge::Default => default,
            set => set,
        }
    }
}

/// Parses `--default-charge`: one of the YAML `charge:` modes.
pub fn parse_charge(text: &str) -> Result<Charge, String> {
    Charge::parse(text)
        .ok_or_else(|| format!("invalid charge '{text}' (valid: descriptor_hits, always, never)"))
}

impl Limit {
    /// A plain fixed-window limit, as envoyproxy/ratelimit would build it.
    pub fn fixed(requests_per_unit: u32, unit: Unit) -> Limit {
        Limit {
            name: None,
            requests_per_unit,
            period: Period::of(unit),
            algorithm: Algorithm::FixedWindow,
            burst: None,
            shadow: false,
            quota_mode: false,
            replaces: Vec::new(),
            variant: 0,
            charge: Charge::default(),
        }
    }

    /// The effective burst B.
    pub fn effective_burst(&self) -> u32 {
        self.burst.map_or_else(
            || self.algorithm.default_burst(self.requests_per_unit),
            NonZeroU32::get,
        )
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} per {} ({})",
            self.requests_per_unit, self.period, self.algorithm
        )?;
        if self.algorithm.takes_burst() {
            write!(f, " burst {}", self.effective_burst())?;
        }
        if let Some(name) = &self.name {
            write!(f, " name {name:?}")?;
        }
        if self.shadow {
            f.write_str(" [shadow]")?;
        }
        if self.quota_mode {
            f.write_str(" [quota]")?;
        }
        if !self.replaces.is_empty() {
            write!(f, " replaces {:?}", self.replaces)?;
        }
        Ok(())
    }
}
