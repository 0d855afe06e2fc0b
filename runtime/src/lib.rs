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

use kungfu_collectives::{CollectiveError, Session, SessionConfig};
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::any::AnyTransport;
use kungfu_transport::hybrid::HybridTransport;
use kungfu_transport::shm::{ShmConfig, ShmTransport};
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
use kungfu_transport::{Epoch, TransportError};
use tokio::net::TcpListener;
use tokio::time::Instant;

pub mod env;
pub mod rendezvous;

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
    #[error("transport {0:?} is not available (this build has: tcp, shm, auto)")]
    UnsupportedTransport(String),
    #[error("connecting to the peers: {0}")]
    Transport(#[from] TransportError),
    #[error("starting the session: {0}")]
    Session(#[from] CollectiveError),
}

/// A started worker: its environment and its session.
pub struct Worker {
    env: WorkerEnv,
    peers: PeerList,
    session: Session<AnyTransport>,
}

impl Worker {
    /// Finds the peers as `env` says, connects to all of them and starts a
    /// session. Must run inside a multi-threaded tokio runtime.
    pub async fn start(env: WorkerEnv) -> Result<Worker, BootstrapError> {
        if !["tcp", "shm", "auto"].contains(&env.transport.as_str()) {
            return Err(BootstrapError::UnsupportedTransport(env.transport.clone()));
        }
        let deadline = Instant::now() + env.connect_timeout;
        let (listener, peers, cluster_id) = match &env.discovery {
            Discovery::Peers(peers) => {
                let me = peers.peer(Rank(env.rank as u32)).expect("validated rank");
                let addr = me.to_string();
                let l = TcpListener::bind((me.host.as_str(), me.port))
                    .await
                    .map_err(|source| BootstrapError::Listen { addr, source })?;
                (l, peers.clone(), env.cluster_id.unwrap_or(0))
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
        let connect_timeout = deadline.saturating_duration_since(Instant::now());
        let one_host = peers.hosts().len() == 1;
        let shm_cfg = || {
            let mut c = ShmConfig::new(
                cluster_id,
                Epoch(env.cluster_version),
                Rank(env.rank as u32),
                env.size,
            );
            c.connect_timeout = connect_timeout;
            if let Some(spin) = env.spin {
                c.spin = spin;
            }
            c
        };
        let tcp_cfg = || {
            let mut c = TcpConfig::new(
                cluster_id,
                Epoch(env.cluster_version),
                Rank(env.rank as u32),
                peers.clone(),
            );
            c.connect_timeout = connect_timeout;
            if let Some(spin) = env.spin {
                c.spin = spin;
            }
            c
        };
        let transport = match env.transport.as_str() {
            "shm" if !one_host => {
                return Err(BootstrapError::Env {
                    var: "KUNGFU_TRANSPORT".into(),
                    reason: format!(
                        "shm needs every worker on one host; these are on {} hosts (use tcp or auto)",
                        peers.hosts().len()
                    ),
                });
            }
            "shm" | "auto" if one_host => {
                drop(listener);
                AnyTransport::Shm(ShmTransport::connect(shm_cfg()).await?)
            }
            "auto" => AnyTransport::Hybrid(
                HybridTransport::connect(tcp_cfg(), shm_cfg(), &peers, listener).await?,
            ),
            _ => AnyTransport::Tcp(TcpTransport::connect(tcp_cfg(), listener).await?),
        };
        let transport = Arc::new(transport);
        let session = Session::new(
            transport,
            peers.clone(),
            SessionConfig {
                strategy: env.strategy,
                chunk_bytes: env.chunk_bytes,
                auto: env.auto,
                op_timeout: env.op_timeout,
                ..SessionConfig::default()
            },
        )?;
        Ok(Worker {
            env,
            peers,
            session,
        })
    }

    /// Closes the connections gracefully, waiting up to `linger` for the
    /// peers to finish with this worker. Call it before exiting.
    pub async fn close(self, linger: std::time::Duration) {
        self.session.close(linger).await;
    }

    pub fn session(&self) -> &Session<AnyTransport> {
        &self.session
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

    /// The position of this worker among the workers of its host.
    pub fn local_rank(&self) -> usize {
        self.peers.local_rank(Rank(self.env.rank as u32))
    }

    /// The number of workers on this worker's host.
    pub fn local_size(&self) -> usize {
        self.peers.local_size(Rank(self.env.rank as u32))
    }
}
