//! An executable model of the idempotency protocol, explored exhaustively with
//! [Stateright](https://docs.rs/stateright).
//!
//! It models the protocol, not the crate's code: a store (one record per key, with the
//! operations and guarantees of `src/store/mod.rs`), clients that send a keyed request and
//! retry, the holders of claims (the layer's flow in `src/service/`), the recovery worker
//! (`src/recovery/mod.rs`), an operator and a clock. Every store call is one atomic step; a
//! call may take effect and lose its reply. The checker explores every interleaving of these
//! actors within [`Bounds`] and checks the properties in [`properties`].
//!
//! The worker's decision after its claim is a variant, [`WorkerLogic`]: `Claimed` is the
//! logic since commit c02a3b3, `Listed` the one before it, which the checker breaks.
//!
//! # Bounds
//!
//! Two checks, each over every reachable state (no depth bound: every actor's budget is
//! finite). Both have an attempt cap of 2, one recovery point per client attempt, one sweep
//! per worker, operator force release and delete, lease lapses and TTL expiry.
//!
//! - [`Bounds::ONE_KEY`]: 1 key, 3 client attempts each with either of 2 fingerprints, 2
//!   workers, and lost replies on claims, completes, releases and give-backs.
//! - [`Bounds::TWO_KEYS`]: 2 keys, 2 attempts each with one fingerprint, 1 worker whose
//!   listing names both, no lost replies.
//!
//! The keys are independent but for the worker, so two keys at the first bounds would
//! roughly square its half a million states; the second check keeps what two keys add, a
//! listing that ages while the worker recovers the other record. States are reduced by
//! symmetry ([`representative`]): nonces renumbered, fingerprints and workers renamed.
//!
//! Run with `cargo test --release --manifest-path tests/protocol/Cargo.toml -- --nocapture`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod properties;
pub mod store;
pub mod trace;

use stateright::{Model, Property};
use store::{Answer, Claim, Point, Record, Token};

/// What the recovery worker does after its claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerLogic {
    /// Before c02a3b3: the cap is checked on the listed generation; the worker runs under
    /// any claim, a first claim included, from `claim.recovery_point.unwrap_or(listed_point)`.
    Listed,
    /// Since c02a3b3: the worker runs only when its claim is a takeover that handed over a
    /// point, with the claimed generation within the cap. Otherwise it gives the claim back
    /// at once: a first claim is released, a takeover's lease is ended (`extend(0)`), which
    /// keeps its point.
    Claimed,
}

/// How far the checker explores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Keys (1 or 2).
    pub keys: u8,
    /// Requests a client sends per key, first and retries together.
    pub attempts: u8,
    /// Fingerprints a request may carry (1: every request is the same; 2: a key may be
    /// reused by another request).
    pub fingerprints: u8,
    /// Recovery workers.
    pub workers: u8,
    /// Listings each worker takes (sweeps).
    pub sweeps: u8,
    /// The worker's attempt cap (`with_max_attempts`): the most generations it runs under.
    pub cap: u8,
    /// Recovery points a client's attempt saves at most.
    pub steps: u8,
    /// Store calls may take effect and lose their reply.
    pub lost_replies: bool,
    /// The operator may force-release and delete records.
    pub operator: bool,
}

impl Bounds {
    /// One key with every actor at full budget: 3 client attempts with either of 2
    /// fingerprints, 2 workers, lost replies, the operator. Where histories get long.
    pub const ONE_KEY: Bounds = Bounds {
        keys: 1,
        attempts: 3,
        fingerprints: 2,
        workers: 2,
        sweeps: 1,
        cap: 2,
        steps: 1,
        lost_replies: true,
        operator: true,
    };

    /// Two keys, so a worker's listing names both and ages while it recovers one: 2
    /// attempts per key with one fingerprint, 1 worker, no lost replies, the operator.
    pub const TWO_KEYS: Bounds = Bounds {
        keys: 2,
        attempts: 2,
        fingerprints: 1,
        workers: 1,
        sweeps: 1,
        cap: 2,
        steps: 1,
        lost_replies: false,
        operator: true,
    };
}

/// The model: the protocol under `bounds`, with the worker's `logic`.
#[derive(Clone, Copy, Debug)]
pub struct Protocol {
    /// How far to explore.
    pub bounds: Bounds,
    /// The worker's decision after its claim.
    pub logic: WorkerLogic,
}

/// Who holds a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum By {
    /// A client's request, through the layer.
    Client,
    /// A recovery worker (its index).
    Worker(u8),
}

/// Where a holder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Running the work, renewing its lease every lease / 3.
    Running,
    /// Stopped (a GC pause, SIGSTOP, cut off from the store): not renewing. It may wake up
    /// and go on with its token, stale or not.
    Paused,
    /// Its `complete` took effect and the reply was lost: it sends it again.
    Completing,
    /// Its `release` took effect and the reply was lost: it sends it again.
    Releasing,
    /// A client's claim took effect and its reply was lost: the layer answered 503 and
    /// releases the claim if the late reply comes; the work never runs.
    Unclaimed,
    /// A worker's claim it will not run under: it gives it back.
    GivingBack,
}

/// An attempt that claimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    /// Its claim's token.
    pub token: Token,
    /// A client's attempt or a worker.
    pub by: By,
    /// Where it is.
    pub phase: Phase,
    /// Points it saved.
    pub saved: u8,
    /// Its claim created the record (`false`: a takeover).
    pub first: bool,
}

impl Holder {
    /// Running or paused in the middle of the work.
    pub fn in_the_work(&self) -> bool {
        matches!(self.phase, Phase::Running | Phase::Paused)
    }
}

/// A record a worker listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Listing {
    /// Its key.
    pub key: u8,
    /// Its generation when listed.
    pub gen: u8,
    /// Its fingerprint (the worker claims with it).
    pub fp: u8,
    /// Its point when listed.
    pub point: Point,
}

/// A recovery worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Worker {
    /// Listings it may still take.
    pub sweeps_left: u8,
    /// Its current listing, not yet claimed: it may be stale by now.
    pub listed: Vec<Listing>,
}

/// One key: its record, its client and its holders.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// What the store holds.
    pub record: Record,
    /// Requests the client may still send.
    pub attempts_left: u8,
    /// Claims made so far: the next claim's nonce is one more.
    pub claims: u8,
    /// Attempts that claimed and are not done, oldest first.
    pub holders: Vec<Holder>,
    /// Ghost: every point saved in the current lineage since the last release (or since the
    /// record was created). Kept by the model from the operations' outcomes, apart from the
    /// store's own point.
    pub lineage: Vec<Point>,
    /// Ghost: the first answer recorded in this record's life.
    pub first_answer: Option<Answer>,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The keys.
    pub keys: Vec<Key>,
    /// The recovery workers.
    pub workers: Vec<Worker>,
    /// Ghost: properties a step broke ([`properties::Broken`] bits).
    pub broken: u16,
}

/// A step of one actor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A client sends a request on `key` with fingerprint `fp`: a claim (its reply lost if
    /// `lost`: the claim took effect, the layer does not know it).
    Send {
        /// The key.
        key: u8,
        /// The request's fingerprint.
        fp: u8,
        /// The claim took effect and its reply was lost.
        lost: bool,
    },
    /// A holder saves a recovery point (fenced by its token).
    Save {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
    },
    /// A holder renews its lease (after a pause: a running holder's renewals keep it live).
    Renew {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
    },
    /// A holder records its answer.
    Complete {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
        /// It took effect and the reply was lost.
        lost: bool,
    },
    /// A client's holder answered 5xx: it releases.
    Release {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
        /// It took effect and the reply was lost.
        lost: bool,
    },
    /// A holder whose reply was lost sends its `complete` or `release` again.
    Resend {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
    },
    /// A holder stops renewing (paused, cut off).
    Pause {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
    },
    /// A paused holder goes on, with its token.
    Wake {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
    },
    /// A holder stops forever: a crash, a failed recovery, a claim reply that never came.
    Crash {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
    },
    /// A worker lists the recoverable records.
    List {
        /// The worker.
        worker: u8,
    },
    /// A worker claims a record it listed, then decides.
    Recover {
        /// The worker.
        worker: u8,
        /// The listed key.
        key: u8,
        /// The claim took effect and its reply was lost.
        lost: bool,
    },
    /// A worker gives back a claim it does not run under (`effect: false`: the call timed
    /// out without effect, so the lease lapses by itself).
    GiveBack {
        /// The key.
        key: u8,
        /// The holder's nonce.
        nonce: u8,
        /// The call took effect.
        effect: bool,
    },
    /// The clock: the lease of a claim whose holder does not renew lapses.
    Lapse {
        /// The key.
        key: u8,
    },
    /// The clock: the record's TTL passes.
    Expire {
        /// The key.
        key: u8,
    },
    /// The operator removes a record in progress.
    ForceRelease {
        /// The key.
        key: u8,
    },
    /// The operator deletes a completed record.
    Delete {
        /// The key.
        key: u8,
    },
}

impl Protocol {
    /// The model under `bounds` with the worker's `logic`.
    pub fn new(bounds: Bounds, logic: WorkerLogic) -> Self {
        Self { bounds, logic }
    }

    fn holder_actions(&self, key: u8, k: &Key, h: &Holder, actions: &mut Vec<Action>) {
        let nonce = h.token.nonce;
        let lost = self.bounds.lost_replies;
        let current = k.record.holder() == Some(h.token);
        match h.phase {
            Phase::Running => {
                if h.by == By::Client && h.saved < self.bounds.steps {
                    actions.push(Action::Save { key, nonce });
                }
                // A running holder's renewals keep its lease live; one matters after a pause
                // (the lease may have lapsed) or when the token is stale.
                let lapsed = matches!(k.record, Record::InProgress(r) if !r.live);
                if !current || lapsed {
                    actions.push(Action::Renew { key, nonce });
                }
                actions.push(Action::Complete {
                    key,
                    nonce,
                    lost: false,
                });
                if lost && current {
                    actions.push(Action::Complete {
                        key,
                        nonce,
                        lost: true,
                    });
                }
                if h.by == By::Client {
                    actions.push(Action::Release {
                        key,
                        nonce,
                        lost: false,
                    });
                    if lost && current {
                        actions.push(Action::Release {
                            key,
                            nonce,
                            lost: true,
                        });
                    }
                }
                actions.push(Action::Pause { key, nonce });
                actions.push(Action::Crash { key, nonce });
            }
            Phase::Paused => {
                actions.push(Action::Wake { key, nonce });
                actions.push(Action::Crash { key, nonce });
            }
            Phase::Completing | Phase::Releasing => actions.push(Action::Resend { key, nonce }),
            Phase::Unclaimed => {
                // The late reply comes and the layer releases the claim; or it never comes.
                actions.push(Action::Release {
                    key,
                    nonce,
                    lost: false,
                });
                actions.push(Action::Crash { key, nonce });
            }
            Phase::GivingBack => {
                actions.push(Action::GiveBack {
                    key,
                    nonce,
                    effect: true,
                });
                if lost {
                    actions.push(Action::GiveBack {
                        key,
                        nonce,
                        effect: false,
                    });
                }
            }
        }
    }

    fn busy(state: &State, worker: u8) -> bool {
        state
            .keys
            .iter()
            .any(|k| k.holders.iter().any(|h| h.by == By::Worker(worker)))
    }

    fn listing(state: &State) -> Vec<Listing> {
        state
            .keys
            .iter()
            .enumerate()
            .filter_map(|(i, k)| {
                k.record.recoverable().map(|(gen, fp, point)| Listing {
                    key: i as u8,
                    gen,
                    fp,
                    point,
                })
            })
            .collect()
    }
}

/// The record's store call by `token`, with the ghost checks every write gets: a stale
/// token changes nothing, a present record's generation never shrinks, a completed record
/// is never overwritten, and the lineage of points follows the outcome.
fn write(
    k: &mut Key,
    broken: &mut u16,
    token: Token,
    op: impl FnOnce(&mut Record) -> Result<(), store::Fenced>,
) -> Result<(), store::Fenced> {
    let before = k.record;
    let result = op(&mut k.record);
    if before.holder() != Some(token) && k.record != before {
        *broken |= properties::Broken::FENCED_WROTE;
    }
    settle(k, broken, before);
    result
}

/// Ghost bookkeeping after any change of a key's record.
fn settle(k: &mut Key, broken: &mut u16, before: Record) {
    let after = k.record;
    if let (Some(a), Some(b)) = (before.generation(), after.generation()) {
        if b < a {
            *broken |= properties::Broken::GENERATION_SHRANK;
        }
    }
    if let Record::Completed { .. } = before {
        if after != before && after != Record::Absent {
            *broken |= properties::Broken::OVERWRITTEN;
        }
    }
    match after {
        Record::Absent => {
            k.lineage.clear();
            k.first_answer = None;
        }
        Record::Completed { answer, .. } => {
            k.lineage.clear();
            k.first_answer.get_or_insert(answer);
        }
        Record::InProgress(r) => {
            // A release (of a takeover: a first claim's leaves the key absent) ends the
            // lineage; the worker's extend(0) does not.
            if r.released && !matches!(before, Record::InProgress(b) if b.released) {
                k.lineage.clear();
            }
            if let Some(p) = r.point {
                if !k.lineage.contains(&p) {
                    k.lineage.push(p);
                }
            }
        }
    }
}

/// Ghost check when an actor starts the work from `point` after a claim: the point must have
/// been saved in the key's current lineage since the last release.
fn resume(k: &Key, broken: &mut u16, point: Option<Point>) {
    if let Some(p) = point {
        if !k.lineage.contains(&p) {
            *broken |= properties::Broken::STALE_POINT;
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let b = self.bounds;
        vec![State {
            keys: (0..b.keys)
                .map(|_| Key {
                    record: Record::Absent,
                    attempts_left: b.attempts,
                    claims: 0,
                    holders: Vec::new(),
                    lineage: Vec::new(),
                    first_answer: None,
                })
                .collect(),
            workers: (0..b.workers)
                .map(|_| Worker {
                    sweeps_left: b.sweeps,
                    listed: Vec::new(),
                })
                .collect(),
            broken: 0,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        let b = self.bounds;
        for (i, k) in state.keys.iter().enumerate() {
            let key = i as u8;
            if k.attempts_left > 0 {
                for fp in 0..b.fingerprints {
                    actions.push(Action::Send {
                        key,
                        fp,
                        lost: false,
                    });
                    if b.lost_replies && k.record.claimable(fp) {
                        actions.push(Action::Send {
                            key,
                            fp,
                            lost: true,
                        });
                    }
                }
            }
            for h in &k.holders {
                self.holder_actions(key, k, h, actions);
            }
            match k.record {
                Record::InProgress(r) => {
                    // Only a claim nobody renews lapses: its holder is paused, crashed, or
                    // never learned it held the claim. A running holder renews every
                    // lease / 3, each renewal bounded by the store deadline.
                    let renewed = k.holders.iter().any(|h| {
                        h.token == r.token
                            && matches!(
                                h.phase,
                                Phase::Running | Phase::Completing | Phase::GivingBack
                            )
                    });
                    if r.live && !renewed {
                        actions.push(Action::Lapse { key });
                    }
                    // The TTL is at least the lease and a renewal extends it: only a record
                    // whose lease is over expires.
                    if !r.live {
                        actions.push(Action::Expire { key });
                    }
                    if b.operator {
                        actions.push(Action::ForceRelease { key });
                    }
                }
                Record::Completed { .. } => {
                    actions.push(Action::Expire { key });
                    if b.operator {
                        actions.push(Action::Delete { key });
                    }
                }
                Record::Absent => {}
            }
        }
        for (w, worker) in state.workers.iter().enumerate() {
            let w = w as u8;
            if Self::busy(state, w) {
                continue;
            }
            if worker.listed.is_empty() {
                if worker.sweeps_left > 0 && !Self::listing(state).is_empty() {
                    actions.push(Action::List { worker: w });
                }
                continue;
            }
            for l in &worker.listed {
                actions.push(Action::Recover {
                    worker: w,
                    key: l.key,
                    lost: false,
                });
                let k = &state.keys[l.key as usize];
                if b.lost_replies && k.record.claimable(l.fp) {
                    actions.push(Action::Recover {
                        worker: w,
                        key: l.key,
                        lost: true,
                    });
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let State {
            keys,
            workers,
            broken,
        } = &mut s;
        match action {
            Action::Send { key, fp, lost } => {
                let k = &mut keys[key as usize];
                k.attempts_left -= 1;
                let before = k.record;
                let nonce = k.claims + 1;
                match k.record.claim(fp, nonce) {
                    Claim::Claimed {
                        token,
                        takeover,
                        point,
                    } => {
                        k.claims = nonce;
                        if takeover && matches!(before, Record::InProgress(r) if r.live) {
                            *broken |= properties::Broken::TOOK_LIVE;
                        }
                        let phase = if lost {
                            Phase::Unclaimed
                        } else {
                            // The takeover's handler resumes from the point handed over.
                            resume(k, broken, point);
                            Phase::Running
                        };
                        k.holders.push(Holder {
                            token,
                            by: By::Client,
                            phase,
                            saved: 0,
                            first: !takeover,
                        });
                    }
                    Claim::Existing(Record::Completed { answer, fp: first }) if first == fp => {
                        // A replay.
                        if k.first_answer != Some(answer) {
                            *broken |= properties::Broken::REPLAY_DIFFERS;
                        }
                    }
                    // 409 (in progress) or 422 (another request): nothing changes.
                    Claim::Existing(_) => {}
                }
                settle(k, broken, before);
            }
            Action::Save { key, nonce } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                let h = k.holders[i];
                let point = Point {
                    by: h.token,
                    step: h.saved + 1,
                };
                match write(k, broken, h.token, |r| r.save(h.token, point)) {
                    Ok(()) => k.holders[i].saved += 1,
                    // The handler's save failed: it stops.
                    Err(_) => {
                        k.holders.remove(i);
                    }
                }
            }
            Action::Renew { key, nonce } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                let token = k.holders[i].token;
                if write(k, broken, token, |r| r.extend(token, true)).is_err() {
                    // Lost to another attempt: this run will not be recorded, and it stops.
                    k.holders.remove(i);
                }
            }
            Action::Complete { key, nonce, lost } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                let h = k.holders[i];
                let answer = Answer {
                    by: h.token,
                    worker: matches!(h.by, By::Worker(_)),
                };
                let ok = write(k, broken, h.token, |r| r.complete(h.token, answer)).is_ok();
                if ok && lost {
                    k.holders[i].phase = Phase::Completing;
                } else {
                    k.holders.remove(i);
                }
            }
            Action::Release { key, nonce, lost } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                let token = k.holders[i].token;
                let ok = write(k, broken, token, |r| r.release(token)).is_ok();
                if ok && lost {
                    k.holders[i].phase = Phase::Releasing;
                } else {
                    k.holders.remove(i);
                }
            }
            Action::Resend { key, nonce } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                let h = k.holders.remove(i);
                let answer = Answer {
                    by: h.token,
                    worker: matches!(h.by, By::Worker(_)),
                };
                let _ = if h.phase == Phase::Completing {
                    write(k, broken, h.token, |r| r.complete(h.token, answer))
                } else {
                    write(k, broken, h.token, |r| r.release(h.token))
                };
            }
            Action::Pause { key, nonce } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                k.holders[i].phase = Phase::Paused;
            }
            Action::Wake { key, nonce } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                k.holders[i].phase = Phase::Running;
            }
            Action::Crash { key, nonce } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                k.holders.remove(i);
            }
            Action::List { worker } => {
                let listed = Self::listing(last);
                let w = &mut workers[worker as usize];
                w.sweeps_left -= 1;
                w.listed = listed;
            }
            Action::Recover { worker, key, lost } => {
                let w = &mut workers[worker as usize];
                let at = w.listed.iter().position(|l| l.key == key)?;
                let listed = w.listed.remove(at);
                // Both logics leave a record listed at the cap without claiming it.
                if listed.gen >= self.bounds.cap {
                    return Some(s);
                }
                let k = &mut keys[key as usize];
                let before = k.record;
                let nonce = k.claims + 1;
                let claim = k.record.claim(listed.fp, nonce);
                if let Claim::Claimed {
                    token,
                    takeover,
                    point,
                } = claim
                {
                    k.claims = nonce;
                    if takeover && matches!(before, Record::InProgress(r) if r.live) {
                        *broken |= properties::Broken::TOOK_LIVE;
                    }
                    if !lost {
                        let run = match self.logic {
                            WorkerLogic::Listed => Some(point.unwrap_or(listed.point)),
                            WorkerLogic::Claimed => {
                                point.filter(|_| takeover && token.gen <= self.bounds.cap)
                            }
                        };
                        if run.is_some() {
                            resume(k, broken, run);
                        }
                        k.holders.push(Holder {
                            token,
                            by: By::Worker(worker),
                            phase: if run.is_some() {
                                Phase::Running
                            } else {
                                Phase::GivingBack
                            },
                            saved: 0,
                            first: !takeover,
                        });
                    }
                    // Lost: the worker counts a failure; the claim's lease lapses.
                }
                settle(k, broken, before);
            }
            Action::GiveBack { key, nonce, effect } => {
                let k = &mut keys[key as usize];
                let i = find(k, nonce);
                let h = k.holders.remove(i);
                if effect {
                    let token = h.token;
                    let _ = if h.first {
                        write(k, broken, token, |r| r.release(token))
                    } else {
                        write(k, broken, token, |r| r.extend(token, false))
                    };
                }
            }
            Action::Lapse { key } => {
                let k = &mut keys[key as usize];
                if let Record::InProgress(r) = &mut k.record {
                    r.live = false;
                }
            }
            Action::Expire { key } | Action::ForceRelease { key } | Action::Delete { key } => {
                let k = &mut keys[key as usize];
                let before = k.record;
                k.record = Record::Absent;
                settle(k, broken, before);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all(&self.bounds)
    }
}

fn find(k: &Key, nonce: u8) -> usize {
    k.holders
        .iter()
        .position(|h| h.token.nonce == nonce)
        .expect("an action names a holder that exists")
}

/// The representative of `state`'s class under renaming: nonces renumbered 1, 2, … in their
/// order (the protocol compares them only for equality and age), so two histories that
/// differ only in how many claims came and went meet in one state. For the checker's
/// symmetry reduction (`symmetry_fn`); paths keep the real states.
pub fn representative(state: &State) -> State {
    let mut s = state.clone();
    for (i, k) in s.keys.iter_mut().enumerate() {
        let mut used: Vec<u8> = Vec::new();
        let mut note = |t: Token| used.push(t.nonce);
        match k.record {
            Record::Absent => {}
            Record::InProgress(r) => {
                note(r.token);
                if let Some(p) = r.point {
                    note(p.by);
                }
            }
            Record::Completed { answer, .. } => note(answer.by),
        }
        k.holders.iter().for_each(|h| note(h.token));
        k.lineage.iter().for_each(|p| note(p.by));
        k.first_answer.iter().for_each(|a| note(a.by));
        for w in &state.workers {
            w.listed
                .iter()
                .filter(|l| l.key as usize == i)
                .for_each(|l| note(l.point.by));
        }
        used.sort_unstable();
        used.dedup();
        let map = |t: &mut Token| {
            t.nonce = used.binary_search(&t.nonce).expect("noted") as u8 + 1;
        };
        match &mut k.record {
            Record::Absent => {}
            Record::InProgress(r) => {
                map(&mut r.token);
                if let Some(p) = &mut r.point {
                    map(&mut p.by);
                }
            }
            Record::Completed { answer, .. } => map(&mut answer.by),
        }
        k.holders.iter_mut().for_each(|h| map(&mut h.token));
        k.lineage.iter_mut().for_each(|p| map(&mut p.by));
        k.lineage.sort_unstable();
        k.first_answer.iter_mut().for_each(|a| map(&mut a.by));
        for w in &mut s.workers {
            w.listed
                .iter_mut()
                .filter(|l| l.key as usize == i)
                .for_each(|l| map(&mut l.point.by));
        }
        k.claims = used.len() as u8;
        // Fingerprints: only equality matters, and a client may send either, so the key's
        // fingerprint (or, for an absent key, the one a stale listing names) reads 0.
        let fp = match k.record {
            Record::InProgress(r) => Some(r.fp),
            Record::Completed { fp, .. } => Some(fp),
            Record::Absent => s
                .workers
                .iter()
                .flat_map(|w| &w.listed)
                .find(|l| l.key as usize == i)
                .map(|l| l.fp),
        };
        if fp == Some(1) {
            match &mut k.record {
                Record::InProgress(r) => r.fp ^= 1,
                Record::Completed { fp, .. } => *fp ^= 1,
                Record::Absent => {}
            }
            for w in &mut s.workers {
                w.listed
                    .iter_mut()
                    .filter(|l| l.key as usize == i)
                    .for_each(|l| l.fp ^= 1);
            }
        }
    }
    // Workers: all alike, so they are sorted, each with the claims it holds.
    let held = |s: &State, w: u8| -> Vec<(usize, Holder)> {
        s.keys
            .iter()
            .enumerate()
            .flat_map(|(i, k)| k.holders.iter().map(move |h| (i, *h)))
            .filter(|(_, h)| h.by == By::Worker(w))
            .map(|(i, mut h)| {
                h.by = By::Worker(0);
                (i, h)
            })
            .collect()
    };
    let mut order: Vec<u8> = (0..s.workers.len() as u8).collect();
    order.sort_by_cached_key(|&w| (s.workers[w as usize].clone(), held(&s, w)));
    let workers = order
        .iter()
        .map(|&w| s.workers[w as usize].clone())
        .collect();
    s.workers = workers;
    for k in &mut s.keys {
        for h in &mut k.holders {
            if let By::Worker(w) = h.by {
                let at = order.iter().position(|&o| o == w).expect("a worker");
                h.by = By::Worker(at as u8);
            }
        }
    }
    s
}
