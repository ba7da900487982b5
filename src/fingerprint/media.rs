//! The `Content-Type` and `Content-Encoding` fields, normalised and framed.

use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use http::HeaderMap;

use super::framing::{frame, BodyKind};

/// The `Content-Type` field, framed, and the body kind it names.
///
/// Normalised (RFC 9110 8.3.1): type, subtype and parameter names lower-cased, a quoted value
/// unquoted (`"utf-8"` is `utf-8`), parameters sorted by name, stably. Values keep their case,
/// since RFC 9110 leaves that to each parameter (a multipart `boundary` is case-sensitive),
/// except `charset`, whose values are case-insensitive by definition (RFC 9110 8.3.2). Absent
/// is empty; several field lines, or one that does not parse, are hashed as sent.
pub(super) fn media_type(headers: &HeaderMap) -> (Vec<u8>, BodyKind) {
    let mut lines = headers.get_all(CONTENT_TYPE).iter();
    let (first, second) = (lines.next(), lines.next());
    let Some(first) = first else {
        return (Vec::new(), BodyKind::Raw);
    };
    let mut out = Vec::with_capacity(32 + first.len());
    if second.is_none() {
        if let Some(kind) = normalise_media_type(first.as_bytes(), &mut out) {
            return (out, kind);
        }
        out.clear();
    }
    out.push(b'r');
    for line in headers.get_all(CONTENT_TYPE) {
        frame(&mut out, line.as_bytes());
    }
    (out, BodyKind::Raw)
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Writes `m`, the framed essence and the framed, sorted parameters of `v` to `out`, or
/// returns `None` (with `out` partly written) when `v` does not parse. Tokens are ASCII, so
/// they are lower-cased as they are copied: a media type without parameters costs one
/// allocation.
fn normalise_media_type(v: &[u8], out: &mut Vec<u8>) -> Option<BodyKind> {
    let ows = |i: &mut usize| {
        while let Some(b' ' | b'\t') = v.get(*i) {
            *i += 1;
        }
    };
    let token = |i: &mut usize| -> Option<&[u8]> {
        let start = *i;
        while v.get(*i).is_some_and(|&b| is_tchar(b)) {
            *i += 1;
        }
        (*i > start).then(|| &v[start..*i])
    };
    let mut i = 0;
    ows(&mut i);
    let ty = token(&mut i)?;
    if v.get(i) != Some(&b'/') {
        return None;
    }
    i += 1;
    let sub = token(&mut i)?;
    out.push(b'm');
    out.extend_from_slice(&((ty.len() + 1 + sub.len()) as u64).to_be_bytes());
    let at = out.len();
    out.extend(ty.iter().map(u8::to_ascii_lowercase));
    out.push(b'/');
    out.extend(sub.iter().map(u8::to_ascii_lowercase));
    let essence = &out[at..];
    let kind = if essence == b"application/json" || essence.ends_with(b"+json") {
        BodyKind::Json
    } else if essence == b"application/x-www-form-urlencoded" {
        BodyKind::Form
    } else {
        BodyKind::Raw
    };
    let mut params: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    loop {
        ows(&mut i);
        match v.get(i) {
            None => break,
            Some(b';') => i += 1,
            Some(_) => return None,
        }
        ows(&mut i);
        if matches!(v.get(i), None | Some(b';')) {
            continue; // empty parameter
        }
        let name = token(&mut i)?.to_ascii_lowercase();
        if v.get(i) != Some(&b'=') {
            return None;
        }
        i += 1;
        let mut value = Vec::new();
        if v.get(i) == Some(&b'"') {
            i += 1;
            loop {
                match *v.get(i)? {
                    b'"' => break,
                    b'\\' => {
                        value.push(*v.get(i + 1)?);
                        i += 2;
                    }
                    b => {
                        value.push(b);
                        i += 1;
                    }
                }
            }
            i += 1;
        } else {
            value.extend_from_slice(token(&mut i).unwrap_or_default());
        }
        if name == b"charset" {
            value.make_ascii_lowercase();
        }
        params.push((name, value));
    }
    params.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, value) in &params {
        frame(out, name);
        frame(out, value);
    }
    Some(kind)
}

/// The `Content-Encoding` codings in order, lower-cased, framed; `identity` (a no-op) and
/// empty list elements left out, so absent and `identity` are both empty.
pub(super) fn content_codings(headers: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::new();
    for line in headers.get_all(CONTENT_ENCODING) {
        for coding in line.as_bytes().split(|&b| b == b',') {
            let coding = coding.trim_ascii().to_ascii_lowercase();
            if !coding.is_empty() && coding != b"identity" {
                frame(&mut out, &coding);
            }
        }
    }
    out
}
