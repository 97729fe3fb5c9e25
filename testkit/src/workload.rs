//! The requests the gRPC-level benches send: 1, 3 (three layers) or 10 descriptors per request,
//! over a pool of distinct clients, against one config whose limits never fill.

use rlsd::pb::rate_limit_descriptor::Entry;
use rlsd::pb::{RateLimitDescriptor, RateLimitRequest};

/// The config domain.
pub const DOMAIN: &str = "bench";

/// How many descriptors a request carries, and which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `[d0=<client>]`.
    One,
    /// Edge IP, API-key plan and endpoint: `[remote_address=<ip>]`,
    /// `[plan=pro, api_key=<key>]`, `[endpoint=search, api_key=<key>]`.
    ThreeLayer,
    /// `[d0=<client>]` ... `[d9=<client>]`.
    Ten,
}

impl Shape {
    /// Every shape, in the order tables print them.
    pub const ALL: [Shape; 3] = [Shape::One, Shape::ThreeLayer, Shape::Ten];

    /// Descriptors per request.
    pub fn descriptors(self) -> usize {
        match self {
            Shape::One => 1,
            Shape::ThreeLayer => 3,
            Shape::Ten => 10,
        }
    }

    /// A short label for tables and file names.
    pub fn label(self) -> &'static str {
        match self {
            Shape::One => "1 descriptor",
            Shape::ThreeLayer => "3 layers",
            Shape::Ten => "10 descriptors",
        }
    }

    /// The request of client `client`.
    pub fn request(self, client: usize) -> RateLimitRequest {
        let id = format!("client-{client}");
        let descriptors = match self {
            Shape::One => vec![descriptor(&[("d0", &id)])],
            Shape::ThreeLayer => {
                let ip = format!(
                    "10.{}.{}.{}",
                    client >> 16 & 255,
                    client >> 8 & 255,
                    client & 255
                );
                vec![
                    descriptor(&[("remote_address", &ip)]),
                    descriptor(&[("plan", "pro"), ("api_key", &id)]),
                    descriptor(&[("endpoint", "search"), ("api_key", &id)]),
                ]
            }
            Shape::Ten => (0..10)
                .map(|d| descriptor(&[(format!("d{d}").as_str(), &id)]))
                .collect(),
        };
        RateLimitRequest {
            domain: DOMAIN.to_owned(),
            descriptors,
            hits_addend: 0,
        }
    }

    /// The requests of `clients` distinct clients.
    pub fn requests(self, clients: usize) -> Vec<RateLimitRequest> {
        (0..clients).map(|c| self.request(c)).collect()
    }

    /// The store checks rlsd plans for client `client`'s request under `config` (default key
    /// settings): the keys and limits the Redis store's script call carries.
    pub fn checks(self, config: &rlsd::config::Config, client: usize) -> Vec<rlsd::store::Check> {
        let wire = self.request(client);
        let request = rlsd::engine::Request {
            domain: wire.domain,
            descriptors: wire
                .descriptors
                .into_iter()
                .map(|d| rlsd::engine::Descriptor {
                    entries: d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                    ..Default::default()
                })
                .collect(),
            hits_addend: 0,
        };
        rlsd::engine::plan(config, &request, &rlsd::engine::KeySettings::default()).checks
    }
}

/// A descriptor from `(key, value)` pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        ..Default::default()
    }
}

/// The bench config with every limit on `algorithm`, high enough that nothing is denied.
pub fn config_yaml(algorithm: &str) -> String {
    // A burst as large as the limit: requests coalesced into one Redis call share one
    // instant, and GCRA's default burst would space them out.
    let burst = match algorithm {
        "gcra" | "token_bucket" => ", burst: 4000000000",
        _ => "",
    };
    let limit = |name: &str| {
        format!(
            "{{name: {name}, unit: second, requests_per_unit: 4000000000, algorithm: {algorithm}{burst}}}"
        )
    };
    let mut yaml = format!(
        "domain: {DOMAIN}\ndescriptors:\n  - key: remote_address\n    rate_limit: {}\n  \
         - key: plan\n    value: pro\n    descriptors:\n      - key: api_key\n        rate_limit: {}\n  \
         - key: endpoint\n    value: search\n    descriptors:\n      - key: api_key\n        rate_limit: {}\n",
        limit("edge"),
        limit("plan-pro"),
        limit("endpoint-search"),
    );
    for d in 0..10 {
        yaml.push_str(&format!(
            "  - key: d{d}\n    rate_limit: {}\n",
            limit(&format!("d{d}"))
        ));
    }
    yaml
}

/// The bench config, loaded.
pub fn config(algorithm: &str) -> rlsd::config::Config {
    let domain = rlsd::config::load_str("bench.yaml", &config_yaml(algorithm))
        .unwrap_or_else(|errors| panic!("bench config: {errors:?}"));
    let mut config = rlsd::config::Config::default();
    config.domains.insert(domain.name.clone(), domain);
    config
}
