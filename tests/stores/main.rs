//! The stores: the conformance suite on each, the Redis and Postgres specifics, the layer over
//! Redis and Postgres, and TLS to both. Tests against a server read its URL from the
//! environment and skip when it is unset (see `support::backend`).
//!
//! The Postgres restart test is a binary of its own (`tests/postgres_restart.rs`): restarting
//! the server would break the sessions of the Postgres tests here.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "conformance")]
mod conformance_rejects;
#[cfg(feature = "conformance")]
mod memory_store;
mod operations;
mod operations_errors;
#[cfg(feature = "postgres")]
mod operations_postgres;
#[cfg(feature = "postgres")]
mod postgres_layer;
#[cfg(all(feature = "conformance", feature = "postgres"))]
mod postgres_store;
#[cfg(feature = "postgres")]
mod postgres_teardown;
#[cfg(feature = "postgres")]
mod postgres_transaction;
mod recovery;
#[cfg(all(feature = "conformance", feature = "redis"))]
mod redis_cluster;
#[cfg(feature = "redis")]
mod redis_layer;
#[cfg(all(feature = "conformance", feature = "redis"))]
mod redis_store;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod stored_bytes;
#[cfg(all(feature = "redis-tls", feature = "postgres-tls"))]
mod tls;
