//! Setting the table up: [`migrate`](PostgresStore::migrate) (migrate.sql and
//! claim_function.sql), [`verify`](PostgresStore::verify), and the errors of setup.

use std::error::Error as StdError;
use std::fmt;

use deadpool_postgres::Object;
use tokio::time::{timeout_at, Instant};
use tokio_postgres::error::SqlState;

use super::retry::{backoff, discard, MAX_ATTEMPTS};
use super::PostgresStore;
use crate::store::error_chain as chain;

/// Why a [`PostgresStore`] could not be set up: from [`connect`](PostgresStore::connect),
/// [`migrate`](PostgresStore::migrate) and [`verify`](PostgresStore::verify).
///
/// The text names the cause and what to do; the driver error it came from is kept in the
/// variant (and is part of the text, so it is not repeated as a [`source`](StdError::source)).
/// `Debug` prints the same text as `Display`, so that an error returned from `main` shows the
/// fix, not the variant's fields. Match on the variants to tell them apart.
#[non_exhaustive]
pub enum SetupError {
    /// The URL or connection string did not parse.
    Url(tokio_postgres::Error),
    /// No connection could be opened: nothing listening, refused login, unknown database.
    Connect(deadpool_postgres::PoolError),
    /// The table does not exist (or its schema does not): run
    /// [`migrate`](PostgresStore::migrate).
    MissingTable {
        /// The table, as given to [`with_table`](super::PostgresStoreBuilder::with_table).
        table: String,
    },
    /// [`migrate`](PostgresStore::migrate) could not create the table: its schema does not
    /// exist, or the role may not create it.
    Migrate {
        /// The table, as given to [`with_table`](super::PostgresStoreBuilder::with_table).
        table: String,
        /// What the server (or the connection) said.
        error: tokio_postgres::Error,
    },
    /// The table exists but the store cannot use it: a missing column, no privilege.
    Table {
        /// The table, as given to [`with_table`](super::PostgresStoreBuilder::with_table).
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
                 PostgresStore::migrate() (or the statements it runs: see the store's docs)"
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

impl fmt::Debug for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl StdError for SetupError {}

impl PostgresStore {
    /// Creates the table, its indexes and the claim function if they do not exist, and brings
    /// a table made by an earlier version up to date: the `scope` column and its index, the
    /// `recovery_point` column and its index, and the storage settings (`fillfactor` and
    /// autovacuum, see the [module docs](super)) where the table has none of its own. Run it
    /// after upgrading the crate: the statements use every column.
    ///
    /// Idempotent, and safe when many processes run it at once: it takes a transaction-level
    /// advisory lock first, and still treats a lost creation race (SQLSTATE `42P07`, `42710`,
    /// or `23505` on the catalog) as done and checks again. A table that is up to date takes
    /// no table lock. Adding the scope or recovery index to a large existing table blocks
    /// writes to it while the index builds (the columns are added without a rewrite); to
    /// avoid that, create them first, `CONCURRENTLY`:
    ///
    /// ```sql
    /// CREATE INDEX CONCURRENTLY <table>_scope_idx ON <table> (scope, expires_at)
    ///     WHERE scope IS NOT NULL;
    /// CREATE INDEX CONCURRENTLY <table>_recovery_idx ON <table> (expires_at)
    ///     WHERE recovery_point IS NOT NULL AND state = 0;
    /// ```
    ///
    /// The schema must exist.
    ///
    /// The claim functions are `<table>_claim_v3` and, for claims without a quota,
    /// `<table>_claim_new_v1` (the insert of an absent key). Replicas of the previous version
    /// call `<table>_claim_v3` with every claim, which keeps working (both write the same
    /// rows). Replicas of the version before that call `<table>_claim_v2`, which `migrate`
    /// keeps as a wrapper over `<table>_claim_v3` (the same claim); replicas of the version
    /// before call `<table>_claim`, which is left alone.
    /// So a rolling upgrade keeps them all working. Drop `<table>_claim` once none runs.
    /// (Such a replica ignores the recovery points: it neither clears one when it completes,
    /// releases or replaces a record, nor hands one on.)
    ///
    /// The functions outlive `DROP TABLE`. To remove everything it creates, stop every
    /// replica (one that starts migrates again), then run, with the table's name as given to
    /// [`with_table`](super::PostgresStoreBuilder::with_table) for `<table>`
    /// (`app.records_claim_v3` for `app.records`):
    ///
    /// ```sql
    /// DROP TABLE IF EXISTS <table>;  -- and its indexes
    /// DROP FUNCTION IF EXISTS <table>_claim_v3;
    /// DROP FUNCTION IF EXISTS <table>_claim_v2;
    /// DROP FUNCTION IF EXISTS <table>_claim_new_v1;
    /// DROP FUNCTION IF EXISTS <table>_claim;  -- made by earlier versions
    /// ```
    ///
    /// The server's notices (`relation … already exists, skipping`) are off for its
    /// transaction, so a start against an up-to-date table logs nothing; warnings still come.
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

    /// Checks that the table exists with every column the store uses, that this role may
    /// read it, and that the claim function `migrate` creates is there: call it at
    /// start-up (after [`migrate`](Self::migrate), or instead of it when the table is managed
    /// elsewhere), so a missing table is a clear [`SetupError::MissingTable`] rather than a
    /// `503` on every request.
    pub async fn verify(&self) -> Result<(), SetupError> {
        let client = self.setup_client().await?;
        let checked = match client.query(&self.sql.verify, &[]).await {
            // Preparing the claims resolves the functions they call, without running them.
            Ok(_) => match client.prepare(&self.sql.claim).await {
                Ok(_) => client.prepare(&self.sql.claim_new).await.map(drop),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match checked {
            Ok(()) => Ok(()),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_errors_debug_print_their_text_so_main_shows_the_fix() {
        let driver = || {
            "postgres://[nope"
                .parse::<tokio_postgres::Config>()
                .unwrap_err()
        };
        let table = || "app.idempotency_records".to_owned();
        let cases = [
            (SetupError::Url(driver()), "invalid Postgres URL"),
            (
                SetupError::Connect(deadpool_postgres::PoolError::Timeout(
                    deadpool_postgres::TimeoutType::Wait,
                )),
                "could not connect to Postgres",
            ),
            (
                SetupError::MissingTable { table: table() },
                "create it with PostgresStore::migrate()",
            ),
            (
                SetupError::Migrate {
                    table: table(),
                    error: driver(),
                },
                "could not create the idempotency table app.idempotency_records",
            ),
            (
                SetupError::Table {
                    table: table(),
                    error: driver(),
                },
                "the idempotency table app.idempotency_records cannot be used",
            ),
        ];
        for (err, fix) in cases {
            let debug = format!("{err:?}");
            assert!(debug.contains(fix), "{debug}");
            assert_eq!(debug, err.to_string());
            // What `fn main() -> Result<(), Box<dyn Error>>` prints after "Error: ".
            let boxed: Box<dyn StdError> = Box::new(err);
            assert_eq!(format!("{boxed:?}"), debug);
        }
    }
}
