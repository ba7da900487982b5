//! Rows to records and back: the columns the statements read and write, and how stored bytes
//! are checked.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{HeaderMap, StatusCode};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::record::{
    get_headers, get_vary, put_headers, put_vary, Completion, Fingerprint, Record, RecordId,
    RecordState, StoredResponse, Token, VaryGuard,
};
use crate::recovery::RecoveryPoint;
use crate::store::{Claim, ClaimOutcome, StoreError, StoreErrorKind};

/// Leases and TTLs reach SQL as whole microseconds, capped at 100 years (3.2e15 µs):
/// `now() + u64::MAX µs` would overflow `timestamptz` (it ends in 294276 AD) and fail, and
/// SQL multiplies `bigint × interval` through `float8`, exact only below 2^53 µs (285 years).
const MAX_MICROS: i64 = 100 * 365 * 24 * 3600 * 1_000_000;

// Values of the `state` column. The SQL writes `0` for `IN_PROGRESS` literally.
pub(super) const IN_PROGRESS: i16 = 0;
const RESPONSE: i16 = 1;
const TOMBSTONE: i16 = 2;

/// Version byte in front of the `headers` and `trailers` columns.
const HEADERS_FORMAT: u8 = 1;
/// The `headers` column with the record's Vary guard after the headers. Version 1 kept the
/// guard as a header; it is still read.
const HEADERS_WITH_GUARD_FORMAT: u8 = 2;

// Outcomes of the claim statement (claim.sql, claim_function.sql), in order of precedence.
const INSERTED: i16 = 0;
const UPDATED: i16 = 1;
const EXISTING: i16 = 2;
const OVER_QUOTA: i16 = 3;

/// Why stored columns could not be read back.
#[derive(Debug)]
pub(super) struct CorruptRow(pub(super) &'static str);

impl fmt::Display for CorruptRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "corrupt idempotency row: {}", self.0)
    }
}

impl StdError for CorruptRow {}

pub(super) fn corrupt(e: impl Into<Box<dyn StdError + Send + Sync>>) -> StoreError {
    StoreError::with_source(StoreErrorKind::Corrupt, e)
}

pub(super) fn encode_headers(h: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 4 + 48 * h.len());
    out.push(HEADERS_FORMAT);
    put_headers(&mut out, h);
    out
}

/// The `headers` column of a response: its headers, then its Vary guard.
fn encode_response_headers(h: &HeaderMap, vary: Option<&VaryGuard>) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 4 + 48 * h.len() + 1);
    out.push(HEADERS_WITH_GUARD_FORMAT);
    put_headers(&mut out, h);
    put_vary(&mut out, vary);
    out
}

fn decode_headers(bytes: Vec<u8>) -> Result<HeaderMap, StoreError> {
    let mut buf = Bytes::from(bytes);
    if buf.is_empty() || buf.get_u8() != HEADERS_FORMAT {
        return Err(corrupt(CorruptRow("unknown headers format")));
    }
    let headers = get_headers(&mut buf).map_err(corrupt)?;
    if buf.has_remaining() {
        return Err(corrupt(CorruptRow("trailing bytes after headers")));
    }
    Ok(headers)
}

fn decode_response_headers(bytes: Vec<u8>) -> Result<(HeaderMap, Option<VaryGuard>), StoreError> {
    let mut buf = Bytes::from(bytes);
    match buf.first() {
        Some(&HEADERS_FORMAT) => {
            let mut headers = decode_headers(buf.to_vec())?;
            let vary = crate::recording::legacy_vary_guard(&mut headers);
            Ok((headers, vary))
        }
        Some(&HEADERS_WITH_GUARD_FORMAT) => {
            buf.advance(1);
            let headers = get_headers(&mut buf).map_err(corrupt)?;
            let vary = get_vary(&mut buf).map_err(corrupt)?;
            if buf.has_remaining() {
                return Err(corrupt(CorruptRow("trailing bytes after headers")));
            }
            Ok((headers, vary))
        }
        _ => Err(corrupt(CorruptRow("unknown headers format"))),
    }
}

pub(super) fn column<'r, T: tokio_postgres::types::FromSql<'r>>(
    row: &'r Row,
    name: &str,
) -> Result<T, StoreError> {
    row.try_get(name).map_err(corrupt)
}

fn generation(row: &Row) -> Result<u64, StoreError> {
    let g: i64 = column(row, "generation")?;
    u64::try_from(g).map_err(|_| corrupt(CorruptRow("negative generation")))
}

/// The `recovery_point` column of a record in progress. A completed record has none, whatever
/// the column holds (a replica of an earlier version completes without clearing it).
fn recovery_point(row: &Row, state: i16) -> Result<Option<RecoveryPoint>, StoreError> {
    if state != IN_PROGRESS {
        return Ok(None);
    }
    let bytes: Option<Vec<u8>> = column(row, "recovery_point")?;
    bytes
        .map(|b| RecoveryPoint::decode(Bytes::from(b)).map_err(corrupt))
        .transpose()
}

/// Reads the record columns: generation, fingerprint, state, lease_us, status, headers,
/// body, trailers, recovery_point.
pub(super) fn decode_record(row: &Row) -> Result<Record, StoreError> {
    let fp: Vec<u8> = column(row, "fingerprint")?;
    let fingerprint = Fingerprint::from_bytes(
        fp.try_into()
            .map_err(|_| corrupt(CorruptRow("fingerprint is not 32 bytes")))?,
    );
    let state: i16 = column(row, "state")?;
    let point = recovery_point(row, state)?;
    let status = || -> Result<StatusCode, StoreError> {
        let s: i16 = column(row, "status")?;
        u16::try_from(s)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| corrupt(CorruptRow("invalid status")))
    };
    let state = match state {
        IN_PROGRESS => {
            let us: i64 = column(row, "lease_us")?;
            RecordState::InProgress {
                lease_remaining: Duration::from_micros(u64::try_from(us).unwrap_or(0)),
            }
        }
        RESPONSE => {
            let headers: Vec<u8> = column(row, "headers")?;
            let body: Vec<u8> = column(row, "body")?;
            let trailers: Option<Vec<u8>> = column(row, "trailers")?;
            let (headers, vary) = decode_response_headers(headers)?;
            RecordState::Completed(Completion::Response(StoredResponse {
                status: status()?,
                headers,
                body: Bytes::from(body),
                trailers: trailers.map(decode_headers).transpose()?,
                vary,
            }))
        }
        TOMBSTONE => RecordState::Completed(Completion::Tombstone { status: status()? }),
        _ => return Err(corrupt(CorruptRow("unknown state"))),
    };
    let generation = generation(row)?;
    let record = Record::new(fingerprint, generation, state).with_recovery_point(point);
    // Statements that do not read the nonce leave the holder unknown.
    let nonce: Option<Vec<u8>> = row.try_get("nonce").ok();
    Ok(match nonce.and_then(|n| <[u8; 16]>::try_from(n).ok()) {
        Some(nonce) => record.with_holder(Token::from_parts(generation, nonce)),
        None => record,
    })
}

/// What the claim statement returned: `None` when it lost a race and must run again.
pub(super) fn decode_claim(
    rows: &[Row],
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<Option<ClaimOutcome>, StoreError> {
    let mut best: Option<(i16, &Row)> = None;
    for row in rows {
        let outcome: i16 = column(row, "outcome")?;
        if best.is_none_or(|(b, _)| outcome < b) {
            best = Some((outcome, row));
        }
    }
    let Some((outcome, row)) = best else {
        return Ok(None);
    };
    if outcome == OVER_QUOTA {
        return Err(StoreError::new(StoreErrorKind::QuotaExceeded));
    }
    let generation = generation(row)?;
    let claimed = |generation: u64, lapsed_for: Option<Duration>, point| {
        // A new or replaced record starts at generation 1; a takeover is always above it,
        // and is handed the record's recovery point.
        let token = Token::from_parts(generation, *nonce);
        Ok(Some(ClaimOutcome::Claimed(if generation > 1 {
            Claim::takeover(token, lapsed_for).with_recovery_point(point)
        } else {
            Claim::first(token)
        })))
    };
    match outcome {
        INSERTED | UPDATED => {
            let lapsed_us: Option<i64> = column(row, "lapsed_us")?;
            let lapsed = lapsed_us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
            claimed(generation, lapsed, recovery_point(row, IN_PROGRESS)?)
        }
        EXISTING => {
            let held: Vec<u8> = column(row, "nonce")?;
            let state: i16 = column(row, "state")?;
            let record = decode_record(row)?;
            // Our own nonce and request: an earlier attempt whose reply was lost did commit.
            // Equal nonces alone never prove that, so the fingerprint must match too.
            if state == IN_PROGRESS
                && held.as_slice() == nonce.as_slice()
                && record.fingerprint == *fingerprint
            {
                // Read back after a lost reply: the lapse is no longer known; the point is.
                return claimed(generation, None, record.recovery_point);
            }
            Ok(Some(ClaimOutcome::Existing(record)))
        }
        _ => Err(corrupt(CorruptRow("unknown claim outcome"))),
    }
}

/// The columns of a completion: state, status, headers, body, trailers.
type CompletionColumns<'a> = (i16, i16, Option<Vec<u8>>, Option<&'a [u8]>, Option<Vec<u8>>);

fn completion_columns(completion: &Completion) -> CompletionColumns<'_> {
    match completion {
        Completion::Response(r) => (
            RESPONSE,
            r.status.as_u16() as i16,
            Some(encode_response_headers(&r.headers, r.vary.as_ref())),
            Some(r.body.as_ref()),
            r.trailers.as_ref().map(encode_headers),
        ),
        Completion::Tombstone { status } => (TOMBSTONE, status.as_u16() as i16, None, None, None),
    }
}

/// The complete statement's parameters, shared by `complete` and `complete_in`.
pub(super) struct CompleteParams<'a> {
    id: &'a [u8],
    generation: i64,
    nonce: &'a [u8],
    columns: CompletionColumns<'a>,
    ttl: i64,
}

impl<'a> CompleteParams<'a> {
    pub(super) fn new(
        id: &'a RecordId,
        token: &'a Token,
        completion: &'a Completion,
        ttl: Duration,
    ) -> Self {
        let (generation, nonce) = token_params(token);
        Self {
            id: id.as_bytes().as_slice(),
            generation,
            nonce,
            columns: completion_columns(completion),
            ttl: micros(ttl),
        }
    }

    /// $1 id, $2 generation, $3 nonce, $4 state, $5 status, $6 headers, $7 body,
    /// $8 trailers, $9 ttl µs.
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        let (state, status, headers, body, trailers) = &self.columns;
        [
            &self.id,
            &self.generation,
            &self.nonce,
            state,
            status,
            headers,
            body,
            trailers,
            &self.ttl,
        ]
    }
}

pub(super) fn token_params(token: &Token) -> (i64, &[u8]) {
    // Stored generations are positive `bigint`s: a token beyond them matches no row.
    let generation = i64::try_from(token.generation()).unwrap_or(-1);
    (generation, token.nonce().as_slice())
}

pub(super) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).map_or(MAX_MICROS, |us| us.min(MAX_MICROS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_bounded_microseconds() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::from_nanos(999)), 0);
        assert_eq!(micros(Duration::MAX), MAX_MICROS);
    }

    #[test]
    fn headers_columns_round_trip_and_reject_unknown_formats() {
        let mut h = HeaderMap::new();
        h.append("link", "<a>".parse().unwrap());
        h.append("link", "<b>".parse().unwrap());
        assert_eq!(decode_headers(encode_headers(&h)).unwrap(), h);
        let mut v2 = encode_headers(&h);
        v2[0] = 2;
        assert_eq!(
            decode_headers(v2).unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        assert!(decode_headers(Vec::new()).is_err());
    }
}
