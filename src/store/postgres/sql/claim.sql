-- Claim a record: one statement, one round trip, reading before it writes.
--
-- $1 id, $2 fingerprint, $3 nonce, $4 lease µs, $5 ttl µs, $6 scope, $7 most records,
-- $8 most bytes ($6 to $8 NULL when quotas are off).
--
-- Always one row. The join reads the row by its primary key: a completed record or a live
-- lease (a replay, a conflict, a mismatch, or our own claim read back after a lost reply) is
-- the answer, in the record's columns, and `claimed` is NULL: the CASE never calls the
-- function, so a replay is one index lookup, writes nothing, and sets up no more than this
-- plan (no insert, no table-function scan). Otherwise (absent, expired, or a lapsed lease
-- with the same fingerprint) the record's columns are NULL and `claimed` is the answer of
-- the function claim_function.sql defines, one record of its result columns.
--
-- The record's columns are the store's to interpret: `lease_us` (the lease left, by the
-- database's clock) is negative once the lease lapsed and means nothing for a completed
-- record, and `recovery_point` counts only for a record in progress.
SELECT r.generation, r.nonce, r.fingerprint, r.state,
       (EXTRACT(EPOCH FROM r.locked_until - statement_timestamp()) * 1000000)::bigint
           AS lease_us,
       r.status, r.headers, r.body, r.trailers, r.recovery_point,
       CASE WHEN r.id IS NULL
            THEN {function}($1::bytea, $2::bytea, $3::bytea, $4::bigint, $5::bigint, $6::bytea,
                            $7::bigint, $8::bigint)
       END AS claimed
  FROM (SELECT) AS one
  LEFT JOIN {table} AS r
    ON r.id = $1::bytea
   AND NOT {expired}
   AND NOT (r.state = 0 AND r.locked_until <= statement_timestamp()
            AND r.fingerprint = $2::bytea)
