//! The `rlsd` binary: `check`, and `serve` refusing bad configs and stopping on SIGTERM.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

const RLSD: &str = env!("CARGO_BIN_EXE_rlsd");

#[test]
fn check_prints_the_limits_of_the_examples() {
    let output = Command::new(RLSD)
        .args(["check", "--config", "examples"])
        .output()
        .expect("run");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("edge-proxy.plan_pro.api_key: 600 per minute (fixed_window)"),
        "{stdout}"
    );
    assert!(stdout.contains("(gcra) burst 3"), "{stdout}");
    assert!(stdout.contains("2 domain(s) OK"), "{stdout}");
}

#[test]
fn check_reports_every_error_with_file_and_line_and_exits_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        "domain: bad\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n  - key: b\n    colour: red\n",
    )
    .expect("write");
    let output = Command::new(RLSD)
        .arg("check")
        .env("RLSD_CONFIG", &file)
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad.yaml:5:"), "{stderr}");
    assert!(
        stderr.contains("invalid rate limit unit 'fortnight'"),
        "{stderr}"
    );
    assert!(stderr.contains("bad.yaml:8:"), "{stderr}");
    assert!(stderr.contains("unknown key 'colour'"), "{stderr}");
}

#[cfg(unix)]
#[test]
fn check_reads_every_file_below_warns_about_symlinked_directories_and_fails_without_domains() {
    // A directory written for envoyproxy/ratelimit, which reads every file below it, any name.
    let dir = tempfile::tempdir().expect("tempdir");
    let elsewhere = tempfile::tempdir().expect("tempdir");
    std::fs::write(elsewhere.path().join("x.yaml"), "domain: elsewhere\n").expect("write");
    std::fs::create_dir(dir.path().join("team-a")).expect("mkdir");
    std::os::unix::fs::symlink(elsewhere.path(), dir.path().join("shared")).expect("symlink");
    let check = |extra: &[&str]| {
        Command::new(RLSD)
            .arg("check")
            .arg("--config")
            .arg(dir.path())
            .args(extra)
            .output()
            .expect("run")
    };
    let output = check(&[]);
    // A reload would refuse this directory, so the check fails it.
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "not read, as symlinks to directories are not followed and only files are config: {}",
            dir.path().join("shared").display()
        )) && stderr.contains(&format!("path={}", dir.path().display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("no config file (a file with a 'domain:')"),
        "{stderr}"
    );

    // Any name, any depth; a dot name only with --config-dotfiles.
    std::fs::write(dir.path().join("limits.conf"), "domain: edge\n").expect("write");
    std::fs::write(dir.path().join("team-a/routes"), "domain: routes\n").expect("write");
    std::fs::write(dir.path().join(".draft"), "domain: draft\n").expect("write");
    let output = check(&[]);
    assert!(output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("2 domain(s) OK"),
        "{output:?}"
    );
    let output = check(&["--config-dotfiles"]);
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("3 domain(s) OK"),
        "{output:?}"
    );
    // One domain in two files: refused, unless merged.
    std::fs::write(dir.path().join("team-a/more"), "domain: routes\n").expect("write");
    let output = check(&[]);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("duplicate domain 'routes'"),
        "{output:?}"
    );
    let output = check(&["--merge-domain-config"]);
    assert!(output.status.success(), "{output:?}");
}

/// Runs `rlsd serve` with `args` on loopback ports; asserts that it exits with an error without
/// ever trying to bind, and returns what it printed to stderr.
fn serve_refused(args: &[&std::ffi::OsStr]) -> String {
    // Held while rlsd runs: had it tried to bind, it would have failed saying so.
    let taken = TcpListener::bind("127.0.0.1:0").expect("a port");
    let grpc = taken.local_addr().expect("address").port();
    let output = Command::new(RLSD)
        .arg("serve")
        .args(args)
        .args([
            "--grpc-addr",
            &format!("127.0.0.1:{grpc}"),
            "--http-addr",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run");
    assert!(!output.status.success(), "{args:?}");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !stderr.contains("binding"),
        "{args:?}: tried to bind: {stderr}"
    );
    drop(taken);
    stderr
}

#[test]
fn serve_refuses_an_invalid_config_before_binding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "domain: ''\ndescriptors: []\n").expect("write");
    let stderr = serve_refused(&["--config".as_ref(), file.as_os_str()]);
    assert!(stderr.contains("invalid config"), "{stderr}");
    assert!(
        stderr.contains("config file cannot have empty domain"),
        "{stderr}"
    );
}

#[test]
fn serve_refuses_a_near_limit_ratio_outside_0_to_1() {
    for ratio in ["NaN", "-0.1", "1.5"] {
        let flag = format!("--near-limit-ratio={ratio}");
        let stderr = serve_refused(&[
            "--config".as_ref(),
            "examples/three-layer.yaml".as_ref(),
            flag.as_ref(),
        ]);
        assert!(stderr.contains("must be from 0 to 1"), "{ratio}: {stderr}");
    }
}

/// `--redis-ca` is refused where it would not apply (Sentinel), instead of leaving those
/// connections on the public roots; for Cluster it is read, and a file without a certificate is
/// an error that names it.
#[test]
fn serve_refuses_a_redis_ca_it_cannot_apply_or_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, "not a certificate").expect("write");
    let args = |mode: &'static str| {
        [
            "--config".as_ref(),
            "examples/three-layer.yaml".as_ref(),
            "--redis-url".as_ref(),
            "rediss://127.0.0.1:1".as_ref(),
            "--redis-mode".as_ref(),
            std::ffi::OsStr::new(mode),
            "--redis-ca".as_ref(),
            ca.as_os_str(),
        ]
    };
    let stderr = serve_refused(&args("sentinel"));
    assert!(
        stderr.contains("--redis-ca applies to --redis-mode single and cluster"),
        "{stderr}"
    );
    // The cluster store reads the CA when it connects, after the ports are bound.
    let output = Command::new(RLSD)
        .arg("serve")
        .args(args("cluster"))
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let expected = format!("redis CA {}: no PEM certificate", ca.display());
    assert!(stderr.contains(&expected), "{stderr}");
}

fn http_get(address: SocketAddr, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(address).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

use crate::common::process;
use rlsd_testkit::redis::RedisServer;

use process::Rlsd;

#[test]
fn serve_answers_health_and_stops_cleanly_on_sigterm() {
    let mut rlsd = Rlsd::serve(["--config", "examples/three-layer.yaml"]);
    let health = http_get(rlsd.http, "/healthcheck").expect("healthcheck");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.ends_with("OK"), "{health}");
    let rlconfig = http_get(rlsd.http, "/rlconfig").expect("rlconfig");
    assert!(
        rlconfig.contains("edge-proxy.remote_address: 1000 per minute"),
        "{rlconfig}"
    );
    assert!(TcpStream::connect(rlsd.grpc).is_ok(), "grpc port is open");

    let status = rlsd.terminate(Duration::from_secs(10));
    assert!(status.success(), "exit status {status:?}");
    let log = rlsd.log();
    assert!(log.contains("SIGTERM received"), "{log}");
}

/// `THP_enabled` of a process's /proc status ("self" for this one): "0" once it has turned
/// transparent huge pages off, or inherited that from its parent; `None` on a kernel without it.
fn thp_enabled(pid: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("THP_enabled:"))
        .map(|value| value.trim().to_owned())
}

#[test]
fn serve_turns_transparent_huge_pages_off_unless_asked_to_keep_them() {
    // rlsd inherits this process's setting; where it is already off there is nothing to see.
    let own = thp_enabled("self");
    if own.as_deref() != Some("1") {
        eprintln!("skipped: this process's THP_enabled is {own:?}");
        return;
    }
    let mut rlsd = Rlsd::serve(["--config", "examples/three-layer.yaml"]);
    assert_eq!(thp_enabled(&rlsd.id().to_string()).as_deref(), Some("0"));
    assert!(rlsd.terminate(Duration::from_secs(10)).success());

    let mut rlsd = Rlsd::serve([
        "--config",
        "examples/three-layer.yaml",
        "--transparent-huge-pages",
    ]);
    assert_eq!(thp_enabled(&rlsd.id().to_string()), own);
    assert!(rlsd.terminate(Duration::from_secs(10)).success());
}

#[test]
fn serve_with_redis_url_loads_the_script_at_start() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut rlsd = Rlsd::serve([
        "--config",
        "examples/three-layer.yaml",
        "--redis-url",
        &url,
        "--key-prefix",
        "cli-test",
    ]);
    // The script was loaded at start.
    let sha_loaded = redis
        .cli(&["SCRIPT", "EXISTS", &script_sha()])
        .expect("script exists");
    assert_eq!(sha_loaded, "1");
    let status = rlsd.terminate(Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    let log = rlsd.log();
    assert!(log.contains("store=\"redis\""), "{log}");
}

fn script_sha() -> String {
    // redis-cli computes nothing for us; ask a scratch redis for the SHA of the embedded script.
    let scratch = RedisServer::start();
    scratch
        .cli(&["SCRIPT", "LOAD", include_str!("../../lua/ratelimit.lua")])
        .expect("load")
}

#[test]
fn json_logs_are_one_object_per_line_and_report_the_worker_threads() {
    let mut rlsd = Rlsd::serve([
        "--config",
        "examples/three-layer.yaml",
        "--log-format",
        "json",
        "--worker-threads",
        "3",
    ]);
    // Each serving thread is a lane of its own (in process, as here). The lanes start just after
    // the "serving" line, so count until three appear or the deadline passes.
    let count_lanes = || {
        std::fs::read_dir(format!("/proc/{}/task", rlsd.id()))
            .expect("the process's threads")
            .flatten()
            .filter(|task| {
                std::fs::read_to_string(task.path().join("comm"))
                    .is_ok_and(|name| name.starts_with("rlsd-lane-"))
            })
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut lanes = count_lanes();
    while lanes < 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        lanes = count_lanes();
    }
    assert!(rlsd.terminate(Duration::from_secs(10)).success());
    assert_eq!(lanes, 3, "threads named rlsd-lane-*");
    let stderr = rlsd.log();
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?} is not JSON: {e}"))
        })
        .collect();
    let serving = lines
        .iter()
        .find(|l| l["fields"]["message"] == "serving")
        .unwrap_or_else(|| panic!("no serving line: {stderr}"));
    assert_eq!(serving["fields"]["threads"], 3, "{stderr}");
    assert_eq!(serving["fields"]["lanes"], 3, "{stderr}");
    assert!(lines.iter().all(|l| l["level"].is_string()), "{stderr}");
}

#[test]
fn serve_help_names_the_secret_variables_without_their_values() {
    let output = crate::common::process::command()
        .args(["serve", "--help"])
        .env(
            "RLSD_REDIS_URL",
            "redis://default:s3cret-password@redis:6379",
        )
        .env("RLSD_XDS_HEADERS", "authorization:Bearer s3cret-token")
        .env("RLSD_KEY_PREFIX", "shown-prefix")
        .output()
        .expect("run");
    assert!(output.status.success(), "{output:?}");
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(!help.contains("s3cret"), "{help}");
    for variable in ["RLSD_REDIS_URL", "RLSD_XDS_HEADERS"] {
        assert!(help.contains(&format!("[env: {variable}]")), "{help}");
    }
    // Other variables keep showing what they are set to.
    assert!(
        help.contains("[env: RLSD_KEY_PREFIX=shown-prefix]"),
        "{help}"
    );
}

#[test]
fn a_malformed_secret_flag_is_refused_without_repeating_it() {
    let output = crate::common::process::command()
        .args(["serve", "--config-xds", "127.0.0.1:1"])
        .env("RLSD_XDS_HEADERS", "authorization Bearer s3cret-token")
        .output()
        .expect("run");
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("s3cret"), "{stderr}");
    assert!(stderr.contains("--xds-headers"), "{stderr}");
}

#[test]
fn a_sentinel_redis_url_refused_as_ratelimit_reads_it_is_not_repeated() {
    // envoyproxy/ratelimit's REDIS_URL for Sentinel is `<master>,<sentinel>...`; a lone URL with
    // a password in it is refused, and the refusal is logged.
    let refused = rlsd::ratelimit_env::serve_flags(|name| match name {
        "REDIS_TYPE" => Some("SENTINEL".to_owned()),
        "REDIS_URL" => Some("redis://:s3cret-password@sentinel:26379".to_owned()),
        _ => None,
    })
    .expect_err("no master name");
    let message = refused.to_string();
    assert!(message.starts_with("REDIS_URL="), "{message}");
    assert!(!message.contains("s3cret"), "{message}");
}
