//! Faults and reliability: the layer under store faults (paused time), a TCP proxy between the
//! stores and their servers, and duplicate storms in one process and over two shop processes.
//! `cargo test --all-features` builds the shop example that `processes` runs; alone, run
//! `cargo build --example shop --all-features` first.
//!
//! The soak is a binary of its own (`tests/soak.rs`), so the RSS it samples is its own.

#[path = "../support/mod.rs"]
mod support;

mod faults;
mod histories;
#[cfg(all(feature = "redis", feature = "postgres"))]
mod processes;
#[cfg(all(feature = "redis", feature = "postgres"))]
mod recovery;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod store_faults;
mod storms;
