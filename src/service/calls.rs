//! Steps 7 and 8's store calls: the lease renewals while the work runs, then the record or
//! the release. Each call is bounded by the store deadline, and the record and release are
//! retried while the lease lives; none of them can hold the answer past the lease.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::deadline::{bounded, deadline, retry_until, Lease};
use super::Chain;
use crate::config::Config;
use crate::metrics::Labels;
use crate::metrics::{timed, Event};
use crate::store::record::{Completion, RecordId, RecordState, Token};
use crate::store::StoreError;
use std::any::Any;

/// A claim's holder: the store calls one claim makes once it is won, for the layer's flow
/// and for [operations](crate::operation) alike.
#[derive(Clone, Copy)]
pub(crate) struct Holder<'a> {
    pub(crate) cfg: &'a Config,
    pub(crate) labels: &'a Labels,
    pub(crate) id: &'a RecordId,
}

impl Holder<'_> {
    /// Records, retrying while the lease lives; then the caller answers anyway.
    pub(crate) async fn complete(&self, token: &Token, completion: &Completion, lease: &Lease) {
        let cfg = self.cfg;
        let (store, ttl) = (&*cfg.store, cfg.timing.ttl());
        let result = retry_until(lease.end(), lease.timeout, || {
            let call = store.complete(self.id, token, completion, ttl);
            timed(self.labels.store_call("complete"), call)
        })
        .await;
        match result {
            Ok(()) => self.labels.event(Event::Recorded),
            // A complete this token made already is `Ok`: fenced means another attempt (or
            // an operator) has the key now.
            Err(e) if e.is_fenced() => {
                self.labels.event(Event::Fenced);
                tracing::error!(error = %Chain(&e), "idempotency record fenced: this attempt's lease lapsed and another attempt took the key over (or an operator released it); this answer was not recorded, and retries get what that attempt records");
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), "idempotency record failed until the lease ran out; the answer goes to the client unrecorded and the key stays in progress until its lease lapses")
            }
        }
    }

    /// One release attempt under the store deadline, before a released answer goes out.
    /// `Err` when it did not take effect for certain (fenced is final, and counts as done).
    pub(crate) async fn release_once(
        &self,
        token: &Token,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let store = &*self.cfg.store;
        let call = timed(
            self.labels.store_call("release"),
            store.release(self.id, token),
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
    pub(crate) async fn release(&self, token: &Token, lease: &Lease) {
        let store = &*self.cfg.store;
        let result = retry_until(lease.end(), lease.timeout, || {
            timed(
                self.labels.store_call("release"),
                store.release(self.id, token),
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
        self.labels.event(Event::Fenced);
        tracing::error!(error = %Chain(e), "idempotency release fenced: this attempt's lease lapsed and another attempt took the key over (or an operator released it); retries get what that attempt records");
    }

    /// Whether the record is completed by this token's claim (`None`: unknown).
    async fn completed_by(&self, token: &Token) -> Option<bool> {
        let cfg = self.cfg;
        let read = deadline(Instant::now(), cfg.timing.store_timeout());
        let get = timed(self.labels.store_call("get"), cfg.store.get(self.id));
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
    pub(crate) async fn check_recorded_by_handler(&self, token: &Token) {
        if self.completed_by(token).await == Some(false) {
            tracing::error!("the handler marked its response RecordDecision::AlreadyRecorded, but the record was not completed by its claim; retries get 409 until the lease lapses, then run again");
        }
    }

    /// Renews the lease at fixed times for as long as it is polled. Never returns. Each
    /// renewal runs under its own deadline, below `lease / 3`, so it ends before the next
    /// one is due: one hung or failed renewal never delays the next.
    pub(crate) async fn renew(self, token: &Token, lease: &Lease) -> std::convert::Infallible {
        let store = &*self.cfg.store;
        loop {
            tokio::time::sleep_until(lease.next_due()).await;
            let sent = Instant::now();
            let until = deadline(sent, lease.timeout);
            let extend = store.extend(self.id, token, lease.length);
            match bounded(until, timed(self.labels.store_call("extend"), extend)).await {
                Ok(()) => lease.renewed(sent),
                Err(e) if e.is_fenced() => {
                    // Completed by the handler's own transaction (AlreadyRecorded) is quiet.
                    if self.completed_by(token).await != Some(true) {
                        self.labels.event(Event::Fenced);
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

/// A claim took over a lapsed lease: counted, logged, and told to the abandoned-key hook (a
/// panicking hook is logged, and the work runs).
pub(crate) fn took_over(
    cfg: &Config,
    labels: &Labels,
    scope: Option<Arc<str>>,
    record: RecordId,
    token: &Token,
    lapsed_for: Option<Duration>,
) {
    labels.event(Event::Takeover);
    tracing::warn!(
        generation = token.generation(),
        "took over a claim whose lease lapsed; the earlier attempt may have done part of the work"
    );
    if let Some(hook) = &cfg.on_abandoned {
        // Generations grow by one per takeover.
        let abandoned = crate::Abandoned {
            scope,
            record,
            old_generation: token.generation().saturating_sub(1),
            new_generation: token.generation(),
            abandoned_for: lapsed_for,
        };
        if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| hook(&abandoned))) {
            tracing::error!(
                panic = panic_message(&*panic),
                "the abandoned-key hook panicked; the work runs"
            );
        }
    }
}

/// The text of a caught panic, for its log line.
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string panic")
}
