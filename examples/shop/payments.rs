//! `POST /v1/payments` in phases, each ending in a recovery point, so that a takeover (a
//! client's retry after the holder died) or the recovery worker resumes where the dead
//! attempt got to instead of starting over:
//!
//! 1. **created**: the payment gets its `pay_` id; point `created` = the payment.
//! 2. **charged**: the card network is charged under a key derived from the record and the
//!    payment id, so a charge sent again by a resumed attempt is the same charge; point
//!    `charged` = the payment and its charge id.
//! 3. the answer, `201` with the payment, recorded by the layer (or by the worker). An
//!    answer that resumed says where from: `"resumed_from": "created"` or `"charged"`.
//!
//! The point's data is the payment as JSON (id, amount, currency, charge id): a shop with a
//! database would save only the id and read the row; this one keeps its payments nowhere else.
// main.rs uses all of it; the tests that include app.rs do not.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tower_idempotency::store::StoreError;
use tower_idempotency::{
    BoxError, IdempotencyContext, IdempotencyLayer, RecoveryHandle, RecoveryPoint, RecoveryWorker,
};

use super::card::{ChargeRequest, Charged};
use super::Shop;

/// The first phase's step name.
pub(crate) const CREATED: &str = "created";
/// The second phase's step name.
pub(crate) const CHARGED: &str = "charged";

/// The request header that stalls this request after a phase (as `SHOP_STALL_AFTER` does
/// for every request): `created` or `charged`.
pub(crate) const STALL_HEADER: &str = "shop-stall-after";

/// How long a stall lasts: until the process is killed, in practice.
const STALL: Duration = Duration::from_secs(3600);

/// The shop's test and demo hooks, from the environment ([`ShopOptions::from_env`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct ShopOptions {
    /// `CARD_NETWORK_URL`: charge the card network another shop process serves.
    pub(crate) card_network: Option<String>,
    /// `SHOP_STALL_AFTER`: every payment request stalls after saving this phase's point.
    pub(crate) stall_after: Option<String>,
    /// `SHOP_RECOVER_FAIL=1`: the recover function fails every time, before any step.
    pub(crate) recover_fail: bool,
}

impl ShopOptions {
    /// `CARD_NETWORK_URL`, `SHOP_STALL_AFTER` and `SHOP_RECOVER_FAIL`.
    pub(crate) fn from_env() -> Result<Self, BoxError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let card_network = var("CARD_NETWORK_URL");
        if let Some(url) = &card_network {
            if !url.starts_with("http://") {
                return Err(format!("CARD_NETWORK_URL={url:?}: expected http://host:port").into());
            }
        }
        let stall_after = var("SHOP_STALL_AFTER");
        if let Some(step) = &stall_after {
            check_phase(step).map_err(|e| format!("SHOP_STALL_AFTER={step:?}: {e}"))?;
        }
        let recover_fail = match var("SHOP_RECOVER_FAIL").as_deref() {
            None | Some("0" | "false") => false,
            Some("1" | "true") => true,
            Some(other) => {
                return Err(format!("SHOP_RECOVER_FAIL={other:?}: expected 1 or 0").into())
            }
        };
        Ok(Self {
            card_network,
            stall_after,
            recover_fail,
        })
    }
}

pub(crate) fn check_phase(step: &str) -> Result<(), &'static str> {
    match step {
        CREATED | CHARGED => Ok(()),
        _ => Err("expected created or charged"),
    }
}

/// The recovery worker's settings: `IDEMPOTENCY_RECOVERY_INTERVAL_MS` (`0`: off; unset: 1000
/// on Redis and Postgres, off on the memory store, which a restart empties anyway) and
/// `IDEMPOTENCY_RECOVERY_MAX_ATTEMPTS` (default 5). `None`: no worker.
pub(crate) fn recovery_from_env(store: &str) -> Result<Option<(Duration, NonZeroU64)>, BoxError> {
    let num = |name: &str| -> Result<Option<u64>, BoxError> {
        match std::env::var(name) {
            Ok(v) if !v.is_empty() => v
                .parse()
                .map(Some)
                .map_err(|e| format!("{name}={v:?}: {e}").into()),
            _ => Ok(None),
        }
    };
    let durable = matches!(store, "redis" | "postgres");
    let interval = match num("IDEMPOTENCY_RECOVERY_INTERVAL_MS")? {
        Some(0) => return Ok(None),
        Some(ms) => Duration::from_millis(ms),
        None if durable => Duration::from_millis(1000),
        None => return Ok(None),
    };
    let max = num("IDEMPOTENCY_RECOVERY_MAX_ATTEMPTS")?.unwrap_or(5);
    let max = NonZeroU64::new(max).ok_or("IDEMPOTENCY_RECOVERY_MAX_ATTEMPTS must be at least 1")?;
    Ok(Some((interval, max)))
}

/// A payment as far as it got: the data of its recovery points.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Progress {
    pub(crate) payment: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) charge: Option<String>,
}

/// Where a run starts.
#[derive(Debug)]
pub(crate) enum Start {
    /// A first attempt (or a takeover of one that saved no point).
    New { amount: i64, currency: String },
    /// From the point the attempts before saved last.
    Resume { step: String, progress: Progress },
}

impl Start {
    /// The run that resumes from `point`.
    pub(crate) fn from_point(point: &RecoveryPoint) -> Result<Self, String> {
        let progress: Progress = serde_json::from_slice(point.data())
            .map_err(|e| format!("the recovery point is not a shop payment: {e}"))?;
        match (point.step(), &progress.charge) {
            (CREATED, _) | (CHARGED, Some(_)) => Ok(Self::Resume {
                step: point.step().to_owned(),
                progress,
            }),
            (step, _) => Err(format!(
                "the recovery point's step {step:?} is not the shop's"
            )),
        }
    }
}

/// How a run ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// Created and charged. `fenced`: the `charged` point was refused because another
    /// attempt took the key over meanwhile; that attempt resumes from `created` with the
    /// same payment id and card-network key, so its charge is this one.
    Paid {
        progress: Progress,
        resumed_from: Option<String>,
        fenced: bool,
    },
    /// The card was declined (recorded: a retry gets the same 402).
    Declined { payment: String },
    /// The network said it is down, or could not be reached: nothing is known to be charged.
    Unavailable {
        payment: String,
        detail: Option<String>,
    },
    /// The `created` point was fenced: another attempt holds the key and runs the payment.
    Fenced,
    /// The `created` point could not be saved (store down): nothing was charged.
    StoreFailed(String),
}

impl Ended {
    /// The answer's status and JSON body, as the handler and the worker send it.
    pub(crate) fn answer(&self) -> (StatusCode, Value) {
        match self {
            Ended::Paid {
                progress,
                resumed_from,
                ..
            } => {
                let mut body = json!({
                    "id": progress.payment,
                    "amount": progress.amount,
                    "currency": progress.currency,
                    "status": "succeeded",
                });
                if let Some(step) = resumed_from {
                    body["resumed_from"] = step.as_str().into();
                }
                (StatusCode::CREATED, body)
            }
            Ended::Declined { payment } => (
                StatusCode::PAYMENT_REQUIRED,
                json!({"error": "card_declined", "payment": payment}),
            ),
            Ended::Unavailable { payment, detail } => {
                let mut body = json!({"error": "card_network_unavailable", "payment": payment});
                if let Some(d) = detail {
                    body["detail"] = d.as_str().into();
                }
                (StatusCode::SERVICE_UNAVAILABLE, body)
            }
            Ended::Fenced => (
                StatusCode::CONFLICT,
                json!({
                    "type": "about:blank",
                    "title": "Conflict",
                    "status": 409,
                    "detail": "another attempt took this payment over; retry to get its answer",
                }),
            ),
            Ended::StoreFailed(detail) => (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({
                    "type": "about:blank",
                    "title": "Service Unavailable",
                    "status": 503,
                    "detail": format!("the payment could not be started: {detail}"),
                }),
            ),
        }
    }
}

/// The card network's key for `payment`: the same on every attempt that resumes it, and
/// unique to this record (payment ids are per process).
fn charge_key(ctx: Option<&IdempotencyContext>, payment: &str) -> String {
    let name = format!("card-network:{payment}");
    match ctx {
        Some(ctx) => ctx.derive(&name),
        None => name,
    }
}

async fn save(ctx: &IdempotencyContext, step: &str, p: &Progress) -> Result<(), StoreError> {
    let data = serde_json::to_vec(p).expect("a payment serialises");
    ctx.save_recovery_point(step, data).await
}

/// Stalls (for an hour: until the process is killed) when `wanted` names the phase just
/// saved.
async fn stall_at(shop: &Shop, wanted: Option<&str>, reached: &str) {
    if wanted == Some(reached) {
        shop.stats().stalled += 1;
        tracing::info!(
            phase = reached,
            "payment stalled after its phase (test hook)"
        );
        tokio::time::sleep(STALL).await;
    }
}

/// Runs the phases from `start`: the handler's and the worker's code. `stall` is the test
/// hook (requests only).
pub(crate) async fn run(
    shop: &Shop,
    ctx: Option<&IdempotencyContext>,
    start: Start,
    stall: Option<&str>,
) -> Ended {
    let (mut progress, resumed_from) = match start {
        Start::New { amount, currency } => {
            let n = shop.payments.fetch_add(1, Ordering::SeqCst) + 1;
            let progress = Progress {
                payment: format!("pay_{n}"),
                amount,
                currency,
                charge: None,
            };
            if let Some(ctx) = ctx {
                match save(ctx, CREATED, &progress).await {
                    Ok(()) => {}
                    Err(e) if e.is_fenced() => return Ended::Fenced,
                    // Nothing is charged yet: the layer releases the 503 and a retry starts
                    // over.
                    Err(e) => return Ended::StoreFailed(e.to_string()),
                }
            }
            stall_at(shop, stall, CREATED).await;
            (progress, None)
        }
        Start::Resume { step, progress } => (progress, Some(step)),
    };
    let mut fenced = false;
    if progress.charge.is_none() {
        let req = ChargeRequest {
            key: charge_key(ctx, &progress.payment),
            payment: progress.payment.clone(),
            amount: progress.amount,
            currency: progress.currency.clone(),
        };
        match shop.charge(&req).await {
            Charged::Charge { id, replayed } => {
                tracing::debug!(payment = %progress.payment, charge = %id, replayed, "card charged");
                progress.charge = Some(id);
            }
            Charged::Declined => {
                return Ended::Declined {
                    payment: progress.payment,
                }
            }
            Charged::Unavailable => {
                return Ended::Unavailable {
                    payment: progress.payment,
                    detail: None,
                }
            }
            Charged::Unknown(detail) => {
                return Ended::Unavailable {
                    payment: progress.payment,
                    detail: Some(detail),
                }
            }
        }
        if let Some(ctx) = ctx {
            match save(ctx, CHARGED, &progress).await {
                Ok(()) => stall_at(shop, stall, CHARGED).await,
                Err(e) if e.is_fenced() => {
                    tracing::warn!(payment = %progress.payment, "the charged point was fenced: another attempt took the payment over; it charges under the same key, so this charge is its charge");
                    fenced = true;
                }
                // A takeover would resume from `created` and charge under the same key:
                // the same charge. So the answer goes on.
                Err(e) => {
                    tracing::warn!(payment = %progress.payment, error = %e, "the charged point could not be saved; the payment goes on")
                }
            }
        }
    }
    Ended::Paid {
        progress,
        resumed_from,
        fenced,
    }
}

/// What the shop's `GET /v1/debug/stats` shows of its resumable payments.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Stats {
    /// Requests stalled by the hook.
    pub(crate) stalled: u64,
    /// Requests (takeovers) that resumed, by the step they resumed from.
    pub(crate) resumed: BTreeMap<String, u64>,
    /// Each run of the recover function in this process.
    pub(crate) recoveries: Vec<RecoveryRun>,
}

/// One run of the recover function.
#[derive(Debug, Serialize)]
pub(crate) struct RecoveryRun {
    pub(crate) record: String,
    pub(crate) generation: u64,
    pub(crate) from: String,
    pub(crate) payment: Option<String>,
    /// `answered` (the worker records the answer), `fenced` or `failed`.
    pub(crate) result: &'static str,
}

/// The recover function: the phases from the record's point, for the worker.
async fn recover(
    shop: Arc<Shop>,
    ctx: IdempotencyContext,
) -> Result<http::Response<Bytes>, BoxError> {
    let point = ctx
        .recovery_point()
        .ok_or("the worker ran a record without a recovery point")?;
    let mut run_log = RecoveryRun {
        record: ctx.record_id().to_hex(),
        generation: ctx.generation(),
        from: point.step().to_owned(),
        payment: None,
        result: "failed",
    };
    let start = match Start::from_point(point) {
        Ok(start) => start,
        Err(e) => {
            shop.stats().recoveries.push(run_log);
            return Err(e.into());
        }
    };
    if let Start::Resume { progress, .. } = &start {
        run_log.payment = Some(progress.payment.clone());
    }
    if shop.options.recover_fail {
        shop.stats().recoveries.push(run_log);
        return Err("SHOP_RECOVER_FAIL is set: the recovery fails on purpose".into());
    }
    let ended = run(&shop, Some(&ctx), start, None).await;
    let (status, body) = ended.answer();
    let result: Result<http::Response<Bytes>, BoxError> = match &ended {
        Ended::Paid { fenced: false, .. } | Ended::Declined { .. } => {
            run_log.result = "answered";
            Ok(http::Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Bytes::from(body.to_string()))?)
        }
        Ended::Paid { fenced: true, .. } | Ended::Fenced => {
            run_log.result = "fenced";
            Err("another attempt took the record over".into())
        }
        // Not an answer to record: the claim lapses with its point, and the next sweep
        // (or the client's retry) resumes again.
        Ended::Unavailable { .. } | Ended::StoreFailed(_) => {
            Err(format!("{status}: {body}").into())
        }
    };
    if result.is_ok() {
        tracing::info!(record = %run_log.record, generation = run_log.generation, from = %run_log.from, payment = ?run_log.payment, status = status.as_u16(), "payment resumed by the recovery worker");
    }
    shop.stats().recoveries.push(run_log);
    result
}

/// Spawns the recovery worker over `layer`'s store, sweeping every `interval`.
pub(crate) fn spawn_recovery(
    layer: &IdempotencyLayer,
    shop: Arc<Shop>,
    interval: Duration,
    max_attempts: NonZeroU64,
) -> RecoveryHandle {
    RecoveryWorker::new(layer, move |ctx| recover(shop.clone(), ctx))
        .with_interval(interval)
        .with_max_attempts(max_attempts)
        .spawn()
}
