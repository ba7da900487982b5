//! Why a store could not be built, in words that name the fix.

use std::error::Error as StdError;
use std::fmt;

use redis::RedisError;

#[cfg(doc)]
use super::RedisStoreBuilder;
#[cfg(doc)]
use crate::store::redis::RedisStore;

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

#[cfg(test)]
mod tests {
    use super::*;

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
