//! Sentinel's events: a store on Sentinel stops acknowledging writes as soon as a failover of
//! its primary starts, and moves to the new primary as soon as it is announced.
//!
//! A forced failover (`SENTINEL FAILOVER`, or a primary that is only cut off) promotes a
//! replica while the old primary still takes writes; with `WAIT` for fewer replicas than
//! exist, the old primary can still acknowledge a write that the promoted replica never gets,
//! and that write is lost when the old primary is demoted. Waiting to hear of the new primary
//! (`+switch-master`) leaves that window open for as long as the promotion takes. So each
//! Sentinel's failover events (`+try-failover`, `+elected-leader`, `+failover-state-*`,
//! `+selected-slave`, `+promoted-slave`) start or renew a hold: every write is refused, and
//! one that was under way is not acknowledged. The hold ends when one of these comes first:
//!
//! - the store is connected to the primary a `+switch-master` named;
//! - every Sentinel that started or renewed it has aborted (`-failover-abort-*`). One
//!   Sentinel's abort is not enough: a Sentinel that lost the leader election
//!   (`-failover-abort-not-elected`) says nothing of the leader, which may still promote a
//!   replica seconds later;
//! - [`HOLD_MAX`] passed since the last event that renewed it, in case the end was missed.
//!
//! A Sentinel is known by the address the store listens to it on: its events do not name it.
//! The hold logs once when it starts (WARN) and once when it ends, saying how (INFO; WARN
//! when [`HOLD_MAX`] ended it), however many writes it refused.

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

/// How a hold ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    /// The store is connected to the primary `+switch-master` named.
    Connected,
    /// Every Sentinel that held it aborted its failover.
    Aborted,
    /// [`HOLD_MAX`] passed without news.
    Expired,
}

/// What one event did to the hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    Started,
    Renewed,
    /// An abort that leaves other Sentinels holding.
    Kept,
    Ended(End),
    /// A new primary was announced: connecting to it ends the hold ([`Hold::end`]).
    Switched,
    Unchanged,
}

/// The write hold: which Sentinels keep it, and until when. Kept apart from the connection
/// so that its rules are tested without servers.
#[derive(Debug, Default)]
pub(super) struct Hold {
    /// The Sentinels that started or renewed this hold and have not aborted since.
    by: Vec<String>,
    until: Option<Instant>,
}

impl Hold {
    /// Applies `step`, reported by `sentinel`, at `now`.
    pub(super) fn apply(&mut self, sentinel: &str, step: &Step, now: Instant) -> Change {
        self.expire(now);
        let on = self.until.is_some();
        match step {
            Step::Started => {
                if !self.by.iter().any(|s| s == sentinel) {
                    self.by.push(sentinel.to_owned());
                }
                self.until = Some(now + HOLD_MAX);
                if on {
                    Change::Renewed
                } else {
                    Change::Started
                }
            }
            Step::Aborted if on => {
                self.by.retain(|s| s != sentinel);
                if self.by.is_empty() {
                    self.until = None;
                    Change::Ended(End::Aborted)
                } else {
                    Change::Kept
                }
            }
            Step::Switched => Change::Switched,
            Step::Aborted | Step::Other => Change::Unchanged,
        }
    }

    /// Ends the hold, the store being connected to the announced primary: how it ended, or
    /// `None` when none was on.
    pub(super) fn end(&mut self, now: Instant) -> Option<End> {
        let (on, expired) = self.held(now);
        self.by.clear();
        self.until = None;
        match (on, expired) {
            (_, true) => Some(End::Expired),
            (true, _) => Some(End::Connected),
            _ => None,
        }
    }

    /// Whether the hold is on at `now`, and whether [`HOLD_MAX`] just ended it.
    pub(super) fn held(&mut self, now: Instant) -> (bool, bool) {
        let expired = self.expire(now);
        (self.until.is_some(), expired)
    }

    /// Ends a hold past its time: `true` once, when it does.
    fn expire(&mut self, now: Instant) -> bool {
        match self.until {
            Some(until) if now >= until => {
                self.by.clear();
                self.until = None;
                true
            }
            _ => false,
        }
    }

    /// The Sentinels that keep the hold, for the log.
    pub(super) fn holders(&self) -> &[String] {
        &self.by
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
        let watcher = Watcher {
            link: weak,
            sentinel: client.get_connection_info().addr().to_string(),
            client,
            master,
        };
        tokio::spawn(follow(watcher, pubsub, timeout, closed));
    }
    subscribed
}

async fn subscribe(client: &redis::Client) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&CHANNELS[..]).await?;
    Ok(pubsub)
}

/// One Sentinel's listener.
struct Watcher {
    link: Weak<Link>,
    client: redis::Client,
    /// The Sentinel's address (never the URL: it may hold a password), which names it in
    /// the hold: its events do not.
    sentinel: String,
    master: String,
}

/// Follows one Sentinel's events, resubscribing (every second at most) when the connection
/// drops, until the link is gone.
async fn follow(
    w: Watcher,
    mut pubsub: Option<redis::aio::PubSub>,
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
                let Some(link) = w.link.upgrade() else { return };
                let payload: String = msg.get_payload().unwrap_or_default();
                let event = msg.get_channel_name();
                let step = step(&w.master, event, &payload);
                if link.failover_event(&w.sentinel, event, &step) == Change::Switched {
                    tracing::info!(%payload, sentinel = %w.sentinel, "Sentinel announced the new primary; reconnecting");
                    let words: Vec<&str> = payload.split_whitespace().collect();
                    match (words.get(3), words.get(4).and_then(|p| p.parse().ok())) {
                        (Some(ip), Some(port)) => link.announce(ip, port),
                        _ => link.suspect(link.epoch()),
                    }
                }
            }
        }
        // Reconnect pacing, not ordering.
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = closed.changed() => return,
        }
        if w.link.strong_count() == 0 {
            return;
        }
        pubsub = tokio::time::timeout(timeout, subscribe(&w.client))
            .await
            .ok()
            .and_then(Result::ok);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "10.0.0.11:26379";
    const B: &str = "10.0.0.12:26379";
    const OLD: &str = "master shop 10.0.0.1 6379";
    const REPLICA: &str = "slave 10.0.0.2:6379 10.0.0.2 6379 @ shop 10.0.0.1 6379";

    /// Feeds `events` (sender, channel, payload) to `hold` as the store reads them, one
    /// millisecond apart; the last change.
    fn feed(hold: &mut Hold, now: &mut Instant, events: &[(&str, &str, &str)]) -> Change {
        let mut last = Change::Unchanged;
        for (sentinel, channel, payload) in events {
            *now += Duration::from_millis(1);
            last = hold.apply(sentinel, &step("shop", channel, payload), *now);
        }
        last
    }

    #[test]
    fn a_sentinel_that_lost_the_election_does_not_end_the_leaders_hold() {
        let (mut hold, mut now) = (Hold::default(), Instant::now());
        // Recorded in a slow promotion with two candidates: B's abort came 3.3 s before
        // A's `+switch-master`.
        let started = feed(
            &mut hold,
            &mut now,
            &[
                (A, "+new-epoch", "7"),
                (A, "+try-failover", OLD),
                (B, "+try-failover", OLD),
            ],
        );
        assert_eq!(started, Change::Renewed);
        let change = feed(
            &mut hold,
            &mut now,
            &[(B, "-failover-abort-not-elected", OLD)],
        );
        assert_eq!(change, Change::Kept);
        assert!(hold.held(now).0, "A still fails over");
        now += Duration::from_millis(3300);
        let change = feed(
            &mut hold,
            &mut now,
            &[
                (A, "+selected-slave", REPLICA),
                (A, "+promoted-slave", REPLICA),
                (A, "+switch-master", "shop 10.0.0.1 6379 10.0.0.2 6379"),
            ],
        );
        assert_eq!(change, Change::Switched);
        assert!(hold.held(now).0, "held until connected to the new primary");
        assert_eq!(hold.end(now), Some(End::Connected));
        assert!(!hold.held(now).0);
    }

    #[test]
    fn the_hold_ends_when_every_sentinel_that_held_it_aborted() {
        let (mut hold, mut now) = (Hold::default(), Instant::now());
        let first = feed(&mut hold, &mut now, &[(A, "+try-failover", OLD)]);
        assert_eq!(first, Change::Started);
        feed(&mut hold, &mut now, &[(B, "+try-failover", OLD)]);
        // An abort from a Sentinel that never held it changes nothing.
        let other = feed(
            &mut hold,
            &mut now,
            &[("10.0.0.13:26379", "-failover-abort-not-elected", OLD)],
        );
        assert_eq!(other, Change::Kept);
        let b = feed(
            &mut hold,
            &mut now,
            &[(B, "-failover-abort-not-elected", OLD)],
        );
        assert_eq!(b, Change::Kept);
        let a = feed(
            &mut hold,
            &mut now,
            &[(A, "-failover-abort-no-good-slave", OLD)],
        );
        assert_eq!(a, Change::Ended(End::Aborted));
        assert!(!hold.held(now).0);
        // A late abort after the end is nothing; a new attempt holds again.
        let late = feed(
            &mut hold,
            &mut now,
            &[(B, "-failover-abort-not-elected", OLD)],
        );
        assert_eq!(late, Change::Unchanged);
        let again = feed(&mut hold, &mut now, &[(B, "+try-failover", OLD)]);
        assert_eq!(again, Change::Started);
    }

    #[test]
    fn a_hold_lasts_hold_max_after_its_last_event_and_ends_once() {
        let (mut hold, mut now) = (Hold::default(), Instant::now());
        feed(&mut hold, &mut now, &[(A, "+try-failover", OLD)]);
        now += HOLD_MAX - Duration::from_secs(1);
        feed(&mut hold, &mut now, &[(A, "+elected-leader", OLD)]);
        now += HOLD_MAX - Duration::from_secs(1);
        assert_eq!(hold.held(now), (true, false), "renewed by the later event");
        now += Duration::from_secs(1);
        assert_eq!(hold.held(now), (false, true));
        assert_eq!(hold.held(now), (false, false), "the end is reported once");
        // Its holders went with it: another Sentinel's attempt starts a hold of its own.
        assert_eq!(
            feed(&mut hold, &mut now, &[(B, "+try-failover", OLD)]),
            Change::Started
        );
        assert_eq!(
            feed(
                &mut hold,
                &mut now,
                &[(B, "-failover-abort-not-elected", OLD)]
            ),
            Change::Ended(End::Aborted)
        );
    }

    #[tokio::test]
    async fn requests_refused_during_a_hold_give_one_line_per_transition_not_an_error_each() {
        use super::super::error::tests::{post, Capture};
        let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
            return;
        };
        let prefix = format!(
            "tidem-unit-hold-{}-{:?}:",
            std::process::id(),
            Instant::now()
        )
        .replace(['{', '}'], "");
        let store = super::super::RedisStore::builder()
            .with_key_prefix(prefix)
            .connect(&url)
            .await
            .unwrap();
        let link = Arc::clone(&store.inner.link);
        let svc = tower::Layer::layer(
            &crate::IdempotencyLayer::new(store).unscoped(),
            tower::service_fn(
                |_: http::Request<crate::RequestBody<http_body_util::Full<bytes::Bytes>>>| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        http_body_util::Full::new(bytes::Bytes::from_static(b"ran")),
                    ))
                },
            ),
        );
        let capture = Capture::default();
        let _guard = capture.install();
        #[cfg(feature = "metrics")]
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        #[cfg(feature = "metrics")]
        let _metrics = metrics::set_default_local_recorder(&recorder);

        link.failover_event(A, "+try-failover", &Step::Started);
        link.failover_event(B, "+try-failover", &Step::Started);
        const N: usize = 20;
        for i in 0..N {
            assert_eq!(post(&svc, &format!("k{i}")).await, 503);
        }
        link.failover_event(B, "-failover-abort-not-elected", &Step::Aborted);
        assert_eq!(post(&svc, "still-held").await, 503);
        link.failover_event(A, "-failover-abort-no-good-slave", &Step::Aborted);
        assert_eq!(post(&svc, "after").await, 200, "served once the hold ended");

        use tracing::Level;
        assert_eq!(
            capture.lines(Level::ERROR, "").len(),
            0,
            "no ERROR line per request"
        );
        assert_eq!(capture.lines(Level::WARN, "failover").len(), 1, "its start");
        let ends = capture.lines(Level::INFO, "hold ended");
        assert_eq!(ends.len(), 1, "its end: {ends:?}");
        assert!(ends[0].contains("aborted"), "{ends:?}");
        let refused = capture.lines(Level::DEBUG, "failover of the Redis primary is under way");
        assert_eq!(refused.len(), N + 1, "each refusal at DEBUG");
        #[cfg(feature = "metrics")]
        assert_eq!(
            super::super::error::tests::counter(
                &recorder.snapshotter(),
                crate::metrics::OUTAGE_REFUSALS,
                &[("reason", "failover"), ("store", "redis")],
            ),
            N as u64 + 1
        );
    }

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
