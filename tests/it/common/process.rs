//! The `rlsd` binary as a child process, on ports it binds itself (port 0) and reports in its
//! log, so that tests never race each other for a "free" port.

use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long `rlsd serve` may take to bind and log its addresses (a debug build on a loaded CI
/// machine, with a store to reach first).
const START_DEADLINE: Duration = Duration::from_secs(30);

/// A running `rlsd serve`; killed when dropped.
pub struct Rlsd {
    child: Child,
    log: tempfile::NamedTempFile,
    /// The bound gRPC address.
    pub grpc: SocketAddr,
    /// The bound admin HTTP address.
    pub http: SocketAddr,
}

impl Rlsd {
    /// `rlsd serve` with `args`, on 127.0.0.1 port 0 for both listeners (given in the
    /// environment, so flags in `args` override them). Waits for the "serving" line, and panics
    /// with the whole log if rlsd exits first or does not get there in time.
    pub fn serve<I, S>(args: I) -> Rlsd
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        Rlsd::serve_with(args, |_| {})
    }

    /// As [`Rlsd::serve`], with `adjust` applied to the command last (environment, say). No
    /// `RLSD_*` variable of the test's own environment reaches rlsd.
    pub fn serve_with<I, S>(args: I, adjust: impl FnOnce(&mut Command)) -> Rlsd
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut command = command();
        command
            .arg("serve")
            .args(args)
            .env("RLSD_GRPC_ADDR", "127.0.0.1:0")
            .env("RLSD_HTTP_ADDR", "127.0.0.1:0");
        adjust(&mut command);
        Rlsd::start(command)
    }

    /// Runs `command` (the binary however it is invoked, set to bind port 0), with its stderr
    /// captured, and waits for the "serving" line as [`Rlsd::serve`] does.
    pub fn start(mut command: Command) -> Rlsd {
        let log = tempfile::NamedTempFile::new().expect("a log file");
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log.reopen().expect("the log file")));
        let mut child = command.spawn().expect("spawn rlsd");
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            if let Some((grpc, http)) = serving_addresses(&text) {
                assert!(
                    grpc.port() != 0 && http.port() != 0,
                    "rlsd logged the requested addresses, not the bound ones:\n{text}"
                );
                return Rlsd {
                    child,
                    log,
                    grpc,
                    http,
                };
            }
            if let Some(status) = child.try_wait().expect("child status") {
                panic!("rlsd exited ({status}) before serving:\n{text}");
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("rlsd was not serving after {START_DEADLINE:?}:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// An address the "serving" line names besides gRPC and HTTP (`debug`, say).
    pub fn serving(&self, name: &str) -> Option<SocketAddr> {
        let log = self.log();
        let line = log.lines().find(|line| line.contains("serving"))?;
        field(line, name)
    }

    /// Everything rlsd has written to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).expect("the log file")
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (as `kill` spells it: `-HUP`).
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill {signal} failed");
    }

    /// Sends SIGTERM and waits up to `within` for the exit; panics with the log if it does not
    /// come.
    pub fn terminate(&mut self, within: Duration) -> ExitStatus {
        self.signal("-TERM");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("child status") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "rlsd did not stop on SIGTERM within {within:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Rlsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `rlsd` binary, with no `RLSD_*` variable of the test's own environment.
pub fn command() -> Command {
    command_at(env!("CARGO_BIN_EXE_rlsd"))
}

/// The `rlsd` binary at `path` (a link to it under another name, say), with no `RLSD_*`
/// variable of the test's own environment.
pub fn command_at(path: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new(path);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("RLSD_") {
            command.env_remove(name);
        }
    }
    command
}

/// The gRPC and HTTP addresses of the "serving" line, in the text or the JSON log format; only
/// a whole line counts (one read mid-write could end inside a port number).
fn serving_addresses(log: &str) -> Option<(SocketAddr, SocketAddr)> {
    log.split_inclusive('\n')
        .filter(|line| line.ends_with('\n') && line.contains("serving"))
        .find_map(|line| Some((field(line, "grpc")?, field(line, "http")?)))
}

fn field(line: &str, name: &str) -> Option<SocketAddr> {
    let text = format!("{name}=");
    let json = format!("\"{name}\":\"");
    let start = line
        .find(&text)
        .map(|at| at + text.len())
        .or_else(|| line.find(&json).map(|at| at + json.len()))?;
    // Optional fields are logged as quoted strings (`debug="127.0.0.1:6070"`).
    let rest = line[start..].trim_start_matches('"');
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '"')
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}
