//! Redis failover: a store that follows its primary (a demoted node behind a URL, Sentinel),
//! setup errors that name the fix, and duplicate storms across a primary crash and a forced
//! failover, counting duplicates and lost acknowledged answers: through the layer in-process,
//! and through one and two processes of the shop example on `redis+sentinel://` (the binary
//! `cargo test --all-features` builds; alone, `cargo build --example shop --all-features`).
//!
//! Each test starts its own servers on free loopback ports (a primary, replicas, three
//! Sentinels) and stops them when it ends. The storms run once per scenario;
//! `IDEMPOTENCY_FAILOVER_TRIALS=<n>` runs each `n` times.
#![cfg(all(feature = "conformance", feature = "redis"))]

mod support;

use support::failover as failover_harness;
use support::load;
use support::redis_harness;
use support::shop::Shops;
use support::storm::{self, Figures};

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use failover_harness::{wait_for, SwitchProxy, Topology, MASTER};
use load::{env_num, run_id};
use redis_harness::RedisServer;
use tower_idempotency::conformance::{fp, unique_id};
use tower_idempotency::store::redis::{RedisStore, SetupError};
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, StoreErrorKind};

/// The lease of the storms, as in issue 27's trials.
const LEASE: Duration = Duration::from_secs(3);
const TTL: Duration = Duration::from_secs(600);

/// One failover at a time: the scenarios time a real failover, and two at once on a shared
/// machine would measure each other.
/// (An async lock: tests run on runtimes of their own, and it is held across awaits.)
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

async fn claim(
    store: &RedisStore,
    id: &tower_idempotency::store::RecordId,
) -> Result<(), StoreErrorKind> {
    match store
        .claim(&ClaimRequest::new(id, &fp(1), LEASE, TTL))
        .await
    {
        Ok(ClaimOutcome::Claimed(_)) => Ok(()),
        Ok(other) => panic!("a fresh key was not claimed: {other:?}"),
        Err(e) => Err(e.kind()),
    }
}

/// Claims fresh keys until one succeeds, within `within`; how many failed first, by kind.
async fn claims_until_one_succeeds(store: &RedisStore, within: Duration) -> Vec<StoreErrorKind> {
    let deadline = Instant::now() + within;
    let mut failed = Vec::new();
    loop {
        match claim(store, &unique_id("follow")).await {
            Ok(()) => return failed,
            Err(kind) => failed.push(kind),
        }
        assert!(
            Instant::now() < deadline,
            "no claim succeeded within {within:?}; {} failures, the last {:?}",
            failed.len(),
            failed.last()
        );
        // Pacing the retries of a client, not ordering tasks.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Behind a proxy that follows the primary, the store's open connection stays on the old
/// node after a switchover. That node answers `READONLY`; the store must reconnect (and reach
/// the new primary) instead of failing every claim until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_node_behind_the_url_is_left_and_claims_succeed_on_the_writable_one() {
    let _serial = serial().await;
    let Some(a) = RedisServer::start(&[]) else {
        return;
    };
    let a_port = a.port().to_string();
    let b = RedisServer::start(&["--replicaof", "127.0.0.1", &a_port]).unwrap();
    let b_port = b.port().to_string();
    let proxy = SwitchProxy::start(a.port()).await;
    let store = RedisStore::connect(&proxy.url()).await.unwrap();
    claim(&store, &unique_id("before")).await.unwrap();

    // Switchover: B promoted, A demoted under B, the proxy sends new connections to B. No
    // client of A is disconnected (REPLICAOF does not do that; Sentinel would).
    b.cli(&["replicaof", "no", "one"]);
    a.cli(&["replicaof", "127.0.0.1", &b_port]);
    proxy.switch(b.port());
    wait_for(Duration::from_secs(10), "A replicates B", || {
        a.cli(&["info", "replication"])
            .contains("master_link_status:up")
    });
    let failed = claims_until_one_succeeds(&store, Duration::from_secs(10)).await;
    assert!(
        failed.iter().all(|k| *k == StoreErrorKind::Unavailable),
        "READONLY is a store error (Unavailable): {failed:?}"
    );
    assert!(
        !failed.is_empty(),
        "the first claim after the switchover went to A and must have been refused"
    );
    // The claim that succeeded is on B, the primary.
    let id = unique_id("after");
    claim(&store, &id).await.unwrap();
    let key = store.key(&id);
    assert_eq!(b.cli(&["exists", &key]).trim(), "1", "the record is on B");

    // Demoted with the URL pointing at it (no proxy in between): claims fail while it is a
    // replica and succeed again once it is writable, without a restart.
    let direct = RedisStore::connect(&b.url()).await.unwrap();
    b.cli(&["replicaof", "127.0.0.1", &a_port]);
    a.cli(&["replicaof", "no", "one"]);
    assert_eq!(
        claim(&direct, &unique_id("on-replica")).await,
        Err(StoreErrorKind::Unavailable)
    );
    b.cli(&["replicaof", "no", "one"]);
    claims_until_one_succeeds(&direct, Duration::from_secs(10)).await;
}

fn sentinel_builder() -> tower_idempotency::store::redis::RedisStoreBuilder {
    RedisStore::builder().with_key_prefix(format!("{}:", run_id("failover")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_sentinel_urls_are_setup_errors_that_show_the_form() {
    let cases = [
        ("redis+sentinel://127.0.0.1:26379", "master name is missing"),
        (
            "redis+sentinel://127.0.0.1:26379/",
            "master name after the hosts is empty",
        ),
        ("redis+sentinel://127.0.0.1:x/m", "has no valid port"),
        ("redis+sentinel://a:1,,b:2/m", "a host is empty"),
        ("redis+sentinel://u:p@a:1/m", "credentials"),
        ("redis+sentinel://a:1/m/x", "one path segment"),
    ];
    for (url, problem) in cases {
        let err = RedisStore::builder().connect(url).await.unwrap_err();
        assert!(
            matches!(err, SetupError::SentinelUrl { .. }),
            "{url}: {err}"
        );
        let text = err.to_string();
        assert!(text.contains(problem), "{url}: {text}");
        assert!(
            text.contains("redis+sentinel://host:port[,host:port...]/<master-name>"),
            "{text}"
        );
        assert_eq!(format!("{err:?}"), text, "Debug prints the sentence");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sentinel_answering_is_a_setup_error_naming_them() {
    let ports = [redis_harness::free_port(), redis_harness::free_port()];
    let url = format!(
        "redis+sentinel://127.0.0.1:{},127.0.0.1:{}/{MASTER}",
        ports[0], ports[1]
    );
    let started = Instant::now();
    let err = RedisStore::builder()
        .with_timeout(Duration::from_millis(300))
        .connect(&url)
        .await
        .unwrap_err();
    assert!(matches!(err, SetupError::NoSentinel { .. }), "{err}");
    let text = err.to_string();
    for p in ports {
        assert!(text.contains(&format!("127.0.0.1:{p}")), "{text}");
    }
    assert!(text.contains("26379"), "says the default port: {text}");
    assert_eq!(format!("{err:?}"), text);
    // Each Sentinel is tried within 2 × the timeout.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_setup_refuses_an_unknown_master_and_a_wait_the_topology_cannot_meet() {
    let _serial = serial().await;
    let Some(topology) = Topology::start(2) else {
        return;
    };
    let addrs = topology.sentinel_addrs().join(",");
    let err = sentinel_builder()
        .connect(&format!("redis+sentinel://{addrs}/no-such-master"))
        .await
        .unwrap_err();
    assert!(matches!(err, SetupError::UnknownMaster { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("\"no-such-master\"") && text.contains("SENTINEL MASTERS"),
        "{text}"
    );
    assert_eq!(format!("{err:?}"), text);

    let err = sentinel_builder()
        .with_wait(NonZeroU32::new(3).unwrap(), Duration::from_millis(200))
        .connect(&topology.sentinel_url())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SetupError::TooFewReplicas {
                connected: 2,
                wanted: 3,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(format!("{err:?}"), err.to_string());

    // Two of two: accepted, and a claim goes to the primary Sentinel names.
    let store = sentinel_builder()
        .with_wait(NonZeroU32::new(2).unwrap(), Duration::from_millis(500))
        .connect(&topology.sentinel_url())
        .await
        .unwrap();
    let id = unique_id("sentinel");
    claim(&store, &id).await.unwrap();
    let primary = topology.primary_port();
    let key = store.key(&id);
    assert_eq!(redis_harness::cli(primary, &["exists", &key]).trim(), "1");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// `kill -9` of the primary; it restarts empty once a replica is promoted.
    Crash,
    /// `SENTINEL FAILOVER`: the old primary stays up until Sentinel demotes it.
    Forced,
}

/// Hits the primary with `fault`; returns once every Sentinel names the new primary.
async fn hit(topology: &mut Topology, fault: Fault) -> Instant {
    let old = topology.primary_port();
    match fault {
        Fault::Crash => {
            topology.primary_mut().stop();
            tokio::task::block_in_place(|| {
                topology.wait_for_new_primary(old, Duration::from_secs(30))
            });
        }
        Fault::Forced => {
            tokio::task::block_in_place(|| topology.force_failover());
        }
    }
    let promoted_at = Instant::now();
    if fault == Fault::Crash {
        // Back, empty: Sentinel turns it into a replica of the new primary.
        let node = topology.nodes.iter_mut().find(|n| n.port() == old).unwrap();
        node.restart();
    }
    promoted_at
}

/// The shared storm ([`storm::storm`]) with `fault` hitting the primary.
async fn storm(
    topology: &mut Topology,
    store: RedisStore,
    fault: Fault,
    lease: Duration,
) -> Figures {
    storm::storm(Arc::new(store), lease, async || hit(topology, fault).await).await
}

fn trials() -> u64 {
    env_num("IDEMPOTENCY_FAILOVER_TRIALS", 1).max(1)
}

async fn sentinel_store(topology: &Topology, wait: Option<u32>) -> RedisStore {
    sentinel_store_with(topology, wait, true).await
}

async fn sentinel_store_with(topology: &Topology, wait: Option<u32>, events: bool) -> RedisStore {
    let mut builder = sentinel_builder().with_failover_events(events);
    if let Some(n) = wait {
        builder = builder.with_wait(NonZeroU32::new(n).unwrap(), Duration::from_millis(200));
    }
    builder.connect(&topology.sentinel_url()).await.unwrap()
}

/// A crash with `WAIT 1`: Sentinel promotes the replica with the most data, which has every
/// write `WAIT 1` acknowledged, so nothing acknowledged is lost and nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_crash_with_wait_one_loses_nothing_and_recovers_within_5_s() {
    let _serial = serial().await;
    for trial in 0..trials() {
        let Some(mut topology) = Topology::start(2) else {
            return;
        };
        let store = sentinel_store(&topology, Some(1)).await;
        let f = storm(&mut topology, store, Fault::Crash, LEASE).await;
        eprintln!("FIGURES crash, WAIT 1 of 2, trial {trial}: {f}");
        assert_eq!(f.duplicates(), 0, "{f}");
        assert_eq!(f.lost, 0, "{f}");
        assert_eq!(f.mismatched + f.unanswered, 0, "{f}");
        assert!(f.outage <= Duration::from_secs(5), "{f}");
    }
}

/// The lease for a forced failover with `WAIT` for every replica: no write is acknowledged
/// until Sentinel re-attaches the old primary as a replica of the new one (it notices the old
/// primary on its 10 s `INFO` round: about 13 s here), and a request in flight keeps its
/// answer only if its lease outlives that, so it can record it then: 30 s (the default).
const FORCED_LEASE: Duration = Duration::from_secs(30);

/// A forced failover with `WAIT` for every replica: the promoted replica stops replicating
/// first, so the old primary can no longer acknowledge anything, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forced_failover_with_wait_for_every_replica_loses_nothing() {
    let _serial = serial().await;
    for trial in 0..trials() {
        let Some(mut topology) = Topology::start(2) else {
            return;
        };
        let store = sentinel_store(&topology, Some(2)).await;
        let f = storm(&mut topology, store, Fault::Forced, FORCED_LEASE).await;
        eprintln!("FIGURES forced failover, WAIT 2 of 2, trial {trial}: {f}");
        assert_eq!(f.duplicates(), 0, "{f}");
        assert_eq!(f.lost, 0, "{f}");
        assert_eq!(f.mismatched + f.unanswered, 0, "{f}");
    }
}

/// A forced failover with `WAIT 1` of two replicas: the old primary can acknowledge writes
/// the promoted replica never gets, until the store stops writing to it. Nothing is promised
/// here, so the figures are printed, not asserted: without Sentinel's events (the store
/// learns of the failover when the old primary is demoted) and with them (it stops writing
/// at the failover's first event).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forced_failover_with_wait_one_of_two_is_measured_with_and_without_events() {
    let _serial = serial().await;
    for trial in 0..trials() {
        for events in [false, true] {
            let Some(mut topology) = Topology::start(2) else {
                return;
            };
            let store = sentinel_store_with(&topology, Some(1), events).await;
            let f = storm(&mut topology, store, Fault::Forced, LEASE).await;
            let how = if events {
                "with events"
            } else {
                "without events"
            };
            eprintln!("FIGURES forced failover, WAIT 1 of 2, {how}, trial {trial}: {f}");
        }
    }
}

/// Without `WAIT` nothing is promised across a failover: a crash loses what the promoted
/// replica had not received, a forced failover what the old primary acknowledged before the
/// store stopped writing to it. Measured, with the failover events on (the default).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failovers_without_wait_are_measured() {
    let _serial = serial().await;
    for trial in 0..trials() {
        for fault in [Fault::Crash, Fault::Forced] {
            let Some(mut topology) = Topology::start(2) else {
                return;
            };
            let store = sentinel_store(&topology, None).await;
            let f = storm(&mut topology, store, fault, LEASE).await;
            eprintln!("FIGURES {fault:?}, no WAIT, trial {trial}: {f}");
        }
    }
}

/// The shop as an operator runs it: `IDEMPOTENCY_STORE=redis+sentinel://…` with
/// `IDEMPOTENCY_REDIS_WAIT=1:200`, in `processes` processes. A storm across a primary kill,
/// then, with the same processes (no restart), one across a forced failover. The kill with
/// `WAIT 1` is promised 0 duplicates and 0 lost; the forced failover with `WAIT 1` of 2 is
/// not, so only that every key was answered is asserted there.
async fn shops_across_a_kill_then_a_forced_failover(processes: usize) {
    let _serial = serial().await;
    for trial in 0..trials() {
        let Some(mut topology) = Topology::start(2) else {
            return;
        };
        let url = topology.sentinel_url();
        let env = [("IDEMPOTENCY_REDIS_WAIT", "1:200")];
        let lease_ms = LEASE.as_millis() as u64;
        let shops = Arc::new(Shops::start(processes, &url, lease_ms, &env).await);
        let f = storm::storm_on(shops.clone(), LEASE, async || {
            hit(&mut topology, Fault::Crash).await
        })
        .await;
        eprintln!("FIGURES {processes} shop processes, crash, WAIT 1 of 2, trial {trial}: {f}");
        assert_eq!(f.duplicates(), 0, "{f}");
        assert_eq!(f.lost, 0, "{f}");
        assert_eq!(f.mismatched + f.unanswered, 0, "{f}");
        assert!(f.outage <= Duration::from_secs(5), "{f}");

        // The killed node is back as a replica; the same shop processes go on.
        tokio::task::block_in_place(|| topology.wait_until_settled(2));
        let f = storm::storm_on(shops.clone(), LEASE, async || {
            hit(&mut topology, Fault::Forced).await
        })
        .await;
        eprintln!(
            "FIGURES {processes} shop processes, then a forced failover, WAIT 1 of 2, trial {trial}: {f}"
        );
        assert_eq!(f.unanswered, 0, "{f}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_shop_process_on_sentinel_survives_a_primary_kill_then_a_forced_failover() {
    shops_across_a_kill_then_a_forced_failover(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_shop_processes_on_sentinel_survive_a_primary_kill_then_a_forced_failover() {
    shops_across_a_kill_then_a_forced_failover(2).await;
}
