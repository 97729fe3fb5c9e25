//! From a request's descriptors to store checks: matching, `replaces`, hits and keys.
//!
//! Pure functions, no I/O: the service feeds in domain types and gets back a [`Plan`].

pub mod key;
pub mod matcher;

use std::borrow::Cow;
use std::ops::Range;

use crate::algorithm::{Hits, Params};
use crate::config::{Config, Domain, Node, Policy};
use crate::limit::{Limit, Unit};
use crate::store::Check;

/// A limit Envoy sent with a descriptor (`RateLimitOverride`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// One request descriptor, validated: entries have non-empty keys.
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

/// How checks are keyed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySettings {
    /// First key component, so several deployments can share one Redis.
    pub prefix: String,
}

impl Default for KeySettings {
    fn default() -> Self {
        KeySettings {
            prefix: "rlsd".to_owned(),
        }
    }
}

/// A limit that decides a descriptor, borrowed from the config or built from an override.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedLimit<'c> {
    /// The limit (reported as `current_limit`).
    pub limit: Cow<'c, Limit>,
    /// Descriptor path for metrics (`domain.key_value...`), or `None` for an override.
    pub path: Option<&'c str>,
    /// `detailed_metric: true`: metrics are labelled with the request's own values.
    pub detailed: bool,
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
}

/// Matches every descriptor of `request` against `config` and lists the checks to run.
pub fn plan<'c>(config: &'c Config, request: &Request, keys: &KeySettings) -> Plan<'c> {
    let Some(domain) = config.domains.get(&request.domain) else {
        return Plan {
            checks: Vec::new(),
            limits: Vec::new(),
            descriptor_of: Vec::new(),
            decisions: vec![Decision::NoLimit; request.descriptors.len()],
        };
    };

    // Each descriptor's match, with the entries it is matched and keyed by (a lone API key
    // gains its plan). Borrowed from the config: nothing per descriptor is allocated here.
    let matched: Vec<(Entries<'_>, Matched<'c>)> = request
        .descriptors
        .iter()
        .map(|descriptor| {
            let entries = with_plan(domain, &descriptor.entries);
            let matched = match descriptor.limit_override {
                Some(o) => Matched::Override(Limit::fixed(o.requests_per_unit, o.unit)),
                None => {
                    match matcher::find(&domain.root, &entries).map(|node| (node, &node.policy)) {
                        None | Some((_, None)) => Matched::Nothing,
                        Some((_, Some(Policy::Unlimited { name, replaces }))) => {
                            Matched::Unlimited(name.as_deref(), replaces)
                        }
                        Some((node, Some(Policy::Limits(limits)))) => Matched::Limits(node, limits),
                    }
                }
            };
            (entries, matched)
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
            Matched::Limits(_, limits) => {
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
                hits,
                shadow: planned.limit.shadow,
            });
            plan.limits.push(planned);
            plan.descriptor_of.push(index);
        };
        match matched {
            Matched::Nothing => {}
            Matched::Unlimited(name, _) => {
                plan.decisions.push(if is_replaced(name) {
                    Decision::NoLimit
                } else {
                    Decision::Unlimited
                });
                continue;
            }
            Matched::Override(limit) => add(PlannedLimit {
                limit: Cow::Owned(limit),
                path: None,
                detailed: false,
                layer: None,
            }),
            Matched::Limits(node, limits) => {
                for limit in limits {
                    add(PlannedLimit {
                        limit: Cow::Borrowed(limit),
                        path: Some(node.path.as_str()),
                        detailed: node.detailed_metric,
                        layer: node.layer.as_deref(),
                    });
                }
            }
        }
        plan.decisions.push(if plan.checks.len() == start {
            Decision::NoLimit
        } else {
            Decision::Checks(start..plan.checks.len())
        });
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

enum Matched<'c> {
    Nothing,
    Unlimited(Option<&'c str>, &'c [String]),
    /// The node's limits, all of which apply.
    Limits(&'c Node, &'c [Limit]),
    /// Envoy's own limit for the descriptor.
    Override(Limit),
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
