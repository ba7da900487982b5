//! What names an operation: its scope, its key, and the fingerprint of its input.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::store::record::Fingerprint;

/// Which operation this is, and with which input: the scope and key that name its record, and
/// the fingerprint that tells a retry from another request reusing the key.
///
/// Built from the message or job: its id as the key, and its payload, hashed as canonical JSON
/// ([`json`](Self::json): member order and insignificant whitespace do not count) or as bytes
/// ([`bytes`](Self::bytes)). The fingerprint is domain-separated from the HTTP layer's, so an
/// operation and an HTTP request never match even under one scope and key.
#[derive(Clone)]
pub struct Identity {
    pub(crate) scope: Option<Arc<str>>,
    pub(crate) key: Arc<str>,
    pub(crate) fingerprint: Fingerprint,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key and scope may be a customer's: kept out of logs, as the layer does.
        f.debug_struct("Identity")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

/// The input of an operation was refused before anything was stored or run.
#[derive(Debug)]
#[non_exhaustive]
pub enum InvalidInput {
    /// The message or job has no key (a closure given to
    /// [`OperationLayer`](super::OperationLayer) says so with this).
    KeyMissing,
    /// The key is empty, longer than 255 bytes, or not visible ASCII (`0x21`-`0x7E`): the
    /// rules the HTTP layer holds its keys to.
    KeyInvalid(&'static str),
    /// The payload does not serialize to JSON (a map with non-string keys, a failing
    /// `Serialize` impl).
    Unserializable(serde_json::Error),
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::KeyMissing => f.write_str("the operation has no idempotency key"),
            Self::KeyInvalid(why) => f.write_str(why),
            Self::Unserializable(e) => write!(f, "the operation's input does not serialize: {e}"),
        }
    }
}

impl std::error::Error for InvalidInput {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unserializable(e) => Some(e),
            _ => None,
        }
    }
}

/// Tags of what the fingerprint hashed, after the domain.
const JSON: u8 = 1;
const BYTES: u8 = 2;
/// JSON the canonical form refuses, hashed as serde_json wrote it: not [`BYTES`], so it never
/// matches the same bytes given to [`Identity::bytes`].
const JSON_AS_WRITTEN: u8 = 3;

impl Identity {
    /// The operation keyed `key`, whose input is `payload` serialized as JSON and hashed in
    /// canonical form (the crate's canonical JSON: two payloads that differ only in member
    /// order are the same input).
    pub fn json<P: Serialize + ?Sized>(key: &str, payload: &P) -> Result<Self, InvalidInput> {
        let key = checked(key)?;
        let body = serde_json::to_vec(payload).map_err(InvalidInput::Unserializable)?;
        let digest = crate::fingerprint::canonical_json_digest(&body);
        let fingerprint = match digest {
            Some(digest) => fingerprint(JSON, &digest),
            // serde_json writes valid JSON; a value the canonical form refuses (a number
            // past its range) is hashed as the bytes serde_json wrote.
            None => fingerprint(JSON_AS_WRITTEN, &body),
        };
        Ok(Self {
            scope: None,
            key,
            fingerprint,
        })
    }

    /// The operation keyed `key`, whose input is `payload` as it is, byte for byte.
    pub fn bytes(key: &str, payload: &[u8]) -> Result<Self, InvalidInput> {
        Ok(Self {
            scope: None,
            key: checked(key)?,
            fingerprint: fingerprint(BYTES, payload),
        })
    }

    /// Puts the key in `scope` (a tenant, a queue, a job's name): the same key in two scopes
    /// names two records. Without one the key space is the store's whole, unscoped one.
    #[must_use]
    pub fn in_scope(mut self, scope: impl Into<Arc<str>>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The input's fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }
}

fn checked(key: &str) -> Result<Arc<str>, InvalidInput> {
    crate::key::check(key.as_bytes()).map_err(|e| InvalidInput::KeyInvalid(e.detail()))
}

fn fingerprint(tag: u8, input: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"tower-idempotency operation v1\0");
    h.update([tag]);
    h.update((input.len() as u64).to_be_bytes());
    h.update(input);
    Fingerprint::from_bytes(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_order_does_not_count_and_values_do() {
        let a = Identity::json("k", &serde_json::json!({"id": "p-1", "amount": 10})).unwrap();
        let b = Identity::json("k", &serde_json::json!({"amount": 10, "id": "p-1"})).unwrap();
        let c = Identity::json("k", &serde_json::json!({"amount": 11, "id": "p-1"})).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        // The same bytes as JSON and as raw bytes are two inputs.
        let raw = Identity::bytes("k", br#"{"amount":10,"id":"p-1"}"#).unwrap();
        assert_ne!(a.fingerprint(), raw.fingerprint());
    }

    #[test]
    fn bad_keys_and_payloads_are_refused() {
        let long = "k".repeat(256);
        assert!(matches!(
            Identity::bytes("", b""),
            Err(InvalidInput::KeyInvalid(_))
        ));
        assert!(matches!(
            Identity::bytes(&long, b""),
            Err(InvalidInput::KeyInvalid(_))
        ));
        assert!(matches!(
            Identity::bytes("a b", b""),
            Err(InvalidInput::KeyInvalid(_))
        ));
        assert!(Identity::bytes(&long[..255], b"").is_ok());
        let mut map = std::collections::BTreeMap::new();
        map.insert((1, 2), "tuple keys are not JSON");
        assert!(matches!(
            Identity::json("k", &map),
            Err(InvalidInput::Unserializable(_))
        ));
        assert!(!format!("{:?}", Identity::bytes("secret", b"").unwrap()).contains("secret"));
    }
}
