//! The examples' shop as an application sees it, and what operators read: the README
//! walk-through, the admin routes, `GET /metrics`, the store selection from the environment,
//! the layer's metrics, operations hooks and tracing; and the Redis Streams consumer
//! (`examples/consumer`) as processes, one of them killed mid-payment.
//!
//! `tracing` is here and not in `tests/layer`: the layer warns about a recorded Set-Cookie once
//! per process, `tracing` checks that, and `tests/layer/layer.rs` records such an answer.

#[path = "../support/mod.rs"]
mod support;

// The example's own files, included once for every test here.
// `metrics_router` is the shop_operations test's, which needs the `metrics` and `axum` features.
#[allow(dead_code)]
#[path = "../../examples/shop/admin.rs"]
mod admin;
#[path = "../../examples/shop/app.rs"]
mod app;
#[path = "../../examples/common/mod.rs"]
mod example_env;

#[cfg(all(feature = "redis", feature = "postgres"))]
mod consumer;
mod example_stores;
#[cfg(all(feature = "metrics", feature = "axum"))]
mod operations;
mod shop;
mod shop_admin;
#[cfg(feature = "utoipa")]
mod shop_openapi;
#[cfg(all(feature = "metrics", feature = "axum"))]
mod shop_operations;
mod tracing;
mod webhooks;
