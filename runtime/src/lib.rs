//! The KungFu-rs worker runtime: find the peers, connect, start a session.
//!
//! A worker started by `kungfu-run`, torchrun, Slurm's `srun` or Open MPI's
//! `mpirun` calls [`Worker::start`] with [`WorkerEnv::from_env`] and gets a
//! connected [`kungfu_collectives::Session`]. See [`mod@env`] for the variables
//! each launcher sets.
//!
//! # Quick start
//!
//! ```no_run
//! use kungfu::{Worker, WorkerEnv};
//! use kungfu_collectives::ReduceOp;
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let w = Worker::start(WorkerEnv::from_env()?).await?;
//! let s = w.session();
//! let sum = s.allreduce("x", &[s.rank().0 as f32], ReduceOp::Sum).await?;
//! println!("rank {} of {}: {sum:?}", w.rank(), w.size());
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kungfu_collectives::{CollectiveError, Element, ReduceOp, Session};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::any::{self, AnyTransport, TransportKind};
use kungfu_transport::pool::BufferPool;
use kungfu_transport::TransportError;
use tokio::net::TcpListener;
use tokio::time::Instant;

mod connect;
pub mod elastic;
pub mod env;
pub mod etcd;
#[doc(hidden)]
pub mod fuzzing;
pub mod listen;
pub mod recover;
pub mod rendezvous;
pub mod store;
mod swap;
pub use recover::Recovered;
pub use swap::TransportSwap;

pub use env::{Discovery, Launcher, WorkerEnv};

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("rendezvous at {addr}: {reason}")]
    Rendezvous { addr: String, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("transport {0} is not available (this build has: {avail})", avail = TransportKind::available())]
    UnsupportedTransport(TransportKind),
    #[error("connecting to the peers: {0}")]
    Transport(#[from] TransportError),
    #[error("starting the session: {0}")]
    Session(#[from] CollectiveError),
    #[error("resizing: {0}")]
    Elastic(String),
    /// A collective of a resize or of [`Worker::sync_state`] failed, as
    /// any op may: after [`CollectiveError::PeerLost`] the session is as
    /// usable as after a failed op of the application's, and
    /// [`Worker::recover`] goes on without the lost worker.
    #[error("resizing: {0}")]
    Op(#[source] CollectiveError),
    /// The cluster went on at `version` without this worker (a recovery
    /// declared it lost): it should exit. Its session is closed.
    #[error("left out of the cluster at version {version}: {reason}")]
    Excluded { version: u32, reason: String },
}

/// A started worker: its environment and its session.
pub struct Worker {
    env: WorkerEnv,
    peers: PeerList,
    session: Session<AnyTransport>,
    /// The process's buffer pool: every cluster version's endpoint uses
    /// it, so a resize keeps the buffers and the budget is the process's.
    pool: Arc<BufferPool>,
    cluster_id: u64,
    /// When this worker began joining its current cluster version, and when
    /// its session was ready.
    joined: (SystemTime, SystemTime),
    /// Joined an elastic job after it started, and has no state yet.
    fresh: bool,
    detached: bool,
    /// The strategy in use before the last resize, until sync_state hands
    /// it to every worker.
    carry: Option<Strategy>,
    /// The transport in use: the environment's, or the last one swapped to.
    current: Arc<std::sync::Mutex<TransportKind>>,
    /// This worker's key in an etcd config store (`P/members/HOST:PORT`,
    /// its rank and version at start), under a lease it renews: gone
    /// within [`store::MEMBER_TTL_S`] of its death, and at once when it
    /// closes or leaves the cluster.
    membership: Option<store::Membership>,
}

/// What a resize did to this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resized {
    /// The cluster changed (a new version).
    pub changed: bool,
    /// This worker is not in the new cluster: it should exit.
    pub detached: bool,
}

impl Worker {
    /// Finds the peers as `env` says, connects to all of them and starts a
    /// session. Must run inside a multi-threaded tokio runtime.
    pub async fn start(env: WorkerEnv) -> Result<Worker, BootstrapError> {
        let began = SystemTime::now();
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
                    env.cluster_id.unwrap_or(0),
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
        let membership = match env.config_server.as_deref().map(store::ConfigStore::open) {
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
        };
        w.auto_across_hosts().await;
        w.joined.1 = SystemTime::now();
        Ok(w)
    }

    /// With `auto` across hosts: RDMA if every worker has it
    /// ([`TransportSwap`]'s `auto_across_hosts`); rank 0 logs the choice
    /// and why.
    async fn auto_across_hosts(&self) {
        if self.env.transport != TransportKind::Auto || self.peers.hosts().len() < 2 {
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

    fn config_store(&self) -> Result<store::ConfigStore, BootstrapError> {
        let url = self.env.config_server.as_deref().ok_or_else(|| {
            BootstrapError::Elastic(
                "no config server (KUNGFU_CONFIG_SERVER; run with kungfu-run -w)".into(),
            )
        })?;
        store::ConfigStore::open(url).map_err(BootstrapError::Elastic)
    }

    /// Asks the config server for a cluster of `n` workers (the first `n`
    /// kept when shrinking; new ones started by `kungfu-run -w` when
    /// growing). Workers switch at their next [`Worker::resize_from_config`].
    pub async fn propose_new_size(
        &self,
        n: usize,
    ) -> Result<elastic::ClusterConfig, BootstrapError> {
        self.config_store()?
            .put(
                &format!("size {n}"),
                self.env.secret.as_ref(),
                Instant::now() + self.env.connect_timeout,
            )
            .await
            .map_err(|e| BootstrapError::Elastic(e.to_string()))
    }

    /// Resizes the cluster to `n` workers: rank 0 proposes, then every
    /// worker switches (see [`Worker::resize_from_config`]). A collective:
    /// every worker calls it at the same step with the same `n`.
    pub async fn resize(&mut self, n: usize) -> Result<Resized, BootstrapError> {
        let mut failed = None;
        if self.rank() == 0 && n != self.size() {
            if let Err(e) = self.propose_new_size(n).await {
                failed = Some(e.to_string());
            }
        }
        self.follow(failed).await
    }

    /// Switches to the config server's current cluster, if it is newer: a
    /// collective (every worker calls it at the same step). Rank 0 reads
    /// the config and broadcasts it, so every worker takes the same one.
    /// Workers in the new cluster connect at the new version (new
    /// connections, which the handshake checks, so no frame of the old one
    /// reaches them) and get a new session, at epoch 0; the others are
    /// detached, their connections closed.
    pub async fn resize_from_config(&mut self) -> Result<Resized, BootstrapError> {
        self.follow(None).await
    }

    async fn follow(&mut self, failed: Option<String>) -> Result<Resized, BootstrapError> {
        let began = SystemTime::now();
        if self.detached {
            return Err(BootstrapError::Elastic("this worker is detached".into()));
        }
        let store = self.config_store()?;
        let deadline = Instant::now() + self.env.connect_timeout;
        // Rank 0 reads; its text (or its error) goes to everyone, as the
        // maximum of an allreduce to which the others give zeros rather
        // than as a broadcast: every worker then needs every other, so a
        // worker lost anywhere fails this on all of them. Under a
        // broadcast, a worker whose path from rank 0 avoids the lost one
        // went on waiting here for a rank 0 that was recovering (the
        // launcher's chaos test caught it).
        let mut text = Vec::new();
        if self.rank() == 0 {
            let got = match failed {
                Some(e) => Err(e),
                None => store.get(deadline).await,
            };
            text = match got {
                Ok(c) => [b"+".as_slice(), c.encode().as_bytes()].concat(),
                Err(e) => [b"-".as_slice(), e.as_bytes()].concat(),
            };
        }
        let s = &self.session;
        let len = s
            .allreduce("kf/resize/len", &[text.len() as u64], ReduceOp::Max)
            .await
            .map_err(op_failed)?[0];
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= 1 << 24)
            .ok_or_else(|| BootstrapError::Elastic(format!("config of {len} bytes")))?;
        text.resize(len, 0);
        let text = s
            .allreduce("kf/resize/config", &text, ReduceOp::Max)
            .await
            .map_err(op_failed)?;
        let text = String::from_utf8_lossy(&text);
        let cfg = match text.split_at_checked(1) {
            Some(("+", c)) => elastic::ClusterConfig::parse(c).map_err(BootstrapError::Elastic)?,
            Some((_, why)) => return Err(BootstrapError::Elastic(format!("rank 0: {why}"))),
            None => return Err(BootstrapError::Elastic("empty config".into())),
        };
        if cfg.version <= self.env.cluster_version {
            return Ok(Resized {
                changed: false,
                detached: false,
            });
        }
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank")
            .clone();
        let linger = Duration::from_secs(2);
        let Some(rank) = cfg.peers.rank_of(&me).map(Rank::idx) else {
            self.detached = true;
            self.leave_store().await;
            self.session.close(linger).await;
            return Ok(Resized {
                changed: true,
                detached: true,
            });
        };
        self.switch_to(rank, cfg, deadline).await?;
        self.joined = (began, SystemTime::now());
        Ok(Resized {
            changed: true,
            detached: false,
        })
    }

    /// Connects this worker, as `rank`, to the cluster `cfg` (new
    /// connections at its version, which the handshake checks, so no frame
    /// of the old one reaches them) while the old session's close.
    async fn switch_to(
        &mut self,
        rank: usize,
        cfg: elastic::ClusterConfig,
        deadline: Instant,
    ) -> Result<(), BootstrapError> {
        let env = self.env_for(rank, &cfg);
        let old = self.session.clone();
        let (new, ()) = tokio::join!(
            self.connect_version(&env, &cfg, deadline),
            old.close(Duration::from_secs(2))
        );
        self.adopt(new?, env, cfg).await;
        Ok(())
    }

    /// This worker's environment as `rank` of `cfg`.
    fn env_for(&self, rank: usize, cfg: &elastic::ClusterConfig) -> WorkerEnv {
        let mut env = self.env.clone();
        // the transport in use, which a swap may have changed
        env.transport = self.transport_kind();
        env.rank = rank;
        env.size = cfg.peers.len();
        env.cluster_version = cfg.version;
        env.discovery = Discovery::Peers(cfg.peers.clone());
        env
    }

    /// Listens at this worker's address again and connects a session to
    /// the cluster `cfg` as `env` says.
    async fn connect_version(
        &self,
        env: &WorkerEnv,
        cfg: &elastic::ClusterConfig,
        deadline: Instant,
    ) -> Result<Session<AnyTransport>, BootstrapError> {
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank");
        // the same address: with an inherited socket, a duplicate of it
        let listener = listen::listen(me, self.env.listen_fd).await?;
        connect::connect(
            env,
            &cfg.peers,
            self.cluster_id,
            &self.pool,
            listener,
            deadline,
        )
        .await
    }

    /// Takes `session`, connected to `cfg` as `env` says, as this
    /// worker's.
    async fn adopt(
        &mut self,
        session: Session<AnyTransport>,
        env: WorkerEnv,
        cfg: elastic::ClusterConfig,
    ) {
        // Every session of the new version starts on the launcher's
        // strategy (new workers know no other); the one in use here is
        // handed on by sync_state.
        self.carry = Some(self.session.strategy());
        self.session = session;
        self.env = env;
        self.peers = cfg.peers;
        self.auto_across_hosts().await;
    }

    /// Brings every worker to the same training state: the step counter,
    /// the strategy in use and the named buffers are broadcast from the
    /// lowest-ranked worker that has state (not [fresh](Worker::is_fresh)); returns the step.
    /// A collective: every worker passes the same names and lengths. Call
    /// it at start (new workers learn where training is) and after every
    /// resize that changed the cluster.
    pub async fn sync_state<E: Element>(
        &mut self,
        step: u64,
        buffers: &mut [(&str, &mut [E])],
    ) -> Result<u64, BootstrapError> {
        let s = &self.session;
        let mine = if self.fresh { u32::MAX } else { s.rank().0 };
        let root = s
            .allreduce("kf/state/root", &[mine], ReduceOp::Min)
            .await
            .map_err(op_failed)?[0];
        if root == u32::MAX {
            return Err(BootstrapError::Elastic(
                "no worker has state to share (every one joined late)".into(),
            ));
        }
        let root = Rank(root);
        let code = Strategy::ALL
            .iter()
            .position(|&x| x == self.carry.unwrap_or(s.strategy()))
            .expect("every strategy is in ALL") as u64;
        let got = s
            .broadcast("kf/state/step", &[step, code], root)
            .await
            .map_err(op_failed)?;
        let step = got[0];
        // new workers start with the launcher's strategy: take the root's
        let strategy = usize::try_from(got[1])
            .ok()
            .and_then(|i| Strategy::ALL.get(i).copied())
            .ok_or_else(|| BootstrapError::Elastic(format!("strategy code {}", got[1])))?;
        s.set_strategy(strategy);
        self.carry = None;
        for (name, buf) in buffers.iter_mut() {
            s.broadcast_in_place(&format!("kf/state/{name}"), buf, root)
                .await
                .map_err(op_failed)?;
        }
        self.fresh = false;
        Ok(step)
    }
}

fn op_failed(e: CollectiveError) -> BootstrapError {
    BootstrapError::Op(e)
}

#[cfg(test)]
mod tests {
    use std::os::fd::IntoRawFd;

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
