//! Several shop processes (the `shop` example's binary) on one Redis or Postgres: duplicate
//! storms spread over two replicas, a SIGKILLed holder, and a SIGSTOPped holder that outlives
//! its lease. `cargo test --all-features` builds the binary; alone, run
//! `cargo build --example shop --all-features` first. The shops' recovery workers are off
//! here (the harness's default): these tests are about the takeover by a client's retry;
//! `recovery` has the worker's.
use crate::support::backend as common;
use crate::support::load::run_id;
use crate::support::rng;
use crate::support::shop::{charges, client, pay, Answer, Http, Shop};

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use rng::Rng;
use tokio::sync::Barrier;

fn urls() -> Option<(String, String)> {
    let redis = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
    let postgres = common::backend_url("IDEMPOTENCY_TEST_POSTGRES_URL")?;
    Some((redis, postgres))
}

/// Storms of 2..=64 duplicates, each sent to a random one of two shop processes (card
/// latency 5 ms and 20 ms). Per key: one charge over both processes, one first answer, every
/// other a 409 or its byte-identical replay.
async fn storms_over_two_processes(store: &str, label: &str) {
    let trials = std::env::var("IDEMPOTENCY_STORM_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100u64);
    let a = Shop::start(store, 30_000, 5).await;
    let b = Shop::start(store, 30_000, 20).await;
    let ports = [a.port, b.port];
    let http = client();
    let mut rng = Rng::from_env(label);
    let api_key = run_id(label);
    let mut requests = 0;
    for trial in 0..trials {
        let n = rng.range(2, 64) as usize;
        // The shop declines 402 and fails 503 on purpose; every other amount charges.
        let amount = match rng.range(1, 10_000) {
            402 | 503 => 1,
            a => a,
        };
        let key = format!("k{trial}");
        let barrier = Arc::new(Barrier::new(n));
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let port = ports[rng.range(0, 1) as usize];
                let (http, barrier, api_key, key) =
                    (http.clone(), barrier.clone(), api_key.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    pay(&http, port, &api_key, &key, amount).await.unwrap()
                })
            })
            .collect();
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.unwrap());
        }
        let first: Vec<_> = answers
            .iter()
            .filter(|(s, r, _)| *s == StatusCode::CREATED && !r)
            .collect();
        assert_eq!(first.len(), 1, "{key}: {answers:?}");
        let body = first[0].2.clone();
        for (s, _, b) in &answers {
            match *s {
                StatusCode::CREATED => assert_eq!(*b, body, "{key}: a replay differs"),
                StatusCode::CONFLICT => {}
                other => panic!("{key}: unexpected {other}: {answers:?}"),
            }
        }
        let total = charges(&http, a.port).await + charges(&http, b.port).await;
        assert_eq!(total, trial + 1, "{key}: charged twice");
        requests += n;
    }
    eprintln!(
        "{label}: {trials} storms, {requests} requests over 2 processes, 0 duplicate charges"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storms_over_two_processes_on_redis_charge_each_key_once() {
    let Some((redis, _)) = urls() else { return };
    storms_over_two_processes(&redis, "processes/redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storms_over_two_processes_on_postgres_charge_each_key_once() {
    let Some((_, postgres)) = urls() else { return };
    storms_over_two_processes(&postgres, "processes/postgres").await;
}

const LEASE_MS: u64 = 1500;

/// Sends `key` to `port` until the answer is not a 409; returns that answer and how many 409s
/// came first.
async fn until_not_409(http: &Http, port: u16, api_key: &str, key: &str) -> (Answer, usize) {
    let mut conflicts = 0;
    loop {
        let a = pay(http, port, api_key, key, 100).await.unwrap();
        if a.0 != StatusCode::CONFLICT {
            return (a, conflicts);
        }
        conflicts += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

type InFlight = Vec<tokio::task::JoinHandle<Result<Answer, String>>>;

/// Sends `key` to `port` until one answer is a 409: then a request on `port` holds the key.
/// Returns the requests still in flight; the holder is among them.
async fn hold(http: &Http, port: u16, api_key: &str, key: &str) -> InFlight {
    let mut in_flight = Vec::new();
    for _ in 0..50 {
        let (http, api_key, key) = (http.clone(), api_key.to_owned(), key.to_owned());
        let mut probe = tokio::spawn(async move { pay(&http, port, &api_key, &key, 100).await });
        match tokio::time::timeout(Duration::from_millis(300), &mut probe).await {
            Ok(done) => {
                let a = done.unwrap().unwrap();
                assert_eq!(a.0, StatusCode::CONFLICT, "{a:?}");
                return in_flight;
            }
            // Still running: it holds the key, or is slow to get its 409.
            Err(_) => in_flight.push(probe),
        }
    }
    panic!("{key} was never held");
}

/// SIGKILL the holder mid-request, restart: 409 until the lease ends, then exactly one
/// takeover, then only replays of the takeover's answer.
async fn crash(store: &str, label: &str) {
    let http = client();
    let api_key = run_id(label);
    let key = "crash";
    // The charge takes 10 s: the kill lands while the handler runs.
    let mut a = Shop::start(store, LEASE_MS, 10_000).await;
    let in_flight = hold(&http, a.port, &api_key, key).await;
    let killed = Instant::now();
    a.sigkill();
    for t in in_flight {
        match t.await.unwrap() {
            Err(_) => {}
            Ok(a) => assert_eq!(
                a.0,
                StatusCode::CONFLICT,
                "an answer from the killed holder"
            ),
        }
    }
    let restarted = Shop::start(store, LEASE_MS, 50).await;
    let (takeover, conflicts) = until_not_409(&http, restarted.port, &api_key, key).await;
    let waited = killed.elapsed();
    assert_eq!(
        (takeover.0, takeover.1),
        (StatusCode::CREATED, false),
        "{takeover:?}"
    );
    let v: serde_json::Value = serde_json::from_slice(&takeover.2).unwrap();
    assert_eq!(v["status"], "succeeded");
    // The holder saved its `created` point before the charge it died in: the takeover
    // resumed from it, with the dead attempt's payment (the restarted shop created none).
    assert_eq!(v["resumed_from"], "created", "{v}");
    assert_eq!(v["id"], "pay_1", "{v}");
    // The last renewal came at most lease/3 before the kill, so the lease ran at least
    // 2/3 of a lease past it: no takeover before then.
    assert!(
        waited >= Duration::from_millis(LEASE_MS * 2 / 3),
        "taken over {waited:?} after the kill"
    );
    for _ in 0..5 {
        let again = pay(&http, restarted.port, &api_key, key, 100)
            .await
            .unwrap();
        assert_eq!(again, (StatusCode::CREATED, true, takeover.2.clone()));
    }
    assert_eq!(charges(&http, restarted.port).await, 1);
    eprintln!("{label}: SIGKILL; {conflicts} retries got 409, takeover after {waited:?}, 1 charge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_taken_over_once_after_its_lease_on_redis() {
    let Some((redis, _)) = urls() else { return };
    crash(&redis, "crash/redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_taken_over_once_after_its_lease_on_postgres() {
    let Some((_, postgres)) = urls() else { return };
    crash(&postgres, "crash/postgres").await;
}

/// SIGSTOP the holder past its lease: the other process takes over and answers; after
/// SIGCONT the paused holder's complete is fenced and every retry, on either process,
/// replays the new holder's answer.
async fn pause(store: &str, label: &str) {
    let http = client();
    let api_key = run_id(label);
    // The charge takes 3 s, so A is still inside it when it is stopped.
    let a = Shop::start(store, LEASE_MS, 3000).await;
    let b = Shop::start(store, LEASE_MS, 50).await;
    // Three charges on A first, so its next payment id differs from B's first.
    for i in 0..3 {
        let warm = pay(&http, a.port, &api_key, &format!("warm-{i}"), 1)
            .await
            .unwrap();
        assert_eq!(warm.0, StatusCode::CREATED);
    }
    let key = "paused";
    let in_flight = hold(&http, a.port, &api_key, key).await;
    a.signal("STOP");
    let (takeover, _) = until_not_409(&http, b.port, &api_key, key).await;
    assert_eq!(
        (takeover.0, takeover.1),
        (StatusCode::CREATED, false),
        "{takeover:?}"
    );
    // A had saved its `created` point (pay_4) before it was stopped: B resumed from it.
    let resumed: serde_json::Value = serde_json::from_slice(&takeover.2).unwrap();
    assert_eq!(
        (&resumed["id"], &resumed["resumed_from"]),
        (&"pay_4".into(), &"created".into()),
        "{resumed}"
    );
    a.signal("CONT");
    // A finishes its charge; its `charged` point and its record are fenced. It still answers
    // its own client with the payment: the one B resumed, charged under the same key.
    let mut late = Vec::new();
    for t in in_flight {
        let a = t.await.unwrap().unwrap();
        if a.0 != StatusCode::CONFLICT {
            assert_ne!(
                a.2, takeover.2,
                "the paused holder's answer should be its own"
            );
            let v: serde_json::Value = serde_json::from_slice(&a.2).unwrap();
            assert_eq!(v["id"], "pay_4", "{v}");
            late.push(a.0);
        }
    }
    assert!(late.len() <= 1, "{late:?}");
    for port in [a.port, b.port, a.port, b.port] {
        let again = pay(&http, port, &api_key, key, 100).await.unwrap();
        assert_eq!(again, (StatusCode::CREATED, true, takeover.2.clone()));
    }
    assert_eq!(charges(&http, b.port).await, 1);
    assert_eq!(charges(&http, a.port).await, 3 + 1);
    eprintln!(
        "{label}: SIGSTOP past the lease; takeover on the other process, the paused holder's \
         late answer ({late:?}) fenced"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_is_fenced_after_a_takeover_on_redis() {
    let Some((redis, _)) = urls() else { return };
    pause(&redis, "pause/redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_is_fenced_after_a_takeover_on_postgres() {
    let Some((_, postgres)) = urls() else { return };
    pause(&postgres, "pause/postgres").await;
}
