//! `application/x-www-form-urlencoded` bodies.

use super::framing::frame;

/// Decoded pairs, sorted by name only and stably (values keep their order within a name),
/// length-prefixed, into `out`; `false` on a bad percent-escape.
///
/// Hand-written: `form_urlencoded` passes bad escapes through and decodes lossily to UTF-8,
/// which would let `a=%zz` and `a=%25zz` (or two invalid byte strings) share a fingerprint.
pub(super) fn canonical_form_into(body: &[u8], out: &mut Vec<u8>) -> bool {
    let mut pairs = Vec::new();
    for part in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        let (k, v) = match part.iter().position(|&b| b == b'=') {
            Some(i) => (&part[..i], &part[i + 1..]),
            None => (part, &[][..]),
        };
        match (percent_decode(k), percent_decode(v)) {
            (Some(k), Some(v)) => pairs.push((k, v)),
            _ => return false,
        }
    }
    // Stable: `a=1&a=2` and `a=2&a=1` mean different things to most frameworks.
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    out.clear();
    out.reserve(body.len() + pairs.len() * 16);
    for (k, v) in pairs {
        frame(out, &k);
        frame(out, &v);
    }
    true
}

/// What a form body holds under one field name, for a key read from it
/// ([`Key::form_field`](crate::Key::form_field)).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Field {
    Absent,
    /// The decoded value; `None` when it has a bad percent-escape.
    One(Option<Vec<u8>>),
    /// The name is given more than once.
    Repeated,
}

/// The field `name` of a form body, split and decoded as [`canonical_form_into`] does.
///
/// Names are compared decoded, leniently: a bad escape in a name stays as sent, as
/// `form_urlencoded` (and so axum's and actix's `Form`) reads it, so the layer finds the
/// field the handler will find. The value it returns must decode strictly: a key must not
/// have two spellings (`%zz` and `%25zz`).
pub(crate) fn field(body: &[u8], name: &[u8]) -> Field {
    let mut found = Field::Absent;
    for part in body.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        let (k, v) = match part.iter().position(|&b| b == b'=') {
            Some(i) => (&part[..i], &part[i + 1..]),
            None => (part, &[][..]),
        };
        let k = decode(k, false).unwrap_or_default();
        if k != name {
            continue;
        }
        if found != Field::Absent {
            return Field::Repeated;
        }
        found = Field::One(percent_decode(v));
    }
    found
}

fn percent_decode(s: &[u8]) -> Option<Vec<u8>> {
    decode(s, true)
}

/// `+` is a space and `%XX` a byte; a `%` without two hex digits after it is refused when
/// `strict`, kept as sent otherwise.
fn decode(s: &[u8], strict: bool) -> Option<Vec<u8>> {
    let hex = |i: usize| s.get(i).and_then(|&b| (b as char).to_digit(16));
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' => match (hex(i + 1), hex(i + 2)) {
                (Some(hi), Some(lo)) => {
                    out.push((hi << 4 | lo) as u8);
                    i += 2;
                }
                _ if strict => return None,
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::{field, Field};

    #[test]
    fn a_field_is_found_by_its_decoded_name_and_decoded_strictly() {
        let one = |v: &str| Field::One(Some(v.as_bytes().to_vec()));
        assert_eq!(field(b"a=1&key=k-1&b=2", b"key"), one("k-1"));
        assert_eq!(field(b"k%65y=k%2D1", b"key"), one("k-1"));
        assert_eq!(field(b"key=a+b%2B", b"key"), one("a b+"));
        assert_eq!(field(b"key", b"key"), one(""));
        assert_eq!(field(b"&&key=&", b"key"), one(""));
        assert_eq!(field(b"keys=1&ke=2", b"key"), Field::Absent);
        assert_eq!(field(b"", b"key"), Field::Absent);
        assert_eq!(field(b"key=1&key=1", b"key"), Field::Repeated);
        assert_eq!(field(b"key=1&k%65y=2", b"key"), Field::Repeated);
        assert_eq!(field(b"key=%zz", b"key"), Field::One(None));
        assert_eq!(field(b"key=%2", b"key"), Field::One(None));
        // A bad escape elsewhere is the handler's business; in a name it stays as sent.
        assert_eq!(field(b"x=%zz&key=k", b"key"), one("k"));
        assert_eq!(field(b"key%zz=1&key=k", b"key"), one("k"));
        assert_eq!(field(b"a%=1", b"a%"), one("1"));
    }
}
