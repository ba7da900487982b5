//! Run with: `cargo run --example grpc` (see `main.rs`).
//!
//! The gRPC shop's server, shared by `main.rs` and `tests/layer/grpc.rs`.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt as _;
use tokio::sync::Semaphore;
use tonic::service::{InterceptorLayer, LayerExt as _};
use tonic::transport::server::Router;
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use tower::layer::util::{Identity, Stack};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{Grpc, IdempotencyLayer, Timing};

/// The code generated from `examples/proto/shop.proto`, committed (see `tests/layer/grpc.rs`).
#[allow(unreachable_pub, missing_docs, clippy::all)]
pub(crate) mod pb {
    include!("generated/shop.v1.rs");
}

use pb::payments_server::{Payments, PaymentsServer};
use pb::{ChargeCount, CountChargesRequest, CreatePaymentRequest, CreatePaymentsRequest, Payment};

/// The method every caller may use without a key: a read.
pub(crate) const COUNT_CHARGES: &str = "/shop.v1.Payments/CountCharges";

/// The shop's settings.
#[derive(Debug, Clone)]
pub(crate) struct ShopConfig {
    /// How long the fake card network takes per charge.
    pub(crate) card_latency: Duration,
    /// Lease, retention TTL and store deadline of idempotency records.
    pub(crate) timing: Timing,
    /// When set, every charge waits at this gate (tests decide when the network answers).
    pub(crate) card_gate: Option<Arc<CardGate>>,
}

/// Holds charges at the card network until a test lets them through.
#[derive(Debug)]
pub(crate) struct CardGate {
    arrived: Semaphore,
    permits: Semaphore,
}

impl CardGate {
    /// A closed gate.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            arrived: Semaphore::new(0),
            permits: Semaphore::new(0),
        })
    }

    /// Waits until a charge has reached the gate.
    pub(crate) async fn arrived(&self) {
        self.arrived.acquire().await.expect("gate open").forget();
    }

    /// Lets `n` charges through.
    pub(crate) fn open(&self, n: usize) {
        self.permits.add_permits(n);
    }

    async fn pass(&self) {
        self.arrived.add_permits(1);
        self.permits.acquire().await.expect("gate open").forget();
    }
}

/// The fake card network and the id counters.
#[derive(Debug)]
pub(crate) struct Shop {
    card_calls: AtomicU64,
    charges: AtomicU64,
    payments: AtomicU64,
    card_latency: Duration,
    card_gate: Option<Arc<CardGate>>,
}

impl Shop {
    /// A shop with nothing charged yet.
    pub(crate) fn new(config: &ShopConfig) -> Arc<Self> {
        Arc::new(Self {
            card_calls: AtomicU64::new(0),
            charges: AtomicU64::new(0),
            payments: AtomicU64::new(0),
            card_latency: config.card_latency,
            card_gate: config.card_gate.clone(),
        })
    }

    /// Charges made since start.
    pub(crate) fn charges(&self) -> u64 {
        self.charges.load(Ordering::SeqCst)
    }

    /// Calls to the card network since start, declined and failed ones included.
    pub(crate) fn card_calls(&self) -> u64 {
        self.card_calls.load(Ordering::SeqCst)
    }

    fn validate(p: &CreatePaymentRequest) -> Result<(), Status> {
        if p.amount <= 0 {
            return Err(Status::invalid_argument(
                "amount must be a positive integer in minor units",
            ));
        }
        if p.currency.len() != 3 || !p.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(Status::invalid_argument("currency must be 3 letters"));
        }
        Ok(())
    }

    /// The card network: 402 declines, 503 is down, anything else is charged.
    async fn charge(&self, p: &CreatePaymentRequest) -> Result<Charge, Status> {
        self.card_calls.fetch_add(1, Ordering::SeqCst);
        if let Some(gate) = &self.card_gate {
            gate.pass().await;
        }
        tokio::time::sleep(self.card_latency).await;
        match p.amount {
            402 => Ok(Charge::Declined),
            503 => Err(Status::unavailable("card_network_unavailable")),
            amount => {
                let charge = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
                let n = self.payments.fetch_add(1, Ordering::SeqCst) + 1;
                let payment = Payment {
                    id: format!("pay_{n}"),
                    amount,
                    currency: p.currency.clone(),
                    status: "succeeded".to_owned(),
                };
                Ok(Charge::Succeeded(payment, ChargeId(format!("ch_{charge}"))))
            }
        }
    }
}

enum Charge {
    Succeeded(Payment, ChargeId),
    Declined,
}

/// The card network's id of a charge; [`add_charge_trailer`] sends it as trailing metadata.
#[derive(Debug, Clone)]
struct ChargeId(String);

type PaymentStream = Pin<Box<dyn Stream<Item = Result<Payment, Status>> + Send>>;

/// The `Payments` service over the shared shop.
#[derive(Debug, Clone)]
pub(crate) struct PaymentsService(Arc<Shop>);

#[tonic::async_trait]
impl Payments for PaymentsService {
    async fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let p = request.into_inner();
        Shop::validate(&p)?;
        match self.0.charge(&p).await? {
            Charge::Succeeded(payment, charge_id) => {
                let id = payment.id.parse().expect("ids are ASCII");
                let mut res = Response::new(payment);
                // Initial metadata (a header) and trailing metadata (`x-charge-id`): both
                // are recorded and replayed.
                res.metadata_mut().insert("x-payment-id", id);
                res.extensions_mut().insert(charge_id);
                Ok(res)
            }
            // Recorded: a retry gets the same decline without calling the network again.
            Charge::Declined => Err(Status::failed_precondition("card_declined")),
        }
    }

    async fn count_charges(
        &self,
        _request: Request<CountChargesRequest>,
    ) -> Result<Response<ChargeCount>, Status> {
        let count = i64::try_from(self.0.charges()).unwrap_or(i64::MAX);
        Ok(Response::new(ChargeCount { count }))
    }

    type CreatePaymentsStream = PaymentStream;

    async fn create_payments(
        &self,
        request: Request<CreatePaymentsRequest>,
    ) -> Result<Response<PaymentStream>, Status> {
        let batch = request.into_inner().payments;
        if batch.is_empty() {
            return Err(Status::invalid_argument("the batch is empty"));
        }
        batch.iter().try_for_each(Shop::validate)?;
        // One message per charge, charged as the stream is read.
        let shop = self.0.clone();
        let stream = futures_util::stream::iter(batch).then(move |p| {
            let shop = shop.clone();
            async move {
                Ok(match shop.charge(&p).await? {
                    Charge::Succeeded(payment, _) => payment,
                    Charge::Declined => Payment {
                        id: String::new(),
                        amount: p.amount,
                        currency: p.currency,
                        status: "declined".to_owned(),
                    },
                })
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn import_payments(
        &self,
        request: Request<tonic::Streaming<CreatePaymentRequest>>,
    ) -> Result<Response<ChargeCount>, Status> {
        // Under the layer the whole request stream was buffered before this runs.
        let mut stream = request.into_inner();
        let mut batch = Vec::new();
        while let Some(p) = stream.message().await? {
            Shop::validate(&p)?;
            batch.push(p);
        }
        let mut count = 0;
        for p in &batch {
            if let Charge::Succeeded(..) = self.0.charge(p).await? {
                count += 1;
            }
        }
        Ok(Response::new(ChargeCount { count }))
    }
}

/// Appends the charge id of a successful payment to its trailers, as `x-charge-id` metadata.
///
/// tonic has no API for custom trailing metadata on a unary response, so this maps the
/// response body; it sits inside the idempotency layer, so the trailer is recorded and
/// replayed like the rest of the answer.
fn add_charge_trailer(res: http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> {
    let Some(ChargeId(id)) = res.extensions().get::<ChargeId>().cloned() else {
        return res;
    };
    let Ok(value) = http::HeaderValue::from_str(&id) else {
        return res;
    };
    res.map(|body| {
        let body = body.map_frame(move |frame| match frame.into_trailers() {
            Ok(mut trailers) => {
                trailers.insert("x-charge-id", value.clone());
                http_body::Frame::trailers(trailers)
            }
            Err(frame) => frame,
        });
        tonic::body::Body::new(body)
    })
}

type ChargeTrailer = fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body>;

/// The `Payments` service, with the `x-charge-id` trailer. `named_layer` keeps its gRPC name.
pub(crate) type PaymentsSvc = tonic::service::Layered<
    tower::util::MapResponse<PaymentsServer<PaymentsService>, ChargeTrailer>,
    PaymentsServer<PaymentsService>,
>;

/// The shop's `Payments` service, without the idempotency layer.
pub(crate) fn payments(shop: Arc<Shop>) -> PaymentsSvc {
    tower::util::MapResponseLayer::new(add_charge_trailer as ChargeTrailer)
        .named_layer(PaymentsServer::new(PaymentsService(shop)))
}

/// The example's gRPC methods: every one needs a key, but the read.
pub(crate) fn grpc() -> Grpc {
    Grpc::all()
        .passthrough(COUNT_CHARGES)
        .expect("a gRPC method path")
}

/// The example's idempotency layer, over [`grpc`].
pub(crate) fn idempotency(
    store: Arc<dyn IdempotencyStore>,
    config: &ShopConfig,
) -> IdempotencyLayer {
    IdempotencyLayer::from_arc(store)
        .with_timing(config.timing)
        .with_grpc(grpc())
        // One key space per caller, as authenticated outside this layer.
        .with_scope(|req| req.extensions.get::<Principal>().map(|p| p.0.clone()))
}

/// Who is calling: set by [`authenticate`], read by the idempotency scope.
#[derive(Debug, Clone)]
pub(crate) struct Principal(pub(crate) String);

/// A demo auth interceptor: `x-api-key` metadata names the caller (as in the HTTP shop).
/// No key is the anonymous caller; a malformed or repeated one is `UNAUTHENTICATED`. It must
/// run outside the idempotency layer (`InterceptorLayer`, not `with_interceptor`, which runs
/// inside it), so that the scope function sees the principal.
pub(crate) fn authenticate(mut req: Request<()>) -> Result<Request<()>, Status> {
    let mut keys = req.metadata().get_all("x-api-key").iter();
    let principal = match (keys.next(), keys.next()) {
        (None, _) => Principal("anonymous".to_owned()),
        (Some(v), None) => match v.to_str().ok().filter(|k| is_api_key(k)) {
            Some(k) => Principal(format!("api-key:{k}")),
            None => {
                return Err(Status::unauthenticated(
                    "the x-api-key metadata is malformed",
                ))
            }
        },
        (Some(_), Some(_)) => {
            return Err(Status::unauthenticated("send x-api-key once"));
        }
    };
    req.extensions_mut().insert(principal);
    Ok(req)
}

/// 1 to 128 visible ASCII characters (no spaces, no control or non-ASCII bytes).
fn is_api_key(k: &str) -> bool {
    (1..=128).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic())
}

pub(crate) type AuthFn = fn(Request<()>) -> Result<Request<()>, Status>;

/// The server's layers, outermost first: auth, then idempotency.
pub(crate) type ServerLayers = Stack<IdempotencyLayer, Stack<InterceptorLayer<AuthFn>, Identity>>;

/// The server-wide form: `Server::builder().layer(..)` wraps every service it serves.
pub(crate) fn server_wide(layer: IdempotencyLayer, shop: Arc<Shop>) -> Router<ServerLayers> {
    Server::builder()
        .layer(InterceptorLayer::new(authenticate as AuthFn))
        .layer(layer)
        .add_service(payments(shop))
}

/// The per-service form: `named_layer` wraps one service and keeps its `NamedService` name,
/// so other services on the same server stay outside the layer.
pub(crate) fn per_service(layer: IdempotencyLayer, shop: Arc<Shop>) -> Router<Identity> {
    let stack = tower::ServiceBuilder::new()
        .layer(InterceptorLayer::new(authenticate as AuthFn))
        .layer(layer);
    Server::builder().add_service(stack.named_layer(payments(shop)))
}

/// The shop's API behind the idempotency layer. Returns the router and the shop state.
pub(crate) fn app(
    store: Arc<dyn IdempotencyStore>,
    config: ShopConfig,
) -> (Router<ServerLayers>, Arc<Shop>) {
    let shop = Shop::new(&config);
    (server_wide(idempotency(store, &config), shop.clone()), shop)
}
