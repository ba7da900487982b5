//! Steps 7 and 8's store calls: the lease renewals while the work runs, then the record or
//! the release. Each call is bounded by the store deadline, and the record and release are
//! retried while the lease lives; none of them can hold the answer past the lease.

use std::time::Duration;

use tokio::time::Instant;

use super::deadline::{bounded, deadline, retry_until, Lease};
use super::{Chain, Keyed};
use crate::metrics::{timed, Event};
use crate::store::record::{Completion, RecordState, Token};
use crate::store::StoreError;
use std::any::Any;

impl Keyed {
    /// Records, retrying while the lease lives; then the caller answers anyway.
    pub(super) async fn complete(&self, token: &Token, completion: &Completion, lease: &Lease) {
        let cfg = &*self.flow.cfg;
        let (store, ttl) = (&*cfg.store, cfg.timing.ttl());
        let result = retry_until(lease.end(), lease.timeout, || {
            let call = store.complete(&self.id, token, completion, ttl);
            timed(self.flow.labels.store_call("complete"), call)
        })
        .await;
        match result {
            Ok(()) => self.flow.labels.event(Event::Recorded),
            // A complete this token made already is `Ok`: fenced means another attempt (or
            // an operator) has the key now.
            Err(e) if e.is_fenced() => {
                self.flow.labels.event(Event::Fenced);
                tracing::error!(error = %Chain(&e), "idempotency record fenced: this attempt's lease lapsed and another attempt took the key over (or an operator released it); this answer was not recorded, and retries get what that attempt records");
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), "idempotency record failed until the lease ran out; the answer goes to the client unrecorded and the key stays in progress until its lease lapses")
            }
        }
    }

    /// One release attempt under the store deadline, before a released answer goes out.
    /// `Err` when it did not take effect for certain (fenced is final, and counts as done).
    pub(super) async fn release_once(
        &self,
        token: &Token,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let store = &*self.flow.cfg.store;
        let call = timed(
            self.flow.labels.store_call("release"),
            store.release(&self.id, token),
        );
        match bounded(deadline(Instant::now(), timeout), call).await {
            Err(e) if e.is_fenced() => {
                self.released_fenced(&e);
                Ok(())
            }
            other => other,
        }
    }

    /// Releases, retrying while the lease lives; a failed release lapses with the lease.
    pub(super) async fn release(&self, token: &Token, lease: &Lease) {
        let store = &*self.flow.cfg.store;
        let result = retry_until(lease.end(), lease.timeout, || {
            timed(
                self.flow.labels.store_call("release"),
                store.release(&self.id, token),
            )
        })
        .await;
        match result {
            Ok(()) => {}
            Err(e) if e.is_fenced() => self.released_fenced(&e),
            Err(e) => {
                tracing::error!(error = %Chain(&e), "idempotency release failed until the lease ran out; the key stays claimed in the store until its lease lapses there, then a retry takes it over")
            }
        }
    }

    fn released_fenced(&self, e: &StoreError) {
        self.flow.labels.event(Event::Fenced);
        tracing::error!(error = %Chain(e), "idempotency release fenced: this attempt's lease lapsed and another attempt took the key over (or an operator released it); retries get what that attempt records");
    }

    /// Whether the record is completed by this token's claim (`None`: unknown).
    async fn completed_by(&self, token: &Token) -> Option<bool> {
        let cfg = &*self.flow.cfg;
        let read = deadline(Instant::now(), cfg.timing.store_timeout());
        let get = timed(self.flow.labels.store_call("get"), cfg.store.get(&self.id));
        match bounded(read, get).await {
            // By this very claim: the holder's nonce, where the store keeps it; a generation
            // alone repeats after an operator's force_release and a new first claim.
            Ok(Some(r)) => Some(
                matches!(r.state, RecordState::Completed(_))
                    && r.holder
                        .map_or(r.generation == token.generation(), |h| h == *token),
            ),
            Ok(None) => Some(false),
            Err(_) => None,
        }
    }

    /// After `RecordDecision::AlreadyRecorded`: says so if the handler did not complete the
    /// record, since retries then get 409 for a lease and a takeover runs the work again.
    pub(super) async fn check_recorded_by_handler(&self, token: &Token) {
        if self.completed_by(token).await == Some(false) {
            tracing::error!("the handler marked its response RecordDecision::AlreadyRecorded, but the record was not completed by its claim; retries get 409 until the lease lapses, then run again");
        }
    }

    /// Renews the lease at fixed times for as long as it is polled. Never returns. Each
    /// renewal runs under its own deadline, below `lease / 3`, so it ends before the next
    /// one is due: one hung or failed renewal never delays the next.
    pub(super) async fn renew(&self, token: &Token, lease: &Lease) -> std::convert::Infallible {
        let store = &*self.flow.cfg.store;
        loop {
            tokio::time::sleep_until(lease.next_due()).await;
            let sent = Instant::now();
            let until = deadline(sent, lease.timeout);
            let extend = store.extend(&self.id, token, lease.length);
            match bounded(until, timed(self.flow.labels.store_call("extend"), extend)).await {
                Ok(()) => lease.renewed(sent),
                Err(e) if e.is_fenced() => {
                    // Completed by the handler's own transaction (AlreadyRecorded) is quiet.
                    if self.completed_by(token).await != Some(true) {
                        self.flow.labels.event(Event::Fenced);
                        tracing::error!(error = %Chain(&e), "idempotency lease lost to another attempt; this run will not be recorded");
                    }
                    return std::future::pending().await;
                }
                Err(e) => {
                    tracing::warn!(error = %Chain(&e), "idempotency lease renewal failed; the next one runs on schedule");
                }
            }
        }
    }
}

/// The text of a caught panic, for its log line.
pub(super) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string panic")
}
