//! A soak on every store: `IDEMPOTENCY_SOAK_SECS` (default 10) of high concurrency mixing new
//! keys, replays, conflicts and mismatches. Its own binary (not a module of `tests/reliability`),
//! so the RSS it samples is its own.
//!
//! On a busy machine a store call can pass the layer's store deadline; the layer then answers
//! `503` with `Retry-After`, which the contract allows under overload. The soak retries such an
//! answer as a client would and counts it; it fails on a wrong answer only.

mod support;
use support::{load, rng};

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, StatusCode};
use load::*;
use rng::Rng;
use tower::ServiceExt;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Timing;

/// Attempts of one request before a run of `503`s fails the soak.
const MAX_ATTEMPTS: u32 = 30;

/// Resident set size in KiB, from /proc (Linux); `None` elsewhere.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[derive(Debug, Default)]
struct SoakCounts {
    new: AtomicU64,
    replays: AtomicU64,
    conflicts: AtomicU64,
    mismatches: AtomicU64,
    /// `503` with `Retry-After`, retried.
    overloaded: AtomicU64,
    /// `409` to the retry of a `503`: the timed-out claim had taken effect, and holds the key
    /// until the layer releases it (or its lease lapses). Retried.
    in_progress_after_overload: AtomicU64,
}

/// Sends `key` as a client would: a `503` with `Retry-After` (store overloaded: nothing ran)
/// is retried after the time it names, and so is a `409` once a `503` came for this request
/// (its claim may have taken effect late). Every other answer is returned.
async fn send(svc: Svc, key: &str, body: &str, latency: u64, counts: &SoakCounts) -> Answer {
    let mut overloaded = false;
    for _ in 0..MAX_ATTEMPTS {
        let res = svc
            .clone()
            .oneshot(keyed(key, body, latency))
            .await
            .unwrap();
        let retry_after = res
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let (counter, secs) = match (res.status(), retry_after) {
            (StatusCode::SERVICE_UNAVAILABLE, Some(secs)) => (&counts.overloaded, secs),
            (StatusCode::CONFLICT, Some(secs)) if overloaded => {
                (&counts.in_progress_after_overload, secs)
            }
            _ => return answer(res).await,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        overloaded = true;
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }
    panic!("{key}: still 503 or 409 after {MAX_ATTEMPTS} attempts");
}

/// `IDEMPOTENCY_SOAK_SECS` of 64 workers mixing new keys (50 %), replays of recent keys
/// (20 %), concurrent pairs on one fresh key (20 %) and a recent key with another body (10 %,
/// 422). Every answer must be the expected one, after retries of `503` as [`send`] makes
/// them; 0 duplicate executions; RSS sampled each second must not keep growing.
async fn soak(label: &str, store: Arc<dyn tower_idempotency::store::IdempotencyStore>) {
    let secs = env_num("IDEMPOTENCY_SOAK_SECS", 10);
    let ttl = Duration::from_secs(20);
    let timing = Timing::new(Duration::from_secs(10), ttl).unwrap();
    let ledger = Arc::new(Ledger::default());
    let svc = service(store, timing, ledger.clone());
    let run = run_id(label);
    let seed = Rng::from_env(label).next_u64();
    let counts = Arc::new(SoakCounts::default());
    // Recently completed keys with their answers and when they completed.
    let recent: Arc<Mutex<Vec<(String, Bytes, Instant)>>> = Default::default();
    let next_key = Arc::new(AtomicUsize::new(0));
    let end = Instant::now() + Duration::from_secs(secs);
    let body = "{\"amount\":100,\"currency\":\"EUR\"}";
    let workers: Vec<_> = (0..64u64)
        .map(|w| {
            let (svc, counts, recent, next_key, run, ledger) = (
                svc.clone(),
                counts.clone(),
                recent.clone(),
                next_key.clone(),
                run.clone(),
                ledger.clone(),
            );
            tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ w);
                let fresh = || format!("{run}-{}", next_key.fetch_add(1, Ordering::Relaxed));
                let pick = |rng: &mut Rng| {
                    let recent = recent.lock().unwrap();
                    let usable: Vec<_> = recent
                        .iter()
                        .filter(|(_, _, at)| at.elapsed() < ttl / 2)
                        .collect();
                    (!usable.is_empty())
                        .then(|| usable[rng.range(0, usable.len() as u64 - 1) as usize].clone())
                };
                let remember = |key: String, b: Bytes| {
                    let mut recent = recent.lock().unwrap();
                    if recent.len() >= 512 {
                        recent.remove(0);
                    }
                    recent.push((key, b, Instant::now()));
                };
                while Instant::now() < end {
                    let roll = rng.range(0, 99);
                    let latency = rng.range(0, 3);
                    if roll < 50 {
                        let key = fresh();
                        let a = send(svc.clone(), &key, body, latency, &counts).await;
                        assert_eq!((a.0, a.1), (StatusCode::CREATED, false), "{key}: {a:?}");
                        counts.new.fetch_add(1, Ordering::Relaxed);
                        remember(key, a.2);
                    } else if roll < 70 {
                        let Some((key, b, _)) = pick(&mut rng) else {
                            continue;
                        };
                        let a = send(svc.clone(), &key, body, 0, &counts).await;
                        assert_eq!(a, (StatusCode::CREATED, true, b), "{key}");
                        counts.replays.fetch_add(1, Ordering::Relaxed);
                    } else if roll < 90 {
                        let key = fresh();
                        let (x, y) = tokio::join!(
                            send(svc.clone(), &key, body, latency, &counts),
                            send(svc.clone(), &key, body, latency, &counts),
                        );
                        check_storm(&key, ledger.runs(&key), &[x.clone(), y.clone()]);
                        counts.conflicts.fetch_add(1, Ordering::Relaxed);
                        let first = if x.1 || x.0 == StatusCode::CONFLICT {
                            y
                        } else {
                            x
                        };
                        remember(key, first.2);
                    } else {
                        let Some((key, _, _)) = pick(&mut rng) else {
                            continue;
                        };
                        let other = "{\"amount\":999,\"currency\":\"EUR\"}";
                        let a = send(svc.clone(), &key, other, 0, &counts).await;
                        assert_eq!(a.0, StatusCode::UNPROCESSABLE_ENTITY, "{key}: {a:?}");
                        counts.mismatches.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let mut samples = Vec::new();
    while Instant::now() < end {
        samples.extend(rss_kib());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for w in workers {
        w.await.unwrap();
    }
    samples.extend(rss_kib());
    assert_eq!(ledger.duplicates(), 0, "{label}: duplicate executions");
    eprintln!("{label}: {secs} s, {counts:?}, 0 duplicate executions, RSS KiB {samples:?}");
    // Bounded: the second half of the run may not grow past the first half's peak by more
    // than half again plus 64 MiB (records live 20 s; the memory store sweeps them).
    if samples.len() >= 4 {
        let half = samples.len() / 2;
        let early = *samples[..half].iter().max().unwrap();
        let late = *samples[half..].iter().max().unwrap();
        assert!(
            late <= early + early / 2 + 64 * 1024,
            "{label}: RSS grew from {early} KiB to {late} KiB"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_on_the_memory_store_answers_only_expected_statuses() {
    let store = MemoryStore::builder()
        .with_sweep_interval(Duration::from_secs(1))
        .build();
    soak("soak/memory", Arc::new(store)).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_on_redis_answers_only_expected_statuses() {
    let Some(store) = redis_store("soak-redis").await else {
        return;
    };
    soak("soak/redis", store).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn soak_on_postgres_answers_only_expected_statuses() {
    let Some((store, schema)) = postgres_store("soak").await else {
        return;
    };
    soak("soak/postgres", store).await;
    schema.drop_now().await;
}
