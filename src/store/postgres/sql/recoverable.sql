-- Records in progress whose lease lapsed and that hold a recovery point, the longest lapsed
-- first, for the recovery worker. $1 most rows.
--
-- Through the partial index `<table>_recovery_idx` (migrate.sql): only records holding a
-- point are in it, so the scan never touches the records that saved none. A lapsed lease
-- is expired past `expires_at`, so `expires_at` bounds the scan and the lapse is checked on
-- the row. The lease left is zero: it lapsed.
SELECT r.id, r.generation, r.nonce, r.fingerprint, r.state, 0::bigint AS lease_us,
       r.status, r.headers, r.body, r.trailers, r.recovery_point
  FROM {table} AS r
 WHERE r.recovery_point IS NOT NULL AND r.state = 0
   AND r.expires_at > statement_timestamp()
   AND r.locked_until <= statement_timestamp()
 ORDER BY r.locked_until, r.id
 LIMIT $1::bigint
