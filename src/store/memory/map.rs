//! The sharded map's bookkeeping: admission and per-scope quotas, record sizes, the index of
//! records that saved a recovery point, and the record an entry stands for.

use std::collections::HashMap;

// Under `--cfg shuttle` the locks and atomics are shuttle's, so the model checker in
// tests/model explores their interleavings.
#[cfg(shuttle)]
use shuttle::sync::{atomic::Ordering, MutexGuard};
#[cfg(not(shuttle))]
use std::sync::{atomic::Ordering, MutexGuard};
// tokio's Instant is the monotonic clock, and it follows `tokio::time::pause` in tests.
use tokio::time::Instant;

use super::{Entry, IdHash, Inner, Shard, Usage, ENTRY_OVERHEAD};
use crate::store::record::{Completion, Record, RecordId, RecordState, ScopeId};
use crate::store::RecoveryPoint;
use crate::store::{StoreError, StoreErrorKind};

// A poisoned lock only means a panic elsewhere while holding it; every mutation below
// keeps the entry consistent before it can panic, so the data is still sound.
impl Inner {
    pub(super) fn remove(&self, shard: &mut Shard, id: &RecordId) {
        if let Some(e) = shard.map.remove(id) {
            self.records.fetch_sub(1, Ordering::Relaxed);
            self.bytes.fetch_sub(e.size as usize, Ordering::Relaxed);
            if let Some(scope) = e.scope {
                Self::unscope(&mut self.scopes(), *scope, e.size as usize);
            }
        }
    }

    /// Sets a live record's size, keeping the store's and its scope's byte counts.
    pub(super) fn resize(&self, e: &mut Entry, size: u32) {
        self.bytes.fetch_add(size as usize, Ordering::Relaxed);
        self.bytes.fetch_sub(e.size as usize, Ordering::Relaxed);
        if let Some(scope) = &e.scope {
            if let Some(u) = self.scopes().get_mut(&**scope) {
                u.bytes = (u.bytes + size as usize).saturating_sub(e.size as usize);
            }
        }
        e.size = size;
    }

    /// The ids of records that saved a recovery point (some may have moved on since). Locked
    /// after a shard, like `scopes`.
    pub(super) fn indexed(&self) -> MutexGuard<'_, std::collections::HashSet<RecordId, IdHash>> {
        self.recoverable.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn index(&self, id: RecordId) {
        self.indexed().insert(id);
    }

    pub(super) fn unindex(&self, id: &RecordId) {
        self.indexed().remove(id);
    }

    pub(super) fn scopes(&self) -> MutexGuard<'_, HashMap<ScopeId, Usage>> {
        self.scopes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one record of `size` bytes off `scope`'s usage.
    pub(super) fn unscope(scopes: &mut HashMap<ScopeId, Usage>, scope: ScopeId, size: usize) {
        if let Some(u) = scopes.get_mut(&scope) {
            u.records = u.records.saturating_sub(1);
            u.bytes = u.bytes.saturating_sub(size);
            if u.records == 0 {
                scopes.remove(&scope);
            }
        }
    }

    /// Reserves one more record for `scope`, or refuses: the scope is at its quota.
    pub(super) fn admit_scope(&self, scope: ScopeId) -> bool {
        let mut scopes = self.scopes();
        let u = scopes.entry(scope).or_default();
        if u.records >= self.max_scope_records
            || u.bytes.saturating_add(ENTRY_OVERHEAD) > self.max_scope_bytes
        {
            if u.records == 0 {
                scopes.remove(&scope);
            }
            return false;
        }
        u.records += 1;
        u.bytes += ENTRY_OVERHEAD;
        true
    }

    /// Gives back a reservation [`admit`](Self::admit) made for a record never inserted.
    pub(super) fn unadmit(&self) {
        self.records.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(ENTRY_OVERHEAD, Ordering::Relaxed);
    }

    /// Reserves room for one more record, or refuses. Never evicts.
    pub(super) fn admit(&self) -> Result<(), StoreError> {
        if self.bytes.load(Ordering::Relaxed) + ENTRY_OVERHEAD > self.max_bytes {
            return Err(StoreError::new(StoreErrorKind::Full));
        }
        self.records
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_records).then_some(n + 1)
            })
            .map(|_| {
                self.bytes.fetch_add(ENTRY_OVERHEAD, Ordering::Relaxed);
            })
            .map_err(|_| StoreError::new(StoreErrorKind::Full))
    }
}

impl Entry {
    pub(super) fn record(&self, now: Instant) -> Result<Record, StoreError> {
        let state = match &self.payload {
            // The body shares the record's allocation: a replay copies no body.
            Some(c) if self.done => RecordState::Completed(
                Completion::decode(c.clone())
                    .map_err(|e| StoreError::with_source(StoreErrorKind::Corrupt, e))?,
            ),
            _ => RecordState::InProgress {
                lease_remaining: self.lease_until.saturating_duration_since(now),
            },
        };
        Ok(
            Record::new(self.fingerprint, self.token.generation(), state)
                .with_holder(self.token)
                .with_recovery_point(self.point()?),
        )
    }

    /// The recovery point, while in progress.
    pub(super) fn point(&self) -> Result<Option<RecoveryPoint>, StoreError> {
        match &self.payload {
            Some(p) if !self.done => RecoveryPoint::decode(p.clone())
                .map(Some)
                .map_err(|e| StoreError::with_source(StoreErrorKind::Corrupt, e)),
            _ => Ok(None),
        }
    }
}
