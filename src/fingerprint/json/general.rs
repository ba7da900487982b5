//! The general path: [`Canon::run`], for documents with excluded fields. It keeps a frame
//! per open array or object, with the pointers that lead into it, and drops excluded
//! members as it goes. Where no excluded field occurs, it must write what the fast path
//! ([`Canon::run_plain`]) writes.

use super::object::{is_simple, key_prefix, Member};
use super::string::{escape_str, plain_end};
use super::Canon;
use crate::fingerprint::JsonPointer;

/// An excluded field's path, each token in the form its key takes in the output.
pub(super) struct Pointer {
    keys: Vec<Vec<u8>>,
    indices: Vec<Option<usize>>,
}

impl Pointer {
    pub(super) fn new(p: &JsonPointer) -> Self {
        let keys =
            p.0.iter()
                .map(|t| {
                    let mut k = Vec::with_capacity(t.len());
                    escape_str(t, &mut k);
                    k
                })
                .collect();
        let indices = p.0.iter().map(|t| array_index(t)).collect();
        Self { keys, indices }
    }
}

fn array_index(token: &str) -> Option<usize> {
    if token.len() > 1 && token.starts_with('0') {
        return None;
    }
    token.parse().ok()
}

/// An open array or object.
pub(super) struct Frame {
    object: bool,
    /// Where its `[` or `{` is in the output.
    start: usize,
    /// Its children are at this pointer depth.
    depth: usize,
    /// Pointers that lead into it: `Canon::active[active..active_end]`.
    active: usize,
    active_end: usize,
    /// Its members start at `Canon::members[members]`.
    members: usize,
    /// Items written, and items seen (an array's next index).
    written: usize,
    seen: usize,
    /// The current item: where it starts in the output (at its comma, if any), where its key
    /// starts and ends (objects), whether it is excluded, and where its pointers start in
    /// `active`.
    item: usize,
    key: usize,
    key_end: usize,
    simple_key: bool,
    key_prefix: u64,
    excluded: bool,
    item_active: usize,
}

impl Canon<'_, '_> {
    /// Iterative: one loop over values with an explicit stack, so nesting depth is bounded
    /// by the body alone.
    pub(super) fn run(&mut self) -> Option<()> {
        // The pointers that lead into the next value (for the top value: all of them).
        let mut next_active = (0, self.active.len());
        'value: loop {
            self.ws();
            match *self.s.get(self.i)? {
                open @ (b'{' | b'[') => {
                    let object = open == b'{';
                    self.stack.push(Frame {
                        object,
                        start: self.pos(),
                        depth: self.stack.len(),
                        active: next_active.0,
                        active_end: next_active.1,
                        members: self.members.len(),
                        written: 0,
                        seen: 0,
                        item: 0,
                        key: 0,
                        key_end: 0,
                        simple_key: true,
                        key_prefix: 0,
                        excluded: false,
                        item_active: 0,
                    });
                    self.emit(self.i, self.i + 1);
                    self.i += 1;
                    self.ws();
                    let close = if object { b'}' } else { b']' };
                    if self.s.get(self.i) == Some(&close) {
                        self.emit(self.i, self.i + 1);
                        self.i += 1;
                        self.stack.pop();
                    } else {
                        next_active = self.item(None)?;
                        continue 'value;
                    }
                }
                b'"' => self.string()?,
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                b'-' | b'0'..=b'9' => self.number()?,
                _ => return None,
            }
            // A value is complete: finish the item it was in, closing frames as they end.
            loop {
                let Some(f) = self.stack.last_mut() else {
                    break 'value;
                };
                f.seen += 1;
                let end = self.out.len() + self.pending.1 - self.pending.0;
                if f.excluded {
                    let item = f.item;
                    self.flush();
                    self.out.truncate(item);
                } else {
                    f.written += 1;
                    if f.object {
                        self.members.push(Member {
                            key: f.key,
                            colon: f.key_end,
                            end,
                            simple: f.simple_key,
                            prefix: f.key_prefix,
                        });
                    }
                }
                let f = self.stack.last()?;
                self.active.truncate(f.item_active);
                let object = f.object;
                self.ws();
                match self.s.get(self.i) {
                    Some(b',') => {
                        let comma = self.i;
                        self.i += 1;
                        self.ws();
                        next_active = self.item(Some(comma))?;
                        continue 'value;
                    }
                    Some(b'}') if object => {
                        self.i += 1;
                        self.close_object()?;
                    }
                    Some(b']') if !object => {
                        self.emit(self.i, self.i + 1);
                        self.i += 1;
                        self.stack.pop();
                    }
                    _ => return None,
                }
            }
        }
        self.ws();
        self.flush();
        (self.i == self.s.len()).then_some(())
    }

    /// Starts the next item of the innermost frame: its comma and, in an object, its key and
    /// colon. Returns the range in `active` of the pointers that lead into its value.
    fn item(&mut self, comma: Option<usize>) -> Option<(usize, usize)> {
        let n = self.stack.len() - 1;
        let f = &self.stack[n];
        let (object, depth, seen, written) = (f.object, f.depth, f.seen, f.written);
        let (active, active_end) = (f.active, f.active_end);
        let item = self.pos();
        if written > 0 {
            match comma {
                Some(c) => self.emit(c, c + 1),
                None => self.out().push(b','),
            }
        }
        let key = self.pos();
        let (mut key_end, mut simple_key, mut key_prefix) = (key, true, 0);
        if object {
            if self.s.get(self.i) != Some(&b'"') {
                return None;
            }
            let start = self.i;
            let end = plain_end::<true>(self.s, start + 1);
            let content = if self.s.get(end) == Some(&b'"') {
                // No escapes: the key is its input bytes.
                self.emit(start, end + 1);
                self.i = end + 1;
                key_end = self.pos();
                let content = &self.s[start + 1..end];
                simple_key = content.iter().all(|&b| b < 0xF0);
                content
            } else {
                self.string()?;
                key_end = self.pos();
                if key < self.out.len() {
                    self.flush(); // partly written out already
                }
                let content = self.view(key + 1, key_end - 1);
                simple_key = is_simple(content);
                content
            };
            key_prefix = self::key_prefix(content);
            if self.s.get(self.i) != Some(&b':') {
                self.ws();
                if self.s.get(self.i) != Some(&b':') {
                    return None;
                }
            }
            self.emit(self.i, self.i + 1);
            self.i += 1;
        }
        let item_active = self.active.len();
        let mut excluded = false;
        for j in active..active_end {
            let p = self.active[j];
            let pointer = &self.pointers[p];
            let hit = if object {
                pointer.keys.get(depth).map(Vec::as_slice) == Some(self.view(key + 1, key_end - 1))
            } else {
                pointer.indices.get(depth).copied().flatten() == Some(seen)
            };
            if hit {
                if pointer.keys.len() == depth + 1 {
                    excluded = true;
                } else {
                    self.active.push(p);
                }
            }
        }
        let f = &mut self.stack[n];
        f.item = item;
        f.key = key;
        f.key_end = key_end;
        f.simple_key = simple_key;
        f.key_prefix = key_prefix;
        f.excluded = excluded;
        f.item_active = item_active;
        Some((item_active, self.active.len()))
    }

    /// At the end of an object: sorts its members (RFC 8785 3.2.3: by UTF-16 code units),
    /// refuses duplicate keys, and writes them back in order if they were not.
    fn close_object(&mut self) -> Option<()> {
        let f = self.stack.pop()?;
        self.close_members(f.start, f.members, self.stack.is_empty())
    }

    fn literal(&mut self, lit: &'static [u8]) -> Option<()> {
        if !self.s[self.i..].starts_with(lit) {
            return None;
        }
        self.emit(self.i, self.i + lit.len());
        self.i += lit.len();
        Some(())
    }
}
