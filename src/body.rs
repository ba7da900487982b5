//! The body types the layer passes on: no boxing, no copies on the pass-through path.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::oneshot;

/// How a streamed response that the layer could not buffer ended, for the record decision
/// that waits on it (a gRPC status arrives in the trailers, after the body).
#[derive(Debug)]
pub(crate) struct StreamEnd {
    pub(crate) how: Ended,
    /// The body holds its last frame (the trailers, the error or the end) until this fires or
    /// is dropped: the claim is settled first, so a retry sent as soon as the client has the
    /// whole answer finds the key released.
    pub(crate) go: oneshot::Sender<()>,
}

/// How the body of a [`StreamEnd`] ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The body ended, with these trailers if it had any.
    Ended(Option<HeaderMap>),
    /// The body failed.
    Failed,
}

pin_project! {
    /// The request body the inner service sees: the original body when the request is not
    /// keyed, or the buffered bytes when it is.
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Stream { #[pin] body: B },
        Buffered { data: Option<Bytes> },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn stream(body: B) -> Self {
        Self {
            kind: RequestKind::Stream { body },
        }
    }

    pub(crate) fn buffered(data: Bytes) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            kind: RequestKind::Buffered { data },
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            RequestKind::Stream { .. } => f.write_str("RequestBody::Stream"),
            RequestKind::Buffered { data } => f
                .debug_struct("RequestBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Stream { body } => body.poll_frame(cx),
            RequestKindProj::Buffered { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Stream { body } => body.is_end_stream(),
            RequestKind::Buffered { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Stream { body } => body.size_hint(),
            RequestKind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

pin_project! {
    /// The response body the layer answers with: the inner body untouched, a buffered or
    /// replayed body with its trailers, or a large body whose start was already read.
    pub struct ResponseBody<B: Body> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    // Every response moves through each layer above this one, by value: the rare kinds and
    // the trailers are boxed so that one moves in a few words (about 50 bytes, not 160).
    #[project = ResponseKindProj]
    enum ResponseKind<B: Body> {
        Stream { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
        Rest { rest: Box<Rest<B>> },
        Failed { failed: Box<Failed<B::Error>> },
    }
}

/// A large body whose start was already read.
struct Rest<B: Body> {
    prefix: Option<Bytes>,
    body: Pin<Box<B>>,
    end: Option<oneshot::Sender<StreamEnd>>,
    // The last frame, held until the claim is settled.
    held: Option<Held<B>>,
}

/// The last frame of a [`Rest`], and the word that it may go out.
type Held<B> = (
    Option<Result<Frame<Bytes>, <B as Body>::Error>>,
    oneshot::Receiver<()>,
);

/// The bytes read so far, then the body's error.
struct Failed<E> {
    prefix: Option<Bytes>,
    error: Option<E>,
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn stream(body: B) -> Self {
        Self {
            kind: ResponseKind::Stream { body },
        }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            kind: ResponseKind::Full {
                data,
                trailers: trailers.map(Box::new),
            },
        }
    }

    /// The bytes read so far, then the rest of a body that was partly read. `end` hears how
    /// the body ended; dropped unread, it hears nothing (the sender is dropped).
    pub(crate) fn rest(
        prefix: Bytes,
        body: Pin<Box<B>>,
        end: Option<oneshot::Sender<StreamEnd>>,
    ) -> Self {
        Self {
            kind: ResponseKind::Rest {
                rest: Box::new(Rest {
                    prefix: Some(prefix),
                    body,
                    end,
                    held: None,
                }),
            },
        }
    }

    /// The bytes read so far, then the body's error.
    pub(crate) fn failed(prefix: Option<Bytes>, error: B::Error) -> Self {
        Self {
            kind: ResponseKind::Failed {
                failed: Box::new(Failed {
                    prefix,
                    error: Some(error),
                }),
            },
        }
    }
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match &self.kind {
            ResponseKind::Stream { .. } => "ResponseBody::Stream",
            ResponseKind::Full { .. } => "ResponseBody::Full",
            ResponseKind::Rest { .. } => "ResponseBody::Rest",
            ResponseKind::Failed { .. } => "ResponseBody::Failed",
        };
        f.write_str(name)
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Stream { body } => body.poll_frame(cx),
            ResponseKindProj::Rest { rest } => {
                let Rest {
                    prefix,
                    body,
                    end,
                    held,
                } = &mut **rest;
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                if held.is_none() {
                    let frame = std::task::ready!(body.as_mut().poll_frame(cx));
                    let how = match &frame {
                        Some(Ok(f)) => f.trailers_ref().map(|t| Ended::Ended(Some(t.clone()))),
                        Some(Err(_)) => Some(Ended::Failed),
                        None => Some(Ended::Ended(None)),
                    };
                    let (Some(how), Some(tx)) = (how, end.take()) else {
                        return Poll::Ready(frame);
                    };
                    let (go, wait) = oneshot::channel();
                    if tx.send(StreamEnd { how, go }).is_err() {
                        return Poll::Ready(frame);
                    }
                    *held = Some((frame, wait));
                }
                // Settled, or the settling side is gone: the last frame goes out now.
                let (_, wait) = held.as_mut().expect("held was just set");
                let _ = std::task::ready!(Pin::new(wait).poll(cx));
                let (frame, _) = held.take().expect("held was just matched");
                Poll::Ready(frame)
            }
            ResponseKindProj::Full { data, trailers } => {
                if let Some(d) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(d))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(*t))))
            }
            ResponseKindProj::Failed { failed } => {
                let Failed { prefix, error } = &mut **failed;
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                Poll::Ready(error.take().map(Err))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Stream { body } => body.is_end_stream(),
            // Not ended while someone waits to hear the trailers: the next poll tells them.
            ResponseKind::Rest { rest } => {
                let Rest {
                    prefix,
                    body,
                    end,
                    held,
                } = &**rest;
                prefix.is_none() && end.is_none() && held.is_none() && body.is_end_stream()
            }
            ResponseKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseKind::Failed { failed } => failed.prefix.is_none() && failed.error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Stream { body } => body.size_hint(),
            ResponseKind::Rest { rest } => {
                let Rest { prefix, body, .. } = &**rest;
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            ResponseKind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseKind::Failed { .. } => SizeHint::default(),
        }
    }
}
