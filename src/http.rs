//! The admin HTTP port: `/healthcheck`, `/metrics` and `/rlconfig`, as envoyproxy/ratelimit
//! serves them.

use std::fmt::Write;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::config::{Config, Level, Policy};
use crate::metrics::Metrics;
use crate::server::Health;

/// What the admin routes read.
#[derive(Clone)]
pub struct AdminState {
    /// The live config.
    pub config: Arc<ArcSwap<Config>>,
    /// Every metric.
    pub metrics: Arc<Metrics>,
    /// Draining and store health.
    pub health: Arc<Health>,
}

/// The admin routes.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .with_state(state)
}

async fn healthcheck(State(state): State<AdminState>) -> (StatusCode, &'static str) {
    if state.health.draining() {
        (StatusCode::INTERNAL_SERVER_ERROR, "draining")
    } else if !state.health.store_ok() {
        (StatusCode::INTERNAL_SERVER_ERROR, "store unreachable")
    } else {
        (StatusCode::OK, "OK")
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn rlconfig(State(state): State<AdminState>) -> String {
    describe(&state.config.load())
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
        let children = nodes
            .exact
            .values()
            .chain(nodes.wildcards.iter().map(|(_, node)| node))
            .chain(nodes.default.as_deref());
        for node in children {
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
