//! What the fingerprint hashes is framed: every field is length-prefixed, so that no two
//! sequences of fields hash the same bytes, and the body goes under the tag of its kind.

use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyKind {
    Json,
    Form,
    Raw,
    /// gRPC message frames: hashed raw, then the `grpc-encoding`.
    Grpc,
}

impl BodyKind {
    /// The byte the body goes under (gRPC frames are raw bytes).
    pub(super) fn tag(self) -> u8 {
        match self {
            BodyKind::Json => b'j',
            BodyKind::Form => b'f',
            BodyKind::Raw | BodyKind::Grpc => b'r',
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
