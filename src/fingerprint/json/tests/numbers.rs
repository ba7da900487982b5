use proptest::prelude::*;

use super::super::number::{digits_end, plain_decimal_is_canonical};
use super::*;

#[test]
fn numbers_rfc8785_cannot_write_exactly_get_an_exact_form() {
    let cases = [
        ("9007199254740993", "#9007199254740993e0"),
        ("-9007199254740993", "#-9007199254740993e0"),
        ("9007199254740993.0", "#9007199254740993e0"),
        ("90071992547409930e-1", "#9007199254740993e0"),
        ("9007199254740992", "9007199254740992"),
        ("9007199254740994", "9007199254740994"),
        ("18446744073709551615", "#18446744073709551615e0"),
        ("1e21", "1e+21"),
        ("1000000000000000000000", "1e+21"),
        ("1000000000000000000000.000", "1e+21"),
        ("0.1", "0.1"),
        ("0.1000000000000000000001", "#1000000000000000000001e-22"),
        (
            "0.1000000000000000055511151231257827021181583404541015625",
            "#1000000000000000055511151231257827021181583404541015625e-55",
        ),
        ("1e400", "#1e400"),
        ("-10.0e399", "#-1e400"),
        ("1e-400", "#1e-400"),
        (
            "123456789012345678901234567890e-10",
            "#12345678901234567890123456789e-9",
        ),
        ("0e400", "0"),
        ("-0.000e-7", "0"),
    ];
    for (input, expected) in cases {
        assert_eq!(jcs(input).as_deref(), Some(expected), "{input}");
    }
    // Exponents too long for any integer type stay exact.
    let big = format!("1e{}", "9".repeat(40));
    assert_eq!(jcs(&big).unwrap(), format!("#1e{}", "9".repeat(40)));
    let shifted = format!("0.00100e-{}", "9".repeat(40));
    assert_eq!(jcs(&shifted).unwrap(), format!("#1e-1{}2", "0".repeat(39)));
    let up = format!("1000e{}", "9".repeat(40));
    assert_eq!(jcs(&up).unwrap(), format!("#1e1{}2", "0".repeat(39)));
    let down = format!("1.5e1{}", "0".repeat(40));
    assert_eq!(jcs(&down).unwrap(), format!("#15e{}", "9".repeat(40)));
}

#[test]
fn huge_exponents_do_not_overflow() {
    for (input, expected) in [
        ("[0.0e-9223372036854775808]", "[0]"),
        ("[0e9223372036854775807]", "[0]"),
        ("[1e9223372036854775807]", "[#1e9223372036854775807]"),
        ("[1.5e-9223372036854775808]", "[#15e-9223372036854775809]"),
        (
            "[1e-340282366920938463463374607431768211456]",
            "[#1e-340282366920938463463374607431768211456]",
        ),
    ] {
        assert_eq!(jcs(input).as_deref(), Some(expected), "{input}");
    }
}

#[test]
fn plain_decimal_fast_path_agrees_with_ecmascript_formatting() {
    // A simple LCG: deterministic.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % m
    };
    let mut fast = 0;
    for _ in 0..200_000 {
        let int_len = next(17) as usize;
        let frac_len = 1 + next(17) as usize;
        let mut int = String::new();
        if int_len == 0 {
            int.push('0');
        } else {
            int.push(char::from(b'1' + next(9) as u8));
            (1..int_len).for_each(|_| int.push(char::from(b'0' + next(10) as u8)));
        }
        let zeros = next(9) as usize;
        let frac: String = (0..frac_len)
            .map(|i| char::from(b'0' + if i < zeros { 0 } else { next(10) as u8 }))
            .collect();
        if plain_decimal_is_canonical(int.as_bytes(), frac.as_bytes()) {
            fast += 1;
            let lit = format!("{int}.{frac}");
            let v: f64 = lit.parse().unwrap();
            assert_eq!(
                ryu_js::Buffer::new().format_finite(v),
                lit,
                "fast path disagrees"
            );
        }
    }
    assert!(fast > 10_000, "the fast path was exercised {fast} times");
}

#[test]
fn decimals_with_trailing_zeros_are_written_without_them() {
    let never = [JsonPointer::parse("/never").unwrap()];
    for (literal, canonical) in [
        ("10.50", "10.5"),
        ("3.0", "3"),
        ("0.00", "0"),
        ("-0.00", "0"),
        ("-5.50", "-5.5"),
        ("100.000", "100"),
        ("0.0000010", "0.000001"),
        ("0.00000010", "1e-7"),
        ("123456789012345.0", "123456789012345"),
        ("1234567890123456.0", "1234567890123456"),
        ("12345678901234567.0", "#12345678901234567e0"),
        ("0.1000000000000000000000", "0.1"),
        ("1.2345678901234560", "1.234567890123456"),
    ] {
        // Alone, and in an array where the run goes on after the number.
        let doc = format!("[{literal},{literal}]");
        let expected = format!("[{canonical},{canonical}]");
        assert_eq!(jcs(&doc).as_deref(), Some(&*expected), "{literal}");
        // The general loop writes every such number through `Canon::number`.
        assert_eq!(
            canonical_json(doc.as_bytes(), &[]),
            canonical_json(doc.as_bytes(), &never),
            "{literal}"
        );
    }
}

proptest! {
    /// `digits_end` reads 8 bytes a word: the same end as a byte at a time, from any start,
    /// whatever follows (bytes above 0xf9 carry out of their byte in its sum).
    #[test]
    fn digits_end_is_the_first_non_digit(
        body in prop::collection::vec(
            prop_oneof![6 => b'0'..=b'9', 1 => b'/'..=b':', 1 => any::<u8>(), 1 => 0xf9u8..=0xff],
            0..40,
        ),
        start in 0usize..40,
    ) {
        let start = start.min(body.len());
        let slow = start + body[start..].iter().take_while(|b| b.is_ascii_digit()).count();
        prop_assert_eq!(digits_end(&body, start), slow);
    }
}
