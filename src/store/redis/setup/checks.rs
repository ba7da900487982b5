//! What setup checks on the server: the eviction policy, the version, the replicas.

use redis::Value;

use super::SetupError;
use crate::store::redis::connection::{as_string, RedisConnection};

pub(super) async fn check_eviction_policy(conn: &RedisConnection) -> Result<(), SetupError> {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("maxmemory-policy");
    let from_config = conn.on_all(&get).await?;
    let mut info_replies = None;
    for (node, reply) in from_config {
        let policy = match policy_from_config(&reply) {
            Some(p) => p,
            None => {
                // CONFIG is disabled, renamed or denied here: INFO memory tells it too.
                if info_replies.is_none() {
                    let mut info = redis::cmd("INFO");
                    info.arg("memory");
                    info_replies = Some(conn.on_all(&info).await?);
                }
                info_replies
                    .as_ref()
                    .and_then(|all| all.iter().find(|(n, _)| *n == node))
                    .and_then(|(_, v)| policy_from_info(v))
                    .ok_or_else(|| SetupError::PolicyUnknown { node: node.clone() })?
            }
        };
        if policy != "noeviction" {
            return Err(SetupError::EvictionPolicy { node, policy });
        }
    }
    Ok(())
}

/// Whether every node runs Redis 7.0 or later, which takes `SET` with both `NX` and `GET`
/// (`INFO server`). Any doubt (`INFO` refused, no version, an error) is `false`: the claim
/// script works everywhere.
pub(super) async fn takes_nx_with_get(conn: &RedisConnection) -> bool {
    let mut info = redis::cmd("INFO");
    info.arg("server");
    let Ok(replies) = conn.on_all(&info).await else {
        return false;
    };
    !replies.is_empty()
        && replies.iter().all(|(_, v)| {
            as_string(v)
                .and_then(|t| major_version(&t))
                .is_some_and(|m| m >= 7)
        })
}

/// The major version in an `INFO server` text (`redis_version:7.0.15`).
fn major_version(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|l| l.strip_prefix("redis_version:"))?
        .split('.')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// With `WAIT n`, every primary must have `n` replicas connected, or each winning claim
/// fails: say so now rather than as 503s.
pub(super) async fn check_replicas(conn: &RedisConnection, wanted: u32) -> Result<(), SetupError> {
    let mut info = redis::cmd("INFO");
    info.arg("replication");
    for (node, reply) in conn.on_all(&info).await? {
        let Some(text) = as_string(&reply) else {
            // INFO refused (renamed, ACL): the check cannot be made; WAIT will tell.
            tracing::warn!(
                ?node,
                "INFO replication refused; the replica check is skipped"
            );
            continue;
        };
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        if field("role:") != Some("master") {
            continue;
        }
        let connected = field("connected_slaves:")
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        if connected < u64::from(wanted) {
            return Err(SetupError::TooFewReplicas {
                node,
                connected,
                wanted,
            });
        }
    }
    Ok(())
}

/// `CONFIG GET maxmemory-policy` answers `[name, value]` (RESP2) or `{name: value}` (RESP3).
fn policy_from_config(v: &Value) -> Option<String> {
    match v {
        Value::Array(items) if items.len() == 2 => as_string(&items[1]),
        Value::Map(pairs) if pairs.len() == 1 => as_string(&pairs[0].1),
        _ => None,
    }
}

fn policy_from_info(v: &Value) -> Option<String> {
    as_string(v)?
        .lines()
        .find_map(|l| l.strip_prefix("maxmemory_policy:"))
        .map(|p| p.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(b: &[u8]) -> Value {
        Value::BulkString(b.to_vec())
    }

    #[test]
    fn eviction_policy_is_read_from_config_or_info() {
        let config = Value::Array(vec![bulk(b"maxmemory-policy"), bulk(b"allkeys-lru")]);
        assert_eq!(policy_from_config(&config).as_deref(), Some("allkeys-lru"));
        let resp3 = Value::Map(vec![(bulk(b"maxmemory-policy"), bulk(b"noeviction"))]);
        assert_eq!(policy_from_config(&resp3).as_deref(), Some("noeviction"));
        assert_eq!(policy_from_config(&Value::Array(vec![])), None);
        let info = bulk(b"# Memory\r\nused_memory:1\r\nmaxmemory_policy:volatile-lru\r\n");
        assert_eq!(policy_from_info(&info).as_deref(), Some("volatile-lru"));
        assert_eq!(policy_from_info(&bulk(b"# Memory\r\n")), None);
    }

    #[test]
    fn the_major_version_is_read_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(major_version(info), Some(7));
        assert_eq!(major_version("redis_version:6.2.14\r\n"), Some(6));
        assert_eq!(major_version("# Server\r\n"), None);
    }
}
