//! Counters and histograms kept per thread shard and summed at scrape.
//!
//! prometheus' own counters and histograms are one set of atomics shared by every thread: on
//! each request both cores' lanes add to the same cache lines (three per limit, four per
//! histogram observation), and each addition waits for the line to come over from the other
//! core. Here each thread adds to its own shard, so a line stays with its core; a scrape sums
//! the shards. The text a scrape renders is what prometheus' `IntCounterVec` and `Histogram`
//! render for the same counts.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};

use super::LimitMap;

/// Shards per metric: more than the threads that serve requests (a lane each, a core each).
const SHARDS: usize = 8;

/// The shard of the calling thread, dealt round robin on its first use.
fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    SHARD.with(|shard| {
        let mut index = shard.get();
        if index == usize::MAX {
            index = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
            shard.set(index);
        }
        index
    })
}

/// A cache line of its own, so two shards never share one.
#[repr(align(64))]
#[derive(Default)]
struct Line<T>(T);

/// The five counters of one limit, in the order of [`LIMIT_FAMILIES`].
#[derive(Default)]
pub(super) struct LimitCounters {
    shards: [Line<[AtomicU64; 5]>; SHARDS],
}

/// Index of each counter in a shard.
pub(super) const TOTAL_HITS: usize = 0;
pub(super) const OVER_LIMIT: usize = 1;
pub(super) const NEAR_LIMIT: usize = 2;
pub(super) const WITHIN_LIMIT: usize = 3;
pub(super) const SHADOW_MODE: usize = 4;

/// Name and help of each per-limit counter family, by index.
pub(super) const LIMIT_FAMILIES: [(&str, &str); 5] = [
    (
        "ratelimit_service_rate_limit_total_hits",
        "Hits checked against a limit",
    ),
    (
        "ratelimit_service_rate_limit_over_limit",
        "Hits denied by a limit",
    ),
    (
        "ratelimit_service_rate_limit_near_limit",
        "Allowed hits above the near-limit ratio",
    ),
    (
        "ratelimit_service_rate_limit_within_limit",
        "Hits allowed by a limit",
    ),
    (
        "ratelimit_service_rate_limit_shadow_mode",
        "Hits a shadow-mode limit would have denied",
    ),
];

/// One thread's shard of a limit's counters.
pub(super) struct LimitShard<'a>(&'a [AtomicU64; 5]);

impl LimitShard<'_> {
    /// Adds `n` to counter `which` (nothing for 0).
    pub(super) fn add(&self, which: usize, n: u64) {
        if n > 0 {
            self.0[which].fetch_add(n, Ordering::Relaxed);
        }
    }
}

impl LimitCounters {
    fn sum(&self, which: usize) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.0[which].load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// Handles by domain, then path.
type LimitTree = LimitMap<LimitMap<Arc<LimitCounters>>>;

/// Every limit's counters: one map that owns them (scrapes and first sightings lock it), and a
/// copy of it per shard that requests read, so the lock word they touch stays on their core.
pub(super) struct LimitTable {
    all: Arc<Mutex<LimitTree>>,
    shards: [Line<RwLock<LimitTree>>; SHARDS],
}

impl LimitTable {
    /// An empty table, and the collector that renders it (to be registered once).
    pub(super) fn new() -> (LimitTable, LimitCollector) {
        let all = Arc::new(Mutex::new(LimitTree::default()));
        let descs = LIMIT_FAMILIES
            .iter()
            .map(|(name, help)| {
                Desc::new(
                    (*name).to_owned(),
                    (*help).to_owned(),
                    vec!["domain".to_owned(), "descriptor".to_owned()],
                    Default::default(),
                )
                .unwrap_or_else(|error| unreachable!("metric {name} is well-formed: {error}"))
            })
            .collect();
        let collector = LimitCollector {
            all: Arc::clone(&all),
            descs,
        };
        let table = LimitTable {
            all,
            shards: Default::default(),
        };
        (table, collector)
    }

    /// Calls `f` with the calling thread's shard of the counters of `domain` + `path`,
    /// creating them on first sight.
    pub(super) fn with<R>(
        &self,
        domain: &str,
        path: &str,
        f: impl FnOnce(LimitShard<'_>) -> R,
    ) -> R {
        let index = shard();
        let own = &self.shards[index].0;
        {
            let map = own.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(counters) = map.get(domain).and_then(|paths| paths.get(path)) {
                return f(LimitShard(&counters.shards[index].0));
            }
        }
        let counters = Arc::clone(
            self.all
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(domain.to_owned())
                .or_default()
                .entry(path.to_owned())
                .or_default(),
        );
        let result = f(LimitShard(&counters.shards[index].0));
        own.write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(domain.to_owned())
            .or_default()
            .insert(path.to_owned(), counters);
        result
    }
}

/// Renders [`LimitTable`]'s counters as prometheus' `IntCounterVec`s would.
#[derive(Clone)]
pub(super) struct LimitCollector {
    all: Arc<Mutex<LimitTree>>,
    descs: Vec<Desc>,
}

impl Collector for LimitCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let all = self.all.lock().unwrap_or_else(PoisonError::into_inner);
        LIMIT_FAMILIES
            .iter()
            .enumerate()
            .map(|(which, (name, help))| {
                let metrics = all
                    .iter()
                    .flat_map(|(domain, paths)| {
                        paths.iter().map(move |(path, counters)| {
                            let mut counter = proto::Counter::default();
                            counter.set_value(counters.sum(which) as f64);
                            let mut metric = proto::Metric::from_label(labels(&[
                                ("domain", domain),
                                ("descriptor", path),
                            ]));
                            metric.set_counter(counter);
                            metric
                        })
                    })
                    .collect();
                family(name, help, MetricType::COUNTER, metrics)
            })
            .collect()
    }
}

/// Label pairs sorted by name, as prometheus sorts them.
fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    let mut labels: Vec<LabelPair> = pairs
        .iter()
        .map(|(name, value)| {
            let mut pair = LabelPair::default();
            pair.set_name((*name).to_owned());
            pair.set_value((*value).to_owned());
            pair
        })
        .collect();
    labels.sort();
    labels
}

fn family(name: &str, help: &str, kind: MetricType, metrics: Vec<proto::Metric>) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(name.to_owned());
    family.set_help(help.to_owned());
    family.set_field_type(kind);
    family.set_metric(metrics);
    family
}

/// One shard of a histogram: a count per bucket (the last past every bound) and the sum.
struct HistogramShard {
    buckets: Box<[AtomicU64]>,
    /// The sum's `f64` bits.
    sum: AtomicU64,
}

/// A histogram with prometheus' buckets, counted per shard.
pub struct Histogram {
    bounds: Arc<[f64]>,
    shards: [Line<HistogramShard>; SHARDS],
}

impl Histogram {
    fn new(bounds: Arc<[f64]>) -> Histogram {
        let shards = std::array::from_fn(|_| {
            Line(HistogramShard {
                buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                sum: AtomicU64::new(0),
            })
        });
        Histogram { bounds, shards }
    }

    /// Counts one observation of `value`.
    pub fn observe(&self, value: f64) {
        let shard = &self.shards[shard()].0;
        let bucket = self
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(self.bounds.len());
        shard.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        // Only this shard's threads add here, so the exchange almost never retries.
        let _ = shard
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }

    fn proto(&self) -> proto::Histogram {
        let mut counts = vec![0u64; self.bounds.len() + 1];
        let mut sum = 0.0;
        for shard in &self.shards {
            for (count, bucket) in counts.iter_mut().zip(shard.0.buckets.iter()) {
                *count += bucket.load(Ordering::Relaxed);
            }
            sum += f64::from_bits(shard.0.sum.load(Ordering::Relaxed));
        }
        let mut cumulative = 0;
        let buckets = self
            .bounds
            .iter()
            .zip(&counts)
            .map(|(bound, count)| {
                cumulative += count;
                let mut bucket = proto::Bucket::default();
                bucket.set_cumulative_count(cumulative);
                bucket.set_upper_bound(*bound);
                bucket
            })
            .collect();
        let mut histogram = proto::Histogram::default();
        histogram.set_sample_count(counts.iter().sum());
        histogram.set_sample_sum(sum);
        histogram.set_bucket(buckets);
        histogram
    }
}

/// A family's series by label value, shared with its collector.
type SeriesList = Arc<Mutex<Vec<(String, Arc<Histogram>)>>>;

/// Histograms of one name, by the value of at most one label (none: a single series that is
/// always rendered, as prometheus' `Histogram`; one: series as they are asked for, as its
/// `HistogramVec`).
pub struct HistogramFamily {
    desc: Desc,
    label: Option<&'static str>,
    bounds: Arc<[f64]>,
    series: SeriesList,
}

impl HistogramFamily {
    /// A family named `name` with `bounds`, labelled by `label` if given.
    pub(super) fn new(
        name: &str,
        help: &str,
        label: Option<&'static str>,
        bounds: Vec<f64>,
    ) -> HistogramFamily {
        let desc = Desc::new(
            name.to_owned(),
            help.to_owned(),
            label.iter().map(|label| (*label).to_owned()).collect(),
            Default::default(),
        )
        .unwrap_or_else(|error| unreachable!("histogram {name} is well-formed: {error}"));
        let family = HistogramFamily {
            desc,
            label,
            bounds: bounds.into(),
            series: Arc::default(),
        };
        if label.is_none() {
            family.series(String::new());
        }
        family
    }

    /// The series for `value` of the label (the one series without a label), created on first
    /// call: look it up once, not per observation.
    pub fn series(&self, value: String) -> Arc<Histogram> {
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, histogram)) = series.iter().find(|(v, _)| *v == value) {
            return Arc::clone(histogram);
        }
        let histogram = Arc::new(Histogram::new(Arc::clone(&self.bounds)));
        series.push((value, Arc::clone(&histogram)));
        histogram
    }

    /// A collector of this family, to be registered once.
    pub(super) fn collector(&self) -> HistogramCollector {
        HistogramCollector {
            desc: self.desc.clone(),
            label: self.label,
            series: Arc::clone(&self.series),
        }
    }
}

/// Renders a [`HistogramFamily`] as prometheus' own histograms would.
#[derive(Clone)]
pub(super) struct HistogramCollector {
    desc: Desc,
    label: Option<&'static str>,
    series: SeriesList,
}

impl Collector for HistogramCollector {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        let metrics = series
            .iter()
            .map(|(value, histogram)| {
                let mut metric = proto::Metric::from_label(match self.label {
                    Some(label) => labels(&[(label, value)]),
                    None => Vec::new(),
                });
                metric.set_histogram(histogram.proto());
                metric
            })
            .collect();
        vec![family(
            &self.desc.fq_name,
            &self.desc.help,
            MetricType::HISTOGRAM,
            metrics,
        )]
    }
}
