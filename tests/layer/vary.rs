//! A recorded answer's `Vary` is part of the match: within one scope, an answer made for
//! one value of a request header is not replayed to a request with another.

use crate::support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use support::*;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{ErrorKind, IdempotencyError, IdempotencyLayer, RequestBody};

/// Answers 201 with `Vary` set to the request's `x-vary` header (when sent), and echoes an
/// `x-inner-digest` header into `idempotency-vary-digest` (an inner service forging the
/// layer's own field).
fn app(
    calls: Arc<AtomicUsize>,
) -> impl Service<
    Request<RequestBody<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let mut res = Response::new(Full::new(Bytes::from(format!("run {n}"))));
            *res.status_mut() = StatusCode::CREATED;
            if let Some(v) = req.headers().get("x-vary") {
                res.headers_mut().insert(http::header::VARY, v.clone());
            }
            if let Some(v) = req.headers().get("x-inner-digest") {
                res.headers_mut()
                    .insert("idempotency-vary-digest", v.clone());
            }
            Ok::<_, Infallible>(res)
        }
    })
}

fn request(key: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut req = post("/v1/payments", Some(key), r#"{"amount":1}"#);
    for (n, v) in headers {
        let name = http::HeaderName::from_bytes(n.as_bytes()).unwrap();
        req.headers_mut()
            .append(name, HeaderValue::from_str(v).unwrap());
    }
    req
}

type Answer = (StatusCode, http::HeaderMap, Bytes, Option<ErrorKind>);

async fn send<S, B>(svc: &S, req: Request<Full<Bytes>>) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let res = svc.clone().oneshot(req).await.unwrap();
    let kind = res.extensions().get::<IdempotencyError>().map(|e| e.kind());
    let (parts, body) = res.into_parts();
    let body = http_body_util::BodyExt::collect(body)
        .await
        .unwrap()
        .to_bytes();
    (parts.status, parts.headers, body, kind)
}

fn layer() -> IdempotencyLayer {
    IdempotencyLayer::new(MemoryStore::new()).unscoped()
}

#[tokio::test]
async fn a_retry_with_other_values_of_a_varied_header_gets_422_and_runs_nothing() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer().layer(app(calls.clone()));
    let alice = [
        ("x-vary", "Authorization, Accept-Language"),
        ("authorization", "Bearer alice"),
        ("accept-language", "fr"),
    ];
    let (status, headers, body, _) = send(&svc, request("k1", &alice)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["vary"], "Authorization, Accept-Language");

    // The same values, sent again: the recorded answer, without the layer's digest.
    let (status, headers, body2, _) = send(&svc, request("k1", &alice)).await;
    assert_eq!((status, &body2), (StatusCode::CREATED, &body));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(
        headers["vary"], "Authorization, Accept-Language",
        "Vary is replayed"
    );
    assert!(
        headers.get("idempotency-vary-digest").is_none(),
        "the digest is never sent"
    );

    // Another user within the same scope: refused, not replayed, not run.
    let bob = [
        ("x-vary", "Authorization, Accept-Language"),
        ("authorization", "Bearer bob"),
        ("accept-language", "fr"),
    ];
    let (status, headers, body3, kind) = send(&svc, request("k1", &bob)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(kind, Some(ErrorKind::Mismatch));
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_ne!(body3, body, "nothing of Alice's answer reaches Bob");

    // One varied header missing is a different request too.
    let no_language = [
        ("x-vary", "Authorization, Accept-Language"),
        ("authorization", "Bearer alice"),
    ];
    let (status, ..) = send(&svc, request("k1", &no_language)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "only the first request ran"
    );
}

#[tokio::test]
async fn header_names_in_vary_match_whatever_their_case_and_order() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer().layer(app(calls.clone()));
    let first = [
        ("x-vary", "ACCEPT-LANGUAGE,authorization"),
        ("authorization", "a"),
        ("accept-language", "de"),
    ];
    send(&svc, request("k2", &first)).await;
    // The retry's own x-vary header is not what counts: the recorded Vary is.
    let retry = [
        ("x-vary", "authorization , Accept-Language"),
        ("accept-language", "de"),
        ("authorization", "a"),
    ];
    let (status, headers, ..) = send(&svc, request("k2", &retry)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn with_vary_match_off_replays_across_values() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer().with_vary_match(false).layer(app(calls.clone()));
    send(
        &svc,
        request(
            "k3",
            &[("x-vary", "authorization"), ("authorization", "alice")],
        ),
    )
    .await;
    let (status, headers, ..) = send(
        &svc,
        request(
            "k3",
            &[("x-vary", "authorization"), ("authorization", "bob")],
        ),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert!(headers.get("idempotency-vary-digest").is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn vary_star_and_no_vary_compare_no_headers() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer().layer(app(calls.clone()));
    send(
        &svc,
        request("k4", &[("x-vary", "*"), ("authorization", "alice")]),
    )
    .await;
    let (status, ..) = send(
        &svc,
        request("k4", &[("x-vary", "*"), ("authorization", "bob")]),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "Vary: * names no header to compare"
    );
    send(&svc, request("k5", &[("authorization", "alice")])).await;
    let (status, ..) = send(&svc, request("k5", &[("authorization", "bob")])).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_inner_service_cannot_forge_the_layers_digest() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer().layer(app(calls.clone()));
    // A forged digest with no Vary: dropped when recording, so it neither blocks a retry nor
    // reaches a client.
    let forged = [("x-inner-digest", "00")];
    let (_, headers, ..) = send(&svc, request("k6", &forged)).await;
    assert_eq!(
        headers["idempotency-vary-digest"], "00",
        "the first answer is the inner one, untouched"
    );
    let (status, headers, ..) = send(&svc, request("k6", &forged)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert!(headers.get("idempotency-vary-digest").is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A handler that records its own answer (as `PostgresStore::record_in` does in its
/// transaction): `Vary: authorization`, a body private to the caller, and a `/wide` route
/// whose answer carries 1,025 header fields (over the record's cap).
fn self_recording(
    store: Arc<MemoryStore>,
    calls: Arc<AtomicUsize>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    let layer = IdempotencyLayer::from_arc(store.clone()).unscoped();
    layer.layer(service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let (store, calls) = (store.clone(), calls.clone());
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let ctx = req
                .extensions()
                .get::<tower_idempotency::IdempotencyContext>()
                .cloned()
                .unwrap();
            let who = req.headers()["authorization"].to_str().unwrap().to_owned();
            let mut res = Response::new(Bytes::from(format!("private statement of {who}")));
            *res.status_mut() = StatusCode::CREATED;
            res.headers_mut().insert(
                http::header::VARY,
                HeaderValue::from_static("authorization"),
            );
            if req.uri().path() == "/wide" {
                for i in 0..1024 {
                    let name = http::HeaderName::from_bytes(format!("x-f{i}").as_bytes());
                    res.headers_mut()
                        .append(name.unwrap(), HeaderValue::from_static("1"));
                }
            }
            tower_idempotency::store::IdempotencyStore::complete(
                &*store,
                &ctx.record_id(),
                &ctx.token(),
                &ctx.completion(&res).unwrap(),
                ctx.ttl(),
            )
            .await
            .unwrap();
            let (mut parts, body) = res.into_parts();
            parts
                .extensions
                .insert(tower_idempotency::RecordDecision::AlreadyRecorded);
            Ok::<_, Infallible>(Response::from_parts(parts, Full::new(body)))
        }
    }))
}

#[tokio::test]
async fn a_handler_recorded_answer_keeps_the_vary_guard() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = self_recording(Arc::new(MemoryStore::new()), calls.clone());
    let alice = [("authorization", "Bearer alice")];
    let (status, _, body, _) = send(&svc, request("k7", &alice)).await;
    assert_eq!(
        (status, &body[..]),
        (
            StatusCode::CREATED,
            &b"private statement of Bearer alice"[..]
        )
    );

    let bob = [("authorization", "Bearer bob")];
    let (status, _, body, kind) = send(&svc, request("k7", &bob)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(kind, Some(ErrorKind::Mismatch));
    assert!(!String::from_utf8_lossy(&body).contains("alice"));

    let (status, headers, body, _) = send(&svc, request("k7", &alice)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(&body[..], b"private statement of Bearer alice");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_handler_recorded_answer_over_the_header_cap_is_a_tombstone_not_an_unreadable_record() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = self_recording(Arc::new(MemoryStore::new()), calls.clone());
    let alice = [("authorization", "Bearer alice")];
    let mut req = request("k8", &alice);
    *req.uri_mut() = "/wide".parse().unwrap();
    let (status, ..) = send(&svc, req).await;
    assert_eq!(status, StatusCode::CREATED);
    let mut retry = request("k8", &alice);
    *retry.uri_mut() = "/wide".parse().unwrap();
    let (status, _, _, kind) = send(&svc, retry).await;
    assert_eq!(kind, Some(ErrorKind::ResponseNotRetained), "{status}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_vary_guard_holds_when_vary_itself_is_not_recorded() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer()
        .with_unrecorded_header(http::header::VARY)
        .layer(app(calls.clone()));
    let alice = [
        ("x-vary", "Authorization"),
        ("authorization", "Bearer alice"),
    ];
    send(&svc, request("k9", &alice)).await;
    let bob = [("x-vary", "Authorization"), ("authorization", "Bearer bob")];
    let (status, _, _, kind) = send(&svc, request("k9", &bob)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(kind, Some(ErrorKind::Mismatch));
    let (status, headers, ..) = send(&svc, request("k9", &alice)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert!(headers.get("vary").is_none(), "Vary is on the deny-list");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_with_a_full_header_map_and_vary_replays() {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer().layer(
        tower::util::MapResponseLayer::new(|mut res: Response<Full<Bytes>>| {
            // 1,023 fields beside Vary: exactly the record's cap of 1,024.
            for i in 0..1023 {
                let name = http::HeaderName::from_bytes(format!("x-f{i}").as_bytes()).unwrap();
                res.headers_mut()
                    .append(name, HeaderValue::from_static("1"));
            }
            res
        })
        .layer(app(calls.clone())),
    );
    let alice = [
        ("x-vary", "Authorization"),
        ("authorization", "Bearer alice"),
    ];
    let (status, headers, body, _) = send(&svc, request("k10", &alice)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers.len(), 1024, "1,023 fields and Vary");
    let (status, headers, body2, kind) = send(&svc, request("k10", &alice)).await;
    assert_eq!((status, kind), (StatusCode::CREATED, None));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(body2, body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
