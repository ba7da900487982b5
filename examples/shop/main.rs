//! Run with: `cargo run --example shop`
//!
//! A payments API on 127.0.0.1:3000 (`SHOP_ADDR` overrides it) behind `IdempotencyLayer`.
//! `IDEMPOTENCY_STORE` picks the store: unset or `memory` for the in-memory store,
//! `redis://…` (feature `redis`) or `postgres://…` (feature `postgres`).
//! `CARD_LATENCY_MS`, `IDEMPOTENCY_LEASE_MS` and `IDEMPOTENCY_TTL_SECS` tune it.

mod app;

use std::sync::Arc;

use tower_idempotency::store::{IdempotencyStore, MemoryStore};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn store_from_env() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    let url = std::env::var("IDEMPOTENCY_STORE").unwrap_or_default();
    if url.is_empty() || url == "memory" {
        return Ok(Arc::new(MemoryStore::new()));
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        #[cfg(feature = "redis")]
        return Ok(Arc::new(
            tower_idempotency::store::redis::RedisStore::connect(&url).await?,
        ));
        #[cfg(not(feature = "redis"))]
        return Err("IDEMPOTENCY_STORE is a redis:// URL: run with `--features redis`".into());
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        {
            let store = tower_idempotency::store::postgres::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            return Ok(Arc::new(store));
        }
        #[cfg(not(feature = "postgres"))]
        return Err(
            "IDEMPOTENCY_STORE is a postgres:// URL: run with `--features postgres`".into(),
        );
    }
    Err(format!("IDEMPOTENCY_STORE={url:?}: expected memory, redis://… or postgres://…").into())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=info".into()),
        )
        .init();
    let config = app::ShopConfig::from_env().map_err(|e| e.to_string())?;
    let store = store_from_env().await?;
    let (router, _shop) = app::app(store, config);
    let addr = std::env::var("SHOP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("shop listening on http://{addr}");
    axum::serve(listener, router).await?;
    Ok(())
}
