//! Writing inside your own transaction: [`record_in`](PostgresStore::record_in),
//! [`complete_in`](PostgresStore::complete_in), [`lock_in`](PostgresStore::lock_in) and
//! [`save_recovery_point_in`](PostgresStore::save_recovery_point_in), through any
//! [`Executor`].

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};

use super::executor::Executor;
use super::rows::{token_params, CompleteParams};
use super::PostgresStore;
use crate::store::record::{Completion, RecordId, Token};
use crate::store::{StoreError, StoreErrorKind};

// The Postgres types of each statement's parameters, as its `$n::type` casts name them
// (sqlx sends them with the values; the test below holds them to the `.sql` files).

/// lock.sql: $1 id, $2 generation, $3 nonce.
const LOCK_TYPES: [Type; 3] = [Type::BYTEA, Type::INT8, Type::BYTEA];
/// save_point.sql: $1 id, $2 generation, $3 nonce, $4 the point.
const SAVE_POINT_TYPES: [Type; 4] = [Type::BYTEA, Type::INT8, Type::BYTEA, Type::BYTEA];
/// complete.sql: $1 id, $2 generation, $3 nonce, $4 state, $5 status, $6 headers, $7 body,
/// $8 trailers, $9 ttl µs (`CompleteParams::params`).
const COMPLETE_TYPES: [Type; 9] = [
    Type::BYTEA,
    Type::INT8,
    Type::BYTEA,
    Type::INT2,
    Type::INT2,
    Type::BYTEA,
    Type::BYTEA,
    Type::BYTEA,
    Type::INT8,
];

impl PostgresStore {
    /// Takes the row lock of `token`'s record in your transaction, for
    /// [`complete_in`](Self::complete_in) and
    /// [`save_recovery_point_in`](Self::save_recovery_point_in) under `REPEATABLE READ` or
    /// `SERIALIZABLE`: call it as the transaction's first statement. Until you commit or roll
    /// back, lease renewals and takeovers of the record wait (a renewal that waits past its
    /// deadline fails, and the next one is tried); keep the transaction shorter than the
    /// lease.
    ///
    /// Fenced like [`complete`](crate::store::IdempotencyStore::complete): a stale token is
    /// [`StoreErrorKind::Fenced`]. Not needed under `READ COMMITTED` (Postgres's default):
    /// there each statement sees the latest renewal, and the write itself takes the lock.
    pub async fn lock_in<C>(
        &self,
        client: C,
        id: &RecordId,
        token: &Token,
    ) -> Result<(), StoreError>
    where
        C: Executor,
    {
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 3] = [&id.as_bytes().as_slice(), &generation, &nonce];
        let rows = client.query(&self.sql.lock, &params, &LOCK_TYPES).await?;
        if rows.is_empty() {
            Err(StoreError::new(StoreErrorKind::Fenced))
        } else {
            Ok(())
        }
    }

    /// Completes `token`'s claim through `client`, typically inside your own transaction, so
    /// the recorded answer commits with your writes or not at all.
    ///
    /// Fenced like [`complete`](crate::store::IdempotencyStore::complete): a stale token is
    /// [`StoreErrorKind::Fenced`] and writes nothing (roll back then). Not retried: a
    /// serialization failure aborts your transaction, and is [`StoreErrorKind::Unavailable`]
    /// with the driver error as source; retry the whole transaction.
    ///
    /// The statement row-locks the record until you commit, so a takeover (and the layer's
    /// lease renewal) waits for your outcome: call it last, just before `COMMIT`. After a
    /// commit, `extend` and `release` with this token are fenced, and `complete` with it
    /// answers `Ok` and writes nothing: the answer committed here stands, even when the
    /// layer completes the record again because the response was not marked
    /// [`RecordDecision::AlreadyRecorded`](crate::RecordDecision::AlreadyRecorded). Under
    /// `REPEATABLE READ` or `SERIALIZABLE`, call
    /// [`lock_in`](Self::lock_in) first, or a renewal during the transaction makes this fail
    /// with a serialization failure.
    pub async fn complete_in<C>(
        &self,
        client: C,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        C: Executor,
    {
        let owned = CompleteParams::new(id, token, completion, ttl);
        let params = owned.params();
        let rows = client
            .query(&self.sql.complete, &params, &COMPLETE_TYPES)
            .await?;
        if rows.first_bool("applied")? || rows.first_bool("done")? {
            Ok(())
        } else {
            Err(StoreError::new(StoreErrorKind::Fenced))
        }
    }

    /// The statement of [`save_recovery_point_in`](Self::save_recovery_point_in): saves
    /// `encoded`, a point within the caps, fenced by `token`.
    pub(crate) async fn save_point_in<C>(
        &self,
        client: C,
        id: &RecordId,
        token: &Token,
        encoded: &[u8],
    ) -> Result<(), StoreError>
    where
        C: Executor,
    {
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 4] =
            [&id.as_bytes().as_slice(), &generation, &nonce, &encoded];
        let rows = client
            .query(&self.sql.save_point, &params, &SAVE_POINT_TYPES)
            .await?;
        if rows.is_empty() {
            Err(StoreError::new(StoreErrorKind::Fenced))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::sql::{Sql, Table};

    /// The `$n::type` casts of `sql`, in parameter order.
    fn casts(sql: &str) -> Vec<String> {
        let mut found: Vec<(usize, String)> = Vec::new();
        for (at, _) in sql.match_indices('$') {
            let rest = &sql[at + 1..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let Some(cast) = rest[digits.len()..].strip_prefix("::") else {
                continue;
            };
            let ty: String = cast
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            let n: usize = digits.parse().unwrap();
            match found.iter().find(|(m, _)| *m == n) {
                Some((_, seen)) => assert_eq!(seen, &ty, "${n} is cast two ways"),
                None => found.push((n, ty)),
            }
        }
        found.sort();
        for (i, (n, _)) in found.iter().enumerate() {
            assert_eq!(*n, i + 1, "every parameter is cast");
        }
        found.into_iter().map(|(_, ty)| ty).collect()
    }

    fn names(types: &[Type]) -> Vec<String> {
        types
            .iter()
            .map(|t| match *t {
                Type::BYTEA => "bytea".to_owned(),
                Type::INT8 => "bigint".to_owned(),
                Type::INT2 => "smallint".to_owned(),
                ref other => other.name().to_owned(),
            })
            .collect()
    }

    #[test]
    fn the_parameter_types_are_those_the_statements_cast_to() {
        let sql = Sql::new(&Table::parse("t").unwrap());
        assert_eq!(casts(&sql.lock), names(&LOCK_TYPES));
        assert_eq!(casts(&sql.save_point), names(&SAVE_POINT_TYPES));
        assert_eq!(casts(&sql.complete), names(&COMPLETE_TYPES));
    }
}
