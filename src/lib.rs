//! Idempotency-Key middleware for tower: run the work once, replay the answer to every retry.
//!
//! A client that timed out cannot tell whether its payment went through. With
//! [`IdempotencyLayer`] in front of the handler it sends the same request again, with the same
//! `Idempotency-Key`, and the second attempt is harmless: the handler runs **at most once per
//! (scope, key)** within the retention window, and every retry gets the first answer, byte for
//! byte, marked `Idempotent-Replayed: true`.
//!
//! For each keyed request (by default `POST` and `PATCH`; other methods pass through
//! untouched, with no buffering and no store call) the layer:
//!
//! 1. reads the key (a bare token or an RFC 8941 string, 1 to 255 visible ASCII characters);
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
//! attempt runs gets `409` with `Retry-After` (or waits, see [`IdempotencyLayer::with_wait`]);
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
//! ```
//! use axum::{routing::post, Router};
//! use tower_idempotency::{store::MemoryStore, IdempotencyLayer};
//!
//! # #[derive(Clone)] struct Tenant(String);
//! let app: Router = Router::new()
//!     .route("/v1/payments", post(|| async { "charged" }))
//!     .layer(
//!         IdempotencyLayer::new(MemoryStore::new())
//!             // One key space per tenant, as set by an auth layer outside this one.
//!             .with_scope(|req| req.extensions.get::<Tenant>().map(|t| t.0.clone())),
//!     );
//! # drop(app);
//! ```
//!
//! `examples/shop` is a complete payments API: `cargo run --example shop --features axum`. `examples/grpc` is
//! the same shop over tonic; [`tonic_guide`] covers gRPC.
//!
//! ## Which routes are protected
//!
//! A router-wide layer protects every `POST` and `PATCH` ([`IdempotencyLayer::with_methods`]
//! changes the set). Two ways to leave a route out, such as a webhook that arrives without a
//! key:
//!
//! - put the layer on the routes that need it only: `.route("/v1/payments",
//!   post(create_payment).layer(idempotency.clone()))`;
//! - or keep it router-wide and select with a predicate:
//!   `.with_filter(|req| !req.uri.path().starts_with("/webhooks/"))`.
//!
//! ## Nested routers
//!
//! `Router::nest("/v1", …)` strips `/v1` from the URI that inner routes, and a layer on them,
//! see. With the **`axum` feature** the fingerprint reads axum's `OriginalUri`, the path the
//! client sent, so `POST /v1/orders` and `POST /refunds/orders` under one key are a mismatch
//! (`422`), wherever the layer sits. Without the feature, a layer inside a nested router
//! fingerprints the stripped path: put it outside the `nest`, or give each nested router its
//! own [scope](IdempotencyLayer::with_scope).
//!
//! ## The context as an extractor
//!
//! With the `axum` feature, a handler takes the [`IdempotencyContext`] as an argument (or an
//! `Option<IdempotencyContext>` where the key is optional). Without the layer in front of it,
//! the extractor answers `500` with a message that says so.
//!
//! ```
//! # #[cfg(feature = "axum")]
//! # {
//! use axum::{http::StatusCode, routing::post, Router};
//! use tower_idempotency::{store::MemoryStore, IdempotencyContext, IdempotencyLayer};
//!
//! async fn create_payment(ctx: IdempotencyContext) -> (StatusCode, String) {
//!     // The same key for the card network on every retry and takeover of this request.
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
//! ## Layer order, and the traps it sets
//!
//! - In axum, `router.layer(a).layer(b)` makes `b` the **outer** layer (the last `.layer()` call
//!   runs first); in `ServiceBuilder` the **first** listed runs first. Authentication must be
//!   outside this layer, so that the [scope function](IdempotencyLayer::with_scope) can read
//!   the principal. The other way round every keyed request gets `500` scope-missing, and an
//!   unauthenticated one gets that `500` instead of its `401`.
//! - tonic: auth done in `with_interceptor` runs *inside* the layer (the interceptor wraps the
//!   service, under every server-wide layer), so every protected call fails with `INTERNAL`
//!   scope-missing. Use tonic's `InterceptorLayer` in the server's layer stack, outside this
//!   one; see the [tonic guide](tonic_guide#authentication-and-scopes).
//! - axum's own `Json` extractor also rejects with `422`. Clients tell a reused key from a bad
//!   body by the problem `type` (`…/problems/#key-reused`), not by the status.
//! - A `409`'s `Retry-After` is the remaining lease (up to 30 s for a handler that takes 1.5 s):
//!   the time after which a retry surely makes progress. Cap it with
//!   [`IdempotencyLayer::with_in_progress_retry_after`], or let retries wait for the answer
//!   with [`IdempotencyLayer::with_wait`].
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
//! # Where to put the layer
//!
//! - **Inside authentication**, so that the scope function can read the principal from the
//!   request extensions. A layer needs a scope ([`IdempotencyLayer::with_scope`]) or an
//!   explicit [`IdempotencyLayer::unscoped`]; with neither, keyed requests get 500.
//! - **Inside compression** (`CompressionLayer` outside this layer), so that records hold the
//!   identity body and each replay is compressed for the retry's own `Accept-Encoding`.
//! - **Outside timeouts is fine**: a `TimeoutLayer` outside drops the response future, but the
//!   claimed work runs on its own task and its answer is recorded for the retry.
//! - **Inside rate limiting**, so that rejected requests never claim a key.
//!
//! # Feature flags
//!
//! | feature | default | enables |
//! |---|---|---|
//! | `redis` | no | `store::redis` with the `redis` crate (1.x): single node and Cluster |
//! | `postgres` | no | `store::postgres` with `tokio-postgres` and `deadpool-postgres` |
//! | `redis-tls` | no | `rediss://` for the Redis store, with rustls ([`security`](crate::security#tls-to-the-stores)) |
//! | `postgres-tls` | no | TLS for the Postgres store as `sslmode` says, with rustls |
//! | `client` | no | `client`: the retry layer for clients, with `tower`'s retry and `httpdate` |
//! | `axum` | no | [`IdempotencyContext`] as an axum extractor, and fingerprints of the path the client sent inside nested routers |
//! | `conformance` | no | `conformance`: the store conformance suite, to test a custom store |
//! | `metrics` | no | counters and histograms through the `metrics` facade (0.24): outcomes, store latency, body sizes, waits; names in `docs/operations.md` |
//!
//! # Operations
//!
//! [`store::IdempotencyAdmin`] looks a key up and frees or deletes it by hand; every store
//! here implements it. [`IdempotencyLayer::with_abandoned_hook`] hears about keys taken over
//! from a holder that died, and [`IdempotencyLayer::with_ttl_header`] publishes how long keys
//! live. The run book (sizing, Redis and Postgres settings, tuning, alerts) is
//! `docs/operations.md` in the repository.
//!
//! # What "exactly once" means here
//!
//! The layer guarantees **at most one execution per (scope, key) at a time, and a replayed
//! first answer**, within the retention TTL (24 h by default). What it cannot promise:
//!
//! - **A holder cut off from the store, or paused.** If a handler runs longer than its lease
//!   while its renewals cannot reach the store (or its process is paused: a GC pause, a
//!   `SIGSTOP`, a VM migration), the lease lapses and a retry with the same request takes
//!   over (generation 2). Both may then act. The late holder's answer is fenced and never
//!   overwrites the record. Use [`IdempotencyContext::derive`] to give downstream calls their
//!   own idempotency keys, so that a takeover repeats them harmlessly. One hung or failed
//!   renewal is harmless: renewals run every `lease / 3` at fixed times, each under its own
//!   deadline, so one failed renewal leaves a third of the lease to spare; after two in a
//!   row the lease is at its edge (the [guarantees] page has the exact bound).
//! - **An answer the store would not take.** When `complete` fails (or hangs past its
//!   deadline) on every attempt until the lease ends, the client still gets its answer, but
//!   the record stays in progress: retries get `409` until the lease lapses, and then the
//!   same request runs again. The error log says so.
//! - **A claim whose reply is lost.** Every store call has a deadline
//!   ([`Retention::with_store_timeout`]). A claim past it is answered `503` and never run; if
//!   it did take effect, the layer releases it in the background, and if that fails too, the
//!   key answers `409` until the lease lapses.
//! - **A store that loses acknowledged writes**: a Redis failover before replication, a
//!   Postgres restore from an old backup.
//! - **After the TTL** a key is new again.
//! - **Bodies beyond `max_response_body`** are not kept: retries get `410` with the original
//!   status, never a second execution. A large gRPC answer is settled by its trailing status
//!   when the stream ends; one the client abandons before its end is kept as completed (its
//!   status is unknown and the work ran).
//! - Request trailers are not forwarded for keyed requests (the body is buffered).
//! - Fingerprints are versioned (`v1`); a future version would make in-flight retries across
//!   an upgrade answer `422`.
//!
//! [`guarantees`] spells out each window, the arithmetic behind the lease, renewal interval,
//! store deadline and TTL, and every rejected input with its exact response.
//!
//! Errors the layer makes are responses, never `Err`: `problem+json` (RFC 9457) with a stable
//! `type` per kind ([`problems`]) and `Cache-Control: no-store`, or a gRPC status for gRPC
//! requests. The typed [`IdempotencyError`] is in the response extensions.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod abandoned;
mod body;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod context;
mod error;
mod fingerprint;
mod key;
mod layer;
mod metrics;
mod policy;
mod record;
mod response;
mod service;
pub mod store;

#[cfg(feature = "axum")]
mod axum;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use crate::axum::MissingIdempotencyContext;

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;

pub use abandoned::Abandoned;
pub use body::{RequestBody, ResponseBody};
pub use context::IdempotencyContext;
pub use error::{ConfigError, ErrorKind, IdempotencyError};
pub use fingerprint::JsonPointer;
pub use layer::{IdempotencyLayer, Retention, DEFAULT_STORE_TIMEOUT_MAX, MIN_LEASE, TTL_HEADER};
pub use policy::{DefaultRecordPolicy, RecordDecision, RecordPolicy, ResponseInfo};
pub use record::{
    Completion, DecodeError, Fingerprint, Record, RecordId, RecordState, ScopeId, StoredResponse,
    Token,
};
pub use service::{Idempotency, ResponseFuture};

/// The problem types the layer answers with. Each `type` URI points at its section here.
///
/// | status | type | when | gRPC status |
/// |---|---|---|---|
/// | 400 | [`key-missing`](#key-missing) | a protected request without a key | `INVALID_ARGUMENT` |
/// | 400 | [`key-invalid`](#key-invalid) | empty, > 255 characters, not visible ASCII, bad sf-string, or two field lines | `INVALID_ARGUMENT` |
/// | 400 | [`body-unreadable`](#body-unreadable) | the request body failed while being read | `INVALID_ARGUMENT` |
/// | 413 | [`body-too-large`](#body-too-large) | the body exceeds `max_request_body` | `RESOURCE_EXHAUSTED` |
/// | 408 | [`body-timeout`](#body-timeout) | the body did not arrive within `request_body_timeout` | `DEADLINE_EXCEEDED` |
/// | 409 | [`in-progress`](#in-progress) | the first request with this key still runs; `Retry-After` says when its lease ends | `ABORTED` |
/// | 422 | [`key-reused`](#key-reused) | the key was used with a different request (body, path, method) | `FAILED_PRECONDITION` |
/// | 410 | [`response-not-retained`](#response-not-retained) | the original completed, but its response was too large to keep | `ALREADY_EXISTS` |
/// | 429 | [`quota-exceeded`](#quota-exceeded) | the caller's scope holds as many records as the store's per-scope quota allows | `RESOURCE_EXHAUSTED` |
/// | 503 | [`store-unavailable`](#store-unavailable) | the store failed; nothing ran; `Retry-After: 1` | `UNAVAILABLE` |
/// | 500 | [`scope-missing`](#scope-missing) | no scope configured, or the scope function found none | `INTERNAL` |
///
/// Every problem carries `type`, `title`, `status` and `detail`; `in-progress` and
/// `store-unavailable` add `retry_after` (seconds), `response-not-retained` adds
/// `original_status`. All have `Cache-Control: no-store`.
///
/// # key-missing
/// Send an `Idempotency-Key` header: a unique value per logical operation (a UUID), reused
/// unchanged for every retry of that operation.
///
/// # key-invalid
/// A key is 1 to 255 visible ASCII characters (`0x21`–`0x7E`), sent once, as a bare token or
/// an RFC 8941 string (`"abc"` is the key `abc`).
///
/// # body-unreadable
/// The connection failed while the body was being read. Nothing was claimed; retry.
///
/// # body-too-large
/// Protected requests are buffered to be fingerprinted. Nothing was claimed.
///
/// # body-timeout
/// The body arrived too slowly (default limit 30 s for the whole body). Nothing was claimed;
/// retry.
///
/// # in-progress
/// Retry after `Retry-After` seconds, with the same key and the same request.
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
///
/// # store-unavailable
/// The request was not processed. Retry after `Retry-After` seconds.
///
/// # scope-missing
/// A server configuration error: the layer has no scope function (and was not made
/// `unscoped()` on purpose), or it runs before the layer that sets the scope (usually
/// authentication).
pub mod problems {}

#[doc = include_str!("docs/tonic.md")]
pub mod tonic_guide {}

#[doc = include_str!("docs/security.md")]
pub mod security {}

#[doc = include_str!("docs/guarantees.md")]
pub mod guarantees {}

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
