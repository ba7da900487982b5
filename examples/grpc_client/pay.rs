//! Run with: `cargo run --example grpc_client --features client` (see `main.rs`).
//!
//! The gRPC shop's client, shared by `main.rs` and `tests/client/client_grpc.rs`: a tonic
//! channel behind `IdempotentRetryLayer`, and payment intents sent through it.

use std::fmt;

use tonic::transport::Channel;
use tonic::Request;
use tower::util::MapRequest;
use tower::ServiceBuilder;
use tower_idempotency::client::{
    BufferedRequest, IdempotentRetry, IdempotentRetryLayer, RetryOutcome,
};

use super::pb::payments_client::PaymentsClient;
use super::pb::CreatePaymentRequest;

/// The retry layer buffers each request once and hands every attempt a [`BufferedRequest`];
/// the channel takes tonic's own body.
type IntoTonic = fn(BufferedRequest) -> http::Request<tonic::body::Body>;

/// The shop's client: each call goes through the retry layer, then the channel.
pub(crate) type ShopClient = PaymentsClient<IdempotentRetry<MapRequest<Channel, IntoTonic>>>;

/// `channel` behind `layer`.
pub(crate) fn client(channel: Channel, layer: IdempotentRetryLayer) -> ShopClient {
    let into_tonic: IntoTonic = |req| req.map(tonic::body::Body::new);
    let svc = ServiceBuilder::new()
        .layer(layer)
        .map_request(into_tonic)
        .service(channel);
    PaymentsClient::new(svc)
}

/// One key per intent: `order-<run>-<n>`. The same run gives the same keys.
pub(crate) fn keys(run: &str, count: usize) -> Vec<String> {
    (1..=count).map(|n| format!("order-{run}-{n}")).collect()
}

/// What became of one intent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Paid {
    pub(crate) key: String,
    /// The payment id, or the final status code when the call failed.
    pub(crate) payment: Result<String, tonic::Code>,
    /// Attempts and whether the answer was a replay, as the layer reports them
    /// ([`RetryOutcome`]); on a failure tonic's `Status` does not carry them.
    pub(crate) attempts: Option<u32>,
    pub(crate) replayed: bool,
}

impl fmt::Display for Paid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.payment {
            Ok(id) => write!(f, "{}: {id}", self.key)?,
            Err(code) => write!(f, "{}: failed, {code:?}", self.key)?,
        }
        if let Some(n) = self.attempts {
            write!(f, " after {n} attempt(s)")?;
        }
        if self.replayed {
            write!(f, " (replayed)")?;
        }
        Ok(())
    }
}

/// Sends one `CreatePayment` of `amount` EUR cents per key, one after another. The layer
/// retries each until it gets an answer it should not retry, with that key every time.
pub(crate) async fn pay(client: &mut ShopClient, keys: &[String], amount: i64) -> Vec<Paid> {
    let mut paid = Vec::with_capacity(keys.len());
    for key in keys {
        let mut req = Request::new(CreatePaymentRequest {
            amount,
            currency: "EUR".to_owned(),
        });
        let value = key.parse().expect("keys are ASCII");
        req.metadata_mut().insert("idempotency-key", value);
        paid.push(match client.create_payment(req).await {
            Ok(res) => {
                let outcome = res.extensions().get::<RetryOutcome>().cloned();
                Paid {
                    key: key.clone(),
                    payment: Ok(res.into_inner().id),
                    attempts: outcome.as_ref().map(RetryOutcome::attempts),
                    replayed: outcome.is_some_and(|o| o.replayed()),
                }
            }
            Err(status) => Paid {
                key: key.clone(),
                payment: Err(status.code()),
                attempts: None,
                replayed: false,
            },
        });
    }
    paid
}

/// Totals over all intents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Summary {
    pub(crate) intents: usize,
    /// Attempts of the intents that succeeded.
    pub(crate) attempts: u32,
    pub(crate) replays: usize,
    pub(crate) failures: usize,
}

impl Summary {
    pub(crate) fn of(paid: &[Paid]) -> Self {
        Self {
            intents: paid.len(),
            attempts: paid.iter().filter_map(|p| p.attempts).sum(),
            replays: paid.iter().filter(|p| p.replayed).count(),
            failures: paid.iter().filter(|p| p.payment.is_err()).count(),
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "intents={} attempts={} replays={} failures={}",
            self.intents, self.attempts, self.replays, self.failures
        )
    }
}
