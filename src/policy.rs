//! Which answers are recorded, and which are released so that a retry runs again.

use http::{HeaderMap, StatusCode};

/// A decision about one response.
///
/// A handler can put one into its response extensions; it overrides the layer's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordDecision {
    /// Keep the answer and replay it to every retry.
    Record,
    /// Forget the claim: a retry runs the inner service again.
    Release,
    /// The handler completed the record itself (for example inside its own database
    /// transaction, see the Postgres store); the layer neither completes nor releases.
    AlreadyRecorded,
}

/// What a [`RecordPolicy`] sees of a response.
#[derive(Debug, Clone, Copy)]
pub struct ResponseInfo<'a> {
    status: StatusCode,
    headers: &'a HeaderMap,
    trailers: Option<&'a HeaderMap>,
}

impl<'a> ResponseInfo<'a> {
    pub(crate) fn new(
        status: StatusCode,
        headers: &'a HeaderMap,
        trailers: Option<&'a HeaderMap>,
    ) -> Self {
        Self {
            status,
            headers,
            trailers,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers.
    pub fn headers(&self) -> &HeaderMap {
        self.headers
    }

    /// The trailers: present for gRPC responses (which are read whole before deciding).
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers
    }

    /// The gRPC status code, from the trailers or, in a trailers-only response, the headers.
    pub fn grpc_status(&self) -> Option<u32> {
        self.trailers
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| self.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }
}

/// Decides whether a response is recorded. Implemented for closures
/// `Fn(&ResponseInfo<'_>) -> bool` (`true` records).
pub trait RecordPolicy: Send + Sync + 'static {
    /// `true` to record `response`, `false` to release the claim.
    fn should_record(&self, response: &ResponseInfo<'_>) -> bool;
}

impl<F> RecordPolicy for F
where
    F: Fn(&ResponseInfo<'_>) -> bool + Send + Sync + 'static,
{
    fn should_record(&self, response: &ResponseInfo<'_>) -> bool {
        self(response)
    }
}

/// The default policy.
///
/// HTTP: record 2xx, 3xx and 4xx, except 400, 401, 403, 404, 405, 408, 409, 413, 415, 422,
/// 425 and 429, which say the request was not acted on (or may succeed later); release those
/// and every 5xx.
///
/// gRPC (decided on `grpc-status`): record `OK`, `ALREADY_EXISTS`, `FAILED_PRECONDITION` and
/// `OUT_OF_RANGE`; release everything else (`INVALID_ARGUMENT` as HTTP 400, `UNAVAILABLE`,
/// `RESOURCE_EXHAUSTED`, `ABORTED`, `INTERNAL`, `UNKNOWN`, `DEADLINE_EXCEEDED`, `CANCELLED`,
/// and the auth, not-found, unimplemented and data-loss codes, as their HTTP kin). The
/// [tonic guide](crate::tonic_guide#recording-and-replay) has the table, code by code.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultRecordPolicy;

impl RecordPolicy for DefaultRecordPolicy {
    fn should_record(&self, response: &ResponseInfo<'_>) -> bool {
        if is_grpc(response.headers) {
            return matches!(response.grpc_status(), Some(0 | 6 | 9 | 11));
        }
        let s = response.status.as_u16();
        match s {
            200..=399 => true,
            400 | 401 | 403 | 404 | 405 | 408 | 409 | 413 | 415 | 422 | 425 | 429 => false,
            402..=499 => true,
            _ => false,
        }
    }
}

pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(http::header::CONTENT_TYPE).is_some_and(|v| {
        // The prefix first: most requests fail it at once, before `to_str` checks every byte.
        v.as_bytes()
            .strip_prefix(b"application/grpc")
            .is_some_and(|rest| matches!(rest.first(), None | Some(b'+' | b';')))
            && v.to_str().is_ok()
    })
}

/// The handler's explicit word first, then the policy. `Cache-Control: no-store` is not read:
/// many APIs send it on every response, and reading it as "do not record" would silently
/// turn idempotency off.
pub(crate) fn decide(
    policy: &dyn RecordPolicy,
    extension: Option<RecordDecision>,
    info: &ResponseInfo<'_>,
) -> RecordDecision {
    if let Some(d) = extension {
        return d;
    }
    if policy.should_record(info) {
        RecordDecision::Record
    } else {
        RecordDecision::Release
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn record(status: u16) -> bool {
        let h = HeaderMap::new();
        DefaultRecordPolicy.should_record(&ResponseInfo::new(
            StatusCode::from_u16(status).unwrap(),
            &h,
            None,
        ))
    }

    #[test]
    fn default_http_policy_matches_the_design_table() {
        for s in [200, 201, 204, 301, 303, 402, 406, 410, 412, 418, 451] {
            assert!(record(s), "{s} must be recorded");
        }
        for s in [
            400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429, 500, 502, 503, 504,
        ] {
            assert!(!record(s), "{s} must be released");
        }
    }

    #[test]
    fn default_grpc_policy_reads_grpc_status_from_trailers_or_headers() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/grpc"));
        let mut t = HeaderMap::new();
        for (code, rec) in [
            (0, true),
            (9, true),
            (6, true),
            (11, true),
            (3, false),
            (14, false),
            (8, false),
            (10, false),
            (13, false),
            (2, false),
            (4, false),
            (1, false),
        ] {
            t.insert("grpc-status", HeaderValue::from(code));
            let info = ResponseInfo::new(StatusCode::OK, &h, Some(&t));
            assert_eq!(
                DefaultRecordPolicy.should_record(&info),
                rec,
                "grpc-status {code}"
            );
        }
        h.insert("grpc-status", HeaderValue::from_static("9"));
        assert!(DefaultRecordPolicy.should_record(&ResponseInfo::new(StatusCode::OK, &h, None)));
        h.remove("grpc-status");
        assert!(
            !DefaultRecordPolicy.should_record(&ResponseInfo::new(StatusCode::OK, &h, None)),
            "no status: release"
        );
    }

    #[test]
    fn the_handlers_extension_comes_before_the_policy_and_no_store_alone_records() {
        let mut h = HeaderMap::new();
        let info = ResponseInfo::new(StatusCode::CREATED, &h, None);
        let p = &DefaultRecordPolicy;
        assert_eq!(decide(p, None, &info), RecordDecision::Record);
        assert_eq!(
            decide(p, Some(RecordDecision::Release), &info),
            RecordDecision::Release
        );
        h.insert(
            "cache-control",
            HeaderValue::from_static("private, No-Store"),
        );
        let info = ResponseInfo::new(StatusCode::CREATED, &h, None);
        assert_eq!(
            decide(p, None, &info),
            RecordDecision::Record,
            "no-store alone must not turn idempotency off"
        );
        assert_eq!(
            decide(p, Some(RecordDecision::Release), &info),
            RecordDecision::Release
        );
    }

    #[test]
    fn grpc_is_its_media_type_and_its_subtypes_only() {
        let of = |ct: &[u8]| {
            let mut h = HeaderMap::new();
            h.insert("content-type", HeaderValue::from_bytes(ct).unwrap());
            is_grpc(&h)
        };
        for yes in [
            &b"application/grpc"[..],
            b"application/grpc+proto",
            b"application/grpc;x=1",
        ] {
            assert!(of(yes), "{yes:?}");
        }
        let no: [&[u8]; 5] = [
            b"application/grpcx",
            b"application/grp",
            b"application/json",
            b"Application/grpc",
            // Not visible ASCII: the header as a whole is not read as gRPC.
            b"application/grpc+\xff",
        ];
        for no in no {
            assert!(!of(no), "{no:?}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }
}
