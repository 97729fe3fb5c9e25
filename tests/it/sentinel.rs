//! The Redis store through Redis Sentinel: decides on the master, and follows a failover.

use std::time::{Duration, Instant};

use rlsd::algorithm::{Hits, Params};
use rlsd::limit::Algorithm;
use rlsd::store::redis::SentinelTarget;
use rlsd::store::{Check, RedisSettings, RedisStore, Store};
use rlsd_testkit::sentinel::{MASTER_NAME, RedisSentinel};

fn check() -> Check {
    Check {
        key: "rlsd:_:s:fw:86400:k=v".to_owned(),
        params: Params {
            algorithm: Algorithm::FixedWindow,
            limit: 1_000_000,
            period_us: 86_400_000_000,
            burst: 1_000_000,
        },
        hits: Hits::Take(1),
        shadow: false,
        quota_mode: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_sentinel_failover() {
    let mut redis = RedisSentinel::start();
    let mut settings = RedisSettings::new("");
    settings.sentinel = Some(SentinelTarget {
        sentinels: redis.sentinel_urls(),
        master_name: MASTER_NAME.to_owned(),
    });
    settings.command_timeout = Duration::from_millis(300);
    let store = RedisStore::connect(settings).await.expect("connect");
    for expected in 1..=3u64 {
        let outcome = store
            .decide(&[check()])
            .await
            .expect("decided on the master")[0];
        assert_eq!(outcome.verdict.remaining, 1_000_000 - expected);
    }

    redis.kill_master();
    let started = Instant::now();
    let mut failed = 0;
    loop {
        let asked = Instant::now();
        let answer = store.decide(&[check()]).await;
        assert!(
            asked.elapsed() < Duration::from_secs(3),
            "a call hung: {:?}",
            asked.elapsed()
        );
        match answer {
            Ok(outcomes) => {
                assert!(outcomes[0].verdict.allowed);
                if failed > 0 {
                    break;
                }
            }
            Err(_) => failed += 1,
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the store never found the new master"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    redis.wait_for_promotion();
    // The promoted replica had the counts: nothing was lost in the failover.
    let outcome = store
        .decide(&[check()])
        .await
        .expect("decided on the new master")[0];
    assert!(outcome.verdict.remaining <= 1_000_000 - 4, "{outcome:?}");
}
