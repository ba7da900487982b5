//! [`LocalTier`]: completed records served from the process.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::broadcast;
use tokio::time::Instant;

use super::record::{Completion, Record, RecordId, RecordState, Token};
use super::{
    ClaimOutcome, ClaimRequest, IdempotencyAdmin, IdempotencyStore, RecordInfo, RecoveryPoint,
    Removal, StoreError,
};

/// What a store's invalidation feed says ([`IdempotencyStore::invalidations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation {
    /// An operator removed this completed record (on any process).
    Removed(RecordId),
    /// The feed is interrupted: removals may go unheard until [`Live`](Self::Live).
    Lost,
    /// The feed (re)started: every removal from now on is sent.
    Live,
}

/// Shards of the map: claims of different records rarely wait for one lock.
const SHARDS: usize = 16;

/// The defaults: 10,000 records, 64 MiB, 60 s.
const DEFAULT_RECORDS: usize = 10_000;
const DEFAULT_BYTES: usize = 64 << 20;
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(60);

/// How long learning a record may wait for the store's `get`.
const LEARN_TIMEOUT: Duration = Duration::from_secs(5);

/// The ticks on which a store's feed checks its connection (Redis `PING`, Postgres an empty
/// query), each check to answer within the store's timeout. A connection that dies without a
/// word (a partition, a stalled proxy) is found within a tick plus that timeout (2 s with the
/// default 1 s timeout); the tiers then forget everything. That is the longest a removal can
/// go unheard. The first tick is one period away: the feed has just (re)connected.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn feed_heartbeat() -> tokio::time::Interval {
    const EVERY: Duration = Duration::from_secs(1);
    let mut beat = tokio::time::interval_at(Instant::now() + EVERY, EVERY);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    beat
}

/// An entry's bookkeeping beyond its bytes: the map's slot, the record's fields.
const ENTRY_OVERHEAD: usize = 256;

/// An [`IdempotencyStore`] that serves completed records from the process.
///
/// A completed record never changes until it expires or an operator deletes it, yet every
/// replay on a networked store is a round trip. A `LocalTier` in front of the store keeps the
/// completed records it has read, in a bounded least-recently-used map, and answers a claim of
/// one without calling the store. The layer then applies every check as on a stored record:
/// the fingerprint, the Vary guard, the scope (part of the record id).
///
/// What bounds an entry's life:
/// - the record's own expiry: an entry is kept no longer than the TTL the store reported
///   when it was read, counted from before the read, so it is never served past it;
/// - an operator's delete, on any process: the store's invalidation feed
///   ([`IdempotencyStore::invalidations`]: Redis pub/sub on a single node or Sentinel,
///   Postgres `LISTEN`/`NOTIFY` on a store built with `connect`) drops it everywhere as the
///   notification arrives. While the feed is down the tier serves nothing from memory.
///   Both feeds check their connection every second: one that dies without a word (a
///   partition, a stalled proxy) is noticed within that second plus the store's timeout,
///   the longest a removal can go unheard, and the tier then forgets everything;
/// - [`with_max_age`](LocalTier::with_max_age) (default 60 s), always: the staleness bound
///   where there is no feed (Redis Cluster, a pool you built, a custom store).
///
/// Only what the store answered is kept: a record this process completed is learned by the
/// next claim that finds it (one `get` per record and process), since a handler that recorded
/// its own answer may have stored another one than it returned.
///
/// ```
/// use std::{num::NonZeroUsize, time::Duration};
/// use tower_idempotency::store::{LocalTier, MemoryStore};
/// use tower_idempotency::IdempotencyLayer;
///
/// // With Redis or Postgres in place of the memory store.
/// let store = LocalTier::new(MemoryStore::new())
///     .with_max_records(NonZeroUsize::new(50_000).unwrap())
///     .with_max_bytes(NonZeroUsize::new(256 << 20).unwrap())
///     .with_max_age(Duration::from_secs(30));
/// let layer = IdempotencyLayer::new(store).unscoped();
/// # drop(layer);
/// ```
pub struct LocalTier<S> {
    inner: Arc<S>,
    cache: Arc<Cache>,
    /// The feed's task, started by the first claim (a runtime is needed).
    feed: OnceLock<()>,
}

impl<S> std::fmt::Debug for LocalTier<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTier")
            .field("max_records", &self.cache.max_records)
            .field("max_bytes", &self.cache.max_bytes)
            .field("max_age", &self.cache.max_age)
            .finish_non_exhaustive()
    }
}

struct Entry {
    record: Record,
    until: Instant,
    bytes: usize,
}

struct Shard {
    map: lru::LruCache<RecordId, Entry, foldhash::fast::RandomState>,
    bytes: usize,
}

struct Cache {
    shards: Vec<Mutex<Shard>>,
    max_records: usize,
    max_bytes: usize,
    max_age: Duration,
    /// Bumped by every invalidation: a read that started before one is not kept.
    epoch: AtomicU64,
    /// `false` while the store's feed is down: nothing is served or kept.
    trusted: AtomicBool,
    /// Records being read to be kept, so a burst of replays reads each once.
    learning: Mutex<std::collections::HashSet<RecordId, foldhash::fast::RandomState>>,
}

impl Cache {
    /// Picked by a byte of the id's hash, not of its scope prefix: one scope's records (an
    /// unscoped layer's are all one scope's) spread over every shard.
    fn shard(&self, id: &RecordId) -> MutexGuard<'_, Shard> {
        let i = usize::from(id.as_bytes()[RecordId::SCOPE_PREFIX]) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live entry of `id`; an expired one is dropped.
    fn get(&self, id: &RecordId) -> Option<Record> {
        if !self.trusted.load(Ordering::Acquire) {
            return None;
        }
        let mut shard = self.shard(id);
        let now = Instant::now();
        match shard.map.get(id) {
            Some(e) if e.until > now => return Some(e.record.clone()),
            Some(_) => {}
            None => return None,
        }
        if let Some(gone) = shard.map.pop(id) {
            shard.bytes -= gone.bytes;
        }
        None
    }

    fn insert(&self, id: RecordId, record: Record, until: Instant, epoch: u64) {
        let bytes = ENTRY_OVERHEAD + size_of(&record);
        let per_shard = (self.max_bytes / SHARDS).max(1);
        if bytes > per_shard {
            return;
        }
        let mut shard = self.shard(&id);
        // Checked under the shard's lock, which every invalidation takes after bumping the
        // epoch: a removal that came in during the read wins.
        if !self.trusted.load(Ordering::Acquire) || self.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        if let Some(old) = shard.map.put(
            id,
            Entry {
                record,
                until,
                bytes,
            },
        ) {
            shard.bytes -= old.bytes;
        }
        shard.bytes += bytes;
        let max_records = (self.max_records / SHARDS).max(1);
        while shard.bytes > per_shard || shard.map.len() > max_records {
            match shard.map.pop_lru() {
                Some((_, e)) => shard.bytes -= e.bytes,
                None => break,
            }
        }
    }

    fn remove(&self, id: &RecordId) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        let mut shard = self.shard(id);
        if let Some(gone) = shard.map.pop(id) {
            shard.bytes -= gone.bytes;
        }
    }

    fn clear(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.map.clear();
            shard.bytes = 0;
        }
    }

    fn hear(&self, message: Invalidation) {
        match message {
            Invalidation::Removed(id) => self.remove(&id),
            Invalidation::Lost => {
                self.trusted.store(false, Ordering::Release);
                self.clear();
            }
            Invalidation::Live => {
                self.clear();
                self.trusted.store(true, Ordering::Release);
            }
        }
    }
}

/// The bytes a record holds beyond its fixed fields.
fn size_of(record: &Record) -> usize {
    let headers = |h: &http::HeaderMap| {
        h.iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 16)
            .sum::<usize>()
    };
    match &record.state {
        RecordState::Completed(Completion::Response(r)) => {
            r.body.len() + headers(&r.headers) + r.trailers.as_ref().map_or(0, headers)
        }
        _ => 0,
    }
}

impl<S: IdempotencyStore> LocalTier<S> {
    /// A tier of at most 10,000 records and 64 MiB in front of `store`, each kept at most
    /// 60 s.
    pub fn new(store: S) -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: lru::LruCache::unbounded_with_hasher(Default::default()),
                    bytes: 0,
                })
            })
            .collect();
        Self {
            inner: Arc::new(store),
            cache: Arc::new(Cache {
                shards,
                max_records: DEFAULT_RECORDS,
                max_bytes: DEFAULT_BYTES,
                max_age: DEFAULT_MAX_AGE,
                epoch: AtomicU64::new(0),
                // Trusted until a feed says otherwise; a store with a feed starts untrusted
                // (see `start_feed`).
                trusted: AtomicBool::new(true),
                learning: Mutex::default(),
            }),
            feed: OnceLock::new(),
        }
    }

    /// Keeps at most `n` records (spread over 16 shards, each holding a sixteenth).
    #[must_use]
    pub fn with_max_records(self, n: NonZeroUsize) -> Self {
        self.configure(|c| c.max_records = n.get())
    }

    /// Keeps at most `bytes` of records (bodies, headers, trailers and a fixed 256 bytes each),
    /// a sixteenth in each of 16 shards: a record over a sixteenth of `bytes` is not kept.
    #[must_use]
    pub fn with_max_bytes(self, bytes: NonZeroUsize) -> Self {
        self.configure(|c| c.max_bytes = bytes.get())
    }

    /// Serves an entry at most `age` after it was read from the store: the staleness bound
    /// where the store has no invalidation feed.
    #[must_use]
    pub fn with_max_age(self, age: Duration) -> Self {
        self.configure(|c| c.max_age = age)
    }

    fn configure(mut self, f: impl FnOnce(&mut Cache)) -> Self {
        f(Arc::get_mut(&mut self.cache).expect("configured before use"));
        self
    }

    /// The store behind the tier.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Starts following the store's invalidations, once, from inside the runtime.
    fn start_feed(&self) {
        self.feed.get_or_init(|| {
            let Some(mut feed) = self.inner.invalidations() else {
                return;
            };
            // Nothing is served until the feed says it is listening.
            self.cache.trusted.store(false, Ordering::Release);
            let cache = Arc::downgrade(&self.cache);
            tokio::spawn(async move {
                loop {
                    let (message, closed) = match feed.recv().await {
                        Ok(m) => (m, false),
                        // Removals were missed: forget everything, and go on listening.
                        Err(broadcast::error::RecvError::Lagged(_)) => (Invalidation::Live, false),
                        Err(broadcast::error::RecvError::Closed) => (Invalidation::Lost, true),
                    };
                    let Some(cache) = cache.upgrade() else { return };
                    cache.hear(message);
                    if closed {
                        // The store is gone: so is anything to hear.
                        return;
                    }
                }
            });
        });
    }

    /// Reads `id` from the store to keep it, on a task of its own: the replay that found it
    /// does not wait.
    fn learn(&self, id: RecordId) {
        let cache = &self.cache;
        if !cache.trusted.load(Ordering::Acquire) {
            return;
        }
        if !cache
            .learning
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id)
        {
            return;
        }
        let (inner, cache) = (self.inner.clone(), self.cache.clone());
        tokio::spawn(async move {
            let epoch = cache.epoch.load(Ordering::Acquire);
            // Before the read: the store's TTL counts from a later moment.
            let sent = Instant::now();
            // Bounded: a read that never returns must not hold `id` in `learning` for ever
            // (the tier would then never learn it). A late answer is as safe as a quick one:
            // its entry counts from `sent`, and the epoch check drops it if a removal came.
            let read = tokio::time::timeout(LEARN_TIMEOUT, inner.get(&id)).await;
            if let Ok(Ok(Some(record))) = read {
                if let (RecordState::Completed(_), Some(left)) = (&record.state, record.expires_in)
                {
                    let until = sent + left.min(cache.max_age);
                    cache.insert(id, record, until, epoch);
                }
            }
            cache
                .learning
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        });
    }
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for LocalTier<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        if let Some(held) = self.claim_now(request) {
            return held;
        }
        self.start_feed();
        let outcome = self.inner.claim(request).await?;
        if let ClaimOutcome::Existing(record) = &outcome {
            if matches!(record.state, RecordState::Completed(_)) {
                self.learn(*request.id);
            }
        }
        Ok(outcome)
    }

    /// A record the tier holds; anything else goes to `claim`, which asks the store and
    /// learns what it answers.
    fn claim_now(&self, request: &ClaimRequest<'_>) -> Option<Result<ClaimOutcome, StoreError>> {
        self.cache
            .get(request.id)
            .map(|record| Ok(ClaimOutcome::Existing(record)))
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.extend(id, token, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(id, token, completion, ttl).await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.inner.release(id, token).await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        self.inner.save_recovery_point(id, token, point).await
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        self.inner.recoverable(limit).await
    }

    fn invalidations(&self) -> Option<broadcast::Receiver<Invalidation>> {
        self.inner.invalidations()
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

/// The operator's calls, through the tier: this process forgets the record at once; others
/// hear it from the store's feed.
#[async_trait]
impl<S: IdempotencyStore + IdempotencyAdmin> IdempotencyAdmin for LocalTier<S> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.inspect(id).await
    }

    async fn force_release(&self, id: &RecordId) -> Result<Removal, StoreError> {
        let removal = self.inner.force_release(id).await;
        self.cache.remove(id);
        removal
    }

    async fn delete(&self, id: &RecordId) -> Result<Removal, StoreError> {
        let removal = self.inner.delete(id).await;
        self.cache.remove(id);
        removal
    }
}
