//! The shop's router, shared by `main.rs` and the tests.

#[path = "card.rs"]
pub(crate) mod card;
#[cfg(feature = "utoipa")]
#[path = "openapi.rs"]
pub(crate) mod openapi;
#[path = "payments.rs"]
pub(crate) mod payments;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Timing};

pub(crate) use payments::ShopOptions;

/// The shop's settings.
#[derive(Debug, Clone)]
pub(crate) struct ShopConfig {
    /// How long the fake card network takes per charge.
    pub(crate) card_latency: Duration,
    /// Lease, retention TTL and store deadline of idempotency records.
    pub(crate) timing: Timing,
}

/// The fake card network, the id counters and the test hooks.
#[derive(Debug)]
pub(crate) struct Shop {
    /// The card network this process simulates (and serves at `/card-network/charges`).
    ledger: Arc<card::Ledger>,
    /// The network charged instead of `ledger` (`CARD_NETWORK_URL`).
    remote: Option<card::Remote>,
    payments: AtomicU64,
    orders: AtomicU64,
    card_latency: Duration,
    options: ShopOptions,
    stats: Mutex<payments::Stats>,
}

impl Shop {
    pub(crate) fn new(card_latency: Duration) -> Self {
        Self::with_options(card_latency, ShopOptions::default())
    }

    fn with_options(card_latency: Duration, options: ShopOptions) -> Self {
        Self {
            ledger: Arc::default(),
            remote: options.card_network.as_deref().map(card::Remote::new),
            payments: AtomicU64::new(0),
            orders: AtomicU64::new(0),
            card_latency,
            options,
            stats: Mutex::default(),
        }
    }

    /// Charges made since start by the card network this process simulates (each
    /// card-network key once).
    pub(crate) fn charges(&self) -> u64 {
        self.ledger.count()
    }

    /// Charges the card, at the remote network if one is set, else at this process's.
    async fn charge(&self, req: &card::ChargeRequest) -> card::Charged {
        match &self.remote {
            Some(remote) => remote.charge(req, self.card_latency).await,
            None => self.ledger.charge(req, self.card_latency).await,
        }
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, payments::Stats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The shop's API behind the idempotency layer. Returns the router and the shop state.
// The tests' entry point; main.rs uses `app_with`.
#[allow(dead_code)]
pub(crate) fn app(store: Arc<dyn IdempotencyStore>, config: ShopConfig) -> (Router, Arc<Shop>) {
    let (router, shop, _) = app_with(store, config, ShopOptions::default());
    (router, shop)
}

/// [`app`] with the test and demo hooks of `options`; also returns the layer, for the
/// recovery worker ([`payments::spawn_recovery`]).
pub(crate) fn app_with(
    store: Arc<dyn IdempotencyStore>,
    config: ShopConfig,
    options: ShopOptions,
) -> (Router, Arc<Shop>, IdempotencyLayer) {
    let shop = Arc::new(Shop::with_options(config.card_latency, options));
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
        .layer(idempotency.clone())
        // Added last, so it runs first: the scope function reads what it sets.
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(shop.clone())
        // The simulated card network, outside the layer: it dedupes by its own key.
        .merge(card::router(shop.ledger.clone()));
    // The API description, outside the layer and the auth.
    #[cfg(feature = "utoipa")]
    let router = router.merge(openapi::router(&idempotency));
    (router, shop, idempotency)
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

/// The shop's routes, before the layers and the state (also served behind another crate's
/// middleware by `bench/peer`).
pub(crate) fn routes() -> Router<Arc<Shop>> {
    Router::new()
        .route("/v1/payments", post(create_payment))
        .route("/v1/orders", post(create_order))
        .route("/v1/charges", get(count_charges))
        .route("/v1/debug/stats", get(stats))
}

/// Who is calling: set by [`authenticate`], read by the idempotency scope.
#[derive(Debug, Clone)]
pub(crate) struct Principal(pub(crate) String);

/// A demo auth layer: `X-Api-Key` names the caller. A real service would look the key up;
/// this one only checks its form. No key is the anonymous caller (so the README's curl
/// walk-through works); a malformed or repeated one is 401, never the anonymous caller.
pub(crate) async fn authenticate(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
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
    problem(StatusCode::BAD_REQUEST, detail)
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or(""),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut res = (status, body.to_string()).into_response();
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
    headers: HeaderMap,
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
    let stall = match headers.get(payments::STALL_HEADER) {
        None => shop.options.stall_after.clone(),
        Some(v) => match v.to_str().ok().filter(|s| payments::check_phase(s).is_ok()) {
            Some(s) => Some(s.to_owned()),
            None => return bad_request("Shop-Stall-After must be created or charged"),
        },
    };
    let ctx = ctx.map(|Extension(ctx)| ctx);
    // A takeover resumes from the point the attempt before it saved last, with its payment:
    // the request's body is the same (the layer checked its fingerprint).
    let start = match ctx.as_ref().and_then(|c| c.recovery_point()) {
        None => payments::Start::New {
            amount: p.amount,
            currency: p.currency,
        },
        Some(point) => match payments::Start::from_point(point) {
            Ok(start) => start,
            Err(e) => {
                tracing::error!(error = %e, "a payment's recovery point is unreadable; it starts over");
                return problem(StatusCode::INTERNAL_SERVER_ERROR, &e);
            }
        },
    };
    let ended = payments::run(&shop, ctx.as_ref(), start, stall.as_deref()).await;
    if let payments::Ended::Paid {
        resumed_from: Some(step),
        ..
    } = &ended
    {
        *shop.stats().resumed.entry(step.clone()).or_default() += 1;
    }
    let (status, body) = ended.answer();
    let mut res = (status, Json(body)).into_response();
    if matches!(
        ended,
        payments::Ended::Fenced | payments::Ended::StoreFailed(_)
    ) {
        let h = res.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            "application/problem+json".parse().unwrap(),
        );
        h.insert(header::RETRY_AFTER, "1".parse().unwrap());
    }
    res
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

/// `GET /v1/debug/stats`: what this process did (read-only, for the tests and the demo):
/// payments created, charges its card network made, requests stalled by the hook, takeovers
/// that resumed (by step) and each run of the recover function.
async fn stats(State(shop): State<Arc<Shop>>) -> Json<Value> {
    let mut body = serde_json::to_value(&*shop.stats()).expect("the stats serialise");
    body["payments_created"] = shop.payments.load(Ordering::SeqCst).into();
    body["charges"] = shop.charges().into();
    Json(body)
}
