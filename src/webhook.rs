//! [`Webhook`]: the defaults a webhook receiver needs, and the signatures the layer checks
//! itself ([`StandardWebhooks`], in `standard.rs`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{request, StatusCode};

use crate::config::{Config, Scope, ScopeFn};
use crate::error::ConfigError;
use crate::fingerprint::JsonPointer;
use crate::key::Key;
use crate::policy::{RecordPolicy, ResponseInfo};

mod standard;
pub use standard::StandardWebhooks;

/// How long a webhook receiver keeps its records by default: 7 days, past Stripe's three
/// days of redelivery with room for an endpoint that was down and a manual resend.
pub const DEFAULT_WEBHOOK_TTL: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// A webhook receiver's settings, for
/// [`IdempotencyLayer::with_webhook`](crate::IdempotencyLayer::with_webhook).
///
/// Senders deliver at least once and redeliver for days, with no `Idempotency-Key`, but each
/// delivery carries the sender's own id of the event. With `with_webhook` the layer:
///
/// - **keys on the sender's id**, the [`Key`] given to [`Webhook::new`]: a header
///   (GitHub's `X-GitHub-Delivery`), a JSON field (Stripe's `/id`) or several joined
///   (Adyen's `eventCode` and `pspReference`). A delivery without it is `400` naming where
///   the id was expected ("the webhook id at JSON pointer `/id` in the request body is
///   missing"), and nothing is stored;
/// - **matches on the key and the route alone** (method, path and query): a redelivery is a
///   replay even when the sender changed a volatile field, such as Stripe's
///   `pending_webhooks` counter. A `422` would be read by the sender as a failure, and
///   redelivered for days. [`matching_body_except`](Self::matching_body_except) matches
///   on the body instead, minus the fields named;
/// - **records 2xx answers only** and replays them: any other answer tells the sender to
///   redeliver, and the redelivery must run again (a `400` from a handler bug fixed since
///   would otherwise be replayed for a week). A handler's
///   [`RecordDecision`](crate::RecordDecision) still comes first, and
///   [`with_record_policy`](crate::IdempotencyLayer::with_record_policy) after
///   `with_webhook` replaces the rule;
/// - **acknowledges a taken event whose answer was too large to keep** (over
///   [`with_max_response_body`](crate::IdempotencyLayer::with_max_response_body), recorded
///   as a tombstone): its redelivery gets the status the first delivery was answered, with
///   an empty body, `Idempotent-Replayed: true` and
///   [`Idempotent-Replay-Omitted: too-large`](crate::REPLAY_OMITTED_HEADER), where outside
///   webhook mode a retry gets the `410` problem, which a sender would read as a failure
///   and redeliver for days. An answer outside 2xx, recorded under a policy of your own,
///   gets its status the same way: the sender redelivers on it, as it did on the first;
/// - **keeps records 7 days** ([`DEFAULT_WEBHOOK_TTL`], [`with_ttl`](Self::with_ttl));
/// - **answers `503` with `Retry-After`** to a duplicate that arrives while the first
///   delivery still runs ([`with_in_progress_status`](Self::with_in_progress_status)). It
///   must not be a 2xx: if the first delivery then fails, the event would be lost. Stripe
///   and Adyen redeliver on any answer outside 2xx, and GitHub lists any such delivery as
///   failed for a redelivery by hand or by script, so `409` would do for them; `503` is
///   the status every sender reads as "try again later", where some treat a 4xx as final.
///   The problem `type` stays `in-progress`, so it is told apart from a store outage;
/// - **scopes by endpoint** when no scope is set: the path the delivery arrived on, so the
///   same event id sent to two tenants' endpoints (`/webhooks/{tenant}/stripe`) is two
///   records. [`with_scope`](Self::with_scope) scopes by what your signature check
///   verified instead, such as the sender's account; a scope already set on the layer is
///   kept.
///
/// Setters on the layer called after `with_webhook` override what it set.
///
/// **Signatures.** A [Standard Webhooks](https://www.standardwebhooks.com/) sender's
/// signature is checked by the layer itself: [`Webhook::standard`] keys on `webhook-id`
/// and verifies `webhook-signature` and `webhook-timestamp` on the buffered body, after
/// the key and the size limit and before anything is claimed, so a forged or stale
/// delivery is `401` and stores nothing. Any other sender's signature is checked in a
/// layer of your own that runs first: with axum, the later `.layer(verify)` call. A
/// delivery whose signature fails is answered `401` there and never reaches this layer, so
/// nothing is claimed or recorded, and the sender's genuine delivery of that id still
/// runs. That check reads the raw body before this layer does, so give it the same size
/// limit as [`with_max_request_body`](crate::IdempotencyLayer::with_max_request_body). The
/// [webhooks guide](crate::webhooks_guide) has the whole receiver.
///
/// ```
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, JsonPointer, Key, Webhook};
///
/// let stripe = IdempotencyLayer::new(MemoryStore::new()).with_webhook(
///     Webhook::new(Key::json_pointer("/id")?)
///         .matching_body_except([JsonPointer::parse("/pending_webhooks")?]),
/// );
/// # drop(stripe);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct Webhook {
    key: Key,
    excluded: Option<Vec<JsonPointer>>,
    ttl: Duration,
    in_progress_status: StatusCode,
    scope: Option<ScopeFn>,
    signature: Option<Arc<StandardWebhooks>>,
}

impl fmt::Debug for Webhook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Webhook")
            .field("key", &self.key)
            .field("matching_body_except", &self.excluded)
            .field("ttl", &self.ttl)
            .field("in_progress_status", &self.in_progress_status)
            .field("scoped", &self.scope.is_some())
            .field("signature", &self.signature)
            .finish()
    }
}

impl Webhook {
    /// A receiver keyed on the sender's id at `key`, with the defaults above. The key is
    /// called "webhook id" in problems unless it was [described](Key::described_as)
    /// otherwise.
    pub fn new(key: Key) -> Self {
        let key = if key.has_noun() {
            key
        } else {
            key.described_as("webhook id")
        };
        Self {
            key,
            excluded: None,
            ttl: DEFAULT_WEBHOOK_TTL,
            in_progress_status: StatusCode::SERVICE_UNAVAILABLE,
            scope: None,
            signature: None,
        }
    }

    /// A [Standard Webhooks 1.0](https://www.standardwebhooks.com/) receiver: keyed on the
    /// `webhook-id` header, each delivery verified with `signature` before anything is
    /// claimed, with the defaults above.
    ///
    /// In order, nothing stored by any of them: a delivery without `webhook-id` is `400`
    /// ([`key-missing`](crate::problems#key-missing)), one over the size limit `413`, and
    /// one whose `webhook-signature` matches none of the secrets, or whose
    /// `webhook-timestamp` is outside the tolerance, `401`
    /// ([`signature-invalid`](crate::problems#signature-invalid)). A delivery that passes
    /// runs once; its redeliveries, each signed afresh by the sender, are replays.
    ///
    /// The TTL is raised to twice the tolerance if shorter, so a captured delivery cannot
    /// outlive its record and be replayed into a second run within the tolerance; a later
    /// [`with_timing`](crate::IdempotencyLayer::with_timing) on the layer overrides that
    /// too.
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, StandardWebhooks, Webhook};
    ///
    /// let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"; // from the sender's dashboard
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_webhook(Webhook::standard(StandardWebhooks::new([secret])?));
    /// # drop(layer);
    /// # Ok(())
    /// # }
    /// ```
    pub fn standard(signature: StandardWebhooks) -> Self {
        let mut webhook = Self::new(Key::header(standard::ID));
        webhook.signature = Some(Arc::new(signature));
        webhook
    }

    /// Matches a redelivery on its body too, as the layer does outside webhook mode
    /// (canonical JSON, method, path, media type), minus the `fields` that change from
    /// one delivery to the next (Stripe's `/pending_webhooks`). A redelivery whose other
    /// fields differ is then `422`, which the sender treats as a failure and redelivers:
    /// use it where a sender might reuse an id for another event, and watch for `422`s.
    pub fn matching_body_except(mut self, fields: impl IntoIterator<Item = JsonPointer>) -> Self {
        self.excluded = Some(fields.into_iter().collect());
        self
    }

    /// Matches on the key and the route alone, the default.
    pub fn matching_route(mut self) -> Self {
        self.excluded = None;
        self
    }

    /// How long records are kept (default [`DEFAULT_WEBHOOK_TTL`], 7 days). Make it longer
    /// than the sender redelivers, plus the longest outage after which you would resend by
    /// hand. Raised to the lease if shorter.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The status of the answer to a duplicate that arrives while the first delivery runs
    /// (default `503`, with `Retry-After`). Refused: anything but a 4xx or 5xx, since a
    /// sender would take a 2xx or 3xx as delivered and never send the event again.
    pub fn with_in_progress_status(mut self, status: StatusCode) -> Result<Self, ConfigError> {
        if !(status.is_client_error() || status.is_server_error()) {
            return Err(ConfigError::new(format!(
                "a webhook's in-progress status must be a 4xx or 5xx that the sender retries on, not {status}"
            )));
        }
        self.in_progress_status = status;
        Ok(self)
    }

    /// Scopes records by what `scope` reads from the request head, as
    /// [`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope) does: the
    /// sender's account or endpoint that your signature check verified and put into the
    /// extensions.
    pub fn with_scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.scope = Some(Arc::new(scope));
        self
    }

    pub(crate) fn apply(self, c: &mut Config) {
        c.key = self.key;
        match self.excluded {
            None => c.fingerprint.route_only = true,
            Some(fields) => {
                c.fingerprint.route_only = false;
                c.fingerprint.excluded.extend(fields);
            }
        }
        c.timing.set_ttl(match &self.signature {
            Some(s) => self.ttl.max(2 * s.tolerance()),
            None => self.ttl,
        });
        c.signature = self.signature.map(|s| -> crate::config::SignatureFn {
            Arc::new(move |parts, body| s.verify(&parts.headers, body))
        });
        c.policy = Arc::new(TwoHundreds);
        c.in_progress_status = self.in_progress_status;
        c.unkept_as_status = true;
        match self.scope {
            Some(scope) => c.scope = Scope::Fn(scope),
            None if matches!(c.scope, Scope::Unset) => c.scope = Scope::Fn(Arc::new(endpoint)),
            None => {}
        }
    }
}

/// The default webhook scope: the endpoint, the path the delivery was sent to.
fn endpoint(parts: &request::Parts) -> Option<String> {
    let uri = crate::fingerprint::original_uri(parts);
    Some(format!("endpoint {}", uri.path()))
}

/// Records 2xx answers only: anything else makes the sender redeliver, and that
/// redelivery must run again.
#[derive(Debug, Clone, Copy)]
struct TwoHundreds;

impl RecordPolicy for TwoHundreds {
    fn should_record(&self, response: &ResponseInfo<'_>) -> bool {
        response.status().is_success()
    }
}
