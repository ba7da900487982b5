//! The reference model of the store contract: for one record id, every state a correct store
//! may be in, and which answers the contract allows to each call.
//!
//! Pure: no store, no clock. Time enters as [`Window`]s, the span (from the start of a
//! history) between sending a call and hearing its answer; a store acts at one instant of
//! its own clock inside it. A lease or a TTL therefore ends somewhere in a [`Deadline`]
//! interval, and where a call's window overlaps that interval the model allows both
//! outcomes (lapsed or not, expired or not) instead of guessing.
//!
//! The model is nondeterministic on purpose: a call whose answer was lost, or that timed
//! out, may or may not have taken effect, and a deadline near its end may or may not have
//! passed. [`Candidates`] keeps every state the store may be in, and each answer keeps only
//! the states that explain it. An empty set is a violation of the contract.

use std::fmt;
use std::time::Duration;

use crate::store::Removal;

/// How far a store's clock may be from the harness's: a store that reads its clock in whole
/// milliseconds (Redis) rounds, and a store's `now` may be the start of its statement.
pub(crate) const SLACK: Duration = Duration::from_millis(5);

/// When a call was in flight: sent at `sent`, answered (or given up on) at `returned`,
/// measured from the start of the history. The store acted at one instant in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) sent: Duration,
    pub(crate) returned: Duration,
}

/// A moment known to lie in `[lo, hi]` (harness time, slack included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Deadline {
    lo: Duration,
    hi: Duration,
}

/// Whether a deadline had passed when a store acted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Passed {
    Yes,
    No,
    /// The window overlaps the deadline: either.
    Maybe,
}

impl Deadline {
    /// `d` after a call made in `w`.
    pub(crate) fn after(w: Window, d: Duration) -> Self {
        Self {
            lo: (w.sent + d).saturating_sub(SLACK),
            hi: w.returned + d + SLACK,
        }
    }

    /// Whether it had passed when a call in `w` acted.
    pub(crate) fn passed(&self, w: Window) -> Passed {
        if self.hi <= w.sent {
            Passed::Yes
        } else if self.lo > w.returned {
            Passed::No
        } else {
            Passed::Maybe
        }
    }

    fn max(self, other: Self) -> Self {
        Self {
            lo: self.lo.max(other.lo),
            hi: self.hi.max(other.hi),
        }
    }
}

/// A token as the history knows it: the n-th token a `Claimed` answer gave this history.
pub(crate) type TokenId = usize;
/// A recorded answer of the history (each `complete` sends a distinct one).
pub(crate) type AnswerId = usize;
/// A recovery point of the history (each save sends a distinct one).
pub(crate) type PointId = usize;

/// Who holds (or completed, or released) a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A token the history was given.
    Known(TokenId),
    /// The token of a claim whose answer was lost: nobody the history can name.
    Unknown,
}

/// A record in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    fp: u8,
    generation: u64,
    holder: Holder,
    /// A takeover its holder released: kept, its lease ended, its token fenced.
    released: bool,
    lease: Deadline,
    expires: Deadline,
    point: Option<PointId>,
}

/// A completed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Done {
    fp: u8,
    generation: u64,
    holder: Holder,
    answer: AnswerId,
    expires: Deadline,
}

/// One state a correct store may hold for a record id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyState {
    Absent,
    InProgress(Held),
    Completed(Done),
}

/// Which token a call carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenRef {
    Known(TokenId),
    /// A token no claim ever held (a random nonce).
    Forged,
}

/// A call on one record id, as the model sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    Claim {
        fp: u8,
        lease: Duration,
        ttl: Duration,
        /// One of several claims of the key at once: a loser may report the record as it
        /// was before the winner's takeover, its lease misstated (a store may read the lease
        /// apart from the record: Redis's plain claim reads the key's `PTTL` after its
        /// `SET … NX GET`, and the lease only sets the Retry-After hint).
        racing: bool,
    },
    Extend {
        token: TokenRef,
        lease: Duration,
    },
    Complete {
        token: TokenRef,
        answer: AnswerId,
        ttl: Duration,
    },
    Release {
        token: TokenRef,
    },
    Save {
        token: TokenRef,
        point: PointId,
    },
    Get,
    ForceRelease,
    Delete,
}

/// A lease as a store reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseSeen {
    /// Time left: more than zero.
    Left,
    /// Zero: lapsed or ended.
    Zero,
}

/// Something the history cannot name (a fingerprint, answer, point or token it never sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Named<T> {
    Is(T),
    Foreign,
}

/// A record as a store reported it, in the history's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) fp: Named<u8>,
    pub(crate) generation: u64,
    pub(crate) state: SeenState,
    /// `None`: the store does not say.
    pub(crate) holder: Option<Named<TokenId>>,
    pub(crate) point: Option<Named<PointId>>,
}

/// The state of a reported record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SeenState {
    InProgress(LeaseSeen),
    Completed(Named<AnswerId>),
}

/// A store's answer, in the history's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Lost, or timed out: the call may or may not have taken effect.
    Unknown,
    Claimed {
        /// The id the history gave the new token.
        token: TokenId,
        generation: u64,
        takeover: bool,
        point: Option<Named<PointId>>,
    },
    Existing(Seen),
    Ok,
    Fenced,
    /// Any other error: never allowed here (no store in a history is full or unreachable).
    Error(String),
    Got(Option<Seen>),
    Removal(Removal),
}

/// The shape of a record the model allows a store to report.
#[derive(Debug, Clone, PartialEq, Eq)]
struct View {
    fp: u8,
    generation: u64,
    holder: Holder,
    released: bool,
    state: ViewState,
    point: Option<PointId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ViewState {
    InProgress(Passed),
    Completed(AnswerId),
}

/// An answer the model allows, and the state it leaves.
#[derive(Debug, Clone)]
enum Expect {
    /// `Claimed`; the new state's holder is the answer's token.
    Claimed {
        generation: u64,
        takeover: bool,
        point: Option<PointId>,
    },
    Existing(View),
    Ok,
    Fenced,
    Got(Option<View>),
    Removal(Removal),
}

impl fmt::Display for Expect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expect::Claimed {
                generation,
                takeover,
                point,
            } => {
                let what = if *takeover { "takeover" } else { "first claim" };
                write!(f, "Claimed ({what}, generation {generation}")?;
                match point {
                    Some(p) => write!(f, ", point p{p})"),
                    None => write!(f, ", no point)"),
                }
            }
            Expect::Existing(v) => write!(f, "Existing({v})"),
            Expect::Ok => f.write_str("Ok"),
            Expect::Fenced => f.write_str("Fenced"),
            Expect::Got(None) => f.write_str("None"),
            Expect::Got(Some(v)) => write!(f, "Some({v})"),
            Expect::Removal(r) => write!(f, "{r:?}"),
        }
    }
}

impl fmt::Display for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fp {} gen {} ", self.fp, self.generation)?;
        match &self.state {
            ViewState::InProgress(Passed::Yes) => f.write_str("in progress, lease zero")?,
            ViewState::InProgress(Passed::No) => f.write_str("in progress, lease left")?,
            ViewState::InProgress(Passed::Maybe) => f.write_str("in progress, any lease")?,
            ViewState::Completed(a) => write!(f, "completed with answer a{a}")?,
        }
        if self.released {
            f.write_str(" (released)")?;
        }
        match self.point {
            Some(p) => write!(f, ", point p{p}"),
            None => f.write_str(", no point"),
        }
    }
}

impl Held {
    fn view(&self, w: Window) -> View {
        let lease = if self.released {
            Passed::Yes
        } else {
            self.lease.passed(w)
        };
        View {
            fp: self.fp,
            generation: self.generation,
            holder: self.holder,
            released: self.released,
            state: ViewState::InProgress(lease),
            point: self.point,
        }
    }

    fn holds(&self, token: TokenRef) -> bool {
        !self.released
            && matches!((self.holder, token), (Holder::Known(a), TokenRef::Known(b)) if a == b)
    }
}

impl Done {
    fn view(&self) -> View {
        View {
            fp: self.fp,
            generation: self.generation,
            holder: self.holder,
            released: false,
            state: ViewState::Completed(self.answer),
            point: None,
        }
    }
}

fn same(holder: Holder, token: TokenRef) -> bool {
    matches!((holder, token), (Holder::Known(a), TokenRef::Known(b)) if a == b)
}

impl KeyState {
    fn expires(&self) -> Option<Deadline> {
        match self {
            KeyState::Absent => None,
            KeyState::InProgress(h) => Some(h.expires),
            KeyState::Completed(d) => Some(d.expires),
        }
    }

    /// The states the store may be in when a call in `w` acts: expired, or not.
    fn at(&self, w: Window) -> Vec<KeyState> {
        match self.expires().map(|e| e.passed(w)) {
            None | Some(Passed::No) => vec![self.clone()],
            Some(Passed::Yes) => vec![KeyState::Absent],
            Some(Passed::Maybe) => vec![self.clone(), KeyState::Absent],
        }
    }

    /// Every answer the contract allows `call` in `w` on this state, with the state it
    /// leaves. A state past its TTL must be resolved by [`at`](Self::at) first.
    fn outcomes(&self, call: &Call, w: Window) -> Vec<(Expect, KeyState)> {
        let keep = |e: Expect| vec![(e, self.clone())];
        match (call, self) {
            (Call::Claim { fp, lease, ttl, .. }, KeyState::Absent) => vec![(
                Expect::Claimed {
                    generation: 1,
                    takeover: false,
                    point: None,
                },
                KeyState::InProgress(Held {
                    fp: *fp,
                    generation: 1,
                    holder: Holder::Unknown,
                    released: false,
                    lease: Deadline::after(w, *lease),
                    expires: Deadline::after(w, (*lease).max(*ttl)),
                    point: None,
                }),
            )],
            (
                Call::Claim {
                    fp, lease, racing, ..
                },
                KeyState::InProgress(h),
            ) => {
                let lapsed = if h.released {
                    Passed::Yes
                } else {
                    h.lease.passed(w)
                };
                let mut out = Vec::new();
                if h.fp == *fp && lapsed != Passed::No {
                    let new_lease = Deadline::after(w, *lease);
                    out.push((
                        Expect::Claimed {
                            generation: h.generation + 1,
                            takeover: true,
                            point: h.point,
                        },
                        KeyState::InProgress(Held {
                            fp: h.fp,
                            generation: h.generation + 1,
                            holder: Holder::Unknown,
                            released: false,
                            lease: new_lease,
                            expires: h.expires.max(new_lease),
                            point: h.point,
                        }),
                    ));
                }
                if *racing {
                    let mut view = h.view(w);
                    view.state = ViewState::InProgress(Passed::Maybe);
                    out.push((Expect::Existing(view), self.clone()));
                } else if h.fp != *fp || lapsed != Passed::Yes {
                    let mut view = h.view(w);
                    if h.fp == *fp {
                        // The same request found it held: its lease had time left.
                        view.state = ViewState::InProgress(Passed::No);
                    }
                    out.push((Expect::Existing(view), self.clone()));
                }
                out
            }
            (Call::Claim { .. }, KeyState::Completed(d)) => keep(Expect::Existing(d.view())),

            (Call::Extend { token, lease }, KeyState::InProgress(h)) if h.holds(*token) => {
                let new_lease = Deadline::after(w, *lease);
                let mut next = h.clone();
                next.lease = new_lease;
                next.expires = h.expires.max(new_lease);
                vec![(Expect::Ok, KeyState::InProgress(next))]
            }
            (Call::Extend { .. }, _) => keep(Expect::Fenced),

            (Call::Complete { token, answer, ttl }, KeyState::InProgress(h)) if h.holds(*token) => {
                vec![(
                    Expect::Ok,
                    KeyState::Completed(Done {
                        fp: h.fp,
                        generation: h.generation,
                        holder: h.holder,
                        answer: *answer,
                        expires: Deadline::after(w, *ttl),
                    }),
                )]
            }
            // A resend of the complete that recorded it: Ok, and the first answer stands.
            (Call::Complete { token, .. }, KeyState::Completed(d)) if same(d.holder, *token) => {
                keep(Expect::Ok)
            }
            (Call::Complete { .. }, _) => keep(Expect::Fenced),

            // The key is free, which is all a release asks for.
            (Call::Release { .. }, KeyState::Absent) => keep(Expect::Ok),
            (Call::Release { token }, KeyState::InProgress(h)) if h.holds(*token) => {
                if h.generation == 1 {
                    vec![(Expect::Ok, KeyState::Absent)]
                } else {
                    let mut next = h.clone();
                    next.released = true;
                    next.lease = Deadline::after(w, Duration::ZERO);
                    next.point = None;
                    vec![(Expect::Ok, KeyState::InProgress(next))]
                }
            }
            // A resend of the release that kept it.
            (Call::Release { token }, KeyState::InProgress(h))
                if h.released && same(h.holder, *token) =>
            {
                keep(Expect::Ok)
            }
            (Call::Release { .. }, _) => keep(Expect::Fenced),

            (Call::Save { token, point }, KeyState::InProgress(h)) if h.holds(*token) => {
                let mut next = h.clone();
                next.point = Some(*point);
                vec![(Expect::Ok, KeyState::InProgress(next))]
            }
            (Call::Save { .. }, _) => keep(Expect::Fenced),

            (Call::Get, KeyState::Absent) => keep(Expect::Got(None)),
            (Call::Get, KeyState::InProgress(h)) => keep(Expect::Got(Some(h.view(w)))),
            (Call::Get, KeyState::Completed(d)) => keep(Expect::Got(Some(d.view()))),

            (Call::ForceRelease | Call::Delete, KeyState::Absent) => {
                keep(Expect::Removal(Removal::Absent))
            }
            (Call::ForceRelease, KeyState::InProgress(_))
            | (Call::Delete, KeyState::Completed(_)) => {
                vec![(Expect::Removal(Removal::Removed), KeyState::Absent)]
            }
            (Call::ForceRelease, KeyState::Completed(_))
            | (Call::Delete, KeyState::InProgress(_)) => keep(Expect::Removal(Removal::Refused)),
        }
    }
}

impl View {
    /// Whether a store's report `seen` is this view, and if not, why.
    fn check(&self, seen: &Seen) -> Result<(), String> {
        if seen.fp != Named::Is(self.fp) {
            return Err(format!("fingerprint {:?}, not fp {}", seen.fp, self.fp));
        }
        if seen.generation != self.generation {
            return Err(format!(
                "generation {}, not {}",
                seen.generation, self.generation
            ));
        }
        match (&self.state, &seen.state) {
            (ViewState::InProgress(lapsed), SeenState::InProgress(lease)) => {
                match (lapsed, lease) {
                    (Passed::Yes, LeaseSeen::Left) => {
                        return Err("a lease with time left, after it lapsed or ended".into())
                    }
                    (Passed::No, LeaseSeen::Zero) => {
                        return Err("no lease left, while it was live".into())
                    }
                    _ => {}
                }
            }
            (ViewState::Completed(a), SeenState::Completed(b)) => {
                if *b != Named::Is(*a) {
                    return Err(format!("answer {b:?}, not a{a}"));
                }
            }
            (ViewState::InProgress(_), SeenState::Completed(_)) => {
                return Err("completed, while in progress".into())
            }
            (ViewState::Completed(_), SeenState::InProgress(_)) => {
                return Err("in progress, while completed".into())
            }
        }
        let point_seen = seen.point.map(|p| match p {
            Named::Is(p) => Some(p),
            Named::Foreign => None,
        });
        if point_seen != self.point.map(Some) {
            return Err(format!(
                "recovery point {:?}, not {:?}",
                seen.point, self.point
            ));
        }
        match (seen.holder, self.holder, self.released) {
            (None, _, _) => {}
            // The contract does not say what a released record names as its holder: it may
            // still name the token it was released with (the `store` module's example
            // does), which stays fenced all the same.
            (Some(Named::Is(t)), Holder::Known(h), true) if t == h => {}
            (Some(seen), Holder::Known(t), false) if seen != Named::Is(t) => {
                return Err(format!("holder {seen:?}, not the token t{t}"))
            }
            // The released token, or one from a lost claim: no token the history holds.
            (Some(Named::Is(t)), Holder::Unknown, _) | (Some(Named::Is(t)), _, true) => {
                return Err(format!("holder t{t}, which no longer holds it"))
            }
            _ => {}
        }
        Ok(())
    }
}

impl Expect {
    /// The state `next` leaves when `answer` is this expectation, or why it is not.
    fn accept(&self, answer: &Answer, next: &KeyState) -> Result<KeyState, String> {
        match (self, answer) {
            (
                Expect::Claimed {
                    generation,
                    takeover,
                    point,
                },
                Answer::Claimed {
                    token,
                    generation: g,
                    takeover: t,
                    point: p,
                },
            ) => {
                if g != generation || t != takeover {
                    return Err(format!("generation {g}, takeover {t}"));
                }
                if *p != point.map(Named::Is) {
                    return Err(format!("handed point {p:?}"));
                }
                let KeyState::InProgress(mut held) = next.clone() else {
                    unreachable!("a claim leaves a record in progress")
                };
                held.holder = Holder::Known(*token);
                Ok(KeyState::InProgress(held))
            }
            (Expect::Existing(v), Answer::Existing(seen)) => v.check(seen).map(|()| next.clone()),
            (Expect::Got(None), Answer::Got(None)) => Ok(next.clone()),
            (Expect::Got(Some(v)), Answer::Got(Some(seen))) => v.check(seen).map(|()| next.clone()),
            (Expect::Ok, Answer::Ok) | (Expect::Fenced, Answer::Fenced) => Ok(next.clone()),
            (Expect::Removal(a), Answer::Removal(b)) if a == b => Ok(next.clone()),
            _ => Err("another answer".into()),
        }
    }
}

/// Every state one record id may be in, given what the history has seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidates(Vec<KeyState>);

impl Default for Candidates {
    fn default() -> Self {
        Self(vec![KeyState::Absent])
    }
}

impl Candidates {
    /// Applies `call`, made in `w` and answered `answer`. `Err` says what the model allowed.
    pub(crate) fn apply(&mut self, call: &Call, w: Window, answer: &Answer) -> Result<(), String> {
        let mut next: Vec<KeyState> = Vec::new();
        let mut allowed: Vec<String> = Vec::new();
        let push = |s: KeyState, next: &mut Vec<KeyState>| {
            if !next.contains(&s) {
                next.push(s);
            }
        };
        for state in &self.0 {
            for now in state.at(w) {
                let outcomes = now.outcomes(call, w);
                if *answer == Answer::Unknown {
                    // Lost or timed out: it took effect, or it did not.
                    push(now.clone(), &mut next);
                    for (_, s) in outcomes {
                        push(s, &mut next);
                    }
                    continue;
                }
                for (expect, s) in outcomes {
                    match expect.accept(answer, &s) {
                        Ok(s) => push(s, &mut next),
                        Err(why) => {
                            let line = format!("{expect} [here: {why}]");
                            if !allowed.contains(&line) {
                                allowed.push(line);
                            }
                        }
                    }
                }
            }
        }
        if next.is_empty() {
            return Err(format!("the model allows only: {}", allowed.join("; or ")));
        }
        self.0 = next;
        Ok(())
    }

    /// Keeps the states in which `recoverable`, called in `w`, may list this id as `seen`:
    /// in progress, not released, its lease lapsed, holding the point it reports.
    pub(crate) fn listed(&mut self, w: Window, seen: &Seen) -> Result<(), String> {
        let mut next = Vec::new();
        let mut why = Vec::new();
        for state in &self.0 {
            for now in state.at(w) {
                let KeyState::InProgress(h) = &now else {
                    why.push("it is not in progress".to_owned());
                    continue;
                };
                let mut view = h.view(w);
                if h.released || h.point.is_none() || h.lease.passed(w) == Passed::No {
                    why.push(format!("it is {view}"));
                    continue;
                }
                view.state = ViewState::InProgress(Passed::Maybe);
                match view.check(seen) {
                    Ok(()) if !next.contains(&now) => next.push(now),
                    Ok(()) => {}
                    Err(e) => why.push(e),
                }
            }
        }
        if next.is_empty() {
            return Err(format!("listed as recoverable, but {}", why.join("; or ")));
        }
        self.0 = next;
        Ok(())
    }

    /// Adds the states of `other` (another order of concurrent calls).
    pub(crate) fn merge(&mut self, other: Candidates) {
        for s in other.0 {
            if !self.0.contains(&s) {
                self.0.push(s);
            }
        }
    }

    /// How many states are still possible.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(ms: u64) -> Window {
        Window {
            sent: Duration::from_millis(ms),
            returned: Duration::from_millis(ms + 1),
        }
    }

    const SHORT: Duration = Duration::from_millis(5);
    const LONG: Duration = Duration::from_secs(60);

    fn claim(fp: u8, lease: Duration) -> Call {
        Call::Claim {
            fp,
            lease,
            ttl: LONG,
            racing: false,
        }
    }

    fn claimed(token: TokenId, generation: u64, takeover: bool) -> Answer {
        Answer::Claimed {
            token,
            generation,
            takeover,
            point: None,
        }
    }

    #[test]
    fn a_token_three_generations_back_is_fenced() {
        let mut m = Candidates::default();
        m.apply(&claim(1, SHORT), w(0), &claimed(0, 1, false))
            .unwrap();
        m.apply(&claim(1, SHORT), w(100), &claimed(1, 2, true))
            .unwrap();
        m.apply(&claim(1, SHORT), w(200), &claimed(2, 3, true))
            .unwrap();
        m.apply(&claim(1, LONG), w(300), &claimed(3, 4, true))
            .unwrap();
        let stale = Call::Complete {
            token: TokenRef::Known(0),
            answer: 0,
            ttl: LONG,
        };
        assert!(m.apply(&stale, w(301), &Answer::Ok).is_err());
        m.apply(&stale, w(301), &Answer::Fenced).unwrap();
    }

    #[test]
    fn a_lease_near_its_end_allows_both_answers() {
        let mut m = Candidates::default();
        m.apply(&claim(1, SHORT), w(0), &claimed(0, 1, false))
            .unwrap();
        let mut lapsed = m.clone();
        lapsed
            .apply(&claim(1, SHORT), w(4), &claimed(1, 2, true))
            .unwrap();
        let seen = Seen {
            fp: Named::Is(1),
            generation: 1,
            state: SeenState::InProgress(LeaseSeen::Left),
            holder: None,
            point: None,
        };
        m.apply(&claim(1, SHORT), w(4), &Answer::Existing(seen))
            .unwrap();
    }

    #[test]
    fn a_lost_complete_leaves_either_state_and_its_resend_is_ok() {
        let mut m = Candidates::default();
        m.apply(&claim(1, LONG), w(0), &claimed(0, 1, false))
            .unwrap();
        let complete = Call::Complete {
            token: TokenRef::Known(0),
            answer: 0,
            ttl: LONG,
        };
        m.apply(&complete, w(1), &Answer::Unknown).unwrap();
        assert_eq!(m.len(), 2);
        m.apply(&complete, w(2), &Answer::Ok).unwrap();
        assert!(m.apply(&complete, w(3), &Answer::Fenced).is_err());
    }

    #[test]
    fn a_released_takeover_keeps_its_generation_but_not_its_point() {
        let mut m = Candidates::default();
        m.apply(&claim(1, SHORT), w(0), &claimed(0, 1, false))
            .unwrap();
        m.apply(&claim(1, LONG), w(100), &claimed(1, 2, true))
            .unwrap();
        let save = Call::Save {
            token: TokenRef::Known(1),
            point: 0,
        };
        m.apply(&save, w(101), &Answer::Ok).unwrap();
        let release = Call::Release {
            token: TokenRef::Known(1),
        };
        m.apply(&release, w(102), &Answer::Ok).unwrap();
        let handed = Answer::Claimed {
            token: 2,
            generation: 3,
            takeover: true,
            point: Some(Named::Is(0)),
        };
        assert!(m.clone().apply(&claim(1, LONG), w(103), &handed).is_err());
        assert!(m
            .clone()
            .apply(&claim(1, LONG), w(103), &claimed(2, 1, false))
            .is_err());
        m.apply(&claim(1, LONG), w(103), &claimed(2, 3, true))
            .unwrap();
    }
}
