-- The live record, if any, with its recovery point while in progress, and a completed
-- one's time left (a local tier keeps it no longer). $1 id.
SELECT r.generation, r.nonce, r.fingerprint, r.state,
       CASE WHEN r.state = 0
            THEN GREATEST(0, EXTRACT(EPOCH FROM (r.locked_until - statement_timestamp()))
                             * 1000000)::bigint
       END AS lease_us,
       r.status, r.headers, r.body, r.trailers,
       CASE WHEN r.state = 0 THEN r.recovery_point END AS recovery_point,
       CASE WHEN r.state <> 0
            THEN GREATEST(0, EXTRACT(EPOCH FROM (r.expires_at - statement_timestamp()))
                             * 1000000)::bigint
       END AS ttl_us
  FROM {table} AS r
 WHERE r.id = $1::bytea AND NOT {expired}
