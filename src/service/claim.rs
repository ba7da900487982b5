//! Step 6: the claim, answered at once where the store can, read for the request (a replay,
//! a conflict, a mismatch, a claim to run under); a claim in flight, and the release of a
//! claim won too late to run.
//!
//! A claim past its deadline is "unknown", never read as claimed; a reply that comes late
//! and won is released before the 503 goes out, or on a task of its own when the request is
//! gone, so the key is not held for a lease by a request that will never run.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;

use std::time::Duration;

use http::{HeaderMap, Response};
use http_body::Body;

use super::deadline::{bounded, deadline, retry_until, within};
use super::{Chain, Keyed, Step, STORE_RETRY_AFTER};
use crate::body::ResponseBody;
use crate::config::Config;
use crate::error::{ErrorKind, IdempotencyError};
use crate::metrics::{timed, Labels, Outcome};
use crate::response;
use crate::store::record::{Completion, Fingerprint, RecordId, RecordState, ScopeId};
use crate::store::{Claim, ClaimOutcome, ClaimRequest, StoreError, StoreErrorKind};

/// Step 6's one store call, for the layer's flow and for operations: a claim of `id` under
/// the store deadline, and when it was sent (the lease counts from then). Past the deadline
/// the outcome is unknown, never read as claimed, and a late reply that won the claim is
/// released within one more store deadline, so a retry sent at once finds the key free.
pub(crate) async fn claim_within(
    cfg: &Arc<Config>,
    labels: &Labels,
    id: RecordId,
    fp: Fingerprint,
    scope: ScopeId,
) -> (Result<ClaimOutcome, StoreError>, Instant) {
    let (lease, ttl) = (cfg.timing.lease(), cfg.timing.ttl());
    let timeout = cfg.timing.store_timeout();
    // The lease clock starts here: the store cannot have started it earlier.
    let sent = Instant::now();
    let mut pending = PendingClaim {
        future: Some({
            let store = cfg.store.clone();
            let timer = labels.store_call("claim");
            Box::pin(async move {
                let request = ClaimRequest::new(&id, &fp, lease, ttl).in_scope(&scope);
                timed(timer, store.claim(&request)).await
            })
        }),
        cfg: cfg.clone(),
        labels: labels.clone(),
        id,
        sent,
    };
    let outcome = match within(deadline(sent, timeout), &mut pending).await {
        Ok(outcome) => outcome,
        Err(elapsed) => {
            pending
                .release_if_won(deadline(Instant::now(), timeout))
                .await;
            Err(StoreError::with_source(StoreErrorKind::Unknown, elapsed))
        }
    };
    (outcome, sent)
}

pub(super) type ClaimFuture =
    Pin<Box<dyn Future<Output = Result<ClaimOutcome, StoreError>> + Send>>;

/// A claim in flight. Dropped before it resolves (its deadline passed, or its response
/// future was dropped), it finishes on its own task and releases the claim if it won it, so
/// the key is not held for a whole lease by a request that will never run.
pub(super) struct PendingClaim {
    pub(super) future: Option<ClaimFuture>,
    pub(super) cfg: Arc<Config>,
    pub(super) labels: Labels,
    pub(super) id: RecordId,
    pub(super) sent: Instant,
}

impl Future for PendingClaim {
    type Output = Result<ClaimOutcome, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self
            .future
            .as_mut()
            .expect("PendingClaim polled after completion");
        let out = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(out)
    }
}

impl PendingClaim {
    /// Past the claim's deadline: waits until `until` for a late reply and, if the claim was
    /// won, releases it within the same window, so the 503 that follows leaves the key free
    /// for a retry sent at once. A release that fails goes on in the background; a reply
    /// later than `until` is left to the task `drop` starts.
    pub(super) async fn release_if_won(&mut self, until: Instant) {
        let Ok(Ok(ClaimOutcome::Claimed(claim))) = within(until, &mut *self).await else {
            return;
        };
        let store = &*self.cfg.store;
        let call = timed(
            self.labels.store_call("release"),
            store.release(&self.id, &claim.token),
        );
        if bounded(until, call).await.is_err() {
            let lease_end = deadline(self.sent, self.cfg.timing.lease());
            let (cfg, labels, id) = (self.cfg.clone(), self.labels.clone(), self.id);
            spawn_release(cfg, labels, id, async move { Some(claim) }, lease_end);
        }
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        // A claim that took effect holds the key for one lease from when it was sent at the
        // earliest; past that it lapses on its own, so nothing waits longer.
        let lease_end = deadline(self.sent, self.cfg.timing.lease());
        let won = async move {
            match tokio::time::timeout_at(lease_end, future).await {
                Ok(Ok(ClaimOutcome::Claimed(claim))) => Some(claim),
                _ => None,
            }
        };
        spawn_release(
            self.cfg.clone(),
            self.labels.clone(),
            self.id,
            won,
            lease_end,
        );
    }
}

/// Releases the claim `won` resolves to, if any, on a task of its own, retrying until
/// `lease_end`: the claim's request went away, or was answered without it.
pub(super) fn spawn_release(
    cfg: Arc<Config>,
    labels: Labels,
    id: RecordId,
    won: impl Future<Output = Option<Claim>> + Send + 'static,
    lease_end: Instant,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let Some(claim) = won.await else { return };
        let store = &*cfg.store;
        let timeout = cfg.timing.store_timeout();
        let released = retry_until(lease_end, timeout, || {
            timed(labels.store_call("release"), store.release(&id, &claim.token))
        })
        .await;
        if let Err(e) = released {
            tracing::warn!(error = %Chain(&e), "could not release a claim whose request went away; it lapses with its lease");
        }
    });
}

/// A claim's outcome, read for the request.
#[allow(clippy::large_enum_variant)] // lives on the stack, returned at once
enum Found<B: Body> {
    Step(Step<B>),
    /// The record is in progress; its lease has this long left.
    InProgress(Duration),
}

impl Keyed {
    /// Step 6 at once, where the store answers without I/O (the memory store, a record a
    /// `LocalTier` holds): no boxed future, no deadline, no wait. `None`: ask with `claim`.
    pub(super) fn claim_now<B: Body>(&self, request: &HeaderMap) -> Option<Step<B>> {
        let cfg = &*self.flow.cfg;
        let (lease, ttl) = (cfg.timing.lease(), cfg.timing.ttl());
        let claim = ClaimRequest::new(&self.id, &self.fp, lease, ttl).in_scope(&self.scope_id);
        let timer = self.flow.labels.store_call("claim");
        let sent = Instant::now();
        let Some(outcome) = cfg.store.claim_now(&claim) else {
            timer.cancel();
            return None;
        };
        drop(timer);
        match self.found(outcome, sent, request) {
            Found::Step(step) => Some(step),
            // Waiting for the record to change is `claim`'s loop, which claims again.
            Found::InProgress(_) if cfg.in_progress.wait.is_some() => None,
            Found::InProgress(left) => Some(Step::Answer(self.conflict(left))),
        }
    }

    pub(super) async fn claim<B: Body>(&self, request: &HeaderMap) -> Step<B> {
        let cfg = &*self.flow.cfg;
        let wait_until = cfg.in_progress.wait.map(|w| deadline(Instant::now(), w));
        loop {
            let (outcome, sent) = claim_within(
                &self.flow.cfg,
                &self.flow.labels,
                self.id,
                self.fp,
                self.scope_id,
            )
            .await;
            let lease_remaining = match self.found(outcome, sent, request) {
                Found::Step(step) => return step,
                Found::InProgress(left) => left,
            };
            if let Some(until) = wait_until {
                let waiters = &self.flow.waiters;
                if waiters
                    .wait_for_change(&self.flow.cfg, &self.flow.labels, self.id, until)
                    .await
                {
                    continue;
                }
            }
            return Step::Answer(self.conflict(lease_remaining));
        }
    }

    /// A 409 (or the configured status) for a record still in progress.
    fn conflict<B: Body>(&self, lease_remaining: Duration) -> Response<ResponseBody<B>> {
        let cfg = &*self.flow.cfg;
        self.outcome(Outcome::Conflict);
        let err = IdempotencyError::new(
            ErrorKind::InProgress,
            "a request with this idempotency key is still being processed",
        )
        .retry_after(lease_remaining.min(cfg.in_progress.retry_after))
        .with_status(cfg.in_progress_status);
        self.flow.error(err)
    }

    /// What the claim's outcome means for the request: the checks of a stored record
    /// (fingerprint, Vary), a replay, an error, or a claim to run under.
    fn found<B: Body>(
        &self,
        outcome: Result<ClaimOutcome, StoreError>,
        sent: Instant,
        request: &HeaderMap,
    ) -> Found<B> {
        let cfg = &*self.flow.cfg;
        let record = match outcome {
            Ok(ClaimOutcome::Claimed(claim)) => return Found::Step(Step::Claimed(claim, sent)),
            Ok(ClaimOutcome::Existing(record)) => record,
            Err(e) if e.kind() == StoreErrorKind::QuotaExceeded => {
                self.outcome(Outcome::OverQuota);
                if cfg.store_failure.open_on_quota {
                    tracing::warn!(
                        "idempotency scope over its quota; running unprotected (quota fail open)"
                    );
                    return Found::Step(Step::FailOpen);
                }
                let err = IdempotencyError::new(
                    ErrorKind::QuotaExceeded,
                    "this caller holds as many idempotency records as it may; the request was not processed",
                )
                .retry_after(cfg.store_failure.quota_retry_after.min(cfg.timing.ttl()));
                return Found::Step(Step::Answer(self.flow.error(err)));
            }
            Err(e) if cfg.store_failure.open_on_error => {
                self.outcome(Outcome::StoreError);
                tracing::warn!(error = %Chain(&e), "idempotency store failed; running unprotected (fail open)");
                return Found::Step(Step::FailOpen);
            }
            Err(e) => {
                self.outcome(Outcome::StoreError);
                // An outage the store logs once (a failover hold, a WAIT shortfall)
                // refuses every request while it lasts: count those, log them at DEBUG.
                if let Some(outage) = e.outage() {
                    self.flow.labels.refused(outage);
                    tracing::debug!(error = %Chain(&e), "idempotency store refused during an outage; refusing the request (fail closed)");
                } else {
                    tracing::error!(error = %Chain(&e), "idempotency store failed; refusing the request (fail closed)");
                }
                let detail = if e.kind() == StoreErrorKind::Unknown {
                    "the idempotency store did not answer in time; the request was not processed"
                } else {
                    "the idempotency store is unavailable; the request was not processed"
                };
                let err = IdempotencyError::new(ErrorKind::StoreUnavailable, detail)
                    .retry_after(STORE_RETRY_AFTER)
                    .source(e);
                return Found::Step(Step::Answer(self.flow.error(err)));
            }
        };
        if record.fingerprint != self.fp {
            self.outcome(Outcome::Mismatch);
            let err = IdempotencyError::new(
                ErrorKind::Mismatch,
                "this idempotency key was already used with a different request",
            );
            return Found::Step(Step::Answer(self.flow.error(err)));
        }
        match record.state {
            RecordState::Completed(Completion::Response(stored)) => {
                if cfg.vary_match && !crate::recording::vary_matches(&stored, request) {
                    self.outcome(Outcome::Mismatch);
                    let err = IdempotencyError::new(
                        ErrorKind::Mismatch,
                        "this idempotency key was already used by a request whose answer varies on request headers (its Vary) that this one sends differently",
                    );
                    return Found::Step(Step::Answer(self.flow.error(err)));
                }
                self.outcome(Outcome::Replayed);
                let mut res = response::replay(stored);
                self.publish_ttl(res.headers_mut());
                Found::Step(Step::Answer(res))
            }
            RecordState::Completed(Completion::Tombstone { status }) => {
                self.outcome(Outcome::Tombstoned);
                // A webhook sender reads anything outside 2xx as "not taken" and
                // redelivers for days: it gets the status it was answered, empty.
                if cfg.unkept_as_status && !self.flow.grpc {
                    let mut res = response::replay_omitted(status);
                    self.publish_ttl(res.headers_mut());
                    return Found::Step(Step::Answer(res));
                }
                let err = IdempotencyError::new(ErrorKind::ResponseNotRetained, "the original request completed, but its response was too large to keep; it was not run again")
                    .original_status(status);
                Found::Step(Step::Answer(self.flow.error(err)))
            }
            RecordState::InProgress { lease_remaining } => Found::InProgress(lease_remaining),
        }
    }
}
