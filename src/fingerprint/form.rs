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

fn percent_decode(s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hi = (*s.get(i + 1)? as char).to_digit(16)?;
                let lo = (*s.get(i + 2)? as char).to_digit(16)?;
                out.push((hi << 4 | lo) as u8);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    Some(out)
}
