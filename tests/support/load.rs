//! The load harness the storm and soak tests share: a counting inner service behind the
//! layer, answers, the per-key check, and stores with their own key space.
#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, util::BoxCloneService, Layer};
use tower_idempotency::store::{IdempotencyStore, RecordId};
use tower_idempotency::{IdempotencyLayer, RequestBody, ResponseBody, Timing};

use super::{body_bytes, post};

pub type Svc =
    BoxCloneService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, Infallible>;

pub fn env_num(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A run id no other run or process shares, for keys and key prefixes.
pub fn run_id(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{label}-{}-{nanos}", std::process::id())
}

/// Executions per idempotency key, as the inner service saw them.
#[derive(Debug, Default)]
pub struct Ledger {
    runs: Mutex<HashMap<String, usize>>,
    serial: AtomicU64,
}

impl Ledger {
    pub fn runs(&self, key: &str) -> usize {
        self.runs.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Runs over all keys.
    pub fn total(&self) -> u64 {
        self.runs.lock().unwrap().values().map(|n| *n as u64).sum()
    }

    /// Keys that ran more than once.
    pub fn duplicates(&self) -> usize {
        self.runs
            .lock()
            .unwrap()
            .values()
            .filter(|n| **n > 1)
            .count()
    }
}

/// The inner service: records the execution, waits `x-latency-ms`, answers 201 with a body
/// unique to this execution (so two executions can never look like one).
pub fn service(store: Arc<dyn IdempotencyStore>, timing: Timing, ledger: Arc<Ledger>) -> Svc {
    service_with(IdempotencyLayer::from_arc(store), timing, ledger)
}

/// [`service`] with the abandoned-key hook on: the record ids of the keys it names.
pub fn service_hearing_abandoned(
    store: Arc<dyn IdempotencyStore>,
    timing: Timing,
    ledger: Arc<Ledger>,
    heard: Arc<Mutex<HashSet<RecordId>>>,
) -> Svc {
    let layer = IdempotencyLayer::from_arc(store).with_abandoned_hook(move |a| {
        heard.lock().unwrap().insert(a.record);
    });
    service_with(layer, timing, ledger)
}

fn service_with(layer: IdempotencyLayer, timing: Timing, ledger: Arc<Ledger>) -> Svc {
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let ledger = ledger.clone();
        async move {
            let key = req.headers()["idempotency-key"]
                .to_str()
                .unwrap()
                .to_owned();
            let latency = req
                .headers()
                .get("x-latency-ms")
                .map_or(0, |v| v.to_str().unwrap().parse().unwrap());
            *ledger.runs.lock().unwrap().entry(key.clone()).or_default() += 1;
            let n = ledger.serial.fetch_add(1, Ordering::SeqCst);
            if latency > 0 {
                tokio::time::sleep(Duration::from_millis(latency)).await;
            } else {
                tokio::task::yield_now().await;
            }
            let mut res = Response::new(Full::new(Bytes::from(format!("pay_{n} for {key}"))));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        }
    });
    BoxCloneService::new(layer.unscoped().with_timing(timing).layer(inner))
}

pub fn keyed(key: &str, body: &str, latency_ms: u64) -> Request<Full<Bytes>> {
    let mut req = post("/v1/payments", Some(key), body);
    req.headers_mut()
        .insert("x-latency-ms", latency_ms.to_string().parse().unwrap());
    req
}

/// One answer: status, replayed or not, body.
pub type Answer = (StatusCode, bool, Bytes);

pub async fn answer(res: Response<ResponseBody<Full<Bytes>>>) -> Answer {
    let replayed = res.headers().get("idempotent-replayed").is_some();
    (res.status(), replayed, body_bytes(res).await)
}

/// Checks one key's answers: exactly one execution, one first answer, every other a 409 or
/// that answer byte for byte.
pub fn check_storm(key: &str, runs: usize, answers: &[Answer]) {
    assert_eq!(runs, 1, "{key}: {runs} executions; answers {answers:?}");
    let first: Vec<_> = answers
        .iter()
        .filter(|(s, r, _)| *s == StatusCode::CREATED && !r)
        .collect();
    assert_eq!(first.len(), 1, "{key}: answers {answers:?}");
    let body = &first[0].2;
    for (status, replayed, b) in answers {
        match *status {
            StatusCode::CREATED => assert_eq!(b, body, "{key}: a replay differs"),
            StatusCode::CONFLICT => assert!(!replayed),
            other => panic!("{key}: unexpected {other} in {answers:?}"),
        }
    }
}

#[cfg(feature = "redis")]
pub async fn redis_store(label: &str) -> Option<Arc<dyn IdempotencyStore>> {
    use tower_idempotency::store::redis::RedisStore;
    let url = super::backend::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
    let store = RedisStore::builder()
        .with_key_prefix(format!("{}:", run_id(label)))
        .connect(&url)
        .await
        .unwrap();
    Some(Arc::new(store))
}

#[cfg(feature = "postgres")]
pub async fn postgres_store(
    label: &str,
) -> Option<(Arc<dyn IdempotencyStore>, super::pg::TestSchema)> {
    let url = super::pg::url()?;
    let schema = super::pg::TestSchema::create(&url, label).await;
    let store = super::pg::store_in(&url, &schema, 16, &format!("tidem-{label}")).await;
    Some((Arc::new(store), schema))
}
