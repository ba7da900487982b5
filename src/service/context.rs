//! What the inner service learns about the keyed request it runs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response};
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::store::record::{hex, Completion, Fingerprint, RecordId, ScopeId, Token};
use crate::store::RecoveryPoint;
use crate::store::{StoreError, StoreErrorKind};

/// Put into the inner request's extensions for every keyed request the layer runs.
///
/// ```
/// # use tower_idempotency::IdempotencyContext;
/// # fn handler(ctx: &IdempotencyContext) {
/// // The same key on every retry and takeover of this request, different per `name`:
/// let provider_key = ctx.derive("card-network");
/// # let _ = provider_key;
/// # }
/// ```
#[derive(Clone)]
pub struct IdempotencyContext {
    /// `None` in a context the recovery worker built: stores never keep the client's key.
    key: Option<Arc<str>>,
    /// `None` in a context the recovery worker built: stores never keep the scope either.
    scope: Option<Arc<str>>,
    /// The scope's id, which a recovery point keeps (the worker knows only this).
    scope_id: ScopeId,
    record_id: RecordId,
    fingerprint: Fingerprint,
    token: Token,
    /// The layer's settings: the TTL and the rule for recorded headers.
    config: Arc<Config>,
    /// The request's headers when Vary matching is on: a recorded answer's guard needs them.
    request_headers: Option<Arc<HeaderMap>>,
    /// The recovery point the claim found (a takeover's), shared by the context's clones.
    recovery_point: Option<RecoveryPoint>,
}

impl fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key and the token's nonce stay out of logs.
        f.debug_struct("IdempotencyContext")
            .field("record_id", &self.record_id)
            .field("generation", &self.token.generation())
            .finish_non_exhaustive()
    }
}

tokio::task_local! {
    /// The context of the operation whose work this task is running.
    static CURRENT: IdempotencyContext;
}

/// Runs `work` with `ctx` as its [`IdempotencyContext::current`].
pub(crate) async fn with_current<F: std::future::Future>(
    ctx: IdempotencyContext,
    work: F,
) -> F::Output {
    CURRENT.scope(ctx, work).await
}

impl IdempotencyContext {
    /// The context of the [operation](crate::operation) whose work is running on this task:
    /// for a service behind an [`OperationLayer`](crate::operation::OperationLayer), which
    /// has no request extensions to find it in. `None` anywhere else: in an HTTP handler
    /// (take it from the request's extensions, or with the axum extractor), and on a task the
    /// work spawned (pass it a clone).
    pub fn current() -> Option<Self> {
        CURRENT.try_with(Clone::clone).ok()
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        key: Option<Arc<str>>,
        scope: Option<Arc<str>>,
        scope_id: ScopeId,
        record_id: RecordId,
        fingerprint: Fingerprint,
        token: Token,
        config: Arc<Config>,
        request_headers: Option<Arc<HeaderMap>>,
        recovery_point: Option<RecoveryPoint>,
    ) -> Self {
        Self {
            key,
            scope,
            scope_id,
            record_id,
            fingerprint,
            token,
            config,
            request_headers,
            recovery_point,
        }
    }

    /// The recovery point the attempts before this one saved last, if any: where to resume.
    /// `None` on a first attempt, and on a takeover of an attempt that saved none (run from
    /// the start, with every downstream call keyed by [`derive`](Self::derive)).
    ///
    /// See the [resumable handlers guide](crate::resumable) for what to put in one.
    pub fn recovery_point(&self) -> Option<&RecoveryPoint> {
        self.recovery_point.as_ref()
    }

    /// Saves where this attempt got to: `step` (1 to [`RecoveryPoint::MAX_STEP`] bytes) and
    /// `data` (at most [`RecoveryPoint::MAX_DATA`] bytes). An attempt that takes over after
    /// this one dies gets it from [`recovery_point`](Self::recovery_point), and so does the
    /// [recovery worker](crate::RecoveryWorker). Each save replaces the one before; the point
    /// is dropped when the answer is recorded or the claim released.
    ///
    /// Fenced by this attempt's claim: once another attempt took over (this one's lease
    /// lapsed), the save fails with [`StoreErrorKind::Fenced`](crate::store::StoreErrorKind::Fenced)
    /// and writes nothing. **Stop then**: the other attempt runs the remaining steps. A point
    /// over a cap fails with [`StoreErrorKind::TooLarge`](crate::store::StoreErrorKind::TooLarge),
    /// naming the cap, and nothing is stored. A store call that times out is
    /// [`StoreErrorKind::Unknown`](crate::store::StoreErrorKind::Unknown): the point may or may
    /// not be saved, so treat it as a failed step (the next save, or the answer, settles it).
    pub async fn save_recovery_point(
        &self,
        step: &str,
        data: impl Into<Bytes>,
    ) -> Result<(), StoreError> {
        let point = self.recovery_point_for(step, data.into())?;
        let store = &self.config.store;
        let timeout = self.config.timing.store_timeout();
        // No timer for a call that is done at its first poll (an in-memory store).
        match super::within_for(
            timeout,
            store.save_recovery_point(&self.record_id, &self.token, &point),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(StoreError::with_source(
                StoreErrorKind::Unknown,
                "saving the recovery point timed out; it may or may not be saved",
            )),
        }
    }

    /// The point [`save_recovery_point`](Self::save_recovery_point) would save, checked
    /// against the caps: for a store that saves it in the handler's own transaction
    /// (`PostgresStore::save_recovery_point_in`).
    pub fn recovery_point_for(&self, step: &str, data: Bytes) -> Result<RecoveryPoint, StoreError> {
        RecoveryPoint::new(step, data, self.scope_id, self.generation())
    }

    /// The largest answer kept whole: the layer's `max_response_body`.
    #[cfg(feature = "postgres")]
    pub(crate) fn max_answer(&self) -> usize {
        self.config.max_response_body
    }

    /// How long the recorded answer is kept: the layer's retention TTL.
    pub fn ttl(&self) -> Duration {
        self.config.timing.ttl()
    }

    /// The answer to record for `response`, exactly as the layer would record it: the same
    /// headers kept, the same Vary guard (a retry that sends other values of the headers the
    /// answer's `Vary` names is refused), and a tombstone where the answer is over
    /// `max_response_body` or the record's caps. For a handler that completes its own record,
    /// such as [`PostgresStore::record_in`](crate::store::postgres::PostgresStore::record_in).
    /// Retries get exactly this, so pass the response the handler returns.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unguarded`] when the answer's `Vary` names request headers (and Vary
    /// matching is on) in a context without a request, the
    /// [recovery worker](crate::RecoveryWorker)'s: such an answer cannot carry its Vary
    /// guard, so it is never built. Answer without that `Vary`, or leave it to the client's
    /// retry, which has the headers.
    pub fn completion(&self, response: &Response<Bytes>) -> Result<Completion, StoreError> {
        crate::recording::completion(
            self.config.recording(),
            self.request_headers.as_deref(),
            response.status(),
            response.headers(),
            response.body().clone(),
            None,
        )
    }

    /// The client's idempotency key. `None` in the context the
    /// [recovery worker](crate::RecoveryWorker) runs a recovery with: stores keep only the
    /// key's hash.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The scope the key lives in; `None` when the layer is unscoped, and in the context the
    /// [recovery worker](crate::RecoveryWorker) runs a recovery with: stores keep only the
    /// scope's hash. A recover function that needs the tenant reads it from the data its
    /// handler saved in the [`RecoveryPoint`].
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// The store's id of this record.
    pub fn record_id(&self) -> RecordId {
        self.record_id
    }

    /// The request's fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// 1 for a first attempt; greater when this run took over from an attempt whose lease
    /// lapsed (it may have done part of the work: make downstream calls idempotent too).
    pub fn generation(&self) -> u64 {
        self.token.generation()
    }

    /// The claim's token, for a handler that completes its own record (transactional stores).
    pub fn token(&self) -> Token {
        self.token
    }

    /// A stable key for a downstream call, such as a payment provider's own Idempotency-Key.
    ///
    /// 64 hex characters from (scope, key, `name`): the same on every retry and takeover of
    /// this request, different for each `name` and for every other scope or key.
    pub fn derive(&self, name: &str) -> String {
        let mut h = Sha256::new();
        h.update(b"tower-idempotency derive v1\0");
        h.update(self.record_id.as_bytes());
        h.update((name.len() as u64).to_be_bytes());
        h.update(name.as_bytes());
        hex(&h.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(scope: Option<&str>, key: &str, generation: u64) -> IdempotencyContext {
        let layer = crate::IdempotencyLayer::new(crate::store::MemoryStore::new());
        IdempotencyContext::new(
            Some(key.into()),
            scope.map(Into::into),
            ScopeId::new(scope),
            RecordId::new(scope, key),
            Fingerprint::from_bytes([0; 32]),
            Token::from_parts(generation, [7; 16]),
            layer.config,
            None,
            None,
        )
    }

    #[test]
    fn completions_keep_the_layers_headers_and_the_ttl_and_debug_hides_the_key() {
        let c = ctx(Some("t1"), "secret-key", 1);
        assert_eq!(c.ttl(), crate::Timing::default().ttl());
        let res = http::Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .header("set-cookie", "session=1")
            .body(Bytes::from_static(b"{}"))
            .unwrap();
        let Ok(Completion::Response(stored)) = c.completion(&res) else {
            panic!("a response")
        };
        assert_eq!(stored.status, 201);
        assert_eq!(stored.body, "{}");
        assert_eq!(stored.headers["content-type"], "application/json");
        assert!(!stored.headers.contains_key("set-cookie"));
        assert!(!format!("{c:?}").contains("secret-key"));
    }

    #[test]
    fn derived_keys_are_stable_across_generations_and_differ_by_name_scope_and_key() {
        let a = ctx(Some("t1"), "k", 1).derive("card");
        assert_eq!(a.len(), 64);
        assert_eq!(a, ctx(Some("t1"), "k", 2).derive("card"));
        assert_ne!(a, ctx(Some("t1"), "k", 1).derive("email"));
        assert_ne!(a, ctx(Some("t2"), "k", 1).derive("card"));
        assert_ne!(a, ctx(Some("t1"), "k2", 1).derive("card"));
    }
}
