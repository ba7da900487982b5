//! Run with: `cargo bench --bench layer`
//!
//! Each group measures the layer beside a baseline taken in the same run:
//! - `layer`: a bare handler, then the same handler behind `IdempotencyLayer` with
//!   `MemoryStore` (pass-through GET, new key, replay);
//! - `fingerprint`: RFC 8785 canonicalisation of a JSON body beside SHA-256 of the same bytes.
#![allow(missing_docs)]

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{IdempotencyLayer, RequestBody};

const PAYMENT: &str =
    r#"{"amount":1000,"currency":"EUR","customer":"cus_123","metadata":{"order":"ord_42"}}"#;

async fn handler<B>(_req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut res = Response::new(Full::new(Bytes::from_static(
        br#"{"id":"pay_1","amount":1000,"currency":"EUR","status":"succeeded"}"#,
    )));
    *res.status_mut() = StatusCode::CREATED;
    res.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(res)
}

fn post(key: &str) -> Request<Full<Bytes>> {
    Request::post("/v1/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(PAYMENT.as_bytes())))
        .unwrap()
}

/// Times `iters` sequential calls inside one task on a runtime worker, the way a server
/// runs a connection: spawned work lands on the same worker instead of waking another.
fn on_worker<F, Fut>(rt: &tokio::runtime::Runtime, iters: u64, one: F) -> Duration
where
    F: Fn(u64) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    rt.block_on(rt.spawn(async move {
        let start = Instant::now();
        for i in 0..iters {
            one(i).await;
        }
        start.elapsed()
    }))
    .unwrap()
}

fn get() -> Request<Full<Bytes>> {
    Request::get("/v1/payments")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn layer(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rt = &runtime;
    let mut g = c.benchmark_group("layer");
    g.measurement_time(Duration::from_secs(5));
    let bare = service_fn(handler::<Full<Bytes>>);
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(service_fn(handler::<RequestBody<Full<Bytes>>>));

    g.bench_function("bare_handler_post", |b| {
        b.iter_custom(|iters| {
            on_worker(rt, iters, move |_| async move {
                let res = bare.oneshot(post("k")).await.unwrap();
                black_box(res.into_body().collect().await.unwrap());
            })
        })
    });
    g.bench_function("bare_handler_get", |b| {
        b.iter_custom(|iters| {
            on_worker(rt, iters, move |_| async move {
                let res = bare.oneshot(get()).await.unwrap();
                black_box(res.into_body().collect().await.unwrap());
            })
        })
    });
    g.bench_function("layer_passthrough_get", |b| {
        let svc = svc.clone();
        b.iter_custom(move |iters| {
            let svc = svc.clone();
            on_worker(rt, iters, move |_| {
                let svc = svc.clone();
                async move {
                    let res = svc.oneshot(get()).await.unwrap();
                    black_box(res.into_body().collect().await.unwrap());
                }
            })
        })
    });
    let next = std::sync::Arc::new(AtomicU64::new(0));
    g.bench_function("layer_new_key", |b| {
        let (svc, next) = (svc.clone(), next.clone());
        b.iter_custom(move |iters| {
            let (svc, next) = (svc.clone(), next.clone());
            on_worker(rt, iters, move |_| {
                let svc = svc.clone();
                let key = format!("k-{}", next.fetch_add(1, Ordering::Relaxed));
                async move {
                    let res = svc.oneshot(post(&key)).await.unwrap();
                    assert_eq!(res.status(), 201);
                    black_box(res.into_body().collect().await.unwrap());
                }
            })
        })
    });
    rt.block_on(svc.clone().oneshot(post("replayed"))).unwrap();
    g.bench_function("layer_replay", |b| {
        let svc = svc.clone();
        b.iter_custom(move |iters| {
            let svc = svc.clone();
            on_worker(rt, iters, move |_| {
                let svc = svc.clone();
                async move {
                    let res = svc.oneshot(post("replayed")).await.unwrap();
                    assert_eq!(res.headers()["idempotent-replayed"], "true");
                    black_box(res.into_body().collect().await.unwrap());
                }
            })
        })
    });
    g.finish();
}

/// A realistic order body of about 64 KiB: nested objects, strings, integers and decimals.
fn order_json() -> Vec<u8> {
    let items: Vec<String> = (0..600)
        .map(|i| {
            format!(
                r#"{{"sku":"SKU-{i:05}","name":"Item number {i} \u00e9\u00e8 \"quoted\"","qty":{},"unit_price":{}.{:02},"tags":["a","b","c"],"attrs":{{"z":{i},"a":true,"m":null}}}}"#,
                i % 7 + 1,
                i * 3 % 1000,
                i % 100
            )
        })
        .collect();
    format!(
        r#"{{"customer":"cus_123","currency":"EUR","items":[{}],"note":"deliver after 5pm"}}"#,
        items.join(",")
    )
    .into_bytes()
}

fn fingerprint(c: &mut Criterion) {
    let body = order_json();
    assert!(tower_idempotency::__bench::canonical_json(&body).is_some());
    let mut g = c.benchmark_group("fingerprint");
    g.throughput(Throughput::Bytes(body.len() as u64));
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("sha256_raw", |b| b.iter(|| Sha256::digest(&body)));
    g.bench_function("canonical_json", |b| {
        b.iter(|| tower_idempotency::__bench::canonical_json(&body))
    });
    g.bench_function("canonical_json_then_sha256", |b| {
        b.iter(|| Sha256::digest(tower_idempotency::__bench::canonical_json(&body).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, layer, fingerprint);
criterion_main!(benches);
