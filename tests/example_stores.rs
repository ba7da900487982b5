//! The examples' `IDEMPOTENCY_STORE` selection, against the real servers. One test in its own
//! binary, because it sets environment variables.

mod common;
#[path = "../examples/common/mod.rs"]
mod example_env;

use std::time::Duration;

use tower_idempotency::store::ClaimOutcome;
use tower_idempotency::{Fingerprint, RecordId};

async fn claims_a_fresh_key(url: &str) {
    std::env::set_var("IDEMPOTENCY_STORE", url);
    let store = example_env::store_from_env()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let id = RecordId::new(
        Some("example-stores"),
        &format!("{}-{nanos}", std::process::id()),
    );
    let fp = Fingerprint::from_bytes([9; 32]);
    let claimed = store
        .claim(&id, &fp, Duration::from_secs(30), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        matches!(claimed, ClaimOutcome::Claimed(_)),
        "{url}: {claimed:?}"
    );
    let again = store
        .claim(&id, &fp, Duration::from_secs(30), Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        matches!(again, ClaimOutcome::Existing(_)),
        "{url}: the store keeps what it claimed"
    );
}

#[tokio::test]
async fn idempotency_store_selects_memory_redis_or_postgres_and_refuses_others() {
    claims_a_fresh_key("memory").await;
    #[cfg(feature = "redis")]
    if let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") {
        claims_a_fresh_key(&url).await;
    }
    #[cfg(feature = "postgres")]
    if let Some(url) = common::backend_url("IDEMPOTENCY_TEST_POSTGRES_URL") {
        claims_a_fresh_key(&url).await;
    }
    std::env::set_var("IDEMPOTENCY_STORE", "mysql://localhost/db");
    let err = example_env::store_from_env()
        .await
        .err()
        .expect("unknown schemes are refused");
    assert!(err.to_string().contains("expected memory, redis"), "{err}");
}
