//! Payment intents sent through the retry layer, shared by `main.rs` and `tests/client/client.rs`.
// The example prints the summary; the test also reads each intent's payment and attempts.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{IdempotentRetryLayer, RetryOutcome};

/// What became of one intent.
#[derive(Debug, Clone)]
pub(crate) struct Intent {
    /// The final status, or `None` when the last attempt failed in transport.
    pub(crate) status: Option<StatusCode>,
    /// The payment id the shop answered with.
    pub(crate) payment: Option<String>,
    /// Attempts the layer reports (`RetryOutcome`); none when the last one failed in transport.
    pub(crate) attempts: Option<u32>,
    pub(crate) replayed: bool,
}

/// All intents, and the attempts that actually went out (counted below the layer).
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub(crate) intents: Vec<Intent>,
    pub(crate) attempts: u64,
}

/// Totals over all intents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Summary {
    pub(crate) intents: usize,
    pub(crate) attempts: u64,
    pub(crate) replays: usize,
    pub(crate) failures: usize,
}

impl Summary {
    pub(crate) fn of(run: &Run) -> Self {
        let intents = &run.intents;
        Self {
            intents: intents.len(),
            attempts: run.attempts,
            replays: intents.iter().filter(|i| i.replayed).count(),
            failures: intents
                .iter()
                .filter(|i| !i.status.is_some_and(|s| s.is_success()))
                .count(),
        }
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "intents={} attempts={} replays={} failures={}",
            self.intents, self.attempts, self.replays, self.failures
        )
    }
}

/// Sends `count` payment intents to `target` (the shop's base URL), `concurrency` at a time,
/// each through `layer` with its own key.
pub(crate) async fn pay(
    target: &Uri,
    count: usize,
    concurrency: usize,
    layer: IdempotentRetryLayer,
) -> Run {
    // A fresh connection per attempt (no pooling), so a dropped connection loses exactly one
    // answer and no reuse race hides a failure.
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Full<Bytes>>();
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    let client = ServiceBuilder::new()
        .layer(layer)
        .map_request(move |req: Request<Full<Bytes>>| {
            counter.fetch_add(1, Ordering::Relaxed);
            req
        })
        .service(http);
    let url: Uri = format!("{}/v1/payments", target.to_string().trim_end_matches('/'))
        .parse()
        .expect("a valid target URL");
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = JoinSet::new();
    for n in 0..count {
        let (mut client, url, permits) = (client.clone(), url.clone(), permits.clone());
        tasks.spawn(async move {
            let _permit = permits.acquire_owned().await.expect("never closed");
            let body = format!(r#"{{"amount":{},"currency":"EUR"}}"#, 1000 + n);
            let req = Request::post(url)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("a valid request");
            match ServiceExt::<Request<Full<Bytes>>>::ready(&mut client)
                .await
                .expect("ready")
                .call(req)
                .await
            {
                Ok(res) => {
                    let status = res.status();
                    let outcome = res.extensions().get::<RetryOutcome>().cloned();
                    let body = res.into_body().collect().await.ok().map(|b| b.to_bytes());
                    let payment = body
                        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                        .and_then(|v| v["id"].as_str().map(str::to_owned));
                    Intent {
                        status: Some(status),
                        payment,
                        attempts: outcome.as_ref().map(RetryOutcome::attempts),
                        replayed: outcome.as_ref().is_some_and(RetryOutcome::replayed),
                    }
                }
                // The retries ran out on transport errors.
                Err(_) => Intent {
                    status: None,
                    payment: None,
                    attempts: None,
                    replayed: false,
                },
            }
        });
    }
    let mut intents = Vec::with_capacity(count);
    while let Some(intent) = tasks.join_next().await {
        intents.push(intent.expect("intent task panicked"));
    }
    Run {
        intents,
        attempts: sent.load(Ordering::Relaxed),
    }
}
