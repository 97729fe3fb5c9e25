use std::sync::Arc;

use super::*;
use crate::algorithm::{Hits, Params};
use crate::clock::ManualClock;
use crate::limit::Algorithm;

const S: u64 = 1_000_000;

fn check(key: &str, algorithm: Algorithm, limit: u64, hits: Hits) -> Check {
    Check {
        key: key.to_owned(),
        params: Params {
            algorithm,
            limit,
            period_us: 60 * S,
            burst: limit,
        },
        hits,
        shadow: false,
        quota_mode: false,
    }
}

fn allowed(outcomes: &[Outcome]) -> Vec<bool> {
    outcomes.iter().map(|o| o.verdict.allowed).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_on_one_key_admit_exactly_the_limit() {
    for algorithm in Algorithm::ALL {
        let store = Arc::new(MemoryStore::with_clock(1000, ManualClock::at(7 * S)));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    let mut ok = 0;
                    for _ in 0..100 {
                        let checks = [check("k", algorithm, 1000, Hits::Take(1))];
                        let outcomes = store.decide(&checks).await.expect("decide");
                        ok += usize::from(request_allowed(&checks, &outcomes));
                    }
                    ok
                })
            })
            .collect();
        let mut total = 0;
        for task in tasks {
            total += task.await.expect("task");
        }
        assert_eq!(total, 1000, "{algorithm}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_multi_key_requests_neither_deadlock_nor_over_admit() {
    let store = Arc::new(MemoryStore::with_clock(1000, ManualClock::at(0)));
    let tasks: Vec<_> = (0..32)
        .map(|t| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut ok = 0;
                for i in 0..200 {
                    // Keys in both orders, so a naive lock order would deadlock.
                    let (a, b) = if (t + i) % 2 == 0 {
                        ("a", "b")
                    } else {
                        ("b", "a")
                    };
                    let checks = [
                        check(a, Algorithm::FixedWindow, 500, Hits::Take(1)),
                        check(b, Algorithm::FixedWindow, 500, Hits::Take(1)),
                    ];
                    let outcomes = store.decide(&checks).await.expect("decide");
                    ok += usize::from(request_allowed(&checks, &outcomes));
                }
                ok
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("task");
    }
    assert_eq!(total, 500);
}

#[tokio::test]
async fn a_denied_request_consumes_nothing_from_its_other_limits() {
    let store = MemoryStore::with_clock(100, ManualClock::at(0));
    let plan = |hits| check("plan", Algorithm::SlidingWindowLog, 10, hits);
    let endpoint = |hits| check("endpoint", Algorithm::FixedWindow, 1, hits);
    let first = store
        .decide(&[plan(Hits::Take(1)), endpoint(Hits::Take(1))])
        .await
        .expect("decide");
    assert_eq!(allowed(&first), [true, true]);
    assert_eq!(first[0].verdict.remaining, 9);
    for _ in 0..5 {
        let denied = store
            .decide(&[plan(Hits::Take(1)), endpoint(Hits::Take(1))])
            .await
            .expect("decide");
        assert_eq!(allowed(&denied), [true, false]);
        // The plan limit would have passed; it reports what it still has, untouched.
        assert_eq!(denied[0].verdict.remaining, 9);
    }
    let plan_alone = store.decide(&[plan(Hits::Take(1))]).await.expect("decide");
    assert_eq!(plan_alone[0].verdict.remaining, 8);
}

#[tokio::test]
async fn shadow_checks_never_deny() {
    let store = MemoryStore::with_clock(100, ManualClock::at(0));
    let mut shadow = check("s", Algorithm::FixedWindow, 1, Hits::Take(1));
    shadow.shadow = true;
    let other = check("o", Algorithm::FixedWindow, 10, Hits::Take(1));
    store.decide(&[shadow.clone()]).await.expect("decide");
    let outcomes = store
        .decide(&[shadow, other.clone()])
        .await
        .expect("decide");
    assert_eq!(allowed(&outcomes), [false, true]);
    let again = store.decide(&[other]).await.expect("decide");
    assert_eq!(
        again[0].verdict.remaining, 8,
        "the request went through and counted"
    );
}

#[tokio::test]
async fn a_key_twice_in_one_request_is_charged_twice() {
    let store = MemoryStore::with_clock(100, ManualClock::at(0));
    let c = check("k", Algorithm::TokenBucket, 3, Hits::Take(2));
    let outcomes = store.decide(&[c.clone(), c.clone()]).await.expect("decide");
    assert_eq!(allowed(&outcomes), [true, false]);
    let outcomes = store
        .decide(&vec![
            check("k", Algorithm::TokenBucket, 3, Hits::Take(1));
            3
        ])
        .await
        .expect("decide");
    assert_eq!(allowed(&outcomes), [true, true, true]);
    assert_eq!(outcomes[2].verdict.remaining, 0);
}

#[tokio::test]
async fn expired_keys_are_reclaimed_and_the_cap_holds() {
    let clock = ManualClock::at(0);
    let store = MemoryStore::with_clock(3, clock.clone());
    for key in ["a", "b", "c"] {
        store
            .decide(&[check(key, Algorithm::FixedWindow, 5, Hits::Take(1))])
            .await
            .expect("room for three");
    }
    assert_eq!(store.stats().live_keys, 3);
    let mut keys = store.keys();
    keys.sort();
    assert_eq!(keys, ["a", "b", "c"]);
    let full = store
        .decide(&[check("d", Algorithm::FixedWindow, 5, Hits::Take(1))])
        .await;
    assert!(matches!(full, Err(StoreError::Full { capacity: 3 })));
    assert_eq!(store.stats().full_rejections, 1);
    // Existing keys keep working at the cap.
    store
        .decide(&[check("a", Algorithm::FixedWindow, 5, Hits::Take(1))])
        .await
        .expect("existing key");
    // One window plus the expiry slack later everything has expired.
    clock.set(62 * S);
    assert_eq!(store.purge_expired(), 3);
    assert_eq!(store.stats().live_keys, 0);
    assert!(store.keys().is_empty());
    store
        .decide(&[check("d", Algorithm::FixedWindow, 5, Hits::Take(1))])
        .await
        .expect("room again");
}

#[tokio::test]
async fn a_full_store_reclaims_expired_keys_before_refusing() {
    let clock = ManualClock::at(0);
    let store = MemoryStore::with_clock(1, clock.clone());
    store
        .decide(&[check("a", Algorithm::Gcra, 5, Hits::Take(1))])
        .await
        .expect("first key");
    clock.advance(120 * S);
    store
        .decide(&[check("b", Algorithm::Gcra, 5, Hits::Take(1))])
        .await
        .expect("expired key a makes room without a sweep");
    assert_eq!(store.stats().live_keys, 1);
}

#[tokio::test]
async fn state_written_while_the_clock_is_behind_does_not_expire_early() {
    for algorithm in [
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::TokenBucket,
    ] {
        let clock = ManualClock::at(130 * S);
        let store = MemoryStore::with_clock(100, clock.clone());
        let c = check("k", algorithm, 2, Hits::Take(1));
        assert!(
            store
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide")[0]
                .verdict
                .allowed
        );
        // The clock steps back 90 s; a second hit is written from there.
        clock.set(40 * S);
        assert!(
            store
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide")[0]
                .verdict
                .allowed,
            "{algorithm}"
        );
        // Past a TTL counted from the stepped-back clock, but not past the state's own time.
        clock.set(105 * S);
        store.purge_expired();
        assert!(
            !store
                .decide(std::slice::from_ref(&c))
                .await
                .expect("decide")[0]
                .verdict
                .allowed,
            "{algorithm}"
        );
    }
}
