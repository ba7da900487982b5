//! `IdempotencyLayer` over `PostgresStore`: duplicates, connections while a handler runs, and
//! a handler that records its answer inside its own transaction.
use crate::support;
use crate::support::pg as pg_support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use pg_support::{admin, store_in, TestSchema};
use support::{body_bytes, post};
use tokio::sync::{Barrier, Notify};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{
    ErrorKind, IdempotencyContext, IdempotencyLayer, RecordDecision, RequestBody,
};

const APP: &str = "tidem-layer";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_duplicates_run_once_and_no_connection_idles_in_a_transaction() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "layer64").await;
    let app_name = format!("{APP}-{}", schema.name);
    let store = store_in(&url, &schema, 16, &app_name).await;
    let (calls, gate, started) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
    );
    let inner = {
        let (calls, gate, started) = (calls.clone(), gate.clone(), started.clone());
        service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let (gate, started) = (gate.clone(), started.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                let mut res = Response::new(Full::new(Bytes::from(format!("pay_{n}"))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        })
    };
    let svc = IdempotencyLayer::new(store).unscoped().layer(inner);
    let barrier = Arc::new(Barrier::new(64));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..64 {
        let (svc, barrier, tx) = (svc.clone(), barrier.clone(), tx.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let res = svc
                .oneshot(post("/pay", Some("dup-64"), "{}"))
                .await
                .unwrap();
            tx.send((res.status().as_u16(), body_bytes(res).await))
                .unwrap();
        });
    }
    started.notified().await;
    let mut by_status = BTreeMap::new();
    for _ in 0..63 {
        let (status, _) = rx.recv().await.unwrap();
        *by_status.entry(status).or_insert(0) += 1;
    }
    assert_eq!(by_status, BTreeMap::from([(409, 63)]));

    // The winner's handler is still held at the gate: its claim committed, and none of the
    // store's connections sits in an open transaction meanwhile.
    let activity = admin(&url)
        .await
        .query(
            "SELECT state FROM pg_stat_activity WHERE application_name = $1",
            &[&app_name],
        )
        .await
        .unwrap();
    assert!(!activity.is_empty(), "the store's connections are visible");
    let states: Vec<Option<String>> = activity.iter().map(|r| r.get(0)).collect();
    assert!(
        states
            .iter()
            .all(|s| s.as_deref() != Some("idle in transaction")),
        "{states:?}"
    );

    gate.notify_one();
    let (status, body) = rx.recv().await.unwrap();
    assert_eq!((status, body), (201, Bytes::from("pay_1")));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let replay = svc
        .oneshot(post("/pay", Some("dup-64"), "{}"))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(replay).await, "pay_1");
    schema.drop_now().await;
}

/// A handler that inserts a payment and records its answer in the same transaction. The first
/// attempt rolls back (as if the business write failed) and answers 503.
async fn transactional_handler(
    store: Arc<PostgresStore>,
    payments: String,
    attempts: Arc<AtomicUsize>,
    req: Request<RequestBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
    let ctx = req
        .extensions()
        .get::<IdempotencyContext>()
        .unwrap()
        .clone();
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let id = format!("pay_{attempt}");
    tx.execute(&format!("INSERT INTO {payments} (id) VALUES ($1)"), &[&id])
        .await
        .unwrap();
    let body = Bytes::from(format!(r#"{{"id":"{id}"}}"#));
    let answer = Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(body.clone())
        .unwrap();
    store.record_in(&tx, &ctx, &answer).await.unwrap();
    if attempt == 1 {
        tx.rollback().await.unwrap();
        let mut res = Response::new(Full::new(Bytes::from_static(b"try again")));
        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        return Ok(res);
    }
    tx.commit().await.unwrap();
    let mut res = answer.map(Full::new);
    res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
    Ok(res)
}

#[tokio::test]
async fn a_handler_records_its_answer_in_its_own_transaction_or_not_at_all() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "layertx").await;
    let store = Arc::new(store_in(&url, &schema, 4, APP).await);
    let payments = format!("{}.payments", schema.name);
    admin(&url)
        .await
        .batch_execute(&format!("CREATE TABLE {payments} (id text PRIMARY KEY)"))
        .await
        .unwrap();
    let attempts = Arc::new(AtomicUsize::new(0));
    let inner = {
        let (store, payments, attempts) = (store.clone(), payments.clone(), attempts.clone());
        service_fn(move |req| {
            transactional_handler(store.clone(), payments.clone(), attempts.clone(), req)
        })
    };
    let svc = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .layer(inner);
    let count = || async {
        let row = admin(&url)
            .await
            .query_one(&format!("SELECT count(*) FROM {payments}"), &[])
            .await
            .unwrap();
        row.get::<_, i64>(0)
    };

    // Rolled back: no payment, no recorded answer, and the key runs again at once.
    let first = svc
        .clone()
        .oneshot(post("/pay", Some("tx-key"), "{}"))
        .await
        .unwrap();
    assert_eq!(first.status(), 503);
    assert_eq!(count().await, 0);
    let id = tower_idempotency::store::RecordId::new(None, "tx-key");
    // A released answer goes out after its release: the key is free when the client hears.
    assert!(
        store.get(&id).await.unwrap().is_none(),
        "released, nothing recorded"
    );

    // Committed: the payment and the answer together; the retry replays it.
    let second = svc
        .clone()
        .oneshot(post("/pay", Some("tx-key"), "{}"))
        .await
        .unwrap();
    assert_eq!(second.status(), 201);
    assert_eq!(body_bytes(second).await, r#"{"id":"pay_2"}"#);
    assert_eq!(count().await, 1);
    let replay = svc
        .oneshot(post("/pay", Some("tx-key"), "{}"))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["content-type"], "application/json");
    assert_eq!(body_bytes(replay).await, r#"{"id":"pay_2"}"#);
    assert_eq!((attempts.load(Ordering::SeqCst), count().await), (2, 1));
    schema.drop_now().await;
}

#[tokio::test]
async fn a_tenant_over_its_postgres_quota_gets_429_and_other_tenants_are_served() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "layerquota").await;
    let store = pg_support::store_with(&url, &schema, 4, APP, |b| {
        b.with_max_records_per_scope(NonZeroUsize::new(2).unwrap())
    })
    .await;
    store.verify().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = support::counting_payments(calls.clone());
    let svc = IdempotencyLayer::new(store)
        .with_scope(support::tenant_scope)
        .layer(inner);
    let send = |tenant: &str, key: &str| {
        let mut req = post("/pay", Some(key), "{}");
        req.headers_mut()
            .insert("x-tenant", tenant.parse().unwrap());
        svc.clone().oneshot(req)
    };

    for (key, body) in [("k1", "pay_1"), ("k2", "pay_2")] {
        let res = send("a", key).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED, "{key}");
        assert_eq!(body_bytes(res).await, body);
    }

    let over = send("a", "k3").await.unwrap();
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(over.headers()["cache-control"], "no-store");
    support::assert_problem(over, ErrorKind::QuotaExceeded).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the refused key did not run"
    );

    // Another tenant claims the same key text in its own scope.
    let other = send("b", "k3").await.unwrap();
    assert_eq!(other.status(), StatusCode::CREATED, "tenant b is served");
    assert!(other.headers().get("idempotent-replayed").is_none());
    assert_eq!(body_bytes(other).await, "pay_3");

    // The full tenant's existing key still replays.
    let replay = send("a", "k1").await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(replay).await, "pay_1");
    assert_eq!(calls.load(Ordering::SeqCst), 3, "a twice, b once");
    drop(svc);
    schema.drop_now().await;
}

/// Collects the text of every ERROR event, fields included.
#[derive(Clone, Default)]
struct Errors(Arc<std::sync::Mutex<String>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Text<'a>(&'a mut String);
        impl tracing::field::Visit for Text<'_> {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={v:?} ", f.name()));
            }
        }
        if *event.metadata().level() == tracing::Level::ERROR {
            event.record(&mut Text(&mut self.0.lock().unwrap()));
        }
    }
}

#[tokio::test]
async fn a_forgotten_migration_is_503_and_the_log_names_the_missing_table() {
    use tracing_subscriber::layer::SubscriberExt;
    let Some(url) = pg_support::url() else { return };
    let errors = Errors::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(errors.clone()));
    let table = format!("tidem_never_migrated_{}", std::process::id());
    let store = PostgresStore::builder()
        .with_table(&table)
        .unwrap()
        .build(pg_support::pool(&url, 2, APP));
    let verify = store.verify().await.expect_err("the table does not exist");
    assert!(verify.to_string().contains("migrate"), "{verify}");

    let svc = IdempotencyLayer::new(store).unscoped().layer(service_fn(
        |_req: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ran"))))
        },
    ));
    let res = svc.oneshot(post("/pay", Some("k"), "{}")).await.unwrap();
    assert_eq!(res.status(), 503);
    let log = errors.0.lock().unwrap().clone();
    assert!(
        log.contains("does not exist"),
        "the driver's cause reaches the log: {log}"
    );
}

#[tokio::test]
async fn an_answer_recorded_in_the_handlers_transaction_keeps_the_vary_guard() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "layervary").await;
    let store = Arc::new(store_in(&url, &schema, 4, APP).await);
    let calls = Arc::new(AtomicUsize::new(0));
    let inner = {
        let (store, calls) = (store.clone(), calls.clone());
        service_fn(
            move |req: Request<tower_idempotency::RequestBody<Full<Bytes>>>| {
                let (store, calls) = (store.clone(), calls.clone());
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let ctx = req
                        .extensions()
                        .get::<IdempotencyContext>()
                        .unwrap()
                        .clone();
                    let who = req.headers()["authorization"].to_str().unwrap().to_owned();
                    let answer = Response::builder()
                        .status(StatusCode::CREATED)
                        .header("vary", "authorization")
                        .body(Bytes::from(format!("private statement of {who}")))
                        .unwrap();
                    let mut client = store.pool().get().await.unwrap();
                    let tx = client.transaction().await.unwrap();
                    store.record_in(&tx, &ctx, &answer).await.unwrap();
                    tx.commit().await.unwrap();
                    let mut res = answer.map(Full::new);
                    res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
                    Ok::<_, Infallible>(res)
                }
            },
        )
    };
    let svc = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .layer(inner);
    let as_user = |who: &str| {
        let mut req = post("/statement", Some("vary-key"), "{}");
        req.headers_mut()
            .insert("authorization", who.parse().unwrap());
        req
    };
    let alice = svc.clone().oneshot(as_user("Bearer alice")).await.unwrap();
    assert_eq!(alice.status(), 201);
    let bob = svc.clone().oneshot(as_user("Bearer bob")).await.unwrap();
    assert_eq!(bob.status(), 422, "Alice's answer is not Bob's");
    assert!(!String::from_utf8_lossy(&body_bytes(bob).await).contains("alice"));
    let again = svc.clone().oneshot(as_user("Bearer alice")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(body_bytes(again).await, "private statement of Bearer alice");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    schema.drop_now().await;
}
