//! `MemoryStore`'s claim, complete, extend and release under shuttle: its shard locks and
//! atomics are shuttle's (`--cfg shuttle`), so every run explores one interleaving of them,
//! chosen by a randomized and a PCT scheduler. `SHUTTLE_ITERATIONS` (default 2,000) per
//! scheduler and test.
#![cfg(shuttle)]

use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use shuttle::thread;
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyStore, MemoryStore, StoreError, StoreErrorKind,
};
use tower_idempotency::store::{
    Completion, Fingerprint, RecordId, RecordState, StoredResponse, Token,
};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

fn iterations() -> usize {
    std::env::var("SHUTTLE_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Both schedulers, the same test.
fn check(f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let g = f.clone();
    shuttle::Runner::new(
        shuttle::scheduler::RandomScheduler::new(iterations()),
        config(),
    )
    .run(move || f());
    shuttle::Runner::new(
        shuttle::scheduler::PctScheduler::new(3, iterations()),
        config(),
    )
    .run(move || g());
}

/// Shuttle runs each thread on its own stack, 32 KiB by default. A debug build of a claim
/// that takes over a record (with its recovery point) keeps more than that on the stack at
/// once, and overflowing it is a SIGSEGV, not a panic. 1 MiB leaves room to spare.
fn config() -> shuttle::Config {
    let mut config = shuttle::Config::new();
    config.stack_size = 1 << 20;
    config
}

/// The memory store never awaits anything but its own locks, so its futures finish on the
/// first poll; shuttle's executor runs them.
fn run<T>(fut: impl Future<Output = T>) -> T {
    shuttle::future::block_on(fut)
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn completion(body: &'static str) -> Completion {
    Completion::Response(StoredResponse::new(
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        body.into(),
        None,
    ))
}

fn claimed(out: &Result<ClaimOutcome, StoreError>) -> Option<Token> {
    match out {
        Ok(ClaimOutcome::Claimed(c)) => Some(c.token),
        _ => None,
    }
}

/// Contract 1: among concurrent claims of an absent key, exactly one gets `Claimed`; the
/// others see the record in progress.
#[test]
fn concurrent_claims_of_an_absent_key_claim_it_once() {
    check(|| {
        let store = Arc::new(
            MemoryStore::builder()
                .with_shards(NonZeroUsize::new(2).unwrap())
                .build(),
        );
        let id = RecordId::new(Some("model"), "k");
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                thread::spawn(move || run(store.claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))))
            })
            .collect();
        let outs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(
            outs.iter().filter(|o| claimed(o).is_some()).count(),
            1,
            "{outs:?}"
        );
        for o in outs.iter().filter(|o| claimed(o).is_none()) {
            match o {
                Ok(ClaimOutcome::Existing(r)) => {
                    assert!(matches!(r.state, RecordState::InProgress { .. }));
                    assert_eq!(r.generation, 1);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(store.len(), 1);
    });
}

/// Contracts 2 and 3: with the lease lapsed, the old holder's complete races two takeover
/// claims. Either the complete lands first (then nobody takes over and the answer replays),
/// or exactly one claim takes over with generation 2 and the old complete is fenced.
#[test]
fn a_late_complete_races_takeovers_and_exactly_one_side_wins() {
    check(|| {
        let store = Arc::new(MemoryStore::new());
        let id = RecordId::new(Some("model"), "k");
        // A zero lease has lapsed as soon as it is granted.
        let old = claimed(&run(store.claim(&ClaimRequest::new(
            &id,
            &fp(1),
            Duration::ZERO,
            TTL,
        ))))
        .unwrap();
        let completer = {
            let store = store.clone();
            thread::spawn(move || run(store.complete(&id, &old, &completion("old"), TTL)))
        };
        let claimers: Vec<_> = (0..2)
            .map(|_| {
                let store = store.clone();
                thread::spawn(move || run(store.claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))))
            })
            .collect();
        let completed = completer.join().unwrap();
        let claims: Vec<_> = claimers.into_iter().map(|h| h.join().unwrap()).collect();
        let takeovers: Vec<_> = claims.iter().filter_map(claimed).collect();
        let record = run(store.get(&id)).unwrap().unwrap();
        match completed {
            Ok(()) => {
                assert!(
                    takeovers.is_empty(),
                    "completed, yet taken over: {claims:?}"
                );
                assert_eq!(record.state, RecordState::Completed(completion("old")));
            }
            Err(e) => {
                assert_eq!(e.kind(), StoreErrorKind::Fenced);
                assert_eq!(takeovers.len(), 1, "{claims:?}");
                assert_eq!(takeovers[0].generation(), 2);
                assert_eq!(record.generation, 2);
                assert!(matches!(record.state, RecordState::InProgress { .. }));
            }
        }
    });
}

/// Contract 3: extend, complete and release by a stale token change nothing while the new
/// holder completes; the record ends with the new holder's answer.
#[test]
fn a_stale_holder_changes_nothing_while_the_new_one_completes() {
    check(|| {
        let store = Arc::new(MemoryStore::new());
        let id = RecordId::new(Some("model"), "k");
        let old = claimed(&run(store.claim(&ClaimRequest::new(
            &id,
            &fp(1),
            Duration::ZERO,
            TTL,
        ))))
        .unwrap();
        let new = claimed(&run(store.claim(&ClaimRequest::new(
            &id,
            &fp(1),
            LEASE,
            TTL,
        ))))
        .unwrap();
        let stale = {
            let store = store.clone();
            thread::spawn(move || {
                let e = run(store.extend(&id, &old, LEASE)).unwrap_err();
                let c = run(store.complete(&id, &old, &completion("old"), TTL)).unwrap_err();
                let r = run(store.release(&id, &old)).unwrap_err();
                [e.kind(), c.kind(), r.kind()]
            })
        };
        let holder = {
            let store = store.clone();
            thread::spawn(move || {
                run(store.extend(&id, &new, LEASE)).unwrap();
                run(store.complete(&id, &new, &completion("new"), TTL)).unwrap();
                // Idempotent per token: a resend after a lost reply succeeds.
                run(store.complete(&id, &new, &completion("new"), TTL)).unwrap();
            })
        };
        assert_eq!(stale.join().unwrap(), [StoreErrorKind::Fenced; 3]);
        holder.join().unwrap();
        let record = run(store.get(&id)).unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(completion("new")));
        assert_eq!(record.generation, 2);
    });
}

/// Contract 10: a takeover's release races two claims of the same request. A claim before
/// the release sees the live lease, one after it takes over: at most one does, with
/// generation 3. The key never starts again at generation 1.
#[test]
fn a_released_takeover_races_claims_and_its_generation_only_grows() {
    check(|| {
        let store = Arc::new(MemoryStore::new());
        let id = RecordId::new(Some("model"), "k");
        claimed(&run(store.claim(&ClaimRequest::new(
            &id,
            &fp(1),
            Duration::ZERO,
            TTL,
        ))))
        .unwrap();
        let second = claimed(&run(store.claim(&ClaimRequest::new(
            &id,
            &fp(1),
            LEASE,
            TTL,
        ))))
        .unwrap();
        assert_eq!(second.generation(), 2);
        let releaser = {
            let store = store.clone();
            thread::spawn(move || run(store.release(&id, &second)))
        };
        let claimers: Vec<_> = (0..2)
            .map(|_| {
                let store = store.clone();
                thread::spawn(move || run(store.claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))))
            })
            .collect();
        releaser.join().unwrap().unwrap();
        let claims: Vec<_> = claimers.into_iter().map(|h| h.join().unwrap()).collect();
        let takeovers: Vec<_> = claims.iter().filter_map(claimed).collect();
        assert!(takeovers.len() <= 1, "{claims:?}");
        for o in &claims {
            match o {
                Ok(ClaimOutcome::Claimed(c)) => {
                    assert!(c.takeover);
                    assert_eq!(c.token.generation(), 3);
                }
                Ok(ClaimOutcome::Existing(r)) => {
                    assert!(matches!(r.state, RecordState::InProgress { .. }));
                    assert!(r.generation >= 2, "{r:?}");
                }
                Ok(other) => panic!("unexpected outcome {other:?}"),
                Err(e) => panic!("{e:?}"),
            }
        }
        // The released token is fenced whoever won.
        let e = run(store.complete(&id, &second, &completion("late"), TTL)).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Fenced);
        let record = run(store.get(&id)).unwrap().unwrap();
        assert_eq!(record.generation, 2 + takeovers.len() as u64);
        assert_eq!(store.len(), 1);
    });
}

/// Contract 5 and the record budget: with room for one record, concurrent claims of
/// different keys admit exactly one, the rest are `Full`; a release frees the slot for the
/// next claim, and the count never drifts.
#[test]
fn a_full_store_admits_exactly_its_budget_and_release_frees_it() {
    check(|| {
        let store = Arc::new(
            MemoryStore::builder()
                .with_max_records(NonZeroUsize::new(1).unwrap())
                .with_shards(NonZeroUsize::new(2).unwrap())
                .build(),
        );
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let store = store.clone();
                thread::spawn(move || {
                    let id = RecordId::new(Some("model"), &format!("k{i}"));
                    let out = run(store.claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL)));
                    (id, out)
                })
            })
            .collect();
        let outs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<_> = outs
            .iter()
            .filter_map(|(id, o)| claimed(o).map(|t| (*id, t)))
            .collect();
        assert_eq!(winners.len(), 1, "{outs:?}");
        for (_, o) in outs.iter().filter(|(_, o)| claimed(o).is_none()) {
            assert_eq!(o.as_ref().unwrap_err().kind(), StoreErrorKind::Full);
        }
        assert_eq!(store.len(), 1);
        let (id, token) = winners[0];
        run(store.release(&id, &token)).unwrap();
        assert_eq!(store.len(), 0);
        let again = RecordId::new(Some("model"), "after-release");
        assert!(claimed(&run(store.claim(&ClaimRequest::new(
            &again,
            &fp(1),
            LEASE,
            TTL
        ))))
        .is_some());
    });
}
