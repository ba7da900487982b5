-- The writing half of the claim, and the per-scope quota. claim.sql reads the row first and
-- calls this only when it found no live record: the key is absent, expired, or in progress
-- with a lapsed lease and the same fingerprint. claim_call.sql calls it alone for the last
-- two, and after claim_new.sql's insert met a row its read could not see. A function, so that the claim stays one
-- statement and one round trip: a single statement could not count a scope after waiting for
-- the scope's lock (its snapshot is taken before the wait), while each query in a VOLATILE
-- function takes a fresh snapshot (under READ COMMITTED). It returns one record, not a set:
-- claim.sql calls it inside a CASE, so a replay neither runs nor sets up a table-function
-- scan. Its name ends in the version of its result columns (sql.rs): replicas of an earlier
-- version of the crate keep calling theirs during a rolling upgrade.
--
-- p_scope, p_max_records, p_max_bytes: the scope and its limits, NULL when quotas are off.
-- Then the quota block is skipped and the record gets no scope.
--
-- 1. Quota (only with a scope and a limit). A live record of this id (a replay, a conflict,
--    a mismatch, committed since claim.sql looked) needs no room: not checked. Otherwise
--    take the scope's transaction-level advisory lock (claims of other scopes do not wait;
--    two scopes that share the lock's 32 bits only take turns) and count the scope's live
--    records other than this id through the (scope, expires_at) index, stopping at the
--    first limit reached: at most p_max_records records, at most p_max_bytes bytes (160 per
--    record plus its recorded answer). Over a limit: outcome 3, nothing written.
-- 2. Insert the key if it is absent (outcome 0), the usual case here: one statement, its
--    result the answer. A conflicting insert in flight is waited for, and then the row is
--    there.
-- 3. Otherwise the claim, one statement (outcomes 0 inserted, 1 updated, 2 existing):
--    `cur` reads the row again with this query's fresh snapshot. The row is written only
--    when the key is absent (INSERT), expired (replaced, generation 1), or in progress with
--    a lapsed lease and the same fingerprint (a takeover, generation + 1); otherwise the
--    INSERT and UPDATE are skipped by one-time filters and the row is returned.
--    Leases start at clock_timestamp(), when the row is written, so time spent waiting on a
--    row lock does not shorten them. A new record is kept max(lease, ttl); a takeover keeps
--    its retention and extends it to cover the new lease, so expires_at >= locked_until.
--    A takeover keeps the record's recovery point and hands it to the new holder (whose next
--    save replaces it); a replaced expired record loses its point with its answer.
--    The outcome is NULL when the claim lost a race (`cur` saw no row but the INSERT hit a
--    concurrent one, or the row changed under the UPDATE): the caller runs it again.
--
-- Variables are set only where they are used: plpgsql sets up every expression it evaluates
-- once per transaction, and each claim is a transaction of its own.
CREATE OR REPLACE FUNCTION {function}(
    p_id bytea, p_fingerprint bytea, p_nonce bytea, p_lease bigint, p_ttl bigint,
    p_scope bytea, p_max_records bigint, p_max_bytes bigint,
    OUT outcome smallint, OUT generation bigint, OUT nonce bytea, OUT fingerprint bytea,
    OUT state smallint, OUT lease_us bigint, OUT status smallint, OUT headers bytea,
    OUT body bytea, OUT trailers bytea, OUT lapsed_us bigint, OUT recovery_point bytea)
LANGUAGE plpgsql VOLATILE
AS $claim$
#variable_conflict use_column
DECLARE
    n_records bigint;
    n_bytes bigint;
    answer_bytes bigint;
    over boolean;
BEGIN
    IF p_scope IS NOT NULL AND (p_max_records IS NOT NULL OR p_max_bytes IS NOT NULL) THEN
        IF NOT EXISTS (SELECT FROM {table} AS r
                        WHERE r.id = p_id AND NOT {expired}
                          AND NOT (r.state = 0 AND r.locked_until <= statement_timestamp()
                                   AND r.fingerprint = p_fingerprint)) THEN
            PERFORM pg_advisory_xact_lock({lock_class},
                ('x' || encode(substring(p_scope FROM 1 FOR 4), 'hex'))::bit(32)::int4);
            n_records := 0;
            n_bytes := 0;
            over := coalesce(p_max_bytes < 160, false);
            IF NOT over THEN
                FOR answer_bytes IN
                    SELECT coalesce(octet_length(r.headers), 0) + coalesce(octet_length(r.body), 0)
                           + coalesce(octet_length(r.trailers), 0)
                      FROM {table} AS r
                     WHERE r.scope = p_scope AND r.expires_at > statement_timestamp()
                       AND r.id <> p_id
                LOOP
                    n_records := n_records + 1;
                    n_bytes := n_bytes + 160 + answer_bytes;
                    IF n_records >= p_max_records OR n_bytes + 160 > p_max_bytes THEN
                        over := true;
                        EXIT;
                    END IF;
                END LOOP;
            END IF;
            IF over THEN
                outcome := 3;
                RETURN;
            END IF;
        END IF;
    END IF;
    -- An absent key, the usual case here: insert it.
    INSERT INTO {table} AS r (id, fingerprint, state, generation, nonce,
                              locked_until, created_at, expires_at, scope)
    VALUES (p_id, p_fingerprint, 0, 1, p_nonce,
            clock_timestamp() + p_lease * interval '1 microsecond',
            statement_timestamp(),
            clock_timestamp() + GREATEST(p_lease, p_ttl) * interval '1 microsecond',
            p_scope)
    ON CONFLICT (id) DO NOTHING
    RETURNING 0::smallint, r.generation INTO outcome, generation;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A row is there (committed since claim.sql looked, or one to replace or take over).
    -- At most one of the three branches returns a row; none when the claim lost a race.
    WITH cur AS MATERIALIZED (
        SELECT r.nonce, r.generation, r.fingerprint, r.state, r.locked_until,
               r.status, r.headers, r.body, r.trailers, r.recovery_point,
               (r.expires_at <= statement_timestamp()
                AND NOT (r.state = 0 AND r.locked_until > statement_timestamp())) AS expired,
               (r.state = 0 AND r.locked_until <= statement_timestamp()
                AND r.fingerprint = p_fingerprint) AS lapsed
          FROM {table} AS r
         WHERE r.id = p_id
    ), ins AS (
        INSERT INTO {table} AS r (id, fingerprint, state, generation, nonce,
                                  locked_until, created_at, expires_at, scope)
        SELECT p_id, p_fingerprint, 0, 1, p_nonce,
               clock_timestamp() + p_lease * interval '1 microsecond',
               statement_timestamp(),
               clock_timestamp() + GREATEST(p_lease, p_ttl) * interval '1 microsecond',
               p_scope
         WHERE NOT EXISTS (SELECT FROM cur)
        ON CONFLICT (id) DO NOTHING
        RETURNING r.generation
    ), upd AS (
        UPDATE {table} AS r SET
               fingerprint = p_fingerprint, state = 0, nonce = p_nonce,
               generation = CASE WHEN {expired} THEN 1 ELSE r.generation + 1 END,
               locked_until = clock_timestamp() + p_lease * interval '1 microsecond',
               created_at = CASE WHEN {expired} THEN statement_timestamp() ELSE r.created_at END,
               expires_at = CASE WHEN {expired}
                            THEN clock_timestamp()
                                 + GREATEST(p_lease, p_ttl) * interval '1 microsecond'
                            ELSE GREATEST(r.expires_at,
                                          clock_timestamp() + p_lease * interval '1 microsecond')
                            END,
               status = NULL, headers = NULL, body = NULL, trailers = NULL,
               recovery_point = CASE WHEN {expired} THEN NULL ELSE r.recovery_point END,
               scope = COALESCE(p_scope, r.scope)
         WHERE r.id = p_id
           AND ({expired}
                OR (r.state = 0 AND r.locked_until <= statement_timestamp()
                    AND r.fingerprint = p_fingerprint))
           AND EXISTS (SELECT FROM cur WHERE cur.expired OR cur.lapsed)
        RETURNING r.generation, r.recovery_point
    )
    SELECT 0::smallint, generation, NULL::bytea, NULL::bytea, NULL::smallint, NULL::bigint,
           NULL::smallint, NULL::bytea, NULL::bytea, NULL::bytea, NULL::bigint, NULL::bytea
      FROM ins
    UNION ALL
    -- How long the replaced lease had lapsed, from the row as `cur` saw it.
    SELECT 1::smallint, generation, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           (SELECT GREATEST(0, EXTRACT(EPOCH FROM (clock_timestamp() - cur.locked_until))
                               * 1000000)::bigint
              FROM cur),
           recovery_point
      FROM upd
    UNION ALL
    SELECT 2::smallint, generation, nonce, fingerprint, state,
           CASE WHEN state = 0
                THEN GREATEST(0, EXTRACT(EPOCH FROM (locked_until - statement_timestamp()))
                                 * 1000000)::bigint
           END,
           status, headers, body, trailers, NULL,
           CASE WHEN state = 0 THEN recovery_point END
      FROM cur
     WHERE NOT expired AND NOT lapsed
      INTO outcome, generation, nonce, fingerprint, state, lease_us, status, headers, body,
           trailers, lapsed_us, recovery_point;
END
$claim$;
