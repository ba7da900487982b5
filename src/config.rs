//! [`Config`]: what an [`IdempotencyLayer`](crate::IdempotencyLayer) was configured with,
//! shared by every service the layer makes, and the values that configure it.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{request, HeaderName, Method, Response};

use crate::error::{ConfigError, IdempotencyError};
use crate::fingerprint::Fingerprinting;
use crate::grpc::Grpc;
use crate::key::Key;
use crate::policy::RecordPolicy;
use crate::store::IdempotencyStore;

/// The shortest lease: renewals run every `lease / 3`, and below ~100 ms a store round trip
/// under load would eat the whole interval.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The default store deadline is `lease / 6`, capped at this.
///
/// The arithmetic: renewals are due every `lease / 3`, counted from the moment the claim was
/// sent. A renewal that hangs is abandoned at its deadline, `lease / 6` later, half an
/// interval before the next one is due, so one hung call never delays the next. One renewal
/// can fail and the next still lands with a third of the lease to spare; after two failures
/// in a row the third is sent just as the local estimate of the lease ends, so it keeps the
/// lease only if it reaches the store sooner than the claim did. With the
/// default 30 s lease the deadline is 1 s (the cap: a healthy store answers in
/// milliseconds); with a 2 s lease it is 333 ms.
pub const DEFAULT_STORE_TIMEOUT_MAX: Duration = Duration::from_secs(1);

/// How long a claim is held, how long an answer is kept, and how long one store call may take.
///
/// - `lease` (default 30 s): how long a claim holds the key without news from its holder.
///   The holder renews it every `lease / 3`, so one renewal can fail with a third of the
///   lease to spare, and two in a row bring it to the edge. A holder that crashes blocks retries (409) for at most one lease; then a retry
///   with the same request takes over.
/// - `ttl` (default 24 h): how long a completed answer is kept, counted from completion.
/// - the store deadline (default `lease / 6`, at most [`DEFAULT_STORE_TIMEOUT_MAX`]): every
///   store call the layer makes is abandoned past it, and its outcome is then unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    lease: Duration,
    ttl: Duration,
    store_timeout: Option<Duration>,
}

impl Timing {
    /// Validates `lease >= MIN_LEASE` and `ttl >= lease`.
    pub fn new(lease: Duration, ttl: Duration) -> Result<Self, ConfigError> {
        if lease < MIN_LEASE {
            return Err(ConfigError::new(format!(
                "lease {lease:?} is shorter than the minimum {MIN_LEASE:?}"
            )));
        }
        if ttl < lease {
            return Err(ConfigError::new(format!(
                "ttl {ttl:?} is shorter than the lease {lease:?}"
            )));
        }
        Ok(Self {
            lease,
            ttl,
            store_timeout: None,
        })
    }

    /// Bounds every store call the layer makes (claim, extend, complete, release, get).
    ///
    /// Refused unless `0 < timeout < lease / 3`: a renewal must end, one way or the other,
    /// before the next one is due. A call past its deadline is "unknown": a claim is then
    /// answered 503 and released in the background if it did take effect, a renewal is
    /// retried at its next time, a complete or release is retried while the lease lives.
    pub fn with_store_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        if timeout.is_zero() || timeout >= self.lease / 3 {
            return Err(ConfigError::new(format!(
                "store timeout {timeout:?} must be above zero and below a third of the lease {:?}",
                self.lease
            )));
        }
        self.store_timeout = Some(timeout);
        Ok(self)
    }

    /// Sets the TTL, raised to the lease if shorter (the invariant `new` checks).
    pub(crate) fn set_ttl(&mut self, ttl: Duration) {
        self.ttl = ttl.max(self.lease);
    }

    /// The lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retention TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The deadline on each store call: the one set, or `lease / 6` capped at
    /// [`DEFAULT_STORE_TIMEOUT_MAX`].
    pub fn store_timeout(&self) -> Duration {
        self.store_timeout
            .unwrap_or_else(|| (self.lease / 6).min(DEFAULT_STORE_TIMEOUT_MAX))
    }
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 60 * 60),
            store_timeout: None,
        }
    }
}

/// What a duplicate meets while the first attempt of its key still runs: a 409 at once, or a
/// wait for the first answer.
///
/// Given to [`IdempotencyLayer::with_in_progress`](crate::IdempotencyLayer::with_in_progress).
/// The default is [`conflict`](Self::conflict).
///
/// ```
/// # use std::{num::NonZeroUsize, time::Duration};
/// # use tower_idempotency::{store::MemoryStore, IdempotencyLayer, InProgress};
/// let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped().with_in_progress(
///     InProgress::wait(Duration::from_secs(10)).max_waiters(NonZeroUsize::new(256).unwrap()),
/// );
/// # drop(layer);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct InProgress {
    /// `None`: answer 409 at once.
    pub(crate) wait: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) retry_after: Duration,
}

impl InProgress {
    /// Answer 409 (gRPC `ABORTED`) at once, with `Retry-After` (the default: 1 s, see
    /// [`retry_after`](Self::retry_after)).
    pub fn conflict() -> Self {
        Self {
            wait: None,
            max_waiters: 1024,
            // A hint for the work, not the lease: see retry_after.
            retry_after: Duration::from_secs(1),
        }
    }

    /// Make a duplicate wait up to `max` for the first attempt's answer, then replay it.
    /// Past `max` it gets the 409 [`conflict`](Self::conflict) would have given.
    ///
    /// Waiting duplicates of one key are coalesced within the process: one poll of the
    /// store per key, with jitter, however many wait. At most
    /// [`max_waiters`](Self::max_waiters) requests wait at once; the rest get 409 at once.
    pub fn wait(max: Duration) -> Self {
        Self {
            wait: Some(max),
            ..Self::conflict()
        }
    }

    /// How many requests may wait at once in [wait mode](Self::wait), over all keys
    /// (default 1,024). Each waiter holds its buffered request body, so this bounds the
    /// memory a burst of duplicates can take. Without wait mode nobody waits, and this has
    /// no effect.
    pub fn max_waiters(mut self, max: NonZeroUsize) -> Self {
        self.max_waiters = max.get();
        self
    }

    /// The `Retry-After` of a 409 in-progress answer (gRPC: the `RetryInfo` delay), including
    /// the one a wait that ran out gets: `max`, or the rest of the lease when that is shorter
    /// (default 1 s, whatever the lease). `Retry-After` is in whole seconds, rounded up.
    ///
    /// The hint should fit the work, not the lease: a duplicate that arrives just after the
    /// first request would otherwise wait out most of a 30 s lease for a handler that takes
    /// a few hundred milliseconds. Raise it for handlers that take longer (each early retry
    /// costs a 409); [`wait`](Self::wait) avoids the round trips altogether.
    ///
    /// `retry-after-ms` carries the same hint to the millisecond (at least 1), for clients
    /// that read it first, as Stainless-generated SDKs do; gRPC answers carry it as
    /// `grpc-retry-pushback-ms`, read by clients with a retry policy for `ABORTED`.
    pub fn retry_after(mut self, max: Duration) -> Self {
        self.retry_after = max;
        self
    }
}

impl Default for InProgress {
    fn default() -> Self {
        Self::conflict()
    }
}

/// What the layer does when the store cannot be used for a request: refuse it (fail closed,
/// the default) or run it unprotected (fail open).
///
/// Given to [`IdempotencyLayer::with_store_failure`](crate::IdempotencyLayer::with_store_failure).
/// Failing open trades the guarantee for availability: a duplicate that arrives while the
/// store fails runs the work again, so a retry can charge a card twice. Choose it only for
/// endpoints where that is safer than refusing.
///
/// ```
/// # use tower_idempotency::{store::MemoryStore, IdempotencyLayer, StoreFailure};
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .unscoped()
///     .with_store_failure(StoreFailure::closed().open_on_quota(true));
/// # drop(layer);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct StoreFailure {
    pub(crate) open_on_error: bool,
    pub(crate) open_on_quota: bool,
    pub(crate) quota_retry_after: Duration,
}

impl Default for StoreFailure {
    fn default() -> Self {
        Self {
            open_on_error: false,
            open_on_quota: false,
            quota_retry_after: Duration::from_secs(60),
        }
    }
}

impl StoreFailure {
    /// Fail closed (the default): a store error is answered 503 (gRPC `UNAVAILABLE`) with
    /// `Retry-After: 1` and `retry-after-ms: 1000`, and a scope over its quota 429 (gRPC
    /// `RESOURCE_EXHAUSTED`) with the [`quota_retry_after`](Self::quota_retry_after) hint;
    /// nothing runs unprotected.
    pub fn closed() -> Self {
        Self::default()
    }

    /// When the store fails (an error, or no answer within the store deadline), run the
    /// request unprotected instead of answering 503.
    ///
    /// A duplicate can then run twice: only for endpoints where that is safer than refusing.
    pub fn open_on_error(mut self, open: bool) -> Self {
        self.open_on_error = open;
        self
    }

    /// When the store refuses a claim because the caller's scope is over its per-scope quota
    /// (see [`MemoryStoreBuilder::with_max_records_per_scope`](crate::store::memory::MemoryStoreBuilder::with_max_records_per_scope)),
    /// run that caller's request unprotected instead of answering 429
    /// ([`ErrorKind::QuotaExceeded`](crate::ErrorKind::QuotaExceeded), gRPC
    /// `RESOURCE_EXHAUSTED`). Other scopes are unaffected either way.
    pub fn open_on_quota(mut self, open: bool) -> Self {
        self.open_on_quota = open;
        self
    }

    /// The `Retry-After` (and `retry-after-ms`) of the `429` quota answer: `after`, or the
    /// layer's retention TTL when that is shorter (default 60 s).
    ///
    /// A hint, not a measure: a scope's quota frees when one of its records expires or is
    /// released, and neither the layer nor the store knows when the next one will (the store
    /// answers a claim over quota without reading the scope's records). The TTL is the only
    /// bound the layer knows: every record the scope holds now is gone one TTL from now,
    /// unless it claims more. A scope that fills its quota is usually a client making a new
    /// key per attempt, and a minute keeps it from retrying in a loop; lower it where scopes
    /// turn their records over quickly (a short TTL does that by itself). Clients that cap
    /// the hints they follow (Stainless SDKs up to 60 s, the crate's own client layer up to
    /// its `with_max_retry_after`, 60 s by default) do not wait out a longer one. gRPC
    /// answers carry no hint: gRPC clients retry `RESOURCE_EXHAUSTED` only under a retry
    /// policy of their own.
    pub fn quota_retry_after(mut self, after: Duration) -> Self {
        self.quota_retry_after = after;
        self
    }
}

pub(crate) type ScopeFn = Arc<dyn Fn(&request::Parts) -> Option<String> + Send + Sync>;

/// Where keys live: per scope, in one shared key space (an explicit choice), or not chosen yet.
#[derive(Clone)]
pub(crate) enum Scope {
    /// Neither [`IdempotencyLayer::with_scope`] nor [`IdempotencyLayer::unscoped`] was called:
    /// keyed requests are refused (500 scope-missing) rather than share one key space.
    Unset,
    /// [`IdempotencyLayer::unscoped`]: every caller shares one key space.
    Unscoped,
    /// [`IdempotencyLayer::with_scope`].
    Fn(ScopeFn),
}
pub(crate) type FilterFn = Arc<dyn Fn(&request::Parts) -> bool + Send + Sync>;
/// Checks a delivery's signature on its head and buffered body: `Err` is the `401` problem.
pub(crate) type SignatureFn =
    Arc<dyn Fn(&request::Parts, &[u8]) -> Result<(), IdempotencyError> + Send + Sync>;
pub(crate) type Renderer = Arc<dyn Fn(&IdempotencyError) -> Response<Bytes> + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) key: Key,
    pub(crate) methods: Vec<Method>,
    pub(crate) filter: Option<FilterFn>,
    pub(crate) scope: Scope,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) request_body_timeout: Duration,
    pub(crate) timing: Timing,
    pub(crate) fingerprint: Fingerprinting,
    pub(crate) unrecorded_headers: Vec<HeaderName>,
    pub(crate) policy: Arc<dyn RecordPolicy>,
    pub(crate) store_failure: StoreFailure,
    pub(crate) in_progress: InProgress,
    /// The status of an in-progress answer: 409, or what a [`Webhook`](crate::Webhook) chose.
    pub(crate) in_progress_status: http::StatusCode,
    /// A retry of a request whose answer was too large to keep gets its original status,
    /// empty, rather than the `410` problem: set by a [`Webhook`](crate::Webhook), whose
    /// sender reads anything outside 2xx as a failure.
    pub(crate) unkept_as_status: bool,
    /// The sender's signature, checked on the buffered body before the claim: set by
    /// [`Webhook::standard`](crate::Webhook::standard).
    pub(crate) signature: Option<SignatureFn>,
    pub(crate) renderer: Option<Renderer>,
    /// `None`: HTTP only.
    pub(crate) grpc: Option<Grpc>,
    /// The `route` metric label when no matched route is known.
    pub(crate) route_label: std::borrow::Cow<'static, str>,
    pub(crate) on_abandoned: Option<AbandonedFn>,
    /// Send [`TTL_HEADER`](crate::TTL_HEADER) on recorded answers and replays.
    pub(crate) ttl_header: bool,
    /// The [`TTL_HEADER`](crate::TTL_HEADER) value when it is sent: made once per edit of
    /// the layer rather than formatted per answer.
    pub(crate) ttl_value: Option<http::HeaderValue>,
    /// Whether a recorded answer's `Vary` headers must match on replay.
    pub(crate) vary_match: bool,
    /// Echo the request's key on every answer to it.
    pub(crate) key_echo: bool,
}

pub(crate) type AbandonedFn = Arc<dyn Fn(&crate::Abandoned) + Send + Sync>;

impl Config {
    /// Makes what is derived from the settings again, after an edit.
    pub(crate) fn derive(&mut self) {
        self.ttl_value = self
            .ttl_header
            .then(|| http::HeaderValue::from(self.timing.ttl().as_secs()));
    }

    /// The settings recording reads.
    pub(crate) fn recording(&self) -> crate::recording::Rules<'_> {
        crate::recording::Rules {
            max_response_body: self.max_response_body,
            unrecorded_headers: &self.unrecorded_headers,
            vary_match: self.vary_match,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_timeout_defaults_to_a_sixth_of_the_lease_capped_and_must_stay_below_a_third() {
        let r = |lease_ms| Timing::new(Duration::from_millis(lease_ms), Duration::MAX).unwrap();
        assert_eq!(r(30_000).store_timeout(), Duration::from_secs(1));
        assert_eq!(
            r(2_000).store_timeout(),
            Duration::from_millis(333) + Duration::from_nanos(333_333)
        );
        assert_eq!(r(100).store_timeout(), Duration::from_nanos(16_666_666));
        let three = r(3_000);
        assert!(
            three.with_store_timeout(Duration::from_secs(1)).is_err(),
            "lease / 3 itself"
        );
        assert!(three.with_store_timeout(Duration::ZERO).is_err());
        let ok = three
            .with_store_timeout(Duration::from_millis(999))
            .unwrap();
        assert_eq!(ok.store_timeout(), Duration::from_millis(999));
    }

    #[test]
    fn timing_refuses_tiny_leases_and_ttls_shorter_than_the_lease() {
        assert!(Timing::new(Duration::from_millis(99), Duration::from_secs(1)).is_err());
        assert!(Timing::new(Duration::from_secs(30), Duration::from_secs(29)).is_err());
        let r = Timing::new(Duration::from_secs(30), Duration::from_secs(30)).unwrap();
        assert_eq!(
            (r.lease(), r.ttl()),
            (Duration::from_secs(30), Duration::from_secs(30))
        );
    }
}
