-- Claim a record under a per-scope quota: one statement, one round trip, reading before it
-- writes. Claims without a quota send claim_new.sql instead, the same read with a leaner
-- insert; replicas of the previous version send this one for every claim.
--
-- $1 id, $2 fingerprint, $3 nonce, $4 lease µs, $5 ttl µs, $6 scope, $7 most records,
-- $8 most bytes ($6 to $8 NULL when quotas are off).
--
-- Always one row. The join reads the row by its primary key. An absent key gets NULL in the
-- record's columns and `claimed` is the answer of the function claim_function.sql defines,
-- one record of its result columns. A row that is there comes back as it is, with `claimed`
-- NULL: the CASE never calls the function, so a replay is one index lookup, writes nothing,
-- and sets up no more than this plan (no insert, no table-function scan).
--
-- The store decides from the row's columns and `now` (the database's clock) whether the
-- record is live (a replay, a conflict, a mismatch, or our own claim read back after a lost
-- reply), or expired or a lapsed lease of the same request, which it then claims with
-- claim_call.sql, in a second round trip. The row is not filtered here, nor the lease left
-- computed: those expressions cost a replay 15% more server CPU than the plain read it is
-- (benches/postgres_claim.rs), and expired records and takeovers are rare.
SELECT r.generation, r.nonce, r.fingerprint, r.state, r.locked_until, r.expires_at,
       statement_timestamp() AS now,
       r.status, r.headers, r.body, r.trailers, r.recovery_point,
       CASE WHEN r.id IS NULL
            THEN {function}($1::bytea, $2::bytea, $3::bytea, $4::bigint, $5::bigint, $6::bytea,
                            $7::bigint, $8::bigint)
       END AS claimed
  FROM (SELECT) AS one
  LEFT JOIN {table} AS r
    ON r.id = $1::bytea
