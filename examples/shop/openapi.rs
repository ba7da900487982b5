//! `GET /openapi.json` (the `utoipa` feature): the shop's routes described by hand, and what
//! the idempotency layer adds to the protected ones (`tower_idempotency::openapi::document`).

use axum::http::header;
use axum::routing::get;
use axum::Router;
use serde_json::json;
use tower_idempotency::IdempotencyLayer;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::{
    ContentBuilder, InfoBuilder, OpenApi, OpenApiBuilder, PathsBuilder, ResponseBuilder,
};

/// The shop's API as an OpenAPI 3.1 document, with `layer`'s contract on its `POST` routes.
pub(crate) fn document(layer: &IdempotencyLayer) -> OpenApi {
    let json_body = |example: serde_json::Value| {
        RequestBodyBuilder::new()
            .required(Some(utoipa::openapi::Required::True))
            .content(
                "application/json",
                ContentBuilder::new().example(Some(example)).build(),
            )
            .build()
    };
    let answer = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content("application/json", ContentBuilder::new().build())
    };
    let post = |id: &str, body, created: &str| {
        OperationBuilder::new()
            .operation_id(Some(id))
            .request_body(Some(body))
            .response("201", answer(created))
            .response("400", answer("The body is malformed."))
    };
    let read = |id: &str, what: &str| {
        OperationBuilder::new()
            .operation_id(Some(id))
            .response("200", answer(what))
    };
    let payments = post(
        "createPayment",
        json_body(json!({"amount": 1000, "currency": "EUR"})),
        "The payment, charged once.",
    )
    .response("402", answer("The card was declined."));
    let orders = post(
        "createOrder",
        json_body(json!({"items": [{"sku": "tea", "qty": 2}]})),
        "The order.",
    );
    let paths = PathsBuilder::new()
        .path("/v1/payments", PathItem::new(HttpMethod::Post, payments))
        .path("/v1/orders", PathItem::new(HttpMethod::Post, orders))
        .path(
            "/v1/charges",
            PathItem::new(HttpMethod::Get, read("countCharges", "Charges made.")),
        )
        .path(
            "/v1/debug/stats",
            PathItem::new(HttpMethod::Get, read("stats", "What this process did.")),
        );
    let mut doc = OpenApiBuilder::new()
        .info(InfoBuilder::new().title("shop").version("1").build())
        .paths(paths)
        .build();
    // The layer sits on every route; its methods (POST, PATCH) pick the protected ones.
    tower_idempotency::openapi::document(&mut doc, layer, |_path, _method| true);
    doc
}

/// The route that serves [`document`], rendered once.
pub(crate) fn router(layer: &IdempotencyLayer) -> Router {
    let body = document(layer)
        .to_json()
        .expect("an OpenAPI document serialises");
    Router::new().route(
        "/openapi.json",
        get(move || async move { ([(header::CONTENT_TYPE, "application/json")], body) }),
    )
}
