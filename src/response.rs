//! Building the responses the layer answers with: problems, gRPC statuses and replays.

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, Response};
use http_body::Body;

use crate::body::ResponseBody;
use crate::error::{ErrorKind, IdempotencyError};
use crate::record::StoredResponse;

/// `Idempotent-Replayed: true` marks an answer that came from the store.
pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Renders an error as RFC 9457 problem+json.
pub(crate) fn problem(err: &IdempotencyError) -> Response<Bytes> {
    let kind = err.kind();
    let mut body = serde_json::json!({
        "type": kind.type_uri(),
        "title": kind.title(),
        "status": kind.status().as_u16(),
        "detail": err.detail(),
    });
    if let Some(secs) = err.retry_after_secs() {
        body["retry_after"] = secs.into();
    }
    if let Some(status) = err.original_response_status() {
        body["original_status"] = status.as_u16().into();
    }
    let mut res = Response::new(Bytes::from(body.to_string()));
    *res.status_mut() = kind.status();
    let h = res.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(secs) = err.retry_after_secs() {
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

/// The gRPC status code for an error kind.
pub(crate) fn grpc_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::KeyMissing | ErrorKind::KeyInvalid | ErrorKind::BodyUnreadable => 3, // INVALID_ARGUMENT
        ErrorKind::InProgress => 10,                                                    // ABORTED
        ErrorKind::Mismatch => 9,            // FAILED_PRECONDITION
        ErrorKind::BodyTooLarge => 8,        // RESOURCE_EXHAUSTED
        ErrorKind::StoreUnavailable => 14,   // UNAVAILABLE
        ErrorKind::ResponseNotRetained => 6, // ALREADY_EXISTS
        ErrorKind::ScopeMissing => 13,       // INTERNAL
    }
}

/// Renders an error as a gRPC trailers-only response: HTTP 200, status in the headers.
pub(crate) fn grpc_status(err: &IdempotencyError) -> Response<Bytes> {
    let mut message = err.detail().to_owned();
    if let Some(secs) = err.retry_after_secs() {
        message = format!("{message}; retry after {secs}s");
    }
    let mut res = Response::new(Bytes::new());
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert(
        "grpc-status",
        HeaderValue::from(u16::from(grpc_code(err.kind()))),
    );
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
        h.insert("grpc-message", v);
    }
    if let Some(secs) = err.retry_after_secs() {
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

/// gRPC's percent-encoding of grpc-message: everything outside 0x20-0x7E and `%` itself.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A layer-made response, with the typed error in its extensions.
pub(crate) fn error_response<B: Body>(
    rendered: Response<Bytes>,
    err: IdempotencyError,
) -> Response<ResponseBody<B>> {
    let (mut parts, body) = rendered.into_parts();
    parts.extensions.insert(err);
    Response::from_parts(parts, ResponseBody::full(body, None))
}

/// The recorded answer, byte for byte, marked as replayed.
pub(crate) fn replay<B: Body>(stored: &StoredResponse) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(
        stored.body.clone(),
        stored.trailers.clone(),
    ));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers.clone();
    res.headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    res
}

/// The headers kept when recording: the allow-list, in their original order.
pub(crate) fn recorded_headers(headers: &HeaderMap, allow: &[HeaderName]) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for name in allow {
        for v in headers.get_all(name) {
            kept.append(name.clone(), v.clone());
        }
    }
    kept
}

/// The default allow-list of recorded response headers.
pub(crate) fn default_recorded_headers() -> Vec<HeaderName> {
    use http::header::*;
    vec![
        CONTENT_TYPE,
        CONTENT_ENCODING,
        CONTENT_LANGUAGE,
        LOCATION,
        CONTENT_LOCATION,
        ETAG,
        LAST_MODIFIED,
        LINK,
        CACHE_CONTROL,
        VARY,
        RETRY_AFTER,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;
    use std::time::Duration;

    #[test]
    fn problems_are_rfc9457_with_no_store_and_retry_after() {
        let err = IdempotencyError::new(ErrorKind::InProgress, "still running")
            .retry_after(Duration::from_millis(2500));
        let res = problem(&err);
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(res.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(res.headers()[RETRY_AFTER], "3");
        let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        assert_eq!(v["status"], 409);
        assert_eq!(v["type"], ErrorKind::InProgress.type_uri());
        assert_eq!(v["detail"], "still running");
    }

    #[test]
    fn grpc_errors_are_trailers_only_with_encoded_messages() {
        let err = IdempotencyError::new(ErrorKind::Mismatch, "50% différent");
        let res = grpc_status(&err);
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "9");
        assert_eq!(res.headers()["grpc-message"], "50%25 diff%C3%A9rent");
        assert!(res.body().is_empty());
    }
}
