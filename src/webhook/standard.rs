//! [`StandardWebhooks`]: the Standard Webhooks 1.0 signature, checked before the claim.

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::digest::{CtOutput, Output};
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName};
use sha2::Sha256;

use crate::error::{ConfigError, ErrorKind, IdempotencyError};

/// The sender's id of the message, the same on every redelivery: the key.
pub(super) const ID: HeaderName = HeaderName::from_static("webhook-id");
/// When this attempt was signed, in seconds since the Unix epoch.
const TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
/// Space-separated `v1,<base64>` signatures, one per secret the sender signs with.
const SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
const PREFIX: &str = "whsec_";
/// The spec's shortest secret: "random, at least 24 bytes".
const MIN_SECRET_LEN: usize = 24;

type HmacSha256 = Hmac<Sha256>;

/// The [Standard Webhooks 1.0](https://www.standardwebhooks.com/) signature, verified by
/// the layer before anything is claimed: given to [`Webhook::standard`](crate::Webhook::standard).
///
/// A delivery carries `webhook-id` (the key), `webhook-timestamp` (seconds since the
/// epoch) and `webhook-signature`: space-separated `v1,<base64 HMAC-SHA256>` entries over
/// `{webhook-id}.{webhook-timestamp}.{body}`, the body as received. It passes when **any**
/// `v1` entry matches **any** of the secrets (a sender rotating its secret signs with both
/// for a while; entries of other versions, such as `v1a`, are skipped) and the timestamp is
/// within the [tolerance](Self::with_tolerance) of this server's clock, either way. Every
/// other delivery is `401` [`signature-invalid`](crate::problems#signature-invalid), and
/// nothing is claimed or stored. MACs are compared in constant time.
///
/// Secrets are what the sender shows: `whsec_` and the base64 of at least 24 random
/// bytes. The bare base64, without `whsec_`, is accepted too, as the reference
/// libraries accept it; anything that is not base64, or is shorter than the spec's 24
/// bytes, is refused here, at configuration, rather than answered `401` for ever after.
///
/// ```
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// use std::time::Duration;
/// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, StandardWebhooks, Webhook};
///
/// // The current secret and the one being rotated out.
/// let signature = StandardWebhooks::new([
///     "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
///     "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
/// ])?
/// .with_tolerance(Duration::from_secs(60));
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_webhook(Webhook::standard(signature));
/// # drop(layer);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct StandardWebhooks {
    /// One keyed HMAC per secret, cloned per delivery: each key is set up once.
    keys: Vec<HmacSha256>,
    tolerance: Duration,
}

impl fmt::Debug for StandardWebhooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secrets.
        f.debug_struct("StandardWebhooks")
            .field("secrets", &self.keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl StandardWebhooks {
    /// How far a delivery's `webhook-timestamp` may be from this server's clock, either
    /// way, by default: 5 minutes, the reference libraries' tolerance.
    pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

    /// Verifies with each of `secrets` (`whsec_<base64>`, or the bare base64): one, or
    /// several while the sender rotates. Refused: no secret, a secret that is not base64,
    /// or one shorter than 24 bytes. The error never contains a secret.
    pub fn new<I>(secrets: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut keys = Vec::new();
        for (i, secret) in secrets.into_iter().enumerate() {
            let n = i + 1;
            let secret = secret.as_ref().trim();
            let encoded = secret.strip_prefix(PREFIX).unwrap_or(secret);
            let Ok(key) = BASE64.decode(encoded) else {
                return Err(ConfigError::new(format!(
                    "Standard Webhooks secret #{n} is not `whsec_` followed by base64 (nor bare base64)"
                )));
            };
            if key.len() < MIN_SECRET_LEN {
                return Err(ConfigError::new(format!(
                    "Standard Webhooks secret #{n} decodes to {} bytes; the spec's secrets are at least {MIN_SECRET_LEN}",
                    key.len()
                )));
            }
            keys.push(HmacSha256::new_from_slice(&key).expect("HMAC takes a key of any length"));
        }
        if keys.is_empty() {
            return Err(ConfigError::new(
                "Standard Webhooks needs at least one secret",
            ));
        }
        Ok(Self {
            keys,
            tolerance: Self::DEFAULT_TOLERANCE,
        })
    }

    /// How far `webhook-timestamp` may be from this server's clock, in the past or the
    /// future (default [`DEFAULT_TOLERANCE`](Self::DEFAULT_TOLERANCE), 5 minutes), in
    /// whole seconds. A sender signs each attempt afresh, so this bounds how long a
    /// captured delivery can be replayed, not how long the sender may redeliver; within
    /// it, a replay is a redelivery of the same `webhook-id`, answered from the record.
    /// Leave room for clock skew.
    pub fn with_tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The tolerance.
    pub fn tolerance(&self) -> Duration {
        self.tolerance
    }

    /// Checks a delivery against this server's clock: `Err` is the `401` problem.
    pub(crate) fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), IdempotencyError> {
        // A clock before 1970 reads as 0: every delivery is then "in the future", refused.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.verify_at(headers, body, now)
            .map_err(|detail| IdempotencyError::new(ErrorKind::SignatureInvalid, detail))
    }

    /// The check at `now` (seconds since the epoch); `Err` is the problem's detail.
    fn verify_at(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: u64,
    ) -> Result<(), Cow<'static, str>> {
        let id = one(headers, &ID)?;
        let timestamp = one(headers, &TIMESTAMP)?;
        let signed_at = parse_timestamp(timestamp)?;
        let tolerance = self.tolerance.as_secs();
        if now.saturating_sub(signed_at) > tolerance {
            return Err(format!(
                "the delivery was signed {} s ago (`webhook-timestamp`), past the tolerance of {tolerance} s",
                now - signed_at
            )
            .into());
        }
        if signed_at.saturating_sub(now) > tolerance {
            return Err(format!(
                "the delivery is signed {} s in the future (`webhook-timestamp`), past the tolerance of {tolerance} s: check the clocks",
                signed_at - now
            )
            .into());
        }
        let mut lines = headers.get_all(&SIGNATURE).iter().peekable();
        if lines.peek().is_none() {
            return Err("the `webhook-signature` header is missing".into());
        }
        // Every `v1` entry of every line: a match is a match, however the entries came.
        let candidates: Vec<CtOutput<HmacSha256>> = lines
            .flat_map(|line| line.as_bytes().split(|&b| b == b' '))
            .filter_map(|entry| entry.strip_prefix(b"v1,"))
            .filter_map(|encoded| BASE64.decode(encoded).ok())
            .filter(|tag| tag.len() == 32)
            .map(|tag| CtOutput::new(Output::<HmacSha256>::clone_from_slice(&tag)))
            .collect();
        if candidates.is_empty() {
            return Err(
                "the `webhook-signature` header has no `v1,<base64 HMAC-SHA256>` signature".into(),
            );
        }
        let matched = self.keys.iter().any(|key| {
            let expected = tag(key, id, timestamp, body);
            // `CtOutput`'s equality (which `contains` uses) is constant time: a forger
            // learns nothing from how long a wrong guess took.
            candidates.contains(&expected)
        });
        if matched {
            Ok(())
        } else {
            Err("no signature in `webhook-signature` matches the delivery: a wrong secret, or the id, timestamp or body changed on the way".into())
        }
    }
}

/// The HMAC of `{id}.{timestamp}.{body}`, fed in pieces: no copy of the body.
fn tag(key: &HmacSha256, id: &[u8], timestamp: &[u8], body: &[u8]) -> CtOutput<HmacSha256> {
    let mut mac = key.clone();
    mac.update(id);
    mac.update(b".");
    mac.update(timestamp);
    mac.update(b".");
    mac.update(body);
    mac.finalize()
}

/// The one value of a header the signature covers: two field lines would leave it unclear
/// which one was signed.
fn one<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<&'a [u8], Cow<'static, str>> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => Ok(value.as_bytes()),
        (None, _) => Err(format!("the `{name}` header is missing").into()),
        (Some(_), Some(_)) => Err(format!("the `{name}` header is sent more than once").into()),
    }
}

/// Whole seconds in decimal digits, as the spec has it; no sign, no fraction.
fn parse_timestamp(value: &[u8]) -> Result<u64, Cow<'static, str>> {
    std::str::from_utf8(value)
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| "the `webhook-timestamp` header is not a whole number of seconds".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks reference libraries' own vectors: the first from the PHP
    /// library's `testSignFunctionWorks` (also Svix's), the second from the Rust library's
    /// `test_sign`, both in github.com/standard-webhooks/standard-webhooks/libraries.
    const VECTORS: [(&str, &str, u64, &str, &str); 2] = [
        (
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#,
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
        ),
        (
            "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
            "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
            1649367553,
            r#"{"email":"test@example.com","username":"test_user"}"#,
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=",
        ),
    ];
    const SECRET: &str = VECTORS[0].0;
    const ID: &str = VECTORS[0].1;
    const AT: u64 = VECTORS[0].2;
    const BODY: &str = VECTORS[0].3;
    const SIGNED: &str = VECTORS[0].4;
    /// Another valid secret, for "the wrong secret".
    const OTHER: &str = VECTORS[1].0;

    fn headers(id: &str, timestamp: &str, signature: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("webhook-id", id.parse().unwrap());
        h.insert("webhook-timestamp", timestamp.parse().unwrap());
        h.insert("webhook-signature", signature.parse().unwrap());
        h
    }

    fn sw(secrets: &[&str]) -> StandardWebhooks {
        StandardWebhooks::new(secrets).unwrap()
    }

    fn signature(secret: &str, id: &str, at: u64, body: &str) -> String {
        let key = &sw(&[secret]).keys[0];
        let tag = tag(
            key,
            id.as_bytes(),
            at.to_string().as_bytes(),
            body.as_bytes(),
        );
        format!("v1,{}", BASE64.encode(tag.into_bytes()))
    }

    #[test]
    fn computes_the_reference_libraries_test_vectors() {
        for (secret, id, at, body, expected) in VECTORS {
            assert_eq!(signature(secret, id, at, body), expected, "{id}");
            let h = headers(id, &at.to_string(), expected);
            assert_eq!(
                sw(&[secret]).verify_at(&h, body.as_bytes(), at),
                Ok(()),
                "{id}"
            );
        }
    }

    #[test]
    fn a_signature_made_with_another_secret_fails() {
        let h = headers(ID, &AT.to_string(), SIGNED);
        let err = sw(&[OTHER]).verify_at(&h, BODY.as_bytes(), AT).unwrap_err();
        assert!(err.contains("no signature"), "{err}");
    }

    #[test]
    fn a_tampered_body_id_or_timestamp_fails() {
        let s = sw(&[SECRET]);
        let tampered_body = headers(ID, &AT.to_string(), SIGNED);
        assert!(s
            .verify_at(&tampered_body, br#"{"test": 2432232315}"#, AT)
            .is_err());
        let other_id = headers("msg_p5jXN8AQM9LWM0D4loKWxJel", &AT.to_string(), SIGNED);
        assert!(s.verify_at(&other_id, BODY.as_bytes(), AT).is_err());
        let other_time = headers(ID, &(AT + 1).to_string(), SIGNED);
        assert!(s.verify_at(&other_time, BODY.as_bytes(), AT).is_err());
    }

    #[test]
    fn each_missing_header_fails_naming_it() {
        for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            let mut h = headers(ID, &AT.to_string(), SIGNED);
            h.remove(name);
            let err = sw(&[SECRET])
                .verify_at(&h, BODY.as_bytes(), AT)
                .unwrap_err();
            assert_eq!(err, format!("the `{name}` header is missing"));
        }
    }

    #[test]
    fn a_timestamp_past_the_tolerance_either_way_fails_and_one_at_its_edge_passes() {
        let s = sw(&[SECRET]);
        let tolerance = StandardWebhooks::DEFAULT_TOLERANCE.as_secs();
        let h = headers(ID, &AT.to_string(), SIGNED);
        let body = BODY.as_bytes();
        assert_eq!(s.verify_at(&h, body, AT + tolerance), Ok(()));
        assert_eq!(s.verify_at(&h, body, AT - tolerance), Ok(()));
        let old = s.verify_at(&h, body, AT + tolerance + 1).unwrap_err();
        assert!(old.contains("301 s ago"), "{old}");
        let new = s.verify_at(&h, body, AT - tolerance - 1).unwrap_err();
        assert!(new.contains("301 s in the future"), "{new}");
        let tight = sw(&[SECRET]).with_tolerance(Duration::from_secs(10));
        assert!(tight.verify_at(&h, body, AT + 11).is_err());
        assert_eq!(tight.verify_at(&h, body, AT + 10), Ok(()));
    }

    #[test]
    fn one_matching_entry_among_several_passes_and_none_fails() {
        let s = sw(&[SECRET]);
        let wrong = signature(OTHER, ID, AT, BODY);
        let others = format!(
            "v1,bm9wZQ== v2,{} v1a,{} {wrong}",
            &SIGNED[3..],
            &SIGNED[3..]
        );
        let h = headers(ID, &AT.to_string(), &format!("{others} {SIGNED} {wrong}"));
        assert_eq!(s.verify_at(&h, BODY.as_bytes(), AT), Ok(()));
        let h = headers(ID, &AT.to_string(), &others);
        assert!(s.verify_at(&h, BODY.as_bytes(), AT).is_err());
        // Entries spread over two field lines count too.
        let mut h = headers(ID, &AT.to_string(), &wrong);
        h.append("webhook-signature", SIGNED.parse().unwrap());
        assert_eq!(s.verify_at(&h, BODY.as_bytes(), AT), Ok(()));
    }

    #[test]
    fn any_of_several_secrets_verifies_during_a_rotation() {
        let h = headers(ID, &AT.to_string(), SIGNED);
        let rotating = sw(&[OTHER, SECRET]);
        assert_eq!(rotating.verify_at(&h, BODY.as_bytes(), AT), Ok(()));
    }

    #[test]
    fn an_empty_or_truncated_signature_never_matches() {
        // A comparison that zips the two without checking lengths would pass these.
        for bad in [
            "v1,",
            "v1,g0hM",
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1O",
            "v1",
        ] {
            let h = headers(ID, &AT.to_string(), bad);
            let err = sw(&[SECRET])
                .verify_at(&h, BODY.as_bytes(), AT)
                .unwrap_err();
            assert!(err.contains("no `v1,"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_timestamp_that_is_not_whole_seconds_or_a_header_sent_twice_fails() {
        for bad in [
            "",
            "+1614265330",
            "1614265330.0",
            "-5",
            "16142653300000000000000",
        ] {
            let h = headers(ID, bad, SIGNED);
            let err = sw(&[SECRET])
                .verify_at(&h, BODY.as_bytes(), AT)
                .unwrap_err();
            assert!(err.contains("whole number"), "{bad:?}: {err}");
        }
        let mut h = headers(ID, &AT.to_string(), SIGNED);
        h.append("webhook-timestamp", AT.to_string().parse().unwrap());
        let err = sw(&[SECRET])
            .verify_at(&h, BODY.as_bytes(), AT)
            .unwrap_err();
        assert!(err.contains("more than once"), "{err}");
    }

    #[test]
    fn a_secret_without_the_prefix_is_the_same_key_and_a_bad_one_is_refused_without_echoing_it() {
        let h = headers(ID, &AT.to_string(), SIGNED);
        let bare = sw(&[SECRET.strip_prefix(PREFIX).unwrap()]);
        assert_eq!(bare.verify_at(&h, BODY.as_bytes(), AT), Ok(()));
        let e = |secrets: &[&str]| StandardWebhooks::new(secrets).unwrap_err().to_string();
        let not_base64 = e(&[SECRET, "whsec_not*base64"]);
        assert!(not_base64.contains("secret #2 is not"), "{not_base64}");
        assert!(!not_base64.contains("not*base64"), "{not_base64}");
        // `whsec_demo` is base64 for 3 bytes: a passphrase, not a Standard Webhooks secret.
        let short = e(&["whsec_demo"]);
        assert!(short.contains("decodes to 3 bytes"), "{short}");
        assert!(e(&[]).contains("at least one secret"));
        let debug = format!("{:?}", sw(&[SECRET]));
        assert!(!debug.contains("MfKQ"), "{debug}");
    }
}
