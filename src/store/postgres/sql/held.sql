-- A fresh look at the live row, if any, after a write that changed nothing: its own snapshot
-- may predate a late commit. $1 id, $2 generation, $3 nonce.
SELECT r.generation = $2::bigint AND r.nonce = $3::bytea AS mine, r.state
  FROM {table} AS r
 WHERE r.id = $1::bytea AND NOT {expired}
