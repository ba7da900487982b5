//! What a durable store holds, byte for byte, for a request whose holder died mid-work:
//! neither the `Idempotency-Key` nor the scope appears anywhere in it, in the clear, in hex or
//! in base64 (issue 45, must-have 5).
//!
//! Through the layer, with a distinctive scope (`alice@example.com-<unique>`) and keys
//! (`order-key-<unique>`): one request saves a recovery point and completes; another saves a
//! point (`reserved`, `pay_123`) and its holder dies (its future is `mem::forget`-ten, so no
//! release and no renewal run). Per-scope quotas are on, so the stores also keep their scope
//! indexes. Then every key name and value (Redis) or every row and `bytea` column (Postgres)
//! is dumped and searched. The dump must hold what it should (the record id, the scope's id,
//! the point's step and data), so the test cannot pass by dumping nothing; and a control
//! writes a version-1 point (which kept the scope in the clear) into the same record by hand
//! and checks the same dump and search report it.

use crate::support;
use crate::support::backend as common;

use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Notify;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::{IdempotencyStore, RecordId, RecordState, ScopeId};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, RequestBody, ResponseBody, Timing};

// ---- the detector --------------------------------------------------------------------------

const STD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const URL_SAFE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

fn hex(bytes: &[u8], upper: bool) -> Vec<u8> {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    bytes
        .iter()
        .flat_map(|b| [digits[(b >> 4) as usize], digits[(b & 15) as usize]])
        .collect()
}

/// Base64 without padding (a trailing partial group is dropped by the caller anyway).
fn base64(bytes: &[u8], alphabet: &[u8; 64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let mut b = [0u8; 3];
        b[..chunk.len()].copy_from_slice(chunk);
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(alphabet[(n >> (18 - 6 * i) & 63) as usize]);
        }
    }
    out
}

/// The forms `needle` is looked for in: as is, in hex (both cases), and in base64 (both
/// alphabets) at each of the three byte alignments it can have in a longer value. For base64,
/// only the characters that depend on the needle's bytes alone: the first group is dropped
/// when it mixes in bytes before the needle, the last one always (bytes after it, padding).
fn forms(needle: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = vec![
        ("raw".to_owned(), needle.to_vec()),
        ("hex".to_owned(), hex(needle, false)),
        ("HEX".to_owned(), hex(needle, true)),
    ];
    for (name, alphabet) in [("base64", STD), ("base64url", URL_SAFE)] {
        for shift in 0..3 {
            let mut shifted = vec![0u8; shift];
            shifted.extend_from_slice(needle);
            let enc = base64(&shifted, alphabet);
            let start = if shift == 0 { 0 } else { 4 };
            let end = enc.len().saturating_sub(4);
            if end > start + 8 {
                out.push((
                    format!("{name}, shifted by {shift}"),
                    enc[start..end].to_vec(),
                ));
            }
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// The form in which `needle` appears in `haystack` (raw, hex or base64), if it does.
fn leak_form(haystack: &[u8], needle: &[u8]) -> Option<String> {
    forms(needle)
        .into_iter()
        .find(|(_, form)| contains(haystack, form))
        .map(|(name, _)| name)
}

/// Whether `needle` appears in `haystack` in the clear, in hex or in base64.
fn leaks(haystack: &[u8], needle: &[u8]) -> bool {
    leak_form(haystack, needle).is_some()
}

/// Everything a store held: where each piece was found (a key's name, a key's value, a row,
/// a column), and its bytes.
#[derive(Default)]
struct Dump(Vec<(String, Vec<u8>)>);

impl Dump {
    fn push(&mut self, place: impl Into<String>, bytes: impl Into<Vec<u8>>) {
        self.0.push((place.into(), bytes.into()));
    }

    /// Every place where one of `needles` appears, and in which form.
    fn leaks(&self, needles: &[&str]) -> Vec<String> {
        let mut found = Vec::new();
        for (place, bytes) in &self.0 {
            for needle in needles {
                if let Some(form) = leak_form(bytes, needle.as_bytes()) {
                    found.push(format!("{needle:?} ({form}) in {place}"));
                }
            }
        }
        found
    }

    fn holds(&self, what: &[u8]) -> bool {
        self.0.iter().any(|(_, bytes)| contains(bytes, what))
    }

    fn bytes(&self) -> usize {
        self.0.iter().map(|(_, b)| b.len()).sum()
    }

    /// Prints the dump (run with `--nocapture` to see it), each value escaped and cut short.
    fn print(&self, title: &str) {
        eprintln!(
            "--- {title}: {} pieces, {} bytes ---",
            self.0.len(),
            self.bytes()
        );
        for (place, bytes) in &self.0 {
            let shown: String = bytes.escape_ascii().to_string().chars().take(240).collect();
            eprintln!("{place} [{} bytes]: {shown}", bytes.len());
        }
    }
}

/// A recovery point in the encoding before c02a3b3 (version 1), which kept the scope in the
/// clear: version, generation (u64), scope length (u16) and scope, step length (u8) and
/// step, data length (u16) and data.
fn version_1_point(generation: u64, scope: &str, step: &str, data: &[u8]) -> Vec<u8> {
    let mut v = vec![1u8];
    v.extend_from_slice(&generation.to_be_bytes());
    v.extend_from_slice(&(scope.len() as u16).to_be_bytes());
    v.extend_from_slice(scope.as_bytes());
    v.push(step.len() as u8);
    v.extend_from_slice(step.as_bytes());
    v.extend_from_slice(&(data.len() as u16).to_be_bytes());
    v.extend_from_slice(data);
    v
}

#[test]
fn the_detector_finds_a_scope_in_the_clear_in_hex_and_in_base64() {
    let scope = "alice@example.com-4242-1700000000";
    let old = version_1_point(1, scope, "reserved", b"pay_123");
    assert!(leaks(&old, scope.as_bytes()), "raw");
    // As Postgres prints a bytea (`t::text`), and as base64 at every alignment.
    let mut text = b"(\\x".to_vec();
    text.extend_from_slice(&hex(&old, false));
    assert!(leaks(&text, scope.as_bytes()), "hex");
    assert!(leaks(&hex(&old, true), scope.as_bytes()), "HEX");
    for pad in 0..3 {
        let mut v = vec![b'x'; pad];
        v.extend_from_slice(&old);
        assert!(leaks(&base64(&v, STD), scope.as_bytes()), "base64 {pad}");
        assert!(leaks(&base64(&v, URL_SAFE), scope.as_bytes()), "url {pad}");
    }
    // Case-sensitive, and not fooled by a part of the needle.
    assert!(!leaks(&old, b"ALICE@example.com-4242-1700000000"));
    assert!(!leaks(b"alice@example.com-4242", scope.as_bytes()));

    // The store still reads such a point, with its scope hashed; what it writes (version 2)
    // holds the scope's id, not the scope.
    let point = tower_idempotency::RecoveryPoint::decode(Bytes::from(old)).unwrap();
    assert_eq!(point.scope_id(), ScopeId::new(Some(scope)));
    assert_eq!(
        (point.step(), &point.data()[..]),
        ("reserved", &b"pay_123"[..])
    );
    let new = point.encode();
    assert_eq!(new[0], 2, "written as version 2");
    assert!(!leaks(&new, scope.as_bytes()));
    assert!(contains(&new, ScopeId::new(Some(scope)).as_bytes()));
    assert!(contains(&new, b"reserved") && contains(&new, b"pay_123"));
}

// ---- the scenario, through the layer -------------------------------------------------------

const STEP: &str = "reserved";
const DATA: &str = "pay_123";

/// A scope and two keys no other test or run uses, and the records they name.
struct Client {
    unique: String,
    scope: String,
    /// The request whose holder dies after saving its point.
    dead_key: String,
    /// A request that saves a point and completes.
    done_key: String,
}

impl Client {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let unique = format!("{}-{nanos}", std::process::id());
        Self {
            scope: format!("alice@example.com-{unique}"),
            dead_key: format!("order-key-{unique}"),
            done_key: format!("order-key-{unique}-done"),
            unique,
        }
    }

    /// What must never be stored in any form.
    fn secrets(&self) -> [&str; 4] {
        [&self.scope, &self.dead_key, &self.done_key, &self.unique]
    }

    fn dead_id(&self) -> RecordId {
        RecordId::new(Some(&self.scope), &self.dead_key)
    }

    fn done_id(&self) -> RecordId {
        RecordId::new(Some(&self.scope), &self.done_key)
    }

    fn scope_id(&self) -> ScopeId {
        ScopeId::new(Some(&self.scope))
    }
}

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<ResponseBody<Full<Bytes>>>,
    Infallible,
>;

type Pending =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<Full<Bytes>>>, Infallible>> + Send>>;

/// The layer over `store`, scoped to `client.scope`, and a handler that saves a point; on
/// `/die` it then tells `saved` and never goes on.
fn service(store: impl IdempotencyStore, client: &Client, saved: Arc<Notify>) -> Svc {
    let timing = Timing::new(Duration::from_secs(30), Duration::from_secs(120))
        .unwrap()
        .with_store_timeout(Duration::from_secs(2))
        .unwrap();
    let scope = client.scope.clone();
    let layer = IdempotencyLayer::new(store)
        .with_scope(move |_| Some(scope.clone()))
        .with_timing(timing);
    let inner = service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let saved = saved.clone();
        async move {
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .expect("a keyed request has a context");
            ctx.save_recovery_point(STEP, DATA).await.unwrap();
            if req.uri().path() == "/die" {
                saved.notify_one();
                std::future::pending::<()>().await;
            }
            let mut res = Response::new(Full::new(Bytes::from_static(br#"{"id":"pay_456"}"#)));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        }
    });
    tower::util::BoxCloneService::new(layer.layer(inner))
}

/// One request completes; another saves its point and its holder dies.
#[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
async fn complete_one_and_die_in_another(store: impl IdempotencyStore + Clone, client: &Client) {
    let saved = Arc::new(Notify::new());
    let svc = service(store.clone(), client, saved.clone());

    let res = svc
        .clone()
        .oneshot(support::post("/done", Some(&client.done_key), "{}"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    support::body_bytes(res).await;

    let mut dying: Pending = Box::pin(svc.clone().oneshot(support::post(
        "/die",
        Some(&client.dead_key),
        "{}",
    )));
    tokio::select! {
        r = &mut dying => panic!("the holder answered instead of dying: {:?}", r.map(|r| r.status())),
        () = saved.notified() => {}
    }
    std::mem::forget(dying);

    // What the store says it holds: the dead holder's record in progress, with its point.
    let record = store.get(&client.dead_id()).await.unwrap().expect("saved");
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    let point = record.recovery_point.expect("the point");
    assert_eq!((point.step(), &point.data()[..]), (STEP, DATA.as_bytes()));
    assert_eq!(point.scope_id(), client.scope_id());
    let done = store.get(&client.done_id()).await.unwrap().expect("kept");
    assert!(matches!(done.state, RecordState::Completed(_)));
}

/// Asserts the dump holds what it should and none of `client`'s secrets in any form.
fn check(dump: &Dump, client: &Client, what: &str) {
    dump.print(what);
    assert!(
        !dump.0.is_empty() && dump.bytes() > 0,
        "{what}: nothing dumped"
    );
    let dead = client.dead_id();
    assert!(
        dump.holds(dead.as_bytes()) || dump.holds(dead.to_hex().as_bytes()),
        "{what}: the dead holder's record id is not in the dump"
    );
    let done = client.done_id();
    assert!(
        dump.holds(done.as_bytes()) || dump.holds(done.to_hex().as_bytes()),
        "{what}: the completed record's id is not in the dump"
    );
    let scope = client.scope_id();
    assert!(
        dump.holds(scope.as_bytes()) || dump.holds(scope.to_hex().as_bytes()),
        "{what}: the scope's id (quotas are on) is not in the dump"
    );
    assert!(
        dump.holds(STEP.as_bytes()) && dump.holds(DATA.as_bytes()),
        "{what}: the point's step and data are not in the dump"
    );
    assert!(
        dump.holds(br#"{"id":"pay_456"}"#),
        "{what}: the completed answer is not in the dump"
    );
    let leaks = dump.leaks(&client.secrets());
    assert!(
        leaks.is_empty(),
        "{what}: stored in a form a reader can undo:\n{}",
        leaks.join("\n")
    );
}

/// The control: `dump` (taken after the store was given a version-1 point, scope in the
/// clear) must be caught.
fn check_control(dump: &Dump, client: &Client, what: &str) {
    let leaks = dump.leaks(&[client.scope.as_str()]);
    eprintln!("--- {what}: the control's version-1 point is reported: {leaks:?}");
    assert!(
        !leaks.is_empty(),
        "{what}: a point holding the scope in the clear went unnoticed"
    );
}

// ---- Redis -----------------------------------------------------------------------------------

#[cfg(feature = "redis")]
mod redis_store {
    use super::*;
    use tower_idempotency::store::redis::redis::{self, aio::MultiplexedConnection, Value};
    use tower_idempotency::store::redis::RedisStore;

    /// A value's bytes as a list of items (members, fields, scores), each separately, with
    /// a byte between them that neither hex, base64 nor the secrets contain.
    fn flatten(v: &Value, out: &mut Vec<u8>) {
        match v {
            Value::Nil | Value::Okay => {}
            Value::BulkString(b) => out.extend_from_slice(b),
            Value::SimpleString(s) => out.extend_from_slice(s.as_bytes()),
            Value::Array(items) | Value::Set(items) => items.iter().for_each(|i| {
                flatten(i, out);
                out.push(0xff);
            }),
            Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
                flatten(k, out);
                out.push(0xff);
                flatten(v, out);
                out.push(0xff);
            }),
            other => out.extend_from_slice(format!("{other:?}").as_bytes()),
        }
    }

    async fn query(con: &mut MultiplexedConnection, cmd: &mut redis::Cmd) -> Value {
        cmd.query_async(con).await.unwrap()
    }

    /// Every key matching `pattern`: its name, and its value read as its `TYPE` says.
    async fn dump(con: &mut MultiplexedConnection, pattern: &[u8]) -> Dump {
        let mut keys: Vec<Vec<u8>> = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(con)
                .await
                .unwrap();
            keys.extend(batch);
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        keys.sort();
        keys.dedup();
        let mut out = Dump::default();
        for key in keys {
            let name = key.escape_ascii().to_string();
            let kind: String = redis::cmd("TYPE").arg(&key).query_async(con).await.unwrap();
            let value = match kind.as_str() {
                "none" => continue, // gone since the SCAN (another test's, or expired)
                "string" => query(con, redis::cmd("GET").arg(&key)).await,
                "hash" => query(con, redis::cmd("HGETALL").arg(&key)).await,
                "zset" => {
                    query(
                        con,
                        redis::cmd("ZRANGE")
                            .arg(&key)
                            .arg(0)
                            .arg(-1)
                            .arg("WITHSCORES"),
                    )
                    .await
                }
                "set" => query(con, redis::cmd("SMEMBERS").arg(&key)).await,
                "list" => query(con, redis::cmd("LRANGE").arg(&key).arg(0).arg(-1)).await,
                "stream" => query(con, redis::cmd("XRANGE").arg(&key).arg("-").arg("+")).await,
                // A module's type: its serialized form, which holds its strings.
                _ => query(con, redis::cmd("DUMP").arg(&key)).await,
            };
            let mut bytes = Vec::new();
            flatten(&value, &mut bytes);
            out.push(format!("name of {kind} key {name}"), key.clone());
            out.push(format!("value of {kind} key {name}"), bytes);
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_holds_neither_the_key_nor_the_scope_of_a_holder_that_died() {
        let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
            return;
        };
        let client = Client::new();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let prefix = format!("tidem-stored-bytes:{nanos}:");
        let store = RedisStore::builder()
            .with_key_prefix(&prefix)
            .with_max_records_per_scope(NonZeroUsize::new(1000).unwrap())
            .with_max_bytes_per_scope(NonZeroUsize::new(1 << 20).unwrap())
            .connect(&url)
            .await
            .unwrap();
        let mut con = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();

        complete_one_and_die_in_another(store.clone(), &client).await;

        // The store's own keys: the records, the scope group's two quota keys, the
        // recoverable index. All present, so the search below covers each.
        let mut pattern = prefix.clone().into_bytes();
        pattern.push(b'*');
        let ours = dump(&mut con, &pattern).await;
        let names: Vec<String> = ours
            .0
            .iter()
            .filter(|(place, _)| place.starts_with("name of"))
            .map(|(_, name)| String::from_utf8_lossy(name).into_owned())
            .collect();
        let record_key = store.key(&client.dead_id());
        assert!(names.contains(&record_key), "{record_key} in {names:?}");
        assert!(names.contains(&store.key(&client.done_id())), "{names:?}");
        assert!(names.contains(&format!("{prefix}recoverable")), "{names:?}");
        let tag = &client.scope_id().to_hex()[..8];
        for group in ["s", "b"] {
            let k = format!("{prefix}{{{tag}}}{group}");
            assert!(names.contains(&k), "the quota key {k} in {names:?}");
        }
        check(&ours, &client, "Redis, the store's keys");
        // And to be safe every key of the database (other tests' too: none knows these
        // secrets, so any hit is this test's).
        let all = dump(&mut con, b"*").await;
        assert!(all.0.len() >= ours.0.len());
        let leaks = all.leaks(&client.secrets());
        assert!(leaks.is_empty(), "in the database:\n{}", leaks.join("\n"));

        // The control: the same record with a version-1 point, as the store wrote it before
        // c02a3b3 (scope in the clear). Same header (format 3: 146 bytes), same expiry.
        let stored: Vec<u8> = redis::cmd("GET")
            .arg(&record_key)
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(&stored[..2], b"3r", "a counted record holding a point");
        let mut old = stored[..146].to_vec();
        old.extend_from_slice(&version_1_point(1, &client.scope, STEP, DATA.as_bytes()));
        let () = redis::cmd("SET")
            .arg(&record_key)
            .arg(old.as_slice())
            .arg("KEEPTTL")
            .query_async(&mut con)
            .await
            .unwrap();
        check_control(&dump(&mut con, &pattern).await, &client, "Redis");
        // The store still reads it, the scope hashed.
        let record = store.get(&client.dead_id()).await.unwrap().unwrap();
        let point = record.recovery_point.unwrap();
        assert_eq!((point.step(), point.scope_id()), (STEP, client.scope_id()));

        // Clean up: every key under the prefix.
        for (place, name) in &ours.0 {
            if place.starts_with("name of") {
                let _: Value = query(&mut con, redis::cmd("DEL").arg(name.as_slice())).await;
            }
        }
    }
}

// ---- Postgres --------------------------------------------------------------------------------

#[cfg(feature = "postgres")]
mod postgres_store {
    use super::*;
    use crate::support::pg::{self, TestSchema};
    use tower_idempotency::store::postgres::tokio_postgres::Client as PgClient;

    /// Every row of every table in `schema`, as text, and every `bytea` column's raw bytes.
    async fn dump(db: &PgClient, schema: &str) -> Dump {
        let mut out = Dump::default();
        let tables = db
            .query(
                "SELECT table_name::text FROM information_schema.tables
                  WHERE table_schema = $1 ORDER BY 1",
                &[&schema],
            )
            .await
            .unwrap();
        assert!(!tables.is_empty(), "no table in {schema}");
        for t in tables {
            let table: String = t.get(0);
            for row in db
                .query(&format!("SELECT t::text FROM {schema}.{table} t"), &[])
                .await
                .unwrap()
            {
                let text: String = row.get(0);
                out.push(format!("row of {table}"), text);
            }
            let columns = db
                .query(
                    "SELECT column_name::text FROM information_schema.columns
                      WHERE table_schema = $1 AND table_name = $2 AND data_type = 'bytea'
                      ORDER BY ordinal_position",
                    &[&schema, &table],
                )
                .await
                .unwrap();
            for c in columns {
                let column: String = c.get(0);
                for row in db
                    .query(&format!("SELECT {column} FROM {schema}.{table}"), &[])
                    .await
                    .unwrap()
                {
                    if let Some(bytes) = row.get::<_, Option<Vec<u8>>>(0) {
                        out.push(format!("{table}.{column}"), bytes);
                    }
                }
            }
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_holds_neither_the_key_nor_the_scope_of_a_holder_that_died() {
        let Some(url) = pg::url() else { return };
        let client = Client::new();
        let schema = TestSchema::create(&url, "storedbytes").await;
        let store = pg::store_with(&url, &schema, 4, "stored-bytes", |b| {
            b.with_max_records_per_scope(NonZeroUsize::new(1000).unwrap())
                .with_max_bytes_per_scope(NonZeroUsize::new(1 << 20).unwrap())
        })
        .await;
        let db = pg::admin(&url).await;

        complete_one_and_die_in_another(store.clone(), &client).await;

        let rows = dump(&db, &schema.name).await;
        assert_eq!(
            rows.0
                .iter()
                .filter(|(place, _)| place.starts_with("row of"))
                .count(),
            2,
            "two records"
        );
        // The bytea text form is `\x` and hex: the record id as Postgres prints it.
        let printed = format!("\\x{}", client.dead_id().to_hex());
        assert!(rows.holds(printed.as_bytes()), "{printed} in the rows");
        check(&rows, &client, "Postgres");

        // The control: the same row with a version-1 point (scope in the clear).
        let old = version_1_point(1, &client.scope, STEP, DATA.as_bytes());
        let n = db
            .execute(
                &format!(
                    "UPDATE {} SET recovery_point = $1 WHERE id = $2",
                    schema.table()
                ),
                &[&old, &client.dead_id().as_bytes().as_slice()],
            )
            .await
            .unwrap();
        assert_eq!(n, 1);
        check_control(&dump(&db, &schema.name).await, &client, "Postgres");
        let record = store.get(&client.dead_id()).await.unwrap().unwrap();
        let point = record.recovery_point.unwrap();
        assert_eq!((point.step(), point.scope_id()), (STEP, client.scope_id()));

        drop(store);
        schema.drop_now().await;
    }
}
