//! The fingerprint's JSON canonicaliser on arbitrary bytes: it must never panic, and its
//! output, where it is still JSON (no exact-form number, no lone surrogate), must be a fixed
//! point.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::__bench::canonical_json;

fuzz_target!(|data: &[u8]| {
    let Some(once) = canonical_json(data) else {
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
