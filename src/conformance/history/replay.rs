//! Running a history against a store, checking each answer against the model, and shrinking a failing one.

use super::*;

/// What [`Faulty`] does to the next call made through it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Arm {
    /// The call runs to its end; its answer never comes back.
    LoseReply,
    /// The call hangs before it reaches the store.
    Hang,
}

/// A store wrapper that loses the reply of a chosen call, or holds it back until the
/// caller's deadline passes. One per history: its calls are one at a time.
pub(super) struct Faulty {
    inner: DynStore,
    admin: Option<Arc<dyn IdempotencyAdmin>>,
    arm: Mutex<Option<Arm>>,
    /// Told when a call whose reply is lost has run.
    landed: Notify,
}

impl Faulty {
    pub(super) async fn around<T>(&self, call: impl Future<Output = T>) -> T {
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
    pub(super) async fn run<T>(&self, fault: Fault, call: impl Future<Output = T>) -> Option<T> {
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
pub(super) struct Outcome {
    /// One line per step run, with its answer.
    pub(super) trace: Vec<String>,
    /// The violation, at the last step of the trace.
    pub(super) failure: Option<String>,
    pub(super) calls: usize,
}

/// One run of a history, on record ids of its own.
pub(super) struct Run<'a> {
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

pub(super) async fn replay(stores: &HistoryStore, steps: &[Step], label: u64) -> Outcome {
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
pub(super) fn error(e: &StoreError) -> Answer {
    if e.is_fenced() {
        Answer::Fenced
    } else {
        Answer::Error(format!("{:?}: {e}", e.kind()))
    }
}

pub(super) fn unit(r: Option<Result<(), StoreError>>) -> Answer {
    match r {
        None => Answer::Unknown,
        Some(Ok(())) => Answer::Ok,
        Some(Err(e)) => error(&e),
    }
}

pub(super) fn describe(answer: &Answer) -> String {
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

pub(super) fn describe_seen(seen: &Seen) -> String {
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
    pub(super) fn now(&self) -> Duration {
        self.start.elapsed()
    }

    pub(super) fn seen(&self, record: &Record) -> Seen {
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

    pub(super) fn point_name(&self, p: &RecoveryPoint) -> Named<usize> {
        self.points
            .iter()
            .position(|q| q == p)
            .map_or(Named::Foreign, Named::Is)
    }

    /// The token a step sends, in the store's and the model's terms.
    pub(super) fn token(&self, key: usize, pick: Pick) -> (Token, TokenRef) {
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

    pub(super) fn claimed_answer(&mut self, key: usize, outcome: ClaimOutcome) -> Answer {
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
    pub(super) async fn step(&mut self, step: &Step) -> (String, Result<(), String>) {
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
    pub(super) async fn race(
        &mut self,
        key: usize,
        f: u8,
        n: usize,
    ) -> (String, Result<(), String>) {
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

    pub(super) async fn recoverable(&mut self) -> (String, Result<(), String>) {
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
pub(super) fn permutations(n: usize) -> Vec<Vec<usize>> {
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
pub(super) async fn shrink(
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
