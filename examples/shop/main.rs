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
//! matched path as the route label); `--features utoipa` serves `GET /openapi.json`, the API
//! with the idempotency layer's contract on its `POST` routes.
//! `SHOP_IDEMPOTENCY=off` serves the same handlers without the layer, and `noop` behind a
//! layer that does nothing (the load script's baselines, `bench/load.sh`).
//!
//! **Resumable payments.** `POST /v1/payments` runs in phases, each saving a recovery point
//! (see `payments.rs`): `created` (the `pay_` id), `charged` (the card network's charge id,
//! under a key derived from the payment), then the `201`. A takeover of a key whose holder
//! died resumes from its last point with the same payment id, and says so in the answer:
//! `"resumed_from": "created"` (or `"charged"`). On Redis and Postgres a recovery worker
//! finishes such keys without waiting for the client's retry:
//! - `IDEMPOTENCY_RECOVERY_INTERVAL_MS`: how often it sweeps (default 1000 on Redis and
//!   Postgres; on the memory store it runs only when this is set). `0` turns it off.
//! - `IDEMPOTENCY_RECOVERY_MAX_ATTEMPTS`: the generation past which a record is left for an
//!   operator, logged at `ERROR` (default 5).
//!
//! Test and demo hooks:
//! - `SHOP_STALL_AFTER=created|charged`, or the request header `Shop-Stall-After:` with the
//!   same values: the request stalls (for an hour) right after saving that phase's point, so
//!   a `kill -9` lands mid-payment. Requests only; a resumed attempt stalls only after a
//!   phase it ran itself, and the worker never stalls.
//! - `CARD_LATENCY_MS`: how long the card network takes to answer a new charge (the charge
//!   is booked when it arrives, so a kill during the wait leaves it made).
//! - `CARD_NETWORK_URL=http://host:port`: charge the card network another shop process
//!   serves (`POST`/`GET /card-network/charges`, its ledger of charges by key) instead of
//!   this process's own, so the network outlives a killed shop.
//! - `SHOP_RECOVER_FAIL=1`: the recover function fails every time (before any step, after
//!   reading the point).
//! - `GET /v1/debug/stats`: payments created, charges made by this process's network,
//!   stalled requests, takeovers resumed (by step) and each recovery the worker ran.

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
    let options = app::ShopOptions::from_env()?;
    let (router, shop, layer) = app::app_with(store.clone(), config, options);
    let _recovery = match app::payments::recovery_from_env(store.name())? {
        Some((interval, max_attempts)) => {
            tracing::info!(
                interval_ms = interval.as_millis() as u64,
                max_attempts,
                "recovery worker on"
            );
            Some(app::payments::spawn_recovery(
                &layer,
                shop,
                interval,
                max_attempts,
            ))
        }
        None => None,
    };
    #[cfg(feature = "metrics")]
    let router = router.merge(admin::metrics_router(metrics));
    let router = admin::mount_admin(router, store, std::env::var("ADMIN_TOKEN").ok());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("shop listening on http://{addr}");
    axum::serve(listener, router).await?;
    Ok(())
}
