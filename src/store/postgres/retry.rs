//! How one operation spends its time and its attempts: retries of serialization failures
//! and lost races, a fresh connection after a failed one, the read-back of a lost reply, and
//! server-side cancel of a statement the store gave up on.

use std::error::Error as StdError;
use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use deadpool_postgres::Object;
use tokio::time::{timeout_at, Instant};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::rows::{column, token_params};
use super::setup::Tls;
use super::PostgresStore;
use crate::store::record::{RecordId, Token};
use crate::store::{StoreError, StoreErrorKind};

// How one operation spends its budget T (`with_timeout`, 5 s by default):
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

/// Attempts per operation, for serialization failures and lost races.
pub(super) const MAX_ATTEMPTS: u32 = 8;

/// Repeats on a fresh connection after a connection failure. Two: a stale pooled connection
/// can fail before the one whose reply was lost, and the read-back still deserves its try.
const MAX_RECONNECTS: u32 = 2;

/// How one attempt failed.
pub(super) enum Failure {
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
pub(super) struct Attempts<'a> {
    store: &'a PostgresStore,
    /// The first attempt ends here, leaving the rest of the budget to a read-back.
    first_by: Instant,
    /// The whole operation ends here, read-back included.
    pub(super) end: Instant,
    made: u32,
    reconnects: u32,
    /// A read, or a write whose repeat needs no read-back: a lost reply is not "unknown".
    idempotent: bool,
    /// Set when an earlier attempt may have committed: every statement resolves it by
    /// reporting whether the row already carries this token.
    uncertain: Option<Box<dyn StdError + Send + Sync>>,
}

impl<'a> Attempts<'a> {
    pub(super) fn new(store: &'a PostgresStore, idempotent: bool) -> Self {
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
    pub(super) fn deadline(&mut self) -> Result<Instant, StoreError> {
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
    pub(super) async fn after(&mut self, failure: Failure) -> Result<(), StoreError> {
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
    pub(super) fn again(&mut self) -> Result<(), StoreError> {
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
pub(super) async fn backoff(attempt: u32) {
    if attempt <= 1 {
        return;
    }
    let cap = 1u64 << attempt.min(6);
    let jitter = u64::from(getrandom::u32().unwrap_or(0)) % (cap + 1);
    tokio::time::sleep(Duration::from_millis(jitter)).await;
}

/// Drops a connection whose state is unknown instead of returning it to the pool.
pub(super) fn discard(client: Object) {
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
pub(super) fn refused(error: tokio_postgres::Error) -> StoreError {
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

impl PostgresStore {
    /// A fresh read of the live row: `(held by token, state)`, or `None` when absent. Run
    /// before answering `Fenced`: a write's own snapshot can predate a commit it then waited
    /// for (a first attempt whose reply was lost, committing late).
    pub(super) async fn held(
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
    pub(super) async fn attempt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        deadline: Instant,
    ) -> Result<Vec<Row>, Failure> {
        let client = match timeout_at(deadline, self.checkout()).await {
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
            Ok(Err(e)) => return Err(self.failed(client, e, false)),
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
            Ok(Err(e)) => Err(self.failed(client, e, true)),
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

    /// A pooled connection opened after the last time one found its server read-only.
    async fn checkout(&self) -> Result<Object, deadpool_postgres::PoolError> {
        loop {
            let client = self.pool.get().await?;
            let stale = self.read_only_since();
            match stale {
                Some(at) if Object::metrics(&client).created <= at => discard(client),
                _ => return Ok(client),
            }
        }
    }

    fn read_only_since(&self) -> Option<std::time::Instant> {
        *self.read_only_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sorts a statement's error, and drops the connection when it is no use any more.
    fn failed(&self, client: Object, e: tokio_postgres::Error, sent: bool) -> Failure {
        if e.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION) {
            // This server no longer takes writes: a standby, or a primary fenced in a
            // failover. So may every connection opened before now be (the pool's idle ones
            // are dropped here, the busy ones when next checked out), and a fresh one finds
            // the writable host (`target_session_attrs=read-write`). The statement wrote
            // nothing: sent again, not read back.
            let now = std::time::Instant::now();
            *self.read_only_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(now);
            self.pool.retain(|_, m| m.created > now);
            discard(client);
            tracing::warn!(
                error = %e,
                "a pooled postgres connection found its server read-only; reconnecting"
            );
            return Failure::Down {
                error: e.into(),
                sent: false,
            };
        }
        let failure = classify(e, sent);
        if matches!(failure, Failure::Down { .. }) {
            discard(client);
        }
        failure
    }

    /// Runs a statement with the retry policy. `idempotent`: a read, or a write whose
    /// outcome does not matter once lost (a sweep); its lost reply is `Unavailable`.
    pub(super) async fn run(
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
