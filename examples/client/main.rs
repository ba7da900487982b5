//! Run with: `cargo run --example client --features client -- --target http://127.0.0.1:3000 --intents 100`
//!
//! Sends payment intents to a running shop (`cargo run --example shop`) through
//! `IdempotentRetryLayer`, each with its own `Idempotency-Key`, and prints one summary line:
//! `intents=100 attempts=100 replays=0 failures=0`. `--concurrency` (default 8) sets how many
//! are in flight at once.

mod intents;

use tower_idempotency::client::IdempotentRetryLayer;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut target = "http://127.0.0.1:3000".to_owned();
    let (mut count, mut concurrency) = (100usize, 8usize);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--target" => target = value()?,
            "--intents" => count = value()?.parse()?,
            "--concurrency" => concurrency = value()?.parse()?,
            other => {
                return Err(format!(
                "unknown argument {other:?}; expected --target URL, --intents N, --concurrency N"
            )
                .into())
            }
        }
    }
    let run = intents::pay(
        &target.parse()?,
        count,
        concurrency,
        IdempotentRetryLayer::new(),
    )
    .await;
    println!("{}", intents::Summary::of(&run));
    Ok(())
}
