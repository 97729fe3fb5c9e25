//! A private Redis Cluster (3 masters + 3 replicas) on free loopback ports, built with
//! `redis-cli --cluster create`, killed when dropped.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The cluster's redis-server processes.
pub struct RedisCluster {
    /// Every node's port, masters and replicas.
    pub ports: Vec<u16>,
    children: Vec<Option<Child>>,
    dir: tempfile::TempDir,
    tls: Option<ClusterTls>,
}

/// TLS on every node's port and on the cluster bus, with a certificate for 127.0.0.1.
pub struct ClusterTls {
    /// The server certificate (for 127.0.0.1).
    pub cert: std::path::PathBuf,
    /// Its private key.
    pub key: std::path::PathBuf,
    /// The CA that signed it, which redis-cli and rlsd trust.
    pub ca: std::path::PathBuf,
    /// A client certificate and key from the same CA, which a node presents on the cluster bus
    /// and to its master (those connections are mutual TLS).
    pub client_cert: std::path::PathBuf,
    /// The client certificate's key.
    pub client_key: std::path::PathBuf,
}

fn free_ports(n: usize) -> Vec<u16> {
    // Hold every listener until all are chosen, so no port is handed out twice. Cluster bus
    // ports are port + 10000, so keep ports low enough.
    let mut listeners = Vec::new();
    while listeners.len() < n {
        let listener = TcpListener::bind("127.0.0.1:0").expect("free port");
        let port = listener.local_addr().expect("addr").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            listeners.push(listener);
        }
    }
    listeners
        .iter()
        .map(|l| l.local_addr().expect("addr").port())
        .collect()
}

impl RedisCluster {
    /// Starts six nodes and joins them into a cluster with one replica per master.
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(None)
    }

    /// [`RedisCluster::start`], speaking only TLS (clients, replication and the cluster bus).
    pub fn start_tls(tls: ClusterTls) -> RedisCluster {
        RedisCluster::start_with(Some(tls))
    }

    fn start_with(tls: Option<ClusterTls>) -> RedisCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports = free_ports(6);
        let mut cluster = RedisCluster {
            children: ports.iter().map(|_| None).collect(),
            ports,
            dir,
            tls,
        };
        for i in 0..cluster.ports.len() {
            cluster.start_node(i);
        }
        let mut create = Command::new("redis-cli");
        cluster.tls_args(&mut create);
        create.arg("--cluster").arg("create");
        for port in &cluster.ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let output = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            output.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        cluster.wait_until_ok();
        cluster
    }

    /// redis-cli's options for a TLS cluster; none for a plain one.
    fn tls_args(&self, command: &mut Command) {
        if let Some(tls) = &self.tls {
            command.arg("--tls").arg("--cacert").arg(&tls.ca);
        }
    }

    fn start_node(&mut self, i: usize) {
        let port = self.ports[i];
        let mut command = Command::new(crate::redis::server_program());
        match &self.tls {
            None => command.args(["--port", &port.to_string()]),
            Some(tls) => crate::redis::tls_only(&mut command, port, &tls.cert, &tls.key, &tls.ca)
                .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                .arg("--tls-client-cert-file")
                .arg(&tls.client_cert)
                .arg("--tls-client-key-file")
                .arg(&tls.client_key)
                .args(["--tls-auth-clients", "optional"]),
        };
        let child = command
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
            // Replicas sync at once and may always take over: a test kills masters on purpose.
            .args([
                "--repl-diskless-sync-delay",
                "0",
                "--cluster-replica-validity-factor",
                "0",
            ])
            .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server");
        self.children[i] = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(port, &["PING"]).as_deref() != Some("PONG") {
            assert!(Instant::now() < deadline, "node {port} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until every live node reports `cluster_state:ok` and every replica is in sync.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let replicas_synced = self
                .ports
                .iter()
                .zip(&self.children)
                .filter(|(_, child)| child.is_some())
                .filter_map(|(port, _)| self.cli(*port, &["INFO", "replication"]))
                .filter(|info| info.contains("role:slave"))
                .all(|info| info.contains("master_link_status:up"));
            let ok = replicas_synced
                && self
                    .ports
                    .iter()
                    .zip(&self.children)
                    .filter(|(_, child)| child.is_some())
                    .all(|(port, _)| {
                        self.cli(*port, &["CLUSTER", "INFO"])
                            .is_some_and(|info| info.contains("cluster_state:ok"))
                    });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "cluster never became ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis://127.0.0.1:<port>` (`rediss://` with TLS) for every node.
    pub fn urls(&self) -> Vec<String> {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.ports
            .iter()
            .map(|port| format!("{scheme}://127.0.0.1:{port}"))
            .collect()
    }

    /// The ports of the current masters.
    pub fn masters(&self) -> Vec<u16> {
        self.ports
            .iter()
            .zip(&self.children)
            .filter(|(_, child)| child.is_some())
            .filter(|(port, _)| {
                self.cli(**port, &["ROLE"])
                    .is_some_and(|role| role.starts_with("master"))
            })
            .map(|(port, _)| *port)
            .collect()
    }

    /// The master that serves `key` (the one that answers it instead of redirecting).
    pub fn master_of(&self, key: &str) -> Option<u16> {
        self.masters().into_iter().find(|port| {
            self.cli(*port, &["GET", key])
                .is_some_and(|answer| !answer.starts_with("MOVED"))
        })
    }

    /// Kills the node on `port`, as a crash would.
    pub fn kill(&mut self, port: u16) {
        if let Some(i) = self.ports.iter().position(|p| *p == port)
            && let Some(mut child) = self.children[i].take()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs redis-cli against one node; its trimmed stdout, if it ran.
    pub fn cli(&self, port: u16, args: &[&str]) -> Option<String> {
        crate::redis::redis_cli(port, args, |command| self.tls_args(command))
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
