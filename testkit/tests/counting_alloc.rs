//! The counting allocator counts what a closure allocates and what it leaves on the heap, and
//! nothing outside the closure. Counting is process-wide, so this binary holds one test: a
//! second one would allocate on its own thread while the first counts.

use rlsd_testkit::counting_alloc::{CountingAlloc, allocations_during, count_during};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

#[test]
fn counts_allocations_reallocations_and_the_bytes_left_behind() {
    let (kept, counted) = count_during(|| {
        let freed = vec![0_u8; 4096];
        drop(std::hint::black_box(freed));
        std::hint::black_box(vec![0_u8; 1000])
    });
    assert_eq!(counted.allocations, 2);
    assert_eq!(counted.net_bytes, 1000, "the freed buffer is netted out");
    let (_, dropped) = count_during(|| drop(kept));
    assert_eq!(dropped.allocations, 0);
    assert_eq!(dropped.net_bytes, -1000);

    let allocations = allocations_during(|| {
        let mut v: Vec<u64> = Vec::with_capacity(1);
        for i in 0..4 {
            v.push(i);
        }
        std::hint::black_box(v);
    });
    // with_capacity(1), then growth to 4 (amortized doubling from a small capacity).
    assert!((2..=3).contains(&allocations), "{allocations}");
}
