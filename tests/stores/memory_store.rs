//! The conformance suite on `MemoryStore`.

use tower_idempotency::{conformance, conformance_suite};

use std::num::NonZeroUsize;
use std::sync::Arc;

use conformance::DynStore;
use tower_idempotency::store::MemoryStore;

conformance_suite! {
    store: async { Some(Arc::new(MemoryStore::new()) as DynStore) },
    full: async {
        let store = MemoryStore::builder()
            .with_max_records(NonZeroUsize::new(40).unwrap())
            .build();
        Some(Arc::new(store) as DynStore)
    },
    admin: async { Some(Arc::new(MemoryStore::new()) as conformance::DynAdminStore) },
    recovery: async { Some(Arc::new(MemoryStore::new()) as DynStore) },
}

#[tokio::test]
async fn byte_budget_also_refuses_claims() {
    let store = MemoryStore::builder()
        .with_max_bytes(NonZeroUsize::new(200 * 1024).unwrap())
        .build();
    conformance::full_store_refuses_claims_and_keeps_records(Arc::new(store)).await;
}

#[tokio::test]
async fn a_recorded_body_keeps_only_its_own_bytes_not_the_buffer_it_came_from() {
    use bytes::Bytes;
    use std::time::Duration;
    use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore};
    use tower_idempotency::store::{Completion, Fingerprint, RecordId, StoredResponse};

    let store = MemoryStore::new();
    let id = RecordId::new(Some("tenant"), "exact-bytes");
    let fp = Fingerprint::from_bytes([1; 32]);
    let ttl = Duration::from_secs(60);
    let ClaimOutcome::Claimed(claim) = store
        .claim(&ClaimRequest::new(&id, &fp, Duration::from_secs(30), ttl))
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed")
    };
    // Ten bytes of a 1 MiB buffer, as a frozen, oversized `BytesMut` would be.
    let buffer = Bytes::from(vec![7u8; 1 << 20]);
    let completion = Completion::Response(StoredResponse::new(
        http::StatusCode::OK,
        http::HeaderMap::new(),
        buffer.slice(0..10),
        None,
    ));
    store
        .complete(&id, &claim.token, &completion, ttl)
        .await
        .unwrap();
    drop(completion);
    assert!(
        buffer.is_unique(),
        "the store must not keep the 1 MiB buffer alive for 10 bytes"
    );
}

/// Claims `key` in `tenant`'s scope.
async fn claim_in(
    store: &MemoryStore,
    tenant: &str,
    key: &str,
    fp: tower_idempotency::store::Fingerprint,
    lease: std::time::Duration,
    ttl: std::time::Duration,
) -> Result<tower_idempotency::store::ClaimOutcome, tower_idempotency::store::StoreError> {
    use tower_idempotency::store::{ClaimRequest, IdempotencyStore};
    use tower_idempotency::store::{RecordId, ScopeId};
    let scope = ScopeId::new(Some(tenant));
    let id = RecordId::new(Some(tenant), key);
    store
        .claim(&ClaimRequest::new(&id, &fp, lease, ttl).in_scope(&scope))
        .await
}

#[tokio::test]
async fn a_scope_over_its_quota_is_refused_while_other_scopes_still_claim() {
    use std::time::Duration;
    use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, StoreErrorKind};
    use tower_idempotency::store::{Fingerprint, RecordId};

    let store = MemoryStore::builder()
        .with_max_records_per_scope(NonZeroUsize::new(3).unwrap())
        .build();
    let fp = Fingerprint::from_bytes([2; 32]);
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let claim = |tenant, key| claim_in(&store, tenant, key, fp, lease, ttl);
    let mut tokens = Vec::new();
    for key in ["k1", "k2", "k3"] {
        match claim("alice", key).await.unwrap() {
            ClaimOutcome::Claimed(c) => tokens.push((key, c.token)),
            other => panic!("{key} is new: {other:?}"),
        }
    }
    let over = claim("alice", "k4").await.unwrap_err();
    assert_eq!(over.kind(), StoreErrorKind::QuotaExceeded);
    // Another tenant is not affected, and alice's own records still answer.
    assert!(matches!(
        claim("bob", "k1").await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    assert!(matches!(
        claim("alice", "k1").await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    // A released record frees its place.
    let (key, token) = tokens[0];
    store
        .release(&RecordId::new(Some("alice"), key), &token)
        .await
        .unwrap();
    assert!(matches!(
        claim("alice", "k4").await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    // Claims without a scope are not counted against any scope.
    for key in ["u1", "u2", "u3", "u4"] {
        let id = RecordId::new(None, key);
        assert!(matches!(
            store
                .claim(&ClaimRequest::new(&id, &fp, lease, ttl))
                .await
                .unwrap(),
            ClaimOutcome::Claimed(_)
        ));
    }
}

#[tokio::test]
async fn a_scope_over_its_byte_quota_is_refused_while_other_scopes_still_claim() {
    use bytes::Bytes;
    use std::time::Duration;
    use tower_idempotency::store::{ClaimOutcome, IdempotencyStore, StoreErrorKind};
    use tower_idempotency::store::{Completion, Fingerprint, RecordId, StoredResponse};

    // 8 KiB per scope; one recorded answer of 10,000 bytes is over it on its own.
    let store = MemoryStore::builder()
        .with_max_bytes_per_scope(NonZeroUsize::new(8 * 1024).unwrap())
        .build();
    let fp = Fingerprint::from_bytes([3; 32]);
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
    let claim = |tenant, key| claim_in(&store, tenant, key, fp, lease, ttl);
    // Small in-progress records fit: the budget counts bytes, not records.
    let mut small = Vec::new();
    for key in ["s1", "s2", "s3"] {
        match claim("alice", key).await.unwrap() {
            ClaimOutcome::Claimed(c) => small.push((key, c.token)),
            other => panic!("{key} is new: {other:?}"),
        }
    }
    let ClaimOutcome::Claimed(big) = claim("alice", "big").await.unwrap() else {
        panic!("a fourth small claim still fits in 8 KiB")
    };
    let answer = Completion::Response(StoredResponse::new(
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        Bytes::from(vec![b'x'; 10_000]),
        None,
    ));
    let big_id = RecordId::new(Some("alice"), "big");
    store
        .complete(&big_id, &big.token, &answer, ttl)
        .await
        .unwrap();
    // Now the scope holds more than its budget: its new keys are refused.
    let over = claim("alice", "next").await.unwrap_err();
    assert_eq!(over.kind(), StoreErrorKind::QuotaExceeded);
    // Another tenant is not affected, and alice's recorded answer still replays.
    assert!(matches!(
        claim("bob", "next").await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    match claim("alice", "big").await.unwrap() {
        ClaimOutcome::Existing(r) => assert_eq!(
            r.state,
            tower_idempotency::store::RecordState::Completed(answer.clone())
        ),
        other => panic!("expected a replay, got {other:?}"),
    }
    // Releasing small records does not bring the scope under 8 KiB: still refused.
    for (key, token) in small {
        store
            .release(&RecordId::new(Some("alice"), key), &token)
            .await
            .unwrap();
    }
    assert_eq!(
        claim("alice", "next").await.unwrap_err().kind(),
        StoreErrorKind::QuotaExceeded
    );
}
