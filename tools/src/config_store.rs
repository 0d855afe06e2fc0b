//! `kungfu-run --config-store etcd://HOST:PORT[/PREFIX]`: a watched job's
//! cluster config and its workers' membership in etcd rather than in the
//! launcher's built-in server (see `kungfu::store` for the keys).
//!
//! The launcher that starts the job makes its keys under
//! `PREFIX/<cluster id>` (`/kungfu` when the URL has no path): version 0
//! and the rules of `size N` (the hosts of `-H` and their slots, `--max-np`,
//! `--port-base`). Every launcher of the job, and every worker, reads and
//! changes the config there; the launchers watch it.

use anyhow::Context;
use kungfu::elastic::ClusterConfig;
use std::collections::HashSet;

use kungfu::store::{ConfigStore, Created, EtcdStore, Membership, Placement};
use kungfu_topology::PeerList;
use tokio::time::{Duration, Instant};

use crate::options::LaunchOptions;

/// The prefix of a job's keys when the URL gives none.
pub const DEFAULT_PREFIX: &str = "/kungfu";

/// How long making the job's keys may take.
const CREATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Refuses what is not `etcd://HOST:PORT[/PREFIX]` or `etcds://...`, and
/// an access to etcd that the environment sets wrongly (see
/// `kungfu::etcd::access`).
pub fn check_url(url: &str) -> anyhow::Result<()> {
    job_url(url, 0)?;
    for k in kungfu::etcd::access::ACCESS_VARS {
        // handed on to other hosts' launchers as text
        anyhow::ensure!(
            std::env::var_os(k).is_none_or(|v| v.to_str().is_some()),
            "{k} is not UTF-8"
        );
    }
    kungfu::etcd::Access::from_env(url.starts_with("etcds://"))
        .map_err(|e| anyhow::anyhow!("--config-store {url:?}: {e}"))?;
    Ok(())
}

/// The store URL of job `cluster_id` under `base`.
pub fn job_url(base: &str, cluster_id: u64) -> anyhow::Result<String> {
    let expected =
        || format!("--config-store {base:?}: expected etcd://HOST:PORT[/PREFIX] or etcds://...");
    let (scheme, rest) = match (base.strip_prefix("etcd://"), base.strip_prefix("etcds://")) {
        (Some(rest), _) => ("etcd", rest),
        (_, Some(rest)) => ("etcds", rest),
        _ => anyhow::bail!(expected()),
    };
    let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    // one member or several (HOST:PORT,HOST:PORT,...)
    kungfu::etcd::check_members(addr).map_err(|e| anyhow::anyhow!("{}: {e}", expected()))?;
    let path = match path.trim_end_matches('/') {
        "" => DEFAULT_PREFIX,
        p => p,
    };
    Ok(format!("{scheme}://{addr}{path}/{cluster_id:x}"))
}

/// Makes job `cluster_id`'s keys in the etcd `opts.config_store` names,
/// with `peers` as version 0; `across` when the job spans hosts (their
/// slots then bound where new workers go, as with the built-in server).
/// In per-node mode (`opts.self_host`) the launcher of another host may
/// have made them: the same first version is then the same job, unless a
/// launcher of it said `done` (an earlier run of the id). A job that
/// changed since (this launcher comes late, or again) is joined at its
/// current config, returned.
pub async fn create(
    opts: &LaunchOptions,
    peers: &PeerList,
    cluster_id: u64,
    across: bool,
) -> anyhow::Result<(ConfigStore, Option<ClusterConfig>)> {
    let per_node = opts.self_host.is_some();
    let base = opts.config_store.as_deref().context("no --config-store")?;
    let url = job_url(base, cluster_id)?;
    let store = ConfigStore::open(&url, None).map_err(anyhow::Error::msg)?;
    let ConfigStore::Etcd(etcd) = &store else {
        anyhow::bail!("--config-store {base:?} is not etcd");
    };
    let total: usize = opts.hosts.iter().map(|h| h.slots).sum();
    let rules = Placement {
        max_size: if across {
            opts.max_np.min(total)
        } else {
            opts.max_np
        },
        hosts: opts
            .hosts
            .iter()
            .map(|h| (h.host.clone(), h.slots))
            .collect(),
        bounded: across,
        port_base: opts.port_base,
    };
    let initial = ClusterConfig {
        version: 0,
        peers: peers.clone(),
    };
    let created = etcd
        .create(&initial, &rules, Instant::now() + CREATE_TIMEOUT)
        .await
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("making the keys of cluster id {cluster_id:x} in etcd ({url})"))?;
    // a fresh cluster id is the job's own; one given twice names a job
    // that ran (or runs) already
    let used = || {
        format!(
            "{url}: the job's keys exist already (cluster id {cluster_id:x} was used): give \
             another --cluster-id, or remove them (etcdctl del --prefix ...)"
        )
    };
    if created == Created::New {
        return Ok((store, None));
    }
    anyhow::ensure!(per_node, "{}", used());
    let deadline = Instant::now() + CREATE_TIMEOUT;
    let (states, version) = etcd.launchers(deadline).await.map_err(anyhow::Error::msg)?;
    if states.iter().any(|(_, st)| st == "done") {
        anyhow::bail!(
            "{}, by a job that is over (its launchers said done)",
            used()
        );
    }
    if version == 0 {
        return Ok((store, None));
    }
    let current = store.get(deadline).await.map_err(anyhow::Error::msg)?;
    Ok((store, Some(current)))
}

/// How often a per-node launcher says what it runs, and looks whether the
/// job is over.
pub const PER_NODE_EVERY: Duration = Duration::from_millis(500);

/// A launcher of per-node mode in etcd (`--self`, `--rdzv`): no launcher
/// sees the others' workers, so each says in `P/launchers/HOST` how many
/// of its own run at which version (`run N V`, under a lease it renews),
/// and the job is over when every host of `-H` says none at the current
/// version (none of them will start another), or is gone (its key
/// expired: its launcher died). Each then says `done` for good, and the
/// one that finds every host done (or gone) removes the job's keys. A host
/// whose launcher never starts keeps the others until `--timeout`.
pub struct PerNode {
    etcd: EtcdStore,
    hosts: Vec<String>,
    /// This launcher's state key, until it says `done`.
    key: Option<Membership>,
    said: (usize, u32),
    /// The hosts whose launcher was seen.
    seen: HashSet<String>,
}

impl PerNode {
    pub async fn start(etcd: EtcdStore, me: &str, opts: &LaunchOptions) -> anyhow::Result<PerNode> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let key = etcd
            .hold_launcher(me, "run 0 0", deadline)
            .await
            .map_err(anyhow::Error::msg)
            .context("saying in etcd what this host runs")?;
        Ok(PerNode {
            etcd,
            hosts: opts.hosts.iter().map(|h| h.host.clone()).collect(),
            key: Some(key),
            said: (0, 0),
            seen: HashSet::new(),
        })
    }

    /// The state of every host: whether each is idle (or gone), and done
    /// (or gone).
    async fn states(&mut self, deadline: Instant) -> anyhow::Result<Vec<(bool, bool)>> {
        let (states, current) = self
            .etcd
            .launchers(deadline)
            .await
            .map_err(anyhow::Error::msg)?;
        self.seen.extend(states.iter().map(|(h, _)| h.clone()));
        Ok(self
            .hosts
            .iter()
            .map(|host| match states.iter().find(|(h, _)| h == host) {
                Some((_, st)) if st == "done" => (true, true),
                Some((_, st)) => {
                    let v = st
                        .strip_prefix("run 0 ")
                        .and_then(|v| v.parse::<u32>().ok());
                    (v.is_some_and(|v| v >= current), false)
                }
                None => {
                    let gone = self.seen.contains(host);
                    (gone, gone)
                }
            })
            .collect())
    }

    /// Says that `live` of this host's workers run, at `version` (the
    /// latest this launcher handled); whether the job is over.
    pub async fn over(&mut self, live: usize, version: u32) -> anyhow::Result<bool> {
        let deadline = Instant::now() + Duration::from_secs(2);
        let Some(key) = &self.key else {
            return Ok(true);
        };
        if self.said != (live, version) {
            let state = format!("run {live} {version}");
            key.update(&state, deadline)
                .await
                .map_err(anyhow::Error::msg)?;
            self.said = (live, version);
        }
        if live > 0 {
            return Ok(false);
        }
        if !self.states(deadline).await?.iter().all(|&(idle, _)| idle) {
            return Ok(false);
        }
        self.finish().await;
        Ok(true)
    }

    /// Says `done` (once the job is over, or this launcher stops it), and
    /// removes the job's keys if every host is done.
    pub async fn finish(&mut self) {
        let Some(key) = self.key.take() else { return };
        let deadline = Instant::now() + Duration::from_secs(5);
        if key.settle("done", deadline).await.is_err() {
            return;
        }
        if let Ok(states) = self.states(deadline).await {
            if states.iter().all(|&(_, done)| done) {
                let _ = self.etcd.remove(deadline).await;
            }
        }
    }
}

/// Removes a job's keys from etcd when dropped: once the job is over, or
/// when the launcher fails after making them.
pub struct RemoveOnDrop(pub Option<EtcdStore>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let Some(etcd) = self.0.take() else { return };
        // a drop cannot await: a thread of its own, with a runtime of its own
        let removed = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(etcd.remove(Instant::now() + Duration::from_secs(10)))
        })
        .join();
        let why = match removed {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => "the removal panicked".into(),
        };
        // stderr may be closed; a drop must not panic
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "kungfu-run: could not remove the job's keys from etcd: {why}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            job_url("etcd://127.0.0.1:2379", 0xab).unwrap(),
            "etcd://127.0.0.1:2379/kungfu/ab"
        );
        assert_eq!(
            job_url("etcd://e:2379/team/a/", 1).unwrap(),
            "etcd://e:2379/team/a/1"
        );
        assert_eq!(
            job_url("etcds://e:2379", 1).unwrap(),
            "etcds://e:2379/kungfu/1"
        );
        assert_eq!(
            job_url("etcd://a:1,b:2,c:3/p", 2).unwrap(),
            "etcd://a:1,b:2,c:3/p/2"
        );
        for bad in [
            "http://e:1",
            "etcd://e",
            "etcd://:1/x",
            "etcd://e:0",
            "etcd://e:x/p",
            "etcd://a:1,,b:2/p",
            "etcd://a:1,b/p",
            "etcd://a:1, b:2/p",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
    }
}
