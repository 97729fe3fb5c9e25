//! Where Envoys' demands meet: each report records one Envoy's demand for a bucket and reads
//! every live Envoy's, in process (one table per server) or in Redis (one hash per bucket, one
//! atomic script call), so every replica splits a limit over the same list.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use tokio::sync::Notify;

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

/// A demand that moved by more than this fraction (or a member that came or went) is a
/// material change: the bucket's other holders recompute at once.
pub const MATERIAL: f64 = 0.05;

/// The Redis channel a material change is published on: `<member> <board key>`.
pub const CHANNEL: &str = "rlqs:changed";

/// Whether a member's demand going from `old` to `new` (`None`: absent) is material.
fn material(old: Option<f64>, new: Option<f64>) -> bool {
    match (old, new) {
        (Some(old), Some(new)) if old.is_finite() && new.is_finite() => {
            (new - old).abs() > MATERIAL * old.max(new)
        }
        (Some(old), Some(new)) => old != new,
        (old, new) => old.is_some() != new.is_some(),
    }
}

/// One stream's wake-up: the board keys whose demands changed since it last looked.
#[derive(Default)]
pub struct Wake {
    changed: Mutex<HashSet<String>>,
    notify: Notify,
}

impl Wake {
    /// Resolves once a key changed since the last [`Wake::take`] (at once if one did).
    pub async fn changed(&self) {
        self.notify.notified().await;
    }

    /// The keys changed since the last call, emptied.
    pub fn take(&self) -> HashSet<String> {
        std::mem::take(&mut *self.changed.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Which streams of this server hold which board key, to wake them when it changes.
#[derive(Default)]
pub struct Signals {
    holders: Mutex<HashMap<String, HashMap<String, Arc<Wake>>>>,
}

impl Signals {
    /// `member` (woken through `wake`) holds `key`.
    pub fn hold(&self, key: &str, member: &str, wake: &Arc<Wake>) {
        let mut holders = self.holders.lock().unwrap_or_else(PoisonError::into_inner);
        // Called at every report: allocates only when the stream starts holding the key.
        if holders
            .get(key)
            .is_some_and(|members| members.contains_key(member))
        {
            return;
        }
        holders
            .entry(key.to_owned())
            .or_default()
            .insert(member.to_owned(), Arc::clone(wake));
    }

    /// `member` no longer holds `key`.
    pub fn release(&self, key: &str, member: &str) {
        let mut holders = self.holders.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(members) = holders.get_mut(key) {
            members.remove(member);
            if members.is_empty() {
                holders.remove(key);
            }
        }
    }

    /// `key`'s demands changed materially by `by`'s hand: wakes every other holder.
    pub fn changed(&self, key: &str, by: &str) {
        let holders = self.holders.lock().unwrap_or_else(PoisonError::into_inner);
        for (member, wake) in holders.get(key).into_iter().flatten() {
            if member != by {
                wake.changed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key.to_owned());
                wake.notify.notify_one();
            }
        }
    }
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

    /// Every live demand for `key`, writing nothing: a holder's recompute after a change.
    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<Demand>, StoreError>>;

    /// Removes `member`'s demand for `key` (its stream ended or the bucket left it).
    fn leave<'a>(&'a self, key: &'a str, member: &'a str) -> BoxFuture<'a, ()>;

    /// Where this server's streams learn that a key they hold changed materially (another
    /// stream's report, on this replica or, through the store, another).
    fn signals(&self) -> &Signals;
}

/// Each member's demand and when it expires, by member.
type Members = HashMap<String, (f64, Instant)>;

/// The board of a server without a shared store: a table in process.
#[derive(Default)]
pub struct MemoryBoard {
    buckets: Mutex<HashMap<String, Members>>,
    signals: Signals,
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

    /// Records `rate` for `member` (`None`: only reads) and returns the live demands.
    fn exchange_now(
        &self,
        key: &str,
        member: &str,
        rate: Option<f64>,
        ttl: Duration,
    ) -> Vec<Demand> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(members) = (match rate {
            Some(_) => Some(buckets.entry(key.to_owned()).or_default()),
            None => buckets.get_mut(key),
        }) else {
            return Vec::new();
        };
        let before = members.len();
        let mut changed = false;
        if let Some(rate) = rate {
            let old = members.insert(member.to_owned(), (rate, now + ttl));
            changed = material(old.map(|(old, _)| old), Some(rate));
        }
        members.retain(|_, (_, expires)| *expires > now);
        changed |= members.len() < before;
        let mut live: Vec<Demand> = members
            .iter()
            .map(|(member, (rate, _))| Demand {
                member: member.clone(),
                rate: *rate,
            })
            .collect();
        live.sort_by(|a, b| a.member.cmp(&b.member));
        drop(buckets);
        if changed {
            self.signals.changed(key, member);
        }
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
        let live = self.exchange_now(key, member, Some(rate), ttl);
        Box::pin(async move { Ok(live) })
    }

    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<Demand>, StoreError>> {
        let live = self.exchange_now(key, "", None, Duration::ZERO);
        Box::pin(async move { Ok(live) })
    }

    fn leave<'a>(&'a self, key: &'a str, member: &'a str) -> BoxFuture<'a, ()> {
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let mut left = false;
        if let Some(members) = buckets.get_mut(key) {
            left = members.remove(member).is_some();
            if members.is_empty() {
                buckets.remove(key);
            }
        }
        drop(buckets);
        if left {
            self.signals.changed(key, member);
        }
        Box::pin(async {})
    }

    fn signals(&self) -> &Signals {
        &self.signals
    }
}

/// The board on rlsd's store: Redis or Redis Cluster hold it, so replicas agree; the in-process
/// store gets a [`MemoryBoard`].
pub struct StoreBoard {
    store: Arc<AnyStore>,
    script: redis::Script,
    memory: MemoryBoard,
    /// Fed by this replica's subscriber to [`CHANNEL`], on Redis and Cluster.
    signals: Arc<Signals>,
}

/// The subscriber's pause between attempts to (re)connect.
const RESUBSCRIBE_DELAY: Duration = Duration::from_millis(500);

impl StoreBoard {
    /// The board on `store`; on Redis or Cluster, with a task (so this runs inside a Tokio
    /// runtime) holding one subscriber connection that wakes this replica's streams.
    pub fn new(store: Arc<AnyStore>) -> StoreBoard {
        let signals = Arc::new(Signals::default());
        let clients = match &*store {
            AnyStore::Memory(_) => Vec::new(),
            AnyStore::Redis(cache) => cache.inner().pubsub_client().into_iter().collect(),
            AnyStore::Cluster(cluster) => cluster.pubsub_clients(),
        };
        if !clients.is_empty() {
            tokio::spawn(subscribe(clients, Arc::downgrade(&signals)));
        }
        StoreBoard {
            store,
            script: redis::Script::new(SCRIPT),
            memory: MemoryBoard::default(),
            signals,
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
            .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg(CHANNEL)
            .arg(MATERIAL);
        match &*self.store {
            AnyStore::Memory(_) => Err(StoreError::Config("no shared store".to_owned())),
            AnyStore::Redis(cache) => cache.inner().run_script(&invocation).await,
            AnyStore::Cluster(cluster) => cluster.run_script(&invocation).await,
        }
    }
}

/// The replica's one subscriber to [`CHANNEL`] (a published message reaches every node of a
/// cluster), reconnecting through `clients` in turn until the board is gone; a message missed
/// while it reconnects only delays a recompute to the holder's next report.
async fn subscribe(clients: Vec<redis::Client>, signals: std::sync::Weak<Signals>) {
    for client in clients.iter().cycle() {
        if signals.strong_count() == 0 {
            return;
        }
        let connect = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(CHANNEL).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match tokio::time::timeout(RESUBSCRIBE_DELAY * 4, connect).await {
            Ok(Ok(mut pubsub)) => {
                let mut messages = pubsub.on_message();
                while let Some(message) = messages.next().await {
                    let Some(signals) = signals.upgrade() else {
                        return;
                    };
                    let payload: Vec<u8> = message.get_payload_bytes().to_vec();
                    if let Ok(payload) = std::str::from_utf8(&payload)
                        && let Some((by, key)) = payload.split_once(' ')
                    {
                        signals.changed(key, by);
                    }
                }
                tracing::debug!("rlqs: change subscriber disconnected; reconnecting");
            }
            Ok(Err(error)) => tracing::debug!(%error, "rlqs: change subscriber cannot connect"),
            Err(_) => tracing::debug!("rlqs: change subscriber connect timed out"),
        }
        tokio::time::sleep(RESUBSCRIBE_DELAY).await;
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

    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<Demand>, StoreError>> {
        if let AnyStore::Memory(_) = &*self.store {
            return self.memory.read(key);
        }
        Box::pin(async move { parse_reply(self.run(key, "", "?", Duration::ZERO).await?) })
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

    fn signals(&self) -> &Signals {
        match &*self.store {
            AnyStore::Memory(_) => self.memory.signals(),
            _ => &self.signals,
        }
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

    #[tokio::test]
    async fn a_material_change_wakes_the_other_holders_only() {
        let board = MemoryBoard::default();
        let long = Duration::from_secs(60);
        let (a, b) = (Arc::new(Wake::default()), Arc::new(Wake::default()));
        board.signals().hold("k", "a", &a);
        board.signals().hold("k", "b", &b);
        let _ = board.exchange("k", "a", 100.0, long).await;
        assert!(a.take().is_empty(), "the writer is not woken");
        assert_eq!(
            b.take().into_iter().collect::<Vec<_>>(),
            ["k"],
            "a member joined"
        );
        let _ = board
            .exchange("k", "a", 100.0 * (1.0 + MATERIAL / 2.0), long)
            .await;
        assert!(b.take().is_empty(), "an immaterial change");
        let _ = board.exchange("k", "a", 50.0, long).await;
        assert_eq!(b.take().len(), 1, "a material change");
        let _ = board.read("k").await;
        assert!(
            a.take().is_empty() && b.take().is_empty(),
            "a read changes nothing"
        );
        board.signals().release("k", "b");
        board.leave("k", "a").await;
        assert!(b.take().is_empty(), "a released holder is not woken");
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
