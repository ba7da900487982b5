//! The operator API: inspect, force-release and delete.

use std::time::Duration;

use crate::store::{ClaimOutcome, ClaimRequest, RecordStatus, Removal, StoreErrorKind};
use crate::store::{Completion, Fingerprint, RecordId, Token};
use http::StatusCode;

use super::recovery::point;
#[cfg(doc)]
use super::run_recovery;
use super::{assert_fenced, fp, response, unique_id, DynAdminStore, LEASE, TTL};

/// The operator API: `inspect` reports state, generation, lease, expiry and the answer;
/// `force_release` removes only a record in progress (its holder is fenced from then on);
/// `delete` removes only a completed one; both say when there was nothing.
pub async fn operator_api_inspects_releases_and_deletes(store: DynAdminStore) {
    let id = unique_id("admin");
    let absent = unique_id("admin-absent");
    assert_eq!(store.inspect(&absent).await.unwrap(), None);
    assert_eq!(store.force_release(&absent).await.unwrap(), Removal::Absent);
    assert_eq!(store.delete(&absent).await.unwrap(), Removal::Absent);

    // In progress: the lease and the expiry are the store's, within the round trip.
    let token = admin_claim(&store, &id, fp(1)).await;
    let info = store.inspect(&id).await.unwrap().expect("claimed record");
    assert_eq!(info.status, RecordStatus::InProgress);
    assert_eq!(info.generation, 1);
    assert_eq!(info.fingerprint, fp(1));
    let lease = info.lease_remaining.expect("in progress has a lease");
    assert!(
        lease <= LEASE && lease > LEASE - Duration::from_secs(5),
        "{lease:?}"
    );
    assert!(
        info.expires_in <= TTL && info.expires_in > TTL - Duration::from_secs(5),
        "{info:?}"
    );
    assert_eq!((info.answer_status, info.answer_size), (None, None));
    assert_eq!(store.delete(&id).await.unwrap(), Removal::Refused);
    assert!(
        store.inspect(&id).await.unwrap().is_some(),
        "a refused delete removed it"
    );
    assert_eq!(store.force_release(&id).await.unwrap(), Removal::Removed);
    assert_eq!(store.inspect(&id).await.unwrap(), None);
    assert_fenced(
        store
            .complete(&id, &token, &response(201, "late"), TTL)
            .await,
        "the released holder's complete",
    );
    assert_fenced(
        store.extend(&id, &token, LEASE).await,
        "the released holder's extend",
    );

    // Completed: status and body size; force_release refuses, delete removes.
    let token = admin_claim(&store, &id, fp(2)).await;
    assert_eq!(token.generation(), 1, "a released key starts again");
    let body = vec![b'x'; 237];
    store
        .complete(&id, &token, &response(201, body), TTL)
        .await
        .unwrap();
    let info = store.inspect(&id).await.unwrap().expect("completed record");
    assert_eq!(info.status, RecordStatus::Completed);
    assert_eq!(info.answer_status, Some(StatusCode::CREATED));
    assert_eq!(info.answer_size, Some(237));
    assert_eq!(info.lease_remaining, None);
    assert!(
        info.expires_in <= TTL && info.expires_in > TTL - Duration::from_secs(5),
        "{info:?}"
    );
    assert_eq!(store.force_release(&id).await.unwrap(), Removal::Refused);
    assert!(
        store.get(&id).await.unwrap().is_some(),
        "a refused release removed it"
    );
    assert_eq!(store.delete(&id).await.unwrap(), Removal::Removed);
    assert_eq!(store.get(&id).await.unwrap(), None);
    assert_eq!(store.delete(&id).await.unwrap(), Removal::Absent);

    // A tombstone is completed too, with its status and no body.
    let token = admin_claim(&store, &id, fp(3)).await;
    let tomb = Completion::Tombstone {
        status: StatusCode::OK,
    };
    store.complete(&id, &token, &tomb, TTL).await.unwrap();
    let info = store.inspect(&id).await.unwrap().expect("tombstone");
    assert_eq!(info.status, RecordStatus::Tombstone);
    assert_eq!(
        (info.answer_status, info.answer_size),
        (Some(StatusCode::OK), None)
    );
    // Another scope's record of the same key is not this one.
    assert_eq!(store.inspect(&absent).await.unwrap(), None);
    assert_eq!(store.delete(&id).await.unwrap(), Removal::Removed);

    // A takeover's release keeps its record: in progress, its lease ended, its retention
    // whole. The operator can still remove it.
    let id = unique_id("admin-released");
    let short = Duration::from_millis(300);
    match store
        .claim(&ClaimRequest::new(&id, &fp(4), short, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(_) => {}
        other => panic!("expected Claimed, got {other:?}"),
    }
    tokio::time::sleep(short + Duration::from_millis(250)).await;
    let token = admin_claim(&store, &id, fp(4)).await;
    assert_eq!(token.generation(), 2, "a takeover");
    store.release(&id, &token).await.unwrap();
    let info = store.inspect(&id).await.unwrap().expect("kept");
    assert_eq!(info.status, RecordStatus::InProgress);
    assert_eq!(info.generation, 2);
    assert_eq!(info.lease_remaining, Some(Duration::ZERO));
    assert!(
        info.expires_in <= TTL && info.expires_in > TTL - Duration::from_secs(5),
        "the release kept the retention: {info:?}"
    );
    assert_eq!(store.delete(&id).await.unwrap(), Removal::Refused);
    assert_eq!(store.force_release(&id).await.unwrap(), Removal::Removed);
    assert_eq!(store.inspect(&id).await.unwrap(), None);
}

async fn admin_claim(store: &DynAdminStore, id: &RecordId, f: Fingerprint) -> Token {
    match store
        .claim(&ClaimRequest::new(id, &f, LEASE, TTL))
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// `inspect` shows the recovery point of a record in progress, and none once completed. A
/// store that answers [`StoreErrorKind::Unsupported`] to saves has none to show: skipped
/// (the [recovery checks](run_recovery) are what prove a store keeps points).
pub async fn inspect_shows_the_recovery_point(store: DynAdminStore) {
    let id = unique_id("inspect-recovery");
    let token = admin_claim(&store, &id, fp(4)).await;
    let p = point(&token, "created", b"pay_9");
    match store.save_recovery_point(&id, &token, &p).await {
        Err(e) if e.kind() == StoreErrorKind::Unsupported => {
            eprintln!(
                "the store keeps no recovery points: inspect_shows_the_recovery_point skipped"
            );
            return;
        }
        r => r.expect("save"),
    }
    let info = store.inspect(&id).await.unwrap().expect("in progress");
    assert_eq!(info.status, RecordStatus::InProgress);
    assert_eq!(info.recovery_point.as_ref(), Some(&p));
    store
        .complete(&id, &token, &response(201, "x"), TTL)
        .await
        .unwrap();
    let info = store.inspect(&id).await.unwrap().expect("completed");
    assert_eq!(info.recovery_point, None);
}
