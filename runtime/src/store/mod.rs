//! Where an elastic job's cluster config lives: the launcher's built-in
//! HTTP server ([`crate::elastic`], `http://...`, the default) or etcd
//! (`etcd://host:port/prefix`, or `etcds://` for TLS; `kungfu-run
//! --config-store`), for clusters
//! that run it already. `KUNGFU_CONFIG_SERVER` names either; workers and
//! launchers use [`ConfigStore`] and do not care which.
//!
//! # The keys in etcd
//!
//! Under the job's prefix `P` (`kungfu-run` makes it `/kungfu/<cluster
//! id>` under the URL's path):
//!
//! ```text
//! P/config              the current config (ClusterConfig::encode's text)
//! P/versions/0000000003 every version, the last 64 kept (GET /cluster/V)
//! P/rules               where `size N` puts new workers (Placement)
//! P/ports               the highest port each host has given out
//! P/members/HOST:PORT   one key per live worker, under its own lease
//! P/launchers/HOST      per-node mode: what each host's launcher runs
//! ```
//!
//! A change is a transaction that holds only if `P/config` is unchanged
//! since it was read (its mod revision), and writes the config, its
//! version key and the ports together: versions are linearisable, and of
//! two workers that propose the same version one wins and the other gets
//! [`PutError::Conflict`], as with the built-in server's 409. Launchers
//! watch `P/versions/` (every version, in order). A worker's member key
//! is bound to a lease it renews: a worker that dies loses its key within
//! [`MEMBER_TTL_S`] seconds.
//!
//! The client speaks HTTP to etcd's JSON gateway ([`crate::etcd`]), in
//! TLS for `etcds://` (the CA and any client certificate from
//! `KUNGFU_ETCD_CA`, `KUNGFU_ETCD_CERT`, `KUNGFU_ETCD_KEY`), as the etcd
//! user `KUNGFU_ETCD_USER` names if set (its password in the file
//! `KUNGFU_ETCD_PASSWORD_FILE`): see [`crate::etcd::access`].

mod in_etcd;
mod placement;

use std::time::Duration;

use kungfu_transport::auth::JobSecret;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::elastic::{self, ClusterConfig};
use crate::etcd::{Access, Etcd, Kv};

pub use in_etcd::{Created, EtcdStore, Membership};
pub use placement::Placement;

/// The largest cluster the rules may allow (what `size N` builds is
/// bounded by it).
pub(crate) const MAX_SIZE: usize = 1 << 16;
/// How many versions are kept (as the built-in server keeps).
pub(crate) const HISTORY: u32 = 64;
/// A member key's lease, in seconds; it is renewed every third of it.
pub const MEMBER_TTL_S: i64 = 5;
/// An etcd watch with nothing new is opened anew this often (each time
/// after reading what it may have missed): a store gone silent is noticed.
pub(crate) const WATCH_IDLE: Duration = Duration::from_secs(5);

/// Why a change of the config was not made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutError {
    /// Another change came first: the version given is not the next one.
    Conflict(String),
    Failed(String),
}

impl std::fmt::Display for PutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PutError::Conflict(e) | PutError::Failed(e) => f.write_str(e),
        }
    }
}

/// A change of the config, as a client asks for it.
pub(crate) enum Change {
    /// `size N`: the first `N` kept, new workers where the store's rules say.
    Size(usize),
    /// A whole config, of the next version.
    Whole(ClusterConfig),
}

/// The compare-and-set of every config store (the built-in server and
/// etcd alike): a whole config is taken only as version `cur + 1`, where
/// `cur` is the version the store holds, so of two proposals of one
/// version the first is taken and the other gets [`PutError::Conflict`].
/// The recovery depends on it (`runtime/src/recover/machine.rs`; the
/// model `runtime/tests/model_recover.rs` calls this very function).
pub fn compare_and_set(cur: u32, given: u32) -> Result<(), PutError> {
    match cur.checked_add(1) {
        Some(next) if given == next => Ok(()),
        Some(next) => Err(PutError::Conflict(format!(
            "version {given} given; the next version is {next}"
        ))),
        None => Err(PutError::Failed("the version cannot grow further".into())),
    }
}

/// Reads a change (`size N`, or a whole config) of a config at version
/// `cur`; returns the next version with it. `max_size` bounds either.
pub(crate) fn parse_change(
    body: &str,
    cur: u32,
    max_size: usize,
) -> Result<(u32, Change), PutError> {
    let bad = PutError::Failed;
    let next = cur
        .checked_add(1)
        .ok_or_else(|| bad("the version cannot grow further".into()))?;
    let body = body.trim();
    if let Some(n) = body.strip_prefix("size ") {
        let n: usize = n
            .trim()
            .parse()
            .map_err(|_| bad(format!("bad size {n:?}")))?;
        if n == 0 || n > max_size {
            return Err(bad(format!("size {n} is outside 1..={max_size}")));
        }
        return Ok((next, Change::Size(n)));
    }
    let c = ClusterConfig::parse(body).map_err(bad)?;
    compare_and_set(cur, c.version)?;
    if c.peers.len() > max_size {
        return Err(bad(format!("{} peers; at most {max_size}", c.peers.len())));
    }
    Ok((next, Change::Whole(c)))
}

/// The config store of an elastic job.
#[derive(Clone, Debug)]
pub enum ConfigStore {
    /// The launcher's built-in server (`http://host:port/cluster`).
    Http(HttpStore),
    Etcd(EtcdStore),
}

/// The launcher's built-in config server, and the job's secret that signs
/// every request to it and checks every answer
/// ([`elastic::credential`]); `None` only for a server without a
/// credential (tests).
#[derive(Clone, Debug)]
pub struct HttpStore {
    pub url: String,
    pub secret: Option<JobSecret>,
}

impl ConfigStore {
    /// The store `url` names: `http://...` (`https://...`: the config
    /// server across hosts, over TLS), `etcd://host:port/prefix`, or
    /// `etcds://host:port/prefix` (TLS); an etcd is reached as the
    /// environment says ([`Access::from_env`]: CA, client certificate,
    /// user).
    /// The built-in server's requests are signed with `secret` (etcd has
    /// its own access control and does not use it).
    pub fn open(url: &str, secret: Option<&JobSecret>) -> Result<ConfigStore, String> {
        if url.starts_with("http://") || url.starts_with("https://") {
            return Ok(ConfigStore::Http(HttpStore {
                url: url.to_string(),
                secret: secret.cloned(),
            }));
        }
        let (tls, rest) = match (url.strip_prefix("etcd://"), url.strip_prefix("etcds://")) {
            (Some(rest), _) => (false, rest),
            (_, Some(rest)) => (true, rest),
            _ => {
                return Err(format!(
                    "{url:?}: a config store is http://HOST:PORT/cluster, etcd://HOST:PORT/PREFIX or etcds://HOST:PORT/PREFIX"
                ))
            }
        };
        let (addr, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(format!(
                "{url:?}: etcd://HOST:PORT/PREFIX needs an address and a prefix"
            ));
        }
        crate::etcd::check_members(addr).map_err(|e| format!("{url:?}: {e}"))?;
        let access = Access::from_env(tls).map_err(|e| format!("{url:?}: {e}"))?;
        Ok(ConfigStore::Etcd(EtcdStore {
            etcd: Etcd::with_access(addr, &access)?,
            prefix: prefix.to_string(),
        }))
    }

    /// The URL workers get (`KUNGFU_CONFIG_SERVER`).
    pub fn url(&self) -> String {
        match self {
            ConfigStore::Http(h) => h.url.clone(),
            ConfigStore::Etcd(e) => {
                let scheme = if e.etcd.is_tls() { "etcds" } else { "etcd" };
                format!("{scheme}://{}{}", e.etcd.addr(), e.prefix)
            }
        }
    }

    /// The current config.
    pub async fn get(&self, deadline: Instant) -> Result<ClusterConfig, String> {
        match self {
            ConfigStore::Http(h) => elastic::get_config(&h.url, h.secret.as_ref(), deadline).await,
            ConfigStore::Etcd(e) => e.read(deadline).await.map(|r| r.config),
        }
    }

    /// Version `v`, if it was made and is still kept.
    pub async fn get_version(
        &self,
        v: u32,
        deadline: Instant,
    ) -> Result<Option<ClusterConfig>, String> {
        match self {
            ConfigStore::Http(h) => {
                elastic::get_version(&h.url, v, h.secret.as_ref(), deadline).await
            }
            ConfigStore::Etcd(e) => {
                let (kvs, _) = e.etcd.range(&e.version_key(v), false, deadline).await?;
                kvs.first().map(config_of).transpose()
            }
        }
    }

    /// Changes the config: `size N`, or a whole config whose version is
    /// the next one.
    pub async fn put(&self, body: &str, deadline: Instant) -> Result<ClusterConfig, PutError> {
        match self {
            ConfigStore::Http(h) => elastic::put_config(&h.url, body, h.secret.as_ref(), deadline)
                .await
                .map_err(|e| match e.contains(": 409 ") {
                    true => PutError::Conflict(e),
                    false => PutError::Failed(e),
                }),
            ConfigStore::Etcd(e) => e.put(body, deadline).await,
        }
    }

    /// Every version after `after`, in order (see [`elastic::follow`]);
    /// a store unreachable for `give_up` ends it with the error.
    pub fn follow(
        &self,
        after: u32,
        period: Duration,
        give_up: Duration,
    ) -> mpsc::UnboundedReceiver<Result<ClusterConfig, String>> {
        match self {
            ConfigStore::Http(h) => {
                elastic::follow(h.url.clone(), h.secret.clone(), after, period, give_up)
            }
            ConfigStore::Etcd(e) => e.clone().follow(after, period, give_up),
        }
    }
}

pub(crate) fn config_of(kv: &Kv) -> Result<ClusterConfig, String> {
    let text = std::str::from_utf8(&kv.value).map_err(|_| format!("{}: not UTF-8", kv.key))?;
    ClusterConfig::parse(text).map_err(|e| format!("{}: {e}", kv.key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert!(matches!(
            ConfigStore::open("http://a:1/cluster", None),
            Ok(ConfigStore::Http(_))
        ));
        let s = ConfigStore::open("etcd://127.0.0.1:2379/kungfu/ab/", None).unwrap();
        assert_eq!(s.url(), "etcd://127.0.0.1:2379/kungfu/ab");
        // TLS without a CA to check etcd against is refused by name
        if std::env::var_os(crate::etcd::access::ENV_CA).is_none() {
            let err = ConfigStore::open("etcds://127.0.0.1:2379/p", None).unwrap_err();
            assert!(err.contains("KUNGFU_ETCD_CA"), "{err}");
        }
        for bad in [
            "etcd://127.0.0.1:2379",
            "etcd:///x",
            "ftp://a/b",
            "etcds://",
        ] {
            assert!(ConfigStore::open(bad, None).is_err(), "{bad}");
        }
    }
}
