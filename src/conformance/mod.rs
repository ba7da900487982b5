//! The store conformance suite (feature `conformance`): the specification of a store, as
//! checks every store that ships with this crate passes, and that your own store can run.
//!
//! Each check is an `async fn(DynStore)` that panics on a violation of the
//! [store contract](crate::store#guarantees-every-store-gives). From a test file, either
//! generate one `#[tokio::test]` per check with [`conformance_suite!`](crate::conformance_suite)
//! (needs `tokio` with the `macros` and `rt-multi-thread` features among your
//! dev-dependencies), or run them all at once with [`run_all`]:
//!
//! ```toml
//! [dev-dependencies]
//! tower-idempotency = { version = "0.1", features = ["conformance"] }
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! ```
//!
//! ```text
//! // tests/my_store.rs
//! use std::sync::Arc;
//! use crate::conformance::DynStore;
//!
//! crate::conformance_suite! {
//!     // A fresh store per check; `None` skips (say why first, e.g. no server configured).
//!     store: async { Some(Arc::new(MyStore::new()) as DynStore) },
//!     // Optional: a store small enough to fill, for "a full store refuses, never evicts".
//!     full: async { Some(Arc::new(MyStore::with_capacity(40)) as DynStore) },
//! }
//! ```
//!
//! The [custom store example](crate::store#implementing-a-custom-store) runs the whole suite.
//!
//! Leases and TTLs here are real time (a store's own clock cannot be paused), so the checks
//! that wait for a lease or a TTL to lapse sleep past it with a margin; the longest takes
//! about five seconds. They never sleep to order two tasks: concurrency is ordered by a
//! barrier or a gate.
#![allow(clippy::match_wildcard_for_single_variants)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::store::{AdminStore, ClaimOutcome, ClaimRequest, IdempotencyStore, StoreErrorKind};
use crate::store::{Completion, Fingerprint, RecordId, StoredResponse, Token};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

mod claims;
mod faults;
mod fencing;
mod history;
mod model;
mod operator;
mod recovery;
mod retention;

pub use claims::{
    a_scoped_claim_claims_the_same_record, claim_now_answers_as_claim_does,
    completed_records_replay_byte_exactly,
    concurrent_claims_of_a_lapsed_or_expired_record_yield_exactly_one,
    concurrent_claims_of_one_key_yield_exactly_one_claimed,
    different_fingerprint_sees_the_existing_record, get_reports_the_holder_of_a_record,
    release_frees_the_key, scopes_are_isolated,
};
pub use faults::lost_replies_are_unknown_and_resends_are_idempotent;
pub use fencing::{
    a_lease_extended_to_zero_is_taken_over_at_once,
    completed_records_are_not_taken_over_after_the_lease, extend_keeps_the_lease_alive,
    forged_extend_leaves_the_lease_unchanged, lapsed_lease_is_taken_over_with_a_greater_generation,
    releasing_a_takeover_keeps_the_keys_history, stale_tokens_change_nothing,
};
#[doc(hidden)]
pub use history::__histories;
pub use history::{run_histories, HistoryConfig, HistoryFailure, HistoryReport, HistoryStore};
pub use operator::{inspect_shows_the_recovery_point, operator_api_inspects_releases_and_deletes};
pub use recovery::{
    recoverable_lists_lapsed_records_with_a_point,
    recovery_points_are_fenced_and_handed_to_a_takeover, the_largest_recovery_point_round_trips,
};
pub use retention::{
    full_store_refuses_claims_and_keeps_records, records_live_for_their_ttl_and_no_longer,
    ttl_counts_from_completion, ttl_expiry_makes_the_key_new,
};

/// A shared store, as the checks take it.
pub type DynStore = Arc<dyn IdempotencyStore>;

/// A shared store with the [operator API](crate::store::IdempotencyAdmin), for
/// [`operator_api_inspects_releases_and_deletes`].
pub type DynAdminStore = Arc<dyn AdminStore>;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

/// A record id no other test, run or process uses.
pub fn unique_id(label: &str) -> RecordId {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let scope = format!(
        "conformance/{}/{nanos}/{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    RecordId::new(Some(&scope), label)
}

/// A fingerprint made of one repeated byte: distinct per `n`.
pub fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

/// A recorded answer with JSON content type and a repeated `link` header.
pub fn response(status: u16, body: impl Into<Bytes>) -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.append("link", HeaderValue::from_static("</a>; rel=a"));
    headers.append("link", HeaderValue::from_static("</b>; rel=b"));
    Completion::Response(StoredResponse::new(
        StatusCode::from_u16(status).unwrap(),
        headers,
        body.into(),
        None,
    ))
}

async fn claim_token(store: &DynStore, id: &RecordId, f: Fingerprint, lease: Duration) -> Token {
    match store
        .claim(&ClaimRequest::new(id, &f, lease, TTL))
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(c) => c.token,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn assert_fenced<T: std::fmt::Debug>(r: Result<T, crate::store::StoreError>, what: &str) {
    match r {
        Err(e) if e.kind() == StoreErrorKind::Fenced => {}
        other => panic!("{what}: expected Fenced, got {other:?}"),
    }
}

/// Runs every check at once, each on a fresh store from `new_store`, and the full-store
/// check when `full` yields a store small enough to fill; meanwhile, the model-based
/// histories ([`run_histories`] at [`HistoryConfig::ci`]'s budget, with recovery points when
/// the store keeps them). Panics on the first violation, with the minimal failing history
/// when a history broke the contract.
///
/// Needs a multi-threaded Tokio runtime (the concurrency checks spawn tasks).
pub async fn run_all<F, Fut>(new_store: F, full: Option<DynStore>)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = DynStore>,
{
    type Check = fn(DynStore) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
    macro_rules! checks {
        ($($name:ident,)*) => {
            [$((stringify!($name), (|s| Box::pin($name(s))) as Check)),*]
        };
    }
    let checks = crate::__conformance_checks!([checks]);
    let mut running = Vec::new();
    for (name, check) in checks {
        let store = new_store().await;
        running.push((name, tokio::spawn(check(store))));
    }
    if let Some(store) = full {
        let check: Check = |s| Box::pin(full_store_refuses_claims_and_keeps_records(s));
        running.push((
            "full_store_refuses_claims_and_keeps_records",
            tokio::spawn(check(store)),
        ));
    }
    // While the single-step checks wait out their leases and TTLs.
    let histories = run_histories(&new_store, HistoryConfig::ci()).await;
    for (name, task) in running {
        if let Err(e) = task.await {
            match e.try_into_panic() {
                Ok(panic) => {
                    eprintln!("conformance check `{name}` failed");
                    std::panic::resume_unwind(panic)
                }
                Err(e) => panic!("conformance check `{name}` did not finish: {e}"),
            }
        }
    }
    match histories {
        Ok(report) => eprintln!("{report}"),
        Err(failure) => panic!("{failure}"),
    }
}

/// Runs the [recovery-point](crate::RecoveryPoint) checks at once, each on a fresh store
/// from `new_store`: for a store that implements
/// [`save_recovery_point`](IdempotencyStore::save_recovery_point) and
/// [`recoverable`](IdempotencyStore::recoverable); then the model-based histories with
/// recovery points required ([`run_histories`]). Panics on the first violation.
pub async fn run_recovery<F, Fut>(new_store: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = DynStore>,
{
    type Check = fn(DynStore) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
    macro_rules! checks {
        ($($name:ident,)*) => {
            [$((stringify!($name), (|s| Box::pin($name(s))) as Check)),*]
        };
    }
    for (name, check) in crate::__conformance_recovery_checks!([checks]) {
        let store = new_store().await;
        if let Err(e) = tokio::spawn(check(store)).await {
            eprintln!("conformance check `{name}` failed");
            match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => panic!("conformance check `{name}` did not finish: {e}"),
            }
        }
    }
    match run_histories(&new_store, HistoryConfig::ci().require_recovery_points()).await {
        Ok(report) => eprintln!("{report}"),
        Err(failure) => panic!("{failure}"),
    }
}

/// The recovery-point checks, as [`__conformance_checks`] lists the others.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_recovery_checks {
    ([$($callback:tt)+] $($args:tt)*) => {
        $($callback)+! { $($args)*
            recovery_points_are_fenced_and_handed_to_a_takeover,
            the_largest_recovery_point_round_trips,
            recoverable_lists_lapsed_records_with_a_point,
        }
    };
}

/// The one list of the checks every store runs (the full-store and operator checks apart):
/// `__conformance_checks!([callback] args…)` expands to `callback! { args… name, name, … }`, so
/// `run_all` and `conformance_suite!` cannot drift apart.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_checks {
    ([$($callback:tt)+] $($args:tt)*) => {
        $($callback)+! { $($args)*
            concurrent_claims_of_one_key_yield_exactly_one_claimed,
            claim_now_answers_as_claim_does,
            completed_records_replay_byte_exactly,
            different_fingerprint_sees_the_existing_record,
            lapsed_lease_is_taken_over_with_a_greater_generation,
            stale_tokens_change_nothing,
            release_frees_the_key,
            get_reports_the_holder_of_a_record,
            releasing_a_takeover_keeps_the_keys_history,
            a_scoped_claim_claims_the_same_record,
            extend_keeps_the_lease_alive,
            a_lease_extended_to_zero_is_taken_over_at_once,
            ttl_expiry_makes_the_key_new,
            completed_records_are_not_taken_over_after_the_lease,
            scopes_are_isolated,
            records_live_for_their_ttl_and_no_longer,
            ttl_counts_from_completion,
            concurrent_claims_of_a_lapsed_or_expired_record_yield_exactly_one,
            forged_extend_leaves_the_lease_unchanged,
            lost_replies_are_unknown_and_resends_are_idempotent,
        }
    };
}

/// Generates one `#[tokio::test]` per conformance check.
///
/// `store` is an async block yielding `Option<DynStore>` (a fresh store, or `None` to skip);
/// `full`, when given, yields `Option<DynStore>` for a store small enough to fill; `admin`,
/// when given, yields `Option<DynAdminStore>` (a store with the operator API); `recovery`,
/// when given, yields `Option<DynStore>` for a store that keeps
/// [recovery points](crate::RecoveryPoint), and runs their checks.
///
/// It also generates `histories_hold_against_the_model`: the model-based histories
/// ([`run_histories`](crate::conformance::run_histories)), on the `admin` store when given
/// (with operator calls) or else on `store`, with recovery points required when `recovery`
/// is given. `IDEMPOTENCY_HISTORIES` and `IDEMPOTENCY_HISTORY_SEED` lengthen or replay it.
#[macro_export]
macro_rules! conformance_suite {
    (store: $store:expr $(, full: $full:expr)? $(, admin: $admin:expr)? $(, recovery: $recovery:expr)? $(,)?) => {
        $crate::conformance_suite!(@histories [$store] [$($admin)?] [$($recovery)?]);
        $crate::__conformance_checks!([$crate::conformance_suite] @test $store;);
        $(
            $crate::conformance_suite!(@test $full; full_store_refuses_claims_and_keeps_records,);
        )?
        $(
            $crate::conformance_suite!(@test $admin;
                operator_api_inspects_releases_and_deletes,
                inspect_shows_the_recovery_point,
            );
        )?
        $(
            $crate::__conformance_recovery_checks!([$crate::conformance_suite] @test $recovery;);
        )?
    };
    (@histories [$store:expr] [] []) => {
        $crate::conformance_suite!(@history_test $store, false);
    };
    (@histories [$store:expr] [] [$recovery:expr]) => {
        $crate::conformance_suite!(@history_test $store, true);
    };
    (@histories [$store:expr] [$admin:expr] []) => {
        $crate::conformance_suite!(@history_test $admin, false);
    };
    (@histories [$store:expr] [$admin:expr] [$recovery:expr]) => {
        $crate::conformance_suite!(@history_test $admin, true);
    };
    (@history_test $store:expr, $points:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn histories_hold_against_the_model() {
            $crate::conformance::__histories($store.await, $points).await;
        }
    };
    (@test $store:expr; $($name:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let Some(store) = $store.await else { return };
                $crate::conformance::$name(store).await;
            }
        )*
    };
}
