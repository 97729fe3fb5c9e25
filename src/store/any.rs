//! One store value for every mode, chosen by settings at start: what the binary serves with,
//! so the service and server are compiled once whatever the store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    Check, ClusterSettings, ClusterStore, MemoryStore, Outcome, OverLimitCache, RedisSettings,
    RedisStore, Store, StoreError,
};
use crate::metrics::Metrics;

/// Which store to connect to, and how.
#[derive(Clone)]
pub enum StoreSettings {
    /// In process, holding at most `max_keys` keys.
    Memory {
        /// The most live keys (see [`MemoryStore::new`]).
        max_keys: usize,
    },
    /// One Redis server, or the master Sentinel names, behind the over-limit cache.
    Redis {
        /// How to reach it.
        redis: RedisSettings,
        /// Entries of the over-limit cache in front of it (0: off).
        over_limit_cache: usize,
    },
    /// Redis Cluster. No over-limit cache: the cluster store refunds cross-slot denials, so
    /// quota can come back before a denial's reset, which the cache's exactness relies on.
    Cluster(ClusterSettings),
}

/// A connected store of any mode.
#[expect(clippy::large_enum_variant, reason = "one per process, held in an Arc")]
pub enum AnyStore {
    /// In process.
    Memory(Arc<MemoryStore>),
    /// One Redis (or Sentinel's master), behind the over-limit cache.
    Redis(OverLimitCache<RedisStore>),
    /// Redis Cluster.
    Cluster(ClusterStore),
}

/// How often the in-process store drops expired keys.
const RECLAIM_INTERVAL: Duration = Duration::from_secs(1);

/// Connects to the store `settings` names. The in-process store gets a task that reclaims
/// expired keys, so this runs inside a Tokio runtime.
pub async fn connect(settings: StoreSettings) -> Result<AnyStore, StoreError> {
    Ok(match settings {
        StoreSettings::Memory { max_keys } => {
            let store = Arc::new(MemoryStore::new(max_keys));
            spawn_reclaimer(Arc::clone(&store));
            AnyStore::Memory(store)
        }
        StoreSettings::Redis {
            redis,
            over_limit_cache,
        } => AnyStore::Redis(OverLimitCache::new(
            RedisStore::connect(redis).await?,
            over_limit_cache,
        )),
        StoreSettings::Cluster(cluster) => AnyStore::Cluster(ClusterStore::connect(cluster).await?),
    })
}

/// Reclaims expired keys every [`RECLAIM_INTERVAL`], off the async workers.
fn spawn_reclaimer(store: Arc<MemoryStore>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(RECLAIM_INTERVAL);
        loop {
            tick.tick().await;
            let store = Arc::clone(&store);
            if let Err(error) = tokio::task::spawn_blocking(move || store.purge_expired()).await {
                tracing::error!(%error, "key reclaimer failed");
            }
        }
    });
}

impl Store for AnyStore {
    fn name(&self) -> &'static str {
        match self {
            AnyStore::Memory(store) => store.name(),
            AnyStore::Redis(store) => store.name(),
            AnyStore::Cluster(store) => store.name(),
        }
    }

    async fn healthy(&self) -> bool {
        match self {
            AnyStore::Memory(store) => store.healthy().await,
            AnyStore::Redis(store) => store.healthy().await,
            AnyStore::Cluster(store) => store.healthy().await,
        }
    }

    fn report(&self, metrics: &Metrics) {
        match self {
            AnyStore::Memory(store) => store.report(metrics),
            AnyStore::Redis(store) => store.report(metrics),
            AnyStore::Cluster(store) => store.report(metrics),
        }
    }

    async fn open_lane(&self) {
        match self {
            AnyStore::Memory(store) => store.open_lane().await,
            AnyStore::Redis(store) => store.open_lane().await,
            AnyStore::Cluster(store) => store.open_lane().await,
        }
    }

    async fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        match self {
            AnyStore::Memory(store) => store.decide_by(checks, deadline).await,
            AnyStore::Redis(store) => store.decide_by(checks, deadline).await,
            AnyStore::Cluster(store) => store.decide_by(checks, deadline).await,
        }
    }
}
