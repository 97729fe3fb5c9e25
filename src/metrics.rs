//! Prometheus metrics, under the names envoyproxy/ratelimit's users already chart
//! (`ratelimit_service_rate_limit_*`), plus rlsd's own (`rlsd_*`).

mod sharded;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

pub use sharded::{Histogram, HistogramFamily};
use sharded::{LimitTable, NEAR_LIMIT, OVER_LIMIT, SHADOW_MODE, TOTAL_HITS, WITHIN_LIMIT};

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
    /// The per-limit counters (`total_hits`, `over_limit`, ...) by domain, then path, sharded
    /// by thread: label lookups (and allocations) stay off the request path once a limit has
    /// been seen, and so do cache lines the other core writes.
    limits: LimitTable,
    /// `ShouldRateLimit` latency, as the server measures it, in `latency_unit`.
    pub request_duration: Arc<Histogram>,
    latency_unit: LatencyUnit,
    /// Store call latency by store.
    pub store_duration: HistogramFamily,
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
        let r = &registry;
        register(r, crate::server::shed::SHED_TOTAL.clone());
        let request_durations = HistogramFamily::new(
            latency_name,
            "ShouldRateLimit latency inside rlsd",
            None,
            LATENCY_BUCKETS.iter().map(|bound| bound * scale).collect(),
        );
        register(r, request_durations.collector());
        let store_duration = HistogramFamily::new(
            "rlsd_store_call_duration_seconds",
            "Store call latency",
            Some("store"),
            LATENCY_BUCKETS.to_vec(),
        );
        register(r, store_duration.collector());
        let (limits, limit_collector) = LimitTable::new();
        register(r, limit_collector);
        Metrics {
            near_limit_ratio,
            limits,
            request_duration: request_durations.series(String::new()),
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

    /// Counts one limit's decision, as envoyproxy/ratelimit does: every hit in `total_hits`, and
    /// each in `over_limit`, or `within_limit` (and `near_limit` for the hits above the ratio);
    /// shadow limits that would deny count in `shadow_mode` and `over_limit`.
    pub fn record_limit(&self, domain: &str, path: &str, result: LimitResult) {
        self.limits.with(domain, path, |counters| {
            counters.add(TOTAL_HITS, result.hits);
            if result.allowed {
                counters.add(WITHIN_LIMIT, result.hits);
                counters.add(NEAR_LIMIT, near_limit_hits(&result, self.near_limit_ratio));
            } else {
                counters.add(OVER_LIMIT, result.hits);
                if result.shadow {
                    counters.add(SHADOW_MODE, result.hits);
                }
            }
        });
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

    #[test]
    fn counts_from_many_threads_add_up_in_one_series_as_prometheus_renders_it() {
        let metrics = Metrics::new(DEFAULT_NEAR_LIMIT_RATIO);
        let allowed = LimitResult {
            hits: 2,
            allowed: true,
            shadow: false,
            limit: 1_000_000,
            remaining: 500_000,
        };
        let denied = LimitResult {
            allowed: false,
            shadow: true,
            ..allowed
        };
        std::thread::scope(|scope| {
            // More threads than shards, so some share one.
            for _ in 0..12 {
                scope.spawn(|| {
                    for _ in 0..100 {
                        metrics.record_limit("web", "web.path_/a", allowed);
                        metrics.record_limit("web", "web.path_/b", denied);
                        metrics.observe_request(Duration::from_micros(300));
                    }
                });
            }
        });
        metrics
            .store_duration
            .series("memory".to_owned())
            .observe(0.002);
        let text = metrics.render();
        for line in [
            r#"ratelimit_service_rate_limit_total_hits{descriptor="web.path_/a",domain="web"} 2400"#,
            r#"ratelimit_service_rate_limit_within_limit{descriptor="web.path_/a",domain="web"} 2400"#,
            r#"ratelimit_service_rate_limit_near_limit{descriptor="web.path_/a",domain="web"} 0"#,
            r#"ratelimit_service_rate_limit_over_limit{descriptor="web.path_/a",domain="web"} 0"#,
            r#"ratelimit_service_rate_limit_over_limit{descriptor="web.path_/b",domain="web"} 2400"#,
            r#"ratelimit_service_rate_limit_shadow_mode{descriptor="web.path_/b",domain="web"} 2400"#,
            "# TYPE ratelimit_service_rate_limit_total_hits counter",
            "# TYPE ratelimit_service_should_rate_limit_duration_seconds histogram",
            r#"ratelimit_service_should_rate_limit_duration_seconds_bucket{le="0.00025"} 0"#,
            r#"ratelimit_service_should_rate_limit_duration_seconds_bucket{le="0.0005"} 1200"#,
            r#"ratelimit_service_should_rate_limit_duration_seconds_bucket{le="+Inf"} 1200"#,
            "ratelimit_service_should_rate_limit_duration_seconds_count 1200",
            r#"rlsd_store_call_duration_seconds_bucket{store="memory",le="0.001"} 0"#,
            r#"rlsd_store_call_duration_seconds_bucket{store="memory",le="0.002"} 1"#,
            r#"rlsd_store_call_duration_seconds_count{store="memory"} 1"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from:\n{text}"
            );
        }
        let sum = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("ratelimit_service_should_rate_limit_duration_seconds_sum ")
            })
            .and_then(|v| v.parse::<f64>().ok());
        assert!(sum.is_some_and(|sum| (sum - 0.36).abs() < 1e-9), "{sum:?}");
    }
}
