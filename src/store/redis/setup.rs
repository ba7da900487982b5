//! Building a store: the builder, connecting, loading the scripts, and the eviction guard.

use std::error::Error as StdError;
use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};

use super::connection::{as_string, primary_of, RedisConnection};
use super::scripts::Scripts;
use super::{Inner, Quotas, RedisStore, DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT};

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

/// Builds a [`RedisStore`]. Start from [`RedisStore::builder`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: String,
    wait: Option<(NonZeroU32, Duration)>,
    eviction_guard: bool,
    timeout: Duration,
    quotas: Quotas,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            wait: None,
            eviction_guard: true,
            timeout: DEFAULT_TIMEOUT,
            quotas: Quotas::default(),
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

    /// Whether to refuse a Redis whose `maxmemory-policy` can evict records (default `true`).
    /// See [the eviction guard](super#the-eviction-guard); turn it off only when you know why.
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
            conn.load_everywhere(script.code).await?;
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
                quotas: self.quotas,
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
    Single(redis::Client),
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
    timeout: Duration,
    response_timeout: Duration,
    idle: std::sync::Mutex<Vec<DedicatedConn>>,
}

impl Dedicated {
    pub(super) async fn take(&self) -> Result<DedicatedConn, RedisError> {
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
    pub(super) fn give(&self, conn: DedicatedConn) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < DEDICATED_IDLE {
            idle.push(conn);
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
}
