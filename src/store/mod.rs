//! The store contract, and the stores that ship with the crate.
//!
//! A store keeps one [`Record`] per [`RecordId`] and answers five operations. Each must be
//! one atomic operation on the backend (one round trip for a networked store):
//!
//! | operation | does |
//! |---|---|
//! | [`claim`](IdempotencyStore::claim) | absent key: create an in-progress record and answer [`ClaimOutcome::Claimed`]; in progress with a lapsed lease and the **same** fingerprint: take over with generation + 1; otherwise answer [`ClaimOutcome::Existing`] with the record |
//! | [`extend`](IdempotencyStore::extend) | renew the lease of the token's claim |
//! | [`complete`](IdempotencyStore::complete) | store the answer and start the retention TTL |
//! | [`release`](IdempotencyStore::release) | end the claim, so a retry runs again: delete a first claim's record, keep a takeover's with its lease ended (see 10) |
//! | [`get`](IdempotencyStore::get) | read a record (wait mode, operators, a [`LocalTier`] learning a completed one with its [`expires_in`](Record::expires_in)) |
//!
//! A store that can settle a claim without I/O may also answer
//! [`claim_now`](IdempotencyStore::claim_now), the same claim answered at once, under the same
//! guarantees; the layer asks it first.
//!
//! # Guarantees every store gives
//!
//! The [conformance suite](crate::conformance) (feature `conformance`) checks each of these
//! against every store.
//!
//! 1. Among any number of concurrent claims of an absent key, exactly one is `Claimed`.
//! 2. A claim of an in-progress record whose lease has lapsed, with the same fingerprint,
//!    takes over with a strictly greater generation; the old token is fenced from then on.
//! 3. `complete`, `extend` and `release` with a stale token change nothing and fail with
//!    [`StoreErrorKind::Fenced`] (a `release` of an absent record excepted, see 9).
//! 4. A completed record replays byte-exactly: status, headers, body, trailers.
//! 5. Past its TTL a record is absent; before it, a completed record is never lost except by
//!    an explicit delete. A full store refuses new claims ([`StoreErrorKind::Full`]) and never
//!    evicts a live record.
//! 6. One clock per store: the backend's own (Redis `TIME`, Postgres `now()`), or a monotonic
//!    clock in process. The application's wall clock is never used.
//! 7. A call whose outcome is unknown (a timeout, a lost reply) is resolved by reading back
//!    before answering; a store never reports `Claimed` without knowing it holds the claim.
//! 8. Different record ids never see each other (scopes are part of the id).
//! 9. `complete` and `release` are idempotent per token, because a call whose reply was lost
//!    gets sent again: `complete` of a record this token already completed answers `Ok` and
//!    writes nothing; `release` of an absent record answers `Ok` (the key is free, which is all
//!    a release asks for: the record was released by this token's earlier attempt, or expired),
//!    and so does `release` of a record this token's earlier release kept (see 10).
//!    `complete` of an absent record is `Fenced`: nothing says the answer was recorded.
//! 10. Within a key's retention its generation only grows. `release` of a first claim
//!     (generation 1) deletes the record, so a corrected request with the same key runs as a
//!     fresh first attempt. `release` of a takeover (generation > 1: an earlier attempt may
//!     have done work) keeps it: in progress, with the same fingerprint, generation and
//!     retention, its lease ended now. The released token is `Fenced` for `complete` and
//!     `extend`; the next claim of the same request takes over (generation + 1, `takeover`,
//!     `lapsed_for` counted from the release), so the abandoned attempt is still reported;
//!     another request gets `Existing`.
//! 11. These hold over any history, not only one step back: a token 2 or 3 generations
//!     behind is fenced as one is, a released takeover's point stays dropped, a third
//!     attempt's release keeps the key's history. The conformance suite's
//!     [`run_histories`](crate::conformance::run_histories) (run by `run_all`, `run_recovery`
//!     and `conformance_suite!`) checks random histories of calls, lost replies, timeouts,
//!     lapses, concurrent claims and operator calls against a model of this contract
//!     (`src/conformance/model.rs`), and prints a failing one shrunk to its minimal form.
//!
//! # Implementing a custom store
//!
//! The claim has no default body: use the backend's own atomic primitive (a Lua script, an
//! `INSERT … ON CONFLICT`, a conditional put). This toy store shows the whole contract under
//! one lock: leases, takeover, fencing, retention, a takeover's release that keeps the key's
//! history, and `complete`/`release` that answer `Ok` when resent. It passes the [conformance suite](crate::conformance) (feature
//! `conformance`), which runs at the end of the example; run the suite on your own store the
//! same way, or with [`conformance_suite!`](crate::conformance_suite) in a test file.
//!
//! ```
//! use std::{collections::HashMap, sync::Mutex, time::{Duration, Instant}};
//! use tower_idempotency::store::{
//!     async_trait, Claim, ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError,
//!     StoreErrorKind,
//! };
//! use tower_idempotency::store::{Completion, Fingerprint, Record, RecordId, RecordState, Token};
//!
//! struct Entry {
//!     fingerprint: Fingerprint,
//!     token: Token,
//!     lease_until: Instant,
//!     expires_at: Instant,
//!     done: Option<Completion>,
//!     /// A takeover its holder released: kept, and its token fenced.
//!     released: bool,
//! }
//!
//! impl Entry {
//!     fn record(&self, now: Instant) -> Record {
//!         let state = match &self.done {
//!             Some(done) => RecordState::Completed(done.clone()),
//!             None => RecordState::InProgress {
//!                 lease_remaining: self.lease_until.saturating_duration_since(now),
//!             },
//!         };
//!         Record::new(self.fingerprint, self.token.generation(), state).with_holder(self.token)
//!     }
//! }
//!
//! /// One clock (a monotonic `Instant`), one lock, and no size limit: a toy.
//! #[derive(Default)]
//! struct ToyStore(Mutex<HashMap<RecordId, Entry>>);
//!
//! /// `now + d` without overflowing on a "keep forever" duration.
//! fn after(now: Instant, d: Duration) -> Instant {
//!     now.checked_add(d).unwrap_or(now + Duration::from_secs(100 * 365 * 86_400))
//! }
//!
//! impl ToyStore {
//!     /// The live entry of `id` held by `token`, or `Fenced`. Expired entries are absent.
//!     fn held<'a>(map: &'a mut HashMap<RecordId, Entry>, id: &RecordId, token: &Token, now: Instant)
//!         -> Result<Option<&'a mut Entry>, StoreError>
//!     {
//!         match map.get_mut(id) {
//!             Some(e) if e.expires_at > now && e.token == *token && !e.released => Ok(Some(e)),
//!             Some(e) if e.expires_at > now => Err(StoreError::new(StoreErrorKind::Fenced)),
//!             _ => Ok(None),
//!         }
//!     }
//! }
//!
//! #[async_trait]
//! impl IdempotencyStore for ToyStore {
//!     async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
//!         // A store with per-scope quotas would count `request.scope` here.
//!         let (id, fp, lease, ttl) = (request.id, request.fingerprint, request.lease, request.ttl);
//!         let now = Instant::now();
//!         let mut map = self.0.lock().unwrap();
//!         if let Some(e) = map.get_mut(id).filter(|e| e.expires_at > now) {
//!             let lapsed = e.done.is_none() && e.lease_until <= now;
//!             if !lapsed || e.fingerprint != *fp {
//!                 return Ok(ClaimOutcome::Existing(e.record(now)));
//!             }
//!             // Takeover: the same request, and its holder went quiet for a whole lease.
//!             e.token = Token::generate(e.token.generation() + 1)?;
//!             e.released = false;
//!             let lapsed_for = Some(now.duration_since(e.lease_until));
//!             e.lease_until = after(now, lease);
//!             e.expires_at = e.expires_at.max(e.lease_until);
//!             return Ok(ClaimOutcome::Claimed(Claim::takeover(e.token, lapsed_for)));
//!         }
//!         // A failed OS random source fails the claim; never use a fixed nonce.
//!         let token = Token::generate(1)?;
//!         let entry = Entry {
//!             fingerprint: *fp,
//!             token,
//!             lease_until: after(now, lease),
//!             // An in-progress record is kept max(lease, ttl).
//!             expires_at: after(now, lease.max(ttl)),
//!             done: None,
//!             released: false,
//!         };
//!         map.insert(*id, entry);
//!         Ok(ClaimOutcome::Claimed(Claim::first(token)))
//!     }
//!
//!     async fn extend(&self, id: &RecordId, token: &Token, lease: Duration) -> Result<(), StoreError> {
//!         let now = Instant::now();
//!         let mut map = self.0.lock().unwrap();
//!         match Self::held(&mut map, id, token, now)? {
//!             Some(e) if e.done.is_none() => {
//!                 e.lease_until = after(now, lease);
//!                 e.expires_at = e.expires_at.max(e.lease_until);
//!                 Ok(())
//!             }
//!             _ => Err(StoreError::new(StoreErrorKind::Fenced)),
//!         }
//!     }
//!
//!     async fn complete(&self, id: &RecordId, token: &Token, done: &Completion, ttl: Duration)
//!         -> Result<(), StoreError>
//!     {
//!         let now = Instant::now();
//!         let mut map = self.0.lock().unwrap();
//!         match Self::held(&mut map, id, token, now)? {
//!             // The TTL counts from completion.
//!             Some(e) if e.done.is_none() => {
//!                 e.done = Some(done.clone());
//!                 e.expires_at = after(now, ttl);
//!                 Ok(())
//!             }
//!             // Completed by this token already (a resend after a lost reply): the first
//!             // answer stands.
//!             Some(_) => Ok(()),
//!             None => Err(StoreError::new(StoreErrorKind::Fenced)),
//!         }
//!     }
//!
//!     async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
//!         let now = Instant::now();
//!         let mut map = self.0.lock().unwrap();
//!         match map.get_mut(id).filter(|e| e.expires_at > now) {
//!             Some(e) if e.token == *token && e.done.is_none() && !e.released => {
//!                 if token.generation() == 1 {
//!                     map.remove(id);
//!                 } else {
//!                     // A takeover: an earlier attempt may have done work. Keep the record
//!                     // with its lease ended, so the next claim takes over and says so.
//!                     e.released = true;
//!                     e.lease_until = now;
//!                 }
//!                 Ok(())
//!             }
//!             // Kept by an earlier attempt of this call.
//!             Some(e) if e.token == *token && e.released => Ok(()),
//!             Some(_) => Err(StoreError::new(StoreErrorKind::Fenced)),
//!             // Gone: released by an earlier attempt of this call, or expired; the key is free.
//!             None => Ok(()),
//!         }
//!     }
//!
//!     async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
//!         let now = Instant::now();
//!         let map = self.0.lock().unwrap();
//!         Ok(map.get(id).filter(|e| e.expires_at > now).map(|e| e.record(now)))
//!     }
//! }
//!
//! # #[derive(Clone)] struct Tenant(String);
//! let layer = tower_idempotency::IdempotencyLayer::new(ToyStore::default())
//!     .with_scope(|req| req.extensions.get::<Tenant>().map(|t| t.0.clone()));
//! # drop(layer);
//!
//! // The store contract, checked (about five seconds: leases and TTLs run in real time).
//! #[cfg(feature = "conformance")]
//! tokio::runtime::Runtime::new().unwrap().block_on(
//!     tower_idempotency::conformance::run_all(
//!         || async { std::sync::Arc::new(ToyStore::default()) as _ },
//!         None,
//!     ),
//! );
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub(crate) mod record;
/// The store data model: what a store keeps and answers.
pub use record::{
    Completion, DecodeError, Fingerprint, Record, RecordId, RecordState, ScopeId, StoredResponse,
    Token,
};

mod point;
pub use point::RecoveryPoint;

mod error;
pub use error::ConfigError;

pub mod memory;

mod admin;
pub use admin::{AdminStore, IdempotencyAdmin, RecordInfo, RecordStatus, Removal};

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;

pub use memory::MemoryStore;
mod tier;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use tier::feed_heartbeat;
pub use tier::{Invalidation, LocalTier};

/// Re-exported for store authors: the trait's methods are `#[async_trait]`.
pub use async_trait::async_trait;

/// What [`IdempotencyStore::claim`] is asked: which record, for which request, for how long.
///
/// Built with [`ClaimRequest::new`] (and [`in_scope`](Self::in_scope)); `#[non_exhaustive]`,
/// so an argument added later (a deadline, say) does not break a store that reads the
/// fields it knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRequest<'a> {
    /// The scope the record is counted against, for stores with per-scope quotas. `None`:
    /// counted against no scope (the layer always gives one).
    pub scope: Option<&'a ScopeId>,
    /// The record to claim.
    pub id: &'a RecordId,
    /// The request's fingerprint: only the same request may take over a lapsed claim.
    pub fingerprint: &'a Fingerprint,
    /// How long the claim holds the key without a renewal.
    pub lease: Duration,
    /// How long the record is kept at least (a store keeps it for the lease at least).
    pub ttl: Duration,
}

impl<'a> ClaimRequest<'a> {
    /// A claim of `id` for the request with `fingerprint`, holding a lease of `lease` and
    /// kept at least `ttl`, counted against no scope.
    pub fn new(
        id: &'a RecordId,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Self {
        Self {
            scope: None,
            id,
            fingerprint,
            lease,
            ttl,
        }
    }

    /// Counts the record against `scope`'s quota.
    #[must_use]
    pub fn in_scope(mut self, scope: &'a ScopeId) -> Self {
        self.scope = Some(scope);
        self
    }
}

/// What [`IdempotencyStore::claim`] found.
// Built once per request and moved a few times; boxing would allocate on every replay.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// This caller holds the key now and must run the work, then complete or release.
    Claimed(Claim),
    /// Someone else's record: completed, or in progress (its lease may have lapsed when the
    /// fingerprint differs, since only the same request may take over).
    Existing(Record),
}

/// A successful claim: built with [`Claim::first`] or [`Claim::takeover`], so a field added
/// later does not break a store.
// Not `Copy`: a field that owns data (a recovery point) may join it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Claim {
    /// Fences every later write of this claim.
    pub token: Token,
    /// `true` when this claim took over an in-progress record whose lease had lapsed.
    pub takeover: bool,
    /// On a takeover, how long the old lease had been lapsed, by the store's clock: how long
    /// the key was abandoned. `None` on a first claim, or when the store cannot tell.
    pub lapsed_for: Option<Duration>,
    /// On a takeover, the last recovery point the earlier attempts saved, so this attempt
    /// resumes from it ([`IdempotencyStore::save_recovery_point`]).
    pub recovery_point: Option<RecoveryPoint>,
}

impl Claim {
    /// The first claim of an absent key.
    pub fn first(token: Token) -> Self {
        Self {
            token,
            takeover: false,
            lapsed_for: None,
            recovery_point: None,
        }
    }

    /// A takeover of a record whose lease had lapsed `lapsed_for` ago (`None`: the store
    /// cannot tell).
    pub fn takeover(token: Token, lapsed_for: Option<Duration>) -> Self {
        Self {
            token,
            takeover: true,
            lapsed_for,
            recovery_point: None,
        }
    }

    /// The same claim, handing the attempt the recovery point the record holds.
    #[must_use]
    pub fn with_recovery_point(mut self, point: Option<RecoveryPoint>) -> Self {
        self.recovery_point = point;
        self
    }
}

/// The kind of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The token is stale: the lease lapsed and another claim took over, or the record was
    /// released or expired. Nothing was written.
    Fenced,
    /// The store is full and refuses new claims. Nothing was evicted.
    Full,
    /// The backend could not be reached or refused the operation.
    Unavailable,
    /// The call timed out and its outcome could not be read back.
    Unknown,
    /// Stored bytes could not be decoded.
    Corrupt,
    /// The scope holds as many records (or bytes) as its quota allows; other scopes still
    /// claim. Nothing was written.
    QuotaExceeded,
    /// What was to be stored is over a documented cap (a [`RecoveryPoint`]'s, say); the
    /// source names the cap. Nothing was written.
    TooLarge,
    /// The store does not implement the operation (a custom store written before it).
    Unsupported,
    /// The answer's `Vary` names request headers, and it is recorded where no request
    /// exists (the [recovery worker](crate::RecoveryWorker)'s context): it would be stored
    /// without the Vary guard that keeps one caller's answer from another. Nothing was written.
    Unguarded,
    /// Anything else, see the source.
    Other,
}

/// An error from a store, with its kind and the backend error that caused it.
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
    outage: Option<Outage>,
}

/// A state of the backend that its store logs once, when it begins and ends: the layer counts
/// the calls it refused rather than logging each.
// Only the Redis store reports outages today.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outage {
    /// A failover of the primary is under way: writes are held.
    Failover,
    /// Fewer replicas than asked for acknowledged a write.
    Replication,
}

impl StoreError {
    /// An error of `kind` with no underlying cause.
    pub fn new(kind: StoreErrorKind) -> Self {
        Self {
            kind,
            source: None,
            outage: None,
        }
    }

    /// An error of `kind` caused by `source`; the source chain is kept.
    pub fn with_source(
        kind: StoreErrorKind,
        source: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            source: Some(source.into()),
            outage: None,
        }
    }

    /// Marks an error caused by `outage`, which the store logs itself.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn during(mut self, outage: Outage) -> Self {
        self.outage = Some(outage);
        self
    }

    /// The outage that caused this error, when the store said so.
    pub(crate) fn outage(&self) -> Option<Outage> {
        self.outage
    }

    /// The kind.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// `true` for [`StoreErrorKind::Fenced`].
    pub fn is_fenced(&self) -> bool {
        self.kind == StoreErrorKind::Fenced
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            StoreErrorKind::Fenced => "idempotency claim is fenced: a newer claim holds the key",
            StoreErrorKind::Full => "idempotency store is full",
            StoreErrorKind::Unavailable => "idempotency store is unavailable",
            StoreErrorKind::Unknown => "idempotency store call timed out with an unknown outcome",
            StoreErrorKind::Corrupt => "idempotency record is corrupt",
            StoreErrorKind::QuotaExceeded => "idempotency scope is over its quota",
            StoreErrorKind::TooLarge => "idempotency store refused a value over its cap",
            StoreErrorKind::Unsupported => "idempotency store does not support this operation",
            StoreErrorKind::Unguarded => "idempotency answer varies on request headers that are not known here, so it cannot carry its Vary guard; nothing was recorded",
            StoreErrorKind::Other => "idempotency store error",
        };
        f.write_str(what)
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Where idempotency records live. See the [module docs](self) for the contract.
///
/// Object-safe: `Arc<dyn IdempotencyStore>` is a store too.
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Atomically claims `request.id` for a request with `request.fingerprint`, or returns
    /// the existing record.
    ///
    /// A new or taken-over record holds a lease of `request.lease` and is kept at least
    /// `request.ttl`. A store with per-scope quotas counts `request.scope`'s records here and
    /// refuses a new record past its quota with [`StoreErrorKind::QuotaExceeded`]; a request
    /// without a scope is placed by its id and counted against none.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError>;

    /// [`claim`](Self::claim), answered at once where the store needs no I/O for it: the
    /// memory store always, a [`LocalTier`] for a record it holds. `None` (the default) means
    /// "call `claim`". The layer tries this first: a replay served from memory then builds
    /// no boxed future and no deadline. An answer here carries every guarantee of `claim`'s.
    fn claim_now(&self, request: &ClaimRequest<'_>) -> Option<Result<ClaimOutcome, StoreError>> {
        let _ = request;
        None
    }

    /// Renews the lease of `token`'s claim to `lease` from now.
    async fn extend(&self, id: &RecordId, token: &Token, lease: Duration)
        -> Result<(), StoreError>;

    /// Records the answer of `token`'s claim and keeps it for `ttl` from now.
    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError>;

    /// Ends `token`'s claim, so the next claim runs the work again. A first claim's record
    /// (generation 1) is deleted; a takeover's is kept, in progress with its lease ended now,
    /// so the next claim of the same request is a takeover too and reports the abandoned
    /// attempt (guarantee 10 in the [module docs](self)). A stale token is `Fenced`.
    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError>;

    /// Reads the record, if any. A record past its TTL is absent.
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError>;

    /// Saves `point` as the recovery point of `token`'s claim, replacing the one before: the
    /// next takeover gets it in [`Claim::recovery_point`], [`get`](Self::get) shows it in
    /// [`Record::recovery_point`], and [`recoverable`](Self::recoverable) lists the record
    /// once its lease lapses. `complete` and `release` drop it.
    ///
    /// Fenced like `extend`: a stale token, a completed or released record, or an absent one
    /// is [`StoreErrorKind::Fenced`] and writes nothing. A point is at most
    /// [`RecoveryPoint::MAX_ENCODED`] bytes encoded. The default answers
    /// [`StoreErrorKind::Unsupported`].
    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        let _ = (id, token, point);
        Err(StoreError::new(StoreErrorKind::Unsupported))
    }

    /// Up to `limit` records in progress whose lease has lapsed and that hold a recovery
    /// point, for the [recovery worker](crate::RecoveryWorker). Each [`Record`] carries its
    /// [`recovery_point`](Record::recovery_point). Records that never saved a point are not
    /// looked at: a store indexes only those that did. The default answers
    /// [`StoreErrorKind::Unsupported`].
    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        let _ = limit;
        Err(StoreError::new(StoreErrorKind::Unsupported))
    }

    /// The store's invalidation feed, for a [`LocalTier`] on another process: every
    /// operator's delete of a completed record, as it happens, with [`Invalidation::Lost`]
    /// and [`Invalidation::Live`] around any time the feed cannot hear them. Called from
    /// inside the runtime; `None` (the default) where the store has none, and a tier then
    /// bounds staleness by its `max_age` alone.
    fn invalidations(&self) -> Option<tokio::sync::broadcast::Receiver<Invalidation>> {
        None
    }

    /// A short, fixed name for the `store` label of the layer's metrics (`"memory"`,
    /// `"redis"`, `"postgres"`). Default `"custom"`.
    fn name(&self) -> &'static str {
        "custom"
    }
}

#[async_trait]
impl<T: IdempotencyStore + ?Sized> IdempotencyStore for Arc<T> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(request).await
    }

    fn claim_now(&self, request: &ClaimRequest<'_>) -> Option<Result<ClaimOutcome, StoreError>> {
        (**self).claim_now(request)
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        (**self).extend(id, token, lease).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        (**self).complete(id, token, completion, ttl).await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        (**self).release(id, token).await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        (**self).get(id).await
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        (**self).save_recovery_point(id, token, point).await
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        (**self).recoverable(limit).await
    }

    fn invalidations(&self) -> Option<tokio::sync::broadcast::Receiver<Invalidation>> {
        (**self).invalidations()
    }

    fn name(&self) -> &'static str {
        (**self).name()
    }
}

/// `error` and each of its sources, joined by `: `, skipping a message a cause repeats: the
/// text of a setup error, which names the real cause.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn error_chain(error: &(dyn StdError + 'static)) -> String {
    let mut out = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        let msg = e.to_string();
        if !out.contains(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        next = e.source();
    }
    out
}

/// The URL of a backend for the unit tests that need one, or `None` (skipped, said so) when
/// `var` is unset, unless `IDEMPOTENCY_REQUIRE_BACKENDS=1`.
#[cfg(all(test, any(feature = "redis", feature = "postgres")))]
pub(crate) fn test_backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("IDEMPOTENCY_REQUIRE_BACKENDS").as_deref() != Ok("1"),
                "{var} is unset but IDEMPOTENCY_REQUIRE_BACKENDS=1: the backend is required"
            );
            eprintln!("SKIPPED: {var} is unset, so this backend test did not run");
            None
        }
    }
}

/// Claims `id` twice with equal nonces (the hook makes every nonce `[0; 16]`, as a broken
/// random source once did) and different fingerprints: the second must not be `Claimed`.
#[cfg(all(test, any(feature = "redis", feature = "postgres")))]
pub(crate) async fn equal_nonces_with_different_fingerprints_claim_once(
    store: &dyn IdempotencyStore,
) {
    use crate::store::record::FIXED_NONCE;
    let id = RecordId::new(
        Some("equal-nonces"),
        &format!("{:?}", std::time::SystemTime::now()),
    );
    let (a, b) = (
        Fingerprint::from_bytes([1; 32]),
        Fingerprint::from_bytes([2; 32]),
    );
    let lease = Duration::from_secs(30);
    FIXED_NONCE.with(|n| n.set(Some([0; 16])));
    let first = store.claim(&ClaimRequest::new(&id, &a, lease, lease)).await;
    let second = store.claim(&ClaimRequest::new(&id, &b, lease, lease)).await;
    let resent = store.claim(&ClaimRequest::new(&id, &a, lease, lease)).await;
    FIXED_NONCE.with(|n| n.set(None));
    assert!(matches!(first.unwrap(), ClaimOutcome::Claimed(_)));
    match second.unwrap() {
        ClaimOutcome::Existing(r) => assert_eq!(r.fingerprint, a),
        other @ ClaimOutcome::Claimed(_) => {
            panic!("another request with an equal nonce claimed too: {other:?}")
        }
    }
    // The same request with its own nonce is still recognised (the read-back path).
    assert!(matches!(resent.unwrap(), ClaimOutcome::Claimed(_)));
}
