//! `RedisStore` on a private three-primary Redis Cluster: the whole conformance suite, the
//! eviction guard on every node, and NOSCRIPT recovery through the cluster client.
//!
//! The cluster is started once per test binary and lives in a static; the harness's watchdogs
//! stop its servers when the binary exits.
#![cfg(feature = "redis")]

mod common;
use tower_idempotency::{conformance, conformance_suite};
mod redis_harness;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use conformance::{fp, response, unique_id, DynStore};
use redis_harness::{RedisCluster, RedisServer};
use tower_idempotency::store::redis::{RedisStore, SetupError};
use tower_idempotency::store::{ClaimOutcome, IdempotencyStore};
use tower_idempotency::RecordState;

/// The cluster shared by this binary's tests; `None` when the binaries are missing.
fn cluster() -> Option<&'static RedisCluster> {
    static CLUSTER: OnceLock<Option<RedisCluster>> = OnceLock::new();
    // Starting takes a few blocking seconds; the first test pays it, the others wait.
    CLUSTER.get_or_init(RedisCluster::start).as_ref()
}

async fn cluster_store() -> Option<RedisStore> {
    let cluster = tokio::task::spawn_blocking(cluster).await.unwrap()?;
    Some(
        RedisStore::connect_cluster(cluster.urls())
            .await
            .expect("connect to the cluster"),
    )
}

conformance_suite! {
    store: async { Some(Arc::new(cluster_store().await?) as DynStore) },
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_the_primaries() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let cluster = cluster().unwrap();
    for i in 0..30 {
        let id = unique_id(&format!("spread-{i}"));
        assert!(matches!(
            store
                .claim(
                    &id,
                    &fp(1),
                    Duration::from_secs(30),
                    Duration::from_secs(60)
                )
                .await
                .unwrap(),
            ClaimOutcome::Claimed(_)
        ));
    }
    // Every primary holds some records: the hash tag is the record id, not the prefix.
    for node in cluster.nodes() {
        let keys = node.cli(&["--scan", "--pattern", "idem:{*"]);
        assert!(
            keys.lines().count() > 0,
            "node {} holds no record",
            node.port()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_scripts_are_reloaded_on_the_cluster() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let cluster = cluster().unwrap();
    let id = unique_id("cluster-noscript");
    let token = match store
        .claim(
            &id,
            &fp(2),
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other @ ClaimOutcome::Existing(_) => panic!("{other:?}"),
    };
    for node in cluster.nodes() {
        assert_eq!(node.cli(&["script", "flush"]).trim(), "OK");
    }
    store
        .complete(
            &id,
            &token,
            &response(200, "reloaded"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(200, "reloaded"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_guard_checks_every_cluster_node() {
    // A cluster of its own: this test changes a node's policy.
    let Some(cluster) = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap()
    else {
        return;
    };
    let odd: &RedisServer = &cluster.nodes()[2];
    odd.cli(&["config", "set", "maxmemory-policy", "allkeys-lfu"]);
    let err = RedisStore::connect_cluster(cluster.urls())
        .await
        .unwrap_err();
    match &err {
        SetupError::EvictionPolicy { node, policy } => {
            assert_eq!(policy, "allkeys-lfu");
            assert!(
                node.as_deref()
                    .is_some_and(|n| n.ends_with(&format!(":{}", odd.port()))),
                "names the node: {node:?}"
            );
        }
        other => panic!("expected EvictionPolicy, got {other:?}"),
    }
    odd.cli(&["config", "set", "maxmemory-policy", "noeviction"]);
    RedisStore::connect_cluster(cluster.urls())
        .await
        .expect("all nodes noeviction");
}

/// With `WAIT`, each write and its `WAIT` go to the record's primary on a connection of their
/// own. This cluster has no replicas, so every write is confirmed by none: claims on every
/// primary fail and are given back, and a complete lands but reports the shortfall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_goes_to_the_records_primary_on_its_own_connection() {
    use std::num::NonZeroU32;
    use tower_idempotency::store::redis::ReplicationShortfall;
    let Some(plain) = cluster_store().await else {
        return;
    };
    let cluster = cluster().unwrap();
    let waiting = RedisStore::builder()
        .with_wait(NonZeroU32::new(1).unwrap(), Duration::from_millis(50))
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let none = Some(&ReplicationShortfall {
        acknowledged: 0,
        wanted: 1,
    });
    let lease = Duration::from_secs(30);
    // Ids spread over the primaries.
    for i in 0..12 {
        let id = unique_id(&format!("cluster-wait-{i}"));
        let err = waiting.claim(&id, &fp(1), lease, lease).await.unwrap_err();
        let source =
            std::error::Error::source(&err).and_then(|s| s.downcast_ref::<ReplicationShortfall>());
        assert_eq!(source, none, "{err:?}");
        assert!(plain.get(&id).await.unwrap().is_none(), "given back");

        let ClaimOutcome::Claimed(c) = plain.claim(&id, &fp(1), lease, lease).await.unwrap() else {
            panic!("a released key is claimable")
        };
        let err = waiting
            .complete(&id, &c.token, &response(200, "x"), lease)
            .await
            .unwrap_err();
        let source =
            std::error::Error::source(&err).and_then(|s| s.downcast_ref::<ReplicationShortfall>());
        assert_eq!(source, none, "{err:?}");
        assert_eq!(
            plain.get(&id).await.unwrap().unwrap().state,
            RecordState::Completed(response(200, "x"))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_are_refused_on_a_cluster_with_the_reason() {
    let Some(cluster) = tokio::task::spawn_blocking(cluster).await.unwrap() else {
        return;
    };
    let err = RedisStore::builder()
        .with_max_records_per_scope(std::num::NonZeroUsize::new(10).unwrap())
        .connect_cluster(cluster.urls())
        .await
        .unwrap_err();
    assert!(matches!(err, SetupError::QuotasOnCluster), "{err:?}");
    assert!(err.to_string().contains("single primary"), "{err}");
}
