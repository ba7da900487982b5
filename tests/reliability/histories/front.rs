//! The operations front: the histories' requests as operations (`OperationLayer` over the
//! same handler), so the protocol checks hold the operation API to what they hold the HTTP
//! layer to.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::operation::{Identity, OnceError, OperationLayer, Raw};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer};

use super::{Svc, World};

/// What a history's requests go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Front {
    /// The HTTP layer.
    Http,
    /// [`OperationLayer`], its answers recorded with the `Raw` codec.
    Operation,
}

impl Front {
    /// The status of an answer the handler (or the worker) produced: the HTTP layer records
    /// 201 as the handler says; an operation records the value alone, which replays as 200.
    pub(super) fn ok(self) -> StatusCode {
        match self {
            Self::Http => StatusCode::CREATED,
            Self::Operation => StatusCode::OK,
        }
    }
}

/// One history request as a message: its key, its body (the operation's input) and its
/// number.
struct Message {
    key: String,
    body: Bytes,
    number: u64,
}

/// A failed handler's answer: the operation's error, which releases the key.
#[derive(Debug)]
struct Failed(StatusCode, Bytes);

/// The operations front: the request becomes a [`Message`], runs through an
/// [`OperationLayer`] on `layer`'s store and configuration, and its outcome is answered as
/// the HTTP layer would (a replay marked as one, 409, 422, 503), for the same checks.
pub(super) fn operations(layer: &IdempotencyLayer, world: Arc<World>) -> Svc {
    let identify = |m: &Message| Identity::bytes(&m.key, &m.body);
    let op = OperationLayer::new(layer.operations(), identify).with_codec(Raw);
    let inner = {
        let world = world.clone();
        service_fn(move |m: Message| {
            let world = world.clone();
            async move {
                let ctx = IdempotencyContext::current().expect("an operation's work");
                match world.work(ctx, m.number).await {
                    (status, body) if status.is_success() => Ok::<Bytes, Failed>(body),
                    (status, body) => Err(Failed(status, body)),
                }
            }
        })
    };
    let svc = op.layer(inner);
    let outer = service_fn(move |req: Request<Full<Bytes>>| {
        let (svc, world) = (svc.clone(), world.clone());
        async move {
            let key = req.headers()["idempotency-key"]
                .to_str()
                .unwrap()
                .to_owned();
            let number: u64 = req.headers()["x-req"].to_str().unwrap().parse().unwrap();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let outcome = svc.oneshot(Message { key, body, number }).await;
            // An operation says nothing of how its value came: a value for a request whose
            // handler never ran is a replay.
            let ran = world.exec_of(number).is_some();
            let (status, body, replayed) = match outcome {
                Ok(body) => (StatusCode::OK, body, !ran),
                Err(OnceError::Failed(Failed(status, body))) => (status, body, false),
                Err(OnceError::InProgress { .. }) => (StatusCode::CONFLICT, Bytes::new(), false),
                Err(OnceError::Mismatch) => (StatusCode::UNPROCESSABLE_ENTITY, Bytes::new(), false),
                Err(OnceError::StoreUnavailable { .. }) => {
                    (StatusCode::SERVICE_UNAVAILABLE, Bytes::new(), false)
                }
                Err(other) => (
                    StatusCode::IM_A_TEAPOT,
                    Bytes::from(format!("{other:?}")),
                    false,
                ),
            };
            let mut res = Response::new(Full::new(body).boxed_unsync());
            *res.status_mut() = status;
            if replayed {
                res.headers_mut().insert(
                    "idempotent-replayed",
                    http::HeaderValue::from_static("true"),
                );
            }
            Ok::<_, Infallible>(res)
        }
    });
    tower::util::BoxCloneService::new(outer)
}
