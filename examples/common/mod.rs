//! Settings both examples read from the environment.
// The examples and the tests that include this file each use part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use tower_idempotency::store::{IdempotencyStore, MemoryStore};
use tower_idempotency::Retention;

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

/// Logs to stderr; `RUST_LOG` overrides the default `info`.
pub(crate) fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=info".into()),
        )
        .init();
}

/// `CARD_LATENCY_MS` (default 50) and the retention from `IDEMPOTENCY_LEASE_MS` (default
/// 30000) and `IDEMPOTENCY_TTL_SECS` (default 86400).
pub(crate) fn settings_from_env() -> Result<(Duration, Retention), BoxError> {
    let num = |var: &str, default: u64| -> Result<u64, BoxError> {
        match std::env::var(var) {
            Ok(v) => v.parse().map_err(|e| format!("{var}={v:?}: {e}").into()),
            Err(_) => Ok(default),
        }
    };
    let card_latency = Duration::from_millis(num("CARD_LATENCY_MS", 50)?);
    let retention = Retention::new(
        Duration::from_millis(num("IDEMPOTENCY_LEASE_MS", 30_000)?),
        Duration::from_secs(num("IDEMPOTENCY_TTL_SECS", 86_400)?),
    )?;
    Ok((card_latency, retention))
}

/// The store `IDEMPOTENCY_STORE` names: unset or `memory`, `redis://…` (feature `redis`) or
/// `postgres://…` (feature `postgres`, migrated on start).
pub(crate) async fn store_from_env() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
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
