//! The Postgres store's `*_in` methods through each driver a handler may hold: a plain
//! tokio-postgres `Client` (in a `BEGIN` … `COMMIT`) and `Transaction`, deadpool's `Client`
//! and `Transaction`, and with the `sqlx` feature sqlx's `Transaction` and `PgConnection`.
//!
//! For each: a recovery point saved in a transaction commits or rolls back with the business
//! row written beside it; a stale holder's save after a takeover is fenced and its
//! transaction rolls back; a point over a cap is refused before anything is sent; and a
//! handler that records its answer (`Bytes`, `String` or `Full<Bytes>` body) in its
//! transaction is replayed to the retry, and still is when the handler forgets to mark its
//! response `AlreadyRecorded`.
//!
//! Needs `IDEMPOTENCY_TEST_POSTGRES_URL`; skipped with a printed reason when unset, unless
//! `IDEMPOTENCY_REQUIRE_BACKENDS=1`. Each test works in a schema of its own and drops it.
use crate::support::pg as pg_support;
use crate::support::{body_bytes, post};

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use pg_support::{admin, pool, store_in, TestSchema};
use tokio::sync::{mpsc, oneshot};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::postgres::deadpool_postgres::Pool;
use tower_idempotency::store::postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::postgres::{Executor, PostgresStore};
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, Completion, IdempotencyStore, Record, RecordId, RecordState,
    StoreError, StoreErrorKind, Token,
};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, RecordDecision, RecoveryPoint, RequestBody, ResponseBody,
    Timing,
};

const APP: &str = "tidem-txdrivers";
/// Short, so a takeover needs one short wait; a held request is never polled, so its lease
/// is not renewed.
const LEASE: Duration = Duration::from_millis(1500);
/// Past a lapsed lease, with room for the database clock's granularity.
const LAPSE: Duration = Duration::from_millis(1900);

/// Every type `Executor` is implemented for, checked at compile time.
#[allow(dead_code)]
fn every_driver_is_an_executor() {
    fn executor<E: Executor>() {}
    executor::<&tokio_postgres::Client>();
    executor::<&tokio_postgres::Transaction<'_>>();
    executor::<&tower_idempotency::store::postgres::deadpool_postgres::Client>();
    executor::<&tower_idempotency::store::postgres::deadpool_postgres::Transaction<'_>>();
    #[cfg(feature = "sqlx")]
    {
        executor::<&mut sqlx::PgConnection>();
        executor::<&mut sqlx::Transaction<'_, sqlx::Postgres>>();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    /// `&tokio_postgres::Client`, inside `BEGIN` … `COMMIT` sent on it.
    TokioClient,
    /// `&tokio_postgres::Transaction`.
    TokioTransaction,
    /// `&deadpool_postgres::Client`, inside `BEGIN` … `COMMIT`.
    DeadpoolClient,
    /// `&deadpool_postgres::Transaction`.
    DeadpoolTransaction,
    /// `&mut sqlx::Transaction<'_, Postgres>`.
    #[cfg(feature = "sqlx")]
    SqlxTransaction,
    /// `&mut sqlx::PgConnection`: the transaction's connection (`&mut *tx`).
    #[cfg(feature = "sqlx")]
    SqlxConnection,
}

const DRIVERS: &[Driver] = &[
    Driver::TokioClient,
    Driver::TokioTransaction,
    Driver::DeadpoolClient,
    Driver::DeadpoolTransaction,
    #[cfg(feature = "sqlx")]
    Driver::SqlxTransaction,
    #[cfg(feature = "sqlx")]
    Driver::SqlxConnection,
];

impl Driver {
    fn label(self) -> &'static str {
        match self {
            Driver::TokioClient => "tokio-client",
            Driver::TokioTransaction => "tokio-tx",
            Driver::DeadpoolClient => "deadpool-client",
            Driver::DeadpoolTransaction => "deadpool-tx",
            #[cfg(feature = "sqlx")]
            Driver::SqlxTransaction => "sqlx-tx",
            #[cfg(feature = "sqlx")]
            Driver::SqlxConnection => "sqlx-conn",
        }
    }
}

/// What a phase does after its business row.
enum Action {
    Save { step: String, data: Bytes },
    RecordBytes(Response<Bytes>),
    RecordString(Response<String>),
    RecordFull(Response<Full<Bytes>>),
}

impl Action {
    fn save(step: &str, data: impl Into<Bytes>) -> Self {
        Action::Save {
            step: step.to_owned(),
            data: data.into(),
        }
    }

    async fn run<C: Executor>(
        &self,
        store: &PostgresStore,
        client: C,
        ctx: &IdempotencyContext,
    ) -> Result<(), StoreError> {
        match self {
            Action::Save { step, data } => {
                store
                    .save_recovery_point_in(client, ctx, step, data.clone())
                    .await
            }
            Action::RecordBytes(res) => store.record_in(client, ctx, res).await,
            Action::RecordString(res) => store.record_in(client, ctx, res).await,
            Action::RecordFull(res) => store.record_in(client, ctx, res).await,
        }
    }

    /// The recorded response, as the handler returns it.
    fn into_response(self) -> Response<Full<Bytes>> {
        match self {
            Action::RecordBytes(res) => res.map(Full::new),
            Action::RecordString(res) => res.map(|s| Full::new(Bytes::from(s))),
            Action::RecordFull(res) => res,
            Action::Save { .. } => unreachable!("not a response"),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Commit {
    /// Commit when the action succeeded, else roll back (what a handler does).
    IfOk,
    /// Roll back whatever the action answered.
    Never,
    /// Commit whatever the action answered: the transaction must still be usable.
    Always,
}

impl Commit {
    fn commits(self, ok: bool) -> bool {
        match self {
            Commit::IfOk => ok,
            Commit::Never => false,
            Commit::Always => true,
        }
    }
}

/// The databases of one test: a schema with the store's table and `orders`, the store, and
/// a business pool per driver (never the store's).
struct Db {
    url: String,
    schema: Option<TestSchema>,
    store: Arc<PostgresStore>,
    orders: String,
    deadpool: Pool,
    #[cfg(feature = "sqlx")]
    sqlx: sqlx::PgPool,
}

impl Db {
    async fn new(url: &str, label: &str) -> Self {
        let schema = TestSchema::create(url, label).await;
        let store = Arc::new(store_in(url, &schema, 4, APP).await);
        let orders = format!("{}.orders", schema.name);
        admin(url)
            .await
            .batch_execute(&format!("CREATE TABLE {orders} (id text PRIMARY KEY)"))
            .await
            .unwrap();
        Self {
            url: url.to_owned(),
            schema: Some(schema),
            store,
            orders,
            deadpool: pool(url, 2, APP),
            #[cfg(feature = "sqlx")]
            sqlx: sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(url)
                .await
                .unwrap(),
        }
    }

    async fn tokio_client(&self) -> tokio_postgres::Client {
        let (client, conn) = pg_support::config(&self.url).connect(NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    async fn has_order(&self, id: &str) -> bool {
        admin(&self.url)
            .await
            .query_one(
                &format!("SELECT EXISTS (SELECT FROM {} WHERE id = $1)", self.orders),
                &[&id],
            )
            .await
            .unwrap()
            .get(0)
    }

    async fn point(&self, ctx: &IdempotencyContext) -> Option<RecoveryPoint> {
        let record = self.store.get(&ctx.record_id()).await.unwrap().unwrap();
        record.recovery_point
    }

    /// One transaction through `driver`: insert the order `order`, run `action`, then commit
    /// or roll back as `commit` says. Answers what the action answered.
    async fn phase(
        &self,
        driver: Driver,
        ctx: &IdempotencyContext,
        order: &str,
        action: &Action,
        commit: Commit,
    ) -> Result<(), StoreError> {
        let insert = format!("INSERT INTO {} (id) VALUES ('{order}')", self.orders);
        let store = &*self.store;
        match driver {
            Driver::TokioClient => {
                let client = self.tokio_client().await;
                client.batch_execute("BEGIN").await.unwrap();
                client.batch_execute(&insert).await.unwrap();
                let r = action.run(store, &client, ctx).await;
                let end = if commit.commits(r.is_ok()) {
                    "COMMIT"
                } else {
                    "ROLLBACK"
                };
                client.batch_execute(end).await.unwrap();
                r
            }
            Driver::TokioTransaction => {
                let mut client = self.tokio_client().await;
                let tx = client.transaction().await.unwrap();
                tx.batch_execute(&insert).await.unwrap();
                let r = action.run(store, &tx, ctx).await;
                if commit.commits(r.is_ok()) {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                r
            }
            Driver::DeadpoolClient => {
                let client = self.deadpool.get().await.unwrap();
                client.batch_execute("BEGIN").await.unwrap();
                client.batch_execute(&insert).await.unwrap();
                let r = action.run(store, &client, ctx).await;
                let end = if commit.commits(r.is_ok()) {
                    "COMMIT"
                } else {
                    "ROLLBACK"
                };
                client.batch_execute(end).await.unwrap();
                r
            }
            Driver::DeadpoolTransaction => {
                let mut client = self.deadpool.get().await.unwrap();
                let tx = client.transaction().await.unwrap();
                tx.batch_execute(&insert).await.unwrap();
                let r = action.run(store, &tx, ctx).await;
                if commit.commits(r.is_ok()) {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                r
            }
            #[cfg(feature = "sqlx")]
            Driver::SqlxTransaction | Driver::SqlxConnection => {
                let mut tx = self.sqlx.begin().await.unwrap();
                sqlx::query(&insert).execute(&mut *tx).await.unwrap();
                let r = if driver == Driver::SqlxTransaction {
                    action.run(store, &mut tx, ctx).await
                } else {
                    action.run(store, &mut *tx, ctx).await
                };
                if commit.commits(r.is_ok()) {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                r
            }
        }
    }

    async fn drop_now(mut self) {
        self.deadpool.close();
        #[cfg(feature = "sqlx")]
        self.sqlx.close().await;
        let schema = self.schema.take().unwrap();
        drop(self);
        schema.drop_now().await;
    }
}

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<ResponseBody<Full<Bytes>>>,
    Infallible,
>;

type Pending =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<Full<Bytes>>>, Infallible>> + Send>>;

fn layer(store: &Arc<PostgresStore>) -> IdempotencyLayer {
    let timing = Timing::new(LEASE, Duration::from_secs(120))
        .unwrap()
        .with_store_timeout(Duration::from_millis(400))
        .unwrap();
    IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing)
}

/// A claim the test holds: the handler hands its context out and waits, and its request is
/// never polled again, so the lease lapses unrenewed.
struct Held {
    ctx: IdempotencyContext,
    _request: Pending,
    _release: oneshot::Sender<()>,
}

/// A service whose handler hands out its context, then waits for its release.
fn holding(store: &Arc<PostgresStore>) -> (Svc, mpsc::UnboundedReceiver<Held0>) {
    let (tx, rx) = mpsc::unbounded_channel::<Held0>();
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let tx = tx.clone();
        async move {
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .unwrap();
            let (release, released) = oneshot::channel();
            tx.send((ctx, release)).unwrap();
            let _ = released.await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"released"))))
        }
    });
    (
        tower::util::BoxCloneService::new(layer(store).layer(inner)),
        rx,
    )
}

type Held0 = (IdempotencyContext, oneshot::Sender<()>);

async fn hold(svc: &Svc, handed: &mut mpsc::UnboundedReceiver<Held0>, key: &str) -> Held {
    let mut request: Pending = Box::pin(svc.clone().oneshot(post("/orders", Some(key), "{}")));
    tokio::select! {
        r = &mut request => panic!("{key}: answered instead of holding: {:?}", r.map(|r| r.status())),
        got = handed.recv() => {
            let (ctx, release) = got.unwrap();
            Held { ctx, _request: request, _release: release }
        }
    }
}

fn unique(label: &str) -> String {
    pg_support::unique(label)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_point_saved_in_a_transaction_commits_or_rolls_back_with_the_business_row() {
    let Some(url) = pg_support::url() else { return };
    let db = Db::new(&url, "txpoint").await;
    let (svc, mut handed) = holding(&db.store);
    for &driver in DRIVERS {
        let d = driver.label();
        let held = hold(&svc, &mut handed, &unique(d)).await;
        let ctx = &held.ctx;

        let rolled_back = format!("{d}-rolled-back");
        let action = Action::save("created", "pay_1");
        db.phase(driver, ctx, &rolled_back, &action, Commit::Never)
            .await
            .unwrap();
        assert!(!db.has_order(&rolled_back).await, "{d}");
        assert_eq!(db.point(ctx).await, None, "{d}: rolled back with the order");

        let committed = format!("{d}-committed");
        db.phase(driver, ctx, &committed, &action, Commit::IfOk)
            .await
            .unwrap();
        assert!(db.has_order(&committed).await, "{d}");
        let point = db
            .point(ctx)
            .await
            .unwrap_or_else(|| panic!("{d}: no point"));
        assert_eq!(
            (point.step(), point.data().as_ref(), point.generation()),
            ("created", &b"pay_1"[..], 1),
            "{d}"
        );

        // The next phase replaces it, with its own business row.
        let next = format!("{d}-next");
        let action = Action::save("charged", "pay_1");
        db.phase(driver, ctx, &next, &action, Commit::IfOk)
            .await
            .unwrap();
        assert!(db.has_order(&next).await, "{d}");
        assert_eq!(db.point(ctx).await.unwrap().step(), "charged", "{d}");
    }
    drop((svc, handed));
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holders_save_after_a_takeover_is_fenced_and_its_business_row_rolled_back() {
    let Some(url) = pg_support::url() else { return };
    let db = Db::new(&url, "txstale").await;
    let (svc, mut handed) = holding(&db.store);
    let keys: Vec<String> = DRIVERS.iter().map(|d| unique(d.label())).collect();
    let mut stale = Vec::new();
    for key in &keys {
        stale.push(hold(&svc, &mut handed, key).await);
    }
    tokio::time::sleep(LAPSE).await;
    let mut fresh = Vec::new();
    for key in &keys {
        fresh.push(hold(&svc, &mut handed, key).await);
    }

    for ((&driver, old), new) in DRIVERS.iter().zip(&stale).zip(&fresh) {
        let d = driver.label();
        assert_eq!(
            (old.ctx.generation(), new.ctx.generation()),
            (1, 2),
            "{d}: taken over"
        );
        let order = format!("{d}-stale");
        let action = Action::save("created", "pay_stale");
        let err = db
            .phase(driver, &old.ctx, &order, &action, Commit::IfOk)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Fenced, "{d}: {err:?}");
        assert!(!db.has_order(&order).await, "{d}: rolled back");
        assert_eq!(db.point(&new.ctx).await, None, "{d}: nothing saved");

        // The new holder's save is its own.
        let order = format!("{d}-fresh");
        let action = Action::save("created", "pay_fresh");
        db.phase(driver, &new.ctx, &order, &action, Commit::IfOk)
            .await
            .unwrap();
        assert!(db.has_order(&order).await, "{d}");
        let point = db.point(&new.ctx).await.unwrap();
        assert_eq!(
            (point.data().as_ref(), point.generation()),
            (&b"pay_fresh"[..], 2)
        );
    }
    drop((stale, fresh, svc, handed));
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_point_over_a_cap_is_too_large_and_nothing_is_sent() {
    let Some(url) = pg_support::url() else { return };
    let db = Db::new(&url, "txcap").await;
    let (svc, mut handed) = holding(&db.store);
    for &driver in DRIVERS {
        let d = driver.label();
        let held = hold(&svc, &mut handed, &unique(d)).await;
        let over = [
            (
                Action::save("s", vec![0u8; RecoveryPoint::MAX_DATA + 1]),
                "4096",
            ),
            (
                Action::save(&"s".repeat(RecoveryPoint::MAX_STEP + 1), ""),
                "64",
            ),
        ];
        for (i, (action, cap)) in over.iter().enumerate() {
            // Committed anyway: the refusal sent nothing, so the transaction is intact and
            // its order commits, without a point.
            let order = format!("{d}-{i}");
            let err = db
                .phase(driver, &held.ctx, &order, action, Commit::Always)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::TooLarge, "{d}: {err:?}");
            let why = std::error::Error::source(&err).unwrap().to_string();
            assert!(why.contains(cap), "{d}: {why}");
            assert!(
                db.has_order(&order).await,
                "{d}: the transaction was intact"
            );
            assert_eq!(db.point(&held.ctx).await, None, "{d}: nothing saved");
        }
    }
    drop((svc, handed));
    db.drop_now().await;
}

#[derive(Debug, Clone, Copy)]
enum BodyKind {
    Bytes,
    String,
    Full,
}

/// A handler that writes its order and records its answer in one transaction through
/// `driver`, with a body of `kind`, and returns that answer marked as recorded.
fn recording(db: &Arc<Db>, driver: Driver, kind: BodyKind) -> Svc {
    let db2 = db.clone();
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let db = db2.clone();
        async move {
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .unwrap();
            let order = ctx.key().unwrap().to_owned();
            let body = format!(r#"{{"order":"{order}"}}"#);
            let builder = || {
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
            };
            let action = match kind {
                BodyKind::Bytes => Action::RecordBytes(builder().body(Bytes::from(body)).unwrap()),
                BodyKind::String => Action::RecordString(builder().body(body).unwrap()),
                BodyKind::Full => {
                    Action::RecordFull(builder().body(Full::new(Bytes::from(body))).unwrap())
                }
            };
            db.phase(driver, &ctx, &order, &action, Commit::IfOk)
                .await
                .unwrap();
            let mut res = action.into_response();
            res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
            Ok::<_, Infallible>(res)
        }
    });
    tower::util::BoxCloneService::new(layer(&db.store).layer(inner))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_recorded_in_the_handlers_transaction_is_replayed_to_the_retry() {
    let Some(url) = pg_support::url() else { return };
    let db = Arc::new(Db::new(&url, "txrecord").await);
    for &driver in DRIVERS {
        for kind in [BodyKind::Bytes, BodyKind::String, BodyKind::Full] {
            let what = format!("{}/{kind:?}", driver.label());
            let svc = recording(&db, driver, kind);
            let key = unique(&format!("{}-{kind:?}", driver.label()));
            let want = format!(r#"{{"order":"{key}"}}"#);

            let first = svc
                .clone()
                .oneshot(post("/orders", Some(&key), "{}"))
                .await
                .unwrap();
            assert_eq!(first.status(), StatusCode::CREATED, "{what}");
            assert!(
                first.headers().get("idempotent-replayed").is_none(),
                "{what}"
            );
            assert_eq!(body_bytes(first).await, want, "{what}");
            assert!(db.has_order(&key).await, "{what}");

            let id = tower_idempotency::store::RecordId::new(None, &key);
            let record = db.store.get(&id).await.unwrap().unwrap();
            assert!(
                matches!(record.state, RecordState::Completed(_)),
                "{what}: {record:?}"
            );

            // The retry replays it: the handler (and its insert, which would conflict) does
            // not run again.
            let replay = svc
                .oneshot(post("/orders", Some(&key), "{}"))
                .await
                .unwrap();
            assert_eq!(replay.status(), StatusCode::CREATED, "{what}");
            assert_eq!(replay.headers()["idempotent-replayed"], "true", "{what}");
            assert_eq!(
                replay.headers()["content-type"],
                "application/json",
                "{what}"
            );
            assert_eq!(body_bytes(replay).await, want, "{what}");
        }
    }
    let db = Arc::into_inner(db).expect("every service is dropped");
    db.drop_now().await;
}

/// The store the layer calls, remembering what each of the layer's `complete` calls was
/// answered.
struct RememberingCompletes {
    inner: Arc<PostgresStore>,
    completes: std::sync::Mutex<Vec<Result<(), StoreErrorKind>>>,
}

#[async_trait::async_trait]
impl IdempotencyStore for RememberingCompletes {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.inner.claim(request).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.extend(id, token, lease).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let answer = self.inner.complete(id, token, completion, ttl).await;
        let kind = answer.as_ref().map(|_| ()).map_err(StoreError::kind);
        self.completes.lock().unwrap().push(kind);
        answer
    }
    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.inner.release(id, token).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }
}

/// A handler that forgets `RecordDecision::AlreadyRecorded`: `record_in` commits one answer,
/// then the layer sees the response unmarked and completes the record itself with its own
/// `complete`, which for a record this token completed already answers `Ok` and writes
/// nothing (guarantee 3). The first recorded answer stands, and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_recorded_in_the_transaction_but_returned_unmarked_stands_and_the_layers_complete_is_ok(
) {
    let Some(url) = pg_support::url() else { return };
    let db = Arc::new(Db::new(&url, "txunmarked").await);
    let store = Arc::new(RememberingCompletes {
        inner: db.store.clone(),
        completes: Default::default(),
    });
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (db2, runs2) = (db.clone(), runs.clone());
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let (db, runs) = (db2.clone(), runs2.clone());
        async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .unwrap();
            let order = ctx.key().unwrap().to_owned();
            let recorded = Response::builder()
                .status(StatusCode::CREATED)
                .body(Bytes::from(format!("{order}: recorded in the transaction")))
                .unwrap();
            let action = Action::RecordBytes(recorded);
            db.phase(
                Driver::DeadpoolTransaction,
                &ctx,
                &order,
                &action,
                Commit::IfOk,
            )
            .await
            .unwrap();
            // Another body than the one recorded, so the test sees which answer the record
            // keeps; and no `RecordDecision::AlreadyRecorded`.
            let returned = Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from(format!(
                    "{order}: returned unmarked"
                ))))
                .unwrap();
            Ok::<_, Infallible>(returned)
        }
    });
    let timing = Timing::new(LEASE, Duration::from_secs(120))
        .unwrap()
        .with_store_timeout(Duration::from_millis(400))
        .unwrap();
    let svc = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .with_timing(timing)
        .layer(inner);

    let key = unique("unmarked");
    let first = svc
        .clone()
        .oneshot(post("/orders", Some(&key), "{}"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    // The client of this attempt gets what the handler returned.
    assert_eq!(body_bytes(first).await, format!("{key}: returned unmarked"));
    assert!(db.has_order(&key).await);
    // The layer completed the record itself, and was answered as a resend: Ok, not fenced.
    assert_eq!(*store.completes.lock().unwrap(), [Ok(())]);

    let replay = svc
        .oneshot(post("/orders", Some(&key), "{}"))
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    // The record keeps the first answer, the one committed with the order.
    assert_eq!(
        body_bytes(replay).await,
        format!("{key}: recorded in the transaction")
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);

    drop(store);
    let db = Arc::into_inner(db).expect("every service is dropped");
    db.drop_now().await;
}

/// Alice's answer: her statement, which varies on who asks.
fn alices_statement() -> Response<Bytes> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("vary", "authorization")
        .body(Bytes::from_static(b"alice's statement"))
        .unwrap()
}

/// The outside review's scenario on Postgres: a recover function records Alice's answer
/// (`Vary: Authorization`) with `record_in` in its own transaction, through each driver, and
/// marks it `AlreadyRecorded`. The worker's context has no request headers, so `record_in`
/// refuses it (`Unguarded`) before sending anything: whether the transaction then commits
/// (its business row with it) or rolls back, the record is still in progress with its point.
/// The worker reports the recovery failed, whatever the mark says, and Bob's retry in the
/// same scope resumes the work: he never gets Alice's statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_recording_an_answer_that_varies_on_request_headers_in_its_transaction_is_refused(
) {
    use std::collections::HashMap;
    use tower_idempotency::{BoxError, RecoveryWorker};

    let Some(url) = pg_support::url() else { return };
    let db = Arc::new(Db::new(&url, "txvary").await);
    let (svc, mut handed) = holding(&db.store);
    // Per driver, Alice's request saves its point with its order, then its holder dies. Half
    // the recoveries commit their transaction after the refusal, half roll it back.
    let mut dead = Vec::new();
    let mut plan = HashMap::new();
    for (i, &driver) in DRIVERS.iter().enumerate() {
        let key = unique(driver.label());
        let held = hold(&svc, &mut handed, &key).await;
        let action = Action::save("created", key.clone());
        db.phase(
            driver,
            &held.ctx,
            &format!("{key}-created"),
            &action,
            Commit::IfOk,
        )
        .await
        .unwrap();
        let commit = if i % 2 == 0 {
            Commit::Always
        } else {
            Commit::Never
        };
        plan.insert(held.ctx.record_id(), (driver, key.clone(), commit));
        dead.push(held);
    }
    let plan = Arc::new(plan);
    let refusals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let worker = {
        let (db, plan, refusals) = (db.clone(), plan.clone(), refusals.clone());
        RecoveryWorker::new(&layer(&db.store), move |ctx: IdempotencyContext| {
            let (db, plan, refusals) = (db.clone(), plan.clone(), refusals.clone());
            async move {
                let (driver, key, commit) = plan[&ctx.record_id()].clone();
                let data = ctx.recovery_point().unwrap().data().clone();
                assert_eq!(data, key.as_bytes(), "{}", driver.label());
                let action = Action::RecordBytes(alices_statement());
                let recorded = db
                    .phase(driver, &ctx, &format!("{key}-worker"), &action, commit)
                    .await;
                refusals
                    .lock()
                    .unwrap()
                    .push((driver, recorded.map_err(|e| e.kind())));
                // Careless: the refusal is ignored, and the answer claimed as recorded.
                let mut res = action.into_response();
                res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
                Ok::<_, BoxError>(res)
            }
        })
    };
    tokio::time::sleep(LAPSE).await;
    let report = worker.run_once().await.unwrap();
    assert_eq!(
        (report.recovered, report.failed),
        (0, DRIVERS.len()),
        "{report:?}"
    );
    let mut refusals = std::mem::take(&mut *refusals.lock().unwrap());
    refusals.sort_by_key(|(d, _)| d.label());
    let mut want: Vec<_> = DRIVERS
        .iter()
        .map(|&d| (d, Err(StoreErrorKind::Unguarded)))
        .collect();
    want.sort_by_key(|(d, _)| d.label());
    assert_eq!(refusals, want);

    for (i, (&driver, held)) in DRIVERS.iter().zip(&dead).enumerate() {
        let d = driver.label();
        let key = held.ctx.key().unwrap();
        // The transaction went on after the refusal: committed or rolled back as planned.
        assert_eq!(
            db.has_order(&format!("{key}-worker")).await,
            i % 2 == 0,
            "{d}"
        );
        let record = db.store.get(&held.ctx.record_id()).await.unwrap().unwrap();
        assert!(
            matches!(record.state, RecordState::InProgress { .. }),
            "{d}: nothing recorded: {record:?}"
        );
        assert_eq!(record.generation, 2, "{d}: the worker's claim");
        let point = record.recovery_point.unwrap();
        assert_eq!(
            (point.step(), point.data().as_ref()),
            ("created", key.as_bytes()),
            "{d}"
        );
    }

    // Once the worker's claims lapse, Bob's retries take over, resume from Alice's point and
    // answer for themselves.
    tokio::time::sleep(LAPSE).await;
    let bob = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
        let ctx = req
            .extensions()
            .get::<IdempotencyContext>()
            .cloned()
            .unwrap();
        let step = ctx.recovery_point().map(|p| p.step().to_owned());
        let body = format!(
            "bob's own answer, generation {}, resumed from {step:?}",
            ctx.generation()
        );
        Ok::<_, Infallible>(
            Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from(body)))
                .unwrap(),
        )
    });
    let bob = layer(&db.store).layer(bob);
    for (&driver, held) in DRIVERS.iter().zip(&dead) {
        let d = driver.label();
        let mut retry = post("/orders", held.ctx.key(), "{}");
        retry
            .headers_mut()
            .insert(http::header::AUTHORIZATION, "Bearer bob".parse().unwrap());
        let res = bob.clone().oneshot(retry).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED, "{d}");
        assert!(res.headers().get("idempotent-replayed").is_none(), "{d}");
        assert_eq!(
            body_bytes(res).await,
            r#"bob's own answer, generation 3, resumed from Some("created")"#,
            "{d}"
        );
    }

    drop((worker, dead, svc, handed, bob));
    let db = Arc::into_inner(db).expect("every service is dropped");
    db.drop_now().await;
}
