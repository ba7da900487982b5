//! The Redis Streams consumer example (`examples/consumer`), as processes: a producer sends
//! each payment twice, two consumers apply them, one is killed with SIGKILL in the middle of
//! a payment, and the survivor claims its pending entries (XAUTOCLAIM), waits out its lease,
//! takes its payment over and finishes: one row per payment, none missing, nothing pending.
//!
//! Needs `IDEMPOTENCY_TEST_REDIS_URL` and `IDEMPOTENCY_TEST_POSTGRES_URL`; skipped with a
//! printed reason when either is unset, unless `IDEMPOTENCY_REQUIRE_BACKENDS=1`. Its stream,
//! group and payment ids are its own, and so is its Postgres schema (the consumers' URL sets
//! `search_path`), dropped at the end with the store's table and `consumer_payments`.

use crate::support::backend::backend_url;
use crate::support::pg;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const PAYMENTS: usize = 40;
const WORK_MS: &str = "150";
const CLAIM_IDLE_MS: &str = "1500";
/// The survivor's `--until-idle`: its exit says every entry was acknowledged.
const UNTIL_IDLE_SECS: &str = "2";

/// Builds the example with this test binary's features (so the library build is shared),
/// and returns its path: `cargo test --all-features` built it already, `cargo test --test
/// examples` did not.
fn consumer_binary() -> PathBuf {
    let features: Vec<&str> = [
        ("redis", cfg!(feature = "redis")),
        ("postgres", cfg!(feature = "postgres")),
        ("conformance", cfg!(feature = "conformance")),
        ("axum", cfg!(feature = "axum")),
        ("postgres-tls", cfg!(feature = "postgres-tls")),
        ("redis-tls", cfg!(feature = "redis-tls")),
        ("client", cfg!(feature = "client")),
        ("metrics", cfg!(feature = "metrics")),
        ("sqlx", cfg!(feature = "sqlx")),
        ("utoipa", cfg!(feature = "utoipa")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--example", "consumer", "--features"])
        .arg(features.join(","));
    if !cfg!(debug_assertions) {
        cargo.arg("--release");
    }
    let status = cargo.status().expect("run cargo build --example consumer");
    assert!(status.success(), "cargo build --example consumer failed");
    let mut path = std::env::current_exe().unwrap();
    path.pop();
    if path.ends_with("deps") {
        path.pop();
    }
    path.join("examples").join("consumer")
}

/// A running example, its stdout and stderr collected line by line into one list (its logs
/// go to stdout, beside the summary line; its errors to stderr).
struct Proc {
    name: &'static str,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    readers: Vec<JoinHandle<()>>,
}

fn collect(pipe: impl Read + Send + 'static, into: Arc<Mutex<Vec<String>>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            into.lock().unwrap().push(line);
        }
    })
}

impl Proc {
    fn start(name: &'static str, mut cmd: Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        let lines = Arc::default();
        let readers = vec![
            collect(child.stdout.take().unwrap(), Arc::clone(&lines)),
            collect(child.stderr.take().unwrap(), Arc::clone(&lines)),
        ];
        Self {
            name,
            child,
            lines,
            readers,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits for the process to end, at most `limit`; its status, or `None` if it still runs.
    fn wait_for(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let until = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                for reader in self.readers.drain(..) {
                    let _ = reader.join();
                }
                return Some(status);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, then the rest of its output.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.wait_for(Duration::from_secs(10));
    }

    /// Its last lines, for a failure message.
    fn tail(&self) -> String {
        let lines = self.lines();
        let from = lines.len().saturating_sub(40);
        format!(
            "--- {} (last {} lines)\n{}",
            self.name,
            lines.len() - from,
            lines[from..].join("\n")
        )
    }
}

impl Drop for Proc {
    /// Every exit path, a failed assertion included, leaves no consumer running.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Deletes the stream (and its group) and drops the schema, on every exit path. Declared
/// before the processes, so they are killed first.
struct Cleanup {
    redis_url: String,
    stream: String,
    pg_url: String,
    schema: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Ok(mut con) =
            redis::Client::open(self.redis_url.as_str()).and_then(|c| c.get_connection())
        {
            let _: Result<i64, _> = redis::cmd("DEL").arg(&self.stream).query(&mut con);
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema);
            if let Err(e) = pg::admin(&self.pg_url).await.batch_execute(&sql).await {
                eprintln!("cleanup: {sql}: {e}");
            }
        });
    }
}

/// `url` with `search_path` set to `schema`, for every connection the example opens.
fn in_schema(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20search_path%3D{schema}")
}

/// `key=value` pairs of the example's `summary` line.
fn summary(proc: &Proc) -> BTreeMap<String, u64> {
    let lines = proc.lines();
    let line = lines
        .iter()
        .find(|l| l.starts_with("summary "))
        .unwrap_or_else(|| panic!("{} printed no summary line\n{}", proc.name, proc.tail()));
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
        .collect()
}

/// The payment in the message of an `applying payment <id> from …` or `applied …` line.
fn payment_of<'a>(line: &'a str, verb: &str) -> Option<&'a str> {
    let rest = &line[line.find(verb)? + verb.len()..];
    rest.split_whitespace().next()
}

#[test]
fn a_consumer_killed_mid_payment_leaves_it_to_the_survivor_and_each_payment_is_applied_once() {
    let Some(redis_url) = backend_url("IDEMPOTENCY_TEST_REDIS_URL") else {
        return;
    };
    let Some(pg_url) = pg::url() else {
        return;
    };
    let started = Instant::now();
    let binary = consumer_binary();
    let built = started.elapsed();

    let tag = pg::unique("consumer");
    let (stream, group, run) = (
        format!("{tag}-payments"),
        format!("{tag}-payers"),
        tag.clone(),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let admin = rt.block_on(async {
        let admin = pg::admin(&pg_url).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA {tag}"))
            .await
            .unwrap();
        admin
    });
    let _cleanup = Cleanup {
        redis_url: redis_url.clone(),
        stream: stream.clone(),
        pg_url: pg_url.clone(),
        schema: tag.clone(),
    };
    let database_url = in_schema(&pg_url, &tag);
    let example = |args: &[&str]| {
        let mut cmd = Command::new(&binary);
        cmd.args(args)
            .env("REDIS_URL", &redis_url)
            .env("DATABASE_URL", &database_url)
            .env("STREAM", &stream)
            .env("GROUP", &group)
            .env("WORK_MS", WORK_MS)
            .env("CLAIM_IDLE_MS", CLAIM_IDLE_MS)
            .env_remove("LEASE_MS")
            // The kill waits for an `applying payment` line, an INFO event.
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1");
        cmd
    };

    let mut producer = Proc::start(
        "producer",
        example(&["--produce", &PAYMENTS.to_string(), "--run", &run]),
    );
    let status = producer.wait_for(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "the producer failed: {status:?}\n{}",
        producer.tail()
    );

    let mut victim = Proc::start("victim", {
        let mut cmd = example(&["--until-idle", UNTIL_IDLE_SECS]);
        cmd.env("CONSUMER_NAME", "victim");
        cmd
    });
    let mut survivor = Proc::start("survivor", {
        let mut cmd = example(&["--until-idle", UNTIL_IDLE_SECS]);
        cmd.env("CONSUMER_NAME", "survivor");
        cmd
    });

    // Both consumers at work, and the victim has applied a few payments; then it is killed
    // right after it logs that it is applying one more: that row is written but not
    // committed, and its WORK_MS sleep has just begun. That payment's record is left in
    // progress, its lease running out, and the victim's other entries pending.
    let wait_until = Instant::now() + Duration::from_secs(60);
    let survivor_ready = loop {
        let lines = survivor.lines();
        if lines.iter().any(|l| l.contains("reading")) {
            break true;
        }
        if Instant::now() > wait_until {
            break false;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(
        survivor_ready,
        "the survivor never started reading\n{}",
        survivor.tail()
    );
    let seen = victim.lines().len();
    let trigger = loop {
        let lines = victim.lines();
        // After its third `applied` line (and after the survivor started).
        let from = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains("applied payment "))
            .nth(2)
            .map(|(i, _)| (i + 1).max(seen));
        if let Some(line) = from.and_then(|from| {
            lines[from..]
                .iter()
                .find(|l| l.contains("applying payment "))
        }) {
            break Some(line.clone());
        }
        if Instant::now() > wait_until || !matches!(victim.child.try_wait(), Ok(None)) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let trigger = trigger.unwrap_or_else(|| {
        panic!(
            "the victim never applied a fourth payment to be killed in\n{}",
            victim.tail()
        )
    });
    victim.kill();
    let killed_at = started.elapsed();
    eprintln!("killed the victim at {killed_at:?}, after: {trigger}");

    // Which payment the kill interrupted: the victim's last `applying` without its `applied`.
    let victim_lines = victim.lines();
    let last_applying = victim_lines
        .iter()
        .rev()
        .find_map(|l| payment_of(l, "applying payment "))
        .expect("the trigger line is one")
        .to_owned();
    let interrupted = !victim_lines
        .iter()
        .any(|l| payment_of(l, "applied payment ") == Some(last_applying.as_str()));

    let status = survivor.wait_for(Duration::from_secs(120));
    let (rows, pending) = rt.block_on(async {
        let rows = admin
            .query(
                &format!(
                    "SELECT payment_id, count(*), max(generation) FROM {tag}.consumer_payments \
                     GROUP BY payment_id"
                ),
                &[],
            )
            .await
            .unwrap();
        let rows: BTreeMap<String, (i64, i64)> = rows
            .iter()
            .map(|r| (r.get(0), (r.get(1), r.get(2))))
            .collect();
        let mut con = redis::Client::open(redis_url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let pending: redis::Value = redis::cmd("XPENDING")
            .arg(&stream)
            .arg(&group)
            .query_async(&mut con)
            .await
            .unwrap();
        (rows, pending)
    });
    let pending = match pending {
        redis::Value::Array(parts) => match parts.first() {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("XPENDING answered {other:?}"),
        },
        other => panic!("XPENDING answered {other:?}"),
    };
    let Some(status) = status else {
        panic!(
            "the survivor did not finish within 120 s: {} of {PAYMENTS} payments applied, {pending} entries pending\n{}",
            rows.len(),
            survivor.tail()
        );
    };
    assert!(
        status.success(),
        "the survivor failed: {status}\n{}",
        survivor.tail()
    );

    let expected: Vec<String> = (0..PAYMENTS).map(|i| format!("{run}-{i}")).collect();
    let missing: Vec<&String> = expected
        .iter()
        .filter(|id| !rows.contains_key(*id))
        .collect();
    let doubled: Vec<(&String, i64)> = rows
        .iter()
        .filter(|(_, (n, _))| *n != 1)
        .map(|(id, (n, _))| (id, *n))
        .collect();
    let unexpected: Vec<&String> = rows.keys().filter(|id| !expected.contains(id)).collect();
    assert!(
        missing.is_empty() && doubled.is_empty() && unexpected.is_empty(),
        "missing {missing:?}, applied more than once {doubled:?}, unexpected {unexpected:?}\n{}\n{}",
        victim.tail(),
        survivor.tail()
    );
    assert_eq!(pending, 0, "entries left pending\n{}", survivor.tail());

    let taken_over: Vec<&String> = rows
        .iter()
        .filter(|(_, (_, generation))| *generation > 1)
        .map(|(id, _)| id)
        .collect();
    let victim_applied = victim_lines
        .iter()
        .filter(|l| l.contains("applied payment "))
        .count();
    let s = summary(&survivor);
    eprintln!(
        "consumer example: {PAYMENTS} payments ({} entries), {} rows, {} with generation > 1 \
         {taken_over:?}; the victim applied {victim_applied} and was killed in {last_applying} \
         (interrupted: {interrupted}); survivor {s:?}; built in {built:?}, ran in {:?}",
        PAYMENTS * 2,
        rows.len(),
        taken_over.len(),
        started.elapsed() - built
    );
    assert!(
        s["claimed"] >= 1,
        "the survivor claimed none of the victim's entries\n{}",
        survivor.tail()
    );
    if interrupted {
        // The victim held the record and its row was rolled back: whoever applied it did so
        // by taking the record over, after its lease lapsed.
        assert!(
            rows[&last_applying].1 >= 2,
            "{last_applying}, interrupted mid-work, was applied at generation {}, not by a takeover\n{}",
            rows[&last_applying].1,
            survivor.tail()
        );
        assert!(
            s["takeovers"] >= 1,
            "the survivor counted no takeover: {s:?}"
        );
    } else {
        eprintln!("the kill landed after {last_applying} committed: no takeover to check");
    }
}
