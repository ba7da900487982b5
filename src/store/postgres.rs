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
//! let store = PostgresStore::connect("postgres://app@db/app")
//!     .await?
//!     .with_table("idempotency.records")?;
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
//! [`with_table`](PostgresStore::with_table) names another) and an index on `expires_at`:
//!
//! ```sql
//! CREATE TABLE idempotency_records (
//!     id           bytea       PRIMARY KEY,  -- RecordId: SHA-256 of (scope, key), 32 bytes
//!     fingerprint  bytea       NOT NULL,     -- 32 bytes
//!     state        smallint    NOT NULL,     -- 0 in progress, 1 response, 2 tombstone
//!     generation   bigint      NOT NULL,     -- 1 for a first claim, + 1 per takeover
//!     nonce        bytea       NOT NULL,     -- the token's random part, 16 bytes
//!     locked_until timestamptz NOT NULL,     -- end of the holder's lease
//!     status       smallint,                 -- the recorded answer, once completed
//!     headers      bytea,
//!     body         bytea,
//!     trailers     bytea,                    -- NULL: the response had no trailers
//!     created_at   timestamptz NOT NULL,
//!     expires_at   timestamptz NOT NULL      -- end of retention
//! );
//! ```
//!
//! Headers and trailers use the compact binary layout of [`Completion::encode`] behind a
//! format byte; bodies are raw `bytea`, never base64. The store writes
//! `expires_at >= locked_until` for every in-progress row, so a live lease always outlives
//! its retention; every statement still treats a row as live while its lease is, whatever
//! `expires_at` says (see [`delete_expired`](PostgresStore::delete_expired)).
//!
//! # How the contract is met
//!
//! - **The claim is one statement and one round trip**: a CTE that tries
//!   `INSERT … ON CONFLICT (id) DO NOTHING`, updates the row in the same statement when it
//!   has expired (it is replaced, generation 1) or is in progress with a lapsed lease and the
//!   same fingerprint (a takeover, generation + 1), and otherwise returns the existing row,
//!   so a replay or a conflict also costs one round trip. A new request costs two (claim,
//!   then complete). The claim commits on its own before the handler runs: no transaction
//!   and no pool connection is held while the handler works.
//! - **Fencing**: `extend`, `complete` and `release` put the generation *and* the nonce in
//!   their `WHERE` clause. Zero rows is [`StoreErrorKind::Fenced`], and nothing was written.
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
//!   together are bounded by [`with_timeout`](PostgresStore::with_timeout) (5 s by default).
//!   A statement the store gives up on is cancelled on the server with the driver's cancel
//!   token, so no backend keeps running it. On connections from
//!   [`connect`](PostgresStore::connect), `statement_timeout` and `lock_timeout` sit below
//!   that deadline, so a statement blocked on a lock is ended by the server first: a known
//!   failure (SQLSTATE `57014` or `55P03`, rolled back), [`StoreErrorKind::Unavailable`]
//!   with no read-back needed. TCP keepalives notice a half-open connection after a failover.
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
//! - make autovacuum keep up with the churn: e.g.
//!   `ALTER TABLE idempotency_records SET (autovacuum_vacuum_scale_factor = 0.01,
//!   autovacuum_vacuum_cost_delay = 0)`;
//! - a `fillfactor` below 100 (e.g. 90) leaves room on each page for lease renewals to be
//!   HOT updates;
//! - keep `max_response_body` modest: large bodies are TOASTed and dominate the table size;
//! - hash-partition by `id` if one table grows too large to vacuum: that keeps the key unique.
//!
//! # Transactional completion
//!
//! A handler that writes to the same database can record its answer in its own transaction
//! with [`complete_in`](PostgresStore::complete_in): the business writes and the recorded
//! answer then commit together or not at all. If the transaction rolls back, the record stays
//! in progress, and once its lease lapses a retry takes it over and runs the work again.
//! The layer puts an [`IdempotencyContext`](crate::IdempotencyContext) (record id and token)
//! into the request's extensions; a response carrying
//! [`RecordDecision::AlreadyRecorded`](crate::RecordDecision::AlreadyRecorded) tells the layer
//! not to complete or release after the handler did. The recorded [`Completion`] is what
//! retries get, so it should match the response the handler returns.
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
//! # TLS
//!
//! [`connect`](PostgresStore::connect) connects without TLS. For TLS, build the pool yourself
//! with a rustls connector (e.g. `tokio-postgres-rustls`) and pass it to
//! [`PostgresStore::new`].

use std::error::Error as StdError;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, Bytes};
use http::{HeaderMap, StatusCode};
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tokio::time::{timeout_at, Instant};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

pub use deadpool_postgres;
/// The rustls the `postgres-tls` feature uses, for [`PostgresStore::connect_with_tls`].
#[cfg(feature = "postgres-tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
pub use rustls;
pub use tokio_postgres;

use deadpool_postgres::{GenericClient, Object, Pool};

use super::{
    error_chain as chain, Claim, ClaimOutcome, IdempotencyStore, StoreError, StoreErrorKind,
};
use crate::error::ConfigError;
use crate::record::{
    get_headers, put_headers, Completion, Fingerprint, Record, RecordId, RecordState,
    StoredResponse, Token,
};

/// The table [`PostgresStore::new`] uses.
pub const DEFAULT_TABLE: &str = "idempotency_records";

/// Default bound on one operation: pool checkout, statement, retries and read-back.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

// How one operation spends its budget T (`with_timeout`, DEFAULT_TIMEOUT by default):
//
// - the whole operation (checkout, prepare, statement, retries, read-back) ends at T;
// - the first attempt of a write ends at 2T/3 (FIRST_TRY_SHARE thirds), so when its reply is
//   lost a read-back on a fresh connection still has T/3 (connect plus one statement);
// - on the connections `connect` opens, the server itself aborts a lock wait at
//   lock_timeout = 2T/5 (55P03) and any statement at statement_timeout = T/2 (57014). Both
//   come before the client's 2T/3 whenever checkout and prepare take less than T/6, so a
//   blocked statement ends as a known failure (rolled back: no read-back needed) rather than
//   an unknown one;
// - a statement the client gives up on anyway is cancelled on the server (cancel token).
//
// With T = 300 ms: locks wait 120 ms, statements run 150 ms, the first try ends at 200 ms and
// the read-back has 100 ms.
const FIRST_TRY_SHARE: u32 = 2;

/// `statement_timeout` and `lock_timeout` for operations bounded by `t` (see above), in whole
/// milliseconds, at least 1 (0 would turn them off).
fn server_timeouts(t: Duration) -> (u128, u128) {
    let ms = |d: Duration| d.as_millis().max(1);
    (ms(t / 2), ms(t * 2 / 5))
}

/// The connection options `connect` adds: the server-side timeouts for `t`.
fn timeout_options(existing: Option<&str>, t: Duration) -> String {
    let (statement, lock) = server_timeouts(t);
    let ours = format!("-c statement_timeout={statement} -c lock_timeout={lock}");
    match existing {
        Some(o) if !o.trim().is_empty() => format!("{o} {ours}"),
        _ => ours,
    }
}

/// TCP keepalive probes: a half-open connection (a failed-over server) is noticed in about
/// 30 s + 3 × 10 s, not the OS default of two hours.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;

/// Attempts per operation, for serialization failures and lost races.
const MAX_ATTEMPTS: u32 = 8;

/// Repeats on a fresh connection after a connection failure. Two: a stale pooled connection
/// can fail before the one whose reply was lost, and the read-back still deserves its try.
const MAX_RECONNECTS: u32 = 2;

/// Rows per `DELETE` in `delete_expired`: short transactions and row locks.
const SWEEP_BATCH: i64 = 1000;

/// Leases and TTLs reach SQL as whole microseconds, capped at 100 years (3.2e15 µs):
/// `now() + u64::MAX µs` would overflow `timestamptz` (it ends in 294276 AD) and fail, and
/// SQL multiplies `bigint × interval` through `float8`, exact only below 2^53 µs (285 years).
const MAX_MICROS: i64 = 100 * 365 * 24 * 3600 * 1_000_000;

/// Postgres truncates identifiers to 63 bytes. The index is named `<table>_expires_at_idx`
/// (15 more bytes), so table names stop at 48 to keep two tables' index names apart.
const MAX_TABLE_LEN: usize = 63 - "_expires_at_idx".len();
const MAX_SCHEMA_LEN: usize = 63;

// Values of the `state` column. The SQL below writes `0` for `IN_PROGRESS` literally.
const IN_PROGRESS: i16 = 0;
const RESPONSE: i16 = 1;
const TOMBSTONE: i16 = 2;

/// Version byte in front of the `headers` and `trailers` columns.
const HEADERS_FORMAT: u8 = 1;

// Outcomes of the claim statement, in order of precedence.
const INSERTED: i16 = 0;
const UPDATED: i16 = 1;
const EXISTING: i16 = 2;

/// An [`IdempotencyStore`] in a Postgres table. Cloning shares the pool.
///
/// See the [module docs](self) for the schema and how each guarantee is met.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    /// The driver config and TLS when `connect` built the pool: `with_timeout` rebuilds it then.
    config: Option<Arc<Owned>>,
    table: Arc<Table>,
    sql: Arc<Sql>,
    timeout: Duration,
    retries: Arc<AtomicU64>,
}

/// libpq's `prefer` and `require`: TLS with the ring provider (never OpenSSL), the
/// handshake's signatures checked, the certificate chain and name not.
#[cfg(feature = "postgres-tls")]
fn encrypt_only_config() -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
        .with_no_client_auth()
}

/// Accepts any server certificate (libpq's `sslmode=require`), but still checks that the
/// server holds the certificate's key.
#[cfg(feature = "postgres-tls")]
#[derive(Debug)]
struct EncryptOnly(Arc<rustls::crypto::CryptoProvider>);

#[cfg(feature = "postgres-tls")]
impl rustls::client::danger::ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// What `connect` built its pool from.
struct Owned {
    config: tokio_postgres::Config,
    tls: Tls,
}

/// How `connect` reaches the server.
#[derive(Clone)]
enum Tls {
    /// Plaintext only: built without `postgres-tls`. `sslmode=require` then fails to connect.
    #[cfg_attr(feature = "postgres-tls", allow(dead_code))]
    None,
    /// rustls, as `sslmode` says (`disable`, `prefer`, `require`).
    #[cfg(feature = "postgres-tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.name)
            .field("timeout", &self.timeout)
            .field("pool", &self.pool.status())
            .finish_non_exhaustive()
    }
}

/// Why a [`PostgresStore`] could not be set up: from [`connect`](PostgresStore::connect),
/// [`migrate`](PostgresStore::migrate) and [`verify`](PostgresStore::verify).
///
/// The text names the cause and what to do; the driver error it came from is kept in the
/// variant (and is part of the text, so it is not repeated as a [`source`](StdError::source)).
#[derive(Debug)]
#[non_exhaustive]
pub enum SetupError {
    /// The URL or connection string did not parse.
    Url(tokio_postgres::Error),
    /// No connection could be opened: nothing listening, refused login, unknown database.
    Connect(deadpool_postgres::PoolError),
    /// The table does not exist (or its schema does not): run
    /// [`migrate`](PostgresStore::migrate).
    MissingTable {
        /// The table, as given to [`with_table`](PostgresStore::with_table).
        table: String,
    },
    /// [`migrate`](PostgresStore::migrate) could not create the table: its schema does not
    /// exist, or the role may not create it.
    Migrate {
        /// The table, as given to [`with_table`](PostgresStore::with_table).
        table: String,
        /// What the server (or the connection) said.
        error: tokio_postgres::Error,
    },
    /// The table exists but the store cannot use it: a missing column, no privilege.
    Table {
        /// The table, as given to [`with_table`](PostgresStore::with_table).
        table: String,
        /// What the server said.
        error: tokio_postgres::Error,
    },
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::Url(e) => write!(f, "invalid Postgres URL: {}", chain(e)),
            SetupError::Connect(e) => write!(f, "could not connect to Postgres: {}", chain(e)),
            SetupError::MissingTable { table } => write!(
                f,
                "the idempotency table {table} does not exist; create it with \
                 PostgresStore::migrate() (or the SQL in the store's docs)"
            ),
            SetupError::Migrate { table, error } => write!(
                f,
                "could not create the idempotency table {table}: {}",
                chain(error)
            ),
            SetupError::Table { table, error } => write!(
                f,
                "the idempotency table {table} cannot be used: {}",
                chain(error)
            ),
        }
    }
}

impl StdError for SetupError {}

/// The validated table: quoted for SQL, and the key of its migration lock.
#[derive(Debug)]
struct Table {
    name: String,
    quoted: String,
    index: String,
    lock_key: i64,
}

impl Table {
    fn parse(name: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::new(format!("invalid table name {name:?}: {why}"));
        let parts: Vec<&str> = name.split('.').collect();
        let (schema, table) = match parts.as_slice() {
            [table] => (None, *table),
            [schema, table] => (Some(*schema), *table),
            _ => return Err(bad("expected `table` or `schema.table`")),
        };
        for (part, max) in [(schema, MAX_SCHEMA_LEN), (Some(table), MAX_TABLE_LEN)] {
            let Some(part) = part else { continue };
            let mut chars = part.chars();
            let first_ok = chars
                .next()
                .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
            if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                return Err(bad(
                    "each part must be a lowercase identifier: [a-z_][a-z0-9_]*",
                ));
            }
            if part.len() > max {
                return Err(bad(&format!("a part is longer than {max} bytes")));
            }
        }
        // The checks above leave nothing to escape; quoting still makes reserved words
        // (`user`, `order`) usable.
        let quoted = match schema {
            Some(s) => format!("\"{s}\".\"{table}\""),
            None => format!("\"{table}\""),
        };
        let digest = Sha256::digest(format!("tower-idempotency migrate {name}"));
        let mut key = [0u8; 8];
        key.copy_from_slice(&digest[..8]);
        Ok(Self {
            name: name.to_owned(),
            quoted,
            index: format!("\"{table}_expires_at_idx\""),
            lock_key: i64::from_be_bytes(key),
        })
    }
}

/// The statements, built once per table. `r` is always the record row.
#[derive(Debug)]
struct Sql {
    migrate: String,
    claim: String,
    extend: String,
    complete: String,
    release: String,
    lock: String,
    held: String,
    get: String,
    sweep: String,
    inspect: String,
    remove: String,
}

impl Sql {
    fn new(table: &Table) -> Self {
        let t = &table.quoted;
        // A row is expired past `expires_at`, unless its lease is still live.
        let expired = |r: &str| {
            format!(
                "({r}.expires_at <= statement_timestamp() \
                 AND NOT ({r}.state = 0 AND {r}.locked_until > statement_timestamp()))"
            )
        };
        let exp = expired("r");
        // In progress, lease lapsed, same request: may be taken over.
        let lapsed =
            "(r.state = 0 AND r.locked_until <= statement_timestamp() AND r.fingerprint = $2)";
        let us = "* interval '1 microsecond'";
        let lease_us = "CASE WHEN r.state = 0 THEN GREATEST(0, EXTRACT(EPOCH FROM \
                        (r.locked_until - statement_timestamp())) * 1000000)::bigint END";
        let record_cols = format!(
            "r.generation, r.fingerprint, r.state, {lease_us} AS lease_us, \
             r.status, r.headers, r.body, r.trailers"
        );
        let fenced = format!(
            "r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea \
             AND r.state = 0 AND NOT {exp}"
        );
        Self {
            migrate: format!(
                "SELECT pg_advisory_xact_lock({key});
                 CREATE TABLE IF NOT EXISTS {t} (
                     id           bytea       PRIMARY KEY CHECK (octet_length(id) = 32),
                     fingerprint  bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
                     state        smallint    NOT NULL CHECK (state IN (0, 1, 2)),
                     generation   bigint      NOT NULL CHECK (generation > 0),
                     nonce        bytea       NOT NULL CHECK (octet_length(nonce) = 16),
                     locked_until timestamptz NOT NULL,
                     status       smallint,
                     headers      bytea,
                     body         bytea,
                     trailers     bytea,
                     created_at   timestamptz NOT NULL,
                     expires_at   timestamptz NOT NULL
                 );
                 CREATE INDEX IF NOT EXISTS {idx} ON {t} (expires_at);",
                key = table.lock_key,
                idx = table.index,
            ),
            // $1 id, $2 fingerprint, $3 nonce, $4 lease µs, $5 ttl µs.
            // A new record is kept max(lease, ttl); a takeover keeps the retention and
            // extends it to cover the new lease, so expires_at >= locked_until (to the
            // microsecond: the predicates above never rely on it). Leases start at
            // clock_timestamp(), when the row is written: time spent waiting on a row lock
            // does not shorten them.
            claim: format!(
                "WITH ins AS (
                     INSERT INTO {t} AS r (id, fingerprint, state, generation, nonce,
                                           locked_until, created_at, expires_at)
                     VALUES ($1::bytea, $2::bytea, 0, 1, $3::bytea,
                             clock_timestamp() + $4::bigint {us},
                             statement_timestamp(),
                             clock_timestamp() + GREATEST($4::bigint, $5::bigint) {us})
                     ON CONFLICT (id) DO NOTHING
                     RETURNING r.generation
                 ), upd AS (
                     UPDATE {t} AS r SET
                         fingerprint = $2, state = 0, nonce = $3,
                         generation = CASE WHEN {exp} THEN 1 ELSE r.generation + 1 END,
                         locked_until = clock_timestamp() + $4 {us},
                         created_at = CASE WHEN {exp} THEN statement_timestamp()
                                      ELSE r.created_at END,
                         expires_at = CASE WHEN {exp}
                                      THEN clock_timestamp() + GREATEST($4, $5) {us}
                                      ELSE GREATEST(r.expires_at, clock_timestamp() + $4 {us})
                                      END,
                         status = NULL, headers = NULL, body = NULL, trailers = NULL
                     WHERE r.id = $1 AND ({exp} OR {lapsed})
                     RETURNING r.generation
                 ), cur AS (
                     -- The row as this statement's snapshot saw it. A row the update should
                     -- have taken but did not was changed concurrently: return nothing, and
                     -- the caller runs the claim again with a fresh snapshot.
                     SELECT r.nonce, {record_cols} FROM {t} AS r
                     WHERE r.id = $1 AND NOT {exp} AND NOT {lapsed}
                       AND NOT EXISTS (SELECT FROM ins) AND NOT EXISTS (SELECT FROM upd)
                 )
                 SELECT {INSERTED}::smallint AS outcome, generation, NULL::bytea AS nonce,
                        NULL::bytea AS fingerprint, NULL::smallint AS state,
                        NULL::bigint AS lease_us, NULL::smallint AS status,
                        NULL::bytea AS headers, NULL::bytea AS body, NULL::bytea AS trailers,
                        NULL::bigint AS lapsed_us
                   FROM ins
                 UNION ALL
                 -- How long the replaced lease had lapsed: the subquery reads the row as the
                 -- statement's snapshot saw it, before the update.
                 SELECT {UPDATED}::smallint, generation, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                        (SELECT GREATEST(0, EXTRACT(EPOCH FROM
                                    (clock_timestamp() - o.locked_until)) * 1000000)::bigint
                           FROM {t} AS o WHERE o.id = $1)
                   FROM upd
                 UNION ALL
                 SELECT {EXISTING}::smallint, generation, nonce, fingerprint, state, lease_us, status,
                        headers, body, trailers, NULL
                   FROM cur"
            ),
            // $1 id, $2 generation, $3 nonce, $4 lease µs.
            extend: format!(
                "UPDATE {t} AS r SET
                     locked_until = clock_timestamp() + $4::bigint {us},
                     expires_at = GREATEST(r.expires_at, clock_timestamp() + $4::bigint {us})
                 WHERE {fenced}
                 RETURNING 1"
            ),
            // $1 id, $2 generation, $3 nonce, $4 state, $5 status, $6 headers, $7 body,
            // $8 trailers, $9 ttl µs. `done` (read from the snapshot before this statement)
            // tells a retry after a lost reply that its first attempt committed.
            complete: format!(
                "WITH upd AS (
                     UPDATE {t} AS r SET
                         state = $4::smallint, status = $5::smallint, headers = $6::bytea,
                         body = $7::bytea, trailers = $8::bytea,
                         expires_at = statement_timestamp() + $9::bigint {us}
                     WHERE {fenced}
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT FROM upd) AS applied,
                        EXISTS (SELECT FROM {t} AS r WHERE r.id = $1 AND r.generation = $2
                                AND r.nonce = $3 AND r.state <> 0 AND NOT {exp}) AS done"
            ),
            // $1 id, $2 generation, $3 nonce. `present`: whether any live row was there.
            release: format!(
                "WITH del AS (
                     DELETE FROM {t} AS r WHERE {fenced}
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT FROM del) AS applied,
                        EXISTS (SELECT FROM {t} AS r WHERE r.id = $1 AND NOT {exp}) AS present"
            ),
            // $1 id, $2 generation, $3 nonce.
            lock: format!("SELECT 1 FROM {t} AS r WHERE {fenced} FOR UPDATE"),
            // $1 id, $2 generation, $3 nonce: a fresh look at the live row, if any, after a
            // write that changed nothing (its own snapshot may predate a late commit).
            held: format!(
                "SELECT r.generation = $2::bigint AND r.nonce = $3::bytea AS mine, r.state
                 FROM {t} AS r WHERE r.id = $1::bytea AND NOT {exp}"
            ),
            get: format!("SELECT {record_cols} FROM {t} AS r WHERE r.id = $1::bytea AND NOT {exp}"),
            // The operator API. A live lease keeps a row past `expires_at`: count to the later.
            inspect: format!(
                "SELECT {record_cols}, GREATEST(0, EXTRACT(EPOCH FROM (
                            GREATEST(r.expires_at, CASE WHEN r.state = 0 THEN r.locked_until END)
                            - statement_timestamp())) * 1000000)::bigint AS expires_us
                 FROM {t} AS r WHERE r.id = $1::bytea AND NOT {exp}"
            ),
            // $1 id, $2 true to remove a completed row, false one in progress.
            remove: format!(
                "WITH del AS (
                     DELETE FROM {t} AS r
                     WHERE r.id = $1::bytea AND NOT {exp} AND (r.state <> 0) = $2::bool
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT FROM del) AS removed,
                        EXISTS (SELECT FROM {t} AS r WHERE r.id = $1::bytea AND NOT {exp}) AS present"
            ),
            // SKIP LOCKED: never wait behind a claim that is replacing an expired row.
            sweep: format!(
                "DELETE FROM {t} AS r
                 WHERE r.id IN (SELECT s.id FROM {t} AS s WHERE {sexp}
                                ORDER BY s.expires_at LIMIT $1::bigint
                                FOR UPDATE SKIP LOCKED)
                   AND {exp}
                 RETURNING 1",
                sexp = expired("s"),
            ),
        }
    }
}

/// How one attempt failed.
enum Failure {
    /// `40001` or `40P01`: the transaction was rolled back; run it again.
    Serialization(tokio_postgres::Error),
    /// The connection failed. `sent`: the statement may have reached the server, so its
    /// outcome is unknown until read back.
    Down {
        error: Box<dyn StdError + Send + Sync>,
        sent: bool,
    },
    /// The server refused the statement; nothing was written.
    Refused(StoreError),
}

/// The retry policy of one operation: bounded attempts within one deadline, and memory of an
/// unknown outcome.
struct Attempts<'a> {
    store: &'a PostgresStore,
    /// The first attempt ends here, leaving the rest of the budget to a read-back.
    first_by: Instant,
    /// The whole operation ends here, read-back included.
    end: Instant,
    made: u32,
    reconnects: u32,
    /// A read, or a write whose repeat needs no read-back: a lost reply is not "unknown".
    idempotent: bool,
    /// Set when an earlier attempt may have committed: every statement resolves it by
    /// reporting whether the row already carries this token.
    uncertain: Option<Box<dyn StdError + Send + Sync>>,
}

impl<'a> Attempts<'a> {
    fn new(store: &'a PostgresStore, idempotent: bool) -> Self {
        let start = Instant::now();
        Self {
            store,
            first_by: start + store.timeout * FIRST_TRY_SHARE / 3,
            end: start + store.timeout,
            made: 0,
            reconnects: 0,
            idempotent,
            uncertain: None,
        }
    }

    /// The deadline of the next attempt, or the error to give up with once the operation's
    /// own deadline has passed. A write whose outcome is still known keeps a third of the
    /// budget back, for reading back a reply it may lose.
    fn deadline(&mut self) -> Result<Instant, StoreError> {
        let now = Instant::now();
        if now >= self.end {
            return Err(self.give_up(Some(Box::new(DeadlinePassed(self.store.timeout)))));
        }
        if !self.idempotent && self.uncertain.is_none() && now < self.first_by {
            Ok(self.first_by)
        } else {
            Ok(self.end)
        }
    }

    /// `Ok` to try again, or the error to give up with.
    async fn after(&mut self, failure: Failure) -> Result<(), StoreError> {
        self.made += 1;
        match failure {
            Failure::Serialization(e) => {
                if self.made >= MAX_ATTEMPTS {
                    return Err(self.give_up(Some(e.into())));
                }
                self.store.retries.fetch_add(1, Ordering::Relaxed);
                // The next `deadline` gives up if the backoff ran into the end.
                let _ = timeout_at(self.end, backoff(self.made)).await;
                Ok(())
            }
            Failure::Down { error, sent } => {
                let last = if sent && !self.idempotent && self.uncertain.is_none() {
                    tracing::debug!(error = %error, "postgres reply lost; reading back");
                    self.uncertain = Some(error);
                    None
                } else {
                    Some(error)
                };
                // A stale pooled connection fails fast, and a fresh one usually works; the
                // repeat on a fresh connection is also the read-back of a lost reply.
                if self.reconnects < MAX_RECONNECTS && self.made < MAX_ATTEMPTS {
                    self.reconnects += 1;
                    return Ok(());
                }
                Err(self.give_up(last))
            }
            Failure::Refused(e) => match self.uncertain.take() {
                Some(first) => Err(StoreError::with_source(StoreErrorKind::Unknown, first)),
                None => Err(e),
            },
        }
    }

    /// For a lost race (a claim that saw no row it could use): run again, bounded.
    fn again(&mut self) -> Result<(), StoreError> {
        self.made += 1;
        if self.made >= MAX_ATTEMPTS {
            return Err(self.give_up(Some("the claim kept losing races for the key".into())));
        }
        Ok(())
    }

    fn give_up(&mut self, last: Option<Box<dyn StdError + Send + Sync>>) -> StoreError {
        match (self.uncertain.take(), last) {
            (Some(first), last) => {
                if let Some(last) = last {
                    tracing::warn!(error = %last, "postgres read-back failed; outcome unknown");
                }
                StoreError::with_source(StoreErrorKind::Unknown, first)
            }
            (None, Some(last)) => StoreError::with_source(StoreErrorKind::Unavailable, last),
            (None, None) => StoreError::new(StoreErrorKind::Unavailable),
        }
    }
}

/// None before the first retry (the conflicting transaction has already committed), then a
/// jittered wait of up to 2^n ms, at most 64 ms.
async fn backoff(attempt: u32) {
    if attempt <= 1 {
        return;
    }
    let cap = 1u64 << attempt.min(6);
    let jitter = u64::from(getrandom::u32().unwrap_or(0)) % (cap + 1);
    tokio::time::sleep(Duration::from_millis(jitter)).await;
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).map_or(MAX_MICROS, |us| us.min(MAX_MICROS))
}

/// Drops a connection whose state is unknown instead of returning it to the pool.
fn discard(client: Object) {
    drop(Object::take(client));
}

/// Sorts a driver error. Only SQLSTATEs decide, never message text.
fn classify(error: tokio_postgres::Error, sent: bool) -> Failure {
    let Some(code) = error.code() else {
        // Closed, I/O, protocol: the connection is gone or unusable.
        return Failure::Down {
            error: error.into(),
            sent,
        };
    };
    if *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED {
        return Failure::Serialization(error);
    }
    // Class 08 (connection exception) and the shutdown codes end the session: treat them
    // like a dropped connection.
    if code.code().starts_with("08")
        || *code == SqlState::ADMIN_SHUTDOWN
        || *code == SqlState::CRASH_SHUTDOWN
        || *code == SqlState::CANNOT_CONNECT_NOW
    {
        return Failure::Down {
            error: error.into(),
            sent,
        };
    }
    Failure::Refused(refused(error))
}

/// The kind of a server error whose statement did not commit.
fn refused(error: tokio_postgres::Error) -> StoreError {
    let kind = match error.code() {
        Some(c) if *c == SqlState::DISK_FULL => StoreErrorKind::Full,
        Some(c)
            if *c == SqlState::QUERY_CANCELED
                || *c == SqlState::LOCK_NOT_AVAILABLE
                || *c == SqlState::TOO_MANY_CONNECTIONS
                || *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED
                || c.code().starts_with("08")
                || c.code().starts_with("57P") =>
        {
            StoreErrorKind::Unavailable
        }
        Some(_) => StoreErrorKind::Other,
        None => StoreErrorKind::Unavailable,
    };
    StoreError::with_source(kind, error)
}

/// The source of an error when an operation used up its time.
#[derive(Debug)]
struct DeadlinePassed(Duration);

impl fmt::Display for DeadlinePassed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the postgres operation ran out of its {:?}", self.0)
    }
}

impl StdError for DeadlinePassed {}

/// Why stored columns could not be read back.
#[derive(Debug)]
struct CorruptRow(&'static str);

impl fmt::Display for CorruptRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "corrupt idempotency row: {}", self.0)
    }
}

impl StdError for CorruptRow {}

fn corrupt(e: impl Into<Box<dyn StdError + Send + Sync>>) -> StoreError {
    StoreError::with_source(StoreErrorKind::Corrupt, e)
}

fn encode_headers(h: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 4 + 48 * h.len());
    out.push(HEADERS_FORMAT);
    put_headers(&mut out, h);
    out
}

fn decode_headers(bytes: Vec<u8>) -> Result<HeaderMap, StoreError> {
    let mut buf = Bytes::from(bytes);
    if buf.is_empty() || buf.get_u8() != HEADERS_FORMAT {
        return Err(corrupt(CorruptRow("unknown headers format")));
    }
    let headers = get_headers(&mut buf).map_err(corrupt)?;
    if buf.has_remaining() {
        return Err(corrupt(CorruptRow("trailing bytes after headers")));
    }
    Ok(headers)
}

fn column<'r, T: tokio_postgres::types::FromSql<'r>>(
    row: &'r Row,
    name: &str,
) -> Result<T, StoreError> {
    row.try_get(name).map_err(corrupt)
}

fn generation(row: &Row) -> Result<u64, StoreError> {
    let g: i64 = column(row, "generation")?;
    u64::try_from(g).map_err(|_| corrupt(CorruptRow("negative generation")))
}

/// Reads the record columns: generation, fingerprint, state, lease_us, status, headers,
/// body, trailers.
fn decode_record(row: &Row) -> Result<Record, StoreError> {
    let fp: Vec<u8> = column(row, "fingerprint")?;
    let fingerprint = Fingerprint::from_bytes(
        fp.try_into()
            .map_err(|_| corrupt(CorruptRow("fingerprint is not 32 bytes")))?,
    );
    let state: i16 = column(row, "state")?;
    let status = || -> Result<StatusCode, StoreError> {
        let s: i16 = column(row, "status")?;
        u16::try_from(s)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| corrupt(CorruptRow("invalid status")))
    };
    let state = match state {
        IN_PROGRESS => {
            let us: i64 = column(row, "lease_us")?;
            RecordState::InProgress {
                lease_remaining: Duration::from_micros(u64::try_from(us).unwrap_or(0)),
            }
        }
        RESPONSE => {
            let headers: Vec<u8> = column(row, "headers")?;
            let body: Vec<u8> = column(row, "body")?;
            let trailers: Option<Vec<u8>> = column(row, "trailers")?;
            RecordState::Completed(Completion::Response(StoredResponse {
                status: status()?,
                headers: decode_headers(headers)?,
                body: Bytes::from(body),
                trailers: trailers.map(decode_headers).transpose()?,
            }))
        }
        TOMBSTONE => RecordState::Completed(Completion::Tombstone { status: status()? }),
        _ => return Err(corrupt(CorruptRow("unknown state"))),
    };
    Ok(Record {
        fingerprint,
        generation: generation(row)?,
        state,
    })
}

/// What the claim statement returned: `None` when it lost a race and must run again.
fn decode_claim(
    rows: &[Row],
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<Option<ClaimOutcome>, StoreError> {
    let mut best: Option<(i16, &Row)> = None;
    for row in rows {
        let outcome: i16 = column(row, "outcome")?;
        if best.is_none_or(|(b, _)| outcome < b) {
            best = Some((outcome, row));
        }
    }
    let Some((outcome, row)) = best else {
        return Ok(None);
    };
    let generation = generation(row)?;
    let claimed = |generation: u64, lapsed_for: Option<Duration>| {
        // A new or replaced record starts at generation 1; a takeover is always above it.
        let takeover = generation > 1;
        Ok(Some(ClaimOutcome::Claimed(Claim {
            token: Token::from_parts(generation, *nonce),
            takeover,
            lapsed_for: lapsed_for.filter(|_| takeover),
        })))
    };
    match outcome {
        INSERTED | UPDATED => {
            let lapsed_us: Option<i64> = column(row, "lapsed_us")?;
            let lapsed = lapsed_us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
            claimed(generation, lapsed)
        }
        EXISTING => {
            let held: Vec<u8> = column(row, "nonce")?;
            let state: i16 = column(row, "state")?;
            let record = decode_record(row)?;
            // Our own nonce and request: an earlier attempt whose reply was lost did commit.
            // Equal nonces alone never prove that, so the fingerprint must match too.
            if state == IN_PROGRESS
                && held.as_slice() == nonce.as_slice()
                && record.fingerprint == *fingerprint
            {
                // Read back after a lost reply: the lapse is no longer known.
                return claimed(generation, None);
            }
            Ok(Some(ClaimOutcome::Existing(record)))
        }
        _ => Err(corrupt(CorruptRow("unknown claim outcome"))),
    }
}

/// The columns of a completion: state, status, headers, body, trailers.
type CompletionColumns<'a> = (i16, i16, Option<Vec<u8>>, Option<&'a [u8]>, Option<Vec<u8>>);

fn completion_columns(completion: &Completion) -> CompletionColumns<'_> {
    match completion {
        Completion::Response(r) => (
            RESPONSE,
            r.status.as_u16() as i16,
            Some(encode_headers(&r.headers)),
            Some(r.body.as_ref()),
            r.trailers.as_ref().map(encode_headers),
        ),
        Completion::Tombstone { status } => (TOMBSTONE, status.as_u16() as i16, None, None, None),
    }
}

/// The complete statement's parameters, shared by `complete` and `complete_in`.
struct CompleteParams<'a> {
    id: &'a [u8],
    generation: i64,
    nonce: &'a [u8],
    columns: CompletionColumns<'a>,
    ttl: i64,
}

impl<'a> CompleteParams<'a> {
    fn new(id: &'a RecordId, token: &'a Token, completion: &'a Completion, ttl: Duration) -> Self {
        let (generation, nonce) = token_params(token);
        Self {
            id: id.as_bytes().as_slice(),
            generation,
            nonce,
            columns: completion_columns(completion),
            ttl: micros(ttl),
        }
    }

    /// $1 id, $2 generation, $3 nonce, $4 state, $5 status, $6 headers, $7 body,
    /// $8 trailers, $9 ttl µs.
    fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        let (state, status, headers, body, trailers) = &self.columns;
        [
            &self.id,
            &self.generation,
            &self.nonce,
            state,
            status,
            headers,
            body,
            trailers,
            &self.ttl,
        ]
    }
}

fn token_params(token: &Token) -> (i64, &[u8]) {
    // Stored generations are positive `bigint`s: a token beyond them matches no row.
    let generation = i64::try_from(token.generation()).unwrap_or(-1);
    (generation, token.nonce().as_slice())
}

impl PostgresStore {
    /// A store on `pool`, in the table `idempotency_records`. Does no I/O.
    ///
    /// Each operation borrows a connection for one statement and returns it at once.
    pub fn new(pool: Pool) -> Self {
        let table = Table::parse(DEFAULT_TABLE).expect("the default table name is valid");
        Self::with_parts(pool, None, table, DEFAULT_TIMEOUT)
    }

    fn with_parts(pool: Pool, config: Option<Arc<Owned>>, table: Table, timeout: Duration) -> Self {
        Self {
            sql: Arc::new(Sql::new(&table)),
            table: Arc::new(table),
            pool,
            config,
            timeout,
            retries: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The pool `connect` makes: 16 connections, each with the server-side timeouts for
    /// `timeout` (see [`server_timeouts`]). Does no I/O.
    fn owned_pool(owned: &Owned, timeout: Duration) -> Result<Pool, StoreError> {
        let mut config = owned.config.clone();
        let options = timeout_options(config.get_options(), timeout);
        config.options(options);
        let manager_config = deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        };
        let manager = match &owned.tls {
            Tls::None => deadpool_postgres::Manager::from_config(
                config,
                tokio_postgres::NoTls,
                manager_config,
            ),
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls(tls) => {
                deadpool_postgres::Manager::from_config(config, tls.clone(), manager_config)
            }
        };
        Pool::builder(manager)
            .max_size(16)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(DEFAULT_TIMEOUT))
            .build()
            .map_err(|e| StoreError::with_source(StoreErrorKind::Other, e))
    }

    /// Connects to `url` (a `postgres://` URL or a key-value string) with a pool of 16
    /// connections, and checks that one connection opens.
    ///
    /// TLS: with the `postgres-tls` feature, connections use rustls as the URL's `sslmode`
    /// says, with libpq's meaning: `disable` (plaintext), `prefer` (the default: TLS when the
    /// server offers it) or `require` (TLS or no connection). As in libpq, these modes
    /// encrypt but do not verify the server's certificate, so they work with any server
    /// (self-signed, a managed service's private CA) and stop eavesdroppers, not an active
    /// man in the middle. To verify the server (libpq's `verify-full`), use
    /// [`connect_with_tls`](Self::connect_with_tls) with the CA that signed its certificate.
    /// Without the feature connections are plaintext: `prefer` falls back to plaintext and
    /// `require` fails.
    ///
    /// The connections' `application_name` is `tower-idempotency` unless the URL sets one.
    /// Their `statement_timeout` and `lock_timeout` sit just below the store's
    /// [timeout](Self::with_timeout), so the server ends a blocked statement itself, and TCP
    /// keepalives notice a dead peer within about a minute.
    /// For other pool settings, build a [`Pool`] and use [`PostgresStore::new`].
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        #[cfg(feature = "postgres-tls")]
        let tls = Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(
            encrypt_only_config(),
        ));
        #[cfg(not(feature = "postgres-tls"))]
        let tls = Tls::None;
        Self::connect_owned(url, tls).await
    }

    /// Like [`connect`](Self::connect), with your rustls configuration, which verifies the
    /// server's certificate and host name against your root certificates (a private CA such
    /// as a managed service's bundle), and may carry a client certificate. `sslmode` in the
    /// URL still decides whether TLS is used: give `require`, so that no connection falls
    /// back to plaintext.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::postgres::{rustls, PostgresStore};
    ///
    /// let ca = std::fs::read("/etc/ssl/private-ca.der")?;
    /// let mut roots = rustls::RootCertStore::empty();
    /// roots.add(ca.into())?;
    /// let tls = rustls::ClientConfig::builder()
    ///     .with_root_certificates(roots)
    ///     .with_no_client_auth();
    /// let store = PostgresStore::connect_with_tls(
    ///     "postgres://app@db.internal/app?sslmode=require",
    ///     tls,
    /// )
    /// .await?;
    /// # drop(store); Ok(()) }
    /// ```
    #[cfg(feature = "postgres-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
    pub async fn connect_with_tls(
        url: &str,
        tls: rustls::ClientConfig,
    ) -> Result<Self, SetupError> {
        let tls = Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(tls));
        Self::connect_owned(url, tls).await
    }

    async fn connect_owned(url: &str, tls: Tls) -> Result<Self, SetupError> {
        let mut config: tokio_postgres::Config = url.parse().map_err(SetupError::Url)?;
        if config.get_application_name().is_none() {
            config.application_name("tower-idempotency");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_TIMEOUT);
        }
        config
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(KEEPALIVE_INTERVAL)
            .keepalives_retries(KEEPALIVE_RETRIES);
        let owned = Owned { config, tls };
        // Building a pool only fails for a broken runtime setup, which a test would catch.
        let pool = Self::owned_pool(&owned, DEFAULT_TIMEOUT)
            .expect("a deadpool pool with the tokio runtime builds");
        drop(pool.get().await.map_err(SetupError::Connect)?);
        let table = Table::parse(DEFAULT_TABLE).expect("the default table name is valid");
        Ok(Self::with_parts(
            pool,
            Some(Arc::new(owned)),
            table,
            DEFAULT_TIMEOUT,
        ))
    }

    /// Uses the table `name`: `table` or `schema.table`, each a lowercase SQL identifier
    /// (`[a-z_][a-z0-9_]*`; at most 48 bytes for the table, 63 for the schema).
    ///
    /// Names are validated, not escaped: anything else is refused.
    pub fn with_table(self, name: &str) -> Result<Self, ConfigError> {
        let table = Table::parse(name)?;
        Ok(Self::with_parts(
            self.pool,
            self.config,
            table,
            self.timeout,
        ))
    }

    /// Bounds each operation to `timeout` (default 5 s): pool checkout, statement, retries
    /// and read-back together, one deadline per operation.
    ///
    /// A statement still running when a write's first attempt runs out (at two thirds of
    /// `timeout`) is cancelled on the server and has an unknown outcome; the store reads it
    /// back on a fresh connection in the time left (see the [module docs](self)).
    ///
    /// On a store from [`connect`](Self::connect) this also sets the connections'
    /// `statement_timeout` to half of `timeout` and `lock_timeout` to two fifths, so the
    /// server ends a blocked statement first, as a known failure
    /// ([`StoreErrorKind::Unavailable`]); the pool is rebuilt for that (no I/O). On your own
    /// pool ([`new`](Self::new)), set them yourself the same way, e.g. with the connection
    /// option `-c statement_timeout=2500 -c lock_timeout=2000` for the default 5 s.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        if let Some(config) = &self.config {
            match Self::owned_pool(config, timeout) {
                Ok(pool) => self.pool = pool,
                // Only a broken runtime setup fails here; the old pool still works.
                Err(e) => tracing::warn!(
                    error = &e as &dyn StdError,
                    "could not rebuild the postgres pool with the new timeouts"
                ),
            }
        }
        self
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

    /// Creates the table and its index if they do not exist.
    ///
    /// Idempotent, and safe when many processes run it at once: it takes a transaction-level
    /// advisory lock first, and still treats a lost creation race (SQLSTATE `42P07`, `42710`,
    /// or `23505` on the catalog) as done and checks again. The schema must exist.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let client = self.setup_client().await?;
            // One simple-query message: the statements run in one implicit transaction.
            let Err(e) = client.batch_execute(&self.sql.migrate).await else {
                return Ok(());
            };
            let race = e.code().is_some_and(|c| {
                *c == SqlState::DUPLICATE_TABLE
                    || *c == SqlState::DUPLICATE_OBJECT
                    || *c == SqlState::UNIQUE_VIOLATION
                    || *c == SqlState::T_R_SERIALIZATION_FAILURE
                    || *c == SqlState::T_R_DEADLOCK_DETECTED
            });
            if !race || attempt >= MAX_ATTEMPTS {
                if e.code().is_none() {
                    discard(client);
                }
                return Err(SetupError::Migrate {
                    table: self.table.name.clone(),
                    error: e,
                });
            }
            backoff(attempt).await;
        }
    }

    /// A pooled connection for setup, within the timeout.
    async fn setup_client(&self) -> Result<Object, SetupError> {
        timeout_at(Instant::now() + self.timeout, self.pool.get())
            .await
            .unwrap_or(Err(deadpool_postgres::PoolError::Timeout(
                deadpool_postgres::TimeoutType::Wait,
            )))
            .map_err(SetupError::Connect)
    }

    /// Checks, in one statement, that the table exists with every column the store uses and
    /// that this role may read it: call it at start-up (after [`migrate`](Self::migrate), or
    /// instead of it when the table is managed elsewhere), so a missing table is a clear
    /// [`SetupError::MissingTable`] rather than a `503` on every request.
    pub async fn verify(&self) -> Result<(), SetupError> {
        let client = self.setup_client().await?;
        let sql = format!(
            "SELECT id, fingerprint, state, generation, nonce, locked_until, status, headers, \
             body, trailers, created_at, expires_at FROM {} LIMIT 0",
            self.table.quoted
        );
        match client.query(&sql, &[]).await {
            Ok(_) => Ok(()),
            Err(e)
                if e.code() == Some(&SqlState::UNDEFINED_TABLE)
                    || e.code() == Some(&SqlState::INVALID_SCHEMA_NAME) =>
            {
                Err(SetupError::MissingTable {
                    table: self.table.name.clone(),
                })
            }
            Err(e) => Err(SetupError::Table {
                table: self.table.name.clone(),
                error: e,
            }),
        }
    }

    /// Deletes expired records in batches of 1000 until none is left, and returns how many
    /// went. Never deletes an in-progress record whose lease is live, even past `expires_at`.
    ///
    /// Each batch is its own short statement; rows a claim is replacing right now are
    /// skipped, not waited for.
    pub async fn delete_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let rows = self.run(&self.sql.sweep, &[&SWEEP_BATCH], true).await?;
            total += rows.len() as u64;
            if (rows.len() as i64) < SWEEP_BATCH {
                return Ok(total);
            }
        }
    }

    /// Runs [`delete_expired`](Self::delete_expired) every `every` (at least 1 ms) on a tokio
    /// task, until the handle is dropped or aborted. Failures are logged and retried at the
    /// next tick.
    ///
    /// One sweeper per table is enough; more only repeat the work (safely).
    #[must_use = "the sweeper stops when its handle is dropped"]
    pub fn spawn_sweeper(&self, every: Duration) -> SweeperHandle {
        let store = self.clone();
        let every = every.max(Duration::from_millis(1));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match store.delete_expired().await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(deleted = n, "swept expired idempotency records"),
                    Err(e) => {
                        tracing::warn!(error = &e as &dyn StdError, "idempotency sweep failed")
                    }
                }
            }
        });
        SweeperHandle { task: Some(task) }
    }

    /// Takes the row lock of `token`'s record in your transaction, for
    /// [`complete_in`](Self::complete_in) under `REPEATABLE READ` or `SERIALIZABLE`: call it
    /// as the transaction's first statement. Until you commit or roll back, lease renewals and
    /// takeovers of the record wait (a renewal that waits past its deadline fails, and the
    /// next one is tried); keep the transaction shorter than the lease.
    ///
    /// Fenced like [`complete`](IdempotencyStore::complete): a stale token is
    /// [`StoreErrorKind::Fenced`]. Not needed under `READ COMMITTED`.
    pub async fn lock_in<C>(
        &self,
        client: &C,
        id: &RecordId,
        token: &Token,
    ) -> Result<(), StoreError>
    where
        C: GenericClient,
    {
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 3] = [&id.as_bytes().as_slice(), &generation, &nonce];
        let statement = client
            .prepare_cached(&self.sql.lock)
            .await
            .map_err(refused)?;
        let rows = client.query(&statement, &params).await.map_err(refused)?;
        if rows.is_empty() {
            Err(StoreError::new(StoreErrorKind::Fenced))
        } else {
            Ok(())
        }
    }

    /// Records `response` as the answer of the request `ctx` belongs to, through `client`,
    /// typically inside your own transaction: [`complete_in`](Self::complete_in) with the
    /// context's record id, token and TTL, and the headers the layer would keep
    /// ([`IdempotencyContext::completion`](crate::IdempotencyContext::completion)).
    ///
    /// Call it last before `COMMIT`, return `response` from the handler, and mark it with
    /// [`RecordDecision::AlreadyRecorded`](crate::RecordDecision::AlreadyRecorded).
    pub async fn record_in<C>(
        &self,
        client: &C,
        ctx: &crate::IdempotencyContext,
        response: &http::Response<bytes::Bytes>,
    ) -> Result<(), StoreError>
    where
        C: GenericClient,
    {
        let completion = ctx.completion(response);
        self.complete_in(
            client,
            &ctx.record_id(),
            &ctx.token(),
            &completion,
            ctx.ttl(),
        )
        .await
    }

    /// Completes `token`'s claim through `client`, typically inside your own transaction, so
    /// the recorded answer commits with your writes or not at all.
    ///
    /// Fenced like [`complete`](IdempotencyStore::complete): a stale token is
    /// [`StoreErrorKind::Fenced`] and writes nothing (roll back then). Not retried: a
    /// serialization failure aborts your transaction, and is [`StoreErrorKind::Unavailable`]
    /// with the driver error as source; retry the whole transaction.
    ///
    /// The statement row-locks the record until you commit, so a takeover (and the layer's
    /// lease renewal) waits for your outcome: call it last, just before `COMMIT`. After a
    /// commit, `extend` and `release` with this token are fenced, and `complete` answers `Ok`
    /// (the answer is recorded already). Under `REPEATABLE READ` or `SERIALIZABLE`, call
    /// [`lock_in`](Self::lock_in) first, or a renewal during the transaction makes this fail
    /// with a serialization failure.
    pub async fn complete_in<C>(
        &self,
        client: &C,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        C: GenericClient,
    {
        let owned = CompleteParams::new(id, token, completion, ttl);
        let params = owned.params();
        let statement = client
            .prepare_cached(&self.sql.complete)
            .await
            .map_err(refused)?;
        let row = client
            .query_one(&statement, &params)
            .await
            .map_err(refused)?;
        if column::<bool>(&row, "applied")? || column::<bool>(&row, "done")? {
            Ok(())
        } else {
            Err(StoreError::new(StoreErrorKind::Fenced))
        }
    }

    /// A fresh read of the live row: `(held by token, state)`, or `None` when absent. Run
    /// before answering `Fenced`: a write's own snapshot can predate a commit it then waited
    /// for (a first attempt whose reply was lost, committing late).
    async fn held(
        &self,
        id: &RecordId,
        token: &Token,
        end: Instant,
    ) -> Result<Option<(bool, i16)>, StoreError> {
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 3] = [&id.as_bytes().as_slice(), &generation, &nonce];
        // Within what is left of the calling operation's deadline.
        let mut attempts = Attempts::new(self, true);
        attempts.end = end;
        let rows = loop {
            let deadline = attempts.deadline()?;
            match self.attempt(&self.sql.held, &params, deadline).await {
                Ok(rows) => break rows,
                Err(f) => attempts.after(f).await?,
            }
        };
        rows.first()
            .map(|row| Ok((column(row, "mine")?, column(row, "state")?)))
            .transpose()
    }

    /// One attempt: a pooled connection, the cached statement, within the timeout.
    async fn attempt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        deadline: Instant,
    ) -> Result<Vec<Row>, Failure> {
        let client = match timeout_at(deadline, self.pool.get()).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                return Err(Failure::Down {
                    error: e.into(),
                    sent: false,
                })
            }
            Err(e) => {
                return Err(Failure::Down {
                    error: e.into(),
                    sent: false,
                })
            }
        };
        // Preparing has no effect on the data, so a failure here is never "unknown".
        let statement = match timeout_at(deadline, client.prepare_cached(sql)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let failure = classify(e, false);
                if matches!(failure, Failure::Down { .. }) {
                    discard(client);
                }
                return Err(failure);
            }
            Err(e) => {
                discard(client);
                return Err(Failure::Down {
                    error: e.into(),
                    sent: false,
                });
            }
        };
        match timeout_at(deadline, client.query(&statement, params)).await {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => {
                let failure = classify(e, true);
                if matches!(failure, Failure::Down { .. }) {
                    discard(client);
                }
                Err(failure)
            }
            Err(e) => {
                // The statement may still be running, or waiting on a lock: cancel it on the
                // server (on a connection of its own, in the background, so this operation
                // keeps its deadline), and never reuse this connection.
                let cancel = client.cancel_token();
                // The cancel request goes as the connection went: over TLS when it did.
                let tls = self.config.as_ref().map_or(Tls::None, |o| o.tls.clone());
                tokio::spawn(async move {
                    let sent = match tls {
                        Tls::None => cancel.cancel_query(tokio_postgres::NoTls).await,
                        #[cfg(feature = "postgres-tls")]
                        Tls::Rustls(tls) => cancel.cancel_query(tls).await,
                    };
                    if let Err(e) = sent {
                        tracing::debug!(error = %e, "could not cancel a timed-out statement");
                    }
                });
                discard(client);
                Err(Failure::Down {
                    error: e.into(),
                    sent: true,
                })
            }
        }
    }

    /// Runs a statement with the retry policy. `idempotent`: a read, or a write whose
    /// outcome does not matter once lost (a sweep); its lost reply is `Unavailable`.
    async fn run(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        idempotent: bool,
    ) -> Result<Vec<Row>, StoreError> {
        let mut attempts = Attempts::new(self, idempotent);
        loop {
            let deadline = attempts.deadline()?;
            match self.attempt(sql, params, deadline).await {
                Ok(rows) => return Ok(rows),
                Err(f) => attempts.after(f).await?,
            }
        }
    }
}

#[async_trait]
impl IdempotencyStore for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn claim(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        // Our nonce, chosen before sending: it is how a read-back recognises our claim.
        let nonce = *Token::generate(0)?.nonce();
        let (lease, ttl) = (micros(lease), micros(ttl));
        let params: [&(dyn ToSql + Sync); 5] = [
            &id.as_bytes().as_slice(),
            &fingerprint.as_bytes().as_slice(),
            &nonce.as_slice(),
            &lease,
            &ttl,
        ];
        let mut attempts = Attempts::new(self, false);
        loop {
            let deadline = attempts.deadline()?;
            match self.attempt(&self.sql.claim, &params, deadline).await {
                Ok(rows) => match decode_claim(&rows, fingerprint, &nonce)? {
                    Some(outcome) => return Ok(outcome),
                    None => attempts.again()?,
                },
                Err(f) => attempts.after(f).await?,
            }
        }
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        // Repeating an extend is harmless: its answer is right either way.
        let (generation, nonce) = token_params(token);
        let lease = micros(lease);
        let params: [&(dyn ToSql + Sync); 4] =
            [&id.as_bytes().as_slice(), &generation, &nonce, &lease];
        let rows = self.run(&self.sql.extend, &params, false).await?;
        if rows.is_empty() {
            return Err(StoreError::new(StoreErrorKind::Fenced));
        }
        Ok(())
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let owned = CompleteParams::new(id, token, completion, ttl);
        let params = owned.params();
        let mut attempts = Attempts::new(self, false);
        loop {
            let deadline = attempts.deadline()?;
            match self.attempt(&self.sql.complete, &params, deadline).await {
                Ok(rows) => {
                    let row = rows
                        .first()
                        .ok_or_else(|| corrupt(CorruptRow("complete returned no row")))?;
                    let applied: bool = column(row, "applied")?;
                    // Completed with our token already: a resend, or our lost first attempt
                    // committed. Either way our answer is stored.
                    let done: bool = column(row, "done")?;
                    if applied || done {
                        return Ok(());
                    }
                    return match self.held(id, token, attempts.end).await? {
                        Some((true, state)) if state != IN_PROGRESS => Ok(()),
                        _ => Err(StoreError::new(StoreErrorKind::Fenced)),
                    };
                }
                Err(f) => attempts.after(f).await?,
            }
        }
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 3] = [&id.as_bytes().as_slice(), &generation, &nonce];
        let mut attempts = Attempts::new(self, false);
        loop {
            let deadline = attempts.deadline()?;
            match self.attempt(&self.sql.release, &params, deadline).await {
                Ok(rows) => {
                    let row = rows
                        .first()
                        .ok_or_else(|| corrupt(CorruptRow("release returned no row")))?;
                    let applied: bool = column(row, "applied")?;
                    // Gone already: an earlier attempt deleted it, or it expired; the key is
                    // free either way.
                    let present: bool = column(row, "present")?;
                    if applied || !present {
                        return Ok(());
                    }
                    return match self.held(id, token, attempts.end).await? {
                        None => Ok(()),
                        Some(_) => Err(StoreError::new(StoreErrorKind::Fenced)),
                    };
                }
                Err(f) => attempts.after(f).await?,
            }
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let rows = self
            .run(&self.sql.get, &[&id.as_bytes().as_slice()], true)
            .await?;
        rows.first().map(decode_record).transpose()
    }
}

impl PostgresStore {
    /// One conditional delete; a lost reply is `Unavailable` (read back with `inspect`).
    async fn remove(&self, id: &RecordId, completed: bool) -> Result<super::Removal, StoreError> {
        let rows = self
            .run(
                &self.sql.remove,
                &[&id.as_bytes().as_slice(), &completed],
                true,
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("remove returned no row"))?;
        let (removed, present): (bool, bool) = (column(row, "removed")?, column(row, "present")?);
        Ok(match (removed, present) {
            (true, _) => super::Removal::Removed,
            (false, true) => super::Removal::Refused,
            (false, false) => super::Removal::Absent,
        })
    }
}

#[async_trait]
impl super::IdempotencyAdmin for PostgresStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<super::RecordInfo>, StoreError> {
        let rows = self
            .run(&self.sql.inspect, &[&id.as_bytes().as_slice()], true)
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let record = decode_record(row)?;
        let us: i64 = column(row, "expires_us")?;
        let expires_in = Duration::from_micros(u64::try_from(us).unwrap_or(0));
        Ok(Some(super::RecordInfo::new(&record, expires_in)))
    }

    async fn force_release(&self, id: &RecordId) -> Result<super::Removal, StoreError> {
        self.remove(id, false).await
    }

    async fn delete(&self, id: &RecordId) -> Result<super::Removal, StoreError> {
        self.remove(id, true).await
    }
}

/// Stops the sweeper of [`PostgresStore::spawn_sweeper`] when dropped or aborted.
#[derive(Debug)]
pub struct SweeperHandle {
    /// `None` only after [`stop`](Self::stop) took it.
    task: Option<JoinHandle<()>>,
}

impl SweeperHandle {
    /// Stops the sweeper at its next await point.
    pub fn abort(&self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }

    /// Stops the sweeper and waits until its task has ended.
    pub async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // A cancelled task ends with a cancellation error: the expected end.
            let _ = task.await;
        }
    }
}

impl Drop for SweeperHandle {
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers_or_schema_qualified() {
        for ok in ["records", "_r", "app.records", "s1.t_2", "user", "a.order"] {
            assert!(Table::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a.b.c",
            "Records",
            "1abc",
            "a-b",
            "a b",
            "r\"; DROP TABLE x; --",
            "a;b",
            "é",
            &"x".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(Table::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Table::parse(&"x".repeat(MAX_TABLE_LEN)).is_ok());
        let t = Table::parse("app.records").unwrap();
        assert_eq!(t.quoted, "\"app\".\"records\"");
        assert_eq!(t.index, "\"records_expires_at_idx\"");
        assert_ne!(t.lock_key, Table::parse("records").unwrap().lock_key);
    }

    #[test]
    fn durations_are_bounded_microseconds() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::from_nanos(999)), 0);
        assert_eq!(micros(Duration::MAX), MAX_MICROS);
    }

    #[test]
    fn headers_columns_round_trip_and_reject_unknown_formats() {
        let mut h = HeaderMap::new();
        h.append("link", "<a>".parse().unwrap());
        h.append("link", "<b>".parse().unwrap());
        assert_eq!(decode_headers(encode_headers(&h)).unwrap(), h);
        let mut v2 = encode_headers(&h);
        v2[0] = 2;
        assert_eq!(
            decode_headers(v2).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        assert!(decode_headers(Vec::new()).is_err());
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
        let store = PostgresStore::connect(&url)
            .await
            .unwrap()
            .with_table(&table)
            .unwrap();
        store.migrate().await.unwrap();
        crate::store::equal_nonces_with_different_fingerprints_claim_once(&store).await;
        let client = store.pool().get().await.unwrap();
        client
            .batch_execute(&format!("DROP TABLE {table}"))
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
        crate::record::FAIL_RANDOM.with(|f| f.set(true));
        let r = store
            .claim(&id, &fp, Duration::from_secs(1), Duration::from_secs(1))
            .await;
        crate::record::FAIL_RANDOM.with(|f| f.set(false));
        let e = r.unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Unavailable);
        let cause = StdError::source(&e).unwrap().to_string();
        assert!(cause.contains("random"), "{cause}");
    }
}
