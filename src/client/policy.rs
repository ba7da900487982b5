//! When to retry: backoff with jitter, the retry budget, and tower's `Policy`.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use tokio::time::{Instant, Sleep};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::Policy;

use super::classify::{classify, Verdict};
use super::{Config, RetryOutcome};
use crate::error::ConfigError;

/// Exponential backoff: the `n`th retry waits up to `min(cap, base × 2ⁿ)` (`n` from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// A backoff from `base` doubling up to `cap`. Fails when `base` is zero or `cap < base`.
    pub fn new(base: Duration, cap: Duration) -> Result<Self, ConfigError> {
        if base.is_zero() {
            return Err(ConfigError::new("backoff base must be above zero"));
        }
        if cap < base {
            return Err(ConfigError::new("backoff cap must be at least its base"));
        }
        Ok(Self { base, cap })
    }

    /// The longest wait before retry number `retry` (0 for the first retry).
    pub fn ceiling(&self, retry: u32) -> Duration {
        self.base
            .checked_mul(1u32.checked_shl(retry).unwrap_or(u32::MAX))
            .map_or(self.cap, |d| d.min(self.cap))
    }
}

impl Default for Backoff {
    /// 100 ms doubling up to 10 s.
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
        }
    }
}

/// How a backoff delay is drawn below its ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Jitter {
    /// Uniform between zero and the ceiling ("full jitter"): clients that failed together
    /// spread out instead of returning together. The default.
    #[default]
    Full,
    /// Exactly the ceiling. Only for comparisons and tests: every client that failed at the
    /// same moment retries at the same moment.
    None,
}

/// A retry budget: retries may add at most `ratio` of the requests made within `window`,
/// plus a floor of `min_per_sec` retries per second for clients that send little.
///
/// This is tower's [`TpsBudget`]. Clones share one balance: every service built from the
/// same layer draws on it, so an upstream that is down gets about `1 + ratio` times its
/// normal traffic instead of `1 + max_retries` times.
#[derive(Clone)]
pub struct RetryBudget {
    budget: Arc<TpsBudget>,
    ratio: f32,
    min_per_sec: u32,
    window: Duration,
}

impl RetryBudget {
    /// Retries up to `ratio` (0.1 is 10%) of the requests in the last `window` (1 to 60 s),
    /// and at least `min_per_sec` retries per second whatever the traffic.
    pub fn new(ratio: f32, min_per_sec: u32, window: Duration) -> Result<Self, ConfigError> {
        if !(ratio.is_finite() && ratio > 0.0 && ratio <= 1000.0) {
            return Err(ConfigError::new(
                "retry budget ratio must be above 0 and at most 1000",
            ));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&window) {
            return Err(ConfigError::new(
                "retry budget window must be between 1 and 60 seconds",
            ));
        }
        if min_per_sec >= i32::MAX as u32 {
            return Err(ConfigError::new("retry budget min_per_sec is too large"));
        }
        Ok(Self {
            budget: Arc::new(TpsBudget::new(window, min_per_sec, ratio)),
            ratio,
            min_per_sec,
            window,
        })
    }

    pub(crate) fn deposit(&self) {
        self.budget.deposit();
    }

    pub(crate) fn withdraw(&self) -> bool {
        self.budget.withdraw()
    }
}

impl Default for RetryBudget {
    /// 10% of requests over 10 s, and at least 10 retries per second.
    fn default() -> Self {
        Self::new(0.1, 10, Duration::from_secs(10)).expect("valid default")
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("ratio", &self.ratio)
            .field("min_per_sec", &self.min_per_sec)
            .field("window", &self.window)
            .field("balance", &self.budget)
            .finish()
    }
}

/// SplitMix64 behind an atomic counter: lock-free, shared by every request of a layer, and
/// reproducible from a seed. Jitter needs spread, not secrecy.
#[derive(Debug)]
pub(crate) struct Rng(AtomicU64);

impl Rng {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

    pub(crate) fn new(seed: u64) -> Self {
        Self(AtomicU64::new(seed))
    }

    pub(crate) fn from_entropy() -> Self {
        let seed = getrandom::u64().unwrap_or_else(|_| {
            // Only the spread suffers: mix in the clock.
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        Self::new(seed)
    }

    pub(crate) fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(Self::GAMMA, Ordering::Relaxed)
            .wrapping_add(Self::GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, max]`.
    fn below(&self, max: Duration) -> Duration {
        let max = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        let draw = (u128::from(self.next_u64()) * (u128::from(max) + 1)) >> 64;
        Duration::from_nanos(draw as u64)
    }
}

/// The retry policy of one logical request: tower's [`Retry`](tower::retry::Retry) asks it
/// after each attempt. A fresh one per request, so its counters are that request's.
#[derive(Debug, Clone)]
pub(crate) struct AttemptPolicy {
    config: Arc<Config>,
    key: HeaderValue,
    deadline: Option<Instant>,
    attempts: u32,
}

impl AttemptPolicy {
    pub(crate) fn new(config: Arc<Config>, key: HeaderValue, deadline: Option<Instant>) -> Self {
        Self {
            config,
            key,
            deadline,
            attempts: 1,
        }
    }

    /// How long to wait before the next attempt, or `None` to stop here.
    fn next_delay(&self, after: Option<Duration>) -> Option<Duration> {
        let config = &self.config;
        let retry = self.attempts - 1;
        if retry >= config.max_retries {
            return None;
        }
        if after.is_some_and(|after| after > config.max_retry_after) {
            tracing::debug!(?after, "Retry-After beyond max_retry_after; not retrying");
            return None;
        }
        let ceiling = config.backoff.ceiling(retry);
        let backoff = match config.jitter {
            Jitter::Full => config.rng.below(ceiling),
            Jitter::None => ceiling,
        };
        // The server's hint is a floor: never sooner than asked, never later than backoff.
        let delay = after.map_or(backoff, |after| after.max(backoff));
        if let Some(deadline) = self.deadline {
            if Instant::now() + delay >= deadline {
                tracing::debug!(?delay, "the next attempt would start past the deadline");
                return None;
            }
        }
        // Last, so that a retry we would not send anyway costs no budget.
        if let Some(budget) = &config.budget {
            if !budget.withdraw() {
                tracing::debug!("retry budget exhausted; not retrying");
                return None;
            }
        }
        Some(delay)
    }
}

impl<ResB, E> Policy<Request<Full<Bytes>>, Response<ResB>, E> for AttemptPolicy {
    type Future = Sleep;

    fn retry(
        &mut self,
        _req: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<ResB>, E>,
    ) -> Option<Self::Future> {
        // Transport errors and timeouts: the request may or may not have arrived, and the key
        // makes resending it safe.
        let verdict = match result {
            Ok(res) => classify(res, SystemTime::now()),
            Err(_) => Verdict::Retry { after: None },
        };
        if let Verdict::Retry { after } = verdict {
            if let Some(delay) = self.next_delay(after) {
                self.attempts += 1;
                tracing::debug!(attempt = self.attempts, ?delay, "retrying");
                return Some(tokio::time::sleep(delay));
            }
        }
        if let Ok(res) = result {
            let replayed = res
                .headers()
                .get(&super::REPLAYED)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
            res.extensions_mut().insert(RetryOutcome {
                attempts: self.attempts,
                replayed,
                key: self.key.clone(),
            });
        }
        None
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        // Cheap: the body is one reference-counted buffer.
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_without_overflow() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).unwrap();
        let ms: Vec<_> = (0..6).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(40), Duration::from_secs(1));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn bad_backoffs_and_budgets_are_config_errors() {
        let s = Duration::from_secs;
        assert!(Backoff::new(Duration::ZERO, s(1)).is_err());
        assert!(Backoff::new(s(2), s(1)).is_err());
        assert!(Backoff::new(s(1), s(1)).is_ok());
        assert!(RetryBudget::new(0.0, 1, s(10)).is_err());
        assert!(RetryBudget::new(f32::NAN, 1, s(10)).is_err());
        assert!(RetryBudget::new(0.1, 1, Duration::from_millis(999)).is_err());
        assert!(RetryBudget::new(0.1, 1, s(61)).is_err());
        assert!(RetryBudget::new(0.1, u32::MAX, s(10)).is_err());
        assert!(RetryBudget::new(0.1, 0, s(10)).is_ok());
    }

    #[test]
    fn full_jitter_covers_the_whole_range_and_stays_below_the_ceiling() {
        let rng = Rng::new(7);
        let max = Duration::from_millis(1000);
        let draws: Vec<_> = (0..10_000).map(|_| rng.below(max)).collect();
        assert!(draws.iter().all(|d| *d <= max));
        // Each tenth of the range gets roughly its share (expected 1,000 each).
        for tenth in 0..10u32 {
            let lo = max * tenth / 10;
            let hi = max * (tenth + 1) / 10;
            let n = draws.iter().filter(|d| **d >= lo && **d < hi).count();
            assert!((850..1150).contains(&n), "tenth {tenth}: {n}");
        }
        // The same seed draws the same sequence.
        let (a, b) = (Rng::new(42), Rng::new(42));
        assert!((0..100).all(|_| a.next_u64() == b.next_u64()));
        assert_eq!(rng.below(Duration::ZERO), Duration::ZERO);
    }
}
