//! Lease and deadline machinery: every store call bounded in time, and the holder's view of
//! its lease.

use std::future::Future;
use std::sync::Mutex;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use super::Chain;
use crate::store::{StoreError, StoreErrorKind};

/// Backoff between retries of `complete`/`release` and between polls in wait mode.
pub(super) const BACKOFF_START: Duration = Duration::from_millis(10);
pub(super) const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// About 30 years: later than any deadline that matters, small enough to add to any `Instant`.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// `at + d`, or far in the future where that would overflow: a "wait forever" or "keep
/// forever" setting must not panic.
pub(crate) fn deadline(at: Instant, d: Duration) -> Instant {
    at.checked_add(d).unwrap_or_else(|| at + FAR_FUTURE)
}

/// Runs one store call under `until`. Past it the outcome is unknown, not failed: the call
/// may still take effect, so no caller reads a timeout as "did not happen".
pub(crate) async fn bounded<T>(
    until: Instant,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match within(until, call).await {
        Ok(result) => result,
        Err(elapsed) => Err(StoreError::with_source(StoreErrorKind::Unknown, elapsed)),
    }
}

/// `tokio::time::timeout_at`, without building a timer for a future that is ready at its
/// first poll (an in-memory store call, a body already received): a `Sleep` takes the runtime
/// handle, a shared atomic, even when it never fires. A ready future wins either way, as it
/// does in `timeout_at`, which also polls the future first.
pub(crate) fn within<F: Future>(until: Instant, future: F) -> Within<F> {
    Within {
        future,
        timer: None,
        until: Until::At(until),
    }
}

/// [`within`] for a span rather than a deadline: the clock is read only when the future is
/// not ready at its first poll. A span too long to add to the clock waits forever, as
/// `tokio::time::timeout` does.
pub(crate) fn within_for<F: Future>(d: Duration, future: F) -> Within<F> {
    Within {
        future,
        timer: None,
        until: Until::After(d),
    }
}

/// When a [`Within`] gives up.
enum Until {
    At(Instant),
    After(Duration),
}

pin_project_lite::pin_project! {
    /// The future of [`within`] and [`within_for`]. Written by hand rather than as an async
    /// fn, which would hold `future` twice (its argument and its pinned copy), and with the
    /// timer boxed: a `Sleep` is cache-padded (128-byte aligned, some 300 bytes), and inline
    /// it would size and align every future around this one, ready or not.
    pub(crate) struct Within<F> {
        #[pin]
        future: F,
        timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
        until: Until,
    }
}

impl<F: Future> Future for Within<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.future.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        let until = &*this.until;
        let timer = this.timer.get_or_insert_with(|| {
            Box::pin(match *until {
                Until::At(at) => tokio::time::sleep_until(at),
                Until::After(d) => tokio::time::sleep(d),
            })
        });
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A [`within`] deadline passed before its future was ready.
#[derive(Debug)]
pub(crate) struct Elapsed;

impl std::fmt::Display for Elapsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("deadline has elapsed")
    }
}

impl std::error::Error for Elapsed {}

/// The holder's view of its lease. Every instant is taken when a call was *sent*, so the
/// local estimate of the lease's end is never later than the store's own.
pub(crate) struct Lease {
    pub(crate) length: Duration,
    every: Duration,
    pub(crate) timeout: Duration,
    state: Mutex<LeaseState>,
}

struct LeaseState {
    /// When the last claim or renewal that succeeded was sent.
    renewed: Instant,
    /// When the last renewal was due (the claim's send time before the first).
    due: Instant,
}

impl Lease {
    pub(crate) fn new(sent: Instant, timing: &crate::Timing) -> Self {
        let length = timing.lease();
        Self {
            length,
            // lease / 3: one renewal can fail (a store blip) and the next lands with a third of
            // the lease to spare; after two failures the third is sent at the lease's edge.
            every: length / 3,
            timeout: timing.store_timeout(),
            state: Mutex::new(LeaseState {
                renewed: sent,
                due: sent,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The local estimate of when the lease lapses.
    pub(crate) fn end(&self) -> Instant {
        deadline(self.state().renewed, self.length)
    }

    /// When the next renewal is due. Renewals run at fixed times from the claim's send
    /// time; one that is already due (a late claim reply) runs at once. A schedule more than
    /// one interval behind restarts from now rather than firing a burst.
    pub(super) fn next_due(&self) -> Instant {
        let mut state = self.state();
        let now = Instant::now();
        let mut next = deadline(state.due, self.every);
        if deadline(next, self.every) <= now {
            next = now;
        }
        state.due = next;
        next
    }

    pub(super) fn renewed(&self, sent: Instant) {
        let mut state = self.state();
        state.renewed = state.renewed.max(sent);
    }
}

/// Retries `op` until it succeeds, is fenced, or `until` passes. Each attempt runs under
/// its own deadline, `timeout` from its start and never past `until`.
pub(super) async fn retry_until<F, Fut>(
    until: Instant,
    timeout: Duration,
    mut op: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let mut pause = BACKOFF_START;
    // The first attempt is always sent, with a whole deadline: a holder that was paused
    // past its local lease estimate still learns from the store what happened (fenced, or
    // still its own), rather than giving up unsent and logging a guess.
    let mut first = true;
    loop {
        let attempt = deadline(Instant::now(), timeout);
        let attempt = if first { attempt } else { attempt.min(until) };
        first = false;
        let err = match bounded(attempt, op()).await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_fenced() => return Err(e),
            Err(e) => e,
        };
        if deadline(Instant::now(), pause) >= until {
            return Err(err);
        }
        tracing::warn!(error = %Chain(&err), "idempotency store call failed; retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(BACKOFF_MAX);
    }
}
