//! The response future, and the work a dropped response future leaves on a task of its own.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;

use super::Answer;
use crate::body::ResponseBody;

/// The work of a won claim, polled inline by the response future. Dropped unfinished (the
/// answer is out and settling goes on, or the response future itself was dropped), it goes
/// on running on a task of its own.
pub(super) struct Detachable {
    future: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Detachable {
    pub(super) fn new(future: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }

    /// Polls the work, unless it has finished.
    pub(super) fn poll_inline(&mut self, cx: &mut Context<'_>) {
        if let Some(future) = &mut self.future {
            if future.as_mut().poll(cx).is_ready() {
                self.future = None;
            }
        }
    }
}

impl Drop for Detachable {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(future)),
                // No runtime (it is shutting down): the work goes with it, as a spawned task
                // would; the claim lapses with its lease.
                Err(_) => tracing::warn!("no tokio runtime to finish an idempotent request on; its claim lapses with its lease"),
            }
        }
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
        Flow { future: BoxFlow<B, E> },
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

    pub(super) fn flow(future: BoxFlow<B, E>) -> Self {
        Self {
            kind: Kind::Flow { future },
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
            KindProj::Flow { future } => future.as_mut().poll(cx),
        }
    }
}
