//! The connection a store talks through, and where each command goes on a cluster.

use std::fmt;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, Pipeline, RedisError, Value};

/// The connection a [`RedisStore`](super::RedisStore) talks through: one node, or a cluster.
///
/// Both reconnect by themselves. Build one by hand (or let
/// [`RedisStore::connect`](super::RedisStore::connect) and
/// [`RedisStore::connect_cluster`](super::RedisStore::connect_cluster) do it) and pass it to
/// [`RedisStore::new`](super::RedisStore::new); `From` converts either kind.
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

/// Where `key` lives on a cluster: its slot's primary.
pub(super) fn primary_of(key: &str) -> SingleNodeRoutingInfo {
    SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master))
}

// The cluster client's futures are boxed: `route_pipeline`'s is 1,440 bytes against 48 for a
// single node's, and every future that awaits a call (the store's claim, complete, their
// deadlines) would otherwise carry that size, copied where each is made and allocated with
// the claim's and the complete's boxed futures.
impl RedisConnection {
    /// Runs `cmd` on the node holding `key` (a single node is always that node).
    pub(super) async fn on_key(&self, cmd: &Cmd, key: &str) -> Result<Value, RedisError> {
        match self {
            RedisConnection::Single(c) => cmd.query_async(&mut c.clone()).await,
            RedisConnection::Cluster(c) => {
                let routing = RoutingInfo::SingleNode(primary_of(key));
                let mut c = c.clone();
                Box::pin(c.route_command(cmd.clone(), routing)).await
            }
        }
    }

    /// Sends `pipe` to the node holding `key` in one round trip; one reply per command.
    pub(super) async fn pipeline(
        &self,
        pipe: &Pipeline,
        key: &str,
    ) -> Result<Vec<Value>, RedisError> {
        match self {
            RedisConnection::Single(c) => pipe.query_async(&mut c.clone()).await,
            RedisConnection::Cluster(c) => {
                let mut c = c.clone();
                Box::pin(c.route_pipeline(pipe.clone(), 0, pipe.len(), primary_of(key))).await
            }
        }
    }

    /// Runs `cmd` on every node; one `(node, reply)` per node, a node's error as its reply.
    pub(super) async fn on_all(
        &self,
        cmd: &Cmd,
    ) -> Result<Vec<(Option<String>, Value)>, RedisError> {
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

    /// `SCRIPT LOAD` on every node (a cluster client sends it to all of them).
    pub(super) async fn load_everywhere(&self, code: &str) -> Result<(), RedisError> {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(code);
        match self {
            RedisConnection::Single(c) => load.query_async(&mut c.clone()).await,
            RedisConnection::Cluster(c) => load.query_async(&mut c.clone()).await,
        }
    }
}

pub(super) fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}
