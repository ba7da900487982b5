//! Building a store: the builder, connecting, loading the scripts, and the eviction guard.

use std::error::Error as StdError;
use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::Sentinel;
use redis::{RedisError, Value};

use super::connection::{as_string, primary_of, RedisConnection};
use super::follow::{bounded, Link, Resolver};
use super::scripts::Scripts;
use super::{Inner, Quotas, RedisStore, DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT};

/// Why a [`RedisStore`] could not be built. The text names the cause and what to do.
///
/// `Debug` prints the same text as `Display`, so that an error returned from `main` shows
/// the fix, not the variant's fields. Match on the variants to tell them apart.
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
    /// A `redis+sentinel://` URL that does not parse.
    SentinelUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Sentinels answered, but none monitors a primary of this name.
    UnknownMaster {
        /// The name asked for.
        master: String,
        /// The Sentinels that answered (`host:port`).
        sentinels: Vec<String>,
    },
    /// No Sentinel answered.
    NoSentinel {
        /// The Sentinels tried (`host:port`).
        sentinels: Vec<String>,
        /// The last error met.
        cause: RedisError,
    },
    /// [`with_wait`](RedisStoreBuilder::with_wait) asks for more replicas than the primary
    /// has connected: every winning claim would fail `WAIT`.
    TooFewReplicas {
        /// The node (`host:port`) on a cluster; `None` on a single connection.
        node: Option<String>,
        /// Replicas connected to it now.
        connected: u64,
        /// Replicas `WAIT` asks for.
        wanted: u32,
    },
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
                crate::store::error_chain(e)
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
            SetupError::SentinelUrl { url, problem } => write!(
                f,
                "malformed Redis Sentinel URL {url:?}: {problem}; write it as \
                 redis+sentinel://host:port[,host:port...]/<master-name>, listing the \
                 Sentinels (not the Redis nodes) and the name of their `sentinel monitor` line"
            ),
            SetupError::UnknownMaster { master, sentinels } => write!(
                f,
                "no Redis Sentinel at {} monitors a primary named {master:?}; check the name \
                 against `redis-cli -p <sentinel port> SENTINEL MASTERS` (the first field of \
                 each Sentinel's `sentinel monitor` line)",
                sentinels.join(", ")
            ),
            SetupError::NoSentinel { sentinels, cause } => write!(
                f,
                "no Redis Sentinel answered at {} ({}); check that they run and that the URL \
                 lists the Sentinels' addresses (their default port is 26379), not the Redis \
                 nodes'",
                sentinels.join(", "),
                crate::store::error_chain(cause)
            ),
            SetupError::TooFewReplicas {
                node,
                connected,
                wanted,
            } => write!(
                f,
                "the Redis primary{} has {connected} connected replica(s), but with_wait asks \
                 WAIT for {wanted}: every winning claim would fail with 503 until enough \
                 replicas are attached; attach them, lower the count (the shop: \
                 IDEMPOTENCY_REDIS_WAIT=<replicas>:<timeout_ms>), or skip this check with \
                 RedisStoreBuilder::with_replica_check(false)",
                on(node)
            ),
        }
    }
}

impl fmt::Debug for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

// The Redis error is part of the text (it names the cause), so it is not a `source` too.
impl StdError for SetupError {}

impl From<RedisError> for SetupError {
    fn from(e: RedisError) -> Self {
        SetupError::Redis(e)
    }
}

/// Builds a [`RedisStore`]. Start from [`RedisStore::builder`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: String,
    wait: Option<(NonZeroU32, Duration)>,
    eviction_guard: bool,
    timeout: Duration,
    quotas: Quotas,
    replica_check: bool,
    failover_events: bool,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            wait: None,
            eviction_guard: true,
            timeout: DEFAULT_TIMEOUT,
            quotas: Quotas::default(),
            replica_check: true,
            failover_events: true,
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
    /// acknowledgements fail the call with [`StoreErrorKind::Unavailable`](crate::store::StoreErrorKind::Unavailable) and a
    /// [`ReplicationShortfall`](super::ReplicationShortfall) source. A winning claim costs one more round trip; `WAIT` runs
    /// on a connection of its own, never holding up other calls (see
    /// [durability](super#durability-aof-replication-and-wait)). Off by default.
    #[must_use]
    pub fn with_wait(mut self, replicas: NonZeroU32, timeout: Duration) -> Self {
        self.wait = Some((replicas, timeout.max(Duration::from_millis(1))));
        self
    }

    /// Whether building the store with [`with_wait`](Self::with_wait) checks that the primary
    /// (each primary, on a cluster) has at least as many replicas connected as `WAIT` asks
    /// for (default `true`). Fewer is a [`SetupError::TooFewReplicas`]: otherwise every
    /// winning claim would fail `WAIT` and be answered 503. Turn it off to start while a
    /// replica is known to be on its way.
    #[must_use]
    pub fn with_replica_check(mut self, enabled: bool) -> Self {
        self.replica_check = enabled;
        self
    }

    /// Whether a store on Sentinel ([`connect_sentinel`](Self::connect_sentinel)) listens to
    /// the Sentinels' failover events (default `true`). From the first sign of a failover of
    /// its primary (`+try-failover` and the steps after it) until it is connected to the new
    /// primary (`+switch-master`), or the failover is aborted, or 30 s passed, it refuses
    /// every claim (a replay too: the claim answers it), complete, renewal and release
    /// ([`StoreErrorKind::Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// with a [`FailoverUnderway`](super::FailoverUnderway) source: the layer answers 503),
    /// and a write answered after the failover began is reported
    /// [`Unknown`](crate::store::StoreErrorKind::Unknown), never acknowledged: the old
    /// primary may be about to be demoted, and lose it. Off, the store learns of a failover
    /// only when its primary refuses a write or drops the connection.
    #[must_use]
    pub fn with_failover_events(mut self, enabled: bool) -> Self {
        self.failover_events = enabled;
        self
    }

    /// Whether to refuse a Redis whose `maxmemory-policy` can evict records (default `true`).
    /// See [the eviction guard](super#the-eviction-guard); turn it off only when you know why.
    #[must_use]
    pub fn with_eviction_guard(mut self, enabled: bool) -> Self {
        self.eviction_guard = enabled;
        self
    }

    /// How long one Redis call may take before its outcome counts as unknown and is read back
    /// (default 1 s; a `WAIT` gets its own timeout on top). It also bounds each setup step,
    /// and [`connect`](Self::connect) sets it as the connect timeout: with nothing listening at
    /// the URL, `connect` fails within it, naming the cause.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The most records one scope (tenant) may hold at once (default: no per-scope limit).
    ///
    /// Past it, that scope's new keys are refused with
    /// [`StoreErrorKind::QuotaExceeded`](crate::store::StoreErrorKind::QuotaExceeded) (the
    /// layer answers 429) while other scopes still claim: one tenant cannot fill Redis for
    /// everyone. Retries of the scope's existing records still replay. Counted atomically in
    /// the claim's one round trip, by Redis's clock, in keys beside the scope's records
    /// (`<prefix>{<scope tag>}s` and `<prefix>{<scope tag>}b`, pruned of expired records as
    /// claims come). Without a quota a claim touches no such key and costs nothing more.
    ///
    /// Works on one node and on Redis Cluster. Any quota changes the key layout to
    /// `<prefix>{<scope tag>}<rest of the id>`: on a cluster a scope's records then live in one
    /// slot, so one node carries a hot tenant (see [per-scope quotas](super#per-scope-quotas)).
    #[must_use]
    pub fn with_max_records_per_scope(mut self, n: NonZeroUsize) -> Self {
        self.quotas.records = n.get();
        self
    }

    /// The byte budget of one scope, recorded answers included (default: no per-scope
    /// limit). A record counts its stored size: an 82-byte header plus the scope's 64,
    /// then the encoded answer once completed. Checked when a new key is claimed: a scope at
    /// or over it gets
    /// [`StoreErrorKind::QuotaExceeded`](crate::store::StoreErrorKind::QuotaExceeded) until
    /// its records expire or are released. Sizes live in a hash per scope group
    /// (`<prefix>{<scope tag>}b`). Same rules and key layout as
    /// [`with_max_records_per_scope`](Self::with_max_records_per_scope), cluster included.
    #[must_use]
    pub fn with_max_bytes_per_scope(mut self, n: NonZeroUsize) -> Self {
        self.quotas.bytes = n.get();
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
    ///
    /// A `redis+sentinel://host:port[,host:port...]/<master-name>` URL lists Sentinels
    /// instead: see [`connect_sentinel`](Self::connect_sentinel).
    ///
    /// A node that stops being the primary without closing the connection (demoted behind
    /// a proxy or a DNS name that now points elsewhere) answers writes `READONLY`: that call
    /// fails, and the store reconnects to the URL, so it never stays on a demoted node.
    pub async fn connect(self, url: &str) -> Result<RedisStore, SetupError> {
        if url.starts_with(SENTINEL_SCHEME) {
            let (sentinels, master) = parse_sentinel_url(url)?;
            return self.connect_sentinel(sentinels, &master).await;
        }
        let client = redis::Client::open(url)?;
        self.connect_client(client).await
    }

    /// Asks the Sentinels (`host:port`, or `redis://host:port`; any subset of them) for the
    /// primary named `master`, connects to it, checks it and loads the scripts, like
    /// [`connect`](Self::connect).
    ///
    /// The store then follows failovers by itself: when the primary answers `READONLY` or
    /// the connection to it is lost, it asks the Sentinels again and reconnects to the
    /// primary they name (scripts are loaded there; `NOSCRIPT` is handled in any case).
    /// The Redis nodes are reached without a password or TLS, on database 0.
    ///
    /// A Sentinel list where none answers is a [`SetupError::NoSentinel`], a name none of
    /// them monitors a [`SetupError::UnknownMaster`]; each names the fix.
    pub async fn connect_sentinel<I, S>(
        self,
        sentinels: I,
        master: &str,
    ) -> Result<RedisStore, SetupError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let urls: Vec<String> = sentinels
            .into_iter()
            .map(|s| {
                let s = s.as_ref();
                if s.contains("://") {
                    s.to_owned()
                } else {
                    format!("redis://{s}")
                }
            })
            .collect();
        let addrs: Vec<String> = urls
            .iter()
            .map(|u| u.split_once("://").map_or(u.as_str(), |(_, a)| a))
            .map(|a| a.trim_end_matches('/').to_owned())
            .collect();
        if urls.is_empty() || master.is_empty() {
            return Err(SetupError::SentinelUrl {
                url: format!("{SENTINEL_SCHEME}{}/{master}", addrs.join(",")),
                problem: "it needs at least one Sentinel and a master name".to_owned(),
            });
        }
        self.probe_sentinels(&urls, &addrs, master).await?;
        let sentinel = Sentinel::build(urls.clone())?;
        let sentinel = tokio::sync::Mutex::new(sentinel);
        let client = {
            let mut s = sentinel.lock().await;
            // Sentinel, then the named node (its role is checked): two steps.
            tokio::time::timeout(2 * self.timeout, s.async_master_for(master, None))
                .await
                .map_err(|_| timed_out(2 * self.timeout))??
        };
        let resolver = Resolver::Sentinel {
            sentinel: Box::new(sentinel),
            master: master.to_owned(),
        };
        let (events, timeout) = (self.failover_events, self.timeout);
        let store = self.connect_resolved(client, resolver).await?;
        if events {
            // Subscribed before the store is handed out, so no failover starts unheard.
            let n = super::events::watch(&store.inner.link, &urls, master, timeout).await;
            if n == 0 {
                tracing::warn!("no Sentinel took the subscription to failover events; the store learns of a failover when its primary refuses a write");
            }
        }
        Ok(store)
    }

    /// Asks each Sentinel, within the timeout, whether it monitors `master`, so that setup
    /// can say which of the two went wrong: no Sentinel answered, or none knows the name.
    async fn probe_sentinels(
        &self,
        urls: &[String],
        addrs: &[String],
        master: &str,
    ) -> Result<(), SetupError> {
        let probe = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let mut answered = Vec::new();
        let mut cause = None;
        for (url, addr) in urls.iter().zip(addrs) {
            let ask = async {
                let client = redis::Client::open(url.as_str())?;
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&probe)
                    .await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(master)
                    .query_async::<Value>(&mut conn)
                    .await
            };
            // Connect and one command: two steps.
            match tokio::time::timeout(2 * self.timeout, ask).await {
                Ok(Ok(Value::Array(a))) if !a.is_empty() => return Ok(()),
                Ok(Ok(_)) => answered.push(addr.clone()),
                Ok(Err(e)) => cause = Some(e),
                Err(_) => cause = Some(timed_out(2 * self.timeout)),
            }
        }
        if answered.is_empty() {
            return Err(SetupError::NoSentinel {
                sentinels: addrs.to_vec(),
                cause: cause.unwrap_or_else(|| timed_out(self.timeout)),
            });
        }
        Err(SetupError::UnknownMaster {
            master: master.to_owned(),
            sentinels: answered,
        })
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
        self.connect_resolved(client, Resolver::Url).await
    }

    async fn connect_resolved(
        self,
        client: redis::Client,
        resolver: Resolver,
    ) -> Result<RedisStore, SetupError> {
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
        let config = self.manager_config();
        let conn = tokio::time::timeout(
            self.timeout,
            ConnectionManager::new_with_config(client.clone(), config),
        )
        .await
        .map_err(|_| timed_out(self.timeout))??;
        self.build_with(conn.into(), Origin::Single { client, resolver })
            .await
    }

    /// The shared connection's configuration. No response timeout: every call the store makes
    /// on it already runs under the store's own deadline (`RedisStore::bounded`, `timeout`;
    /// `timeout + wait` for a `WAIT`), which also covers a call held while the manager
    /// redials. A second timer per call would only cost: dropping it saved 700 to 1,400
    /// instructions per call (callgrind), and a new key makes two calls.
    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(self.timeout))
            // Reconnect attempts back off to at most 1 s, so a restarted Redis is found soon.
            .set_max_delay(Duration::from_secs(1))
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
        self.build_with(conn.into(), Origin::Cluster(client)).await
    }

    /// Builds the store on an existing connection: checks the eviction policy (unless turned
    /// off) and loads the scripts.
    ///
    /// With [`with_wait`](Self::with_wait), a store built here sends `WAIT` on `conn` itself,
    /// where it holds up every other call on that connection until replicas answer; use
    /// [`connect`](Self::connect) or [`connect_cluster`](Self::connect_cluster), which send
    /// each write and its `WAIT` on a connection of their own.
    pub async fn build(self, conn: impl Into<RedisConnection>) -> Result<RedisStore, SetupError> {
        self.build_with(conn.into(), Origin::User).await
    }

    async fn build_with(
        self,
        conn: RedisConnection,
        origin: Origin,
    ) -> Result<RedisStore, SetupError> {
        if self.prefix.contains(['{', '}']) {
            return Err(SetupError::KeyPrefix(self.prefix));
        }
        // Each step is bounded here: the store's own connection manager has no response
        // timeout (see `manager_config`), and one passed to `build` may have none either.
        let limit = self.timeout;
        if self.eviction_guard {
            bounded(limit, check_eviction_policy(&conn)).await?;
        }
        let scripts = Scripts::new();
        // Loading now saves the first call of each script a NOSCRIPT round trip. On a cluster,
        // SCRIPT LOAD goes to every node.
        for script in scripts.all() {
            bounded(limit, conn.load_everywhere(script.code)).await?;
        }
        if let (Some((wanted, _)), true) = (self.wait, self.replica_check) {
            bounded(limit, check_replicas(&conn, wanted.get())).await?;
        }
        // Read once: a plain claim needs `SET … NX GET` on every node. Unknown in time, the
        // store uses the claim script, which every version takes.
        let plain_claims = !self.quotas.any()
            && tokio::time::timeout(limit, takes_nx_with_get(&conn))
                .await
                .unwrap_or(false);
        let codes = scripts.all().iter().map(|s| s.code).collect();
        let config = self.manager_config();
        let (link, source) = match origin {
            Origin::User => (
                Link::new(conn, None, None, self.timeout, config, codes),
                None,
            ),
            Origin::Single { client, resolver } => {
                let link = Link::new(
                    conn,
                    Some(client),
                    Some(resolver),
                    self.timeout,
                    config,
                    codes,
                );
                (link, Some(Source::Single))
            }
            Origin::Cluster(client) => (
                Link::new(conn, None, None, self.timeout, config, codes),
                Some(Source::Cluster(client)),
            ),
        };
        let link = Arc::new(link);
        let dedicated = match (self.wait, source) {
            (Some(_), Some(source)) => Some(Dedicated {
                source,
                link: Arc::clone(&link),
                timeout: self.timeout,
                response_timeout: self.response_timeout(),
                idle: std::sync::Mutex::new(Vec::new()),
            }),
            _ => None,
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                link,
                dedicated,
                prefix: self.prefix,
                wait: self.wait,
                timeout: self.timeout,
                scripts,
                quotas: self.quotas,
                plain_claims: std::sync::atomic::AtomicBool::new(plain_claims),
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

/// Whether every node runs Redis 7.0 or later, which takes `SET` with both `NX` and `GET`
/// (`INFO server`). Any doubt (`INFO` refused, no version, an error) is `false`: the claim
/// script works everywhere.
async fn takes_nx_with_get(conn: &RedisConnection) -> bool {
    let mut info = redis::cmd("INFO");
    info.arg("server");
    let Ok(replies) = conn.on_all(&info).await else {
        return false;
    };
    !replies.is_empty()
        && replies.iter().all(|(_, v)| {
            as_string(v)
                .and_then(|t| major_version(&t))
                .is_some_and(|m| m >= 7)
        })
}

/// The major version in an `INFO server` text (`redis_version:7.0.15`).
fn major_version(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|l| l.strip_prefix("redis_version:"))?
        .split('.')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// With `WAIT n`, every primary must have `n` replicas connected, or each winning claim
/// fails: say so now rather than as 503s.
async fn check_replicas(conn: &RedisConnection, wanted: u32) -> Result<(), SetupError> {
    let mut info = redis::cmd("INFO");
    info.arg("replication");
    for (node, reply) in conn.on_all(&info).await? {
        let Some(text) = as_string(&reply) else {
            // INFO refused (renamed, ACL): the check cannot be made; WAIT will tell.
            tracing::warn!(
                ?node,
                "INFO replication refused; the replica check is skipped"
            );
            continue;
        };
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        if field("role:") != Some("master") {
            continue;
        }
        let connected = field("connected_slaves:")
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        if connected < u64::from(wanted) {
            return Err(SetupError::TooFewReplicas {
                node,
                connected,
                wanted,
            });
        }
    }
    Ok(())
}

/// The scheme of a URL that lists Sentinels.
pub(super) const SENTINEL_SCHEME: &str = "redis+sentinel://";

/// The default port of a Sentinel.
const SENTINEL_PORT: u16 = 26379;

/// `redis+sentinel://host:port[,host:port...]/<master-name>`: the Sentinels as
/// `redis://host:port` URLs, and the master name.
fn parse_sentinel_url(url: &str) -> Result<(Vec<String>, String), SetupError> {
    let bad = |problem: &str| SetupError::SentinelUrl {
        url: url.to_owned(),
        problem: problem.to_owned(),
    };
    let rest = url
        .strip_prefix(SENTINEL_SCHEME)
        .ok_or_else(|| bad("it does not start with redis+sentinel://"))?;
    let (hosts, master) = rest
        .split_once('/')
        .ok_or_else(|| bad("the master name is missing after the hosts (/<master-name>)"))?;
    if hosts.contains('@') {
        return Err(bad(
            "credentials in the URL are not supported; the Sentinels and nodes are reached \
             without a password",
        ));
    }
    let master = master.trim_end_matches('/');
    if master.is_empty() {
        return Err(bad("the master name after the hosts is empty"));
    }
    if master.contains(['/', '?', '#']) {
        return Err(bad(
            "the master name must be one path segment, without a query",
        ));
    }
    let mut sentinels = Vec::new();
    for host in hosts.split(',') {
        let (name, port) = match host.rsplit_once(':') {
            Some((name, port)) if !name.ends_with(']') || host.starts_with('[') => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| bad(&format!("{host:?} has no valid port")))?;
                (name, port)
            }
            _ => (host, SENTINEL_PORT),
        };
        if name.is_empty() || name == "[]" {
            return Err(bad("a host is empty (two commas, or a comma at an end?)"));
        }
        sentinels.push(format!("redis://{name}:{port}"));
    }
    Ok((sentinels, master.to_owned()))
}

fn timed_out(limit: Duration) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no answer within {limit:?}"),
    ))
}

/// Where the store's connection came from.
enum Origin {
    /// Built by the user: used as it is.
    User,
    /// Made from a client, to one node found by URL or by Sentinel.
    Single {
        client: redis::Client,
        resolver: Resolver,
    },
    Cluster(ClusterClient),
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
pub(super) enum Source {
    /// The node the store's link points at now.
    Single,
    Cluster(ClusterClient),
}

/// A connection only one call uses at a time.
pub(super) enum DedicatedConn {
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
pub(super) struct Dedicated {
    source: Source,
    link: Arc<Link>,
    timeout: Duration,
    response_timeout: Duration,
    /// Idle connections, each with the link's epoch it was opened in: one from before the
    /// primary moved is dropped, not reused.
    idle: std::sync::Mutex<Vec<(u64, DedicatedConn)>>,
}

impl Dedicated {
    /// A connection, and the link's epoch it belongs to.
    pub(super) async fn take(&self) -> Result<(u64, DedicatedConn), RedisError> {
        let (epoch, client) = self.link.client();
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.retain(|(e, _)| *e == epoch);
            if let Some(conn) = idle.pop() {
                return Ok(conn);
            }
        }
        match &self.source {
            Source::Single => {
                let client = client.ok_or_else(|| timed_out(self.timeout))?;
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.response_timeout));
                let conn = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                Ok((epoch, DedicatedConn::Single(conn)))
            }
            Source::Cluster(client) => Ok((
                epoch,
                DedicatedConn::Cluster(client.get_async_connection().await?),
            )),
        }
    }

    /// Returns a connection whose last call ended cleanly.
    pub(super) fn give(&self, epoch: u64, conn: DedicatedConn) {
        if epoch != self.link.epoch() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < DEDICATED_IDLE {
            idle.push((epoch, conn));
        }
    }
}

impl DedicatedConn {
    /// Sends `pipe` to the node holding `key`; a command's error is its reply.
    pub(super) async fn send(
        &mut self,
        pipe: &redis::Pipeline,
        key: &str,
    ) -> Result<Vec<Value>, RedisError> {
        match self {
            DedicatedConn::Single(c) => pipe.query_async(c).await,
            DedicatedConn::Cluster(c) => {
                c.route_pipeline(pipe.clone(), 0, pipe.len(), primary_of(key))
                    .await
            }
        }
    }

    pub(super) async fn load(&mut self, code: &str) -> Result<(), RedisError> {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(code);
        match self {
            DedicatedConn::Single(c) => load.query_async(c).await,
            DedicatedConn::Cluster(c) => load.query_async(c).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(b: &[u8]) -> Value {
        Value::BulkString(b.to_vec())
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
    fn the_major_version_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(major_version(info), Some(7));
        assert_eq!(major_version("redis_version:6.2.14\r\n"), Some(6));
        assert_eq!(major_version("# Server\r\n"), None);
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

    #[test]
    fn setup_errors_debug_print_their_text_so_main_shows_the_fix() {
        let node = || Some("10.0.0.7:6379".to_owned());
        let cases = [
            (
                SetupError::EvictionPolicy {
                    node: node(),
                    policy: "allkeys-lru".to_owned(),
                },
                "fix it with `CONFIG SET maxmemory-policy noeviction`",
            ),
            (
                SetupError::PolicyUnknown { node: node() },
                "make sure it is noeviction",
            ),
            (
                SetupError::KeyPrefix("a{b}:".to_owned()),
                "contains a brace",
            ),
            (
                SetupError::Redis(RedisError::from((
                    redis::ErrorKind::AuthenticationFailed,
                    "WRONGPASS",
                ))),
                "WRONGPASS",
            ),
        ];
        for (err, fix) in cases {
            let debug = format!("{err:?}");
            assert!(debug.contains(fix), "{debug}");
            assert_eq!(debug, err.to_string());
            // What `fn main() -> Result<(), Box<dyn Error>>` prints after "Error: ".
            let boxed: Box<dyn StdError> = Box::new(err);
            assert_eq!(format!("{boxed:?}"), debug);
        }
    }
}
