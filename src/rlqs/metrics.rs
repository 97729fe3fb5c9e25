//! The quota service's metrics, `rlsd_rlqs_*`, in the server's one registry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

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
    /// Assignments sent between reports, after peers' demands changed.
    pub pushes: IntCounter,
    /// Streams of this replica holding each (domain, bucket) series: the series go with the
    /// last, so clients cannot grow `/metrics` beyond the buckets held now.
    holders: Arc<Mutex<HashMap<(String, String), usize>>>,
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
            pushes: register(
                registry,
                IntCounter::new(
                    "rlsd_rlqs_pushes_total",
                    "RLQS assignments sent between reports after peers' demands changed",
                )
                .unwrap_or_else(|_| unreachable!("rlsd_rlqs_pushes_total is well-formed")),
            ),
            holders: Arc::default(),
        }
    }

    /// A stream starts holding the series of `bucket` in `domain` (call once per stream).
    pub fn hold(&self, domain: &str, bucket: &str) {
        let mut holders = self.holders.lock().unwrap_or_else(PoisonError::into_inner);
        *holders
            .entry((domain.to_owned(), bucket.to_owned()))
            .or_default() += 1;
    }

    /// A stream stops holding them; the last one removes every series of the bucket.
    pub fn release(&self, domain: &str, bucket: &str) {
        let mut holders = self.holders.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (domain.to_owned(), bucket.to_owned());
        let Some(count) = holders.get_mut(&key) else {
            return;
        };
        *count = count.saturating_sub(1);
        if *count > 0 {
            return;
        }
        holders.remove(&key);
        // Under the lock, so a stream taking the bucket up meanwhile writes after the removal.
        let labels = [domain, bucket];
        // A series never written is not there to remove: nothing to report.
        let _ = self.envoys.remove_label_values(&labels);
        let _ = self.demand.remove_label_values(&labels);
        let _ = self.assigned.remove_label_values(&labels);
        for verdict in ["allowed", "denied"] {
            let _ = self
                .requests
                .remove_label_values(&[domain, bucket, verdict]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket_series(registry: &Registry) -> usize {
        registry
            .gather()
            .iter()
            .filter(|family| family.name().starts_with("rlsd_rlqs_bucket_"))
            .map(|family| family.get_metric().len())
            .sum()
    }

    #[test]
    fn a_bucket_s_series_go_with_the_last_stream_holding_it() {
        let registry = Registry::new();
        let metrics = RlqsMetrics::new(&registry);
        let write = |bucket: &str| {
            metrics.envoys.with_label_values(&["web", bucket]).set(2);
            metrics
                .assigned
                .with_label_values(&["web", bucket])
                .set(1.0);
            metrics
                .requests
                .with_label_values(&["web", bucket, "allowed"])
                .inc();
        };
        metrics.hold("web", "a");
        metrics.hold("web", "a");
        metrics.hold("web", "b");
        write("a");
        write("b");
        assert_eq!(bucket_series(&registry), 6);
        metrics.release("web", "a");
        assert_eq!(bucket_series(&registry), 6, "one stream still holds a");
        metrics.release("web", "a");
        metrics.release("web", "a");
        assert_eq!(bucket_series(&registry), 3, "b's alone");
        metrics.release("web", "b");
        assert_eq!(bucket_series(&registry), 0);
    }
}
