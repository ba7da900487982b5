//! The shop's handlers behind another crate's middleware: `idempotent` 2.0's
//! `IdempotencyLayer` on its Valkey/Redis store, the peer of `bench/load.sh` (mode
//! `idempotent`). The routes, the auth layer and the handlers are examples/shop's own files,
//! compiled in by path, so the bare shop, the shop behind tower-idempotency and this one run
//! the very same code around a different middleware.
//!
//! Env: `SHOP_ADDR` (127.0.0.1:3000), `CARD_LATENCY_MS` (50), `IDEMPOTENCY_TTL_SECS` (86400,
//! the completed lease; load.sh sets 600 as for the shop), `IDEMPOTENCY_STORE`
//! (`redis://…`, required) and `SHOP_IDEMPOTENCY`: `idempotent` (the default) or `off` (the
//! same handlers with no middleware, built in this crate: a check that this build's bare shop
//! runs like the example's).
//!
//! idempotent is configured as its README and defaults have it: the default processing lease
//! (60 s) renewed every half lease while the handler runs (its default keep-alive ceiling, 10
//! minutes), its default fingerprint (xxHash3 over method, path and query, and the body), its
//! default store timeout (5 s), no cap on requests in flight, one key space per caller (the
//! same `Principal` the shop's auth layer sets and tower-idempotency scopes by), and a key
//! prefix on the store.

#[path = "../../../examples/shop/app.rs"]
#[allow(dead_code, unreachable_pub)]
mod app;
#[path = "../../../examples/common/mod.rs"]
#[allow(dead_code, unreachable_pub)]
mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotent::middleware::IdempotencyLayer;
use idempotent::valkey::ValkeyStore;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_tracing();
    common::exit_status("peer-shop", run().await)
}

async fn run() -> Result<(), common::BoxError> {
    let (card_latency, timing) = common::settings_from_env()?;
    let addr = std::env::var("SHOP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let router = match std::env::var("SHOP_IDEMPOTENCY").as_deref() {
        Ok("off") => app::bare_app(app::ShopConfig {
            card_latency,
            timing,
        }),
        Ok("idempotent") | Err(_) => {
            let url = std::env::var("IDEMPOTENCY_STORE")
                .map_err(|_| "IDEMPOTENCY_STORE=redis://… is required")?;
            let store = ValkeyStore::with_url(url)
                .prefix("peer")
                .try_build()
                .await?;
            store.ping().await?;
            let layer = IdempotencyLayer::new(store)
                .completed_ttl(Duration::from_secs(ttl_secs()?))
                // One key space per caller, as the shop's own layer has it (app.rs).
                .scope(|parts| {
                    parts
                        .extensions
                        .get::<app::Principal>()
                        .map(|p| p.0.clone())
                });
            app::routes()
                .layer(layer)
                // Added last, so it runs first: the scope reads what it sets.
                .layer(axum::middleware::from_fn(app::authenticate))
                .with_state(Arc::new(app::Shop::new(card_latency)))
        }
        Ok(other) => {
            return Err(format!("SHOP_IDEMPOTENCY={other:?}: expected idempotent or off").into())
        }
    };
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("peer shop listening on http://{addr}");
    axum::serve(listener, router).await?;
    Ok(())
}

/// `IDEMPOTENCY_TTL_SECS`, as examples/common reads it for the shop.
fn ttl_secs() -> Result<u64, common::BoxError> {
    match std::env::var("IDEMPOTENCY_TTL_SECS") {
        Ok(v) => v
            .parse()
            .map_err(|e| format!("IDEMPOTENCY_TTL_SECS={v:?}: {e}").into()),
        Err(_) => Ok(86_400),
    }
}
