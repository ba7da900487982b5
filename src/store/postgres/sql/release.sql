-- Release a claim, fenced by the token. $1 id, $2 generation, $3 nonce, $4 the nonce of the
-- token's released token (Token::released: one no claim holds).
--
-- A first claim (generation 1) is deleted: a retry runs as a new first attempt. A takeover is
-- kept, because an earlier attempt may have done work: its nonce becomes $4 (so this token is
-- fenced) and its lease ends now, so the next claim of the same request takes over with
-- generation + 1 and is told so. Its retention stays as it was, and its recovery point is
-- dropped with the claim: the next claim starts from nothing.
--
-- `applied`: this statement released it. Otherwise `done` says this token's earlier release
-- kept it (a resend after a lost reply), and `present` whether any live row is there; both
-- from this statement's snapshot, and only evaluated when nothing was applied.
WITH del AS (
    DELETE FROM {table} AS r
     WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
       AND r.generation = 1 AND r.state = 0 AND NOT {expired}
    RETURNING 1
), kept AS (
    UPDATE {table} AS r SET nonce = $4::bytea, locked_until = statement_timestamp(),
                            recovery_point = NULL
     WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
       AND r.generation > 1 AND r.state = 0 AND NOT {expired}
    RETURNING 1
), applied AS (
    SELECT EXISTS (SELECT FROM del) OR EXISTS (SELECT FROM kept) AS applied
)
SELECT applied,
       CASE WHEN applied THEN false
            ELSE EXISTS (SELECT FROM {table} AS r
                          WHERE r.id = $1::bytea AND r.generation = $2::bigint
                            AND r.nonce = $4::bytea AND r.state = 0 AND NOT {expired})
       END AS done,
       CASE WHEN applied THEN true
            ELSE EXISTS (SELECT FROM {table} AS r WHERE r.id = $1::bytea AND NOT {expired})
       END AS present
  FROM applied
