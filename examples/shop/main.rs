//! Run with: `cargo run --example shop`
//!
//! A payments API on 127.0.0.1:3000 (`SHOP_ADDR` overrides it) behind `IdempotencyLayer`.
//! `IDEMPOTENCY_STORE` picks the store: unset or `memory` for the in-memory store,
//! `redis://…` or `redis+sentinel://host:port[,host:port…]/<master-name>` (feature `redis`;
//! `IDEMPOTENCY_REDIS_WAIT=<replicas>:<timeout_ms>` turns on `WAIT`) or `postgres://…`
//! (feature `postgres`).
//! `CARD_LATENCY_MS`, `IDEMPOTENCY_LEASE_MS` and `IDEMPOTENCY_TTL_SECS` tune it.
//! `ADMIN_TOKEN` mounts the admin routes (`/admin/idempotency/{scope}/{key}`) behind that
//! bearer token; `--features metrics,axum` serves `GET /metrics` (Prometheus, with axum's
//! matched path as the route label).
//! `SHOP_IDEMPOTENCY=off` serves the same handlers without the layer, and `noop` behind a
//! layer that does nothing (the load script's baselines, `bench/load.sh`).

mod admin;
mod app;
#[path = "../common/mod.rs"]
mod common;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_tracing();
    common::exit_status("shop", run().await)
}

async fn run() -> Result<(), common::BoxError> {
    let (card_latency, timing) = common::settings_from_env()?;
    let config = app::ShopConfig {
        card_latency,
        timing,
    };
    let addr = std::env::var("SHOP_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let baseline = match std::env::var("SHOP_IDEMPOTENCY").as_deref() {
        Ok("off") => Some(app::bare_app(config.clone())),
        Ok("noop") => Some(app::noop_layer_app(config.clone())),
        _ => None,
    };
    if let Some(router) = baseline {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        tracing::info!("shop listening on http://{addr} WITHOUT the idempotency layer");
        axum::serve(listener, router).await?;
        return Ok(());
    }
    #[cfg(feature = "metrics")]
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let store = common::store_from_env().await?;
    let (router, _shop) = app::app(store.clone(), config);
    #[cfg(feature = "metrics")]
    let router = router.merge(admin::metrics_router(metrics));
    let router = admin::mount_admin(router, store, std::env::var("ADMIN_TOKEN").ok());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("shop listening on http://{addr}");
    axum::serve(listener, router).await?;
    Ok(())
}
