use super::*;

#[test]
fn lone_surrogates_are_kept_as_escapes() {
    assert_eq!(jcs(r#""\ud800""#).unwrap(), r#""\ud800""#);
    assert_eq!(jcs(r#""\uDC00x""#).unwrap(), r#""\udc00x""#);
    assert_eq!(jcs(r#""\uD800\u0041""#).unwrap(), r#""\ud800A""#);
    assert_eq!(jcs(r#""\ud83d\ude00""#).unwrap(), "\"\u{1f600}\"");
    assert_eq!(jcs("\"\\ude00\\ud83d\"").unwrap(), r#""\ude00\ud83d""#);
    // Not the escaped backslash followed by `ud800`.
    assert_ne!(jcs(r#""\ud800""#), jcs(r#""\\ud800""#));
    // Keys too, in UTF-16 order: U+D800 sorts between U+D7FF and U+E000.
    assert_eq!(
        jcs("{\"\u{e000}\":3,\"\\ud800\":2,\"\u{d7ff}\":1}").unwrap(),
        "{\"\u{d7ff}\":1,\"\\ud800\":2,\"\u{e000}\":3}"
    );
}

#[test]
fn invalid_utf8_anywhere_is_refused_and_other_text_kept() {
    let never = [JsonPointer::parse("/never").unwrap()];
    let long = "a".repeat(24);
    // Both loops check UTF-8 only after a byte above 0x7f turned up in a string.
    let both = |doc: &[u8]| {
        let plain = canonical_json(doc, &[]);
        assert_eq!(plain, canonical_json(doc, &never), "{doc:?}");
        plain.map(|v| String::from_utf8(v).unwrap())
    };
    for (doc, canonical) in [
        ("[\"é\"]", "[\"é\"]"),
        ("{\"é\":1,\"a\":2}", "{\"a\":2,\"é\":1}"),
        ("[\"\\u00e9é\",\"é\\u00e9\"]", "[\"éé\",\"éé\"]"),
        (
            &format!("[\"{long}日本{long}\"]"),
            &format!("[\"{long}日本{long}\"]"),
        ),
        // UTF-16 order: U+1F600 is D83D DE00, below U+FFFF (UTF-8 byte order is not).
        (
            "[\"😀\",{\"\u{ffff}\":2,\"😀\":1}]",
            "[\"😀\",{\"😀\":1,\"\u{ffff}\":2}]",
        ),
    ] {
        assert_eq!(both(doc.as_bytes()).as_deref(), Some(canonical), "{doc}");
    }
    let bad: [&[u8]; 10] = [
        b"[\"\xff\"]",
        b"[\"a\xffb\"]",
        b"{\"\xff\":1}",
        b"{\"a\":1,\"\xc3\":2}",
        b"[\"\\u00e9\xff\"]",
        b"[\"\xc3\"]",
        b"[\"\xed\xa0\x80\"]",
        b"[\"\xc0\x80\"]",
        b"[\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\xffaaaa\"]",
        b"[\"\xc3\xa9\",\"\xa9\"]",
    ];
    for doc in bad {
        assert_eq!(both(doc), None, "{doc:?}");
    }
    // Outside strings such a byte is a syntax error whatever follows.
    assert_eq!(both(b"[1]\xff"), None);
    assert_eq!(both(b"[\xc3\xa9]"), None);
}
