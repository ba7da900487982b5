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
