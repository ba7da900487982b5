//! The operator API ([`IdempotencyAdmin`](crate::store::IdempotencyAdmin)) on Redis.

use std::time::Duration;

use async_trait::async_trait;
use redis::Value;

use super::error::{corrupt, Failure};
use super::{record, RedisStore};
use crate::store::record::RecordId;
use crate::store::{IdempotencyAdmin, RecordInfo, Removal, StoreError, StoreErrorKind};

impl RedisStore {
    /// Runs the remove script; `completed` picks the state that may be removed. Operator
    /// calls skip `WAIT`: they are rare, and the operator reads the result back.
    async fn remove(&self, id: &RecordId, completed: bool) -> Result<Removal, StoreError> {
        let keys = self.keys(id);
        let state: &[u8] = if completed { b"c" } else { b"p" };
        let lua = &self.inner.scripts.remove;
        let channel = self.invalidation_channel();
        let args: [&[u8]; 3] = [state, keys.id().as_bytes(), channel.as_bytes()];
        match self
            .eval(lua, &keys, &args)
            .await
            .map_err(Failure::into_error)?
        {
            Value::Int(0) => Ok(Removal::Absent),
            Value::Int(1) => Ok(Removal::Removed),
            Value::Int(2) => Ok(Removal::Refused),
            _ => Err(corrupt("remove reply is not 0, 1 or 2")),
        }
    }
}

#[async_trait]
impl IdempotencyAdmin for RedisStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<RecordInfo>, StoreError> {
        let key = self.key(id);
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(&key).cmd("TIME").cmd("PTTL").arg(&key);
        let (_, conn) = self.inner.link.any_conn();
        let call = conn.pipeline(&pipe, &key);
        let replies = match tokio::time::timeout(self.inner.timeout, call).await {
            Ok(r) => r.map_err(|e| Failure::from_redis(e).into_error())?,
            Err(elapsed) => return Err(StoreError::with_source(StoreErrorKind::Unknown, elapsed)),
        };
        let [value, time, pttl]: [Value; 3] = replies
            .try_into()
            .map_err(|_| corrupt("inspect reply count"))?;
        let Some(value) = record::value_bytes(value)? else {
            return Ok(None);
        };
        let clock = record::Clock {
            now_ms: Some(record::time_ms(&time)?),
            pttl_ms: record::Clock::pttl(&pttl),
        };
        let found = record::decode(value, clock)?;
        // PTTL is -1 for a key without expiry, which the store never writes.
        let expires_in = Duration::from_millis(clock.pttl_ms.unwrap_or(0));
        Ok(Some(RecordInfo::new(&found.record, expires_in)))
    }

    async fn force_release(&self, id: &RecordId) -> Result<Removal, StoreError> {
        self.remove(id, false).await
    }

    async fn delete(&self, id: &RecordId) -> Result<Removal, StoreError> {
        self.remove(id, true).await
    }
}
