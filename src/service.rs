//! [`Idempotency`]: the service, and the request flow of DESIGN.md read top to bottom.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{request, HeaderMap, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody};
use crate::context::IdempotencyContext;
use crate::error::{ErrorKind, IdempotencyError};
use crate::fingerprint::fingerprint;
use crate::key;
use crate::layer::Config;
use crate::policy::{decide, is_grpc, RecordDecision, ResponseInfo};
use crate::record::{Completion, Fingerprint, RecordId, RecordState, StoredResponse, Token};
use crate::response;
use crate::store::{Claim, ClaimOutcome, IdempotencyStore, StoreError};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Panic = Box<dyn Any + Send + 'static>;

/// `Retry-After` for a 503: the store is expected back within a second or two.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Backoff between retries of `complete`/`release` and between polls in wait mode.
const BACKOFF_START: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// The [`IdempotencyLayer`](crate::IdempotencyLayer) service.
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let cfg = &self.config;
        // 1. Eligible? Anything else passes through: no buffering, no store call, no boxing.
        let grpc = is_grpc(req.headers());
        let eligible = if grpc {
            cfg.grpc_protected(req.uri().path())
        } else {
            cfg.methods.contains(req.method())
        };
        if !eligible {
            return ResponseFuture::passthrough(self.inner.call(req.map(RequestBody::stream)));
        }
        // 2. Key.
        let key = match key::extract(req.headers(), &cfg.header) {
            Ok(Some(key)) => key,
            Ok(None) if !cfg.key_required => {
                return ResponseFuture::passthrough(self.inner.call(req.map(RequestBody::stream)))
            }
            Ok(None) => {
                let field = if grpc { "metadata entry" } else { "header" };
                let detail = format!("this request requires an `{}` {field}", cfg.header);
                let err = IdempotencyError::new(ErrorKind::KeyMissing, detail);
                return ResponseFuture::ready(render(cfg, grpc, err));
            }
            Err(e) => {
                let err = IdempotencyError::new(ErrorKind::KeyInvalid, e.detail());
                return ResponseFuture::ready(render(cfg, grpc, err));
            }
        };
        // The inner service that was polled ready goes with this request; a clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let flow = Flow {
            cfg: self.config.clone(),
            grpc,
            key: key.into(),
        };
        ResponseFuture::flow(Box::pin(flow.run(inner, req)))
    }
}

/// Renders a layer-made error in the request's protocol.
fn render<B: Body>(cfg: &Config, grpc: bool, err: IdempotencyError) -> Response<ResponseBody<B>> {
    let rendered = match &cfg.renderer {
        Some(r) => r(&err),
        None if grpc => response::grpc_status(&err),
        None => response::problem(&err),
    };
    response::error_response(rendered, err)
}

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

struct Flow {
    cfg: Arc<Config>,
    grpc: bool,
    key: Arc<str>,
}

impl Flow {
    fn error<B: Body>(&self, err: IdempotencyError) -> Response<ResponseBody<B>> {
        render(&self.cfg, self.grpc, err)
    }

    /// Steps 3 to 9 for one keyed request.
    async fn run<S, ReqB, ResB>(self, inner: S, req: Request<ReqB>) -> Answer<ResB, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ReqB::Error: Into<BoxError>,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Send + 'static,
    {
        let (parts, body) = req.into_parts();
        let scope: Option<Arc<str>> = match &self.cfg.scope {
            None => None,
            Some(f) => match f(&parts) {
                Some(s) => Some(s.into()),
                None => {
                    tracing::error!("idempotency scope function returned None; is the layer ordered before auth?");
                    let err = IdempotencyError::new(
                        ErrorKind::ScopeMissing,
                        "the request's idempotency scope could not be determined",
                    );
                    return Ok(self.error(err));
                }
            },
        };

        // 3. Body: Content-Length first, then the limit while reading.
        let limit = if self.grpc {
            self.cfg.max_grpc_request_body
        } else {
            self.cfg.max_request_body
        };
        let too_large = || {
            IdempotencyError::new(
                ErrorKind::BodyTooLarge,
                format!("the request body is larger than {limit} bytes"),
            )
        };
        if content_length(&parts.headers).is_some_and(|n| n > limit as u64) {
            return Ok(self.error(too_large()));
        }
        let bytes = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<LengthLimitError>() => return Ok(self.error(too_large())),
            Err(e) => {
                tracing::debug!(error = %e, "request body unreadable");
                return Ok(self.error(IdempotencyError::new(
                    ErrorKind::BodyUnreadable,
                    "the request body could not be read",
                )));
            }
        };

        // 4. Fingerprint. 5. Record id: the store never sees the raw key.
        let fp = fingerprint(&parts, &parts.uri, &bytes, &self.cfg.fingerprint);
        let id = RecordId::new(scope.as_deref(), &self.key);
        let span = tracing::info_span!(
            "idempotency",
            record = %&id.to_hex()[..16],
            outcome = tracing::field::Empty,
            generation = tracing::field::Empty,
        );

        let keyed = Keyed {
            flow: self,
            scope,
            id,
            fp,
        };
        // 6. Claim, inline: a replay or a conflict costs no task. A response future dropped
        // mid-claim leaves the claim to `PendingClaim`, which releases it if it was won.
        let claim = match keyed.claim().instrument(span.clone()).await {
            Step::Answer(res) => return Ok(res),
            Step::FailOpen => {
                let mut inner = inner;
                let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                return inner.call(req).await.map(|r| r.map(ResponseBody::stream));
            }
            Step::Claimed(claim) => claim,
        };
        // 7-9 run on their own task: a dropped response future (client gone, deadline)
        // cannot cancel the work between the claim and the record.
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(
            async move {
                let answer = keyed.execute(inner, parts, bytes, claim).await;
                let _ = tx.send(answer);
            }
            .instrument(span),
        );
        match rx.await {
            Ok(Ok(answer)) => answer,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            // The task itself panicked outside the inner call: a bug in this crate.
            Err(_) => panic!("tower-idempotency: the request task ended without an answer"),
        }
    }
}

/// What the claim step decided.
#[allow(clippy::large_enum_variant)] // lives on the stack for one await
enum Step<B: Body> {
    /// Run the inner service under this claim.
    Claimed(Claim),
    /// Answer without running: a replay, a conflict, a mismatch, a store error.
    Answer(Response<ResponseBody<B>>),
    /// The store failed and the layer fails open: run unprotected.
    FailOpen,
}

type ClaimFuture = Pin<Box<dyn Future<Output = Result<ClaimOutcome, StoreError>> + Send>>;

/// A claim in flight. Dropped before it resolves (its response future was dropped), it
/// finishes on its own task and releases the claim if it won it, so the key is not held
/// for a whole lease by a request that will never run.
struct PendingClaim {
    future: Option<ClaimFuture>,
    store: Arc<dyn IdempotencyStore>,
    id: RecordId,
}

impl Future for PendingClaim {
    type Output = Result<ClaimOutcome, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self
            .future
            .as_mut()
            .expect("PendingClaim polled after completion");
        let out = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(out)
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        let (store, id) = (self.store.clone(), self.id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Ok(ClaimOutcome::Claimed(claim)) = future.await {
                    if let Err(e) = store.release(&id, &claim.token).await {
                        tracing::warn!(error = %e, "could not release a claim whose request went away; it lapses with its lease");
                    }
                }
            });
        }
    }
}

struct Keyed {
    flow: Flow,
    scope: Option<Arc<str>>,
    id: RecordId,
    fp: Fingerprint,
}

/// How the detached work ended, before settling with the store.
enum Work<B: Body> {
    /// Not to be buffered: released (or recorded by the handler) on the response head.
    Unbuffered(RecordDecision, Response<ResponseBody<B>>),
    /// Read whole: record or release.
    Buffered {
        parts: http::response::Parts,
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// Larger than `max_response_body`: a tombstone.
    TooLarge(Response<ResponseBody<B>>),
    /// The body failed while being read.
    Failed(Response<ResponseBody<B>>),
}

fn outcome(name: &'static str) {
    tracing::Span::current().record("outcome", name);
}

impl Keyed {
    async fn claim<B: Body>(&self) -> Step<B> {
        let cfg = &*self.flow.cfg;
        let (lease, ttl) = (cfg.retention.lease(), cfg.retention.ttl());
        let wait_until = cfg.wait.map(|w| Instant::now() + w);
        loop {
            let pending = PendingClaim {
                future: Some({
                    let (store, id, fp) = (cfg.store.clone(), self.id, self.fp);
                    Box::pin(async move { store.claim(&id, &fp, lease, ttl).await })
                }),
                store: cfg.store.clone(),
                id: self.id,
            };
            let record = match pending.await {
                Ok(ClaimOutcome::Claimed(claim)) => return Step::Claimed(claim),
                Ok(ClaimOutcome::Existing(record)) => record,
                Err(e) if cfg.fail_open => {
                    outcome("store_error");
                    tracing::warn!(error = %e, "idempotency store failed; running unprotected (fail open)");
                    return Step::FailOpen;
                }
                Err(e) => {
                    outcome("store_error");
                    tracing::error!(error = %e, "idempotency store failed; refusing the request (fail closed)");
                    let err = IdempotencyError::new(
                        ErrorKind::StoreUnavailable,
                        "the idempotency store is unavailable; the request was not processed",
                    )
                    .retry_after(STORE_RETRY_AFTER)
                    .source(e);
                    return Step::Answer(self.flow.error(err));
                }
            };
            if record.fingerprint != self.fp {
                outcome("mismatch");
                let err = IdempotencyError::new(
                    ErrorKind::Mismatch,
                    "this idempotency key was already used with a different request",
                );
                return Step::Answer(self.flow.error(err));
            }
            match record.state {
                RecordState::Completed(Completion::Response(stored)) => {
                    outcome("replayed");
                    return Step::Answer(response::replay(&stored));
                }
                RecordState::Completed(Completion::Tombstone { status }) => {
                    outcome("tombstoned");
                    let err = IdempotencyError::new(ErrorKind::ResponseNotRetained, "the original request completed, but its response was too large to keep; it was not run again")
                        .original_status(status);
                    return Step::Answer(self.flow.error(err));
                }
                RecordState::InProgress { lease_remaining } => {
                    if let Some(until) = wait_until {
                        if self.wait_for_change(until).await {
                            continue;
                        }
                    }
                    outcome("conflict");
                    let err = IdempotencyError::new(
                        ErrorKind::InProgress,
                        "a request with this idempotency key is still being processed",
                    )
                    .retry_after(lease_remaining);
                    return Step::Answer(self.flow.error(err));
                }
            }
        }
    }

    /// Wait mode: polls until the record is no longer a live claim (`true`), or `until` passes.
    async fn wait_for_change(&self, until: Instant) -> bool {
        let mut pause = BACKOFF_START;
        loop {
            if Instant::now() + pause > until {
                return false;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(BACKOFF_MAX);
            match self.flow.cfg.store.get(&self.id).await {
                Ok(Some(r)) if matches!(r.state, RecordState::InProgress { lease_remaining } if !lease_remaining.is_zero()) =>
                    {}
                // Completed, released, lapsed or a store error: claim again to find out.
                _ => return true,
            }
        }
    }

    /// 7. Run the inner service once, renewing the lease. 8. Settle. 9. Answer.
    async fn execute<S, ReqB, ResB>(
        &self,
        mut inner: S,
        mut parts: request::Parts,
        bytes: Bytes,
        Claim { token, takeover }: Claim,
    ) -> Result<Answer<ResB, S::Error>, Panic>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
        ResB: Body<Data = Bytes>,
    {
        let cfg = &*self.flow.cfg;
        tracing::Span::current().record("generation", token.generation());
        if takeover {
            tracing::warn!(generation = token.generation(), "took over a claim whose lease lapsed; the earlier attempt may have done part of the work");
        }
        let ctx = IdempotencyContext::new(
            self.flow.key.clone(),
            self.scope.clone(),
            self.id,
            self.fp,
            token,
        );
        parts.extensions.insert(ctx);
        let req = Request::from_parts(parts, RequestBody::buffered(bytes));

        let lease = cfg.retention.lease();
        // The local estimate of the lease's end: taken when a claim/extend was *sent*, so
        // it is never later than the store's own deadline.
        let renewed_at = Mutex::new(Instant::now());
        let work = AssertUnwindSafe(self.work(&mut inner, req)).catch_unwind();
        let renew = renew(&*cfg.store, &self.id, &token, lease, &renewed_at);
        let result = tokio::select! {
            biased;
            r = work => r,
            never = renew => match never {},
        };
        let lease_end = *renewed_at.lock().unwrap_or_else(|e| e.into_inner()) + lease;

        let work = match result {
            Err(panic) => {
                outcome("released");
                self.release(&token, lease_end).await;
                return Err(panic);
            }
            Ok(Err(e)) => {
                outcome("released");
                self.release(&token, lease_end).await;
                return Ok(Err(e));
            }
            Ok(Ok(work)) => work,
        };
        let response = match work {
            Work::Unbuffered(RecordDecision::AlreadyRecorded, res) => {
                outcome("executed");
                res
            }
            Work::Unbuffered(_, res) | Work::Failed(res) => {
                outcome("released");
                self.release(&token, lease_end).await;
                res
            }
            Work::TooLarge(res) => {
                outcome("tombstoned");
                let tomb = Completion::Tombstone {
                    status: res.status(),
                };
                self.complete(&token, &tomb, lease_end).await;
                res
            }
            Work::Buffered {
                parts,
                data,
                trailers,
            } => {
                let info = ResponseInfo::new(parts.status, &parts.headers, trailers.as_ref());
                match decide(&*cfg.policy, parts.extensions.get().copied(), &info) {
                    RecordDecision::Record => {
                        outcome("executed");
                        let stored = StoredResponse {
                            status: parts.status,
                            headers: if self.flow.grpc {
                                response::grpc_recorded_headers(&parts.headers)
                            } else {
                                response::recorded_headers(&parts.headers, &cfg.recorded_headers)
                            },
                            body: data.clone(),
                            trailers: trailers.clone(),
                        };
                        self.complete(&token, &Completion::Response(stored), lease_end)
                            .await;
                    }
                    RecordDecision::Release => {
                        outcome("released");
                        self.release(&token, lease_end).await;
                    }
                    RecordDecision::AlreadyRecorded => outcome("executed"),
                }
                Response::from_parts(parts, ResponseBody::full(data, trailers))
            }
        };
        Ok(Ok(response))
    }

    /// Calls the inner service and reads the body as far as the record needs.
    async fn work<S, ReqB, ResB>(
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
        // HTTP decides on the head, so released answers stream unbuffered. gRPC's status
        // is in the trailers: read first, decide after.
        if !self.flow.grpc {
            let info = ResponseInfo::new(parts.status, &parts.headers, None);
            let decision = decide(&*cfg.policy, parts.extensions.get().copied(), &info);
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
                    if buf.len() + data.len() > cfg.max_response_body {
                        buf.extend_from_slice(&data);
                        let res =
                            Response::from_parts(parts, ResponseBody::rest(buf.freeze(), body));
                        return Ok(Work::TooLarge(res));
                    }
                    buf.extend_from_slice(&data);
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

    /// Records with retries while the lease lives; then answers anyway and logs.
    async fn complete(&self, token: &Token, completion: &Completion, lease_end: Instant) {
        let ttl = self.flow.cfg.retention.ttl();
        let store = &*self.flow.cfg.store;
        retry(lease_end, "complete", || {
            store.complete(&self.id, token, completion, ttl)
        })
        .await;
    }

    /// Releases with retries while the lease lives; a failed release lapses with the lease.
    async fn release(&self, token: &Token, lease_end: Instant) {
        let store = &*self.flow.cfg.store;
        retry(lease_end, "release", || store.release(&self.id, token)).await;
    }
}

async fn retry<F, Fut>(lease_end: Instant, what: &'static str, mut op: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), crate::store::StoreError>>,
{
    let mut pause = BACKOFF_START;
    loop {
        match op().await {
            Ok(()) => return,
            Err(e) if e.is_fenced() => {
                tracing::error!(error = %e, "idempotency {what} fenced: the lease lapsed and another attempt took over");
                return;
            }
            Err(e) => {
                if Instant::now() + pause >= lease_end {
                    tracing::error!(error = %e, "idempotency {what} failed until the lease ran out; the record stays in progress until it lapses");
                    return;
                }
                tracing::warn!(error = %e, "idempotency {what} failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Renews the lease every `lease / 3` for as long as it is polled. Never returns.
async fn renew(
    store: &dyn IdempotencyStore,
    id: &RecordId,
    token: &Token,
    lease: Duration,
    renewed_at: &Mutex<Instant>,
) -> std::convert::Infallible {
    // lease / 3: two renewals in a row can fail (a store blip) before the lease lapses.
    let every = lease / 3;
    loop {
        tokio::time::sleep(every).await;
        let sent = Instant::now();
        match store.extend(id, token, lease).await {
            Ok(()) => *renewed_at.lock().unwrap_or_else(|e| e.into_inner()) = sent,
            Err(e) if e.is_fenced() => {
                tracing::error!(error = %e, "idempotency lease lost to another attempt; this run will not be recorded");
                return std::future::pending().await;
            }
            Err(e) => tracing::warn!(error = %e, "idempotency lease renewal failed; retrying"),
        }
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

pin_project! {
    /// The response future of [`Idempotency`].
    pub struct ResponseFuture<F, B: Body, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

type BoxFlow<B, E> = Pin<Box<dyn Future<Output = Answer<B, E>> + Send>>;

pin_project! {
    #[project = KindProj]
    enum Kind<F, B: Body, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Flow { future: BoxFlow<B, E> },
    }
}

impl<F, B: Body, E> ResponseFuture<F, B, E> {
    fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    fn flow(future: BoxFlow<B, E>) -> Self {
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
