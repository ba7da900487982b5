//! Private `redis-server` processes for tests: free loopback ports, a temp dir each, no
//! persistence (`--save "" --appendonly no`).
//!
//! A server dies when its [`RedisServer`] drops. A server held in a static never drops, and a
//! test process can die without unwinding, so each server also gets a watchdog: a `sh` whose
//! stdin is a pipe from the test process. When the test process exits, for whatever reason, the
//! pipe closes, `read` returns, and the watchdog kills the server and removes its dir. No
//! polling, no orphans.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tower_idempotency::store::ClaimRequest;

/// `true` when `redis-server` and `redis-cli` run. When they do not, prints why the test is
/// skipped, or panics under `IDEMPOTENCY_REQUIRE_BACKENDS=1`.
pub fn binaries_available() -> bool {
    let runs = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let missing: Vec<&str> = ["redis-server", "redis-cli"]
        .into_iter()
        .filter(|b| !runs(b))
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "{} not found (install redis-server and redis-tools)",
        missing.join(" and ")
    );
    if std::env::var("IDEMPOTENCY_REQUIRE_BACKENDS").as_deref() == Ok("1") {
        panic!("{why}, but IDEMPOTENCY_REQUIRE_BACKENDS=1: the backend is required");
    }
    eprintln!("SKIPPED: {why}, so this test did not run");
    false
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free loopback port")
        .port()
}

fn temp_dir(label: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-{label}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("create a temp dir");
    dir
}

/// One private `redis-server`.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    config: Option<PathBuf>,
    child: Option<Child>,
    watchdog: Option<Child>,
}

impl RedisServer {
    /// Starts a server with extra `args` (`["--maxmemory", "4mb"]`); `None` when the binaries
    /// are missing (the test is skipped).
    pub fn start(args: &[&str]) -> Option<Self> {
        Self::start_with_config("", args)
    }

    /// Like [`start`](Self::start), with `config` written to a redis.conf read first (for
    /// directives the command line cannot carry, such as `rename-command CONFIG ""`).
    pub fn start_with_config(config: &str, args: &[&str]) -> Option<Self> {
        if !binaries_available() {
            return None;
        }
        let dir = temp_dir("redis");
        let config = (!config.is_empty()).then(|| {
            let path = dir.join("redis.conf");
            std::fs::write(&path, config).expect("write redis.conf");
            path
        });
        let mut server = RedisServer {
            port: 0,
            dir,
            args: args.iter().map(|a| a.to_string()).collect(),
            config,
            child: None,
            watchdog: None,
        };
        // A free port can be taken between the probe and the bind: try a few.
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn() {
                return Some(server);
            }
        }
        panic!("redis-server did not start; see {}", server.log().display());
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn log(&self) -> PathBuf {
        self.dir.join("redis.log")
    }

    /// Starts the process on `self.port`; `false` when it exited instead of answering PING.
    fn spawn(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        if let Some(config) = &self.config {
            cmd.arg(config);
        }
        cmd.arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--dir"])
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.log())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().expect("spawn redis-server");
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "read x; kill -9 {} 2>/dev/null; rm -rf '{}'",
                child.id(),
                self.dir.display()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let watchdog = match watchdog {
            Ok(w) => w,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("spawn the watchdog: {e}");
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if ping(self.port) {
                self.child = Some(child);
                self.watchdog = Some(watchdog);
                return true;
            }
            let exited = child.try_wait().ok().flatten().is_some();
            if exited || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                end_watchdog(watchdog);
                return false;
            }
            // Waiting for a process to come up, not ordering tasks.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL: a crash, not a shutdown). The port and dir stay reserved.
    pub fn stop(&mut self) {
        if let Some(w) = self.watchdog.take() {
            end_watchdog(w);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port, empty (nothing was persisted).
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `redis-cli -p PORT args...` and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn end_watchdog(mut w: Child) {
    let _ = w.kill();
    let _ = w.wait();
}

/// Runs `redis-cli -p port args...` and returns its stdout.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `true` when a server on `port` answers PING.
pub fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// A Redis Cluster of three primaries and no replicas, on private servers.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes, joins them with `redis-cli --cluster create` and waits for
    /// `cluster_state:ok` on each. `None` when the binaries are missing.
    pub fn start() -> Option<Self> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            // The bus port defaults to port + 10000, which may not be free (or exist): pick it.
            let bus = free_port().to_string();
            let node = RedisServer::start(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                &bus,
                "--cluster-node-timeout",
                "5000",
            ])?;
            nodes.push(node);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addrs.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        let out = Command::new("redis-cli")
            .args(&create)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
                assert!(
                    Instant::now() < deadline,
                    "cluster never reached cluster_state:ok"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(RedisCluster { nodes })
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

/// A store that owns the server it talks to, so the server lives exactly as long as the test
/// holds the store.
pub struct WithServer<S> {
    pub store: S,
    pub server: RedisServer,
}

#[async_trait::async_trait]
impl<S: tower_idempotency::store::IdempotencyStore> tower_idempotency::store::IdempotencyStore
    for WithServer<S>
{
    async fn claim(
        &self,
        request: &ClaimRequest<'_>,
    ) -> Result<tower_idempotency::store::ClaimOutcome, tower_idempotency::store::StoreError> {
        self.store.claim(request).await
    }

    async fn extend(
        &self,
        id: &tower_idempotency::store::RecordId,
        token: &tower_idempotency::store::Token,
        lease: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store.extend(id, token, lease).await
    }

    async fn complete(
        &self,
        id: &tower_idempotency::store::RecordId,
        token: &tower_idempotency::store::Token,
        completion: &tower_idempotency::store::Completion,
        ttl: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store.complete(id, token, completion, ttl).await
    }

    async fn release(
        &self,
        id: &tower_idempotency::store::RecordId,
        token: &tower_idempotency::store::Token,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store.release(id, token).await
    }

    async fn get(
        &self,
        id: &tower_idempotency::store::RecordId,
    ) -> Result<Option<tower_idempotency::store::Record>, tower_idempotency::store::StoreError>
    {
        self.store.get(id).await
    }
}
