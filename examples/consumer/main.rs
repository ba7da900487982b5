//! Run with: `cargo run --example consumer --features redis,postgres`
//!
//! A Redis Streams consumer group that applies `payment` messages exactly once in effect: each
//! payment is a row in Postgres (`consumer_payments`), written in the same transaction as the
//! payment's idempotency record ([`PostgresStore::record_output_in`]), so a redelivery, a
//! producer's retry or a takeover of a dead consumer's message finds either both (a replay:
//! acknowledge) or neither (apply it, once).
//!
//! ```sh
//! export REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test
//! # 20 payments, each sent twice (a producer that retried): 40 entries.
//! cargo run --example consumer --features redis,postgres -- --produce 20 --run demo
//! # Two consumers; kill -9 one mid-way: the other claims its entries and finishes them.
//! CONSUMER_NAME=a WORK_MS=300 cargo run --example consumer --features redis,postgres &
//! CONSUMER_NAME=b WORK_MS=300 cargo run --example consumer --features redis,postgres &
//! psql "$DATABASE_URL" -c 'SELECT payment_id, count(*), max(generation)
//!     FROM consumer_payments GROUP BY 1 ORDER BY 1'   # one row per payment
//! ```
//!
//! Settings, from the environment:
//! - `REDIS_URL` (required): the stream's server.
//! - `DATABASE_URL` (required to consume): the Postgres database of the idempotency records
//!   (the store's `idempotency_records`, migrated on start) and of `consumer_payments`
//!   (created if absent). Plaintext connections only (this example's own connection uses
//!   `NoTls`).
//! - `CONSUMER_NAME` (default `consumer-<pid>`): this consumer's name in the group. Keep it
//!   stable across restarts, so a restarted consumer finishes its own pending entries first.
//! - `STREAM` (default `payments`), `GROUP` (default `payers`): created with `MKSTREAM`, from
//!   the stream's start, if absent.
//! - `WORK_MS` (default 0): how long applying a payment takes, inside its transaction.
//! - `CLAIM_IDLE_MS` (default 2000): an entry pending on another consumer for longer than
//!   this is taken over with `XAUTOCLAIM` (its consumer is presumed dead). Keep it well
//!   above `WORK_MS`, or live consumers take each other's entries (harmless, wasteful).
//! - `LEASE_MS` (default `CLAIM_IDLE_MS`): the idempotency record's lease. A dead consumer's
//!   record stays in progress for at most this long after its last renewal; with the lease
//!   equal to `CLAIM_IDLE_MS`, the entry is claimed about when the lease lapses, and the
//!   survivor retries it (`InProgress`, with `retry_after`) only briefly before taking over.
//!
//! Arguments: `--produce N --run RUN` publishes payments `RUN-0` … `RUN-(N-1)`, each twice,
//! and exits; without it the consumer runs until killed, or with `--until-idle SECS` until
//! the stream has had no new entry and the group no pending entry for that long. Then it
//! prints one `summary` line on stdout.

#[path = "../common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Value};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower_idempotency::operation::{Identity, Json, OnceError, Operations};
use tower_idempotency::store::postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Timing};
use tracing::{error, info, warn};

use common::BoxError;

/// How long a record is kept: longer than any entry stays pending, or a very late
/// redelivery would apply its payment again.
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// How long to wait before retrying an entry whose work failed (the key was released).
const FAILED_RETRY: Duration = Duration::from_secs(1);
/// Entries per XAUTOCLAIM and per page of the pending list.
const PAGE: usize = 100;

/// The advisory lock `create_table` takes: any fixed number no other code of the database uses.
const CREATE_LOCK: i64 = 0x636f_6e73_756d_6572; // "consumer"
const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS consumer_payments (
    payment_id text NOT NULL,  -- deliberately not unique: a double application shows
    message_id text NOT NULL,
    generation bigint NOT NULL,
    applied_at timestamptz NOT NULL
)";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    common::init_tracing();
    common::exit_status("consumer", run().await)
}

async fn run() -> Result<(), BoxError> {
    let mode = Mode::from_args(std::env::args().skip(1))?;
    let stream = var("STREAM")?.unwrap_or_else(|| "payments".into());
    let group = var("GROUP")?.unwrap_or_else(|| "payers".into());
    let redis_url = var("REDIS_URL")?
        .ok_or("REDIS_URL is unset: the Redis server of the stream, e.g. redis://127.0.0.1:6379")?;
    let consume = match mode {
        Mode::Produce { count, run } => {
            let mut redis = connect_redis(&redis_url, Duration::ZERO).await?;
            return produce(&mut redis, &stream, &group, count, &run).await;
        }
        Mode::Consume { until_idle } => until_idle,
    };
    let database_url = var("DATABASE_URL")?.ok_or(
        "DATABASE_URL is unset: the Postgres database of the records and consumer_payments, \
         e.g. postgres://postgres@127.0.0.1:5432/test",
    )?;
    let name = var("CONSUMER_NAME")?.unwrap_or_else(|| format!("consumer-{}", std::process::id()));
    let work = millis("WORK_MS", 0)?;
    let claim_idle = millis("CLAIM_IDLE_MS", 2000)?;
    if claim_idle.is_zero() {
        return Err("CLAIM_IDLE_MS=0: an entry would be taken from a live consumer at once".into());
    }
    let lease = millis("LEASE_MS", claim_idle.as_millis() as u64)?;
    let timing = Timing::new(lease, RETENTION).map_err(|e| format!("LEASE_MS: {e}"))?;
    if work * 2 >= claim_idle {
        warn!("WORK_MS is not well below CLAIM_IDLE_MS: consumers will claim entries a live peer is still working on");
    }

    let store = PostgresStore::connect(&database_url).await?;
    store.migrate().await?;
    let mut db = Db {
        url: database_url,
        client: None,
    };
    create_table(db.client().await?).await?;
    // The layer only carries the configuration here: every operation names its own scope.
    let ops = IdempotencyLayer::new(store.clone())
        .with_timing(timing)
        .operations();

    // Short enough that our own pending entries are read again (which resets their idle
    // time) well within CLAIM_IDLE_MS, so a live peer does not claim them while we wait.
    let block = (claim_idle / 4).clamp(Duration::from_millis(1), Duration::from_secs(1));
    let mut redis = connect_redis(&redis_url, block).await?;
    create_group(&mut redis, &stream, &group).await?;
    // A batch is worked through in at most half of CLAIM_IDLE_MS, for the same reason.
    let per_batch = (claim_idle.as_millis() / (2 * work.as_millis()).max(1)).clamp(1, 10) as usize;
    info!("consumer {name} reading {stream} in group {group} (batches of {per_batch}, lease {lease:?}, claim after {claim_idle:?})");
    let consumer = Consumer {
        redis,
        ops,
        store,
        db,
        stream,
        group,
        name,
        work,
        claim_idle,
        block,
        per_batch,
        not_before: HashMap::new(),
        stats: Stats::default(),
    };
    consumer.consume(consume).await
}

enum Mode {
    Produce { count: u64, run: String },
    Consume { until_idle: Option<Duration> },
}

impl Mode {
    fn from_args(mut args: impl Iterator<Item = String>) -> Result<Self, BoxError> {
        const USAGE: &str = "usage: consumer [--until-idle SECS] | --produce N --run RUN";
        let (mut produce, mut run, mut until_idle) = (None, None, None);
        while let Some(arg) = args.next() {
            let mut value = || {
                args.next()
                    .ok_or_else(|| format!("{arg} needs a value; {USAGE}"))
            };
            match arg.as_str() {
                "--produce" => {
                    let v = value()?;
                    produce = Some(
                        v.parse::<u64>()
                            .map_err(|e| format!("--produce {v:?}: {e}"))?,
                    );
                }
                "--run" => run = Some(value()?),
                "--until-idle" => {
                    let v = value()?;
                    let secs = v.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0);
                    let secs =
                        secs.ok_or_else(|| format!("--until-idle {v:?}: expected seconds"))?;
                    until_idle = Some(Duration::from_secs_f64(secs));
                }
                _ => return Err(format!("unexpected argument {arg:?}; {USAGE}").into()),
            }
        }
        match (produce, run) {
            (Some(count), Some(run)) => Ok(Mode::Produce { count, run }),
            (Some(_), None) => {
                Err(format!("--produce needs --run RUN, the payment ids' prefix; {USAGE}").into())
            }
            (None, Some(_)) => Err(format!("--run goes with --produce; {USAGE}").into()),
            (None, None) => Ok(Mode::Consume { until_idle }),
        }
    }
}

/// A variable's value; unset or empty is `None`, and a value that is not UTF-8 an error.
fn var(name: &str) -> Result<Option<String>, BoxError> {
    match std::env::var(name) {
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(format!("{name}: {e}").into()),
    }
}

fn millis(name: &str, default: u64) -> Result<Duration, BoxError> {
    match var(name)? {
        None => Ok(Duration::from_millis(default)),
        Some(v) => v
            .parse()
            .map(Duration::from_millis)
            .map_err(|e| format!("{name}={v:?}: expected milliseconds: {e}").into()),
    }
}

/// A payment as the stream carries it, and as its fingerprint covers it.
#[derive(Debug, Serialize)]
struct Payment {
    id: String,
    amount: i64,
}

impl Payment {
    fn from_fields(fields: &[(String, String)]) -> Result<Self, String> {
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .ok_or_else(|| format!("no {name:?} field"))
        };
        let amount = field("amount")?;
        Ok(Self {
            id: field("id")?,
            amount: amount
                .parse()
                .map_err(|e| format!("amount {amount:?}: {e}"))?,
        })
    }
}

/// The operation's answer, recorded with the payment's row: who applied it, from which entry.
#[derive(Debug, Serialize, Deserialize)]
struct Applied {
    consumer: String,
    message_id: String,
    generation: u64,
}

async fn connect_redis(url: &str, block: Duration) -> Result<ConnectionManager, BoxError> {
    let client = redis::Client::open(url).map_err(|e| format!("REDIS_URL={url:?}: {e}"))?;
    // The default 500 ms response timeout would cut a blocking XREADGROUP short.
    let config =
        ConnectionManagerConfig::new().set_response_timeout(Some(block + Duration::from_secs(2)));
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| format!("REDIS_URL={url:?}: {e}").into())
}

/// The group, reading the stream from its start (`0`, not `$`: entries produced before the
/// first consumer started are delivered too).
async fn create_group(
    redis: &mut ConnectionManager,
    stream: &str,
    group: &str,
) -> Result<(), RedisError> {
    let created: Result<(), RedisError> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(redis)
        .await;
    match created {
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        other => other,
    }
}

async fn produce(
    redis: &mut ConnectionManager,
    stream: &str,
    group: &str,
    count: u64,
    run: &str,
) -> Result<(), BoxError> {
    create_group(redis, stream, group).await?;
    for i in 0..count {
        let payment = Payment {
            id: format!("{run}-{i}"),
            amount: 1000 + i as i64,
        };
        // Refused here rather than as a poison message in every consumer.
        Identity::json(&payment.id, &payment)
            .map_err(|e| format!("--run {run:?}: payment id {:?}: {e}", payment.id))?;
        // Twice, as a producer whose first XADD timed out and that sent it again.
        for _ in 0..2 {
            let _: String = redis::cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("id")
                .arg(&payment.id)
                .arg("amount")
                .arg(payment.amount)
                .query_async(redis)
                .await?;
        }
    }
    println!(
        "produced {count} payments ({} entries) to {stream}",
        count * 2
    );
    Ok(())
}

async fn create_table(client: &tokio_postgres::Client) -> Result<(), BoxError> {
    // Two consumers starting together race on CREATE TABLE IF NOT EXISTS (its catalog rows),
    // and the loser's error depends on where they collided. A transaction-scoped advisory
    // lock makes the second wait, then find the table.
    let ddl = format!("BEGIN; SELECT pg_advisory_xact_lock({CREATE_LOCK}); {CREATE_TABLE}; COMMIT");
    client.batch_execute(&ddl).await.map_err(|e| {
        let detail = e
            .as_db_error()
            .map_or_else(|| e.to_string(), ToString::to_string);
        format!("creating consumer_payments: {detail}").into()
    })
}

/// The business connection, apart from the store's pool, connected again once closed.
struct Db {
    url: String,
    client: Option<tokio_postgres::Client>,
}

impl Db {
    async fn client(&mut self) -> Result<&mut tokio_postgres::Client, tokio_postgres::Error> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let (client, connection) = tokio_postgres::connect(&self.url, NoTls).await?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    warn!(error = %e, "the business connection to Postgres ended");
                }
            });
            self.client = Some(client);
        }
        Ok(self.client.as_mut().expect("connected above"))
    }
}

/// One stream entry: `fields` is `None` for an entry deleted from the stream while pending.
struct Entry {
    id: String,
    fields: Option<Vec<(String, String)>>,
}

#[derive(Default)]
struct Stats {
    applied: u64,
    replayed: u64,
    takeovers: u64,
    claimed: u64,
    acked: u64,
    poison: u64,
    retries: u64,
}

struct Consumer {
    redis: ConnectionManager,
    ops: Operations,
    store: PostgresStore,
    db: Db,
    stream: String,
    group: String,
    name: String,
    work: Duration,
    claim_idle: Duration,
    block: Duration,
    per_batch: usize,
    /// Entries left pending after InProgress, StoreUnavailable or Failed: not retried before.
    not_before: HashMap<String, Instant>,
    stats: Stats,
}

impl Consumer {
    async fn consume(mut self, until_idle: Option<Duration>) -> Result<(), BoxError> {
        let mut cursor = "0-0".to_owned();
        let mut idle_since: Option<Instant> = None;
        loop {
            let read = match self.step(&mut cursor).await {
                Ok(read) => read,
                Err(e) => {
                    // Nothing is lost: unacknowledged entries stay pending and are read again.
                    warn!(error = %e, "redis failed; trying again in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            let Some(until_idle) = until_idle else {
                continue;
            };
            // Idle: nothing new, nothing of ours waiting, and nothing pending on anyone
            // (a dead consumer's entries count until they are claimed and acknowledged).
            if read == 0
                && self.not_before.is_empty()
                && self.pending_in_group().await.unwrap_or(1) == 0
            {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= until_idle {
                    break;
                }
            } else {
                idle_since = None;
            }
        }
        let s = &self.stats;
        println!(
            "summary consumer={} applied={} replayed={} takeovers={} claimed={} acked={} poison={} retries={}",
            self.name, s.applied, s.replayed, s.takeovers, s.claimed, s.acked, s.poison, s.retries
        );
        Ok(())
    }

    /// One round: claim a dead consumer's entries, work through our own pending entries (id
    /// `0`), then new ones (`>`). Returns how many new entries were read.
    async fn step(&mut self, cursor: &mut String) -> Result<usize, BoxError> {
        self.claim_abandoned(cursor).await?;
        let mut after = "0".to_owned();
        loop {
            // Reading our history also resets each entry's idle time, so a peer does not
            // claim the entries we are waiting to retry.
            let page = self.read(&after, None).await?;
            let Some(last) = page.last() else { break };
            after = last.id.clone();
            let full = page.len() == PAGE;
            for entry in page {
                if self
                    .not_before
                    .get(&entry.id)
                    .is_none_or(|t| *t <= Instant::now())
                {
                    self.handle(entry).await?;
                }
            }
            if !full {
                break;
            }
        }
        let block = match self.not_before.values().min() {
            Some(next) => next
                .saturating_duration_since(Instant::now())
                .min(self.block),
            None => self.block,
        }
        .max(Duration::from_millis(1));
        let new = self.read(">", Some(block)).await?;
        let read = new.len();
        for entry in new {
            self.handle(entry).await?;
        }
        Ok(read)
    }

    /// XAUTOCLAIM: entries idle past CLAIM_IDLE_MS become ours (a dead consumer's, mostly);
    /// they are then in our pending list, read right after. One page per round.
    async fn claim_abandoned(&mut self, cursor: &mut String) -> Result<(), BoxError> {
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.name)
            .arg(self.claim_idle.as_millis() as u64)
            .arg(cursor.as_str())
            .arg("COUNT")
            .arg(PAGE)
            .query_async(&mut self.redis)
            .await?;
        let Value::Array(parts) = reply else {
            return Err(format!("XAUTOCLAIM answered {reply:?}").into());
        };
        let (Some(next), Some(claimed)) = (parts.first().and_then(text), parts.get(1)) else {
            return Err(format!("XAUTOCLAIM answered {parts:?}").into());
        };
        let claimed = entries(claimed)?;
        if !claimed.is_empty() {
            info!(
                "claimed {} entries idle for over {:?}: {}",
                claimed.len(),
                self.claim_idle,
                claimed
                    .iter()
                    .map(|e| e.id.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            self.stats.claimed += claimed.len() as u64;
        }
        *cursor = next;
        Ok(())
    }

    /// XREADGROUP from `id`: our pending entries after `id`, or new ones for `>` (blocking).
    async fn read(&mut self, id: &str, block: Option<Duration>) -> Result<Vec<Entry>, BoxError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.group).arg(&self.name);
        match block {
            Some(block) => cmd
                .arg("COUNT")
                .arg(self.per_batch)
                .arg("BLOCK")
                .arg(block.as_millis() as u64),
            None => cmd.arg("COUNT").arg(PAGE),
        };
        cmd.arg("STREAMS").arg(&self.stream).arg(id);
        let reply: Value = cmd.query_async(&mut self.redis).await?;
        // Nil when BLOCK timed out; one [stream, entries] pair (a map under RESP3).
        let streams = match reply {
            Value::Nil => return Ok(Vec::new()),
            Value::Array(streams) => streams,
            Value::Map(streams) => streams
                .into_iter()
                .map(|(k, v)| Value::Array(vec![k, v]))
                .collect(),
            other => return Err(format!("XREADGROUP answered {other:?}").into()),
        };
        match streams.first() {
            Some(Value::Array(pair)) if pair.len() == 2 => entries(&pair[1]),
            None => Ok(Vec::new()),
            Some(other) => Err(format!("XREADGROUP answered {other:?}").into()),
        }
    }

    /// The group's pending count, across all its consumers (XPENDING's summary form).
    async fn pending_in_group(&mut self) -> Result<i64, RedisError> {
        let reply: Value = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(&self.group)
            .query_async(&mut self.redis)
            .await?;
        match reply {
            Value::Array(parts) => Ok(match parts.first() {
                Some(Value::Int(n)) => *n,
                _ => 1,
            }),
            _ => Ok(1),
        }
    }

    async fn ack(&mut self, id: &str) -> Result<(), RedisError> {
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(id)
            .query_async(&mut self.redis)
            .await?;
        self.not_before.remove(id);
        self.stats.acked += 1;
        Ok(())
    }

    /// Applies one entry's payment once, then acknowledges it, or leaves it pending to retry.
    async fn handle(&mut self, entry: Entry) -> Result<(), BoxError> {
        let Some(fields) = entry.fields else {
            warn!(
                "entry {} was deleted from the stream while pending; acknowledged",
                entry.id
            );
            return Ok(self.ack(&entry.id).await?);
        };
        let payment = match Payment::from_fields(&fields) {
            Ok(payment) => payment,
            Err(why) => {
                error!(
                    "poison message {}: {why}; acknowledged without applying",
                    entry.id
                );
                self.stats.poison += 1;
                return Ok(self.ack(&entry.id).await?);
            }
        };
        let mut ran = false;
        let outcome = self.apply(&entry.id, &payment, &mut ran).await;
        match outcome {
            Ok(applied) => {
                if ran {
                    self.stats.applied += 1;
                    if applied.generation > 1 {
                        self.stats.takeovers += 1;
                    }
                } else {
                    self.stats.replayed += 1;
                    info!(
                        "payment {} from {} was applied already, by {} from {}; acknowledged",
                        payment.id, entry.id, applied.consumer, applied.message_id
                    );
                }
            }
            // Applied earlier; only its answer is not readable.
            Err(e) if e.completed() => info!(
                "payment {} from {}: {e}; acknowledged",
                payment.id, entry.id
            ),
            // Retrying cannot help: another payload under this id, or an id that is no key.
            Err(e @ (OnceError::Mismatch | OnceError::Invalid(_))) => {
                error!(
                    "poison message {} (payment {}): {e}; acknowledged without applying",
                    entry.id, payment.id
                );
                self.stats.poison += 1;
            }
            // InProgress (another consumer, or a dead one's lease), StoreUnavailable, Failed.
            Err(e) => {
                let wait = e.retry_after().unwrap_or(FAILED_RETRY);
                match &e {
                    OnceError::InProgress { .. } => info!(
                        "payment {} from {}: in progress elsewhere; retrying in {wait:?}",
                        payment.id, entry.id
                    ),
                    _ => warn!(
                        "payment {} from {}: {e}; left pending, retrying in {wait:?}",
                        payment.id, entry.id
                    ),
                }
                self.stats.retries += 1;
                self.not_before.insert(entry.id, Instant::now() + wait);
                return Ok(());
            }
        }
        Ok(self.ack(&entry.id).await?)
    }

    /// The operation: the payment's row and its record, in one transaction.
    async fn apply(
        &mut self,
        message_id: &str,
        payment: &Payment,
        ran: &mut bool,
    ) -> Result<Applied, OnceError<BoxError>> {
        let identity = Identity::json(&payment.id, payment)
            .map_err(OnceError::Invalid)?
            .in_scope(self.stream.as_str());
        let (db, store, name, work) = (&mut self.db, &self.store, &self.name, self.work);
        self.ops
            .run(identity, &Json, move |ctx: IdempotencyContext| async move {
                *ran = true;
                let generation = ctx.generation();
                let client = db.client().await?;
                let tx = client.transaction().await?;
                tx.execute(
                    "INSERT INTO consumer_payments (payment_id, message_id, generation, applied_at)
                     VALUES ($1, $2, $3, now())",
                    &[&payment.id, &message_id, &i64::try_from(generation)?],
                )
                .await?;
                info!(
                    "applying payment {} from {message_id} (generation {generation})",
                    payment.id
                );
                tokio::time::sleep(work).await;
                let applied = Applied {
                    consumer: name.clone(),
                    message_id: message_id.to_owned(),
                    generation,
                };
                // Fenced (another consumer took over after our lease lapsed): dropping `tx`
                // rolls the row back, and the entry is retried, to find the other's answer.
                store.record_output_in(&tx, &ctx, &Json, &applied).await?;
                tx.commit().await?;
                info!(
                    "applied payment {} from {message_id} (generation {generation})",
                    payment.id
                );
                Ok::<_, BoxError>(applied)
            })
            .await
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// A list of `[id, [field, value, …]]` entries, as XREADGROUP and XAUTOCLAIM give them.
fn entries(v: &Value) -> Result<Vec<Entry>, BoxError> {
    let bad = || -> BoxError { format!("unexpected stream entries: {v:?}").into() };
    let Value::Array(items) = v else {
        return Err(bad());
    };
    items
        .iter()
        .map(|item| {
            let Value::Array(pair) = item else {
                return Err(bad());
            };
            let [id, fields] = pair.as_slice() else {
                return Err(bad());
            };
            let fields = match fields {
                Value::Nil => None,
                Value::Array(kv) => Some(
                    kv.chunks(2)
                        .map(|c| Some((text(&c[0])?, text(c.get(1)?)?)))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(bad)?,
                ),
                _ => return Err(bad()),
            };
            Ok(Entry {
                id: text(id).ok_or_else(bad)?,
                fields,
            })
        })
        .collect()
}
