use super::*;

#[test]
fn reordered_keys_and_whitespace_canonicalise_alike() {
    let a = jcs(r#"{"amount": 100, "currency":"EUR", "meta": {"b": [1, 2.5, true], "a": null}}"#);
    let b =
        jcs("{\n  \"meta\":{\"a\":null,\"b\":[1,2.5,true]},\"currency\":\"EUR\",\"amount\":100}");
    assert_eq!(a, b);
    assert_eq!(
        a.unwrap(),
        r#"{"amount":100,"currency":"EUR","meta":{"a":null,"b":[1,2.5,true]}}"#
    );
}

/// RFC 8785 Appendix B: IEEE 754 bit patterns and their ECMAScript forms.
const RFC8785_NUMBERS: &[(u64, &str)] = &[
    (0x0000000000000000, "0"),
    (0x8000000000000000, "0"),
    (0x0000000000000001, "5e-324"),
    (0x8000000000000001, "-5e-324"),
    (0x7fefffffffffffff, "1.7976931348623157e+308"),
    (0xffefffffffffffff, "-1.7976931348623157e+308"),
    (0x4340000000000000, "9007199254740992"),
    (0xc340000000000000, "-9007199254740992"),
    (0x4430000000000000, "295147905179352830000"),
    (0x44b52d02c7e14af5, "9.999999999999997e+22"),
    (0x44b52d02c7e14af6, "1e+23"),
    (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
    (0x444b1ae4d6e2ef4e, "999999999999999700000"),
    (0x444b1ae4d6e2ef4f, "999999999999999900000"),
    (0x444b1ae4d6e2ef50, "1e+21"),
    (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
    (0x3eb0c6f7a0b5ed8d, "0.000001"),
    (0x41b3de4355555553, "333333333.3333332"),
    (0x41b3de4355555554, "333333333.33333325"),
    (0x41b3de4355555555, "333333333.3333333"),
    (0x41b3de4355555556, "333333333.3333334"),
    (0x41b3de4355555557, "333333333.33333343"),
    (0xbecbf647612f3696, "-0.0000033333333333333333"),
    (0x43143ff3c1cb0959, "1424953923781206.2"),
];

#[test]
fn rfc8785_number_table_is_written_byte_for_byte() {
    for &(bits, expected) in RFC8785_NUMBERS {
        let x = f64::from_bits(bits);
        assert_eq!(
            ryu_js::Buffer::new().format_finite(x),
            expected,
            "{bits:016x}"
        );
        // Spelled as written, and as Rust's shortest forms of the same double.
        for spelling in [
            expected.to_owned(),
            format!("{x:e}"),
            format!("{x:E}"),
            format!("{x}"),
        ] {
            assert_eq!(
                jcs(&spelling),
                Some(same_or_exact(&spelling, expected)),
                "{spelling}"
            );
        }
    }
    // NaN and Infinity are not JSON.
    assert_eq!(jcs("NaN"), None);
    assert_eq!(jcs("Infinity"), None);
}

#[test]
fn rust_and_ecmascript_break_ties_apart() {
    let x = f64::from_bits(0x43143ff3c1cb0959);
    assert_eq!(format!("{x}"), "1424953923781206.3");
    assert_eq!(jcs("1424953923781206.3").unwrap(), "#14249539237812063e-1");
    assert_eq!(jcs("1424953923781206.2").unwrap(), "1424953923781206.2");
    assert_eq!(
        jcs("1424953923781206.25").unwrap(),
        "#142495392378120625e-2"
    );
}

#[test]
fn rfc8785_sorting_example() {
    let input = r#"{
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\ud83d\ude00": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis"
    }"#;
    let expected = "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
        \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
        \"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
    assert_eq!(jcs(input).unwrap(), expected);
}

const VALUES_OUT: &str = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;

/// RFC 8785 3.2.4 and the json-canonicalization test data (`testdata/input` and
/// `output`): arrays, french, structures, unicode, values, weird.
#[test]
fn rfc8785_published_test_data() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "arrays",
            "[\n  56,\n  {\n    \"d\": true,\n    \"10\": null,\n    \"1\": [ ]\n  }\n]\n",
            r#"[56,{"1":[],"10":null,"d":true}]"#,
        ),
        (
            "french",
            "{\n  \"peach\": \"This sorting order\",\n  \"p\u{e9}ch\u{e9}\": \"is wrong according to French\",\n  \"p\u{ea}che\": \"but canonicalization MUST\",\n  \"sin\":   \"ignore locale\"\n}\n",
            "{\"peach\":\"This sorting order\",\"p\u{e9}ch\u{e9}\":\"is wrong according to French\",\"p\u{ea}che\":\"but canonicalization MUST\",\"sin\":\"ignore locale\"}",
        ),
        (
            "structures",
            "{\n  \"1\": {\"f\": {\"f\": \"hi\",\"F\": 5} ,\"\\n\": 56.0},\n  \"10\": { },\n  \"\": \"empty\",\n  \"a\": { },\n  \"111\": [ {\"e\": \"yes\",\"E\": \"no\" } ],\n  \"A\": { }\n}\n",
            r#"{"":"empty","1":{"\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{"E":"no","e":"yes"}],"A":{},"a":{}}"#,
        ),
        (
            "unicode",
            "{\n  \"Unnormalized Unicode\":\"A\\u030a\"\n}\n",
            "{\"Unnormalized Unicode\":\"A\u{30a}\"}",
        ),
        (
            // As published but for its first number, see below.
            "values",
            "{\n  \"numbers\": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],\n  \"string\": \"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\",\n  \"literals\": [null, true, false]\n}\n",
            VALUES_OUT,
        ),
        (
            "weird",
            "{\n  \"\\u20ac\": \"Euro Sign\",\n  \"\\r\": \"Carriage Return\",\n  \"\\u000a\": \"Newline\",\n  \"1\": \"One\",\n  \"\\u0080\": \"Control\\u007f\",\n  \"\\ud83d\\ude02\": \"Smiley\",\n  \"\\u00f6\": \"Latin Small Letter O With Diaeresis\",\n  \"\\ufb33\": \"Hebrew Letter Dalet With Dagesh\",\n  \"</script>\": \"Browser Challenge\"\n}\n",
            "{\"\\n\":\"Newline\",\"\\r\":\"Carriage Return\",\"1\":\"One\",\"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\"\u{1f602}\":\"Smiley\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}",
        ),
    ];
    for (name, input, output) in cases {
        assert_eq!(jcs(input).as_deref(), Some(*output), "{name}");
    }
}

#[test]
fn a_decimal_rfc8785_would_round_gets_the_exact_form_instead() {
    // The published `values` input: 333333333.33333329 is not the shortest form of the
    // double it parses to (RFC 8785 writes 333333333.3333333, which would merge it with
    // that literal), so it is written exactly; everything else is as RFC 8785 writes it.
    let input = r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/", "literals": [null, true, false]}"#;
    assert_eq!(
        jcs(input).unwrap(),
        VALUES_OUT.replace("333333333.3333333", "#33333333333333329e-8")
    );
}
