//! Bodies read into one buffer: the request's (step 3), within its limit, and the response's
//! (step 8), as far as the record needs.

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt;

use http::{Request, Response};
use tower_service::Service;

use super::{BoxError, Keyed};
use crate::body::{RequestBody, ResponseBody, StreamEnd};
use crate::policy::{decide, RecordDecision, ResponseInfo};

pub(super) enum BodyError {
    TooLarge,
    Failed(BoxError),
}

/// Reads a request body into one buffer, sized from `Content-Length` (already checked
/// against `limit`). A body that comes whole in one frame is kept as it is, with no copy;
/// otherwise each frame is copied and dropped at once: a body sent in many small frames must
/// not pin a read buffer per frame until the end.
///
/// Not an `async fn`, which would hold its arguments twice: this future sits inside every
/// keyed request's.
#[allow(clippy::manual_async_fn)] // on purpose: see above
pub(super) fn buffer_body<B>(
    body: B,
    limit: usize,
    declared: usize,
) -> impl std::future::Future<Output = Result<Bytes, BodyError>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    async move {
        let mut body = std::pin::pin!(body);
        let mut first: Option<Bytes> = None;
        let mut buf = BytesMut::new();
        while let Some(frame) = body.as_mut().frame().await {
            let frame = frame.map_err(|e| BodyError::Failed(e.into()))?;
            if let Ok(data) = frame.into_data() {
                if data.is_empty() {
                    continue;
                }
                let held = first.as_ref().map_or(0, Bytes::len) + buf.len();
                if data.len() > limit - held {
                    return Err(BodyError::TooLarge);
                }
                match first.take() {
                    // All there is (its declared length, or the body says it ended): kept as
                    // it is. Anything else is copied at once.
                    None if buf.is_empty() && (data.len() == declared || body.is_end_stream()) => {
                        first = Some(data)
                    }
                    held => {
                        if buf.capacity() == 0 {
                            buf.reserve(
                                declared
                                    .min(limit)
                                    .max(held.as_ref().map_or(0, Bytes::len) + data.len()),
                            );
                        }
                        if let Some(h) = held {
                            buf.extend_from_slice(&h);
                        }
                        buf.extend_from_slice(&data);
                    }
                }
            }
        }
        Ok(first.unwrap_or_else(|| buf.freeze()))
    }
}

pub(super) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// How the detached work ended, before settling with the store.
pub(super) enum Work<B: Body> {
    /// Not to be buffered: released (or recorded by the handler) on the response head.
    Unbuffered(RecordDecision, Response<ResponseBody<B>>),
    /// Read whole: record or release.
    Buffered {
        parts: http::response::Parts,
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// Larger than `max_response_body`, and to be recorded: a tombstone.
    TooLarge(Response<ResponseBody<B>>),
    /// Larger than `max_response_body`, undecided until the stream ends (gRPC: the status is
    /// in the trailers). The response streams to the client; `end` hears how it ended.
    Streaming {
        response: Response<ResponseBody<B>>,
        extension: Option<RecordDecision>,
        end: tokio::sync::oneshot::Receiver<StreamEnd>,
    },
    /// The body failed while being read.
    Failed(Response<ResponseBody<B>>),
}

impl Keyed {
    /// Calls the inner service and reads the body as far as the record needs.
    pub(super) async fn work<S, ReqB, ResB>(
        &self,
        inner: &mut S,
        req: Request<RequestBody<ReqB>>,
    ) -> Result<Work<ResB>, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
        ResB: Body<Data = Bytes>,
    {
        let cfg = &*self.flow.cfg;
        let (parts, body) = inner.call(req).await?.into_parts();
        let extension: Option<RecordDecision> = parts.extensions.get().copied();
        // HTTP decides on the head, so released answers stream unbuffered. gRPC's status is
        // in the trailers, so only the handler's own word or a trailers-only answer (status
        // in the head) decides early; otherwise read first, decide after.
        let decided_on_head = !self.flow.grpc
            || matches!(
                extension,
                Some(RecordDecision::Release | RecordDecision::AlreadyRecorded)
            )
            || parts.headers.contains_key("grpc-status");
        if decided_on_head {
            let info = ResponseInfo::new(parts.status, &parts.headers, None);
            let decision = decide(&*cfg.policy, extension, &info);
            if decision != RecordDecision::Record {
                return Ok(Work::Unbuffered(
                    decision,
                    Response::from_parts(parts, ResponseBody::stream(body)),
                ));
            }
        }
        // Boxed so the rest can be handed on if it proves too large; only keyed requests
        // that record pay this allocation, next to their store round trips.
        let mut body = Box::pin(body);
        let mut buf = BytesMut::new();
        let mut trailers = None;
        while let Some(frame) = body.as_mut().frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    let prefix = (!buf.is_empty()).then(|| buf.freeze());
                    return Ok(Work::Failed(Response::from_parts(
                        parts,
                        ResponseBody::failed(prefix, e),
                    )));
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    if buf.len() > cfg.max_response_body {
                        let prefix = buf.freeze();
                        if decided_on_head || extension == Some(RecordDecision::Record) {
                            let res =
                                Response::from_parts(parts, ResponseBody::rest(prefix, body, None));
                            return Ok(Work::TooLarge(res));
                        }
                        let (tx, end) = tokio::sync::oneshot::channel();
                        let response =
                            Response::from_parts(parts, ResponseBody::rest(prefix, body, Some(tx)));
                        return Ok(Work::Streaming {
                            response,
                            extension,
                            end,
                        });
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            }
        }
        Ok(Work::Buffered {
            parts,
            data: buf.freeze(),
            trailers,
        })
    }
}
