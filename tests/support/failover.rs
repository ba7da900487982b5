//! Replicated Redis for failover tests: a primary, replicas and Sentinels, each a private
//! server on a free loopback port (see `redis_harness`: every process is stopped by its own
//! PID when its handle drops, and by a watchdog if the test process dies). Also a TCP proxy
//! whose upstream can be switched, as a load balancer in front of Redis would be.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::redis_harness::RedisServer;

/// The master name every Sentinel here monitors.
pub const MASTER: &str = "tidem";

/// How long a Sentinel waits before it calls an unanswering primary down. Short, so a crash
/// is failed over within the suite's 5 s outage budget: 1 s to `+sdown`, then the vote and
/// the promotion (about 1 s on loopback).
pub const DOWN_AFTER_MS: u64 = 1000;

/// Sentinel's `failover-timeout`: how long a promotion may take before Sentinel gives it up.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(10);

/// A primary, its replicas and three Sentinels.
pub struct Topology {
    /// Every data node, the first one the primary at start.
    pub nodes: Vec<RedisServer>,
    pub sentinels: Vec<RedisServer>,
}

impl Topology {
    /// Starts a primary with `replicas` replicas and three Sentinels (quorum 2) and waits
    /// until the replicas are online and every Sentinel sees them and the other Sentinels.
    /// `None` when the binaries are missing.
    pub fn start(replicas: usize) -> Option<Self> {
        let primary = RedisServer::start(&[])?;
        let port = primary.port().to_string();
        let mut nodes = vec![primary];
        for _ in 0..replicas {
            nodes.push(RedisServer::start(&["--replicaof", "127.0.0.1", &port])?);
        }
        wait_for(Duration::from_secs(20), "replicas online", || {
            count(&nodes[0].cli(&["info", "replication"]), "state=online") == replicas
        });
        let config = format!(
            "sentinel monitor {MASTER} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {MASTER} {}\n\
             sentinel parallel-syncs {MASTER} {replicas}\n",
            FAILOVER_TIMEOUT.as_millis()
        );
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(RedisServer::start_with_config(&config, &["--sentinel"])?);
        }
        let topology = Topology { nodes, sentinels };
        topology.wait_until_settled(replicas);
        Some(topology)
    }

    /// Waits until every Sentinel agrees on one primary, sees `replicas` replicas of it and
    /// the two other Sentinels, and every replica is one Sentinel may promote: online at the
    /// primary, and to every Sentinel a plain `slave` (not down, not disconnected) whose link
    /// to the primary is up. A node restarted after a crash counts among `num-slaves` as soon
    /// as Sentinel reconfigures it, before it has synced; a forced failover that picks it
    /// then waits out the whole failover timeout.
    pub fn wait_until_settled(&self, replicas: usize) {
        wait_for(Duration::from_secs(40), "Sentinels settled", || {
            let primaries: Vec<Option<u16>> = self.sentinels.iter().map(primary_port).collect();
            let Some(primary) = primaries[0] else {
                return false;
            };
            primaries.iter().all(|p| *p == Some(primary))
                && count(
                    &super::redis_harness::cli(primary, &["info", "replication"]),
                    "state=online",
                ) == replicas
                && self.sentinels.iter().all(|s| {
                    let m = s.cli(&["sentinel", "master", MASTER]);
                    let r = s.cli(&["sentinel", "replicas", MASTER]);
                    field(&m, "num-other-sentinels") == Some(2)
                        && field(&m, "num-slaves") == Some(replicas as u64)
                        && !m.contains("s_down")
                        && values(&r, "flags").iter().filter(|f| *f == "slave").count() == replicas
                        && values(&r, "master-link-status")
                            .iter()
                            .filter(|f| *f == "ok")
                            .count()
                            == replicas
                })
        });
    }

    /// `SENTINEL FAILOVER`, until every Sentinel names a primary other than the one it
    /// started from; returns the new primary's port. Sentinel aborts a forced failover whose
    /// chosen replica does not report itself primary within `failover-timeout` (10 s here)
    /// and never retries it by itself, the old primary being healthy: so each attempt waits
    /// that long plus 5 s for the vote and the other Sentinels to learn of it, and then asks
    /// again, three times in all (45 s at worst).
    pub fn force_failover(&self) -> u16 {
        let old = self.primary_port();
        for attempt in 1..=3 {
            let reply = self.sentinels[0].cli(&["sentinel", "failover", MASTER]);
            // INPROG: an attempt the Sentinel still runs; waiting on it is what is wanted.
            assert!(
                reply.contains("OK") || reply.contains("INPROG"),
                "SENTINEL FAILOVER, attempt {attempt}: {reply}"
            );
            if poll_until(FAILOVER_TIMEOUT + Duration::from_secs(5), || {
                self.all_name_other_than(old)
            }) {
                return self.primary_port();
            }
            eprintln!(
                "forced failover attempt {attempt} not seen by every Sentinel; Sentinel 0 says:\n{}",
                self.sentinels[0].cli(&["sentinel", "replicas", MASTER])
            );
        }
        panic!("a forced failover: no new primary after 3 attempts");
    }

    fn all_name_other_than(&self, old: u16) -> bool {
        self.sentinels
            .iter()
            .all(|s| primary_port(s).is_some_and(|p| p != old))
    }

    /// `host:port` of each Sentinel.
    pub fn sentinel_addrs(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect()
    }

    /// `redis+sentinel://127.0.0.1:a,127.0.0.1:b,127.0.0.1:c/tidem`.
    pub fn sentinel_url(&self) -> String {
        format!(
            "redis+sentinel://{}/{MASTER}",
            self.sentinel_addrs().join(",")
        )
    }

    /// The port of the primary the first Sentinel names.
    pub fn primary_port(&self) -> u16 {
        primary_port(&self.sentinels[0]).expect("a Sentinel names the primary")
    }

    /// The node that is the primary now.
    pub fn primary_mut(&mut self) -> &mut RedisServer {
        let port = self.primary_port();
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("the primary is one of the nodes")
    }

    /// Waits until every Sentinel names a primary other than `old`, and returns its port.
    pub fn wait_for_new_primary(&self, old: u16, within: Duration) -> u16 {
        wait_for(within, "a new primary", || self.all_name_other_than(old));
        self.primary_port()
    }
}

/// The port of the primary `sentinel` names for [`MASTER`].
fn primary_port(sentinel: &RedisServer) -> Option<u16> {
    let out = sentinel.cli(&["sentinel", "get-master-addr-by-name", MASTER]);
    out.lines().nth(1)?.trim().parse().ok()
}

/// Every value of the field `name` in redis-cli's print of a list of maps (`SENTINEL
/// REPLICAS`): name and value on lines of their own.
fn values(text: &str, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.trim() == name {
            if let Some(v) = lines.next() {
                out.push(v.trim().to_owned());
            }
        }
    }
    out
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

/// A numeric field of `SENTINEL MASTER` (redis-cli prints name and value on lines of their
/// own).
fn field(text: &str, name: &str) -> Option<u64> {
    values(text, name).first()?.parse().ok()
}

/// Polls `ok` until it holds, panicking with `what` after `within`. For waiting on real
/// processes (a replica syncing, Sentinels agreeing), not for ordering tasks.
pub fn wait_for(within: Duration, what: &str, ok: impl FnMut() -> bool) {
    assert!(poll_until(within, ok), "{what}: not within {within:?}");
}

/// Polls `ok` every 50 ms until it holds (`true`) or `within` has passed (`false`).
fn poll_until(within: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !ok() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// A TCP proxy on a loopback port that sends each new connection to the upstream port set
/// last; connections already open stay where they are, as with a load balancer that follows
/// the primary.
pub struct SwitchProxy {
    pub port: u16,
    upstream: Arc<AtomicU16>,
    task: tokio::task::JoinHandle<()>,
}

impl SwitchProxy {
    pub async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(upstream));
        let t = target.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = t.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        SwitchProxy {
            port,
            upstream: target,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// New connections go to `port` from now on.
    pub fn switch(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }
}

impl Drop for SwitchProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
