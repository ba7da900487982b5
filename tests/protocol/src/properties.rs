//! What the checker holds the protocol to (`always`), and what it must be able to reach
//! (`sometimes`), so that the model is not vacuous.
//!
//! A property that is about a step (a write, a claim, a replay) is checked in the step and
//! kept in the state's ghost [`Broken`] bits; the others are read from the state itself.

use stateright::Property;

use crate::store::Record;
use crate::{Bounds, By, Phase, Protocol, State};

/// Ghost bits a step sets when it breaks a property.
#[derive(Debug)]
pub struct Broken;

impl Broken {
    /// A holder whose token the record no longer accepts changed the record.
    pub const FENCED_WROTE: u16 = 1;
    /// A replay returned another answer than the first one recorded.
    pub const REPLAY_DIFFERS: u16 = 1 << 1;
    /// A completed record became something else than itself or absent.
    pub const OVERWRITTEN: u16 = 1 << 2;
    /// An actor started the work from a point not saved in the key's current lineage since
    /// its last release.
    pub const STALE_POINT: u16 = 1 << 3;
    /// A claim took over a record whose lease was live.
    pub const TOOK_LIVE: u16 = 1 << 4;
    /// A present record's generation went down.
    pub const GENERATION_SHRANK: u16 = 1 << 5;
}

/// Two holders of a key in the work at once: the older one is fenced.
pub const ONE_LIVE_HOLDER: &str =
    "no two holders of a key run the work at once unless the older one is fenced";
/// A fenced holder's writes change nothing.
pub const FENCED_CHANGES_NOTHING: &str =
    "a fenced holder never changes the record, whatever the generation gap";
/// Replays return the first answer.
pub const REPLAY_IS_FIRST: &str = "every replay is the first recorded answer";
/// A completed record stays as it is.
pub const NEVER_OVERWRITTEN: &str = "a completed record is never overwritten";
/// Resumption only from the current lineage.
pub const CURRENT_LINEAGE: &str =
    "a takeover or a worker resumes only from a point of the current lineage";
/// The worker's cap.
pub const WITHIN_CAP: &str = "the worker never passes the attempt cap";
/// The worker and absent keys.
pub const NO_RECREATION: &str = "the worker never recreates an absent key";
/// Claims of live leases.
pub const NEVER_TAKES_LIVE: &str =
    "no claim, the worker's included, takes what a live holder holds";
/// Generations.
pub const GENERATION_GROWS: &str = "within retention a key's generation only grows";

/// Every property of the model under `bounds`.
pub fn all(bounds: &Bounds) -> Vec<Property<Protocol>> {
    let mut all = vec![
        Property::<Protocol>::always(ONE_LIVE_HOLDER, |_, s| one_live_holder(s)),
        Property::<Protocol>::always(FENCED_CHANGES_NOTHING, |_, s| {
            s.broken & Broken::FENCED_WROTE == 0
        }),
        Property::<Protocol>::always(REPLAY_IS_FIRST, |_, s| {
            s.broken & Broken::REPLAY_DIFFERS == 0
        }),
        Property::<Protocol>::always(NEVER_OVERWRITTEN, |_, s| {
            s.broken & Broken::OVERWRITTEN == 0
        }),
        Property::<Protocol>::always(CURRENT_LINEAGE, |_, s| s.broken & Broken::STALE_POINT == 0),
        Property::<Protocol>::always(WITHIN_CAP, |m, s| {
            workers_running(s).all(|h| h.token.gen <= m.bounds.cap)
        }),
        Property::<Protocol>::always(NO_RECREATION, |_, s| workers_running(s).all(|h| !h.first)),
        Property::<Protocol>::always(NEVER_TAKES_LIVE, |_, s| s.broken & Broken::TOOK_LIVE == 0),
        Property::<Protocol>::always(GENERATION_GROWS, |_, s| {
            s.broken & Broken::GENERATION_SHRANK == 0
        }),
        // Reachable, so that the properties above are not vacuous.
        Property::<Protocol>::sometimes("a worker recovers a record", |_, s| {
            s.keys
                .iter()
                .any(|k| matches!(k.record, Record::Completed { answer, .. } if answer.worker))
        }),
        Property::<Protocol>::sometimes("a client's retry takes over a lapsed claim", |_, s| {
            s.keys.iter().any(|k| {
                k.holders
                    .iter()
                    .any(|h| h.by == By::Client && !h.first && h.phase == Phase::Running)
            })
        }),
        Property::<Protocol>::sometimes(
            "a takeover holds the point its predecessor saved",
            |_, s| {
                s.keys.iter().any(|k| {
                    matches!(k.record, Record::InProgress(r)
                    if !r.released && r.point.is_some_and(|p| p.by.gen < r.token.gen))
                })
            },
        ),
        Property::<Protocol>::sometimes("a released takeover keeps its record", |_, s| {
            s.keys
                .iter()
                .any(|k| matches!(k.record, Record::InProgress(r) if r.released))
        }),
        Property::<Protocol>::sometimes("a worker gives a claim back", |_, s| {
            s.keys
                .iter()
                .any(|k| k.holders.iter().any(|h| h.phase == Phase::GivingBack))
        }),
        Property::<Protocol>::sometimes("a holder two generations behind goes on", |_, s| {
            s.keys.iter().any(|k| {
                k.holders.iter().any(|h| {
                    h.phase == Phase::Running
                        && k.record.generation().is_some_and(|g| g >= h.token.gen + 2)
                })
            })
        }),
    ];
    if bounds.lost_replies {
        all.push(Property::<Protocol>::sometimes(
            "a complete whose reply was lost is sent again",
            |_, s| {
                s.keys
                    .iter()
                    .any(|k| k.holders.iter().any(|h| h.phase == Phase::Completing))
            },
        ));
    }
    if bounds.keys > 1 {
        all.push(Property::<Protocol>::sometimes(
            "a worker recovers one key while its listing of another ages",
            |_, s| {
                s.workers.iter().enumerate().any(|(w, worker)| {
                    !worker.listed.is_empty()
                        && s.keys.iter().any(|k| {
                            k.holders
                                .iter()
                                .any(|h| h.by == By::Worker(w as u8) && h.phase == Phase::Running)
                        })
                })
            },
        ));
    }
    all
}

/// Among a key's holders in the work (running or paused), every one but the newest is fenced.
fn one_live_holder(s: &State) -> bool {
    s.keys.iter().all(|k| {
        let mut working = k.holders.iter().filter(|h| h.in_the_work()).rev();
        let _newest = working.next();
        working.all(|older| k.record.holder() != Some(older.token))
    })
}

/// Holders started by a worker that run (or ran) the recovery.
fn workers_running(s: &State) -> impl Iterator<Item = &crate::Holder> {
    s.keys.iter().flat_map(|k| {
        k.holders
            .iter()
            .filter(|h| matches!(h.by, By::Worker(_)) && h.phase != Phase::GivingBack)
    })
}
