//! The alternative to rlsd's Redis store that the design once named: a deadpool-redis pool,
//! sized as its docs advise (its default, twice the CPUs), with the store's own script, call
//! and reply parser. `pool` sends one EVALSHA per request on a connection checked out for it;
//! `pool-batch` coalesces as the store does (a queue, at most `max_batch` requests and
//! `MAX_BATCH_CHECKS` checks per call), each batch on a pooled connection, as many calls in
//! flight as the pool has connections. Bench-only: it exists to be measured against the store.

use std::time::{Duration, Instant};

use deadpool_redis::{Config, Pool, Runtime};
use rlsd::store::redis::{MAX_BATCH_CHECKS, SCRIPT, script_command, script_outcomes};
use rlsd::store::{Check, Outcome, Store, StoreError};
use tokio::sync::{mpsc, oneshot};

/// One request waiting for a batch, and where its answer goes.
struct Job {
    checks: Vec<Check>,
    reply: oneshot::Sender<Result<Vec<Outcome>, StoreError>>,
}

/// A deadpool-redis pool running the store's script.
pub(crate) struct PooledStore {
    pool: Pool,
    timeout: Duration,
    /// Where requests queue for a batch; `None`: one call per request.
    queue: Option<mpsc::UnboundedSender<Job>>,
}

impl PooledStore {
    /// A pool on `url` with deadpool's default size; `max_batch` above 1 coalesces. Call it on
    /// the runtime the batcher is to run on.
    pub(crate) fn new(url: &str, timeout: Duration, max_batch: usize) -> PooledStore {
        let pool = Config::from_url(url)
            .create_pool(Some(Runtime::Tokio1))
            .expect("deadpool-redis pool");
        let queue = (max_batch > 1).then(|| {
            let (sender, receiver) = mpsc::unbounded_channel();
            tokio::spawn(batches(pool.clone(), receiver, max_batch));
            sender
        });
        PooledStore {
            pool,
            timeout,
            queue,
        }
    }

    /// The pool's size, for the header.
    pub(crate) fn max_size(&self) -> usize {
        self.pool.status().max_size
    }
}

fn unavailable(error: &dyn std::fmt::Display) -> StoreError {
    StoreError::Unavailable(error.to_string())
}

/// Runs `requests` in one EVALSHA on `connection` (checked out of the pool, which recycles it
/// with a PING on each check-out, as deadpool-redis does): each request's outcomes.
async fn call(
    mut connection: deadpool_redis::Connection,
    requests: &[&[Check]],
) -> Result<Vec<Option<Vec<Outcome>>>, StoreError> {
    let command = script_command(requests, None);
    let reply: Vec<u8> = match command.query_async(&mut *connection).await {
        Err(error)
            if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
        {
            redis::Script::new(SCRIPT)
                .prepare_invoke()
                .load_async(&mut *connection)
                .await
                .map_err(|e| unavailable(&e))?;
            command
                .query_async(&mut *connection)
                .await
                .map_err(|e| unavailable(&e))?
        }
        reply => reply.map_err(|e| unavailable(&e))?,
    };
    let sizes: Vec<usize> = requests.iter().map(|checks| checks.len()).collect();
    script_outcomes(&reply, &sizes)
}

/// Takes a request, waits for a pooled connection, then takes whatever else queued meanwhile
/// (as the store's batchers wait for a call slot), and runs them as one call in a task of its
/// own; the pool bounds the calls in flight.
async fn batches(pool: Pool, mut queue: mpsc::UnboundedReceiver<Job>, max_batch: usize) {
    while let Some(first) = queue.recv().await {
        let connection = pool.get().await;
        let mut checks = first.checks.len();
        let mut jobs = vec![first];
        while jobs.len() < max_batch && checks < MAX_BATCH_CHECKS {
            match queue.try_recv() {
                Ok(job) => {
                    checks += job.checks.len();
                    jobs.push(job);
                }
                Err(_) => break,
            }
        }
        tokio::spawn(async move {
            let requests: Vec<&[Check]> = jobs.iter().map(|job| job.checks.as_slice()).collect();
            let answers = match connection {
                Ok(connection) => call(connection, &requests).await,
                Err(error) => Err(unavailable(&error)),
            };
            match answers {
                Ok(answers) => {
                    for (job, answer) in jobs.into_iter().zip(answers) {
                        let answer = answer.ok_or_else(|| {
                            StoreError::Protocol("a request answered late".to_owned())
                        });
                        let _ = job.reply.send(answer);
                    }
                }
                Err(error) => {
                    for job in jobs {
                        let _ = job.reply.send(Err(error.clone()));
                    }
                }
            }
        });
    }
}

impl Store for PooledStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn healthy(&self) -> bool {
        self.pool.get().await.is_ok()
    }

    async fn decide_by(
        &self,
        checks: &[Check],
        deadline: Option<Instant>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let deadline = deadline.unwrap_or_else(|| Instant::now() + self.timeout);
        let decided = async {
            match &self.queue {
                None => {
                    let connection = self.pool.get().await.map_err(|e| unavailable(&e))?;
                    let answer = call(connection, &[checks]).await?.into_iter().next();
                    answer
                        .flatten()
                        .ok_or_else(|| StoreError::Protocol("the request answered late".to_owned()))
                }
                Some(queue) => {
                    let (reply, answer) = oneshot::channel();
                    let job = Job {
                        checks: checks.to_vec(),
                        reply,
                    };
                    queue
                        .send(job)
                        .map_err(|_| StoreError::Unavailable("batcher stopped".to_owned()))?;
                    answer
                        .await
                        .map_err(|_| StoreError::Unavailable("batcher dropped it".to_owned()))?
                }
            }
        };
        tokio::time::timeout_at(deadline.into(), decided)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
}
