//! Run with: `cargo run --example grpc_client --features client -- --target http://127.0.0.1:50051 --intents 10`
//!
//! Pays the gRPC shop (`cargo run --example grpc`) through `IdempotentRetryLayer` on a tonic
//! channel: one `CreatePayment` per intent, each with its own `idempotency-key` (`order-`, the
//! run, and the intent's number), which every retry of that intent sends again. Prints one
//! line per intent and a summary: `intents=10 attempts=10 replays=0 failures=0`.
//!
//! `--run ID` names the run (default: the time). Run it again with the same `--run` and every
//! intent is answered from the shop's records: `replays=10`, nothing charged twice.

#[allow(unreachable_pub, missing_docs, dead_code, clippy::all)]
mod pb {
    include!("../grpc/generated/shop.v1.rs");
}
mod pay;

use tonic::transport::Channel;
use tower_idempotency::client::IdempotentRetryLayer;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut target = "http://127.0.0.1:50051".to_owned();
    let mut count = 10usize;
    let mut run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis()
        .to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--target" => target = value()?,
            "--intents" => count = value()?.parse()?,
            "--run" => run = value()?,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; expected --target URL, --intents N, --run ID"
                )
                .into())
            }
        }
    }
    let channel = Channel::from_shared(target)?.connect().await?;
    let mut client = pay::client(channel, IdempotentRetryLayer::new());
    let paid = pay::pay(&mut client, &pay::keys(&run, count), 1000).await;
    for p in &paid {
        println!("{p}");
    }
    println!("{}", pay::Summary::of(&paid));
    Ok(())
}
