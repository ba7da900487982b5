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

/// What a history may contain.
#[derive(Debug, Clone, Copy)]
struct Shape {
    points: bool,
    admin: bool,
    max_steps: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Len {
    Short,
    Long,
}

impl Len {
    fn duration(self) -> Duration {
        match self {
            Len::Short => SHORT,
            Len::Long => LONG,
        }
    }
}

/// Which token a step sends: the key's token `n` claims back (0: the latest), or a forged one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    Back(usize),
    Forged,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The call takes effect; its answer is lost.
    LostReply,
    /// The call is delayed past the caller's deadline: before it acts, or after.
    Timeout {
        acts: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Claim {
        key: usize,
        fp: u8,
        lease: Len,
        fault: Fault,
    },
    /// `n` claims of one key at once (long leases: exactly one may win).
    Race {
        key: usize,
        fp: u8,
        n: usize,
    },
    Extend {
        key: usize,
        token: Pick,
        lease: Len,
        fault: Fault,
    },
    Complete {
        key: usize,
        token: Pick,
        ttl: Len,
        fault: Fault,
    },
    Release {
        key: usize,
        token: Pick,
        fault: Fault,
    },
    Save {
        key: usize,
        token: Pick,
        fault: Fault,
    },
    Get {
        key: usize,
    },
    Recoverable,
    ForceRelease {
        key: usize,
        fault: Fault,
    },
    Delete {
        key: usize,
        fault: Fault,
    },
    /// Time passes: every short lease and TTL so far runs out.
    Pause,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::None => Ok(()),
            Fault::LostReply => f.write_str(" [reply lost]"),
            Fault::Timeout { acts: true } => f.write_str(" [timed out after it acted]"),
            Fault::Timeout { acts: false } => f.write_str(" [timed out before it acted]"),
        }
    }
}

impl fmt::Display for Pick {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pick::Back(0) => f.write_str("its latest token"),
            Pick::Back(n) => write!(f, "the token {n} claim(s) back"),
            Pick::Forged => f.write_str("a forged token"),
        }
    }
}

impl fmt::Display for Len {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Len::Short => write!(f, "{SHORT:?}"),
            Len::Long => write!(f, "{LONG:?}"),
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Claim {
                key,
                fp,
                lease,
                fault,
            } => write!(f, "claim k{key} with fp {fp}, lease {lease}{fault}"),
            Step::Race { key, fp, n } => {
                write!(
                    f,
                    "{n} concurrent claims of k{key} with fp {fp}, lease {LONG:?}"
                )
            }
            Step::Extend {
                key,
                token,
                lease,
                fault,
            } => write!(f, "extend k{key} with {token}, lease {lease}{fault}"),
            Step::Complete {
                key,
                token,
                ttl,
                fault,
            } => write!(f, "complete k{key} with {token}, ttl {ttl}{fault}"),
            Step::Release { key, token, fault } => write!(f, "release k{key} with {token}{fault}"),
            Step::Save { key, token, fault } => {
                write!(f, "save a recovery point on k{key} with {token}{fault}")
            }
            Step::Get { key } => write!(f, "get k{key}"),
            Step::Recoverable => f.write_str("recoverable"),
            Step::ForceRelease { key, fault } => write!(f, "force_release k{key}{fault}"),
            Step::Delete { key, fault } => write!(f, "delete k{key}{fault}"),
            Step::Pause => write!(f, "pause {PAUSE:?}: short leases and TTLs run out"),
        }
    }
}

/// splitmix64: small, seedable, and good enough to pick steps.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// The history generated from `seed`.
fn generate(seed: u64, shape: Shape) -> Vec<Step> {
    let mut rng = Rng(seed);
    let keys = 2 + rng.below(2);
    let len = 6 + rng.below(shape.max_steps.saturating_sub(5).max(1));
    let mut steps = Vec::with_capacity(len);
    for _ in 0..len {
        // Most steps on the first key, so that its generations pile up.
        let key = if rng.chance(60) {
            0
        } else {
            1 + rng.below(keys - 1)
        };
        let fp = if rng.chance(85) { 0 } else { 1 };
        let lease = if rng.chance(65) {
            Len::Short
        } else {
            Len::Long
        };
        let fault = match rng.below(100) {
            0..=75 => Fault::None,
            76..=87 => Fault::LostReply,
            n => Fault::Timeout { acts: n % 2 == 0 },
        };
        let token = match rng.below(100) {
            0..=54 => Pick::Back(0),
            55..=69 => Pick::Back(1),
            70..=79 => Pick::Back(2),
            80..=89 => Pick::Back(3),
            _ => Pick::Forged,
        };
        let mut weights: Vec<(usize, u8)> = vec![
            (24, 0), // claim
            (14, 1), // pause
            (10, 2), // complete
            (9, 3),  // release
            (5, 4),  // extend
            (10, 5), // get
            (4, 6),  // race
        ];
        if shape.points {
            weights.push((8, 7)); // save
            weights.push((2, 8)); // recoverable
        }
        if shape.admin {
            weights.push((2, 9)); // force_release
            weights.push((2, 10)); // delete
        }
        let total: usize = weights.iter().map(|(w, _)| w).sum();
        let mut pick = rng.below(total);
        let mut kind = 0;
        for (w, k) in weights {
            if pick < w {
                kind = k;
                break;
            }
            pick -= w;
        }
        steps.push(match kind {
            0 => Step::Claim {
                key,
                fp,
                lease,
                fault,
            },
            1 => Step::Pause,
            2 => Step::Complete {
                key,
                token,
                ttl: if rng.chance(25) {
                    Len::Short
                } else {
                    Len::Long
                },
                fault,
            },
            3 => Step::Release { key, token, fault },
            4 => Step::Extend {
                key,
                token,
                lease,
                fault,
            },
            5 => Step::Get { key },
            6 => Step::Race {
                key,
                fp,
                n: 2 + rng.below(3),
            },
            7 => Step::Save { key, token, fault },
            8 => Step::Recoverable,
            9 => Step::ForceRelease { key, fault },
            _ => Step::Delete { key, fault },
        });
    }
    steps
}

// ------------------------------------------------------------------------------------------
// Faults

/// What [`Faulty`] does to the next call made through it.
#[derive(Debug, Clone, Copy)]
enum Arm {
    /// The call runs to its end; its answer never comes back.
    LoseReply,
    /// The call hangs before it reaches the store.
    Hang,
}

/// A store wrapper that loses the reply of a chosen call, or holds it back until the
/// caller's deadline passes. One per history: its calls are one at a time.
struct Faulty {
    inner: DynStore,
    admin: Option<Arc<dyn IdempotencyAdmin>>,
    arm: Mutex<Option<Arm>>,
    /// Told when a call whose reply is lost has run.
    landed: Notify,
}

impl Faulty {
    async fn around<T>(&self, call: impl Future<Output = T>) -> T {
        let arm = self.arm.lock().unwrap_or_else(|e| e.into_inner()).take();
        match arm {
            None => call.await,
            Some(Arm::Hang) => std::future::pending().await,
            Some(Arm::LoseReply) => {
                let _ = call.await;
                self.landed.notify_one();
                std::future::pending().await
            }
        }
    }

    /// Runs `call` through the wrapper with `fault`: `None` when its outcome is unknown.
    async fn run<T>(&self, fault: Fault, call: impl Future<Output = T>) -> Option<T> {
        let arm = match fault {
            Fault::None => return Some(call.await),
            Fault::LostReply | Fault::Timeout { acts: true } => Arm::LoseReply,
            Fault::Timeout { acts: false } => Arm::Hang,
        };
        *self.arm.lock().unwrap_or_else(|e| e.into_inner()) = Some(arm);
        let call = std::pin::pin!(call);
        let mut call = call;
        match arm {
            Arm::Hang => {
                let r = tokio::time::timeout(TIMEOUT, call).await;
                assert!(r.is_err(), "a hung call answered");
            }
            Arm::LoseReply => {
                let landed = self.landed.notified();
                let mut landed = std::pin::pin!(landed);
                landed.as_mut().enable();
                // Ordered by the gate, not a clock: the caller gives up once it has run.
                tokio::select! {
                    biased;
                    () = &mut landed => {}
                    _ = &mut call => unreachable!("a lost reply came back"),
                }
                if fault != Fault::LostReply {
                    // The reply is late: the caller's deadline passes first.
                    let r = tokio::time::timeout(TIMEOUT, &mut call).await;
                    assert!(r.is_err(), "a lost reply came back");
                }
            }
        }
        None
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for Faulty {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.around(self.inner.claim(request)).await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.around(self.inner.extend(id, token, lease)).await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.around(self.inner.complete(id, token, completion, ttl))
            .await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.around(self.inner.release(id, token)).await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.around(self.inner.get(id)).await
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        self.around(self.inner.save_recovery_point(id, token, point))
            .await
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        self.around(self.inner.recoverable(limit)).await
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

// ------------------------------------------------------------------------------------------
// Running one history

/// The outcome of one run of a history.
#[derive(Debug)]
struct Outcome {
    /// One line per step run, with its answer.
    trace: Vec<String>,
    /// The violation, at the last step of the trace.
    failure: Option<String>,
    calls: usize,
}

/// One run of a history, on record ids of its own.
struct Run<'a> {
    stores: &'a HistoryStore,
    faulty: Faulty,
    ids: Vec<RecordId>,
    start: Instant,
    /// Every token a `Claimed` answer gave, by [`TokenId`].
    tokens: Vec<Token>,
    /// Each key's tokens, in the order they were claimed.
    claimed: Vec<Vec<TokenId>>,
    answers: Vec<Completion>,
    points: Vec<RecoveryPoint>,
    models: Vec<Candidates>,
    label: u64,
    calls: usize,
}

async fn replay(stores: &HistoryStore, steps: &[Step], label: u64) -> Outcome {
    let keys = 1 + steps
        .iter()
        .filter_map(|s| match *s {
            Step::Claim { key, .. }
            | Step::Race { key, .. }
            | Step::Extend { key, .. }
            | Step::Complete { key, .. }
            | Step::Release { key, .. }
            | Step::Save { key, .. }
            | Step::Get { key }
            | Step::ForceRelease { key, .. }
            | Step::Delete { key, .. } => Some(key),
            Step::Recoverable | Step::Pause => None,
        })
        .max()
        .unwrap_or(0);
    let mut run = Run {
        stores,
        faulty: Faulty {
            inner: stores.store.clone(),
            admin: stores.admin.clone(),
            arm: Mutex::new(None),
            landed: Notify::new(),
        },
        ids: (0..keys)
            .map(|k| unique_id(&format!("history-k{k}")))
            .collect(),
        start: Instant::now(),
        tokens: Vec::new(),
        claimed: vec![Vec::new(); keys],
        answers: Vec::new(),
        points: Vec::new(),
        models: vec![Candidates::default(); keys],
        label,
        calls: 0,
    };
    let mut trace = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        let (answer, verdict) = run.step(step).await;
        trace.push(format!("#{i:<2} {step} -> {answer}"));
        if let Err(why) = verdict {
            return Outcome {
                trace,
                failure: Some(format!("at #{i} ({step}): {why}")),
                calls: run.calls,
            };
        }
    }
    Outcome {
        trace,
        failure: None,
        calls: run.calls,
    }
}

/// An error, in the model's terms.
fn error(e: &StoreError) -> Answer {
    if e.is_fenced() {
        Answer::Fenced
    } else {
        Answer::Error(format!("{:?}: {e}", e.kind()))
    }
}

fn unit(r: Option<Result<(), StoreError>>) -> Answer {
    match r {
        None => Answer::Unknown,
        Some(Ok(())) => Answer::Ok,
        Some(Err(e)) => error(&e),
    }
}

fn describe(answer: &Answer) -> String {
    match answer {
        Answer::Unknown => "unknown".into(),
        Answer::Claimed {
            token,
            generation,
            takeover,
            point,
        } => format!(
            "Claimed t{token} (generation {generation}{}{})",
            if *takeover { ", takeover" } else { "" },
            match point {
                Some(Named::Is(p)) => format!(", point p{p}"),
                Some(Named::Foreign) => ", a point never saved here".into(),
                None => String::new(),
            }
        ),
        Answer::Existing(seen) => format!("Existing({})", describe_seen(seen)),
        Answer::Ok => "Ok".into(),
        Answer::Fenced => "Fenced".into(),
        Answer::Error(e) => format!("error {e}"),
        Answer::Got(None) => "None".into(),
        Answer::Got(Some(seen)) => format!("Some({})", describe_seen(seen)),
        Answer::Removal(r) => format!("{r:?}"),
    }
}

fn describe_seen(seen: &Seen) -> String {
    let name = |n: Named<usize>, p: &str| match n {
        Named::Is(i) => format!("{p}{i}"),
        Named::Foreign => format!("an unknown {p}"),
    };
    let mut s = match seen.fp {
        Named::Is(f) => format!("fp {f}"),
        Named::Foreign => "an unknown fp".into(),
    };
    s.push_str(&format!(" gen {} ", seen.generation));
    match &seen.state {
        SeenState::InProgress(LeaseSeen::Left) => s.push_str("in progress, lease left"),
        SeenState::InProgress(LeaseSeen::Zero) => s.push_str("in progress, lease zero"),
        SeenState::Completed(a) => s.push_str(&format!("completed with {}", name(*a, "a"))),
    }
    if let Some(h) = seen.holder {
        s.push_str(&format!(", holder {}", name(h, "t")));
    }
    match seen.point {
        Some(p) => s.push_str(&format!(", point {}", name(p, "p"))),
        None => s.push_str(", no point"),
    }
    s
}

impl Run<'_> {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn seen(&self, record: &Record) -> Seen {
        let fp_named = (0..2u8)
            .find(|i| fp(FP_BASE + i) == record.fingerprint)
            .map_or(Named::Foreign, Named::Is);
        let state = match &record.state {
            RecordState::InProgress { lease_remaining } => {
                SeenState::InProgress(if lease_remaining.is_zero() {
                    LeaseSeen::Zero
                } else {
                    LeaseSeen::Left
                })
            }
            RecordState::Completed(c) => SeenState::Completed(
                self.answers
                    .iter()
                    .position(|a| a == c)
                    .map_or(Named::Foreign, Named::Is),
            ),
        };
        Seen {
            fp: fp_named,
            generation: record.generation,
            state,
            holder: record.holder.map(|h| {
                self.tokens
                    .iter()
                    .position(|t| *t == h)
                    .map_or(Named::Foreign, Named::Is)
            }),
            point: record.recovery_point.as_ref().map(|p| self.point_name(p)),
        }
    }

    fn point_name(&self, p: &RecoveryPoint) -> Named<usize> {
        self.points
            .iter()
            .position(|q| q == p)
            .map_or(Named::Foreign, Named::Is)
    }

    /// The token a step sends, in the store's and the model's terms.
    fn token(&self, key: usize, pick: Pick) -> (Token, TokenRef) {
        let ours = &self.claimed[key];
        if let Pick::Back(n) = pick {
            if n < ours.len() {
                let id = ours[ours.len() - 1 - n];
                return (self.tokens[id], TokenRef::Known(id));
            }
        }
        let generation = ours.last().map_or(1, |&id| self.tokens[id].generation());
        let forged = Token::generate(generation).expect("a random source");
        (forged, TokenRef::Forged)
    }

    fn claimed_answer(&mut self, key: usize, outcome: ClaimOutcome) -> Answer {
        match outcome {
            ClaimOutcome::Claimed(c) => {
                let id = self.tokens.len();
                self.tokens.push(c.token);
                self.claimed[key].push(id);
                Answer::Claimed {
                    token: id,
                    generation: c.token.generation(),
                    takeover: c.takeover,
                    point: c.recovery_point.as_ref().map(|p| self.point_name(p)),
                }
            }
            ClaimOutcome::Existing(record) => Answer::Existing(self.seen(&record)),
        }
    }

    /// Runs one step: the answer as printed, and the model's verdict.
    async fn step(&mut self, step: &Step) -> (String, Result<(), String>) {
        let sent = self.now();
        let sends = match *step {
            Step::Extend { key, token, .. }
            | Step::Complete { key, token, .. }
            | Step::Release { key, token, .. }
            | Step::Save { key, token, .. } => match self.token(key, token) {
                (t, TokenRef::Known(id)) => format!(" (sent t{id}, generation {})", t.generation()),
                (t, TokenRef::Forged) => {
                    format!(" (sent a forged token, generation {})", t.generation())
                }
            },
            _ => String::new(),
        };
        let (key, call, answer) = match *step {
            Step::Pause => {
                tokio::time::sleep(PAUSE).await;
                return ("slept".into(), Ok(()));
            }
            Step::Race { key, fp: f, n } => return self.race(key, f, n).await,
            Step::Recoverable => return self.recoverable().await,
            Step::Claim {
                key,
                fp: f,
                lease,
                fault,
            } => {
                let (id, fingerprint) = (self.ids[key], fp(FP_BASE + f));
                let request = ClaimRequest::new(&id, &fingerprint, lease.duration(), CLAIM_TTL);
                self.calls += 1;
                let r = self.faulty.run(fault, self.faulty.claim(&request)).await;
                let answer = match r {
                    None => Answer::Unknown,
                    Some(Ok(o)) => self.claimed_answer(key, o),
                    Some(Err(e)) => error(&e),
                };
                let call = Call::Claim {
                    fp: f,
                    lease: lease.duration(),
                    ttl: CLAIM_TTL,
                    racing: false,
                };
                (key, call, answer)
            }
            Step::Extend {
                key,
                token,
                lease,
                fault,
            } => {
                let (t, tref) = self.token(key, token);
                self.calls += 1;
                let r = self
                    .faulty
                    .run(
                        fault,
                        self.faulty.extend(&self.ids[key], &t, lease.duration()),
                    )
                    .await;
                let call = Call::Extend {
                    token: tref,
                    lease: lease.duration(),
                };
                (key, call, unit(r))
            }
            Step::Complete {
                key,
                token,
                ttl,
                fault,
            } => {
                let (t, tref) = self.token(key, token);
                let answer_id = self.answers.len();
                let completion = response(201, format!("{}/a{answer_id}", self.label));
                self.answers.push(completion.clone());
                self.calls += 1;
                let r = self
                    .faulty
                    .run(
                        fault,
                        self.faulty
                            .complete(&self.ids[key], &t, &completion, ttl.duration()),
                    )
                    .await;
                let call = Call::Complete {
                    token: tref,
                    answer: answer_id,
                    ttl: ttl.duration(),
                };
                (key, call, unit(r))
            }
            Step::Release { key, token, fault } => {
                let (t, tref) = self.token(key, token);
                self.calls += 1;
                let r = self
                    .faulty
                    .run(fault, self.faulty.release(&self.ids[key], &t))
                    .await;
                (key, Call::Release { token: tref }, unit(r))
            }
            Step::Save { key, token, fault } => {
                let (t, tref) = self.token(key, token);
                let point_id = self.points.len();
                let point = RecoveryPoint::new(
                    &format!("p{point_id}"),
                    bytes::Bytes::from(format!("{}/p{point_id}", self.label)),
                    ScopeId::new(Some("conformance")),
                    t.generation(),
                )
                .expect("a small point");
                self.points.push(point.clone());
                self.calls += 1;
                let r = self
                    .faulty
                    .run(
                        fault,
                        self.faulty.save_recovery_point(&self.ids[key], &t, &point),
                    )
                    .await;
                let call = Call::Save {
                    token: tref,
                    point: point_id,
                };
                (key, call, unit(r))
            }
            Step::Get { key } => {
                self.calls += 1;
                let answer = match self.faulty.get(&self.ids[key]).await {
                    Ok(r) => Answer::Got(r.as_ref().map(|r| self.seen(r))),
                    Err(e) => error(&e),
                };
                (key, Call::Get, answer)
            }
            Step::ForceRelease { key, fault } | Step::Delete { key, fault } => {
                let admin = self
                    .faulty
                    .admin
                    .clone()
                    .expect("operator steps need an admin");
                let force = matches!(step, Step::ForceRelease { .. });
                let id = self.ids[key];
                self.calls += 1;
                let r = self
                    .faulty
                    .run(
                        fault,
                        self.faulty.around(async {
                            if force {
                                admin.force_release(&id).await
                            } else {
                                admin.delete(&id).await
                            }
                        }),
                    )
                    .await;
                let answer = match r {
                    None => Answer::Unknown,
                    Some(Ok(removal)) => Answer::Removal(removal),
                    Some(Err(e)) => error(&e),
                };
                let call = if force {
                    Call::ForceRelease
                } else {
                    Call::Delete
                };
                (key, call, answer)
            }
        };
        let w = Window {
            sent,
            returned: self.now(),
        };
        let verdict = self.models[key].apply(&call, w, &answer);
        (format!("{}{sends}", describe(&answer)), verdict)
    }

    /// `n` claims of one key at once, released by a barrier: the answers must fit some
    /// order of the claims (so at most one wins, and exactly one where the key was free).
    async fn race(&mut self, key: usize, f: u8, n: usize) -> (String, Result<(), String>) {
        let sent = self.now();
        let barrier = Arc::new(Barrier::new(n));
        let id = self.ids[key];
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (store, barrier) = (self.stores.store.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let fingerprint = fp(FP_BASE + f);
                    store
                        .claim(&ClaimRequest::new(&id, &fingerprint, LONG, CLAIM_TTL))
                        .await
                })
            })
            .collect();
        let mut results = Vec::with_capacity(n);
        for t in tasks {
            self.calls += 1;
            results.push(t.await);
        }
        // The winner's token first, so that the others' reports of it are named.
        let mut answers = vec![Answer::Unknown; n];
        for (i, r) in results.iter().enumerate() {
            if let Ok(Ok(o @ ClaimOutcome::Claimed(_))) = r {
                answers[i] = self.claimed_answer(key, o.clone());
            }
        }
        for (i, r) in results.into_iter().enumerate() {
            answers[i] = match r {
                Ok(Ok(ClaimOutcome::Claimed(_))) => continue,
                Ok(Ok(o)) => self.claimed_answer(key, o),
                Ok(Err(e)) => error(&e),
                Err(e) => Answer::Error(format!("the claim's task failed: {e}")),
            };
        }
        let w = Window {
            sent,
            returned: self.now(),
        };
        let call = Call::Claim {
            fp: f,
            lease: LONG,
            ttl: CLAIM_TTL,
            racing: true,
        };
        let printed = answers.iter().map(describe).collect::<Vec<_>>().join(", ");
        let mut merged: Option<Candidates> = None;
        let mut why = None;
        for order in permutations(n) {
            let mut model = self.models[key].clone();
            let fits = order
                .iter()
                .try_for_each(|&i| model.apply(&call, w, &answers[i]));
            match fits {
                Ok(()) => match &mut merged {
                    None => merged = Some(model),
                    Some(m) => m.merge(model),
                },
                Err(e) => why = why.or(Some(e)),
            }
        }
        match merged {
            Some(m) => {
                self.models[key] = m;
                (printed, Ok(()))
            }
            None => (
                printed,
                Err(format!(
                    "no order of the concurrent claims explains these answers (one order: {})",
                    why.unwrap_or_default()
                )),
            ),
        }
    }

    async fn recoverable(&mut self) -> (String, Result<(), String>) {
        let sent = self.now();
        self.calls += 1;
        let listed = match self.stores.store.recoverable(LISTED).await {
            Ok(l) => l,
            Err(e) => return (describe(&error(&e)), Err("recoverable failed".into())),
        };
        let w = Window {
            sent,
            returned: self.now(),
        };
        let mut printed = Vec::new();
        for (id, record) in &listed {
            let Some(key) = self.ids.iter().position(|i| i == id) else {
                continue;
            };
            let seen = self.seen(record);
            printed.push(format!("k{key}: {}", describe_seen(&seen)));
            if let Err(e) = self.models[key].listed(w, &seen) {
                return (
                    format!("[{}]", printed.join("; ")),
                    Err(format!("k{key} {e}")),
                );
            }
        }
        (format!("[{}]", printed.join("; ")), Ok(()))
    }
}

/// Every order of `0..n` (n is at most 4).
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for p in permutations(n - 1) {
        for at in 0..=p.len() {
            let mut q = p.clone();
            q.insert(at, n - 1);
            out.push(q);
        }
    }
    out
}

// ------------------------------------------------------------------------------------------
// Shrinking

/// Delta debugging (ddmin): drops chunks of steps, then single steps, while the history
/// still fails, each replay on fresh keys. A replay that happens to pass (a failure that
/// depends on timing) keeps the steps it dropped. Returns the minimal history, its trace
/// from its last failing run, the violation, and the replays spent.
async fn shrink(
    stores: &HistoryStore,
    mut steps: Vec<Step>,
    first: Outcome,
    label: u64,
) -> (Vec<Step>, Vec<String>, String, usize) {
    let mut trace = first.trace;
    let mut violation = first.failure.unwrap_or_default();
    // Steps past the violation never ran.
    steps.truncate(trace.len());
    let mut replays = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut chunks = 2;
    while steps.len() >= 2 {
        if replays >= MAX_REPLAYS || Instant::now() > deadline {
            break;
        }
        let size = steps.len().div_ceil(chunks);
        let mut reduced = false;
        for start in (0..steps.len()).step_by(size) {
            let candidate: Vec<Step> = steps[..start]
                .iter()
                .chain(steps[(start + size).min(steps.len())..].iter())
                .copied()
                .collect();
            if candidate.is_empty() {
                continue;
            }
            replays += 1;
            let outcome = replay(stores, &candidate, label).await;
            if let Some(v) = outcome.failure {
                let mut s = candidate;
                s.truncate(outcome.trace.len());
                let t = outcome.trace;
                (steps, trace, violation) = (s, t, v);
                chunks = (chunks - 1).max(2);
                reduced = true;
                break;
            }
        }
        if !reduced {
            if chunks >= steps.len() {
                break;
            }
            chunks = (chunks * 2).min(steps.len());
        }
    }
    (steps, trace, violation, replays)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histories_are_generated_from_their_seed() {
        let shape = Shape {
            points: true,
            admin: true,
            max_steps: 24,
        };
        assert_eq!(generate(42, shape), generate(42, shape));
        assert_ne!(generate(42, shape), generate(43, shape));
        let all: Vec<Step> = (0..200).flat_map(|s| generate(s, shape)).collect();
        for want in [
            |s: &Step| {
                matches!(
                    s,
                    Step::Complete {
                        token: Pick::Back(3),
                        ..
                    }
                )
            },
            |s: &Step| {
                matches!(
                    s,
                    Step::Claim {
                        fault: Fault::LostReply,
                        ..
                    }
                )
            },
            |s: &Step| {
                matches!(
                    s,
                    Step::Release {
                        fault: Fault::Timeout { acts: true },
                        ..
                    }
                )
            },
            |s: &Step| {
                matches!(
                    s,
                    Step::Save {
                        fault: Fault::Timeout { acts: false },
                        ..
                    }
                )
            },
            |s: &Step| matches!(s, Step::Race { .. }),
            |s: &Step| matches!(s, Step::ForceRelease { .. }),
        ] {
            assert!(all.iter().any(want));
        }
    }

    #[test]
    fn every_order_of_four_claims() {
        let p = permutations(4);
        assert_eq!(p.len(), 24);
        let mut q = p.clone();
        q.sort();
        q.dedup();
        assert_eq!(q.len(), 24);
    }
}
