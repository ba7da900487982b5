//! Reliability under load, on every store: randomized duplicate storms and cancellation at
//! every await. `IDEMPOTENCY_STORM_TRIALS` (default 100) sets the trials per store;
//! `IDEMPOTENCY_TEST_SEED` replays a run.

use crate::support;
use crate::support::load;
use crate::support::rng;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use http::StatusCode;
use load::*;
use rng::Rng;
use support::{Fault, Op};
use tokio::sync::Barrier;
use tower::ServiceExt;
use tower_idempotency::store::{IdempotencyStore, MemoryStore};
use tower_idempotency::{
    store::{Completion, RecordId, RecordState},
    Timing,
};

/// Trials of 2..=64 identical requests released by one barrier, each with a fresh key and a
/// random inner latency (0..=25 ms). Returns (trials, requests).
async fn storms(label: &str, store: Arc<dyn IdempotencyStore>) -> (u64, u64) {
    let trials = env_num("IDEMPOTENCY_STORM_TRIALS", 100).max(1);
    let mut rng = Rng::from_env(label);
    let ledger = Arc::new(Ledger::default());
    let svc = service(store, Timing::default(), ledger.clone());
    let run = run_id(label);
    let mut requests = 0;
    for trial in 0..trials {
        let n = rng.range(2, 64) as usize;
        let latency = rng.range(0, 25);
        let key = format!("{run}-{trial}");
        let body = format!(
            "{{\"amount\":{},\"currency\":\"EUR\"}}",
            rng.range(1, 10_000)
        );
        let barrier = Arc::new(Barrier::new(n));
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (svc, barrier, req) =
                    (svc.clone(), barrier.clone(), keyed(&key, &body, latency));
                tokio::spawn(async move {
                    barrier.wait().await;
                    answer(svc.oneshot(req).await.unwrap()).await
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(n + 1);
        for t in tasks {
            answers.push(t.await.unwrap());
        }
        // Once settled, a retry replays the one answer.
        let after = answer(svc.clone().oneshot(keyed(&key, &body, 0)).await.unwrap()).await;
        assert!(
            after.1,
            "{key}: the retry after the storm was not a replay: {after:?}"
        );
        answers.push(after);
        check_storm(&key, ledger.runs(&key), &answers);
        requests += n as u64 + 1;
    }
    assert_eq!(ledger.duplicates(), 0);
    eprintln!("{label}: {trials} storms, {requests} requests, 0 duplicate executions");
    (trials, requests)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storms_on_the_memory_store_run_each_key_once() {
    storms("storms/memory", Arc::new(MemoryStore::new())).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storms_on_redis_run_each_key_once() {
    let Some(store) = redis_store("storms-redis").await else {
        return;
    };
    storms("storms/redis", store).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storms_on_postgres_run_each_key_once() {
    let Some((store, schema)) = postgres_store("storms").await else {
        return;
    };
    storms("storms/postgres", store).await;
    schema.drop_now().await;
}

/// Polls `fut` at most `k` times, letting other tasks and (paused) time run 1 ms between
/// polls. `true` if it finished.
async fn poll_k_times<F: Future + Unpin>(fut: &mut F, k: usize) -> bool {
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    for _ in 0..k {
        if std::pin::Pin::new(&mut *fut).poll(&mut cx).is_ready() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    false
}

/// For every k, polls one keyed request k times and drops it; then retries until the key
/// settles. Each key runs at most once; whatever the drop point, the store holds either
/// nothing or the one answer, and the retry gets the replay or runs it once (a takeover or
/// a first run).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn dropping_the_future_after_any_number_of_polls_never_runs_twice() {
    // Every store call takes 1 ms, so each one is an await the drop can land on.
    let store = support::FaultStore::new(MemoryStore::new());
    for op in [Op::Claim, Op::Extend, Op::Complete, Op::Release, Op::Get] {
        store.on_all(op, Fault::Delay(Duration::from_millis(1)));
    }
    let ledger = Arc::new(Ledger::default());
    let timing = Timing::new(Duration::from_millis(600), Duration::from_secs(60)).unwrap();
    let svc = service(store.clone(), timing, ledger.clone());
    let run = run_id("cancel");
    let mut outcomes: HashMap<&str, usize> = HashMap::new();
    for k in 0..1000 {
        let key = format!("{run}-{k}");
        let mut fut = Box::pin(svc.clone().oneshot(keyed(&key, "{\"amount\":1}", 5)));
        let finished = poll_k_times(&mut fut, k).await;
        drop(fut);
        // The retry: 409 while the dropped request's work (or its stranded claim) holds the
        // key; paused time makes waiting out the lease free.
        let answer = loop {
            let a = answer(
                svc.clone()
                    .oneshot(keyed(&key, "{\"amount\":1}", 5))
                    .await
                    .unwrap(),
            )
            .await;
            if a.0 != StatusCode::CONFLICT {
                break a;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(answer.0, StatusCode::CREATED, "k={k}: {answer:?}");
        assert_eq!(
            ledger.runs(&key),
            1,
            "k={k}: ran {} times",
            ledger.runs(&key)
        );
        let record = store
            .get(&RecordId::new(None, &key))
            .await
            .unwrap()
            .expect("a completed record");
        match record.state {
            RecordState::Completed(Completion::Response(r)) => {
                assert_eq!(
                    r.body, answer.2,
                    "k={k}: the stored answer is not the one given"
                )
            }
            other => panic!("k={k}: {other:?}"),
        }
        *outcomes
            .entry(if answer.1 { "replay" } else { "ran on retry" })
            .or_default() += 1;
        if finished {
            eprintln!("cancellation: dropped after 0..{k} polls: {outcomes:?}");
            assert!(
                k > 2,
                "the request finished in {k} polls: nothing was cancelled"
            );
            break;
        }
    }
    assert!(outcomes.contains_key("ran on retry") && outcomes.contains_key("replay"));
}
