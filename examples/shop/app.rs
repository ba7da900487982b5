//! The shop's router, shared by `main.rs` and the tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Timing};

/// The shop's settings.
#[derive(Debug, Clone)]
pub(crate) struct ShopConfig {
    /// How long the fake card network takes per charge.
    pub(crate) card_latency: Duration,
    /// Lease, retention TTL and store deadline of idempotency records.
    pub(crate) timing: Timing,
}

/// The fake card network and the id counters.
#[derive(Debug)]
pub(crate) struct Shop {
    charges: AtomicU64,
    payments: AtomicU64,
    orders: AtomicU64,
    card_latency: Duration,
}

impl Shop {
    fn new(card_latency: Duration) -> Self {
        Self {
            charges: AtomicU64::new(0),
            payments: AtomicU64::new(0),
            orders: AtomicU64::new(0),
            card_latency,
        }
    }

    /// Charges made since start.
    pub(crate) fn charges(&self) -> u64 {
        self.charges.load(Ordering::SeqCst)
    }
}

/// The shop's API behind the idempotency layer. Returns the router and the shop state.
pub(crate) fn app(store: Arc<dyn IdempotencyStore>, config: ShopConfig) -> (Router, Arc<Shop>) {
    let shop = Arc::new(Shop::new(config.card_latency));
    let idempotency = IdempotencyLayer::from_arc(store)
        .with_timing(config.timing)
        // One key space per caller, as authenticated outside this layer.
        .with_scope(|req| req.extensions.get::<Principal>().map(|p| p.0.clone()))
        // Tell clients how long keys live (`Idempotency-Key-TTL`).
        .with_ttl_header(true)
        // A payment whose first attempt died mid-charge: check the card network before
        // charging again. The record id stands for the key, which is never logged.
        .with_abandoned_hook(|a| {
            tracing::warn!(
                record = %a.record.to_hex(),
                old_generation = a.old_generation,
                new_generation = a.new_generation,
                abandoned_for = ?a.abandoned_for,
                "payment key abandoned by an earlier attempt: reconcile with the card network"
            );
        });
    let router = routes()
        .layer(idempotency)
        // Added last, so it runs first: the scope function reads what it sets.
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(shop.clone());
    (router, shop)
}

/// The same API with no idempotency layer: the load script's baseline (`bench/load.sh`),
/// so that both run the very same handlers and auth.
// main.rs uses it; the tests that include this file do not all.
#[allow(dead_code)]
pub(crate) fn bare_app(config: ShopConfig) -> Router {
    routes()
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(Arc::new(Shop::new(config.card_latency)))
}

/// The same API behind a layer that does nothing: what any tower layer on an axum `Router`
/// costs per request (axum boxes and clones each layered route), the load script's second
/// baseline.
#[allow(dead_code)]
pub(crate) fn noop_layer_app(config: ShopConfig) -> Router {
    routes()
        .layer(tower::layer::util::Identity::new())
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(Arc::new(Shop::new(config.card_latency)))
}

fn routes() -> Router<Arc<Shop>> {
    Router::new()
        .route("/v1/payments", post(create_payment))
        .route("/v1/orders", post(create_order))
        .route("/v1/charges", get(count_charges))
}

/// Who is calling: set by [`authenticate`], read by the idempotency scope.
#[derive(Debug, Clone)]
pub(crate) struct Principal(pub(crate) String);

/// A demo auth layer: `X-Api-Key` names the caller. A real service would look the key up;
/// this one only checks its form. No key is the anonymous caller (so the README's curl
/// walk-through works); a malformed or repeated one is 401, never the anonymous caller.
async fn authenticate(mut req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let mut keys = req.headers().get_all("x-api-key").iter();
    let principal = match (keys.next(), keys.next()) {
        (None, _) => Principal("anonymous".to_owned()),
        (Some(v), None) => match v.to_str().ok().filter(|k| is_api_key(k)) {
            Some(k) => Principal(format!("api-key:{k}")),
            None => return unauthorized(),
        },
        (Some(_), Some(_)) => return unauthorized(),
    };
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// 1 to 128 visible ASCII characters (no spaces, no control or non-ASCII bytes).
pub(crate) fn is_api_key(k: &str) -> bool {
    (1..=128).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic())
}

fn unauthorized() -> Response {
    let body = json!({
        "type": "about:blank",
        "title": "Unauthorized",
        "status": 401,
        "detail": "the X-Api-Key header is malformed",
    });
    let mut res = (StatusCode::UNAUTHORIZED, body.to_string()).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/problem+json".parse().unwrap(),
    );
    res
}

fn bad_request(detail: &str) -> Response {
    let body = json!({
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
        "detail": detail,
    });
    let mut res = (StatusCode::BAD_REQUEST, body.to_string()).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/problem+json".parse().unwrap(),
    );
    res
}

#[derive(Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
}

async fn create_payment(
    State(shop): State<Arc<Shop>>,
    // The layer puts the context into the request extensions of every keyed request it
    // runs (no crate feature needed); absent only in the load script's bare baseline,
    // which has no layer.
    ctx: Option<Extension<IdempotencyContext>>,
    body: Bytes,
) -> Response {
    let Ok(p) = serde_json::from_slice::<NewPayment>(&body) else {
        return bad_request("body must be {\"amount\": <integer>, \"currency\": \"<3 letters>\"}");
    };
    if p.amount <= 0 {
        return bad_request("amount must be a positive integer in minor units");
    }
    if p.currency.len() != 3 || !p.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return bad_request("currency must be 3 letters");
    }
    // The card network, called with a key of its own that is the same on every retry and
    // takeover of this payment, so a second attempt cannot charge twice downstream either.
    if let Some(Extension(ctx)) = ctx {
        let card_key = ctx.derive("card-network");
        tracing::debug!(card_key = &card_key[..16], "charging the card");
    }
    if !shop.card_latency.is_zero() {
        tokio::time::sleep(shop.card_latency).await;
    }
    match p.amount {
        402 => (
            StatusCode::PAYMENT_REQUIRED,
            Json(json!({"error": "card_declined"})),
        )
            .into_response(),
        503 => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "card_network_unavailable"})),
        )
            .into_response(),
        amount => {
            shop.charges.fetch_add(1, Ordering::SeqCst);
            let n = shop.payments.fetch_add(1, Ordering::SeqCst) + 1;
            let payment = json!({
                "id": format!("pay_{n}"),
                "amount": amount,
                "currency": p.currency,
                "status": "succeeded",
            });
            (StatusCode::CREATED, Json(payment)).into_response()
        }
    }
}

#[derive(Deserialize)]
struct NewOrder {
    items: Vec<Item>,
}

#[derive(Deserialize)]
struct Item {
    sku: String,
    qty: i64,
}

async fn create_order(State(shop): State<Arc<Shop>>, body: Bytes) -> Response {
    let Ok(order) = serde_json::from_slice::<NewOrder>(&body) else {
        return bad_request("body must be {\"items\": [{\"sku\": \"…\", \"qty\": <integer>}]}");
    };
    if order.items.is_empty() || order.items.iter().any(|i| i.qty <= 0 || i.sku.is_empty()) {
        return bad_request("items must be non-empty, each with a sku and a positive qty");
    }
    let n = shop.orders.fetch_add(1, Ordering::SeqCst) + 1;
    let items: Vec<Value> = order
        .items
        .iter()
        .map(|i| json!({"sku": i.sku, "qty": i.qty}))
        .collect();
    let body = json!({"id": format!("ord_{n}"), "items": items, "status": "created"});
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn count_charges(State(shop): State<Arc<Shop>>) -> Json<Value> {
    Json(json!({"count": shop.charges()}))
}
