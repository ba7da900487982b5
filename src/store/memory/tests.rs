use super::*;
use crate::store::RecordState;

fn fp() -> Fingerprint {
    Fingerprint::from_bytes([1; 32])
}

async fn completed(store: &MemoryStore, key: &str, ttl: Duration) {
    let id = RecordId::new(None, key);
    let ClaimOutcome::Claimed(c) = store
        .claim(&ClaimRequest::new(&id, &fp(), ttl, ttl))
        .await
        .unwrap()
    else {
        panic!("fresh key")
    };
    let done = Completion::Tombstone {
        status: http::StatusCode::OK,
    };
    store.complete(&id, &c.token, &done, ttl).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn expired_records_are_swept_when_a_shard_is_next_touched() {
    let store = MemoryStore::builder()
        .with_shards(NonZeroUsize::new(1).unwrap())
        .with_sweep_interval(Duration::from_secs(5))
        .build();
    for key in ["a", "b", "c"] {
        completed(&store, key, Duration::from_secs(1)).await;
    }
    assert_eq!(store.len(), 3);
    tokio::time::advance(Duration::from_secs(2)).await;
    // Expired but not yet swept: the interval has not passed.
    assert_eq!(store.len(), 3);
    assert!(store
        .get(&RecordId::new(None, "a"))
        .await
        .unwrap()
        .is_none());
    tokio::time::advance(Duration::from_secs(4)).await;
    completed(&store, "d", Duration::from_secs(60)).await;
    assert_eq!(store.len(), 1, "the touch swept the expired three");
    let before = store.inner.bytes.load(Ordering::Relaxed);
    // One completed tombstone: the slot, its 4 encoded bytes and their malloc header.
    assert_eq!(
        before,
        ENTRY_OVERHEAD + 4 + 16,
        "their bytes were returned too"
    );
}

#[tokio::test(start_paused = true)]
async fn purge_expired_removes_only_expired_records() {
    let store = MemoryStore::new();
    completed(&store, "short", Duration::from_secs(1)).await;
    completed(&store, "long", Duration::from_secs(60)).await;
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(store.purge_expired(), 1);
    assert_eq!(store.len(), 1);
    assert!(store
        .get(&RecordId::new(None, "long"))
        .await
        .unwrap()
        .is_some());
}

#[tokio::test(start_paused = true)]
async fn expired_unswept_records_never_make_the_store_full() {
    // No periodic sweep will run: only the admission path can free the slots.
    let store = MemoryStore::builder()
        .with_max_records(NonZeroUsize::new(8).unwrap())
        .with_shards(NonZeroUsize::new(16).unwrap())
        .with_sweep_interval(Duration::from_secs(3600))
        .build();
    for i in 0..8 {
        completed(&store, &format!("old-{i}"), Duration::from_secs(1)).await;
    }
    let fresh = RecordId::new(None, "fresh");
    assert_eq!(
        store
            .claim(&ClaimRequest::new(
                &fresh,
                &fp(),
                Duration::from_secs(1),
                Duration::from_secs(1)
            ))
            .await
            .unwrap_err()
            .kind(),
        StoreErrorKind::Full,
        "live records do fill it"
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(store.len(), 8, "expired, not yet swept");
    for i in 0..8 {
        let id = RecordId::new(None, &format!("new-{i}"));
        let outcome = store
            .claim(&ClaimRequest::new(
                &id,
                &fp(),
                Duration::from_secs(60),
                Duration::from_secs(60),
            ))
            .await
            .expect("expired records make room");
        assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
    }
    assert_eq!(store.len(), 8);
    // Full of live records again: refused, and the refusal evicted nothing.
    assert_eq!(
        store
            .claim(&ClaimRequest::new(
                &fresh,
                &fp(),
                Duration::from_secs(1),
                Duration::from_secs(1)
            ))
            .await
            .unwrap_err()
            .kind(),
        StoreErrorKind::Full
    );
    assert_eq!(store.len(), 8);
}

#[tokio::test(start_paused = true)]
async fn keep_forever_durations_neither_panic_nor_leak_a_slot() {
    let store = MemoryStore::builder()
        .with_max_records(NonZeroUsize::new(1).unwrap())
        .build();
    let forever = Duration::MAX;
    for key in ["a", "b", "c"] {
        let id = RecordId::new(None, key);
        let ClaimOutcome::Claimed(c) = store
            .claim(&ClaimRequest::new(&id, &fp(), forever, forever))
            .await
            .unwrap()
        else {
            panic!("fresh key")
        };
        store.extend(&id, &c.token, forever).await.unwrap();
        store.release(&id, &c.token).await.unwrap();
    }
    let id = RecordId::new(None, "kept");
    let ClaimOutcome::Claimed(c) = store
        .claim(&ClaimRequest::new(&id, &fp(), forever, forever))
        .await
        .unwrap()
    else {
        panic!("the slot came back")
    };
    let done = Completion::Tombstone {
        status: http::StatusCode::OK,
    };
    store.complete(&id, &c.token, &done, forever).await.unwrap();
    tokio::time::advance(Duration::from_secs(50 * 365 * 24 * 3600)).await;
    assert!(store.get(&id).await.unwrap().is_some(), "kept for decades");
}

#[tokio::test(start_paused = true)]
async fn a_released_takeover_keeps_its_slot_and_quota_until_removed() {
    use crate::store::{IdempotencyAdmin, Removal};
    let store = MemoryStore::builder()
        .with_max_records_per_scope(NonZeroUsize::new(1).unwrap())
        .build();
    let scope = ScopeId::new(Some("t"));
    let id = RecordId::new(Some("t"), "k");
    let (lease, ttl) = (Duration::from_secs(1), Duration::from_secs(60));
    store
        .claim(&ClaimRequest::new(&id, &fp(), lease, ttl).in_scope(&scope))
        .await
        .unwrap();
    tokio::time::advance(lease * 2).await;
    let ClaimOutcome::Claimed(c) = store
        .claim(&ClaimRequest::new(&id, &fp(), lease, ttl).in_scope(&scope))
        .await
        .unwrap()
    else {
        panic!("the lapsed lease is taken over")
    };
    assert_eq!(c.token.generation(), 2);
    store.release(&id, &c.token).await.unwrap();
    assert_eq!(store.len(), 1, "kept");
    assert_eq!(store.inner.bytes.load(Ordering::Relaxed), ENTRY_OVERHEAD);
    let other = RecordId::new(Some("t"), "other");
    let refused = store
        .claim(&ClaimRequest::new(&other, &fp(), lease, ttl).in_scope(&scope))
        .await
        .unwrap_err();
    assert_eq!(
        refused.kind(),
        StoreErrorKind::QuotaExceeded,
        "the kept record still counts against its scope"
    );
    assert_eq!(store.force_release(&id).await.unwrap(), Removal::Removed);
    assert_eq!(
        (store.len(), store.inner.bytes.load(Ordering::Relaxed)),
        (0, 0)
    );
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&other, &fp(), lease, ttl).in_scope(&scope))
            .await
            .unwrap(),
        ClaimOutcome::Claimed(_)
    ));
}

#[tokio::test]
async fn a_failed_random_source_fails_the_claim_and_takes_no_slot() {
    let store = MemoryStore::builder()
        .with_max_records(NonZeroUsize::new(1).unwrap())
        .build();
    let id = RecordId::new(None, "k");
    crate::store::record::FAIL_RANDOM.with(|f| f.set(true));
    let r = store
        .claim(&ClaimRequest::new(
            &id,
            &fp(),
            Duration::from_secs(1),
            Duration::from_secs(1),
        ))
        .await;
    crate::store::record::FAIL_RANDOM.with(|f| f.set(false));
    assert_eq!(r.unwrap_err().kind(), StoreErrorKind::Unavailable);
    assert!(store.is_empty());
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(
                &id,
                &fp(),
                Duration::from_secs(1),
                Duration::from_secs(1)
            ))
            .await
            .unwrap(),
        ClaimOutcome::Claimed(_)
    ));
}

/// `claim_now` is `claim` answered at once: the same outcomes, in one sequence of both.
#[tokio::test(start_paused = true)]
async fn claim_now_answers_as_claim_does() {
    let store = MemoryStore::new();
    let id = RecordId::new(None, "now");
    let lease = Duration::from_secs(1);
    let fingerprint = fp();
    let req = ClaimRequest::new(&id, &fingerprint, lease, Duration::from_secs(60));
    let Some(Ok(ClaimOutcome::Claimed(first))) = store.claim_now(&req) else {
        panic!("an absent key is claimed at once")
    };
    assert_eq!(first.token.generation(), 1);
    for outcome in [store.claim_now(&req).unwrap(), store.claim(&req).await] {
        let Ok(ClaimOutcome::Existing(record)) = outcome else {
            panic!("a held key is not claimed twice")
        };
        assert!(matches!(record.state, RecordState::InProgress { .. }));
    }
    // Past the lease, the same request takes over, and the first token is fenced.
    tokio::time::advance(lease + Duration::from_millis(1)).await;
    let Some(Ok(ClaimOutcome::Claimed(second))) = store.claim_now(&req) else {
        panic!("a lapsed lease is taken over at once")
    };
    assert_eq!(second.token.generation(), 2);
    let err = store.extend(&id, &first.token, lease).await.unwrap_err();
    assert!(err.is_fenced());
    let done = Completion::Tombstone {
        status: http::StatusCode::OK,
    };
    store
        .complete(&id, &second.token, &done, Duration::from_secs(60))
        .await
        .unwrap();
    let Some(Ok(ClaimOutcome::Existing(record))) = store.claim_now(&req) else {
        panic!("a completed record is answered at once")
    };
    assert!(matches!(record.state, RecordState::Completed(_)));
    assert_eq!(record.fingerprint, fp());
}
