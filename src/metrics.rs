//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`). Without
//! the feature every call here is empty and `Labels` holds nothing.
//!
//! Names and labels are listed in docs/operations.md; keep the two in step.
// Without the feature the methods are empty, and keep their shape for the call sites.
#![cfg_attr(not(feature = "metrics"), allow(clippy::unused_self))]

#[cfg(feature = "metrics")]
use std::borrow::Cow;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Config;
use crate::store::Outage;

/// Keyed requests by how the layer answered them, one per request.
#[cfg(feature = "metrics")]
pub(crate) const REQUESTS: &str = "idempotency_requests_total";
/// Store events beside the answer: `recorded`, `fenced`, `takeover`.
#[cfg(feature = "metrics")]
pub(crate) const EVENTS: &str = "idempotency_events_total";
/// Seconds per store call, by store and operation (timeouts included, at their deadline).
#[cfg(feature = "metrics")]
pub(crate) const STORE_DURATION: &str = "idempotency_store_duration_seconds";
/// Bytes of each recorded answer body.
#[cfg(feature = "metrics")]
pub(crate) const RECORDED_BODY: &str = "idempotency_recorded_body_bytes";
/// Seconds a request spent waiting for another attempt (wait mode), per wait.
#[cfg(feature = "metrics")]
pub(crate) const WAIT_DURATION: &str = "idempotency_wait_seconds";

/// Keyed requests refused (`503`) for an outage the store logs itself, by `reason`:
/// `failover` (writes held for a failover), `replication` (`WAIT` saw too few replicas).
#[cfg(feature = "metrics")]
pub(crate) const OUTAGE_REFUSALS: &str = "idempotency_outage_refusals_total";

/// Records the recovery worker looked at, by outcome: `recovered`, `failed`, `left`, `taken`.
#[cfg(feature = "metrics")]
pub(crate) const RECOVERIES: &str = "idempotency_recoveries_total";

/// Counts one record the recovery worker looked at.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn recovery(store: &'static str, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(RECOVERIES, "outcome" => outcome, "store" => store).increment(1);
}

/// The labels of one keyed request: route, protocol and store.
#[derive(Clone, Debug)]
pub(crate) struct Labels {
    #[cfg(feature = "metrics")]
    route: Cow<'static, str>,
    #[cfg(feature = "metrics")]
    protocol: &'static str,
    #[cfg(feature = "metrics")]
    store: &'static str,
}

impl Labels {
    /// The route is axum's `MatchedPath` when present (feature `axum`), else the configured
    /// gRPC method pattern the path matched, else the layer's route label: never the raw
    /// path, which a client could fill with unbounded values.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(cfg: &Config, ext: &http::Extensions, path: &str, grpc: bool) -> Self {
        #[cfg(feature = "metrics")]
        {
            let route = matched_path(ext)
                .or_else(|| {
                    cfg.grpc
                        .as_ref()
                        .filter(|_| grpc)
                        .and_then(|g| g.pattern(path))
                        .map(|p| Cow::Owned(p.to_owned()))
                })
                .unwrap_or_else(|| cfg.route_label.clone());
            Self {
                route,
                protocol: if grpc { "grpc" } else { "http" },
                store: cfg.store.name(),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Self {}
    }

    /// The labels of an [operation](crate::operation): the layer's route label, protocol
    /// `operation`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn operation(cfg: &Config) -> Self {
        #[cfg(feature = "metrics")]
        {
            Self {
                route: cfg.route_label.clone(),
                protocol: "operation",
                store: cfg.store.name(),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Self {}
    }

    /// Counts one keyed request by its answer.
    pub(crate) fn outcome(&self, outcome: Outcome) {
        let outcome = outcome.as_str();
        #[cfg(feature = "metrics")]
        metrics::counter!(REQUESTS, "outcome" => outcome, "route" => self.route.clone(),
            "protocol" => self.protocol, "store" => self.store)
        .increment(1);
        let _ = outcome;
    }

    /// Counts a store event.
    pub(crate) fn event(&self, event: Event) {
        let event = event.as_str();
        #[cfg(feature = "metrics")]
        metrics::counter!(EVENTS, "event" => event, "route" => self.route.clone(),
            "protocol" => self.protocol, "store" => self.store)
        .increment(1);
        let _ = event;
    }

    /// Counts a request refused for an outage the store logs itself (one line per outage,
    /// not one per request).
    pub(crate) fn refused(&self, outage: Outage) {
        let reason = match outage {
            Outage::Failover => "failover",
            Outage::Replication => "replication",
        };
        #[cfg(feature = "metrics")]
        metrics::counter!(OUTAGE_REFUSALS, "reason" => reason, "route" => self.route.clone(),
            "protocol" => self.protocol, "store" => self.store)
        .increment(1);
        let _ = reason;
    }

    pub(crate) fn recorded_body(&self, bytes: usize) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(RECORDED_BODY, "route" => self.route.clone(),
            "protocol" => self.protocol, "store" => self.store)
        .record(bytes as f64);
        let _ = bytes;
    }

    pub(crate) fn waited(&self, d: Duration) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(WAIT_DURATION, "route" => self.route.clone(),
            "protocol" => self.protocol, "store" => self.store)
        .record(d.as_secs_f64());
        let _ = d;
    }

    /// Times one store call: recorded when the guard drops, so a call abandoned at its
    /// deadline counts too (by the time it was given).
    pub(crate) fn store_call(&self, operation: &'static str) -> StoreTimer {
        #[cfg(feature = "metrics")]
        let store = self.store;
        #[cfg(not(feature = "metrics"))]
        let store = "";
        store_timer(store, operation)
    }
}

/// Times one call to the store named `store`, outside any one request (a shared poll).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn store_timer(store: &'static str, operation: &'static str) -> StoreTimer {
    StoreTimer {
        #[cfg(feature = "metrics")]
        store,
        operation,
        start: Instant::now(),
        live: true,
    }
}

#[cfg(all(feature = "metrics", feature = "axum"))]
fn matched_path(ext: &http::Extensions) -> Option<Cow<'static, str>> {
    ext.get::<::axum::extract::MatchedPath>()
        .map(|m| Cow::Owned(m.as_str().to_owned()))
}

#[cfg(all(feature = "metrics", not(feature = "axum")))]
fn matched_path(_: &http::Extensions) -> Option<Cow<'static, str>> {
    None
}

/// Records one store call's duration when dropped.
#[derive(Debug)]
pub(crate) struct StoreTimer {
    #[cfg(feature = "metrics")]
    store: &'static str,
    operation: &'static str,
    start: Instant,
    /// False once [`cancel`](Self::cancel)led.
    live: bool,
}

impl Drop for StoreTimer {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        if self.live {
            metrics::histogram!(STORE_DURATION, "store" => self.store, "operation" => self.operation)
                .record(self.start.elapsed().as_secs_f64());
        }
        let _ = (self.operation, self.start, self.live);
    }
}

impl StoreTimer {
    /// A call that did not happen (a store without a synchronous answer): nothing recorded.
    pub(crate) fn cancel(mut self) {
        self.live = false;
    }
}

/// Runs `call` under a [`StoreTimer`].
pub(crate) async fn timed<T>(timer: StoreTimer, call: impl std::future::Future<Output = T>) -> T {
    let out = call.await;
    drop(timer);
    out
}

/// How a keyed request was answered: the `outcome` label of the requests counter and the
/// `outcome` field of the request's span (docs/operations.md lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Executed,
    Replayed,
    Conflict,
    Mismatch,
    Tombstoned,
    Released,
    KeyMissing,
    KeyInvalid,
    BodyTooLarge,
    BodyTimeout,
    BodyUnreadable,
    SignatureInvalid,
    ScopeMissing,
    StoreError,
    OverQuota,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Tombstoned => "tombstoned",
            Self::Released => "released",
            Self::KeyMissing => "key_missing",
            Self::KeyInvalid => "key_invalid",
            Self::BodyTooLarge => "body_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::BodyUnreadable => "body_unreadable",
            Self::SignatureInvalid => "signature_invalid",
            Self::ScopeMissing => "scope_missing",
            Self::StoreError => "store_error",
            Self::OverQuota => "over_quota",
        }
    }
}

/// A store event beside the answer: the `event` label of the events counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// The answer was recorded.
    Recorded,
    /// A write of this attempt was fenced: another attempt (or an operator) has the key.
    Fenced,
    /// This claim took over a lapsed lease.
    Takeover,
}

impl Event {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Recorded => "recorded",
            Self::Fenced => "fenced",
            Self::Takeover => "takeover",
        }
    }
}
