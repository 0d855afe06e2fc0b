//! Shrink and continue: after a worker is lost, the survivors agree on who
//! is left and go on as a smaller cluster ([`Worker::recover`]).
//!
//! The protocol is [`machine::Recovery`] (its docs say how it decides and
//! why no two survivors continue with different memberships); this module
//! drives it: views travel over the connections of the version being
//! recovered from (they stay open meanwhile, and their heartbeats keep
//! telling who is lost), the decision is the config server's
//! compare-and-set of the next version, and the new version connects as a
//! resize does.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use bytes::{Buf, BufMut, Bytes};
use kungfu_collectives::names::op_id;
use kungfu_collectives::CollectiveError;
use kungfu_topology::{Peer, PeerList, Rank};
use kungfu_transport::any::AnyTransport;
use kungfu_transport::{FrameKind, Header, OpTag, PeerSet, Transport};
use tokio::time::Instant;

use crate::elastic::ClusterConfig;
use crate::store::PutError;
use crate::{BootstrapError, Worker};

pub mod machine;

use machine::{Recovery, Step};

/// How often a survivor looks at the config server and its losses while it
/// waits.
const POLL: Duration = Duration::from_millis(50);

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
        // the server's successor of the machine's base, once made
        let mut decided: Option<ClusterConfig> = None;
        loop {
            while let Some(step) = m.poll() {
                match step {
                    Step::SendView { to, base, lost } => {
                        // A failure means `to` is lost: the matcher says
                        // so, and the next coordinator gets the view.
                        let _ = old
                            .send(to, view_header(&old, base), encode_view(base, &lost))
                            .await;
                    }
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
                            // another coordinator was first (409): its
                            // config is the decision, read below
                            Err(PutError::Conflict(_)) => last_get = Instant::now() - POLL,
                            Err(PutError::Failed(e)) => return Err(BootstrapError::Elastic(e)),
                        }
                    }
                    Step::Connect { version, .. } => {
                        // the successor of the base, as decided, even if a
                        // resize came after it (that one is followed later,
                        // as a resize)
                        let cfg = decided
                            .clone()
                            .filter(|c| u64::from(c.version) == version)
                            .ok_or_else(|| {
                                BootstrapError::Elastic(format!(
                                    "recover: no config of version {version} to connect to"
                                ))
                            })?;
                        match self.join(&cfg, &old, &old_peers, deadline).await {
                            Ok(()) => {
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
                            Err(Joined::Lost(lost)) => m.handle_connect_failed(version, lost),
                            Err(Joined::Failed(e)) => return Err(e),
                        }
                    }
                    Step::Excluded { version } => {
                        self.detached = true;
                        self.leave_store().await;
                        self.session.close(Duration::from_millis(500)).await;
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
                     known lost: {:?}, waiting for the views of {:?}",
                    m.base(),
                    m.lost(),
                    m.waiting_for()
                )));
            }
            // Inputs: a view (as the coordinator), a loss, the server's
            // config.
            let waiting = m.waiting_for();
            if waiting.is_empty() {
                tokio::time::sleep(POLL).await;
            } else {
                let mut from = PeerSet::new();
                waiting.iter().for_each(|&r| from.insert(r));
                let tag = view_tag(&old, m.base());
                if let Ok(f) = old.recv(tag, &from, Instant::now() + POLL).await {
                    match decode_view(f.payload) {
                        Some((base, lost)) => m.handle_view(f.from, base, &lost),
                        None => eprintln!("kungfu: recover: a malformed view from {}", f.from),
                    }
                }
            }
            let lost = old.matcher().lost_in_order();
            for &r in &lost[lost_seen.min(lost.len())..] {
                m.handle_lost(r);
            }
            lost_seen = lost.len();
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
    /// of its members was lost (connecting would wait for it until the
    /// deadline).
    async fn join(
        &mut self,
        cfg: &ClusterConfig,
        old: &AnyTransport,
        old_peers: &PeerList,
        deadline: Instant,
    ) -> Result<(), Joined> {
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
                    .lost_in_order()
                    .into_iter()
                    .filter(|r| members.contains(r))
                    .collect();
                if !lost.is_empty() {
                    return lost;
                }
                tokio::time::sleep(POLL).await;
            }
        };
        let session = tokio::select! {
            s = self.connect_version(&env, cfg, deadline) => s.map_err(Joined::Failed)?,
            lost = lost_member => return Err(Joined::Lost(lost)),
        };
        // Every member is here as this worker sees it. The old connections
        // stay open until every member sees so too: closed at once, they
        // made this worker look lost to a member still connecting, which
        // then gave up the version that the others had joined (the
        // launcher's chaos test caught it). Not when the config came from
        // a resize and has new workers: they start as in a scale-out, and
        // would never meet the barrier.
        let recovering = cfg
            .peers
            .peers()
            .iter()
            .all(|p| old_peers.rank_of(p).is_some());
        let joined = match recovering {
            true => tokio::time::timeout_at(deadline, session.barrier("kf/recover/joined")).await,
            false => Ok(Ok(())),
        };
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(CollectiveError::PeerLost { peer, .. })) => {
                let old_rank = cfg.peers.peer(peer).and_then(|p| old_peers.rank_of(p));
                session.close(Duration::ZERO).await;
                return Err(Joined::Lost(old_rank.into_iter().collect()));
            }
            Ok(Err(e)) => return Err(Joined::Failed(BootstrapError::Op(e))),
            Err(_) => {
                return Err(Joined::Failed(BootstrapError::Elastic(format!(
                    "recover: the members of version {} did not all connect it in time",
                    cfg.version
                ))))
            }
        }
        // The old connections are done with: every member is here, and
        // past the barrier none watches them. No linger: a lost peer's link
        // (a frozen one's) never closes, and waiting for it held every
        // recovery from a freeze for the whole linger (500 ms, measured by
        // the chaos test).
        self.session.close(Duration::ZERO).await;
        self.adopt(session, env, cfg.clone()).await;
        Ok(())
    }
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
        .map(|p| old_peers.rank_of(p).unwrap_or(Rank(u32::MAX)))
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

/// The tag of the views of the round deciding `base`.
fn view_tag(t: &AnyTransport, base: u64) -> OpTag {
    OpTag {
        epoch: t.epoch(),
        op: op_id("kf/recover/view"),
        seq: base as u32,
    }
}

fn view_header(t: &AnyTransport, base: u64) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: view_tag(t, base),
        chunk: 0,
        step: 0,
        digest: 0,
        len: 0,
    }
}

/// A view: the base version, then the ranks known lost (u32 each).
fn encode_view(base: u64, lost: &[Rank]) -> Bytes {
    let mut b = Vec::with_capacity(8 + 4 * lost.len());
    b.put_u64_le(base);
    for r in lost {
        b.put_u32_le(r.0);
    }
    b.into()
}

/// A view from the network: `None` if malformed.
fn decode_view(mut b: Bytes) -> Option<(u64, Vec<Rank>)> {
    if b.len() < 8 || !(b.len() - 8).is_multiple_of(4) || b.len() > 8 + 4 * (1 << 16) {
        return None;
    }
    let base = b.get_u64_le();
    let mut lost = BTreeSet::new();
    while b.has_remaining() {
        lost.insert(Rank(b.get_u32_le()));
    }
    Some((base, lost.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_round_trip_and_bad_ones_are_refused() {
        let v = encode_view(7, &[Rank(3), Rank(1)]);
        assert_eq!(decode_view(v), Some((7, vec![Rank(1), Rank(3)])));
        assert_eq!(decode_view(Bytes::from_static(&[1, 2, 3])), None);
        assert_eq!(decode_view(Bytes::from(vec![0u8; 8 + 3])), None);
        assert_eq!(decode_view(Bytes::from(vec![0u8; 8])), Some((0, vec![])));
    }
}
