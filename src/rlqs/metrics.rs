//! The quota service's metrics, `rlsd_rlqs_*`, in the server's one registry.

use prometheus::core::Collector;
use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Per domain and bucket: Envoys reporting, their demand, the rate assigned, what they report
/// admitted and denied; and the service's own counts.
#[derive(Clone)]
pub struct RlqsMetrics {
    /// Streams open now.
    pub streams: IntGauge,
    /// Reports received.
    pub reports: IntCounter,
    /// Envoys reporting a bucket (as the last report of it saw them).
    pub envoys: IntGaugeVec,
    /// Their demand in requests per second (allowed and denied; Envoys whose demand is not
    /// known yet count 0).
    pub demand: GaugeVec,
    /// The rate assigned to them in all, requests per second.
    pub assigned: GaugeVec,
    /// Requests Envoys report, by `verdict` (`allowed`, `denied`).
    pub requests: IntCounterVec,
    /// Input skipped without ending the stream, by `reason`.
    pub skipped: IntCounterVec,
    /// Streams ended with an error, by `reason`.
    pub stream_errors: IntCounterVec,
    /// Assignments answered by the failure mode because the store failed, by `mode`.
    pub failure_mode_answers: IntCounterVec,
    /// Buckets abandoned after being idle.
    pub abandoned: IntCounter,
}

fn register<M: Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    // Names are constants, registered once per registry.
    if let Err(error) = registry.register(Box::new(metric.clone())) {
        tracing::error!(%error, "metric registration failed");
    }
    metric
}

impl RlqsMetrics {
    /// Registers every quota metric in `registry`.
    pub fn new(registry: &Registry) -> RlqsMetrics {
        let bucket = ["domain", "bucket"];
        let well_formed = |name: &str| format!("metric {name} is well-formed");
        let int_gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                registry,
                IntGaugeVec::new(Opts::new(name, help), labels)
                    .unwrap_or_else(|_| unreachable!("{}", well_formed(name))),
            )
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                registry,
                GaugeVec::new(Opts::new(name, help), labels)
                    .unwrap_or_else(|_| unreachable!("{}", well_formed(name))),
            )
        };
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            register(
                registry,
                IntCounterVec::new(Opts::new(name, help), labels)
                    .unwrap_or_else(|_| unreachable!("{}", well_formed(name))),
            )
        };
        RlqsMetrics {
            streams: register(
                registry,
                IntGauge::new("rlsd_rlqs_streams", "RLQS streams open")
                    .unwrap_or_else(|_| unreachable!("rlsd_rlqs_streams is well-formed")),
            ),
            reports: register(
                registry,
                IntCounter::new("rlsd_rlqs_reports_total", "RLQS usage reports received")
                    .unwrap_or_else(|_| unreachable!("rlsd_rlqs_reports_total is well-formed")),
            ),
            envoys: int_gauge_vec(
                "rlsd_rlqs_bucket_envoys",
                "Envoys reporting a quota bucket",
                &bucket,
            ),
            demand: gauge_vec(
                "rlsd_rlqs_bucket_demand_rps",
                "Demand for a quota bucket, requests per second, allowed and denied",
                &bucket,
            ),
            assigned: gauge_vec(
                "rlsd_rlqs_bucket_assigned_rps",
                "Rate assigned to a quota bucket's Envoys in all, requests per second",
                &bucket,
            ),
            requests: counter_vec(
                "rlsd_rlqs_bucket_requests_total",
                "Requests Envoys report for a quota bucket, by verdict",
                &["domain", "bucket", "verdict"],
            ),
            skipped: counter_vec(
                "rlsd_rlqs_skipped_total",
                "RLQS input skipped without ending its stream, by reason",
                &["reason"],
            ),
            stream_errors: counter_vec(
                "rlsd_rlqs_stream_errors_total",
                "RLQS streams ended with an error, by reason",
                &["reason"],
            ),
            failure_mode_answers: counter_vec(
                "rlsd_rlqs_failure_mode_answers_total",
                "RLQS assignments answered by the failure mode, by mode",
                &["mode"],
            ),
            abandoned: register(
                registry,
                IntCounter::new("rlsd_rlqs_abandoned_total", "Idle quota buckets abandoned")
                    .unwrap_or_else(|_| unreachable!("rlsd_rlqs_abandoned_total is well-formed")),
            ),
        }
    }
}
