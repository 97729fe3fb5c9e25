//! The validated configuration: what a request is matched against. Built only by the loader.

use std::collections::HashMap;

use crate::limit::Limit;

/// The maps requests are matched through: foldhash, several times cheaper than SipHash on
/// these short keys. Requests only look up, never insert, so flooding cannot degrade them.
pub type Map<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// Every domain rlsd knows, by name. Immutable once loaded; a reload builds a new one.
#[derive(Debug, Default)]
pub struct Config {
    /// Domains by name.
    pub domains: Map<Domain>,
}

/// One domain (one `domain:` file, or several merged): the descriptor tree requests of that
/// domain are matched against.
#[derive(Debug)]
pub struct Domain {
    /// The domain name (non-empty).
    pub name: String,
    /// The file it came from (files, comma-separated, when `--merge-domain-config` merged
    /// several), for `rlsd check` and diagnostics.
    pub source: String,
    /// Top-level descriptors.
    pub root: Level,
    /// `plans:`: the plan of each API key, for requests where Envoy cannot supply it.
    pub plans: Option<PlanTable>,
    /// Some descriptor has `share_threshold: true`, so keys depend on the nodes walked through.
    pub shares_thresholds: bool,
    /// Some descriptor has `value_to_metric: true`, so metric paths depend on the request.
    pub values_in_metrics: bool,
    /// `quota_buckets:`: the limits of Rate Limit Quota Service buckets (see `docs/rlqs.md`).
    pub quota: crate::rlqs::QuotaRules,
}

/// Maps an API key to its plan, so a descriptor `[api_key=K]` is matched as
/// `[plan=<plan of K>, api_key=K]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanTable {
    /// The entry whose value selects the plan (`api_key`).
    pub from: String,
    /// The entry the plan is placed in, before `from` (`plan`).
    pub entry: String,
    /// The plan of keys not in `keys`.
    pub default: String,
    /// Plan by key value.
    pub keys: Map<String>,
}

impl PlanTable {
    /// The plan of `key`.
    pub fn plan_of(&self, key: &str) -> &str {
        self.keys
            .get(key)
            .map_or(self.default.as_str(), String::as_str)
    }
}

/// The descriptors at one depth of the tree, indexed for matching.
#[derive(Debug, Default)]
pub struct Level {
    /// Children keyed by descriptor `key`.
    pub keys: Map<KeyNodes>,
}

/// The descriptors that share one `key` at one level, in matching priority.
#[derive(Debug, Default)]
pub struct KeyNodes {
    /// `value:` given exactly.
    pub exact: Map<Node>,
    /// `value:` containing `*`, in config order.
    pub wildcards: Vec<(Wildcard, Node)>,
    /// No `value:`: matches any value.
    pub default: Option<Box<Node>>,
}

impl KeyNodes {
    /// Every node: exact values, then wildcards, then the default (matching priority).
    pub fn all(&self) -> impl Iterator<Item = &Node> {
        self.exact
            .values()
            .chain(self.wildcards.iter().map(|(_, node)| node))
            .chain(self.default.as_deref())
    }
}

/// A value pattern with `*` wildcards anywhere (`foo*`, `bar*b`, `foo*bar*baz`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wildcard {
    /// The pattern as written.
    pub pattern: String,
    /// The literal pieces between `*`s; first anchors the start, last the end.
    parts: Vec<String>,
}

impl Wildcard {
    /// Compiles a pattern; `None` if it has no `*` (then it is an exact value).
    pub fn new(pattern: &str) -> Option<Wildcard> {
        pattern.contains('*').then(|| Wildcard {
            pattern: pattern.to_owned(),
            parts: pattern.split('*').map(str::to_owned).collect(),
        })
    }

    /// Whether `value` matches the whole pattern.
    pub fn matches(&self, value: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(split) => split,
            None => return true,
        };
        let Some(mut tail) = value.strip_prefix(first.as_str()) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return tail.is_empty();
        };
        for part in middle {
            match tail.find(part.as_str()) {
                Some(at) => tail = &tail[at + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(last.as_str())
    }
}

/// One descriptor of the config tree.
#[derive(Debug, Default)]
pub struct Node {
    /// `domain.key_value.key2` path, for metrics, diagnostics and duplicate detection.
    pub path: String,
    /// What applies when a request's last entry lands here; `None` is a whitelist node.
    pub policy: Option<Policy>,
    /// `detailed_metric: true`: metrics carry the request's values.
    pub detailed_metric: bool,
    /// `value_to_metric: true`: this entry's value goes into the metric path even when the
    /// node matched it by wildcard or as the default.
    pub value_to_metric: bool,
    /// `share_threshold: true` on a wildcard: the pattern, which stands in for the value in
    /// keys and metrics, so every value it matches shares one counter.
    pub shared_value: Option<String>,
    /// The key namespace (`layer:`, inherited from the parent); `None` is the default layer.
    pub layer: Option<String>,
    /// `metadata:`, returned in the response's `dynamic_metadata` when this node's policy
    /// decides a descriptor.
    pub metadata: Option<prost_types::Struct>,
    /// Nested descriptors.
    pub children: Level,
}

/// What a node enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// `unlimited: true`: always OK, never touches the store.
    Unlimited {
        /// The limit's `name`, if any (a target of `replaces` like any other).
        name: Option<String>,
        /// Names of limits this one replaces when both match one request.
        replaces: Vec<String>,
    },
    /// One or more limits (`rate_limit`, or the `rate_limits` list); all must pass.
    Limits(Vec<Limit>),
}
