//! A private Postgres primary and a streaming standby made with `pg_basebackup`, on free
//! loopback ports, in a temp dir owned by `postgres` (the server refuses to run as root).
//! Each server is the test's own child process, run as `postgres`, and is stopped by its PID
//! when its handle drops; a watchdog (a `sh` reading a pipe from the test process) stops it
//! too if the test process dies without unwinding.
#![allow(dead_code, unreachable_pub)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/postgresql/15/bin";

/// The uid and gid of `postgres`, or `None` (with the reason printed) when the binaries or
/// the user are missing.
fn postgres_user() -> Option<(u32, u32)> {
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    let found = Path::new(BIN).join("postgres").exists();
    match (found, id("-u"), id("-g")) {
        (true, Some(u), Some(g)) => Some((u, g)),
        _ => {
            let why = format!("{BIN}/postgres or the postgres user not found");
            if std::env::var("IDEMPOTENCY_REQUIRE_BACKENDS").as_deref() == Ok("1") {
                panic!("{why}, but IDEMPOTENCY_REQUIRE_BACKENDS=1: the backend is required");
            }
            eprintln!("SKIPPED: {why}, so this test did not run");
            None
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free loopback port")
        .port()
}

/// Runs a Postgres tool as `postgres`; panics with its output when it fails.
fn run(user: (u32, u32), tool: &str, args: &[&str]) {
    let out = Command::new(Path::new(BIN).join(tool))
        .args(args)
        .uid(user.0)
        .gid(user.1)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One server on a data dir.
pub struct PgNode {
    pub port: u16,
    data: PathBuf,
    user: (u32, u32),
    child: Option<Child>,
    watchdog: Option<Child>,
}

impl PgNode {
    fn start(user: (u32, u32), data: PathBuf, port: u16) -> Self {
        let mut node = PgNode {
            port,
            data,
            user,
            child: None,
            watchdog: None,
        };
        node.spawn();
        node
    }

    fn spawn(&mut self) {
        let log = self.data.with_extension("log");
        let child = Command::new(Path::new(BIN).join("postgres"))
            .arg("-D")
            .arg(&self.data)
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.data.parent().unwrap().display()
            ))
            .args(["-c", "fsync=off", "-c", "wal_level=replica"])
            .args(["-c", "max_wal_senders=4", "-c", "logging_collector=off"])
            .uid(self.user.0)
            .gid(self.user.1)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).map_or(Stdio::null(), Stdio::from))
            .spawn()
            .expect("spawn postgres");
        // SIGQUIT is Postgres's immediate shutdown: the postmaster ends its backends too.
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "read x; kill -QUIT {0} 2>/dev/null; sleep 2; kill -9 {0} 2>/dev/null",
                child.id()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the watchdog");
        self.child = Some(child);
        self.watchdog = Some(watchdog);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.ready() {
            assert!(
                Instant::now() < deadline,
                "postgres on {} did not start; see {}",
                self.port,
                log.display()
            );
            // Waiting for a process to come up, not ordering tasks.
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self) -> bool {
        Command::new(Path::new(BIN).join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// `host=127.0.0.1 port=…` for a URL's host list.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Immediate shutdown (SIGQUIT), then SIGKILL if it lingers: the node is gone.
    pub fn stop(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-QUIT", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `pg_ctl promote`: a standby becomes a primary.
    pub fn promote(&self) {
        run(
            self.user,
            "pg_ctl",
            &[
                "promote",
                "-w",
                "-t",
                "30",
                "-D",
                &self.data.display().to_string(),
            ],
        );
    }
}

impl Drop for PgNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A primary and one streaming standby, asynchronous unless made with
/// [`PgPair::start_sync`].
pub struct PgPair {
    pub primary: PgNode,
    pub standby: PgNode,
    dir: PathBuf,
}

impl PgPair {
    /// `initdb`, start, `pg_basebackup -R` of it, start the standby; waits until the
    /// primary streams to it. `None` when the binaries are missing.
    pub fn start() -> Option<Self> {
        let user = postgres_user()?;
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-pg-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(user.0), Some(user.1)).unwrap();
        let p = dir.join("primary");
        let s = dir.join("standby");
        let p_str = p.display().to_string();
        run(
            user,
            "initdb",
            &[
                "-D",
                &p_str,
                "-U",
                "postgres",
                "--auth=trust",
                "-N",
                "-E",
                "UTF8",
            ],
        );
        let primary = PgNode::start(user, p, free_port());
        run(
            user,
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                &s.display().to_string(),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
        );
        let standby = PgNode::start(user, s, free_port());
        let pair = PgPair {
            primary,
            standby,
            dir,
        };
        Some(pair)
    }

    /// [`start`](Self::start), then the standby made synchronous
    /// (`synchronous_standby_names = '*'`, `synchronous_commit = on`): the primary
    /// acknowledges a commit only once the standby has flushed it. Waits until
    /// `pg_stat_replication` says `sync`.
    pub fn start_sync() -> Option<Self> {
        let pair = Self::start()?;
        let psql = |sql: &str| -> String {
            let out = Command::new(Path::new(BIN).join("psql"))
                .args(["-h", "127.0.0.1", "-p", &pair.primary.port.to_string()])
                .args(["-U", "postgres", "-d", "postgres", "-tAc", sql])
                .stdin(Stdio::null())
                .output()
                .expect("run psql");
            assert!(
                out.status.success(),
                "psql {sql}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
        psql("SELECT pg_reload_conf()");
        let deadline = Instant::now() + Duration::from_secs(30);
        while psql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'") != "1" {
            assert!(
                Instant::now() < deadline,
                "the standby never became synchronous"
            );
            // Waiting for a server's state, not ordering tasks.
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(pair)
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        self.primary.stop();
        self.standby.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
