//! Settings the examples read from the environment.
// The examples and the tests that include this file each use part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use tower_idempotency::store::{AdminStore, MemoryStore};
use tower_idempotency::Timing;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Ends an example: status 0, or one line naming the error and each of its causes on stderr
/// and status 1 (a Debug dump says nothing a user can act on).
pub(crate) fn exit_status(name: &str, result: Result<(), BoxError>) -> std::process::ExitCode {
    let Err(e) = result else {
        return std::process::ExitCode::SUCCESS;
    };
    let mut line = format!("{name}: {e}");
    let mut source = e.source();
    while let Some(cause) = source {
        // Setup errors often repeat their cause in their own text.
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    eprintln!("{line}");
    std::process::ExitCode::FAILURE
}

/// Logs to stdout (tracing-subscriber's default); `RUST_LOG` overrides the default `info`.
pub(crate) fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=info".into()),
        )
        .init();
}

/// `CARD_LATENCY_MS` (default 50) and the lease and TTL from `IDEMPOTENCY_LEASE_MS` (default
/// 30000) and `IDEMPOTENCY_TTL_SECS` (default 86400).
pub(crate) fn settings_from_env() -> Result<(Duration, Timing), BoxError> {
    let num = |var: &str, default: u64| -> Result<u64, BoxError> {
        match std::env::var(var) {
            Ok(v) => v.parse().map_err(|e| format!("{var}={v:?}: {e}").into()),
            Err(_) => Ok(default),
        }
    };
    let card_latency = Duration::from_millis(num("CARD_LATENCY_MS", 50)?);
    let timing = Timing::new(
        Duration::from_millis(num("IDEMPOTENCY_LEASE_MS", 30_000)?),
        Duration::from_secs(num("IDEMPOTENCY_TTL_SECS", 86_400)?),
    )?;
    Ok((card_latency, timing))
}

/// The store `IDEMPOTENCY_STORE` names: unset or `memory`, `redis://…` or
/// `redis+sentinel://host:port[,host:port…]/<master-name>` (feature `redis`; with
/// `IDEMPOTENCY_REDIS_WAIT=<replicas>:<timeout_ms>`, each write waits for that many
/// replicas) or `postgres://…` (feature `postgres`, migrated on start; a multi-host URL with
/// `target_session_attrs=read-write` follows a promotion). With the operator API, for the
/// shop's admin routes. `IDEMPOTENCY_LOCAL_TIER=1` puts a `LocalTier` in front of it.
pub(crate) async fn store_from_env() -> Result<Arc<dyn AdminStore>, BoxError> {
    let store = named_store().await?;
    // `IDEMPOTENCY_LOCAL_TIER=1`: completed answers served from the process (`LocalTier`).
    if std::env::var("IDEMPOTENCY_LOCAL_TIER").is_ok_and(|v| v == "1") {
        return Ok(Arc::new(tower_idempotency::store::LocalTier::new(store)));
    }
    Ok(store)
}

async fn named_store() -> Result<Arc<dyn AdminStore>, BoxError> {
    let url = std::env::var("IDEMPOTENCY_STORE").unwrap_or_default();
    if url.is_empty() || url == "memory" {
        return Ok(Arc::new(MemoryStore::new()));
    }
    if url.starts_with("redis://")
        || url.starts_with("rediss://")
        || url.starts_with("redis+sentinel://")
    {
        #[cfg(feature = "redis")]
        {
            let mut builder = tower_idempotency::store::redis::RedisStore::builder();
            if let Some((replicas, timeout)) = redis_wait_from_env()? {
                builder = builder.with_wait(replicas, timeout);
            }
            return Ok(Arc::new(builder.connect(&url).await?));
        }
        #[cfg(not(feature = "redis"))]
        return Err("IDEMPOTENCY_STORE is a redis URL: run with `--features redis`".into());
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
    Err(format!(
        "IDEMPOTENCY_STORE={url:?}: expected memory, redis://…, redis+sentinel://… or postgres://…"
    )
    .into())
}

/// `IDEMPOTENCY_REDIS_WAIT=<replicas>:<timeout_ms>`, e.g. `1:200`; unset or empty is no `WAIT`.
#[cfg(feature = "redis")]
fn redis_wait_from_env() -> Result<Option<(std::num::NonZeroU32, Duration)>, BoxError> {
    let Ok(v) = std::env::var("IDEMPOTENCY_REDIS_WAIT") else {
        return Ok(None);
    };
    if v.is_empty() {
        return Ok(None);
    }
    let bad = || -> BoxError {
        format!(
            "IDEMPOTENCY_REDIS_WAIT={v:?}: expected <replicas>:<timeout_ms> with replicas at \
             least 1, e.g. 1:200"
        )
        .into()
    };
    let (n, ms) = v.split_once(':').ok_or_else(bad)?;
    let n = n.parse::<std::num::NonZeroU32>().map_err(|_| bad())?;
    let ms = ms.parse::<u64>().map_err(|_| bad())?;
    Ok(Some((n, Duration::from_millis(ms))))
}
