//! What the fingerprint hashes is framed: every field is length-prefixed, so that no two
//! sequences of fields hash the same bytes, and the body goes under the tag of its kind.

use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyKind {
    Json,
    Form,
    Raw,
}

impl BodyKind {
    pub(super) fn tag(self) -> &'static [u8] {
        match self {
            BodyKind::Json => b"jcs",
            BodyKind::Form => b"form",
            BodyKind::Raw => b"raw",
        }
    }
}

pub(super) struct Hasher(pub(super) Sha256);

impl Hasher {
    /// Length-prefixed, so no two field sequences hash the same bytes.
    pub(super) fn field(&mut self, bytes: &[u8]) {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }
}

/// Appends a length-prefixed field to `out`.
pub(super) fn frame(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}
