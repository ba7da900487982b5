//! The shop's `GET /metrics` after the README's curl walk-through.

use crate::admin;
use crate::app;
use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{Request, Response};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use support::body_bytes;
use tokio::sync::Barrier;
use tower::ServiceExt;
use tower_idempotency::store::{AdminStore, MemoryStore};
use tower_idempotency::Timing;

/// A Prometheus recorder of the walk-through's own, the default recorder of the test's thread.
/// The test runs on tokio's current-thread runtime, so every task it spawns records there, and
/// the counts are the walk-through's alone although other tests of this binary send the shop
/// requests too (and `operations` installs the global recorder). The admin routes are tested
/// in tests/examples/shop_admin.rs.
fn prometheus() -> PrometheusHandle {
    let recorder: &'static PrometheusRecorder =
        Box::leak(Box::new(PrometheusBuilder::new().build_recorder()));
    // Dropping the guard would restore the thread's previous default; the thread ends with
    // the test, so the recorder stays its default until then.
    #[allow(clippy::mem_forget)]
    std::mem::forget(metrics::set_default_local_recorder(recorder));
    recorder.handle()
}

/// The shop as `main.rs` assembles it with `--features metrics`, on a memory store.
fn shop(admin_token: Option<&str>) -> (Router, Arc<dyn AdminStore>) {
    let store: Arc<dyn AdminStore> = Arc::new(MemoryStore::new());
    let config = app::ShopConfig {
        card_latency: Duration::from_millis(50),
        timing: Timing::default(),
    };
    let (router, _shop) = app::app(store.clone(), config);
    let router = router.merge(admin::metrics_router(prometheus()));
    let router = admin::mount_admin(router, store.clone(), admin_token.map(str::to_owned));
    (router, store)
}

fn pay(key: &str, body: &str) -> Request<Body> {
    Request::post("/v1/payments")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(router: &Router, req: Request<Body>) -> Response<Body> {
    router.clone().oneshot(req).await.unwrap()
}

/// `name{labels} value` lines of the Prometheus text whose labels include `outcome`.
fn sample(text: &str, name: &str, outcome: &str) -> u64 {
    let want = format!("outcome=\"{outcome}\"");
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&want))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// The README's walk-through: 20 simultaneous duplicates, a replay, a changed amount. Paused
/// time holds the card network's 50 ms until all 20 have claimed or conflicted.
#[tokio::test(start_paused = true)]
async fn after_the_readme_walkthrough_metrics_show_one_executed_nineteen_conflicts() {
    let (router, _) = shop(None);
    let barrier = Arc::new(Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (router, barrier) = (router.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let res = send(
                    &router,
                    pay("order-1001", r#"{"amount": 1000, "currency": "EUR"}"#),
                );
                res.await.status().as_u16()
            })
        })
        .collect();
    let mut by_status = BTreeMap::new();
    for t in tasks {
        *by_status.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(by_status, BTreeMap::from([(201, 1), (409, 19)]));
    let replay = send(
        &router,
        pay("order-1001", r#"{"currency": "EUR", "amount": 1000}"#),
    )
    .await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["idempotency-key-ttl"], "86400");
    let changed = send(
        &router,
        pay("order-1001", r#"{"amount": 2000, "currency": "EUR"}"#),
    )
    .await;
    assert_eq!(changed.status(), 422);

    let res = send(
        &router,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(res.status(), 200);
    let text = String::from_utf8(body_bytes(res).await.to_vec()).unwrap();
    let total = "idempotency_requests_total";
    assert_eq!(sample(&text, total, "executed"), 1, "{text}");
    assert_eq!(sample(&text, total, "conflict"), 19, "{text}");
    assert_eq!(sample(&text, total, "replayed"), 1, "{text}");
    assert_eq!(sample(&text, total, "mismatch"), 1, "{text}");
    assert!(
        text.contains(r#"route="/v1/payments""#) && text.contains(r#"store="memory""#),
        "{text}"
    );
    assert!(
        text.contains("idempotency_store_duration_seconds"),
        "{text}"
    );
}
