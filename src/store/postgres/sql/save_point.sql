-- Save the holder's recovery point, replacing the one before: fenced by the token like
-- extend.sql. $1 id, $2 generation, $3 nonce, $4 the point (RecoveryPoint::encode).
--
-- A resend after a lost reply writes the same bytes again and matches: no read-back needed.
UPDATE {table} AS r SET recovery_point = $4::bytea
 WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
   AND r.state = 0 AND NOT {expired}
RETURNING 1
