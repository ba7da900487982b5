//! Operations (`Operations::once`, `Operations::run`, `OperationLayer`) keep the layer's
//! guarantees, checked with the layer's kind of tests on memory, Redis and Postgres: a storm of
//! one key runs its work once; a crashed or dropped attempt is taken over and resumed from
//! its recovery point; a fenced zombie changes nothing; and the work (a service's `call` and
//! its future) sees its context. `operations_errors` has each typed refusal, and
//! `operations_postgres` the effect recorded in its own transaction; both use the helpers and
//! the `on_every_store!` macro here.
//!
//! Redis and Postgres read their URLs from the environment and skip with a printed reason
//! when unset, unless `IDEMPOTENCY_REQUIRE_BACKENDS=1`. Each test has its own store (its own
//! Redis key prefix, its own Postgres schema, dropped after).

use crate::support::load::run_id;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_idempotency::operation::{Identity, InvalidInput, OnceError, OperationLayer, Operations};
use tower_idempotency::store::{
    async_trait, ClaimOutcome, ClaimRequest, Completion, IdempotencyStore, Record, RecordId,
    RecordState, StoreError, StoreErrorKind, Token,
};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, InProgress, RecoveryPoint, Timing};

pub(crate) const SCOPE: &str = "orders";
/// Short, so a takeover waits one short lease; the store deadline is set below lease / 3 with
/// room for a store call on 2 loaded cores.
pub(crate) const LEASE: Duration = Duration::from_millis(1200);
const STORE_TIMEOUT: Duration = Duration::from_millis(350);
/// Past a lapsed lease, with room for clock granularity (Redis and Postgres use their own).
pub(crate) const LAPSE: Duration = Duration::from_millis(1700);
/// How long the storms' work takes: the other 63 calls arrive while it runs.
const WORK: Duration = Duration::from_millis(400);
const STORM: usize = 64;
/// What every operation here answers a duplicate in progress (and a store failure) with.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The input of most operations: an order.
#[derive(Serialize)]
pub(crate) struct Order {
    pub(crate) id: &'static str,
    pub(crate) amount: u64,
}

pub(crate) const ORDER: Order = Order {
    id: "order-1",
    amount: 1200,
};

pub(crate) fn ops(store: Arc<dyn IdempotencyStore>) -> Operations {
    IdempotencyLayer::from_arc(store).operations()
}

pub(crate) fn ops_with(
    store: Arc<dyn IdempotencyStore>,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Operations {
    configure(IdempotencyLayer::from_arc(store)).operations()
}

pub(crate) fn short_lease() -> Timing {
    Timing::new(LEASE, Duration::from_secs(60))
        .unwrap()
        .with_store_timeout(STORE_TIMEOUT)
        .unwrap()
}

pub(crate) fn unique(label: &str) -> String {
    run_id(label)
}

pub(crate) fn record_id(key: &str) -> RecordId {
    RecordId::new(Some(SCOPE), key)
}

pub(crate) async fn record(store: &dyn IdempotencyStore, key: &str) -> Option<Record> {
    store.get(&record_id(key)).await.unwrap()
}

/// The answer the record of `key` keeps, panicking unless it is completed with one.
pub(crate) async fn kept_answer(store: &dyn IdempotencyStore, key: &str) -> Bytes {
    match record(store, key).await.map(|r| r.state) {
        Some(RecordState::Completed(Completion::Response(stored))) => stored.body,
        other => panic!("{key}: no answer kept: {other:?}"),
    }
}

/// Starts `n` futures on the runtime's threads at once (a barrier), and collects their outputs.
async fn together<T, Fut>(n: usize, start: impl Fn() -> Fut) -> Vec<T>
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (barrier, fut) = (barrier.clone(), start());
            tokio::spawn(async move {
                barrier.wait().await;
                fut.await
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// Checks a storm's answers: one execution, one value for every `Ok`; the rest in progress
/// (`waited`: none, every call got the value). Returns the value.
fn one_answer<E: std::fmt::Debug>(
    results: &[Result<String, OnceError<E>>],
    runs: usize,
    waited: bool,
) -> String {
    assert_eq!(runs, 1, "executions; answers {results:?}");
    let oks: Vec<&String> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let value = oks.first().expect("no call got the answer").to_string();
    assert!(oks.iter().all(|v| **v == value), "two answers: {oks:?}");
    let mut in_progress = 0;
    for r in results {
        match r {
            Ok(_) => {}
            Err(OnceError::InProgress { retry_after }) if !waited => {
                assert_eq!(*retry_after, RETRY_AFTER);
                in_progress += 1;
            }
            Err(e) => panic!("unexpected {e:?} in {results:?}"),
        }
    }
    if waited {
        assert_eq!(oks.len(), results.len());
    } else {
        assert!(in_progress > 0, "no call met the work in progress");
        assert_eq!(oks.len() + in_progress, results.len());
    }
    value
}

// ---- 1. a storm of one key ----------------------------------------------------------------

/// The storm's work: counts its runs, takes `WORK`, answers a value unique to this run.
fn slow_work(
    runs: &Arc<AtomicUsize>,
) -> impl FnOnce(IdempotencyContext) -> BoxFuture<'static, Result<String, Infallible>> + Send {
    let runs = runs.clone();
    move |ctx| {
        Box::pin(async move {
            let n = runs.fetch_add(1, SeqCst) + 1;
            tokio::time::sleep(WORK).await;
            Ok(format!("pay_{n} at generation {}", ctx.generation()))
        })
    }
}

async fn once_storm(
    ops: &Operations,
    key: &str,
    runs: &Arc<AtomicUsize>,
) -> Vec<Result<String, OnceError<Infallible>>> {
    together(STORM, || {
        let (ops, key, work) = (ops.clone(), key.to_owned(), slow_work(runs));
        async move { ops.once(SCOPE, &key, &ORDER, work).await }
    })
    .await
}

async fn a_storm_of_one_key_runs_the_work_once(store: Arc<dyn IdempotencyStore>) {
    let ops = ops(store.clone());
    let key = unique("storm");
    let runs = Arc::new(AtomicUsize::new(0));
    let results = once_storm(&ops, &key, &runs).await;
    let value = one_answer(&results, runs.load(SeqCst), false);
    assert_eq!(value, "pay_1 at generation 1");
    assert_eq!(
        kept_answer(&*store, &key).await,
        serde_json::to_vec(&value).unwrap()
    );
    // Later calls replay it without running.
    let again = ops.once(SCOPE, &key, &ORDER, slow_work(&runs)).await;
    assert_eq!(again.unwrap(), value);
    assert_eq!(runs.load(SeqCst), 1);
}

async fn a_waiting_storm_gives_every_call_the_one_answer(store: Arc<dyn IdempotencyStore>) {
    let ops = ops_with(store.clone(), |l| {
        l.with_in_progress(InProgress::wait(Duration::from_secs(20)))
    });
    let key = unique("storm-wait");
    let runs = Arc::new(AtomicUsize::new(0));
    let results = once_storm(&ops, &key, &runs).await;
    let value = one_answer(&results, runs.load(SeqCst), true);
    assert_eq!(
        kept_answer(&*store, &key).await,
        serde_json::to_vec(&value).unwrap()
    );
}

/// A message of a queue: its id is the key; the whole message is the input.
#[derive(Serialize, Clone, Debug)]
pub(crate) struct Message {
    pub(crate) id: Option<String>,
    pub(crate) body: String,
}

pub(crate) fn message(id: &str) -> Message {
    Message {
        id: Some(id.to_owned()),
        body: "ship order-1".to_owned(),
    }
}

pub(crate) fn identify(m: &Message) -> Result<Identity, InvalidInput> {
    let id = m.id.as_deref().ok_or(InvalidInput::KeyMissing)?;
    Ok(Identity::json(id, m)?.in_scope(SCOPE))
}

async fn a_storm_through_the_operation_layer_runs_the_service_once(
    store: Arc<dyn IdempotencyStore>,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let inner = service_fn({
        let runs = runs.clone();
        move |m: Message| {
            let runs = runs.clone();
            async move {
                let n = runs.fetch_add(1, SeqCst) + 1;
                tokio::time::sleep(WORK).await;
                Ok::<_, Infallible>(format!("shipped {} as run {n}", m.id.unwrap()))
            }
        }
    });
    let svc = OperationLayer::new(ops(store.clone()), identify).layer(inner);
    let key = unique("storm-layer");
    let results = together(STORM, || svc.clone().oneshot(message(&key))).await;
    let value = one_answer(&results, runs.load(SeqCst), false);
    assert_eq!(value, format!("shipped {key} as run 1"));
    assert_eq!(
        kept_answer(&*store, &key).await,
        serde_json::to_vec(&value).unwrap()
    );
}

// ---- 2. a crashed or dropped attempt is resumed ------------------------------------------

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
struct Receipt {
    charge: String,
    generation: u64,
    resumed_from: Option<String>,
}

/// What the first takeover of a charged, then stalled attempt answers: the one charge, resumed.
fn resumed() -> Receipt {
    Receipt {
        charge: "ch_1".to_owned(),
        generation: 2,
        resumed_from: Some("charged".to_owned()),
    }
}

type Paying = Pin<Box<dyn Future<Output = Result<Receipt, OnceError<StoreError>>> + Send>>;

/// The payment: charges (unless the recovery point says it is charged) and saves "charged"
/// with the charge's id; with `stall`, then tells it and never goes on; else answers.
fn pay(
    charges: &Arc<AtomicUsize>,
    stall: Option<Arc<Notify>>,
) -> impl FnOnce(IdempotencyContext) -> BoxFuture<'static, Result<Receipt, StoreError>> + Send {
    let charges = charges.clone();
    move |ctx| {
        Box::pin(async move {
            let resumed = ctx.recovery_point().map(|p| {
                let data = String::from_utf8(p.data().to_vec()).unwrap();
                (p.step().to_owned(), data)
            });
            let charge = match &resumed {
                Some((step, charge)) if step == "charged" => charge.clone(),
                _ => {
                    let charge = format!("ch_{}", charges.fetch_add(1, SeqCst) + 1);
                    ctx.save_recovery_point("charged", charge.clone()).await?;
                    charge
                }
            };
            if let Some(stalled) = stall {
                stalled.notify_one();
                std::future::pending::<()>().await;
            }
            Ok(Receipt {
                charge,
                generation: ctx.generation(),
                resumed_from: resumed.map(|(step, _)| step),
            })
        })
    }
}

/// Starts a payment and polls it until it charged and saved its point; it is returned
/// unpolled from then on, so no renewal runs.
async fn charged_then_stalled(ops: &Operations, key: &str, charges: &Arc<AtomicUsize>) -> Paying {
    let stalled = Arc::new(Notify::new());
    let (ops, key) = (ops.clone(), key.to_owned());
    let work = pay(charges, Some(stalled.clone()));
    let mut attempt: Paying = Box::pin(async move { ops.once(SCOPE, &key, &ORDER, work).await });
    tokio::select! {
        r = &mut attempt => panic!("answered instead of stalling: {r:?}"),
        () = stalled.notified() => {}
    }
    attempt
}

#[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
fn crash(attempt: Paying) {
    std::mem::forget(attempt);
}

fn charged_point(record: &Record) -> (String, Bytes, u64) {
    let point: &RecoveryPoint = record.recovery_point.as_ref().expect("no recovery point");
    (
        point.step().to_owned(),
        point.data().clone(),
        point.generation(),
    )
}

async fn a_crashed_attempt_is_resumed_from_its_point_after_the_lease(
    store: Arc<dyn IdempotencyStore>,
) {
    let ops = ops_with(store.clone(), |l| l.with_timing(short_lease()));
    let key = unique("crash");
    let charges = Arc::new(AtomicUsize::new(0));
    let crashed = Instant::now();
    crash(charged_then_stalled(&ops, &key, &charges).await);

    // While the dead attempt's lease lives, a retry runs nothing.
    let early = ops.once(SCOPE, &key, &ORDER, pay(&charges, None)).await;
    assert!(
        matches!(early, Err(OnceError::InProgress { .. })),
        "{early:?}"
    );
    let held = record(&*store, &key).await.unwrap();
    assert!(
        matches!(held.state, RecordState::InProgress { .. }),
        "{held:?}"
    );
    assert_eq!(
        charged_point(&held),
        ("charged".to_owned(), Bytes::from("ch_1"), 1)
    );

    tokio::time::sleep_until(crashed + LAPSE).await;
    let receipt = ops
        .once(SCOPE, &key, &ORDER, pay(&charges, None))
        .await
        .unwrap();
    assert_eq!(receipt, resumed(), "the takeover resumes from the point");
    assert_eq!(charges.load(SeqCst), 1, "charged once");

    let done = record(&*store, &key).await.unwrap();
    assert!(matches!(done.state, RecordState::Completed(_)), "{done:?}");
    assert_eq!((done.generation, done.recovery_point), (2, None));
    assert_eq!(
        kept_answer(&*store, &key).await,
        serde_json::to_vec(&resumed()).unwrap()
    );
    let again = ops.once(SCOPE, &key, &ORDER, pay(&charges, None)).await;
    assert_eq!(again.unwrap(), resumed());
    assert_eq!(charges.load(SeqCst), 1);
}

async fn a_dropped_attempt_is_taken_over_at_once(store: Arc<dyn IdempotencyStore>) {
    // A lease far longer than the test: only the dropped attempt's own end of its lease
    // lets the next one in.
    const LONG: Duration = Duration::from_secs(20);
    let timing = Timing::new(LONG, Duration::from_secs(60)).unwrap();
    let ops = ops_with(store.clone(), |l| l.with_timing(timing));
    let key = unique("dropped");
    let charges = Arc::new(AtomicUsize::new(0));
    drop(charged_then_stalled(&ops, &key, &charges).await);
    let dropped = Instant::now();

    // The lease is ended on a task of its own: a retry may meet the claim for a moment.
    let receipt = loop {
        match ops.once(SCOPE, &key, &ORDER, pay(&charges, None)).await {
            Err(OnceError::InProgress { .. }) if dropped.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert!(
        dropped.elapsed() < LONG / 4,
        "waited {:?}: the lease lapsed instead of ending",
        dropped.elapsed()
    );
    assert_eq!(receipt, resumed());
    assert_eq!(charges.load(SeqCst), 1);
    let done = record(&*store, &key).await.unwrap();
    assert!(matches!(done.state, RecordState::Completed(_)), "{done:?}");
    assert_eq!(done.generation, 2);
}

/// The dropped attempt's lease is ended by `extend(…, 0)` on a task of its own. When that call
/// never returns, nothing waits on it: the task gives up at the store deadline, the lease
/// lapses on its own, and the first call after it takes over, from the saved point. Before
/// then the claim holds: the key is never free while the dropped work may still run.
async fn a_hung_lease_end_lets_the_lease_lapse(store: Arc<dyn IdempotencyStore>) {
    const LEASE: Duration = Duration::from_secs(2);
    let timing = Timing::new(LEASE, Duration::from_secs(60))
        .unwrap()
        .with_store_timeout(Duration::from_millis(200))
        .unwrap();
    let faulty = crate::support::FaultStore::new(store.clone());
    let ops = ops_with(faulty.clone(), |l| l.with_timing(timing));
    let key = unique("lease-end-hangs");
    let charges = Arc::new(AtomicUsize::new(0));
    let claimed = Instant::now();
    let attempt = charged_then_stalled(&ops, &key, &charges).await;
    // Every `extend` from here on never returns: the lease end among them.
    faulty.on_all(crate::support::Op::Extend, crate::support::Fault::Hang);
    drop(attempt);
    let receipt = loop {
        match ops.once(SCOPE, &key, &ORDER, pay(&charges, None)).await {
            Err(OnceError::InProgress { .. }) if claimed.elapsed() < LEASE * 3 => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.unwrap(),
        }
    };
    let waited = claimed.elapsed();
    assert!(
        faulty.calls(crate::support::Op::Extend) >= 1,
        "the lease end was never tried"
    );
    assert!(
        waited >= LEASE - Duration::from_millis(100),
        "taken over after {waited:?}, inside the lease: the hung lease end freed the key"
    );
    assert_eq!(receipt, resumed());
    assert_eq!(charges.load(SeqCst), 1);
}

// ---- 3. a fenced zombie -------------------------------------------------------------------

/// Refuses every renewal of a first claim (generation 1): its holder keeps working while
/// its lease lapses in the store, as when its renewals cannot reach the store.
pub(crate) struct StuckRenewals {
    inner: Arc<dyn IdempotencyStore>,
    pub(crate) refused: AtomicUsize,
}

impl StuckRenewals {
    pub(crate) fn new(inner: Arc<dyn IdempotencyStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            refused: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl IdempotencyStore for StuckRenewals {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.inner.claim(request).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        if token.generation() == 1 {
            self.refused.fetch_add(1, SeqCst);
            return Err(StoreError::with_source(
                StoreErrorKind::Unavailable,
                "renewals of the first claim are cut off",
            ));
        }
        self.inner.extend(id, token, lease).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(id, token, completion, ttl).await
    }
    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.inner.release(id, token).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }
    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        self.inner.save_recovery_point(id, token, point).await
    }
    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        self.inner.recoverable(limit).await
    }
}

async fn a_fenced_zombie_changes_nothing(store: Arc<dyn IdempotencyStore>) {
    let stuck = StuckRenewals::new(store.clone());
    let ops = ops_with(stuck.clone(), |l| l.with_timing(short_lease()));
    let key = unique("zombie");
    let (started, a_started) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let late_save = Arc::new(Mutex::new(None));
    let a = tokio::spawn({
        let (ops, key, gate, late_save) =
            (ops.clone(), key.clone(), gate.clone(), late_save.clone());
        async move {
            ops.once(SCOPE, &key, &ORDER, |ctx| async move {
                ctx.save_recovery_point("reserved", "by A").await?;
                started.send(ctx.generation()).unwrap();
                gate.notified().await;
                // Past its lease, after the takeover: this save must write nothing.
                let saved = ctx.save_recovery_point("shipped", "by A").await;
                *late_save.lock().unwrap() = Some(saved.map_err(|e| e.kind()));
                Ok::<_, StoreError>("A".to_owned())
            })
            .await
        }
    });
    let claimed = Instant::now();
    assert_eq!(a_started.await.unwrap(), 1);

    // A's lease still lives: B is refused and runs nothing.
    let b_runs = Arc::new(AtomicUsize::new(0));
    let b = |b_runs: Arc<AtomicUsize>| {
        move |ctx: IdempotencyContext| async move {
            b_runs.fetch_add(1, SeqCst);
            let point = ctx
                .recovery_point()
                .map(|p| (p.step().to_owned(), p.data().clone()));
            assert_eq!(point, Some(("reserved".to_owned(), Bytes::from("by A"))));
            assert_eq!(ctx.generation(), 2);
            Ok::<_, StoreError>("B".to_owned())
        }
    };
    let early = ops.once(SCOPE, &key, &ORDER, b(b_runs.clone())).await;
    assert!(
        matches!(early, Err(OnceError::InProgress { .. })),
        "{early:?}"
    );
    assert_eq!(b_runs.load(SeqCst), 0);

    // A works on, its renewals refused, past its lease: B takes over and completes.
    tokio::time::sleep_until(claimed + LAPSE).await;
    assert!(stuck.refused.load(SeqCst) >= 2, "A did not try to renew");
    assert_eq!(
        ops.once(SCOPE, &key, &ORDER, b(b_runs.clone()))
            .await
            .unwrap(),
        "B"
    );
    assert_eq!(b_runs.load(SeqCst), 1);

    // A wakes and answers "A": its save and its record are fenced.
    gate.notify_one();
    let a = a.await.unwrap();
    assert_eq!(
        *late_save.lock().unwrap(),
        Some(Err(StoreErrorKind::Fenced)),
        "the zombie's save after the takeover"
    );
    // Its own caller gets what its work returned; nothing of it is recorded.
    assert_eq!(a.unwrap(), "A");
    let done = record(&*store, &key).await.unwrap();
    assert_eq!((done.generation, done.recovery_point.as_ref()), (2, None));
    assert_eq!(
        kept_answer(&*store, &key).await,
        Bytes::from_static(b"\"B\"")
    );
    let again = ops.once(SCOPE, &key, &ORDER, b(b_runs.clone())).await;
    assert_eq!(again.unwrap(), "B");
    assert_eq!(b_runs.load(SeqCst), 1);
}

// ---- 10. the context of a service's call --------------------------------------------------

/// What `IdempotencyContext::current` showed, and where.
type Seen = Arc<Mutex<Vec<(&'static str, Option<(u64, RecordId, Option<String>)>)>>>;

fn seen(ctx: Option<IdempotencyContext>) -> Option<(u64, RecordId, Option<String>)> {
    ctx.map(|c| (c.generation(), c.record_id(), c.key().map(str::to_owned)))
}

/// A service that notes its context in `call`, in its future after a real suspension, and on
/// a task it spawns; saves a recovery point through it; and, while `stall` is set, stops
/// there for good.
#[derive(Clone)]
struct Probe {
    seen: Seen,
    stall: Arc<Mutex<Option<Arc<Notify>>>>,
}

impl Service<Message> for Probe {
    type Response = String;
    type Error = StoreError;
    type Future = BoxFuture<'static, Result<String, StoreError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), StoreError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, m: Message) -> Self::Future {
        self.seen
            .lock()
            .unwrap()
            .push(("call", seen(IdempotencyContext::current())));
        let (seen_by, stall) = (self.seen.clone(), self.stall.lock().unwrap().take());
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let ctx = IdempotencyContext::current();
            seen_by.lock().unwrap().push(("future", seen(ctx.clone())));
            let spawned = tokio::spawn(async { seen(IdempotencyContext::current()) });
            let spawned = spawned.await.unwrap();
            seen_by.lock().unwrap().push(("spawned", spawned));
            let Some(ctx) = ctx else {
                return Err(StoreError::with_source(StoreErrorKind::Other, "no context"));
            };
            let resumed = ctx.recovery_point().map(|p| p.step().to_owned());
            ctx.save_recovery_point("noted", m.body.clone()).await?;
            if let Some(stalled) = stall {
                stalled.notify_one();
                std::future::pending::<()>().await;
            }
            Ok(format!(
                "generation {} resumed from {resumed:?}",
                ctx.generation()
            ))
        })
    }
}

async fn the_context_is_current_in_a_services_call_and_future(store: Arc<dyn IdempotencyStore>) {
    let probe = Probe {
        seen: Arc::default(),
        stall: Arc::default(),
    };
    let svc = OperationLayer::new(ops(store.clone()), identify).layer(probe.clone());
    let key = unique("current");
    assert!(IdempotencyContext::current().is_none());
    let answer = svc.clone().oneshot(message(&key)).await.unwrap();
    assert_eq!(answer, "generation 1 resumed from None");
    assert!(
        IdempotencyContext::current().is_none(),
        "leaked to the caller"
    );
    let inside = Some((1, record_id(&key), Some(key.clone())));
    assert_eq!(
        *probe.seen.lock().unwrap(),
        vec![
            ("call", inside.clone()),
            ("future", inside),
            ("spawned", None)
        ]
    );
    // A replay does not call the service.
    assert_eq!(svc.clone().oneshot(message(&key)).await.unwrap(), answer);
    assert_eq!(probe.seen.lock().unwrap().len(), 3);
    // Called without the layer, the service has no context.
    let mut bare = probe.clone();
    let outside = bare.call(message(&key)).await;
    assert_eq!(outside.unwrap_err().kind(), StoreErrorKind::Other);
    assert_eq!(
        probe.seen.lock().unwrap()[3..],
        [("call", None), ("future", None), ("spawned", None)]
    );
}

async fn a_dropped_service_call_is_taken_over_at_once_through_the_layer(
    store: Arc<dyn IdempotencyStore>,
) {
    let timing = Timing::new(Duration::from_secs(20), Duration::from_secs(60)).unwrap();
    let stalled = Arc::new(Notify::new());
    let probe = Probe {
        seen: Arc::default(),
        stall: Arc::new(Mutex::new(Some(stalled.clone()))),
    };
    let svc = OperationLayer::new(ops_with(store.clone(), |l| l.with_timing(timing)), identify)
        .layer(probe.clone());
    let key = unique("layer-dropped");
    let mut first = svc.clone().oneshot(message(&key));
    tokio::select! {
        r = &mut first => panic!("answered instead of stalling: {r:?}"),
        () = stalled.notified() => {}
    }
    drop(first);
    let dropped = Instant::now();
    let answer = loop {
        match svc.clone().oneshot(message(&key)).await {
            Err(OnceError::InProgress { .. }) if dropped.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert!(
        dropped.elapsed() < Duration::from_secs(5),
        "the lease lapsed instead of ending"
    );
    assert_eq!(answer, "generation 2 resumed from Some(\"noted\")");
    let seen = probe.seen.lock().unwrap().clone();
    let generations: Vec<_> = seen
        .iter()
        .filter(|(at, _)| *at == "call")
        .map(|(_, s)| s.as_ref().map(|s| s.0))
        .collect();
    assert_eq!(generations, vec![Some(1), Some(2)]);
    let done = record(&*store, &key).await.unwrap();
    assert_eq!((done.generation, done.recovery_point), (2, None));
}

// ---- each scenario on each store ----------------------------------------------------------

macro_rules! on_every_store {
    ($($(#[$attr:meta])* $scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                $(#[$attr])*
                async fn $scenario() {
                    let store = tower_idempotency::store::MemoryStore::new();
                    super::$scenario(std::sync::Arc::new(store)).await;
                }
            )*
        }

        #[cfg(feature = "redis")]
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                $(#[$attr])*
                async fn $scenario() {
                    let label = concat!("ops-", stringify!($scenario));
                    let Some(store) = crate::support::load::redis_store(label).await else {
                        return;
                    };
                    super::$scenario(store).await;
                }
            )*
        }

        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                $(#[$attr])*
                async fn $scenario() {
                    let Some((store, schema)) =
                        crate::support::load::postgres_store("operations").await
                    else {
                        return;
                    };
                    super::$scenario(store).await;
                    schema.drop_now().await;
                }
            )*
        }
    };
}
pub(crate) use on_every_store;

on_every_store!(
    a_storm_of_one_key_runs_the_work_once,
    a_waiting_storm_gives_every_call_the_one_answer,
    a_storm_through_the_operation_layer_runs_the_service_once,
    a_crashed_attempt_is_resumed_from_its_point_after_the_lease,
    a_dropped_attempt_is_taken_over_at_once,
    a_hung_lease_end_lets_the_lease_lapse,
    a_fenced_zombie_changes_nothing,
    the_context_is_current_in_a_services_call_and_future,
    a_dropped_service_call_is_taken_over_at_once_through_the_layer,
);
