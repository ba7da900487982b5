//! TLS to the stores: a private `redis-server` with `--tls-port` and a private Postgres
//! cluster with `ssl=on`, both with certificates made here for 127.0.0.1.
//!
//! Skipped, with the reason printed, when `redis-server` or Postgres' `initdb` is missing,
//! unless `IDEMPOTENCY_REQUIRE_BACKENDS=1`.

use crate::support::redis_harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use tower_idempotency::store::postgres::{rustls, PostgresStore};
use tower_idempotency::store::redis::RedisStore;
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore};
use tower_idempotency::store::{Fingerprint, RecordId};

/// A CA and a server certificate for 127.0.0.1 signed by it, as PEM files in `dir`.
struct Certs {
    ca_pem: String,
    ca_der: Vec<u8>,
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

fn make_certs(dir: &Path) -> Certs {
    std::fs::create_dir_all(dir).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "tower-idempotency test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &ca_cert, &ca_key)
        .unwrap();
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    Certs {
        ca_pem: ca_cert.pem(),
        ca_der: ca_cert.der().to_vec(),
        cert: write("server.crt", server.pem()),
        key: write("server.key", server_key.serialize_pem()),
        ca: write("ca.crt", ca_cert.pem()),
    }
}

fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-tls-{label}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn skip(why: &str) {
    if std::env::var("IDEMPOTENCY_REQUIRE_BACKENDS").as_deref() == Ok("1") {
        panic!("{why}, but IDEMPOTENCY_REQUIRE_BACKENDS=1: the backend is required");
    }
    eprintln!("SKIPPED: {why}, so this test did not run");
}

/// A claim and a read through `store`: the connection works end to end.
async fn round_trip(store: &dyn IdempotencyStore, key: &str) {
    let id = RecordId::new(Some("tls-test"), key);
    let fp = Fingerprint::from_bytes([3; 32]);
    let outcome = store
        .claim(&ClaimRequest::new(
            &id,
            &fp,
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    assert!(matches!(outcome, ClaimOutcome::Claimed(_)));
    assert!(store.get(&id).await.unwrap().is_some());
}

#[tokio::test]
async fn redis_over_tls_verifies_the_server_and_works_end_to_end() {
    if !redis_harness::binaries_available() {
        return;
    }
    let dir = temp_dir("redis");
    let certs = make_certs(&dir);
    let tls_port = redis_harness::free_port();
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let Some(server) = redis_harness::RedisServer::start(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &path(&certs.cert),
        "--tls-key-file",
        &path(&certs.key),
        "--tls-ca-cert-file",
        &path(&certs.ca),
        "--tls-auth-clients",
        "no",
        "--maxmemory-policy",
        "noeviction",
    ]) else {
        return;
    };
    let url = format!("rediss://127.0.0.1:{tls_port}/");

    // Trusting the test CA: connects, and the store works.
    let trusted = tower_idempotency::store::redis::redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(certs.ca_pem.clone().into_bytes()),
    };
    let store = RedisStore::builder()
        .with_timeout(Duration::from_secs(2))
        .connect_with_tls(&url, trusted)
        .await
        .expect("TLS with the test CA");
    round_trip(&store, "redis").await;

    // With the platform's roots only, the unknown CA is refused: the certificate is checked.
    let untrusted = RedisStore::builder()
        .with_timeout(Duration::from_secs(2))
        .connect(&url)
        .await;
    assert!(untrusted.is_err(), "an unknown CA must be refused");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The newest Postgres server binaries installed (`/usr/lib/postgresql/<version>/bin`).
fn postgres_bin() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop()
}

/// A private Postgres cluster with `ssl=on`, stopped and removed on drop.
struct PgCluster {
    bin: PathBuf,
    data: PathBuf,
    root: PathBuf,
    as_postgres: bool,
    port: u16,
}

impl PgCluster {
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if self.as_postgres {
            // initdb refuses to run as root.
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    fn start(certs_from: &Certs, root: PathBuf) -> Option<Self> {
        let Some(bin) = postgres_bin() else {
            skip("Postgres server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql");
            return None;
        };
        let is_root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        let data = root.join("data");
        let cluster = PgCluster {
            bin,
            data,
            root,
            as_postgres: is_root,
            port: redis_harness::free_port(),
        };
        if is_root {
            let owned = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&cluster.root)
                .status()
                .is_ok_and(|s| s.success());
            assert!(owned, "chown the cluster dir to postgres");
        }
        let init = cluster
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&cluster.data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(init.success(), "initdb failed");
        // The server reads its key only if the key is private to its user.
        for (from, to) in [
            (&certs_from.cert, "server.crt"),
            (&certs_from.key, "server.key"),
        ] {
            let target = cluster.data.join(to);
            std::fs::copy(from, &target).unwrap();
            let mut chmod = Command::new("chmod");
            chmod.arg("600").arg(&target);
            assert!(chmod.status().unwrap().success());
            if is_root {
                let chown = Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(&target)
                    .status()
                    .unwrap();
                assert!(chown.success());
            }
        }
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c ssl=on -c fsync=off",
            cluster.port,
            cluster.root.display()
        );
        let started = cluster
            .command("pg_ctl")
            .args(["-w", "-t", "30", "-D"])
            .arg(&cluster.data)
            .args(["-o", &options, "-l"])
            .arg(cluster.root.join("server.log"))
            .arg("start")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(
            started.success(),
            "pg_ctl start failed; see {}",
            cluster.root.join("server.log").display()
        );
        Some(cluster)
    }

    fn url(&self, sslmode: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode={sslmode}",
            self.port
        )
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args(["-m", "immediate", "-D"])
            .arg(&self.data)
            .arg("stop")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn trusting(ca_der: &[u8]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca_der.to_vec().into()).unwrap();
    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth()
}

/// Whether the store's own connection is encrypted, as the server sees it.
async fn encrypted(store: &PostgresStore) -> bool {
    let client = store.pool().get().await.unwrap();
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn postgres_over_tls_honours_sslmode_and_verifies_the_server() {
    let root = temp_dir("postgres");
    let certs = make_certs(&root);
    let Some(cluster) = PgCluster::start(&certs, root.clone()) else {
        let _ = std::fs::remove_dir_all(&root);
        return;
    };

    // `connect` with sslmode=require: encrypted (libpq's meaning: not verified).
    let store = PostgresStore::connect(&cluster.url("require"))
        .await
        .unwrap();
    assert!(encrypted(&store).await, "sslmode=require is encrypted");
    // sslmode=prefer (the default) uses TLS when the server offers it.
    let store = PostgresStore::connect(&cluster.url("prefer"))
        .await
        .unwrap();
    assert!(
        encrypted(&store).await,
        "sslmode=prefer is encrypted when offered"
    );
    // sslmode=disable stays plaintext, as asked.
    let store = PostgresStore::connect(&cluster.url("disable"))
        .await
        .unwrap();
    assert!(!encrypted(&store).await, "sslmode=disable is plaintext");

    // connect_with_tls verifies: the CA that signed the server's certificate is accepted,
    // and the store works end to end.
    let store = PostgresStore::builder()
        .connect_with_tls(&cluster.url("require"), trusting(&certs.ca_der))
        .await
        .expect("TLS with the test CA");
    assert!(encrypted(&store).await);
    store.migrate().await.unwrap();
    round_trip(&store, "postgres").await;
    // Another CA is refused: the certificate is checked, never ignored.
    let other = make_certs(&root.join("other"));
    let refused = PostgresStore::builder()
        .connect_with_tls(&cluster.url("require"), trusting(&other.ca_der))
        .await;
    assert!(
        refused.is_err(),
        "a certificate from another CA must be refused"
    );
    drop(cluster);
}
