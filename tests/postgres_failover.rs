//! `PostgresStore` through a promotion: a multi-host URL with
//! `target_session_attrs=read-write` in front of a private primary and a `pg_basebackup`
//! standby. When the old primary is fenced (read-only) and the standby promoted, the pooled
//! connections to the old primary answer SQLSTATE 25006; the store drops them and reconnects,
//! so no request fails on them. And a duplicate storm across the promotion of a synchronous
//! standby, counting duplicates and lost acknowledged answers.
#![cfg(all(feature = "conformance", feature = "postgres"))]

mod support;

use support::pg_failover;
use support::shop::Shops;
use support::storm::{self, storm};

use std::sync::Arc;
use std::time::{Duration, Instant};

use pg_failover::PgPair;
use tokio_postgres::NoTls;
use tower_idempotency::conformance::{fp, unique_id};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

async fn sql(url: &str, statement: &str) {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client.simple_query(statement).await.unwrap();
}

async fn one_bool(url: &str, query: &str) -> bool {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    client.query_one(query, &[]).await.unwrap().get(0)
}

/// Polls `check` until it holds, within `within`: waiting on a real server, not ordering.
async fn until(within: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_promotion_no_request_fails_on_a_connection_to_the_fenced_primary() {
    let Some(mut pair) = PgPair::start() else {
        return;
    };
    let (p, s) = (pair.primary.port, pair.standby.port);
    let url = format!(
        "postgres://postgres@127.0.0.1:{p},127.0.0.1:{s}/postgres\
         ?target_session_attrs=read-write&connect_timeout=2"
    );
    let store = PostgresStore::builder()
        .with_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    // Fill the pool with connections to the primary.
    let warm: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let id = unique_id("warm");
                store
                    .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
                    .await
            })
        })
        .collect();
    for w in warm {
        assert!(matches!(w.await.unwrap(), Ok(ClaimOutcome::Claimed(_))));
    }
    let kept = unique_id("kept");
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&kept, &fp(1), LEASE, TTL))
            .await,
        Ok(ClaimOutcome::Claimed(_))
    ));

    // Fence the old primary (read-only for every session, the pooled ones included), let
    // the standby replay all it has, promote it.
    let primary = pair.primary.url();
    sql(
        &primary,
        "ALTER SYSTEM SET default_transaction_read_only = on",
    )
    .await;
    sql(&primary, "SELECT pg_reload_conf()").await;
    until(
        Duration::from_secs(10),
        "the primary is fenced",
        async || {
            one_bool(
                &primary,
                "SELECT current_setting('transaction_read_only') = 'on'",
            )
            .await
        },
    )
    .await;
    let standby = pair.standby.url();
    until(
        Duration::from_secs(10),
        "the standby caught up",
        async || {
            let (client, conn) = tokio_postgres::connect(&primary, NoTls).await.unwrap();
            tokio::spawn(conn);
            let lsn: String = client
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .unwrap()
                .get(0);
            one_bool(
                &standby,
                &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            )
            .await
        },
    )
    .await;
    pair.standby.promote();
    assert!(!one_bool(&standby, "SELECT pg_is_in_recovery()").await);

    // Every pooled connection still points at the fenced node: none may fail a request.
    let mut failures = Vec::new();
    for _ in 0..20 {
        let id = unique_id("after");
        match store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
        {
            Ok(ClaimOutcome::Claimed(_)) => {}
            other => failures.push(format!("{other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    // The new primary has what the old one acknowledged before the fence.
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&kept, &fp(1), LEASE, TTL))
            .await,
        Ok(ClaimOutcome::Existing(_))
    ));
    // The old primary gone for good: the store is on the new one already.
    pair.primary.stop();
    let id = unique_id("gone");
    assert!(matches!(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await,
        Ok(ClaimOutcome::Claimed(_))
    ));
}

/// One storm at a time: each times a real promotion, and two at once on a shared machine
/// would measure each other. (An async lock: it is held across awaits.)
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs per storm: 1, or `IDEMPOTENCY_FAILOVER_TRIALS`.
fn trials() -> u64 {
    support::load::env_num("IDEMPOTENCY_FAILOVER_TRIALS", 1).max(1)
}

/// The storms' lease, as in issue 27's trials.
const STORM_LEASE: Duration = Duration::from_secs(3);

/// What hits the primary in a storm.
#[derive(Debug, Clone, Copy)]
enum PgFault {
    /// The standby is promoted while the old primary still runs, and the old primary is
    /// stopped (fenced) this long after.
    PromoteThenFence(Duration),
    /// The primary is stopped (`SIGQUIT`, immediate shutdown), then the standby promoted.
    Crash,
}

/// Where a storm's requests go.
#[derive(Debug, Clone, Copy)]
enum Through {
    /// The layer in-process.
    Layer,
    /// This many processes of the shop example on the multi-host URL.
    Shops(usize),
}

/// A storm on a primary and its standby (synchronous or not) across `fault`, through the
/// layer in-process. Lease 3 s, so the layer's store deadline `T` is 0.5 s (`lease / 6`).
async fn pg_storm(sync: bool, fault: PgFault) -> Option<storm::Figures> {
    pg_storm_through(sync, fault, Through::Layer).await
}

async fn pg_storm_through(sync: bool, fault: PgFault, through: Through) -> Option<storm::Figures> {
    let mut pair = if sync {
        PgPair::start_sync()?
    } else {
        PgPair::start()?
    };
    let (p, s) = (pair.primary.port, pair.standby.port);
    let url = format!(
        "postgres://postgres@127.0.0.1:{p},127.0.0.1:{s}/postgres\
         ?target_session_attrs=read-write&connect_timeout=2"
    );
    let store = PostgresStore::builder().connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let fault = async || {
        match fault {
            PgFault::PromoteThenFence(after) => {
                tokio::task::block_in_place(|| pair.standby.promote());
                tokio::time::sleep(after).await;
                tokio::task::block_in_place(|| pair.primary.stop());
            }
            PgFault::Crash => {
                tokio::task::block_in_place(|| {
                    pair.primary.stop();
                    pair.standby.promote();
                });
            }
        }
        Instant::now()
    };
    let figures = match through {
        Through::Layer => storm(Arc::new(store), STORM_LEASE, fault).await,
        Through::Shops(n) => {
            let lease_ms = STORM_LEASE.as_millis() as u64;
            let shops = Arc::new(Shops::start(n, &url, lease_ms, &[]).await);
            storm::storm_on(shops, STORM_LEASE, fault).await
        }
    };
    Some(figures)
}

/// With a synchronous standby, every claim and answer the old primary acknowledged is on the
/// standby. Once it is promoted, the old primary's commits wait for a standby that is gone,
/// and a holder's renewals and its record hang with them until the fence. Fenced 1 s after
/// the promotion, `lease > 1.5 × (F + T)` holds (3 s > 2.25 s; docs/operations.md has the
/// arithmetic): nothing acknowledged is lost, nothing runs twice, and any key run again was a
/// takeover the abandoned-key hook named.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_promoted_with_the_old_primary_fenced_within_the_lease_loses_nothing()
{
    let _serial = SERIAL.lock().await;
    for trial in 0..trials() {
        let Some(f) = pg_storm(true, PgFault::PromoteThenFence(Duration::from_secs(1))).await
        else {
            return;
        };
        eprintln!(
            "FIGURES Postgres sync standby promoted, old primary fenced after 1 s, trial {trial}: {f}"
        );
        assert_eq!(f.duplicates(), 0, "{f}");
        assert_eq!(f.lost, 0, "{f}");
        assert_eq!(f.mismatched + f.unanswered, 0, "{f}");
        assert_eq!(f.reran_unheard, 0, "{f}");
    }
}

/// The shop as an operator runs it on a multi-host URL, one and two processes (a key's two
/// clients on different processes), across both faults with a synchronous standby: the same
/// promise as through the layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shop_processes_on_a_synchronous_standby_lose_nothing_across_a_crash_or_a_fenced_promotion()
{
    let _serial = SERIAL.lock().await;
    for trial in 0..trials() {
        for processes in [1, 2] {
            for fault in [
                PgFault::Crash,
                PgFault::PromoteThenFence(Duration::from_secs(1)),
            ] {
                let through = Through::Shops(processes);
                let Some(f) = pg_storm_through(true, fault, through).await else {
                    return;
                };
                eprintln!(
                    "FIGURES Postgres sync standby, {fault:?}, {processes} shop processes, trial {trial}: {f}"
                );
                assert_eq!(f.duplicates(), 0, "{f}");
                assert_eq!(f.lost, 0, "{f}");
                assert_eq!(f.mismatched + f.unanswered, 0, "{f}");
            }
        }
    }
}

/// The same, with the old primary fenced 4 s after the promotion, past the 3 s lease: a holder
/// cannot record its answer before its lease lapses on the new primary, so a retry may take
/// over and run again. Nothing is promised about duplicates here, so those figures are
/// printed, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_promoted_with_the_old_primary_fenced_late_is_measured() {
    let _serial = SERIAL.lock().await;
    for trial in 0..trials() {
        let Some(f) = pg_storm(true, PgFault::PromoteThenFence(Duration::from_secs(4))).await
        else {
            return;
        };
        eprintln!(
            "FIGURES Postgres sync standby promoted, old primary fenced after 4 s, trial {trial}: {f}"
        );
        // No acknowledged claim is lost with a synchronous standby, so a key run again was
        // taken over, and the abandoned-key hook must have named it.
        assert_eq!(f.reran_unheard, 0, "{f}");
    }
}

/// A synchronous standby promoted after the primary crashed: every acknowledged commit is on
/// it. A holder caught by the crash cannot renew until the promotion, so a lease shorter than
/// the crash-to-promotion time would be taken over; here the promotion follows at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_promoted_after_a_primary_crash_loses_nothing() {
    let _serial = SERIAL.lock().await;
    for trial in 0..trials() {
        let Some(f) = pg_storm(true, PgFault::Crash).await else {
            return;
        };
        eprintln!("FIGURES Postgres sync standby, primary crash, trial {trial}: {f}");
        assert_eq!(f.duplicates(), 0, "{f}");
        assert_eq!(f.lost, 0, "{f}");
        assert_eq!(f.mismatched + f.unanswered, 0, "{f}");
        assert_eq!(f.reran_unheard, 0, "{f}");
    }
}

/// An asynchronous standby promises nothing across a failover: a crash loses what the
/// standby had not replayed, a promotion while the old primary still serves everything the
/// old primary acknowledges until it is fenced. Measured, not asserted: after a crash, and
/// with the old primary fenced 1 s after the promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_asynchronous_standby_is_measured_after_a_crash_and_a_promotion_beside_the_old_primary()
{
    let _serial = SERIAL.lock().await;
    for trial in 0..trials() {
        for fault in [
            PgFault::Crash,
            PgFault::PromoteThenFence(Duration::from_secs(1)),
        ] {
            let Some(f) = pg_storm(false, fault).await else {
                return;
            };
            eprintln!("FIGURES Postgres async standby, {fault:?}, trial {trial}: {f}");
        }
    }
}
