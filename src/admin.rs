//! The admin HTTP port: `/healthcheck`, `/metrics`, `/rlconfig` and `/json`, as
//! envoyproxy/ratelimit serves them.

use std::fmt::Write;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::config::{Config, Level, Policy};
use crate::health::Health;
use crate::json;
use crate::metrics::Metrics;
use crate::pb::rate_limit_response::Code;
use crate::service::{Decide, Effect};

/// What the admin routes read.
#[derive(Clone)]
pub struct AdminState {
    /// The live config.
    pub config: Arc<ArcSwap<Config>>,
    /// Every metric.
    pub metrics: Arc<Metrics>,
    /// Draining and store health.
    pub health: Arc<Health>,
    /// The service, for `/json`.
    pub limiter: Arc<dyn Decide>,
    /// What `/json` may change: a dry run unless `--admin-json-writes`.
    pub json: Effect,
}

/// The admin routes.
pub fn router(state: AdminState) -> Router {
    if state.json == Effect::Apply {
        tracing::warn!(
            "/json on the admin port takes and gives back hits (--admin-json-writes): whoever \
             reaches that port can exhaust or refill any quota"
        );
    }
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .route("/json", post(json_request))
        .with_state(state)
}

/// What `--debug-addr` serves: the limits and the metrics, nothing that changes state.
pub fn debug_router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .with_state(state)
}

/// Only the metrics, at `path`: the port `--metrics-addr` opens.
pub fn metrics_router(path: &str, metrics: Arc<Metrics>) -> Router {
    Router::new().route(
        path,
        get(move || {
            let metrics = Arc::clone(&metrics);
            async move { render_metrics(&metrics) }
        }),
    )
}

async fn healthcheck(State(state): State<AdminState>) -> (StatusCode, &'static str) {
    if state.health.draining() {
        (StatusCode::INTERNAL_SERVER_ERROR, "draining")
    } else if !state.health.store_ok() {
        (StatusCode::INTERNAL_SERVER_ERROR, "store unreachable")
    } else if !state.health.config_ok() {
        (StatusCode::INTERNAL_SERVER_ERROR, "no config loaded")
    } else {
        (StatusCode::OK, "OK")
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    render_metrics(&state.metrics)
}

fn render_metrics(metrics: &Metrics) -> impl IntoResponse + use<> {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.render(),
    )
}

/// `POST /json`: a proto3-JSON `RateLimitRequest`; 200 OK, 429 over the limit, 400 malformed.
/// A dry run unless `--admin-json-writes`: an unauthenticated port must not change quotas.
async fn json_request(State(state): State<AdminState>, body: Bytes) -> Response {
    let request = match json::parse_request(&body) {
        Ok(request) => request,
        Err(reason) => return (StatusCode::BAD_REQUEST, reason).into_response(),
    };
    match state.limiter.decide_request(request, state.json).await {
        Ok(response) => {
            let status = if response.overall_code == i32::from(Code::OverLimit) {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            let body = json::render_response(&response).to_string();
            (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Err(error) if error.code() == tonic::Code::InvalidArgument => {
            (StatusCode::BAD_REQUEST, error.message().to_owned()).into_response()
        }
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, error.message().to_owned()).into_response(),
    }
}

/// The limits as [`describe`] prints them, after one `# <domain>: <source>` line per domain
/// pushed over xDS, so an operator sees which resource and version is serving.
async fn rlconfig(State(state): State<AdminState>) -> String {
    let config = state.config.load();
    let mut pushed: Vec<String> = config
        .domains
        .values()
        .filter(|domain| domain.source.starts_with("xds:"))
        .map(|domain| format!("# {}: {}\n", domain.name, domain.source))
        .collect();
    pushed.sort();
    pushed.concat() + &describe(&config)
}

/// One line per configured limit: `<path>: <limit>`, sorted, as `rlsd check` prints it.
pub fn describe(config: &Config) -> String {
    let mut lines = Vec::new();
    for domain in config.domains.values() {
        collect(&domain.root, &mut lines);
    }
    lines.sort();
    lines.iter().fold(String::new(), |mut out, line| {
        let _ = writeln!(out, "{line}");
        out
    })
}

fn collect(level: &Level, lines: &mut Vec<String>) {
    for nodes in level.keys.values() {
        for node in nodes.all() {
            match &node.policy {
                Some(Policy::Unlimited { .. }) => lines.push(format!("{}: unlimited", node.path)),
                Some(Policy::Limits(limits)) => {
                    for limit in limits {
                        lines.push(format!("{}: {limit}", node.path));
                    }
                }
                None => {}
            }
            collect(&node.children, lines);
        }
    }
}
