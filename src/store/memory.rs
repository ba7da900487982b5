//! An in-process store: sharded maps, one lock scope per claim, a monotonic clock.
//!
//! Good for one process (tests, a single replica, a sidecar). Records die with the process,
//! and replicas do not share them: behind a load balancer use a networked store.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
// tokio's Instant is the monotonic clock, and it follows `tokio::time::pause` in tests.
use tokio::time::Instant;

use super::{Claim, ClaimOutcome, IdempotencyStore, StoreError, StoreErrorKind};
use crate::record::{Completion, Fingerprint, Record, RecordId, RecordState, Token};

/// Fixed cost charged per record against `max_bytes`: the map slot, ids, fingerprint, token.
const ENTRY_OVERHEAD: usize = 160;

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
///     .max_records(NonZeroUsize::new(10_000).unwrap())
///     .max_bytes(NonZeroUsize::new(64 << 20).unwrap())
///     .build();
/// # drop(store);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: std::collections::hash_map::RandomState,
    records: AtomicUsize,
    bytes: AtomicUsize,
    max_records: usize,
    max_bytes: usize,
    sweep_interval: Duration,
}

struct Shard {
    map: HashMap<RecordId, Entry>,
    last_sweep: Instant,
}

struct Entry {
    fingerprint: Fingerprint,
    token: Token,
    lease_until: Instant,
    expires_at: Instant,
    completion: Option<Completion>,
    size: usize,
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_records: usize,
    max_bytes: usize,
    shards: usize,
    sweep_interval: Duration,
}

impl MemoryStoreBuilder {
    /// The most records kept at once (default 1,000,000).
    #[must_use]
    pub fn max_records(mut self, n: NonZeroUsize) -> Self {
        self.max_records = n.get();
        self
    }

    /// The byte budget for records, responses included (default 1 GiB).
    #[must_use]
    pub fn max_bytes(mut self, n: NonZeroUsize) -> Self {
        self.max_bytes = n.get();
        self
    }

    /// The number of independently locked shards (default 64).
    #[must_use]
    pub fn shards(mut self, n: NonZeroUsize) -> Self {
        self.shards = n.get();
        self
    }

    /// How often a shard is swept of expired records (default 10 s).
    #[must_use]
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let now = Instant::now();
        let shards = (0..self.shards)
            .map(|_| {
                Mutex::new(Shard {
                    map: HashMap::new(),
                    last_sweep: now,
                })
            })
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: Default::default(),
                records: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                max_records: self.max_records,
                max_bytes: self.max_bytes,
                sweep_interval: self.sweep_interval,
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
        let now = Instant::now();
        (0..self.inner.shards.len())
            .map(|i| {
                let mut shard = lock(&self.inner.shards[i]);
                self.inner.sweep(&mut shard, now)
            })
            .sum()
    }

    fn shard(&self, id: &RecordId) -> MutexGuard<'_, Shard> {
        let i = (self.inner.hasher.hash_one(id) as usize) % self.inner.shards.len();
        let mut shard = lock(&self.inner.shards[i]);
        let now = Instant::now();
        if now.duration_since(shard.last_sweep) >= self.inner.sweep_interval {
            self.inner.sweep(&mut shard, now);
        }
        shard
    }
}

/// A poisoned shard only means a panic elsewhere while holding it; every mutation below
/// keeps the entry consistent before it can panic, so the data is still sound.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn sweep(&self, shard: &mut Shard, now: Instant) -> usize {
        shard.last_sweep = now;
        let before = shard.map.len();
        let mut freed = 0;
        shard.map.retain(|_, e| {
            let keep = e.expires_at > now;
            if !keep {
                freed += e.size;
            }
            keep
        });
        let removed = before - shard.map.len();
        self.records.fetch_sub(removed, Ordering::Relaxed);
        self.bytes.fetch_sub(freed, Ordering::Relaxed);
        removed
    }

    fn remove(&self, shard: &mut Shard, id: &RecordId) {
        if let Some(e) = shard.map.remove(id) {
            self.records.fetch_sub(1, Ordering::Relaxed);
            self.bytes.fetch_sub(e.size, Ordering::Relaxed);
        }
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
    fn record(&self, now: Instant) -> Record {
        let state = match &self.completion {
            Some(c) => RecordState::Completed(c.clone()),
            None => RecordState::InProgress {
                lease_remaining: self.lease_until.saturating_duration_since(now),
            },
        };
        Record {
            fingerprint: self.fingerprint,
            generation: self.token.generation(),
            state,
        }
    }
}

fn completion_size(c: &Completion) -> usize {
    match c {
        Completion::Tombstone { .. } => 0,
        Completion::Response(r) => {
            let headers = |h: &http::HeaderMap| -> usize {
                h.iter().map(|(n, v)| n.as_str().len() + v.len() + 16).sum()
            };
            r.body.len() + headers(&r.headers) + r.trailers.as_ref().map_or(0, headers)
        }
    }
}

#[async_trait]
impl IdempotencyStore for MemoryStore {
    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let mut shard = self.shard(id);
        let now = Instant::now();
        if let Some(e) = shard.map.get_mut(id) {
            if e.expires_at > now {
                let lapsed = e.completion.is_none() && e.lease_until <= now;
                if lapsed && e.fingerprint == *fingerprint {
                    let token = Token::new(e.token.generation() + 1);
                    e.token = token;
                    e.lease_until = now + lease;
                    e.expires_at = e.expires_at.max(now + lease);
                    return Ok(ClaimOutcome::Claimed(Claim {
                        token,
                        takeover: true,
                    }));
                }
                return Ok(ClaimOutcome::Existing(e.record(now)));
            }
            self.inner.remove(&mut shard, id);
        }
        self.inner.admit()?;
        let token = Token::new(1);
        shard.map.insert(
            *id,
            Entry {
                fingerprint: *fingerprint,
                token,
                lease_until: now + lease,
                expires_at: now + ttl.max(lease),
                completion: None,
                size: ENTRY_OVERHEAD,
            },
        );
        Ok(ClaimOutcome::Claimed(Claim {
            token,
            takeover: false,
        }))
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let mut shard = self.shard(id);
        let now = Instant::now();
        match shard.map.get_mut(id) {
            Some(e) if e.token == *token && e.completion.is_none() && e.expires_at > now => {
                e.lease_until = now + lease;
                e.expires_at = e.expires_at.max(now + lease);
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
        let mut shard = self.shard(id);
        let now = Instant::now();
        match shard.map.get_mut(id) {
            Some(e) if e.token == *token && e.completion.is_none() && e.expires_at > now => {
                let size = ENTRY_OVERHEAD + completion_size(completion);
                self.inner.bytes.fetch_add(size, Ordering::Relaxed);
                self.inner.bytes.fetch_sub(e.size, Ordering::Relaxed);
                e.size = size;
                e.completion = Some(completion.clone());
                e.expires_at = now + ttl;
                Ok(())
            }
            _ => Err(StoreError::new(StoreErrorKind::Fenced)),
        }
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let mut shard = self.shard(id);
        let now = Instant::now();
        match shard.map.get(id) {
            Some(e) if e.token == *token && e.completion.is_none() && e.expires_at > now => {
                self.inner.remove(&mut shard, id);
                Ok(())
            }
            _ => Err(StoreError::new(StoreErrorKind::Fenced)),
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let shard = self.shard(id);
        let now = Instant::now();
        Ok(shard
            .map
            .get(id)
            .filter(|e| e.expires_at > now)
            .map(|e| e.record(now)))
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
        let ClaimOutcome::Claimed(c) = store.claim(&id, &fp(), ttl, ttl).await.unwrap() else {
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
            .shards(NonZeroUsize::new(1).unwrap())
            .sweep_interval(Duration::from_secs(5))
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
        assert_eq!(before, ENTRY_OVERHEAD, "their bytes were returned too");
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
}
