//! [`Idempotency`]: the service, and the request flow read top to bottom (call, key, body,
//! fingerprint, claim, run, settle, answer). The machinery beside it has files of its own:
//! the key's refusal and echo (`key.rs`), body buffering (`buffer.rs`), a claim in flight
//! (`claim.rs`), the claim's renewals, record and release (`calls.rs`), deadlines and the
//! lease (`deadline.rs`), wait mode (`wait.rs`) and the response future (`future.rs`).

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{request, HeaderMap, Method, Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{Ended, RequestBody, ResponseBody, StreamEnd};
use crate::config::{Config, Scope};
mod context;
#[cfg(feature = "postgres")]
mod record_in;

use crate::error::{ErrorKind, IdempotencyError};
use crate::fingerprint::fingerprint;
use crate::grpc::Grpc;
use crate::key::Refusal;
use crate::metrics::{Labels, Outcome};
use crate::policy::{decide, is_grpc, RecordDecision, ResponseInfo};
use crate::response;
use crate::store::record::{Completion, Fingerprint, RecordId, ScopeId, Token};
use crate::store::Claim;
pub(crate) use context::with_current;
pub use context::IdempotencyContext;

mod buffer;
mod calls;
pub(crate) use calls::{panic_message, took_over, Holder};
mod claim;
mod deadline;
pub(crate) use deadline::{bounded, deadline, Lease};
mod future;
mod key;
mod wait;

use buffer::{buffer_body, content_length, BodyError, Work};
pub(crate) use claim::claim_within;
pub(crate) use deadline::within_for;
pub use future::ResponseFuture;
use key::{key_refused, Echo};
pub(crate) use wait::Waiters;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Panic = Box<dyn Any + Send + 'static>;

/// `Retry-After` for a 503: the store is expected back within a second or two.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The [`IdempotencyLayer`](crate::IdempotencyLayer) service.
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
    waiters: Arc<Waiters>,
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
            waiters: self.waiters.clone(),
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
    pub(crate) fn new(inner: S, config: Arc<Config>, waiters: Arc<Waiters>) -> Self {
        Self {
            inner,
            config,
            waiters,
        }
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
        // gRPC handling is the configuration's choice, never the client's alone.
        // gRPC calls are POSTs: other methods skip the header lookup.
        // A path outside the configured gRPC methods is an HTTP route whatever the client's
        // `Content-Type` claims: a client must not lift it out of protection.
        let grpc_config = (req.method() == Method::POST && is_grpc(req.headers()))
            .then(|| grpc_mode(cfg))
            .flatten()
            .filter(|g| g.route(req.uri().path()));
        let grpc = grpc_config.is_some();
        let eligible = if let Some(g) = grpc_config {
            g.protected(req.uri().path())
        } else {
            cfg.methods.contains(req.method())
        };
        if !eligible {
            return ResponseFuture::passthrough(self.inner.call(req.map(RequestBody::stream)));
        }
        let req = match &cfg.filter {
            None => req,
            Some(filter) => {
                let (parts, body) = req.into_parts();
                let selected = filter(&parts);
                let req = Request::from_parts(parts, body);
                if !selected {
                    return ResponseFuture::passthrough(
                        self.inner.call(req.map(RequestBody::stream)),
                    );
                }
                req
            }
        };
        let labels = Labels::new(cfg, req.extensions(), req.uri().path(), grpc);
        // 2. Key. One from a header is checked here, so a request without it costs no
        // buffering; one from the body is read from step 3's buffer.
        let key = if cfg.key.reads_body() {
            None
        } else {
            match cfg.key.read_head(req.headers(), grpc) {
                Ok(key) => Some(key),
                Err(Refusal::Missing(_)) if cfg.key.is_optional() => {
                    return ResponseFuture::passthrough(
                        self.inner.call(req.map(RequestBody::stream)),
                    )
                }
                Err(refusal) => {
                    return ResponseFuture::ready(render(cfg, grpc, key_refused(&labels, refusal)))
                }
            }
        };
        // The inner service that was polled ready goes with this request; a clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let echo: Echo = cfg.key_echo.then(Default::default);
        let flow = Flow {
            cfg: self.config.clone(),
            waiters: self.waiters.clone(),
            grpc,
            labels,
            echo: echo.clone(),
        };
        if let Some(key) = &key {
            flow.known(req.headers(), key);
        }
        ResponseFuture::flow(
            Box::pin(flow.run(inner, req, key)),
            future::detach::<ResB, S::Error>,
            echo,
        )
    }
}

/// How the layer serves gRPC, if it does; says once when a gRPC request meets a layer that
/// does not.
fn grpc_mode(cfg: &Config) -> Option<&Grpc> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if cfg.grpc.is_none() && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!("a gRPC request reached an idempotency layer without with_grpc(..); it is handled as HTTP");
    }
    cfg.grpc.as_ref()
}

/// Renders a layer-made error in the request's protocol. The user's renderer is for HTTP
/// only: a gRPC client cannot read an HTTP 409 or 422.
fn render<B: Body>(cfg: &Config, grpc: bool, err: IdempotencyError) -> Response<ResponseBody<B>> {
    let rendered = match &cfg.renderer {
        _ if grpc => response::grpc_status(&err),
        Some(r) => r(&err),
        None => response::problem(&err),
    };
    response::error_response(rendered, err)
}

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;
/// What the claimed work ends with: an answer, or the handler's panic, resumed once the claim
/// is settled.
type Delivery<B, E> = Result<Answer<B, E>, Panic>;

pub(crate) use crate::error::Chain;

struct Flow {
    cfg: Arc<Config>,
    waiters: Arc<Waiters>,
    grpc: bool,
    labels: Labels,
    /// The key for the answers to echo, when they do.
    echo: Echo,
}

impl Flow {
    fn error<B: Body>(&self, err: IdempotencyError) -> Response<ResponseBody<B>> {
        render(&self.cfg, self.grpc, err)
    }

    /// The refusal of a keyed request whose scope is unknown, counted; the caller logs why.
    fn scope_missing<B: Body>(&self) -> Response<ResponseBody<B>> {
        self.labels.outcome(Outcome::ScopeMissing);
        self.error(IdempotencyError::new(
            ErrorKind::ScopeMissing,
            "the request's idempotency scope could not be determined",
        ))
    }

    /// Steps 3 to 9 for one keyed request; `key` is `None` when it is read from the body.
    ///
    /// Not an `async fn`, which would keep its arguments beside the locals they move into for
    /// its whole life (the request twice): this future is boxed for every keyed request.
    fn run<S, ReqB, ResB>(
        self,
        inner: S,
        req: Request<ReqB>,
        key: Option<Arc<str>>,
    ) -> impl Future<Output = Answer<ResB, S::Error>> + Send + 'static
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
        async move {
            let scope: Option<Arc<str>> = match &self.cfg.scope {
                Scope::Unscoped => None,
                Scope::Unset => {
                    tracing::error!("idempotency layer has no scope: call with_scope (or unscoped, to share one key space on purpose); keyed requests are refused");
                    return Ok(self.scope_missing());
                }
                Scope::Fn(f) => match f(&parts) {
                    Some(s) => Some(s.into()),
                    None => {
                        tracing::error!("idempotency scope function returned None: the idempotency layer runs before the layer that sets the scope. Put authentication outside it: with axum, call `.layer(auth)` after `.layer(idempotency)` (the last `.layer()` call is the outermost); with ServiceBuilder or tonic, list the auth layer first");
                        return Ok(self.scope_missing());
                    }
                },
            };

            // 3. Body: Content-Length first, then the limit while reading.
            // In a block: the limit and its message end with it, not kept in this future.
            let bytes = {
                let limit = match &self.cfg.grpc {
                    Some(g) if self.grpc => g.max_request_body,
                    _ => self.cfg.max_request_body,
                };
                let too_large = || {
                    IdempotencyError::new(
                        ErrorKind::BodyTooLarge,
                        format!("the request body is larger than {limit} bytes"),
                    )
                };
                let declared = content_length(&parts.headers);
                if declared.is_some_and(|n| n > limit as u64) {
                    self.labels.outcome(Outcome::BodyTooLarge);
                    return Ok(self.error(too_large()));
                }
                let read = buffer_body(body, limit, declared.unwrap_or(0) as usize);
                match within_for(self.cfg.request_body_timeout, read).await {
                    Ok(Ok(bytes)) => bytes,
                    Ok(Err(BodyError::TooLarge)) => {
                        self.labels.outcome(Outcome::BodyTooLarge);
                        return Ok(self.error(too_large()));
                    }
                    Ok(Err(BodyError::Failed(e))) => {
                        self.labels.outcome(Outcome::BodyUnreadable);
                        tracing::debug!(error = %e, "request body unreadable");
                        return Ok(self.error(IdempotencyError::new(
                            ErrorKind::BodyUnreadable,
                            "the request body could not be read",
                        )));
                    }
                    Err(_) => {
                        self.labels.outcome(Outcome::BodyTimeout);
                        return Ok(self.error(IdempotencyError::new(
                            ErrorKind::BodyTimeout,
                            "the request body did not arrive in time; nothing was processed",
                        )));
                    }
                }
            };

            // 2, for a key in the body: read from the one buffer, within its limit and timeout.
            let key = match key {
                Some(key) => key,
                None => match self.cfg.key.read_request(&parts, &bytes, self.grpc) {
                    Ok(key) => {
                        self.known(&parts.headers, &key);
                        key
                    }
                    Err(Refusal::Missing(_)) if self.cfg.key.is_optional() => {
                        let mut inner = inner;
                        let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                        // Boxed: inline, the inner future would size every keyed request's.
                        return Box::pin(inner.call(req))
                            .await
                            .map(|r| r.map(ResponseBody::stream));
                    }
                    Err(refusal) => return Ok(self.error(key_refused(&self.labels, refusal))),
                },
            };
            // Matched in place: a named result would stay in the future across every await.
            if let Some(Err(err)) = self.cfg.signature.as_ref().map(|f| f(&parts, &bytes)) {
                self.labels.outcome(Outcome::SignatureInvalid);
                return Ok(self.error(err));
            }

            // 4. Fingerprint. 5. Record id: the store never sees the raw key.
            // The path the client sent: inside axum's nested routers `parts.uri` lost its prefix.
            let target = crate::fingerprint::original_uri(&parts);
            let fp = fingerprint(&parts, target, &bytes, &self.cfg.fingerprint);
            // In a block, so the key, its id and its scope live on only in `keyed`.
            let (keyed, span) = {
                // Moved in whole, so the borrows below do not keep them in the future.
                let (key, scope) = (key, scope);
                let (scope_id, id) = RecordId::cached(scope.as_deref(), &key);
                let span = record_span(&id);
                let keyed = Keyed {
                    flow: self,
                    key,
                    scope,
                    scope_id,
                    id,
                    fp,
                };
                (keyed, span)
            };
            // 6. Claim, inline: a replay or a conflict costs no task. The span is entered around
            // each step of 6-9 rather than wrapping them in one more future: a replay's future
            // is moved through every layer above this one, and its size is the cost. The step
            // has one slot, whichever way it comes: read back out of it into a second one,
            // both stayed in this boxed future across the awaits below.
            let mut step = {
                let _entered = span.enter();
                keyed.claim_now(&parts.headers)
            };
            if step.is_none() {
                // A response future dropped mid-claim leaves the claim to `PendingClaim`, which
                // releases it if it was won.
                step = Some(
                    Box::pin(keyed.claim(&parts.headers))
                        .instrument(span.clone())
                        .await,
                );
            }
            match step {
                None => unreachable!("the claim step is taken above"),
                Some(Step::Answer(res)) => Ok(res),
                // Boxed, as is the claimed path, for the same reason.
                Some(Step::FailOpen) => {
                    let mut inner = inner;
                    let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                    Box::pin(inner.call(req))
                        .instrument(span)
                        .await
                        .map(|r| r.map(ResponseBody::stream))
                }
                Some(Step::Claimed(claim, sent)) => {
                    future::commit();
                    Box::pin(keyed.claimed(inner, parts, bytes, claim, sent))
                        .instrument(span)
                        .await
                }
            }
        }
    }
}

/// The span of one keyed request or operation: named by its record id's first 16 hex digits,
/// never by its key; the outcome and the claim's generation are filled in as they are known.
pub(crate) fn record_span(id: &RecordId) -> tracing::Span {
    tracing::info_span!(
        "idempotency",
        record = %&id.to_hex()[..16],
        outcome = tracing::field::Empty,
        generation = tracing::field::Empty,
    )
}

/// What the claim step decided.
#[allow(clippy::large_enum_variant)] // lives on the stack for one await
enum Step<B: Body> {
    /// Run the inner service under this claim, sent to the store at this instant.
    Claimed(Claim, Instant),
    /// Answer without running: a replay, a conflict, a mismatch, a store error.
    Answer(Response<ResponseBody<B>>),
    /// The store failed and the layer fails open: run unprotected.
    FailOpen,
}

struct Keyed {
    flow: Flow,
    key: Arc<str>,
    scope: Option<Arc<str>>,
    scope_id: ScopeId,
    id: RecordId,
    fp: Fingerprint,
}

/// How a claim ends: the record's one rule of step 8, applied by `Keyed::finish`.
// Lives on the stack for one await, as `Completion` does elsewhere: no box per record.
#[allow(clippy::large_enum_variant)]
enum Settlement {
    /// Complete with this answer (or tombstone), then answer.
    Record(Completion),
    /// Release first, then answer, so a retry sent at once runs again.
    Release,
    /// The handler completed the record itself.
    AlreadyRecorded,
}

/// What is left of a claim once its answer is out.
enum After {
    /// The release before the answer failed or timed out: retried while the lease lives.
    Release,
    /// The handler said it recorded the answer itself: checked, and said if it did not.
    CheckRecorded,
    /// The answer streams past `max_response_body`: decided and settled when it ends.
    Stream {
        status: http::StatusCode,
        head: HeaderMap,
        extension: Option<RecordDecision>,
        end: tokio::sync::oneshot::Receiver<StreamEnd>,
    },
}

impl Settlement {
    /// The settlement `decision` calls for; `record` makes the answer to keep.
    fn of(decision: RecordDecision, record: impl FnOnce() -> Completion) -> Self {
        match decision {
            RecordDecision::Record => Self::Record(record()),
            RecordDecision::Release => Self::Release,
            RecordDecision::AlreadyRecorded => Self::AlreadyRecorded,
        }
    }
}

fn outcome(name: Outcome) {
    tracing::Span::current().record("outcome", name.as_str());
}

impl Keyed {
    /// The store calls of this request's claim.
    fn holder(&self) -> calls::Holder<'_> {
        calls::Holder {
            cfg: &self.flow.cfg,
            labels: &self.flow.labels,
            id: &self.id,
        }
    }

    /// Adds the published TTL to a recorded answer or a replay, when configured.
    fn publish_ttl(&self, headers: &mut HeaderMap) {
        if let Some(ttl) = &self.flow.cfg.ttl_value {
            headers.insert(response::TTL_HEADER, ttl.clone());
        }
    }

    /// Names the request's outcome in its span and counts it.
    fn outcome(&self, name: Outcome) {
        outcome(name);
        self.flow.labels.outcome(name);
    }
}

impl Keyed {
    /// Steps 7 to 9 under the claim won at `sent`.
    ///
    /// They run inline until the answer is out; what is left then (settling a released
    /// claim, a streamed answer's end) goes on a task of its own, and so does this whole
    /// flow when its response future is dropped (client gone, a deadline): nothing can cancel
    /// the work between the claim and the record (`future::commit`). Inline saves a spawn and
    /// a cross-thread wake per request.
    ///
    /// Not an `async fn`, which would hold its arguments twice inside every claimed
    /// request's future.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn claimed<S, ReqB, ResB>(
        self,
        inner: S,
        parts: request::Parts,
        bytes: Bytes,
        claim: Claim,
        sent: Instant,
    ) -> impl Future<Output = Answer<ResB, S::Error>>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Send + 'static,
    {
        async move {
            let lease = Lease::new(sent, &self.flow.cfg.timing);
            let (delivery, token, after) = self.execute(inner, parts, bytes, claim, &lease).await;
            if let Some(after) = after {
                let span = tracing::Span::current();
                if let Some(here) = self.spawn_after(after, token, lease, span) {
                    here.await;
                }
            }
            match delivery {
                Ok(answer) => answer,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    }

    /// Steps 7 to 9: run the inner service once, renewing the lease; settle; the answer as
    /// soon as it is known (a released answer does not wait for its release), with the claim's
    /// token and what is left to do after it.
    ///
    /// Not an `async fn`, which would hold its arguments twice inside every claimed
    /// request's future.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn execute<'a, S, ReqB, ResB>(
        &'a self,
        mut inner: S,
        mut parts: request::Parts,
        bytes: Bytes,
        Claim {
            token,
            takeover,
            lapsed_for,
            recovery_point,
            ..
        }: Claim,
        lease: &'a Lease,
    ) -> impl Future<Output = (Delivery<ResB, S::Error>, Token, Option<After>)> + use<'a, S, ReqB, ResB>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
        ResB: Body<Data = Bytes>,
    {
        async move {
            tracing::Span::current().record("generation", token.generation());
            if takeover {
                let scope = self.scope.clone();
                took_over(
                    &self.flow.cfg,
                    &self.flow.labels,
                    scope,
                    self.id,
                    &token,
                    lapsed_for,
                );
            }
            // What a recorded answer's `Vary` names is known only once it exists: keep the
            // request's headers until then, for the layer and for a handler that records itself.
            let request_headers = self
                .flow
                .cfg
                .vary_match
                .then(|| Arc::new(parts.headers.clone()));
            let ctx = IdempotencyContext::new(
                Some(self.key.clone()),
                self.scope.clone(),
                self.scope_id,
                self.id,
                self.fp,
                token,
                self.flow.cfg.clone(),
                request_headers.clone(),
                recovery_point,
            );
            parts.extensions.insert(ctx);
            let req = Request::from_parts(parts, RequestBody::buffered(bytes));

            let work = AssertUnwindSafe(self.work(&mut inner, req)).catch_unwind();
            let result = tokio::select! {
                biased;
                r = work => r,
                never = self.holder().renew(&token, lease) => match never {},
            };
            let (delivery, after) = match result {
                Err(panic) => {
                    let (_, after) = self.finish(Settlement::Release, &token, lease).await;
                    (Err(panic), after)
                }
                Ok(Err(e)) => {
                    let (_, after) = self.finish(Settlement::Release, &token, lease).await;
                    (Ok(Err(e)), after)
                }
                Ok(Ok(work)) => {
                    self.settle(work, request_headers.as_deref(), &token, lease)
                        .await
                }
            };
            (delivery, token, after)
        }
    }

    /// Runs what is left after the answer on a task of its own; where there is no runtime
    /// (it is shutting down), gives it back to run here, before the answer. Boxed, that rare
    /// future does not size every claimed request's.
    fn spawn_after(
        self,
        after: After,
        token: Token,
        lease: Lease,
        span: tracing::Span,
    ) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        let rest = async move { self.after(after, &token, &lease).await }.instrument(span);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                drop(runtime.spawn(rest));
                None
            }
            Err(_) => Some(Box::pin(rest)),
        }
    }

    /// What is left once the answer is out: a release to retry, a handler's record to check,
    /// or a streamed answer to settle when its stream ends.
    async fn after(&self, after: After, token: &Token, lease: &Lease) {
        let (status, head, extension, end) = match after {
            After::Release => return self.holder().release(token, lease).await,
            After::CheckRecorded => return self.holder().check_recorded_by_handler(token).await,
            After::Stream {
                status,
                head,
                extension,
                end,
            } => (status, head, extension, end),
        };
        // The client reads the stream; the claim stays renewed until it ends.
        let ended = tokio::select! {
            biased;
            ended = end => ended,
            never = self.holder().renew(token, lease) => match never {},
        };
        let (how, go) = match ended {
            Ok(StreamEnd { how, go }) => (Ok(how), Some(go)),
            Err(gone) => (Err(gone), None),
        };
        let decision = match how {
            Ok(Ended::Ended(trailers)) => {
                let info = ResponseInfo::new(status, &head, trailers.as_ref());
                match self.decide(extension, &info) {
                    Ok(d) => d,
                    Err(panic) => {
                        tracing::error!(
                            panic = panic_message(&*panic),
                            "the record policy panicked after the response streamed; released"
                        );
                        RecordDecision::Release
                    }
                }
            }
            Ok(Ended::Failed) => RecordDecision::Release,
            // The client dropped the stream before its end: the status is unknown
            // and the work ran, so it must not run again.
            Err(_) => RecordDecision::Record,
        };
        // Over max_response_body: only its status is kept.
        let settlement = Settlement::of(decision, || Completion::Tombstone { status });
        let (_, rest) = self.finish(settlement, token, lease).await;
        // The body holds its last frame until this: settled first, then answered.
        if let Some(go) = go {
            let _ = go.send(());
        }
        match rest {
            Some(After::Release) => self.holder().release(token, lease).await,
            Some(After::CheckRecorded) => self.holder().check_recorded_by_handler(token).await,
            Some(After::Stream { .. }) | None => {}
        }
    }

    /// 8. What the work produced decides record or release; [`finish`](Self::finish) does it.
    ///
    /// Not an `async fn`, which would hold its arguments twice inside every claimed
    /// request's future.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn settle<'a, ResB, E>(
        &'a self,
        work: Work<ResB>,
        request_headers: Option<&'a HeaderMap>,
        token: &'a Token,
        lease: &'a Lease,
    ) -> impl Future<Output = (Delivery<ResB, E>, Option<After>)> + use<'a, ResB, E>
    where
        ResB: Body<Data = Bytes>,
    {
        async move {
            let cfg = &*self.flow.cfg;
            let (settlement, res) = match work {
                Work::Unbuffered(RecordDecision::AlreadyRecorded, res) => {
                    (Settlement::AlreadyRecorded, res)
                }
                Work::Unbuffered(_, res) | Work::Failed(res) => (Settlement::Release, res),
                Work::TooLarge(res) => {
                    let tomb = Completion::Tombstone {
                        status: res.status(),
                    };
                    (Settlement::Record(tomb), res)
                }
                Work::Streaming {
                    response,
                    extension,
                    end,
                } => {
                    // Settled when the stream ends, after the answer.
                    let after = After::Stream {
                        status: response.status(),
                        head: response.headers().clone(),
                        extension,
                        end,
                    };
                    return (Ok(Ok(response)), Some(after));
                }
                Work::Buffered {
                    mut parts,
                    mut data,
                    trailers,
                } => {
                    let info = ResponseInfo::new(parts.status, &parts.headers, trailers.as_ref());
                    let decision = match self.decide(parts.extensions.get().copied(), &info) {
                        Ok(d) => d,
                        Err(panic) => {
                            let (_, after) = self.finish(Settlement::Release, token, lease).await;
                            return (Err(panic), after);
                        }
                    };
                    let settlement = Settlement::of(decision, || {
                        // The headers and body may move into the record, and come back once
                        // it is stored.
                        let completion = crate::recording::completion_taking(
                            cfg.recording(),
                            request_headers,
                            parts.status,
                            &mut parts.headers,
                            &mut data,
                            trailers.as_ref(),
                        );
                        if let Completion::Response(r) = &completion {
                            self.flow.labels.recorded_body(r.body.len());
                        }
                        completion
                    });
                    let (recorded, after) = self.finish(settlement, token, lease).await;
                    if let Some(completion) = recorded {
                        let replayable = matches!(completion, Completion::Response(_));
                        crate::recording::give_back(&mut parts.headers, &mut data, completion);
                        if replayable {
                            self.publish_ttl(&mut parts.headers);
                        }
                    }
                    let res = Response::from_parts(parts, ResponseBody::full(data, trailers));
                    return (Ok(Ok(res)), after);
                }
            };
            let (_, after) = self.finish(settlement, token, lease).await;
            (Ok(Ok(res)), after)
        }
    }

    /// The record decision; a panicking user policy is caught so the claim can be released
    /// before the panic is resumed in the caller.
    fn decide(
        &self,
        extension: Option<RecordDecision>,
        info: &ResponseInfo<'_>,
    ) -> Result<RecordDecision, Panic> {
        let cfg = &*self.flow.cfg;
        std::panic::catch_unwind(AssertUnwindSafe(|| decide(&*cfg.policy, extension, info)))
    }

    /// Step 8, before the answer: records or releases. A recorded answer after its record
    /// (retried while the lease lives), a released one after one release attempt under the
    /// store deadline, so a retry sent at once finds the key free. Gives back the completion
    /// it recorded, and what is left after the answer: only a release that failed or timed
    /// out goes on, while the lease lives.
    ///
    /// Not an `async fn`, which would hold its arguments twice inside every claimed
    /// request's future.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn finish<'a>(
        &'a self,
        settlement: Settlement,
        token: &'a Token,
        lease: &'a Lease,
    ) -> impl Future<Output = (Option<Completion>, Option<After>)> + use<'a> {
        async move {
            match settlement {
                Settlement::Record(completion) => {
                    self.outcome(match completion {
                        Completion::Response(_) => Outcome::Executed,
                        Completion::Tombstone { .. } => Outcome::Tombstoned,
                    });
                    self.holder().complete(token, &completion, lease).await;
                    (Some(completion), None)
                }
                Settlement::Release => {
                    self.outcome(Outcome::Released);
                    let first = self.holder().release_once(token, lease.timeout).await;
                    (None, first.is_err().then_some(After::Release))
                }
                Settlement::AlreadyRecorded => {
                    self.outcome(Outcome::Executed);
                    (None, Some(After::CheckRecorded))
                }
            }
        }
    }
}
