//! Recovery points on Redis: the save script, and the index the recovery worker sweeps.
//!
//! A point lives in its record (state `r`, after the header: see [`record`](super::record)),
//! so a takeover's claim reads it with the record, and `complete` and `release` drop it in
//! the same script that ends the claim. The index, `<prefix>recoverable`, is one sorted set
//! for the whole store (see `index.lua`): on a cluster it sits on one node, apart from the
//! records, so it is only a hint. Every record it names is read before anything is done with
//! it, and an entry whose record moved on is dropped then.

use redis::Value;

use super::error::{corrupt, fenced, Failure};
use super::{record, Keys, RedisStore};
use crate::store::record::{Record, RecordId, RecordState, Token};
use crate::store::RecoveryPoint;
use crate::store::{StoreError, StoreErrorKind};

/// The most index entries one sweep reads records for, whatever the limit: a sweep is a
/// bounded amount of work.
const MAX_SCAN: usize = 1000;

impl RedisStore {
    /// The index of records holding a recovery point.
    fn index_keys(&self) -> Keys {
        Keys {
            record: format!("{}recoverable", self.inner.prefix),
            group: None,
            id: Some(String::new()),
        }
    }

    async fn index(&self, args: &[&[u8]]) -> Result<Value, StoreError> {
        let lua = &self.inner.scripts.index;
        self.eval(lua, &self.index_keys(), args)
            .await
            .map_err(Failure::into_error)
    }

    pub(super) async fn save_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        let keys = self.keys(id);
        let tok = record::token_bytes(token).ok_or_else(fenced)?;
        let encoded = point.encode();
        // Indexed before it is saved, so a saved point is always found by the sweep. An entry
        // for a save that was then fenced, or never arrived, costs the sweep one read.
        self.index(&[b"add", id.as_bytes()]).await?;
        let args: [&[u8]; 2] = [&tok, &encoded];
        let lua = &self.inner.scripts.save;
        self.fenced(&keys, lua, &args, |found| match found {
            Some(f) if f.held_by(token) && !f.completed() => {
                if f.record.recovery_point.as_ref() == Some(point) {
                    Some(Ok(()))
                } else {
                    // Not there yet: saving it again is harmless.
                    None
                }
            }
            _ => Some(Err(fenced())),
        })
        .await?;
        self.replicate(&keys.record).await
    }

    /// Drops `id` from the index after its record completed (best effort: an entry left
    /// behind is dropped by the next sweep that reads the record).
    pub(super) async fn forget_recoverable(&self, id: &RecordId) {
        if let Err(e) = self.index(&[b"forget", id.as_bytes()]).await {
            tracing::debug!(error = %e, "could not drop a completed record from the recovery index");
        }
    }

    pub(super) async fn recoverable_records(
        &self,
        limit: usize,
    ) -> Result<Vec<(RecordId, Record)>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let scan = limit.saturating_mul(2).clamp(16, MAX_SCAN).to_string();
        let Value::Array(due) = self.index(&[b"due", scan.as_bytes()]).await? else {
            return Err(corrupt("recovery index reply"));
        };
        let mut found = Vec::new();
        for pair in due.chunks(2) {
            let [Value::BulkString(member), Value::BulkString(score)] = pair else {
                return Err(corrupt("recovery index entry"));
            };
            let Ok(bytes) = <[u8; 32]>::try_from(member.as_slice()) else {
                self.index(&[b"forget", member]).await?;
                continue;
            };
            let id = RecordId::from_bytes(bytes);
            let record = match self.read(&self.key(&id)).await {
                Ok(r) => r,
                Err(Failure::Certain(e)) if e.kind() == StoreErrorKind::Corrupt => {
                    // One bad record must not stop every sweep: left for an operator.
                    tracing::warn!(record = %&id.to_hex()[..16], error = %e, "corrupt record in the recovery index, skipped");
                    continue;
                }
                Err(f) => return Err(f.into_error()),
            };
            let state = record
                .as_ref()
                .filter(|f| f.record.recovery_point.is_some())
                .map(|f| &f.record.state);
            match state {
                Some(RecordState::InProgress { lease_remaining }) if lease_remaining.is_zero() => {
                    found.push((id, record.expect("read").record));
                    if found.len() == limit {
                        break;
                    }
                }
                Some(RecordState::InProgress { lease_remaining }) => {
                    // A live lease: look again when it would lapse.
                    let ms = lease_remaining.as_millis().to_string();
                    self.index(&[b"later", member, score, ms.as_bytes()])
                        .await?;
                }
                // Gone, completed, or released (its point went with the claim).
                _ => {
                    self.index(&[b"drop", member, score]).await?;
                }
            }
        }
        Ok(found)
    }
}
