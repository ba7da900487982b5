-- Renew the lease, fenced by the token. $1 id, $2 generation, $3 nonce, $4 lease µs.
--
-- `expires_at` only grows when the new lease would outlive it, so it usually keeps its value:
-- no indexed column changes, and the renewal is a HOT update (no index entries) when the
-- page has room, which the table's fillfactor leaves.
UPDATE {table} AS r SET
       locked_until = clock_timestamp() + $4::bigint * interval '1 microsecond',
       expires_at = GREATEST(r.expires_at,
                             clock_timestamp() + $4::bigint * interval '1 microsecond')
 WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
   AND r.state = 0 AND NOT {expired}
RETURNING 1
