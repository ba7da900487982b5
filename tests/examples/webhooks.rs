//! The webhooks example through its axum `Router`, per receiver and per store: redeliveries
//! are acknowledged without running the work again, for a week.
//!
//! On memory the store's clock is tokio's, so "3 days later" is paused time. Redis and
//! Postgres keep time by their server's clock, which paused time cannot move: there the
//! tests wait a real second for the 1 s redelivery and read the record's remaining TTL on
//! the server instead of waiting 3 days.

#[path = "../../examples/webhooks/app.rs"]
mod app;
#[cfg(any(feature = "redis", feature = "postgres"))]
use crate::support::backend as common;

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hmac::{Hmac, Mac};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use sha2::Sha256;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::store::{AdminStore, MemoryStore, RecordId, RecordStatus};

const SECRET: &[u8] = b"whsec_test";
/// The Standard Webhooks sender's current secret (the spec's example) and the one it
/// rotates out (the reference Rust library's test secret).
const STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STANDARD_OLD_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const DAY: Duration = Duration::from_secs(24 * 60 * 60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sender {
    Stripe,
    Github,
    Adyen,
}

const SENDERS: [Sender; 3] = [Sender::Stripe, Sender::Github, Sender::Adyen];

impl Sender {
    fn name(self) -> &'static str {
        match self {
            Sender::Stripe => "stripe",
            Sender::Github => "github",
            Sender::Adyen => "adyen",
        }
    }

    fn path(self, tenant: &str) -> String {
        if tenant == "default" {
            format!("/webhooks/{}", self.name())
        } else {
            format!("/webhooks/{tenant}/{}", self.name())
        }
    }

    /// A delivery of event `id`; `attempt` changes a field each sender may change between
    /// deliveries (Stripe's `pending_webhooks`; for the others, whose receivers match on key
    /// and route, any field).
    fn delivery(self, tenant: &str, id: &str, attempt: u32) -> Request<Body> {
        let body = match self {
            Sender::Stripe => serde_json::json!({
                "id": id, "object": "event", "type": "invoice.paid",
                "data": {"object": {"id": "in_1", "amount_paid": 1000}},
                "pending_webhooks": 3 - attempt,
            }),
            Sender::Github => serde_json::json!({
                "ref": "refs/heads/main", "after": "6113728f", "attempt": attempt,
            }),
            Sender::Adyen => adyen_body(Some(id), attempt),
        };
        let mut req = self.raw(tenant, &body.to_string(), id);
        sign(&mut req, &body.to_string());
        req
    }

    /// A signed delivery without the sender's id.
    fn without_id(self, tenant: &str) -> Request<Body> {
        let body = match self {
            Sender::Stripe => serde_json::json!({"object": "event", "type": "invoice.paid"}),
            Sender::Github => serde_json::json!({"ref": "refs/heads/main"}),
            Sender::Adyen => adyen_body(None, 0),
        };
        let body = body.to_string();
        let mut req = Request::post(self.path(tenant))
            .header("content-type", "application/json")
            .body(Body::from(body.clone()))
            .unwrap();
        sign(&mut req, &body);
        req
    }

    fn raw(self, tenant: &str, body: &str, id: &str) -> Request<Body> {
        let mut b = Request::post(self.path(tenant)).header("content-type", "application/json");
        if self == Sender::Github {
            b = b
                .header("x-github-delivery", id)
                .header("x-github-event", "push");
        }
        b.body(Body::from(body.to_owned())).unwrap()
    }

    /// Where the problem says the id was expected.
    fn missing_detail(self) -> String {
        match self {
            Sender::Stripe => {
                "the webhook id at JSON pointer `/id` in the request body is missing".into()
            }
            Sender::Github => "the webhook id in the `x-github-delivery` header is missing".into(),
            Sender::Adyen => format!(
                "the webhook id part at JSON pointer `{}/pspReference` in the request body is missing",
                app::ADYEN_ITEM
            ),
        }
    }

    fn record(self, tenant: &str, id: &str) -> RecordId {
        let key = match self {
            Sender::Adyen => format!("13:AUTHORISATION{}:{id}", id.len()),
            _ => id.to_owned(),
        };
        RecordId::new(Some(&format!("{tenant}/{}", self.name())), &key)
    }

    fn count(self, processed: &app::Processed) -> u64 {
        let (stripe, github, adyen) = processed.counts();
        match self {
            Sender::Stripe => stripe,
            Sender::Github => github,
            Sender::Adyen => adyen,
        }
    }
}

fn adyen_body(psp: Option<&str>, attempt: u32) -> serde_json::Value {
    let mut item = serde_json::json!({
        "eventCode": "AUTHORISATION", "success": "true",
        "eventDate": "2026-12-01T18:03:50+01:00", "merchantAccountCode": "ACME",
        "amount": {"value": 1130, "currency": "EUR"},
        "additionalData": {"attempt": attempt.to_string()},
    });
    if let Some(psp) = psp {
        item["pspReference"] = psp.into();
    }
    serde_json::json!({"live": "false", "notificationItems": [{"NotificationRequestItem": item}]})
}

fn sign(req: &mut Request<Body>, body: &str) {
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
    mac.update(body.as_bytes());
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    req.headers_mut()
        .insert("x-signature", format!("sha256={hex}").parse().unwrap());
}

/// Ids no other run of these tests has used, for stores that outlive the test.
fn fresh(label: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{label}_{}_{nanos}", std::process::id())
}

struct Receivers {
    router: Router,
    processed: Arc<app::Processed>,
    store: Arc<dyn AdminStore>,
}

fn receivers(store: Arc<dyn AdminStore>, hold: Option<app::Hold>) -> Receivers {
    receivers_keeping(store, hold, None)
}

/// The receivers, recording acknowledgements up to `max_response_body` bytes.
fn receivers_keeping(
    store: Arc<dyn AdminStore>,
    hold: Option<app::Hold>,
    max_response_body: Option<NonZeroUsize>,
) -> Receivers {
    let (router, processed) = app::app(store.clone(), config(hold, max_response_body));
    Receivers {
        router,
        processed,
        store,
    }
}

fn config(hold: Option<app::Hold>, max_response_body: Option<NonZeroUsize>) -> app::WebhooksConfig {
    app::WebhooksConfig {
        secret: SECRET.to_vec(),
        standard: tower_idempotency::StandardWebhooks::new([STANDARD_SECRET, STANDARD_OLD_SECRET])
            .unwrap(),
        hold,
        max_response_body,
    }
}

async fn send(router: &Router, req: Request<Body>) -> Response<Body> {
    router.clone().oneshot(req).await.unwrap()
}

fn replayed(res: &Response<Body>) -> bool {
    res.headers().get("idempotent-replayed").is_some()
}

async fn json(res: Response<Body>) -> serde_json::Value {
    serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

/// How a test moves "later": paused tokio time (memory), or the server's clock (Redis,
/// Postgres), which only real time moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
enum Clock {
    Paused,
    Server,
}

/// Every check of one receiver but the concurrent one.
async fn redeliveries_are_acknowledged_once(r: &Receivers, sender: Sender, clock: Clock) {
    let s = sender.name();
    let id = fresh(&format!("evt_{s}"));
    let before = sender.count(&r.processed);
    let first = send(&r.router, sender.delivery("default", &id, 0)).await;
    assert!(first.status().is_success(), "{s}: {}", first.status());
    assert!(!replayed(&first), "{s}");
    assert_eq!(sender.count(&r.processed), before + 1, "{s}: ran once");

    // A redelivery 1 s later.
    match clock {
        Clock::Paused => tokio::time::advance(Duration::from_secs(1)).await,
        Clock::Server => tokio::time::sleep(Duration::from_secs(1)).await,
    }
    let again = send(&r.router, sender.delivery("default", &id, 0)).await;
    assert_eq!(again.status(), first.status(), "{s}");
    assert!(replayed(&again), "{s}: 1 s later");

    // One whose volatile field changed is acknowledged, not 422.
    let changed = send(&r.router, sender.delivery("default", &id, 1)).await;
    assert_eq!(changed.status(), first.status(), "{s}: changed field");
    assert!(replayed(&changed), "{s}: changed field");

    // 3 days later, within the 7 days.
    let info = r
        .store
        .inspect(&sender.record("default", &id))
        .await
        .unwrap();
    let info = info.unwrap_or_else(|| panic!("{s}: the record is on the store"));
    assert!(
        info.expires_in >= 7 * DAY - Duration::from_secs(300),
        "{s}: expires in {:?}",
        info.expires_in
    );
    if clock == Clock::Paused {
        tokio::time::advance(3 * DAY).await;
        let late = send(&r.router, sender.delivery("default", &id, 2)).await;
        assert_eq!(late.status(), first.status(), "{s}: 3 days later");
        assert!(replayed(&late), "{s}: 3 days later");
    }
    assert_eq!(sender.count(&r.processed), before + 1, "{s}: still once");

    // Another event id runs.
    let other = send(
        &r.router,
        sender.delivery("default", &fresh("evt_other"), 0),
    )
    .await;
    assert!(other.status().is_success() && !replayed(&other), "{s}");
    assert_eq!(
        sender.count(&r.processed),
        before + 2,
        "{s}: two ids, twice"
    );

    // The same id from two tenants runs for each.
    for tenant in ["acme", "globex"] {
        let res = send(&r.router, sender.delivery(tenant, &id, 0)).await;
        assert!(
            res.status().is_success() && !replayed(&res),
            "{s}: {tenant}"
        );
    }
    assert_eq!(
        sender.count(&r.processed),
        before + 4,
        "{s}: two tenants, twice"
    );

    // No id: 400, naming where the id was expected.
    let res = send(&r.router, sender.without_id("default")).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{s}");
    let problem = json(res).await;
    assert_eq!(problem["detail"], sender.missing_detail(), "{s}");
    assert_eq!(
        problem["type"],
        tower_idempotency::ErrorKind::KeyMissing.type_uri()
    );

    // A body over the limit: 413, before any claim.
    let big_id = fresh("evt_big");
    let pad = "x".repeat(app::MAX_BODY);
    let body = match sender {
        Sender::Stripe => serde_json::json!({"id": big_id, "pad": pad}),
        Sender::Github => serde_json::json!({"pad": pad}),
        Sender::Adyen => {
            let mut b = adyen_body(Some(&big_id), 0);
            b["pad"] = pad.into();
            b
        }
    }
    .to_string();
    let mut big = sender.raw("default", &body, &big_id);
    sign(&mut big, &body);
    let res = send(&r.router, big).await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE, "{s}");
    let record = r.store.inspect(&sender.record("default", &big_id)).await;
    assert_eq!(record.unwrap(), None, "{s}: nothing claimed");

    // A missing or wrong signature: 401, never recorded, and the genuine delivery runs.
    let forged_id = fresh("evt_forged");
    let mut unsigned = sender.delivery("default", &forged_id, 0);
    unsigned.headers_mut().remove("x-signature");
    let mut wrong = sender.delivery("default", &forged_id, 0);
    wrong.headers_mut().insert(
        "x-signature",
        format!("sha256={}", "0".repeat(64)).parse().unwrap(),
    );
    for (label, req) in [("missing", unsigned), ("wrong", wrong)] {
        let res = send(&r.router, req).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{s}: {label}");
        let record = r.store.inspect(&sender.record("default", &forged_id)).await;
        assert_eq!(
            record.unwrap(),
            None,
            "{s}: {label} signature, nothing recorded"
        );
    }
    assert_eq!(
        sender.count(&r.processed),
        before + 4,
        "{s}: rejects ran nothing"
    );
    let genuine = send(&r.router, sender.delivery("default", &forged_id, 0)).await;
    assert!(genuine.status().is_success() && !replayed(&genuine), "{s}");
    assert_eq!(sender.count(&r.processed), before + 5, "{s}");
}

/// A hold that keeps the first run of the work until `open`, and lets any later run (a bug)
/// through at once, so a second run shows up as a count rather than a hang.
fn gate() -> (app::Hold, Arc<Notify>, Arc<Notify>) {
    let (started, open) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let first = Arc::new(AtomicBool::new(true));
    let (s, o) = (started.clone(), open.clone());
    let hold: app::Hold = Arc::new(move || {
        let held = first.swap(false, Ordering::SeqCst);
        let (s, o) = (s.clone(), o.clone());
        Box::pin(async move {
            if held {
                s.notify_one();
                o.notified().await;
            }
        })
    });
    (hold, started, open)
}

/// 20 simultaneous deliveries of one event: the work runs once; the 19 that arrive while
/// it runs get 503 with `Retry-After` (a status every sender redelivers on), and a later
/// redelivery is a replay.
async fn twenty_concurrent_redeliveries_run_once(store: Arc<dyn AdminStore>, sender: Sender) {
    let s = sender.name();
    let (hold, started, open) = gate();
    let r = receivers(store, Some(hold));
    let id = fresh(&format!("evt_herd_{s}"));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..20 {
        let (router, tx, req) = (
            r.router.clone(),
            tx.clone(),
            sender.delivery("default", &id, 0),
        );
        tokio::spawn(async move {
            let res = send(&router, req).await;
            let retry_after = res.headers().get("retry-after").cloned();
            tx.send((res.status(), retry_after)).unwrap();
        });
    }
    started.notified().await;
    // 19 answers come while the first delivery is held.
    for _ in 0..19 {
        let (status, retry_after) = rx.recv().await.unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{s}");
        assert_eq!(retry_after.unwrap(), "1", "{s}");
    }
    open.notify_one();
    let (status, _) = rx.recv().await.unwrap();
    assert!(status.is_success(), "{s}: {status}");
    assert_eq!(sender.count(&r.processed), 1, "{s}: once");
    let later = send(&r.router, sender.delivery("default", &id, 1)).await;
    assert!(replayed(&later), "{s}");
    assert_eq!(sender.count(&r.processed), 1, "{s}");
}

/// Receivers that keep acknowledgements up to 8 bytes: Stripe's `{"received":true}` and
/// Adyen's `[accepted]` are too large to keep (tombstones, decoded by each store), GitHub's
/// empty `204` is kept. A redelivery of a taken event gets its 2xx either way, never the
/// `410` a sender would read as a failure and redeliver for days: an unkept one empty and
/// marked `Idempotent-Replay-Omitted: too-large`, a kept one byte for byte.
async fn a_taken_event_whose_answer_was_too_large_to_keep_is_still_acknowledged_with_its_2xx(
    store: Arc<dyn AdminStore>,
) {
    const KEPT: usize = 8;
    let r = receivers_keeping(store, None, NonZeroUsize::new(KEPT));
    for sender in SENDERS {
        let s = sender.name();
        let id = fresh(&format!("evt_large_answer_{s}"));
        let before = sender.count(&r.processed);
        let first = send(&r.router, sender.delivery("default", &id, 0)).await;
        let status = first.status();
        assert!(status.is_success() && !replayed(&first), "{s}: {status}");
        let body = first.into_body().collect().await.unwrap().to_bytes();
        let too_large = sender != Sender::Github;
        assert_eq!(body.len() > KEPT, too_large, "{s}: {body:?}");
        let info = r.store.inspect(&sender.record("default", &id)).await;
        let info = info.unwrap().unwrap_or_else(|| panic!("{s}: a record"));
        let want = if too_large {
            RecordStatus::Tombstone
        } else {
            RecordStatus::Completed
        };
        assert_eq!(
            (info.status, info.answer_status),
            (want, Some(status)),
            "{s}"
        );

        for attempt in [0, 1] {
            let again = send(&r.router, sender.delivery("default", &id, attempt)).await;
            assert_eq!(again.status(), status, "{s}: the first 2xx, not 410");
            assert!(replayed(&again), "{s}");
            let omitted = again.headers().get("idempotent-replay-omitted").cloned();
            let replayed_body = again.into_body().collect().await.unwrap().to_bytes();
            if too_large {
                assert_eq!(omitted.unwrap(), "too-large", "{s}");
                assert!(replayed_body.is_empty(), "{s}: {replayed_body:?}");
            } else {
                assert_eq!(omitted, None, "{s}");
                assert_eq!(replayed_body, body, "{s}");
            }
        }
        assert_eq!(sender.count(&r.processed), before + 1, "{s}: ran once");
    }
}

#[tokio::test]
async fn on_memory_a_taken_event_whose_answer_was_too_large_to_keep_is_acknowledged_with_its_2xx() {
    a_taken_event_whose_answer_was_too_large_to_keep_is_still_acknowledged_with_its_2xx(Arc::new(
        MemoryStore::new(),
    ))
    .await;
}

#[tokio::test(start_paused = true)]
async fn on_memory_each_receiver_acknowledges_redeliveries_after_1_s_and_3_days_without_running_again(
) {
    let r = receivers(Arc::new(MemoryStore::new()), None);
    for sender in SENDERS {
        redeliveries_are_acknowledged_once(&r, sender, Clock::Paused).await;
    }
}

#[tokio::test(start_paused = true)]
async fn on_memory_twenty_concurrent_redeliveries_run_each_receivers_work_once() {
    for sender in SENDERS {
        twenty_concurrent_redeliveries_run_once(Arc::new(MemoryStore::new()), sender).await;
    }
}

#[tokio::test]
async fn processed_counts_each_sender_and_is_not_a_webhook() {
    let r = receivers(Arc::new(MemoryStore::new()), None);
    for sender in SENDERS {
        send(&r.router, sender.delivery("default", "evt_1", 0)).await;
    }
    send(&r.router, Sender::Stripe.delivery("default", "evt_2", 0)).await;
    send(
        &r.router,
        standard("msg_1", STANDARD_BODY, now(), STANDARD_SECRET),
    )
    .await;
    let res = send(
        &r.router,
        Request::get("/webhooks/processed")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        json(res).await,
        serde_json::json!({"stripe": 2, "github": 1, "adyen": 1, "standard": 1})
    );
}

const STANDARD_BODY: &str =
    r#"{"type":"invoice.paid","timestamp":"2026-12-01T18:03:50Z","data":{"id":"in_1"}}"#;

/// Seconds since the epoch: the layer checks `webhook-timestamp` against the wall clock,
/// which paused tokio time does not move.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A Standard Webhooks delivery of message `id`, signed at `signed_at` with `secret` as a
/// sender signs it, by hand here (not with the crate's code): `v1,` and the base64
/// HMAC-SHA256 of `{id}.{signed_at}.{body}`, keyed with the base64-decoded secret.
fn standard(id: &str, body: &str, signed_at: u64, secret: &str) -> Request<Body> {
    let signature = standard_signature(id, body, signed_at, secret);
    Request::post("/webhooks/standard")
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", signed_at.to_string())
        .header("webhook-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn standard_signature(id: &str, body: &str, signed_at: u64, secret: &str) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let key = b64.decode(secret.strip_prefix("whsec_").unwrap()).unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{signed_at}.{body}").as_bytes());
    format!("v1,{}", b64.encode(mac.finalize().into_bytes()))
}

fn standard_record(id: &str) -> RecordId {
    // The default webhook scope: the endpoint.
    RecordId::new(Some("endpoint /webhooks/standard"), id)
}

#[test]
fn the_tests_own_standard_webhooks_signer_reproduces_the_spec_vector() {
    assert_eq!(
        standard_signature(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            r#"{"test": 2432232314}"#,
            1614265330,
            STANDARD_SECRET
        ),
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    );
}

/// A signed delivery runs once; each redelivery, signed afresh by the sender (a new
/// timestamp, a new signature), and one signed with the secret being rotated out, replays.
async fn standard_webhooks_deliveries_run_once_and_redeliveries_replay(store: Arc<dyn AdminStore>) {
    let r = receivers(store, None);
    let id = fresh("msg");
    let before = r.processed.standard();
    let first = send(
        &r.router,
        standard(&id, STANDARD_BODY, now(), STANDARD_SECRET),
    )
    .await;
    assert_eq!(first.status(), StatusCode::OK);
    assert!(!replayed(&first));
    assert_eq!(json(first).await, serde_json::json!({"received": true}));
    assert_eq!(r.processed.standard(), before + 1);

    for (label, secret) in [("current", STANDARD_SECRET), ("old", STANDARD_OLD_SECRET)] {
        let again = send(&r.router, standard(&id, STANDARD_BODY, now() + 1, secret)).await;
        assert_eq!(again.status(), StatusCode::OK, "{label}");
        assert!(replayed(&again), "{label}");
        assert_eq!(json(again).await, serde_json::json!({"received": true}));
    }
    assert_eq!(r.processed.standard(), before + 1, "ran once");

    let info = r.store.inspect(&standard_record(&id)).await.unwrap();
    let info = info.expect("the record is on the store");
    assert_eq!(info.status, RecordStatus::Completed);
    assert!(
        info.expires_in >= 7 * DAY - Duration::from_secs(300),
        "{:?}",
        info.expires_in
    );

    let other = send(
        &r.router,
        standard(&fresh("msg"), STANDARD_BODY, now(), STANDARD_SECRET),
    )
    .await;
    assert!(other.status().is_success() && !replayed(&other));
    assert_eq!(r.processed.standard(), before + 2, "another id runs");
}

#[tokio::test]
async fn on_memory_a_standard_webhooks_delivery_runs_once_and_its_redeliveries_replay() {
    standard_webhooks_deliveries_run_once_and_redeliveries_replay(Arc::new(MemoryStore::new()))
        .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn on_redis_a_standard_webhooks_delivery_runs_once_and_its_redeliveries_replay() {
    let Some(store) = redis().await else { return };
    standard_webhooks_deliveries_run_once_and_redeliveries_replay(store).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn on_postgres_a_standard_webhooks_delivery_runs_once_and_its_redeliveries_replay() {
    let Some(store) = postgres().await else {
        return;
    };
    standard_webhooks_deliveries_run_once_and_redeliveries_replay(store).await;
}

/// Every forged, tampered, unsigned or stale delivery is `401` `signature-invalid` and
/// makes no store call at all: nothing claimed, nothing stored. The genuine delivery of
/// the same id then runs.
#[tokio::test]
async fn a_standard_webhooks_delivery_with_a_bad_signature_is_401_and_the_store_is_untouched() {
    let store = Arc::new(crate::support::CountingStore::default());
    let (router, processed) = app::app(store.clone(), config(None, None));
    let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    let at = now();
    let tolerance = 5 * 60;
    let with = |f: &dyn Fn(&mut Request<Body>)| {
        let mut req = standard(id, STANDARD_BODY, at, STANDARD_SECRET);
        f(&mut req);
        req
    };
    let other_secret = "whsec_dGhpcyBpcyBub3QgdGhlIHNlbmRlcidzIGtleSBhdCBhbGw=";
    let tampered = STANDARD_BODY.replace("in_1", "in_2");
    let cases: Vec<(&str, Request<Body>)> = vec![
        (
            "another secret",
            standard(id, STANDARD_BODY, at, other_secret),
        ),
        ("a tampered body", {
            let mut req = standard(id, &tampered, at, STANDARD_SECRET);
            let signature = standard_signature(id, STANDARD_BODY, at, STANDARD_SECRET);
            req.headers_mut()
                .insert("webhook-signature", signature.parse().unwrap());
            req
        }),
        (
            "no signature",
            with(&|req| {
                req.headers_mut().remove("webhook-signature");
            }),
        ),
        (
            "no timestamp",
            with(&|req| {
                req.headers_mut().remove("webhook-timestamp");
            }),
        ),
        (
            "a garbage signature",
            with(&|req| {
                let garbage = format!("v1,{}", "A".repeat(43)) + "=";
                req.headers_mut()
                    .insert("webhook-signature", garbage.parse().unwrap());
            }),
        ),
        (
            "too old",
            standard(id, STANDARD_BODY, at - tolerance - 60, STANDARD_SECRET),
        ),
        (
            "too new",
            standard(id, STANDARD_BODY, at + tolerance + 60, STANDARD_SECRET),
        ),
    ];
    for (label, req) in cases {
        let res = send(&router, req).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{label}");
        assert_eq!(
            res.headers()["content-type"],
            "application/problem+json",
            "{label}"
        );
        let problem = json(res).await;
        assert_eq!(
            problem["type"],
            tower_idempotency::ErrorKind::SignatureInvalid.type_uri(),
            "{label}"
        );
        assert_eq!(problem["status"], 401, "{label}");
        assert_eq!(store.total(), 0, "{label}: no store call");
    }
    // No `webhook-id`: the key is missing, `400`, and nothing is stored either.
    let res = send(
        &router,
        with(&|req| {
            req.headers_mut().remove("webhook-id");
        }),
    )
    .await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        json(res).await["detail"],
        "the webhook id in the `webhook-id` header is missing"
    );
    assert_eq!(store.total(), 0, "no id: no store call");
    assert_eq!(
        tower_idempotency::store::IdempotencyAdmin::inspect(&store.inner, &standard_record(id))
            .await
            .unwrap(),
        None
    );
    assert_eq!(processed.standard(), 0, "nothing ran");

    let genuine = send(&router, standard(id, STANDARD_BODY, at, STANDARD_SECRET)).await;
    assert_eq!(genuine.status(), StatusCode::OK);
    assert_eq!(processed.standard(), 1, "the genuine delivery runs");
    assert_eq!(store.claims.load(Ordering::SeqCst), 1);
}

#[cfg(feature = "redis")]
async fn redis() -> Option<Arc<dyn AdminStore>> {
    let url = common::backend_url("IDEMPOTENCY_TEST_REDIS_URL")?;
    let store = tower_idempotency::store::redis::RedisStore::connect(&url)
        .await
        .unwrap();
    Some(Arc::new(store))
}

#[cfg(feature = "postgres")]
async fn postgres() -> Option<Arc<dyn AdminStore>> {
    let url = common::backend_url("IDEMPOTENCY_TEST_POSTGRES_URL")?;
    let store = tower_idempotency::store::postgres::PostgresStore::connect(&url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn on_redis_each_receiver_acknowledges_redeliveries_and_keeps_records_7_days() {
    let Some(store) = redis().await else { return };
    let r = receivers(store, None);
    for sender in SENDERS {
        redeliveries_are_acknowledged_once(&r, sender, Clock::Server).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn on_redis_twenty_concurrent_redeliveries_run_each_receivers_work_once() {
    let Some(store) = redis().await else { return };
    for sender in SENDERS {
        twenty_concurrent_redeliveries_run_once(store.clone(), sender).await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn on_postgres_each_receiver_acknowledges_redeliveries_and_keeps_records_7_days() {
    let Some(store) = postgres().await else {
        return;
    };
    let r = receivers(store, None);
    for sender in SENDERS {
        redeliveries_are_acknowledged_once(&r, sender, Clock::Server).await;
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn on_postgres_twenty_concurrent_redeliveries_run_each_receivers_work_once() {
    let Some(store) = postgres().await else {
        return;
    };
    for sender in SENDERS {
        twenty_concurrent_redeliveries_run_once(store.clone(), sender).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn on_redis_a_taken_event_whose_answer_was_too_large_to_keep_is_acknowledged_with_its_2xx() {
    let Some(store) = redis().await else { return };
    a_taken_event_whose_answer_was_too_large_to_keep_is_still_acknowledged_with_its_2xx(store)
        .await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn on_postgres_a_taken_event_whose_answer_was_too_large_to_keep_is_acknowledged_with_its_2xx()
{
    let Some(store) = postgres().await else {
        return;
    };
    a_taken_event_whose_answer_was_too_large_to_keep_is_still_acknowledged_with_its_2xx(store)
        .await;
}
