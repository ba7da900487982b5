//! [`RecoveryPoint`]: what a handler saves after a step, and how stores keep it.

use std::fmt;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};

use crate::store::{DecodeError, ScopeId};
use crate::store::{StoreError, StoreErrorKind};

/// Where an attempt got to: a step name and a few bytes of its own (a payment id, say),
/// saved by [`IdempotencyContext::save_recovery_point`](crate::IdempotencyContext::save_recovery_point)
/// and handed to the attempt that takes over, or to the [recovery worker](crate::RecoveryWorker).
///
/// Small by design: a step name of at most [`MAX_STEP`](Self::MAX_STEP) bytes and data of at
/// most [`MAX_DATA`](Self::MAX_DATA) bytes. Put ids in it, not payloads: the rows the ids name
/// live in your own database.
///
/// One pointer wide: a record, a claim and a context carry an `Option<RecoveryPoint>` on
/// every request, and most never hold one.
#[derive(Clone, PartialEq, Eq)]
pub struct RecoveryPoint(Arc<Point>);

#[derive(PartialEq, Eq)]
struct Point {
    step: String,
    data: Bytes,
    /// The id (a hash) of the scope of the request that saved it, so the recovery worker
    /// counts its claim against that scope's quota. Never the scope itself: nothing a
    /// client sent is stored in the clear.
    scope: ScopeId,
    /// The generation of the claim that saved it.
    generation: u64,
}

/// Encoding version of a stored recovery point: 2 keeps the scope's id. Version 1 kept the
/// scope in the clear; such a point is still read (its scope hashed as it is read), and is
/// gone once its record completes, is released or expires.
const VERSION: u8 = 2;
const VERSION_1: u8 = 1;

/// The longest scope a version-1 point kept.
const MAX_SCOPE: usize = 1024;

impl RecoveryPoint {
    /// The longest step name, in bytes.
    pub const MAX_STEP: usize = 64;
    /// The most data a recovery point carries, in bytes.
    pub const MAX_DATA: usize = 4096;
    /// The most bytes a store keeps for one recovery point, in [`encode`](Self::encode)'s
    /// form (step, data, the scope's id and framing together).
    pub const MAX_ENCODED: usize = 1 + 8 + 32 + 1 + Self::MAX_STEP + 2 + Self::MAX_DATA;

    /// A point at `step` with `data`, checked against the caps. `scope` (its id) and
    /// `generation` are the saving claim's.
    pub(crate) fn new(
        step: &str,
        data: Bytes,
        scope: ScopeId,
        generation: u64,
    ) -> Result<Self, StoreError> {
        let over = |what: &str, len: usize, cap: usize| {
            StoreError::with_source(
                StoreErrorKind::TooLarge,
                format!("the recovery point's {what} is {len} bytes, over the cap of {cap} bytes; nothing was saved"),
            )
        };
        if step.is_empty() {
            return Err(StoreError::with_source(
                StoreErrorKind::TooLarge,
                "a recovery point needs a step name of 1 to 64 bytes; nothing was saved",
            ));
        }
        if step.len() > Self::MAX_STEP {
            return Err(over("step name", step.len(), Self::MAX_STEP));
        }
        if data.len() > Self::MAX_DATA {
            return Err(over("data", data.len(), Self::MAX_DATA));
        }
        Ok(Self(Arc::new(Point {
            step: step.to_owned(),
            data,
            scope,
            generation,
        })))
    }

    /// The step the attempt finished last, as it named it.
    pub fn step(&self) -> &str {
        &self.0.step
    }

    /// The data it saved with the step.
    pub fn data(&self) -> &Bytes {
        &self.0.data
    }

    /// The id of the request's scope (a hash: the scope itself is never stored).
    pub fn scope_id(&self) -> ScopeId {
        self.0.scope
    }

    /// The generation of the claim that saved it.
    pub fn generation(&self) -> u64 {
        self.0.generation
    }

    /// The stored form: what a store keeps, at most [`MAX_ENCODED`](Self::MAX_ENCODED) bytes.
    pub fn encode(&self) -> Vec<u8> {
        let p = &*self.0;
        let mut out = Vec::with_capacity(44 + p.step.len() + p.data.len());
        out.put_u8(VERSION);
        out.put_u64(p.generation);
        out.put_slice(p.scope.as_bytes());
        out.put_u8(p.step.len() as u8);
        out.put_slice(p.step.as_bytes());
        out.put_u16(p.data.len() as u16);
        out.put_slice(&p.data);
        out
    }

    /// Reads back what [`encode`](Self::encode) wrote. The data shares `bytes`.
    pub fn decode(bytes: Bytes) -> Result<Self, DecodeError> {
        let mut b = bytes;
        let short = DecodeError::new("recovery point is truncated");
        if b.remaining() < 9 {
            return Err(short);
        }
        let version = b.get_u8();
        let generation = b.get_u64();
        let scope = match version {
            VERSION if b.remaining() >= 32 => {
                let mut id = [0u8; 32];
                b.copy_to_slice(&mut id);
                ScopeId::from_bytes(id)
            }
            VERSION_1 if b.remaining() >= 2 => match b.get_u16() {
                u16::MAX => ScopeId::new(None),
                n if (n as usize) <= MAX_SCOPE && b.remaining() >= n as usize => {
                    ScopeId::new(Some(&utf8(&b.split_to(n as usize))?))
                }
                _ => return Err(short),
            },
            VERSION | VERSION_1 => return Err(short),
            _ => return Err(DecodeError::new("recovery point has an unknown version")),
        };
        if b.remaining() < 1 {
            return Err(short);
        }
        let step_len = b.get_u8() as usize;
        if step_len == 0 || step_len > Self::MAX_STEP || b.remaining() < step_len + 2 {
            return Err(short);
        }
        let step = utf8(&b.split_to(step_len))?;
        let data_len = b.get_u16() as usize;
        if data_len > Self::MAX_DATA || b.remaining() != data_len {
            return Err(DecodeError::new("recovery point has a bad data length"));
        }
        Ok(Self(Arc::new(Point {
            step,
            data: b,
            scope,
            generation,
        })))
    }
}

fn utf8(b: &[u8]) -> Result<String, DecodeError> {
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| DecodeError::new("recovery point holds text that is not UTF-8"))
}

impl fmt::Debug for RecoveryPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The data may name customers' objects: its size only.
        f.debug_struct("RecoveryPoint")
            .field("step", &self.step())
            .field("data_len", &self.data().len())
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_round_trip_and_the_caps_are_named() {
        for scope in [None, Some("tenant-1"), Some("")] {
            let id = ScopeId::new(scope);
            let p = RecoveryPoint::new("charged", Bytes::from_static(b"pay_1"), id, 3).unwrap();
            let back = RecoveryPoint::decode(Bytes::from(p.encode())).unwrap();
            assert_eq!(back, p);
            assert_eq!(
                (back.step(), back.scope_id(), back.generation()),
                ("charged", id, 3)
            );
        }
        let max = RecoveryPoint::new(
            &"s".repeat(64),
            Bytes::from(vec![7; 4096]),
            ScopeId::new(Some(&"t".repeat(4096))),
            u64::MAX,
        )
        .unwrap();
        assert_eq!(max.encode().len(), RecoveryPoint::MAX_ENCODED);
        let any = ScopeId::new(None);
        let e = RecoveryPoint::new("s", Bytes::from(vec![0; 4097]), any, 1).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::TooLarge);
        assert!(
            std::error::Error::source(&e)
                .unwrap()
                .to_string()
                .contains("4096"),
            "{e:?}"
        );
        let e = RecoveryPoint::new(&"s".repeat(65), Bytes::new(), any, 1).unwrap_err();
        assert!(std::error::Error::source(&e)
            .unwrap()
            .to_string()
            .contains("64"));
        assert!(RecoveryPoint::new("", Bytes::new(), any, 1).is_err());
    }

    #[test]
    fn a_point_keeps_no_scope_in_the_clear() {
        let scope = "alice@example.com";
        let p = RecoveryPoint::new(
            "reserved",
            Bytes::from_static(b"pay_1"),
            ScopeId::new(Some(scope)),
            2,
        );
        let bytes = p.unwrap().encode();
        assert!(!bytes.windows(scope.len()).any(|w| w == scope.as_bytes()));
    }

    /// A point saved before version 2 kept its scope in the clear: it is still read, as the
    /// scope's id.
    #[test]
    fn a_version_1_point_is_read_with_its_scope_hashed() {
        let mut v1 = vec![1u8];
        v1.extend_from_slice(&5u64.to_be_bytes());
        v1.extend_from_slice(&4u16.to_be_bytes());
        v1.extend_from_slice(b"acme");
        v1.push(7);
        v1.extend_from_slice(b"charged");
        v1.extend_from_slice(&5u16.to_be_bytes());
        v1.extend_from_slice(b"pay_1");
        let p = RecoveryPoint::decode(Bytes::from(v1)).unwrap();
        assert_eq!(
            (p.step(), &p.data()[..], p.generation(), p.scope_id()),
            ("charged", &b"pay_1"[..], 5, ScopeId::new(Some("acme")))
        );
        let mut unscoped = vec![1u8];
        unscoped.extend_from_slice(&1u64.to_be_bytes());
        unscoped.extend_from_slice(&u16::MAX.to_be_bytes());
        unscoped.extend_from_slice(&[1, b's', 0, 0]);
        let p = RecoveryPoint::decode(Bytes::from(unscoped)).unwrap();
        assert_eq!(p.scope_id(), ScopeId::new(None));
    }

    #[test]
    fn damaged_points_are_errors_not_panics() {
        let id = ScopeId::new(Some("t"));
        let p = RecoveryPoint::new("step", Bytes::from_static(b"data"), id, 2).unwrap();
        let bytes = p.encode();
        for cut in 0..bytes.len() {
            assert!(RecoveryPoint::decode(Bytes::copy_from_slice(&bytes[..cut])).is_err());
        }
        let mut bad = bytes.clone();
        bad[0] = 9;
        assert!(RecoveryPoint::decode(Bytes::from(bad)).is_err());
        let mut long = bytes;
        long.push(0);
        assert!(RecoveryPoint::decode(Bytes::from(long)).is_err());
    }
}
