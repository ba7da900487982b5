//! Rows of the rejected-input table (`guarantees` docs) that the other suites do not show
//! whole: a reused key leaves the first record exactly as it was.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use support::{body_bytes, body_json, post};
use tower::{Layer, ServiceExt};
use tower_idempotency::store::{IdempotencyStore, MemoryStore};
use tower_idempotency::{store::RecordId, ErrorKind, IdempotencyLayer};

#[tokio::test]
async fn a_reused_key_is_422_key_reused_and_leaves_the_first_record_as_it_was() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let inner = support::counting_payments(runs.clone());
    let svc = IdempotencyLayer::new(store.clone()).unscoped().layer(inner);
    let first = svc
        .clone()
        .oneshot(post("/x?a=1", Some("k"), r#"{"amount":100}"#))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first = body_bytes(first).await;
    let id = RecordId::new(None, "k");
    let before = store.get(&id).await.unwrap().expect("the first record");

    let patch = Request::patch("/x?a=1")
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount":100}"#)))
        .unwrap();
    for (label, req) in [
        ("body", post("/x?a=1", Some("k"), r#"{"amount":101}"#)),
        ("path", post("/y?a=1", Some("k"), r#"{"amount":100}"#)),
        ("query", post("/x?a=2", Some("k"), r#"{"amount":100}"#)),
        ("method", patch),
    ] {
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::UNPROCESSABLE_ENTITY, "{label}");
        assert_eq!(res.headers()["content-type"], "application/problem+json");
        assert_eq!(res.headers()["cache-control"], "no-store");
        let v = body_json(res).await;
        assert_eq!(v["type"], ErrorKind::Mismatch.type_uri(), "{label}");
        assert_eq!(
            store.get(&id).await.unwrap().as_ref(),
            Some(&before),
            "{label}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The first request still replays, byte for byte.
    let replay = svc
        .oneshot(post("/x?a=1", Some("k"), r#"{"amount":100}"#))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(replay).await, first);
}
