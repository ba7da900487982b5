-- The operator API: the live record (with its recovery point while in progress) and how long
-- it is kept. A live lease keeps a row past `expires_at`: count to the later. $1 id.
SELECT r.generation, r.fingerprint, r.state,
       CASE WHEN r.state = 0
            THEN GREATEST(0, EXTRACT(EPOCH FROM (r.locked_until - statement_timestamp()))
                             * 1000000)::bigint
       END AS lease_us,
       r.status, r.headers, r.body, r.trailers,
       CASE WHEN r.state = 0 THEN r.recovery_point END AS recovery_point,
       GREATEST(0, EXTRACT(EPOCH FROM (
                    GREATEST(r.expires_at, CASE WHEN r.state = 0 THEN r.locked_until END)
                    - statement_timestamp())) * 1000000)::bigint AS expires_us
  FROM {table} AS r
 WHERE r.id = $1::bytea AND NOT {expired}
