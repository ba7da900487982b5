//! The examples' `IDEMPOTENCY_STORE` selection, against the real servers. One test in its own
//! binary, because it sets environment variables.

mod common;
#[path = "../examples/common/mod.rs"]
mod example_env;
mod redis_harness;

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

/// The shop example binary, built by `cargo test` beside this test.
fn shop_binary() -> std::path::PathBuf {
    let mut path = std::env::current_exe().unwrap();
    path.pop();
    if path.ends_with("deps") {
        path.pop();
    }
    path.join("examples").join("shop")
}

/// Runs the shop against `store` and returns its exit status and stderr; it must end on its
/// own (a usable store would make it serve, and this test would time out).
fn shop_with_store(store: &str) -> (Option<i32>, String) {
    let out = std::process::Command::new(shop_binary())
        .env("IDEMPOTENCY_STORE", store)
        .env("SHOP_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "off")
        .output()
        .expect("the shop example is built by cargo test");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unusable_store_ends_the_example_with_one_line_and_status_1() {
    let (code, stderr) = shop_with_store("mysql://localhost/db");
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("shop: IDEMPOTENCY_STORE="), "{stderr}");
    assert!(!stderr.contains("Error: "), "no Debug dump: {stderr}");

    #[cfg(feature = "redis")]
    if let Some(mut server) =
        redis_harness::RedisServer::start(&["--maxmemory-policy", "volatile-lru"])
    {
        let (code, stderr) = shop_with_store(&server.url());
        assert_eq!(code, Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains("noeviction"), "says what to set: {stderr}");
        assert!(
            !stderr.contains("EvictionPolicy {"),
            "no Debug dump: {stderr}"
        );
        server.stop();
    }

    #[cfg(feature = "postgres")]
    {
        let port = redis_harness::free_port();
        let (code, stderr) = shop_with_store(&format!("postgres://postgres@127.0.0.1:{port}/test"));
        assert_eq!(code, Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.to_lowercase().contains("refused"),
            "names the cause: {stderr}"
        );
    }
}
