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
        .chain(["/".to_owned(), "/x".repeat(80), "/y".repeat(200)])
        .collect();
    // Header lines as the head reads them, each with the media field and kind it must give:
    // a kept head must not take another's because only its headers differ.
    let json = |media: &str| {
        let mut m = b"m".to_vec();
        framing::frame(&mut m, media.as_bytes());
        m
    };
    type Case<'a> = (Vec<(&'a str, &'a str)>, Vec<u8>, &'a [u8], BodyKind);
    let cases: Vec<Case<'_>> = vec![
        (vec![], vec![], b"", BodyKind::Raw),
        (
            vec![("content-type", "application/json")],
            json("application/json"),
            b"",
            BodyKind::Json,
        ),
        (
            vec![("content-type", "Application/JSON")],
            json("application/json"),
            b"",
            BodyKind::Json,
        ),
        (
            vec![
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            json("application/json"),
            b"\0\0\0\0\0\0\0\x04gzip",
            BodyKind::Raw,
        ),
        (
            vec![("content-type", "application/grpc")],
            json("application/grpc"),
            b"",
            BodyKind::Grpc,
        ),
    ];
    for round in 0..2 {
        for path in &paths {
            for (lines, media, codings, kind) in &cases {
                let mut headers = HeaderMap::new();
                for (name, value) in lines {
                    headers.append(*name, value.parse().unwrap());
                }
                for route_only in [false, true] {
                    let prefix: &[u8] = if route_only {
                        b"tower-idempotency fingerprint v3 route-only\0"
                    } else {
                        b"tower-idempotency fingerprint v3\0"
                    };
                    let mut want = Hasher(Sha256::new());
                    want.0.update(prefix);
                    want.field(b"POST");
                    want.field(path.as_bytes());
                    let mut len = prefix.len() + 16 + 4 + path.len();
                    if !route_only {
                        want.field(media);
                        want.field(codings);
                        len += 16 + media.len() + codings.len();
                    }
                    want.0.update(vec![0u8; (64 - len % 64) % 64]);
                    let got = head(route_only, "POST", path, &headers);
                    assert_eq!(
                        got.h.0.finalize(),
                        want.0.finalize(),
                        "round {round}, {path}, {lines:?}"
                    );
                    if !route_only {
                        assert_eq!(got.kind, *kind, "{lines:?}");
                    }
                }
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
    want.0.update(b"tower-idempotency fingerprint v3\0");
    want.field(b"POST");
    want.field(b"/v1/payments");
    let mut media = b"m".to_vec();
    framing::frame(&mut media, b"application/json");
    want.field(&media);
    want.field(b"");
    // 33 + 12 + 20 + 33 + 8 = 106 bytes of head: zeros up to two blocks.
    want.0.update([0u8; 22]);
    want.0.update(b"j");
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
        "aa86b1e9b0e8d77068d034ad0a7ab7b165d81fa6bf6206b89419931d81f32776",
        "65a39fa0ff5c59d6190983510a71284fa68f463cdbe4e2a1527c6be057a9abd6",
        "3beecd6719c4165ae26952c8d789085c9d92ebaf873eb0780d5f2368bb89f0f6",
        "cc40ad630b3674b26b940979711655f307781934119ddcd5df7227b8baad8c65",
        "fadd46c1cdabf97739acd0232b8218192f89d96c3da08896270e09257a3b6ace",
        "fd0f8fef92774f743419c747255441f29d98da2f4762330368ab4abc97bd142a",
        "204750b3857afb2d7fd3a74f4ed906396a022ae524d62ea15aafbb838650e0a2",
        "8abd3a5f0b56373ed15f3fe0a71c0d84dce8c1ec2592208d403ddc35144cdfbd",
        "6e17caad73076b94faf107d9f625ffeacecd206f209b11d42e0953e1fb667cd3",
        "0f0c174ba275505848f3adbd15c3e940acf05b6ecea69da0450e4c99569bba78",
        "4134080d67552a3825b1de5830741ac8600229dd244b8370c7b90a310f1ca649",
        "9fe3553c68a674ba11c3d36b76f119125b98c75b345205a0934a82c2e3e99fcc",
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
            crate::store::record::hex(fp.as_bytes())
        })
        .collect();
    assert_eq!(got, want, "{got:#?}");
}
