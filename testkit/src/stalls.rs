//! How much the machine itself takes CPUs away, which every tail latency measured here includes.
//!
//! One thread per CPU, pinned, reads the clock in a tight loop while nothing else of the bench
//! runs; a gap between two readings is time that CPU ran something else (the host's other
//! guests, the kernel, the machine's other services). On an idle 2-core VM of this kind, gaps of
//! 1 to 8 ms came several times a second: a request whose thread sits on that CPU waits them out,
//! and at high load so does the queue behind it.

use std::fmt;
use std::time::{Duration, Instant};

/// Gaps shorter than this are the loop's own noise (cache misses, timer ticks).
const COUNTED_GAP: Duration = Duration::from_micros(50);
/// Gaps at least this long are counted apart: they alone can put a request past p99 < 2 ms.
const LONG_GAP: Duration = Duration::from_millis(1);

/// What one CPU lost over the probe.
pub struct CpuStalls {
    cpu: usize,
    /// Time in gaps of at least [`COUNTED_GAP`].
    lost: Duration,
    /// Gaps of at least [`LONG_GAP`].
    long_gaps: u32,
    longest: Duration,
    span: Duration,
}

impl CpuStalls {
    /// The CPU probed.
    pub fn cpu(&self) -> usize {
        self.cpu
    }

    /// The share of the probe's time this CPU spent on something else.
    pub fn lost_share(&self) -> f64 {
        self.lost.as_secs_f64() / self.span.as_secs_f64()
    }
}

impl fmt::Display for CpuStalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cpu{} lost {:.2} % in gaps >= {} µs, {:.1} gaps >= {} ms per s, longest {:.2} ms",
            self.cpu(),
            100.0 * self.lost_share(),
            COUNTED_GAP.as_micros(),
            f64::from(self.long_gaps) / self.span.as_secs_f64(),
            LONG_GAP.as_millis(),
            self.longest.as_secs_f64() * 1e3,
        )
    }
}

/// Spins one pinned thread per CPU this process may use for `span`.
pub fn probe(span: Duration) -> Vec<CpuStalls> {
    let cpus = allowed_cpus();
    std::thread::scope(|scope| {
        let probes: Vec<_> = cpus
            .iter()
            .map(|&cpu| scope.spawn(move || spin_on(cpu, span)))
            .collect();
        probes
            .into_iter()
            .map(|probe| probe.join().expect("stall probe"))
            .collect()
    })
}

/// One line for the bench's header.
pub fn line(stalls: &[CpuStalls]) -> String {
    stalls
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Spins on `cpu` for `span`, counting the gaps between clock readings.
///
/// # Panics
/// When the calling thread cannot be pinned to `cpu`: unpinned, the figures would mean nothing.
#[expect(unsafe_code, reason = "sched_setaffinity to pin the probe")]
pub fn spin_on(cpu: usize, span: Duration) -> CpuStalls {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, CPU_SET writes one bit of it, and
    // sched_setaffinity(0, ..) only reads it to pin the calling thread.
    let pinned = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    assert!(
        pinned,
        "cannot pin the stall probe to cpu{cpu}: {}",
        std::io::Error::last_os_error()
    );
    let start = Instant::now();
    let (mut previous, mut lost, mut long_gaps, mut longest) =
        (start, Duration::ZERO, 0, Duration::ZERO);
    loop {
        let now = Instant::now();
        let gap = now - previous;
        previous = now;
        if gap >= COUNTED_GAP {
            lost += gap;
            longest = longest.max(gap);
            long_gaps += u32::from(gap >= LONG_GAP);
        }
        if now - start >= span {
            return CpuStalls {
                cpu,
                lost,
                long_gaps,
                longest,
                span: now - start,
            };
        }
    }
}

/// The CPUs the calling thread may run on.
///
/// # Panics
/// When the kernel does not say.
#[expect(unsafe_code, reason = "sched_getaffinity")]
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the zeroed set it is given; CPU_ISSET only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let read = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        assert!(
            read == 0,
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
            .collect()
    }
}
