//! The layer over Redis and Postgres through a TCP fault proxy: lost replies, replies past the
//! store deadline, a partitioned or refusing store, a failing complete, and healing.

use crate::support;
use crate::support::backend as common;
#[cfg(feature = "postgres")]
use crate::support::pg as pg_support;
use crate::support::proxy;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use proxy::{Dir, FaultProxy, Mode};
use support::{body_bytes, post};
use tokio::sync::Notify;
use tower::{service_fn, util::BoxCloneService, Layer, ServiceExt};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyLayer, RequestBody, ResponseBody, Timing};

type Svc = BoxCloneService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, Infallible>;

/// A short lease keeps the fault cases quick: store deadline 250 ms, renewals every 500 ms.
fn timing() -> Timing {
    Timing::new(Duration::from_millis(1500), Duration::from_secs(60)).unwrap()
}

/// Counts runs; on `/gated` signals `started` and waits for `gate`.
struct App {
    runs: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: Arc<Notify>,
    svc: Svc,
}

fn app(store: Arc<dyn IdempotencyStore>) -> App {
    let (runs, started, gate) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
    );
    let inner = {
        let (runs, started, gate) = (runs.clone(), started.clone(), gate.clone());
        service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                if req.uri().path() == "/gated" {
                    started.notify_one();
                    gate.notified().await;
                }
                let mut res = Response::new(Full::new(Bytes::from(format!("pay_{n}"))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        })
    };
    let svc = BoxCloneService::new(
        IdempotencyLayer::from_arc(store)
            .unscoped()
            .with_timing(timing())
            .layer(inner),
    );
    App {
        runs,
        started,
        gate,
        svc,
    }
}

async fn send(svc: &Svc, path: &str, key: &str) -> (StatusCode, bool, Bytes) {
    call(svc.clone(), path, key).await
}

async fn call(svc: Svc, path: &str, key: &str) -> (StatusCode, bool, Bytes) {
    let res = svc.oneshot(post(path, Some(key), "{}")).await.unwrap();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    (res.status(), replayed, body_bytes(res).await)
}

/// Retries `key` through a healthy store until it is settled (neither 409 nor 503); returns
/// that answer.
async fn settle(svc: &Svc, path: &str, key: &str) -> (StatusCode, bool, Bytes) {
    for _ in 0..200 {
        let a = send(svc, path, key).await;
        if a.0 != StatusCode::CONFLICT && a.0 != StatusCode::SERVICE_UNAVAILABLE {
            return a;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} never settled");
}

fn unique(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{label}-{}-{nanos}", std::process::id())
}

/// Every fault on one store, one fresh key each. Returns the faults the proxy injected.
async fn faults(label: &str, proxy: &FaultProxy, store: Arc<dyn IdempotencyStore>) -> u64 {
    let a = app(store);
    let run = unique(label);
    // Warm up: connections open, scripts and statements cached.
    let warm = format!("{run}-warm");
    assert_eq!(send(&a.svc, "/pay", &warm).await.0, StatusCode::CREATED);
    let mut runs = 1;

    // A claim whose reply is lost with its connection: the store reads back, so the key runs
    // at most once, and once settled it replays.
    let key = format!("{run}-lost-claim-reply");
    let faults = proxy.faults();
    proxy.set(Dir::Down, Mode::LoseNextThenCut);
    let first = send(&a.svc, "/pay", &key).await;
    assert!(proxy.faults() > faults, "{key}: no reply was lost");
    proxy.heal();
    assert!(
        [StatusCode::CREATED, StatusCode::SERVICE_UNAVAILABLE].contains(&first.0),
        "{key}: {first:?}"
    );
    let settled = settle(&a.svc, "/pay", &key).await;
    runs += 1;
    assert_eq!(a.runs.load(Ordering::SeqCst), runs, "{key}: ran twice");
    assert_eq!(settled.0, StatusCode::CREATED);
    if first.0 == StatusCode::CREATED {
        assert_eq!((settled.1, &settled.2), (true, &first.2));
    }
    eprintln!("{label}: lost claim reply: first answer {}", first.0);

    // A claim reply delayed past the store deadline: 503, nothing run; the late claim is
    // released (or lapses), then one run and replays.
    let key = format!("{run}-late-claim-reply");
    proxy.set(Dir::Down, Mode::Delay(Duration::from_millis(600)));
    let first = send(&a.svc, "/pay", &key).await;
    assert_eq!(first.0, StatusCode::SERVICE_UNAVAILABLE, "{key}: {first:?}");
    assert_eq!(a.runs.load(Ordering::SeqCst), runs, "{key}: ran on a 503");
    proxy.heal();
    let settled = settle(&a.svc, "/pay", &key).await;
    runs += 1;
    assert_eq!((settled.0, settled.1), (StatusCode::CREATED, false));
    assert_eq!(
        send(&a.svc, "/pay", &key).await,
        (StatusCode::CREATED, true, settled.2)
    );
    assert_eq!(a.runs.load(Ordering::SeqCst), runs);

    // Store partitioned (requests held, up direction): every keyed request is 503 at the store
    // deadline and nothing runs. The held commands reach the store on heal.
    proxy.set(Dir::Up, Mode::Blackhole);
    for i in 0..5 {
        let a503 = send(&a.svc, "/pay", &format!("{run}-partitioned-{i}")).await;
        assert_eq!(a503.0, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(a.runs.load(Ordering::SeqCst), runs, "ran while partitioned");
    proxy.heal();

    // Store down: connections reset and new ones refused. 503, nothing runs.
    proxy.refuse(true);
    proxy.reset();
    for i in 0..5 {
        let a503 = send(&a.svc, "/pay", &format!("{run}-down-{i}")).await;
        assert_eq!(a503.0, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(
        a.runs.load(Ordering::SeqCst),
        runs,
        "ran while the store was down"
    );
    // Healed: the same layer and store serve again, without a restart.
    proxy.heal();
    let key = format!("{run}-after-heal");
    let healed = settle(&a.svc, "/pay", &key).await;
    runs += 1;
    assert_eq!((healed.0, healed.1), (StatusCode::CREATED, false));
    assert_eq!(
        send(&a.svc, "/pay", &key).await,
        (StatusCode::CREATED, true, healed.2)
    );

    // Complete fails for a while within the lease (DESIGN step 8): retried, then recorded;
    // the client gets the first answer and a retry replays it.
    let key = format!("{run}-complete-blip");
    let task = {
        let (svc, key) = (a.svc.clone(), key.clone());
        tokio::spawn(async move { call(svc, "/gated", &key).await })
    };
    a.started.notified().await;
    proxy.set(Dir::Up, Mode::Blackhole);
    proxy.reset();
    a.gate.notify_one();
    tokio::time::sleep(Duration::from_millis(400)).await;
    proxy.heal();
    let answered = task.await.unwrap();
    runs += 1;
    assert_eq!((answered.0, answered.1), (StatusCode::CREATED, false));
    assert_eq!(
        settle(&a.svc, "/gated", &key).await,
        (StatusCode::CREATED, true, answered.2)
    );
    assert_eq!(a.runs.load(Ordering::SeqCst), runs);

    // Complete cannot reach the store for the whole lease: the client is answered anyway
    // (by the lease end), never with a 5xx, and the key is never replayed with anything but
    // that answer; a retry after the lease may take over (the documented window).
    let key = format!("{run}-complete-cut-off");
    let task = {
        let (svc, key) = (a.svc.clone(), key.clone());
        tokio::spawn(async move { call(svc, "/gated", &key).await })
    };
    a.started.notified().await;
    proxy.refuse(true);
    proxy.reset();
    a.gate.notify_one();
    let answered = task.await.unwrap();
    runs += 1;
    assert_eq!((answered.0, answered.1), (StatusCode::CREATED, false));
    proxy.heal();
    a.gate.notify_one(); // in case the retry takes over and runs the gated handler
    let after = settle(&a.svc, "/gated", &key).await;
    assert_eq!(after.0, StatusCode::CREATED);
    if after.1 {
        assert_eq!(after.2, answered.2, "{key}: replayed another answer");
    } else {
        runs += 1;
        eprintln!("{label}: complete cut off past the lease: the retry took over");
    }
    assert_eq!(a.runs.load(Ordering::SeqCst), runs);
    proxy.faults()
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_behind_a_fault_proxy_never_runs_twice_and_recovers() {
    use tower_idempotency::store::redis::RedisStore;
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let upstream = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = FaultProxy::start(&upstream).await;
    let store = RedisStore::builder()
        .with_key_prefix(format!("{}:", unique("faults-redis")))
        .connect(&format!("redis://127.0.0.1:{}/", proxy.port))
        .await
        .unwrap();
    let n = faults("redis", &proxy, Arc::new(store)).await;
    eprintln!("redis: {n} faults injected; no key ran twice except across the cut-off lease");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_behind_a_fault_proxy_never_runs_twice_and_recovers() {
    use tower_idempotency::store::postgres::PostgresStore;
    let Some(url) = pg_support::url() else { return };
    let cfg = pg_support::config(&url);
    let host = match cfg.get_hosts().first() {
        Some(tower_idempotency::store::postgres::tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let proxy = FaultProxy::start(&format!("{host}:{port}")).await;
    let schema = pg_support::TestSchema::create(&url, "faults").await;
    let mut via = tower_idempotency::store::postgres::tokio_postgres::Config::new();
    via.host("127.0.0.1")
        .port(proxy.port)
        .user(cfg.get_user().unwrap_or("postgres"))
        .dbname(cfg.get_dbname().unwrap_or("postgres"));
    if let Some(p) = cfg.get_password() {
        via.password(p);
    }
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pg_support::pool_from(via, 4, "tidem-faults"));
    store.migrate().await.unwrap();
    let n = faults("postgres", &proxy, Arc::new(store)).await;
    eprintln!("postgres: {n} faults injected; no key ran twice except across the cut-off lease");
    drop(proxy);
    schema.drop_now().await;
}
