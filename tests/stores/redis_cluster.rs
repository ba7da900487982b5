//! `RedisStore` on a private three-primary Redis Cluster: the whole conformance suite (with and
//! without per-scope quotas), the eviction guard on every node, NOSCRIPT recovery through the
//! cluster client, `WAIT`, and per-scope quotas (each scope's keys in one slot).
//!
//! The cluster is started once per test binary and lives in a static; the harness's watchdogs
//! stop its servers when the binary exits.
use crate::support::redis_harness;
use crate::support::redis_quota;
use tower_idempotency::{conformance, conformance_suite};

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use conformance::{fp, response, unique_id, DynStore};
use redis_harness::{RedisCluster, RedisServer};
use redis_quota::{claim_in, scoped, token_of, TTL};
use tower_idempotency::store::redis::{RedisStore, RedisStoreBuilder, SetupError};
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyAdmin, IdempotencyStore, Removal, StoreErrorKind,
};
use tower_idempotency::store::{RecordId, RecordState};

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
    admin: async { Some(Arc::new(cluster_store().await?) as conformance::DynAdminStore) },
    recovery: async { Some(Arc::new(cluster_store().await?) as DynStore) },
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
                .claim(&ClaimRequest::new(
                    &id,
                    &fp(1),
                    Duration::from_secs(30),
                    Duration::from_secs(60)
                ))
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

/// On a cluster the plain claim (`SET … NX GET`, then `PTTL` for a record in progress, one key) goes to the key's slot
/// like a script: a live lease is a conflict, a lapsed one is taken over by the script at
/// generation 2, and the old token is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_claims_conflict_and_lapsed_leases_are_taken_over_on_the_cluster() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let cluster = cluster().unwrap();
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(600));
    let claim = |id: &RecordId| {
        let store = store.clone();
        let id = *id;
        async move {
            store
                .claim(&ClaimRequest::new(&id, &fp(1), lease, ttl))
                .await
                .unwrap()
        }
    };
    for i in 0..6 {
        let id = unique_id(&format!("cluster-plain-{i}"));
        let first = match claim(&id).await {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("{other:?}"),
        };
        assert_eq!(first.token.generation(), 1);
        assert!(matches!(
            claim(&id).await,
            ClaimOutcome::Existing(r) if matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > lease / 2)
        ));
        // An expiry closer than the record's gap (ttl - lease) is a lapsed lease.
        let gap = (ttl - lease).as_millis() - 1000;
        let key = store.key(&id);
        let set = cluster.nodes()[0].cli(&["-c", "pexpire", &key, &gap.to_string()]);
        assert_eq!(set.trim(), "1", "{set}");
        let second = match claim(&id).await {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("{other:?}"),
        };
        assert!(second.takeover);
        assert_eq!(second.token.generation(), 2);
        let fenced = store
            .complete(&id, &first.token, &response(200, "late"), ttl)
            .await
            .unwrap_err();
        assert_eq!(fenced.kind(), StoreErrorKind::Fenced);
        store
            .complete(&id, &second.token, &response(201, "second"), ttl)
            .await
            .unwrap();
        assert!(matches!(
            claim(&id).await,
            ClaimOutcome::Existing(r) if r.state == RecordState::Completed(response(201, "second"))
        ));
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
        .claim(&ClaimRequest::new(
            &id,
            &fp(2),
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("{other:?}"),
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
        // No replicas: each write's WAIT is meant to fall short.
        .with_replica_check(false)
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
        let err = waiting
            .claim(&ClaimRequest::new(&id, &fp(1), lease, lease))
            .await
            .unwrap_err();
        let source =
            std::error::Error::source(&err).and_then(|s| s.downcast_ref::<ReplicationShortfall>());
        assert_eq!(source, none, "{err:?}");
        assert!(plain.get(&id).await.unwrap().is_none(), "given back");

        let ClaimOutcome::Claimed(c) = plain
            .claim(&ClaimRequest::new(&id, &fp(1), lease, lease))
            .await
            .unwrap()
        else {
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

/// A store on the shared cluster with per-scope quotas, under a prefix of its own.
async fn quota_store(records: Option<usize>, bytes: Option<usize>) -> Option<RedisStore> {
    let cluster = tokio::task::spawn_blocking(cluster).await.unwrap()?;
    Some(
        quota_builder(records, bytes)
            .connect_cluster(cluster.urls())
            .await
            .unwrap(),
    )
}

fn quota_builder(records: Option<usize>, bytes: Option<usize>) -> RedisStoreBuilder {
    let prefix = format!(
        "tidem-cq-{}-{}:",
        std::process::id(),
        unique_id("p").to_hex()
    );
    let mut builder = RedisStore::builder().with_key_prefix(prefix);
    if let Some(n) = records {
        builder = builder.with_max_records_per_scope(NonZeroUsize::new(n).unwrap());
    }
    if let Some(n) = bytes {
        builder = builder.with_max_bytes_per_scope(NonZeroUsize::new(n).unwrap());
    }
    builder
}

/// The conformance suite with quotas set (too large to refuse anything): every record in its
/// scope group's layout, on the cluster.
mod with_quotas {
    use super::*;

    conformance_suite! {
        store: async {
            Some(Arc::new(quota_store(Some(1_000_000), Some(1 << 40)).await?) as DynStore)
        },
        admin: async {
            let store = quota_store(Some(1_000_000), Some(1 << 40)).await?;
            Some(Arc::new(store) as conformance::DynAdminStore)
        },
        recovery: async {
            Some(Arc::new(quota_store(Some(1_000_000), Some(1 << 40)).await?) as DynStore)
        },
    }
}

/// The key of `id`'s scope group: its records (`'s'`) or its counts (`'b'`).
fn group_key(store: &RedisStore, id: &RecordId, which: char) -> String {
    let key = store.key(id);
    let (head, _) = key.split_once('}').unwrap();
    format!("{head}}}{which}")
}

fn keyslot(key: &str) -> u16 {
    let node = &cluster().unwrap().nodes()[0];
    node.cli(&["cluster", "keyslot", key])
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_scope_refuses_new_keys_on_a_cluster_while_its_records_replay() {
    let Some(store) = quota_store(Some(2), None).await else {
        return;
    };
    let (a, in_a) =
        redis_quota::a_full_scope_refuses_new_keys_while_its_records_answer(&store, true).await;
    // As a release does, the operator's delete gives the scope its record back.
    assert_eq!(store.delete(&in_a("k1")).await.unwrap(), Removal::Removed);
    token_of(claim_in(&store, &a, &in_a("k4")).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_quota_counts_recorded_answers_on_a_cluster() {
    // One record in progress is 146 bytes (header and scope); a 600-byte answer puts the
    // scope over a 700-byte budget.
    let Some(store) = quota_store(None, Some(700)).await else {
        return;
    };
    let (a, in_a) = scoped("bytes");
    let (b, in_b) = scoped("bytes-other");
    let token = token_of(claim_in(&store, &a, &in_a("k1")).await.unwrap());
    let answer = response(201, vec![b'x'; 600]);
    store
        .complete(&in_a("k1"), &token, &answer, TTL)
        .await
        .unwrap();
    let err = claim_in(&store, &a, &in_a("k2")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
    token_of(claim_in(&store, &b, &in_b("k1")).await.unwrap());

    // The scope's total is the stored size of its record, read on the slot's node.
    let node = &cluster().unwrap().nodes()[0];
    let key = store.key(&in_a("k1"));
    let total = node.cli(&[
        "-c",
        "hget",
        &group_key(&store, &in_a("k1"), 'b'),
        &format!("t{}", a.to_hex()),
    ]);
    let stored = node.cli(&["-c", "strlen", &key]);
    assert_eq!(total.trim(), stored.trim());
    assert_eq!(stored.trim(), (146 + answer.encode().len()).to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_holds_under_concurrent_claims_on_a_cluster() {
    let Some(store) = quota_store(Some(5), None).await else {
        return;
    };
    let (a, in_a) = scoped("racing");
    let ids: Vec<RecordId> = (0..40).map(|i| in_a(&format!("k{i}"))).collect();
    let claims = ids.iter().map(|id| claim_in(&store, &a, id));
    let outcomes = futures_util::future::join_all(claims).await;
    let claimed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(ClaimOutcome::Claimed(_))))
        .count();
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o, Err(e) if e.kind() == StoreErrorKind::QuotaExceeded))
        .count();
    assert_eq!((claimed, refused), (5, 35), "{outcomes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scopes_records_and_counts_share_one_slot_and_scopes_spread() {
    let Some(store) = quota_store(Some(100), Some(1 << 20)).await else {
        return;
    };
    let mut slots = std::collections::BTreeSet::new();
    for s in 0..12 {
        let (a, in_a) = scoped(&format!("slot-{s}"));
        let mut keys = Vec::new();
        for k in 0..5 {
            let id = in_a(&format!("k{k}"));
            let token = token_of(claim_in(&store, &a, &id).await.unwrap());
            store
                .complete(&id, &token, &response(200, "x"), TTL)
                .await
                .unwrap();
            keys.push(store.key(&id));
        }
        let id = in_a("k0");
        keys.extend([group_key(&store, &id, 's'), group_key(&store, &id, 'b')]);
        let slot = keyslot(&keys[0]);
        for key in &keys {
            assert_eq!(keyslot(key), slot, "{key} is in the slot of {}", keys[0]);
        }
        slots.insert(slot);
    }
    // Scopes are placed by their tag: twelve scopes do not all land in one slot.
    assert!(slots.len() > 1, "{slots:?}");
}

/// With `WAIT` and quotas, a claim and its `WAIT` go as one pipeline to the scope's primary;
/// a claim no replica confirmed is given back, and its scope counts it no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_with_quotas_gives_an_unconfirmed_claim_back_to_its_scope() {
    use std::num::NonZeroU32;
    let Some(cluster) = tokio::task::spawn_blocking(cluster).await.unwrap() else {
        return;
    };
    let builder = quota_builder(Some(1), None);
    let plain = builder
        .clone()
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let waiting = builder
        .with_wait(NonZeroU32::new(1).unwrap(), Duration::from_millis(50))
        // No replicas: each write's WAIT is meant to fall short.
        .with_replica_check(false)
        .connect_cluster(cluster.urls())
        .await
        .unwrap();
    let (a, in_a) = scoped("waiting");
    for k in 0..3 {
        let id = in_a(&format!("k{k}"));
        let err = claim_in(&waiting, &a, &id).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
        assert!(plain.get(&id).await.unwrap().is_none(), "given back");
    }
    // The scope's one slot is free: the given-back claims count no more.
    let id = in_a("last");
    let token = token_of(claim_in(&plain, &a, &id).await.unwrap());
    let err = waiting
        .complete(&id, &token, &response(200, "x"), TTL)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    assert_eq!(
        plain.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(200, "x"))
    );
}
