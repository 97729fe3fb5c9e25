//! From a request's descriptors to store checks: matching, `replaces`, hits and keys.
//!
//! Pure functions, no I/O: the service feeds in domain types and gets back a [`Plan`].

pub mod key;
pub mod matcher;

use std::borrow::Cow;
use std::ops::Range;

use crate::algorithm::{Hits, Params};
use crate::config::{Config, Domain, Node, Policy};
use crate::limit::{Charge, Limit, Unit};
use crate::store::Check;

/// A limit Envoy sent with a descriptor (`RateLimitOverride`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// One request descriptor, validated (an entry's key may be empty, and entries may be none: no
/// configured limit matches such a descriptor, but an override applies).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// `(key, value)` entries in order.
    pub entries: Vec<(String, String)>,
    /// Envoy's per-descriptor limit, which replaces the configured one.
    pub limit_override: Option<LimitOverride>,
    /// The descriptor's own `hits_addend`; `Some(0)` is a pure check.
    pub hits_addend: Option<u64>,
    /// `is_negative_hits`: the hits are given back.
    pub refund: bool,
}

/// One validated `ShouldRateLimit` request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The config domain (non-empty).
    pub domain: String,
    /// Descriptors (at least one).
    pub descriptors: Vec<Descriptor>,
    /// The request's `hits_addend`; 0 means 1.
    pub hits_addend: u32,
}

/// How checks are keyed and counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySettings {
    /// First key component, so several deployments can share one Redis.
    pub prefix: String,
    /// Which hits are charges for a limit that does not say (`--default-charge`).
    pub default_charge: Charge,
}

impl Default for KeySettings {
    fn default() -> Self {
        KeySettings {
            prefix: "rlsd".to_owned(),
            default_charge: Charge::DescriptorHits,
        }
    }
}

/// A limit that decides a descriptor, borrowed from the config or built from an override.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedLimit<'c> {
    /// The limit (reported as `current_limit`).
    pub limit: Cow<'c, Limit>,
    /// Descriptor path for metrics (`domain.key_value...`), or `None` for an override: the
    /// config's path, or built from the request's values for `detailed_metric` and
    /// `value_to_metric` descriptors.
    pub path: Option<Cow<'c, str>>,
    /// The node's layer; `None` is the default layer.
    pub layer: Option<&'c str>,
}

/// The key component of the default layer (descriptors without `layer:`).
pub const DEFAULT_LAYER: &str = "_";

/// What decides one request descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No limit applies (unknown domain or descriptor, whitelist node, all limits replaced).
    NoLimit,
    /// `unlimited: true`.
    Unlimited,
    /// These checks of [`Plan::checks`] decide it.
    Checks(Range<usize>),
}

/// Everything a request needs from the store, and how to report each descriptor.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan<'c> {
    /// Store checks, in descriptor order.
    pub checks: Vec<Check>,
    /// The limit behind each check, same order and length as `checks`.
    pub limits: Vec<PlannedLimit<'c>>,
    /// The request descriptor each check came from, same order and length as `checks`.
    pub descriptor_of: Vec<usize>,
    /// One decision per request descriptor, in request order.
    pub decisions: Vec<Decision>,
    /// The `metadata:` of each descriptor's node that decides it, with the descriptor's index,
    /// in request order.
    pub metadata: Vec<(usize, &'c prost_types::Struct)>,
}

/// Matches every descriptor of `request` against `config` and lists the checks to run.
pub fn plan<'c>(config: &'c Config, request: &Request, keys: &KeySettings) -> Plan<'c> {
    let Some(domain) = config.domains.get(&request.domain) else {
        return Plan {
            checks: Vec::new(),
            limits: Vec::new(),
            descriptor_of: Vec::new(),
            decisions: vec![Decision::NoLimit; request.descriptors.len()],
            metadata: Vec::new(),
        };
    };

    // Each descriptor's match, with the entries it is matched and keyed by (a lone API key
    // gains its plan). Borrowed from the config: nothing per descriptor is allocated here,
    // unless metrics carry request values (`detailed_metric`, `value_to_metric`) or a
    // `share_threshold` wildcard rewrites the entries.
    let mut metadata_of: Vec<Option<&'c prost_types::Struct>> = Vec::new();
    let matched: Vec<(Entries<'_>, Matched<'c>)> = request
        .descriptors
        .iter()
        .enumerate()
        .map(|(index, descriptor)| {
            let entries = with_plan(domain, &descriptor.entries);
            if let Some(o) = descriptor.limit_override {
                let limit = Limit::fixed(o.requests_per_unit, o.unit);
                return (entries, Matched::Override(limit));
            }
            let located = locate(domain, &descriptor.entries, entries);
            if let Some(metadata) = located.node.and_then(|node| node.metadata.as_ref()) {
                metadata_of.resize(index, None);
                metadata_of.push(Some(metadata));
            }
            let matched = match (located.node.map(|node| &node.policy), located.path) {
                (Some(Some(Policy::Unlimited { name, replaces })), _) => {
                    Matched::Unlimited(name.as_deref(), replaces)
                }
                (Some(Some(Policy::Limits(limits))), Some(path)) => Matched::Limits(
                    path,
                    located.node.and_then(|node| node.layer.as_deref()),
                    limits,
                ),
                _ => Matched::Nothing,
            };
            (located.entries, matched)
        })
        .collect();

    // Names that some matched limit replaces; few or none, so a list beats a hash set.
    let mut replaced: Vec<&str> = Vec::new();
    let mut limit_count = 0;
    for (_, matched) in &matched {
        match matched {
            Matched::Nothing => {}
            Matched::Override(_) => limit_count += 1,
            Matched::Unlimited(_, replaces) => {
                replaced.extend(replaces.iter().map(String::as_str));
            }
            Matched::Limits(_, _, limits) => {
                limit_count += limits.len();
                for limit in limits.iter() {
                    replaced.extend(limit.replaces.iter().map(String::as_str));
                }
            }
        }
    }
    let is_replaced = |name: Option<&str>| name.is_some_and(|name| replaced.contains(&name));

    let namespace = key::Namespace::new(keys, &request.domain);
    let mut plan = Plan {
        checks: Vec::with_capacity(limit_count),
        limits: Vec::with_capacity(limit_count),
        descriptor_of: Vec::with_capacity(limit_count),
        decisions: Vec::with_capacity(request.descriptors.len()),
        metadata: Vec::new(),
    };
    for (index, (descriptor, (entries, matched))) in
        request.descriptors.iter().zip(matched).enumerate()
    {
        let start = plan.checks.len();
        let hits = hits_of(descriptor, request.hits_addend);
        let mut add = |planned: PlannedLimit<'c>| {
            if is_replaced(planned.limit.name.as_deref()) {
                return;
            }
            plan.checks.push(Check {
                key: namespace.encode(
                    planned.layer.unwrap_or(DEFAULT_LAYER),
                    &planned.limit,
                    &entries,
                ),
                params: Params::of(&planned.limit),
                hits: charged(
                    hits,
                    descriptor,
                    planned.limit.charge.or(keys.default_charge),
                ),
                shadow: planned.limit.shadow,
                quota_mode: planned.limit.quota_mode,
            });
            plan.limits.push(planned);
            plan.descriptor_of.push(index);
        };
        match matched {
            Matched::Nothing => {}
            Matched::Unlimited(name, _) => {
                if is_replaced(name) {
                    plan.decisions.push(Decision::NoLimit);
                } else {
                    if let Some(Some(metadata)) = metadata_of.get(index) {
                        plan.metadata.push((index, metadata));
                    }
                    plan.decisions.push(Decision::Unlimited);
                }
                continue;
            }
            Matched::Override(limit) => add(PlannedLimit {
                limit: Cow::Owned(limit),
                path: None,
                layer: None,
            }),
            Matched::Limits(path, layer, limits) => {
                for limit in limits {
                    add(PlannedLimit {
                        limit: Cow::Borrowed(limit),
                        path: Some(path.clone()),
                        layer,
                    });
                }
            }
        }
        let decision = if plan.checks.len() == start {
            Decision::NoLimit
        } else {
            Decision::Checks(start..plan.checks.len())
        };
        if decision != Decision::NoLimit
            && let Some(Some(metadata)) = metadata_of.get(index)
        {
            plan.metadata.push((index, metadata));
        }
        plan.decisions.push(decision);
    }
    plan
}

/// `[api_key=K]` becomes `[plan=<plan of K>, api_key=K]` when the domain has a plan table
/// (Envoy could not supply the plan); every other descriptor is left as it is.
fn with_plan<'e>(domain: &Domain, entries: &'e [(String, String)]) -> Cow<'e, [(String, String)]> {
    match (&domain.plans, entries) {
        (Some(plans), [(key, value)]) if *key == plans.from => Cow::Owned(vec![
            (plans.entry.clone(), plans.plan_of(value).to_owned()),
            (key.clone(), value.clone()),
        ]),
        _ => Cow::Borrowed(entries),
    }
}

/// The entries a descriptor is matched and keyed by.
type Entries<'r> = Cow<'r, [(String, String)]>;

/// Where a descriptor lands, and how its checks are keyed and counted.
struct Located<'c, 'e> {
    /// The node its last entry matched, if any.
    node: Option<&'c Node>,
    /// The entries to key it by: a value a `share_threshold` wildcard matched is the pattern,
    /// so every such value draws on one counter.
    entries: Entries<'e>,
    /// The metric path, for a node with limits.
    path: Option<Cow<'c, str>>,
}

/// Matches `entries` (the request's `own` entries, with a plan perhaps added) in `domain`.
///
/// Domains without `share_threshold` and `value_to_metric` walk the tree once, as
/// [`matcher::find`], and allocate only a `detailed_metric` path.
#[inline]
fn locate<'c, 'e>(
    domain: &'c Domain,
    own: &[(String, String)],
    entries: Entries<'e>,
) -> Located<'c, 'e> {
    if domain.shares_thresholds || domain.values_in_metrics {
        return locate_walking(domain, own, entries);
    }
    let node = matcher::find(&domain.root, &entries);
    let path = node.filter(|node| counted(node)).map(|node| {
        if node.detailed_metric {
            Cow::Owned(detailed_path(&domain.name, own))
        } else {
            Cow::Borrowed(node.path.as_str())
        }
    });
    Located {
        node,
        entries,
        path,
    }
}

/// Whether a descriptor landing on `node` is checked and counted.
fn counted(node: &Node) -> bool {
    matches!(node.policy, Some(Policy::Limits(_)))
}

/// [`locate`] in a domain with `share_threshold` or `value_to_metric`: the walk records every
/// node it passes, since both options act on the nodes above the last one.
#[inline(never)]
fn locate_walking<'c, 'e>(
    domain: &'c Domain,
    own: &[(String, String)],
    entries: Entries<'e>,
) -> Located<'c, 'e> {
    let mut walked: Vec<&'c Node> = Vec::with_capacity(entries.len());
    let Some(node) = matcher::walk(&domain.root, &entries, |_, node| walked.push(node)) else {
        return Located {
            node: None,
            entries,
            path: None,
        };
    };
    let shared = walked.iter().any(|node| node.shared_value.is_some());
    let entries = if shared {
        let rewritten = entries
            .iter()
            .zip(&walked)
            .map(|((key, value), node)| {
                let value = node.shared_value.as_ref().unwrap_or(value);
                (key.clone(), value.clone())
            })
            .collect::<Vec<_>>();
        Cow::Owned(rewritten)
    } else {
        entries
    };
    let path = counted(node).then(|| {
        if node.detailed_metric && shared {
            Cow::Owned(shared_detailed_path(&domain.name, &entries))
        } else if node.detailed_metric {
            Cow::Owned(detailed_path(&domain.name, own))
        } else if walked
            .iter()
            .any(|node| node.value_to_metric && node.shared_value.is_none())
        {
            Cow::Owned(value_path(&domain.name, &entries, &walked))
        } else {
            Cow::Borrowed(node.path.as_str())
        }
    });
    Located {
        node: Some(node),
        entries,
        path,
    }
}

/// envoyproxy/ratelimit's metric path under `value_to_metric`: each entry as its node's own
/// segment of the config path (`key`, `key_value`, `key_pattern`), except that a node with
/// `value_to_metric` shows the request's value (a shared pattern stays the pattern).
fn value_path(domain: &str, entries: &[(String, String)], walked: &[&Node]) -> String {
    let mut path = domain.to_owned();
    let mut parent_len = domain.len();
    for ((key, value), node) in entries.iter().zip(walked) {
        path.push('.');
        if node.value_to_metric && node.shared_value.is_none() {
            push_entry(&mut path, key, value);
        } else {
            // A node's path is its parent's, a dot, and its own segment.
            path.push_str(node.path.get(parent_len + 1..).unwrap_or_default());
        }
        parent_len = node.path.len();
    }
    path
}

/// `domain.key_value.key_value` with the request's own values, for `detailed_metric` limits
/// (an empty value still gets its `_`, as envoyproxy/ratelimit writes it).
fn detailed_path(domain: &str, entries: &[(String, String)]) -> String {
    let mut path = domain.to_owned();
    for (key, value) in entries {
        path.push('.');
        path.push_str(key);
        path.push('_');
        path.push_str(value);
    }
    path
}

/// The `detailed_metric` path when a `share_threshold` wildcard rewrote some values: theirs
/// then writes an empty value as the bare `key`.
fn shared_detailed_path(domain: &str, entries: &[(String, String)]) -> String {
    let mut path = domain.to_owned();
    for (key, value) in entries {
        path.push('.');
        push_entry(&mut path, key, value);
    }
    path
}

/// `key_value`, or `key` for an empty value, as envoyproxy/ratelimit writes an entry.
fn push_entry(path: &mut String, key: &str, value: &str) {
    path.push_str(key);
    if !value.is_empty() {
        path.push('_');
        path.push_str(value);
    }
}

enum Matched<'c> {
    Nothing,
    Unlimited(Option<&'c str>, &'c [String]),
    /// The node's limits, all of which apply, with their metric path and the node's layer.
    Limits(Cow<'c, str>, Option<&'c str>, &'c [Limit]),
    /// Envoy's own limit for the descriptor.
    Override(Limit),
}

/// `hits` as a charge (recorded whatever the answer) when the limit's policy says so: by
/// default when the descriptor carries its own cost, as Envoy sends a response's.
fn charged(hits: Hits, descriptor: &Descriptor, charge: Charge) -> Hits {
    let Hits::Take(n) = hits else {
        return hits;
    };
    match charge {
        Charge::Always => Hits::Charge(n),
        // `Default` was resolved by the caller; taken as the built-in default all the same.
        Charge::Default | Charge::DescriptorHits if descriptor.hits_addend.is_some() => {
            Hits::Charge(n)
        }
        Charge::Default | Charge::DescriptorHits | Charge::Never => hits,
    }
}

/// The descriptor's `hits_addend` wins over the request's; a request's 0 means 1.
fn hits_of(descriptor: &Descriptor, request_hits: u32) -> Hits {
    let hits = descriptor
        .hits_addend
        .unwrap_or_else(|| u64::from(request_hits.max(1)));
    match (descriptor.refund, hits) {
        (true, n) => Hits::Refund(n),
        (false, 0) => Hits::Peek,
        (false, n) => Hits::Take(n),
    }
}

#[cfg(test)]
mod tests;
