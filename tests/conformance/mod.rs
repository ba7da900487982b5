//! The store conformance suite: every store runs these checks (see `src/store/mod.rs`).
//!
//! A store's test file calls [`conformance_suite!`] with an async factory that returns
//! `Option<Arc<dyn IdempotencyStore>>` (`None` skips, after printing why) and, optionally,
//! a factory for a store small enough to fill.
//!
//! Leases and TTLs here are real time (a store's own clock cannot be paused), so the
//! checks that wait for a lease or a TTL to lapse sleep past it with a margin. They never
//! sleep to order two tasks: concurrency is ordered by a barrier.
#![allow(dead_code, unreachable_pub, clippy::match_wildcard_for_single_variants)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::sync::Barrier;
use tower_idempotency::store::{ClaimOutcome, IdempotencyStore, StoreErrorKind};
use tower_idempotency::{Completion, Fingerprint, RecordId, RecordState, StoredResponse, Token};

pub type DynStore = Arc<dyn IdempotencyStore>;

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

pub fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

pub fn response(status: u16, body: impl Into<Bytes>) -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.append("link", HeaderValue::from_static("</a>; rel=a"));
    headers.append("link", HeaderValue::from_static("</b>; rel=b"));
    Completion::Response(StoredResponse {
        status: StatusCode::from_u16(status).unwrap(),
        headers,
        body: body.into(),
        trailers: None,
    })
}

async fn claim_token(store: &DynStore, id: &RecordId, f: Fingerprint, lease: Duration) -> Token {
    match store.claim(id, &f, lease, TTL).await.expect("claim") {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn assert_fenced<T: std::fmt::Debug>(
    r: Result<T, tower_idempotency::store::StoreError>,
    what: &str,
) {
    match r {
        Err(e) if e.kind() == StoreErrorKind::Fenced => {}
        other => panic!("{what}: expected Fenced, got {other:?}"),
    }
}

pub async fn concurrent_claims_of_one_key_yield_exactly_one_claimed(store: DynStore) {
    const N: usize = 64;
    let id = unique_id("race");
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&id, &fp(1), LEASE, TTL).await
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
        Completion::Response(StoredResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from(big),
            trailers: Some(trailers),
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
        match store.claim(&id, &fp(2), LEASE, TTL).await.expect("claim") {
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

pub async fn different_fingerprint_sees_the_existing_record(store: DynStore) {
    let id = unique_id("mismatch");
    let token = claim_token(&store, &id, fp(3), LEASE).await;
    match store.claim(&id, &fp(4), LEASE, TTL).await.expect("claim") {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(3));
            assert!(matches!(r.state, RecordState::InProgress { .. }));
        }
        other => panic!("expected Existing, got {other:?}"),
    }
    store
        .complete(&id, &token, &response(200, "ok"), TTL)
        .await
        .unwrap();
    match store.claim(&id, &fp(4), LEASE, TTL).await.expect("claim") {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(3));
            assert!(matches!(r.state, RecordState::Completed(_)));
        }
        other => panic!("expected Existing, got {other:?}"),
    }
}

pub async fn lapsed_lease_is_taken_over_with_a_greater_generation(store: DynStore) {
    let id = unique_id("takeover");
    let short = Duration::from_millis(300);
    let old = claim_token(&store, &id, fp(5), short).await;
    match store.claim(&id, &fp(5), LEASE, TTL).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
            )
        }
        other => panic!("live lease must not be taken over: {other:?}"),
    }
    tokio::time::sleep(short + Duration::from_millis(250)).await;
    // Another request may not take over, even with the lease lapsed.
    match store.claim(&id, &fp(6), LEASE, TTL).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(5));
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining == Duration::ZERO)
            );
        }
        other => panic!("a different fingerprint must not take over: {other:?}"),
    }
    let new = match store.claim(&id, &fp(5), LEASE, TTL).await.unwrap() {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            assert!(c.token.generation() > old.generation());
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

pub async fn stale_tokens_change_nothing(store: DynStore) {
    let id = unique_id("stale");
    let token = claim_token(&store, &id, fp(7), LEASE).await;
    // Same generation, another nonce: a forged or foreign token.
    let forged = Token::new(token.generation());
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
    assert_fenced(
        store
            .complete(&id, &again, &response(500, "twice"), TTL)
            .await,
        "complete twice",
    );
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
    assert_fenced(store.release(&absent, &forged).await, "release absent");
    assert!(store.get(&absent).await.unwrap().is_none());
}

pub async fn release_frees_the_key(store: DynStore) {
    let id = unique_id("release");
    let token = claim_token(&store, &id, fp(8), LEASE).await;
    store.release(&id, &token).await.unwrap();
    assert!(store.get(&id).await.unwrap().is_none());
    match store.claim(&id, &fp(9), LEASE, TTL).await.unwrap() {
        ClaimOutcome::Claimed(c) => assert!(!c.takeover),
        other => panic!("released key must be claimable, got {other:?}"),
    }
}

pub async fn extend_keeps_the_lease_alive(store: DynStore) {
    let id = unique_id("extend");
    let lease = Duration::from_millis(1000);
    let token = claim_token(&store, &id, fp(10), lease).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    store.extend(&id, &token, lease).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    // 1.2 s after the claim, 0.6 s after the renewal: still held.
    match store.claim(&id, &fp(10), lease, TTL).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
            )
        }
        other => panic!("renewed lease must hold, got {other:?}"),
    }
}

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
    match store.claim(&id, &fp(12), LEASE, TTL).await.unwrap() {
        ClaimOutcome::Claimed(c) => assert!(!c.takeover),
        other => panic!("expired key must be new, got {other:?}"),
    }
}

pub async fn completed_records_are_not_taken_over_after_the_lease(store: DynStore) {
    let id = unique_id("kept");
    let short = Duration::from_millis(200);
    let token = claim_token(&store, &id, fp(13), short).await;
    store
        .complete(&id, &token, &response(201, "done"), TTL)
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    match store.claim(&id, &fp(13), LEASE, TTL).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "done")))
        }
        other => panic!("completed record must replay, got {other:?}"),
    }
}

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

/// Fills `store` with completed records until it refuses a claim, then checks that the refusal
/// is `Full`, that nothing was evicted and that completed records still replay.
pub async fn full_store_refuses_claims_and_keeps_records(store: DynStore) {
    let body = Bytes::from(vec![0x5a; 16 * 1024]);
    let mut kept = Vec::new();
    let mut refused = None;
    for i in 0..20_000 {
        let id = unique_id(&format!("fill-{i}"));
        match store.claim(&id, &fp(17), LEASE, TTL).await {
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
            match store.claim(id, &fp(17), LEASE, TTL).await.unwrap() {
                ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::Completed(_))),
                other => panic!("replay in a full store: {other:?}"),
            }
        }
    }
}

/// Generates one `#[tokio::test]` per conformance check.
///
/// `store` is an async block yielding `Option<DynStore>` (a fresh store, or `None` to skip);
/// `full`, when given, yields `Option<DynStore>` for a store small enough to fill.
#[macro_export]
macro_rules! conformance_suite {
    (store: $store:expr $(, full: $full:expr)? $(,)?) => {
        $crate::conformance_suite!(@test $store;
            concurrent_claims_of_one_key_yield_exactly_one_claimed,
            completed_records_replay_byte_exactly,
            different_fingerprint_sees_the_existing_record,
            lapsed_lease_is_taken_over_with_a_greater_generation,
            stale_tokens_change_nothing,
            release_frees_the_key,
            extend_keeps_the_lease_alive,
            ttl_expiry_makes_the_key_new,
            completed_records_are_not_taken_over_after_the_lease,
            scopes_are_isolated,
        );
        $(
            $crate::conformance_suite!(@test $full; full_store_refuses_claims_and_keeps_records,);
        )?
    };
    (@test $store:expr; $($name:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let Some(store) = $store.await else { return };
                conformance::$name(store).await;
            }
        )*
    };
}
