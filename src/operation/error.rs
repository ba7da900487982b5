//! What an operation answers instead of its work's value.

use std::fmt;
use std::time::Duration;

use super::codec::CodecError;
use super::identity::InvalidInput;
use crate::store::StoreError;

/// Why an [operation](super) gave no value: typed, not an HTTP status.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// The work ran and failed with this error. Its key was released: the next attempt runs
    /// the work again (a takeover's record is kept, so that attempt resumes from the point).
    Failed(E),
    /// Another attempt holds the key and is running the work. Try again after `retry_after`
    /// (at most the time left on its lease): a queue consumer leaves the message pending.
    InProgress {
        /// When to try again.
        retry_after: Duration,
    },
    /// The key was used already with another input: a different message reusing an id, or a
    /// payload that changed between deliveries. Nothing ran.
    Mismatch,
    /// The store could not be reached, timed out, or refused (a quota, a failover): nothing
    /// ran, and nothing is known to be held. Try again after `retry_after`.
    StoreUnavailable {
        /// The store's error; its [`kind`](StoreError::kind) says which.
        error: StoreError,
        /// When to try again.
        retry_after: Duration,
    },
    /// The input was refused before anything was stored: no key, a bad key, a payload that
    /// does not serialize.
    Invalid(InvalidInput),
    /// The work completed earlier, but its answer was not kept (over `max_response_body`,
    /// or it could not be encoded). It was not run again.
    NotKept,
    /// The work completed earlier, and its recorded answer does not decode with this codec
    /// (the answer's type changed since). It was not run again.
    Undecodable(CodecError),
}

impl<E> OnceError<E> {
    /// When trying again may succeed: `Some` for [`InProgress`](Self::InProgress) and
    /// [`StoreUnavailable`](Self::StoreUnavailable), `None` for the rest.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after } | Self::StoreUnavailable { retry_after, .. } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }

    /// `true` when the work is known to have completed (earlier): a queue consumer can
    /// acknowledge the message. [`NotKept`](Self::NotKept) and
    /// [`Undecodable`](Self::Undecodable).
    pub fn completed(&self) -> bool {
        matches!(self, Self::NotKept | Self::Undecodable(_))
    }

    /// `true` when the same operation, tried again later, may end otherwise:
    /// [`Failed`](Self::Failed), [`InProgress`](Self::InProgress) and
    /// [`StoreUnavailable`](Self::StoreUnavailable). A queue consumer leaves such a message
    /// for redelivery, and acknowledges (or parks) the rest: a completed operation, a
    /// mismatch, an invalid input, which no retry changes.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Self::Failed(_) | Self::InProgress { .. } | Self::StoreUnavailable { .. }
        )
    }
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "the operation failed: {e}"),
            Self::InProgress { retry_after } => write!(
                f,
                "the operation is being run by another attempt; try again in {retry_after:?}"
            ),
            Self::Mismatch => {
                f.write_str("this idempotency key was already used with another input")
            }
            Self::StoreUnavailable { error, .. } => {
                write!(
                    f,
                    "the idempotency store is unavailable; the operation was not run: {error}"
                )
            }
            Self::Invalid(e) => write!(f, "{e}"),
            Self::NotKept => {
                f.write_str("the operation completed earlier, but its answer was not kept")
            }
            Self::Undecodable(e) => {
                write!(
                    f,
                    "the operation completed earlier, and its recorded answer does not decode: {e}"
                )
            }
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for OnceError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Failed(e) => Some(e),
            Self::StoreUnavailable { error, .. } => Some(error),
            Self::Invalid(e) => Some(e),
            Self::Undecodable(e) => Some(&**e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;

    #[test]
    fn a_consumer_reads_which_errors_to_retry_and_which_to_acknowledge() {
        let store = || StoreError::new(StoreErrorKind::Unavailable);
        let second = Duration::from_secs(1);
        let cases: [(OnceError<&str>, bool, bool); 7] = [
            (OnceError::Failed("boom"), true, false),
            (
                OnceError::InProgress {
                    retry_after: second,
                },
                true,
                false,
            ),
            (
                OnceError::StoreUnavailable {
                    error: store(),
                    retry_after: second,
                },
                true,
                false,
            ),
            (OnceError::Mismatch, false, false),
            (OnceError::Invalid(InvalidInput::KeyMissing), false, false),
            (OnceError::NotKept, false, true),
            (OnceError::Undecodable("x".into()), false, true),
        ];
        for (e, retryable, completed) in cases {
            assert_eq!(
                (e.retryable(), e.completed()),
                (retryable, completed),
                "{e}"
            );
        }
    }
}
