//! The fingerprint through the public API: two requests with one key through
//! `IdempotencyLayer` and `MemoryStore`. The same meaning replays the first answer; another
//! meaning is a 422 and never reaches the handler.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{Fingerprinting, IdempotencyLayer, JsonPointer, RequestBody};

fn request(content_type: &str, encoding: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post("/v1/orders?src=test")
        .header("idempotency-key", "key-1")
        .header("content-type", content_type);
    if let Some(e) = encoding {
        req = req.header("content-encoding", e);
    }
    req.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

fn json(body: &str) -> Request<Full<Bytes>> {
    request("application/json", None, body)
}

/// Sends `first` then `second` with the same key; returns the second status, whether it
/// was a replay, and how many times the handler ran.
async fn twice(
    layer: IdempotencyLayer,
    first: Request<Full<Bytes>>,
    second: Request<Full<Bytes>>,
) -> (StatusCode, bool, usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let mut svc = layer.layer(service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let counter = counter.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            let mut res = Response::new(Full::new(Bytes::from(format!(
                "run {n}: {} bytes",
                body.len()
            ))));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        }
    }));
    let res = svc.ready().await.unwrap().call(first).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let res = svc.ready().await.unwrap().call(second).await.unwrap();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    (res.status(), replayed, calls.load(Ordering::SeqCst))
}

fn layer() -> IdempotencyLayer {
    IdempotencyLayer::new(MemoryStore::new()).unscoped()
}

async fn assert_replays(first: Request<Full<Bytes>>, second: Request<Full<Bytes>>) {
    assert_eq!(
        twice(layer(), first, second).await,
        (StatusCode::CREATED, true, 1)
    );
}

async fn assert_mismatch(first: Request<Full<Bytes>>, second: Request<Full<Bytes>>) {
    let (status, replayed, calls) = twice(layer(), first, second).await;
    assert_eq!(
        (status, replayed, calls),
        (StatusCode::UNPROCESSABLE_ENTITY, false, 1)
    );
}

#[tokio::test]
async fn one_number_in_two_spellings_replays() {
    assert_replays(
        json(r#"{"wei":1e21}"#),
        json(r#"{ "wei": 1000000000000000000000 }"#),
    )
    .await;
    assert_replays(json("[1.50, 2E-3]"), json("[1.5, 0.002]")).await;
}

#[tokio::test]
async fn a_64_bit_id_in_a_reserialised_body_replays() {
    // Beyond 2^53: hashed exactly, so key order and whitespace no longer matter.
    assert_replays(
        json(r#"{"id":18446744073709551615,"amount":5}"#),
        json(r#"{ "amount": 5, "id": 18446744073709551615 }"#),
    )
    .await;
}

#[tokio::test]
async fn integers_that_share_a_double_stay_apart() {
    assert_mismatch(
        json(r#"{"id":9007199254740993}"#),
        json(r#"{"id":9007199254740992}"#),
    )
    .await;
    assert_mismatch(json("[0.1]"), json("[0.1000000000000000000001]")).await;
}

#[tokio::test]
async fn escapes_and_key_order_replay_and_lone_surrogates_stay_apart() {
    assert_replays(
        json(r#"{"b":"\u00e9","a":"\/"}"#),
        json("{\"a\":\"/\",\"b\":\"\u{e9}\"}"),
    )
    .await;
    assert_mismatch(json(r#"["\ud800"]"#), json(r#"["\udc00"]"#)).await;
}

#[tokio::test]
async fn repeated_form_names_keep_their_order() {
    let form = |body| request("application/x-www-form-urlencoded", None, body);
    assert_mismatch(form("a=1&a=2"), form("a=2&a=1")).await;
    assert_replays(form("b=0&a=1&a=2"), form("a=1&b=0&a=2")).await;
}

#[tokio::test]
async fn charset_and_content_encoding_count() {
    let form = |ct| request(ct, None, "name=%E9");
    assert_mismatch(
        form("application/x-www-form-urlencoded; charset=iso-8859-1"),
        form("application/x-www-form-urlencoded; charset=utf-8"),
    )
    .await;
    assert_replays(
        form("application/x-www-form-urlencoded; charset=UTF-8"),
        form("Application/X-WWW-Form-Urlencoded;charset=\"utf-8\""),
    )
    .await;
    let body = r#"{"a":1}"#;
    assert_mismatch(
        request("application/json", Some("x-custom"), body),
        request("application/json", None, body),
    )
    .await;
}

#[tokio::test]
async fn excluded_fields_still_leave_the_fingerprint() {
    let layer = || {
        layer().with_fingerprint(
            Fingerprinting::default().exclude_field(JsonPointer::parse("/meta/sent_at").unwrap()),
        )
    };
    let (status, replayed, calls) = twice(
        layer(),
        json(r#"{"id":9007199254740993,"meta":{"sent_at":"10:00"}}"#),
        json(r#"{"meta":{"sent_at":"10:01"},"id":9007199254740993}"#),
    )
    .await;
    assert_eq!((status, replayed, calls), (StatusCode::CREATED, true, 1));
    let (status, _, calls) = twice(
        layer(),
        json(r#"{"id":1,"meta":{"sent_at":"10:00"}}"#),
        json(r#"{"id":2,"meta":{"sent_at":"10:00"}}"#),
    )
    .await;
    assert_eq!((status, calls), (StatusCode::UNPROCESSABLE_ENTITY, 1));
}

/// A JSON body whose keys are not UTF-8, in an object of more than 16 members: the
/// canonicaliser's sort panicked on it (found by the fuzz target). It is hashed raw: the same
/// bytes replay, other bytes are another request.
#[tokio::test]
async fn keys_that_are_not_utf8_are_answered_and_hashed_raw() {
    let body: &[u8] = b"{\"\xb8\":2,\"a``````\xb8b\":2,\"b\":2,\"\":2,\"\":2,\"\":2,\"a``````\xffb\":2,\"\x84\":2,\"\x84\":2,\"\xb8\":2,\"\x84\":2,\"\":2,\"\":2,\"\":2,\"a\":2,\"\x84\":2,\"a``````\x84\x84\":2,\"\x84\":2,\"\":2,\"b\":2,\"\":3}";
    let raw = |body: &[u8]| {
        Request::post("/v1/orders")
            .header("idempotency-key", "key-1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .unwrap()
    };
    assert_replays(raw(body), raw(body)).await;
    let mut other = body.to_vec();
    *other.last_mut().unwrap() = b' ';
    other.push(b'}');
    assert_mismatch(raw(body), raw(&other)).await;
}
