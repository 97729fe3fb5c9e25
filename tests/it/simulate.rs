//! `rlsd simulate`: decisions equal the engine's, edge-burst bounds, the SVG, and the CLI.

use std::path::Path;
use std::process::Command;

use rlsd::clock::ManualClock;
use rlsd::config::{self, Config};
use rlsd::engine::{self, Decision, Descriptor, KeySettings, Request};
use rlsd::limit::Algorithm;
use rlsd::simulate::{self, Report, Scenario, Traffic, traffic};
use rlsd::store::{MemoryStore, Store, request_allowed};

const RLSD: &str = env!("CARGO_BIN_EXE_rlsd");
const THREE_LAYER: &str = "examples/three-layer.yaml";

/// The README picture's command line, after `rlsd simulate`.
const README_ARGS: [&str; 11] = [
    "--config",
    THREE_LAYER,
    "--domain",
    "edge-proxy",
    "--descriptor",
    "endpoint=search,api_key=k1",
    "--pattern",
    "edge:10+steady:0.2",
    "--duration",
    "180s",
    "--out",
];

fn config_of(yaml: &str) -> Config {
    let domain = config::load_str("test.yaml", yaml).expect("test config is valid");
    let mut loaded = Config::default();
    loaded.domains.insert(domain.name.clone(), domain);
    loaded
}

fn entries(text: &str) -> Vec<(String, String)> {
    simulate::parse_descriptor(text).expect("descriptor")
}

fn scenario(domain: &str, descriptor: &str, pattern: &str, duration_s: u64) -> Scenario {
    Scenario {
        domain: domain.to_owned(),
        entries: entries(descriptor),
        traffic: Traffic::Patterns {
            text: pattern.to_owned(),
            patterns: traffic::parse_patterns(pattern).expect("pattern"),
        },
        duration_us: Some(duration_s * 1_000_000),
        algorithms: Algorithm::ALL.to_vec(),
        seed: 42,
    }
}

/// What a client sees, computed here from the store's outcomes independently of the simulator.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    allowed: bool,
    retry_after_us: u64,
    remaining: u64,
}

/// Replays `times` straight through `engine::plan` and a `MemoryStore`, as the service would.
fn replay_directly(
    config: &Config,
    domain: &str,
    descriptor: &str,
    origin_us: u64,
    times: &[u64],
) -> Vec<Seen> {
    let request = Request {
        domain: domain.to_owned(),
        descriptors: vec![Descriptor {
            entries: entries(descriptor),
            ..Descriptor::default()
        }],
        hits_addend: 0,
    };
    let plan = engine::plan(config, &request, &KeySettings::default());
    assert!(matches!(plan.decisions[0], Decision::Checks(_)), "{plan:?}");
    let clock = ManualClock::at(origin_us);
    let store = MemoryStore::with_clock(1_000, clock.clone());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    times
        .iter()
        .map(|&t| {
            clock.set(origin_us + t);
            let outcomes = runtime
                .block_on(store.decide(&plan.checks))
                .expect("decide");
            let allowed = request_allowed(&plan.checks, &outcomes);
            Seen {
                allowed,
                retry_after_us: outcomes
                    .iter()
                    .filter(|outcome| !allowed && !outcome.verdict.allowed)
                    .map(|outcome| outcome.verdict.reset_us)
                    .max()
                    .unwrap_or(0),
                remaining: outcomes
                    .iter()
                    .map(|outcome| outcome.verdict.remaining)
                    .min()
                    .expect("one outcome"),
            }
        })
        .collect()
}

fn seen(report: &Report, run: usize) -> Vec<Seen> {
    report.runs[run]
        .answers
        .iter()
        .map(|answer| Seen {
            allowed: answer.allowed,
            retry_after_us: answer.retry_after_us,
            remaining: answer.remaining,
        })
        .collect()
}

/// The most allowed requests inside any `[s, s + window)`, by brute force.
fn brute_max_in_window(report: &Report, run: usize, window_us: u64) -> usize {
    let allowed: Vec<u64> = report
        .times_us
        .iter()
        .zip(&report.runs[run].answers)
        .filter(|(_, answer)| answer.allowed)
        .map(|(&t, _)| t)
        .collect();
    allowed
        .iter()
        .map(|&start| {
            allowed
                .iter()
                .filter(|&&t| t >= start && t - start < window_us)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn configured_algorithms_decide_exactly_as_the_engine_does() {
    // One limit per algorithm, with custom bursts and periods.
    let config = config::load_path(
        Path::new("examples/algorithms.yaml"),
        config::LoadOptions::default(),
    )
    .expect("example");
    for algorithm in Algorithm::ALL {
        let descriptor = format!("algorithm={},user=u1", algorithm.name());
        let mut scenario = scenario(
            "algorithms",
            &descriptor,
            "poisson:0.7+burst:25@30s+edge:12+steady:0.1",
            200,
        );
        scenario.algorithms = vec![algorithm];
        let report = simulate::simulate(&config, &scenario).expect("simulate");
        assert!(report.times_us.len() > 100, "{}", report.times_us.len());
        let direct = replay_directly(
            &config,
            "algorithms",
            &descriptor,
            report.origin_us,
            &report.times_us,
        );
        assert_eq!(seen(&report, 0), direct, "{algorithm}");
        let summary = report.runs[0].summary;
        assert!(summary.allowed > 0 && summary.denied > 0, "{summary:?}");
    }
}

#[test]
fn a_substituted_algorithm_decides_as_if_the_config_named_it() {
    let base = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n";
    let report = simulate::simulate(
        &config_of(base),
        &scenario("d", "k=v", "steady:0.3+burst:20@50s+edge:10", 180),
    )
    .expect("simulate");
    assert_eq!(report.runs.len(), Algorithm::ALL.len());
    for (index, algorithm) in Algorithm::ALL.into_iter().enumerate() {
        assert_eq!(report.runs[index].algorithm, algorithm);
        let named = config_of(&format!("{base}      algorithm: {}\n", algorithm.name()));
        let direct = replay_directly(&named, "d", "k=v", report.origin_us, &report.times_us);
        assert_eq!(seen(&report, index), direct, "{algorithm}");
    }
}

#[test]
fn every_limit_of_a_descriptor_is_enforced_together() {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limits:\n      - unit: minute\n        requests_per_unit: 20\n      - unit: second\n        requests_per_unit: 2\n";
    let config = config_of(yaml);
    let mut scenario = scenario("d", "k=v", "poisson:3", 120);
    scenario.algorithms = vec![Algorithm::FixedWindow];
    let report = simulate::simulate(&config, &scenario).expect("simulate");
    assert_eq!(report.limits.len(), 2);
    let direct = replay_directly(&config, "d", "k=v", report.origin_us, &report.times_us);
    assert_eq!(seen(&report, 0), direct);
    assert!(simulate::table(&report).contains("the descriptor has 2 limits"));
}

#[test]
fn edge_shows_the_fixed_window_admitting_2l_and_gcra_at_most_l_plus_b_minus_1() {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n      algorithm: gcra\n      burst: 3\n";
    let config = config_of(yaml);
    let (l, b) = (10, 3);
    let minute = 60_000_000;
    let report =
        simulate::simulate(&config, &scenario("d", "k=v", "edge:10", 120)).expect("simulate");
    let by_algorithm = |algorithm: Algorithm| {
        report
            .runs
            .iter()
            .position(|run| run.algorithm == algorithm)
            .expect("run")
    };
    let fixed = by_algorithm(Algorithm::FixedWindow);
    assert_eq!(report.runs[fixed].summary.max_in_window, 2 * l);
    assert_eq!(brute_max_in_window(&report, fixed, minute), 2 * l);
    assert_eq!(report.runs[fixed].summary.allowed, 2 * l);
    // The fixed window's 2L all happen within two seconds, straddling the window boundary.
    let log = by_algorithm(Algorithm::SlidingWindowLog);
    assert_eq!(report.runs[log].summary.max_in_window, l);

    // GCRA's bound holds for any traffic, not just the edge, and sustained traffic reaches it.
    let gcra_bound = l + b - 1;
    let mut gcra_most = 0;
    for pattern in [
        "edge:10",
        "edge:30",
        "burst:40@5s+steady:1",
        "poisson:2",
        "steady:0.5+edge:5",
    ] {
        let report =
            simulate::simulate(&config, &scenario("d", "k=v", pattern, 180)).expect("simulate");
        for (index, run) in report.runs.iter().enumerate() {
            let brute = brute_max_in_window(&report, index, minute);
            assert_eq!(
                run.summary.max_in_window, brute,
                "{pattern} {}",
                run.algorithm
            );
            match run.algorithm {
                Algorithm::Gcra => {
                    assert!(brute <= gcra_bound, "{pattern}: {brute}");
                    gcra_most = gcra_most.max(brute);
                }
                Algorithm::SlidingWindowLog => assert!(brute <= l, "{pattern}: {brute}"),
                Algorithm::FixedWindow => assert!(brute <= 2 * l, "{pattern}: {brute}"),
                _ => {}
            }
        }
    }
    assert_eq!(gcra_most, gcra_bound);
}

#[test]
fn longest_retry_after_is_the_largest_reset_of_a_denied_request() {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n";
    let mut scenario = scenario("d", "k=v", "burst:11@15s", 60);
    scenario.algorithms = vec![Algorithm::FixedWindow, Algorithm::Gcra];
    let report = simulate::simulate(&config_of(yaml), &scenario).expect("simulate");
    // Fixed window: the 11th waits until the window ends, 45 s later.
    assert_eq!(report.runs[0].summary.denied, 1);
    assert_eq!(report.runs[0].summary.longest_retry_after_us, 45_000_000);
    // GCRA, burst 1: the second request waits one emission interval (6 s), the 11th the same.
    assert_eq!(report.runs[1].summary.allowed, 1);
    assert_eq!(report.runs[1].summary.longest_retry_after_us, 6_000_000);
}

#[test]
fn setup_errors_are_clear() {
    let config =
        config::load_path(Path::new(THREE_LAYER), config::LoadOptions::default()).expect("example");
    let cases = [
        (
            "nope",
            "endpoint=search,api_key=k1",
            "edge:5",
            "unknown domain 'nope'",
        ),
        (
            "edge-proxy",
            "endpoint=upload,api_key=k1",
            "edge:5",
            "matches no limit in domain 'edge-proxy'",
        ),
        (
            "edge-proxy",
            "endpoint=search",
            "edge:5",
            "matches no limit",
        ),
    ];
    for (domain, descriptor, pattern, message) in cases {
        let error = simulate::simulate(&config, &scenario(domain, descriptor, pattern, 120))
            .expect_err("must fail")
            .0;
        assert!(error.contains(message), "{error}");
    }
    let unlimited =
        config_of("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n");
    let error = simulate::simulate(&unlimited, &scenario("d", "k=v", "edge:5", 120))
        .expect_err("must fail")
        .0;
    assert!(error.contains("is unlimited"), "{error}");
    // An hour limit has no window boundary in two minutes.
    let hourly = config_of(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: hour\n      requests_per_unit: 5\n",
    );
    let error = simulate::simulate(&hourly, &scenario("d", "k=v", "edge:5", 120))
        .expect_err("must fail")
        .0;
    assert!(error.contains("--duration 2h"), "{error}");
}

/// Checks that `xml` is well-formed: one prolog, one root, balanced tags, quoted attributes,
/// and no stray `<` or bad `&` in text or attribute values.
fn assert_well_formed(xml: &str) {
    fn check_text(text: &str, at: usize) {
        assert!(!text.contains('<'), "'<' in text at byte {at}");
        let mut rest = text;
        while let Some(amp) = rest.find('&') {
            let after = &rest[amp + 1..];
            let end = after
                .find(';')
                .unwrap_or_else(|| panic!("unterminated entity at byte {at}"));
            let name = &after[..end];
            let numeric = name
                .strip_prefix('#')
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
            assert!(
                numeric || ["amp", "lt", "gt", "quot", "apos"].contains(&name),
                "bad entity &{name}; at byte {at}"
            );
            rest = &after[end + 1..];
        }
    }
    fn is_name(name: &str) -> bool {
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.'))
            && !name.starts_with(|c: char| c.is_ascii_digit() || c == '-')
    }

    let body = xml
        .strip_prefix("<?xml ")
        .and_then(|rest| rest.split_once("?>"))
        .map(|(_, body)| body)
        .expect("XML declaration first");
    let offset = xml.len() - body.len();
    let mut stack: Vec<&str> = Vec::new();
    let mut roots = 0;
    let mut i = 0;
    while i < body.len() {
        let Some(open) = body[i..].find('<') else {
            assert!(body[i..].trim().is_empty(), "text after the root");
            break;
        };
        let text = &body[i..i + open];
        if stack.is_empty() {
            assert!(text.trim().is_empty(), "text outside the root: {text:?}");
        }
        check_text(text, offset + i);
        let start = i + open;
        if body[start..].starts_with("<!--") {
            let end = body[start..].find("-->").expect("comment closes");
            i = start + end + 3;
            continue;
        }
        let close = body[start..].find('>').expect("tag closes") + start;
        let tag = &body[start + 1..close];
        i = close + 1;
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack
                .pop()
                .unwrap_or_else(|| panic!("</{name}> with nothing open"));
            assert_eq!(open, name.trim(), "mismatched close tag");
            continue;
        }
        let (tag, self_closing) = match tag.strip_suffix('/') {
            Some(tag) => (tag, true),
            None => (tag, false),
        };
        let (name, mut attributes) = tag.split_once(char::is_whitespace).unwrap_or((tag, ""));
        assert!(is_name(name), "bad element name {name:?}");
        let mut seen_names = Vec::new();
        loop {
            attributes = attributes.trim_start();
            if attributes.is_empty() {
                break;
            }
            let (attribute, rest) = attributes
                .split_once('=')
                .unwrap_or_else(|| panic!("attribute without value in <{name}>"));
            let attribute = attribute.trim();
            assert!(is_name(attribute), "bad attribute name {attribute:?}");
            assert!(
                !seen_names.contains(&attribute),
                "duplicate attribute {attribute}"
            );
            seen_names.push(attribute);
            let rest = rest.trim_start();
            let quote = rest.chars().next().expect("attribute value");
            assert!(
                quote == '"' || quote == '\'',
                "unquoted attribute {attribute}"
            );
            let value_end = rest[1..]
                .find(quote)
                .unwrap_or_else(|| panic!("unterminated value of {attribute}"));
            check_text(&rest[1..1 + value_end], offset + start);
            attributes = &rest[value_end + 2..];
        }
        if stack.is_empty() {
            roots += 1;
        }
        if !self_closing {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed elements: {stack:?}");
    assert_eq!(roots, 1, "exactly one root element");
}

#[test]
fn the_checker_rejects_malformed_xml() {
    let good = r#"<?xml version="1.0"?><svg a="1"><g><text>a &amp; b</text></g><rect/></svg>"#;
    assert_well_formed(good);
    for bad in [
        r#"<?xml version="1.0"?><svg><g></svg>"#,
        r#"<?xml version="1.0"?><svg><text>a & b</text></svg>"#,
        r#"<?xml version="1.0"?><svg a=1></svg>"#,
        r#"<?xml version="1.0"?><svg a="<"></svg>"#,
        r#"<?xml version="1.0"?><svg></svg><svg></svg>"#,
        r#"<?xml version="1.0"?><svg a="1" a="2"></svg>"#,
        r#"<svg></svg>"#,
    ] {
        let result = std::panic::catch_unwind(|| assert_well_formed(bad));
        assert!(result.is_err(), "accepted {bad}");
    }
}

#[test]
fn the_picture_is_well_formed_svg_with_one_panel_per_algorithm() {
    let config =
        config::load_path(Path::new(THREE_LAYER), config::LoadOptions::default()).expect("example");
    // A value full of XML specials reaches the title through the wildcard `api_key`.
    let report = simulate::simulate(
        &config,
        &scenario(
            "edge-proxy",
            "endpoint=search,api_key=<k&1> \"'",
            "edge:10+poisson:0.3",
            120,
        ),
    )
    .expect("simulate");
    let svg = simulate::svg::render(&report);
    assert_well_formed(&svg);
    assert!(svg.contains("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.contains("api_key=&lt;k&amp;1&gt; &quot;&apos;"));
    assert_eq!(svg.matches("<g transform=").count(), Algorithm::ALL.len());
    for algorithm in Algorithm::ALL {
        assert!(
            svg.contains(&format!(">{}", algorithm.name())),
            "{algorithm}"
        );
    }
    assert!(svg.contains("L = 10"));
    assert!(
        svg.contains("peak 20"),
        "the fixed window's edge burst is marked"
    );

    // Tiny, long and empty-ish simulations render too.
    for (pattern, duration) in [("burst:1@0s", 1), ("steady:0.001", 3_000)] {
        let report = simulate::simulate(
            &config,
            &scenario(
                "edge-proxy",
                "endpoint=search,api_key=k1",
                pattern,
                duration,
            ),
        )
        .expect("simulate");
        assert_well_formed(&simulate::svg::render(&report));
    }
}

#[test]
fn the_cli_runs_end_to_end_and_writes_the_picture() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("search.svg");
    let output = Command::new(RLSD)
        .arg("simulate")
        .args(README_ARGS)
        .arg(&out)
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("rlsd simulate: edge-proxy endpoint=search,api_key=k1"));
    assert!(stdout.contains("limit:   10 per minute (fixed_window) name \"endpoint-search\""));
    assert!(stdout.contains("longest retry-after"), "{stdout}");
    for algorithm in Algorithm::ALL {
        assert!(
            stdout
                .lines()
                .any(|line| line.starts_with(algorithm.name())),
            "{stdout}"
        );
    }
    let svg = std::fs::read_to_string(&out).expect("picture written");
    assert_well_formed(&svg);

    // A trace file, with a header, replays the same way; --algorithms picks panels.
    let trace = dir.path().join("trace.csv");
    std::fs::write(
        &trace,
        "timestamp\n0\n0.5\n1\n1500ms\n2\n2.5\n3\n3.5\n4\n4.5\n5\n5.5\n",
    )
    .expect("write");
    let out = dir.path().join("trace.svg");
    let output = Command::new(RLSD)
        .args([
            "simulate",
            "--config",
            THREE_LAYER,
            "--domain",
            "edge-proxy",
        ])
        .args(["--descriptor", "endpoint=search,api_key=k1", "--traffic"])
        .arg(&trace)
        .args(["--algorithms", "fixed_window,gcra", "--out"])
        .arg(&out)
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("12 requests in 6s"), "{stdout}");
    let fixed = stdout
        .lines()
        .find(|line| line.starts_with("fixed_window"))
        .expect("fixed window row");
    assert_eq!(
        fixed.split_whitespace().take(4).collect::<Vec<_>>(),
        ["fixed_window", "*", "10", "2"],
        "{stdout}"
    );
    assert!(!stdout.contains("sliding_window_log"), "{stdout}");
    let svg = std::fs::read_to_string(&out).expect("picture written");
    assert_well_formed(&svg);
    assert_eq!(svg.matches("<g transform=").count(), 2);
}

#[test]
fn bad_input_exits_1_with_a_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("x.svg");
    let bad_trace = dir.path().join("bad.csv");
    std::fs::write(&bad_trace, "ts\n0.5\n1.0\nlater\n").expect("write");
    let unlimited = dir.path().join("unlimited.yaml");
    std::fs::write(
        &unlimited,
        "domain: u\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n",
    )
    .expect("write");
    let search = ["--descriptor", "endpoint=search,api_key=k1"];
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            args(&["--domain", "nope"], &search, &["--pattern", "edge:5"]),
            "unknown domain 'nope'",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &["--descriptor", "endpoint=upload,api_key=k1"],
                &["--pattern", "edge:5"],
            ),
            "matches no limit",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &search,
                &["--pattern", "wave:5"],
            ),
            "unknown pattern 'wave'",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &search,
                &["--pattern", "burst:5@3m"],
            ),
            "pass a longer --duration",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &search,
                &["--pattern", "steady:1", "--duration", "2 minutes"],
            ),
            "is not a duration",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &search,
                &["--pattern", "steady:1", "--algorithms", "leaky_bucket"],
            ),
            "unknown algorithm 'leaky_bucket'",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &["--descriptor", "endpoint"],
                &["--pattern", "steady:1"],
            ),
            "is not key=value",
        ),
        (
            args(
                &["--domain", "edge-proxy"],
                &search,
                &["--traffic", &bad_trace.display().to_string()],
            ),
            "bad.csv:4: 'later' is not a timestamp",
        ),
    ];
    for (case, message) in cases {
        let output = Command::new(RLSD)
            .args(["simulate", "--config", THREE_LAYER])
            .args(&case)
            .arg("--out")
            .arg(&out)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{case:?}: {stderr}");
        assert!(stderr.contains(message), "{case:?}: {stderr}");
        assert!(!out.exists(), "no picture on error");
    }
    let output = Command::new(RLSD)
        .args(["simulate", "--config"])
        .arg(&unlimited)
        .args([
            "--domain",
            "u",
            "--descriptor",
            "k=v",
            "--pattern",
            "steady:1",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("is unlimited"));
}

fn args(a: &[&str], b: &[&str], c: &[&str]) -> Vec<String> {
    a.iter()
        .chain(b)
        .chain(c)
        .map(|s| (*s).to_owned())
        .collect()
}

#[test]
fn the_committed_readme_picture_is_current() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("search.svg");
    let status = Command::new(RLSD)
        .arg("simulate")
        .args(README_ARGS)
        .arg(&out)
        .output()
        .expect("run")
        .status;
    assert!(status.success());
    let fresh = std::fs::read_to_string(&out).expect("picture");
    let committed = std::fs::read_to_string("docs/simulate-search.svg").expect("docs picture");
    assert!(
        fresh == committed,
        "docs/simulate-search.svg is stale; regenerate it with: cargo run -- simulate {} docs/simulate-search.svg",
        README_ARGS.join(" ")
    );
}
