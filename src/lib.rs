//! Idempotency-Key middleware for tower: run the work once, replay the answer to every retry.
//!
//! A client that timed out cannot tell whether its payment went through. With
//! [`IdempotencyLayer`] in front of the handler it sends the same request again, with the same
//! `Idempotency-Key`, and the second attempt is harmless: the handler runs **at most once per
//! (scope, key)** within the retention window, and every retry gets the first answer, byte for
//! byte, marked `Idempotent-Replayed: true`. [`guarantees`] states exactly what is promised
//! and where it cannot hold.
//!
//! For each keyed request (by default `POST` and `PATCH`; other methods pass through
//! untouched, with no buffering and no store call) the layer:
//!
//! 1. reads the key (a bare token or an RFC 8941 string, 1 to 255 visible ASCII characters;
//!    another header or a field of the body with [`IdempotencyLayer::with_key`]);
//! 2. buffers the body (up to 1 MiB) and fingerprints method, path, media type,
//!    `Content-Encoding` and canonical body (RFC 8785 JSON with exact numbers, form pairs
//!    sorted by name, or raw bytes);
//! 3. claims the key in one atomic store operation;
//! 4. runs the inner service on its own task, renewing its lease, so a client that hangs up
//!    cannot cancel the work halfway;
//! 5. records the answer (or releases the key, for answers a retry should redo: 5xx, 429, …)
//!    and answers.
//!
//! A retry of a completed request gets the recorded answer; one that arrives while the first
//! attempt runs gets `409` with `Retry-After` (or waits, see [`InProgress::wait`]);
//! the same key with a different request gets `422`. When the store is down the layer answers
//! `503` and runs nothing.
//!
//! # Example: any tower service
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::{store::MemoryStore, IdempotencyLayer, RequestBody};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let charge = service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
//!     let mut res = Response::new(Full::new(Bytes::from(r#"{"id":"pay_1"}"#)));
//!     *res.status_mut() = StatusCode::CREATED;
//!     Ok::<_, Infallible>(res)
//! });
//! // Who is calling: an authentication layer outside this one puts it into the extensions.
//! #[derive(Clone)]
//! struct Principal(String);
//!
//! let svc = ServiceBuilder::new()
//!     .layer(
//!         IdempotencyLayer::new(MemoryStore::new())
//!             // One key space per principal: nobody else can replay its answers.
//!             .with_scope(|req| req.extensions.get::<Principal>().map(|p| p.0.clone())),
//!     )
//!     .service(charge);
//!
//! let request = || {
//!     Request::post("/v1/payments")
//!         .header("idempotency-key", "order-1234-attempt")
//!         .header("content-type", "application/json")
//!         .extension(Principal("alice".into()))
//!         .body(Full::new(Bytes::from(r#"{"amount":1000,"currency":"EUR"}"#)))
//!         .unwrap()
//! };
//! let first = svc.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//!
//! let retry = svc.clone().oneshot(request()).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), r#"{"id":"pay_1"}"#);
//! # }
//! ```
//!
//! The inner service receives a [`RequestBody`]: the buffered bytes for keyed requests, the
//! original body otherwise. Responses come back as a [`ResponseBody`].
//!
//! # Example: axum
//!
//! The layer puts an [`IdempotencyContext`] into the request extensions of every keyed
//! request it runs; a handler reads it with axum's `Extension` extractor (or
//! `Option<Extension<IdempotencyContext>>` where the key is optional), with or without this
//! crate's `axum` feature.
//!
//! ```
//! use axum::{http::StatusCode, routing::post, Extension, Router};
//! use tower_idempotency::{store::MemoryStore, IdempotencyContext, IdempotencyLayer};
//!
//! async fn create_payment(Extension(ctx): Extension<IdempotencyContext>) -> (StatusCode, String) {
//!     // The same key for the card network on every retry and takeover of this request.
//!     (StatusCode::CREATED, format!("charged with key {}", ctx.derive("card-network")))
//! }
//!
//! # #[derive(Clone)] struct Tenant(String);
//! let app: Router = Router::new()
//!     .route("/v1/payments", post(create_payment))
//!     .layer(
//!         IdempotencyLayer::new(MemoryStore::new())
//!             // One key space per tenant, as set by an auth layer outside this one.
//!             .with_scope(|req| req.extensions.get::<Tenant>().map(|t| t.0.clone())),
//!     );
//! # drop(app);
//! ```
//!
//! `examples/shop` is a complete payments API: `cargo run --example shop`. `examples/grpc` is
//! the same shop over tonic; [`tonic_guide`] covers gRPC.
//!
//! # Resumable work
//!
//! A handler that saves a [`RecoveryPoint`] after each step
//! ([`IdempotencyContext::save_recovery_point`]) is resumed from it when its holder dies:
//! the client's retry, or a [`RecoveryWorker`] with no retry at all, takes over and reads
//! the point instead of starting over. The [`resumable`] guide shows the pattern, what to put
//! in a point, and the window that remains between a step and its save.
//!
//! # Beyond HTTP: jobs, queue consumers, any service
//!
//! The same protocol runs work that is not an HTTP request: [`operation::Operations::once`]
//! for a function or a job (`ops.once(scope, key, &input, |ctx| async { … })`), and
//! [`operation::OperationLayer`] for a `tower::Service<R>` of any request type, with answers
//! recorded through a codec (serde JSON by default) and typed errors instead of statuses. The
//! [`beyond_http`] guide covers queue consumers: what the key should be, how the lease meets
//! a queue's redelivery, and the effect in the record's transaction for exactly once in
//! effect. `examples/consumer` is a Redis Streams consumer group that applies each payment
//! once.
//!
//! # Webhook receivers
//!
//! Webhooks come without an `Idempotency-Key`, but with the sender's own id of the event,
//! and are redelivered for days. [`IdempotencyLayer::with_key`] reads the key from another
//! header, a JSON field of the body ([`Key::json_pointer`]) or several joined, and
//! [`IdempotencyLayer::with_webhook`] sets a receiver's defaults: match on the id and the
//! route, record 2xx only, keep records 7 days, answer a duplicate in flight `503`. The
//! [`webhooks_guide`] covers signature checks, inbox-style processing and event order;
//! [`Webhook::standard`] checks a [Standard Webhooks](https://www.standardwebhooks.com/)
//! signature itself, before the claim. `cargo run --example webhooks` receives Stripe,
//! GitHub, Adyen and Standard Webhooks style deliveries.
//!
//! ## Which routes are protected
//!
//! A router-wide layer protects every `POST` and `PATCH` ([`IdempotencyLayer::with_methods`]
//! changes the set). Two ways to leave a route out, such as a health probe or a callback
//! that needs no protection:
//!
//! - put the layer on the routes that need it only: `.route("/v1/payments",
//!   post(create_payment).layer(idempotency.clone()))`;
//! - or keep it router-wide and select with a predicate:
//!   `.with_filter(|req| !req.uri.path().starts_with("/webhooks/"))`.
//!
//! ## The `axum` feature: nested routers and the extractor
//!
//! `Router::nest("/v1", …)` strips `/v1` from the URI that inner routes, and a layer on them,
//! see. With the **`axum` feature** the fingerprint reads axum's `OriginalUri`, the path the
//! client sent, so `POST /v1/orders` and `POST /refunds/orders` under one key are a mismatch
//! (`422`), wherever the layer sits. Without the feature, a layer inside a nested router
//! fingerprints the stripped path: put it outside the `nest`, or give each nested router its
//! own [scope](IdempotencyLayer::with_scope).
//!
//! The feature therefore **changes the fingerprints of requests inside nested routers**: a
//! record made without it does not match a retry fingerprinted with it, and the other way
//! round. Turning it on or off while such requests are in flight answers their retries `422`;
//! routes that are not nested fingerprint the same either way.
//!
//! The feature also makes [`IdempotencyContext`] an extractor of its own (and
//! `Option<IdempotencyContext>`), whose rejection, when the layer does not run before the
//! handler, is a `500` that says so; and with the `metrics` feature it labels each route by
//! axum's `MatchedPath`.
//!
//! ```
//! # #[cfg(feature = "axum")]
//! # {
//! use axum::{http::StatusCode, routing::post, Router};
//! use tower_idempotency::{store::MemoryStore, IdempotencyContext, IdempotencyLayer};
//!
//! async fn create_payment(ctx: IdempotencyContext) -> (StatusCode, String) {
//!     (StatusCode::CREATED, format!("charged with key {}", ctx.derive("card-network")))
//! }
//!
//! # #[derive(Clone)] struct Tenant(String);
//! let idempotency = IdempotencyLayer::new(MemoryStore::new())
//!     .with_scope(|req| req.extensions.get::<Tenant>().map(|t| t.0.clone()));
//! let app: Router = Router::new().route("/v1/payments", post(create_payment).layer(idempotency));
//! # drop(app);
//! # }
//! ```
//!
//! # Where to put the layer
//!
//! In axum, `router.layer(a).layer(b)` makes `b` the **outer** layer (the last `.layer()` call
//! runs first); in `ServiceBuilder` the **first** listed runs first.
//!
//! - **Inside authentication**, so that the [scope function](IdempotencyLayer::with_scope)
//!   can read the principal from the request extensions. A layer needs a scope or an
//!   explicit [`IdempotencyLayer::unscoped`]; with neither, keyed requests get `500`. With
//!   authentication inside the layer, every keyed request gets `500` scope-missing, and an
//!   unauthenticated one gets that `500` instead of its `401`.
//! - **tonic**: authentication done in `with_interceptor` runs *inside* the layer (the
//!   interceptor wraps the service, under every server-wide layer), so every protected call
//!   fails with `INTERNAL` scope-missing. Use tonic's `InterceptorLayer` in the server's layer
//!   stack, outside this one; see the [tonic guide](tonic_guide#authentication-and-scopes).
//! - **Inside compression** (`CompressionLayer` outside this layer), so that records hold the
//!   identity body and each replay is compressed for the retry's own `Accept-Encoding`.
//! - **Outside timeouts is fine**: a `TimeoutLayer` outside drops the response future, but the
//!   claimed work runs on its own task and its answer is recorded for the retry.
//! - **Inside rate limiting** and concurrency limits, so that rejected requests never buffer a
//!   body or claim a key.
//! - axum's own `Json` extractor also rejects with `422`. Clients tell a reused key from a bad
//!   body by the problem `type` (`…/problems/#key-reused`), not by the status.
//! - A `409`'s `Retry-After` is 1 s (`retry-after-ms: 1000`), whatever the lease: a hint
//!   for the work, so a duplicate comes back soon after a fast handler finishes. For
//!   handlers that take longer, raise it with [`InProgress::retry_after`], or let retries
//!   wait for the
//!   answer with [`InProgress::wait`] (both through [`IdempotencyLayer::with_in_progress`]).
//! - Transactional completion ([`RecordDecision::AlreadyRecorded`], the Postgres store's
//!   `record_in`) should use a connection pool of its own: the store's pool carries every
//!   claim and renewal.
//!
//! # Security
//!
//! Keys are scoped: choose who shares a key space with
//! [`IdempotencyLayer::with_scope`] (the principal, from an auth layer outside this one).
//! [`security`] has the threat model (who can replay what), what the crate stores, the
//! settings that bound memory and load, TLS to the stores and how to check advisories.
//!
//! # The client side
//!
//! The server side is half of it: clients must send one key per intent and retry with
//! jitter, within a budget and a deadline. With the `client` feature,
//! `client::IdempotentRetryLayer` does that for any tower HTTP client (hyper-util, tonic
//! channels): `cargo run --example client` pays the shop through it, and `examples/herd`
//! shows what jitter does to a thundering herd.
//! The [`clients_guide`] covers the clients that send keys themselves (the Stripe and
//! Stainless-generated SDKs, browsers), why a key must name the business intent, what each
//! answer means to each client, and the CORS set-up.
//!
//! # Choosing a store
//!
//! | store | feature | use when |
//! |---|---|---|
//! | [`store::MemoryStore`] | always | one process: tests, a single replica. Records die with the process. |
//! | `store::redis::RedisStore` | `redis` | several replicas, low latency. Redis must run with `maxmemory-policy noeviction` (checked at construction); a failover without `WAIT` can lose an acknowledged claim. |
//! | `store::postgres::PostgresStore` | `postgres` | several replicas, durable records, or a handler that records its answer in its own transaction. |
//!
//! Every store passes the same conformance suite; see [`store`] for the contract and for
//! writing your own, and the `conformance` feature (`tower_idempotency::conformance`) to run
//! the suite against it from your own tests.
//!
//! [`store::LocalTier`] in front of any of them serves completed answers from the process:
//! a replay costs no round trip, an operator's delete on any process reaches every tier
//! (Redis pub/sub, Postgres `NOTIFY`), and no answer is served past its record's TTL.
//!
//! # Feature flags
//!
//! | feature | default | enables |
//! |---|---|---|
//! | `redis` | no | `store::redis` with the `redis` crate (1.x): single node, Cluster and Sentinel |
//! | `postgres` | no | `store::postgres` with `tokio-postgres` and `deadpool-postgres` |
//! | `redis-tls` | no | `rediss://` for the Redis store, with rustls ([`security`](crate::security#tls-to-the-stores)) |
//! | `postgres-tls` | no | TLS for the Postgres store as `sslmode` says, with rustls |
//! | `sqlx` | no | sqlx's `&mut PgConnection` and `&mut Transaction<'_, Postgres>` for `PostgresStore::record_in` and the other `*_in` methods (implies `postgres`) |
//! | `client` | no | `client`: the retry layer for clients, with `tower`'s retry and `httpdate` |
//! | `axum` | no | fingerprints of the path the client sent inside nested routers (`OriginalUri`), which **changes the fingerprints of nested routes** ([more](#the-axum-feature-nested-routers-and-the-extractor)); [`IdempotencyContext`] as an extractor of its own (without the feature, use `Extension<IdempotencyContext>`); `MatchedPath` route labels for `metrics` |
//! | `conformance` | no | `conformance`: the store conformance suite, to test a custom store |
//! | `metrics` | no | counters and histograms through the `metrics` facade (0.24): outcomes, store latency, body sizes, waits; names in `docs/operations.md` |
//! | `utoipa` | no | `openapi::document`: the key parameter, the `Idempotent-Replayed` header and the problem responses in a `utoipa` (5.x) OpenAPI document, for the operations a layer covers |
//!
//! # Operations
//!
//! [`store::IdempotencyAdmin`] looks a key up and frees or deletes it by hand; every store
//! here implements it. [`IdempotencyLayer::with_abandoned_hook`] hears about keys taken over
//! from a holder that died, [`IdempotencyLayer::with_key_echo`] sends each answer's key back
//! to the client, and [`IdempotencyLayer::with_ttl_header`] publishes how long keys
//! live. The run book (sizing, Redis and Postgres settings, tuning, alerts) is
//! `docs/operations.md` in the repository.
//!
//! # Caveats
//!
//! What "exactly once" means here, the windows where it cannot hold (a holder cut off from
//! the store past its lease, a store that loses acknowledged writes, the TTL, an answer the
//! store would not take, a claim whose reply is lost) and the arithmetic behind the lease,
//! renewal interval, store deadline and TTL are on one page: [`guarantees`]. Use
//! [`IdempotencyContext::derive`] to give downstream calls their own idempotency keys, so that
//! a second run after a takeover repeats them harmlessly.
//!
//! Traps in practice:
//!
//! - The traps of layer order are under [Where to put the layer](#where-to-put-the-layer).
//!
//! Errors the layer makes are responses, never `Err`: `problem+json` (RFC 9457) with a stable
//! `type` per kind ([`problems`]) and `Cache-Control: no-store`, or a gRPC status for gRPC
//! requests. The typed [`IdempotencyError`] is in the response extensions.
//! [`IdempotencyLayer::with_error_renderer`] replaces the HTTP form; [`render::stripe`]
//! answers in Stripe's error shape, which the Stripe SDKs raise as their own errors.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod abandoned;
mod body;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod config;
mod error;
mod fingerprint;
mod grpc;
mod key;
mod layer;
mod metrics;
pub mod operation;
mod policy;
mod recording;
mod recovery;
pub mod render;
mod response;
mod service;
pub mod store;
mod webhook;

#[cfg(feature = "axum")]
mod axum;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use crate::axum::MissingIdempotencyContext;

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;

#[cfg(feature = "utoipa")]
#[cfg_attr(docsrs, doc(cfg(feature = "utoipa")))]
pub mod openapi;

pub use abandoned::Abandoned;
pub use body::{RequestBody, ResponseBody};
pub use config::{InProgress, StoreFailure, Timing, DEFAULT_STORE_TIMEOUT_MAX, MIN_LEASE};
pub use error::{ConfigError, ErrorKind, IdempotencyError};
pub use fingerprint::{Fingerprinting, JsonPointer};
pub use grpc::Grpc;
pub use key::{Key, KeyPart};
pub use layer::IdempotencyLayer;
pub use policy::{DefaultRecordPolicy, RecordDecision, RecordPolicy, ResponseInfo};
pub use recovery::{BoxError, RecoveredBody, RecoveryHandle, RecoveryReport, RecoveryWorker};
pub use response::{REPLAY_OMITTED_HEADER, TTL_HEADER};
pub use service::IdempotencyContext;
pub use service::{Idempotency, ResponseFuture};
pub use store::RecoveryPoint;
pub use webhook::{StandardWebhooks, Webhook, DEFAULT_WEBHOOK_TTL};

/// The problem types the layer answers with. Each `type` URI points at its section here.
///
/// | status | type | when | gRPC status |
/// |---|---|---|---|
/// | 400 | [`key-missing`](#key-missing) | a protected request without a key (where it was expected is in `detail`) | `INVALID_ARGUMENT` |
/// | 400 | [`key-invalid`](#key-invalid) | empty, > 255 characters, not visible ASCII, bad sf-string, or two field lines (a form field: given twice, or a bad percent-escape) | `INVALID_ARGUMENT` |
/// | 400 | [`body-unreadable`](#body-unreadable) | the request body failed while being read | `INVALID_ARGUMENT` |
/// | 401 | [`signature-invalid`](#signature-invalid) | [`Webhook::standard`] only: no `webhook-signature` entry matches, or `webhook-timestamp` is outside the tolerance; nothing was claimed | `UNAUTHENTICATED` |
/// | 413 | [`body-too-large`](#body-too-large) | the body exceeds `max_request_body` | `RESOURCE_EXHAUSTED` |
/// | 408 | [`body-timeout`](#body-timeout) | the body did not arrive within `request_body_timeout` | `DEADLINE_EXCEEDED` |
/// | 409 | [`in-progress`](#in-progress) | the first request with this key still runs; retry after `Retry-After` (1 s by default), or `retry-after-ms` to the millisecond. `503` under [`Webhook`] | `ABORTED` |
/// | 422 | [`key-reused`](#key-reused) | the key was used with a different request (body, path, method) | `FAILED_PRECONDITION` |
/// | 410 | [`response-not-retained`](#response-not-retained) | the original completed, but its response was too large to keep. Under [`Webhook`], not a problem: the original status, empty, with [`REPLAY_OMITTED_HEADER`] | `ALREADY_EXISTS` |
/// | 429 | [`quota-exceeded`](#quota-exceeded) | the caller's scope holds as many records as the store's per-scope quota allows; `Retry-After` and `retry-after-ms` as [`StoreFailure::quota_retry_after`] says (60 s by default, at most the TTL) | `RESOURCE_EXHAUSTED` |
/// | 503 | [`store-unavailable`](#store-unavailable) | the store failed; nothing ran; `Retry-After: 1`, `retry-after-ms: 1000` | `UNAVAILABLE` |
/// | 500 | [`scope-missing`](#scope-missing) | no scope configured, or the scope function found none | `INTERNAL` |
/// | 500 | [`context-missing`](#context-missing) | axum only: a handler takes `IdempotencyContext`, and the layer did not run for the request | — |
///
/// Every problem carries `type`, `title`, `status` and `detail`; `in-progress`,
/// `quota-exceeded` and `store-unavailable` add `retry_after` (seconds),
/// `response-not-retained` adds `original_status`. All have `Cache-Control: no-store`.
/// Those with `retry_after` carry
/// the same hint as `Retry-After` (whole seconds, rounded up) and as `retry-after-ms` (the
/// milliseconds the layer means, at least 1), which Stainless-generated SDKs read first.
/// Under [`IdempotencyLayer::with_key_echo`], every problem given once the key is known
/// carries it in `Idempotency-Key`.
///
/// # key-missing
/// Send an `Idempotency-Key` header: a unique value per logical operation (a UUID), reused
/// unchanged for every retry of that operation. Where the server reads the key from
/// elsewhere (another header, a field of the JSON or form body, as webhook receivers do), the
/// `detail` names the place, as in "the webhook id at JSON pointer `/id` in the request body
/// is missing".
///
/// # key-invalid
/// A key is 1 to 255 visible ASCII characters (`0x21`–`0x7E`), sent once, as a bare token or
/// an RFC 8941 string (`"abc"` is the key `abc`). A key in the JSON body is a string or an
/// integer, named once on its path. A key in a form body is given once, and its value
/// percent-decodes. The `detail` names the key's place and what is wrong.
///
/// # body-unreadable
/// The connection failed while the body was being read. Nothing was claimed; retry.
///
/// # signature-invalid
/// A [Standard Webhooks](https://www.standardwebhooks.com/) receiver
/// ([`Webhook::standard`]) checked the delivery before claiming anything, and it failed:
/// the `webhook-signature` or `webhook-timestamp` header is missing, no `v1` signature
/// matches `{webhook-id}.{webhook-timestamp}.{body}` under the receiver's secrets (a wrong
/// or rotated secret, a body changed on the way), or the timestamp is further from the
/// receiver's clock than its tolerance (5 minutes by default). The `detail` says which.
/// Nothing was claimed or stored, so the sender's genuine delivery of the same id still
/// runs. A sender redelivers on it; check the secret and the clocks.
///
/// # body-too-large
/// Protected requests are buffered to be fingerprinted. Nothing was claimed.
///
/// # body-timeout
/// The body arrived too slowly (default limit 30 s for the whole body). Nothing was claimed;
/// retry.
///
/// # in-progress
/// Retry after `Retry-After` seconds (`retry-after-ms` milliseconds), with the same key
/// and the same request.
///
/// # key-reused
/// A key names one operation. Use a new key for a new request; do not retry this one.
///
/// # response-not-retained
/// The operation completed with `original_status`; it was not run again.
///
/// # quota-exceeded
/// Your scope (tenant) holds as many idempotency records as the store allows it. Nothing was
/// claimed or run. Records expire with the retention TTL; other tenants are not affected.
/// `Retry-After` is a hint the server configured, not the moment a record expires, which
/// is not known: see [`StoreFailure::quota_retry_after`].
///
/// # store-unavailable
/// The request was not processed. Retry after `Retry-After` seconds (`retry-after-ms`
/// milliseconds).
///
/// # scope-missing
/// A server configuration error: the layer has no scope function (and was not made
/// `unscoped()` on purpose), or it runs before the layer that sets the scope (usually
/// authentication).
///
/// # context-missing
/// A server configuration error (axum): the handler extracts an `IdempotencyContext`, and
/// the idempotency layer did not run in front of it for this request. The route is not
/// wrapped, or the layer's methods, filter or optional key let the request through. Use
/// `Option<IdempotencyContext>` where the layer may pass a request through.
pub mod problems {}

#[doc = include_str!("docs/tonic.md")]
pub mod tonic_guide {}

#[doc = include_str!("docs/security.md")]
pub mod security {}

#[doc = include_str!("docs/guarantees.md")]
pub mod guarantees {}

#[doc = include_str!("docs/resumable.md")]
pub mod resumable {}

#[doc = include_str!("docs/webhooks.md")]
pub mod webhooks_guide {}

#[doc = include_str!("docs/clients.md")]
pub mod clients_guide {}

#[doc = include_str!("docs/beyond_http.md")]
pub mod beyond_http {}

/// The README's Rust blocks, run as doctests so that its code keeps compiling.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Not public API: hooks for the benchmarks and the fuzz target (`fuzz/`).
#[doc(hidden)]
pub mod __bench {
    /// The RFC 8785 canonicaliser the fingerprint uses.
    pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
        crate::fingerprint::canonical_json(body, &[])
    }

    /// SHA-256 of the canonical JSON form of `body`, as the fingerprint computes it.
    pub fn canonical_json_digest(body: &[u8]) -> Option<[u8; 32]> {
        crate::fingerprint::canonical_json_digest(body)
    }
}
