//! Fencing and takeover: lapsed leases, stale and forged tokens, a key's history.

use std::time::Duration;

use crate::store::{ClaimOutcome, ClaimRequest};
use crate::store::{RecordState, Token};

use super::{assert_fenced, claim_token, fp, response, unique_id, DynStore, LEASE, TTL};

/// Guarantee 2: a lapsed lease is taken over with generation + 1; the old token is fenced.
pub async fn lapsed_lease_is_taken_over_with_a_greater_generation(store: DynStore) {
    let id = unique_id("takeover");
    let short = Duration::from_millis(300);
    let old = claim_token(&store, &id, fp(5), short).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp(5), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
            )
        }
        other => panic!("live lease must not be taken over: {other:?}"),
    }
    tokio::time::sleep(short + Duration::from_millis(250)).await;
    // Another request may not take over, even with the lease lapsed.
    match store
        .claim(&ClaimRequest::new(&id, &fp(6), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(5));
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining == Duration::ZERO)
            );
        }
        other => panic!("a different fingerprint must not take over: {other:?}"),
    }
    let new = match store
        .claim(&ClaimRequest::new(&id, &fp(5), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            assert!(c.token.generation() > old.generation());
            // Optional: a store that tells how long the lease had lapsed must be right.
            if let Some(lapsed) = c.lapsed_for {
                assert!(
                    lapsed >= Duration::from_millis(200) && lapsed < Duration::from_secs(30),
                    "lapsed_for {lapsed:?}: the lease lapsed about 250 ms before"
                );
            }
            c.token
        }
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert_fenced(
        store.extend(&id, &old, LEASE).await,
        "extend with old token",
    );
    assert_fenced(
        store.complete(&id, &old, &response(200, "old"), TTL).await,
        "complete with old token",
    );
    assert_fenced(store.release(&id, &old).await, "release with old token");
    let rec = store.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.generation, new.generation());
    assert!(matches!(rec.state, RecordState::InProgress { .. }));
    store
        .complete(&id, &new, &response(201, "new"), TTL)
        .await
        .unwrap();
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "new"))
    );
}

/// Guarantee 3: `complete`, `extend` and `release` with a stale token change nothing.
pub async fn stale_tokens_change_nothing(store: DynStore) {
    let id = unique_id("stale");
    let token = claim_token(&store, &id, fp(7), LEASE).await;
    // Same generation, another nonce: a forged or foreign token.
    let forged = Token::generate(token.generation()).unwrap();
    let before = store.get(&id).await.unwrap().unwrap();
    assert_fenced(
        store.complete(&id, &forged, &response(200, "x"), TTL).await,
        "complete",
    );
    assert_fenced(store.extend(&id, &forged, LEASE).await, "extend");
    assert_fenced(store.release(&id, &forged).await, "release");
    let after = store.get(&id).await.unwrap().unwrap();
    assert_eq!(after.fingerprint, before.fingerprint);
    assert_eq!(after.generation, before.generation);
    assert!(matches!(after.state, RecordState::InProgress { .. }));

    // A holder that released, then a new claim of generation 1: the old token stays fenced.
    store.release(&id, &token).await.unwrap();
    let again = claim_token(&store, &id, fp(7), LEASE).await;
    assert_fenced(
        store
            .complete(&id, &token, &response(200, "late"), TTL)
            .await,
        "late complete",
    );
    assert_fenced(store.release(&id, &token).await, "late release");
    store
        .complete(&id, &again, &response(200, "fresh"), TTL)
        .await
        .unwrap();
    // Completed records cannot be released, extended or completed again.
    assert_fenced(store.release(&id, &again).await, "release after complete");
    assert_fenced(
        store.extend(&id, &again, LEASE).await,
        "extend after complete",
    );
    // Completing again with the same token is a resend: `Ok`, and the first answer stands.
    store
        .complete(&id, &again, &response(500, "twice"), TTL)
        .await
        .expect("complete resent with its own token");
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(200, "fresh"))
    );
    // Tokens for a record that never existed.
    let absent = unique_id("absent");
    assert_fenced(store.extend(&absent, &forged, LEASE).await, "extend absent");
    assert_fenced(
        store
            .complete(&absent, &forged, &response(200, "x"), TTL)
            .await,
        "complete absent",
    );
    // Releasing an absent record frees nothing, but the key is free: `Ok`.
    store
        .release(&absent, &forged)
        .await
        .expect("release of an absent record");
    assert!(store.get(&absent).await.unwrap().is_none());
}

/// Guarantee 10: releasing a takeover keeps the record, so the key's generation only grows
/// and the next claim of the same request is a takeover again, measured from the release.
pub async fn releasing_a_takeover_keeps_the_keys_history(store: DynStore) {
    let id = unique_id("released-takeover");
    let short = Duration::from_millis(300);
    let first = claim_token(&store, &id, fp(31), short).await;
    assert_eq!(first.generation(), 1);
    tokio::time::sleep(short + Duration::from_millis(250)).await;
    let second = match store
        .claim(&ClaimRequest::new(&id, &fp(31), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) if c.takeover && c.token.generation() == 2 => c.token,
        other => panic!("expected a takeover with generation 2, got {other:?}"),
    };
    let released_at = std::time::Instant::now();
    store
        .release(&id, &second)
        .await
        .expect("release of a takeover");
    let returned_at = std::time::Instant::now();

    let rec = store
        .get(&id)
        .await
        .unwrap()
        .expect("a takeover's release keeps the record");
    assert_eq!(rec.fingerprint, fp(31));
    assert_eq!(rec.generation, 2);
    assert_eq!(
        rec.state,
        RecordState::InProgress {
            lease_remaining: Duration::ZERO
        },
        "its lease ended at the release"
    );
    assert_fenced(
        store
            .complete(&id, &second, &response(201, "released"), TTL)
            .await,
        "complete with the released token",
    );
    assert_fenced(
        store.extend(&id, &second, LEASE).await,
        "extend with the released token",
    );
    assert_fenced(
        store.release(&id, &first).await,
        "release with the old token",
    );
    let forged = Token::generate(second.generation()).unwrap();
    assert_fenced(
        store.release(&id, &forged).await,
        "release with a forged token",
    );
    store
        .release(&id, &second)
        .await
        .expect("a resent release of a kept record is Ok");
    let again = store.get(&id).await.unwrap().expect("still kept");
    assert_eq!((again.fingerprint, again.generation), (fp(31), 2));
    assert!(matches!(again.state, RecordState::InProgress { .. }));

    // The key stays bound to the request that may have partly run.
    match store
        .claim(&ClaimRequest::new(&id, &fp(32), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!((r.fingerprint, r.generation), (fp(31), 2));
            assert_eq!(
                r.state,
                RecordState::InProgress {
                    lease_remaining: Duration::ZERO
                }
            );
        }
        other => panic!("another request must not claim a kept record: {other:?}"),
    }

    let pause = Duration::from_millis(200);
    tokio::time::sleep(pause).await;
    let sent_at = std::time::Instant::now();
    let third = match store
        .claim(&ClaimRequest::new(&id, &fp(31), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover, "the abandoned attempt must still be reported");
            assert_eq!(c.token.generation(), 3, "the generation only grows");
            // Optional: a store that tells how long the key was abandoned counts from the
            // release (the first lease had lapsed 250 ms before it), by its own clock; 2 ms
            // for a clock in whole milliseconds.
            if let Some(lapsed) = c.lapsed_for {
                let slack = Duration::from_millis(2);
                let most = released_at.elapsed() + slack;
                let least = sent_at.duration_since(returned_at).saturating_sub(slack);
                assert!(
                    lapsed >= least && lapsed <= most,
                    "lapsed_for {lapsed:?}: the release was between {least:?} and {most:?} before"
                );
            }
            c.token
        }
        other => panic!("expected a takeover with generation 3, got {other:?}"),
    };
    assert_fenced(
        store.release(&id, &second).await,
        "release with the released token after a takeover",
    );
    store
        .complete(&id, &third, &response(201, "third"), TTL)
        .await
        .unwrap();
    let done = store.get(&id).await.unwrap().unwrap();
    assert_eq!(done.generation, 3);
    assert_eq!(done.state, RecordState::Completed(response(201, "third")));
}

/// `extend` keeps a short lease from lapsing.
pub async fn extend_keeps_the_lease_alive(store: DynStore) {
    let id = unique_id("extend");
    let lease = Duration::from_millis(1000);
    let token = claim_token(&store, &id, fp(10), lease).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    store.extend(&id, &token, lease).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    // 1.2 s after the claim, 0.6 s after the renewal: still held.
    match store
        .claim(&ClaimRequest::new(&id, &fp(10), lease, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
            )
        }
        other => panic!("renewed lease must hold, got {other:?}"),
    }
}

/// `extend` to zero ends the lease now (a give-back, a dropped attempt): the same request's
/// next claim, sent at once, takes over; it does not wait out a rounding of the lease.
pub async fn a_lease_extended_to_zero_is_taken_over_at_once(store: DynStore) {
    for _ in 0..20 {
        let id = unique_id("ended");
        let token = claim_token(&store, &id, fp(13), LEASE).await;
        store.extend(&id, &token, Duration::ZERO).await.unwrap();
        match store
            .claim(&ClaimRequest::new(&id, &fp(13), LEASE, TTL))
            .await
            .unwrap()
        {
            ClaimOutcome::Claimed(c) => assert_eq!(c.token.generation(), 2),
            other => panic!("a lease ended now was still held: {other:?}"),
        }
    }
}

/// A completed record is never taken over, however long ago its lease ended.
pub async fn completed_records_are_not_taken_over_after_the_lease(store: DynStore) {
    let id = unique_id("kept");
    let short = Duration::from_millis(200);
    let token = claim_token(&store, &id, fp(13), short).await;
    store
        .complete(&id, &token, &response(201, "done"), TTL)
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp(13), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "done")))
        }
        other => panic!("completed record must replay, got {other:?}"),
    }
}

/// An `extend` with a forged token (right generation, wrong nonce) leaves the lease alone.
pub async fn forged_extend_leaves_the_lease_unchanged(store: DynStore) {
    let id = unique_id("forged-extend");
    let lease = Duration::from_millis(600);
    let token = claim_token(&store, &id, fp(27), lease).await;
    let forged = Token::generate(token.generation()).unwrap();
    assert_fenced(store.extend(&id, &forged, LEASE).await, "forged extend");
    match store.get(&id).await.unwrap().unwrap().state {
        RecordState::InProgress { lease_remaining } => {
            assert!(
                lease_remaining <= lease,
                "lease grew to {lease_remaining:?}"
            )
        }
        other => panic!("expected in progress, got {other:?}"),
    }
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp(27), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => assert!(c.takeover, "the original lease lapsed"),
        other => panic!("the forged extend kept the lease alive: {other:?}"),
    }
}
