use super::*;

fn bulk(b: &[u8]) -> Value {
    Value::BulkString(b.to_vec())
}

fn stored(state: u8, tail: &[u8]) -> Value {
    let mut v = record::new_record(record::PLAIN, &Fingerprint::from_bytes([7; 32]), &[1; 16]);
    v[1] = state;
    v.extend_from_slice(b"0000000000009000");
    v.extend_from_slice(tail);
    bulk(&v)
}

#[test]
fn millis_round_up_and_stay_in_range() {
    assert_eq!(millis(Duration::ZERO), 1);
    assert_eq!(millis(Duration::from_micros(1)), 1);
    assert_eq!(millis(Duration::from_micros(1001)), 2);
    assert_eq!(millis(Duration::from_secs(30)), 30_000);
    assert_eq!(millis(Duration::MAX), MAX_MS);
    assert_eq!(
        format!("{:016}", MAX_MS * 2).len(),
        16,
        "fits the record's digits"
    );
}

#[test]
fn claim_replies_decode_to_outcomes() {
    let nonce = [9; 16];
    let claim = |script: Value, value: Value| parse_claim(vec![script, value], nonce);
    match claim(Value::Int(1), Value::Nil).ok().flatten().unwrap() {
        ClaimOutcome::Claimed(c) => {
            assert_eq!(c.token, Token::from_parts(1, nonce));
            assert!(!c.takeover);
        }
        other @ ClaimOutcome::Existing(_) => panic!("{other:?}"),
    }
    let takeover = Value::Array(vec![Value::Int(4), Value::Int(250)]);
    match claim(takeover, Value::Nil).ok().flatten().unwrap() {
        ClaimOutcome::Claimed(c) => {
            assert!(c.takeover);
            assert_eq!(c.lapsed_for, Some(Duration::from_millis(250)));
        }
        other @ ClaimOutcome::Existing(_) => panic!("{other:?}"),
    }
    // In progress with 1,500 ms left, by the script's clock.
    match claim(Value::Int(-1501), stored(b'p', b""))
        .ok()
        .flatten()
        .unwrap()
    {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.fingerprint, Fingerprint::from_bytes([7; 32]));
            assert_eq!(r.generation, 1);
            assert_eq!(
                r.state,
                RecordState::InProgress {
                    lease_remaining: Duration::from_millis(1500)
                }
            );
        }
        other @ ClaimOutcome::Claimed(_) => panic!("{other:?}"),
    }
    let done = Completion::Tombstone {
        status: http::StatusCode::CREATED,
    };
    match claim(Value::Int(0), stored(b'c', &done.encode()))
        .ok()
        .flatten()
        .unwrap()
    {
        ClaimOutcome::Existing(r) => assert_eq!(r.state, RecordState::Completed(done)),
        other @ ClaimOutcome::Claimed(_) => panic!("{other:?}"),
    }
    // Changed between the script and the GET: claim again.
    assert!(claim(Value::Int(-5), Value::Nil).ok().unwrap().is_none());
    assert!(claim(Value::Int(0), stored(b'p', b""))
        .ok()
        .unwrap()
        .is_none());
    let bad = |f: Failure| f.into_error().kind();
    assert_eq!(
        bad(claim(bulk(b"x"), Value::Nil).err().unwrap()),
        super::StoreErrorKind::Corrupt
    );
    assert_eq!(
        bad(parse_claim(vec![Value::Int(1)], nonce).err().unwrap()),
        super::StoreErrorKind::Corrupt
    );
}

#[test]
fn the_plain_claim_is_one_set_nx_px_get_of_the_new_record() {
    let (fp, nonce) = (Fingerprint::from_bytes([7; 32]), [9; 16]);
    let pipe = plain_claim("p:{ab}", &fp, &nonce, 30_000, 86_400_000).unwrap();
    let mut value = record::new_record(record::PLAIN, &fp, &nonce);
    value.extend_from_slice(&record::lease_gap(86_400_000 - 30_000).unwrap());
    let mut expected = redis::pipe();
    expected
        .ignore_errors()
        .cmd("SET")
        .arg("p:{ab}")
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(86_400_000u64)
        .arg("GET");
    assert_eq!(pipe.get_packed_pipeline(), expected.get_packed_pipeline());
}

#[test]
fn plain_claim_replies_decide_or_hand_over_to_the_script() {
    let nonce = [9; 16];
    let mine = Fingerprint::from_bytes([7; 32]);
    let set = |set: Value| parse_plain(vec![set], nonce, &mine).ok().unwrap();
    // The SET's reply, then (for a record in progress) the PTTL's.
    let plain = |reply: Value, pttl: i64| match set(reply) {
        Err(Fallback::Lease(value)) => plain_outcome(value, Some(&Value::Int(pttl)), nonce, &mine)
            .ok()
            .unwrap(),
        decided => decided,
    };
    // In progress, claimed by nonce [1; 16] with a gap of 9,000 ms before the key expires.
    let held = |nonce: [u8; 16]| {
        let mut v = record::new_record(record::PLAIN, &mine, &nonce);
        v.extend_from_slice(&record::lease_gap(9_000).unwrap());
        bulk(&v)
    };
    match set(Value::Nil).ok().unwrap() {
        ClaimOutcome::Claimed(c) => {
            assert_eq!(c.token, Token::from_parts(1, nonce));
            assert!(!c.takeover);
        }
        other @ ClaimOutcome::Existing(_) => panic!("{other:?}"),
    }
    // A record in progress asks for its PTTL; nothing else does.
    assert!(matches!(set(held([1; 16])), Err(Fallback::Lease(_))));
    match plain(held([1; 16]), 10_500).ok().unwrap() {
        ClaimOutcome::Existing(r) => assert_eq!(
            r.state,
            RecordState::InProgress {
                lease_remaining: Duration::from_millis(1500)
            }
        ),
        other @ ClaimOutcome::Claimed(_) => panic!("{other:?}"),
    }
    // So does one holding a recovery point (state `r`), which comes back with its point.
    let point = crate::store::RecoveryPoint::new(
        "charged",
        bytes::Bytes::from_static(b"pay_1"),
        crate::store::record::ScopeId::new(None),
        1,
    )
    .unwrap();
    let with_point = {
        let Value::BulkString(mut v) = held([1; 16]) else {
            unreachable!()
        };
        v[1] = b'r';
        v.extend_from_slice(&point.encode());
        bulk(&v)
    };
    assert!(matches!(set(with_point.clone()), Err(Fallback::Lease(_))));
    match plain(with_point, 10_500).ok().unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.recovery_point, Some(point));
            assert_eq!(
                r.state,
                RecordState::InProgress {
                    lease_remaining: Duration::from_millis(1500)
                }
            );
        }
        other @ ClaimOutcome::Claimed(_) => panic!("{other:?}"),
    }
    // Lapsed: the script takes over; another fingerprint is told, and never takes over.
    assert!(matches!(plain(held([1; 16]), 8_000), Err(Fallback::Script)));
    let theirs = Fingerprint::from_bytes([8; 32]);
    let Err(Fallback::Lease(value)) = parse_plain(vec![held([1; 16])], nonce, &theirs)
        .ok()
        .unwrap()
    else {
        panic!("no PTTL asked for")
    };
    let other = plain_outcome(value, Some(&Value::Int(8_000)), nonce, &theirs);
    assert!(matches!(other.ok().unwrap(), Ok(ClaimOutcome::Existing(_))));
    // This claim, sent again: claimed, whatever the lease, and without a PTTL.
    assert!(matches!(
        set(held(nonce)),
        Ok(ClaimOutcome::Claimed(c)) if c.token == Token::from_parts(1, nonce)
    ));
    // A deadline (an earlier version's record) needs TIME, which the PTTL does not give;
    // nor does a key gone between the SET and the PTTL: the script reads them.
    assert!(matches!(
        plain(stored(b'p', b""), 10_000),
        Err(Fallback::Script)
    ));
    assert!(matches!(plain(held([1; 16]), -2), Err(Fallback::Script)));
    let done = Completion::Tombstone {
        status: http::StatusCode::CREATED,
    };
    assert!(matches!(
        set(stored(b'c', &done.encode())),
        Ok(ClaimOutcome::Existing(r)) if r.state == RecordState::Completed(done)
    ));
    let error = |line: &str| redis::parse_redis_value(line.as_bytes()).unwrap();
    let oom = error("-OOM command not allowed when used memory > 'maxmemory'.\r\n");
    assert!(matches!(oom, Value::ServerError(_)), "{oom:?}");
    // Full: the script reads what is there. Before 7.0: the script from now on.
    assert!(matches!(set(oom), Err(Fallback::Script)));
    assert!(matches!(
        set(error("-ERR syntax error\r\n")),
        Err(Fallback::Unsupported)
    ));
    let wrong = parse_plain(
        vec![error("-WRONGTYPE Operation against a key\r\n")],
        nonce,
        &mine,
    );
    assert_eq!(
        wrong.err().unwrap().into_error().kind(),
        StoreErrorKind::Corrupt
    );
    assert!(parse_plain(vec![Value::Nil, Value::Int(1)], nonce, &mine).is_err());
}

#[test]
fn keys_carry_the_record_id_as_hash_tag() {
    let id = RecordId::new(Some("t"), "k");
    let key = record_key(DEFAULT_KEY_PREFIX, &id);
    assert_eq!(key, format!("idem:{{{}}}", id.to_hex()));
    // Redis Cluster hashes what is between the first `{` and the next `}`.
    let tag = key
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'));
    assert_eq!(tag.map(|(t, _)| t.to_owned()), Some(id.to_hex()));
    assert_ne!(record_key("a:", &id), record_key("b:", &id));
}

#[test]
fn a_calls_keys_are_the_keys_and_id_of_its_record() {
    for (scope, key) in [(None, "k"), (Some("tenant"), "k2")] {
        let id = RecordId::new(scope, key);
        let hex = id.to_hex();
        let plain = Keys::new("p:", false, &id);
        assert_eq!(plain.record, format!("p:{{{hex}}}"));
        assert_eq!(
            (plain.id(), &*plain.all()),
            (hex.as_str(), &[plain.record.as_str()][..])
        );
        let grouped = Keys::new("p:", true, &id);
        assert_eq!(grouped.record, grouped_key("p:", &hex));
        assert_eq!(grouped.id(), hex);
        let tag = &hex[..8];
        assert_eq!(
            *grouped.all(),
            [
                grouped.record.clone(),
                format!("p:{{{tag}}}s"),
                format!("p:{{{tag}}}b")
            ]
        );
    }
}

#[test]
fn grouped_keys_carry_the_scope_tag_as_hash_tag() {
    let id = RecordId::new(Some("tenant"), "k");
    let other = RecordId::new(Some("tenant"), "k2");
    let hex = id.to_hex();
    let key = grouped_key(DEFAULT_KEY_PREFIX, &hex);
    assert_eq!(key, format!("idem:{{{}}}{}", &hex[..8], &hex[8..]));
    let tag = &hex[..2 * RecordId::SCOPE_PREFIX];
    assert_eq!(tag, &ScopeId::new(Some("tenant")).to_hex()[..8]);
    let other = grouped_key(DEFAULT_KEY_PREFIX, &other.to_hex());
    assert!(
        other.starts_with(&format!("idem:{{{tag}}}")),
        "one tag for the scope's records"
    );
    assert_ne!(key, other);
}

#[tokio::test]
async fn equal_nonces_with_different_fingerprints_claim_once() {
    let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let prefix = format!(
        "tidem-unit-{}-{:?}:",
        std::process::id(),
        std::time::Instant::now()
    );
    let prefix = prefix.replace(['{', '}'], "");
    let store = RedisStore::builder()
        .with_key_prefix(prefix)
        .connect(&url)
        .await
        .unwrap();
    crate::store::equal_nonces_with_different_fingerprints_claim_once(&store).await;
}
