//! The Redis store: every request is one EVALSHA of `lua/ratelimit.lua` over all its keys.
//!
//! A multiplexed connection (redis-rs `ConnectionManager`) per serving lane, and one shared by
//! every other thread, carries the requests: it pipelines concurrent EVALSHAs on one socket and
//! reconnects by itself after an outage.
//! Requests that arrive while calls are in flight are coalesced into one EVALSHA (each request
//! still decided atomically, all or nothing), so a busy server makes fewer, larger calls and an
//! idle one sends a lone request at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::AsyncConnectionConfig;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelServerType};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::algorithm::{Hits, Params, Verdict};
use crate::clock::Clock;

use super::deadline::{Budget, DEFAULT_MAX_LATE_REQUESTS, LateCalls, RedisClock};
use super::{Check, Outcome, Store, StoreError, refunds, request_allowed};

/// The entry script, embedded so the binary is all one needs.
pub const SCRIPT: &str = include_str!("../../lua/ratelimit.lua");

/// The script, hashed once.
static LOADED: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(SCRIPT));

/// Reads Redis's clock in µs; with a key, on the node that holds it.
const TIME_SCRIPT: &str = "local t = redis.call('TIME') return t[1] * 1000000 + t[2]";

/// Default bound on a call whose caller sent no deadline (`grpc-timeout`): Envoy's own default
/// timeout, so a caller that says nothing is treated as Envoy's default would be.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(20);

/// Default bound on any call, whatever deadline its caller sent.
pub const DEFAULT_TIMEOUT_CAP: Duration = Duration::from_secs(1);

/// How to reach Redis.
#[derive(Clone)]
pub struct RedisSettings {
    /// `redis://[user:pass@]host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    /// Longest wait for a TCP/TLS connection.
    pub connect_timeout: Duration,
    /// Longest wait for a request whose caller sent no deadline; past it the request gets the
    /// failure-mode answer and nothing of it is counted.
    pub command_timeout: Duration,
    /// Longest wait for any request, whatever deadline its caller sent.
    pub timeout_cap: Duration,
    /// Tests only: a clock whose reading is passed to the script instead of Redis `TIME`.
    pub fixed_clock: Option<Arc<dyn Clock>>,
    /// Most requests coalesced into one EVALSHA; 1 sends every request on its own.
    pub max_batch: usize,
    /// EVALSHA calls in flight at once per lane when coalescing, pipelined on its connection.
    pub pipelines: usize,
    /// A PEM file of CA certificates to trust for `rediss://` instead of the built-in roots.
    pub ca_file: Option<std::path::PathBuf>,
    /// A certificate to present to Redis (`tls-auth-clients yes`) over `rediss://`.
    pub client_identity: Option<ClientIdentity>,
    /// Find the master through Redis Sentinel instead of `url`, following failovers.
    pub sentinel: Option<SentinelTarget>,
    /// Most random time added to the TTL of each key a call writes (0: none); answers never
    /// see it (`EXPIRATION_JITTER_MAX_SECONDS`).
    pub expiry_jitter: Duration,
    /// Serving lanes (`server::ServeOptions::lanes`) that each get a connection and batchers of
    /// their own, opened on the lane's thread before it serves; other threads share one. Not
    /// with Sentinel, whose one link follows failovers. A store with lanes serves one server:
    /// a lane's connection lives on that lane's runtime and stops with it.
    pub lanes: usize,
    /// Most requests, per lane, whose calls are awaited after their callers stopped waiting;
    /// past it such a call is let go, and what it commits stays counted.
    pub max_late_requests: usize,
}

/// Where Redis Sentinel is, and which master it watches.
#[derive(Clone, Debug)]
pub struct SentinelTarget {
    /// Sentinel addresses (`redis://host:26379`).
    pub sentinels: Vec<String>,
    /// The monitored master's name (`sentinel monitor <name> ...`).
    pub master_name: String,
}

impl RedisSettings {
    /// Settings for `url` with the default timeouts (connect 1 s, command 20 ms, cap 1 s).
    pub fn new(url: impl Into<String>) -> RedisSettings {
        RedisSettings {
            url: url.into(),
            connect_timeout: Duration::from_secs(1),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            timeout_cap: DEFAULT_TIMEOUT_CAP,
            fixed_clock: None,
            max_batch: DEFAULT_MAX_BATCH,
            pipelines: DEFAULT_PIPELINES,
            ca_file: None,
            client_identity: None,
            sentinel: None,
            expiry_jitter: Duration::ZERO,
            lanes: 0,
            max_late_requests: DEFAULT_MAX_LATE_REQUESTS,
        }
    }
}

/// PEM files of the certificate rlsd presents to Redis, and its private key.
#[derive(Clone, Debug)]
pub struct ClientIdentity {
    /// The certificate chain.
    pub cert: std::path::PathBuf,
    /// Its private key.
    pub key: std::path::PathBuf,
}

/// A client for `settings.url`, trusting `settings.ca_file` and presenting
/// `settings.client_identity` when there are any.
fn client(settings: &RedisSettings) -> Result<redis::Client, StoreError> {
    let Some(certificates) = tls_certificates(
        settings.ca_file.as_deref(),
        settings.client_identity.as_ref(),
    )?
    else {
        return redis::Client::open(settings.url.as_str())
            .map_err(|error| StoreError::Config(format!("invalid redis url: {error}")));
    };
    redis::Client::build_with_tls(settings.url.as_str(), certificates).map_err(|error| {
        StoreError::Config(format!(
            "invalid redis url with a CA or client certificate (needs rediss://): {error}"
        ))
    })
}

/// The CA to trust instead of the built-in roots and the certificate to present, as redis-rs
/// takes them; `None` when neither is given. An unreadable file, or one without the PEM block
/// it should hold, is an error naming it.
pub(super) fn tls_certificates(
    ca: Option<&std::path::Path>,
    identity: Option<&ClientIdentity>,
) -> Result<Option<redis::TlsCertificates>, StoreError> {
    if ca.is_none() && identity.is_none() {
        return Ok(None);
    }
    let root_cert = ca
        .map(|path| {
            let pem = read_pem("CA", path)?;
            check_certificates("CA", path, &pem)?;
            Ok::<_, StoreError>(pem)
        })
        .transpose()?;
    let client_tls = identity
        .map(|identity| {
            let client_cert = read_pem("client certificate", &identity.cert)?;
            check_certificates("client certificate", &identity.cert, &client_cert)?;
            let client_key = read_pem("client key", &identity.key)?;
            if PrivateKeyDer::from_pem_slice(&client_key).is_err() {
                return Err(StoreError::Config(format!(
                    "redis client key {}: no PEM private key found",
                    identity.key.display()
                )));
            }
            Ok(redis::ClientTlsConfig {
                client_cert,
                client_key,
            })
        })
        .transpose()?;
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

fn read_pem(what: &str, path: &std::path::Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|error| {
        StoreError::Config(format!(
            "cannot read redis {what} {}: {error}",
            path.display()
        ))
    })
}

/// At least one certificate, and no broken one, in `pem`.
fn check_certificates(what: &str, path: &std::path::Path, pem: &[u8]) -> Result<(), StoreError> {
    match CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>() {
        Ok(found) if !found.is_empty() => Ok(()),
        Ok(_) => Err(StoreError::Config(format!(
            "redis {what} {}: no PEM certificate (BEGIN CERTIFICATE) found",
            path.display()
        ))),
        Err(error) => Err(StoreError::Config(format!(
            "redis {what} {}: invalid PEM certificate: {error}",
            path.display()
        ))),
    }
}

/// Default bound on requests per coalesced EVALSHA.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Most checks in one coalesced EVALSHA, however few requests carry them.
pub const MAX_BATCH_CHECKS: usize = 256;

/// Default number of coalesced calls in flight at once: with fewer in flight each carries more
/// requests, and Redis spends less per decision.
pub const DEFAULT_PIPELINES: usize = 2;

/// State in Redis, shared by every rlsd replica that points at it.
pub struct RedisStore {
    /// What threads outside the serving lanes use (every thread, when there are none).
    shared: Lane,
    /// One per serving lane, for that lane's thread alone: its requests, their EVALSHA and the
    /// reply then stay on one thread, where a shared connection's driver and batcher would wake
    /// other threads for every request.
    lanes: Box<[OnceLock<Lane>]>,
    settings: RedisSettings,
    /// Redis's clock as every lane learns it.
    clock: Arc<RedisClock>,
}

/// A connection to Redis and the batchers that coalesce onto it.
struct Lane {
    caller: Arc<RedisCaller>,
    /// Where requests queue to be coalesced; `None` when every request is its own call.
    queue: Option<Coalescer>,
}

/// The connection and the script: what actually talks to Redis.
struct RedisCaller {
    link: Link,
    command_timeout: Duration,
    timeout_cap: Duration,
    fixed_clock: Option<Arc<dyn Clock>>,
    clock: Arc<RedisClock>,
    expiry_jitter: Duration,
    /// This lane's calls awaited after their callers stopped waiting.
    late: Arc<LateCalls>,
}

/// A script call sent, owning all it needs: a caller that stops waiting hands it to the
/// background, where its reply is still read.
type SentCall = Pin<Box<dyn Future<Output = Result<Vec<u8>, StoreError>> + Send>>;

/// A multiplexed connection to `settings.url`, opened on first use and reopened after failures.
fn direct_connection(settings: &RedisSettings) -> Result<ConnectionManager, StoreError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(settings.connect_timeout))
        // None in redis-rs: every wait on a call is bounded here (the caller's deadline, then
        // the cap for a late call), and a second timer per call bounded nothing more.
        .set_response_timeout(None)
        // Reconnect quickly after an outage; every failed call also reconnects.
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(500))
        .set_number_of_retries(3);
    ConnectionManager::new_lazy_with_config(client(settings)?, config)
        .map_err(|error| StoreError::Config(format!("redis: {error}")))
}

impl Lane {
    /// A lane on `link`; its batchers run on the runtime this is called on.
    fn open(link: Link, settings: &RedisSettings, clock: &Arc<RedisClock>) -> Lane {
        let caller = Arc::new(RedisCaller {
            link,
            command_timeout: settings.command_timeout,
            timeout_cap: settings.timeout_cap,
            fixed_clock: settings.fixed_clock.clone(),
            clock: Arc::clone(clock),
            expiry_jitter: settings.expiry_jitter,
            late: LateCalls::new(settings.max_late_requests),
        });
        let queue = (settings.max_batch > 1).then(|| {
            let pipelines = settings.pipelines.max(1);
            // Bounded, so a stalled Redis cannot queue without limit: beyond it callers wait,
            // and their own timeout answers them.
            let (sender, receiver) = mpsc::channel(settings.max_batch * pipelines * 4);
            let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
            let calls = Arc::new(Semaphore::new(pipelines));
            for _ in 0..pipelines {
                tokio::spawn(run_batches(
                    Arc::clone(&caller),
                    Arc::clone(&receiver),
                    Arc::clone(&calls),
                    settings.max_batch,
                ));
            }
            Coalescer { sender, calls }
        });
        Lane { caller, queue }
    }

    /// Decides one request by `deadline`: sent on its own when nothing waits and a call slot
    /// is free (so coalescing adds no hand-off at low load), else queued for the next batch.
    async fn decide(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let budget = Budget::from_now(
            deadline,
            self.caller.command_timeout,
            self.caller.timeout_cap,
        );
        let coalescer = match &self.queue {
            None => return self.caller.decide_one(checks, budget).await,
            Some(coalescer) => coalescer,
        };
        if coalescer.sender.capacity() == coalescer.sender.max_capacity() {
            // The semaphore is fair: while batches wait for a slot, this fails, and the
            // request joins them.
            if let Ok(_slot) = coalescer.calls.try_acquire() {
                return self.caller.decide_one(checks, budget).await;
            }
        }
        let (reply, answer) = oneshot::channel();
        let job = Job {
            checks: checks.to_vec(),
            budget,
            reply,
        };
        let mut awaiting = Awaiting {
            caller: &self.caller,
            checks,
            answer,
        };
        tokio::time::timeout_at(budget.deadline.into(), coalescer.sender.send(job))
            .await
            .map_err(|_| budget.exceeded())?
            .map_err(|_| StoreError::Unavailable("redis batcher stopped".to_owned()))?;
        awaiting.wait_for(&budget).await
    }
}

/// A queued request's answer, awaited by its caller. Once the caller stops waiting the channel
/// is closed, so an answer that comes later is known to be unused (the batch gives its hits
/// back); one that came in time but that a dropped caller never read is given back here.
struct Awaiting<'c> {
    caller: &'c Arc<RedisCaller>,
    checks: &'c [Check],
    answer: oneshot::Receiver<Result<Vec<Outcome>, StoreError>>,
}

impl Awaiting<'_> {
    /// The answer by the budget's deadline; one that came just in time is still taken.
    async fn wait_for(&mut self, budget: &Budget) -> Result<Vec<Outcome>, StoreError> {
        match tokio::time::timeout_at(budget.deadline.into(), &mut self.answer).await {
            Ok(answer) => answer.map_err(|_| {
                StoreError::Unavailable("redis batcher dropped the request".to_owned())
            })?,
            Err(_) => {
                self.answer.close();
                self.answer
                    .try_recv()
                    .unwrap_or_else(|_| Err(budget.exceeded()))
            }
        }
    }
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        self.answer.close();
        if let Ok(Ok(outcomes)) = self.answer.try_recv()
            && request_allowed(self.checks, &outcomes)
        {
            self.caller.give_back_later(refunds(self.checks, &outcomes));
        }
    }
}

/// A request's own call, awaited by its caller. If the caller stops waiting with the call
/// still in flight (its deadline passed, or it was dropped because its client cancelled), the
/// call goes to the background with a copy of the checks, so what a late reply commits is
/// given back: only then is anything copied or spawned.
struct InFlight<'c> {
    caller: &'c Arc<RedisCaller>,
    checks: &'c [Check],
    budget: Budget,
    call: Option<SentCall>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            // Nobody takes this answer: its sender is dropped with the receiver.
            let (reply, _) = oneshot::channel();
            let job = Job {
                checks: self.checks.to_vec(),
                budget: self.budget,
                reply,
            };
            self.caller.await_late(vec![job], call);
        }
    }
}

impl RedisStore {
    /// Connects lazily (rlsd starts even while Redis is down, answering by its failure mode)
    /// and loads the script if Redis is there.
    ///
    /// # Errors
    /// When the URL is invalid.
    pub async fn connect(settings: RedisSettings) -> Result<RedisStore, StoreError> {
        let link = match &settings.sentinel {
            Some(target) => Link::Sentinel(Arc::new(SentinelLink::new(target, &settings)?)),
            None => Link::Direct(Box::new(DirectLink::new(&settings)?)),
        };
        if let Link::Sentinel(sentinel) = &link {
            sentinel.reconnect().await;
        }
        let lanes = if settings.sentinel.is_some() {
            0
        } else {
            settings.lanes
        };
        let clock = Arc::new(RedisClock::new(settings.fixed_clock.clone()));
        let store = RedisStore {
            shared: Lane::open(link, &settings, &clock),
            lanes: (0..lanes).map(|_| OnceLock::new()).collect(),
            settings,
            clock,
        };
        match tokio::time::timeout(store.settings.connect_timeout, store.load_script()).await {
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
        self.shared.caller.load_script().await
    }

    /// A client for a pub/sub connection to the same Redis (`None` behind Sentinel, whose
    /// master moves).
    pub fn pubsub_client(&self) -> Option<redis::Client> {
        if self.settings.sentinel.is_some() {
            return None;
        }
        client(&self.settings).ok()
    }

    /// Whether Redis answers a PING within the command timeout.
    pub async fn ping(&self) -> bool {
        self.shared.caller.ping().await
    }

    /// The calling thread's lane: its own on a serving lane (opened here on its first request,
    /// so its connection and batchers live on that lane's runtime), else the shared one.
    fn lane(&self) -> &Lane {
        let Some(slot) = crate::lane::current().and_then(|index| self.lanes.get(index)) else {
            return &self.shared;
        };
        if let Some(lane) = slot.get() {
            return lane;
        }
        match DirectLink::new(&self.settings) {
            Ok(connection) => slot.get_or_init(|| {
                Lane::open(
                    Link::Direct(Box::new(connection)),
                    &self.settings,
                    &self.clock,
                )
            }),
            Err(error) => {
                // The shared lane was built from the same settings, so this is not expected.
                tracing::warn!(%error, "redis: cannot open a lane's connection; sharing one");
                &self.shared
            }
        }
    }
}

/// Coalescing: the queue batches are drawn from, and the slots for calls in flight (one per
/// pipeline), shared by batches and by requests sent on their own.
struct Coalescer {
    sender: mpsc::Sender<Job>,
    calls: Arc<Semaphore>,
}

/// How the store reaches its Redis.
enum Link {
    /// One server at a known address; the connection manager reconnects by itself.
    Direct(Box<DirectLink>),
    /// The current master, as Sentinel names it.
    Sentinel(Arc<SentinelLink>),
}

/// One server at a known address, through a connection manager that reconnects after I/O
/// failures by itself. A READONLY reply (the server was demoted to a replica, and Redis keeps
/// its clients connected) replaces the manager, so the next call connects afresh and reaches
/// whatever master the address now leads to (a DNS name or a proxy that followed a failover).
struct DirectLink {
    current: ArcSwap<ConnectionManager>,
    settings: RedisSettings,
}

impl DirectLink {
    fn new(settings: &RedisSettings) -> Result<DirectLink, StoreError> {
        Ok(DirectLink {
            current: ArcSwap::from_pointee(direct_connection(settings)?),
            settings: settings.clone(),
        })
    }

    /// Drops `used` for a fresh connection when `result` is a READONLY reply (once, however
    /// many calls saw it on that connection).
    fn after<T>(&self, used: &Arc<ConnectionManager>, result: &redis::RedisResult<T>) {
        let Err(error) = result else { return };
        if error.kind() != redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly) {
            return;
        }
        let Ok(fresh) = direct_connection(&self.settings) else {
            return;
        };
        let previous = self.current.compare_and_swap(used, Arc::new(fresh));
        if Arc::ptr_eq(&previous, used) {
            tracing::warn!("redis answered READONLY (a replica now): reconnecting");
        }
    }
}

/// A connection to the master Sentinel points at, replaced after a failure: a master that died
/// or was demoted (READONLY) is how a failover shows.
struct SentinelLink {
    client: tokio::sync::Mutex<SentinelClient>,
    current: ArcSwapOption<MultiplexedConnection>,
    rebuilding: AtomicBool,
    config: AsyncConnectionConfig,
    connect_timeout: Duration,
}

impl SentinelLink {
    fn new(target: &SentinelTarget, settings: &RedisSettings) -> Result<SentinelLink, StoreError> {
        let client = SentinelClient::build(
            target.sentinels.clone(),
            target.master_name.as_str(),
            None,
            SentinelServerType::Master,
        )
        .map_err(|error| {
            StoreError::Config(format!("invalid redis sentinel addresses: {error}"))
        })?;
        Ok(SentinelLink {
            client: tokio::sync::Mutex::new(client),
            current: ArcSwapOption::empty(),
            rebuilding: AtomicBool::new(false),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(settings.connect_timeout))
                .set_response_timeout(Some(settings.timeout_cap)),
            connect_timeout: settings.connect_timeout,
        })
    }

    /// Asks Sentinel for the master and connects to it.
    async fn reconnect(&self) {
        let mut client = self.client.lock().await;
        let connect = client.get_async_connection_with_config(&self.config);
        match tokio::time::timeout(self.connect_timeout, connect).await {
            Ok(Ok(connection)) => {
                self.current.store(Some(Arc::new(connection)));
                tracing::info!("redis sentinel: connected to the current master");
            }
            Ok(Err(error)) => tracing::warn!(%error, "redis sentinel: cannot reach the master"),
            Err(_) => tracing::warn!("redis sentinel: master lookup timed out"),
        }
    }

    /// Reconnects in the background, one attempt at a time, at most every 200 ms.
    fn reconnect_later(self: &Arc<Self>) {
        if self.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = Arc::clone(self);
        tokio::spawn(async move {
            link.reconnect().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            link.rebuilding.store(false, Ordering::Release);
        });
    }
}

/// Runs `$call` on the link's connection (bound to `$connection`); a Sentinel link reconnects
/// after a failure.
macro_rules! on_link {
    ($caller:expr, |$connection:ident| $call:expr) => {
        match &$caller.link {
            Link::Direct(link) => {
                let used = link.current.load_full();
                let mut $connection = ConnectionManager::clone(&used);
                let result = $call.await;
                link.after(&used, &result);
                result
            }
            Link::Sentinel(link) => match link.current.load_full() {
                Some(connection) => {
                    let mut $connection = MultiplexedConnection::clone(&connection);
                    let result = $call.await;
                    if result.is_err() {
                        link.reconnect_later();
                    }
                    result
                }
                None => {
                    link.reconnect_later();
                    Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no connection to the master yet",
                    )))
                }
            },
        }
    };
}

impl RedisCaller {
    async fn load_script(&self) -> Result<String, StoreError> {
        let load = async { on_link!(self, |connection| LOADED.load_async(&mut connection)) };
        let loaded = tokio::time::timeout(self.timeout_cap, load)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout_cap))?
            .map_err(|error| StoreError::Unavailable(error.to_string()))?;
        // Learn Redis's clock too, so the first requests carry deadlines without a detour.
        if let Err(error) = self.sync_clock(Instant::now() + self.command_timeout).await {
            tracing::debug!(%error, "redis clock not read at load");
        }
        Ok(loaded)
    }

    async fn ping(&self) -> bool {
        let command = redis::cmd("PING");
        let ping = async {
            on_link!(self, |connection| command
                .query_async::<String>(&mut connection))
        };
        matches!(
            tokio::time::timeout(self.command_timeout, ping).await,
            Ok(Ok(_))
        )
    }

    /// Reads Redis's clock once, by `deadline`.
    async fn sync_clock(&self, deadline: Instant) -> Result<(), StoreError> {
        let command = time_command(None);
        let read = async {
            on_link!(self, |connection| command
                .query_async::<u64>(&mut connection))
        };
        let now = tokio::time::timeout_at(deadline.into(), read)
            .await
            .map_err(|_| StoreError::Timeout(deadline.saturating_duration_since(Instant::now())))?
            .map_err(|error| StoreError::Unavailable(error.to_string()))?;
        self.clock.observe(now, Instant::now());
        Ok(())
    }

    /// Decides `jobs` in one EVALSHA and answers each through its channel; each stays atomic
    /// and all-or-nothing, and later ones see what earlier ones committed.
    ///
    /// A request is decided only if the script reaches it before its script deadline, so a
    /// stalled Redis that runs the call late writes nothing for it. Waits until the latest
    /// deadline; a reply still out then is awaited in the background (up to the cap), and the
    /// hits of any request it committed whose caller had stopped listening are given back.
    async fn run_jobs(self: &Arc<Self>, jobs: Vec<Job>) {
        let Some(latest) = jobs.iter().map(|job| job.budget.deadline).max() else {
            return;
        };
        let Some((jobs, call)) = self.prepare(jobs, latest).await else {
            return;
        };
        let mut reply = Box::pin(Arc::clone(self).send(call));
        tokio::select! {
            biased;
            reply = &mut reply => self.answer(jobs, reply),
            () = tokio::time::sleep_until(latest.into()) => {
                // A master that stopped answering may have been replaced.
                if let Link::Sentinel(link) = &self.link {
                    link.reconnect_later();
                }
                self.await_late(jobs, reply);
            }
        }
    }

    /// Decides one request on a call of its own, awaited in the caller's task; see
    /// [`InFlight`] for a caller that stops waiting first.
    async fn decide_one(
        self: &Arc<Self>,
        checks: &[Check],
        budget: Budget,
    ) -> Result<Vec<Outcome>, StoreError> {
        // Redis's clock is read once per request; only after a clock read is the time left
        // looked at again (without one, the budget was made an instant ago).
        let at = match self
            .clock
            .redis_us_as_of(budget.script_deadline, budget.started)
        {
            Some(at) => (budget.script_deadline > budget.started).then_some(at),
            None => {
                self.sync_clock(budget.deadline).await?;
                (budget.script_deadline > Instant::now())
                    .then(|| self.clock.redis_us(budget.script_deadline))
                    .flatten()
            }
        }
        .ok_or_else(|| budget.exceeded())?;
        let call = ScriptCall::new(self.fixed_clock.as_deref(), &[(checks, Some(at))])
            .with_expiry_jitter(self.expiry_jitter);
        let mut in_flight = InFlight {
            caller: self,
            checks,
            budget,
            call: Some(Box::pin(Arc::clone(self).send(call))),
        };
        let reply = match &mut in_flight.call {
            Some(call) => tokio::time::timeout_at(budget.deadline.into(), call).await,
            None => return Err(budget.exceeded()),
        };
        let Ok(reply) = reply else {
            // A master that stopped answering may have been replaced.
            if let Link::Sentinel(link) = &self.link {
                link.reconnect_later();
            }
            return Err(budget.exceeded());
        };
        in_flight.call = None;
        let received = Instant::now();
        let (now_us, outcomes) = parse_one(&reply?, checks.len())?;
        self.clock.observe(now_us, received);
        outcomes.ok_or_else(|| budget.exceeded())
    }

    /// Awaits `call`, which carries `jobs`, after their callers stopped waiting: for at most
    /// the timeout cap, and only while the lane's late requests stay within their bound; the
    /// hits of what its reply committed are then given back. Past the bound the call is let
    /// go (its jobs answered as timed out), and what it commits stays counted.
    fn await_late(self: &Arc<Self>, jobs: Vec<Job>, call: SentCall) {
        let runtime = tokio::runtime::Handle::try_current();
        let (Some(hold), Ok(runtime)) = (self.late.hold(jobs.len()), runtime) else {
            for job in jobs {
                let _ = job.reply.send(Err(job.budget.exceeded()));
            }
            return;
        };
        let caller = Arc::clone(self);
        runtime.spawn(async move {
            let reply = tokio::time::timeout(caller.timeout_cap, call)
                .await
                .unwrap_or(Err(StoreError::Timeout(caller.timeout_cap)));
            caller.answer(jobs, reply);
            drop(hold);
        });
    }

    /// The call for `jobs` on Redis's clock (read first if still unknown), and the jobs it
    /// carries; jobs already past their script deadline are answered as timed out here.
    async fn prepare(&self, jobs: Vec<Job>, latest: Instant) -> Option<(Vec<Job>, ScriptCall)> {
        if self.clock.redis_us(latest).is_none()
            && let Err(error) = self.sync_clock(latest).await
        {
            for job in jobs {
                let _ = job.reply.send(Err(error.clone()));
            }
            return None;
        }
        let now = Instant::now();
        let mut sent = Vec::with_capacity(jobs.len());
        let mut deadlines = Vec::with_capacity(jobs.len());
        for job in jobs {
            let script_deadline = job.budget.script_deadline;
            match (script_deadline > now)
                .then(|| self.clock.redis_us(script_deadline))
                .flatten()
            {
                Some(at) => {
                    sent.push(job);
                    deadlines.push(Some(at));
                }
                None => {
                    let _ = job.reply.send(Err(job.budget.exceeded()));
                }
            }
        }
        if sent.is_empty() {
            return None;
        }
        let requests: Vec<(&[Check], Option<u64>)> = sent
            .iter()
            .zip(deadlines)
            .map(|(job, at)| (job.checks.as_slice(), at))
            .collect();
        let call = ScriptCall::new(self.fixed_clock.as_deref(), &requests)
            .with_expiry_jitter(self.expiry_jitter);
        Some((sent, call))
    }

    /// Sends `call`; owns everything, so it can finish after its caller stopped waiting.
    async fn send(self: Arc<Self>, call: ScriptCall) -> Result<Vec<u8>, StoreError> {
        // Never retried after a timeout: the script may have run, and a retry could count twice.
        let reply = match &self.link {
            Link::Direct(link) => {
                let used = link.current.load_full();
                let result = call.run_on(&mut ConnectionManager::clone(&used)).await;
                link.after(&used, &result);
                result
            }
            Link::Sentinel(_) => on_link!(self, |connection| call.run(&mut connection)),
        };
        reply.map_err(|error| StoreError::Unavailable(error.to_string()))
    }

    /// Answers each job from `reply`; gives back what a request committed when its caller no
    /// longer listens.
    fn answer(self: &Arc<Self>, jobs: Vec<Job>, reply: Result<Vec<u8>, StoreError>) {
        let received = Instant::now();
        let sizes: Vec<usize> = jobs.iter().map(|job| job.checks.len()).collect();
        let answers = match reply.and_then(|reply| split_reply(&reply, &sizes)) {
            Ok(reply) => {
                self.clock.observe(reply.now_us, received);
                reply.answers
            }
            Err(error) => {
                for job in jobs {
                    let _ = job.reply.send(Err(error.clone()));
                }
                return;
            }
        };
        let mut unused = Vec::new();
        for (job, answer) in jobs.into_iter().zip(answers) {
            let answer = answer.ok_or_else(|| job.budget.exceeded());
            // A send that fails hands the answer back: nobody took it.
            if let Err(Ok(outcomes)) = job.reply.send(answer)
                && request_allowed(&job.checks, &outcomes)
            {
                unused.extend(refunds(&job.checks, &outcomes));
            }
        }
        self.give_back_later(unused);
    }

    /// Gives `unused` back in a task of its own: the call slot a batch holds is for deciding.
    fn give_back_later(self: &Arc<Self>, unused: Vec<Check>) {
        if unused.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("redis: shutting down; the hits of an unused answer stay counted");
            return;
        };
        let caller = Arc::clone(self);
        runtime.spawn(async move { caller.give_back(&unused).await });
    }

    /// Refunds hits committed for requests whose answers went unused: with no deadline, since
    /// they must land however late.
    async fn give_back(&self, refunds: &[Check]) {
        let call = ScriptCall::new(self.fixed_clock.as_deref(), &[(refunds, None)]);
        let sent = async { on_link!(self, |connection| call.run(&mut connection)) };
        match tokio::time::timeout(self.timeout_cap, sent).await {
            Ok(Ok(_)) => tracing::debug!(
                checks = refunds.len(),
                "gave back the hits of answers that came too late to be used"
            ),
            Ok(Err(error)) => {
                tracing::warn!(%error, "redis: giving back the hits of an unused answer failed; they stay counted")
            }
            Err(_) => tracing::warn!(
                "redis: giving back the hits of an unused answer timed out; they may stay counted"
            ),
        }
    }
}

/// The command that reads Redis's clock (µs), on the node holding `key` when given.
pub(super) fn time_command(key: Option<&str>) -> redis::Cmd {
    let mut command = redis::cmd("EVAL");
    command.arg(TIME_SCRIPT);
    match key {
        Some(key) => command.arg(1).arg(key),
        None => command.arg(0),
    };
    command
}

/// One EVALSHA of the script (see `lua/ratelimit.lua` for the layout), its keys and arguments
/// written straight into one command buffer: a `ScriptInvocation` allocates a buffer per
/// argument and then copies them all into the command again.
pub(super) struct ScriptCall {
    command: redis::Cmd,
}

impl ScriptCall {
    /// The call deciding `requests`, in order, each by its deadline on the script's clock (µs;
    /// `None`: whenever the script runs).
    pub(super) fn new(
        fixed_clock: Option<&dyn Clock>,
        requests: &[(&[Check], Option<u64>)],
    ) -> ScriptCall {
        ScriptCall::build(fixed_clock, requests, false)
    }

    /// [`ScriptCall::new`] for a call that must write nothing (with a check that always
    /// denies): its charges are evaluated as charges but not recorded when denied.
    pub(super) fn evaluating(
        fixed_clock: Option<&dyn Clock>,
        requests: &[(&[Check], Option<u64>)],
    ) -> ScriptCall {
        ScriptCall::build(fixed_clock, requests, true)
    }

    /// Adds a random 0..=`max` (whole milliseconds) to the TTL of every key the call writes;
    /// nothing when `max` is zero.
    pub(super) fn with_expiry_jitter(mut self, max: Duration) -> ScriptCall {
        let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX);
        if max_ms > 0 {
            // A fresh SipHash key per call (std seeds them randomly): random enough to spread
            // expiries, without a crate.
            use std::hash::{BuildHasher, Hasher};
            let random = std::hash::RandomState::new().build_hasher().finish();
            self.command.arg(random % max_ms.saturating_add(1));
        }
        self
    }

    fn build(
        fixed_clock: Option<&dyn Clock>,
        requests: &[(&[Check], Option<u64>)],
        evaluating: bool,
    ) -> ScriptCall {
        let keys: usize = requests.iter().map(|(checks, _)| checks.len()).sum();
        let key_bytes: usize = requests
            .iter()
            .flat_map(|(checks, _)| checks.iter())
            .map(|check| check.key.len())
            .sum();
        // Sized up front: grown argument by argument, the buffers were reallocated several
        // times per call. At most one limit per check; numbers take a few digits each.
        let arguments = 6 + keys * 8 + requests.len() * 3;
        let mut command =
            redis::Cmd::with_capacity(arguments, 64 + key_bytes + arguments * NUMBER_BYTES);
        command.arg("EVALSHA").arg(LOADED.get_hash()).arg(keys);
        for check in requests.iter().flat_map(|(checks, _)| checks.iter()) {
            command.arg(check.key.as_str());
        }
        match fixed_clock {
            Some(clock) => command.arg(clock.now_us()),
            None => command.arg(""),
        };
        // Each distinct limit goes once; checks name theirs by index. A batch holds few
        // distinct limits (every request of a route shares them), so a scan finds them.
        // The script's mode argument: 0 enforced, 1 shadow, 2 quota mode.
        fn limit_of(check: &Check) -> (&Params, u8) {
            let mode = if check.shadow {
                1
            } else {
                2 * u8::from(check.quota_mode)
            };
            (&check.params, mode)
        }
        let mut limits: Vec<(&Params, u8)> = Vec::new();
        for check in requests.iter().flat_map(|(checks, _)| checks.iter()) {
            if !limits.contains(&limit_of(check)) {
                limits.push(limit_of(check));
            }
        }
        command.arg(limits.len());
        for (params, mode) in &limits {
            command
                .arg(params.algorithm.key_tag())
                .arg(params.limit)
                .arg(params.period_us)
                .arg(params.burst)
                .arg(*mode);
        }
        command.arg(requests.len());
        for (checks, deadline) in requests {
            command.arg(checks.len());
            match deadline {
                Some(at) => command.arg(*at),
                None => command.arg(""),
            };
            for check in *checks {
                let index = limits.iter().position(|known| *known == limit_of(check));
                command.arg(index.map_or(0, |index| index + 1));
                match check.hits {
                    Hits::Take(n) => command.arg(n),
                    Hits::Peek => command.arg("p"),
                    // Refunds and charges are rare: one small allocation is fine.
                    Hits::Refund(n) => command.arg(format!("r{n}")),
                    Hits::Charge(n) if evaluating => command.arg(format!("d{n}")),
                    Hits::Charge(n) => command.arg(format!("c{n}")),
                };
            }
        }
        ScriptCall { command }
    }

    /// Runs the call and returns the script's reply. On NOSCRIPT (Redis restarted, failed
    /// over, or its scripts were flushed) the script did not run: the same call goes again as
    /// an EVAL carrying the script, one more round trip instead of a load and a retry, so the
    /// reload stays within the caller's budget and nothing counts twice.
    pub(super) async fn run(
        &self,
        connection: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<Vec<u8>> {
        match self.command.query_async(connection).await {
            Err(error)
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                self.with_script_body().query_async(connection).await
            }
            reply => reply,
        }
    }

    /// [`ScriptCall::run`] on a direct connection, through its own future rather than the
    /// boxed one of redis-rs's `ConnectionLike`: a request's call is already boxed once.
    async fn run_on(&self, connection: &mut ConnectionManager) -> redis::RedisResult<Vec<u8>> {
        let reply = match connection.send_packed_command(&self.command).await {
            Ok(reply) => reply.extract_error(),
            Err(error) => Err(error),
        };
        let reply = match reply {
            Err(error)
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                connection
                    .send_packed_command(&self.with_script_body())
                    .await?
                    .extract_error()?
            }
            reply => reply?,
        };
        Ok(redis::from_redis_value(reply)?)
    }

    /// The same call as `EVAL <script> ...`.
    fn with_script_body(&self) -> redis::Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(SCRIPT);
        for arg in self.command.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                eval.arg(bytes);
            }
        }
        eval
    }
}

impl RedisStore {
    /// Runs another script (the quota service's) on the shared connection within the command
    /// timeout; redis-rs sends EVALSHA and reloads the script on NOSCRIPT.
    ///
    /// # Errors
    /// When Redis cannot be reached, refuses the script or does not answer in time.
    pub async fn run_script<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let caller = &self.shared.caller;
        let call = async {
            on_link!(caller, |connection| invocation
                .invoke_async::<T>(&mut connection))
        };
        tokio::time::timeout(caller.timeout_cap, call)
            .await
            .map_err(|_| StoreError::Timeout(caller.timeout_cap))?
            .map_err(|error| StoreError::Unavailable(error.to_string()))
    }
}

/// The EVALSHA that decides `requests`, exactly as the store sends it: on Redis's clock, or at
/// `fixed_clock`'s time as in tests (the bench tool replays it with `redis-benchmark` as the
/// one-call-per-request ceiling).
pub fn script_command(requests: &[&[Check]], fixed_clock: Option<&dyn Clock>) -> redis::Cmd {
    let requests: Vec<(&[Check], Option<u64>)> =
        requests.iter().map(|checks| (*checks, None)).collect();
    ScriptCall::new(fixed_clock, &requests).command
}

/// Each request's outcomes from the reply to the [`script_command`] for requests of `sizes`
/// checks each, read as the store reads them (the bench's pooled store uses it).
///
/// # Errors
/// When the reply is not the script's answer to such a call.
#[doc(hidden)]
pub fn script_outcomes(
    reply: &[u8],
    sizes: &[usize],
) -> Result<Vec<Option<Vec<Outcome>>>, StoreError> {
    split_reply(reply, sizes).map(|reply| reply.answers)
}

/// A script reply: the script's clock, and each request's outcomes (`None`: the script
/// reached it after its deadline and wrote nothing).
pub(super) struct ScriptReply {
    pub(super) now_us: u64,
    pub(super) answers: Vec<Option<Vec<Outcome>>>,
}

/// The script's reply to requests of `sizes` checks each, split back into one answer per
/// request.
pub(super) fn split_reply(reply: &[u8], sizes: &[usize]) -> Result<ScriptReply, StoreError> {
    let total: usize = sizes.iter().sum();
    let (now_us, outcomes) = parse_reply(reply, total)?;
    let mut outcomes = outcomes.into_iter();
    let answers = sizes
        .iter()
        .map(|&size| {
            let answer: Vec<Option<Outcome>> = outcomes.by_ref().take(size).collect();
            answer.into_iter().collect::<Option<Vec<Outcome>>>()
        })
        .collect();
    Ok(ScriptReply { now_us, answers })
}

/// One request to decide, and where its answer goes.
struct Job {
    checks: Vec<Check>,
    budget: Budget,
    reply: oneshot::Sender<Result<Vec<Outcome>, StoreError>>,
}

/// Runs batches: waits for a request, then for a free call slot, then takes whatever else
/// queued meanwhile (at most `max_batch` requests), so a busy server sends fewer, larger calls.
async fn run_batches(
    store: Arc<RedisCaller>,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    calls: Arc<Semaphore>,
    max_batch: usize,
) {
    loop {
        // The lock is held while waiting for a slot too: no other batch could go out before a
        // slot frees anyway, and the batch then takes everything that queued meanwhile.
        let mut waiting = queue.lock().await;
        let Some(first) = waiting.recv().await else {
            return;
        };
        let Ok(_slot) = calls.acquire().await else {
            return;
        };
        let mut checks = first.checks.len();
        let mut jobs = vec![first];
        // Bounded by requests and by checks, so one call stays short for Redis.
        while jobs.len() < max_batch && checks < MAX_BATCH_CHECKS {
            match waiting.try_recv() {
                Ok(job) => {
                    checks += job.checks.len();
                    jobs.push(job);
                }
                Err(_) => break,
            }
        }
        drop(waiting);
        // A caller that gave up (its own timeout) is not decided late.
        jobs.retain(|job| !job.reply.is_closed());
        if jobs.is_empty() {
            continue;
        }
        store.run_jobs(jobs).await;
    }
}

/// The script's clock, then `allowed remaining reset_us` per check (`None` for a late request's
/// checks, allowed 2), as decimal integers separated by spaces. Read byte by byte: through
/// `str::parse` the reply cost thousands of instructions per request.
fn parse_reply(reply: &[u8], checks: usize) -> Result<(u64, Vec<Option<Outcome>>), StoreError> {
    let mut outcomes = Vec::with_capacity(checks);
    let now_us = read_reply(reply, checks, |outcome| outcomes.push(outcome))?;
    Ok((now_us, outcomes))
}

/// The reply to a call of one request: the script's clock, and its outcomes (`None`: the
/// script reached it past its deadline).
fn parse_one(reply: &[u8], checks: usize) -> Result<(u64, Option<Vec<Outcome>>), StoreError> {
    let mut outcomes = Vec::with_capacity(checks);
    let mut late = false;
    let now_us = read_reply(reply, checks, |outcome| match outcome {
        Some(outcome) => outcomes.push(outcome),
        None => late = true,
    })?;
    Ok((now_us, (!late).then_some(outcomes)))
}

/// Reads the reply of [`parse_reply`], handing each check's outcome to `each`; returns the
/// script's clock.
fn read_reply(
    reply: &[u8],
    checks: usize,
    mut each: impl FnMut(Option<Outcome>),
) -> Result<u64, StoreError> {
    let mut numbers = ReplyNumbers { reply, at: 0 };
    let now_us = numbers
        .next()
        .ok_or_else(|| StoreError::Protocol("script answered nothing".to_owned()))??;
    for read in 0..checks {
        let (Some(allowed), Some(remaining), Some(reset)) =
            (numbers.next(), numbers.next(), numbers.next())
        else {
            return Err(StoreError::Protocol(format!(
                "script answered {} values for {checks} checks",
                read * 3
            )));
        };
        let (allowed, remaining, reset_us) = (allowed?, remaining?, reset?);
        each((allowed != LATE).then_some(Outcome {
            verdict: Verdict {
                allowed: allowed == 1,
                remaining,
                reset_us,
            },
        }));
    }
    if numbers.next().is_some() {
        return Err(StoreError::Protocol(format!(
            "script answered more than {} values for {checks} checks",
            checks * 3
        )));
    }
    Ok(now_us)
}

/// The `allowed` the script answers for the checks of a request it reached past its deadline.
const LATE: u64 = 2;

/// Typical bytes of one numeric argument, for sizing a command.
const NUMBER_BYTES: usize = 8;

/// The space-separated non-negative integers of a script reply, in order.
struct ReplyNumbers<'r> {
    reply: &'r [u8],
    at: usize,
}

impl Iterator for ReplyNumbers<'_> {
    type Item = Result<u64, StoreError>;

    /// One pass over the token: spaces skipped, digits read as they come.
    fn next(&mut self) -> Option<Self::Item> {
        let reply = self.reply;
        let mut at = self.at;
        while reply.get(at) == Some(&b' ') {
            at += 1;
        }
        if at == reply.len() {
            self.at = at;
            return None;
        }
        let start = at;
        let mut value: u64 = 0;
        let mut digits = true;
        while let Some(&byte) = reply.get(at) {
            if byte == b' ' {
                break;
            }
            let digit = byte.wrapping_sub(b'0');
            digits &= digit < 10;
            value = value.wrapping_mul(10).wrapping_add(u64::from(digit));
            at += 1;
        }
        self.at = at;
        let token = &reply[start..at];
        // Up to 19 digits cannot overflow; a longer token is read again with checks.
        let exact = match token.len() {
            0..=19 => Some(value),
            _ => token.iter().try_fold(0_u64, |value, &byte| {
                value
                    .checked_mul(10)?
                    .checked_add(u64::from(byte.wrapping_sub(b'0')))
            }),
        };
        if let (true, Some(value)) = (digits, exact) {
            return Some(Ok(value));
        }
        Some(Err(StoreError::Protocol(format!(
            "script answered {:?} where a non-negative integer belongs",
            String::from_utf8_lossy(token)
        ))))
    }
}

impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn healthy(&self) -> bool {
        self.ping().await
    }

    fn report(&self, metrics: &crate::metrics::Metrics) {
        let lanes =
            std::iter::once(&self.shared).chain(self.lanes.iter().filter_map(OnceLock::get));
        let (held, let_go) = lanes.fold((0, 0), |(held, let_go), lane| {
            (
                held + lane.caller.late.held(),
                let_go + lane.caller.late.let_go(),
            )
        });
        metrics
            .redis_late_requests
            .set(i64::try_from(held).unwrap_or(i64::MAX));
        metrics
            .redis_late_requests_let_go
            .set(i64::try_from(let_go).unwrap_or(i64::MAX));
    }

    async fn open_lane(&self) {
        let lane = self.lane();
        if std::ptr::eq(lane, &self.shared) {
            return;
        }
        // Connects, and makes sure the script is there, before the lane takes requests.
        let opened = tokio::time::timeout(self.settings.connect_timeout, lane.caller.load_script());
        match opened.await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, "redis not reachable from a lane yet; will retry per request")
            }
            Err(_) => tracing::warn!(
                "redis not reachable from a lane yet (connect timeout); will retry per request"
            ),
        }
    }

    async fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        self.lane().decide(checks, deadline).await
    }
}

#[cfg(test)]
mod reply_tests {
    use super::*;

    #[test]
    fn replies_parse_three_integers_per_check() {
        let (now, outcomes) = parse_reply(b"77 1 4 1000 0 0 250000 2 0 0", 3).expect("parses");
        assert_eq!(now, 77);
        assert_eq!(
            outcomes
                .iter()
                .map(|o| o.map(|o| (o.verdict.allowed, o.verdict.remaining, o.verdict.reset_us)))
                .collect::<Vec<_>>(),
            [Some((true, 4, 1000)), Some((false, 0, 250_000)), None]
        );
        assert!(parse_reply(b"5", 0).expect("empty").1.is_empty());
    }

    proptest::proptest! {
        /// Whatever the numbers and however many spaces between them, each reads as `str::parse`
        /// reads it.
        #[test]
        fn replies_read_every_u64_exactly(
            checks in proptest::collection::vec((0..=1_u64, proptest::num::u64::ANY, proptest::num::u64::ANY), 0..20),
            gaps in proptest::collection::vec(1..4_usize, 60),
        ) {
            let mut reply = String::from("1");
            reply.push_str(&" ".repeat(gaps[0]));
            for (i, number) in checks.iter().flat_map(|&(a, r, t)| [a, r, t]).enumerate() {
                if i > 0 {
                    reply.push_str(&" ".repeat(gaps[i % gaps.len()]));
                }
                reply.push_str(&number.to_string());
            }
            let (_, outcomes) = parse_reply(reply.as_bytes(), checks.len()).expect("parses");
            let read: Vec<(bool, u64, u64)> = outcomes
                .iter()
                .flatten()
                .map(|o| (o.verdict.allowed, o.verdict.remaining, o.verdict.reset_us))
                .collect();
            let expected: Vec<(bool, u64, u64)> =
                checks.iter().map(|&(a, r, t)| (a == 1, r, t)).collect();
            proptest::prop_assert_eq!(read, expected);
        }
    }

    #[test]
    fn malformed_replies_are_protocol_errors() {
        for (reply, checks) in [
            (&b"1 4"[..], 1),
            (b"1 4 1000 1", 1),
            (b"1 -4 1000", 1),
            (b"1 4 1e3", 1),
            (b"1 4 18446744073709551616", 1),
            (b"1 4 +3", 1),
            (b"", 1),
        ] {
            let reply = [&b"9 "[..], reply].concat();
            assert!(
                matches!(parse_reply(&reply, checks), Err(StoreError::Protocol(_))),
                "{:?} for {checks} checks",
                String::from_utf8_lossy(&reply)
            );
        }
        assert!(matches!(parse_reply(b"", 0), Err(StoreError::Protocol(_))));
    }
}
