//! Test doubles shared by the layer tests: a counting store, a failing store, request helpers.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower_idempotency::store::{
    ClaimOutcome, IdempotencyStore, MemoryStore, StoreError, StoreErrorKind,
};
use tower_idempotency::{Completion, Fingerprint, Record, RecordId, Token};

/// Counts every store call, then delegates to a `MemoryStore`.
#[derive(Debug, Default)]
pub struct CountingStore {
    pub inner: MemoryStore,
    pub claims: AtomicUsize,
    pub extends: AtomicUsize,
    pub completes: AtomicUsize,
    pub releases: AtomicUsize,
    pub gets: AtomicUsize,
}

impl CountingStore {
    pub fn total(&self) -> usize {
        [
            &self.claims,
            &self.extends,
            &self.completes,
            &self.releases,
            &self.gets,
        ]
        .iter()
        .map(|c| c.load(Ordering::SeqCst))
        .sum()
    }
}

#[async_trait]
impl IdempotencyStore for CountingStore {
    async fn claim(
        &self,
        id: &RecordId,
        fp: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(id, fp, lease, ttl).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(id, token, lease).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        c: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(id, token, c, ttl).await
    }
    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(id, token).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        self.inner.get(id).await
    }
}

/// A store whose every call fails as unreachable.
#[derive(Debug, Default)]
pub struct DownStore;

fn down() -> StoreError {
    StoreError::with_source(
        StoreErrorKind::Unavailable,
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"),
    )
}

#[async_trait]
impl IdempotencyStore for DownStore {
    async fn claim(
        &self,
        _: &RecordId,
        _: &Fingerprint,
        _: Duration,
        _: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        Err(down())
    }
    async fn extend(&self, _: &RecordId, _: &Token, _: Duration) -> Result<(), StoreError> {
        Err(down())
    }
    async fn complete(
        &self,
        _: &RecordId,
        _: &Token,
        _: &Completion,
        _: Duration,
    ) -> Result<(), StoreError> {
        Err(down())
    }
    async fn release(&self, _: &RecordId, _: &Token) -> Result<(), StoreError> {
        Err(down())
    }
    async fn get(&self, _: &RecordId) -> Result<Option<Record>, StoreError> {
        Err(down())
    }
}

/// A keyed JSON POST.
pub fn post(path: &str, key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap()
}

pub async fn body_bytes<B>(res: Response<B>) -> Bytes
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    res.into_body().collect().await.unwrap().to_bytes()
}

pub async fn body_json<B>(res: Response<B>) -> serde_json::Value
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    serde_json::from_slice(&body_bytes(res).await).unwrap()
}

pub fn counting() -> Arc<CountingStore> {
    Arc::new(CountingStore::default())
}
