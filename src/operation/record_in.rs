//! [`PostgresStore::record_output_in`]: an operation's answer recorded in the caller's own
//! transaction, beside its effect.

use super::{encode, Codec};
use crate::service::IdempotencyContext;
use crate::store::postgres::{Executor, PostgresStore};
use crate::store::{StoreError, StoreErrorKind};

impl PostgresStore {
    /// Records `value`, an [operation](crate::operation)'s answer, through `client`: call it
    /// inside the transaction that writes the operation's effect, last before `COMMIT`, and
    /// return the same `value` from the work. The effect and the record then commit together
    /// or not at all, which is what makes a queue consumer's effect happen exactly once: a
    /// takeover finds either both or neither.
    ///
    /// The operation then completes the record again with the same token, which the store
    /// answers `Ok` without writing. A stale token (another attempt took over) is
    /// [`StoreErrorKind::Fenced`] and writes nothing: roll back, and stop. Encoded as the
    /// operation would (`codec`, tombstoned past the configuration's `max_response_body`);
    /// an answer that does not encode is [`StoreErrorKind::Other`] and nothing is sent.
    pub async fn record_output_in<C, T, K>(
        &self,
        client: C,
        ctx: &IdempotencyContext,
        codec: &K,
        value: &T,
    ) -> Result<(), StoreError>
    where
        C: Executor,
        K: Codec<T>,
    {
        let completion = encode(codec, value, ctx.max_answer())
            .map_err(|e| StoreError::with_source(StoreErrorKind::Other, e))?;
        self.complete_in(
            client,
            &ctx.record_id(),
            &ctx.token(),
            &completion,
            ctx.ttl(),
        )
        .await
    }
}
