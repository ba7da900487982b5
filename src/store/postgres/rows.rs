//! Rows to records and back: the columns the statements read and write, and how stored bytes
//! are checked.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{HeaderMap, StatusCode};
use tokio_postgres::types::{FromSql, Kind, ToSql, Type};
use tokio_postgres::Row;

use crate::store::record::{
    get_headers, get_vary, put_headers, put_vary, Completion, Fingerprint, Record, RecordId,
    RecordState, StoredResponse, Token, VaryGuard,
};
use crate::store::RecoveryPoint;
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

// Outcomes of the claim function (claim_function.sql); claim.sql's own answer is EXISTING.
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
            let vary = crate::store::record::legacy_vary_guard(&mut headers);
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

pub(super) fn column<'r, T: FromSql<'r>>(row: &'r Row, name: &str) -> Result<T, StoreError> {
    row.try_get(name).map_err(corrupt)
}

/// Named columns: a row, or the record the claim function returns.
pub(super) trait Columns {
    /// The column `name`, or `Corrupt` when it is missing or of another type.
    fn value<'r, T: FromSql<'r>>(&'r self, name: &str) -> Result<T, StoreError>;
}

impl Columns for Row {
    fn value<'r, T: FromSql<'r>>(&'r self, name: &str) -> Result<T, StoreError> {
        column(self, name)
    }
}

/// The claim function's result columns (claim_function.sql), in order.
const CLAIMED: [&str; 12] = [
    "outcome",
    "generation",
    "nonce",
    "fingerprint",
    "state",
    "lease_us",
    "status",
    "headers",
    "body",
    "trailers",
    "lapsed_us",
    "recovery_point",
];

/// The claim function's answer: one record, in Postgres's binary format for records (the
/// number of fields, then each field's type, length or -1 for NULL, and value).
struct Claimed<'r> {
    fields: Vec<(Type, Option<&'r [u8]>)>,
}

impl<'r> FromSql<'r> for Claimed<'r> {
    fn from_sql(_: &Type, mut raw: &'r [u8]) -> Result<Self, Box<dyn StdError + Sync + Send>> {
        fn take<'r>(raw: &mut &'r [u8], n: usize) -> Result<&'r [u8], CorruptRow> {
            if raw.len() < n {
                return Err(CorruptRow("truncated claim record"));
            }
            let (head, rest) = raw.split_at(n);
            *raw = rest;
            Ok(head)
        }
        let int = |raw: &mut &'r [u8]| -> Result<i32, CorruptRow> {
            Ok(i32::from_be_bytes(
                take(raw, 4)?.try_into().expect("4 bytes"),
            ))
        };
        let count = int(&mut raw)?;
        if usize::try_from(count) != Ok(CLAIMED.len()) {
            return Err(Box::new(CorruptRow("unexpected claim record fields")));
        }
        let mut fields = Vec::with_capacity(CLAIMED.len());
        for _ in 0..count {
            let oid = int(&mut raw)? as u32;
            let ty = Type::from_oid(oid).ok_or(CorruptRow("unexpected claim record type"))?;
            let len = int(&mut raw)?;
            let value = match usize::try_from(len) {
                Ok(n) => Some(take(&mut raw, n)?),
                Err(_) => None,
            };
            fields.push((ty, value));
        }
        if !raw.is_empty() {
            return Err(Box::new(CorruptRow(
                "trailing bytes after the claim record",
            )));
        }
        Ok(Self { fields })
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::RECORD || matches!(ty.kind(), Kind::Composite(_))
    }
}

impl Columns for Claimed<'_> {
    fn value<'r, T: FromSql<'r>>(&'r self, name: &str) -> Result<T, StoreError> {
        let i = CLAIMED
            .iter()
            .position(|c| *c == name)
            .ok_or_else(|| corrupt(CorruptRow("no such claim record field")))?;
        let (ty, value) = &self.fields[i];
        if !T::accepts(ty) {
            return Err(corrupt(CorruptRow("claim record field of another type")));
        }
        T::from_sql_nullable(ty, *value).map_err(corrupt)
    }
}

fn generation(row: &impl Columns) -> Result<u64, StoreError> {
    let g: i64 = row.value("generation")?;
    u64::try_from(g).map_err(|_| corrupt(CorruptRow("negative generation")))
}

/// The `recovery_point` column of a record in progress. A completed record has none, whatever
/// the column holds (a replica of an earlier version completes without clearing it).
fn recovery_point(row: &impl Columns, state: i16) -> Result<Option<RecoveryPoint>, StoreError> {
    if state != IN_PROGRESS {
        return Ok(None);
    }
    let bytes: Option<Vec<u8>> = row.value("recovery_point")?;
    bytes
        .map(|b| RecoveryPoint::decode(Bytes::from(b)).map_err(corrupt))
        .transpose()
}

/// Reads the record columns: generation, fingerprint, state, lease_us (read for a record in
/// progress only; a negative lease is none left), status, headers, body, trailers,
/// recovery_point.
pub(super) fn decode_record(row: &impl Columns) -> Result<Record, StoreError> {
    let fp: Vec<u8> = row.value("fingerprint")?;
    let fingerprint = Fingerprint::from_bytes(
        fp.try_into()
            .map_err(|_| corrupt(CorruptRow("fingerprint is not 32 bytes")))?,
    );
    let state: i16 = row.value("state")?;
    let point = recovery_point(row, state)?;
    let status = || -> Result<StatusCode, StoreError> {
        let s: i16 = row.value("status")?;
        u16::try_from(s)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| corrupt(CorruptRow("invalid status")))
    };
    let state = match state {
        IN_PROGRESS => {
            let us: i64 = row.value("lease_us")?;
            RecordState::InProgress {
                lease_remaining: Duration::from_micros(u64::try_from(us).unwrap_or(0)),
            }
        }
        RESPONSE => {
            let headers: Vec<u8> = row.value("headers")?;
            let body: Vec<u8> = row.value("body")?;
            let trailers: Option<Vec<u8>> = row.value("trailers")?;
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
    let nonce: Option<Vec<u8>> = row.value("nonce").ok().flatten();
    Ok(match nonce.and_then(|n| <[u8; 16]>::try_from(n).ok()) {
        Some(nonce) => record.with_holder(Token::from_parts(generation, nonce)),
        None => record,
    })
}

/// What a claim statement's row says.
// Returned and matched at once, never stored: boxing the outcome would cost every claim an
// allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum ClaimRead {
    /// The claim's outcome.
    Done(ClaimOutcome),
    /// The function lost a race: run the claim again.
    Again,
    /// The row is expired, or a lapsed lease of this request, or claim_new.sql's insert met a
    /// row its read could not see: claim it with claim_call.sql.
    Call,
}

/// A `timestamptz` as Postgres sends it: microseconds since 2000-01-01. Only differences of
/// two are used, so the epoch does not matter.
struct Micros(i64);

impl<'r> FromSql<'r> for Micros {
    fn from_sql(_: &Type, raw: &'r [u8]) -> Result<Self, Box<dyn StdError + Sync + Send>> {
        let bytes: [u8; 8] = raw
            .try_into()
            .map_err(|_| CorruptRow("timestamp is not 8 bytes"))?;
        Ok(Self(i64::from_be_bytes(bytes)))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TIMESTAMPTZ
    }
}

/// The row claim.sql read, with the lease left (µs, by the database's clock) that the
/// statement leaves to the store to work out.
struct ReadRow<'r> {
    row: &'r Row,
    /// `lease_us` in Postgres's binary form for a `bigint`.
    lease_us: [u8; 8],
}

impl Columns for ReadRow<'_> {
    fn value<'r, T: FromSql<'r>>(&'r self, name: &str) -> Result<T, StoreError> {
        if name != "lease_us" {
            return self.row.value(name);
        }
        if !T::accepts(&Type::INT8) {
            return Err(corrupt(CorruptRow("lease_us read as another type")));
        }
        T::from_sql(&Type::INT8, &self.lease_us).map_err(corrupt)
    }
}

/// What the claim statement (claim.sql) returned, its one row.
pub(super) fn decode_claim(
    row: &Row,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<ClaimRead, StoreError> {
    if let Some(claimed) = column::<Option<Claimed<'_>>>(row, "claimed")? {
        return decode_claimed(&claimed, fingerprint, nonce);
    }
    decode_read(row, fingerprint, nonce)
}

/// What the claim statement without a quota (claim_new.sql) returned, its one row: the new
/// record's generation in `claimed`, or the row it read.
pub(super) fn decode_new(
    row: &Row,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<ClaimRead, StoreError> {
    if let Some(generation) = column::<Option<i64>>(row, "claimed")? {
        // The insert of an absent key: always generation 1.
        if generation != 1 {
            return Err(corrupt(CorruptRow("a new record not at generation 1")));
        }
        return Ok(ClaimRead::Done(ClaimOutcome::Claimed(Claim::first(
            Token::from_parts(1, *nonce),
        ))));
    }
    // `generation` is never NULL in the table: NULL is no row read, and an insert that met a
    // row committed since. The claim function reads it again with a fresh snapshot.
    if column::<Option<i64>>(row, "generation")?.is_none() {
        return Ok(ClaimRead::Call);
    }
    decode_read(row, fingerprint, nonce)
}

/// A row a claim statement read: the answer when it is live, otherwise `Call`.
fn decode_read(
    row: &Row,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<ClaimRead, StoreError> {
    // A row is there: live unless expired or a lapsed lease of this same request, the same
    // test the claim function makes (`{expired}` and its takeover condition in sql.rs).
    let Micros(now) = column(row, "now")?;
    let Micros(locked_until) = column(row, "locked_until")?;
    let Micros(expires_at) = column(row, "expires_at")?;
    let state: i16 = column(row, "state")?;
    let fp: &[u8] = column(row, "fingerprint")?;
    let held = state == IN_PROGRESS && locked_until > now;
    let expired = expires_at <= now && !held;
    let lapsed = state == IN_PROGRESS && !held && fp == fingerprint.as_bytes();
    if expired || lapsed {
        return Ok(ClaimRead::Call);
    }
    let read = ReadRow {
        row,
        lease_us: locked_until.saturating_sub(now).to_be_bytes(),
    };
    decode_outcome(EXISTING, &read, fingerprint, nonce).map(ClaimRead::Done)
}

/// What claim_call.sql returned, its one row: the claim function's answer.
pub(super) fn decode_called(
    row: &Row,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<ClaimRead, StoreError> {
    let claimed: Claimed<'_> = column(row, "claimed")?;
    decode_claimed(&claimed, fingerprint, nonce)
}

fn decode_claimed(
    claimed: &Claimed<'_>,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<ClaimRead, StoreError> {
    match claimed.value::<Option<i16>>("outcome")? {
        Some(outcome) => decode_outcome(outcome, claimed, fingerprint, nonce).map(ClaimRead::Done),
        None => Ok(ClaimRead::Again),
    }
}

fn decode_outcome(
    outcome: i16,
    row: &impl Columns,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
) -> Result<ClaimOutcome, StoreError> {
    if outcome == OVER_QUOTA {
        return Err(StoreError::new(StoreErrorKind::QuotaExceeded));
    }
    let generation = generation(row)?;
    let claimed = |generation: u64, lapsed_for: Option<Duration>, point| {
        // A new or replaced record starts at generation 1; a takeover is always above it,
        // and is handed the record's recovery point.
        let token = Token::from_parts(generation, *nonce);
        Ok(ClaimOutcome::Claimed(if generation > 1 {
            Claim::takeover(token, lapsed_for).with_recovery_point(point)
        } else {
            Claim::first(token)
        }))
    };
    match outcome {
        INSERTED | UPDATED => {
            let lapsed_us: Option<i64> = row.value("lapsed_us")?;
            let lapsed = lapsed_us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
            claimed(generation, lapsed, recovery_point(row, IN_PROGRESS)?)
        }
        EXISTING => {
            let held: Vec<u8> = row.value("nonce")?;
            let state: i16 = row.value("state")?;
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
            Ok(ClaimOutcome::Existing(record))
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

    /// The claim function's record, as Postgres sends it: the field count, then each field's
    /// type, length (-1 for NULL) and value.
    fn record(fields: &[(Type, Option<&[u8]>)]) -> Vec<u8> {
        let mut out = (fields.len() as i32).to_be_bytes().to_vec();
        for (ty, value) in fields {
            out.extend(ty.oid().to_be_bytes());
            match value {
                Some(v) => {
                    out.extend((v.len() as i32).to_be_bytes());
                    out.extend(*v);
                }
                None => out.extend((-1i32).to_be_bytes()),
            }
        }
        out
    }

    #[test]
    fn the_claim_record_is_read_by_field_name_and_checked() {
        let types = [
            Type::INT2,
            Type::INT8,
            Type::BYTEA,
            Type::BYTEA,
            Type::INT2,
            Type::INT8,
            Type::INT2,
            Type::BYTEA,
            Type::BYTEA,
            Type::BYTEA,
            Type::INT8,
            Type::BYTEA,
        ];
        let mut fields: Vec<(Type, Option<&[u8]>)> =
            types.iter().map(|t| (t.clone(), None)).collect();
        let (outcome, generation, lapsed) = (
            1i16.to_be_bytes(),
            4i64.to_be_bytes(),
            2_500_000i64.to_be_bytes(),
        );
        fields[0].1 = Some(&outcome);
        fields[1].1 = Some(&generation);
        fields[10].1 = Some(&lapsed);
        let raw = record(&fields);
        let claimed = Claimed::from_sql(&Type::RECORD, &raw).unwrap();
        let nonce = [3u8; 16];
        let fp = Fingerprint::from_bytes([5; 32]);
        match decode_outcome(UPDATED, &claimed, &fp, &nonce).unwrap() {
            ClaimOutcome::Claimed(c) => {
                assert_eq!(c.token, Token::from_parts(4, nonce));
                assert!(c.takeover);
                assert_eq!(c.lapsed_for, Some(Duration::from_millis(2500)));
            }
            other => panic!("{other:?}"),
        }
        // A field read as another type, a record cut short or of another shape: corrupt.
        assert_eq!(
            claimed.value::<i64>("outcome").unwrap_err().kind(),
            StoreErrorKind::Corrupt
        );
        assert!(Claimed::from_sql(&Type::RECORD, &raw[..raw.len() - 1]).is_err());
        assert!(Claimed::from_sql(&Type::RECORD, &record(&fields[..11])).is_err());
        let mut longer = raw.clone();
        longer.push(0);
        assert!(Claimed::from_sql(&Type::RECORD, &longer).is_err());
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
