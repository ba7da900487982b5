//! What the inner service learns about the keyed request it runs.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::record::{hex, Fingerprint, RecordId, Token};

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
#[derive(Clone, Debug)]
pub struct IdempotencyContext {
    key: Arc<str>,
    scope: Option<Arc<str>>,
    record_id: RecordId,
    fingerprint: Fingerprint,
    token: Token,
}

impl IdempotencyContext {
    pub(crate) fn new(
        key: Arc<str>,
        scope: Option<Arc<str>>,
        record_id: RecordId,
        fingerprint: Fingerprint,
        token: Token,
    ) -> Self {
        Self {
            key,
            scope,
            record_id,
            fingerprint,
            token,
        }
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
        IdempotencyContext::new(
            key.into(),
            scope.map(Into::into),
            RecordId::new(scope, key),
            Fingerprint::from_bytes([0; 32]),
            Token::from_parts(generation, [7; 16]),
        )
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
