//! The shop's `GET /openapi.json` (the `utoipa` feature): the layer's contract on the
//! protected routes, and on them only. `.ci/run` validates the same document with
//! `openapi-spec-validator`.

use crate::app;
use crate::support::body_json;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use serde_json::Value;
use tower::ServiceExt;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Timing;

async fn served_document() -> Value {
    let config = app::ShopConfig {
        card_latency: Duration::from_millis(1),
        timing: Timing::default(),
    };
    let (router, _) = app::app(Arc::new(MemoryStore::new()), config);
    let res = router
        .oneshot(Request::get("/openapi.json").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/json");
    body_json(res).await
}

const PROBLEMS: [&str; 6] = ["400", "409", "413", "422", "429", "503"];

#[tokio::test]
async fn payments_carry_the_key_parameter_the_replay_header_and_the_problems() {
    let doc = served_document().await;
    let post = &doc["paths"]["/v1/payments"]["post"];

    let params = post["parameters"].as_array().expect("parameters");
    let key: Vec<_> = params
        .iter()
        .filter(|p| p["name"] == "Idempotency-Key")
        .collect();
    assert_eq!(key.len(), 1, "{params:?}");
    assert_eq!(key[0]["in"], "header");
    assert_eq!(key[0]["required"], true);

    let created = &post["responses"]["201"];
    assert_eq!(
        created["headers"]["Idempotent-Replayed"]["schema"]["enum"],
        serde_json::json!(["true"])
    );
    // The shop turns on the TTL header: the document says so.
    assert!(created["headers"]["Idempotency-Key-TTL"].is_object());

    for status in PROBLEMS {
        let response = &post["responses"][status];
        assert_eq!(
            response["content"]["application/problem+json"]["schema"]["$ref"],
            "#/components/schemas/Problem",
            "{status}: {response}"
        );
        let retries = matches!(status, "409" | "429" | "503");
        for header in ["Retry-After", "retry-after-ms"] {
            assert_eq!(
                response["headers"][header].is_object(),
                retries,
                "{status} {header}: {response}"
            );
        }
    }
    // The handler's own 400 keeps its description; the layer's problems are added to it.
    let bad = post["responses"]["400"]["description"].as_str().unwrap();
    assert!(bad.starts_with("The body is malformed."), "{bad}");
    assert!(bad.contains("/problems/#key-missing"), "{bad}");
    assert!(post["responses"]["422"]["description"]
        .as_str()
        .unwrap()
        .contains("/problems/#key-reused"));

    let problem = &doc["components"]["schemas"]["Problem"];
    assert_eq!(
        problem["required"],
        serde_json::json!(["type", "title", "status", "detail"])
    );
    for field in [
        "type",
        "title",
        "status",
        "detail",
        "retry_after",
        "original_status",
    ] {
        assert!(problem["properties"][field].is_object(), "{field}");
    }
}

#[tokio::test]
async fn get_routes_are_left_as_the_shop_described_them() {
    let doc = served_document().await;
    for path in ["/v1/charges", "/v1/debug/stats"] {
        let get = &doc["paths"][path]["get"];
        assert!(get.is_object(), "{path} is described");
        assert!(get["parameters"].is_null(), "{path}: {get}");
        let responses = get["responses"].as_object().unwrap();
        assert_eq!(responses.keys().collect::<Vec<_>>(), ["200"], "{path}");
        assert!(responses["200"]["headers"].is_null(), "{path}: {get}");
    }
}
