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
//! A gRPC request (`application/grpc`, `+proto`, `+json`) hashes the path, the raw message
//! frames and its `grpc-encoding` (absent is `identity`).
//!
//! Canonicalising must never make two different requests equal. A JSON body with duplicate
//! keys, a lone surrogate, a number beyond 2^53 in magnitude, a number whose literal is not
//! exactly the double it parses to, invalid UTF-8 or syntax, or nesting deeper than [`MAX_DEPTH`] is
//! hashed as raw bytes instead; so is a form body with a bad percent-escape.
//!
//! The JSON reader is hand-written: `serde_json` keeps the last of duplicate keys and, without
//! its global `arbitrary_precision` feature, loses number literals, so it cannot tell when
//! canonicalising would merge two requests.

use std::borrow::Cow;
use std::cmp::Ordering;

use http::{request, HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use crate::policy::is_grpc;
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

    // gRPC bodies are length-prefixed message frames, even `application/grpc+json`: raw.
    let grpc = is_grpc(&parts.headers);
    let canonical = match kind_of(&media) {
        _ if grpc => None,
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
    if grpc {
        // The same frame bytes under another `grpc-encoding` are another message. Absent
        // means `identity`. Only gRPC requests hash this field, so HTTP fingerprints are
        // unchanged.
        let encoding = parts
            .headers
            .get("grpc-encoding")
            .map_or(&b"identity"[..], |v| v.as_bytes())
            .to_ascii_lowercase();
        h.field(b"grpc-encoding");
        h.field(&encoding);
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

/// Strings and numbers borrow from the input when it already holds their canonical form.
enum Value<'a> {
    Null,
    Bool(bool),
    /// Already in ECMAScript `Number.prototype.toString` form.
    Number(Cow<'a, str>),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// The RFC 8785 form of `body` with `excluded` fields removed, or `None` when canonicalising
/// could merge two different requests.
pub(crate) fn canonical_json(body: &[u8], excluded: &[JsonPointer]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut p = Parser {
        s: text.as_bytes(),
        text,
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

fn remove(value: &mut Value<'_>, path: &[String]) {
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
    /// Checked to be UTF-8 before parsing.
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl<'a> Parser<'a> {
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

    fn value(&mut self, depth: usize) -> Option<Value<'a>> {
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

    fn object(&mut self, depth: usize) -> Option<Value<'a>> {
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

    fn array(&mut self, depth: usize) -> Option<Value<'a>> {
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

    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.i += 1; // opening quote
        let start = self.i;
        self.plain_run();
        // Fast path: no escapes, so the input slice is the value.
        if self.s.get(self.i) == Some(&b'"') {
            self.i += 1;
            return Some(Cow::Borrowed(&self.text[start..self.i - 1]));
        }
        let mut out = String::from(&self.text[start..self.i]);
        loop {
            match *self.s.get(self.i)? {
                b'"' => {
                    self.i += 1;
                    return Some(Cow::Owned(out));
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
                        b'u' => out.push(self.unicode_escape()?),
                        _ => return None,
                    }
                }
                _ => return None, // raw control character
            }
            let run = self.i;
            self.plain_run();
            out.push_str(&self.text[run..self.i]);
        }
    }

    /// Skips bytes that stand for themselves inside a string. Stops only on ASCII, so the
    /// positions it leaves are char boundaries of the (UTF-8) input.
    fn plain_run(&mut self) {
        let rest = &self.s[self.i..];
        self.i += rest
            .iter()
            .position(|&b| SPECIAL[b as usize])
            .unwrap_or(rest.len());
    }

    /// After `\u`: one code point, pairing surrogates; a lone surrogate is `None`.
    fn unicode_escape(&mut self) -> Option<char> {
        let hi = self.hex4()?;
        match hi {
            0xD800..=0xDBFF => {
                self.eat(b"\\u")?;
                let lo = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&lo) {
                    return None; // lone high surrogate
                }
                let cp = 0x10000 + ((u32::from(hi) - 0xD800) << 10) + (u32::from(lo) - 0xDC00);
                char::from_u32(cp)
            }
            0xDC00..=0xDFFF => None, // lone low surrogate
            _ => char::from_u32(u32::from(hi)),
        }
    }

    /// Reads a number literal and returns its ECMAScript form, or `None` when that form
    /// would stand for more than one literal value.
    fn number(&mut self) -> Option<Cow<'a, str>> {
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
        let literal = &self.text[start..self.i];
        if integer {
            // Judge integers on their digits: 2^53 + 1 parses to the double 2^53 and
            // would merge with it. More digits than an i128 holds is beyond 2^53 anyway.
            let n: i128 = literal.parse().ok()?;
            if n.unsigned_abs() > MAX_SAFE_INTEGER {
                return None;
            }
            // JSON forbids leading zeros, so the literal is canonical except for "-0".
            return Some(if n == 0 {
                Cow::Borrowed("0")
            } else {
                Cow::Borrowed(literal)
            });
        }
        if plain_decimal_is_canonical(literal) {
            return Some(Cow::Borrowed(literal));
        }
        let value: f64 = literal.parse().ok()?;
        if !value.is_finite() || (value.fract() == 0.0 && value.abs() > MAX_SAFE) {
            return None;
        }
        let mut buf = ryu_js::Buffer::new();
        let es = buf.format_finite(value);
        // Only canonicalise when the literal is exactly this double's shortest form, so two
        // distinct decimals (0.1 and 0.10000000000000000001) never share a fingerprint.
        (decimal(literal)? == decimal(es)?).then(|| Cow::Owned(es.to_owned()))
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

/// `d.ddd` with at most 15 significant digits, no trailing fraction zero, and a magnitude
/// of at least 1e-6: such a decimal is its double's shortest round-trip form, and
/// ECMAScript prints it unchanged (it switches to exponents below 1e-6 and above 1e21).
fn plain_decimal_is_canonical(lit: &str) -> bool {
    let digits = lit.strip_prefix('-').unwrap_or(lit);
    let Some((int, frac)) = digits.split_once('.') else {
        return false;
    };
    if frac.is_empty() || frac.ends_with('0') || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    let significant = if int == "0" {
        let zeros = frac.len() - frac.trim_start_matches('0').len();
        if zeros >= 6 {
            return false;
        }
        frac.len() - zeros
    } else {
        int.len() + frac.len()
    };
    significant <= 15
}

/// RFC 8785 orders keys by UTF-16 code units. That equals byte order unless a string holds a
/// supplementary-plane character (a 4-byte UTF-8 sequence, lead byte >= 0xF0).
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    let supplementary = |s: &str| s.bytes().any(|b| b >= 0xF0);
    if supplementary(a) || supplementary(b) {
        a.encode_utf16().cmp(b.encode_utf16())
    } else {
        a.as_bytes().cmp(b.as_bytes())
    }
}

fn write(v: &Value<'_>, out: &mut Vec<u8>) {
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

/// Bytes that end a plain run inside a JSON string: `"`, `\\` and controls.
const SPECIAL: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 0x20 {
        t[i] = true;
        i += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// RFC 8785 3.2.2.2: escape `"`, `\\` and controls; everything else as UTF-8.
fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    if !bytes.iter().any(|&b| SPECIAL[b as usize]) {
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        if escape.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[(b >> 4) as usize]);
            out.push(HEX[(b & 0xf) as usize]);
        } else {
            out.extend_from_slice(escape);
        }
    }
    out.extend_from_slice(&bytes[run..]);
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
    fn the_plain_decimal_fast_path_agrees_with_ecmascript_formatting() {
        // A simple LCG: deterministic, no dev-dependency.
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
            let mut lit = String::new();
            if next(2) == 0 {
                lit.push('-');
            }
            if int_len == 0 {
                lit.push('0');
            } else {
                lit.push(char::from(b'1' + next(9) as u8));
                (1..int_len).for_each(|_| lit.push(char::from(b'0' + next(10) as u8)));
            }
            lit.push('.');
            let zeros = next(9) as usize;
            (0..frac_len).for_each(|i| {
                let d = if i < zeros { 0 } else { next(10) as u8 };
                lit.push(char::from(b'0' + d));
            });
            if plain_decimal_is_canonical(&lit) {
                fast += 1;
                let v: f64 = lit.parse().unwrap();
                let mut buf = ryu_js::Buffer::new();
                assert_eq!(buf.format_finite(v), lit, "fast path disagrees");
            }
        }
        assert!(fast > 10_000, "the fast path was exercised {fast} times");
    }

    #[test]
    fn key_order_fast_path_agrees_with_utf16_order() {
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
        ];
        for a in keys {
            for b in keys {
                assert_eq!(
                    utf16_cmp(a, b),
                    a.encode_utf16().cmp(b.encode_utf16()),
                    "{a:?} vs {b:?}"
                );
            }
        }
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

    fn grpc_fp(path: &str, content_type: &str, encoding: Option<&str>, body: &[u8]) -> Fingerprint {
        let mut req = http::Request::post(path).header("content-type", content_type);
        if let Some(e) = encoding {
            req = req.header("grpc-encoding", e);
        }
        let (parts, ()) = req.body(()).unwrap().into_parts();
        fingerprint(&parts, body, &FingerprintConfig::default())
    }

    #[test]
    fn grpc_fingerprints_cover_path_raw_frames_and_grpc_encoding() {
        let frame = b"\0\0\0\0\x02\x08\x01";
        let p = "/shop.v1.Payments/CreatePayment";
        let base = grpc_fp(p, "application/grpc", None, frame);
        assert_eq!(
            base,
            grpc_fp(p, "application/grpc", Some("identity"), frame)
        );
        assert_ne!(base, grpc_fp(p, "application/grpc", Some("gzip"), frame));
        assert_ne!(
            base,
            grpc_fp("/shop.v1.Payments/Refund", "application/grpc", None, frame)
        );
        assert_ne!(
            base,
            grpc_fp(p, "application/grpc", None, b"\0\0\0\0\x02\x08\x02")
        );
        // `+json` frames are hashed raw: another spacing is another request.
        let a = grpc_fp(p, "application/grpc+json", None, b"\0\0\0\0\x02{}");
        let b = grpc_fp(p, "application/grpc+json", None, b"\0\0\0\0\x03{ }");
        assert_ne!(a, b);
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
