//! Numbers: RFC 8785's form where it is exact, else the exact `#` form (see the
//! `fingerprint` module's docs).

use std::io::Write as _;

use super::Canon;

impl Canon<'_, '_> {
    /// Writes a number literal's canonical form; see the `fingerprint` module's docs.
    pub(super) fn number(&mut self) -> Option<()> {
        let s = self.s;
        let start = self.i;
        let mut i = start;
        let negative = s[i] == b'-';
        if negative {
            i += 1;
        }
        let int_start = i;
        match *s.get(i)? {
            b'0' => i += 1,
            b'1'..=b'9' => i = digits_end(s, i + 1),
            _ => return None,
        }
        let int = &s[int_start..i];
        let mut frac: &[u8] = &[];
        if s.get(i) == Some(&b'.') {
            let frac_start = i + 1;
            i = digits_end(s, frac_start);
            if i == frac_start {
                return None;
            }
            frac = &s[frac_start..i];
        }
        let mut exp = None;
        if let Some(b'e' | b'E') = s.get(i) {
            i += 1;
            let exp_negative = match s.get(i) {
                Some(b'-') => {
                    i += 1;
                    true
                }
                Some(b'+') => {
                    i += 1;
                    false
                }
                _ => false,
            };
            let exp_start = i;
            i = digits_end(s, exp_start);
            if i == exp_start {
                return None;
            }
            exp = Some((exp_negative, &s[exp_start..i]));
        }
        self.i = i;
        let literal = &s[start..i];
        if exp.is_none() {
            if frac.is_empty() {
                if int == b"0" {
                    self.out().push(b'0'); // and "-0"
                    return Some(());
                }
                // At most 15 digits: below 2^53, printed by ECMAScript as written.
                if int.len() <= 15 {
                    self.emit(start, i);
                    return Some(());
                }
            } else if plain_decimal_is_canonical(int, frac) {
                self.emit(start, i);
                return Some(());
            }
        }
        let value = Decimal::new(negative, int, frac, exp);
        if value.a.is_empty() && value.b.is_empty() {
            self.out().push(b'0');
            return Some(());
        }
        // The literal is ASCII, and Rust parses any JSON number, rounding correctly.
        let double: f64 = std::str::from_utf8(literal).ok()?.parse().ok()?;
        if double.is_finite() {
            let mut buf = ryu_js::Buffer::new();
            let es = buf.format_finite(double);
            if es_decimal(es.as_bytes()).is_some_and(|d| d == value) {
                self.out().extend_from_slice(es.as_bytes());
                return Some(());
            }
        }
        value.write_exact(self.out());
        Some(())
    }
}

#[inline]
pub(super) fn digits_end(s: &[u8], mut i: usize) -> usize {
    // The first non-digit of the next 8 bytes from the word's bits, not a branch per digit:
    // numbers vary in length, and this measured 2-3% faster on the fingerprint benchmark's
    // orders (integers of 1 to 3 digits, decimals).
    if let Some(chunk) = s.get(i..i + 8) {
        const ONES: u64 = 0x0101_0101_0101_0101;
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        // Per byte nonzero unless a digit: high nibble 3, and still 3 after adding 6. A carry
        // out of a byte above 0xf9 only reaches bytes after that non-digit.
        let x = ((w & (ONES * 0xf0)) ^ (ONES * 0x30))
            | ((w.wrapping_add(ONES * 0x06) & (ONES * 0xf0)) ^ (ONES * 0x30));
        let hits = (((x & (ONES * 0x7f)) + ONES * 0x7f) | x) & (ONES * 0x80);
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while s.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    i
}

/// `d.ddd` with at most 15 significant digits, no trailing fraction zero, and a magnitude of
/// at least 1e-6: such a decimal is its double's shortest round-trip form, and ECMAScript
/// prints it unchanged (it switches to exponents below 1e-6 and from 1e21).
pub(super) fn plain_decimal_is_canonical(int: &[u8], frac: &[u8]) -> bool {
    if frac.last() == Some(&b'0') {
        return false;
    }
    let significant = if int == b"0" {
        let zeros = frac.iter().take_while(|&&d| d == b'0').count();
        if zeros >= 6 {
            return false;
        }
        frac.len() - zeros
    } else {
        int.len() + frac.len()
    };
    significant <= 15
}

/// For a decimal `int.frac` (no exponent) with trailing zeros: how many digits of `frac` its
/// ECMAScript form keeps, when that form is the literal without those zeros (and without the
/// point when none are left); `None` when it is another form, which [`Canon::number`] writes.
/// Amounts written with a fixed number of decimals (`10.50`, `3.00`) take this way.
pub(super) fn without_trailing_zeros(negative: bool, int: &[u8], frac: &[u8]) -> Option<usize> {
    let kept = frac.len() - frac.iter().rev().take_while(|&&d| d == b'0').count();
    if kept == frac.len() {
        return None; // no trailing zeros: not canonical for another reason
    }
    if kept == 0 {
        // An integer of up to 15 digits is below 2^53 and written as is; `-0` is written `0`.
        return (int.len() <= 15 && !(negative && int == b"0")).then_some(0);
    }
    plain_decimal_is_canonical(int, &frac[..kept]).then_some(kept)
}

/// A decimal's value: sign, the significant digits `a` then `b` (no leading or trailing
/// zeros; both empty for zero), and the exponent of the last digit.
#[derive(Debug)]
pub(super) struct Decimal<'a> {
    negative: bool,
    a: &'a [u8],
    b: &'a [u8],
    exp: Exponent<'a>,
}

/// Literal exponents of up to 30 digits are exact in an `i128` with room for the shift by
/// the digit count; longer ones keep their digits.
#[derive(Debug, PartialEq, Eq)]
enum Exponent<'a> {
    Small(i128),
    /// `(-1 if negative) * digits + shift`, with `digits` over 30 long: far beyond any shift.
    Big {
        negative: bool,
        digits: &'a [u8],
        shift: i128,
    },
}

/// Equal values: the digits are compared as one sequence, wherever the point split them.
impl PartialEq for Decimal<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.negative == other.negative
            && self.exp == other.exp
            && self.a.len() + self.b.len() == other.a.len() + other.b.len()
            && self
                .a
                .iter()
                .chain(self.b)
                .eq(other.a.iter().chain(other.b))
    }
}

impl<'a> Decimal<'a> {
    /// The value of `-? int . frac e exp` (digits only, `exp` as sign and digits).
    fn new(negative: bool, int: &'a [u8], frac: &'a [u8], exp: Option<(bool, &'a [u8])>) -> Self {
        let zeros = |d: &[u8]| d.iter().take_while(|&&b| b == b'0').count();
        let trailing = |d: &[u8]| d.iter().rev().take_while(|&&b| b == b'0').count();
        let (mut a, mut b) = (&int[zeros(int)..], frac);
        if a.is_empty() {
            b = &b[zeros(b)..];
        }
        let mut dropped = trailing(b);
        b = &b[..b.len() - dropped];
        if b.is_empty() {
            let t = trailing(a);
            a = &a[..a.len() - t];
            dropped += t;
        }
        if a.is_empty() && b.is_empty() {
            return Self {
                negative: false,
                a,
                b,
                exp: Exponent::Small(0),
            };
        }
        // Both at most the body's length: far inside an i128.
        let shift = dropped as i128 - frac.len() as i128;
        let exp = match exp {
            None => Exponent::Small(shift),
            Some((negative, digits)) => {
                let digits = &digits[zeros(digits)..];
                if digits.len() <= 30 {
                    let magnitude = digits
                        .iter()
                        .fold(0i128, |n, &d| n * 10 + i128::from(d - b'0'));
                    Exponent::Small(if negative { -magnitude } else { magnitude } + shift)
                } else {
                    Exponent::Big {
                        negative,
                        digits,
                        shift,
                    }
                }
            }
        };
        Self {
            negative,
            a,
            b,
            exp,
        }
    }

    /// `#`, `-` if negative, the digits, `e`, the exponent: never an RFC 8785 number.
    pub(super) fn write_exact(&self, out: &mut Vec<u8>) {
        out.push(b'#');
        if self.negative {
            out.push(b'-');
        }
        out.extend_from_slice(self.a);
        out.extend_from_slice(self.b);
        out.push(b'e');
        match self.exp {
            Exponent::Small(e) => {
                let _ = write!(out, "{e}");
            }
            Exponent::Big {
                negative,
                digits,
                shift,
            } => {
                if negative {
                    out.push(b'-');
                }
                out.extend_from_slice(&shift_digits(digits, if negative { -shift } else { shift }));
            }
        }
    }
}

/// `digits + delta` for a decimal `digits` far larger than `|delta|`.
fn shift_digits(digits: &[u8], delta: i128) -> Vec<u8> {
    let mut n = digits.to_vec();
    let mut carry = delta.unsigned_abs();
    for d in n.iter_mut().rev() {
        if carry == 0 {
            break;
        }
        let digit = u128::from(*d - b'0');
        let step = carry % 10;
        carry /= 10;
        let v = if delta >= 0 {
            let v = digit + step;
            carry += v / 10;
            v % 10
        } else if digit >= step {
            digit - step
        } else {
            carry += 1;
            digit + 10 - step
        };
        *d = b'0' + v as u8;
    }
    if carry > 0 {
        // Only when adding: more digits than before.
        let mut head = carry.to_string().into_bytes();
        head.extend_from_slice(&n);
        n = head;
    }
    let zeros = n.iter().take_while(|&&b| b == b'0').count();
    n.drain(..zeros);
    n
}

/// The value of an ECMAScript number string (`-1.5e-7`, `1e+21`, `123`).
pub(super) fn es_decimal(es: &[u8]) -> Option<Decimal<'_>> {
    let (negative, rest) = match es.split_first()? {
        (b'-', rest) => (true, rest),
        _ => (false, es),
    };
    let (mantissa, exp) = match rest.iter().position(|&b| b == b'e' || b == b'E') {
        Some(p) => {
            let e = &rest[p + 1..];
            let (neg, digits) = match e.split_first()? {
                (b'-', d) => (true, d),
                (b'+', d) => (false, d),
                _ => (false, e),
            };
            (&rest[..p], Some((neg, digits)))
        }
        None => (rest, None),
    };
    let (int, frac) = match mantissa.iter().position(|&b| b == b'.') {
        Some(p) => (&mantissa[..p], &mantissa[p + 1..]),
        None => (mantissa, &[][..]),
    };
    Some(Decimal::new(negative, int, frac, exp))
}
