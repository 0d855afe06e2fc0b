//! Subgroups: a [`Session`] over some of its ranks, with every collective
//! of a session ([`Session::subgroup`]).
//!
//! A subgroup is a scope inside its session, not a transport of its own:
//! its ops travel over the session's transport, under tags no other group
//! (and not the session itself) can make. An op's id is the FNV-1a 64 hash
//! of its name started from the group's own basis, the hash of
//! `kf/group\0`, the group's id and a NUL; names of callers cannot hold
//! NUL, so no name of the session hashes from there. Per-name sequence
//! numbers then count within the group, so the k-th op of a name in a
//! group meets the k-th of its other members, whatever the members do in
//! other groups meanwhile, in any order.
//!
//! A group's plans are built over its members' places (ranks `0..n` of
//! the group, the places its roots and blocks name) and relabelled to the
//! session's ranks ([`crate::plan::Plan::relabelled`]); its ops listen to,
//! and abort, its members alone. They do not take the host fast path,
//! whose lanes pair the session's ranks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kungfu_topology::{fnv1a64, PeerList, Rank, Root, Strategy, Topology};
use kungfu_transport::{OpId, Transport};

use super::plans::PlanCache;
use super::{lock, Session};
use crate::CollectiveError;

/// The FNV-1a 64 offset basis.
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// The ranks a subgroup runs on, and what its ops are built from.
pub(super) struct Scope {
    /// The group's id (the same on every member).
    pub(super) id: u64,
    /// The FNV-1a state its op names hash from.
    basis: u64,
    /// The session rank of each group rank.
    pub(super) members: Arc<[Rank]>,
    /// This rank's place in the group.
    pub(super) pos: Rank,
    /// The members' addresses, in group order (the strategies' input).
    pub(super) peers: PeerList,
    pub(super) topologies: Mutex<HashMap<(Strategy, Root), Arc<Topology>>>,
    pub(super) plans: Mutex<PlanCache>,
}

impl Scope {
    /// The id of op `name` in this group.
    pub(super) fn op_id(&self, name: &str) -> OpId {
        OpId(fnv1a64(self.basis, name.as_bytes()))
    }
}

/// The id of the `nth` group (counted from 0) made here over the set of
/// session ranks `sorted`: the same on every member, which make their
/// groups over one set in the same order.
fn group_id(sorted: &[Rank], nth: u64) -> u64 {
    let mut h = fnv1a64(FNV_BASIS, b"kf/group");
    for r in sorted {
        h = fnv1a64(h, &r.0.to_le_bytes());
    }
    fnv1a64(h, &nth.to_le_bytes())
}

impl<T: Transport> Session<T> {
    /// A session over `ranks` (ranks of this session, this rank among
    /// them): rank `i` of the subgroup is `ranks[i]`. It has every
    /// collective of a session, with its own names: its ops meet only its
    /// members' ops of the same group, and never wait on ops of this
    /// session or of other groups, so a rank in many groups may issue
    /// their ops in any order.
    ///
    /// A collective of the members only: each calls it with the same list
    /// (the same order too: they check it, and fail with
    /// [`CollectiveError::Mismatch`] if not), and members that make several
    /// groups over one set of ranks make them in the same order. A rank
    /// that is not in `ranks`, an empty list, a rank out of range or named
    /// twice fail at once with [`CollectiveError::InvalidArgument`]. A
    /// member that never calls makes the others fail at the op timeout.
    ///
    /// Cheap to clone; dropping every clone ends the group here (ops in
    /// flight finish). A group lives on its session: a swap, which the
    /// group's session refuses, is the session's; a resize makes a new
    /// session, over which groups must be made again.
    pub async fn subgroup(&self, ranks: &[Rank]) -> Result<Session<T>, CollectiveError> {
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: "<subgroup>".into(),
            reason,
        };
        let (n, me) = (self.size(), self.rank());
        if ranks.is_empty() {
            return Err(invalid("a group needs at least one rank".into()));
        }
        let mut seen = vec![false; n];
        for r in ranks {
            match seen.get_mut(r.idx()) {
                None => {
                    return Err(invalid(format!(
                        "rank {} is not a rank of this session of {n}",
                        r.0
                    )))
                }
                Some(true) => return Err(invalid(format!("rank {} is named twice", r.0))),
                Some(s) => *s = true,
            }
        }
        if !ranks.contains(&me) {
            return Err(invalid(format!(
                "rank {} is not among the group's ranks {:?}",
                me.0,
                ranks.iter().map(|r| r.0).collect::<Vec<_>>()
            )));
        }
        // in the session's ranks
        let members: Arc<[Rank]> = ranks.iter().map(|&r| self.session_rank(r)).collect();
        let mut sorted = members.to_vec();
        sorted.sort();
        let nth = {
            let mut made = lock(&self.inner.groups_made);
            let c = made.entry(sorted.clone()).or_insert(0);
            *c += 1;
            *c - 1
        };
        let id = group_id(&sorted, nth);
        let scoped = |members: Arc<[Rank]>| -> Result<Session<T>, CollectiveError> {
            let mut basis = fnv1a64(FNV_BASIS, b"kf/group\0");
            basis = fnv1a64(basis, &id.to_le_bytes());
            basis = fnv1a64(basis, b"\0");
            let peers = members
                .iter()
                .map(|&r| self.inner.peers.peer(r).expect("checked").clone())
                .collect();
            let my = self.inner.transport().rank();
            Ok(Session {
                inner: self.inner.clone(),
                scope: Some(Arc::new(Scope {
                    id,
                    basis,
                    pos: Rank(members.iter().position(|&r| r == my).expect("a member") as u32),
                    members,
                    peers: PeerList::new(peers).map_err(|e| invalid(e.to_string()))?,
                    topologies: Mutex::default(),
                    plans: Mutex::default(),
                })),
            })
        };
        let group = scoped(members.clone())?;
        // The members check that they named them in one order, in the
        // group's ranks in ascending order (the same on every member that
        // names the same set; one that names another set makes another
        // group id, so its ops never meet these: they time out).
        let check = scoped(sorted.clone().into())?;
        let order: Vec<u8> = members.iter().flat_map(|r| r.0.to_le_bytes()).collect();
        let (tx, rx) = tokio::sync::oneshot::channel();
        check.consensus_with("kf/group\0members", &order, false, tx);
        let same = rx
            .await
            .map_err(|_| invalid("the session stopped".into()))??;
        if !same {
            return Err(CollectiveError::Mismatch {
                name: "kf/group\0members".into(),
                epoch: self.epoch(),
                ranks: Vec::new(),
                detail: format!(
                    "the members of a group over ranks {:?} named them in different orders",
                    sorted.iter().map(|r| r.0).collect::<Vec<_>>()
                ),
            });
        }
        Ok(group)
    }

    /// The session rank of this session's (or group's) rank `r`.
    pub fn session_rank(&self, r: Rank) -> Rank {
        match &self.scope {
            Some(s) => s.members.get(r.idx()).copied().unwrap_or(r),
            None => r,
        }
    }

    /// For a subgroup, the session rank of each of its ranks; `None` for
    /// the session itself.
    pub fn members(&self) -> Option<&[Rank]> {
        self.scope.as_ref().map(|s| &s.members[..])
    }

    /// For a subgroup, its id (the same on every member); `None` for the
    /// session itself.
    pub fn group_id(&self) -> Option<u64> {
        self.scope.as_ref().map(|s| s.id)
    }

    /// The session this group is a part of (itself, for a session).
    pub fn whole(&self) -> Session<T> {
        Session {
            inner: self.inner.clone(),
            scope: None,
        }
    }
}
