//! The layer through its front doors: a plain tower `service_fn`, axum, tonic, the
//! fingerprint, `Vary` and rejected input, on the memory store; the local tier on every store.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "axum")]
mod axum;
mod bad_input;
mod fingerprint;
mod grpc;
mod key_sources;
mod layer;
mod local_tier;
mod no_runtime;
mod panics;
mod recovery_faults;
mod vary;
