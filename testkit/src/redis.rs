//! A private redis-server on a free loopback port, started and stopped by the test or bench
//! itself.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A redis-server child process; killed when dropped.
pub struct RedisServer {
    /// The loopback port it listens on (its TLS port, with TLS).
    pub port: u16,
    /// TLS-only, with an ACL user, when started by [`RedisServer::start_tls`].
    tls: Option<RedisTls>,
    /// A program redis-server runs under (valgrind and its options), from
    /// [`RedisServer::start_for_bench`].
    wrapper: Vec<String>,
    /// Whether the kernel kills the server when the thread that started it ends.
    dies_with_thread: bool,
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

/// The server binary every launcher runs: `RLSD_TEST_REDIS_SERVER` (a path, such as a Valkey
/// `valkey-server`, to run the same tests against another server), else `redis-server`.
pub fn server_program() -> String {
    std::env::var("RLSD_TEST_REDIS_SERVER")
        .ok()
        .filter(|program| !program.is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free loopback ports (every listener is held until all are chosen).
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("addr").port())
        .collect()
}

/// redis-cli against the server on `port`, with `options` (TLS, say) added first; its trimmed
/// stdout, if it ran and succeeded.
pub(crate) fn redis_cli(
    port: u16,
    args: &[&str],
    options: impl FnOnce(&mut Command),
) -> Option<String> {
    let mut command = Command::new("redis-cli");
    options(&mut command);
    let output = command
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

impl RedisServer {
    /// Starts redis-server on a free port and waits until it answers.
    pub fn start() -> RedisServer {
        RedisServer::launch(None, Vec::new(), false)
    }

    /// Starts redis-server as the last argument of `wrapper` (valgrind and its options; empty:
    /// redis-server itself), killed by the kernel when the starting thread ends, so a bench
    /// that dies of a signal or an abort leaves no server behind.
    pub fn start_for_bench(wrapper: &[&str]) -> RedisServer {
        let wrapper = wrapper.iter().map(|arg| (*arg).to_owned()).collect();
        RedisServer::launch(None, wrapper, true)
    }

    /// Starts redis-server speaking only TLS (`--tls-port`, no plain port; clients need a
    /// certificate only with `tls.client_cert`) with one ACL user, and waits until it answers.
    pub fn start_tls(tls: RedisTls) -> RedisServer {
        RedisServer::launch(Some(tls), Vec::new(), false)
    }

    fn launch(tls: Option<RedisTls>, wrapper: Vec<String>, dies_with_thread: bool) -> RedisServer {
        let mut server = RedisServer {
            port: free_port(),
            tls,
            wrapper,
            dies_with_thread,
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
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(server_program());
                command
            }
            None => Command::new(server_program()),
        };
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
        command
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null());
        if self.wrapper.is_empty() {
            // A wrapper's complaints are worth seeing; redis-server's own go to its log.
            command.stderr(Stdio::null());
        }
        if self.dies_with_thread {
            die_with_thread(&mut command);
        }
        let child = command
            .spawn()
            .expect("redis-server is installed (.ci/run installs it)");
        self.child = Some(child);
        // Under valgrind, start-up takes seconds.
        let patience = if self.wrapper.is_empty() { 10 } else { 60 };
        let deadline = Instant::now() + Duration::from_secs(patience);
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
        redis_cli(self.port, args, |command| {
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
        })
    }

    /// Shuts the server down cleanly (SHUTDOWN NOSAVE), so a wrapper sees it exit, and waits
    /// for the process.
    pub fn shutdown(mut self) {
        let _ = self.cli(&["SHUTDOWN", "NOSAVE"]);
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// How many EVALSHA calls this server has run (see [`evalsha_calls`]).
    pub fn evalsha_calls(&self) -> Option<u64> {
        evalsha_calls(self.port)
    }

    /// The redis-server process id (the wrapper's, under one); 0 once killed.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// CPU time of the redis-server process so far, in microseconds.
    pub fn cpu_us(&self) -> u64 {
        let cpu = crate::cpu::cpu_time_of(format!("/proc/{}/stat", self.pid()));
        u64::try_from(cpu.as_micros()).unwrap_or(u64::MAX)
    }

    /// Redis's `used_memory`, in bytes.
    pub fn used_memory(&self) -> u64 {
        self.cli(&["INFO", "memory"])
            .and_then(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("used_memory:")?.trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

#[expect(unsafe_code, reason = "prctl(PR_SET_PDEATHSIG) in pre_exec")]
fn die_with_thread(command: &mut Command) {
    // SAFETY: prctl only sets a flag of the child being started; it allocates nothing and takes
    // no lock.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// How many EVALSHA calls the server on `port` has run, from INFO commandstats over a plain
/// socket (no redis-cli process, so it can be read mid-measurement); `None` if it cannot be read.
pub fn evalsha_calls(port: u16) -> Option<u64> {
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    socket.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    socket.write_all(b"INFO commandstats\r\n").ok()?;
    // A bulk string: `$<len>\r\n<text>\r\n`; read until the text is whole.
    let mut reply = Vec::new();
    let mut buffer = [0_u8; 4096];
    loop {
        let n = socket.read(&mut buffer).ok()?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buffer[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some((header, body)) = text.split_once("\r\n")
            && let Some(len) = header
                .strip_prefix('$')
                .and_then(|l| l.parse::<usize>().ok())
            && body.len() >= len
        {
            break;
        }
    }
    let text = String::from_utf8_lossy(&reply);
    if !text.starts_with('$') {
        return None;
    }
    // No line until the first EVALSHA.
    Some(
        text.lines()
            .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|calls| calls.parse().ok())
            .unwrap_or(0),
    )
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
