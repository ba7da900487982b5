-- Take the record's row lock in the caller's transaction (`lock_in`), fenced by the token.
-- $1 id, $2 generation, $3 nonce.
SELECT 1 FROM {table} AS r
 WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
   AND r.state = 0 AND NOT {expired}
   FOR UPDATE
