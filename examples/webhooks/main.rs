//! Run with: `cargo run --example webhooks`
//!
//! Webhook receivers for Stripe, GitHub and Adyen style deliveries, and a Standard Webhooks
//! sender's, on 127.0.0.1:3001 (`WEBHOOKS_ADDR` overrides it), each deduplicated on the
//! sender's own event id for 7 days, per tenant (`/webhooks/{tenant}/stripe`;
//! `/webhooks/stripe` is the `default` tenant). `GET /webhooks/processed` counts the events
//! processed per sender.
//!
//! Every Stripe, GitHub and Adyen delivery needs `X-Signature: sha256=<hex HMAC-SHA256 of
//! the raw body>` with the secret in `WEBHOOK_SECRET` (default `whsec_demo`); without it:
//! `401`, never recorded. `POST /webhooks/standard` takes Standard Webhooks 1.0 deliveries
//! signed with `STANDARD_WEBHOOK_SECRET` (default the spec's example secret below; a
//! second one, space-separated, while the sender rotates): `webhook-id`,
//! `webhook-timestamp` within 5 minutes, `webhook-signature: v1,<base64 HMAC-SHA256 of
//! id.timestamp.body>`.
//!
//! `IDEMPOTENCY_STORE` picks the store as in the shop: unset or `memory`, `redis://…`
//! (feature `redis`) or `postgres://…` (feature `postgres`). `WORK_LATENCY_MS` makes each
//! event's work take that long, so a duplicate can arrive while it runs (`503`).
//!
//! ```sh
//! body='{"id":"evt_1","type":"payment_intent.succeeded","pending_webhooks":1}'
//! sig=$(printf %s "$body" | openssl dgst -sha256 -hmac whsec_demo -hex | sed 's/.* //')
//! curl -si localhost:3001/webhooks/stripe -H "X-Signature: sha256=$sig" \
//!   -H 'Content-Type: application/json' -d "$body"
//!
//! # Standard Webhooks: the key is the base64 after `whsec_`.
//! id=msg_1 ts=$(date +%s) body='{"type":"invoice.paid","data":{"id":"in_1"}}'
//! key=$(printf %s MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw | base64 -d | od -An -tx1 | tr -d ' \n')
//! sig=$(printf %s "$id.$ts.$body" | openssl dgst -sha256 -mac HMAC -macopt "hexkey:$key" -binary | base64)
//! curl -si localhost:3001/webhooks/standard -H "webhook-id: $id" -H "webhook-timestamp: $ts" \
//!   -H "webhook-signature: v1,$sig" -H 'Content-Type: application/json' -d "$body"
//! ```

mod app;
#[path = "../common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_tracing();
    common::exit_status("webhooks", run().await)
}

async fn run() -> Result<(), common::BoxError> {
    let secret = std::env::var("WEBHOOK_SECRET").unwrap_or_else(|_| "whsec_demo".into());
    // The Standard Webhooks spec's example secret: a demo only, as public as can be.
    let standard_secrets = std::env::var("STANDARD_WEBHOOK_SECRET")
        .unwrap_or_else(|_| "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into());
    let standard = tower_idempotency::StandardWebhooks::new(standard_secrets.split_whitespace())
        .map_err(|e| format!("STANDARD_WEBHOOK_SECRET: {e}"))?;
    let latency = match std::env::var("WORK_LATENCY_MS") {
        Ok(v) => Duration::from_millis(
            v.parse()
                .map_err(|e| format!("WORK_LATENCY_MS={v:?}: {e}"))?,
        ),
        Err(_) => Duration::ZERO,
    };
    let hold = (!latency.is_zero()).then(|| {
        let hold: app::Hold = Arc::new(move || Box::pin(tokio::time::sleep(latency)));
        hold
    });
    let config = app::WebhooksConfig {
        secret: secret.into_bytes(),
        standard,
        hold,
        max_response_body: None,
    };
    let store = common::store_from_env().await?;
    let (router, _processed) = app::app(store, config);
    let addr = std::env::var("WEBHOOKS_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("webhook receivers listening on http://{addr}");
    axum::serve(listener, router).await?;
    Ok(())
}
