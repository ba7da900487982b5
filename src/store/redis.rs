//! A Redis store: one hash per record, one Lua script per operation, Redis's own clock.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::store::redis::RedisStore;
//!
//! // One node (or a primary behind a proxy):
//! let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
//! // Redis Cluster, from any subset of its nodes:
//! let cluster = RedisStore::connect_cluster(["redis://redis-a:7000/", "redis://redis-b:7000/"]).await?;
//! // With settings:
//! let tuned = RedisStore::builder()
//!     .with_key_prefix("shop:idem:")
//!     .with_timeout(std::time::Duration::from_millis(500))
//!     .connect("redis://127.0.0.1:6379/")
//!     .await?;
//! # drop((store, cluster, tuned));
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
//! - **Atomic claims.** Each operation is one Lua script, so it runs alone on the node that holds
//!   the record. A claim creates the record or returns the existing one in the same call.
//! - **One round trip per operation.** A new request costs 2 (claim, complete); a replay and a
//!   conflict cost 1 (the claim returns the record). `get` is 1. With [`with_wait`] a claim
//!   that wins costs one more (a renewal and `WAIT`, pipelined); a complete sends its `WAIT` in
//!   the same pipeline.
//! - **Fencing.** `complete`, `extend` and `release` check the token's generation **and** nonce;
//!   a stale token writes nothing and fails with [`StoreErrorKind::Fenced`].
//! - **Redis's clock.** Lease deadlines come from `TIME` inside the scripts, and expiry from
//!   `PEXPIRE`. The application's clock is never read, so clock skew between app servers does
//!   not matter.
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
//! service), while completed records still replay: the claim script reads before it writes, and
//! Redis refuses only a script's first write, not the script. A takeover, `complete` and
//! `extend` are writes and fail with `Full` too; `release` (a `DEL`) and `get` keep working.
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
//! # Redis Cluster
//!
//! All of a record is one hash, and its key carries the record id as a hash tag, so every
//! script touches one slot and the store runs unchanged on a cluster. `EVALSHA` goes to the
//! slot's primary; a `NOSCRIPT` answer (a fresh node, `SCRIPT FLUSH`) loads the script on every
//! node and runs it again, for a single node and for a cluster alike. The scripts are also
//! loaded when the store is built. `WAIT` goes to the primary of the record's slot.
//!
//! The cluster client itself resends a command whose connection dropped. Every script is safe
//! to resend: a claim is idempotent for its nonce and fingerprint, a `complete` that had landed
//! answers `Ok` the second time, and so does a `release` that had deleted the record.
//!
//! # Requirements
//!
//! Redis 5 or later (the scripts read `TIME` before they write, which needs effects
//! replication, the default since 5); tested with Redis 7.0, single node and cluster. TLS
//! is not enabled in this crate's `redis` features.
//!
//! # Key layout and record format
//!
//! One hash per record, at `<prefix>{<id>}`: the prefix (default `idem:`) and the record id in
//! lowercase hex, 64 characters, inside braces so it is the cluster hash tag. The prefix must not
//! contain braces. Fields:
//!
//! | field | holds |
//! |---|---|
//! | `v` | format version, `1` |
//! | `f` | fingerprint, 32 raw bytes |
//! | `g` | generation, decimal |
//! | `n` | nonce of the current claim, 16 raw bytes |
//! | `l` | lease deadline, milliseconds since the Unix epoch by Redis `TIME` |
//! | `c` | the answer, [`Completion::encode`] bytes (raw, no base64); present once completed |
//!
//! A record without `c` is in progress; with it, completed.
//!
//! [`with_wait`]: RedisStoreBuilder::with_wait

use std::error::Error as StdError;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

pub use redis;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, RedisError, Script, ScriptInvocation, Value};

use super::{Claim, ClaimOutcome, IdempotencyStore, StoreError, StoreErrorKind};
use crate::record::{Completion, Fingerprint, Record, RecordId, RecordState, Token};

/// The default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "idem:";

/// The default time one Redis call may take before its outcome counts as unknown.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// The record format the scripts write (field `v`).
const FORMAT: &[u8] = b"1";

/// The longest lease or TTL sent to Redis, in milliseconds (about 35,000 years). Lua numbers are
/// doubles, so `now + this` must stay below 2^53 to be exact: now is about 2^41 ms.
const MAX_MS: u64 = 1 << 50;

// Lua shared by the scripts.
//
// `now_ms` is Redis's clock: TIME inside the script, in milliseconds since the Unix epoch.
// `int` writes a whole number as plain digits. Fields are compared as strings (the generation
// against the caller's decimal), so the text must not depend on how a Redis version formats
// Lua numbers.
// `read` returns the reply shape `get` decodes: {v, f, g, remaining lease ms, mine, c}, where
// `mine` is 1 when the record's nonce is `nonce`. The nonce itself never leaves Redis.
const PRELUDE: &str = r"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(x)
  return string.format('%.0f', x)
end
local function read(r, now, nonce)
  local rem = 0
  if not r[6] then rem = math.max(tonumber(r[5]) - now, 0) end
  local mine = 0
  if r[4] == nonce then mine = 1 end
  return {r[1], r[2], r[3], rem, mine, r[6] or false}
end
";

// KEYS[1] record; ARGV: fingerprint, nonce, lease ms, ttl ms, format.
// Reads before it writes: under OOM Redis refuses a script's first write, not the script, so
// an existing record still comes back when Redis is full.
// Replies {0, generation} when this nonce holds the claim ({0, generation, ms the old lease
// had lapsed} on a takeover), or {1, <read>} for someone else's.
const CLAIM: &str = r"
local key, fp, nonce = KEYS[1], ARGV[1], ARGV[2]
local lease, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local r = redis.call('HMGET', key, 'v', 'f', 'g', 'n', 'l', 'c')
if r[1] then
  if r[1] == ARGV[5] and not r[6] then
    if r[4] == nonce and r[2] == fp then
      -- Our own claim, sent again after a lost reply. The fingerprint must match too:
      -- equal nonces alone never prove it is the same request.
      return {0, tonumber(r[3])}
    end
    if r[2] == fp and tonumber(r[5]) <= now then
      -- The holder's lease lapsed: take over, and keep the key at least one lease.
      local g = tonumber(r[3]) + 1
      redis.call('HSET', key, 'g', int(g), 'n', nonce, 'l', int(now + lease))
      if redis.call('PTTL', key) < lease then redis.call('PEXPIRE', key, int(lease)) end
      return {0, g, int(now - tonumber(r[5]))}
    end
  end
  local out = read(r, now, nonce)
  table.insert(out, 1, 1)
  return out
end
redis.call('HSET', key, 'v', ARGV[5], 'f', fp, 'g', '1', 'n', nonce, 'l', int(now + lease))
redis.call('PEXPIRE', key, int(math.max(ttl, lease)))
return {0, 1}
";

// The fence shared by complete, extend and release: `held` when generation and nonce match.
// ARGV[1] generation, ARGV[2] nonce. Each script replies 0 (fenced, nothing written) or 1.
const FENCE: &str = r"
local key = KEYS[1]
local r = redis.call('HMGET', key, 'g', 'n', 'c')
local held = r[1] == ARGV[1] and r[2] == ARGV[2]
";

// ARGV[3] lease ms. The key lives at least one more lease.
const EXTEND: &str = r"
if not held or r[3] then return 0 end
local lease = tonumber(ARGV[3])
redis.call('HSET', key, 'l', int(now_ms() + lease))
if redis.call('PTTL', key) < lease then redis.call('PEXPIRE', key, int(lease)) end
return 1
";

// ARGV[3] encoded completion, ARGV[4] ttl ms: retention starts now. Completed by this token
// already: a resend, whose answer is there; done, and the retention is not restarted.
const COMPLETE: &str = r"
if not held then return 0 end
if r[3] then return 1 end
redis.call('HSET', key, 'c', ARGV[3])
redis.call('PEXPIRE', key, ARGV[4])
return 1
";

// Absent: released by an earlier attempt, or expired; the key is free either way.
const RELEASE: &str = r"
if not r[1] then return 1 end
if not held or r[3] then return 0 end
redis.call('DEL', key)
return 1
";

// KEYS[1] record; ARGV[1] nonce to recognise (empty for none). Writes nothing.
const READ: &str = r"
local r = redis.call('HMGET', KEYS[1], 'v', 'f', 'g', 'n', 'l', 'c')
if not r[1] then return false end
return read(r, now_ms(), ARGV[1])
";

/// A script and its code (for `SCRIPT LOAD`, which [`Script`] does not expose).
#[derive(Debug)]
struct Lua {
    code: String,
    script: Script,
}

impl Lua {
    fn new(parts: &[&str]) -> Self {
        let code = parts.concat();
        let script = Script::new(&code);
        Self { code, script }
    }
}

#[derive(Debug)]
struct Scripts {
    claim: Lua,
    extend: Lua,
    complete: Lua,
    release: Lua,
    read: Lua,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Lua::new(&[PRELUDE, CLAIM]),
            extend: Lua::new(&[PRELUDE, FENCE, EXTEND]),
            complete: Lua::new(&[PRELUDE, FENCE, COMPLETE]),
            release: Lua::new(&[PRELUDE, FENCE, RELEASE]),
            read: Lua::new(&[PRELUDE, READ]),
        }
    }

    fn all(&self) -> [&Lua; 5] {
        [
            &self.claim,
            &self.extend,
            &self.complete,
            &self.release,
            &self.read,
        ]
    }
}

/// The connection a [`RedisStore`] talks through: one node, or a cluster.
///
/// Both reconnect by themselves. Build one by hand (or let [`RedisStore::connect`] and
/// [`RedisStore::connect_cluster`] do it) and pass it to [`RedisStore::new`]; `From` converts
/// either kind.
#[derive(Clone)]
#[non_exhaustive]
pub enum RedisConnection {
    /// One Redis node, reconnecting on failure.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisConnection::Single(c) => f.debug_tuple("Single").field(c).finish(),
            RedisConnection::Cluster(_) => f.write_str("Cluster"),
        }
    }
}

impl From<ConnectionManager> for RedisConnection {
    fn from(c: ConnectionManager) -> Self {
        RedisConnection::Single(c)
    }
}

impl From<ClusterConnection> for RedisConnection {
    fn from(c: ClusterConnection) -> Self {
        RedisConnection::Cluster(c)
    }
}

impl RedisConnection {
    async fn invoke(&self, inv: &ScriptInvocation<'_>) -> Result<Value, RedisError> {
        match self {
            RedisConnection::Single(c) => inv.invoke_async(&mut c.clone()).await,
            RedisConnection::Cluster(c) => inv.invoke_async(&mut c.clone()).await,
        }
    }

    /// Runs `cmd` on the node holding `key` (a single node is always that node).
    async fn on_key(&self, cmd: &Cmd, key: &str) -> Result<Value, RedisError> {
        match self {
            RedisConnection::Single(c) => cmd.query_async(&mut c.clone()).await,
            RedisConnection::Cluster(c) => {
                let route = Route::with_key(key, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                c.clone().route_command(cmd.clone(), routing).await
            }
        }
    }

    /// Runs `cmd` on every node; one `(node, reply)` per node, a node's error as its reply.
    async fn on_all(&self, cmd: &Cmd) -> Result<Vec<(Option<String>, Value)>, RedisError> {
        match self {
            RedisConnection::Single(c) => {
                let reply = match cmd.query_async::<Value>(&mut c.clone()).await {
                    Ok(v) => v,
                    Err(e) => match e.code() {
                        // A server's refusal (renamed command, ACL) is that node's answer.
                        Some(_) => Value::SimpleString(String::new()),
                        None => return Err(e),
                    },
                };
                Ok(vec![(None, reply)])
            }
            RedisConnection::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None));
                match c.clone().route_command(cmd.clone(), routing).await? {
                    Value::Map(pairs) => Ok(pairs
                        .into_iter()
                        .map(|(node, v)| (as_string(&node), v))
                        .collect()),
                    other => Ok(vec![(None, other)]),
                }
            }
        }
    }
}

/// Why a [`RedisStore`] could not be built. The text names the cause and what to do.
#[derive(Debug)]
#[non_exhaustive]
pub enum SetupError {
    /// Connecting, or a command the setup needs, failed.
    Redis(RedisError),
    /// A node would evict records: its `maxmemory-policy` is not `noeviction`.
    EvictionPolicy {
        /// The node (`host:port`) on a cluster; `None` on a single connection.
        node: Option<String>,
        /// The policy it runs.
        policy: String,
    },
    /// Neither `CONFIG GET maxmemory-policy` nor `INFO memory` told the policy.
    PolicyUnknown {
        /// The node (`host:port`) on a cluster; `None` on a single connection.
        node: Option<String>,
    },
    /// The key prefix contains `{` or `}`, which would change the cluster hash tag.
    KeyPrefix(String),
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = |node: &Option<String>| {
            node.as_ref()
                .map(|n| format!(" on {n}"))
                .unwrap_or_default()
        };
        match self {
            SetupError::Redis(e) => write!(
                f,
                "could not set up the Redis idempotency store: {}",
                super::error_chain(e)
            ),
            SetupError::EvictionPolicy { node, policy } => write!(
                f,
                "Redis{} runs maxmemory-policy {policy}, which can evict idempotency records \
                 (every record has a TTL, so volatile-* policies evict them too) and let a \
                 retry run twice; fix it with `CONFIG SET maxmemory-policy noeviction` (and in \
                 redis.conf), or opt out with RedisStoreBuilder::with_eviction_guard(false)",
                on(node)
            ),
            SetupError::PolicyUnknown { node } => write!(
                f,
                "could not read maxmemory-policy from Redis{} (CONFIG GET and INFO memory both \
                 failed); make sure it is noeviction, then opt out of the check with \
                 RedisStoreBuilder::with_eviction_guard(false)",
                on(node)
            ),
            SetupError::KeyPrefix(p) => write!(
                f,
                "idempotency key prefix {p:?} contains a brace; braces would change the Redis \
                 Cluster hash tag"
            ),
        }
    }
}

// The Redis error is part of the text (it names the cause), so it is not a `source` too.
impl StdError for SetupError {}

impl From<RedisError> for SetupError {
    fn from(e: RedisError) -> Self {
        SetupError::Redis(e)
    }
}

/// The source of a [`StoreErrorKind::Unavailable`] error when `WAIT` saw too few replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationShortfall {
    /// Replicas that acknowledged the write in time.
    pub acknowledged: u64,
    /// Replicas asked for with [`RedisStoreBuilder::with_wait`].
    pub wanted: u32,
}

impl fmt::Display for ReplicationShortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WAIT: {} of {} replicas acknowledged the idempotency record in time",
            self.acknowledged, self.wanted
        )
    }
}

impl StdError for ReplicationShortfall {}

/// A reply the store cannot read: a script and this code disagree, or a key holds something
/// that is not a record.
#[derive(Debug)]
struct BadReply(&'static str);

impl fmt::Display for BadReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply from Redis: {}", self.0)
    }
}

impl StdError for BadReply {}

/// Builds a [`RedisStore`]. Start from [`RedisStore::builder`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: String,
    wait: Option<(NonZeroU32, Duration)>,
    eviction_guard: bool,
    timeout: Duration,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            wait: None,
            eviction_guard: true,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl RedisStoreBuilder {
    /// The prefix of every key (default `idem:`). It must not contain `{` or `}`.
    #[must_use]
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// After each winning claim and each complete, waits until `replicas` replicas have the
    /// write, or `timeout` passes (at least 1 ms; `WAIT 0` would block forever). Fewer
    /// acknowledgements fail the call with [`StoreErrorKind::Unavailable`] and a
    /// [`ReplicationShortfall`] source. A winning claim costs one more round trip; `WAIT` runs
    /// on a connection of its own, never holding up other calls (see
    /// [durability](self#durability-aof-replication-and-wait)). Off by default.
    #[must_use]
    pub fn with_wait(mut self, replicas: NonZeroU32, timeout: Duration) -> Self {
        self.wait = Some((replicas, timeout.max(Duration::from_millis(1))));
        self
    }

    /// Whether to refuse a Redis whose `maxmemory-policy` can evict records (default `true`).
    /// See [the eviction guard](self#the-eviction-guard); turn it off only when you know why.
    #[must_use]
    pub fn with_eviction_guard(mut self, enabled: bool) -> Self {
        self.eviction_guard = enabled;
        self
    }

    /// How long one Redis call may take before its outcome counts as unknown and is read back
    /// (default 1 s). [`connect`](Self::connect) also sets it as the connection's response
    /// timeout (plus the `WAIT` timeout when set), and as the connect timeout: with nothing
    /// listening at the URL, `connect` fails within it, naming the cause.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects to one Redis node at `url` (`redis://[user:password@]host:port[/db]`),
    /// checks its eviction policy and loads the scripts.
    ///
    /// With the `redis-tls` feature, a `rediss://` URL connects over TLS (rustls, with the
    /// platform's root certificates; the server's certificate and host name are verified).
    /// For a private CA or a client certificate, use
    /// [`connect_with_tls`](Self::connect_with_tls). Without the feature a `rediss://` URL
    /// is refused.
    pub async fn connect(self, url: &str) -> Result<RedisStore, SetupError> {
        let client = redis::Client::open(url)?;
        self.connect_client(client).await
    }

    /// Like [`connect`](Self::connect) for a `rediss://` URL, trusting the PEM root
    /// certificates in `certs.root_cert` (a private CA) and presenting `certs.client_tls`
    /// when the server asks for a client certificate.
    #[cfg(feature = "redis-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-tls")))]
    pub async fn connect_with_tls(
        self,
        url: &str,
        certs: redis::TlsCertificates,
    ) -> Result<RedisStore, SetupError> {
        let client = redis::Client::build_with_tls(url, certs)?;
        self.connect_client(client).await
    }

    async fn connect_client(self, client: redis::Client) -> Result<RedisStore, SetupError> {
        // One plain attempt first, bounded by the timeout: its error is the real cause (the
        // connection manager would retry with backoff for seconds, then report less).
        let probe = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        drop(
            client
                .get_multiplexed_async_connection_with_config(&probe)
                .await?,
        );
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout()))
            .set_connection_timeout(Some(self.timeout))
            // Reconnect attempts back off to at most 1 s, so a restarted Redis is found soon.
            .set_max_delay(Duration::from_secs(1));
        let conn = tokio::time::timeout(
            self.timeout,
            ConnectionManager::new_with_config(client.clone(), config),
        )
        .await
        .map_err(|_| {
            RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {:?}", self.timeout),
            ))
        })??;
        self.build_with(conn.into(), Some(Source::Single(client)))
            .await
    }

    /// Connects to the Redis Cluster that `nodes` belong to (any subset of its nodes, as
    /// `redis://host:port` urls), checks every node's eviction policy and loads the scripts.
    pub async fn connect_cluster<I, S>(self, nodes: I) -> Result<RedisStore, SetupError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(|s| s.as_ref().to_owned()).collect();
        let client = ClusterClientBuilder::new(nodes)
            .response_timeout(self.response_timeout())
            .connection_timeout(self.timeout)
            .build()?;
        let conn = client.get_async_connection().await?;
        self.build_with(conn.into(), Some(Source::Cluster(client)))
            .await
    }

    /// Builds the store on an existing connection: checks the eviction policy (unless turned
    /// off) and loads the scripts.
    ///
    /// With [`with_wait`](Self::with_wait), a store built here sends `WAIT` on `conn` itself,
    /// where it holds up every other call on that connection until replicas answer; use
    /// [`connect`](Self::connect) or [`connect_cluster`](Self::connect_cluster), which send
    /// each write and its `WAIT` on a connection of their own.
    pub async fn build(self, conn: impl Into<RedisConnection>) -> Result<RedisStore, SetupError> {
        self.build_with(conn.into(), None).await
    }

    async fn build_with(
        self,
        conn: RedisConnection,
        source: Option<Source>,
    ) -> Result<RedisStore, SetupError> {
        if self.prefix.contains(['{', '}']) {
            return Err(SetupError::KeyPrefix(self.prefix));
        }
        if self.eviction_guard {
            check_eviction_policy(&conn).await?;
        }
        let scripts = Scripts::new();
        // Loading now saves the first call of each script a NOSCRIPT round trip. On a cluster,
        // SCRIPT LOAD goes to every node.
        for script in scripts.all() {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(&script.code);
            match &conn {
                RedisConnection::Single(c) => load.query_async::<()>(&mut c.clone()).await?,
                RedisConnection::Cluster(c) => load.query_async::<()>(&mut c.clone()).await?,
            }
        }
        let dedicated = match (self.wait, source) {
            (Some(_), Some(source)) => Some(Dedicated {
                source,
                timeout: self.timeout,
                response_timeout: self.response_timeout(),
                idle: std::sync::Mutex::new(Vec::new()),
            }),
            _ => None,
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                conn,
                dedicated,
                prefix: self.prefix,
                wait: self.wait,
                timeout: self.timeout,
                scripts,
            }),
        })
    }

    fn response_timeout(&self) -> Duration {
        self.timeout + self.wait.map_or(Duration::ZERO, |(_, t)| t)
    }
}

async fn check_eviction_policy(conn: &RedisConnection) -> Result<(), SetupError> {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("maxmemory-policy");
    let from_config = conn.on_all(&get).await?;
    let mut info_replies = None;
    for (node, reply) in from_config {
        let policy = match policy_from_config(&reply) {
            Some(p) => p,
            None => {
                // CONFIG is disabled, renamed or denied here: INFO memory tells it too.
                if info_replies.is_none() {
                    let mut info = redis::cmd("INFO");
                    info.arg("memory");
                    info_replies = Some(conn.on_all(&info).await?);
                }
                info_replies
                    .as_ref()
                    .and_then(|all| all.iter().find(|(n, _)| *n == node))
                    .and_then(|(_, v)| policy_from_info(v))
                    .ok_or_else(|| SetupError::PolicyUnknown { node: node.clone() })?
            }
        };
        if policy != "noeviction" {
            return Err(SetupError::EvictionPolicy { node, policy });
        }
    }
    Ok(())
}

fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// `CONFIG GET maxmemory-policy` answers `[name, value]` (RESP2) or `{name: value}` (RESP3).
fn policy_from_config(v: &Value) -> Option<String> {
    match v {
        Value::Array(items) if items.len() == 2 => as_string(&items[1]),
        Value::Map(pairs) if pairs.len() == 1 => as_string(&pairs[0].1),
        _ => None,
    }
}

fn policy_from_info(v: &Value) -> Option<String> {
    as_string(v)?
        .lines()
        .find_map(|l| l.strip_prefix("maxmemory_policy:"))
        .map(|p| p.trim().to_owned())
}

/// Where dedicated connections come from. Built once per store: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Source {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// A connection only one call uses at a time.
enum DedicatedConn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// Idle connections kept for the next write that waits for replicas.
const DEDICATED_IDLE: usize = 8;

/// A small pool of connections for a write and its `WAIT`.
///
/// `WAIT` blocks the connection it is sent on until replicas acknowledge that connection's
/// writes, so on the shared, multiplexed connection it would hold up every other call (a
/// replay would wait for someone else's replica). Each write that is followed by `WAIT` takes
/// a connection of its own instead, sends both as one pipeline, and gives it back. Connections
/// are opened on demand (a burst opens more) and at most [`DEDICATED_IDLE`] are kept idle.
struct Dedicated {
    source: Source,
    timeout: Duration,
    response_timeout: Duration,
    idle: std::sync::Mutex<Vec<DedicatedConn>>,
}

impl Dedicated {
    async fn take(&self) -> Result<DedicatedConn, RedisError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(conn) = idle {
            return Ok(conn);
        }
        match &self.source {
            Source::Single(client) => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.response_timeout));
                let conn = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                Ok(DedicatedConn::Single(conn))
            }
            Source::Cluster(client) => {
                Ok(DedicatedConn::Cluster(client.get_async_connection().await?))
            }
        }
    }

    /// Returns a connection whose last call ended cleanly.
    fn give(&self, conn: DedicatedConn) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < DEDICATED_IDLE {
            idle.push(conn);
        }
    }
}

impl DedicatedConn {
    /// Sends `pipe` to the node holding `key`; a command's error is its reply.
    async fn send(&mut self, pipe: &redis::Pipeline, key: &str) -> Result<Vec<Value>, RedisError> {
        match self {
            DedicatedConn::Single(c) => pipe.query_async(c).await,
            DedicatedConn::Cluster(c) => {
                let route = Route::with_key(key, SlotAddr::Master);
                c.route_pipeline(
                    pipe.clone(),
                    0,
                    pipe.len(),
                    SingleNodeRoutingInfo::SpecificNode(route),
                )
                .await
            }
        }
    }

    async fn load(&mut self, code: &str) -> Result<(), RedisError> {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(code);
        match self {
            DedicatedConn::Single(c) => load.query_async(c).await,
            DedicatedConn::Cluster(c) => load.query_async(c).await,
        }
    }
}

/// An [`IdempotencyStore`] on Redis or Redis Cluster. Cloning shares the connection.
///
/// See the [module docs](self) for what it guarantees and how to run Redis for it.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: RedisConnection,
    /// Connections for writes followed by `WAIT`, when `WAIT` is on and the store made its
    /// own connection.
    dedicated: Option<Dedicated>,
    prefix: String,
    wait: Option<(NonZeroU32, Duration)>,
    timeout: Duration,
    scripts: Scripts,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("conn", &self.inner.conn)
            .field("prefix", &self.inner.prefix)
            .field("wait", &self.inner.wait)
            .field("timeout", &self.inner.timeout)
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

    /// The Redis key of `id`: `<prefix>{<hex id>}`.
    pub fn key(&self, id: &RecordId) -> String {
        record_key(&self.inner.prefix, id)
    }

    /// Runs one script call, bounded by the timeout.
    async fn eval(&self, inv: &ScriptInvocation<'_>) -> Result<Value, Failure> {
        match tokio::time::timeout(self.inner.timeout, self.inner.conn.invoke(inv)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Failure::from_redis(e)),
            Err(elapsed) => Err(Failure::Uncertain(Box::new(elapsed))),
        }
    }

    /// Reads the record, telling whether `nonce` holds it.
    async fn read(&self, key: &str, nonce: &[u8]) -> Result<Option<Found>, Failure> {
        let mut inv = self.inner.scripts.read.script.key(key);
        inv.arg(nonce);
        parse_read(self.eval(&inv).await?).map_err(Failure::Certain)
    }

    /// Makes sure replicas have a claim this store just won, when `WAIT` is on. On a dedicated
    /// connection that is a renewal of the claim followed by `WAIT`: replication is in order,
    /// so replicas that have the renewal have the claim before it.
    async fn replicate_claim(
        &self,
        key: &str,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let (Some(dedicated), Some(wait)) = (&self.inner.dedicated, self.inner.wait) else {
            return self.replicate(key).await;
        };
        let (generation, lease) = (token.generation().to_string(), millis(lease).to_string());
        let args: [&[u8]; 3] = [generation.as_bytes(), &token.nonce()[..], lease.as_bytes()];
        match self
            .write_and_wait(dedicated, &self.inner.scripts.extend, key, &args, wait)
            .await
        {
            Ok((Value::Int(1), acked)) => shortfall(acked, wait.0),
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
        let call = self.inner.conn.on_key(&wait, key);
        let acknowledged = match tokio::time::timeout(self.inner.timeout + timeout, call).await {
            Ok(Ok(Value::Int(n))) => u64::try_from(n).unwrap_or(0),
            Ok(Ok(_)) => return Err(corrupt("WAIT reply is not an integer")),
            Ok(Err(e)) => return Err(Failure::from_redis(e).into_error()),
            Err(elapsed) => return Err(StoreError::with_source(StoreErrorKind::Unknown, elapsed)),
        };
        if acknowledged < u64::from(wanted.get()) {
            return Err(StoreError::with_source(
                StoreErrorKind::Unavailable,
                ReplicationShortfall {
                    acknowledged,
                    wanted: wanted.get(),
                },
            ));
        }
        Ok(())
    }

    /// Runs the script `lua` with `args` on `key`, then `WAIT`, as one pipeline on a dedicated
    /// connection: the script's reply, and how many replicas acknowledged it.
    async fn write_and_wait(
        &self,
        dedicated: &Dedicated,
        lua: &Lua,
        key: &str,
        args: &[&[u8]],
        (wanted, wait): (NonZeroU32, Duration),
    ) -> Result<(Value, u64), Failure> {
        let mut eval = redis::cmd("EVALSHA");
        eval.arg(lua.script.get_hash()).arg(1).arg(key);
        for a in args {
            eval.arg(*a);
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(eval)
            .cmd("WAIT")
            .arg(wanted.get())
            .arg(millis(wait));
        let call = async {
            let mut conn = dedicated.take().await.map_err(Failure::from_redis)?;
            let mut replies = conn.send(&pipe, key).await.map_err(Failure::from_redis)?;
            if matches!(replies.first(), Some(Value::ServerError(e)) if e.code() == "NOSCRIPT") {
                // A fresh node, or SCRIPT FLUSH: load it here and send once more (the failed
                // EVALSHA wrote nothing).
                conn.load(&lua.code).await.map_err(Failure::from_redis)?;
                replies = conn.send(&pipe, key).await.map_err(Failure::from_redis)?;
            }
            dedicated.give(conn);
            Ok(replies)
        };
        let replies = match tokio::time::timeout(self.inner.timeout + wait, call).await {
            Ok(r) => r?,
            Err(elapsed) => return Err(Failure::Uncertain(Box::new(elapsed))),
        };
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
        key: &str,
        token: &Token,
        inv: &ScriptInvocation<'_>,
        settled: impl Fn(Option<&Found>) -> Option<Result<(), StoreError>>,
    ) -> Result<(), StoreError> {
        let mut lost = None;
        for _ in 0..2 {
            match self.eval(inv).await {
                Ok(Value::Int(1)) => return Ok(()),
                Ok(Value::Int(0)) => return Err(StoreError::new(StoreErrorKind::Fenced)),
                Ok(_) => return Err(corrupt("fenced script reply")),
                Err(Failure::Certain(e)) => return Err(e),
                Err(Failure::Uncertain(e)) => match self.read(key, token.nonce()).await {
                    Ok(found) => match settled(found.as_ref()) {
                        Some(result) => return result,
                        None => lost = Some(e),
                    },
                    Err(_) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
                },
            }
        }
        Err(unknown(lost))
    }
}

/// `Ok` when `acknowledged` replicas are enough, else [`ReplicationShortfall`].
fn shortfall(acknowledged: u64, wanted: NonZeroU32) -> Result<(), StoreError> {
    if acknowledged < u64::from(wanted.get()) {
        return Err(StoreError::with_source(
            StoreErrorKind::Unavailable,
            ReplicationShortfall {
                acknowledged,
                wanted: wanted.get(),
            },
        ));
    }
    Ok(())
}

/// A record as a script read it.
#[derive(Debug)]
struct Found {
    record: Record,
    /// The nonce asked about holds the record.
    mine: bool,
}

impl Found {
    /// Held by `token`: the generation matches and the nonce is `token`'s.
    fn held_by(&self, token: &Token) -> bool {
        self.mine && self.record.generation == token.generation()
    }

    fn completed(&self) -> bool {
        matches!(self.record.state, RecordState::Completed(_))
    }
}

/// Why a call failed: for sure, or with an outcome nobody knows yet.
enum Failure {
    /// The call did not happen (or was refused): map and return.
    Certain(StoreError),
    /// A timeout or a connection lost mid-call: it may have run. Read back before deciding.
    Uncertain(Box<dyn StdError + Send + Sync + 'static>),
}

impl Failure {
    fn from_redis(e: RedisError) -> Self {
        // A refused connection never carried the call; other I/O errors may have lost its reply.
        if e.is_timeout() || (e.is_io_error() && !e.is_connection_refusal()) {
            return Failure::Uncertain(Box::new(e));
        }
        // Redis 7 passes a script's OOM error on with its code; older versions wrap it in ERR.
        let oom = e.code() == Some("OOM")
            || e.detail()
                .is_some_and(|d| d.contains("OOM command not allowed"));
        let kind = match e.code() {
            _ if oom => StoreErrorKind::Full,
            Some("WRONGTYPE") => StoreErrorKind::Corrupt,
            _ => StoreErrorKind::Unavailable,
        };
        Failure::Certain(StoreError::with_source(kind, e))
    }

    fn into_error(self) -> StoreError {
        match self {
            Failure::Certain(e) => e,
            Failure::Uncertain(e) => StoreError::with_source(StoreErrorKind::Unknown, e),
        }
    }
}

fn unknown(source: Option<Box<dyn StdError + Send + Sync + 'static>>) -> StoreError {
    match source {
        Some(e) => StoreError::with_source(StoreErrorKind::Unknown, e),
        None => StoreError::new(StoreErrorKind::Unknown),
    }
}

fn corrupt(what: &'static str) -> StoreError {
    StoreError::with_source(StoreErrorKind::Corrupt, BadReply(what))
}

/// `<prefix>{<hex id>}`: the braces make the id the cluster hash tag, whatever the prefix.
fn record_key(prefix: &str, id: &RecordId) -> String {
    format!("{prefix}{{{}}}", id.to_hex())
}

/// Milliseconds for Redis, rounded up (a lease is never shorter than asked), 1 ms at least
/// (`PEXPIRE 0` deletes) and [`MAX_MS`] at most.
fn millis(d: Duration) -> u64 {
    let ms = d.as_micros().div_ceil(1000);
    u64::try_from(ms).unwrap_or(MAX_MS).clamp(1, MAX_MS)
}

fn bytes_of(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

fn int_of(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn is_nil(v: &Value) -> bool {
    matches!(v, Value::Nil | Value::Boolean(false))
}

/// Decodes the `read` reply shape: nil, or `[v, f, g, remaining ms, mine, c | nil]`.
fn parse_read(v: Value) -> Result<Option<Found>, StoreError> {
    match v {
        v if is_nil(&v) => Ok(None),
        Value::Array(items) => parse_found(items).map(Some),
        _ => Err(corrupt("read reply is not an array")),
    }
}

fn parse_found(items: Vec<Value>) -> Result<Found, StoreError> {
    let [v, f, g, rem, mine, c]: [Value; 6] = items
        .try_into()
        .map_err(|_| corrupt("record reply has the wrong length"))?;
    if bytes_of(v).as_deref() != Some(FORMAT) {
        return Err(corrupt("unknown record format version"));
    }
    let fingerprint: [u8; 32] = bytes_of(f)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes"))?;
    let generation = int_of(&g)
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| corrupt("generation is not a number"))?;
    let state = if is_nil(&c) {
        let ms = int_of(&rem).ok_or_else(|| corrupt("lease is not a number"))?;
        RecordState::InProgress {
            lease_remaining: Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        }
    } else {
        let bytes = bytes_of(c).ok_or_else(|| corrupt("completion is not bytes"))?;
        let completion = Completion::decode(Bytes::from(bytes))
            .map_err(|e| StoreError::with_source(StoreErrorKind::Corrupt, e))?;
        RecordState::Completed(completion)
    };
    Ok(Found {
        record: Record {
            fingerprint: Fingerprint::from_bytes(fingerprint),
            generation,
            state,
        },
        mine: int_of(&mine) == Some(1),
    })
}

/// Decodes the claim reply: `[0, generation]` (claimed with `nonce`) or `[1, <read shape>]`.
fn parse_claim(v: Value, nonce: [u8; 16]) -> Result<ClaimOutcome, StoreError> {
    let Value::Array(mut items) = v else {
        return Err(corrupt("claim reply is not an array"));
    };
    if items.is_empty() {
        return Err(corrupt("claim reply is empty"));
    }
    match int_of(&items.remove(0)) {
        Some(0) => {
            let generation = items
                .first()
                .and_then(int_of)
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| corrupt("claimed generation is not a number"))?;
            // A takeover also says how long the old lease had lapsed.
            let lapsed_for = items
                .get(1)
                .and_then(int_of)
                .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
            Ok(claimed(generation, nonce, lapsed_for))
        }
        Some(1) => Ok(ClaimOutcome::Existing(parse_found(items)?.record)),
        _ => Err(corrupt("claim reply tag")),
    }
}

/// A claim this store's nonce holds. Every fresh record starts at generation 1, so a higher
/// one was a takeover.
fn claimed(generation: u64, nonce: [u8; 16], lapsed_for: Option<Duration>) -> ClaimOutcome {
    ClaimOutcome::Claimed(Claim {
        token: Token::from_parts(generation, nonce),
        takeover: generation > 1,
        lapsed_for,
    })
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let key = self.key(id);
        // The nonce is made here, so a claim whose reply is lost can be recognised.
        let nonce = *Token::generate(0)?.nonce();
        let mut inv = self.inner.scripts.claim.script.key(&key);
        inv.arg(&fingerprint.as_bytes()[..])
            .arg(&nonce[..])
            .arg(millis(lease))
            .arg(millis(ttl))
            .arg(FORMAT);
        let mut lost = None;
        for _ in 0..2 {
            let outcome = match self.eval(&inv).await {
                Ok(v) => parse_claim(v, nonce)?,
                Err(Failure::Certain(e)) => return Err(e),
                Err(Failure::Uncertain(e)) => match self.read(&key, &nonce).await {
                    Ok(Some(found))
                        if found.mine
                            && !found.completed()
                            && found.record.fingerprint == *fingerprint =>
                    {
                        // Read back after a lost reply: the lapse is no longer known.
                        claimed(found.record.generation, nonce, None)
                    }
                    Ok(Some(found)) => ClaimOutcome::Existing(found.record),
                    // The claim never arrived (the read went after it on the same
                    // connection): send it again. It is idempotent for this nonce.
                    Ok(None) => {
                        lost = Some(e);
                        continue;
                    }
                    Err(_) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
                },
            };
            if let ClaimOutcome::Claimed(claim) = &outcome {
                if let Err(e) = self.replicate_claim(&key, &claim.token, lease).await {
                    // Not durable: give the key back so a retry need not wait out the lease.
                    let _ = self.release(id, &claim.token).await;
                    return Err(e);
                }
            }
            return Ok(outcome);
        }
        Err(unknown(lost))
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut inv = self.inner.scripts.extend.script.key(&key);
        inv.arg(token.generation())
            .arg(&token.nonce()[..])
            .arg(millis(lease));
        // Still ours and in progress: send again (renewing twice is harmless).
        self.fenced(&key, token, &inv, |found| match found {
            Some(f) if f.held_by(token) && !f.completed() => None,
            _ => Some(Err(StoreError::new(StoreErrorKind::Fenced))),
        })
        .await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let key = self.key(id);
        let encoded = completion.encode();
        if let (Some(dedicated), Some(wait)) = (&self.inner.dedicated, self.inner.wait) {
            let (generation, ttl) = (token.generation().to_string(), millis(ttl).to_string());
            let args: [&[u8]; 4] = [
                generation.as_bytes(),
                &token.nonce()[..],
                &encoded,
                ttl.as_bytes(),
            ];
            let mut lost = None;
            for _ in 0..2 {
                let scripts = &self.inner.scripts;
                match self
                    .write_and_wait(dedicated, &scripts.complete, &key, &args, wait)
                    .await
                {
                    Ok((Value::Int(1), acked)) => return shortfall(acked, wait.0),
                    Ok((Value::Int(0), _)) => return Err(StoreError::new(StoreErrorKind::Fenced)),
                    Ok(_) => return Err(corrupt("complete script reply")),
                    Err(Failure::Certain(e)) => return Err(e),
                    Err(Failure::Uncertain(e)) => match self.read(&key, token.nonce()).await {
                        // It landed, but whether replicas have it is not known.
                        Ok(Some(f)) if f.held_by(token) && f.completed() => {
                            return Err(StoreError::with_source(StoreErrorKind::Unknown, e))
                        }
                        Ok(Some(f)) if f.held_by(token) => lost = Some(e),
                        Ok(_) => return Err(StoreError::new(StoreErrorKind::Fenced)),
                        Err(_) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
                    },
                }
            }
            return Err(unknown(lost));
        }
        let mut inv = self.inner.scripts.complete.script.key(&key);
        inv.arg(token.generation())
            .arg(&token.nonce()[..])
            .arg(encoded)
            .arg(millis(ttl));
        self.fenced(&key, token, &inv, |found| match found {
            Some(f) if f.held_by(token) && f.completed() => Some(Ok(())),
            Some(f) if f.held_by(token) => None,
            _ => Some(Err(StoreError::new(StoreErrorKind::Fenced))),
        })
        .await?;
        self.replicate(&key).await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let key = self.key(id);
        let mut inv = self.inner.scripts.release.script.key(&key);
        inv.arg(token.generation()).arg(&token.nonce()[..]);
        self.fenced(&key, token, &inv, |found| match found {
            // Gone: released, by this call or by expiry; the key is free either way.
            None => Some(Ok(())),
            Some(f) if f.held_by(token) && !f.completed() => None,
            Some(_) => Some(Err(StoreError::new(StoreErrorKind::Fenced))),
        })
        .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let key = self.key(id);
        match self.read(&key, &[]).await {
            Ok(found) => Ok(found.map(|f| f.record)),
            Err(e) => Err(e.into_error()),
        }
    }
}

// The operator API. KEYS[1] record. Reads the record and its remaining time to live.
const INSPECT: &str = r"
local r = redis.call('HMGET', KEYS[1], 'v', 'f', 'g', 'n', 'l', 'c')
if not r[1] then return false end
local out = read(r, now_ms(), '')
table.insert(out, redis.call('PTTL', KEYS[1]))
return out
";

// KEYS[1] record; ARGV[1] '0' to remove a record in progress, '1' a completed one.
// Replies 0 absent, 1 removed, 2 refused (the other state).
const REMOVE: &str = r"
local r = redis.call('HMGET', KEYS[1], 'v', 'c')
if not r[1] then return 0 end
local done = '0'
if r[2] then done = '1' end
if done ~= ARGV[1] then return 2 end
redis.call('DEL', KEYS[1])
return 1
";

impl RedisStore {
    /// Runs REMOVE; `completed` picks the state that may be removed. Operator calls skip
    /// `WAIT`: they are rare, and the operator reads the result back.
    async fn remove(&self, id: &RecordId, completed: bool) -> Result<super::Removal, StoreError> {
        let script = Script::new(REMOVE);
        let key = self.key(id);
        let mut inv = script.key(&key);
        inv.arg(if completed { "1" } else { "0" });
        match int_of(&self.eval(&inv).await.map_err(Failure::into_error)?) {
            Some(0) => Ok(super::Removal::Absent),
            Some(1) => Ok(super::Removal::Removed),
            Some(2) => Ok(super::Removal::Refused),
            _ => Err(corrupt("remove reply is not 0, 1 or 2")),
        }
    }
}

#[async_trait]
impl super::IdempotencyAdmin for RedisStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<super::RecordInfo>, StoreError> {
        let script = Script::new(&[PRELUDE, INSPECT].concat());
        let key = self.key(id);
        let inv = script.key(&key);
        let mut items = match self.eval(&inv).await.map_err(Failure::into_error)? {
            v if is_nil(&v) => return Ok(None),
            Value::Array(items) if items.len() == 7 => items,
            _ => return Err(corrupt("inspect reply is not 7 values")),
        };
        let pttl = items.pop().as_ref().and_then(int_of).unwrap_or(0);
        let found = parse_found(items)?;
        // PTTL is -1 for a key without expiry, which the store never writes.
        let expires_in = Duration::from_millis(u64::try_from(pttl).unwrap_or(0));
        Ok(Some(super::RecordInfo::new(&found.record, expires_in)))
    }

    async fn force_release(&self, id: &RecordId) -> Result<super::Removal, StoreError> {
        self.remove(id, false).await
    }

    async fn delete(&self, id: &RecordId) -> Result<super::Removal, StoreError> {
        self.remove(id, true).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn bulk(b: &[u8]) -> Value {
        Value::BulkString(b.to_vec())
    }

    fn read_reply(c: Value) -> Vec<Value> {
        vec![
            bulk(b"1"),
            bulk(&[7; 32]),
            bulk(b"3"),
            Value::Int(1500),
            Value::Int(0),
            c,
        ]
    }

    #[test]
    fn millis_round_up_and_stay_in_range() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(1)), 1);
        assert_eq!(millis(Duration::from_micros(1001)), 2);
        assert_eq!(millis(Duration::from_secs(30)), 30_000);
        assert_eq!(millis(Duration::MAX), MAX_MS);
    }

    #[test]
    fn claim_replies_decode_to_outcomes() {
        let nonce = [9; 16];
        match parse_claim(Value::Array(vec![Value::Int(0), Value::Int(1)]), nonce).unwrap() {
            ClaimOutcome::Claimed(c) => {
                assert_eq!(c.token, Token::from_parts(1, nonce));
                assert!(!c.takeover);
            }
            other @ ClaimOutcome::Existing(_) => panic!("{other:?}"),
        }
        match parse_claim(Value::Array(vec![Value::Int(0), Value::Int(4)]), nonce).unwrap() {
            ClaimOutcome::Claimed(c) => assert!(c.takeover),
            other @ ClaimOutcome::Existing(_) => panic!("{other:?}"),
        }
        let mut existing = vec![Value::Int(1)];
        existing.extend(read_reply(Value::Nil));
        match parse_claim(Value::Array(existing), nonce).unwrap() {
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.fingerprint, Fingerprint::from_bytes([7; 32]));
                assert_eq!(r.generation, 3);
                assert_eq!(
                    r.state,
                    RecordState::InProgress {
                        lease_remaining: Duration::from_millis(1500)
                    }
                );
            }
            other @ ClaimOutcome::Claimed(_) => panic!("{other:?}"),
        }
    }

    #[test]
    fn completed_records_decode_and_bad_bytes_are_corrupt() {
        let done = Completion::Tombstone {
            status: StatusCode::CREATED,
        };
        let found = parse_read(Value::Array(read_reply(bulk(&done.encode()))))
            .unwrap()
            .unwrap();
        assert_eq!(found.record.state, RecordState::Completed(done));
        // RESP3 answers Lua's false as a boolean.
        assert!(parse_read(Value::Boolean(false)).unwrap().is_none());
        assert!(parse_read(Value::Nil).unwrap().is_none());

        let corrupt_kind = |v| parse_read(v).unwrap_err().kind();
        assert_eq!(
            corrupt_kind(Value::Array(read_reply(bulk(b"\x09junk")))),
            StoreErrorKind::Corrupt
        );
        let mut v2 = read_reply(Value::Nil);
        v2[0] = bulk(b"2");
        assert_eq!(corrupt_kind(Value::Array(v2)), StoreErrorKind::Corrupt);
        let mut short_fp = read_reply(Value::Nil);
        short_fp[1] = bulk(&[1; 31]);
        assert_eq!(
            corrupt_kind(Value::Array(short_fp)),
            StoreErrorKind::Corrupt
        );
        assert_eq!(corrupt_kind(Value::Int(3)), StoreErrorKind::Corrupt);
    }

    #[test]
    fn keys_carry_the_record_id_as_hash_tag() {
        let id = RecordId::new(Some("t"), "k");
        let key = record_key(DEFAULT_KEY_PREFIX, &id);
        assert_eq!(key, format!("idem:{{{}}}", id.to_hex()));
        // Redis Cluster hashes what is between the first `{` and the next `}`.
        let tag = key
            .split_once('{')
            .and_then(|(_, rest)| rest.split_once('}'));
        assert_eq!(tag.map(|(t, _)| t.to_owned()), Some(id.to_hex()));
        assert_ne!(record_key("a:", &id), record_key("b:", &id));
    }

    #[test]
    fn eviction_policy_is_read_from_config_or_info() {
        let config = Value::Array(vec![bulk(b"maxmemory-policy"), bulk(b"allkeys-lru")]);
        assert_eq!(policy_from_config(&config).as_deref(), Some("allkeys-lru"));
        let resp3 = Value::Map(vec![(bulk(b"maxmemory-policy"), bulk(b"noeviction"))]);
        assert_eq!(policy_from_config(&resp3).as_deref(), Some("noeviction"));
        assert_eq!(policy_from_config(&Value::Array(vec![])), None);
        let info = bulk(b"# Memory\r\nused_memory:1\r\nmaxmemory_policy:volatile-lru\r\n");
        assert_eq!(policy_from_info(&info).as_deref(), Some("volatile-lru"));
        assert_eq!(policy_from_info(&bulk(b"# Memory\r\n")), None);
    }

    #[test]
    fn redis_errors_map_to_store_error_kinds() {
        let kind = |e: RedisError| Failure::from_redis(e).into_error().kind();
        let server = |code: &str, detail: &str| {
            redis::make_extension_error(code.to_owned(), Some(detail.to_owned()))
        };
        let oom7 =
            "command not allowed when used memory > 'maxmemory'. script: f, on @user_script:9.";
        assert_eq!(kind(server("OOM", oom7)), StoreErrorKind::Full);
        let oom6 = "Error running script (call to f_1): @user_script:9: -OOM command not allowed \
                    when used memory > 'maxmemory'.";
        assert_eq!(kind(server("ERR", oom6)), StoreErrorKind::Full);
        assert_eq!(kind(server("NOPERM", "no")), StoreErrorKind::Unavailable);
        assert_eq!(kind(server("WRONGTYPE", "hash")), StoreErrorKind::Corrupt);
        let io = |k| RedisError::from(std::io::Error::from(k));
        assert_eq!(
            kind(io(std::io::ErrorKind::TimedOut)),
            StoreErrorKind::Unknown
        );
        assert_eq!(
            kind(io(std::io::ErrorKind::ConnectionReset)),
            StoreErrorKind::Unknown
        );
        assert_eq!(
            kind(io(std::io::ErrorKind::ConnectionRefused)),
            StoreErrorKind::Unavailable
        );
    }

    #[test]
    fn setup_errors_name_the_policy_and_the_fix() {
        let e = SetupError::EvictionPolicy {
            node: None,
            policy: "volatile-lru".to_owned(),
        };
        let msg = e.to_string();
        assert!(msg.contains("volatile-lru"), "{msg}");
        assert!(
            msg.contains("CONFIG SET maxmemory-policy noeviction"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn equal_nonces_with_different_fingerprints_claim_once() {
        let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
            return;
        };
        let prefix = format!(
            "tidem-unit-{}-{:?}:",
            std::process::id(),
            std::time::Instant::now()
        );
        let prefix = prefix.replace(['{', '}'], "");
        let store = RedisStore::builder()
            .with_key_prefix(prefix)
            .connect(&url)
            .await
            .unwrap();
        crate::store::equal_nonces_with_different_fingerprints_claim_once(&store).await;
    }
}
