//! [`IdempotencyLayer`]: the builder users configure, and the [`Layer`] that wraps services.

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{request, HeaderName, Method, Response};
use tower_layer::Layer;

use crate::config::{Config, InProgress, Scope, StoreFailure, Timing};
use crate::error::IdempotencyError;
use crate::fingerprint::Fingerprinting;
use crate::grpc::Grpc;
use crate::key::Key;
use crate::policy::{DefaultRecordPolicy, RecordPolicy};
use crate::service::{Idempotency, Waiters};
use crate::store::IdempotencyStore;
use crate::webhook::Webhook;

/// Makes keyed requests safe to retry: the inner service runs at most once per
/// (scope, key), and retries get the first answer.
///
/// See the [crate docs](crate) for the flow and an example.
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    pub(crate) config: Arc<Config>,
    /// Wait mode's registry: runtime state, not configuration. Made once here, so every
    /// service this layer makes (one per connection, say) coalesces its waiters with the rest.
    pub(crate) waiters: Arc<Waiters>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("key", &c.key)
            .field("methods", &c.methods)
            .field("scoped", &matches!(c.scope, Scope::Fn(_)))
            .field("max_request_body", &c.max_request_body)
            .field("max_response_body", &c.max_response_body)
            .field("timing", &c.timing)
            .field("store_failure", &c.store_failure)
            .field("in_progress", &c.in_progress)
            .field("grpc", &c.grpc)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults: `Idempotency-Key` required on `POST` and
    /// `PATCH`, no scope chosen yet (choose with [`with_scope`](Self::with_scope)), HTTP
    /// only (gRPC with [`with_grpc`](Self::with_grpc)), 1 MiB request and response limits,
    /// a 30 s lease, 24 h retention, fail closed, answer 409 with `Retry-After: 1` while in
    /// progress.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// Like [`new`](Self::new), for a store already shared.
    pub fn from_arc(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                key: Key::default(),
                methods: vec![Method::POST, Method::PATCH],
                filter: None,
                scope: Scope::Unset,
                max_request_body: 1 << 20,
                max_response_body: 1 << 20,
                request_body_timeout: Duration::from_secs(30),
                timing: Timing::default(),
                fingerprint: Fingerprinting::default(),
                unrecorded_headers: Vec::new(),
                policy: Arc::new(DefaultRecordPolicy),
                store_failure: StoreFailure::closed(),
                in_progress: InProgress::conflict(),
                in_progress_status: http::StatusCode::CONFLICT,
                unkept_as_status: false,
                signature: None,
                renderer: None,
                grpc: None,
                route_label: std::borrow::Cow::Borrowed("unnamed"),
                on_abandoned: None,
                ttl_header: false,
                ttl_value: None,
                vary_match: true,
                key_echo: false,
            }),
            waiters: Arc::default(),
        }
    }

    fn edit(mut self, f: impl FnOnce(&mut Config)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        f(config);
        config.derive();
        self
    }

    /// Where each request's key comes from, and whether it is required (default: the
    /// `Idempotency-Key` header, required). See [`Key`]: another header, a JSON field of the
    /// body, several joined, or a function of the request; [`Key::optional`] lets requests
    /// without one pass through.
    ///
    /// ```
    /// # use http::HeaderName;
    /// # use tower_idempotency::{store::MemoryStore, IdempotencyLayer, Key};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .unscoped()
    ///     .with_key(Key::header(HeaderName::from_static("x-request-key")).optional());
    /// # drop(layer);
    /// ```
    pub fn with_key(self, key: Key) -> Self {
        self.edit(|c| c.key = key)
    }

    /// Sets what a webhook receiver needs, each default overridable: see [`Webhook`]. The
    /// key is the sender's event id, a request matches on key and route, only 2xx answers
    /// are recorded, records live 7 days, and a duplicate that arrives while the first
    /// delivery runs gets a status senders redeliver on. Setters called after this one
    /// override what it set.
    pub fn with_webhook(self, webhook: Webhook) -> Self {
        self.edit(|c| webhook.apply(c))
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
    /// For a router-wide layer with routes that must not be protected, such as webhooks
    /// that arrive without a key (or protect those with their own layer and
    /// [`with_webhook`](Self::with_webhook), keyed on the sender's id):
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
    /// gRPC requests have their own limit, [`Grpc::max_request_body`].
    pub fn with_max_request_body(self, limit: NonZeroUsize) -> Self {
        self.edit(|c| c.max_request_body = limit.get())
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
    /// and is recorded as a tombstone: retries get 410, never a second execution. Under
    /// [`with_webhook`](Self::with_webhook) a redelivery gets the original status instead,
    /// with an empty body and [`REPLAY_OMITTED_HEADER`](crate::REPLAY_OMITTED_HEADER), so
    /// the sender reads a taken event as taken.
    pub fn with_max_response_body(self, limit: NonZeroUsize) -> Self {
        self.edit(|c| c.max_response_body = limit.get())
    }

    /// The lease, the retention TTL and the deadline on each store call; see [`Timing`].
    pub fn with_timing(self, timing: Timing) -> Self {
        self.edit(|c| c.timing = timing)
    }

    /// What the request fingerprint covers beyond method, path, query and body: JSON fields
    /// left out, request headers taken in (default: neither). Replaces any earlier
    /// [`Fingerprinting`].
    pub fn with_fingerprint(self, fingerprinting: Fingerprinting) -> Self {
        self.edit(|c| c.fingerprint = fingerprinting)
    }

    /// Whether a recorded answer's `Vary` is part of the match (default `true`).
    ///
    /// When an answer names request headers in `Vary` (`Authorization`, `Accept-Language`),
    /// the record keeps a digest of the first request's values of them, and a retry that sends
    /// other values gets `422` instead of that answer: within one scope, an answer made for
    /// one user is not replayed to another. `Vary: *` names nothing to compare. Headers that
    /// must match whatever the answer says belong in
    /// [`Fingerprinting::include_header`].
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
    /// extension still comes first.
    ///
    /// `Cache-Control: no-store` does not release an answer: many APIs send it on every
    /// response (the usual advice for sensitive data), and reading it as "do not record"
    /// would silently turn idempotency off and let a retry charge a card twice. To release
    /// one answer, put [`RecordDecision::Release`](crate::RecordDecision::Release) into its
    /// extensions.
    pub fn with_record_policy(self, policy: impl RecordPolicy) -> Self {
        self.edit(|c| c.policy = Arc::new(policy))
    }

    /// What a request meets when the store fails or its scope is over quota (default
    /// [`StoreFailure::closed`]: 503 and 429, each with `Retry-After` and `retry-after-ms`),
    /// and the 429's retry hint ([`StoreFailure::quota_retry_after`]). Failing open runs the
    /// request unprotected, so a duplicate can run twice; see [`StoreFailure`].
    pub fn with_store_failure(self, policy: StoreFailure) -> Self {
        self.edit(|c| c.store_failure = policy)
    }

    /// What a duplicate meets while the first attempt of its key runs: a 409 with
    /// `Retry-After: 1` and `retry-after-ms: 1000` ([`InProgress::conflict`], the default;
    /// [`InProgress::retry_after`] sets the hint), or a wait for the first answer, replayed
    /// ([`InProgress::wait`]).
    pub fn with_in_progress(self, in_progress: InProgress) -> Self {
        self.edit(|c| c.in_progress = in_progress)
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

    /// Serves gRPC: requests with a gRPC `Content-Type` are handled as gRPC (errors as gRPC
    /// statuses, answers recorded on `grpc-status`), protecting the methods `grpc` names,
    /// [`Grpc::all`] or [`Grpc::methods`]. With a method list, every other path follows the
    /// HTTP rules, whatever `Content-Type` a client sends.
    ///
    /// Off by default: the client's `Content-Type` alone never switches a route to gRPC
    /// handling, so an HTTP API cannot be made to skip its method check or take larger
    /// bodies by a client claiming to speak gRPC. Without it a gRPC request is handled as
    /// HTTP. In gRPC mode only `POST` (all gRPC calls) is protected. Calling it again
    /// replaces the earlier [`Grpc`].
    pub fn with_grpc(self, grpc: Grpc) -> Self {
        self.edit(|c| c.grpc = Some(grpc))
    }

    /// The `route` label of this layer's metrics (feature `metrics`) when the request
    /// carries no matched route: axum's `MatchedPath` is used when present (feature
    /// `axum`, layer added with `Router::layer`), and for gRPC the
    /// [`Grpc::methods`] entry the path matched. The raw
    /// path is never a label: clients could fill it with unbounded values. Default
    /// `"unnamed"`.
    pub fn with_route_label(self, label: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        let label = label.into();
        self.edit(|c| c.route_label = label)
    }

    /// Calls `hook` when a claim takes over a key whose holder's lease lapsed: the earlier
    /// attempt died (or lost the store) without finishing, and may have done part of its
    /// work. A takeover that is released in turn (a 5xx, a claim reply past its deadline)
    /// keeps the key's history, so the retry after it is reported too. The hook runs before
    /// the inner service, on the request's task: keep it short
    /// (log, count, queue a reconciliation), and check there whether the side effect
    /// happened (say, ask the card network) before the retry charges again.
    ///
    /// ```
    /// # use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_abandoned_hook(|a| {
    ///     tracing::warn!(
    ///         record = %&a.record.to_hex()[..16],
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
    /// [`TTL_HEADER`](crate::TTL_HEADER) (`Idempotency-Key-TTL`), the retention in whole seconds (an RFC 8941
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

    /// Echoes the key on every answer to a keyed request: first runs, replays, and the
    /// layer's own problems (`409`, `422`, `503`, …) alike carry `Idempotency-Key` with the
    /// key, so the caller of an SDK that makes keys for it can read back the key of each
    /// call. Off by default.
    ///
    /// A key from a header comes back as its field value was sent (`"abc"` stays quoted); a
    /// key from the body (or [`Key::joined`], [`Key::from_fn`]) as the layer read it, the key
    /// [`IdempotencyContext::key`](crate::IdempotencyContext::key) returns. The echo is
    /// never recorded: a replay carries the retry's own. An answer given before the key is
    /// known (a `400` for a missing or invalid key, and for a key in the body a `413`, `408`
    /// or `500` scope-missing before it is read) has none, nor has a request passed through
    /// without a key. gRPC answers carry it as an `idempotency-key` metadata entry. Browsers
    /// read it only when CORS exposes it.
    pub fn with_key_echo(self, on: bool) -> Self {
        self.edit(|c| c.key_echo = on)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.config.clone(), self.waiters.clone())
    }
}
