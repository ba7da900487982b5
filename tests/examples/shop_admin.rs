//! The shop's admin routes behind `ADMIN_TOKEN`: inspect, force-release, delete.

use crate::admin;
use crate::app;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http::{Request, Response};
use support::{body_bytes, body_json};
use tower::ServiceExt;
use tower_idempotency::store::{AdminStore, MemoryStore};
use tower_idempotency::Timing;

const TOKEN: &str = "s3cret-admin-token";

/// The shop as `main.rs` assembles it, on a memory store.
fn shop(admin_token: Option<&str>) -> Router {
    let store: Arc<dyn AdminStore> = Arc::new(MemoryStore::new());
    let config = app::ShopConfig {
        card_latency: Duration::from_millis(50),
        timing: Timing::default(),
    };
    let (router, _shop) = app::app(store.clone(), config);
    admin::mount_admin(router, store, admin_token.map(str::to_owned))
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

fn admin_req(method: &str, uri: &str, token: Option<&str>) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.body(Body::empty()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn admin_routes_inspect_release_and_delete_behind_the_token() {
    let router = shop(Some(TOKEN));
    let uri = "/admin/idempotency/anonymous/order-7";
    for token in [None, Some("wrong"), Some("s3cret-admin-tokeN")] {
        let res = send(&router, admin_req("GET", uri, token)).await;
        assert_eq!(res.status(), 401, "{token:?}");
    }
    assert_eq!(
        send(&router, admin_req("GET", uri, Some(TOKEN)))
            .await
            .status(),
        404
    );

    // In progress: the card network takes 50 ms (paused), so the claim is held.
    let paying = tokio::spawn({
        let router = router.clone();
        async move {
            send(
                &router,
                pay("order-7", r#"{"amount": 700, "currency": "EUR"}"#),
            )
            .await
        }
    });
    let info = loop {
        let res = send(&router, admin_req("GET", uri, Some(TOKEN))).await;
        if res.status() == 200 {
            break body_json(res).await;
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(info["state"], "in_progress");
    assert_eq!(info["generation"], 1);
    assert!(info["lease_remaining_ms"].as_u64().unwrap() > 0);
    let del = send(&router, admin_req("DELETE", uri, Some(TOKEN))).await;
    assert_eq!(del.status(), 409, "in progress needs ?force=true");
    let forced = send(
        &router,
        admin_req("DELETE", &format!("{uri}?force=true"), Some(TOKEN)),
    )
    .await;
    assert_eq!(forced.status(), 204);
    // The released holder still answers its client, but its record is fenced off.
    assert_eq!(paying.await.unwrap().status(), 201);
    assert_eq!(
        send(&router, admin_req("GET", uri, Some(TOKEN)))
            .await
            .status(),
        404
    );

    // Completed: status and size; a plain DELETE lets the key run again.
    let first = send(
        &router,
        pay("order-7", r#"{"amount": 700, "currency": "EUR"}"#),
    )
    .await;
    assert_eq!(first.status(), 201);
    let size = body_bytes(first).await.len() as u64;
    let info = body_json(send(&router, admin_req("GET", uri, Some(TOKEN))).await).await;
    assert_eq!(info["state"], "completed");
    assert_eq!(info["answer_status"], 201);
    assert_eq!(info["answer_size"], size);
    assert_eq!(info["expires_in_secs"], 86_400);
    assert_eq!(
        send(&router, admin_req("DELETE", uri, Some(TOKEN)))
            .await
            .status(),
        204
    );
    assert_eq!(
        send(&router, admin_req("DELETE", uri, Some(TOKEN)))
            .await
            .status(),
        404
    );
    // Another scope's key of the same name is another record.
    let other = "/admin/idempotency/api-key:someone/order-7";
    assert_eq!(
        send(&router, admin_req("GET", other, Some(TOKEN)))
            .await
            .status(),
        404
    );
}

#[tokio::test]
async fn without_admin_token_the_admin_routes_do_not_exist() {
    for token in [None, Some("")] {
        let router = shop(token);
        let res = send(
            &router,
            admin_req("GET", "/admin/idempotency/anonymous/k", Some("")),
        )
        .await;
        assert_eq!(res.status(), 404);
    }
}
