-- Claim a record: one statement, one round trip, reading before it writes.
--
-- $1 id, $2 fingerprint, $3 nonce, $4 lease µs, $5 ttl µs, $6 scope, $7 most records,
-- $8 most bytes ($6 to $8 NULL when quotas are off).
--
-- `cur` reads the row by its primary key. A completed record or a live lease (a replay, a
-- conflict, a mismatch, or our own claim read back after a lost reply) is the answer
-- (outcome 2), and the function that writes is never called: its one-time filter is false.
-- So a replay costs one index lookup and writes nothing. Otherwise (absent, expired, or a
-- lapsed lease with the same fingerprint) the function claim_function.sql defines claims.
-- A record in progress comes with its recovery point: our own takeover read back after a
-- lost reply must still hand it on.
WITH cur AS MATERIALIZED (
    SELECT 2::smallint AS outcome, r.generation, r.nonce, r.fingerprint, r.state,
           CASE WHEN r.state = 0
                THEN GREATEST(0, EXTRACT(EPOCH FROM (r.locked_until - statement_timestamp()))
                                 * 1000000)::bigint
           END AS lease_us,
           r.status, r.headers, r.body, r.trailers, NULL::bigint AS lapsed_us,
           CASE WHEN r.state = 0 THEN r.recovery_point END AS recovery_point
      FROM {table} AS r
     WHERE r.id = $1::bytea
       AND NOT {expired}
       AND NOT (r.state = 0 AND r.locked_until <= statement_timestamp()
                AND r.fingerprint = $2::bytea)
)
SELECT * FROM cur
UNION ALL
SELECT * FROM {function}($1::bytea, $2::bytea, $3::bytea, $4::bigint, $5::bigint, $6::bytea,
                         $7::bigint, $8::bigint)
 WHERE NOT EXISTS (SELECT FROM cur)
