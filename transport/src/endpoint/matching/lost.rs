//! Lost peers as the matcher reports them: the checks before a send or a
//! receive, the losses that concern an op (not yet a peer whose frames of
//! it are still queued), and their reasons, which name where the peer
//! runs.

use std::sync::Arc;

use kungfu_topology::Rank;

use super::{Inner, Matcher};
use crate::{OpTag, PeerSet, TransportError};

impl Matcher {
    /// Says where each rank runs (`host:port`, by rank): the reason of a
    /// loss names it, so that an error tells which machine to look at.
    pub fn name_peers(&self, names: impl IntoIterator<Item = String>) {
        self.lock().names = names.into_iter().map(Arc::from).collect();
    }

    /// `reason`, a loss of `peer`, with where `peer` runs when that is
    /// known and not said yet.
    pub fn locate(&self, peer: Rank, reason: Arc<str>) -> Arc<str> {
        locate(&self.lock(), peer, reason)
    }

    /// The ranks lost so far, the first lost first.
    pub fn lost_in_order(&self) -> Vec<Rank> {
        self.lock().lost_order.clone()
    }

    /// The ranks this endpoint lost by itself (its connection to them
    /// ended or broke, or they went silent), not by hearsay
    /// ([`Matcher::hearsay`]), the first lost first. A peer's notice tells
    /// what that peer saw, which may be a link of its own that broke: the
    /// recovery connects a new version without a member only for what it
    /// saw here (`runtime/src/recover/`).
    pub fn lost_first_hand(&self) -> Vec<Rank> {
        let inner = self.lock();
        inner
            .lost_order
            .iter()
            .copied()
            .filter(|r| !inner.accusers.contains_key(r))
            .collect()
    }

    /// The checks every backend makes before it sends `len` bytes to
    /// `to`: a rank it has a route to, a frame within `max_frame`, an
    /// endpoint not closed, a peer not lost.
    pub(crate) fn check_send(
        &self,
        to: Rank,
        size: usize,
        has_route: bool,
        len: usize,
        max_frame: usize,
    ) -> Result<(), TransportError> {
        if !has_route {
            return Err(TransportError::NoSuchPeer { peer: to, size });
        }
        if len > max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                max: max_frame,
            });
        }
        let inner = self.lock();
        // A closed endpoint sends nothing, whatever its readers made of
        // the peers as they stopped.
        if inner.closed {
            return Err(TransportError::Closed);
        }
        match inner.lost.get(&to) {
            Some(reason) => Err(TransportError::PeerLost {
                peer: to,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks `peer` lost because writing to it failed, and returns the
    /// error its pending and later sends report.
    pub(crate) fn lose_writer(&self, peer: Rank, why: impl std::fmt::Display) -> TransportError {
        let reason: Arc<str> = format!("write: {why}").into();
        self.fail_peer(peer, reason.clone());
        TransportError::PeerLost { peer, reason }
    }

    /// See [`crate::Transport::check_peers`].
    pub fn check_peers(&self, peers: &PeerSet) -> Result<(), TransportError> {
        let inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        match lost_in(&inner, peers) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// See [`crate::Transport::check_peers_for`].
    pub fn check_peers_for(&self, tag: OpTag, peers: &PeerSet) -> Result<(), TransportError> {
        match self.lost_for(tag, peers)?.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// See [`crate::Transport::lost_for`].
    pub fn lost_for(
        &self,
        tag: OpTag,
        peers: &PeerSet,
    ) -> Result<Vec<TransportError>, TransportError> {
        let inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        let mut silent = peers.clone();
        if let Some(slot) = inner.slots.get(&tag) {
            for f in &slot.frames {
                silent.remove(f.from);
            }
            for (from, _) in &slot.landed {
                silent.remove(*from);
            }
        }
        Ok(inner
            .lost_order
            .iter()
            .filter(|r| silent.contains(**r))
            .filter_map(|r| {
                inner.lost.get(r).map(|why| TransportError::PeerLost {
                    peer: *r,
                    reason: why.clone(),
                })
            })
            .collect())
    }

    /// The reason `peer` was lost, if it was.
    pub fn lost_reason(&self, peer: Rank) -> Option<Arc<str>> {
        self.lock().lost.get(&peer).cloned()
    }
}

const WORKER_AT: &str = "the worker at ";

pub(super) fn locate(inner: &Inner, peer: Rank, reason: Arc<str>) -> Arc<str> {
    match inner.names.get(peer.idx()) {
        Some(at) if !reason.contains(WORKER_AT) => format!("{reason} ({WORKER_AT}{at})").into(),
        _ => reason,
    }
}

pub(super) fn lost_in(inner: &Inner, from: &PeerSet) -> Option<TransportError> {
    // Report the first of them lost: the culprit, not a neighbour whose
    // connection failed later because of it (and reproducible).
    inner
        .lost_order
        .iter()
        .find(|r| from.contains(**r))
        .and_then(|r| inner.lost.get(r).map(|why| (*r, why)))
        .map(|(r, why)| TransportError::PeerLost {
            peer: r,
            reason: why.clone(),
        })
}
