//! The fingerprint's JSON canonicaliser on arbitrary bytes: it must never panic, its output,
//! where it is still JSON (no exact-form number, no lone surrogate), must be a fixed point,
//! and the digest the fingerprint takes (which hashes a large outermost object's members in
//! order where they lie, not a sorted copy) must be SHA-256 of that output.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use tower_idempotency::__bench::{canonical_json, canonical_json_digest};

fuzz_target!(|data: &[u8]| {
    let canonical = canonical_json(data);
    assert_eq!(
        canonical_json_digest(data),
        canonical.as_deref().map(|c| <[u8; 32]>::from(Sha256::digest(c))),
        "the digest is not SHA-256 of the canonical form"
    );
    let Some(once) = canonical else {
        return;
    };
    let exact_number = once.contains(&b'#');
    let lone_surrogate = once.windows(3).any(|w| w == b"\\ud");
    if !exact_number && !lone_surrogate {
        assert_eq!(
            canonical_json(&once).as_deref(),
            Some(&once[..]),
            "not a fixed point"
        );
    }
});
