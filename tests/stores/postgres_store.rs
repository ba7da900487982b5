//! The conformance suite and the Postgres-specific guarantees of `PostgresStore`.
//!
//! Needs `IDEMPOTENCY_TEST_POSTGRES_URL` (e.g. `postgres://postgres@127.0.0.1:5432/test`, a
//! role that may create schemas and roles); skipped with a printed reason when unset, unless
//! `IDEMPOTENCY_REQUIRE_BACKENDS=1`. Each test works in a schema of its own and drops it.
use crate::support::pg as pg_support;
use tower_idempotency::{conformance, conformance_suite};

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use conformance::{fp, response, unique_id, DynStore};
use pg_support::{admin, eventually, mode, pool, pool_from, store_in, unique, Proxy, TestSchema};
use tokio::sync::{Barrier, Notify};
use tower_idempotency::store::postgres::{PostgresStore, SetupError};
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyStore, StoreError, StoreErrorKind,
};
use tower_idempotency::store::{RecordId, RecordState, ScopeId, Token};

const LEASE: Duration = Duration::from_secs(30);
/// A lease short enough to lapse within a test.
const SHORT_LEASE: Duration = Duration::from_millis(60);
const TTL: Duration = Duration::from_secs(600);

/// One shared table for the suite: its checks use unique record ids, so they never collide,
/// and a fixed name keeps repeated runs from leaving tables behind.
async fn conformance_store() -> Option<DynStore> {
    let url = pg_support::url()?;
    // 16 connections: the 64-claim race runs 16 statements at once.
    let store = PostgresStore::builder()
        .with_table("tidem_conformance")
        .unwrap()
        .build(pool(&url, 16, "tidem-conformance"));
    store.migrate().await.unwrap();
    store.delete_expired().await.unwrap();
    Some(Arc::new(store) as DynStore)
}

/// A store that fills up at 40 records. Postgres has no record limit of its own; it is full
/// when its disk is (SQLSTATE `53100`, which the store answers as `Full`). Filling a real disk
/// is out of reach of a test on a shared server, so a trigger raises that same SQLSTATE for
/// an insert of a new id beyond 40 rows, as the server does when it cannot write a new tuple.
/// A claim of an existing id inserts nothing, so replays still work, as on a full disk.
async fn full_store() -> Option<DynStore> {
    let url = pg_support::url()?;
    let schema = TestSchema::create(&url, "full").await;
    let store = store_in(&url, &schema, 4, "tidem-full").await;
    let table = schema.table();
    admin(&url)
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION {s}.refuse_when_full() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NOT EXISTS (SELECT FROM {table} WHERE id = NEW.id)
                    AND (SELECT count(*) FROM {table}) >= 40 THEN
                     RAISE EXCEPTION 'could not extend file: No space left on device'
                         USING ERRCODE = 'disk_full';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_when_full BEFORE INSERT ON {table}
                 FOR EACH ROW EXECUTE FUNCTION {s}.refuse_when_full();",
            s = schema.name
        ))
        .await
        .unwrap();
    Some(Arc::new(WithSchema {
        store,
        schema: Some(schema),
    }) as DynStore)
}

/// A store that drops its schema when dropped.
struct WithSchema {
    store: PostgresStore,
    schema: Option<TestSchema>,
}

impl Drop for WithSchema {
    fn drop(&mut self) {
        let Some(schema) = self.schema.take() else {
            return;
        };
        // Drop runs inside the test's runtime: drop the schema from a thread of its own.
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(schema.drop_now());
        })
        .join()
        .unwrap();
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for WithSchema {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.store.claim(request).await
    }

    async fn extend(
        &self,
        id: &tower_idempotency::store::RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.store.extend(id, token, lease).await
    }

    async fn complete(
        &self,
        id: &tower_idempotency::store::RecordId,
        token: &Token,
        completion: &tower_idempotency::store::Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.store.complete(id, token, completion, ttl).await
    }

    async fn release(
        &self,
        id: &tower_idempotency::store::RecordId,
        token: &Token,
    ) -> Result<(), StoreError> {
        self.store.release(id, token).await
    }

    async fn get(
        &self,
        id: &tower_idempotency::store::RecordId,
    ) -> Result<Option<tower_idempotency::store::Record>, StoreError> {
        self.store.get(id).await
    }
}

conformance_suite! {
    store: conformance_store(),
    full: full_store(),
    admin: admin_store(),
    recovery: conformance_store(),
}

async fn admin_store() -> Option<conformance::DynAdminStore> {
    let url = pg_support::url()?;
    let store = PostgresStore::builder()
        .with_table("tidem_conformance")
        .unwrap()
        .build(pool(&url, 2, "tidem-admin"));
    store.migrate().await.unwrap();
    Some(Arc::new(store) as conformance::DynAdminStore)
}

fn claimed(outcome: ClaimOutcome) -> Token {
    match outcome {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// Runs every statement once, so the single pooled connection has them all prepared and
/// the next statement sent is the one a test means to lose.
async fn warm(store: &PostgresStore) {
    let id = unique_id("warm");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(99), LEASE, TTL))
            .await
            .unwrap(),
    );
    store.extend(&id, &t, LEASE).await.unwrap();
    store
        .complete(&id, &t, &response(200, "warm"), TTL)
        .await
        .unwrap();
    store.get(&id).await.unwrap();
    let id = unique_id("warm-release");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(99), LEASE, TTL))
            .await
            .unwrap(),
    );
    store.release(&id, &t).await.unwrap();
    // A takeover of a lapsed lease, so claim_call.sql is prepared too.
    let id = lapsed(store, "warm-takeover").await;
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(98), LEASE, TTL))
            .await
            .unwrap(),
    );
    assert_eq!(t.generation(), 2, "the lapsed lease was taken over");
    store.release(&id, &t).await.unwrap();
}

/// A record whose short lease has lapsed, of request `fp(98)`: the next claim of it with that
/// fingerprint takes it over, in two statements (the read, then claim_call.sql).
async fn lapsed(store: &PostgresStore, label: &str) -> RecordId {
    let id = unique_id(label);
    claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(98), SHORT_LEASE, TTL))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE * 3).await;
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_of_a_new_table_all_succeed() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "migrate").await;
    const N: usize = 8;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            // A pool of one per task: eight separate sessions race on the DDL.
            let store = PostgresStore::builder()
                .with_table(&schema.table())
                .unwrap()
                .build(pool(&url, 1, &format!("tidem-migrate-{i}")));
            let barrier = barrier.clone();
            tokio::spawn(async move {
                // Open the connection first, so the barrier releases the DDL itself.
                drop(store.pool().get().await.unwrap());
                barrier.wait().await;
                store.migrate().await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().expect("every concurrent migrate succeeds");
    }
    let admin = admin(&url).await;
    let indexes: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'records'",
            &[&schema.name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        indexes, 4,
        "primary key, expires_at, scope and recovery indexes"
    );
    // And once more, on an existing table.
    let store = store_in(&url, &schema, 1, "tidem-migrate-again").await;
    store.migrate().await.unwrap();
    schema.drop_now().await;
}

/// Every event at INFO and above, as `LEVEL target: message`; records of the `log` crate
/// (tokio-postgres logs with it) arrive through `tracing_log::LogTracer`.
#[derive(Clone, Default)]
struct Events(Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        use tracing_log::NormalizeEvent;
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" {
                    self.0 = format!("{v:?}");
                }
            }
        }
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or(event.metadata());
        if *meta.level() <= tracing::Level::INFO {
            let mut message = Message(String::new());
            event.record(&mut message);
            let line = format!("{} {}: {}", meta.level(), meta.target(), message.0);
            self.0.lock().unwrap().push(line);
        }
    }
}

// Current-thread: the pool's connection tasks, which log the notices, run on this thread,
// under the subscriber set for it.
#[tokio::test(flavor = "current_thread")]
async fn migrating_an_up_to_date_table_logs_no_notice() {
    use tracing_subscriber::layer::SubscriberExt;
    let Some(url) = pg_support::url() else { return };
    let _ = tracing_log::LogTracer::init();
    let events = Events::default();
    let subscriber = tracing_subscriber::registry().with(events.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    let schema = TestSchema::create(&url, "quiet").await;
    let store = store_in(&url, &schema, 1, "tidem-quiet").await;
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    // The capture does see the driver's notices, on the very connection migrate used (a pool
    // of one): the quieter setting ended with the migration.
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute("DO $$ BEGIN RAISE NOTICE 'tidem probe'; END $$")
        .await
        .unwrap();
    let events = events.0.lock().unwrap().clone();
    schema.drop_now().await;

    assert!(
        events
            .iter()
            .any(|e| e.starts_with("INFO tokio_postgres") && e.contains("NOTICE: tidem probe")),
        "{events:#?}"
    );
    let notices: Vec<_> = events
        .iter()
        .filter(|e| e.contains("NOTICE") && !e.contains("tidem probe"))
        .collect();
    assert!(notices.is_empty(), "{notices:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_are_validated_and_used_quoted() {
    let Some(url) = pg_support::url() else { return };
    let p = pool(&url, 1, "tidem-names");
    for bad in ["a.b.c", "Records", "x; DROP TABLE y", "\"q\"", ""] {
        assert!(PostgresStore::builder().with_table(bad).is_err(), "{bad:?}");
    }
    // A reserved word works as a table name, because names are quoted.
    let schema = TestSchema::create(&url, "names").await;
    let store = PostgresStore::builder()
        .with_table(&format!("{}.order", schema.name))
        .unwrap()
        .build(p);
    store.migrate().await.unwrap();
    let id = unique_id("reserved");
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    store
        .complete(&id, &token, &response(200, "ok"), TTL)
        .await
        .unwrap();
    assert!(store.get(&id).await.unwrap().is_some());
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_connection_is_idle_in_transaction_while_the_handler_runs() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "idle").await;
    let app = unique("app");
    let store = store_in(&url, &schema, 4, &app).await;
    let admin = admin(&url).await;
    let sessions = |state: &'static str| {
        let (admin, app) = (&admin, app.clone());
        async move {
            let n: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = $1 AND state = $2",
                    &[&app, &state],
                )
                .await
                .unwrap()
                .get(0);
            n
        }
    };

    let (claimed_note, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let id = unique_id("slow");
    let mut handler = {
        let (store, claimed_note, gate) = (store.clone(), claimed_note.clone(), gate.clone());
        tokio::spawn(async move {
            let token = claimed(
                store
                    .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
                    .await
                    .unwrap(),
            );
            claimed_note.notify_one();
            gate.notified().await; // the slow handler
            store
                .complete(&id, &token, &response(201, "done"), TTL)
                .await
        })
    };
    tokio::select! {
        _ = claimed_note.notified() => {}
        early = &mut handler => panic!("the handler ended before its claim: {early:?}"),
    }
    // The claim committed and gave its connection back: nothing is checked out, and the
    // session the claim used is plain idle.
    let status = store.pool().status();
    assert_eq!(
        status.available, status.size,
        "a connection is held: {status:?}"
    );
    assert!(
        sessions("idle").await >= 1,
        "the store's sessions are not visible"
    );
    assert_eq!(sessions("idle in transaction").await, 0);
    assert!(matches!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::InProgress { .. }
    ));

    // The check can see an open transaction, so the zero above means something.
    let mut conn = store.pool().get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    tx.execute("SELECT 1", &[]).await.unwrap();
    assert_eq!(sessions("idle in transaction").await, 1);
    tx.rollback().await.unwrap();
    drop(conn);

    gate.notify_one();
    handler.await.unwrap().unwrap();
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "done"))
    );
    drop(store);
    schema.drop_now().await;
}

/// Runs 64 claims of `id` at once; returns the claims won and the records the others saw.
async fn race(
    store: &PostgresStore,
    id: tower_idempotency::store::RecordId,
    f: tower_idempotency::store::Fingerprint,
) -> (
    Vec<tower_idempotency::store::Claim>,
    Vec<tower_idempotency::store::Record>,
) {
    const N: usize = 64;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&ClaimRequest::new(&id, &f, LEASE, TTL)).await
            })
        })
        .collect();
    let (mut won, mut seen) = (Vec::new(), Vec::new());
    for t in tasks {
        match t.await.unwrap().expect("claim") {
            ClaimOutcome::Claimed(c) => won.push(c),
            ClaimOutcome::Existing(r) => seen.push(r),
            other => panic!("a claim is Claimed or Existing: {other:?}"),
        }
    }
    (won, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_claims_of_an_expired_record_replace_it_once() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "race-exp").await;
    let store = store_in(&url, &schema, 16, "tidem-race-expired").await;
    let id = unique_id("race-expired");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    let ttl = Duration::from_millis(300);
    store
        .complete(&id, &t, &response(200, "old"), ttl)
        .await
        .unwrap();
    tokio::time::sleep(ttl + Duration::from_millis(200)).await; // wait out the TTL

    // Another request reuses the key after expiry: exactly one replaces the row.
    let (won, seen) = race(&store, id, fp(2)).await;
    assert_eq!(won.len(), 1, "claims won: {won:?}");
    assert!(
        !won[0].takeover,
        "an expired record is replaced, not taken over"
    );
    assert_eq!(won[0].token.generation(), 1);
    for r in seen {
        assert_eq!(r.fingerprint, fp(2), "someone saw the expired record");
        assert!(
            matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
        );
    }
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_takeovers_of_a_lapsed_lease_succeed_once() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "race-lapse").await;
    let store = store_in(&url, &schema, 16, "tidem-race-lapsed").await;
    let id = unique_id("race-lapsed");
    let lease = Duration::from_millis(300);
    let old = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), lease, TTL))
            .await
            .unwrap(),
    );
    tokio::time::sleep(lease + Duration::from_millis(200)).await; // wait out the lease

    let (won, seen) = race(&store, id, fp(1)).await;
    assert_eq!(won.len(), 1, "claims won: {won:?}");
    assert!(won[0].takeover);
    assert_eq!(won[0].token.generation(), old.generation() + 1);
    for r in seen {
        assert_eq!(
            r.generation,
            old.generation() + 1,
            "someone saw the lapsed claim"
        );
        assert!(
            matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
        );
    }
    assert_eq!(
        store.extend(&id, &old, LEASE).await.unwrap_err().kind(),
        StoreErrorKind::Fenced
    );
    drop(store);
    schema.drop_now().await;
}

/// A role whose sessions default to SERIALIZABLE, with its own schema.
struct SerializableRole {
    role: String,
    schema: TestSchema,
    url: String,
}

impl SerializableRole {
    async fn create(url: &str) -> Self {
        let schema = TestSchema::create(url, "ser").await;
        let role = unique("role");
        admin(url)
            .await
            .batch_execute(&format!(
                // A password too, so the role can log in where pg_hba asks for one.
                "CREATE ROLE {role} LOGIN PASSWORD '{role}';
                 ALTER ROLE {role} SET default_transaction_isolation = 'serializable';
                 GRANT USAGE, CREATE ON SCHEMA {s} TO {role};",
                s = schema.name
            ))
            .await
            .unwrap();
        Self {
            role,
            schema,
            url: url.to_owned(),
        }
    }

    /// A migrated store connected as the role (it owns the table).
    async fn store(&self, size: usize, app: &str) -> PostgresStore {
        let mut cfg = pg_support::config(&self.url);
        cfg.user(&self.role).password(self.role.as_bytes());
        let store = PostgresStore::builder()
            .with_table(&self.schema.table())
            .unwrap()
            .build(pool_from(cfg, size, app));
        let conn = store.pool().get().await.unwrap();
        let level: String = conn
            .query_one("SHOW transaction_isolation", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(level, "serializable", "the role's default did not apply");
        drop(conn);
        store.migrate().await.unwrap();
        store
    }

    async fn drop_now(self) {
        self.schema.drop_now().await;
        admin(&self.url)
            .await
            .batch_execute(&format!("DROP ROLE {}", self.role))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serializable_role_keeps_exactly_one_claim_among_64() {
    let Some(url) = pg_support::url() else { return };
    let role = SerializableRole::create(&url).await;
    let store = role.store(24, "tidem-ser-race").await;
    for _ in 0..3 {
        conformance::concurrent_claims_of_one_key_yield_exactly_one_claimed(Arc::new(
            store.clone(),
        ))
        .await;
    }
    // Serialization failures happen only when sessions really overlap; the deterministic
    // check is the next test. Print what this run saw.
    println!(
        "serialization failures retried over 3 x 64 claims: {}",
        store.serialization_retries()
    );
    drop(store);
    role.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_claim_retries_a_serialization_failure_instead_of_failing() {
    let Some(url) = pg_support::url() else { return };
    let role = SerializableRole::create(&url).await;
    let app = unique("ser");
    let store = role.store(2, &app).await;
    let id = unique_id("ser-conflict");

    // Another session inserts the record and keeps its transaction open.
    let mut other = admin(&url).await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        &format!(
            "INSERT INTO {} (id, fingerprint, state, generation, nonce, locked_until,
                             created_at, expires_at)
             VALUES ($1, $2, 0, 1, $3, now() + interval '30 s', now(), now() + interval '10 min')",
            role.schema.table()
        ),
        &[
            &id.as_bytes().as_slice(),
            &fp(7).as_bytes().as_slice(),
            &[9u8; 16].as_slice(),
        ],
    )
    .await
    .unwrap();

    // The claim's insert waits on that row; once it commits, the claim's snapshot cannot
    // see it, which SERIALIZABLE reports as 40001.
    let claim = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .claim(&ClaimRequest::new(&id, &fp(7), LEASE, TTL))
                .await
        })
    };
    let watcher = admin(&url).await;
    let waiting = eventually(10, || async {
        let n: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&app],
            )
            .await
            .unwrap()
            .get(0);
        n == 1
    })
    .await;
    assert!(waiting, "the claim never blocked on the uncommitted row");
    tx.commit().await.unwrap();

    match claim
        .await
        .unwrap()
        .expect("a serialization failure must be retried")
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, fp(7));
            assert!(
                matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::ZERO)
            );
        }
        other => {
            panic!("the other session holds the key, got {other:?}")
        }
    }
    assert!(
        store.serialization_retries() >= 1,
        "expected a retried 40001, saw {}",
        store.serialization_retries()
    );
    drop(store);
    role.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_are_two_for_new_and_one_for_replay_or_conflict() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "rtt").await;
    store_in(&url, &schema, 1, "tidem-rtt-setup").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pool_from(proxy.config(&url), 1, "tidem-rtt"));

    // Connect and prepare every statement once on the single connection.
    warm(&store).await;

    let mut measure = {
        let mut last = proxy.round_trips();
        move |proxy: &Proxy| {
            let now = proxy.round_trips();
            let d = now - last;
            last = now;
            d
        }
    };
    measure(&proxy);

    let id = unique_id("new");
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(2), LEASE, TTL))
            .await
            .unwrap(),
    );
    store
        .complete(&id, &token, &response(201, "created"), TTL)
        .await
        .unwrap();
    let new = measure(&proxy);

    match store
        .claim(&ClaimRequest::new(&id, &fp(2), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "created")))
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    let replay = measure(&proxy);

    let busy = unique_id("busy");
    claimed(
        store
            .claim(&ClaimRequest::new(&busy, &fp(3), LEASE, TTL))
            .await
            .unwrap(),
    );
    measure(&proxy);
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&busy, &fp(3), LEASE, TTL))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));
    let conflict = measure(&proxy);
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&busy, &fp(4), LEASE, TTL))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));
    let mismatch = measure(&proxy);

    // The other operations are one statement each too.
    let ops = unique_id("ops2");
    let t2 = claimed(
        store
            .claim(&ClaimRequest::new(&ops, &fp(5), LEASE, TTL))
            .await
            .unwrap(),
    );
    measure(&proxy);
    store.extend(&ops, &t2, LEASE).await.unwrap();
    let extend = measure(&proxy);
    store.get(&ops).await.unwrap();
    let get = measure(&proxy);
    store.release(&ops, &t2).await.unwrap();
    let release = measure(&proxy);

    // A takeover of a lapsed lease is the one claim that takes a second statement.
    let old = lapsed(&store, "takeover").await;
    measure(&proxy);
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&old, &fp(98), LEASE, TTL))
            .await
            .unwrap(),
    );
    let takeover = measure(&proxy);
    assert!(t.generation() > 1, "taken over: {}", t.generation());

    println!(
        "round trips: new {new}, replay {replay}, conflict {conflict}, mismatch {mismatch}, \
         extend {extend}, get {get}, release {release}, takeover {takeover}"
    );
    assert_eq!((new, replay, conflict, mismatch), (2, 1, 1, 1));
    assert_eq!((extend, get, release, takeover), (1, 1, 1, 2));
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_claim_reply_is_read_back_as_claimed() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "lost").await;
    let direct = store_in(&url, &schema, 1, "tidem-lost-direct").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pool_from(proxy.config(&url), 1, "tidem-lost"));
    let id = unique_id("lost");
    warm(&store).await;

    // The claim commits, its reply is lost with the connection; the store reads it back.
    let before = proxy.connections();
    proxy.next_reply(mode::CUT, mode::PASS);
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .expect("read back"),
    );
    assert_eq!(proxy.connections(), before + 1, "the reply was not lost");
    assert_eq!(token.generation(), 1);
    assert!(matches!(
        direct
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));

    // Same for a complete: the read-back finds it done with our token.
    proxy.next_reply(mode::CUT, mode::PASS);
    store
        .complete(&id, &token, &response(201, "once"), TTL)
        .await
        .expect("read back");
    assert_eq!(
        direct.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "once"))
    );
    // A second complete with the same token is a resend: Ok, and the first answer stands.
    store
        .complete(&id, &token, &response(500, "twice"), TTL)
        .await
        .expect("idempotent per token");
    assert_eq!(
        direct.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "once"))
    );

    // And for a release.
    let other = unique_id("lost-release");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&other, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    proxy.next_reply(mode::CUT, mode::PASS);
    store.release(&other, &t).await.expect("read back");
    assert!(direct.get(&other).await.unwrap().is_none());
    drop((store, direct));
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_takeover_reply_is_read_back_as_claimed() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "lost_takeover").await;
    let direct = store_in(&url, &schema, 1, "tidem-lost-takeover-direct").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pool_from(proxy.config(&url), 1, "tidem-lost-takeover"));
    warm(&store).await;
    let id = lapsed(&store, "lost-takeover").await;
    let generation = direct.get(&id).await.unwrap().unwrap().generation;

    // The read passes; the reply of the second statement, the claim function's takeover,
    // is lost with its connection. The resend reads its own takeover back.
    let (before, trips) = (proxy.connections(), proxy.round_trips());
    proxy.reply_after(1, mode::CUT, mode::PASS);
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(98), LEASE, TTL))
            .await
            .expect("read back"),
    );
    assert_eq!(proxy.connections(), before + 1, "the reply was not lost");
    assert_eq!(
        proxy.cut_at(),
        trips + 1,
        "the read's reply passed, the call's was cut"
    );
    assert_eq!(token.generation(), generation + 1, "one takeover, not two");
    let record = direct.get(&id).await.unwrap().unwrap();
    assert_eq!(record.generation, generation + 1);
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    // The token read back is the one the store holds: it completes, once.
    store
        .complete(&id, &token, &response(201, "taken over"), TTL)
        .await
        .unwrap();
    assert_eq!(
        direct.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "taken over"))
    );

    // Lost, then the database is unreachable for the resend: unknown, never claimed.
    let other = lapsed(&store, "lost-takeover-unknown").await;
    proxy.reply_after(1, mode::CUT, mode::REFUSE);
    let err = store
        .claim(&ClaimRequest::new(&other, &fp(98), LEASE, TTL))
        .await
        .unwrap_err();
    proxy.set_mode(mode::PASS);
    assert_eq!(err.kind(), StoreErrorKind::Unknown, "{err:?}");
    assert!(matches!(
        direct.get(&other).await.unwrap().unwrap().state,
        RecordState::InProgress { .. }
    ));
    drop((store, direct));
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_claim_is_read_back_on_a_fresh_connection() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "stall").await;
    store_in(&url, &schema, 1, "tidem-stall-setup").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .with_timeout(Duration::from_millis(500))
        .build(pool_from(proxy.config(&url), 1, "tidem-stall"));
    let id = unique_id("stall");
    warm(&store).await;

    // The reply never comes; the connection stays open. After the timeout the store drops
    // that connection and reads back through a new one.
    proxy.next_reply(mode::STALL, mode::PASS);
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .expect("read back"),
    );
    store
        .complete(&id, &token, &response(200, "ok"), TTL)
        .await
        .unwrap();
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_that_cannot_be_read_back_is_unknown_never_claimed() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "unknown").await;
    let direct = store_in(&url, &schema, 1, "tidem-unknown-direct").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pool_from(proxy.config(&url), 1, "tidem-unknown"));
    let id = unique_id("unknown");
    warm(&store).await;

    // The reply is lost, and then the database is unreachable for the read-back.
    proxy.next_reply(mode::CUT, mode::REFUSE);
    let err = store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unknown, "{err:?}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the cause is kept"
    );
    // It had in fact committed: reporting Unavailable ("nothing happened") would be wrong.
    assert!(matches!(
        direct.get(&id).await.unwrap().unwrap().state,
        RecordState::InProgress { .. }
    ));

    // Nothing sent at all: plain Unavailable.
    let err = store.get(&id).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    drop((store, direct));
    schema.drop_now().await;
}

/// Needs no server: it checks what the store says when there is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_is_unavailable() {
    // A port nothing listens on: the connection is refused before anything is sent.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let store = PostgresStore::new(pool(&url, 1, "tidem-dead"));
    for err in [
        store
            .claim(&ClaimRequest::new(&unique_id("dead"), &fp(1), LEASE, TTL))
            .await
            .unwrap_err(),
        store.get(&unique_id("dead")).await.unwrap_err(),
    ] {
        assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
        assert!(
            std::error::Error::source(&err).is_some(),
            "the driver error is kept"
        );
    }
    // Setup errors say what went wrong in their text.
    for err in [
        PostgresStore::connect(&url).await.unwrap_err(),
        store.migrate().await.unwrap_err(),
        store.verify().await.unwrap_err(),
    ] {
        assert!(matches!(err, SetupError::Connect(_)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with("could not connect to Postgres") && text.contains("refused"),
            "{text}"
        );
    }
    let err = PostgresStore::connect("postgres://[nope")
        .await
        .unwrap_err();
    assert!(matches!(err, SetupError::Url(_)), "{err:?}");
    assert!(
        err.to_string().starts_with("invalid Postgres URL: "),
        "{err}"
    );
}

/// `verify` names a missing table and what to do, and passes once `migrate` ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_missing_table() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "verify").await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pool(&url, 1, "tidem-verify"));
    let err = store.verify().await.unwrap_err();
    assert!(matches!(err, SetupError::MissingTable { .. }), "{err:?}");
    // migrate into a schema that does not exist says so.
    let migrate_err = PostgresStore::builder()
        .with_table(&format!("{}_absent.records", schema.name))
        .unwrap()
        .build(pool(&url, 1, "tidem-verify"))
        .migrate()
        .await
        .unwrap_err();
    assert!(
        matches!(migrate_err, SetupError::Migrate { .. }),
        "{migrate_err:?}"
    );
    assert!(
        migrate_err.to_string().contains("does not exist"),
        "{migrate_err}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&schema.table()) && text.contains("migrate()"),
        "{text}"
    );
    // A schema that does not exist is a missing table too.
    let elsewhere = PostgresStore::builder()
        .with_table(&format!("{}_absent.records", schema.name))
        .unwrap()
        .build(pool(&url, 1, "tidem-verify"));
    assert!(matches!(
        elsewhere.verify().await.unwrap_err(),
        SetupError::MissingTable { .. }
    ));
    // A table of that name without the store's columns.
    admin(&url)
        .await
        .batch_execute(&format!("CREATE TABLE {} (id bytea)", schema.table()))
        .await
        .unwrap();
    let err = store.verify().await.unwrap_err();
    assert!(matches!(err, SetupError::Table { .. }), "{err:?}");
    assert!(err.to_string().contains("does not exist"), "{err}");
    admin(&url)
        .await
        .batch_execute(&format!("DROP TABLE {}", schema.table()))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
    drop((store, elsewhere));
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_expired_removes_expired_records_and_keeps_live_leases() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "sweep").await;
    let store = store_in(&url, &schema, 2, "tidem-sweep").await;
    let short = Duration::from_millis(400);

    // Completed with a short TTL: goes.
    let done = unique_id("done");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&done, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    store
        .complete(&done, &t, &response(200, "x"), short)
        .await
        .unwrap();
    // In progress with short lease and TTL, abandoned: goes.
    let abandoned = unique_id("abandoned");
    claimed(
        store
            .claim(&ClaimRequest::new(&abandoned, &fp(1), short, short))
            .await
            .unwrap(),
    );
    // In progress with a short TTL but a long lease: the claim keeps it max(lease, ttl).
    let long_lease = unique_id("long-lease");
    claimed(
        store
            .claim(&ClaimRequest::new(&long_lease, &fp(1), LEASE, short))
            .await
            .unwrap(),
    );
    // In progress with a live lease whose expires_at was forced into the past (the store
    // never writes that; an operator might): the live lease wins.
    let forced = unique_id("forced");
    claimed(
        store
            .claim(&ClaimRequest::new(&forced, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    let admin = admin(&url).await;
    admin
        .execute(
            &format!(
                "UPDATE {} SET expires_at = now() - interval '1 hour' WHERE id = $1",
                schema.table()
            ),
            &[&forced.as_bytes().as_slice()],
        )
        .await
        .unwrap();
    // Many expired rows, to make the sweep take several batches.
    admin
        .execute(
            &format!(
                "INSERT INTO {} (id, fingerprint, state, generation, nonce, locked_until,
                                 status, headers, body, created_at, expires_at)
                 SELECT sha256(('bulk' || i)::bytea), sha256('fp'::bytea), 1, 1,
                        substring(sha256(('n' || i)::bytea) from 1 for 16),
                        now() - interval '2 hours', 200, NULL, NULL,
                        now() - interval '2 hours', now() - interval '1 hour'
                 FROM generate_series(1, 2500) AS i",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap();

    tokio::time::sleep(short + Duration::from_millis(300)).await; // wait out the TTLs
    assert!(
        store.get(&done).await.unwrap().is_none(),
        "expired reads as absent"
    );
    let deleted = store.delete_expired().await.unwrap();
    assert_eq!(deleted, 2500 + 2);
    assert_eq!(store.delete_expired().await.unwrap(), 0);
    for (id, what) in [
        (long_lease, "long lease"),
        (forced, "forced past expires_at"),
    ] {
        assert!(
            matches!(
                store.get(&id).await.unwrap().map(|r| r.state),
                Some(RecordState::InProgress { .. })
            ),
            "{what}: a live lease was swept"
        );
    }
    let rows: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {}", schema.table()), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 2, "only the two live leases are left");
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeper_runs_until_stopped() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "sweeper").await;
    let store = store_in(&url, &schema, 2, "tidem-sweeper").await;
    let insert_expired = |label: &str| {
        let id = unique_id(label);
        let (url, table) = (url.clone(), schema.table());
        async move {
            admin(&url)
                .await
                .execute(
                    &format!(
                        "INSERT INTO {table} (id, fingerprint, state, generation, nonce,
                             locked_until, status, created_at, expires_at)
                         VALUES ($1, sha256('fp'::bytea), 2, 1, '\\x00000000000000000000000000000000',
                                 now() - interval '2 hours', 200, now() - interval '2 hours',
                                 now() - interval '1 hour')"
                    ),
                    &[&id.as_bytes().as_slice()],
                )
                .await
                .unwrap();
            id
        }
    };
    let count = || {
        let (url, table) = (url.clone(), schema.table());
        async move {
            let n: i64 = admin(&url)
                .await
                .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                .await
                .unwrap()
                .get(0);
            n
        }
    };
    let live = unique_id("live");
    claimed(
        store
            .claim(&ClaimRequest::new(&live, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    insert_expired("gone").await;
    assert_eq!(count().await, 2);

    let sweeper = store.spawn_sweeper(Duration::from_millis(50));
    assert!(
        eventually(10, || async { count().await == 1 }).await,
        "the sweeper did not run"
    );
    sweeper.stop().await;

    insert_expired("stays").await;
    tokio::time::sleep(Duration::from_millis(300)).await; // six sweeper periods
    assert_eq!(count().await, 2, "a stopped sweeper kept deleting");
    assert!(store.get(&live).await.unwrap().is_some());

    // Dropping the handle stops it too.
    let sweeper = store.spawn_sweeper(Duration::from_millis(50));
    assert!(eventually(10, || async { count().await == 1 }).await);
    drop(sweeper);
    drop(store);
    schema.drop_now().await;
}

/// A business table next to the records, for the transactional tests.
async fn orders_table(url: &str, schema: &TestSchema) -> String {
    let table = format!("{}.orders", schema.name);
    admin(url)
        .await
        .batch_execute(&format!("CREATE TABLE {table} (sku text NOT NULL)"))
        .await
        .unwrap();
    table
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_a_rolled_back_transaction_records_nothing_and_the_key_is_taken_over() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "txrb").await;
    let store = store_in(&url, &schema, 2, "tidem-txrb").await;
    let orders = orders_table(&url, &schema).await;
    let id = unique_id("tx-rollback");
    let lease = Duration::from_millis(500);
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), lease, TTL))
            .await
            .unwrap(),
    );

    {
        let mut conn = store.pool().get().await.unwrap();
        let tx = conn.transaction().await.unwrap();
        tx.execute(&format!("INSERT INTO {orders} VALUES ('sku-1')"), &[])
            .await
            .unwrap();
        store
            .complete_in(&tx, &id, &token, &response(201, "ordered"), TTL)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
    }
    assert!(
        matches!(
            store.get(&id).await.unwrap().unwrap().state,
            RecordState::InProgress { .. }
        ),
        "a rolled-back completion must not be recorded"
    );
    let n: i64 = admin(&url)
        .await
        .query_one(&format!("SELECT count(*) FROM {orders}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);

    tokio::time::sleep(lease + Duration::from_millis(250)).await; // wait out the lease
    let taken = match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            c.token
        }
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert!(taken.generation() > token.generation());
    let mut conn = store.pool().get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    let err = store
        .complete_in(&tx, &id, &token, &response(201, "late"), TTL)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Fenced);
    tx.rollback().await.unwrap();
    drop(conn);
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_a_committed_transaction_replays_with_the_business_write() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "txok").await;
    let store = store_in(&url, &schema, 2, "tidem-txok").await;
    let orders = orders_table(&url, &schema).await;
    let id = unique_id("tx-commit");
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );

    let mut conn = store.pool().get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    tx.execute(&format!("INSERT INTO {orders} VALUES ('sku-1')"), &[])
        .await
        .unwrap();
    store
        .complete_in(&tx, &id, &token, &response(201, "ordered"), TTL)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(conn);

    match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "ordered")))
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    let n: i64 = admin(&url)
        .await
        .query_one(&format!("SELECT count(*) FROM {orders}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    // A complete after the handler's is a resend: Ok, and changes nothing. A release is
    // fenced: the record is completed.
    store
        .complete(&id, &token, &response(500, "again"), TTL)
        .await
        .expect("idempotent per token");
    assert_eq!(
        store.release(&id, &token).await.unwrap_err().kind(),
        StoreErrorKind::Fenced
    );
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "ordered"))
    );
    // A forged token is fenced inside a transaction too.
    let other = unique_id("tx-forged");
    claimed(
        store
            .claim(&ClaimRequest::new(&other, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    let conn = store.pool().get().await.unwrap();
    let err = store
        .complete_in(
            &conn,
            &other,
            &Token::generate(1).unwrap(),
            &response(200, "x"),
            TTL,
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Fenced);
    drop(conn);
    drop(store);
    schema.drop_now().await;
}

/// Holds the row of `id` locked (`SELECT … FOR UPDATE` in an open transaction) until dropped
/// or `release`d.
struct RowLock(tokio_postgres_client::Client);

use tower_idempotency::store::postgres::tokio_postgres as tokio_postgres_client;

impl RowLock {
    async fn take(url: &str, table: &str, id: &tower_idempotency::store::RecordId) -> Self {
        let client = admin(url).await;
        client
            .batch_execute(&format!(
                "BEGIN; SELECT FROM {table} WHERE id = decode('{}', 'hex') FOR UPDATE",
                id.to_hex()
            ))
            .await
            .unwrap();
        Self(client)
    }

    async fn release(self) {
        self.0.batch_execute("COMMIT").await.unwrap();
    }
}

/// Statements of `app` still running on the server (waiting on a lock included).
async fn running(url: &str, app: &str) -> i64 {
    admin(url)
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND state = 'active'",
            &[&app],
        )
        .await
        .unwrap()
        .get(0)
}

async fn locked_until(url: &str, table: &str, id: &tower_idempotency::store::RecordId) -> String {
    admin(url)
        .await
        .query_one(
            &format!("SELECT locked_until::text FROM {table} WHERE id = $1"),
            &[&id.as_bytes().as_slice()],
        )
        .await
        .unwrap()
        .get(0)
}

/// A store from `connect` sets `lock_timeout` below its deadline: a statement blocked on a
/// row lock is ended by the server (55P03), a known failure with nothing written, within the
/// one deadline of the operation, and leaves no statement running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_statement_is_ended_by_the_server_within_the_deadline() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "locktimeout").await;
    let app = unique("lockapp");
    let timeout = Duration::from_millis(300);
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .with_timeout(timeout)
        .connect(&format!("{url}?application_name={app}"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let id = unique_id("locked");
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    let before = locked_until(&url, &schema.table(), &id).await;

    let lock = RowLock::take(&url, &schema.table(), &id).await;
    let started = std::time::Instant::now();
    let err = store.extend(&id, &token, LEASE).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    let code = std::error::Error::source(&err)
        .and_then(|e| e.downcast_ref::<pg_support::PgError>())
        .and_then(|e| e.code().cloned());
    assert_eq!(
        code,
        Some(tokio_postgres_client::error::SqlState::LOCK_NOT_AVAILABLE),
        "{err:?}"
    );
    // One deadline for the whole operation (it used to be one per attempt: 3 × 300 ms).
    assert!(
        took < timeout * 2,
        "extend took {took:?} with a {timeout:?} timeout"
    );
    // The backend reports itself idle just after it answered: wait for that, not longer.
    assert!(
        eventually(2, || async { running(&url, &app).await == 0 }).await,
        "a statement was left running"
    );
    lock.release().await;
    assert_eq!(locked_until(&url, &schema.table(), &id).await, before);
    store.extend(&id, &token, LEASE).await.unwrap();
    drop(store);
    schema.drop_now().await;
}

/// On a pool without server-side timeouts, a statement the store gives up on is cancelled on
/// the server: no backend keeps waiting, and it never applies after the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_statement_is_cancelled_on_the_server() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "cancel").await;
    let app = unique("cancelapp");
    let store = pg_support::store_with(&url, &schema, 2, &app, |b| {
        b.with_timeout(Duration::from_millis(300))
    })
    .await;
    let id = unique_id("cancel");
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );
    let before = locked_until(&url, &schema.table(), &id).await;

    let lock = RowLock::take(&url, &schema.table(), &id).await;
    let err = store.extend(&id, &token, LEASE).await.unwrap_err();
    // The first attempt timed out, and so did the read-back: the outcome is unknown.
    assert_eq!(err.kind(), StoreErrorKind::Unknown, "{err:?}");
    assert!(
        eventually(5, || async { running(&url, &app).await == 0 }).await,
        "the timed-out statements still run on the server"
    );
    lock.release().await;
    // Nothing was left to apply once the lock was gone.
    assert_eq!(locked_until(&url, &schema.table(), &id).await, before);
    drop(store);
    schema.drop_now().await;
}

/// A `complete` whose statement snapshot predates the commit it waited for (the same
/// token's other attempt, committing late) answers `Ok` after a fresh read, not `Fenced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_that_lost_to_its_own_late_commit_is_ok() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "latecommit").await;
    let app = unique("lateapp");
    let store = store_in(&url, &schema, 4, &app).await;
    let id = unique_id("late");
    let token = claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap(),
    );

    let lock = RowLock::take(&url, &schema.table(), &id).await;
    let first = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .complete(&id, &token, &response(201, "first"), TTL)
                .await
        })
    };
    assert!(eventually(5, || async { running(&url, &app).await == 1 }).await);
    let second = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .complete(&id, &token, &response(201, "first"), TTL)
                .await
        })
    };
    // Both wait on the lock, the second behind the first.
    assert!(eventually(5, || async { running(&url, &app).await == 2 }).await);
    lock.release().await;
    first.await.unwrap().expect("the first attempt applies");
    second
        .await
        .unwrap()
        .expect("the resend finds its own answer: Ok, not Fenced");
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "first"))
    );
    drop(store);
    schema.drop_now().await;
}

/// Under REPEATABLE READ and SERIALIZABLE a renewal during the transaction makes
/// `complete_in` fail (40001); `lock_in` as the first statement makes it work, with the
/// renewal waiting for the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_under_repeatable_read_or_serializable_works_after_lock_in() {
    use tokio_postgres_client::IsolationLevel;
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "txiso").await;
    let app = unique("txisoapp");
    let store = store_in(&url, &schema, 3, &app).await;
    let orders = orders_table(&url, &schema).await;
    let insert = format!("INSERT INTO {orders} VALUES ('sku-1')");
    for level in [IsolationLevel::RepeatableRead, IsolationLevel::Serializable] {
        let id = unique_id("tx-iso");
        let token = claimed(
            store
                .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
                .await
                .unwrap(),
        );

        // Without lock_in: the renewal lands after the snapshot, and complete_in fails.
        let mut conn = store.pool().get().await.unwrap();
        let tx = conn
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        tx.execute(&insert, &[]).await.unwrap();
        store.extend(&id, &token, LEASE).await.unwrap();
        let err = store
            .complete_in(&tx, &id, &token, &response(201, "ordered"), TTL)
            .await
            .unwrap_err();
        let code = std::error::Error::source(&err)
            .and_then(|e| e.downcast_ref::<pg_support::PgError>())
            .and_then(|e| e.code().cloned());
        assert_eq!(
            code,
            Some(tokio_postgres_client::error::SqlState::T_R_SERIALIZATION_FAILURE),
            "{level:?}: {err:?}"
        );
        tx.rollback().await.unwrap();

        // With lock_in first: the renewal waits, complete_in commits.
        let tx = conn
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        store.lock_in(&tx, &id, &token).await.unwrap();
        let renewal = {
            let store = store.clone();
            tokio::spawn(async move { store.extend(&id, &token, LEASE).await })
        };
        assert!(
            eventually(5, || async { running(&url, &app).await == 1 }).await,
            "the renewal waits on the row lock"
        );
        tx.execute(&insert, &[]).await.unwrap();
        store
            .complete_in(&tx, &id, &token, &response(201, "ordered"), TTL)
            .await
            .unwrap_or_else(|e| panic!("{level:?}: {e:?}"));
        tx.commit().await.unwrap();
        // The renewal then finds the record completed.
        assert!(renewal.await.unwrap().unwrap_err().is_fenced());
        assert_eq!(
            store.get(&id).await.unwrap().unwrap().state,
            RecordState::Completed(response(201, "ordered"))
        );
        // A stale token cannot take the lock.
        let tx = conn.transaction().await.unwrap();
        let forged = Token::generate(token.generation()).unwrap();
        assert!(store
            .lock_in(&tx, &id, &forged)
            .await
            .unwrap_err()
            .is_fenced());
        tx.rollback().await.unwrap();
    }
    drop(store);
    schema.drop_now().await;
}

// Per-scope quotas (issue 12, point 3).

fn quota_error(outcome: Result<ClaimOutcome, StoreError>) -> StoreErrorKind {
    match outcome {
        Err(e) => e.kind(),
        Ok(other) => panic!("expected a quota error, got {other:?}"),
    }
}

/// A migrated store in `schema` with the given quotas, on `size` connections.
async fn quota_store(
    url: &str,
    schema: &TestSchema,
    size: usize,
    records: Option<usize>,
    bytes: Option<usize>,
) -> PostgresStore {
    let store = pg_support::store_with(url, schema, size, "tidem-quota", |mut b| {
        if let Some(n) = records {
            b = b.with_max_records_per_scope(NonZeroUsize::new(n).unwrap());
        }
        if let Some(n) = bytes {
            b = b.with_max_bytes_per_scope(NonZeroUsize::new(n).unwrap());
        }
        b
    })
    .await;
    store.verify().await.unwrap();
    store
}

/// A record id of `scope`, as the layer derives it.
fn scoped_id(scope: &str, key: &str) -> RecordId {
    RecordId::new(Some(scope), &format!("{key}-{}", unique("k")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_scope_refuses_new_keys_but_replays_and_other_scopes_still_claim() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "quota_records").await;
    let store = quota_store(&url, &schema, 2, Some(2), None).await;
    let (a, b) = (
        ScopeId::new(Some("tenant-a")),
        ScopeId::new(Some("tenant-b")),
    );
    let (a1, a2, a3) = (
        scoped_id("tenant-a", "1"),
        scoped_id("tenant-a", "2"),
        scoped_id("tenant-a", "3"),
    );

    let t1 = claimed(
        store
            .claim(&ClaimRequest::new(&a1, &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    store
        .complete(&a1, &t1, &response(201, "one"), TTL)
        .await
        .unwrap();
    let t2 = claimed(
        store
            .claim(&ClaimRequest::new(&a2, &fp(2), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );

    // Full: a new key is refused and nothing is written.
    let over = store
        .claim(&ClaimRequest::new(&a3, &fp(3), LEASE, TTL).in_scope(&a))
        .await;
    assert_eq!(quota_error(over), StoreErrorKind::QuotaExceeded);
    assert!(store.get(&a3).await.unwrap().is_none());

    // Retries of the scope's records still get their answers: a replay, and a conflict.
    match store
        .claim(&ClaimRequest::new(&a1, &fp(1), LEASE, TTL).in_scope(&a))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "one")))
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&a2, &fp(2), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));
    // A mismatch is still a mismatch, not a quota error.
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&a1, &fp(9), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));

    // Another scope is not affected.
    let b1 = scoped_id("tenant-b", "1");
    claimed(
        store
            .claim(&ClaimRequest::new(&b1, &fp(1), LEASE, TTL).in_scope(&b))
            .await
            .unwrap(),
    );

    // A released record frees its room.
    store.release(&a2, &t2).await.unwrap();
    claimed(
        store
            .claim(&ClaimRequest::new(&a3, &fp(3), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_and_unscoped_claims_do_not_count() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "quota_expired").await;
    let store = quota_store(&url, &schema, 2, Some(1), None).await;
    let a = ScopeId::new(Some("tenant-a"));
    let first = scoped_id("tenant-a", "1");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&first, &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    store
        .complete(&first, &t, &response(200, "x"), TTL)
        .await
        .unwrap();
    let second = scoped_id("tenant-a", "2");
    assert_eq!(
        quota_error(
            store
                .claim(&ClaimRequest::new(&second, &fp(2), LEASE, TTL).in_scope(&a))
                .await
        ),
        StoreErrorKind::QuotaExceeded
    );
    // The first record expires (by the database's clock), unswept: it no longer counts.
    admin(&url)
        .await
        .execute(
            &format!(
                "UPDATE {} SET expires_at = now() - interval '1 second'",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap();
    claimed(
        store
            .claim(&ClaimRequest::new(&second, &fp(2), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    // `claim` without a scope is never counted (and never refused).
    claimed(
        store
            .claim(&ClaimRequest::new(
                &scoped_id("tenant-a", "3"),
                &fp(3),
                LEASE,
                TTL,
            ))
            .await
            .unwrap(),
    );
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bytes_quota_counts_recorded_answers() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "quota_bytes").await;
    // Room for two records' overhead (160 each) and a 1,000-byte answer, not a second one.
    let store = quota_store(&url, &schema, 2, None, Some(2 * 160 + 1_500)).await;
    let a = ScopeId::new(Some("tenant-a"));
    let first = scoped_id("tenant-a", "1");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&first, &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    store
        .complete(&first, &t, &response(200, vec![b'x'; 1_000]), TTL)
        .await
        .unwrap();
    let second = scoped_id("tenant-a", "2");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&second, &fp(2), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    store
        .complete(&second, &t, &response(200, vec![b'y'; 1_000]), TTL)
        .await
        .unwrap();
    // 2 × 160 + 2,000 bytes of bodies (and the headers) are over 1,820.
    let third = scoped_id("tenant-a", "3");
    assert_eq!(
        quota_error(
            store
                .claim(&ClaimRequest::new(&third, &fp(3), LEASE, TTL).in_scope(&a))
                .await
        ),
        StoreErrorKind::QuotaExceeded
    );
    // A budget below one record's overhead refuses every new key.
    let tiny = quota_store(&url, &schema, 1, None, Some(100)).await;
    let b = ScopeId::new(Some("tenant-b"));
    assert_eq!(
        quota_error(
            tiny.claim(
                &ClaimRequest::new(&scoped_id("tenant-b", "1"), &fp(1), LEASE, TTL).in_scope(&b)
            )
            .await
        ),
        StoreErrorKind::QuotaExceeded
    );
    drop((store, tiny));
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_of_one_scope_never_overshoot_its_quota() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "quota_race").await;
    let store = Arc::new(quota_store(&url, &schema, 8, Some(5), None).await);
    let scope = ScopeId::new(Some("tenant-a"));
    let barrier = Arc::new(Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                let id = scoped_id("tenant-a", &i.to_string());
                barrier.wait().await;
                store
                    .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL).in_scope(&scope))
                    .await
            })
        })
        .collect();
    let (mut won, mut refused) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(ClaimOutcome::Claimed(_)) => won += 1,
            Err(e) if e.kind() == StoreErrorKind::QuotaExceeded => refused += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((won, refused), (5, 27));
    let rows: i64 = admin(&url)
        .await
        .query_one(&format!("SELECT count(*) FROM {}", schema.table()), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 5);
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_with_quotas_is_one_round_trip() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "quota_rtt").await;
    store_in(&url, &schema, 1, "tidem-quota-rtt-setup").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .with_max_records_per_scope(NonZeroUsize::new(1).unwrap())
        .build(pool_from(proxy.config(&url), 1, "tidem-quota-rtt"));
    let a = ScopeId::new(Some("tenant-a"));
    // Connect and prepare the statement once.
    let warm = scoped_id("tenant-a", "warm");
    let t = claimed(
        store
            .claim(&ClaimRequest::new(&warm, &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    store.release(&warm, &t).await.unwrap();

    let before = proxy.round_trips();
    let id = scoped_id("tenant-a", "1");
    claimed(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    let new = proxy.round_trips() - before;
    let before = proxy.round_trips();
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));
    let conflict = proxy.round_trips() - before;
    let before = proxy.round_trips();
    let over = store
        .claim(&ClaimRequest::new(&scoped_id("tenant-a", "2"), &fp(1), LEASE, TTL).in_scope(&a))
        .await;
    assert_eq!(quota_error(over), StoreErrorKind::QuotaExceeded);
    let refused = proxy.round_trips() - before;
    assert_eq!((new, conflict, refused), (1, 1, 1));
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_table_from_before_quotas_and_keeps_an_operators_settings() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "upgrade").await;
    let table = schema.table();
    let admin = admin(&url).await;
    // The table as the previous release created it, with a fillfactor an operator chose.
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (
                 id bytea PRIMARY KEY CHECK (octet_length(id) = 32),
                 fingerprint bytea NOT NULL CHECK (octet_length(fingerprint) = 32),
                 state smallint NOT NULL CHECK (state IN (0, 1, 2)),
                 generation bigint NOT NULL CHECK (generation > 0),
                 nonce bytea NOT NULL CHECK (octet_length(nonce) = 16),
                 locked_until timestamptz NOT NULL,
                 status smallint, headers bytea, body bytea, trailers bytea,
                 created_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
                 CONSTRAINT operator_rule CHECK (status IS NULL OR status BETWEEN 100 AND 599)
             ) WITH (fillfactor = 90);
             CREATE INDEX records_expires_at_idx ON {table} (expires_at);"
        ))
        .await
        .unwrap();
    let old = PostgresStore::builder()
        .with_table(&table)
        .unwrap()
        .build(pool(&url, 1, "tidem-upgrade"));
    assert!(matches!(old.verify().await, Err(SetupError::Table { .. })));
    old.migrate().await.unwrap();
    old.migrate().await.unwrap();
    old.verify().await.unwrap();
    let row = admin
        .query_one(
            &format!(
                "SELECT c.reloptions::text,
                        (SELECT count(*) FROM pg_index x WHERE x.indrelid = c.oid),
                        (SELECT count(*) FROM pg_attribute a
                          WHERE a.attrelid = c.oid AND a.attname IN ('scope', 'recovery_point'))
                   FROM pg_class c WHERE c.oid = '{table}'::regclass"
            ),
            &[],
        )
        .await
        .unwrap();
    let options: String = row.get(0);
    assert!(options.contains("fillfactor=90"), "{options}");
    assert!(!options.contains("fillfactor=80"), "{options}");
    assert!(
        options.contains("autovacuum_vacuum_scale_factor=0.01"),
        "{options}"
    );
    // The primary key, the sweeper's index, the scope index and the recovery index.
    assert_eq!((row.get::<_, i64>(1), row.get::<_, i64>(2)), (4, 2));
    // The CHECK constraints the previous release declared are dropped (each costs every
    // insert and update); the operator's own is kept.
    let checks: Vec<String> = admin
        .query(
            &format!(
                "SELECT conname::text FROM pg_constraint
                  WHERE conrelid = '{table}'::regclass AND contype = 'c' ORDER BY 1"
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(checks, ["operator_rule"]);
    // The upgraded table works with quotas.
    let store = PostgresStore::builder()
        .with_table(old.table())
        .unwrap()
        .with_max_records_per_scope(NonZeroUsize::new(1).unwrap())
        .build(old.pool().clone());
    let a = ScopeId::new(Some("tenant-a"));
    claimed(
        store
            .claim(&ClaimRequest::new(&scoped_id("tenant-a", "1"), &fp(1), LEASE, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    assert_eq!(
        quota_error(
            store
                .claim(
                    &ClaimRequest::new(&scoped_id("tenant-a", "2"), &fp(1), LEASE, TTL)
                        .in_scope(&a)
                )
                .await
        ),
        StoreErrorKind::QuotaExceeded
    );
    drop(store);
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_sets_the_storage_settings_of_a_new_table() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "settings").await;
    store_in(&url, &schema, 1, "tidem-settings").await;
    let options: String = admin(&url)
        .await
        .query_one(
            &format!(
                "SELECT reloptions::text FROM pg_class WHERE oid = '{}'::regclass",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        options,
        "{fillfactor=80,autovacuum_vacuum_scale_factor=0.01,\
         autovacuum_analyze_scale_factor=0.05,autovacuum_vacuum_cost_delay=0}"
    );
    // No CHECK constraints: each would be rebuilt for every insert and update.
    let checks: i64 = admin(&url)
        .await
        .query_one(
            &format!(
                "SELECT count(*) FROM pg_constraint WHERE conrelid = '{}'::regclass AND contype = 'c'",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(checks, 0);
    schema.drop_now().await;
}

/// A recovery point as a handler's save makes it (`RecoveryPoint::encode`'s form, unscoped).
fn recovery_point(generation: u64, step: &str, data: &[u8]) -> tower_idempotency::RecoveryPoint {
    let mut b = vec![1];
    b.extend_from_slice(&generation.to_be_bytes());
    b.extend_from_slice(&u16::MAX.to_be_bytes());
    b.push(step.len() as u8);
    b.extend_from_slice(step.as_bytes());
    b.extend_from_slice(&(data.len() as u16).to_be_bytes());
    b.extend_from_slice(data);
    tower_idempotency::RecoveryPoint::decode(bytes::Bytes::from(b)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_adds_recovery_points_to_a_table_from_before_them() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "rpupgrade").await;
    let table = schema.table();
    let admin = admin(&url).await;
    // The table, its indexes and its claim function as the previous version made them, and
    // a record one of its replicas claimed.
    let id = unique_id("rp-upgrade");
    let nonce = [7u8; 16];
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (
                 id bytea PRIMARY KEY CHECK (octet_length(id) = 32),
                 fingerprint bytea NOT NULL CHECK (octet_length(fingerprint) = 32),
                 state smallint NOT NULL CHECK (state IN (0, 1, 2)),
                 generation bigint NOT NULL CHECK (generation > 0),
                 nonce bytea NOT NULL CHECK (octet_length(nonce) = 16),
                 locked_until timestamptz NOT NULL,
                 status smallint, headers bytea, body bytea, trailers bytea,
                 created_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
                 scope bytea CHECK (octet_length(scope) = 32)
             ) WITH (fillfactor = 80);
             CREATE INDEX records_expires_at_idx ON {table} (expires_at);
             CREATE INDEX records_scope_idx ON {table} (scope, expires_at)
                 WHERE scope IS NOT NULL;
             CREATE FUNCTION {table}_claim(
                 p_id bytea, p_fingerprint bytea, p_nonce bytea, p_lease bigint, p_ttl bigint,
                 p_scope bytea, p_max_records bigint, p_max_bytes bigint)
             RETURNS TABLE (outcome smallint, generation bigint, nonce bytea, fingerprint bytea,
                            state smallint, lease_us bigint, status smallint, headers bytea,
                            body bytea, trailers bytea, lapsed_us bigint)
             LANGUAGE sql AS $$ SELECT NULL::smallint, NULL::bigint, NULL::bytea, NULL::bytea,
                 NULL::smallint, NULL::bigint, NULL::smallint, NULL::bytea, NULL::bytea,
                 NULL::bytea, NULL::bigint WHERE false $$;
             INSERT INTO {table} (id, fingerprint, state, generation, nonce, locked_until,
                                  created_at, expires_at)
             VALUES ('\\x{id}', '\\x{fp}', 0, 1, '\\x{nonce}', now() + interval '30 s', now(),
                     now() + interval '10 min');",
            id = id.to_hex(),
            fp = "05".repeat(32),
            nonce = "07".repeat(16),
        ))
        .await
        .unwrap();
    let filenode = format!("SELECT pg_relation_filenode('{table}')::bigint");
    let before: i64 = admin.query_one(&filenode, &[]).await.unwrap().get(0);
    let store = PostgresStore::builder()
        .with_table(&table)
        .unwrap()
        .build(pool(&url, 1, "tidem-rp-upgrade"));
    // The statements read the new column: an old table is named, not used.
    let err = store.verify().await.unwrap_err();
    assert!(matches!(err, SetupError::Table { .. }), "{err:?}");
    assert!(err.to_string().contains("recovery_point"), "{err}");
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    store.verify().await.unwrap();
    // Added in place: the catalog changed, the rows were not rewritten.
    let after: i64 = admin.query_one(&filenode, &[]).await.unwrap().get(0);
    assert_eq!(after, before);
    let row = admin
        .query_one(
            &format!(
                "SELECT (SELECT format_type(atttypid, atttypmod) || ' ' || NOT attnotnull
                           FROM pg_attribute
                          WHERE attrelid = '{table}'::regclass AND attname = 'recovery_point'),
                        (SELECT pg_get_indexdef(indexrelid) FROM pg_index x
                           JOIN pg_class i ON i.oid = x.indexrelid
                          WHERE x.indrelid = '{table}'::regclass
                            AND i.relname = 'records_recovery_idx'),
                        (SELECT pg_get_function_result('{table}_claim'::regproc))"
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "bytea true");
    let index: String = row.get(1);
    assert!(
        index.contains("(expires_at) WHERE ((recovery_point IS NOT NULL) AND (state = 0))"),
        "{index}"
    );
    // The earlier version's claim function is left to the replicas still calling it.
    assert!(row.get::<_, String>(2).ends_with("lapsed_us bigint)"));

    // The record claimed before the upgrade has no point, and its holder saves one.
    let token = Token::from_parts(1, nonce);
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(
        (record.holder, record.recovery_point.as_ref()),
        (Some(token), None)
    );
    let point = recovery_point(1, "charged", b"ch_1");
    store
        .save_recovery_point(&id, &token, &point)
        .await
        .unwrap();
    let record = store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.recovery_point, Some(point));
    drop(store);
    schema.drop_now().await;
}

/// The recovery index costs a record that saves no point nothing: a lease renewal still
/// changes no indexed column, so it stays a HOT update (no index entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_records_without_a_point_stay_hot() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "rphot").await;
    let store = store_in(&url, &schema, 1, "tidem-rp-hot").await;
    const N: i64 = 10;
    let mut claims = Vec::new();
    for i in 0..N {
        let id = unique_id(&format!("hot-{i}"));
        let t = claimed(
            store
                .claim(&ClaimRequest::new(&id, &fp(6), LEASE, TTL))
                .await
                .unwrap(),
        );
        claims.push((id, t));
    }
    for (id, t) in &claims {
        store.extend(id, t, LEASE).await.unwrap();
    }
    // On the store's one connection, which ran them: its counts are flushed once it idles.
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    let admin = admin(&url).await;
    let query = format!(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = '{}'::regclass",
        schema.table()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let seen = loop {
        let row = admin.query_one(query.as_str(), &[]).await.unwrap();
        let seen = (row.get::<_, i64>(0), row.get::<_, i64>(1));
        if seen.0 >= N || tokio::time::Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(seen, (N, N), "(updates, HOT updates)");
    drop(store);
    schema.drop_now().await;
}

/// Whether the row of `id` still holds bytes in its `recovery_point` column (`None`: no row).
async fn point_column(url: &str, table: &str, id: &RecordId) -> Option<bool> {
    admin(url)
        .await
        .query_opt(
            &format!("SELECT recovery_point IS NOT NULL FROM {table} WHERE id = $1"),
            &[&id.as_bytes().as_slice()],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// Every path that ends a claim clears the column itself, not only what `get` shows: a
/// completion (the store's and one in the caller's transaction), a released takeover, and a
/// claim that replaces an expired record; a takeover keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_points_end_with_the_claim_that_saved_them() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "rpend").await;
    let table = schema.table();
    let store = store_in(&url, &schema, 2, "tidem-rp-end").await;
    let short = Duration::from_millis(200);
    let claim = |id: RecordId, f: u8, lease: Duration, ttl: Duration| {
        let store = store.clone();
        async move {
            store
                .claim(&ClaimRequest::new(&id, &fp(f), lease, ttl))
                .await
                .unwrap()
        }
    };
    let save = |id: RecordId, t: Token| {
        let store = store.clone();
        async move {
            let p = recovery_point(t.generation(), "charged", b"ch_1");
            store.save_recovery_point(&id, &t, &p).await.unwrap();
        }
    };

    let done = unique_id("rp-complete");
    let t = claimed(claim(done, 1, LEASE, TTL).await);
    save(done, t).await;
    assert_eq!(point_column(&url, &table, &done).await, Some(true));
    store
        .complete(&done, &t, &response(201, "ok"), TTL)
        .await
        .unwrap();
    assert_eq!(point_column(&url, &table, &done).await, Some(false));

    let in_tx = unique_id("rp-complete-in");
    let t = claimed(claim(in_tx, 1, LEASE, TTL).await);
    save(in_tx, t).await;
    let mut conn = store.pool().get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    store
        .complete_in(&tx, &in_tx, &t, &response(201, "ok"), TTL)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(conn);
    assert_eq!(point_column(&url, &table, &in_tx).await, Some(false));

    // A takeover keeps the point for its holder; its release drops it and keeps the row.
    let released = unique_id("rp-release");
    let t = claimed(claim(released, 1, short, TTL).await);
    save(released, t).await;
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let t2 = match claim(released, 1, LEASE, TTL).await {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            assert_eq!(c.recovery_point.as_ref().map(|p| p.generation()), Some(1));
            c.token
        }
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert_eq!(point_column(&url, &table, &released).await, Some(true));
    store.release(&released, &t2).await.unwrap();
    assert_eq!(point_column(&url, &table, &released).await, Some(false));

    // An expired record replaced by another request's claim: a new record, with no point.
    let expired = unique_id("rp-expired");
    let t = claimed(claim(expired, 1, short, short).await);
    save(expired, t).await;
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    match claim(expired, 2, LEASE, TTL).await {
        ClaimOutcome::Claimed(c) => {
            assert!(!c.takeover);
            assert_eq!(c.recovery_point, None);
        }
        other => panic!("expected a first claim, got {other:?}"),
    }
    assert_eq!(point_column(&url, &table, &expired).await, Some(false));
    drop(store);
    schema.drop_now().await;
}

/// A takeover whose reply is lost is read back with the point it was handed, and a save whose
/// reply is lost is sent again and answers Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_of_a_takeover_and_a_save_keep_the_point() {
    let Some(url) = pg_support::url() else { return };
    let schema = TestSchema::create(&url, "rplost").await;
    let direct = store_in(&url, &schema, 1, "tidem-rp-lost-direct").await;
    let proxy = Proxy::start(&url).await;
    let store = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .build(pool_from(proxy.config(&url), 1, "tidem-rp-lost"));
    warm(&store).await;
    let short = Duration::from_millis(200);

    let id = unique_id("rp-lost");
    let first = claimed(
        direct
            .claim(&ClaimRequest::new(&id, &fp(1), short, TTL))
            .await
            .unwrap(),
    );
    let point = recovery_point(1, "charged", b"ch_1");
    // Prepared on the proxied connection, so the next save sent is the one to lose.
    assert_eq!(
        store
            .save_recovery_point(&unique_id("rp-warm"), &first, &point)
            .await
            .unwrap_err()
            .kind(),
        StoreErrorKind::Fenced
    );
    direct
        .save_recovery_point(&id, &first, &point)
        .await
        .unwrap();
    tokio::time::sleep(short + Duration::from_millis(100)).await;

    let before = proxy.connections();
    proxy.next_reply(mode::CUT, mode::PASS);
    let claim = match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .expect("read back")
    {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert_eq!(proxy.connections(), before + 1, "the reply was not lost");
    assert!(claim.takeover);
    assert_eq!(claim.token.generation(), 2);
    assert_eq!(claim.recovery_point.as_ref(), Some(&point));

    let next = recovery_point(2, "recorded", b"ch_1/ok");
    proxy.next_reply(mode::CUT, mode::PASS);
    store
        .save_recovery_point(&id, &claim.token, &next)
        .await
        .expect("sent again");
    assert_eq!(proxy.connections(), before + 2, "the reply was not lost");
    let record = direct.get(&id).await.unwrap().unwrap();
    assert_eq!(record.recovery_point, Some(next));
    drop((store, direct));
    schema.drop_now().await;
}
