//! The layer polled where there is no tokio runtime (one that is shutting down): what is
//! left after the answer cannot go on a task, so it runs before the answer.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::{IdempotencyLayer, RecordDecision};

use crate::support::{counting, post};

/// Polls `f` on this thread with a waker that does nothing, outside any runtime: every store
/// call here is on the memory store and ready at once, so the flow never waits.
fn run_ready<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000 {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
    }
    panic!("not ready after 1,000 polls: the flow waited on a timer or a task");
}

#[test]
fn without_a_runtime_the_check_of_a_handlers_own_record_runs_before_the_answer() {
    assert!(tokio::runtime::Handle::try_current().is_err());
    let store = counting();
    // The handler says it recorded its answer itself (and did not): after the answer, the
    // layer reads the record to check, which with a runtime is a task of its own.
    let svc = IdempotencyLayer::from_arc(store.clone())
        .unscoped()
        .layer(service_fn(|_req| async {
            let mut res = Response::new(Full::new(Bytes::from_static(b"done")));
            res.extensions_mut().insert(RecordDecision::AlreadyRecorded);
            Ok::<_, Infallible>(res)
        }));
    let res = run_ready(svc.oneshot(post("/pay", Some("no-runtime-1"), "{}"))).unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(store.claims.load(Ordering::SeqCst), 1);
    assert_eq!(store.completes.load(Ordering::SeqCst), 0);
    assert_eq!(
        store.gets.load(Ordering::SeqCst),
        1,
        "the record check ran before the answer came back"
    );
}
