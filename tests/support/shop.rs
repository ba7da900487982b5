//! Shop processes (the `shop` example's binary) on free ports, and an HTTP client for them:
//! payments and the charge count. `cargo test --all-features` builds the binary; alone, run
//! `cargo build --example shop --all-features` first.
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
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let shop = Self { child, port };
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
    let req = Request::post(format!("http://127.0.0.1:{port}/v1/payments"))
        .header("content-type", "application/json")
        .header("x-api-key", api_key)
        .header("idempotency-key", key)
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
