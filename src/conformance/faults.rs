//! Faults: lost replies are unknown outcomes, and resends are idempotent.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError};
use crate::store::{Completion, Record, RecordId, RecordState, Token};
use tokio::sync::Notify;

use super::{claim_token, fp, response, unique_id, DynStore, LEASE, TTL};

/// A store whose replies can be lost: the real call runs to its end, then the caller hears
/// nothing, as when a reply times out. `landed` tells when the call has run.
struct LoseReplies<S> {
    inner: S,
    lose: AtomicBool,
    landed: Notify,
}

impl<S> LoseReplies<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            lose: AtomicBool::new(false),
            landed: Notify::new(),
        }
    }

    /// Loses the reply of the next call made through `self`, and only that one.
    fn lose_next(&self) {
        self.lose.store(true, Ordering::SeqCst);
    }

    async fn reply<T>(&self, result: T) -> T {
        if self.lose.swap(false, Ordering::SeqCst) {
            self.landed.notify_one();
            std::future::pending::<()>().await;
        }
        result
    }
}

#[async_trait::async_trait]
impl<S: IdempotencyStore> IdempotencyStore for LoseReplies<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let r = self.inner.claim(request).await;
        self.reply(r).await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let r = self.inner.extend(id, token, lease).await;
        self.reply(r).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let r = self.inner.complete(id, token, completion, ttl).await;
        self.reply(r).await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let r = self.inner.release(id, token).await;
        self.reply(r).await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let r = self.inner.get(id).await;
        self.reply(r).await
    }
}

/// Runs `call` through `store` with its reply lost: the caller gives up waiting (an unknown
/// outcome) once the call has run in the store.
async fn with_lost_reply<T: std::fmt::Debug>(
    store: &LoseReplies<DynStore>,
    call: impl std::future::Future<Output = T>,
) {
    store.lose_next();
    let landed = store.landed.notified();
    tokio::pin!(landed);
    landed.as_mut().enable();
    // The caller gives up the moment the call has run: ordered by the gate, not a clock.
    tokio::select! {
        biased;
        () = &mut landed => {}
        r = call => panic!("the reply was to be lost, got {r:?}"),
    }
}

/// Guarantee 7 and 9: a call whose reply was lost is unknown, never `Claimed`; what it did is
/// read back, a retry of the same request does not get a second claim, and a resent
/// `complete` or `release` answers `Ok`.
pub async fn lost_replies_are_unknown_and_resends_are_idempotent(store: DynStore) {
    let lossy = LoseReplies::new(store.clone());
    let id = unique_id("lost-claim");
    with_lost_reply(
        &lossy,
        lossy.claim(&ClaimRequest::new(&id, &fp(28), LEASE, TTL)),
    )
    .await;
    // The claim landed, but nobody was told: the record is in progress, and the same request
    // sent again is a duplicate (its lease is live), never a second `Claimed`.
    let rec = store
        .get(&id)
        .await
        .unwrap()
        .expect("the lost claim landed");
    assert_eq!(rec.fingerprint, fp(28));
    assert!(matches!(rec.state, RecordState::InProgress { .. }));
    match store
        .claim(&ClaimRequest::new(&id, &fp(28), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert_eq!(r.generation, rec.generation),
        other => panic!("a retry after a lost claim reply must not claim again: {other:?}"),
    }

    let id = unique_id("lost-complete");
    let t = claim_token(&store, &id, fp(29), LEASE).await;
    let answer = response(201, "first");
    with_lost_reply(&lossy, lossy.complete(&id, &t, &answer, TTL)).await;
    store
        .complete(&id, &t, &answer, TTL)
        .await
        .expect("a resent complete whose first attempt landed is Ok, not Fenced");
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(answer)
    );

    let id = unique_id("lost-release");
    let t = claim_token(&store, &id, fp(30), LEASE).await;
    with_lost_reply(&lossy, lossy.release(&id, &t)).await;
    store
        .release(&id, &t)
        .await
        .expect("a resent release whose first attempt landed is Ok, not Fenced");
    assert!(store.get(&id).await.unwrap().is_none());
    // The key is free: the same request runs again.
    match store
        .claim(&ClaimRequest::new(&id, &fp(30), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => assert!(!c.takeover),
        other => panic!("a released key must be claimable, got {other:?}"),
    }
}
