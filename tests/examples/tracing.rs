//! One span per keyed request, with its outcome; the raw key never reaches the logs.
//! No other test of this binary records a Set-Cookie answer: the layer warns about one once per
//! process.

use crate::support;

use std::convert::Infallible;
use std::fmt::Write as _;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use support::{post, DownStore};
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{IdempotencyLayer, RequestBody};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Captures every span's fields and every event's text.
#[derive(Clone, Default)]
struct Capture {
    outcomes: Arc<Mutex<Vec<String>>>,
    text: Arc<Mutex<String>>,
}

struct Fields<'a>(&'a mut String, Option<&'a mut Vec<String>>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
        if field.name() == "outcome" {
            if let Some(o) = self.1.as_deref_mut() {
                o.push(format!("{value:?}").trim_matches('"').to_owned());
            }
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={}", field.name(), value);
        if field.name() == "outcome" {
            if let Some(o) = self.1.as_deref_mut() {
                o.push(value.to_owned());
            }
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        let mut text = self.text.lock().unwrap();
        let _ = write!(text, "\nspan {}", attrs.metadata().name());
        attrs.record(&mut Fields(&mut text, None));
    }
    fn on_record(&self, _: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut text = self.text.lock().unwrap();
        let mut outcomes = self.outcomes.lock().unwrap();
        values.record(&mut Fields(&mut text, Some(&mut outcomes)));
    }
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut text = self.text.lock().unwrap();
        text.push_str("\nevent");
        event.record(&mut Fields(&mut text, None));
    }
}

const SECRET_KEY: &str = "customer-secret-key-4242";

#[tokio::test(flavor = "current_thread")]
async fn each_keyed_request_reports_its_outcome_and_never_the_raw_key() {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    let inner = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
        let mut res = Response::new(Full::new(Bytes::from(vec![b'x'; 2048])));
        *res.status_mut() = match req.uri().path() {
            "/fail" => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::CREATED,
        };
        Ok::<_, Infallible>(res)
    });
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_max_response_body(NonZeroUsize::new(4096).unwrap());
    let s = layer.layer(inner);
    let run = |path: &'static str, body: &'static str| {
        s.clone().oneshot(post(path, Some(SECRET_KEY), body))
    };

    run("/ok", "{}").await.unwrap(); // executed
    run("/ok", "{}").await.unwrap(); // replayed
    run("/ok", r#"{"changed":1}"#).await.unwrap(); // mismatch
    let fresh = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    fresh
        .oneshot(post("/fail", Some(SECRET_KEY), "{}"))
        .await
        .unwrap(); // released
    let big = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .with_max_response_body(NonZeroUsize::new(1024).unwrap())
        .layer(inner);
    big.oneshot(post("/big", Some(SECRET_KEY), "{}"))
        .await
        .unwrap(); // tombstoned
    let down = IdempotencyLayer::new(DownStore).unscoped().layer(inner);
    down.oneshot(post("/ok", Some(SECRET_KEY), "{}"))
        .await
        .unwrap(); // store_error

    let outcomes = capture.outcomes.lock().unwrap().clone();
    assert_eq!(
        outcomes,
        [
            "executed",
            "replayed",
            "mismatch",
            "released",
            "tombstoned",
            "store_error"
        ]
    );
    let text = capture.text.lock().unwrap().clone();
    assert!(text.contains("span idempotency"), "{text}");
    assert!(
        !text.contains(SECRET_KEY),
        "the raw key leaked into the logs:\n{text}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_conflict_is_reported_as_conflict() {
    let capture = Capture::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let inner = {
        let (gate, started) = (gate.clone(), started.clone());
        service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
            let (gate, started) = (gate.clone(), started.clone());
            async move {
                started.notify_one();
                gate.notified().await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        })
    };
    let s = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    let first = tokio::spawn(s.clone().oneshot(post("/x", Some(SECRET_KEY), "{}")));
    started.notified().await;
    assert_eq!(
        s.oneshot(post("/x", Some(SECRET_KEY), "{}"))
            .await
            .unwrap()
            .status(),
        409
    );
    gate.notify_one();
    first.await.unwrap().unwrap();
    let outcomes = capture.outcomes.lock().unwrap().clone();
    assert_eq!(outcomes, ["conflict", "executed"]);
}

#[tokio::test(flavor = "current_thread")]
async fn an_unscoped_layer_warns_when_it_is_built_and_a_scoped_one_does_not() {
    let capture = Capture::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
    let _scoped = IdempotencyLayer::new(MemoryStore::new()).with_scope(|req| {
        req.headers
            .get("x-tenant")
            .map(|v| v.to_str().unwrap_or("").to_owned())
    });
    assert!(
        !capture.text.lock().unwrap().contains("unscoped"),
        "a scoped layer warned"
    );
    let _unscoped = IdempotencyLayer::new(MemoryStore::new()).unscoped();
    let text = capture.text.lock().unwrap().clone();
    assert_eq!(
        text.matches("built unscoped").count(),
        1,
        "one warning for one unscoped layer:\n{text}"
    );
    assert!(
        text.contains("with_scope"),
        "the warning names the fix:\n{text}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_set_cookie_answer_is_recorded_without_it_and_warned_about_once() {
    let capture = Capture::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(capture.clone()));
    let inner = service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async move {
        let mut res = Response::new(Full::new(Bytes::from_static(b"{\"id\":1}")));
        *res.status_mut() = StatusCode::CREATED;
        res.headers_mut()
            .insert("set-cookie", "session=alice".parse().unwrap());
        res.headers_mut().insert("x-order", "o-1".parse().unwrap());
        Ok::<_, Infallible>(res)
    });
    let s = IdempotencyLayer::new(MemoryStore::new())
        .unscoped()
        .layer(inner);
    let first = s
        .clone()
        .oneshot(post("/o", Some("cookie-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // The live answer is the handler's own, cookie included.
    assert_eq!(first.headers()["set-cookie"], "session=alice");
    let replay = s
        .clone()
        .oneshot(post("/o", Some("cookie-1"), "{}"))
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["x-order"], "o-1", "other headers replay");
    assert!(
        replay.headers().get("set-cookie").is_none(),
        "a replay must not hand the first caller's cookie to whoever retries"
    );
    s.oneshot(post("/o", Some("cookie-2"), "{}")).await.unwrap();
    let text = capture.text.lock().unwrap().clone();
    assert_eq!(
        text.matches("carried Set-Cookie").count(),
        1,
        "warned once per process, not per answer:\n{text}"
    );
}
