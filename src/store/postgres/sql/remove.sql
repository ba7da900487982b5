-- The operator API: delete the live record. $1 id, $2 true to remove a completed record,
-- false one in progress. `present`: whether a live row is there (when nothing was removed).
-- A removed completed record is announced to local tiers on every process (`NOTIFY`, sent on
-- commit, with the id in hex): `notified` reads the CTE, which would not run unread.
WITH del AS (
    DELETE FROM {table} AS r
     WHERE r.id = $1::bytea AND NOT {expired} AND (r.state <> 0) = $2::bool
    RETURNING 1
), note AS (
    SELECT pg_notify('tower_idempotency_invalidations', encode($1::bytea, 'hex'))
      FROM del WHERE $2::bool
)
SELECT EXISTS (SELECT FROM del) AS removed,
       EXISTS (SELECT FROM {table} AS r WHERE r.id = $1::bytea AND NOT {expired}) AS present,
       (SELECT count(*) FROM note) AS notified
