//! A private Redis with one replica and three Sentinels on free loopback ports.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The master's name the Sentinels monitor.
pub const MASTER_NAME: &str = "rlsdmaster";

/// Master, replica and Sentinel processes; killed when dropped.
pub struct RedisSentinel {
    /// The master's port (until a failover).
    pub master: u16,
    /// The replica's port.
    pub replica: u16,
    /// Each Sentinel's port.
    pub sentinels: Vec<u16>,
    children: Vec<(u16, Child)>,
    dir: tempfile::TempDir,
}

use crate::redis::free_ports;

fn cli(port: u16, args: &[&str]) -> Option<String> {
    crate::redis::redis_cli(port, args, |_| {})
}

fn wait(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl RedisSentinel {
    /// Starts everything and waits until the replica is in sync and the Sentinels know it.
    pub fn start() -> RedisSentinel {
        let ports = free_ports(5);
        let mut set = RedisSentinel {
            master: ports[0],
            replica: ports[1],
            sentinels: ports[2..].to_vec(),
            children: Vec::new(),
            dir: tempfile::tempdir().expect("tempdir"),
        };
        let dir = set.dir.path().display().to_string();
        // Replication writes an RDB file: keep it in the test's own directory.
        let base = |port: u16| {
            [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                &dir,
            ]
            .map(str::to_owned)
            .to_vec()
        };
        set.spawn(set.master, base(set.master));
        let mut replica = base(set.replica);
        replica.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            set.master.to_string(),
        ]);
        set.spawn(set.replica, replica);
        wait("the replica to sync", || {
            cli(set.replica, &["INFO", "replication"])
                .is_some_and(|i| i.contains("master_link_status:up"))
        });
        for port in set.sentinels.clone() {
            let conf = set.dir.path().join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {MASTER_NAME} 127.0.0.1 {} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 1000\nsentinel failover-timeout {MASTER_NAME} 3000\n",
                    set.dir.path().display(),
                    set.master
                ),
            )
            .expect("sentinel conf");
            set.spawn(port, vec![conf.display().to_string(), "--sentinel".into()]);
        }
        let sentinels = set.sentinels.clone();
        wait("the sentinels to know the replica and each other", || {
            sentinels.iter().all(|port| {
                cli(*port, &["SENTINEL", "MASTER", MASTER_NAME]).is_some_and(|info| {
                    let lines: Vec<&str> = info.lines().collect();
                    let field = |name: &str| {
                        lines
                            .iter()
                            .position(|l| *l == name)
                            .and_then(|i| lines.get(i + 1))
                            .copied()
                    };
                    field("num-slaves") == Some("1") && field("num-other-sentinels") == Some("2")
                })
            })
        });
        set
    }

    fn spawn(&mut self, port: u16, args: Vec<String>) {
        let child = Command::new(crate::redis::server_program())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server");
        self.children.push((port, child));
        wait("a redis process to answer", || {
            cli(port, &["PING"]).as_deref() == Some("PONG")
        });
    }

    /// `redis://127.0.0.1:<port>` of each Sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// Kills the master, as a crash would.
    pub fn kill_master(&mut self) {
        let master = self.master;
        if let Some(i) = self.children.iter().position(|(port, _)| *port == master) {
            let (_, mut child) = self.children.remove(i);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until the replica has been promoted.
    pub fn wait_for_promotion(&self) {
        wait("the replica to become master", || {
            cli(self.replica, &["ROLE"]).is_some_and(|r| r.starts_with("master"))
        });
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
