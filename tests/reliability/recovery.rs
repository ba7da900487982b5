//! Resumable payments across processes (issue 25): shop processes killed with SIGKILL in the
//! middle of a payment, on Redis and on Postgres, finished from their recovery point by the
//! client's retry or by the recovery worker, with the card network in a process of its own
//! (a shop on the memory store, `CARD_NETWORK_URL`) so its ledger outlives the killed shop.
//!
//! Each test has a namespace of its own on the backend (a Redis database, a Postgres schema):
//! a recovery worker sweeps its whole store, and would otherwise finish the abandoned keys of
//! the tests running beside it, or of `processes`.
use crate::support::backend::backend_url;
use crate::support::load::run_id;
use crate::support::pg::TestSchema;
use crate::support::shop::{client, ledger, pay, pay_with, record, stats, Answer, Http, Shop};

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::Value;
use tower_idempotency::store::redis::redis;
use tower_idempotency::store::RecordId;

/// The lease of every shop here: short, so a dead holder's key is free soon.
const LEASE_MS: u64 = 1500;
/// The sweep interval of the shops that run a worker.
const SWEEP_MS: u64 = 300;
const TOKEN: &str = "recovery-admin-token";
/// A card network's own store: its shop serves no payments here.
const MEMORY: &str = "memory";

#[derive(Clone, Copy, Debug)]
enum Backend {
    Redis,
    Postgres,
}

/// A store URL no other test uses; `drop` removes the Postgres schema.
struct Namespace {
    url: String,
    schema: Option<TestSchema>,
}

impl Namespace {
    /// `db` is the Redis database of the test (each test its own); Postgres gets a fresh
    /// schema, named by `label`. `None` (after printing why) when the backend's URL is unset.
    async fn new(backend: Backend, db: u8, label: &str) -> Option<Self> {
        match backend {
            Backend::Redis => {
                let base = backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
                let url = redis_db(&base, db);
                // Left over from an earlier run that failed midway: nothing else uses `db`.
                let client = redis::Client::open(url.as_str()).unwrap();
                let mut con = client.get_multiplexed_async_connection().await.unwrap();
                redis::cmd("FLUSHDB")
                    .query_async::<()>(&mut con)
                    .await
                    .unwrap();
                Some(Self { url, schema: None })
            }
            Backend::Postgres => {
                let base = backend_url("IDEMPOTENCY_TEST_POSTGRES_URL")?;
                let schema = TestSchema::create(&base, label).await;
                // The shop's store uses the default table name, unqualified: the schema is
                // the first (only) one on the search path.
                let sep = if base.contains('?') { '&' } else { '?' };
                let url = format!("{base}{sep}options=-c%20search_path%3D{}", schema.name);
                Some(Self {
                    url,
                    schema: Some(schema),
                })
            }
        }
    }

    async fn drop_now(self) {
        if let Some(schema) = self.schema {
            schema.drop_now().await;
        }
    }
}

/// `base` (`redis://host:port[/db][?query]`) on database `db`.
fn redis_db(base: &str, db: u8) -> String {
    let (head, query) = match base.split_once('?') {
        Some((h, q)) => (h, format!("?{q}")),
        None => (base, String::new()),
    };
    let after_scheme = head.find("://").map_or(0, |i| i + 3);
    let host_end = head[after_scheme..]
        .find('/')
        .map_or(head.len(), |i| after_scheme + i);
    format!("{}/{db}{query}", &head[..host_end])
}

/// The card network, in a shop process of its own.
async fn network() -> (Shop, String) {
    let net = Shop::start(MEMORY, 30_000, 0).await;
    let url = format!("http://127.0.0.1:{}", net.port);
    (net, url)
}

/// The charges in a card network's ledger (each with its key, payment and requests).
fn entries(ledger: &Value) -> Vec<Value> {
    ledger["charges"].as_array().unwrap().clone()
}

async fn wait_until<F, Fut>(what: &str, within: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Sends `key` until the answer is not a 409; returns it and how many 409s came first.
async fn until_not_409(http: &Http, port: u16, api_key: &str, key: &str) -> (Answer, usize) {
    let mut conflicts = 0;
    loop {
        let a = pay(http, port, api_key, key, 100).await.unwrap();
        if a.0 != StatusCode::CONFLICT {
            return (a, conflicts);
        }
        conflicts += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn json(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap()
}

/// The recovery point of `key` on `port` (an admin shop) while it is in progress.
async fn point_of(http: &Http, port: u16, scope: &str, key: &str) -> (String, Value) {
    let r = record(http, port, TOKEN, scope, key)
        .await
        .expect("a live record");
    assert_eq!(r["state"], "in_progress", "{r}");
    let p = &r["recovery_point"];
    let data = json(p["data"].as_str().expect("a point with data").as_bytes());
    (p["step"].as_str().unwrap().to_owned(), data)
}

/// A shop (`CARD_LATENCY_MS=10000`, so the kill lands while the charge is at the network)
/// sends one payment; once the network booked its charge, the shop is SIGKILLed. Returns the
/// moment of the kill and the point the dead attempt left: step `created`, its payment.
async fn kill_mid_charge(
    store: &str,
    net_url: &str,
    net_port: u16,
    api_key: &str,
    key: &str,
) -> (Instant, Value) {
    let http = client();
    let env = [("CARD_NETWORK_URL", net_url), ("ADMIN_TOKEN", TOKEN)];
    let mut a = Shop::start_with(store, LEASE_MS, 10_000, &env).await;
    let paying = {
        let (http, api_key, key, port) = (http.clone(), api_key.to_owned(), key.to_owned(), a.port);
        tokio::spawn(async move { pay(&http, port, &api_key, &key, 100).await })
    };
    wait_until(
        "the charge reached the network",
        Duration::from_secs(10),
        || async { ledger(&http, net_port).await["count"] == 1 },
    )
    .await;
    let scope = format!("api-key:{api_key}");
    let (step, point) = point_of(&http, a.port, &scope, key).await;
    assert_eq!(step, "created", "{point}");
    assert!(point.get("charge").is_none(), "{point}");
    let killed = Instant::now();
    a.sigkill();
    let answer = paying.await.unwrap();
    assert!(answer.is_err(), "the killed shop answered: {answer:?}");
    (killed, point)
}

/// Client-retry path: kill -9 mid-charge, a second shop with its worker off; the retry after
/// the lease takes over, resumes from `created` with the dead attempt's payment, and its
/// charge is the one the network already booked.
async fn a_retry_resumes_a_killed_payment(backend: Backend, db: u8) {
    let label = format!("resume-retry-{backend:?}");
    let Some(ns) = Namespace::new(backend, db, &label).await else {
        return;
    };
    let http = client();
    let api_key = run_id(&label);
    let key = "pay-1";
    let (net, net_url) = network().await;
    let (killed, point) = kill_mid_charge(&ns.url, &net_url, net.port, &api_key, key).await;

    let b = Shop::start_with(&ns.url, LEASE_MS, 50, &[("CARD_NETWORK_URL", &net_url)]).await;
    let (takeover, conflicts) = until_not_409(&http, b.port, &api_key, key).await;
    let waited = killed.elapsed();
    assert_eq!(
        (takeover.0, takeover.1),
        (StatusCode::CREATED, false),
        "{takeover:?}"
    );
    let body = json(&takeover.2);
    assert_eq!(body["resumed_from"], "created", "{body}");
    assert_eq!(body["id"], point["payment"], "{body} vs {point}");
    assert_eq!(body["status"], "succeeded");
    assert!(
        waited >= Duration::from_millis(LEASE_MS * 2 / 3),
        "taken over {waited:?} after the kill"
    );
    for _ in 0..3 {
        let again = pay(&http, b.port, &api_key, key, 100).await.unwrap();
        assert_eq!(again, (StatusCode::CREATED, true, takeover.2.clone()));
    }
    // One charge, asked for twice (the dead attempt, then the takeover under the same key).
    let l = ledger(&http, net.port).await;
    let charges = entries(&l);
    assert_eq!(charges.len(), 1, "{l}");
    assert_eq!(charges[0]["payment"], point["payment"], "{l}");
    assert_eq!(charges[0]["requests"], 2, "{l}");
    // One creation: the dead shop's; the second shop created none, resumed once.
    let s = stats(&http, b.port).await;
    assert_eq!(s["payments_created"], 0, "{s}");
    assert_eq!(s["resumed"], serde_json::json!({"created": 1}), "{s}");
    assert_eq!(s["recoveries"], serde_json::json!([]), "{s}");
    eprintln!(
        "{label}: SIGKILL mid-charge; {conflicts} retries got 409, the takeover resumed from \
         created {waited:?} after the kill; 1 creation, 1 charge (2 requests)"
    );
    drop((b, net));
    ns.drop_now().await;
}

/// Worker path: kill -9 mid-charge, a shop with the worker on and NO client retry: the
/// record is completed within the lease and a sweep; then the retry replays the worker's
/// answer.
async fn the_worker_finishes_a_killed_payment(backend: Backend, db: u8) {
    let label = format!("resume-worker-{backend:?}");
    let Some(ns) = Namespace::new(backend, db, &label).await else {
        return;
    };
    let http = client();
    let api_key = run_id(&label);
    let scope = format!("api-key:{api_key}");
    let key = "pay-1";
    let (net, net_url) = network().await;
    let (killed, point) = kill_mid_charge(&ns.url, &net_url, net.port, &api_key, key).await;

    let sweep = SWEEP_MS.to_string();
    let env = [
        ("CARD_NETWORK_URL", net_url.as_str()),
        ("ADMIN_TOKEN", TOKEN),
        ("IDEMPOTENCY_RECOVERY_INTERVAL_MS", sweep.as_str()),
    ];
    let w = Shop::start_with(&ns.url, LEASE_MS, 50, &env).await;
    let within = Duration::from_millis(LEASE_MS + SWEEP_MS) + Duration::from_secs(3);
    wait_until("the worker completed the record", within, || async {
        record(&http, w.port, TOKEN, &scope, key)
            .await
            .is_some_and(|r| r["state"] == "completed")
    })
    .await;
    let done = killed.elapsed();
    assert!(
        done >= Duration::from_millis(LEASE_MS * 2 / 3),
        "recovered {done:?} after the kill, inside the lease"
    );
    let r = record(&http, w.port, TOKEN, &scope, key).await.unwrap();
    assert_eq!(
        (r["generation"].as_u64(), r["answer_status"].as_u64()),
        (Some(2), Some(201)),
        "{r}"
    );

    let replay = pay(&http, w.port, &api_key, key, 100).await.unwrap();
    assert_eq!(
        (replay.0, replay.1),
        (StatusCode::CREATED, true),
        "{replay:?}"
    );
    let body = json(&replay.2);
    assert_eq!(body["id"], point["payment"], "{body}");
    assert_eq!(body["resumed_from"], "created", "{body}");
    assert_eq!(
        pay(&http, w.port, &api_key, key, 100).await.unwrap(),
        replay,
        "the same replay"
    );
    let l = ledger(&http, net.port).await;
    let charges = entries(&l);
    assert_eq!(charges.len(), 1, "{l}");
    assert_eq!(charges[0]["requests"], 2, "{l}");
    let s = stats(&http, w.port).await;
    assert_eq!(s["payments_created"], 0, "{s}");
    assert_eq!(
        s["resumed"],
        serde_json::json!({}),
        "no client takeover: {s}"
    );
    let runs = s["recoveries"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{s}");
    assert_eq!(
        (&runs[0]["from"], &runs[0]["payment"], &runs[0]["result"]),
        (&"created".into(), &point["payment"], &"answered".into()),
        "{s}"
    );
    eprintln!(
        "{label}: SIGKILL mid-charge; the worker (sweep {SWEEP_MS} ms, lease {LEASE_MS} ms) \
         completed the record {done:?} after the kill; the retry replayed it; 1 charge"
    );
    drop((w, net));
    ns.drop_now().await;
}

/// Two shops, each with a worker, and six keys abandoned by a third, killed: three stalled
/// after `created`, three after `charged`. Each record is recovered once, by one of the two,
/// and each payment charged once.
async fn two_workers_recover_each_record_once(backend: Backend, db: u8) {
    let label = format!("resume-fleet-{backend:?}");
    let Some(ns) = Namespace::new(backend, db, &label).await else {
        return;
    };
    let http = client();
    let api_key = run_id(&label);
    let scope = format!("api-key:{api_key}");
    let (net, net_url) = network().await;
    let sweep = SWEEP_MS.to_string();
    let env = [
        ("CARD_NETWORK_URL", net_url.as_str()),
        ("ADMIN_TOKEN", TOKEN),
        ("IDEMPOTENCY_RECOVERY_INTERVAL_MS", sweep.as_str()),
    ];
    // The fleet runs first: its workers must leave the victim's live keys alone.
    let b = Shop::start_with(&ns.url, LEASE_MS, 20, &env).await;
    let c = Shop::start_with(&ns.url, LEASE_MS, 20, &env).await;
    let mut a = Shop::start_with(&ns.url, LEASE_MS, 20, &[("CARD_NETWORK_URL", &net_url)]).await;
    let keys: Vec<(String, &str)> = (0..6)
        .map(|i| {
            (
                format!("k{i}"),
                if i % 2 == 0 { "created" } else { "charged" },
            )
        })
        .collect();
    let mut in_flight = Vec::new();
    for (i, (key, phase)) in keys.iter().enumerate() {
        let (http2, api_key, key, phase, port) =
            (http.clone(), api_key.clone(), key.clone(), *phase, a.port);
        in_flight.push(tokio::spawn(async move {
            pay_with(
                &http2,
                port,
                &api_key,
                &key,
                100,
                &[("shop-stall-after", phase)],
            )
            .await
        }));
        // One at a time, so the victim's payment ids follow the keys: k<i> is pay_<i+1>.
        wait_until("the payment stalled", Duration::from_secs(10), || async {
            stats(&http, a.port).await["stalled"] == (i + 1) as u64
        })
        .await;
    }
    // A few sweeps with every lease alive: nothing is taken.
    tokio::time::sleep(Duration::from_millis(2 * SWEEP_MS)).await;
    for s in [&b, &c] {
        assert_eq!(
            stats(&http, s.port).await["recoveries"],
            serde_json::json!([])
        );
    }
    assert_eq!(ledger(&http, net.port).await["count"], 3);
    let killed = Instant::now();
    a.sigkill();
    for t in in_flight {
        assert!(t.await.unwrap().is_err(), "the killed shop answered");
    }
    let within = Duration::from_millis(LEASE_MS + SWEEP_MS) + Duration::from_secs(5);
    wait_until("every record completed", within, || async {
        for (key, _) in &keys {
            let done = record(&http, b.port, TOKEN, &scope, key)
                .await
                .is_some_and(|r| r["state"] == "completed");
            if !done {
                return false;
            }
        }
        true
    })
    .await;
    let done = killed.elapsed();

    // Every run of the recover function, over both processes.
    let mut runs: BTreeMap<String, Vec<(usize, Value)>> = BTreeMap::new();
    let mut per_shop = Vec::new();
    for (n, s) in [&b, &c].into_iter().enumerate() {
        let st = stats(&http, s.port).await;
        assert_eq!(st["payments_created"], 0, "{st}");
        assert_eq!(st["resumed"], serde_json::json!({}), "{st}");
        let list = st["recoveries"].as_array().unwrap();
        per_shop.push(list.len());
        for run in list {
            runs.entry(run["record"].as_str().unwrap().to_owned())
                .or_default()
                .push((n, run.clone()));
        }
    }
    assert_eq!(runs.len(), keys.len(), "{runs:?}");
    for (i, (key, phase)) in keys.iter().enumerate() {
        let id = RecordId::new(Some(&scope), key).to_hex();
        let mine = runs
            .get(&id)
            .unwrap_or_else(|| panic!("{key} never recovered: {runs:?}"));
        assert_eq!(mine.len(), 1, "{key} recovered more than once: {mine:?}");
        let run = &mine[0].1;
        assert_eq!(run["result"], "answered", "{run}");
        assert_eq!(run["from"], *phase, "{run}");
        assert_eq!(run["payment"], format!("pay_{}", i + 1), "{run}");
        // The client's retry, on either shop, replays the worker's answer.
        let port = [b.port, c.port][i % 2];
        let replay = pay(&http, port, &api_key, key, 100).await.unwrap();
        assert_eq!(
            (replay.0, replay.1),
            (StatusCode::CREATED, true),
            "{key}: {replay:?}"
        );
        let body = json(&replay.2);
        assert_eq!(body["id"], format!("pay_{}", i + 1), "{body}");
        assert_eq!(body["resumed_from"], *phase, "{body}");
    }
    // Each payment charged once, and only once asked for: after `charged` the workers did
    // not call the network, after `created` the dead shop had not.
    let l = ledger(&http, net.port).await;
    let charges = entries(&l);
    assert_eq!(charges.len(), keys.len(), "{l}");
    let mut payments: Vec<_> = charges
        .iter()
        .map(|c| {
            assert_eq!(c["requests"], 1, "{c}");
            c["payment"].as_str().unwrap().to_owned()
        })
        .collect();
    payments.sort();
    payments.dedup();
    assert_eq!(payments.len(), keys.len(), "{l}");
    eprintln!(
        "{label}: 6 abandoned keys, 2 workers: recovered {per_shop:?} (each record once) \
         {done:?} after the kill; 6 charges"
    );
    drop((b, c, net));
    ns.drop_now().await;
}

/// A recover function that always fails (`SHOP_RECOVER_FAIL=1`) with at most 3 attempts:
/// the worker tries generations 2 and 3, then leaves the record in progress, logged once
/// at ERROR; the client's retry can still finish it.
async fn a_failing_recovery_stops_after_its_attempts(backend: Backend, db: u8) {
    let label = format!("resume-fail-{backend:?}");
    let Some(ns) = Namespace::new(backend, db, &label).await else {
        return;
    };
    let http = client();
    let api_key = run_id(&label);
    let scope = format!("api-key:{api_key}");
    let key = "pay-1";
    let (net, net_url) = network().await;
    let mut a = Shop::start_with(&ns.url, LEASE_MS, 20, &[("CARD_NETWORK_URL", &net_url)]).await;
    let paying = {
        let (http, api_key, port) = (http.clone(), api_key.clone(), a.port);
        tokio::spawn(async move {
            pay_with(
                &http,
                port,
                &api_key,
                key,
                100,
                &[("shop-stall-after", "created")],
            )
            .await
        })
    };
    wait_until("the payment stalled", Duration::from_secs(10), || async {
        stats(&http, a.port).await["stalled"] == 1
    })
    .await;
    let killed = Instant::now();
    a.sigkill();
    assert!(paying.await.unwrap().is_err());

    let sweep = SWEEP_MS.to_string();
    let env = [
        ("CARD_NETWORK_URL", net_url.as_str()),
        ("ADMIN_TOKEN", TOKEN),
        ("IDEMPOTENCY_RECOVERY_INTERVAL_MS", sweep.as_str()),
        ("IDEMPOTENCY_RECOVERY_MAX_ATTEMPTS", "3"),
        ("SHOP_RECOVER_FAIL", "1"),
    ];
    let w = Shop::start_logged(&ns.url, LEASE_MS, 20, &env).await;
    const LEFT: &str = "left for an operator";
    // Three leases: the dead holder's, then each failed attempt's, and a sweep after each.
    let within = Duration::from_millis(3 * (LEASE_MS + SWEEP_MS)) + Duration::from_secs(4);
    let waited = tokio::time::timeout(within, async {
        while !w.log().contains(LEFT) {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "not left for an operator within {within:?}: {} {}",
        stats(&http, w.port).await,
        w.log()
    );
    let left_after = killed.elapsed();
    let runs = |s: &Value| s["recoveries"].as_array().unwrap().clone();
    let s = stats(&http, w.port).await;
    let tried = runs(&s);
    assert_eq!(tried.len(), 2, "generations 2 and 3: {s}");
    for (run, generation) in tried.iter().zip([2, 3]) {
        assert_eq!(
            (&run["generation"], &run["from"], &run["result"]),
            (&generation.into(), &"created".into(), &"failed".into()),
            "{s}"
        );
    }
    let r = record(&http, w.port, TOKEN, &scope, key).await.unwrap();
    assert_eq!(r["state"], "in_progress", "{r}");
    assert_eq!(r["generation"], 3, "{r}");
    assert_eq!(r["recovery_point"]["step"], "created", "{r}");
    // More sweeps: no more attempts, and the record is reported once.
    tokio::time::sleep(Duration::from_millis(4 * SWEEP_MS)).await;
    assert_eq!(runs(&stats(&http, w.port).await).len(), 2);
    let log = w.log();
    assert_eq!(log.matches(LEFT).count(), 1, "{log}");
    assert!(log.contains("ERROR"), "{log}");
    assert_eq!(ledger(&http, net.port).await["count"], 0, "nothing charged");

    // Left in progress, not lost: the client's retry (a takeover, the handler's path) resumes it.
    let (retry, _) = until_not_409(&http, w.port, &api_key, key).await;
    assert_eq!(
        (retry.0, retry.1),
        (StatusCode::CREATED, false),
        "{retry:?}"
    );
    let body = json(&retry.2);
    assert_eq!(
        (&body["id"], &body["resumed_from"]),
        (&"pay_1".into(), &"created".into()),
        "{body}"
    );
    assert_eq!(ledger(&http, net.port).await["count"], 1);
    eprintln!(
        "{label}: the recover function failed at generations 2 and 3; left for an operator \
         {left_after:?} after the kill, logged once; the client's retry then resumed it"
    );
    drop((w, net));
    ns.drop_now().await;
}

// Redis databases: one per test, so no worker sees another test's keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_resumes_a_killed_payment_on_redis() {
    a_retry_resumes_a_killed_payment(Backend::Redis, 11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_resumes_a_killed_payment_on_postgres() {
    a_retry_resumes_a_killed_payment(Backend::Postgres, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_finishes_a_killed_payment_on_redis() {
    the_worker_finishes_a_killed_payment(Backend::Redis, 12).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_finishes_a_killed_payment_on_postgres() {
    the_worker_finishes_a_killed_payment(Backend::Postgres, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_recover_each_record_once_on_redis() {
    two_workers_recover_each_record_once(Backend::Redis, 13).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_recover_each_record_once_on_postgres() {
    two_workers_recover_each_record_once(Backend::Postgres, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_recovery_stops_after_its_attempts_on_redis() {
    a_failing_recovery_stops_after_its_attempts(Backend::Redis, 14).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_recovery_stops_after_its_attempts_on_postgres() {
    a_failing_recovery_stops_after_its_attempts(Backend::Postgres, 0).await;
}
