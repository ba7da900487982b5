//! The fast path: [`Canon::run_plain`], for documents without excluded fields. It must write
//! what the general path ([`Canon::run`]) writes for a body in which no excluded field occurs.

use super::number::{digits_end, plain_decimal_is_canonical, without_trailing_zeros};
use super::object::{is_simple, key_prefix, Member};
use super::string::plain_end;
use super::Canon;

/// An open array or object in [`Canon::run_plain`]: where its bracket is in the output and
/// where its members start in `Canon::members` (the last of them is the current one, its
/// `end` set when its value is complete).
pub(super) struct Open {
    object: bool,
    start: usize,
    members: usize,
    /// Every key so far is simple and its prefix above the last one's: the members are in
    /// order and distinct, so closing it need not sort.
    sorted: bool,
}

impl Canon<'_, '_> {
    /// [`Canon::run`] for a document without excluded fields: the same output in fewer steps
    /// per token. The output is `out` then the input run `s[ps..i]`: canonical input costs
    /// no step at all per token, and is copied only where whitespace or a rewritten token
    /// ends the run (or an object is sorted).
    pub(super) fn run_plain(&mut self, open: &mut Vec<Open>) -> Option<()> {
        let s = self.s;
        let mut i = self.i;
        let mut ps = i;
        macro_rules! pos {
            () => {
                self.out.len() + i - ps
            };
        }
        // Copies the run out, for it to end at `i`.
        macro_rules! flush {
            () => {
                if ps != i {
                    self.out.extend_from_slice(&s[ps..i]);
                }
            };
        }
        // Whitespace is at most b' ': one test for the usual byte, and a run ends only
        // where there is some.
        macro_rules! ws {
            () => {
                if s.get(i).is_some_and(|&b| b <= b' ') {
                    flush!();
                    while let Some(b' ' | b'\t' | b'\n' | b'\r') = s.get(i) {
                        i += 1;
                    }
                    ps = i;
                }
            };
        }
        // Hands the state to a method of `self` that writes through `emit` and `out`, and
        // takes it back: a run the method left open continues, else a new one starts.
        macro_rules! call {
            ($e:expr) => {{
                self.i = i;
                self.pending = (ps, i);
                let r = $e;
                i = self.i;
                let (a, b) = self.pending;
                if b == i {
                    ps = a;
                } else {
                    self.flush();
                    ps = i;
                }
                r
            }};
        }
        // An object member's key and colon, recorded in `members`.
        macro_rules! key {
            () => {{
                if s.get(i) != Some(&b'"') {
                    return None;
                }
                let key = pos!();
                let end = plain_end::<true>(s, i + 1);
                let (simple, prefix);
                if s.get(end) == Some(&b'"') {
                    let content = &s[i + 1..end];
                    prefix = match s.get(i + 1..i + 9) {
                        // The 8 bytes from the key's start, those past its end masked off.
                        Some(word) if content.len() < 8 => {
                            let mut w = [0; 8];
                            w.copy_from_slice(word);
                            u64::from_be_bytes(w) & !(u64::MAX >> (8 * content.len()))
                        }
                        _ => key_prefix(content),
                    };
                    // The ASCII scan stopped at the closing quote: no escape and no byte
                    // above 0x7f, so simple without looking again (the test this replaced
                    // went over every byte of a key longer than 8).
                    debug_assert!(content.iter().all(|&b| b < 0x80 && b != b'\\'));
                    simple = true;
                    i = end + 1;
                } else {
                    i = end;
                    call!(self.string_rest(end))?;
                    flush!();
                    ps = i;
                    let content = self.out.get(key + 1..self.out.len() - 1)?;
                    simple = is_simple(content);
                    prefix = key_prefix(content);
                }
                let colon = pos!();
                ws!();
                if s.get(i) != Some(&b':') {
                    return None;
                }
                i += 1;
                self.members.push(Member {
                    key,
                    colon,
                    end: 0,
                    simple,
                    prefix,
                });
                (simple, prefix)
            }};
        }
        'value: loop {
            ws!();
            match *s.get(i)? {
                b'"' => {
                    let end = plain_end::<true>(s, i + 1);
                    if s.get(end) == Some(&b'"') {
                        i = end + 1;
                    } else {
                        i = end;
                        call!(self.string_rest(end))?;
                    }
                }
                b @ (b'{' | b'[') => {
                    let object = b == b'{';
                    let start = pos!();
                    i += 1;
                    ws!();
                    let close = if object { b'}' } else { b']' };
                    if s.get(i) == Some(&close) {
                        i += 1;
                    } else {
                        open.push(Open {
                            object,
                            start,
                            members: self.members.len(),
                            sorted: true,
                        });
                        if object {
                            key!();
                        }
                        continue 'value;
                    }
                }
                b't' | b'f' | b'n' => {
                    // Fixed-length comparisons: a 4-byte load each, not a `memcmp` call.
                    i += match s.get(i..i + 4) {
                        Some(b"true" | b"null") => 4,
                        Some(b"fals") if s.get(i + 4) == Some(&b'e') => 5,
                        _ => return None,
                    };
                }
                b'-' | b'0'..=b'9' => {
                    // Fast path: an integer of 1 to 15 digits, not `-0`, as written.
                    let digits = i + usize::from(s[i] == b'-');
                    let end = digits_end(s, digits);
                    let int_len = end - digits;
                    let leading_zero = int_len > 1 && s[digits] == b'0';
                    match s.get(end) {
                        Some(b'e' | b'E') => call!(self.number())?,
                        _ if int_len == 0 || leading_zero => return None,
                        Some(b'.') => {
                            // `d.ddd` that is its double's ECMAScript form: as written.
                            let frac_end = digits_end(s, end + 1);
                            let decimal =
                                !matches!(s.get(frac_end), Some(b'e' | b'E')) && frac_end > end + 1;
                            let (int, frac) = (&s[digits..end], &s[end + 1..frac_end]);
                            let negative = digits > i;
                            if decimal && plain_decimal_is_canonical(int, frac) {
                                i = frac_end;
                            } else if let Some(kept) = decimal
                                .then(|| without_trailing_zeros(negative, int, frac))
                                .flatten()
                            {
                                // Canonical once its trailing zeros go (`10.50`, `3.0`): the
                                // run ends before them and starts again after.
                                let cut = if kept == 0 { end } else { end + 1 + kept };
                                self.out.extend_from_slice(&s[ps..cut]);
                                i = frac_end;
                                ps = i;
                            } else {
                                call!(self.number())?;
                            }
                        }
                        // An integer of up to 15 digits is below 2^53: as written, but `-0`.
                        _ if int_len <= 15 && !(digits > i && s[digits] == b'0') => i = end,
                        _ => call!(self.number())?,
                    }
                }
                _ => return None,
            }
            // A value is complete: finish the item it was in, closing containers as they end.
            loop {
                let Some(f) = open.last() else {
                    break 'value;
                };
                if f.object {
                    let sorted = f.sorted;
                    let end = pos!();
                    self.members.last_mut()?.end = end;
                    ws!();
                    match s.get(i) {
                        Some(b',') => {
                            i += 1;
                            ws!();
                            let (simple, prefix) = key!();
                            // This key and the one before are the object's last two.
                            if let (true, [.., a, _]) = (sorted, &self.members[..]) {
                                if !(a.simple && simple && a.prefix < prefix) {
                                    open.last_mut()?.sorted = false;
                                }
                            }
                            continue 'value;
                        }
                        Some(b'}') => {
                            let f = open.pop()?;
                            if f.sorted {
                                self.members.truncate(f.members);
                                i += 1;
                            } else if !open.is_empty()
                                && self.close_known(f.start, f.members, ps, i)?
                            {
                                i += 1;
                                ps = i;
                            } else {
                                let top = open.is_empty();
                                self.i = i + 1;
                                self.pending = (ps, i);
                                self.close_members(f.start, f.members, top)?;
                                i = self.i;
                                let (a, b) = self.pending;
                                debug_assert_eq!(b, i);
                                ps = a;
                            }
                        }
                        _ => return None,
                    }
                } else {
                    ws!();
                    match s.get(i) {
                        Some(b',') => {
                            i += 1;
                            continue 'value;
                        }
                        Some(b']') => {
                            i += 1;
                            open.pop();
                        }
                        _ => return None,
                    }
                }
            }
        }
        ws!();
        flush!();
        self.i = i;
        self.pending = (i, i);
        (i == s.len()).then_some(())
    }
}
