//! Run with: `cargo run --example herd --features client`
//!
//! A thundering herd, simulated: 1,000 clients call at once an upstream that serves 50 calls
//! per 100 ms and answers `503` to the rest. Every client retries through
//! `IdempotentRetryLayer` (backoff 100 ms doubling to 10 s, up to 30 retries, no budget, so
//! that jitter is the only difference). It prints, with no jitter and with full jitter, over
//! several seeds, the calls sent and when the last client was served.
//!
//! Time is tokio's paused clock, so the simulated minutes take a moment, and the jitter comes
//! from the layer's seeded generator, so every run prints the same table.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{Backoff, IdempotentRetryLayer, Jitter};

const CLIENTS: usize = 1_000;
const CAPACITY: u64 = 50;
const WINDOW: Duration = Duration::from_millis(100);

/// What one run of the herd did.
struct Run {
    calls: u64,
    served: usize,
    last_served: Duration,
}

async fn herd(jitter: Jitter, seed: u64) -> Run {
    let start = Instant::now();
    let calls = Arc::new(AtomicU64::new(0));
    // (window index, calls served in it): a fixed-window limiter.
    let window = Arc::new(Mutex::new((0u128, 0u64)));
    let upstream = {
        let calls = calls.clone();
        service_fn(move |_req: Request<Full<Bytes>>| {
            calls.fetch_add(1, Ordering::Relaxed);
            let index = start.elapsed().as_millis() / WINDOW.as_millis();
            let mut w = window.lock().unwrap();
            if w.0 != index {
                *w = (index, 0);
            }
            let status = if w.1 < CAPACITY {
                w.1 += 1;
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let mut res = Response::new(Full::new(Bytes::new()));
            *res.status_mut() = status;
            std::future::ready(Ok::<_, Infallible>(res))
        })
    };
    let layer = IdempotentRetryLayer::new()
        .with_backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(10)).unwrap())
        .with_max_retries(30)
        .without_budget()
        .with_jitter(jitter)
        .with_seed(seed);
    let client = ServiceBuilder::new().layer(layer).service(upstream);
    let mut tasks = JoinSet::new();
    for _ in 0..CLIENTS {
        let client = client.clone();
        tasks.spawn(async move {
            let req = Request::post("/v1/payments")
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let res = client.oneshot(req).await.unwrap();
            res.status().is_success().then(|| start.elapsed())
        });
    }
    let (mut served, mut last_served) = (0, Duration::ZERO);
    while let Some(done) = tasks.join_next().await {
        if let Some(at) = done.unwrap() {
            served += 1;
            last_served = last_served.max(at);
        }
    }
    Run {
        calls: calls.load(Ordering::Relaxed),
        served,
        last_served,
    }
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() {
    println!(
        "{CLIENTS} clients at once, capacity {CAPACITY} calls per {} ms",
        WINDOW.as_millis()
    );
    println!("jitter  seed   calls  served  last served at");
    for seed in 1..=5 {
        for (name, jitter) in [("none", Jitter::None), ("full", Jitter::Full)] {
            let run = herd(jitter, seed).await;
            println!(
                "{name:<6}  {seed:>4}  {:>6}  {:>6}  {:>10.1} s",
                run.calls,
                run.served,
                run.last_served.as_secs_f64()
            );
        }
    }
}
