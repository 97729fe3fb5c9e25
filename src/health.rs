//! The server's health: whether it is draining, whether its store answered the last probe and,
//! when asked, whether a config with a domain is loaded, as `/healthcheck` and the gRPC health
//! service report it, and the prober that keeps it current.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tonic_health::server::HealthReporter;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::Store;

/// The gRPC health service names rlsd answers for, besides "" (the whole server).
const HEALTH_SERVICES: [&str; 2] = ["ratelimit", "envoy.service.ratelimit.v3.RateLimitService"];

/// How often the store's health is probed, and a config change reaches the gRPC health service.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// What the server reports about itself: draining, whether its store answers, and whether a
/// config with a domain is loaded.
pub struct Health {
    draining: AtomicBool,
    store_ok: AtomicBool,
    /// The live config, when health requires it to have a domain
    /// (`--healthy-with-at-least-one-config-loaded`).
    required_config: Option<Arc<ArcSwap<Config>>>,
    /// What the gRPC health service was last told, so it hears only changes; held while it
    /// is told, so a drain and a probe cannot publish out of order.
    published: tokio::sync::Mutex<bool>,
    reporter: HealthReporter,
    /// Services reported besides [`HEALTH_SERVICES`] (the quota service, when it is on).
    also: std::sync::Mutex<Vec<&'static str>>,
}

impl Health {
    /// Health reported to the gRPC health service behind `reporter`: serving, unless
    /// `required_config` is given and has no domain yet.
    pub async fn new(
        reporter: HealthReporter,
        required_config: Option<Arc<ArcSwap<Config>>>,
    ) -> Health {
        let health = Health {
            draining: AtomicBool::new(false),
            store_ok: AtomicBool::new(true),
            required_config,
            published: tokio::sync::Mutex::new(false),
            reporter,
            also: std::sync::Mutex::new(Vec::new()),
        };
        let serving = health.serving();
        *health.published.lock().await = serving;
        health.set_grpc_health(serving).await;
        health
    }

    /// Reports `service` too, from now on, with the rest.
    pub async fn report_also(&self, service: &'static str) {
        let published = self.published.lock().await;
        self.also
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(service);
        self.reporter
            .set_service_status(service, status_of(*published))
            .await;
    }

    /// Whether the server should receive traffic.
    pub fn serving(&self) -> bool {
        !self.draining() && self.store_ok() && self.config_ok()
    }

    /// Whether a shutdown is under way.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the store answered its last probe.
    pub fn store_ok(&self) -> bool {
        self.store_ok.load(Ordering::Relaxed)
    }

    /// Whether the config is as health requires: always, unless a domain is required and the
    /// config has none (none loaded yet, or an xDS push that dropped them all).
    pub fn config_ok(&self) -> bool {
        self.required_config
            .as_ref()
            .is_none_or(|config| !config.load().domains.is_empty())
    }

    /// Reports NOT_SERVING from now on: a shutdown has begun.
    pub async fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
        self.publish().await;
    }

    /// Tells the gRPC health service the current state, if it changed since it was last told.
    async fn publish(&self) {
        let mut published = self.published.lock().await;
        let serving = self.serving();
        if *published != serving {
            *published = serving;
            self.set_grpc_health(serving).await;
        }
    }

    /// Probes `store` every second, publishing its gauges into `metrics` and the whole state
    /// to the gRPC health service, until aborted.
    pub fn spawn_prober<S: Store>(
        self: &Arc<Self>,
        store: Arc<S>,
        metrics: Arc<Metrics>,
    ) -> tokio::task::JoinHandle<()> {
        let health = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(PROBE_INTERVAL);
            let mut config_ok = health.config_ok();
            loop {
                tick.tick().await;
                let ok = store.healthy().await;
                store.report(&metrics);
                if health.store_ok.swap(ok, Ordering::Relaxed) != ok {
                    tracing::warn!(store = store.name(), healthy = ok, "store health changed");
                }
                if health.config_ok() != config_ok {
                    config_ok = !config_ok;
                    tracing::warn!(
                        healthy = config_ok,
                        "health follows the config: a config with at least one domain is {}",
                        if config_ok {
                            "loaded"
                        } else {
                            "no longer loaded"
                        }
                    );
                }
                health.publish().await;
            }
        })
    }
}

impl Health {
    async fn set_grpc_health(&self, serving: bool) {
        let status = status_of(serving);
        self.reporter.set_service_status("", status).await;
        let also = self
            .also
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for service in HEALTH_SERVICES.into_iter().chain(also) {
            self.reporter.set_service_status(service, status).await;
        }
    }
}

fn status_of(serving: bool) -> tonic_health::ServingStatus {
    if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    }
}
