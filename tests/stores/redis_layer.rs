//! `IdempotencyLayer` over `RedisStore`: what a client sees when Redis is slow, full or down.
use crate::support;
use crate::support::backend as common;
use crate::support::redis_harness;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use redis_harness::RedisServer;
use support::{body_bytes, post};
use tokio::sync::{Barrier, Notify};
use tower::{service_fn, util::BoxCloneService, Layer, ServiceExt};
use tower_idempotency::store::redis::{redis, RedisStore};
use tower_idempotency::{
    store::{Completion, RecordId},
    ErrorKind, IdempotencyError, IdempotencyLayer, RequestBody, ResponseBody,
};

type Svc = BoxCloneService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, Infallible>;

/// A handler that counts its calls and, on `/gated`, waits for `gate`.
fn service(store: RedisStore, calls: Arc<AtomicUsize>, gate: Arc<Notify>) -> Svc {
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        let gate = gate.clone();
        async move {
            if req.uri().path() == "/gated" {
                gate.notified().await;
            }
            let mut res = Response::new(Full::new(Bytes::from(format!("pay_{n}"))));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        }
    });
    BoxCloneService::new(IdempotencyLayer::new(store).unscoped().layer(inner))
}

fn unique(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{label}-{}-{nanos}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_duplicates_over_redis_run_once() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let (calls, gate) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
    let svc = service(store, calls.clone(), gate.clone());
    let key = unique("double-click");
    let barrier = Arc::new(Barrier::new(20));
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..20 {
        let (svc, barrier, key, done_tx) =
            (svc.clone(), barrier.clone(), key.clone(), done_tx.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let res = svc.oneshot(post("/gated", Some(&key), "{}")).await.unwrap();
            let status = res.status().as_u16();
            done_tx.send((status, body_bytes(res).await)).unwrap();
        });
    }
    // 19 answers come back while the winner is held at the gate; then let it finish.
    let mut by_status = BTreeMap::new();
    for _ in 0..19 {
        let (status, _) = done_rx.recv().await.unwrap();
        *by_status.entry(status).or_insert(0) += 1;
    }
    assert_eq!(by_status, BTreeMap::from([(409, 19)]));
    gate.notify_one();
    let (status, body) = done_rx.recv().await.unwrap();
    assert_eq!((status, body), (201, Bytes::from("pay_1")));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let replay = svc.oneshot(post("/gated", Some(&key), "{}")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(replay).await, "pay_1");
}

#[tokio::test]
async fn a_full_redis_answers_503_without_running_and_still_replays() {
    let Some(server) =
        RedisServer::start(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"])
    else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = service(store, calls.clone(), Arc::new(Notify::new()));
    assert_eq!(
        svc.clone()
            .oneshot(post("/x", Some("old"), "{}"))
            .await
            .unwrap()
            .status(),
        201
    );

    // Fill Redis behind the layer's back, then hold it below what it uses.
    let filler = "x".repeat(4096);
    for i in 0.. {
        let out = server.cli(&["set", &format!("filler:{i}"), &filler]);
        if out.contains("OOM") {
            break;
        }
        assert!(i < 10_000, "Redis never filled up");
    }
    let used: u64 = server
        .cli(&["info", "memory"])
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    server.cli(&[
        "config",
        "set",
        "maxmemory",
        &(used - 512 * 1024).to_string(),
    ]);

    let res = svc
        .clone()
        .oneshot(post("/x", Some("new"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(
        res.extensions().get::<IdempotencyError>().unwrap().kind(),
        ErrorKind::StoreUnavailable
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the inner service did not run for the new key"
    );

    let replay = svc.oneshot(post("/x", Some("old"), "{}")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(replay).await, "pay_1");
}

#[tokio::test]
async fn a_restarting_redis_fails_closed_then_serves_after_the_reconnect() {
    let Some(mut server) = RedisServer::start(&[]) else {
        return;
    };
    let store = RedisStore::builder()
        .with_timeout(Duration::from_millis(500))
        .connect(&server.url())
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = service(store, calls.clone(), Arc::new(Notify::new()));
    assert_eq!(
        svc.clone()
            .oneshot(post("/x", Some("before"), "{}"))
            .await
            .unwrap()
            .status(),
        201
    );

    server.stop();
    let res = svc
        .clone()
        .oneshot(post("/x", Some("during"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), 503, "fail closed while Redis is down");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let res = svc
            .clone()
            .oneshot(post("/x", Some("during"), "{}"))
            .await
            .unwrap();
        if res.status() == 201 {
            break;
        }
        assert_eq!(res.status(), 503);
        assert!(Instant::now() < deadline, "never reconnected");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the retried key ran once after the restart"
    );
    let replay = svc.oneshot(post("/x", Some("during"), "{}")).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// A tenant over its Redis quota gets 429; its earlier request still replays, and another
/// tenant is served.
#[tokio::test]
async fn a_tenant_over_its_redis_quota_gets_429_and_others_are_served() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::builder()
        .with_key_prefix(unique("quota-layer").replace(['{', '}'], "") + ":")
        .with_max_records_per_scope(std::num::NonZeroUsize::new(1).unwrap())
        .connect(&url)
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = support::counting_payments(calls.clone());
    let svc = IdempotencyLayer::new(store)
        .with_scope(support::tenant_scope)
        .layer(inner);
    let (alice, bob) = (unique("alice"), unique("bob"));
    let send = |tenant: &str, key: &str| {
        let mut req = post("/pay", Some(key), "{}");
        req.headers_mut()
            .insert("x-tenant", tenant.parse().unwrap());
        svc.clone().oneshot(req)
    };
    let first = send(&alice, "k1").await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let over = send(&alice, "k2").await.unwrap();
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        over.extensions()
            .get::<IdempotencyError>()
            .map(|e| e.kind()),
        Some(ErrorKind::QuotaExceeded)
    );
    let again = send(&alice, "k1").await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        send(&bob, "k1").await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "alice once, bob once");
}

/// A completed answer as `Completion::encode` lays it out (status 201, no body, no
/// trailers) whose header map holds `count` well-formed fields: far more than the decoder
/// accepts, and more than an `http::HeaderMap` can hold (appending them all would panic).
fn completion_with_fields(count: u32) -> Vec<u8> {
    let mut out = vec![1, 0]; // format version 1, kind: response
    out.extend_from_slice(&201u16.to_be_bytes());
    out.extend_from_slice(&count.to_be_bytes());
    for i in 0..count {
        let name = format!("x-{i}");
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&1u32.to_be_bytes());
        out.push(b'v');
    }
    out.extend_from_slice(&0u32.to_be_bytes()); // empty body
    out.push(0); // no trailers
    out
}

/// A record in Redis whose answer carries more header fields than the decoder allows: a
/// retry of its key gets a clean 503 problem (the store is treated as broken for it), never
/// a panic, and the handler does not run again.
#[tokio::test]
async fn a_stored_answer_with_too_many_header_fields_is_a_503_problem_not_a_panic() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::builder()
        .with_key_prefix(unique("hostile-layer") + ":")
        .connect(&url)
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = service(store.clone(), calls.clone(), Arc::new(Notify::new()));
    let key = unique("hostile");
    let first = svc
        .clone()
        .oneshot(post("/x", Some(&key), "{}"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(body_bytes(first).await, "pay_1");

    // The record the layer completed: a plain (format `2`) record, 82 header bytes, then
    // the encoded answer.
    let redis_key = store.key(&RecordId::new(None, &key));
    let mut con = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(&redis_key)
        .query_async(&mut con)
        .await
        .unwrap();
    const HEADER: usize = 82;
    assert_eq!(&stored[..2], b"2c", "a completed plain record");
    match Completion::decode(Bytes::copy_from_slice(&stored[HEADER..])).unwrap() {
        Completion::Response(r) => assert_eq!(r.body, "pay_1"),
        other @ Completion::Tombstone { .. } => panic!("expected a response, got {other:?}"),
    }

    // Same record header (fingerprint, token, state), crafted answer; the TTL stays.
    let mut overwrite = async |fields: u32| {
        let mut value = stored[..HEADER].to_vec();
        value.extend_from_slice(&completion_with_fields(fields));
        let () = redis::cmd("SET")
            .arg(&redis_key)
            .arg(value.as_slice())
            .arg("KEEPTTL")
            .query_async(&mut con)
            .await
            .unwrap();
    };

    // The crafted layout is right: with a few fields it replays as written.
    overwrite(3).await;
    let replay = svc
        .clone()
        .oneshot(post("/x", Some(&key), "{}"))
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["x-2"], "v");
    assert!(body_bytes(replay).await.is_empty());

    // Past the decoder's field cap.
    overwrite(30_000).await;

    for _ in 0..2 {
        let res = svc
            .clone()
            .oneshot(post("/x", Some(&key), "{}"))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()["retry-after"], "1");
        support::assert_problem(res, ErrorKind::StoreUnavailable).await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "never run again");

    // Other keys on the same store are unaffected.
    let other = svc
        .clone()
        .oneshot(post("/x", Some(&unique("fine")), "{}"))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::CREATED);

    let _: i64 = redis::cmd("DEL")
        .arg(&redis_key)
        .query_async(&mut con)
        .await
        .unwrap();
}
