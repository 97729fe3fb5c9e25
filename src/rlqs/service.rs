//! The streams: each Envoy's reports turned into demands, demands into shares, shares into
//! the assignments Envoy applies. One task per stream; nothing a stream sends reaches another.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::alloc::{self, Bucket};
use super::board::{Demand, DemandBoard, Wake};
use super::metrics::RlqsMetrics;
use super::rules::Quota;
use crate::config::Config;
use crate::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, rate_limit_quota_response,
    rate_limit_quota_service_server::RateLimitQuotaService,
};
use crate::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket, rate_limit_strategy};
use crate::service::{ChargeDescriptor, Charged, FailureMode};

use rate_limit_quota_response::BucketAction;
use rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};

/// How the quota service behaves, and what one client may hold of it.
#[derive(Clone, Debug)]
pub struct RlqsSettings {
    /// Report interval assumed until a bucket's own is measured (Envoy's is 5 s).
    pub report_interval: Duration,
    /// A bucket reported 0/0 for this long is abandoned.
    pub idle_after: Duration,
    /// Buckets one stream may hold; a report beyond it ends the stream.
    pub max_buckets_per_stream: usize,
    /// Streams open at once on this server; more are refused with RESOURCE_EXHAUSTED.
    pub max_streams: usize,
    /// Entries one bucket id may have.
    pub max_bucket_entries: usize,
    /// Bytes of one bucket id's keys and values (and of the domain).
    pub max_bucket_bytes: usize,
    /// Bytes of one report message.
    pub max_report_bytes: usize,
    /// A stream that has sent no report this long after it opened is ended.
    pub first_report_timeout: Duration,
    /// What Envoys are told when the store fails.
    pub failure_mode: FailureMode,
}

impl Default for RlqsSettings {
    fn default() -> Self {
        RlqsSettings {
            report_interval: Duration::from_secs(5),
            idle_after: Duration::from_secs(60),
            max_buckets_per_stream: 1_000,
            max_streams: 10_000,
            max_bucket_entries: 16,
            max_bucket_bytes: 1_024,
            max_report_bytes: 1 << 20,
            first_report_timeout: Duration::from_secs(10),
            failure_mode: FailureMode::Error,
        }
    }
}

/// Assignments last this many report intervals, so one late or lost report does not let a
/// bucket fall back.
const TTL_INTERVALS: f64 = 3.0;
/// The shortest TTL of a real assignment: what lets Envoys ride out a restart of rlsd (or a
/// move to another replica) on their shares, rather than fall back. Shares are sent again at
/// every report, so a long TTL delays nothing.
const MIN_TTL_SECONDS: f64 = 20.0;
/// An Envoy's demand is forgotten (its share reclaimed) after this many intervals unreported.
const DEPARTED_INTERVALS: f64 = 2.5;
/// Reports closer together than this are summed with the next one before a rate is taken:
/// a bucket's first periodic report can come right after its initial one.
const MIN_RATE_WINDOW: Duration = Duration::from_millis(500);
/// Intervals a reconnected bucket waits at least for its peers (see [`Held::quiet`]).
const QUIET_INTERVALS: u32 = 2;
/// Intervals it waits at most: well inside [`MIN_TTL_SECONDS`] at Envoy's 5 s.
const MAX_QUIET_INTERVALS: u32 = 3;
/// The TTL of a failure-mode assignment, in intervals: short, so the real one returns soon.
const FAILURE_TTL_INTERVALS: f64 = 2.0;
/// A stream recomputes after peers' changes at most once per this fraction of the report
/// interval, so a flood of changes cannot make it spin.
const PUSH_GAP_FRACTION: u32 = 10;

/// The quota service a server routes `StreamRateLimitQuotas` to.
#[derive(Clone)]
pub struct QuotaService {
    shared: Arc<Shared>,
}

struct Shared {
    config: Arc<ArcSwap<Config>>,
    board: Arc<dyn DemandBoard>,
    /// Where buckets that share an RLS descriptor's budget are charged.
    budget: Arc<dyn ChargeDescriptor>,
    settings: RlqsSettings,
    metrics: RlqsMetrics,
    view: Arc<View>,
    streams: Arc<Semaphore>,
    stop: watch::Receiver<bool>,
    replica: String,
    next_stream: AtomicU64,
}

impl QuotaService {
    /// A service answering from `config`, its demands on `board`, shared budgets charged
    /// through `budget` (the RLS service), ending every stream when `stop` turns true.
    pub fn new(
        config: Arc<ArcSwap<Config>>,
        board: Arc<dyn DemandBoard>,
        budget: Arc<dyn ChargeDescriptor>,
        settings: RlqsSettings,
        metrics: RlqsMetrics,
        stop: watch::Receiver<bool>,
    ) -> QuotaService {
        QuotaService {
            shared: Arc::new(Shared {
                config,
                board,
                budget,
                streams: Arc::new(Semaphore::new(settings.max_streams)),
                settings,
                metrics,
                view: Arc::new(View::default()),
                stop,
                replica: replica_id(),
                next_stream: AtomicU64::new(0),
            }),
        }
    }

    /// The assignments of every stream, for the debug port.
    pub fn view(&self) -> Arc<View> {
        Arc::clone(&self.shared.view)
    }

    /// The largest report message accepted.
    pub fn max_report_bytes(&self) -> usize {
        self.shared.settings.max_report_bytes
    }
}

/// An id for this process that other replicas' cannot share: streams are named by it.
fn replica_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    format!("{:016x}", hasher.finish())
}

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let Ok(permit) = Arc::clone(&self.shared.streams).try_acquire_owned() else {
            self.shared
                .metrics
                .stream_errors
                .with_label_values(&["too_many_streams"])
                .inc();
            return Err(Status::resource_exhausted(format!(
                "rlsd serves at most {} RLQS streams (--rlqs-max-streams)",
                self.shared.settings.max_streams
            )));
        };
        let (sender, receiver) = mpsc::channel(4);
        let shared = Arc::clone(&self.shared);
        let number = shared.next_stream.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{number}", shared.replica);
        tokio::spawn(async move {
            shared.metrics.streams.inc();
            let mut stream = StreamState {
                id,
                domain: None,
                buckets: HashMap::new(),
                wake: Arc::new(Wake::default()),
            };
            stream.run(&shared, request.into_inner(), &sender).await;
            stream.leave_all(&shared).await;
            shared.view.remove(&stream.id);
            shared.metrics.streams.dec();
            drop(permit);
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }
}

/// One stream's buckets.
struct StreamState {
    id: String,
    domain: Option<String>,
    buckets: HashMap<String, Held>,
    /// Woken when a peer changes the demands of a bucket this stream has on the board.
    wake: Arc<Wake>,
}

/// What a stream knows of one of its buckets.
struct Held {
    /// The id as Envoy sent it, echoed in every action.
    id: BucketId,
    /// `k=v,k2=v2`, for metrics and the debug view.
    label: String,
    /// When it was last reported.
    last_seen: Instant,
    /// Report interval estimate, seconds.
    interval: f64,
    /// Requests reported since `window_start`, not yet turned into a rate.
    carried: u64,
    window_start: Instant,
    /// Requests per second, allowed and denied; infinite until measured.
    demand: f64,
    /// Since when every report said 0/0.
    idle_since: Option<Instant>,
    /// Whether its demand is on the board.
    on_board: bool,
    /// Whether this stream holds the bucket's metric series ([`RlqsMetrics::hold`]).
    metered: bool,
    /// The last assignment sent.
    sent: Option<Sent>,
    /// The fleet's rate and fill interval of its last split, for a recompute between reports.
    split: Option<(f64, u32)>,
    /// While nothing is assigned: a bucket first seen in a periodic report comes from an
    /// Envoy that held it before (rlsd restarted, or its stream moved here), which keeps its
    /// assignment until the TTL while its peers reconnect. Assigning before they are on the
    /// board would hand the first one back the whole limit.
    quiet: Option<Quiet>,
}

/// A reconnected bucket's wait for its peers: at least [`QUIET_INTERVALS`] from first sight,
/// and until the peers on the board stopped growing for one interval, at most
/// [`MAX_QUIET_INTERVALS`].
#[derive(Clone, Copy)]
struct Quiet {
    since: Instant,
    peers: usize,
    peers_changed: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Sent {
    Bucket(Bucket),
    AllowAll,
    DenyAll,
}

/// A bucket of this report whose limit is split over Envoys.
struct Split {
    key: String,
    /// Requests per second for the fleet (a shared budget's: what its counter has left).
    limit: f64,
    /// Envoy's fill interval, fixed by the configured limit.
    fill: u32,
    /// The store failed on a shared budget's charge: the failure mode answers.
    failed: Option<crate::store::StoreError>,
}

/// A bucket of this report that shares an RLS descriptor's budget: its allowed requests are
/// charged to the descriptor's counter before its split.
struct Charge {
    key: String,
    entries: Vec<(String, String)>,
    allowed: u64,
}

impl StreamState {
    async fn run(
        &mut self,
        shared: &Shared,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        sender: &mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    ) {
        let mut stop = shared.stop.clone();
        let stopping = async move {
            // A sender gone without saying stop never stops the stream.
            if stop.wait_for(|stop| *stop).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::pin!(stopping);
        let first_deadline = tokio::time::Instant::now() + shared.settings.first_report_timeout;
        let wake = Arc::clone(&self.wake);
        let push_gap = shared.settings.report_interval / PUSH_GAP_FRACTION;
        let mut last_push = tokio::time::Instant::now();
        let mut push_at: Option<tokio::time::Instant> = None;
        let ended: Result<(), (Status, &'static str)> = loop {
            let waiting_for_first = self.domain.is_none();
            let next = async {
                if waiting_for_first {
                    tokio::time::timeout_at(first_deadline, inbound.message())
                        .await
                        .unwrap_or_else(|_| {
                            Err(Status::deadline_exceeded(
                                "no report within --rlqs-first-report-timeout",
                            ))
                        })
                } else {
                    inbound.message().await
                }
            };
            tokio::select! {
                () = &mut stopping => break Err((
                    Status::unavailable("rlsd is shutting down: reconnect (assignments hold until their TTL)"),
                    "shutdown",
                )),
                // A peer changed a bucket's demands: recompute, coalesced to one per gap.
                () = wake.changed(), if push_at.is_none() => {
                    push_at = Some((last_push + push_gap).max(tokio::time::Instant::now()));
                }
                () = tokio::time::sleep_until(push_at.unwrap_or_else(tokio::time::Instant::now)), if push_at.is_some() => {
                    push_at = None;
                    last_push = tokio::time::Instant::now();
                    if let Some(response) = self.push(shared).await
                        && sender.send(Ok(response)).await.is_err()
                    {
                        break Ok(());
                    }
                }
                message = next => match message {
                    Ok(None) => break Ok(()),
                    Err(status) if status.code() == tonic::Code::DeadlineExceeded => {
                        break Err((status, "no_first_report"));
                    }
                    Err(status) if status.code() == tonic::Code::OutOfRange => {
                        break Err((status, "report_too_large"));
                    }
                    // The client went away or sent garbage: nothing to answer.
                    Err(_) => break Ok(()),
                    Ok(Some(report)) => match self.handle(shared, report).await {
                        Ok(Some(response)) => {
                            if sender.send(Ok(response)).await.is_err() {
                                break Ok(());
                            }
                        }
                        Ok(None) => {}
                        Err(failed) => break Err(failed),
                    },
                },
            }
        };
        if let Err((status, reason)) = ended {
            shared
                .metrics
                .stream_errors
                .with_label_values(&[reason])
                .inc();
            tracing::debug!(stream = %self.id, %status, "rlqs stream ended");
            let _ = sender.send(Err(status)).await;
        }
    }

    /// One report: validated whole first (a bad one changes nothing), then each bucket's
    /// demand, the board, the actions.
    async fn handle(
        &mut self,
        shared: &Shared,
        report: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, (Status, &'static str)> {
        let now = Instant::now();
        let settings = &shared.settings;
        let invalid = |reason: &'static str, message: String| {
            Err((Status::invalid_argument(message), reason))
        };
        if report.domain.is_empty() {
            return invalid("no_domain", "the report has no domain".to_owned());
        }
        if report.domain.len() > settings.max_bucket_bytes {
            return invalid(
                "domain_too_long",
                format!(
                    "the domain is longer than {} bytes (--rlqs-max-bucket-bytes)",
                    settings.max_bucket_bytes
                ),
            );
        }
        if let Some(domain) = &self.domain
            && *domain != report.domain
        {
            return invalid(
                "domain_changed",
                format!(
                    "the domain changed mid-stream from '{domain}' to '{}'",
                    report.domain
                ),
            );
        }
        let mut keyed = Vec::with_capacity(report.bucket_quota_usages.len());
        let mut new_buckets = 0;
        for usage in &report.bucket_quota_usages {
            let entries = match &usage.bucket_id {
                Some(id) if !id.bucket.is_empty() => &id.bucket,
                _ => return invalid("empty_bucket_id", "a bucket_id is empty".to_owned()),
            };
            if entries.len() > settings.max_bucket_entries {
                return invalid(
                    "bucket_id_too_large",
                    format!(
                        "a bucket_id has {} entries, more than {} (--rlqs-max-bucket-entries)",
                        entries.len(),
                        settings.max_bucket_entries
                    ),
                );
            }
            let bytes: usize = entries.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > settings.max_bucket_bytes {
                return invalid(
                    "bucket_id_too_large",
                    format!(
                        "a bucket_id has {bytes} bytes, more than {} (--rlqs-max-bucket-bytes)",
                        settings.max_bucket_bytes
                    ),
                );
            }
            if entries.iter().any(|(k, v)| k.is_empty() || v.is_empty()) {
                return invalid(
                    "empty_bucket_entry",
                    "a bucket_id has an empty key or value".to_owned(),
                );
            }
            let sorted: BTreeMap<String, String> = entries
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let key = canonical(&sorted);
            if !self.buckets.contains_key(&key) {
                new_buckets += 1;
            }
            keyed.push((key, sorted));
        }
        if self.buckets.len() + new_buckets > settings.max_buckets_per_stream {
            return Err((
                Status::resource_exhausted(format!(
                    "more than {} buckets on one stream (--rlqs-max-buckets-per-stream)",
                    settings.max_buckets_per_stream
                )),
                "too_many_buckets",
            ));
        }
        if self.domain.is_none() {
            self.domain = Some(report.domain.clone());
        }
        shared.metrics.reports.inc();
        if report.bucket_quota_usages.is_empty() {
            // Envoy sends these every interval while it holds no bucket.
            shared
                .metrics
                .skipped
                .with_label_values(&["empty_report"])
                .inc();
            return Ok(None);
        }
        let domain = report.domain.as_str();
        let config = shared.config.load();
        let rules = config.domains.get(domain).map(|domain| &domain.quota);
        let mut actions = Vec::new();
        let mut splits = Vec::new();
        let mut charges = Vec::new();
        let mut gone = Vec::new();
        for (usage, (key, sorted)) in report.bucket_quota_usages.iter().zip(keyed) {
            let count = usage
                .num_requests_allowed
                .saturating_add(usage.num_requests_denied);
            let label = label(&sorted);
            let held = self.buckets.entry(key.clone()).or_insert_with(|| Held {
                id: BucketId {
                    bucket: sorted.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                },
                label,
                last_seen: now,
                interval: settings.report_interval.as_secs_f64(),
                carried: 0,
                window_start: now,
                demand: f64::INFINITY,
                idle_since: None,
                on_board: false,
                metered: false,
                sent: None,
                split: None,
                // Envoy's report of a bucket it just created holds that bucket alone, 1/0 or
                // 0/1, with time_elapsed 0; anything else is a bucket it held before.
                quiet: (report.bucket_quota_usages.len() > 1
                    || count != 1
                    || usage
                        .time_elapsed
                        .is_some_and(|elapsed| elapsed.seconds > 0 || elapsed.nanos > 0))
                .then_some(Quiet {
                    since: now,
                    peers: 0,
                    peers_changed: now,
                }),
            });
            held.observe(now, count);
            if count == 0 {
                let since = *held.idle_since.get_or_insert(now);
                if now.duration_since(since) >= settings.idle_after {
                    actions.push(BucketAction {
                        bucket_id: Some(held.id.clone()),
                        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                    });
                    shared.metrics.abandoned.inc();
                    gone.push(key);
                    continue;
                }
            } else {
                held.idle_since = None;
            }
            let quota = rules
                .and_then(|rules| rules.find(&sorted))
                .map(|rule| &rule.quota);
            // Series only for buckets with a rule, held by a stream: a reload that removes the
            // rule takes them away as an abandon or the stream's end does.
            if quota.is_some() {
                if !held.metered {
                    held.metered = true;
                    shared.metrics.hold(domain, &held.label);
                }
                let requests = &shared.metrics.requests;
                requests
                    .with_label_values(&[domain, &held.label, "allowed"])
                    .inc_by(usage.num_requests_allowed);
                requests
                    .with_label_values(&[domain, &held.label, "denied"])
                    .inc_by(usage.num_requests_denied);
            } else if held.metered {
                held.metered = false;
                shared.metrics.release(domain, &held.label);
            }
            match quota {
                None => {
                    // No rule: Envoy's no-assignment behaviour decides.
                    shared.metrics.skipped.with_label_values(&["no_rule"]).inc();
                }
                Some(Quota::Unlimited) => {
                    held.sent = Some(Sent::AllowAll);
                    actions.push(held.action(Sent::AllowAll, TTL_INTERVALS, MIN_TTL_SECONDS));
                }
                Some(Quota::Zero) => {
                    held.sent = Some(Sent::DenyAll);
                    actions.push(held.action(Sent::DenyAll, TTL_INTERVALS, MIN_TTL_SECONDS));
                }
                Some(Quota::PerSecond(limit)) => splits.push(Split {
                    key,
                    limit: *limit,
                    fill: alloc::fill_seconds_for(*limit),
                    failed: None,
                }),
                Some(Quota::Descriptor(descriptor)) => match descriptor.entries_for(&sorted) {
                    Some(entries) => charges.push(Charge {
                        key,
                        entries,
                        allowed: usage.num_requests_allowed,
                    }),
                    None => shared.metrics.skipped.with_label_values(&["no_rule"]).inc(),
                },
            }
        }
        self.charge(shared, domain, charges, &mut splits, &mut actions)
            .await;
        for key in gone {
            let Some(held) = self.buckets.remove(&key) else {
                continue;
            };
            if held.metered {
                shared.metrics.release(domain, &held.label);
            }
            if held.on_board {
                self.leave(shared, &board_key(domain, &key)).await;
            }
        }
        // Buckets whose rule changed away from a split leave the board.
        let split_keys: std::collections::HashSet<&str> =
            splits.iter().map(|split| split.key.as_str()).collect();
        let mut left = Vec::new();
        for (key, held) in &mut self.buckets {
            if held.on_board && !split_keys.contains(key.as_str()) && held.last_seen == now {
                held.on_board = false;
                left.push(key.clone());
            }
        }
        for key in left {
            self.leave(shared, &board_key(domain, &key)).await;
        }
        let exchanges = splits.iter().map(|split| {
            let held = &self.buckets[&split.key];
            let ttl = Duration::from_secs_f64((DEPARTED_INTERVALS * held.interval).max(1.0));
            let board_key = board_key(domain, &split.key);
            let board = &shared.board;
            let (member, demand) = (self.id.as_str(), held.demand);
            async move {
                match &split.failed {
                    Some(error) => Err(error.clone()),
                    None => board.exchange(&board_key, member, demand, ttl).await,
                }
            }
        });
        let answers = join_all(exchanges).await;
        for (split, answer) in splits.iter().zip(answers) {
            let Some(held) = self.buckets.get_mut(&split.key) else {
                continue;
            };
            if let Some(quiet) = &mut held.quiet {
                let interval = settings.report_interval;
                if let Ok(live) = &answer
                    && live.len() > quiet.peers
                {
                    quiet.peers = live.len();
                    quiet.peers_changed = now;
                }
                let waited = now.duration_since(quiet.since);
                let settled = waited >= QUIET_INTERVALS * interval
                    && now.duration_since(quiet.peers_changed) >= interval;
                if !settled && waited < MAX_QUIET_INTERVALS * interval {
                    held.on_board = answer.is_ok();
                    continue;
                }
            }
            held.quiet = None;
            match answer {
                Ok(live) => {
                    held.on_board = true;
                    shared.board.signals().hold(
                        &board_key(domain, &split.key),
                        &self.id,
                        &self.wake,
                    );
                    let sent = held.share(shared, domain, &self.id, split.limit, split.fill, &live);
                    actions.push(held.action(sent, TTL_INTERVALS, MIN_TTL_SECONDS));
                }
                Err(error) => {
                    let mode = settings.failure_mode;
                    shared
                        .metrics
                        .failure_mode_answers
                        .with_label_values(&[mode.name()])
                        .inc();
                    tracing::warn!(%error, mode = mode.name(), "rlqs: store failing; answering by failure mode");
                    match mode {
                        // No answer: the held assignment runs out at its TTL, then Envoy's
                        // expired-assignment behaviour decides.
                        FailureMode::Error => {}
                        FailureMode::Allow => {
                            held.sent = Some(Sent::AllowAll);
                            actions.push(held.action(Sent::AllowAll, FAILURE_TTL_INTERVALS, 0.0));
                        }
                        FailureMode::Deny => {
                            held.sent = Some(Sent::DenyAll);
                            actions.push(held.action(Sent::DenyAll, FAILURE_TTL_INTERVALS, 0.0));
                        }
                    }
                }
            }
        }
        shared.view.update(&self.id, domain, &self.buckets);
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        }))
    }

    /// Charges each shared-budget bucket's allowed requests to its RLS descriptor's counter
    /// (a charge: recorded whatever the answer; 0 only reads it), all at once, and turns what
    /// each counter has left into the fleet's rate to split, or a blanket rule.
    async fn charge(
        &mut self,
        shared: &Shared,
        domain: &str,
        charges: Vec<Charge>,
        splits: &mut Vec<Split>,
        actions: &mut Vec<BucketAction>,
    ) {
        let budget = &shared.budget;
        let answers = join_all(charges.iter().map(|charge| {
            budget.charge_descriptor(domain, charge.entries.clone(), charge.allowed)
        }))
        .await;
        for (charge, answer) in charges.into_iter().zip(answers) {
            let Some(held) = self.buckets.get_mut(&charge.key) else {
                continue;
            };
            let (limit, fill, failed) = match answer {
                Ok(Charged::NoLimit) => {
                    // The descriptor has no limit for these values: as a bucket without a rule.
                    shared.metrics.skipped.with_label_values(&["no_rule"]).inc();
                    continue;
                }
                Ok(Charged::Unlimited) => {
                    held.sent = Some(Sent::AllowAll);
                    actions.push(held.action(Sent::AllowAll, TTL_INTERVALS, MIN_TTL_SECONDS));
                    continue;
                }
                Ok(Charged::Limits(limits)) => {
                    let (rate, fill) = alloc::budget_rate(&limits, held.interval);
                    (rate, fill, None)
                }
                Err(error) => (0.0, 1, Some(error)),
            };
            splits.push(Split {
                key: charge.key,
                limit,
                fill,
                failed,
            });
        }
    }

    /// Takes this stream's demand for `board_key` off the board.
    async fn leave(&self, shared: &Shared, board_key: &str) {
        shared.board.signals().release(board_key, &self.id);
        shared.board.leave(board_key, &self.id).await;
    }

    /// After peers changed the demands of some of this stream's buckets: re-reads the board
    /// for those with a share and recomputes it, answering only where the share leaves the
    /// keep band (each change is a fresh full bucket in Envoy).
    async fn push(&mut self, shared: &Shared) -> Option<RateLimitQuotaResponse> {
        let changed = self.wake.take();
        let domain = self.domain.clone()?;
        let keys: Vec<(String, String)> = self
            .buckets
            .iter()
            .filter(|(_, held)| {
                held.on_board
                    && held.quiet.is_none()
                    && held.split.is_some()
                    && matches!(held.sent, Some(Sent::Bucket(_)))
            })
            .map(|(key, _)| (key.clone(), board_key(&domain, key)))
            .filter(|(_, board_key)| changed.contains(board_key))
            .collect();
        if keys.is_empty() {
            return None;
        }
        let board = &shared.board;
        let answers = join_all(keys.iter().map(|(_, board_key)| board.read(board_key))).await;
        let mut actions = Vec::new();
        for ((key, _), answer) in keys.iter().zip(answers) {
            // A failed read changes nothing: the next report recomputes.
            let (Ok(live), Some(held)) = (answer, self.buckets.get_mut(key)) else {
                continue;
            };
            let Some((limit, fill)) = held.split else {
                continue;
            };
            if !live.iter().any(|demand| demand.member == self.id) {
                continue;
            }
            let before = held.sent;
            let sent = held.share(shared, &domain, &self.id, limit, fill, &live);
            if Some(sent) != before {
                shared.metrics.pushes.inc();
                actions.push(held.action(sent, TTL_INTERVALS, MIN_TTL_SECONDS));
            }
        }
        shared.view.update(&self.id, &domain, &self.buckets);
        (!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        })
    }

    /// Takes every demand of this stream off the board: its share goes back at once.
    async fn leave_all(&mut self, shared: &Shared) {
        let Some(domain) = &self.domain else {
            return;
        };
        let leaving = self
            .buckets
            .iter()
            .filter(|(_, held)| held.on_board)
            .map(|(key, _)| {
                let board_key = board_key(domain, key);
                let (board, member) = (&shared.board, self.id.as_str());
                async move {
                    board.signals().release(&board_key, member);
                    board.leave(&board_key, member).await;
                }
            });
        join_all(leaving).await;
        for held in self.buckets.values().filter(|held| held.metered) {
            shared.metrics.release(domain, &held.label);
        }
        self.buckets.clear();
    }
}

impl Held {
    /// Splits `limit` (refilled every `fill` seconds) over the `live` demands and takes this
    /// stream's (`member`'s) max-min share, keeping the held bucket when close; records it as
    /// sent and sets the bucket's gauges.
    fn share(
        &mut self,
        shared: &Shared,
        domain: &str,
        member: &str,
        limit: f64,
        fill: u32,
        live: &[Demand],
    ) -> Sent {
        let demands: Vec<f64> = live.iter().map(|d| d.rate).collect();
        let wanted: Vec<f64> = demands.iter().map(|d| alloc::share_wanted(*d)).collect();
        let shares = alloc::max_min_shares(limit, &wanted);
        let own = live
            .iter()
            .position(|d| d.member == member)
            .map_or(limit / (live.len() + 1) as f64, |at| shares[at]);
        let mut bucket = alloc::bucket_for(own, fill, self.interval);
        if let Some(Sent::Bucket(old)) = self.sent
            && alloc::keep(old, bucket)
        {
            bucket = old;
        }
        // A shared budget with nothing left: exact, and no burst of a fresh bucket.
        let sent = if limit > 0.0 {
            Sent::Bucket(bucket)
        } else {
            Sent::DenyAll
        };
        self.sent = Some(sent);
        self.split = Some((limit, fill));
        let labels = [domain, self.label.as_str()];
        let metrics = &shared.metrics;
        metrics
            .envoys
            .with_label_values(&labels)
            .set(live.len() as i64);
        metrics
            .demand
            .with_label_values(&labels)
            .set(demands.iter().filter(|d| d.is_finite()).sum());
        metrics
            .assigned
            .with_label_values(&labels)
            .set(shares.iter().sum::<f64>() * (1.0 - alloc::BURST_SHARE));
        sent
    }

    /// Counts a report of `count` requests at `now`: the rate over rlsd's own clock since the
    /// last rate was taken (never Envoy's `time_elapsed`, 0 on a first report and whole seconds
    /// after), and the interval between reports.
    fn observe(&mut self, now: Instant, count: u64) {
        let gap = now.duration_since(self.last_seen);
        if gap >= MIN_RATE_WINDOW {
            self.interval = (self.interval + gap.as_secs_f64().min(60.0)) / 2.0;
        }
        self.last_seen = now;
        self.carried = self.carried.saturating_add(count);
        let window = now.duration_since(self.window_start);
        if window >= MIN_RATE_WINDOW {
            self.demand = self.carried as f64 / window.as_secs_f64();
            self.carried = 0;
            self.window_start = now;
        }
    }

    /// The action that tells Envoy `sent`, for `intervals` report intervals and at least
    /// `min_seconds`.
    fn action(&self, sent: Sent, intervals: f64, min_seconds: f64) -> BucketAction {
        let ttl = (intervals * self.interval).ceil().max(min_seconds).max(2.0) as i64;
        let strategy = match sent {
            Sent::AllowAll => rate_limit_strategy::Strategy::BlanketRule(
                rate_limit_strategy::BlanketRule::AllowAll as i32,
            ),
            Sent::DenyAll => rate_limit_strategy::Strategy::BlanketRule(
                rate_limit_strategy::BlanketRule::DenyAll as i32,
            ),
            Sent::Bucket(bucket) => rate_limit_strategy::Strategy::TokenBucket(TokenBucket {
                max_tokens: bucket.max_tokens,
                tokens_per_fill: Some(bucket.tokens_per_fill),
                fill_interval: Some(prost_types::Duration {
                    seconds: i64::from(bucket.fill_seconds),
                    nanos: 0,
                }),
            }),
        };
        BucketAction {
            bucket_id: Some(self.id.clone()),
            bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
                assignment_time_to_live: Some(prost_types::Duration {
                    seconds: ttl,
                    nanos: 0,
                }),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            })),
        }
    }
}

/// A bucket id as one string, entries in key order, unambiguous whatever they hold.
fn canonical(entries: &BTreeMap<String, String>) -> String {
    let mut key = String::new();
    for (k, v) in entries {
        key.push_str(&k.len().to_string());
        key.push(':');
        key.push_str(k);
        key.push_str(&v.len().to_string());
        key.push(':');
        key.push_str(v);
    }
    key
}

/// `k=v,k2=v2`: a bucket id for people.
fn label(entries: &BTreeMap<String, String>) -> String {
    let mut label = String::new();
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            label.push(',');
        }
        label.push_str(k);
        label.push('=');
        label.push_str(v);
    }
    label
}

/// The board key of a domain's bucket, shared by every replica.
fn board_key(domain: &str, key: &str) -> String {
    format!("rlqs:{}:{domain}:{key}", domain.len())
}

/// Every stream's current assignments, for the debug port's `/rlqs`.
#[derive(Default)]
pub struct View {
    streams: Mutex<BTreeMap<String, serde_json::Value>>,
}

impl View {
    fn update(&self, stream: &str, domain: &str, buckets: &HashMap<String, Held>) {
        let now = Instant::now();
        let mut list: Vec<serde_json::Value> = buckets
            .values()
            .map(|held| {
                let assignment = match held.sent {
                    None => serde_json::Value::Null,
                    Some(Sent::AllowAll) => "ALLOW_ALL".into(),
                    Some(Sent::DenyAll) => "DENY_ALL".into(),
                    Some(Sent::Bucket(bucket)) => serde_json::json!({
                        "tokens_per_fill": bucket.tokens_per_fill,
                        "fill_interval_s": bucket.fill_seconds,
                        "max_tokens": bucket.max_tokens,
                    }),
                };
                serde_json::json!({
                    "bucket": held.label,
                    "demand_rps": held.demand.is_finite().then_some(held.demand),
                    "interval_s": held.interval,
                    "idle_s": held.idle_since.map(|since| now.duration_since(since).as_secs_f64()),
                    "assignment": assignment,
                })
            })
            .collect();
        list.sort_by(|a, b| a["bucket"].as_str().cmp(&b["bucket"].as_str()));
        let entry = serde_json::json!({ "domain": domain, "buckets": list });
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(stream.to_owned(), entry);
    }

    fn remove(&self, stream: &str) {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(stream);
    }

    /// Every stream, as JSON: `{"streams": {"<id>": {"domain": .., "buckets": [..]}}}`.
    pub fn render(&self) -> String {
        let streams = self
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        serde_json::json!({ "streams": streams }).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_keys_do_not_collide_on_separators() {
        let one: BTreeMap<String, String> = [("a".into(), "b1:c".into())].into_iter().collect();
        let two: BTreeMap<String, String> = [("a".into(), "b".into()), ("c".into(), "".into())]
            .into_iter()
            .collect();
        assert_ne!(canonical(&one), canonical(&two));
        assert_eq!(label(&two), "a=b,c=");
    }
}
