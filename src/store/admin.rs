//! The operator API: look at one record, free a stuck key, delete an answer.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use http::StatusCode;

use super::StoreError;
use crate::store::record::{Completion, Fingerprint, Record, RecordId, RecordState};

/// What an operator needs to fix a key by hand, beside the [`IdempotencyStore`] trait so
/// that trait stays small. Every store that ships with the crate implements it; the
/// [conformance suite](crate::conformance) checks it.
///
/// Look a key up by `RecordId::new(Some(scope), key)` (`None` for unscoped layers): the
/// store only knows the hash. Each operation is one atomic step on the backend, and each
/// is conditional, so it never removes a record in a state the operator did not see:
///
/// - [`force_release`](Self::force_release) removes a record **in progress** (a holder
///   that is stuck, or died and whose lease the operator will not wait out). The next retry
///   runs the work again; if the holder is still alive, its answer is fenced and not
///   recorded. Check the side effects first.
/// - [`delete`](Self::delete) removes a **completed** record (an answer, or a tombstone),
///   so the next request with that key runs as new.
///
/// [`IdempotencyStore`]: super::IdempotencyStore
#[async_trait]
pub trait IdempotencyAdmin: Send + Sync + 'static {
    /// The record of `id`, if live.
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError>;

    /// Removes the record of `id` if it is in progress (whatever its lease).
    async fn force_release(&self, id: &RecordId) -> Result<Removal, StoreError>;

    /// Removes the record of `id` if it is completed.
    async fn delete(&self, id: &RecordId) -> Result<Removal, StoreError>;
}

#[async_trait]
impl<T: IdempotencyAdmin + ?Sized> IdempotencyAdmin for Arc<T> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        (**self).inspect(id).await
    }

    async fn force_release(&self, id: &RecordId) -> Result<Removal, StoreError> {
        (**self).force_release(id).await
    }

    async fn delete(&self, id: &RecordId) -> Result<Removal, StoreError> {
        (**self).delete(id).await
    }
}

/// A store with the operator API: `Arc<dyn AdminStore>` serves the layer (it upcasts to
/// `Arc<dyn IdempotencyStore>`) and an admin endpoint alike.
pub trait AdminStore: super::IdempotencyStore + IdempotencyAdmin {}
impl<T: super::IdempotencyStore + IdempotencyAdmin + ?Sized> AdminStore for T {}

/// What [`force_release`](IdempotencyAdmin::force_release) and
/// [`delete`](IdempotencyAdmin::delete) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// The record was removed.
    Removed,
    /// There was no live record.
    Absent,
    /// The record is in the other state (completed for `force_release`, in progress for
    /// `delete`) and was left alone.
    Refused,
}

/// Where a record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    /// Claimed, not completed.
    InProgress,
    /// Completed with an answer that replays.
    Completed,
    /// Completed, with an answer too large to keep: retries get a problem response (in
    /// webhook mode, the original status with an empty body).
    Tombstone,
}

/// One record as an operator sees it: [`IdempotencyAdmin::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// In progress, completed, or a tombstone.
    pub status: RecordStatus,
    /// The generation of the latest claim (1, + 1 per takeover).
    pub generation: u64,
    /// Time left on the holder's lease (in progress only; zero once lapsed).
    pub lease_remaining: Option<Duration>,
    /// Time until the record expires, by the store's clock.
    pub expires_in: Duration,
    /// The recorded status (completed records and tombstones).
    pub answer_status: Option<StatusCode>,
    /// Bytes of the recorded body (completed records).
    pub answer_size: Option<usize>,
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The last recovery point an attempt saved (in progress only): the step it reached.
    pub recovery_point: Option<super::RecoveryPoint>,
}

impl RecordInfo {
    /// The operator's view of `record`, which expires in `expires_in`. For custom stores
    /// implementing [`IdempotencyAdmin`] on top of their `get`.
    pub fn new(record: &Record, expires_in: Duration) -> Self {
        let (status, lease_remaining, answer_status, answer_size) = match &record.state {
            RecordState::InProgress { lease_remaining } => {
                (RecordStatus::InProgress, Some(*lease_remaining), None, None)
            }
            RecordState::Completed(Completion::Response(r)) => (
                RecordStatus::Completed,
                None,
                Some(r.status),
                Some(r.body.len()),
            ),
            RecordState::Completed(Completion::Tombstone { status }) => {
                (RecordStatus::Tombstone, None, Some(*status), None)
            }
        };
        Self {
            status,
            generation: record.generation,
            lease_remaining,
            expires_in,
            answer_status,
            answer_size,
            fingerprint: record.fingerprint,
            recovery_point: record.recovery_point.clone(),
        }
    }
}
