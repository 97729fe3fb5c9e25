//! Properties over thousands of generated inputs: store keys are injective and brace-free,
//! planning and validation never panic, and config loading reports every error at a position.

use crate::common;

use std::cell::Cell;
use std::num::NonZeroU32;
use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestRunner};
use rlsd::clock::ManualClock;
use rlsd::config;
use rlsd::engine::key::MAX_PLAIN_ENTRIES_BYTES;
use rlsd::engine::{self, Decision, Descriptor, KeySettings, LimitOverride};
use rlsd::limit::{Algorithm, Limit, Period, Unit};
use rlsd::pb::rate_limit_descriptor::{Entry, RateLimitOverride};
use rlsd::pb::{RateLimitDescriptor, RateLimitRequest};
use rlsd::service::{RateLimiter, RequestLimits, ServiceSettings};
use rlsd::store::MemoryStore;

/// Limits of every shape the engine plans for.
const SHOP: &str = r#"
domain: shop
descriptors:
  - key: user
    rate_limit:
      name: per-user
      unit: minute
      requests_per_unit: 3
  - key: path
    value: /health
  - key: path
    value: "/api/*"
    detailed_metric: true
    rate_limit:
      unit: second
      requests_per_unit: 2
      algorithm: gcra
      burst: 2
  - key: path
    value: /free
    rate_limit:
      unlimited: true
      name: free
      replaces:
        - name: per-user
  - key: tenant
    descriptors:
      - key: user
        rate_limit:
          name: tenant-user
          unit: hour
          requests_per_unit: 5
          replaces:
            - name: per-user
  - key: shadowed
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: zero
    rate_limit:
      unit: second
      requests_per_unit: 0
  - key: many
    rate_limits:
      - unit: minute
        requests_per_unit: 10
        algorithm: sliding_window_log
      - unit: minute
        requests_per_unit: 100
        algorithm: sliding_window_log
      - unit: day
        unit_multiplier: 7
        requests_per_unit: 1000
        algorithm: token_bucket
        burst: 50
      - unit: year
        requests_per_unit: 4294967295
        algorithm: sliding_window_counter
"#;

const THREE_LAYER: &str = include_str!("../../examples/three-layer.yaml");
const ALGORITHMS: &str = include_str!("../../examples/algorithms.yaml");

/// The keys and values the configs above match on, so generated requests often hit limits.
const KEYS: &[&str] = &[
    "user",
    "path",
    "tenant",
    "shadowed",
    "zero",
    "many",
    "remote_address",
    "plan",
    "api_key",
    "endpoint",
    "algorithm",
];
const VALUES: &[&str] = &[
    "ann",
    "/health",
    "/api/x",
    "/free",
    "free",
    "pro",
    "k-acme-prod",
    "search",
    "export",
    "fixed_window",
    "gcra",
    "token_bucket",
    "burst_and_sustained",
    "10.0.0.1",
];
const DOMAINS: &[&str] = &["shop", "edge-proxy", "algorithms"];

/// Every config above, loaded into one.
fn fixed_config() -> config::Config {
    let mut loaded = config::Config::default();
    for (name, yaml) in [
        ("shop.yaml", SHOP),
        ("three-layer.yaml", THREE_LAYER),
        ("algorithms.yaml", ALGORITHMS),
    ] {
        let domain = config::load_str(name, yaml).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        loaded.domains.insert(domain.name.clone(), domain);
    }
    loaded
}

/// Strings dense in the characters the key encoding escapes, so near-collisions are common.
fn tricky() -> impl Strategy<Value = String> {
    tricky_of(0..5)
}

/// Tricky strings, some long enough to have their keys digested.
fn tricky_or_long() -> impl Strategy<Value = String> {
    prop_oneof![3 => tricky(), 1 => tricky_of(20..40)]
}

/// Tricky strings of `pieces` pieces.
fn tricky_of(pieces: std::ops::Range<usize>) -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        ":", "=", "%", "{", "}", "%3A", "%3D", "%25", "%7B", "%7D", "%%", "~", "a", "é", "🦀", "",
    ]);
    prop::collection::vec(piece, pieces).prop_map(|pieces| pieces.concat())
}

/// Any UTF-8, tricky strings, ones around the length where keys are digested, and the
/// configs' own words.
fn text(words: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(words).prop_map(str::to_owned),
        2 => tricky(),
        2 => any::<String>(),
        1 => tricky_of(20..40),
        1 => Just(String::new()),
    ]
}

fn entries() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec((text(KEYS), text(VALUES)), 0..5)
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(Algorithm::ALL.to_vec())
}

fn unit() -> impl Strategy<Value = Unit> {
    prop::sample::select(Unit::ALL.to_vec())
}

/// What a key is made of.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KeyParts {
    prefix: String,
    layer: String,
    domain: String,
    tag: String,
    seconds: u64,
    variant: u32,
    entries: Vec<(String, String)>,
}

fn key_inputs() -> impl Strategy<Value = (KeyParts, Limit)> {
    (
        text(&["rlsd"]),
        text(&["_", "edge", "plan"]),
        text(DOMAINS),
        algorithm(),
        unit(),
        1..=1000u32,
        prop_oneof![Just(0u32), any::<u32>()],
        entries(),
    )
        .prop_map(
            |(prefix, layer, domain, algorithm, unit, multiplier, variant, entries)| {
                let mut limit = Limit::fixed(10, unit);
                limit.algorithm = algorithm;
                limit.period = Period {
                    unit,
                    multiplier: NonZeroU32::new(multiplier).unwrap_or(NonZeroU32::MIN),
                };
                limit.variant = variant;
                let parts = KeyParts {
                    prefix,
                    layer,
                    domain,
                    tag: algorithm.key_tag().to_owned(),
                    seconds: limit.period.seconds(),
                    variant,
                    entries,
                };
                (parts, limit)
            },
        )
}

fn encode(parts: &KeyParts, limit: &Limit) -> String {
    let settings = KeySettings {
        prefix: parts.prefix.clone(),
        ..KeySettings::default()
    };
    engine::key::encode(
        &settings,
        &parts.layer,
        &parts.domain,
        limit,
        &parts.entries,
    )
}

/// Undoes the component escaping; `None` for a `%` not followed by a known escape.
fn unescape(text: &str) -> Option<String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 3)?;
        out.push(match code {
            "25" => '%',
            "3A" => ':',
            "3D" => '=',
            "7B" => '{',
            "7D" => '}',
            _ => return None,
        });
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// The escaped entries part of a key, `:<k>=<v>...`, written here apart from `engine::key`.
fn escaped_entries(entries: &[(String, String)]) -> String {
    let escape = |text: &str| {
        text.replace('%', "%25")
            .replace(':', "%3A")
            .replace('=', "%3D")
            .replace('{', "%7B")
            .replace('}', "%7D")
    };
    entries
        .iter()
        .map(|(k, v)| format!(":{}={}", escape(k), escape(v)))
        .collect()
}

/// The digest segment a key carries instead of `escaped` entries (lowercase hex SHA-256).
fn digest_of(escaped: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, escaped.as_bytes());
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256-{hex}")
}

/// Parses a key back into its parts: a left inverse of `encode` for keys with plain entries, so
/// those are injective. A digested key decodes to its parts without entries and its digest.
fn decode_any(key: &str) -> Option<(KeyParts, Option<String>)> {
    let (head, last) = key.rsplit_once(':')?;
    if last.starts_with("sha256-") && !last.contains('=') {
        return Some((decode(head)?, Some(last.to_owned())));
    }
    Some((decode(key)?, None))
}

/// Parses a key with plain entries back into its parts.
fn decode(key: &str) -> Option<KeyParts> {
    let mut fields = key.split(':');
    let prefix = unescape(fields.next()?)?;
    let layer = unescape(fields.next()?)?;
    let domain = unescape(fields.next()?)?;
    let tag = fields.next()?.to_owned();
    let period = fields.next()?;
    let (seconds, variant) = match period.split_once('~') {
        Some((seconds, variant)) => (seconds.parse().ok()?, variant.parse().ok()?),
        None => (period.parse().ok()?, 0),
    };
    let entries = fields
        .map(|entry| {
            let (k, v) = entry.split_once('=')?;
            if v.contains('=') {
                return None;
            }
            Some((unescape(k)?, unescape(v)?))
        })
        .collect::<Option<Vec<_>>>()?;
    Some(KeyParts {
        prefix,
        layer,
        domain,
        tag,
        seconds,
        variant,
        entries,
    })
}

/// `cases` cases; shrunk failures are saved in `tests/properties.proptest-regressions` and
/// replayed first on every run.
fn cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::with_cases(cases)
    }
}

/// A runner for tests that keep state across cases.
fn runner(count: u32) -> TestRunner {
    TestRunner::new(cases(count))
}

proptest! {
    #![proptest_config(cases(4000))]

    /// Every key decodes back to exactly what it was built from, and holds no hash tag brace;
    /// entries longer than the bound are replaced by the digest of their escaped form.
    #[test]
    fn keys_decode_to_their_parts_and_have_no_braces((parts, limit) in key_inputs()) {
        let key = encode(&parts, &limit);
        prop_assert!(!key.contains('{') && !key.contains('}'), "{key}");
        let escaped = escaped_entries(&parts.entries);
        if escaped.len() > MAX_PLAIN_ENTRIES_BYTES {
            let head = KeyParts { entries: Vec::new(), ..parts };
            prop_assert_eq!(decode_any(&key), Some((head, Some(digest_of(&escaped)))), "{}", key);
        } else {
            prop_assert_eq!(decode_any(&key), Some((parts, None)), "{}", key);
        }
    }

    /// Two different inputs never share a key (checked directly, on collision-prone strings,
    /// plain and digested).
    #[test]
    fn different_parts_give_different_keys(
        a in (tricky(), tricky(), prop::collection::vec((tricky_or_long(), tricky_or_long()), 0..3)),
        b in (tricky(), tricky(), prop::collection::vec((tricky_or_long(), tricky_or_long()), 0..3)),
    ) {
        let limit = Limit::fixed(1, Unit::Second);
        let key = |(layer, domain, entries): &(String, String, Vec<(String, String)>)| {
            engine::key::encode(&KeySettings::default(), layer, domain, &limit, entries)
        };
        if a != b {
            prop_assert_ne!(key(&a), key(&b));
        } else {
            prop_assert_eq!(key(&a), key(&b));
        }
    }
}

fn engine_request() -> impl Strategy<Value = engine::Request> {
    let descriptor = (
        entries(),
        prop::option::weighted(
            0.2,
            (any::<u32>(), unit()).prop_map(|(requests_per_unit, unit)| LimitOverride {
                requests_per_unit,
                unit,
            }),
        ),
        prop::option::of(prop_oneof![0..5u64, any::<u64>()]),
        any::<bool>(),
    )
        .prop_map(
            |(entries, limit_override, hits_addend, refund)| Descriptor {
                entries,
                limit_override,
                hits_addend,
                refund,
            },
        );
    (
        text(DOMAINS),
        prop::collection::vec(descriptor, 0..6),
        prop_oneof![0..5u32, any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| engine::Request {
            domain,
            descriptors,
            hits_addend,
        })
}

#[test]
fn planning_never_panics_and_plans_are_consistent() {
    let config = fixed_config();
    let keys = KeySettings::default();
    let mut runner = runner(4000);
    let planned_checks = Cell::new(0usize);
    runner
        .run(&engine_request(), |request| {
            let plan = engine::plan(&config, &request, &keys);
            prop_assert_eq!(plan.decisions.len(), request.descriptors.len());
            prop_assert_eq!(plan.limits.len(), plan.checks.len());
            prop_assert_eq!(plan.descriptor_of.len(), plan.checks.len());
            let mut next = 0;
            for (index, decision) in plan.decisions.iter().enumerate() {
                if let Decision::Checks(range) = decision {
                    prop_assert!(range.start == next && range.end > range.start);
                    prop_assert!(
                        plan.descriptor_of[range.clone()]
                            .iter()
                            .all(|&d| d == index)
                    );
                    next = range.end;
                }
            }
            prop_assert_eq!(next, plan.checks.len());
            for check in &plan.checks {
                prop_assert!(!check.key.contains(['{', '}']), "{}", check.key);
            }
            planned_checks.set(planned_checks.get() + plan.checks.len());
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
    // The generator reaches real limits, not only unknown descriptors.
    let planned_checks = planned_checks.get();
    assert!(planned_checks > 500, "only {planned_checks} checks planned");
}

/// Valid configs to mutate.
const BASES: &[&str] = &[SHOP, THREE_LAYER, ALGORITHMS];

/// YAML-ish fragments a mutation inserts.
const SNIPPETS: &[&str] = &[
    ": ",
    "- ",
    "\n",
    "  ",
    "\t",
    "{",
    "}",
    "[",
    "]",
    ",",
    "&a ",
    "*a",
    "<<: *a",
    "!!str ",
    "!tag ",
    "'",
    "\"",
    "# c",
    "---\n",
    "...\n",
    "~",
    "null",
    "-1",
    "0",
    "99999999999999999999999",
    "1e400",
    "key: x",
    "value: \"*\"",
    "rate_limit:",
    "rate_limits: []",
    "descriptors:",
    "unit: fortnight",
    "unit: hour",
    "requests_per_unit: 5",
    "unlimited: true",
    "replaces: [{name: nope}]",
    "layer: nowhere",
    "algorithm: gcra",
    "burst: 0",
    "unit_multiplier: 0",
    "domain: shop",
    "é",
    "\u{feff}",
    "\u{0}",
    "\r",
    "\r\n",
    "? ",
    "|\n",
    ">-\n",
    "%YAML 1.2\n",
    "\\",
];

/// One edit of a YAML text, at a position given as a fraction of its length.
#[derive(Clone, Debug)]
enum Mutation {
    Insert(f64, &'static str),
    Delete(f64, usize),
    DuplicateLine(f64),
    DeleteLine(f64),
    SwapLines(f64, f64),
    Indent(f64, usize),
    Dedent(f64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = 0.0..1.0f64;
    prop_oneof![
        4 => (at.clone(), prop::sample::select(SNIPPETS)).prop_map(|(a, s)| Mutation::Insert(a, s)),
        2 => (at.clone(), 1..20usize).prop_map(|(a, n)| Mutation::Delete(a, n)),
        1 => at.clone().prop_map(Mutation::DuplicateLine),
        1 => at.clone().prop_map(Mutation::DeleteLine),
        1 => (at.clone(), at.clone()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        1 => (at.clone(), 1..4usize).prop_map(|(a, n)| Mutation::Indent(a, n)),
        1 => at.prop_map(Mutation::Dedent),
    ]
}

/// The char boundary nearest below `fraction` of `text`.
fn boundary(text: &str, fraction: f64) -> usize {
    let mut at = ((text.len() as f64) * fraction) as usize;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn apply(text: &mut String, mutation: &Mutation) {
    let line_index = |lines: &[String], fraction: f64| {
        ((lines.len() as f64 * fraction) as usize).min(lines.len().saturating_sub(1))
    };
    let mut lines: Vec<String> = text.split('\n').map(str::to_owned).collect();
    match *mutation {
        Mutation::Insert(at, snippet) => {
            let at = boundary(text, at);
            text.insert_str(at, snippet);
            return;
        }
        Mutation::Delete(at, n) => {
            let start = boundary(text, at);
            let end = text[start..]
                .char_indices()
                .nth(n)
                .map_or(text.len(), |(i, _)| start + i);
            text.replace_range(start..end, "");
            return;
        }
        Mutation::DuplicateLine(at) => {
            let i = line_index(&lines, at);
            let line = lines[i].clone();
            lines.insert(i, line);
        }
        Mutation::DeleteLine(at) => {
            let i = line_index(&lines, at);
            lines.remove(i);
        }
        Mutation::SwapLines(a, b) => {
            let (a, b) = (line_index(&lines, a), line_index(&lines, b));
            lines.swap(a, b);
        }
        Mutation::Indent(at, n) => {
            let i = line_index(&lines, at);
            lines[i].insert_str(0, &" ".repeat(n));
        }
        Mutation::Dedent(at) => {
            let i = line_index(&lines, at);
            let trimmed = lines[i].trim_start().to_owned();
            lines[i] = trimmed;
        }
    }
    *text = lines.join("\n");
}

/// `load_str` returns, and any error sits at line >= 1, column >= 1, with a reason.
fn check_errors(text: &str) -> Result<(), TestCaseError> {
    if let Err(errors) = config::load_str("fuzz.yaml", text) {
        prop_assert!(!errors.is_empty(), "Err with no errors");
        for error in &errors {
            prop_assert!(
                error.line >= 1 && error.column >= 1,
                "{error} (line {}, column {})",
                error.line,
                error.column
            );
            prop_assert!(!error.reason.trim().is_empty(), "{error:?}");
            prop_assert_eq!(&error.file, "fuzz.yaml");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(3000))]

    /// Arbitrary bytes (lossily decoded, as a file read would refuse them otherwise).
    #[test]
    fn loading_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        check_errors(&String::from_utf8_lossy(&bytes))?;
    }

    /// Arbitrary strings, and strings built from YAML syntax.
    #[test]
    fn loading_arbitrary_text_never_panics(
        text in prop_oneof![
            any::<String>(),
            prop::collection::vec(prop::sample::select(SNIPPETS), 0..40).prop_map(|s| s.concat()),
        ]
    ) {
        check_errors(&text)?;
    }

    /// Valid configs with a few random edits.
    #[test]
    fn loading_mutated_configs_never_panics(
        base in prop::sample::select(BASES),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let mut text = base.to_owned();
        for mutation in &mutations {
            apply(&mut text, mutation);
        }
        check_errors(&text)?;
    }
}

#[test]
fn the_mutation_bases_are_valid() {
    for base in BASES {
        check_errors(base).unwrap_or_else(|e| panic!("{e}"));
        assert!(config::load_str("base.yaml", base).is_ok());
    }
}

/// Limits small enough that generated requests cross every one of them often.
const SMALL: RequestLimits = RequestLimits {
    max_descriptors: 3,
    max_entries: 3,
    max_key_bytes: 16,
    max_value_bytes: 16,
    max_hits_addend: 1000,
    max_message_bytes: 1024,
};

/// Strings mostly within the small byte limits, some over, multi-byte characters included.
fn sized_text(words: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        12 => prop::sample::select(words).prop_map(str::to_owned),
        3 => tricky(),
        2 => "[a-z]{15,17}",
        1 => "[é🦀a]{4,5}",
        1 => any::<String>(),
        1 => Just(String::new()),
    ]
}

/// Mostly `in_bounds`, sometimes 0 or one over `max`.
fn count(in_bounds: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = usize> {
    let over = in_bounds.end() + 1;
    prop_oneof![8 => in_bounds, 1 => Just(0), 1 => Just(over)]
}

fn wire_request() -> impl Strategy<Value = RateLimitRequest> {
    let entry = (sized_text(KEYS), sized_text(VALUES))
        .prop_map(|(key, value)| Entry { key, value })
        .boxed();
    let unit = prop_oneof![8 => 1..=6i32, 1 => 0..=7i32, 1 => any::<i32>()];
    let descriptor = (
        count(1..=3).prop_flat_map(move |n| prop::collection::vec(entry.clone(), n)),
        prop::option::weighted(
            0.2,
            (any::<u32>(), unit).prop_map(|(requests_per_unit, unit)| RateLimitOverride {
                requests_per_unit,
                unit,
            }),
        ),
        prop::option::weighted(0.3, prop_oneof![0..5u64, 995..1005u64, any::<u64>()]),
        any::<bool>(),
    )
        .prop_map(
            |(entries, limit, hits_addend, is_negative_hits)| RateLimitDescriptor {
                entries,
                limit,
                hits_addend,
                is_negative_hits,
            },
        )
        .boxed();
    let domain = prop_oneof![
        6 => prop::sample::select(DOMAINS).prop_map(str::to_owned),
        1 => text(DOMAINS),
        1 => Just(String::new()),
    ];
    (
        domain,
        count(1..=3).prop_flat_map(move |n| prop::collection::vec(descriptor.clone(), n)),
        prop_oneof![6 => 0..5u32, 2 => 995..1005u32, 1 => any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
}

/// Whether the service should accept `request` under `limits`.
fn acceptable(request: &RateLimitRequest, limits: &RequestLimits) -> bool {
    !request.domain.is_empty()
        && (1..=limits.max_descriptors).contains(&request.descriptors.len())
        && u64::from(request.hits_addend) <= limits.max_hits_addend
        && request.descriptors.iter().all(|d| {
            // No entries, or an empty key, is answered OK without a limit, as the reference does.
            d.entries.len() <= limits.max_entries
                && d.hits_addend
                    .is_none_or(|hits| hits <= limits.max_hits_addend)
                && d.limit.as_ref().is_none_or(|l| (1..=6).contains(&l.unit))
                && d.entries.iter().all(|e| {
                    e.key.len() <= limits.max_key_bytes && e.value.len() <= limits.max_value_bytes
                })
        })
}

/// Every generated wire request is answered or refused with INVALID_ARGUMENT, exactly when
/// it breaks a rule or a limit; answers have one status per descriptor.
fn decide_all(limits: RequestLimits, cases: u32) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let live = Arc::new(arc_swap::ArcSwap::from_pointee(fixed_config()));
    let store = Arc::new(MemoryStore::with_clock(
        10_000_000,
        ManualClock::at(common::T0),
    ));
    let settings = ServiceSettings {
        limits,
        ..Default::default()
    };
    let limiter = RateLimiter::new(live, store, settings);
    let (answered, refused) = (Cell::new(0u32), Cell::new(0u32));
    let mut runner = runner(cases);
    runner
        .run(&wire_request(), |request| {
            let expected = acceptable(&request, &limits);
            let descriptors = request.descriptors.len();
            match runtime.block_on(limiter.decide(request)) {
                Ok(response) => {
                    prop_assert!(expected, "accepted a request that breaks a limit");
                    prop_assert_eq!(response.statuses.len(), descriptors);
                    answered.set(answered.get() + 1);
                }
                Err(status) => {
                    prop_assert_eq!(status.code(), tonic::Code::InvalidArgument, "{:?}", status);
                    prop_assert!(!expected, "refused a valid request: {}", status.message());
                    prop_assert!(!status.message().is_empty());
                    refused.set(refused.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
    // Both outcomes are exercised.
    let (answered, refused) = (answered.get(), refused.get());
    assert!(
        answered > cases / 20 && refused > cases / 20,
        "{answered} answered, {refused} refused"
    );
}

#[test]
fn wire_requests_are_answered_or_invalid_under_small_limits() {
    decide_all(SMALL, 4000);
}

#[test]
fn wire_requests_are_answered_or_invalid_under_default_limits() {
    decide_all(RequestLimits::default(), 3000);
}

/// Nesting deeper than serde-saphyr's depth budget (64) is an error at a position, not a stack
/// overflow. Debug builds need about 3 MiB of stack to reach the budget (release fits in the
/// 2 MiB of a test or tokio thread), so this runs on a 4 MiB thread.
#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let nested_descriptors: String = (0..3000)
        .map(|i| format!("{0}- key: k\n{0}  descriptors:\n", "  ".repeat(i)))
        .collect();
    let nested_lists: String = (0..3000)
        .map(|i| format!("{}- \n", " ".repeat(i)))
        .collect();
    let texts = [
        format!("domain: d\ndescriptors:\n{nested_descriptors}"),
        format!("domain: d\ndescriptors:\n{nested_lists}"),
        format!("domain: d\ndescriptors: {}", "[".repeat(100_000)),
        format!("domain: d\ndescriptors: {}", "{a: ".repeat(50_000)),
    ];
    let checked = std::thread::Builder::new()
        .stack_size(4 << 20)
        .spawn(move || {
            texts.iter().all(|text| {
                let errors = config::load_str("deep.yaml", text).expect_err("too deep");
                errors
                    .iter()
                    .all(|e| e.line >= 1 && e.column >= 1 && !e.reason.is_empty())
            })
        })
        .expect("thread")
        .join()
        .expect("no panic");
    assert!(checked);
}
