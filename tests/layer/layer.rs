//! The layer through a plain tower `service_fn`: one or more tests per item of the core issue.

use crate::support;

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use support::*;
use tokio::sync::Notify;
use tower::{service_fn, BoxError, Layer, Service, ServiceExt};
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, MemoryStore};
use tower_idempotency::{
    store::RecordId, ErrorKind, Fingerprinting, Grpc, IdempotencyContext, IdempotencyError,
    IdempotencyLayer, InProgress, JsonPointer, Key, RecordDecision, RequestBody, StoreFailure,
    Timing,
};

type Body = BoxBody<Bytes, std::io::Error>;

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed()
}

/// The inner service under test. Paths pick the behaviour; `calls` counts executions.
#[derive(Clone, Default)]
struct App {
    calls: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: Arc<Notify>,
}

impl App {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    async fn handle(
        self,
        req: Request<RequestBody<Full<Bytes>>>,
    ) -> Result<Response<Body>, Infallible> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let path = req.uri().path().to_owned();
        let ctx = req.extensions().get::<IdempotencyContext>().cloned();
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let mut res = Response::new(full(format!("run {n}")));
        *res.status_mut() = StatusCode::CREATED;
        match path.as_str() {
            p if p.starts_with("/status/") => {
                *res.status_mut() = StatusCode::from_u16(p[8..].parse().unwrap()).unwrap();
            }
            "/echo" => *res.body_mut() = full(body),
            "/headers" => {
                let h = res.headers_mut();
                h.insert("content-type", HeaderValue::from_static("application/json"));
                h.insert("location", HeaderValue::from_static("/v1/things/1"));
                h.append("link", HeaderValue::from_static("</a>; rel=a"));
                h.append("link", HeaderValue::from_static("</b>; rel=b"));
                h.insert("set-cookie", HeaderValue::from_static("session=secret"));
                h.insert("x-request-id", HeaderValue::from_static("req-123"));
                h.insert("x-custom", HeaderValue::from_static("kept-when-configured"));
            }
            "/gated" => {
                self.started.notify_one();
                self.gate.notified().await;
            }
            "/trailers" => {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-checksum", HeaderValue::from_static("c0ffee"));
                trailers.insert("x-trace", HeaderValue::from_static("t-1"));
                let frames = vec![
                    Ok(Frame::data(Bytes::from_static(b"part-1;"))),
                    Ok(Frame::data(Bytes::from(format!("part-2 run {n}")))),
                    Ok(Frame::trailers(trailers)),
                ];
                *res.body_mut() = StreamBody::new(stream::iter(frames)).boxed();
            }
            "/many-headers" => {
                for i in 0..1100 {
                    res.headers_mut().append(
                        http::HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                        HeaderValue::from_static("v"),
                    );
                }
            }
            p if p.starts_with("/large/") => {
                let size: usize = p[7..].parse().unwrap();
                let chunks: Vec<Result<Frame<Bytes>, std::io::Error>> = (0..size / 1024)
                    .map(|i| Ok(Frame::data(Bytes::from(vec![(i % 251) as u8; 1024]))))
                    .collect();
                *res.body_mut() = StreamBody::new(stream::iter(chunks)).boxed();
            }
            "/broken-body" => {
                let frames = vec![
                    Ok(Frame::data(Bytes::from_static(b"partial"))),
                    Err(std::io::Error::other("backend hung up")),
                ];
                *res.body_mut() = StreamBody::new(stream::iter(frames)).boxed();
            }
            "/context" => {
                let ctx = ctx.expect("keyed requests carry an IdempotencyContext");
                let v = serde_json::json!({
                    "key": ctx.key(),
                    "scope": ctx.scope(),
                    "generation": ctx.generation(),
                    "derived": ctx.derive("card-network"),
                    "run": n,
                });
                *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE; // released: every call runs
                *res.body_mut() = full(v.to_string());
            }
            "/no-store" => {
                res.headers_mut()
                    .insert("cache-control", HeaderValue::from_static("no-store"));
            }
            "/decide-release" => {
                res.extensions_mut().insert(RecordDecision::Release);
            }
            "/decide-record" => {
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                res.extensions_mut().insert(RecordDecision::Record);
            }
            "/panic" => panic!("handler bug"),
            _ => {}
        }
        Ok(res)
    }
}

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<tower_idempotency::ResponseBody<Body>>,
    Infallible,
>;

fn svc(layer: IdempotencyLayer, app: &App) -> Svc {
    let app = app.clone();
    let inner = service_fn(move |req| app.clone().handle(req));
    tower::util::BoxCloneService::new(tower::ServiceBuilder::new().layer(layer).service(inner))
}

fn call(
    svc: &Svc,
    req: Request<Full<Bytes>>,
) -> impl std::future::Future<Output = Response<tower_idempotency::ResponseBody<Body>>> + Send {
    let svc = svc.clone();
    async move { svc.oneshot(req).await.unwrap() }
}

fn problem_kind(res: &Response<tower_idempotency::ResponseBody<Body>>) -> ErrorKind {
    res.extensions()
        .get::<IdempotencyError>()
        .expect("typed error in extensions")
        .kind()
}

async fn assert_problem(
    res: Response<tower_idempotency::ResponseBody<Body>>,
    status: u16,
    kind: ErrorKind,
) -> serde_json::Value {
    assert_eq!(res.status().as_u16(), status);
    assert_eq!(problem_kind(&res), kind);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert_eq!(res.headers()["cache-control"], "no-store");
    let v = body_json(res).await;
    assert_eq!(v["type"], kind.type_uri());
    assert_eq!(v["status"], status);
    v
}

// 1. Keys ---------------------------------------------------------------------------------

#[tokio::test]
async fn missing_key_is_400_and_runs_nothing() {
    let (store, app) = (counting(), App::default());
    let s = svc(IdempotencyLayer::new(store.clone()).unscoped(), &app);
    let res = call(&s, post("/x", None, "{}")).await;
    let v = assert_problem(res, 400, ErrorKind::KeyMissing).await;
    assert!(v["detail"].as_str().unwrap().contains("idempotency-key"));
    assert_eq!((app.calls(), store.total()), (0, 0));
}

#[tokio::test]
async fn invalid_keys_are_400_and_store_nothing() {
    let (store, app) = (counting(), App::default());
    let s = svc(IdempotencyLayer::new(store.clone()).unscoped(), &app);
    let long = "k".repeat(256);
    for (label, values) in [
        ("empty", vec![HeaderValue::from_static("")]),
        (
            "256 characters",
            vec![HeaderValue::from_str(&long).unwrap()],
        ),
        (
            "non-ASCII",
            vec![HeaderValue::from_bytes("caf\u{e9}".as_bytes()).unwrap()],
        ),
        ("space", vec![HeaderValue::from_static("a b")]),
        (
            "malformed sf-string",
            vec![HeaderValue::from_static("\"open")],
        ),
        (
            "sent twice",
            vec![HeaderValue::from_static("a"), HeaderValue::from_static("a")],
        ),
    ] {
        let mut req = post("/x", None, "{}");
        for v in values {
            req.headers_mut().append("idempotency-key", v);
        }
        let res = call(&s, req).await;
        assert_eq!(res.status(), 400, "{label}");
        assert_problem(res, 400, ErrorKind::KeyInvalid).await;
    }
    assert_eq!((app.calls(), store.total()), (0, 0));
    // 255 characters is fine.
    let ok = call(&s, post("/x", Some(&"k".repeat(255)), "{}")).await;
    assert_eq!(ok.status(), 201);
}

#[tokio::test]
async fn quoted_and_bare_keys_name_the_same_record() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    let first = call(&s, post("/x", Some("abc"), "{}")).await;
    assert_eq!(body_bytes(first).await, "run 1");
    let second = call(&s, post("/x", Some("\"abc\""), "{}")).await;
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(second).await, "run 1");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn other_methods_pass_through_unbuffered_without_store_calls() {
    let store = counting();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        seen2.lock().unwrap().push(format!("{:?}", req.body()));
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))) }
    });
    let mut s = IdempotencyLayer::new(store.clone()).unscoped().layer(inner);
    for method in ["GET", "PUT", "DELETE"] {
        let req = Request::builder()
            .method(method)
            .uri("/x")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(b"body")))
            .unwrap();
        let res = s.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), 200);
        assert!(res.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(store.total(), 0);
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|d| d == "RequestBody::Stream"),
        "{seen:?}"
    );
}

#[tokio::test]
async fn optional_keys_pass_through_when_absent_and_protect_when_present() {
    let (store, app) = (counting(), App::default());
    let s = svc(
        IdempotencyLayer::new(store.clone())
            .unscoped()
            .with_key(Key::default().optional()),
        &app,
    );
    assert_eq!(call(&s, post("/x", None, "{}")).await.status(), 201);
    assert_eq!(call(&s, post("/x", None, "{}")).await.status(), 201);
    assert_eq!((app.calls(), store.total()), (2, 0));
    call(&s, post("/x", Some("k"), "{}")).await;
    let replay = call(&s, post("/x", Some("k"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(app.calls(), 3);
}

#[tokio::test]
async fn header_name_and_methods_are_configurable() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_key(Key::header(http::HeaderName::from_static("x-request-key")))
        .with_methods([http::Method::PUT]);
    let s = svc(layer, &app);
    let put = |key: &str| {
        Request::put("/x")
            .header("x-request-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    call(&s, put("k")).await;
    let replay = call(&s, put("k")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    // POST is no longer protected: no key needed, runs every time.
    assert_eq!(call(&s, post("/x", None, "{}")).await.status(), 201);
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn a_grpc_content_type_does_not_switch_an_http_layer_to_grpc() {
    let (store, app) = (counting(), App::default());
    let grpc_ct = |method: &str, body: &'static str| {
        let mut r = post("/x", Some("k"), body);
        *r.method_mut() = method.parse().unwrap();
        r.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/grpc"));
        r
    };
    let http_only = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_max_request_body(NonZeroUsize::new(16).unwrap());
    let s = svc(http_only, &app);
    // The method check holds: a GET is not keyed, whatever its content type says.
    let get = call(&s, grpc_ct("GET", "")).await;
    assert!(get.headers().get("idempotent-replayed").is_none());
    assert_eq!(store.total(), 0);
    // The HTTP limit and the HTTP error form hold too.
    let big = call(&s, grpc_ct("POST", "0123456789abcdef0123456789abcdef")).await;
    assert_problem(big, 413, ErrorKind::BodyTooLarge).await;

    // A layer configured for gRPC still checks the method.
    let s = svc(
        IdempotencyLayer::new(store.clone())
            .unscoped()
            .with_grpc(Grpc::all()),
        &app,
    );
    let get = call(&s, grpc_ct("GET", "")).await;
    assert!(
        get.headers().get("grpc-status").is_none(),
        "passed through, not keyed"
    );
    assert_eq!(store.total(), 0);
    let post = call(&s, grpc_ct("POST", "")).await;
    assert_eq!(store.total(), 1 + 1, "claimed and completed: keyed as gRPC");
    assert_eq!(post.status(), 201);
}

// 2. Scope --------------------------------------------------------------------------------

#[tokio::test]
async fn the_same_key_in_two_scopes_runs_twice_and_replays_per_scope() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(|req| {
        req.headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let s = svc(layer, &app);
    let req = |tenant: &str| {
        let mut r = post("/x", Some("shared"), "{}");
        r.headers_mut()
            .insert("x-tenant", HeaderValue::from_str(tenant).unwrap());
        r
    };
    assert_eq!(body_bytes(call(&s, req("a")).await).await, "run 1");
    assert_eq!(body_bytes(call(&s, req("b")).await).await, "run 2");
    assert_eq!(body_bytes(call(&s, req("a")).await).await, "run 1");
    assert_eq!(body_bytes(call(&s, req("b")).await).await, "run 2");
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn a_scope_function_that_finds_no_scope_is_500_and_runs_nothing() {
    let (store, app) = (counting(), App::default());
    let layer = IdempotencyLayer::new(store.clone()).with_scope(|_| None);
    let s = svc(layer, &app);
    assert_problem(
        call(&s, post("/x", Some("k"), "{}")).await,
        500,
        ErrorKind::ScopeMissing,
    )
    .await;
    assert_eq!((app.calls(), store.total()), (0, 0));
}

#[tokio::test]
async fn a_layer_with_no_scope_chosen_refuses_keyed_requests_and_runs_nothing() {
    let (store, app) = (counting(), App::default());
    let s = svc(IdempotencyLayer::new(store.clone()), &app);
    assert_problem(
        call(&s, post("/x", Some("k"), "{}")).await,
        500,
        ErrorKind::ScopeMissing,
    )
    .await;
    assert_eq!((app.calls(), store.total()), (0, 0));
    // Requests the layer does not protect still pass.
    let mut get = post("/x", None, "");
    *get.method_mut() = http::Method::GET;
    assert_eq!(call(&s, get).await.status(), 201);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn a_tenant_over_its_quota_gets_429_and_other_tenants_are_served() {
    for fail_open in [false, true] {
        let app = App::default();
        let store = MemoryStore::builder()
            .with_max_records_per_scope(NonZeroUsize::new(2).unwrap())
            .build();
        let layer = IdempotencyLayer::new(store)
            .with_scope(|req| {
                req.headers
                    .get("x-tenant")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            })
            .with_store_failure(StoreFailure::closed().open_on_quota(fail_open));
        let s = svc(layer, &app);
        let req = |tenant: &str, key: &str| {
            let mut r = post("/x", Some(key), "{}");
            r.headers_mut()
                .insert("x-tenant", HeaderValue::from_str(tenant).unwrap());
            r
        };
        for key in ["k1", "k2"] {
            assert_eq!(call(&s, req("a", key)).await.status(), 201);
        }
        let over = call(&s, req("a", "k3")).await;
        if fail_open {
            assert_eq!(over.status(), 201, "runs unprotected");
            assert!(over.headers().get("idempotent-replayed").is_none());
        } else {
            let v = assert_problem(over, 429, ErrorKind::QuotaExceeded).await;
            assert_eq!(v["type"], ErrorKind::QuotaExceeded.type_uri());
        }
        assert_eq!(call(&s, req("b", "k3")).await.status(), 201, "tenant b");
        let replay = call(&s, req("a", "k1")).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(app.calls(), if fail_open { 4 } else { 3 });
    }
}

// 3. Request body ---------------------------------------------------------------------------

#[tokio::test]
async fn a_body_over_the_limit_by_content_length_is_413_before_any_claim() {
    let (store, app) = (counting(), App::default());
    let layer = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_max_request_body(NonZeroUsize::new(16).unwrap());
    let s = svc(layer, &app);
    let mut req = post("/x", Some("k"), &"x".repeat(17));
    req.headers_mut()
        .insert("content-length", HeaderValue::from(17));
    assert_problem(call(&s, req).await, 413, ErrorKind::BodyTooLarge).await;
    assert_eq!((app.calls(), store.total()), (0, 0));
    // At the limit: fine.
    assert_eq!(
        call(&s, post("/x", Some("k"), &"x".repeat(16)))
            .await
            .status(),
        201
    );
}

/// A body of 1-byte frames, each a slice of its own 64 KiB buffer (as a server's read
/// buffer). Counts the frames whose buffer was still referenced when the next was asked for.
struct PinningBody {
    sent: Vec<Bytes>,
    left: usize,
    pinned: Arc<AtomicUsize>,
}

impl http_body::Body for PinningBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(last) = self.sent.pop() {
            if !last.is_unique() {
                self.pinned.fetch_add(1, Ordering::SeqCst);
            }
        }
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        self.left -= 1;
        let backing = Bytes::from(vec![b'x'; 64 * 1024]);
        let frame = backing.slice(0..1);
        self.sent.push(backing);
        std::task::Poll::Ready(Some(Ok(Frame::data(frame))))
    }
}

#[tokio::test]
async fn a_body_in_small_frames_is_copied_into_one_buffer_not_kept_frame_by_frame() {
    let pinned = Arc::new(AtomicUsize::new(0));
    let inner = service_fn(|req: Request<RequestBody<PinningBody>>| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        Ok::<_, Infallible>(Response::new(Full::new(body)))
    });
    let s = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    let req = Request::post("/x")
        .header("idempotency-key", "k")
        .header("content-length", "100")
        .body(PinningBody {
            sent: Vec::new(),
            left: 100,
            pinned: pinned.clone(),
        })
        .unwrap();
    let res = s.oneshot(req).await.unwrap();
    assert_eq!(body_bytes(res).await, "x".repeat(100));
    assert_eq!(
        pinned.load(Ordering::SeqCst),
        0,
        "no frame outlived its turn"
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_slower_than_the_timeout_is_408_before_any_claim() {
    let store = counting();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let inner = service_fn(move |_req: Request<RequestBody<StreamBody<_>>>| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) }
    });
    let s = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_request_body_timeout(Duration::from_secs(5))
        .layer(inner);
    // One byte, then nothing: a slow client holding its buffer.
    let frames = stream::iter([Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(
        b"{",
    )))]);
    let frames = futures_util::StreamExt::chain(frames, stream::pending());
    let req = Request::post("/x")
        .header("idempotency-key", "k")
        .body(StreamBody::new(frames))
        .unwrap();
    let res = s.oneshot(req).await.unwrap();
    assert_eq!(res.status(), 408);
    let err = res.extensions().get::<IdempotencyError>().unwrap();
    assert_eq!(err.kind(), ErrorKind::BodyTimeout);
    assert_eq!((calls.load(Ordering::SeqCst), store.total()), (0, 0));
}

#[tokio::test]
async fn a_chunked_body_over_the_limit_is_413_before_any_claim() {
    let store = counting();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let inner = service_fn(move |_req: Request<RequestBody<StreamBody<_>>>| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) }
    });
    let layer = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_max_request_body(NonZeroUsize::new(1024).unwrap());
    let s = layer.layer(inner);
    // No Content-Length: 3 chunks of 512 bytes arrive as a stream.
    let chunks: Vec<Result<Frame<Bytes>, Infallible>> = (0..3)
        .map(|_| Ok(Frame::data(Bytes::from(vec![b'a'; 512]))))
        .collect();
    let req = Request::post("/x")
        .header("idempotency-key", "k")
        .body(StreamBody::new(stream::iter(chunks)))
        .unwrap();
    let res = s.oneshot(req).await.unwrap();
    assert_eq!(res.status(), 413);
    assert_eq!(
        res.extensions().get::<IdempotencyError>().unwrap().kind(),
        ErrorKind::BodyTooLarge
    );
    assert_eq!((calls.load(Ordering::SeqCst), store.total()), (0, 0));
}

#[tokio::test]
async fn an_unreadable_body_is_400_before_any_claim() {
    let store = counting();
    let inner = service_fn(|_req: Request<RequestBody<StreamBody<_>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let s = IdempotencyLayer::new(store.clone()).unscoped().layer(inner);
    let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = vec![
        Ok(Frame::data(Bytes::from_static(b"{"))),
        Err(std::io::Error::other("client reset")),
    ];
    let req = Request::post("/x")
        .header("idempotency-key", "k")
        .body(StreamBody::new(stream::iter(frames)))
        .unwrap();
    let res = s.oneshot(req).await.unwrap();
    assert_eq!(res.status(), 400);
    assert_eq!(
        res.extensions().get::<IdempotencyError>().unwrap().kind(),
        ErrorKind::BodyUnreadable
    );
    assert_eq!(store.total(), 0);
}

// 4. Fingerprint --------------------------------------------------------------------------

async fn second_status(
    layer: IdempotencyLayer,
    first: Request<Full<Bytes>>,
    second: Request<Full<Bytes>>,
) -> (StatusCode, usize) {
    let app = App::default();
    let s = svc(layer, &app);
    assert_eq!(call(&s, first).await.status(), 201);
    let res = call(&s, second).await;
    (res.status(), app.calls())
}

#[tokio::test]
async fn json_with_reordered_keys_and_other_whitespace_replays() {
    let (status, calls) = second_status(
        IdempotencyLayer::new(MemoryStore::new()).unscoped(),
        post("/x", Some("k"), r#"{"amount":100,"currency":"EUR","meta":{"a":1,"b":[1,2]}}"#),
        post("/x", Some("k"), "{ \"meta\" : { \"b\" : [ 1 , 2 ] , \"a\" : 1.0 } ,\n\"currency\":\"EUR\", \"amount\": 1e2 }"),
    )
    .await;
    assert_eq!((status, calls), (StatusCode::CREATED, 1));
}

#[tokio::test]
async fn a_changed_body_path_or_method_under_the_same_key_is_422() {
    let layer = || IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let (s, _) = second_status(
        layer(),
        post("/x", Some("k"), r#"{"amount":100}"#),
        post("/x", Some("k"), r#"{"amount":101}"#),
    )
    .await;
    assert_eq!(s, 422);
    let (s, _) = second_status(
        layer(),
        post("/x", Some("k"), "{}"),
        post("/y", Some("k"), "{}"),
    )
    .await;
    assert_eq!(s, 422, "another endpoint");
    let (s, _) = second_status(
        layer(),
        post("/x?a=1", Some("k"), "{}"),
        post("/x?a=2", Some("k"), "{}"),
    )
    .await;
    assert_eq!(s, 422, "another query");
    let patch = Request::patch("/x")
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let (s, _) = second_status(layer(), post("/x", Some("k"), "{}"), patch).await;
    assert_eq!(s, 422, "another method");
}

#[tokio::test]
async fn invalid_json_is_compared_as_raw_bytes() {
    let layer = || IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let (s, calls) = second_status(
        layer(),
        post("/x", Some("k"), "{not json"),
        post("/x", Some("k"), "{not json"),
    )
    .await;
    assert_eq!(
        (s, calls),
        (StatusCode::CREATED, 1),
        "identical invalid JSON replays"
    );
    let (s, _) = second_status(
        layer(),
        post("/x", Some("k"), "{not json"),
        post("/x", Some("k"), "{not  json"),
    )
    .await;
    assert_eq!(s, 422);
}

#[tokio::test]
async fn duplicate_json_keys_never_match_their_last_wins_reading() {
    let (s, _) = second_status(
        IdempotencyLayer::new(MemoryStore::new()).unscoped(),
        post("/x", Some("k"), r#"{"amount":1,"amount":1000}"#),
        post("/x", Some("k"), r#"{"amount":1000}"#),
    )
    .await;
    assert_eq!(s, 422);
}

#[tokio::test]
async fn integers_beyond_2_pow_53_are_not_merged() {
    let (s, _) = second_status(
        IdempotencyLayer::new(MemoryStore::new()).unscoped(),
        post("/x", Some("k"), r#"{"id":9007199254740993}"#),
        post("/x", Some("k"), r#"{"id":9007199254740992}"#),
    )
    .await;
    assert_eq!(
        s, 422,
        "they parse to the same double, yet are different requests"
    );
}

#[tokio::test]
async fn form_bodies_compare_as_sorted_pairs() {
    let form = |body: &'static str| {
        Request::post("/x")
            .header("idempotency-key", "k")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    };
    let layer = || IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let (s, calls) = second_status(
        layer(),
        form("amount=100&currency=EUR"),
        form("currency=EUR&amount=100"),
    )
    .await;
    assert_eq!((s, calls), (StatusCode::CREATED, 1));
    let (s, _) = second_status(layer(), form("amount=100"), form("amount=101")).await;
    assert_eq!(s, 422);
}

#[tokio::test]
async fn excluded_json_fields_and_included_headers_shape_the_fingerprint() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_fingerprint(
            Fingerprinting::default().exclude_field(JsonPointer::parse("/client_time").unwrap()),
        );
    let (s, calls) = second_status(
        layer,
        post("/x", Some("k"), r#"{"amount":1,"client_time":"10:00"}"#),
        post("/x", Some("k"), r#"{"amount":1,"client_time":"10:01"}"#),
    )
    .await;
    assert_eq!((s, calls), (StatusCode::CREATED, 1));

    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_fingerprint(
            Fingerprinting::default().include_header(http::HeaderName::from_static("x-account")),
        );
    let with = |acct: &'static str| {
        let mut r = post("/x", Some("k"), "{}");
        r.headers_mut()
            .insert("x-account", HeaderValue::from_static(acct));
        r
    };
    let (s, _) = second_status(layer, with("acct_1"), with("acct_2")).await;
    assert_eq!(s, 422);
}

// 5. Claim before work ----------------------------------------------------------------------

#[tokio::test]
async fn an_in_progress_key_is_409_with_retry_after_until_the_first_finishes() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let res = call(&s, post("/gated", Some("k"), "{}")).await;
    let retry_after: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    let v = assert_problem(res, 409, ErrorKind::InProgress).await;
    assert_eq!(v["retry_after"], retry_after);
    app.gate.notify_one();
    assert_eq!(body_bytes(first.await.unwrap()).await, "run 1");
    let replay = call(&s, post("/gated", Some("k"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn a_failed_store_is_503_with_retry_after_and_runs_nothing() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(DownStore).unscoped(), &app);
    let res = call(&s, post("/x", Some("k"), "{}")).await;
    assert_eq!(res.headers()["retry-after"], "1");
    let err = res.extensions().get::<IdempotencyError>().unwrap().clone();
    assert!(
        std::error::Error::source(&err).is_some(),
        "the store error is kept as the source"
    );
    assert_problem(res, 503, ErrorKind::StoreUnavailable).await;
    assert_eq!(app.calls(), 0);
}

#[tokio::test]
async fn fail_open_runs_the_request_unprotected_when_the_store_fails() {
    let app = App::default();
    let s = svc(
        IdempotencyLayer::new(DownStore)
            .unscoped()
            .with_store_failure(StoreFailure::closed().open_on_error(true)),
        &app,
    );
    assert_eq!(call(&s, post("/x", Some("k"), "{}")).await.status(), 201);
    assert_eq!(call(&s, post("/x", Some("k"), "{}")).await.status(), 201);
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn a_full_memory_store_refuses_new_keys_with_503_and_still_replays_old_ones() {
    let app = App::default();
    let store = MemoryStore::builder()
        .with_max_records(NonZeroUsize::new(2).unwrap())
        .build();
    let s = svc(IdempotencyLayer::new(store).unscoped(), &app);
    call(&s, post("/x", Some("a"), "{}")).await;
    call(&s, post("/x", Some("b"), "{}")).await;
    assert_problem(
        call(&s, post("/x", Some("c"), "{}")).await,
        503,
        ErrorKind::StoreUnavailable,
    )
    .await;
    assert_eq!(
        call(&s, post("/x", Some("a"), "{}")).await.headers()["idempotent-replayed"],
        "true"
    );
    assert_eq!(app.calls(), 2);
}

// 6. Detached execution -------------------------------------------------------------------

#[tokio::test]
async fn dropping_the_response_future_after_the_claim_does_not_cancel_the_work() {
    let app = App::default();
    let s = svc(
        IdempotencyLayer::new(MemoryStore::new())
            .unscoped()
            .with_in_progress(InProgress::wait(Duration::from_secs(30))),
        &app,
    );
    let fut = call(&s, post("/gated", Some("k"), "{}"));
    let mut fut = Box::pin(fut);
    // Drive the first request until the handler runs, then drop it: the client went away.
    tokio::select! {
        _ = &mut fut => panic!("the gated handler cannot finish yet"),
        _ = app.started.notified() => {}
    }
    drop(fut);
    app.gate.notify_one();
    // The retry waits for the detached run's answer and replays it.
    let retry = call(&s, post("/gated", Some("k"), "{}")).await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(retry).await, "run 1");
    assert_eq!(app.calls(), 1);
}

/// Delegates to a `MemoryStore`; each claim waits for `gate` first, and releases are signalled.
#[derive(Default)]
struct SlowClaimStore {
    inner: MemoryStore,
    claim_started: Notify,
    gate: Notify,
    released: Notify,
}

#[async_trait::async_trait]
impl IdempotencyStore for SlowClaimStore {
    async fn claim(
        &self,
        request: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, tower_idempotency::store::StoreError> {
        self.claim_started.notify_one();
        self.gate.notified().await;
        self.inner.claim(request).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        t: &tower_idempotency::store::Token,
        lease: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.inner.extend(id, t, lease).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        t: &tower_idempotency::store::Token,
        c: &tower_idempotency::store::Completion,
        ttl: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.inner.complete(id, t, c, ttl).await
    }
    async fn release(
        &self,
        id: &RecordId,
        t: &tower_idempotency::store::Token,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        let r = self.inner.release(id, t).await;
        self.released.notify_one();
        r
    }
    async fn get(
        &self,
        id: &RecordId,
    ) -> Result<Option<tower_idempotency::store::Record>, tower_idempotency::store::StoreError>
    {
        self.inner.get(id).await
    }
}

#[tokio::test]
async fn a_response_future_dropped_during_the_claim_releases_a_won_claim() {
    let store = Arc::new(SlowClaimStore::default());
    let app = App::default();
    let s = svc(IdempotencyLayer::new(store.clone()).unscoped(), &app);
    let mut fut = Box::pin(call(&s, post("/x", Some("k"), "{}")));
    tokio::select! {
        _ = &mut fut => panic!("the claim is gated"),
        _ = store.claim_started.notified() => {}
    }
    drop(fut); // the client went away while the claim was in flight
    store.gate.notify_one(); // the claim now lands in the store...
    store.released.notified().await; // ...and is released, not left to lapse with its lease
    assert!(store
        .inner
        .get(&RecordId::new(None, "k"))
        .await
        .unwrap()
        .is_none());
    assert_eq!(app.calls(), 0, "the dropped request never ran");
    let retry = tokio::spawn(call(&s, post("/x", Some("k"), "{}")));
    store.claim_started.notified().await;
    store.gate.notify_one();
    assert_eq!(
        retry.await.unwrap().status(),
        201,
        "the retry runs at once instead of 409"
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn a_panicking_handler_releases_the_claim_and_propagates_the_panic() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    let joined = tokio::spawn(call(&s, post("/panic", Some("k"), "{}"))).await;
    assert!(joined.unwrap_err().is_panic());
    // Released: the retry runs again (and panics again) instead of getting 409.
    let again = tokio::spawn(call(&s, post("/panic", Some("k"), "{}"))).await;
    assert!(again.unwrap_err().is_panic());
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn an_inner_service_error_releases_the_claim_and_is_returned() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let inner = service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Err::<Response<Full<Bytes>>, BoxError>("inner failed".into()) }
    });
    let s = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    assert!(s
        .clone()
        .oneshot(post("/x", Some("k"), "{}"))
        .await
        .is_err());
    assert!(s.oneshot(post("/x", Some("k"), "{}")).await.is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

// 7. Lease and fencing ----------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn the_lease_is_renewed_while_a_slow_handler_runs() {
    let (store, app) = (counting(), App::default());
    let timing = Timing::new(Duration::from_secs(3), Duration::from_secs(60)).unwrap();
    let s = svc(
        IdempotencyLayer::new(store.clone())
            .unscoped()
            .with_timing(timing),
        &app,
    );
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    // Ten leases of (paused, auto-advanced) time later the claim still holds: renewed
    // every lease / 3 = 1 s, so about 30 times.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let res = call(&s, post("/gated", Some("k"), "{}")).await;
    assert_eq!(res.status(), 409);
    let extends = store.extends.load(Ordering::SeqCst);
    assert!(
        (29..=31).contains(&extends),
        "renewed every lease/3: {extends}"
    );
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
    assert_eq!(app.calls(), 1);
}

/// Delegates to a `MemoryStore`, except that renewals fail: a holder cut off from the store.
#[derive(Default)]
struct NoRenewStore(MemoryStore);

#[async_trait::async_trait]
impl IdempotencyStore for NoRenewStore {
    async fn claim(
        &self,
        request: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, tower_idempotency::store::StoreError> {
        self.0.claim(request).await
    }
    async fn extend(
        &self,
        _: &RecordId,
        _: &tower_idempotency::store::Token,
        _: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        Err(tower_idempotency::store::StoreError::new(
            tower_idempotency::store::StoreErrorKind::Unavailable,
        ))
    }
    async fn complete(
        &self,
        id: &RecordId,
        t: &tower_idempotency::store::Token,
        c: &tower_idempotency::store::Completion,
        ttl: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.0.complete(id, t, c, ttl).await
    }
    async fn release(
        &self,
        id: &RecordId,
        t: &tower_idempotency::store::Token,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.0.release(id, t).await
    }
    async fn get(
        &self,
        id: &RecordId,
    ) -> Result<Option<tower_idempotency::store::Record>, tower_idempotency::store::StoreError>
    {
        self.0.get(id).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_lapsed_lease_is_taken_over_with_generation_2_and_the_old_holder_is_fenced() {
    let store = Arc::new(NoRenewStore::default());
    let gates = [Arc::new(Notify::new()), Arc::new(Notify::new())];
    let started = Arc::new(Notify::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = {
        let (gates, started, calls) = (gates.clone(), started.clone(), calls.clone());
        service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            let gen = req
                .extensions()
                .get::<IdempotencyContext>()
                .unwrap()
                .generation();
            let (gate, started) = (gates[n].clone(), started.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                let mut res = Response::new(Full::new(Bytes::from(format!("generation {gen}"))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        })
    };
    let timing = Timing::new(Duration::from_secs(3), Duration::from_secs(60)).unwrap();
    let s = IdempotencyLayer::new(store.clone())
        .unscoped()
        .with_timing(timing)
        .layer(inner);
    let first = tokio::spawn(s.clone().oneshot(post("/x", Some("k"), "{}")));
    started.notified().await;
    assert_eq!(
        s.clone()
            .oneshot(post("/x", Some("k"), "{}"))
            .await
            .unwrap()
            .status(),
        409,
        "lease still live"
    );
    // The holder cannot renew: past one lease, the same request takes over.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let different = s
        .clone()
        .oneshot(post("/x", Some("k"), r#"{"other":1}"#))
        .await
        .unwrap();
    assert_eq!(
        different.status(),
        422,
        "only the same request may take over"
    );
    let second = tokio::spawn(s.clone().oneshot(post("/x", Some("k"), "{}")));
    started.notified().await;
    gates[1].notify_one();
    assert_eq!(
        body_bytes(second.await.unwrap().unwrap()).await,
        "generation 2"
    );
    // The cut-off holder finishes last: its complete is fenced, the record keeps generation 2.
    gates[0].notify_one();
    assert_eq!(
        body_bytes(first.await.unwrap().unwrap()).await,
        "generation 1"
    );
    let replay = s.oneshot(post("/x", Some("k"), "{}")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(replay).await, "generation 2");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

// 8. Record policy ------------------------------------------------------------------------

#[tokio::test]
async fn the_default_policy_records_success_and_business_errors_and_releases_the_rest() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    for (status, recorded) in [
        (201, true),
        (302, true),
        (402, true),
        (410, true),
        (400, false),
        (404, false),
        (409, false),
        (429, false),
        (500, false),
        (503, false),
    ] {
        let key = format!("k{status}");
        let path = format!("/status/{status}");
        let before = app.calls();
        assert_eq!(
            call(&s, post(&path, Some(&key), "{}")).await.status(),
            status
        );
        let again = call(&s, post(&path, Some(&key), "{}")).await;
        assert_eq!(again.status(), status);
        let ran_again = app.calls() - before == 2;
        assert_eq!(!ran_again, recorded, "status {status}");
        assert_eq!(
            again.headers().contains_key("idempotent-replayed"),
            recorded,
            "status {status}"
        );
    }
}

#[tokio::test]
async fn handler_decisions_override_the_policy_and_no_store_alone_does_not_release() {
    for (path, recorded) in [
        ("/no-store", true),
        ("/decide-release", false),
        ("/decide-record", true),
    ] {
        let app = App::default();
        let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
        let s = svc(layer, &app);
        call(&s, post(path, Some(path), "{}")).await;
        call(&s, post(path, Some(path), "{}")).await;
        assert_eq!(app.calls() == 1, recorded, "{path}");
    }
}

#[tokio::test]
async fn a_policy_closure_replaces_the_default() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_record_policy(|r: &tower_idempotency::ResponseInfo<'_>| r.status() == 500);
    let s = svc(layer, &app);
    call(&s, post("/status/201", Some("a"), "{}")).await;
    call(&s, post("/status/201", Some("a"), "{}")).await;
    assert_eq!(app.calls(), 2, "201 released by the closure");
    call(&s, post("/status/500", Some("b"), "{}")).await;
    let replay = call(&s, post("/status/500", Some("b"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(app.calls(), 3);
}

// 9. Recording and replay -----------------------------------------------------------------

#[tokio::test]
async fn replays_carry_every_header_but_the_deny_list_and_the_exact_body() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_unrecorded_header(http::HeaderName::from_static("x-request-id"));
    let s = svc(layer, &app);
    let first = call(&s, post("/headers", Some("k"), "{}")).await;
    assert_eq!(
        first.headers()["set-cookie"],
        "session=secret",
        "the first answer is untouched"
    );
    let replay = call(&s, post("/headers", Some("k"), "{}")).await;
    let h = replay.headers();
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(h["content-type"], "application/json");
    assert_eq!(h["location"], "/v1/things/1");
    assert_eq!(
        h.get_all("link").iter().collect::<Vec<_>>(),
        ["</a>; rel=a", "</b>; rel=b"]
    );
    assert_eq!(
        h["x-custom"], "kept-when-configured",
        "custom headers replay"
    );
    assert!(h.get("set-cookie").is_none(), "cookies are never recorded");
    assert!(h.get("x-request-id").is_none(), "the user's deny-list");
    assert_eq!(body_bytes(replay).await, "run 1");
}

#[tokio::test]
async fn an_answer_beyond_the_header_caps_is_tombstoned_never_run_twice() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    let first = call(&s, post("/many-headers", Some("k"), "{}")).await;
    assert_eq!(first.headers().len(), 1100, "the first answer is whole");
    assert_eq!(body_bytes(first).await, "run 1", "its body too, given back");
    let retry = call(&s, post("/many-headers", Some("k"), "{}")).await;
    let v = assert_problem(retry, 410, ErrorKind::ResponseNotRetained).await;
    assert_eq!(v["original_status"], 201);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn binary_bodies_replay_byte_for_byte() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    let binary: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let req = || {
        Request::post("/echo")
            .header("idempotency-key", "k")
            .header("content-type", "application/octet-stream")
            .body(Full::new(Bytes::from(binary.clone())))
            .unwrap()
    };
    assert_eq!(body_bytes(call(&s, req()).await).await, binary);
    assert_eq!(body_bytes(call(&s, req()).await).await, binary);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn trailers_are_recorded_and_replayed_by_the_same_rule_as_headers() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_unrecorded_header(http::HeaderName::from_static("x-trace"));
    let s = svc(layer, &app);
    for replay in [false, true] {
        let res = call(&s, post("/trailers", Some("k"), "{}")).await;
        let collected = res.into_body().collect().await.unwrap();
        let trailers = collected.trailers().unwrap();
        assert_eq!(trailers["x-checksum"], "c0ffee");
        assert_eq!(trailers.contains_key("x-trace"), !replay);
        assert_eq!(collected.to_bytes(), "part-1;part-2 run 1");
    }
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn a_response_over_the_limit_streams_whole_and_retries_get_410_not_a_rerun() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_max_response_body(NonZeroUsize::new(64 * 1024).unwrap());
    let s = svc(layer, &app);
    let first = call(&s, post("/large/200000", Some("k"), "{}")).await;
    assert_eq!(first.status(), 201);
    let body = body_bytes(first).await;
    assert_eq!(
        body.len(),
        200_000 / 1024 * 1024,
        "the client gets the whole body"
    );
    assert!(body
        .chunks(1024)
        .enumerate()
        .all(|(i, c)| c.iter().all(|&b| b == (i % 251) as u8)));
    let retry = call(&s, post("/large/200000", Some("k"), "{}")).await;
    let v = assert_problem(retry, 410, ErrorKind::ResponseNotRetained).await;
    assert_eq!(v["original_status"], 201);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn a_response_body_that_fails_is_released_and_the_error_reaches_the_client() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(MemoryStore::new()).unscoped(), &app);
    let res = call(&s, post("/broken-body", Some("k"), "{}")).await;
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "partial");
    assert!(body.frame().await.unwrap().is_err());
    call(&s, post("/broken-body", Some("k"), "{}")).await;
    assert_eq!(app.calls(), 2, "released: the retry ran again");
}

#[tokio::test]
async fn an_in_progress_409_says_retry_after_one_second_whatever_the_lease() {
    let app = App::default();
    let timing = Timing::new(Duration::from_secs(30), Duration::from_secs(24 * 60 * 60)).unwrap();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_timing(timing);
    let s = svc(layer, &app);
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let res = call(&s, post("/gated", Some("k"), "{}")).await;
    assert_eq!(res.status(), 409);
    assert_eq!(
        res.headers()["retry-after"],
        "1",
        "not the rest of the 30 s lease"
    );
    let err = res.extensions().get::<IdempotencyError>().unwrap();
    assert_eq!(err.retry_after_duration(), Some(Duration::from_secs(1)));
    app.gate.notify_one();
    first.await.unwrap();
}

#[tokio::test]
async fn the_in_progress_retry_after_can_be_capped() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_in_progress(InProgress::conflict().retry_after(Duration::from_millis(1500)));
    let s = svc(layer, &app);
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let res = call(&s, post("/gated", Some("k"), "{}")).await;
    assert_eq!(res.status(), 409);
    assert_eq!(res.headers()["retry-after"], "2", "1.5 s, rounded up");
    app.gate.notify_one();
    first.await.unwrap();
}

// 10. Errors -------------------------------------------------------------------------------

#[tokio::test]
async fn errors_can_be_rendered_by_the_user() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_error_renderer(|e: &IdempotencyError| {
            let mut res = Response::new(Bytes::from(format!("custom: {}", e.kind().slug())));
            *res.status_mut() = e.kind().status();
            res
        });
    let s = svc(layer, &app);
    let res = call(&s, post("/x", None, "{}")).await;
    assert_eq!(res.status(), 400);
    assert_eq!(problem_kind(&res), ErrorKind::KeyMissing);
    assert_eq!(body_bytes(res).await, "custom: key-missing");
}

// 11. Wait mode ----------------------------------------------------------------------------

#[tokio::test]
async fn wait_mode_replays_the_first_answer_instead_of_409() {
    let app = App::default();
    let s = svc(
        IdempotencyLayer::new(MemoryStore::new())
            .unscoped()
            .with_in_progress(InProgress::wait(Duration::from_secs(30))),
        &app,
    );
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let second = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.gate.notify_one();
    let (a, b) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(b.headers()["idempotent-replayed"], "true");
    assert_eq!(
        (body_bytes(a).await, body_bytes(b).await),
        (Bytes::from("run 1"), Bytes::from("run 1"))
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn wait_mode_falls_back_to_409_when_the_wait_times_out() {
    let app = App::default();
    let s = svc(
        IdempotencyLayer::new(MemoryStore::new())
            .unscoped()
            .with_in_progress(InProgress::wait(Duration::from_secs(2))),
        &app,
    );
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let second = call(&s, post("/gated", Some("k"), "{}")).await;
    assert_eq!(second.status(), 409);
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicates_share_one_poll_and_past_the_cap_get_409() {
    let (store, app) = (counting(), App::default());
    let s = svc(
        IdempotencyLayer::new(store.clone())
            .unscoped()
            .with_in_progress(
                InProgress::wait(Duration::from_secs(60))
                    .max_waiters(NonZeroUsize::new(40).unwrap()),
            ),
        &app,
    );
    let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let waiters: Vec<_> = (0..50)
        .map(|_| tokio::spawn(call(&s, post("/gated", Some("k"), "{}"))))
        .collect();
    // Five seconds of waiting: about fifteen polls at the backoff's pace.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let gets = store.gets.load(Ordering::SeqCst);
    assert!(
        (1..=20).contains(&gets),
        "{gets} gets for 40 waiters: one poll serves them all"
    );
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
    let mut statuses = std::collections::BTreeMap::new();
    for w in waiters {
        let res = w.await.unwrap();
        *statuses.entry(res.status().as_u16()).or_insert(0) += 1;
        if res.status() == 201 {
            assert_eq!(res.headers()["idempotent-replayed"], "true");
        }
    }
    assert_eq!(statuses, [(201, 40), (409, 10)].into());
    assert_eq!(app.calls(), 1);
}

// 12. IdempotencyContext -------------------------------------------------------------------

#[tokio::test]
async fn the_context_carries_key_scope_generation_and_a_stable_derived_key() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(|_| Some("tenant-1".into()));
    let s = svc(layer, &app);
    // /context answers 503, so it is released and each call runs: compare two runs.
    let a = body_json(call(&s, post("/context", Some("key-1"), "{}")).await).await;
    let b = body_json(call(&s, post("/context", Some("key-1"), "{}")).await).await;
    let c = body_json(call(&s, post("/context", Some("key-2"), "{}")).await).await;
    assert_eq!(
        (
            a["key"].as_str(),
            a["scope"].as_str(),
            a["generation"].as_u64()
        ),
        (Some("key-1"), Some("tenant-1"), Some(1))
    );
    assert_eq!((a["run"].as_u64(), b["run"].as_u64()), (Some(1), Some(2)));
    assert_eq!(
        a["derived"], b["derived"],
        "stable across runs of the same request"
    );
    assert_ne!(a["derived"], c["derived"]);
    assert_eq!(a["derived"].as_str().unwrap().len(), 64);
}

// 13. Retry hints and the key echo ----------------------------------------------------------

/// `Retry-After` and `retry-after-ms` of an answer, as numbers.
fn hints(res: &Response<tower_idempotency::ResponseBody<Body>>) -> (u64, u64) {
    let n = |name: &str| res.headers()[name].to_str().unwrap().parse().unwrap();
    (n("retry-after"), n("retry-after-ms"))
}

#[tokio::test]
async fn an_in_progress_409_says_retry_after_ms_to_the_millisecond_beside_whole_seconds() {
    for (in_progress, lease, want) in [
        (
            InProgress::conflict(),
            Duration::from_secs(30),
            Some((1, 1000)),
        ),
        (
            InProgress::conflict().retry_after(Duration::from_millis(1500)),
            Duration::from_secs(30),
            Some((2, 1500)),
        ),
        // The rest of a 300 ms lease is shorter than the 1 s hint: the rest it is.
        (InProgress::conflict(), Duration::from_millis(300), None),
    ] {
        let app = App::default();
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .unscoped()
            .with_timing(Timing::new(lease, Duration::from_secs(60)).unwrap())
            .with_in_progress(in_progress);
        let s = svc(layer, &app);
        let first = tokio::spawn(call(&s, post("/gated", Some("k"), "{}")));
        app.started.notified().await;
        let res = call(&s, post("/gated", Some("k"), "{}")).await;
        let (secs, ms) = hints(&res);
        let err = res.extensions().get::<IdempotencyError>().unwrap();
        assert_eq!(
            Some(ms),
            err.retry_after_duration()
                .map(|d| d.as_nanos().div_ceil(1_000_000) as u64),
            "the milliseconds the layer means"
        );
        match want {
            Some(want) => assert_eq!((secs, ms), want),
            None => assert!(secs == 1 && (1..=300).contains(&ms), "{secs} s, {ms} ms"),
        }
        let v = assert_problem(res, 409, ErrorKind::InProgress).await;
        assert_eq!(v["retry_after"], secs);
        app.gate.notify_one();
        first.await.unwrap();
    }
}

#[tokio::test]
async fn a_store_unavailable_503_says_retry_after_ms_beside_retry_after() {
    let app = App::default();
    let s = svc(IdempotencyLayer::new(DownStore).unscoped(), &app);
    let res = call(&s, post("/x", Some("k"), "{}")).await;
    assert_eq!(hints(&res), (1, 1000));
    assert_problem(res, 503, ErrorKind::StoreUnavailable).await;
    assert_eq!(app.calls(), 0);
}

#[tokio::test]
async fn a_quota_429_says_when_to_retry_as_configured_and_never_past_the_ttl() {
    for (store_failure, ttl, want) in [
        (
            StoreFailure::closed(),
            Duration::from_secs(86_400),
            (60, 60_000),
        ),
        (
            StoreFailure::closed().quota_retry_after(Duration::from_millis(1500)),
            Duration::from_secs(86_400),
            (2, 1500),
        ),
        // Every record the scope holds is gone within one TTL.
        (
            StoreFailure::closed(),
            Duration::from_secs(10),
            (10, 10_000),
        ),
    ] {
        let app = App::default();
        let store = MemoryStore::builder()
            .with_max_records_per_scope(NonZeroUsize::new(1).unwrap())
            .build();
        let layer = IdempotencyLayer::new(store)
            .with_scope(|_| Some("tenant".into()))
            .with_timing(Timing::new(Duration::from_secs(1), ttl).unwrap())
            .with_store_failure(store_failure);
        let s = svc(layer, &app);
        assert_eq!(call(&s, post("/x", Some("k1"), "{}")).await.status(), 201);
        let over = call(&s, post("/x", Some("k2"), "{}")).await;
        assert_eq!(hints(&over), want);
        let v = assert_problem(over, 429, ErrorKind::QuotaExceeded).await;
        assert_eq!(v["retry_after"], want.0);
        assert_eq!(app.calls(), 1);
    }
}

#[tokio::test]
async fn the_key_is_echoed_on_every_answer_to_a_keyed_request_only_when_asked() {
    for echo in [false, true] {
        let app = App::default();
        let store = MemoryStore::new();
        let layer = IdempotencyLayer::new(store.clone()).unscoped();
        let layer = if echo {
            layer.with_key_echo(true)
        } else {
            layer
        };
        let s = svc(layer, &app);
        let echoed = |res: &Response<tower_idempotency::ResponseBody<Body>>| {
            res.headers()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let want = |key: &str| echo.then(|| key.to_owned());

        let first = call(&s, post("/x", Some("k-1"), r#"{"a":1}"#)).await;
        assert_eq!(
            (first.status().as_u16(), echoed(&first)),
            (201, want("k-1"))
        );
        let replay = call(&s, post("/x", Some("k-1"), r#"{"a":1}"#)).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(echoed(&replay), want("k-1"));
        let reused = call(&s, post("/x", Some("k-1"), r#"{"a":2}"#)).await;
        assert_eq!(echoed(&reused), want("k-1"));
        assert_problem(reused, 422, ErrorKind::Mismatch).await;

        // An sf-string key comes back as it was sent.
        let first = tokio::spawn(call(&s, post("/gated", Some("\"k-2\""), "{}")));
        app.started.notified().await;
        let busy = call(&s, post("/gated", Some("\"k-2\""), "{}")).await;
        assert_eq!(echoed(&busy), want("\"k-2\""));
        assert_problem(busy, 409, ErrorKind::InProgress).await;
        app.gate.notify_one();
        assert_eq!(echoed(&first.await.unwrap()), want("\"k-2\""));

        // Not known, not echoed: a request refused for its key, or passed through.
        let bad = call(&s, post("/x", Some("a b"), "{}")).await;
        assert_eq!(echoed(&bad), None);
        let mut get = post("/x", Some("k-3"), "");
        *get.method_mut() = http::Method::GET;
        assert_eq!(echoed(&call(&s, get).await), None);

        // The echo is never recorded: a layer that does not echo replays without it.
        let quiet = svc(IdempotencyLayer::new(store).unscoped(), &app);
        let replay = call(&quiet, post("/x", Some("k-1"), r#"{"a":1}"#)).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(echoed(&replay), None);
        assert_eq!(app.calls(), 3, "k-1, k-2 and the GET");
    }
}
