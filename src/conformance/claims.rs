//! Claims and replay: one winner among concurrent claims, byte-exact replays, scopes.

use std::sync::Arc;
use std::time::Duration;

use crate::store::{ClaimOutcome, ClaimRequest};
use crate::store::{Completion, Fingerprint, RecordId, RecordState, StoredResponse};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::sync::Barrier;

use super::{assert_fenced, claim_token, fp, response, unique_id, DynStore, LEASE, TTL};

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
            r.vary = Some(crate::store::record::VaryGuard {
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

/// [`claim_now`](crate::store::IdempotencyStore::claim_now), wherever a store answers it, is
/// `claim` answered at once: 64 concurrent claims of an absent key, half through each, have
/// exactly one `Claimed`; a held record is never claimed again through it; a completed one
/// comes back with its fingerprint and its answer, to any fingerprint. A store that answers
/// `None` passes: the layer then calls `claim`.
pub async fn claim_now_answers_as_claim_does(store: DynStore) {
    const N: usize = 64;
    let id = unique_id("now");
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                let f = fp(11);
                let request = ClaimRequest::new(&id, &f, LEASE, TTL);
                barrier.wait().await;
                let now = if i % 2 == 0 {
                    store.claim_now(&request)
                } else {
                    None
                };
                match now {
                    Some(outcome) => outcome,
                    None => store.claim(&request).await,
                }
            })
        })
        .collect();
    let mut tokens = Vec::new();
    for t in tasks {
        match t.await.unwrap().expect("claim") {
            ClaimOutcome::Claimed(c) => tokens.push(c.token),
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.fingerprint, fp(11));
                assert!(matches!(r.state, RecordState::InProgress { .. }));
            }
        }
    }
    let [token] = tokens[..] else {
        panic!("{} of {N} claims were Claimed", tokens.len())
    };
    let first = fp(11);
    let held = ClaimRequest::new(&id, &first, LEASE, TTL);
    if let Some(outcome) = store.claim_now(&held) {
        match outcome.expect("claim_now") {
            ClaimOutcome::Existing(r) => {
                assert!(matches!(r.state, RecordState::InProgress { .. }))
            }
            other => panic!("a held record was claimed at once: {other:?}"),
        }
    }
    let answer = response(201, "now");
    store.complete(&id, &token, &answer, TTL).await.unwrap();
    for f in [fp(11), fp(12)] {
        let request = ClaimRequest::new(&id, &f, LEASE, TTL);
        let Some(outcome) = store.claim_now(&request) else {
            continue;
        };
        match outcome.expect("claim_now") {
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.fingerprint, fp(11));
                assert!(
                    matches!(&r.state, RecordState::Completed(c) if *c == answer),
                    "{:?}",
                    r.state
                );
            }
            other => panic!("a completed record was claimed at once: {other:?}"),
        }
    }
}
