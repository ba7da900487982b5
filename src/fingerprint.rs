//! The `v1` request fingerprint.
//!
//! SHA-256 over length-prefixed fields: method, path and query, media type, body kind,
//! canonical body, then each configured header. The body is canonical so that a retry that
//! re-serialises the same JSON (other key order, other whitespace) still matches:
//!
//! - JSON (`application/json`, `*/*+json`): RFC 8785 (JCS);
//! - `application/x-www-form-urlencoded`: the decoded pairs, sorted;
//! - anything else: the raw bytes.
//!
//! Canonicalising must never make two different requests equal. A JSON body with duplicate
//! keys, a lone surrogate, a number beyond 2^53 in magnitude, a number whose literal is not
//! exactly the double it parses to, invalid UTF-8 or syntax, or nesting deeper than [`MAX_DEPTH`] is
//! hashed as raw bytes instead; so is a form body with a bad percent-escape.
//!
//! The JSON reader is hand-written: `serde_json` keeps the last of duplicate keys and, without
//! its global `arbitrary_precision` feature, loses number literals, so it cannot tell when
//! canonicalising would merge two requests.

use std::cmp::Ordering;

use http::{request, HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::record::Fingerprint;

/// Deeper JSON is hashed raw: bounds recursion on hostile input.
pub(crate) const MAX_DEPTH: usize = 128;
/// 2^53: integers beyond it do not survive a round trip through an IEEE double.
const MAX_SAFE_INTEGER: u128 = 1 << 53;
const MAX_SAFE: f64 = MAX_SAFE_INTEGER as f64;

/// What the fingerprint covers beyond method, path and body.
#[derive(Debug, Clone, Default)]
pub(crate) struct FingerprintConfig {
    pub(crate) excluded: Vec<JsonPointer>,
    pub(crate) headers: Vec<HeaderName>,
}

/// A parsed RFC 6901 JSON Pointer, naming a field the fingerprint leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPointer(Vec<String>);

impl JsonPointer {
    /// Parses `/a/b~1c/0`. Only the empty pointer (the whole document) is refused, since
    /// excluding it would make every body match.
    pub fn parse(pointer: &str) -> Result<Self, crate::ConfigError> {
        let err = |why: &str| crate::ConfigError::new(format!("JSON pointer {pointer:?}: {why}"));
        let rest = pointer
            .strip_prefix('/')
            .ok_or_else(|| err("must start with '/'"))?;
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                match c {
                    '~' => match chars.next() {
                        Some('0') => token.push('~'),
                        Some('1') => token.push('/'),
                        _ => return Err(err("'~' must be followed by '0' or '1'")),
                    },
                    c => token.push(c),
                }
            }
            tokens.push(token);
        }
        Ok(Self(tokens))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyKind {
    Json,
    Form,
    Raw,
}

impl BodyKind {
    fn tag(self) -> &'static [u8] {
        match self {
            BodyKind::Json => b"jcs",
            BodyKind::Form => b"form",
            BodyKind::Raw => b"raw",
        }
    }
}

fn media_type(headers: &HeaderMap) -> String {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

fn kind_of(media: &str) -> BodyKind {
    if media == "application/json" || (media.contains('/') && media.ends_with("+json")) {
        BodyKind::Json
    } else if media == "application/x-www-form-urlencoded" {
        BodyKind::Form
    } else {
        BodyKind::Raw
    }
}

struct Hasher(Sha256);

impl Hasher {
    /// Length-prefixed, so no two field sequences hash the same bytes.
    fn field(&mut self, bytes: &[u8]) {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }
}

/// Computes the `v1` fingerprint of a request.
pub(crate) fn fingerprint(
    parts: &request::Parts,
    body: &[u8],
    config: &FingerprintConfig,
) -> Fingerprint {
    let mut h = Hasher(Sha256::new());
    h.0.update(b"tower-idempotency fingerprint v1\0");
    h.field(parts.method.as_str().as_bytes());
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .as_bytes();
    h.field(target);
    let media = media_type(&parts.headers);
    h.field(media.as_bytes());

    let canonical = match kind_of(&media) {
        BodyKind::Json => canonical_json(body, &config.excluded).map(|c| (BodyKind::Json, c)),
        BodyKind::Form => canonical_form(body).map(|c| (BodyKind::Form, c)),
        BodyKind::Raw => None,
    };
    match &canonical {
        Some((kind, bytes)) => {
            h.field(kind.tag());
            h.field(bytes);
        }
        None => {
            h.field(BodyKind::Raw.tag());
            h.field(body);
        }
    }

    for name in &config.headers {
        h.field(name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        h.0.update((values.iter().count() as u64).to_be_bytes());
        for v in values {
            h.field(v.as_bytes());
        }
    }
    Fingerprint::from_bytes(h.0.finalize().into())
}

// ---------------------------------------------------------------------------------------
// RFC 8785 canonical JSON
// ---------------------------------------------------------------------------------------

enum Value {
    Null,
    Bool(bool),
    /// Already in ECMAScript `Number.prototype.toString` form.
    Number(String),
    String(String),
    Array(Vec<Value>),
    Object(Vec<(String, Value)>),
}

/// The RFC 8785 form of `body` with `excluded` fields removed, or `None` when canonicalising
/// could merge two different requests.
pub(crate) fn canonical_json(body: &[u8], excluded: &[JsonPointer]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
    };
    p.ws();
    let mut value = p.value(0)?;
    p.ws();
    if p.i != p.s.len() {
        return None;
    }
    for pointer in excluded {
        remove(&mut value, &pointer.0);
    }
    let mut out = Vec::with_capacity(body.len());
    write(&value, &mut out);
    Some(out)
}

fn remove(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = value;
    for token in parents {
        cur = match cur {
            Value::Object(members) => match members.iter_mut().find(|(k, _)| k == token) {
                Some((_, v)) => v,
                None => return,
            },
            Value::Array(items) => match array_index(token).and_then(|i| items.get_mut(i)) {
                Some(v) => v,
                None => return,
            },
            _ => return,
        };
    }
    match cur {
        Value::Object(members) => members.retain(|(k, _)| k != last),
        Value::Array(items) => {
            if let Some(i) = array_index(last).filter(|&i| i < items.len()) {
                items.remove(i);
            }
        }
        _ => {}
    }
}

fn array_index(token: &str) -> Option<usize> {
    if token.len() > 1 && token.starts_with('0') {
        return None;
    }
    token.parse().ok()
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &[u8]) -> Option<()> {
        if self.s[self.i..].starts_with(lit) {
            self.i += lit.len();
            Some(())
        } else {
            None
        }
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        match *self.s.get(self.i)? {
            b'{' => self.object(depth),
            b'[' => self.array(depth),
            b'"' => self.string().map(Value::String),
            b't' => self.eat(b"true").map(|()| Value::Bool(true)),
            b'f' => self.eat(b"false").map(|()| Value::Bool(false)),
            b'n' => self.eat(b"null").map(|()| Value::Null),
            b'-' | b'0'..=b'9' => self.number().map(Value::Number),
            _ => None,
        }
    }

    fn object(&mut self, depth: usize) -> Option<Value> {
        self.i += 1;
        let mut members = Vec::new();
        self.ws();
        if self.eat(b"}").is_some() {
            return Some(Value::Object(members));
        }
        loop {
            self.ws();
            if self.s.get(self.i) != Some(&b'"') {
                return None;
            }
            let key = self.string()?;
            self.ws();
            self.eat(b":")?;
            self.ws();
            let v = self.value(depth + 1)?;
            members.push((key, v));
            self.ws();
            match *self.s.get(self.i)? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    break;
                }
                _ => return None,
            }
        }
        // RFC 8785 3.2.3: members sorted by their UTF-16 code units.
        members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
        if members.windows(2).any(|w| w[0].0 == w[1].0) {
            return None; // duplicate keys: parsers disagree on which one wins
        }
        Some(Value::Object(members))
    }

    fn array(&mut self, depth: usize) -> Option<Value> {
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat(b"]").is_some() {
            return Some(Value::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth + 1)?);
            self.ws();
            match *self.s.get(self.i)? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(Value::Array(items));
                }
                _ => return None,
            }
        }
    }

    fn hex4(&mut self) -> Option<u16> {
        let digits = self.s.get(self.i..self.i + 4)?;
        self.i += 4;
        let text = std::str::from_utf8(digits).ok()?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u16::from_str_radix(text, 16).ok()
    }

    fn string(&mut self) -> Option<String> {
        self.i += 1; // opening quote
        let mut out = String::new();
        loop {
            let start = self.i;
            while let Some(&b) = self.s.get(self.i) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            // The input was checked to be UTF-8 and we stopped on ASCII bytes only.
            out.push_str(std::str::from_utf8(&self.s[start..self.i]).ok()?);
            match *self.s.get(self.i)? {
                b'"' => {
                    self.i += 1;
                    return Some(out);
                }
                b'\\' => {
                    self.i += 1;
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let hi = self.hex4()?;
                            let c = match hi {
                                0xD800..=0xDBFF => {
                                    self.eat(b"\\u")?;
                                    let lo = self.hex4()?;
                                    if !(0xDC00..=0xDFFF).contains(&lo) {
                                        return None; // lone high surrogate
                                    }
                                    let cp = 0x10000
                                        + ((u32::from(hi) - 0xD800) << 10)
                                        + (u32::from(lo) - 0xDC00);
                                    char::from_u32(cp)?
                                }
                                0xDC00..=0xDFFF => return None, // lone low surrogate
                                _ => char::from_u32(u32::from(hi))?,
                            };
                            out.push(c);
                        }
                        _ => return None,
                    }
                }
                _ => return None, // raw control character
            }
        }
    }

    /// Reads a number literal and returns its ECMAScript form, or `None` when that form
    /// would stand for more than one literal value.
    fn number(&mut self) -> Option<String> {
        let start = self.i;
        self.eat(b"-");
        match *self.s.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        let mut integer = true;
        if self.s.get(self.i) == Some(&b'.') {
            integer = false;
            self.i += 1;
            if !self.s.get(self.i)?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            integer = false;
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if !self.s.get(self.i)?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        let literal = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        if integer {
            // Judge integers on their digits: 2^53 + 1 parses to the double 2^53 and
            // would merge with it. More digits than an i128 holds is beyond 2^53 anyway.
            let n: i128 = literal.parse().ok()?;
            return (n.unsigned_abs() <= MAX_SAFE_INTEGER).then(|| n.to_string());
        }
        let value: f64 = literal.parse().ok()?;
        if !value.is_finite() || (value.fract() == 0.0 && value.abs() > MAX_SAFE) {
            return None;
        }
        let mut buf = ryu_js::Buffer::new();
        let es = buf.format_finite(value);
        // Only canonicalise when the literal is exactly this double's shortest form, so two
        // distinct decimals (0.1 and 0.10000000000000000001) never share a fingerprint.
        (decimal(literal)? == decimal(es)?).then(|| es.to_owned())
    }

    fn digits(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
    }
}

/// A decimal literal as (negative, significant digits, exponent of the last digit).
/// Zero has no digits and no sign.
fn decimal(lit: &str) -> Option<(bool, String, i64)> {
    let (neg, rest) = match lit.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, lit),
    };
    let (mantissa, exp) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], rest[i + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits: String = int.chars().chain(frac.chars()).collect();
    let mut exp = exp - frac.len() as i64;
    while digits.ends_with('0') {
        digits.pop();
        exp += 1;
    }
    let digits = digits.trim_start_matches('0').to_owned();
    if digits.is_empty() {
        return Some((false, digits, 0));
    }
    Some((neg, digits, exp))
}

fn utf16_cmp(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

fn write(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => out.extend_from_slice(n.as_bytes()),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(k, out);
                out.push(b':');
                write(v, out);
            }
            out.push(b'}');
        }
    }
}

/// RFC 8785 3.2.2.2: escape `"`, `\` and controls; everything else as UTF-8.
fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x09 => out.extend_from_slice(b"\\t"),
            0x0a => out.extend_from_slice(b"\\n"),
            0x0c => out.extend_from_slice(b"\\f"),
            0x0d => out.extend_from_slice(b"\\r"),
            0x00..=0x1f => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[(b >> 4) as usize]);
                out.push(HEX[(b & 0xf) as usize]);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

// ---------------------------------------------------------------------------------------
// Form bodies
// ---------------------------------------------------------------------------------------

/// Decoded pairs, sorted, length-prefixed; `None` on a bad percent-escape.
///
/// Hand-written: `form_urlencoded` passes bad escapes through and decodes lossily to UTF-8,
/// which would let `a=%zz` and `a=%25zz` (or two invalid byte strings) share a fingerprint.
pub(crate) fn canonical_form(body: &[u8]) -> Option<Vec<u8>> {
    let mut pairs = Vec::new();
    for part in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        let (k, v) = match part.iter().position(|&b| b == b'=') {
            Some(i) => (&part[..i], &part[i + 1..]),
            None => (part, &[][..]),
        };
        pairs.push((percent_decode(k)?, percent_decode(v)?));
    }
    pairs.sort();
    let mut out = Vec::with_capacity(body.len() + pairs.len() * 16);
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u64).to_be_bytes());
        out.extend_from_slice(&k);
        out.extend_from_slice(&(v.len() as u64).to_be_bytes());
        out.extend_from_slice(&v);
    }
    Some(out)
}

fn percent_decode(s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                let text = std::str::from_utf8(hex).ok()?;
                if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return None;
                }
                out.push(u8::from_str_radix(text, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jcs(s: &str) -> Option<String> {
        canonical_json(s.as_bytes(), &[]).map(|v| String::from_utf8(v).unwrap())
    }

    #[test]
    fn reordered_keys_and_whitespace_canonicalise_alike() {
        let a =
            jcs(r#"{"amount": 100, "currency":"EUR", "meta": {"b": [1, 2.5, true], "a": null}}"#);
        let b = jcs(
            "{\n  \"meta\":{\"a\":null,\"b\":[1,2.5,true]},\"currency\":\"EUR\",\"amount\":100}",
        );
        assert_eq!(a, b);
        assert_eq!(
            a.unwrap(),
            r#"{"amount":100,"currency":"EUR","meta":{"a":null,"b":[1,2.5,true]}}"#
        );
    }

    #[test]
    fn rfc8785_numbers_strings_and_key_order() {
        // Numbers: ECMAScript forms.
        assert_eq!(
            jcs("[1E2, 1.50, -0, 0.000001, 1e-7, 4.5e-1, 123456789012345.5, -2.5E-15]").unwrap(),
            "[100,1.5,0,0.000001,1e-7,0.45,123456789012345.5,-2.5e-15]"
        );
        // Strings: only ", \ and controls escaped; unicode literal; \u escapes decoded.
        assert_eq!(
            jcs(r#""\u20ac\/\u0007\n""#).unwrap(),
            "\"\u{20ac}/\\u0007\\n\""
        );
        // Key order by UTF-16 code units: U+FB33 sorts after U+1F600 (a surrogate pair 0xD83D).
        assert_eq!(
            jcs("{\"\u{fb33}\":1,\"\u{1f600}\":2,\"a\":3}").unwrap(),
            "{\"a\":3,\"\u{1f600}\":2,\"\u{fb33}\":1}"
        );
    }

    #[test]
    fn inputs_that_could_merge_two_requests_are_not_canonicalised() {
        assert_eq!(jcs(r#"{"a":1,"a":2}"#), None, "duplicate keys");
        assert_eq!(
            jcs(r#"{"a":1,"\u0061":2}"#),
            None,
            "duplicate keys after unescaping"
        );
        assert_eq!(jcs("9007199254740993"), None, "integer beyond 2^53");
        assert_eq!(
            jcs("9007199254740993.0"),
            None,
            "integral literal beyond 2^53"
        );
        assert_eq!(
            jcs("123456789012345678901234567890123456789012"),
            None,
            "beyond i128"
        );
        assert_eq!(jcs("-9007199254740993"), None);
        assert_eq!(jcs("1e300").as_deref(), None, "integral value beyond 2^53");
        assert_eq!(
            jcs("1e21").as_deref(),
            None,
            "every magnitude beyond 2^53 falls back"
        );
        assert_eq!(jcs("9007199254740992").as_deref(), Some("9007199254740992"));
        assert_eq!(jcs("0.1000000000000000000001"), None, "inexact decimal");
        assert_eq!(jcs(r#""\ud800""#), None, "lone high surrogate");
        assert_eq!(jcs(r#""\udc00x""#), None, "lone low surrogate");
        assert_eq!(jcs("{\"a\":1"), None, "truncated");
        assert_eq!(jcs("{\"a\":1} x"), None, "trailing garbage");
        assert_eq!(jcs("[01]"), None, "leading zero");
        assert_eq!(jcs("\"tab\there\""), None, "raw control character");
        assert_eq!(jcs(&"[".repeat(MAX_DEPTH + 2)), None, "too deep");
        assert!(
            canonical_json(&[0x22, 0xff, 0x22], &[]).is_none(),
            "invalid UTF-8"
        );
    }

    #[test]
    fn excluded_pointers_remove_fields_anywhere() {
        let ptrs = [
            JsonPointer::parse("/meta/request_time").unwrap(),
            JsonPointer::parse("/items/0/note").unwrap(),
            JsonPointer::parse("/a~1b").unwrap(),
        ];
        let out = canonical_json(
            br#"{"a/b":1,"items":[{"note":"x","sku":"s"}],"meta":{"request_time":"t","z":1},"k":2}"#,
            &ptrs,
        )
        .unwrap();
        assert_eq!(out, br#"{"items":[{"sku":"s"}],"k":2,"meta":{"z":1}}"#);
        assert!(JsonPointer::parse("").is_err());
        assert!(JsonPointer::parse("a").is_err());
        assert!(JsonPointer::parse("/a~2").is_err());
    }

    #[test]
    fn form_pairs_sort_and_bad_escapes_fall_back() {
        assert_eq!(
            canonical_form(b"b=2&a=1+x"),
            canonical_form(b"a=1%20x&&b=2")
        );
        assert_ne!(canonical_form(b"a=1&b=2"), canonical_form(b"a=2&b=1"));
        assert_eq!(canonical_form(b"a=%zz"), None);
        assert_eq!(canonical_form(b"a=%2"), None);
        // Pairs are length-prefixed: "a=b&c" differs from "a=b%26c".
        assert_ne!(canonical_form(b"a=b&c"), canonical_form(b"a=b%26c"));
    }
}
