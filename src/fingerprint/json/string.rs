//! Strings: RFC 8785's escapes, `\u` escapes decoded, lone surrogates kept as escapes, and
//! the scan for the bytes that end a plain run.

use super::Canon;

impl Canon<'_, '_> {
    /// At an opening quote: writes the string in canonical form (RFC 8785 3.2.2.2: only `"`,
    /// `\` and controls escaped, the rest UTF-8), and a lone surrogate as `\udxxx`.
    #[inline]
    pub(super) fn string(&mut self) -> Option<()> {
        let s = self.s;
        let start = self.i;
        let i = plain_end::<true>(s, start + 1);
        // Fast path: no escapes, so the input is already canonical.
        if s.get(i) == Some(&b'"') {
            self.emit(start, i + 1);
            self.i = i + 1;
            return Some(());
        }
        self.emit(start, i);
        self.string_rest(i)
    }

    /// The rest of a string with escapes (or a bad byte) at `i`.
    #[inline(never)]
    pub(super) fn string_rest(&mut self, mut i: usize) -> Option<()> {
        let s = self.s;
        // The pending run reaches `i`. Canonical text and canonical escapes only lengthen it,
        // so its end is stored only where something else is written, and on leaving.
        debug_assert_eq!(self.pending.1, i);
        loop {
            match *s.get(i)? {
                b'"' => {
                    self.pending.1 = i + 1;
                    self.i = i + 1;
                    return Some(());
                }
                b'\\' => match *s.get(i + 1)? {
                    b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                    _ => {
                        self.pending.1 = i;
                        i = self.escape(i)?;
                        self.pending = (i, i);
                    }
                },
                // Stands for itself, like ASCII; the body's UTF-8 is checked at the end.
                0x80.. => self.non_ascii = true,
                _ => return None, // raw control character
            }
            i = if self.non_ascii {
                plain_end::<false>(s, i)
            } else {
                plain_end::<true>(s, i)
            };
        }
    }

    /// At a backslash that is not a canonical escape ([`Canon::string_rest`] keeps those in
    /// the run): writes the escaped character canonically; returns where it ends.
    fn escape(&mut self, i: usize) -> Option<usize> {
        let s = self.s;
        match *s.get(i + 1)? {
            b'/' => {
                self.out().push(b'/');
                return Some(i + 2);
            }
            b'u' => {}
            _ => return None,
        }
        let out = self.out();
        let mut end = i;
        // `\u` escapes come in runs (a client escaping all non-ASCII text): decoded here one
        // after another, without going back through the string loop for each.
        loop {
            let unit = hex4(s, end + 2)?;
            end += 6;
            let cp = match unit {
                0xD800..=0xDBFF => match (s.get(end..end + 2), hex4(s, end + 2)) {
                    (Some(b"\\u"), Some(lo @ 0xDC00..=0xDFFF)) => {
                        end += 6;
                        0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(lo) - 0xDC00)
                    }
                    _ => {
                        write_unit_escape(unit, out);
                        return Some(end);
                    }
                },
                0xDC00..=0xDFFF => {
                    write_unit_escape(unit, out);
                    return Some(end);
                }
                _ => u32::from(unit),
            };
            // UTF-8 by hand: `encode_utf8` and a slice copy cost a call each.
            match cp {
                0x22 | 0x5c | 0..=0x1f => escape_char(cp as u8, out),
                0..=0x7f => out.push(cp as u8),
                0x80..=0x7ff => {
                    out.extend_from_slice(&[0xc0 | (cp >> 6) as u8, 0x80 | (cp & 0x3f) as u8])
                }
                0x800..=0xffff => out.extend_from_slice(&[
                    0xe0 | (cp >> 12) as u8,
                    0x80 | (cp >> 6 & 0x3f) as u8,
                    0x80 | (cp & 0x3f) as u8,
                ]),
                _ => out.extend_from_slice(&[
                    0xf0 | (cp >> 18) as u8,
                    0x80 | (cp >> 12 & 0x3f) as u8,
                    0x80 | (cp >> 6 & 0x3f) as u8,
                    0x80 | (cp & 0x3f) as u8,
                ]),
            }
            if s.get(end..end + 2) != Some(b"\\u") {
                return Some(end);
            }
        }
    }
}

/// Skips bytes that stand for themselves inside a string: stops at `"`, `\` or a control,
/// and with `ASCII` at any byte above 0x7f too (see [`Canon::non_ascii`]). Where it stops is
/// a char boundary.
///
/// The first 16 bytes are tested byte by byte (two per step), then 8 at a time. Where a
/// short string ends then comes from branches the CPU predicts (an API's keys and values
/// repeat their lengths), not from a word's bits, which the next token's every step would
/// wait on: an 8-byte scan from the first byte, and one byte a step instead of two, both
/// measured slower. Long strings still take the wide steps.
#[inline(always)]
pub(super) fn plain_end<const ASCII: bool>(s: &[u8], mut i: usize) -> usize {
    let stop = if ASCII { &STOP } else { &SPECIAL };
    // One bounds check for the 16 bytes, two bytes a step.
    match s.get(i..i + 16) {
        Some(narrow) => {
            for (k, &[a, b]) in narrow.as_chunks::<2>().0.iter().enumerate() {
                if stop[usize::from(a)] {
                    return i + 2 * k;
                }
                if stop[usize::from(b)] {
                    return i + 2 * k + 1;
                }
            }
            i += 16;
        }
        None => {
            while s.get(i).is_some_and(|&b| !stop[usize::from(b)]) {
                i += 1;
            }
            return i;
        }
    }
    while let Some(chunk) = s.get(i..i + 8) {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let hits = specials(w) | if ASCII { w & 0x8080_8080_8080_8080 } else { 0 };
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while s.get(i).is_some_and(|&b| !stop[usize::from(b)]) {
        i += 1;
    }
    i
}

/// The high bit of each byte of `w` (little-endian: the first byte lowest) that is `"`, `\`
/// or a control, exact for the lowest one (a borrow can flag a byte above it).
#[inline(always)]
fn specials(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let quote = w ^ (ONES * u64::from(b'"'));
    let backslash = w ^ (ONES * u64::from(b'\\'));
    // Per byte "is zero" and "is below 0x20".
    let hits = (quote.wrapping_sub(ONES) & !quote)
        | (backslash.wrapping_sub(ONES) & !backslash)
        | (w.wrapping_sub(ONES * 0x20) & !w);
    hits & HIGH
}

pub(super) fn hex4(s: &[u8], i: usize) -> Option<u16> {
    let [a, b, c, d] = *s.get(i..)?.first_chunk::<4>()?;
    let v = |h: u8| HEX_VALUE[usize::from(h)];
    let (a, b, c, d) = (v(a), v(b), v(c), v(d));
    // Each is 0-15, or 0xff for a byte that is not a hex digit.
    if (a | b | c | d) > 0xf {
        return None;
    }
    Some(u16::from(a) << 12 | u16::from(b) << 8 | u16::from(c) << 4 | u16::from(d))
}

/// Hex digits' values, by byte; `0xff` for other bytes.
const HEX_VALUE: [u8; 256] = {
    let mut t = [0xff; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        t[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};

const HEX: &[u8; 16] = b"0123456789abcdef";

fn write_unit_escape(unit: u16, out: &mut Vec<u8>) {
    out.extend_from_slice(b"\\u");
    for shift in [12, 8, 4, 0] {
        out.push(HEX[usize::from(unit >> shift & 0xf)]);
    }
}

/// RFC 8785 3.2.2.2 for `"`, `\` and the controls.
fn escape_char(b: u8, out: &mut Vec<u8>) {
    match b {
        b'"' => out.extend_from_slice(b"\\\""),
        b'\\' => out.extend_from_slice(b"\\\\"),
        0x08 => out.extend_from_slice(b"\\b"),
        0x09 => out.extend_from_slice(b"\\t"),
        0x0a => out.extend_from_slice(b"\\n"),
        0x0c => out.extend_from_slice(b"\\f"),
        0x0d => out.extend_from_slice(b"\\r"),
        _ => write_unit_escape(u16::from(b), out),
    }
}

/// A string's canonical content (without quotes).
pub(super) fn escape_str(s: &str, out: &mut Vec<u8>) {
    for &b in s.as_bytes() {
        if SPECIAL[b as usize] {
            escape_char(b, out);
        } else {
            out.push(b);
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

/// [`SPECIAL`] and every byte above 0x7f: where a string's ASCII run ends.
const STOP: [bool; 256] = {
    let mut t = SPECIAL;
    let mut i = 0x80;
    while i < 0x100 {
        t[i] = true;
        i += 1;
    }
    t
};
