//! The client retry layer under a real tonic client, against the gRPC shop example and its
//! server-side idempotency layer; and the gRPC client example against the same server.

#[path = "../../examples/grpc/app.rs"]
#[allow(dead_code)]
mod app;
/// The gRPC client example's client and intents (its `super::pb` is the shop's).
#[path = "../../examples/grpc_client/pay.rs"]
mod grpc_client;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;
use tonic::{Code, Request};
use tower::{BoxError, ServiceBuilder};
use tower_idempotency::client::{Backoff, IdempotentRetryLayer, Jitter, RetryOutcome};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Timing;

use app::pb;
use app::{CardGate, Shop, ShopConfig};
use pb::payments_client::PaymentsClient;
use pb::CreatePaymentRequest;

/// Serves the shop on 127.0.0.1:0; returns a plain channel to it.
async fn serve(config: ShopConfig) -> (Channel, Arc<Shop>) {
    let store = Arc::new(MemoryStore::new());
    let shop = Shop::new(&config);
    let router = app::server_wide(app::idempotency(store, &config), shop.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
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
    (channel, shop)
}

fn config(timing: Timing, card_gate: Option<Arc<CardGate>>) -> ShopConfig {
    ShopConfig {
        card_latency: Duration::ZERO,
        timing,
        card_gate,
    }
}

fn layer() -> IdempotentRetryLayer {
    IdempotentRetryLayer::new()
        .with_jitter(Jitter::None)
        .with_backoff(Backoff::new(Duration::from_millis(1), Duration::from_millis(10)).unwrap())
        .without_budget()
}

/// The tonic client through the retry layer; `answered` is told of every attempt's answer.
fn retrying_client(
    channel: Channel,
    layer: IdempotentRetryLayer,
    answered: Arc<Notify>,
    attempts: Arc<AtomicUsize>,
) -> PaymentsClient<
    impl tonic::client::GrpcService<
            tonic::body::Body,
            Error = BoxError,
            ResponseBody = tonic::body::Body,
            Future = impl Send,
        > + Clone,
> {
    let svc = ServiceBuilder::new()
        .layer(layer)
        // tonic wants its own body type: the buffered bytes go into one.
        .map_request(move |req: http::Request<Full<Bytes>>| {
            attempts.fetch_add(1, Ordering::SeqCst);
            req.map(tonic::body::Body::new)
        })
        .map_response(move |res| {
            answered.notify_one();
            res
        })
        .service(channel);
    PaymentsClient::new(svc)
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

#[tokio::test]
async fn a_tonic_call_gets_a_key_and_unavailable_is_retried() {
    let (channel, shop) = serve(config(Timing::default(), None)).await;
    let attempts = Arc::new(AtomicUsize::new(0));
    let mut client = retrying_client(
        channel,
        layer().with_max_retries(3),
        Arc::default(),
        attempts.clone(),
    );

    // The server requires a key on CreatePayment: the layer sent one.
    let ok = client.create_payment(payment(None, 1000)).await.unwrap();
    let outcome = ok.extensions().get::<RetryOutcome>().unwrap();
    assert_eq!(outcome.attempts(), 1);
    assert_eq!(outcome.key().len(), 36);
    assert_eq!(shop.charges(), 1);

    // 503 is "card network down": UNAVAILABLE, released by the server, so each retry runs.
    attempts.store(0, Ordering::SeqCst);
    let status = client.create_payment(payment(None, 503)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(attempts.load(Ordering::SeqCst), 4);
    assert_eq!(shop.card_calls(), 1 + 4);

    // INVALID_ARGUMENT is final.
    attempts.store(0, Ordering::SeqCst);
    let status = client.create_payment(payment(None, 0)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_in_progress_abort_is_retried_after_its_retry_info_and_gets_the_replay() {
    // A short lease: the server's RetryInfo says when the first call's lease ends.
    let timing = Timing::new(Duration::from_millis(500), Duration::from_secs(60)).unwrap();
    let gate = CardGate::new();
    let (channel, shop) = serve(config(timing, Some(gate.clone()))).await;

    // The first call holds the key at the card network.
    let mut first = PaymentsClient::new(channel.clone());
    let first = tokio::spawn(async move {
        first
            .create_payment(payment(Some("k-in-progress"), 1000))
            .await
    });
    gate.arrived().await;

    let (answered, attempts) = (Arc::new(Notify::new()), Arc::new(AtomicUsize::new(0)));
    let mut client = retrying_client(channel, layer(), answered.clone(), attempts.clone());
    let second = tokio::spawn(async move {
        client
            .create_payment(payment(Some("k-in-progress"), 1000))
            .await
    });
    // The second call's first attempt was answered ABORTED; now let the first one finish.
    answered.notified().await;
    gate.open(1);

    let first = first.await.unwrap().unwrap();
    let second = second.await.unwrap().unwrap();
    let outcome = second.extensions().get::<RetryOutcome>().unwrap();
    assert_eq!(outcome.attempts(), 2);
    assert!(outcome.replayed());
    assert_eq!(outcome.key(), "k-in-progress");
    assert_eq!(second.get_ref(), first.get_ref());
    assert_eq!(shop.card_calls(), 1);
}

#[tokio::test]
async fn the_grpc_client_example_pays_each_intent_once_and_a_second_run_replays_them() {
    let (channel, shop) = serve(config(Timing::default(), None)).await;
    let mut client = grpc_client::client(channel, layer().with_max_retries(3));
    let keys = grpc_client::keys("test", 5);

    let first = grpc_client::pay(&mut client, &keys, 1000).await;
    let summary = grpc_client::Summary::of(&first);
    assert_eq!(
        (
            summary.intents,
            summary.attempts,
            summary.replays,
            summary.failures
        ),
        (5, 5, 0, 0),
        "{first:?}"
    );
    assert_eq!(shop.charges(), 5);
    let ids: Vec<_> = first.iter().map(|p| p.payment.clone().unwrap()).collect();
    assert_eq!(ids, ["pay_1", "pay_2", "pay_3", "pay_4", "pay_5"]);

    // The same intents again (a restarted run): each key is answered from its record.
    let again = grpc_client::pay(&mut client, &keys, 1000).await;
    assert!(again.iter().all(|p| p.replayed), "{again:?}");
    let replayed: Vec<_> = again.iter().map(|p| p.payment.clone().unwrap()).collect();
    assert_eq!(replayed, ids);
    assert_eq!(shop.charges(), 5);

    // The card network down: each intent is retried, with its key, until the retries run out.
    let down = grpc_client::pay(&mut client, &grpc_client::keys("down", 1), 503).await;
    assert_eq!(down[0].payment, Err(Code::Unavailable));
    assert_eq!(shop.card_calls(), 5 + 4);
}
