//! The store conformance suite (feature `conformance`): the specification of a store, as
//! checks every store that ships with this crate passes, and that your own store can run.
//!
//! Each check is an `async fn(DynStore)` that panics on a violation of the
//! [store contract](crate::store#guarantees-every-store-gives). From a test file, either
//! generate one `#[tokio::test]` per check with [`conformance_suite!`](crate::conformance_suite)
//! (needs `tokio` with the `macros` and `rt-multi-thread` features among your
//! dev-dependencies), or run them all at once with [`run_all`]:
//!
//! ```toml
//! [dev-dependencies]
//! tower-idempotency = { version = "0.1", features = ["conformance"] }
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! ```
//!
//! ```text
//! // tests/my_store.rs
//! use std::sync::Arc;
//! use crate::conformance::DynStore;
//!
//! crate::conformance_suite! {
//!     // A fresh store per check; `None` skips (say why first, e.g. no server configured).
//!     store: async { Some(Arc::new(MyStore::new()) as DynStore) },
//!     // Optional: a store small enough to fill, for "a full store refuses, never evicts".
//!     full: async { Some(Arc::new(MyStore::with_capacity(40)) as DynStore) },
//! }
//! ```
//!
//! The [custom store example](crate::store#implementing-a-custom-store) runs the whole suite.
//!
//! Leases and TTLs here are real time (a store's own clock cannot be paused), so the checks
//! that wait for a lease or a TTL to lapse sleep past it with a margin; the longest takes
//! about five seconds. They never sleep to order two tasks: concurrency is ordered by a
//! barrier or a gate.
#![allow(clippy::match_wildcard_for_single_variants)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::store::{
    AdminStore, ClaimOutcome, ClaimRequest, IdempotencyAdmin, IdempotencyStore, RecordStatus,
    Removal, StoreError, StoreErrorKind,
};
use crate::store::{Completion, Fingerprint, Record, RecordId, RecordState, StoredResponse, Token};
use crate::RecoveryPoint;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::sync::{Barrier, Notify};

/// A shared store, as the checks take it.
pub type DynStore = Arc<dyn IdempotencyStore>;

/// A shared store with the [operator API](crate::store::IdempotencyAdmin), for
/// [`operator_api_inspects_releases_and_deletes`].
pub type DynAdminStore = Arc<dyn AdminStore>;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

/// A record id no other test, run or process uses.
pub fn unique_id(label: &str) -> RecordId {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let scope = format!(
        "conformance/{}/{nanos}/{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    RecordId::new(Some(&scope), label)
}

/// A fingerprint made of one repeated byte: distinct per `n`.
pub fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

/// A recorded answer with JSON content type and a repeated `link` header.
pub fn response(status: u16, body: impl Into<Bytes>) -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.append("link", HeaderValue::from_static("</a>; rel=a"));
    headers.append("link", HeaderValue::from_static("</b>; rel=b"));
    Completion::Response(StoredResponse::new(
        StatusCode::from_u16(status).unwrap(),
        headers,
        body.into(),
        None,
    ))
}

async fn claim_token(store: &DynStore, id: &RecordId, f: Fingerprint, lease: Duration) -> Token {
    match store
        .claim(&ClaimRequest::new(id, &f, lease, TTL))
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn assert_fenced<T: std::fmt::Debug>(r: Result<T, crate::store::StoreError>, what: &str) {
    match r {
        Err(e) if e.kind() == StoreErrorKind::Fenced => {}
        other => panic!("{what}: expected Fenced, got {other:?}"),
    }
}

/// Guarantee 1: 64 concurrent claims of an absent key, exactly one `Claimed`.
pub async fn concurrent_claims_of_one_key_yield_exactly_one_claimed(store: DynStore) {
    const N: usize = 64;
    let id = unique_id("race");
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
                    .await
            })
        })
        .collect();
    let (mut claimed, mut existing) = (0, 0);
    for t in tasks {
        match t.await.unwrap().expect("claim") {
            ClaimOutcome::Claimed(c) => {
                claimed += 1;
                assert_eq!(c.token.generation(), 1);
                assert!(!c.takeover);
            }
            ClaimOutcome::Existing(r) => {
                existing += 1;
                assert_eq!(r.fingerprint, fp(1));
                assert!(
                    matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
                );
            }
        }
    }
    assert_eq!((claimed, existing), (1, N - 1));
}

/// Guarantee 4: binary, empty and 1 MiB bodies, repeated headers and trailers replay exactly.
pub async fn completed_records_replay_byte_exactly(store: DynStore) {
    // Binary bodies with every byte value, an empty body, a 1 MiB body; headers with repeated
    // names; trailers.
    let binary: Vec<u8> = (0..=255u8).rev().cycle().take(4096 + 17).collect();
    let big: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 31 % 251) as u8).collect();
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("x-checksum", HeaderValue::from_static("abc123"));
    let cases = [
        response(201, binary),
        response(204, Bytes::new()),
        response(200, big.clone()),
        Completion::Response(StoredResponse::new(
            StatusCode::OK,
            HeaderMap::new(),
            Bytes::from(big),
            Some(trailers),
        )),
        // The Vary guard is a field of the record: a store keeps it with the answer.
        Completion::Response({
            let Completion::Response(mut r) = response(201, "varies") else {
                unreachable!()
            };
            r.vary = Some(crate::record::VaryGuard {
                names: "accept-language,authorization".into(),
                digest: [0x5a; 32],
            });
            r
        }),
        Completion::Tombstone {
            status: StatusCode::CREATED,
        },
    ];
    for (i, completion) in cases.into_iter().enumerate() {
        let id = unique_id(&format!("replay-{i}"));
        let token = claim_token(&store, &id, fp(2), LEASE).await;
        store
            .complete(&id, &token, &completion, TTL)
            .await
            .expect("complete");
        let got = store.get(&id).await.expect("get").expect("present");
        assert_eq!(
            got.state,
            RecordState::Completed(completion.clone()),
            "case {i} via get"
        );
        assert_eq!(got.fingerprint, fp(2));
        match store
            .claim(&ClaimRequest::new(&id, &fp(2), LEASE, TTL))
            .await
            .expect("claim")
        {
            ClaimOutcome::Existing(r) => {
                assert_eq!(
                    r.state,
                    RecordState::Completed(completion),
                    "case {i} via claim"
                )
            }
            other => panic!("case {i}: expected Existing, got {other:?}"),
        }
    }
}

/// A claim with another fingerprint sees the record and never takes it over.
pub async fn different_fingerprint_sees_the_existing_record(store: DynStore) {
    let id = unique_id("mismatch");
    let token = claim_token(&store, &id, fp(3), LEASE).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp(4), LEASE, TTL))
        .await
        .expect("claim")
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(3));
            assert!(matches!(r.state, RecordState::InProgress { .. }));
            // Where a store reports the holder, it is the claim's own token.
            assert!(r.holder.is_none_or(|h| h == token), "{:?}", r.holder);
        }
        other => panic!("expected Existing, got {other:?}"),
    }
    store
        .complete(&id, &token, &response(200, "ok"), TTL)
        .await
        .unwrap();
    match store
        .claim(&ClaimRequest::new(&id, &fp(4), LEASE, TTL))
        .await
        .expect("claim")
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(3));
            assert!(matches!(r.state, RecordState::Completed(_)));
            assert!(r.holder.is_none_or(|h| h == token), "{:?}", r.holder);
        }
        other => panic!("expected Existing, got {other:?}"),
    }
}

/// `get` names the claim that completed a record, where the store keeps it (the layer tells
/// its own claim's record from another's of the same generation by it).
pub async fn get_reports_the_holder_of_a_record(store: DynStore) {
    let id = unique_id("holder");
    let token = claim_token(&store, &id, fp(5), LEASE).await;
    let held = store.get(&id).await.unwrap().expect("the claimed record");
    assert!(held.holder.is_none_or(|h| h == token), "{:?}", held.holder);
    store
        .complete(&id, &token, &response(201, "held"), TTL)
        .await
        .unwrap();
    let done = store.get(&id).await.unwrap().expect("the completed record");
    assert!(done.holder.is_none_or(|h| h == token), "{:?}", done.holder);
}

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

/// A released key is claimed anew.
pub async fn release_frees_the_key(store: DynStore) {
    let id = unique_id("release");
    let token = claim_token(&store, &id, fp(8), LEASE).await;
    store.release(&id, &token).await.unwrap();
    assert!(store.get(&id).await.unwrap().is_none());
    match store
        .claim(&ClaimRequest::new(&id, &fp(9), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert!(!c.takeover);
            assert_eq!(c.token.generation(), 1, "a fresh first attempt");
        }
        other => panic!("released key must be claimable, got {other:?}"),
    }
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

/// A claim in a scope ([`ClaimRequest::in_scope`]) claims the same record as one without:
/// the same record, the same fencing. A store with per-scope quotas counts it, and must keep
/// this.
pub async fn a_scoped_claim_claims_the_same_record(store: DynStore) {
    let id = unique_id("in-scope");
    let scope = crate::store::ScopeId::new(Some("conformance-scope"));
    let token = match store
        .claim(&ClaimRequest::new(&id, &fp(4), LEASE, TTL).in_scope(&scope))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("a new key must be claimed, got {other:?}"),
    };
    match store
        .claim(&ClaimRequest::new(&id, &fp(4), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert_eq!(r.generation, token.generation()),
        other => panic!("claim must see the scoped claim, got {other:?}"),
    }
    store
        .complete(&id, &token, &response(201, "scoped"), TTL)
        .await
        .unwrap();
    match store
        .claim(&ClaimRequest::new(&id, &fp(4), LEASE, TTL).in_scope(&scope))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::Completed(_))),
        other => panic!("a completed record must be returned, got {other:?}"),
    }
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

/// Guarantee 8: the same key in two scopes names two records.
pub async fn scopes_are_isolated(store: DynStore) {
    let key = format!("shared-key-{}", unique_id("k").to_hex());
    let a = RecordId::new(Some("tenant-a"), &key);
    let b = RecordId::new(Some("tenant-b"), &key);
    let none = RecordId::new(None, &key);
    let ta = claim_token(&store, &a, fp(14), LEASE).await;
    let tb = claim_token(&store, &b, fp(15), LEASE).await;
    let tn = claim_token(&store, &none, fp(16), LEASE).await;
    store
        .complete(&a, &ta, &response(201, "a"), TTL)
        .await
        .unwrap();
    assert!(matches!(
        store.get(&b).await.unwrap().unwrap().state,
        RecordState::InProgress { .. }
    ));
    assert_fenced(
        store.complete(&b, &ta, &response(201, "a"), TTL).await,
        "cross-scope token",
    );
    store
        .complete(&b, &tb, &response(201, "b"), TTL)
        .await
        .unwrap();
    store.release(&none, &tn).await.unwrap();
    assert_eq!(
        store.get(&a).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "a"))
    );
    assert_eq!(
        store.get(&b).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "b"))
    );
    assert!(store.get(&none).await.unwrap().is_none());
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

/// Runs `n` claims of `id` at once, released by a barrier.
async fn race_claims(
    store: &DynStore,
    id: RecordId,
    f: Fingerprint,
    n: usize,
) -> Vec<ClaimOutcome> {
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&ClaimRequest::new(&id, &f, LEASE, TTL)).await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.unwrap().expect("claim"));
    }
    out
}

/// Many claims of a lapsed lease: exactly one takes over. Many claims of an expired record:
/// exactly one wins, as a new record.
pub async fn concurrent_claims_of_a_lapsed_or_expired_record_yield_exactly_one(store: DynStore) {
    const N: usize = 32;
    let lapsed = unique_id("lapsed-race");
    let short = Duration::from_millis(300);
    store
        .claim(&ClaimRequest::new(&lapsed, &fp(24), short, TTL))
        .await
        .unwrap();
    let expired = unique_id("expired-race");
    let t = match store
        .claim(&ClaimRequest::new(&expired, &fp(25), short, short))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    };
    store
        .complete(&expired, &t, &response(200, "old"), short)
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(300)).await;

    let outcomes = race_claims(&store, lapsed, fp(24), N).await;
    let won: Vec<_> = outcomes
        .iter()
        .filter_map(|o| match o {
            ClaimOutcome::Claimed(c) => Some(c.clone()),
            ClaimOutcome::Existing(_) => None,
        })
        .collect();
    assert_eq!(won.len(), 1, "exactly one takeover: {outcomes:?}");
    assert!(won[0].takeover);
    assert_eq!(won[0].token.generation(), 2);
    assert_eq!(store.get(&lapsed).await.unwrap().unwrap().generation, 2);

    let outcomes = race_claims(&store, expired, fp(26), N).await;
    let won: Vec<_> = outcomes
        .iter()
        .filter_map(|o| match o {
            ClaimOutcome::Claimed(c) => Some(c.clone()),
            ClaimOutcome::Existing(_) => None,
        })
        .collect();
    assert_eq!(won.len(), 1, "exactly one new claim: {outcomes:?}");
    assert!(!won[0].takeover);
    assert_eq!(won[0].token.generation(), 1);
    for o in &outcomes {
        if let ClaimOutcome::Existing(r) = o {
            assert_eq!(r.fingerprint, fp(26), "the old record is gone");
            assert!(matches!(r.state, RecordState::InProgress { .. }));
        }
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

/// A recovery point for the claim of `token`.
fn point(token: &Token, step: &str, data: &'static [u8]) -> RecoveryPoint {
    RecoveryPoint::new(
        step,
        Bytes::from_static(data),
        Some("conformance"),
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
    assert_eq!((p.generation(), p.scope()), (1, Some("conformance")));

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

/// The largest recovery point (step, data and scope at their caps, every byte value) comes
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
        Some(&scope),
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

/// Runs every check at once, each on a fresh store from `new_store`, and the full-store
/// check when `full` yields a store small enough to fill. Panics on the first violation.
///
/// Needs a multi-threaded Tokio runtime (the concurrency checks spawn tasks).
pub async fn run_all<F, Fut>(new_store: F, full: Option<DynStore>)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = DynStore>,
{
    type Check = fn(DynStore) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
    macro_rules! checks {
        ($($name:ident,)*) => {
            [$((stringify!($name), (|s| Box::pin($name(s))) as Check)),*]
        };
    }
    let checks = crate::__conformance_checks!([checks]);
    let mut running = Vec::new();
    for (name, check) in checks {
        let store = new_store().await;
        running.push((name, tokio::spawn(check(store))));
    }
    if let Some(store) = full {
        let check: Check = |s| Box::pin(full_store_refuses_claims_and_keeps_records(s));
        running.push((
            "full_store_refuses_claims_and_keeps_records",
            tokio::spawn(check(store)),
        ));
    }
    for (name, task) in running {
        if let Err(e) = task.await {
            match e.try_into_panic() {
                Ok(panic) => {
                    eprintln!("conformance check `{name}` failed");
                    std::panic::resume_unwind(panic)
                }
                Err(e) => panic!("conformance check `{name}` did not finish: {e}"),
            }
        }
    }
}

/// Runs the [recovery-point](crate::RecoveryPoint) checks at once, each on a fresh store
/// from `new_store`: for a store that implements
/// [`save_recovery_point`](IdempotencyStore::save_recovery_point) and
/// [`recoverable`](IdempotencyStore::recoverable). Panics on the first violation.
pub async fn run_recovery<F, Fut>(new_store: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = DynStore>,
{
    type Check = fn(DynStore) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
    macro_rules! checks {
        ($($name:ident,)*) => {
            [$((stringify!($name), (|s| Box::pin($name(s))) as Check)),*]
        };
    }
    for (name, check) in crate::__conformance_recovery_checks!([checks]) {
        let store = new_store().await;
        if let Err(e) = tokio::spawn(check(store)).await {
            eprintln!("conformance check `{name}` failed");
            match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => panic!("conformance check `{name}` did not finish: {e}"),
            }
        }
    }
}

/// The recovery-point checks, as [`__conformance_checks`] lists the others.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_recovery_checks {
    ([$($callback:tt)+] $($args:tt)*) => {
        $($callback)+! { $($args)*
            recovery_points_are_fenced_and_handed_to_a_takeover,
            the_largest_recovery_point_round_trips,
            recoverable_lists_lapsed_records_with_a_point,
        }
    };
}

/// The one list of the checks every store runs (the full-store and operator checks apart):
/// `__conformance_checks!([callback] args…)` expands to `callback! { args… name, name, … }`, so
/// `run_all` and `conformance_suite!` cannot drift apart.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_checks {
    ([$($callback:tt)+] $($args:tt)*) => {
        $($callback)+! { $($args)*
            concurrent_claims_of_one_key_yield_exactly_one_claimed,
            completed_records_replay_byte_exactly,
            different_fingerprint_sees_the_existing_record,
            lapsed_lease_is_taken_over_with_a_greater_generation,
            stale_tokens_change_nothing,
            release_frees_the_key,
            get_reports_the_holder_of_a_record,
            releasing_a_takeover_keeps_the_keys_history,
            a_scoped_claim_claims_the_same_record,
            extend_keeps_the_lease_alive,
            ttl_expiry_makes_the_key_new,
            completed_records_are_not_taken_over_after_the_lease,
            scopes_are_isolated,
            records_live_for_their_ttl_and_no_longer,
            ttl_counts_from_completion,
            concurrent_claims_of_a_lapsed_or_expired_record_yield_exactly_one,
            forged_extend_leaves_the_lease_unchanged,
            lost_replies_are_unknown_and_resends_are_idempotent,
        }
    };
}

/// Generates one `#[tokio::test]` per conformance check.
///
/// `store` is an async block yielding `Option<DynStore>` (a fresh store, or `None` to skip);
/// `full`, when given, yields `Option<DynStore>` for a store small enough to fill; `admin`,
/// when given, yields `Option<DynAdminStore>` (a store with the operator API); `recovery`,
/// when given, yields `Option<DynStore>` for a store that keeps
/// [recovery points](crate::RecoveryPoint), and runs their checks.
#[macro_export]
macro_rules! conformance_suite {
    (store: $store:expr $(, full: $full:expr)? $(, admin: $admin:expr)? $(, recovery: $recovery:expr)? $(,)?) => {
        $crate::__conformance_checks!([$crate::conformance_suite] @test $store;);
        $(
            $crate::conformance_suite!(@test $full; full_store_refuses_claims_and_keeps_records,);
        )?
        $(
            $crate::conformance_suite!(@test $admin;
                operator_api_inspects_releases_and_deletes,
                inspect_shows_the_recovery_point,
            );
        )?
        $(
            $crate::__conformance_recovery_checks!([$crate::conformance_suite] @test $recovery;);
        )?
    };
    (@test $store:expr; $($name:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let Some(store) = $store.await else { return };
                $crate::conformance::$name(store).await;
            }
        )*
    };
}
