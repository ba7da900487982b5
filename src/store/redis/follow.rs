//! Following the primary: the connection every call takes, replaced when the node behind it
//! stopped being the primary.
//!
//! A [`ConnectionManager`] reconnects to the address it was built with, and only when the
//! connection breaks. Neither is enough when the primary moves: a node demoted without
//! dropping its clients answers every write `READONLY` on a healthy connection, and after a
//! crash the manager keeps dialing a dead or demoted address. So the store watches its
//! replies. A `READONLY` (or `MASTERDOWN`) reply, and with Sentinel a lost connection too,
//! marks the connection suspect; one background task (never two at once, at most one every
//! [`MIN_GAP`]) then builds a new one (with Sentinel, to the primary Sentinel names now),
//! loads the scripts there and swaps it in. Calls already under way finish on the old
//! connection: they fail, and their retries go to the new one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::Sentinel;
use redis::{RedisError, Value};

use super::connection::RedisConnection;
use super::error::Shortfalls;
use super::events::{Change, End, Hold, Step, HOLD_MAX};

/// The shortest time between two refreshes: a crashed primary makes every call fail, and
/// each failure asks for one.
pub(super) const MIN_GAP: Duration = Duration::from_millis(100);

/// Where a fresh connection to the primary comes from.
pub(super) enum Resolver {
    /// The URL the store was built with: a new connection re-resolves its host name (and
    /// a proxy in front of Redis picks the node it now forwards to).
    Url,
    /// Sentinel, asked for `master`'s current address.
    Sentinel {
        // Boxed: the client caches a connection per Sentinel, and a link holds one resolver.
        sentinel: Box<tokio::sync::Mutex<Sentinel>>,
        master: String,
    },
}

/// The connection in use, and how many times it was replaced.
struct Current {
    epoch: u64,
    conn: RedisConnection,
    /// The client it was made from, for dedicated connections to the same node.
    client: Option<redis::Client>,
}

/// The connection a store's calls take, and how to replace it.
pub(super) struct Link {
    current: RwLock<Current>,
    /// `None` for a connection the user built, and for a cluster (its client follows
    /// failovers by itself): such a link never changes.
    resolver: Option<Resolver>,
    refreshing: AtomicBool,
    warned: AtomicBool,
    /// One more than the epoch whose connection is suspect, 0 for none. A suspect
    /// connection is not used: with Sentinel, the connection manager would otherwise redial
    /// the old address by itself and could write to a node restarted empty or demoted.
    stale: AtomicU64,
    last_refresh: Mutex<Option<Instant>>,
    /// Bounds each step of a refresh: asking Sentinel, connecting, loading the scripts.
    timeout: Duration,
    config: ConnectionManagerConfig,
    scripts: Vec<&'static str>,
    /// While on, a failover of the primary is under way: writes are refused.
    hold: Mutex<Hold>,
    /// Bumped when a hold starts, so a write sent before it is not acknowledged after it.
    holds: AtomicU64,
    /// The primary Sentinel announced last (`+switch-master`), for the next refresh: the
    /// Sentinel a refresh would ask may not know yet, and name the old primary, which still
    /// answers as one until it is demoted.
    announced: Mutex<Option<(String, u16)>>,
    /// Dropped with the link: tells the event watchers to end.
    closing: tokio::sync::watch::Sender<()>,
    /// Whether `WAIT` falls short now, so that it is logged when that begins and ends.
    pub(super) shortfalls: Shortfalls,
}

impl Link {
    pub(super) fn new(
        conn: RedisConnection,
        client: Option<redis::Client>,
        resolver: Option<Resolver>,
        timeout: Duration,
        config: ConnectionManagerConfig,
        scripts: Vec<&'static str>,
    ) -> Self {
        Link {
            current: RwLock::new(Current {
                epoch: 0,
                conn,
                client,
            }),
            resolver,
            refreshing: AtomicBool::new(false),
            warned: AtomicBool::new(false),
            stale: AtomicU64::new(0),
            last_refresh: Mutex::new(None),
            timeout,
            config,
            scripts,
            hold: Mutex::new(Hold::default()),
            holds: AtomicU64::new(0),
            closing: tokio::sync::watch::channel(()).0,
            announced: Mutex::new(None),
            shortfalls: Shortfalls::default(),
        }
    }

    /// A receiver that sees the link dropped.
    pub(super) fn closed(&self) -> tokio::sync::watch::Receiver<()> {
        self.closing.subscribe()
    }

    /// The connection to use now, and its epoch (to report it suspect); `None` while it is
    /// suspect and its replacement is being looked for (that starts one more attempt).
    pub(super) fn conn(self: &Arc<Self>) -> Option<(u64, RedisConnection)> {
        let (epoch, conn) = self.any_conn();
        if !self.usable(epoch) {
            self.suspect(epoch);
            return None;
        }
        Some((epoch, conn))
    }

    /// The connection in use, suspect or not (for reads and operators).
    pub(super) fn any_conn(&self) -> (u64, RedisConnection) {
        let c = self.current.read().unwrap_or_else(|e| e.into_inner());
        (c.epoch, c.conn.clone())
    }

    /// `false` once the connection of `epoch` was found suspect (or replaced): a write sent on
    /// it and answered after that is not acknowledged.
    pub(super) fn usable(&self, epoch: u64) -> bool {
        self.epoch() == epoch && self.stale.load(Ordering::Acquire) != epoch + 1
    }

    /// The client of the connection in use, for a dedicated connection to the same node.
    pub(super) fn client(&self) -> (u64, Option<redis::Client>) {
        let c = self.current.read().unwrap_or_else(|e| e.into_inner());
        (c.epoch, c.client.clone())
    }

    pub(super) fn epoch(&self) -> u64 {
        self.current.read().unwrap_or_else(|e| e.into_inner()).epoch
    }

    pub(super) fn follows_sentinel(&self) -> bool {
        matches!(self.resolver, Some(Resolver::Sentinel { .. }))
    }

    /// Looks at an error a call on the connection of `epoch` got, and asks for a new
    /// connection when it says the node is no longer the primary (or, with Sentinel, gone).
    pub(super) fn observe(self: &Arc<Self>, epoch: u64, e: &RedisError) {
        let moved = wrong_node(e.code(), e.detail());
        let lost = e.is_io_error() || e.is_timeout() || e.is_connection_dropped();
        if moved || (lost && self.follows_sentinel()) {
            self.suspect(epoch);
        }
    }

    /// Like [`observe`](Self::observe), for an error returned as a pipeline reply; `true`
    /// when the replies say the node is not the primary (a refusal: nothing was written).
    pub(super) fn observe_replies(self: &Arc<Self>, epoch: u64, replies: &[Value]) -> bool {
        let moved = replies.iter().any(|v| match v {
            Value::ServerError(e) => wrong_node(Some(e.code()), e.details()),
            _ => false,
        });
        if moved {
            self.suspect(epoch);
        }
        moved
    }

    /// Starts a refresh unless one runs, the connection of `epoch` was replaced already, or
    /// the link cannot change.
    pub(super) fn suspect(self: &Arc<Self>, epoch: u64) {
        if self.resolver.is_none() || self.epoch() != epoch {
            return;
        }
        self.stale.store(epoch + 1, Ordering::Release);
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = Arc::clone(self);
        // On its own task: the call that noticed fails now, and a caller that drops its
        // future (the layer's deadline) does not cancel the refresh halfway.
        tokio::spawn(async move {
            let last = *link.last_refresh.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(gap) = last.and_then(|t| MIN_GAP.checked_sub(t.elapsed())) {
                // Rate limiting, not ordering.
                tokio::time::sleep(gap).await;
            }
            match link.refresh().await {
                Ok(()) => link.warned.store(false, Ordering::Relaxed),
                // Once per outage: during a failover this fails every MIN_GAP until the new
                // primary is named.
                Err(e) if !link.warned.swap(true, Ordering::Relaxed) => tracing::warn!(
                    error = %crate::store::error_chain(&e),
                    "could not reconnect the Redis idempotency store to its primary; calls \
                     fail (503) and try again"
                ),
                Err(e) => {
                    tracing::debug!(error = %crate::store::error_chain(&e), "still no primary")
                }
            }
            *link.last_refresh.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            link.refreshing.store(false, Ordering::Release);
            // An announcement that came while this refresh ran has not been followed yet.
            let pending = link
                .announced
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some();
            if pending {
                link.suspect(link.epoch());
            }
        });
    }

    /// Finds the primary, connects, loads the scripts and swaps the connection in. Each step
    /// is bounded by the timeout, so a refresh ends within `4 × timeout` (Sentinel, connect,
    /// scripts; a URL skips the first).
    async fn refresh(&self) -> Result<(), RedisError> {
        let announced = self
            .announced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let client = match (&self.resolver, &announced) {
            (Some(Resolver::Sentinel { .. }), Some((ip, port))) => {
                redis::Client::open(format!("redis://{ip}:{port}/"))?
            }
            _ => self.resolve().await?,
        };
        let conn = bounded(
            self.timeout,
            ConnectionManager::new_with_config(client.clone(), self.config.clone()),
        )
        .await?;
        let conn = RedisConnection::Single(conn);
        // Saves each script's first call a NOSCRIPT round trip on the new node; a failure
        // here is not fatal (NOSCRIPT loads it then).
        let load = async {
            for code in &self.scripts {
                conn.load_everywhere(code).await?;
            }
            Ok::<_, RedisError>(())
        };
        let _ = bounded(self.timeout, load).await;
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        current.epoch += 1;
        current.conn = conn;
        current.client = Some(client);
        drop(current);
        if announced.is_some() {
            // On the primary Sentinel announced: a failover hold has done its work.
            self.release_hold();
        }
        tracing::info!("the Redis idempotency store reconnected to its primary");
        Ok(())
    }

    /// The client of the primary: the URL's, or the one Sentinel names now.
    async fn resolve(&self) -> Result<redis::Client, RedisError> {
        match &self.resolver {
            None | Some(Resolver::Url) => self
                .client()
                .1
                .ok_or_else(|| timed_out("no client to reconnect with")),
            Some(Resolver::Sentinel { sentinel, master }) => {
                let ask = async { sentinel.lock().await.async_master_for(master, None).await };
                // Asking Sentinel also connects to the named node to check its role: 2 steps.
                bounded(2 * self.timeout, ask).await
            }
        }
    }

    /// Sentinel announced `ip:port` as the new primary: reconnect there.
    pub(super) fn announce(self: &Arc<Self>, ip: &str, port: u16) {
        *self.announced.lock().unwrap_or_else(|e| e.into_inner()) = Some((ip.to_owned(), port));
        // A refresh already running may have asked Sentinel before it knew: mark the
        // connection suspect again once it is done (the next failing or held call does).
        self.suspect(self.epoch());
    }

    /// Applies a failover event `event` that `sentinel` sent (see [`Hold`]); logs the hold's
    /// start and end, once each.
    pub(super) fn failover_event(&self, sentinel: &str, event: &str, step: &Step) -> Change {
        let now = Instant::now();
        let mut hold = self.hold.lock().unwrap_or_else(|e| e.into_inner());
        if hold.held(now).1 {
            log_end(End::Expired);
        }
        let change = hold.apply(sentinel, step, now);
        if matches!(change, Change::Started | Change::Renewed) {
            // Once the hold is on: a write that read the count before it sees the hold, or
            // the count changed when its reply comes.
            self.holds.fetch_add(1, Ordering::AcqRel);
        }
        match change {
            Change::Started => tracing::warn!(
                event,
                sentinel,
                "a Sentinel failover of the idempotency store's primary started; writes are \
                 refused (503) until it ends"
            ),
            Change::Renewed => tracing::debug!(event, sentinel, "the failover hold goes on"),
            Change::Kept => tracing::debug!(
                event,
                sentinel,
                holders = ?hold.holders(),
                "a Sentinel aborted its failover; the hold stays while another one's goes on"
            ),
            Change::Ended(end) => log_end(end),
            Change::Switched | Change::Unchanged => {}
        }
        change
    }

    /// Ends a hold: the store is connected to the primary Sentinel announced.
    pub(super) fn release_hold(&self) {
        let end = self
            .hold
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end(Instant::now());
        if let Some(end) = end {
            log_end(end);
        }
    }

    /// The number of holds so far, read before a write is sent.
    pub(super) fn holds(&self) -> u64 {
        self.holds.load(Ordering::Acquire)
    }

    /// `true` while a hold lasts.
    pub(super) fn held(&self) -> bool {
        let mut hold = self.hold.lock().unwrap_or_else(|e| e.into_inner());
        let (on, expired) = hold.held(Instant::now());
        if expired {
            log_end(End::Expired);
        }
        on
    }
}

/// One line per hold, however many writes it refused.
fn log_end(end: End) {
    match end {
        End::Connected => tracing::info!(
            ended = "connected",
            "the Redis idempotency store's failover hold ended: it is connected to the primary \
             Sentinel announced; writes resume"
        ),
        End::Aborted => tracing::info!(
            ended = "aborted",
            "the Redis idempotency store's failover hold ended: every Sentinel that started \
             the failover aborted it; writes resume on the same primary"
        ),
        End::Expired => tracing::warn!(
            ended = "expired",
            "the Redis idempotency store's failover hold ended: no news of the failover's \
             end within {HOLD_MAX:?}; writes resume"
        ),
    }
}

/// A reply that says this node does not take writes as a primary now.
fn wrong_node(code: Option<&str>, detail: Option<&str>) -> bool {
    matches!(code, Some("READONLY" | "MASTERDOWN"))
        // Before Redis 7, a script's error came wrapped in ERR.
        || detail.is_some_and(|d| d.contains("-READONLY") || d.contains("READONLY You can't"))
}

fn timed_out(what: &str) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        what.to_owned(),
    ))
}

/// `f` within `limit`; past it, a timed-out Redis error (reconnects here, setup's steps).
pub(super) async fn bounded<T, E: From<RedisError>>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(timed_out(&format!("no answer within {limit:?}")).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readonly_and_masterdown_replies_mean_the_node_moved() {
        assert!(wrong_node(
            Some("READONLY"),
            Some("You can't write against a read only replica.")
        ));
        assert!(wrong_node(
            Some("MASTERDOWN"),
            Some("Link with MASTER is down")
        ));
        let wrapped = "Error running script (call to f_1): @user_script:9: -READONLY You can't \
                       write against a read only replica.";
        assert!(wrong_node(Some("ERR"), Some(wrapped)));
        assert!(!wrong_node(Some("OOM"), Some("command not allowed")));
        assert!(!wrong_node(None, None));
    }
}
