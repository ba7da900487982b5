//! Helpers for the Postgres store tests: pools, throwaway schemas, and a counting proxy.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::store::postgres::deadpool_postgres::{
    Manager, ManagerConfig, Pool, RecyclingMethod, Runtime,
};
use tower_idempotency::store::postgres::tokio_postgres::config::{Host, SslMode};
use tower_idempotency::store::postgres::tokio_postgres::{self, Client, Config, NoTls};
use tower_idempotency::store::postgres::{PostgresStore, PostgresStoreBuilder};

use super::backend::backend_url;

pub const URL_VAR: &str = "IDEMPOTENCY_TEST_POSTGRES_URL";

/// The test database URL, or `None` (after printing why) to skip.
pub fn url() -> Option<String> {
    backend_url(URL_VAR)
}

/// A lowercase identifier no other test, run or process uses (at most 40 bytes).
pub fn unique(label: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000;
    let label: String = label
        .chars()
        .take(12)
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!(
        "tidem_{label}_{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn config(url: &str) -> Config {
    url.parse()
        .expect("IDEMPOTENCY_TEST_POSTGRES_URL is not a valid Postgres URL")
}

/// A pool of `size` connections whose `application_name` is `app`, recycled the fast way.
pub fn pool_from(mut config: Config, size: usize, app: &str) -> Pool {
    config.application_name(app);
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .build()
        .unwrap()
}

pub fn pool(url: &str, size: usize, app: &str) -> Pool {
    pool_from(config(url), size, app)
}

/// A plain connection for setup and inspection, outside any store.
pub async fn admin(url: &str) -> Client {
    let (client, conn) = config(url)
        .connect(NoTls)
        .await
        .expect("connect to Postgres");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// A schema of its own, dropped by [`TestSchema::drop_now`].
pub struct TestSchema {
    pub name: String,
    url: String,
}

impl TestSchema {
    pub async fn create(url: &str, label: &str) -> Self {
        let name = unique(label);
        admin(url)
            .await
            .batch_execute(&format!("CREATE SCHEMA {name}"))
            .await
            .unwrap();
        Self {
            name,
            url: url.to_owned(),
        }
    }

    pub fn table(&self) -> String {
        format!("{}.records", self.name)
    }

    pub async fn drop_now(self) {
        admin(&self.url)
            .await
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", self.name))
            .await
            .unwrap();
    }
}

/// A migrated store in `schema`, on a pool of `size` connections named `app`.
pub async fn store_in(url: &str, schema: &TestSchema, size: usize, app: &str) -> PostgresStore {
    store_with(url, schema, size, app, |b| b).await
}

/// [`store_in`], with more settings made by `configure`.
pub async fn store_with(
    url: &str,
    schema: &TestSchema,
    size: usize,
    app: &str,
    configure: impl FnOnce(PostgresStoreBuilder) -> PostgresStoreBuilder,
) -> PostgresStore {
    let builder = PostgresStore::builder()
        .with_table(&schema.table())
        .unwrap();
    let store = configure(builder).build(pool(url, size, app));
    store.migrate().await.unwrap();
    store
}

/// What the proxy does with the next server reply.
pub mod mode {
    pub const PASS: u8 = 0;
    /// Drop the next reply and close that connection.
    pub const CUT: u8 = 1;
    /// Hold the next reply forever (the connection stays open).
    pub const STALL: u8 = 2;
    /// Close every new connection at once.
    pub const REFUSE: u8 = 3;
}

/// A TCP proxy in front of Postgres that counts round trips: every `ReadyForQuery` message
/// the server sends ends one. It can also lose a reply, to test unknown outcomes.
pub struct Proxy {
    pub port: u16,
    ready: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    mode: Arc<AtomicU8>,
    after: Arc<AtomicU8>,
    grace: Arc<AtomicU64>,
    cut_at: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    pub async fn start(url: &str) -> Self {
        let cfg = config(url);
        let host = match cfg.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        let upstream = format!("{host}:{port}");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let local = listener.local_addr().unwrap().port();
        let ready = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let mode = Arc::new(AtomicU8::new(mode::PASS));
        let after = Arc::new(AtomicU8::new(mode::PASS));
        let grace = Arc::new(AtomicU64::new(0));
        let cut_at = Arc::new(AtomicU64::new(u64::MAX));
        let task = {
            let (ready, accepted, mode, after, grace, cut_at, upstream) = (
                ready.clone(),
                accepted.clone(),
                mode.clone(),
                after.clone(),
                grace.clone(),
                cut_at.clone(),
                upstream,
            );
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    accepted.fetch_add(1, Ordering::SeqCst);
                    if mode.load(Ordering::SeqCst) == mode::REFUSE {
                        drop(client);
                        continue;
                    }
                    let modes = Modes {
                        now: mode.clone(),
                        after: after.clone(),
                        grace: grace.clone(),
                        cut_at: cut_at.clone(),
                    };
                    let (ready, upstream) = (ready.clone(), upstream.clone());
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(&upstream).await else {
                            return;
                        };
                        relay(client, server, ready, modes).await;
                    });
                }
            })
        };
        Self {
            port: local,
            ready,
            accepted,
            mode,
            after,
            grace,
            cut_at,
            task,
        }
    }

    /// `ReadyForQuery` messages relayed so far: one per completed round trip.
    pub fn round_trips(&self) -> u64 {
        self.ready.load(Ordering::SeqCst)
    }

    /// Client connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Applies `what` to the next server reply, then switches to `then`.
    pub fn next_reply(&self, what: u8, then: u8) {
        self.reply_after(0, what, then);
    }

    /// Relays `passed` whole replies (round trips) first, then applies `what` to the next
    /// one and switches to `then`: to lose the second statement of a two-statement claim.
    pub fn reply_after(&self, passed: u64, what: u8, then: u8) {
        self.after.store(then, Ordering::SeqCst);
        self.grace.store(passed, Ordering::SeqCst);
        self.mode.store(what, Ordering::SeqCst);
    }

    /// Round trips relayed when the proxy last cut a reply (`u64::MAX` before any cut).
    pub fn cut_at(&self) -> u64 {
        self.cut_at.load(Ordering::SeqCst)
    }

    pub fn set_mode(&self, what: u8) {
        self.mode.store(what, Ordering::SeqCst);
    }

    /// A client config that goes through the proxy, as the user of `url`.
    pub fn config(&self, url: &str) -> Config {
        let base = config(url);
        let mut cfg = Config::new();
        cfg.host("127.0.0.1")
            .port(self.port)
            .ssl_mode(SslMode::Disable)
            .user(base.get_user().unwrap_or("postgres"));
        if let Some(db) = base.get_dbname() {
            cfg.dbname(db);
        }
        if let Some(password) = base.get_password() {
            cfg.password(password);
        }
        cfg
    }
}

/// The proxy's shared switches, as each relay sees them.
struct Modes {
    now: Arc<AtomicU8>,
    after: Arc<AtomicU8>,
    /// Replies still to relay untouched before `now` applies.
    grace: Arc<AtomicU64>,
    cut_at: Arc<AtomicU64>,
}

async fn relay(client: TcpStream, server: TcpStream, ready: Arc<AtomicU64>, modes: Modes) {
    let Modes {
        now: mode,
        after,
        grace,
        cut_at,
    } = modes;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let upstream = async move {
        let _ = tokio::io::copy(&mut cr, &mut sw).await;
        let _ = sw.shutdown().await;
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut framer = Framer::default();
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let held = grace.load(Ordering::SeqCst) > 0;
            match mode.load(Ordering::SeqCst) {
                mode::CUT | mode::STALL if held => {}
                mode::CUT => {
                    cut_at.store(ready.load(Ordering::SeqCst), Ordering::SeqCst);
                    mode.store(after.load(Ordering::SeqCst), Ordering::SeqCst);
                    return; // dropping both halves closes the client's socket
                }
                mode::STALL => {
                    mode.store(after.load(Ordering::SeqCst), Ordering::SeqCst);
                    // Keep the socket open and never answer, until the client gives up.
                    std::future::pending::<()>().await;
                }
                _ => {}
            }
            let ended = framer.count_ready(&buf[..n]);
            if held {
                let left = grace.load(Ordering::SeqCst).saturating_sub(ended);
                grace.store(left, Ordering::SeqCst);
            }
            ready.fetch_add(ended, Ordering::SeqCst);
            if cw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Either side ending ends the relay (a stalled downstream ends when the client hangs up).
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}

/// Splits the server's byte stream into messages (type byte, then a length that counts
/// itself) and counts `ReadyForQuery` ('Z').
#[derive(Default)]
struct Framer {
    header: Vec<u8>,
    skip: usize,
}

impl Framer {
    fn count_ready(&mut self, mut data: &[u8]) -> u64 {
        let mut count = 0;
        while !data.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(data.len());
                self.skip -= n;
                data = &data[n..];
                continue;
            }
            let need = 5 - self.header.len();
            let n = need.min(data.len());
            self.header.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.header.len() == 5 {
                if self.header[0] == b'Z' {
                    count += 1;
                }
                let len = u32::from_be_bytes(self.header[1..5].try_into().unwrap()) as usize;
                self.skip = len - 4;
                self.header.clear();
            }
        }
        count
    }
}

/// Polls `check` every 20 ms until it holds, for at most `secs` seconds. For waiting on an
/// effect another task or the server produces, never for ordering our own tasks.
pub async fn eventually<F, Fut>(secs: u64, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    false
}

/// The `tokio_postgres` error type, for tests that look at sources.
pub type PgError = tokio_postgres::Error;
