//! Run with: `cargo run --example stripe`
//!
//! A Stripe-shaped charges API on 127.0.0.1:4242 (`STRIPE_ADDR` overrides it), behind
//! `IdempotencyLayer` with errors in Stripe's shape ([`tower_idempotency::render::stripe`]),
//! so the official Stripe SDKs can call it as they call Stripe and raise their own errors:
//! a reused key is `stripe.IdempotencyError` in stripe-python, not a generic `APIError`.
//!
//! - `POST /v1/charges`: a form body (`amount=1000&currency=eur`, optional `description`
//!   and `metadata[…]`), the key in `Idempotency-Key` as the SDKs send it. Answers a
//!   `charge` object. `metadata[latency_ms]=<n>` makes this charge take `n` ms (at most
//!   10 s), so a retry can meet it in flight (`409`, `idempotency_key_in_use`).
//! - `GET /v1/charges`: every charge made since start, newest first, as a Stripe `list`:
//!   each is one run of the handler, so a charge run twice shows up twice.
//!
//! Authentication is Stripe's: `Authorization: Bearer <secret key>`; each key is its own
//! idempotency scope. Point an SDK at it with `stripe.api_base = "http://127.0.0.1:4242"`.
//! `tests/sdk/stripe_test.py` drives stripe-python through a proxy that drops answers.

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Form, Json, Router};
use serde_json::{json, Value};
use tower_idempotency::{render, store::MemoryStore, IdempotencyLayer};

/// The charges made, oldest first.
#[derive(Debug, Default)]
struct Charges(Mutex<Vec<Value>>);

/// The caller, from its secret key: the idempotency scope.
#[derive(Debug, Clone)]
struct Account(String);

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_tracing();
    common::exit_status("stripe", run().await)
}

async fn run() -> Result<(), common::BoxError> {
    let addr = std::env::var("STRIPE_ADDR").unwrap_or_else(|_| "127.0.0.1:4242".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("Stripe-shaped API listening on http://{addr}");
    axum::serve(listener, app()).await?;
    Ok(())
}

/// The API behind the layer and the authentication in front of it.
fn app() -> Router {
    let idempotency = IdempotencyLayer::new(MemoryStore::new())
        .with_scope(|req| req.extensions.get::<Account>().map(|a| a.0.clone()))
        // Reused keys as `400 idempotency_error`, in-flight duplicates as `409
        // idempotency_key_in_use`, each with Retry-After: what Stripe's SDKs read.
        .with_error_renderer(render::stripe);
    Router::new()
        .route("/v1/charges", post(create_charge).get(list_charges))
        .layer(idempotency)
        // Added last, so it runs first: the scope function reads the account it sets.
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(Arc::new(Charges::default()))
}

/// `Authorization: Bearer sk_…`, as Stripe's SDKs send the key. A real API looks it up.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let key = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|k| k.starts_with("sk_") && k.len() <= 128)
        .map(str::to_owned);
    let Some(key) = key else {
        return stripe_error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            None,
            "Invalid API Key provided: send `Authorization: Bearer sk_…`.",
        );
    };
    req.extensions_mut().insert(Account(key));
    next.run(req).await
}

async fn create_charge(
    State(charges): State<Arc<Charges>>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    let Some(amount) = form.get("amount").and_then(|a| a.parse::<u64>().ok()) else {
        return stripe_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("amount"),
            "amount must be a positive integer in the currency's minor unit",
        );
    };
    let Some(currency) = form
        .get("currency")
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_alphabetic()))
    else {
        return stripe_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("currency"),
            "currency must be a three-letter ISO code",
        );
    };
    // `metadata[name]=value`, as the SDKs encode a dictionary.
    let metadata: BTreeMap<&str, &str> = form
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("metadata[")?.strip_suffix(']')?, v.as_str())))
        .collect();
    if let Some(ms) = metadata
        .get("latency_ms")
        .and_then(|ms| ms.parse::<u64>().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms.min(10_000))).await;
    }
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut all = charges.0.lock().unwrap_or_else(|e| e.into_inner());
    let charge = json!({
        "id": format!("ch_{:06}", all.len() + 1),
        "object": "charge",
        "amount": amount,
        "currency": currency.to_ascii_lowercase(),
        "description": form.get("description"),
        "metadata": metadata,
        "created": created,
        "livemode": false,
        "paid": true,
        "status": "succeeded",
    });
    all.push(charge.clone());
    Json(charge).into_response()
}

async fn list_charges(State(charges): State<Arc<Charges>>) -> Json<Value> {
    let all = charges.0.lock().unwrap_or_else(|e| e.into_inner());
    let data: Vec<&Value> = all.iter().rev().collect();
    Json(json!({
        "object": "list",
        "url": "/v1/charges",
        "has_more": false,
        "data": data,
    }))
}

/// The handler's own errors, in the same shape as the layer's.
fn stripe_error(status: StatusCode, ty: &str, param: Option<&str>, message: &str) -> Response {
    let body = json!({"error": {"type": ty, "param": param, "message": message}});
    (status, Json(body)).into_response()
}
