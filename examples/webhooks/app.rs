//! The webhook receivers' router, shared by `main.rs` and the tests.
//!
//! Four senders, each deduplicated on its own id of the event, one record per tenant:
//!
//! | route | the id | matched on |
//! |---|---|---|
//! | `POST /webhooks[/{tenant}]/stripe` | the event's `id` in the body | the body, minus `pending_webhooks` |
//! | `POST /webhooks[/{tenant}]/github` | the `X-GitHub-Delivery` header (the same on a redelivery) | key and route |
//! | `POST /webhooks[/{tenant}]/adyen` | `eventCode` and `pspReference` of the body's one notification item | key and route (records kept 31 days: Adyen retries for 30) |
//! | `POST /webhooks/standard` | the `webhook-id` header of a [Standard Webhooks](https://www.standardwebhooks.com/) sender | key and route, one record per endpoint |
//!
//! Adyen's JSON webhooks carry exactly one item in `notificationItems` (only SOAP batches
//! several), so the key reads `/notificationItems/0/NotificationRequestItem/…`.
//!
//! Each sender registers one URL per tenant; `/webhooks/stripe` is the `default` tenant's.
//! Every Stripe, GitHub and Adyen delivery passes [`verify`] first: `X-Signature:
//! sha256=<hex HMAC-SHA256 of the raw body>`. A delivery that fails it is `401` before the
//! idempotency layer sees it, so it is never recorded.
//!
//! The Standard Webhooks receiver needs no `verify` of its own: the layer checks
//! `webhook-signature` (over `{webhook-id}.{webhook-timestamp}.{body}`, with
//! [`WebhooksConfig::standard`]) and the timestamp's 5 minute tolerance on the
//! buffered body, before it claims anything. A delivery that fails is `401`
//! `signature-invalid`, and nothing is stored.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hmac::{Hmac, Mac};
use serde_json::json;
use sha2::Sha256;
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyLayer, JsonPointer, Key, KeyPart, StandardWebhooks, Webhook};

/// The largest delivery accepted, by the signature check and the idempotency layer alike.
pub(crate) const MAX_BODY: usize = 256 * 1024;

const DAY: std::time::Duration = std::time::Duration::from_secs(24 * 60 * 60);

/// Where Adyen's one notification item sits in its JSON webhooks.
pub(crate) const ADYEN_ITEM: &str = "/notificationItems/0/NotificationRequestItem";

/// Something each delivery's work waits on once it has counted (a slow downstream call).
/// `None` in the server by default; the tests hold the work to make deliveries overlap.
pub(crate) type Hold = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The receivers' settings.
#[derive(Clone)]
pub(crate) struct WebhooksConfig {
    /// The shared secret of the demo signature.
    pub(crate) secret: Vec<u8>,
    /// The Standard Webhooks sender's secrets (`whsec_<base64>`: the current one, and the
    /// previous one while the sender rotates) and the timestamp tolerance.
    pub(crate) standard: StandardWebhooks,
    pub(crate) hold: Option<Hold>,
    /// The largest acknowledgement recorded (the layer's default, 1 MiB, when `None`). A
    /// larger one is not kept, and a redelivery gets its status with an empty body and
    /// `Idempotent-Replay-Omitted: too-large`: still a 2xx, so the sender stops.
    pub(crate) max_response_body: Option<std::num::NonZeroUsize>,
}

/// Events processed since start, per sender: the work each delivery does once.
#[derive(Debug, Default)]
pub(crate) struct Processed {
    stripe: AtomicU64,
    github: AtomicU64,
    adyen: AtomicU64,
    standard: AtomicU64,
}

impl Processed {
    /// `(stripe, github, adyen)`.
    pub(crate) fn counts(&self) -> (u64, u64, u64) {
        let get = |c: &AtomicU64| c.load(Ordering::SeqCst);
        (get(&self.stripe), get(&self.github), get(&self.adyen))
    }

    /// The Standard Webhooks sender's.
    pub(crate) fn standard(&self) -> u64 {
        self.standard.load(Ordering::SeqCst)
    }
}

/// The tenant whose endpoint a delivery came to, set by [`verify`].
#[derive(Debug, Clone)]
pub(crate) struct Tenant(pub(crate) String);

#[derive(Clone)]
struct AppState {
    processed: Arc<Processed>,
    hold: Option<Hold>,
}

/// The receivers on `store`. Returns the router and the counters.
pub(crate) fn app(
    store: Arc<dyn IdempotencyStore>,
    config: WebhooksConfig,
) -> (Router, Arc<Processed>) {
    let processed = Arc::new(Processed::default());
    let state = AppState {
        processed: processed.clone(),
        hold: config.hold,
    };
    let max_response_body = config.max_response_body;
    let layer = |sender: &'static str, webhook: Webhook| {
        let layer = IdempotencyLayer::from_arc(store.clone())
            .with_max_request_body(std::num::NonZeroUsize::new(MAX_BODY).unwrap())
            .with_route_label(sender);
        let layer = match max_response_body {
            Some(limit) => layer.with_max_response_body(limit),
            None => layer,
        };
        layer
            // One key space per tenant and sender: the sender's ids are unique only there.
            .with_webhook(webhook.with_scope(move |req| {
                let tenant = req.extensions.get::<Tenant>()?;
                Some(format!("{}/{sender}", tenant.0))
            }))
    };
    let pointer = |p: &str| JsonPointer::parse(p).expect("a valid pointer");
    let stripe = layer(
        "stripe",
        Webhook::new(Key::json_pointer("/id").expect("a valid pointer"))
            // Stripe counts down the endpoints still to deliver to on each redelivery.
            .matching_body_except([pointer("/pending_webhooks")]),
    );
    let github = layer(
        "github",
        Webhook::new(Key::header(HeaderName::from_static("x-github-delivery"))),
    );
    let adyen_key = Key::joined([
        KeyPart::json_pointer(&format!("{ADYEN_ITEM}/eventCode")).expect("a valid pointer"),
        KeyPart::json_pointer(&format!("{ADYEN_ITEM}/pspReference")).expect("a valid pointer"),
    ])
    .expect("two parts");
    // Adyen's retry queue runs for 30 days, past the 7 day default.
    let adyen = layer("adyen", Webhook::new(adyen_key).with_ttl(31 * DAY));
    // Its own layer: no `verify` in front, and the default scope, the endpoint's path.
    let standard = IdempotencyLayer::from_arc(store.clone())
        .with_max_request_body(std::num::NonZeroUsize::new(MAX_BODY).unwrap())
        .with_route_label("standard")
        .with_webhook(Webhook::standard(config.standard));
    let secret: Arc<[u8]> = config.secret.into();
    let router = Router::new()
        .route("/webhooks/stripe", post(on_stripe).layer(stripe.clone()))
        .route("/webhooks/{tenant}/stripe", post(on_stripe).layer(stripe))
        .route("/webhooks/github", post(on_github).layer(github.clone()))
        .route("/webhooks/{tenant}/github", post(on_github).layer(github))
        .route("/webhooks/adyen", post(on_adyen).layer(adyen.clone()))
        .route("/webhooks/{tenant}/adyen", post(on_adyen).layer(adyen))
        // Outside every idempotency layer: a bad signature never reaches one.
        .route_layer(axum::middleware::from_fn_with_state(secret, verify))
        // After `route_layer`, so outside `verify`: the layer checks this sender's signature.
        .route("/webhooks/standard", post(on_standard).layer(standard))
        .route("/webhooks/processed", get(processed_counts))
        .with_state(state);
    (router, processed)
}

/// The demo signature check: reads the raw body (within [`MAX_BODY`]), checks
/// `X-Signature`, notes the tenant of the endpoint, and hands the same bytes on.
///
/// A real receiver checks each sender's own scheme (`Stripe-Signature` with its timestamp,
/// `X-Hub-Signature-256`, Adyen's `hmacSignature`) with the secret of that tenant's
/// endpoint, so the tenant it sets is one the signature proved.
async fn verify(State(secret): State<Arc<[u8]>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the delivery is larger than the receiver takes",
        );
    };
    let signed = parts
        .headers
        .get("x-signature")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("sha256="))
        .and_then(from_hex)
        .is_some_and(|tag| {
            let mut mac = Hmac::<Sha256>::new_from_slice(&secret).expect("any key length");
            mac.update(&bytes);
            // Constant time: the comparison must not tell a forger how much was right.
            mac.verify_slice(&tag).is_ok()
        });
    if !signed {
        return problem(
            StatusCode::UNAUTHORIZED,
            "the X-Signature header is missing or wrong",
        );
    }
    let mut req = Request::from_parts(parts, Body::from(bytes));
    let tenant = tenant_of(req.uri().path());
    req.extensions_mut().insert(Tenant(tenant));
    next.run(req).await
}

/// `/webhooks/{tenant}/{sender}`, or `default` for `/webhooks/{sender}`.
fn tenant_of(path: &str) -> String {
    let segments: Vec<_> = path.trim_start_matches('/').split('/').collect();
    match segments.as_slice() {
        ["webhooks", tenant, _sender] => (*tenant).to_owned(),
        _ => "default".to_owned(),
    }
}

/// Lowercase or uppercase hex, two digits a byte.
pub(crate) fn from_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = json!({
        "type": "about:blank",
        "title": status.canonical_reason(),
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

/// The work: counts the event once, then waits on the hold. A real receiver would store
/// the event in its inbox here and acknowledge; see the webhooks guide.
async fn work(state: &AppState, counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::SeqCst);
    if let Some(hold) = &state.hold {
        hold().await;
    }
}

async fn on_stripe(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    body: Bytes,
) -> Response {
    let Ok(event) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return problem(StatusCode::BAD_REQUEST, "the event is not JSON");
    };
    work(&state, &state.processed.stripe).await;
    tracing::info!(tenant = tenant.0, event = %event["id"], kind = %event["type"], "stripe event processed");
    Json(json!({"received": true})).into_response()
}

async fn on_github(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    req: Request,
) -> Response {
    let event = req.headers().get("x-github-event").cloned();
    work(&state, &state.processed.github).await;
    tracing::info!(tenant = tenant.0, event = ?event, "github delivery processed");
    StatusCode::NO_CONTENT.into_response()
}

async fn on_adyen(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    body: Bytes,
) -> Response {
    let Ok(notification) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return problem(StatusCode::BAD_REQUEST, "the notification is not JSON");
    };
    work(&state, &state.processed.adyen).await;
    let item = &notification["notificationItems"][0]["NotificationRequestItem"];
    tracing::info!(tenant = tenant.0, code = %item["eventCode"], psp = %item["pspReference"], "adyen notification processed");
    // Adyen takes any 2xx; older integrations were asked for this body.
    (StatusCode::ACCEPTED, "[accepted]").into_response()
}

/// A Standard Webhooks message: `{"type", "timestamp", "data"}`. The layer verified the
/// signature and the timestamp before this ran, and keyed it on `webhook-id`.
async fn on_standard(State(state): State<AppState>, body: Bytes) -> Response {
    let Ok(message) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return problem(StatusCode::BAD_REQUEST, "the message is not JSON");
    };
    work(&state, &state.processed.standard).await;
    tracing::info!(kind = %message["type"], "standard webhooks message processed");
    Json(json!({"received": true})).into_response()
}

async fn processed_counts(State(state): State<AppState>) -> Json<serde_json::Value> {
    let (stripe, github, adyen) = state.processed.counts();
    let standard = state.processed.standard();
    Json(json!({"stripe": stripe, "github": github, "adyen": adyen, "standard": standard}))
}
