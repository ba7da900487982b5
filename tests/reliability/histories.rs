//! The layer and the recovery worker held against the protocol, end to end (issue 47,
//! must-have 4). Random seeded histories drive the real `IdempotencyLayer` over a counting
//! handler, on memory (paused time), Redis and Postgres, interleaving:
//!
//! - keyed requests and retries over 2 or 3 keys, sometimes with another body under a key;
//! - handlers that answer 2xx or 5xx, panic, save recovery points, stall past their lease (a
//!   future no longer polled, woken later to go on with its stale token) or die with it
//!   (`mem::forget`);
//! - client disconnects (the response future dropped while the handler runs);
//! - lapses (the clock moves past the lease), the worker's listing taken early and swept
//!   late, worker sweeps whose recover function answers, fails or answers 5xx, and operator
//!   calls (`force_release`, `delete`).
//!
//! Every store call goes through a [`Journal`]: a wrapper that orders the calls of a history,
//! keeps the protocol's view of each key (holder, generation, point, recorded answer) from
//! what the store answered, and flags any answer the protocol forbids. The handler counts its
//! executions (per generation, and by `ctx.derive("charge")`) and checks, as each one starts,
//! that no other holder of its key is alive and unfenced. Each answer is checked against the
//! journal: a replay is the recorded answer byte for byte, 409 only while an attempt is in
//! flight, 422 only for another body. A failing history shrinks (events dropped while it
//! still fails) and prints with its seed.
//!
//! `IDEMPOTENCY_LAYER_HISTORY_SEED` fixes the first history's seed (history `i` runs seed
//! + `i`), `IDEMPOTENCY_LAYER_HISTORIES` how many run (then without the CI time budget):
//!
//! ```text
//! IDEMPOTENCY_LAYER_HISTORY_SEED=17 IDEMPOTENCY_LAYER_HISTORIES=1 \
//!   cargo test --all-features --test reliability histories::memory -- --nocapture
//! ```

mod front;
mod journal;

use crate::support::backend::backend_url;
use crate::support::rng::Rng;
use crate::support::{body_bytes, post};

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use front::Front;
use futures_util::FutureExt;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::Full;
use journal::{point_of, Journal, Snapshot};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::{
    AdminStore, Completion, Fingerprint, IdempotencyAdmin, IdempotencyStore, RecordId, Token,
};
use tower_idempotency::{
    BoxError, IdempotencyContext, IdempotencyLayer, RecoveryWorker, RequestBody, ResponseBody,
    Timing,
};

/// The most attempts the worker makes on a record, its first included.
const MAX_ATTEMPTS: u64 = 3;
/// How much earlier than the journal's own bound a takeover may land (clock reads).
const SLACK: Duration = Duration::from_millis(20);
/// Longer than any answer takes; past it, the answer is reported as hung.
const PATIENCE: Duration = Duration::from_secs(20);
const SAME_BODY: &str = r#"{"amount":100}"#;
const OTHER_BODY: &str = r#"{"amount":999}"#;
/// The payload of a handler's deliberate panic: the panic hook keeps it quiet.
const PANIC: &str = "history: the handler panics";

// ---- histories -----------------------------------------------------------------------------

/// What a handler does when its request runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Behave {
    /// Saves a point, answers 201.
    Ok,
    /// Saves a point, answers 500 (released: a retry runs again).
    Fail,
    /// Saves a point, panics.
    Panic,
    /// Saves a point, then stops being polled (a pause) until a `Wake`.
    Stall,
    /// Saves a point, then dies (`mem::forget`).
    Die,
    /// Saves a point, then waits for an `Open` while its client disconnects.
    Disconnect,
}

/// What the worker's recover function does in a sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recover {
    Ok,
    Err,
    Answer5xx,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// A request under key `key` (its other body when `other`), run to its answer unless it
    /// stalls, dies or disconnects.
    Send {
        key: usize,
        other: bool,
        behave: Behave,
    },
    /// The oldest stalled holder of `key` is polled again; it saves a point and, if that is
    /// fenced, answers 500, or when `stubborn` goes on and answers 201 all the same.
    Wake {
        key: usize,
        stubborn: bool,
    },
    /// The oldest disconnected holder of `key` goes on to its answer, on its own task.
    Open {
        key: usize,
    },
    /// The clock moves past the lease.
    Lapse,
    /// The worker lists recoverable records now and sweeps that listing at its next sweep.
    List,
    Sweep(Recover),
    ForceRelease(usize),
    Delete(usize),
}

#[derive(Clone, Debug)]
struct History {
    seed: u64,
    keys: usize,
    events: Vec<Event>,
}

impl History {
    fn generate(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let keys = rng.range(2, 3) as usize;
        let len = rng.range(6, 16) as usize;
        let mut events = Vec::with_capacity(len);
        for _ in 0..len {
            let key = rng.range(0, keys as u64 - 1) as usize;
            let event = match rng.range(0, 99) {
                0..=44 => Event::Send {
                    key,
                    other: rng.range(0, 9) == 0,
                    behave: match rng.range(0, 99) {
                        0..=29 => Behave::Ok,
                        30..=42 => Behave::Fail,
                        43..=50 => Behave::Panic,
                        51..=68 => Behave::Stall,
                        69..=84 => Behave::Die,
                        _ => Behave::Disconnect,
                    },
                },
                45..=54 => Event::Wake {
                    key,
                    stubborn: rng.range(0, 1) == 0,
                },
                55..=61 => Event::Open { key },
                62..=74 => Event::Lapse,
                75..=78 => Event::List,
                79..=90 => Event::Sweep(match rng.range(0, 5) {
                    0..=3 => Recover::Ok,
                    4 => Recover::Err,
                    _ => Recover::Answer5xx,
                }),
                91..=95 => Event::ForceRelease(key),
                _ => Event::Delete(key),
            };
            events.push(event);
        }
        Self { seed, keys, events }
    }
}

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "history seed {} ({} keys, {} events):",
            self.seed,
            self.keys,
            self.events.len()
        )?;
        for (i, e) in self.events.iter().enumerate() {
            writeln!(f, "  {i:>2}. {e:?}")?;
        }
        Ok(())
    }
}

// ---- the world: the handler, its executions, and the checks on them -------------------------

/// A request of the history, as its handler sees it.
struct Ctl {
    key: usize,
    other: bool,
    behave: Behave,
    /// Notified when the handler reached its stall.
    reached: Notify,
    /// Lets a stalled or disconnected handler go on.
    gate: Notify,
    stubborn: AtomicBool,
}

/// One run of the work: a handler's or a recover function's.
struct Exec {
    id: RecordId,
    req: Option<u64>,
    token: Token,
    /// No longer polled (stalled, or died).
    stopped: bool,
    finished: bool,
    body: Option<Bytes>,
    /// `ctx.derive("charge")`: the key of its side effect downstream.
    derived: String,
}

#[derive(Default, Debug, Clone, Copy)]
struct Stats {
    histories: usize,
    executions: usize,
    by_worker: usize,
    replays: usize,
    conflicts: usize,
    mismatches: usize,
    unavailable: usize,
    panics: usize,
    takeovers: usize,
    fenced: usize,
    recorded: usize,
    abandoned_calls: usize,
    degraded: usize,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.histories += o.histories;
        self.executions += o.executions;
        self.by_worker += o.by_worker;
        self.replays += o.replays;
        self.conflicts += o.conflicts;
        self.mismatches += o.mismatches;
        self.unavailable += o.unavailable;
        self.panics += o.panics;
        self.takeovers += o.takeovers;
        self.fenced += o.fenced;
        self.recorded += o.recorded;
        self.abandoned_calls += o.abandoned_calls;
        self.degraded += o.degraded;
    }
}

struct World {
    front: Front,
    journal: Arc<Journal>,
    ids: Vec<RecordId>,
    ctls: Mutex<HashMap<u64, Arc<Ctl>>>,
    execs: Mutex<Vec<Exec>>,
    violations: Mutex<Vec<String>>,
    /// The fingerprint of each body, once a request with it ran.
    fingerprints: Mutex<[Option<Fingerprint>; 2]>,
    /// Starts per claim (its token names key, generation and nonce): at most one each.
    starts: Mutex<HashMap<Token, usize>>,
    /// Executions counted by `ctx.derive("charge")`.
    charges: Mutex<HashMap<String, usize>>,
    recover: Mutex<Recover>,
    stats: Mutex<Stats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl World {
    fn key_of(&self, id: &RecordId) -> Option<usize> {
        self.ids.iter().position(|i| i == id)
    }

    fn flag(&self, what: impl fmt::Display) {
        lock(&self.violations).push(what.to_string());
    }

    /// An execution starts: the checks of at most once, on what the journal knows now.
    fn start(&self, ctx: &IdempotencyContext, req: Option<(u64, bool)>) -> usize {
        let id = ctx.record_id();
        let token = ctx.token();
        let generation = token.generation();
        let who = match req {
            Some((r, _)) => format!("request {r}"),
            None => "the worker".to_owned(),
        };
        let mut problems = Vec::new();
        let Some(key) = self.key_of(&id) else {
            self.flag(format!("{who} ran a key this history never sent"));
            return usize::MAX;
        };
        {
            let m = self.journal.model();
            let mut execs = lock(&self.execs);
            let mut stats = lock(&self.stats);
            stats.executions += 1;
            if req.is_none() {
                stats.by_worker += 1;
            }
            drop(stats);
            *lock(&self.charges).entry(ctx.derive("charge")).or_default() += 1;
            if let Some((_, other)) = req {
                let mut fps = lock(&self.fingerprints);
                let slot = &mut fps[usize::from(other)];
                match slot {
                    Some(fp) if *fp != ctx.fingerprint() => {
                        problems.push("one body, two fingerprints".to_owned());
                    }
                    _ => *slot = Some(ctx.fingerprint()),
                }
            }
            if !m.uncertain.contains(&id) {
                match m.holders.get(&token) {
                    None => problems.push(format!(
                        "{who} ran under a claim (generation {generation}) the store never granted"
                    )),
                    Some(h) => {
                        if !m.holds(&id, &token) {
                            problems.push(format!(
                                "{who} started under generation {generation}, which no longer holds the key"
                            ));
                        }
                        let handed = ctx.recovery_point().map(point_of);
                        if handed != h.handed {
                            problems.push(format!(
                                "{who} resumed from {handed:?}, not the point its claim handed over ({:?})",
                                h.handed
                            ));
                        }
                        if req.is_none() {
                            if !h.takeover || h.handed.is_none() {
                                problems.push(format!("the worker ran generation {generation}, which is not a takeover with a point"));
                            }
                            if generation > MAX_ATTEMPTS {
                                problems.push(format!(
                                    "the worker ran generation {generation}, past its cap of {MAX_ATTEMPTS}"
                                ));
                            }
                        }
                        let n = {
                            let mut starts = lock(&self.starts);
                            let n = starts.entry(token).or_default();
                            *n += 1;
                            *n
                        };
                        if n > 1 {
                            problems.push(format!(
                                "the claim of generation {generation} started the work {n} times"
                            ));
                        }
                        for e in execs.iter().filter(|e| e.id == id && !e.finished) {
                            let other = m.holders.get(&e.token);
                            let g = e.token.generation();
                            if !other.is_some_and(|o| o.superseded) {
                                problems.push(format!(
                                    "{who} runs generation {generation} while generation {g} holds the key unfenced"
                                ));
                            } else if !e.stopped
                                && !other.is_some_and(|o| o.cut_off || o.by_operator)
                            {
                                problems.push(format!(
                                    "{who} took the key over (generation {generation}) from generation {g}, which is alive and reaches the store"
                                ));
                            }
                        }
                    }
                }
            }
            execs.push(Exec {
                id,
                req: req.map(|(r, _)| r),
                token,
                stopped: false,
                finished: false,
                body: None,
                derived: ctx.derive("charge"),
            });
            drop(m);
            let n = execs.len() - 1;
            for p in problems {
                self.flag(format!("key k{key}: {p}"));
            }
            n
        }
    }

    fn finish(&self, exec: usize, body: Option<Bytes>) {
        if let Some(e) = lock(&self.execs).get_mut(exec) {
            e.finished = true;
            e.body = body;
        }
    }

    /// The request's holder is no longer polled (`stopped`), or polled again.
    fn set_stopped(&self, req: u64, stopped: bool) {
        for e in lock(&self.execs).iter_mut().filter(|e| e.req == Some(req)) {
            e.stopped = stopped;
        }
    }

    fn exec_of(&self, req: u64) -> Option<(usize, bool, Option<Bytes>)> {
        lock(&self.execs)
            .iter()
            .enumerate()
            .find(|(_, e)| e.req == Some(req))
            .map(|(i, e)| (i, e.finished, e.body.clone()))
    }

    fn answer(exec: usize, ctx: &IdempotencyContext, by: &str) -> Bytes {
        let body = serde_json::json!({
            "exec": exec,
            "by": by,
            "generation": ctx.generation(),
            "resumed_from": ctx.recovery_point().map(|p| p.step().to_owned()),
        });
        Bytes::from(body.to_string())
    }

    /// The handler, behind the HTTP layer.
    async fn handle(
        self: Arc<Self>,
        req: Request<RequestBody<Full<Bytes>>>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        let ctx = req
            .extensions()
            .get::<IdempotencyContext>()
            .cloned()
            .expect("a keyed request");
        let number: u64 = req.headers()["x-req"].to_str().unwrap().parse().unwrap();
        let (status, body) = self.work(ctx, number).await;
        let mut res = Response::new(Full::new(body));
        *res.status_mut() = status;
        Ok(res)
    }

    /// What request `number` does under `ctx`, behind either front: its status and body.
    async fn work(self: Arc<Self>, ctx: IdempotencyContext, number: u64) -> (StatusCode, Bytes) {
        let reply = |status: StatusCode, body: Bytes| (status, body);
        let Some(ctl) = lock(&self.ctls).get(&number).cloned() else {
            return reply(StatusCode::IM_A_TEAPOT, Bytes::new());
        };
        let exec = self.start(&ctx, Some((number, ctl.other)));
        let _ = ctx.save_recovery_point("created", format!("e{exec}")).await;
        match ctl.behave {
            Behave::Ok => {}
            Behave::Fail => {
                self.finish(exec, None);
                return reply(StatusCode::INTERNAL_SERVER_ERROR, "failed".into());
            }
            Behave::Panic => {
                self.finish(exec, None);
                std::panic::panic_any(PANIC);
            }
            Behave::Stall | Behave::Die | Behave::Disconnect => {
                ctl.reached.notify_one();
                ctl.gate.notified().await;
                let saved = ctx.save_recovery_point("woke", format!("e{exec}")).await;
                if saved.is_err() && !ctl.stubborn.load(Ordering::SeqCst) {
                    self.finish(exec, None);
                    return reply(StatusCode::INTERNAL_SERVER_ERROR, "fenced".into());
                }
            }
        }
        let body = Self::answer(exec, &ctx, "handler");
        self.finish(exec, Some(body.clone()));
        reply(self.front.ok(), body)
    }

    /// The worker's recover function.
    async fn recover(
        self: Arc<Self>,
        ctx: IdempotencyContext,
    ) -> Result<Response<Bytes>, BoxError> {
        let mode = *lock(&self.recover);
        let exec = self.start(&ctx, None);
        match mode {
            Recover::Ok => {
                let body = Self::answer(exec, &ctx, "worker");
                self.finish(exec, Some(body.clone()));
                let mut res = Response::new(body);
                *res.status_mut() = self.front.ok();
                Ok(res)
            }
            Recover::Err => {
                self.finish(exec, None);
                Err("the recovery failed".into())
            }
            Recover::Answer5xx => {
                self.finish(exec, None);
                let mut res = Response::new(Bytes::from_static(b"unavailable"));
                *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                Ok(res)
            }
        }
    }

    /// Checks one answer against the journal and the executions.
    async fn check_answer(
        &self,
        number: u64,
        ctl: &Ctl,
        before: &Snapshot,
        answer: Result<Answer, Box<dyn std::any::Any + Send>>,
    ) {
        let key = ctl.key;
        let id = self.ids[key];
        let who = format!(
            "key k{key}: request {number} ({:?}{})",
            ctl.behave,
            if ctl.other { ", other body" } else { "" }
        );
        let ran = self.exec_of(number);
        let res = match answer {
            Err(panic) => {
                lock(&self.stats).panics += 1;
                let ours = panic.downcast_ref::<&str>() == Some(&PANIC);
                if !ours || ctl.behave != Behave::Panic || ran.is_none() {
                    self.flag(format!("{who}: a panic no handler of it raised"));
                }
                return;
            }
            Ok(Ok(res)) => res,
            Ok(Err(never)) => match never {},
        };
        let status = res.status();
        let replayed = res.headers().get("idempotent-replayed").is_some();
        let body = match tokio::time::timeout(PATIENCE, body_bytes(res)).await {
            Ok(b) => b,
            Err(_) => return self.flag(format!("{who}: the answer's body never ended")),
        };
        let after = self.journal.snapshot(&id);
        let certain = !before.uncertain && !after.uncertain;
        let changed = before.version != after.version;
        let fp = lock(&self.fingerprints)[usize::from(ctl.other)];
        let mut stats = lock(&self.stats);
        let shown = String::from_utf8_lossy(&body).into_owned();
        if replayed {
            stats.replays += 1;
            drop(stats);
            if ran.is_some() {
                return self.flag(format!("{who}: ran, and was answered as a replay"));
            }
            if !certain {
                return;
            }
            let recorded = [before, &after].into_iter().find_map(|s| {
                s.present
                    .as_ref()
                    .and_then(|p| p.completed.clone().map(|c| (p.fingerprint, c.1)))
            });
            match recorded {
                Some((fingerprint, Completion::Response(stored))) => {
                    if stored.status != status || stored.body != body {
                        self.flag(format!(
                            "{who}: replayed {status} {shown}, not the recorded {} {}",
                            stored.status,
                            String::from_utf8_lossy(&stored.body)
                        ));
                    }
                    if fp.is_some_and(|f| f != fingerprint) {
                        self.flag(format!("{who}: replayed the answer of another body"));
                    }
                }
                other => self.flag(format!(
                    "{who}: replayed {status} {shown} with no answer recorded ({other:?})"
                )),
            }
            return;
        }
        match status {
            StatusCode::CONFLICT => {
                stats.conflicts += 1;
                drop(stats);
                let in_flight = |s: &Snapshot| {
                    s.present
                        .as_ref()
                        .is_some_and(|p| p.completed.is_none() && !p.released)
                };
                if ran.is_some() {
                    self.flag(format!("{who}: ran, and was answered 409"));
                } else if certain && !in_flight(before) && !in_flight(&after) && !changed {
                    self.flag(format!(
                        "{who}: 409 with no attempt in flight ({:?})",
                        after.present
                    ));
                }
            }
            StatusCode::UNPROCESSABLE_ENTITY => {
                stats.mismatches += 1;
                drop(stats);
                let other_body = |s: &Snapshot| {
                    s.present
                        .as_ref()
                        .is_some_and(|p| fp.is_none_or(|f| f != p.fingerprint))
                };
                if ran.is_some() {
                    self.flag(format!("{who}: ran, and was answered 422"));
                } else if certain && !other_body(before) && !other_body(&after) && !changed {
                    self.flag(format!(
                        "{who}: 422, but the key holds this body's request ({:?})",
                        after.present
                    ));
                }
            }
            StatusCode::SERVICE_UNAVAILABLE if ran.is_none() => {
                stats.unavailable += 1;
            }
            _ => {
                drop(stats);
                let Some((_, finished, produced)) = &ran else {
                    return self.flag(format!(
                        "{who}: answered {status} {shown} without running or replaying"
                    ));
                };
                if !finished {
                    self.flag(format!(
                        "{who}: answered {status} before its handler finished"
                    ));
                }
                if status == self.front.ok() && produced.as_ref() != Some(&body) {
                    self.flag(format!(
                        "{who}: answered {shown}, not what its handler produced"
                    ));
                }
            }
        }
        // A request of the body the key holds, with nothing changing meanwhile, replays or
        // waits; of another body, it is refused.
        if certain && !changed && ran.is_some() {
            if let (Some(p), Some(f)) = (&before.present, fp) {
                if p.completed.is_some() && p.fingerprint == f {
                    self.flag(format!(
                        "{who}: ran although the key holds a recorded answer"
                    ));
                }
            }
        }
    }
}

// ---- running a history ---------------------------------------------------------------------

type Svc = tower::util::BoxCloneService<Request<Full<Bytes>>, Response<AnswerBody>, Infallible>;
type AnswerBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;
type Answer = Result<Response<AnswerBody>, Infallible>;
type InFlight = Pin<Box<dyn Future<Output = Answer> + Send>>;
type Recovering = Pin<Box<dyn Future<Output = Result<Response<Bytes>, BoxError>> + Send>>;

/// A backend of the histories: its store, shared by every history of a run (each history has
/// keys of its own and removes them at its end), and its timing.
#[derive(Clone)]
struct Backend {
    name: &'static str,
    /// What the histories' requests go through.
    front: Front,
    store: Arc<dyn AdminStore>,
    lease: Duration,
    store_timeout: Duration,
}

impl Backend {
    fn lapse(&self) -> Duration {
        self.lease + self.lease / 4
    }
}

/// Names no other run or history uses.
fn nonce() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "h{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The state of one history's run: the service, the worker, and the requests paused.
struct Runner<W> {
    backend: Backend,
    world: Arc<World>,
    svc: Svc,
    worker: W,
    keys: Vec<String>,
    ids: Vec<RecordId>,
    number: u64,
    /// Stalled holders, oldest first: not polled until woken.
    stalled: Vec<(u64, Arc<Ctl>, Snapshot, InFlight)>,
    /// Disconnected holders, oldest first: their work goes on, on the layer's task.
    disconnected: Vec<Arc<Ctl>>,
}

/// A holder that dies with its process: no destructor, no release, no renewal.
#[expect(clippy::mem_forget, reason = "a crash: no destructor may run")]
fn die(fut: InFlight) {
    std::mem::forget(fut);
}

impl<F> Runner<RecoveryWorker<F>>
where
    F: Fn(IdempotencyContext) -> Recovering + Send + Sync + 'static,
{
    /// Sends a request; `false` when it hung.
    async fn send(&mut self, key: usize, other: bool, behave: Behave) -> bool {
        self.number += 1;
        let number = self.number;
        let ctl = Arc::new(Ctl {
            key,
            other,
            behave,
            reached: Notify::new(),
            gate: Notify::new(),
            stubborn: AtomicBool::new(false),
        });
        lock(&self.world.ctls).insert(number, ctl.clone());
        let body = if other { OTHER_BODY } else { SAME_BODY };
        let mut req = post("/pay", Some(&self.keys[key]), body);
        req.headers_mut().insert("x-req", HeaderValue::from(number));
        let before = self.world.journal.snapshot(&self.ids[key]);
        let mut fut: InFlight = Box::pin(self.svc.clone().oneshot(req));
        let answered = tokio::select! {
            a = AssertUnwindSafe(&mut fut).catch_unwind() => Some(a),
            () = ctl.reached.notified() => None,
            () = tokio::time::sleep(PATIENCE) => {
                self.world.flag(format!("key k{key}: request {number} hung"));
                return false;
            }
        };
        match answered {
            Some(a) => self.world.check_answer(number, &ctl, &before, a).await,
            None => match behave {
                Behave::Stall => {
                    self.world.set_stopped(number, true);
                    self.stalled.push((number, ctl, before, fut));
                }
                Behave::Die => {
                    self.world.set_stopped(number, true);
                    die(fut);
                }
                _ if self.backend.front == Front::Operation => {
                    // The caller drops the operation: its work stops with it (never polled
                    // again), and the claim's lease is ended for the next attempt.
                    self.world.set_stopped(number, true);
                    drop(fut);
                }
                _ => {
                    // The client is gone: the layer finishes the work on a task.
                    drop(fut);
                    self.disconnected.push(ctl);
                }
            },
        }
        true
    }

    /// Polls the oldest stalled holder of `key` again, to its answer; `false` when it hung.
    async fn wake(&mut self, key: usize, stubborn: bool) -> bool {
        let Some(at) = self.stalled.iter().position(|s| s.1.key == key) else {
            return true;
        };
        let (number, ctl, before, fut) = self.stalled.remove(at);
        ctl.stubborn.store(stubborn, Ordering::SeqCst);
        self.world.set_stopped(number, false);
        ctl.gate.notify_one();
        match tokio::time::timeout(PATIENCE, AssertUnwindSafe(fut).catch_unwind()).await {
            Ok(a) => {
                self.world.check_answer(number, &ctl, &before, a).await;
                true
            }
            Err(_) => {
                self.world
                    .flag(format!("key k{key}: woken request {number} hung"));
                false
            }
        }
    }

    fn open(&mut self, key: usize) {
        if let Some(at) = self.disconnected.iter().position(|c| c.key == key) {
            self.disconnected.remove(at).gate.notify_one();
        }
    }

    /// A worker sweep; `false` when it hung. A key absent before it is absent after it.
    async fn sweep(&mut self, mode: Recover) -> bool {
        *lock(&self.world.recover) = mode;
        let store = &self.backend.store;
        let mut absent = Vec::new();
        for (k, id) in self.ids.iter().enumerate() {
            if let Ok(None) = store.get(id).await {
                absent.push(k);
            }
        }
        match tokio::time::timeout(PATIENCE, self.worker.run_once()).await {
            Err(_) => {
                self.world.flag("a sweep hung");
                return false;
            }
            Ok(Err(e)) => self.world.flag(format!("a sweep failed: {e}")),
            Ok(Ok(_)) => {}
        }
        for k in absent {
            if let Ok(Some(r)) = store.get(&self.ids[k]).await {
                self.world.flag(format!(
                    "key k{k}: absent before a sweep, the sweep recreated it: {r:?}"
                ));
            }
        }
        true
    }

    /// One event; `false` when the history cannot go on (something hung).
    async fn step(&mut self, event: Event) -> bool {
        match event {
            Event::Send { key, other, behave } => return self.send(key, other, behave).await,
            Event::Wake { key, stubborn } => return self.wake(key, stubborn).await,
            Event::Open { key } => self.open(key),
            Event::Lapse => tokio::time::sleep(self.backend.lapse()).await,
            Event::List => self.world.journal.list_now().await,
            Event::Sweep(mode) => return self.sweep(mode).await,
            Event::ForceRelease(key) => {
                let _ = self.world.journal.force_release(&self.ids[key]).await;
            }
            Event::Delete(key) => {
                let _ = self.world.journal.delete(&self.ids[key]).await;
            }
        }
        true
    }

    /// After the events: every paused holder goes on to its end, and each key is asked
    /// once more.
    async fn drain(&mut self) {
        for ctl in self.disconnected.drain(..) {
            ctl.gate.notify_one();
        }
        while let Some(key) = self.stalled.first().map(|s| s.1.key) {
            if !self.wake(key, false).await {
                return;
            }
        }
        // Every holder that was not killed finishes its work, once.
        let deadline = Instant::now() + PATIENCE;
        loop {
            let pending: Vec<u64> = lock(&self.world.execs)
                .iter()
                .filter(|e| !e.finished && !e.stopped)
                .filter_map(|e| e.req)
                .collect();
            if pending.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                self.world
                    .flag(format!("requests {pending:?} never finished their work"));
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for key in 0..self.keys.len() {
            if !self.send(key, false, Behave::Ok).await {
                return;
            }
        }
    }

    /// The executions, counted per key by the derived key of their side effect: one derived
    /// key per key (the worker's included), and as many effects as executions.
    fn count(&self) {
        let execs = lock(&self.world.execs);
        let charges = lock(&self.world.charges);
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (k, id) in self.ids.iter().enumerate() {
            let mine: Vec<&Exec> = execs.iter().filter(|e| e.id == *id).collect();
            let derived: HashSet<&str> = mine.iter().map(|e| e.derived.as_str()).collect();
            if derived.len() > 1 {
                self.world.flag(format!(
                    "key k{k}: its executions derived {} different keys",
                    derived.len()
                ));
            }
            for d in derived {
                if let Some(other) = seen.insert(d, k) {
                    self.world
                        .flag(format!("keys k{other} and k{k} derived the same key"));
                }
                let charged = charges.get(d).copied().unwrap_or(0);
                if charged != mine.len() {
                    self.world.flag(format!(
                        "key k{k}: {charged} side effects for {} executions",
                        mine.len()
                    ));
                }
            }
        }
    }
}

/// Runs `history` on `backend`: its violations (none when it holds), and its figures.
async fn run(backend: &Backend, history: &History) -> (Vec<String>, Stats) {
    let run = nonce();
    let keys: Vec<String> = (0..history.keys).map(|k| format!("{run}-k{k}")).collect();
    let ids: Vec<RecordId> = keys.iter().map(|k| RecordId::new(None, k)).collect();
    let names: Vec<(RecordId, String)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, format!("k{i}")))
        .collect();
    let journal = Arc::new(Journal::new(backend.store.clone(), backend.lease, &names));
    let world = Arc::new(World {
        front: backend.front,
        journal: journal.clone(),
        ids: ids.clone(),
        ctls: Mutex::default(),
        execs: Mutex::default(),
        violations: Mutex::default(),
        fingerprints: Mutex::default(),
        starts: Mutex::default(),
        charges: Mutex::default(),
        recover: Mutex::new(Recover::Ok),
        stats: Mutex::default(),
    });
    let timing = Timing::new(backend.lease, Duration::from_secs(120))
        .unwrap()
        .with_store_timeout(backend.store_timeout)
        .unwrap();
    let layer = IdempotencyLayer::new(journal.clone() as Arc<dyn IdempotencyStore>)
        .unscoped()
        .with_timing(timing);
    let svc: Svc = match backend.front {
        Front::Http => {
            let world = world.clone();
            let inner = service_fn(move |req| world.clone().handle(req));
            let svc = layer.clone().layer(inner);
            tower::util::BoxCloneService::new(svc.map_response(
                |res: Response<ResponseBody<Full<Bytes>>>| res.map(BodyExt::boxed_unsync),
            ))
        }
        Front::Operation => front::operations(&layer, world.clone()),
    };
    let worker = {
        let world = world.clone();
        RecoveryWorker::new(&layer, move |ctx| -> Recovering {
            Box::pin(world.clone().recover(ctx))
        })
        .with_max_attempts(std::num::NonZeroU64::new(MAX_ATTEMPTS).unwrap())
    };
    let mut runner = Runner {
        backend: backend.clone(),
        world: world.clone(),
        svc,
        worker,
        keys,
        ids: ids.clone(),
        number: 0,
        stalled: Vec::new(),
        disconnected: Vec::new(),
    };
    let mut went_on = true;
    for event in &history.events {
        went_on = runner.step(*event).await;
        if !went_on {
            break;
        }
    }
    if went_on {
        runner.drain().await;
    }
    runner.count();
    // Leave nothing behind for the next history (a dead holder's record included).
    for id in &ids {
        let _ = backend.store.force_release(id).await;
        let _ = backend.store.delete(id).await;
    }
    let mut violations = std::mem::take(&mut *lock(&world.violations));
    let mut stats = *lock(&world.stats);
    {
        let mut m = journal.model();
        violations.append(&mut m.violations);
        stats.takeovers = m.stats.takeovers;
        stats.fenced = m.stats.fenced;
        stats.recorded = m.stats.recorded;
        stats.abandoned_calls = m.stats.abandoned_calls;
        stats.degraded = usize::from(!m.uncertain.is_empty());
    }
    stats.histories = 1;
    (violations, stats)
}

/// Drops events from a failing history while it still fails: a minimal counterexample
/// (each event needed), within `budget`.
async fn shrink(backend: &Backend, history: &History, budget: Duration) -> (History, Vec<String>) {
    let started = Instant::now();
    let mut best = history.clone();
    let mut failure = run(backend, &best).await.0;
    if failure.is_empty() {
        // It did not fail again (timing): the original is all there is.
        return (best, failure);
    }
    loop {
        let mut shrunk = false;
        let mut i = 0;
        while i < best.events.len() {
            if started.elapsed() > budget {
                return (best, failure);
            }
            let mut candidate = best.clone();
            candidate.events.remove(i);
            let (violations, _) = run(backend, &candidate).await;
            if violations.is_empty() {
                i += 1;
            } else {
                best = candidate;
                failure = violations;
                shrunk = true;
            }
        }
        if !shrunk {
            return (best, failure);
        }
    }
}

/// The seed and count of a run: `IDEMPOTENCY_LAYER_HISTORY_SEED` and
/// `IDEMPOTENCY_LAYER_HISTORIES`, else a seed from the clock and the CI budget (`histories`
/// within `budget`).
fn plan(histories: usize, budget: Duration) -> (u64, usize, Option<Duration>) {
    let seed = std::env::var("IDEMPOTENCY_LAYER_HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    match std::env::var("IDEMPOTENCY_LAYER_HISTORIES")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(n) => (seed, n, None),
        None => (seed, histories, Some(budget)),
    }
}

/// What a flow future says when it is polled again after its handler's panic unwound
/// through it.
const RESUMED: &str = "`async fn` resumed after panicking";

/// Panics with [`RESUMED`] on the runtime's threads: a response future dropped after its
/// poll panicked would hand the spent flow to a task, which polls it again. Counted, and
/// none is allowed (`service/future.rs` forgets a flow whose poll unwound).
static RESUMED_PANICS: AtomicU64 = AtomicU64::new(0);

/// Keeps the handlers' deliberate panics out of the output, and counts [`RESUMED`] ones;
/// every other panic prints.
fn quiet_deliberate_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let text = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
            if text == Some(RESUMED) {
                RESUMED_PANICS.fetch_add(1, Ordering::Relaxed);
            } else if text != Some(PANIC) {
                default(info);
            }
        }));
    });
}

/// Runs the planned histories on `backend`; on the first that fails, shrinks it and panics
/// with the minimal history, its seed and what it broke.
async fn histories(backend: Backend, histories: usize, budget: Duration) {
    quiet_deliberate_panics();
    let (seed, count, budget) = plan(histories, budget);
    eprintln!(
        "{} ({:?}): layer histories from seed {seed} (IDEMPOTENCY_LAYER_HISTORY_SEED={seed} replays them)",
        backend.name, backend.front
    );
    let started = std::time::Instant::now();
    let mut total = Stats::default();
    for i in 0..count {
        if budget.is_some_and(|b| started.elapsed() > b) {
            break;
        }
        let history = History::generate(seed.wrapping_add(i as u64));
        let (violations, stats) = run(&backend, &history).await;
        total.add(&stats);
        if !violations.is_empty() {
            eprintln!("{history}violations:\n  {}", violations.join("\n  "));
            let (minimal, failure) = shrink(&backend, &history, Duration::from_secs(180)).await;
            panic!(
                "{}: a layer history broke the protocol.\nminimal {minimal}violations:\n  {}\nreplay: IDEMPOTENCY_LAYER_HISTORY_SEED={} IDEMPOTENCY_LAYER_HISTORIES=1",
                backend.name,
                failure.join("\n  "),
                history.seed
            );
        }
    }
    eprintln!(
        "{}: {} histories in {:.1?}, none broke the protocol: {total:?}",
        backend.name,
        total.histories,
        started.elapsed(),
    );
    assert!(total.histories > 0, "no history ran");
    assert_eq!(
        RESUMED_PANICS.load(Ordering::Relaxed),
        0,
        "a flow was polled again after its handler's panic unwound through it"
    );
}

fn memory_backend(front: Front) -> Backend {
    Backend {
        name: "memory",
        front,
        store: Arc::new(tower_idempotency::store::MemoryStore::new()),
        lease: Duration::from_millis(600),
        store_timeout: Duration::from_millis(150),
    }
}

#[tokio::test(start_paused = true)]
async fn memory() {
    histories(memory_backend(Front::Http), 3000, Duration::from_secs(20)).await;
}

/// The same histories through the operation API (`OperationLayer`).
#[tokio::test(start_paused = true)]
async fn memory_operations() {
    histories(
        memory_backend(Front::Operation),
        2000,
        Duration::from_secs(12),
    )
    .await;
}

#[cfg(feature = "redis")]
async fn redis_backend(front: Front) -> Option<Backend> {
    use tower_idempotency::store::redis::RedisStore;
    let url = backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
    let store = RedisStore::builder()
        .with_key_prefix(format!("{}:", nonce()))
        .connect(&url)
        .await
        .unwrap();
    Some(Backend {
        name: "redis",
        front,
        store: Arc::new(store),
        lease: Duration::from_millis(450),
        store_timeout: Duration::from_millis(140),
    })
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    if let Some(backend) = redis_backend(Front::Http).await {
        histories(backend, 60, Duration::from_secs(25)).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_operations() {
    if let Some(backend) = redis_backend(Front::Operation).await {
        histories(backend, 40, Duration::from_secs(15)).await;
    }
}

#[cfg(feature = "postgres")]
async fn postgres_histories(front: Front, count: usize, budget: Duration) {
    use crate::support::pg;
    let Some(url) = pg::url() else {
        return;
    };
    let schema = pg::TestSchema::create(&url, "histories").await;
    let store = pg::store_in(&url, &schema, 4, "tidem-histories").await;
    let backend = Backend {
        name: "postgres",
        front,
        store: Arc::new(store),
        lease: Duration::from_millis(450),
        store_timeout: Duration::from_millis(140),
    };
    histories(backend, count, budget).await;
    schema.drop_now().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    postgres_histories(Front::Http, 60, Duration::from_secs(25)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_operations() {
    postgres_histories(Front::Operation, 40, Duration::from_secs(15)).await;
}
