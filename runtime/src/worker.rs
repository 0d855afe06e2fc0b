//! A started worker: finding the peers and connecting at start, its
//! session, its transport, and what it reports of itself.

use std::sync::Arc;
use std::time::SystemTime;

use kungfu_collectives::{CollectiveError, Session};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::any::{self, AnyTransport, TransportKind};
use kungfu_transport::pool::BufferPool;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::{connect, listen, reconfigure, rendezvous, store};
use crate::{BootstrapError, Discovery, TransportSwap, WorkerEnv};

/// A started worker: its environment and its session.
pub struct Worker {
    pub(crate) env: WorkerEnv,
    pub(crate) peers: PeerList,
    pub(crate) session: Session<AnyTransport>,
    /// The process's buffer pool: every cluster version's endpoint uses
    /// it, so a resize keeps the buffers and the budget is the process's.
    pub(crate) pool: Arc<BufferPool>,
    pub(crate) cluster_id: u64,
    /// When this worker began joining its current cluster version, and when
    /// its session was ready.
    pub(crate) joined: (SystemTime, SystemTime),
    /// Joined an elastic job after it started, and has no state yet.
    pub(crate) fresh: bool,
    pub(crate) detached: bool,
    /// The strategy in use before the last resize, until sync_state hands
    /// it to every worker.
    pub(crate) carry: Option<Strategy>,
    /// The transport in use: the environment's, or the last one swapped to.
    current: Arc<std::sync::Mutex<TransportKind>>,
    /// This worker's key in an etcd config store (`P/members/HOST:PORT`,
    /// its rank and version at start), under a lease it renews: gone
    /// within [`store::MEMBER_TTL_S`] of its death, and at once when it
    /// closes or leaves the cluster.
    membership: Option<store::Membership>,
    /// This worker's id in its reconfigure handle: random, one per
    /// process, so a handle of a dead worker whose address a new process
    /// took is not the new one's.
    pub(crate) id: u64,
    /// The uuids of the reconfigures this worker took part in (each may
    /// be used once).
    pub(crate) used_uuids: std::collections::BTreeSet<i64>,
    /// A cluster version connected in the background
    /// ([`Worker::poll_resize_from_config`]).
    pub(crate) pending: Option<crate::pending::Pending>,
}

/// A worker no launcher placed ([`crate::Launcher::Single`]) starts alone
/// at a port the kernel picks on its host, held for the life of the
/// process (a reconfigure names the address to its peers later).
fn alone_at_own_port(env: &mut WorkerEnv) -> Result<(), BootstrapError> {
    let Discovery::Peers(peers) = &env.discovery else {
        return Ok(());
    };
    if env.launcher != crate::Launcher::Single || peers.len() != 1 || peers.peers()[0].port != 0 {
        return Ok(());
    }
    let (me, fd) = listen::bind_own(&peers.peers()[0].host)?;
    let peers = PeerList::new(vec![me]).map_err(|e| BootstrapError::Env {
        var: crate::env::SELF_HOST_VAR.into(),
        reason: e.to_string(),
    })?;
    env.discovery = Discovery::Peers(peers);
    env.listen_fd = Some(fd);
    Ok(())
}

impl Worker {
    /// Finds the peers as `env` says, connects to all of them and starts a
    /// session. Must run inside a multi-threaded tokio runtime.
    pub async fn start(mut env: WorkerEnv) -> Result<Worker, BootstrapError> {
        let began = SystemTime::now();
        alone_at_own_port(&mut env)?;
        if !env.transport.built() {
            return Err(BootstrapError::UnsupportedTransport(env.transport));
        }
        let deadline = Instant::now() + env.connect_timeout;
        let (listener, peers, cluster_id) = match &env.discovery {
            Discovery::Peers(peers) => {
                let me = peers.peer(Rank(env.rank as u32)).expect("validated rank");
                (
                    listen::listen(me, env.listen_fd).await?,
                    peers.clone(),
                    env.cluster_id
                        .unwrap_or_else(|| reconfigure::cluster_id_of(&env)),
                )
            }
            Discovery::Rendezvous { host, port } => {
                let server = if env.rank == 0 {
                    let l = TcpListener::bind((host.as_str(), *port))
                        .await
                        .map_err(|source| BootstrapError::Listen {
                            addr: format!("{host}:{port} (rendezvous)"),
                            source,
                        })?;
                    Some(tokio::spawn(rendezvous::serve(
                        l,
                        env.size,
                        env.cluster_version,
                        env.secret.clone(),
                        deadline,
                    )))
                } else {
                    None
                };
                let got = rendezvous::register(
                    host,
                    *port,
                    env.rank,
                    env.size,
                    env.cluster_version,
                    env.secret.as_ref(),
                    deadline,
                )
                .await;
                if let Some(server) = server {
                    let served = server.await.map_err(|e| BootstrapError::Rendezvous {
                        addr: format!("{host}:{port}"),
                        reason: format!("server task: {e}"),
                    })?;
                    // rank 0's own registration error is the more specific one
                    if got.is_ok() {
                        served?;
                    }
                }
                got?
            }
        };
        let pool = BufferPool::new(env.buffer_pool_bytes);
        let env_transport = env.transport;
        let session = connect::connect(&env, &peers, cluster_id, &pool, listener, deadline).await?;
        let fresh = env.config_server.is_some() && env.cluster_version > 0;
        let opened = env
            .config_server
            .as_deref()
            .map(|u| store::ConfigStore::open(u, env.secret.as_ref()));
        let membership = match opened {
            Some(Ok(store::ConfigStore::Etcd(etcd))) => {
                let me = peers.peer(Rank(env.rank as u32)).expect("validated rank");
                let value = format!(
                    "rank {} version {} pid {}",
                    env.rank,
                    env.cluster_version,
                    std::process::id()
                );
                let m = etcd.register(&me.to_string(), &value, deadline).await;
                Some(m.map_err(|e| BootstrapError::Elastic(format!("registering in etcd: {e}")))?)
            }
            // a store this worker cannot reach as the environment says
            // (its files, its user) fails it here, named, not at a resize
            Some(Err(e)) => return Err(BootstrapError::Elastic(e)),
            _ => None,
        };
        let mut w = Worker {
            env,
            peers,
            session,
            pool,
            cluster_id,
            joined: (began, SystemTime::now()),
            fresh,
            detached: false,
            carry: None,
            current: Arc::new(std::sync::Mutex::new(env_transport)),
            membership,
            id: reconfigure::worker_id()?,
            used_uuids: std::collections::BTreeSet::new(),
            pending: None,
        };
        w.auto_across_hosts().await;
        w.joined.1 = SystemTime::now();
        Ok(w)
    }

    /// With `auto` across hosts: RDMA if every worker has it
    /// ([`TransportSwap`]'s `auto_across_hosts`); rank 0 logs the choice
    /// and why.
    pub(crate) async fn auto_across_hosts(&self) {
        if self.env.transport != TransportKind::Auto || self.peers.hosts().len() < 2 {
            return;
        }
        if self.env.secure {
            // auto across hosts is QUIC then: no RDMA wire authenticates
            // its frames
            if self.env.rank == 0 {
                let on = any::describe(&self.session.transport());
                eprintln!("kungfu: auto: across hosts over {on} (KUNGFU_SECURE=1)");
            }
            return;
        }
        let (moved, why) = self.transport_swap().auto_across_hosts().await;
        if self.env.rank == 0 {
            let on = any::describe(&self.session.transport());
            let why = match (moved, why.is_empty()) {
                (true, _) => String::new(),
                (false, true) => " (this build has no RDMA wire)".into(),
                (false, false) => format!(" (no RDMA: {})", why.join("; ")),
            };
            eprintln!("kungfu: auto: across hosts over {on}{why}");
        }
    }

    /// Closes the connections gracefully, waiting up to `linger` for the
    /// peers to finish with this worker. Call it before exiting.
    pub async fn close(mut self, linger: std::time::Duration) {
        self.leave_store().await;
        self.session.close(linger).await;
    }

    /// Removes this worker's member key, if it has one (it exits, or left
    /// the cluster).
    pub(crate) async fn leave_store(&mut self) {
        if let Some(m) = self.membership.take() {
            m.leave(Instant::now() + self.env.connect_timeout).await;
        }
    }

    /// The session of the current cluster version. A resize replaces it:
    /// take it anew after one (a clone of an old one fails its ops).
    pub fn session(&self) -> &Session<AnyTransport> {
        &self.session
    }

    /// The transport asked for and what it connected, for headers and
    /// logs: `tcp`, `quic`, `auto (shm+tcp)`, `fabric (tcp;ofi_rxm)`.
    pub fn transport_name(&self) -> String {
        let kind = self.transport_kind();
        let got = any::describe(&self.session.transport());
        if got.starts_with(kind.name()) {
            got
        } else {
            format!("{kind} ({got})")
        }
    }

    /// The transport in use: the environment's, or the last one swapped to.
    pub fn transport_kind(&self) -> TransportKind {
        *self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What swaps this worker's transport ([`TransportSwap::swap`]).
    pub fn transport_swap(&self) -> TransportSwap {
        TransportSwap {
            env: self.env.clone(),
            peers: self.peers.clone(),
            cluster_id: self.cluster_id,
            pool: self.pool.clone(),
            session: self.session.clone(),
            current: self.current.clone(),
        }
    }

    /// Swaps the transport at a consistency barrier (a collective: see
    /// [`TransportSwap::swap`]); returns the new epoch.
    pub async fn swap_transport(
        &self,
        kind: TransportKind,
    ) -> Result<kungfu_transport::Epoch, CollectiveError> {
        self.transport_swap().swap(kind).await
    }

    pub fn env(&self) -> &WorkerEnv {
        &self.env
    }

    pub fn peers(&self) -> &PeerList {
        &self.peers
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn size(&self) -> usize {
        self.env.size
    }

    /// The cluster version (the config server's; the session's
    /// [`Session::generation`] pairs it with the swap epoch).
    pub fn version(&self) -> u32 {
        self.env.cluster_version
    }

    /// The position of this worker among the workers of its host.
    pub fn local_rank(&self) -> usize {
        self.peers.local_rank(Rank(self.env.rank as u32))
    }

    /// The number of workers on this worker's host.
    pub fn local_size(&self) -> usize {
        self.peers.local_size(Rank(self.env.rank as u32))
    }

    /// When this worker began joining its current cluster version (at
    /// start: after the process started; at a resize: when it was called)
    /// and when its session was ready. The latency of a resize is the last
    /// ready time minus the last begin time among the workers.
    pub fn joined(&self) -> (SystemTime, SystemTime) {
        self.joined
    }

    /// Whether this worker joined a running elastic job and has not yet
    /// received the model state ([`Worker::sync_state`]).
    pub fn is_fresh(&self) -> bool {
        self.fresh
    }

    /// Whether a resize left this worker out.
    pub fn is_detached(&self) -> bool {
        self.detached
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::IntoRawFd;
    use std::time::Duration;

    use kungfu_transport::Transport;

    use super::*;

    /// The budget the environment gives sizes the one pool of the process:
    /// the worker's, its endpoint's (whose wires fill payloads from it)
    /// and its session's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_environment_sizes_the_pool_of_the_process() {
        for transport in ["tcp", "shm"] {
            // as kungfu-run passes it: bound, and owned by the worker
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let peers = format!("127.0.0.1:{}", l.local_addr().unwrap().port());
            let fd = l.into_raw_fd().to_string();
            let vars = [
                ("KUNGFU_RANK", "0"),
                ("KUNGFU_SIZE", "1"),
                ("KUNGFU_PEERS", peers.as_str()),
                ("KUNGFU_LISTEN_FD", fd.as_str()),
                ("KUNGFU_TRANSPORT", transport),
                ("KUNGFU_BUFFER_POOL_BYTES", "12345"),
            ];
            let get = |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            };
            let w = Worker::start(WorkerEnv::from_vars(&get).unwrap())
                .await
                .unwrap();
            let t = w.session().transport();
            let pool = t.pool();
            assert_eq!(pool.budget(), 12345, "{transport}");
            assert!(Arc::ptr_eq(pool, &w.pool), "{transport}");
            w.close(Duration::ZERO).await;
        }
    }
}
