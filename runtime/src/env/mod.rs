//! What a worker learns from its environment: who it is and how to find
//! its peers, whichever launcher started it.
//!
//! | launcher | identity | peers |
//! |---|---|---|
//! | `kungfu-run` | `KUNGFU_RANK`, `KUNGFU_SIZE`, `KUNGFU_LOCAL_RANK`, `KUNGFU_LOCAL_SIZE` | `KUNGFU_PEERS` (the full list) |
//! | torchrun | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | rendezvous at `MASTER_ADDR`:`MASTER_PORT`+1 |
//! | Slurm `srun` | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` | rendezvous on the first node of `SLURM_JOB_NODELIST` |
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK` | rendezvous on 127.0.0.1 when all ranks share a host |
//!
//! On one machine, kungfu-run also passes each worker its listening socket,
//! already bound (`KUNGFU_LISTEN_FD`; see [`crate::listen`]).
//!
//! `KUNGFU_RENDEZVOUS=host:port` overrides the rendezvous address for any
//! launcher, and `KUNGFU_RENDEZVOUS_PORT` just the port. Where no port is
//! given (Slurm, Open MPI), it is derived from the job id, so every rank of
//! a job computes the same one.
//!
//! # The job secret
//!
//! `KUNGFU_JOB_SECRET` is the secret every worker of the job shares: each
//! link proves it in the transports' handshake (TCP, shared memory,
//! libfabric, ibverbs; QUIC has mutual TLS), the rendezvous checks it on
//! each registration, and the config server of `kungfu-run -w` wants a
//! token made from it for each change. `kungfu-run` always sets it (its
//! own `KUNGFU_JOB_SECRET`, or a random one per job). Unset (or empty),
//! nothing is authenticated, as before: torchrun, `srun` and `mpirun`
//! jobs keep working unchanged, and should set it on every rank (the same
//! value; e.g. `export KUNGFU_JOB_SECRET=$(openssl rand -hex 32)` where
//! the job is submitted) to be authenticated. A worker does not make one
//! up: the others could not know it.

use std::path::PathBuf;
use std::time::Duration;

use kungfu_topology::{AutoThresholds, Strategy};
use kungfu_transport::any::TransportKind;
use kungfu_transport::auth::JobSecret;
use kungfu_transport::pool::BufferPool;

use crate::BootstrapError;

mod launcher;
#[cfg(test)]
mod tests;

use launcher::Identity;
pub use launcher::{first_slurm_host, Discovery, Launcher, ALONE_VAR, SELF_HOST_VAR};

/// The variable that holds the job's secret.
pub const SECRET_VAR: &str = "KUNGFU_JOB_SECRET";

/// Where a worker's QUIC certificates are (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicFiles {
    /// The CA certificate(s) peers are checked against.
    pub ca: PathBuf,
    /// This worker's certificate chain.
    pub cert: PathBuf,
    /// This worker's private key.
    pub key: PathBuf,
}

/// The three QUIC variables: all or none.
fn quic_files(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<QuicFiles>, BootstrapError> {
    const VARS: [&str; 3] = ["KUNGFU_QUIC_CA", "KUNGFU_QUIC_CERT", "KUNGFU_QUIC_KEY"];
    let [ca, cert, key] = VARS.map(|v| get(v).filter(|s| !s.is_empty()));
    match (ca, cert, key) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => Ok(Some(QuicFiles {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        })),
        (ca, cert, _) => {
            let missing = if ca.is_none() {
                VARS[0]
            } else if cert.is_none() {
                VARS[1]
            } else {
                VARS[2]
            };
            Err(BootstrapError::Env {
                var: missing.into(),
                reason: format!("{} go together: set all three or none", VARS.join(", ")),
            })
        }
    }
}

/// Everything the runtime reads from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEnv {
    pub launcher: Launcher,
    pub rank: usize,
    pub size: usize,
    pub discovery: Discovery,
    pub strategy: Strategy,
    /// `KUNGFU_TRANSPORT` (default auto).
    pub transport: TransportKind,
    /// The QUIC certificates (`KUNGFU_QUIC_CA`, `KUNGFU_QUIC_CERT`,
    /// `KUNGFU_QUIC_KEY`: PEM files; kungfu-run makes them per job).
    pub quic_files: Option<QuicFiles>,
    /// With `fabric`: the libfabric provider (`KUNGFU_FABRIC_PROVIDER`,
    /// e.g. `verbs;ofi_rxm`, `efa`, `tcp;ofi_rxm`, `shm`); unset,
    /// libfabric's first choice, which honours `FI_PROVIDER`.
    pub fabric_provider: Option<String>,
    /// With `verbs`: the RDMA device (`KUNGFU_VERBS_DEVICE`, e.g. `mlx5_0`,
    /// `rxe0`); unset, the first with an active port.
    pub verbs_device: Option<String>,
    /// The cluster version (the config server's; the transport's
    /// `ClusterVersion`, widened where it connects).
    pub cluster_version: u32,
    /// Set by kungfu-run; with a rendezvous, rank 0 chooses it. Sent in
    /// clear: it keeps jobs apart, it proves nothing.
    pub cluster_id: Option<u64>,
    /// The job's secret (`KUNGFU_JOB_SECRET`; see "The job secret"
    /// above): `None`, nothing is authenticated.
    pub secret: Option<JobSecret>,
    /// `KUNGFU_SECURE=1`: every frame between hosts must be authenticated,
    /// so a job across hosts runs on QUIC (`auto` becomes `quic`; `tcp`,
    /// `fabric` and `verbs`, whose frames carry no MAC, are refused, at
    /// start and in a swap). Needs the secret. No effect on one host.
    pub secure: bool,
    pub connect_timeout: Duration,
    pub op_timeout: Duration,
    /// A peer silent this long (no frame, no heartbeat) is lost
    /// (`KUNGFU_PEER_TIMEOUT_MS`, 1500; 0: no heartbeats, only broken
    /// connections tell). See `kungfu_transport::endpoint::Liveness`.
    pub peer_timeout: Duration,
    /// An op that some rank has waited on this long is in the stall
    /// report, which every worker logs (`KUNGFU_STALL_TIMEOUT_MS`, 10000;
    /// 0: no report is published or logged). See
    /// `kungfu_collectives::Session::watch_stalls`.
    pub stall_timeout: Duration,
    pub chunk_bytes: usize,
    /// Ops of at most this many bytes per rank take the host fast path
    /// when every rank is on this host (`KUNGFU_FAST_MAX_BYTES`; 1048576:
    /// allreduce whose slices fit a lane's slot, broadcast and allgather
    /// up to a slot, 262144; 0: off). See
    /// `kungfu_collectives::SessionConfig::fast_max_bytes`.
    pub fast_max_bytes: usize,
    /// Which larger ops of one host move their bytes by cross-memory
    /// attach (`KUNGFU_FAST_LARGE`: 0 none, through the rings; 1
    /// broadcast and allgather, the default; 2 allreduce too). See
    /// `kungfu_collectives::SessionConfig::fast_large`.
    pub fast_large: kungfu_collectives::FastLarge,
    /// Write a Chrome trace of every op's phases here
    /// (`KUNGFU_TIMELINE=FILE`; see `kungfu_collectives::timeline` for the
    /// file of each rank); `None`: off.
    pub timeline: Option<String>,
    /// The budget of the process's buffer pool: idle buffers kept for
    /// reuse, in bytes at most (`KUNGFU_BUFFER_POOL_BYTES`; 256 MiB; see
    /// `kungfu_transport::pool`).
    pub buffer_pool_bytes: usize,
    /// `AUTO`'s size threshold (`KUNGFU_AUTO_LARGE_BYTES`).
    pub auto: AutoThresholds,
    /// How long a receive polls before it sleeps (`KUNGFU_SPIN_US`; the
    /// transport's default when unset).
    pub spin: Option<Duration>,
    /// The config server of an elastic job (`KUNGFU_CONFIG_SERVER`, set by
    /// `kungfu-run -w`): `http://host:port/cluster` (`https://` across
    /// hosts), or
    /// `etcd://host:port/prefix` with `--config-store` (see [`crate::store`]).
    pub config_server: Option<String>,
    /// The listening socket kungfu-run bound for this worker and passed
    /// down (`KUNGFU_LISTEN_FD`; see [`crate::listen`]). Read only with
    /// kungfu-run's variables: other launchers pass no socket.
    pub listen_fd: Option<i32>,
}

fn parse<T: std::str::FromStr>(var: &str, v: &str) -> Result<T, BootstrapError> {
    v.trim().parse().map_err(|_| BootstrapError::Env {
        var: var.to_string(),
        reason: format!("cannot parse {v:?}"),
    })
}

impl WorkerEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<WorkerEnv, BootstrapError> {
        WorkerEnv::from_vars(&|k| std::env::var(k).ok())
    }

    /// Reads from `get` (a stand-in for the environment, for tests).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<WorkerEnv, BootstrapError> {
        let Identity {
            launcher,
            rank,
            size,
            discovery,
            listen_fd,
        } = Identity::from_vars(get)?;
        let ms = |k: &str, default: u64| -> Result<Duration, BootstrapError> {
            Ok(Duration::from_millis(
                get(k).map(|v| parse(k, &v)).transpose()?.unwrap_or(default),
            ))
        };
        let strategy = match get("KUNGFU_STRATEGY") {
            Some(s) => s.parse().map_err(|e| BootstrapError::Env {
                var: "KUNGFU_STRATEGY".into(),
                reason: format!("{e}"),
            })?,
            None => Strategy::Auto,
        };
        let cluster_id = get("KUNGFU_CLUSTER_ID")
            .map(|v| {
                u64::from_str_radix(v.trim().trim_start_matches("0x"), 16).map_err(|_| {
                    BootstrapError::Env {
                        var: "KUNGFU_CLUSTER_ID".into(),
                        reason: format!("expected hex, got {v:?}"),
                    }
                })
            })
            .transpose()?;
        let chunk_bytes = get("KUNGFU_CHUNK_BYTES")
            .map(|v| parse("KUNGFU_CHUNK_BYTES", &v))
            .transpose()?
            .unwrap_or(1 << 20);
        let bytes = |var: &str, default: usize| -> Result<usize, BootstrapError> {
            Ok(get(var)
                .map(|v| parse(var, &v))
                .transpose()?
                .unwrap_or(default))
        };
        let def = AutoThresholds::default();
        let auto = AutoThresholds {
            large_bytes: bytes("KUNGFU_AUTO_LARGE_BYTES", def.large_bytes)?,
            ring_min_share: bytes("KUNGFU_AUTO_RING_MIN_SHARE", def.ring_min_share)?,
        };
        let buffer_pool_bytes = bytes("KUNGFU_BUFFER_POOL_BYTES", BufferPool::DEFAULT_BUDGET)?;
        let fast_max_bytes = bytes(
            "KUNGFU_FAST_MAX_BYTES",
            kungfu_collectives::DEFAULT_FAST_MAX_BYTES,
        )?;
        let spin = get("KUNGFU_SPIN_US")
            .map(|v| parse("KUNGFU_SPIN_US", &v).map(Duration::from_micros))
            .transpose()?;
        let secret = get(SECRET_VAR)
            .filter(|v| !v.is_empty())
            .map(|v| {
                JobSecret::new(v.as_bytes()).map_err(|e| BootstrapError::Env {
                    var: SECRET_VAR.into(),
                    reason: e.to_string(),
                })
            })
            .transpose()?;
        let secure = match get("KUNGFU_SECURE").as_deref() {
            None | Some("") | Some("0") => false,
            Some("1") => true,
            Some(v) => {
                return Err(BootstrapError::Env {
                    var: "KUNGFU_SECURE".into(),
                    reason: format!("{v:?}: 1 (on) or 0 (off)"),
                })
            }
        };
        if secure && secret.is_none() {
            return Err(BootstrapError::Env {
                var: "KUNGFU_SECURE".into(),
                reason: "KUNGFU_SECURE=1 needs the job's secret (KUNGFU_JOB_SECRET), which keys \
                         the links"
                    .into(),
            });
        }
        Ok(WorkerEnv {
            secret,
            secure,
            spin,
            config_server: get("KUNGFU_CONFIG_SERVER"),
            listen_fd,
            auto,
            launcher,
            rank,
            size,
            discovery,
            strategy,
            transport: get("KUNGFU_TRANSPORT")
                .map(|v| {
                    v.parse().map_err(|reason| BootstrapError::Env {
                        var: "KUNGFU_TRANSPORT".into(),
                        reason,
                    })
                })
                .transpose()?
                .unwrap_or(TransportKind::Auto),
            quic_files: quic_files(get)?,
            fabric_provider: get("KUNGFU_FABRIC_PROVIDER").filter(|p| !p.is_empty()),
            verbs_device: get("KUNGFU_VERBS_DEVICE").filter(|d| !d.is_empty()),
            cluster_version: get("KUNGFU_CLUSTER_VERSION")
                .map(|v| parse("KUNGFU_CLUSTER_VERSION", &v))
                .transpose()?
                .unwrap_or(0),
            cluster_id,
            connect_timeout: ms("KUNGFU_CONNECT_TIMEOUT_MS", 60_000)?,
            op_timeout: ms("KUNGFU_OP_TIMEOUT_MS", 60_000)?,
            peer_timeout: ms("KUNGFU_PEER_TIMEOUT_MS", 1_500)?,
            stall_timeout: ms("KUNGFU_STALL_TIMEOUT_MS", 10_000)?,
            chunk_bytes,
            fast_max_bytes,
            timeline: get("KUNGFU_TIMELINE").filter(|v| !v.is_empty()),
            fast_large: match bytes("KUNGFU_FAST_LARGE", 1)? {
                0 => kungfu_collectives::FastLarge::Off,
                1 => kungfu_collectives::FastLarge::Copies,
                2 => kungfu_collectives::FastLarge::All,
                v => {
                    return Err(BootstrapError::Env {
                        var: "KUNGFU_FAST_LARGE".into(),
                        reason: format!("{v}: 0, 1 or 2"),
                    })
                }
            },
            buffer_pool_bytes,
        })
    }
}
