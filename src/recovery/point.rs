//! [`RecoveryPoint`]: what a handler saves after a step, and how stores keep it.

use std::fmt;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};

use crate::record::DecodeError;
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
    /// The scope of the request that saved it, so the recovery worker can name it: stores
    /// only know scopes by their hash.
    scope: Option<String>,
    /// The generation of the claim that saved it.
    generation: u64,
}

/// Encoding version of a stored recovery point.
const VERSION: u8 = 1;

/// The longest scope kept with a point: a scope longer than this is refused at save.
const MAX_SCOPE: usize = 1024;

impl RecoveryPoint {
    /// The longest step name, in bytes.
    pub const MAX_STEP: usize = 64;
    /// The most data a recovery point carries, in bytes.
    pub const MAX_DATA: usize = 4096;
    /// The most bytes a store keeps for one recovery point, in [`encode`](Self::encode)'s
    /// form (step, data, scope and framing together).
    pub const MAX_ENCODED: usize = 1 + 8 + 2 + MAX_SCOPE + 1 + Self::MAX_STEP + 2 + Self::MAX_DATA;

    /// A point at `step` with `data`, checked against the caps. `scope` and `generation` are
    /// the saving claim's.
    pub(crate) fn new(
        step: &str,
        data: Bytes,
        scope: Option<&str>,
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
        if let Some(s) = scope.filter(|s| s.len() > MAX_SCOPE) {
            return Err(over("scope", s.len(), MAX_SCOPE));
        }
        Ok(Self(Arc::new(Point {
            step: step.to_owned(),
            data,
            scope: scope.map(str::to_owned),
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

    /// The scope of the request (`None`: unscoped).
    pub fn scope(&self) -> Option<&str> {
        self.0.scope.as_deref()
    }

    /// The generation of the claim that saved it.
    pub fn generation(&self) -> u64 {
        self.0.generation
    }

    /// The stored form: what a store keeps, at most [`MAX_ENCODED`](Self::MAX_ENCODED) bytes.
    pub fn encode(&self) -> Vec<u8> {
        let p = &*self.0;
        let scope = p.scope.as_deref().map(str::as_bytes);
        let mut out =
            Vec::with_capacity(14 + scope.map_or(0, <[u8]>::len) + p.step.len() + p.data.len());
        out.put_u8(VERSION);
        out.put_u64(p.generation);
        // 0xFFFF: unscoped (a scope is at most MAX_SCOPE bytes).
        match scope {
            None => out.put_u16(u16::MAX),
            Some(s) => {
                out.put_u16(s.len() as u16);
                out.put_slice(s);
            }
        }
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
        if b.remaining() < 11 {
            return Err(short);
        }
        if b.get_u8() != VERSION {
            return Err(DecodeError::new("recovery point has an unknown version"));
        }
        let generation = b.get_u64();
        let scope = match b.get_u16() {
            u16::MAX => None,
            n if (n as usize) <= MAX_SCOPE && b.remaining() >= n as usize => {
                let s = b.split_to(n as usize);
                Some(utf8(&s)?)
            }
            _ => return Err(short),
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
            let p = RecoveryPoint::new("charged", Bytes::from_static(b"pay_1"), scope, 3).unwrap();
            let back = RecoveryPoint::decode(Bytes::from(p.encode())).unwrap();
            assert_eq!(back, p);
            assert_eq!(
                (back.step(), back.scope(), back.generation()),
                ("charged", scope, 3)
            );
        }
        let max = RecoveryPoint::new(
            &"s".repeat(64),
            Bytes::from(vec![7; 4096]),
            Some(&"t".repeat(1024)),
            u64::MAX,
        )
        .unwrap();
        assert_eq!(max.encode().len(), RecoveryPoint::MAX_ENCODED);
        let e = RecoveryPoint::new("s", Bytes::from(vec![0; 4097]), None, 1).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::TooLarge);
        assert!(
            std::error::Error::source(&e)
                .unwrap()
                .to_string()
                .contains("4096"),
            "{e:?}"
        );
        let e = RecoveryPoint::new(&"s".repeat(65), Bytes::new(), None, 1).unwrap_err();
        assert!(std::error::Error::source(&e)
            .unwrap()
            .to_string()
            .contains("64"));
        assert!(RecoveryPoint::new("", Bytes::new(), None, 1).is_err());
    }

    #[test]
    fn damaged_points_are_errors_not_panics() {
        let p = RecoveryPoint::new("step", Bytes::from_static(b"data"), Some("t"), 2).unwrap();
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
