//! Hot reload of the real binary: file changes, SIGHUP, a Kubernetes `..data` symlink swap, and
//! a broken edit or an emptied directory that must change nothing.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::process::Rlsd;
use common::{descriptor, http_get, request};
use rlsd::pb::RateLimitServiceClient;
use rlsd::pb::rate_limit_response::Code;
use tonic::transport::Channel;

fn config(limit: u32) -> String {
    format!(
        "domain: live\ndescriptors:\n  - key: user\n    rate_limit: {{unit: day, requests_per_unit: {limit}}}\n"
    )
}

/// rlsd serving a config with the given extra flags.
struct Running(Rlsd);

impl Running {
    async fn start(config_path: &Path, extra: &[&str]) -> Running {
        let config = config_path.as_os_str();
        let args = ["--config".as_ref(), config]
            .into_iter()
            .chain(extra.iter().map(|arg| arg.as_ref()));
        Running(Rlsd::serve(args.collect::<Vec<&std::ffi::OsStr>>()))
    }

    async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.0.grpc))
            .await
            .expect("connect")
    }

    async fn remaining(&self, user: &str) -> u32 {
        let response = self
            .client()
            .await
            .should_rate_limit(request("live", vec![descriptor(&[("user", user)])]))
            .await
            .expect("answer")
            .into_inner();
        response.statuses[0].limit_remaining
    }

    async fn code(&self, user: &str) -> Code {
        let response = self
            .client()
            .await
            .should_rate_limit(request("live", vec![descriptor(&[("user", user)])]))
            .await
            .expect("answer")
            .into_inner();
        Code::try_from(response.overall_code).expect("a known code")
    }

    async fn rlconfig(&self) -> String {
        http_get(self.0.http, "/rlconfig").await.1
    }

    async fn wait_for_config(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !self.rlconfig().await.contains(needle) {
            assert!(Instant::now() < deadline, "config never showed {needle:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn metric(&self, name: &str) -> f64 {
        let (_, body) = http_get(self.0.http, "/metrics").await;
        body.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    fn log(&self) -> String {
        self.0.log()
    }

    fn signal(&self, signal: &str) {
        self.0.signal(signal);
    }
}

/// Replaces `file` the way editors and `kubectl cp` do, by renaming a finished copy over it: a
/// plain `fs::write` truncates first, and a reload that reads the empty file in between rightly
/// rejects it, which made this test's error count and log racy.
fn replace(file: &std::path::Path, text: &str) {
    let staged = file.with_extension("staged");
    std::fs::write(&staged, text).expect("write");
    std::fs::rename(&staged, file).expect("rename");
}

#[tokio::test]
async fn a_changed_file_reloads_without_restart_and_counters_survive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("live.yaml");
    std::fs::write(&file, config(3)).expect("write");
    let rlsd = Running::start(dir.path(), &["--reload-interval-ms", "100"]).await;
    assert_eq!(rlsd.remaining("ann").await, 2);
    assert_eq!(rlsd.remaining("ann").await, 1);

    replace(&file, &config(5));
    rlsd.wait_for_config("live.user: 5 per day").await;
    // Raised mid-window, the new limit applies to the current window: 3 used of 5.
    assert_eq!(rlsd.remaining("ann").await, 2);
    assert_eq!(
        rlsd.metric("ratelimit_service_config_load_success").await,
        2.0
    );

    // A broken edit is rejected, counted, and changes nothing.
    replace(
        &file,
        "domain: live\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight}\n",
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while rlsd.metric("ratelimit_service_config_load_error").await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the broken file was never looked at"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rlsd.rlconfig().await.contains("live.user: 5 per day"));
    assert_eq!(rlsd.remaining("ann").await, 1);
    let log = rlsd.log();
    assert!(log.contains("config reload rejected"), "{log}");
    assert!(
        log.contains("live.yaml:4:"),
        "the log names file and line: {log}"
    );
    assert!(log.contains("invalid rate limit unit 'fortnight'"), "{log}");
}

#[tokio::test]
async fn sighup_reloads_when_polling_is_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("live.yaml");
    std::fs::write(&file, config(3)).expect("write");
    let rlsd = Running::start(&file, &["--reload-interval-ms", "0"]).await;
    std::fs::write(&file, config(7)).expect("write");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rlsd.rlconfig().await.contains("3 per day"),
        "no reload without SIGHUP"
    );
    rlsd.signal("-HUP");
    rlsd.wait_for_config("live.user: 7 per day").await;
}

#[cfg(unix)]
#[tokio::test]
async fn a_kubernetes_configmap_symlink_swap_is_seen() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    std::fs::create_dir(root.join("..2026_12_02_v1")).expect("mkdir");
    std::fs::write(root.join("..2026_12_02_v1/live.yaml"), config(3)).expect("write");
    symlink("..2026_12_02_v1", root.join("..data")).expect("symlink");
    symlink("..data/live.yaml", root.join("live.yaml")).expect("symlink");
    let rlsd = Running::start(root, &["--reload-interval-ms", "100"]).await;
    assert!(rlsd.rlconfig().await.contains("3 per day"));

    // What the kubelet does: write a new version, then atomically replace `..data`.
    std::fs::create_dir(root.join("..2026_12_02_v2")).expect("mkdir");
    std::fs::write(root.join("..2026_12_02_v2/live.yaml"), config(9)).expect("write");
    symlink("..2026_12_02_v2", root.join("..data_tmp")).expect("symlink");
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap");
    std::fs::remove_dir_all(root.join("..2026_12_02_v1")).expect("cleanup");
    rlsd.wait_for_config("live.user: 9 per day").await;
}

#[tokio::test]
async fn an_emptied_config_directory_keeps_the_last_config_enforced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("live.yaml");
    std::fs::write(&file, config(2)).expect("write");
    let rlsd = Running::start(dir.path(), &["--reload-interval-ms", "100"]).await;
    assert_eq!(rlsd.remaining("ann").await, 1);
    assert_eq!(rlsd.remaining("ann").await, 0);
    assert_eq!(rlsd.code("ann").await, Code::OverLimit);

    // The ConfigMap remounted empty, a deploy that lost its files.
    std::fs::remove_file(&file).expect("remove");
    let deadline = Instant::now() + Duration::from_secs(15);
    // Refused and counted now; swapped in, the limit would leave /rlconfig.
    while rlsd.metric("ratelimit_service_config_load_error").await < 1.0
        && rlsd.rlconfig().await.contains("live.user")
    {
        assert!(
            Instant::now() < deadline,
            "the empty directory was never looked at"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A few more reload intervals: the empty directory is refused once, and stays refused.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(rlsd.code("ann").await, Code::OverLimit);
    assert!(rlsd.rlconfig().await.contains("live.user: 2 per day"));
    assert_eq!(
        rlsd.metric("ratelimit_service_config_load_error").await,
        1.0
    );
    assert_eq!(
        rlsd.metric("ratelimit_service_config_load_success").await,
        1.0
    );
    let log = rlsd.log();
    let line = log
        .lines()
        .find(|line| line.contains("config reload rejected"))
        .unwrap_or_else(|| panic!("no rejection logged: {log}"));
    assert!(line.contains("ERROR"), "logged as an error: {line}");
    assert!(log.contains("no config file"), "{log}");

    // Files back: the reload takes them as usual.
    replace(&file, &config(5));
    rlsd.wait_for_config("live.user: 5 per day").await;
    assert_eq!(rlsd.code("ann").await, Code::Ok);
}

#[tokio::test]
async fn a_domain_without_descriptors_lifts_the_limits_on_purpose() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("live.yaml");
    std::fs::write(&file, config(1)).expect("write");
    let rlsd = Running::start(dir.path(), &["--reload-interval-ms", "100"]).await;
    assert_eq!(rlsd.remaining("ann").await, 0);
    assert_eq!(rlsd.code("ann").await, Code::OverLimit);

    replace(&file, "domain: live\n");
    let deadline = Instant::now() + Duration::from_secs(15);
    while rlsd.rlconfig().await.contains("live.user") {
        assert!(Instant::now() < deadline, "the edit was never loaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rlsd.code("ann").await, Code::Ok);
    assert_eq!(
        rlsd.metric("ratelimit_service_config_load_error").await,
        0.0
    );
}

#[tokio::test]
async fn a_start_with_an_empty_directory_serves_without_limits_and_counts_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rlsd = Running::start(dir.path(), &["--reload-interval-ms", "100"]).await;
    // As envoyproxy/ratelimit, rlsd starts; it has no earlier config to keep.
    assert_eq!(rlsd.code("ann").await, Code::Ok);
    assert_eq!(
        rlsd.metric("ratelimit_service_config_load_error").await,
        1.0
    );
    assert_eq!(
        rlsd.metric("ratelimit_service_config_load_success").await,
        0.0
    );
    let log = rlsd.log();
    let line = log
        .lines()
        .find(|line| line.contains("no config file"))
        .unwrap_or_else(|| panic!("the empty directory is not logged: {log}"));
    assert!(line.contains("ERROR"), "logged as an error: {line}");

    replace(&dir.path().join("live.yaml"), &config(3));
    rlsd.wait_for_config("live.user: 3 per day").await;
    assert_eq!(rlsd.remaining("ann").await, 2);
}
