//! The shop's simulated card network: charges keyed by an idempotency key of their own, so a
//! charge sent twice (by a takeover, or by the recovery worker resuming a payment) is made
//! once and answered with the same charge id.
//!
//! Each shop process simulates one in memory, and serves it at `POST /card-network/charges`
//! and `GET /card-network/charges` (its ledger). With `CARD_NETWORK_URL=http://host:port` a
//! shop charges the network another shop process serves instead of its own: one network
//! for several shops, which outlives a shop killed mid-charge (the tests and the README's
//! kill -9 demo use it).
// main.rs uses all of it; the tests that include app.rs do not.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;

/// One charge request. `key` is the caller's idempotency key at the network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChargeRequest {
    pub(crate) key: String,
    pub(crate) payment: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
}

/// What the network answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Charged {
    /// Charged: now, or earlier under the same key (`replayed`).
    Charge { id: String, replayed: bool },
    /// Amount 402: the card is declined; nothing is charged.
    Declined,
    /// Amount 503: the network is down; nothing is charged.
    Unavailable,
    /// No answer (a remote network out of reach), or the key was sent before with another
    /// payment: the charge may or may not have been made.
    Unknown(String),
}

#[derive(Debug, Clone, Serialize)]
struct Charge {
    id: String,
    key: String,
    payment: String,
    amount: i64,
    currency: String,
    /// Requests that came with this key: 1 + the duplicates the key deduplicated.
    requests: u64,
}

/// The charges one simulated network made, by key.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    charges: Vec<Charge>,
    by_key: HashMap<String, usize>,
}

impl Ledger {
    /// Real charges made (each key counts once).
    pub(crate) fn count(&self) -> u64 {
        self.lock().charges.len() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Charges `req`. A new charge is booked at once and answered after `latency` (a kill
    /// during that wait leaves the charge made, as a real network would); a key seen before
    /// is answered at once with its charge.
    pub(crate) async fn charge(&self, req: &ChargeRequest, latency: Duration) -> Charged {
        let outcome = match req.amount {
            402 => Charged::Declined,
            503 => Charged::Unavailable,
            _ => {
                let mut inner = self.lock();
                if let Some(&i) = inner.by_key.get(&req.key) {
                    let c = &mut inner.charges[i];
                    c.requests += 1;
                    if (&c.payment, c.amount, &c.currency)
                        != (&req.payment, req.amount, &req.currency)
                    {
                        return Charged::Unknown(
                            "the card network refused the charge: its key was used for another payment"
                                .to_owned(),
                        );
                    }
                    return Charged::Charge {
                        id: c.id.clone(),
                        replayed: true,
                    };
                }
                let id = format!("ch_{}", inner.charges.len() + 1);
                let i = inner.charges.len();
                inner.charges.push(Charge {
                    id: id.clone(),
                    key: req.key.clone(),
                    payment: req.payment.clone(),
                    amount: req.amount,
                    currency: req.currency.clone(),
                    requests: 1,
                });
                inner.by_key.insert(req.key.clone(), i);
                Charged::Charge {
                    id,
                    replayed: false,
                }
            }
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        outcome
    }
}

/// A card network another shop process serves (`CARD_NETWORK_URL`).
#[derive(Debug, Clone)]
pub(crate) struct Remote {
    base: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

#[derive(Serialize, Deserialize)]
struct RemoteRequest {
    #[serde(flatten)]
    charge: ChargeRequest,
    /// How long the network waits before answering a new charge: the calling shop's
    /// `CARD_LATENCY_MS`, so each shop keeps its own slow-charge knob.
    #[serde(default)]
    latency_ms: u64,
}

impl Remote {
    pub(crate) fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// Sends the charge; a lost answer is sent again (the key makes that safe), up to three
    /// times in all.
    pub(crate) async fn charge(&self, req: &ChargeRequest, latency: Duration) -> Charged {
        let body = serde_json::to_vec(&RemoteRequest {
            charge: req.clone(),
            latency_ms: latency.as_millis() as u64,
        })
        .expect("a charge request serialises");
        let mut last = String::new();
        for attempt in 0..3 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            match tokio::time::timeout(latency + Duration::from_secs(5), self.send(&body)).await {
                Ok(Ok(charged)) => return charged,
                Ok(Err(e)) => last = e,
                Err(_) => last = "the card network did not answer in time".to_owned(),
            }
        }
        Charged::Unknown(last)
    }

    async fn send(&self, body: &[u8]) -> Result<Charged, String> {
        let req = http::Request::post(format!("{}/card-network/charges", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .map_err(|e| e.to_string())?;
        let res = self.http.request(req).await.map_err(|e| e.to_string())?;
        let status = res.status();
        let body = res
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        match status {
            StatusCode::CREATED | StatusCode::OK => {
                let v: serde_json::Value =
                    serde_json::from_slice(&body).map_err(|e| e.to_string())?;
                match v["id"].as_str() {
                    Some(id) => Ok(Charged::Charge {
                        id: id.to_owned(),
                        replayed: v["replayed"].as_bool().unwrap_or(false),
                    }),
                    None => Err(format!("the card network answered {status} without an id")),
                }
            }
            StatusCode::PAYMENT_REQUIRED => Ok(Charged::Declined),
            StatusCode::SERVICE_UNAVAILABLE => Ok(Charged::Unavailable),
            other => Ok(Charged::Unknown(format!(
                "the card network answered {other}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }
}

/// `POST /card-network/charges` and `GET /card-network/charges`: this process's network, for
/// shops started with `CARD_NETWORK_URL` pointing here. Outside the idempotency layer: the
/// network dedupes by the key in the body.
pub(crate) fn router(ledger: Arc<Ledger>) -> Router {
    Router::new()
        .route("/card-network/charges", post(charge).get(list))
        .with_state(ledger)
}

async fn charge(State(ledger): State<Arc<Ledger>>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<RemoteRequest>(&body) else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "body must be {\"key\", \"payment\", \"amount\", \"currency\"}"})),
        )
            .into_response();
    };
    match ledger
        .charge(&req.charge, Duration::from_millis(req.latency_ms))
        .await
    {
        Charged::Charge { id, replayed } => (
            StatusCode::CREATED,
            Json(json!({"id": id, "replayed": replayed})),
        )
            .into_response(),
        Charged::Declined => (
            StatusCode::PAYMENT_REQUIRED,
            Json(json!({"error": "card_declined"})),
        )
            .into_response(),
        Charged::Unavailable => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "card_network_unavailable"})),
        )
            .into_response(),
        Charged::Unknown(detail) => {
            (StatusCode::CONFLICT, Json(json!({"error": detail}))).into_response()
        }
    }
}

/// The ledger: every charge with its key, payment and how many requests its key got.
async fn list(State(ledger): State<Arc<Ledger>>) -> Response {
    let inner = ledger.lock();
    Json(json!({"count": inner.charges.len(), "charges": inner.charges})).into_response()
}
