//! The behaviour suite every store must pass unchanged: the semantics of docs/algorithms.md through
//! the `Store` trait, on a clock the test drives. The Redis run uses a real redis-server.

use crate::common;

use std::sync::Arc;

use rlsd::algorithm::{Hits, Params, Verdict};
use rlsd::clock::ManualClock;
use rlsd::limit::Algorithm;
use rlsd::store::{Check, MemoryStore, Outcome, RedisSettings, RedisStore, Store, request_allowed};

const MS: u64 = 1_000;
const S: u64 = 1_000_000;
/// A minute boundary, so windows start where the tests expect.
const T0: u64 = common::T0;

fn check(
    key: &str,
    algorithm: Algorithm,
    limit: u64,
    period_us: u64,
    burst: u64,
    hits: Hits,
) -> Check {
    Check {
        key: key.to_owned(),
        params: Params {
            algorithm,
            limit,
            period_us,
            burst,
        },
        hits,
        shadow: false,
        quota_mode: false,
    }
}

async fn decide<S: Store>(store: &S, checks: &[Check]) -> Vec<Outcome> {
    store.decide(checks).await.expect("store answers")
}

async fn one<S: Store>(store: &S, check: &Check) -> Verdict {
    decide(store, std::slice::from_ref(check)).await[0].verdict
}

async fn take<S: Store>(
    store: &S,
    key: &str,
    algorithm: Algorithm,
    limit: u64,
    period_us: u64,
    burst: u64,
) -> Verdict {
    one(
        store,
        &check(key, algorithm, limit, period_us, burst, Hits::Take(1)),
    )
    .await
}

async fn gcra_worked_example<S: Store>(store: &S, clock: &ManualClock) {
    clock.set(T0);
    let first = take(store, "gcra1", Algorithm::Gcra, 10, S, 1).await;
    assert_eq!((first.allowed, first.reset_us), (true, 100 * MS));
    clock.set(T0 + 50 * MS);
    let early = take(store, "gcra1", Algorithm::Gcra, 10, S, 1).await;
    assert_eq!(
        (early.allowed, early.remaining, early.reset_us),
        (false, 0, 50 * MS)
    );
    clock.set(T0 + 100 * MS);
    assert!(
        take(store, "gcra1", Algorithm::Gcra, 10, S, 1)
            .await
            .allowed
    );
    clock.set(T0);
    let mut passes = Vec::new();
    for _ in 0..6 {
        passes.push(
            take(store, "gcra5", Algorithm::Gcra, 10, S, 5)
                .await
                .allowed,
        );
    }
    assert_eq!(passes, [true, true, true, true, true, false]);
}

async fn fixed_window_edge_burst<S: Store>(store: &S, clock: &ManualClock) {
    let mut allowed = 0;
    clock.set(T0 + 60 * S - MS);
    for _ in 0..11 {
        allowed += usize::from(
            take(store, "fw", Algorithm::FixedWindow, 10, 60 * S, 10)
                .await
                .allowed,
        );
    }
    clock.set(T0 + 60 * S + MS);
    for _ in 0..11 {
        allowed += usize::from(
            take(store, "fw", Algorithm::FixedWindow, 10, 60 * S, 10)
                .await
                .allowed,
        );
    }
    assert_eq!(allowed, 20, "2L within two milliseconds across the edge");
    let v = take(store, "fw", Algorithm::FixedWindow, 10, 60 * S, 10).await;
    assert_eq!(
        (v.allowed, v.remaining, v.reset_us),
        (false, 0, 60 * S - MS)
    );
}

async fn sliding_log_exactness<S: Store>(store: &S, clock: &ManualClock) {
    let log = |hits| check("swl", Algorithm::SlidingWindowLog, 4, 10 * S, 4, hits);
    for t in [0, 1, 2, 3] {
        clock.set(T0 + t * S);
        assert!(one(store, &log(Hits::Take(1))).await.allowed);
    }
    clock.set(T0 + 5 * S);
    let denied = one(store, &log(Hits::Take(3))).await;
    assert_eq!(
        (denied.allowed, denied.remaining, denied.reset_us),
        (false, 0, 7 * S)
    );
    clock.set(T0 + 10 * S);
    let one_left = one(store, &log(Hits::Take(1))).await;
    assert_eq!((one_left.allowed, one_left.remaining), (true, 0));
    clock.set(T0 + 12 * S - 1);
    assert!(!one(store, &log(Hits::Take(2))).await.allowed);
    clock.set(T0 + 12 * S);
    assert!(one(store, &log(Hits::Take(2))).await.allowed);
}

async fn sliding_counter_weights<S: Store>(store: &S, clock: &ManualClock) {
    clock.set(T0 + 30 * S);
    for _ in 0..10 {
        assert!(
            take(
                store,
                "swc",
                Algorithm::SlidingWindowCounter,
                10,
                60 * S,
                10
            )
            .await
            .allowed
        );
    }
    clock.set(T0 + 75 * S);
    let mut allowed = 0;
    for _ in 0..5 {
        allowed += usize::from(
            take(
                store,
                "swc",
                Algorithm::SlidingWindowCounter,
                10,
                60 * S,
                10,
            )
            .await
            .allowed,
        );
    }
    assert_eq!(allowed, 2);
    let denied = take(
        store,
        "swc",
        Algorithm::SlidingWindowCounter,
        10,
        60 * S,
        10,
    )
    .await;
    assert_eq!((denied.allowed, denied.reset_us), (false, 3 * S));
    clock.set(T0 + 78 * S);
    assert!(
        take(
            store,
            "swc",
            Algorithm::SlidingWindowCounter,
            10,
            60 * S,
            10
        )
        .await
        .allowed
    );
}

async fn token_bucket_refill<S: Store>(store: &S, clock: &ManualClock) {
    clock.set(T0);
    let mut allowed = 0;
    for _ in 0..6 {
        allowed += usize::from(
            take(store, "tb", Algorithm::TokenBucket, 10, S, 5)
                .await
                .allowed,
        );
    }
    assert_eq!(allowed, 5);
    clock.set(T0 + 250 * MS);
    let v = take(store, "tb", Algorithm::TokenBucket, 10, S, 5).await;
    assert_eq!((v.allowed, v.remaining, v.reset_us), (true, 1, 350 * MS));
}

/// A refund restores at most what the limit holds, and never less: after taking 3, refunding
/// 1,000 and then 10^9, exactly the capacity passes again, one hit at a time, with the clock
/// moving on a millisecond per call.
async fn refunds_restore_exactly_the_capacity<S: Store>(store: &S, clock: &ManualClock) {
    for algorithm in Algorithm::ALL {
        let mut now = T0 + 11 * S;
        clock.set(now);
        let key = format!("refund-{algorithm}");
        let c = |hits| check(&key, algorithm, 10, 3_600 * S, 10, hits);
        assert!(one(store, &c(Hits::Take(3))).await.allowed, "{algorithm}");
        let v = one(store, &c(Hits::Refund(1_000))).await;
        assert_eq!(
            (v.allowed, v.remaining),
            (true, 10),
            "{algorithm}: refund 1000"
        );
        let v = one(store, &c(Hits::Refund(1_000_000_000))).await;
        assert_eq!(
            (v.allowed, v.remaining),
            (true, 10),
            "{algorithm}: refund 10^9"
        );
        let mut allowed = 0;
        for _ in 0..14 {
            now += MS;
            clock.set(now);
            allowed += usize::from(one(store, &c(Hits::Take(1))).await.allowed);
        }
        assert_eq!(allowed, 10, "{algorithm}: single hits after the refunds");
    }
}

async fn hits_peek_refund_and_capacity<S: Store>(store: &S, clock: &ManualClock) {
    clock.set(T0 + 7 * S);
    for algorithm in Algorithm::ALL {
        let key = format!("hits-{algorithm}");
        let c = |hits| check(&key, algorithm, 10, 60 * S, 10, hits);
        let v = one(store, &c(Hits::Take(7))).await;
        assert_eq!((v.allowed, v.remaining), (true, 3), "{algorithm}");
        let v = one(store, &c(Hits::Take(4))).await;
        assert_eq!((v.allowed, v.remaining), (false, 3), "{algorithm}");
        let v = one(store, &c(Hits::Peek)).await;
        assert_eq!(
            (v.allowed, v.remaining),
            (true, 3),
            "{algorithm}: a peek takes nothing"
        );
        // Never passing, so a fixed window says when it ends, the others a period.
        let never = match algorithm {
            Algorithm::FixedWindow => 60 * S - (T0 + 7 * S) % (60 * S),
            _ => 60 * S,
        };
        let v = one(store, &c(Hits::Take(11))).await;
        assert_eq!(
            (v.allowed, v.remaining, v.reset_us),
            (false, 3, never),
            "{algorithm}: more than capacity"
        );
        let v = one(store, &c(Hits::Refund(5))).await;
        assert_eq!((v.allowed, v.remaining), (true, 8), "{algorithm}");
        one(store, &c(Hits::Refund(50))).await;
        let v = one(store, &c(Hits::Take(10))).await;
        assert_eq!(
            (v.allowed, v.remaining),
            (true, 0),
            "{algorithm}: refunds stop at fresh"
        );
        let v = one(store, &c(Hits::Peek)).await;
        assert!(!v.allowed, "{algorithm}: a peek at the limit is over");
        let zero = check(
            &format!("zero-{algorithm}"),
            algorithm,
            0,
            60 * S,
            1,
            Hits::Take(1),
        );
        let v = one(store, &zero).await;
        assert_eq!(
            (v.allowed, v.reset_us),
            (false, never),
            "{algorithm}: L = 0"
        );
    }
}

/// A charge recorded past the limit answers the state it leaves: nothing remaining, and the
/// reset a check right after it reports (issue 41: `chg` 5/hour, charged 3 twice, said 2 left).
async fn a_recorded_charge_reports_what_is_left<S: Store>(store: &S, clock: &ManualClock) {
    for algorithm in Algorithm::ALL {
        clock.set(T0 + 5 * S);
        let key = format!("chg-{algorithm}");
        let c = |hits| check(&key, algorithm, 5, 3_600 * S, 5, hits);
        let first = one(store, &c(Hits::Charge(3))).await;
        assert_eq!((first.allowed, first.remaining), (true, 2), "{algorithm}");
        let second = one(store, &c(Hits::Charge(3))).await;
        let after = one(store, &c(Hits::Peek)).await;
        assert_eq!(
            (second.allowed, second.remaining),
            (false, 0),
            "{algorithm}: the 3 hits were recorded, so nothing is left"
        );
        assert_eq!(
            second, after,
            "{algorithm}: the answer is the state after it"
        );
        if algorithm == Algorithm::FixedWindow {
            assert_eq!(second.reset_us, 3_600 * S - (T0 + 5 * S) % (3_600 * S));
        }
        // More than the capacity at once: recorded too, and answered the same way.
        let key = format!("chg-big-{algorithm}");
        let c = |hits| check(&key, algorithm, 5, 3_600 * S, 5, hits);
        let big = one(store, &c(Hits::Charge(8))).await;
        let after = one(store, &c(Hits::Peek)).await;
        assert_eq!(
            (big.allowed, big.remaining),
            (false, 0),
            "{algorithm}: 8 of 5"
        );
        assert_eq!(big, after, "{algorithm}: 8 of 5, the state after it");
    }
}

async fn denied_requests_consume_nothing<S: Store>(store: &S, clock: &ManualClock) {
    clock.set(T0);
    let plan = check(
        "plan",
        Algorithm::SlidingWindowLog,
        10,
        60 * S,
        10,
        Hits::Take(1),
    );
    let endpoint = check(
        "endpoint",
        Algorithm::FixedWindow,
        1,
        60 * S,
        1,
        Hits::Take(1),
    );
    let both = [plan.clone(), endpoint];
    assert!(request_allowed(&both, &decide(store, &both).await));
    for _ in 0..3 {
        let outcomes = decide(store, &both).await;
        assert!(!request_allowed(&both, &outcomes));
        assert_eq!(
            (outcomes[0].verdict.allowed, outcomes[0].verdict.remaining),
            (true, 9)
        );
        assert!(!outcomes[1].verdict.allowed);
    }
    assert_eq!(one(store, &plan).await.remaining, 8);
    // A shadow check never blocks the others.
    let mut shadow = check("shadow", Algorithm::Gcra, 1, 60 * S, 1, Hits::Take(1));
    shadow.shadow = true;
    one(store, &shadow).await;
    let with_shadow = [shadow, plan.clone()];
    let outcomes = decide(store, &with_shadow).await;
    assert!(!outcomes[0].verdict.allowed);
    assert!(request_allowed(&with_shadow, &outcomes));
    assert_eq!(outcomes[1].verdict.remaining, 7);
}

async fn a_key_twice_in_one_request<S: Store>(store: &S, clock: &ManualClock) {
    clock.set(T0);
    for algorithm in Algorithm::ALL {
        let c = check(
            &format!("twice-{algorithm}"),
            algorithm,
            3,
            60 * S,
            3,
            Hits::Take(1),
        );
        let outcomes = decide(store, &[c.clone(), c.clone(), c.clone()]).await;
        let remaining: Vec<u64> = outcomes.iter().map(|o| o.verdict.remaining).collect();
        assert_eq!(remaining, [2, 1, 0], "{algorithm}");
        assert!(
            !one(store, &c).await.allowed,
            "{algorithm}: all three were charged"
        );
    }
}

async fn a_clock_stepping_back_grants_nothing<S: Store>(store: &S, clock: &ManualClock) {
    for algorithm in Algorithm::ALL {
        let key = format!("back-{algorithm}");
        clock.set(T0 + 130 * S);
        for _ in 0..5 {
            assert!(
                take(store, &key, algorithm, 5, 60 * S, 5).await.allowed,
                "{algorithm}"
            );
        }
        for back in [S, 60 * S, 90 * S] {
            clock.set(T0 + 130 * S - back);
            assert!(
                !take(store, &key, algorithm, 5, 60 * S, 5).await.allowed,
                "{algorithm} -{back}"
            );
        }
    }
}

/// A small deterministic generator, so a failing sequence can be replayed from its seed.
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

/// Random requests over a few keys, answered by the store under test and by a fresh in-process
/// store: every answer must be identical.
async fn random_sequences_match_the_reference<S: Store>(store: &S, clock: &ManualClock) {
    for seed in [0x5eed, 7, 1_000_003] {
        random_sequence(store, clock, seed).await;
    }
}

/// Twelve keys of every algorithm, with small limits and periods of 1 s to 1 min.
fn random_shapes(seed: u64) -> Vec<(String, Params)> {
    (0..12)
        .map(|i| {
            let algorithm = Algorithm::ALL[i % 5];
            let limit = [1, 3, 7, 20][i % 4];
            let period_us = [S, 10 * S, 60 * S][i % 3];
            let burst = if algorithm.takes_burst() {
                [1, 4, 9][i % 3]
            } else {
                limit
            };
            (
                format!("rand-{seed}-{i}"),
                Params {
                    algorithm,
                    limit,
                    period_us,
                    burst,
                },
            )
        })
        .collect()
}

/// One random request: 1 to 3 checks (a key may repeat), mostly single takes, some peeks,
/// refunds, large takes and shadow checks.
/// Quota mode is drawn from `quota` so the main sequence stays what it was before quota mode.
fn random_checks(rng: &mut Lcg, quota: &mut Lcg, shapes: &[(String, Params)]) -> Vec<Check> {
    (0..1 + rng.next(3))
        .map(|_| {
            let (key, params) = &shapes[rng.next(shapes.len() as u64) as usize];
            let hits = match rng.next(11) {
                0 => Hits::Peek,
                1 => Hits::Refund(1 + rng.next(3)),
                2 => Hits::Take(1 + rng.next(25)),
                3 => Hits::Charge(1 + rng.next(30)),
                _ => Hits::Take(1),
            };
            Check {
                key: key.clone(),
                params: *params,
                hits,
                shadow: rng.next(8) == 0,
                quota_mode: quota.next(4) == 0,
            }
        })
        .collect()
}

/// The clock's next step: none, a µs, a ms, or up to 3 s.
fn random_step(rng: &mut Lcg) -> u64 {
    [0, 1, 999, 50 * MS, 700 * MS, 3 * S][rng.next(6) as usize]
}

async fn random_sequence<S: Store>(store: &S, clock: &ManualClock, seed: u64) {
    let reference_clock = ManualClock::at(T0);
    let reference = MemoryStore::with_clock(10_000, reference_clock.clone());
    let mut rng = Lcg(seed);
    let mut quota = Lcg(!seed);
    let mut now = T0 + 1_234_567;
    let shapes = random_shapes(seed);
    for step in 0..1500 {
        now += random_step(&mut rng);
        clock.set(now);
        reference_clock.set(now);
        let checks = random_checks(&mut rng, &mut quota, &shapes);
        let got = decide(store, &checks).await;
        let want = decide(&reference, &checks).await;
        if std::env::var_os("RLSD_TRACE").is_some() {
            eprintln!("{step} {now} {checks:?}\n  -> {want:?}");
        }
        assert_eq!(got, want, "seed {seed} step {step} at {now}: {checks:?}");
    }
}

/// Random batches of up to 24 requests, each batch decided by one call of the script, answer
/// for answer the same as the in-process store deciding the requests one after another: what
/// the coalescing store relies on, including keys that several requests of a call share.
#[tokio::test]
async fn random_batches_in_one_call_match_the_reference() {
    let redis = rlsd_testkit::redis::RedisServer::start();
    let mut connection = ::redis::Client::open(redis.url())
        .and_then(|client| client.get_connection())
        .expect("connect");
    ::redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(rlsd::store::redis::SCRIPT)
        .exec(&mut connection)
        .expect("script loads");
    for seed in [0xba7c, 11, 424_242] {
        let clock = ManualClock::at(T0);
        let reference = MemoryStore::with_clock(10_000, clock.clone());
        let mut rng = Lcg(seed);
        let mut quota = Lcg(!seed);
        let mut now = T0 + 7_654_321;
        let shapes = random_shapes(seed);
        for step in 0..250 {
            now += random_step(&mut rng);
            clock.set(now);
            let batch: Vec<Vec<Check>> = (0..1 + rng.next(24))
                .map(|_| random_checks(&mut rng, &mut quota, &shapes))
                .collect();
            let requests: Vec<&[Check]> = batch.iter().map(Vec::as_slice).collect();
            let got: String = rlsd::store::redis::script_command(&requests, Some(&clock))
                .query(&mut connection)
                .expect("one call");
            let mut want = Vec::new();
            for checks in &batch {
                for outcome in decide(&reference, checks).await {
                    let verdict = outcome.verdict;
                    want.push(format!(
                        "{} {} {}",
                        u8::from(verdict.allowed),
                        verdict.remaining,
                        verdict.reset_us
                    ));
                }
            }
            // The reply starts with the script's clock.
            assert_eq!(
                got,
                format!("{now} {}", want.join(" ")),
                "seed {seed} step {step} at {now}: {batch:?}"
            );
        }
    }
}

macro_rules! behaviour_suite {
    ($store:ident, $make:path) => {
        mod $store {
            use super::*;

            behaviour_suite!(@tests $make;
                gcra_worked_example,
                fixed_window_edge_burst,
                sliding_log_exactness,
                sliding_counter_weights,
                token_bucket_refill,
                hits_peek_refund_and_capacity,
                refunds_restore_exactly_the_capacity,
                a_recorded_charge_reports_what_is_left,
                denied_requests_consume_nothing,
                a_key_twice_in_one_request,
                a_clock_stepping_back_grants_nothing,
                random_sequences_match_the_reference,
            );
        }
    };
    (@tests $make:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                let (store, clock, _guard) = $make().await;
                super::$name(&store, &clock).await;
            }
        )*
    };
}

async fn memory_store() -> (MemoryStore<ManualClock>, ManualClock, ()) {
    let clock = ManualClock::at(T0);
    (MemoryStore::with_clock(10_000, clock.clone()), clock, ())
}

async fn redis_store() -> (RedisStore, ManualClock, rlsd_testkit::redis::RedisServer) {
    redis_store_batching(rlsd::store::redis::DEFAULT_MAX_BATCH).await
}

async fn redis_store_unbatched() -> (RedisStore, ManualClock, rlsd_testkit::redis::RedisServer) {
    redis_store_batching(1).await
}

async fn redis_store_batching(
    max_batch: usize,
) -> (RedisStore, ManualClock, rlsd_testkit::redis::RedisServer) {
    let server = rlsd_testkit::redis::RedisServer::start();
    let clock = ManualClock::at(T0);
    let mut settings = RedisSettings::new(server.url());
    settings.max_batch = max_batch;
    // Generous: debug builds on a loaded CI machine; the timeout itself is tested elsewhere.
    settings.command_timeout = std::time::Duration::from_secs(2);
    settings.fixed_clock = Some(Arc::new(clock.clone()));
    let store = RedisStore::connect(settings).await.expect("connect");
    (store, clock, server)
}

behaviour_suite!(memory, memory_store);
behaviour_suite!(redis, redis_store);
behaviour_suite!(redis_unbatched, redis_store_unbatched);

/// The whole suite against one real Redis Cluster (started once: it takes seconds), each
/// scenario on keys of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_passes_the_whole_suite() {
    let cluster = rlsd_testkit::cluster::RedisCluster::start();
    let clock = ManualClock::at(T0);
    let mut settings = rlsd::store::ClusterSettings::new(cluster.urls());
    settings.command_timeout = std::time::Duration::from_secs(2);
    settings.fixed_clock = Some(Arc::new(clock.clone()));
    let store = rlsd::store::ClusterStore::connect(settings)
        .await
        .expect("connect");
    gcra_worked_example(&store, &clock).await;
    fixed_window_edge_burst(&store, &clock).await;
    sliding_log_exactness(&store, &clock).await;
    sliding_counter_weights(&store, &clock).await;
    token_bucket_refill(&store, &clock).await;
    hits_peek_refund_and_capacity(&store, &clock).await;
    refunds_restore_exactly_the_capacity(&store, &clock).await;
    a_recorded_charge_reports_what_is_left(&store, &clock).await;
    denied_requests_consume_nothing(&store, &clock).await;
    a_key_twice_in_one_request(&store, &clock).await;
    a_clock_stepping_back_grants_nothing(&store, &clock).await;
    random_sequences_match_the_reference(&store, &clock).await;
}
