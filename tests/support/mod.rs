//! What the integration tests share, included once by each test crate (`tests/<group>/main.rs`).
//! Here: test doubles (a counting store, a failing store) and request helpers. Beside it: the
//! backends' URLs ([`backend`]), private Postgres schemas and a TCP proxy to Postgres ([`pg`]),
//! private `redis-server`s ([`redis_harness`]) and per-scope quota helpers ([`redis_quota`]),
//! the load of the storm and soak tests ([`load`]), a fault-injecting TCP proxy ([`proxy`]) and
//! a seeded random number generator ([`rng`]).
#![allow(dead_code, unreachable_pub)]

pub mod backend;
#[cfg(feature = "redis")]
pub mod failover;
pub mod load;
#[cfg(feature = "postgres")]
pub mod pg;
pub mod pg_failover;
pub mod proxy;
pub mod redis_harness;
#[cfg(feature = "redis")]
pub mod redis_quota;
pub mod rng;
pub mod shop;
pub mod storm;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower_idempotency::store::{
    ClaimOutcome, ClaimRequest, IdempotencyStore, MemoryStore, StoreError, StoreErrorKind,
};
use tower_idempotency::store::{Completion, Record, RecordId, Token};
use tower_idempotency::{RecoveryPoint, RequestBody};

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
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
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
    async fn claim(&self, _: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
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

/// Asserts that `res` is the layer's own problem+json answer of `kind` (never a replay), its
/// status also in the body, and returns the problem.
pub async fn assert_problem<B>(
    res: Response<B>,
    kind: tower_idempotency::ErrorKind,
) -> serde_json::Value
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    let status = res.status();
    assert_eq!(
        res.extensions()
            .get::<tower_idempotency::IdempotencyError>()
            .map(|e| e.kind()),
        Some(kind)
    );
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert!(res.headers().get("idempotent-replayed").is_none());
    let problem = body_json(res).await;
    assert_eq!(problem["type"], kind.type_uri());
    assert_eq!(problem["status"], status.as_u16());
    problem
}

pub fn counting() -> Arc<CountingStore> {
    Arc::new(CountingStore::default())
}

/// A store call [`FaultStore`] can break.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Claim,
    Extend,
    Complete,
    Release,
    Get,
    SaveRecoveryPoint,
    Recoverable,
}

/// What [`FaultStore`] does to one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Never returns, and never takes effect.
    Hang,
    /// Takes effect, then never returns.
    ApplyThenHang,
    /// Waits, then takes effect and returns.
    Delay(Duration),
    /// Takes effect at once; the reply comes this much later.
    ReplyLate(Duration),
    /// Fails without taking effect.
    Fail,
    /// Takes effect, then fails: a lost reply.
    ApplyThenFail,
}

#[derive(Debug)]
struct Rule {
    op: Op,
    /// 1-based call numbers this rule covers, `first..=last`.
    first: usize,
    last: usize,
    fault: Fault,
}

/// Wraps a real store and breaks chosen calls: hangs, delays, failures, lost replies.
/// Records when each call started, so tests can check the layer's schedule.
#[derive(Debug)]
pub struct FaultStore<S = MemoryStore> {
    pub inner: S,
    rules: std::sync::Mutex<Vec<Rule>>,
    calls: std::sync::Mutex<Vec<(Op, tokio::time::Instant)>>,
}

impl<S: IdempotencyStore> FaultStore<S> {
    pub fn new(inner: S) -> Arc<Self> {
        Arc::new(Self {
            inner,
            rules: Default::default(),
            calls: Default::default(),
        })
    }

    /// Breaks the `nth` call (1-based, counted from the store's creation) of `op`.
    pub fn on(&self, op: Op, nth: usize, fault: Fault) {
        self.on_range(op, nth, nth, fault);
    }

    /// Breaks every call of `op` from the next one on.
    pub fn on_all(&self, op: Op, fault: Fault) {
        let next = self.calls(op) + 1;
        self.on_range(op, next, usize::MAX, fault);
    }

    fn on_range(&self, op: Op, first: usize, last: usize, fault: Fault) {
        self.rules.lock().unwrap().push(Rule {
            op,
            first,
            last,
            fault,
        });
    }

    /// Heals every call from now on.
    pub fn heal(&self) {
        self.rules.lock().unwrap().clear();
    }

    pub fn calls(&self, op: Op) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(o, _)| *o == op)
            .count()
    }

    /// When each call of `op` started.
    pub fn started(&self, op: Op) -> Vec<tokio::time::Instant> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(o, _)| *o == op)
            .map(|(_, t)| *t)
            .collect()
    }

    async fn run<T>(
        &self,
        op: Op,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let fault = {
            let mut calls = self.calls.lock().unwrap();
            calls.push((op, tokio::time::Instant::now()));
            let n = calls.iter().filter(|(o, _)| *o == op).count();
            let rules = self.rules.lock().unwrap();
            rules
                .iter()
                .rev()
                .find(|r| r.op == op && (r.first..=r.last).contains(&n))
                .map(|r| r.fault)
        };
        let injected = || StoreError::with_source(StoreErrorKind::Unavailable, "injected fault");
        match fault {
            None => call.await,
            Some(Fault::Hang) => std::future::pending().await,
            Some(Fault::ApplyThenHang) => {
                let _ = call.await;
                std::future::pending().await
            }
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                call.await
            }
            Some(Fault::ReplyLate(d)) => {
                let out = call.await;
                tokio::time::sleep(d).await;
                out
            }
            Some(Fault::Fail) => Err(injected()),
            Some(Fault::ApplyThenFail) => {
                let _ = call.await;
                Err(injected())
            }
        }
    }
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for FaultStore<S> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.run(Op::Claim, self.inner.claim(request)).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: &Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.run(Op::Extend, self.inner.extend(id, token, lease))
            .await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: &Token,
        c: &Completion,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.run(Op::Complete, self.inner.complete(id, token, c, ttl))
            .await
    }
    async fn release(&self, id: &RecordId, token: &Token) -> Result<(), StoreError> {
        self.run(Op::Release, self.inner.release(id, token)).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.run(Op::Get, self.inner.get(id)).await
    }
    async fn save_recovery_point(
        &self,
        id: &RecordId,
        token: &Token,
        point: &RecoveryPoint,
    ) -> Result<(), StoreError> {
        self.run(
            Op::SaveRecoveryPoint,
            self.inner.save_recovery_point(id, token, point),
        )
        .await
    }
    async fn recoverable(&self, limit: usize) -> Result<Vec<(RecordId, Record)>, StoreError> {
        self.run(Op::Recoverable, self.inner.recoverable(limit))
            .await
    }
    fn invalidations(
        &self,
    ) -> Option<tokio::sync::broadcast::Receiver<tower_idempotency::store::Invalidation>> {
        self.inner.invalidations()
    }
}

/// What the layer hands a handler in these tests.
pub type LayerRequest = Request<RequestBody<Full<Bytes>>>;
/// What [`counting_payments`] answers.
pub type PaymentAnswer =
    std::future::Ready<Result<Response<Full<Bytes>>, std::convert::Infallible>>;

/// A payment handler for layer tests: answers 201 `pay_<n>`, `n` counting its runs.
pub fn counting_payments(
    calls: Arc<AtomicUsize>,
) -> tower::util::ServiceFn<impl FnMut(LayerRequest) -> PaymentAnswer + Clone> {
    tower::service_fn(move |_req: LayerRequest| {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        let mut res = Response::new(Full::new(Bytes::from(format!("pay_{n}"))));
        *res.status_mut() = http::StatusCode::CREATED;
        std::future::ready(Ok(res))
    })
}

/// The scope function of tests with tenants: the request's `x-tenant` header.
pub fn tenant_scope(req: &http::request::Parts) -> Option<String> {
    Some(req.headers.get("x-tenant")?.to_str().ok()?.to_owned())
}
