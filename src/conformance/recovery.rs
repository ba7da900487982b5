//! Recovery points: fenced saves, handed to a takeover, listed when recoverable.

use std::time::Duration;

use crate::store::{ClaimOutcome, ClaimRequest};
use crate::store::{Record, RecordId, RecordState, ScopeId, Token};
use crate::RecoveryPoint;
use bytes::Bytes;

use super::{assert_fenced, claim_token, fp, response, unique_id, DynStore, LEASE, TTL};

/// A recovery point for the claim of `token`.
pub(super) fn point(token: &Token, step: &str, data: &'static [u8]) -> RecoveryPoint {
    RecoveryPoint::new(
        step,
        Bytes::from_static(data),
        ScopeId::new(Some("conformance")),
        token.generation(),
    )
    .expect("a point within the caps")
}

fn saved(record: &Record) -> Option<(&str, &[u8])> {
    record
        .recovery_point
        .as_ref()
        .map(|p| (p.step(), p.data().as_ref()))
}

/// Recovery points: the holder's save replaces the one before, `get` shows it, a takeover is
/// handed it, the stale holder's save is fenced and changes nothing, the new holder's save
/// lands, and `complete` drops it (a later save is fenced).
pub async fn recovery_points_are_fenced_and_handed_to_a_takeover(store: DynStore) {
    let id = unique_id("recovery");
    let short = Duration::from_millis(300);
    let first = claim_token(&store, &id, fp(1), short).await;
    store
        .save_recovery_point(&id, &first, &point(&first, "created", b"pay_1"))
        .await
        .expect("the holder saves");
    store
        .save_recovery_point(&id, &first, &point(&first, "charged", b"pay_1/ch_1"))
        .await
        .expect("the holder saves again");
    let record = store.get(&id).await.unwrap().expect("in progress");
    assert_eq!(
        saved(&record),
        Some(("charged", &b"pay_1/ch_1"[..])),
        "the latest point"
    );
    let p = record.recovery_point.as_ref().unwrap();
    assert_eq!(
        (p.generation(), p.scope_id()),
        (1, ScopeId::new(Some("conformance")))
    );

    tokio::time::sleep(short + Duration::from_millis(250)).await;
    let second = match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            let p = c
                .recovery_point
                .as_ref()
                .expect("a takeover gets the point");
            assert_eq!(
                (p.step(), p.data().as_ref()),
                ("charged", &b"pay_1/ch_1"[..])
            );
            assert_eq!(p.generation(), 1, "saved by the first claim");
            c.token
        }
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert_fenced(
        store
            .save_recovery_point(&id, &first, &point(&first, "stale", b"x"))
            .await,
        "the stale holder's save",
    );
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        saved(&record),
        Some(("charged", &b"pay_1/ch_1"[..])),
        "the stale save changed nothing"
    );
    store
        .save_recovery_point(&id, &second, &point(&second, "recorded", b"pay_1/ch_1/ok"))
        .await
        .expect("the new holder saves");
    // A resent save (a lost reply) answers Ok and keeps the same point.
    store
        .save_recovery_point(&id, &second, &point(&second, "recorded", b"pay_1/ch_1/ok"))
        .await
        .expect("a resent save");
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(saved(&record), Some(("recorded", &b"pay_1/ch_1/ok"[..])));
    assert_eq!(record.recovery_point.as_ref().unwrap().generation(), 2);

    store
        .complete(&id, &second, &response(201, "{\"id\":\"pay_1\"}"), TTL)
        .await
        .unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::Completed(_)));
    assert_eq!(record.recovery_point, None, "complete drops the point");
    assert_eq!(
        record.state,
        RecordState::Completed(response(201, "{\"id\":\"pay_1\"}")),
        "the answer is intact"
    );
    assert_fenced(
        store
            .save_recovery_point(&id, &second, &point(&second, "late", b"x"))
            .await,
        "a save after complete",
    );
    let absent = unique_id("recovery-absent");
    assert_fenced(
        store
            .save_recovery_point(&absent, &first, &point(&first, "x", b"x"))
            .await,
        "a save on an absent record",
    );
}

/// The largest recovery point (step and data at their caps, every byte value) comes
/// back byte for byte, and a point saved on a record counted against nothing else leaves its
/// answer untouched when a shorter point replaces it.
pub async fn the_largest_recovery_point_round_trips(store: DynStore) {
    let id = unique_id("recovery-cap");
    let token = claim_token(&store, &id, fp(2), LEASE).await;
    let data: Vec<u8> = (0..RecoveryPoint::MAX_DATA)
        .map(|i| (i % 256) as u8)
        .collect();
    let step = "s".repeat(RecoveryPoint::MAX_STEP);
    let scope = "é".repeat(512);
    let big = RecoveryPoint::new(
        &step,
        Bytes::from(data.clone()),
        ScopeId::new(Some(&scope)),
        token.generation(),
    )
    .unwrap();
    assert!(big.encode().len() <= RecoveryPoint::MAX_ENCODED);
    store.save_recovery_point(&id, &token, &big).await.unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_ref(), Some(&big));
    // A shorter point replaces it whole: nothing of the longer one is left behind.
    let small = point(&token, "s", b"");
    store
        .save_recovery_point(&id, &token, &small)
        .await
        .unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.recovery_point.as_ref(), Some(&small));
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    store
        .complete(&id, &token, &response(200, "ok"), TTL)
        .await
        .unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed(response(200, "ok")));
}

/// `recoverable` lists records in progress whose lease lapsed and that saved a point, each
/// with its point; not a live lease, not a record without a point; and no longer once the
/// record is completed or released. A released takeover keeps its history, not its point.
pub async fn recoverable_lists_lapsed_records_with_a_point(store: DynStore) {
    let short = Duration::from_millis(300);
    let lapsed = unique_id("recoverable-lapsed");
    let live = unique_id("recoverable-live");
    let bare = unique_id("recoverable-bare");
    let t_lapsed = claim_token(&store, &lapsed, fp(3), short).await;
    let t_live = claim_token(&store, &live, fp(3), LEASE).await;
    let _t_bare = claim_token(&store, &bare, fp(3), short).await;
    store
        .save_recovery_point(&lapsed, &t_lapsed, &point(&t_lapsed, "created", b"a"))
        .await
        .unwrap();
    store
        .save_recovery_point(&live, &t_live, &point(&t_live, "created", b"b"))
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(250)).await;

    // Other checks share a server: look only at this check's records.
    let ours = |found: &[(RecordId, Record)]| -> Vec<RecordId> {
        found
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| [lapsed, live, bare].contains(id))
            .collect()
    };
    let found = store.recoverable(10_000).await.expect("recoverable");
    assert_eq!(ours(&found), vec![lapsed], "{found:?}");
    let (_, record) = found.iter().find(|(id, _)| *id == lapsed).unwrap();
    assert_eq!(saved(record), Some(("created", &b"a"[..])));
    assert!(
        matches!(record.state, RecordState::InProgress { lease_remaining } if lease_remaining == Duration::ZERO)
    );
    assert_eq!(record.generation, 1);

    // Taken over and completed: no longer listed, even once the completer's lease would
    // have lapsed.
    let t2 = match store
        .claim(&ClaimRequest::new(&lapsed, &fp(3), short, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected a takeover, got {other:?}"),
    };
    store
        .save_recovery_point(&lapsed, &t2, &point(&t2, "charged", b"a2"))
        .await
        .unwrap();
    store
        .complete(&lapsed, &t2, &response(201, "done"), TTL)
        .await
        .unwrap();

    // The live one: taken over later, then released. The key keeps its history (generation
    // 2), not the point.
    store.release(&live, &t_live).await.unwrap();
    assert!(
        store.get(&live).await.unwrap().is_none(),
        "a first claim's release frees the key"
    );
    let t_live = claim_token(&store, &live, fp(3), short).await;
    store
        .save_recovery_point(&live, &t_live, &point(&t_live, "created", b"c"))
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(250)).await;
    let t_live2 = match store
        .claim(&ClaimRequest::new(&live, &fp(3), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert_eq!(
                c.recovery_point.as_ref().map(RecoveryPoint::step),
                Some("created")
            );
            c.token
        }
        other => panic!("expected a takeover, got {other:?}"),
    };
    store.release(&live, &t_live2).await.unwrap();
    let kept = store
        .get(&live)
        .await
        .unwrap()
        .expect("a released takeover keeps the record");
    assert_eq!(kept.recovery_point, None, "release drops the point");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let found = store.recoverable(10_000).await.unwrap();
    assert_eq!(ours(&found), Vec::<RecordId>::new(), "{found:?}");
    // The next claim of the released key starts from nothing.
    match store
        .claim(&ClaimRequest::new(&live, &fp(3), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => assert_eq!(c.recovery_point, None),
        other => panic!("expected a claim, got {other:?}"),
    }
}
