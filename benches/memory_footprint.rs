//! Bytes per record in the memory store, from the process's RSS: 200,000 completed records
//! of a 237-byte answer with two headers (issue 15's measure).
//!
//! `cargo bench --bench memory_footprint` (Linux: reads /proc/self/status).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, MemoryStore};
use tower_idempotency::store::{Completion, Fingerprint, RecordId, StoredResponse};

const RECORDS: usize = 200_000;

fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux /proc");
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line");
    kb * 1024
}

fn answer() -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        "x-request-id",
        HeaderValue::from_static("req_8f14e45fceea167a5a36dedd4bea2543"),
    );
    // 237 bytes, as a payment API answers.
    let mut body = br#"{"id":"pay_000000000001","object":"payment","amount":1999,"currency":"eur","status":"succeeded","customer":"cus_00000000000000000001","created":1764460800,"description":"order 1234","metadata":{"order":"ord_1234"},"livemode":false}"#.to_vec();
    body.resize(237, b' ');
    Completion::Response(StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Bytes::from(body),
        None,
    ))
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = MemoryStore::new();
        let answer = answer();
        let fp = Fingerprint::from_bytes([7; 32]);
        let ttl = Duration::from_secs(3600);
        let fill = |from: usize, to: usize| {
            let store = store.clone();
            let answer = answer.clone();
            async move {
                for i in from..to {
                    let id = RecordId::new(Some("tenant"), &format!("key-{i}"));
                    let ClaimOutcome::Claimed(c) = store.claim(&ClaimRequest::new(&id, &fp, ttl, ttl)).await.unwrap()
                    else {
                        panic!("fresh key")
                    };
                    store.complete(&id, &c.token, &answer, ttl).await.unwrap();
                }
            }
        };
        // Warm up the allocator and the runtime, then measure the next RECORDS.
        fill(0, 1_000).await;
        let before = rss_bytes();
        fill(1_000, 1_000 + RECORDS).await;
        let after = rss_bytes();
        let per_record = (after - before) as f64 / RECORDS as f64;
        let Completion::Response(r) = &answer else { unreachable!() };
        println!(
            "memory store: {RECORDS} completed records of a {}-byte answer with {} headers: RSS +{:.1} MiB = {per_record:.0} bytes per record (goal <= 2x answer + 256 = {} B)",
            r.body.len(),
            r.headers.len(),
            (after - before) as f64 / (1 << 20) as f64,
            2 * r.body.len() + 256,
        );
        assert_eq!(store.len(), RECORDS + 1_000);
    });
}
