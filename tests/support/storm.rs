//! Duplicate storms across a store failover, shared by the Redis and Postgres failover suites:
//! 16 clients send fresh keys, each key twice at once, retrying, while a fault hits the store;
//! afterwards every acknowledged key is asked for again. They count requests, acknowledged
//! keys, executions, duplicates, lost acknowledged answers, and keys run again that the
//! abandoned-key hook did not name.
#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use tower::ServiceExt;
use tower_idempotency::store::{IdempotencyStore, RecordId};
use tower_idempotency::Timing;

use super::load::{self, answer, keyed, run_id, Answer, Ledger};

const TTL: Duration = Duration::from_secs(600);

/// What one storm across a failover saw.
#[derive(Debug, Default)]
pub struct Figures {
    pub requests: u64,
    /// Keys some client got a 201 for.
    pub acknowledged: u64,
    /// Runs of the inner service, over all keys (the check afterwards included).
    pub executions: u64,
    /// Acknowledged keys whose answer, asked for again after the failover, was not the first
    /// one byte for byte.
    pub lost: u64,
    /// Keys whose two clients got two different 201s.
    pub mismatched: u64,
    /// Keys no client got an answer for within the per-key deadline.
    pub unanswered: u64,
    /// The longest time without any 201, from the fault on.
    pub outage: Duration,
    /// From the fault until the new primary was in place (every Sentinel named it, or the
    /// old primary was fenced).
    pub promoted_after: Duration,
    /// Keys the inner service ran more than once.
    pub reran: u64,
    /// Of those, keys the abandoned-key hook never named: a run again that the application
    /// cannot learn of to reconcile.
    pub reran_unheard: u64,
    /// Whether the two above were counted: the target sees the hook.
    pub hook_seen: bool,
}

impl Figures {
    pub fn duplicates(&self) -> i64 {
        self.executions as i64 - self.acknowledged as i64
    }
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} requests, {} acknowledged keys, {} executions, {} duplicates, {} lost \
             acknowledged answers, {} mismatched, {} unanswered, outage {:.1} s (promotion \
             seen after {:.1} s)",
            self.requests,
            self.acknowledged,
            self.executions,
            self.duplicates(),
            self.lost,
            self.mismatched,
            self.unanswered,
            self.outage.as_secs_f64(),
            self.promoted_after.as_secs_f64(),
        )?;
        if self.hook_seen {
            write!(
                f,
                ", {} keys run again, {} of them unheard by the abandoned-key hook",
                self.reran, self.reran_unheard
            )?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    unanswered: AtomicU64,
    mismatched: AtomicU64,
    /// The first 201 body per key.
    acked: Mutex<HashMap<String, Bytes>>,
    /// When each 201 arrived.
    successes: Mutex<Vec<Instant>>,
}

const BODY: &str = r#"{"amount":1250,"currency":"EUR"}"#;

/// Sends `key` until a 201, retrying 409 and 503 every 50 ms, for at most the lease plus
/// 40 s: a request caught by the failover may wait out its lease recording its answer, and
/// the outage can last 15 s more.
async fn send_until_answered<T: Target>(
    target: Arc<T>,
    key: String,
    client: usize,
    tally: Arc<Tally>,
    lease: Duration,
) {
    let deadline = Instant::now() + lease + Duration::from_secs(40);
    loop {
        tally.requests.fetch_add(1, Ordering::Relaxed);
        let got = target.send(&key, client).await;
        if let Some((StatusCode::CREATED, _, body)) = got {
            tally.successes.lock().unwrap().push(Instant::now());
            let mut acked = tally.acked.lock().unwrap();
            match acked.get(&key) {
                Some(first) if *first != body => {
                    tally.mismatched.fetch_add(1, Ordering::Relaxed);
                }
                Some(_) => {}
                None => {
                    acked.insert(key, body);
                }
            }
            return;
        }
        if Instant::now() > deadline {
            tally.unanswered.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // A client's retry pacing.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where a storm's requests go: the layer in-process ([`Layer`]), or shop processes.
pub trait Target: Send + Sync + 'static {
    /// One attempt with `key` by the key's client `client` (0 or 1); `None` when no answer
    /// came (the connection was lost).
    fn send(&self, key: &str, client: usize) -> impl Future<Output = Option<Answer>> + Send;
    /// Runs of the work so far, over all keys.
    fn executions(&self) -> impl Future<Output = u64> + Send;
    /// Of `keys`, how many ran more than once and how many of those the abandoned-key hook
    /// did not name; `None` where the hook cannot be seen.
    fn reran(&self, keys: &[String]) -> Option<(u64, u64)>;
}

/// The layer in-process over a store, with the load harness's counting service (5 ms of
/// work per request) and the abandoned-key hook recorded.
pub struct Layer {
    // A BoxCloneService is Send but not Sync; each request clones it out.
    svc: Mutex<load::Svc>,
    ledger: Arc<Ledger>,
    heard: Arc<Mutex<HashSet<RecordId>>>,
}

impl Layer {
    pub fn new(store: Arc<dyn IdempotencyStore>, lease: Duration) -> Self {
        let ledger = Arc::new(Ledger::default());
        let heard = Arc::new(Mutex::new(HashSet::new()));
        let timing = Timing::new(lease, TTL).unwrap();
        let svc = load::service_hearing_abandoned(store, timing, ledger.clone(), heard.clone());
        Layer {
            svc: Mutex::new(svc),
            ledger,
            heard,
        }
    }
}

impl Target for Layer {
    async fn send(&self, key: &str, _client: usize) -> Option<Answer> {
        let svc = self.svc.lock().unwrap().clone();
        let res = svc.oneshot(keyed(key, BODY, 5)).await.unwrap();
        Some(answer(res).await)
    }

    async fn executions(&self) -> u64 {
        self.ledger.total()
    }

    fn reran(&self, keys: &[String]) -> Option<(u64, u64)> {
        let heard = self.heard.lock().unwrap();
        let again: Vec<_> = keys.iter().filter(|k| self.ledger.runs(k) > 1).collect();
        let unheard = again
            .iter()
            .filter(|k| !heard.contains(&RecordId::new(None, k)))
            .count();
        Some((again.len() as u64, unheard as u64))
    }
}

/// [`storm_on`] the layer over `store`.
pub async fn storm(
    store: Arc<dyn IdempotencyStore>,
    lease: Duration,
    fault: impl AsyncFnOnce() -> Instant,
) -> Figures {
    storm_on(Arc::new(Layer::new(store, lease)), lease, fault).await
}

/// Runs the storm on `target`: 1.5 s on the healthy store, then `fault`, which returns once
/// the new primary is in place; once a 201 came after that the load runs 1 s more and stops.
/// Then every acknowledged key is sent once more: it must replay its first answer.
pub async fn storm_on<T: Target>(
    target: Arc<T>,
    lease: Duration,
    fault: impl AsyncFnOnce() -> Instant,
) -> Figures {
    let executions_before = target.executions().await;
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicU64::new(0));
    let run = run_id("storm");
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (target, tally, stop, next, run) = (
                target.clone(),
                tally.clone(),
                stop.clone(),
                next.clone(),
                run.clone(),
            );
            tokio::spawn(async move {
                let mut keys = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("{run}-{}", next.fetch_add(1, Ordering::Relaxed));
                    let a =
                        send_until_answered(target.clone(), key.clone(), 0, tally.clone(), lease);
                    let b =
                        send_until_answered(target.clone(), key.clone(), 1, tally.clone(), lease);
                    tokio::join!(a, b);
                    keys.push(key);
                }
                keys
            })
        })
        .collect();
    // The storm runs on the old primary for a while first.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let fault_at = Instant::now();
    let promoted_at = fault().await;
    // Wait (bounded) for a 201 answered after the promotion, then let the load run on.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !tally
        .successes
        .lock()
        .unwrap()
        .iter()
        .any(|t| *t > promoted_at)
    {
        assert!(
            Instant::now() < deadline,
            "no request succeeded within 60 s of the promotion"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut keys = Vec::new();
    for w in workers {
        keys.extend(w.await.unwrap());
    }

    let mut figures = Figures {
        requests: tally.requests.load(Ordering::Relaxed),
        mismatched: tally.mismatched.load(Ordering::Relaxed),
        unanswered: tally.unanswered.load(Ordering::Relaxed),
        promoted_after: promoted_at - fault_at,
        ..Figures::default()
    };
    let mut times = tally.successes.lock().unwrap().clone();
    times.sort();
    let mut last = fault_at;
    for t in times.into_iter().filter(|t| *t > fault_at) {
        figures.outage = figures.outage.max(t - last);
        last = t;
    }
    // Every acknowledged answer, asked for again: replayed byte for byte, or lost.
    let acked = tally.acked.lock().unwrap().clone();
    figures.acknowledged = acked.len() as u64;
    for (key, first) in &acked {
        // A key left in progress answers once its lease lapses.
        let deadline = Instant::now() + lease + Duration::from_secs(10);
        loop {
            match target.send(key, 0).await {
                Some((StatusCode::CREATED, replayed, body)) => {
                    if !(replayed && body == *first) {
                        figures.lost += 1;
                    }
                    break;
                }
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => panic!("{key}: still {other:?} a lease after the failover"),
            }
        }
    }
    figures.executions = target.executions().await - executions_before;
    if let Some((reran, unheard)) = target.reran(&keys) {
        (figures.reran, figures.reran_unheard, figures.hook_seen) = (reran, unheard, true);
    }
    figures
}
