//! The server's health: whether it is draining and whether its store answered the last probe,
//! as `/healthcheck` and the gRPC health service report it, and the prober that keeps it current.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic_health::server::HealthReporter;

use crate::metrics::Metrics;
use crate::store::Store;

/// The gRPC health service names rlsd answers for, besides "" (the whole server).
const HEALTH_SERVICES: [&str; 2] = ["ratelimit", "envoy.service.ratelimit.v3.RateLimitService"];

/// How often the store's health is probed.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// What the server reports about itself: draining, and whether its store answers.
pub struct Health {
    draining: AtomicBool,
    store_ok: AtomicBool,
    reporter: HealthReporter,
}

impl Health {
    /// Serving, reported as such to the gRPC health service behind `reporter`.
    pub async fn new(reporter: HealthReporter) -> Health {
        set_grpc_health(&reporter, true).await;
        Health {
            draining: AtomicBool::new(false),
            store_ok: AtomicBool::new(true),
            reporter,
        }
    }

    /// Whether the server should receive traffic.
    pub fn serving(&self) -> bool {
        !self.draining() && self.store_ok()
    }

    /// Whether a shutdown is under way.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the store answered its last probe.
    pub fn store_ok(&self) -> bool {
        self.store_ok.load(Ordering::Relaxed)
    }

    /// Reports NOT_SERVING from now on: a shutdown has begun.
    pub async fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
        set_grpc_health(&self.reporter, false).await;
    }

    /// Probes `store` every second, publishing its gauges into `metrics`, until aborted.
    pub fn spawn_prober<S: Store>(
        self: &Arc<Self>,
        store: Arc<S>,
        metrics: Arc<Metrics>,
    ) -> tokio::task::JoinHandle<()> {
        let health = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(PROBE_INTERVAL);
            loop {
                tick.tick().await;
                let ok = store.healthy().await;
                store.report(&metrics);
                if health.store_ok.swap(ok, Ordering::Relaxed) != ok {
                    tracing::warn!(store = store.name(), healthy = ok, "store health changed");
                    if !health.draining() {
                        set_grpc_health(&health.reporter, ok).await;
                    }
                }
            }
        })
    }
}

async fn set_grpc_health(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter.set_service_status("", status).await;
    for service in HEALTH_SERVICES {
        reporter.set_service_status(service, status).await;
    }
}
