//! `PostgresStore` across a Postgres restart: the pool drops its dead connections and the
//! store works again.
//!
//! A test binary of its own (not a module of `tests/stores`), because restarting the server
//! breaks every session: cargo runs test binaries one after another, so no other test shares
//! this moment. Needs `IDEMPOTENCY_TEST_POSTGRES_URL` pointing at the local cluster and
//! `pg_ctlcluster` (Debian's postgresql-common) with the right to use it; skipped with a
//! printed reason otherwise, unless `IDEMPOTENCY_REQUIRE_BACKENDS=1`.
#![cfg(all(feature = "conformance", feature = "postgres"))]

mod support;
use support::pg as pg_support;
use tower_idempotency::conformance;

use std::process::Command;
use std::time::Duration;

use conformance::{fp, response, unique_id};
use pg_support::{store_in, TestSchema};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::RecordState;
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError, StoreErrorKind,
};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

fn skip(why: &str) {
    if std::env::var("IDEMPOTENCY_REQUIRE_BACKENDS").as_deref() == Ok("1") {
        panic!("cannot restart Postgres ({why}) but IDEMPOTENCY_REQUIRE_BACKENDS=1");
    }
    eprintln!("SKIPPED: cannot restart Postgres: {why}");
}

/// The one cluster under /etc/postgresql, as (version, name).
fn cluster() -> Result<(String, String), String> {
    let versions: Vec<_> = std::fs::read_dir("/etc/postgresql")
        .map_err(|e| format!("/etc/postgresql: {e}"))?
        .filter_map(|e| e.ok())
        .collect();
    let [version] = versions.as_slice() else {
        return Err(format!(
            "expected one version in /etc/postgresql, found {}",
            versions.len()
        ));
    };
    let name = if version.path().join("main").exists() {
        "main".to_owned()
    } else {
        return Err("no cluster named main".to_owned());
    };
    Ok((version.file_name().to_string_lossy().into_owned(), name))
}

fn ctl(version: &str, name: &str, action: &str) -> Result<(), String> {
    let out = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", version, name, action])
        .output()
        .map_err(|e| format!("pg_ctlcluster: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pg_ctlcluster failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Runs `op` until it succeeds, at most 20 times, 250 ms apart. Every failure on the way
/// must say "unavailable" or, for a statement sent on a connection that died, "unknown".
async fn until_ok<T, F, Fut>(what: &str, mut op: F) -> (T, Vec<StoreErrorKind>)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut failures = Vec::new();
    for _ in 0..20 {
        match op().await {
            Ok(v) => return (v, failures),
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        StoreErrorKind::Unavailable | StoreErrorKind::Unknown
                    ),
                    "{what} after a restart failed with {e:?}"
                );
                failures.push(e.kind());
                tokio::time::sleep(Duration::from_millis(250)).await; // the server's start-up
            }
        }
    }
    panic!("{what} never recovered after the restart: {failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_recovers_after_a_postgres_restart() {
    let Some(url) = pg_support::url() else { return };
    let (version, name) = match cluster() {
        Ok(c) => c,
        Err(why) => return skip(&why),
    };
    let schema = TestSchema::create(&url, "restart").await;
    let store: PostgresStore = store_in(&url, &schema, 4, "tidem-restart").await;

    // A completed record, and four pooled connections with prepared statements.
    let id = unique_id("before");
    let token = match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    };
    store
        .complete(&id, &token, &response(201, "kept"), TTL)
        .await
        .unwrap();
    // Four connections held at once, so the pool opens all four (four concurrent gets may
    // finish before the last one starts and share three); then gets prepare statements.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(store.pool().get().await.expect("a pooled connection"));
    }
    drop(held);
    assert_eq!(store.pool().status().size, 4);
    let warm: Vec<_> = (0..4)
        .map(|_| {
            let (store, id) = (store.clone(), id);
            tokio::spawn(async move { store.get(&id).await })
        })
        .collect();
    for w in warm {
        w.await.unwrap().unwrap();
    }

    let ctl = |action: &'static str| {
        let (version, name) = (version.clone(), name.clone());
        tokio::task::spawn_blocking(move || ctl(&version, &name, action))
    };
    if let Err(why) = ctl("stop").await.unwrap() {
        schema.drop_now().await;
        return skip(&why);
    }
    // While the server is down: a read is Unavailable (nothing can have happened), and a
    // claim is Unavailable or, if it went out on a connection that then died, Unknown;
    // never Claimed.
    let down = store.get(&id).await;
    let claim_down = store
        .claim(&ClaimRequest::new(&unique_id("down"), &fp(3), LEASE, TTL))
        .await;
    ctl("start").await.unwrap().expect("pg_ctlcluster start");
    let err = down.expect_err("a read with the server down");
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the driver error is kept"
    );
    let err = claim_down.expect_err("a claim with the server down");
    println!(
        "while down: get {:?}, claim {:?}",
        StoreErrorKind::Unavailable,
        err.kind()
    );
    assert!(
        matches!(
            err.kind(),
            StoreErrorKind::Unavailable | StoreErrorKind::Unknown
        ),
        "{err:?}"
    );

    // Back up. The first calls may still fail the same way; then the store works again.
    let (record, failures) = until_ok("get", || store.get(&id)).await;
    println!("failures before the first success after the restart: {failures:?}");
    assert_eq!(
        record.expect("a committed record survives a restart").state,
        RecordState::Completed(response(201, "kept"))
    );
    // Once one call went through, the others do too: four at once, on fresh connections.
    let after: Vec<_> = (0..4)
        .map(|_| {
            let (store, id) = (store.clone(), id);
            tokio::spawn(async move { store.get(&id).await })
        })
        .collect();
    for a in after {
        assert!(a.await.unwrap().expect("get after recovery").is_some());
    }
    // A whole new request: claim, complete, replay.
    let fresh = unique_id("after");
    let token = match store
        .claim(&ClaimRequest::new(&fresh, &fp(2), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    };
    store
        .complete(&fresh, &token, &response(200, "new"), TTL)
        .await
        .unwrap();
    match store
        .claim(&ClaimRequest::new(&fresh, &fp(2), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(200, "new")))
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    drop(store);
    schema.drop_now().await;
}
