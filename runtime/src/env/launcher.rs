//! Which launcher started this worker, and what follows from its
//! variables: the rank, the size and how the worker finds its peers (the
//! full list, or a rendezvous whose address the launcher's variables give
//! or a job id derives).

use kungfu_topology::{fnv1a64, PeerList};

use super::parse;
use crate::BootstrapError;

/// The address a worker that no launcher started listens on (and names in
/// its reconfigure handle); 127.0.0.1 when unset.
pub const SELF_HOST_VAR: &str = "KUNGFU_SELF_HOST";

/// `1`: the worker starts alone whatever launcher's variables are set (a
/// process group whose members a reconfigure names, as torchft's replica
/// groups: their torchrun's `RANK` and `WORLD_SIZE` are of another group).
pub const ALONE_VAR: &str = "KUNGFU_ALONE";

/// Which launcher started this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    KungfuRun,
    Torchrun,
    Slurm,
    OpenMpi,
    /// Nothing set: a single worker, until a reconfigure names its peers.
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

/// Who a worker is and how it finds its peers, as its launcher says.
pub(super) struct Identity {
    pub(super) launcher: Launcher,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) discovery: Discovery,
    /// kungfu-run's listening socket (`KUNGFU_LISTEN_FD`), read only with
    /// kungfu-run's variables.
    pub(super) listen_fd: Option<i32>,
}

impl Identity {
    /// Reads the launcher's variables from `get`; checks that the rank
    /// is in the cluster and the size within [`PeerList::MAX_SIZE`].
    pub(super) fn from_vars(
        get: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Identity, BootstrapError> {
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
        let alone = match get(ALONE_VAR).as_deref() {
            None | Some("") | Some("0") => false,
            Some("1") => true,
            Some(v) => {
                return Err(BootstrapError::Env {
                    var: ALONE_VAR.into(),
                    reason: format!("{v:?}: 1 (start alone) or 0"),
                })
            }
        };
        let (launcher, rank, size, discovery) = if alone {
            single(get)?
        } else if get("KUNGFU_RANK").is_some() {
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
            single(get)?
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
        Ok(Identity {
            launcher,
            rank,
            size,
            discovery,
            listen_fd,
        })
    }
}

/// A worker alone, at a port chosen when it starts (port 0 here: see
/// `Worker::start`), on `KUNGFU_SELF_HOST`: a reconfigure may later make
/// it one of many (its handle carries the address).
fn single(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<(Launcher, usize, usize, Discovery), BootstrapError> {
    let host = get(SELF_HOST_VAR)
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "127.0.0.1".into());
    let me = kungfu_topology::Peer { host, port: 0 };
    let peers = PeerList::new(vec![me]).map_err(|e| BootstrapError::Env {
        var: SELF_HOST_VAR.into(),
        reason: e.to_string(),
    })?;
    Ok((Launcher::Single, 0, 1, Discovery::Peers(peers)))
}

/// A port in 20000..40000 derived from a job id, the same on every rank.
pub(super) fn derived_port(job: &str) -> u16 {
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
