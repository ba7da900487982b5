//! Objects: members in RFC 8785 order (by UTF-16 code units), duplicate keys refused, and
//! the key orders a thread remembers so that objects of one shape sort without comparing.

use std::cmp::Ordering;

use super::string::hex4;
use super::{Canon, DEFER_TOP_MIN};

/// One written member of an open object: `out[key..end]` is `"key":value`; the key's
/// content is `out[key + 1..colon - 1]`.
#[derive(Clone, Copy)]
pub(super) struct Member {
    pub(super) key: usize,
    pub(super) colon: usize,
    pub(super) end: usize,
    /// UTF-8 with no escapes and no supplementary-plane character: its byte order is UTF-16
    /// order ([`is_simple`]).
    pub(super) simple: bool,
    /// A simple key's first 8 bytes, big-endian, zero-padded (a simple key holds no NUL):
    /// most comparisons end here.
    pub(super) prefix: u64,
}

/// How an object of `n` simple keys with these prefixes, all distinct, sorts. The prefixes
/// alone decide that order, so another object with the same ones sorts the same way without
/// comparing: the objects of one array mostly share their keys and their order, and this
/// saves sorting all but the first.
#[derive(Clone, Copy, Default)]
pub(super) struct KeyOrder {
    n: usize,
    prefixes: [u64; 16],
    order: [u8; 16],
    moved: bool,
    /// The order as runs of members that stay side by side, `(first, count)`: each run is
    /// moved in one copy, commas and all.
    runs: [(u8, u8); 16],
    run_count: usize,
}

/// Slots in `Canon::orders`, chosen by member count.
const KEY_ORDERS: usize = 4;

impl Canon<'_, '_> {
    /// [`Canon::close_members`] for the usual unsorted object: not the outermost, and with
    /// keys whose order is remembered ([`KeyOrder`]), so that it is moved without comparing.
    /// A lean path of its own, moving the order's runs of members: the general path's set-up
    /// cost more than its moves.
    /// `s[ps..i]` is the pending input run, `i` at the `}`. Returns whether it closed the
    /// object (its `}` written and no run pending); if not, it did nothing.
    pub(super) fn close_known(
        &mut self,
        start: usize,
        base: usize,
        ps: usize,
        i: usize,
    ) -> Option<bool> {
        let members = self.members.get(base..)?;
        let n = members.len();
        let Some(o) = self.orders.get(n % KEY_ORDERS) else {
            return Some(false);
        };
        let known = o.n == n
            && o.moved
            && members
                .iter()
                .zip(&o.prefixes)
                .fold(true, |same, (m, &p)| same & m.simple & (m.prefix == p));
        if !known {
            return Some(false);
        }
        let (runs, run_count) = (o.runs, o.run_count);
        let s = self.s;
        let body = start + 1;
        // Where the members' bytes are: in the input when the whole object was in the run
        // (output position `p` is input `p + delta`), else copied aside to `scratch`: the part
        // in `out`, then the run. Either way `out` then holds them unsorted, to be overwritten
        // in order.
        let flushed = self.out.len();
        let run = s.get(ps..i)?;
        let (src, delta) = if start >= flushed {
            (s, ps.wrapping_sub(flushed))
        } else {
            // The run's part from the input: reading it back from `out` just after it was
            // written there measured slower.
            self.scratch.clear();
            self.scratch.extend_from_slice(self.out.get(body..)?);
            self.scratch.extend_from_slice(run);
            (&self.scratch[..], body.wrapping_neg())
        };
        self.out.extend_from_slice(run);
        let dst = self.out.get_mut(body..)?;
        let mut w = 0;
        for &(first, count) in runs.get(..run_count)? {
            let first = usize::from(first);
            let (a, b) = (
                members.get(first)?,
                members.get(first + usize::from(count) - 1)?,
            );
            let bytes = src.get(a.key.wrapping_add(delta)..b.end.wrapping_add(delta))?;
            copy_short(dst.get_mut(w..w + bytes.len())?, bytes);
            w += bytes.len();
            // A comma after each member but the last, which ends `dst`.
            if let Some(comma) = dst.get_mut(w) {
                *comma = b',';
                w += 1;
            }
        }
        debug_assert_eq!(w, dst.len());
        self.members.truncate(base);
        self.out.push(b'}');
        Some(true)
    }

    /// Closes the object whose `{` is at output position `start`, its members from
    /// `self.members[base..]`, its `}` just before `self.i`. `top`: it is the outermost value.
    pub(super) fn close_members(&mut self, start: usize, base: usize, top: bool) -> Option<()> {
        let close = self.i - 1;
        // Where the members' bytes are: still in the input when the whole object is pending
        // (no whitespace, no rewritten value), else in `out`. Whitespace before the `}` is
        // skipped, not pending: the members end where the pending run ends, not at `close`.
        let flushed = self.out.len();
        let in_input = start >= flushed;
        let members_end = self.pending.1;
        if !in_input {
            self.flush();
        }
        let (src, delta): (&[u8], usize) = if in_input {
            (self.s, self.pending.0.wrapping_sub(flushed))
        } else {
            (self.out, 0)
        };
        let members = &mut self.members[base..];
        let n = members.len();
        let mut moved = false;
        // The members in order, as indices: up to 16 by an insertion sort that moves bytes,
        // not members, and finds duplicates on the way (equal keys end up side by side, and
        // the later one stops at the earlier); an object already in order costs n - 1
        // comparisons. Larger objects are sorted in place.
        let mut order = [0u8; 16];
        let small = n <= 16;
        if self.orders.len() < KEY_ORDERS {
            self.orders.resize(KEY_ORDERS, KeyOrder::default());
        }
        let slot = n % KEY_ORDERS;
        let known = small
            && self.orders.get(slot).is_some_and(|o| {
                o.n == n
                    && members
                        .iter()
                        .zip(&o.prefixes)
                        .fold(true, |same, (m, &p)| same & m.simple & (m.prefix == p))
            });
        if known {
            let o = self.orders.get(slot)?;
            (order, moved) = (o.order, o.moved);
        } else if small {
            for i in 1..n {
                let m = &members[i];
                let mut j = i;
                while j > 0 {
                    match key_cmp(src, delta, &members[usize::from(order[j - 1])], m) {
                        Ordering::Greater => {
                            order[j] = order[j - 1];
                            j -= 1;
                            moved = true;
                        }
                        Ordering::Equal => return None, // duplicate keys: parsers disagree
                        Ordering::Less => break,
                    }
                }
                order[j] = i as u8;
            }
            // Recorded when the prefixes alone decided the order.
            let decided = (1..n).all(|k| {
                let (a, b) = (
                    &members[usize::from(order[k - 1])],
                    &members[usize::from(order[k])],
                );
                a.simple && b.simple && a.prefix < b.prefix
            });
            if decided && n > 1 {
                let o = self.orders.get_mut(slot)?;
                o.n = n;
                for (p, m) in o.prefixes.iter_mut().zip(members.iter()) {
                    *p = m.prefix;
                }
                (o.order, o.moved) = (order, moved);
                o.run_count = 0;
                for (k, &m) in order[..n].iter().enumerate() {
                    if k > 0 && order[k - 1] + 1 == m {
                        o.runs.get_mut(o.run_count - 1)?.1 += 1;
                    } else {
                        *o.runs.get_mut(o.run_count)? = (m, 1);
                        o.run_count += 1;
                    }
                }
            }
        } else if !members
            .windows(2)
            .all(|w| key_cmp(src, delta, &w[0], &w[1]) == Ordering::Less)
        {
            members.sort_unstable_by(|a, b| key_cmp(src, delta, a, b));
            if members
                .windows(2)
                .any(|w| key_cmp(src, delta, &w[0], &w[1]) == Ordering::Equal)
            {
                return None; // duplicate keys: parsers disagree on which one wins
            }
            moved = true;
        }
        if !moved {
            self.members.truncate(base);
            self.emit(close, close + 1);
            return Some(());
        }
        let body = start + 1;
        if in_input {
            // One copy: the run before the object, its `{` and its members as they are, to
            // be overwritten in order below.
            let from = self.pending.0;
            self.out.extend_from_slice(&self.s[from..members_end]);
        }
        let members = &self.members[base..];
        let nth = |k: usize| {
            if small {
                members[usize::from(order[k])]
            } else {
                members[k]
            }
        };
        // Past a few KiB, hashing the members in order where they lie beats moving them
        // twice; below, the extra SHA-256 calls cost more than the copies.
        let large = !in_input && self.out.len() - body >= DEFER_TOP_MIN;
        if let (false, true, true, Some(order)) = (in_input, top, large, self.top.as_mut()) {
            // The outermost object, already in `out`: leave its bytes where they are and
            // record the order to hash them in.
            order.clear();
            order.extend((0..n).map(|k| {
                let m = nth(k);
                (m.key, m.end)
            }));
            self.members.truncate(base);
            self.out.push(b'}');
            self.pending = (close + 1, close + 1);
            return Some(());
        }
        // The members take as many bytes sorted as unsorted: overwrite them in place, from
        // the input or from a copy, each with a few fixed-size moves rather than a `memcpy`
        // call.
        let (src, delta) = if in_input {
            (self.s, delta)
        } else {
            self.scratch.clear();
            self.scratch.extend_from_slice(&self.out[body..]);
            (&self.scratch[..], body.wrapping_neg())
        };
        let dst = self.out.get_mut(body..)?;
        let mut w = 0;
        let mut put = |m: &Member| -> Option<()> {
            if w > 0 {
                *dst.get_mut(w)? = b',';
                w += 1;
            }
            let bytes = src.get(m.key.wrapping_add(delta)..m.end.wrapping_add(delta))?;
            copy_short(dst.get_mut(w..w + bytes.len())?, bytes);
            w += bytes.len();
            Some(())
        };
        if small {
            for &k in &order[..n] {
                put(members.get(usize::from(k))?)?;
            }
        } else {
            for m in members {
                put(m)?;
            }
        }
        debug_assert_eq!(w, dst.len());
        self.members.truncate(base);
        self.out.push(b'}');
        self.pending = (close + 1, close + 1);
        Some(())
    }
}

/// `dst.copy_from_slice(src)` in one or two fixed-size moves when short (members are mostly
/// under 64 bytes), where `copy_from_slice` would call `memcpy`.
#[inline(always)]
pub(super) fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    // Whole-array moves (a load and a store each), not `copy_from_slice`: LLVM merged those
    // fixed-size copies into the `memcpy` call below, one call per member.
    macro_rules! two_moves {
        ($w:literal) => {{
            if let (Some(d), Some(s)) = (dst.first_chunk_mut::<$w>(), src.first_chunk::<$w>()) {
                *d = *s;
            }
            if let (Some(d), Some(s)) = (dst.last_chunk_mut::<$w>(), src.last_chunk::<$w>()) {
                *d = *s;
            }
        }};
    }
    match n {
        _ if dst.len() != n => {}
        33..=64 => two_moves!(32),
        16..=32 => two_moves!(16),
        8..=15 => two_moves!(8),
        4..=7 => two_moves!(4),
        0..=3 => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = *s;
            }
        }
        _ => dst.copy_from_slice(src),
    }
}

/// RFC 8785 orders keys by UTF-16 code units. That is byte order for keys without escapes
/// or supplementary-plane characters (4-byte UTF-8, lead byte >= 0xF0).
/// Keys are at `src[position + delta]` (wrapping: `delta` may stand for a negative shift).
#[inline(always)]
fn key_cmp(src: &[u8], delta: usize, a: &Member, b: &Member) -> Ordering {
    if a.simple && b.simple && a.prefix != b.prefix {
        return a.prefix.cmp(&b.prefix);
    }
    let key = |m: &Member| &src[(m.key + 1).wrapping_add(delta)..(m.colon - 1).wrapping_add(delta)];
    let (ka, kb) = (key(a), key(b));
    if a.simple && b.simple {
        ka.cmp(kb)
    } else {
        utf16_units(ka).cmp(&utf16_units(kb))
    }
}

/// Whether a key's canonical content sorts by its bytes ([`key_cmp`]): no escape, no
/// supplementary-plane character, and UTF-8. A key that is not UTF-8 (the body is hashed raw
/// then) must not be simple: it would sort by its bytes against simple keys and by a lossy
/// reading against others, no total order, and `sort_unstable_by` panics on that (found by
/// the fuzz target). Keys the ASCII scan clears are simple without this test.
pub(super) fn is_simple(content: &[u8]) -> bool {
    !content.iter().any(|&b| b == b'\\' || b >= 0xF0) && std::str::from_utf8(content).is_ok()
}

/// A key's first 8 bytes, big-endian, zero-padded.
#[inline]
pub(super) fn key_prefix(content: &[u8]) -> u64 {
    match content.first_chunk::<8>() {
        Some(head) => u64::from_be_bytes(*head),
        None => content
            .iter()
            .enumerate()
            .fold(0, |p, (k, &b)| p | u64::from(b) << (56 - 8 * k)),
    }
}

/// The UTF-16 code units of a string's canonical content.
fn utf16_units(k: &[u8]) -> Vec<u16> {
    let mut units = Vec::with_capacity(k.len());
    let mut i = 0;
    while i < k.len() {
        let run = k[i..]
            .iter()
            .position(|&b| b == b'\\')
            .map_or(k.len(), |p| i + p);
        // Escapes are ASCII, so the runs between them are whole UTF-8.
        units.extend(String::from_utf8_lossy(&k[i..run]).encode_utf16());
        i = run;
        if i < k.len() {
            let (unit, len) = match k.get(i + 1) {
                Some(b'"') => (0x22, 2),
                Some(b'\\') => (0x5c, 2),
                Some(b'b') => (0x08, 2),
                Some(b'f') => (0x0c, 2),
                Some(b'n') => (0x0a, 2),
                Some(b'r') => (0x0d, 2),
                Some(b't') => (0x09, 2),
                _ => (hex4(k, i + 2).unwrap_or(0), 6),
            };
            units.push(unit);
            i += len;
        }
    }
    units
}
