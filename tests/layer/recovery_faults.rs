//! Recovery points and the recovery worker when store calls hang, fail, or fail after they
//! took effect (`FaultStore` over the memory store): a hung save fails the step within the
//! store deadline, a save whose reply was lost took effect all the same, and the worker comes back
//! from a hung listing, a refused takeover, a lost `complete` reply and a hung `complete`
//! without recovering anything twice.

use crate::support::{self, post, Fault, FaultStore, Op};

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Notify;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::{
    IdempotencyStore, MemoryStore, RecordId, RecordState, StoreErrorKind,
};
use tower_idempotency::{
    BoxError, IdempotencyContext, IdempotencyLayer, RecoveryReport, RecoveryWorker, RequestBody,
    Timing,
};

const LEASE: Duration = Duration::from_millis(600);
/// The store deadline: every store call the layer and the worker make ends by then.
const DEADLINE: Duration = Duration::from_millis(150);
const LAPSE: Duration = Duration::from_millis(800);

fn layer(store: Arc<FaultStore>) -> IdempotencyLayer {
    let timing = Timing::new(LEASE, Duration::from_secs(60))
        .unwrap()
        .with_store_timeout(DEADLINE)
        .unwrap();
    IdempotencyLayer::new(store).unscoped().with_timing(timing)
}

/// A handler that saves "created" and then, when `die` is set, never goes on (the test
/// forgets it: a crash). A failed save answers 503 with the error's kind.
#[derive(Clone, Default)]
struct App {
    die: Arc<std::sync::atomic::AtomicBool>,
    saved: Arc<Notify>,
    runs: Arc<AtomicUsize>,
}

impl App {
    fn service(
        &self,
        layer: &IdempotencyLayer,
    ) -> impl tower::Service<
        Request<Full<Bytes>>,
        Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone {
        let app = self.clone();
        layer
            .clone()
            .layer(service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
                let app = app.clone();
                async move {
                    app.runs.fetch_add(1, Ordering::SeqCst);
                    let ctx = req
                        .extensions()
                        .get::<IdempotencyContext>()
                        .cloned()
                        .unwrap();
                    let status = match ctx.save_recovery_point("created", "pay_1").await {
                        Ok(()) => {
                            app.saved.notify_one();
                            if app.die.load(Ordering::SeqCst) {
                                std::future::pending::<()>().await;
                            }
                            StatusCode::CREATED
                        }
                        Err(e) => {
                            let body = format!("{:?}", e.kind());
                            let mut res = Response::new(Full::new(Bytes::from(body)));
                            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                            return Ok::<_, Infallible>(res);
                        }
                    };
                    let mut res = Response::new(Full::new(Bytes::from_static(b"pay_1")));
                    *res.status_mut() = status;
                    Ok(res)
                }
            }))
    }

    /// Sends `key` and forgets the request once its point is saved: the holder died.
    #[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
    async fn die_after_saving(&self, layer: &IdempotencyLayer, key: &str) {
        self.die.store(true, Ordering::SeqCst);
        let mut fut = Box::pin(self.service(layer).oneshot(post("/pay", Some(key), "{}")));
        tokio::select! {
            r = &mut fut => panic!("answered: {:?}", r.map(|r| r.status())),
            () = self.saved.notified() => {}
        }
        std::mem::forget(fut);
        self.die.store(false, Ordering::SeqCst);
    }
}

/// A worker whose recover function answers 201 from the point and counts its calls.
fn worker(
    layer: &IdempotencyLayer,
    calls: &Arc<AtomicUsize>,
) -> RecoveryWorker<
    impl Fn(IdempotencyContext) -> std::future::Ready<Result<Response<Bytes>, BoxError>>
        + Send
        + Sync
        + 'static,
> {
    let calls = calls.clone();
    RecoveryWorker::new(layer, move |ctx| {
        calls.fetch_add(1, Ordering::SeqCst);
        let point = ctx
            .recovery_point()
            .expect("the worker runs records with a point");
        let mut res = Response::new(point.data().clone());
        *res.status_mut() = StatusCode::CREATED;
        std::future::ready(Ok(res))
    })
}

fn id(key: &str) -> RecordId {
    RecordId::new(None, key)
}

/// (recovered, failed)
fn got(r: &RecoveryReport) -> (usize, usize) {
    (r.recovered, r.failed)
}

#[tokio::test]
async fn a_save_that_hangs_fails_the_step_within_the_store_deadline() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    store.on(Op::SaveRecoveryPoint, 1, Fault::Hang);
    let sent = Instant::now();
    let res = app
        .service(&layer)
        .oneshot(post("/pay", Some("hung-save"), "{}"))
        .await
        .unwrap();
    let took = sent.elapsed();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        support::body_bytes(res).await,
        "Unknown",
        "the outcome is unknown"
    );
    assert!(took < LEASE, "bounded by the store deadline, took {took:?}");
    // The 503 released the claim: the retry runs now, from the start.
    assert!(store.inner.get(&id("hung-save")).await.unwrap().is_none());
    let res = app
        .service(&layer)
        .oneshot(post("/pay", Some("hung-save"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_save_whose_reply_was_lost_took_effect_all_the_same() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    store.on(Op::SaveRecoveryPoint, 1, Fault::ApplyThenFail);
    // The handler saw the save fail and answered 503; the layer released the claim, and
    // the release dropped the point: a first attempt starts over, nothing half-kept.
    let res = app
        .service(&layer)
        .oneshot(post("/pay", Some("lost-save"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(store.inner.get(&id("lost-save")).await.unwrap().is_none());

    // A holder that dies right after a save whose reply was lost: the point landed, and the
    // worker finds it.
    store.on(Op::SaveRecoveryPoint, 2, Fault::ApplyThenHang);
    app.die.store(true, Ordering::SeqCst);
    let fut = Box::pin(
        app.service(&layer)
            .oneshot(post("/pay", Some("lost-save-2"), "{}")),
    );
    // The save hangs after taking effect; the handler never gets past it.
    let waited = tokio::time::timeout(Duration::from_millis(50), fut).await;
    assert!(waited.is_err(), "still saving");
    let record = store.inner.get(&id("lost-save-2")).await.unwrap().unwrap();
    assert_eq!(
        record.recovery_point.as_ref().map(|p| p.step()),
        Some("created")
    );
}

#[tokio::test]
async fn the_worker_comes_back_from_a_listing_that_hangs() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let worker = worker(&layer, &calls);
    app.die_after_saving(&layer, "hung-list").await;
    tokio::time::sleep(LAPSE).await;
    store.on(Op::Recoverable, 1, Fault::Hang);
    let sent = Instant::now();
    let e = worker.run_once().await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unknown);
    assert!(sent.elapsed() < LEASE, "bounded by the store deadline");
    assert_eq!(got(&worker.run_once().await.unwrap()), (1, 0));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_refused_takeover_is_tried_again_at_the_next_sweep() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let worker = worker(&layer, &calls);
    app.die_after_saving(&layer, "refused").await;
    tokio::time::sleep(LAPSE).await;
    // Claim 1 was the request's; the worker's takeover is claim 2.
    store.on(Op::Claim, 2, Fault::Fail);
    assert_eq!(got(&worker.run_once().await.unwrap()), (0, 1));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "nothing ran without a claim"
    );
    assert_eq!(got(&worker.run_once().await.unwrap()), (1, 0));
    let record = store.inner.get(&id("refused")).await.unwrap().unwrap();
    assert_eq!(record.generation, 2, "the refused claim took nothing");
}

#[tokio::test]
async fn a_lost_complete_reply_is_resent_and_the_record_recovered_once() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let worker = worker(&layer, &calls);
    app.die_after_saving(&layer, "lost-complete").await;
    tokio::time::sleep(LAPSE).await;
    store.on(Op::Complete, 1, Fault::ApplyThenFail);
    assert_eq!(got(&worker.run_once().await.unwrap()), (1, 0));
    assert_eq!(store.calls(Op::Complete), 2, "sent once more");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(got(&worker.run_once().await.unwrap()), (0, 0));
    let res = app
        .service(&layer)
        .oneshot(post("/pay", Some("lost-complete"), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(res.headers().get("idempotent-replayed").is_some());
}

#[tokio::test]
async fn a_complete_that_hangs_leaves_the_record_to_the_next_sweep() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let worker = worker(&layer, &calls);
    app.die_after_saving(&layer, "hung-complete").await;
    tokio::time::sleep(LAPSE).await;
    store.on(Op::Complete, 1, Fault::Hang);
    store.on(Op::Complete, 2, Fault::Hang);
    let sent = Instant::now();
    assert_eq!(got(&worker.run_once().await.unwrap()), (0, 1));
    assert!(
        sent.elapsed() < LEASE,
        "two bounded tries, took {:?}",
        sent.elapsed()
    );
    // Still in progress under the worker's lapsed claim, its point kept.
    let record = store
        .inner
        .get(&id("hung-complete"))
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    assert_eq!(record.generation, 2);
    assert!(record.recovery_point.is_some());
    tokio::time::sleep(LAPSE).await;
    assert_eq!(got(&worker.run_once().await.unwrap()), (1, 0));
    assert_eq!(calls.load(Ordering::SeqCst), 2, "run again from the point");
    let record = store
        .inner
        .get(&id("hung-complete"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.generation, 3);
    assert!(matches!(record.state, RecordState::Completed(_)));
}

#[tokio::test]
async fn a_record_left_for_an_operator_does_not_crowd_out_the_others() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let worker = worker(&layer, &calls)
        .with_max_attempts(std::num::NonZeroU64::new(2).unwrap())
        .with_batch(std::num::NonZeroUsize::new(1).unwrap());
    // "poison" dies twice (generation 2: past the worker's attempts), then "good" once; the
    // poison record lapsed first, so it is listed first.
    app.die_after_saving(&layer, "poison").await;
    tokio::time::sleep(LAPSE).await;
    app.die_after_saving(&layer, "poison").await;
    app.die_after_saving(&layer, "good").await;
    tokio::time::sleep(LAPSE).await;
    let first = worker.run_once().await.unwrap();
    assert_eq!((first.left, first.recovered), (1, 0), "{first:?}");
    // The next sweep lists past the record it left, within the same batch of one.
    let second = worker.run_once().await.unwrap();
    assert_eq!((second.left, second.recovered), (1, 1), "{second:?}");
    let good = store.inner.get(&id("good")).await.unwrap().unwrap();
    assert!(matches!(good.state, RecordState::Completed(_)));
    let poison = store.inner.get(&id("poison")).await.unwrap().unwrap();
    assert_eq!(poison.generation, 2, "never taken over by the worker");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A worker whose recover function answers `res` (built fresh per call).
fn answering(
    layer: &IdempotencyLayer,
    res: fn() -> Response<Bytes>,
) -> RecoveryWorker<
    impl Fn(IdempotencyContext) -> std::future::Ready<Result<Response<Bytes>, BoxError>>
        + Send
        + Sync
        + 'static,
> {
    RecoveryWorker::new(layer, move |_ctx| std::future::ready(Ok(res())))
}

#[tokio::test]
async fn the_workers_answer_that_varies_on_request_headers_is_not_recorded() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let worker = answering(&layer, || {
        let mut res = Response::new(Bytes::from_static(b"by tenant"));
        *res.status_mut() = StatusCode::CREATED;
        res.headers_mut()
            .insert("vary", http::HeaderValue::from_static("x-tenant"));
        res
    });
    app.die_after_saving(&layer, "varies").await;
    tokio::time::sleep(LAPSE).await;
    // It has no request to take the Vary digest from: not recorded, the point kept for the
    // client's retry, which has the headers.
    assert_eq!(got(&worker.run_once().await.unwrap()), (0, 1));
    let record = store.inner.get(&id("varies")).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    assert!(record.recovery_point.is_some());
}

#[tokio::test]
async fn the_workers_answer_over_the_size_cap_is_kept_as_a_tombstone() {
    let store = FaultStore::new(MemoryStore::new());
    let layer =
        layer(store.clone()).with_max_response_body(std::num::NonZeroUsize::new(16).unwrap());
    let app = App::default();
    let worker = answering(&layer, || {
        let mut res = Response::new(Bytes::from(vec![b'x'; 64]));
        *res.status_mut() = StatusCode::CREATED;
        res
    });
    app.die_after_saving(&layer, "too-big").await;
    tokio::time::sleep(LAPSE).await;
    assert_eq!(got(&worker.run_once().await.unwrap()), (1, 0));
    let record = store.inner.get(&id("too-big")).await.unwrap().unwrap();
    assert!(
        matches!(
            record.state,
            RecordState::Completed(tower_idempotency::store::Completion::Tombstone { status })
                if status == StatusCode::CREATED
        ),
        "{record:?}"
    );
}

#[tokio::test]
async fn the_workers_answer_is_fenced_once_someone_else_holds_the_record() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    // While the worker recovers, an operator force-releases the record and the client's
    // retry claims it anew and records its own answer.
    let worker = {
        let (store, layer2, app) = (store.clone(), layer.clone(), app.clone());
        RecoveryWorker::new(&layer, move |_ctx| {
            let (store, layer2, app) = (store.clone(), layer2.clone(), app.clone());
            async move {
                use tower_idempotency::store::IdempotencyAdmin;
                store.inner.force_release(&id("fenced")).await.unwrap();
                let res = app
                    .service(&layer2)
                    .oneshot(post("/pay", Some("fenced"), "{}"))
                    .await
                    .unwrap();
                assert_eq!(res.status(), StatusCode::CREATED);
                let mut res = Response::new(Bytes::from_static(b"from the worker"));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, BoxError>(res)
            }
        })
    };
    app.die_after_saving(&layer, "fenced").await;
    tokio::time::sleep(LAPSE).await;
    assert_eq!(got(&worker.run_once().await.unwrap()), (0, 1));
    let res = app
        .service(&layer)
        .oneshot(post("/pay", Some("fenced"), "{}"))
        .await
        .unwrap();
    assert!(res.headers().get("idempotent-replayed").is_some());
    assert_eq!(
        support::body_bytes(res).await,
        "pay_1",
        "the retry's answer, not the worker's"
    );
}

/// The ERROR events logged while it is the thread's default subscriber: each as its message
/// followed by its other fields (`name=value`).
#[derive(Clone, Default)]
struct Errors(Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Fields(String);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0.insert_str(0, &format!("{v:?}"));
                } else {
                    self.0.push_str(&format!(" {}={v:?}", f.name()));
                }
            }
        }
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            self.0.lock().unwrap().push(fields.0);
        }
    }
}

impl Errors {
    /// Captures this thread's ERROR events until the guard drops (a current-thread runtime:
    /// the worker runs on it).
    fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::layer::SubscriberExt;
        let errors = Self::default();
        let subscriber = tracing_subscriber::registry().with(errors.clone());
        (errors, tracing::subscriber::set_default(subscriber))
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Alice's answer: her statement, which varies on who asks.
fn alices_statement() -> Response<Bytes> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("vary", "authorization")
        .body(Bytes::from_static(b"alice's statement"))
        .unwrap()
}

/// `post` as `who` (an `Authorization` header), in the one scope the unscoped layer has.
fn post_as(key: &str, who: &str) -> Request<Full<Bytes>> {
    let mut req = post("/pay", Some(key), "{}");
    req.headers_mut().insert(
        http::header::AUTHORIZATION,
        http::HeaderValue::from_str(&format!("Bearer {who}")).unwrap(),
    );
    req
}

/// The outside review's scenario, through the context's own recording: the recover function
/// asks `ctx.completion` for Alice's answer, is refused (`Unguarded`), and, as a careless
/// user would, returns the answer marked `AlreadyRecorded` all the same. The worker does not
/// take that mark on trust: it fails the recovery, nothing is recorded, and Bob's retry in
/// the same scope resumes the work instead of being handed Alice's statement.
#[tokio::test]
async fn a_refused_completion_marked_already_recorded_by_the_recover_function_is_not_recorded() {
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let refused = Arc::new(std::sync::Mutex::new(Vec::new()));
    let worker = {
        let refused = refused.clone();
        RecoveryWorker::new(&layer, move |ctx: IdempotencyContext| {
            let mut res = alices_statement();
            let e = ctx
                .completion(&res)
                .expect_err("no request headers here: no Vary guard can be built");
            refused.lock().unwrap().push(e.kind());
            // Careless: the error is ignored, and the answer claimed as recorded.
            res.extensions_mut()
                .insert(tower_idempotency::RecordDecision::AlreadyRecorded);
            std::future::ready(Ok::<_, BoxError>(res))
        })
    };
    app.die_after_saving(&layer, "careless").await;
    tokio::time::sleep(LAPSE).await;

    let (errors, guard) = Errors::capture();
    let report = worker.run_once().await.unwrap();
    drop(guard);
    assert_eq!(got(&report), (0, 1), "failed, not recovered: {report:?}");
    assert_eq!(*refused.lock().unwrap(), [StoreErrorKind::Unguarded]);
    let errors = errors.all();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("varies on request headers")
                && e.contains("recorded_by_the_function=true")),
        "{errors:?}"
    );
    // Not completed: still in progress under the worker's claim, the point kept.
    let record = store.inner.get(&id("careless")).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
    assert_eq!(record.generation, 2);
    assert_eq!(
        record.recovery_point.as_ref().map(|p| p.step()),
        Some("created")
    );

    // Once the worker's claim lapses, Bob's retry takes over and runs: his own answer, never
    // Alice's statement.
    tokio::time::sleep(LAPSE).await;
    let res = app
        .service(&layer)
        .oneshot(post_as("careless", "bob"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(res.headers().get("idempotent-replayed").is_none());
    assert_eq!(support::body_bytes(res).await, "pay_1");
    assert_eq!(
        app.runs.load(Ordering::SeqCst),
        2,
        "the dead attempt, then Bob's"
    );
    let record = store.inner.get(&id("careless")).await.unwrap().unwrap();
    assert_eq!(record.generation, 3);
    assert!(matches!(record.state, RecordState::Completed(_)));
}

/// The low-level way round the guard: the recover function builds the completion by hand
/// (`StoredResponse::new`, which builds no guard) and stores it with the store's own
/// `complete` under its claim, then marks its answer `AlreadyRecorded`. The worker refuses
/// the answer (it fails the recovery, and logs an ERROR naming it), but the record is
/// stored by then and the worker cannot undo it: Bob's retry is replayed Alice's statement.
/// This pins what happens; the store API is the caller's responsibility past this point.
#[tokio::test]
async fn an_unguarded_answer_the_recover_function_stored_itself_fails_the_recovery_but_stays_stored(
) {
    use tower_idempotency::store::{Completion, StoredResponse};
    let store = FaultStore::new(MemoryStore::new());
    let layer = layer(store.clone());
    let app = App::default();
    let worker = {
        let store = store.clone();
        RecoveryWorker::new(&layer, move |ctx: IdempotencyContext| {
            let store = store.clone();
            async move {
                let mut res = alices_statement();
                let hand_built = Completion::Response(StoredResponse::new(
                    res.status(),
                    res.headers().clone(),
                    res.body().clone(),
                    None,
                ));
                store
                    .complete(&ctx.record_id(), &ctx.token(), &hand_built, ctx.ttl())
                    .await?;
                res.extensions_mut()
                    .insert(tower_idempotency::RecordDecision::AlreadyRecorded);
                Ok::<_, BoxError>(res)
            }
        })
    };
    app.die_after_saving(&layer, "hand-built").await;
    tokio::time::sleep(LAPSE).await;

    let (errors, guard) = Errors::capture();
    let report = worker.run_once().await.unwrap();
    drop(guard);
    assert_eq!(got(&report), (0, 1), "failed, not recovered: {report:?}");
    let errors = errors.all();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("varies on request headers")
                && e.contains("recorded_by_the_function=true")),
        "{errors:?}"
    );
    // The store took the function's `complete`: completed by the worker's claim, without a
    // guard, and the worker leaves it so.
    let record = store.inner.get(&id("hand-built")).await.unwrap().unwrap();
    assert_eq!(record.generation, 2);
    let RecordState::Completed(Completion::Response(stored)) = &record.state else {
        panic!("completed by the recover function: {record:?}")
    };
    assert_eq!(stored.body, "alice's statement");
    assert_eq!(
        store.calls(Op::Complete),
        1,
        "the worker wrote nothing more"
    );

    let res = app
        .service(&layer)
        .oneshot(post_as("hand-built", "bob"))
        .await
        .unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    assert_eq!(support::body_bytes(res).await, "alice's statement");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "never run again");
}
