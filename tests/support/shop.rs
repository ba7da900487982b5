//! Shop processes (the `shop` example's binary) on free ports, and an HTTP client for them:
//! payments, the charge count, the shop's debug stats, its card network's ledger and its admin
//! routes. `cargo test --all-features` builds the binary; alone, run
//! `cargo build --example shop --all-features` first.
//!
//! The shop's recovery worker is off in the shops started here unless the test's `env` turns
//! it on (`IDEMPOTENCY_RECOVERY_INTERVAL_MS`): a worker sweeps the whole store, and would
//! finish other tests' abandoned keys before their own retries do.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use super::load::run_id;
use super::storm;

pub type Http = Client<HttpConnector, Full<Bytes>>;
pub type Answer = (StatusCode, bool, Bytes);

/// One shop process on a free port.
pub struct Shop {
    child: Child,
    pub port: u16,
    /// Where its output goes, when captured ([`Shop::start_logged`]).
    log: Option<PathBuf>,
}

impl Shop {
    fn binary() -> PathBuf {
        let exe = std::env::current_exe().unwrap();
        let debug = exe.parent().unwrap().parent().unwrap();
        let bin = debug.join("examples").join("shop");
        assert!(
            bin.exists(),
            "{} is missing: run `cargo build --example shop --all-features`",
            bin.display()
        );
        bin
    }

    pub async fn start(store: &str, lease_ms: u64, card_latency_ms: u64) -> Self {
        Self::start_with(store, lease_ms, card_latency_ms, &[]).await
    }

    /// [`start`](Self::start) with more environment variables.
    pub async fn start_with(
        store: &str,
        lease_ms: u64,
        card_latency_ms: u64,
        env: &[(&str, &str)],
    ) -> Self {
        Self::spawn(store, lease_ms, card_latency_ms, env, None).await
    }

    /// [`start_with`](Self::start_with), its output (the log, `RUST_LOG=error` unless `env`
    /// sets it) kept in a file that [`log`](Self::log) reads.
    pub async fn start_logged(
        store: &str,
        lease_ms: u64,
        card_latency_ms: u64,
        env: &[(&str, &str)],
    ) -> Self {
        let path = std::env::temp_dir().join(format!("{}.log", run_id("shop")));
        Self::spawn(store, lease_ms, card_latency_ms, env, Some(path)).await
    }

    /// What a [`start_logged`](Self::start_logged) shop wrote so far.
    pub fn log(&self) -> String {
        let path = self.log.as_ref().expect("a shop started with start_logged");
        std::fs::read_to_string(path).unwrap_or_default()
    }

    async fn spawn(
        store: &str,
        lease_ms: u64,
        card_latency_ms: u64,
        env: &[(&str, &str)],
        log: Option<PathBuf>,
    ) -> Self {
        // The shop logs to stdout (tracing-subscriber's default) and fails on stderr.
        let (stdout, stderr) = match &log {
            Some(path) => {
                let file = std::fs::File::create(path).unwrap();
                (Stdio::from(file.try_clone().unwrap()), Stdio::from(file))
            }
            None => (Stdio::null(), Stdio::inherit()),
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(Self::binary())
            .env("SHOP_ADDR", format!("127.0.0.1:{port}"))
            .env("IDEMPOTENCY_STORE", store)
            .env("IDEMPOTENCY_LEASE_MS", lease_ms.to_string())
            .env("CARD_LATENCY_MS", card_latency_ms.to_string())
            .env("RUST_LOG", "error")
            .env("IDEMPOTENCY_RECOVERY_INTERVAL_MS", "0")
            .envs(env.iter().copied())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap();
        let shop = Self { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the shop on {port} never listened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shop
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    pub fn sigkill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(path) = &self.log {
            let _ = std::fs::remove_file(path);
        }
    }
}

pub fn client() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A payment on `port`; `Err` when the connection dies without an answer.
pub async fn pay(
    http: &Http,
    port: u16,
    api_key: &str,
    key: &str,
    amount: u64,
) -> Result<Answer, String> {
    pay_with(http, port, api_key, key, amount, &[]).await
}

/// [`pay`] with more request headers (the shop's `Shop-Stall-After` hook, say).
pub async fn pay_with(
    http: &Http,
    port: u16,
    api_key: &str,
    key: &str,
    amount: u64,
    headers: &[(&str, &str)],
) -> Result<Answer, String> {
    let mut req = Request::post(format!("http://127.0.0.1:{port}/v1/payments"))
        .header("content-type", "application/json")
        .header("x-api-key", api_key)
        .header("idempotency-key", key);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .body(Full::new(Bytes::from(format!(
            "{{\"amount\":{amount},\"currency\":\"EUR\"}}"
        ))))
        .unwrap();
    let res = http.request(req).await.map_err(|e| e.to_string())?;
    let status = res.status();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    let body = res.into_body().collect().await.map_err(|e| e.to_string())?;
    Ok((status, replayed, body.to_bytes()))
}

/// `GET path` on `port` with `headers`: the status and the JSON body (`Null` if none).
pub async fn get_json(
    http: &Http,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, serde_json::Value) {
    let mut req = Request::get(format!("http://127.0.0.1:{port}{path}"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let res = http
        .request(req.body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    (status, v)
}

/// The shop's `GET /v1/debug/stats`: payments created, charges, stalls, resumes, recoveries.
pub async fn stats(http: &Http, port: u16) -> serde_json::Value {
    get_json(http, port, "/v1/debug/stats", &[]).await.1
}

/// The ledger of the card network the shop on `port` serves (`GET /card-network/charges`).
pub async fn ledger(http: &Http, port: u16) -> serde_json::Value {
    get_json(http, port, "/card-network/charges", &[]).await.1
}

/// The admin view of `key` in `scope` on a shop started with `ADMIN_TOKEN=token`; `None` if
/// it has no live record.
pub async fn record(
    http: &Http,
    port: u16,
    token: &str,
    scope: &str,
    key: &str,
) -> Option<serde_json::Value> {
    let auth = format!("Bearer {token}");
    let path = format!("/admin/idempotency/{scope}/{key}");
    match get_json(http, port, &path, &[("authorization", &auth)]).await {
        (StatusCode::OK, v) => Some(v),
        (StatusCode::NOT_FOUND, _) => None,
        (status, v) => panic!("GET {path}: {status} {v}"),
    }
}

pub async fn charges(http: &Http, port: u16) -> u64 {
    let req = Request::get(format!("http://127.0.0.1:{port}/v1/charges"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let body = http.request(req).await.unwrap().into_body().collect().await;
    let v: serde_json::Value = serde_json::from_slice(&body.unwrap().to_bytes()).unwrap();
    v["count"].as_u64().unwrap()
}

/// Shop processes on one store, as a storm's target; with two, a key's two clients are on
/// different processes.
pub struct Shops {
    shops: Vec<Shop>,
    http: Http,
    api_key: String,
}

impl Shops {
    /// `processes` shops on `store` (card latency 5 ms), with `env` set in each.
    pub async fn start(processes: usize, store: &str, lease_ms: u64, env: &[(&str, &str)]) -> Self {
        let mut shops = Vec::new();
        for _ in 0..processes {
            shops.push(Shop::start_with(store, lease_ms, 5, env).await);
        }
        Shops {
            shops,
            http: client(),
            api_key: run_id("storm-shops"),
        }
    }
}

impl storm::Target for Shops {
    async fn send(&self, key: &str, client: usize) -> Option<Answer> {
        let port = self.shops[client % self.shops.len()].port;
        pay(&self.http, port, &self.api_key, key, 1250).await.ok()
    }

    async fn executions(&self) -> u64 {
        let mut total = 0;
        for s in &self.shops {
            total += charges(&self.http, s.port).await;
        }
        total
    }

    /// The shops log the keys the hook names; the tests do not read their logs.
    fn reran(&self, _: &[String]) -> Option<(u64, u64)> {
        None
    }
}
