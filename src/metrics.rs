//! Prometheus metrics, under the names envoyproxy/ratelimit's users already chart
//! (`ratelimit_service_rate_limit_*`), plus rlsd's own (`rlsd_*`).

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

/// Latency buckets in seconds: sub-millisecond resolution where rlsd lives, up to Envoy's 20 ms
/// default timeout and past it.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.000_75, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
];

/// The unit of the request latency histogram.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LatencyUnit {
    /// `ratelimit_service_should_rate_limit_duration_seconds`, Prometheus's base unit.
    #[default]
    Seconds,
    /// `ratelimit_service_should_rate_limit_duration_milliseconds`, for dashboards kept in
    /// milliseconds (envoyproxy/ratelimit's `PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS`).
    Milliseconds,
}

impl LatencyUnit {
    /// Units in a second.
    fn per_second(self) -> f64 {
        match self {
            LatencyUnit::Seconds => 1.0,
            LatencyUnit::Milliseconds => 1_000.0,
        }
    }
}

/// Usage ratio above which allowed hits also count as `near_limit` (envoyproxy/ratelimit's 0.8).
pub const DEFAULT_NEAR_LIMIT_RATIO: f64 = 0.8;

/// The per-limit counters of one `domain` + descriptor path.
#[derive(Clone)]
pub struct LimitCounters {
    total_hits: IntCounter,
    over_limit: IntCounter,
    near_limit: IntCounter,
    within_limit: IntCounter,
    shadow_mode: IntCounter,
}

/// What one limit decided for one request, for [`Metrics::record_limit`].
#[derive(Clone, Copy, Debug)]
pub struct LimitResult {
    /// Hits the request asked for.
    pub hits: u64,
    /// Whether the limit allowed them.
    pub allowed: bool,
    /// Whether the limit is in shadow mode.
    pub shadow: bool,
    /// What `remaining` counts down from: L, or the burst B for token bucket and GCRA.
    pub limit: u64,
    /// What is left after the request.
    pub remaining: u64,
}

/// Every metric rlsd exports, registered in one registry.
pub struct Metrics {
    registry: Registry,
    near_limit_ratio: f64,
    total_hits: IntCounterVec,
    over_limit: IntCounterVec,
    near_limit: IntCounterVec,
    within_limit: IntCounterVec,
    shadow_mode: IntCounterVec,
    /// Cached handles by domain, then path: label lookups (and allocations) stay off the
    /// request path once a limit has been seen.
    limits: RwLock<LimitMap<LimitMap<Arc<LimitCounters>>>>,
    /// `ShouldRateLimit` latency, as the server measures it, in `latency_unit`.
    pub request_duration: Histogram,
    latency_unit: LatencyUnit,
    /// Store call latency by store.
    pub store_duration: HistogramVec,
    /// Store failures by kind (`unavailable`, `timeout`, `full`, ...).
    pub store_errors: IntCounterVec,
    /// Requests answered by the failure mode, by mode.
    pub failure_mode_answers: IntCounterVec,
    /// Requests rejected as malformed.
    pub invalid_requests: IntCounter,
    /// Descriptors answered OK without a limit for their shape (an empty key, no entries), by
    /// reason.
    pub descriptors_skipped: IntCounterVec,
    /// Config loads that succeeded.
    pub config_load_success: IntCounter,
    /// Config loads that failed (the previous config stays).
    pub config_load_error: IntCounter,
    /// Keys held by the in-process store.
    pub memory_live_keys: IntGauge,
    /// The in-process store's key cap.
    pub memory_capacity: IntGauge,
    /// Requests the in-process store refused because it was full.
    pub memory_full_rejections: IntGauge,
    /// Requests denied by the local over-limit cache without a store round trip.
    pub over_limit_cache_hits: IntCounter,
    /// Requests whose Redis calls are awaited after their callers stopped waiting.
    pub redis_late_requests: IntGauge,
    /// Requests whose Redis calls were let go past `--redis-max-late-requests` since start.
    pub redis_late_requests_let_go: IntGauge,
}

fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let vec = IntCounterVec::new(Opts::new(name, help), labels)
        .unwrap_or_else(|error| unreachable!("metric {name} is well-formed: {error}"));
    register(registry, vec)
}

fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    // Names are constants and registered once per registry, so this cannot collide.
    if let Err(error) = registry.register(Box::new(metric.clone())) {
        tracing::error!(%error, "metric registration failed");
    }
    metric
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let metric = IntCounter::new(name, help)
        .unwrap_or_else(|error| unreachable!("metric {name} is well-formed: {error}"));
    register(registry, metric)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let metric = IntGauge::new(name, help)
        .unwrap_or_else(|error| unreachable!("metric {name} is well-formed: {error}"));
    register(registry, metric)
}

impl Metrics {
    /// A fresh registry with every metric, counting `near_limit` above `near_limit_ratio`.
    pub fn new(near_limit_ratio: f64) -> Metrics {
        Metrics::with_latency_unit(near_limit_ratio, LatencyUnit::Seconds)
    }

    /// [`Metrics::new`], with the request latency histogram in `latency_unit`.
    pub fn with_latency_unit(near_limit_ratio: f64, latency_unit: LatencyUnit) -> Metrics {
        let registry = Registry::new();
        let latency_name = match latency_unit {
            LatencyUnit::Seconds => "ratelimit_service_should_rate_limit_duration_seconds",
            LatencyUnit::Milliseconds => {
                "ratelimit_service_should_rate_limit_duration_milliseconds"
            }
        };
        let scale = latency_unit.per_second();
        let per_limit = ["domain", "descriptor"];
        let r = &registry;
        register(r, crate::server::shed::SHED_TOTAL.clone());
        let request_duration = register(
            r,
            Histogram::with_opts(
                HistogramOpts::new(latency_name, "ShouldRateLimit latency inside rlsd")
                    .buckets(LATENCY_BUCKETS.iter().map(|bound| bound * scale).collect()),
            )
            .unwrap_or_else(|error| unreachable!("histogram is well-formed: {error}")),
        );
        let store_duration = register(
            r,
            HistogramVec::new(
                HistogramOpts::new("rlsd_store_call_duration_seconds", "Store call latency")
                    .buckets(LATENCY_BUCKETS.to_vec()),
                &["store"],
            )
            .unwrap_or_else(|error| unreachable!("histogram is well-formed: {error}")),
        );
        Metrics {
            near_limit_ratio,
            total_hits: counter_vec(
                r,
                "ratelimit_service_rate_limit_total_hits",
                "Hits checked against a limit",
                &per_limit,
            ),
            over_limit: counter_vec(
                r,
                "ratelimit_service_rate_limit_over_limit",
                "Hits denied by a limit",
                &per_limit,
            ),
            near_limit: counter_vec(
                r,
                "ratelimit_service_rate_limit_near_limit",
                "Allowed hits above the near-limit ratio",
                &per_limit,
            ),
            within_limit: counter_vec(
                r,
                "ratelimit_service_rate_limit_within_limit",
                "Hits allowed by a limit",
                &per_limit,
            ),
            shadow_mode: counter_vec(
                r,
                "ratelimit_service_rate_limit_shadow_mode",
                "Hits a shadow-mode limit would have denied",
                &per_limit,
            ),
            limits: RwLock::default(),
            request_duration,
            latency_unit,
            store_duration,
            store_errors: counter_vec(
                r,
                "rlsd_store_errors_total",
                "Store calls that failed, by kind",
                &["kind"],
            ),
            failure_mode_answers: counter_vec(
                r,
                "rlsd_failure_mode_answers_total",
                "Requests answered by the failure mode, by mode",
                &["mode"],
            ),
            invalid_requests: counter(
                r,
                "rlsd_invalid_requests_total",
                "Requests rejected as INVALID_ARGUMENT",
            ),
            descriptors_skipped: counter_vec(
                r,
                "rlsd_descriptors_skipped_total",
                "Descriptors answered OK without a limit for their shape, by reason (empty_key, no_entries)",
                &["reason"],
            ),
            config_load_success: counter(
                r,
                "ratelimit_service_config_load_success",
                "Config loads that succeeded",
            ),
            config_load_error: counter(
                r,
                "ratelimit_service_config_load_error",
                "Config loads that failed; the previous config stays",
            ),
            memory_live_keys: gauge(
                r,
                "rlsd_memory_store_live_keys",
                "Keys held by the in-process store",
            ),
            memory_capacity: gauge(
                r,
                "rlsd_memory_store_capacity",
                "The in-process store's cap on live keys",
            ),
            memory_full_rejections: gauge(
                r,
                "rlsd_memory_store_full_rejections",
                "Requests refused because the in-process store was full",
            ),
            over_limit_cache_hits: counter(
                r,
                "rlsd_over_limit_cache_hits_total",
                "Requests denied from the local over-limit cache, without a store round trip",
            ),
            redis_late_requests: gauge(
                r,
                "rlsd_redis_late_requests",
                "Requests whose Redis calls are awaited after their callers stopped waiting",
            ),
            redis_late_requests_let_go: gauge(
                r,
                "rlsd_redis_late_requests_let_go",
                "Requests whose Redis calls were let go past --redis-max-late-requests (what they committed stays counted)",
            ),
            registry,
        }
    }

    /// The counters of one limit, created on first use.
    pub fn limit(&self, domain: &str, path: &str) -> Arc<LimitCounters> {
        let cached = self
            .limits
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(domain)
            .and_then(|paths| paths.get(path))
            .cloned();
        if let Some(counters) = cached {
            return counters;
        }
        let labels = [domain, path];
        // One Arc for the five handles: a request clones one pointer per limit, not five.
        let counters = Arc::new(LimitCounters {
            total_hits: self.total_hits.with_label_values(&labels),
            over_limit: self.over_limit.with_label_values(&labels),
            near_limit: self.near_limit.with_label_values(&labels),
            within_limit: self.within_limit.with_label_values(&labels),
            shadow_mode: self.shadow_mode.with_label_values(&labels),
        });
        self.limits
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(domain.to_owned())
            .or_default()
            .insert(path.to_owned(), Arc::clone(&counters));
        counters
    }

    /// Counts one limit's decision, as envoyproxy/ratelimit does: every hit in `total_hits`, and
    /// each in `over_limit`, or `within_limit` (and `near_limit` for the hits above the ratio);
    /// shadow limits that would deny count in `shadow_mode` and `over_limit`.
    pub fn record_limit(&self, counters: &LimitCounters, result: LimitResult) {
        counters.total_hits.inc_by(result.hits);
        if result.allowed {
            counters.within_limit.inc_by(result.hits);
            counters
                .near_limit
                .inc_by(near_limit_hits(&result, self.near_limit_ratio));
        } else {
            counters.over_limit.inc_by(result.hits);
            if result.shadow {
                counters.shadow_mode.inc_by(result.hits);
            }
        }
    }

    /// Records a request's latency.
    pub fn observe_request(&self, took: Duration) {
        self.request_duration
            .observe(took.as_secs_f64() * self.latency_unit.per_second());
    }

    /// The registry, for metrics of other modules (the quota service's) to join.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(error) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(%error, "metrics encoding failed");
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// The allowed hits that took usage past `floor(ratio x L)`: all of them when usage was already
/// there, else only those past it. envoyproxy/ratelimit's rule, so dashboards read the same.
fn near_limit_hits(result: &LimitResult, ratio: f64) -> u64 {
    // In f32, as envoyproxy/ratelimit computes it (f64 gives floor(0.7 x 90) = 62, theirs 63).
    let threshold = (result.limit as f32 * ratio as f32).floor() as u64;
    let used_after = result.limit.saturating_sub(result.remaining);
    let used_before = used_after.saturating_sub(result.hits);
    if used_after <= threshold {
        0
    } else if used_before >= threshold {
        result.hits
    } else {
        used_after - threshold
    }
}

/// Handles by domain, hashed with foldhash (cheaper than SipHash on the request path). Only
/// configured domains get here; the paths inside keep SipHash, because `detailed_metric` paths
/// carry request values and so are inserted by clients.
type LimitMap<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// A shared handle.
pub type SharedMetrics = Arc<Metrics>;

#[cfg(test)]
mod tests {
    use super::*;

    fn near(limit: u64, used_before: u64, hits: u64) -> u64 {
        let result = LimitResult {
            hits,
            allowed: true,
            shadow: false,
            limit,
            remaining: limit - used_before - hits,
        };
        near_limit_hits(&result, DEFAULT_NEAR_LIMIT_RATIO)
    }

    #[test]
    fn near_limit_counts_the_hits_past_the_floor_of_the_ratio() {
        // L = 10: the threshold is 8, so single hits 9 and 10 are near the limit, 8 is not.
        let singles: Vec<u64> = (0..10).map(|before| near(10, before, 1)).collect();
        assert_eq!(singles, [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
        // From 6 to 10 in one request of 4: only the 2 hits past 8.
        assert_eq!(near(10, 6, 4), 2);
        // Already past the threshold: every hit.
        assert_eq!(near(10, 8, 2), 2);
        // L = 3: floor(2.4) = 2, so only the third hit.
        assert_eq!([near(3, 0, 1), near(3, 1, 1), near(3, 2, 1)], [0, 0, 1]);
    }
}
