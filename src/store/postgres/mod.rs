//! A Postgres store: one row per record, the database clock, one statement per operation.
//!
//! Built on [`tokio_postgres`] and a [`deadpool_postgres`] pool; both crates are re-exported
//! so that your versions match ours. Create the table once with
//! [`migrate`](PostgresStore::migrate) (safe to run from every replica at start-up), or, when
//! the table is managed elsewhere, check it with [`verify`](PostgresStore::verify); then hand
//! the store to the layer. Setup fails with a [`SetupError`] whose text names the cause.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::store::postgres::PostgresStore;
//!
//! let store = PostgresStore::builder()
//!     .with_table("idempotency.records")?
//!     .connect("postgres://app@db/app")
//!     .await?;
//! store.migrate().await?;
//! let _sweeper = store.spawn_sweeper(std::time::Duration::from_secs(60));
//! # #[derive(Clone)] struct Tenant(String);
//! let layer = tower_idempotency::IdempotencyLayer::new(store)
//!     .with_scope(|req| req.extensions.get::<Tenant>().map(|t| t.0.clone()));
//! # drop(layer);
//! # Ok(()) }
//! ```
//!
//! # Schema
//!
//! [`migrate`](PostgresStore::migrate) creates this table (`idempotency_records` unless
//! [`with_table`](PostgresStoreBuilder::with_table) names another), an index on `expires_at` for
//! the sweeper, a partial index on `(scope, expires_at)` for per-scope quotas, a partial index
//! `<table>_recovery_idx` on `expires_at` of the records in progress that hold a recovery
//! point, and the PL/pgSQL functions the claims that write go through: `<table>_claim_new_v1`
//! (the insert of an absent key, without a quota) and `<table>_claim_v3` (quotas,
//! replacements, takeovers), with `<table>_claim_v2`, a wrapper over the latter for processes
//! on an earlier version. The statements are the `.sql` files of `src/store/postgres/sql/`,
//! one per operation; when the schema is managed elsewhere, apply `migrate.sql`,
//! `claim_function.sql`, `claim_function_v2.sql` and `claim_new_function.sql` (with the
//! table's name) there. The table:
//!
//! ```sql
//! CREATE TABLE idempotency_records (
//!     id             bytea       PRIMARY KEY,  -- RecordId, 32 bytes (below)
//!     fingerprint    bytea       NOT NULL,     -- 32 bytes
//!     state          smallint    NOT NULL,     -- 0 in progress, 1 response, 2 tombstone
//!     generation     bigint      NOT NULL,     -- 1 for a first claim, + 1 per takeover
//!     nonce          bytea       NOT NULL,     -- the token's random part, 16 bytes
//!     locked_until   timestamptz NOT NULL,     -- end of the holder's lease
//!     status         smallint,                 -- the recorded answer, once completed
//!     headers        bytea,
//!     body           bytea,
//!     trailers       bytea,                    -- NULL: the response had no trailers
//!     created_at     timestamptz NOT NULL,
//!     expires_at     timestamptz NOT NULL,     -- end of retention
//!     scope          bytea,                    -- ScopeId (32 bytes), only with quotas on
//!     recovery_point bytea                     -- RecoveryPoint::encode, while in progress
//! );
//! ```
//!
//! Neither the key nor the scope is stored in the clear. The `scope` column is the
//! [`ScopeId`](crate::store::ScopeId): SHA-256 over `tower-idempotency scope v1\0`, then `0x00` for
//! the unscoped space, or `0x01`, the scope's length in bytes (8 bytes, big-endian) and the
//! scope. The `id` is the [`RecordId`](crate::store::RecordId): SHA-256 over
//! `tower-idempotency record v3\0`, the scope framed in the same way, zero bytes up to the
//! next multiple of 64 bytes, the key's length (8 bytes, big-endian) and the key; its first
//! 4 bytes are then replaced by the first 4 bytes of the scope id, so every record id begins
//! with its scope's prefix, and 224 bits of the hash remain. The `recovery_point` column
//! holds the step, the data the handler saved (as it gave them), the saving claim's
//! generation and the scope id, never the scope (points an earlier version wrote kept the
//! scope; they are still read, and go with their record). The
//! [security page](crate::security#what-the-crate-stores) lists what each store keeps.
//!
//! `migrate` also sets the table's storage settings, where the table has none of its own
//! (so an operator's tuning survives restarts): `fillfactor = 80`, which leaves room on
//! each page for the completion and the lease renewals of the rows inserted there, and
//! `autovacuum_vacuum_scale_factor = 0.01`, `autovacuum_analyze_scale_factor = 0.05`,
//! `autovacuum_vacuum_cost_delay = 0`: every record is inserted, updated and deleted within
//! its TTL, so vacuum should run after 1% of the rows changed, not the default 20%.
//!
//! Headers and trailers use the compact binary layout of [`Completion::encode`] behind a
//! format byte; bodies are raw `bytea`, never base64. The store writes
//! `expires_at >= locked_until` for every in-progress row, so a live lease always outlives
//! its retention; every statement still treats a row as live while its lease is, whatever
//! `expires_at` says (see [`delete_expired`](PostgresStore::delete_expired)).
//!
//! # How the contract is met
//!
//! - **The claim is one statement and one round trip**, and it reads before it writes
//!   (claim_new.sql, or claim.sql with a per-scope quota). It first reads the row by its
//!   primary key. A completed record or a live lease (a replay, a conflict, a mismatch) is
//!   the answer, and the writing half is not called (a `CASE` calls it only when no row was
//!   read): a replay is one index lookup and writes nothing. Without a quota the writing
//!   half is `<table>_claim_new_v1` (claim_new_function.sql), a PL/pgSQL function that runs
//!   one `INSERT … ON CONFLICT (id) DO NOTHING` and returns the new generation, or nothing
//!   when a row committed since the read (then the claim function below, a second round
//!   trip, as for any lost race). With a quota it is `<table>_claim_v3`
//!   (claim_function.sql), which counts the scope first.
//!   The store tells a live row from an expired one, or from a lapsed lease of the same
//!   request, by the timestamps read with the database's clock; those two rare cases take
//!   a second statement, `<table>_claim_v3` alone (claim_call.sql). That function claims:
//!   it inserts an absent key (`INSERT … ON CONFLICT (id) DO NOTHING`); when a row is there
//!   it reads it again with a fresh snapshot and, in one statement, replaces an expired row
//!   (generation 1), takes over one in progress with a lapsed lease and the same
//!   fingerprint (the generation plus one), or returns the row it found. A new request
//!   costs two round trips (claim, then complete). The claim commits on its own before the
//!   handler runs: no transaction and no pool connection is held while the handler works.
//! - **Fencing**: `extend`, `complete` and `release` put the generation *and* the nonce in
//!   their `WHERE` clause. Zero rows is [`StoreErrorKind::Fenced`], and nothing was written.
//! - **Recovery points** (save_point.sql, recoverable.sql): a save is an `UPDATE` of the
//!   `recovery_point` column, fenced like `extend`. A takeover keeps the point and the claim
//!   returns it; `complete`, `release` and the replacement of an expired record set it to
//!   `NULL`. The partial index `<table>_recovery_idx` (`ON (expires_at) WHERE recovery_point
//!   IS NOT NULL AND state = 0`) holds only the records that saved one, so
//!   [`recoverable`](crate::store::IdempotencyStore::recoverable) reads those alone and sorts
//!   them by lease. It is keyed on `expires_at`, not the lease: an index on `locked_until`
//!   would make every lease renewal, of every record, a non-HOT update.
//! - **A key keeps its history** (release.sql): `release` deletes a first claim's row, but
//!   keeps a takeover's, its lease ended at `statement_timestamp()` and its nonce replaced by
//!   one no claim holds, so the next claim of the same request takes over with the generation
//!   plus one (the claim statements are unchanged: such a row is a lapsed lease to them).
//! - **One clock**: every time is the database's: `statement_timestamp()` (which is `now()`
//!   for the store's own single-statement transactions, and stays correct inside a long
//!   transaction for [`complete_in`](PostgresStore::complete_in)), and `clock_timestamp()`
//!   for the end of a lease, so time a statement spent waiting on a row lock does not shorten
//!   the lease it grants; the lease left is computed in SQL.
//! - **Unknown outcomes**: the nonce is generated here, not in SQL. When a statement was sent
//!   and the reply is lost (a timeout, a dropped connection), the store drops that connection
//!   and runs the statement again on a fresh one. The claim, complete and release statements
//!   also report what the row held before them, so the repeat tells "my first attempt
//!   committed" (the row carries my nonce) from "someone else's record"; a repeated extend is
//!   simply right. If that read-back fails too, the answer is [`StoreErrorKind::Unknown`],
//!   never `Claimed`. Failures before anything was sent (no connection), and lost replies to
//!   reads, are [`StoreErrorKind::Unavailable`].
//! - **One deadline per operation**: pool checkout, statements, retries and read-back
//!   together are bounded by [`with_timeout`](PostgresStoreBuilder::with_timeout) (5 s by default).
//!   A statement the store gives up on is cancelled on the server with the driver's cancel
//!   token, so no backend keeps running it. On connections from
//!   [`connect`](PostgresStore::connect), `statement_timeout` and `lock_timeout` sit below
//!   that deadline, so a statement blocked on a lock is ended by the server first: a known
//!   failure (SQLSTATE `57014` or `55P03`, rolled back), [`StoreErrorKind::Unavailable`]
//!   with no read-back needed. TCP keepalives notice a half-open connection after a failover.
//! - **Failover**: give every host in the URL with `target_session_attrs=read-write`
//!   (`postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write`): a new
//!   connection tries them in order and keeps the first that takes writes. A pooled
//!   connection that finds its server read-only (SQLSTATE `25006`: a standby, or an old
//!   primary fenced with `default_transaction_read_only`) is dropped with every connection
//!   opened before it, and the statement, which wrote nothing, is sent again on a fresh
//!   connection, within the same deadline. See `docs/operations.md` (Failover) for the
//!   lease a synchronous standby needs.
//! - **Statements are prepared once per connection** (deadpool's statement cache). Use
//!   [`RecyclingMethod::Fast`](deadpool_postgres::RecyclingMethod::Fast) (deadpool's
//!   default, and what [`connect`](PostgresStore::connect) sets): `Verified` costs one more
//!   round trip per checkout.
//! - A claim that loses a race with a concurrent insert of the same key may cost one more
//!   round trip: its statement snapshot predates the winner's commit, so it cannot return the
//!   winner's row and runs once more.
//!
//! Postgres has no capacity limit of its own here: a full disk (SQLSTATE `53100`) is
//! [`StoreErrorKind::Full`], and nothing is evicted.
//!
//! # Serializable isolation
//!
//! The store's statements are correct at any isolation level. When the role or database
//! defaults to `SERIALIZABLE` (or `REPEATABLE READ`), concurrent claims of one key fail with
//! serialization failures (`40001`) instead of waiting; the store retries `40001` and
//! deadlocks (`40P01`) up to 8 attempts with a short jittered backoff, so callers do not see
//! them. [`serialization_retries`](PostgresStore::serialization_retries) counts the retries.
//!
//! # Expiry, and why the table is not partitioned by time
//!
//! Rows past `expires_at` are absent to every operation, and a claim replaces one in the same
//! statement. They are deleted by [`delete_expired`](PostgresStore::delete_expired), in
//! batches, or by a background [`spawn_sweeper`](PostgresStore::spawn_sweeper) (opt in).
//!
//! The table is deliberately **not** partitioned by time. Uniqueness of the key is what makes
//! the claim atomic, and Postgres can only enforce a primary key that includes the partition
//! key: with partitions by day, a retry landing in the next day's partition would not
//! conflict with the first request, and would run the work twice. At high volume, instead:
//!
//! - run the sweeper often enough that each pass deletes a few batches, not millions of rows;
//! - make autovacuum keep up with the churn: `migrate` sets the settings above; lower
//!   them further (`ALTER TABLE … SET (…)`, which `migrate` then keeps) if `n_dead_tup`
//!   in `pg_stat_user_tables` keeps growing;
//! - keep `max_response_body` modest: large bodies are TOASTed and dominate the table size;
//! - hash-partition by `id` if one table grows too large to vacuum: that keeps the key unique.
//!
//! # Transactional completion
//!
//! A handler that writes to the same database can record its answer in its own transaction
//! with [`record_in`](PostgresStore::record_in) (or [`complete_in`](PostgresStore::complete_in)
//! for a [`Completion`] of your own): the business writes and the recorded answer then commit
//! together or not at all. If the transaction rolls back, the record stays in progress, and
//! once its lease lapses a retry takes it over and runs the work again. The layer puts an
//! [`IdempotencyContext`](crate::IdempotencyContext) (record id and token) into the request's
//! extensions; a response carrying
//! [`RecordDecision::AlreadyRecorded`](crate::RecordDecision::AlreadyRecorded) tells the layer
//! not to complete or release after the handler did. The recorded [`Completion`] is what
//! retries get, so `record_in` takes the response the handler returns, with any
//! [`BufferedBody`] (`Bytes`, `String`, `Vec<u8>`, `Full<Bytes>`).
//!
//! The `*_in` methods run their one statement through any [`Executor`]: tokio-postgres's
//! `&Client` or `&Transaction`, deadpool's `&Client` or `&Transaction`, and with the `sqlx`
//! feature sqlx's `&mut Transaction<'_, Postgres>` or `&mut PgConnection`. They are fenced
//! like the store's own calls and never retried: on an error, roll back.
//!
//! Under `REPEATABLE READ` or `SERIALIZABLE`, the layer's lease renewal updates the record
//! while your transaction runs, and `complete_in` would then fail with a serialization failure
//! (`40001`: the row changed after your snapshot). Call [`lock_in`](PostgresStore::lock_in)
//! as the transaction's **first** statement: it takes the record's row lock with a snapshot
//! that already has the latest renewal, and renewals wait for your commit. Under `READ
//! COMMITTED` (Postgres's default) neither is needed.
//!
//! Use a pool of its own for business transactions: the store's pool also carries every
//! claim and renewal, and a handler holding its connections can starve them.
//!
//! ```no_run
//! use bytes::Bytes;
//! use tower_idempotency::store::postgres::deadpool_postgres::Pool;
//! use http::{header, Request, Response, StatusCode};
//! use tower_idempotency::store::postgres::PostgresStore;
//! use tower_idempotency::{IdempotencyContext, RecordDecision};
//!
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//!
//! async fn place_order(
//!     store: &PostgresStore,
//!     business: &Pool, // not the store's pool
//!     req: Request<Bytes>,
//! ) -> Result<Response<Bytes>, BoxError> {
//!     let ctx = req.extensions().get::<IdempotencyContext>().ok_or("not behind the layer")?;
//!     let mut res = Response::builder()
//!         .status(StatusCode::CREATED)
//!         .header(header::CONTENT_TYPE, "application/json")
//!         .body(Bytes::from_static(br#"{"order":"o-1"}"#))?;
//!
//!     let mut conn = business.get().await?;
//!     let tx = conn.transaction().await?;
//!     tx.execute("INSERT INTO orders (id, sku) VALUES ($1, $2)", &[&"o-1", &"sku-1"]).await?;
//!     // Last before COMMIT. Fenced like `complete`: with a stale token it fails, and the
//!     // order is rolled back with it.
//!     store.record_in(&tx, ctx, &res).await?;
//!     tx.commit().await?;
//!
//!     res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
//!     Ok(res)
//! }
//! ```
//!
//! ## Atomic phases
//!
//! A [resumable handler](crate::resumable) saves a recovery point after each step; between a
//! step's write and its save, a crash leaves the write without the point, and the takeover
//! runs the step again. When the step's write is in this database, close that window: make
//! each phase one transaction, its business write then
//! [`save_recovery_point_in`](PostgresStore::save_recovery_point_in), and the last phase its
//! write then `record_in`. Every phase commits whole or not at all, so a takeover resumes
//! exactly after the last committed one. A stale attempt's save is
//! [`StoreErrorKind::Fenced`]: it rolls back, so its write never lands either. Under `READ
//! COMMITTED` no `lock_in` is needed.
//!
//! ```no_run
//! # use tower_idempotency::store::postgres::deadpool_postgres::Pool;
//! # use tower_idempotency::store::postgres::PostgresStore;
//! # use tower_idempotency::{IdempotencyContext, RecordDecision};
//! # type BoxError = Box<dyn std::error::Error + Send + Sync>;
//! async fn transfer(
//!     store: &PostgresStore,
//!     business: &Pool,
//!     ctx: &IdempotencyContext,
//! ) -> Result<http::Response<String>, BoxError> {
//!     let mut conn = business.get().await?;
//!     if ctx.recovery_point().is_none() {
//!         let tx = conn.transaction().await?;
//!         tx.execute("UPDATE accounts SET held = held + 100 WHERE id = 1", &[]).await?;
//!         store.save_recovery_point_in(&tx, ctx, "held", "acct-1").await?;
//!         tx.commit().await?;
//!     }
//!     let tx = conn.transaction().await?;
//!     tx.execute("UPDATE accounts SET held = held - 100 WHERE id = 1", &[]).await?;
//!     let mut res = http::Response::new(String::from(r#"{"transfer":"done"}"#));
//!     store.record_in(&tx, ctx, &res).await?;
//!     tx.commit().await?;
//!     res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
//!     Ok(res)
//! }
//! ```
//!
//! # Per-scope quotas
//!
//! [`with_max_records_per_scope`](PostgresStoreBuilder::with_max_records_per_scope) and
//! [`with_max_bytes_per_scope`](PostgresStoreBuilder::with_max_bytes_per_scope) bound what one scope
//! (tenant) may hold, so one tenant cannot fill the database for the others: past a limit,
//! that scope's new keys get [`StoreErrorKind::QuotaExceeded`] (the layer answers `429`)
//! while retries of its existing records still replay and other scopes still claim. Records
//! count until their `expires_at`; bytes are the recorded answers' (headers, body, trailers)
//! plus 160 per record for the row and its index entries.
//!
//! The claim of a new key stays one statement and one round trip, and a live record needs no room, so the
//! quota is never checked for a replay (claim.sql answers it without calling the function).
//! For a new key, the claim function takes a transaction-level advisory
//! lock on the scope (claims of other scopes do not wait), counts the scope's live records
//! through the `(scope, expires_at)` index, stopping at the first limit reached (so the cost
//! is bounded by the quota, never a full count), and claims. The count runs after the lock,
//! with a fresh snapshot, so concurrent claims of one scope cannot overshoot it. That holds
//! under `READ COMMITTED` (the default) and `SERIALIZABLE` (where a conflicting count is a
//! retried serialization failure); under `REPEATABLE READ` the count's snapshot is taken
//! before the lock, and concurrent claims may overshoot by up to their number.
//!
//! With quotas off (the default) the function skips the quota, the `scope` column stays
//! `NULL`, and the partial index gets no entry, so quotas cost nothing. Records claimed while
//! quotas were off do not count once they are turned on.
//!
//! # What a request writes
//!
//! Measured on PostgreSQL 15 with `pg_stat_statements` (WAL bytes and records per statement),
//! `pg_current_wal_lsn()` before and after N requests, and `pg_stat_user_tables` (rows
//! inserted, updated, HOT-updated), with quotas off and a 70-byte answer (see BENCHMARKS.md):
//!
//! | request | statements | index entries written | WAL |
//! |---|---|---:|---:|
//! | replay, conflict, mismatch | claim: one primary-key read | 0 | 0 bytes |
//! | new key | claim: INSERT (heap row, primary key, `expires_at` index) | 2 | 862 bytes, 4 records |
//! | | complete: UPDATE (a new row version, not HOT: `expires_at` changes) | 2 | 380 bytes, 3 records |
//! | | total with the commits | 4 | about 1.3 KB |
//!
//! The new-key figures include the full-page images of index pages first touched since the
//! last checkpoint (about one claim in thirteen wrote one); they shrink with a longer
//! `checkpoint_timeout`. A lease renewal that does not move `expires_at` (the usual case: the
//! TTL outlives the lease) changes no indexed column and is a HOT update when its page has
//! room, which `fillfactor = 80` leaves: no index entry. With quotas on, the partial scope
//! index adds one entry per new key and one per completion; with them off it gets none.
//! A takeover or the replacement of an expired record is an UPDATE like the completion.
//! A request that saves no recovery point writes nothing more for them: the recovery index
//! gets no entry and its renewals stay HOT. Each save is an UPDATE that is not HOT (the
//! column is in that index's predicate): one entry in each index.
//!
//! # TLS
//!
//! [`connect`](PostgresStore::connect) honours `sslmode` with the `postgres-tls` feature, and
//! [`connect_with_tls`](PostgresStoreBuilder::connect_with_tls) verifies the server against your CA;
//! see them. With your own pool, pass it to [`PostgresStore::new`].

mod body;
mod executor;
mod feed;
mod migrate;
mod ops;
mod retry;
mod rows;
mod setup;
mod sql;
mod sweep;
mod transaction;

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use deadpool_postgres;
/// The rustls the `postgres-tls` feature uses, for [`PostgresStoreBuilder::connect_with_tls`].
#[cfg(feature = "postgres-tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
pub use rustls;
pub use tokio_postgres;

pub use body::BufferedBody;
pub use executor::Executor;
pub use migrate::SetupError;
pub use sweep::SweeperHandle;

use deadpool_postgres::Pool;

#[cfg(doc)]
use crate::store::record::Completion;
use crate::store::ConfigError;
#[cfg(doc)]
use crate::store::StoreErrorKind;
use setup::Owned;
use sql::{Sql, Table};

/// The table [`PostgresStore::new`] uses.
pub const DEFAULT_TABLE: &str = "idempotency_records";

/// Default bound on one operation: pool checkout, statement, retries and read-back.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// An [`IdempotencyStore`](crate::store::IdempotencyStore) in a Postgres table. Cloning shares
/// the pool.
///
/// See the [module docs](self) for the schema and how each guarantee is met.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    /// The driver config and TLS when `connect` built the pool: a timed-out statement's
    /// cancel request goes the same way.
    config: Option<Arc<Owned>>,
    table: Arc<Table>,
    sql: Arc<Sql>,
    timeout: Duration,
    retries: Arc<AtomicU64>,
    quota: Quota,
    /// When a pooled connection last found its server read-only (SQLSTATE 25006: a standby,
    /// or a primary fenced after a failover): connections opened before that are dropped.
    read_only_at: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    /// The invalidation feed's sender, once a local tier asked for it (`feed.rs`).
    feed: Arc<
        std::sync::OnceLock<Option<tokio::sync::broadcast::Sender<crate::store::Invalidation>>>,
    >,
}

/// Per-scope limits, as the quota function takes them (`NULL`: no limit).
#[derive(Debug, Clone, Copy, Default)]
struct Quota {
    records: Option<i64>,
    bytes: Option<i64>,
}

impl Quota {
    fn is_on(&self) -> bool {
        self.records.is_some() || self.bytes.is_some()
    }
}

/// A limit as SQL `bigint`: no quota that fits in memory is larger.
fn limit(n: NonZeroUsize) -> i64 {
    i64::try_from(n.get()).unwrap_or(i64::MAX)
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.name)
            .field("timeout", &self.timeout)
            .field("quota", &self.quota)
            .field("pool", &self.pool.status())
            .finish_non_exhaustive()
    }
}

/// Configures a [`PostgresStore`]: the table, the bound on each operation and per-scope
/// quotas, then [`connect`](Self::connect) to a URL or [`build`](Self::build) on your pool.
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_idempotency::store::postgres::PostgresStore;
///
/// let store = PostgresStore::builder()
///     .with_table("idempotency.records")?
///     .with_timeout(Duration::from_secs(2))
///     .connect("postgres://app@db/app")
///     .await?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresStoreBuilder {
    table: Table,
    timeout: Duration,
    quota: Quota,
}

impl Default for PostgresStoreBuilder {
    fn default() -> Self {
        Self {
            table: Table::parse(DEFAULT_TABLE).expect("the default table name is valid"),
            timeout: DEFAULT_TIMEOUT,
            quota: Quota::default(),
        }
    }
}

impl PostgresStoreBuilder {
    /// Uses the table `name` (default `idempotency_records`): `table` or `schema.table`,
    /// each a lowercase SQL identifier (`[a-z_][a-z0-9_]*`; at most 48 bytes for the table,
    /// 63 for the schema).
    ///
    /// Names are validated, not escaped: anything else is refused.
    pub fn with_table(mut self, name: &str) -> Result<Self, ConfigError> {
        self.table = Table::parse(name)?;
        Ok(self)
    }

    /// The most live records one scope (tenant) may hold at once (default: no per-scope
    /// limit).
    ///
    /// Past it, that scope's new keys are refused with [`StoreErrorKind::QuotaExceeded`]
    /// (the layer answers 429) while other scopes still claim: one tenant cannot fill the
    /// table for everyone. Retries of the scope's existing records still replay. Needs the
    /// function [`migrate`](PostgresStore::migrate) creates; see
    /// [Per-scope quotas](self#per-scope-quotas) for how the count works and what it costs.
    pub fn with_max_records_per_scope(mut self, n: NonZeroUsize) -> Self {
        self.quota.records = Some(limit(n));
        self
    }

    /// The byte budget of one scope: its recorded answers (headers, body, trailers) plus 160
    /// bytes per record (default: no per-scope limit). Checked when a new key is claimed: a
    /// scope at or over it gets [`StoreErrorKind::QuotaExceeded`] until its records expire.
    pub fn with_max_bytes_per_scope(mut self, n: NonZeroUsize) -> Self {
        self.quota.bytes = Some(limit(n));
        self
    }

    /// Bounds each operation to `timeout` (default 5 s): pool checkout, statement, retries
    /// and read-back together, one deadline per operation.
    ///
    /// A statement still running when a write's first attempt runs out (at two thirds of
    /// `timeout`) is cancelled on the server and has an unknown outcome; the store reads it
    /// back on a fresh connection in the time left (see the [module docs](self)).
    ///
    /// The pool [`connect`](Self::connect) makes also sets the connections'
    /// `statement_timeout` to half of `timeout` and `lock_timeout` to two fifths, so the
    /// server ends a blocked statement first, as a known failure
    /// ([`StoreErrorKind::Unavailable`]). On your own pool ([`build`](Self::build)), set
    /// them yourself the same way, e.g. with the connection option
    /// `-c statement_timeout=2500 -c lock_timeout=2000` for the default 5 s.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The store on your `pool`. Does no I/O.
    ///
    /// Each operation borrows a connection for one statement and returns it at once.
    pub fn build(self, pool: Pool) -> PostgresStore {
        PostgresStore::with_parts(pool, None, self)
    }
}

impl PostgresStore {
    /// A store on `pool`, in the table `idempotency_records`, with the defaults of
    /// [`builder`](Self::builder). Does no I/O.
    pub fn new(pool: Pool) -> Self {
        Self::builder().build(pool)
    }

    /// Configures a store: table, timeout, quotas.
    pub fn builder() -> PostgresStoreBuilder {
        PostgresStoreBuilder::default()
    }

    fn with_parts(pool: Pool, config: Option<Arc<Owned>>, options: PostgresStoreBuilder) -> Self {
        let PostgresStoreBuilder {
            table,
            timeout,
            quota,
        } = options;
        Self {
            sql: Arc::new(Sql::new(&table)),
            table: Arc::new(table),
            pool,
            config,
            timeout,
            retries: Arc::new(AtomicU64::new(0)),
            quota,
            read_only_at: Arc::new(std::sync::Mutex::new(None)),
            feed: Arc::default(),
        }
    }

    /// The pool, for your own queries and for [`complete_in`](Self::complete_in).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The table name, as given.
    pub fn table(&self) -> &str {
        &self.table.name
    }

    /// How many times this store (and its clones) retried a statement after a
    /// serialization failure or a deadlock.
    pub fn serialization_retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::{Fingerprint, RecordId};
    use crate::store::{ClaimRequest, IdempotencyStore, StoreErrorKind};

    /// The recipe the schema docs give, step by step, against the code's.
    #[test]
    fn the_schema_docs_derive_the_record_and_scope_ids_as_the_code_does() {
        use sha2::{Digest, Sha256};
        let framed = |h: &mut Sha256, part: Option<&str>| match part {
            None => h.update([0u8]),
            Some(p) => {
                h.update([1u8]);
                h.update((p.len() as u64).to_be_bytes());
                h.update(p.as_bytes());
            }
        };
        for scope in [
            None,
            Some(""),
            Some("tenant-a"),
            Some("s".repeat(27).as_str()),
            Some("s".repeat(90).as_str()),
        ] {
            let mut h = Sha256::new();
            h.update(b"tower-idempotency scope v1\0");
            framed(&mut h, scope);
            let scope_id: [u8; 32] = h.finalize().into();
            assert_eq!(&scope_id, crate::store::ScopeId::new(scope).as_bytes());

            let key = "order-1042";
            let mut h = Sha256::new();
            h.update(b"tower-idempotency record v3\0");
            framed(&mut h, scope);
            let header = 28 + scope.map_or(1, |s| 9 + s.len());
            h.update(vec![0u8; (64 - header % 64) % 64]);
            h.update((key.len() as u64).to_be_bytes());
            h.update(key.as_bytes());
            let mut id: [u8; 32] = h.finalize().into();
            id[..4].copy_from_slice(&scope_id[..4]);
            assert_eq!(&id, RecordId::new(scope, key).as_bytes());
        }
    }

    #[tokio::test]
    async fn equal_nonces_with_different_fingerprints_claim_once() {
        let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_POSTGRES_URL") else {
            return;
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000;
        let table = format!("tidem_unit_{}_{nanos}", std::process::id());
        let store = PostgresStore::builder()
            .with_table(&table)
            .unwrap()
            .connect(&url)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        crate::store::equal_nonces_with_different_fingerprints_claim_once(&store).await;
        let client = store.pool().get().await.unwrap();
        client
            .batch_execute(&format!(
                "DROP TABLE {table}; DROP FUNCTION {table}_claim_v2; DROP FUNCTION {table}_claim_v3; \
                 DROP FUNCTION {table}_claim_new_v1"
            ))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_failed_random_source_fails_the_claim_before_any_io() {
        // A pool that would never connect: the claim must fail before it tries.
        let config: tokio_postgres::Config = "host=127.0.0.1 port=1 user=nobody".parse().unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        let pool = Pool::builder(manager).max_size(1).build().unwrap();
        let store = PostgresStore::new(pool);
        let id = RecordId::new(None, "k");
        let fp = Fingerprint::from_bytes([1; 32]);
        crate::store::record::FAIL_RANDOM.with(|f| f.set(true));
        let r = store
            .claim(&ClaimRequest::new(
                &id,
                &fp,
                Duration::from_secs(1),
                Duration::from_secs(1),
            ))
            .await;
        crate::store::record::FAIL_RANDOM.with(|f| f.set(false));
        let e = r.unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Unavailable);
        let cause = std::error::Error::source(&e).unwrap().to_string();
        assert!(cause.contains("random"), "{cause}");
    }
}
