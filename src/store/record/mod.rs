//! What a store keeps for one (scope, key): identifiers, the claim token and the recorded answer.

use std::fmt;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;
use sha2::{Digest, Sha256};

use crate::store::{StoreError, StoreErrorKind};

/// The store key of one idempotency record: a hash of (scope, key).
///
/// Stores never see the raw client key, only this hash, so a hostile key cannot
/// reach a store's key space or its logs.
///
/// The first [`SCOPE_PREFIX`](Self::SCOPE_PREFIX) bytes are those of the record's
/// [`ScopeId`], the other 28 a SHA-256 of (scope, key): a store that only gets the id can
/// still place a scope's records together (Redis Cluster hash-tags them into one slot, so a
/// per-scope quota is counted atomically beside the record).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordId([u8; 32]);

/// Feeds the hasher the id's last 8 bytes, which are SHA-256 output and so already uniform,
/// instead of all 32 with their length: a map of ids (the memory store's, the tier's, the
/// waiters') hashes one word per lookup. Ids that differ only in other bytes collide, which
/// takes a 64-bit partial SHA-256 collision to bring about. Equal ids hash equal, as `Eq`
/// needs.
impl std::hash::Hash for RecordId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let [.., a, b, c, d, e, f, g, h] = self.0;
        state.write_u64(u64::from_le_bytes([a, b, c, d, e, f, g, h]));
    }
}

impl RecordId {
    /// Derives the record id of `key` within `scope` (`None` is the shared, unscoped space).
    ///
    /// Each part is length-prefixed, so `("ab", "c")` and `("a", "bc")` differ, and the
    /// unscoped space differs from every named scope, the empty one included.
    pub fn new(scope: Option<&str>, key: &str) -> Self {
        Self::after_header(record_header(scope), &ScopeId::new(scope), key)
    }

    /// The scope id and the record id of `key` within `scope`, from this thread's cache of
    /// recent scopes: the layer needs both, and a cached header leaves one SHA-256 block to
    /// hash for a key of up to 47 bytes.
    pub(crate) fn cached(scope: Option<&str>, key: &str) -> (ScopeId, Self) {
        let (scope_id, header) = cached_scope(scope);
        (scope_id, Self::after_header(header, &scope_id, key))
    }

    fn after_header(mut h: Sha256, scope_id: &ScopeId, key: &str) -> Self {
        h.update((key.len() as u64).to_be_bytes());
        h.update(key.as_bytes());
        let mut id: [u8; 32] = h.finalize().into();
        // 224 bits of hash stay: still collision-free for any number of records.
        id[..Self::SCOPE_PREFIX].copy_from_slice(&scope_id.0[..Self::SCOPE_PREFIX]);
        Self(id)
    }

    /// How many leading bytes of a record id are its scope id's.
    pub const SCOPE_PREFIX: usize = 4;

    /// Wraps 32 bytes read back from a store.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters: the form stores use in their keys.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// The id [`to_hex`](Self::to_hex) wrote (either case); `None` for anything else.
    pub fn from_hex(text: &str) -> Option<Self> {
        let text = text.as_bytes();
        if text.len() != 64 {
            return None;
        }
        let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut bytes = [0u8; 32];
        for (i, pair) in text.chunks_exact(2).enumerate() {
            bytes[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
        }
        Some(Self(bytes))
    }
}

/// The scope a record belongs to, as a hash: what a store counts per-scope quotas by.
///
/// Like [`RecordId`], stores never see the scope itself. The unscoped space has an id of
/// its own.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeId([u8; 32]);

impl ScopeId {
    /// Derives the id of `scope` (`None` is the shared, unscoped space).
    pub fn new(scope: Option<&str>) -> Self {
        let mut h = Sha256::new();
        h.update(b"tower-idempotency scope v1\0");
        match scope {
            None => h.update([0u8]),
            Some(s) => {
                h.update([1u8]);
                h.update((s.len() as u64).to_be_bytes());
                h.update(s.as_bytes());
            }
        }
        Self(h.finalize().into())
    }

    /// Wraps 32 bytes read back from a store.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

/// The record id's hasher after its header: the prefix and the framed scope, then zero bytes
/// up to a whole number of SHA-256 blocks. The framing fixes the header's length, so the
/// padding is unambiguous, and a hasher kept at that point has compressed the header: what
/// is left is the key's length and the key, one block for keys of up to 47 bytes
/// (64 - 8 for the length - 9 for SHA-256's own padding).
fn record_header(scope: Option<&str>) -> Sha256 {
    const PREFIX: &[u8] = b"tower-idempotency record v3\0";
    let mut h = Sha256::new();
    h.update(PREFIX);
    let framed = match scope {
        None => {
            h.update([0u8]);
            1
        }
        Some(s) => {
            h.update([1u8]);
            h.update((s.len() as u64).to_be_bytes());
            h.update(s.as_bytes());
            9 + s.len()
        }
    };
    let pad = (64 - (PREFIX.len() + framed) % 64) % 64;
    h.update(&[0u8; 64][..pad]);
    h
}

/// The scope's id and its record header, remembered: the unscoped ones once per process, a
/// named scope's for the last few scopes this thread saw. A layer meets the same few scopes
/// request after request, and each would cost two SHA-256 blocks.
fn cached_scope(scope: Option<&str>) -> (ScopeId, Sha256) {
    static UNSCOPED: std::sync::OnceLock<(ScopeId, Sha256)> = std::sync::OnceLock::new();
    let derive = || (ScopeId::new(scope), record_header(scope));
    let Some(s) = scope else {
        return UNSCOPED.get_or_init(derive).clone();
    };
    // Gone only while the thread exits: then computed.
    SCOPES
        .try_with(|cache| {
            let mut cache = cache.borrow_mut();
            if let Some(e) = cache.entries.iter().find(|e| &*e.name == s) {
                return (e.id, e.header.clone());
            }
            let (id, header) = derive();
            let entry = CachedScope {
                name: s.into(),
                id,
                header: header.clone(),
            };
            let slot = cache.next;
            cache.next = (slot + 1) % SCOPE_CACHE;
            if slot < cache.entries.len() {
                cache.entries[slot] = entry;
            } else {
                cache.entries.push(entry);
            }
            (id, header)
        })
        .unwrap_or_else(|_| derive())
}

/// How many scopes a thread remembers: replaced in turn, so a thread serving many tenants
/// costs a few string compares more than it saves, never a growing table.
const SCOPE_CACHE: usize = 8;

struct CachedScope {
    name: Box<str>,
    id: ScopeId,
    header: Sha256,
}

#[derive(Default)]
struct Scopes {
    entries: Vec<CachedScope>,
    /// The slot the next new scope takes.
    next: usize,
}

thread_local! {
    static SCOPES: std::cell::RefCell<Scopes> = std::cell::RefCell::new(Scopes::default());
}

impl fmt::Debug for ScopeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeId({})", &self.to_hex()[..16])
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The `v3` SHA-256 fingerprint of a request: method, path and query, media type with its
/// parameters, `Content-Encoding`, canonical body (RFC 8785 JSON with exact numbers, form
/// pairs sorted stably by name, or raw bytes) and chosen headers.
///
/// `v3` is the fingerprint the first release computes (`v1` and `v2`, never released,
/// covered the same and framed it otherwise: `v3` pads the method, path, media type and
/// codings to a SHA-256 block and tags the body with one byte, so a small body costs one
/// block); a release that changes what it covers or how bumps the version, and
/// [`Display`](fmt::Display) prints it (`v3:` and 64 hex digits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps 32 bytes read back from a store.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &hex(&self.0)[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v3:{}", hex(&self.0))
    }
}

/// Proof of one claim: the record's generation and a random nonce.
///
/// The nonce matters: after a first claim's release the key starts again at generation 1,
/// and a holder that outlived its lease must not be able to complete the new claim.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token {
    generation: u64,
    nonce: [u8; 16],
}

impl Token {
    /// A fresh token for `generation`, with a random nonce from the OS.
    ///
    /// Fails with [`StoreErrorKind::Unavailable`] when the OS random source fails: a store
    /// must then fail the claim (the layer answers 503). A fixed nonce would let two
    /// different claims of one generation carry equal tokens, and each pass the other's fence.
    pub fn generate(generation: u64) -> Result<Self, StoreError> {
        Ok(Self {
            generation,
            nonce: random_nonce()?,
        })
    }

    /// Rebuilds a token read back from a store.
    pub const fn from_parts(generation: u64, nonce: [u8; 16]) -> Self {
        Self { generation, nonce }
    }

    /// The record generation this token holds: 1 for a first claim, +1 per takeover.
    pub const fn generation(&self) -> u64 {
        self.generation
    }

    /// The random part.
    pub const fn nonce(&self) -> &[u8; 16] {
        &self.nonce
    }

    /// What a record keeps in place of this token once this token released it and the record
    /// stayed (a takeover's release keeps the key's history): the same generation, and a nonce
    /// derived from this one. No claim holds it, so this token is fenced from then on, and a
    /// release sent again recognises its own. One-way, so that nothing read from a record
    /// leads back to a token that holds it.
    pub(crate) fn released(&self) -> Self {
        let mut h = Sha256::new();
        h.update(b"tower-idempotency released\0");
        h.update(self.nonce);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&h.finalize()[..16]);
        Self {
            generation: self.generation,
            nonce,
        }
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The nonce is a capability: keep it out of logs.
        f.debug_struct("Token")
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// Why a nonce could not be made.
#[derive(Debug)]
struct RandomUnavailable(getrandom::Error);

impl fmt::Display for RandomUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the OS random source failed: {}", self.0)
    }
}

impl std::error::Error for RandomUnavailable {}

#[cfg(test)]
thread_local! {
    /// Makes [`random_nonce`] fail on this thread, as a broken OS random source would.
    pub(crate) static FAIL_RANDOM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Makes [`random_nonce`] return this on this thread: equal tokens, crafted.
    pub(crate) static FIXED_NONCE: std::cell::Cell<Option<[u8; 16]>> =
        const { std::cell::Cell::new(None) };
}

fn random_nonce() -> Result<[u8; 16], StoreError> {
    let mut nonce = [0u8; 16];
    #[cfg(test)]
    if FAIL_RANDOM.with(std::cell::Cell::get) {
        return Err(StoreError::with_source(
            StoreErrorKind::Unavailable,
            RandomUnavailable(getrandom::Error::UNSUPPORTED),
        ));
    }
    #[cfg(test)]
    if let Some(fixed) = FIXED_NONCE.with(std::cell::Cell::get) {
        return Ok(fixed);
    }
    NONCES.with(|cell| {
        let mut rng = cell.borrow_mut();
        let rng = match &mut *rng {
            Some(rng) => rng,
            None => {
                // Seeded from the OS once per thread; a failed seed fails this claim and is
                // tried again on the next one, never replaced by a fixed seed.
                let mut seed = [0u8; 32];
                getrandom::fill(&mut seed).map_err(|e| {
                    StoreError::with_source(StoreErrorKind::Unavailable, RandomUnavailable(e))
                })?;
                rng.insert(ChaCha12Rng::from_seed(seed))
            }
        };
        rng.fill_bytes(&mut nonce);
        Ok(nonce)
    })
}

thread_local! {
    /// A user-space CSPRNG per thread. Nonces only need to be unpredictable and distinct:
    /// ChaCha12 from a 256-bit OS seed gives that, at a few nanoseconds instead of a
    /// syscall. A process that forks after making nonces copies the generator; a forked
    /// child must not serve requests before it `exec`s (tokio runtimes don't survive a fork
    /// either).
    static NONCES: std::cell::RefCell<Option<ChaCha12Rng>> = const { std::cell::RefCell::new(None) };
}

/// A recorded response, replayed byte for byte.
///
/// Built by the layer (and by [`IdempotencyContext::completion`](crate::IdempotencyContext::completion)
/// for a handler that records its own answer), which also derives the guards a record
/// carries beside the answer; a store keeps it whole with [`Completion::encode`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The allow-listed response headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// The trailers, when the body had them.
    pub trailers: Option<HeaderMap>,
    /// The request headers the answer varies on and the recording request's values of them:
    /// a field of the record, not a header, so neither the deny-list nor the header caps
    /// can drop it.
    pub(crate) vary: Option<VaryGuard>,
}

impl StoredResponse {
    /// A response to record, without guards (for tests and stores that build one by hand).
    pub fn new(
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        trailers: Option<HeaderMap>,
    ) -> Self {
        Self {
            status,
            headers,
            body,
            trailers,
            vary: None,
        }
    }

    /// Whether this fits the caps decoding enforces, as it will be stored.
    pub(crate) fn fits(&self) -> bool {
        fits_record(&self.headers)
            && self.trailers.as_ref().is_none_or(fits_record)
            && self.body.len() <= u32::MAX as usize
            && self
                .vary
                .as_ref()
                .is_none_or(|v| v.names.len() <= MAX_RECORDED_FIELD_BYTES)
    }
}

/// What a recorded answer's `Vary` names, and a SHA-256 of the recording request's values of
/// those headers: a retry that sends other values is not given the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VaryGuard {
    /// Lower-case header names, sorted, once each, joined by `,`.
    pub(crate) names: Box<str>,
    pub(crate) digest: [u8; 32],
}

/// How a claimed request ended, as `complete` records it.
// Built once per request and moved a few times; boxing would allocate on every replay.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// The answer, kept whole.
    Response(StoredResponse),
    /// The request completed with `status`, but its body was larger than the layer keeps.
    /// Retries get a problem response, never a second execution.
    Tombstone {
        /// The status the original request answered with.
        status: StatusCode,
    },
}

/// The state of one record, as the store's clock sees it.
// Built once per request and moved a few times; boxing would allocate on every replay.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed and not yet completed.
    InProgress {
        /// Time left on the holder's lease; zero once it has lapsed.
        lease_remaining: Duration,
    },
    /// Completed: the recorded answer.
    Completed(Completion),
}

/// One idempotency record, as `claim` and `get` return it.
///
/// Two records are equal when they hold the same thing: [`expires_in`](Self::expires_in) is a
/// reading of the store's clock, which moves between two reads of one record, and is not
/// compared.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Record {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The generation of the latest claim.
    pub generation: u64,
    /// In progress or completed.
    pub state: RecordState,
    /// The token of the claim that holds the record, or completed it, where the store can
    /// tell: the layer knows its own claim's record by it. A generation alone repeats after
    /// an operator's `force_release` and a new first claim.
    pub holder: Option<Token>,
    /// The last recovery point an attempt saved, while the record is in progress.
    pub recovery_point: Option<crate::store::RecoveryPoint>,
    /// How long the record has left before it expires, by the store's clock, where the store
    /// tells ([`get`](crate::store::IdempotencyStore::get) of the stores in this crate):
    /// a [`LocalTier`](crate::store::LocalTier) keeps a completed record no longer.
    pub expires_in: Option<Duration>,
}

impl PartialEq for Record {
    fn eq(&self, other: &Self) -> bool {
        self.fingerprint == other.fingerprint
            && self.generation == other.generation
            && self.state == other.state
            && self.holder == other.holder
            && self.recovery_point == other.recovery_point
    }
}

impl Eq for Record {}

impl Record {
    /// A record with no [`holder`](Self::holder) known.
    pub fn new(fingerprint: Fingerprint, generation: u64, state: RecordState) -> Self {
        Self {
            fingerprint,
            generation,
            state,
            holder: None,
            recovery_point: None,
            expires_in: None,
        }
    }

    /// The same record, expiring in `left` by the store's clock.
    #[must_use]
    pub fn with_expires_in(mut self, left: Duration) -> Self {
        self.expires_in = Some(left);
        self
    }

    /// The same record, holding `point` (in progress only).
    #[must_use]
    pub fn with_recovery_point(mut self, point: Option<crate::store::RecoveryPoint>) -> Self {
        self.recovery_point = point;
        self
    }

    /// The same record, held (or completed) by `token`'s claim.
    #[must_use]
    pub fn with_holder(mut self, token: Token) -> Self {
        self.holder = Some(token);
        self
    }
}

/// Why stored bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(&'static str);

impl DecodeError {
    pub(crate) const fn new(what: &'static str) -> Self {
        Self(what)
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "corrupt idempotency record: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Version byte of the completion encoding; bump on any layout change. Version 1 kept the
/// Vary digest as a header; it is still read.
const COMPLETION_FORMAT: u8 = 2;
const COMPLETION_FORMAT_V1: u8 = 1;
const KIND_RESPONSE: u8 = 0;
const KIND_TOMBSTONE: u8 = 1;

impl Completion {
    /// Encodes to the compact, versioned binary form stores keep.
    ///
    /// Layout (big-endian): version `u8`, kind `u8`, status `u16`; for a response then
    /// headers, body (`u32` length + bytes), trailers (`u8` present flag + headers) and the
    /// Vary guard (`u8` present flag, `u32` length + names, 32-byte digest), where headers
    /// are a `u32` count of (`u16` name length, name, `u32` value length, value).
    /// Bodies are raw bytes: no base64.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Completion::Tombstone { status } => {
                let mut out = Vec::with_capacity(4);
                out.put_u8(COMPLETION_FORMAT);
                out.put_u8(KIND_TOMBSTONE);
                out.put_u16(status.as_u16());
                out
            }
            Completion::Response(r) => {
                // Exactly its size: a store that keeps it as it is needs no second allocation.
                let len = 4
                    + headers_len(&r.headers)
                    + 4
                    + r.body.len()
                    + 1
                    + r.trailers.as_ref().map_or(0, headers_len)
                    + r.vary.as_ref().map_or(1, |v| 1 + 4 + v.names.len() + 32);
                let mut out = Vec::with_capacity(len);
                out.put_u8(COMPLETION_FORMAT);
                out.put_u8(KIND_RESPONSE);
                out.put_u16(r.status.as_u16());
                put_headers(&mut out, &r.headers);
                out.put_u32(r.body.len() as u32);
                out.extend_from_slice(&r.body);
                match &r.trailers {
                    None => out.put_u8(0),
                    Some(t) => {
                        out.put_u8(1);
                        put_headers(&mut out, t);
                    }
                }
                put_vary(&mut out, r.vary.as_ref());
                out
            }
        }
    }

    /// Decodes what [`Completion::encode`] wrote. The body shares `bytes`' allocation.
    pub fn decode(bytes: Bytes) -> Result<Self, DecodeError> {
        let mut buf = bytes;
        need(&buf, 4)?;
        let version = buf.get_u8();
        if version != COMPLETION_FORMAT && version != COMPLETION_FORMAT_V1 {
            return Err(DecodeError("unknown format version"));
        }
        let kind = buf.get_u8();
        let status =
            StatusCode::from_u16(buf.get_u16()).map_err(|_| DecodeError("invalid status"))?;
        match kind {
            KIND_TOMBSTONE => Ok(Completion::Tombstone { status }),
            KIND_RESPONSE => {
                let headers = get_headers(&mut buf)?;
                need(&buf, 4)?;
                let len = buf.get_u32() as usize;
                need(&buf, len)?;
                let body = buf.split_to(len);
                need(&buf, 1)?;
                let trailers = match buf.get_u8() {
                    0 => None,
                    1 => Some(get_headers(&mut buf)?),
                    _ => return Err(DecodeError("invalid trailer flag")),
                };
                let mut headers = headers;
                let vary = if version == COMPLETION_FORMAT_V1 {
                    legacy_vary_guard(&mut headers)
                } else {
                    get_vary(&mut buf)?
                };
                if buf.has_remaining() {
                    return Err(DecodeError("trailing bytes"));
                }
                Ok(Completion::Response(StoredResponse {
                    status,
                    headers,
                    body,
                    trailers,
                    vary,
                }))
            }
            _ => Err(DecodeError("unknown completion kind")),
        }
    }

    /// The status the original request answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Completion::Response(r) => r.status,
            Completion::Tombstone { status } => *status,
        }
    }
}

fn need(buf: &Bytes, n: usize) -> Result<(), DecodeError> {
    if buf.remaining() < n {
        Err(DecodeError("truncated"))
    } else {
        Ok(())
    }
}

/// The most fields (name-value pairs) one header or trailer map of a record may hold.
pub(crate) const MAX_RECORDED_FIELDS: usize = 1024;
/// The most bytes (names and values) one header or trailer map of a record may hold.
pub(crate) const MAX_RECORDED_FIELD_BYTES: usize = 256 * 1024;

/// Whether `headers` fits the record's caps; an answer that does not is kept as a tombstone.
pub(crate) fn fits_record(headers: &HeaderMap) -> bool {
    let bytes: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum();
    headers.len() <= MAX_RECORDED_FIELDS && bytes <= MAX_RECORDED_FIELD_BYTES
}

/// Appends `headers` in the layout [`Completion::encode`] uses (a `u32` count, then pairs).
/// How many bytes [`put_headers`] writes for `headers`.
fn headers_len(headers: &HeaderMap) -> usize {
    4 + headers
        .iter()
        .map(|(name, value)| 2 + name.as_str().len() + 4 + value.len())
        .sum::<usize>()
}

pub(crate) fn put_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    out.put_u32(headers.len() as u32);
    for (name, value) in headers {
        out.put_u16(name.as_str().len() as u16);
        out.extend_from_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.extend_from_slice(value.as_bytes());
    }
}

/// Reads headers written by [`put_headers`], advancing `buf`. Stored bytes are not trusted:
/// past the caps, or past what a `HeaderMap` can hold, this is an error, never a panic.
pub(crate) fn get_headers(buf: &mut Bytes) -> Result<HeaderMap, DecodeError> {
    need(buf, 4)?;
    let count = buf.get_u32() as usize;
    if count > MAX_RECORDED_FIELDS {
        return Err(DecodeError("too many header fields"));
    }
    // Four to spare: a replay adds its marker and the TTL header, and a server its
    // `Content-Length` and `Date`, without growing the map.
    let mut headers = HeaderMap::try_with_capacity(count.min(64) + 4)
        .map_err(|_| DecodeError("too many header fields"))?;
    let mut bytes = 0usize;
    for _ in 0..count {
        need(buf, 2)?;
        let n = buf.get_u16() as usize;
        need(buf, n)?;
        let name = HeaderName::from_bytes(&buf.split_to(n))
            .map_err(|_| DecodeError("invalid header name"))?;
        need(buf, 4)?;
        let v = buf.get_u32() as usize;
        need(buf, v)?;
        bytes += n + v;
        if bytes > MAX_RECORDED_FIELD_BYTES {
            return Err(DecodeError("header fields too large"));
        }
        let value = HeaderValue::from_maybe_shared(buf.split_to(v))
            .map_err(|_| DecodeError("invalid header value"))?;
        headers
            .try_append(name, value)
            .map_err(|_| DecodeError("too many header fields"))?;
    }
    Ok(headers)
}

/// Appends the Vary guard in the layout [`Completion::encode`] uses.
pub(crate) fn put_vary(out: &mut Vec<u8>, vary: Option<&VaryGuard>) {
    match vary {
        None => out.put_u8(0),
        Some(v) => {
            out.put_u8(1);
            out.put_u32(v.names.len() as u32);
            out.extend_from_slice(v.names.as_bytes());
            out.extend_from_slice(&v.digest);
        }
    }
}

/// Reads what [`put_vary`] wrote, under the same byte cap as a header map.
pub(crate) fn get_vary(buf: &mut Bytes) -> Result<Option<VaryGuard>, DecodeError> {
    need(buf, 1)?;
    match buf.get_u8() {
        0 => Ok(None),
        1 => {
            need(buf, 4)?;
            let n = buf.get_u32() as usize;
            if n > MAX_RECORDED_FIELD_BYTES {
                return Err(DecodeError("vary names too large"));
            }
            need(buf, n + 32)?;
            let names = std::str::from_utf8(&buf.split_to(n))
                .map_err(|_| DecodeError("vary names are not UTF-8"))?
                .into();
            let mut digest = [0; 32];
            buf.copy_to_slice(&mut digest);
            Ok(Some(VaryGuard { names, digest }))
        }
        _ => Err(DecodeError("invalid vary flag")),
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    hex_into(&mut s, bytes);
    s
}

/// Appends `bytes` in lower-case hex to `out`: 32 bytes at a time through a stack buffer and
/// one `push_str`, not a `push` per digit (which checks capacity and encodes a `char` each).
pub(crate) fn hex_into(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for chunk in bytes.chunks(32) {
        let mut buf = [0u8; 64];
        for (pair, b) in buf.chunks_exact_mut(2).zip(chunk) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
        out.push_str(std::str::from_utf8(&buf[..2 * chunk.len()]).expect("hex digits are ASCII"));
    }
}

/// The header in which records of the first encoding kept the Vary guard (see
/// [`legacy_vary_guard`]); never recorded from an inner service.
pub(crate) const VARY_DIGEST: HeaderName = HeaderName::from_static("idempotency-vary-digest");

/// A record of the first encoding kept the guard as a header: takes it out, as a guard.
pub(crate) fn legacy_vary_guard(headers: &mut HeaderMap) -> Option<VaryGuard> {
    let value = headers.remove(VARY_DIGEST)?;
    let hex = value.as_bytes();
    let mut digest = [0u8; 32];
    if hex.len() != 64 {
        return None;
    }
    for (i, pair) in hex.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).ok()?;
        digest[i] = u8::from_str_radix(text, 16).ok()?;
    }
    let names = vary_names(headers);
    Some(VaryGuard {
        names: names.join(",").into(),
        digest,
    })
}

/// Whether an answer's `Vary` names a request header (a guard would be needed).
pub(crate) fn names_vary(answer: &HeaderMap) -> bool {
    !vary_names(answer).is_empty()
}

/// The request header names an answer's `Vary` lists: lower-case, sorted, once each.
/// `Vary: *` (varies on more than headers) names nothing that can be matched; the scope and
/// the fingerprint are all that decide then.
pub(crate) fn vary_names(answer: &HeaderMap) -> Vec<String> {
    let mut names: Vec<String> = answer
        .get_all(http::header::VARY)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty() && n != "*")
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

#[cfg(test)]
mod tests;
