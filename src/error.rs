//! The errors the layer answers with, and configuration errors.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use crate::store::StoreError;

/// What went wrong, one stable kind per problem `type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The method requires a key and none was sent. HTTP 400.
    KeyMissing,
    /// The key is empty, too long, not visible ASCII, malformed, or sent twice. HTTP 400.
    KeyInvalid,
    /// The request body is larger than `max_request_body`. HTTP 413.
    BodyTooLarge,
    /// The request body could not be read. HTTP 400.
    BodyUnreadable,
    /// The request body did not arrive within the request body timeout. HTTP 408.
    BodyTimeout,
    /// The first request with this key is still running. HTTP 409, with `Retry-After` (503
    /// under a [`Webhook`](crate::Webhook)).
    InProgress,
    /// The key was used before with a different request. HTTP 422.
    Mismatch,
    /// The store could not be used; the request was not run. HTTP 503, with `Retry-After`.
    StoreUnavailable,
    /// The original request completed, but its response was too large to keep. HTTP 410.
    ResponseNotRetained,
    /// The scope is over the store's per-scope quota. HTTP 429.
    QuotaExceeded,
    /// The scope function found no scope: the layer runs before the one that sets it. HTTP 500.
    ScopeMissing,
    /// A signed webhook delivery ([`Webhook::standard`](crate::Webhook::standard)) without a
    /// valid signature, or signed outside the timestamp tolerance. HTTP 401.
    SignatureInvalid,
}

impl ErrorKind {
    /// The kind's HTTP status. The default renderer answers with
    /// [`IdempotencyError::status`], which differs only for `InProgress` under a
    /// [`Webhook`](crate::Webhook); a renderer of your own should use that one too.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::KeyMissing | ErrorKind::KeyInvalid | ErrorKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ErrorKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::InProgress => StatusCode::CONFLICT,
            ErrorKind::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::ResponseNotRetained => StatusCode::GONE,
            ErrorKind::ScopeMissing => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::SignatureInvalid => StatusCode::UNAUTHORIZED,
        }
    }

    /// The stable slug in the problem `type` URI and in logs.
    pub fn slug(self) -> &'static str {
        match self {
            ErrorKind::KeyMissing => "key-missing",
            ErrorKind::KeyInvalid => "key-invalid",
            ErrorKind::BodyTooLarge => "body-too-large",
            ErrorKind::BodyUnreadable => "body-unreadable",
            ErrorKind::BodyTimeout => "body-timeout",
            ErrorKind::InProgress => "in-progress",
            ErrorKind::Mismatch => "key-reused",
            ErrorKind::StoreUnavailable => "store-unavailable",
            ErrorKind::ResponseNotRetained => "response-not-retained",
            ErrorKind::ScopeMissing => "scope-missing",
            ErrorKind::QuotaExceeded => "quota-exceeded",
            ErrorKind::SignatureInvalid => "signature-invalid",
        }
    }

    /// The problem `type`: a stable URI per kind.
    pub fn type_uri(self) -> String {
        format!(
            "https://docs.rs/tower-idempotency/latest/tower_idempotency/problems/#{}",
            self.slug()
        )
    }

    pub(crate) fn title(self) -> &'static str {
        match self {
            ErrorKind::KeyMissing => "Idempotency key missing",
            ErrorKind::KeyInvalid => "Idempotency key invalid",
            ErrorKind::BodyTooLarge => "Request body too large",
            ErrorKind::BodyUnreadable => "Request body unreadable",
            ErrorKind::BodyTimeout => "Request body timed out",
            ErrorKind::InProgress => "Request in progress",
            ErrorKind::Mismatch => "Idempotency key reused",
            ErrorKind::StoreUnavailable => "Idempotency store unavailable",
            ErrorKind::ResponseNotRetained => "Original response not retained",
            ErrorKind::ScopeMissing => "Idempotency scope missing",
            ErrorKind::QuotaExceeded => "Idempotency quota exceeded",
            ErrorKind::SignatureInvalid => "Webhook signature invalid",
        }
    }
}

/// An error the layer answered with instead of calling the inner service.
///
/// The layer renders it (problem+json, or a gRPC status) and also puts it into the response
/// extensions, so an outer layer can render its own form.
#[derive(Debug, Clone)]
pub struct IdempotencyError {
    kind: ErrorKind,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
    original_status: Option<StatusCode>,
    status: Option<StatusCode>,
    source: Option<Arc<StoreError>>,
}

impl IdempotencyError {
    pub(crate) fn new(kind: ErrorKind, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            retry_after: None,
            original_status: None,
            status: None,
            source: None,
        }
    }

    /// Answers with `status` instead of the kind's (a webhook's in-progress answer).
    pub(crate) fn with_status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn original_status(mut self, status: StatusCode) -> Self {
        self.original_status = Some(status);
        self
    }

    pub(crate) fn source(mut self, source: StoreError) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The HTTP status the default renderer answers with: the kind's
    /// ([`ErrorKind::status`]), except for an in-progress answer under a
    /// [`Webhook`](crate::Webhook), which answers what the webhook chose (503 by default).
    pub fn status(&self) -> StatusCode {
        self.status.unwrap_or_else(|| self.kind.status())
    }

    /// A human-readable explanation for this occurrence.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// When the client may retry (409 and 503).
    pub fn retry_after_duration(&self) -> Option<Duration> {
        self.retry_after
    }

    /// For [`ErrorKind::ResponseNotRetained`]: the status the original request answered with.
    pub fn original_response_status(&self) -> Option<StatusCode> {
        self.original_status
    }

    /// `Retry-After` in whole seconds: rounded up, at least 1.
    pub(crate) fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|d| {
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            secs.max(1)
        })
    }
}

impl fmt::Display for IdempotencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.title(), self.detail)
    }
}

impl std::error::Error for IdempotencyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

pub use crate::store::ConfigError;

/// Displays an error with its whole source chain: "a: b: c".
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_and_is_at_least_one() {
        let e = |ms| {
            IdempotencyError::new(ErrorKind::InProgress, "x").retry_after(Duration::from_millis(ms))
        };
        assert_eq!(e(0).retry_after_secs(), Some(1));
        assert_eq!(e(1).retry_after_secs(), Some(1));
        assert_eq!(e(1000).retry_after_secs(), Some(1));
        assert_eq!(e(1001).retry_after_secs(), Some(2));
        assert_eq!(e(29_500).retry_after_secs(), Some(30));
    }

    #[test]
    fn config_errors_debug_print_their_text_so_main_shows_the_fix() {
        let err = crate::Timing::new(Duration::from_secs(30), Duration::from_secs(1)).unwrap_err();
        let debug = format!("{err:?}");
        assert_eq!(
            debug,
            "invalid idempotency configuration: ttl 1s is shorter than the lease 30s"
        );
        assert_eq!(debug, err.to_string());
        let boxed: Box<dyn std::error::Error> = Box::new(err);
        assert_eq!(format!("{boxed:?}"), debug);
    }
}
