//! The layer on an axum `Router`: what an axum user writes and sees.

use crate::support;

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use support::{body_bytes, body_json};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::store::{Completion, IdempotencyStore, MemoryStore, RecordId, RecordState};
use tower_idempotency::{
    BoxError, ErrorKind, IdempotencyContext, IdempotencyError, IdempotencyLayer, Key,
    RecordDecision, RecoveryWorker, Timing,
};

#[derive(Default)]
struct AppState {
    calls: AtomicUsize,
    started: Notify,
    gate: Notify,
}

async fn charge(State(s): State<Arc<AppState>>, ctx: Extension<IdempotencyContext>) -> Response {
    let n = s.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let body = serde_json::json!({"run": n, "key": ctx.key(), "provider_key": ctx.derive("psp")});
    (StatusCode::CREATED, axum::Json(body)).into_response()
}

async fn slow(State(s): State<Arc<AppState>>) -> &'static str {
    s.calls.fetch_add(1, Ordering::SeqCst);
    s.started.notify_one();
    s.gate.notified().await;
    "done"
}

async fn flaky(State(s): State<Arc<AppState>>) -> Response {
    let n = s.calls.fetch_add(1, Ordering::SeqCst) + 1;
    // A 200 the handler knows must not be kept (say, a pending upstream).
    let mut res = format!("attempt {n}").into_response();
    res.extensions_mut().insert(RecordDecision::Release);
    res
}

async fn export(State(s): State<Arc<AppState>>) -> Vec<u8> {
    s.calls.fetch_add(1, Ordering::SeqCst);
    vec![b'r'; 8 * 1024]
}

fn app(layer: IdempotencyLayer) -> (Router, Arc<AppState>) {
    let state = Arc::new(AppState::default());
    let router = Router::new()
        .route("/charge", post(charge))
        .route("/slow", post(slow))
        .route("/flaky", post(flaky))
        .route("/export", post(export))
        .route("/health", get(|| async { "ok" }))
        .layer(layer)
        .with_state(state.clone());
    (router, state)
}

fn default_app() -> (Router, Arc<AppState>) {
    app(IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_max_response_body(NonZeroUsize::new(4096).unwrap()))
}

fn req(path: &str, key: Option<&str>, body: impl Into<Body>) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(body.into()).unwrap()
}

async fn send(router: &Router, r: Request<Body>) -> Response {
    router.clone().oneshot(r).await.unwrap()
}

fn kind(res: &Response) -> ErrorKind {
    res.extensions().get::<IdempotencyError>().unwrap().kind()
}

#[tokio::test]
async fn handlers_read_the_context_and_replays_are_marked() {
    let (router, state) = default_app();
    let first = body_json(send(&router, req("/charge", Some("k1"), "{}")).await).await;
    assert_eq!(
        (first["run"].as_u64(), first["key"].as_str()),
        (Some(1), Some("k1"))
    );
    let replay = send(&router, req("/charge", Some("k1"), "{ }")).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_json(replay).await, first);
    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn key_errors_are_problem_json_and_reach_no_handler() {
    let (router, state) = default_app();
    let missing = send(&router, req("/charge", None, "{}")).await;
    assert_eq!(
        (missing.status(), kind(&missing)),
        (StatusCode::BAD_REQUEST, ErrorKind::KeyMissing)
    );
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );
    let long = "x".repeat(256);
    let too_long = send(&router, req("/charge", Some(&long), "{}")).await;
    assert_eq!(
        (too_long.status(), kind(&too_long)),
        (StatusCode::BAD_REQUEST, ErrorKind::KeyInvalid)
    );
    let mut twice = req("/charge", Some("a"), "{}");
    twice
        .headers_mut()
        .append("idempotency-key", "b".parse().unwrap());
    assert_eq!(kind(&send(&router, twice).await), ErrorKind::KeyInvalid);
    // GET routes need no key.
    let health = send(
        &router,
        Request::get("/health").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(body_bytes(health).await, "ok");
    assert_eq!(state.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn oversized_bodies_are_413_by_length_and_by_stream() {
    let (router, state) = app(IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_max_request_body(NonZeroUsize::new(1024).unwrap()));
    let big = vec![b' '; 2048];
    let by_length = send(&router, req("/charge", Some("k"), big.clone())).await;
    assert_eq!(
        (by_length.status(), kind(&by_length)),
        (StatusCode::PAYLOAD_TOO_LARGE, ErrorKind::BodyTooLarge)
    );
    let chunks = futures_util::stream::iter(
        (0..4).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b' '; 512]))),
    );
    let by_stream = send(
        &router,
        req("/charge", Some("k"), Body::from_stream(chunks)),
    )
    .await;
    assert_eq!(by_stream.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(state.calls.load(Ordering::SeqCst), 0);
    // Nothing was claimed: the same key works with a small body.
    assert_eq!(
        send(&router, req("/charge", Some("k"), "{}"))
            .await
            .status(),
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn a_duplicate_during_the_first_attempt_is_409_then_replays() {
    let (router, state) = default_app();
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, req("/slow", Some("s"), "{}")).await }
    });
    state.started.notified().await;
    let dup = send(&router, req("/slow", Some("s"), "{}")).await;
    assert_eq!(
        (dup.status(), kind(&dup)),
        (StatusCode::CONFLICT, ErrorKind::InProgress)
    );
    assert!(dup.headers().contains_key("retry-after"));
    state.gate.notify_one();
    assert_eq!(body_bytes(first.await.unwrap()).await, "done");
    let replay = send(&router, req("/slow", Some("s"), "{}")).await;
    assert_eq!(body_bytes(replay).await, "done");
    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_handler_can_release_its_own_success() {
    let (router, state) = default_app();
    assert_eq!(
        body_bytes(send(&router, req("/flaky", Some("f"), "{}")).await).await,
        "attempt 1"
    );
    assert_eq!(
        body_bytes(send(&router, req("/flaky", Some("f"), "{}")).await).await,
        "attempt 2"
    );
    assert_eq!(state.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_body_over_the_record_limit_is_served_once_and_tombstoned() {
    let (router, state) = default_app();
    let first = send(&router, req("/export", Some("e"), "{}")).await;
    assert_eq!(body_bytes(first).await.len(), 8 * 1024);
    let retry = send(&router, req("/export", Some("e"), "{}")).await;
    assert_eq!(
        (retry.status(), kind(&retry)),
        (StatusCode::GONE, ErrorKind::ResponseNotRetained)
    );
    assert_eq!(body_json(retry).await["original_status"], 200);
    assert_eq!(state.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_custom_renderer_shapes_the_errors() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_error_renderer(|e: &IdempotencyError| {
            let body =
                serde_json::json!({"error": {"code": e.kind().slug(), "message": e.detail()}});
            let mut res = axum::http::Response::new(Bytes::from(body.to_string()));
            *res.status_mut() = e.kind().status();
            res
        });
    let (router, _) = app(layer);
    let res = send(&router, req("/charge", None, "{}")).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(body_json(res).await["error"]["code"], "key-missing");
}

// Integration: routes, nesting, the extractor ----------------------------------------------

/// A handler that names itself, so a replay from another endpoint would show.
fn named(name: &'static str, calls: Arc<AtomicUsize>) -> axum::routing::MethodRouter {
    post(move || {
        calls.fetch_add(1, Ordering::SeqCst);
        async move { (StatusCode::CREATED, name) }
    })
}

#[tokio::test]
async fn nested_routers_keep_endpoints_apart_by_the_path_the_client_sent() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let app = Router::new()
        .nest(
            "/v1",
            Router::new()
                .route("/orders", named("v1", calls.clone()))
                .layer(layer.clone()),
        )
        .nest(
            "/refunds",
            Router::new()
                .route("/orders", named("refunds", calls.clone()))
                .layer(layer),
        );
    let res = app
        .clone()
        .oneshot(req("/v1/orders", Some("k"), "{}"))
        .await
        .unwrap();
    assert_eq!(body_bytes(res).await, "v1");
    // Both inner routers see `/orders`; the fingerprint must see where the client sent it.
    let res = app
        .oneshot(req("/refunds/orders", Some("k"), "{}"))
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        422,
        "another endpoint under the same key is a mismatch"
    );
    assert_eq!(
        res.extensions().get::<IdempotencyError>().unwrap().kind(),
        ErrorKind::Mismatch
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_filter_exempts_a_webhook_route_from_a_router_wide_layer() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_filter(|req| !req.uri.path().starts_with("/webhooks/"));
    let app = Router::new()
        .route("/webhooks/psp", named("hook", calls.clone()))
        .route("/pay", named("pay", calls.clone()))
        .layer(layer);
    for _ in 0..2 {
        let res = app
            .clone()
            .oneshot(req("/webhooks/psp", None, "{}"))
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "no key needed, never replayed");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let res = app.oneshot(req("/pay", None, "{}")).await.unwrap();
    assert_eq!(res.status(), 400, "the rest stays protected");
}

#[tokio::test]
async fn the_layer_on_one_route_protects_that_route_only() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let app = Router::new()
        .route("/pay", named("pay", calls.clone()).layer(layer))
        .route("/webhooks/psp", named("hook", calls.clone()));
    assert_eq!(
        app.clone()
            .oneshot(req("/webhooks/psp", None, "{}"))
            .await
            .unwrap()
            .status(),
        201
    );
    assert_eq!(
        app.clone()
            .oneshot(req("/pay", None, "{}"))
            .await
            .unwrap()
            .status(),
        400
    );
    app.clone()
        .oneshot(req("/pay", Some("k"), "{}"))
        .await
        .unwrap();
    let replay = app.oneshot(req("/pay", Some("k"), "{}")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

async fn with_context(ctx: IdempotencyContext) -> String {
    format!("generation {}", ctx.generation())
}

async fn with_optional_context(ctx: Option<IdempotencyContext>) -> &'static str {
    if ctx.is_some() {
        "keyed"
    } else {
        "not keyed"
    }
}

#[tokio::test]
async fn the_context_is_an_extractor_whose_rejection_is_a_problem_naming_the_missing_layer() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let app = Router::new()
        .route("/keyed", post(with_context).layer(layer.clone()))
        .route("/bare", post(with_context))
        .route(
            "/optional",
            post(with_optional_context).layer(layer.with_key(Key::default().optional())),
        );
    let res = app
        .clone()
        .oneshot(req("/keyed", Some("k"), "{}"))
        .await
        .unwrap();
    assert_eq!(body_bytes(res).await, "generation 1");
    let res = app
        .clone()
        .oneshot(req("/bare", Some("k"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), 500);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert_eq!(res.headers()["cache-control"], "no-store");
    let problem = body_json(res).await;
    assert_eq!(
        problem["type"],
        "https://docs.rs/tower-idempotency/latest/tower_idempotency/problems/#context-missing"
    );
    assert_eq!(problem["status"], 500);
    assert_eq!(problem["title"], "Idempotency context missing");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("idempotency layer did not run in front of this handler"),
        "{problem}"
    );
    let res = app
        .clone()
        .oneshot(req("/optional", None, "{}"))
        .await
        .unwrap();
    assert_eq!(body_bytes(res).await, "not keyed");
    let res = app
        .oneshot(req("/optional", Some("k2"), "{}"))
        .await
        .unwrap();
    assert_eq!(body_bytes(res).await, "keyed");
}

/// A payment in two steps, shared by the axum handler and the recovery worker's recover
/// function: create the payment (saving a point), then charge it and answer what an axum
/// handler answers. `die` makes the holder stop for good right after its save.
#[derive(Default)]
struct PaySteps {
    die: std::sync::atomic::AtomicBool,
    saved: Notify,
    created: AtomicUsize,
    charged: AtomicUsize,
}

async fn pay_steps(
    ctx: &IdempotencyContext,
    steps: &PaySteps,
) -> Result<impl IntoResponse, BoxError> {
    let (payment, resumed_from) = match ctx.recovery_point() {
        // A takeover (the worker's, or a retry's): the payment the dead attempt created.
        Some(p) => (
            String::from_utf8(p.data().to_vec())?,
            Some(p.step().to_owned()),
        ),
        None => {
            steps.created.fetch_add(1, Ordering::SeqCst);
            let payment = format!("pay_{}", &ctx.derive("payment")[..12]);
            ctx.save_recovery_point("created", payment.clone()).await?;
            steps.saved.notify_one();
            if steps.die.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            (payment, None)
        }
    };
    steps.charged.fetch_add(1, Ordering::SeqCst);
    let body = serde_json::json!({
        "payment": payment,
        "charge_key": ctx.derive("charge"),
        "resumed_from": resumed_from,
    });
    Ok((
        StatusCode::CREATED,
        [("x-payment", payment)],
        axum::Json(body),
    ))
}

/// The handler: the steps, and a 503 when a step fails.
async fn pay(State(steps): State<Arc<PaySteps>>, ctx: IdempotencyContext) -> impl IntoResponse {
    pay_steps(&ctx, &steps)
        .await
        .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
}

/// Must-have 6 of issue 45: the recover function runs the handler's own steps and answers
/// with `into_response()` (`Response<axum::body::Body>`), with no conversion to bytes. A
/// holder dies after its save; the worker finishes the payment from the point; the client's
/// retry replays the worker's answer byte for byte, and nothing ran twice.
#[tokio::test]
#[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
async fn the_recovery_worker_runs_the_handlers_steps_and_answers_with_an_axum_response() {
    let lease = std::time::Duration::from_millis(600);
    let timing = Timing::new(lease, std::time::Duration::from_secs(60))
        .unwrap()
        .with_store_timeout(std::time::Duration::from_millis(150))
        .unwrap();
    let store = Arc::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_timing(timing);
    let steps = Arc::new(PaySteps::default());
    let router = Router::new()
        .route("/pay", post(pay))
        .layer(layer.clone())
        .with_state(steps.clone());
    let worker = {
        let steps = steps.clone();
        RecoveryWorker::new(&layer, move |ctx: IdempotencyContext| {
            let steps = steps.clone();
            async move { Ok::<_, BoxError>(pay_steps(&ctx, &steps).await?.into_response()) }
        })
    };

    // The holder saves "created", then dies.
    steps.die.store(true, Ordering::SeqCst);
    let mut first = Box::pin(router.clone().oneshot(req("/pay", Some("axum-pay"), "{}")));
    tokio::select! {
        r = &mut first => panic!("answered: {:?}", r.map(|r| r.status())),
        () = steps.saved.notified() => {}
    }
    std::mem::forget(first);
    steps.die.store(false, Ordering::SeqCst);
    tokio::time::sleep(lease + std::time::Duration::from_millis(200)).await;

    let report = worker.run_once().await.unwrap();
    assert_eq!((report.recovered, report.failed), (1, 0), "{report:?}");
    let record = store
        .get(&RecordId::new(None, "axum-pay"))
        .await
        .unwrap()
        .unwrap();
    let RecordState::Completed(Completion::Response(stored)) = record.state else {
        panic!("recorded by the worker: {record:?}")
    };
    assert_eq!(record.generation, 2);

    let replay = send(&router, req("/pay", Some("axum-pay"), "{}")).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["content-type"], "application/json");
    let payment = replay.headers()["x-payment"].to_str().unwrap().to_owned();
    assert!(payment.starts_with("pay_"), "{payment}");
    let bytes = body_bytes(replay).await;
    assert_eq!(bytes, stored.body, "the worker's answer, byte for byte");
    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(json["payment"], payment.as_str());
    assert_eq!(json["resumed_from"], "created", "finished from the point");
    assert_eq!(
        (
            steps.created.load(Ordering::SeqCst),
            steps.charged.load(Ordering::SeqCst)
        ),
        (1, 1),
        "created by the dead holder, charged by the worker, neither twice"
    );
}
