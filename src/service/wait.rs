//! Wait mode: retries of a key in progress wait for its answer, one poll per record.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::deadline::{bounded, deadline, BACKOFF_MAX, BACKOFF_START};
use crate::config::Config;
use crate::metrics::{timed, Labels};
use crate::store::record::{RecordId, RecordState};

/// Wait mode's registry: one poller per record id, many listeners.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    polls: Mutex<HashMap<RecordId, tokio::sync::watch::Sender<bool>>>,
    waiting: AtomicUsize,
}

/// One waiting request; leaving (dropped) frees its place under the cap.
struct WaitTicket {
    changed: tokio::sync::watch::Receiver<bool>,
    waiters: Arc<Waiters>,
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, AtomicOrdering::Relaxed);
    }
}

impl Waiters {
    fn polls(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<RecordId, tokio::sync::watch::Sender<bool>>> {
        self.polls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Listens for a change of `id`, starting its poller if none runs; `None` past the cap.
    fn join(self: &Arc<Self>, cfg: &Arc<Config>, id: RecordId) -> Option<WaitTicket> {
        let waiters = self.clone();
        if waiters.waiting.fetch_add(1, AtomicOrdering::Relaxed) >= cfg.in_progress.max_waiters {
            waiters.waiting.fetch_sub(1, AtomicOrdering::Relaxed);
            return None;
        }
        let changed = {
            let mut polls = waiters.polls();
            match polls.get(&id) {
                Some(tx) => tx.subscribe(),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(false);
                    polls.insert(id, tx.clone());
                    tokio::spawn(poll_record(cfg.clone(), self.clone(), id, tx));
                    rx
                }
            }
        };
        Some(WaitTicket { changed, waiters })
    }
}

/// Polls `id` with jittered backoff until it is no longer a live claim, then tells every
/// listener; stops early when nobody listens any more.
async fn poll_record(
    cfg: Arc<Config>,
    waiters: Arc<Waiters>,
    id: RecordId,
    tx: tokio::sync::watch::Sender<bool>,
) {
    let mut pause = BACKOFF_START;
    loop {
        tokio::time::sleep(jitter(pause)).await;
        pause = (pause * 2).min(BACKOFF_MAX);
        {
            // Under the lock, so no listener joins between this check and the removal.
            let mut polls = waiters.polls();
            if tx.receiver_count() == 0 {
                polls.remove(&id);
                return;
            }
        }
        let read = deadline(Instant::now(), cfg.timing.store_timeout());
        let live = matches!(
            bounded(read, timed(crate::metrics::store_timer(cfg.store.name(), "get"), cfg.store.get(&id))).await,
            Ok(Some(r)) if matches!(r.state, RecordState::InProgress { lease_remaining } if !lease_remaining.is_zero())
        );
        // Completed, released, lapsed or a store error: the listeners claim again to find out.
        if !live {
            waiters.polls().remove(&id);
            let _ = tx.send(true);
            return;
        }
    }
}

/// A pause between half of `pause` and all of it, so pollers on many replicas spread out.
fn jitter(pause: Duration) -> Duration {
    let r = getrandom::u32().unwrap_or(u32::MAX);
    let half = pause / 2;
    half + half.mul_f64(f64::from(r) / f64::from(u32::MAX))
}

impl Waiters {
    /// Wait mode: waits until the record is no longer a live claim (`true`), or `until`
    /// passes, or too many wait already (`false`). Waiters of one record share one poll; the
    /// time waited is counted.
    pub(crate) async fn wait_for_change(
        self: &Arc<Self>,
        cfg: &Arc<Config>,
        labels: &Labels,
        id: RecordId,
        until: Instant,
    ) -> bool {
        let Some(mut ticket) = self.join(cfg, id) else {
            return false;
        };
        let started = Instant::now();
        let changed = tokio::time::timeout_at(until, ticket.changed.wait_for(|c| *c)).await;
        labels.waited(started.elapsed());
        changed.is_ok()
    }
}
