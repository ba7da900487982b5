//! `RedisStore` against real Redis: the conformance suite on `IDEMPOTENCY_TEST_REDIS_URL`, and
//! the failure modes (eviction policy, out of memory, NOSCRIPT, restart, timeouts, WAIT) and
//! round-trip counts on private `redis-server` processes.
use crate::support::backend as common;
use crate::support::redis_harness;
use tower_idempotency::{conformance, conformance_suite};

use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use conformance::{fp, response, unique_id, DynStore};
use redis_harness::{RedisServer, WithServer};
use tower_idempotency::store::redis::{redis, RedisStore, ReplicationShortfall, SetupError};
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, StoreErrorKind};
use tower_idempotency::store::{RecordId, RecordState, Token};

use crate::support::redis_quota;
use redis_quota::{claim_in, scoped, token_of, LEASE, TTL};

/// The shared Redis from `IDEMPOTENCY_TEST_REDIS_URL`, or `None` (skipped).
async fn shared_store() -> Option<RedisStore> {
    let url = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
    Some(
        RedisStore::connect(&url)
            .await
            .expect("connect to IDEMPOTENCY_TEST_REDIS_URL"),
    )
}

/// A private noeviction server that fills up at a few MiB.
fn tiny_server() -> Option<RedisServer> {
    RedisServer::start(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"])
}

/// A connection for the test's own commands, with no response timeout (a paused server
/// answers late, and the test waits for that).
async fn admin(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap()
}

async fn claim_token(
    store: &impl IdempotencyStore,
    id: &tower_idempotency::store::RecordId,
) -> Token {
    match store
        .claim(&ClaimRequest::new(id, &fp(1), LEASE, TTL))
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

conformance_suite! {
    store: async { Some(Arc::new(shared_store().await?) as DynStore) },
    full: async {
        let server = tiny_server()?;
        let store = RedisStore::connect(&server.url()).await.unwrap();
        Some(Arc::new(WithServer { store, server }) as DynStore)
    },
    admin: async { Some(Arc::new(shared_store().await?) as conformance::DynAdminStore) },
    recovery: async { Some(Arc::new(shared_store().await?) as DynStore) },
}

/// The same contract with quotas set (too large to refuse anything): every record then lives
/// in its scope group's layout, `<prefix>{<scope tag>}<rest>`.
mod with_quotas {
    use super::*;

    fn quotas(
        builder: tower_idempotency::store::redis::RedisStoreBuilder,
    ) -> tower_idempotency::store::redis::RedisStoreBuilder {
        builder
            .with_max_records_per_scope(NonZeroUsize::new(1_000_000).unwrap())
            .with_max_bytes_per_scope(NonZeroUsize::new(1 << 40).unwrap())
    }

    async fn store() -> Option<RedisStore> {
        let url = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
        Some(quotas(RedisStore::builder()).connect(&url).await.unwrap())
    }

    conformance_suite! {
        store: async { Some(Arc::new(store().await?) as DynStore) },
        full: async {
            let server = tiny_server()?;
            let store = quotas(RedisStore::builder()).connect(&server.url()).await.unwrap();
            Some(Arc::new(WithServer { store, server }) as DynStore)
        },
        admin: async { Some(Arc::new(store().await?) as conformance::DynAdminStore) },
        recovery: async { Some(Arc::new(store().await?) as DynStore) },
    }
}

#[tokio::test]
async fn records_are_one_string_per_key_with_a_ttl_under_the_prefix() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::builder()
        .with_key_prefix("test-idem:")
        .connect(&url)
        .await
        .unwrap();
    let mut con = raw_connection(&url).await;
    let id = unique_id("layout");
    let key = store.key(&id);
    assert_eq!(key, format!("test-idem:{{{}}}", id.to_hex()));

    let token = claim_token(&store, &id).await;
    let kind: String = redis::cmd("TYPE")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(kind, "string");
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    // Format, state, fingerprint, nonce, generation, lease field: 82 bytes.
    assert_eq!(value.len(), 82);
    assert_eq!(&value[..2], b"2p");
    assert_eq!(&value[2..34], fp(1).as_bytes());
    assert_eq!(&value[34..50], token.nonce());
    assert_eq!(&value[50..66], b"0000000000000001");
    // The lease ends TTL - LEASE before the key expires, by Redis's clock.
    let gap = format!("k{:015}", (TTL - LEASE).as_millis());
    assert_eq!(std::str::from_utf8(&value[66..82]).unwrap(), gap);
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(
        pttl > 0 && pttl <= TTL.as_millis() as i64,
        "claim PTTL {pttl}"
    );

    let done = response(201, Bytes::from_static(b"\x00\xffraw"));
    store
        .complete(&id, &token, &done, Duration::from_secs(60))
        .await
        .unwrap();
    let completed: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(&completed[..2], b"2c");
    assert_eq!(
        completed[2..66],
        value[2..66],
        "fingerprint and token are kept"
    );
    assert_eq!(
        completed[82..],
        done.encode(),
        "the completion is stored as raw encoded bytes after the header"
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= 60_000, "complete PTTL {pttl}");

    // Braces in the prefix would move the cluster hash tag.
    let err = RedisStore::builder()
        .with_key_prefix("idem:{x}:")
        .connect(&url)
        .await
        .unwrap_err();
    assert!(matches!(err, SetupError::KeyPrefix(_)), "{err:?}");
}

#[tokio::test]
async fn extreme_leases_and_ttls_are_clamped_not_refused() {
    let Some(store) = shared_store().await else {
        return;
    };
    let id = unique_id("extreme");
    let token = match store
        .claim(&ClaimRequest::new(
            &id,
            &fp(1),
            Duration::MAX,
            Duration::MAX,
        ))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("{other:?}"),
    };
    store.extend(&id, &token, Duration::MAX).await.unwrap();
    match store.get(&id).await.unwrap().unwrap().state {
        RecordState::InProgress { lease_remaining } => {
            assert!(
                lease_remaining > Duration::from_secs(1 << 40),
                "{lease_remaining:?}"
            )
        }
        other @ RecordState::Completed(_) => panic!("{other:?}"),
    }
    // A zero lease or TTL is 1 ms, never PEXPIRE 0 (which would delete at once).
    store
        .complete(&id, &token, &response(200, "ok"), Duration::ZERO)
        .await
        .unwrap();
}

#[tokio::test]
async fn eviction_guard_refuses_an_evicting_policy_and_names_it() {
    let Some(server) = RedisServer::start(&["--maxmemory-policy", "volatile-lru"]) else {
        return;
    };
    let err = RedisStore::connect(&server.url()).await.unwrap_err();
    match &err {
        SetupError::EvictionPolicy { policy, .. } => assert_eq!(policy, "volatile-lru"),
        other => panic!("expected EvictionPolicy, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("volatile-lru"), "{msg}");
    assert!(
        msg.contains("CONFIG SET maxmemory-policy noeviction"),
        "{msg}"
    );

    // The explicit opt-in, and only it, lets the store run there.
    let store = RedisStore::builder()
        .with_eviction_guard(false)
        .connect(&server.url())
        .await
        .expect("opted out of the guard");
    claim_token(&store, &unique_id("opt-in")).await;

    // After the fix the default store connects.
    server.cli(&["config", "set", "maxmemory-policy", "noeviction"]);
    RedisStore::connect(&server.url())
        .await
        .expect("noeviction passes");
}

#[tokio::test]
async fn eviction_guard_falls_back_to_info_when_config_is_renamed() {
    let config = "rename-command CONFIG \"\"\nmaxmemory-policy allkeys-lru\n";
    let Some(server) = RedisServer::start_with_config(config, &[]) else {
        return;
    };
    let denied = server.cli(&["config", "get", "maxmemory-policy"]);
    assert!(
        denied.contains("unknown command"),
        "CONFIG should be disabled: {denied}"
    );
    let err = RedisStore::connect(&server.url()).await.unwrap_err();
    match &err {
        SetupError::EvictionPolicy { policy, .. } => assert_eq!(policy, "allkeys-lru"),
        other => panic!("expected EvictionPolicy from INFO, got {other:?}"),
    }

    let config = "rename-command CONFIG \"\"\nmaxmemory-policy noeviction\n";
    let Some(ok) = RedisServer::start_with_config(config, &[]) else {
        return;
    };
    let store = RedisStore::connect(&ok.url())
        .await
        .expect("noeviction read from INFO");
    claim_token(&store, &unique_id("info")).await;
}

/// Fills `server` behind the store's back until it refuses writes, and keeps it full.
async fn fill_up(server: &RedisServer) {
    let mut con = admin(server).await;
    let filler = vec![b'x'; 4 * 1024];
    let mut refused = None;
    for i in 0..10_000 {
        let r: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(&filler)
            .query_async(&mut con)
            .await;
        if let Err(e) = r {
            refused = Some(e);
            break;
        }
    }
    let refused = refused.expect("Redis never filled up");
    assert_eq!(refused.code(), Some("OOM"), "{refused:?}");
    // Right at the limit, freed client buffers can bring Redis back under it for a moment.
    // Lower the limit below what the data holds, so Redis stays full for the rest of the test.
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut con)
        .await
        .unwrap();
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used - 512 * 1024)
        .query_async(&mut con)
        .await
        .unwrap();
}

#[tokio::test]
async fn full_redis_refuses_new_claims_and_still_replays_old_records() {
    let Some(server) = tiny_server() else { return };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let old = unique_id("old");
    let token = claim_token(&store, &old).await;
    store
        .complete(&old, &token, &response(201, "kept"), TTL)
        .await
        .unwrap();
    let pending = unique_id("pending");
    let pending_token = claim_token(&store, &pending).await;

    fill_up(&server).await;

    let new = unique_id("new");
    let err = store
        .claim(&ClaimRequest::new(&new, &fp(1), LEASE, TTL))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Full, "{err:?}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the OOM error is kept as the source"
    );
    assert!(
        store.get(&new).await.unwrap().is_none(),
        "a refused claim writes nothing"
    );

    // Old records replay, through claim and get.
    match store
        .claim(&ClaimRequest::new(&old, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "kept")))
        }
        other => panic!("replay on a full Redis: {other:?}"),
    }
    let got = store.get(&old).await.unwrap().unwrap();
    assert_eq!(got.state, RecordState::Completed(response(201, "kept")));
    // A record in progress is a conflict, its lease read by the script Redis still runs.
    match store
        .claim(&ClaimRequest::new(&pending, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert!(
            matches!(r.state, RecordState::InProgress { lease_remaining } if lease_remaining > LEASE / 2),
            "{r:?}"
        ),
        other => panic!("conflict on a full Redis: {other:?}"),
    }

    // A completion is a write too; a release frees memory and still works.
    let err = store
        .complete(&pending, &pending_token, &response(200, "late"), TTL)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Full, "{err:?}");
    store.release(&pending, &pending_token).await.unwrap();
    assert!(store.get(&pending).await.unwrap().is_none());
}

/// With quotas a full Redis still replays a scope's records and still releases; a claim that
/// would first forget an expired record writes nothing. A release gives the scope its record
/// back even then: Redis refuses only a script's first write, and the release's is a `DEL`.
#[tokio::test]
async fn a_full_redis_with_quotas_replays_and_releases_and_keeps_counts_whole() {
    let Some(server) = tiny_server() else { return };
    let store = RedisStore::builder()
        .with_max_records_per_scope(NonZeroUsize::new(3).unwrap())
        .with_max_bytes_per_scope(NonZeroUsize::new(1 << 20).unwrap())
        .connect(&server.url())
        .await
        .unwrap();
    let (a, in_a) = scoped("full");
    let old = in_a("old");
    let token = token_of(claim_in(&store, &a, &old).await.unwrap());
    store
        .complete(&old, &token, &response(201, "kept"), TTL)
        .await
        .unwrap();
    let pending = in_a("pending");
    let pending_token = token_of(claim_in(&store, &a, &pending).await.unwrap());
    let short = Duration::from_millis(100);
    let brief = in_a("brief");
    token_of(
        store
            .claim(&ClaimRequest::new(&brief, &fp(1), short, short).in_scope(&a))
            .await
            .unwrap(),
    );
    redis_quota::wait_until_expired(&store, &brief).await;
    fill_up(&server).await;

    let err = claim_in(&store, &a, &in_a("new")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Full, "{err:?}");
    assert!(store.get(&in_a("new")).await.unwrap().is_none());
    match claim_in(&store, &a, &old).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "kept")))
        }
        other => panic!("replay on a full Redis: {other:?}"),
    }
    let err = store
        .complete(&pending, &pending_token, &response(200, "late"), TTL)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Full, "{err:?}");
    store.release(&pending, &pending_token).await.unwrap();
    assert!(store.get(&pending).await.unwrap().is_none());

    // Room again: the expired record is forgotten now, the released one counted no more.
    let mut con = admin(&server).await;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query_async(&mut con)
        .await
        .unwrap();
    token_of(claim_in(&store, &a, &in_a("new")).await.unwrap());
    token_of(claim_in(&store, &a, &in_a("newer")).await.unwrap());
    let err = claim_in(&store, &a, &in_a("newest")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
}

#[tokio::test]
async fn flushed_scripts_are_reloaded_between_claim_and_complete() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let id = unique_id("noscript");
    let token = claim_token(&store, &id).await;
    assert_eq!(server.cli(&["script", "flush"]).trim(), "OK");
    store
        .complete(&id, &token, &response(200, "after flush"), TTL)
        .await
        .unwrap();
    assert_eq!(
        store.get(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(200, "after flush"))
    );
    assert!(server
        .cli(&["info", "commandstats"])
        .contains("cmdstat_script|load"));
}

#[tokio::test]
async fn a_restarted_redis_fails_closed_then_serves_again() {
    let Some(mut server) = RedisServer::start(&[]) else {
        return;
    };
    let store = RedisStore::builder()
        .with_timeout(Duration::from_millis(500))
        .connect(&server.url())
        .await
        .unwrap();
    claim_token(&store, &unique_id("before")).await;

    server.stop();
    let during = unique_id("during");
    let err = store
        .claim(&ClaimRequest::new(&during, &fp(1), LEASE, TTL))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.kind(),
            StoreErrorKind::Unavailable | StoreErrorKind::Unknown
        ),
        "a claim while Redis is down must fail closed: {err:?}"
    );

    server.restart();
    // The ConnectionManager reconnects in the background; wait for it, bounded.
    let after = unique_id("after");
    let deadline = Instant::now() + Duration::from_secs(15);
    let token = loop {
        match store
            .claim(&ClaimRequest::new(&after, &fp(1), LEASE, TTL))
            .await
        {
            Ok(ClaimOutcome::Claimed(c)) => break c.token,
            Ok(other) => panic!("fresh key after restart: {other:?}"),
            Err(e) => {
                assert!(Instant::now() < deadline, "never reconnected: {e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    store
        .complete(&after, &token, &response(200, "back"), TTL)
        .await
        .unwrap();
    assert!(store.get(&after).await.unwrap().is_some());
}

/// Reads `INFO commandstats` into (command, calls).
async fn command_calls(con: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Round trips since the last `CONFIG RESETSTAT`: the reads Redis made from its clients
/// (a pipeline arrives in one), less the one that carried this `INFO`.
async fn round_trips(con: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(con)
        .await
        .unwrap();
    let reads: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("total_reads_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_reads_processed");
    reads - 1
}

async fn reset_stats(con: &mut redis::aio::MultiplexedConnection) {
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(con)
        .await
        .unwrap();
}

/// Commands since the last `CONFIG RESETSTAT`, those Redis ran inside scripts included,
/// less this test's own.
async fn commands(con: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    let mut calls = command_calls(con).await;
    calls.retain(|(n, _)| n != "config|resetstat" && n != "info");
    calls.sort();
    calls
}

fn calls(list: &[(&str, u64)]) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = list.iter().map(|(n, c)| (n.to_string(), *c)).collect();
    v.sort();
    v
}

/// Without quotas, on Redis 7, a claim is one plain `SET … NX PX … GET`: one command, no
/// script. A complete is one script call of two commands. A record in progress needs its
/// `PTTL` too, in a second round trip; only a takeover runs the claim script, in a third.
#[tokio::test]
async fn new_requests_cost_two_round_trips_replays_one_conflicts_two() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut con = admin(&server).await;

    reset_stats(&mut con).await;
    let id = unique_id("trips");
    let token = claim_token(&store, &id).await;
    assert_eq!(
        token.generation(),
        1,
        "an absent key is claimed at generation 1"
    );
    store
        .complete(&id, &token, &response(201, "once"), TTL)
        .await
        .unwrap();
    assert_eq!(
        round_trips(&mut con).await,
        2,
        "new request: claim and complete"
    );
    assert_eq!(
        commands(&mut con).await,
        calls(&[("set", 2), ("evalsha", 1), ("getrange", 1)]),
        "claim: SET; complete: EVALSHA running GETRANGE and SET"
    );

    reset_stats(&mut con).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::Completed(_))),
        other => panic!("{other:?}"),
    }
    assert_eq!(round_trips(&mut con).await, 1, "replay: one round trip");
    assert_eq!(
        commands(&mut con).await,
        calls(&[("set", 1)]),
        "replay: the claim's SET answers the record"
    );

    let busy = unique_id("busy");
    claim_token(&store, &busy).await;
    reset_stats(&mut con).await;
    match store
        .claim(&ClaimRequest::new(&busy, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::InProgress { .. })),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        round_trips(&mut con).await,
        2,
        "conflict: the SET, then the PTTL for the lease left"
    );
    assert_eq!(commands(&mut con).await, calls(&[("set", 1), ("pttl", 1)]));

    // A lapsed lease: the plain claim and its PTTL read it, the script takes over.
    lapse(&mut con, &store.key(&busy)).await;
    reset_stats(&mut con).await;
    let took = store
        .claim(&ClaimRequest::new(&busy, &fp(1), LEASE, TTL))
        .await
        .unwrap();
    assert!(
        matches!(&took, ClaimOutcome::Claimed(c) if c.takeover),
        "{took:?}"
    );
    assert_eq!(
        round_trips(&mut con).await,
        3,
        "takeover: the plain claim, its PTTL, then the script"
    );
    let sent = commands(&mut con).await;
    assert!(
        sent.contains(&("evalsha".to_owned(), 1)) && sent.contains(&("get".to_owned(), 1)),
        "{sent:?}"
    );

    reset_stats(&mut con).await;
    assert!(store.get(&id).await.unwrap().is_some());
    assert_eq!(round_trips(&mut con).await, 1, "get: one pipeline");
    assert_eq!(
        commands(&mut con).await,
        calls(&[("get", 1), ("time", 1), ("pttl", 1)])
    );
}

/// Ends the lease of the record in progress at `key` now, by Redis's clock and without
/// waiting: its lease field is a gap before the key's expiry (`TTL - LEASE` for a claim
/// with this suite's figures), so an expiry closer than that gap means a lapsed lease.
/// A connection of its own to the store's Redis, for commands the store never sends.
async fn raw_connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn lapse(con: &mut redis::aio::MultiplexedConnection, key: &str) {
    let gap = (TTL - LEASE).as_millis() as u64;
    let () = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(gap - 1000)
        .query_async(con)
        .await
        .unwrap();
}

/// The lease is read off the key's expiry, so a key an operator made persistent says nothing
/// about it: held, never taken over (a second holder would run the request twice).
#[tokio::test]
async fn a_record_without_expiry_is_held_never_taken_over() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let mut con = raw_connection(&url).await;
    let id = unique_id("persist");
    let first = claim_token(&store, &id).await;
    let persisted: i64 = redis::cmd("PERSIST")
        .arg(store.key(&id))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(persisted, 1);
    for _ in 0..2 {
        match store
            .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
            .await
            .unwrap()
        {
            ClaimOutcome::Existing(r) => {
                assert!(matches!(r.state, RecordState::InProgress { .. }), "{r:?}")
            }
            other => panic!("a key without expiry is held: {other:?}"),
        }
    }
    // The holder still holds it, and finishes.
    store
        .complete(&id, &first, &response(201, "once"), TTL)
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(store.key(&id))
        .query_async(&mut con)
        .await
        .unwrap();
}

/// The lease is read from the record's gap and the key's TTL: a live lease is a conflict
/// with the time left, a lapsed one a takeover through the script, at generation 2, and the
/// old token is fenced out of `complete`, `extend` and `release` from then on.
#[tokio::test]
async fn a_plain_claim_conflicts_while_leased_and_a_lapsed_lease_is_taken_over_and_fenced() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let mut con = raw_connection(&url).await;
    let id = unique_id("lapse");
    let first = claim_token(&store, &id).await;
    match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => match r.state {
            RecordState::InProgress { lease_remaining } => assert!(
                lease_remaining > LEASE - Duration::from_secs(5) && lease_remaining <= LEASE,
                "{lease_remaining:?}"
            ),
            other @ RecordState::Completed(_) => panic!("{other:?}"),
        },
        other => panic!("a live lease is a conflict: {other:?}"),
    }

    lapse(&mut con, &store.key(&id)).await;
    // Another request under the same key never takes over: it sees the lapsed lease.
    match store
        .claim(&ClaimRequest::new(&id, &fp(2), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert_eq!(
            r.state,
            RecordState::InProgress {
                lease_remaining: Duration::ZERO
            }
        ),
        other => panic!("{other:?}"),
    }
    let second = match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("a lapsed lease is taken over: {other:?}"),
    };
    assert!(second.takeover);
    assert_eq!(second.token.generation(), 2);
    assert!(second
        .lapsed_for
        .is_some_and(|l| l >= Duration::from_millis(900)));

    let late = response(200, "late");
    let fenced = |r: Result<(), tower_idempotency::store::StoreError>| {
        assert_eq!(r.unwrap_err().kind(), StoreErrorKind::Fenced)
    };
    fenced(store.complete(&id, &first, &late, TTL).await);
    fenced(store.extend(&id, &first, LEASE).await);
    fenced(store.release(&id, &first).await);

    // The takeover wrote the lease as a gap too: a claim now conflicts with about a lease left.
    match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => match r.state {
            RecordState::InProgress { lease_remaining } => assert!(
                lease_remaining > LEASE - Duration::from_secs(5),
                "{lease_remaining:?}"
            ),
            other @ RecordState::Completed(_) => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    store
        .complete(&id, &second.token, &response(201, "second"), TTL)
        .await
        .unwrap();
    match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.generation, 2);
            assert_eq!(r.state, RecordState::Completed(response(201, "second")));
        }
        other => panic!("{other:?}"),
    }
}

/// A record in progress as earlier versions wrote it (its lease field a deadline by Redis's
/// `TIME`, 16 digits) still reads: a live lease is a conflict with the time left, a lapsed one
/// is taken over. And the scripts keep a record in the new format (a gap) readable: renewed,
/// released after a takeover (the lease ends now), taken over again, completed.
#[tokio::test]
async fn records_in_either_lease_format_are_read_by_the_plain_claim_and_the_scripts() {
    let Some(url) = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let store = RedisStore::connect(&url).await.unwrap();
    let mut con = raw_connection(&url).await;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
    let now = secs * 1000 + micros / 1000;
    let old_record = |nonce: u8, deadline: u64| {
        let mut v = b"2p".to_vec();
        v.extend_from_slice(fp(1).as_bytes());
        v.extend_from_slice(&[nonce; 16]);
        v.extend_from_slice(b"0000000000000001");
        v.extend_from_slice(format!("{deadline:016}").as_bytes());
        v
    };
    let live = unique_id("old-live");
    let lapsed = unique_id("old-lapsed");
    for (id, deadline) in [(&live, now + 20_000), (&lapsed, now - 2_000)] {
        let () = redis::cmd("SET")
            .arg(store.key(id))
            .arg(old_record(7, deadline))
            .arg("PX")
            .arg(TTL.as_millis() as u64)
            .query_async(&mut con)
            .await
            .unwrap();
    }
    match store
        .claim(&ClaimRequest::new(&live, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => match r.state {
            RecordState::InProgress { lease_remaining } => assert!(
                lease_remaining > Duration::from_secs(15)
                    && lease_remaining <= Duration::from_secs(20),
                "{lease_remaining:?}"
            ),
            other @ RecordState::Completed(_) => panic!("{other:?}"),
        },
        other => panic!("an old record's live lease is a conflict: {other:?}"),
    }
    let got = store.get(&live).await.unwrap().unwrap();
    assert!(
        matches!(got.state, RecordState::InProgress { lease_remaining } if lease_remaining > Duration::from_secs(15))
    );
    let took = match store
        .claim(&ClaimRequest::new(&lapsed, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("an old record's lapsed lease is taken over: {other:?}"),
    };
    assert_eq!(took.token.generation(), 2);
    assert!(took.lapsed_for.is_some_and(|l| l >= Duration::from_secs(1)));
    // Old token (nonce 7, generation 1) fenced.
    let old = Token::from_parts(1, [7; 16]);
    assert_eq!(
        store.release(&lapsed, &old).await.unwrap_err().kind(),
        StoreErrorKind::Fenced
    );

    // The takeover wrote a gap. Renew it (extend.lua rewrites the gap), then release it:
    // a takeover's release keeps the record with its lease ended now.
    let key = store.key(&lapsed);
    let field = |con: &mut redis::aio::MultiplexedConnection| {
        let mut con = con.clone();
        let key = key.clone();
        async move {
            let v: Vec<u8> = redis::cmd("GETRANGE")
                .arg(&key)
                .arg(66)
                .arg(81)
                .query_async(&mut con)
                .await
                .unwrap();
            String::from_utf8(v).unwrap()
        }
    };
    assert!(
        field(&mut con).await.starts_with('k'),
        "a takeover writes a gap"
    );
    store.extend(&lapsed, &took.token, LEASE).await.unwrap();
    assert!(
        field(&mut con).await.starts_with('k'),
        "a renewal writes a gap"
    );
    match store.get(&lapsed).await.unwrap().unwrap().state {
        RecordState::InProgress { lease_remaining } => {
            assert!(
                lease_remaining > LEASE - Duration::from_secs(5),
                "{lease_remaining:?}"
            )
        }
        other @ RecordState::Completed(_) => panic!("{other:?}"),
    }
    store.release(&lapsed, &took.token).await.unwrap();
    assert!(
        field(&mut con).await.starts_with('k'),
        "a release writes a gap"
    );
    let third = match store
        .claim(&ClaimRequest::new(&lapsed, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("a released takeover is taken over at once: {other:?}"),
    };
    assert_eq!(third.token.generation(), 3);
    store
        .complete(&lapsed, &third.token, &response(201, "third"), TTL)
        .await
        .unwrap();
    match store.get(&lapsed).await.unwrap().unwrap().state {
        RecordState::Completed(c) => assert_eq!(c, response(201, "third")),
        other @ RecordState::InProgress { .. } => panic!("{other:?}"),
    }
}

/// Pauses every client of `server` for `pause`; returns once the pause is in force.
async fn pause_clients(server: &RedisServer, pause: Duration) -> redis::aio::MultiplexedConnection {
    let mut con = admin(server).await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause.as_millis() as u64)
        .arg("ALL")
        .query_async(&mut con)
        .await
        .unwrap();
    con
}

#[tokio::test]
async fn timed_out_claims_are_read_back_and_exactly_one_holds_the_key() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let timeout = Duration::from_millis(600);
    let url = server.url();
    let connect = || RedisStore::builder().with_timeout(timeout).connect(&url);
    let (a, b) = (connect().await.unwrap(), connect().await.unwrap());
    let f = fp(1);
    let id = unique_id("lost-reply");

    // Both claims time out while Redis holds them; each read-back runs right after its own
    // claim, on the same connection, once the pause ends (900 ms, inside the read-back's 600).
    let _admin = pause_clients(&server, Duration::from_millis(900)).await;
    let started = Instant::now();
    let request = ClaimRequest::new(&id, &f, LEASE, TTL);
    let (ra, rb) = tokio::join!(a.claim(&request), b.claim(&request));
    assert!(
        started.elapsed() >= timeout,
        "the claims should have timed out first"
    );
    let outcomes = [ra.expect("claim a"), rb.expect("claim b")];
    let claimed: Vec<_> = outcomes
        .iter()
        .filter_map(|o| match o {
            ClaimOutcome::Claimed(c) => Some(c.token),
            _ => None,
        })
        .collect();
    assert_eq!(
        claimed.len(),
        1,
        "exactly one read-back recognises its nonce: {outcomes:?}"
    );
    let rec = a.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.generation, claimed[0].generation());
    // The recognised token really holds the key.
    a.complete(&id, &claimed[0], &response(200, "mine"), TTL)
        .await
        .unwrap();
}

/// Setup on a connection with no response timeout of its own (the store's connection manager
/// has none: each store call carries the store's deadline) still ends within the timeout
/// when Redis stops answering, and says so.
#[tokio::test]
async fn setup_on_a_connection_without_response_timeout_ends_within_the_timeout() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let config = redis::aio::ConnectionManagerConfig::new().set_response_timeout(None);
    let conn = redis::aio::ConnectionManager::new_with_config(
        redis::Client::open(server.url()).unwrap(),
        config,
    )
    .await
    .unwrap();
    let timeout = Duration::from_millis(300);
    let _admin = pause_clients(&server, Duration::from_millis(3000)).await;
    let started = Instant::now();
    let err = RedisStore::builder()
        .with_timeout(timeout)
        .build(conn)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, SetupError::Redis(_)), "{err:?}");
    assert!(err.to_string().contains("no answer within"), "{err}");
    assert!(
        took >= timeout && took < timeout * 3,
        "setup gave up after {took:?}"
    );
}

/// A store call on a Redis that stopped answering ends at the store's timeout, as unknown,
/// with nothing but the store's own deadline on the call.
#[tokio::test]
async fn a_call_on_a_paused_redis_is_unknown_at_the_store_timeout() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let timeout = Duration::from_millis(300);
    let store = RedisStore::builder()
        .with_timeout(timeout)
        .connect(&server.url())
        .await
        .unwrap();
    let id = unique_id("paused-complete");
    let token = claim_token(&store, &id).await;
    let _admin = pause_clients(&server, Duration::from_millis(3000)).await;
    let started = Instant::now();
    let err = store
        .complete(&id, &token, &response(200, "late"), TTL)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.kind(), StoreErrorKind::Unknown, "{err:?}");
    // The complete and its read-back, each within the timeout.
    assert!(
        took >= timeout && took < timeout * 3,
        "the complete gave up after {took:?}"
    );
}

#[tokio::test]
async fn a_claim_that_cannot_be_read_back_is_unknown_never_claimed() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let store = RedisStore::builder()
        .with_timeout(Duration::from_millis(300))
        .connect(&server.url())
        .await
        .unwrap();
    let id = unique_id("unknown");
    let mut admin = pause_clients(&server, Duration::from_millis(1500)).await;
    let err = store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unknown, "{err:?}");
    assert!(std::error::Error::source(&err).is_some());

    // The claim landed once the pause ended: nobody holds it, and it is not handed out again
    // until its lease lapses.
    let () = redis::cmd("PING")
        .query_async(&mut admin)
        .await
        .map(|_: String| ())
        .unwrap();
    match store
        .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert!(matches!(r.state, RecordState::InProgress { .. })),
        other => {
            panic!("the stranded claim must not be handed out: {other:?}")
        }
    }
}

#[tokio::test]
async fn timed_out_writes_are_read_back_before_answering() {
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let store = RedisStore::builder()
        .with_timeout(Duration::from_millis(600))
        .connect(&server.url())
        .await
        .unwrap();
    let pause = Duration::from_millis(900);
    // Past the 600 ms timeout, an answer can only come from the read-back.
    let read_back = |started: Instant| {
        assert!(
            started.elapsed() >= Duration::from_millis(600),
            "the call did not time out"
        );
    };

    // Each call times out during the pause; its read-back runs right after it once the pause
    // ends, sees the call took effect (or that it did not and it may be sent again), and answers.
    let done = unique_id("late-complete");
    let token = claim_token(&store, &done).await;
    let _admin = pause_clients(&server, pause).await;
    let started = Instant::now();
    store
        .complete(&done, &token, &response(201, "late"), TTL)
        .await
        .expect("a complete that landed is done");
    read_back(started);
    assert_eq!(
        store.get(&done).await.unwrap().unwrap().state,
        RecordState::Completed(response(201, "late"))
    );

    let renewed = unique_id("late-extend");
    let token = claim_token(&store, &renewed).await;
    let _admin = pause_clients(&server, pause).await;
    let started = Instant::now();
    store.extend(&renewed, &token, LEASE).await.expect("extend");
    read_back(started);

    let freed = unique_id("late-release");
    let token = claim_token(&store, &freed).await;
    let _admin = pause_clients(&server, pause).await;
    let started = Instant::now();
    store.release(&freed, &token).await.expect("release");
    read_back(started);
    assert!(store.get(&freed).await.unwrap().is_none());
}

#[tokio::test]
async fn wait_confirms_replicas_and_a_shortfall_fails_and_releases() {
    let Some(primary) = RedisServer::start(&[]) else {
        return;
    };
    let port = primary.port().to_string();
    let Some(_replica) = RedisServer::start(&["--replicaof", "127.0.0.1", &port]) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !primary
        .cli(&["info", "replication"])
        .contains("state=online")
    {
        assert!(Instant::now() < deadline, "replica never came online");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let one = RedisStore::builder()
        .with_wait(NonZeroU32::new(1).unwrap(), Duration::from_secs(2))
        .connect(&primary.url())
        .await
        .unwrap();
    let id = unique_id("wait");
    let token = claim_token(&one, &id).await;
    one.complete(&id, &token, &response(201, "replicated"), TTL)
        .await
        .unwrap();

    // Two replicas asked of a primary with one: refused at start-up, not seen as 503s.
    let refused = RedisStore::builder()
        .with_wait(NonZeroU32::new(2).unwrap(), Duration::from_millis(200))
        .connect(&primary.url())
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            SetupError::TooFewReplicas {
                connected: 1,
                wanted: 2,
                ..
            }
        ),
        "{refused}"
    );
    let text = refused.to_string();
    assert!(
        text.contains("1 connected replica") && text.contains("WAIT for 2"),
        "{text}"
    );
    assert!(text.contains("with_replica_check(false)"), "{text}");
    // Past the check (a replica lost after start-up looks the same): the claim fails.
    let two = RedisStore::builder()
        .with_wait(NonZeroU32::new(2).unwrap(), Duration::from_millis(200))
        .with_replica_check(false)
        .connect(&primary.url())
        .await
        .unwrap();
    let short = unique_id("short");
    let err = two
        .claim(&ClaimRequest::new(&short, &fp(1), LEASE, TTL))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    let source =
        std::error::Error::source(&err).and_then(|s| s.downcast_ref::<ReplicationShortfall>());
    assert_eq!(
        source,
        Some(&ReplicationShortfall {
            acknowledged: 1,
            wanted: 2
        })
    );
    assert!(
        two.get(&short).await.unwrap().is_none(),
        "an unreplicated claim is released"
    );
}

/// `WAIT` runs on a connection of its own: while one claim waits for a replica that is not
/// there, a replay and a read through the same store answer at once.
#[tokio::test]
async fn wait_never_holds_up_other_calls() {
    // No replica: `WAIT 1` blocks for its whole timeout.
    let Some(server) = RedisServer::start(&[]) else {
        return;
    };
    let plain = RedisStore::connect(&server.url()).await.unwrap();
    let waiting = Arc::new(
        RedisStore::builder()
            .with_wait(NonZeroU32::new(1).unwrap(), Duration::from_secs(5))
            .with_replica_check(false)
            .connect(&server.url())
            .await
            .unwrap(),
    );
    let done = unique_id("replayed");
    let token = claim_token(&plain, &done).await;
    plain
        .complete(&done, &token, &response(201, "kept"), TTL)
        .await
        .unwrap();

    let id = unique_id("waits");
    let pending = {
        let store = waiting.clone();
        tokio::spawn(async move {
            store
                .claim(&ClaimRequest::new(&id, &fp(1), LEASE, TTL))
                .await
        })
    };
    // Gate: the server shows a client blocked in WAIT.
    let mut con = admin(&server).await;
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut con)
            .await
            .unwrap();
        if clients
            .lines()
            .any(|l| l.contains("cmd=wait") && l.contains("flags=b"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "no client ever blocked in WAIT");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    match waiting
        .claim(&ClaimRequest::new(&done, &fp(1), LEASE, TTL))
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.state, RecordState::Completed(response(201, "kept")))
        }
        other => panic!("expected a replay, got {other:?}"),
    }
    assert!(waiting.get(&done).await.unwrap().is_some());
    assert!(
        !pending.is_finished(),
        "the replay answered only once the WAIT had ended"
    );

    // The waiting claim then fails for want of a replica, and is given back.
    let err = pending.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    let source =
        std::error::Error::source(&err).and_then(|s| s.downcast_ref::<ReplicationShortfall>());
    assert_eq!(
        source,
        Some(&ReplicationShortfall {
            acknowledged: 0,
            wanted: 1
        })
    );
    assert!(waiting.get(&id).await.unwrap().is_none());
}

/// Setup errors name the cause in their text, and nothing listening fails within the timeout.
#[tokio::test]
async fn setup_errors_say_why_and_come_within_the_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let err = RedisStore::builder()
        .with_timeout(timeout)
        .connect(&format!("redis://127.0.0.1:{port}/"))
        .await
        .unwrap_err();
    let took = started.elapsed();
    let text = err.to_string();
    assert!(matches!(err, SetupError::Redis(_)), "{err:?}");
    assert!(text.contains("refused"), "{text}");
    assert!(took < timeout * 2, "connect failed after {took:?}");

    let started = Instant::now();
    let err = RedisStore::builder()
        .with_timeout(timeout)
        .connect_cluster([format!("redis://127.0.0.1:{port}/")])
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(err.to_string().contains("refused"), "{err}");
    assert!(took < timeout * 2, "connect_cluster failed after {took:?}");

    let err = RedisStore::connect("rediss-nope://x").await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("could not set up the Redis idempotency store: ") && text.len() > 50,
        "{text}"
    );
}

async fn quota_store(records: Option<usize>, bytes: Option<usize>) -> Option<(RedisStore, String)> {
    let url = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
    let prefix = format!(
        "tidem-quota-{}-{}:",
        std::process::id(),
        unique_id("p").to_hex()
    );
    let mut builder = RedisStore::builder().with_key_prefix(&prefix);
    if let Some(n) = records {
        builder = builder.with_max_records_per_scope(NonZeroUsize::new(n).unwrap());
    }
    if let Some(n) = bytes {
        builder = builder.with_max_bytes_per_scope(NonZeroUsize::new(n).unwrap());
    }
    Some((builder.connect(&url).await.unwrap(), url))
}

/// With quotas, the key of `id`'s scope group: its records (`'s'`) or its counts (`'b'`).
fn group_key(store: &RedisStore, id: &RecordId, which: char) -> String {
    let key = store.key(id);
    let (head, rest) = key.split_once('}').unwrap();
    assert_eq!(rest.len(), 56, "a grouped record key: {key}");
    format!("{head}}}{which}")
}

#[tokio::test]
async fn a_full_scope_refuses_new_keys_while_its_records_replay_and_other_scopes_claim() {
    let Some((store, _)) = quota_store(Some(2), None).await else {
        return;
    };
    let _ =
        redis_quota::a_full_scope_refuses_new_keys_while_its_records_answer(&store, false).await;
}

#[tokio::test]
async fn expired_records_leave_the_scope_by_redis_clock() {
    let Some((store, _)) = quota_store(Some(1), None).await else {
        return;
    };
    let (a, in_a) = scoped("expiring");
    let short = Duration::from_millis(200);
    let outcome = store
        .claim(&ClaimRequest::new(&in_a("k1"), &fp(1), short, short).in_scope(&a))
        .await
        .unwrap();
    token_of(outcome);
    let err = claim_in(&store, &a, &in_a("k2")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
    // Wait for Redis to expire the record (bounded), then the scope has room again.
    redis_quota::wait_until_expired(&store, &in_a("k1")).await;
    token_of(claim_in(&store, &a, &in_a("k2")).await.unwrap());
}

#[tokio::test]
async fn an_expired_record_leaves_its_scopes_counts_when_a_claim_prunes_it() {
    let Some((store, url)) = quota_store(Some(10), Some(10_000)).await else {
        return;
    };
    let (a, in_a) = scoped("pruned");
    let short = Duration::from_millis(100);
    let old = in_a("k1");
    token_of(
        store
            .claim(&ClaimRequest::new(&old, &fp(1), short, short).in_scope(&a))
            .await
            .unwrap(),
    );
    redis_quota::wait_until_expired(&store, &old).await;
    token_of(claim_in(&store, &a, &in_a("k2")).await.unwrap());
    let mut con = raw_connection(&url).await;
    let (count, bytes, old_size): (u64, u64, Option<u64>) = redis::cmd("HMGET")
        .arg(group_key(&store, &old, 'b'))
        .arg(format!("n{}", a.to_hex()))
        .arg(format!("t{}", a.to_hex()))
        .arg(old.to_hex())
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(
        (count, bytes, old_size),
        (1, 146, None),
        "only the new record counts"
    );
    let members: u64 = redis::cmd("ZCARD")
        .arg(group_key(&store, &old, 's'))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(members, 1);
}

#[tokio::test]
async fn the_byte_quota_counts_recorded_answers() {
    // One record in progress is 146 bytes (header and scope); a 600-byte answer puts the
    // scope over a 700-byte budget.
    let Some((store, url)) = quota_store(None, Some(700)).await else {
        return;
    };
    let (a, in_a) = scoped("bytes");
    let (b, in_b) = scoped("bytes-other");
    let token = token_of(claim_in(&store, &a, &in_a("k1")).await.unwrap());
    let answer = response(201, vec![b'x'; 600]);
    store
        .complete(&in_a("k1"), &token, &answer, TTL)
        .await
        .unwrap();
    let err = claim_in(&store, &a, &in_a("k2")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
    token_of(claim_in(&store, &b, &in_b("k1")).await.unwrap());

    // The total is the stored size of the scope's record.
    let mut con = raw_connection(&url).await;
    let total: u64 = redis::cmd("HGET")
        .arg(group_key(&store, &in_a("k1"), 'b'))
        .arg(format!("t{}", a.to_hex()))
        .query_async(&mut con)
        .await
        .unwrap();
    let stored: u64 = redis::cmd("STRLEN")
        .arg(store.key(&in_a("k1")))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(total, stored);
    assert_eq!(stored, 146 + answer.encode().len() as u64);
}

#[tokio::test]
async fn without_quotas_a_scoped_claim_touches_only_its_record() {
    let Some((store, url)) = quota_store(None, None).await else {
        return;
    };
    let (a, in_a) = scoped("free");
    for i in 0..5 {
        token_of(claim_in(&store, &a, &in_a(&format!("k{i}"))).await.unwrap());
    }
    let mut con = raw_connection(&url).await;
    let key = store.key(&in_a("k0"));
    let prefix = key.split('{').next().unwrap();
    assert_eq!(
        key,
        format!("{prefix}{{{}}}", in_a("k0").to_hex()),
        "the plain layout"
    );
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(&value[..2], b"2p", "an uncounted record");
    // SCAN, not KEYS: the shared Redis may hold a million other keys (a load run's), and
    // one KEYS over them outlasts the client's timeout.
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut con)
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
    let mut records: Vec<String> = (0..5).map(|i| store.key(&in_a(&format!("k{i}")))).collect();
    records.sort();
    assert_eq!(keys, records, "the records and nothing else");
}

#[tokio::test]
async fn a_quota_holds_under_concurrent_claims_of_one_scope() {
    let Some((store, _)) = quota_store(Some(5), None).await else {
        return;
    };
    let (a, in_a) = scoped("racing");
    let ids: Vec<RecordId> = (0..40).map(|i| in_a(&format!("k{i}"))).collect();
    let claims = ids.iter().map(|id| claim_in(&store, &a, id));
    let outcomes = futures_util::future::join_all(claims).await;
    let claimed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(ClaimOutcome::Claimed(_))))
        .count();
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o, Err(e) if e.kind() == StoreErrorKind::QuotaExceeded))
        .count();
    assert_eq!((claimed, refused), (5, 35), "{outcomes:?}");
}

#[tokio::test]
async fn a_counted_record_is_taken_over_renewed_and_completed_once_in_its_scope() {
    let Some((store, url)) = quota_store(Some(2), Some(10_000)).await else {
        return;
    };
    let (a, in_a) = scoped("takeover");
    let id = in_a("k1");
    let short = Duration::from_millis(100);
    let first = token_of(
        store
            .claim(&ClaimRequest::new(&id, &fp(1), short, TTL).in_scope(&a))
            .await
            .unwrap(),
    );
    // Wait out the lease by Redis's clock (bounded), then take over.
    let deadline = Instant::now() + Duration::from_secs(10);
    let second = loop {
        match claim_in(&store, &a, &id).await.unwrap() {
            ClaimOutcome::Claimed(c) => break c,
            _ => {
                assert!(Instant::now() < deadline, "the lease never lapsed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert!(second.takeover);
    assert_eq!(second.token.generation(), first.generation() + 1);
    assert_eq!(
        store.extend(&id, &first, LEASE).await.unwrap_err().kind(),
        StoreErrorKind::Fenced
    );
    store.extend(&id, &second.token, LEASE).await.unwrap();
    store
        .complete(&id, &second.token, &response(201, "once"), TTL)
        .await
        .unwrap();

    let mut con = raw_connection(&url).await;
    let key = store.key(&id);
    let counted: u64 = redis::cmd("ZCARD")
        .arg(group_key(&store, &id, 's'))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(counted, 1, "one record, counted once through the takeover");
    let count: u64 = redis::cmd("HGET")
        .arg(group_key(&store, &id, 'b'))
        .arg(format!("n{}", a.to_hex()))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(count, 1, "and in the scope's count");
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(&value[..2], b"3c");
    assert_eq!(
        &value[82..146],
        a.to_hex().as_bytes(),
        "the record names its scope"
    );
}

#[tokio::test]
async fn an_operator_delete_gives_the_scope_its_record_back() {
    use tower_idempotency::store::{IdempotencyAdmin, Removal};
    let Some((store, _)) = quota_store(Some(1), Some(10_000)).await else {
        return;
    };
    let (a, in_a) = scoped("operator");
    token_of(claim_in(&store, &a, &in_a("k1")).await.unwrap());
    let err = claim_in(&store, &a, &in_a("k2")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::QuotaExceeded, "{err:?}");
    assert_eq!(
        store.force_release(&in_a("k1")).await.unwrap(),
        Removal::Removed
    );
    let token = token_of(claim_in(&store, &a, &in_a("k2")).await.unwrap());
    store
        .complete(&in_a("k2"), &token, &response(200, "done"), TTL)
        .await
        .unwrap();
    assert_eq!(store.delete(&in_a("k2")).await.unwrap(), Removal::Removed);
    token_of(claim_in(&store, &a, &in_a("k3")).await.unwrap());
}
