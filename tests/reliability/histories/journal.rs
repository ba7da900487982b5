//! The journal of a layer history: every store call of the history, in the order the store
//! applied it, against the protocol. It keeps each key's record as the store's answers say
//! it is (holder, generation, point, recorded answer, a released takeover's kept history)
//! and flags any answer the protocol forbids: a takeover before the lease ended or handing
//! over a point the lineage did not save last, a write by a holder that no longer holds the
//! key, an answer overwritten, an operator call answered against the record's state.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tower_idempotency::store::{
    async_trait, AdminStore, ClaimOutcome, ClaimRequest, Completion, Fingerprint, IdempotencyAdmin,
    IdempotencyStore, Record, RecordId, RecordInfo, RecoveryPoint, Removal, StoreError, Token,
};

use super::{Stats, SLACK};

/// A point as the journal keeps it: step and data.
pub(super) type Point = (String, Bytes);

pub(super) fn point_of(p: &RecoveryPoint) -> Point {
    (p.step().to_owned(), p.data().clone())
}

/// A key's record as the store's answers say it is.
#[derive(Clone, Debug)]
pub(super) struct Present {
    pub(super) fingerprint: Fingerprint,
    pub(super) holder: Token,
    /// The answer recorded, by which claim.
    pub(super) completed: Option<(Token, Completion)>,
    pub(super) point: Option<Point>,
    /// Released by a takeover: kept, lapsed and without its point, so the next claim
    /// takes over from it (the key's history stays).
    pub(super) released: bool,
}

#[derive(Default)]
pub(super) struct KeyModel {
    /// Counts every change of `present`.
    pub(super) version: u64,
    pub(super) present: Option<Present>,
    /// The claim whose release emptied the key last (a resent release succeeds again).
    pub(super) released_by: Option<Token>,
}

/// One claim the store granted.
pub(super) struct Holder {
    pub(super) takeover: bool,
    pub(super) handed: Option<Point>,
    /// When the last grant of its lease (claim or renewal) was sent, or earlier when it was
    /// given back (extended by zero).
    pub(super) granted: Instant,
    /// A later claim took the key over, or an operator removed the record.
    pub(super) superseded: bool,
    pub(super) by_operator: bool,
    /// One of its store calls failed or was abandoned: it could not reach the store.
    pub(super) cut_off: bool,
}

#[derive(Default)]
pub(super) struct Model {
    pub(super) names: HashMap<RecordId, String>,
    pub(super) keys: HashMap<RecordId, KeyModel>,
    pub(super) holders: HashMap<Token, Holder>,
    /// Keys with a store call whose outcome is unknown (abandoned mid-flight, or an error):
    /// the checks that need the exact state skip them from then on.
    pub(super) uncertain: HashSet<RecordId>,
    pub(super) violations: Vec<String>,
    pub(super) stats: Stats,
}

impl Model {
    pub(super) fn name(&self, id: &RecordId) -> String {
        self.names.get(id).cloned().unwrap_or_else(|| "?".into())
    }

    pub(super) fn flag(&mut self, id: &RecordId, what: impl fmt::Display) {
        if !self.uncertain.contains(id) {
            let name = self.name(id);
            self.violations.push(format!("key {name}: {what}"));
        }
    }

    /// Whether `token` holds `id` now, in progress.
    pub(super) fn holds(&self, id: &RecordId, token: &Token) -> bool {
        self.keys
            .get(id)
            .and_then(|k| k.present.as_ref())
            .is_some_and(|p| p.holder == *token && p.completed.is_none() && !p.released)
    }

    pub(super) fn stale_write(&mut self, id: &RecordId, token: &Token, op: &str) {
        if !self.holds(id, token) {
            let gen = token.generation();
            self.flag(
                id,
                format!("{op} by generation {gen}, which no longer holds the key, took effect"),
            );
        }
    }
}

/// What [`Journal::snapshot`] tells about a key.
#[derive(Clone, Debug)]
pub(super) struct Snapshot {
    pub(super) version: u64,
    pub(super) present: Option<Present>,
    pub(super) uncertain: bool,
}

/// The store of a history: the backend's real store, with every call journaled.
pub(super) struct Journal {
    pub(super) inner: Arc<dyn AdminStore>,
    pub(super) lease: Duration,
    /// Orders the calls: the journal sees them in the order the store applied them.
    pub(super) order: tokio::sync::Mutex<()>,
    pub(super) model: Mutex<Model>,
    /// The listing `List` took, for the next sweep.
    pub(super) aged: Mutex<Option<Vec<(RecordId, Record)>>>,
}

/// Marks a key uncertain when its call is dropped before it returned (a deadline).
pub(super) struct Pending<'a> {
    pub(super) journal: &'a Journal,
    pub(super) id: RecordId,
    pub(super) armed: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut m = self.journal.model();
            m.uncertain.insert(self.id);
            m.stats.abandoned_calls += 1;
        }
    }
}

impl Journal {
    pub(super) fn new(
        inner: Arc<dyn AdminStore>,
        lease: Duration,
        names: &[(RecordId, String)],
    ) -> Self {
        let model = Model {
            names: names.iter().cloned().collect(),
            ..Model::default()
        };
        Self {
            inner,
            lease,
            order: tokio::sync::Mutex::new(()),
            model: Mutex::new(model),
            aged: Mutex::new(None),
        }
    }

    pub(super) fn model(&self) -> MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn tracked(&self, id: &RecordId) -> bool {
        self.model().names.contains_key(id)
    }

    pub(super) fn snapshot(&self, id: &RecordId) -> Snapshot {
        let m = self.model();
        let k = m.keys.get(id);
        Snapshot {
            version: k.map_or(0, |k| k.version),
            present: k.and_then(|k| k.present.clone()),
            uncertain: m.uncertain.contains(id),
        }
    }

    /// Runs one store call of `id` in order, then `then` on the model with its answer, sent
    /// at `start` (once the call was the next in order).
    pub(super) async fn call<T>(
        &self,
        id: &RecordId,
        token: Option<&Token>,
        fut: impl Future<Output = Result<T, StoreError>>,
        then: impl FnOnce(&mut Model, &T, Instant),
    ) -> Result<T, StoreError> {
        if !self.tracked(id) {
            return fut.await;
        }
        let _order = self.order.lock().await;
        let mut pending = Pending {
            journal: self,
            id: *id,
            armed: true,
        };
        let start = Instant::now();
        let out = fut.await;
        pending.armed = false;
        let mut m = self.model();
        match &out {
            Ok(v) => then(&mut m, v, start),
            Err(e) if e.is_fenced() => m.stats.fenced += 1,
            Err(_) => {
                m.uncertain.insert(*id);
                if let Some(h) = token.and_then(|t| m.holders.get_mut(t)) {
                    h.cut_off = true;
                }
            }
        }
        out
    }

    /// The `List` event: the worker's next sweep gets this listing, however old it is then.
    pub(super) async fn list_now(&self) {
        if let Ok(found) = self.inner.recoverable(100).await {
            let m = self.model();
            let ours = found
                .into_iter()
                .filter(|(id, _)| m.names.contains_key(id))
                .collect();
            drop(m);
            *self.aged.lock().unwrap() = Some(ours);
        }
    }
}

#[async_trait]
impl IdempotencyStore for Journal {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let id = *request.id;
        let fingerprint = *request.fingerprint;
        let lease = self.lease;
        self.call(&id, None, self.inner.claim(request), |m, out, sent| {
            let ClaimOutcome::Claimed(claim) = out else {
                return;
            };
            let token = claim.token;
            let handed = claim.recovery_point.as_ref().map(point_of);
            let k = m.keys.entry(id).or_default();
            let before = k.present.clone();
            k.version += 1;
            k.present = Some(Present {
                fingerprint,
                holder: token,
                completed: None,
                point: None,
                released: false,
            });
            let mut problems = Vec::new();
            if claim.takeover {
                match before {
                    Some(p) if p.completed.is_none() => {
                        if p.released && handed.is_some() {
                            problems.push(format!(
                                "a takeover of a released attempt handed over {handed:?}, a point the release dropped"
                            ));
                        }
                        if p.fingerprint != fingerprint {
                            problems.push("a takeover by another request's fingerprint".into());
                        }
                        if token.generation() <= p.holder.generation() {
                            problems.push(format!(
                                "a takeover at generation {} over generation {}",
                                token.generation(),
                                p.holder.generation()
                            ));
                        }
                        if handed != p.point {
                            problems.push(format!(
                                "a takeover handed over {handed:?}, not the lineage's point {:?}",
                                p.point
                            ));
                        }
                        if let Some(old) = m.holders.get_mut(&p.holder) {
                            old.superseded = true;
                            if sent + SLACK < old.granted + lease {
                                problems.push(format!(
                                    "generation {} was taken over {:?} before its lease ended",
                                    p.holder.generation(),
                                    (old.granted + lease) - sent
                                ));
                            }
                        }
                        if let Some(k) = m.keys.get_mut(&id) {
                            k.present.as_mut().unwrap().point = p.point;
                        }
                    }
                    other => problems.push(format!("a takeover of {other:?}")),
                }
                m.stats.takeovers += 1;
            } else if let Some(p) = before {
                problems.push(format!("a first claim over a record {p:?}"));
            }
            m.holders.insert(
                token,
                Holder {
                    takeover: claim.takeover,
                    handed,
                    granted: sent,
                    superseded: false,
                    by_operator: false,
                    cut_off: false,
                },
            );
            for p in problems {
                m.flag(&id, p);
            }
        })
        .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let full = self.lease;
        let call = self.inner.extend(id, token, lease);
        self.call(id, Some(token), call, |m, (), sent| {
            m.stale_write(id, token, "a renewal");
            if let Some(h) = m.holders.get_mut(token) {
                // Given back (zero): lapsed as of now.
                h.granted = if lease.is_zero() {
                    sent.checked_sub(full).unwrap_or(sent)
                } else {
                    sent
                };
            }
        })
        .await
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let call = self.inner.complete(id, token, completion, ttl);
        self.call(id, Some(token), call, |m, (), _| {
            let present = m.keys.get(id).and_then(|k| k.present.clone());
            match present.as_ref().and_then(|p| p.completed.clone()) {
                // A resend of a complete that took effect.
                Some((by, _)) if by == *token => return,
                Some((by, _)) => {
                    let what = format!(
                        "generation {} overwrote the answer generation {} recorded",
                        token.generation(),
                        by.generation()
                    );
                    m.flag(id, what);
                    return;
                }
                None => {}
            }
            m.stale_write(id, token, "a complete");
            let k = m.keys.entry(*id).or_default();
            k.version += 1;
            if let Some(p) = k.present.as_mut() {
                p.completed = Some((*token, completion.clone()));
                p.point = None;
            }
            m.stats.recorded += 1;
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let lease = self.lease;
        let call = self.inner.release(id, token);
        self.call(id, Some(token), call, |m, (), sent| {
            let k = m.keys.entry(*id).or_default();
            let kept = k.present.as_ref().is_none_or(|p| p.released);
            // A resend of a release that took effect, or a key gone: nothing to free.
            if (k.released_by == Some(*token) && kept) || k.present.is_none() {
                return;
            }
            m.stale_write(id, token, "a release");
            let k = m.keys.entry(*id).or_default();
            k.version += 1;
            k.released_by = Some(*token);
            if token.generation() == 1 {
                k.present = None;
            } else if let Some(p) = k.present.as_mut() {
                p.released = true;
                p.point = None;
                if let Some(h) = m.holders.get_mut(token) {
                    h.granted = sent.checked_sub(lease).unwrap_or(sent);
                }
            }
        })
        .await
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        let call = self.inner.save_recovery_point(id, token, point);
        self.call(id, Some(token), call, |m, (), _| {
            m.stale_write(id, token, "a recovery point save");
            if let Some(p) = m.keys.get_mut(id).and_then(|k| k.present.as_mut()) {
                p.point = Some(point_of(point));
            }
        })
        .await
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        let aged = self.aged.lock().unwrap().take();
        if let Some(listed) = aged {
            return Ok(listed);
        }
        let found = self.inner.recoverable(limit).await?;
        let m = self.model();
        Ok(found
            .into_iter()
            .filter(|(id, _)| m.names.contains_key(id))
            .collect())
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}

#[async_trait]
impl IdempotencyAdmin for Journal {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.inspect(id).await
    }

    async fn force_release(&self, id: &RecordId) -> Result<Removal, StoreError> {
        self.call(id, None, self.inner.force_release(id), |m, removal, _| {
            let present = m.keys.get(id).and_then(|k| k.present.clone());
            let expected = match &present {
                None => Removal::Absent,
                Some(p) if p.completed.is_some() => Removal::Refused,
                Some(_) => Removal::Removed,
            };
            if *removal != expected {
                m.flag(
                    id,
                    format!("force_release answered {removal:?} for {present:?}"),
                );
            }
            if *removal == Removal::Removed {
                if let Some(h) = present.and_then(|p| m.holders.get_mut(&p.holder)) {
                    h.superseded = true;
                    h.by_operator = true;
                }
                let k = m.keys.entry(*id).or_default();
                k.version += 1;
                k.present = None;
                k.released_by = None;
            }
        })
        .await
    }

    async fn delete(&self, id: &RecordId) -> Result<Removal, StoreError> {
        self.call(id, None, self.inner.delete(id), |m, removal, _| {
            let present = m.keys.get(id).and_then(|k| k.present.clone());
            let expected = match &present {
                None => Removal::Absent,
                Some(p) if p.completed.is_some() => Removal::Removed,
                Some(_) => Removal::Refused,
            };
            if *removal != expected {
                m.flag(id, format!("delete answered {removal:?} for {present:?}"));
            }
            if *removal == Removal::Removed {
                let k = m.keys.entry(*id).or_default();
                k.version += 1;
                k.present = None;
                k.released_by = None;
            }
        })
        .await
    }
}
