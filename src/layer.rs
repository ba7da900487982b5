//! [`IdempotencyLayer`]: the configuration.

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{request, HeaderName, Method, Response};
use tower_layer::Layer;

use crate::error::{ConfigError, IdempotencyError};
use crate::fingerprint::{FingerprintConfig, JsonPointer};
use crate::policy::{DefaultRecordPolicy, RecordPolicy};
use crate::service::Idempotency;
use crate::store::IdempotencyStore;

/// The shortest lease: renewals run every `lease / 3`, and below ~100 ms a store round trip
/// under load would eat the whole interval.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The default store deadline is `lease / 6`, capped at this.
///
/// The arithmetic: renewals are due every `lease / 3`, counted from the moment the claim was
/// sent. A renewal that hangs is abandoned at its deadline, `lease / 6` later, half an
/// interval before the next one is due, so one hung call never delays the next. One renewal
/// can fail and the next still lands with a third of the lease to spare; after two failures
/// in a row the third is sent just as the local estimate of the lease ends, so it keeps the
/// lease only if it reaches the store sooner than the claim did. With the
/// default 30 s lease the deadline is 1 s (the cap: a healthy store answers in
/// milliseconds); with a 2 s lease it is 333 ms.
pub const DEFAULT_STORE_TIMEOUT_MAX: Duration = Duration::from_secs(1);

/// How long a claim is held, how long an answer is kept, and how long one store call may take.
///
/// - `lease` (default 30 s): how long a claim holds the key without news from its holder.
///   The holder renews it every `lease / 3`, so one renewal can fail with a third of the
///   lease to spare, and two in a row bring it to the edge. A holder that crashes blocks retries (409) for at most one lease; then a retry
///   with the same request takes over.
/// - `ttl` (default 24 h): how long a completed answer is kept, counted from completion.
/// - the store deadline (default `lease / 6`, at most [`DEFAULT_STORE_TIMEOUT_MAX`]): every
///   store call the layer makes is abandoned past it, and its outcome is then unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    lease: Duration,
    ttl: Duration,
    store_timeout: Option<Duration>,
}

impl Retention {
    /// Validates `lease >= MIN_LEASE` and `ttl >= lease`.
    pub fn new(lease: Duration, ttl: Duration) -> Result<Self, ConfigError> {
        if lease < MIN_LEASE {
            return Err(ConfigError::new(format!(
                "lease {lease:?} is shorter than the minimum {MIN_LEASE:?}"
            )));
        }
        if ttl < lease {
            return Err(ConfigError::new(format!(
                "ttl {ttl:?} is shorter than the lease {lease:?}"
            )));
        }
        Ok(Self {
            lease,
            ttl,
            store_timeout: None,
        })
    }

    /// Bounds every store call the layer makes (claim, extend, complete, release, get).
    ///
    /// Refused unless `0 < timeout < lease / 3`: a renewal must end, one way or the other,
    /// before the next one is due. A call past its deadline is "unknown": a claim is then
    /// answered 503 and released in the background if it did take effect, a renewal is
    /// retried at its next time, a complete or release is retried while the lease lives.
    pub fn with_store_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        if timeout.is_zero() || timeout >= self.lease / 3 {
            return Err(ConfigError::new(format!(
                "store timeout {timeout:?} must be above zero and below a third of the lease {:?}",
                self.lease
            )));
        }
        self.store_timeout = Some(timeout);
        Ok(self)
    }

    /// The lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retention TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The deadline on each store call: the one set, or `lease / 6` capped at
    /// [`DEFAULT_STORE_TIMEOUT_MAX`].
    pub fn store_timeout(&self) -> Duration {
        self.store_timeout
            .unwrap_or_else(|| (self.lease / 6).min(DEFAULT_STORE_TIMEOUT_MAX))
    }
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 60 * 60),
            store_timeout: None,
        }
    }
}

pub(crate) type ScopeFn = Arc<dyn Fn(&request::Parts) -> Option<String> + Send + Sync>;

/// Where keys live: per scope, in one shared key space (an explicit choice), or not chosen yet.
#[derive(Clone)]
pub(crate) enum Scope {
    /// Neither [`IdempotencyLayer::with_scope`] nor [`IdempotencyLayer::unscoped`] was called:
    /// keyed requests are refused (500 scope-missing) rather than share one key space.
    Unset,
    /// [`IdempotencyLayer::unscoped`]: every caller shares one key space.
    Unscoped,
    /// [`IdempotencyLayer::with_scope`].
    Fn(ScopeFn),
}
pub(crate) type FilterFn = Arc<dyn Fn(&request::Parts) -> bool + Send + Sync>;
pub(crate) type Renderer = Arc<dyn Fn(&IdempotencyError) -> Response<Bytes> + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) filter: Option<FilterFn>,
    pub(crate) key_required: bool,
    pub(crate) scope: Scope,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) request_body_timeout: Duration,
    pub(crate) retention: Retention,
    pub(crate) fingerprint: FingerprintConfig,
    pub(crate) unrecorded_headers: Vec<HeaderName>,
    pub(crate) policy: Arc<dyn RecordPolicy>,
    pub(crate) fail_open: bool,
    pub(crate) quota_fail_open: bool,
    pub(crate) release_on_no_store: bool,
    pub(crate) wait: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) waiters: Arc<crate::service::Waiters>,
    pub(crate) in_progress_retry_after: Duration,
    pub(crate) renderer: Option<Renderer>,
    pub(crate) max_grpc_request_body: usize,
    pub(crate) grpc: bool,
    pub(crate) grpc_methods: Option<Vec<String>>,
    pub(crate) grpc_passthrough: Vec<String>,
    /// The `route` metric label when no matched route is known.
    pub(crate) route_label: std::borrow::Cow<'static, str>,
    pub(crate) on_abandoned: Option<AbandonedFn>,
    /// Send [`TTL_HEADER`] on recorded answers and replays.
    pub(crate) ttl_header: bool,
    /// Whether a recorded answer's `Vary` headers must match on replay.
    pub(crate) vary_match: bool,
}

pub(crate) type AbandonedFn = Arc<dyn Fn(&crate::Abandoned) + Send + Sync>;

/// The header that publishes how long keys live, when
/// [`with_ttl_header`](IdempotencyLayer::with_ttl_header) is on.
pub const TTL_HEADER: HeaderName = HeaderName::from_static("idempotency-key-ttl");

/// gRPC services that never need a key, passed through by default: health checks (probes
/// send no key) and server reflection (a bidirectional stream).
pub(crate) const DEFAULT_GRPC_PASSTHROUGH: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// Checks that `path` is `/package.Service/Method` or, for a whole service,
/// `/package.Service/`: what a gRPC request's path can be.
fn grpc_path(path: String) -> Result<String, ConfigError> {
    let valid = path.strip_prefix('/').is_some_and(|rest| {
        let mut parts = rest.split('/');
        let service = parts.next().unwrap_or_default();
        let method = parts.next();
        let visible = |s: &str| s.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
        !service.is_empty()
            && visible(service)
            && method.is_some_and(visible)
            && parts.next().is_none()
    });
    if valid {
        Ok(path)
    } else {
        Err(ConfigError::new(format!(
            "{path:?} is not a gRPC method path (`/package.Service/Method`) or service (`/package.Service/`)"
        )))
    }
}

/// `pattern` names one method (`/pkg.Service/Method`) or, ending in `/`, a whole service.
fn grpc_path_matches(pattern: &str, path: &str) -> bool {
    if pattern.ends_with('/') {
        path.starts_with(pattern)
    } else {
        path == pattern
    }
}

impl Config {
    /// The response headers (or trailers) a record keeps: the one rule for both protocols,
    /// for the layer and for handlers that record their own answer.
    pub(crate) fn recorded_headers(&self, headers: &http::HeaderMap) -> http::HeaderMap {
        crate::response::recorded_headers(headers, &self.unrecorded_headers)
    }

    /// Whether a gRPC request to `path` is protected: in `grpc_methods` (all when unset)
    /// and not in `grpc_passthrough`.
    pub(crate) fn grpc_protected(&self, path: &str) -> bool {
        let listed = self
            .grpc_methods
            .as_ref()
            .is_none_or(|m| m.iter().any(|p| grpc_path_matches(p, path)));
        listed
            && !self
                .grpc_passthrough
                .iter()
                .any(|p| grpc_path_matches(p, path))
    }

    /// The configured gRPC method or service pattern `path` matched, if a list is set: a
    /// bounded metric label, where the path itself is whatever the client sent.
    #[cfg(feature = "metrics")]
    pub(crate) fn grpc_pattern(&self, path: &str) -> Option<&str> {
        self.grpc_methods
            .as_ref()?
            .iter()
            .find(|p| grpc_path_matches(p, path))
            .map(String::as_str)
    }
}

/// Makes keyed requests safe to retry: the inner service runs at most once per
/// (scope, key), and retries get the first answer.
///
/// See the [crate docs](crate) for the flow and an example.
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    pub(crate) config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("header", &c.header)
            .field("methods", &c.methods)
            .field("key_required", &c.key_required)
            .field("scoped", &matches!(c.scope, Scope::Fn(_)))
            .field("max_request_body", &c.max_request_body)
            .field("max_response_body", &c.max_response_body)
            .field("retention", &c.retention)
            .field("fail_open", &c.fail_open)
            .field("wait", &c.wait)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: `Idempotency-Key` required on `POST` and
    /// `PATCH`, no scope chosen yet (choose with [`with_scope`](Self::with_scope)), HTTP
    /// only (gRPC with [`with_grpc`](Self::with_grpc)), 1 MiB request and response limits,
    /// a 30 s lease, 24 h retention, fail closed, answer 409 while in progress.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// Like [`new`](Self::new), for a store already shared.
    pub fn from_arc(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                header: HeaderName::from_static("idempotency-key"),
                methods: vec![Method::POST, Method::PATCH],
                filter: None,
                key_required: true,
                scope: Scope::Unset,
                max_request_body: 1 << 20,
                max_response_body: 1 << 20,
                request_body_timeout: Duration::from_secs(30),
                retention: Retention::default(),
                fingerprint: FingerprintConfig::default(),
                unrecorded_headers: Vec::new(),
                policy: Arc::new(DefaultRecordPolicy),
                fail_open: false,
                quota_fail_open: false,
                release_on_no_store: false,
                wait: None,
                max_waiters: 1024,
                waiters: Arc::default(),
                in_progress_retry_after: Duration::MAX,
                renderer: None,
                max_grpc_request_body: 4 << 20,
                grpc: false,
                grpc_methods: None,
                grpc_passthrough: DEFAULT_GRPC_PASSTHROUGH.map(String::from).to_vec(),
                route_label: std::borrow::Cow::Borrowed("unnamed"),
                on_abandoned: None,
                ttl_header: false,
                vary_match: true,
            }),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The header that carries the key (default `Idempotency-Key`).
    pub fn with_header_name(self, name: HeaderName) -> Self {
        self.edit(|c| c.header = name)
    }

    /// The methods the layer protects (default `POST`, `PATCH`). Others pass through untouched.
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.edit(|c| c.methods = methods.into_iter().collect())
    }

    /// Protects only the requests `filter` selects; every other request passes through
    /// untouched (no key needed, no buffering, no store call), like a method not in
    /// [`with_methods`](Self::with_methods). Runs after the method check, on every request of
    /// a protected method.
    ///
    /// For a router-wide layer with a route that must not be protected, such as a webhook
    /// that arrives without a key:
    ///
    /// ```
    /// # use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
    /// # #[derive(Clone)] struct Tenant(String);
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_scope(|req| req.extensions.get::<Tenant>().map(|t| t.0.clone()))
    ///     .with_filter(|req| !req.uri.path().starts_with("/webhooks/"));
    /// # drop(layer);
    /// ```
    ///
    /// With axum, the layer can also sit on the routes that need it alone, as in
    /// `post(create_payment).layer(idempotency)`; see the crate docs.
    pub fn with_filter<F>(self, filter: F) -> Self
    where
        F: Fn(&request::Parts) -> bool + Send + Sync + 'static,
    {
        self.edit(|c| c.filter = Some(Arc::new(filter)))
    }

    /// Whether a protected request without a key is refused with 400 (default `true`).
    /// When `false`, such a request passes through unprotected.
    pub fn with_key_required(self, required: bool) -> Self {
        self.edit(|c| c.key_required = required)
    }

    /// Scopes keys, so that the same key from two scopes names two records.
    ///
    /// Every layer needs a scope function, or an explicit [`unscoped`](Self::unscoped):
    /// until one is chosen, keyed requests are refused with 500
    /// ([`ErrorKind::ScopeMissing`](crate::ErrorKind::ScopeMissing)) and nothing runs.
    ///
    /// `scope` reads the request head: the principal an auth layer (placed outside this one)
    /// put into the extensions. The scope is who may see a recorded answer: a retry with the
    /// same key in the same scope gets the first answer, whoever sends it. Scope by the
    /// principal that may read the answer (a user, or a tenant if every user of a tenant may),
    /// never by an unauthenticated header. See [security](crate::security).
    ///
    /// When `scope` returns `None` the layer answers 500 ([`ErrorKind::ScopeMissing`](crate::ErrorKind::ScopeMissing))
    /// and runs nothing: that means the layer runs before the one that sets the scope.
    pub fn with_scope<F>(self, scope: F) -> Self
    where
        F: Fn(&request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.edit(|c| c.scope = Scope::Fn(Arc::new(scope)))
    }

    /// Shares one key space among all callers, on purpose: a service with a single trusted
    /// caller, or one where every caller may see every answer.
    ///
    /// Anyone who sends a key another caller used gets that caller's answer replayed (or
    /// learns, from a 422, that the key exists), and can claim a key first to make another
    /// caller's request fail. Logs a warning once, here. Prefer [`with_scope`](Self::with_scope).
    pub fn unscoped(self) -> Self {
        tracing::warn!("idempotency layer built unscoped: every caller shares one key space and can replay another's answer; use with_scope to separate callers");
        self.edit(|c| c.scope = Scope::Unscoped)
    }

    /// The largest request body buffered for fingerprinting (default 1 MiB); larger: 413.
    ///
    /// gRPC requests have their own limit, [`with_max_grpc_request_body`](Self::with_max_grpc_request_body).
    pub fn with_max_request_body(self, limit: NonZeroUsize) -> Self {
        self.edit(|c| c.max_request_body = limit.get())
    }

    /// The largest gRPC request buffered (default 4 MiB, tonic's default largest message);
    /// larger: `RESOURCE_EXHAUSTED`. It bounds the whole request stream, so it is also the
    /// largest client-streaming request the layer protects.
    pub fn with_max_grpc_request_body(self, limit: NonZeroUsize) -> Self {
        self.edit(|c| c.max_grpc_request_body = limit.get())
    }

    /// How long a keyed request's whole body may take to arrive (default 30 s); slower: 408
    /// ([`ErrorKind::BodyTimeout`](crate::ErrorKind::BodyTimeout), gRPC `DEADLINE_EXCEEDED`),
    /// and nothing is claimed.
    ///
    /// Keyed bodies are buffered before the handler runs, so this bounds how long a slow
    /// client can hold up to the body limit in memory.
    pub fn with_request_body_timeout(self, timeout: Duration) -> Self {
        self.edit(|c| c.request_body_timeout = timeout)
    }

    /// The largest response body recorded (default 1 MiB). A larger one streams to the client
    /// and is recorded as a tombstone: retries get 410, never a second execution.
    pub fn with_max_response_body(self, limit: NonZeroUsize) -> Self {
        self.edit(|c| c.max_response_body = limit.get())
    }

    /// The lease and the retention TTL.
    pub fn with_retention(self, retention: Retention) -> Self {
        self.edit(|c| c.retention = retention)
    }

    /// Leaves a JSON field out of the fingerprint (a client timestamp, a trace id).
    pub fn with_fingerprint_excluded_field(self, pointer: JsonPointer) -> Self {
        self.edit(|c| c.fingerprint.excluded.push(pointer))
    }

    /// Adds a request header to the fingerprint.
    pub fn with_fingerprint_header(self, name: HeaderName) -> Self {
        self.edit(|c| c.fingerprint.headers.push(name))
    }

    /// Whether a recorded answer's `Vary` is part of the match (default `true`).
    ///
    /// When an answer names request headers in `Vary` (`Authorization`, `Accept-Language`),
    /// the record keeps a digest of the first request's values of them, and a retry that sends
    /// other values gets `422` instead of that answer: within one scope, an answer made for
    /// one user is not replayed to another. `Vary: *` names nothing to compare. Headers that
    /// must match whatever the answer says belong in
    /// [`with_fingerprint_header`](Self::with_fingerprint_header).
    pub fn with_vary_match(self, on: bool) -> Self {
        self.edit(|c| c.vary_match = on)
    }

    /// Leaves the response header or trailer `name` out of every record, so replays do not
    /// carry it (a per-response id, a timing header, anything that names the first caller).
    ///
    /// A record keeps every response header and trailer, on HTTP and gRPC alike, except the
    /// connection's own (`connection`, `keep-alive`, `proxy-connection`, `transfer-encoding`,
    /// `upgrade`, `te`, `trailer`), `content-length`, `date`, `set-cookie` and the names
    /// given here. `Set-Cookie` is never recorded: a replay would hand one caller's session
    /// to whoever retries with the key.
    pub fn with_unrecorded_header(self, name: HeaderName) -> Self {
        self.edit(|c| {
            if !c.unrecorded_headers.contains(&name) {
                c.unrecorded_headers.push(name);
            }
        })
    }

    /// Replaces the default [`RecordPolicy`]. A handler's [`RecordDecision`](crate::RecordDecision)
    /// extension (and `Cache-Control: no-store`, when
    /// [`with_release_on_no_store`](Self::with_release_on_no_store) is on) still come first.
    pub fn with_record_policy(self, policy: impl RecordPolicy) -> Self {
        self.edit(|c| c.policy = Arc::new(policy))
    }

    /// Releases, instead of recording, answers sent with `Cache-Control: no-store` (default
    /// `false`).
    ///
    /// Off by default: many APIs send `no-store` on every response (the usual advice for
    /// sensitive data), and reading it as "do not record" would silently turn idempotency off
    /// and let a retry charge a card twice. To release one answer, put
    /// [`RecordDecision::Release`](crate::RecordDecision::Release) into its extensions.
    pub fn with_release_on_no_store(self, release: bool) -> Self {
        self.edit(|c| c.release_on_no_store = release)
    }

    /// When the store fails, run the request unprotected instead of answering 503.
    ///
    /// A duplicate can then run twice: only for endpoints where that is safer than refusing.
    pub fn with_fail_open(self, fail_open: bool) -> Self {
        self.edit(|c| c.fail_open = fail_open)
    }

    /// When the store refuses a claim because the caller's scope is over its per-scope quota
    /// (see [`MemoryStoreBuilder::with_max_records_per_scope`](crate::store::memory::MemoryStoreBuilder::with_max_records_per_scope)),
    /// run that caller's request unprotected instead of answering 429
    /// ([`ErrorKind::QuotaExceeded`](crate::ErrorKind::QuotaExceeded), gRPC
    /// `RESOURCE_EXHAUSTED`). Default `false`. Other scopes are unaffected either way.
    pub fn with_quota_fail_open(self, fail_open: bool) -> Self {
        self.edit(|c| c.quota_fail_open = fail_open)
    }

    /// While the first attempt runs, make a retry wait up to `max` for its answer, then
    /// replay it. Past `max` the retry gets 409 as without waiting.
    ///
    /// Waiting duplicates of one key are coalesced within the process: one poll of the
    /// store per key, with jitter, however many wait. At most
    /// [`with_max_waiters`](Self::with_max_waiters) requests wait at once; the rest get
    /// 409 at once.
    pub fn with_wait(self, max: Duration) -> Self {
        self.edit(|c| c.wait = Some(max))
    }

    /// How many requests may wait at once in [wait mode](Self::with_wait), over all keys
    /// (default 1,024). Each waiter holds its buffered request body, so this bounds the
    /// memory a burst of duplicates can take.
    pub fn with_max_waiters(self, max: NonZeroUsize) -> Self {
        self.edit(|c| c.max_waiters = max.get())
    }

    /// Caps the `Retry-After` of a 409 in-progress answer (gRPC: the `RetryInfo` delay) at
    /// `max`. By default it is the remaining lease: the time after which a retry surely
    /// makes progress (the answer is recorded, or the lease lapsed and the retry takes
    /// over). For handlers much faster than the lease, a shorter hint lets clients come back
    /// sooner, at the cost of more 409s; [`with_wait`](Self::with_wait) avoids the round
    /// trips altogether.
    pub fn with_in_progress_retry_after(self, max: Duration) -> Self {
        self.edit(|c| c.in_progress_retry_after = max)
    }

    /// Renders the layer's HTTP errors yourself. The typed [`IdempotencyError`] also goes into
    /// the response extensions, whichever renderer is used.
    ///
    /// gRPC requests always get a gRPC status (a trailers-only response): a gRPC client
    /// cannot read an HTTP 409 or 422, so the renderer is not called for them.
    pub fn with_error_renderer<F>(self, render: F) -> Self
    where
        F: Fn(&IdempotencyError) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.edit(|c| c.renderer = Some(Arc::new(render)))
    }

    /// Serves gRPC: requests with a gRPC `Content-Type` are handled as gRPC (every method
    /// protected but health checks and reflection, a 4 MiB request limit, errors as gRPC
    /// statuses, answers recorded on `grpc-status`).
    ///
    /// Off by default: the client's `Content-Type` alone never switches a route to gRPC
    /// handling, so an HTTP API cannot be made to skip its method check or take larger
    /// bodies by a client claiming to speak gRPC. Without it a gRPC request is handled as
    /// HTTP. In gRPC mode only `POST` (all gRPC calls) is protected.
    pub fn with_grpc(self) -> Self {
        self.edit(|c| c.grpc = true)
    }

    /// Protects only these gRPC methods; every other gRPC request passes through untouched.
    /// Turns gRPC handling on, as [`with_grpc`](Self::with_grpc) does.
    ///
    /// By default every gRPC method is protected (except the passthrough list). The layer
    /// cannot tell a unary method from a streaming one on the wire, so a service with
    /// streaming methods is safest with an explicit list of the methods that change state.
    /// Each entry is a method path (`/shop.v1.Payments/CreatePayment`) or, ending in `/`, a
    /// whole service (`/shop.v1.Payments/`). Calling it again replaces the list.
    ///
    /// A path that cannot name a gRPC method or service (no leading `/`, no service part,
    /// more than one method part) is refused.
    pub fn with_grpc_methods<I, P>(self, paths: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        let paths = paths
            .into_iter()
            .map(|p| grpc_path(p.into()))
            .collect::<Result<_, _>>()?;
        Ok(self.edit(|c| {
            c.grpc = true;
            c.grpc_methods = Some(paths);
        }))
    }

    /// Lets a gRPC method (`/package.Service/Method`), or a whole service (`/package.Service/`,
    /// ending in `/`), pass through unprotected: no key, no buffering, no store call.
    ///
    /// A protected gRPC request has its request stream read whole before the handler runs
    /// and its response stream read whole before the client sees it. The layer cannot see
    /// whether a method streams, so list here the bidirectional methods (they would wait
    /// forever for the request to end), long-lived server streams and reads that need no
    /// key. Health checks (`/grpc.health.v1.Health/`) and server reflection are on the list
    /// from the start. The list wins over [`with_grpc_methods`](Self::with_grpc_methods).
    ///
    /// A path that cannot name a gRPC method or service is refused, as in
    /// [`with_grpc_methods`](Self::with_grpc_methods).
    pub fn with_grpc_passthrough(self, path: impl Into<String>) -> Result<Self, ConfigError> {
        let path = grpc_path(path.into())?;
        Ok(self.edit(|c| c.grpc_passthrough.push(path)))
    }

    /// The `route` label of this layer's metrics (feature `metrics`) when the request
    /// carries no matched route: axum's `MatchedPath` is used when present (feature
    /// `axum`, layer added with `Router::layer`), and for gRPC the
    /// [`with_grpc_methods`](Self::with_grpc_methods) entry the path matched. The raw
    /// path is never a label: clients could fill it with unbounded values. Default
    /// `"unnamed"`.
    pub fn with_route_label(self, label: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        let label = label.into();
        self.edit(|c| c.route_label = label)
    }

    /// Calls `hook` when a claim takes over a key whose holder's lease lapsed: the earlier
    /// attempt died (or lost the store) without finishing, and may have done part of its
    /// work. The hook runs before the inner service, on the request's task: keep it short
    /// (log, count, queue a reconciliation), and check there whether the side effect
    /// happened (say, ask the card network) before the retry charges again.
    ///
    /// ```
    /// # use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_abandoned_hook(|a| {
    ///     tracing::warn!(
    ///         record = %a.record.to_hex(),
    ///         old = a.old_generation,
    ///         new = a.new_generation,
    ///         "idempotency key abandoned by a previous attempt; reconcile"
    ///     );
    /// });
    /// # drop(layer);
    /// ```
    pub fn with_abandoned_hook<F>(self, hook: F) -> Self
    where
        F: Fn(&crate::Abandoned) + Send + Sync + 'static,
    {
        self.edit(|c| c.on_abandoned = Some(Arc::new(hook)))
    }

    /// Publishes how long keys live: recorded answers and replays carry
    /// [`TTL_HEADER`] (`Idempotency-Key-TTL`), the retention in whole seconds (an RFC 8941
    /// integer), counted from when the answer was recorded. Off by default.
    ///
    /// The IETF Idempotency-Key draft asks a resource to publish its key expiry policy
    /// and defines no header for it; this one states the policy on the answers it governs.
    /// It is a duration, not a date, so it does not depend on the client's clock, and the
    /// same on a replay as on the first answer (the replay's own instant of expiry would
    /// need a store read).
    pub fn with_ttl_header(self, on: bool) -> Self {
        self.edit(|c| c.ttl_header = on)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_timeout_defaults_to_a_sixth_of_the_lease_capped_and_must_stay_below_a_third() {
        let r = |lease_ms| Retention::new(Duration::from_millis(lease_ms), Duration::MAX).unwrap();
        assert_eq!(r(30_000).store_timeout(), Duration::from_secs(1));
        assert_eq!(
            r(2_000).store_timeout(),
            Duration::from_millis(333) + Duration::from_nanos(333_333)
        );
        assert_eq!(r(100).store_timeout(), Duration::from_nanos(16_666_666));
        let three = r(3_000);
        assert!(
            three.with_store_timeout(Duration::from_secs(1)).is_err(),
            "lease / 3 itself"
        );
        assert!(three.with_store_timeout(Duration::ZERO).is_err());
        let ok = three
            .with_store_timeout(Duration::from_millis(999))
            .unwrap();
        assert_eq!(ok.store_timeout(), Duration::from_millis(999));
    }

    #[test]
    fn retention_refuses_tiny_leases_and_ttls_shorter_than_the_lease() {
        assert!(Retention::new(Duration::from_millis(99), Duration::from_secs(1)).is_err());
        assert!(Retention::new(Duration::from_secs(30), Duration::from_secs(29)).is_err());
        let r = Retention::new(Duration::from_secs(30), Duration::from_secs(30)).unwrap();
        assert_eq!(
            (r.lease(), r.ttl()),
            (Duration::from_secs(30), Duration::from_secs(30))
        );
    }

    fn config(layer: IdempotencyLayer) -> Config {
        Arc::try_unwrap(layer.config).unwrap_or_else(|c| (*c).clone())
    }

    #[test]
    fn names_that_cannot_be_grpc_paths_are_refused() {
        let layer = || IdempotencyLayer::new(crate::store::MemoryStore::new());
        for bad in [
            "shop.v1.Payments/Create",
            "/shop.v1.Payments",
            "//Create",
            "/shop.v1.Payments/Create/extra",
            "/shop v1.Payments/Create",
            "",
        ] {
            assert!(layer().with_grpc_methods([bad]).is_err(), "{bad:?}");
            assert!(layer().with_grpc_passthrough(bad).is_err(), "{bad:?}");
        }
        for good in ["/shop.v1.Payments/Create", "/shop.v1.Payments/"] {
            assert!(layer().with_grpc_methods([good]).is_ok(), "{good:?}");
            assert!(layer().with_grpc_passthrough(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn grpc_methods_are_all_protected_except_health_reflection_and_the_passthrough_list() {
        let store = crate::store::MemoryStore::new();
        let c = config(IdempotencyLayer::new(store.clone()));
        assert!(c.grpc_protected("/shop.v1.Payments/CreatePayment"));
        assert!(!c.grpc_protected("/grpc.health.v1.Health/Check"));
        assert!(!c.grpc_protected("/grpc.health.v1.Health/Watch"));
        assert!(!c.grpc_protected("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"));

        let c = config(
            IdempotencyLayer::new(store.clone())
                .with_grpc_passthrough("/shop.v1.Payments/CountCharges")
                .unwrap()
                .with_grpc_passthrough("/shop.v1.Chat/")
                .unwrap(),
        );
        assert!(c.grpc_protected("/shop.v1.Payments/CreatePayment"));
        assert!(!c.grpc_protected("/shop.v1.Payments/CountCharges"));
        assert!(
            c.grpc_protected("/shop.v1.Payments/CountChargesAll"),
            "exact, not a prefix"
        );
        assert!(!c.grpc_protected("/shop.v1.Chat/Talk"));

        let c = config(
            IdempotencyLayer::new(store)
                .with_grpc_methods(["/shop.v1.Payments/", "/shop.v1.Orders/Create"])
                .unwrap()
                .with_grpc_passthrough("/shop.v1.Payments/CountCharges")
                .unwrap(),
        );
        assert!(c.grpc_protected("/shop.v1.Payments/CreatePayment"));
        assert!(c.grpc_protected("/shop.v1.Orders/Create"));
        assert!(!c.grpc_protected("/shop.v1.Orders/List"));
        assert!(
            !c.grpc_protected("/shop.v1.Payments/CountCharges"),
            "passthrough wins"
        );
    }
}
