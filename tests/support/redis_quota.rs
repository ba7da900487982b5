//! Per-scope quota helpers shared by the single-node and the cluster Redis tests, and the
//! scenario both run: a full scope refuses new keys while its records answer.
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, Instant};

use tower_idempotency::conformance::{fp, response};
use tower_idempotency::store::redis::RedisStore;
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError, StoreErrorKind,
};
use tower_idempotency::store::{RecordId, RecordState, ScopeId, Token};

pub const LEASE: Duration = Duration::from_secs(30);
pub const TTL: Duration = Duration::from_secs(600);

/// A scope and record ids in it, unique to this run.
pub fn scoped(label: &str) -> (ScopeId, impl Fn(&str) -> RecordId) {
    let name = format!("{label}-{}-{:?}", std::process::id(), Instant::now());
    let scope = ScopeId::new(Some(&name));
    (scope, move |key: &str| RecordId::new(Some(&name), key))
}

pub async fn claim_in(
    store: &RedisStore,
    scope: &ScopeId,
    id: &RecordId,
) -> Result<ClaimOutcome, StoreError> {
    store
        .claim(&ClaimRequest::new(id, &fp(1), LEASE, TTL).in_scope(scope))
        .await
}

pub fn token_of(outcome: ClaimOutcome) -> Token {
    match outcome {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// On `store`, quota 2 records per scope: tenant a's third key is refused and writes
/// nothing; its own records still answer (in progress, then replayed), with a renewal in
/// between when `renew` is set; tenant b claims; a release gives a its place back at once.
/// Returns a's scope and its ids, for steps of the caller's own.
pub async fn a_full_scope_refuses_new_keys_while_its_records_answer(
    store: &RedisStore,
    renew: bool,
) -> (ScopeId, impl Fn(&str) -> RecordId) {
    let (a, in_a) = scoped("tenant-a");
    let (b, in_b) = scoped("tenant-b");
    let first = token_of(claim_in(store, &a, &in_a("k1")).await.unwrap());
    let second = token_of(claim_in(store, &a, &in_a("k2")).await.unwrap());
    let err = claim_in(store, &a, &in_a("k3")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
    assert!(
        store.get(&in_a("k3")).await.unwrap().is_none(),
        "a refused claim writes nothing"
    );

    // The scope's own records still answer: a retry in progress, then a replay.
    match claim_in(store, &a, &in_a("k1")).await.unwrap() {
        ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::InProgress { .. })),
        other => panic!("{other:?}"),
    }
    if renew {
        store.extend(&in_a("k1"), &first, LEASE).await.unwrap();
    }
    store
        .complete(&in_a("k1"), &first, &response(201, "kept"), TTL)
        .await
        .unwrap();
    match claim_in(store, &a, &in_a("k1")).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "kept")))
        }
        other => panic!("{other:?}"),
    }
    // Another tenant is not affected.
    token_of(claim_in(store, &b, &in_b("k1")).await.unwrap());

    // A release gives the scope its record back at once.
    store.release(&in_a("k2"), &second).await.unwrap();
    token_of(claim_in(store, &a, &in_a("k3")).await.unwrap());
    let err = claim_in(store, &a, &in_a("k4")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
    (a, in_a)
}

/// Waits (at most 10 s) until Redis has expired `id`'s record.
pub async fn wait_until_expired(store: &RedisStore, id: &RecordId) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.get(id).await.unwrap().is_some() {
        assert!(Instant::now() < deadline, "the record never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
