//! Operations: the layer's metrics (read back with `metrics-util`'s test recorder), the
//! abandoned-key hook and the published TTL header.
//!
//! One recorder serves the whole binary; each test uses its own route label (and so its
//! own series), so tests running in parallel do not see each other's counts.

use crate::support;
use crate::support::backend as common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use support::{body_bytes, DownStore};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyAdmin, IdempotencyStore, MemoryStore,
};
use tower_idempotency::{store::RecordId, Abandoned, IdempotencyLayer, InProgress, Timing};

/// The binary's recorder, and every value read from it so far: a snapshot drains the
/// recorder, so reads accumulate here, shared by all tests.
struct Metrics {
    snapshotter: Snapshotter,
    seen: Mutex<HashMap<SeriesKey, Seen>>,
}

/// (kind, name, sorted labels): one series.
type SeriesKey = (MetricKind, String, Vec<(String, String)>);

#[derive(Debug, Clone, Default)]
struct Seen {
    count: u64,
    values: Vec<f64>,
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this binary");
        Metrics {
            snapshotter,
            seen: Mutex::default(),
        }
    })
}

impl Metrics {
    fn read(&self) {
        let mut seen = self.seen.lock().unwrap();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let (kind, key) = key.into_parts();
            let mut labels: Vec<_> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            let entry = seen
                .entry((kind, key.name().to_owned(), labels))
                .or_default();
            match value {
                DebugValue::Counter(n) => entry.count += n,
                DebugValue::Histogram(v) => entry.values.extend(v.into_iter().map(|f| f.0)),
                DebugValue::Gauge(_) => {}
            }
        }
    }

    /// The sum over every series of `name` whose labels include all of `labels`.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.read();
        self.matching(MetricKind::Counter, name, labels)
            .iter()
            .map(|s| s.count)
            .sum()
    }

    fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.read();
        self.matching(MetricKind::Histogram, name, labels)
            .into_iter()
            .flat_map(|s| s.values)
            .collect()
    }

    fn matching(&self, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|((k, n, l), _)| {
                *k == kind
                    && n == name
                    && labels
                        .iter()
                        .all(|(lk, lv)| l.iter().any(|(k, v)| k == lk && v == lv))
            })
            .map(|(_, s)| s.clone())
            .collect()
    }
}

fn outcomes(route: &str, outcome: &str) -> u64 {
    metrics().counter(
        "idempotency_requests_total",
        &[("route", route), ("outcome", outcome)],
    )
}

fn events(route: &str, event: &str) -> u64 {
    metrics().counter(
        "idempotency_events_total",
        &[("route", route), ("event", event)],
    )
}

fn pay(path: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

async fn send(router: &Router, req: Request<Body>) -> http::Response<Body> {
    router.clone().oneshot(req).await.unwrap()
}

/// A router whose one route answers `status` once `gate` (if any) opens.
fn router(path: &str, layer: IdempotencyLayer, status: u16, gate: Option<Arc<Notify>>) -> Router {
    Router::new()
        .route(
            path,
            post(move || async move {
                if let Some(gate) = gate {
                    gate.notified().await;
                }
                (StatusCode::from_u16(status).unwrap(), "{\"ok\":true}")
            }),
        )
        .layer(layer)
}

/// Claims with a 300 ms lease, lets it lapse by about 400 ms, and takes over: the store
/// reports the lapse by its own clock.
async fn takeover_reports_how_long_the_lease_had_lapsed(store: &dyn IdempotencyStore) {
    let id = RecordId::new(
        Some("operations-lapse"),
        &format!("{:?}", std::time::SystemTime::now()),
    );
    let fp = tower_idempotency::store::Fingerprint::from_bytes([9; 32]);
    let lease = Duration::from_millis(300);
    let first = store
        .claim(&ClaimRequest::new(&id, &fp, lease, Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(matches!(first, ClaimOutcome::Claimed(c) if c.lapsed_for.is_none()));
    tokio::time::sleep(lease + Duration::from_millis(400)).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp, lease, Duration::from_secs(60)))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            let lapsed = c.lapsed_for.expect("the store knows when the lease ended");
            assert!(
                lapsed >= Duration::from_millis(350) && lapsed < Duration::from_secs(5),
                "{lapsed:?}"
            );
        }
        other => panic!("expected a takeover, got {other:?}"),
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_takeovers_report_the_lapse() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = tower_idempotency::store::redis::RedisStore::builder()
        .with_key_prefix("tidem-operations:")
        .connect(&url)
        .await
        .unwrap();
    takeover_reports_how_long_the_lease_had_lapsed(&store).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_takeovers_report_the_lapse() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_POSTGRES_URL") else {
        return;
    };
    let store = tower_idempotency::store::postgres::PostgresStore::builder()
        .with_table("tidem_operations")
        .unwrap()
        .connect(&url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    takeover_reports_how_long_the_lease_had_lapsed(&store).await;
}

#[tokio::test]
async fn memory_takeovers_report_the_lapse() {
    takeover_reports_how_long_the_lease_had_lapsed(&MemoryStore::new()).await;
}

/// Returns once `id` has a record (the first request holds its claim).
async fn claimed(store: &MemoryStore, id: &RecordId) {
    for _ in 0..100_000 {
        if store.get(id).await.unwrap().is_some() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the first request never claimed its key");
}

#[tokio::test(start_paused = true)]
async fn outcomes_are_counted_per_route_protocol_and_store() {
    metrics();
    let route = "/m/outcomes";
    let store = Arc::new(MemoryStore::new());
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_max_request_body(std::num::NonZeroUsize::new(64).unwrap());
    let app = router(route, layer, 201, None);

    assert_eq!(send(&app, pay(route, Some("k1"), "{}")).await.status(), 201);
    assert_eq!(send(&app, pay(route, Some("k1"), "{}")).await.status(), 201);
    assert_eq!(
        send(&app, pay(route, Some("k1"), "[1]")).await.status(),
        422
    );
    assert_eq!(send(&app, pay(route, None, "{}")).await.status(), 400);
    let bad = Request::post(route)
        .header("idempotency-key", "")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, bad).await.status(), 400);
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(100));
    assert_eq!(send(&app, pay(route, Some("k2"), &big)).await.status(), 413);

    for (outcome, n) in [
        ("executed", 1),
        ("replayed", 1),
        ("mismatch", 1),
        ("key_missing", 1),
        ("key_invalid", 1),
        ("body_too_large", 1),
        ("conflict", 0),
    ] {
        assert_eq!(outcomes(route, outcome), n, "{outcome}");
    }
    assert_eq!(events(route, "recorded"), 1);
    // The labels: the matched route, the protocol and the store's name.
    assert_eq!(
        metrics().counter(
            "idempotency_requests_total",
            &[
                ("route", route),
                ("protocol", "http"),
                ("store", "memory"),
                ("outcome", "replayed")
            ]
        ),
        1
    );
    // Store latency per operation and store; the recorded body's size.
    let claims = metrics().histogram(
        "idempotency_store_duration_seconds",
        &[("store", "memory"), ("operation", "claim")],
    );
    assert!(claims.len() >= 4, "{claims:?}");
    assert!(!metrics()
        .histogram(
            "idempotency_store_duration_seconds",
            &[("store", "memory"), ("operation", "complete")]
        )
        .is_empty());
    assert_eq!(
        metrics().histogram("idempotency_recorded_body_bytes", &[("route", route)]),
        vec![11.0]
    );
}

#[tokio::test]
async fn conflicts_releases_and_store_errors_are_counted() {
    metrics();
    let route = "/m/conflicts";
    let gate = Arc::new(Notify::new());
    let store = Arc::new(MemoryStore::new());
    let app = router(
        route,
        IdempotencyLayer::from_arc(store.clone()).unscoped(),
        503,
        Some(gate.clone()),
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(route, Some("c"), "{}")).await.status() }
    });
    claimed(&store, &RecordId::new(None, "c")).await;
    assert_eq!(send(&app, pay(route, Some("c"), "{}")).await.status(), 409);
    assert_eq!(outcomes(route, "conflict"), 1);
    gate.notify_one();
    assert_eq!(first.await.unwrap(), 503);
    assert_eq!(outcomes(route, "released"), 1);
    assert_eq!(outcomes(route, "executed"), 0);

    let route = "/m/down";
    let app = router(
        route,
        IdempotencyLayer::new(DownStore).unscoped(),
        201,
        None,
    );
    assert_eq!(send(&app, pay(route, Some("d"), "{}")).await.status(), 503);
    assert_eq!(
        metrics().counter(
            "idempotency_requests_total",
            &[
                ("route", route),
                ("outcome", "store_error"),
                ("store", "custom")
            ]
        ),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_takeover_calls_the_abandoned_hook_and_is_counted() {
    metrics();
    let route = "/m/takeover";
    let store = Arc::new(MemoryStore::new());
    let heard: Arc<Mutex<Vec<Abandoned>>> = Arc::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .with_scope(|_| Some("tenant-7".to_owned()))
        .with_abandoned_hook({
            let heard = heard.clone();
            move |a| heard.lock().unwrap().push(a.clone())
        });
    let app = router(route, layer, 201, None);
    // A first attempt with the same request claimed and died: find its fingerprint by
    // running the request once on a side key, then claim the real key with it.
    assert_eq!(
        send(&app, pay(route, Some("probe"), "{}")).await.status(),
        201
    );
    let probe = store
        .get(&RecordId::new(Some("tenant-7"), "probe"))
        .await
        .unwrap()
        .unwrap();
    let id = RecordId::new(Some("tenant-7"), "died");
    let lease = Duration::from_secs(1);
    let dead = store
        .claim(&ClaimRequest::new(
            &id,
            &probe.fingerprint,
            lease,
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert!(matches!(dead, ClaimOutcome::Claimed(_)));
    tokio::time::advance(lease + Duration::from_millis(1)).await;

    assert_eq!(
        send(&app, pay(route, Some("died"), "{}")).await.status(),
        201
    );
    let heard = heard.lock().unwrap().clone();
    assert_eq!(heard.len(), 1, "{heard:?}");
    let a = &heard[0];
    assert_eq!(a.scope.as_deref(), Some("tenant-7"));
    assert_eq!(a.record, id);
    assert_eq!((a.old_generation, a.new_generation), (1, 2));
    // Paused time: the lease lapsed exactly 1 ms before the takeover.
    assert_eq!(a.abandoned_for, Some(Duration::from_millis(1)));
    assert_eq!(events(route, "takeover"), 1);
    assert_eq!(outcomes(route, "executed"), 2);
}

#[tokio::test]
async fn a_holder_released_by_an_operator_is_counted_as_fenced() {
    metrics();
    let route = "/m/fenced";
    let store = Arc::new(MemoryStore::new());
    let gate = Arc::new(Notify::new());
    let app = router(
        route,
        IdempotencyLayer::from_arc(store.clone()).unscoped(),
        201,
        Some(gate.clone()),
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(route, Some("f"), "{}")).await.status() }
    });
    let id = RecordId::new(None, "f");
    claimed(&store, &id).await;
    store.force_release(&id).await.unwrap();
    gate.notify_one();
    assert_eq!(first.await.unwrap(), 201);
    assert_eq!(events(route, "fenced"), 1);
    assert_eq!(events(route, "recorded"), 0);
}

/// After an operator's release a new first attempt claims the key at generation 1 again,
/// with another nonce: the old holder's complete is fenced, and counted as such, not taken
/// for the handler having completed the record itself.
#[tokio::test(start_paused = true)]
async fn a_complete_fenced_by_a_new_first_claim_after_an_operator_release_is_counted_as_fenced() {
    metrics();
    let route = "/m/fenced-regen";
    let store = Arc::new(MemoryStore::new());
    let gate = Arc::new(Notify::new());
    let app = router(
        route,
        IdempotencyLayer::from_arc(store.clone()).unscoped(),
        201,
        Some(gate.clone()),
    );
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(route, Some("g"), "{}")).await.status() }
    });
    let id = RecordId::new(None, "g");
    claimed(&store, &id).await;
    store.force_release(&id).await.unwrap();
    let second = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(route, Some("g"), "{}")).await.status() }
    });
    claimed(&store, &id).await;
    assert_eq!(store.get(&id).await.unwrap().unwrap().generation, 1);
    // The gate wakes its waiters in order: the old holder first.
    gate.notify_one();
    assert_eq!(first.await.unwrap(), 201);
    gate.notify_one();
    assert_eq!(second.await.unwrap(), 201);
    assert_eq!(events(route, "fenced"), 1, "the old holder's complete");
    assert_eq!(events(route, "recorded"), 1, "the new first attempt's");
}

/// A holder whose renewal is fenced because an operator released its key and a new first
/// attempt (generation 1 again, another nonce) completed it: the renewal counts a fenced
/// event, where a generation alone would take the new record for this claim's own.
#[tokio::test(start_paused = true)]
async fn a_renewal_fenced_by_a_new_first_attempt_after_an_operator_release_is_counted() {
    metrics();
    let (held, other) = ("/m/renew-fenced", "/m/renew-fenced-other");
    let store = Arc::new(MemoryStore::new());
    let gate = Arc::new(Notify::new());
    let app = Router::new()
        .route(
            held,
            post({
                let gate = gate.clone();
                move || async move {
                    gate.notified().await;
                    (StatusCode::CREATED, "held")
                }
            }),
        )
        .route(other, post(|| async { (StatusCode::CREATED, "other") }))
        .layer(IdempotencyLayer::from_arc(store.clone()).unscoped());
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(held, Some("r"), "{}")).await.status() }
    });
    let id = RecordId::new(None, "r");
    claimed(&store, &id).await;
    store.force_release(&id).await.unwrap();
    assert_eq!(send(&app, pay(other, Some("r"), "{}")).await.status(), 201);
    assert_eq!(store.get(&id).await.unwrap().unwrap().generation, 1);
    // Past the first renewal (every lease / 3 = 10 s), still inside the handler.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(events(held, "fenced"), 1, "the renewal was fenced");
    gate.notify_one();
    assert_eq!(first.await.unwrap(), 201);
}

/// Paused time: the second request polls on tokio timers while the first is held at its
/// gate; the test opens the gate at a virtual 100 ms, between two polls.
#[tokio::test(start_paused = true)]
async fn time_spent_waiting_is_recorded() {
    metrics();
    let route = "/m/wait";
    let gate = Arc::new(Notify::new());
    let store = Arc::new(MemoryStore::new());
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_in_progress(InProgress::wait(Duration::from_secs(30)));
    let app = router(route, layer, 201, Some(gate.clone()));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(route, Some("w"), "{}")).await.status() }
    });
    claimed(&store, &RecordId::new(None, "w")).await;
    let second = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay(route, Some("w"), "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate.notify_one();
    assert_eq!(first.await.unwrap(), 201);
    let second = second.await.unwrap();
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    let waits = metrics().histogram("idempotency_wait_seconds", &[("route", route)]);
    assert_eq!(waits.len(), 1, "{waits:?}");
    assert!(waits[0] > 0.0);
    assert_eq!(outcomes(route, "replayed"), 1);
}

#[tokio::test]
async fn the_ttl_header_is_sent_on_recorded_answers_and_replays_only_when_enabled() {
    let timing = Timing::new(Duration::from_secs(30), Duration::from_secs(7200)).unwrap();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_timing(timing)
        .with_ttl_header(true);
    let app = router("/t", layer, 201, None);
    let first = send(&app, pay("/t", Some("t"), "{}")).await;
    assert_eq!(first.headers()["idempotency-key-ttl"], "7200");
    let replay = send(&app, pay("/t", Some("t"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["idempotency-key-ttl"], "7200");
    assert_eq!(body_bytes(replay).await, body_bytes(first).await);

    // Off by default; never on a released answer.
    let app = router(
        "/t",
        IdempotencyLayer::new(MemoryStore::new()).unscoped(),
        201,
        None,
    );
    let res = send(&app, pay("/t", Some("t"), "{}")).await;
    assert!(res.headers().get("idempotency-key-ttl").is_none());
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_ttl_header(true);
    let app = router("/t", layer, 503, None);
    let res = send(&app, pay("/t", Some("t"), "{}")).await;
    assert!(res.headers().get("idempotency-key-ttl").is_none());
}

#[tokio::test]
async fn without_a_matched_route_the_configured_label_is_used_never_the_path() {
    metrics();
    let svc = tower::service_fn(|_req: Request<_>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("done")))
    });
    let svc = tower::ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .unscoped()
                .with_route_label("bare-service"),
        )
        .service(svc);
    let res = svc
        .oneshot(pay("/raw/path/with-id-123", Some("r"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(outcomes("bare-service", "executed"), 1);
    assert_eq!(outcomes("/raw/path/with-id-123", "executed"), 0);
}

/// The recovery worker counts each record it looks at by outcome: `recovered` when it
/// recorded an answer, `failed` when the recover function failed.
#[tokio::test]
async fn recoveries_are_counted_by_outcome() {
    let store = Arc::new(MemoryStore::new());
    let timing = Timing::new(Duration::from_millis(200), Duration::from_secs(60)).unwrap();
    let layer = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_timing(timing);
    let saved = Arc::new(Notify::new());
    let app = {
        let saved = saved.clone();
        tower::service_fn(move |req: Request<tower_idempotency::RequestBody<Body>>| {
            let saved = saved.clone();
            async move {
                let ctx = req
                    .extensions()
                    .get::<tower_idempotency::IdempotencyContext>()
                    .cloned()
                    .unwrap();
                ctx.save_recovery_point("created", "pay_1").await.unwrap();
                saved.notify_one();
                std::future::pending::<Result<http::Response<Body>, std::convert::Infallible>>()
                    .await
            }
        })
    };
    let svc = tower::Layer::layer(&layer, app);
    for key in ["metrics-recover-ok", "metrics-recover-fail"] {
        let mut fut = Box::pin(svc.clone().oneshot(pay("/pay", Some(key), "{}")));
        tokio::select! {
            r = &mut fut => panic!("answered: {:?}", r.map(|r| r.status())),
            () = saved.notified() => {}
        }
        // The holder dies: no destructor, no release, no renewal.
        #[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
        std::mem::forget(fut);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let count = |outcome: &str| {
        metrics().counter(
            "idempotency_recoveries_total",
            &[("outcome", outcome), ("store", "memory")],
        )
    };
    let (recovered, failed) = (count("recovered"), count("failed"));
    let fail = RecordId::new(None, "metrics-recover-fail");
    let worker = tower_idempotency::RecoveryWorker::new(&layer, move |ctx| {
        let failing = ctx.record_id() == fail;
        async move {
            if failing {
                return Err("the card network is down".into());
            }
            Ok(http::Response::builder()
                .status(201)
                .body(bytes::Bytes::from_static(b"pay_1"))?)
        }
    });
    let report = worker.run_once().await.unwrap();
    assert_eq!((report.recovered, report.failed), (1, 1), "{report:?}");
    assert_eq!(count("recovered"), recovered + 1);
    assert_eq!(count("failed"), failed + 1);
}

/// Operations are counted as HTTP requests are, under `protocol="operation"` and the layer's
/// route label: executed, replayed, conflict, mismatch, released; the takeover event too.
#[tokio::test(start_paused = true)]
async fn operations_are_counted_under_their_own_protocol() {
    use tower_idempotency::operation::OnceError;
    let route = "jobs-metrics";
    let counted = |outcome: &str| {
        metrics().counter(
            "idempotency_requests_total",
            &[
                ("route", route),
                ("protocol", "operation"),
                ("outcome", outcome),
            ],
        )
    };
    let before: Vec<u64> = ["executed", "replayed", "conflict", "mismatch", "released"]
        .iter()
        .map(|o| counted(o))
        .collect();
    let takeovers = events(route, "takeover");
    let timing = Timing::new(Duration::from_secs(1), Duration::from_secs(60)).unwrap();
    let ops = IdempotencyLayer::new(MemoryStore::new())
        .with_route_label(route)
        .with_timing(timing)
        .operations();
    let ok = |v: u32| async move { Ok::<u32, &str>(v) };
    assert_eq!(ops.once("s", "a", &1, |_| ok(7)).await.unwrap(), 7);
    assert_eq!(ops.once("s", "a", &1, |_| ok(8)).await.unwrap(), 7);
    assert!(matches!(
        ops.once("s", "a", &2, |_| ok(9)).await,
        Err(OnceError::Mismatch)
    ));
    let failed = ops
        .once("s", "b", &1, |_| async { Err::<u32, _>("boom") })
        .await;
    assert!(matches!(failed, Err(OnceError::Failed("boom"))));
    // A holder that dies mid-work (never polled again), then a duplicate while it holds the
    // key, then the takeover once its lease lapsed.
    let gate = Arc::new(Notify::new());
    let mut dead = Box::pin(ops.once("s", "c", &1, |_| {
        let gate = gate.clone();
        async move {
            gate.notified().await;
            Ok::<u32, &str>(1)
        }
    }));
    assert!(futures_util::FutureExt::now_or_never(dead.as_mut()).is_none());
    let busy = ops.once("s", "c", &1, |_| ok(2)).await;
    assert!(matches!(busy, Err(OnceError::InProgress { .. })));
    #[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
    std::mem::forget(dead);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(ops.once("s", "c", &1, |_| ok(3)).await.unwrap(), 3);
    let after: Vec<u64> = ["executed", "replayed", "conflict", "mismatch", "released"]
        .iter()
        .map(|o| counted(o))
        .collect();
    let delta: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    // executed: a, c (the takeover); replayed: a; conflict: c; mismatch: a; released: b.
    assert_eq!(delta, [2, 1, 1, 1, 1]);
    assert_eq!(events(route, "takeover") - takeovers, 1);
}
