//! The client side: retries that are safe to send and do not stampede.
//!
//! An `Idempotency-Key` only helps if the client retries well. [`IdempotentRetryLayer`] wraps
//! any tower client of `http::Request<Full<Bytes>>` (the hyper-util client, a tonic channel,
//! your own service) and, for every request through it:
//!
//! 1. **gives it one key**: the `Idempotency-Key` the caller set, else the one
//!    [`with_key`](IdempotentRetryLayer::with_key) derives (such as `refund:order-1042`), else
//!    a random UUIDv4. Every attempt sends the same key and the same bytes: the body is
//!    buffered once;
//! 2. **retries only what can succeed later**: transport errors and timeouts; `408`, `429`,
//!    `500`, `502`, `503`, `504`; the server layer's `409` "still in progress" (it carries
//!    `Retry-After`); gRPC `UNAVAILABLE`, and `ABORTED` or `RESOURCE_EXHAUSTED` that carry a
//!    `RetryInfo`. Never `400`, `401`, `403`, `404`, `422`, nor gRPC `INVALID_ARGUMENT` or
//!    `FAILED_PRECONDITION`;
//! 3. **waits** with exponential backoff and full jitter ([`Backoff`], [`Jitter`]), and never
//!    sooner than the server asked: `Retry-After` in seconds or as an HTTP-date, or gRPC
//!    `RetryInfo`;
//! 4. **stays within a retry budget** ([`RetryBudget`], tower's `TpsBudget`): retries add at
//!    most a fraction of the traffic, so an upstream that is down is not hit four times as hard;
//! 5. **respects the caller's deadline** ([`Deadline`],
//!    [`with_deadline`](IdempotentRetryLayer::with_deadline)): no retry is sent that would start
//!    past it. When the wait (a `409`'s `Retry-After` included) would end past it, the last
//!    answer is returned at once, not after sleeping out what is left: a retry sent before
//!    the server's hint would most likely get the same `409`, and the caller gets its
//!    remaining time back to answer its own caller (it can retry later with the same key,
//!    from [`RetryOutcome::key`]);
//! 6. **reports** on the final response a [`RetryOutcome`] extension: the attempts it took,
//!    whether the answer was a replay (`Idempotent-Replayed: true`), and the key.
//!
//! The retry loop is tower's [`Retry`](tower::retry::Retry) with a policy of this crate.
//!
//! # Example
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::client::{IdempotentRetryLayer, RetryOutcome};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // An upstream that fails twice, then charges.
//! let calls = Arc::new(AtomicUsize::new(0));
//! let upstream = service_fn(move |req: Request<Full<Bytes>>| {
//!     let n = calls.fetch_add(1, Ordering::SeqCst);
//!     async move {
//!         assert!(req.headers().contains_key("idempotency-key"));
//!         let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!         let mut res = Response::new(Full::new(Bytes::new()));
//!         *res.status_mut() = status;
//!         Ok::<_, std::convert::Infallible>(res)
//!     }
//! });
//! let client = ServiceBuilder::new()
//!     .layer(IdempotentRetryLayer::new())
//!     .service(upstream);
//!
//! let res = client
//!     .oneshot(Request::post("/v1/payments").body(Full::new(Bytes::from("{}"))).unwrap())
//!     .await
//!     .unwrap();
//! assert_eq!(res.status(), StatusCode::CREATED);
//! let outcome = res.extensions().get::<RetryOutcome>().unwrap();
//! assert_eq!(outcome.attempts(), 3);
//! assert!(!outcome.replayed());
//! # }
//! ```
//!
//! The inner service takes a [`BufferedRequest`], `http::Request<Full<Bytes>>`:
//! [`Bytes`] and [`Full`] are re-exported here, so a client needs no `bytes` or
//! `http-body-util` of its own. With hyper-util,
//! `Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>()` is the inner service
//! (`examples/client`). With tonic, map the buffered body into tonic's own in between:
//! `.map_request(|r: BufferedRequest| r.map(tonic::body::Body::new))` before the channel,
//! as in the [tonic guide](crate::tonic_guide#the-client-side) and `examples/grpc_client`.
//! Only unary calls: a streaming request body would be buffered to its end.
//!
//! # Where to put it
//!
//! - A [`TimeoutLayer`](https://docs.rs/tower/latest/tower/timeout/struct.TimeoutLayer.html)
//!   **inside** this layer bounds each attempt; its timeout is an error, which is retried.
//!   Outside, it bounds the whole call, retries included. [`with_deadline`] makes the
//!   retries stop in time; it does not cut an attempt short.
//! - **One layer per upstream**: services built from one layer (and its clones) share its
//!   retry budget.
//!
//! [`with_deadline`]: IdempotentRetryLayer::with_deadline
//!
//! # Errors
//!
//! The service's error is a `Box<dyn Error + Send + Sync>`: the last attempt's error from the
//! inner service, or the request body's error while it was buffered (nothing was sent then).
//! gRPC statuses are read from trailers-only responses (the status in the headers), which is
//! how a unary call that failed before its answer comes back; a status in the trailers comes
//! after the body has started and is handed to the caller as it is.

mod classify;
mod policy;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use policy::{AttemptPolicy, Rng};
pub use policy::{Backoff, Jitter, RetryBudget};

/// The body buffer of a [`BufferedRequest`] (from `bytes`).
pub use bytes::Bytes;
/// The body of a [`BufferedRequest`] (from `http-body-util`).
pub use http_body_util::Full;

/// What [`IdempotentRetry`] sends its inner service on every attempt: the caller's request
/// with its body buffered once, so each attempt sends the same bytes.
pub type BufferedRequest = Request<Full<Bytes>>;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type KeyFn = dyn Fn(&Parts) -> Option<HeaderValue> + Send + Sync;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How the final response came about: a response extension set by [`IdempotentRetry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryOutcome {
    attempts: u32,
    replayed: bool,
    key: HeaderValue,
}

impl RetryOutcome {
    /// Attempts sent, the first included: `1` means no retry.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the server answered from its record (`Idempotent-Replayed: true`): an earlier
    /// attempt ran, and its answer was lost on the way back.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The idempotency key every attempt carried.
    pub fn key(&self) -> &HeaderValue {
        &self.key
    }
}

/// The caller's overall deadline for one request, as a request extension. It overrides
/// [`IdempotentRetryLayer::with_deadline`]. No retry is sent that would start past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline(Instant);

impl Deadline {
    /// A deadline at `instant` (tokio's clock, so paused time applies).
    pub fn at(instant: Instant) -> Self {
        Self(instant)
    }

    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        Self(Instant::now() + timeout)
    }

    /// When it falls.
    pub fn instant(&self) -> Instant {
        self.0
    }
}

#[derive(Clone)]
pub(crate) struct Config {
    header: HeaderName,
    key_fn: Option<Arc<KeyFn>>,
    max_retries: u32,
    backoff: Backoff,
    jitter: Jitter,
    budget: Option<RetryBudget>,
    deadline: Option<Duration>,
    max_retry_after: Duration,
    rng: Arc<Rng>,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("header", &self.header)
            .field("key_fn", &self.key_fn.as_ref().map(|_| "<fn>"))
            .field("max_retries", &self.max_retries)
            .field("backoff", &self.backoff)
            .field("jitter", &self.jitter)
            .field("budget", &self.budget)
            .field("deadline", &self.deadline)
            .field("max_retry_after", &self.max_retry_after)
            .finish_non_exhaustive()
    }
}

/// A [`Layer`] that retries requests safely: one `Idempotency-Key` per request, reused by
/// every attempt. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct IdempotentRetryLayer {
    config: Arc<Config>,
}

impl Default for IdempotentRetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentRetryLayer {
    /// Up to 3 retries; backoff from 100 ms to 10 s with full jitter; a 10% retry budget
    /// ([`RetryBudget::default`]); no deadline; `Retry-After` up to 60 s honoured (a longer
    /// one ends the retries); the key in `Idempotency-Key`.
    pub fn new() -> Self {
        Self {
            config: Arc::new(Config {
                header: IDEMPOTENCY_KEY,
                key_fn: None,
                max_retries: 3,
                backoff: Backoff::default(),
                jitter: Jitter::Full,
                budget: Some(RetryBudget::default()),
                deadline: None,
                max_retry_after: Duration::from_secs(60),
                rng: Arc::new(Rng::from_entropy()),
            }),
        }
    }

    fn map(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// Retries after the first attempt, at most (default 3). `0` turns retrying off but
    /// still sends a key.
    #[must_use]
    pub fn with_max_retries(self, retries: u32) -> Self {
        self.map(|c| c.max_retries = retries)
    }

    /// The exponential backoff (default 100 ms doubling to 10 s).
    #[must_use]
    pub fn with_backoff(self, backoff: Backoff) -> Self {
        self.map(|c| c.backoff = backoff)
    }

    /// How delays are drawn below the backoff ceiling (default [`Jitter::Full`]).
    #[must_use]
    pub fn with_jitter(self, jitter: Jitter) -> Self {
        self.map(|c| c.jitter = jitter)
    }

    /// Seeds the jitter, for reproducible runs (default: seeded from the OS).
    #[must_use]
    pub fn with_seed(self, seed: u64) -> Self {
        self.map(|c| c.rng = Arc::new(Rng::new(seed)))
    }

    /// The retry budget shared by every service made from this layer (default
    /// [`RetryBudget::default`], 10%).
    #[must_use]
    pub fn with_budget(self, budget: RetryBudget) -> Self {
        self.map(|c| c.budget = Some(budget))
    }

    /// No retry budget: each request retries up to `max_retries` whatever the others do.
    /// Against an upstream that is down this multiplies its load by `1 + max_retries`.
    #[must_use]
    pub fn without_budget(self) -> Self {
        self.map(|c| c.budget = None)
    }

    /// The overall deadline of each request, counted from the call: no retry is sent that
    /// would start past it, and a wait that would end past it is not begun (the last answer
    /// is returned at once). A [`Deadline`] request extension overrides it.
    #[must_use]
    pub fn with_deadline(self, deadline: Duration) -> Self {
        self.map(|c| c.deadline = Some(deadline))
    }

    /// The longest `Retry-After` (or gRPC `RetryInfo`) the layer waits out (default 60 s). A
    /// server asking for longer gets its answer handed to the caller instead.
    #[must_use]
    pub fn with_max_retry_after(self, max: Duration) -> Self {
        self.map(|c| c.max_retry_after = max)
    }

    /// The header that carries the key (default `Idempotency-Key`).
    #[must_use]
    pub fn with_header_name(self, name: HeaderName) -> Self {
        self.map(|c| c.header = name)
    }

    /// Derives the key of a request that has none, such as `refund:order-1042` from the
    /// path; `None` falls back to a random UUIDv4. A key the caller set in the header wins.
    #[must_use]
    pub fn with_key<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<HeaderValue> + Send + Sync + 'static,
    {
        self.map(|c| c.key_fn = Some(Arc::new(f)))
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetry {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The [`Service`] made by [`IdempotentRetryLayer`].
#[derive(Debug, Clone)]
pub struct IdempotentRetry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotentRetry<S> {
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

impl<S, B, ResB> Service<Request<B>> for IdempotentRetry<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResB: Send + 'static,
{
    type Response = Response<ResB>;
    // Boxed, as in tower's `timeout`: the request body can fail too, before any attempt.
    type Error = BoxError;
    type Future = ResponseFuture<ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The clone takes the place of the service that was polled ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        let started = Instant::now();
        ResponseFuture {
            inner: Box::pin(async move {
                let (mut parts, body) = req.into_parts();
                let body = body.collect().await.map_err(Into::into)?.to_bytes();
                let key = key_for(&config, &parts);
                parts.headers.insert(config.header.clone(), key.clone());
                let deadline = parts
                    .extensions
                    .get::<Deadline>()
                    .map(Deadline::instant)
                    .or_else(|| config.deadline.map(|d| started + d));
                if let Some(budget) = &config.budget {
                    budget.deposit();
                }
                let policy = AttemptPolicy::new(config, key, deadline);
                let req = Request::from_parts(parts, Full::new(body));
                // `inner` is ready: the first attempt goes straight out; tower's `Retry`
                // polls its clone ready before each retry.
                let mut retry = tower::retry::Retry::new(policy, inner);
                retry.call(req).await.map_err(Into::into)
            }),
        }
    }
}

/// The caller's key, the derived one, or a fresh UUIDv4.
fn key_for(config: &Config, parts: &Parts) -> HeaderValue {
    if let Some(key) = parts.headers.get(&config.header) {
        return key.clone();
    }
    config
        .key_fn
        .as_ref()
        .and_then(|f| f(parts))
        .unwrap_or_else(|| uuid_v4(&config.rng))
}

/// A random (version 4) UUID in its hyphenated lowercase form.
fn uuid_v4(rng: &Rng) -> HeaderValue {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        tracing::warn!("getrandom failed; the idempotency key comes from the jitter generator");
        b[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
        b[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 9562 variant
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    let s = format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    );
    HeaderValue::try_from(s).expect("hex and hyphens are a valid header value")
}

/// The response future of [`IdempotentRetry`].
pub struct ResponseFuture<B> {
    inner: Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>,
}

impl<B> fmt::Debug for ResponseFuture<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<B> Future for ResponseFuture<B> {
    type Output = Result<Response<B>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_version_4_and_distinct() {
        let rng = Rng::new(1);
        let a = uuid_v4(&rng);
        let b = uuid_v4(&rng);
        assert_ne!(a, b);
        let s = a.to_str().unwrap();
        assert_eq!(s.len(), 36);
        let groups: Vec<_> = s.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12]);
        assert_eq!(&s[14..15], "4");
        assert!(matches!(&s[19..20], "8" | "9" | "a" | "b"));
        assert!(s
            .bytes()
            .all(|c| c == b'-' || c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
    }
}
