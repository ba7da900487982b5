//! Retention and expiry: TTLs, and a full store that refuses rather than evicts.

use std::time::Duration;

use crate::store::RecordState;
use crate::store::{ClaimOutcome, ClaimRequest, StoreErrorKind};
use bytes::Bytes;

use super::{claim_token, fp, response, unique_id, DynStore, LEASE, TTL};

/// Guarantee 5: past its TTL a completed record is absent and the key is new.
pub async fn ttl_expiry_makes_the_key_new(store: DynStore) {
    let id = unique_id("ttl");
    let token = claim_token(&store, &id, fp(11), LEASE).await;
    let ttl = Duration::from_millis(1500);
    store
        .complete(&id, &token, &response(200, "kept"), ttl)
        .await
        .unwrap();
    assert!(store.get(&id).await.unwrap().is_some());
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    assert!(
        store.get(&id).await.unwrap().is_none(),
        "expired record must be absent"
    );
    match store
        .claim(&ClaimRequest::new(&id, &fp(12), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => assert!(!c.takeover),
        other => panic!("expired key must be new, got {other:?}"),
    }
}

/// A completed record is there for (most of) its TTL, not a thousandth of it, and gone after.
/// An in-progress record lives max(lease, TTL): the longer of the two, either way round.
pub async fn records_live_for_their_ttl_and_no_longer(store: DynStore) {
    let done = unique_id("ttl-4s");
    let t = claim_token(&store, &done, fp(20), LEASE).await;
    store
        .complete(&done, &t, &response(200, "kept"), Duration::from_secs(4))
        .await
        .unwrap();
    // Lease 1 s, TTL 3 s: kept 3 s, though the lease lapsed at 1 s.
    let ttl_longer = unique_id("ttl-longer");
    store
        .claim(&ClaimRequest::new(
            &ttl_longer,
            &fp(21),
            Duration::from_secs(1),
            Duration::from_secs(3),
        ))
        .await
        .unwrap();
    // Lease 3 s, TTL 1 s: kept while the lease lives.
    let lease_longer = unique_id("lease-longer");
    store
        .claim(&ClaimRequest::new(
            &lease_longer,
            &fp(22),
            Duration::from_secs(3),
            Duration::from_secs(1),
        ))
        .await
        .unwrap();

    tokio::time::sleep(Duration::from_secs(2)).await;
    for (id, what) in [(&ttl_longer, "TTL 3 s"), (&lease_longer, "lease 3 s")] {
        let rec = store.get(id).await.unwrap();
        assert!(
            matches!(rec, Some(ref r) if matches!(r.state, RecordState::InProgress { .. })),
            "in progress with {what}, at 2 s: {rec:?}"
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        store.get(&done).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(response(200, "kept"))),
        "completed with TTL 4 s, at 3 s"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        store.get(&ttl_longer).await.unwrap().is_none(),
        "TTL 3 s, at 3.6 s"
    );
    assert!(
        store.get(&lease_longer).await.unwrap().is_none(),
        "lease 3 s, at 3.6 s"
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(
        store.get(&done).await.unwrap().is_none(),
        "TTL 4 s, at 4.5 s"
    );
}

/// Retention counts from the completion, not from the claim.
pub async fn ttl_counts_from_completion(store: DynStore) {
    let id = unique_id("ttl-from-completion");
    let ttl = Duration::from_secs(2);
    let t = match store
        .claim(&ClaimRequest::new(&id, &fp(23), LEASE, ttl))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    store
        .complete(&id, &t, &response(201, "late"), ttl)
        .await
        .unwrap();
    // 2.5 s after the claim, 1 s after the completion.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        store.get(&id).await.unwrap().is_some(),
        "a completion 1 s ago with TTL 2 s must still be there"
    );
    // 1.5 s more: 2.5 s after the completion.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(store.get(&id).await.unwrap().is_none(), "past the TTL");
}

/// Fills `store` with completed records until it refuses a claim, then checks that the refusal
/// is `Full`, that nothing was evicted and that completed records still replay.
pub async fn full_store_refuses_claims_and_keeps_records(store: DynStore) {
    let body = Bytes::from(vec![0x5a; 16 * 1024]);
    let mut kept = Vec::new();
    let mut refused = None;
    for i in 0..20_000 {
        let id = unique_id(&format!("fill-{i}"));
        match store
            .claim(&ClaimRequest::new(&id, &fp(17), LEASE, TTL))
            .await
        {
            Ok(ClaimOutcome::Claimed(c)) => {
                // A completion may itself hit the limit; the claim stays then, and is kept too.
                let done = store
                    .complete(&id, &c.token, &response(201, body.clone()), TTL)
                    .await
                    .is_ok();
                kept.push((id, done));
            }
            Ok(other) => panic!("fresh id answered {other:?}"),
            Err(e) => {
                refused = Some((id, e));
                break;
            }
        }
    }
    let (refused_id, err) = refused.expect("store never filled up");
    assert_eq!(
        err.kind(),
        StoreErrorKind::Full,
        "refusal must be Full: {err:?}"
    );
    assert!(kept.len() > 1, "store filled before any record was kept");
    assert!(
        store.get(&refused_id).await.unwrap().is_none(),
        "a refused claim must leave nothing"
    );
    for (id, done) in &kept {
        let rec = store
            .get(id)
            .await
            .unwrap()
            .expect("a live record was evicted");
        if *done {
            assert_eq!(
                rec.state,
                RecordState::Completed(response(201, body.clone()))
            );
            match store
                .claim(&ClaimRequest::new(id, &fp(17), LEASE, TTL))
                .await
                .unwrap()
            {
                ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::Completed(_))),
                other => panic!("replay in a full store: {other:?}"),
            }
        }
    }
}
