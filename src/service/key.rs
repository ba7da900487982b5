//! Step 2 beside the flow: the `400` for a request without a usable key, and the key's echo
//! on the answers ([`with_key_echo`](crate::IdempotencyLayer::with_key_echo)).

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{Answer, BoxError, Flow};
use crate::body::RequestBody;
use crate::error::{ErrorKind, IdempotencyError};
use crate::key::Refusal;
use crate::metrics::{Labels, Outcome};
use crate::response;

/// The key to echo, once the flow knows it: shared between [`Flow::echoing`] and the flow.
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
    /// [`Flow::run`], with the key echoed on its answer once the key is known: a key from a
    /// header from the start, one from the body once read from the buffer.
    pub(super) async fn echoing<S, ReqB, ResB>(
        self,
        inner: S,
        req: Request<ReqB>,
        key: Option<Arc<str>>,
    ) -> Answer<ResB, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ReqB::Error: Into<BoxError>,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Send + 'static,
    {
        let Some(echo) = self.echo.clone() else {
            return self.run(inner, req, key).await;
        };
        if let Some(key) = &key {
            self.known(req.headers(), key);
        }
        let mut answer = self.run(inner, req, key).await;
        if let (Ok(res), Some(key)) = (&mut answer, echo.get()) {
            response::echo_key(res, key);
        }
        answer
    }

    /// Notes the request's key, read from `headers` or the body, for the echo.
    pub(super) fn known(&self, headers: &HeaderMap, key: &str) {
        if let Some(echo) = &self.echo {
            if let Some(value) = self.cfg.key.echo(headers, key) {
                let _ = echo.set(value);
            }
        }
    }
}
