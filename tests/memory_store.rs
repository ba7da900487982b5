//! The conformance suite on `MemoryStore`.

use tower_idempotency::{conformance, conformance_suite};

use std::num::NonZeroUsize;
use std::sync::Arc;

use conformance::DynStore;
use tower_idempotency::store::MemoryStore;

conformance_suite! {
    store: async { Some(Arc::new(MemoryStore::new()) as DynStore) },
    full: async {
        let store = MemoryStore::builder()
            .max_records(NonZeroUsize::new(40).unwrap())
            .build();
        Some(Arc::new(store) as DynStore)
    },
}

#[tokio::test]
async fn byte_budget_also_refuses_claims() {
    let store = MemoryStore::builder()
        .max_bytes(NonZeroUsize::new(200 * 1024).unwrap())
        .build();
    conformance::full_store_refuses_claims_and_keeps_records(Arc::new(store)).await;
}

#[tokio::test]
async fn a_recorded_body_keeps_only_its_own_bytes_not_the_buffer_it_came_from() {
    use bytes::Bytes;
    use std::time::Duration;
    use tower_idempotency::store::{ClaimOutcome, IdempotencyStore};
    use tower_idempotency::{Completion, Fingerprint, RecordId, StoredResponse};

    let store = MemoryStore::new();
    let id = RecordId::new(Some("tenant"), "exact-bytes");
    let fp = Fingerprint::from_bytes([1; 32]);
    let ttl = Duration::from_secs(60);
    let ClaimOutcome::Claimed(claim) = store
        .claim(&id, &fp, Duration::from_secs(30), ttl)
        .await
        .unwrap()
    else {
        panic!("a fresh key is claimed")
    };
    // Ten bytes of a 1 MiB buffer, as a frozen, oversized `BytesMut` would be.
    let buffer = Bytes::from(vec![7u8; 1 << 20]);
    let completion = Completion::Response(StoredResponse {
        status: http::StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: buffer.slice(0..10),
        trailers: None,
    });
    store
        .complete(&id, &claim.token, &completion, ttl)
        .await
        .unwrap();
    drop(completion);
    assert!(
        buffer.is_unique(),
        "the store must not keep the 1 MiB buffer alive for 10 bytes"
    );
}
