//! The invalidation feed: operators' deletes of completed records, heard over pub/sub, for
//! [local tiers](crate::store::LocalTier) on any process. The remove script publishes each
//! one on `<prefix>invalidations` in the same script as the `DEL`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::broadcast;

use super::{follow, RedisStore};
use crate::store::record::RecordId;
use crate::store::Invalidation;

/// Removals a slow tier may fall behind by before it forgets everything instead.
const BACKLOG: usize = 1024;
/// The pause before subscribing again after the subscription broke, doubled up to the most.
const PAUSE: Duration = Duration::from_millis(100);
const PAUSE_MAX: Duration = Duration::from_secs(5);

impl RedisStore {
    /// The channel the remove script publishes removals on.
    pub(super) fn invalidation_channel(&self) -> String {
        format!("{}invalidations", self.inner.prefix)
    }

    /// The feed, started by the first caller. `None` on a cluster (its client is not one
    /// node's): a tier there bounds staleness by its max age.
    pub(super) fn feed(&self) -> Option<broadcast::Receiver<Invalidation>> {
        let sender = self.inner.feed.get_or_init(|| {
            self.inner.link.client().1?;
            let (tx, _) = broadcast::channel(BACKLOG);
            let link = Arc::downgrade(&self.inner.link);
            tokio::spawn(listen(
                link,
                self.invalidation_channel(),
                self.inner.timeout,
                tx.clone(),
            ));
            Some(tx)
        });
        sender.as_ref().map(broadcast::Sender::subscribe)
    }
}

/// Subscribes on the node the store's link uses now (the primary a Sentinel names, after a
/// failover too), and passes on every removal; says [`Invalidation::Lost`] when the
/// subscription breaks and [`Invalidation::Live`] once it is back. Ends with the store.
async fn listen(
    link: Weak<follow::Link>,
    channel: String,
    timeout: Duration,
    tx: broadcast::Sender<Invalidation>,
) {
    let mut pause = PAUSE;
    loop {
        let Some(client) = link.upgrade().and_then(|l| l.client().1) else {
            let _ = tx.send(Invalidation::Lost);
            return;
        };
        let subscribed = tokio::time::timeout(timeout, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        match subscribed {
            Ok(Ok(pubsub)) => {
                pause = PAUSE;
                let _ = tx.send(Invalidation::Live);
                hear(pubsub, timeout, &tx).await;
                tracing::warn!("the Redis store's invalidation subscription ended; local tiers serve nothing from memory until it is back");
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the Redis store could not subscribe to its invalidations; retrying")
            }
            Err(_) => {
                tracing::warn!("subscribing to the Redis store's invalidations timed out; retrying")
            }
        }
        let _ = tx.send(Invalidation::Lost);
        if link.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PAUSE_MAX);
    }
}

/// Passes on the subscription's removals until it ends, or until a heartbeat `PING` fails or
/// goes unanswered for `timeout`. Messages published before the `PING` arrive before its
/// answer, so each answered `PING` vouches for every removal published until it was sent.
async fn hear(pubsub: redis::aio::PubSub, timeout: Duration, tx: &broadcast::Sender<Invalidation>) {
    let (mut sink, mut messages) = pubsub.split();
    let mut beat = crate::store::feed_heartbeat();
    loop {
        tokio::select! {
            message = messages.next() => {
                let Some(message) = message else { return };
                let id = std::str::from_utf8(message.get_payload_bytes())
                    .ok()
                    .and_then(RecordId::from_hex);
                if let Some(id) = id {
                    let _ = tx.send(Invalidation::Removed(id));
                }
            }
            _ = beat.tick() => {
                let ping = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                if !matches!(ping, Ok(Ok(_))) {
                    tracing::warn!("the Redis store's invalidation subscription did not answer its heartbeat");
                    return;
                }
            }
        }
    }
}
