//! [`Executor`]: the connections and transactions the `*_in` methods of [`PostgresStore`]
//! run their statement through.

#[cfg(doc)]
use super::PostgresStore;

/// A connection or transaction of yours that [`PostgresStore::record_in`],
/// [`complete_in`](PostgresStore::complete_in), [`lock_in`](PostgresStore::lock_in) and
/// [`save_recovery_point_in`](PostgresStore::save_recovery_point_in) send their statement
/// through, so it commits or rolls back with your own writes.
///
/// Implemented for:
///
/// - tokio-postgres: `&Client` and `&Transaction<'_>`;
/// - deadpool-postgres: `&Client` (a pooled connection) and `&Transaction<'_>`, which use
///   deadpool's statement cache (tokio-postgres prepares the statement on each call: one
///   more round trip);
/// - sqlx, with the `sqlx` feature: `&mut PgConnection` and `&mut Transaction<'_, Postgres>`
///   (for a `PoolConnection<Postgres>`, pass `&mut *conn`). sqlx caches the statement per
///   connection.
///
/// deadpool's own `GenericClient` is not enough: it covers deadpool's types only (not
/// tokio-postgres's `Client` or `Transaction`), and a trait of another crate cannot be
/// implemented for sqlx's types. Hence this one.
///
/// Sealed: its methods are the store's, and a new driver is added here. Pass references,
/// as you would to the driver's own query methods:
///
/// ```no_run
/// # use tower_idempotency::store::postgres::{deadpool_postgres, PostgresStore};
/// # use tower_idempotency::IdempotencyContext;
/// # type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// async fn with_deadpool(
///     store: &PostgresStore,
///     pool: &deadpool_postgres::Pool,
///     ctx: &IdempotencyContext,
/// ) -> Result<(), BoxError> {
///     let mut conn = pool.get().await?;
///     let tx = conn.transaction().await?;
///     tx.execute("INSERT INTO charges (id) VALUES ('ch_1')", &[]).await?;
///     store.save_recovery_point_in(&tx, ctx, "charged", "ch_1").await?;
///     tx.commit().await?;
///     Ok(())
/// }
///
/// # #[cfg(feature = "sqlx")]
/// async fn with_sqlx(
///     store: &PostgresStore,
///     pool: &sqlx::PgPool,
///     ctx: &IdempotencyContext,
/// ) -> Result<(), BoxError> {
///     let mut tx = pool.begin().await?;
///     sqlx::query("INSERT INTO charges (id) VALUES ('ch_1')").execute(&mut *tx).await?;
///     store.save_recovery_point_in(&mut tx, ctx, "charged", "ch_1").await?;
///     tx.commit().await?;
///     Ok(())
/// }
/// ```
#[cfg_attr(
    not(feature = "sqlx"),
    diagnostic::on_unimplemented(
        message = "`{Self}` is not a connection or transaction the Postgres store can write through",
        note = "sqlx's `&mut PgConnection` and `&mut Transaction<'_, Postgres>` need the `sqlx` feature of tower-idempotency",
        note = "tokio-postgres's and deadpool-postgres's `&Client` and `&Transaction<'_>` work without it"
    )
)]
#[cfg_attr(
    feature = "sqlx",
    diagnostic::on_unimplemented(
        message = "`{Self}` is not a connection or transaction the Postgres store can write through",
        note = "pass `&Client` or `&Transaction<'_>` (tokio-postgres, deadpool-postgres), or `&mut PgConnection` or `&mut Transaction<'_, Postgres>` (sqlx; `&mut *tx` and `&mut *conn` reach them)"
    )
)]
pub trait Executor: sealed::Sealed {}

impl<T: sealed::Sealed> Executor for T {}

pub(super) mod sealed {
    use std::future::Future;

    use tokio_postgres::types::{ToSql, Type};

    use crate::store::StoreError;

    /// What a statement returned, from either driver.
    #[derive(Debug)]
    pub enum Rows {
        Tokio(Vec<tokio_postgres::Row>),
        #[cfg(feature = "sqlx")]
        Sqlx(Vec<sqlx::postgres::PgRow>),
    }

    /// How the store runs one statement through a caller's connection. The same diagnostic
    /// as `Executor`'s: a type that is not one is reported against this trait.
    #[cfg_attr(
        not(feature = "sqlx"),
        diagnostic::on_unimplemented(
            message = "`{Self}` is not a connection or transaction the Postgres store can write through",
            note = "sqlx's `&mut PgConnection` and `&mut Transaction<'_, Postgres>` need the `sqlx` feature of tower-idempotency",
            note = "tokio-postgres's and deadpool-postgres's `&Client` and `&Transaction<'_>` work without it"
        )
    )]
    #[cfg_attr(
        feature = "sqlx",
        diagnostic::on_unimplemented(
            message = "`{Self}` is not a connection or transaction the Postgres store can write through",
            note = "pass `&Client` or `&Transaction<'_>` (tokio-postgres, deadpool-postgres), or `&mut PgConnection` or `&mut Transaction<'_, Postgres>` (sqlx; `&mut *tx` and `&mut *conn` reach them)"
        )
    )]
    pub trait Sealed: Send {
        /// Runs `sql` with `params`, whose Postgres types are `types` (the casts of the
        /// statement's `$n`: sqlx sends them, tokio-postgres infers them from the SQL).
        fn query(
            self,
            sql: &str,
            params: &[&(dyn ToSql + Sync)],
            types: &[Type],
        ) -> impl Future<Output = Result<Rows, StoreError>> + Send;
    }
}

use sealed::{Rows, Sealed};
use tokio_postgres::types::{ToSql, Type};

use super::retry::refused;
use super::rows::column;
use crate::store::StoreError;

impl Rows {
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Rows::Tokio(rows) => rows.is_empty(),
            #[cfg(feature = "sqlx")]
            Rows::Sqlx(rows) => rows.is_empty(),
        }
    }

    /// The `bool` column `name` of the first row.
    pub(super) fn first_bool(&self, name: &str) -> Result<bool, StoreError> {
        let none =
            || super::rows::corrupt(super::rows::CorruptRow("the statement returned no row"));
        match self {
            Rows::Tokio(rows) => column(rows.first().ok_or_else(none)?, name),
            #[cfg(feature = "sqlx")]
            Rows::Sqlx(rows) => {
                use sqlx::Row as _;
                let row = rows.first().ok_or_else(none)?;
                row.try_get::<bool, _>(name).map_err(super::rows::corrupt)
            }
        }
    }
}

impl Sealed for &tokio_postgres::Client {
    async fn query(
        self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        _: &[Type],
    ) -> Result<Rows, StoreError> {
        let rows = tokio_postgres::Client::query(self, sql, params)
            .await
            .map_err(refused)?;
        Ok(Rows::Tokio(rows))
    }
}

impl Sealed for &tokio_postgres::Transaction<'_> {
    async fn query(
        self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        _: &[Type],
    ) -> Result<Rows, StoreError> {
        let rows = tokio_postgres::Transaction::query(self, sql, params)
            .await
            .map_err(refused)?;
        Ok(Rows::Tokio(rows))
    }
}

/// Through deadpool's statement cache: prepared once per connection.
async fn cached<C: deadpool_postgres::GenericClient>(
    client: &C,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Rows, StoreError> {
    let statement = client.prepare_cached(sql).await.map_err(refused)?;
    let rows = client.query(&statement, params).await.map_err(refused)?;
    Ok(Rows::Tokio(rows))
}

impl Sealed for &deadpool_postgres::Client {
    async fn query(
        self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        _: &[Type],
    ) -> Result<Rows, StoreError> {
        cached(self, sql, params).await
    }
}

impl Sealed for &deadpool_postgres::Transaction<'_> {
    async fn query(
        self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        _: &[Type],
    ) -> Result<Rows, StoreError> {
        cached(self, sql, params).await
    }
}

#[cfg(feature = "sqlx")]
mod with_sqlx {
    use bytes::BytesMut;
    use sqlx::encode::IsNull;
    use sqlx::error::BoxDynError;
    use sqlx::postgres::types::Oid;
    use sqlx::postgres::{PgArgumentBuffer, PgConnection, PgTypeInfo, Postgres};
    use tokio_postgres::types::{ToSql, Type};

    use super::{Rows, Sealed};
    use crate::store::{StoreError, StoreErrorKind};

    /// A parameter as tokio-postgres encodes it, bound to a sqlx query. Both drivers send
    /// Postgres's binary format, so sqlx gets the very bytes tokio-postgres would send, from
    /// the same parameter list (`CompleteParams` and the others), under the type of the
    /// statement's cast.
    struct Param<'a> {
        value: &'a (dyn ToSql + Sync),
        ty: &'a Type,
    }

    impl sqlx::Type<Postgres> for Param<'_> {
        fn type_info() -> PgTypeInfo {
            // Never used: every value says its type (`produces`).
            PgTypeInfo::with_oid(Oid(Type::BYTEA.oid()))
        }
    }

    impl<'q> sqlx::Encode<'q, Postgres> for Param<'_> {
        fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
            let mut out = BytesMut::new();
            match self.value.to_sql_checked(self.ty, &mut out)? {
                tokio_postgres::types::IsNull::Yes => Ok(IsNull::Yes),
                tokio_postgres::types::IsNull::No => {
                    buf.extend_from_slice(&out);
                    Ok(IsNull::No)
                }
            }
        }

        fn produces(&self) -> Option<PgTypeInfo> {
            Some(PgTypeInfo::with_oid(Oid(self.ty.oid())))
        }
    }

    async fn run(
        conn: &mut PgConnection,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        types: &[Type],
    ) -> Result<Rows, StoreError> {
        debug_assert_eq!(params.len(), types.len(), "a type for each parameter");
        let mut query = sqlx::query(sql);
        for (value, ty) in params.iter().zip(types) {
            query = query.bind(Param { value: *value, ty });
        }
        let rows = query.fetch_all(conn).await.map_err(refused)?;
        Ok(Rows::Sqlx(rows))
    }

    /// The kind of a sqlx error, as `retry::refused` sorts tokio-postgres's: the statement
    /// did not commit.
    fn refused(error: sqlx::Error) -> StoreError {
        let kind = match &error {
            sqlx::Error::Database(e) => match e.code().as_deref() {
                Some("53100") => StoreErrorKind::Full,
                // query_canceled, lock_not_available, too_many_connections,
                // serialization_failure, deadlock_detected, connection exceptions, and
                // operator intervention (a shutdown, a terminated backend).
                Some("57014" | "55P03" | "53300" | "40001" | "40P01") => {
                    StoreErrorKind::Unavailable
                }
                Some(c) if c.starts_with("08") || c.starts_with("57P") => {
                    StoreErrorKind::Unavailable
                }
                _ => StoreErrorKind::Other,
            },
            sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::ColumnIndexOutOfBounds { .. }
            | sqlx::Error::Decode(_) => StoreErrorKind::Corrupt,
            sqlx::Error::Encode(_)
            | sqlx::Error::Configuration(_)
            | sqlx::Error::InvalidArgument(_)
            | sqlx::Error::TypeNotFound { .. } => StoreErrorKind::Other,
            // I/O, TLS, protocol, pool: the connection failed.
            _ => StoreErrorKind::Unavailable,
        };
        StoreError::with_source(kind, error)
    }

    impl Sealed for &mut PgConnection {
        async fn query(
            self,
            sql: &str,
            params: &[&(dyn ToSql + Sync)],
            types: &[Type],
        ) -> Result<Rows, StoreError> {
            run(self, sql, params, types).await
        }
    }

    impl Sealed for &mut sqlx::Transaction<'_, Postgres> {
        async fn query(
            self,
            sql: &str,
            params: &[&(dyn ToSql + Sync)],
            types: &[Type],
        ) -> Result<Rows, StoreError> {
            run(self, sql, params, types).await
        }
    }
}
