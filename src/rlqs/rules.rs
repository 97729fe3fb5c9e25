//! Which limit a quota bucket gets: a domain's `quota_buckets:` rules, matched against a
//! `BucketId`'s entries, first match wins.

use std::collections::BTreeMap;

use crate::config::Wildcard;

/// The `quota_buckets:` of one domain, in config order. Built only by the config loader.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct QuotaRules {
    /// Rules in config order; the first whose entries all match decides.
    pub rules: Vec<BucketRule>,
}

/// One `quota_buckets:` item.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketRule {
    /// Entries a `BucketId` must hold, each matched by value; empty matches every bucket (the
    /// default rule, which must be last).
    pub entries: Vec<(String, ValueMatch)>,
    /// What a matching bucket is held to.
    pub quota: Quota,
    /// The line of the rule in its file, for the debug view and logs.
    pub line: u64,
}

/// How a rule matches one entry's value.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueMatch {
    /// Exactly this value.
    Exact(String),
    /// A `*` pattern (`*` alone matches any value).
    Pattern(Wildcard),
}

impl ValueMatch {
    /// Whether `value` matches.
    pub fn matches(&self, value: &str) -> bool {
        match self {
            ValueMatch::Exact(exact) => exact == value,
            ValueMatch::Pattern(pattern) => pattern.matches(value),
        }
    }
}

/// The limit one bucket is held to, across every Envoy and replica that reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum Quota {
    /// `unlimited: true`: every Envoy is told ALLOW_ALL.
    Unlimited,
    /// `requests_per_unit: 0`: every Envoy is told DENY_ALL.
    Zero,
    /// This many requests per second, split between the Envoys.
    PerSecond(f64),
    /// `descriptor:`: the limit of an RLS descriptor of the same domain, whose counter is the
    /// budget of both (`docs/rlqs.md#one-budget-for-rls-and-rlqs`).
    Descriptor(SharedDescriptor),
}

/// The RLS descriptor a quota bucket shares its budget with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedDescriptor {
    /// Its entries in order; an entry without a value takes the bucket id's value of the same
    /// key (each value its own counter, as an RLS descriptor without a value counts).
    pub entries: Vec<(String, Option<String>)>,
}

impl SharedDescriptor {
    /// The descriptor's entries for `bucket`, or `None` when the bucket id lacks the value of
    /// an entry that takes it from there.
    pub fn entries_for(&self, bucket: &BTreeMap<String, String>) -> Option<Vec<(String, String)>> {
        self.entries
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    Some(value) => value.clone(),
                    None => bucket.get(key)?.clone(),
                };
                Some((key.clone(), value))
            })
            .collect()
    }
}

impl QuotaRules {
    /// The first rule matching `bucket`, if any.
    pub fn find(&self, bucket: &BTreeMap<String, String>) -> Option<&BucketRule> {
        self.rules.iter().find(|rule| {
            rule.entries
                .iter()
                .all(|(key, value)| bucket.get(key).is_some_and(|actual| value.matches(actual)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn rule(entries: &[(&str, &str)], quota: Quota) -> BucketRule {
        BucketRule {
            entries: entries
                .iter()
                .map(|(k, v)| {
                    let value = Wildcard::new(v)
                        .map_or_else(|| ValueMatch::Exact((*v).to_owned()), ValueMatch::Pattern);
                    ((*k).to_owned(), value)
                })
                .collect(),
            quota,
            line: 1,
        }
    }

    #[test]
    fn first_matching_rule_decides_and_the_default_catches_the_rest() {
        let rules = QuotaRules {
            rules: vec![
                rule(&[("name", "checkout")], Quota::PerSecond(10.0)),
                rule(&[("tenant", "gold-*")], Quota::Unlimited),
                rule(&[("tenant", "*")], Quota::PerSecond(5.0)),
                rule(&[], Quota::Zero),
            ],
        };
        let quota =
            |pairs: &[(&str, &str)]| rules.find(&bucket(pairs)).map(|rule| rule.quota.clone());
        assert_eq!(
            quota(&[("name", "checkout"), ("tenant", "gold-1")]),
            Some(Quota::PerSecond(10.0))
        );
        assert_eq!(quota(&[("tenant", "gold-1")]), Some(Quota::Unlimited));
        assert_eq!(quota(&[("tenant", "x")]), Some(Quota::PerSecond(5.0)));
        assert_eq!(quota(&[("other", "x")]), Some(Quota::Zero));
        assert_eq!(QuotaRules::default().find(&bucket(&[("a", "b")])), None);
    }

    #[test]
    fn a_shared_descriptor_takes_missing_values_from_the_bucket_id() {
        let shared = SharedDescriptor {
            entries: vec![
                ("generic_key".to_owned(), Some("checkout".to_owned())),
                ("tenant".to_owned(), None),
            ],
        };
        assert_eq!(
            shared.entries_for(&bucket(&[("tenant", "acme"), ("name", "x")])),
            Some(vec![
                ("generic_key".to_owned(), "checkout".to_owned()),
                ("tenant".to_owned(), "acme".to_owned()),
            ])
        );
        assert_eq!(shared.entries_for(&bucket(&[("name", "x")])), None);
    }
}
