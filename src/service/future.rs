//! The response future, and the work a dropped response future leaves on a task of its own.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;

use super::key::Echo;
use super::Answer;
use crate::body::ResponseBody;

thread_local! {
    /// Set by the flow being polled, within the poll that won its claim: see [`commit`].
    static COMMITTED: Cell<bool> = const { Cell::new(false) };
}

/// Says, from inside the flow's poll, that its claim is won: from then on the flow must run
/// to its end, so a dropped response future (client gone, a deadline) hands it to a task of
/// its own instead of cancelling the work halfway. Before it, dropping cancels, as it should
/// (a claim in flight is released by `PendingClaim`). A flag read around each poll rather than
/// a second boxed future or a channel per request; each poll saves and restores the flag of
/// any flow that polls it (nested layers).
pub(super) fn commit() {
    COMMITTED.with(|c| c.set(true));
}

/// A keyed request's flow, and whether it has won its claim.
pub(super) struct Flow<B: Body, E> {
    future: Option<BoxFlow<B, E>>,
    committed: bool,
    /// Spawns the rest of a committed flow: made where the output's `Send + 'static` is known.
    detach: fn(BoxFlow<B, E>),
    /// The key to put on the answer, once the flow has read it.
    echo: Echo,
}

impl<B: Body, E> Flow<B, E> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Answer<B, E>> {
        let future = self.future.as_mut().expect("polled after completion");
        let outer = COMMITTED.with(|c| c.replace(false));
        // A handler's panic is resumed here once its key is settled: the flow is spent then.
        // Caught for a moment, so the outer flag is restored and the drop detaches nothing
        // (a spent future polled again on a task would panic a second time).
        let out = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        if COMMITTED.with(|c| c.replace(outer)) {
            self.committed = true;
        }
        let out = match out {
            Ok(out) => out,
            Err(panic) => {
                self.future = None;
                std::panic::resume_unwind(panic)
            }
        };
        let Poll::Ready(mut answer) = out else {
            return Poll::Pending;
        };
        self.future = None;
        if let (Ok(res), Some(key)) = (&mut answer, self.echo.as_ref().and_then(|e| e.get())) {
            crate::response::echo_key(res, key);
        }
        Poll::Ready(answer)
    }
}

impl<B: Body, E> Drop for Flow<B, E> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take().filter(|_| self.committed) {
            (self.detach)(future);
        }
    }
}

/// Runs a committed flow to its end on a task; its answer has no one left to take it.
pub(super) fn detach<B: Body, E>(future: BoxFlow<B, E>)
where
    Answer<B, E>: Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(future)),
        // No runtime (it is shutting down): the work goes with it, as a spawned task
        // would; the claim lapses with its lease.
        Err(_) => tracing::warn!(
            "no tokio runtime to finish an idempotent request on; its claim lapses with its lease"
        ),
    }
}

pin_project! {
    /// The response future of [`Idempotency`].
    pub struct ResponseFuture<F, B: Body, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pub(super) type BoxFlow<B, E> = Pin<Box<dyn Future<Output = Answer<B, E>> + Send>>;

pin_project! {
    #[project = KindProj]
    enum Kind<F, B: Body, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Flow { flow: Flow<B, E> },
    }
}

impl<F, B: Body, E> ResponseFuture<F, B, E> {
    pub(super) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(super) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(super) fn flow(future: BoxFlow<B, E>, detach: fn(BoxFlow<B, E>), echo: Echo) -> Self {
        Self {
            kind: Kind::Flow {
                flow: Flow {
                    future: Some(future),
                    committed: false,
                    detach,
                    echo,
                },
            },
        }
    }
}

impl<F, B: Body, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Ready { .. } => "ready",
            Kind::Flow { .. } => "flow",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map(|r| r.map(|res| res.map(ResponseBody::stream))),
            KindProj::Ready { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            KindProj::Flow { flow } => flow.poll(cx),
        }
    }
}
