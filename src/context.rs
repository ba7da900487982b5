//! What the inner service learns about the keyed request it runs.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response};
use sha2::{Digest, Sha256};

use crate::config::Config;
use crate::record::{hex, Completion, Fingerprint, RecordId, Token};

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
    key: Arc<str>,
    scope: Option<Arc<str>>,
    record_id: RecordId,
    fingerprint: Fingerprint,
    token: Token,
    /// The layer's settings: the TTL and the rule for recorded headers.
    config: Arc<Config>,
    /// The request's headers when Vary matching is on: a recorded answer's guard needs them.
    request_headers: Option<Arc<HeaderMap>>,
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

impl IdempotencyContext {
    pub(crate) fn new(
        key: Arc<str>,
        scope: Option<Arc<str>>,
        record_id: RecordId,
        fingerprint: Fingerprint,
        token: Token,
        config: Arc<Config>,
        request_headers: Option<Arc<HeaderMap>>,
    ) -> Self {
        Self {
            key,
            scope,
            record_id,
            fingerprint,
            token,
            config,
            request_headers,
        }
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
    pub fn completion(&self, response: &Response<Bytes>) -> Completion {
        crate::recording::completion(
            &self.config,
            self.request_headers.as_deref(),
            response.status(),
            response.headers(),
            response.body().clone(),
            None,
        )
    }

    /// The client's idempotency key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The scope the key lives in; `None` when the layer is unscoped.
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
            key.into(),
            scope.map(Into::into),
            RecordId::new(scope, key),
            Fingerprint::from_bytes([0; 32]),
            Token::from_parts(generation, [7; 16]),
            layer.config,
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
        let Completion::Response(stored) = c.completion(&res) else {
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
