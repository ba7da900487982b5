//! Idempotent operations beyond HTTP: any job, any message, any `tower::Service<R>`.
//!
//! The same protocol as the HTTP layer (claim, lease renewals, fencing, takeover with the
//! recovery point, the recovery worker's records, transactional completion), on the same
//! stores and configuration, for work that is not an HTTP request: a queue consumer's
//! messages, scheduled jobs, internal calls. Read the [Beyond HTTP guide](crate::beyond_http)
//! for what the key should be and how the lease meets a queue's redelivery.
//!
//! - [`Operations::once`]: a function form, for code that is not a service.
//! - [`OperationLayer`]: a layer for a `tower::Service<R>` with any request type.
//!
//! ```
//! use tower_idempotency::operation::{OnceError, Operations};
//! use tower_idempotency::store::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! #[derive(serde::Serialize)]
//! struct Payment { id: String, amount: u64 }
//!
//! let ops = Operations::new(MemoryStore::new());
//! let payment = Payment { id: "pay-1".into(), amount: 1200 };
//! let charge = |ctx: tower_idempotency::IdempotencyContext| async move {
//!     // The provider gets a key of its own, the same on every attempt.
//!     let provider_key = ctx.derive("card-network");
//!     Ok::<_, std::io::Error>(format!("ch_{}", &provider_key[..8]))
//! };
//! let first: String = ops.once("payments", &payment.id, &payment, charge).await.unwrap();
//! // A redelivery of the same message runs nothing and gets the recorded answer.
//! let again: Result<String, OnceError<std::io::Error>> =
//!     ops.once("payments", &payment.id, &payment, |_| async { unreachable!() }).await;
//! assert_eq!(again.unwrap(), first);
//! // The same id with another payload is refused.
//! let other = Payment { id: "pay-1".into(), amount: 1 };
//! let reused = ops.once("payments", &other.id, &other, charge).await;
//! assert!(matches!(reused, Err(OnceError::Mismatch)));
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde::{de::DeserializeOwned, Serialize};
use tokio::time::Instant;
use tracing::Instrument;

use crate::config::Config;
use crate::layer::IdempotencyLayer;
use crate::metrics::{Labels, Outcome};
use crate::service::{
    bounded, claim_within, deadline, panic_message, took_over, with_current, Chain, Holder,
    IdempotencyContext, Lease, Waiters,
};
use crate::store::record::{Completion, RecordId, RecordState, ScopeId, StoredResponse, Token};
use crate::store::{ClaimOutcome, IdempotencyStore, StoreErrorKind};

mod codec;
mod error;
mod identity;
mod layer;
#[cfg(feature = "postgres")]
mod record_in;

pub use codec::{Codec, CodecError, Json, Raw};
pub use error::OnceError;
pub use identity::{Identity, InvalidInput};
pub use layer::{Identify, OperationLayer, OperationService};

/// Runs operations once per (scope, key) on a store, with an [`IdempotencyLayer`]'s
/// configuration: its store, [`Timing`](crate::Timing) (lease, TTL, store deadline),
/// [`InProgress`](crate::InProgress) (answer at once, or wait for the attempt in flight),
/// `max_response_body` (an answer larger than this is not kept), abandoned-key hook, route
/// label and metrics.
///
/// Cheap to clone; every clone shares one wait registry.
///
/// Two things differ from HTTP, on purpose:
/// - a store failure is always an error ([`OnceError::StoreUnavailable`]), never "run
///   unprotected": a message or job can be delivered again later, and running it
///   unprotected is the duplicate this exists to prevent;
/// - the work's future is the caller's: dropped mid-work (a timeout around it, a consumer
///   shutting down), it stops, and its claim's lease is ended at once, keeping the record
///   and its recovery point, so the next attempt takes over at once and resumes.
#[derive(Clone)]
#[must_use]
pub struct Operations {
    config: Arc<Config>,
    waiters: Arc<Waiters>,
}

impl fmt::Debug for Operations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Operations")
            .field("store", &self.config.store.name())
            .field("timing", &self.config.timing)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Operations on this layer's store and configuration (see [`Operations`]): for the
    /// jobs and messages an HTTP service also handles, on the same store. Each operation
    /// names its own scope.
    pub fn operations(&self) -> Operations {
        Operations {
            config: self.config.clone(),
            waiters: self.waiters.clone(),
        }
    }
}

/// How long a caller waits before retrying after a store failure: the store is expected
/// back within a second or two (the HTTP layer's `Retry-After` for a 503).
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Operations {
    /// Operations on `store` with the defaults of [`IdempotencyLayer::new`]: a 30 s lease,
    /// 24 h retention, a 1 s store deadline, in-progress duplicates answered at once. Use
    /// [`IdempotencyLayer::operations`] for any other configuration.
    pub fn new(store: impl IdempotencyStore) -> Self {
        // Each operation names its scope: the layer's scope setting is never read here.
        IdempotencyLayer::new(store).operations()
    }

    /// Runs `work` once for (`scope`, `key`) and `input`, and gives every later call the same
    /// answer, recorded as JSON ([`Json`]).
    ///
    /// - First call: `work` runs; `Ok` is recorded and returned; `Err` releases the key (the
    ///   next call runs again) and is returned as [`OnceError::Failed`]. A failure that must
    ///   not run again is an answer: make it part of `T` (`T = Result<Charge, Declined>`).
    /// - While another call runs it: [`OnceError::InProgress`], or a wait for its answer
    ///   when the configuration waits ([`InProgress::wait`](crate::InProgress::wait)).
    /// - Once recorded: the recorded answer, without running `work`.
    /// - The same key with another `input`: [`OnceError::Mismatch`].
    /// - An attempt that died mid-work (its lease lapsed): the next call takes over, and its
    ///   [`IdempotencyContext::recovery_point`] is where the dead one got to.
    pub async fn once<I, T, E, F, Fut>(
        &self,
        scope: &str,
        key: &str,
        input: &I,
        work: F,
    ) -> Result<T, OnceError<E>>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce(IdempotencyContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let identity = Identity::json(key, input)
            .map_err(OnceError::Invalid)?
            .in_scope(scope);
        self.run(identity, &Json, work).await
    }

    /// [`once`](Self::once) for an [`Identity`] built by hand (bytes, no scope), with the
    /// answer recorded through `codec`.
    pub async fn run<T, E, C, F, Fut>(
        &self,
        identity: Identity,
        codec: &C,
        work: F,
    ) -> Result<T, OnceError<E>>
    where
        C: Codec<T>,
        F: FnOnce(IdempotencyContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let Identity {
            scope,
            key,
            fingerprint,
        } = identity;
        let (scope_id, id) = RecordId::cached(scope.as_deref(), &key);
        let span = crate::service::record_span(&id);
        let run = Run {
            cfg: &self.config,
            waiters: &self.waiters,
            labels: Labels::operation(&self.config),
            scope_id,
            id,
        };
        async move {
            let claim = match run.claim::<T, E, C>(&fingerprint, codec).await {
                Step::Won(claim) => claim,
                Step::Done(answer) => return answer,
            };
            let ctx = IdempotencyContext::new(
                Some(key),
                scope.clone(),
                scope_id,
                id,
                fingerprint,
                claim.token,
                self.config.clone(),
                None,
                claim.recovery_point,
            );
            if claim.takeover {
                took_over(
                    &self.config,
                    &run.labels,
                    scope,
                    id,
                    &claim.token,
                    claim.lapsed_for,
                );
            }
            run.execute(ctx, claim.sent, codec, work).await
        }
        .instrument(span)
        .await
    }
}

/// One operation's record, and the store calls on it.
struct Run<'a> {
    cfg: &'a Arc<Config>,
    waiters: &'a Arc<Waiters>,
    labels: Labels,
    scope_id: ScopeId,
    id: RecordId,
}

/// What the claim found.
enum Step<T, E> {
    /// This call holds the key: run the work.
    Won(Won),
    /// The answer without running: a replay, or an error.
    Done(Result<T, OnceError<E>>),
}

/// A won claim, and when it was sent (the lease counts from then).
struct Won {
    token: Token,
    takeover: bool,
    lapsed_for: Option<Duration>,
    recovery_point: Option<crate::RecoveryPoint>,
    sent: Instant,
}

impl Run<'_> {
    fn outcome(&self, name: Outcome) {
        tracing::Span::current().record("outcome", name.as_str());
        self.labels.outcome(name);
    }

    fn holder(&self) -> Holder<'_> {
        Holder {
            cfg: self.cfg,
            labels: &self.labels,
            id: &self.id,
        }
    }

    /// Claims the key, or answers from its record.
    async fn claim<T, E, C: Codec<T>>(
        &self,
        fingerprint: &crate::store::record::Fingerprint,
        codec: &C,
    ) -> Step<T, E> {
        let cfg = &**self.cfg;
        let wait_until = cfg.in_progress.wait.map(|w| deadline(Instant::now(), w));
        loop {
            let (outcome, sent) =
                claim_within(self.cfg, &self.labels, self.id, *fingerprint, self.scope_id).await;
            let record = match outcome {
                Ok(ClaimOutcome::Claimed(claim)) => {
                    return Step::Won(Won {
                        token: claim.token,
                        takeover: claim.takeover,
                        lapsed_for: claim.lapsed_for,
                        recovery_point: claim.recovery_point,
                        sent,
                    })
                }
                Ok(ClaimOutcome::Existing(record)) => record,
                Err(e) => {
                    let (outcome, retry_after) = match e.kind() {
                        StoreErrorKind::QuotaExceeded => (
                            Outcome::OverQuota,
                            cfg.store_failure.quota_retry_after.min(cfg.timing.ttl()),
                        ),
                        _ => (Outcome::StoreError, STORE_RETRY_AFTER),
                    };
                    self.outcome(outcome);
                    if let Some(outage) = e.outage() {
                        self.labels.refused(outage);
                    } else {
                        tracing::error!(error = %Chain(&e), "idempotency store failed; the operation was not run");
                    }
                    return Step::Done(Err(OnceError::StoreUnavailable {
                        error: e,
                        retry_after,
                    }));
                }
            };
            if record.fingerprint != *fingerprint {
                self.outcome(Outcome::Mismatch);
                return Step::Done(Err(OnceError::Mismatch));
            }
            match record.state {
                RecordState::Completed(Completion::Response(stored)) => {
                    return Step::Done(match codec.decode(stored.body) {
                        Ok(value) => {
                            self.outcome(Outcome::Replayed);
                            Ok(value)
                        }
                        Err(e) => {
                            self.outcome(Outcome::Replayed);
                            tracing::error!(error = %e, "the recorded answer does not decode with this codec (its type changed?); the operation was not run again");
                            Err(OnceError::Undecodable(e))
                        }
                    });
                }
                RecordState::Completed(Completion::Tombstone { .. }) => {
                    self.outcome(Outcome::Tombstoned);
                    return Step::Done(Err(OnceError::NotKept));
                }
                RecordState::InProgress { lease_remaining } => {
                    if let Some(until) = wait_until {
                        let waiters = self.waiters;
                        if waiters
                            .wait_for_change(self.cfg, &self.labels, self.id, until)
                            .await
                        {
                            continue;
                        }
                    }
                    self.outcome(Outcome::Conflict);
                    return Step::Done(Err(OnceError::InProgress {
                        retry_after: lease_remaining.min(cfg.in_progress.retry_after),
                    }));
                }
            }
        }
    }

    /// Runs the work under the claim, renewing its lease, then records or releases.
    async fn execute<T, E, C, F, Fut>(
        &self,
        ctx: IdempotencyContext,
        sent: Instant,
        codec: &C,
        work: F,
    ) -> Result<T, OnceError<E>>
    where
        C: Codec<T>,
        F: FnOnce(IdempotencyContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let token = ctx.token();
        tracing::Span::current().record("generation", token.generation());
        let lease = Lease::new(sent, &self.cfg.timing);
        let mut unsettled = Unsettled {
            store: Some(self.cfg.store.clone()),
            id: self.id,
            token,
            timeout: lease.timeout,
        };
        // The work's first poll runs inside the context, so a service's `call` reads it too.
        let scoped = with_current(ctx.clone(), async move { work(ctx).await });
        let work = AssertUnwindSafe(scoped).catch_unwind();
        let holder = self.holder();
        let result = tokio::select! {
            biased;
            r = work => r,
            never = holder.renew(&token, &lease) => match never {},
        };
        unsettled.store = None;
        match result {
            Err(panic) => {
                self.outcome(Outcome::Released);
                self.settle(None, token, lease).await;
                tracing::error!(
                    panic = panic_message(&*panic),
                    "the operation's work panicked; its key was released"
                );
                std::panic::resume_unwind(panic)
            }
            Ok(Err(e)) => {
                self.outcome(Outcome::Released);
                self.settle(None, token, lease).await;
                Err(OnceError::Failed(e))
            }
            Ok(Ok(value)) => {
                let completion = self.completion(codec, &value);
                self.outcome(match completion {
                    Completion::Response(_) => Outcome::Executed,
                    Completion::Tombstone { .. } => Outcome::Tombstoned,
                });
                self.settle(Some(completion), token, lease).await;
                Ok(value)
            }
        }
    }

    /// Records `completion`, or releases the claim (`None`), retrying while the lease lives.
    /// On a task of its own: a caller that drops the operation once its work is done must
    /// not cancel the record (the key would stay held for a lease, then run again) or the
    /// release.
    async fn settle(&self, completion: Option<Completion>, token: Token, lease: Lease) {
        let (cfg, labels, id) = (self.cfg.clone(), self.labels.clone(), self.id);
        let settle = async move {
            let holder = Holder {
                cfg: &cfg,
                labels: &labels,
                id: &id,
            };
            match completion {
                Some(completion) => holder.complete(&token, &completion, &lease).await,
                None => holder.release(&token, &lease).await,
            }
        }
        .in_current_span();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(settle).await),
            Err(_) => settle.await,
        }
    }

    /// The record of `value`: its encoding, or only that it completed where the encoding
    /// fails or is over `max_response_body` (the work ran, so it must not run again).
    fn completion<T, C: Codec<T>>(&self, codec: &C, value: &T) -> Completion {
        match encode(codec, value, self.cfg.max_response_body) {
            Ok(completion) => completion,
            Err(e) => {
                tracing::error!(error = %e, "the operation's answer could not be encoded; it is recorded as completed without its answer, and retries get OnceError::NotKept");
                Completion::Tombstone {
                    status: StatusCode::OK,
                }
            }
        }
    }
}

/// The completion that records `value`, as the layer and
/// [`PostgresStore::record_output_in`](crate::store::postgres::PostgresStore::record_output_in)
/// store it: a 200 with the codec's media type, or a tombstone past `limit` bytes.
pub(crate) fn encode<T, C: Codec<T>>(
    codec: &C,
    value: &T,
    limit: usize,
) -> Result<Completion, CodecError> {
    let body: Bytes = codec.encode(value)?;
    if body.len() > limit {
        return Ok(Completion::Tombstone {
            status: StatusCode::OK,
        });
    }
    let mut headers = HeaderMap::with_capacity(1);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.media_type()),
    );
    Ok(Completion::Response(StoredResponse::new(
        StatusCode::OK,
        headers,
        body,
        None,
    )))
}

/// What a [`RecoveryWorker`](crate::RecoveryWorker)'s recover function returns to finish an
/// operation's record: `value` encoded as the operation records it (a 200 with the codec's
/// media type), so that the next attempt of the operation reads `value` back. The worker
/// runs operations' records beside HTTP ones: it tells them apart by what its recover
/// function finds in the [`RecoveryPoint`](crate::RecoveryPoint) the work saved.
pub fn recovered<T, C: Codec<T>>(
    codec: &C,
    value: &T,
) -> Result<http::Response<Bytes>, CodecError> {
    let body = codec.encode(value)?;
    let mut response = http::Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.media_type()),
    );
    Ok(response)
}

/// A claim whose work is still running. Dropped so (the caller dropped the future), it ends
/// the claim's lease at once on a task of its own, keeping the record and its recovery point:
/// the next attempt takes over without waiting a lease, and knows it is a takeover.
struct Unsettled {
    store: Option<Arc<dyn IdempotencyStore>>,
    id: RecordId,
    token: Token,
    timeout: Duration,
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (id, token, timeout) = (self.id, self.token, self.timeout);
        runtime.spawn(async move {
            let until = deadline(Instant::now(), timeout);
            match bounded(until, store.extend(&id, &token, Duration::ZERO)).await {
                Ok(()) => tracing::warn!("an operation's work was dropped mid-way; its lease was ended, so the next attempt takes over"),
                Err(e) if e.is_fenced() => {}
                Err(e) => tracing::warn!(error = %Chain(&e), "an operation's work was dropped mid-way; ending its lease failed, so it lapses on its own"),
            }
        });
    }
}
