use std::cmp::Ordering;

use super::super::object::copy_short;
use super::*;

#[test]
fn copy_short_copies_every_length_across_its_move_sizes() {
    let src: Vec<u8> = (1..=80).collect();
    for n in 0..=80 {
        for offset in 0..3 {
            let mut dst = vec![0; n + 6];
            copy_short(&mut dst[offset..offset + n], &src[..n]);
            assert_eq!(&dst[offset..offset + n], &src[..n], "length {n}");
            assert!(dst[..offset]
                .iter()
                .chain(&dst[offset + n..])
                .all(|&b| b == 0));
        }
    }
}

#[test]
fn an_unsorted_outermost_object_is_hashed_in_sorted_order() {
    for doc in [
        &br#"{ "b": 1, "a": [2, {"d":1,"c":2}] }"#[..],
        br#"{"b":"\u00e9","a":1}"#,
        br#"{"b":1,"a":1}"#,
        br#"{"a":1,"b":1}"#,
        br#"[{"b":1,"a":1}]"#,
    ] {
        let text = canonical_json(doc, &[]).unwrap();
        let digest: [u8; 32] = Sha256::digest(&text).into();
        assert_eq!(canonical_json_digest(doc), Some(digest), "{text:?}");
    }
    let long = "x".repeat(DEFER_TOP_MIN);
    let doc = format!(r#"{{ "b": "{long}", "a": 2 }}"#);
    let text = canonical_json(doc.as_bytes(), &[]).unwrap();
    assert_eq!(text, format!(r#"{{"a":2,"b":"{long}"}}"#).into_bytes());
    let left_unsorted = with_buffers(|b| {
        assert!(canonicalise(
            doc.as_bytes(),
            &[],
            &mut b.out,
            &mut b.work,
            true
        ));
        (b.out.clone(), b.work.top.clone())
    });
    let b_end = 7 + long.len();
    let unsorted = format!(r#"{{"b":"{long}","a":2}}"#).into_bytes();
    assert_eq!(
        left_unsorted,
        (unsorted, vec![(b_end + 1, b_end + 6), (1, b_end)])
    );
    let digest: [u8; 32] = Sha256::digest(&text).into();
    assert_eq!(canonical_json_digest(doc.as_bytes()), Some(digest));
    // Small objects are sorted in `out` as before.
    let small = with_buffers(|b| {
        assert!(canonicalise(
            br#"{ "b": 1, "a": 2 }"#,
            &[],
            &mut b.out,
            &mut b.work,
            true
        ));
        (b.out.clone(), b.work.top.is_empty())
    });
    assert_eq!(small, (br#"{"a":2,"b":1}"#.to_vec(), true));
}

#[test]
fn large_objects_sort_and_refuse_duplicates_too() {
    let keys: Vec<String> = (0..40).map(|k| format!("k{:02}", (k * 17) % 40)).collect();
    let doc = |keys: &[String]| {
        let members: Vec<String> = keys
            .iter()
            .map(|k| format!("\"{k}\":[{{\"b\":1,\"a\":2}}]"))
            .collect();
        format!("{{{}}}", members.join(","))
    };
    let mut sorted = keys.clone();
    sorted.sort();
    let expected = doc(&sorted).replace("{\"b\":1,\"a\":2}", "{\"a\":2,\"b\":1}");
    assert_eq!(jcs(&doc(&keys)).unwrap(), expected);
    // With whitespace the members are rewritten from the output, not the input.
    assert_eq!(jcs(&doc(&keys).replace(',', " , ")).unwrap(), expected);
    let mut twice = keys.clone();
    twice[39] = twice[3].clone();
    assert_eq!(jcs(&doc(&twice)), None);
}

/// Found by the fuzz target (minimised): keys that are not UTF-8 were compared by their
/// bytes when they held no escape and no byte from 0xF0, and by a lossy reading's UTF-16
/// units otherwise; the two orders disagree on such keys, and the sort of this object of
/// more than 16 members panicked ("user-provided comparison function does not correctly
/// implement a total order"). Such a body is hashed raw.
#[test]
fn keys_that_are_not_utf8_do_not_break_the_sort() {
    let never = [JsonPointer::parse("/never").unwrap()];
    let doc: &[u8] = b"{\"\xb8\":2,\"a``````\xb8b\":2,\"b\":2,\"\":2,\"\":2,\"\":2,\"a``````\xffb\":2,\"\x84\":2,\"\x84\":2,\"\xb8\":2,\"\x84\":2,\"\":2,\"\":2,\"\":2,\"a\":2,\"\x84\":2,\"a``````\x84\x84\":2,\"\x84\":2,\"\":2,\"b\":2,\"\":3}";
    assert_eq!(canonical_json(doc, &[]), None);
    assert_eq!(canonical_json(doc, &never), None);
    assert_eq!(canonical_json_digest(doc), None);
}

#[test]
fn objects_sharing_a_key_order_sort_alike_and_others_are_not_taken_for_them() {
    // The first object's order is remembered and reused for the next ones.
    assert_eq!(
        jcs(r#"[{"b":1,"c":2,"a":3},{"b":4,"c":5,"a":6},{"b":7,"c":8,"a":9}]"#).unwrap(),
        r#"[{"a":3,"b":1,"c":2},{"a":6,"b":4,"c":5},{"a":9,"b":7,"c":8}]"#
    );
    // Same member count, other keys: sorted afresh.
    assert_eq!(
        jcs(r#"[{"b":1,"c":2,"a":3},{"c":1,"a":2,"b":3},{"a":1,"c":2,"b":3}]"#).unwrap(),
        r#"[{"a":3,"b":1,"c":2},{"a":2,"b":3,"c":1},{"a":1,"b":3,"c":2}]"#
    );
    // Keys alike in their first 8 bytes: never remembered, always compared whole.
    assert_eq!(
        jcs(r#"[{"abcdefgh2":1,"abcdefgh1":2},{"abcdefgh1":1,"abcdefgh2":2}]"#).unwrap(),
        r#"[{"abcdefgh1":2,"abcdefgh2":1},{"abcdefgh1":1,"abcdefgh2":2}]"#
    );
    // A duplicate key after a remembered order is still refused.
    assert_eq!(jcs(r#"[{"b":1,"a":2},{"b":1,"b":2}]"#), None);
    assert_eq!(jcs(r#"[{"b":1,"a":2},{"b":1,"a":2,"a":3}]"#), None);
    // A key with an escape (not simple) in a remembered shape's place.
    assert_eq!(
        jcs(r#"[{"b":1,"a":2},{"b":1,"\u0061":2}]"#).unwrap(),
        r#"[{"a":2,"b":1},{"a":2,"b":1}]"#
    );
    // Orders outlive the call: the same shape in the next document.
    for _ in 0..2 {
        assert_eq!(
            jcs(r#"{"z":{"y":1,"x":2},"a":0}"#).unwrap(),
            r#"{"a":0,"z":{"x":2,"y":1}}"#
        );
    }
    // Each of those agrees with the general path (which excludes a field that is not there).
    let never = [JsonPointer::parse("/never").unwrap()];
    for doc in [
        r#"[{"b":1,"c":2,"a":3},{"b":4,"c":5,"a":6}]"#,
        r#"[{"abcdefgh2":1,"abcdefgh1":2},{"abcdefgh1":1,"abcdefgh2":2}]"#,
    ] {
        assert_eq!(
            canonical_json(doc.as_bytes(), &[]),
            canonical_json(doc.as_bytes(), &never)
        );
    }
}

#[test]
fn keys_sort_by_utf16_code_units() {
    let keys = [
        "a",
        "b",
        "ab",
        "\u{e9}",
        "\u{fb33}",
        "\u{ffff}",
        "\u{1f600}",
        "\u{10000}",
        "z\u{1f600}",
        "z\u{e000}",
        "",
        "\"",
        "\\",
        "\n",
    ];
    for a in keys {
        for b in keys {
            if a == b {
                continue;
            }
            let doc = format!(
                "{{{}:1,{}:2}}",
                serde_json::to_string(a).unwrap(),
                serde_json::to_string(b).unwrap()
            );
            let out = jcs(&doc).unwrap();
            let first_a = a.encode_utf16().cmp(b.encode_utf16()) == Ordering::Less;
            let expected = if first_a { "1,\"" } else { "2,\"" };
            assert!(
                out.contains(&format!(":{expected}")),
                "{a:?} vs {b:?}: {out}"
            );
        }
    }
}

#[test]
fn whitespace_before_the_brace_of_an_unsorted_object_is_not_kept() {
    // Found by the property tests at 200,000 cases: an object still wholly in the input
    // but for whitespace before its `}` was sorted with that whitespace copied in, and
    // a debug assertion fired (release builds kept the stray bytes in the output).
    for (doc, want) in [
        ("{\"a\":null,\"\":\"\"\n\t\t }", r#"{"":"","a":null}"#),
        (
            "\r {\"aaa\":null,\"\":{\"\":\"\"}\n\t}\r\t",
            r#"{"":{"":""},"aaa":null}"#,
        ),
        ("[{\"b\":1,\"a\":2} ]", r#"[{"a":2,"b":1}]"#),
        ("{\"b\":1,\"a\":2 }", r#"{"a":2,"b":1}"#),
    ] {
        let never = [JsonPointer::parse("/no key is this long").unwrap()];
        for excluded in [&[][..], &never[..]] {
            let out = canonical_json(doc.as_bytes(), excluded).expect(doc);
            assert_eq!(String::from_utf8(out).unwrap(), want, "{doc:?}");
        }
        assert_eq!(
            canonical_json_digest(doc.as_bytes()),
            Some(<[u8; 32]>::from(Sha256::digest(want.as_bytes()))),
            "{doc:?}"
        );
    }
}
