//! The Redis store: every request is one EVALSHA of `lua/ratelimit.lua` over all its keys.
//!
//! One multiplexed connection (redis-rs `ConnectionManager`) carries every request: it
//! pipelines concurrent EVALSHAs on one socket and reconnects by itself after an outage.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::algorithm::{Hits, Verdict};
use crate::clock::Clock;

use super::{Check, Outcome, Store, StoreError};

/// The entry script, embedded so the binary is all one needs.
pub const SCRIPT: &str = include_str!("../../lua/ratelimit.lua");

/// How to reach Redis.
#[derive(Clone)]
pub struct RedisSettings {
    /// `redis://[user:pass@]host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    /// Longest wait for a TCP/TLS connection.
    pub connect_timeout: Duration,
    /// Longest wait for one EVALSHA; past it the request gets the failure-mode answer.
    pub command_timeout: Duration,
    /// Tests only: a clock whose reading is passed to the script instead of Redis `TIME`.
    pub fixed_clock: Option<Arc<dyn Clock>>,
}

impl RedisSettings {
    /// Settings for `url` with the default timeouts (connect 1 s, command 5 ms).
    pub fn new(url: impl Into<String>) -> RedisSettings {
        RedisSettings {
            url: url.into(),
            connect_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_millis(5),
            fixed_clock: None,
        }
    }
}

/// State in Redis, shared by every rlsd replica that points at it.
pub struct RedisStore {
    connection: ConnectionManager,
    script: redis::Script,
    command_timeout: Duration,
    fixed_clock: Option<Arc<dyn Clock>>,
}

impl RedisStore {
    /// Connects lazily (rlsd starts even while Redis is down, answering by its failure mode)
    /// and loads the script if Redis is there.
    ///
    /// # Errors
    /// When the URL is invalid.
    pub async fn connect(settings: RedisSettings) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(settings.url.as_str())
            .map_err(|error| StoreError::Config(format!("invalid redis url: {error}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.connect_timeout))
            .set_response_timeout(Some(settings.command_timeout))
            // Reconnect quickly after an outage; every failed call also triggers a reconnect.
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500))
            .set_number_of_retries(3);
        let connection = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|error| StoreError::Config(format!("redis: {error}")))?;
        let store = RedisStore {
            connection,
            script: redis::Script::new(SCRIPT),
            command_timeout: settings.command_timeout,
            fixed_clock: settings.fixed_clock,
        };
        match tokio::time::timeout(settings.connect_timeout, store.load_script()).await {
            Ok(Ok(sha)) => tracing::info!(%sha, "redis connected, script loaded"),
            Ok(Err(error)) => {
                tracing::warn!(%error, "redis not reachable yet; will retry per request")
            }
            Err(_) => {
                tracing::warn!("redis not reachable yet (connect timeout); will retry per request")
            }
        }
        Ok(store)
    }

    /// Loads the script (SCRIPT LOAD); later calls reload it by themselves on NOSCRIPT.
    ///
    /// # Errors
    /// When Redis cannot be reached.
    pub async fn load_script(&self) -> Result<String, StoreError> {
        let mut connection = self.connection.clone();
        self.script
            .load_async(&mut connection)
            .await
            .map_err(|error| StoreError::Unavailable(error.to_string()))
    }

    /// Whether Redis answers a PING within the command timeout.
    pub async fn ping(&self) -> bool {
        let mut connection = self.connection.clone();
        let command = redis::cmd("PING");
        let ping = command.query_async::<String>(&mut connection);
        matches!(
            tokio::time::timeout(self.command_timeout, ping).await,
            Ok(Ok(_))
        )
    }

    async fn evaluate(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        let mut invocation = self.script.prepare_invoke();
        match &self.fixed_clock {
            Some(clock) => invocation.arg(clock.now_us()),
            None => invocation.arg(""),
        };
        for check in checks {
            let (mode, hits) = match check.hits {
                Hits::Take(n) => ("t", n),
                Hits::Peek => ("p", 1),
                Hits::Refund(n) => ("r", n),
            };
            let params = &check.params;
            invocation
                .key(check.key.as_str())
                .arg(params.algorithm.key_tag())
                .arg(params.limit)
                .arg(params.period_us)
                .arg(params.burst)
                .arg(mode)
                .arg(hits)
                .arg(u8::from(check.shadow));
        }
        let mut connection = self.connection.clone();
        // Never retried after a timeout: the script may have run, and a retry could count twice.
        let reply: Vec<i64> = tokio::time::timeout(
            self.command_timeout,
            invocation.invoke_async(&mut connection),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.command_timeout))?
        .map_err(|error| StoreError::Unavailable(error.to_string()))?;
        parse_reply(&reply, checks.len())
    }
}

/// `[allowed, remaining, reset_us]` per check.
fn parse_reply(reply: &[i64], checks: usize) -> Result<Vec<Outcome>, StoreError> {
    if reply.len() != checks * 3 {
        return Err(StoreError::Protocol(format!(
            "script answered {} values for {checks} checks",
            reply.len()
        )));
    }
    let non_negative = |value: i64| {
        u64::try_from(value)
            .map_err(|_| StoreError::Protocol(format!("script answered a negative value {value}")))
    };
    reply
        .chunks_exact(3)
        .map(|triple| {
            Ok(Outcome {
                verdict: Verdict {
                    allowed: triple[0] == 1,
                    remaining: non_negative(triple[1])?,
                    reset_us: non_negative(triple[2])?,
                },
            })
        })
        .collect()
}

impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn healthy(&self) -> bool {
        self.ping().await
    }

    async fn decide(&self, checks: &[Check]) -> Result<Vec<Outcome>, StoreError> {
        self.evaluate(checks).await
    }
}
