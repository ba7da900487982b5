//! The shop's operator routes: `GET /metrics` (feature `metrics`) and the idempotency admin
//! API behind its own bearer token. A record in progress that saved a recovery point shows it
//! (`recovery_point`: step, generation of the attempt that saved it, data).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tower_idempotency::store::RecordId;
use tower_idempotency::store::{AdminStore, RecordInfo, RecordStatus, Removal, StoreError};

#[derive(Clone)]
struct Admin {
    store: Arc<dyn AdminStore>,
    token: Arc<str>,
}

/// `GET` and `DELETE /admin/idempotency/{scope}/{key}`, for requests that carry
/// `Authorization: Bearer <token>`. The scope is the shop's (`anonymous`, or
/// `api-key:<key>`). Mount it only when a token is configured.
pub(crate) fn admin_router(store: Arc<dyn AdminStore>, token: String) -> Router {
    let state = Admin {
        store,
        token: token.into(),
    };
    Router::new()
        .route(
            "/admin/idempotency/{scope}/{key}",
            get(inspect).delete(remove),
        )
        .with_state(state)
}

/// Adds the admin routes when `token` is set (non-empty); without one they do not exist.
pub(crate) fn mount_admin(
    router: Router,
    store: Arc<dyn AdminStore>,
    token: Option<String>,
) -> Router {
    match token.filter(|t| !t.is_empty()) {
        Some(token) => router.merge(admin_router(store, token)),
        None => {
            tracing::info!("ADMIN_TOKEN unset: admin routes not mounted");
            router
        }
    }
}

/// `GET /metrics`: the Prometheus text format of every metric recorded in this process.
#[cfg(feature = "metrics")]
pub(crate) fn metrics_router(handle: metrics_exporter_prometheus::PrometheusHandle) -> Router {
    Router::new().route("/metrics", get(move || async move { handle.render() }))
}

/// Compares in time independent of where the first difference is.
fn authorized(headers: &HeaderMap, token: &str) -> bool {
    let Some(sent) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (sent.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = json!({"type": "about:blank", "status": status.as_u16(), "detail": detail});
    let mut res = (status, body.to_string()).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/problem+json".parse().unwrap(),
    );
    res
}

fn unauthorized() -> Response {
    let mut res = problem(
        StatusCode::UNAUTHORIZED,
        "a valid admin bearer token is required",
    );
    res.headers_mut()
        .insert(header::WWW_AUTHENTICATE, "Bearer".parse().unwrap());
    res
}

/// The error's kind only: the key is never logged, and the record id is enough to find it.
fn store_failed(id: &RecordId, e: &StoreError) -> Response {
    tracing::error!(record = %id.to_hex(), kind = ?e.kind(), error = %e, "admin: idempotency store call failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "the idempotency store failed",
    )
}

fn view(info: &RecordInfo) -> serde_json::Value {
    let state = match info.status {
        RecordStatus::InProgress => "in_progress",
        RecordStatus::Completed => "completed",
        RecordStatus::Tombstone => "tombstone",
    };
    let mut body = json!({
        "state": state,
        "generation": info.generation,
        "lease_remaining_ms": info.lease_remaining.map(|d| d.as_millis() as u64),
        "expires_in_secs": info.expires_in.as_secs(),
        "answer_status": info.answer_status.map(|s| s.as_u16()),
        "answer_size": info.answer_size,
    });
    // In progress with a recovery point: where its attempts got to. The data is the shop's
    // own (the payment's ids, see payments.rs), shown only to the operator.
    if let Some(point) = &info.recovery_point {
        body["recovery_point"] = json!({
            "step": point.step(),
            "generation": point.generation(),
            "data": std::str::from_utf8(point.data()).ok(),
        });
    }
    body
}

async fn inspect(
    State(admin): State<Admin>,
    Path((scope, key)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&headers, &admin.token) {
        return unauthorized();
    }
    let id = RecordId::new(Some(&scope), &key);
    match admin.store.inspect(&id).await {
        Ok(Some(info)) => {
            let mut body = view(&info);
            body["record"] = id.to_hex().into();
            Json(body).into_response()
        }
        Ok(None) => problem(StatusCode::NOT_FOUND, "no live record for this key"),
        Err(e) => store_failed(&id, &e),
    }
}

#[derive(Deserialize)]
struct Force {
    #[serde(default)]
    force: bool,
}

/// Deletes a completed record. A record in progress is only released with `?force=true`:
/// its holder may still be running, and the next retry runs the work again.
async fn remove(
    State(admin): State<Admin>,
    Path((scope, key)): Path<(String, String)>,
    Query(Force { force }): Query<Force>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&headers, &admin.token) {
        return unauthorized();
    }
    let id = RecordId::new(Some(&scope), &key);
    let removed = match admin.store.delete(&id).await {
        Ok(Removal::Refused) if force => admin.store.force_release(&id).await,
        other => other,
    };
    match removed {
        Ok(Removal::Removed) => {
            tracing::warn!(record = %id.to_hex(), force, "admin: idempotency record removed");
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Removal::Absent) => problem(StatusCode::NOT_FOUND, "no live record for this key"),
        Ok(Removal::Refused) if force => problem(
            StatusCode::CONFLICT,
            "the record changed state while being removed; look again",
        ),
        Ok(Removal::Refused) => problem(
            StatusCode::CONFLICT,
            "the key is in progress; add ?force=true to release it (the next retry runs the work again)",
        ),
        Err(e) => store_failed(&id, &e),
    }
}
