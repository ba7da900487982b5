//! Property tests: a model of JSON values, and random spellings of each. Their regression
//! seeds are in `proptest-regressions/fingerprint/json/tests/properties.txt`.

use proptest::prelude::*;

use super::*;
use crate::fingerprint::tests::canonical_form;

/// A JSON value by meaning: numbers as exact decimals (`digits` without leading or
/// trailing zeros, empty for zero, times 10^`exp`), strings as UTF-16 code units (lone
/// surrogates included), objects with distinct keys.
#[derive(Clone, Debug, PartialEq)]
enum J {
    Null,
    Bool(bool),
    Num {
        negative: bool,
        digits: Vec<u8>,
        exp: i32,
    },
    Str(Vec<u16>),
    Arr(Vec<J>),
    Obj(Vec<(Vec<u16>, J)>),
}

impl J {
    /// Objects sorted, so that `==` on the result is equality of meaning.
    fn meaning(&self) -> J {
        match self {
            J::Arr(items) => J::Arr(items.iter().map(J::meaning).collect()),
            J::Obj(members) => {
                let mut m: Vec<_> = members
                    .iter()
                    .map(|(k, v)| (k.clone(), v.meaning()))
                    .collect();
                m.sort_by(|a, b| a.0.cmp(&b.0));
                J::Obj(m)
            }
            other => other.clone(),
        }
    }

    fn leaves(&self) -> usize {
        match self {
            J::Arr(items) => 1 + items.iter().map(J::leaves).sum::<usize>(),
            J::Obj(members) => 1 + members.iter().map(|(_, v)| v.leaves()).sum::<usize>(),
            _ => 1,
        }
    }

    /// Replaces the `n`th node (pre-order) with `with`.
    fn replace(&mut self, n: &mut usize, with: &J) -> bool {
        if *n == 0 {
            *self = with.clone();
            return true;
        }
        *n -= 1;
        match self {
            J::Arr(items) => items.iter_mut().any(|v| v.replace(n, with)),
            J::Obj(members) => members.iter_mut().any(|(_, v)| v.replace(n, with)),
            _ => false,
        }
    }
}

fn number() -> impl Strategy<Value = J> {
    (
        any::<bool>(),
        prop::collection::vec(0u8..10, 0..25),
        -30i32..30,
        0usize..4,
    )
        .prop_map(|(negative, mut digits, exp, pick)| {
            // Bias towards doubles' own shortest forms, so both kinds of output occur.
            if pick == 0 {
                let x = f64::from_bits(
                    digits
                        .iter()
                        .fold(0u64, |n, &d| n.wrapping_mul(10_007).wrapping_add(d.into()))
                        ^ 0x4000_0000_0000_0000,
                );
                let s = if x.is_finite() {
                    format!("{x:e}")
                } else {
                    "1e0".to_owned()
                };
                let (m, e) = s.split_once('e').unwrap();
                let e: i32 = e.parse().unwrap();
                let frac = m.split_once('.').map_or(0, |(_, f)| f.len()) as i32;
                digits = m
                    .bytes()
                    .filter(u8::is_ascii_digit)
                    .map(|b| b - b'0')
                    .collect();
                return normal_number(m.starts_with('-') ^ negative, digits, e - frac);
            }
            normal_number(negative, digits, exp)
        })
}

fn normal_number(negative: bool, mut digits: Vec<u8>, mut exp: i32) -> J {
    while digits.first() == Some(&0) {
        digits.remove(0);
    }
    while digits.last() == Some(&0) {
        digits.pop();
        exp += 1;
    }
    if digits.is_empty() {
        return J::Num {
            negative: false,
            digits,
            exp: 0,
        };
    }
    J::Num {
        negative,
        digits,
        exp,
    }
}

fn unit() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => 0x20u16..0x7f,
        1 => 0u16..0x20,
        1 => 0x80u16..0x800,
        1 => 0xd800u16..0xe000,
        1 => 0xe000u16..=0xffff,
    ]
}

fn key() -> impl Strategy<Value = Vec<u16>> {
    prop::collection::vec(prop_oneof![4 => 0x61u16..0x64, 1 => unit()], 0..4)
}

fn json() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        number(),
        prop::collection::vec(unit(), 0..6).prop_map(J::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(J::Arr),
            prop::collection::vec((key(), inner), 0..6).prop_map(|mut m| {
                let mut seen = std::collections::HashSet::new();
                m.retain(|(k, _)| seen.insert(k.clone()));
                J::Obj(m)
            }),
        ]
    })
}

/// Writes `j` as JSON text, choosing whitespace, member order, escapes and number
/// spellings from `seed`.
struct Speller(u64);

impl Speller {
    fn pick(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }

    fn ws(&mut self, out: &mut String) {
        for _ in 0..self.pick(3) {
            out.push([' ', '\n', '\t', '\r'][self.pick(4) as usize]);
        }
    }

    fn write(&mut self, j: &J, out: &mut String) {
        self.ws(out);
        match j {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Num {
                negative,
                digits,
                exp,
            } => self.number(*negative, digits, *exp, out),
            J::Str(units) => self.string(units, out),
            J::Arr(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    self.write(v, out);
                }
                self.ws(out);
                out.push(']');
            }
            J::Obj(members) => {
                let mut order: Vec<usize> = (0..members.len()).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, self.pick(i as u64 + 1) as usize);
                }
                out.push('{');
                for (n, &i) in order.iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    self.ws(out);
                    self.string(&members[i].0, out);
                    self.ws(out);
                    out.push(':');
                    self.write(&members[i].1, out);
                }
                self.ws(out);
                out.push('}');
            }
        }
        self.ws(out);
    }

    fn number(&mut self, negative: bool, digits: &[u8], exp: i32, out: &mut String) {
        if negative || (digits.is_empty() && self.pick(2) == 0) {
            out.push('-');
        }
        if digits.is_empty() {
            out.push('0');
            if self.pick(2) == 0 {
                out.push('.');
                (0..=self.pick(3)).for_each(|_| out.push('0'));
            }
            if self.pick(2) == 0 {
                out.push_str(["e5", "E-0", "e+12"][self.pick(3) as usize]);
            }
            return;
        }
        let mut d: Vec<u8> = digits.to_vec();
        let mut e = exp as i64;
        let zeros = self.pick(3);
        d.extend(std::iter::repeat_n(0, zeros as usize));
        e -= zeros as i64;
        if d.is_empty() {
            d.push(0);
        }
        // Digits before the point: none ("0.ddd", with leading zeros) to all.
        let point = self.pick(d.len() as u64 + 1) as usize;
        if point == 0 {
            out.push('0');
            out.push('.');
            for _ in 0..self.pick(3) {
                out.push('0');
                e += 1;
            }
        } else {
            out.extend(d[..point].iter().map(|&x| char::from(b'0' + x)));
            if point < d.len() {
                out.push('.');
            }
        }
        out.extend(d[point..].iter().map(|&x| char::from(b'0' + x)));
        e += (d.len() - point) as i64;
        if e != 0 || self.pick(2) == 0 {
            out.push(if self.pick(2) == 0 { 'e' } else { 'E' });
            match (e < 0, self.pick(2)) {
                (true, _) => out.push('-'),
                (false, 0) => out.push('+'),
                _ => {}
            }
            for _ in 0..self.pick(2) {
                out.push('0');
            }
            out.push_str(&e.unsigned_abs().to_string());
        }
    }

    fn string(&mut self, units: &[u16], out: &mut String) {
        out.push('"');
        for c in char::decode_utf16(units.iter().copied()) {
            match c {
                Ok(c) if c >= ' ' && c != '"' && c != '\\' && self.pick(3) > 0 => out.push(c),
                Ok(c) => {
                    let short = match c {
                        '"' => Some("\\\""),
                        '\\' => Some("\\\\"),
                        '/' => Some("\\/"),
                        '\n' => Some("\\n"),
                        '\t' => Some("\\t"),
                        '\r' => Some("\\r"),
                        '\u{8}' => Some("\\b"),
                        '\u{c}' => Some("\\f"),
                        _ => None,
                    };
                    match short {
                        Some(s) if self.pick(2) == 0 => out.push_str(s),
                        _ => {
                            let mut buf = [0; 2];
                            for u in c.encode_utf16(&mut buf) {
                                self.unit_escape(*u, out);
                            }
                        }
                    }
                }
                Err(e) => self.unit_escape(e.unpaired_surrogate(), out),
            }
        }
        out.push('"');
    }

    fn unit_escape(&mut self, u: u16, out: &mut String) {
        if self.pick(2) == 0 {
            out.push_str(&format!("\\u{u:04x}"));
        } else {
            out.push_str(&format!("\\u{u:04X}"));
        }
    }
}

fn spell(j: &J, seed: u64) -> String {
    let mut out = String::new();
    Speller(seed).write(j, &mut out);
    out
}

proptest! {
    // Bounded to keep the CI run short; raise with PROPTEST_CASES locally. A bug these
    // missed at 384 showed at 200,000.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(4096),
        // About 2% of changes keep the meaning and are rejected: room for long local runs.
        max_global_rejects: 1 << 20,
        ..ProptestConfig::default()
    })]

    #[test]
    fn equivalent_spellings_share_one_canonical_form(j in json(), s1 in any::<u64>(), s2 in any::<u64>()) {
        let (a, b) = (spell(&j, s1), spell(&j, s2));
        let ca = jcs(&a);
        prop_assert!(ca.is_some(), "not canonicalised: {a}");
        prop_assert_eq!(ca, jcs(&b), "{} vs {}", a, b);
    }

    #[test]
    fn any_change_of_meaning_changes_the_canonical_form(
        j in json(), with in json(), at in any::<usize>(), s1 in any::<u64>(), s2 in any::<u64>(),
    ) {
        let mut changed = j.clone();
        let mut n = at % j.leaves();
        changed.replace(&mut n, &with);
        prop_assume!(changed.meaning() != j.meaning());
        let (a, b) = (spell(&j, s1), spell(&changed, s2));
        prop_assert_ne!(jcs(&a), jcs(&b), "{} vs {}", a, b);
    }

    #[test]
    fn decimals_one_unit_apart_stay_apart(
        digits in prop::collection::vec(0u8..10, 1..30), exp in -400i32..400,
    ) {
        // Most of these pairs parse to one double; only the exact form keeps them apart.
        let mut other = digits.clone();
        let n = digits.len() - 1;
        other[n] = (other[n] + 1) % 10;
        let spell = |d: &[u8]| format!("1{}e{exp}", d.iter().map(|&x| char::from(b'0' + x)).collect::<String>());
        let (a, b) = (spell(&digits), spell(&other));
        prop_assert_ne!(jcs(&a), jcs(&b), "{} vs {}", a, b);
    }

    #[test]
    fn every_finite_double_is_written_as_rfc8785_writes_it(bits in any::<u64>()) {
        let x = f64::from_bits(bits);
        prop_assume!(x.is_finite());
        let mut buf = ryu_js::Buffer::new();
        let expected = buf.format_finite(x).to_owned();
        prop_assert_eq!(jcs(&expected), Some(expected.clone()));
        for spelling in [format!("{x:e}"), format!("{x}")] {
            prop_assert_eq!(jcs(&spelling), Some(same_or_exact(&spelling, &expected)), "{}", spelling);
        }
    }

    #[test]
    fn objects_of_one_shape_agree_with_the_general_loop(
        j in json(), with in json(), at in any::<usize>(), seeds in any::<[u64; 3]>(),
    ) {
        // The same keys again (and once with a leaf replaced): later objects reuse the
        // key orders the first ones left, which the general loop never does.
        let mut changed = j.clone();
        let mut n = at % j.leaves();
        changed.replace(&mut n, &with);
        let doc = format!(
            "[{},{},{}]",
            spell(&j, seeds[0]),
            spell(&j, seeds[1]),
            spell(&changed, seeds[2])
        );
        let never = [JsonPointer::parse("/no key is this long").unwrap()];
        let general = canonical_json(doc.as_bytes(), &never);
        prop_assert_eq!(canonical_json(doc.as_bytes(), &[]), general, "{}", doc);
    }

    #[test]
    fn keys_of_any_bytes_never_panic_and_only_utf8_is_canonicalised(
        keys in prop::collection::vec(prop::collection::vec(0usize..9, 0..4), 1..40),
    ) {
        // Pieces that are UTF-8 and simple, an escape, a supplementary-plane character,
        // and bytes that are not UTF-8: mixed in one object, over 16 members or under.
        const PIECES: [&[u8]; 9] = [
            b"a", b"b", "\u{e9}".as_bytes(), "\u{ffff}".as_bytes(), b"\\n",
            "\u{1f600}".as_bytes(), b"\x84", b"\xb8", b"\xff",
        ];
        let mut doc = b"{".to_vec();
        for (k, key) in keys.iter().enumerate() {
            if k > 0 {
                doc.push(b',');
            }
            doc.push(b'"');
            key.iter().for_each(|&p| doc.extend_from_slice(PIECES[p]));
            doc.extend_from_slice(format!("\":{k}").as_bytes());
        }
        doc.push(b'}');
        let utf8 = std::str::from_utf8(&doc).is_ok();
        let distinct = keys.iter().collect::<std::collections::HashSet<_>>().len() == keys.len();
        let never = [JsonPointer::parse("/no key is this long").unwrap()];
        let plain = canonical_json(&doc, &[]);
        prop_assert_eq!(plain.is_some(), utf8 && distinct, "{:?}", doc);
        prop_assert_eq!(&canonical_json(&doc, &never), &plain);
        let want = plain.as_deref().map(|t| <[u8; 32]>::from(Sha256::digest(t)));
        prop_assert_eq!(canonical_json_digest(&doc), want);
    }

    #[test]
    fn what_a_thread_remembers_never_changes_a_result(
        a in json(), b in json(), seeds in any::<[u64; 3]>(),
    ) {
        // The key orders a thread keeps from body to body: `a` after `b` and `a` itself
        // must canonicalise as `a` does on a thread that has seen nothing.
        let (a1, b1, a2) = (spell(&a, seeds[0]), spell(&b, seeds[1]), spell(&a, seeds[2]));
        let fresh = std::thread::scope(|s| {
            s.spawn(|| (canonical_json(a1.as_bytes(), &[]), canonical_json_digest(a1.as_bytes())))
                .join()
                .unwrap()
        });
        let _ = canonical_json(b1.as_bytes(), &[]);
        prop_assert_eq!(&canonical_json(a1.as_bytes(), &[]), &fresh.0, "{} after {}", a1, b1);
        prop_assert_eq!(canonical_json_digest(a1.as_bytes()), fresh.1, "{} after {}", a1, b1);
        let _ = canonical_json_digest(b1.as_bytes());
        prop_assert_eq!(&canonical_json(a2.as_bytes(), &[]), &fresh.0, "{} after {}", a2, b1);
    }

    #[test]
    fn the_plain_and_the_general_loop_agree(j in json(), seed in any::<u64>()) {
        // A pointer no generated key matches sends the document through `Canon::run`.
        let doc = spell(&j, seed);
        let never = [JsonPointer::parse("/no key is this long").unwrap()];
        let general = canonical_json(doc.as_bytes(), &never);
        prop_assert_eq!(canonical_json(doc.as_bytes(), &[]), general, "{}", doc);
    }

    #[test]
    fn the_digest_hashes_the_canonical_text(j in json(), seed in any::<u64>()) {
        // The digest hashes an outermost object's members in order without sorting their
        // bytes: it must hash exactly the text `canonical_json` writes, in both loops.
        let doc = spell(&j, seed);
        let text = canonical_json(doc.as_bytes(), &[]);
        let want = text.as_deref().map(|t| <[u8; 32]>::from(Sha256::digest(t)));
        prop_assert_eq!(canonical_json_digest(doc.as_bytes()), want, "{}", doc);
        let never = [JsonPointer::parse("/no key is this long").unwrap()];
        let mut h = Sha256::new();
        with_buffers(|b| {
            if canonicalise(doc.as_bytes(), &never, &mut b.out, &mut b.work, true) {
                hash_canonical(&mut h, &b.out, &b.work.top);
            }
        });
        if let Some(t) = &text {
            prop_assert_eq!(<[u8; 32]>::from(h.finalize()), <[u8; 32]>::from(Sha256::digest(t)));
        }
    }

    #[test]
    fn no_input_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = canonical_json(&bytes, &[]);
        let _ = canonical_json_digest(&bytes);
        let _ = canonical_form(&bytes);
    }

    #[test]
    fn no_json_like_input_panics(
        tokens in prop::collection::vec(0usize..TOKENS.len() + RAW_BYTES.len(), 0..40),
    ) {
        // Tokens, and now and then bytes that are not UTF-8 (which both loops check only
        // after a string held a byte above 0x7f).
        let doc: Vec<u8> = tokens
            .iter()
            .flat_map(|&t| match TOKENS.get(t) {
                Some(token) => token.as_bytes(),
                None => RAW_BYTES[t - TOKENS.len()],
            })
            .copied()
            .collect();
        let shown = String::from_utf8_lossy(&doc);
        let pointers = [JsonPointer::parse("/a").unwrap(), JsonPointer::parse("/0/a").unwrap()];
        let plain = canonical_json(&doc, &[]);
        let never = [JsonPointer::parse("/no key is this long").unwrap()];
        prop_assert_eq!(&plain, &canonical_json(&doc, &never), "{}", shown);
        if plain.is_some() {
            prop_assert!(std::str::from_utf8(&doc).is_ok(), "{}", shown);
        }
        let _ = canonical_json(&doc, &pointers);
        let want = plain.as_deref().map(|t| <[u8; 32]>::from(Sha256::digest(t)));
        prop_assert_eq!(canonical_json_digest(&doc), want, "{}", shown);
    }
}

/// Pieces of UTF-8 that are invalid alone or in the wrong order.
const RAW_BYTES: &[&[u8]] = &[b"\xff", b"\xc3", b"\xa9", b"\xed\xa0\x80", b"\xf0\x9f"];

const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\"a\"",
    "\\",
    "\\u",
    "d800",
    "DC00",
    "0",
    "-",
    "1",
    "9",
    "e",
    "E",
    "+",
    ".",
    "9223372036854775807",
    "9223372036854775808",
    "true",
    "null",
    " ",
    "\u{e9}",
    "\u{1f600}",
    "\\n",
    "\\\"",
    "00000000000000000000000000000000001",
];
