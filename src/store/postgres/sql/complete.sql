-- Record the answer: fenced by the token (generation and nonce), one statement.
--
-- $1 id, $2 generation, $3 nonce, $4 state, $5 status, $6 headers, $7 body, $8 trailers,
-- $9 ttl µs.
--
-- The recovery point is dropped: a completed record has none.
--
-- `applied`: this statement recorded it. Otherwise `done` tells a resend after a lost reply
-- that its first attempt committed (read from this statement's snapshot). `done` is only
-- evaluated when nothing was applied: the usual complete costs one index lookup.
WITH upd AS (
    UPDATE {table} AS r SET
           state = $4::smallint, status = $5::smallint, headers = $6::bytea,
           body = $7::bytea, trailers = $8::bytea, recovery_point = NULL,
           expires_at = statement_timestamp() + $9::bigint * interval '1 microsecond'
     WHERE r.id = $1::bytea AND r.generation = $2::bigint AND r.nonce = $3::bytea
       AND r.state = 0 AND NOT {expired}
    RETURNING 1
)
SELECT EXISTS (SELECT FROM upd) AS applied,
       CASE WHEN EXISTS (SELECT FROM upd) THEN false
            ELSE EXISTS (SELECT FROM {table} AS r
                          WHERE r.id = $1::bytea AND r.generation = $2::bigint
                            AND r.nonce = $3::bytea AND r.state <> 0 AND NOT {expired})
       END AS done
