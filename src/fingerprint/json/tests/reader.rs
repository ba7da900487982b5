use super::*;

#[test]
fn only_duplicate_keys_and_invalid_json_fall_back_to_raw() {
    assert_eq!(jcs(r#"{"a":1,"a":2}"#), None, "duplicate keys");
    assert_eq!(jcs(r#"{"b":{"a":1,"\u0061":2}}"#), None, "after unescaping");
    assert_eq!(jcs(r#"{"\ud800":1,"\uD800":2}"#), None, "lone surrogates");
    for bad in [
        "",
        " ",
        "{\"a\":1",
        "{\"a\":1} x",
        "[01]",
        "[1.]",
        "[.5]",
        "[1e]",
        "[-]",
        "[+1]",
        "\"tab\there\"",
        "\"\\x\"",
        "\"\\u12\"",
        "\"\\u12g4\"",
        "[1,]",
        "{\"a\" 1}",
        "{,}",
        "[,1]",
        "tru",
        "nul",
        "{1:2}",
        "[1 2]",
        "\"abc",
        "[\"a\\\"]",
    ] {
        assert_eq!(jcs(bad), None, "{bad:?}");
    }
    assert!(
        canonical_json(&[0x22, 0xff, 0x22], &[]).is_none(),
        "invalid UTF-8"
    );
}

#[test]
fn deep_nesting_is_canonicalised_without_recursion() {
    let n = 100_000;
    let deep = format!("{}1{}", "[{\"b\":0, \"a\":".repeat(n), "}]".repeat(n));
    let out = jcs(&deep).unwrap();
    assert_eq!(
        out,
        format!("{}1{}", "[{\"a\":".repeat(n), ",\"b\":0}]".repeat(n))
    );
}

#[test]
fn excluded_pointers_remove_fields_anywhere() {
    let ptrs = [
        JsonPointer::parse("/meta/request_time").unwrap(),
        JsonPointer::parse("/items/0/note").unwrap(),
        JsonPointer::parse("/a~1b").unwrap(),
        JsonPointer::parse("/list/1").unwrap(),
        JsonPointer::parse("/q\"t").unwrap(),
    ];
    // Excluded members are dropped before duplicates are looked for: `q"t` twice, both
    // excluded, leaves nothing to merge.
    let out = canonical_json(
        br#"{"a/b":1,"items":[{"note":"x","sku":"s"},{"note":"y"}],"meta":{"request_time":"t","z":1},"k":2,"list":[0,{"x":1},2],"q\u0022t":3,"\u0071\"t":4}"#,
        &ptrs,
    )
    .unwrap();
    assert_eq!(
        String::from_utf8(out).unwrap(),
        r#"{"items":[{"sku":"s"},{"note":"y"}],"k":2,"list":[0,2],"meta":{"z":1}}"#
    );
    // A duplicate that is not excluded still falls back.
    assert_eq!(
        canonical_json(br#"{"meta":{"z":1},"meta":{"z":2}}"#, &ptrs),
        None
    );
    // An excluded field's value does not count, whatever it is.
    assert_eq!(
        canonical_json(br#"{"t":1,"v":2}"#, &ptrs[..1]),
        canonical_json(br#"{"v":2,"t":1}"#, &ptrs[..1])
    );
    assert_eq!(
        canonical_json(br#"{"meta":{"request_time":1},"v":2}"#, &ptrs[..1]),
        canonical_json(br#"{"v":2,"meta":{"request_time":[3]}}"#, &ptrs[..1])
    );
    assert!(JsonPointer::parse("").is_err());
    assert!(JsonPointer::parse("a").is_err());
    assert!(JsonPointer::parse("/a~2").is_err());
}
