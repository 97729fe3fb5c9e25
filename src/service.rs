//! The tonic `RateLimitService`: the only module that sees Envoy's wire types.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use opentelemetry::trace::TraceContextExt as _;
use tonic::{Request, Response, Status};

use crate::algorithm::{Hits, Params, Verdict};
use crate::config::Config;
use crate::engine::key::push_decimal;
use crate::engine::{self, Decision, Descriptor, KeySettings, LimitOverride, Plan};
use crate::limit::{MICROS_PER_SECOND, Unit};
use crate::metrics::{DEFAULT_NEAR_LIMIT_RATIO, LimitResult, Metrics};
use crate::pb;
use crate::pb::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit as WireUnit,
};
use crate::store::{Check, Outcome, Store, StoreError};
use crate::telemetry::RequestTracer;

/// Which rate limit headers rlsd adds to responses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`, and `Retry-After`.
    #[default]
    XRatelimit,
    /// `RateLimit-Limit` (the bare limit), `RateLimit-Remaining`, `RateLimit-Reset`, as
    /// envoyproxy/ratelimit sends them, and `Retry-After`.
    Ratelimit,
    /// None: for when Envoy's own `enable_x_ratelimit_headers` is on, so headers never repeat.
    Off,
}

/// Header names that replace the style's own, each `None` for the style's
/// (envoyproxy/ratelimit's `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeaderNames {
    /// Replaces the limit header's name.
    pub limit: Option<http::HeaderName>,
    /// Replaces the remaining header's name.
    pub remaining: Option<http::HeaderName>,
    /// Replaces the reset header's name.
    pub reset: Option<http::HeaderName>,
}

impl HeaderStyle {
    fn names(self) -> Option<[&'static str; 3]> {
        match self {
            HeaderStyle::XRatelimit => Some([
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
            ]),
            HeaderStyle::Ratelimit => {
                Some(["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"])
            }
            HeaderStyle::Off => None,
        }
    }
}

/// What a request gets when the store cannot decide (Redis down or slow, memory full).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FailureMode {
    /// gRPC UNAVAILABLE, so Envoy's own `failure_mode_deny` decides.
    #[default]
    Error,
    /// OK: let traffic through.
    Allow,
    /// OVER_LIMIT for every limited descriptor.
    Deny,
}

impl FailureMode {
    /// The flag spelling, for logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            FailureMode::Error => "error",
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
        }
    }
}

/// What one decision may change in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Effect {
    /// Hits are taken and refunds given back, and counted in the limit metrics: a gRPC call.
    #[default]
    Apply,
    /// Every check is a peek ([`Hits::Peek`], refunds too): the answer one more hit would get
    /// now, with nothing written to the store and nothing counted in the limit metrics.
    DryRun,
}

/// How the service answers, apart from the config and the store.
#[derive(Clone, Debug, Default)]
pub struct ServiceSettings {
    /// Store key layout.
    pub keys: KeySettings,
    /// Response headers.
    pub headers: HeaderStyle,
    /// Names replacing the style's header names (lower case, as HTTP/2 sends them).
    pub header_names: HeaderNames,
    /// The answer when the store fails.
    pub failure_mode: FailureMode,
    /// Every limit in shadow mode (envoyproxy/ratelimit's `SHADOW_MODE`): evaluated, counted and
    /// reported as it stands (an over limit's status stays OVER_LIMIT), while the answer is
    /// always OK: a dry run of a whole config.
    pub shadow_mode: bool,
    /// Every limit in quota mode (envoyproxy/ratelimit's `QUOTA_MODE`): the quotas of a request
    /// deny it only when every one of them is over.
    pub quota_mode: bool,
    /// Send envoyproxy/ratelimit's `dynamic_metadata` (`RESPONSE_DYNAMIC_METADATA`): the domain,
    /// the request's descriptors, and the merged `metadata:` of those that passed.
    pub dynamic_metadata: bool,
    /// Bounds on a request's size; anything over is INVALID_ARGUMENT.
    pub limits: RequestLimits,
}

/// Bounds on what one request may carry, far above anything Envoy sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most descriptors in one request (`--max-descriptors`).
    pub max_descriptors: usize,
    /// Most entries in one descriptor (`--max-entries`).
    pub max_entries: usize,
    /// Longest entry key, in bytes (`--max-key-bytes`).
    pub max_key_bytes: usize,
    /// Longest entry value, in bytes (`--max-value-bytes`).
    pub max_value_bytes: usize,
    /// Largest `hits_addend`, of the request or of a descriptor (`--max-hits-addend`).
    pub max_hits_addend: u64,
    /// Largest encoded gRPC request, in bytes (`--max-message-bytes`); tonic enforces it.
    pub max_message_bytes: usize,
}

impl RequestLimits {
    /// Default `max_descriptors`.
    pub const DEFAULT_MAX_DESCRIPTORS: usize = 64;
    /// Default `max_entries`.
    pub const DEFAULT_MAX_ENTRIES: usize = 32;
    /// Default `max_key_bytes`.
    pub const DEFAULT_MAX_KEY_BYTES: usize = 256;
    /// Default `max_value_bytes`: a descriptor value is often a request header or the `:path`,
    /// and URLs of a few KiB are ordinary, so this admits what web servers accept (8 KiB request
    /// lines) twice over.
    pub const DEFAULT_MAX_VALUE_BYTES: usize = 16 * 1024;
    /// Default `max_hits_addend`.
    pub const DEFAULT_MAX_HITS_ADDEND: u64 = 1_000_000_000;
    /// Default `max_message_bytes` (64 KiB).
    pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 * 1024;
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_descriptors: Self::DEFAULT_MAX_DESCRIPTORS,
            max_entries: Self::DEFAULT_MAX_ENTRIES,
            max_key_bytes: Self::DEFAULT_MAX_KEY_BYTES,
            max_value_bytes: Self::DEFAULT_MAX_VALUE_BYTES,
            max_hits_addend: Self::DEFAULT_MAX_HITS_ADDEND,
            max_message_bytes: Self::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// The rate limit service over a store `S`.
pub struct RateLimiter<S> {
    config: Arc<ArcSwap<Config>>,
    store: Arc<S>,
    settings: ServiceSettings,
    metrics: Arc<Metrics>,
    /// `store_duration` for this store, looked up once instead of per request.
    store_duration: Arc<crate::metrics::Histogram>,
    /// Whether the last store call failed, so failures and recoveries are logged once.
    store_failing: AtomicBool,
    /// Traces each call when tracing is on.
    tracer: Option<RequestTracer>,
}

impl<S: Store> RateLimiter<S> {
    /// A service answering from the current value of `config`.
    pub fn new(config: Arc<ArcSwap<Config>>, store: Arc<S>, settings: ServiceSettings) -> Self {
        let metrics = Arc::new(Metrics::new(DEFAULT_NEAR_LIMIT_RATIO));
        RateLimiter {
            store_duration: store_duration(&metrics, store.as_ref()),
            config,
            store,
            settings,
            metrics,
            store_failing: AtomicBool::new(false),
            tracer: None,
        }
    }

    /// Traces every `ShouldRateLimit` call with `tracer`.
    pub fn with_tracing(mut self, tracer: RequestTracer) -> Self {
        self.tracer = Some(tracer);
        self
    }

    /// Counts into `metrics` instead of a private registry.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.store_duration = store_duration(&metrics, self.store.as_ref());
        self.metrics = metrics;
        self
    }

    /// The store this service decides with.
    pub fn store(&self) -> Arc<S> {
        Arc::clone(&self.store)
    }

    /// The metrics this service counts into.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// The request bounds this service enforces.
    pub fn limits(&self) -> RequestLimits {
        self.settings.limits
    }

    /// Answers one request: validate, match, decide, assemble.
    pub async fn decide(
        &self,
        request: pb::RateLimitRequest,
    ) -> Result<pb::RateLimitResponse, Status> {
        self.decide_in(request, None, Effect::Apply, None).await
    }

    /// [`RateLimiter::decide`] with `effect` and the store given until `deadline` (`None`: the
    /// store's own timeout), tracing the store call as a child of `trace` when given.
    async fn decide_in(
        &self,
        request: pb::RateLimitRequest,
        trace: Option<&opentelemetry::Context>,
        effect: Effect,
        deadline: Option<Instant>,
    ) -> Result<pb::RateLimitResponse, Status> {
        let request = validate(request, &self.settings.limits)
            .inspect_err(|_| self.metrics.invalid_requests.inc())?;
        if effect == Effect::Apply {
            self.count_skipped(&request);
        }
        // One snapshot for the whole request, however the config changes meanwhile.
        let config = self.config.load();
        let mut plan = engine::plan(&config, &request, &self.settings.keys);
        enforce(&mut plan, &self.settings);
        if effect == Effect::DryRun {
            for check in &mut plan.checks {
                check.hits = Hits::Peek;
            }
        }
        if plan.checks.is_empty() {
            return Ok(assemble(&request, &plan, &[], &self.settings));
        }
        let store_trace = trace.zip(self.tracer.as_ref()).map(|(parent, tracer)| {
            tracer.store_span(parent, self.store.name(), plan.checks.len())
        });
        let decided = self.decide_on_store(&plan.checks, deadline).await;
        if let Some(store_trace) = store_trace {
            let span = store_trace.span();
            if let Err(error) = &decided {
                span.set_status(opentelemetry::trace::Status::error(error.to_string()));
            }
            span.end();
        }
        match decided {
            Ok(outcomes) => {
                if self.store_failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("store answering again");
                }
                // A dry run is not traffic: it counts no hits and creates no series.
                if effect == Effect::Apply {
                    self.record(&request, &plan, &outcomes);
                }
                Ok(assemble(&request, &plan, &outcomes, &self.settings))
            }
            Err(error) => self.failure_answer(&plan, &error),
        }
    }

    /// The store's decision on `checks` by `deadline` (`None`: the store's own timeout), timed
    /// in `store_duration`, a failure counted in `store_errors`: every caller of the store.
    async fn decide_on_store(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let started = Instant::now();
        let decided = self.store.decide_by(checks, deadline).await;
        self.store_duration.observe(started.elapsed().as_secs_f64());
        if let Err(error) = &decided {
            self.metrics
                .store_errors
                .with_label_values(&[error.kind()])
                .inc();
        }
        decided
    }

    /// Counts the descriptors no configured limit can match for their shape (an entry with an
    /// empty key, or no entries): answered OK without a limit, as envoyproxy/ratelimit does,
    /// rather than refusing the whole call. An override still applies to them, as there.
    fn count_skipped(&self, request: &engine::Request) {
        for descriptor in &request.descriptors {
            let reason = if descriptor.limit_override.is_some() {
                continue;
            } else if descriptor.entries.is_empty() {
                "no_entries"
            } else if descriptor.entries.iter().any(|(key, _)| key.is_empty()) {
                "empty_key"
            } else {
                continue;
            };
            self.metrics
                .descriptors_skipped
                .with_label_values(&[reason])
                .inc();
        }
    }

    /// Counts every check's decision under its limit's descriptor path.
    fn record(&self, request: &engine::Request, plan: &Plan<'_>, outcomes: &[Outcome]) {
        for ((check, planned), outcome) in plan.checks.iter().zip(&plan.limits).zip(outcomes) {
            let path: Cow<'_, str> = match &planned.path {
                Some(path) => Cow::Borrowed(path),
                None => format!("{}.limit_override", request.domain).into(),
            };
            let hits = match check.hits {
                Hits::Take(n) | Hits::Charge(n) => n,
                Hits::Peek | Hits::Refund(_) => 0,
            };
            self.metrics.record_limit(
                &request.domain,
                &path,
                LimitResult {
                    hits,
                    allowed: outcome.verdict.allowed,
                    // Not `check.shadow`, which also marks quota checks that cannot deny.
                    shadow: planned.limit.shadow || self.settings.shadow_mode,
                    // `remaining` counts against the burst for token bucket and GCRA.
                    limit: check.params.capacity(),
                    remaining: outcome.verdict.remaining,
                },
            );
        }
    }

    /// The configured answer when the store fails; logged when the store starts failing.
    fn failure_answer(
        &self,
        plan: &Plan<'_>,
        error: &StoreError,
    ) -> Result<pb::RateLimitResponse, Status> {
        self.metrics
            .failure_mode_answers
            .with_label_values(&[self.settings.failure_mode.name()])
            .inc();
        if !self.store_failing.swap(true, Ordering::Relaxed) {
            tracing::warn!(%error, kind = error.kind(), mode = ?self.settings.failure_mode, "store failing; answering by failure mode");
        }
        let over = match self.settings.failure_mode {
            FailureMode::Error => return Err(Status::unavailable(error.to_string())),
            FailureMode::Allow => false,
            FailureMode::Deny => true,
        };
        let statuses = plan
            .decisions
            .iter()
            .map(|decision| match decision {
                Decision::Checks(range) if over => {
                    let limit = &plan.limits[range.start].limit;
                    DescriptorStatus {
                        code: Code::OverLimit.into(),
                        current_limit: Some(wire_limit(limit)),
                        limit_remaining: 0,
                        duration_until_reset: Some(duration(MICROS_PER_SECOND)),
                        quota: None,
                    }
                }
                other => uncounted_status(other),
            })
            .collect();
        Ok(pb::RateLimitResponse {
            // `--shadow-mode` denies nothing, whatever the statuses say.
            overall_code: if over && !self.settings.shadow_mode {
                Code::OverLimit
            } else {
                Code::Ok
            }
            .into(),
            statuses,
            ..Default::default()
        })
    }
}

fn store_duration(metrics: &Metrics, store: &impl Store) -> Arc<crate::metrics::Histogram> {
    metrics.store_duration.series(store.name().to_owned())
}

/// Something that answers `ShouldRateLimit`, without naming its store: what the admin `/json`
/// endpoint calls.
pub trait Decide: Send + Sync + 'static {
    /// Answers one request, changing the store only as `effect` allows.
    fn decide_request(
        &self,
        request: pb::RateLimitRequest,
        effect: Effect,
    ) -> Pin<Box<dyn Future<Output = Result<pb::RateLimitResponse, Status>> + Send + '_>>;
}

impl<S: Store> Decide for RateLimiter<S> {
    fn decide_request(
        &self,
        request: pb::RateLimitRequest,
        effect: Effect,
    ) -> Pin<Box<dyn Future<Output = Result<pb::RateLimitResponse, Status>> + Send + '_>> {
        // Timed like a gRPC call, so `/json` traffic shows in the request latency too.
        Box::pin(async move {
            let started = Instant::now();
            let answer = self.decide_in(request, None, effect, None).await;
            self.metrics.observe_request(started.elapsed());
            answer
        })
    }
}

/// A descriptor's counters after a charge: what the quota service reads a shared budget from.
#[derive(Clone, Debug, PartialEq)]
pub enum Charged {
    /// No limit applies to the descriptor (no node, a whitelist node, or every limit replaced).
    NoLimit,
    /// `unlimited: true`.
    Unlimited,
    /// Each enforced limit's numbers and its answer after the charge (shadow limits, which
    /// never deny, are charged but left out).
    Limits(Vec<(Params, Verdict)>),
}

/// Charges work already done to one descriptor's counters, through the same plan, keys and
/// store as `ShouldRateLimit`: the quota service's way into a budget it shares with RLS.
pub trait ChargeDescriptor: Send + Sync + 'static {
    /// Charges `hits` (recorded whatever the answer, past the limit if need be; 0 only reads;
    /// at most `--max-hits-addend`) to the descriptor `entries` of `domain`, and returns what
    /// its counters hold after.
    fn charge_descriptor<'a>(
        &'a self,
        domain: &'a str,
        entries: Vec<(String, String)>,
        hits: u64,
    ) -> Pin<Box<dyn Future<Output = Result<Charged, StoreError>> + Send + 'a>>;
}

impl<S: Store> ChargeDescriptor for RateLimiter<S> {
    fn charge_descriptor<'a>(
        &'a self,
        domain: &'a str,
        entries: Vec<(String, String)>,
        hits: u64,
    ) -> Pin<Box<dyn Future<Output = Result<Charged, StoreError>> + Send + 'a>> {
        // The bound `ShouldRateLimit` puts on a descriptor's hits, far above any report's.
        let hits = hits.min(self.settings.limits.max_hits_addend);
        Box::pin(async move {
            let request = engine::Request {
                domain: domain.to_owned(),
                descriptors: vec![Descriptor {
                    entries,
                    limit_override: None,
                    hits_addend: Some(hits),
                    refund: false,
                }],
                hits_addend: 1,
            };
            let config = self.config.load();
            let mut plan = engine::plan(&config, &request, &self.settings.keys);
            enforce(&mut plan, &self.settings);
            match plan.decisions.first() {
                Some(Decision::Unlimited) => return Ok(Charged::Unlimited),
                Some(Decision::Checks(_)) => {}
                Some(Decision::NoLimit) | None => return Ok(Charged::NoLimit),
            }
            // Whatever the limit's `charge:` says: these requests were admitted already.
            let taken = if hits == 0 {
                Hits::Peek
            } else {
                Hits::Charge(hits)
            };
            for check in &mut plan.checks {
                check.hits = taken;
            }
            let outcomes = self.decide_on_store(&plan.checks, None).await?;
            if hits > 0 {
                self.record(&request, &plan, &outcomes);
            }
            let limits: Vec<(Params, Verdict)> = plan
                .checks
                .iter()
                .zip(&outcomes)
                .filter(|(check, _)| !check.shadow)
                .map(|(check, outcome)| (check.params, outcome.verdict))
                .collect();
            Ok(if limits.is_empty() {
                Charged::Unlimited
            } else {
                Charged::Limits(limits)
            })
        })
    }
}

#[tonic::async_trait]
impl<S: Store> pb::RateLimitService for RateLimiter<S> {
    async fn should_rate_limit(
        &self,
        request: Request<pb::RateLimitRequest>,
    ) -> Result<Response<pb::RateLimitResponse>, Status> {
        let started = Instant::now();
        let deadline = store_deadline(started, request.metadata());
        let answer = match &self.tracer {
            None => {
                self.decide_in(request.into_inner(), None, Effect::Apply, deadline)
                    .await
            }
            Some(tracer) => {
                let trace = tracer.request_span(request.metadata(), &request.get_ref().domain);
                let answer = self
                    .decide_in(request.into_inner(), Some(&trace), Effect::Apply, deadline)
                    .await;
                end_request_span(&trace, &answer);
                answer
            }
        };
        self.metrics.observe_request(started.elapsed());
        answer.map(Response::new)
    }
}

/// When the store must have answered a call that started at `started`: the caller's
/// `grpc-timeout` less a margin to send the answer back (a tenth, at least 1 ms). `None` when the
/// caller sent none (or one that does not parse), so the store's own timeout applies.
fn store_deadline(started: Instant, metadata: &tonic::metadata::MetadataMap) -> Option<Instant> {
    let timeout = grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)?;
    let margin = (timeout / 10).max(Duration::from_millis(1));
    Some(started + timeout.saturating_sub(margin))
}

/// A `grpc-timeout` value: at most 8 digits and a unit (H, M, S, m, u, n), per the gRPC spec.
fn grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at_checked(value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Ends a call's span with its verdict, or the error it answered.
fn end_request_span(
    trace: &opentelemetry::Context,
    answer: &Result<pb::RateLimitResponse, Status>,
) {
    let span = trace.span();
    match answer {
        Ok(response) => {
            let code = Code::try_from(response.overall_code).unwrap_or(Code::Unknown);
            span.set_attribute(opentelemetry::KeyValue::new(
                "ratelimit.overall_code",
                code.as_str_name(),
            ));
        }
        Err(status) => {
            span.set_attribute(opentelemetry::KeyValue::new(
                "rpc.grpc.status_code",
                i64::from(i32::from(status.code())),
            ));
            span.set_status(opentelemetry::trace::Status::error(
                status.message().to_owned(),
            ));
        }
    }
    span.end();
}

/// Turns the wire request into the engine's, rejecting what Envoy would never send and what
/// exceeds `limits`.
fn validate(
    request: pb::RateLimitRequest,
    limits: &RequestLimits,
) -> Result<engine::Request, Status> {
    if request.domain.is_empty() {
        return Err(Status::invalid_argument(
            "rate limit domain must not be empty",
        ));
    }
    if request.descriptors.is_empty() {
        return Err(Status::invalid_argument(
            "rate limit descriptor list must not be empty",
        ));
    }
    if request.descriptors.len() > limits.max_descriptors {
        return Err(Status::invalid_argument(format!(
            "request has {} descriptors; at most {} are allowed (--max-descriptors)",
            request.descriptors.len(),
            limits.max_descriptors
        )));
    }
    if u64::from(request.hits_addend) > limits.max_hits_addend {
        return Err(Status::invalid_argument(format!(
            "request hits_addend is {}; at most {} is allowed (--max-hits-addend)",
            request.hits_addend, limits.max_hits_addend
        )));
    }
    let descriptors = request
        .descriptors
        .into_iter()
        .enumerate()
        .map(|(index, descriptor)| validate_descriptor(index, descriptor, limits))
        .collect::<Result<_, _>>()?;
    Ok(engine::Request {
        domain: request.domain,
        descriptors,
        hits_addend: request.hits_addend,
    })
}

fn validate_descriptor(
    index: usize,
    descriptor: pb::RateLimitDescriptor,
    limits: &RequestLimits,
) -> Result<Descriptor, Status> {
    if descriptor.entries.len() > limits.max_entries {
        return Err(Status::invalid_argument(format!(
            "descriptor {index} has {} entries; at most {} are allowed (--max-entries)",
            descriptor.entries.len(),
            limits.max_entries
        )));
    }
    if let Some(hits) = descriptor.hits_addend
        && hits > limits.max_hits_addend
    {
        return Err(Status::invalid_argument(format!(
            "descriptor {index} hits_addend is {hits}; at most {} is allowed (--max-hits-addend)",
            limits.max_hits_addend
        )));
    }
    let entries = descriptor
        .entries
        .into_iter()
        .enumerate()
        .map(|(position, entry)| {
            if entry.key.len() > limits.max_key_bytes {
                Err(Status::invalid_argument(format!(
                    "descriptor {index} entry {position} key is {} bytes; at most {} are allowed (--max-key-bytes)",
                    entry.key.len(),
                    limits.max_key_bytes
                )))
            } else if entry.value.len() > limits.max_value_bytes {
                Err(Status::invalid_argument(format!(
                    "descriptor {index} entry {position} value is {} bytes; at most {} are allowed (--max-value-bytes)",
                    entry.value.len(),
                    limits.max_value_bytes
                )))
            } else {
                Ok((entry.key, entry.value))
            }
        })
        .collect::<Result<_, _>>()?;
    let limit_override = descriptor
        .limit
        .map(|limit| {
            let unit = override_unit(limit.unit).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "descriptor {index} limit override has unit {}: expected SECOND, MINUTE, HOUR, DAY, MONTH or YEAR",
                    pb::RateLimitUnit::try_from(limit.unit).map_or("out of range", |unit| unit.as_str_name())
                ))
            })?;
            Ok::<_, Status>(LimitOverride {
                requests_per_unit: limit.requests_per_unit,
                unit,
            })
        })
        .transpose()?;
    Ok(Descriptor {
        entries,
        limit_override,
        hits_addend: descriptor.hits_addend,
        refund: descriptor.is_negative_hits,
    })
}

fn override_unit(unit: i32) -> Option<Unit> {
    match pb::RateLimitUnit::try_from(unit).ok()? {
        pb::RateLimitUnit::Unknown => None,
        pb::RateLimitUnit::Second => Some(Unit::Second),
        pb::RateLimitUnit::Minute => Some(Unit::Minute),
        pb::RateLimitUnit::Hour => Some(Unit::Hour),
        pb::RateLimitUnit::Day => Some(Unit::Day),
        pb::RateLimitUnit::Month => Some(Unit::Month),
        pb::RateLimitUnit::Year => Some(Unit::Year),
    }
}

fn wire_unit(unit: Unit) -> WireUnit {
    match unit {
        Unit::Second => WireUnit::Second,
        Unit::Minute => WireUnit::Minute,
        Unit::Hour => WireUnit::Hour,
        Unit::Day => WireUnit::Day,
        Unit::Week => WireUnit::Week,
        Unit::Month => WireUnit::Month,
        Unit::Year => WireUnit::Year,
    }
}

fn wire_limit(limit: &crate::limit::Limit) -> RateLimit {
    RateLimit {
        name: limit.name.clone().unwrap_or_default(),
        requests_per_unit: limit.requests_per_unit,
        unit: wire_unit(limit.period.unit).into(),
    }
}

/// The status of a descriptor no store check decided: OK, and for `unlimited` the most
/// remaining there is (as envoyproxy/ratelimit answers).
fn uncounted_status(decision: &Decision) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok.into(),
        limit_remaining: if *decision == Decision::Unlimited {
            u32::MAX
        } else {
            0
        },
        ..Default::default()
    }
}

/// What the headers need from the limit that reported a descriptor.
struct Reported<'c> {
    over: bool,
    remaining: u32,
    reset_us: u64,
    requests_per_unit: u32,
    window_seconds: u64,
    name: Option<&'c str>,
}

/// Sets what the store may deny on. `--shadow-mode` and `--quota-mode` apply to every check. A
/// request's quotas deny only when every one is over, so when one cannot be (a shadow quota
/// limit, or under `--quota-mode` a descriptor no limit applies to, which envoyproxy/ratelimit
/// counts as a quota with room), none of them denies and the store takes them as shadow checks.
fn enforce(plan: &mut Plan<'_>, settings: &ServiceSettings) {
    if settings.shadow_mode || settings.quota_mode {
        for check in &mut plan.checks {
            check.shadow |= settings.shadow_mode;
            check.quota_mode |= settings.quota_mode;
        }
    }
    let open_quota = quota_without_limit(plan, settings)
        || plan
            .checks
            .iter()
            .any(|check| check.quota_mode && check.shadow);
    if open_quota {
        for check in plan.checks.iter_mut().filter(|check| check.quota_mode) {
            check.shadow = true;
        }
    }
}

/// Whether, under `--quota-mode`, a descriptor no limit applies to is among the request's
/// quotas: one that always has room, as envoyproxy/ratelimit counts it.
fn quota_without_limit(plan: &Plan<'_>, settings: &ServiceSettings) -> bool {
    settings.quota_mode && plan.decisions.contains(&Decision::NoLimit)
}

/// How each check bears on the answer, as envoyproxy/ratelimit decides it: a limit over in the
/// config's shadow mode reports OK; any other over limit reports OVER_LIMIT, and denies the
/// request unless it is a quota while some quota has room, or `--shadow-mode` is on.
struct Judged<'p, 'c> {
    plan: &'p Plan<'c>,
    outcomes: &'p [Outcome],
    /// Every quota of the request is over.
    quotas_over: bool,
    /// `--shadow-mode`: nothing denies.
    shadow_mode: bool,
}

impl<'p, 'c> Judged<'p, 'c> {
    fn new(plan: &'p Plan<'c>, outcomes: &'p [Outcome], settings: &ServiceSettings) -> Self {
        let mut judged = Judged {
            plan,
            outcomes,
            quotas_over: false,
            shadow_mode: settings.shadow_mode,
        };
        // A quota in the config's shadow mode is never over, so it has room.
        let mut quotas = (0..outcomes.len())
            .filter(|&i| plan.checks[i].quota_mode)
            .peekable();
        judged.quotas_over = !quota_without_limit(plan, settings)
            && quotas.peek().is_some()
            && quotas.all(|i| judged.over(i));
        judged
    }

    /// Over its limit, and reported as such (a limit in shadow mode in the config reports OK, and
    /// so does a refund, which the store applies even to a key over its limit).
    fn over(&self, i: usize) -> bool {
        !self.outcomes[i].verdict.allowed
            && !self.plan.limits[i].limit.shadow
            && !matches!(self.plan.checks[i].hits, Hits::Refund(_))
    }

    /// Over its limit, and denying the request.
    fn denies(&self, i: usize) -> bool {
        self.over(i) && !self.shadow_mode && (!self.plan.checks[i].quota_mode || self.quotas_over)
    }
}

/// Builds the wire response from the plan and the store's outcomes.
fn assemble(
    request: &engine::Request,
    plan: &Plan<'_>,
    outcomes: &[Outcome],
    settings: &ServiceSettings,
) -> pb::RateLimitResponse {
    let judged = Judged::new(plan, outcomes, settings);
    let mut statuses = Vec::with_capacity(plan.decisions.len());
    let mut limited = Vec::with_capacity(plan.decisions.len());
    for decision in &plan.decisions {
        match decision {
            Decision::Checks(range) => {
                let (status, reported) = report(&judged, range.clone());
                statuses.push(status);
                limited.push(reported);
            }
            other => statuses.push(uncounted_status(other)),
        }
    }
    // Statuses no check decided are always OK.
    let over = limited.iter().any(|r| r.over);
    let dynamic_metadata = settings
        .dynamic_metadata
        .then(|| dynamic_metadata(request, plan, &statuses));
    pb::RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok }.into(),
        statuses,
        response_headers_to_add: rate_limit_headers(
            &limited,
            over,
            settings.headers,
            &settings.header_names,
        ),
        dynamic_metadata,
        ..Default::default()
    }
}

/// Reports the most restrictive of a descriptor's limits: a denying one, else an over one (the
/// longest wait first), else the one with the least remaining.
fn report<'c>(
    judged: &Judged<'_, 'c>,
    range: std::ops::Range<usize>,
) -> (DescriptorStatus, Reported<'c>) {
    let (plan, outcomes) = (judged.plan, judged.outcomes);
    let reported = |i: usize| reported_verdict(&outcomes[i].verdict, !judged.denies(i));
    let chosen = range
        .clone()
        .filter(|&i| judged.over(i))
        .max_by_key(|&i| (judged.denies(i), outcomes[i].verdict.reset_us))
        .or_else(|| range.clone().min_by_key(|&i| reported(i).remaining))
        .unwrap_or(range.start);
    let planned = &plan.limits[chosen].limit;
    // Only config limits have names; an override's limit (owned by the plan) has none.
    let name = match planned {
        Cow::Borrowed(limit) => limit.name.as_deref(),
        Cow::Owned(_) => None,
    };
    let wire = wire_limit(planned);
    let verdict = reported(chosen);
    let remaining = u32::try_from(verdict.remaining).unwrap_or(u32::MAX);
    let reported = Reported {
        over: judged.denies(chosen),
        remaining,
        reset_us: verdict.reset_us,
        requests_per_unit: wire.requests_per_unit,
        window_seconds: planned.period.seconds(),
        name,
    };
    let status = DescriptorStatus {
        code: if judged.over(chosen) {
            Code::OverLimit
        } else {
            Code::Ok
        }
        .into(),
        current_limit: Some(wire),
        limit_remaining: remaining,
        duration_until_reset: Some(duration(verdict.reset_us)),
        quota: None,
    };
    (status, reported)
}

/// An over limit that does not deny (shadow, a quota with others left, `--shadow-mode`) reports
/// remaining 0, like envoyproxy/ratelimit.
fn reported_verdict(verdict: &Verdict, not_denying: bool) -> Verdict {
    if verdict.allowed || !not_denying {
        *verdict
    } else {
        Verdict {
            remaining: 0,
            ..*verdict
        }
    }
}

/// envoyproxy/ratelimit's `dynamic_metadata`: `domain`; `descriptors`, one per request
/// descriptor (`entries` as `key=value`, `limit` for an override in protobuf text form,
/// `hitsAddend` when set); the request's `hitsAddend` when not 0; and `metadata`, the
/// `metadata:` of the descriptors whose status is OK, merged in request order (a key already
/// there stays; Structs under one key merge).
fn dynamic_metadata(
    request: &engine::Request,
    plan: &Plan<'_>,
    statuses: &[DescriptorStatus],
) -> prost_types::Struct {
    use prost_types::value::Kind;
    use prost_types::{ListValue, Struct, Value};
    let value = |kind: Kind| Value { kind: Some(kind) };
    let descriptors = request
        .descriptors
        .iter()
        .map(|descriptor| {
            let entries = descriptor
                .entries
                .iter()
                .map(|(key, entry)| value(Kind::StringValue(format!("{key}={entry}"))))
                .collect();
            let mut fields = std::collections::BTreeMap::new();
            fields.insert(
                "entries".to_owned(),
                value(Kind::ListValue(ListValue { values: entries })),
            );
            if let Some(limit) = descriptor.limit_override {
                fields.insert(
                    "limit".to_owned(),
                    value(Kind::StringValue(override_text(limit))),
                );
            }
            if let Some(hits) = descriptor.hits_addend {
                fields.insert(
                    "hitsAddend".to_owned(),
                    value(Kind::NumberValue(hits as f64)),
                );
            }
            value(Kind::StructValue(Struct { fields }))
        })
        .collect();
    let mut fields = std::collections::BTreeMap::new();
    fields.insert(
        "domain".to_owned(),
        value(Kind::StringValue(request.domain.clone())),
    );
    fields.insert(
        "descriptors".to_owned(),
        value(Kind::ListValue(ListValue {
            values: descriptors,
        })),
    );
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_owned(),
            value(Kind::NumberValue(f64::from(request.hits_addend))),
        );
    }
    let mut passed = Struct::default();
    for (index, metadata) in &plan.metadata {
        // Unlimited descriptors pass without a check, and add nothing, as in envoyproxy/ratelimit.
        let checked = matches!(plan.decisions.get(*index), Some(Decision::Checks(_)));
        let ok = statuses
            .get(*index)
            .is_some_and(|status| status.code == i32::from(Code::Ok));
        if checked && ok {
            merge_metadata(&mut passed, metadata);
        }
    }
    if !passed.fields.is_empty() {
        fields.insert("metadata".to_owned(), value(Kind::StructValue(passed)));
    }
    Struct { fields }
}

/// Adds `from`'s fields to `into`: a key already there keeps its value, except that two Structs
/// merge, recursively.
fn merge_metadata(into: &mut prost_types::Struct, from: &prost_types::Struct) {
    use prost_types::value::Kind;
    for (key, value) in &from.fields {
        match into.fields.get_mut(key) {
            None => {
                into.fields.insert(key.clone(), value.clone());
            }
            Some(prost_types::Value {
                kind: Some(Kind::StructValue(existing)),
            }) => {
                if let Some(Kind::StructValue(added)) = &value.kind {
                    merge_metadata(existing, added);
                }
            }
            Some(_) => {}
        }
    }
}

/// A limit override as Go's protobuf text form writes it (`requests_per_unit:10 unit:MINUTE`),
/// which is what envoyproxy/ratelimit puts in its metadata; fields at zero are left out.
fn override_text(limit: LimitOverride) -> String {
    let mut parts = Vec::with_capacity(2);
    if limit.requests_per_unit != 0 {
        parts.push(format!("requests_per_unit:{}", limit.requests_per_unit));
    }
    parts.push(format!("unit:{}", wire_unit(limit.unit).as_str_name()));
    parts.join(" ")
}

fn duration(us: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(us / MICROS_PER_SECOND).unwrap_or(i64::MAX),
        nanos: ((us % MICROS_PER_SECOND) * 1_000) as i32,
    }
}

fn whole_seconds_up(us: u64) -> u64 {
    us.div_ceil(MICROS_PER_SECOND)
}

/// `name`, or the style's `default` without one.
fn or_name<'a>(name: Option<&'a http::HeaderName>, default: &'a str) -> &'a str {
    name.map_or(default, http::HeaderName::as_str)
}

/// Rate limit headers from the status closest to its limit (Envoy's own rule); `Retry-After`
/// from the longest wait among denials.
fn rate_limit_headers(
    limited: &[Reported<'_>],
    over: bool,
    style: HeaderStyle,
    names: &HeaderNames,
) -> Vec<pb::HeaderValue> {
    let (Some([limit_name, remaining_name, reset_name]), Some(closest)) = (
        style.names().map(|[limit, remaining, reset]| {
            [
                or_name(names.limit.as_ref(), limit),
                or_name(names.remaining.as_ref(), remaining),
                or_name(names.reset.as_ref(), reset),
            ]
        }),
        limited
            .iter()
            .min_by_key(|r| (r.remaining, std::cmp::Reverse(r.reset_us))),
    ) else {
        return Vec::new();
    };
    let header = |key: &str, value: String| pb::HeaderValue {
        key: key.to_owned(),
        value,
        raw_value: Vec::new(),
    };
    // Envoy's DRAFT_VERSION_03 form: the closest limit, then one policy per limit. Written into
    // one buffer without `fmt`: this runs on every limited request. envoyproxy/ratelimit's
    // `RateLimit-Limit` is the bare number, and clients of it parse it as one.
    let policies = if style == HeaderStyle::Ratelimit {
        &[][..]
    } else {
        limited
    };
    let mut policy = String::with_capacity(16 + 24 * policies.len());
    push_decimal(&mut policy, u64::from(closest.requests_per_unit));
    for r in policies {
        policy.push_str(", ");
        push_decimal(&mut policy, u64::from(r.requests_per_unit));
        policy.push_str(";w=");
        push_decimal(&mut policy, r.window_seconds);
        if let Some(name) = r.name.filter(|name| !name.is_empty()) {
            policy.push_str(";name=\"");
            policy.push_str(name);
            policy.push('"');
        }
    }
    let decimal = |n: u64| {
        let mut text = String::with_capacity(20);
        push_decimal(&mut text, n);
        text
    };
    let mut headers = Vec::with_capacity(4);
    headers.push(header(limit_name, policy));
    headers.push(header(
        remaining_name,
        decimal(u64::from(closest.remaining)),
    ));
    headers.push(header(
        reset_name,
        decimal(whole_seconds_up(closest.reset_us)),
    ));
    if over {
        let wait = limited
            .iter()
            .filter(|r| r.over)
            .map(|r| r.reset_us)
            .max()
            .unwrap_or(0);
        headers.push(header(
            "retry-after",
            decimal(whole_seconds_up(wait).max(1)),
        ));
    }
    headers
}

#[cfg(test)]
mod deadline_tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        assert_eq!(grpc_timeout("20m"), Some(Duration::from_millis(20)));
        assert_eq!(grpc_timeout("1S"), Some(Duration::from_secs(1)));
        assert_eq!(grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(
            grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "m", "20", "123456789m", "-1m", "1.5S", "20x", "２m"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_store_gets_the_callers_budget_less_a_margin_to_answer() {
        let started = Instant::now();
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert_eq!(store_deadline(started, &metadata), None);
        metadata.insert("grpc-timeout", "20m".parse().expect("ascii"));
        assert_eq!(
            store_deadline(started, &metadata),
            Some(started + Duration::from_millis(18))
        );
        metadata.insert("grpc-timeout", "5m".parse().expect("ascii"));
        assert_eq!(
            store_deadline(started, &metadata),
            Some(started + Duration::from_millis(4))
        );
    }
}
