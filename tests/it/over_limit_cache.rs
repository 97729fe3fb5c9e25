//! The local over-limit cache in front of a real store: requests made only of known denials are
//! answered locally until the store's own reset, for every algorithm, exactly as the store would.

use crate::common;

use common::T0;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rlsd::algorithm::{Hits, Params};
use rlsd::clock::{Clock, ManualClock};
use rlsd::limit::Algorithm;
use rlsd::store::{
    Check, MemoryStore, Outcome, OverLimitCache, RedisSettings, RedisStore, Store, StoreError,
};

const S: u64 = 1_000_000;

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

    async fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<std::time::Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.decide_by(checks, deadline).await
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
async fn a_denied_key_is_answered_locally_until_its_reset_or_for_a_second() {
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
        // Until the reset, and for at most a second: the store's own answer, without asking it.
        let learned = clock.now_us();
        let until = learned + denied.reset_us;
        let answered_until = until.min(learned + S);
        clock.set(answered_until - 2_000);
        let local = cache
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decide");
        assert_eq!(
            cache.inner().calls.load(Ordering::Relaxed),
            calls,
            "{algorithm}"
        );
        assert_eq!(cache.hits(), 1);
        let store = cache
            .inner()
            .store
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decide");
        assert_eq!(local, store, "{algorithm}");
        // Within the reset's last millisecond, or a second on, the store decides again; from the
        // reset on it passes.
        clock.set((until - 1_000).min(learned + S));
        cache
            .decide(std::slice::from_ref(&c))
            .await
            .expect("decide");
        assert_eq!(
            cache.inner().calls.load(Ordering::Relaxed),
            calls + 1,
            "{algorithm}"
        );
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
    }
}

#[tokio::test]
async fn only_requests_made_of_known_denials_are_answered_locally() {
    let clock = ManualClock::at(T0);
    let cache = cached(&clock, 100);
    let calls = || cache.inner().calls.load(Ordering::Relaxed);
    let one = check("k", Algorithm::TokenBucket, Hits::Take(1));
    cache
        .decide(&[check("k", Algorithm::TokenBucket, Hits::Take(3))])
        .await
        .expect("decide");
    cache
        .decide(std::slice::from_ref(&one))
        .await
        .expect("decide");
    let before = calls();
    // A shadow or quota check of that denial is the same denial.
    let mut shadow = one.clone();
    shadow.shadow = true;
    let mut quota = one.clone();
    quota.quota_mode = true;
    for c in [one.clone(), shadow, quota] {
        cache.decide(&[c]).await.expect("decide");
    }
    assert_eq!(calls(), before);
    // Another limit in the request: the store answers all of it, with that limit's own status.
    let other = check("other", Algorithm::FixedWindow, Hits::Take(1));
    let answer = cache
        .decide(&[one.clone(), other.clone()])
        .await
        .expect("decide");
    assert_eq!(calls(), before + 1);
    assert!(!answer[0].verdict.allowed);
    assert!(answer[1].verdict.allowed);
    assert_eq!(
        answer[1].verdict.remaining, 3,
        "the store's count (nothing taken, the request is denied), not a guess"
    );
    // Two hits of a bucket wait longer than one: not the remembered answer.
    cache
        .decide(&[check("k", Algorithm::TokenBucket, Hits::Take(2))])
        .await
        .expect("decide");
    assert_eq!(calls(), before + 2);
    // A raised limit (a reload) is not the limit that denied.
    let mut raised = one.clone();
    raised.params.limit = 100;
    raised.params.burst = 100;
    cache.decide(&[raised]).await.expect("decide");
    assert_eq!(calls(), before + 3);
    // A refund through this rlsd drops what the cache knew.
    cache
        .decide(&[check("k", Algorithm::TokenBucket, Hits::Refund(3))])
        .await
        .expect("decide");
    assert!(
        cache
            .decide(std::slice::from_ref(&one))
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

/// Random requests over ten keys, two to a store: one behind the cache, one without.
fn random_requests(seed: u64, steps_us: &[u64]) -> Vec<(u64, Vec<Check>)> {
    let mut rng = Lcg(seed);
    let keys: Vec<(String, Algorithm)> = (0..10)
        .map(|i| (format!("r{i}"), Algorithm::ALL[i % 5]))
        .collect();
    let mut now = T0;
    (0..5000)
        .map(|_| {
            now += steps_us[rng.next(steps_us.len() as u64) as usize];
            let checks = (0..1 + rng.next(3))
                .map(|_| {
                    let (key, algorithm) = &keys[rng.next(keys.len() as u64) as usize];
                    let hits = match rng.next(14) {
                        0 => Hits::Peek,
                        1 => Hits::Refund(1),
                        2 => Hits::Take(2),
                        3 => Hits::Take(5),
                        _ => Hits::Take(1),
                    };
                    let mut c = check(key, *algorithm, hits);
                    c.shadow = rng.next(10) == 0;
                    c.quota_mode = rng.next(6) == 0;
                    c
                })
                .collect();
            (now, checks)
        })
        .collect()
}

/// Replays `requests` through `cache` and through an in-process store without one; returns how
/// many the cache answered.
async fn replay<S: Store>(
    cache: &OverLimitCache<S, ManualClock>,
    clock: &ManualClock,
    requests: &[(u64, Vec<Check>)],
    exact_reset: bool,
) -> u64 {
    let reference = MemoryStore::with_clock(10_000, clock.clone());
    for (step, (now, checks)) in requests.iter().enumerate() {
        clock.set(*now);
        let hits_before = cache.hits();
        let mut got = cache.decide(checks).await.expect("decide");
        let want = reference.decide(checks).await.expect("decide");
        if !exact_reset && cache.hits() > hits_before {
            // Off the millisecond grid the store's rounded reset can be 1 ms shorter.
            for (got, want) in got.iter_mut().zip(&want) {
                let (g, w) = (got.verdict.reset_us, want.verdict.reset_us);
                assert!(g == w || g == w + 1_000, "step {step}: {g} vs {w}");
                got.verdict.reset_us = w;
            }
        }
        assert_eq!(got, want, "step {step}: {checks:?}");
    }
    cache.hits()
}

/// Clock steps on the millisecond grid, where even a cached reset is the store's to the µs.
const ON_THE_MS: [u64; 6] = [0, 1_000, 7_000, 100_000, 900_000, 3 * S];

#[tokio::test]
async fn the_cache_answers_exactly_what_the_store_would() {
    let clock = ManualClock::at(T0);
    let on_the_ms = random_requests(99, &ON_THE_MS);
    let answered = replay(&cached(&clock, 4), &clock, &on_the_ms, true).await;
    eprintln!("on the millisecond grid the cache answered {answered} of 5000 requests");
    assert!(answered > 10, "the cache answered {answered} requests");
    let clock = ManualClock::at(T0);
    let off_the_ms = random_requests(7, &[0, 1, 997, 100_000, 900_000, 3 * S]);
    let answered = replay(&cached(&clock, 4), &clock, &off_the_ms, false).await;
    eprintln!("off the grid the cache answered {answered} of 5000 requests");
    assert!(answered > 10, "the cache answered {answered} requests");
}

/// The same over a real Redis: the cache in front of the Redis store answers what the in-process
/// store answers without one (which the behaviour suite proves Redis does too).
#[tokio::test]
async fn redis_behind_the_cache_answers_what_the_store_would() {
    let redis = rlsd_testkit::redis::RedisServer::start();
    let clock = ManualClock::at(T0);
    let mut settings = RedisSettings::new(redis.url());
    settings.fixed_clock = Some(Arc::new(clock.clone()));
    // The 5 ms production default is a budget; this test compares answers, on a loaded machine.
    settings.command_timeout = std::time::Duration::from_secs(2);
    let store = RedisStore::connect(settings).await.expect("connect");
    let cache = OverLimitCache::with_clock(store, 4, clock.clone());
    let requests = random_requests(2026, &ON_THE_MS);
    let answered = replay(&cache, &clock, &requests[..2000], true).await;
    eprintln!("over Redis the cache answered {answered} of 2000 requests");
    assert!(answered > 10, "the cache answered {answered} requests");
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
