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
    let mut out = Vec::new();
    let (first, second) = (lines.next(), lines.next());
    let Some(first) = first else {
        return (out, BodyKind::Raw);
    };
    if second.is_none() {
        if let Some((essence, params)) = parse_media_type(first.as_bytes()) {
            out.push(b'm');
            frame(&mut out, essence.as_bytes());
            for (name, value) in &params {
                frame(&mut out, name.as_bytes());
                frame(&mut out, value);
            }
            let kind = if essence == "application/json" || essence.ends_with("+json") {
                BodyKind::Json
            } else if essence == "application/x-www-form-urlencoded" {
                BodyKind::Form
            } else {
                BodyKind::Raw
            };
            return (out, kind);
        }
    }
    out.push(b'r');
    for line in headers.get_all(CONTENT_TYPE) {
        frame(&mut out, line.as_bytes());
    }
    (out, BodyKind::Raw)
}

type Params = Vec<(String, Vec<u8>)>;

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn parse_media_type(v: &[u8]) -> Option<(String, Params)> {
    let ows = |i: &mut usize| {
        while let Some(b' ' | b'\t') = v.get(*i) {
            *i += 1;
        }
    };
    let token = |i: &mut usize| -> Option<String> {
        let start = *i;
        while v.get(*i).is_some_and(|&b| is_tchar(b)) {
            *i += 1;
        }
        (*i > start).then(|| String::from_utf8_lossy(&v[start..*i]).to_ascii_lowercase())
    };
    let mut i = 0;
    ows(&mut i);
    let ty = token(&mut i)?;
    if v.get(i) != Some(&b'/') {
        return None;
    }
    i += 1;
    let sub = token(&mut i)?;
    let essence = format!("{ty}/{sub}");
    let mut params = Params::new();
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
        let name = token(&mut i)?;
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
            let start = i;
            while v.get(i).is_some_and(|&b| is_tchar(b)) {
                i += 1;
            }
            value.extend_from_slice(&v[start..i]);
        }
        if name == "charset" {
            value.make_ascii_lowercase();
        }
        params.push((name, value));
    }
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Some((essence, params))
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
