//! CPU time of a process or thread, from its `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat`.

use std::time::Duration;

/// Clock ticks per second of `/proc/*/stat` times (`getconf CLK_TCK` on Linux).
const CLK_TCK: u64 = 100;

/// User plus system time in the text of a `stat` file; zero if it cannot be read.
pub fn cpu_time(stat: &str) -> Duration {
    // Fields after the `(comm)`, which may itself hold spaces: state is field 3, utime 14,
    // stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let field = |n: usize| -> u64 { fields.get(n - 3).and_then(|f| f.parse().ok()).unwrap_or(0) };
    Duration::from_millis((field(14) + field(15)) * 1000 / CLK_TCK)
}

/// [`cpu_time`] of the `stat` file at `path` (a process that has exited reads as zero).
pub fn cpu_time_of(path: impl AsRef<std::path::Path>) -> Duration {
    std::fs::read_to_string(path).map_or(Duration::ZERO, |stat| cpu_time(&stat))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_utime_and_stime_after_a_command_name_with_spaces() {
        let stat = "42 (bench server) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0";
        assert_eq!(cpu_time(stat), Duration::from_secs(3));
        assert_eq!(cpu_time("garbage"), Duration::ZERO);
    }
}
