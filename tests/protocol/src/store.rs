//! One key's record in the store, and the store's operations on it, as the contract in
//! `src/store/mod.rs` states them (guarantees 1-11) and the memory store implements them.
//!
//! Each operation is one atomic step. Time is abstract: a lease is `live` or lapsed, and the
//! clock actions in the model lapse it or expire the record.

/// A claim's token: its generation and a nonce unique among the key's claims, so that a
/// generation repeated after an operator's force release (or an expiry) and a new first
/// claim is still another token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token {
    /// 1 for a first claim, one more for each takeover.
    pub gen: u8,
    /// The claim's number among the key's claims (1, 2, …): what a random nonce is for.
    pub nonce: u8,
}

/// A recovery point: saved under a token, at a step of the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Point {
    /// The claim that saved it.
    pub by: Token,
    /// Its step (1, 2, …) in that claim's work.
    pub step: u8,
}

/// A recorded answer: which attempt produced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Answer {
    /// The claim whose holder answered.
    pub by: Token,
    /// Recorded by a recovery worker rather than by a client's attempt.
    pub worker: bool,
}

/// A record in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InProgress {
    /// The current claim's token.
    pub token: Token,
    /// The lease holds (`false`: it lapsed, was ended by `extend(0)`, or was released).
    pub live: bool,
    /// The request's fingerprint (0 or 1): only the same request takes over.
    pub fp: u8,
    /// The last recovery point saved in this lineage since the last release.
    pub point: Option<Point>,
    /// A takeover its holder released: kept, its token fenced, its point dropped.
    pub released: bool,
}

/// What the store holds for one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Record {
    /// Never claimed, released as a first claim, removed by an operator, or expired.
    #[default]
    Absent,
    /// Claimed and not settled.
    InProgress(InProgress),
    /// Settled with an answer, which every replay of the same request (`fp`) returns.
    Completed {
        /// The answer.
        answer: Answer,
        /// The request's fingerprint.
        fp: u8,
    },
}

/// The store's answer to a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The caller holds the key now.
    Claimed {
        /// Its token.
        token: Token,
        /// It took over a lapsed claim (rather than creating the record).
        takeover: bool,
        /// On a takeover, the point the record held, handed to the new holder.
        point: Option<Point>,
    },
    /// Someone else's record: completed, or in progress and not claimable by this request.
    Existing(Record),
}

/// A stale token: the call wrote nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fenced;

impl Record {
    /// The token the store accepts writes from: the current claim's, unless released.
    pub fn holder(&self) -> Option<Token> {
        match self {
            Record::InProgress(r) if !r.released => Some(r.token),
            _ => None,
        }
    }

    /// The generation the record shows, if present.
    pub fn generation(&self) -> Option<u8> {
        match self {
            Record::Absent => None,
            Record::InProgress(r) => Some(r.token.gen),
            Record::Completed { answer, .. } => Some(answer.by.gen),
        }
    }

    /// Guarantees 1 and 2: an absent key is created (generation 1); a record in progress whose
    /// lease lapsed takes over with the same fingerprint (generation + 1, its point handed
    /// over, the old token fenced); anything else is `Existing`.
    pub fn claim(&mut self, fp: u8, nonce: u8) -> Claim {
        match self {
            Record::Absent => {
                let token = Token { gen: 1, nonce };
                *self = Record::InProgress(InProgress {
                    token,
                    live: true,
                    fp,
                    point: None,
                    released: false,
                });
                Claim::Claimed {
                    token,
                    takeover: false,
                    point: None,
                }
            }
            Record::InProgress(r) if !r.live && r.fp == fp => {
                let token = Token {
                    gen: r.token.gen + 1,
                    nonce,
                };
                r.token = token;
                r.live = true;
                r.released = false;
                Claim::Claimed {
                    token,
                    takeover: true,
                    point: r.point,
                }
            }
            other => Claim::Existing(*other),
        }
    }

    /// Whether a claim with `fp` would be `Claimed` (without making it).
    pub fn claimable(&self, fp: u8) -> bool {
        match self {
            Record::Absent => true,
            Record::InProgress(r) => !r.live && r.fp == fp,
            Record::Completed { .. } => false,
        }
    }

    /// Renews the lease (`renew`), or ends it now (`extend(0)`, the worker's give-back). A
    /// stale token is fenced.
    pub fn extend(&mut self, token: Token, renew: bool) -> Result<(), Fenced> {
        match self {
            Record::InProgress(r) if r.token == token && !r.released => {
                r.live = renew;
                Ok(())
            }
            _ => Err(Fenced),
        }
    }

    /// Saves `point`, replacing the one before; fenced like `extend` (guarantee 10).
    pub fn save(&mut self, token: Token, point: Point) -> Result<(), Fenced> {
        match self {
            Record::InProgress(r) if r.token == token && !r.released => {
                r.point = Some(point);
                Ok(())
            }
            _ => Err(Fenced),
        }
    }

    /// Records `answer` (which drops the point). Idempotent per token: a resend after a lost
    /// reply is `Ok` and writes nothing (guarantee 9). A stale token is fenced (guarantee 3).
    pub fn complete(&mut self, token: Token, answer: Answer) -> Result<(), Fenced> {
        match self {
            Record::InProgress(r) if r.token == token && !r.released => {
                let fp = r.fp;
                *self = Record::Completed { answer, fp };
                Ok(())
            }
            Record::Completed { answer, .. } if answer.by == token => Ok(()),
            _ => Err(Fenced),
        }
    }

    /// Ends the claim: a first claim's record is deleted; a takeover's is kept in progress,
    /// its lease ended, its generation kept, its point dropped (guarantee 10). Idempotent
    /// per token: an absent record, or one this token's release kept, is `Ok`.
    pub fn release(&mut self, token: Token) -> Result<(), Fenced> {
        match self {
            Record::InProgress(r) if r.token == token && !r.released => {
                if token.gen == 1 {
                    *self = Record::Absent;
                } else {
                    r.live = false;
                    r.point = None;
                    r.released = true;
                }
                Ok(())
            }
            Record::InProgress(r) if r.token == token => Ok(()),
            Record::Absent => Ok(()),
            _ => Err(Fenced),
        }
    }

    /// What `recoverable` lists: in progress, lapsed, with a point.
    pub fn recoverable(&self) -> Option<(u8, u8, Point)> {
        match self {
            Record::InProgress(r) if !r.live => r.point.map(|p| (r.token.gen, r.fp, p)),
            _ => None,
        }
    }
}
