//! Connecting: the pool `connect` builds, its server-side timeouts and keepalives, and TLS.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use super::migrate::SetupError;
use super::{PostgresStore, PostgresStoreBuilder, DEFAULT_TIMEOUT};
use crate::store::{StoreError, StoreErrorKind};

/// `statement_timeout` and `lock_timeout` for operations bounded by `t` (see above), in whole
/// milliseconds, at least 1 (0 would turn them off).
fn server_timeouts(t: Duration) -> (u128, u128) {
    let ms = |d: Duration| d.as_millis().max(1);
    (ms(t / 2), ms(t * 2 / 5))
}

/// The connection options `connect` adds: the server-side timeouts for `t`.
fn timeout_options(existing: Option<&str>, t: Duration) -> String {
    let (statement, lock) = server_timeouts(t);
    let ours = format!("-c statement_timeout={statement} -c lock_timeout={lock}");
    match existing {
        Some(o) if !o.trim().is_empty() => format!("{o} {ours}"),
        _ => ours,
    }
}

/// TCP keepalive probes: a half-open connection (a failed-over server) is noticed in about
/// 30 s + 3 × 10 s, not the OS default of two hours.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;

/// libpq's `prefer` and `require`: TLS with the ring provider (never OpenSSL), the
/// handshake's signatures checked, the certificate chain and name not.
#[cfg(feature = "postgres-tls")]
fn encrypt_only_config() -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
        .with_no_client_auth()
}

/// Accepts any server certificate (libpq's `sslmode=require`), but still checks that the
/// server holds the certificate's key.
#[cfg(feature = "postgres-tls")]
#[derive(Debug)]
struct EncryptOnly(Arc<rustls::crypto::CryptoProvider>);

#[cfg(feature = "postgres-tls")]
impl rustls::client::danger::ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// What `connect` built its pool from.
pub(super) struct Owned {
    pub(super) config: tokio_postgres::Config,
    pub(super) tls: Tls,
}

/// How `connect` reaches the server.
#[derive(Clone)]
pub(super) enum Tls {
    /// Plaintext only: built without `postgres-tls`. `sslmode=require` then fails to connect.
    #[cfg_attr(feature = "postgres-tls", allow(dead_code))]
    None,
    /// rustls, as `sslmode` says (`disable`, `prefer`, `require`).
    #[cfg(feature = "postgres-tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

impl PostgresStore {
    /// The pool `connect` makes: 16 connections, each with the server-side timeouts for
    /// `timeout` (see [`server_timeouts`]). Does no I/O.
    pub(super) fn owned_pool(owned: &Owned, timeout: Duration) -> Result<Pool, StoreError> {
        let mut config = owned.config.clone();
        let options = timeout_options(config.get_options(), timeout);
        config.options(options);
        let manager_config = deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        };
        let manager = match &owned.tls {
            Tls::None => deadpool_postgres::Manager::from_config(
                config,
                tokio_postgres::NoTls,
                manager_config,
            ),
            #[cfg(feature = "postgres-tls")]
            Tls::Rustls(tls) => {
                deadpool_postgres::Manager::from_config(config, tls.clone(), manager_config)
            }
        };
        Pool::builder(manager)
            .max_size(16)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .create_timeout(Some(DEFAULT_TIMEOUT))
            .build()
            .map_err(|e| StoreError::with_source(StoreErrorKind::Other, e))
    }
}

impl PostgresStoreBuilder {
    /// Connects to `url` (a `postgres://` URL or a key-value string) with a pool of 16
    /// connections, and checks that one connection opens.
    ///
    /// TLS: with the `postgres-tls` feature, connections use rustls as the URL's `sslmode`
    /// says, with libpq's meaning: `disable` (plaintext), `prefer` (the default: TLS when the
    /// server offers it) or `require` (TLS or no connection). As in libpq, these modes
    /// encrypt but do not verify the server's certificate, so they work with any server
    /// (self-signed, a managed service's private CA) and stop eavesdroppers, not an active
    /// man in the middle. To verify the server (libpq's `verify-full`), use
    /// [`connect_with_tls`](Self::connect_with_tls) with the CA that signed its certificate.
    /// Without the feature connections are plaintext: `prefer` falls back to plaintext and
    /// `require` fails.
    ///
    /// The connections' `application_name` is `tower-idempotency` unless the URL sets one.
    /// Their `statement_timeout` and `lock_timeout` sit just below the store's
    /// [timeout](Self::with_timeout), so the server ends a blocked statement itself, and TCP
    /// keepalives notice a dead peer within about a minute.
    /// For other pool settings, build a [`Pool`] and use [`build`](Self::build).
    pub async fn connect(self, url: &str) -> Result<PostgresStore, SetupError> {
        #[cfg(feature = "postgres-tls")]
        let tls = Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(
            encrypt_only_config(),
        ));
        #[cfg(not(feature = "postgres-tls"))]
        let tls = Tls::None;
        self.connect_owned(url, tls).await
    }

    /// Like [`connect`](Self::connect), with your rustls configuration, which verifies the
    /// server's certificate and host name against your root certificates (a private CA such
    /// as a managed service's bundle), and may carry a client certificate. `sslmode` in the
    /// URL still decides whether TLS is used: give `require`, so that no connection falls
    /// back to plaintext.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::postgres::{rustls, PostgresStore};
    ///
    /// let ca = std::fs::read("/etc/ssl/private-ca.der")?;
    /// let mut roots = rustls::RootCertStore::empty();
    /// roots.add(ca.into())?;
    /// let tls = rustls::ClientConfig::builder()
    ///     .with_root_certificates(roots)
    ///     .with_no_client_auth();
    /// let store = PostgresStore::builder()
    ///     .connect_with_tls(
    ///     "postgres://app@db.internal/app?sslmode=require",
    ///     tls,
    /// )
    /// .await?;
    /// # drop(store); Ok(()) }
    /// ```
    #[cfg(feature = "postgres-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres-tls")))]
    pub async fn connect_with_tls(
        self,
        url: &str,
        tls: rustls::ClientConfig,
    ) -> Result<PostgresStore, SetupError> {
        let tls = Tls::Rustls(tokio_postgres_rustls::MakeRustlsConnect::new(tls));
        self.connect_owned(url, tls).await
    }

    async fn connect_owned(self, url: &str, tls: Tls) -> Result<PostgresStore, SetupError> {
        let mut config: tokio_postgres::Config = url.parse().map_err(SetupError::Url)?;
        if config.get_application_name().is_none() {
            config.application_name("tower-idempotency");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_TIMEOUT);
        }
        config
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(KEEPALIVE_INTERVAL)
            .keepalives_retries(KEEPALIVE_RETRIES);
        let owned = Owned { config, tls };
        // Building a pool only fails for a broken runtime setup, which a test would catch.
        let pool = PostgresStore::owned_pool(&owned, self.timeout)
            .expect("a deadpool pool with the tokio runtime builds");
        drop(pool.get().await.map_err(SetupError::Connect)?);
        Ok(PostgresStore::with_parts(pool, Some(Arc::new(owned)), self))
    }
}

impl PostgresStore {
    /// [`PostgresStore::builder().connect(url)`](PostgresStoreBuilder::connect): the
    /// defaults, on a pool of 16 connections to `url`.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timeouts_sit_below_the_first_attempt() {
        // The server ends a blocked statement (T/2) and a lock wait (2T/5) before the client
        // gives up on the first attempt (2T/3), and never turns them off (0).
        assert_eq!(server_timeouts(Duration::from_millis(300)), (150, 120));
        assert_eq!(server_timeouts(Duration::from_micros(1)), (1, 1));
        assert_eq!(
            timeout_options(Some("-c search_path=app"), Duration::from_secs(5)),
            "-c search_path=app -c statement_timeout=2500 -c lock_timeout=2000"
        );
        assert_eq!(
            timeout_options(None, Duration::from_secs(5)),
            "-c statement_timeout=2500 -c lock_timeout=2000"
        );
    }
}
