//! Sentinel's events: a store on Sentinel stops acknowledging writes as soon as a failover of
//! its primary starts, and moves to the new primary as soon as it is announced.
//!
//! A forced failover (`SENTINEL FAILOVER`, or a primary that is only cut off) promotes a
//! replica while the old primary still takes writes; with `WAIT` for fewer replicas than
//! exist, the old primary can still acknowledge a write that the promoted replica never gets,
//! and that write is lost when the old primary is demoted. Waiting to hear of the new primary
//! (`+switch-master`) leaves that window open for as long as the promotion takes. So each
//! Sentinel's first failover events (`+try-failover`, `+elected-leader`, `+failover-state-*`,
//! `+selected-slave`, `+promoted-slave`) put the store on hold: every write is refused, and
//! one that was under way is not acknowledged. `+switch-master` reconnects to the new primary,
//! which ends the hold; an aborted failover (`-failover-abort-*`) ends it too, and so does
//! [`HOLD_MAX`], in case the end was missed.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use super::follow::Link;

/// The longest hold without news of the failover's end: Sentinel's own `failover-timeout`
/// (3 minutes by default) bounds a failover that is stuck; 30 s covers a failover that works
/// (about 1-2 s on loopback) with room, and stops a missed `+switch-master` from holding the
/// store for longer.
pub(super) const HOLD_MAX: Duration = Duration::from_secs(30);

/// The channels listened to: a failover's start and its steps, its end, and its abort.
const CHANNELS: [&str; 12] = [
    "+try-failover",
    "+elected-leader",
    "+failover-state-select-slave",
    "+selected-slave",
    "+failover-state-send-slaveof-noone",
    "+failover-state-wait-promotion",
    "+promoted-slave",
    "+switch-master",
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
    "-failover-abort-master-timeout",
];

/// What an event on `channel` with `payload` means for a store on `master`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    Started,
    Switched,
    Aborted,
    Other,
}

pub(super) fn step(master: &str, channel: &str, payload: &str) -> Step {
    let words: Vec<&str> = payload.split_whitespace().collect();
    // `+switch-master <name> <old ip> <old port> <new ip> <new port>`; instance events:
    // `<type> <name> <ip> <port> [@ <master name> <ip> <port>]`, the master's own with type
    // `master`.
    let ours = if channel == "+switch-master" {
        words.first() == Some(&master)
    } else {
        match words.iter().position(|w| *w == "@") {
            Some(at) => words.get(at + 1) == Some(&master),
            None => words.first() == Some(&"master") && words.get(1) == Some(&master),
        }
    };
    if !ours {
        return Step::Other;
    }
    match channel {
        "+switch-master" => Step::Switched,
        c if c.starts_with("-failover-abort") => Step::Aborted,
        _ => Step::Started,
    }
}

/// Subscribes to each Sentinel's events for `master`, each within `timeout`, then follows
/// them on a task per Sentinel until the link is dropped. The number subscribed.
pub(super) async fn watch(
    link: &Arc<Link>,
    sentinels: &[String],
    master: &str,
    timeout: Duration,
) -> usize {
    let mut subscribed = 0;
    for url in sentinels {
        let Ok(client) = redis::Client::open(url.as_str()) else {
            continue;
        };
        let first = tokio::time::timeout(timeout, subscribe(&client)).await;
        let pubsub = match first {
            Ok(Ok(p)) => {
                subscribed += 1;
                Some(p)
            }
            _ => None,
        };
        let (weak, master) = (Arc::downgrade(link), master.to_owned());
        let closed = link.closed();
        tokio::spawn(follow(weak, client, pubsub, master, timeout, closed));
    }
    subscribed
}

async fn subscribe(client: &redis::Client) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&CHANNELS[..]).await?;
    Ok(pubsub)
}

/// Follows one Sentinel's events, resubscribing (every second at most) when the connection
/// drops, until the link is gone.
async fn follow(
    link: Weak<Link>,
    client: redis::Client,
    mut pubsub: Option<redis::aio::PubSub>,
    master: String,
    timeout: Duration,
    mut closed: tokio::sync::watch::Receiver<()>,
) {
    loop {
        if let Some(p) = pubsub.take() {
            let mut messages = p.into_on_message();
            loop {
                let msg = tokio::select! {
                    m = messages.next() => m,
                    _ = closed.changed() => return,
                };
                let Some(msg) = msg else { break };
                let Some(link) = link.upgrade() else { return };
                let payload: String = msg.get_payload().unwrap_or_default();
                match step(&master, msg.get_channel_name(), &payload) {
                    Step::Started => {
                        if !link.held() {
                            tracing::warn!(event = msg.get_channel_name(), %payload, "a Sentinel failover of the idempotency store's primary started; writes are refused until it ends");
                        }
                        link.hold_until(Instant::now() + HOLD_MAX);
                    }
                    Step::Switched => {
                        tracing::info!(%payload, "Sentinel announced the new primary; reconnecting");
                        let words: Vec<&str> = payload.split_whitespace().collect();
                        match (words.get(3), words.get(4).and_then(|p| p.parse().ok())) {
                            (Some(ip), Some(port)) => link.announce(ip, port),
                            _ => link.suspect(link.epoch()),
                        }
                    }
                    Step::Aborted => link.release_hold(),
                    Step::Other => {}
                }
            }
        }
        // Reconnect pacing, not ordering.
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = closed.changed() => return,
        }
        if link.strong_count() == 0 {
            return;
        }
        pubsub = tokio::time::timeout(timeout, subscribe(&client))
            .await
            .ok()
            .and_then(Result::ok);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_read_for_the_stores_master_only() {
        let m = "shop";
        assert_eq!(
            step(m, "+try-failover", "master shop 10.0.0.1 6379"),
            Step::Started
        );
        assert_eq!(
            step(m, "+try-failover", "master other 10.0.0.1 6379"),
            Step::Other
        );
        assert_eq!(
            step(
                m,
                "+promoted-slave",
                "slave 10.0.0.2:6379 10.0.0.2 6379 @ shop 10.0.0.1 6379"
            ),
            Step::Started
        );
        assert_eq!(
            step(
                m,
                "+selected-slave",
                "slave 10.0.0.2:6379 10.0.0.2 6379 @ other 10.0.0.1 6379"
            ),
            Step::Other
        );
        assert_eq!(
            step(m, "+switch-master", "shop 10.0.0.1 6379 10.0.0.2 6379"),
            Step::Switched
        );
        assert_eq!(
            step(m, "+switch-master", "shopping 10.0.0.1 6379 10.0.0.2 6379"),
            Step::Other
        );
        assert_eq!(
            step(
                m,
                "-failover-abort-no-good-slave",
                "master shop 10.0.0.1 6379"
            ),
            Step::Aborted
        );
    }
}
