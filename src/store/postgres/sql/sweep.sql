-- Delete one batch of expired rows. $1 batch size.
--
-- A row is expired past `expires_at` unless its lease is still live. SKIP LOCKED: never wait
-- behind a claim that is replacing an expired row.
DELETE FROM {table} AS r
 WHERE r.id IN (SELECT s.id FROM {table} AS s
                 WHERE s.expires_at <= statement_timestamp()
                   AND NOT (s.state = 0 AND s.locked_until > statement_timestamp())
                 ORDER BY s.expires_at
                 LIMIT $1::bigint
                   FOR UPDATE SKIP LOCKED)
   AND {expired}
RETURNING 1
