//! The invalidation feed: operators' deletes of completed records, heard with `LISTEN`, for
//! [local tiers](crate::store::LocalTier) on any process. The remove statement sends each
//! one with `pg_notify` in its own transaction, so it is heard once committed.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::broadcast;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, Socket};

use super::setup::{Owned, Tls};
use super::PostgresStore;
use crate::store::record::RecordId;
use crate::store::Invalidation;

/// The channel remove.sql notifies.
const CHANNEL: &str = "tower_idempotency_invalidations";
/// Removals a slow tier may fall behind by before it forgets everything instead.
const BACKLOG: usize = 1024;
/// The pause before listening again after the connection broke, doubled up to the most.
const PAUSE: Duration = Duration::from_millis(100);
const PAUSE_MAX: Duration = Duration::from_secs(5);

impl PostgresStore {
    /// The feed, started by the first caller, on a connection of its own. `None` for a store
    /// on a pool you built (`build`, `new`): it has no way to open one, and a tier there
    /// bounds staleness by its max age.
    pub(super) fn feed(&self) -> Option<broadcast::Receiver<Invalidation>> {
        let sender = self.feed.get_or_init(|| {
            let owned = self.config.clone()?;
            let (tx, _) = broadcast::channel(BACKLOG);
            tokio::spawn(listen(owned, self.timeout, tx.clone()));
            Some(tx)
        });
        sender.as_ref().map(broadcast::Sender::subscribe)
    }
}

/// Listens until every receiver is gone; says [`Invalidation::Lost`] when the connection
/// breaks and [`Invalidation::Live`] once `LISTEN` holds again. Multi-host URLs reach the
/// primary as the pool does (a standby refuses `LISTEN`, and the next try goes on).
async fn listen(owned: Arc<Owned>, timeout: Duration, tx: broadcast::Sender<Invalidation>) {
    let mut pause = PAUSE;
    loop {
        let listened = match &owned.tls {
            Tls::None => listen_once(&owned.config, tokio_postgres::NoTls, timeout, &tx).await,
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls(tls) => listen_once(&owned.config, tls.clone(), timeout, &tx).await,
        };
        match listened {
            Ok(()) => {
                pause = PAUSE;
                tracing::warn!("the Postgres store's invalidation connection ended; local tiers serve nothing from memory until it is back");
            }
            Err(e) => {
                tracing::warn!(error = %e, "the Postgres store could not listen for invalidations; retrying")
            }
        }
        if tx.send(Invalidation::Lost).is_err() && tx.receiver_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PAUSE_MAX);
    }
}

/// One connection's life: `LISTEN`, then every notification until it ends.
async fn listen_once<T>(
    config: &tokio_postgres::Config,
    tls: T,
    timeout: Duration,
    tx: &broadcast::Sender<Invalidation>,
) -> Result<(), tokio_postgres::Error>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let Ok(connected) = tokio::time::timeout(timeout * 4, config.connect(tls)).await else {
        return Ok(());
    };
    let (client, mut connection) = connected?;
    // The connection is polled here, by this task: notifications arrive as its messages.
    let (notes, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    let _ = notes.send(RecordId::from_hex(n.payload()));
                }
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    });
    // Bounded like every statement after it: a `LISTEN` that never answers is retried, not
    // waited on (the tiers serve nothing from memory meanwhile).
    let statement = format!("LISTEN {CHANNEL}");
    match tokio::time::timeout(timeout, client.batch_execute(&statement)).await {
        Ok(listened) => listened?,
        Err(_) => {
            driver.abort();
            return Ok(());
        }
    }
    let _ = tx.send(Invalidation::Live);
    let mut beat = crate::store::feed_heartbeat();
    loop {
        tokio::select! {
            id = heard.recv() => match id {
                Some(Some(id)) => {
                    let _ = tx.send(Invalidation::Removed(id));
                }
                Some(None) => {}
                None => break,
            },
            _ = beat.tick() => {
                if !matches!(tokio::time::timeout(timeout, client.simple_query("")).await, Ok(Ok(_))) {
                    tracing::warn!("the Postgres store's invalidation connection did not answer its heartbeat");
                    // A silent connection's driver would wait on its socket for ever.
                    driver.abort();
                    return Ok(());
                }
            }
        }
    }
    drop(client);
    match driver.await {
        Ok(result) => result,
        Err(_) => Ok(()),
    }
}
