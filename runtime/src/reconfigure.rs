//! Reconfigure: make the cluster exactly the workers a caller lists, in
//! the caller's order, with no config server ([`Worker::reconfigure`]).
//!
//! This is the library's side of torch's process-group reconfigure
//! (`get_reconfigure_handle`, `reconfigure(uuid, handles)`): each worker
//! hands out a [`WorkerHandle`], the caller gathers them by its own means
//! (torch's store, torchft's lighthouse, a launcher) and every listed
//! worker calls [`Worker::reconfigure`] with the same uuid and the same
//! list. They connect anew, as a resize does, at a cluster version derived
//! from the uuid and the list, so no frame of an earlier membership
//! reaches the new one (the transports' handshake checks the version).
//!
//! # Handles
//!
//! `kungfu:1:<worker id>:<cluster id>:<proof>:<host>:<port>`, ids in hex.
//! The proof is an HMAC under the job's secret of the rest, so a handle of
//! another job (another secret) is refused by name before anything
//! connects; without a secret it is `-` and nothing is proved (as with
//! every other link of a job without one). The address is where the worker
//! accepts its peers for every version: the port is held for the life of
//! the process.
//!
//! # Uuids
//!
//! Each worker refuses a uuid it has reconfigured with before ("already
//! used"), at once and without touching its cluster; the other members
//! then fail at their timeout, naming the worker that never connected.
//!
//! # Failures
//!
//! Before the new cluster is connected the old one is closed, as in a
//! resize: after a failed reconfigure (a member that never came, a dead
//! one) the worker belongs to no cluster, its ops fail, and a reconfigure
//! with a fresh uuid brings it back. [`Worker::abort`] puts a worker in
//! that state on purpose.

use std::time::{Duration, SystemTime};

use kungfu_topology::{fnv1a64, Peer, PeerList, Rank};
use kungfu_transport::auth::{self, JobSecret, MAC_LEN};
use tokio::time::Instant;

use crate::{elastic, BootstrapError, Worker, WorkerEnv};

/// The label of a handle's proof (a MAC made for another use of the
/// secret is worth nothing here).
const LABEL: &[u8] = b"kungfu reconfigure handle v1";
/// How a handle starts: the format's name and version.
const PREFIX: &str = "kungfu:1:";
/// The longest handle accepted (a host name is at most 253 bytes).
pub const MAX_HANDLE: usize = 512;

/// Why a reconfigure was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconfigureError {
    /// A handle that does not parse, or does not prove this job's secret.
    /// Nothing changed.
    #[error("reconfigure: handle {index} ({text:?}): {reason}")]
    BadHandle {
        index: usize,
        text: String,
        reason: String,
    },
    /// The list is empty, or names one worker twice. Nothing changed.
    #[error("reconfigure: {0}")]
    BadList(String),
    /// This worker's handle is not in the list. Nothing changed.
    #[error("reconfigure: this worker ({mine}) is not among the {n} handles listed")]
    NotListed { mine: String, n: usize },
    /// This worker took part in a reconfigure with this uuid before.
    /// Nothing changed.
    #[error(
        "reconfigure: uuid {uuid} was already used by this worker; each reconfigure needs a \
         fresh uuid"
    )]
    UuidUsed { uuid: i64 },
    /// Connecting the new cluster failed (a member never came, or died):
    /// the old cluster is closed and this worker belongs to none until a
    /// reconfigure with a fresh uuid succeeds.
    #[error("reconfigure (uuid {uuid}) to {n} workers failed: {source}")]
    Connect {
        uuid: i64,
        n: usize,
        #[source]
        source: BootstrapError,
    },
}

/// A worker's reconfigure handle: who it is, where it accepts its peers,
/// and a proof that it holds the job's secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerHandle {
    /// Random, one per process.
    pub id: u64,
    pub cluster_id: u64,
    pub peer: Peer,
    mac: Option<[u8; MAC_LEN]>,
}

impl WorkerHandle {
    fn new(id: u64, cluster_id: u64, peer: Peer, secret: Option<&JobSecret>) -> WorkerHandle {
        let mac = secret.map(|s| proof(s, id, cluster_id, &peer));
        WorkerHandle {
            id,
            cluster_id,
            peer,
            mac,
        }
    }

    /// The text form (see the module docs).
    pub fn encode(&self) -> String {
        let proof = self.mac.map_or_else(|| "-".to_string(), |m| auth::hex(&m));
        format!(
            "{PREFIX}{:016x}:{:016x}:{proof}:{}",
            self.id, self.cluster_id, self.peer
        )
    }

    /// Parses a handle and checks its proof against `secret` and its
    /// cluster id against `cluster_id` (this worker's).
    pub fn parse(
        text: &str,
        secret: Option<&JobSecret>,
        cluster_id: u64,
    ) -> Result<WorkerHandle, String> {
        if text.len() > MAX_HANDLE {
            return Err(format!("{} bytes; at most {MAX_HANDLE}", text.len()));
        }
        let rest = text
            .strip_prefix(PREFIX)
            .ok_or_else(|| format!("not a kungfu handle (they start with {PREFIX:?})"))?;
        let mut parts = rest.splitn(4, ':');
        let (Some(id), Some(cid), Some(tag), Some(addr)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err("expected ID:CLUSTER:PROOF:HOST:PORT after the prefix".into());
        };
        let hex64 = |what: &str, v: &str| {
            (v.len() == 16)
                .then(|| u64::from_str_radix(v, 16).ok())
                .flatten()
                .ok_or_else(|| format!("{what} {v:?} is not 16 hex digits"))
        };
        let (id, cid) = (hex64("worker id", id)?, hex64("cluster id", cid)?);
        let list: PeerList = addr.parse().map_err(|e| format!("address {addr:?}: {e}"))?;
        if list.len() != 1 || list.peers()[0].port == 0 {
            return Err(format!("address {addr:?}: one HOST:PORT, port not 0"));
        }
        let peer = list.peers()[0].clone();
        let mac = match tag {
            "-" => None,
            p => Some(
                parse_mac(p).ok_or_else(|| format!("proof {p:?} is not {MAC_LEN} hex bytes"))?,
            ),
        };
        match (secret, mac) {
            (Some(s), Some(m)) => {
                if !auth::eq_constant_time(&proof(s, id, cid, &peer), &m) {
                    return Err("its proof does not match this job's secret: a worker of \
                                another job (another KUNGFU_JOB_SECRET)"
                        .into());
                }
            }
            (Some(_), None) => {
                return Err(
                    "it proves no job secret, and this job has one: a worker of \
                            another job (one without KUNGFU_JOB_SECRET)"
                        .into(),
                )
            }
            (None, Some(_)) => {
                return Err(
                    "it proves a job secret, and this worker has none: a worker of \
                            another job (set the same KUNGFU_JOB_SECRET on every worker)"
                        .into(),
                )
            }
            (None, None) => {}
        }
        if cid != cluster_id {
            return Err(format!(
                "cluster id {cid:016x}, this worker's is {cluster_id:016x}: a worker of another \
                 job"
            ));
        }
        Ok(WorkerHandle {
            id,
            cluster_id: cid,
            peer,
            mac,
        })
    }
}

/// A handle's proof: a MAC of its id, cluster id and address.
fn proof(secret: &JobSecret, id: u64, cluster_id: u64, peer: &Peer) -> [u8; MAC_LEN] {
    let addr = peer.to_string();
    secret.mac(
        LABEL,
        &[
            &id.to_le_bytes(),
            &cluster_id.to_le_bytes(),
            addr.as_bytes(),
        ],
    )
}

fn parse_mac(hex: &str) -> Option<[u8; MAC_LEN]> {
    if hex.len() != 2 * MAC_LEN || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; MAC_LEN];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A fresh worker id.
pub(crate) fn worker_id() -> Result<u64, BootstrapError> {
    let b: [u8; 8] = auth::random().map_err(|e| BootstrapError::Env {
        var: "worker id".into(),
        reason: e.to_string(),
    })?;
    Ok(u64::from_le_bytes(b))
}

/// The cluster id of a worker no launcher gave one: derived from the
/// job's secret (every worker of the job has the same), else 0.
pub(crate) fn cluster_id_of(env: &WorkerEnv) -> u64 {
    env.secret.as_ref().map_or(0, |s| {
        let m = s.mac(b"kungfu cluster id", &[]);
        u64::from_le_bytes(m[..8].try_into().expect("8 bytes"))
    })
}

/// The cluster version of a reconfigure: the same on every member (a hash
/// of the uuid and the members in order), and apart from every other
/// reconfigure's, so the handshake refuses links of other memberships.
fn version_of(uuid: i64, members: &[WorkerHandle]) -> u32 {
    let mut h = fnv1a64(0xcbf2_9ce4_8422_2325, b"kungfu reconfigure");
    h = fnv1a64(h, &uuid.to_le_bytes());
    for m in members {
        h = fnv1a64(h, &m.id.to_le_bytes());
        h = fnv1a64(h, m.peer.to_string().as_bytes());
    }
    // both halves, so every bit of the hash counts
    (h ^ (h >> 32)) as u32
}

/// A reconfigure checked and not yet done ([`Worker::plan_reconfigure`]).
#[derive(Debug)]
pub struct ReconfigurePlan {
    uuid: i64,
    rank: usize,
    cfg: elastic::ClusterConfig,
}

/// What a reconfigure made of this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reconfigured {
    pub rank: usize,
    pub size: usize,
    /// The new cluster version (derived from the uuid and the members).
    pub version: u32,
}

impl Worker {
    /// This worker's handle (see the module docs): the same for the life
    /// of the process.
    pub fn handle(&self) -> WorkerHandle {
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank")
            .clone();
        WorkerHandle::new(self.id, self.cluster_id, me, self.env.secret.as_ref())
    }

    /// Makes the cluster exactly the workers of `handles`, in that order
    /// (this worker's rank is the position of its own handle): a
    /// collective of the listed workers, which pass the same `uuid` and
    /// list. Bounded by `timeout`. The members connect anew at a version
    /// derived from both; the old cluster's connections close (its ops in
    /// flight fail). Then [`Worker::rank`], [`Worker::size`] and
    /// [`Worker::session`] are the new cluster's.
    ///
    /// Refused, with nothing changed: a handle that does not parse or is
    /// of another job, a list without this worker or naming one twice, a
    /// uuid this worker used before. A failure to connect leaves the
    /// worker in no cluster (see the module docs).
    pub async fn reconfigure(
        &mut self,
        uuid: i64,
        handles: &[String],
        timeout: Duration,
    ) -> Result<Reconfigured, ReconfigureError> {
        let plan = self.plan_reconfigure(uuid, handles)?;
        self.reconfigure_to(plan, timeout).await
    }

    /// The checks of [`Worker::reconfigure`], which change nothing: what
    /// it would connect, or why it is refused.
    pub fn plan_reconfigure(
        &self,
        uuid: i64,
        handles: &[String],
    ) -> Result<ReconfigurePlan, ReconfigureError> {
        let members = self.members_of(handles)?;
        let mine = self.handle();
        let rank = members
            .iter()
            .position(|m| m.id == mine.id && m.peer == mine.peer)
            .ok_or_else(|| ReconfigureError::NotListed {
                mine: mine.encode(),
                n: members.len(),
            })?;
        if self.used_uuids.contains(&uuid) {
            return Err(ReconfigureError::UuidUsed { uuid });
        }
        let peers = PeerList::new(members.iter().map(|m| m.peer.clone()).collect())
            .map_err(|e| ReconfigureError::BadList(e.to_string()))?;
        Ok(ReconfigurePlan {
            uuid,
            rank,
            cfg: elastic::ClusterConfig {
                version: version_of(uuid, &members),
                peers,
            },
        })
    }

    /// Connects the cluster `plan` names (the second half of
    /// [`Worker::reconfigure`]).
    pub async fn reconfigure_to(
        &mut self,
        plan: ReconfigurePlan,
        timeout: Duration,
    ) -> Result<Reconfigured, ReconfigureError> {
        let began = SystemTime::now();
        let deadline = Instant::now() + timeout;
        self.drop_pending();
        let ReconfigurePlan { uuid, rank, cfg } = plan;
        // used once tried, whatever comes of it
        self.used_uuids.insert(uuid);
        let (n, version) = (cfg.peers.len(), cfg.version);
        self.switch_to(rank, cfg, deadline)
            .await
            .map_err(|source| ReconfigureError::Connect { uuid, n, source })?;
        self.detached = false;
        self.fresh = false;
        self.joined = (began, SystemTime::now());
        Ok(Reconfigured {
            rank,
            size: n,
            version,
        })
    }

    /// The handles parsed and checked, with no worker named twice.
    fn members_of(&self, handles: &[String]) -> Result<Vec<WorkerHandle>, ReconfigureError> {
        if handles.is_empty() {
            return Err(ReconfigureError::BadList("no handles".into()));
        }
        if handles.len() > PeerList::MAX_SIZE {
            return Err(ReconfigureError::BadList(format!(
                "{} handles; at most {}",
                handles.len(),
                PeerList::MAX_SIZE
            )));
        }
        let mut members: Vec<WorkerHandle> = Vec::with_capacity(handles.len());
        for (index, text) in handles.iter().enumerate() {
            let h = WorkerHandle::parse(text, self.env.secret.as_ref(), self.cluster_id).map_err(
                |reason| ReconfigureError::BadHandle {
                    index,
                    text: text.chars().take(MAX_HANDLE).collect(),
                    reason,
                },
            )?;
            if let Some(first) = members
                .iter()
                .position(|m| m.id == h.id || m.peer == h.peer)
            {
                return Err(ReconfigureError::BadList(format!(
                    "handles {first} and {index} name the same worker ({})",
                    h.peer
                )));
            }
            members.push(h);
        }
        Ok(members)
    }

    /// Fails every op in flight and every later one, until a reconfigure
    /// (see the module docs): this worker leaves its cluster at once,
    /// without waiting for its peers.
    pub fn abort(&self) {
        self.session.shutdown();
    }
}

#[cfg(test)]
mod tests;
