//! A private redis-server for benchmarks, on a free loopback port; killed when dropped, and by
//! the kernel when the bench dies (a signal, a panic that aborts), so none outlives its bench.
#![allow(dead_code)]

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

/// A redis-server child process.
pub struct Redis {
    pub port: u16,
    child: Child,
}

impl Redis {
    /// Starts redis-server and waits until it answers.
    pub fn start() -> Redis {
        Redis::start_under(&[])
    }

    /// Starts redis-server as the last argument of `wrapper` (e.g. `valgrind` and its options;
    /// none: redis-server itself) and waits until it answers.
    #[expect(unsafe_code, reason = "prctl(PR_SET_PDEATHSIG) in pre_exec")]
    pub fn start_under(wrapper: &[&str]) -> Redis {
        let port = free_port();
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg("redis-server");
                command
            }
            None => Command::new("redis-server"),
        };
        command
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null());
        // SAFETY: prctl only sets a flag of the child being started; it allocates nothing and
        // takes no lock. The kernel sends the signal when the thread that started the child
        // ends: every bench starts its Redis on its main thread.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let child = command.spawn().expect("redis-server");
        let redis = Redis { port, child };
        // Under valgrind, start-up takes seconds.
        let deadline = Instant::now() + Duration::from_secs(60);
        while redis.cli(&["PING"]).as_deref() != Some("PONG") {
            assert!(Instant::now() < deadline, "redis did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }

    /// Shuts the server down cleanly (SHUTDOWN NOSAVE), so a wrapper sees it exit, and waits
    /// for the process.
    pub fn shutdown(mut self) {
        let _ = self.cli(&["SHUTDOWN", "NOSAVE"]);
        let _ = self.child.wait();
    }

    /// redis-cli against this server; trimmed stdout if it ran.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// How many EVALSHA calls this server has run (see `evalsha_calls`).
    pub fn evalsha_calls(&self) -> Option<u64> {
        evalsha_calls(self.port)
    }

    /// The redis-server process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time of the redis-server process so far, in microseconds.
    pub fn cpu_us(&self) -> u64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
            + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
        ticks * 10_000
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Redis {
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

/// How many EVALSHA calls the server on `port` has run, from INFO commandstats over a plain
/// socket (no redis-cli process); `None` if it cannot be read.
pub fn evalsha_calls(port: u16) -> Option<u64> {
    use std::io::{Read, Write};
    let Ok(mut socket) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return None;
    };
    let _ = socket.set_read_timeout(Some(std::time::Duration::from_secs(1)));
    if socket.write_all(b"INFO commandstats\r\n").is_err() {
        return None;
    }
    // A bulk string: `$<len>\r\n<text>\r\n`; read until the text is whole.
    let mut reply = Vec::new();
    let mut buffer = [0_u8; 4096];
    loop {
        let Ok(n) = socket.read(&mut buffer) else {
            return None;
        };
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
