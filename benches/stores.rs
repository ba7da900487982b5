//! Run with: `cargo bench --bench stores --all-features`
//!
//! Throughput through `IdempotencyLayer` per store, beside baselines measured in the same run:
//! the bare handler (no layer), and the raw backend commands a store's work corresponds to
//! (Redis: `SET NX PX` then `SET PX` for a new key, `GET` for a replay; Postgres: an
//! `INSERT … ON CONFLICT DO NOTHING` then an `UPDATE` for a new key, a `SELECT` for a replay).
//!
//! Redis and Postgres run when `IDEMPOTENCY_TEST_REDIS_URL` / `IDEMPOTENCY_TEST_POSTGRES_URL`
//! are set. `BENCH_CONCURRENCY` (default 32) requests are in flight; `BENCH_SECONDS` (default 3)
//! is the time per row.
#![allow(missing_docs)]

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::{IdempotencyStore, MemoryStore};
use tower_idempotency::{IdempotencyLayer, RequestBody};

const BODY: &str = r#"{"amount":1000,"currency":"EUR","customer":"cus_123"}"#;
const ANSWER: &[u8] = br#"{"id":"pay_1","amount":1000,"currency":"EUR","status":"succeeded"}"#;

fn env_num(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn handler<B>(_req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut res = Response::new(Full::new(Bytes::from_static(ANSWER)));
    *res.status_mut() = StatusCode::CREATED;
    res.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(res)
}

fn post(key: &str) -> Request<Full<Bytes>> {
    Request::post("/v1/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap()
}

/// Runs `op(i)` from `concurrency` tasks for `seconds`; returns operations per second.
async fn throughput<F, Fut>(op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let concurrency = env_num("BENCH_CONCURRENCY", 32);
    let seconds = env_num("BENCH_SECONDS", 3);
    let next = Arc::new(AtomicU64::new(0));
    // A short warm-up: connections, prepared statements, script cache.
    for _ in 0..concurrency {
        op(next.fetch_add(1, Ordering::Relaxed)).await;
    }
    let start = Instant::now();
    let until = start + Duration::from_secs(seconds);
    let done = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (op, next, done) = (op.clone(), next.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    op(next.fetch_add(1, Ordering::Relaxed)).await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

struct Table {
    rows: Vec<(String, f64)>,
}

impl Table {
    fn add(&mut self, name: &str, ops: f64) {
        eprintln!("  {name}: {ops:.0}/s");
        self.rows.push((name.to_owned(), ops));
    }

    fn get(&self, name: &str) -> f64 {
        self.rows
            .iter()
            .find(|(n, _)| n == name)
            .map_or(f64::NAN, |r| r.1)
    }

    fn print(&self) {
        let bare = self.get("bare handler");
        println!("| case | requests/s | vs bare handler | vs raw backend |");
        println!("|---|---:|---:|---:|");
        for (name, ops) in &self.rows {
            let raw = match name.as_str() {
                n if n.starts_with("redis layer new") => {
                    self.get("redis raw new (SET NX PX + SET PX)")
                }
                n if n.starts_with("redis layer replay") => self.get("redis raw replay (GET)"),
                n if n.starts_with("postgres layer new") => {
                    self.get("postgres raw new (INSERT + UPDATE)")
                }
                n if n.starts_with("postgres layer replay") => {
                    self.get("postgres raw replay (SELECT)")
                }
                _ => f64::NAN,
            };
            let raw = if raw.is_nan() {
                "".to_owned()
            } else {
                format!("{:.2}x", ops / raw)
            };
            println!("| {name} | {ops:.0} | {:.3}x | {raw} |", ops / bare);
        }
    }
}

async fn layer_rows(table: &mut Table, label: &str, store: Arc<dyn IdempotencyStore>) {
    let svc = IdempotencyLayer::from_arc(store)
        .unscoped()
        .layer(service_fn(handler::<RequestBody<Full<Bytes>>>));
    let run = format!(
        "{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    );
    let s = svc.clone();
    let r = run.clone();
    let new = throughput(move |i| {
        let (s, key) = (s.clone(), format!("bench-{r}-{i}"));
        async move {
            let res = s.oneshot(post(&key)).await.unwrap();
            assert_eq!(res.status(), 201);
            res.into_body().collect().await.unwrap();
        }
    })
    .await;
    table.add(&format!("{label} layer new key"), new);
    let key = format!("bench-{run}-replayed");
    svc.clone().oneshot(post(&key)).await.unwrap();
    let replay = throughput(move |_| {
        let (s, key) = (svc.clone(), key.clone());
        async move {
            let res = s.oneshot(post(&key)).await.unwrap();
            assert_eq!(res.headers()["idempotent-replayed"], "true");
            res.into_body().collect().await.unwrap();
        }
    })
    .await;
    table.add(&format!("{label} layer replay"), replay);
}

#[cfg(feature = "redis")]
async fn redis_rows(table: &mut Table, url: &str) {
    use tower_idempotency::store::redis::{redis, RedisStore};
    let store = RedisStore::connect(url).await.expect("connect to Redis");
    layer_rows(table, "redis", Arc::new(store)).await;

    let client = redis::Client::open(url).unwrap();
    let con = redis::aio::ConnectionManager::new(client).await.unwrap();
    let value = Bytes::from_static(ANSWER);
    let c = con.clone();
    let v = value.clone();
    let new = throughput(move |i| {
        let (mut c, v) = (c.clone(), v.clone());
        async move {
            let key = format!("bench-raw:{{{i}}}");
            let _: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(b"claim".as_slice())
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut c)
                .await
                .unwrap();
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(v.as_ref())
                .arg("PX")
                .arg(60_000)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    })
    .await;
    table.add("redis raw new (SET NX PX + SET PX)", new);
    let mut c = con.clone();
    let _: () = redis::cmd("SET")
        .arg("bench-raw:replayed")
        .arg(value.as_ref())
        .arg("PX")
        .arg(60_000)
        .query_async(&mut c)
        .await
        .unwrap();
    let replay = throughput(move |_| {
        let mut c = con.clone();
        async move {
            let v: Vec<u8> = redis::cmd("GET")
                .arg("bench-raw:replayed")
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(v.len(), ANSWER.len());
        }
    })
    .await;
    table.add("redis raw replay (GET)", replay);
}

#[cfg(feature = "postgres")]
async fn postgres_rows(table: &mut Table, url: &str) {
    use tower_idempotency::store::postgres::{deadpool_postgres, tokio_postgres, PostgresStore};
    let store = PostgresStore::builder()
        .with_table("tidem_bench_records")
        .unwrap()
        .connect(url)
        .await
        .expect("connect to Postgres");
    store.migrate().await.unwrap();
    layer_rows(table, "postgres", Arc::new(store)).await;

    // The raw statements, on a pool of the same size (16) with cached prepared statements.
    let config: tokio_postgres::Config = url.parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(16)
        .build()
        .unwrap();
    pool.get()
        .await
        .unwrap()
        .batch_execute(
            "DROP TABLE IF EXISTS tidem_bench_raw;
             CREATE TABLE tidem_bench_raw (id bytea PRIMARY KEY, state smallint NOT NULL,
               body bytea, locked_until timestamptz, expires_at timestamptz NOT NULL)",
        )
        .await
        .unwrap();
    let p = pool.clone();
    let new = throughput(move |i| {
        let p = p.clone();
        async move {
            let c = p.get().await.unwrap();
            let id = i.to_be_bytes().to_vec();
            let insert = c
                .prepare_cached(
                    "INSERT INTO tidem_bench_raw (id, state, locked_until, expires_at)
                     VALUES ($1, 0, now() + interval '30 s', now() + interval '1 day')
                     ON CONFLICT DO NOTHING",
                )
                .await
                .unwrap();
            c.execute(&insert, &[&id]).await.unwrap();
            let update = c
                .prepare_cached(
                    "UPDATE tidem_bench_raw SET state = 1, body = $2 WHERE id = $1 AND state = 0",
                )
                .await
                .unwrap();
            c.execute(&update, &[&id, &ANSWER]).await.unwrap();
        }
    })
    .await;
    table.add("postgres raw new (INSERT + UPDATE)", new);
    let replay = throughput(move |_| {
        let p = pool.clone();
        async move {
            let c = p.get().await.unwrap();
            let select = c
                .prepare_cached(
                    "SELECT state, body FROM tidem_bench_raw WHERE id = $1 AND expires_at > now()",
                )
                .await
                .unwrap();
            let id = 0u64.to_be_bytes().to_vec();
            let row = c.query_one(&select, &[&id]).await.unwrap();
            assert_eq!(row.get::<_, Vec<u8>>(1).len(), ANSWER.len());
        }
    })
    .await;
    table.add("postgres raw replay (SELECT)", replay);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; this harness takes no other arguments.
    let mut table = Table { rows: Vec::new() };
    eprintln!(
        "measuring (BENCH_CONCURRENCY={}, BENCH_SECONDS={} per row)",
        env_num("BENCH_CONCURRENCY", 32),
        env_num("BENCH_SECONDS", 3)
    );
    let bare = service_fn(handler::<Full<Bytes>>);
    let ops = throughput(move |_| async move {
        let res = bare.oneshot(post("k")).await.unwrap();
        res.into_body().collect().await.unwrap();
    })
    .await;
    table.add("bare handler", ops);
    layer_rows(&mut table, "memory", Arc::new(MemoryStore::new())).await;

    #[cfg(feature = "redis")]
    match std::env::var("IDEMPOTENCY_TEST_REDIS_URL") {
        Ok(url) => redis_rows(&mut table, &url).await,
        Err(_) => eprintln!("SKIPPED redis: IDEMPOTENCY_TEST_REDIS_URL is unset"),
    }
    #[cfg(not(feature = "redis"))]
    eprintln!("SKIPPED redis: built without the `redis` feature");

    #[cfg(feature = "postgres")]
    match std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL") {
        Ok(url) => postgres_rows(&mut table, &url).await,
        Err(_) => eprintln!("SKIPPED postgres: IDEMPOTENCY_TEST_POSTGRES_URL is unset"),
    }
    #[cfg(not(feature = "postgres"))]
    eprintln!("SKIPPED postgres: built without the `postgres` feature");

    table.print();
}
