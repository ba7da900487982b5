//! Each way an operation refuses or answers without running its work, typed, on memory, Redis
//! and Postgres (the scenarios run by `on_every_store!`, see `operations`): another input
//! under a key is a mismatch; bad input is refused before the store hears of it; a failure
//! releases the key and the next call runs; an answer over the cap, or asked for as another
//! type, is not run again; a failed or hung claim is a store error that runs nothing and
//! leaves the key free.

use crate::operations::{
    identify, kept_answer, message, on_every_store, ops, ops_with, record, unique, Message, ORDER,
    RETRY_AFTER, SCOPE,
};
use crate::support::{Fault, FaultStore, Op};

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::time::Instant;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::operation::{Identity, InvalidInput, Json, OnceError, OperationLayer, Raw};
use tower_idempotency::store::{Completion, IdempotencyStore, RecordState, StoreErrorKind};
use tower_idempotency::{IdempotencyContext, Timing};

// ---- 4. another input under the key ------------------------------------------------------

async fn another_input_under_the_key_is_a_mismatch_and_runs_nothing(
    store: Arc<dyn IdempotencyStore>,
) {
    let ops = ops(store.clone());
    let key = unique("mismatch");
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>| {
        let runs = runs.clone();
        move |_: IdempotencyContext| async move {
            Ok::<_, Infallible>(format!("run {}", runs.fetch_add(1, SeqCst) + 1))
        }
    };
    let input = serde_json::json!({"amount": 10, "currency": "eur"});
    assert_eq!(
        ops.once(SCOPE, &key, &input, work(&runs)).await.unwrap(),
        "run 1"
    );

    let other = serde_json::json!({"amount": 11, "currency": "eur"});
    let refused = ops.once(SCOPE, &key, &other, work(&runs)).await;
    assert!(matches!(refused, Err(OnceError::Mismatch)), "{refused:?}");
    assert_eq!(runs.load(SeqCst), 1, "the mismatch ran the work");
    // The same input with its members in another order is the same input: replayed.
    let reordered = serde_json::json!({"currency": "eur", "amount": 10});
    assert_eq!(
        ops.once(SCOPE, &key, &reordered, work(&runs))
            .await
            .unwrap(),
        "run 1"
    );
    assert_eq!(
        kept_answer(&*store, &key).await,
        Bytes::from_static(b"\"run 1\"")
    );
    // The key in another scope names another operation.
    let elsewhere = Identity::json(&key, &other).unwrap().in_scope("refunds");
    let ran = ops.run(elsewhere, &Json, work(&runs)).await;
    assert_eq!(ran.unwrap(), "run 2");

    // Bytes: the same, byte for byte, through a layer recording them as they are.
    let frame_key = unique("mismatch-raw");
    let identify_frame = {
        let key = frame_key.clone();
        move |frame: &Bytes| Ok(Identity::bytes(&key, frame)?.in_scope(SCOPE))
    };
    let frames = Arc::new(AtomicUsize::new(0));
    let inner = service_fn({
        let frames = frames.clone();
        move |frame: Bytes| {
            let n = frames.fetch_add(1, SeqCst) + 1;
            let ack = [b"\x00ack ".as_slice(), &frame, format!(" #{n}").as_bytes()].concat();
            std::future::ready(Ok::<_, Infallible>(Bytes::from(ack)))
        }
    });
    let svc = OperationLayer::new(ops.clone(), identify_frame)
        .with_codec(Raw)
        .layer(inner);
    let v1 = || Bytes::from_static(b"frame v1");
    let first = svc.clone().oneshot(v1()).await.unwrap();
    assert_eq!(first, Bytes::from_static(b"\x00ack frame v1 #1"));
    let refused = svc.clone().oneshot(Bytes::from_static(b"frame v2")).await;
    assert!(matches!(refused, Err(OnceError::Mismatch)), "{refused:?}");
    assert_eq!(svc.clone().oneshot(v1()).await.unwrap(), first);
    assert_eq!(frames.load(SeqCst), 1);
    match record(&*store, &frame_key).await.map(|r| r.state) {
        Some(RecordState::Completed(Completion::Response(kept))) => {
            assert_eq!(kept.body, first, "kept as the bytes they are");
            assert_eq!(kept.headers["content-type"], "application/octet-stream");
        }
        other => panic!("{other:?}"),
    }
}

// ---- 5. bad input -------------------------------------------------------------------------

async fn bad_input_is_refused_before_the_store_hears_of_it(store: Arc<dyn IdempotencyStore>) {
    // A pass-through wrapper, here for its count of calls.
    let counted = FaultStore::new(store.clone());
    let ops = ops(counted.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>| {
        let runs = runs.clone();
        move |_: IdempotencyContext| async move {
            runs.fetch_add(1, SeqCst);
            Ok::<_, Infallible>(1_u64)
        }
    };
    let long = "k".repeat(256);
    let suffix = unique("bad");
    let spaced = format!("a b-{suffix}");
    let accented = format!("clé-{suffix}");
    for key in ["", &long, &spaced, &accented] {
        let refused = ops.once(SCOPE, key, &ORDER, work(&runs)).await;
        assert!(
            matches!(
                refused,
                Err(OnceError::Invalid(InvalidInput::KeyInvalid(_)))
            ),
            "{key:?}: {refused:?}"
        );
        assert_eq!(record(&*store, key).await, None, "{key:?}");
    }
    // A payload that is not JSON: a map with tuple keys.
    let unserializable = unique("bad-payload");
    let mut tuples = BTreeMap::new();
    tuples.insert((1, 2), "not a JSON key");
    let refused = ops.once(SCOPE, &unserializable, &tuples, work(&runs)).await;
    assert!(
        matches!(
            refused,
            Err(OnceError::Invalid(InvalidInput::Unserializable(_)))
        ),
        "{refused:?}"
    );
    assert_eq!(record(&*store, &unserializable).await, None);

    // Through the layer: a message without a key, and one whose key is bad.
    let inner_runs = Arc::new(AtomicUsize::new(0));
    let inner = service_fn({
        let runs = inner_runs.clone();
        move |_: Message| {
            runs.fetch_add(1, SeqCst);
            std::future::ready(Ok::<_, Infallible>("ran".to_owned()))
        }
    });
    let svc = OperationLayer::new(ops.clone(), identify).layer(inner);
    let keyless = Message {
        id: None,
        body: "no key".to_owned(),
    };
    let refused = svc.clone().oneshot(keyless).await;
    assert!(
        matches!(refused, Err(OnceError::Invalid(InvalidInput::KeyMissing))),
        "{refused:?}"
    );
    let refused = svc.clone().oneshot(message(&spaced)).await;
    assert!(
        matches!(
            refused,
            Err(OnceError::Invalid(InvalidInput::KeyInvalid(_)))
        ),
        "{refused:?}"
    );

    assert_eq!(
        (runs.load(SeqCst), inner_runs.load(SeqCst)),
        (0, 0),
        "bad input ran"
    );
    for op in [Op::Claim, Op::Get, Op::Extend, Op::Complete, Op::Release] {
        assert_eq!(counted.calls(op), 0, "the store heard {op:?}");
    }
    // The longest key allowed, 255 bytes, is claimed and runs: the count above counts.
    let longest = format!("{suffix}{}", "k".repeat(255 - suffix.len()));
    assert_eq!(
        ops.once(SCOPE, &longest, &ORDER, work(&runs))
            .await
            .unwrap(),
        1
    );
    assert_eq!((runs.load(SeqCst), counted.calls(Op::Claim)), (1, 1));
    assert!(record(&*store, &longest).await.is_some());
}

// ---- 6. a failure releases the key --------------------------------------------------------

#[derive(Debug, PartialEq, Eq)]
struct Declined(String);

async fn a_failure_releases_the_key_and_the_next_call_runs(store: Arc<dyn IdempotencyStore>) {
    let ops = ops(store.clone());
    let key = unique("failed");
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>, fail: bool| {
        let runs = runs.clone();
        move |ctx: IdempotencyContext| async move {
            let n = runs.fetch_add(1, SeqCst) + 1;
            if fail {
                return Err(Declined(format!("declined on run {n}")));
            }
            Ok(format!(
                "paid on run {n} at generation {}",
                ctx.generation()
            ))
        }
    };
    let failed = ops.once(SCOPE, &key, &ORDER, work(&runs, true)).await;
    match failed {
        Err(OnceError::Failed(e)) => assert_eq!(e, Declined("declined on run 1".to_owned())),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        record(&*store, &key).await,
        None,
        "a released first claim is gone"
    );

    let paid = ops
        .once(SCOPE, &key, &ORDER, work(&runs, false))
        .await
        .unwrap();
    assert_eq!(paid, "paid on run 2 at generation 1");
    assert_eq!(
        kept_answer(&*store, &key).await,
        serde_json::to_vec(&paid).unwrap()
    );
    let again = ops.once(SCOPE, &key, &ORDER, work(&runs, true)).await;
    assert_eq!(again.unwrap(), paid);
    assert_eq!(runs.load(SeqCst), 2);
}

async fn a_panicking_work_releases_the_key(store: Arc<dyn IdempotencyStore>) {
    let ops = ops(store.clone());
    let key = unique("panicked");
    let panicking = tokio::spawn({
        let (ops, key) = (ops.clone(), key.clone());
        async move {
            let work = |ctx: IdempotencyContext| async move {
                if ctx.generation() > 0 {
                    panic!("the work panicked (on purpose)");
                }
                Ok::<u64, Infallible>(0)
            };
            ops.once(SCOPE, &key, &ORDER, work).await
        }
    });
    let joined = panicking.await;
    assert!(
        joined.unwrap_err().is_panic(),
        "the panic reaches the caller"
    );
    assert_eq!(record(&*store, &key).await, None, "the key stayed held");
    let runs = Arc::new(AtomicUsize::new(0));
    assert_eq!(
        ops.once(SCOPE, &key, &ORDER, counted(&runs)).await.unwrap(),
        1
    );
    assert_eq!(runs.load(SeqCst), 1);
}

// ---- 7. not kept, undecodable -------------------------------------------------------------

async fn an_answer_over_the_cap_is_not_kept_and_not_run_again(store: Arc<dyn IdempotencyStore>) {
    let cap = NonZeroUsize::new(64).unwrap();
    let ops = ops_with(store.clone(), |l| l.with_max_response_body(cap));
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: &Arc<AtomicUsize>, len: usize| {
        let runs = runs.clone();
        move |_: IdempotencyContext| async move {
            runs.fetch_add(1, SeqCst);
            Ok::<_, Infallible>("x".repeat(len))
        }
    };
    let key = unique("over-cap");
    // 200 characters encode to 202 bytes of JSON, over the cap of 64.
    assert_eq!(
        ops.once(SCOPE, &key, &ORDER, work(&runs, 200))
            .await
            .unwrap()
            .len(),
        200
    );
    let done = record(&*store, &key).await.unwrap();
    assert!(
        matches!(
            done.state,
            RecordState::Completed(Completion::Tombstone { .. })
        ),
        "{done:?}"
    );
    let again = ops.once(SCOPE, &key, &ORDER, work(&runs, 200)).await;
    match again {
        Err(e @ OnceError::NotKept) => assert!(e.completed() && e.retry_after().is_none()),
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(SeqCst), 1, "run again");
    // Under the cap (62 bytes of JSON), the answer is kept and replayed.
    let under = unique("under-cap");
    let kept = ops
        .once(SCOPE, &under, &ORDER, work(&runs, 60))
        .await
        .unwrap();
    assert_eq!(
        ops.once(SCOPE, &under, &ORDER, work(&runs, 60))
            .await
            .unwrap(),
        kept
    );
    assert_eq!(runs.load(SeqCst), 2);
}

async fn an_answer_of_another_type_is_undecodable_and_not_run_again(
    store: Arc<dyn IdempotencyStore>,
) {
    let ops = ops(store.clone());
    let key = unique("undecodable");
    let runs = Arc::new(AtomicUsize::new(0));
    let text = ops
        .once(SCOPE, &key, &ORDER, |_| async {
            runs.fetch_add(1, SeqCst);
            Ok::<_, Infallible>("forty-two".to_owned())
        })
        .await
        .unwrap();
    let as_number = ops
        .once(SCOPE, &key, &ORDER, |_| async {
            runs.fetch_add(1, SeqCst);
            Ok::<u64, Infallible>(42)
        })
        .await;
    match as_number {
        Err(e @ OnceError::Undecodable(_)) => assert!(e.completed()),
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(SeqCst), 1);
    // Asked as the type it was recorded as, it replays.
    let again = ops
        .once(SCOPE, &key, &ORDER, |_| async {
            Ok::<String, Infallible>("never".to_owned())
        })
        .await;
    assert_eq!(again.unwrap(), text);
    assert_eq!(
        kept_answer(&*store, &key).await,
        Bytes::from_static(b"\"forty-two\"")
    );
}

// ---- 8. store faults ----------------------------------------------------------------------

/// Counts its runs and answers its generation.
fn counted(
    runs: &Arc<AtomicUsize>,
) -> impl FnOnce(IdempotencyContext) -> BoxFuture<'static, Result<u64, Infallible>> + Send {
    let runs = runs.clone();
    move |ctx| {
        Box::pin(async move {
            runs.fetch_add(1, SeqCst);
            Ok(ctx.generation())
        })
    }
}

fn unavailable<T: std::fmt::Debug>(r: &Result<T, OnceError<Infallible>>) -> StoreErrorKind {
    match r {
        Err(OnceError::StoreUnavailable { error, retry_after }) => {
            assert_eq!(*retry_after, RETRY_AFTER, "{error}");
            error.kind()
        }
        other => panic!("{other:?}"),
    }
}

async fn a_failed_claim_is_store_unavailable_and_runs_nothing(store: Arc<dyn IdempotencyStore>) {
    let faulty = FaultStore::new(store.clone());
    let ops = ops(faulty.clone());
    let key = unique("claim-fails");
    let runs = Arc::new(AtomicUsize::new(0));
    faulty.on_all(Op::Claim, Fault::Fail);
    let refused = ops.once(SCOPE, &key, &ORDER, counted(&runs)).await;
    assert_eq!(unavailable(&refused), StoreErrorKind::Unavailable);
    assert_eq!(refused.unwrap_err().retry_after(), Some(RETRY_AFTER));
    assert_eq!(runs.load(SeqCst), 0, "ran unprotected");
    assert_eq!(record(&*store, &key).await, None);
    faulty.heal();
    assert_eq!(
        ops.once(SCOPE, &key, &ORDER, counted(&runs)).await.unwrap(),
        1
    );
    assert_eq!(runs.load(SeqCst), 1);
}

async fn a_hung_claim_is_unknown_and_leaves_the_key_free(store: Arc<dyn IdempotencyStore>) {
    const DEADLINE: Duration = Duration::from_millis(200);
    let timing = Timing::new(Duration::from_secs(4), Duration::from_secs(60))
        .unwrap()
        .with_store_timeout(DEADLINE)
        .unwrap();
    let faulty = FaultStore::new(store.clone());
    let ops = ops_with(faulty.clone(), |l| l.with_timing(timing));
    let runs = Arc::new(AtomicUsize::new(0));

    // The claim never reaches the store.
    let key = unique("claim-hangs");
    faulty.on(Op::Claim, 1, Fault::Hang);
    let sent = Instant::now();
    let refused = ops.once(SCOPE, &key, &ORDER, counted(&runs)).await;
    assert_eq!(unavailable(&refused), StoreErrorKind::Unknown);
    assert!(sent.elapsed() >= DEADLINE, "answered before the deadline");
    assert!(
        sent.elapsed() < Duration::from_secs(2),
        "took {:?}",
        sent.elapsed()
    );
    assert_eq!(runs.load(SeqCst), 0);
    assert_eq!(record(&*store, &key).await, None);
    assert_eq!(
        ops.once(SCOPE, &key, &ORDER, counted(&runs)).await.unwrap(),
        1
    );

    // The claim takes effect, and its reply comes past the deadline (and past the window the
    // call waits for it): the claim is released on a task of its own, long before its lease
    // would lapse, and a later call runs as a first attempt.
    let key = unique("claim-late");
    faulty.on(
        Op::Claim,
        faulty.calls(Op::Claim) + 1,
        Fault::ReplyLate(Duration::from_millis(900)),
    );
    let sent = Instant::now();
    let refused = ops.once(SCOPE, &key, &ORDER, counted(&runs)).await;
    assert_eq!(unavailable(&refused), StoreErrorKind::Unknown);
    assert_eq!(runs.load(SeqCst), 1);
    let generation = loop {
        match ops.once(SCOPE, &key, &ORDER, counted(&runs)).await {
            Err(OnceError::InProgress { .. }) if sent.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "the late claim held the key"
    );
    assert_eq!(
        generation, 1,
        "a takeover: the late claim lapsed instead of being released"
    );
    assert_eq!(runs.load(SeqCst), 2);
    assert!(faulty.calls(Op::Release) >= 1);
}

/// Polls `call` until the store call `op` has started, then drops it, as a caller's timeout
/// would (whatever the machine's load, the drop falls inside the slow store call).
async fn give_up_during<T: std::fmt::Debug>(
    call: impl std::future::Future<Output = T>,
    faulty: &FaultStore<Arc<dyn IdempotencyStore>>,
    op: Op,
) {
    let mut call = std::pin::pin!(call);
    while faulty.calls(op) == 0 {
        tokio::select! {
            r = &mut call => panic!("answered before {op:?} began: {r:?}"),
            () = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }
}

/// The caller gives up (a timeout around the call) after the work finished, while its answer
/// is being recorded. The work is done, so its answer must still be recorded: a retry then
/// replays it. Dropped there, the record stays in progress for the whole lease, and the
/// retry after it takes over and runs the finished work again.
async fn a_caller_timeout_while_recording_keeps_the_answer(store: Arc<dyn IdempotencyStore>) {
    let faulty = FaultStore::new(store.clone());
    let ops = ops(faulty.clone());
    let key = unique("timeout-recording");
    let runs = Arc::new(AtomicUsize::new(0));
    // Recording takes 300 ms (within the 1 s store deadline); the caller gives up meanwhile.
    faulty.on(Op::Complete, 1, Fault::Delay(Duration::from_millis(300)));
    let call = ops.once(SCOPE, &key, &ORDER, counted(&runs));
    give_up_during(call, &faulty, Op::Complete).await;
    assert_eq!(runs.load(SeqCst), 1);
    let given_up = Instant::now();
    loop {
        let state = record(&*store, &key).await.map(|r| r.state);
        if matches!(state, Some(RecordState::Completed(_))) {
            break;
        }
        assert!(
            given_up.elapsed() < Duration::from_secs(2),
            "the finished work's answer was never recorded: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        ops.once(SCOPE, &key, &ORDER, counted(&runs)).await.unwrap(),
        1
    );
    assert_eq!(runs.load(SeqCst), 1, "the finished work ran again");
}

/// The same for a failed work: its release still happens, so the next call runs at once as a
/// first attempt instead of meeting the claim for a lease (30 s here).
async fn a_caller_timeout_while_releasing_leaves_the_key_free(store: Arc<dyn IdempotencyStore>) {
    let faulty = FaultStore::new(store.clone());
    let ops = ops(faulty.clone());
    let key = unique("timeout-releasing");
    faulty.on(Op::Release, 1, Fault::Delay(Duration::from_millis(300)));
    let failing = ops.once(SCOPE, &key, &ORDER, |_| async { Err::<u64, _>("declined") });
    give_up_during(failing, &faulty, Op::Release).await;
    let given_up = Instant::now();
    let runs = Arc::new(AtomicUsize::new(0));
    let generation = loop {
        match ops.once(SCOPE, &key, &ORDER, counted(&runs)).await {
            Err(OnceError::InProgress { .. }) if given_up.elapsed() < Duration::from_secs(2) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert_eq!(generation, 1, "released, not taken over");
    assert_eq!((runs.load(SeqCst), faulty.calls(Op::Release)), (1, 1));
}

on_every_store!(
    another_input_under_the_key_is_a_mismatch_and_runs_nothing,
    bad_input_is_refused_before_the_store_hears_of_it,
    a_failure_releases_the_key_and_the_next_call_runs,
    a_panicking_work_releases_the_key,
    an_answer_over_the_cap_is_not_kept_and_not_run_again,
    an_answer_of_another_type_is_undecodable_and_not_run_again,
    a_failed_claim_is_store_unavailable_and_runs_nothing,
    a_hung_claim_is_unknown_and_leaves_the_key_free,
    a_caller_timeout_while_recording_keeps_the_answer,
    a_caller_timeout_while_releasing_leaves_the_key_free,
);
