//! The binary's allocator (mimalloc), counting allocations and net bytes while `COUNTING` is on:
//! off during timed loops, so they pay one relaxed load per allocation.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// Counts allocations (and reallocations) while [`COUNTING`] is on.
pub struct CountingAlloc;

/// Whether allocations are counted now.
pub static COUNTING: AtomicBool = AtomicBool::new(false);
/// Allocations counted so far.
pub static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// Bytes allocated minus bytes freed while counting.
static NET_BYTES: AtomicI64 = AtomicI64::new(0);

fn count(allocations: u64, bytes: i64) {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(allocations, Ordering::Relaxed);
        NET_BYTES.fetch_add(bytes, Ordering::Relaxed);
    }
}

fn size(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

// SAFETY: forwards every call to mimalloc unchanged.
#[expect(unsafe_code, reason = "a counting global allocator")]
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(1, size(layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(1, size(layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(0, -size(layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(1, size(new_size) - size(layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

/// What the allocator saw while `work` ran.
#[derive(Clone, Copy, Debug)]
pub struct Counted {
    /// Allocations and reallocations.
    pub allocations: u64,
    /// Bytes allocated minus bytes freed: what `work` left on the heap.
    pub net_bytes: i64,
}

/// Counts what is allocated while `work` runs, on every thread (only with [`CountingAlloc`] as
/// the global allocator).
pub fn count_during<R>(work: impl FnOnce() -> R) -> (R, Counted) {
    ALLOCS.store(0, Ordering::Relaxed);
    NET_BYTES.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let result = work();
    COUNTING.store(false, Ordering::Relaxed);
    let counted = Counted {
        allocations: ALLOCS.load(Ordering::Relaxed),
        net_bytes: NET_BYTES.load(Ordering::Relaxed),
    };
    (result, counted)
}

/// Counts the allocations `work` makes.
pub fn allocations_during(work: impl FnOnce()) -> u64 {
    count_during(work).1.allocations
}
