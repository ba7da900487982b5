//! What a recorded answer carries, derived in one place for every way an answer is recorded:
//! the layer's own, [`IdempotencyContext::completion`](crate::IdempotencyContext::completion)
//! and `record_in`, which builds on it. No path can then forget a guard: the headers the
//! deny-list keeps, the Vary guard, and the caps checked on exactly what is stored.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, StatusCode};
use sha2::{Digest, Sha256};

use crate::store::record::{names_vary, vary_names};
use crate::store::record::{Completion, StoredResponse, VaryGuard};
use crate::store::{StoreError, StoreErrorKind};

/// What recording needs of the layer's settings, lent by `Config::recording`: this floor
/// reads the settings without importing the configuration above it.
#[derive(Clone, Copy)]
pub(crate) struct Rules<'a> {
    pub(crate) max_response_body: usize,
    pub(crate) unrecorded_headers: &'a [HeaderName],
    pub(crate) vary_match: bool,
}

impl Rules<'_> {
    /// The response headers (or trailers) a record keeps: the one rule for both protocols,
    /// for the layer and for handlers that record their own answer.
    fn recorded_headers(&self, headers: &HeaderMap) -> HeaderMap {
        crate::response::recorded_headers(headers, self.unrecorded_headers)
    }
}

/// The completion to store for an answer recorded by a handler or the recovery worker.
/// `request` is the recording request's headers when Vary matching is on, and `None` where
/// no request exists (the worker's context): an answer whose `Vary` names request headers is
/// then refused ([`StoreErrorKind::Unguarded`]) rather than stored without its guard. The
/// layer's own recording ([`completion_taking`]) always has the request's headers when
/// Vary matching is on, so the refusal cannot apply there.
pub(crate) fn completion(
    cfg: Rules<'_>,
    request: Option<&HeaderMap>,
    status: StatusCode,
    headers: &HeaderMap,
    body: Bytes,
    trailers: Option<&HeaderMap>,
) -> Result<Completion, StoreError> {
    if cfg.vary_match && request.is_none() && names_vary(headers) {
        return Err(StoreError::with_source(
            StoreErrorKind::Unguarded,
            "the answer's Vary names request headers, and no request's headers are known here \
             (the recovery worker runs without one): it cannot carry its Vary guard, so it is \
             not recorded; let the client's retry, which has the headers, record it",
        ));
    }
    Ok(build(cfg, request, status, headers, body, trailers))
}

/// An answer whose body is over `max_response_body`, or whose stored form is over the
/// record's caps, is a tombstone: it is never run twice, and never stored in a form that
/// cannot be read back.
fn build(
    cfg: Rules<'_>,
    request: Option<&HeaderMap>,
    status: StatusCode,
    headers: &HeaderMap,
    mut body: Bytes,
    trailers: Option<&HeaderMap>,
) -> Completion {
    if body.len() > cfg.max_response_body {
        return Completion::Tombstone { status };
    }
    // From the answer's own `Vary`, before the deny-list: the guard follows what the answer
    // varies on, whether or not the header itself is replayed.
    let vary = request.and_then(|request| vary_guard(headers, request));
    let mut kept = cfg.recorded_headers(headers);
    fitted(cfg, status, &mut kept, &mut body, trailers, vary)
        .unwrap_or(Completion::Tombstone { status })
}

/// The answer as recorded, its headers and body taken from `headers` and `body`; `None`, with
/// them put back, when the whole record would not fit.
fn fitted(
    cfg: Rules<'_>,
    status: StatusCode,
    headers: &mut HeaderMap,
    body: &mut Bytes,
    trailers: Option<&HeaderMap>,
    vary: Option<VaryGuard>,
) -> Option<Completion> {
    let stored = StoredResponse {
        status,
        headers: std::mem::take(headers),
        body: std::mem::take(body),
        trailers: trailers.map(|t| cfg.recorded_headers(t)),
        vary,
    };
    if stored.fits() {
        Some(Completion::Response(stored))
    } else {
        (*headers, *body) = (stored.headers, stored.body);
        None
    }
}

/// [`completion`], for the layer's own answer, whose headers and body it may take: when the
/// record keeps every header they move into the completion instead of being copied (no map
/// built per record, no shared copy of a body made per record), and `headers` and `body` are
/// left empty for [`give_back`] once it is stored.
pub(crate) fn completion_taking(
    cfg: Rules<'_>,
    request: Option<&HeaderMap>,
    status: StatusCode,
    headers: &mut HeaderMap,
    body: &mut Bytes,
    trailers: Option<&HeaderMap>,
) -> Completion {
    let all_kept = headers
        .keys()
        .all(|n| crate::response::is_recorded(n, cfg.unrecorded_headers));
    if !all_kept || body.len() > cfg.max_response_body {
        return build(cfg, request, status, headers, body.clone(), trailers);
    }
    let vary = request.and_then(|request| vary_guard(headers, request));
    fitted(cfg, status, headers, body, trailers, vary).unwrap_or(Completion::Tombstone { status })
}

/// Puts back the headers and body [`completion_taking`] took, once the completion is stored.
/// Either is empty only if taken or empty from the start, when the record's is empty too.
pub(crate) fn give_back(headers: &mut HeaderMap, body: &mut Bytes, completion: Completion) {
    if let Completion::Response(stored) = completion {
        if headers.is_empty() {
            *headers = stored.headers;
        }
        if body.is_empty() {
            *body = stored.body;
        }
    }
}

/// The guard for an answer with these headers, or `None` when its `Vary` names no header.
fn vary_guard(answer: &HeaderMap, request: &HeaderMap) -> Option<VaryGuard> {
    let names = vary_names(answer);
    if names.is_empty() {
        return None;
    }
    let digest = vary_digest(names.iter().map(String::as_str), request);
    Some(VaryGuard {
        names: names.join(",").into(),
        digest,
    })
}

/// Whether `request` may be given `stored`: it sends the same values of every header the
/// answer varies on. A record without a guard (recorded with Vary matching off, or an answer
/// without `Vary`) matches.
pub(crate) fn vary_matches(stored: &StoredResponse, request: &HeaderMap) -> bool {
    stored
        .vary
        .as_ref()
        .is_none_or(|g| vary_digest(g.names.split(','), request) == g.digest)
}

/// The digest of `request`'s values of `names`, each name's values in order.
fn vary_digest<'a>(names: impl Iterator<Item = &'a str>, request: &HeaderMap) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"tower-idempotency vary v1\0");
    for name in names {
        h.update((name.len() as u64).to_be_bytes());
        h.update(name.as_bytes());
        let values = request.get_all(name);
        h.update((values.iter().count() as u64).to_be_bytes());
        for v in values {
            h.update((v.len() as u64).to_be_bytes());
            h.update(v.as_bytes());
        }
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::VARY_DIGEST;
    use crate::store::record::{MAX_RECORDED_FIELDS, MAX_RECORDED_FIELD_BYTES};
    use http::{HeaderName, HeaderValue};
    use proptest::prelude::*;

    fn config(unrecorded: &[&str], vary_match: bool) -> std::sync::Arc<crate::config::Config> {
        let mut layer = crate::IdempotencyLayer::new(crate::store::MemoryStore::new())
            .with_max_response_body(std::num::NonZeroUsize::new(1 << 16).unwrap());
        for name in unrecorded {
            layer = layer.with_unrecorded_header(HeaderName::from_bytes(name.as_bytes()).unwrap());
        }
        if !vary_match {
            layer = layer.with_vary_match(false);
        }
        layer.config
    }

    fn request(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_str(auth).unwrap());
        h
    }

    fn answer_varying_on_authorization() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("vary", HeaderValue::from_static("Authorization"));
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        h
    }

    fn stored(c: Completion) -> StoredResponse {
        match c {
            Completion::Response(r) => r,
            Completion::Tombstone { .. } => panic!("a tombstone"),
        }
    }

    #[test]
    fn the_vary_guard_follows_the_answers_vary_even_when_vary_is_not_replayed() {
        let cfg = config(&["vary"], true);
        let alice = request("Bearer alice");
        let c = build(
            cfg.recording(),
            Some(&alice),
            StatusCode::CREATED,
            &answer_varying_on_authorization(),
            Bytes::from_static(b"private statement of Bearer alice"),
            None,
        );
        let r = stored(Completion::decode(Bytes::from(c.encode())).unwrap());
        assert!(!r.headers.contains_key("vary"), "the deny-list kept Vary");
        assert!(vary_matches(&r, &alice));
        assert!(!vary_matches(&r, &request("Bearer bob")));
    }

    #[test]
    fn a_vary_guard_takes_no_header_field_so_a_full_header_map_stays_readable() {
        let cfg = config(&[], true);
        let mut headers = answer_varying_on_authorization();
        for i in headers.len()..MAX_RECORDED_FIELDS {
            headers.append(
                HeaderName::from_bytes(format!("x-f{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            );
        }
        assert_eq!(headers.len(), MAX_RECORDED_FIELDS);
        let c = build(
            cfg.recording(),
            Some(&request("Bearer alice")),
            StatusCode::OK,
            &headers,
            Bytes::new(),
            None,
        );
        let r = stored(Completion::decode(Bytes::from(c.encode())).unwrap());
        assert_eq!(r.headers.len(), MAX_RECORDED_FIELDS);
        assert!(!vary_matches(&r, &request("Bearer bob")));
    }

    #[test]
    fn an_answer_varying_on_request_headers_is_refused_where_no_request_exists() {
        let cfg = config(&[], true);
        let answer = answer_varying_on_authorization();
        let body = Bytes::from_static(b"alice's statement");
        let e = completion(
            cfg.recording(),
            None,
            StatusCode::OK,
            &answer,
            body.clone(),
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Unguarded);
        assert!(
            std::error::Error::source(&e)
                .unwrap()
                .to_string()
                .contains("Vary guard"),
            "{e:?}"
        );
        // With the request's headers the guard is built; with Vary matching off, none is
        // asked for; an answer without Vary needs none.
        let alice = request("Bearer alice");
        let guarded = completion(
            cfg.recording(),
            Some(&alice),
            StatusCode::OK,
            &answer,
            body.clone(),
            None,
        );
        assert!(matches!(guarded, Ok(Completion::Response(r)) if r.vary.is_some()));
        let off = config(&[], false);
        assert!(completion(
            off.recording(),
            None,
            StatusCode::OK,
            &answer,
            body.clone(),
            None
        )
        .is_ok());
        assert!(completion(
            cfg.recording(),
            None,
            StatusCode::OK,
            &HeaderMap::new(),
            body,
            None
        )
        .is_ok());
    }

    #[test]
    fn answers_over_the_caps_or_the_body_limit_are_tombstones() {
        let cfg = config(&[], true);
        let mut many = HeaderMap::new();
        for i in 0..=MAX_RECORDED_FIELDS {
            many.append(
                HeaderName::from_bytes(format!("x-f{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            );
        }
        let big = build(
            cfg.recording(),
            None,
            StatusCode::OK,
            &many,
            Bytes::new(),
            None,
        );
        assert_eq!(
            big,
            Completion::Tombstone {
                status: StatusCode::OK
            }
        );
        let body = Bytes::from(vec![0u8; (1 << 16) + 1]);
        let c = build(
            cfg.recording(),
            None,
            StatusCode::OK,
            &HeaderMap::new(),
            body,
            None,
        );
        assert_eq!(
            c,
            Completion::Tombstone {
                status: StatusCode::OK
            }
        );
    }

    #[test]
    fn records_of_the_first_encoding_keep_their_vary_guard() {
        let alice = request("Bearer alice");
        let guard = vary_guard(&answer_varying_on_authorization(), &alice).unwrap();
        let mut headers = answer_varying_on_authorization();
        let hex = crate::store::record::hex(&guard.digest);
        headers.insert(VARY_DIGEST, HeaderValue::from_str(&hex).unwrap());
        let mut v1 = StoredResponse::new(StatusCode::OK, headers, Bytes::new(), None);
        v1.vary = None;
        let mut bytes = Completion::Response(v1).encode();
        bytes[0] = 1;
        bytes.pop(); // version 1 had no vary section
        let r = stored(Completion::decode(Bytes::from(bytes)).unwrap());
        assert!(!r.headers.contains_key(VARY_DIGEST));
        assert!(vary_matches(&r, &alice));
        assert!(!vary_matches(&r, &request("Bearer bob")));
    }

    fn header_map(max: usize) -> impl Strategy<Value = HeaderMap> {
        let field = (
            prop_oneof![
                Just("vary".to_owned()),
                Just("x-a".to_owned()),
                Just("set-cookie".to_owned()),
                Just("content-length".to_owned()),
                "[a-z]{1,12}",
            ],
            prop_oneof![
                Just("authorization, accept".to_owned()),
                Just("*".to_owned()),
                "[ -~]{0,40}",
            ],
            // Sometimes one field large enough to reach the byte cap.
            prop_oneof![9 => Just(0usize), 1 => 0usize..MAX_RECORDED_FIELD_BYTES / 2],
        );
        (prop::collection::vec(field, 0..8), 0..max).prop_map(|(fields, filler)| {
            let mut h = HeaderMap::new();
            for (name, value, pad) in fields {
                let value = format!("{value}{}", "p".repeat(pad));
                h.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(&value).unwrap(),
                );
            }
            for i in 0..filler {
                h.append(
                    HeaderName::from_bytes(format!("x-fill-{i}").as_bytes()).unwrap(),
                    HeaderValue::from_static("1"),
                );
            }
            h
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever is recorded, by the layer or a handler, decodes again or is a tombstone.
        #[test]
        fn whatever_is_recorded_decodes_or_was_tombstoned(
            headers in header_map(MAX_RECORDED_FIELDS + 8),
            trailers in prop::option::of(header_map(8)),
            request in header_map(4),
            body_len in prop_oneof![Just(0usize), 0usize..=(1 << 16) + 1],
            unrecorded_vary in any::<bool>(),
            vary_match in any::<bool>(),
        ) {
            let cfg = config(if unrecorded_vary { &["vary"] } else { &[] }, vary_match);
            let request = vary_match.then_some(&request);
            let c = build(cfg.recording(), request, StatusCode::OK, &headers, Bytes::from(vec![7; body_len]), trailers.as_ref());
            match &c {
                Completion::Tombstone { status } => prop_assert_eq!(*status, StatusCode::OK),
                Completion::Response(_) => {
                    let back = Completion::decode(Bytes::from(c.encode()));
                    prop_assert_eq!(back.as_ref().ok(), Some(&c));
                }
            }
        }
    }
}
