//! How Redis failures become [`StoreError`]s: certain or unknown outcome, and the kinds.

use std::error::Error as StdError;
use std::fmt;
use std::num::NonZeroU32;

use redis::RedisError;

use crate::store::{StoreError, StoreErrorKind};

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

/// `Ok` when `acknowledged` replicas are enough, else [`ReplicationShortfall`].
pub(super) fn shortfall(acknowledged: u64, wanted: NonZeroU32) -> Result<(), StoreError> {
    if acknowledged < u64::from(wanted.get()) {
        return Err(StoreError::with_source(
            StoreErrorKind::Unavailable,
            ReplicationShortfall {
                acknowledged,
                wanted: wanted.get(),
            },
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
