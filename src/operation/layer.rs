//! [`OperationLayer`]: any `tower::Service<R>` made idempotent.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use super::{Codec, Identity, InvalidInput, Json, OnceError, Operations};

/// Reads an [`Identity`] (scope, key, input fingerprint) from a request: implemented by any
/// `Fn(&R) -> Result<Identity, InvalidInput>`.
pub trait Identify<R>: Send + Sync + 'static {
    /// The request's identity, or why it has none ([`InvalidInput::KeyMissing`], say).
    fn identify(&self, request: &R) -> Result<Identity, InvalidInput>;
}

impl<R, F> Identify<R> for F
where
    F: Fn(&R) -> Result<Identity, InvalidInput> + Send + Sync + 'static,
{
    fn identify(&self, request: &R) -> Result<Identity, InvalidInput> {
        self(request)
    }
}

/// Makes a `tower::Service<R>`, for any request type `R`, run at most once per identity:
/// the service's `Response` is recorded through a [`Codec`] ([`Json`] by default) and
/// replayed to every retry, and its errors are [`OnceError`]s.
///
/// The service reaches the operation's context (recovery points,
/// [`derive`](crate::IdempotencyContext::derive)) through
/// [`IdempotencyContext::current`](crate::IdempotencyContext::current), in its `call` and in
/// its future.
///
/// ```
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_idempotency::operation::{Identity, OperationLayer, Operations};
/// use tower_idempotency::{store::MemoryStore, IdempotencyContext};
///
/// #[derive(serde::Serialize)]
/// struct Message { id: String, amount: u64 }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = OperationLayer::new(Operations::new(MemoryStore::new()), |m: &Message| {
///     Ok(Identity::json(&m.id, m)?.in_scope("payments"))
/// });
/// let service = layer.layer(service_fn(|m: Message| async move {
///     let ctx = IdempotencyContext::current().expect("set for the work");
///     Ok::<_, std::convert::Infallible>(format!("applied {} at generation {}", m.id, ctx.generation()))
/// }));
/// let message = || Message { id: "m-1".into(), amount: 5 };
/// let first = service.clone().oneshot(message()).await.unwrap();
/// assert_eq!(service.oneshot(message()).await.unwrap(), first);
/// # }
/// ```
pub struct OperationLayer<I, C = Json> {
    operations: Operations,
    identify: std::sync::Arc<I>,
    codec: std::sync::Arc<C>,
}

impl<I, C> Clone for OperationLayer<I, C> {
    fn clone(&self) -> Self {
        Self {
            operations: self.operations.clone(),
            identify: self.identify.clone(),
            codec: self.codec.clone(),
        }
    }
}

impl<I, C> fmt::Debug for OperationLayer<I, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationLayer")
            .field("operations", &self.operations)
            .finish_non_exhaustive()
    }
}

impl<I> OperationLayer<I, Json> {
    /// A layer running each request once per the identity `identify` reads from it, on
    /// `operations`' store and configuration, recording answers as JSON.
    pub fn new(operations: Operations, identify: I) -> Self {
        Self {
            operations,
            identify: std::sync::Arc::new(identify),
            codec: std::sync::Arc::new(Json),
        }
    }
}

impl<I, C> OperationLayer<I, C> {
    /// Records answers through `codec` instead ([`Raw`](super::Raw) for bytes).
    pub fn with_codec<C2>(self, codec: C2) -> OperationLayer<I, C2> {
        OperationLayer {
            operations: self.operations,
            identify: self.identify,
            codec: std::sync::Arc::new(codec),
        }
    }
}

impl<S, I, C> Layer<S> for OperationLayer<I, C> {
    type Service = OperationService<S, I, C>;

    fn layer(&self, inner: S) -> Self::Service {
        OperationService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service an [`OperationLayer`] makes.
pub struct OperationService<S, I, C = Json> {
    inner: S,
    layer: OperationLayer<I, C>,
}

impl<S: Clone, I, C> Clone for OperationService<S, I, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, I, C> fmt::Debug for OperationService<S, I, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, R, I, C> Service<R> for OperationService<S, I, C>
where
    S: Service<R> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    R: Send + 'static,
    I: Identify<R>,
    C: Codec<S::Response>,
{
    type Response = S::Response;
    type Error = OnceError<S::Error>;
    type Future = BoxFuture<S::Response, OnceError<S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(OnceError::Failed)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let identity = match self.layer.identify.identify(&request) {
            Ok(identity) => identity,
            Err(invalid) => return Box::pin(std::future::ready(Err(OnceError::Invalid(invalid)))),
        };
        // The service that was polled ready runs the request; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (operations, codec) = (self.layer.operations.clone(), self.layer.codec.clone());
        Box::pin(async move {
            operations
                .run(identity, &*codec, move |_ctx| inner.call(request))
                .await
        })
    }
}
