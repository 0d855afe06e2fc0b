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

use kungfu_topology::{fnv1a64, AutoThresholds, PeerList, Strategy};
use kungfu_transport::any::TransportKind;
use kungfu_transport::auth::JobSecret;
use kungfu_transport::pool::BufferPool;

use crate::BootstrapError;

/// The variable that holds the job's secret.
pub const SECRET_VAR: &str = "KUNGFU_JOB_SECRET";

/// Which launcher started this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    KungfuRun,
    Torchrun,
    Slurm,
    OpenMpi,
    /// Nothing set: a single worker.
    Single,
}

/// How a worker finds its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// The launcher gave the full peer list.
    Peers(PeerList),
    /// Workers register with a rendezvous server that rank 0 runs here.
    Rendezvous { host: String, port: u16 },
}

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
    /// `kungfu-run -w`): `http://host:port/cluster`, or
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

/// A port in 20000..40000 derived from a job id, the same on every rank.
fn derived_port(job: &str) -> u16 {
    20_000 + (fnv1a64(0xcbf2_9ce4_8422_2325, job.as_bytes()) % 20_000) as u16
}

/// The first host name of a Slurm node list such as `node[07-09,12],gpu1`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list
        .char_indices()
        .scan(0i32, |depth, (i, c)| {
            match c {
                '[' => *depth += 1,
                ']' => *depth -= 1,
                _ => {}
            }
            Some((i, c, *depth))
        })
        .find(|&(_, c, d)| c == ',' && d == 0)
        .map_or(list.len(), |(i, _, _)| i);
    let first = &list[..end];
    match first.split_once('[') {
        None => (!first.is_empty()).then(|| first.to_string()),
        Some((prefix, rest)) => {
            let inner = rest.strip_suffix(']')?;
            let lo = inner.split([',', '-']).next()?;
            if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some(format!("{prefix}{lo}"))
        }
    }
}

fn rendezvous_override(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(String, u16)>, BootstrapError> {
    let Some(v) = get("KUNGFU_RENDEZVOUS") else {
        return Ok(None);
    };
    let (h, p) = v.rsplit_once(':').ok_or_else(|| BootstrapError::Env {
        var: "KUNGFU_RENDEZVOUS".into(),
        reason: format!("expected HOST:PORT, got {v:?}"),
    })?;
    Ok(Some((
        h.trim_matches(['[', ']']).to_string(),
        parse("KUNGFU_RENDEZVOUS", p)?,
    )))
}

impl WorkerEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<WorkerEnv, BootstrapError> {
        WorkerEnv::from_vars(&|k| std::env::var(k).ok())
    }

    /// Reads from `get` (a stand-in for the environment, for tests).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<WorkerEnv, BootstrapError> {
        let need = |k: &str| {
            get(k).ok_or_else(|| BootstrapError::Env {
                var: k.into(),
                reason: "not set".into(),
            })
        };
        let num = |k: &str| -> Result<usize, BootstrapError> { parse(k, &need(k)?) };
        let port_override = get("KUNGFU_RENDEZVOUS_PORT")
            .map(|p| parse::<u16>("KUNGFU_RENDEZVOUS_PORT", &p))
            .transpose()?;
        let over = rendezvous_override(get)?;
        let rdv = |host: String, port: u16| {
            let (h, p) = over.clone().unwrap_or((host, port));
            Discovery::Rendezvous {
                host: h,
                port: port_override.unwrap_or(p),
            }
        };

        let mut listen_fd = None;
        let (launcher, rank, size, discovery) = if get("KUNGFU_RANK").is_some() {
            let peers: PeerList =
                need("KUNGFU_PEERS")?
                    .parse()
                    .map_err(|e| BootstrapError::Env {
                        var: "KUNGFU_PEERS".into(),
                        reason: format!("{e}"),
                    })?;
            let (rank, size) = (num("KUNGFU_RANK")?, num("KUNGFU_SIZE")?);
            if size != peers.len() {
                return Err(BootstrapError::Env {
                    var: "KUNGFU_SIZE".into(),
                    reason: format!("{size}, but KUNGFU_PEERS lists {} peers", peers.len()),
                });
            }
            listen_fd = get(crate::listen::LISTEN_FD_VAR)
                .map(|v| parse::<i32>(crate::listen::LISTEN_FD_VAR, &v))
                .transpose()?;
            (Launcher::KungfuRun, rank, size, Discovery::Peers(peers))
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            let (rank, size) = (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?);
            let local_size = get("OMPI_COMM_WORLD_LOCAL_SIZE")
                .map(|v| parse::<usize>("OMPI_COMM_WORLD_LOCAL_SIZE", &v))
                .transpose()?;
            if over.is_none() && local_size != Some(size) {
                return Err(BootstrapError::Env {
                    var: "KUNGFU_RENDEZVOUS".into(),
                    reason: "mpirun across hosts: set KUNGFU_RENDEZVOUS=HOST:PORT (a host of rank 0) and pass it with -x".into(),
                });
            }
            let job = [
                "OMPI_MCA_ess_base_jobid",
                "OMPI_MCA_orte_ess_jobid",
                "PMIX_NAMESPACE",
                "OMPI_MCA_orte_hnp_uri",
            ]
            .iter()
            .find_map(|k| get(k))
            .unwrap_or_else(|| "ompi".into());
            (
                Launcher::OpenMpi,
                rank,
                size,
                rdv("127.0.0.1".into(), derived_port(&job)),
            )
        } else if get("SLURM_PROCID").is_some() {
            let (rank, size) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?);
            let nodes = need("SLURM_JOB_NODELIST")?;
            let host = first_slurm_host(&nodes).ok_or_else(|| BootstrapError::Env {
                var: "SLURM_JOB_NODELIST".into(),
                reason: format!("cannot find a first host in {nodes:?}"),
            })?;
            let job = get("SLURM_JOB_ID").unwrap_or_else(|| nodes.clone());
            (Launcher::Slurm, rank, size, rdv(host, derived_port(&job)))
        } else if get("RANK").is_some() && get("WORLD_SIZE").is_some() {
            let (rank, size) = (num("RANK")?, num("WORLD_SIZE")?);
            let host = need("MASTER_ADDR")?;
            let port: u16 = parse("MASTER_PORT", &need("MASTER_PORT")?)?;
            // torchrun's agent serves its own store on MASTER_PORT.
            let port = port.checked_add(1).ok_or_else(|| BootstrapError::Env {
                var: "MASTER_PORT".into(),
                reason: "65535 leaves no port for the rendezvous; set KUNGFU_RENDEZVOUS_PORT"
                    .into(),
            })?;
            (Launcher::Torchrun, rank, size, rdv(host, port))
        } else {
            let peers = PeerList::local(1);
            (Launcher::Single, 0, 1, Discovery::Peers(peers))
        };
        if size == 0 || rank >= size {
            return Err(BootstrapError::Env {
                var: "rank".into(),
                reason: format!("rank {rank} outside a cluster of {size}"),
            });
        }
        if size > PeerList::MAX_SIZE {
            return Err(BootstrapError::Env {
                var: "size".into(),
                reason: format!("{size} workers; at most {}", PeerList::MAX_SIZE),
            });
        }
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
        Ok(WorkerEnv {
            secret,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<WorkerEnv, BootstrapError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WorkerEnv::from_vars(&move |k| m.get(k).cloned())
    }

    #[test]
    fn transports_and_quic_files_are_checked() {
        let base = [
            ("KUNGFU_RANK", "0"),
            ("KUNGFU_SIZE", "1"),
            ("KUNGFU_PEERS", "127.0.0.1:5000"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            env(&v)
        };
        let e = with(&[("KUNGFU_TRANSPORT", "quic")]).unwrap();
        assert_eq!((e.transport, e.quic_files), (TransportKind::Quic, None));
        let e = with(&[("KUNGFU_TRANSPORT", "udp")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KUNGFU_TRANSPORT") && e.contains("one of: auto"),
            "{e}"
        );
        let e = with(&[("KUNGFU_QUIC_CA", "/a"), ("KUNGFU_QUIC_KEY", "/c")]);
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("KUNGFU_QUIC_CERT") && e.contains("all three"),
            "{e}"
        );
        let all = [
            ("KUNGFU_QUIC_CA", "/a"),
            ("KUNGFU_QUIC_CERT", "/b"),
            ("KUNGFU_QUIC_KEY", "/c"),
        ];
        let f = with(&all).unwrap().quic_files.unwrap();
        assert_eq!(
            (f.ca, f.cert, f.key),
            ("/a".into(), "/b".into(), "/c".into())
        );
    }

    #[test]
    fn kungfu_run_variables() {
        let e = env(&[
            ("KUNGFU_RANK", "1"),
            ("KUNGFU_SIZE", "2"),
            ("KUNGFU_PEERS", "127.0.0.1:5000,127.0.0.1:5001"),
            ("KUNGFU_STRATEGY", "ring"),
            ("KUNGFU_CLUSTER_ID", "0xabc"),
        ])
        .unwrap();
        assert_eq!((e.launcher, e.rank, e.size), (Launcher::KungfuRun, 1, 2));
        assert_eq!(e.strategy, Strategy::Ring);
        assert_eq!(e.cluster_id, Some(0xabc));
        assert_eq!(e.secret, None, "not set: nothing is authenticated");
        assert_eq!(e.auto, AutoThresholds::default());
        assert_eq!(e.spin, None);
        assert_eq!(e.listen_fd, None);
        assert_eq!(e.buffer_pool_bytes, 256 << 20);
        let base = [
            ("KUNGFU_RANK", "0"),
            ("KUNGFU_SIZE", "1"),
            ("KUNGFU_PEERS", "127.0.0.1:5000"),
        ];
        let tuned = [
            base.as_slice(),
            &[
                ("KUNGFU_AUTO_LARGE_BYTES", "4096"),
                ("KUNGFU_SPIN_US", "7"),
                ("KUNGFU_BUFFER_POOL_BYTES", "0"),
            ],
        ]
        .concat();
        let e = env(&tuned).unwrap();
        assert_eq!(e.auto.large_bytes, 4096);
        assert_eq!(e.buffer_pool_bytes, 0);
        let passed = [base.as_slice(), &[("KUNGFU_LISTEN_FD", "7")]].concat();
        assert_eq!(env(&passed).unwrap().listen_fd, Some(7));
        let bad = [base.as_slice(), &[("KUNGFU_LISTEN_FD", "seven")]].concat();
        assert!(env(&bad).is_err());
        assert_eq!(e.spin, Some(Duration::from_micros(7)));
        let bad = [base.as_slice(), &[("KUNGFU_AUTO_LARGE_BYTES", "big")]].concat();
        let err = env(&bad).unwrap_err().to_string();
        assert!(err.contains("KUNGFU_AUTO_LARGE_BYTES"), "{err}");
        assert!(env(&[
            ("KUNGFU_RANK", "1"),
            ("KUNGFU_SIZE", "3"),
            ("KUNGFU_PEERS", "a:1,a:2")
        ])
        .is_err());
    }

    #[test]
    fn the_job_secret() {
        let base = [
            ("KUNGFU_RANK", "0"),
            ("KUNGFU_SIZE", "1"),
            ("KUNGFU_PEERS", "127.0.0.1:5000"),
        ];
        let with = |v: &str| env(&[base.as_slice(), &[("KUNGFU_JOB_SECRET", v)]].concat());
        let e = with("0123abcd").unwrap();
        assert_eq!(e.secret, Some(JobSecret::new(b"0123abcd").unwrap()));
        assert!(!format!("{e:?}").contains("0123abcd"), "never printed");
        assert_eq!(with("").unwrap().secret, None, "empty is unset");
        let long = "x".repeat(2000);
        let err = with(&long).unwrap_err().to_string();
        assert!(
            err.contains("KUNGFU_JOB_SECRET") && err.contains("at most"),
            "{err}"
        );
        // every launcher's workers read it
        let t = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "29500"),
            ("KUNGFU_JOB_SECRET", "s"),
        ])
        .unwrap();
        assert!(t.secret.is_some());
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!(
            e.discovery,
            Discovery::Rendezvous {
                host: "10.1.2.3".into(),
                port: 29501
            }
        );
        assert!(env(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1")
        ])
        .is_err());
    }

    #[test]
    fn slurm_and_mpi_variables() {
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_NODELIST", "gpu[07-09],x1"),
            ("SLURM_JOB_ID", "77"),
        ])
        .unwrap();
        match e.discovery {
            Discovery::Rendezvous { host, port } => {
                assert_eq!(host, "gpu07");
                assert_eq!(port, derived_port("77"));
            }
            d => panic!("{d:?}"),
        }
        let m = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("KUNGFU_RENDEZVOUS_PORT", "4444"),
        ])
        .unwrap();
        assert_eq!(
            m.discovery,
            Discovery::Rendezvous {
                host: "127.0.0.1".into(),
                port: 4444
            }
        );
        // across hosts, mpirun needs an explicit rendezvous
        assert!(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
        ])
        .is_err());
        let o = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("KUNGFU_RENDEZVOUS", "h0:99"),
        ])
        .unwrap();
        assert_eq!(
            o.discovery,
            Discovery::Rendezvous {
                host: "h0".into(),
                port: 99
            }
        );
    }

    #[test]
    fn nothing_set_is_a_single_worker() {
        let e = env(&[]).unwrap();
        assert_eq!((e.launcher, e.rank, e.size), (Launcher::Single, 0, 1));
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_slurm_host("node1"), Some("node1".into()));
        assert_eq!(first_slurm_host("a[001-004,9],b2"), Some("a001".into()));
        assert_eq!(first_slurm_host("x[3],y"), Some("x3".into()));
        assert_eq!(first_slurm_host("bad[]"), None);
        assert_eq!(first_slurm_host(""), None);
    }
}
