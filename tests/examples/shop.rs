//! The shop example through its axum `Router`: the API other tests and the README rely on.

use crate::app;
use crate::example_env;
use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{Request, Response};
use support::{body_bytes, body_json};
use tokio::sync::Barrier;
use tower::ServiceExt;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Timing;

fn shop() -> (Router, Arc<app::Shop>) {
    let config = app::ShopConfig {
        card_latency: Duration::from_millis(50),
        timing: Timing::default(),
    };
    app::app(Arc::new(MemoryStore::new()), config)
}

fn pay(key: Option<&str>, api_key: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::post("/v1/payments").header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    if let Some(k) = api_key {
        b = b.header("x-api-key", k);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

async fn send(router: &Router, req: Request<Body>) -> Response<Body> {
    router.clone().oneshot(req).await.unwrap()
}

async fn charges(router: &Router) -> u64 {
    let res = send(
        router,
        Request::get("/v1/charges").body(Body::empty()).unwrap(),
    )
    .await;
    body_json(res).await["count"].as_u64().unwrap()
}

/// Paused time: the card network's 50 ms only pass once every task is idle, so all 20
/// duplicates have claimed (and 19 answered) before the first payment can finish.
#[tokio::test(start_paused = true)]
async fn twenty_simultaneous_duplicates_charge_once_then_replay_then_422() {
    let (router, shop) = shop();
    let barrier = Arc::new(Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (router, barrier) = (router.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let res = send(
                    &router,
                    pay(
                        Some("double-click"),
                        None,
                        r#"{"amount":1000,"currency":"EUR"}"#,
                    ),
                )
                .await;
                let status = res.status().as_u16();
                (
                    status,
                    res.headers().get("retry-after").cloned(),
                    body_bytes(res).await,
                )
            })
        })
        .collect();
    let mut by_status = BTreeMap::new();
    let mut created = None;
    for t in tasks {
        let (status, retry_after, body) = t.await.unwrap();
        *by_status.entry(status).or_insert(0) += 1;
        match status {
            201 => created = Some(body),
            409 => assert!(retry_after.is_some(), "409 carries Retry-After"),
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(by_status, BTreeMap::from([(201, 1), (409, 19)]));
    assert_eq!(shop.charges(), 1);

    let created: serde_json::Value = serde_json::from_slice(&created.unwrap()).unwrap();
    assert!(created["id"].as_str().unwrap().starts_with("pay_"));
    let replay = send(
        &router,
        pay(
            Some("double-click"),
            None,
            r#"{"currency":"EUR","amount":1000}"#,
        ),
    )
    .await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(body_json(replay).await, created);

    let changed = send(
        &router,
        pay(
            Some("double-click"),
            None,
            r#"{"amount":2000,"currency":"EUR"}"#,
        ),
    )
    .await;
    assert_eq!(changed.status(), 422);
    assert_eq!(charges(&router).await, 1);
}

#[tokio::test]
async fn invalid_payments_are_400_and_not_recorded() {
    let (router, shop) = shop();
    for body in [
        r#"{"amount":0,"currency":"EUR"}"#,
        r#"{"amount":-5,"currency":"EUR"}"#,
        r#"{"currency":"EUR"}"#,
        r#"{"amount":"1","currency":"EUR"}"#,
        r#"{"amount":1,"currency":"EURO"}"#,
        "not json",
    ] {
        let res = send(&router, pay(Some("bad"), None, body)).await;
        assert_eq!(res.status(), 400, "{body}");
        assert!(
            res.headers().get("idempotent-replayed").is_none(),
            "{body}: released, not replayed"
        );
    }
    // The key was released each time, so a valid request under it now runs.
    let res = send(
        &router,
        pay(Some("bad"), None, r#"{"amount":1,"currency":"EUR"}"#),
    )
    .await;
    assert_eq!(res.status(), 201);
    assert_eq!(shop.charges(), 1);
}

#[tokio::test]
async fn a_decline_is_recorded_and_a_network_outage_is_released() {
    let (router, _) = shop();
    let declined = send(
        &router,
        pay(Some("d"), None, r#"{"amount":402,"currency":"EUR"}"#),
    )
    .await;
    assert_eq!(declined.status(), 402);
    assert_eq!(body_json(declined).await["error"], "card_declined");
    let again = send(
        &router,
        pay(Some("d"), None, r#"{"amount":402,"currency":"EUR"}"#),
    )
    .await;
    assert_eq!(
        (
            again.status().as_u16(),
            &again.headers()["idempotent-replayed"]
        ),
        (402, &"true".parse::<http::HeaderValue>().unwrap())
    );

    let outage = send(
        &router,
        pay(Some("o"), None, r#"{"amount":503,"currency":"EUR"}"#),
    )
    .await;
    assert_eq!(outage.status(), 503);
    assert_eq!(body_json(outage).await["error"], "card_network_unavailable");
    let retry = send(
        &router,
        pay(Some("o"), None, r#"{"amount":503,"currency":"EUR"}"#),
    )
    .await;
    assert_eq!(retry.status(), 503);
    assert!(
        retry.headers().get("idempotent-replayed").is_none(),
        "released: the retry ran again"
    );
}

#[tokio::test]
async fn a_malformed_api_key_is_401_and_never_the_anonymous_caller() {
    let (router, shop) = shop();
    let body = r#"{"amount":10,"currency":"EUR"}"#;
    let anon = send(&router, pay(Some("k"), None, body)).await;
    assert_eq!(anon.status(), 201, "no key: the anonymous caller");
    for bad in [&b"bob\xff"[..], b"", b"has space", &[b'a'; 129]] {
        let mut req = pay(Some("k"), None, body);
        req.headers_mut()
            .insert("x-api-key", http::HeaderValue::from_bytes(bad).unwrap());
        let res = send(&router, req).await;
        assert_eq!(res.status(), 401, "{bad:?}");
        assert!(res.headers().get("idempotent-replayed").is_none());
    }
    let mut twice = pay(Some("k"), Some("alice"), body);
    twice
        .headers_mut()
        .append("x-api-key", http::HeaderValue::from_static("bob"));
    assert_eq!(send(&router, twice).await.status(), 401);
    assert_eq!(shop.charges(), 1);
}

#[tokio::test]
async fn api_keys_scope_idempotency_keys() {
    let (router, shop) = shop();
    let a = body_json(
        send(
            &router,
            pay(
                Some("k"),
                Some("alice"),
                r#"{"amount":10,"currency":"EUR"}"#,
            ),
        )
        .await,
    )
    .await;
    let b = body_json(
        send(
            &router,
            pay(Some("k"), Some("bob"), r#"{"amount":10,"currency":"EUR"}"#),
        )
        .await,
    )
    .await;
    let anon = body_json(
        send(
            &router,
            pay(Some("k"), None, r#"{"amount":10,"currency":"EUR"}"#),
        )
        .await,
    )
    .await;
    assert_ne!(a["id"], b["id"]);
    assert_ne!(a["id"], anon["id"]);
    assert_eq!(shop.charges(), 3);
    let a_again = body_json(
        send(
            &router,
            pay(
                Some("k"),
                Some("alice"),
                r#"{"amount":10,"currency":"EUR"}"#,
            ),
        )
        .await,
    )
    .await;
    assert_eq!(a, a_again);
    assert_eq!(shop.charges(), 3);
}

#[tokio::test]
async fn orders_are_idempotent_and_charges_need_no_key() {
    let (router, _) = shop();
    let order = |key: &str| {
        Request::post("/v1/orders")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(r#"{"items":[{"sku":"tea","qty":2}]}"#))
            .unwrap()
    };
    let first = send(&router, order("o1")).await;
    assert_eq!(first.status(), 201);
    let first = body_json(first).await;
    assert!(first["id"].as_str().unwrap().starts_with("ord_"));
    assert_eq!(body_json(send(&router, order("o1")).await).await, first);
    let missing = Request::post("/v1/orders").body(Body::from("{}")).unwrap();
    assert_eq!(send(&router, missing).await.status(), 400);
    assert_eq!(charges(&router).await, 0);
}

#[test]
fn shop_config_defaults_match_the_documented_values() {
    let vars = [
        "CARD_LATENCY_MS",
        "IDEMPOTENCY_LEASE_MS",
        "IDEMPOTENCY_TTL_SECS",
    ];
    if vars.iter().any(|v| std::env::var_os(v).is_some()) {
        eprintln!("SKIPPED: a shop env var is set in this environment");
        return;
    }
    let (card_latency, timing) = example_env::settings_from_env().unwrap();
    assert_eq!(card_latency, Duration::from_millis(50));
    assert_eq!(timing, Timing::default());
    assert_eq!(
        (timing.lease(), timing.ttl()),
        (Duration::from_secs(30), Duration::from_secs(86_400))
    );
}
