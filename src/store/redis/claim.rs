//! The claim: the script and the plain `SET NX` path, and the keys and replies they use.

use super::*;

/// `<prefix>{<hex id>}`: the braces make the id the cluster hash tag, whatever the prefix.
/// The hex is written straight into the key, with no string of its own.
pub(super) fn record_key(prefix: &str, id: &RecordId) -> String {
    let mut key = String::with_capacity(prefix.len() + 66);
    key.push_str(prefix);
    key.push('{');
    crate::store::record::hex_into(&mut key, id.as_bytes());
    key.push('}');
    key
}

/// `<prefix>{<scope tag>}<rest of the hex id>`: with quotas, a scope's records and its
/// counts share one hash tag (the id's first [`RecordId::SCOPE_PREFIX`] bytes, which are
/// its scope id's), so one script can touch them all on a cluster.
pub(super) fn grouped_key(prefix: &str, hex: &str) -> String {
    let (tag, rest) = hex.split_at(2 * RecordId::SCOPE_PREFIX);
    let mut key = String::with_capacity(prefix.len() + hex.len() + 2);
    key.push_str(prefix);
    key.push('{');
    key.push_str(tag);
    key.push('}');
    key.push_str(rest);
    key
}

/// Milliseconds for Redis, rounded up (a lease is never shorter than asked), 1 ms at least
/// (`PEXPIRE 0` deletes) and [`MAX_MS`] at most.
pub(super) fn millis(d: Duration) -> u64 {
    let ms = d.as_micros().div_ceil(1000);
    u64::try_from(ms).unwrap_or(MAX_MS).clamp(1, MAX_MS)
}

/// Decodes the claim pipeline's replies: the script's, then the `GET`'s. `None` when the
/// record changed between the two (deleted, or completed and claimed anew): claim again.
pub(super) fn parse_claim(
    replies: Vec<Value>,
    nonce: [u8; 16],
) -> Result<Option<ClaimOutcome>, Failure> {
    let [script, value]: [Value; 2] = replies
        .try_into()
        .map_err(|_| corrupt("claim reply count"))?;
    let n = match script {
        Value::ServerError(e) => return Err(Failure::from_redis(e.into())),
        Value::SimpleString(s) if s == "QUOTA" => {
            return Err(StoreError::new(StoreErrorKind::QuotaExceeded).into())
        }
        Value::Int(n) => n,
        Value::Array(items) => {
            // A takeover: the generation, and how long the old lease had lapsed.
            let [g, lapsed]: [Value; 2] = items
                .try_into()
                .map_err(|_| corrupt("takeover reply length"))?;
            let (Value::Int(g), Value::Int(lapsed)) = (g, lapsed) else {
                return Err(corrupt("takeover reply").into());
            };
            let lapsed = Duration::from_millis(u64::try_from(lapsed).unwrap_or(0));
            let claim = claimed(positive(g)?, nonce, Some(lapsed));
            return Ok(Some(with_point(claim, value, nonce)?));
        }
        _ => return Err(corrupt("claim reply").into()),
    };
    if n > 1 {
        // This nonce's takeover, sent again: the recovery point is still the one it took over.
        return Ok(Some(with_point(
            claimed(positive(n)?, nonce, None),
            value,
            nonce,
        )?));
    }
    if n > 0 {
        return Ok(Some(claimed(positive(n)?, nonce, None)));
    }
    let Some(value) = record::value_bytes(value)? else {
        return Ok(None);
    };
    let mut found = record::decode(value, Clock::default())?;
    match &mut found.record.state {
        RecordState::Completed(_) => {}
        // In progress: the lease left comes from the script, which read Redis's clock.
        RecordState::InProgress { lease_remaining } if n < 0 => {
            let left = n.checked_neg().map_or(0, |m| m - 1);
            *lease_remaining = Duration::from_millis(u64::try_from(left).unwrap_or(0));
        }
        RecordState::InProgress { .. } => return Ok(None),
    }
    Ok(Some(ClaimOutcome::Existing(found.record)))
}

/// A takeover's claim, handed the recovery point of the record the claim's `GET` read (only
/// a takeover pays for decoding it). Gone or changed since (another claim's nonce): none.
pub(super) fn with_point(
    claim: ClaimOutcome,
    value: Value,
    nonce: [u8; 16],
) -> Result<ClaimOutcome, Failure> {
    let ClaimOutcome::Claimed(claim) = claim else {
        return Ok(claim);
    };
    let point = match record::value_bytes(value)? {
        Some(v) => {
            let found = record::decode(v, Clock::default())?;
            (found.nonce == nonce)
                .then_some(found.record.recovery_point)
                .flatten()
        }
        None => None,
    };
    Ok(ClaimOutcome::Claimed(claim.with_recovery_point(point)))
}

pub(super) fn positive(n: i64) -> Result<u64, StoreError> {
    u64::try_from(n)
        .ok()
        .filter(|&g| g > 0)
        .ok_or_else(|| corrupt("claimed generation"))
}

/// A claim this store's nonce holds. Every fresh record starts at generation 1, so a higher
/// one was a takeover.
pub(super) fn claimed(
    generation: u64,
    nonce: [u8; 16],
    lapsed_for: Option<Duration>,
) -> ClaimOutcome {
    let token = Token::from_parts(generation, nonce);
    ClaimOutcome::Claimed(if generation > 1 {
        Claim::takeover(token, lapsed_for)
    } else {
        Claim::first(token)
    })
}

impl RedisStore {
    /// Claims `id`, counted against `scope`'s quota when one is given.
    ///
    /// Where no quota applies and Redis takes `SET … NX GET` (7.0 and later), the claim is one
    /// plain command (see [`plain_claim`]); the script runs only to take over a lapsed lease,
    /// and when Redis is full (it refuses the `SET`, and the script still reads what is there).
    pub(super) async fn claim_as(
        &self,
        scope: Option<&ScopeId>,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let keys = self.keys(id);
        let key = keys.record.as_str();
        // The nonce is made here, so a claim whose reply is lost can be recognised.
        let nonce = *Token::generate(0)?.nonce();
        let (lease_ms, keep_ms) = (millis(lease), millis(ttl.max(lease)));
        let lua = &self.inner.scripts.claim;
        let mut plain = (keys.group.is_none() && self.inner.plain_claims.load(Ordering::Relaxed))
            .then(|| plain_claim(key, fingerprint, &nonce, lease_ms, keep_ms))
            .flatten();
        let mut script = None;
        let mut lost = None;
        // Three sends at most, plus the switch from the plain claim to the script.
        for _ in 0..4 {
            let parsed = if let Some(pipe) = &plain {
                let mut decided = self
                    .send(pipe, lua, key)
                    .await
                    .and_then(|replies| parse_plain(replies, nonce, fingerprint));
                if let Ok(Err(Fallback::Lease(value))) = decided {
                    // A record in progress: its lease left is its key's PTTL less the gap.
                    // Read alone and only here, so a new key and a replay cost Redis the
                    // SET alone. The record may change between the two (completed, say):
                    // the PTTL then misstates the lease, which only decides the Retry-After
                    // hint or hands a lapse to the script, which reads again atomically.
                    decided = self.send(&pttl(key), lua, key).await.and_then(|replies| {
                        plain_outcome(value, replies.first(), nonce, fingerprint)
                    });
                }
                match decided {
                    Ok(Ok(outcome)) => Ok(Some(outcome)),
                    // The PTTL did not tell the lease (see plain_outcome).
                    Ok(Err(Fallback::Lease(_) | Fallback::Script)) => {
                        plain = None;
                        continue;
                    }
                    Ok(Err(Fallback::Unsupported)) => {
                        self.inner.plain_claims.store(false, Ordering::Relaxed);
                        plain = None;
                        continue;
                    }
                    Err(f) => Err(f),
                }
            } else {
                let pipe = script.get_or_insert_with(|| {
                    self.claim_script(&keys, scope, fingerprint, &nonce, lease_ms, keep_ms)
                });
                self.send(pipe, lua, key)
                    .await
                    .and_then(|replies| parse_claim(replies, nonce))
            };
            let outcome = match parsed {
                Ok(Some(outcome)) => outcome,
                // The record changed between the script and the GET: ask again.
                Ok(None) => continue,
                Err(Failure::Certain(e)) => return Err(e),
                Err(Failure::Uncertain(e)) => match self.read(key).await {
                    Ok(Some(found))
                        if found.nonce == nonce
                            && !found.completed()
                            && found.record.fingerprint == *fingerprint =>
                    {
                        // Read back after a lost reply: the lapse is no longer known.
                        match claimed(found.record.generation, nonce, None) {
                            ClaimOutcome::Claimed(c) if c.takeover => ClaimOutcome::Claimed(
                                c.with_recovery_point(found.record.recovery_point),
                            ),
                            other => other,
                        }
                    }
                    Ok(Some(found)) => ClaimOutcome::Existing(found.record),
                    // The claim never arrived (the read went after it on the same
                    // connection): send it again. It is idempotent for this nonce.
                    Ok(None) => {
                        lost = Some(e);
                        continue;
                    }
                    Err(_) => return Err(StoreError::with_source(StoreErrorKind::Unknown, e)),
                },
            };
            if let ClaimOutcome::Claimed(claim) = &outcome {
                if let Err(e) = self.replicate_claim(&keys, &claim.token, lease).await {
                    // Not durable: give the key back so a retry need not wait out the lease.
                    let _ = self.release(id, &claim.token).await;
                    return Err(e);
                }
            }
            return Ok(outcome);
        }
        Err(unknown(lost))
    }

    /// The claim script, with a `GET` of the record pipelined after it.
    pub(super) fn claim_script(
        &self,
        keys: &Keys,
        scope: Option<&ScopeId>,
        fingerprint: &Fingerprint,
        nonce: &[u8; 16],
        lease_ms: u64,
        keep_ms: u64,
    ) -> Pipeline {
        let format = if scope.is_some() {
            record::SCOPED
        } else {
            record::PLAIN
        };
        let new = record::new_record(format, fingerprint, nonce);
        let (lease_ms, keep_ms) = (lease_ms.to_string(), keep_ms.to_string());
        let mut args: Vec<&[u8]> = vec![&new, lease_ms.as_bytes(), keep_ms.as_bytes()];
        let (hex, records, bytes);
        if keys.group.is_some() {
            // With quotas every record lives in its scope group, counted or not ('' scope).
            hex = scope.map(ScopeId::to_hex).unwrap_or_default();
            records = self.inner.quotas.records.to_string();
            bytes = self.inner.quotas.bytes.to_string();
            args.extend([hex.as_bytes(), records.as_bytes(), bytes.as_bytes()]);
            args.push(keys.id().as_bytes());
        }
        let call = self.inner.scripts.claim.call(&keys.all(), &args);
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(call)
            .cmd("GET")
            .arg(&keys.record);
        pipe
    }
}

/// The plain claim: `SET key <record> NX PX keep GET`, one command. It writes a new record
/// only where there is none, and answers what was there before, so it both claims and reads:
/// a new key and a replay need nothing else. A record in progress needs its key's `PTTL`
/// too, read after it (see [`plain_outcome`]). `None` for a gap too long for the record
/// (over 31,000 years: see [`record::lease_gap`]), which the script writes as a deadline.
///
/// The client writes the record, so it cannot stamp a lease deadline by Redis's clock: the
/// lease field holds `keep - lease`, the ms by which the lease ends before the key, set to
/// expire `keep` after Redis runs the `SET`. A reader's lease left is then `PTTL - gap`, all
/// by Redis's clock (see the [record format](record)).
pub(super) fn plain_claim(
    key: &str,
    fingerprint: &Fingerprint,
    nonce: &[u8; 16],
    lease_ms: u64,
    keep_ms: u64,
) -> Option<Pipeline> {
    let gap = record::lease_gap(keep_ms - lease_ms)?;
    let mut value = record::new_record(record::PLAIN, fingerprint, nonce);
    value.extend_from_slice(&gap);
    // Sized once, as `Lua::call` is: 7 arguments, `keep_ms` at most 20 digits.
    let mut set = redis::Cmd::with_capacity(7, "SETNXPXGET".len() + key.len() + value.len() + 20);
    set.arg("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(keep_ms)
        .arg("GET");
    let mut pipe = redis::pipe();
    pipe.ignore_errors().add_command(set);
    Some(pipe)
}

/// `PTTL key`: the lease left of a record in progress the plain claim answered.
pub(super) fn pttl(key: &str) -> Pipeline {
    let mut pipe = redis::pipe();
    pipe.ignore_errors().cmd("PTTL").arg(key);
    pipe
}

/// Why a plain claim's replies decide nothing.
pub(super) enum Fallback {
    /// Ask the claim script: a lapsed lease to take over, a full Redis, or a lease this
    /// reply cannot tell (a record written by an earlier version, or the key gone meanwhile).
    Script,
    /// Redis refused the syntax (before 7.0): the script from now on.
    Unsupported,
    /// A record in progress (the `SET`'s reply): decided once its key's `PTTL` is read.
    Lease(bytes::Bytes),
}

/// Decodes the plain claim's reply: the record that was there, if any.
pub(super) fn parse_plain(
    replies: Vec<Value>,
    nonce: [u8; 16],
    fingerprint: &Fingerprint,
) -> Result<Result<ClaimOutcome, Fallback>, Failure> {
    let [set]: [Value; 1] = replies
        .try_into()
        .map_err(|_| corrupt("claim reply count"))?;
    let value = match set {
        // Absent, and now ours: every fresh record starts at generation 1.
        Value::Nil => return Ok(Ok(claimed(1, nonce, None))),
        Value::BulkString(b) => bytes::Bytes::from(b),
        // Full: the SET wrote nothing, and the script still reads what is there.
        Value::ServerError(e) if e.code() == "OOM" => return Ok(Err(Fallback::Script)),
        Value::ServerError(e)
            if e.code() == "ERR" && e.details().is_some_and(|d| d.contains("syntax")) =>
        {
            return Ok(Err(Fallback::Unsupported))
        }
        Value::ServerError(e) => return Err(Failure::from_redis(e.into())),
        _ => return Err(corrupt("claim reply").into()),
    };
    plain_outcome(value, None, nonce, fingerprint)
}

/// What the record a plain claim found means for it. `pttl`: the key's `PTTL` reply, read
/// after the `SET` for a record in progress; `None` before it is read.
pub(super) fn plain_outcome(
    value: bytes::Bytes,
    pttl: Option<&Value>,
    nonce: [u8; 16],
    fingerprint: &Fingerprint,
) -> Result<Result<ClaimOutcome, Fallback>, Failure> {
    let clock = Clock {
        now_ms: None,
        pttl_ms: pttl.and_then(Clock::pttl),
    };
    let found = record::decode(value.clone(), clock)?;
    let RecordState::InProgress { lease_remaining } = found.record.state else {
        return Ok(Ok(ClaimOutcome::Existing(found.record)));
    };
    let same = found.record.fingerprint == *fingerprint;
    if same && found.nonce == nonce {
        // This claim, sent again after a lost reply (equal nonces alone never prove it).
        return Ok(Ok(match claimed(found.record.generation, nonce, None) {
            ClaimOutcome::Claimed(c) if c.takeover => {
                ClaimOutcome::Claimed(c.with_recovery_point(found.record.recovery_point))
            }
            other => other,
        }));
    }
    if !found.lease_known {
        // Read the PTTL first. Still unknown after it: a deadline (an earlier version's
        // record, which needs Redis's TIME) or a key gone meanwhile; the script reads it.
        return Ok(Err(match pttl {
            None => Fallback::Lease(value),
            Some(_) => Fallback::Script,
        }));
    }
    if same && lease_remaining.is_zero() {
        // Lapsed: only the script can take over, atomically and by Redis's clock.
        return Ok(Err(Fallback::Script));
    }
    Ok(Ok(ClaimOutcome::Existing(found.record)))
}
