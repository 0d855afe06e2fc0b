//! Shrink and continue: after a worker is lost, the survivors agree on who
//! is left and go on as a smaller cluster ([`Worker::recover`]).
//!
//! The protocol is [`machine::Recovery`] (its docs say how it decides and
//! why no two survivors continue with different memberships); this module
//! drives it: the decision is the config server's compare-and-set of the
//! next version, the old connections stay open until the new version is
//! connected (their heartbeats keep telling who is lost), and the new
//! version connects as a resize does.

use std::time::{Duration, SystemTime};

use kungfu_collectives::{CollectiveError, Session as Sess};
use kungfu_topology::{Peer, PeerList, Rank};
use kungfu_transport::any::AnyTransport;
use kungfu_transport::Transport;
use tokio::time::Instant;

use crate::elastic::ClusterConfig;
use crate::store::PutError;
use crate::{BootstrapError, Worker};

pub mod machine;

use machine::{Recovery, Step};

/// How often a survivor looks at the config server and its losses while it
/// waits.
const POLL: Duration = Duration::from_millis(50);
/// How long a survivor that is not the first to propose (as it sees it)
/// waits for a decision before it proposes too (see [`machine`]).
const PATIENCE: Duration = Duration::from_millis(200);

/// What a recovery did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovered {
    /// The workers left out, by their rank in the version recovered from,
    /// with their addresses.
    pub lost: Vec<(Rank, Peer)>,
    /// The cluster version now (the config server's: the successor of the
    /// version recovered from that the survivors agreed on; a resize the
    /// server made after it is followed at the next
    /// [`Worker::resize_from_config`]).
    pub version: u32,
}

impl Worker {
    /// After an op failed because a worker was lost
    /// ([`kungfu_collectives::CollectiveError::PeerLost`]): the survivors
    /// agree on who is left and continue as a cluster of them, at a new
    /// cluster version (see the module docs). A collective among the
    /// survivors: each calls it once it saw a loss. Afterwards
    /// [`Worker::rank`], [`Worker::size`] and [`Worker::version`] describe
    /// the new cluster and [`Worker::session`] is its session; call
    /// [`Worker::sync_state`] next, so that every survivor goes on from the
    /// same state. A worker the others declared lost (it was frozen, or cut
    /// off) gets [`BootstrapError::Excluded`] and should exit: the cluster
    /// went on without it.
    ///
    /// Needs the job's config server (`kungfu-run --on-failure shrink` or
    /// `-w`): its compare-and-set of the next version is what makes one
    /// decision out of several. Bounded by `KUNGFU_CONNECT_TIMEOUT_MS`.
    pub async fn recover(&mut self) -> Result<Recovered, BootstrapError> {
        let began = SystemTime::now();
        // a version connected in the background held the lost worker, or
        // will be decided anew
        self.drop_pending();
        if self.detached {
            return Err(excluded(
                self.env.cluster_version,
                "this worker is detached",
            ));
        }
        let store = self.config_store().map_err(|_| {
            BootstrapError::Elastic(
                "recover needs the job's config server (KUNGFU_CONFIG_SERVER): run under \
                     kungfu-run --on-failure shrink|replace, or -w"
                    .into(),
            )
        })?;
        let deadline = Instant::now() + self.env.connect_timeout;
        let old = self.session.transport();
        let old_peers = self.peers.clone();
        let me = Rank(self.env.rank as u32);
        let all: Vec<Rank> = (0..old_peers.len() as u32).map(Rank).collect();
        let mut m = Recovery::new(
            me,
            u64::from(self.env.cluster_version),
            all,
            old.matcher().lost_in_order(),
        );
        let mut lost_seen = 0;
        let mut last_get = Instant::now() - POLL;
        let mut round = (m.base(), Instant::now());
        // the server's successor of the machine's base, once made
        let mut decided: Option<ClusterConfig> = None;
        // the new version's session, once connected
        let mut joined: Option<Sess<AnyTransport>> = None;
        loop {
            while let Some(step) = m.poll() {
                match step {
                    Step::Propose { base, members } => {
                        let next = ClusterConfig {
                            version: u32::try_from(base + 1).map_err(|_| {
                                BootstrapError::Elastic("the version cannot grow further".into())
                            })?,
                            peers: members_of(&old_peers, &members)?,
                        };
                        let put = store.put(&next.encode(), deadline).await;
                        match put {
                            Ok(c) => {
                                feed(&mut m, &old_peers, &c);
                                decided = Some(c);
                            }
                            // another was first (409): its config is the
                            // decision, read below
                            Err(PutError::Conflict(_)) => last_get = Instant::now() - POLL,
                            Err(PutError::Failed(e)) => return Err(BootstrapError::Elastic(e)),
                        }
                    }
                    Step::Connect { version, .. } => {
                        // the successor of the base, as decided, even if a
                        // resize came after it (that one is followed later,
                        // as a resize)
                        let cfg = config_of(&decided, version)?;
                        match self.connect_new(cfg, &old, &old_peers, deadline).await {
                            Ok(s) => {
                                joined = Some(s);
                                m.handle_connected(version);
                            }
                            Err(Joined::Lost(lost)) => m.handle_connect_failed(version, lost),
                            Err(Joined::Failed(e)) => return Err(e),
                        }
                    }
                    Step::Barrier { version } => {
                        let cfg = config_of(&decided, version)?;
                        let session = joined.as_ref().expect("connected before the barrier");
                        match barrier(session, cfg, &old_peers, deadline).await {
                            Ok(()) => m.handle_barrier_passed(version),
                            Err(Joined::Lost(lost)) => {
                                if let Some(s) = joined.take() {
                                    s.close(Duration::ZERO).await;
                                }
                                m.handle_connect_failed(version, lost);
                            }
                            Err(Joined::Failed(e)) => return Err(e),
                        }
                    }
                    Step::Adopt { version } => {
                        let cfg = config_of(&decided, version)?.clone();
                        let session = joined.take().expect("connected before adopting");
                        // The old connections are done with: every member
                        // is here, and past the barrier none watches them.
                        // No linger: a lost peer's link (a frozen one's)
                        // never closes, and waiting for it held every
                        // recovery from a freeze for the whole linger (500
                        // ms, measured by the chaos test).
                        self.session.close(Duration::ZERO).await;
                        let rank = cfg.peers.rank_of(old_peers.peer(me).expect("own rank"));
                        let env = self.env_for(rank.expect("a member").idx(), &cfg);
                        self.adopt(session, env, cfg.clone()).await;
                        let lost = old_peers
                            .peers()
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| cfg.peers.rank_of(p).is_none())
                            .map(|(r, p)| (Rank(r as u32), p.clone()))
                            .collect();
                        self.joined = (began, SystemTime::now());
                        return Ok(Recovered {
                            lost,
                            version: cfg.version,
                        });
                    }
                    Step::Excluded { version } => {
                        self.detached = true;
                        self.leave_store().await;
                        self.session.close(Duration::ZERO).await;
                        return Err(excluded(
                            version as u32,
                            "the other workers declared this one lost (it was frozen, or cut \
                             off from them)",
                        ));
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(BootstrapError::Elastic(format!(
                    "recovery from version {} did not end within the connect timeout; \
                     known lost: {:?}",
                    m.base(),
                    m.lost(),
                )));
            }
            // Inputs: a loss, the server's config, and time.
            tokio::time::sleep(POLL).await;
            let lost = old.matcher().lost_in_order();
            for &r in &lost[lost_seen.min(lost.len())..] {
                m.handle_lost(r);
            }
            lost_seen = lost.len();
            if round.0 != m.base() {
                round = (m.base(), Instant::now());
            }
            if round.1.elapsed() >= PATIENCE {
                m.handle_patience();
            }
            if last_get.elapsed() >= POLL {
                last_get = Instant::now();
                let next = u32::try_from(m.base() + 1).unwrap_or(u32::MAX);
                let got = store
                    .get_version(next, deadline)
                    .await
                    .map_err(BootstrapError::Elastic)?;
                if let Some(c) = got {
                    feed(&mut m, &old_peers, &c);
                    decided = Some(c);
                }
            }
        }
    }

    /// Connects to `cfg`, giving up as soon as the old connections say one
    /// of its members was lost here (connecting would wait for it until
    /// the deadline). Only a loss seen here counts, not one a peer told
    /// of: a peer whose link to that member broke would otherwise make
    /// every worker that heard it give up a version the others connect.
    async fn connect_new(
        &mut self,
        cfg: &ClusterConfig,
        old: &AnyTransport,
        old_peers: &PeerList,
        deadline: Instant,
    ) -> Result<Sess<AnyTransport>, Joined> {
        let me = old_peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank");
        let rank = cfg
            .peers
            .rank_of(me)
            .ok_or_else(|| Joined::Failed(excluded(cfg.version, "not in the new cluster")))?;
        let members: Vec<Rank> = cfg
            .peers
            .peers()
            .iter()
            .filter_map(|p| old_peers.rank_of(p))
            .collect();
        let env = self.env_for(rank.idx(), cfg);
        let lost_member = async {
            loop {
                let lost: Vec<Rank> = old
                    .matcher()
                    .lost_first_hand()
                    .into_iter()
                    .filter(|r| members.contains(r))
                    .collect();
                if !lost.is_empty() {
                    return lost;
                }
                tokio::time::sleep(POLL).await;
            }
        };
        tokio::select! {
            s = self.connect_version(&env, cfg, deadline) => s.map_err(Joined::Failed),
            lost = lost_member => Err(Joined::Lost(lost)),
        }
    }
}

/// The barrier of a new version among workers of the old one: every
/// member is here as each sees it, so the old connections may close (see
/// [`machine`]).
async fn barrier(
    session: &Sess<AnyTransport>,
    cfg: &ClusterConfig,
    old_peers: &PeerList,
    deadline: Instant,
) -> Result<(), Joined> {
    match tokio::time::timeout_at(deadline, session.barrier("kf/recover/joined")).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(CollectiveError::PeerLost { peer, .. })) => {
            let old_rank = cfg.peers.peer(peer).and_then(|p| old_peers.rank_of(p));
            Err(Joined::Lost(old_rank.into_iter().collect()))
        }
        Ok(Err(e)) => Err(Joined::Failed(BootstrapError::Op(e))),
        Err(_) => Err(Joined::Failed(BootstrapError::Elastic(format!(
            "recover: the members of version {} did not all connect it in time",
            cfg.version
        )))),
    }
}

/// The config of `version` the driver read or made.
fn config_of(
    decided: &Option<ClusterConfig>,
    version: u64,
) -> Result<&ClusterConfig, BootstrapError> {
    decided
        .as_ref()
        .filter(|c| u64::from(c.version) == version)
        .ok_or_else(|| {
            BootstrapError::Elastic(format!(
                "recover: no config of version {version} to connect to"
            ))
        })
}

enum Joined {
    /// Members of the new cluster were lost while connecting to it.
    Lost(Vec<Rank>),
    Failed(BootstrapError),
}

fn excluded(version: u32, why: &str) -> BootstrapError {
    BootstrapError::Excluded {
        version,
        reason: why.into(),
    }
}

/// Tells the machine the server's config, in the old ranks.
fn feed(m: &mut Recovery, old_peers: &PeerList, cfg: &ClusterConfig) {
    // A worker the old version did not have (a replacement) has no old
    // rank: such a config came from a resize, and is followed as one.
    let members = cfg
        .peers
        .peers()
        .iter()
        .map(|p| old_peers.rank_of(p).unwrap_or(machine::NEW))
        .collect();
    m.handle_config(u64::from(cfg.version), members);
}

/// The peers of the old ranks `members`, in their order.
fn members_of(old_peers: &PeerList, members: &[Rank]) -> Result<PeerList, BootstrapError> {
    let peers = members
        .iter()
        .filter_map(|r| old_peers.peer(*r).cloned())
        .collect();
    PeerList::new(peers).map_err(|e| BootstrapError::Elastic(e.to_string()))
}
