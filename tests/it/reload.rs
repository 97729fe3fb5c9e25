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
/// rejects it, which made this test's error count and log racy. The copy has a dot name, which
/// is not read: every other file below the directory is.
fn replace(file: &std::path::Path, text: &str) {
    let name = file.file_name().expect("a file name").to_string_lossy();
    let staged = file.with_file_name(format!(".{name}.staged"));
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

/// Writes version `stamp` of a ConfigMap volume the way the kubelet's atomic writer does: the
/// files into a new timestamped dot directory, a symlink to it renamed over `..data`, a
/// top-level symlink into `..data` per key, and only then the old version removed.
#[cfg(unix)]
fn configmap_version(root: &Path, stamp: &str, files: &[(&str, String)], old: Option<&str>) {
    use std::os::unix::fs::symlink;
    std::fs::create_dir(root.join(stamp)).expect("mkdir");
    for (name, text) in files {
        std::fs::write(root.join(stamp).join(name), text).expect("write");
    }
    symlink(stamp, root.join("..data_tmp")).expect("symlink");
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap");
    for (name, _) in files {
        if std::fs::symlink_metadata(root.join(name)).is_err() {
            symlink(format!("..data/{name}"), root.join(name)).expect("symlink");
        }
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(root.join(old)).expect("cleanup");
    }
}

#[cfg(unix)]
#[tokio::test]
async fn a_kubernetes_configmap_loads_each_file_once_and_its_update_is_seen() {
    // The keys need no .yaml name; each file loads once whether dot names are read
    // (RUNTIME_IGNOREDOTFILES=false, where envoyproxy/ratelimit loads each twice and refuses
    // the duplicate domain) or not.
    let other = |limit: u32| {
        format!(
            "domain: other\ndescriptors: [{{key: k, rate_limit: {{unit: day, requests_per_unit: {limit}}}}}]\n"
        )
    };
    for dotfiles in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let v1 = [("live.yaml", config(3)), ("other.conf", other(4))];
        configmap_version(root, "..2026_12_07_21_00_00.1", &v1, None);
        let flags: &[&str] = if dotfiles {
            &["--reload-interval-ms", "100", "--config-dotfiles"]
        } else {
            &["--reload-interval-ms", "100"]
        };
        let rlsd = Running::start(root, flags).await;
        let limits = rlsd.rlconfig().await;
        assert!(limits.contains("live.user: 3 per day"), "{limits}");
        assert!(limits.contains("other.k: 4 per day"), "{limits}");
        assert_eq!(rlsd.remaining("ann").await, 2);

        let v2 = [("live.yaml", config(9)), ("other.conf", other(5))];
        configmap_version(
            root,
            "..2026_12_07_21_05_00.2",
            &v2,
            Some("..2026_12_07_21_00_00.1"),
        );
        rlsd.wait_for_config("live.user: 9 per day").await;
        let limits = rlsd.rlconfig().await;
        assert!(limits.contains("other.k: 5 per day"), "{limits}");
        // The counter carried over, and no version was ever refused (no file read twice).
        assert_eq!(rlsd.remaining("ann").await, 7, "dotfiles {dotfiles}");
        assert_eq!(
            rlsd.metric("ratelimit_service_config_load_error").await,
            0.0,
            "dotfiles {dotfiles}: {}",
            rlsd.log()
        );
        assert_eq!(
            rlsd.metric("ratelimit_service_config_load_success").await,
            2.0,
            "dotfiles {dotfiles}"
        );
    }
}

#[tokio::test]
async fn a_file_in_a_subdirectory_is_read_and_reloaded() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("teams")).expect("mkdir");
    let file = dir.path().join("teams").join("live");
    std::fs::write(&file, config(3)).expect("write");
    let rlsd = Running::start(dir.path(), &["--reload-interval-ms", "100"]).await;
    assert_eq!(rlsd.remaining("ann").await, 2);
    replace(&file, &config(6));
    rlsd.wait_for_config("live.user: 6 per day").await;
    assert_eq!(rlsd.remaining("ann").await, 4);
}

#[tokio::test]
async fn merged_domain_files_reload_together_and_a_clash_is_refused_by_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let extra = |key: &str, limit: u32| {
        format!(
            "domain: live\ndescriptors:\n  - key: {key}\n    rate_limit: {{unit: day, requests_per_unit: {limit}}}\n"
        )
    };
    std::fs::write(dir.path().join("live.yaml"), config(3)).expect("write");
    let second = dir.path().join("team.yaml");
    std::fs::write(&second, extra("team", 4)).expect("write");
    let rlsd = Running::start(
        dir.path(),
        &["--reload-interval-ms", "100", "--merge-domain-config"],
    )
    .await;
    let limits = rlsd.rlconfig().await;
    assert!(limits.contains("live.user: 3 per day"), "{limits}");
    assert!(limits.contains("live.team: 4 per day"), "{limits}");
    assert_eq!(rlsd.remaining("ann").await, 2);

    replace(&second, &extra("team", 8));
    rlsd.wait_for_config("live.team: 8 per day").await;

    // The second file now gives `user` too: refused, naming the file, its line and the first.
    replace(&second, &extra("user", 1));
    let deadline = Instant::now() + Duration::from_secs(15);
    while rlsd.metric("ratelimit_service_config_load_error").await < 1.0 {
        assert!(Instant::now() < deadline, "the clash was never looked at");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        rlsd.remaining("ann").await,
        1,
        "the last config still counts"
    );
    let log = rlsd.log();
    assert!(
        log.contains("team.yaml:3:")
            && log.contains("duplicate descriptor composite key 'live.user' (already defined in"),
        "{log}"
    );
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
