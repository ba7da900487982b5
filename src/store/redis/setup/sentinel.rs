//! Connecting through Sentinel: its URL form, and asking the Sentinels for the primary.

use redis::sentinel::Sentinel;
use redis::Value;

use super::{timed_out, RedisStoreBuilder, SetupError};
use crate::store::redis::follow::Resolver;
use crate::store::redis::RedisStore;

/// The scheme of a URL that lists Sentinels.
pub(super) const SENTINEL_SCHEME: &str = "redis+sentinel://";

/// The default port of a Sentinel.
const SENTINEL_PORT: u16 = 26379;

/// `redis+sentinel://host:port[,host:port...]/<master-name>`: the Sentinels as
/// `redis://host:port` URLs, and the master name.
pub(super) fn parse_sentinel_url(url: &str) -> Result<(Vec<String>, String), SetupError> {
    let bad = |problem: &str| SetupError::SentinelUrl {
        url: url.to_owned(),
        problem: problem.to_owned(),
    };
    let rest = url
        .strip_prefix(SENTINEL_SCHEME)
        .ok_or_else(|| bad("it does not start with redis+sentinel://"))?;
    let (hosts, master) = rest
        .split_once('/')
        .ok_or_else(|| bad("the master name is missing after the hosts (/<master-name>)"))?;
    if hosts.contains('@') {
        return Err(bad(
            "credentials in the URL are not supported; the Sentinels and nodes are reached \
             without a password",
        ));
    }
    let master = master.trim_end_matches('/');
    if master.is_empty() {
        return Err(bad("the master name after the hosts is empty"));
    }
    if master.contains(['/', '?', '#']) {
        return Err(bad(
            "the master name must be one path segment, without a query",
        ));
    }
    let mut sentinels = Vec::new();
    for host in hosts.split(',') {
        let (name, port) = match host.rsplit_once(':') {
            Some((name, port)) if !name.ends_with(']') || host.starts_with('[') => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| bad(&format!("{host:?} has no valid port")))?;
                (name, port)
            }
            _ => (host, SENTINEL_PORT),
        };
        if name.is_empty() || name == "[]" {
            return Err(bad("a host is empty (two commas, or a comma at an end?)"));
        }
        sentinels.push(format!("redis://{name}:{port}"));
    }
    Ok((sentinels, master.to_owned()))
}

impl RedisStoreBuilder {
    /// Asks the Sentinels (`host:port`, or `redis://host:port`; any subset of them) for the
    /// primary named `master`, connects to it, checks it and loads the scripts, like
    /// [`connect`](Self::connect).
    ///
    /// The store then follows failovers by itself: when the primary answers `READONLY` or
    /// the connection to it is lost, it asks the Sentinels again and reconnects to the
    /// primary they name (scripts are loaded there; `NOSCRIPT` is handled in any case).
    /// The Redis nodes are reached without a password or TLS, on database 0.
    ///
    /// A Sentinel list where none answers is a [`SetupError::NoSentinel`], a name none of
    /// them monitors a [`SetupError::UnknownMaster`]; each names the fix.
    pub async fn connect_sentinel<I, S>(
        self,
        sentinels: I,
        master: &str,
    ) -> Result<RedisStore, SetupError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let urls: Vec<String> = sentinels
            .into_iter()
            .map(|s| {
                let s = s.as_ref();
                if s.contains("://") {
                    s.to_owned()
                } else {
                    format!("redis://{s}")
                }
            })
            .collect();
        let addrs: Vec<String> = urls
            .iter()
            .map(|u| u.split_once("://").map_or(u.as_str(), |(_, a)| a))
            .map(|a| a.trim_end_matches('/').to_owned())
            .collect();
        if urls.is_empty() || master.is_empty() {
            return Err(SetupError::SentinelUrl {
                url: format!("{SENTINEL_SCHEME}{}/{master}", addrs.join(",")),
                problem: "it needs at least one Sentinel and a master name".to_owned(),
            });
        }
        self.probe_sentinels(&urls, &addrs, master).await?;
        let sentinel = Sentinel::build(urls.clone())?;
        let sentinel = tokio::sync::Mutex::new(sentinel);
        let client = {
            let mut s = sentinel.lock().await;
            // Sentinel, then the named node (its role is checked): two steps.
            tokio::time::timeout(2 * self.timeout, s.async_master_for(master, None))
                .await
                .map_err(|_| timed_out(2 * self.timeout))??
        };
        let resolver = Resolver::Sentinel {
            sentinel: Box::new(sentinel),
            master: master.to_owned(),
        };
        let (events, timeout) = (self.failover_events, self.timeout);
        let store = self.connect_resolved(client, resolver).await?;
        if events {
            // Subscribed before the store is handed out, so no failover starts unheard.
            let n =
                crate::store::redis::events::watch(&store.inner.link, &urls, master, timeout).await;
            if n == 0 {
                tracing::warn!("no Sentinel took the subscription to failover events; the store learns of a failover when its primary refuses a write");
            }
        }
        Ok(store)
    }

    /// Asks each Sentinel, within the timeout, whether it monitors `master`, so that setup
    /// can say which of the two went wrong: no Sentinel answered, or none knows the name.
    async fn probe_sentinels(
        &self,
        urls: &[String],
        addrs: &[String],
        master: &str,
    ) -> Result<(), SetupError> {
        let probe = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let mut answered = Vec::new();
        let mut cause = None;
        for (url, addr) in urls.iter().zip(addrs) {
            let ask = async {
                let client = redis::Client::open(url.as_str())?;
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&probe)
                    .await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(master)
                    .query_async::<Value>(&mut conn)
                    .await
            };
            // Connect and one command: two steps.
            match tokio::time::timeout(2 * self.timeout, ask).await {
                Ok(Ok(Value::Array(a))) if !a.is_empty() => return Ok(()),
                Ok(Ok(_)) => answered.push(addr.clone()),
                Ok(Err(e)) => cause = Some(e),
                Err(_) => cause = Some(timed_out(2 * self.timeout)),
            }
        }
        if answered.is_empty() {
            return Err(SetupError::NoSentinel {
                sentinels: addrs.to_vec(),
                cause: cause.unwrap_or_else(|| timed_out(self.timeout)),
            });
        }
        Err(SetupError::UnknownMaster {
            master: master.to_owned(),
            sentinels: answered,
        })
    }
}
