//! The layer under tonic 0.14, through a real tonic client, against the example's server
//! (`examples/grpc/app.rs`).

#[path = "../../examples/grpc/app.rs"]
#[allow(dead_code)]
mod app;
use crate::support;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt as _;
use prost::Message as _;
use support::DownStore;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Barrier, Notify};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::Routes;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Status};
use tower::ServiceExt as _;
use tower_idempotency::store::{IdempotencyStore, MemoryStore};
use tower_idempotency::{IdempotencyLayer, InProgress, Timing};

use app::pb::payments_client::PaymentsClient;
use app::pb::{CountChargesRequest, CreatePaymentRequest, CreatePaymentsRequest, Payment};
use app::{CardGate, Shop, ShopConfig};

const CREATE_PAYMENT: &str = "/shop.v1.Payments/CreatePayment";

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

fn config(card_gate: Option<Arc<CardGate>>) -> ShopConfig {
    ShopConfig {
        card_latency: Duration::ZERO,
        timing: Timing::default(),
        card_gate,
    }
}

/// A running server and a client connected to it.
struct Harness {
    addr: std::net::SocketAddr,
    channel: Channel,
    client: PaymentsClient<Channel>,
    shop: Arc<Shop>,
}

impl Harness {
    async fn charges(&self) -> i64 {
        let mut client = self.client.clone();
        client
            .count_charges(CountChargesRequest {})
            .await
            .expect("CountCharges passes through without a key")
            .into_inner()
            .count
    }
}

/// Serves `router` on 127.0.0.1:0 and connects a client.
macro_rules! serve {
    ($router:expr, $shop:expr) => {{
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = $router;
        tokio::spawn(async move {
            router
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
                .unwrap()
        });
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Harness {
            addr,
            client: PaymentsClient::new(channel.clone()),
            channel,
            shop: $shop,
        }
    }};
}

/// The example's server-wide form, its layer adjusted by `tune`.
async fn start(
    config: ShopConfig,
    tune: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Harness {
    start_with_store(Arc::new(MemoryStore::new()), config, tune).await
}

async fn start_with_store(
    store: Arc<dyn IdempotencyStore>,
    config: ShopConfig,
    tune: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Harness {
    let shop = Shop::new(&config);
    let layer = tune(app::idempotency(store, &config));
    serve!(app::server_wide(layer, shop.clone()), shop)
}

fn payment(key: Option<&str>, amount: i64) -> Request<CreatePaymentRequest> {
    let mut req = Request::new(CreatePaymentRequest {
        amount,
        currency: "EUR".to_owned(),
    });
    if let Some(key) = key {
        req.metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    req
}

fn batch(key: &str, amounts: &[i64]) -> Request<CreatePaymentsRequest> {
    let payments = amounts
        .iter()
        .map(|&amount| CreatePaymentRequest {
            amount,
            currency: "EUR".to_owned(),
        })
        .collect();
    let mut req = Request::new(CreatePaymentsRequest { payments });
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    req
}

fn replayed<T>(res: &tonic::Response<T>) -> bool {
    res.metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// One raw gRPC exchange, read whole: the bytes the client saw.
#[derive(Debug)]
struct Raw {
    status: http::StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
    trailers: Option<http::HeaderMap>,
}

async fn raw_call(h: &Harness, path: &str, key: &str, message: &impl prost::Message) -> Raw {
    raw_call_with(h, path, &[("idempotency-key", key)], message).await
}

/// [`raw_call`] with any request metadata (`idempotency-key` included, if wanted).
async fn raw_call_with(
    h: &Harness,
    path: &str,
    metadata: &[(&str, &str)],
    message: &impl prost::Message,
) -> Raw {
    let mut body = BytesMut::new();
    body.put_u8(0);
    body.put_u32(message.encoded_len() as u32);
    message.encode(&mut body).unwrap();
    let mut req = http::Request::post(format!("http://{}{path}", h.addr))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in metadata {
        req = req.header(*name, *value);
    }
    let req = req
        .body(tonic::body::Body::new(http_body_util::Full::new(
            body.freeze(),
        )))
        .unwrap();
    let res = h.channel.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Raw {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

// google.rpc.Status and RetryInfo, to decode what the layer encodes by hand.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<ProtoAny>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoAny {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<ProtoDuration>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// The `google.rpc.RetryInfo` delay in a status's `grpc-status-details-bin`, decoded by prost.
fn retry_delay(status: &Status) -> Duration {
    let rpc = RpcStatus::decode(status.details()).expect("google.rpc.Status");
    assert_eq!(rpc.code, status.code() as i32);
    assert_eq!(rpc.message, status.message());
    assert_eq!(rpc.details.len(), 1);
    assert_eq!(
        rpc.details[0].type_url,
        "type.googleapis.com/google.rpc.RetryInfo"
    );
    let info = RetryInfo::decode(&rpc.details[0].value[..]).expect("RetryInfo");
    let d = info.retry_delay.expect("retry_delay");
    Duration::new(d.seconds as u64, d.nanos as u32)
}

// ---------------------------------------------------------------------------------------
// Concurrency, replay, mismatch, keys
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn twenty_concurrent_calls_with_one_key_charge_once_and_abort_the_rest() {
    let gate = CardGate::new();
    let h = start(config(Some(gate.clone())), |l| l).await;
    let barrier = Arc::new(Barrier::new(20));
    let (tx, mut rx) = mpsc::unbounded_channel();
    for _ in 0..20 {
        let (mut client, barrier, tx) = (h.client.clone(), barrier.clone(), tx.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let res = client.create_payment(payment(Some("k-20"), 1000)).await;
            tx.send(res).unwrap();
        });
    }
    // One call holds the key at the card network, so the other 19 answer first.
    gate.arrived().await;
    for _ in 0..19 {
        let status = rx.recv().await.unwrap().expect_err("only one call runs");
        assert_eq!(status.code(), Code::Aborted, "{status:?}");
        assert!(status.message().contains("retry after"), "{status:?}");
        // The hint fits the work, not the 30 s lease: 1 s by default.
        let delay = retry_delay(&status);
        assert!(
            delay > Duration::ZERO && delay <= Duration::from_secs(1),
            "{delay:?}"
        );
    }
    gate.open(1);
    let ok = rx.recv().await.unwrap().expect("the first call succeeds");
    assert_eq!(ok.get_ref().id, "pay_1");
    assert_eq!(h.charges().await, 1);
    assert_eq!(h.shop.card_calls(), 1);
}

#[tokio::test]
async fn replay_is_byte_identical_with_custom_trailing_metadata() {
    let h = start(config(None), |l| l).await;
    let msg = CreatePaymentRequest {
        amount: 1000,
        currency: "EUR".to_owned(),
    };
    let first = raw_call(&h, CREATE_PAYMENT, "k-raw", &msg).await;
    let again = raw_call(&h, CREATE_PAYMENT, "k-raw", &msg).await;
    assert_eq!(first.status, http::StatusCode::OK);
    let trailers = first
        .trailers
        .as_ref()
        .expect("a unary answer ends in trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["x-charge-id"], "ch_1");
    assert!(!first.body.is_empty());
    assert_eq!(first.headers["x-payment-id"], "pay_1", "initial metadata");
    assert!(!first.headers.contains_key("idempotent-replayed"));

    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body, "message bytes");
    assert_eq!(
        again.trailers, first.trailers,
        "trailers, custom metadata included"
    );
    let mut headers = again.headers.clone();
    assert_eq!(headers.remove("idempotent-replayed").unwrap(), "true");
    let strip_date = |mut h: http::HeaderMap| {
        h.remove("date");
        h
    };
    assert_eq!(strip_date(headers), strip_date(first.headers.clone()));
    assert_eq!(h.shop.card_calls(), 1);

    // The same through the generated client: unary trailers arrive as metadata.
    let mut client = h.client.clone();
    let one = client
        .create_payment(payment(Some("k-client"), 700))
        .await
        .unwrap();
    let two = client
        .create_payment(payment(Some("k-client"), 700))
        .await
        .unwrap();
    assert!(!replayed(&one) && replayed(&two));
    assert_eq!(two.get_ref(), one.get_ref());
    assert_eq!(one.metadata().get("x-charge-id").unwrap(), "ch_2");
    assert_eq!(
        two.metadata().get("x-charge-id"),
        one.metadata().get("x-charge-id")
    );
    assert_eq!(h.charges().await, 2);
}

#[tokio::test]
async fn a_declined_card_is_recorded_and_replayed_as_a_trailers_only_response() {
    let h = start(config(None), |l| l).await;
    let msg = CreatePaymentRequest {
        amount: 402,
        currency: "EUR".to_owned(),
    };
    let first = raw_call(&h, CREATE_PAYMENT, "k-declined", &msg).await;
    assert_eq!(
        first.headers["grpc-status"], "9",
        "trailers-only: status in the headers"
    );
    assert_eq!(first.headers["grpc-message"], "card_declined");
    assert!(first.body.is_empty() && first.trailers.is_none());
    let again = raw_call(&h, CREATE_PAYMENT, "k-declined", &msg).await;
    assert_eq!(again.headers["grpc-status"], "9");
    assert_eq!(again.headers["grpc-message"], "card_declined");
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert!(again.body.is_empty() && again.trailers.is_none());

    let mut client = h.client.clone();
    let status = client
        .create_payment(payment(Some("k-declined"), 402))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "card_declined");
    assert_eq!(
        status.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(h.shop.card_calls(), 1, "the network was asked once");
}

#[tokio::test]
async fn unavailable_and_invalid_argument_from_the_handler_are_released() {
    let h = start(config(None), |l| l).await;
    let mut client = h.client.clone();
    for _ in 0..2 {
        let status = client
            .create_payment(payment(Some("k-503"), 503))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.metadata().get("idempotent-replayed").is_none());
    }
    assert_eq!(h.shop.card_calls(), 2, "released: the retry ran again");

    let status = client
        .create_payment(payment(Some("k-zero"), 0))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    // Released, so the fixed request may use the same key.
    let ok = client
        .create_payment(payment(Some("k-zero"), 100))
        .await
        .unwrap();
    assert!(!replayed(&ok));
    assert_eq!(h.charges().await, 1);
}

#[tokio::test]
async fn a_changed_amount_under_the_same_key_is_failed_precondition() {
    let h = start(config(None), |l| l).await;
    let mut client = h.client.clone();
    client
        .create_payment(payment(Some("k-change"), 1000))
        .await
        .unwrap();
    let status = client
        .create_payment(payment(Some("k-change"), 2000))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("different request"), "{status:?}");
    assert_eq!(h.charges().await, 1);
}

#[tokio::test]
async fn api_keys_scope_keys_and_a_malformed_one_is_unauthenticated() {
    let h = start(config(None), |l| l).await;
    let mut client = h.client.clone();
    let as_caller = |api_key: Option<&str>| {
        let mut req = payment(Some("k-shared"), 1000);
        if let Some(k) = api_key {
            req.metadata_mut().insert("x-api-key", k.parse().unwrap());
        }
        req
    };
    let alice = client
        .create_payment(as_caller(Some("alice")))
        .await
        .unwrap();
    let bob = client.create_payment(as_caller(Some("bob"))).await.unwrap();
    let anon = client.create_payment(as_caller(None)).await.unwrap();
    assert!(
        !replayed(&bob) && !replayed(&anon),
        "another caller's key space"
    );
    assert_ne!(alice.get_ref().id, bob.get_ref().id);
    let again = client
        .create_payment(as_caller(Some("alice")))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref().id, alice.get_ref().id);
    let too_long = "k".repeat(129);
    for bad in ["has space", too_long.as_str()] {
        let status = client
            .create_payment(as_caller(Some(bad)))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{bad}");
    }
    assert_eq!(h.charges().await, 3);
}

#[tokio::test]
async fn a_missing_or_invalid_key_is_invalid_argument() {
    let h = start(config(None), |l| l).await;
    let mut client = h.client.clone();
    let status = client
        .create_payment(payment(None, 1000))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("`idempotency-key` metadata entry"),
        "{status:?}"
    );

    let long = "k".repeat(256);
    let status = client
        .create_payment(payment(Some(&long), 1000))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("longer than 255"), "{status:?}");

    let mut twice = payment(Some("k-a"), 1000);
    twice
        .metadata_mut()
        .append("idempotency-key", "k-b".parse().unwrap());
    let status = client.create_payment(twice).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(h.shop.card_calls(), 0);
}

#[tokio::test]
async fn a_request_over_the_grpc_limit_is_resource_exhausted() {
    let h = start(config(None), |l| {
        l.with_grpc(app::grpc().max_request_body(NonZeroUsize::new(64).unwrap()))
    })
    .await;
    let mut req = payment(Some("k-big"), 1000);
    req.get_mut().currency = "E".repeat(100);
    let status = h.client.clone().create_payment(req).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(h.shop.card_calls(), 0);
}

/// What the layer says when a caller's scope is over the store's per-scope quota.
const QUOTA_MESSAGE: &str =
    "this caller holds as many idempotency records as it may; the request was not processed";

#[tokio::test]
async fn a_caller_over_its_quota_is_resource_exhausted_and_other_callers_are_served() {
    let store = MemoryStore::builder()
        .with_max_records_per_scope(NonZeroUsize::new(2).unwrap())
        .build();
    let h = start_with_store(Arc::new(store), config(None), |l| l).await;
    let mut client = h.client.clone();
    // The example's scope is the caller named by `x-api-key`.
    let as_caller = |api_key: &str, key: &str| {
        let mut req = payment(Some(key), 1000);
        req.metadata_mut()
            .insert("x-api-key", api_key.parse().unwrap());
        req
    };
    for key in ["k1", "k2"] {
        let ok = client
            .create_payment(as_caller("alice", key))
            .await
            .unwrap();
        assert!(!replayed(&ok), "{key}");
    }

    // A third key: refused by the quota, in gRPC's terms, before the handler runs.
    let status = client
        .create_payment(as_caller("alice", "k3"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), QUOTA_MESSAGE);
    assert!(status.details().is_empty(), "no RetryInfo: {status:?}");
    assert_eq!(h.shop.card_calls(), 2);

    // On the wire: a trailers-only gRPC answer (HTTP 200, status in the headers), not an
    // HTTP 429 with a problem+json body.
    let msg = CreatePaymentRequest {
        amount: 1000,
        currency: "EUR".to_owned(),
    };
    let raw = raw_call_with(
        &h,
        CREATE_PAYMENT,
        &[("idempotency-key", "k4"), ("x-api-key", "alice")],
        &msg,
    )
    .await;
    assert_eq!(raw.status, http::StatusCode::OK, "{raw:?}");
    assert_eq!(raw.headers["content-type"], "application/grpc");
    assert_eq!(raw.headers["grpc-status"], "8", "RESOURCE_EXHAUSTED");
    assert_eq!(raw.headers["grpc-message"], QUOTA_MESSAGE);
    assert!(!raw.headers.contains_key("grpc-status-details-bin"));
    assert!(!raw.headers.contains_key("retry-after"));
    assert!(!raw.headers.contains_key("idempotent-replayed"));
    assert!(raw.body.is_empty() && raw.trailers.is_none(), "{raw:?}");
    assert_eq!(
        h.shop.card_calls(),
        2,
        "refused calls never reach the handler"
    );

    // Another caller is served, and alice's existing keys still replay.
    let bob = client.create_payment(as_caller("bob", "k3")).await.unwrap();
    assert!(!replayed(&bob));
    let again = client
        .create_payment(as_caller("alice", "k1"))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref().id, "pay_1");
    assert_eq!(h.charges().await, 3, "alice twice, bob once");
    assert_eq!(h.shop.card_calls(), 3);
}

// ---------------------------------------------------------------------------------------
// Cancellation and deadlines: the detached run records the answer
// ---------------------------------------------------------------------------------------

/// Fires when the response future of the layer below is dropped before it finished.
struct DropProbe(Option<Arc<Notify>>);

impl DropProbe {
    fn finished(&mut self) {
        self.0 = None;
    }
}

impl Drop for DropProbe {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            n.notify_one();
        }
    }
}

/// Like [`start`], with a probe outside the idempotency layer that reports a dropped call,
/// and a layer that waits for an in-flight first attempt instead of answering ABORTED.
async fn start_probed(gate: Arc<CardGate>) -> (Harness, Arc<Notify>) {
    let config = config(Some(gate));
    let shop = Shop::new(&config);
    let layer = app::idempotency(Arc::new(MemoryStore::new()), &config)
        .with_in_progress(InProgress::wait(Duration::from_secs(30)));
    let dropped = Arc::new(Notify::new());
    let signal = dropped.clone();
    let probe = tower::util::MapFutureLayer::new(move |call| {
        let mut probe = DropProbe(Some(signal.clone()));
        async move {
            let res = call.await;
            probe.finished();
            res
        }
    });
    let router = Server::builder()
        .layer(probe)
        .layer(tonic::service::InterceptorLayer::new(
            app::authenticate as app::AuthFn,
        ))
        .layer(layer)
        .add_routes(Routes::new(app::payments(shop.clone())));
    (serve!(router, shop), dropped)
}

#[tokio::test]
async fn a_client_that_cancels_mid_call_gets_the_replay_on_retry() {
    let gate = CardGate::new();
    let (h, dropped) = start_probed(gate.clone()).await;
    let mut client = h.client.clone();
    let call =
        tokio::spawn(async move { client.create_payment(payment(Some("k-cancel"), 1000)).await });
    gate.arrived().await;
    call.abort(); // drops the call future: the client resets the stream
    assert!(call.await.unwrap_err().is_cancelled());
    dropped.notified().await; // the server dropped the layer's future mid-call
    gate.open(1);

    let retry = h
        .client
        .clone()
        .create_payment(payment(Some("k-cancel"), 1000))
        .await
        .unwrap();
    assert!(replayed(&retry), "the retry gets the detached run's answer");
    assert_eq!(retry.get_ref().id, "pay_1");
    assert_eq!(h.charges().await, 1);
    assert_eq!(h.shop.card_calls(), 1);
}

#[tokio::test]
async fn a_call_past_its_grpc_timeout_still_records_and_the_retry_replays() {
    let gate = CardGate::new();
    let (h, dropped) = start_probed(gate.clone()).await;
    let mut req = payment(Some("k-deadline"), 1000);
    // Generous, so the call reaches the card network long before it passes.
    req.set_timeout(Duration::from_millis(500));
    let mut client = h.client.clone();
    let call = tokio::spawn(async move { client.create_payment(req).await });
    gate.arrived().await;
    let status = call.await.unwrap().unwrap_err();
    assert!(
        matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{status:?}"
    );
    dropped.notified().await; // tonic's timeout dropped the layer's future
    gate.open(1);

    let retry = h
        .client
        .clone()
        .create_payment(payment(Some("k-deadline"), 1000))
        .await
        .unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref().id, "pay_1");
    assert_eq!(h.charges().await, 1);
}

// ---------------------------------------------------------------------------------------
// Server streaming
// ---------------------------------------------------------------------------------------

async fn collect(
    h: &Harness,
    req: Request<CreatePaymentsRequest>,
) -> Result<(bool, Vec<Payment>), Status> {
    let res = h.client.clone().create_payments(req).await?;
    let was_replayed = replayed(&res);
    let mut stream = res.into_inner();
    let mut out = Vec::new();
    while let Some(p) = stream.message().await? {
        out.push(p);
    }
    Ok((was_replayed, out))
}

#[tokio::test]
async fn a_server_stream_is_recorded_and_replayed() {
    let h = start(config(None), |l| l).await;
    let (replayed_first, first) = collect(&h, batch("k-batch", &[1000, 402, 2000]))
        .await
        .unwrap();
    assert!(!replayed_first);
    let ids: Vec<_> = first
        .iter()
        .map(|p| (p.id.as_str(), p.status.as_str()))
        .collect();
    assert_eq!(
        ids,
        [
            ("pay_1", "succeeded"),
            ("", "declined"),
            ("pay_2", "succeeded")
        ]
    );
    let (replayed_again, again) = collect(&h, batch("k-batch", &[1000, 402, 2000]))
        .await
        .unwrap();
    assert!(replayed_again);
    assert_eq!(again, first);
    assert_eq!(h.charges().await, 2);
    assert_eq!(h.shop.card_calls(), 3);
}

#[tokio::test]
async fn a_server_stream_over_the_response_limit_streams_once_then_is_tombstoned() {
    // Each Payment message is about 30 bytes framed: six of them are well over 64.
    let h = start(config(None), |l| {
        l.with_max_response_body(NonZeroUsize::new(64).unwrap())
    })
    .await;
    let amounts = [100, 200, 300, 400, 500, 600];
    let (_, first) = collect(&h, batch("k-huge", &amounts)).await.unwrap();
    assert_eq!(first.len(), 6, "the client still gets the whole stream");
    let status = collect(&h, batch("k-huge", &amounts)).await.unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    assert!(status.message().contains("too large to keep"), "{status:?}");
    assert_eq!(h.charges().await, 6, "never run again");
}

// ---------------------------------------------------------------------------------------
// Client streaming
// ---------------------------------------------------------------------------------------

fn import(
    key: &str,
    amounts: &[i64],
) -> Request<impl tokio_stream::Stream<Item = CreatePaymentRequest> + Send + 'static> {
    let messages: Vec<_> = amounts
        .iter()
        .map(|&amount| CreatePaymentRequest {
            amount,
            currency: "EUR".to_owned(),
        })
        .collect();
    let mut req = Request::new(tokio_stream::iter(messages));
    req.metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    req
}

#[tokio::test]
async fn a_client_stream_is_buffered_whole_recorded_and_replayed() {
    let h = start(config(None), |l| l).await;
    let mut client = h.client.clone();
    let one = client
        .import_payments(import("k-import", &[100, 402, 300]))
        .await
        .unwrap();
    assert_eq!(one.get_ref().count, 2);
    assert!(!replayed(&one));
    let two = client
        .import_payments(import("k-import", &[100, 402, 300]))
        .await
        .unwrap();
    assert!(replayed(&two));
    assert_eq!(two.get_ref(), one.get_ref());
    // The fingerprint covers the whole request stream.
    let status = client
        .import_payments(import("k-import", &[100, 402]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(h.charges().await, 2);
    assert_eq!(h.shop.card_calls(), 3);
}

#[tokio::test]
async fn a_client_stream_over_the_grpc_request_limit_is_resource_exhausted() {
    let h = start(config(None), |l| {
        l.with_grpc(app::grpc().max_request_body(NonZeroUsize::new(64).unwrap()))
    })
    .await;
    // Ten messages of about 12 bytes each, framed: past 64 bytes while being read.
    let status = h
        .client
        .clone()
        .import_payments(import("k-import-big", &[100; 10]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(h.shop.card_calls(), 0);
}

// ---------------------------------------------------------------------------------------
// Attaching, and a store that is down
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn the_server_wide_and_the_per_service_forms_both_serve() {
    let config = config(None);
    let shop = Shop::new(&config);
    let layer = app::idempotency(Arc::new(MemoryStore::new()), &config);
    let per_service = serve!(app::per_service(layer, shop.clone()), shop);

    let config = self::config(None);
    let shop = Shop::new(&config);
    let layer = app::idempotency(Arc::new(MemoryStore::new()), &config);
    let server_wide = serve!(app::server_wide(layer, shop.clone()), shop);

    for h in [per_service, server_wide] {
        let mut client = h.client.clone();
        let one = client
            .create_payment(payment(Some("k"), 1000))
            .await
            .unwrap();
        let two = client
            .create_payment(payment(Some("k"), 1000))
            .await
            .unwrap();
        assert!(!replayed(&one) && replayed(&two));
        let status = client
            .create_payment(payment(None, 1000))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(h.charges().await, 1);
    }
}

#[tokio::test]
async fn a_store_that_is_down_answers_unavailable_with_retry_info() {
    let h = start_with_store(Arc::new(DownStore), config(None), |l| l).await;
    let status = h
        .client
        .clone()
        .create_payment(payment(Some("k-down"), 1000))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(retry_delay(&status), Duration::from_secs(1));
    assert_eq!(h.shop.card_calls(), 0, "fail closed: nothing ran");
    assert_eq!(h.charges().await, 0, "the passthrough read needs no store");
}
