-- Create the table, or bring an existing one up to date. Runs as one simple-query message,
-- so in one transaction, under a transaction-level advisory lock: replicas that migrate at
-- once take turns. Every step checks the catalog first, so a table that is already up to
-- date takes no table lock at all (`ALTER TABLE` and `CREATE INDEX` would, even when they
-- change nothing).
-- `IF NOT EXISTS` reports an existing object as a NOTICE, which the driver logs at INFO on
-- every start; keep warnings. LOCAL: the pooled connection gets its setting back at the end.
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock({lock_key});

-- No CHECK constraints: Postgres rebuilds every CHECK expression from its stored text for each
-- INSERT and UPDATE statement (the executor prepares them per statement, not per session).
-- The six checks earlier versions declared were 114k of the 245k instructions of a plain
-- insert into this table, paid again by every complete, extend and recovery point. The
-- store writes only values it built, and checks every row it reads (rows.rs).
CREATE TABLE IF NOT EXISTS {table} (
    id             bytea       PRIMARY KEY,
    fingerprint    bytea       NOT NULL,
    state          smallint    NOT NULL,
    generation     bigint      NOT NULL,
    nonce          bytea       NOT NULL,
    locked_until   timestamptz NOT NULL,
    status         smallint,
    headers        bytea,
    body           bytea,
    trailers       bytea,
    created_at     timestamptz NOT NULL,
    expires_at     timestamptz NOT NULL,
    scope          bytea,
    recovery_point bytea
);

DO $migrate$
DECLARE
    -- fillfactor: room on each page for the completion and the lease renewals of the rows
    -- inserted there, so those updates stay on their page (and renewals are HOT). The
    -- autovacuum settings: every record is inserted, updated and deleted within its TTL, so
    -- vacuum runs after 1% of the rows changed instead of 20%, unthrottled.
    wanted text[] := ARRAY['fillfactor=80',
                           'autovacuum_vacuum_scale_factor=0.01',
                           'autovacuum_analyze_scale_factor=0.05',
                           'autovacuum_vacuum_cost_delay=0'];
    have text[];
    missing text[] := '{}';
    w text;
    -- The CHECK constraints earlier versions declared, as pg_get_constraintdef shows them.
    ours text[] := ARRAY['CHECK ((octet_length(id) = 32))',
                         'CHECK ((octet_length(fingerprint) = 32))',
                         'CHECK ((state = ANY (ARRAY[0, 1, 2])))',
                         'CHECK ((generation > 0))',
                         'CHECK ((octet_length(nonce) = 16))',
                         'CHECK ((octet_length(scope) = 32))'];
    drops text;
BEGIN
    -- Tables from before: drop those CHECK constraints (see CREATE TABLE), in one ALTER,
    -- and only when there are some. A constraint an operator added is kept.
    SELECT string_agg(format('DROP CONSTRAINT %I', conname), ', ') INTO drops
      FROM pg_constraint
     WHERE conrelid = '{table}'::regclass AND contype = 'c'
       AND pg_get_constraintdef(oid) = ANY (ours);
    IF drops IS NOT NULL THEN
        EXECUTE format('ALTER TABLE %s %s', '{table}'::regclass, drops);
    END IF;

    -- Tables from before the per-scope quotas.
    IF NOT EXISTS (SELECT FROM pg_attribute
                    WHERE attrelid = '{table}'::regclass AND attname = 'scope'
                      AND NOT attisdropped) THEN
        ALTER TABLE {table} ADD COLUMN scope bytea;
    END IF;

    -- Tables from before recovery points. Nullable, with no default and no constraint, so
    -- adding it changes the catalog only: no rewrite and no scan of the rows. The store
    -- bounds its size (RecoveryPoint::MAX_ENCODED).
    IF NOT EXISTS (SELECT FROM pg_attribute
                    WHERE attrelid = '{table}'::regclass AND attname = 'recovery_point'
                      AND NOT attisdropped) THEN
        ALTER TABLE {table} ADD COLUMN IF NOT EXISTS recovery_point bytea;
    END IF;

    -- Set each storage setting the table does not have yet; one an operator set is kept.
    SELECT coalesce(reloptions, '{}') INTO have FROM pg_class WHERE oid = '{table}'::regclass;
    FOREACH w IN ARRAY wanted LOOP
        IF NOT EXISTS (SELECT FROM unnest(have) AS o
                        WHERE split_part(o, '=', 1) = split_part(w, '=', 1)) THEN
            missing := missing || w;
        END IF;
    END LOOP;
    IF cardinality(missing) > 0 THEN
        EXECUTE format('ALTER TABLE %s SET (%s)', '{table}'::regclass,
                       array_to_string(missing, ', '));
    END IF;

    -- The sweeper's index.
    IF NOT EXISTS (SELECT FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
                    WHERE x.indrelid = '{table}'::regclass
                      AND i.relname = '{expires_index_name}') THEN
        CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at);
    END IF;

    -- Counting a scope's live records for its quota. Partial: records claimed without
    -- quotas have no scope and cost no index entry.
    IF NOT EXISTS (SELECT FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
                    WHERE x.indrelid = '{table}'::regclass
                      AND i.relname = '{scope_index_name}') THEN
        CREATE INDEX IF NOT EXISTS {scope_index} ON {table} (scope, expires_at)
            WHERE scope IS NOT NULL;
    END IF;

    -- The recovery worker's records. Partial: a record that never saves a point has no entry.
    -- Keyed on expires_at, not the lease: an indexed lease (or any column a renewal changes)
    -- would make every renewal, of every record, a non-HOT update with new entries in every
    -- index; expires_at is indexed already, and bounds the scan (a lapsed lease is expired
    -- past it). Saving a point changes an indexed column (the predicate's), so the saver
    -- alone pays for the entry.
    IF NOT EXISTS (SELECT FROM pg_index AS x JOIN pg_class AS i ON i.oid = x.indexrelid
                    WHERE x.indrelid = '{table}'::regclass
                      AND i.relname = '{recovery_index_name}') THEN
        CREATE INDEX IF NOT EXISTS {recovery_index} ON {table} (expires_at)
            WHERE recovery_point IS NOT NULL AND state = 0;
    END IF;
END
$migrate$;
