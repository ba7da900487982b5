//! Resumable work through the layer, on each store: a holder that dies after saving a
//! recovery point is resumed by the client's retry or by the recovery worker, and each step
//! with a side effect runs once; a stale holder's save is refused and its later steps do not
//! run; a recovery that always fails stops after its attempts; two workers never recover one
//! record twice.
//!
//! A holder "dies" by `mem::forget` of its request future: no destructor, no release and no
//! renewal run, as when the process is killed. Each test has its own store (its own Redis key
//! prefix, its own Postgres schema), since the worker recovers whatever its store lists.

use crate::support;
use crate::support::backend as common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use support::{body_bytes, post};
use tokio::sync::Notify;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::{
    async_trait, AdminStore, ClaimOutcome, ClaimRequest, Completion, IdempotencyAdmin,
    IdempotencyStore, Record, RecordId, RecordState, RecoveryPoint, Removal, StoreError, Token,
};
use tower_idempotency::{
    BoxError, IdempotencyContext, IdempotencyLayer, RecoveryWorker, RequestBody, ResponseBody,
    Timing,
};

/// Long enough for a store call under load on 2 cores (the store deadline is 400 ms, below
/// lease / 3), short enough that a test waits out a few leases.
const LEASE: Duration = Duration::from_millis(1500);
/// Past a lapsed lease, with room for clock granularity (Redis and Postgres use their own).
const LAPSE: Duration = Duration::from_millis(1900);

/// Where a holder stops for good (a test then forgets it) or until `gate`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stall {
    /// After saving "created", before the charge.
    Created,
    /// After the charge, before saving "charged".
    Charging,
}

/// The payment service's side effects, counted.
#[derive(Default)]
struct Payments {
    created: AtomicUsize,
    /// Charge calls by idempotency key (the card network sees every call) ...
    charge_calls: Mutex<HashMap<String, usize>>,
    /// ... and the charges it executed (it dedupes by key).
    charged: Mutex<HashMap<String, usize>>,
    receipts: Mutex<HashMap<String, usize>>,
    /// The stall the next attempt to start takes (then cleared).
    stall: Mutex<Option<Stall>>,
    stalled: Notify,
    /// Releases an attempt stalled at `Stall::Created` ...
    created_gate: Notify,
    /// ... or at `Stall::Charging`.
    charging_gate: Notify,
    /// Attempts stopped by a refused save.
    fenced: AtomicUsize,
    /// The next attempt declines at once (it undid its work, say) and answers 500.
    decline: std::sync::atomic::AtomicBool,
}

impl Payments {
    fn count(map: &Mutex<HashMap<String, usize>>, key: &str) -> usize {
        map.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// The card network: keyed by the payment, so a repeated call charges once.
    fn charge(&self, key: &str) {
        *self
            .charge_calls
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default() += 1;
        let mut charged = self.charged.lock().unwrap();
        let n = charged.entry(key.to_owned()).or_default();
        *n = 1;
    }
}

/// The three phases: create the payment and save "created"; charge it (keyed by the payment
/// id) and save "charged"; send the receipt and answer. A resumed attempt skips what its
/// point says is done and reuses the payment id.
async fn phases(p: Arc<Payments>, ctx: IdempotencyContext) -> Result<Response<Bytes>, BoxError> {
    if p.decline.swap(false, Ordering::SeqCst) {
        return Err("the payment was cancelled".into());
    }
    let stall = p.stall.lock().unwrap().take();
    let resumed = ctx.recovery_point().map(|pt| {
        (
            pt.step().to_owned(),
            String::from_utf8(pt.data().to_vec()).unwrap(),
        )
    });
    let (mut step, id) = match &resumed {
        Some((step, id)) => (step.clone(), id.clone()),
        None => {
            let id = format!("pay_{}", p.created.fetch_add(1, Ordering::SeqCst) + 1);
            ctx.save_recovery_point("created", id.clone()).await?;
            ("created".to_owned(), id)
        }
    };
    if stall == Some(Stall::Created) {
        p.stalled.notify_one();
        p.created_gate.notified().await;
    }
    if step == "created" {
        p.charge(&format!("charge:{id}"));
        if stall == Some(Stall::Charging) {
            p.stalled.notify_one();
            p.charging_gate.notified().await;
        }
        if let Err(e) = ctx.save_recovery_point("charged", id.clone()).await {
            // Another attempt took over: it runs the rest.
            p.fenced.fetch_add(1, Ordering::SeqCst);
            return Err(e.into());
        }
        step = "charged".to_owned();
    }
    debug_assert_eq!(step, "charged");
    *p.receipts.lock().unwrap().entry(id.clone()).or_default() += 1;
    let body = serde_json::json!({
        "id": id,
        "resumed_from": resumed.map(|(s, _)| s),
        "generation": ctx.generation(),
    });
    let mut res = Response::new(Bytes::from(body.to_string()));
    *res.status_mut() = StatusCode::CREATED;
    Ok(res)
}

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<ResponseBody<Full<Bytes>>>,
    Infallible,
>;

fn layer(store: Arc<dyn IdempotencyStore>) -> IdempotencyLayer {
    let timing = Timing::new(LEASE, Duration::from_secs(120))
        .unwrap()
        .with_store_timeout(Duration::from_millis(400))
        .unwrap();
    IdempotencyLayer::new(store)
        .with_scope(support::tenant_scope)
        .with_timing(timing)
}

fn service(layer: &IdempotencyLayer, p: &Arc<Payments>) -> Svc {
    let p = p.clone();
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let p = p.clone();
        async move {
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .unwrap();
            let res = match phases(p, ctx).await {
                Ok(res) => res.map(Full::new),
                Err(e) => {
                    let mut res = Response::new(Full::new(Bytes::from(e.to_string())));
                    *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                    res
                }
            };
            Ok::<_, Infallible>(res)
        }
    });
    tower::util::BoxCloneService::new(layer.clone().layer(inner))
}

/// What the recover function returns: the phases' future, boxed to name it.
type Recovering = Pin<Box<dyn Future<Output = Result<Response<Bytes>, BoxError>> + Send>>;

fn worker(
    layer: &IdempotencyLayer,
    p: &Arc<Payments>,
) -> RecoveryWorker<impl Fn(IdempotencyContext) -> Recovering + Send + Sync + 'static> {
    let p = p.clone();
    RecoveryWorker::new(layer, move |ctx| -> Recovering {
        Box::pin(phases(p.clone(), ctx))
    })
}

fn pay(key: &str) -> Request<Full<Bytes>> {
    let mut req = post("/v1/payments", Some(key), r#"{"amount":1000}"#);
    req.headers_mut()
        .insert("x-tenant", http::HeaderValue::from_static("acme"));
    req
}

type Pending =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<Full<Bytes>>>, Infallible>> + Send>>;

/// Starts a request with `stall` and polls it until it stalls there; the future is returned
/// unpolled from then on (no renewal runs).
async fn start_stalled(svc: &Svc, p: &Payments, key: &str, stall: Stall) -> Pending {
    *p.stall.lock().unwrap() = Some(stall);
    let mut fut: Pending = Box::pin(svc.clone().oneshot(pay(key)));
    tokio::select! {
        r = &mut fut => panic!("the holder answered instead of stalling: {:?}", r.map(|r| r.status())),
        () = p.stalled.notified() => {}
    }
    fut
}

/// Starts a request that dies with its process once it reached `stall`.
#[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
async fn die_at(svc: &Svc, p: &Payments, key: &str, stall: Stall) {
    std::mem::forget(start_stalled(svc, p, key, stall).await);
}

async fn answer(svc: &Svc, key: &str) -> (StatusCode, bool, serde_json::Value) {
    let res = svc.clone().oneshot(pay(key)).await.unwrap();
    let status = res.status();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    let body = body_bytes(res).await;
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|_| panic!("{status}: {}", String::from_utf8_lossy(&body)));
    (status, replayed, json)
}

fn unique(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{label}-{}-{nanos}", std::process::id())
}

fn record_id(key: &str) -> RecordId {
    RecordId::new(Some("acme"), key)
}

// ---- the scenarios, each on a fresh store ------------------------------------------------

async fn a_retry_resumes_after_the_holder_died(store: Arc<dyn AdminStore>) {
    let p = Arc::new(Payments::default());
    let svc = service(&layer(store.clone()), &p);
    let (early, late) = (unique("died-created"), unique("died-charging"));

    die_at(&svc, &p, &early, Stall::Created).await;
    die_at(&svc, &p, &late, Stall::Charging).await;
    // While the dead holder's lease lives, a retry waits its turn (409), and runs nothing.
    let res = svc.clone().oneshot(pay(&early)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    tokio::time::sleep(LAPSE).await;

    let (status, replayed, body) = answer(&svc, &early).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{body}");
    assert_eq!(body["id"], "pay_1", "the payment id of the point is reused");
    assert_eq!(body["resumed_from"], "created");
    assert_eq!(body["generation"], 2);
    // Died after the charge but before saving it: the retry charges again, keyed by the
    // payment, and the card network charges once.
    let (status, _, body) = answer(&svc, &late).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        (body["id"].as_str(), body["resumed_from"].as_str()),
        (Some("pay_2"), Some("created"))
    );

    assert_eq!(
        p.created.load(Ordering::SeqCst),
        2,
        "each payment created once"
    );
    for id in ["pay_1", "pay_2"] {
        assert_eq!(Payments::count(&p.charged, &format!("charge:{id}")), 1);
        assert_eq!(Payments::count(&p.receipts, id), 1);
    }
    assert_eq!(Payments::count(&p.charge_calls, "charge:pay_1"), 1);
    assert_eq!(Payments::count(&p.charge_calls, "charge:pay_2"), 2);
    // And the answer is recorded: the next retry replays it, and the point is gone.
    let (status, replayed, again) = answer(&svc, &early).await;
    assert_eq!(
        (status, replayed, again["id"].as_str()),
        (StatusCode::CREATED, true, Some("pay_1"))
    );
    let record = store.get(&record_id(&early)).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::Completed(_)));
    assert_eq!(record.recovery_point, None);
}

async fn the_worker_finishes_an_abandoned_key_without_a_retry(store: Arc<dyn AdminStore>) {
    let p = Arc::new(Payments::default());
    let heard = Arc::new(Mutex::new(Vec::new()));
    let layer = layer(store.clone()).with_abandoned_hook({
        let heard = heard.clone();
        move |a| {
            let scope = a.scope.as_deref().map(str::to_owned);
            heard
                .lock()
                .unwrap()
                .push((scope, a.old_generation, a.new_generation));
        }
    });
    let svc = service(&layer, &p);
    let worker = worker(&layer, &p);
    let key = unique("worker");
    let plain = unique("no-point");

    die_at(&svc, &p, &key, Stall::Charging).await;
    // A request that ran straight through saved points too, and completed: never listed.
    let (status, _, _) = answer(&svc, &plain).await;
    assert_eq!(status, StatusCode::CREATED);

    // Its lease is live: nothing to recover yet.
    let report = worker.run_once().await.unwrap();
    assert_eq!((report.recovered, report.taken), (0, 0), "{report:?}");
    tokio::time::sleep(LAPSE).await;
    let report = worker.run_once().await.unwrap();
    assert_eq!(report.recovered, 1, "{report:?}");
    assert_eq!((report.failed, report.left), (0, 0), "{report:?}");
    // The worker's takeover is reported as a retry's would be, without the scope: stores
    // keep only its hash, recovery points included.
    assert_eq!(*heard.lock().unwrap(), vec![(None, 1, 2)]);
    // Quiet once done.
    let report = worker.run_once().await.unwrap();
    assert_eq!(
        (report.recovered, report.failed, report.taken),
        (0, 0, 0),
        "{report:?}"
    );

    let record = store.get(&record_id(&key)).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::Completed(_)),
        "{record:?}"
    );
    assert_eq!(record.recovery_point, None);
    assert_eq!(record.generation, 2);
    // The client's retry replays what the worker recorded.
    let (status, replayed, body) = answer(&svc, &key).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true), "{body}");
    assert_eq!(
        (body["id"].as_str(), body["resumed_from"].as_str()),
        (Some("pay_1"), Some("created"))
    );
    assert_eq!(
        p.created.load(Ordering::SeqCst),
        2,
        "pay_1 once, and the control's pay_2"
    );
    assert_eq!(Payments::count(&p.charged, "charge:pay_1"), 1);
    assert_eq!(Payments::count(&p.receipts, "pay_1"), 1);
}

async fn a_stale_holder_is_refused_and_its_later_steps_do_not_run(store: Arc<dyn AdminStore>) {
    let p = Arc::new(Payments::default());
    let svc = service(&layer(store.clone()), &p);
    let key = unique("stale");

    // The first attempt charges, then stops being polled (a long GC pause, a frozen VM):
    // no renewal, so its lease lapses while it still lives.
    let stale = start_stalled(&svc, &p, &key, Stall::Charging).await;
    tokio::time::sleep(LAPSE).await;
    // The retry takes over from "created" and holds there, its lease renewed.
    let retry = {
        let fut = start_stalled(&svc, &p, &key, Stall::Created).await;
        tokio::spawn(fut)
    };

    // The stale attempt wakes while the new one holds the record in progress: its save is
    // refused, and it sends no receipt.
    p.charging_gate.notify_one();
    let res = stale.await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(p.fenced.load(Ordering::SeqCst), 1);
    assert_eq!(
        Payments::count(&p.receipts, "pay_1"),
        0,
        "the stale attempt sent no receipt"
    );
    let record = store.get(&record_id(&key)).await.unwrap().unwrap();
    assert_eq!(record.generation, 2);
    assert_eq!(
        record
            .recovery_point
            .as_ref()
            .map(|p| (p.step(), p.generation())),
        Some(("created", 1)),
        "the refused save changed nothing"
    );

    // The new holder finishes: one charge executed, one receipt, its answer recorded.
    p.created_gate.notify_one();
    let res = retry.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let body: serde_json::Value = serde_json::from_slice(&body_bytes(res).await).unwrap();
    assert_eq!(
        (body["id"].as_str(), body["resumed_from"].as_str()),
        (Some("pay_1"), Some("created"))
    );
    assert_eq!(body["generation"], 2);
    assert_eq!(Payments::count(&p.receipts, "pay_1"), 1);
    assert_eq!(Payments::count(&p.charged, "charge:pay_1"), 1);
    assert_eq!(
        Payments::count(&p.charge_calls, "charge:pay_1"),
        2,
        "keyed downstream"
    );
    let (status, replayed, again) = answer(&svc, &key).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, body);
}

async fn a_recovery_that_always_fails_stops_after_its_attempts(store: Arc<dyn AdminStore>) {
    let p = Arc::new(Payments::default());
    let layer = layer(store.clone());
    let svc = service(&layer, &p);
    let tries = Arc::new(AtomicUsize::new(0));
    let worker = {
        let tries = tries.clone();
        RecoveryWorker::new(&layer, move |_ctx| {
            tries.fetch_add(1, Ordering::SeqCst);
            async { Err::<Response<Bytes>, BoxError>("the card network is down".into()) }
        })
        .with_max_attempts(std::num::NonZeroU64::new(3).unwrap())
    };
    let key = unique("poison");
    die_at(&svc, &p, &key, Stall::Created).await;

    let mut reports = Vec::new();
    for _ in 0..4 {
        tokio::time::sleep(LAPSE).await;
        reports.push(worker.run_once().await.unwrap());
    }
    let failed: usize = reports.iter().map(|r| r.failed).sum();
    let left: Vec<usize> = reports.iter().map(|r| r.left).collect();
    // Generation 1 died; the worker tries as 2 and 3, then leaves it, every sweep after.
    assert_eq!(
        (failed, tries.load(Ordering::SeqCst)),
        (2, 2),
        "{reports:?}"
    );
    assert_eq!(left, vec![0, 0, 1, 1], "{reports:?}");
    let record = store.get(&record_id(&key)).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "left for an operator"
    );
    assert_eq!(record.generation, 3);
    assert_eq!(
        record.recovery_point.as_ref().map(|p| p.step()),
        Some("created")
    );
}

async fn two_workers_never_recover_one_record_twice(store: Arc<dyn AdminStore>) {
    const KEYS: usize = 8;
    let p = Arc::new(Payments::default());
    let layer = layer(store.clone());
    let svc = service(&layer, &p);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = |p: Arc<Payments>, calls: Arc<AtomicUsize>| {
        RecoveryWorker::new(&layer, move |ctx| {
            calls.fetch_add(1, Ordering::SeqCst);
            phases(p.clone(), ctx)
        })
    };
    let (a, b) = (
        counted(p.clone(), calls.clone()),
        counted(p.clone(), calls.clone()),
    );
    let keys: Vec<String> = (0..KEYS).map(|i| unique(&format!("herd{i}"))).collect();
    for key in &keys {
        die_at(&svc, &p, key, Stall::Created).await;
    }
    tokio::time::sleep(LAPSE).await;
    let (ra, rb) = tokio::join!(a.run_once(), b.run_once());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.recovered + rb.recovered, KEYS, "{ra:?} {rb:?}");
    assert_eq!(ra.failed + rb.failed, 0, "{ra:?} {rb:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        KEYS,
        "each record recovered by one worker"
    );
    for i in 1..=KEYS {
        assert_eq!(
            Payments::count(&p.charge_calls, &format!("charge:pay_{i}")),
            1
        );
        assert_eq!(Payments::count(&p.receipts, &format!("pay_{i}")), 1);
    }
    for key in &keys {
        let (status, replayed, _) = answer(&svc, key).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true));
    }
}

// ---- a listing that aged: what happens between the worker's listing and its claim -------

/// The real store, except that its next `recoverable` answers the listing taken at
/// [`list_now`](Self::list_now): a listing as old as what happened since, as it is once a
/// sweep spent its time recovering other records.
struct AgedListing {
    inner: Arc<dyn AdminStore>,
    listed: Mutex<Option<Vec<(RecordId, Record)>>>,
}

impl AgedListing {
    fn new(inner: Arc<dyn AdminStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            listed: Mutex::new(None),
        })
    }

    async fn list_now(&self) {
        let listed = self.inner.recoverable(100).await.unwrap();
        assert_eq!(listed.len(), 1, "one record to recover: {listed:?}");
        *self.listed.lock().unwrap() = Some(listed);
    }
}

#[async_trait]
impl IdempotencyStore for AgedListing {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.inner.claim(request).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.extend(id, token, lease).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(id, token, completion, ttl).await
    }
    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.inner.release(id, token).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }
    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        self.inner.save_recovery_point(id, token, point).await
    }
    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        let aged = self.listed.lock().unwrap().take();
        match aged {
            Some(listed) => Ok(listed),
            None => self.inner.recoverable(limit).await,
        }
    }
}

/// A worker running `phases` that counts its runs.
fn counting_worker(
    layer: &IdempotencyLayer,
    p: &Arc<Payments>,
    runs: &Arc<AtomicUsize>,
) -> RecoveryWorker<impl Fn(IdempotencyContext) -> Recovering + Send + Sync + 'static> {
    let (p, runs) = (p.clone(), runs.clone());
    RecoveryWorker::new(layer, move |ctx| -> Recovering {
        runs.fetch_add(1, Ordering::SeqCst);
        Box::pin(phases(p.clone(), ctx))
    })
}

/// A retry takes the listed record over and declines (it undid the payment and answered
/// 500), which releases it and drops its point. The worker's claim then hands over no point:
/// it gives the claim back, never resuming the cancelled payment from the listed point.
async fn the_worker_never_resumes_from_a_point_a_release_dropped(store: Arc<dyn AdminStore>) {
    let aged = AgedListing::new(store.clone());
    let p = Arc::new(Payments::default());
    let layer = layer(aged.clone());
    let svc = service(&layer, &p);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = counting_worker(&layer, &p, &runs);
    let key = unique("released-since");
    die_at(&svc, &p, &key, Stall::Created).await;
    tokio::time::sleep(LAPSE).await;

    aged.list_now().await;
    p.decline.store(true, Ordering::SeqCst);
    let res = svc.clone().oneshot(pay(&key)).await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let report = worker.run_once().await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "resumed from a dropped point: {report:?}"
    );
    assert_eq!((report.recovered, report.given_back), (0, 1), "{report:?}");
    let record = store.get(&record_id(&key)).await.unwrap().unwrap();
    assert_eq!(record.recovery_point, None);
    // The client's retry starts over: a new payment, not the cancelled one.
    let (status, replayed, body) = answer(&svc, &key).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{body}");
    assert_eq!(
        (body["id"].as_str(), body["resumed_from"].as_str()),
        (Some("pay_2"), None)
    );
    assert_eq!(Payments::count(&p.charge_calls, "charge:pay_1"), 0);
}

/// With a cap of 2, a retry takes the listed record to generation 2 and dies too. The worker's
/// claim is generation 3, past the cap: it runs nothing and leaves the record, point and all,
/// as it was; the client's retry still resumes from the point.
async fn the_worker_counts_the_cap_on_its_own_claim(store: Arc<dyn AdminStore>) {
    let aged = AgedListing::new(store.clone());
    let p = Arc::new(Payments::default());
    let layer = layer(aged.clone());
    let svc = service(&layer, &p);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker =
        counting_worker(&layer, &p, &runs).with_max_attempts(std::num::NonZeroU64::new(2).unwrap());
    let key = unique("cap-since");
    die_at(&svc, &p, &key, Stall::Created).await;
    tokio::time::sleep(LAPSE).await;

    aged.list_now().await;
    die_at(&svc, &p, &key, Stall::Created).await;
    tokio::time::sleep(LAPSE).await;
    let report = worker.run_once().await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "ran past the cap: {report:?}"
    );
    assert_eq!((report.recovered, report.left), (0, 1), "{report:?}");
    let record = store.get(&record_id(&key)).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
    assert_eq!(record.generation, 3);
    assert_eq!(
        record.recovery_point.as_ref().map(|p| p.step()),
        Some("created"),
        "the point is kept for the retry and the operator"
    );
    // Left: the next sweep does not claim it again.
    let report = worker.run_once().await.unwrap();
    assert_eq!((report.left, report.given_back), (1, 0), "{report:?}");
    assert_eq!(
        store
            .get(&record_id(&key))
            .await
            .unwrap()
            .unwrap()
            .generation,
        3
    );
    // The client's retry resumes from the point.
    let (status, replayed, body) = answer(&svc, &key).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{body}");
    assert_eq!(
        (body["id"].as_str(), body["resumed_from"].as_str()),
        (Some("pay_1"), Some("created"))
    );
    assert_eq!(body["generation"], 4);
}

/// An operator force-releases the listed record. The worker's claim is then a first claim:
/// it gives it back, so the key stays absent and the client's next request runs afresh
/// instead of getting an answer the worker made up from the removed record's point.
async fn the_worker_never_recreates_a_key_an_operator_released(store: Arc<dyn AdminStore>) {
    let aged = AgedListing::new(store.clone());
    let p = Arc::new(Payments::default());
    let layer = layer(aged.clone());
    let svc = service(&layer, &p);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = counting_worker(&layer, &p, &runs);
    let key = unique("operator-since");
    die_at(&svc, &p, &key, Stall::Created).await;
    tokio::time::sleep(LAPSE).await;

    aged.list_now().await;
    assert_eq!(
        store.force_release(&record_id(&key)).await.unwrap(),
        Removal::Removed
    );
    let report = worker.run_once().await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "recovered a removed record: {report:?}"
    );
    assert_eq!((report.recovered, report.given_back), (0, 1), "{report:?}");
    assert_eq!(
        store.get(&record_id(&key)).await.unwrap(),
        None,
        "the key was recreated"
    );
    let (status, replayed, body) = answer(&svc, &key).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false), "{body}");
    assert_eq!(
        (body["id"].as_str(), body["resumed_from"].as_str()),
        (Some("pay_2"), None)
    );
}

/// The listed record expires before the worker reaches it: as after an operator's release,
/// the worker's first claim is given back and the key stays absent.
async fn the_worker_never_recreates_a_key_that_expired(store: Arc<dyn AdminStore>) {
    const TTL: Duration = Duration::from_secs(4);
    let aged = AgedListing::new(store.clone());
    let p = Arc::new(Payments::default());
    let timing = Timing::new(LEASE, TTL)
        .unwrap()
        .with_store_timeout(Duration::from_millis(400))
        .unwrap();
    let layer = IdempotencyLayer::new(aged.clone() as Arc<dyn IdempotencyStore>)
        .with_scope(support::tenant_scope)
        .with_timing(timing);
    let svc = service(&layer, &p);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = counting_worker(&layer, &p, &runs);
    let key = unique("expired-since");
    let died = tokio::time::Instant::now();
    die_at(&svc, &p, &key, Stall::Created).await;
    tokio::time::sleep(LAPSE).await;

    aged.list_now().await;
    // An in-progress record is kept max(lease, TTL) from its last claim or renewal.
    tokio::time::sleep_until(died + TTL + Duration::from_millis(600)).await;
    let report = worker.run_once().await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "recovered an expired record: {report:?}"
    );
    assert_eq!((report.recovered, report.given_back), (0, 1), "{report:?}");
    assert_eq!(
        store.get(&record_id(&key)).await.unwrap(),
        None,
        "the key was recreated"
    );
}

/// Dropping the worker's handle does not stop it: a holder that dies afterwards is still
/// recovered.
async fn a_dropped_handle_does_not_stop_the_worker(store: Arc<dyn AdminStore>) {
    let p = Arc::new(Payments::default());
    let layer = layer(store.clone());
    let svc = service(&layer, &p);
    let runs = Arc::new(AtomicUsize::new(0));
    drop(
        counting_worker(&layer, &p, &runs)
            .with_interval(Duration::from_millis(100))
            .spawn(),
    );
    let key = unique("dropped-handle");
    die_at(&svc, &p, &key, Stall::Created).await;
    let id = record_id(&key);
    // Generous: a worker that runs finishes within a lease and a sweep, and one that
    // stopped never does; the margin is for a loaded machine (other tests pause Redis).
    let deadline = tokio::time::Instant::now() + LAPSE + Duration::from_secs(30);
    loop {
        let record = store.get(&id).await.unwrap().unwrap();
        if matches!(record.state, RecordState::Completed(_)) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker stopped with its handle: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let (status, replayed, _) = answer(&svc, &key).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
}

macro_rules! scenarios {
    ($store:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_retry_resumes_after_the_holder_died() {
            let Some(store) = $store else { return };
            super::a_retry_resumes_after_the_holder_died(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_worker_finishes_an_abandoned_key_without_a_retry() {
            let Some(store) = $store else { return };
            super::the_worker_finishes_an_abandoned_key_without_a_retry(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_stale_holder_is_refused_and_its_later_steps_do_not_run() {
            let Some(store) = $store else { return };
            super::a_stale_holder_is_refused_and_its_later_steps_do_not_run(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_recovery_that_always_fails_stops_after_its_attempts() {
            let Some(store) = $store else { return };
            super::a_recovery_that_always_fails_stops_after_its_attempts(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_workers_never_recover_one_record_twice() {
            let Some(store) = $store else { return };
            super::two_workers_never_recover_one_record_twice(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_worker_never_resumes_from_a_point_a_release_dropped() {
            let Some(store) = $store else { return };
            super::the_worker_never_resumes_from_a_point_a_release_dropped(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_worker_counts_the_cap_on_its_own_claim() {
            let Some(store) = $store else { return };
            super::the_worker_counts_the_cap_on_its_own_claim(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_worker_never_recreates_a_key_an_operator_released() {
            let Some(store) = $store else { return };
            super::the_worker_never_recreates_a_key_an_operator_released(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_worker_never_recreates_a_key_that_expired() {
            let Some(store) = $store else { return };
            super::the_worker_never_recreates_a_key_that_expired(store).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_dropped_handle_does_not_stop_the_worker() {
            let Some(store) = $store else { return };
            super::a_dropped_handle_does_not_stop_the_worker(store).await;
        }
    };
}

mod memory {
    use super::*;
    use tower_idempotency::store::MemoryStore;

    scenarios!(Some(Arc::new(MemoryStore::new()) as Arc<dyn AdminStore>));
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use tower_idempotency::store::redis::RedisStore;

    /// A store under a prefix of its own: its own recovery index.
    async fn store() -> Option<Arc<dyn AdminStore>> {
        let url = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
        let store = RedisStore::builder()
            .with_key_prefix(format!("{}:", unique("recovery")))
            .connect(&url)
            .await
            .unwrap();
        Some(Arc::new(store))
    }

    scenarios!(store().await);
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use crate::support::pg as pg_support;

    /// A store in a schema of its own: its own table, so its own recoverable records. The
    /// schema is left for the run's cleanup (the test database is throwaway).
    async fn store() -> Option<Arc<dyn AdminStore>> {
        let url = pg_support::url()?;
        let schema = pg_support::TestSchema::create(&url, "recovery").await;
        let store = pg_support::store_in(&url, &schema, 4, "tidem-recovery").await;
        Some(Arc::new(store))
    }

    scenarios!(store().await);
}
