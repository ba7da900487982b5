//! The claim, under one shard lock: a first claim, a takeover of a lapsed lease, or the
//! existing record; a full store sweeps once and refuses rather than evicts.

use std::time::Duration;

// tokio's Instant is the monotonic clock, and it follows `tokio::time::pause` in tests.
use tokio::time::Instant;

use super::{after, Entry, MemoryStore, ENTRY_OVERHEAD};
use crate::store::record::{Fingerprint, RecordId, ScopeId, Token};
use crate::store::{Claim, ClaimOutcome, StoreError, StoreErrorKind};

impl MemoryStore {
    pub(super) fn claim_as(
        &self,
        scope: Option<ScopeId>,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        // Scopes are counted only when a quota needs them: otherwise a claim would lock the
        // shared scope table for nothing.
        let quotas =
            self.inner.max_scope_records != usize::MAX || self.inner.max_scope_bytes != usize::MAX;
        let scope = scope.filter(|_| quotas);
        // At most twice: the second time after a full sweep made room.
        match self.try_claim(scope, id, fingerprint, lease, ttl, true)? {
            Some(outcome) => Ok(outcome),
            None => self
                .try_claim(scope, id, fingerprint, lease, ttl, false)?
                .ok_or_else(|| StoreError::new(StoreErrorKind::Full)),
        }
    }

    /// One claim under the shard lock. `None`: the store was full, a full sweep has run since,
    /// and the claim should run again (only when `may_sweep`).
    fn try_claim(
        &self,
        scope: Option<ScopeId>,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
        may_sweep: bool,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let (mut shard, now) = self.shard(id);
        if let Some(e) = shard.map.get_mut(id) {
            if e.expires_at > now {
                let lapsed = !e.done && e.lease_until <= now;
                if lapsed && e.fingerprint == *fingerprint {
                    let token = Token::generate(e.token.generation() + 1)?;
                    let lease_until = after(now, lease);
                    let lapsed_for = Some(now.duration_since(e.lease_until));
                    e.token = token;
                    e.lease_until = lease_until;
                    e.expires_at = e.expires_at.max(lease_until);
                    let point = e.point()?;
                    return Ok(Some(ClaimOutcome::Claimed(
                        Claim::takeover(token, lapsed_for).with_recovery_point(point),
                    )));
                }
                return Ok(Some(ClaimOutcome::Existing(e.record(now)?)));
            }
            self.inner.remove(&mut shard, id);
        }
        // Everything that can fail or panic comes before the slot is taken.
        let token = Token::generate(1)?;
        let entry = Entry {
            fingerprint: *fingerprint,
            token,
            lease_until: after(now, lease),
            expires_at: after(now, ttl.max(lease)),
            payload: None,
            size: ENTRY_OVERHEAD as u32,
            done: false,
            scope: scope.map(Box::new),
        };
        if self.inner.admit().is_err() {
            // Expired records that no sweep has removed yet must not make the store full:
            // this shard first (it is locked already), then every shard, when a record may
            // have expired since the last full sweep.
            self.inner.sweep(&mut shard, now);
            if self.inner.admit().is_err() {
                if !may_sweep {
                    return Err(StoreError::new(StoreErrorKind::Full));
                }
                // Never hold a shard while sweeping the others: two sweepers would deadlock.
                drop(shard);
                {
                    let _one = self
                        .inner
                        .full_sweep
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    let now = Instant::now();
                    if self.inner.may_have_expired(now) {
                        self.inner.sweep_all(now);
                    }
                }
                // The key may have changed while unlocked: claim from the start.
                return Ok(None);
            }
        }
        if let Some(scope) = scope {
            if !self.inner.admit_scope(scope) {
                self.inner.unadmit();
                if may_sweep && self.inner.may_have_expired(now) {
                    // Some of the scope's records may have expired unswept: sweep, retry.
                    drop(shard);
                    let _one = self
                        .inner
                        .full_sweep
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    self.inner.sweep_all(Instant::now());
                    return Ok(None);
                }
                return Err(StoreError::new(StoreErrorKind::QuotaExceeded));
            }
        }
        self.inner.note_expiry(entry.expires_at);
        shard.map.insert(*id, entry);
        Ok(Some(ClaimOutcome::Claimed(Claim::first(token))))
    }
}
