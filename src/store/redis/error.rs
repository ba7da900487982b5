//! How Redis failures become [`StoreError`]s: certain or unknown outcome, and the kinds.

use std::error::Error as StdError;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::RedisError;

use crate::store::{Outage, StoreError, StoreErrorKind};

/// The source of a [`StoreErrorKind::Unavailable`] error when `WAIT` saw too few replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationShortfall {
    /// Replicas that acknowledged the write in time.
    pub acknowledged: u64,
    /// Replicas asked for with [`RedisStoreBuilder::with_wait`](super::RedisStoreBuilder::with_wait).
    pub wanted: u32,
}

impl fmt::Display for ReplicationShortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WAIT: {} of {} replicas acknowledged the idempotency record in time",
            self.acknowledged, self.wanted
        )
    }
}

impl StdError for ReplicationShortfall {}

/// The source of a store error while a failover of the primary is under way: the store
/// learned from Sentinel that its primary is being replaced, and acknowledges no write until
/// it is connected to the new one (a write the old primary took now could be lost with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailoverUnderway;

impl fmt::Display for FailoverUnderway {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a Sentinel failover of the Redis primary is under way: no write is acknowledged \
             until the store is connected to the new primary",
        )
    }
}

impl StdError for FailoverUnderway {}

/// A call refused, or not acknowledged, because the connection it took was found to point
/// at a node that may no longer be the primary; the store is reconnecting.
#[derive(Debug)]
pub(super) struct Reconnecting;

impl fmt::Display for Reconnecting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the Redis idempotency store is reconnecting to its primary")
    }
}

impl StdError for Reconnecting {}

/// A reply the store cannot read: a script and this code disagree, or a key holds something
/// that is not a record.
#[derive(Debug)]
pub(super) struct BadReply(pub(super) &'static str);

impl fmt::Display for BadReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply from Redis: {}", self.0)
    }
}

impl StdError for BadReply {}

/// Why a call failed: for sure, or with an outcome nobody knows yet.
pub(super) enum Failure {
    /// The call did not happen (or was refused): map and return.
    Certain(StoreError),
    /// A timeout or a connection lost mid-call: it may have run. Read back before deciding.
    Uncertain(Box<dyn StdError + Send + Sync + 'static>),
}

impl Failure {
    pub(super) fn from_redis(e: RedisError) -> Self {
        // A refused connection never carried the call; other I/O errors may have lost its reply.
        if e.is_timeout() || (e.is_io_error() && !e.is_connection_refusal()) {
            return Failure::Uncertain(Box::new(e));
        }
        // Redis 7 passes a script's OOM error on with its code; older versions wrap it in ERR.
        let oom = e.code() == Some("OOM")
            || e.detail()
                .is_some_and(|d| d.contains("OOM command not allowed"));
        let kind = match e.code() {
            _ if oom => StoreErrorKind::Full,
            Some("WRONGTYPE") => StoreErrorKind::Corrupt,
            _ => StoreErrorKind::Unavailable,
        };
        Failure::Certain(StoreError::with_source(kind, e))
    }

    pub(super) fn into_error(self) -> StoreError {
        match self {
            Failure::Certain(e) => e,
            Failure::Uncertain(e) => StoreError::with_source(StoreErrorKind::Unknown, e),
        }
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::Certain(e)
    }
}

pub(super) fn unknown(source: Option<Box<dyn StdError + Send + Sync + 'static>>) -> StoreError {
    match source {
        Some(e) => StoreError::with_source(StoreErrorKind::Unknown, e),
        None => StoreError::new(StoreErrorKind::Unknown),
    }
}

pub(super) fn corrupt(what: &'static str) -> StoreError {
    StoreError::with_source(StoreErrorKind::Corrupt, BadReply(what))
}

pub(super) fn fenced() -> StoreError {
    StoreError::new(StoreErrorKind::Fenced)
}

/// A write refused, or of `kind` (`Unknown`: answered after the hold began), because a
/// failover of the primary holds writes; the hold's start and end are logged where it is kept.
pub(super) fn failover_underway(kind: StoreErrorKind) -> StoreError {
    StoreError::with_source(kind, FailoverUnderway).during(Outage::Failover)
}

/// `Ok` when `acknowledged` replicas are enough, else [`ReplicationShortfall`].
fn shortfall(acknowledged: u64, wanted: NonZeroU32) -> Result<(), StoreError> {
    if acknowledged < u64::from(wanted.get()) {
        let source = ReplicationShortfall {
            acknowledged,
            wanted: wanted.get(),
        };
        return Err(StoreError::with_source(StoreErrorKind::Unavailable, source)
            .during(Outage::Replication));
    }
    Ok(())
}

/// Whether the last `WAIT` fell short, so that a shortfall is logged when it begins and when
/// it ends, not once per refused write (one store refuses thousands a second in one).
#[derive(Debug, Default)]
pub(super) struct Shortfalls {
    short: AtomicBool,
}

impl Shortfalls {
    /// `Ok` when `acknowledged` replicas are enough, else [`ReplicationShortfall`]; logs a change.
    pub(super) fn check(&self, acknowledged: u64, wanted: NonZeroU32) -> Result<(), StoreError> {
        let result = shortfall(acknowledged, wanted);
        match (self.short.swap(result.is_err(), Ordering::AcqRel), &result) {
            (false, Err(_)) => tracing::warn!(
                acknowledged,
                wanted = wanted.get(),
                "WAIT: too few replicas acknowledged a write of the Redis idempotency store; \
                 writes are refused (503) until enough do"
            ),
            (true, Ok(())) => tracing::info!(
                wanted = wanted.get(),
                "WAIT: enough replicas acknowledge the Redis idempotency store's writes again"
            ),
            _ => {}
        }
        result
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    /// Every event of this crate, as its level and its fields' text.
    #[derive(Clone, Default)]
    pub(in crate::store::redis) struct Capture(Arc<Mutex<Vec<(tracing::Level, String)>>>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            struct Text(String);
            impl tracing::field::Visit for Text {
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn fmt::Debug) {
                    self.0.push_str(&format!("{}={v:?} ", f.name()));
                }
            }
            if !event.metadata().target().starts_with("tower_idempotency") {
                return;
            }
            let mut text = Text(String::new());
            event.record(&mut text);
            let level = *event.metadata().level();
            self.0.lock().unwrap().push((level, text.0));
        }
    }

    impl Capture {
        /// Captures this thread's events until the guard drops.
        pub(in crate::store::redis) fn install(&self) -> tracing::subscriber::DefaultGuard {
            use tracing_subscriber::layer::SubscriberExt;
            tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
        }

        /// The events at `level` whose text holds `part`.
        pub(in crate::store::redis) fn lines(
            &self,
            level: tracing::Level,
            part: &str,
        ) -> Vec<String> {
            let lines = self.0.lock().unwrap();
            lines
                .iter()
                .filter(|(l, t)| *l == level && t.contains(part))
                .map(|(_, t)| t.clone())
                .collect()
        }
    }

    /// A keyed POST through `svc`: its status.
    pub(in crate::store::redis) async fn post<S>(svc: &S, key: &str) -> http::StatusCode
    where
        S: tower::Service<
                http::Request<http_body_util::Full<bytes::Bytes>>,
                Response = http::Response<crate::ResponseBody<http_body_util::Full<bytes::Bytes>>>,
                Error = std::convert::Infallible,
            > + Clone,
    {
        use tower::ServiceExt;
        let req = http::Request::post("/pay")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        svc.clone().oneshot(req).await.unwrap().status()
    }

    /// The value of the counter `name` whose labels include `labels`.
    #[cfg(feature = "metrics")]
    pub(in crate::store::redis) fn counter(
        snapshotter: &metrics_util::debugging::Snapshotter,
        name: &str,
        labels: &[(&str, &str)],
    ) -> u64 {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| {
                let key = key.key();
                key.name() == name
                    && labels
                        .iter()
                        .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
            })
            .map(|(.., value)| match value {
                metrics_util::debugging::DebugValue::Counter(n) => n,
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn a_wait_shortfall_is_logged_when_it_begins_and_when_it_ends() {
        let capture = Capture::default();
        let _guard = capture.install();
        let shortfalls = Shortfalls::default();
        let one = NonZeroU32::new(1).unwrap();
        for _ in 0..5 {
            let e = shortfalls.check(0, one).unwrap_err();
            assert_eq!(e.outage(), Some(Outage::Replication));
        }
        shortfalls.check(1, one).unwrap();
        shortfalls.check(1, one).unwrap();
        assert_eq!(
            capture
                .lines(tracing::Level::WARN, "too few replicas")
                .len(),
            1
        );
        assert_eq!(
            capture.lines(tracing::Level::INFO, "enough replicas").len(),
            1
        );
        assert_eq!(capture.0.lock().unwrap().len(), 2, "nothing else is logged");
    }

    #[tokio::test]
    async fn requests_refused_in_a_wait_shortfall_are_counted_not_logged_as_errors() {
        let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
            return;
        };
        let prefix = format!(
            "tidem-unit-short-{}-{:?}:",
            std::process::id(),
            Instant::now()
        )
        .replace(['{', '}'], "");
        // One replica asked of a Redis that has none: every winning claim falls short.
        let store = super::super::RedisStore::builder()
            .with_key_prefix(prefix)
            .with_wait(NonZeroU32::new(1).unwrap(), Duration::from_millis(5))
            .with_replica_check(false)
            .connect(&url)
            .await
            .unwrap();
        let svc = tower::Layer::layer(
            &crate::IdempotencyLayer::new(store).unscoped(),
            tower::service_fn(
                |_: http::Request<crate::RequestBody<http_body_util::Full<bytes::Bytes>>>| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        http_body_util::Full::new(bytes::Bytes::from_static(b"ran")),
                    ))
                },
            ),
        );
        let capture = Capture::default();
        let _guard = capture.install();
        #[cfg(feature = "metrics")]
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        #[cfg(feature = "metrics")]
        let _metrics = metrics::set_default_local_recorder(&recorder);

        const N: usize = 12;
        for i in 0..N {
            assert_eq!(post(&svc, &format!("k{i}")).await, 503);
        }
        assert_eq!(
            capture.lines(tracing::Level::ERROR, "").len(),
            0,
            "no ERROR line per request"
        );
        assert_eq!(
            capture
                .lines(tracing::Level::WARN, "too few replicas")
                .len(),
            1
        );
        #[cfg(feature = "metrics")]
        assert_eq!(
            counter(
                &recorder.snapshotter(),
                crate::metrics::OUTAGE_REFUSALS,
                &[("reason", "replication"), ("store", "redis")],
            ),
            N as u64
        );
    }

    #[test]
    fn redis_errors_map_to_store_error_kinds() {
        let kind = |e: RedisError| Failure::from_redis(e).into_error().kind();
        let server = |code: &str, detail: &str| {
            redis::make_extension_error(code.to_owned(), Some(detail.to_owned()))
        };
        let oom7 =
            "command not allowed when used memory > 'maxmemory'. script: f, on @user_script:9.";
        assert_eq!(kind(server("OOM", oom7)), StoreErrorKind::Full);
        let oom6 = "Error running script (call to f_1): @user_script:9: -OOM command not allowed \
                    when used memory > 'maxmemory'.";
        assert_eq!(kind(server("ERR", oom6)), StoreErrorKind::Full);
        assert_eq!(kind(server("NOPERM", "no")), StoreErrorKind::Unavailable);
        assert_eq!(kind(server("WRONGTYPE", "hash")), StoreErrorKind::Corrupt);
        let io = |k| RedisError::from(std::io::Error::from(k));
        assert_eq!(
            kind(io(std::io::ErrorKind::TimedOut)),
            StoreErrorKind::Unknown
        );
        assert_eq!(
            kind(io(std::io::ErrorKind::ConnectionReset)),
            StoreErrorKind::Unknown
        );
        assert_eq!(
            kind(io(std::io::ErrorKind::ConnectionRefused)),
            StoreErrorKind::Unavailable
        );
    }
}
