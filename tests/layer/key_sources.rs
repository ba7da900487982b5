//! Where the key comes from (`Key`) and the webhook defaults (`Webhook`), through plain
//! tower: every rejected input is a 400 problem that names the key's place, with no store
//! call and no handler run.

use crate::support;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::Full;
use support::{assert_problem, body_bytes, counting, CountingStore};
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{
    ErrorKind, IdempotencyLayer, InProgress, JsonPointer, Key, KeyPart, RequestBody, ResponseInfo,
    Webhook, DEFAULT_WEBHOOK_TTL,
};

type Req = Request<RequestBody<Full<Bytes>>>;

/// A handler that counts its runs and answers 200 `run <n>`, or the status in the
/// request's `x-answer` header.
#[derive(Clone, Default)]
struct Work {
    runs: Arc<AtomicUsize>,
}

impl Work {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

impl Service<Req> for Work {
    type Response = Response<Full<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let mut res = Response::new(Full::new(Bytes::from(format!("run {n}"))));
        if let Some(status) = req.headers().get("x-answer") {
            *res.status_mut() = status.to_str().unwrap().parse().unwrap();
        }
        std::future::ready(Ok(res))
    }
}

fn svc(layer: IdempotencyLayer, work: &Work) -> tower_idempotency::Idempotency<Work> {
    layer.layer(work.clone())
}

fn unscoped(store: &Arc<CountingStore>) -> IdempotencyLayer {
    IdempotencyLayer::from_arc(store.clone()).unscoped()
}

/// A JSON POST without an `Idempotency-Key`.
fn json(path: &str, body: &str) -> Request<Full<Bytes>> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap()
}

async fn call<S, B>(
    s: &S,
    req: Request<B>,
) -> Response<tower_idempotency::ResponseBody<Full<Bytes>>>
where
    S: Service<
            Request<B>,
            Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
            Error = std::convert::Infallible,
        > + Clone,
{
    s.clone().oneshot(req).await.unwrap()
}

fn replayed<B>(res: &Response<B>) -> bool {
    res.headers().get("idempotent-replayed").is_some()
}

#[tokio::test]
async fn a_json_pointer_key_dedupes_on_the_bodys_id_and_two_ids_run_twice() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::json_pointer("/id").unwrap()),
        &work,
    );
    let first = call(&s, json("/hook", r#"{"id":"evt_1","n":1}"#)).await;
    assert_eq!(first.status(), 200);
    assert_eq!(body_bytes(first).await, "run 1");
    let again = call(&s, json("/hook", r#"{ "n":1, "id":"evt_1" }"#)).await;
    assert!(replayed(&again));
    assert_eq!(body_bytes(again).await, "run 1");
    let other = call(&s, json("/hook", r#"{"id":"evt_2","n":1}"#)).await;
    assert_eq!(body_bytes(other).await, "run 2");
    assert_eq!(work.runs(), 2);
}

#[tokio::test]
async fn an_integer_id_is_its_decimal_text_so_123_and_the_string_123_are_one_key() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::json_pointer("/event/id").unwrap()),
        &work,
    );
    call(&s, json("/hook", r#"{"event":{"id":123}}"#)).await;
    let string = call(&s, json("/hook", r#"{"event":{"id":123}}"#)).await;
    assert!(replayed(&string));
    // Same key, other body: the fingerprint still tells them apart.
    let res = call(&s, json("/hook", r#"{"event":{"id":"123"}}"#)).await;
    assert_problem(res, ErrorKind::Mismatch).await;
    let negative = call(&s, json("/hook", r#"{"event":{"id":-7}}"#)).await;
    assert_eq!(negative.status(), 200);
    assert_eq!(work.runs(), 2);
}

/// Each refused body, with the kind and the words its problem must carry; none reaches the
/// store or the handler.
#[tokio::test]
async fn every_bad_body_id_is_a_400_naming_the_pointer_and_nothing_is_stored() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::json_pointer("/data/id").unwrap()),
        &work,
    );
    let long = format!(r#"{{"data":{{"id":"{}"}}}}"#, "k".repeat(256));
    let cases: &[(&str, &str, ErrorKind, &str)] = &[
        (
            "absent",
            r#"{"data":{}}"#,
            ErrorKind::KeyMissing,
            "is missing",
        ),
        (
            "null",
            r#"{"data":{"id":null}}"#,
            ErrorKind::KeyMissing,
            "is missing",
        ),
        (
            "path through a scalar",
            r#"{"data":7}"#,
            ErrorKind::KeyMissing,
            "is missing",
        ),
        (
            "not JSON",
            r#"{"data":{"id":"a"}"#,
            ErrorKind::KeyMissing,
            "not JSON",
        ),
        (
            "two documents",
            r#"{"data":{"id":"a"}} {}"#,
            ErrorKind::KeyMissing,
            "not JSON",
        ),
        (
            "empty string",
            r#"{"data":{"id":""}}"#,
            ErrorKind::KeyInvalid,
            "is empty",
        ),
        (
            "256 characters",
            &long,
            ErrorKind::KeyInvalid,
            "longer than 255",
        ),
        (
            "a space",
            r#"{"data":{"id":"a b"}}"#,
            ErrorKind::KeyInvalid,
            "visible ASCII",
        ),
        (
            "non-ASCII",
            r#"{"data":{"id":"caf\u00e9"}}"#,
            ErrorKind::KeyInvalid,
            "visible ASCII",
        ),
        (
            "a fraction",
            r#"{"data":{"id":1.5}}"#,
            ErrorKind::KeyInvalid,
            "a fraction",
        ),
        (
            "an exponent",
            r#"{"data":{"id":1e3}}"#,
            ErrorKind::KeyInvalid,
            "an exponent",
        ),
        (
            "beyond 64 bits",
            r#"{"data":{"id":18446744073709551616}}"#,
            ErrorKind::KeyInvalid,
            "64 bits",
        ),
        (
            "a boolean",
            r#"{"data":{"id":true}}"#,
            ErrorKind::KeyInvalid,
            "a boolean",
        ),
        (
            "an object",
            r#"{"data":{"id":{}}}"#,
            ErrorKind::KeyInvalid,
            "an object",
        ),
        (
            "an array",
            r#"{"data":{"id":["a"]}}"#,
            ErrorKind::KeyInvalid,
            "an array",
        ),
        (
            "named twice",
            r#"{"data":{"id":"a","id":"b"}}"#,
            ErrorKind::KeyInvalid,
            "more than once",
        ),
        (
            "parent named twice",
            r#"{"data":{"id":"a"},"data":{}}"#,
            ErrorKind::KeyInvalid,
            "more than once",
        ),
    ];
    for (label, body, kind, words) in cases {
        let res = call(&s, json("/hook", body)).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{label}");
        let problem = assert_problem(res, *kind).await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains("the idempotency key at JSON pointer `/data/id` in the request body"),
            "{label}: {detail}"
        );
        assert!(detail.contains(words), "{label}: {detail}");
    }
    assert_eq!((store.total(), work.runs()), (0, 0));
}

#[tokio::test]
async fn a_pointer_walks_arrays_by_index_and_unescapes_its_tokens() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::json_pointer("/items/1/a~1b").unwrap()),
        &work,
    );
    let res = call(&s, json("/hook", r#"{"items":[{"a/b":"x"},{"a/b":"y"}]}"#)).await;
    assert_eq!(res.status(), 200);
    let same = call(&s, json("/hook", r#"{"items":[{"a/b":"x"},{"a/b":"y"}]}"#)).await;
    assert!(replayed(&same));
    for (label, body) in [
        ("index past the end", r#"{"items":[{"a/b":"x"}]}"#),
        ("a string", r#"{"items":"ab"}"#),
    ] {
        let res = call(&s, json("/hook", body)).await;
        let problem = assert_problem(res, ErrorKind::KeyMissing).await;
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("`/items/1/a~1b`"),
            "{label}"
        );
    }
    // On an object a token is a member name, as RFC 6901 says: `1` finds `{"1": ..}`.
    let object = call(&s, json("/hook", r#"{"items":{"1":{"a/b":"z"}}}"#)).await;
    assert_eq!(
        (object.status(), replayed(&object)),
        (StatusCode::OK, false)
    );
    let s = svc(
        unscoped(&store).with_key(Key::json_pointer("/items/01").unwrap()),
        &work,
    );
    let res = call(&s, json("/hook", r#"{"items":["a","b"]}"#)).await;
    assert_problem(res, ErrorKind::KeyMissing).await;
    assert_eq!(work.runs(), 2);
}

#[tokio::test]
async fn an_optional_body_key_lets_a_body_without_it_through_but_refuses_a_bad_one() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::json_pointer("/id").unwrap().optional()),
        &work,
    );
    for body in [r#"{"other":1}"#, "not json"] {
        let res = call(&s, json("/hook", body)).await;
        assert_eq!(res.status(), 200);
        assert!(!replayed(&res));
    }
    assert_eq!((work.runs(), store.total()), (2, 0));
    let bad = call(&s, json("/hook", r#"{"id":""}"#)).await;
    assert_problem(bad, ErrorKind::KeyInvalid).await;
    call(&s, json("/hook", r#"{"id":"a"}"#)).await;
    assert!(replayed(&call(&s, json("/hook", r#"{"id":"a"}"#)).await));
    assert_eq!(work.runs(), 3);
}

fn adyen_key() -> Key {
    Key::joined([
        KeyPart::json_pointer("/item/eventCode").unwrap(),
        KeyPart::json_pointer("/item/pspReference").unwrap(),
    ])
    .unwrap()
}

#[tokio::test]
async fn joined_parts_are_length_prefixed_so_moving_a_character_between_them_is_another_key() {
    let (store, work) = (counting(), Work::default());
    let s = svc(unscoped(&store).with_key(adyen_key()), &work);
    let body = |code: &str, psp: &str| {
        format!(r#"{{"item":{{"eventCode":"{code}","pspReference":"{psp}"}}}}"#)
    };
    call(&s, json("/hook", &body("AB", "C"))).await;
    // With the same body `A`,`BC` would be a 422 if the keys merged; here it runs.
    let split = call(&s, json("/hook", &body("A", "BC"))).await;
    assert_eq!(split.status(), 200);
    assert!(!replayed(&split));
    assert!(replayed(&call(&s, json("/hook", &body("AB", "C"))).await));
    assert_eq!(work.runs(), 2);
    // The key the handler sees is the joined form.
    let ids: Vec<_> = [("AB", "C"), ("A", "BC")]
        .iter()
        .map(|(c, p)| {
            tower_idempotency::store::RecordId::new(
                None,
                &format!("{}:{c}{}:{p}", c.len(), p.len()),
            )
        })
        .collect();
    for id in ids {
        let record = tower_idempotency::store::IdempotencyStore::get(&*store, &id).await;
        assert!(record.unwrap().is_some(), "{id:?}");
    }
}

#[tokio::test]
async fn a_missing_joined_part_is_named_and_a_joined_key_over_255_characters_is_refused() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(adyen_key().described_as("notification id")),
        &work,
    );
    let res = call(
        &s,
        json("/hook", r#"{"item":{"eventCode":"AUTHORISATION"}}"#),
    )
    .await;
    let problem = assert_problem(res, ErrorKind::KeyMissing).await;
    assert_eq!(
        problem["detail"],
        "the notification id part at JSON pointer `/item/pspReference` in the request body is missing"
    );
    let long = format!(
        r#"{{"item":{{"eventCode":"{}","pspReference":"{}"}}}}"#,
        "A".repeat(200),
        "B".repeat(50)
    );
    let problem = assert_problem(call(&s, json("/hook", &long)).await, ErrorKind::KeyInvalid).await;
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("joined from its parts is longer than 255"));
    assert_eq!((store.total(), work.runs()), (0, 0));
}

#[tokio::test]
async fn a_key_from_a_function_reads_head_and_body_and_is_held_to_the_same_rules() {
    let (store, work) = (counting(), Work::default());
    let key = Key::from_fn(|parts, body| {
        let kind = parts.headers.get("x-kind")?.to_str().ok()?;
        Some(format!("{kind}/{}", std::str::from_utf8(body).ok()?.trim()))
    });
    let s = svc(unscoped(&store).with_key(key), &work);
    let req = |kind: Option<&str>, body: &str| {
        let mut b = Request::post("/hook");
        if let Some(k) = kind {
            b = b.header("x-kind", k);
        }
        b.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .unwrap()
    };
    call(&s, req(Some("push"), "abc")).await;
    assert!(replayed(&call(&s, req(Some("push"), "abc")).await));
    let problem = assert_problem(call(&s, req(None, "abc")).await, ErrorKind::KeyMissing).await;
    assert_eq!(problem["detail"], "this request has no idempotency key");
    let problem = assert_problem(
        call(&s, req(Some("push"), "a b")).await,
        ErrorKind::KeyInvalid,
    )
    .await;
    assert_eq!(
        problem["detail"],
        "the idempotency key derived from this request must be visible ASCII characters (0x21-0x7E)"
    );
    assert_eq!(work.runs(), 1);
}

#[tokio::test]
async fn another_header_is_named_in_its_problems() {
    let (store, work) = (counting(), Work::default());
    let key = Key::header(HeaderName::from_static("x-github-delivery")).described_as("delivery id");
    let s = svc(unscoped(&store).with_key(key), &work);
    let problem = assert_problem(call(&s, json("/hook", "{}")).await, ErrorKind::KeyMissing).await;
    assert_eq!(
        problem["detail"],
        "the delivery id in the `x-github-delivery` header is missing"
    );
    let mut twice = json("/hook", "{}");
    twice
        .headers_mut()
        .append("x-github-delivery", "a".parse().unwrap());
    twice
        .headers_mut()
        .append("x-github-delivery", "b".parse().unwrap());
    let problem = assert_problem(call(&s, twice).await, ErrorKind::KeyInvalid).await;
    assert_eq!(
        problem["detail"],
        "the delivery id in the `x-github-delivery` header was sent in more than one field line"
    );
    assert_eq!((store.total(), work.runs()), (0, 0));
}

/// A body that says whether it was ever polled, and never ends.
struct Watched(Arc<AtomicBool>);

impl Body for Watched {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.store(true, Ordering::SeqCst);
        Poll::Pending
    }
}

#[tokio::test(start_paused = true)]
async fn a_header_key_is_refused_before_the_body_is_read_and_a_body_key_after() {
    let polled = Arc::new(AtomicBool::new(false));
    let inner = tower::service_fn(|_: Request<RequestBody<Watched>>| async {
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let store = counting();
    let header = unscoped(&store).layer(inner);
    let req = || {
        Request::post("/hook")
            .body(Watched(polled.clone()))
            .unwrap()
    };
    let res = header.clone().oneshot(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(!polled.load(Ordering::SeqCst), "refused before buffering");

    // A body key waits for the body: here, until the body timeout.
    let body = unscoped(&store)
        .with_key(Key::json_pointer("/id").unwrap())
        .with_request_body_timeout(Duration::from_millis(10))
        .layer(inner);
    let res = body.oneshot(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert!(polled.load(Ordering::SeqCst));
    assert_eq!(store.total(), 0);
}

#[tokio::test]
async fn a_body_keyed_request_over_the_limit_is_413_before_any_claim() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store)
            .with_key(Key::json_pointer("/id").unwrap())
            .with_max_request_body(std::num::NonZeroUsize::new(32).unwrap()),
        &work,
    );
    let big = format!(r#"{{"id":"evt_1","pad":"{}"}}"#, "x".repeat(64));
    let res = call(&s, json("/hook", &big)).await;
    assert_problem(res, ErrorKind::BodyTooLarge).await;
    // Declared too large, or streamed past the limit without a length: the same.
    let mut chunked = json("/hook", &big);
    chunked.headers_mut().remove("content-length");
    assert_problem(call(&s, chunked).await, ErrorKind::BodyTooLarge).await;
    assert_eq!((store.total(), work.runs()), (0, 0));
}

#[test]
fn bad_key_and_webhook_settings_are_refused_when_built() {
    assert!(Key::json_pointer("id").is_err(), "must start with /");
    assert!(Key::json_pointer("/a~2").is_err());
    assert!(KeyPart::json_pointer("").is_err());
    assert!(Key::joined([]).is_err());
    let webhook = || Webhook::new(Key::json_pointer("/id").unwrap());
    for ok in [
        StatusCode::CONFLICT,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::SERVICE_UNAVAILABLE,
    ] {
        assert!(webhook().with_in_progress_status(ok).is_ok(), "{ok}");
    }
    for bad in [StatusCode::OK, StatusCode::ACCEPTED, StatusCode::FOUND] {
        assert!(webhook().with_in_progress_status(bad).is_err(), "{bad}");
    }
}

fn stripe(store: &Arc<CountingStore>) -> IdempotencyLayer {
    IdempotencyLayer::from_arc(store.clone())
        .with_webhook(Webhook::new(Key::json_pointer("/id").unwrap()))
}

#[tokio::test]
async fn webhook_mode_matches_key_and_route_so_a_changed_body_is_a_replay_not_422() {
    let (store, work) = (counting(), Work::default());
    let s = svc(stripe(&store), &work);
    call(
        &s,
        json("/webhooks/stripe", r#"{"id":"evt_1","pending_webhooks":2}"#),
    )
    .await;
    let redelivery = call(
        &s,
        json("/webhooks/stripe", r#"{"id":"evt_1","pending_webhooks":1}"#),
    )
    .await;
    assert_eq!(redelivery.status(), 200);
    assert!(replayed(&redelivery));
    assert_eq!(body_bytes(redelivery).await, "run 1");
    assert_eq!(work.runs(), 1);
}

#[tokio::test]
async fn webhook_mode_says_webhook_id_in_its_problems_and_stores_nothing() {
    let (store, work) = (counting(), Work::default());
    let s = svc(stripe(&store), &work);
    let problem = assert_problem(
        call(&s, json("/webhooks/stripe", r#"{"type":"x"}"#)).await,
        ErrorKind::KeyMissing,
    )
    .await;
    assert_eq!(
        problem["detail"],
        "the webhook id at JSON pointer `/id` in the request body is missing"
    );
    assert_eq!((store.total(), work.runs()), (0, 0));
}

#[tokio::test]
async fn matching_the_body_except_volatile_fields_replays_those_and_refuses_other_changes() {
    let (store, work) = (counting(), Work::default());
    let layer = IdempotencyLayer::from_arc(store.clone()).with_webhook(
        Webhook::new(Key::json_pointer("/id").unwrap())
            .matching_body_except([JsonPointer::parse("/pending_webhooks").unwrap()]),
    );
    let s = svc(layer, &work);
    call(
        &s,
        json(
            "/webhooks/stripe",
            r#"{"id":"evt_1","amount":5,"pending_webhooks":2}"#,
        ),
    )
    .await;
    let volatile = call(
        &s,
        json(
            "/webhooks/stripe",
            r#"{"id":"evt_1","amount":5,"pending_webhooks":1}"#,
        ),
    )
    .await;
    assert!(replayed(&volatile));
    let changed = call(
        &s,
        json(
            "/webhooks/stripe",
            r#"{"id":"evt_1","amount":6,"pending_webhooks":1}"#,
        ),
    )
    .await;
    assert_problem(changed, ErrorKind::Mismatch).await;
    assert_eq!(work.runs(), 1);
}

#[tokio::test]
async fn webhook_mode_records_only_2xx_so_a_failed_delivery_runs_again_when_redelivered() {
    let (store, work) = (counting(), Work::default());
    let s = svc(stripe(&store), &work);
    for status in ["400", "409", "410", "302", "500"] {
        let mut failed = json("/webhooks/stripe", r#"{"id":"evt_1"}"#);
        failed
            .headers_mut()
            .insert("x-answer", status.parse().unwrap());
        let res = call(&s, failed).await;
        assert_eq!(res.status().as_str(), status);
        assert!(!replayed(&res), "{status}");
    }
    let ok = call(&s, json("/webhooks/stripe", r#"{"id":"evt_1"}"#)).await;
    assert_eq!((ok.status(), replayed(&ok)), (StatusCode::OK, false));
    let again = call(&s, json("/webhooks/stripe", r#"{"id":"evt_1"}"#)).await;
    assert!(replayed(&again));
    assert_eq!(work.runs(), 6);
}

#[tokio::test]
async fn webhook_mode_scopes_by_endpoint_so_one_id_on_two_endpoints_runs_twice() {
    let (store, work) = (counting(), Work::default());
    let s = svc(stripe(&store), &work);
    for path in ["/webhooks/acme/stripe", "/webhooks/globex/stripe"] {
        let res = call(&s, json(path, r#"{"id":"evt_1"}"#)).await;
        assert_eq!(
            (res.status(), replayed(&res)),
            (StatusCode::OK, false),
            "{path}"
        );
    }
    assert!(replayed(
        &call(&s, json("/webhooks/acme/stripe", r#"{"id":"evt_1"}"#)).await
    ));
    assert_eq!(work.runs(), 2);
    // A scope set on the layer first is kept: one key space, so the second path is 422.
    let (store, work) = (counting(), Work::default());
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_webhook(Webhook::new(Key::json_pointer("/id").unwrap()));
    let s = svc(layer, &work);
    call(&s, json("/webhooks/acme/stripe", r#"{"id":"evt_1"}"#)).await;
    let other = call(&s, json("/webhooks/globex/stripe", r#"{"id":"evt_1"}"#)).await;
    assert_problem(other, ErrorKind::Mismatch).await;
}

#[tokio::test(start_paused = true)]
async fn webhook_records_live_seven_days_by_default_and_with_ttl_changes_it() {
    let (store, work) = (counting(), Work::default());
    let s = svc(stripe(&store), &work);
    call(&s, json("/webhooks/stripe", r#"{"id":"evt_1"}"#)).await;
    tokio::time::advance(DEFAULT_WEBHOOK_TTL - Duration::from_secs(1)).await;
    assert!(replayed(
        &call(&s, json("/webhooks/stripe", r#"{"id":"evt_1"}"#)).await
    ));
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(!replayed(
        &call(&s, json("/webhooks/stripe", r#"{"id":"evt_1"}"#)).await
    ));
    assert_eq!(work.runs(), 2);

    let layer = IdempotencyLayer::from_arc(store.clone()).with_webhook(
        Webhook::new(Key::json_pointer("/id").unwrap()).with_ttl(Duration::from_secs(3600)),
    );
    let s = svc(layer, &work);
    call(&s, json("/webhooks/other", r#"{"id":"evt_1"}"#)).await;
    tokio::time::advance(Duration::from_secs(3601)).await;
    assert!(!replayed(
        &call(&s, json("/webhooks/other", r#"{"id":"evt_1"}"#)).await
    ));
    assert_eq!(work.runs(), 4);
}

/// A handler that waits for `gate` after saying it started.
#[derive(Clone)]
struct Gated {
    started: Arc<Notify>,
    gate: Arc<Notify>,
    runs: Arc<AtomicUsize>,
}

impl Service<Req> for Gated {
    type Response = Response<Full<Bytes>>;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Req) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            this.runs.fetch_add(1, Ordering::SeqCst);
            this.started.notify_one();
            this.gate.notified().await;
            Ok(Response::new(Full::new(Bytes::from_static(b"done"))))
        })
    }
}

#[tokio::test]
async fn a_duplicate_while_the_first_delivery_runs_is_503_with_retry_after_or_the_chosen_status() {
    for (webhook, status) in [
        (
            Webhook::new(Key::json_pointer("/id").unwrap()),
            StatusCode::SERVICE_UNAVAILABLE,
        ),
        (
            Webhook::new(Key::json_pointer("/id").unwrap())
                .with_in_progress_status(StatusCode::CONFLICT)
                .unwrap(),
            StatusCode::CONFLICT,
        ),
    ] {
        let gated = Gated {
            started: Arc::default(),
            gate: Arc::default(),
            runs: Arc::default(),
        };
        let s = IdempotencyLayer::new(tower_idempotency::store::MemoryStore::new())
            .with_webhook(webhook)
            .layer(gated.clone());
        let first = tokio::spawn(
            s.clone()
                .oneshot(json("/webhooks/stripe", r#"{"id":"evt_1"}"#)),
        );
        gated.started.notified().await;
        let dup = s
            .clone()
            .oneshot(json("/webhooks/stripe", r#"{"id":"evt_1"}"#))
            .await
            .unwrap();
        assert_eq!(dup.status(), status);
        assert_eq!(dup.headers()["retry-after"], "1");
        let problem = assert_problem(dup, ErrorKind::InProgress).await;
        assert_eq!(problem["status"], status.as_u16());
        gated.gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        let after = s
            .oneshot(json("/webhooks/stripe", r#"{"id":"evt_1"}"#))
            .await
            .unwrap();
        assert!(replayed(&after));
        assert_eq!(gated.runs.load(Ordering::SeqCst), 1);
    }
}

/// The webhook layer of [`stripe`], keeping answers of at most `kept` bytes.
fn stripe_keeping(store: &Arc<CountingStore>, kept: usize) -> IdempotencyLayer {
    stripe(store).with_max_response_body(std::num::NonZeroUsize::new(kept).unwrap())
}

/// A redelivery's answer when the original was too large to keep: `status`, empty, marked.
async fn assert_omitted<B>(res: Response<B>, status: StatusCode)
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    assert_eq!(res.status(), status);
    assert!(replayed(&res), "{status}");
    assert_eq!(res.headers()["idempotent-replay-omitted"], "too-large");
    assert!(res.headers().get("content-type").is_none());
    assert_eq!(body_bytes(res).await, "", "{status}");
}

#[tokio::test]
async fn webhook_mode_acknowledges_a_taken_event_too_large_to_keep_with_its_status_not_410() {
    let (store, work) = (counting(), Work::default());
    // `run 1` is 5 bytes: a tombstone.
    let s = svc(stripe_keeping(&store, 4), &work);
    for (id, status) in [("evt_1", StatusCode::OK), ("evt_2", StatusCode::ACCEPTED)] {
        let body = format!(r#"{{"id":"{id}"}}"#);
        let mut first = json("/webhooks/stripe", &body);
        first
            .headers_mut()
            .insert("x-answer", status.as_str().parse().unwrap());
        let first = call(&s, first).await;
        assert_eq!((first.status(), replayed(&first)), (status, false));
        assert!(
            body_bytes(first).await.starts_with(b"run "),
            "streamed whole"
        );
        // The redelivery carries no `x-answer`: the status comes from the tombstone.
        assert_omitted(call(&s, json("/webhooks/stripe", &body)).await, status).await;
    }
    assert_eq!(work.runs(), 2);

    // Outside webhook mode, the same tombstone is still the 410 problem.
    let plain = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_max_response_body(std::num::NonZeroUsize::new(4).unwrap());
    let s = svc(plain, &work);
    let keyed = || support::post("/orders", Some("k1"), "{}");
    assert_eq!(call(&s, keyed()).await.status(), StatusCode::OK);
    let retry = call(&s, keyed()).await;
    assert!(retry.headers().get("idempotent-replay-omitted").is_none());
    let problem = assert_problem(retry, ErrorKind::ResponseNotRetained).await;
    assert_eq!(problem["original_status"], 200);
    assert_eq!(work.runs(), 3);
}

#[tokio::test]
async fn webhook_mode_answers_a_recorded_non_2xx_too_large_to_keep_with_its_status_too() {
    let (store, work) = (counting(), Work::default());
    // A policy of the user's own that records every answer.
    let layer = stripe_keeping(&store, 4).with_record_policy(|_: &ResponseInfo<'_>| true);
    let s = svc(layer, &work);
    let mut first = json("/webhooks/stripe", r#"{"id":"evt_1"}"#);
    first
        .headers_mut()
        .insert("x-answer", "409".parse().unwrap());
    assert_eq!(call(&s, first).await.status(), StatusCode::CONFLICT);
    let again = call(&s, json("/webhooks/stripe", r#"{"id":"evt_1"}"#)).await;
    assert_omitted(again, StatusCode::CONFLICT).await;
    assert_eq!(work.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_webhook_redelivery_waiting_for_the_first_gets_its_status_when_the_answer_was_too_large_to_keep(
) {
    let store = counting();
    let gated = Gated {
        started: Arc::default(),
        gate: Arc::default(),
        runs: Arc::default(),
    };
    // `done` is 4 bytes: a tombstone.
    let s = stripe_keeping(&store, 3)
        .with_in_progress(InProgress::wait(Duration::from_secs(10)))
        .layer(gated.clone());
    let delivery = || json("/webhooks/stripe", r#"{"id":"evt_1"}"#);
    let first = tokio::spawn(s.clone().oneshot(delivery()));
    gated.started.notified().await;
    let waiting = tokio::spawn(s.clone().oneshot(delivery()));
    // Its claim found the first in progress, and its wait polls the record.
    while store.gets.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    gated.gate.notify_one();
    let first = first.await.unwrap().unwrap();
    assert_eq!((first.status(), replayed(&first)), (StatusCode::OK, false));
    assert_eq!(body_bytes(first).await, "done");
    assert_omitted(waiting.await.unwrap().unwrap(), StatusCode::OK).await;
    assert_eq!(gated.runs.load(Ordering::SeqCst), 1);
}

/// A form POST without an `Idempotency-Key`.
fn form(path: &str, body: &str) -> Request<Full<Bytes>> {
    Request::post(path)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap()
}

#[tokio::test]
async fn a_form_field_key_dedupes_on_the_decoded_field_and_two_keys_run_twice() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::form_field("idempotency_key")),
        &work,
    );
    let first = call(&s, form("/v1/charges", "amount=100&idempotency_key=k-1")).await;
    assert_eq!((first.status(), replayed(&first)), (StatusCode::OK, false));
    assert_eq!(body_bytes(first).await, "run 1");
    // The same field, spelled otherwise: `%5F` is `_`, `%2D` is `-`; pairs in another order.
    let again = call(
        &s,
        form("/v1/charges", "idempotency%5Fkey=k%2D1&amount=100"),
    )
    .await;
    assert!(replayed(&again));
    assert_eq!(body_bytes(again).await, "run 1");
    // The key is the decoded value: the store holds the record of `k-1`.
    let id = tower_idempotency::store::RecordId::new(None, "k-1");
    let record = tower_idempotency::store::IdempotencyStore::get(&*store, &id).await;
    assert!(record.unwrap().is_some());
    // `%2B` is a `+`; a key with a reserved character, and another key: it runs.
    let other = call(&s, form("/v1/charges", "amount=100&idempotency_key=k%2B1")).await;
    assert_eq!((other.status(), replayed(&other)), (StatusCode::OK, false));
    let id = tower_idempotency::store::RecordId::new(None, "k+1");
    let record = tower_idempotency::store::IdempotencyStore::get(&*store, &id).await;
    assert!(record.unwrap().is_some());
    // The media type's case and parameters do not matter to the key.
    let mut charset = form("/v1/charges", "idempotency_key=k-2");
    charset.headers_mut().insert(
        "content-type",
        "Application/X-WWW-Form-URLEncoded ; charset=UTF-8"
            .parse()
            .unwrap(),
    );
    assert_eq!(call(&s, charset).await.status(), StatusCode::OK);
    assert_eq!(work.runs(), 3);
}

/// Each refused form request, with the kind and the words its problem must carry; none
/// reaches the store or the handler.
#[tokio::test]
async fn every_bad_form_key_is_a_400_naming_the_field_and_nothing_is_stored() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::form_field("idempotency_key")),
        &work,
    );
    let long = format!("idempotency_key={}", "k".repeat(256));
    let with_type = |content_type: Option<&str>, body: &str| {
        let mut b = Request::post("/v1/charges");
        if let Some(t) = content_type {
            b = b.header("content-type", t);
        }
        b.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .unwrap()
    };
    let form_type = Some("application/x-www-form-urlencoded");
    let cases: Vec<(&str, Request<Full<Bytes>>, ErrorKind, &str)> = vec![
        (
            "absent",
            with_type(form_type, "amount=100&idempotency_keys=k"),
            ErrorKind::KeyMissing,
            "of the request body is missing",
        ),
        (
            "empty body",
            with_type(form_type, ""),
            ErrorKind::KeyMissing,
            "of the request body is missing",
        ),
        (
            "a JSON body",
            with_type(Some("application/json"), r#"{"idempotency_key":"k"}"#),
            ErrorKind::KeyMissing,
            "is missing: the request body is `application/json`, not `application/x-www-form-urlencoded`",
        ),
        (
            "a multipart body",
            with_type(
                Some("multipart/form-data; boundary=x"),
                "--x\r\nContent-Disposition: form-data; name=\"idempotency_key\"\r\n\r\nk\r\n--x--",
            ),
            ErrorKind::KeyMissing,
            "the request body is `multipart/form-data`, not",
        ),
        (
            "no Content-Type",
            with_type(None, "idempotency_key=k"),
            ErrorKind::KeyMissing,
            "the request has no `Content-Type`",
        ),
        (
            "given twice",
            with_type(form_type, "idempotency_key=a&amount=1&idempotency_key=a"),
            ErrorKind::KeyInvalid,
            "is given more than once in the form body",
        ),
        (
            "given twice, once encoded",
            with_type(form_type, "idempotency_key=a&idempotency%5Fkey=b"),
            ErrorKind::KeyInvalid,
            "more than once",
        ),
        (
            "empty",
            with_type(form_type, "idempotency_key=&amount=1"),
            ErrorKind::KeyInvalid,
            "is empty",
        ),
        (
            "a name without a value",
            with_type(form_type, "idempotency_key&amount=1"),
            ErrorKind::KeyInvalid,
            "is empty",
        ),
        (
            "256 characters",
            with_type(form_type, &long),
            ErrorKind::KeyInvalid,
            "longer than 255",
        ),
        (
            "a plus is a space",
            with_type(form_type, "idempotency_key=a+b"),
            ErrorKind::KeyInvalid,
            "visible ASCII",
        ),
        (
            "non-ASCII",
            with_type(form_type, "idempotency_key=caf%C3%A9"),
            ErrorKind::KeyInvalid,
            "visible ASCII",
        ),
        (
            "a bad percent-escape",
            with_type(form_type, "idempotency_key=k%zz"),
            ErrorKind::KeyInvalid,
            "a `%` must be followed by two hex digits",
        ),
    ];
    for (label, req, kind, words) in cases {
        let res = call(&s, req).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{label}");
        assert!(res.headers().get("idempotency-key").is_none(), "{label}");
        let problem = assert_problem(res, kind).await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(
                "the idempotency key in form field `idempotency_key` of the request body"
            ),
            "{label}: {detail}"
        );
        assert!(detail.contains(words), "{label}: {detail}");
    }
    assert_eq!((store.total(), work.runs()), (0, 0));
}

#[tokio::test]
async fn an_optional_form_key_lets_a_request_without_it_through_but_refuses_a_bad_one() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store).with_key(Key::form_field("idempotency_key").optional()),
        &work,
    );
    for req in [
        form("/v1/charges", "amount=100"),
        json("/v1/charges", r#"{"idempotency_key":"k"}"#),
    ] {
        let res = call(&s, req).await;
        assert_eq!((res.status(), replayed(&res)), (StatusCode::OK, false));
    }
    assert_eq!((work.runs(), store.total()), (2, 0));
    for body in ["idempotency_key=", "idempotency_key=a&idempotency_key=a"] {
        let res = call(&s, form("/v1/charges", body)).await;
        assert_problem(res, ErrorKind::KeyInvalid).await;
    }
    assert_eq!((work.runs(), store.total()), (2, 0));
    call(&s, form("/v1/charges", "idempotency_key=a")).await;
    assert!(replayed(
        &call(&s, form("/v1/charges", "idempotency_key=a")).await
    ));
    assert_eq!(work.runs(), 3);
}

#[tokio::test]
async fn a_form_field_joins_a_header_and_a_missing_part_is_named() {
    let (store, work) = (counting(), Work::default());
    let key = Key::joined([
        KeyPart::header(HeaderName::from_static("x-account")),
        KeyPart::form_field("idempotency_key"),
    ])
    .unwrap();
    let s = svc(unscoped(&store).with_key(key), &work);
    let req = |account: &str, body: &str| {
        let mut r = form("/v1/charges", body);
        r.headers_mut()
            .insert("x-account", account.parse().unwrap());
        r
    };
    call(&s, req("acct_1", "idempotency_key=k")).await;
    assert!(replayed(
        &call(&s, req("acct_1", "idempotency_key=k")).await
    ));
    let id = tower_idempotency::store::RecordId::new(None, "6:acct_11:k");
    let record = tower_idempotency::store::IdempotencyStore::get(&*store, &id).await;
    assert!(record.unwrap().is_some(), "the joined key");
    let other = call(&s, req("acct_2", "idempotency_key=k")).await;
    assert!(!replayed(&other));
    let problem = assert_problem(
        call(&s, req("acct_1", "amount=1")).await,
        ErrorKind::KeyMissing,
    )
    .await;
    assert_eq!(
        problem["detail"],
        "the idempotency key part in form field `idempotency_key` of the request body is missing"
    );
    assert_eq!(work.runs(), 2);
}

#[tokio::test]
async fn a_form_keyed_request_over_the_limit_is_413_before_any_claim() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store)
            .with_key(Key::form_field("idempotency_key"))
            .with_max_request_body(std::num::NonZeroUsize::new(32).unwrap()),
        &work,
    );
    let big = format!("idempotency_key=k&pad={}", "x".repeat(64));
    assert_problem(
        call(&s, form("/v1/charges", &big)).await,
        ErrorKind::BodyTooLarge,
    )
    .await;
    let mut chunked = form("/v1/charges", &big);
    chunked.headers_mut().remove("content-length");
    assert_problem(call(&s, chunked).await, ErrorKind::BodyTooLarge).await;
    assert_eq!((store.total(), work.runs()), (0, 0));
}

#[tokio::test]
async fn a_key_read_from_the_body_is_echoed_as_read_when_the_layer_echoes_keys() {
    let (store, work) = (counting(), Work::default());
    let s = svc(
        unscoped(&store)
            .with_key(Key::form_field("idempotency_key"))
            .with_key_echo(true),
        &work,
    );
    let first = call(&s, form("/v1/charges", "idempotency_key=k%2D1")).await;
    assert_eq!(first.headers()["idempotency-key"], "k-1");
    let again = call(&s, form("/v1/charges", "idempotency_key=k%2D1")).await;
    assert!(replayed(&again));
    assert_eq!(again.headers()["idempotency-key"], "k-1");
    let reused = call(&s, form("/v1/charges", "idempotency_key=k-1&amount=2")).await;
    assert_eq!(reused.headers()["idempotency-key"], "k-1");
    assert_problem(reused, ErrorKind::Mismatch).await;
    // Before the key is known there is nothing to echo.
    let missing = call(&s, form("/v1/charges", "amount=2")).await;
    assert!(missing.headers().get("idempotency-key").is_none());
    assert_eq!(work.runs(), 1);
}
