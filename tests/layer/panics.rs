//! A handler's panic is resumed in the caller once, and nothing polls the spent flow again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response};
use http_body_util::Full;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{IdempotencyLayer, RequestBody};

use crate::support::post;

/// What a future polled again after its poll panicked says.
const RESUMED: &str = "`async fn` resumed after panicking";

static RESUMED_PANICS: AtomicUsize = AtomicUsize::new(0);

/// Counts panics that say [`RESUMED`]; every panic still prints.
fn count_resumed_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let text = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
            if text == Some(RESUMED) {
                RESUMED_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            default(info);
        }));
    });
}

/// The handler panics after a yield, so the flow won its claim in an earlier poll than the
/// one that unwinds: a dropped response future then holds a committed flow. It must not be
/// handed to a task, where it would be polled again and panic a second time.
#[tokio::test]
async fn a_panic_after_the_claim_is_resumed_once_and_the_spent_flow_is_not_polled_again() {
    count_resumed_panics();
    let inner = service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
        tokio::task::yield_now().await;
        if true {
            panic!("handler bug after a yield");
        }
        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    let caught = std::panic::AssertUnwindSafe(svc.oneshot(post("/pay", Some("k"), "{}")))
        .catch_unwind()
        .await;
    let panic = caught.expect_err("the handler's panic reaches the caller");
    assert_eq!(
        panic.downcast_ref::<&str>().copied(),
        Some("handler bug after a yield")
    );
    // Give a detached task every chance to run.
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(
        RESUMED_PANICS.load(Ordering::SeqCst),
        0,
        "the spent flow was polled again"
    );
}
