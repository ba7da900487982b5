//! The `v3` request fingerprint.
//!
//! Two JSON readers exist and must agree: the fast path (`json/fast.rs`) reads a body when no
//! field is excluded, the general path (`json/general.rs`) when some are, and where no
//! excluded field occurs both must write the same canonical form and refuse the same bodies.
//! Property tests hold them to it (`json/tests/properties.rs`, the general path run with a
//! pointer that matches nothing). A change to one is a change to the other.
//!
//! SHA-256 over length-prefixed fields: method, path and query, media type (with its
//! parameters) and content codings, zero-padded to a whole block (see [`head`]); then the body
//! kind (one byte) and the canonical body, then each configured header. The
//! body is canonical so that a retry that re-serialises the same JSON (other key order, other
//! whitespace, other escapes or number spellings) still matches:
//!
//! - JSON (`application/json`, `*/*+json`): RFC 8785 (JCS), except that a number RFC 8785
//!   cannot write exactly is written in an exact form (below);
//! - `application/x-www-form-urlencoded`: the decoded pairs, sorted by name only, so values
//!   keep their order within a name (`a=1&a=2` is not `a=2&a=1`);
//! - anything else, and any body under a `Content-Encoding` other than `identity`: the raw
//!   bytes.
//!
//! A gRPC request (`application/grpc`, `+proto`, `+json`) hashes the path, the raw message
//! frames and its `grpc-encoding` (absent is `identity`).
//!
//! Canonicalising must never make two different requests equal. Numbers: a literal whose
//! value is exactly the number RFC 8785 writes for the double it parses to (`1.5`, `1e21`,
//! `1000000000000000000000`) is written as RFC 8785 writes it; any other literal
//! (`9007199254740993`, `0.10000000000000000001`, `1e400`), which RFC 8785 would round into
//! another value's form, is written exactly as `#` sign digits `e` exponent
//! (`#9007199254740993e0`, also for `9007199254740993.0`), with no leading or trailing zeros
//! in the digits. RFC 8785 never writes `#`, so the two forms cannot meet. A lone surrogate is
//! kept as its `\udxxx` escape; RFC 8785 writes every valid code point as UTF-8. Only a body
//! whose canonical form could still merge two requests is hashed raw: duplicate keys (parsers
//! disagree on which wins), and anything that is not JSON (bad syntax, invalid UTF-8); so is a
//! form body with a bad percent-escape.
//!
//! The parts:
//!
//! - [`framing`]: the length-prefixed fields and the body kinds' tags;
//! - [`media`]: the `Content-Type` (and the body kind it names) and `Content-Encoding` fields;
//! - [`form`]: form bodies;
//! - [`json`]: canonical JSON, its tokens (`string.rs`, `number.rs`), objects and their key
//!   order (`object.rs`), and the two readers (`fast.rs`, `general.rs`).

pub(crate) mod form;
mod framing;
mod json;
mod media;
/// The URI the client sent. axum's `Router::nest` strips the prefix from the URI that inner
/// routes (and a layer on them) see, and keeps the original in `OriginalUri`.
pub(crate) fn original_uri(parts: &http::request::Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    &parts.uri
}

#[cfg(test)]
mod tests;

use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use http::{request, HeaderMap, HeaderName, Uri};
use sha2::{Digest, Sha256};

use crate::policy::is_grpc;
use crate::store::record::Fingerprint;

use self::form::canonical_form_into;
use self::framing::{BodyKind, Hasher};
pub(crate) use self::json::{canonical_json, canonical_json_digest};
use self::json::{canonicalise, hash_canonical, with_buffers};
use self::media::{content_codings, media_type};

/// What the request fingerprint covers beyond method, path, query and body: JSON fields it
/// leaves out and request headers it takes in.
///
/// Given to [`IdempotencyLayer::with_fingerprint`](crate::IdempotencyLayer::with_fingerprint).
/// By default it covers method, path and query, and the body as read by its media type and
/// content coding (gRPC: its `grpc-encoding`), and no other header.
///
/// ```
/// # use http::HeaderName;
/// # use tower_idempotency::{store::MemoryStore, Fingerprinting, IdempotencyLayer, JsonPointer};
/// let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped().with_fingerprint(
///     Fingerprinting::default()
///         .exclude_field(JsonPointer::parse("/client_time")?)
///         .include_header(HeaderName::from_static("x-account")),
/// );
/// # drop(layer);
/// # Ok::<_, tower_idempotency::ConfigError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use]
pub struct Fingerprinting {
    pub(crate) excluded: Vec<JsonPointer>,
    pub(crate) headers: Vec<HeaderName>,
    /// Match on method and target alone (webhook receivers): no media type, coding or body.
    pub(crate) route_only: bool,
}

impl Fingerprinting {
    /// Leaves a JSON field out of the fingerprint (a client timestamp, a trace id), so two
    /// requests that differ only there match.
    pub fn exclude_field(mut self, pointer: JsonPointer) -> Self {
        self.excluded.push(pointer);
        self
    }

    /// Adds a request header to the fingerprint, so a retry that sends another value of it
    /// gets 422 rather than the first answer. Headers that an answer names in `Vary` are
    /// compared anyway, see
    /// [`with_vary_match`](crate::IdempotencyLayer::with_vary_match).
    pub fn include_header(mut self, name: HeaderName) -> Self {
        self.headers.push(name);
        self
    }
}

/// A parsed RFC 6901 JSON Pointer, naming a field the fingerprint leaves out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPointer(Vec<String>);

impl JsonPointer {
    /// Parses `/a/b~1c/0`. Only the empty pointer (the whole document) is refused, since
    /// excluding it would make every body match.
    pub fn parse(pointer: &str) -> Result<Self, crate::ConfigError> {
        let err = |why: &str| crate::ConfigError::new(format!("JSON pointer {pointer:?}: {why}"));
        let rest = pointer
            .strip_prefix('/')
            .ok_or_else(|| err("must start with '/'"))?;
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                match c {
                    '~' => match chars.next() {
                        Some('0') => token.push('~'),
                        Some('1') => token.push('/'),
                        _ => return Err(err("'~' must be followed by '0' or '1'")),
                    },
                    c => token.push(c),
                }
            }
            tokens.push(token);
        }
        Ok(Self(tokens))
    }

    /// The reference tokens, unescaped (`~1` is `/`).
    pub(crate) fn tokens(&self) -> &[String] {
        &self.0
    }
}

/// Computes the `v3` fingerprint of a request. `target` is the URI whose path and query are
/// hashed: the one the client sent, which a nested router may have rewritten in `parts`.
pub(crate) fn fingerprint(
    parts: &request::Parts,
    target: &Uri,
    body: &[u8],
    config: &Fingerprinting,
) -> Fingerprint {
    let path = target.path_and_query().map_or("/", |p| p.as_str());
    let Head { mut h, kind } = head(
        config.route_only,
        parts.method.as_str(),
        path,
        &parts.headers,
    );
    if config.route_only {
        hash_headers(&mut h, parts, config);
        return Fingerprint::from_bytes(h.0.finalize().into());
    }
    with_buffers(|b| {
        let done = match kind {
            BodyKind::Json => canonicalise(body, &config.excluded, &mut b.out, &mut b.work, true),
            BodyKind::Form => canonical_form_into(body, &mut b.out),
            BodyKind::Raw | BodyKind::Grpc => false,
        };
        // One tag byte and the length: a small body then fits the head's next block whole.
        if done {
            h.0.update([kind.tag()]);
            h.0.update((b.out.len() as u64).to_be_bytes());
            // The outermost members' ranges are the JSON reader's; a form body has none,
            // whatever an earlier JSON body on this thread left there.
            let top: &[(usize, usize)] = match kind {
                BodyKind::Json => &b.work.top,
                _ => &[],
            };
            hash_canonical(&mut h.0, &b.out, top);
        } else {
            h.0.update([BodyKind::Raw.tag()]);
            h.field(body);
        }
    });
    if kind == BodyKind::Grpc {
        // The same frame bytes under another `grpc-encoding` are another message. Absent
        // means `identity`. Only gRPC requests hash this field.
        let encoding = parts
            .headers
            .get("grpc-encoding")
            .map_or(&b"identity"[..], |v| v.as_bytes())
            .to_ascii_lowercase();
        h.field(b"grpc-encoding");
        h.field(&encoding);
    }

    hash_headers(&mut h, parts, config);
    Fingerprint::from_bytes(h.0.finalize().into())
}

/// A fingerprint's start: the hasher after its head, and how the body is read.
struct Head {
    h: Hasher,
    kind: BodyKind,
}

/// The hasher after the prefix, the method, the path and query and, unless `route_only`, the
/// media type and content codings, zero-padded to a whole number of SHA-256 blocks, and the
/// body kind those headers name. Both are the same for every request to one route with the
/// same `Content-Type` and `Content-Encoding` lines, so this thread keeps them for its last few
/// (keyed by the raw lines: a hit skips normalising them) and starts from the state; the body
/// then starts a block of its own, and a canonical body of up to 46 bytes costs one block.
/// The framing fixes the head's length, so the padding is unambiguous.
fn head(route_only: bool, method: &str, path: &str, headers: &HeaderMap) -> Head {
    // A prefix of its own: a route-only fingerprint never equals a full one.
    let prefix: &[u8] = if route_only {
        b"tower-idempotency fingerprint v3 route-only\0"
    } else {
        b"tower-idempotency fingerprint v3\0"
    };
    let fresh = || {
        let mut h = Hasher(Sha256::new());
        h.0.update(prefix);
        h.field(method.as_bytes());
        h.field(path.as_bytes());
        let mut len = prefix.len() + 16 + method.len() + path.len();
        let mut kind = BodyKind::Raw;
        if !route_only {
            let (media, named) = media_type(headers);
            let codings = content_codings(headers);
            h.field(&media);
            h.field(&codings);
            len += 16 + media.len() + codings.len();
            // gRPC bodies are length-prefixed message frames, even `application/grpc+json`,
            // and an encoded body's bytes are not the JSON or form they decode to: both raw.
            kind = if is_grpc(headers) {
                BodyKind::Grpc
            } else if !codings.is_empty() {
                BodyKind::Raw
            } else {
                named
            };
        }
        h.0.update(&[0u8; 64][..(64 - len % 64) % 64]);
        Head { h, kind }
    };
    let mut key = [0u8; HEAD_KEY];
    let mut at = 0;
    let mut put = |part: &[u8]| {
        let end = at + 8 + part.len();
        let slot = key.get_mut(at..end)?;
        slot[..8].copy_from_slice(&(part.len() as u64).to_be_bytes());
        slot[8..].copy_from_slice(part);
        at = end;
        Some(())
    };
    let keyed = (|| {
        put(method.as_bytes())?;
        put(path.as_bytes())?;
        if !route_only {
            for name in [CONTENT_TYPE, CONTENT_ENCODING] {
                // Absent is not an empty line; several lines are not kept.
                let mut lines = headers.get_all(name).iter();
                match (lines.next(), lines.next()) {
                    (None, _) => put(b"-")?,
                    (Some(line), None) => {
                        put(b"+")?;
                        put(line.as_bytes())?;
                    }
                    (Some(_), Some(_)) => return None,
                }
            }
        }
        Some(())
    })();
    // A long target, or headers sent in several lines: not kept.
    if keyed.is_none() {
        return fresh();
    }
    let key = &key[..at];
    HEADS
        .try_with(|heads| {
            let mut heads = heads.borrow_mut();
            if let Some(hit) = heads
                .entries
                .iter()
                .find(|e| e.route_only == route_only && &e.key[..e.len] == key)
            {
                return Head {
                    h: Hasher(hit.state.clone()),
                    kind: hit.kind,
                };
            }
            let head = fresh();
            let mut entry = Kept {
                route_only,
                key: [0; HEAD_KEY],
                len: key.len(),
                state: head.h.0.clone(),
                kind: head.kind,
            };
            entry.key[..key.len()].copy_from_slice(key);
            let slot = heads.next;
            heads.next = (slot + 1) % HEADS_KEPT;
            if slot < heads.entries.len() {
                heads.entries[slot] = entry;
            } else {
                heads.entries.push(entry);
            }
            head
        })
        .unwrap_or_else(|_| fresh())
}

/// The longest method, target and header fields (with their length prefixes) [`head`] keeps.
const HEAD_KEY: usize = 192;
/// Heads per thread: replaced in turn, so routes with ids in the path cost a copy, not a
/// growing table.
const HEADS_KEPT: usize = 4;

struct Kept {
    route_only: bool,
    key: [u8; HEAD_KEY],
    len: usize,
    state: Sha256,
    kind: BodyKind,
}

#[derive(Default)]
struct Heads {
    entries: Vec<Kept>,
    next: usize,
}

thread_local! {
    static HEADS: std::cell::RefCell<Heads> = std::cell::RefCell::new(Heads::default());
}

/// The configured headers, each with its count of field lines.
fn hash_headers(h: &mut Hasher, parts: &request::Parts, config: &Fingerprinting) {
    for name in &config.headers {
        h.field(name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        h.0.update((values.iter().count() as u64).to_be_bytes());
        for v in values {
            h.field(v.as_bytes());
        }
    }
}
