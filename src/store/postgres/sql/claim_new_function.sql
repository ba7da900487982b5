-- The insert of an absent key, for claim_new.sql (claims without a quota): one statement, its
-- result the answer. Returns the new record's generation (1), or NULL when the key is there:
-- a row committed since claim_new.sql's read, which its snapshot cannot see. The store then
-- runs claim_call.sql, whose function reads the row again with a fresh snapshot.
--
-- Leaner than the claim function (claim_function.sql), which quotas, replacements and
-- takeovers keep: no quota block, five arguments, and one `bigint` back instead of a record of
-- twelve columns. Counted by callgrind on the server, a new key's claim_new.sql runs about
-- 152k instructions beside the raw insert's 127k; claim.sql through the claim function ran
-- 225k beside 123k (BENCHMARKS.md).
--
-- The lease starts at clock_timestamp(), when the row is written, so time spent waiting on a
-- conflicting insert in flight does not shorten it. The record is kept max(lease, ttl) from a
-- later clock_timestamp(), so expires_at >= locked_until: a live lease never outlives its
-- retention. Its name ends in its own version (sql.rs).
CREATE OR REPLACE FUNCTION {new_function}(
    p_id bytea, p_fingerprint bytea, p_nonce bytea, p_lease bigint, p_ttl bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $claim$
#variable_conflict use_column
DECLARE
    claimed bigint;
BEGIN
    INSERT INTO {table} AS r (id, fingerprint, state, generation, nonce,
                              locked_until, created_at, expires_at)
    VALUES (p_id, p_fingerprint, 0, 1, p_nonce,
            clock_timestamp() + p_lease * interval '1 microsecond',
            statement_timestamp(),
            clock_timestamp() + GREATEST(p_lease, p_ttl) * interval '1 microsecond')
    ON CONFLICT (id) DO NOTHING
    RETURNING r.generation INTO claimed;
    RETURN claimed;
END
$claim$;
