//! How an op names what went wrong: transport errors, a peer's abort, a
//! frame for another spec, a protocol violation; and which of its own
//! errors it tells the other ranks about.

use kungfu_topology::Rank;
use kungfu_transport::TransportError;

use super::OpMachine;
use crate::abort::{Abort, AbortReason};
use crate::CollectiveError;

/// The abort an op error sends to the others, as (reason, offender); None
/// for errors that concern no other rank (invalid arguments, shutdown, a
/// failing local transport).
pub(crate) fn abort_reason(e: &CollectiveError, me: Rank) -> Option<(AbortReason, Rank)> {
    Some(match e {
        CollectiveError::Mismatch { ranks, .. } => {
            (AbortReason::Mismatch, ranks.get(1).copied().unwrap_or(me))
        }
        CollectiveError::Protocol { peer, .. } => (AbortReason::Protocol, *peer),
        CollectiveError::PeerLost { peer, .. } => (AbortReason::PeerLost, *peer),
        CollectiveError::Timeout { waiting, .. } => {
            (AbortReason::Timeout, waiting.first().copied().unwrap_or(me))
        }
        _ => return None,
    })
}

impl OpMachine {
    pub(super) fn transport_error(&self, e: TransportError) -> CollectiveError {
        let (name, epoch) = (self.op.name.clone(), self.op.tag.epoch);
        match e {
            TransportError::PeerLost { peer, .. } => CollectiveError::PeerLost {
                name,
                epoch,
                peer,
                source: e,
            },
            TransportError::Closed => CollectiveError::Closed,
            e => CollectiveError::Transport {
                name,
                epoch,
                source: e,
            },
        }
    }

    /// The error an abort frame from `from` stands for; a malformed one is
    /// a protocol violation.
    pub(super) fn decode_abort(&mut self, from: Rank, payload: &[u8]) -> CollectiveError {
        match Abort::decode(payload) {
            Ok(a) => {
                self.remote_abort = true;
                a.to_error(&self.op.name, self.op.tag.epoch, self.me, &self.op.spec)
            }
            Err(why) => self.protocol(from, format!("malformed abort frame: {why}")),
        }
    }

    pub(super) fn mismatch(&self, from: Rank, digest: u32) -> CollectiveError {
        CollectiveError::Mismatch {
            name: self.op.name.clone(),
            epoch: self.op.tag.epoch,
            ranks: vec![self.me, from],
            detail: format!(
                "rank {} sent a frame for a different op spec (digest {digest:08x}); rank {} has {} (digest {:08x})",
                from.0,
                self.me.0,
                self.op.spec.describe(),
                self.op.digest
            ),
        }
    }

    pub(super) fn protocol(&self, from: Rank, reason: String) -> CollectiveError {
        CollectiveError::Protocol {
            name: self.op.name.clone(),
            epoch: self.op.tag.epoch,
            peer: from,
            reason,
        }
    }
}
