//! `quota_buckets:`: the limits of Rate Limit Quota Service buckets in a domain file, checked
//! with the same walker (and the same `rate_limit` parser) as descriptors.

use super::{Walker, YNode};
use crate::config::yaml::{Pos, Value};
use crate::config::{Level, Node, PlanTable, Wildcard};
use crate::engine::matcher;
use crate::rlqs::rules::{BucketRule, Quota, QuotaRules, SharedDescriptor, ValueMatch};

/// Keys allowed in a `quota_buckets:` item.
const QUOTA_BUCKET_KEYS: &[&str] = &["bucket", "rate_limit", "descriptor"];
/// Keys of one entry of a quota bucket's `descriptor`.
const DESCRIPTOR_ENTRY_KEYS: &[&str] = &["key", "value"];
/// Keys of `rate_limit` that mean something for a quota bucket (no algorithm: Envoy enforces a
/// token bucket of its own).
const QUOTA_LIMIT_KEYS: &[&str] = &["unit", "requests_per_unit", "unlimited", "unit_multiplier"];

impl Walker<'_> {
    /// `quota_buckets: [{bucket: {k: v}, rate_limit: {...}}, ...]`, first match wins; an item
    /// without `bucket` matches every bucket and must be the last. An item may give
    /// `descriptor:` instead of `rate_limit:`, one of `level` (the domain's descriptors).
    pub(super) fn quota_buckets(
        &mut self,
        node: &YNode,
        level: &Level,
        plans: Option<&PlanTable>,
    ) -> QuotaRules {
        let mut rules = QuotaRules::default();
        let Value::Seq(items) = &node.value else {
            let found = self.describe(node);
            self.error(
                node.pos,
                format!("quota_buckets must be a list, found {found}"),
            );
            return rules;
        };
        let mut catch_all: Option<Pos> = None;
        for item in items {
            let Some(fields) = self.fields(item, "a quota bucket", QUOTA_BUCKET_KEYS) else {
                continue;
            };
            if let Some(at) = catch_all {
                self.error(
                    item.pos,
                    format!(
                        "this quota bucket never matches: the one at line {} has no 'bucket' and matches every bucket",
                        at.line
                    ),
                );
            }
            let entries = match fields.get("bucket") {
                None => Some(Vec::new()),
                Some((_, map)) => self.bucket_entries(map),
            };
            let quota = match (fields.get("rate_limit"), fields.get("descriptor")) {
                (None, None) => {
                    self.error(
                        item.pos,
                        "quota bucket is missing 'rate_limit' (or 'descriptor')".to_owned(),
                    );
                    None
                }
                (Some(_), Some((key, _))) => {
                    self.error(
                        key.pos,
                        "a quota bucket takes 'rate_limit' or 'descriptor', not both".to_owned(),
                    );
                    None
                }
                (Some((key, limit)), None) => self.quota(limit, key.pos),
                (None, Some((_, descriptor))) => entries.as_ref().and_then(|entries| {
                    self.shared_descriptor(descriptor, entries, level, plans)
                        .map(Quota::Descriptor)
                }),
            };
            if let (Some(entries), Some(quota)) = (entries, quota) {
                if entries.is_empty() {
                    catch_all.get_or_insert(item.pos);
                }
                rules.rules.push(BucketRule {
                    entries,
                    quota,
                    line: item.pos.line,
                });
            }
        }
        rules
    }

    /// `bucket: {key: value, ...}`: non-empty keys and values, a value with `*` a pattern.
    fn bucket_entries(&mut self, node: &YNode) -> Option<Vec<(String, ValueMatch)>> {
        let Value::Map(pairs) = &node.value else {
            let found = self.describe(node);
            self.error(
                node.pos,
                format!("bucket must be a mapping of entries, found {found}"),
            );
            return None;
        };
        let mut entries = Vec::with_capacity(pairs.len());
        let mut ok = true;
        for (key, value) in pairs {
            let name = self.text("a bucket entry key", key);
            let value_text = self.text("a bucket entry value", value);
            match (name, value_text) {
                (Some(name), _) if name.is_empty() => {
                    self.error(key.pos, "bucket entry keys must not be empty".to_owned());
                    ok = false;
                }
                (Some(_), Some(text)) if text.is_empty() => {
                    self.error(
                        value.pos,
                        "bucket entry values must not be empty (use \"*\" for any value)"
                            .to_owned(),
                    );
                    ok = false;
                }
                (Some(name), Some(text)) => {
                    let matcher =
                        Wildcard::new(&text).map_or(ValueMatch::Exact(text), ValueMatch::Pattern);
                    entries.push((name, matcher));
                }
                _ => ok = false,
            }
        }
        ok.then_some(entries)
    }

    /// `descriptor: [{key: k, value: v}, {key: k2}]`: an RLS descriptor of the domain whose
    /// limit (and counter) the bucket shares. An entry without a value takes the bucket id's
    /// value, so its key must be one the item's `bucket` matches.
    fn shared_descriptor(
        &mut self,
        node: &YNode,
        bucket: &[(String, ValueMatch)],
        level: &Level,
        plans: Option<&PlanTable>,
    ) -> Option<SharedDescriptor> {
        let items = match &node.value {
            Value::Seq(items) if !items.is_empty() => items,
            _ => {
                let found = self.describe(node);
                self.error(
                    node.pos,
                    format!(
                        "descriptor must be a non-empty list of entries ({{key: k, value: v}}), found {found}"
                    ),
                );
                return None;
            }
        };
        let before = self.errors.len();
        let mut entries = Vec::with_capacity(items.len());
        for item in items {
            let Some(fields) = self.fields(item, "a descriptor entry", DESCRIPTOR_ENTRY_KEYS)
            else {
                continue;
            };
            let key = match fields.get("key") {
                None => {
                    self.error(item.pos, "descriptor entry is missing 'key'".to_owned());
                    continue;
                }
                Some((_, key)) => match self.text("a descriptor entry key", key) {
                    Some(text) if text.is_empty() => {
                        self.error(
                            key.pos,
                            "descriptor entry keys must not be empty".to_owned(),
                        );
                        continue;
                    }
                    Some(text) => text,
                    None => continue,
                },
            };
            let value = match fields.get("value") {
                None => None,
                Some((_, value)) => match self.text("a descriptor entry value", value) {
                    Some(text) if text.is_empty() => None,
                    Some(text) => Some(text),
                    None => continue,
                },
            };
            if value.is_none() && !bucket.iter().any(|(name, _)| *name == key) {
                self.error(
                    item.pos,
                    format!(
                        "descriptor entry '{key}' has no value and this quota bucket's 'bucket' has no entry '{key}' to take it from"
                    ),
                );
                continue;
            }
            entries.push((key, value));
        }
        if self.errors.len() > before {
            return None;
        }
        let shown = show(&entries);
        // `[api_key=K]` is matched as `[plan=<plan of K>, api_key=K]` (any plan without K).
        let walked = match (plans, entries.as_slice()) {
            (Some(plans), [(key, value)]) if *key == plans.from => vec![
                (
                    plans.entry.clone(),
                    value
                        .as_deref()
                        .map(|value| plans.plan_of(value).to_owned()),
                ),
                (key.clone(), value.clone()),
            ],
            _ => entries.clone(),
        };
        let nodes = reachable(level, &walked);
        if nodes.is_empty() {
            self.error(
                node.pos,
                format!(
                    "descriptor {shown} matches no descriptor of domain '{}' (give it in this file or an earlier one)",
                    self.domain
                ),
            );
            return None;
        }
        if nodes.iter().all(|node| node.policy.is_none()) {
            let path = &nodes[0].path;
            self.error(
                node.pos,
                format!("descriptor {shown} lands on '{path}', which has no rate_limit to share"),
            );
            return None;
        }
        Some(SharedDescriptor { entries })
    }

    /// A quota bucket's `rate_limit`: requests per unit (0: deny all) or `unlimited: true`.
    fn quota(&mut self, node: &YNode, at: Pos) -> Option<Quota> {
        let before = self.errors.len();
        self.fields(node, "a quota bucket's rate_limit", QUOTA_LIMIT_KEYS)?;
        if self.errors.len() > before {
            return None;
        }
        let parsed = self.limit(node, at, "a quota bucket's rate_limit")?;
        Some(match parsed.limit {
            None => Quota::Unlimited,
            Some(limit) if limit.requests_per_unit == 0 => Quota::Zero,
            Some(limit) => {
                let seconds =
                    limit.period.unit.seconds() * u64::from(limit.period.multiplier.get());
                Quota::PerSecond(f64::from(limit.requests_per_unit) / seconds as f64)
            }
        })
    }
}

/// The nodes a descriptor can land on: an entry with a value matches as a request would (exact,
/// then wildcards, then the default); one without may land on any node of its key.
fn reachable<'c>(level: &'c Level, entries: &[(String, Option<String>)]) -> Vec<&'c Node> {
    let Some(((key, value), rest)) = entries.split_first() else {
        return Vec::new();
    };
    let nodes: Vec<&Node> = match value {
        Some(value) => matcher::find(level, &[(key, value)]).into_iter().collect(),
        None => level
            .keys
            .get(key)
            .map(|nodes| nodes.all().collect())
            .unwrap_or_default(),
    };
    if rest.is_empty() {
        return nodes;
    }
    nodes
        .into_iter()
        .flat_map(|node| reachable(&node.children, rest))
        .collect()
}

/// `[k=v, k2=*]`: a descriptor for messages (`*`: the bucket id's value).
fn show(entries: &[(String, Option<String>)]) -> String {
    let shown: Vec<String> = entries
        .iter()
        .map(|(key, value)| format!("{key}={}", value.as_deref().unwrap_or("<bucket's>")))
        .collect();
    format!("[{}]", shown.join(", "))
}

#[cfg(test)]
mod tests {
    use crate::config::load_str;
    use crate::rlqs::Quota;

    #[test]
    fn quota_buckets_load_in_order_with_their_limits() {
        let domain = load_str(
            "q.yaml",
            "domain: api\nquota_buckets:\n  - bucket: {name: checkout}\n    rate_limit: {unit: minute, requests_per_unit: 600}\n  - bucket: {tenant: 'gold-*'}\n    rate_limit: {unlimited: true}\n  - bucket: {tenant: x}\n    rate_limit: {unit: second, requests_per_unit: 0}\n  - rate_limit: {unit: second, requests_per_unit: 5, unit_multiplier: 2}\n",
        )
        .unwrap_or_else(|errors| panic!("{errors:?}"));
        let quotas: Vec<Quota> = domain
            .quota
            .rules
            .iter()
            .map(|rule| rule.quota.clone())
            .collect();
        assert_eq!(
            quotas,
            [
                Quota::PerSecond(10.0),
                Quota::Unlimited,
                Quota::Zero,
                Quota::PerSecond(2.5)
            ]
        );
        assert_eq!(domain.quota.rules[3].entries.len(), 0);
    }

    #[test]
    fn bad_quota_buckets_are_reported_with_their_lines() {
        let errors = load_str(
            "q.yaml",
            "domain: api\nquota_buckets:\n  - rate_limit: {unit: second, requests_per_unit: 5}\n  - bucket: {a: b}\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: gcra}\n  - bucket: {a: ''}\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - bucket: {a: b}\n",
        )
        .err()
        .unwrap_or_default();
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert!(
            text.iter()
                .any(|e| e.starts_with("q.yaml:4:") && e.contains("never matches")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|e| e.starts_with("q.yaml:5:") && e.contains("unknown key 'algorithm'")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|e| e.starts_with("q.yaml:6:") && e.contains("must not be empty")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|e| e.starts_with("q.yaml:8:") && e.contains("missing 'rate_limit'")),
            "{text:?}"
        );
    }

    #[test]
    fn a_quota_bucket_shares_a_descriptor_of_its_domain() {
        let domain = load_str(
            "q.yaml",
            "domain: api\ndescriptors:\n  - key: generic_key\n    value: checkout\n    rate_limit: {unit: minute, requests_per_unit: 600}\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 5}\nquota_buckets:\n  - bucket: {name: checkout}\n    descriptor: [{key: generic_key, value: checkout}]\n  - bucket: {tenant: '*'}\n    descriptor: [{key: tenant}]\n",
        )
        .unwrap_or_else(|errors| panic!("{errors:?}"));
        let shared = |i: usize| match &domain.quota.rules[i].quota {
            Quota::Descriptor(shared) => shared.entries.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            shared(0),
            [("generic_key".to_owned(), Some("checkout".to_owned()))]
        );
        assert_eq!(shared(1), [("tenant".to_owned(), None)]);
    }

    #[test]
    fn a_shared_descriptor_that_cannot_be_found_is_reported_with_its_line() {
        let errors = load_str(
            "q.yaml",
            "domain: api\ndescriptors:\n  - key: generic_key\n    value: checkout\n    rate_limit: {unit: minute, requests_per_unit: 600}\n  - key: whitelisted\nquota_buckets:\n  - bucket: {name: a}\n    descriptor: [{key: generic_key, value: cart}]\n  - bucket: {name: b}\n    descriptor: [{key: tenant}]\n  - bucket: {name: c}\n    descriptor: [{key: whitelisted, value: x}]\n  - bucket: {name: d}\n    descriptor: [{key: generic_key, value: checkout}]\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - bucket: {name: e}\n    descriptor: []\n",
        )
        .err()
        .unwrap_or_default();
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        let has = |at: &str, what: &str| text.iter().any(|e| e.starts_with(at) && e.contains(what));
        assert!(
            has("q.yaml:9:", "matches no descriptor of domain 'api'"),
            "{text:?}"
        );
        assert!(has("q.yaml:11:", "has no entry 'tenant'"), "{text:?}");
        assert!(has("q.yaml:13:", "has no rate_limit to share"), "{text:?}");
        assert!(has("q.yaml:15:", "not both"), "{text:?}");
        assert!(has("q.yaml:18:", "non-empty list"), "{text:?}");
        assert_eq!(text.len(), 5, "{text:?}");
    }

    #[test]
    fn a_lone_api_key_descriptor_is_found_under_its_plan() {
        let domain = load_str(
            "q.yaml",
            "domain: api\ndescriptors:\n  - key: plan\n    value: pro\n    descriptors:\n      - key: api_key\n        rate_limit: {unit: second, requests_per_unit: 50}\nplans:\n  from: api_key\n  entry: plan\n  default: pro\nquota_buckets:\n  - bucket: {api_key: '*'}\n    descriptor: [{key: api_key}]\n  - bucket: {name: k}\n    descriptor: [{key: api_key, value: k1}]\n",
        )
        .unwrap_or_else(|errors| panic!("{errors:?}"));
        assert_eq!(domain.quota.rules.len(), 2);
    }
}
