//! Completing inside your own transaction: [`record_in`](PostgresStore::record_in),
//! [`complete_in`](PostgresStore::complete_in) and [`lock_in`](PostgresStore::lock_in).

use std::time::Duration;

use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::retry::refused;
use super::rows::{column, token_params, CompleteParams};
use super::PostgresStore;
use crate::record::{Completion, RecordId, Token};
use crate::store::{StoreError, StoreErrorKind};

impl PostgresStore {
    /// Takes the row lock of `token`'s record in your transaction, for
    /// [`complete_in`](Self::complete_in) under `REPEATABLE READ` or `SERIALIZABLE`: call it
    /// as the transaction's first statement. Until you commit or roll back, lease renewals and
    /// takeovers of the record wait (a renewal that waits past its deadline fails, and the
    /// next one is tried); keep the transaction shorter than the lease.
    ///
    /// Fenced like [`complete`](crate::store::IdempotencyStore::complete): a stale token is
    /// [`StoreErrorKind::Fenced`]. Not needed under `READ COMMITTED`.
    pub async fn lock_in<C>(
        &self,
        client: &C,
        id: &RecordId,
        token: &Token,
    ) -> Result<(), StoreError>
    where
        C: GenericClient,
    {
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 3] = [&id.as_bytes().as_slice(), &generation, &nonce];
        let statement = client
            .prepare_cached(&self.sql.lock)
            .await
            .map_err(refused)?;
        let rows = client.query(&statement, &params).await.map_err(refused)?;
        if rows.is_empty() {
            Err(StoreError::new(StoreErrorKind::Fenced))
        } else {
            Ok(())
        }
    }

    /// Records `response` as the answer of the request `ctx` belongs to, through `client`,
    /// typically inside your own transaction: [`complete_in`](Self::complete_in) with the
    /// context's record id, token and TTL, and the headers the layer would keep
    /// ([`IdempotencyContext::completion`](crate::IdempotencyContext::completion)).
    ///
    /// Call it last before `COMMIT`, return `response` from the handler, and mark it with
    /// [`RecordDecision::AlreadyRecorded`](crate::RecordDecision::AlreadyRecorded).
    pub async fn record_in<C>(
        &self,
        client: &C,
        ctx: &crate::IdempotencyContext,
        response: &http::Response<bytes::Bytes>,
    ) -> Result<(), StoreError>
    where
        C: GenericClient,
    {
        let completion = ctx.completion(response);
        self.complete_in(
            client,
            &ctx.record_id(),
            &ctx.token(),
            &completion,
            ctx.ttl(),
        )
        .await
    }

    /// Completes `token`'s claim through `client`, typically inside your own transaction, so
    /// the recorded answer commits with your writes or not at all.
    ///
    /// Fenced like [`complete`](crate::store::IdempotencyStore::complete): a stale token is
    /// [`StoreErrorKind::Fenced`] and writes nothing (roll back then). Not retried: a
    /// serialization failure aborts your transaction, and is [`StoreErrorKind::Unavailable`]
    /// with the driver error as source; retry the whole transaction.
    ///
    /// The statement row-locks the record until you commit, so a takeover (and the layer's
    /// lease renewal) waits for your outcome: call it last, just before `COMMIT`. After a
    /// commit, `extend` and `release` with this token are fenced, and `complete` answers `Ok`
    /// (the answer is recorded already). Under `REPEATABLE READ` or `SERIALIZABLE`, call
    /// [`lock_in`](Self::lock_in) first, or a renewal during the transaction makes this fail
    /// with a serialization failure.
    pub async fn complete_in<C>(
        &self,
        client: &C,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        C: GenericClient,
    {
        let owned = CompleteParams::new(id, token, completion, ttl);
        let params = owned.params();
        let statement = client
            .prepare_cached(&self.sql.complete)
            .await
            .map_err(refused)?;
        let row = client
            .query_one(&statement, &params)
            .await
            .map_err(refused)?;
        if column::<bool>(&row, "applied")? || column::<bool>(&row, "done")? {
            Ok(())
        } else {
            Err(StoreError::new(StoreErrorKind::Fenced))
        }
    }
}
