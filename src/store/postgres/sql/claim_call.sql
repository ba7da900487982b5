-- The claim of a record claim.sql read as expired, or as a lapsed lease of the same request:
-- the function alone (claim_function.sql), which reads the row again with a fresh snapshot
-- and decides for itself. Parameters as claim.sql's.
SELECT {function}($1::bytea, $2::bytea, $3::bytea, $4::bigint, $5::bigint, $6::bytea,
                  $7::bigint, $8::bigint) AS claimed
