//! The local over-limit cache in front of a real store: denials answered locally exactly until
//! the store's own reset, for every algorithm, and never a different decision.

use std::sync::atomic::{AtomicUsize, Ordering};

use rlsd::algorithm::{Hits, Params};
use rlsd::clock::{Clock, ManualClock};
use rlsd::limit::Algorithm;
use rlsd::store::{
    Check, MemoryStore, Outcome, OverLimitCache, Store, StoreError, request_allowed,
};

const S: u64 = 1_000_000;
const T0: u64 = 1_796_223_600_000_000;

/// The real in-process store, counting the calls that reach it.
struct Counted {
    store: MemoryStore<ManualClock>,
    calls: AtomicUsize,
}

impl Store for Counted {
    fn name(&self) -> &'static str {
        "counted"
    }

    async fn healthy(&self) -> bool {
        true
    }

    async fn decide(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.decide(checks).await
    }
}

fn cached(clock: &ManualClock, capacity: usize) -> OverLimitCache<Counted, ManualClock> {
    let inner = Counted {
        store: MemoryStore::with_clock(10_000, clock.clone()),
        calls: AtomicUsize::new(0),
    };
    OverLimitCache::with_clock(inner, capacity, clock.clone())
}

fn check(key: &str, algorithm: Algorithm, hits: Hits) -> Check {
    Check {
        key: key.to_owned(),
        params: Params {
            algorithm,
            limit: 3,
            period_us: 10 * S,
            burst: 3,
        },
        hits,
        shadow: false,
        quota_mode: false,
    }
}

#[tokio::test]
async fn a_denied_key_is_answered_locally_until_its_reset_for_every_algorithm() {
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::at(T0 + 2 * S);
        let cache = cached(&clock, 100);
        let c = check("k", algorithm, Hits::Take(1));
        for _ in 0..3 {
            assert!(
                cache
                    .decide(std::slice::from_ref(&c))
                    .await
                    .expect("decide")[0]
                    .verdict
                    .allowed
            );
        }
        let denied = cache
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decide")[0]
            .verdict;
        assert!(!denied.allowed, "{algorithm}");
        let calls = cache.inner().calls.load(Ordering::Relaxed);
        assert_eq!(calls, 4);
        // Until the reset: denied from the cache, the store is not asked.
        let until = clock.now_us() + denied.reset_us;
        clock.set(until - 2_000); // the cache ends 1 ms before the rounded reset
        let local = cache
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decide")[0]
            .verdict;
        assert!(!local.allowed, "{algorithm}");
        assert_eq!(
            local.reset_us, 1_000,
            "{algorithm}: the reset counts down to the same instant"
        );
        assert_eq!(
            cache.inner().calls.load(Ordering::Relaxed),
            calls,
            "{algorithm}"
        );
        assert_eq!(cache.hits(), 1);
        // At the reset the store decides again, and the request passes.
        clock.set(until);
        assert!(
            cache
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide")[0]
                .verdict
                .allowed,
            "{algorithm}"
        );
        assert_eq!(
            cache.inner().calls.load(Ordering::Relaxed),
            calls + 1,
            "{algorithm}"
        );
    }
}

#[tokio::test]
async fn fewer_hits_changed_limits_refunds_and_shadow_go_to_the_store() {
    let clock = ManualClock::at(T0);
    let cache = cached(&clock, 100);
    let big = check("k", Algorithm::TokenBucket, Hits::Take(3));
    cache
        .decide(&[check("k", Algorithm::TokenBucket, Hits::Take(2))])
        .await
        .expect("decide");
    assert!(
        !cache
            .decide(std::slice::from_ref(&big))
            .await
            .expect("decide")[0]
            .verdict
            .allowed
    );
    let calls = || cache.inner().calls.load(Ordering::Relaxed);
    let before = calls();
    // One hit still fits: the cache must not deny it.
    assert!(
        cache
            .decide(&[check("k", Algorithm::TokenBucket, Hits::Take(1))])
            .await
            .expect("decide")[0]
            .verdict
            .allowed
    );
    assert_eq!(calls(), before + 1);
    // A raised limit (a reload) is not the limit that denied.
    let mut raised = big.clone();
    raised.params.limit = 100;
    raised.params.burst = 100;
    cache.decide(&[raised]).await.expect("decide");
    assert_eq!(calls(), before + 2);
    // A refund through this rlsd drops what the cache knew.
    cache
        .decide(std::slice::from_ref(&big))
        .await
        .expect("decide");
    cache
        .decide(&[check("k", Algorithm::TokenBucket, Hits::Refund(3))])
        .await
        .expect("decide");
    assert!(
        cache
            .decide(std::slice::from_ref(&big))
            .await
            .expect("decide")[0]
            .verdict
            .allowed
    );
}

/// A small deterministic generator.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % below
    }
}

#[tokio::test]
async fn the_cache_never_changes_a_decision() {
    let clock = ManualClock::at(T0);
    let cache = cached(&clock, 4);
    let reference = MemoryStore::with_clock(10_000, clock.clone());
    let mut rng = Lcg(99);
    let keys: Vec<(String, Algorithm)> = (0..10)
        .map(|i| (format!("r{i}"), Algorithm::ALL[i % 5]))
        .collect();
    let mut now = T0;
    for step in 0..5000 {
        now += [0, 1, 997, 100_000, 900_000, 3 * S][rng.next(6) as usize];
        clock.set(now);
        let checks: Vec<Check> = (0..1 + rng.next(3))
            .map(|_| {
                let (key, algorithm) = &keys[rng.next(keys.len() as u64) as usize];
                let hits = match rng.next(12) {
                    0 => Hits::Peek,
                    1 => Hits::Refund(1),
                    2 => Hits::Take(2),
                    _ => Hits::Take(1),
                };
                let mut c = check(key, *algorithm, hits);
                c.shadow = rng.next(10) == 0;
                c
            })
            .collect();
        let hits_before = cache.hits();
        let got = cache.decide(&checks).await.expect("decide");
        let want = reference.decide(&checks).await.expect("decide");
        assert_eq!(
            request_allowed(&checks, &got),
            request_allowed(&checks, &want),
            "step {step}: {checks:?}"
        );
        if cache.hits() == hits_before {
            assert_eq!(got, want, "step {step}: answered by the store, identical");
        }
    }
    assert!(
        cache.hits() > 100,
        "the cache answered {} requests",
        cache.hits()
    );
}

#[tokio::test]
async fn a_zero_capacity_cache_is_a_pass_through_and_memory_stays_bounded() {
    let clock = ManualClock::at(T0);
    let off = cached(&clock, 0);
    let c = check("k", Algorithm::FixedWindow, Hits::Take(4));
    for _ in 0..3 {
        off.decide(std::slice::from_ref(&c)).await.expect("decide");
    }
    assert_eq!(off.hits(), 0);
    assert_eq!(off.inner().calls.load(Ordering::Relaxed), 3);
    // A tiny cache under many denied keys keeps answering correctly.
    let small = cached(&clock, 1);
    for i in 0..500 {
        let c = check(&format!("k{i}"), Algorithm::Gcra, Hits::Take(4));
        assert!(
            !small
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide")[0]
                .verdict
                .allowed
        );
    }
}
