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
//! `redis://…` or `redis+sentinel://host:port[,host:port…]/<master-name>` (feature `redis`;
//! `IDEMPOTENCY_REDIS_WAIT=<replicas>:<timeout_ms>` turns on `WAIT`) or `postgres://…`
//! (feature `postgres`).
//! `CARD_LATENCY_MS`, `IDEMPOTENCY_LEASE_MS` and `IDEMPOTENCY_TTL_SECS` tune it.

// The card gate and the per-service form are there for tests/layer/grpc.rs.
#[allow(dead_code)]
mod app;
#[path = "../common/mod.rs"]
mod common;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_tracing();
    common::exit_status("grpc", run().await)
}

async fn run() -> Result<(), common::BoxError> {
    let (card_latency, timing) = common::settings_from_env()?;
    let config = app::ShopConfig {
        card_latency,
        timing,
        card_gate: None,
    };
    let store = common::store_from_env().await?;
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
