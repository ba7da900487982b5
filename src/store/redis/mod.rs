//! A Redis store: one string per record, one round trip per operation, Redis's own clock.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::store::redis::RedisStore;
//!
//! // One node (or a primary behind a proxy):
//! let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
//! // Redis Cluster, from any subset of its nodes:
//! let cluster = RedisStore::connect_cluster(["redis://redis-a:7000/", "redis://redis-b:7000/"]).await?;
//! // The primary Sentinel names for `shop`, followed through failovers:
//! let sentinel = RedisStore::connect("redis+sentinel://sentinel-a:26379,sentinel-b:26379/shop").await?;
//! // With settings:
//! let tuned = RedisStore::builder()
//!     .with_key_prefix("shop:idem:")
//!     .with_timeout(std::time::Duration::from_millis(500))
//!     .connect("redis://127.0.0.1:6379/")
//!     .await?;
//! # drop((store, cluster, sentinel, tuned));
//! # Ok(())
//! # }
//! ```
//!
//! The [`redis`] crate is re-exported, so a connection built by hand has matching versions:
//! [`RedisStore::new`] takes a [`ConnectionManager`] or a cluster [`ClusterConnection`].
//!
//! # What it guarantees
//!
//! Every point of the [store contract](super) holds on one node and on a cluster:
//!
//! - **Atomic claims.** Each write is one command or one Lua script, so it runs alone on the
//!   node that holds the record. A claim creates the record or says what is there in the
//!   same call: without quotas, on Redis 7, it is one plain `SET <record> NX PX <keep> GET`
//!   (it writes only where there is no record, and answers the one there); the claim script
//!   runs only to take over a lapsed lease, with quotas, on a full Redis and before Redis 7.
//! - **One round trip per operation.** A new request costs 2 (claim, complete); a replay
//!   costs 1, and the answer comes back without passing through Lua (a script that
//!   returned a 1 MiB answer would hold Redis, and every other client, for milliseconds):
//!   the plain claim's `SET` answers it, and the claim script is pipelined with a `GET`. A
//!   record in progress costs one more, its key's `PTTL` (the lease left, for the 409's
//!   `Retry-After` and to see a lapse): a conflict costs 2, and a takeover 3 (the plain
//!   claim, the `PTTL`, then the script). Reading the `PTTL` with every claim would cost
//!   each new key and replay a second command for what only a record in progress needs
//!   (a replay's Redis time 1.63 µs against 1.32 µs, BENCHMARKS.md). `get` is 1
//!   (`GET`, `TIME` and `PTTL`, pipelined, no script). With [`with_wait`] a claim that wins
//!   costs one more (a renewal and `WAIT`, pipelined); a complete sends its `WAIT` in the
//!   same pipeline.
//! - **Fencing.** `complete`, `extend` and `release` check the token's generation **and** nonce;
//!   a stale token writes nothing and fails with [`StoreErrorKind::Fenced`].
//! - **A key keeps its history.** `release` deletes a first claim's record, but keeps a
//!   takeover's: its lease ends now and its nonce becomes one no claim holds (release.lua), so
//!   the next claim of the same request takes over with the generation plus one.
//! - **Redis's clock.** A record stores when its lease ends as a gap before the key's
//!   expiry (`PX` and `PEXPIRE`), so the lease left is the key's `PTTL` less the gap, and a
//!   claim the client writes needs no clock at all (see the
//!   [record format](#key-layout-and-record-format)). The application's clock is never
//!   read, so clock skew between app servers does not matter. The lease rides on the key's
//!   expiry, so never change the TTL of the store's keys by hand (`EXPIRE`, `PERSIST`):
//!   shortening one ends its lease early, and a retry could take the key over while the
//!   first attempt still runs. A key left without expiry is held (409) until an operator
//!   releases it ([`IdempotencyAdmin::force_release`](crate::store::IdempotencyAdmin)).
//! - **Every key expires.** A record lives `max(ttl, lease)` from its claim, at least `lease`
//!   from each takeover or renewal, and `ttl` from its completion.
//! - **Unknown outcomes are read back.** The claim's nonce is made here, not in Redis, and sent
//!   with the claim. When a reply times out or the connection drops mid-call, the store reads the
//!   record back on the same connection (so Redis has run the lost call first, if it ever got
//!   it): its own nonce means `Claimed`, another means `Existing`, no record means the call never
//!   arrived and it is sent once more. A claim is idempotent for its nonce, so a late duplicate is
//!   harmless. When nothing can be read back the answer is [`StoreErrorKind::Unknown`], never
//!   `Claimed`: the record, if the claim did land, stays in progress until its lease lapses.
//!
//! # The eviction guard
//!
//! Redis deletes keys under memory pressure unless `maxmemory-policy` is `noeviction`. Every
//! record has a TTL, so the `volatile-*` policies evict records too, and an evicted in-progress
//! record lets a retry run the work twice. Construction therefore reads the policy, with
//! `CONFIG GET maxmemory-policy` or, where `CONFIG` is disabled or renamed (managed Redis often
//! does that), from `INFO memory`; on a cluster, from every node. Any other policy than
//! `noeviction` is a [`SetupError::EvictionPolicy`] that names it and the fix:
//!
//! ```text
//! CONFIG SET maxmemory-policy noeviction
//! ```
//!
//! [`with_eviction_guard(false)`](RedisStoreBuilder::with_eviction_guard) skips the check, for a
//! Redis used only for this with memory to spare.
//!
//! # When Redis is full
//!
//! A full `noeviction` Redis refuses writes. A claim of a new key then fails with
//! [`StoreErrorKind::Full`] and writes nothing (the layer answers 503 without running the inner
//! service), while completed records still replay: Redis refuses the plain claim's `SET`
//! whether or not the key exists, so the store sends the claim script, which reads before it
//! writes (Redis refuses only a script's first write, not the script), and the record comes
//! from the `GET` pipelined after it. A replay then costs 2 round trips. A takeover, `complete` and `extend` are writes and fail with `Full`
//! too; `release` of a first claim (a `DEL`) and `get` keep working. The release of a
//! takeover keeps the record (see the [store contract](super)), rewriting its lease in place,
//! and a full Redis refuses that write too: the key is then taken over once the lease lapses.
//!
//! # Durability: AOF, replication and `WAIT`
//!
//! Redis acknowledges a write before it is on disk (unless `appendfsync always`) and before its
//! replicas have it. A crash loses the last second of writes with `appendfsync everysec`, and a
//! failover to a replica that had not caught up loses what the replica lacked. Either way an
//! acknowledged claim can vanish and a retry run the work again, or a completed answer vanish
//! and a retry run again. [`with_wait`] narrows the failover window: after a winning claim and
//! after a complete, the store sends `WAIT numreplicas timeout` and fails with
//! [`StoreErrorKind::Unavailable`] when fewer replicas acknowledged in time (a claim is then
//! released, best effort). `WAIT` is not consensus: it shrinks the window, it does not close it.
//!
//! `WAIT` blocks the connection it is sent on, so the store never sends it on the shared
//! connection every other call uses: each write that waits (a complete, or a renewal right
//! after a winning claim, which replicates the claim before it) goes with its `WAIT` as one
//! pipeline on a connection of its own, from a small pool, to the record's primary. A replay
//! or a read never waits for someone else's replica. This needs the store to open its own
//! connections ([`connect`](RedisStoreBuilder::connect),
//! [`connect_cluster`](RedisStoreBuilder::connect_cluster)); a store
//! [built](RedisStoreBuilder::build) on your connection sends `WAIT` on that connection.
//!
//! # Failover
//!
//! A store follows its primary by itself. A `READONLY` (or `MASTERDOWN`) reply fails that
//! call ([`StoreErrorKind::Unavailable`]: the layer answers 503) and marks the connection
//! suspect: it is not used again, and one background task (at most one every 100 ms)
//! reconnects, loads the scripts on the node it reaches and swaps the new connection in.
//! Which node that is depends on how the store was built:
//!
//! - **A URL** ([`connect`](RedisStoreBuilder::connect)): the URL again, so a host name or a
//!   proxy that now points at the new primary is followed. A URL naming one node's address
//!   cannot follow a failover to another node: use Sentinel.
//! - **Sentinel** (`redis+sentinel://host:port[,host:port...]/<master-name>`, or
//!   [`connect_sentinel`](RedisStoreBuilder::connect_sentinel)): the primary Sentinel names
//!   now, asked with the `redis` crate's Sentinel client, which checks the node's role. A lost
//!   connection or a timeout marks the connection suspect too, since the connection manager
//!   would redial the old address (a primary that restarted empty, or was demoted). The store
//!   also listens to the Sentinels' failover events
//!   ([`with_failover_events`](RedisStoreBuilder::with_failover_events)): from a failover's
//!   first event until it is connected to the primary `+switch-master` announced it
//!   acknowledges no write, so an old primary that still takes writes during a forced
//!   failover cannot lose an answer the store reported as recorded. Only an abort by every
//!   Sentinel that reported the failover ends this hold early (a Sentinel that lost the
//!   leader election aborts while the leader goes on), and 30 s without a further event end
//!   it in case the end was missed. The hold logs once when it starts (WARN) and once when it
//!   ends, saying how (INFO); the layer counts the requests it refused
//!   (`idempotency_outage_refusals_total`) and logs each at DEBUG only.
//!
//! A call that was under way when its connection was found suspect, or when a failover
//! began, is reported [`StoreErrorKind::Unknown`], never acknowledged. What each `WAIT`
//! setting promises across a failover, and what the failover suite measured, is in
//! `docs/operations.md` (Failover).
//!
//! # Redis Cluster
//!
//! All of a record is one string, and its key carries the record id as a hash tag (with
//! quotas, its scope's tag), so every script touches one slot and the store runs unchanged on
//! a cluster. Each call, with the
//! commands pipelined after it, goes to the slot's primary; a `NOSCRIPT` answer (a fresh node
//! after a failover, `SCRIPT FLUSH`) loads the script on that node and sends the call again
//! (the refused call wrote nothing), for a single node and for a cluster alike. The scripts are
//! also loaded on every node when the store is built. `WAIT` goes to the primary of the
//! record's slot.
//!
//! The plain claim names one key, so it goes to that key's slot like a script.
//!
//! The cluster client itself resends a command whose connection dropped. Every call is safe
//! to resend: a claim is idempotent for its nonce and fingerprint (a plain claim's `SET`
//! sent again answers the record it wrote, which holds its nonce), a `complete` that had landed
//! answers `Ok` the second time, and so does a `release` that had deleted or kept the record.
//!
//! # Per-scope quotas
//!
//! [`with_max_records_per_scope`](RedisStoreBuilder::with_max_records_per_scope) and
//! [`with_max_bytes_per_scope`](RedisStoreBuilder::with_max_bytes_per_scope) cap what one
//! scope (tenant) may hold, so one tenant cannot fill Redis for the others, on one node and on
//! a cluster alike. The claim script counts and admits in the same call as the claim. A
//! refused claim writes nothing and fails with [`StoreErrorKind::QuotaExceeded`]; existing
//! records still replay. A counted record carries its scope (format `3`), so `complete` adds
//! the answer's bytes and `release` of a first claim (and the operator's removals) give the
//! record back; a kept takeover counts until it expires or is removed.
//! Without a quota none of this runs.
//!
//! `complete`, `extend`, `release` and `get` receive only the record id, so the scope's keys
//! must be found from it: every record id begins with its scope id's first
//! [`RecordId::SCOPE_PREFIX`] bytes, and with quotas those bytes, in hex, are the hash tag of
//! the record key and of its **scope group**'s two keys (the scopes whose ids share those 4
//! bytes):
//!
//! - `<prefix>{<tag>}s`, a sorted set of the group's records by expiry (member: scope id hex
//!   then record id hex), whose expired members are dropped by Redis's clock as claims come;
//! - `<prefix>{<tag>}b`, a hash of each record's stored size (by record id hex) and, per
//!   scope, its record count (`n<scope hex>`) and bytes (`t<scope hex>`).
//!
//! Each scope is counted on its own, by its full id, so two scopes that share a tag never
//! share a quota; they only share a slot. Every script names all three keys in `KEYS`, so each
//! call stays one atomic script on one node, in one round trip, with its `WAIT` after it.
//!
//! The price, on a cluster: **a scope lives on one node.** All of a tenant's records and
//! counts are in one slot, so a hot tenant is one node's load (and memory) however many
//! primaries there are; tenants still spread over the slots by their tags. Without quotas
//! every record is its own hash tag and one tenant's records spread over the whole cluster.
//! The unscoped space is one scope here too: an unscoped layer's records all share one tag
//! (a record claimed without a [scope](crate::store::ClaimRequest::in_scope) is placed
//! by its id but not counted). Turning quotas on or off changes the key layout: records written under the
//! other setting are not found (a retry within their TTL runs again), so switch when a lost
//! TTL's worth of records is acceptable, or drain first.
//!
//! # Requirements
//!
//! Redis 6.0 or later (the scripts read `TIME` before they write, which needs effects
//! replication, the default since 5; saving a recovery point keeps the key's expiry with
//! `SET … KEEPTTL`, new in 6.0); tested with Redis 7.0, single node and cluster. The plain
//! claim needs `SET` with both `NX` and `GET`, new in 7.0: setup reads every node's
//! `redis_version` (`INFO server`) once, and without 7.0 everywhere (or should a node later
//! refuse the syntax) claims go through the script. TLS comes with the `redis-tls` feature.
//!
//! # Key layout and record format
//!
//! One string per record, at `<prefix>{<id>}`: the prefix (default `idem:`) and the record id
//! in lowercase hex, 64 characters, inside braces so it is the cluster hash tag. With
//! per-scope quotas the braces hold only the first 8 hex characters (the scope's tag, see
//! [per-scope quotas](#per-scope-quotas)): `<prefix>{<8 hex>}<56 hex>`. The prefix must not
//! contain braces. The value is an 82-byte header (format, state, fingerprint, nonce,
//! generation, lease, at fixed offsets, so the scripts read and rewrite fields with
//! `GETRANGE` and `SETRANGE` and never copy the answer; with per-scope quotas 146 bytes, the
//! last 64 the scope id in hex) followed, once completed, by the answer as
//! [`Completion::encode`] bytes. Records in the earlier format (one hash each) read
//! as [`StoreErrorKind::Corrupt`]: see the changelog.
//!
//! The lease field is `k` and the 15-digit gap between the lease's end and the key's expiry.
//! Earlier versions wrote (and read) a 16-digit deadline by `TIME` instead; this version reads
//! both, so during a rolling upgrade every record an earlier instance wrote is served. An
//! earlier instance meeting a record in progress that this version wrote fails closed: its
//! claim script stops with a Lua error (the layer answers 503, where this version would answer
//! 409 or take over) and its reads say [`StoreErrorKind::Corrupt`]; it never runs a request
//! twice. Completed records read the same in both.
//!
//! A record in progress that saved a [recovery point](crate::RecoveryPoint) has state `r`
//! and the point after its header (its step and data as the handler gave them, the saving
//! claim's generation and the scope id: never the scope, nor the key, which no key, value or
//! index here holds in the clear; see [security](crate::security#what-the-crate-stores));
//! `complete` and `release` drop it. `<prefix>recoverable`
//! is a sorted set of the record ids that saved one, by when the
//! [recovery worker](crate::RecoveryWorker) should look at them next: one key for the whole
//! store (on a cluster, one slot apart from the records), so it is a hint, and the worker
//! reads each record before it acts. A completed record's entry goes at once; a released
//! record's entry stays until a worker's sweep reads the record (about 60 bytes each), so run
//! a worker wherever handlers save points.
//!
//! [`with_wait`]: RedisStoreBuilder::with_wait
//! [`ConnectionManager`]: redis::aio::ConnectionManager
//! [`ClusterConnection`]: redis::cluster_async::ClusterConnection

mod admin;
mod claim;
mod connection;
mod error;
mod events;
mod feed;
mod follow;
mod record;
mod recovery;
mod scripts;
mod setup;

use claim::*;

use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

pub use redis;

use redis::{Pipeline, Value};

pub use connection::RedisConnection;
pub use error::{FailoverUnderway, ReplicationShortfall};
pub use setup::{RedisStoreBuilder, SetupError};

use super::{Claim, ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError, StoreErrorKind};
use crate::store::record::{
    Completion, Fingerprint, Record, RecordId, RecordState, ScopeId, Token,
};
use crate::store::RecoveryPoint;
use error::{corrupt, failover_underway, fenced, unknown, BadReply, Failure};
use record::{Clock, Found};
use scripts::{Lua, Scripts};
use setup::Dedicated;

/// The default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "idem:";

/// The default time one Redis call may take before its outcome counts as unknown.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest lease or TTL sent to Redis, in milliseconds (about 35,000 years). Lua numbers are
/// doubles, so `now + this` must stay below 2^53 to be exact (now is about 2^41 ms), and it
/// must fit the record's 16 digits.
const MAX_MS: u64 = 1 << 50;

/// An [`IdempotencyStore`] on Redis or Redis Cluster. Cloning shares the connection.
///
/// See the [module docs](self) for what it guarantees and how to run Redis for it.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// The connection calls take, replaced when the primary moves.
    link: Arc<follow::Link>,
    /// Connections for writes followed by `WAIT`, when `WAIT` is on and the store made its
    /// own connection.
    dedicated: Option<Dedicated>,
    prefix: String,
    wait: Option<(NonZeroU32, Duration)>,
    timeout: Duration,
    scripts: Scripts,
    quotas: Quotas,
    /// Claims go as one plain `SET … NX PX … GET` (see [`plain_claim`]): no quota, and every
    /// node runs Redis 7 or later (read at setup; cleared should a node refuse the syntax).
    plain_claims: AtomicBool,
    /// The invalidation feed's sender, once a local tier asked for it (`feed.rs`).
    feed: std::sync::OnceLock<Option<tokio::sync::broadcast::Sender<crate::store::Invalidation>>>,
}

/// The keys a script on one record is given: the record's, then, with quotas, its scope
/// group's records and counts. All share the record's hash tag, so one slot holds them.
struct Keys {
    record: String,
    group: Option<[String; 2]>,
    /// The record id in hex where the record key does not hold it whole (with quotas).
    id: Option<String>,
}

impl Keys {
    /// Without quotas the record key is built with the id's hex written straight into it,
    /// which [`id`](Self::id) then borrows: one allocation per call instead of three.
    fn new(prefix: &str, grouped: bool, id: &RecordId) -> Self {
        if !grouped {
            return Keys {
                record: record_key(prefix, id),
                group: None,
                id: None,
            };
        }
        let hex = id.to_hex();
        let tag = &hex[..2 * RecordId::SCOPE_PREFIX];
        let group = Some([format!("{prefix}{{{tag}}}s"), format!("{prefix}{{{tag}}}b")]);
        Keys {
            record: grouped_key(prefix, &hex),
            group,
            id: Some(hex),
        }
    }

    /// The record id in hex, which the scripts name the record by in its group.
    fn id(&self) -> &str {
        match &self.id {
            Some(hex) => hex,
            // `<prefix>{<hex>}`: the 64 digits before the closing brace.
            None => &self.record[self.record.len() - 65..self.record.len() - 1],
        }
    }

    /// The record's key, then its group's keys where it has them.
    fn all(&self) -> KeyList<'_> {
        match &self.group {
            None => KeyList::One([self.record.as_str()]),
            Some([z, b]) => KeyList::Three([self.record.as_str(), z.as_str(), b.as_str()]),
        }
    }
}

/// A call's keys, without an allocation.
#[derive(Debug)]
enum KeyList<'a> {
    One([&'a str; 1]),
    Three([&'a str; 3]),
}

impl<'a> std::ops::Deref for KeyList<'a> {
    type Target = [&'a str];
    fn deref(&self) -> &Self::Target {
        match self {
            KeyList::One(k) => k,
            KeyList::Three(k) => k,
        }
    }
}

/// Per-scope limits; 0 is none.
#[derive(Debug, Clone, Copy, Default)]
struct Quotas {
    records: usize,
    bytes: usize,
}

impl Quotas {
    fn any(self) -> bool {
        self.records > 0 || self.bytes > 0
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("conn", &self.inner.link.any_conn().1)
            .field("prefix", &self.inner.prefix)
            .field("wait", &self.inner.wait)
            .field("timeout", &self.inner.timeout)
            .field("quotas", &self.inner.quotas)
            .finish()
    }
}

impl RedisStore {
    /// A builder, for a key prefix, `WAIT`, the timeout or the eviction guard.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }

    /// A store on `conn` with the defaults. See [`RedisStoreBuilder::build`].
    pub async fn new(conn: impl Into<RedisConnection>) -> Result<Self, SetupError> {
        Self::builder().build(conn).await
    }

    /// Connects to one Redis node with the defaults. See [`RedisStoreBuilder::connect`].
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// Connects to a Redis Cluster with the defaults. See
    /// [`RedisStoreBuilder::connect_cluster`].
    pub async fn connect_cluster<I, S>(nodes: I) -> Result<Self, SetupError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::builder().connect_cluster(nodes).await
    }

    /// The Redis key of `id`: `<prefix>{<hex id>}`, or with per-scope quotas
    /// `<prefix>{<first 8 hex>}<other 56 hex>` (see [key layout](self#key-layout-and-record-format)).
    pub fn key(&self, id: &RecordId) -> String {
        self.keys(id).record
    }

    /// The keys scripts on `id` touch.
    fn keys(&self, id: &RecordId) -> Keys {
        Keys::new(&self.inner.prefix, self.inner.quotas.any(), id)
    }

    /// Sends `pipe`, whose first command runs `lua`, to `key`'s node in one round trip,
    /// bounded by the timeout. A `NOSCRIPT` answer (a fresh node, `SCRIPT FLUSH`) loads the
    /// script there and sends the pipeline once more; the refused call wrote nothing.
    async fn send(&self, pipe: &Pipeline, lua: &Lua, key: &str) -> Result<Vec<Value>, Failure> {
        let link = &self.inner.link;
        let holds = self.refuse_during_failover()?;
        let (epoch, conn) = link.conn().ok_or_else(reconnecting)?;
        let call = async {
            let mut replies = conn
                .pipeline(pipe, key)
                .await
                .map_err(|e| self.failed(epoch, e))?;
            if matches!(replies.first(), Some(Value::ServerError(e)) if e.code() == "NOSCRIPT") {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(lua.code);
                conn.on_key(&load, key)
                    .await
                    .map_err(|e| self.failed(epoch, e))?;
                replies = conn
                    .pipeline(pipe, key)
                    .await
                    .map_err(|e| self.failed(epoch, e))?;
            }
            Ok::<_, Failure>(replies)
        };
        let replies = self.bounded(epoch, call).await?;
        self.acknowledge_unless_failover(holds)?;
        // A refusal by a node that is no longer the primary is certain: its error stands.
        // Otherwise a connection found suspect while this call ran may have been redialled
        // to a node that is no longer the primary: nothing it answered is acknowledged.
        if !link.observe_replies(epoch, &replies) && !link.usable(epoch) {
            return Err(Failure::Certain(StoreError::with_source(
                StoreErrorKind::Unknown,
                error::Reconnecting,
            )));
        }
        Ok(replies)
    }

    /// `call` on the connection of `epoch`, within the timeout; past it, an unknown outcome.
    ///
    /// The only timer on a call to the store's own connection manager, which has no response
    /// timeout: this one also covers a call the manager holds while it redials, with backoff.
    async fn bounded<T>(
        &self,
        epoch: u64,
        call: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(self.inner.timeout, call).await {
            Ok(r) => r,
            Err(elapsed) => {
                if self.inner.link.follows_sentinel() {
                    self.inner.link.suspect(epoch);
                }
                Err(Failure::Uncertain(Box::new(elapsed)))
            }
        }
    }

    /// A Redis error on the connection of `epoch`, noted (a `READONLY` reply or, with
    /// Sentinel, a lost connection makes the store look for the primary again).
    fn failed(&self, epoch: u64, e: redis::RedisError) -> Failure {
        self.inner.link.observe(epoch, &e);
        Failure::from_redis(e)
    }

    /// Refuses a write while a failover of the primary is under way (see
    /// [`with_failover_events`](RedisStoreBuilder::with_failover_events)); otherwise the
    /// count of failovers seen so far, for [`acknowledge_unless_failover`](Self::acknowledge_unless_failover).
    fn refuse_during_failover(&self) -> Result<u64, Failure> {
        let link = &self.inner.link;
        let holds = link.holds();
        if link.held() {
            return Err(Failure::Certain(failover_underway(
                StoreErrorKind::Unavailable,
            )));
        }
        Ok(holds)
    }

    /// A write whose reply came after a failover began may be on a node about to be demoted,
    /// and lost with it: its outcome is unknown, never acknowledged.
    fn acknowledge_unless_failover(&self, holds: u64) -> Result<(), Failure> {
        if self.inner.link.holds() != holds {
            return Err(Failure::Certain(failover_underway(StoreErrorKind::Unknown)));
        }
        Ok(())
    }

    /// Runs one script call on `keys` (the first names the node); its reply, or its error
    /// as a failure.
    async fn eval(&self, lua: &Lua, keys: &Keys, args: &[&[u8]]) -> Result<Value, Failure> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(lua.call(&keys.all(), args));
        let replies = self.send(&pipe, lua, &keys.record).await?;
        match <[Value; 1]>::try_from(replies) {
            Ok([Value::ServerError(e)]) => Err(Failure::from_redis(e.into())),
            Ok([v]) => Ok(v),
            Err(_) => Err(Failure::Certain(corrupt("script reply count"))),
        }
    }

    /// Reads the record (`GET`, `TIME` and `PTTL`, pipelined: no script).
    async fn read(&self, key: &str) -> Result<Option<Found>, Failure> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(key).cmd("TIME").cmd("PTTL").arg(key);
        let (epoch, conn) = self.inner.link.conn().ok_or_else(reconnecting)?;
        let call = async {
            conn.pipeline(&pipe, key)
                .await
                .map_err(|e| self.failed(epoch, e))
        };
        let replies = self.bounded(epoch, call).await?;
        let [value, time, pttl]: [Value; 3] = replies
            .try_into()
            .map_err(|_| corrupt("read reply count"))?;
        let Some(value) = record::value_bytes(value)? else {
            return Ok(None);
        };
        let clock = Clock {
            now_ms: Some(record::time_ms(&time)?),
            pttl_ms: Clock::pttl(&pttl),
        };
        Ok(Some(record::decode(value, clock)?))
    }

    /// Makes sure replicas have a claim this store just won, when `WAIT` is on. On a dedicated
    /// connection that is a renewal of the claim followed by `WAIT`: replication is in order,
    /// so replicas that have the renewal have the claim before it.
    async fn replicate_claim(
        &self,
        keys: &Keys,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let (Some(dedicated), Some(wait)) = (&self.inner.dedicated, self.inner.wait) else {
            return self.replicate(&keys.record).await;
        };
        let tok = record::token_bytes(token).ok_or_else(fenced)?;
        let lease = millis(lease).to_string();
        let args: [&[u8]; 3] = [&tok, lease.as_bytes(), keys.id().as_bytes()];
        match self
            .write_and_wait(dedicated, &self.inner.scripts.extend, keys, &args, wait)
            .await
        {
            Ok((Value::Int(1), acked)) => self.inner.link.shortfalls.check(acked, wait.0),
            // Released or expired in between: the claim is not ours to report.
            Ok((Value::Int(0), _)) => Err(StoreError::with_source(
                StoreErrorKind::Unavailable,
                BadReply("the claim was gone before replicas confirmed it"),
            )),
            Ok(_) => Err(corrupt("extend script reply")),
            Err(f) => Err(f.into_error()),
        }
    }

    /// Sends `WAIT` when configured; fewer replicas than asked for is an error.
    async fn replicate(&self, key: &str) -> Result<(), StoreError> {
        let Some((wanted, timeout)) = self.inner.wait else {
            return Ok(());
        };
        let mut wait = redis::cmd("WAIT");
        wait.arg(wanted.get()).arg(millis(timeout));
        let (epoch, conn) = self
            .inner
            .link
            .conn()
            .ok_or_else(|| reconnecting().into_error())?;
        let call = conn.on_key(&wait, key);
        let acknowledged = match tokio::time::timeout(self.inner.timeout + timeout, call).await {
            Ok(Ok(Value::Int(n))) => u64::try_from(n).unwrap_or(0),
            Ok(Ok(_)) => return Err(corrupt("WAIT reply is not an integer")),
            Ok(Err(e)) => return Err(self.failed(epoch, e).into_error()),
            Err(elapsed) => return Err(StoreError::with_source(StoreErrorKind::Unknown, elapsed)),
        };
        self.inner.link.shortfalls.check(acknowledged, wanted)
    }

    /// Runs the script `lua` with `args` on `key`, then `WAIT`, as one pipeline on a dedicated
    /// connection: the script's reply, and how many replicas acknowledged it.
    async fn write_and_wait(
        &self,
        dedicated: &Dedicated,
        lua: &Lua,
        keys: &Keys,
        args: &[&[u8]],
        (wanted, wait): (NonZeroU32, Duration),
    ) -> Result<(Value, u64), Failure> {
        let key = keys.record.as_str();
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(lua.call(&keys.all(), args))
            .cmd("WAIT")
            .arg(wanted.get())
            .arg(millis(wait));
        let holds = self.refuse_during_failover()?;
        let (link_epoch, _) = self.inner.link.conn().ok_or_else(reconnecting)?;
        let call = async {
            let (epoch, mut conn) = dedicated
                .take()
                .await
                .map_err(|e| self.failed(link_epoch, e))?;
            let mut replies = conn
                .send(&pipe, key)
                .await
                .map_err(|e| self.failed(epoch, e))?;
            if matches!(replies.first(), Some(Value::ServerError(e)) if e.code() == "NOSCRIPT") {
                // A fresh node, or SCRIPT FLUSH: load it here and send once more (the failed
                // EVALSHA wrote nothing).
                conn.load(lua.code)
                    .await
                    .map_err(|e| self.failed(epoch, e))?;
                replies = conn
                    .send(&pipe, key)
                    .await
                    .map_err(|e| self.failed(epoch, e))?;
            }
            dedicated.give(epoch, conn);
            Ok::<_, Failure>((epoch, replies))
        };
        // Boxed: the dedicated connection's futures are 2.4 KB, which every claim's and
        // complete's future would carry (and copy) even where `WAIT` is off.
        let call = Box::pin(call);
        let (epoch, replies) = match tokio::time::timeout(self.inner.timeout + wait, call).await {
            Ok(r) => r?,
            Err(elapsed) => {
                if self.inner.link.follows_sentinel() {
                    self.inner.link.suspect(link_epoch);
                }
                return Err(Failure::Uncertain(Box::new(elapsed)));
            }
        };
        self.acknowledge_unless_failover(holds)?;
        let moved = self.inner.link.observe_replies(epoch, &replies);
        if !moved && !self.inner.link.usable(epoch) {
            return Err(Failure::Certain(StoreError::with_source(
                StoreErrorKind::Unknown,
                error::Reconnecting,
            )));
        }
        let [reply, acked]: [Value; 2] = replies
            .try_into()
            .map_err(|_| Failure::Certain(corrupt("pipeline reply count")))?;
        let reply = match reply {
            Value::ServerError(e) => return Err(Failure::from_redis(e.into())),
            v => v,
        };
        let acked = match acked {
            Value::Int(n) => u64::try_from(n).unwrap_or(0),
            _ => return Err(Failure::Certain(corrupt("WAIT reply is not an integer"))),
        };
        Ok((reply, acked))
    }

    /// Runs a fenced script (complete, extend, release) that answers 1 (done) or 0 (fenced).
    /// When the outcome is unknown, reads back: `settled` says from the record whether the
    /// call took effect (`Some(result)`) or can be sent once more (`None`).
    async fn fenced(
        &self,
        keys: &Keys,
        lua: &Lua,
        args: &[&[u8]],
        settled: impl Fn(Option<&Found>) -> Option<Result<(), StoreError>>,
    ) -> Result<Done, StoreError> {
        let key = keys.record.as_str();
        let mut lost = None;
        for _ in 0..2 {
            match self.eval(lua, keys, args).await {
                Ok(Value::Int(1)) => return Ok(Done::Written),
                Ok(Value::Int(2)) => return Ok(Done::DroppedPoint),
                Ok(Value::Int(0)) => return Err(fenced()),
                Ok(_) => return Err(corrupt("fenced script reply")),
                Err(Failure::Certain(e)) => return Err(e),
                Err(Failure::Uncertain(e)) => match self.read(key).await {
                    Ok(found) => match settled(found.as_ref()) {
                        // Read back: whether a point went with it is no longer known, and
                        // the recovery worker's sweep forgets it if so.
                        Some(result) => return result.map(|()| Done::Written),
                        None => lost = Some(e),
                    },
                    Err(_) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
                },
            }
        }
        Err(unknown(lost))
    }
}

/// What a fenced script did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    Written,
    /// Completed, and dropped the record's recovery point with it.
    DroppedPoint,
}

/// The failure of a call made while the store looks for its primary: nothing was sent.
fn reconnecting() -> Failure {
    Failure::Certain(StoreError::with_source(
        StoreErrorKind::Unavailable,
        error::Reconnecting,
    ))
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn invalidations(
        &self,
    ) -> Option<tokio::sync::broadcast::Receiver<crate::store::Invalidation>> {
        self.feed()
    }

    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let r = request;
        // Without quotas a scope changes nothing here: the record id already includes it.
        let scope = r.scope.filter(|_| self.inner.quotas.any());
        self.claim_as(scope, r.id, r.fingerprint, r.lease, r.ttl)
            .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let keys = self.keys(id);
        let tok = record::token_bytes(token).ok_or_else(fenced)?;
        // Zero ends the lease now: `millis`'s 1 ms floor (for `PX`) would hold the key 1 ms.
        let lease = if lease.is_zero() { 0 } else { millis(lease) }.to_string();
        let lua = &self.inner.scripts.extend;
        // Still ours and in progress: send again (renewing twice is harmless).
        let args: [&[u8]; 3] = [&tok, lease.as_bytes(), keys.id().as_bytes()];
        self.fenced(&keys, lua, &args, |found| match found {
            Some(f) if f.held_by(token) && !f.completed() => None,
            _ => Some(Err(fenced())),
        })
        .await
        .map(drop)
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let keys = self.keys(id);
        let key = keys.record.as_str();
        let tok = record::token_bytes(token).ok_or_else(fenced)?;
        let encoded = completion.encode();
        let ttl = millis(ttl).to_string();
        // The record id only where a scope counts the record: each argument costs Redis.
        let all: [&[u8]; 4] = [&tok, &encoded, ttl.as_bytes(), keys.id().as_bytes()];
        let args = &all[..if keys.group.is_some() { 4 } else { 3 }];
        let lua = &self.inner.scripts.complete;
        if let (Some(dedicated), Some(wait)) = (&self.inner.dedicated, self.inner.wait) {
            let mut lost = None;
            for _ in 0..2 {
                match self.write_and_wait(dedicated, lua, &keys, args, wait).await {
                    Ok((Value::Int(1), acked)) => {
                        return self.inner.link.shortfalls.check(acked, wait.0)
                    }
                    Ok((Value::Int(2), acked)) => {
                        self.forget_recoverable(id).await;
                        return self.inner.link.shortfalls.check(acked, wait.0);
                    }
                    Ok((Value::Int(0), _)) => return Err(fenced()),
                    Ok(_) => return Err(corrupt("complete script reply")),
                    Err(Failure::Certain(e)) => return Err(e),
                    Err(Failure::Uncertain(e)) => match self.read(key).await {
                        // It landed, but whether replicas have it is not known.
                        Ok(Some(f)) if f.held_by(token) && f.completed() => {
                            return Err(StoreError::with_source(StoreErrorKind::Unknown, e))
                        }
                        Ok(Some(f)) if f.held_by(token) => lost = Some(e),
                        Ok(_) => return Err(fenced()),
                        Err(_) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
                    },
                }
            }
            return Err(unknown(lost));
        }
        let done = self
            .fenced(&keys, lua, args, |found| match found {
                Some(f) if f.held_by(token) && f.completed() => Some(Ok(())),
                Some(f) if f.held_by(token) => None,
                _ => Some(Err(fenced())),
            })
            .await?;
        if done == Done::DroppedPoint {
            self.forget_recoverable(id).await;
        }
        self.replicate(key).await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let keys = self.keys(id);
        let tok = record::token_bytes(token).ok_or_else(fenced)?;
        let released = record::token_bytes(&token.released()).ok_or_else(fenced)?;
        let lua = &self.inner.scripts.release;
        let args: [&[u8]; 3] = [&tok, keys.id().as_bytes(), &released];
        self.fenced(&keys, lua, &args, |found| match found {
            // Gone: released, by this call or by expiry; the key is free either way.
            None => Some(Ok(())),
            // A takeover's record, kept by this call.
            Some(f) if f.released_by(token) => Some(Ok(())),
            Some(f) if f.held_by(token) && !f.completed() => None,
            Some(_) => Some(Err(fenced())),
        })
        .await
        .map(drop)
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        self.save_point(id, token, point).await
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        self.recoverable_records(limit).await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let key = self.key(id);
        match self.read(&key).await {
            Ok(found) => Ok(found.map(|f| f.record)),
            Err(e) => Err(e.into_error()),
        }
    }
}

#[cfg(test)]
mod tests;
