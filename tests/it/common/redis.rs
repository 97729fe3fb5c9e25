//! A private redis-server on a free loopback port, started and stopped by the test itself.
// Some test crates include this file on its own (`#[path]`) and use only part of it.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A redis-server child process; killed when dropped.
pub struct RedisServer {
    pub port: u16,
    /// TLS-only, with an ACL user, when started by [`RedisServer::start_tls`].
    tls: Option<RedisTls>,
    child: Option<Child>,
}

/// What a TLS redis-server serves with: PEM files, and the one ACL user it lets in.
#[derive(Clone, Debug)]
pub struct RedisTls {
    /// The server certificate (for 127.0.0.1).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA that signed it; redis-cli trusts it, and so must rlsd (`--redis-ca`).
    pub ca: PathBuf,
    /// An ACL user with every permission; the `default` user is disabled.
    pub user: String,
    /// That user's password.
    pub password: String,
    /// When set, clients must present a certificate `ca` signed (`tls-auth-clients yes`);
    /// redis-cli presents this one (certificate, key).
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("free port")
        .port()
}

impl RedisServer {
    /// Starts redis-server on a free port and waits until it answers.
    pub fn start() -> RedisServer {
        let mut server = RedisServer {
            port: free_port(),
            tls: None,
            child: None,
        };
        server.restart();
        server
    }

    /// Starts redis-server speaking only TLS (`--tls-port`, no plain port; clients need a
    /// certificate only with `tls.client_cert`) with one ACL user, and waits until it answers.
    pub fn start_tls(tls: RedisTls) -> RedisServer {
        let mut server = RedisServer {
            port: free_port(),
            tls: Some(tls),
            child: None,
        };
        server.restart();
        server
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://<user>:<password>@127.0.0.1:<port>` over TLS.
    pub fn url(&self) -> String {
        match &self.tls {
            None => format!("redis://127.0.0.1:{}", self.port),
            Some(tls) => self.tls_url(&tls.user, &tls.password),
        }
    }

    /// `rediss://<user>:<password>@127.0.0.1:<port>`, with any credentials.
    pub fn tls_url(&self, user: &str, password: &str) -> String {
        format!("rediss://{user}:{password}@127.0.0.1:{}", self.port)
    }

    /// Kills the server (as a crash would: no shutdown, no save).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        let mut command = Command::new("redis-server");
        match &self.tls {
            None => command.args(["--port", &self.port.to_string()]),
            Some(tls) => tls_only(&mut command, self.port, &tls.cert, &tls.key, &tls.ca)
                .args([
                    "--tls-auth-clients",
                    if tls.client_cert.is_some() {
                        "yes"
                    } else {
                        "no"
                    },
                ])
                .args(["--user", "default", "off"])
                .args(["--user", &tls.user, "on", &format!(">{}", tls.password)])
                .args(["~*", "&*", "+@all"]),
        };
        let child = command
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (.ci/run installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).as_deref() != Some("PONG") {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs redis-cli against this server; its trimmed stdout, if it ran.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let mut command = Command::new("redis-cli");
        command.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(tls) = &self.tls {
            command
                .arg("--tls")
                .arg("--cacert")
                .arg(&tls.ca)
                .args(["--user", &tls.user, "--pass", &tls.password])
                .arg("--no-auth-warning");
            if let Some((cert, key)) = &tls.client_cert {
                command.arg("--cert").arg(cert).arg("--key").arg(key);
            }
        }
        let output = command.args(args).output().ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// redis-server options to listen on `port` with TLS only, presenting `cert` and `key` and
/// trusting `ca`.
pub fn tls_only<'c>(
    command: &'c mut Command,
    port: u16,
    cert: &std::path::Path,
    key: &std::path::Path,
    ca: &std::path::Path,
) -> &'c mut Command {
    command
        .args(["--port", "0", "--tls-port", &port.to_string()])
        .arg("--tls-cert-file")
        .arg(cert)
        .arg("--tls-key-file")
        .arg(key)
        .arg("--tls-ca-cert-file")
        .arg(ca)
}
