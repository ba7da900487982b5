//! Model-based tests of a store: random histories of calls and faults, run against the real
//! store, every answer checked against [the model](super::model); a failing history is
//! shrunk to a minimal one and printed with its seed.
//!
//! Hand-rolled (a seeded splitmix64 generator and delta debugging) rather than proptest:
//! a history runs async calls against a live store inside the caller's Tokio runtime, where
//! proptest's synchronous runner would need a runtime of its own; shrinking must replay on a
//! fresh key namespace each time, which a strategy's value tree does not know about; and the
//! suite ships to store authors under the `conformance` feature, which should not pull a
//! property-testing framework into their builds.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::{Barrier, Notify};

use super::model::{
    Answer, Call, Candidates, LeaseSeen, Named, Seen, SeenState, TokenId, TokenRef, Window,
};
use super::{fp, response, unique_id, DynAdminStore, DynStore};
use crate::store::{ClaimOutcome, ClaimRequest, IdempotencyAdmin, IdempotencyStore, StoreError};
use crate::store::{Completion, Record, RecordId, RecordState, ScopeId, StoreErrorKind, Token};
use crate::RecoveryPoint;

mod replay;
mod steps;

use replay::*;
use steps::*;

/// A lease that lapses within a history: a few milliseconds.
const SHORT: Duration = Duration::from_millis(5);
/// A lease or TTL no history outlives.
const LONG: Duration = Duration::from_secs(60);
/// How long an in-progress record is kept (`ttl` of a claim): long enough for any history,
/// short enough that a long run does not pile up records in a shared store.
const CLAIM_TTL: Duration = Duration::from_secs(20);
/// "Time passes": past a short lease or TTL by the model's slack on both sides.
const PAUSE: Duration = Duration::from_millis(25);
/// The caller's deadline for a call a fault delays.
const TIMEOUT: Duration = Duration::from_millis(10);
/// The fingerprints a history uses: `fp(FP_BASE)` mostly, `fp(FP_BASE + 1)` at times.
const FP_BASE: u8 = 0xE0;
/// How many records a `recoverable` step asks for.
const LISTED: usize = 10_000;
/// At most this many replays to shrink a failing history.
const MAX_REPLAYS: usize = 400;

/// The stores a history runs against: the store, and its operator API when it has one
/// (then histories include `force_release` and `delete`).
#[derive(Clone)]
pub struct HistoryStore {
    store: DynStore,
    admin: Option<Arc<dyn IdempotencyAdmin>>,
}

impl fmt::Debug for HistoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HistoryStore")
            .field("store", &self.store.name())
            .field("admin", &self.admin.is_some())
            .finish()
    }
}

impl From<DynStore> for HistoryStore {
    fn from(store: DynStore) -> Self {
        Self { store, admin: None }
    }
}

impl From<DynAdminStore> for HistoryStore {
    fn from(store: DynAdminStore) -> Self {
        Self {
            store: store.clone(),
            admin: Some(store),
        }
    }
}

/// Whether histories save recovery points and list `recoverable` records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Points {
    /// When the store keeps them (probed once: a store that answers `Unsupported` runs
    /// histories without them).
    IfSupported,
    /// Always; a store that does not keep them fails.
    Required,
}

/// How many histories to run, from which seed: see [`run_histories`].
#[derive(Debug, Clone)]
pub struct HistoryConfig {
    histories: usize,
    seed: Option<u64>,
    concurrency: usize,
    max_steps: usize,
    points: Points,
}

impl HistoryConfig {
    /// The budget `run_all`, `run_recovery` and `conformance_suite!` use: a few hundred
    /// histories, a random seed. `IDEMPOTENCY_HISTORIES` sets the number of histories and
    /// `IDEMPOTENCY_HISTORY_SEED` the seed (to replay a printed failure, or for a long run).
    pub fn ci() -> Self {
        let env = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .map(|v| {
                    v.trim()
                        .parse::<u64>()
                        .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
                })
        };
        Self {
            histories: env("IDEMPOTENCY_HISTORIES").map_or(CI_HISTORIES, |n| n as usize),
            seed: env("IDEMPOTENCY_HISTORY_SEED"),
            concurrency: env("IDEMPOTENCY_HISTORY_CONCURRENCY").map_or(16, |n| n.max(1) as usize),
            max_steps: 24,
            points: Points::IfSupported,
        }
    }

    /// Runs `n` histories.
    #[must_use]
    pub fn with_histories(mut self, n: usize) -> Self {
        self.histories = n;
        self
    }

    /// Runs from `seed`: history `i` is generated from `seed + i`, so a printed history
    /// seed with one history replays that history.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Runs up to `n` histories at once (default 16, or `IDEMPOTENCY_HISTORY_CONCURRENCY`;
    /// they use keys of their own, and mostly wait for leases to lapse).
    #[must_use]
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Histories save recovery points and list `recoverable` records, and a store that
    /// answers `Unsupported` fails (for [`run_recovery`](super::run_recovery)).
    #[must_use]
    pub fn require_recovery_points(mut self) -> Self {
        self.points = Points::Required;
        self
    }
}

impl Default for HistoryConfig {
    fn default() -> Self {
        Self::ci()
    }
}

/// Histories per store in CI: about 3 s on memory, 5 s on Redis, 10 s on Postgres (a debug
/// build on two cores).
const CI_HISTORIES: usize = 600;

/// What a passing run did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HistoryReport {
    /// The store's [`name`](IdempotencyStore::name).
    pub store: &'static str,
    /// The run's seed (history `i` from `seed + i`).
    pub seed: u64,
    /// Histories run, each checked against the model.
    pub histories: usize,
    /// Store calls made in them.
    pub calls: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Whether they saved recovery points and listed `recoverable` records.
    pub recovery_points: bool,
    /// Whether they made operator calls.
    pub operator: bool,
}

impl fmt::Display for HistoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} histories ({} store calls) held against the model on store `{}` in {:.1?} \
             (seed {}; recovery points: {}; operator calls: {})",
            self.histories,
            self.calls,
            self.store,
            self.elapsed,
            self.seed,
            self.recovery_points,
            self.operator
        )
    }
}

/// A history the store failed, shrunk: its [`Display`](fmt::Display) prints the seed, the
/// minimal history with every answer, and the rule it broke.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HistoryFailure {
    /// The store's [`name`](IdempotencyStore::name).
    pub store: &'static str,
    /// The run's seed.
    pub seed: u64,
    /// The failing history's own seed: `IDEMPOTENCY_HISTORY_SEED=<it> IDEMPOTENCY_HISTORIES=1`
    /// runs it alone.
    pub history_seed: u64,
    /// Histories that passed before it failed (as they finished; up to the concurrency more
    /// were under way).
    pub passed: usize,
    /// Wall time until the failure was found (before shrinking).
    pub found_after: Duration,
    /// Steps of the history as generated.
    pub original_steps: usize,
    /// The minimal history: one line per step with the store's answer, the last one the
    /// violation.
    pub minimal: Vec<String>,
    /// What the contract allowed instead.
    pub violation: String,
    /// Replays spent shrinking.
    pub replays: usize,
}

impl fmt::Display for HistoryFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "store `{}` broke the store contract in a history (run seed {}, history seed {}, \
             found after {} passing histories in {:.1?}).",
            self.store, self.seed, self.history_seed, self.passed, self.found_after
        )?;
        writeln!(
            f,
            "Replay it alone: IDEMPOTENCY_HISTORY_SEED={} IDEMPOTENCY_HISTORIES=1",
            self.history_seed
        )?;
        writeln!(
            f,
            "Minimal history ({} of {} steps, {} replays to shrink):",
            self.minimal.len(),
            self.original_steps,
            self.replays
        )?;
        for line in &self.minimal {
            writeln!(f, "  {line}")?;
        }
        write!(f, "Violation: {}", self.violation)
    }
}

impl std::error::Error for HistoryFailure {}

/// Runs random histories of store calls and faults against a store from `new_store`
/// (called once; each history uses record ids of its own), checking every answer against
/// the model of the store contract ([guarantee 11](crate::store#guarantees-every-store-gives)).
///
/// A history holds 6 to 24 steps over 2 or 3 keys: claims (with short leases that lapse
/// within the history, or long ones; with one of two fingerprints), bursts of 2 to 4
/// concurrent claims of one key, `extend`, `complete` (with a short TTL at times),
/// `release` and recovery-point saves with the key's current token, a token 1, 2 or 3
/// claims back, or a forged one; `get`; `recoverable`; the operator's `force_release` and
/// `delete` when the store has them; pauses that let short leases and TTLs run out; and
/// faults on the writes: a lost reply (the call takes effect, the answer never comes) or a
/// timeout (the call is delayed past the caller's deadline, before or after it acts). A lost
/// or timed-out call is unknown: the model allows either outcome, and later answers must fit
/// one of them.
///
/// On the first failure, the history is shrunk by delta debugging (dropping steps while it
/// still fails, each replay on fresh keys) and returned as a [`HistoryFailure`].
///
/// Needs a multi-threaded Tokio runtime (concurrent claims run on tasks).
pub async fn run_histories<F, Fut, S>(
    new_store: F,
    config: HistoryConfig,
) -> Result<HistoryReport, HistoryFailure>
where
    F: Fn() -> Fut,
    Fut: Future<Output = S>,
    S: Into<HistoryStore>,
{
    let stores: HistoryStore = new_store().await.into();
    let name = stores.store.name();
    let seed = config.seed.unwrap_or_else(random_seed);
    let points = match (probe_points(&stores.store).await, config.points) {
        (Ok(true), _) => true,
        (Ok(false), Points::IfSupported) => false,
        (Ok(false), Points::Required) => {
            return Err(setup_failure(name, seed, "the store does not keep recovery points (save_recovery_point or recoverable answered Unsupported)".into()))
        }
        (Err(e), _) => return Err(setup_failure(name, seed, e)),
    };
    let shape = Shape {
        points,
        admin: stores.admin.is_some(),
        max_steps: config.max_steps,
    };
    let started = Instant::now();
    let calls = AtomicUsize::new(0);
    let mut passed = 0;
    let mut results = futures_util::stream::iter(0..config.histories)
        .map(|i| {
            let history_seed = seed.wrapping_add(i as u64);
            let steps = generate(history_seed, shape);
            let stores = &stores;
            let calls = &calls;
            async move {
                let outcome = replay(stores, &steps, history_seed).await;
                calls.fetch_add(outcome.calls, Ordering::Relaxed);
                (history_seed, steps, outcome)
            }
        })
        .buffer_unordered(config.concurrency);
    while let Some((history_seed, steps, outcome)) = results.next().await {
        if outcome.failure.is_none() {
            passed += 1;
            // A long run says how far it got.
            if config.histories >= 20_000 && passed % 10_000 == 0 {
                eprintln!(
                    "{passed} of {} histories passed on store `{name}` in {:.1?}",
                    config.histories,
                    started.elapsed()
                );
            }
            continue;
        }
        drop(results);
        let found_after = started.elapsed();
        let (_, trace, violation, replays) =
            shrink(&stores, steps.clone(), outcome, history_seed).await;
        return Err(HistoryFailure {
            store: name,
            seed,
            history_seed,
            passed,
            found_after,
            original_steps: steps.len(),
            minimal: trace,
            violation,
            replays,
        });
    }
    Ok(HistoryReport {
        store: name,
        seed,
        histories: passed,
        calls: calls.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
        recovery_points: points,
        operator: shape.admin,
    })
}

fn setup_failure(store: &'static str, seed: u64, why: String) -> HistoryFailure {
    HistoryFailure {
        store,
        seed,
        history_seed: seed,
        passed: 0,
        found_after: Duration::ZERO,
        original_steps: 0,
        minimal: Vec::new(),
        violation: why,
        replays: 0,
    }
}

fn random_seed() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        return nanos as u64;
    }
    // Small enough to type.
    u64::from_le_bytes(b) % 1_000_000_000_000
}

/// Runs histories on the store, at the CI budget (or the environment's), and panics with
/// the minimal failing history. What `conformance_suite!` generates its
/// `histories_hold_against_the_model` test from; `None` skips.
#[doc(hidden)]
pub async fn __histories<S: Into<HistoryStore>>(store: Option<S>, require_points: bool) {
    let Some(store) = store else { return };
    let store: HistoryStore = store.into();
    let mut config = HistoryConfig::ci();
    if require_points {
        config = config.require_recovery_points();
    }
    match run_histories(move || std::future::ready(store.clone()), config).await {
        Ok(report) => eprintln!("{report}"),
        Err(failure) => panic!("{failure}"),
    }
}

/// Whether the store keeps recovery points: a save on a claim of its own, and `recoverable`.
async fn probe_points(store: &DynStore) -> Result<bool, String> {
    let id = unique_id("histories-probe");
    let f = fp(FP_BASE);
    let token = match store.claim(&ClaimRequest::new(&id, &f, LONG, SHORT)).await {
        Ok(ClaimOutcome::Claimed(c)) => c.token,
        other => return Err(format!("the probe's claim of a new key answered {other:?}")),
    };
    let point = RecoveryPoint::new(
        "probe",
        bytes::Bytes::from_static(b"probe"),
        ScopeId::new(Some("conformance")),
        token.generation(),
    )
    .expect("a small point");
    let saved = store.save_recovery_point(&id, &token, &point).await;
    let _ = store
        .complete(&id, &token, &response(200, "probe"), SHORT)
        .await;
    match saved {
        Ok(()) => {}
        Err(e) if e.kind() == StoreErrorKind::Unsupported => return Ok(false),
        Err(e) => {
            return Err(format!(
                "the probe's save of a recovery point failed: {e:?}"
            ))
        }
    }
    match store.recoverable(1).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == StoreErrorKind::Unsupported => Ok(false),
        Err(e) => Err(format!("the probe's recoverable failed: {e:?}")),
    }
}

// ------------------------------------------------------------------------------------------
// Histories

#[cfg(test)]
mod tests;
