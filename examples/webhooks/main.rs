//! Run with: `cargo run --example webhooks`
//!
//! Webhook receivers for Stripe, GitHub and Adyen style deliveries on 127.0.0.1:3001
//! (`WEBHOOKS_ADDR` overrides it), each deduplicated on the sender's own event id for 7
//! days, per tenant (`/webhooks/{tenant}/stripe`; `/webhooks/stripe` is the `default`
//! tenant). `GET /webhooks/processed` counts the events processed per sender.
//!
//! Every delivery needs `X-Signature: sha256=<hex HMAC-SHA256 of the raw body>` with the
//! secret in `WEBHOOK_SECRET` (default `whsec_demo`); without it: `401`, never recorded.
//! `IDEMPOTENCY_STORE` picks the store as in the shop: unset or `memory`, `redis://…`
//! (feature `redis`) or `postgres://…` (feature `postgres`). `WORK_LATENCY_MS` makes each
//! event's work take that long, so a duplicate can arrive while it runs (`503`).
//!
//! ```sh
//! body='{"id":"evt_1","type":"payment_intent.succeeded","pending_webhooks":1}'
//! sig=$(printf %s "$body" | openssl dgst -sha256 -hmac whsec_demo -hex | sed 's/.* //')
//! curl -si localhost:3001/webhooks/stripe -H "X-Signature: sha256=$sig" \
//!   -H 'Content-Type: application/json' -d "$body"
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
