//! The examples' `IDEMPOTENCY_STORE` selection, against the real servers. One test, because it
//! sets environment variables: it alone in this binary sets or reads `IDEMPOTENCY_STORE`.

use crate::app;
use crate::example_env;
#[cfg(any(feature = "redis", feature = "postgres"))]
use crate::support::backend as common;
#[cfg(feature = "redis")]
use crate::support::failover as failover_harness;
#[cfg(any(feature = "redis", feature = "postgres"))]
use crate::support::redis_harness;

use std::time::Duration;

use tower_idempotency::store::ClaimOutcome;
use tower_idempotency::store::{ClaimRequest, Fingerprint, RecordId};

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
        .claim(&ClaimRequest::new(
            &id,
            &fp,
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert!(
        matches!(claimed, ClaimOutcome::Claimed(_)),
        "{url}: {claimed:?}"
    );
    let again = store
        .claim(&ClaimRequest::new(
            &id,
            &fp,
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
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
    a_retry_sent_at_once_after_a_released_answer_runs("memory").await;
    #[cfg(feature = "redis")]
    if let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") {
        claims_a_fresh_key(&url).await;
        a_retry_sent_at_once_after_a_released_answer_runs(&url).await;
    }
    #[cfg(feature = "postgres")]
    if let Some(url) = common::backend_url("IDEMPOTENCY_TEST_POSTGRES_URL") {
        claims_a_fresh_key(&url).await;
        a_retry_sent_at_once_after_a_released_answer_runs(&url).await;
    }
    #[cfg(feature = "redis")]
    sentinel_and_wait_come_from_the_environment().await;
    std::env::set_var("IDEMPOTENCY_STORE", "mysql://localhost/db");
    let err = example_env::store_from_env()
        .await
        .err()
        .expect("unknown schemes are refused");
    assert!(err.to_string().contains("expected memory, redis"), "{err}");
}

/// `redis+sentinel://` and `IDEMPOTENCY_REDIS_WAIT`, on a primary with one replica and three
/// Sentinels: a WAIT the replicas can meet claims, one they cannot is refused at start-up,
/// and a malformed setting names the form.
#[cfg(feature = "redis")]
async fn sentinel_and_wait_come_from_the_environment() {
    let Some(topology) = failover_harness::Topology::start(1) else {
        return;
    };
    let url = topology.sentinel_url();
    std::env::set_var("IDEMPOTENCY_REDIS_WAIT", "1:500");
    claims_a_fresh_key(&url).await;
    std::env::set_var("IDEMPOTENCY_REDIS_WAIT", "2:500");
    std::env::set_var("IDEMPOTENCY_STORE", &url);
    let err = example_env::store_from_env()
        .await
        .err()
        .expect("WAIT 2 of 1");
    assert!(err.to_string().contains("1 connected replica(s)"), "{err}");
    for bad in ["1", "0:200", "x:1", "1:y"] {
        std::env::set_var("IDEMPOTENCY_REDIS_WAIT", bad);
        let err = example_env::store_from_env().await.err().expect(bad);
        assert!(
            err.to_string().contains("<replicas>:<timeout_ms>"),
            "{bad}: {err}"
        );
    }
    std::env::remove_var("IDEMPOTENCY_REDIS_WAIT");
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

/// The shop on `url`'s store: a retry sent at once after each released answer (a 400, then a
/// 503 from the card network) runs again, because the layer frees the key before answering.
async fn a_retry_sent_at_once_after_a_released_answer_runs(url: &str) {
    use tower::ServiceExt;
    std::env::set_var("IDEMPOTENCY_STORE", url);
    let store = example_env::store_from_env()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let config = app::ShopConfig {
        card_latency: Duration::from_millis(1),
        timing: tower_idempotency::Timing::default(),
    };
    let (router, shop) = app::app(store, config);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let pay = |key: &str, body: &str| {
        http::Request::post("/v1/payments")
            .header("content-type", "application/json")
            .header(
                "idempotency-key",
                format!("{key}-{}-{nanos}", std::process::id()),
            )
            .body(axum::body::Body::from(body.to_owned()))
            .unwrap()
    };
    let send = |req| router.clone().oneshot(req);
    let bad = send(pay("fix", r#"{"amount":0,"currency":"EUR"}"#))
        .await
        .unwrap();
    assert_eq!(bad.status(), 400, "{url}");
    let fixed = send(pay("fix", r#"{"amount":7,"currency":"EUR"}"#))
        .await
        .unwrap();
    assert_eq!(fixed.status(), 201, "{url}: the corrected body ran at once");
    let outage = send(pay("outage", r#"{"amount":503,"currency":"EUR"}"#))
        .await
        .unwrap();
    assert_eq!(outage.status(), 503, "{url}");
    let retry = send(pay("outage", r#"{"amount":503,"currency":"EUR"}"#))
        .await
        .unwrap();
    assert_eq!(retry.status(), 503, "{url}: the retry ran again, not 409");
    assert!(
        retry.headers().get("idempotent-replayed").is_none(),
        "{url}"
    );
    assert_eq!(
        shop.charges(),
        1,
        "{url}: one charge, for the corrected body"
    );
}
