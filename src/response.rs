//! Building the responses the layer answers with: problems, gRPC statuses and replays.

use bytes::Bytes;
use http::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, Response, StatusCode};
use http_body::Body;
use std::time::Duration;

use crate::body::ResponseBody;
use crate::error::{ErrorKind, IdempotencyError};
use crate::store::record::StoredResponse;

/// `Idempotent-Replayed: true` marks an answer that came from the store.
pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotent-Replay-Omitted: too-large` marks a replay that stands in for an answer too
/// large to keep (over [`with_max_response_body`](crate::IdempotencyLayer::with_max_response_body),
/// or a record over the store's caps): under
/// [`with_webhook`](crate::IdempotencyLayer::with_webhook), a redelivery of such an event
/// gets the original status with an empty body, `Idempotent-Replayed: true` and this header,
/// where outside webhook mode a retry gets the `410`
/// [`response-not-retained`](crate::ErrorKind::ResponseNotRetained) problem.
pub const REPLAY_OMITTED_HEADER: HeaderName = HeaderName::from_static("idempotent-replay-omitted");

/// The header that publishes how long keys live, when
/// [`with_ttl_header`](crate::IdempotencyLayer::with_ttl_header) is on.
pub const TTL_HEADER: HeaderName = HeaderName::from_static("idempotency-key-ttl");

/// `retry-after-ms`: the retry hint in milliseconds, beside `Retry-After` in whole seconds.
/// Not a standard: Stainless-generated SDKs (OpenAI's, Anthropic's, …) read it before
/// `Retry-After`, and follow it to the millisecond.
pub(crate) const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// gRPC's own retry hint (gRFC A6), read by clients with a retry policy for the status.
const GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The hint in whole milliseconds: rounded up, at least 1 (`0` reads as "no hint" to
/// Stainless SDKs, and would invite a retry at once).
fn millis(after: Duration) -> HeaderValue {
    let ms = after.as_nanos().div_ceil(1_000_000).max(1);
    HeaderValue::from(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// Renders an error as RFC 9457 problem+json.
pub(crate) fn problem(err: &IdempotencyError) -> Response<Bytes> {
    let kind = err.kind();
    let mut body = serde_json::json!({
        "type": kind.type_uri(),
        "title": kind.title(),
        "status": err.status().as_u16(),
        "detail": err.detail(),
    });
    if let Some(secs) = err.retry_after_secs() {
        body["retry_after"] = secs.into();
    }
    if let Some(status) = err.original_response_status() {
        body["original_status"] = status.as_u16().into();
    }
    let mut res = Response::new(Bytes::from(body.to_string()));
    *res.status_mut() = err.status();
    let h = res.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(secs) = err.retry_after_secs() {
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    if let Some(after) = err.retry_after_duration() {
        h.insert(RETRY_AFTER_MS, millis(after));
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
        ErrorKind::BodyTimeout => 4,         // DEADLINE_EXCEEDED
        ErrorKind::StoreUnavailable => 14,   // UNAVAILABLE
        ErrorKind::ResponseNotRetained => 6, // ALREADY_EXISTS
        ErrorKind::ScopeMissing => 13,       // INTERNAL
        ErrorKind::QuotaExceeded => 8,       // RESOURCE_EXHAUSTED
        ErrorKind::SignatureInvalid => 16,   // UNAUTHENTICATED
    }
}

/// Renders an error as a gRPC trailers-only response: HTTP 200, status in the headers.
///
/// A retry hint goes into the message, a `RetryInfo` detail, `grpc-retry-pushback-ms` and
/// `Retry-After`, except on the quota answer: its hint is a guess for HTTP clients (see
/// [`StoreFailure::quota_retry_after`](crate::StoreFailure::quota_retry_after)).
pub(crate) fn grpc_status(err: &IdempotencyError) -> Response<Bytes> {
    let after = err
        .retry_after_duration()
        .filter(|_| err.kind() != ErrorKind::QuotaExceeded);
    let secs = after.and(err.retry_after_secs());
    let mut message = err.detail().to_owned();
    if let Some(secs) = secs {
        message = format!("{message}; retry after {secs}s");
    }
    let code = grpc_code(err.kind());
    let mut res = Response::new(Bytes::new());
    let h = res.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", HeaderValue::from(u16::from(code)));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&message)) {
        h.insert("grpc-message", v);
    }
    if let Some(delay) = after {
        let details = status_with_retry_info(code, &message, delay);
        if let Ok(v) = HeaderValue::from_str(&base64(&details)) {
            h.insert("grpc-status-details-bin", v);
        }
        h.insert(GRPC_PUSHBACK, millis(delay));
    }
    if let Some(secs) = secs {
        h.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

/// `Idempotency-Key` on an answer, when the layer echoes keys
/// ([`with_key_echo`](crate::IdempotencyLayer::with_key_echo)).
pub(crate) fn echo_key<B>(res: &mut Response<B>, key: &HeaderValue) {
    res.headers_mut()
        .insert(HeaderName::from_static("idempotency-key"), key.clone());
}

/// A `google.rpc.Status` carrying one `google.rpc.RetryInfo` detail, protobuf-encoded by hand
/// (a few bytes; not worth a prost dependency for every user):
///
/// ```text
/// Status     { int32 code = 1; string message = 2; repeated Any details = 3; }
/// Any        { string type_url = 1; bytes value = 2; }
/// RetryInfo  { Duration retry_delay = 1; }
/// Duration   { int64 seconds = 1; int32 nanos = 2; }
/// ```
///
/// Fields at their default (zero) are left out, as protobuf encoders do. `tests/layer/grpc.rs`
/// decodes it with prost.
fn status_with_retry_info(code: u8, message: &str, delay: Duration) -> Vec<u8> {
    let mut duration = Vec::new();
    if delay.as_secs() > 0 {
        duration.push(0x08); // field 1, varint
        varint(&mut duration, delay.as_secs());
    }
    if delay.subsec_nanos() > 0 {
        duration.push(0x10); // field 2, varint
        varint(&mut duration, u64::from(delay.subsec_nanos()));
    }
    let mut retry_info = Vec::new();
    length_delimited(&mut retry_info, 1, &duration);
    let mut any = Vec::new();
    length_delimited(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
    length_delimited(&mut any, 2, &retry_info);
    let mut status = Vec::new();
    if code != 0 {
        status.push(0x08); // field 1, varint
        varint(&mut status, u64::from(code));
    }
    if !message.is_empty() {
        length_delimited(&mut status, 2, message.as_bytes());
    }
    length_delimited(&mut status, 3, &any);
    status
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2) with a field number below 16.
fn length_delimited(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push((field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Standard base64 without padding, as gRPC sends `-bin` metadata.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 0x3f) as usize] as char);
        }
    }
    out
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
pub(crate) fn replay<B: Body>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(stored.body, stored.trailers));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    res.headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    res
}

/// The stand-in for an answer too large to keep (a tombstone), in webhook mode: its original
/// `status`, an empty body, marked as replayed and as omitted. A sender reads the status, so
/// a taken event stays taken; nothing of the original's headers or body is known any more.
pub(crate) fn replay_omitted<B: Body>(status: StatusCode) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(Bytes::new(), None));
    *res.status_mut() = status;
    let h = res.headers_mut();
    h.insert(REPLAYED, HeaderValue::from_static("true"));
    h.insert(REPLAY_OMITTED_HEADER, HeaderValue::from_static("too-large"));
    res
}

pub(crate) use crate::store::record::VARY_DIGEST;

/// Never recorded, in headers or trailers, on HTTP or gRPC: the connection's own (HTTP/2
/// refuses them), values that describe one transmission, cookies (a replay must not hand one
/// caller's session to whoever retries), and the replay marker itself.
pub(crate) const UNRECORDED: [HeaderName; 12] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::TE,
    http::header::TRAILER,
    http::header::CONTENT_LENGTH,
    http::header::DATE,
    http::header::SET_COOKIE,
    REPLAYED,
    // Only the layer writes it; an inner service's own would be trusted on replay.
    VARY_DIGEST,
];

/// The fields kept when recording a response's headers or trailers: all but [`UNRECORDED`]
/// and the user's `extra` deny-list, in their original order.
pub(crate) fn recorded_headers(headers: &HeaderMap, extra: &[HeaderName]) -> HeaderMap {
    if headers.contains_key(http::header::SET_COOKIE) {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!("a recorded answer carried Set-Cookie; cookies are never recorded, so replays do not set them");
        }
    }
    // One pass that copies what is kept: cheaper than a clone and a removal (a hash of the
    // name each) per unrecorded name.
    let mut kept = HeaderMap::with_capacity(headers.len() + 2);
    for (name, value) in headers {
        if is_recorded(name, extra) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// Whether a record keeps the field `name`, given the configured `extra` unrecorded names.
pub(crate) fn is_recorded(name: &HeaderName, extra: &[HeaderName]) -> bool {
    !UNRECORDED.contains(name) && !extra.contains(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn problems_are_rfc9457_with_no_store_and_retry_after() {
        let err = IdempotencyError::new(ErrorKind::InProgress, "still running")
            .retry_after(Duration::from_millis(2500));
        let res = problem(&err);
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(res.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(res.headers()[RETRY_AFTER], "3");
        assert_eq!(res.headers()[RETRY_AFTER_MS], "2500");
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
        assert!(!res.headers().contains_key("grpc-status-details-bin"));
        assert!(!res.headers().contains_key(GRPC_PUSHBACK));
    }

    #[test]
    fn retry_after_ms_is_the_hint_in_milliseconds_rounded_up_and_at_least_one() {
        let ms = |d: Duration| millis(d).to_str().unwrap().to_owned();
        assert_eq!(ms(Duration::from_millis(1500)), "1500");
        assert_eq!(ms(Duration::from_nanos(1_000_001)), "2");
        assert_eq!(ms(Duration::ZERO), "1");
        assert_eq!(ms(Duration::from_secs(60)), "60000");
        let without = problem(&IdempotencyError::new(ErrorKind::Mismatch, "reused"));
        assert!(!without.headers().contains_key(RETRY_AFTER_MS));
        assert!(!without.headers().contains_key(RETRY_AFTER));
    }

    #[test]
    fn a_quota_answer_has_a_retry_hint_on_http_and_none_on_grpc() {
        let err = IdempotencyError::new(ErrorKind::QuotaExceeded, "full")
            .retry_after(Duration::from_secs(60));
        let http = problem(&err);
        assert_eq!(http.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(http.headers()[RETRY_AFTER], "60");
        assert_eq!(http.headers()[RETRY_AFTER_MS], "60000");
        let grpc = grpc_status(&err);
        assert_eq!(grpc.headers()["grpc-status"], "8");
        assert_eq!(grpc.headers()["grpc-message"], "full");
        for name in [
            "grpc-status-details-bin",
            "grpc-retry-pushback-ms",
            "retry-after",
        ] {
            assert!(!grpc.headers().contains_key(name), "{name}");
        }
    }

    #[test]
    fn base64_is_standard_and_unpadded() {
        for (raw, b64) in [
            (&b""[..], ""),
            (b"f", "Zg"),
            (b"fo", "Zm8"),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg"),
            (b"\xfb\xff\xbf", "+/+/"),
        ] {
            assert_eq!(base64(raw), b64);
        }
    }

    #[test]
    fn retry_info_detail_is_the_expected_protobuf() {
        let bytes = status_with_retry_info(10, "busy", Duration::new(2, 500));
        let any =
            b"\x0a\x28type.googleapis.com/google.rpc.RetryInfo\x12\x07\x0a\x05\x08\x02\x10\xf4\x03";
        let mut want = b"\x08\x0a\x12\x04busy\x1a".to_vec();
        want.push(any.len() as u8);
        want.extend_from_slice(any);
        assert_eq!(bytes, want);
    }

    #[test]
    fn in_progress_grpc_errors_carry_retry_info() {
        let err = IdempotencyError::new(ErrorKind::InProgress, "still running")
            .retry_after(Duration::from_millis(1500));
        let res = grpc_status(&err);
        assert_eq!(res.headers()["grpc-status"], "10");
        assert_eq!(
            res.headers()["grpc-message"],
            "still running; retry after 2s"
        );
        assert!(res.headers().contains_key("grpc-status-details-bin"));
        assert_eq!(res.headers()[GRPC_PUSHBACK], "1500");
        assert_eq!(res.headers()[RETRY_AFTER], "2");
    }

    #[test]
    fn records_keep_metadata_and_drop_connection_headers_and_the_deny_list() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert("grpc-status", HeaderValue::from_static("9"));
        h.insert("grpc-message", HeaderValue::from_static("card_declined"));
        h.append("x-charge", HeaderValue::from_static("a"));
        h.append("x-charge", HeaderValue::from_static("b"));
        h.insert(
            "date",
            HeaderValue::from_static("Sat, 29 Nov 2025 14:00:00 GMT"),
        );
        h.insert("connection", HeaderValue::from_static("close"));
        let kept = recorded_headers(&h, &[]);
        assert_eq!(kept.len(), 5);
        assert_eq!(kept["grpc-status"], "9");
        let charges: Vec<_> = kept.get_all("x-charge").iter().collect();
        assert_eq!(charges, ["a", "b"]);
        assert!(!kept.contains_key("date") && !kept.contains_key("connection"));
        let kept = recorded_headers(&h, &[HeaderName::from_static("x-charge")]);
        assert_eq!(kept.len(), 3, "the user's deny-list applies too");
    }
}
