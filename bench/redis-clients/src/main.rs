//! One Redis call shaped like a replay (EVALSHA, one key, two arguments, a 300-byte bulk
//! reply), made by 64 tasks at once on a two-worker runtime as the shop makes it, through each
//! client design in turn. Reports calls per second and this process's CPU per call (user +
//! system: the client and the runtime, not the server), each the median over interleaved
//! rounds, and each design's CPU per call as a ratio to the store's current design.
//!
//!   redis-server --port 16392 --save "" --appendonly no --daemonize yes
//!   cargo run --release --manifest-path bench/redis-clients/Cargo.toml
//!
//! Env: REDIS_URL (redis://127.0.0.1:16392), SECONDS per run (5), ROUNDS (3), TASKS (64).
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fred::interfaces::{ClientLike, LuaInterface};

const SCRIPT: &str = "return redis.call('GET', KEYS[1])";
const KEY: &str = "redis-clients:record";
/// The store's call timeout; every design that bounds its calls uses it.
const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Design {
    /// What `RedisStore` does: a `ConnectionManager`, each call under `tokio::time::timeout`.
    ManagerTimeout,
    /// The same without the per-call timer.
    Manager,
    /// redis-rs's multiplexed connection without the manager (and, like the store's manager,
    /// without redis-rs's own response timer), each call under a timeout.
    MultiplexedTimeout,
    /// fred 10's client (one connection, its own reconnect), each call under a timeout.
    FredTimeout,
    /// fred without the per-call timer.
    Fred,
}

const DESIGNS: [Design; 5] = [
    Design::ManagerTimeout,
    Design::Manager,
    Design::MultiplexedTimeout,
    Design::FredTimeout,
    Design::Fred,
];

#[derive(Clone)]
enum Client {
    Manager(redis::aio::ConnectionManager),
    Multiplexed(redis::aio::MultiplexedConnection),
    Fred(fred::clients::Client),
}

/// The call, for redis-rs: the same command through either connection type.
fn evalsha(sha: &str, arg: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(1).arg(KEY).arg(arg).arg("replay");
    cmd
}

async fn call(client: &mut Client, sha: &str, arg: u64) -> usize {
    let v: bytes::Bytes = match client {
        Client::Manager(c) => evalsha(sha, arg).query_async(c).await,
        Client::Multiplexed(c) => evalsha(sha, arg).query_async(c).await,
        Client::Fred(c) => {
            let args = vec![arg.to_string(), "replay".to_string()];
            return c
                .evalsha::<bytes::Bytes, _, _, _>(sha, vec![KEY], args)
                .await
                .expect("EVALSHA")
                .len();
        }
    }
    .expect("EVALSHA");
    v.len()
}

fn cpu() -> Duration {
    // The whole process: both workers, and any task a client runs by itself.
    // SAFETY: rusage is plain data, all zeros is a valid value, and getrusage only writes it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

async fn open(design: Design, url: &str) -> Client {
    let client = redis::Client::open(url).expect("REDIS_URL");
    match design {
        Design::ManagerTimeout | Design::Manager => Client::Manager(
            redis::aio::ConnectionManager::new_with_config(
                client,
                redis::aio::ConnectionManagerConfig::new().set_response_timeout(None),
            )
            .await
            .expect("connect"),
        ),
        Design::MultiplexedTimeout => Client::Multiplexed(
            client
                .get_multiplexed_async_connection_with_config(
                    &redis::AsyncConnectionConfig::new().set_response_timeout(None),
                )
                .await
                .expect("connect"),
        ),
        Design::FredTimeout | Design::Fred => {
            let config = fred::types::config::Config::from_url(url).expect("REDIS_URL");
            let c = fred::types::Builder::from_config(config)
                .build()
                .expect("fred");
            c.init().await.expect("connect");
            Client::Fred(c)
        }
    }
}

/// (calls per second, CPU per call)
async fn run(design: Design, url: &str, sha: &str, tasks: usize, secs: u64) -> (f64, Duration) {
    let client = open(design, url).await;
    let bounded = matches!(
        design,
        Design::ManagerTimeout | Design::MultiplexedTimeout | Design::FredTimeout
    );
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let counting = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (mut client, stop, calls, counting, sha) = (
            client.clone(),
            stop.clone(),
            calls.clone(),
            counting.clone(),
            sha.to_string(),
        );
        handles.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let len = if bounded {
                    tokio::time::timeout(TIMEOUT, call(&mut client, &sha, t as u64))
                        .await
                        .expect("timed out")
                } else {
                    call(&mut client, &sha, t as u64).await
                };
                assert_eq!(len, 300);
                if counting.load(Ordering::Relaxed) {
                    n += 1;
                }
            }
            calls.fetch_add(n, Ordering::Relaxed);
        }));
    }
    // One second of warm-up, then the measured span.
    tokio::time::sleep(Duration::from_secs(1)).await;
    counting.store(true, Ordering::Relaxed);
    let (t0, c0) = (Instant::now(), cpu());
    tokio::time::sleep(Duration::from_secs(secs)).await;
    counting.store(false, Ordering::Relaxed);
    let (t1, c1) = (Instant::now(), cpu());
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.await.expect("task");
    }
    if let Client::Fred(c) = &client {
        let _ = c.quit().await;
    }
    let n = calls.load(Ordering::Relaxed) as f64;
    (n / (t1 - t0).as_secs_f64(), (c1 - c0).div_f64(n))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let url = env("REDIS_URL", "redis://127.0.0.1:16392");
    let secs: u64 = env("SECONDS", "5").parse().expect("SECONDS");
    let rounds: usize = env("ROUNDS", "3").parse().expect("ROUNDS");
    let tasks: usize = env("TASKS", "64").parse().expect("TASKS");

    let mut setup = redis::Client::open(url.as_str())
        .expect("REDIS_URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let _: () = redis::cmd("SET")
        .arg(KEY)
        .arg(vec![b'r'; 300])
        .query_async(&mut setup)
        .await
        .expect("SET");
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SCRIPT)
        .query_async(&mut setup)
        .await
        .expect("SCRIPT LOAD");

    let mut rate = vec![Vec::new(); DESIGNS.len()];
    let mut per_call = vec![Vec::new(); DESIGNS.len()];
    let mut ratio = vec![Vec::new(); DESIGNS.len()];
    for _ in 0..rounds {
        let mut base = None;
        for (i, d) in DESIGNS.iter().enumerate() {
            let (r, c) = run(*d, &url, &sha, tasks, secs).await;
            let c = c.as_secs_f64() * 1e6;
            let b = *base.get_or_insert(c);
            rate[i].push(r);
            per_call[i].push(c);
            ratio[i].push(c / b);
        }
    }
    println!("| design | calls/s | client CPU µs/call | vs the store's design |");
    println!("|---|---:|---:|---:|");
    for (i, d) in DESIGNS.iter().enumerate() {
        println!(
            "| {d:?} | {:.0} | {:.2} | {:.2}x |",
            median(rate[i].clone()),
            median(per_call[i].clone()),
            median(ratio[i].clone())
        );
    }
}
