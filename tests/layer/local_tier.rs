//! `LocalTier`: completed records served from the process, through the layer. A counting
//! store under each tier tells a local answer (no claim reached the store) from a stored one.
//!
//! - replays of a completed record stop reaching the store once the tier has learned it, and
//!   every check still applies (another body is refused, another scope never sees it);
//! - an expired record is never served;
//! - an operator's delete on process A makes process B run the next request (Redis pub/sub,
//!   Postgres `NOTIFY`), each "process" a store with connections of its own;
//! - without a feed, the documented bound: at most `max_age` of staleness.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::{IdempotencyAdmin, IdempotencyStore, LocalTier, RecordId};
use tower_idempotency::{IdempotencyLayer, RequestBody, Timing};

use crate::support::proxy::{Dir, FaultProxy, Mode};
use crate::support::{body_bytes, post, Fault, FaultStore, Op};

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
    std::convert::Infallible,
>;

/// One process: a tier over a store whose claims are counted ([`FaultStore`], breaking
/// nothing), the layer (scoped by `x-tenant`), and a handler that counts its runs.
struct Process {
    svc: Svc,
    claims: Box<dyn Fn() -> usize + Send + Sync>,
    runs: Arc<AtomicUsize>,
}

fn process<S: IdempotencyStore>(
    name: &'static str,
    store: S,
    timing: Timing,
    max_age: Duration,
) -> Process {
    process_over(name, FaultStore::new(store), timing, max_age)
}

/// [`process`] over a [`FaultStore`] the test breaks calls of.
fn process_over<S: IdempotencyStore>(
    name: &'static str,
    counted: Arc<FaultStore<S>>,
    timing: Timing,
    max_age: Duration,
) -> Process {
    let runs = Arc::new(AtomicUsize::new(0));
    let claims = {
        let counted = counted.clone();
        Box::new(move || counted.calls(Op::Claim))
    };
    let tier = LocalTier::new(counted).with_max_age(max_age);
    let layer = IdempotencyLayer::new(tier)
        .with_timing(timing)
        .with_scope(|req| {
            req.headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let handler = {
        let runs = runs.clone();
        service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let mut res = Response::new(Full::new(Bytes::from(format!("{name} run {n}"))));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, std::convert::Infallible>(res)
            }
        })
    };
    Process {
        svc: tower::util::BoxCloneService::new(layer.layer(handler)),
        claims,
        runs,
    }
}

impl Process {
    async fn send(&self, tenant: &str, key: &str, body: &str) -> (StatusCode, String) {
        let mut req = post("/pay", Some(key), body);
        req.headers_mut()
            .insert("x-tenant", http::HeaderValue::from_str(tenant).unwrap());
        let res = self.svc.clone().oneshot(req).await.unwrap();
        let status = res.status();
        (
            status,
            String::from_utf8_lossy(&body_bytes(res).await).into_owned(),
        )
    }

    /// Sends until a replay is answered without reaching the store (the tier has learned the
    /// record, on a task of its own): at most `tries` sends.
    async fn until_local(&self, tenant: &str, key: &str, expect: &str, tries: usize) {
        for _ in 0..tries {
            let before = (self.claims)();
            let (status, body) = self.send(tenant, key, "{}").await;
            assert_eq!((status, body.as_str()), (StatusCode::CREATED, expect));
            if (self.claims)() == before {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the tier never served {key} locally in {tries} sends");
    }
}

fn timing(ttl: Duration) -> Timing {
    Timing::new(Duration::from_millis(300), ttl).unwrap()
}

#[tokio::test(start_paused = true)]
async fn memory_replays_stay_local_and_every_check_applies() {
    let p = process(
        "m",
        tower_idempotency::store::MemoryStore::new(),
        timing(Duration::from_secs(60)),
        Duration::from_secs(30),
    );
    assert_eq!(
        p.send("t1", "k", "{}").await,
        (StatusCode::CREATED, "m run 1".into())
    );
    p.until_local("t1", "k", "m run 1", 20).await;
    let claims = (p.claims)();
    for _ in 0..50 {
        assert_eq!(
            p.send("t1", "k", "{}").await,
            (StatusCode::CREATED, "m run 1".into())
        );
    }
    assert_eq!((p.claims)(), claims, "50 replays reached the store");
    // Another body under the key: refused from the local record as from the stored one.
    let (status, _) = p.send("t1", "k", r#"{"other":1}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    // Another scope, the same key: its own record, never the cached one.
    assert_eq!(
        p.send("t2", "k", "{}").await,
        (StatusCode::CREATED, "m run 2".into())
    );
    assert_eq!(p.runs.load(Ordering::SeqCst), 2);
}

/// The tier answers a claim at once only from what it holds: anything else goes to the
/// store's `claim`, which learns, even where the store below could answer at once too.
#[tokio::test(start_paused = true)]
async fn a_tier_answers_at_once_only_what_it_holds() {
    use tower_idempotency::store::{
        ClaimOutcome, ClaimRequest, Completion, Fingerprint, MemoryStore, RecordState,
    };
    let memory = Arc::new(MemoryStore::new());
    let tier = LocalTier::new(memory).with_max_age(Duration::from_secs(5));
    let id = RecordId::new(None, "k");
    let fp = Fingerprint::from_bytes([7; 32]);
    let ttl = Duration::from_secs(60);
    let req = ClaimRequest::new(&id, &fp, Duration::from_secs(1), ttl);
    assert!(
        tier.claim_now(&req).is_none(),
        "an absent record is the store's"
    );
    let Ok(ClaimOutcome::Claimed(claim)) = tier.claim(&req).await else {
        panic!("a fresh key")
    };
    assert!(
        tier.claim_now(&req).is_none(),
        "an in-progress record is the store's"
    );
    let done = Completion::Tombstone {
        status: StatusCode::OK,
    };
    tier.complete(&id, &claim.token, &done, ttl).await.unwrap();
    assert!(
        tier.claim_now(&req).is_none(),
        "not learned from its own complete"
    );
    // The next claim finds it completed and learns it (on a task): then it is answered here.
    let mut held = None;
    for _ in 0..20 {
        assert!(matches!(
            tier.claim(&req).await,
            Ok(ClaimOutcome::Existing(_))
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Some(outcome) = tier.claim_now(&req) {
            held = Some(outcome);
            break;
        }
    }
    let Some(Ok(ClaimOutcome::Existing(record))) = held else {
        panic!("the tier never held the completed record")
    };
    assert!(matches!(record.state, RecordState::Completed(_)));
    // The memory store has no feed: past `max_age` the tier holds nothing, and asks again.
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(tier.claim_now(&req).is_none(), "held past its max_age");
}

/// A read that never returns does not stop the tier from learning the record later.
#[tokio::test(start_paused = true)]
async fn memory_a_hung_read_while_learning_is_given_up_and_tried_again() {
    let faults = FaultStore::new(tower_idempotency::store::MemoryStore::new());
    faults.on(Op::Get, 1, Fault::Hang);
    let p = process_over(
        "m",
        faults.clone(),
        timing(Duration::from_secs(600)),
        Duration::from_secs(600),
    );
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 1");
    // The first replay starts learning: its read hangs.
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 1");
    tokio::time::sleep(Duration::from_secs(6)).await;
    p.until_local("t1", "k", "m run 1", 20).await;
    assert_eq!(
        faults.calls(Op::Get),
        2,
        "the hung read, then one that answered"
    );
}

#[tokio::test(start_paused = true)]
async fn memory_an_expired_record_is_never_served() {
    let p = process(
        "m",
        tower_idempotency::store::MemoryStore::new(),
        timing(Duration::from_secs(2)),
        Duration::from_secs(3600),
    );
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 1");
    p.until_local("t1", "k", "m run 1", 20).await;
    // Just before the record's TTL ends, counted from its completion, it may still be
    // served; just after, the request runs again.
    tokio::time::sleep(Duration::from_millis(2_050)).await;
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 2");
}

#[tokio::test(start_paused = true)]
async fn memory_without_a_feed_staleness_is_bounded_by_max_age() {
    let store = Arc::new(tower_idempotency::store::MemoryStore::new());
    let p = process(
        "m",
        store.clone(),
        timing(Duration::from_secs(600)),
        Duration::from_secs(5),
    );
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 1");
    p.until_local("t1", "k", "m run 1", 20).await;
    // An operator deletes the record behind the tier's back: the memory store has no feed.
    let id = RecordId::new(Some("t1"), "k");
    store.delete(&id).await.unwrap();
    assert_eq!(
        p.send("t1", "k", "{}").await.1,
        "m run 1",
        "served within max_age"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        p.send("t1", "k", "{}").await.1,
        "m run 2",
        "past max_age the store answers"
    );
}

/// Process A deletes; process B, which served the record locally, runs the next request.
async fn a_delete_on_one_process_reaches_the_other<S, A>(a: S, b: S, admin: A, name: &str)
where
    S: IdempotencyStore,
    A: IdempotencyAdmin,
{
    let timing = timing(Duration::from_secs(600));
    let (pa, pb) = (
        process("A", a, timing, Duration::from_secs(600)),
        process("B", b, timing, Duration::from_secs(600)),
    );
    let key = format!("k-{}", std::process::id());
    assert_eq!(pa.send("t1", &key, "{}").await.1, "A run 1", "{name}");
    pb.until_local("t1", &key, "A run 1", 100).await;
    pa.until_local("t1", &key, "A run 1", 100).await;
    let id = RecordId::new(Some("t1"), &key);
    admin.delete(&id).await.unwrap();
    // The removal reaches B over the store's feed: B stops serving it within moments.
    let mut ran = None;
    for _ in 0..100 {
        let (status, body) = pb.send("t1", &key, "{}").await;
        assert_eq!(status, StatusCode::CREATED, "{name}");
        if body != "A run 1" {
            ran = Some(body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        ran.as_deref(),
        Some("B run 1"),
        "{name}: B never ran again after the delete"
    );
    assert_eq!(pb.runs.load(Ordering::SeqCst), 1, "{name}");
    // And B's new answer is what A now replays (A heard of the delete too).
    let mut replayed = false;
    for _ in 0..100 {
        if pa.send("t1", &key, "{}").await.1 == "B run 1" {
            replayed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(replayed, "{name}: A did not replay B's new answer");
    assert_eq!(
        (
            pa.runs.load(Ordering::SeqCst),
            pb.runs.load(Ordering::SeqCst)
        ),
        (1, 1),
        "{name}"
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_delete_on_one_process_makes_the_other_run_again() {
    use tower_idempotency::store::redis::RedisStore;
    let Some(url) = crate::support::backend::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let prefix = format!("{}:", crate::support::load::run_id("tier"));
    let connect = || {
        RedisStore::builder()
            .with_key_prefix(prefix.clone())
            .connect(&url)
    };
    let (a, b, admin) = (
        connect().await.unwrap(),
        connect().await.unwrap(),
        connect().await.unwrap(),
    );
    a_delete_on_one_process_reaches_the_other(a, b, admin, "redis").await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_expired_record_is_never_served() {
    let Some(store) = crate::support::load::redis_store("tier-ttl").await else {
        return;
    };
    let p = process(
        "m",
        store,
        timing(Duration::from_millis(900)),
        Duration::from_secs(600),
    );
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 1");
    p.until_local("t1", "k", "m run 1", 40).await;
    tokio::time::sleep(Duration::from_millis(950)).await;
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 2");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_delete_on_one_process_makes_the_other_run_again() {
    use tower_idempotency::store::postgres::PostgresStore;
    let Some(url) = crate::support::pg::url() else {
        return;
    };
    let schema = crate::support::pg::TestSchema::create(&url, "tier").await;
    let connect = || async {
        let store = PostgresStore::builder()
            .with_table(&schema.table())
            .unwrap()
            .connect(&url)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        store
    };
    let (a, b, admin) = (connect().await, connect().await, connect().await);
    a_delete_on_one_process_reaches_the_other(a, b, admin, "postgres").await;
    schema.drop_now().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_expired_record_is_never_served() {
    let Some((store, schema)) = crate::support::load::postgres_store("tier_ttl").await else {
        return;
    };
    let p = process(
        "m",
        store,
        timing(Duration::from_millis(900)),
        Duration::from_secs(600),
    );
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 1");
    p.until_local("t1", "k", "m run 1", 40).await;
    tokio::time::sleep(Duration::from_millis(950)).await;
    assert_eq!(p.send("t1", "k", "{}").await.1, "m run 2");
    schema.drop_now().await;
}

/// A delete while the feed is down is not missed: the tier serves nothing from memory until
/// its subscription is back, and then forgets what it held.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_delete_while_the_feed_is_down_is_not_missed() {
    use tower_idempotency::store::redis::RedisStore;
    let Some(url) = crate::support::backend::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let prefix = format!("{}:", crate::support::load::run_id("tier-lost"));
    let connect = || {
        RedisStore::builder()
            .with_key_prefix(prefix.clone())
            .connect(&url)
    };
    let (b, admin) = (connect().await.unwrap(), connect().await.unwrap());
    let pb = process(
        "B",
        b,
        timing(Duration::from_secs(600)),
        Duration::from_secs(600),
    );
    assert_eq!(pb.send("t1", "k", "{}").await.1, "B run 1");
    pb.until_local("t1", "k", "B run 1", 100).await;
    // Every subscriber on the server loses its connection; the delete is published into the
    // gap, before the feed subscribes again (it waits 100 ms first).
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(killed >= 1, "no subscriber to kill");
    admin.delete(&RecordId::new(Some("t1"), "k")).await.unwrap();
    let mut ran = false;
    for _ in 0..100 {
        if pb.send("t1", "k", "{}").await.1 == "B run 2" {
            ran = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ran, "the delete made during the feed's gap was missed");
}

/// A feed whose connection dies without a word (a partition: the proxy holds every byte and
/// the sockets stay open) is caught by its heartbeat. Within the heartbeat (1 s) plus the
/// store's timeout (0.5 s here) the tier stops serving from memory, so a delete made meanwhile
/// on another process is served at most that long, not until `max_age` (600 s here).
async fn a_silent_feed_is_noticed<S, A>(b: S, admin: A, proxy: &FaultProxy, name: &str)
where
    S: IdempotencyStore,
    A: IdempotencyAdmin,
{
    let pb = process(
        "B",
        b,
        timing(Duration::from_secs(600)),
        Duration::from_secs(600),
    );
    let key = format!("silent-{}", std::process::id());
    assert_eq!(pb.send("t1", &key, "{}").await.1, "B run 1", "{name}");
    pb.until_local("t1", &key, "B run 1", 100).await;
    proxy.set(Dir::Up, Mode::Blackhole);
    proxy.set(Dir::Down, Mode::Blackhole);
    let cut = std::time::Instant::now();
    admin
        .delete(&RecordId::new(Some("t1"), &key))
        .await
        .unwrap();
    // Served from memory (no claim reaches the store) until the heartbeat fails; then every
    // claim goes to the store, which the proxy holds.
    let mut served = 0;
    loop {
        let before = (pb.claims)();
        let answer = tokio::time::timeout(Duration::from_millis(100), pb.send("t1", &key, "{}"));
        if let Ok((_, body)) = answer.await {
            if (pb.claims)() == before {
                assert_eq!(body, "B run 1", "{name}");
                served += 1;
            }
        }
        if (pb.claims)() > before {
            break;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(4),
            "{name}: B still served the deleted record from memory {:?} after its feed went silent",
            cut.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{name}: a silent feed was noticed {:?} after the cut ({served} answers from memory meanwhile)",
        cut.elapsed()
    );
    assert!(
        served > 0,
        "{name}: the tier never served from memory before the cut was noticed"
    );
    // Healed, the feed subscribes again and B finds the record gone: it runs again.
    proxy.heal();
    let mut ran = false;
    for _ in 0..200 {
        let answer = tokio::time::timeout(Duration::from_secs(2), pb.send("t1", &key, "{}")).await;
        if matches!(answer, Ok((StatusCode::CREATED, ref body)) if body == "B run 2") {
            ran = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ran, "{name}: B did not run again once healed");
    assert_eq!(pb.runs.load(Ordering::SeqCst), 2, "{name}");
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_silent_feed_is_noticed_by_its_heartbeat() {
    use tower_idempotency::store::redis::RedisStore;
    let Some(url) = crate::support::backend::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let upstream = url.trim_start_matches("redis://").trim_end_matches('/');
    let proxy = FaultProxy::start(upstream).await;
    let prefix = format!("{}:", crate::support::load::run_id("tier-silent"));
    let b = RedisStore::builder()
        .with_key_prefix(prefix.clone())
        .with_timeout(Duration::from_millis(500))
        .connect(&format!("redis://127.0.0.1:{}/", proxy.port))
        .await
        .unwrap();
    let admin = RedisStore::builder()
        .with_key_prefix(prefix)
        .connect(&url)
        .await
        .unwrap();
    a_silent_feed_is_noticed(b, admin, &proxy, "redis").await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_silent_feed_is_noticed_by_its_heartbeat() {
    use tower_idempotency::store::postgres::tokio_postgres::config::Host;
    use tower_idempotency::store::postgres::PostgresStore;
    let Some(url) = crate::support::pg::url() else {
        return;
    };
    let cfg = crate::support::pg::config(&url);
    let host = match cfg.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let proxy = FaultProxy::start(&format!("{host}:{port}")).await;
    let mut via = format!("postgres://{}", cfg.get_user().unwrap_or("postgres"));
    if let Some(password) = cfg.get_password() {
        via.push(':');
        via.push_str(std::str::from_utf8(password).unwrap());
    }
    via.push_str(&format!(
        "@127.0.0.1:{}/{}",
        proxy.port,
        cfg.get_dbname().unwrap_or("postgres")
    ));
    let schema = crate::support::pg::TestSchema::create(&url, "tier_silent").await;
    let admin = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .connect(&url)
        .await
        .unwrap();
    admin.migrate().await.unwrap();
    let b = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap()
        .with_timeout(Duration::from_millis(500))
        .connect(&via)
        .await
        .unwrap();
    a_silent_feed_is_noticed(b, admin, &proxy, "postgres").await;
    schema.drop_now().await;
}

/// The tier is a store: it passes the store conformance suite (the model-based histories
/// included), with its operator calls and its claims answered from memory where it can.
#[cfg(feature = "conformance")]
mod conformance_on_the_tier {
    use std::sync::Arc;

    use tower_idempotency::conformance::{DynAdminStore, DynStore};
    use tower_idempotency::conformance_suite;
    use tower_idempotency::store::{LocalTier, MemoryStore};

    conformance_suite! {
        store: async { Some(Arc::new(LocalTier::new(MemoryStore::new())) as DynStore) },
        admin: async { Some(Arc::new(LocalTier::new(MemoryStore::new())) as DynAdminStore) },
        recovery: async { Some(Arc::new(LocalTier::new(MemoryStore::new())) as DynStore) },
    }
}

#[cfg(all(feature = "conformance", feature = "redis"))]
mod conformance_on_the_tier_over_redis {
    use std::sync::Arc;

    use tower_idempotency::conformance::{DynAdminStore, DynStore};
    use tower_idempotency::conformance_suite;
    use tower_idempotency::store::redis::RedisStore;
    use tower_idempotency::store::LocalTier;

    async fn tier() -> Option<LocalTier<RedisStore>> {
        let url = crate::support::backend::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
        let prefix = format!("{}:", crate::support::load::run_id("tier-conf"));
        let store = RedisStore::builder()
            .with_key_prefix(prefix)
            .connect(&url)
            .await
            .unwrap();
        Some(LocalTier::new(store))
    }

    conformance_suite! {
        store: async { tier().await.map(|t| Arc::new(t) as DynStore) },
        admin: async { tier().await.map(|t| Arc::new(t) as DynAdminStore) },
        recovery: async { tier().await.map(|t| Arc::new(t) as DynStore) },
    }
}

/// A scope's records spread over the tier's shards. The tier is split into 16 shards, each
/// holding a sixteenth of its records and bytes; a record id starts with its scope's bytes,
/// so a shard picked by those would put one scope (every record of an unscoped layer) in one
/// shard, and the tier would hold a sixteenth of what it was given.
#[tokio::test(start_paused = true)]
async fn one_scope_can_fill_the_whole_tier() {
    use std::num::NonZeroUsize;
    use tower_idempotency::store::{
        ClaimOutcome, ClaimRequest, Completion, Fingerprint, MemoryStore,
    };
    // 160 records: 10 a shard.
    let tier = LocalTier::new(Arc::new(MemoryStore::new()))
        .with_max_records(NonZeroUsize::new(160).unwrap())
        .with_max_age(Duration::from_secs(600));
    let fp = Fingerprint::from_bytes([7; 32]);
    let ttl = Duration::from_secs(600);
    let ids: Vec<RecordId> = (0..80)
        .map(|k| RecordId::new(Some("t1"), &format!("order-{k}")))
        .collect();
    let done = Completion::Tombstone {
        status: StatusCode::OK,
    };
    for id in &ids {
        let req = ClaimRequest::new(id, &fp, Duration::from_secs(1), ttl);
        let Ok(ClaimOutcome::Claimed(claim)) = tier.claim(&req).await else {
            panic!("a fresh key")
        };
        tier.complete(id, &claim.token, &done, ttl).await.unwrap();
    }
    // Each claim that finds its record completed learns it, on a task of its own.
    for id in &ids {
        let req = ClaimRequest::new(id, &fp, Duration::from_secs(1), ttl);
        assert!(matches!(
            tier.claim(&req).await,
            Ok(ClaimOutcome::Existing(_))
        ));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let held = ids
        .iter()
        .filter(|id| {
            let req = ClaimRequest::new(id, &fp, Duration::from_secs(1), ttl);
            tier.claim_now(&req).is_some()
        })
        .count();
    // Spread at random, 80 records over 16 shards of 10 rarely overflow one; all in one
    // shard, 10 would stay.
    assert!(
        held >= 72,
        "the tier of 160 held {held} of 80 records of one scope"
    );
}
