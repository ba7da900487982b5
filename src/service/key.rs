//! Step 2 beside the flow: the `400` for a request without a usable key, and the key's echo
//! on the answers ([`with_key_echo`](crate::IdempotencyLayer::with_key_echo)).

use std::sync::{Arc, OnceLock};

use http::{HeaderMap, HeaderValue};

use super::Flow;
use crate::error::{ErrorKind, IdempotencyError};
use crate::key::Refusal;
use crate::metrics::{Labels, Outcome};

/// The key to echo, once the flow knows it: shared between the flow and its response future,
/// which puts it on the answer.
pub(super) type Echo = Option<Arc<OnceLock<HeaderValue>>>;

/// The 400 for a request without a usable key; the detail names where it was expected.
pub(super) fn key_refused(labels: &Labels, refusal: Refusal) -> IdempotencyError {
    match refusal {
        Refusal::Missing(detail) => {
            labels.outcome(Outcome::KeyMissing);
            IdempotencyError::new(ErrorKind::KeyMissing, detail)
        }
        Refusal::Invalid(detail) => {
            labels.outcome(Outcome::KeyInvalid);
            IdempotencyError::new(ErrorKind::KeyInvalid, detail)
        }
    }
}

impl Flow {
    /// Notes the request's key, read from `headers` or the body, for the echo.
    pub(super) fn known(&self, headers: &HeaderMap, key: &str) {
        if let Some(echo) = &self.echo {
            if let Some(value) = self.cfg.key.echo(headers, key) {
                let _ = echo.set(value);
            }
        }
    }
}
