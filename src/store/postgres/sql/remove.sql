-- The operator API: delete the live record. $1 id, $2 true to remove a completed record,
-- false one in progress. `present`: whether a live row is there (when nothing was removed).
WITH del AS (
    DELETE FROM {table} AS r
     WHERE r.id = $1::bytea AND NOT {expired} AND (r.state <> 0) = $2::bool
    RETURNING 1
)
SELECT EXISTS (SELECT FROM del) AS removed,
       EXISTS (SELECT FROM {table} AS r WHERE r.id = $1::bytea AND NOT {expired}) AS present
