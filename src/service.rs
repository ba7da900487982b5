//! [`Idempotency`]: the service, and the request flow of DESIGN.md read top to bottom.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{request, HeaderMap, Method, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody, StreamEnd};
use crate::context::IdempotencyContext;
use crate::error::{ErrorKind, IdempotencyError};
use crate::fingerprint::fingerprint;
use crate::key;
use crate::layer::{Config, Scope};
use crate::metrics::{timed, Labels};
use crate::policy::{decide, is_grpc, RecordDecision, ResponseInfo};
use crate::record::{
    self, Completion, Fingerprint, RecordId, RecordState, ScopeId, StoredResponse, Token,
};
use crate::response;
use crate::store::{Claim, ClaimOutcome, StoreError, StoreErrorKind};

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
        // gRPC handling is the configuration's choice, never the client's alone.
        // gRPC calls are POSTs: other methods skip the header lookup.
        let grpc = req.method() == Method::POST && is_grpc(req.headers()) && grpc_mode(cfg);
        let eligible = if grpc {
            req.method() == Method::POST && cfg.grpc_protected(req.uri().path())
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
                labels.outcome("key_missing");
                return ResponseFuture::ready(render(cfg, grpc, err));
            }
            Err(e) => {
                let err = IdempotencyError::new(ErrorKind::KeyInvalid, e.detail());
                labels.outcome("key_invalid");
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
            labels,
        };
        ResponseFuture::flow(Box::pin(flow.run(inner, req)))
    }
}

/// Whether the layer serves gRPC; says once when a gRPC request meets a layer that does not.
fn grpc_mode(cfg: &Config) -> bool {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !cfg.grpc && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!("a gRPC request reached an idempotency layer without with_grpc(); it is handled as HTTP");
    }
    cfg.grpc
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
/// What the detached task hands back to the response future: an answer, or a panic to resume.
type Delivery<B, E> = Result<Answer<B, E>, Panic>;

/// About 30 years: later than any deadline that matters, small enough to add to any `Instant`.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// `at + d`, or far in the future where that would overflow: a "wait forever" or "keep
/// forever" setting must not panic.
fn deadline(at: Instant, d: Duration) -> Instant {
    at.checked_add(d).unwrap_or_else(|| at + FAR_FUTURE)
}

/// Runs one store call under `until`. Past it the outcome is unknown, not failed: the call
/// may still take effect, so no caller reads a timeout as "did not happen".
async fn bounded<T>(
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
async fn within<F: Future>(
    until: Instant,
    future: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut future = std::pin::pin!(future);
    if let Poll::Ready(out) = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await
    {
        return Ok(out);
    }
    tokio::time::timeout_at(until, future).await
}

/// Displays an error with its whole source chain: "a: b: c".
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

struct Flow {
    cfg: Arc<Config>,
    grpc: bool,
    key: Arc<str>,
    labels: Labels,
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
            Scope::Unscoped => None,
            Scope::Unset => {
                self.labels.outcome("scope_missing");
                tracing::error!("idempotency layer has no scope: call with_scope (or unscoped, to share one key space on purpose); keyed requests are refused");
                let err = IdempotencyError::new(
                    ErrorKind::ScopeMissing,
                    "the request's idempotency scope could not be determined",
                );
                return Ok(self.error(err));
            }
            Scope::Fn(f) => match f(&parts) {
                Some(s) => Some(s.into()),
                None => {
                    self.labels.outcome("scope_missing");
                    tracing::error!("idempotency scope function returned None: the idempotency layer runs before the layer that sets the scope. Put authentication outside it: with axum, call `.layer(auth)` after `.layer(idempotency)` (the last `.layer()` call is the outermost); with ServiceBuilder or tonic, list the auth layer first");
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
        let declared = content_length(&parts.headers);
        if declared.is_some_and(|n| n > limit as u64) {
            self.labels.outcome("body_too_large");
            return Ok(self.error(too_large()));
        }
        let read = buffer_body(body, limit, declared.unwrap_or(0) as usize);
        let body_deadline = deadline(Instant::now(), self.cfg.request_body_timeout);
        let bytes = match within(body_deadline, read).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(BodyError::TooLarge)) => {
                self.labels.outcome("body_too_large");
                return Ok(self.error(too_large()));
            }
            Ok(Err(BodyError::Failed(e))) => {
                self.labels.outcome("body_unreadable");
                tracing::debug!(error = %e, "request body unreadable");
                return Ok(self.error(IdempotencyError::new(
                    ErrorKind::BodyUnreadable,
                    "the request body could not be read",
                )));
            }
            Err(_) => {
                self.labels.outcome("body_timeout");
                return Ok(self.error(IdempotencyError::new(
                    ErrorKind::BodyTimeout,
                    "the request body did not arrive in time; nothing was processed",
                )));
            }
        };

        // 4. Fingerprint. 5. Record id: the store never sees the raw key.
        // The path the client sent: inside axum's nested routers `parts.uri` lost its prefix.
        #[cfg(feature = "axum")]
        let target = crate::axum::original_uri(&parts);
        #[cfg(not(feature = "axum"))]
        let target = &parts.uri;
        let fp = fingerprint(&parts, target, &bytes, &self.cfg.fingerprint);
        let scope_id = ScopeId::new(scope.as_deref());
        let id = RecordId::in_scope(&scope_id, scope.as_deref(), &self.key);
        let span = tracing::info_span!(
            "idempotency",
            record = %&id.to_hex()[..16],
            outcome = tracing::field::Empty,
            generation = tracing::field::Empty,
        );

        let keyed = Keyed {
            flow: self,
            scope,
            scope_id,
            id,
            fp,
        };
        // 6. Claim, inline: a replay or a conflict costs no task. A response future dropped
        // mid-claim leaves the claim to `PendingClaim`, which releases it if it was won.
        let (claim, sent) = match keyed.claim(&parts.headers).instrument(span.clone()).await {
            Step::Answer(res) => return Ok(res),
            Step::FailOpen => {
                let mut inner = inner;
                let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                return inner.call(req).await.map(|r| r.map(ResponseBody::stream));
            }
            Step::Claimed(claim, sent) => (claim, sent),
        };
        // 7-9 run here, inline, until the answer is out; what is left then (settling a
        // released claim, a streamed answer's end) or when this future is dropped (client
        // gone, a deadline) moves onto a task of its own: nothing can cancel the work between
        // the claim and the record. Inline saves a spawn and a cross-thread wake per request.
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let mut work = Detachable::new(
            async move {
                let lease = Lease::new(sent, &keyed.flow.cfg.retention);
                keyed.execute(inner, parts, bytes, claim, lease, tx).await;
            }
            .instrument(span),
        );
        // Work that ended has sent or dropped `tx`, so `rx` is ready then.
        let delivered = std::future::poll_fn(|cx| {
            work.poll_inline(cx);
            Pin::new(&mut rx).poll(cx)
        })
        .await;
        drop(work);
        match delivered {
            Ok(Ok(answer)) => answer,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            // The task itself panicked outside the inner call: a bug in this crate.
            Err(_) => panic!("tower-idempotency: the request task ended without an answer"),
        }
    }
}

/// The work of a won claim, polled inline by the response future. Dropped unfinished (the
/// answer is out and settling goes on, or the response future itself was dropped), it goes
/// on running on a task of its own.
struct Detachable {
    future: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Detachable {
    fn new(future: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }

    /// Polls the work, unless it has finished.
    fn poll_inline(&mut self, cx: &mut Context<'_>) {
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

type ClaimFuture = Pin<Box<dyn Future<Output = Result<ClaimOutcome, StoreError>> + Send>>;

/// A claim in flight. Dropped before it resolves (its deadline passed, or its response
/// future was dropped), it finishes on its own task and releases the claim if it won it, so
/// the key is not held for a whole lease by a request that will never run.
struct PendingClaim {
    future: Option<ClaimFuture>,
    cfg: Arc<Config>,
    labels: Labels,
    id: RecordId,
    sent: Instant,
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
        let (cfg, id, labels) = (self.cfg.clone(), self.id, self.labels.clone());
        // A claim that took effect holds the key for one lease from when it was sent at the
        // earliest; past that it lapses on its own, so nothing waits longer.
        let lease_end = deadline(self.sent, cfg.retention.lease());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Ok(Ok(ClaimOutcome::Claimed(claim))) =
                    tokio::time::timeout_at(lease_end, future).await
                {
                    let store = &*cfg.store;
                    let timeout = cfg.retention.store_timeout();
                    let released = retry_until(lease_end, timeout, || {
                        timed(labels.store_call("release"), store.release(&id, &claim.token))
                    })
                    .await;
                    if let Err(e) = released {
                        tracing::warn!(error = %Chain(&e), "could not release a claim whose request went away; it lapses with its lease");
                    }
                }
            });
        }
    }
}

/// The holder's view of its lease. Every instant is taken when a call was *sent*, so the
/// local estimate of the lease's end is never later than the store's own.
struct Lease {
    length: Duration,
    every: Duration,
    timeout: Duration,
    state: Mutex<LeaseState>,
}

struct LeaseState {
    /// When the last claim or renewal that succeeded was sent.
    renewed: Instant,
    /// When the last renewal was due (the claim's send time before the first).
    due: Instant,
}

impl Lease {
    fn new(sent: Instant, retention: &crate::Retention) -> Self {
        let length = retention.lease();
        Self {
            length,
            // lease / 3: one renewal can fail (a store blip) and the next lands with a third of
            // the lease to spare; after two failures the third is sent at the lease's edge.
            every: length / 3,
            timeout: retention.store_timeout(),
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
    fn end(&self) -> Instant {
        deadline(self.state().renewed, self.length)
    }

    /// When the next renewal is due. Renewals run at fixed times from the claim's send
    /// time; one that is already due (a late claim reply) runs at once. A schedule more than
    /// one interval behind restarts from now rather than firing a burst.
    fn next_due(&self) -> Instant {
        let mut state = self.state();
        let now = Instant::now();
        let mut next = deadline(state.due, self.every);
        if deadline(next, self.every) <= now {
            next = now;
        }
        state.due = next;
        next
    }

    fn renewed(&self, sent: Instant) {
        let mut state = self.state();
        state.renewed = state.renewed.max(sent);
    }
}

struct Keyed {
    flow: Flow,
    scope: Option<Arc<str>>,
    scope_id: ScopeId,
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

fn outcome(name: &'static str) {
    tracing::Span::current().record("outcome", name);
}

impl Keyed {
    /// Adds the published TTL to a recorded answer or a replay, when configured.
    fn publish_ttl(&self, headers: &mut HeaderMap) {
        let cfg = &*self.flow.cfg;
        if cfg.ttl_header {
            let secs = cfg.retention.ttl().as_secs();
            headers.insert(crate::layer::TTL_HEADER, http::HeaderValue::from(secs));
        }
    }

    /// Names the request's outcome in its span and counts it.
    fn outcome(&self, name: &'static str) {
        outcome(name);
        self.flow.labels.outcome(name);
    }
}

/// Retries `op` until it succeeds, is fenced, or `until` passes. Each attempt runs under
/// its own deadline, `timeout` from its start and never past `until`.
async fn retry_until<F, Fut>(until: Instant, timeout: Duration, mut op: F) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let mut pause = BACKOFF_START;
    loop {
        let attempt = deadline(Instant::now(), timeout).min(until);
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

/// Wait mode's registry: one poller per record id, many listeners.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    polls: Mutex<HashMap<RecordId, tokio::sync::watch::Sender<bool>>>,
    waiting: AtomicUsize,
}

/// One waiting request; leaving (dropped) frees its place under the cap.
struct WaitTicket {
    changed: tokio::sync::watch::Receiver<bool>,
    waiters: Arc<Waiters>,
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, AtomicOrdering::Relaxed);
    }
}

impl Waiters {
    fn polls(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<RecordId, tokio::sync::watch::Sender<bool>>> {
        self.polls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Listens for a change of `id`, starting its poller if none runs; `None` past the cap.
    fn join(cfg: &Arc<Config>, id: RecordId) -> Option<WaitTicket> {
        let waiters = cfg.waiters.clone();
        if waiters.waiting.fetch_add(1, AtomicOrdering::Relaxed) >= cfg.max_waiters {
            waiters.waiting.fetch_sub(1, AtomicOrdering::Relaxed);
            return None;
        }
        let changed = {
            let mut polls = waiters.polls();
            match polls.get(&id) {
                Some(tx) => tx.subscribe(),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(false);
                    polls.insert(id, tx.clone());
                    tokio::spawn(poll_record(cfg.clone(), id, tx));
                    rx
                }
            }
        };
        Some(WaitTicket { changed, waiters })
    }
}

/// Polls `id` with jittered backoff until it is no longer a live claim, then tells every
/// listener; stops early when nobody listens any more.
async fn poll_record(cfg: Arc<Config>, id: RecordId, tx: tokio::sync::watch::Sender<bool>) {
    let mut pause = BACKOFF_START;
    loop {
        tokio::time::sleep(jitter(pause)).await;
        pause = (pause * 2).min(BACKOFF_MAX);
        {
            // Under the lock, so no listener joins between this check and the removal.
            let mut polls = cfg.waiters.polls();
            if tx.receiver_count() == 0 {
                polls.remove(&id);
                return;
            }
        }
        let read = deadline(Instant::now(), cfg.retention.store_timeout());
        let live = matches!(
            bounded(read, timed(crate::metrics::store_timer(cfg.store.name(), "get"), cfg.store.get(&id))).await,
            Ok(Some(r)) if matches!(r.state, RecordState::InProgress { lease_remaining } if !lease_remaining.is_zero())
        );
        // Completed, released, lapsed or a store error: the listeners claim again to find out.
        if !live {
            cfg.waiters.polls().remove(&id);
            let _ = tx.send(true);
            return;
        }
    }
}

/// A pause between half of `pause` and all of it, so pollers on many replicas spread out.
fn jitter(pause: Duration) -> Duration {
    let r = getrandom::u32().unwrap_or(u32::MAX);
    let half = pause / 2;
    half + half.mul_f64(f64::from(r) / f64::from(u32::MAX))
}

impl Keyed {
    async fn claim<B: Body>(&self, request: &HeaderMap) -> Step<B> {
        let cfg = &*self.flow.cfg;
        let (lease, ttl) = (cfg.retention.lease(), cfg.retention.ttl());
        let timeout = cfg.retention.store_timeout();
        let wait_until = cfg.wait.map(|w| deadline(Instant::now(), w));
        loop {
            // The lease clock starts here: the store cannot have started it earlier.
            let sent = Instant::now();
            let pending = PendingClaim {
                future: Some({
                    let (store, id, fp, scope) =
                        (cfg.store.clone(), self.id, self.fp, self.scope_id);
                    let timer = self.flow.labels.store_call("claim");
                    Box::pin(async move {
                        let claim = store.claim_in_scope(&scope, &id, &fp, lease, ttl);
                        timed(timer, claim).await
                    })
                }),
                cfg: self.flow.cfg.clone(),
                labels: self.flow.labels.clone(),
                id: self.id,
                sent,
            };
            let record = match bounded(deadline(sent, timeout), pending).await {
                Ok(ClaimOutcome::Claimed(claim)) => return Step::Claimed(claim, sent),
                Ok(ClaimOutcome::Existing(record)) => record,
                Err(e) if e.kind() == StoreErrorKind::QuotaExceeded => {
                    self.outcome("over_quota");
                    if cfg.quota_fail_open {
                        tracing::warn!("idempotency scope over its quota; running unprotected (quota fail open)");
                        return Step::FailOpen;
                    }
                    let err = IdempotencyError::new(
                        ErrorKind::QuotaExceeded,
                        "this caller holds as many idempotency records as it may; the request was not processed",
                    );
                    return Step::Answer(self.flow.error(err));
                }
                Err(e) if cfg.fail_open => {
                    self.outcome("store_error");
                    tracing::warn!(error = %Chain(&e), "idempotency store failed; running unprotected (fail open)");
                    return Step::FailOpen;
                }
                Err(e) => {
                    self.outcome("store_error");
                    tracing::error!(error = %Chain(&e), "idempotency store failed; refusing the request (fail closed)");
                    let detail = if e.kind() == StoreErrorKind::Unknown {
                        "the idempotency store did not answer in time; the request was not processed"
                    } else {
                        "the idempotency store is unavailable; the request was not processed"
                    };
                    let err = IdempotencyError::new(ErrorKind::StoreUnavailable, detail)
                        .retry_after(STORE_RETRY_AFTER)
                        .source(e);
                    return Step::Answer(self.flow.error(err));
                }
            };
            if record.fingerprint != self.fp {
                self.outcome("mismatch");
                let err = IdempotencyError::new(
                    ErrorKind::Mismatch,
                    "this idempotency key was already used with a different request",
                );
                return Step::Answer(self.flow.error(err));
            }
            match record.state {
                RecordState::Completed(Completion::Response(stored)) => {
                    if cfg.vary_match && !response::vary_matches(&stored, request) {
                        self.outcome("mismatch");
                        let err = IdempotencyError::new(
                            ErrorKind::Mismatch,
                            "this idempotency key was already used by a request whose answer varies on request headers (its Vary) that this one sends differently",
                        );
                        return Step::Answer(self.flow.error(err));
                    }
                    self.outcome("replayed");
                    let mut res = response::replay(stored);
                    self.publish_ttl(res.headers_mut());
                    return Step::Answer(res);
                }
                RecordState::Completed(Completion::Tombstone { status }) => {
                    self.outcome("tombstoned");
                    let err = IdempotencyError::new(ErrorKind::ResponseNotRetained, "the original request completed, but its response was too large to keep; it was not run again")
                        .original_status(status);
                    return Step::Answer(self.flow.error(err));
                }
                RecordState::InProgress { lease_remaining } => {
                    if let Some(until) = wait_until {
                        let started = Instant::now();
                        let changed = self.wait_for_change(until).await;
                        self.flow.labels.waited(started.elapsed());
                        if changed {
                            continue;
                        }
                    }
                    self.outcome("conflict");
                    let err = IdempotencyError::new(
                        ErrorKind::InProgress,
                        "a request with this idempotency key is still being processed",
                    )
                    .retry_after(lease_remaining.min(cfg.in_progress_retry_after));
                    return Step::Answer(self.flow.error(err));
                }
            }
        }
    }

    /// Wait mode: waits until the record is no longer a live claim (`true`), or `until`
    /// passes, or too many wait already (`false`). Waiters of one record share one poll.
    async fn wait_for_change(&self, until: Instant) -> bool {
        let Some(mut ticket) = Waiters::join(&self.flow.cfg, self.id) else {
            return false;
        };
        let changed = tokio::time::timeout_at(until, ticket.changed.wait_for(|c| *c)).await;
        changed.is_ok()
    }

    /// Steps 7 to 9: run the inner service once, renewing the lease; settle; answer through
    /// `tx` as soon as the answer is known (a released answer does not wait for its release).
    async fn execute<S, ReqB, ResB>(
        &self,
        mut inner: S,
        mut parts: request::Parts,
        bytes: Bytes,
        Claim {
            token,
            takeover,
            lapsed_for,
        }: Claim,
        lease: Lease,
        tx: tokio::sync::oneshot::Sender<Delivery<ResB, S::Error>>,
    ) where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
        ResB: Body<Data = Bytes>,
    {
        tracing::Span::current().record("generation", token.generation());
        if takeover {
            self.flow.labels.event("takeover");
            tracing::warn!(generation = token.generation(), "took over a claim whose lease lapsed; the earlier attempt may have done part of the work");
            if let Some(hook) = &self.flow.cfg.on_abandoned {
                // Generations grow by one per takeover.
                let abandoned = crate::Abandoned {
                    scope: self.scope.clone(),
                    record: self.id,
                    old_generation: token.generation().saturating_sub(1),
                    new_generation: token.generation(),
                    abandoned_for: lapsed_for,
                };
                if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| hook(&abandoned)))
                {
                    tracing::error!(
                        panic = panic_message(&*panic),
                        "the abandoned-key hook panicked; the request runs"
                    );
                }
            }
        }
        let ctx = IdempotencyContext::new(
            self.flow.key.clone(),
            self.scope.clone(),
            self.id,
            self.fp,
            token,
            self.flow.cfg.clone(),
        );
        parts.extensions.insert(ctx);
        // What a recorded answer's `Vary` names is known only once it exists: keep the
        // request's headers until then.
        let request_headers = self.flow.cfg.vary_match.then(|| parts.headers.clone());
        let req = Request::from_parts(parts, RequestBody::buffered(bytes));

        let work = AssertUnwindSafe(self.work(&mut inner, req)).catch_unwind();
        let result = tokio::select! {
            biased;
            r = work => r,
            never = self.renew(&token, &lease) => match never {},
        };
        match result {
            Err(panic) => {
                self.outcome("released");
                let _ = tx.send(Err(panic));
                self.release(&token, &lease).await;
            }
            Ok(Err(e)) => {
                self.outcome("released");
                let _ = tx.send(Ok(Err(e)));
                self.release(&token, &lease).await;
            }
            Ok(Ok(work)) => {
                self.settle(work, request_headers.as_ref(), &token, &lease, tx)
                    .await
            }
        }
    }

    /// 8. Record or release what the work produced, and answer.
    async fn settle<ResB, E>(
        &self,
        work: Work<ResB>,
        request_headers: Option<&HeaderMap>,
        token: &Token,
        lease: &Lease,
        tx: tokio::sync::oneshot::Sender<Delivery<ResB, E>>,
    ) where
        ResB: Body<Data = Bytes>,
    {
        let cfg = &*self.flow.cfg;
        match work {
            Work::Unbuffered(RecordDecision::AlreadyRecorded, res) => {
                self.outcome("executed");
                let _ = tx.send(Ok(Ok(res)));
                self.check_recorded_by_handler(token).await;
            }
            Work::Unbuffered(_, res) | Work::Failed(res) => {
                self.outcome("released");
                let _ = tx.send(Ok(Ok(res)));
                self.release(token, lease).await;
            }
            Work::TooLarge(res) => {
                self.outcome("tombstoned");
                let tomb = Completion::Tombstone {
                    status: res.status(),
                };
                self.complete(token, &tomb, lease).await;
                let _ = tx.send(Ok(Ok(res)));
            }
            Work::Streaming {
                response,
                extension,
                end,
            } => {
                let status = response.status();
                let head = response.headers().clone();
                let _ = tx.send(Ok(Ok(response)));
                // The client reads the stream; the claim stays renewed until it ends.
                let ended = tokio::select! {
                    biased;
                    ended = end => ended,
                    never = self.renew(token, lease) => match never {},
                };
                let decision = match ended {
                    Ok(StreamEnd::Ended(trailers)) => {
                        let info = ResponseInfo::new(status, &head, trailers.as_ref());
                        match self.decide(extension, &info) {
                            Ok(d) => d,
                            Err(panic) => {
                                tracing::error!(panic = panic_message(&*panic), "the record policy panicked after the response streamed; released");
                                RecordDecision::Release
                            }
                        }
                    }
                    Ok(StreamEnd::Failed) => RecordDecision::Release,
                    // The client dropped the stream before its end: the status is unknown
                    // and the work ran, so it must not run again.
                    Err(_) => RecordDecision::Record,
                };
                match decision {
                    RecordDecision::Record => {
                        self.outcome("tombstoned");
                        self.complete(token, &Completion::Tombstone { status }, lease)
                            .await;
                    }
                    RecordDecision::Release => {
                        self.outcome("released");
                        self.release(token, lease).await;
                    }
                    RecordDecision::AlreadyRecorded => {
                        self.outcome("executed");
                        self.check_recorded_by_handler(token).await;
                    }
                }
            }
            Work::Buffered {
                parts,
                data,
                trailers,
            } => {
                let info = ResponseInfo::new(parts.status, &parts.headers, trailers.as_ref());
                let decision = match self.decide(parts.extensions.get().copied(), &info) {
                    Ok(d) => d,
                    Err(panic) => {
                        self.outcome("released");
                        let _ = tx.send(Err(panic));
                        self.release(token, lease).await;
                        return;
                    }
                };
                let fits = || {
                    record::fits_record(&parts.headers)
                        && trailers.as_ref().is_none_or(record::fits_record)
                };
                match decision {
                    RecordDecision::Record if !fits() => {
                        // Beyond the record's header caps: kept as a tombstone, as a body
                        // beyond max_response_body is, so it is never run twice.
                        self.outcome("tombstoned");
                        let tomb = Completion::Tombstone {
                            status: parts.status,
                        };
                        self.complete(token, &tomb, lease).await;
                        let res = Response::from_parts(parts, ResponseBody::full(data, trailers));
                        let _ = tx.send(Ok(Ok(res)));
                    }
                    RecordDecision::Record => {
                        self.outcome("executed");
                        let mut headers = cfg.recorded_headers(&parts.headers);
                        if let Some(request) = request_headers {
                            response::note_vary(&mut headers, request);
                        }
                        let stored = StoredResponse {
                            status: parts.status,
                            headers,
                            body: data.clone(),
                            trailers: trailers.as_ref().map(|t| cfg.recorded_headers(t)),
                        };
                        self.flow.labels.recorded_body(data.len());
                        self.complete(token, &Completion::Response(stored), lease)
                            .await;
                        let mut parts = parts;
                        self.publish_ttl(&mut parts.headers);
                        let res = Response::from_parts(parts, ResponseBody::full(data, trailers));
                        let _ = tx.send(Ok(Ok(res)));
                    }
                    RecordDecision::Release => {
                        self.outcome("released");
                        let res = Response::from_parts(parts, ResponseBody::full(data, trailers));
                        let _ = tx.send(Ok(Ok(res)));
                        self.release(token, lease).await;
                    }
                    RecordDecision::AlreadyRecorded => {
                        self.outcome("executed");
                        let res = Response::from_parts(parts, ResponseBody::full(data, trailers));
                        let _ = tx.send(Ok(Ok(res)));
                        self.check_recorded_by_handler(token).await;
                    }
                }
            }
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
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            decide(&*cfg.policy, extension, cfg.release_on_no_store, info)
        }))
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
            let decision = decide(&*cfg.policy, extension, cfg.release_on_no_store, &info);
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

    /// Records, retrying while the lease lives; then the caller answers anyway.
    async fn complete(&self, token: &Token, completion: &Completion, lease: &Lease) {
        let cfg = &*self.flow.cfg;
        let (store, ttl) = (&*cfg.store, cfg.retention.ttl());
        let result = retry_until(lease.end(), lease.timeout, || {
            let call = store.complete(&self.id, token, completion, ttl);
            timed(self.flow.labels.store_call("complete"), call)
        })
        .await;
        match result {
            Ok(()) => self.flow.labels.event("recorded"),
            Err(e) if e.is_fenced() => {
                if self.completed_by(token).await == Some(true) {
                    tracing::warn!("the handler completed the record itself; mark its response with RecordDecision::AlreadyRecorded so the layer does not try again");
                } else {
                    self.flow.labels.event("fenced");
                    tracing::error!(error = %Chain(&e), "idempotency record fenced: the lease lapsed and another attempt took over; this answer was not recorded");
                }
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), "idempotency record failed until the lease ran out; the answer goes to the client unrecorded and the key stays in progress until its lease lapses")
            }
        }
    }

    /// Releases, retrying while the lease lives; a failed release lapses with the lease.
    async fn release(&self, token: &Token, lease: &Lease) {
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
            Err(e) if e.is_fenced() => {
                self.flow.labels.event("fenced");
                tracing::error!(error = %Chain(&e), "idempotency release fenced: the lease lapsed and another attempt took over");
            }
            Err(e) => {
                tracing::error!(error = %Chain(&e), "idempotency release failed until the lease ran out; retries get 409 until it lapses")
            }
        }
    }

    /// Whether the record is completed by this token's generation (`None`: unknown).
    async fn completed_by(&self, token: &Token) -> Option<bool> {
        let cfg = &*self.flow.cfg;
        let read = deadline(Instant::now(), cfg.retention.store_timeout());
        let get = timed(self.flow.labels.store_call("get"), cfg.store.get(&self.id));
        match bounded(read, get).await {
            Ok(Some(r)) => Some(
                matches!(r.state, RecordState::Completed(_)) && r.generation == token.generation(),
            ),
            Ok(None) => Some(false),
            Err(_) => None,
        }
    }

    /// After `RecordDecision::AlreadyRecorded`: says so if the handler did not complete the
    /// record, since retries then get 409 for a lease and a takeover runs the work again.
    async fn check_recorded_by_handler(&self, token: &Token) {
        if self.completed_by(token).await == Some(false) {
            tracing::error!("the handler marked its response RecordDecision::AlreadyRecorded, but the record was not completed by its claim; retries get 409 until the lease lapses, then run again");
        }
    }

    /// Renews the lease at fixed times for as long as it is polled. Never returns. Each
    /// renewal runs under its own deadline, below `lease / 3`, so it ends before the next
    /// one is due: one hung or failed renewal never delays the next.
    async fn renew(&self, token: &Token, lease: &Lease) -> std::convert::Infallible {
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
                        self.flow.labels.event("fenced");
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

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string panic")
}

enum BodyError {
    TooLarge,
    Failed(BoxError),
}

/// Reads a request body into one buffer, sized from `Content-Length` (already checked
/// against `limit`). Each frame is copied and dropped at once: a body sent in many small
/// frames must not pin a read buffer per frame until the end.
async fn buffer_body<B>(body: B, limit: usize, declared: usize) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut buf = BytesMut::with_capacity(declared.min(limit));
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|e| BodyError::Failed(e.into()))?;
        if let Ok(data) = frame.into_data() {
            if data.len() > limit - buf.len() {
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.freeze())
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
