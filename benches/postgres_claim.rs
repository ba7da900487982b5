//! Run with: `cargo bench --bench postgres_claim --all-features`, with
//! `IDEMPOTENCY_TEST_POSTGRES_URL` naming a database on this machine that the bench may create
//! a table in, as a superuser (for `pg_stat_statements_reset`, `track_functions` and
//! `pg_walinspect`).
//!
//! What the Postgres store's claim costs the server, beside the raw statement it corresponds
//! to, measured in the same run:
//!
//! - a new key: the claim against a raw `INSERT … ON CONFLICT DO NOTHING` of the same columns
//!   and values into the same table;
//! - a replay of a completed record (a 70-byte answer): the claim against a raw `SELECT` of
//!   the record's columns by primary key.
//!
//! The store and the raw statements each have a pool of one connection (so one server
//! process each), and their calls alternate, raw then claim then claim then raw,
//! `BENCH_KEYS` (default 20,000) of each per run, `BENCH_RUNS` (default 3) runs; the tables
//! show medians of the runs. Three measures:
//!
//! - server CPU: the on-CPU time of each connection's server process per call
//!   (`/proc/<pid>/schedstat`, so the server must run on this machine): everything the
//!   server does for the call, from reading the request to sending the answer and
//!   committing;
//! - `pg_stat_statements`: planning and execution time per call (load it with
//!   `shared_preload_libraries` and set `pg_stat_statements.track_planning = on`, on a
//!   private server: the bench resets it). It leaves out setting the plan up and tearing it
//!   down (ExecutorStart and ExecutorEnd), which is most of a short statement's cost, but
//!   counts that of statements a function runs;
//! - client latency, median: the call as the application sees it, through the store.
//!
//! WAL per new key is `pg_current_wal_lsn()` before and after `BENCH_WAL_KEYS` (default
//! 5,000) claims, then as many raw inserts, commits included; with `pg_walinspect`
//! (PostgreSQL 15) the same range is split into full-page images and index entries (B-tree
//! leaf insertions). Nothing else should write to the server meanwhile.
#![allow(missing_docs)]

#[cfg(feature = "postgres")]
mod bench {
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};
    use tower_idempotency::store::postgres::{deadpool_postgres, tokio_postgres, PostgresStore};
    use tower_idempotency::store::{
        ClaimOutcome, ClaimRequest, Completion, Fingerprint, IdempotencyStore, RecordId,
        RecordState, StoredResponse,
    };

    const TABLE: &str = "tidem_claim_bench";
    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(24 * 3600);
    const ANSWER: &[u8] = br#"{"id":"pay_1","amount":1000,"currency":"EUR","status":"succeeded"}"#;

    const RAW_INSERT: &str = "INSERT INTO tidem_claim_bench (id, fingerprint, state, generation, \
        nonce, locked_until, created_at, expires_at, scope) \
        VALUES ($1, $2, 0, 1, $3, clock_timestamp() + $4::bigint * interval '1 microsecond', \
        statement_timestamp(), \
        clock_timestamp() + GREATEST($4::bigint, $5::bigint) * interval '1 microsecond', NULL) \
        ON CONFLICT (id) DO NOTHING";
    const RAW_SELECT: &str = "SELECT generation, nonce, fingerprint, state, locked_until, status, \
        headers, body, trailers, recovery_point FROM tidem_claim_bench WHERE id = $1";

    fn env_num(var: &str, default: usize) -> usize {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    fn fingerprint(i: usize) -> Fingerprint {
        let mut b = [7u8; 32];
        b[..8].copy_from_slice(&(i as u64).to_be_bytes());
        Fingerprint::from_bytes(b)
    }

    fn nonce(i: usize) -> [u8; 16] {
        let mut b = [9u8; 16];
        b[..8].copy_from_slice(&(i as u64).to_be_bytes());
        b
    }

    fn answer() -> Completion {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/json".parse().unwrap());
        Completion::Response(StoredResponse::new(
            StatusCode::CREATED,
            headers,
            Bytes::from_static(ANSWER),
            None,
        ))
    }

    /// One statement's `pg_stat_statements` counters.
    #[derive(Debug, Default, Clone, Copy)]
    struct Statement {
        calls: i64,
        micros: f64,
        wal_bytes: f64,
        buffers: i64,
    }

    /// What the server reports for one case: the raw statement, the claim, and how many
    /// statements ran inside functions.
    #[derive(Debug, Default, Clone, Copy)]
    struct Statements {
        raw: Statement,
        claim: Statement,
        nested: i64,
    }

    /// What `f` returns, and how long it took in µs.
    async fn timed<T>(f: impl std::future::Future<Output = T>) -> (f64, T) {
        let t = Instant::now();
        let out = f.await;
        (t.elapsed().as_secs_f64() * 1e6, out)
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    }

    /// A pool of one connection, and its server process.
    async fn one_connection(url: &str) -> (deadpool_postgres::Pool, i32) {
        let config: tokio_postgres::Config = url.parse().unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(1)
            .build()
            .unwrap();
        let pid = pool
            .get()
            .await
            .unwrap()
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        (pool, pid)
    }

    /// On-CPU nanoseconds of a local process so far.
    fn cpu_ns(pid: i32) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?;
        stat.split_whitespace().next()?.parse().ok()
    }

    struct Bench {
        store: PostgresStore,
        store_pid: i32,
        raw: deadpool_postgres::Pool,
        raw_pid: i32,
        function: String,
        statements: bool,
        walinspect: bool,
        track_functions: bool,
    }

    impl Bench {
        async fn raw_insert(&self, id: &RecordId, i: usize) {
            let c = self.raw.get().await.unwrap();
            let s = c.prepare_cached(RAW_INSERT).await.unwrap();
            let (lease, ttl) = (LEASE.as_micros() as i64, TTL.as_micros() as i64);
            let n = c
                .execute(
                    &s,
                    &[
                        &id.as_bytes().as_slice(),
                        &fingerprint(i).as_bytes().as_slice(),
                        &nonce(i).as_slice(),
                        &lease,
                        &ttl,
                    ],
                )
                .await
                .unwrap();
            assert_eq!(n, 1);
        }

        async fn raw_select(&self, id: &RecordId) {
            let c = self.raw.get().await.unwrap();
            let s = c.prepare_cached(RAW_SELECT).await.unwrap();
            let row = c.query_one(&s, &[&id.as_bytes().as_slice()]).await.unwrap();
            assert_eq!(row.get::<_, Vec<u8>>("body").len(), ANSWER.len());
        }

        async fn claim(&self, id: &RecordId, i: usize) -> ClaimOutcome {
            self.store
                .claim(&ClaimRequest::new(id, &fingerprint(i), LEASE, TTL))
                .await
                .unwrap()
        }

        async fn reset(&self) {
            if self.statements {
                let c = self.raw.get().await.unwrap();
                c.execute("SELECT pg_stat_statements_reset()", &[])
                    .await
                    .unwrap();
            }
        }

        /// The statements on the bench's table since the last reset: the raw statement, the
        /// store's claim (the other top-level statement on the table, the one with the most
        /// calls), and how many statements ran inside functions.
        async fn statements(&self, raw: &str) -> Option<Statements> {
            if !self.statements {
                return None;
            }
            let c = self.raw.get().await.unwrap();
            let rows = c
                .query(
                    "SELECT query, toplevel, calls,
                            total_plan_time + total_exec_time AS ms,
                            wal_bytes::float8 AS wal, shared_blks_hit + shared_blks_read AS bufs
                       FROM pg_stat_statements
                      WHERE dbid = (SELECT oid FROM pg_database
                                     WHERE datname = current_database())",
                    &[],
                )
                .await
                .unwrap();
            let mut out = Statements::default();
            for row in rows {
                let query: String = row.get("query");
                let toplevel: bool = row.get("toplevel");
                let s = Statement {
                    calls: row.get("calls"),
                    micros: row.get::<_, f64>("ms") * 1000.0,
                    wal_bytes: row.get("wal"),
                    buffers: row.get("bufs"),
                };
                if !toplevel {
                    out.nested += s.calls;
                } else if query == raw {
                    out.raw = s;
                } else if query.contains(&format!("\"{TABLE}\"")) && s.calls > out.claim.calls {
                    out.claim = s;
                }
            }
            Some(out)
        }

        /// Calls of the claim functions (either) by the store's connection so far.
        async fn function_calls(&self) -> Option<i64> {
            if !self.track_functions {
                return None;
            }
            let c = self.store.pool().get().await.unwrap();
            // Flushed when this statement's transaction ends; read in the next one.
            c.execute("SELECT pg_stat_force_next_flush()", &[])
                .await
                .unwrap();
            let row = c
                .query_opt(
                    "SELECT sum(calls)::bigint FROM pg_stat_user_functions
                      WHERE funcname IN ($1, $2)",
                    &[&self.function, &format!("{TABLE}_claim_new_v1")],
                )
                .await
                .unwrap();
            Some(row.and_then(|r| r.get::<_, Option<i64>>(0)).unwrap_or(0))
        }

        fn cpu(&self) -> Option<(f64, f64)> {
            Some((cpu_ns(self.raw_pid)?, cpu_ns(self.store_pid)?))
        }

        async fn lsn(&self) -> String {
            let c = self.raw.get().await.unwrap();
            c.query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .unwrap()
                .get(0)
        }

        /// WAL bytes between two LSNs, and with `pg_walinspect` the full-page image bytes and
        /// the B-tree leaf entries written.
        async fn wal(&self, from: &str, to: &str) -> (f64, Option<(f64, i64)>) {
            let c = self.raw.get().await.unwrap();
            let bytes: f64 = c
                .query_one(
                    "SELECT pg_wal_lsn_diff($2::text::pg_lsn, $1::text::pg_lsn)::float8",
                    &[&from, &to],
                )
                .await
                .unwrap()
                .get(0);
            if !self.walinspect {
                return (bytes, None);
            }
            // A leaf entry is a leaf insertion, or the new item of a leaf split; every leaf
            // split puts one downlink into its parent (INSERT_UPPER, or NEWROOT at the root),
            // while an internal page's split carries its parent's new downlink, no leaf entry.
            let row = c
                .query_one(
                    "SELECT coalesce(sum(fpi_length), 0)::float8,
                            count(*) FILTER (WHERE resource_manager = 'Btree'
                                AND record_type IN ('INSERT_LEAF', 'INSERT_POST',
                                                    'INSERT_UPPER', 'NEWROOT'))
                       FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn)",
                    &[&from, &to],
                )
                .await
                .unwrap();
            (bytes, Some((row.get(0), row.get(1))))
        }
    }

    /// One case of one run.
    #[derive(Default)]
    struct Case {
        client_raw: f64,
        client_claim: f64,
        /// Server CPU µs per call: raw, claim.
        cpu: Option<(f64, f64)>,
        statements: Option<Statements>,
        function_calls: Option<i64>,
    }

    struct Wal {
        claim: (f64, Option<(f64, i64)>),
        raw: (f64, Option<(f64, i64)>),
        keys: usize,
    }

    struct Run {
        new: Case,
        replay: Case,
        wal: Wal,
    }

    /// Alternates `raw(i)` and `claim(i)` for `keys` calls each.
    async fn case<R, C, RF, CF>(b: &Bench, keys: usize, sql: &str, raw: R, claim: C) -> Case
    where
        R: Fn(usize) -> RF,
        RF: std::future::Future<Output = ()>,
        C: Fn(usize) -> CF,
        CF: std::future::Future<Output = ()>,
    {
        let calls_before = b.function_calls().await;
        b.reset().await;
        let cpu_before = b.cpu();
        let (mut raw_us, mut claim_us) = (Vec::with_capacity(keys), Vec::with_capacity(keys));
        for i in 0..keys {
            if i % 2 == 0 {
                raw_us.push(timed(raw(i)).await.0);
            }
            claim_us.push(timed(claim(i)).await.0);
            if i % 2 == 1 {
                raw_us.push(timed(raw(i)).await.0);
            }
        }
        let cpu = match (cpu_before, b.cpu()) {
            (Some((r0, c0)), Some((r1, c1))) => {
                let per_call = |ns: f64| ns / 1000.0 / keys as f64;
                Some((per_call(r1 - r0), per_call(c1 - c0)))
            }
            _ => None,
        };
        let statements = b.statements(sql).await;
        let function_calls = match (calls_before, b.function_calls().await) {
            (Some(before), Some(after)) => Some(after - before),
            _ => None,
        };
        Case {
            client_raw: median(&mut raw_us),
            client_claim: median(&mut claim_us),
            cpu,
            statements,
            function_calls,
        }
    }

    async fn run_once(b: &Bench, run: usize, keys: usize, wal_keys: usize) -> Run {
        let id = |kind: &str, i: usize| RecordId::new(None, &format!("{run}-{kind}-{i}"));
        // Warm up: statements prepared, plans cached (generic past the fifth execution).
        for i in 0..200 {
            b.raw_insert(&id("warm-raw", i), i).await;
            b.claim(&id("warm-claim", i), i).await;
        }

        let new = case(
            b,
            keys,
            RAW_INSERT,
            |i| async move { b.raw_insert(&id("raw", i), i).await },
            |i| async move {
                let outcome = b.claim(&id("new", i), i).await;
                assert!(
                    matches!(&outcome, ClaimOutcome::Claimed(c) if !c.takeover),
                    "{outcome:?}"
                );
            },
        )
        .await;

        // Replays of completed records.
        let completed = keys.min(1000);
        for i in 0..completed {
            let outcome = b.claim(&id("replayed", i), i).await;
            let ClaimOutcome::Claimed(c) = outcome else {
                panic!("{outcome:?}")
            };
            b.store
                .complete(&id("replayed", i), &c.token, &answer(), TTL)
                .await
                .unwrap();
        }
        let replay = case(
            b,
            keys,
            RAW_SELECT,
            |i| async move { b.raw_select(&id("replayed", i % completed)).await },
            |i| async move {
                let outcome = b.claim(&id("replayed", i % completed), i % completed).await;
                assert!(
                    matches!(&outcome, ClaimOutcome::Existing(r)
                        if matches!(r.state, RecordState::Completed(_))),
                    "{outcome:?}"
                );
            },
        )
        .await;

        // WAL per new key, commits included.
        let start = b.lsn().await;
        for i in 0..wal_keys {
            b.claim(&id("wal-claim", i), i).await;
        }
        let mid = b.lsn().await;
        for i in 0..wal_keys {
            b.raw_insert(&id("wal-raw", i), i).await;
        }
        let end = b.lsn().await;
        let wal = Wal {
            claim: b.wal(&start, &mid).await,
            raw: b.wal(&mid, &end).await,
            keys: wal_keys,
        };
        Run { new, replay, wal }
    }

    fn med(runs: &[Run], f: impl Fn(&Run) -> Option<f64>) -> Option<f64> {
        let mut v: Vec<f64> = runs.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&mut v))
    }

    fn fmt(v: Option<f64>, digits: usize) -> String {
        v.map_or("-".to_owned(), |v| format!("{v:.digits$}"))
    }

    /// Each measure of a case: its name, and the raw statement's and the claim's µs per call.
    fn measures(c: &Case) -> [(&'static str, Option<(f64, f64)>); 3] {
        let per_call = |s: &Statement| s.micros / s.calls.max(1) as f64;
        [
            ("server CPU", c.cpu),
            (
                "`pg_stat_statements`",
                c.statements.map(|s| (per_call(&s.raw), per_call(&s.claim))),
            ),
            (
                "client latency, median",
                Some((c.client_raw, c.client_claim)),
            ),
        ]
    }

    fn print(all: &[Run], keys: usize, wal_keys: usize) {
        type Pick = fn(&Run) -> &Case;
        let cases: [(&str, &str, Pick); 2] = [
            (
                "new key",
                "`INSERT … ON CONFLICT DO NOTHING`",
                |r: &Run| &r.new,
            ),
            ("replay", "`SELECT` by primary key", |r: &Run| &r.replay),
        ];
        println!(
            "\nmedians of {} runs, {keys} calls of each per run\n",
            all.len()
        );
        println!("| case | measure | raw µs | claim µs | claim / raw |");
        println!("|---|---|---:|---:|---:|");
        for (name, raw, pick) in cases {
            for m in 0..3 {
                let measure = measures(pick(&all[0]))[m].0;
                let raw_us = med(all, |r| measures(pick(r))[m].1.map(|v| v.0));
                let claim_us = med(all, |r| measures(pick(r))[m].1.map(|v| v.1));
                let ratio = med(all, |r| measures(pick(r))[m].1.map(|(a, b)| b / a));
                if raw_us.is_some() {
                    println!(
                        "| {name} (raw: {raw}) | {measure} | {} | {} | {}x |",
                        fmt(raw_us, 1),
                        fmt(claim_us, 1),
                        fmt(ratio, 2)
                    );
                }
            }
        }

        println!("\n| per call | raw insert | claim, new key | raw select | claim, replay |");
        println!("|---|---:|---:|---:|---:|");
        let stat = |pick: Pick, claim: bool, g: fn(&Statement) -> f64| {
            med(all, move |r| {
                pick(r).statements.map(|s| {
                    let s = if claim { s.claim } else { s.raw };
                    g(&s) / s.calls.max(1) as f64
                })
            })
        };
        let (new, replay) = (cases[0].2, cases[1].2);
        for (label, g) in [
            (
                "WAL bytes of the statement (`pg_stat_statements`)",
                (|s: &Statement| s.wal_bytes) as fn(&Statement) -> f64,
            ),
            ("shared buffers", |s: &Statement| s.buffers as f64),
        ] {
            println!(
                "| {label} | {} | {} | {} | {} |",
                fmt(stat(new, false, g), 1),
                fmt(stat(new, true, g), 1),
                fmt(stat(replay, false, g), 1),
                fmt(stat(replay, true, g), 1),
            );
        }
        let per_claim = |pick: Pick, g: fn(&Case) -> Option<f64>| {
            fmt(med(all, move |r| g(pick(r)).map(|n| n / keys as f64)), 2)
        };
        let sent = |c: &Case| c.statements.map(|s| s.claim.calls as f64);
        let nested = |c: &Case| c.statements.map(|s| s.nested as f64);
        let calls = |c: &Case| c.function_calls.map(|n| n as f64);
        for (label, g) in [
            ("statements sent", sent as fn(&Case) -> Option<f64>),
            ("statements run inside the claim function", nested),
            ("calls of a claim function", calls),
        ] {
            println!(
                "| {label} | | {} | | {} |",
                per_claim(new, g),
                per_claim(replay, g)
            );
        }

        println!(
            "\nWAL per new key, commits included (median of {} runs of {wal_keys} keys)\n",
            all.len()
        );
        println!("| statement | WAL bytes | of which full-page images | index entries |");
        println!("|---|---:|---:|---:|");
        for (label, claim) in [("claim", true), ("raw insert", false)] {
            let pick = |r: &Run| {
                let w = if claim { r.wal.claim } else { r.wal.raw };
                (w, r.wal.keys as f64)
            };
            let bytes = med(all, |r| {
                let ((b, _), n) = pick(r);
                Some(b / n)
            });
            let fpi = med(all, |r| {
                let ((_, i), n) = pick(r);
                i.map(|(f, _)| f / n)
            });
            let entries = med(all, |r| {
                let ((_, i), n) = pick(r);
                i.map(|(_, e)| e as f64 / n)
            });
            println!(
                "| {label} | {} | {} | {} |",
                fmt(bytes, 0),
                fmt(fpi, 0),
                fmt(entries, 2)
            );
        }
    }

    pub(crate) async fn main(url: &str) {
        let keys = env_num("BENCH_KEYS", 20_000);
        let wal_keys = env_num("BENCH_WAL_KEYS", 5_000);
        let runs = env_num("BENCH_RUNS", 3);
        let (raw, raw_pid) = one_connection(url).await;
        let (pool, store_pid) = one_connection(url).await;
        let store = PostgresStore::builder()
            .with_table(TABLE)
            .unwrap()
            .build(pool);
        let c = raw.get().await.unwrap();
        let function = format!("{TABLE}_claim_v3");
        c.batch_execute(&format!(
            "DROP TABLE IF EXISTS {TABLE};
             DROP FUNCTION IF EXISTS {TABLE}_claim_v2;
             DROP FUNCTION IF EXISTS {TABLE}_claim_new_v1;
             DROP FUNCTION IF EXISTS {function}"
        ))
        .await
        .unwrap();
        store.migrate().await.unwrap();
        let statements = c
            .batch_execute(
                "CREATE EXTENSION IF NOT EXISTS pg_stat_statements;
                 SELECT pg_stat_statements_reset()",
            )
            .await
            .is_ok();
        let walinspect = c
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .await
            .is_ok();
        drop(c);
        // Superuser only; set on the store's one connection.
        let track_functions = store
            .pool()
            .get()
            .await
            .unwrap()
            .batch_execute("SET track_functions = 'pl'")
            .await
            .is_ok();
        if !statements {
            eprintln!("pg_stat_statements is not loaded: no statement counters");
        }
        if cpu_ns(raw_pid).is_none() {
            eprintln!("the server's processes are not visible here: no server CPU");
        }
        let b = Bench {
            store,
            store_pid,
            raw,
            raw_pid,
            function,
            statements,
            walinspect,
            track_functions,
        };
        let mut all = Vec::new();
        for run in 0..runs {
            eprintln!("run {} of {runs}: {keys} keys per case", run + 1);
            let r = run_once(&b, run, keys, wal_keys).await;
            for (name, case) in [("new key", &r.new), ("replay", &r.replay)] {
                eprint!(
                    "  {name}: client median raw {:.1} µs, claim {:.1} µs",
                    case.client_raw, case.client_claim
                );
                if let Some((raw, claim)) = case.cpu {
                    eprint!("; server CPU raw {raw:.1} µs, claim {claim:.1} µs");
                }
                if let Some(s) = case.statements {
                    let per_call = |s: &Statement| s.micros / s.calls.max(1) as f64;
                    eprint!(
                        "; pg_stat_statements raw {:.2} µs, claim {:.2} µs",
                        per_call(&s.raw),
                        per_call(&s.claim)
                    );
                }
                eprintln!();
            }
            all.push(r);
        }
        print(&all, keys, wal_keys);

        b.raw
            .get()
            .await
            .unwrap()
            .batch_execute(&format!(
                "DROP TABLE {TABLE}; DROP FUNCTION {TABLE}_claim_v2; DROP FUNCTION {}; \
                 DROP FUNCTION {TABLE}_claim_new_v1",
                b.function
            ))
            .await
            .unwrap();
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    #[cfg(feature = "postgres")]
    match std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL") {
        Ok(url) => bench::main(&url).await,
        Err(_) => eprintln!("SKIPPED: IDEMPOTENCY_TEST_POSTGRES_URL is unset"),
    }
    #[cfg(not(feature = "postgres"))]
    eprintln!("SKIPPED: built without the `postgres` feature");
}
