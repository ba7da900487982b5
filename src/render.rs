//! Error renderers for [`IdempotencyLayer::with_error_renderer`](crate::IdempotencyLayer::with_error_renderer):
//! the layer's errors in the shape a client library already reads.
//!
//! The default is problem+json (RFC 9457, see [`problems`](crate::problems)). Clients
//! generated for another error shape see a problem as an unknown error: the official Stripe
//! SDKs read `{"error": {"type", "code", "message"}}` only, so a reused key surfaces as a
//! generic error with no code. [`stripe`] answers in that shape.
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use std::convert::Infallible;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::{render, store::MemoryStore, IdempotencyLayer, RequestBody};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let charge = service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
//!     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(r#"{"id":"ch_1"}"#))))
//! });
//! let svc = ServiceBuilder::new()
//!     .layer(
//!         IdempotencyLayer::new(MemoryStore::new())
//!             // One key space per account, as an auth layer outside this one would set it.
//!             .with_scope(|_req| Some("acct_1".to_owned()))
//!             .with_error_renderer(render::stripe),
//!     )
//!     .service(charge);
//! let charge = |amount: &str| {
//!     Request::post("/v1/charges")
//!         .header("idempotency-key", "order-1234")
//!         .header("content-type", "application/x-www-form-urlencoded")
//!         .body(Full::new(Bytes::from(format!("amount={amount}&currency=eur"))))
//!         .unwrap()
//! };
//! svc.clone().oneshot(charge("1000")).await.unwrap();
//!
//! // The same key with another amount: what stripe-python raises as `stripe.IdempotencyError`.
//! let reused = svc.clone().oneshot(charge("2000")).await.unwrap();
//! assert_eq!(reused.status(), StatusCode::BAD_REQUEST);
//! let body = reused.into_body().collect().await.unwrap().to_bytes();
//! let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
//! assert_eq!(v["error"]["type"], "idempotency_error");
//! assert_eq!(v["error"]["code"], "key_reused");
//! # }
//! ```

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::error::{ErrorKind, IdempotencyError};

/// Renders an error as a [Stripe error object](https://docs.stripe.com/api/errors):
/// `{"error": {"type": …, "code": …, "message": …, "doc_url": …}}`, `application/json`.
///
/// | kind | status | `type` | `code` | what stripe-python raises |
/// |---|---|---|---|---|
/// | [`Mismatch`](ErrorKind::Mismatch) | **400** (not 422) | `idempotency_error` | `key_reused` | `IdempotencyError` |
/// | [`InProgress`](ErrorKind::InProgress) | 409 (503 under a [`Webhook`](crate::Webhook)) | `idempotency_error` | `idempotency_key_in_use` | retries, then `APIError` |
/// | [`QuotaExceeded`](ErrorKind::QuotaExceeded) | 429 | `invalid_request_error` | `rate_limit` | `RateLimitError` |
/// | [`StoreUnavailable`](ErrorKind::StoreUnavailable), [`ScopeMissing`](ErrorKind::ScopeMissing) | 503, 500 | `api_error` | `store_unavailable`, `scope_missing` | retries, then `APIError` |
/// | every other kind | its own ([`IdempotencyError::status`]) | `invalid_request_error` | the kind's [slug](ErrorKind::slug), `-` as `_` | `InvalidRequestError` on 400 |
///
/// A reused key is a `400`, as Stripe answers it: stripe-python (`_api_requestor.py`,
/// `specific_v1_api_error`) raises `IdempotencyError` only for a `400` or `404` whose
/// `error.type` is `idempotency_error`, and a generic `APIError` for a `422`. The typed
/// [`IdempotencyError`] in the response extensions still says
/// [`ErrorKind::Mismatch`]. `409`, `429` and `5xx` keep their status, which the SDKs
/// retry (409 and 5xx) or raise as a rate limit (429).
///
/// `type` is one of Stripe's documented values (`api_error`, `card_error`,
/// `idempotency_error`, `invalid_request_error`); `code` is Stripe's own code where Stripe
/// has one for the case (`idempotency_key_in_use`, `rate_limit`), else this crate's stable
/// slug; `doc_url` is the kind's section in [`problems`](crate::problems). `Retry-After`
/// (whole seconds) and `retry-after-ms` are kept on the answers that carry a retry hint,
/// with `Cache-Control: no-store` on all, as the default renderer sends them.
pub fn stripe(err: &IdempotencyError) -> Response<Bytes> {
    let kind = err.kind();
    let (status, ty, code) = match kind {
        ErrorKind::Mismatch => (StatusCode::BAD_REQUEST, "idempotency_error", snake(kind)),
        ErrorKind::InProgress => (
            err.status(),
            "idempotency_error",
            "idempotency_key_in_use".to_owned(),
        ),
        ErrorKind::QuotaExceeded => (err.status(), "invalid_request_error", "rate_limit".into()),
        ErrorKind::StoreUnavailable | ErrorKind::ScopeMissing => {
            (err.status(), "api_error", snake(kind))
        }
        _ => (err.status(), "invalid_request_error", snake(kind)),
    };
    let body = serde_json::json!({
        "error": {
            "type": ty,
            "code": code,
            "message": err.detail(),
            "doc_url": kind.type_uri(),
        }
    });
    let mut res = Response::new(Bytes::from(body.to_string()));
    *res.status_mut() = status;
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(after) = err.retry_after_duration() {
        // As the default renderer: whole seconds rounded up (at least 1), and the
        // milliseconds themselves (at least 1) for clients that read `retry-after-ms`.
        let secs = (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1);
        let ms = u64::try_from(after.as_nanos().div_ceil(1_000_000).max(1)).unwrap_or(u64::MAX);
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
        h.insert(
            http::HeaderName::from_static("retry-after-ms"),
            HeaderValue::from(ms),
        );
    }
    res
}

/// The kind's slug as a Stripe-style code: `key-reused` → `key_reused`.
fn snake(kind: ErrorKind) -> String {
    kind.slug().replace('-', "_")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn error_object(res: &Response<Bytes>) -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        v["error"].clone()
    }

    #[test]
    fn a_reused_key_is_a_400_idempotency_error_as_stripe_sdks_expect() {
        let res = stripe(&IdempotencyError::new(ErrorKind::Mismatch, "other params"));
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/json");
        assert_eq!(res.headers()[CACHE_CONTROL], "no-store");
        assert!(!res.headers().contains_key(RETRY_AFTER));
        let e = error_object(&res);
        assert_eq!(e["type"], "idempotency_error");
        assert_eq!(e["code"], "key_reused");
        assert_eq!(e["message"], "other params");
        assert_eq!(e["doc_url"], ErrorKind::Mismatch.type_uri());
    }

    #[test]
    fn in_progress_keeps_409_and_its_retry_hints() {
        let err = IdempotencyError::new(ErrorKind::InProgress, "still running")
            .retry_after(Duration::from_millis(1500));
        let res = stripe(&err);
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[RETRY_AFTER], "2");
        assert_eq!(res.headers()["retry-after-ms"], "1500");
        let e = error_object(&res);
        assert_eq!(e["type"], "idempotency_error");
        assert_eq!(e["code"], "idempotency_key_in_use");
    }

    #[test]
    fn in_progress_under_a_webhook_keeps_the_webhooks_status() {
        let err = IdempotencyError::new(ErrorKind::InProgress, "still running")
            .with_status(StatusCode::SERVICE_UNAVAILABLE)
            .retry_after(Duration::ZERO);
        let res = stripe(&err);
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()[RETRY_AFTER], "1");
        assert_eq!(res.headers()["retry-after-ms"], "1");
    }

    #[test]
    fn other_kinds_keep_their_status_with_a_documented_stripe_type() {
        let invalid = "invalid_request_error";
        for (kind, status, ty, code) in [
            (ErrorKind::KeyMissing, 400, invalid, "key_missing"),
            (ErrorKind::KeyInvalid, 400, invalid, "key_invalid"),
            (ErrorKind::BodyTooLarge, 413, invalid, "body_too_large"),
            (ErrorKind::QuotaExceeded, 429, invalid, "rate_limit"),
            (
                ErrorKind::StoreUnavailable,
                503,
                "api_error",
                "store_unavailable",
            ),
            (ErrorKind::ScopeMissing, 500, "api_error", "scope_missing"),
            (
                ErrorKind::SignatureInvalid,
                401,
                invalid,
                "signature_invalid",
            ),
        ] {
            let res = stripe(&IdempotencyError::new(kind, "x"));
            assert_eq!(res.status().as_u16(), status, "{kind:?}");
            let e = error_object(&res);
            assert_eq!(
                (e["type"].as_str(), e["code"].as_str()),
                (Some(ty), Some(code))
            );
        }
    }
}
