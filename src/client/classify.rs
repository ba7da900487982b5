//! Which outcomes a retry can fix, and how long the server asked us to wait.

use std::time::{Duration, SystemTime};

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

/// What to do with one attempt's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Hand the outcome to the caller.
    Final,
    /// Retry, no sooner than `after` when the server said so.
    Retry { after: Option<Duration> },
}

/// gRPC status codes this module looks at.
const GRPC_RESOURCE_EXHAUSTED: u32 = 8;
const GRPC_ABORTED: u32 = 10;
const GRPC_UNAVAILABLE: u32 = 14;

/// The verdict on a response. Transport errors are always retried (see the caller).
///
/// gRPC: a status in the response headers (a trailers-only response, which is how servers and
/// proxies answer a unary call that failed before any message) decides. `UNAVAILABLE` is
/// retried; `ABORTED` and `RESOURCE_EXHAUSTED` only when they carry a `RetryInfo`, because
/// without one the server gave no sign that the same request can succeed later. A status in
/// the trailers arrives after the body started, so it is the caller's to handle.
pub(crate) fn classify<B>(res: &Response<B>, now: SystemTime) -> Verdict {
    let headers = res.headers();
    if res.status() == StatusCode::OK && is_grpc(headers) {
        let Some(code) = header_str(headers, "grpc-status").and_then(|s| s.parse::<u32>().ok())
        else {
            return Verdict::Final;
        };
        let retry_info = grpc_retry_delay(headers);
        return match code {
            GRPC_UNAVAILABLE => Verdict::Retry { after: retry_info },
            GRPC_ABORTED | GRPC_RESOURCE_EXHAUSTED if retry_info.is_some() => {
                Verdict::Retry { after: retry_info }
            }
            _ => Verdict::Final,
        };
    }
    let after = retry_after(headers, now);
    match res.status().as_u16() {
        408 | 429 | 500 | 502 | 503 | 504 => Verdict::Retry { after },
        // The server layer's "still in progress" answer always carries `Retry-After`; a 409
        // without one is some other conflict that a retry cannot fix.
        409 if after.is_some() => Verdict::Retry { after },
        _ => Verdict::Final,
    }
}

fn is_grpc(headers: &HeaderMap) -> bool {
    header_str(headers, CONTENT_TYPE.as_str()).is_some_and(|ct| ct.starts_with("application/grpc"))
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `Retry-After` as delta-seconds or an HTTP-date (RFC 9110 §10.2.3). A date in the past is
/// zero; anything unparsable is ignored, as if absent.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = header_str(headers, RETRY_AFTER.as_str())?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Absurdly long digit strings saturate instead of being dropped.
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The `retry_delay` of a `google.rpc.RetryInfo` inside `grpc-status-details-bin`.
///
/// The few protobuf fields are decoded by hand (as `response.rs` encodes them) rather than
/// with prost: prost would become a dependency of every `client` user, with generated types,
/// to read two varints.
///
/// ```text
/// Status    { int32 code = 1; string message = 2; repeated Any details = 3; }
/// Any       { string type_url = 1; bytes value = 2; }
/// RetryInfo { Duration retry_delay = 1; }
/// Duration  { int64 seconds = 1; int32 nanos = 2; }
/// ```
pub(crate) fn grpc_retry_delay(headers: &HeaderMap) -> Option<Duration> {
    const RETRY_INFO: &[u8] = b"type.googleapis.com/google.rpc.RetryInfo";
    let status = base64_decode(header_str(headers, "grpc-status-details-bin")?)?;
    let details = fields(&status)?.into_iter().filter_map(|f| match f {
        (3, Field::Bytes(any)) => Some(any),
        _ => None,
    });
    for any in details {
        let any = fields(any)?;
        let is_retry_info = any
            .iter()
            .any(|f| matches!(f, (1, Field::Bytes(url)) if *url == RETRY_INFO));
        if !is_retry_info {
            continue;
        }
        let value = any.iter().find_map(|f| match f {
            (2, Field::Bytes(v)) => Some(*v),
            _ => None,
        });
        // An empty RetryInfo (all defaults) means a zero delay.
        let delay = fields(value.unwrap_or_default())?
            .into_iter()
            .find_map(|f| match f {
                (1, Field::Bytes(d)) => Some(d),
                _ => None,
            })
            .unwrap_or_default();
        let (mut secs, mut nanos) = (0i64, 0i32);
        for f in fields(delay)? {
            match f {
                // int64 and int32 are two's complement in a varint: truncating is the decoding.
                (1, Field::Varint(v)) => secs = v as i64,
                (2, Field::Varint(v)) => nanos = v as i32,
                _ => {}
            }
        }
        if secs < 0 || !(0..1_000_000_000).contains(&nanos) {
            return None;
        }
        return Some(Duration::new(secs as u64, nanos as u32));
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// Every (field number, value) of a message; `None` when it is malformed.
fn fields(mut buf: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let tag = varint(&mut buf)?;
        let value = match tag & 7 {
            0 => Field::Varint(varint(&mut buf)?),
            1 => {
                buf = buf.get(8..)?;
                Field::Fixed
            }
            2 => {
                let len = usize::try_from(varint(&mut buf)?).ok()?;
                let (bytes, rest) = (buf.get(..len)?, buf.get(len..)?);
                buf = rest;
                Field::Bytes(bytes)
            }
            5 => {
                buf = buf.get(4..)?;
                Field::Fixed
            }
            _ => return None, // groups are long deprecated; nothing we read uses them
        };
        out.push((tag >> 3, value));
    }
    Some(out)
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

/// Base64 as gRPC sends `-bin` metadata: standard alphabet, padding optional. The URL-safe
/// alphabet is accepted too, since it cannot be confused with the standard one.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim().trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for b in s.bytes() {
        let v = match b {
            b'A'..=b'Z' => b - b'A',
            b'a'..=b'z' => b - b'a' + 26,
            b'0'..=b'9' => b - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    // One leftover character (6 bits) cannot end a valid encoding.
    (bits < 6).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn response(status: u16, headers: &[(&'static str, &str)]) -> Response<()> {
        let mut res = Response::new(());
        *res.status_mut() = StatusCode::from_u16(status).unwrap();
        for (k, v) in headers {
            res.headers_mut()
                .insert(*k, HeaderValue::from_str(v).unwrap());
        }
        res
    }

    fn verdict(status: u16, headers: &[(&'static str, &str)]) -> Verdict {
        classify(&response(status, headers), SystemTime::now())
    }

    #[test]
    fn retries_exactly_the_statuses_that_can_succeed_later() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert_eq!(
                verdict(status, &[]),
                Verdict::Retry { after: None },
                "{status}"
            );
        }
        for status in [
            200, 201, 204, 301, 304, 400, 401, 403, 404, 405, 409, 410, 412, 413, 415, 422, 501,
            505,
        ] {
            assert_eq!(verdict(status, &[]), Verdict::Final, "{status}");
        }
    }

    #[test]
    fn a_409_is_retried_only_with_retry_after() {
        assert_eq!(
            verdict(409, &[("retry-after", "7")]),
            Verdict::Retry {
                after: Some(Duration::from_secs(7))
            }
        );
        assert_eq!(verdict(409, &[]), Verdict::Final);
        // A 422 stays final even when a server adds Retry-After to it.
        assert_eq!(verdict(422, &[("retry-after", "7")]), Verdict::Final);
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let h = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(RETRY_AFTER, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(retry_after(&h("120"), now), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(&h(" 0 "), now), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(retry_after(&h(&later), now), Some(Duration::from_secs(90)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(retry_after(&h(&earlier), now), Some(Duration::ZERO));
        assert_eq!(retry_after(&h("-5"), now), None);
        assert_eq!(retry_after(&h("soon"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    /// `google.rpc.Status { code: ABORTED, message: "hi", details: [RetryInfo 2.5 s] }`.
    const STATUS_WITH_RETRY_INFO: &[u8] =
        b"\x08\x0a\x12\x02hi\x1a\x36\x0a\x28type.googleapis.com/google.rpc.RetryInfo\x12\x0a\x0a\x08\x08\x02\x10\x80\xca\xb5\xee\x01";

    // The server side's encoder: what the layer's own gRPC errors carry.
    use crate::response::base64 as b64;

    fn grpc(code: &str, details: Option<&[u8]>) -> Verdict {
        let encoded = details.map(b64);
        let mut h = vec![("content-type", "application/grpc"), ("grpc-status", code)];
        if let Some(d) = &encoded {
            h.push(("grpc-status-details-bin", d));
        }
        verdict(200, &h)
    }

    #[test]
    fn decodes_retry_info_from_grpc_status_details() {
        let mut h = HeaderMap::new();
        h.insert(
            "grpc-status-details-bin",
            HeaderValue::from_str(&b64(STATUS_WITH_RETRY_INFO)).unwrap(),
        );
        assert_eq!(grpc_retry_delay(&h), Some(Duration::from_millis(2500)));
        // Padded base64 decodes the same.
        let mut padded = b64(STATUS_WITH_RETRY_INFO);
        while !padded.len().is_multiple_of(4) {
            padded.push('=');
        }
        h.insert(
            "grpc-status-details-bin",
            HeaderValue::from_str(&padded).unwrap(),
        );
        assert_eq!(grpc_retry_delay(&h), Some(Duration::from_millis(2500)));
        // A detail of another type is no RetryInfo.
        let other = b"\x08\x0a\x1a\x2f\x0a\x2btype.googleapis.com/google.rpc.ErrorInfoXYZ\x12\x00";
        h.insert(
            "grpc-status-details-bin",
            HeaderValue::from_str(&b64(other)).unwrap(),
        );
        assert_eq!(grpc_retry_delay(&h), None);
        // Truncated input is ignored, never a panic.
        for cut in 0..STATUS_WITH_RETRY_INFO.len() {
            let mut h = HeaderMap::new();
            h.insert(
                "grpc-status-details-bin",
                HeaderValue::from_str(&b64(&STATUS_WITH_RETRY_INFO[..cut])).unwrap(),
            );
            let _ = grpc_retry_delay(&h);
        }
    }

    #[test]
    fn grpc_statuses_are_retried_only_when_they_can_succeed_later() {
        let delay = Some(Duration::from_millis(2500));
        assert_eq!(grpc("14", None), Verdict::Retry { after: None });
        assert_eq!(
            grpc("14", Some(STATUS_WITH_RETRY_INFO)),
            Verdict::Retry { after: delay }
        );
        assert_eq!(
            grpc("10", Some(STATUS_WITH_RETRY_INFO)),
            Verdict::Retry { after: delay }
        );
        assert_eq!(
            grpc("8", Some(STATUS_WITH_RETRY_INFO)),
            Verdict::Retry { after: delay }
        );
        assert_eq!(grpc("10", None), Verdict::Final);
        assert_eq!(grpc("8", None), Verdict::Final);
        for code in ["0", "3", "5", "6", "9", "13", "16"] {
            assert_eq!(
                grpc(code, Some(STATUS_WITH_RETRY_INFO)),
                Verdict::Final,
                "{code}"
            );
        }
        // The status in the trailers (a body follows): not ours to judge from the headers.
        assert_eq!(
            verdict(200, &[("content-type", "application/grpc")]),
            Verdict::Final
        );
        // A proxy's HTTP 503 in front of a gRPC server is judged as HTTP.
        assert_eq!(
            verdict(503, &[("content-type", "application/grpc")]),
            Verdict::Retry { after: None }
        );
    }

    #[test]
    fn base64_decodes_both_alphabets_and_rejects_garbage() {
        assert_eq!(base64_decode("aGk").unwrap(), b"hi");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode("-_8").unwrap(), base64_decode("+/8").unwrap());
        assert_eq!(base64_decode("").unwrap(), b"");
        assert!(base64_decode("a").is_none());
        assert!(base64_decode("a*b").is_none());
    }
}
