//! Resumable work: [`RecoveryPoint`]s, and the [`RecoveryWorker`] that finishes keys whose
//! holder died after saving one. The [guide](crate::resumable) shows the pattern.

mod body;

use std::collections::HashSet;
use std::future::Future;
use std::num::NonZeroU64;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use http::Response;
use tokio::time::Instant;

pub use body::RecoveredBody;

use crate::config::Config;
use crate::policy::{decide, RecordDecision, ResponseInfo};
use crate::store::record::{Completion, Record, RecordId, RecordState, Token};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError, StoreErrorKind};
use crate::{IdempotencyContext, IdempotencyLayer};

/// The most records left for an operator a worker remembers (to log each once, and to list
/// past them).
const MAX_LEFT: usize = 1000;

/// What a recover function may fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Finishes the work of keys whose holder died: it finds records in progress whose lease
/// lapsed and that hold a [`RecoveryPoint`](crate::RecoveryPoint), takes each over exactly as a retry would
/// (fenced, generation + 1, the abandoned-key hook fires), runs your recover function from
/// the point, and records the answer it returns, so the client's next retry replays it.
///
/// Spawn one per process (or a few per fleet: two workers never recover one record twice,
/// because the takeover is the store's atomic claim). The handle it gives back does not
/// stop it when dropped, as with tokio's `JoinHandle`: stop it with
/// [`RecoveryHandle::stop`] or [`RecoveryHandle::abort`]. A worker recovers every record its
/// store lists: services that share a database give each its own Redis key prefix or
/// Postgres table. Only records that saved a point are
/// looked at, so requests that never save one cost the worker nothing.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, RecoveryWorker};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
/// let worker = RecoveryWorker::new(&layer, |ctx| async move {
///     let point = ctx.recovery_point().expect("the worker runs only records with a point");
///     // Resume from `point.step()` with `point.data()`, as the handler would.
///     let body = format!("{{\"resumed_from\":\"{}\"}}", point.step());
///     Ok(http::Response::builder().status(201).body(Bytes::from(body))?)
/// })
/// .with_interval(Duration::from_secs(1));
/// let handle = worker.spawn();
/// # handle.stop().await;
/// # }
/// ```
///
/// **It acts only on what its own claim returned.** A sweep's listing can be a whole sweep
/// old by the time the worker reaches a record: a retry may have taken it over since, and
/// released it (which drops its point), or died; an operator may have released it; it may
/// have expired. So the listing only picks what to try. The worker runs the recover function
/// only when its claim is a takeover, with the point *that claim* handed over, and only while
/// the *claimed* generation is within the cap. A first claim (the record was gone: the
/// worker never recreates a key), a takeover without a point, or one past the cap is given
/// back at once without running: a first claim is released (the key is absent again), a
/// takeover's lease is ended (the record, its point and its history stay as they were,
/// one generation on). Each is counted as `given_back` (past the cap: `left`).
///
/// **Bounded.** A record gets at most [`with_max_attempts`](Self::with_max_attempts) attempts
/// in all (default 5), its first one included: each takeover, by a client's retry or by a
/// worker, is one. The worker runs a recovery only under a claim whose generation is at most
/// that; past it the record is left for an operator
/// ([`IdempotencyAdmin`](crate::store::IdempotencyAdmin)), logged at `ERROR` once per worker
/// and counted as `left`, so a record whose recovery always fails never loops. Left records
/// do not use up a sweep's batch: the worker lists past them.
///
/// **A failed attempt** (the function returns `Err`, panics, or answers what the layer's
/// record policy would release, such as a 5xx) is logged and counted as `failed`; the claim
/// is left to lapse with its point kept, so the next sweep, or the client's retry, resumes
/// again. A release would drop the point and start the work over.
///
/// **What is recorded** is built as the layer builds it: the same kept headers, caps and
/// tombstones. The worker has no request, so an answer whose `Vary` names request headers
/// cannot carry the layer's Vary guard: with Vary matching on, such an answer is refused
/// (a failed attempt, never stored unguarded) and the client's retry, which has the
/// headers, resumes. A function that records the answer itself (`PostgresStore::record_in`)
/// marks its response with [`RecordDecision::AlreadyRecorded`], as a handler does; there
/// too, [`IdempotencyContext::completion`] and `record_in` refuse such an answer with
/// [`StoreErrorKind::Unguarded`].
///
/// **What the recover function knows**: the record id, [`derive`](IdempotencyContext::derive),
/// the generation and the point (its step and data). Not the client's key nor the scope:
/// stores keep neither in the clear, points included. A handler that needs the tenant in a
/// recovery saves its own id for it in the point's data, knowingly.
pub struct RecoveryWorker<F> {
    config: Arc<Config>,
    recover: F,
    interval: Duration,
    max_attempts: u64,
    batch: usize,
    /// Records already reported as left, so each is logged once.
    reported: Mutex<HashSet<RecordId>>,
}

impl<F> std::fmt::Debug for RecoveryWorker<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryWorker")
            .field("store", &self.config.store.name())
            .field("interval", &self.interval)
            .field("max_attempts", &self.max_attempts)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl<F, Fut, B> RecoveryWorker<F>
where
    F: Fn(IdempotencyContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<B>, BoxError>> + Send + 'static,
    B: RecoveredBody,
{
    /// A worker over `layer`'s store, with its lease, retention and recording rules. `recover`
    /// gets the context of its takeover: [`record_id`](IdempotencyContext::record_id),
    /// [`recovery_point`](IdempotencyContext::recovery_point) (always `Some`: the point its
    /// own claim handed over), [`generation`](IdempotencyContext::generation) and
    /// [`derive`](IdempotencyContext::derive) are those a retry's handler would see; its
    /// [`key`](IdempotencyContext::key) and [`scope`](IdempotencyContext::scope) are `None`,
    /// since stores keep only their hashes. It answers with any [`RecoveredBody`], axum's
    /// `Body` included (feature `axum`).
    pub fn new(layer: &IdempotencyLayer, recover: F) -> Self {
        Self {
            config: layer.config.clone(),
            recover,
            interval: Duration::from_secs(1),
            max_attempts: 5,
            batch: 100,
            reported: Mutex::new(HashSet::new()),
        }
    }

    /// How often [`spawn`](Self::spawn)'s task sweeps (default 1 s). A record is recovered
    /// within its lease plus one interval of its holder's death.
    #[must_use]
    pub fn with_interval(mut self, every: Duration) -> Self {
        self.interval = every.max(Duration::from_millis(10));
        self
    }

    /// The most attempts a record gets, its first included (default 5): the worker runs a
    /// recovery only under a claim of at most this generation; past it the record is left
    /// for an operator.
    #[must_use]
    pub fn with_max_attempts(mut self, n: NonZeroU64) -> Self {
        self.max_attempts = n.get();
        self
    }

    /// How many records one sweep looks at, at most (default 100).
    #[must_use]
    pub fn with_batch(mut self, n: std::num::NonZeroUsize) -> Self {
        self.batch = n.get();
        self
    }

    /// One sweep: every recoverable record found is tried once, one after another.
    pub async fn run_once(&self) -> Result<RecoveryReport, StoreError> {
        let store = &self.config.store;
        let timeout = self.config.timing.store_timeout();
        // Records left for an operator stay listed until they expire: ask for as many more as
        // this worker has left, so they never crowd out the records still worth trying.
        let left = self
            .reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len();
        let limit = self.batch.saturating_add(left);
        let found = match tokio::time::timeout(timeout, store.recoverable(limit)).await {
            Ok(found) => found?,
            Err(e) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
        };
        let mut report = RecoveryReport::default();
        let mut tried = 0;
        for (id, record) in found {
            if tried == self.batch {
                break;
            }
            let outcome = self.recover_one(id, record).await;
            if !matches!(outcome, Outcome::Left) {
                tried += 1;
            }
            crate::metrics::recovery(store.name(), outcome.as_str());
            match outcome {
                Outcome::Recovered => report.recovered += 1,
                Outcome::Failed => report.failed += 1,
                Outcome::Left => report.left += 1,
                Outcome::Taken => report.taken += 1,
                Outcome::GivenBack => report.given_back += 1,
            }
        }
        Ok(report)
    }

    /// Sweeps every [`with_interval`](Self::with_interval) on a task of its own, until the
    /// handle stops it ([`RecoveryHandle::stop`] or [`abort`](RecoveryHandle::abort)).
    /// Dropping the handle does not stop it: the worker then runs as long as the runtime.
    /// Quiet when it finds nothing; each record it recovers is logged.
    pub fn spawn(self) -> RecoveryHandle {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Only an explicit stop ends the loop: a dropped handle closes the channel, and
            // the worker goes on without listening to it.
            let mut listening = true;
            loop {
                tokio::select! {
                    stop = &mut stopped, if listening => match stop {
                        Ok(()) => return,
                        Err(_) => {
                            listening = false;
                            continue;
                        }
                    },
                    _ = tick.tick() => {}
                }
                match self.run_once().await {
                    Ok(_) => {}
                    Err(e) if e.kind() == StoreErrorKind::Unsupported => {
                        tracing::error!("the recovery worker's store cannot list recoverable records; the worker stops");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(error = %crate::service::Chain(&e), "the recovery worker could not list recoverable records; it tries again at the next sweep");
                    }
                }
            }
        });
        RecoveryHandle {
            stop: Some(stop),
            task,
        }
    }

    async fn recover_one(&self, id: RecordId, listed: Record) -> Outcome {
        let cfg = &*self.config;
        let store = &*cfg.store;
        // The listing only picks what to try: it may be a whole sweep old.
        let Some(listed_point) = listed.recovery_point.as_ref() else {
            return Outcome::Taken;
        };
        if !matches!(listed.state, RecordState::InProgress { .. }) {
            return Outcome::Taken;
        }
        // Generations only grow: a record listed at the cap is past it under any claim now.
        if listed.generation >= self.max_attempts {
            self.leave(id, listed.generation + 1, listed_point.step());
            return Outcome::Left;
        }
        let scope_id = listed_point.scope_id();
        let timing = &cfg.timing;
        let request = ClaimRequest::new(&id, &listed.fingerprint, timing.lease(), timing.ttl())
            .in_scope(&scope_id);
        let sent = Instant::now();
        let claim = match tokio::time::timeout(timing.store_timeout(), store.claim(&request)).await
        {
            Ok(Ok(ClaimOutcome::Claimed(claim))) => claim,
            // A retry, another worker, or a completion got there first.
            Ok(Ok(_)) => return Outcome::Taken,
            Ok(Err(e)) => {
                tracing::warn!(record = %short(&id), error = %crate::service::Chain(&e), "the recovery worker could not take over a record; it tries again at the next sweep");
                return Outcome::Failed;
            }
            Err(_) => {
                // The claim may have taken effect: its lease lapses, and the next sweep
                // takes over again.
                tracing::warn!(record = %short(&id), "the recovery worker's takeover timed out; it tries again at the next sweep");
                return Outcome::Failed;
            }
        };
        // From here on, only what this claim returned decides.
        let token = claim.token;
        if !claim.takeover {
            // The record was gone (released by an operator, or expired) since the listing:
            // the worker never recreates a key. The client's next request runs afresh.
            tracing::info!(record = %short(&id), "the record the recovery worker listed is gone; its claim is given back");
            self.give_back(&id, &token, false).await;
            return Outcome::GivenBack;
        }
        if token.generation() > self.max_attempts {
            // An attempt since the listing (a retry that died) used up the cap.
            self.give_back(&id, &token, true).await;
            self.leave(id, token.generation(), listed_point.step());
            return Outcome::Left;
        }
        let Some(point) = claim.recovery_point else {
            // Released since the listing, which dropped its point (a handler that undid its
            // work and answered 5xx, say): nothing to resume from, and the client's retry
            // starts over.
            tracing::info!(record = %short(&id), generation = token.generation(), "the record the recovery worker listed holds no recovery point now; its claim is given back");
            self.give_back(&id, &token, true).await;
            return Outcome::GivenBack;
        };
        if let Some(hook) = &cfg.on_abandoned {
            let abandoned = crate::Abandoned {
                scope: None,
                record: id,
                old_generation: token.generation().saturating_sub(1),
                new_generation: token.generation(),
                abandoned_for: claim.lapsed_for,
            };
            if std::panic::catch_unwind(AssertUnwindSafe(|| hook(&abandoned))).is_err() {
                tracing::error!("the abandoned-key hook panicked; the recovery runs");
            }
        }
        let step = point.step().to_owned();
        let ctx = IdempotencyContext::new(
            None,
            None,
            point.scope_id(),
            id,
            listed.fingerprint,
            token,
            self.config.clone(),
            None,
            Some(point),
        );
        let limit = cfg.max_response_body;
        let work = AssertUnwindSafe(async move {
            let (parts, body) = (self.recover)(ctx).await?.into_parts();
            let read = body::sealed::Sealed::read(body, limit).await?;
            Ok::<_, BoxError>((parts, read))
        })
        .catch_unwind();
        let result = tokio::select! {
            biased;
            r = work => r,
            () = renew(cfg, &id, &token, sent) => {
                tracing::warn!(record = %short(&id), "the recovery worker lost its claim while recovering; the work stops, and the record's new holder goes on");
                return Outcome::Failed;
            }
        };
        let answer = match result {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                tracing::warn!(record = %short(&id), step, generation = token.generation(), error = %e, "a recovery failed; the claim lapses and the record is tried again");
                return Outcome::Failed;
            }
            Err(_) => {
                tracing::error!(record = %short(&id), step, generation = token.generation(), "the recover function panicked; the claim lapses and the record is tried again");
                return Outcome::Failed;
            }
        };
        self.settle(id, token, step, answer).await
    }

    /// Logs, once per worker, a record left for an operator.
    fn leave(&self, id: RecordId, generation: u64, step: &str) {
        let first_time = {
            let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
            // Bounded: past this many, start over (each is logged once more).
            if reported.len() >= MAX_LEFT && !reported.contains(&id) {
                reported.clear();
            }
            reported.insert(id)
        };
        if first_time {
            tracing::error!(record = %short(&id), generation, step, max_attempts = self.max_attempts, "a record with a recovery point reached the most attempts the recovery worker makes; it is left for an operator");
        }
    }

    /// Hands back a claim the worker will not run under, leaving the record as it found it:
    /// a first claim is released (the key is absent again); a takeover's lease is ended now,
    /// which keeps the record's point and history (a release would drop the point). If the
    /// call fails, the claim's lease lapses by itself.
    async fn give_back(&self, id: &RecordId, token: &Token, takeover: bool) {
        let cfg = &*self.config;
        let call = async {
            if takeover {
                cfg.store.extend(id, token, Duration::ZERO).await
            } else {
                cfg.store.release(id, token).await
            }
        };
        match tokio::time::timeout(cfg.timing.store_timeout(), call).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.is_fenced() => {}
            Ok(Err(e)) => {
                tracing::warn!(record = %short(id), error = %crate::service::Chain(&e), "the recovery worker could not give back a claim it does not run under; its lease lapses by itself");
            }
            Err(_) => {
                tracing::warn!(record = %short(id), "giving back a claim timed out; its lease lapses by itself");
            }
        }
    }

    async fn settle(
        &self,
        id: RecordId,
        token: Token,
        step: String,
        (parts, read): (
            http::response::Parts,
            Option<(bytes::Bytes, Option<http::HeaderMap>)>,
        ),
    ) -> Outcome {
        let cfg = &*self.config;
        let store = &*cfg.store;
        let trailers = read.as_ref().and_then(|(_, t)| t.as_ref());
        let info = ResponseInfo::new(parts.status, &parts.headers, trailers);
        let decision = decide(
            &*cfg.policy,
            parts.extensions.get::<RecordDecision>().copied(),
            &info,
        );
        if decision == RecordDecision::Release {
            tracing::warn!(record = %short(&id), status = parts.status.as_u16(), "the recover function answered what the record policy releases; the claim lapses and the record is tried again");
            return Outcome::Failed;
        }
        // One function builds every recorded answer, with its guards; it refuses an answer
        // that varies on request headers here, where no request exists. Checked for an answer
        // the function recorded itself too: it must not have stored one either.
        let completion = match read {
            Some((body, trailers)) => crate::recording::completion(
                cfg.recording(),
                None,
                parts.status,
                &parts.headers,
                body,
                trailers.as_ref(),
            ),
            None => Ok(Completion::Tombstone {
                status: parts.status,
            }),
        };
        let completion = match completion {
            Ok(completion) => completion,
            Err(e) => {
                let recorded = decision == RecordDecision::AlreadyRecorded;
                // A function that stored a completion it built by hand bypassed the refusal:
                // the worker cannot undo it, so it says so.
                let stored = recorded
                    && matches!(
                        tokio::time::timeout(cfg.timing.store_timeout(), store.get(&id)).await,
                        Ok(Ok(Some(r))) if matches!(r.state, RecordState::Completed(_)) && r.holder == Some(token)
                    );
                if stored {
                    tracing::error!(record = %short(&id), recorded_by_the_function = true, error = %crate::service::Chain(&e), "the recover function stored an answer that varies on request headers without its Vary guard (a completion built by hand); retries replay it to any caller until an operator deletes it");
                } else {
                    tracing::error!(record = %short(&id), recorded_by_the_function = recorded, error = %crate::service::Chain(&e), "the recover function's answer varies on request headers, which the worker does not have; it is not recorded, and the client's retry resumes");
                }
                return Outcome::Failed;
            }
        };
        if decision == RecordDecision::AlreadyRecorded {
            let done = matches!(
                tokio::time::timeout(cfg.timing.store_timeout(), store.get(&id)).await,
                Ok(Ok(Some(r))) if matches!(r.state, RecordState::Completed(_)) && r.holder == Some(token)
            );
            if done {
                tracing::info!(record = %short(&id), step, generation = token.generation(), "recovered a record from its recovery point (recorded by the recover function)");
                return Outcome::Recovered;
            }
            tracing::error!(record = %short(&id), "the recover function marked its answer AlreadyRecorded, but the record was not completed by its claim");
            return Outcome::Failed;
        }
        let ttl = cfg.timing.ttl();
        // Resent once: `complete` is idempotent per token (guarantee 9).
        for _ in 0..2 {
            match tokio::time::timeout(
                cfg.timing.store_timeout(),
                store.complete(&id, &token, &completion, ttl),
            )
            .await
            {
                Ok(Ok(())) => {
                    tracing::info!(record = %short(&id), step, generation = token.generation(), status = parts.status.as_u16(), "recovered a record from its recovery point");
                    return Outcome::Recovered;
                }
                Ok(Err(e)) if e.is_fenced() => {
                    tracing::warn!(record = %short(&id), "the recovery's answer was fenced: another attempt holds the record");
                    return Outcome::Failed;
                }
                Ok(Err(_)) | Err(_) => {}
            }
        }
        tracing::warn!(record = %short(&id), "the recovery's answer could not be recorded; the claim lapses and the record is tried again");
        Outcome::Failed
    }
}

/// The first 16 hex digits of a record id, as every log line of the crate prints it.
fn short(id: &RecordId) -> String {
    id.to_hex()[..16].to_owned()
}

/// Renews the worker's claim every lease / 3 (the layer's schedule) and returns when the
/// claim is lost: fenced, or not renewed within a whole lease of the last success.
async fn renew(cfg: &Config, id: &RecordId, token: &Token, sent: Instant) {
    let lease = cfg.timing.lease();
    let mut renewed = sent;
    loop {
        tokio::time::sleep(lease / 3).await;
        let at = Instant::now();
        match tokio::time::timeout(
            cfg.timing.store_timeout(),
            cfg.store.extend(id, token, lease),
        )
        .await
        {
            Ok(Ok(())) => renewed = at,
            Ok(Err(e)) if e.is_fenced() => return,
            _ => {}
        }
        // The local estimate of the lease's end, counted from a send time: never later
        // than the store's.
        if Instant::now() >= renewed + lease {
            return;
        }
    }
}

#[derive(Clone, Copy)]
enum Outcome {
    Recovered,
    Failed,
    Left,
    Taken,
    GivenBack,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Recovered => "recovered",
            Self::Failed => "failed",
            Self::Left => "left",
            Self::Taken => "taken",
            Self::GivenBack => "given_back",
        }
    }
}

/// What one sweep did ([`RecoveryWorker::run_once`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryReport {
    /// Records recovered: their answer is recorded.
    pub recovered: usize,
    /// Attempts that failed; each record is tried again once its claim lapses.
    pub failed: usize,
    /// Records past the most attempts, left for an operator.
    pub left: usize,
    /// Records someone else took first (a retry, another worker) or that completed.
    pub taken: usize,
    /// Claims given back without running: the record had gone since the listing (the
    /// worker never recreates a key), or held no recovery point any more (a release
    /// dropped it).
    pub given_back: usize,
}

/// Stops the task [`RecoveryWorker::spawn`] started. Dropping it does not: the worker runs
/// on, as a task whose `JoinHandle` was dropped does.
#[derive(Debug)]
pub struct RecoveryHandle {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl RecoveryHandle {
    /// Stops after the sweep in progress, if any, and waits for it.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }

    /// Stops at once, dropping a recovery in progress (its claim lapses).
    pub fn abort(&self) {
        self.task.abort();
    }
}
