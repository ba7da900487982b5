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

use super::{Claim, ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError, StoreErrorKind};
use crate::record::{Completion, Fingerprint, Record, RecordId, RecordState, ScopeId, Token};
use crate::recovery::RecoveryPoint;

/// Fixed cost charged per record against `max_bytes`: the map slot (id and [`Entry`], 168
/// bytes) at the map's average load, rounded up.
const ENTRY_OVERHEAD: usize = 256;

/// The longest lease or TTL the store keeps: 100 years stands for "forever". Longer ones
/// (`Duration::MAX`) are cut to it, so an `Instant` sum can never overflow and panic.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d`, with `d` capped at [`MAX_SPAN`]: never panics.
fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d.min(MAX_SPAN)).unwrap_or(now)
}

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

// A poisoned lock only means a panic elsewhere while holding it; every mutation below
// keeps the entry consistent before it can panic, so the data is still sound.

impl Inner {
    fn sweep(&self, shard: &mut Shard, now: Instant) -> usize {
        shard.last_sweep = now;
        let before = shard.map.len();
        let mut freed = 0;
        let mut scoped = Vec::new();
        shard.map.retain(|_, e| {
            let keep = e.expires_at > now;
            if !keep {
                freed += e.size as usize;
                if let Some(scope) = e.scope.take() {
                    scoped.push((*scope, e.size as usize));
                }
            }
            keep
        });
        let removed = before - shard.map.len();
        self.records.fetch_sub(removed, Ordering::Relaxed);
        self.bytes.fetch_sub(freed, Ordering::Relaxed);
        if !scoped.is_empty() {
            let mut scopes = self.scopes();
            for (scope, size) in scoped {
                Self::unscope(&mut scopes, scope, size);
            }
        }
        removed
    }

    /// Sweeps every shard, one at a time, and makes `min_expiry` exact again. The caller
    /// holds `full_sweep`.
    fn sweep_all(&self, now: Instant) -> usize {
        // Reset first: writes during the sweep lower it again, and are kept.
        self.min_expiry.store(u64::MAX, Ordering::Release);
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            removed += self.sweep(&mut shard, now);
            if let Some(min) = shard.map.values().map(|e| e.expires_at).min() {
                self.note_expiry(min);
            }
        }
        removed
    }

    /// Lowers `min_expiry` to `at` if it is earlier.
    fn note_expiry(&self, at: Instant) {
        let nanos = at.saturating_duration_since(self.epoch).as_nanos();
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        self.min_expiry.fetch_min(nanos, Ordering::AcqRel);
    }

    /// Whether some record may have expired by `now` (and a full sweep could free room).
    fn may_have_expired(&self, now: Instant) -> bool {
        let nanos = now.saturating_duration_since(self.epoch).as_nanos();
        u64::try_from(nanos).unwrap_or(u64::MAX) >= self.min_expiry.load(Ordering::Acquire)
    }

    fn remove(&self, shard: &mut Shard, id: &RecordId) {
        if let Some(e) = shard.map.remove(id) {
            self.records.fetch_sub(1, Ordering::Relaxed);
            self.bytes.fetch_sub(e.size as usize, Ordering::Relaxed);
            if let Some(scope) = e.scope {
                Self::unscope(&mut self.scopes(), *scope, e.size as usize);
            }
        }
    }

    /// Sets a live record's size, keeping the store's and its scope's byte counts.
    fn resize(&self, e: &mut Entry, size: u32) {
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
    fn indexed(&self) -> MutexGuard<'_, std::collections::HashSet<RecordId, IdHash>> {
        self.recoverable.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn index(&self, id: RecordId) {
        self.indexed().insert(id);
    }

    fn unindex(&self, id: &RecordId) {
        self.indexed().remove(id);
    }

    fn scopes(&self) -> MutexGuard<'_, HashMap<ScopeId, Usage>> {
        self.scopes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one record of `size` bytes off `scope`'s usage.
    fn unscope(scopes: &mut HashMap<ScopeId, Usage>, scope: ScopeId, size: usize) {
        if let Some(u) = scopes.get_mut(&scope) {
            u.records = u.records.saturating_sub(1);
            u.bytes = u.bytes.saturating_sub(size);
            if u.records == 0 {
                scopes.remove(&scope);
            }
        }
    }

    /// Reserves one more record for `scope`, or refuses: the scope is at its quota.
    fn admit_scope(&self, scope: ScopeId) -> bool {
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
    fn unadmit(&self) {
        self.records.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(ENTRY_OVERHEAD, Ordering::Relaxed);
    }

    /// Reserves room for one more record, or refuses. Never evicts.
    fn admit(&self) -> Result<(), StoreError> {
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
    fn record(&self, now: Instant) -> Result<Record, StoreError> {
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
    fn point(&self) -> Result<Option<RecoveryPoint>, StoreError> {
        match &self.payload {
            Some(p) if !self.done => RecoveryPoint::decode(p.clone())
                .map(Some)
                .map_err(|e| StoreError::with_source(StoreErrorKind::Corrupt, e)),
            _ => Ok(None),
        }
    }
}

/// The answer as kept: encoded into one allocation of exactly its size. A copy, so the
/// caller's body, which may be a slice of a larger buffer (a frozen `BytesMut` can hold twice
/// its length), is never kept alive by the store and the byte count is true.
fn encode_exact(c: &Completion) -> Bytes {
    Bytes::from(c.encode().into_boxed_slice())
}

impl MemoryStore {
    fn claim_as(
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

#[async_trait]
impl IdempotencyStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let r = request;
        self.claim_as(r.scope.copied(), r.id, r.fingerprint, r.lease, r.ttl)
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
            .map(|e| e.record(now))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> Fingerprint {
        Fingerprint::from_bytes([1; 32])
    }

    async fn completed(store: &MemoryStore, key: &str, ttl: Duration) {
        let id = RecordId::new(None, key);
        let ClaimOutcome::Claimed(c) = store
            .claim(&ClaimRequest::new(&id, &fp(), ttl, ttl))
            .await
            .unwrap()
        else {
            panic!("fresh key")
        };
        let done = Completion::Tombstone {
            status: http::StatusCode::OK,
        };
        store.complete(&id, &c.token, &done, ttl).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_swept_when_a_shard_is_next_touched() {
        let store = MemoryStore::builder()
            .with_shards(NonZeroUsize::new(1).unwrap())
            .with_sweep_interval(Duration::from_secs(5))
            .build();
        for key in ["a", "b", "c"] {
            completed(&store, key, Duration::from_secs(1)).await;
        }
        assert_eq!(store.len(), 3);
        tokio::time::advance(Duration::from_secs(2)).await;
        // Expired but not yet swept: the interval has not passed.
        assert_eq!(store.len(), 3);
        assert!(store
            .get(&RecordId::new(None, "a"))
            .await
            .unwrap()
            .is_none());
        tokio::time::advance(Duration::from_secs(4)).await;
        completed(&store, "d", Duration::from_secs(60)).await;
        assert_eq!(store.len(), 1, "the touch swept the expired three");
        let before = store.inner.bytes.load(Ordering::Relaxed);
        // One completed tombstone: the slot, its 4 encoded bytes and their malloc header.
        assert_eq!(
            before,
            ENTRY_OVERHEAD + 4 + 16,
            "their bytes were returned too"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn purge_expired_removes_only_expired_records() {
        let store = MemoryStore::new();
        completed(&store, "short", Duration::from_secs(1)).await;
        completed(&store, "long", Duration::from_secs(60)).await;
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(store.purge_expired(), 1);
        assert_eq!(store.len(), 1);
        assert!(store
            .get(&RecordId::new(None, "long"))
            .await
            .unwrap()
            .is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn expired_unswept_records_never_make_the_store_full() {
        // No periodic sweep will run: only the admission path can free the slots.
        let store = MemoryStore::builder()
            .with_max_records(NonZeroUsize::new(8).unwrap())
            .with_shards(NonZeroUsize::new(16).unwrap())
            .with_sweep_interval(Duration::from_secs(3600))
            .build();
        for i in 0..8 {
            completed(&store, &format!("old-{i}"), Duration::from_secs(1)).await;
        }
        let fresh = RecordId::new(None, "fresh");
        assert_eq!(
            store
                .claim(&ClaimRequest::new(
                    &fresh,
                    &fp(),
                    Duration::from_secs(1),
                    Duration::from_secs(1)
                ))
                .await
                .unwrap_err()
                .kind(),
            StoreErrorKind::Full,
            "live records do fill it"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(store.len(), 8, "expired, not yet swept");
        for i in 0..8 {
            let id = RecordId::new(None, &format!("new-{i}"));
            let outcome = store
                .claim(&ClaimRequest::new(
                    &id,
                    &fp(),
                    Duration::from_secs(60),
                    Duration::from_secs(60),
                ))
                .await
                .expect("expired records make room");
            assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
        }
        assert_eq!(store.len(), 8);
        // Full of live records again: refused, and the refusal evicted nothing.
        assert_eq!(
            store
                .claim(&ClaimRequest::new(
                    &fresh,
                    &fp(),
                    Duration::from_secs(1),
                    Duration::from_secs(1)
                ))
                .await
                .unwrap_err()
                .kind(),
            StoreErrorKind::Full
        );
        assert_eq!(store.len(), 8);
    }

    #[tokio::test(start_paused = true)]
    async fn keep_forever_durations_neither_panic_nor_leak_a_slot() {
        let store = MemoryStore::builder()
            .with_max_records(NonZeroUsize::new(1).unwrap())
            .build();
        let forever = Duration::MAX;
        for key in ["a", "b", "c"] {
            let id = RecordId::new(None, key);
            let ClaimOutcome::Claimed(c) = store
                .claim(&ClaimRequest::new(&id, &fp(), forever, forever))
                .await
                .unwrap()
            else {
                panic!("fresh key")
            };
            store.extend(&id, &c.token, forever).await.unwrap();
            store.release(&id, &c.token).await.unwrap();
        }
        let id = RecordId::new(None, "kept");
        let ClaimOutcome::Claimed(c) = store
            .claim(&ClaimRequest::new(&id, &fp(), forever, forever))
            .await
            .unwrap()
        else {
            panic!("the slot came back")
        };
        let done = Completion::Tombstone {
            status: http::StatusCode::OK,
        };
        store.complete(&id, &c.token, &done, forever).await.unwrap();
        tokio::time::advance(Duration::from_secs(50 * 365 * 24 * 3600)).await;
        assert!(store.get(&id).await.unwrap().is_some(), "kept for decades");
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_takeover_keeps_its_slot_and_quota_until_removed() {
        use crate::store::{IdempotencyAdmin, Removal};
        let store = MemoryStore::builder()
            .with_max_records_per_scope(NonZeroUsize::new(1).unwrap())
            .build();
        let scope = ScopeId::new(Some("t"));
        let id = RecordId::new(Some("t"), "k");
        let (lease, ttl) = (Duration::from_secs(1), Duration::from_secs(60));
        store
            .claim(&ClaimRequest::new(&id, &fp(), lease, ttl).in_scope(&scope))
            .await
            .unwrap();
        tokio::time::advance(lease * 2).await;
        let ClaimOutcome::Claimed(c) = store
            .claim(&ClaimRequest::new(&id, &fp(), lease, ttl).in_scope(&scope))
            .await
            .unwrap()
        else {
            panic!("the lapsed lease is taken over")
        };
        assert_eq!(c.token.generation(), 2);
        store.release(&id, &c.token).await.unwrap();
        assert_eq!(store.len(), 1, "kept");
        assert_eq!(store.inner.bytes.load(Ordering::Relaxed), ENTRY_OVERHEAD);
        let other = RecordId::new(Some("t"), "other");
        let refused = store
            .claim(&ClaimRequest::new(&other, &fp(), lease, ttl).in_scope(&scope))
            .await
            .unwrap_err();
        assert_eq!(
            refused.kind(),
            StoreErrorKind::QuotaExceeded,
            "the kept record still counts against its scope"
        );
        assert_eq!(store.force_release(&id).await.unwrap(), Removal::Removed);
        assert_eq!(
            (store.len(), store.inner.bytes.load(Ordering::Relaxed)),
            (0, 0)
        );
        assert!(matches!(
            store
                .claim(&ClaimRequest::new(&other, &fp(), lease, ttl).in_scope(&scope))
                .await
                .unwrap(),
            ClaimOutcome::Claimed(_)
        ));
    }

    #[tokio::test]
    async fn a_failed_random_source_fails_the_claim_and_takes_no_slot() {
        let store = MemoryStore::builder()
            .with_max_records(NonZeroUsize::new(1).unwrap())
            .build();
        let id = RecordId::new(None, "k");
        crate::record::FAIL_RANDOM.with(|f| f.set(true));
        let r = store
            .claim(&ClaimRequest::new(
                &id,
                &fp(),
                Duration::from_secs(1),
                Duration::from_secs(1),
            ))
            .await;
        crate::record::FAIL_RANDOM.with(|f| f.set(false));
        assert_eq!(r.unwrap_err().kind(), StoreErrorKind::Unavailable);
        assert!(store.is_empty());
        assert!(matches!(
            store
                .claim(&ClaimRequest::new(
                    &id,
                    &fp(),
                    Duration::from_secs(1),
                    Duration::from_secs(1)
                ))
                .await
                .unwrap(),
            ClaimOutcome::Claimed(_)
        ));
    }
}
