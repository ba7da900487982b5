//! The operations: the [`IdempotencyStore`] and [`IdempotencyAdmin`] implementations, one
//! statement each (claim.sql, extend.sql, complete.sql, release.sql, get.sql; save_point.sql
//! and recoverable.sql for recovery points; inspect.sql and remove.sql for operators).

use std::time::Duration;

use async_trait::async_trait;
use tokio_postgres::types::ToSql;

use super::retry::Attempts;
use super::rows::{
    column, corrupt, decode_called, decode_claim, decode_new, decode_record, micros, token_params,
    ClaimRead, CompleteParams, CorruptRow, IN_PROGRESS,
};
use super::PostgresStore;
use crate::store::record::{Completion, Fingerprint, Record, RecordId, ScopeId, Token};
use crate::store::RecoveryPoint;
use crate::store::{
    ClaimOutcome, ClaimRequest, IdempotencyAdmin, IdempotencyStore, RecordInfo, Removal,
    StoreError, StoreErrorKind,
};

#[async_trait]
impl IdempotencyStore for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn invalidations(
        &self,
    ) -> Option<tokio::sync::broadcast::Receiver<crate::store::Invalidation>> {
        self.feed()
    }

    /// With per-scope quotas the claim counts the request's scope's records first; without
    /// quotas the scope is not read.
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let r = request;
        let scope = r.scope.filter(|_| self.quota.is_on());
        self.claim_as(scope, r.id, r.fingerprint, r.lease, r.ttl)
            .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        // Repeating an extend is harmless: its answer is right either way.
        let (generation, nonce) = token_params(token);
        let lease = micros(lease);
        let params: [&(dyn ToSql + Sync); 4] =
            [&id.as_bytes().as_slice(), &generation, &nonce, &lease];
        let rows = self.run(&self.sql.extend, &params, false).await?;
        if rows.is_empty() {
            return Err(StoreError::new(StoreErrorKind::Fenced));
        }
        Ok(())
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        completion: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let owned = CompleteParams::new(id, token, completion, ttl);
        let params = owned.params();
        let mut attempts = Attempts::new(self, false);
        loop {
            let deadline = attempts.deadline()?;
            match self.attempt(&self.sql.complete, &params, deadline).await {
                Ok(rows) => {
                    let row = rows
                        .first()
                        .ok_or_else(|| corrupt(CorruptRow("complete returned no row")))?;
                    let applied: bool = column(row, "applied")?;
                    // Completed with our token already: a resend, or our lost first attempt
                    // committed. Either way our answer is stored.
                    let done: bool = column(row, "done")?;
                    if applied || done {
                        return Ok(());
                    }
                    return match self.held(id, token, attempts.end).await? {
                        Some((true, state)) if state != IN_PROGRESS => Ok(()),
                        _ => Err(StoreError::new(StoreErrorKind::Fenced)),
                    };
                }
                Err(f) => attempts.after(f).await?,
            }
        }
    }

    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        let (generation, nonce) = token_params(token);
        // What a takeover's record holds once this token released it (release.sql).
        let released = token.released();
        let params: [&(dyn ToSql + Sync); 4] = [
            &id.as_bytes().as_slice(),
            &generation,
            &nonce,
            &released.nonce().as_slice(),
        ];
        let mut attempts = Attempts::new(self, false);
        loop {
            let deadline = attempts.deadline()?;
            match self.attempt(&self.sql.release, &params, deadline).await {
                Ok(rows) => {
                    let row = rows
                        .first()
                        .ok_or_else(|| corrupt(CorruptRow("release returned no row")))?;
                    let applied: bool = column(row, "applied")?;
                    // Kept by an earlier attempt of this release (a takeover's record).
                    let done: bool = column(row, "done")?;
                    // Gone already: an earlier attempt deleted it, or it expired; the key is
                    // free either way.
                    let present: bool = column(row, "present")?;
                    if applied || done || !present {
                        return Ok(());
                    }
                    // A fresh look: an earlier attempt may have committed after this
                    // statement's snapshot, deleting the record or keeping it released.
                    return match self.held(id, &released, attempts.end).await? {
                        None => Ok(()),
                        Some((true, IN_PROGRESS)) => Ok(()),
                        Some(_) => Err(StoreError::new(StoreErrorKind::Fenced)),
                    };
                }
                Err(f) => attempts.after(f).await?,
            }
        }
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        let rows = self
            .run(&self.sql.get, &[&id.as_bytes().as_slice()], true)
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let record = decode_record(row)?;
        // A completed record's time left, by the database's clock.
        let left: Option<i64> = column(row, "ttl_us")?;
        Ok(Some(match left {
            Some(us) => {
                record.with_expires_in(Duration::from_micros(u64::try_from(us).unwrap_or(0)))
            }
            None => record,
        }))
    }

    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        let encoded = point.encode();
        // `RecoveryPoint::new` enforces the caps; the column itself has no constraint.
        if encoded.len() > RecoveryPoint::MAX_ENCODED {
            return Err(StoreError::with_source(
                StoreErrorKind::TooLarge,
                format!(
                    "the recovery point is {} bytes encoded, over the cap of {} bytes; \
                     nothing was saved",
                    encoded.len(),
                    RecoveryPoint::MAX_ENCODED
                ),
            ));
        }
        // Like extend: a resend writes the same point again, so a lost reply needs no
        // read-back, and zero rows is a stale token.
        let (generation, nonce) = token_params(token);
        let params: [&(dyn ToSql + Sync); 4] = [
            &id.as_bytes().as_slice(),
            &generation,
            &nonce,
            &encoded.as_slice(),
        ];
        let rows = self.run(&self.sql.save_point, &params, false).await?;
        if rows.is_empty() {
            return Err(StoreError::new(StoreErrorKind::Fenced));
        }
        Ok(())
    }

    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let most = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.run(&self.sql.recoverable, &[&most], true).await?;
        let mut found = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: Vec<u8> = column(row, "id")?;
            let Ok(id) = <[u8; 32]>::try_from(id.as_slice()).map(RecordId::from_bytes) else {
                return Err(corrupt(CorruptRow("id is not 32 bytes")));
            };
            match decode_record(row) {
                Ok(record) => found.push((id, record)),
                // One bad row must not stop every sweep: left for an operator.
                Err(e) if e.kind() == StoreErrorKind::Corrupt => {
                    tracing::warn!(record = %&id.to_hex()[..16], error = %e, "corrupt record among the recoverable, skipped");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(found)
    }
}

impl PostgresStore {
    /// The claim (claim.sql), counted against `scope`'s quota when there is one.
    async fn claim_as(
        &self,
        scope: Option<&ScopeId>,
        id: &RecordId,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        // Our nonce, chosen before sending: it is how a read-back recognises our claim.
        let nonce = *Token::generate(0)?.nonce();
        let (lease, ttl) = (micros(lease), micros(ttl));
        let scope_bytes = scope.map(|s| s.as_bytes().as_slice());
        // Without a scope the limits are not used: pass none, so the function skips the
        // quota whatever the store's settings.
        let (records, bytes) = match scope {
            Some(_) => (self.quota.records, self.quota.bytes),
            None => (None, None),
        };
        let params: [&(dyn ToSql + Sync); 8] = [
            &id.as_bytes().as_slice(),
            &fingerprint.as_bytes().as_slice(),
            &nonce.as_slice(),
            &lease,
            &ttl,
            &scope_bytes,
            &records,
            &bytes,
        ];
        // Without a quota, claim_new.sql: the same read, and for an absent key the lean
        // insert function (its first five parameters). With one, claim.sql and the claim
        // function, which counts the scope first.
        let plain = scope.is_none();
        let mut attempts = Attempts::new(self, false);
        // Whether the read found a record to replace or take over: then the function alone,
        // until it answers (a resend after a lost reply reads its own claim back).
        let mut call = false;
        loop {
            let deadline = attempts.deadline()?;
            let (sql, params): (&str, &[&(dyn ToSql + Sync)]) = if call {
                (&self.sql.claim_call, &params)
            } else if plain {
                (&self.sql.claim_new, &params[..5])
            } else {
                (&self.sql.claim, &params)
            };
            match self.attempt(sql, params, deadline).await {
                Ok(rows) => {
                    let row = rows
                        .first()
                        .ok_or_else(|| corrupt(CorruptRow("claim returned no row")))?;
                    let read = if call {
                        decode_called(row, fingerprint, &nonce)?
                    } else if plain {
                        decode_new(row, fingerprint, &nonce)?
                    } else {
                        decode_claim(row, fingerprint, &nonce)?
                    };
                    match read {
                        ClaimRead::Done(outcome) => return Ok(outcome),
                        ClaimRead::Call => call = true,
                        ClaimRead::Again => {
                            call = false;
                            attempts.again()?;
                        }
                    }
                }
                Err(f) => attempts.after(f).await?,
            }
        }
    }

    /// One conditional delete; a lost reply is `Unavailable` (read back with `inspect`).
    async fn remove(&self, id: &RecordId, completed: bool) -> Result<Removal, StoreError> {
        let rows = self
            .run(
                &self.sql.remove,
                &[&id.as_bytes().as_slice(), &completed],
                true,
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("remove returned no row"))?;
        let (removed, present): (bool, bool) = (column(row, "removed")?, column(row, "present")?);
        Ok(match (removed, present) {
            (true, _) => Removal::Removed,
            (false, true) => Removal::Refused,
            (false, false) => Removal::Absent,
        })
    }
}

#[async_trait]
impl IdempotencyAdmin for PostgresStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        let rows = self
            .run(&self.sql.inspect, &[&id.as_bytes().as_slice()], true)
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let record = decode_record(row)?;
        let us: i64 = column(row, "expires_us")?;
        let expires_in = Duration::from_micros(u64::try_from(us).unwrap_or(0));
        Ok(Some(RecordInfo::new(&record, expires_in)))
    }

    async fn force_release(&self, id: &RecordId) -> Result<Removal, StoreError> {
        self.remove(id, false).await
    }

    async fn delete(&self, id: &RecordId) -> Result<Removal, StoreError> {
        self.remove(id, true).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::PostgresStore;
    use crate::store::record::{Completion, Fingerprint, RecordId, StoredResponse};
    use crate::store::{ClaimOutcome, ClaimRequest, IdempotencyStore};

    const TTL: Duration = Duration::from_secs(60);
    const LEASE: Duration = Duration::from_secs(30);

    /// claim_new.sql and claim.sql call a claim function only when they read no live record:
    /// a replay, a conflict and a mismatch are answered by the statement's own primary-key
    /// read. Shown with functions that fail whenever they run, in the one statement each claim
    /// sends.
    #[tokio::test]
    async fn the_claim_function_runs_only_when_no_live_record_was_read() {
        let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_POSTGRES_URL") else {
            return;
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000;
        let table = format!("tidem_unit_fn_{}_{nanos}", std::process::id());
        let store = PostgresStore::builder()
            .with_table(&table)
            .unwrap()
            .connect(&url)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let fp = |b: u8| Fingerprint::from_bytes([b; 32]);
        let claim = |id: &RecordId, f: Fingerprint, lease: Duration| {
            let (store, id) = (store.clone(), *id);
            async move { store.claim(&ClaimRequest::new(&id, &f, lease, TTL)).await }
        };
        let claimed = |outcome: ClaimOutcome| match outcome {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("expected Claimed, got {other:?}"),
        };

        // A completed record, one in progress, and one whose lease is about to lapse.
        let done = RecordId::new(None, "done");
        let token = claimed(claim(&done, fp(1), LEASE).await.unwrap()).token;
        let answer = Completion::Response(StoredResponse::new(
            StatusCode::CREATED,
            HeaderMap::new(),
            Bytes::from_static(b"made"),
            None,
        ));
        store.complete(&done, &token, &answer, TTL).await.unwrap();
        let busy = RecordId::new(None, "busy");
        claimed(claim(&busy, fp(2), LEASE).await.unwrap());
        let lapsing = RecordId::new(None, "lapsing");
        let first = claimed(
            claim(&lapsing, fp(3), Duration::from_millis(200))
                .await
                .unwrap(),
        );

        let client = store.pool().get().await.unwrap();
        client
            .batch_execute(&format!(
                "CREATE OR REPLACE FUNCTION {table}_claim_v3(
                     p_id bytea, p_fingerprint bytea, p_nonce bytea, p_lease bigint,
                     p_ttl bigint, p_scope bytea, p_max_records bigint, p_max_bytes bigint,
                     OUT outcome smallint, OUT generation bigint, OUT nonce bytea,
                     OUT fingerprint bytea, OUT state smallint, OUT lease_us bigint,
                     OUT status smallint, OUT headers bytea, OUT body bytea,
                     OUT trailers bytea, OUT lapsed_us bigint, OUT recovery_point bytea)
                 LANGUAGE plpgsql VOLATILE AS $$
                 BEGIN RAISE EXCEPTION 'the claim function ran'; END $$;
                 CREATE OR REPLACE FUNCTION {table}_claim_new_v1(
                     p_id bytea, p_fingerprint bytea, p_nonce bytea, p_lease bigint,
                     p_ttl bigint)
                 RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
                 BEGIN RAISE EXCEPTION 'the claim function ran'; END $$"
            ))
            .await
            .unwrap();
        drop(client);

        // Replay, conflict, mismatch: answered without the function.
        for (id, f) in [
            (&done, fp(1)),
            (&busy, fp(2)),
            (&busy, fp(9)),
            (&done, fp(9)),
        ] {
            let outcome = claim(id, f, LEASE).await.unwrap();
            assert!(matches!(outcome, ClaimOutcome::Existing(_)), "{outcome:?}");
        }
        // A new key and a lapsed lease are the function's.
        tokio::time::sleep(Duration::from_millis(400)).await;
        for (id, f) in [(&RecordId::new(None, "new"), fp(4)), (&lapsing, fp(3))] {
            let e = claim(id, f, LEASE).await.unwrap_err();
            let text = crate::store::error_chain(&e);
            assert!(text.contains("the claim function ran"), "{text}");
        }

        // `migrate` puts the function back, and the lapsed lease is taken over.
        store.migrate().await.unwrap();
        let takeover = claimed(claim(&lapsing, fp(3), LEASE).await.unwrap());
        assert!(takeover.takeover);
        assert_eq!(takeover.token.generation(), first.token.generation() + 1);
        store
            .pool()
            .get()
            .await
            .unwrap()
            .batch_execute(&format!(
                "DROP TABLE {table}; DROP FUNCTION {table}_claim_v2; \
                 DROP FUNCTION {table}_claim_v3; DROP FUNCTION {table}_claim_new_v1"
            ))
            .await
            .unwrap();
    }

    /// A key inserted by a transaction still in flight when claim_new.sql reads: the read sees
    /// no row, the lean insert waits for that transaction and then meets its row, and returns
    /// nothing; the claim function, in a second statement, reads the committed row and
    /// answers with it.
    #[tokio::test]
    async fn a_new_key_whose_insert_meets_a_row_committed_after_the_read_gets_that_row() {
        let Some(url) = crate::store::test_backend_url("IDEMPOTENCY_TEST_POSTGRES_URL") else {
            return;
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000;
        let table = format!("tidem_unit_race_{}_{nanos}", std::process::id());
        let store = PostgresStore::builder()
            .with_table(&table)
            .unwrap()
            .connect(&url)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let id = RecordId::new(None, "raced");
        let fp = Fingerprint::from_bytes([6; 32]);
        let mut other = store.pool().get().await.unwrap();
        let tx = other.transaction().await.unwrap();
        tx.execute(
            &format!(
                "INSERT INTO {table} (id, fingerprint, state, generation, nonce, locked_until,
                                     status, created_at, expires_at)
                 VALUES ($1, $2, 2, 1, $3, now(), 409, now(), now() + interval '1 min')"
            ),
            &[
                &id.as_bytes().as_slice(),
                &fp.as_bytes().as_slice(),
                &[8u8; 16].as_slice(),
            ],
        )
        .await
        .unwrap();
        let claim = {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&ClaimRequest::new(&id, &fp, LEASE, TTL)).await })
        };
        // Long enough for the claim's read to run and its insert to wait on ours.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !claim.is_finished(),
            "the claim did not wait for the insert in flight"
        );
        tx.commit().await.unwrap();
        let outcome = claim.await.unwrap().unwrap();
        match outcome {
            ClaimOutcome::Existing(record) => {
                assert_eq!(record.fingerprint, fp);
                assert_eq!(record.holder.map(|t| t.generation()), Some(1));
            }
            other => panic!("expected the committed row, got {other:?}"),
        }
        drop(other);
        store
            .pool()
            .get()
            .await
            .unwrap()
            .batch_execute(&format!(
                "DROP TABLE {table}; DROP FUNCTION {table}_claim_v2; \
                 DROP FUNCTION {table}_claim_v3; DROP FUNCTION {table}_claim_new_v1"
            ))
            .await
            .unwrap();
    }
}
