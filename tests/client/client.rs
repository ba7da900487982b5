//! The client retry layer against a fake upstream (paused time), and end to end against the
//! shop behind a proxy that loses answers.

#[path = "../../examples/shop/app.rs"]
mod app;
#[path = "../../examples/client/intents.rs"]
mod intents;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tower::{service_fn, BoxError, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{
    Backoff, Deadline, IdempotentRetryLayer, Jitter, RetryBudget, RetryOutcome,
};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::Timing;

/// One scripted answer of the fake upstream.
#[derive(Clone)]
enum Reply {
    Status(u16, Vec<(&'static str, String)>),
    /// A transport error (connection refused, reset, timeout).
    Error,
}

fn status(code: u16) -> Reply {
    Reply::Status(code, Vec::new())
}

fn status_with(code: u16, headers: &[(&'static str, &str)]) -> Reply {
    Reply::Status(
        code,
        headers.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
    )
}

/// What the upstream saw of one attempt.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    key: Option<HeaderValue>,
    body: Bytes,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// An upstream that answers attempt `n` with `script[n]` (the last entry once past its end)
/// and logs every attempt.
fn upstream(
    script: Vec<Reply>,
) -> (
    impl Service<
            Request<Full<Bytes>>,
            Response = Response<Full<Bytes>>,
            Error = BoxError,
            Future = impl Send,
        > + Clone
        + Send,
    Log,
) {
    let log: Log = Arc::default();
    let seen = log.clone();
    let svc = service_fn(move |req: Request<Full<Bytes>>| {
        let (seen, script) = (seen.clone(), script.clone());
        async move {
            let key = req.headers().get("idempotency-key").cloned();
            let body = http_body_util::BodyExt::collect(req.into_body())
                .await
                .unwrap()
                .to_bytes();
            let n = {
                let mut seen = seen.lock().unwrap();
                seen.push(Seen {
                    at: Instant::now(),
                    key,
                    body,
                });
                seen.len() - 1
            };
            match &script[n.min(script.len() - 1)] {
                Reply::Error => Err::<Response<Full<Bytes>>, BoxError>("connection reset".into()),
                Reply::Status(code, headers) => {
                    let mut res = Response::new(Full::new(Bytes::from("answer")));
                    *res.status_mut() = StatusCode::from_u16(*code).unwrap();
                    for (k, v) in headers {
                        res.headers_mut()
                            .insert(*k, HeaderValue::from_str(v).unwrap());
                    }
                    Ok(res)
                }
            }
        }
    });
    (svc, log)
}

/// Exact delays: no jitter, 100 ms doubling to 1 s, no budget.
fn layer() -> IdempotentRetryLayer {
    IdempotentRetryLayer::new()
        .with_jitter(Jitter::None)
        .with_backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).unwrap())
        .without_budget()
}

fn payment() -> Request<Full<Bytes>> {
    Request::post("/v1/payments")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            r#"{"amount":1000,"currency":"EUR"}"#,
        )))
        .unwrap()
}

/// Sends `req` through `layer` to an upstream playing `script`: the final result and the log.
async fn run(
    layer: IdempotentRetryLayer,
    script: Vec<Reply>,
    req: Request<Full<Bytes>>,
) -> (Result<Response<Full<Bytes>>, BoxError>, Vec<Seen>) {
    let (svc, log) = upstream(script);
    let client = ServiceBuilder::new().layer(layer).service(svc);
    let res = client.oneshot(req).await;
    let seen = log.lock().unwrap().clone();
    (res, seen)
}

fn outcome<B>(res: &Response<B>) -> RetryOutcome {
    res.extensions().get::<RetryOutcome>().cloned().unwrap()
}

fn gaps(seen: &[Seen]) -> Vec<Duration> {
    seen.windows(2).map(|w| w[1].at - w[0].at).collect()
}

#[tokio::test(start_paused = true)]
async fn two_503s_then_success_takes_three_attempts_with_one_key_and_one_body() {
    let (res, seen) = run(
        layer(),
        vec![status(503), status(503), status(201)],
        payment(),
    )
    .await;
    let res = res.unwrap();
    assert_eq!(res.status(), 201);
    let outcome = outcome(&res);
    assert_eq!(outcome.attempts(), 3);
    assert!(!outcome.replayed());
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.key.as_ref() == Some(outcome.key())));
    assert!(seen
        .iter()
        .all(|s| s.body == r#"{"amount":1000,"currency":"EUR"}"#));
    // Backoff without jitter: 100 ms, then 200 ms.
    assert_eq!(
        gaps(&seen),
        [Duration::from_millis(100), Duration::from_millis(200)]
    );
}

#[tokio::test(start_paused = true)]
async fn each_request_gets_its_own_uuid_key() {
    let (svc, log) = upstream(vec![status(201)]);
    let mut client = ServiceBuilder::new().layer(layer()).service(svc);
    for _ in 0..3 {
        ServiceExt::<Request<Full<Bytes>>>::ready(&mut client)
            .await
            .unwrap()
            .call(payment())
            .await
            .unwrap();
    }
    let keys: HashSet<_> = log
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.key.clone().unwrap())
        .collect();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| k.len() == 36));
}

#[tokio::test(start_paused = true)]
async fn a_caller_provided_key_is_kept_on_every_attempt() {
    let mut req = payment();
    req.headers_mut().insert(
        "idempotency-key",
        HeaderValue::from_static("refund:order-1042"),
    );
    let (res, seen) = run(layer(), vec![Reply::Error, status(201)], req).await;
    assert_eq!(outcome(&res.unwrap()).key(), "refund:order-1042");
    assert_eq!(seen.len(), 2);
    assert!(seen
        .iter()
        .all(|s| s.key.as_ref().unwrap() == "refund:order-1042"));
}

#[tokio::test(start_paused = true)]
async fn a_derived_key_is_used_when_the_caller_sets_none() {
    let layer = layer().with_key(|parts| {
        let order = parts.uri.path().rsplit('/').next()?;
        HeaderValue::from_str(&format!("refund:{order}")).ok()
    });
    let req = Request::post("/v1/refunds/order-1042")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (res, seen) = run(layer, vec![status(502), status(200)], req).await;
    assert_eq!(outcome(&res.unwrap()).attempts(), 2);
    assert!(seen
        .iter()
        .all(|s| s.key.as_ref().unwrap() == "refund:order-1042"));
}

#[tokio::test(start_paused = true)]
async fn a_422_is_not_retried() {
    let (res, seen) = run(layer(), vec![status(422), status(201)], payment()).await;
    let res = res.unwrap();
    assert_eq!(res.status(), 422);
    assert_eq!(outcome(&res).attempts(), 1);
    assert_eq!(seen.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn retries_the_statuses_that_can_succeed_later_and_no_others() {
    for code in [408, 429, 500, 502, 503, 504] {
        let (res, seen) = run(layer(), vec![status(code), status(201)], payment()).await;
        assert_eq!(res.unwrap().status(), 201, "{code}");
        assert_eq!(seen.len(), 2, "{code} is retried");
    }
    for code in [200, 201, 400, 401, 403, 404, 405, 409, 410, 413, 422, 501] {
        let (res, seen) = run(layer(), vec![status(code), status(201)], payment()).await;
        assert_eq!(res.unwrap().status(), code);
        assert_eq!(seen.len(), 1, "{code} is not retried");
    }
}

#[tokio::test(start_paused = true)]
async fn transport_errors_are_retried_and_the_last_one_is_returned() {
    let (res, seen) = run(layer(), vec![Reply::Error, status(201)], payment()).await;
    assert_eq!(res.unwrap().status(), 201);
    assert_eq!(seen.len(), 2);

    let (res, seen) = run(layer().with_max_retries(2), vec![Reply::Error], payment()).await;
    assert_eq!(res.unwrap_err().to_string(), "connection reset");
    assert_eq!(seen.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn retry_after_in_seconds_is_waited_out() {
    let script = vec![status_with(503, &[("retry-after", "7")]), status(201)];
    let (res, seen) = run(layer(), script, payment()).await;
    assert_eq!(outcome(&res.unwrap()).attempts(), 2);
    // The hint is longer than the 100 ms backoff, so it decides.
    assert_eq!(gaps(&seen), [Duration::from_secs(7)]);

    // A hint shorter than the backoff does not make the retry sooner.
    let script = vec![status_with(429, &[("retry-after", "0")]), status(201)];
    let (_, seen) = run(layer(), script, payment()).await;
    assert_eq!(gaps(&seen), [Duration::from_millis(100)]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_waited_out() {
    // HTTP-dates have whole seconds, and the wall clock runs on while tokio's is paused.
    let date = httpdate_in(Duration::from_secs(30));
    let script = vec![status_with(503, &[("retry-after", &date)]), status(201)];
    let (res, seen) = run(layer(), script, payment()).await;
    assert_eq!(outcome(&res.unwrap()).attempts(), 2);
    let gap = gaps(&seen)[0];
    assert!(
        gap > Duration::from_secs(28) && gap <= Duration::from_secs(30),
        "{gap:?}"
    );
}

fn httpdate_in(d: Duration) -> String {
    // RFC 9110 IMF-fixdate, formatted by hand to keep httpdate out of the test's deps.
    let secs = (SystemTime::now() + d)
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "{weekday}, {day:02} {} {year} {:02}:{:02}:{:02} GMT",
        months[(month - 1) as usize],
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[tokio::test(start_paused = true)]
async fn an_in_progress_409_is_retried_after_its_retry_after_and_reports_the_replay() {
    let script = vec![
        status_with(
            409,
            &[
                ("retry-after", "2"),
                ("content-type", "application/problem+json"),
            ],
        ),
        status_with(201, &[("idempotent-replayed", "true")]),
    ];
    let (res, seen) = run(layer(), script, payment()).await;
    let res = res.unwrap();
    assert_eq!(res.status(), 201);
    let outcome = outcome(&res);
    assert_eq!(outcome.attempts(), 2);
    assert!(outcome.replayed());
    assert_eq!(gaps(&seen), [Duration::from_secs(2)]);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_beyond_the_maximum_ends_the_retries() {
    let script = vec![status_with(503, &[("retry-after", "120")]), status(201)];
    let (res, seen) = run(
        layer().with_max_retry_after(Duration::from_secs(60)),
        script,
        payment(),
    )
    .await;
    assert_eq!(res.unwrap().status(), 503);
    assert_eq!(seen.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_stops_retries_that_would_start_past_it() {
    // Attempts at 0, 100 ms, 300 ms, 700 ms; the next would be at 1.5 s, past the 1 s deadline.
    let layer = layer()
        .with_max_retries(10)
        .with_deadline(Duration::from_secs(1));
    let start = Instant::now();
    let (res, seen) = run(layer, vec![status(503)], payment()).await;
    let res = res.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(outcome(&res).attempts(), 4);
    assert_eq!(seen.len(), 4);
    assert!(seen.iter().all(|s| s.at - start < Duration::from_secs(1)));
    // It returned as soon as it gave up, without waiting for the deadline.
    assert_eq!(Instant::now() - start, Duration::from_millis(700));

    // A Retry-After that ends past the deadline is not waited for.
    let layer = self::layer().with_deadline(Duration::from_secs(5));
    let script = vec![status_with(503, &[("retry-after", "10")]), status(201)];
    let (res, seen) = run(layer, script, payment()).await;
    assert_eq!(res.unwrap().status(), 503);
    assert_eq!(seen.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_in_progress_409_whose_retry_after_passes_the_deadline_is_returned_at_once() {
    // A server that still hints the rest of its 30 s lease, and a caller with 5 s to spare.
    let in_progress = status_with(
        409,
        &[
            ("retry-after", "29"),
            ("content-type", "application/problem+json"),
        ],
    );
    let script = vec![in_progress, status(201)];
    let start = Instant::now();
    let (res, seen) = run(
        layer().with_deadline(Duration::from_secs(5)),
        script,
        payment(),
    )
    .await;
    let res = res.unwrap();
    assert_eq!(res.status(), 409);
    assert_eq!(outcome(&res).attempts(), 1);
    assert_eq!(seen.len(), 1);
    // Not asleep until the deadline either: the caller gets its time back.
    assert_eq!(Instant::now() - start, Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn a_deadline_extension_overrides_the_layer_deadline() {
    let mut req = payment();
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(250)));
    let layer = layer()
        .with_max_retries(10)
        .with_deadline(Duration::from_secs(60));
    let (res, seen) = run(layer, vec![status(503)], req).await;
    // 0 and 100 ms; 300 ms would be past 250 ms.
    assert_eq!(outcome(&res.unwrap()).attempts(), 2);
    assert_eq!(seen.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn full_jitter_waits_at_most_the_backoff_ceiling() {
    let layer = IdempotentRetryLayer::new()
        .with_backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).unwrap())
        .with_max_retries(6)
        .without_budget()
        .with_seed(3);
    let (_, seen) = run(layer, vec![status(503)], payment()).await;
    let gaps = gaps(&seen);
    assert_eq!(gaps.len(), 6);
    for (n, gap) in gaps.iter().enumerate() {
        let ceiling = Duration::from_millis(100 << n).min(Duration::from_secs(1));
        assert!(*gap <= ceiling, "retry {n}: {gap:?} > {ceiling:?}");
    }
    // Jittered, not the ceilings themselves.
    assert_ne!(
        gaps,
        [100, 200, 400, 800, 1000, 1000].map(Duration::from_millis)
    );
}

/// Calls made when 1,000 requests, all at once, meet an upstream that is down, with up to 3
/// retries each.
async fn calls_against_a_dead_upstream(layer: IdempotentRetryLayer) -> usize {
    let (svc, log) = upstream(vec![Reply::Error]);
    let client = ServiceBuilder::new().layer(layer).service(svc);
    let requests = (0..1_000).map(|_| client.clone().oneshot(payment()));
    let results = futures_util::future::join_all(requests).await;
    assert!(results.iter().all(Result::is_err));
    let calls = log.lock().unwrap().len();
    calls
}

#[tokio::test(start_paused = true)]
async fn a_ten_percent_budget_keeps_a_dead_upstream_at_about_1_1x_its_calls() {
    let base = || {
        IdempotentRetryLayer::new()
            .with_backoff(
                Backoff::new(Duration::from_millis(10), Duration::from_millis(100)).unwrap(),
            )
            .with_max_retries(3)
            .with_seed(1)
    };
    let unbudgeted = calls_against_a_dead_upstream(base().without_budget()).await;
    assert_eq!(unbudgeted, 4_000);

    // 10% of 1,000 requests, plus a reserve of 1 retry per second over the 10 s window.
    let budget = RetryBudget::new(0.1, 1, Duration::from_secs(10)).unwrap();
    let budgeted = calls_against_a_dead_upstream(base().with_budget(budget)).await;
    println!(
        "dead upstream, 1,000 requests: {unbudgeted} calls without a budget, {budgeted} with 10%"
    );
    assert!(
        (1_000..=1_110).contains(&budgeted),
        "{budgeted} calls for 1,000 requests"
    );
    // The budget was spent, not left unused.
    assert!(budgeted >= 1_100, "{budgeted}");
}

// --- gRPC -----------------------------------------------------------------------------------

/// `google.rpc.Status` and friends, encoded by prost: an encoder independent of the layer's
/// hand-written decoder.
mod rpc {
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Status {
        #[prost(int32, tag = "1")]
        pub(super) code: i32,
        #[prost(string, tag = "2")]
        pub(super) message: String,
        #[prost(message, repeated, tag = "3")]
        pub(super) details: Vec<Any>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Any {
        #[prost(string, tag = "1")]
        pub(super) type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        pub(super) value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct RetryInfo {
        #[prost(message, optional, tag = "1")]
        pub(super) retry_delay: Option<Duration>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Duration {
        #[prost(int64, tag = "1")]
        pub(super) seconds: i64,
        #[prost(int32, tag = "2")]
        pub(super) nanos: i32,
    }
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(A[((n >> (18 - 6 * i)) & 0x3f) as usize] as char);
        }
    }
    out
}

/// A trailers-only gRPC answer with `code`, and a RetryInfo of `delay` when given.
fn grpc(code: i32, delay: Option<Duration>) -> Reply {
    use prost::Message;
    let mut headers = vec![
        ("content-type", "application/grpc".to_owned()),
        ("grpc-status", code.to_string()),
    ];
    if let Some(delay) = delay {
        let retry_info = rpc::RetryInfo {
            retry_delay: Some(rpc::Duration {
                seconds: delay.as_secs() as i64,
                nanos: delay.subsec_nanos() as i32,
            }),
        };
        let status = rpc::Status {
            code,
            message: "try later".to_owned(),
            details: vec![rpc::Any {
                type_url: "type.googleapis.com/google.rpc.RetryInfo".to_owned(),
                value: retry_info.encode_to_vec(),
            }],
        };
        headers.push(("grpc-status-details-bin", base64(&status.encode_to_vec())));
    }
    Reply::Status(200, headers)
}

fn grpc_ok() -> Reply {
    status_with(200, &[("content-type", "application/grpc")])
}

fn unary_call() -> Request<Full<Bytes>> {
    Request::post("/shop.v1.Payments/Create")
        .header("content-type", "application/grpc")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn grpc_unavailable_and_statuses_with_retry_info_are_retried_after_their_delay() {
    const UNAVAILABLE: i32 = 14;
    const ABORTED: i32 = 10;
    const RESOURCE_EXHAUSTED: i32 = 8;
    let (_, seen) = run(
        layer(),
        vec![grpc(UNAVAILABLE, None), grpc_ok()],
        unary_call(),
    )
    .await;
    assert_eq!(gaps(&seen), [Duration::from_millis(100)]);

    for code in [UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED] {
        let delay = Duration::from_millis(2_500);
        let script = vec![grpc(code, Some(delay)), grpc_ok()];
        let (res, seen) = run(layer(), script, unary_call()).await;
        assert_eq!(outcome(&res.unwrap()).attempts(), 2, "{code}");
        assert_eq!(gaps(&seen), [delay], "{code}");
    }
}

#[tokio::test(start_paused = true)]
async fn grpc_statuses_a_retry_cannot_fix_are_not_retried() {
    const INVALID_ARGUMENT: i32 = 3;
    const FAILED_PRECONDITION: i32 = 9;
    const ABORTED: i32 = 10;
    const RESOURCE_EXHAUSTED: i32 = 8;
    let delay = Some(Duration::from_secs(1));
    for reply in [
        grpc(INVALID_ARGUMENT, None),
        grpc(INVALID_ARGUMENT, delay),
        grpc(FAILED_PRECONDITION, None),
        grpc(FAILED_PRECONDITION, delay),
        // Without RetryInfo the server gave no sign that the same call can succeed later.
        grpc(ABORTED, None),
        grpc(RESOURCE_EXHAUSTED, None),
    ] {
        let (res, seen) = run(layer(), vec![reply, grpc_ok()], unary_call()).await;
        assert_eq!(outcome(&res.unwrap()).attempts(), 1);
        assert_eq!(seen.len(), 1);
    }
}

// --- end to end -----------------------------------------------------------------------------

/// A TCP proxy in front of `upstream` that, for 30% of connections (a seeded choice), forwards
/// the request, waits for the answer to start, and then closes the client's connection
/// instead of forwarding it: the work is done, the client never hears of it.
async fn lossy_proxy(upstream: SocketAddr, dropped: Arc<AtomicUsize>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let n = connections.fetch_add(1, Ordering::Relaxed);
            let lose = splitmix(n) % 10 < 3;
            let dropped = dropped.clone();
            tokio::spawn(async move {
                let server = TcpStream::connect(upstream).await.unwrap();
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                let requests = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_rx, &mut server_tx).await;
                    let _ = server_tx.shutdown().await;
                });
                if lose {
                    // The first byte of the answer: the shop has done the work.
                    let mut byte = [0u8; 1];
                    if server_rx.read(&mut byte).await.unwrap_or(0) == 1 {
                        dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    requests.abort();
                    // Dropping both halves closes the client's connection.
                    return;
                }
                let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
                let _ = client_tx.shutdown().await;
            });
        }
    });
    addr
}

/// SplitMix64 of `n`: a fixed, well-spread choice of which connections lose their answer.
fn splitmix(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_intent_is_charged_exactly_once_when_30_percent_of_answers_are_lost() {
    let config = app::ShopConfig {
        card_latency: Duration::from_millis(2),
        timing: Timing::default(),
    };
    let (router, shop) = app::app(Arc::new(MemoryStore::new()), config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let shop_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let dropped = Arc::new(AtomicUsize::new(0));
    let proxy = lossy_proxy(shop_addr, dropped.clone()).await;

    // Enough retries that losing every answer of one intent is negligible (0.3^11), and a
    // budget that allows them all: this test is about keys, not load shedding.
    let layer = IdempotentRetryLayer::new()
        .with_backoff(Backoff::new(Duration::from_millis(1), Duration::from_millis(20)).unwrap())
        .with_max_retries(10)
        .with_budget(RetryBudget::new(1.0, 100, Duration::from_secs(10)).unwrap());
    let target = format!("http://{proxy}").parse().unwrap();
    let run = intents::pay(&target, 100, 8, layer).await;
    let summary = intents::Summary::of(&run);
    println!(
        "{summary}, {} answers lost",
        dropped.load(Ordering::Relaxed)
    );

    assert_eq!(summary.failures, 0, "{:?}", run.intents);
    assert_eq!(shop.charges(), 100, "one charge per intent");
    let payments: HashSet<_> = run
        .intents
        .iter()
        .map(|i| i.payment.clone().unwrap())
        .collect();
    assert_eq!(payments.len(), 100, "each intent has its own payment");
    // Answers were lost and the retries got them back as replays, not as new charges.
    let lost = dropped.load(Ordering::Relaxed);
    assert!(lost > 0);
    assert!(summary.replays > 0);
    assert_eq!(summary.attempts, 100 + lost as u64);
    let reported: u64 = run
        .intents
        .iter()
        .map(|i| u64::from(i.attempts.unwrap()))
        .sum();
    assert_eq!(reported, summary.attempts);
}
