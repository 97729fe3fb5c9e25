//! The Redis Cluster store: the keys of a request are grouped by hash slot, and each group is
//! one EVALSHA of `lua/ratelimit.lua`; the groups are sent concurrently.
//!
//! # Guarantee
//! Each slot group is decided atomically, all or nothing, exactly like the single-Redis store.
//! Across slots a request is all or nothing **once its answer goes out**: every group commits
//! only if its own limits pass, and if any group denies (or fails), the groups that committed
//! are refunded before the answer is sent. Between a group's commit and its refund (one round
//! trip) that quota is held, so another request on the same key may be denied meanwhile
//! (under-admission). A refund is applied to the state it finds, so it is exact unless a window
//! edge passes in that round trip (then the refunded hits land in the new window: at most that
//! one request's hits are over-admitted) or a concurrent request's newer log entries are the
//! ones removed (same count, so the window holds the same number); a token bucket's refilled
//! tokens are recomputed in floating point, which can move its reported reset by 1 ms. If a
//! refund itself fails those hits stay counted until their window passes: never more than one
//! request's hits, and logged. A denied cross-slot request takes two round trips (three when it gives hits back).
//! Each request is decided in its caller's task, by the caller's deadline. A caller that stops
//! waiting first (its deadline, or its client cancelled) hands the request's unfinished work to
//! the background, where its calls are awaited up to `--redis-timeout-cap-ms` each and what a
//! late answer committed is given back, within `--redis-max-late-requests` such requests.
//!
//! # Keys
//! Keys carry no hash tag (request values are escaped, so none can plant one): each limit's
//! key lands where its hash sends it, which spreads load over the masters. A request's keys
//! usually span several slots, hence the grouping.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;

use crate::algorithm::{Hits, Params};
use crate::clock::Clock;
use crate::limit::Algorithm;

use super::deadline::{Budget, DEFAULT_MAX_LATE_REQUESTS, LateCalls, RedisClock};
use super::redis::{
    ClientIdentity, DEFAULT_COMMAND_TIMEOUT, DEFAULT_TIMEOUT_CAP, ScriptCall, split_reply,
    time_command, tls_certificates,
};
use super::{Check, Outcome, Store, StoreError, refunds, request_allowed};

/// How to reach a Redis Cluster.
#[derive(Clone)]
pub struct ClusterSettings {
    /// Seed nodes (`redis://host:port`); the rest of the topology is discovered.
    pub nodes: Vec<String>,
    /// Longest wait for a connection.
    pub connect_timeout: Duration,
    /// Longest wait for a request whose caller sent no deadline.
    pub command_timeout: Duration,
    /// Longest wait for any request, whatever deadline its caller sent.
    pub timeout_cap: Duration,
    /// Tests only: a clock whose reading is passed to the script instead of Redis `TIME`.
    pub fixed_clock: Option<Arc<dyn Clock>>,
    /// A PEM file of CA certificates to trust for `rediss://` nodes instead of the built-in
    /// roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// A certificate to present to the nodes (`tls-auth-clients yes`).
    pub client_identity: Option<ClientIdentity>,
    /// Most random time added to the TTL of each key a call writes (0: none).
    pub expiry_jitter: Duration,
    /// Most requests whose calls are awaited after their callers stopped waiting; past it such
    /// a request is let go, and what it commits stays counted.
    pub max_late_requests: usize,
}

impl ClusterSettings {
    /// Settings for `nodes` with the default timeouts (connect 1 s, command 5 ms).
    pub fn new(nodes: Vec<String>) -> ClusterSettings {
        ClusterSettings {
            nodes,
            connect_timeout: Duration::from_secs(1),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            timeout_cap: DEFAULT_TIMEOUT_CAP,
            fixed_clock: None,
            ca_file: None,
            client_identity: None,
            expiry_jitter: Duration::ZERO,
            max_late_requests: DEFAULT_MAX_LATE_REQUESTS,
        }
    }
}

/// State in a Redis Cluster.
pub struct ClusterStore {
    /// Shared with the requests handed to the background, whose callers stopped waiting.
    inner: Arc<Cluster>,
}

/// The connection and what every call needs.
struct Cluster {
    client: ClusterClient,
    /// One client per seed node, for a pub/sub connection (published messages reach every
    /// node).
    seeds: Vec<redis::Client>,
    /// Replaced by a fresh connection (a fresh view of the topology) after failures, since a
    /// connection can keep routing to a master that died until it is rebuilt.
    connection: Arc<ArcSwap<ClusterConnection>>,
    /// Whether a rebuild is under way, so failures trigger one at a time.
    rebuilding: Arc<AtomicBool>,
    command_timeout: Duration,
    timeout_cap: Duration,
    connect_timeout: Duration,
    fixed_clock: Option<Arc<dyn Clock>>,
    /// The nodes' clock, as their replies teach it.
    clock: RedisClock,
    expiry_jitter: Duration,
    /// Requests awaited after their callers stopped waiting.
    late: Arc<LateCalls>,
}

impl ClusterStore {
    /// Connects to the cluster through its seed nodes.
    ///
    /// # Errors
    /// When the node list is invalid or no seed node answers.
    pub async fn connect(settings: ClusterSettings) -> Result<ClusterStore, StoreError> {
        let mut builder = ClusterClient::builder(settings.nodes.clone())
            .connection_timeout(settings.connect_timeout)
            .response_timeout(settings.timeout_cap)
            .retries(2);
        if let Some(certificates) = tls_certificates(
            settings.ca_file.as_deref(),
            settings.client_identity.as_ref(),
        )? {
            builder = builder.certs(certificates);
        }
        let client = builder
            .build()
            .map_err(|error| StoreError::Config(format!("invalid redis cluster nodes: {error}")))?;
        let connection =
            tokio::time::timeout(settings.connect_timeout * 5, client.get_async_connection())
                .await
                .map_err(|_| {
                    StoreError::Unavailable(
                        "redis cluster: no seed node answered in time".to_owned(),
                    )
                })?
                .map_err(|error| StoreError::Unavailable(format!("redis cluster: {error}")))?;
        tracing::info!(nodes = settings.nodes.len(), "redis cluster connected");
        let certificates = tls_certificates(
            settings.ca_file.as_deref(),
            settings.client_identity.as_ref(),
        )?;
        let seeds = settings
            .nodes
            .iter()
            .filter_map(|node| match &certificates {
                None => redis::Client::open(node.as_str()).ok(),
                Some(certs) => redis::Client::build_with_tls(node.as_str(), certs.clone()).ok(),
            })
            .collect();
        let inner = Cluster {
            client,
            seeds,
            connection: Arc::new(ArcSwap::from_pointee(connection)),
            rebuilding: Arc::new(AtomicBool::new(false)),
            command_timeout: settings.command_timeout,
            timeout_cap: settings.timeout_cap,
            clock: RedisClock::new(settings.fixed_clock.clone()),
            connect_timeout: settings.connect_timeout,
            fixed_clock: settings.fixed_clock,
            expiry_jitter: settings.expiry_jitter,
            late: LateCalls::new(settings.max_late_requests),
        };
        Ok(ClusterStore {
            inner: Arc::new(inner),
        })
    }
}

impl ClusterStore {
    /// Clients for a pub/sub connection, one per seed node.
    pub fn pubsub_clients(&self) -> Vec<redis::Client> {
        self.inner.seeds.clone()
    }

    /// Runs another script (the quota service's) on the master of its key within the timeout
    /// cap (`--redis-timeout-cap-ms`); redis-rs sends EVALSHA and loads the script on NOSCRIPT.
    ///
    /// # Errors
    /// When the cluster cannot be reached, refuses the script or does not answer in time.
    pub async fn run_script<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let inner = &self.inner;
        let mut connection = ClusterConnection::clone(&inner.connection.load());
        match tokio::time::timeout(
            inner.timeout_cap,
            invocation.invoke_async::<T>(&mut connection),
        )
        .await
        {
            Err(_) => Err(StoreError::Timeout(inner.timeout_cap)),
            Ok(Err(error)) => {
                inner.rebuild_connection();
                Err(StoreError::Unavailable(error.to_string()))
            }
            Ok(Ok(value)) => Ok(value),
        }
    }
}

impl Cluster {
    /// Rebuilds the connection in the background (one rebuild at a time, at most one a
    /// second), so a failover is followed even when no MOVED reply ever comes back.
    fn rebuild_connection(&self) {
        if self.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        let (client, connection, rebuilding) = (
            self.client.clone(),
            Arc::clone(&self.connection),
            Arc::clone(&self.rebuilding),
        );
        let connect_timeout = self.connect_timeout;
        tokio::spawn(async move {
            match tokio::time::timeout(connect_timeout, client.get_async_connection()).await {
                Ok(Ok(fresh)) => {
                    connection.store(Arc::new(fresh));
                    tracing::info!("redis cluster connection rebuilt");
                }
                Ok(Err(error)) => tracing::warn!(%error, "redis cluster reconnect failed"),
                Err(_) => tracing::warn!("redis cluster reconnect timed out"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            rebuilding.store(false, Ordering::Release);
        });
    }

    /// One slot group as one request of the script.
    async fn call(&self, checks: &[Check], budget: Budget) -> Result<Vec<Outcome>, StoreError> {
        self.call_by(checks, budget, Call::Deciding).await
    }

    /// [`ClusterStore::call`] of a `kind`.
    async fn call_by(
        &self,
        checks: &[Check],
        budget: Budget,
        kind: Call,
    ) -> Result<Vec<Outcome>, StoreError> {
        let bounded = kind != Call::Refunding;
        let first = checks.first().map(|check| check.key.as_str());
        let deadline = if bounded {
            if self.clock.redis_us(budget.deadline).is_none() {
                self.sync_clock(first, budget.deadline).await?;
            }
            if budget.script_deadline <= Instant::now() {
                return Err(budget.exceeded());
            }
            let at = self.clock.redis_us(budget.script_deadline);
            Some(at.ok_or_else(|| budget.exceeded())?)
        } else {
            None
        };
        let requests = [(checks, deadline)];
        let script_call = match kind {
            Call::Evaluating => ScriptCall::evaluating(self.fixed_clock.as_deref(), &requests),
            Call::Deciding | Call::Refunding => {
                ScriptCall::new(self.fixed_clock.as_deref(), &requests)
            }
        }
        .with_expiry_jitter(self.expiry_jitter);
        let mut connection = ClusterConnection::clone(&self.connection.load());
        // Awaited up to the cap, past the caller's deadline: a caller that stops waiting hands
        // this to the background (see `decide_by`), which gives back what a late answer
        // committed. Never retried after a timeout: the script may have run, and a retry could
        // count twice.
        let call = script_call.run(&mut connection);
        let reply: Vec<u8> = match tokio::time::timeout(self.timeout_cap, call).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(error)) => {
                self.rebuild_connection();
                return Err(StoreError::Unavailable(error.to_string()));
            }
            Err(_) => {
                self.rebuild_connection();
                return Err(StoreError::Timeout(self.timeout_cap));
            }
        };
        let reply = split_reply(&reply, &[checks.len()])?;
        self.clock.observe(reply.now_us, Instant::now());
        match reply.answers.into_iter().next() {
            Some(Some(outcomes)) => Ok(outcomes),
            Some(None) => Err(budget.exceeded()),
            None => Err(StoreError::Protocol(
                "no answer for the slot group".to_owned(),
            )),
        }
    }

    /// Reads the clock of the node holding `key`, by `deadline`.
    async fn sync_clock(&self, key: Option<&str>, deadline: Instant) -> Result<(), StoreError> {
        let mut connection = ClusterConnection::clone(&self.connection.load());
        let command = time_command(key);
        let now =
            tokio::time::timeout_at(deadline.into(), command.query_async::<u64>(&mut connection))
                .await
                .map_err(|_| {
                    StoreError::Timeout(deadline.saturating_duration_since(Instant::now()))
                })?
                .map_err(|error| StoreError::Unavailable(error.to_string()))?;
        self.clock.observe(now, Instant::now());
        Ok(())
    }
}

/// The checks of a request by hash slot, in first-seen order; each with its index in the request.
fn group_by_slot(checks: &[Check]) -> Vec<Vec<(usize, Check)>> {
    let mut groups: Vec<Vec<(usize, Check)>> = Vec::new();
    let mut slot_group: HashMap<Slot, usize> = HashMap::new();
    for (index, check) in checks.iter().enumerate() {
        let slot = Slot::for_key(check.key.as_bytes());
        let group = *slot_group.entry(slot).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[group].push((index, check.clone()));
    }
    groups
}

/// A slot group's checks, each with its index in the request.
type Members = [(usize, Check)];

/// What a slot group's call is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// Decides and commits, its script within the caller's budget.
    Deciding,
    /// Evaluates only (with the dry-run guard): charges are not recorded.
    Evaluating,
    /// Gives hits back, with no deadline on the script: it must land however late, or the hits
    /// stay counted.
    Refunding,
}

/// A check that always denies and touches nothing (L = 0), on a key the group already read:
/// appended to a group, it makes the script evaluate the group without committing it.
fn dry_run_guard(group: &[Check]) -> Option<Check> {
    group.first().map(|first| Check {
        key: first.key.clone(),
        params: Params {
            algorithm: Algorithm::FixedWindow,
            limit: 0,
            period_us: 1,
            burst: 0,
        },
        hits: Hits::Take(1),
        shadow: false,
        quota_mode: false,
    })
}

impl Cluster {
    /// Evaluates every group without committing anything: exact answers for a request that
    /// turns out denied.
    async fn dry_run(
        &self,
        groups: &[Vec<Check>],
        budget: Budget,
    ) -> Vec<Result<Vec<Outcome>, StoreError>> {
        let guarded: Vec<Vec<Check>> = groups
            .iter()
            .map(|group| group.iter().cloned().chain(dry_run_guard(group)).collect())
            .collect();
        join_all(guarded.iter().map(|group| async move {
            let mut outcomes = self.call_by(group, budget, Call::Evaluating).await?;
            outcomes.pop();
            Ok(outcomes)
        }))
        .await
    }
}

impl Cluster {
    /// Refunds `refunds` slot by slot, with no deadline on the script: hits of an answer nobody
    /// used must land however late.
    async fn give_back(&self, refunds: Vec<Check>) {
        if refunds.is_empty() {
            return;
        }
        let budget = Budget::from_now(None, self.command_timeout, self.timeout_cap);
        let groups: Vec<Vec<Check>> = group_by_slot(&refunds)
            .into_iter()
            .map(|group| group.into_iter().map(|(_, check)| check).collect())
            .collect();
        let calls = groups
            .iter()
            .map(|group| self.call_by(group, budget, Call::Refunding));
        for result in join_all(calls).await {
            if let Err(error) = result {
                tracing::warn!(%error, "redis cluster: giving back the hits of an unused answer failed; they stay counted");
            }
        }
    }

    /// Records the charges of a denied request, which count whatever the answer: each group
    /// holding one runs with the guard, so only its charges are written.
    /// Returns each such group's members with their outcomes.
    async fn record_charges<'g>(
        &self,
        members: &'g [Vec<(usize, Check)>],
        groups: &[Vec<Check>],
        budget: Budget,
    ) -> Result<Vec<(&'g Members, Vec<Outcome>)>, StoreError> {
        let charged: Vec<(&'g Members, Vec<Check>)> = members
            .iter()
            .zip(groups)
            .filter(|(_, group)| {
                group
                    .iter()
                    .any(|check| matches!(check.hits, Hits::Charge(_)))
            })
            .map(|(members, group)| {
                let guarded = group.iter().cloned().chain(dry_run_guard(group)).collect();
                (members.as_slice(), guarded)
            })
            .collect();
        let answers = join_all(charged.iter().map(|(_, group)| self.call(group, budget))).await;
        charged
            .iter()
            .zip(answers)
            .map(|((members, _), answer)| Ok((*members, answer?)))
            .collect()
    }
}

impl Store for ClusterStore {
    fn name(&self) -> &'static str {
        "redis-cluster"
    }

    async fn healthy(&self) -> bool {
        let mut connection = ClusterConnection::clone(&self.inner.connection.load());
        let command = redis::cmd("PING");
        let ping = command.query_async::<String>(&mut connection);
        matches!(
            tokio::time::timeout(self.inner.command_timeout, ping).await,
            Ok(Ok(_))
        )
    }

    fn report(&self, metrics: &crate::metrics::Metrics) {
        let late = &self.inner.late;
        metrics
            .redis_late_requests
            .set(i64::try_from(late.held()).unwrap_or(i64::MAX));
        metrics
            .redis_late_requests_let_go
            .set(i64::try_from(late.let_go()).unwrap_or(i64::MAX));
    }

    async fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let budget = Budget::from_now(deadline, self.inner.command_timeout, self.inner.timeout_cap);
        let (inner, checks) = (Arc::clone(&self.inner), checks.to_vec());
        let mut in_flight = Unfinished {
            cluster: &self.inner,
            work: Some(Box::pin(async move {
                let decided = inner.decide(&checks, budget).await;
                (checks, decided)
            })),
        };
        let decided = match &mut in_flight.work {
            Some(work) => tokio::time::timeout_at(budget.deadline.into(), work).await,
            None => return Err(budget.exceeded()),
        };
        match decided {
            Ok((_, decided)) => {
                in_flight.work = None;
                decided
            }
            // The work goes to the background with `in_flight`.
            Err(_) => Err(budget.exceeded()),
        }
    }
}

/// A request being decided, with its checks, owned so it can finish in the background.
type Work = Pin<Box<dyn Future<Output = (Vec<Check>, Result<Vec<Outcome>, StoreError>)> + Send>>;

/// A request's work, awaited by its caller; dropped unfinished (the caller's deadline passed,
/// or its client cancelled), it is awaited in the background within the late bound, and what
/// it committed is given back.
struct Unfinished<'c> {
    cluster: &'c Arc<Cluster>,
    work: Option<Work>,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        let runtime = tokio::runtime::Handle::try_current();
        let (Some(hold), Ok(runtime)) = (self.cluster.late.hold(1), runtime) else {
            return;
        };
        let cluster = Arc::clone(self.cluster);
        runtime.spawn(async move {
            // Each of its calls is bounded by the cap.
            let (checks, decided) = work.await;
            if let Ok(outcomes) = decided
                && request_allowed(&checks, &outcomes)
            {
                cluster.give_back(refunds(&checks, &outcomes)).await;
            }
            drop(hold);
        });
    }
}

impl Cluster {
    /// Decides `checks` across their slots within `budget`; see the module's guarantee.
    async fn decide(&self, checks: &[Check], budget: Budget) -> Result<Vec<Outcome>, StoreError> {
        let groups = group_by_slot(checks);
        // Quota checks in several groups are decided together, here: each group takes them as
        // shadow checks.
        let quota_groups = groups
            .iter()
            .filter(|group| {
                group
                    .iter()
                    .any(|(_, check)| check.quota_mode && !check.shadow)
            })
            .count();
        let group_checks: Vec<Vec<Check>> = groups
            .iter()
            .map(|group| {
                group
                    .iter()
                    .map(|(_, check)| {
                        let mut check = check.clone();
                        if quota_groups > 1 && check.quota_mode {
                            check.shadow = true;
                            check.quota_mode = false;
                        }
                        check
                    })
                    .collect()
            })
            .collect();
        // Refunds cannot be taken back exactly, so a request that gives hits back across slots
        // is first evaluated without committing; only if it passes is it sent for real.
        // So is one whose quota checks span slots: only all of them together decide it.
        let dry_run_first = group_checks.len() > 1
            && (quota_groups > 1
                || checks
                    .iter()
                    .any(|check| matches!(check.hits, Hits::Refund(_))));
        if dry_run_first {
            let dry = self.dry_run(&group_checks, budget).await;
            let mut outcomes: Vec<Option<Outcome>> = vec![None; checks.len()];
            for (members, answer) in groups.iter().zip(dry) {
                for ((index, _), outcome) in members.iter().zip(answer?) {
                    outcomes[*index] = Some(outcome);
                }
            }
            let mut outcomes: Vec<Outcome> = outcomes
                .into_iter()
                .collect::<Option<_>>()
                .ok_or_else(|| StoreError::Protocol("a slot group had no answer".to_owned()))?;
            if !request_allowed(checks, &outcomes) {
                // Charges count whatever the answer, and report what they took.
                for (members, answer) in self.record_charges(&groups, &group_checks, budget).await?
                {
                    for ((index, check), outcome) in members.iter().zip(answer) {
                        if matches!(check.hits, Hits::Charge(_)) {
                            outcomes[*index] = outcome;
                        }
                    }
                }
                return Ok(outcomes);
            }
        }
        let answers = join_all(group_checks.iter().map(|group| self.call(group, budget))).await;

        let mut outcomes: Vec<Option<Outcome>> = vec![None; checks.len()];
        let mut failure = None;
        // Each committed group with its own answers, so it can be refunded even when another
        // group failed outright.
        let mut committed: Vec<(usize, Vec<Outcome>)> = Vec::new();
        for (group_index, ((group, members), answer)) in
            group_checks.iter().zip(&groups).zip(answers).enumerate()
        {
            match answer {
                Ok(answer) => {
                    for ((index, _), outcome) in members.iter().zip(&answer) {
                        outcomes[*index] = Some(*outcome);
                    }
                    if request_allowed(group, &answer) {
                        committed.push((group_index, answer));
                    }
                }
                Err(error) => failure = Some(error),
            }
        }
        let outcomes: Option<Vec<Outcome>> = outcomes.into_iter().collect();
        let denied = match &outcomes {
            Some(outcomes) => !request_allowed(checks, outcomes),
            None => true,
        };
        if denied {
            // All or nothing across slots: give back what the passing groups took.
            let refunds: Vec<Vec<Check>> = committed
                .iter()
                .map(|(group, answer)| refunds(&group_checks[*group], answer))
                .filter(|refund| !refund.is_empty())
                .collect();
            // A refund waits its own command timeout: it must land even past the caller's.
            let refund_budget = Budget::from_now(None, self.command_timeout, self.timeout_cap);
            let results = join_all(
                refunds
                    .iter()
                    .map(|refund| self.call_by(refund, refund_budget, Call::Refunding)),
            )
            .await;
            for result in results {
                if let Err(error) = result {
                    tracing::warn!(%error, "redis cluster: refund of a denied request failed; its hits stay counted");
                }
            }
        }
        if let Some(error) = failure {
            return Err(error);
        }
        let mut outcomes = outcomes
            .ok_or_else(|| StoreError::Protocol("a slot group had no answer".to_owned()))?;
        if denied {
            // The refunded groups took nothing in the end: report what they still have (groups
            // that denied already report it).
            for (group, _) in &committed {
                for (index, check) in &groups[*group] {
                    let outcome = &mut outcomes[*index];
                    if let (true, Hits::Take(n)) = (outcome.verdict.allowed, check.hits) {
                        outcome.verdict.remaining += n;
                    }
                }
            }
        }
        Ok(outcomes)
    }
}
