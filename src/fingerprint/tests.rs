//! Whole requests: what is hashed besides the body, media types and content codings, gRPC,
//! and form bodies.

use super::*;

pub(super) fn canonical_form(body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    canonical_form_into(body, &mut out).then_some(out)
}

fn fp(
    build: impl FnOnce(http::request::Builder) -> http::request::Builder,
    body: &[u8],
) -> Fingerprint {
    let (parts, ()) = build(http::Request::post("/v1/things"))
        .body(())
        .unwrap()
        .into_parts();
    fingerprint(&parts, &parts.uri, body, &Fingerprinting::default())
}

fn grpc_fp(path: &str, content_type: &str, encoding: Option<&str>, body: &[u8]) -> Fingerprint {
    let mut req = http::Request::post(path).header("content-type", content_type);
    if let Some(e) = encoding {
        req = req.header("grpc-encoding", e);
    }
    let (parts, ()) = req.body(()).unwrap().into_parts();
    fingerprint(&parts, &parts.uri, body, &Fingerprinting::default())
}

#[test]
fn grpc_fingerprints_cover_path_raw_frames_and_grpc_encoding() {
    let frame = b"\0\0\0\0\x02\x08\x01";
    let p = "/shop.v1.Payments/CreatePayment";
    let base = grpc_fp(p, "application/grpc", None, frame);
    assert_eq!(
        base,
        grpc_fp(p, "application/grpc", Some("identity"), frame)
    );
    assert_ne!(base, grpc_fp(p, "application/grpc", Some("gzip"), frame));
    assert_ne!(
        base,
        grpc_fp("/shop.v1.Payments/Refund", "application/grpc", None, frame)
    );
    assert_ne!(
        base,
        grpc_fp(p, "application/grpc", None, b"\0\0\0\0\x02\x08\x02")
    );
    // `+json` frames are hashed raw: another spacing is another request.
    let a = grpc_fp(p, "application/grpc+json", None, b"\0\0\0\0\x02{}");
    let b = grpc_fp(p, "application/grpc+json", None, b"\0\0\0\0\x03{ }");
    assert_ne!(a, b);
}

#[test]
fn the_target_uri_is_hashed_not_the_one_in_parts() {
    let (parts, ()) = http::Request::post("/inner").body(()).unwrap().into_parts();
    let cfg = Fingerprinting::default();
    let outer: Uri = "/api/inner?x=1".parse().unwrap();
    assert_ne!(
        fingerprint(&parts, &parts.uri, b"", &cfg),
        fingerprint(&parts, &outer, b"", &cfg)
    );
    let (other, ()) = http::Request::post("/elsewhere")
        .body(())
        .unwrap()
        .into_parts();
    assert_eq!(
        fingerprint(&parts, &outer, b"", &cfg),
        fingerprint(&other, &outer, b"", &cfg)
    );
}

#[test]
fn media_type_parameters_count_normalised() {
    let ct = |v: &'static str| move |b: http::request::Builder| b.header("content-type", v);
    let form = b"a=%E9";
    let latin1 = fp(
        ct("application/x-www-form-urlencoded; charset=ISO-8859-1"),
        form,
    );
    let utf8 = fp(ct("application/x-www-form-urlencoded; charset=utf-8"), form);
    assert_ne!(latin1, utf8);
    assert_ne!(utf8, fp(ct("application/x-www-form-urlencoded"), form));
    // Case of names and of charset values, quoting, spacing and order do not count.
    assert_eq!(
        latin1,
        fp(
            ct("Application/X-WWW-Form-URLEncoded;CHARSET=\"iso-8859-1\""),
            form
        )
    );
    let json = br#"{"a":1}"#;
    assert_eq!(
        fp(ct("application/json; charset=utf-8; v=2"), json),
        fp(
            ct("application/json;v=2 ;  Charset=UTF-8"),
            br#"{ "a" : 1 }"#
        )
    );
    // Other values keep their case: a multipart boundary is case-sensitive.
    assert_ne!(
        fp(ct("multipart/form-data; boundary=AbC"), b"x"),
        fp(ct("multipart/form-data; boundary=abc"), b"x")
    );
    // Repeated parameters keep their order.
    assert_ne!(
        fp(ct("text/plain; p=1; p=2"), b"x"),
        fp(ct("text/plain; p=2; p=1"), b"x")
    );
    // Absent, unparsable and several field lines are each their own.
    let none = fp(|b| b, b"x");
    let bad = fp(ct("text/plain; ="), b"x");
    let two = fp(
        |b| {
            b.header("content-type", "text/plain")
                .header("content-type", "text/html")
        },
        b"x",
    );
    assert_ne!(none, bad);
    assert_ne!(bad, two);
    assert_ne!(none, fp(ct("text/plain"), b"x"));
}

#[test]
fn content_encoding_counts_and_encoded_bodies_are_hashed_raw() {
    let json = |enc: Option<&'static str>, body: &'static [u8]| {
        fp(
            move |b| {
                let b = b.header("content-type", "application/json");
                match enc {
                    Some(e) => b.header("content-encoding", e),
                    None => b,
                }
            },
            body,
        )
    };
    let plain = json(None, br#"{"a":1}"#);
    assert_eq!(plain, json(Some("identity"), br#"{"a":1}"#));
    assert_ne!(plain, json(Some("gzip"), br#"{"a":1}"#));
    assert_eq!(json(Some("GZip, br"), b"x"), json(Some("gzip,br"), b"x"));
    assert_ne!(json(Some("gzip, br"), b"x"), json(Some("br, gzip"), b"x"));
    // Under a coding the bytes are not the JSON they decode to: no canonicalising.
    assert_eq!(plain, json(None, br#"{ "a": 1 }"#));
    assert_ne!(
        json(Some("x-custom"), br#"{"a":1}"#),
        json(Some("x-custom"), br#"{ "a": 1 }"#)
    );
}

#[test]
fn form_pairs_sort_by_name_only_and_bad_escapes_fall_back() {
    assert_eq!(
        canonical_form(b"b=2&a=1+x"),
        canonical_form(b"a=1%20x&&b=2")
    );
    assert_ne!(canonical_form(b"a=1&b=2"), canonical_form(b"a=2&b=1"));
    // Values keep their order within a name.
    assert_ne!(canonical_form(b"a=1&a=2"), canonical_form(b"a=2&a=1"));
    assert_eq!(
        canonical_form(b"a=1&b=0&a=2"),
        canonical_form(b"b=0&a=1&a=2")
    );
    assert_eq!(canonical_form(b"a=%zz"), None);
    assert_eq!(canonical_form(b"a=%2"), None);
    assert_eq!(canonical_form(b"a=%"), None);
    // Pairs are length-prefixed: "a=b&c" differs from "a=b%26c".
    assert_ne!(canonical_form(b"a=b&c"), canonical_form(b"a=b%26c"));
}

#[test]
fn a_form_body_fingerprints_alike_after_a_large_unsorted_json_body_on_the_same_thread() {
    let form =
        |b: http::request::Builder| b.header("content-type", "application/x-www-form-urlencoded");
    let fresh = std::thread::scope(|s| s.spawn(|| fp(form, b"a=1&b=2")).join().unwrap());
    // An outermost object out of order and past the deferred-sort size leaves its members'
    // ranges in the thread's buffers.
    let json = format!(r#"{{ "b": "{}", "a": 1 }}"#, "x".repeat(8192));
    let json_fp = |b: http::request::Builder| b.header("content-type", "application/json");
    let _ = fp(json_fp, json.as_bytes());
    assert_eq!(fp(form, b"a=1&b=2"), fresh);
}

#[test]
fn a_route_only_fingerprint_covers_method_and_target_and_never_equals_a_full_one() {
    let route = Fingerprinting {
        route_only: true,
        ..Fingerprinting::default()
    };
    let of = |method: &str, target: &str, ct: &str, body: &[u8], config: &Fingerprinting| {
        let (parts, ()) = http::Request::builder()
            .method(method)
            .uri(target)
            .header("content-type", ct)
            .body(())
            .unwrap()
            .into_parts();
        fingerprint(&parts, &parts.uri, body, config)
    };
    let base = of(
        "POST",
        "/hooks/a",
        "application/json",
        br#"{"n":1}"#,
        &route,
    );
    assert_eq!(base, of("POST", "/hooks/a", "text/plain", b"other", &route));
    assert_ne!(
        base,
        of(
            "POST",
            "/hooks/b",
            "application/json",
            br#"{"n":1}"#,
            &route
        )
    );
    assert_ne!(
        base,
        of(
            "POST",
            "/hooks/a?x=1",
            "application/json",
            br#"{"n":1}"#,
            &route
        )
    );
    assert_ne!(
        base,
        of("PUT", "/hooks/a", "application/json", br#"{"n":1}"#, &route)
    );
    let full = Fingerprinting::default();
    for body in [&b""[..], br#"{"n":1}"#] {
        assert_ne!(base, of("POST", "/hooks/a", "", body, &full));
    }
}

#[test]
fn a_routes_remembered_head_hashes_what_a_fresh_one_does() {
    // More routes than a thread keeps, each twice: misses, then hits and replacements.
    let paths: Vec<String> = (0..3 * HEADS_KEPT)
        .map(|i| format!("/v1/accounts/{i}/payments?expand=charges"))
        .chain(["/".to_owned(), "/x".repeat(80)])
        .collect();
    for round in 0..2 {
        for path in &paths {
            for (route_only, prefix) in [
                (false, &b"tower-idempotency fingerprint v2\0"[..]),
                (true, b"tower-idempotency fingerprint v2 route-only\0"),
            ] {
                let mut want = Hasher(Sha256::new());
                want.0.update(prefix);
                want.field(b"POST");
                want.field(path.as_bytes());
                let len = prefix.len() + 16 + 4 + path.len();
                want.0.update(vec![0u8; (64 - len % 64) % 64]);
                let got = head(route_only, "POST", path).0.finalize();
                assert_eq!(got, want.0.finalize(), "round {round}, {path}");
            }
        }
    }
}

#[test]
fn a_json_fingerprint_keeps_its_value() {
    // Stores keep fingerprints: a release that changed one would refuse every retry of a
    // request recorded before it.
    let (parts, ()) = http::Request::post("/v1/payments")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let body = br#"{"currency": "eur", "amount": 1999}"#;
    let mut want = Hasher(Sha256::new());
    want.0.update(b"tower-idempotency fingerprint v2\0");
    want.field(b"POST");
    want.field(b"/v1/payments");
    // 33 + 12 + 20 = 65 bytes of head: zeros up to two blocks.
    want.0.update([0u8; 63]);
    let mut media = b"m".to_vec();
    framing::frame(&mut media, b"application/json");
    want.field(&media);
    want.field(b"");
    want.field(b"jcs");
    want.field(br#"{"amount":1999,"currency":"eur"}"#);
    let want = Fingerprint::from_bytes(want.0.finalize().into());
    for _ in 0..2 {
        let got = fingerprint(&parts, &parts.uri, body, &Fingerprinting::default());
        assert_eq!(got, want);
    }
}

#[test]
fn media_type_fingerprints_keep_their_values() {
    // Pinned digests, one per way a `Content-Type` is read: a change to how media types are
    // normalised must not move a recorded fingerprint.
    let cases: &[(&[&str], &[u8])] = &[
        (&[], b"abc"),
        (&["application/json"], br#"{"b": 1, "a": [true, null]}"#),
        (&["Application/JSON ; Charset=UTF-8"], br#"{"a": 1}"#),
        (&["application/problem+json"], br#"{"a": 1}"#),
        (
            &["application/json; a=1; B=\"x \\\"y\\\"\"; ;"],
            br#"{"a": 1}"#,
        ),
        (&["application/x-www-form-urlencoded"], b"b=2&a=1"),
        (
            &["application/x-www-form-urlencoded; charset=ISO-8859-1"],
            b"a=%E9",
        ),
        (&["text/plain; charset=\"UTF-8\"; format=flowed"], b"hi"),
        (&["text/plain; charset=\"unterminated"], b"hi"),
        (&["no-slash"], b"{}"),
        (&["application/json", "text/plain"], b"{}"),
        (&["application/json;x"], b"{}"),
    ];
    let want = [
        "86e247d0c2b31de4916ebb52e053bf03d256b79616ec7cb4de40161e21da46fd",
        "03704a37a34808fa7f5d66c7c1c42be4c5328f51db38e7d25239d8600639979a",
        "315c5d2cbdf4028eadc495218fff5c339aecbbd7b6716820b19719c54228615c",
        "c02721e098245ec199b7310f25cf76a0b6d213e1fda5dca09d9421d310738699",
        "82a03f96cbe8b75b2a4e3d4bdd37024af643e1886e42c0b5535f2c0d5bf76a89",
        "7ebbc2aeb711b43dbe3e364163541853d96116f2c2d2a0515fb46d7698a0ded8",
        "51ef12e744be9c58d5a9e6d789cb0055c2957c8927934dcf1822d8cbe49d69ca",
        "43ac0f6121186c8c2fbc021e0afdf306089b6b3d5305e2bd4216b32468242ac8",
        "53112ce72f375398ca001f327a961d3c34d6f4e164805bfa9ea76963305b249b",
        "77cad5e6228767f9f5e99ddacc3eec1a564ebc18192b414d3802ef2bea11c879",
        "b3e84c8780e7d0b1fc1b39e6b9ceef278b95385d6dfe0b4b357ba50dfa3432e7",
        "9ed4ad982c505c7b2f550025cc57ef60bed994630f50ee31d2d615e0f65eeb2c",
    ];
    let got: Vec<String> = cases
        .iter()
        .map(|(types, body)| {
            let mut req = http::Request::post("/v1/things");
            for t in *types {
                req = req.header("content-type", *t);
            }
            let (parts, ()) = req.body(()).unwrap().into_parts();
            let fp = fingerprint(&parts, &parts.uri, body, &Fingerprinting::default());
            crate::record::hex(fp.as_bytes())
        })
        .collect();
    assert_eq!(got, want, "{got:#?}");
}
