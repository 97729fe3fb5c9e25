//! `quota_buckets:`: the limits of Rate Limit Quota Service buckets in a domain file, checked
//! with the same walker (and the same `rate_limit` parser) as descriptors.

use super::{Walker, YNode};
use crate::config::Wildcard;
use crate::config::yaml::{Pos, Value};
use crate::rlqs::rules::{BucketRule, Quota, QuotaRules, ValueMatch};

/// Keys allowed in a `quota_buckets:` item.
const QUOTA_BUCKET_KEYS: &[&str] = &["bucket", "rate_limit"];
/// Keys of `rate_limit` that mean something for a quota bucket (no algorithm: Envoy enforces a
/// token bucket of its own).
const QUOTA_LIMIT_KEYS: &[&str] = &["unit", "requests_per_unit", "unlimited", "unit_multiplier"];

impl Walker<'_> {
    /// `quota_buckets: [{bucket: {k: v}, rate_limit: {...}}, ...]`, first match wins; an item
    /// without `bucket` matches every bucket and must be the last.
    pub(super) fn quota_buckets(&mut self, node: &YNode) -> QuotaRules {
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
            let quota = match fields.get("rate_limit") {
                None => {
                    self.error(item.pos, "quota bucket is missing 'rate_limit'".to_owned());
                    None
                }
                Some((key, limit)) => self.quota(limit, key.pos),
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
        let quotas: Vec<Quota> = domain.quota.rules.iter().map(|rule| rule.quota).collect();
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
}
