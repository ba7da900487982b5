//! [`Abandoned`]: what the abandoned-key hook hears.

use std::sync::Arc;
use std::time::Duration;

use crate::store::record::RecordId;

/// A key taken over after its holder's lease lapsed, for the hook of
/// [`with_abandoned_hook`](crate::IdempotencyLayer::with_abandoned_hook).
///
/// The raw key is not here: only its record id (the SHA-256 of scope and key), which is what
/// the store and the operator API know it by.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Abandoned {
    /// The request's scope (`None`: unscoped).
    pub scope: Option<Arc<str>>,
    /// The record id of (scope, key).
    pub record: RecordId,
    /// The generation of the claim that was abandoned.
    pub old_generation: u64,
    /// The generation of the claim that took over (this request).
    pub new_generation: u64,
    /// How long the key had been abandoned: from when the lapsed lease ended to the
    /// takeover, by the store's clock ([`Claim::lapsed_for`](crate::store::Claim::lapsed_for)).
    /// The holder's last renewal was about one lease before that. `None` when the store
    /// cannot tell: a custom store that does not say, or a takeover whose reply was lost and
    /// read back. It is then somewhere between zero and the retention TTL.
    pub abandoned_for: Option<Duration>,
}
