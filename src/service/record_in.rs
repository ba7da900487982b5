//! [`PostgresStore::record_in`] and [`PostgresStore::save_recovery_point_in`]: the
//! transactional writes that take the request's [`IdempotencyContext`]. They stand here, over
//! the store, so that the store never imports the layer.

use bytes::Bytes;

use super::IdempotencyContext;
use crate::store::postgres::{BufferedBody, Executor, PostgresStore};
use crate::store::StoreError;

impl PostgresStore {
    /// Records `response` as the answer of the request `ctx` belongs to, through `client`,
    /// typically inside your own transaction: [`complete_in`](Self::complete_in) with the
    /// context's record id, token and TTL, and the headers the layer would keep
    /// ([`IdempotencyContext::completion`]).
    ///
    /// Takes the response the handler returns, with any [`BufferedBody`] (`Bytes`, `String`,
    /// `Vec<u8>`, `Full<Bytes>`, …), so retries replay exactly what this attempt answered.
    /// Call it last before `COMMIT`, return `response` from the handler, and mark it with
    /// [`RecordDecision::AlreadyRecorded`](crate::RecordDecision::AlreadyRecorded): the layer
    /// then streams the body and only checks that the record is completed.
    ///
    /// Unmarked, the response goes through the layer's record policy. One it would record is
    /// buffered and completed again with the same token, which the store answers `Ok`
    /// without writing (the answer is recorded already); one it would release (a 5xx) gets a
    /// release that is [`StoreErrorKind::Fenced`](crate::store::StoreErrorKind::Fenced) and logged. Either way the answer committed
    /// here stands, and retries replay it, not what the handler returned.
    pub async fn record_in<C, B>(
        &self,
        client: C,
        ctx: &IdempotencyContext,
        response: &http::Response<B>,
    ) -> Result<(), StoreError>
    where
        C: Executor,
        B: BufferedBody,
    {
        let completion = B::with_bytes(response, |response| ctx.completion(response))?;
        self.complete_in(
            client,
            &ctx.record_id(),
            &ctx.token(),
            &completion,
            ctx.ttl(),
        )
        .await
    }

    /// Saves where the request `ctx` belongs to got to, through `client`: the same fenced
    /// statement as [`IdempotencyContext::save_recovery_point`], inside your transaction, so
    /// a step's business write and its recovery point commit together or not at all. A
    /// takeover then never finds a point without the write it stands for, nor a write past
    /// the point it resumes from.
    ///
    /// Each phase of a resumable handler is one transaction: its business write, then
    /// `save_recovery_point_in`, then `COMMIT`. The last phase writes and calls
    /// [`record_in`](Self::record_in) instead, which drops the point. Under `READ COMMITTED`
    /// nothing else is needed; under `REPEATABLE READ` or `SERIALIZABLE`, start each phase
    /// with [`lock_in`](Self::lock_in).
    ///
    /// A point over a cap ([`RecoveryPoint::MAX_STEP`](crate::RecoveryPoint::MAX_STEP),
    /// [`MAX_DATA`](crate::RecoveryPoint::MAX_DATA)) is [`StoreErrorKind::TooLarge`](crate::store::StoreErrorKind::TooLarge), naming
    /// the cap, and nothing is sent. A stale token (another attempt took over) is
    /// [`StoreErrorKind::Fenced`](crate::store::StoreErrorKind::Fenced) and writes nothing: roll back, and stop. Like
    /// [`complete_in`](Self::complete_in), it row-locks the record until you commit (lease
    /// renewals wait: save last, just before `COMMIT`), and is not retried: on any other
    /// error, roll back and retry the whole phase.
    pub async fn save_recovery_point_in<C>(
        &self,
        client: C,
        ctx: &IdempotencyContext,
        step: &str,
        data: impl Into<Bytes>,
    ) -> Result<(), StoreError>
    where
        C: Executor,
    {
        let encoded = ctx.recovery_point_for(step, data.into())?.encode();
        self.save_point_in(client, &ctx.record_id(), &ctx.token(), &encoded)
            .await
    }
}
