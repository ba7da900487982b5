//! RFC 8785 canonical JSON, with exact numbers.
//!
//! The JSON reader is hand-written and single-pass, neither recurses nor allocates per value,
//! and copies input that is already canonical in runs rather than token by token: `serde_json`
//! keeps the last of duplicate keys and, without its global `arbitrary_precision` feature,
//! loses number literals. Documents without excluded fields take a leaner loop
//! ([`Canon::run_plain`]) than those with ([`Canon::run`]); property tests hold them to the
//! same output. That loop knows an object is already in order from its keys as it reads them,
//! and an object whose keys match a recently sorted one's ([`KeyOrder`], kept per thread)
//! takes that order without comparing. The fingerprint hashes an unsorted outermost object's
//! members in sorted order where they lie ([`hash_canonical`]) instead of moving the whole
//! body into order: the same bytes reach SHA-256, and a property test holds the digest to the
//! canonical text.

mod fast;
mod general;
mod number;
mod object;
mod string;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use sha2::{Digest, Sha256};

use self::fast::Open;
use self::general::{Frame, Pointer};
use self::object::{KeyOrder, Member};
use super::JsonPointer;

/// The canonical form of `body` with `excluded` fields removed, or `None` when canonicalising
/// could merge two different requests.
pub(crate) fn canonical_json(body: &[u8], excluded: &[JsonPointer]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    canonical_json_into(body, excluded, &mut out).then_some(out)
}

/// [`canonical_json`] into `out` (cleared first); `false` where that returns `None`.
pub(crate) fn canonical_json_into(
    body: &[u8],
    excluded: &[JsonPointer],
    out: &mut Vec<u8>,
) -> bool {
    with_buffers(|b| canonicalise(body, excluded, out, &mut b.work, false))
}

/// Writes the canonical form of `body` into `out`, or returns `false`. With `defer_top`, an
/// outermost object whose members are out of order is left unsorted in `out` and its order
/// put in `work.top` instead, for [`hash_canonical`]: that saves copying the whole body twice.
pub(super) fn canonicalise(
    body: &[u8],
    excluded: &[JsonPointer],
    out: &mut Vec<u8>,
    work: &mut Work,
    defer_top: bool,
) -> bool {
    out.clear();
    work.top.clear();
    work.stack.clear();
    work.open.clear();
    work.members.clear();
    out.reserve(body.len());
    let mut c = Canon {
        s: body,
        i: 0,
        out,
        pending: (0, 0),
        stack: std::mem::take(&mut work.stack),
        members: std::mem::take(&mut work.members),
        scratch: std::mem::take(&mut work.scratch),
        orders: std::mem::take(&mut work.orders),
        // Not `collect`ed when empty: two calls per body for nothing (see `with_buffers`).
        pointers: if excluded.is_empty() {
            Vec::new()
        } else {
            excluded.iter().map(Pointer::new).collect()
        },
        active: if excluded.is_empty() {
            Vec::new()
        } else {
            (0..excluded.len()).collect()
        },
        top: defer_top.then(|| std::mem::take(&mut work.top)),
        non_ascii: false,
    };
    let done = if excluded.is_empty() {
        let mut open = std::mem::take(&mut work.open);
        let done = c.run_plain(&mut open).is_some();
        work.open = open;
        done
    } else {
        c.run().is_some()
    };
    (work.stack, work.members, work.scratch) = (c.stack, c.members, c.scratch);
    work.orders = c.orders;
    if let Some(top) = c.top {
        work.top = top;
    }
    // Invalid UTF-8 is not JSON: hashed raw. Only a string can hold a byte above 0x7f.
    done && (!c.non_ascii || std::str::from_utf8(body).is_ok())
}

/// Feeds the canonical form that [`canonicalise`] left in `out` and `top` to `h`: `out` as it
/// is, or, where `top` holds the outermost object's members (ranges of `out`) in order, the
/// bytes before them, the members in that order with commas, and the closing brace.
pub(super) fn hash_canonical(h: &mut Sha256, out: &[u8], top: &[(usize, usize)]) {
    let (Some(first), Some(last)) = (top.iter().map(|m| m.0).min(), top.iter().map(|m| m.1).max())
    else {
        h.update(out);
        return;
    };
    h.update(&out[..first]);
    for (k, &(a, b)) in top.iter().enumerate() {
        if k > 0 {
            h.update(b",");
        }
        h.update(&out[a..b]);
    }
    h.update(&out[last..]);
}

/// Buffers one thread reuses from request to request, so that a small body costs no
/// allocation.
#[derive(Default)]
pub(super) struct Buffers {
    /// The canonical body.
    pub(super) out: Vec<u8>,
    pub(super) work: Work,
}

#[derive(Default)]
pub(super) struct Work {
    stack: Vec<Frame>,
    open: Vec<Open>,
    members: Vec<Member>,
    scratch: Vec<u8>,
    /// Recent objects' key orders, kept from request to request.
    orders: Vec<KeyOrder>,
    /// The outermost object's members in order, when left unsorted in the output.
    pub(super) top: Vec<(usize, usize)>,
}

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::new(Buffers::default());
}

/// Runs `f` with this thread's buffers, in place, or with new ones when they are in use or
/// gone: in place, since moving them out and back measured slower on small bodies. Buffers
/// grown past `KEEP` bytes are freed afterwards rather than kept for the thread's lifetime. `f`
/// gets them as the last call left them: [`canonicalise`] clears what it uses.
pub(super) fn with_buffers<R>(f: impl FnOnce(&mut Buffers) -> R) -> R {
    const KEEP: usize = 64 * 1024;
    // Gone only while the thread exits; `with` cannot fail once this has not.
    if BUFFERS.try_with(|_| ()).is_err() {
        return f(&mut Buffers::default());
    }
    BUFFERS.with(|cell| {
        let Ok(mut b) = cell.try_borrow_mut() else {
            return f(&mut Buffers::default());
        };
        let r = f(&mut b);
        if b.out.capacity() > KEEP {
            b.out = Vec::new();
        }
        let w = &b.work;
        if w.scratch.capacity() > KEEP
            || w.stack.capacity() > KEEP / 64
            || w.top.capacity() > KEEP / 16
            || w.open.capacity() > KEEP / 64
            || w.members.capacity() > KEEP / 32
        {
            b.work = Work::default();
        }
        r
    })
}

/// SHA-256 of the canonical JSON form of `body`, with the buffers `fingerprint` uses.
pub(crate) fn canonical_json_digest(body: &[u8]) -> Option<[u8; 32]> {
    with_buffers(|b| {
        canonicalise(body, &[], &mut b.out, &mut b.work, true).then(|| {
            let mut h = Sha256::new();
            hash_canonical(&mut h, &b.out, &b.work.top);
            h.finalize().into()
        })
    })
}

/// The smallest outermost object (in bytes) that [`hash_canonical`] hashes in place. Tests
/// use a small one, so that the property tests' documents take both ways.
#[cfg(not(test))]
const DEFER_TOP_MIN: usize = 4096;
#[cfg(test)]
const DEFER_TOP_MIN: usize = 16;

struct Canon<'a, 'o> {
    /// The body; UTF-8 is checked at the end, and only if a string held a byte above 0x7f
    /// (`non_ascii`).
    s: &'a [u8],
    i: usize,
    /// The output is `out` then `s[pending.0..pending.1]`: input that is already canonical
    /// is not copied byte by byte but in runs, as late as possible. Positions (`pos`)
    /// count both.
    out: &'o mut Vec<u8>,
    pending: (usize, usize),
    stack: Vec<Frame>,
    members: Vec<Member>,
    /// Where an object's members are copied to be written back in order.
    scratch: Vec<u8>,
    /// The order of the last few objects' keys, by member count: see [`KeyOrder`].
    orders: Vec<KeyOrder>,
    pointers: Vec<Pointer>,
    /// Indices into `pointers`: a range per open frame, then per current item.
    active: Vec<usize>,
    /// Where the outermost object's order goes instead of sorting its bytes, if anywhere.
    top: Option<Vec<(usize, usize)>>,
    /// A string held a byte above 0x7f. Strings are the only place JSON allows one, so until
    /// this is set the body is ASCII and valid UTF-8; once it is, the body is checked whole
    /// at the end. A body that is ASCII so skips a pass over it.
    non_ascii: bool,
}

impl Canon<'_, '_> {
    /// The output length so far.
    #[inline]
    fn pos(&self) -> usize {
        self.out.len() + self.pending.1 - self.pending.0
    }

    /// Appends input bytes `a..b`, already canonical.
    #[inline]
    fn emit(&mut self, a: usize, b: usize) {
        if self.pending.1 != a {
            self.flush();
            self.pending.0 = a;
        }
        self.pending.1 = b;
    }

    #[inline]
    fn flush(&mut self) {
        let (a, b) = self.pending;
        if a != b {
            self.out.extend_from_slice(&self.s[a..b]);
        }
        self.pending = (b, b);
    }

    /// The output, for bytes that are not input.
    #[inline]
    fn out(&mut self) -> &mut Vec<u8> {
        self.flush();
        self.out
    }

    /// Output bytes `a..b`, which must lie wholly in `out` or wholly in the pending input.
    fn view(&self, a: usize, b: usize) -> &[u8] {
        let flushed = self.out.len();
        if a >= flushed {
            &self.s[self.pending.0 + a - flushed..self.pending.0 + b - flushed]
        } else {
            &self.out[a..b]
        }
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }
}
