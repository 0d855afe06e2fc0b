//! How an op names what went wrong: transport errors, a peer's abort, a
//! frame for another spec, a protocol violation; which of its own errors
//! it tells the other ranks about; and how it fails (queuing those
//! aborts).

use kungfu_topology::Rank;
use kungfu_transport::{FrameKind, TransportError};

use super::{OpEvent, OpMachine, State, Transmit};
use crate::abort::{Abort, AbortReason};
use crate::failure::{self, OpId};
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
    /// Which op its errors are of.
    pub(super) fn id(&self) -> OpId<'_> {
        OpId {
            name: &self.op.name,
            epoch: self.op.tag.epoch,
        }
    }

    pub(super) fn transport_error(&self, e: TransportError) -> CollectiveError {
        failure::transport_error(self.id(), e)
    }

    /// The error an abort frame from `from` stands for; a malformed one is
    /// a protocol violation.
    pub(super) fn decode_abort(&mut self, from: Rank, payload: &[u8]) -> CollectiveError {
        match failure::abort_error(self.id(), self.me, &self.op.spec, from, payload) {
            Ok(e) => {
                self.remote_abort = true;
                e
            }
            Err(e) => e,
        }
    }

    pub(super) fn mismatch(&self, from: Rank, digest: u32) -> CollectiveError {
        let detail = format!(
            "rank {} sent a frame for a different op spec (digest {digest:08x}); rank {} has {} (digest {:08x})",
            from.0,
            self.me.0,
            self.op.spec.describe(),
            self.op.digest
        );
        failure::mismatch(self.id(), self.me, from, detail)
    }

    pub(super) fn protocol(&self, from: Rank, reason: String) -> CollectiveError {
        failure::protocol(self.id(), from, reason)
    }

    /// The transport failed for this op (a lost peer at the start, a
    /// closed endpoint, a protocol error below the op).
    pub fn handle_error(&mut self, e: TransportError) {
        if self.is_running() {
            self.fail(self.transport_error(e));
        }
    }

    /// Ends the op with `e`, and queues an abort to every rank not known
    /// lost, unless the error came from a peer's abort or concerns no one
    /// else.
    pub(super) fn fail(&mut self, e: CollectiveError) {
        if let Some(abort) = self.abort_for(&e) {
            let payload = abort.encode();
            let header = self.header(FrameKind::Abort, 0, 0);
            for to in self.others() {
                if !self.lost.contains(to) {
                    self.aborts.push_back(Transmit::Abort {
                        to,
                        header,
                        payload: payload.clone(),
                    });
                }
            }
        }
        self.state = State::Ended(OpEvent::Failed(e));
    }

    fn abort_for(&self, e: &CollectiveError) -> Option<Abort> {
        if self.remote_abort {
            return None;
        }
        abort_reason(e, self.me)
            .map(|(reason, offender)| Abort::new(reason, self.me, offender, &self.op.spec))
    }
}
