//! Step 6's machinery: a claim in flight, and the release of a claim won too late to run.
//!
//! A claim past its deadline is "unknown", never read as claimed; a reply that comes late
//! and won is released before the 503 goes out, or on a task of its own when the request is
//! gone, so the key is not held for a lease by a request that will never run.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;

use super::deadline::{bounded, deadline, retry_until, within};
use super::Chain;
use crate::config::Config;
use crate::metrics::{timed, Labels};
use crate::store::record::{Fingerprint, RecordId, ScopeId};
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
