//! The elastic side of a launch (`-w`, `--on-failure shrink|replace`):
//! the config server this launcher serves, or the store it creates or
//! follows, the versions of the cluster it watches, and the replacement
//! of lost workers.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use kungfu::elastic::{ClusterConfig, ConfigServer};
use kungfu::store::{ConfigStore, HttpStore};
use kungfu_topology::PeerList;
use kungfu_transport::auth::JobSecret;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{is_mine, LaunchOptions, OnFailure, FOLLOW_EVERY, FOLLOW_GIVE_UP};
use crate::config_store::{PerNode, RemoveOnDrop};
use crate::served::{config_server, Pending};

/// What an elastic launch serves, creates or follows; for a job that is
/// not elastic, neither flag is set and every option is `None`.
pub(super) struct Elastic {
    /// This launcher serves the job's config (or creates it in etcd).
    pub(super) serves: bool,
    /// This launcher (`--self`) follows the job's config: another
    /// launcher's server, or etcd.
    pub(super) follows: bool,
    pub(super) server: Option<ConfigServer>,
    /// Sockets bound for workers the config server added.
    pub(super) pending: Pending,
    /// The current config, when the job changed before this launcher
    /// found it in etcd: it starts the workers of that version.
    pub(super) late: Option<ClusterConfig>,
    pub(super) store: Option<ConfigStore>,
    /// The store's URL, for the workers and the other hosts' launchers.
    pub(super) url: Option<String>,
    /// Removes the job's keys from etcd when dropped.
    pub(super) keys: RemoveOnDrop,
    /// What this host runs, told to etcd (per-node mode).
    pub(super) node: Option<PerNode>,
    /// Every version of the config after the first, in order.
    pub(super) versions: Option<mpsc::UnboundedReceiver<Result<ClusterConfig, String>>>,
    /// The latest version handled (the first, to begin with).
    pub(super) latest: Option<ClusterConfig>,
}

impl Elastic {
    /// Serves, creates or finds the job's config as `opts` say.
    pub(super) async fn start(
        opts: &LaunchOptions,
        peers: &PeerList,
        secret: &JobSecret,
        cluster_id: u64,
        all_local: bool,
        in_etcd: bool,
        per_node: bool,
    ) -> anyhow::Result<Elastic> {
        let mine = |host: &str| is_mine(opts, host);
        // The config server: for -w (the launcher that starts the job serves
        // it; those it starts on other hosts follow it), and for the
        // survivors' recovery.
        let elastic = opts.watch || opts.on_failure != OnFailure::Stop;
        let serves = elastic && opts.self_host.is_none();
        let follows = elastic && opts.self_host.is_some();
        let here = if serves && !all_local && !in_etcd {
            let h = opts.hosts.iter().find(|h| mine(&h.host)).with_context(|| {
                "-w or --on-failure across hosts: start kungfu-run on one of the hosts of -H \
                 (its config server listens there, for the other hosts), or give --config-store"
            })?;
            Some(h.host.as_str())
        } else {
            None
        };
        let (server, pending) = if serves && !in_etcd {
            let (s, p) = config_server(opts, peers, secret, here).await?;
            (Some(s), p)
        } else {
            (None, Pending::default())
        };
        // a per-node launcher that finds the job changed already starts the
        // workers of its current version, not of the first
        let mut late: Option<ClusterConfig> = None;
        let store = match (&server, &opts.config_server) {
            (Some(s), _) => Some(ConfigStore::Http(HttpStore {
                url: s.url(),
                secret: Some(secret.clone()),
            })),
            (None, _) if serves || (follows && per_node && in_etcd) => {
                let (store, current) =
                    crate::config_store::create(opts, peers, cluster_id, !all_local).await?;
                late = current;
                Some(store)
            }
            (None, Some(u)) if follows => {
                Some(ConfigStore::open(u, Some(secret)).map_err(anyhow::Error::msg)?)
            }
            (None, _) if follows => {
                anyhow::bail!("-w or --on-failure with --self needs --config-server URL")
            }
            _ => None,
        };
        let url = store.as_ref().map(ConfigStore::url);
        // a job's keys in etcd go with it, however it ends
        let keys = RemoveOnDrop(match &store {
            Some(ConfigStore::Etcd(e)) if serves => Some(e.clone()),
            _ => None,
        });
        let node = match (&store, &opts.self_host) {
            (Some(ConfigStore::Etcd(e)), Some(me)) if per_node => {
                Some(PerNode::start(e.clone(), me, opts).await?)
            }
            _ => None,
        };
        // every version of the config after the first, in order
        let versions = match (&server, &store) {
            (Some(s), _) => Some(s.versions(0)),
            (None, Some(st)) => {
                // from the current version on, for a launcher that comes late
                let after = late.as_ref().map_or(0, |c| c.version - 1);
                Some(st.follow(after, FOLLOW_EVERY, FOLLOW_GIVE_UP))
            }
            _ => None,
        };
        // the latest version handled
        let latest = versions.as_ref().map(|_| ClusterConfig {
            version: 0,
            peers: peers.clone(),
        });
        Ok(Elastic {
            serves,
            follows,
            server,
            pending,
            late,
            store,
            url,
            keys,
            node,
            versions,
            latest,
        })
    }
}

/// `--on-failure replace`: asks the config server for `np` workers again
/// (the launcher starts the new ones when the config changes).
pub(super) fn replace_lost(store: Option<ConfigStore>, np: usize) {
    let Some(store) = store else { return };
    tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        let body = format!("size {np}");
        match store.put(&body, deadline).await {
            Ok(c) => say!(
                "kungfu-run: replacing the lost: version {} of {} workers",
                c.version,
                c.peers.len()
            ),
            Err(e) => say!("kungfu-run: could not start replacements: {e}"),
        }
    });
}

/// What `--on-failure shrink|replace` keeps track of.
#[derive(Default)]
pub(super) struct Survived {
    /// The status of the first worker that failed.
    pub(super) failed: Option<i32>,
    /// Failed workers a replacement is still to be started for.
    pub(super) to_replace: usize,
}
