-- The claim function of the previous version (result version 2, a set of rows), for its
-- replicas during a rolling upgrade: the same claim, through the current function
-- (claim_function.sql). It returns no row where that one's outcome is NULL (a lost race),
-- as it always did.
CREATE OR REPLACE FUNCTION {previous_function}(
    p_id bytea, p_fingerprint bytea, p_nonce bytea, p_lease bigint, p_ttl bigint,
    p_scope bytea, p_max_records bigint, p_max_bytes bigint)
RETURNS TABLE (outcome smallint, generation bigint, nonce bytea, fingerprint bytea,
               state smallint, lease_us bigint, status smallint, headers bytea, body bytea,
               trailers bytea, lapsed_us bigint, recovery_point bytea)
LANGUAGE sql VOLATILE
AS $claim$
SELECT c.* FROM {function}(p_id, p_fingerprint, p_nonce, p_lease, p_ttl, p_scope,
                           p_max_records, p_max_bytes) AS c
 WHERE c.outcome IS NOT NULL
$claim$;
