//! The record format: one Redis string per record, a fixed header then the answer.
//!
//! | bytes | holds |
//! |---|---|
//! | 0 | format: `2`, or `3` for a record counted against a scope's quota |
//! | 1 | state: `p` in progress, `r` in progress with a recovery point, `c` completed |
//! | 2..34 | fingerprint, 32 raw bytes |
//! | 34..50 | nonce of the current claim, 16 raw bytes (a released takeover's: its released token's, see `release.lua`) |
//! | 50..66 | generation, 16 decimal digits |
//! | 66..82 | lease deadline: `k` then 15 digits, the ms between the lease's end and the key's expiry; or (written by earlier versions, and where 15 digits do not hold it) 16 digits, ms since the Unix epoch by Redis `TIME` |
//! | 82..146 | format `3` only: the scope id, 64 lowercase hex digits |
//! | rest | once completed: the answer, [`Completion::encode`] bytes; in state `r`: the recovery point, [`RecoveryPoint::encode`] bytes |
//!
//! Fixed offsets let the scripts read and rewrite fields with `GETRANGE` and `SETRANGE`,
//! never touching the answer; the nonce and generation sit side by side (bytes 34..66), so a
//! token is one comparison. Digits rather than binary keep the fields readable in
//! `redis-cli` and exact in Lua's doubles.
//!
//! # The lease, relative to the key's expiry
//!
//! A claim sets the key's expiry to `keep = max(ttl, lease)` from Redis's now, so its lease
//! ends `keep - lease` before the key expires. The record stores that gap (`k` + 15 digits),
//! not a deadline by some clock, and the lease left is `PTTL(key) - gap`, both by Redis's
//! clock. That lets a claim be one plain `SET … NX PX keep GET` written by the client (it
//! knows `keep - lease`, never Redis's time), and a reader needs only `PTTL`. Whatever moves
//! the expiry or the lease's end of a record in progress (a takeover, a renewal, a release)
//! rewrites the gap in the same script; saving a recovery point keeps both. 15 digits hold 31,000 years; a longer gap is written as a deadline.
//!
//! Earlier versions of this crate read the field as 16 digits: they fail closed on `k`
//! (their claim script errors, their reads say [`Corrupt`](crate::store::StoreErrorKind::Corrupt)),
//! never taking over a live lease. Completed records read the same in both.

use bytes::Bytes;
use redis::Value;

use super::error::corrupt;
use crate::store::record::{Completion, Fingerprint, Record, RecordState, Token};
use crate::store::RecoveryPoint;
use crate::store::StoreError;

/// Format byte of a record outside any quota.
pub(super) const PLAIN: u8 = b'2';
/// Format byte of a record counted against its scope's quota.
pub(super) const SCOPED: u8 = b'3';
/// Header length of a [`PLAIN`] record.
pub(super) const HEADER: usize = 82;
/// Header length of a [`SCOPED`] record.
pub(super) const SCOPED_HEADER: usize = HEADER + 64;
/// The largest lease gap the `k` field holds (15 digits, about 31,700 years).
///
/// The arithmetic, all in ms by Redis's clock: a claim at `t` sets the key to expire at
/// `t + keep` (`keep = max(ttl, lease)`, `PX keep`) and its lease to end at `t + lease`, so
/// the gap is `keep - lease`, known before the claim is sent. At any later `now`,
/// `PTTL = t + keep - now`, so the lease left is `PTTL - gap = t + lease - now`. A script
/// that moves the expiry to `E` (a renewal, a takeover) or the lease's end to `L` (those,
/// and a takeover's release: `L = now`) writes `E - L`. Both PTTL and the gap are under
/// 2^53, exact in Lua's doubles. A gap past this (a TTL of more than 31,700 years, which
/// `millis` allows, up to 2^50 ms) is written as a 16-digit deadline.
pub(super) const MAX_GAP_MS: u64 = 999_999_999_999_999;

/// The lease field of a record whose lease ends `gap_ms` before its key expires; `None`
/// past [`MAX_GAP_MS`].
pub(super) fn lease_gap(gap_ms: u64) -> Option<[u8; 16]> {
    if gap_ms > MAX_GAP_MS {
        return None;
    }
    let mut field = *b"k000000000000000";
    padded_decimal(&mut field[1..], gap_ms).then_some(field)
}

/// Writes `n` into `field` in decimal, zero-padded to its width; `false` if it has more
/// digits than that. By hand: `format!` cost about a thousand instructions and an allocation
/// for each token a complete, renewal or release sends.
fn padded_decimal(field: &mut [u8], mut n: u64) -> bool {
    for b in field.iter_mut().rev() {
        *b = b'0' + (n % 10) as u8;
        n /= 10;
    }
    n == 0
}

/// Redis's clock as a reader saw it, for the lease left: `TIME` (for a deadline field) and
/// the key's `PTTL` (for a gap). A part not read is `None`.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Clock {
    pub(super) now_ms: Option<u64>,
    pub(super) pttl_ms: Option<u64>,
}

impl Clock {
    /// `PTTL`'s reply: negative (no key, no expiry) is unknown.
    pub(super) fn pttl(v: &Value) -> Option<u64> {
        match v {
            Value::Int(n) => u64::try_from(*n).ok(),
            _ => None,
        }
    }
}

/// The lease left by `field` (bytes 66..82) and `clock`; `Ok(None)` when the clock lacks
/// the part this field needs.
fn lease_left(field: &[u8], clock: Clock) -> Result<Option<u64>, StoreError> {
    if let Some(gap) = field.strip_prefix(b"k") {
        let gap = digits(gap).ok_or_else(|| corrupt("lease gap is not digits"))?;
        return Ok(clock.pttl_ms.map(|t| t.saturating_sub(gap)));
    }
    let deadline = digits(field).ok_or_else(|| corrupt("lease deadline is not digits"))?;
    Ok(clock.now_ms.map(|now| deadline.saturating_sub(now)))
}

/// The first 66 bytes of a new record (format, state, fingerprint, nonce, generation 1); the
/// lease field follows (see [`lease_gap`]).
pub(super) fn new_record(format: u8, fingerprint: &Fingerprint, nonce: &[u8; 16]) -> Vec<u8> {
    // Room for the lease field the caller appends.
    let mut v = Vec::with_capacity(HEADER);
    v.push(format);
    v.push(b'p');
    v.extend_from_slice(fingerprint.as_bytes());
    v.extend_from_slice(nonce);
    v.extend_from_slice(b"0000000000000001");
    v
}

/// A token as the record holds it: nonce then generation (bytes 34..66). `None` for a
/// generation no record can hold (more than 16 digits): such a token is fenced everywhere.
pub(super) fn token_bytes(token: &Token) -> Option<[u8; 32]> {
    let mut v = [0; 32];
    v[..16].copy_from_slice(token.nonce());
    padded_decimal(&mut v[16..], token.generation()).then_some(v)
}

/// A record as read, with the nonce it holds.
#[derive(Debug)]
pub(super) struct Found {
    pub(super) record: Record,
    pub(super) nonce: [u8; 16],
    /// `false` for a record in progress whose lease the reader's clock could not tell (its
    /// `lease_remaining` is then zero, and means nothing).
    pub(super) lease_known: bool,
}

impl Found {
    /// Held by `token`: the generation matches and the nonce is `token`'s.
    pub(super) fn held_by(&self, token: &Token) -> bool {
        self.nonce == *token.nonce() && self.record.generation == token.generation()
    }

    /// Kept after `token` released it (a takeover's release): it holds `token`'s released
    /// token.
    pub(super) fn released_by(&self, token: &Token) -> bool {
        !self.completed() && self.held_by(&token.released())
    }

    pub(super) fn completed(&self) -> bool {
        matches!(self.record.state, RecordState::Completed(_))
    }
}

/// A decimal of ASCII digits only (no sign, not empty), `None` past `u64`. By hand: through
/// `str::parse` it cost some 480 instructions per record read (UTF-8 check, sign handling).
fn digits(b: &[u8]) -> Option<u64> {
    if b.is_empty() {
        return None;
    }
    b.iter().try_fold(0u64, |n, &d| {
        let d = d.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(d))
    })
}

/// Decodes a stored record; `clock` turns its lease field into the lease left.
pub(super) fn decode(value: Bytes, clock: Clock) -> Result<Found, StoreError> {
    let header = match value.first() {
        Some(&PLAIN) => HEADER,
        Some(&SCOPED) => SCOPED_HEADER,
        _ => return Err(corrupt("unknown record format")),
    };
    if value.len() < header {
        return Err(corrupt("record shorter than its header"));
    }
    let fingerprint: [u8; 32] = value[2..34].try_into().expect("32 bytes");
    let generation = digits(&value[50..66]).ok_or_else(|| corrupt("generation is not digits"))?;
    let nonce: [u8; 16] = value[34..50].try_into().expect("16 bytes");
    let mut point = None;
    let mut lease_known = true;
    let mut in_progress = || {
        let left = lease_left(&value[66..82], clock)?;
        lease_known = left.is_some();
        Ok::<_, StoreError>(RecordState::InProgress {
            lease_remaining: std::time::Duration::from_millis(left.unwrap_or(0)),
        })
    };
    let state = match value[1] {
        b'p' if value.len() == header => in_progress()?,
        b'r' => {
            let state = in_progress()?;
            point =
                Some(RecoveryPoint::decode(value.slice(header..)).map_err(|e| {
                    StoreError::with_source(crate::store::StoreErrorKind::Corrupt, e)
                })?);
            state
        }
        b'c' => {
            let completion = Completion::decode(value.slice(header..))
                .map_err(|e| StoreError::with_source(crate::store::StoreErrorKind::Corrupt, e))?;
            RecordState::Completed(completion)
        }
        _ => return Err(corrupt("unknown record state")),
    };
    let mut record = Record::new(Fingerprint::from_bytes(fingerprint), generation, state)
        .with_holder(Token::from_parts(generation, nonce))
        .with_recovery_point(point);
    // A completed record lives as long as its key: the `PTTL` read beside it, when it was.
    if let (RecordState::Completed(_), Some(left)) = (&record.state, clock.pttl_ms) {
        record = record.with_expires_in(std::time::Duration::from_millis(left));
    }
    Ok(Found {
        record,
        nonce,
        lease_known,
    })
}

/// Bytes of a `GET` reply: `None` for no key.
pub(super) fn value_bytes(v: Value) -> Result<Option<Bytes>, StoreError> {
    match v {
        Value::Nil => Ok(None),
        Value::BulkString(b) => Ok(Some(Bytes::from(b))),
        _ => Err(corrupt("record is not a string")),
    }
}

/// Milliseconds since the Unix epoch from a `TIME` reply.
pub(super) fn time_ms(v: &Value) -> Result<u64, StoreError> {
    let part = |v: &Value| match v {
        Value::BulkString(b) => digits(b),
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    match v {
        Value::Array(items) if items.len() == 2 => {
            let secs = part(&items[0]).ok_or_else(|| corrupt("TIME seconds"))?;
            let micros = part(&items[1]).ok_or_else(|| corrupt("TIME microseconds"))?;
            Ok(secs * 1000 + micros / 1000)
        }
        _ => Err(corrupt("TIME reply")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;
    use std::time::Duration;

    fn at(now_ms: u64) -> Clock {
        Clock {
            now_ms: Some(now_ms),
            pttl_ms: None,
        }
    }

    fn in_progress(deadline: u64) -> Vec<u8> {
        let mut v = new_record(PLAIN, &Fingerprint::from_bytes([7; 32]), &[9; 16]);
        v.extend_from_slice(format!("{deadline:016}").as_bytes());
        v
    }

    #[test]
    fn digits_reads_what_str_parse_reads_and_refuses_the_rest() {
        for s in [
            "0",
            "0000000000000001",
            "9999999999999999",
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999",
            "",
            "+1",
            "-1",
            " 1",
            "1 ",
            "12a4",
            "1/",
            "1:",
            "\u{0660}",
        ] {
            let expected = match s.bytes().all(|b| b.is_ascii_digit()) {
                true => s.parse::<u64>().ok(),
                false => None,
            };
            assert_eq!(digits(s.as_bytes()), expected, "{s:?}");
        }
        assert_eq!(digits(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(digits(b"18446744073709551616"), None);
        assert_eq!(digits(&[0x80, b'1']), None);
    }

    #[test]
    fn records_decode_with_their_lease_and_owner() {
        let v = in_progress(10_500);
        assert_eq!(v.len(), HEADER);
        let found = decode(Bytes::from(v), at(9_000)).unwrap();
        assert_eq!(found.nonce, [9; 16]);
        assert_eq!(found.record.generation, 1);
        assert_eq!(found.record.fingerprint, Fingerprint::from_bytes([7; 32]));
        assert_eq!(
            found.record.state,
            RecordState::InProgress {
                lease_remaining: Duration::from_millis(1500)
            }
        );
        let token = Token::from_parts(1, [9; 16]);
        assert!(found.held_by(&token));
        assert!(!found.released_by(&token));
        assert_eq!(token_bytes(&token).unwrap(), in_progress(0)[34..66]);
        // A lapsed lease is zero left, and another nonce is not the owner.
        let other = decode(Bytes::from(in_progress(1)), at(9_000)).unwrap();
        assert!(!other.held_by(&Token::from_parts(1, [1; 16])));
        assert_eq!(
            other.record.state,
            RecordState::InProgress {
                lease_remaining: Duration::ZERO
            }
        );
    }

    #[test]
    fn a_record_kept_by_a_release_is_recognised_by_the_token_that_released_it() {
        let token = Token::from_parts(1, [3; 16]);
        let released = token.released();
        let mut v = new_record(PLAIN, &Fingerprint::from_bytes([7; 32]), released.nonce());
        v.extend_from_slice(b"0000000000009000");
        let found = decode(Bytes::from(v), at(9_000)).unwrap();
        assert!(found.released_by(&token));
        assert!(!found.held_by(&token), "its token is fenced");
        assert!(!found.released_by(&Token::from_parts(1, [4; 16])));
    }

    #[test]
    fn completed_records_decode_and_bad_bytes_are_corrupt() {
        let done = Completion::Tombstone {
            status: StatusCode::CREATED,
        };
        let mut v = in_progress(0);
        v[1] = b'c';
        v.extend_from_slice(&done.encode());
        let found = decode(Bytes::from(v.clone()), at(0)).unwrap();
        assert_eq!(found.record.state, RecordState::Completed(done));

        let kind = |v: Vec<u8>| decode(Bytes::from(v), at(0)).unwrap_err().kind();
        let mut junk = v.clone();
        junk.truncate(HEADER);
        junk.extend_from_slice(b"\x09junk");
        assert_eq!(kind(junk), crate::store::StoreErrorKind::Corrupt);
        let mut format = v.clone();
        format[0] = b'1';
        assert_eq!(kind(format), crate::store::StoreErrorKind::Corrupt);
        assert_eq!(
            kind(v[..40].to_vec()),
            crate::store::StoreErrorKind::Corrupt
        );
        let mut gen = in_progress(0);
        gen[60] = b'x';
        assert_eq!(kind(gen), crate::store::StoreErrorKind::Corrupt);
        // An in-progress record is exactly its header.
        let mut long = in_progress(0);
        long.push(0);
        assert_eq!(kind(long), crate::store::StoreErrorKind::Corrupt);
        assert_eq!(
            value_bytes(Value::Int(3)).unwrap_err().kind(),
            crate::store::StoreErrorKind::Corrupt
        );
        assert!(value_bytes(Value::Nil).unwrap().is_none());
    }

    #[test]
    fn a_record_with_a_recovery_point_decodes_in_progress_with_it() {
        let point = RecoveryPoint::new(
            "charged",
            Bytes::from_static(b"pay_1"),
            crate::store::record::ScopeId::new(Some("shop")),
            1,
        )
        .unwrap();
        let mut v = in_progress(10_500);
        v[1] = b'r';
        v.extend_from_slice(&point.encode());
        let found = decode(Bytes::from(v.clone()), at(10_000)).unwrap();
        assert_eq!(found.record.recovery_point, Some(point));
        assert_eq!(
            found.record.state,
            RecordState::InProgress {
                lease_remaining: Duration::from_millis(500)
            }
        );
        // A truncated point is corrupt, not a record without one.
        v.pop();
        assert_eq!(
            decode(Bytes::from(v), at(0)).unwrap_err().kind(),
            crate::store::StoreErrorKind::Corrupt
        );
    }

    #[test]
    fn a_lease_gap_is_read_against_the_keys_ttl() {
        let mut v = new_record(PLAIN, &Fingerprint::from_bytes([7; 32]), &[9; 16]);
        v.extend_from_slice(&lease_gap(86_370_000).unwrap());
        assert_eq!(&v[66..], b"k000000086370000".as_slice());
        let ttl = |pttl_ms| Clock {
            now_ms: None,
            pttl_ms: Some(pttl_ms),
        };
        // Claimed with keep 86,400 s and lease 30 s: 1.5 s of lease left at 86,371.5 s.
        let found = decode(Bytes::from(v.clone()), ttl(86_371_500)).unwrap();
        assert!(found.lease_known);
        assert_eq!(
            found.record.state,
            RecordState::InProgress {
                lease_remaining: Duration::from_millis(1500)
            }
        );
        let lapsed = decode(Bytes::from(v.clone()), ttl(86_000_000)).unwrap();
        assert_eq!(
            lapsed.record.state,
            RecordState::InProgress {
                lease_remaining: Duration::ZERO
            }
        );
        // A gap needs the TTL, a deadline needs the time: without them the lease is unknown.
        assert!(!decode(Bytes::from(v.clone()), at(5)).unwrap().lease_known);
        assert!(
            !decode(Bytes::from(in_progress(9)), ttl(5))
                .unwrap()
                .lease_known
        );
        v[70] = b'x';
        assert_eq!(
            decode(Bytes::from(v), ttl(5)).unwrap_err().kind(),
            crate::store::StoreErrorKind::Corrupt
        );
        assert_eq!(lease_gap(0).unwrap(), *b"k000000000000000");
        assert_eq!(lease_gap(MAX_GAP_MS).unwrap(), *b"k999999999999999");
        assert!(lease_gap(MAX_GAP_MS + 1).is_none());
    }

    #[test]
    fn time_replies_are_milliseconds() {
        let t = Value::Array(vec![
            Value::BulkString(b"1700000000".to_vec()),
            Value::BulkString(b"123456".to_vec()),
        ]);
        assert_eq!(time_ms(&t).unwrap(), 1_700_000_000_123);
        assert!(time_ms(&Value::Nil).is_err());
    }

    #[test]
    fn generations_past_sixteen_digits_are_no_token() {
        assert!(token_bytes(&Token::from_parts(u64::MAX, [0; 16])).is_none());
    }
}
