//! Building a store: the builder, connecting, loading the scripts, and the eviction guard.

use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::RedisError;

use super::connection::RedisConnection;
use super::follow::{bounded, Link, Resolver};
use super::scripts::Scripts;
use super::{Inner, Quotas, RedisStore, DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT};

mod checks;
mod dedicated;
mod error;
mod sentinel;

pub(super) use dedicated::Dedicated;
pub use error::SetupError;

use checks::{check_eviction_policy, check_replicas, takes_nx_with_get};
use dedicated::Source;
use sentinel::{parse_sentinel_url, SENTINEL_SCHEME};

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
    /// primary (`+switch-master`), or every Sentinel that reported the failover aborted it
    /// (one that lost the leader election does not end it), or 30 s passed without a
    /// further event, it refuses every claim (a replay too: the claim answers it), complete,
    /// renewal and release
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
                feed: std::sync::OnceLock::new(),
            }),
        })
    }

    fn response_timeout(&self) -> Duration {
        self.timeout + self.wait.map_or(Duration::ZERO, |(_, t)| t)
    }
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
