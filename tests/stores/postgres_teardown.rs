//! The teardown docs/operations.md gives for what `PostgresStore::migrate` creates: run on a
//! migrated table in a schema of its own, it leaves nothing of the store behind.
//!
//! Needs `IDEMPOTENCY_TEST_POSTGRES_URL`; skipped with a printed reason when unset, unless
//! `IDEMPOTENCY_REQUIRE_BACKENDS=1`.
use crate::support::pg::{self as pg_support, admin, store_in, TestSchema};

use tower_idempotency::store::postgres::tokio_postgres;

/// The statements of the "Removing the store" block in docs/operations.md, for the default
/// table.
fn documented_teardown() -> String {
    let docs = include_str!("../../docs/operations.md");
    let at = docs
        .find("**Removing the store.**")
        .expect("docs/operations.md has no \"Removing the store\"");
    let rest = &docs[at..];
    let start = rest.find("```sql").expect("no sql block") + "```sql".len();
    let len = rest[start..].find("```").expect("unclosed sql block");
    rest[start..start + len]
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the schema holds: its relations (tables, indexes, sequences, views), functions and
/// types, by name.
async fn objects_in(client: &tokio_postgres::Client, schema: &str) -> Vec<String> {
    let rows = client
        .query(
            "SELECT 'relation ' || c.relname FROM pg_class AS c
               JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE n.nspname = $1
             UNION ALL
             SELECT 'function ' || p.proname FROM pg_proc AS p
               JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = $1
             UNION ALL
             SELECT 'type ' || t.typname FROM pg_type AS t
               JOIN pg_namespace AS n ON n.oid = t.typnamespace WHERE n.nspname = $1
             UNION ALL
             SELECT 'information_schema table ' || table_name FROM information_schema.tables
              WHERE table_schema = $1
             UNION ALL
             SELECT 'information_schema routine ' || routine_name
               FROM information_schema.routines WHERE routine_schema = $1
             ORDER BY 1",
            &[&schema],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

#[tokio::test]
async fn the_documented_teardown_leaves_nothing_migrate_created() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "teardown").await;
    let store = store_in(&url, &schema, 1, "tidem-teardown").await;
    drop(store);
    let client = admin(&url).await;
    let table = schema.table();
    // The claim function of the version before the versioned ones, as a replica of it left it.
    client
        .batch_execute(&format!(
            "CREATE FUNCTION {table}_claim(p_id bytea) RETURNS bigint LANGUAGE sql AS 'SELECT 1'"
        ))
        .await
        .unwrap();

    let before = objects_in(&client, &schema.name).await;
    for made in [
        "relation records",
        "relation records_pkey",
        "relation records_expires_at_idx",
        "relation records_scope_idx",
        "relation records_recovery_idx",
        "function records_claim",
        "function records_claim_v2",
        "function records_claim_v3",
        "function records_claim_new_v1",
        "information_schema table records",
    ] {
        assert!(
            before.iter().any(|o| o == made),
            "{made} not found after migrate: {before:?}"
        );
    }

    let teardown = documented_teardown().replace("idempotency_records", &table);
    client.batch_execute(&teardown).await.unwrap();
    assert_eq!(
        objects_in(&client, &schema.name).await,
        Vec::<String>::new(),
        "left after the teardown:\n{teardown}"
    );
    // Every statement is `IF EXISTS`: running it again is harmless.
    client.batch_execute(&teardown).await.unwrap();

    schema.drop_now().await;
}
