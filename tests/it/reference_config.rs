//! The config read side by side with envoyproxy/ratelimit itself (f2fb157, the runnable build in
//! `../shared/peers/envoyproxy-ratelimit`): the same files, the same calls, the same limits and
//! metadata. Skipped, saying so, where that build is absent (a plain clone).

use crate::common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::process::Rlsd;
use common::{descriptor, request};
use rlsd::pb::{RateLimitResponse, RateLimitServiceClient};
use rlsd_testkit::redis::RedisServer;

/// The reference's start script, if the shared build is here: `../shared` beside the checkout
/// (or beside the directory of worktrees the checkout is in).
fn reference_script() -> Option<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = ["..", "../.."]
        .iter()
        .map(|up| {
            manifest
                .join(up)
                .join("shared/peers/envoyproxy-ratelimit/run.sh")
        })
        .find(|script| script.is_file() && script.with_file_name("bin/ratelimit").is_file());
    if script.is_none() {
        eprintln!("skipped: no envoyproxy/ratelimit build in ../shared/peers (a plain clone)");
    }
    script
}

/// A config directory: `config` in a temporary directory (whose own name starts with `.`, and
/// goruntime skipping dot names skips the whole root).
fn config_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("config");
    std::fs::create_dir(&config).expect("mkdir");
    (dir, config)
}

/// Loopback ports free at the time of asking (the reference needs them given; each listener is
/// held until all are chosen, so none is handed out twice).
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("addr").port())
}

/// The reference serving `config` against its own Redis; killed when dropped.
struct Reference {
    child: Child,
    grpc: SocketAddr,
    log: tempfile::NamedTempFile,
    _redis: RedisServer,
}

impl Reference {
    fn start(script: &Path, config: &Path, vars: &[&str]) -> Reference {
        let redis = RedisServer::start();
        let [grpc, http, debug] = free_ports::<3>();
        let log = tempfile::NamedTempFile::new().expect("a log file");
        let child = Command::new(script)
            .arg(config)
            .arg(format!("127.0.0.1:{}", redis.port))
            .args([grpc, http, debug].map(|port| port.to_string()))
            .args(["RESPONSE_DYNAMIC_METADATA=true", "LOG_LEVEL=debug"])
            .args(vars)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.reopen().expect("log")))
            .stderr(Stdio::from(log.reopen().expect("log")))
            .spawn()
            .expect("run the reference");
        let mut reference = Reference {
            child,
            grpc: SocketAddr::from(([127, 0, 0, 1], grpc)),
            log,
            _redis: redis,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(reference.grpc).is_err() {
            if let Ok(Some(status)) = reference.child.try_wait() {
                panic!("the reference exited ({status}):\n{}", reference.log());
            }
            assert!(
                Instant::now() < deadline,
                "the reference never listened:\n{}",
                reference.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        reference
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One `[key=value]` call to domain `domain` at `grpc`.
async fn ask(grpc: SocketAddr, domain: &str, key: &str, value: &str) -> RateLimitResponse {
    try_ask(grpc, domain, key, value).await.expect("an answer")
}

/// As [`ask`], keeping an error status.
async fn try_ask(
    grpc: SocketAddr,
    domain: &str,
    key: &str,
    value: &str,
) -> Result<RateLimitResponse, tonic::Status> {
    RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect")
        .should_rate_limit(request(domain, vec![descriptor(&[(key, value)])]))
        .await
        .map(tonic::Response::into_inner)
}

/// Asserts the reference refused its config: it answers every call with an error, having none.
async fn refused_by_reference(reference: &Reference, because: &str) {
    let answer = try_ask(reference.grpc, "any", "k", "v").await;
    assert!(
        answer.as_ref().is_err_and(|status| status
            .message()
            .contains("no rate limit configuration loaded")),
        "{answer:?}\n{}",
        reference.log()
    );
    assert!(reference.log().contains(because), "{}", reference.log());
}

/// What the config decided for a one-descriptor answer: the limit's count (`None`: no limit
/// applies) and the response's `metadata`, as JSON.
fn decided(response: &RateLimitResponse) -> (Option<u32>, serde_json::Value) {
    use prost_types::value::Kind;
    fn json(value: &prost_types::Value) -> serde_json::Value {
        match &value.kind {
            Some(Kind::NullValue(_)) | None => serde_json::Value::Null,
            Some(Kind::BoolValue(b)) => (*b).into(),
            Some(Kind::NumberValue(n)) => (*n).into(),
            Some(Kind::StringValue(s)) => s.clone().into(),
            Some(Kind::ListValue(list)) => list.values.iter().map(json).collect(),
            Some(Kind::StructValue(fields)) => fields
                .fields
                .iter()
                .map(|(key, value)| (key.clone(), json(value)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }
    let limit = response.statuses[0]
        .current_limit
        .as_ref()
        .map(|limit| limit.requests_per_unit);
    let metadata = response
        .dynamic_metadata
        .as_ref()
        .and_then(|metadata| metadata.fields.get("metadata"))
        .map_or(serde_json::Value::Null, json);
    (limit, metadata)
}

/// Asks both the same `(domain, key, value)` calls; asserts they decided the same, and that each
/// call found a limit where `limited` says.
async fn same_answers(reference: &Reference, rlsd: &Rlsd, calls: &[(&str, &str, &str, bool)]) {
    for (domain, key, value, limited) in calls {
        let theirs = decided(&ask(reference.grpc, domain, key, value).await);
        let ours = decided(&ask(rlsd.grpc, domain, key, value).await);
        assert_eq!(
            ours,
            theirs,
            "[{key}={value}] in {domain}:\n{}",
            reference.log()
        );
        assert_eq!(ours.0.is_some(), *limited, "[{key}={value}] in {domain}");
    }
}

const YAML_1_1: &str = "domain: d
descriptors:
  - key: k
    value: yes
    rate_limit: {unit: minute, requests_per_unit: 5}
    metadata:
      x: 1
      y: 2
      on: off
      s: 010
      f: 1e3
      n: {y: 1, 0x10: 2.5, ~: t, 1e6: a, 0.00001: c, 08: e, -0b11: f, Off: l, 2001-12-14: p}
      list: [y, 1_0, 0x1F, NULL, 'on']
  - key: o
    value: 010
    rate_limit: {unit: minute, requests_per_unit: 010}
  - key: b
    value: on
    shadow_mode: off
    rate_limit: {unit: minute, requests_per_unit: 0x2}
  - key: u
    value: 1_000
    rate_limit: {unit: MINUTE, requests_per_unit: 1_0}
  - key: q
    value: \"on\"
    rate_limit: {unit: minute, requests_per_unit: +7}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_1_1_scalars_mean_what_they_mean_to_the_reference() {
    let Some(script) = reference_script() else {
        return;
    };
    let (_dir, config) = config_dir();
    std::fs::write(config.join("d.yaml"), YAML_1_1).expect("write");
    let reference = Reference::start(&script, &config, &[]);
    let rlsd = Rlsd::serve([
        "--config".as_ref(),
        config.as_os_str(),
        "--response-dynamic-metadata".as_ref(),
    ]);
    same_answers(
        &reference,
        &rlsd,
        &[
            ("d", "k", "yes", true),
            ("d", "k", "true", false),
            ("d", "o", "010", true),
            ("d", "o", "8", false),
            ("d", "b", "on", true),
            ("d", "b", "true", false),
            ("d", "u", "1_000", true),
            ("d", "u", "1000", false),
            ("d", "q", "on", true),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_file_below_the_directory_and_a_configmap_load_as_in_the_reference() {
    let Some(script) = reference_script() else {
        return;
    };
    use std::os::unix::fs::symlink;
    let (_dir, root) = config_dir();
    let root = root.as_path();
    let limit = |domain: &str, count: u32| {
        format!(
            "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: {count}}}\n"
        )
    };
    // A ConfigMap of two keys, beside a subdirectory, a dot file and a file of any name.
    std::fs::create_dir(root.join("..2026_12_07_21_30_00.1")).expect("mkdir");
    std::fs::write(root.join("..2026_12_07_21_30_00.1/cm.conf"), limit("cm", 3)).expect("write");
    symlink("..2026_12_07_21_30_00.1", root.join("..data")).expect("symlink");
    symlink("..data/cm.conf", root.join("cm.conf")).expect("symlink");
    std::fs::create_dir_all(root.join("teams/a")).expect("mkdir");
    std::fs::write(root.join("teams/a/limits"), limit("team", 4)).expect("write");
    std::fs::write(root.join("plain.txt"), limit("plain", 5)).expect("write");
    std::fs::write(root.join(".hidden"), limit("hidden", 6)).expect("write");
    let calls = [
        ("cm", "k", "v", true),
        ("team", "k", "v", true),
        ("plain", "k", "v", true),
        ("hidden", "k", "v", false),
    ];
    let reference = Reference::start(&script, root, &["RUNTIME_IGNOREDOTFILES=true"]);
    let rlsd = Rlsd::serve(["--config".as_ref(), root.as_os_str()]);
    same_answers(&reference, &rlsd, &calls).await;
    drop(reference);

    // Dot names read: the reference reads the ConfigMap key twice and refuses the whole config
    // (serving none); rlsd reads it once, and the dot file too.
    std::fs::remove_file(root.join(".hidden")).expect("remove");
    let reference = Reference::start(&script, root, &["RUNTIME_IGNOREDOTFILES=false"]);
    refused_by_reference(&reference, "duplicate domain 'cm'").await;
    let rlsd = Rlsd::serve([
        "--config".as_ref(),
        root.as_os_str(),
        "--config-dotfiles".as_ref(),
    ]);
    for domain in ["cm", "team", "plain"] {
        assert!(
            decided(&ask(rlsd.grpc, domain, "k", "v").await).0.is_some(),
            "{domain}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_merged_from_files_answers_as_in_the_reference_and_a_clash_is_refused_by_both() {
    let Some(script) = reference_script() else {
        return;
    };
    let (_dir, config) = config_dir();
    std::fs::write(
        config.join("one.yaml"),
        "domain: m\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 3}\n  - key: w\n    value: x*\n    rate_limit: {unit: minute, requests_per_unit: 4}\n",
    )
    .expect("write");
    std::fs::write(
        config.as_path().join("two.yaml"),
        "domain: m\ndescriptors:\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: a\n    value: v\n    rate_limit: {unit: minute, requests_per_unit: 6}\n",
    )
    .expect("write");
    let reference = Reference::start(&script, config.as_path(), &["MERGE_DOMAIN_CONFIG=true"]);
    let rlsd = Rlsd::serve([
        "--config".as_ref(),
        config.as_path().as_os_str(),
        "--merge-domain-config".as_ref(),
    ]);
    same_answers(
        &reference,
        &rlsd,
        &[
            ("m", "a", "q", true),
            ("m", "a", "v", true),
            ("m", "b", "v", true),
            ("m", "w", "xy", true),
            ("m", "c", "v", false),
        ],
    )
    .await;
    drop((reference, rlsd));

    // A third file giving `w: x*` again: the reference refuses the config, rlsd too, by line.
    std::fs::write(
        config.as_path().join("three.yaml"),
        "domain: m\ndescriptors:\n  - key: w\n    value: x*\n",
    )
    .expect("write");
    let reference = Reference::start(&script, config.as_path(), &["MERGE_DOMAIN_CONFIG=true"]);
    refused_by_reference(&reference, "duplicate descriptor composite key 'm.w_x*'").await;
    let output = common::process::command()
        .args(["check", "--merge-domain-config", "--config"])
        .arg(config.as_path())
        .output()
        .expect("run");
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "three.yaml:4:12: duplicate descriptor composite key 'm.w_x*' (already defined in {})",
            config.as_path().join("one.yaml").display()
        )),
        "{stderr}"
    );
}
