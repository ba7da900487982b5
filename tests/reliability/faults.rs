//! The layer under store faults: calls that hang, answer late, fail, or fail after they took
//! effect, injected by `FaultStore` around a real `MemoryStore`. Time is paused, so a lease
//! of seconds costs no wall time and every instant is exact.

use crate::support;

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use support::*;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::{service_fn, util::BoxCloneService, Layer, ServiceExt};
use tower_idempotency::store::{IdempotencyStore, MemoryStore};
use tower_idempotency::{
    store::{Completion, RecordId, RecordState, StoredResponse},
    Abandoned, DefaultRecordPolicy, ErrorKind, Grpc, IdempotencyContext, IdempotencyError,
    IdempotencyLayer, InProgress, RecordDecision, RecordPolicy, RequestBody, ResponseBody, Timing,
};

type Body = BoxBody<Bytes, std::io::Error>;
type Res = Response<ResponseBody<Body>>;
type Svc = BoxCloneService<Request<Full<Bytes>>, Res, Infallible>;

const LEASE: Duration = Duration::from_secs(3);

fn timing() -> Timing {
    Timing::new(LEASE, Duration::from_secs(3600)).unwrap()
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed()
}

/// The inner service: counts runs; `/gated` waits for `gate`; `/status/N` answers N;
/// `/grpc/...` answers a gRPC stream larger than the test limit, status from the path.
#[derive(Clone, Default)]
struct App {
    calls: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: Arc<Notify>,
}

impl App {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    async fn handle(
        self,
        req: Request<RequestBody<Full<Bytes>>>,
    ) -> Result<Response<Body>, Infallible> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let path = req.uri().path().to_owned();
        let mut res = Response::new(full(format!("run {n}")));
        *res.status_mut() = StatusCode::CREATED;
        if path == "/gated" {
            self.started.notify_one();
            self.gate.notified().await;
        } else if let Some(s) = path.strip_prefix("/status/") {
            *res.status_mut() = StatusCode::from_u16(s.parse().unwrap()).unwrap();
        } else if let Some(rest) = path.strip_prefix("/grpc.Test/") {
            // `/grpc.Test/Status<code>[Release]`: 64 bytes of messages, then the status.
            let code: u32 = rest
                .trim_start_matches("Status")
                .trim_end_matches("Release")
                .parse()
                .unwrap();
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from(code));
            let frames = vec![
                Ok(Frame::data(Bytes::from(vec![b'a'; 32]))),
                Ok(Frame::data(Bytes::from(vec![b'b'; 32]))),
                Ok(Frame::trailers(trailers)),
            ];
            let mut r = Response::new(StreamBody::new(stream::iter(frames)).boxed());
            r.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            if rest.ends_with("Release") {
                r.extensions_mut().insert(RecordDecision::Release);
            }
            return Ok(r);
        }
        Ok(res)
    }
}

fn svc(layer: IdempotencyLayer, app: &App) -> Svc {
    let app = app.clone();
    BoxCloneService::new(layer.layer(service_fn(move |req| app.clone().handle(req))))
}

/// One call; fails the test instead of hanging when the layer never answers.
async fn call(s: Svc, req: Request<Full<Bytes>>) -> Res {
    tokio::time::timeout(Duration::from_secs(600), s.oneshot(req))
        .await
        .expect("the layer never answered")
        .unwrap()
}

fn kind(res: &Res) -> Option<ErrorKind> {
    res.extensions().get::<IdempotencyError>().map(|e| e.kind())
}

fn grpc(path: &str, key: &str) -> Request<Full<Bytes>> {
    Request::post(path)
        .header("content-type", "application/grpc")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\x01x")))
        .unwrap()
}

/// Waits, without sleeping, until `done` holds: the layer settles after answering.
async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("condition never held");
}

// 1. Every store call is bounded in time ------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_hung_claim_is_503_at_the_store_deadline_and_runs_nothing() {
    let store = FaultStore::new(MemoryStore::new());
    store.on(Op::Claim, 1, Fault::Hang);
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    let t0 = Instant::now();
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 503);
    assert_eq!(kind(&res), Some(ErrorKind::StoreUnavailable));
    assert_eq!(
        t0.elapsed(),
        timing().store_timeout() * 2,
        "answered at the deadline, after one more for a late reply to release"
    );
    assert_eq!(app.calls(), 0);

    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201, "the hung claim never took effect");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_claim_answered_after_its_deadline_is_503_and_released_if_it_took_effect() {
    let store = FaultStore::new(MemoryStore::new());
    // Takes effect at once; the reply comes two seconds later.
    store.on(Op::Claim, 1, Fault::ReplyLate(Duration::from_secs(2)));
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(
        res.status(),
        503,
        "a timed-out claim is unknown, never claimed"
    );
    assert_eq!(app.calls(), 0);

    // The claim finishes on its own task and is released, well before its lease lapses.
    until_released(&store, 1).await;
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(
        res.status(),
        201,
        "a retry runs: the late claim was released, not left held"
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_claim_won_just_past_its_deadline_is_released_before_the_503_goes_out() {
    let store = FaultStore::new(MemoryStore::new());
    // Takes effect at once; the reply comes 200 ms past the store deadline.
    let late = timing().store_timeout() + Duration::from_millis(200);
    store.on(Op::Claim, 1, Fault::ReplyLate(late));
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    let t0 = Instant::now();
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 503);
    assert_eq!(kind(&res), Some(ErrorKind::StoreUnavailable));
    assert_eq!(
        t0.elapsed(),
        late,
        "answered once the late claim was released"
    );
    assert_eq!(store.calls(Op::Release), 1, "released before the 503");
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201, "a retry sent at once runs");
    assert_eq!(app.calls(), 1);
}

async fn until_released(store: &FaultStore, n: usize) {
    tokio::time::timeout(LEASE, async {
        while store.calls(Op::Release) < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("no release within a lease");
}

/// Issue 23: generation 1 ran but its answer never reached the store; generation 2 took
/// over, but its claim's reply came past the deadline, so it was released in the background.
/// That release keeps the key's history: the next retry is a takeover (generation 3), and
/// the abandoned-key hook warns about the work an earlier attempt may have done.
#[tokio::test(start_paused = true)]
async fn a_takeover_released_after_a_late_claim_reply_leaves_the_next_retry_a_takeover() {
    let store = FaultStore::new(MemoryStore::new());
    let heard: Arc<Mutex<Vec<Abandoned>>> = Arc::default();
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing())
            .with_abandoned_hook({
                let heard = heard.clone();
                move |a| heard.lock().unwrap().push(a.clone())
            }),
        &app,
    );
    let id = RecordId::new(None, "k");

    store.on_all(Op::Complete, Fault::Fail);
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201, "answered, though not recorded");
    assert_eq!(app.calls(), 1);
    store.heal();
    tokio::time::sleep(LEASE).await;

    store.on(Op::Claim, 2, Fault::ReplyLate(Duration::from_secs(2)));
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 503);
    until_released(&store, 1).await;
    assert_eq!(app.calls(), 1);
    assert!(heard.lock().unwrap().is_empty(), "{heard:?}");

    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201);
    assert_eq!(app.calls(), 2);
    let heard = heard.lock().unwrap().clone();
    assert_eq!(heard.len(), 1, "the retry must be reported: {heard:?}");
    assert_eq!((heard[0].old_generation, heard[0].new_generation), (2, 3));
    // Abandoned since the release, by the store's clock (paused: exact).
    let released = store.started(Op::Release)[0];
    let retried = store.started(Op::Claim)[2];
    assert_eq!(heard[0].abandoned_for, Some(retried - released));
    let record = store.inner.get(&id).await.unwrap().unwrap();
    assert_eq!(record.generation, 3);
    assert!(matches!(record.state, RecordState::Completed(_)));
}

/// The same with a takeover whose run answered 503: released before the answer, the record
/// kept, so the retry is a takeover of generation 3 and both takeovers are reported.
#[tokio::test(start_paused = true)]
async fn a_takeover_released_after_a_503_leaves_the_next_retry_a_takeover() {
    let store = FaultStore::new(MemoryStore::new());
    let heard: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing())
        .with_abandoned_hook({
            let heard = heard.clone();
            move |a| {
                let generations = (a.old_generation, a.new_generation);
                heard.lock().unwrap().push(generations);
            }
        });
    let s: Svc = BoxCloneService::new(layer.layer(service_fn({
        let runs = runs.clone();
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            // The first run charged; the second met an outage of the card network.
            let status = match runs.fetch_add(1, Ordering::SeqCst) {
                1 => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::CREATED,
            };
            let mut res = Response::new(full("run"));
            *res.status_mut() = status;
            async move { Ok::<_, Infallible>(res) }
        }
    })));

    store.on_all(Op::Complete, Fault::Fail);
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201);
    store.heal();
    tokio::time::sleep(LEASE).await;
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 503);
    assert_eq!(store.calls(Op::Release), 1, "released before the answer");
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(*heard.lock().unwrap(), [(1, 2), (2, 3)]);
    let record = store.inner.get(&RecordId::new(None, "k")).await.unwrap();
    assert_eq!(record.map(|r| r.generation), Some(3));
}

#[tokio::test(start_paused = true)]
async fn a_hung_get_in_wait_mode_is_bounded() {
    let store = FaultStore::new(MemoryStore::new());
    store.on_all(Op::Get, Fault::Hang);
    let app = App::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing())
        .with_in_progress(InProgress::wait(Duration::from_secs(2)));
    let s = svc(layer, &app);
    let first = tokio::spawn(call(s.clone(), post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let t0 = Instant::now();
    let res = call(s.clone(), post("/gated", Some("k"), "{}")).await;
    assert_eq!(
        res.status(),
        409,
        "a hung poll ends the wait, not the request"
    );
    assert!(t0.elapsed() <= Duration::from_secs(3), "{:?}", t0.elapsed());
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
    assert_eq!(app.calls(), 1);
}

// 2. Renewals cannot stall ----------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn one_hung_renewal_does_not_stop_the_next_and_the_live_holder_keeps_its_lease() {
    let store = FaultStore::new(MemoryStore::new());
    store.on(Op::Extend, 1, Fault::Hang);
    store.on(Op::Extend, 2, Fault::Fail);
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    let first = tokio::spawn(call(s.clone(), post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    tokio::time::sleep(LEASE * 3).await;
    let retry = call(s.clone(), post("/gated", Some("k"), "{}")).await;
    assert_eq!(
        retry.status(),
        409,
        "the holder is alive: its lease must hold"
    );
    assert_eq!(app.calls(), 1);
    assert!(
        store.calls(Op::Extend) >= 8,
        "renewals went on: {}",
        store.calls(Op::Extend)
    );

    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
    let replay = call(s.clone(), post("/gated", Some("k"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(app.calls(), 1);
}

// 3. The lease clock starts when the claim is sent ------------------------------------------

#[tokio::test(start_paused = true)]
async fn renewals_are_due_a_third_of_a_lease_after_the_claim_was_sent_not_answered() {
    let store = FaultStore::new(MemoryStore::new());
    store.on(Op::Claim, 1, Fault::ReplyLate(Duration::from_millis(400)));
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    let first = tokio::spawn(call(s.clone(), post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    tokio::time::sleep(LEASE).await;
    app.gate.notify_one();
    first.await.unwrap();
    let sent = store.started(Op::Claim)[0];
    let renewals: Vec<_> = store
        .started(Op::Extend)
        .iter()
        .map(|t| *t - sent)
        .collect();
    assert_eq!(renewals[..2], [LEASE / 3, LEASE * 2 / 3], "{renewals:?}");
}

// 4. A hung complete still answers the client ---------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_hung_complete_still_answers_the_client_by_the_end_of_the_lease() {
    let store = FaultStore::new(MemoryStore::new());
    store.on_all(Op::Complete, Fault::Hang);
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    let t0 = Instant::now();
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201);
    assert!(t0.elapsed() <= LEASE, "answered after {:?}", t0.elapsed());
    assert!(store.calls(Op::Complete) >= 2, "recording was retried");
}

#[tokio::test(start_paused = true)]
async fn a_complete_that_hangs_once_is_retried_and_then_replays() {
    let store = FaultStore::new(MemoryStore::new());
    store.on(Op::Complete, 1, Fault::Hang);
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );

    assert_eq!(
        call(s.clone(), post("/pay", Some("k"), "{}"))
            .await
            .status(),
        201
    );
    let replay = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(store.calls(Op::Complete), 2);
    assert_eq!(app.calls(), 1);
}

// 5. Released answers free the key before the client hears them ---------------------------

#[tokio::test(start_paused = true)]
async fn a_5xx_waits_at_most_the_store_deadline_for_a_failing_release_which_goes_on_in_the_background(
) {
    // Fails, hangs, or takes effect and then loses its reply.
    for fault in [Fault::Fail, Fault::Hang, Fault::ApplyThenFail] {
        let store = FaultStore::new(MemoryStore::new());
        store.on_all(Op::Release, fault);
        let app = App::default();
        let s = svc(
            IdempotencyLayer::from_arc(store.clone())
                .unscoped()
                .with_timing(timing()),
            &app,
        );

        let t0 = Instant::now();
        let res = call(s.clone(), post("/status/502", Some("k"), "{}")).await;
        assert_eq!(res.status(), 502);
        let waited = t0.elapsed();
        let expected = match fault {
            Fault::Hang => timing().store_timeout(),
            _ => Duration::ZERO,
        };
        assert_eq!(
            waited, expected,
            "{fault:?}: one release attempt, then the answer"
        );

        // The release goes on: once the store heals, the key is free again within the lease.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(store.calls(Op::Release) >= 2, "{fault:?}: release retried");
        store.heal();
        tokio::time::sleep(Duration::from_millis(600)).await;
        let res = call(s.clone(), post("/status/502", Some("k"), "{}")).await;
        assert_eq!(res.status(), 502);
        assert_eq!(app.calls(), 2, "{fault:?}: released, so the retry ran");
        assert!(t0.elapsed() < LEASE, "{fault:?}: before the lease lapsed");
    }
}

#[tokio::test(start_paused = true)]
async fn an_inner_error_and_a_panic_wait_at_most_the_store_deadline_for_a_hung_release() {
    let store = FaultStore::new(MemoryStore::new());
    store.on_all(Op::Release, Fault::Hang);
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing());
    let failing = layer.layer(service_fn(
        |req: Request<RequestBody<Full<Bytes>>>| async move {
            if req.uri().path() == "/panic" {
                panic!("handler bug");
            }
            Err::<Response<Body>, _>(std::io::Error::other("inner failure"))
        },
    ));

    let t0 = Instant::now();
    let err = failing
        .clone()
        .oneshot(post("/err", Some("a"), "{}"))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "inner failure");
    assert_eq!(t0.elapsed(), timing().store_timeout());
    let t1 = Instant::now();
    let panicked = tokio::spawn(failing.oneshot(post("/panic", Some("b"), "{}"))).await;
    assert!(panicked.unwrap_err().is_panic());
    assert_eq!(t1.elapsed(), timing().store_timeout());
}

/// Answers 400 to a body that says `bad`, 503 to one that says `busy`, 201 otherwise.
fn validating(store: Arc<FaultStore>, calls: Arc<AtomicUsize>) -> Svc {
    let layer = IdempotencyLayer::from_arc(store)
        .unscoped()
        .with_timing(timing());
    BoxCloneService::new(
        layer.layer(service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let status = match &body[..] {
                    b"bad" => 400,
                    b"busy" if n == 1 => 503,
                    _ => 201,
                };
                let mut res = Response::new(full(format!("run {n}")));
                *res.status_mut() = StatusCode::from_u16(status).unwrap();
                Ok::<_, Infallible>(res)
            }
        })),
    )
}

#[tokio::test(start_paused = true)]
async fn a_retry_sent_at_once_after_a_released_answer_runs_again() {
    // A slow release (it takes effect 100 ms after it is sent) must not race the retry.
    for (first, retry, answered) in [("bad", "good", 400), ("busy", "busy", 503)] {
        let store = FaultStore::new(MemoryStore::new());
        store.on_all(Op::Release, Fault::Delay(Duration::from_millis(100)));
        let calls = Arc::new(AtomicUsize::new(0));
        let s = validating(store.clone(), calls.clone());
        let res = call(s.clone(), post("/pay", Some("k"), first)).await;
        assert_eq!(res.status(), answered);
        let res = call(s.clone(), post("/pay", Some("k"), retry)).await;
        assert_eq!(
            (res.status(), kind(&res)),
            (StatusCode::CREATED, None),
            "after a {answered}, the retry sent at once ran"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

// 6. No duration overflows ----------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn waiting_forever_and_keeping_forever_do_not_overflow() {
    let store = FaultStore::new(MemoryStore::new());
    let forever = Timing::new(LEASE, Duration::MAX).unwrap();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(forever)
        .with_in_progress(InProgress::wait(Duration::MAX));
    let app = App::default();
    let s = svc(layer, &app);
    let first = tokio::spawn(call(s.clone(), post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let waiting = tokio::spawn(call(s.clone(), post("/gated", Some("k"), "{}")));
    tokio::time::sleep(Duration::from_secs(1)).await;
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
    let replay = waiting.await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(app.calls(), 1);
}

// 7. gRPC answers over the response limit obey the record policy ----------------------------

#[tokio::test(start_paused = true)]
async fn large_grpc_answers_are_released_or_tombstoned_by_their_trailing_status() {
    for (path, released) in [
        ("/grpc.Test/Status14", true),
        ("/grpc.Test/Status0Release", true),
        ("/grpc.Test/Status0", false),
        ("/grpc.Test/Status6", false),
    ] {
        let store = FaultStore::new(MemoryStore::new());
        let app = App::default();
        let layer = IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_grpc(Grpc::all())
            .with_timing(timing())
            .with_max_response_body(NonZeroUsize::new(40).unwrap());
        let s = svc(layer, &app);

        let res = call(s.clone(), grpc(path, "k")).await;
        let body = res.into_body().collect().await.unwrap();
        assert_eq!(
            body.trailers().unwrap()["grpc-status"],
            path["/grpc.Test/Status".len()..].trim_end_matches("Release")
        );
        assert_eq!(
            body.to_bytes().len(),
            64,
            "{path}: the whole stream reached the client"
        );
        until(|| store.calls(Op::Release) + store.calls(Op::Complete) == 1).await;

        let retry = call(s.clone(), grpc(path, "k")).await;
        if released {
            assert_eq!(app.calls(), 2, "{path}: released, so the retry ran");
            assert_eq!(store.calls(Op::Complete), 0, "{path}");
        } else {
            assert_eq!(app.calls(), 1, "{path}: never run twice");
            assert_eq!(
                retry.headers()["grpc-status"],
                "6",
                "{path}: the tombstone's answer"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_large_grpc_answer_released_by_its_trailers_frees_the_key_before_the_client_has_them() {
    // The release takes effect 100 ms after it is sent: the trailers (and with them the end
    // of the answer) must wait for it, so a retry sent at once runs again.
    let store = FaultStore::new(MemoryStore::new());
    store.on_all(Op::Release, Fault::Delay(Duration::from_millis(100)));
    let app = App::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_grpc(Grpc::all())
        .with_timing(timing())
        .with_max_response_body(NonZeroUsize::new(40).unwrap());
    let s = svc(layer, &app);
    let res = call(s.clone(), grpc("/grpc.Test/Status14", "k")).await;
    let body = res.into_body().collect().await.unwrap();
    assert_eq!(body.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(
        store.calls(Op::Release),
        1,
        "released before the trailers went out"
    );
    let retry = call(s.clone(), grpc("/grpc.Test/Status14", "k")).await;
    let retried = retry.into_body().collect().await.unwrap();
    assert_eq!(retried.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(app.calls(), 2, "the retry sent at once ran again");
}

#[tokio::test(start_paused = true)]
async fn a_large_grpc_stream_dropped_by_the_client_is_never_run_again() {
    let store = FaultStore::new(MemoryStore::new());
    let app = App::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_grpc(Grpc::all())
        .with_timing(timing())
        .with_max_response_body(NonZeroUsize::new(40).unwrap());
    let s = svc(layer, &app);
    drop(call(s.clone(), grpc("/grpc.Test/Status14", "k")).await);
    until(|| store.calls(Op::Complete) == 1).await;
    let retry = call(s.clone(), grpc("/grpc.Test/Status14", "k")).await;
    assert_eq!(retry.headers()["grpc-status"], "6");
    assert_eq!(app.calls(), 1);
}

// 8. A custom renderer never turns gRPC errors into HTTP ones -------------------------------

#[tokio::test(start_paused = true)]
async fn a_custom_renderer_renders_http_errors_only() {
    let app = App::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_grpc(Grpc::all())
        .with_error_renderer(|e: &IdempotencyError| {
            let mut res = Response::new(Bytes::from(format!("custom: {}", e.kind().slug())));
            *res.status_mut() = e.kind().status();
            res
        });
    let s = svc(layer, &app);
    let mut missing = grpc("/grpc.Test/Status0", "k");
    missing.headers_mut().remove("idempotency-key");
    let res = call(s.clone(), missing).await;
    assert_eq!(res.status(), 200, "gRPC errors are trailers-only responses");
    assert_eq!(res.headers()["grpc-status"], "3");
    assert_eq!(kind(&res), Some(ErrorKind::KeyMissing));
    let res = call(s.clone(), post("/pay", None, "{}")).await;
    assert_eq!(res.status(), 400);
    assert_eq!(
        res.into_body().collect().await.unwrap().to_bytes(),
        "custom: key-missing"
    );
}

// 9. A panicking record policy releases the key ---------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_panicking_record_policy_releases_the_key_and_the_panic_reaches_the_caller() {
    for req in [
        || post("/pay", Some("k"), "{}"),
        || grpc("/grpc.Test/Status0", "k"),
    ] {
        let store = FaultStore::new(MemoryStore::new());
        let app = App::default();
        let layer = IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_grpc(Grpc::all())
            .with_timing(timing())
            .with_record_policy(|_: &tower_idempotency::ResponseInfo<'_>| -> bool {
                panic!("policy bug")
            });
        let s = svc(layer, &app);
        for run in 1..=2 {
            let joined = tokio::spawn(s.clone().oneshot(req())).await;
            assert!(joined.unwrap_err().is_panic());
            until(|| store.calls(Op::Release) == run).await;
            assert_eq!(app.calls(), run, "released: each attempt runs");
        }
    }
}

// 10. AlreadyRecorded stops renewals quietly -------------------------------------------------

/// Collects the text of every ERROR event.
#[derive(Clone, Default)]
struct Errors(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            struct Msg(String);
            impl tracing::field::Visit for Msg {
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    self.0 += &format!("{}={v:?} ", f.name());
                }
            }
            let mut m = Msg(String::new());
            event.record(&mut m);
            self.0.lock().unwrap().push(m.0);
        }
    }
}

fn capture_errors() -> (Errors, tracing::subscriber::DefaultGuard) {
    use tracing_subscriber::layer::SubscriberExt;
    let errors = Errors::default();
    let guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(errors.clone()));
    (errors, guard)
}

/// A handler that completes its own record (as `complete_in` does inside a transaction),
/// then outlives a renewal before answering; `/lie` only claims to have, and `/unmarked`
/// does not say so.
fn self_recording(store: Arc<FaultStore>) -> Svc {
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing());
    BoxCloneService::new(
        layer.layer(service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let store = store.clone();
            async move {
                let ctx = req
                    .extensions()
                    .get::<IdempotencyContext>()
                    .cloned()
                    .unwrap();
                let stored = StoredResponse::new(
                    StatusCode::CREATED,
                    HeaderMap::new(),
                    Bytes::from_static(b"done"),
                    None,
                );
                if req.uri().path() != "/lie" {
                    store
                        .complete(
                            &ctx.record_id(),
                            &ctx.token(),
                            &Completion::Response(stored),
                            Duration::from_secs(60),
                        )
                        .await
                        .unwrap();
                }
                tokio::time::sleep(LEASE / 2).await;
                let mut res = Response::new(full("done"));
                *res.status_mut() = StatusCode::CREATED;
                res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
                Ok::<_, Infallible>(res)
            }
        })),
    )
}

#[tokio::test(start_paused = true)]
async fn already_recorded_stops_renewals_quietly() {
    let (errors, _guard) = capture_errors();
    let store = FaultStore::new(MemoryStore::new());
    let s = self_recording(store.clone());
    assert_eq!(
        call(s.clone(), post("/pay", Some("k"), "{}"))
            .await
            .status(),
        201
    );
    assert_eq!(
        store.calls(Op::Extend),
        1,
        "one renewal landed after the handler's record"
    );
    let replay = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(*errors.0.lock().unwrap(), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn already_recorded_without_a_record_is_logged_as_an_error() {
    let (errors, _guard) = capture_errors();
    let store = FaultStore::new(MemoryStore::new());
    let s = self_recording(store.clone());
    assert_eq!(
        call(s.clone(), post("/lie", Some("k"), "{}"))
            .await
            .status(),
        201
    );
    until(|| store.calls(Op::Get) == 1).await;
    tokio::task::yield_now().await;
    let errors = errors.0.lock().unwrap();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("AlreadyRecorded") && e.contains("not completed")),
        "{errors:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_self_recorded_answer_without_the_marker_is_not_reported_as_a_takeover() {
    let (errors, _guard) = capture_errors();
    let store = FaultStore::new(MemoryStore::new());
    let s = self_recording(store.clone());
    assert_eq!(
        call(s.clone(), post("/unmarked", Some("k"), "{}"))
            .await
            .status(),
        201
    );
    let replay = call(s.clone(), post("/unmarked", Some("k"), "{}")).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let errors = errors.0.lock().unwrap();
    assert!(
        !errors.iter().any(|e| e.contains("took over")),
        "{errors:?}"
    );
}

// 11. Cache-Control: no-store records by default ---------------------------------------------

#[tokio::test(start_paused = true)]
async fn no_store_answers_are_recorded_unless_a_record_policy_releases_them() {
    // Releasing `no-store` answers is a record policy's choice, not a layer switch.
    let no_store = |r: &tower_idempotency::ResponseInfo<'_>| {
        r.headers()
            .get("cache-control")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"no-store"))
    };
    for (release_no_store, runs) in [(false, 1), (true, 2)] {
        let mut layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
        if release_no_store {
            layer = layer.with_record_policy(move |r: &tower_idempotency::ResponseInfo<'_>| {
                !no_store(r) && DefaultRecordPolicy.should_record(r)
            });
        }
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let s = layer.layer(service_fn(
            move |_req: Request<RequestBody<Full<Bytes>>>| {
                c.fetch_add(1, Ordering::SeqCst);
                async {
                    let mut res = Response::new(full("charged"));
                    *res.status_mut() = StatusCode::CREATED;
                    res.headers_mut()
                        .insert("cache-control", HeaderValue::from_static("no-store"));
                    Ok::<_, Infallible>(res)
                }
            },
        ));
        for _ in 0..2 {
            let res = s
                .clone()
                .oneshot(post("/pay", Some("k"), "{}"))
                .await
                .unwrap();
            assert_eq!(res.status(), 201);
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            runs,
            "policy releases no-store: {release_no_store}"
        );
    }
}

#[test]
fn a_store_timeout_at_or_above_a_third_of_the_lease_is_refused() {
    assert!(timing().with_store_timeout(LEASE / 3).is_err());
    assert!(timing()
        .with_store_timeout(LEASE / 3 - Duration::from_millis(1))
        .is_ok());
}

// 12. A gRPC content type never moves an HTTP route out of protection -----------------------

#[tokio::test]
async fn a_grpc_content_type_on_an_http_route_keeps_the_http_rules() {
    let store = FaultStore::new(MemoryStore::new());
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_grpc(Grpc::methods(["/shop.v1.Payments/"]).unwrap()),
        &app,
    );
    let claiming_grpc = |key: Option<&str>| {
        let mut req = post("/v1/orders", key, "{}");
        req.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/grpc"));
        req
    };
    assert_eq!(
        call(s.clone(), claiming_grpc(Some("k"))).await.status(),
        201
    );
    let res = call(s.clone(), claiming_grpc(Some("k"))).await;
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    assert_eq!(
        app.calls(),
        1,
        "the handler ran once for two requests with one key"
    );
    let res = call(s.clone(), claiming_grpc(None)).await;
    assert_eq!(res.status(), 400);
    assert_eq!(kind(&res), Some(ErrorKind::KeyMissing));
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert_eq!(app.calls(), 1);
    // A listed gRPC method is still gRPC.
    let res = call(s.clone(), grpc("/shop.v1.Payments/Create", "g")).await;
    assert_eq!(res.status(), 201);
}

// 13. What a fenced holder logs is what happened ---------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_complete_fenced_after_an_operator_release_and_a_new_first_claim_is_logged_as_fenced() {
    let (errors, _guard) = capture_errors();
    let store = FaultStore::new(MemoryStore::new());
    let app = App::default();
    let s = svc(
        IdempotencyLayer::from_arc(store.clone())
            .unscoped()
            .with_timing(timing()),
        &app,
    );
    let first = tokio::spawn(call(s.clone(), post("/gated", Some("k"), "{}")));
    app.started.notified().await;
    let id = tower_idempotency::store::RecordId::new(None, "k");
    let removed = tower_idempotency::store::IdempotencyAdmin::force_release(&store.inner, &id)
        .await
        .unwrap();
    assert_eq!(removed, tower_idempotency::store::Removal::Removed);
    // A new first attempt (generation 1 again, another nonce) completes the key.
    assert_eq!(
        call(s.clone(), post("/pay", Some("k"), "{}"))
            .await
            .status(),
        201
    );
    app.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 201);
    let errors = errors.0.lock().unwrap();
    assert!(
        errors.iter().any(|e| e.contains("record fenced")),
        "the old holder's complete is reported as fenced: {errors:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_holder_paused_past_its_lease_logs_that_it_was_fenced_not_that_retries_get_409() {
    let (errors, _guard) = capture_errors();
    let store = FaultStore::new(MemoryStore::new());
    // Renewals never land, so the first holder's lease lapses while it is stalled.
    store.on_all(Op::Extend, Fault::Hang);
    let (gate, started) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing());
    let s: Svc = BoxCloneService::new(layer.layer(service_fn({
        let (gate, started, calls) = (gate.clone(), started.clone(), calls.clone());
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            let (gate, started, calls) = (gate.clone(), started.clone(), calls.clone());
            async move {
                let mut res = Response::new(full("ok"));
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    started.notify_one();
                    gate.notified().await;
                    *res.status_mut() = StatusCode::BAD_GATEWAY;
                } else {
                    *res.status_mut() = StatusCode::CREATED;
                }
                Ok::<_, Infallible>(res)
            }
        }
    })));
    let first = tokio::spawn(call(s.clone(), post("/pay", Some("k"), "{}")));
    started.notified().await;
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(res.status(), 201, "a takeover after the lease lapsed");
    gate.notify_one();
    assert_eq!(first.await.unwrap().status(), 502);
    let res = call(s.clone(), post("/pay", Some("k"), "{}")).await;
    assert_eq!(
        res.headers()["idempotent-replayed"],
        "true",
        "retries get replays"
    );
    let errors = errors.0.lock().unwrap();
    assert!(
        errors.iter().any(|e| e.contains("release fenced")),
        "the stale release reached the store and was fenced: {errors:?}"
    );
    assert!(!errors.iter().any(|e| e.contains("409")), "{errors:?}");
}
