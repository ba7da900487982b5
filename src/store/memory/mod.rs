//! An in-process store: sharded maps, one lock scope per claim, a monotonic clock.
//!
//! Good for one process (tests, a single replica, a sidecar). Records die with the process,
//! and replicas do not share them: behind a load balancer use a networked store.
use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::num::NonZeroUsize;
use std::sync::Arc;

// Under `--cfg shuttle` the locks and atomics are shuttle's, so the model checker in
// tests/model explores their interleavings.
#[cfg(shuttle)]
use shuttle::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Mutex, MutexGuard,
};
#[cfg(not(shuttle))]
use std::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Mutex, MutexGuard,
};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
// tokio's Instant is the monotonic clock, and it follows `tokio::time::pause` in tests.
use tokio::time::Instant;

use super::{ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError, StoreErrorKind};
use crate::store::record::{Completion, Fingerprint, Record, RecordId, ScopeId, Token};
use crate::store::RecoveryPoint;

mod claim;
mod expiry;
mod map;
#[cfg(test)]
mod tests;

use expiry::after;

/// Fixed cost charged per record against `max_bytes`: the map slot (id and [`Entry`], 168
/// bytes) at the map's average load, rounded up.
const ENTRY_OVERHEAD: usize = 256;

/// An in-memory [`IdempotencyStore`]. Cloning shares the records.
///
/// Bounded by a record count and a byte budget. When either is reached, new claims fail with
/// [`StoreErrorKind::Full`] (the layer answers 503) and no live record is evicted. The byte
/// budget is checked when a claim is admitted; a completion is never refused, so the store can
/// overshoot by at most one response per claim in flight (each at most the layer's
/// `max_response_body`). Expired records are removed when touched, and each shard is swept
/// whole when an operation finds its last sweep older than the sweep interval.
///
/// ```
/// use std::num::NonZeroUsize;
/// use tower_idempotency::store::MemoryStore;
///
/// let store = MemoryStore::builder()
///     .with_max_records(NonZeroUsize::new(10_000).unwrap())
///     .with_max_bytes(NonZeroUsize::new(64 << 20).unwrap())
///     .build();
/// # drop(store);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Picks a record's shard; the maps hash with keys of their own, so a shard's records
    /// do not share their low hash bits.
    hasher: IdHash,
    records: AtomicUsize,
    bytes: AtomicUsize,
    max_records: usize,
    max_bytes: usize,
    sweep_interval: Duration,
    /// The time `min_expiry` counts from.
    epoch: Instant,
    /// A lower bound of every record's `expires_at`, in nanoseconds since `epoch`: until
    /// then no record has expired, so a full store has nothing to sweep. Exact after a full
    /// sweep, lowered by every write.
    min_expiry: AtomicU64,
    /// One full sweep at a time; the others wait for it and use what it freed.
    full_sweep: Mutex<()>,
    /// Records and bytes per scope, for records claimed with a scope. Locked after a shard.
    scopes: Mutex<HashMap<ScopeId, Usage>>,
    max_scope_records: usize,
    max_scope_bytes: usize,
    /// Records that saved a recovery point: all [`recoverable`](IdempotencyStore::recoverable)
    /// looks at. Entries that moved on leave it when next looked at.
    recoverable: Mutex<std::collections::HashSet<RecordId, IdHash>>,
}

/// Hashes record ids, which are SHA-256 outputs already: foldhash's folded multiply instead
/// of SipHash, a few instructions instead of a few hundred on every store call (callgrind,
/// bench/callgrind.sh). Seeded at random per map, so a client that grinds keys for colliding
/// ids cannot aim at buckets it cannot compute.
type IdHash = foldhash::fast::RandomState;

/// What one scope holds.
#[derive(Default)]
struct Usage {
    records: usize,
    bytes: usize,
}

struct Shard {
    map: HashMap<RecordId, Entry, IdHash>,
    last_sweep: Instant,
}

// Kept small (136 bytes; with its id, a map slot is 168): a store of a million records
// pays for every byte of it at the map's load factor. BENCHMARKS.md has bytes per record.
struct Entry {
    fingerprint: Fingerprint,
    token: Token,
    lease_until: Instant,
    expires_at: Instant,
    /// Completed: the answer in [`Completion::encode`]'s form, one exact-size allocation
    /// instead of a `HeaderMap` (a few hundred bytes for two headers) and a body. In
    /// progress: the recovery point in [`RecoveryPoint::encode`]'s form, if one was saved.
    /// One slot for both, so a record that never saves a point pays nothing for it.
    payload: Option<Bytes>,
    /// What the record counts against `max_bytes`.
    size: u32,
    /// Completed (in the padding after `size`: no extra bytes).
    done: bool,
    /// The scope it counts against, only when per-scope quotas are set.
    scope: Option<Box<ScopeId>>,
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_records: usize,
    max_bytes: usize,
    max_scope_records: usize,
    max_scope_bytes: usize,
    shards: usize,
    sweep_interval: Duration,
}

impl MemoryStoreBuilder {
    /// The most records kept at once (default 1,000,000).
    #[must_use]
    pub fn with_max_records(mut self, n: NonZeroUsize) -> Self {
        self.max_records = n.get();
        self
    }

    /// The byte budget for records, responses included (default 1 GiB).
    #[must_use]
    pub fn with_max_bytes(mut self, n: NonZeroUsize) -> Self {
        self.max_bytes = n.get();
        self
    }

    /// The most records one scope (tenant) may hold at once (default: no per-scope limit).
    ///
    /// Past it, that scope's new keys are refused with [`StoreErrorKind::QuotaExceeded`]
    /// (the layer answers 429) while other scopes still claim: one tenant cannot fill the
    /// store for everyone. Retries of the scope's existing records still replay.
    #[must_use]
    pub fn with_max_records_per_scope(mut self, n: NonZeroUsize) -> Self {
        self.max_scope_records = n.get();
        self
    }

    /// The byte budget of one scope, recorded answers included (default: no per-scope
    /// limit). Checked when a new key is claimed: a scope at or over it gets
    /// [`StoreErrorKind::QuotaExceeded`] until its records expire.
    #[must_use]
    pub fn with_max_bytes_per_scope(mut self, n: NonZeroUsize) -> Self {
        self.max_scope_bytes = n.get();
        self
    }

    /// The number of independently locked shards (default 64).
    #[must_use]
    pub fn with_shards(mut self, n: NonZeroUsize) -> Self {
        self.shards = n.get();
        self
    }

    /// How often a shard is swept of expired records (default 10 s).
    #[must_use]
    pub fn with_sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let now = Instant::now();
        let shards = (0..self.shards)
            .map(|_| {
                Mutex::new(Shard {
                    map: HashMap::with_hasher(IdHash::default()),
                    last_sweep: now,
                })
            })
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: IdHash::default(),
                records: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                max_records: self.max_records,
                max_bytes: self.max_bytes,
                sweep_interval: self.sweep_interval,
                epoch: now,
                min_expiry: AtomicU64::new(u64::MAX),
                full_sweep: Mutex::new(()),
                scopes: Mutex::new(HashMap::new()),
                max_scope_records: self.max_scope_records,
                max_scope_bytes: self.max_scope_bytes,
                recoverable: Mutex::new(std::collections::HashSet::with_hasher(IdHash::default())),
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("bytes", &self.inner.bytes.load(Ordering::Relaxed))
            .field("max_records", &self.inner.max_records)
            .field("max_bytes", &self.inner.max_bytes)
            .finish()
    }
}

impl MemoryStore {
    /// A store with the default limits: 1,000,000 records, 1 GiB.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the limits.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_records: 1_000_000,
            max_bytes: 1 << 30,
            max_scope_records: usize::MAX,
            max_scope_bytes: usize::MAX,
            shards: 64,
            sweep_interval: Duration::from_secs(10),
        }
    }

    /// The number of records held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.inner.records.load(Ordering::Relaxed)
    }

    /// `true` when no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every expired record now, and returns how many went.
    pub fn purge_expired(&self) -> usize {
        let _one = self
            .inner
            .full_sweep
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.inner.sweep_all(Instant::now())
    }

    /// The record's shard, locked, and the time read under its lock (one clock read per call).
    fn shard(&self, id: &RecordId) -> (MutexGuard<'_, Shard>, Instant) {
        let i = (self.inner.hasher.hash_one(id) as usize) % self.inner.shards.len();
        let mut shard = self.inner.shards[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if now.duration_since(shard.last_sweep) >= self.inner.sweep_interval {
            self.inner.sweep(&mut shard, now);
        }
        (shard, now)
    }
}
/// The answer as kept: encoded into one allocation of exactly its size. A copy, so the
/// caller's body, which may be a slice of a larger buffer (a frozen `BytesMut` can hold twice
/// its length), is never kept alive by the store and the byte count is true.
fn encode_exact(c: &Completion) -> Bytes {
    Bytes::from(c.encode().into_boxed_slice())
}
#[async_trait]
impl IdempotencyStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let r = request;
        self.claim_as(r.scope.copied(), r.id, r.fingerprint, r.lease, r.ttl)
    }

    fn claim_now(&self, request: &ClaimRequest<'_>) -> Option<Result<ClaimOutcome, StoreError>> {
        let r = request;
        Some(self.claim_as(r.scope.copied(), r.id, r.fingerprint, r.lease, r.ttl))
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let (mut shard, now) = self.shard(id);
        match shard.map.get_mut(id) {
            Some(e) if e.token == *token && !e.done && e.expires_at > now => {
                e.lease_until = after(now, lease);
                e.expires_at = e.expires_at.max(e.lease_until);
                Ok(())
            }
            _ => Err(StoreError::new(StoreErrorKind::Fenced)),
        }
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let kept = encode_exact(completion);
        // Malloc rounds each allocation up and adds a header: 16 bytes.
        let size = u32::try_from(ENTRY_OVERHEAD + kept.len() + 16).unwrap_or(u32::MAX);
        let (mut shard, now) = self.shard(id);
        match shard.map.get_mut(id) {
            Some(e) if e.token == *token && !e.done && e.expires_at > now => {
                let expires_at = after(now, ttl);
                let had_point = e.payload.is_some();
                self.inner.resize(e, size);
                e.payload = Some(kept);
                e.done = true;
                e.expires_at = expires_at;
                if had_point {
                    self.inner.unindex(id);
                }
                self.inner.note_expiry(expires_at);
                Ok(())
            }
            // Completed by this token already: a resend. Its answer stands.
            Some(e) if e.token == *token && e.expires_at > now => Ok(()),
            _ => Err(StoreError::new(StoreErrorKind::Fenced)),
        }
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let (mut shard, now) = self.shard(id);
        match shard.map.get_mut(id) {
            Some(e) if e.token == *token && !e.done && e.expires_at > now => {
                if e.payload.is_some() {
                    self.inner.unindex(id);
                }
                if token.generation() == 1 {
                    // A first claim: gone, so a retry runs as a new first attempt.
                    self.inner.remove(&mut shard, id);
                } else {
                    // A takeover: an earlier attempt may have done work, so the record stays
                    // (same retention, same counts) with its lease ended now, and the next
                    // claim takes over from it.
                    e.token = token.released();
                    e.lease_until = now;
                    // The point goes with the claim: the next attempt starts over.
                    e.payload = None;
                    self.inner.resize(e, ENTRY_OVERHEAD as u32);
                }
                Ok(())
            }
            // Gone (released by an earlier attempt, or expired): the key is free.
            None => Ok(()),
            Some(e) if e.expires_at <= now => Ok(()),
            // Kept by this token's earlier release: a resend.
            Some(e) if !e.done && e.token == token.released() => Ok(()),
            _ => Err(StoreError::new(StoreErrorKind::Fenced)),
        }
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        let kept = Bytes::from(point.encode().into_boxed_slice());
        let size = u32::try_from(ENTRY_OVERHEAD + kept.len() + 16).unwrap_or(u32::MAX);
        let (mut shard, now) = self.shard(id);
        match shard.map.get_mut(id) {
            Some(e) if e.token == *token && !e.done && e.expires_at > now => {
                self.inner.resize(e, size);
                e.payload = Some(kept);
                self.inner.index(*id);
                Ok(())
            }
            _ => Err(StoreError::new(StoreErrorKind::Fenced)),
        }
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        let ids: Vec<RecordId> = self.inner.indexed().iter().copied().collect();
        let mut found = Vec::new();
        for id in ids {
            let (shard, now) = self.shard(&id);
            match shard.map.get(&id) {
                Some(e) if e.expires_at > now && !e.done && e.payload.is_some() => {
                    if e.lease_until <= now {
                        found.push((e.lease_until, id, e.record(now)?));
                    }
                }
                // Completed, released, removed or expired: no longer indexed. Under the
                // shard lock, so a point saved meanwhile keeps its entry.
                _ => self.inner.unindex(&id),
            }
        }
        // The longest abandoned first.
        found.sort_by_key(|(lapsed_at, _, _)| *lapsed_at);
        Ok(found
            .into_iter()
            .take(limit)
            .map(|(_, id, r)| (id, r))
            .collect())
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let (shard, now) = self.shard(id);
        shard
            .map
            .get(id)
            .filter(|e| e.expires_at > now)
            .map(|e| e.record(now).map(|r| r.with_expires_in(e.expires_at - now)))
            .transpose()
    }
}

#[async_trait]
impl super::IdempotencyAdmin for MemoryStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<super::RecordInfo>, StoreError> {
        let (shard, now) = self.shard(id);
        shard
            .map
            .get(id)
            .filter(|e| e.expires_at > now)
            .map(|e| Ok(super::RecordInfo::new(&e.record(now)?, e.expires_at - now)))
            .transpose()
    }

    async fn force_release(&self, id: &RecordId) -> Result<super::Removal, StoreError> {
        self.remove_if(id, |e| !e.done)
    }

    async fn delete(&self, id: &RecordId) -> Result<super::Removal, StoreError> {
        self.remove_if(id, |e| e.done)
    }
}

impl MemoryStore {
    /// Removes the live record of `id` if `wanted` says so, under the shard lock.
    fn remove_if(
        &self,
        id: &RecordId,
        wanted: impl FnOnce(&Entry) -> bool,
    ) -> Result<super::Removal, StoreError> {
        let (mut shard, now) = self.shard(id);
        match shard.map.get(id).filter(|e| e.expires_at > now) {
            None => Ok(super::Removal::Absent),
            Some(e) if wanted(e) => {
                self.inner.remove(&mut shard, id);
                Ok(super::Removal::Removed)
            }
            Some(_) => Ok(super::Removal::Refused),
        }
    }
}
