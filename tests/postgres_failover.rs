//! `PostgresStore` through a promotion: a multi-host URL with
//! `target_session_attrs=read-write` in front of a private primary and a `pg_basebackup`
//! standby. When the old primary is fenced (read-only) and the standby promoted, the pooled
//! connections to the old primary answer SQLSTATE 25006; the store drops them and reconnects,
//! so no request fails on them.
#![cfg(all(feature = "conformance", feature = "postgres"))]

mod support;

use support::pg_failover;

use std::time::{Duration, Instant};

use pg_failover::PgPair;
use tokio_postgres::NoTls;
use tower_idempotency::conformance::{fp, unique_id};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

async fn sql(url: &str, statement: &str) {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client.simple_query(statement).await.unwrap();
}

async fn one_bool(url: &str, query: &str) -> bool {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client.query_one(query, &[]).await.unwrap().get(0)
}

/// Polls `check` until it holds, within `within`: waiting on a real server, not ordering.
async fn until(within: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_promotion_no_request_fails_on_a_connection_to_the_fenced_primary() {
    let Some(mut pair) = PgPair::start() else {
        return;
    };
    let (p, s) = (pair.primary.port, pair.standby.port);
    let url = format!(
        "postgres://postgres@127.0.0.1:{p},127.0.0.1:{s}/postgres\
         ?target_session_attrs=read-write&connect_timeout=2"
    );
    let store = PostgresStore::builder()
        .with_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    // Fill the pool with connections to the primary.
    let warm: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = unique_id("warm");
                store
                    .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
                    .await
            })
        })
        .collect();
    for w in warm {
        assert!(matches!(w.await.unwrap(), Ok(ClaimOutcome::Claimed(_))));
    }
    let kept = unique_id("kept");
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&kept, &fp(1), LEASE, TTL))
            .await,
        Ok(ClaimOutcome::Claimed(_))
    ));

    // Fence the old primary (read-only for every session, the pooled ones included), let
    // the standby replay all it has, promote it.
    let primary = pair.primary.url();
    sql(
        &primary,
        "ALTER SYSTEM SET default_transaction_read_only = on",
    )
    .await;
    sql(&primary, "SELECT pg_reload_conf()").await;
    until(
        Duration::from_secs(10),
        "the primary is fenced",
        async || {
            one_bool(
                &primary,
                "SELECT current_setting('transaction_read_only') = 'on'",
            )
            .await
        },
    )
    .await;
    let standby = pair.standby.url();
    until(
        Duration::from_secs(10),
        "the standby caught up",
        async || {
            let (client, conn) = tokio_postgres::connect(&primary, NoTls).await.unwrap();
            tokio::spawn(conn);
            let lsn: String = client
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .unwrap()
                .get(0);
            one_bool(
                &standby,
                &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            )
            .await
        },
    )
    .await;
    pair.standby.promote();
    assert!(!one_bool(&standby, "SELECT pg_is_in_recovery()").await);

    // Every pooled connection still points at the fenced node: none may fail a request.
    let mut failures = Vec::new();
    for _ in 0..20 {
        let id = unique_id("after");
        match store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
        {
            Ok(ClaimOutcome::Claimed(_)) => {}
            other => failures.push(format!("{other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    // The new primary has what the old one acknowledged before the fence.
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&kept, &fp(1), LEASE, TTL))
            .await,
        Ok(ClaimOutcome::Existing(_))
    ));
    // The old primary gone for good: the store is on the new one already.
    pair.primary.stop();
    let id = unique_id("gone");
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await,
        Ok(ClaimOutcome::Claimed(_))
    ));
}
