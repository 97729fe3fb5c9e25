//! The admin HTTP port: `/healthcheck` and `/rlconfig`, as envoyproxy/ratelimit serves them.

use std::fmt::Write;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::State;
use axum::routing::get;

use crate::config::{Config, Level, Policy};

/// The admin routes over the live config.
pub fn router(config: Arc<ArcSwap<Config>>) -> Router {
    Router::new()
        .route("/healthcheck", get(|| async { "OK" }))
        .route("/rlconfig", get(rlconfig))
        .with_state(config)
}

async fn rlconfig(State(config): State<Arc<ArcSwap<Config>>>) -> String {
    describe(&config.load())
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
