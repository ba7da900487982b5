//! An operation's effect and its answer in one Postgres transaction
//! (`PostgresStore::record_output_in`), through each driver a worker may hold: a
//! tokio-postgres `Transaction`, a deadpool `Client` (in a `BEGIN` … `COMMIT`) and, with the
//! `sqlx` feature, an sqlx `Transaction`.
//!
//! For each: the effect's row and the answer commit together, once, and a retry replays the
//! answer without a second row; rolled back, neither is kept and the next call runs. And an
//! attempt that lost its lease to a takeover has its answer fenced, so its row rolls back
//! with it and only the takeover's effect stays.
//!
//! Needs `IDEMPOTENCY_TEST_POSTGRES_URL`; skipped with a printed reason when unset, unless
//! `IDEMPOTENCY_REQUIRE_BACKENDS=1`. Each test works in a schema of its own and drops it.

use crate::operations::{
    kept_answer, ops, ops_with, record, short_lease, unique, StuckRenewals, LAPSE, ORDER, SCOPE,
};
use crate::support::pg as pg_support;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use pg_support::{admin, pool, store_in, TestSchema};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use tower_idempotency::operation::{Json, OnceError};
use tower_idempotency::store::postgres::deadpool_postgres::Pool;
use tower_idempotency::store::postgres::tokio_postgres::NoTls;
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::{RecordState, StoreError, StoreErrorKind};
use tower_idempotency::{BoxError, IdempotencyContext};

const APP: &str = "tidem-ops-record";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    /// `&tokio_postgres::Transaction`.
    TokioTransaction,
    /// `&deadpool_postgres::Client`, inside `BEGIN` … `COMMIT` sent on it.
    DeadpoolClient,
    /// `&mut sqlx::Transaction<'_, Postgres>`.
    #[cfg(feature = "sqlx")]
    SqlxTransaction,
}

const DRIVERS: &[Driver] = &[
    Driver::TokioTransaction,
    Driver::DeadpoolClient,
    #[cfg(feature = "sqlx")]
    Driver::SqlxTransaction,
];

impl Driver {
    fn label(self) -> &'static str {
        match self {
            Driver::TokioTransaction => "tokio-tx",
            Driver::DeadpoolClient => "deadpool-client",
            #[cfg(feature = "sqlx")]
            Driver::SqlxTransaction => "sqlx-tx",
        }
    }
}

/// How the work's transaction ends once its answer is recorded in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Commit,
    /// Rolls back and fails, as work that found a reason not to go on after writing.
    RollBack,
}

/// The operation's answer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
struct Shipment {
    key: String,
    generation: u64,
    driver: String,
}

/// One test's database: a schema with the store's table and `shipments` (the effect, one row
/// per attempt that committed), the store, and a business pool per driver (never the store's).
struct Db {
    url: String,
    schema: Option<TestSchema>,
    store: Arc<PostgresStore>,
    shipments: String,
    deadpool: Pool,
    #[cfg(feature = "sqlx")]
    sqlx: sqlx::PgPool,
}

impl Db {
    async fn new(url: &str, label: &str) -> Self {
        let schema = TestSchema::create(url, label).await;
        let store = Arc::new(store_in(url, &schema, 4, APP).await);
        let shipments = format!("{}.shipments", schema.name);
        admin(url)
            .await
            .batch_execute(&format!(
                "CREATE TABLE {shipments} (key text NOT NULL, generation bigint NOT NULL)"
            ))
            .await
            .unwrap();
        Self {
            url: url.to_owned(),
            schema: Some(schema),
            store,
            shipments,
            deadpool: pool(url, 2, APP),
            #[cfg(feature = "sqlx")]
            sqlx: sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(url)
                .await
                .unwrap(),
        }
    }

    /// The generations of the attempts whose shipment of `key` committed.
    async fn shipped(&self, key: &str) -> Vec<i64> {
        admin(&self.url)
            .await
            .query(
                &format!("SELECT generation FROM {} WHERE key = $1", self.shipments),
                &[&key],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect()
    }

    /// The work: one transaction through `driver` that ships `key` (its row), records the
    /// answer in it, and ends as `end` says. A refused record rolls back and fails.
    async fn ship(
        &self,
        driver: Driver,
        ctx: &IdempotencyContext,
        key: &str,
        end: End,
    ) -> Result<Shipment, BoxError> {
        let shipment = Shipment {
            key: key.to_owned(),
            generation: ctx.generation(),
            driver: driver.label().to_owned(),
        };
        let insert = format!(
            "INSERT INTO {} (key, generation) VALUES ($1, $2)",
            self.shipments
        );
        let generation = i64::try_from(ctx.generation()).unwrap();
        let (store, commit) = (&*self.store, end == End::Commit);
        let recorded = match driver {
            Driver::TokioTransaction => {
                let (mut client, conn) = pg_support::config(&self.url).connect(NoTls).await?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                let tx = client.transaction().await?;
                tx.execute(&insert, &[&key, &generation]).await?;
                let recorded = store.record_output_in(&tx, ctx, &Json, &shipment).await;
                if recorded.is_ok() && commit {
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
                recorded
            }
            Driver::DeadpoolClient => {
                let client = self.deadpool.get().await?;
                client.batch_execute("BEGIN").await?;
                client.execute(&insert, &[&key, &generation]).await?;
                let recorded = store.record_output_in(&client, ctx, &Json, &shipment).await;
                let last = if recorded.is_ok() && commit {
                    "COMMIT"
                } else {
                    "ROLLBACK"
                };
                client.batch_execute(last).await?;
                recorded
            }
            #[cfg(feature = "sqlx")]
            Driver::SqlxTransaction => {
                let mut tx = self.sqlx.begin().await?;
                sqlx::query(&insert)
                    .bind(key)
                    .bind(generation)
                    .execute(&mut *tx)
                    .await?;
                let recorded = store.record_output_in(&mut tx, ctx, &Json, &shipment).await;
                if recorded.is_ok() && commit {
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
                recorded
            }
        };
        recorded?;
        match end {
            End::Commit => Ok(shipment),
            End::RollBack => Err("rolled back after recording".into()),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_and_its_answer_commit_together_once() {
    let Some(url) = pg_support::url() else { return };
    let db = Db::new(&url, "opscommit").await;
    let ops = ops(db.store.clone());
    for &driver in DRIVERS {
        let d = driver.label();
        let key = unique(&format!("ship-{d}"));
        let runs = AtomicUsize::new(0);
        let work = |ctx: IdempotencyContext| {
            runs.fetch_add(1, SeqCst);
            let (db, key) = (&db, key.clone());
            async move { db.ship(driver, &ctx, &key, End::Commit).await }
        };
        let shipped = ops.once(SCOPE, &key, &ORDER, work).await.unwrap();
        let expected = Shipment {
            key: key.clone(),
            generation: 1,
            driver: d.to_owned(),
        };
        assert_eq!(shipped, expected, "{d}");
        assert_eq!(db.shipped(&key).await, vec![1], "{d}: one shipment");
        assert_eq!(
            kept_answer(&*db.store, &key).await,
            serde_json::to_vec(&expected).unwrap(),
            "{d}: the answer recorded in the transaction"
        );
        // A retry (a redelivered message) replays it, and ships nothing.
        let again = ops.once(SCOPE, &key, &ORDER, work).await;
        assert_eq!(again.unwrap(), expected, "{d}");
        assert_eq!(runs.load(SeqCst), 1, "{d}: ran again");
        assert_eq!(db.shipped(&key).await, vec![1], "{d}: shipped twice");
    }
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_effect_keeps_no_answer_and_the_next_call_runs() {
    let Some(url) = pg_support::url() else { return };
    let db = Db::new(&url, "opsrollback").await;
    let ops = ops(db.store.clone());
    for &driver in DRIVERS {
        let d = driver.label();
        let key = unique(&format!("rollback-{d}"));
        let runs = AtomicUsize::new(0);
        let work = |end: End| {
            let (db, key, runs) = (&db, key.clone(), &runs);
            move |ctx: IdempotencyContext| async move {
                runs.fetch_add(1, SeqCst);
                db.ship(driver, &ctx, &key, end).await
            }
        };
        let failed = ops.once(SCOPE, &key, &ORDER, work(End::RollBack)).await;
        match failed {
            Err(OnceError::Failed(e)) => assert_eq!(e.to_string(), "rolled back after recording"),
            other => panic!("{d}: {other:?}"),
        }
        assert_eq!(
            db.shipped(&key).await,
            Vec::<i64>::new(),
            "{d}: a row outlived its rollback"
        );
        assert_eq!(
            record(&*db.store, &key).await,
            None,
            "{d}: a record outlived its rollback"
        );

        let shipped = ops
            .once(SCOPE, &key, &ORDER, work(End::Commit))
            .await
            .unwrap();
        assert_eq!(shipped.generation, 1, "{d}");
        assert_eq!(runs.load(SeqCst), 2, "{d}");
        assert_eq!(db.shipped(&key).await, vec![1], "{d}");
        let again = ops.once(SCOPE, &key, &ORDER, work(End::Commit)).await;
        assert_eq!(again.unwrap(), shipped, "{d}");
        assert_eq!(runs.load(SeqCst), 2, "{d}");
    }
    db.drop_now().await;
}

/// Attempt A's renewals are cut off and it waits past its lease; B takes over and ships. A
/// then ships too: its answer is fenced in its transaction, so its row rolls back, and only
/// B's shipment and answer stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_attempts_effect_rolls_back_with_its_fenced_answer() {
    let Some(url) = pg_support::url() else { return };
    let db = Arc::new(Db::new(&url, "opsstale").await);
    let stuck = StuckRenewals::new(db.store.clone());
    let ops = ops_with(stuck.clone(), |l| l.with_timing(short_lease()));
    let key = unique("stale-ship");
    let (started, a_started) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let a = tokio::spawn({
        let (ops, db, key, gate) = (ops.clone(), db.clone(), key.clone(), gate.clone());
        async move {
            let shipping = key.clone();
            let work = |ctx: IdempotencyContext| async move {
                started.send(()).unwrap();
                gate.notified().await;
                db.ship(Driver::TokioTransaction, &ctx, &shipping, End::Commit)
                    .await
            };
            ops.once(SCOPE, &key, &ORDER, work).await
        }
    });
    let claimed = Instant::now();
    a_started.await.unwrap();
    tokio::time::sleep_until(claimed + LAPSE).await;
    assert!(stuck.refused.load(SeqCst) >= 2, "A did not try to renew");

    let b = ops
        .once(SCOPE, &key, &ORDER, |ctx| {
            let (db, key) = (db.clone(), key.clone());
            async move {
                db.ship(Driver::TokioTransaction, &ctx, &key, End::Commit)
                    .await
            }
        })
        .await
        .unwrap();
    assert_eq!(b.generation, 2, "B took over");
    gate.notify_one();
    match a.await.unwrap() {
        Err(OnceError::Failed(e)) => {
            let kind = e.downcast_ref::<StoreError>().map(StoreError::kind);
            assert_eq!(kind, Some(StoreErrorKind::Fenced), "{e}");
        }
        other => panic!("A: {other:?}"),
    }
    assert_eq!(db.shipped(&key).await, vec![2], "only B's shipment stays");
    assert_eq!(
        kept_answer(&*db.store, &key).await,
        serde_json::to_vec(&b).unwrap()
    );
    let done = record(&*db.store, &key).await.unwrap();
    assert!(matches!(done.state, RecordState::Completed(_)), "{done:?}");
    assert_eq!(done.generation, 2);
    drop(ops);
    Arc::into_inner(db)
        .expect("the only handle")
        .drop_now()
        .await;
}
