//! Run with: `cargo run --example grpc`
//!
//! The shop's payments as a gRPC service (tonic 0.14) on 127.0.0.1:50051 (`GRPC_ADDR`
//! overrides it) behind `IdempotencyLayer`. Send the key as `idempotency-key` metadata:
//!
//! ```text
//! grpcurl -plaintext -import-path examples/proto -proto shop.proto \
//!   -H 'idempotency-key: order-42' -d '{"amount": 1000, "currency": "EUR"}' \
//!   127.0.0.1:50051 shop.v1.Payments/CreatePayment
//! ```
//!
//! `IDEMPOTENCY_STORE` picks the store: unset or `memory` for the in-memory store,
//! `redis://…` (feature `redis`) or `postgres://…` (feature `postgres`).
//! `CARD_LATENCY_MS`, `IDEMPOTENCY_LEASE_MS` and `IDEMPOTENCY_TTL_SECS` tune it.

// The card gate and the per-service form are there for tests/grpc.rs.
#[allow(dead_code)]
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
    let addr = std::env::var("GRPC_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".into());
    let addr = tokio::net::lookup_host(&addr)
        .await?
        .next()
        .ok_or_else(|| format!("GRPC_ADDR={addr:?} resolves to no address"))?;
    tracing::info!("gRPC shop listening on {addr}");
    router.serve(addr).await?;
    Ok(())
}
