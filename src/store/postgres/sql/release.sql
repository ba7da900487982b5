-- Free the key, fenced by the token. $1 id, $2 generation, $3 nonce.
--
-- `applied`: this statement deleted it. Otherwise `present` says whether any live row is
-- there (from this statement's snapshot); it is only evaluated when nothing was deleted.
WITH del AS (
    DELETE FROM {table} AS r
     WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
       AND r.state = 0 AND NOT {expired}
    RETURNING 1
)
SELECT EXISTS (SELECT FROM del) AS applied,
       CASE WHEN EXISTS (SELECT FROM del) THEN true
            ELSE EXISTS (SELECT FROM {table} AS r WHERE r.id = $1::bytea AND NOT {expired})
       END AS present
