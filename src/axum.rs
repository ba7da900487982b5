//! axum integration (feature `axum`): the context as an extractor.

use std::convert::Infallible;
use std::fmt;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use http::request::Parts;
use http::StatusCode;

use crate::IdempotencyContext;

/// `IdempotencyContext` as an axum extractor: a keyed request the layer runs has one.
///
/// Use `Option<IdempotencyContext>` on routes where the key is optional.
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = MissingIdempotencyContext;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyContext>()
            .cloned()
            .ok_or(MissingIdempotencyContext)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Infallible> {
        Ok(parts.extensions.get::<IdempotencyContext>().cloned())
    }
}

/// The rejection of the [`IdempotencyContext`] extractor: the handler runs without the
/// layer in front of it (the route is not wrapped, the method or the filter let the request
/// pass, or the key was optional and absent). A server bug, so 500, answered as problem+json
/// of type [`context-missing`](crate::problems#context-missing); the log gets the fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingIdempotencyContext;

impl fmt::Display for MissingIdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no IdempotencyContext: IdempotencyLayer does not run before this handler for this request (add it with `.layer()` on the route or router, and check its methods and filter)")
    }
}

impl std::error::Error for MissingIdempotencyContext {}

impl MissingIdempotencyContext {
    /// The problem `type`, in the URI scheme of [`ErrorKind::type_uri`](crate::ErrorKind::type_uri).
    /// Not an `ErrorKind`: the layer never answers with it, only this extractor does.
    const TYPE: &'static str =
        "https://docs.rs/tower-idempotency/latest/tower_idempotency/problems/#context-missing";
}

/// RFC 9457 problem+json with `Cache-Control: no-store`, like every answer the layer makes.
impl IntoResponse for MissingIdempotencyContext {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        let status = StatusCode::INTERNAL_SERVER_ERROR;
        let body = serde_json::json!({
            "type": Self::TYPE,
            "title": "Idempotency context missing",
            "status": status.as_u16(),
            "detail": "the idempotency layer did not run in front of this handler for this request",
        });
        let mut res = (status, body.to_string()).into_response();
        let h = res.headers_mut();
        h.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        res
    }
}
