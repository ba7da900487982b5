-- Claim a record without a quota (no scope, or quotas off): one statement, one round trip,
-- reading before it writes, like claim.sql, whose quota path this leaves out.
--
-- $1 id, $2 fingerprint, $3 nonce, $4 lease µs, $5 ttl µs.
--
-- Always one row. The join reads the row by its primary key. An absent key gets NULL in the
-- record's columns, and `claimed` is what claim_new_function.sql's insert returned: the new
-- record's generation, or NULL when a row committed since this read (then the store runs
-- claim_call.sql). A row that is there comes back as it is, with `claimed` NULL: the CASE
-- never calls the function, so a replay is one index lookup and writes nothing.
--
-- As with claim.sql, the store decides from the row's columns and `now` (the database's
-- clock) whether the record is live, expired, or a lapsed lease of the same request; the
-- last two take claim_call.sql, in a second round trip.
--
-- Why a function and not a data-modifying CTE (`WITH i AS (INSERT … WHERE NOT EXISTS …)`):
-- a CTE's insert is set up on every call, a replay's too. Measured by
-- benches/postgres_claim.rs, the CTE took 1.58x the raw SELECT's server CPU per replay and
-- 1.24x the raw insert's per new key, against 1.15x and 1.20x for this statement.
SELECT r.generation, r.nonce, r.fingerprint, r.state, r.locked_until, r.expires_at,
       statement_timestamp() AS now,
       r.status, r.headers, r.body, r.trailers, r.recovery_point,
       CASE WHEN r.id IS NULL
            THEN {new_function}($1::bytea, $2::bytea, $3::bytea, $4::bigint, $5::bigint)
       END AS claimed
  FROM (SELECT) AS one
  LEFT JOIN {table} AS r
    ON r.id = $1::bytea
