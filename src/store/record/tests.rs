//! The data model's encodings and ids.
use super::*;

#[test]
fn completion_round_trips_binary_body_headers_and_trailers() {
    let mut headers = HeaderMap::new();
    headers.append(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.append("link", HeaderValue::from_static("<a>"));
    headers.append("link", HeaderValue::from_static("<b>"));
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let mut r = StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from(body),
        Some(trailers),
    );
    r.vary = Some(VaryGuard {
        names: "accept,authorization".into(),
        digest: [3; 32],
    });
    let c = Completion::Response(r);
    assert_eq!(Completion::decode(Bytes::from(c.encode())).unwrap(), c);
    let t = Completion::Tombstone {
        status: StatusCode::OK,
    };
    assert_eq!(Completion::decode(Bytes::from(t.encode())).unwrap(), t);
}

#[test]
fn oversized_header_maps_are_decode_errors_not_panics() {
    // 30,000 fields: more than a HeaderMap can hold (its `append` would panic).
    let encode = |count: u32, value_len: usize| {
        let mut out = vec![COMPLETION_FORMAT, KIND_RESPONSE, 0, 200];
        out.put_u32(count);
        for i in 0..count {
            let name = format!("x-{i}");
            out.put_u16(name.len() as u16);
            out.extend_from_slice(name.as_bytes());
            out.put_u32(value_len as u32);
            out.extend(std::iter::repeat_n(b'v', value_len));
        }
        out.put_u32(0);
        out.put_u8(0);
        out.put_u8(0);
        Bytes::from(out)
    };
    let err = Completion::decode(encode(30_000, 1)).unwrap_err();
    assert_eq!(err, DecodeError("too many header fields"));
    let err = Completion::decode(encode(2, MAX_RECORDED_FIELD_BYTES)).unwrap_err();
    assert_eq!(err, DecodeError("header fields too large"));
    let ok = Completion::decode(encode(MAX_RECORDED_FIELDS as u32, 1)).unwrap();
    assert!(matches!(ok, Completion::Response(r) if r.headers.len() == MAX_RECORDED_FIELDS));
}

#[test]
fn truncated_or_unknown_encodings_are_errors_not_panics() {
    let mut r = StoredResponse::new(
        StatusCode::OK,
        HeaderMap::new(),
        Bytes::from_static(b"hello"),
        None,
    );
    r.vary = Some(VaryGuard {
        names: "authorization".into(),
        digest: [1; 32],
    });
    let bytes = Completion::Response(r).encode();
    for cut in 0..bytes.len() {
        assert!(Completion::decode(Bytes::copy_from_slice(&bytes[..cut])).is_err());
    }
    let mut v3 = bytes.clone();
    v3[0] = 3;
    assert!(Completion::decode(Bytes::from(v3)).is_err());
    let mut bad_flag = bytes.clone();
    let flag = bytes.len() - 1 - 32 - "authorization".len() - 4;
    bad_flag[flag] = 2;
    assert_eq!(
        Completion::decode(Bytes::from(bad_flag)).unwrap_err(),
        DecodeError("invalid vary flag")
    );
}

#[test]
fn an_encoded_response_fills_exactly_the_room_it_reserved() {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.append("x-a", HeaderValue::from_static("1"));
    headers.append("x-a", HeaderValue::from_static("22"));
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let mut r = StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from_static(b"{}"),
        None,
    );
    let plain = Completion::Response(r.clone()).encode();
    assert_eq!(plain.len(), plain.capacity());
    r.trailers = Some(trailers);
    r.vary = Some(VaryGuard {
        names: "accept,authorization".into(),
        digest: [3; 32],
    });
    let full = Completion::Response(r).encode();
    assert_eq!(full.len(), full.capacity());
}

#[test]
fn cached_ids_equal_derived_ones_past_the_cache_size() {
    let both = |scope: Option<&str>, key: &str| (ScopeId::new(scope), RecordId::new(scope, key));
    assert_eq!(RecordId::cached(None, "k"), both(None, "k"));
    let names: Vec<String> = (0..3 * SCOPE_CACHE)
        .map(|i| format!("tenant-{i}"))
        .collect();
    for round in 0..2 {
        for (i, name) in names.iter().enumerate() {
            let want = both(Some(name), "k");
            assert_eq!(
                RecordId::cached(Some(name), "k"),
                want,
                "round {round}, scope {i}"
            );
            // Hit while still remembered, for another key too.
            assert_eq!(RecordId::cached(Some(name), "k"), want);
            assert_eq!(RecordId::cached(Some(name), "k2"), both(Some(name), "k2"));
        }
    }
    assert_ne!(RecordId::cached(Some(""), "k"), RecordId::cached(None, "k"));
}

#[test]
fn record_ids_keep_their_values() {
    // Stores keep record ids: a release that moved one would lose every record made
    // before it. Scopes either side of a block boundary, keys either side of one block.
    let long_scope = "s".repeat(27); // 28 + 9 + 27 = 64: no padding
    let (s28, k47, k48) = ("s".repeat(28), "k".repeat(47), "k".repeat(48));
    let cases = [
        (None, "k"),
        (Some(""), "k"),
        (Some("shop"), "3f2b8c1e-9d4a-4b6f-a1c2-7e8d9f0a1b2c"),
        (Some("shop"), k47.as_str()),
        (Some("shop"), k48.as_str()),
        (Some(long_scope.as_str()), "k"),
        (Some(s28.as_str()), "k"),
    ];
    let got: Vec<String> = cases
        .iter()
        .map(|(scope, key)| RecordId::new(*scope, key).to_hex())
        .collect();
    let want = [
        "84592e196c17861c8bbce8efd3989b8e40d659748ff7f27248297fde096ebdb0",
        "a50d01db625705c3a56e61594adb5fc3643bca4bdcf9cb8e695a304184fde860",
        "7deed18380b7eb2cf8f6464dd1e98e9b1324bc89161c52be867e5957c9ec705b",
        "7deed1830234ff93e39a6cd5e952054cfbb7c597a5109cc7bd23e958ac27cc26",
        "7deed183249d866c99265b5720981ac720e82923400e9f7f115e2cf24020b43f",
        "0e9ba3cb4f07a004071beeb3908ad7902a31d2ef475f108b9f4112b75a3ccc9a",
        "c6fa14e7aab44823649844c51dcd2eb2287393558fbaa4e131c9ece31f0f3b73",
    ];
    assert_eq!(got, want, "{got:#?}");
}

#[test]
fn record_ids_separate_scopes_and_length_prefix_parts() {
    assert_ne!(
        RecordId::new(Some("ab"), "c"),
        RecordId::new(Some("a"), "bc")
    );
    assert_ne!(RecordId::new(None, "k"), RecordId::new(Some(""), "k"));
    assert_eq!(RecordId::new(Some("t"), "k"), RecordId::new(Some("t"), "k"));
}

#[test]
fn a_record_id_starts_with_its_scope_ids_prefix() {
    let n = RecordId::SCOPE_PREFIX;
    for scope in [None, Some(""), Some("tenant-a"), Some("tenant-b")] {
        let a = RecordId::new(scope, "k1");
        let b = RecordId::new(scope, "k2");
        assert_eq!(a.as_bytes()[..n], ScopeId::new(scope).as_bytes()[..n]);
        assert_eq!(a.as_bytes()[..n], b.as_bytes()[..n]);
        assert_ne!(a, b, "the rest still tells keys apart");
    }
    assert_ne!(
        RecordId::new(Some("tenant-a"), "k").as_bytes()[..n],
        RecordId::new(Some("tenant-b"), "k").as_bytes()[..n]
    );
}

/// Maps of ids hash only part of each: one scope's ids, which share their first bytes, must
/// still hash apart, and equal ids alike.
#[test]
fn one_scopes_record_ids_hash_apart() {
    use std::hash::BuildHasher;
    let hasher =
        std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
    let hashes: std::collections::HashSet<u64> = (0..10_000)
        .map(|k| hasher.hash_one(RecordId::new(Some("t"), &format!("order-{k}"))))
        .collect();
    assert_eq!(hashes.len(), 10_000);
    assert_eq!(
        hasher.hash_one(RecordId::new(Some("t"), "k")),
        hasher.hash_one(RecordId::new(Some("t"), "k"))
    );
}

#[test]
fn tokens_of_the_same_generation_differ() {
    assert_ne!(Token::generate(1).unwrap(), Token::generate(1).unwrap());
    assert_eq!(Token::generate(7).unwrap().generation(), 7);
}

#[test]
fn a_released_token_keeps_its_generation_and_leads_back_to_no_holder() {
    let t = Token::from_parts(2, [9; 16]);
    let released = t.released();
    assert_eq!(released.generation(), 2);
    assert_ne!(released, t);
    assert_eq!(released, t.released(), "a resent release finds its own");
    assert_ne!(released.released(), t);
    assert_ne!(Token::from_parts(2, [8; 16]).released(), released);
}

#[test]
fn a_failed_random_source_is_an_error_not_a_zero_nonce() {
    FAIL_RANDOM.with(|f| f.set(true));
    let r = Token::generate(1);
    FAIL_RANDOM.with(|f| f.set(false));
    let e = r.expect_err("no token without randomness");
    assert_eq!(e.kind(), StoreErrorKind::Unavailable);
    let source = std::error::Error::source(&e)
        .expect("the cause is kept")
        .to_string();
    assert!(source.contains("random"), "{source}");
}
