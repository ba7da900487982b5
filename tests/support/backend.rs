//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

/// Reads a backend URL from `var`. When it is unset the test is skipped with a printed
/// reason, unless `IDEMPOTENCY_REQUIRE_BACKENDS=1`, which turns the skip into a failure.
pub fn backend_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            if std::env::var("IDEMPOTENCY_REQUIRE_BACKENDS").as_deref() == Ok("1") {
                panic!(
                    "{var} is unset but IDEMPOTENCY_REQUIRE_BACKENDS=1: the backend is required"
                );
            }
            eprintln!("SKIPPED: {var} is unset, so this backend test did not run");
            None
        }
    }
}
