//! The table name, and the statements built for it from the `.sql` files beside this module.

use sha2::{Digest, Sha256};

use crate::store::ConfigError;

/// Postgres truncates identifiers to 63 bytes. The longest name made from the table's is the
/// index `<table>_expires_at_idx` (15 more bytes), so table names stop at 48 to keep two
/// tables' objects apart.
pub(super) const MAX_TABLE_LEN: usize = 63 - "_expires_at_idx".len();
const MAX_SCHEMA_LEN: usize = 63;

/// The validated table: quoted for SQL, the names of the objects `migrate` makes for it, and
/// the keys of its advisory locks.
#[derive(Debug, Clone)]
pub(super) struct Table {
    pub(super) name: String,
    pub(super) quoted: String,
    /// Unquoted: `migrate` looks them up in the catalog, then creates them beside the table.
    expires_index_name: String,
    scope_index_name: String,
    recovery_index_name: String,
    /// The claim function (claim_function.sql), schema-qualified like the table.
    function: String,
    /// The previous version's claim function, kept as a wrapper (claim_function_v2.sql).
    previous_function: String,
    /// The insert of an absent key for claims without a quota (claim_new_function.sql).
    new_function: String,
    /// The migration lock (one-`bigint` advisory lock space).
    lock_key: i64,
    /// The first key of the scopes' quota locks (the two-`int` space, apart from the above).
    lock_class: i32,
}

impl Table {
    pub(super) fn parse(name: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::new(format!("invalid table name {name:?}: {why}"));
        let parts: Vec<&str> = name.split('.').collect();
        let (schema, table) = match parts.as_slice() {
            [table] => (None, *table),
            [schema, table] => (Some(*schema), *table),
            _ => return Err(bad("expected `table` or `schema.table`")),
        };
        for (part, max) in [(schema, MAX_SCHEMA_LEN), (Some(table), MAX_TABLE_LEN)] {
            let Some(part) = part else { continue };
            let mut chars = part.chars();
            let first_ok = chars
                .next()
                .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
            if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                return Err(bad(
                    "each part must be a lowercase identifier: [a-z_][a-z0-9_]*",
                ));
            }
            if part.len() > max {
                return Err(bad(&format!("a part is longer than {max} bytes")));
            }
        }
        // The checks above leave nothing to escape; quoting still makes reserved words
        // (`user`, `order`) usable.
        let quoted = match schema {
            Some(s) => format!("\"{s}\".\"{table}\""),
            None => format!("\"{table}\""),
        };
        let digest = Sha256::digest(format!("tower-idempotency migrate {name}"));
        let mut key = [0u8; 8];
        key.copy_from_slice(&digest[..8]);
        let mut class = [0u8; 4];
        class.copy_from_slice(&digest[8..12]);
        let qualify = |object: &str| match schema {
            Some(s) => format!("\"{s}\".\"{object}\""),
            None => format!("\"{object}\""),
        };
        Ok(Self {
            name: name.to_owned(),
            quoted,
            expires_index_name: format!("{table}_expires_at_idx"),
            scope_index_name: format!("{table}_scope_idx"),
            recovery_index_name: format!("{table}_recovery_idx"),
            function: qualify(&format!("{table}_claim{FUNCTION_VERSION}")),
            previous_function: qualify(&format!("{table}_claim{PREVIOUS_FUNCTION_VERSION}")),
            new_function: qualify(&format!("{table}_claim_new{NEW_FUNCTION_VERSION}")),
            lock_key: i64::from_be_bytes(key),
            lock_class: i32::from_be_bytes(class),
        })
    }
}

/// The claim function's name ends in the version of its result columns. `CREATE OR REPLACE`
/// cannot change a function's result type, and replicas of an earlier version of this crate
/// keep calling (and their `migrate` keeps creating) the function their claim statement
/// names: each version gets its own, so a rolling upgrade never breaks the other's claims.
/// Version 3 returns one record instead of a set, so that claim.sql can call it inside a
/// `CASE`, only when it read no live record. Version 2 (a set, with the recovery point) is
/// kept as a wrapper over version 3 for the replicas still calling it. Version 1 was named
/// `<table>_claim`, and is left alone.
const FUNCTION_VERSION: &str = "_v3";
const PREVIOUS_FUNCTION_VERSION: &str = "_v2";
/// The insert of an absent key (claim_new_function.sql), which claim_new.sql calls: versioned
/// the same way. `<table>_claim_new_v1` is 13 bytes longer than the table's name, within the
/// 15 that [`MAX_TABLE_LEN`] leaves.
const NEW_FUNCTION_VERSION: &str = "_v1";

/// A row is expired past `expires_at`, unless its lease is still live. `r` is the record row;
/// the `.sql` files write `{expired}` for it.
const EXPIRED: &str = "(r.expires_at <= statement_timestamp() \
                       AND NOT (r.state = 0 AND r.locked_until > statement_timestamp()))";

/// The statements, built once per table. Parameters are documented in each file.
#[derive(Debug)]
pub(super) struct Sql {
    pub(super) migrate: String,
    pub(super) verify: String,
    pub(super) claim: String,
    pub(super) claim_new: String,
    pub(super) claim_call: String,
    pub(super) extend: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) lock: String,
    pub(super) held: String,
    pub(super) get: String,
    pub(super) sweep: String,
    pub(super) inspect: String,
    pub(super) remove: String,
    pub(super) save_point: String,
    pub(super) recoverable: String,
}

/// A statement file for `table`: comment lines and indentation dropped (shorter text to send,
/// hash in the statement cache and read in `pg_stat_statements`), `{table}` and `{expired}`
/// filled in. Lines stay lines, so a comment at the end of one could not swallow the next.
fn load(text: &str, table: &Table) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with("--") {
            continue;
        }
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(line);
    }
    out.replace("{expired}", EXPIRED)
        .replace("{table}", &table.quoted)
}

impl Sql {
    pub(super) fn new(table: &Table) -> Self {
        let function = load(include_str!("sql/claim_function.sql"), table)
            .replace("{function}", &table.function)
            .replace("{lock_class}", &table.lock_class.to_string());
        let previous = load(include_str!("sql/claim_function_v2.sql"), table)
            .replace("{previous_function}", &table.previous_function)
            .replace("{function}", &table.function);
        let new_function = load(include_str!("sql/claim_new_function.sql"), table)
            .replace("{new_function}", &table.new_function);
        let migrate = load(include_str!("sql/migrate.sql"), table)
            .replace("{lock_key}", &table.lock_key.to_string())
            .replace("{expires_index_name}", &table.expires_index_name)
            .replace(
                "{expires_index}",
                &format!("\"{}\"", table.expires_index_name),
            )
            .replace("{scope_index_name}", &table.scope_index_name)
            .replace("{scope_index}", &format!("\"{}\"", table.scope_index_name))
            .replace("{recovery_index_name}", &table.recovery_index_name)
            .replace(
                "{recovery_index}",
                &format!("\"{}\"", table.recovery_index_name),
            );
        Self {
            // One simple-query message: the functions are created in the migration's
            // transaction, under its lock.
            migrate: format!("{migrate}\n{function}\n{previous}\n{new_function}"),
            verify: load(include_str!("sql/verify.sql"), table),
            claim: load(include_str!("sql/claim.sql"), table)
                .replace("{function}", &table.function),
            claim_new: load(include_str!("sql/claim_new.sql"), table)
                .replace("{new_function}", &table.new_function),
            claim_call: load(include_str!("sql/claim_call.sql"), table)
                .replace("{function}", &table.function),
            extend: load(include_str!("sql/extend.sql"), table),
            complete: load(include_str!("sql/complete.sql"), table),
            release: load(include_str!("sql/release.sql"), table),
            lock: load(include_str!("sql/lock.sql"), table),
            held: load(include_str!("sql/held.sql"), table),
            get: load(include_str!("sql/get.sql"), table),
            sweep: load(include_str!("sql/sweep.sql"), table),
            inspect: load(include_str!("sql/inspect.sql"), table),
            remove: load(include_str!("sql/remove.sql"), table),
            save_point: load(include_str!("sql/save_point.sql"), table),
            recoverable: load(include_str!("sql/recoverable.sql"), table),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers_or_schema_qualified() {
        for ok in ["records", "_r", "app.records", "s1.t_2", "user", "a.order"] {
            assert!(Table::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a.b.c",
            "Records",
            "1abc",
            "a-b",
            "a b",
            "r\"; DROP TABLE x; --",
            "a;b",
            "é",
            &"x".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(Table::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Table::parse(&"x".repeat(MAX_TABLE_LEN)).is_ok());
        let t = Table::parse("app.records").unwrap();
        assert_eq!(t.quoted, "\"app\".\"records\"");
        assert_eq!(t.expires_index_name, "records_expires_at_idx");
        assert_eq!(t.function, "\"app\".\"records_claim_v3\"");
        assert_eq!(t.previous_function, "\"app\".\"records_claim_v2\"");
        assert_eq!(t.new_function, "\"app\".\"records_claim_new_v1\"");
        assert_eq!(t.recovery_index_name, "records_recovery_idx");
        let other = Table::parse("records").unwrap();
        assert_ne!(t.lock_key, other.lock_key);
        assert_ne!(t.lock_class, other.lock_class);
        assert_eq!(other.function, "\"records_claim_v3\"");
    }

    #[test]
    fn every_placeholder_is_filled_and_comments_are_gone() {
        let sql = Sql::new(&Table::parse("app.records").unwrap());
        for text in [
            &sql.migrate,
            &sql.verify,
            &sql.claim,
            &sql.claim_new,
            &sql.claim_call,
            &sql.extend,
            &sql.complete,
            &sql.release,
            &sql.lock,
            &sql.held,
            &sql.get,
            &sql.sweep,
            &sql.inspect,
            &sql.remove,
            &sql.save_point,
            &sql.recoverable,
        ] {
            // `'{}'` (an empty array) is SQL; `{name}` would be a placeholder left behind.
            let left = text
                .match_indices('{')
                .any(|(i, _)| text[i + 1..].starts_with(|c: char| c.is_ascii_lowercase()));
            assert!(!left, "placeholder left in {text}");
            assert!(!text.lines().any(|l| l.starts_with("--")), "{text}");
            // The table, or the function made for it.
            assert!(text.contains("\"app\".\"records"), "{text}");
        }
        // The functions work on their arguments, never on a caller's parameters.
        let body = &sql.migrate[sql.migrate.find("CREATE OR REPLACE FUNCTION").unwrap()..];
        assert!(!body.contains("$1"), "{body}");
        assert!(body.contains("CREATE OR REPLACE FUNCTION \"app\".\"records_claim_v3\"("));
        // The previous version's, over the current one.
        assert!(body.contains("CREATE OR REPLACE FUNCTION \"app\".\"records_claim_v2\"("));
        assert!(body.contains("SELECT c.* FROM \"app\".\"records_claim_v3\"(p_id"));
        assert!(sql.claim.contains("\"app\".\"records_claim_v3\"($1::bytea"));
        assert!(body.contains("CREATE OR REPLACE FUNCTION \"app\".\"records_claim_new_v1\"("));
        assert!(sql
            .claim_new
            .contains("\"app\".\"records_claim_new_v1\"($1::bytea, $2::bytea, $3::bytea, $4::bigint, $5::bigint)"));
        // The longest table name still keeps its functions apart.
        let longest = Table::parse(&"x".repeat(MAX_TABLE_LEN)).unwrap();
        assert!(longest.new_function.len() - 2 <= 63);
    }
}
