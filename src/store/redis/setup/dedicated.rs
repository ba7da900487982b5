//! Dedicated connections, for a write and the `WAIT` that follows it.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};

use super::timed_out;
use crate::store::redis::connection::primary_of;
use crate::store::redis::follow::Link;

/// Where dedicated connections come from. Built once per store: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Source {
    /// The node the store's link points at now.
    Single,
    Cluster(ClusterClient),
}

/// A connection only one call uses at a time.
pub(crate) enum DedicatedConn {
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
pub(crate) struct Dedicated {
    pub(super) source: Source,
    pub(super) link: Arc<Link>,
    pub(super) timeout: Duration,
    pub(super) response_timeout: Duration,
    /// Idle connections, each with the link's epoch it was opened in: one from before the
    /// primary moved is dropped, not reused.
    pub(super) idle: std::sync::Mutex<Vec<(u64, DedicatedConn)>>,
}

impl Dedicated {
    /// A connection, and the link's epoch it belongs to.
    pub(crate) async fn take(&self) -> Result<(u64, DedicatedConn), RedisError> {
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
    pub(crate) fn give(&self, epoch: u64, conn: DedicatedConn) {
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
    pub(crate) async fn send(
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

    pub(crate) async fn load(&mut self, code: &str) -> Result<(), RedisError> {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(code);
        match self {
            DedicatedConn::Single(c) => load.query_async(c).await,
            DedicatedConn::Cluster(c) => load.query_async(c).await,
        }
    }
}
