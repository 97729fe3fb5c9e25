//! Measures of admitted traffic: sliding-window maxima and per-bucket counts.

/// The most of the sorted `times` inside any window `[s, s + window_us)`: a true sliding
/// maximum, not a count per aligned window, so a fixed window's edge burst shows up.
pub fn max_in_window(times: &[u64], window_us: u64) -> usize {
    let window_us = window_us.max(1);
    let mut start = 0;
    let mut best = 0;
    for (end, &t) in times.iter().enumerate() {
        while t - times[start] >= window_us {
            start += 1;
        }
        best = best.max(end + 1 - start);
    }
    best
}

/// How many of the sorted `times` fall in the trailing window `(t - window_us, t]`.
fn trailing_count(times: &[u64], window_us: u64, t: u64) -> usize {
    let upto = times.partition_point(|&a| a <= t);
    let gone = match t.checked_sub(window_us) {
        Some(horizon) => times.partition_point(|&a| a <= horizon),
        None => 0,
    };
    upto - gone
}

/// For each of `columns` equal slices of `[0, duration_us)`, the largest trailing-window count
/// of `times` reached inside it: the admitted-rate curve at one value per pixel column, keeping
/// every peak however many requests share a pixel.
pub fn trailing_max_per_column(
    times: &[u64],
    window_us: u64,
    duration_us: u64,
    columns: usize,
) -> Vec<usize> {
    let window_us = window_us.max(1);
    let columns_u = columns.max(1) as u128;
    let edge = |c: usize| (c as u128 * u128::from(duration_us) / columns_u) as u64;
    (0..columns)
        .map(|c| {
            let (from, to) = (edge(c), edge(c + 1));
            // The count only rises at an admitted request, so the slice's maximum is at its
            // start or at one of the requests inside it.
            let first = times.partition_point(|&a| a < from);
            let last = times.partition_point(|&a| a < to);
            times[first..last]
                .iter()
                .map(|&a| trailing_count(times, window_us, a))
                .fold(trailing_count(times, window_us, from), usize::max)
        })
        .collect()
}

/// Counts `times` per bucket of `bucket_us` over `[0, duration_us)`.
pub fn per_bucket(times: impl Iterator<Item = u64>, bucket_us: u64, duration_us: u64) -> Vec<u64> {
    let bucket_us = bucket_us.max(1);
    let mut counts = vec![0; duration_us.div_ceil(bucket_us).max(1) as usize];
    let last = counts.len() - 1;
    for t in times {
        counts[((t / bucket_us) as usize).min(last)] += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_maximum_spans_aligned_windows() {
        // 3 at the end of one window and 3 at the start of the next: 6 within 2 s of 10 s.
        let times = [8, 9, 9, 10, 11, 11].map(|s| s * 1_000_000);
        assert_eq!(max_in_window(&times, 10_000_000), 6);
        assert_eq!(max_in_window(&times, 2_000_000), 3);
        // Half-open: two requests exactly one window apart are never in the same window.
        assert_eq!(max_in_window(&[0, 10], 10), 1);
        assert_eq!(max_in_window(&[], 10), 0);
    }

    #[test]
    fn column_maxima_agree_with_the_sliding_maximum() {
        let times: Vec<u64> = (0..200u64).map(|i| (i * i * 7_919) % 100_000).collect();
        let mut times = times;
        times.sort_unstable();
        for window in [1, 500, 5_000, 40_000] {
            for columns in [1, 7, 100, 1_000] {
                let curve = trailing_max_per_column(&times, window, 100_000, columns);
                assert_eq!(curve.len(), columns);
                assert_eq!(
                    curve.iter().copied().max(),
                    Some(max_in_window(&times, window)),
                    "window {window}, columns {columns}"
                );
            }
        }
    }

    #[test]
    fn trailing_window_drops_a_request_after_exactly_one_window() {
        let curve = trailing_max_per_column(&[0], 10, 20, 20);
        assert_eq!(curve[..10], [1; 10]);
        assert_eq!(curve[10..], [0; 10]);
    }

    #[test]
    fn buckets_count_and_clamp_the_last() {
        assert_eq!(per_bucket([0, 1, 5, 9].into_iter(), 5, 10), vec![2, 2]);
        assert_eq!(per_bucket([0, 11].into_iter(), 5, 11), vec![1, 0, 1]);
    }
}
