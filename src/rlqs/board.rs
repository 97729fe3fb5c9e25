//! Where Envoys' demands meet: each report records one Envoy's demand for a bucket and reads
//! every live Envoy's, in process (one table per server) or in Redis (one hash per bucket, one
//! atomic script call), so every replica splits a limit over the same list.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use crate::store::{AnyStore, StoreError};

/// The script that records a demand and returns every live one.
pub const SCRIPT: &str = include_str!("../../lua/rlqs.lua");

/// One Envoy stream's demand for a bucket, in requests per second (`f64::INFINITY`: not known
/// yet, a bucket at its first report).
#[derive(Clone, Debug, PartialEq)]
pub struct Demand {
    /// The stream, unique across replicas (`<replica>-<stream>`).
    pub member: String,
    /// Requests per second, allowed and denied.
    pub rate: f64,
}

/// Records demands and reads them back; shared by every stream of a server.
pub trait DemandBoard: Send + Sync + 'static {
    /// Records `member`'s `rate` for the bucket `key`, live for `ttl` without a new report,
    /// and returns every live demand for it (this one included), sorted by member.
    fn exchange<'a>(
        &'a self,
        key: &'a str,
        member: &'a str,
        rate: f64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<Demand>, StoreError>>;

    /// Removes `member`'s demand for `key` (its stream ended or the bucket left it).
    fn leave<'a>(&'a self, key: &'a str, member: &'a str) -> BoxFuture<'a, ()>;
}

/// Each member's demand and when it expires, by member.
type Members = HashMap<String, (f64, Instant)>;

/// The board of a server without a shared store: a table in process.
#[derive(Default)]
pub struct MemoryBoard {
    buckets: Mutex<HashMap<String, Members>>,
}

impl MemoryBoard {
    /// Buckets with at least one live demand (for tests and the bench).
    pub fn len(&self) -> usize {
        self.buckets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no bucket has a demand.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn exchange_now(&self, key: &str, member: &str, rate: f64, ttl: Duration) -> Vec<Demand> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let members = buckets.entry(key.to_owned()).or_default();
        members.insert(member.to_owned(), (rate, now + ttl));
        members.retain(|_, (_, expires)| *expires > now);
        let mut live: Vec<Demand> = members
            .iter()
            .map(|(member, (rate, _))| Demand {
                member: member.clone(),
                rate: *rate,
            })
            .collect();
        live.sort_by(|a, b| a.member.cmp(&b.member));
        live
    }
}

impl DemandBoard for MemoryBoard {
    fn exchange<'a>(
        &'a self,
        key: &'a str,
        member: &'a str,
        rate: f64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<Demand>, StoreError>> {
        let live = self.exchange_now(key, member, rate, ttl);
        Box::pin(async move { Ok(live) })
    }

    fn leave<'a>(&'a self, key: &'a str, member: &'a str) -> BoxFuture<'a, ()> {
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(members) = buckets.get_mut(key) {
            members.remove(member);
            if members.is_empty() {
                buckets.remove(key);
            }
        }
        Box::pin(async {})
    }
}

/// The board on rlsd's store: Redis or Redis Cluster hold it, so replicas agree; the in-process
/// store gets a [`MemoryBoard`].
pub struct StoreBoard {
    store: Arc<AnyStore>,
    script: redis::Script,
    memory: MemoryBoard,
}

impl StoreBoard {
    /// The board on `store`.
    pub fn new(store: Arc<AnyStore>) -> StoreBoard {
        StoreBoard {
            store,
            script: redis::Script::new(SCRIPT),
            memory: MemoryBoard::default(),
        }
    }

    async fn run(
        &self,
        key: &str,
        member: &str,
        rate: &str,
        ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        let mut invocation = self.script.key(key);
        invocation
            .arg(member)
            .arg(rate)
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
        match &*self.store {
            AnyStore::Memory(_) => Err(StoreError::Config("no shared store".to_owned())),
            AnyStore::Redis(cache) => cache.inner().run_script(&invocation).await,
            AnyStore::Cluster(cluster) => cluster.run_script(&invocation).await,
        }
    }
}

/// Reads the script's flat `member, demand, ...` reply.
fn parse_reply(reply: Vec<String>) -> Result<Vec<Demand>, StoreError> {
    let mut live = Vec::with_capacity(reply.len() / 2);
    let mut items = reply.into_iter();
    while let Some(member) = items.next() {
        let rate = items
            .next()
            .and_then(|rate| rate.parse::<f64>().ok())
            .ok_or_else(|| StoreError::Protocol(format!("rlqs demand of {member} unreadable")))?;
        live.push(Demand { member, rate });
    }
    live.sort_by(|a, b| a.member.cmp(&b.member));
    Ok(live)
}

impl DemandBoard for StoreBoard {
    fn exchange<'a>(
        &'a self,
        key: &'a str,
        member: &'a str,
        rate: f64,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<Demand>, StoreError>> {
        if let AnyStore::Memory(_) = &*self.store {
            return self.memory.exchange(key, member, rate, ttl);
        }
        Box::pin(async move {
            let rate = if rate.is_finite() {
                format!("{rate:.3}")
            } else {
                "inf".to_owned()
            };
            parse_reply(self.run(key, member, &rate, ttl).await?)
        })
    }

    fn leave<'a>(&'a self, key: &'a str, member: &'a str) -> BoxFuture<'a, ()> {
        if let AnyStore::Memory(_) = &*self.store {
            return self.memory.leave(key, member);
        }
        Box::pin(async move {
            // Best effort: the entry expires by itself anyway.
            if let Err(error) = self.run(key, member, "", Duration::from_millis(1)).await {
                tracing::debug!(%error, "rlqs: demand not removed; it expires by itself");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_board_returns_live_demands_sorted_and_forgets_expired_ones() {
        let board = MemoryBoard::default();
        let long = Duration::from_secs(60);
        board
            .exchange("b", "z", 5.0, long)
            .await
            .unwrap_or_default();
        board
            .exchange("b", "x", 1.0, Duration::from_millis(1))
            .await
            .unwrap_or_default();
        tokio::time::sleep(Duration::from_millis(5)).await;
        let live = board
            .exchange("b", "y", f64::INFINITY, long)
            .await
            .unwrap_or_default();
        let members: Vec<&str> = live.iter().map(|d| d.member.as_str()).collect();
        assert_eq!(members, ["y", "z"]);
        board.leave("b", "y").await;
        board.leave("b", "z").await;
        assert!(board.is_empty());
    }

    #[test]
    fn script_replies_parse_and_bad_ones_are_protocol_errors() {
        let live = parse_reply(vec!["b".into(), "inf".into(), "a".into(), "2.5".into()]);
        assert_eq!(
            live.ok(),
            Some(vec![
                Demand {
                    member: "a".into(),
                    rate: 2.5
                },
                Demand {
                    member: "b".into(),
                    rate: f64::INFINITY
                },
            ])
        );
        assert!(parse_reply(vec!["a".into()]).is_err());
        assert!(parse_reply(vec!["a".into(), "x".into()]).is_err());
    }
}
