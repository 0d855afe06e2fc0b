//! When an op gives up: its one inactivity deadline, and what a lost peer
//! does to it (fail at once while the op waits for the peer, or shorten
//! the deadline to [`LOST_GRACE`] while only the output depends on it).

use std::time::Duration;

use kungfu_topology::Rank;
use kungfu_transport::{Instant, TransportError};

use super::OpMachine;
use crate::CollectiveError;

/// How long an op goes on without progress once a rank its output depends
/// on (not one it waits for) was lost: long enough for what that rank sent
/// before it went to arrive, or for the abort of a neighbour that gave up.
pub const LOST_GRACE: Duration = Duration::from_secs(1);

impl OpMachine {
    /// `peer` was lost (`e` says how). The op fails at once while it waits
    /// for frames from the peer. When this rank's output depends on the
    /// peer only through others ([`crate::OpKind::depends_on`]), what the
    /// peer owed may already be on its way (the op then completes), or a
    /// neighbour gave up because of the loss, and its abort should follow:
    /// the op goes on, but from now on fails after [`LOST_GRACE`] without
    /// progress, not after the op timeout. Either way the error names the
    /// first rank this op heard was lost: the culprit, not the neighbour.
    /// A send owed to the peer fails on its own.
    pub fn handle_peer_lost(&mut self, now: Instant, peer: Rank, e: TransportError) {
        if !self.is_running() {
            return;
        }
        self.lost.insert(peer);
        let first = self.first_lost.get_or_insert_with(|| e.clone()).clone();
        let waiting = self.plan.waiting_for();
        if waiting.contains(&peer) {
            let e = match first {
                TransportError::PeerLost { peer: p, reason } if p != peer => {
                    TransportError::PeerLost {
                        peer: p,
                        reason: format!(
                            "{reason} (lost first; {peer}, which this op waited for, was lost \
                             after it)"
                        )
                        .into(),
                    }
                }
                _ => e,
            };
            return self.fail(self.transport_error(e));
        }
        self.listen.remove(peer);
        if !waiting.is_empty() && self.op.spec.kind.depends_on(self.me, peer) {
            self.lost_dependency = true;
            self.deadline = self.deadline.min(now + self.grace());
        }
    }

    /// The driver's wait ended at `now` with nothing to report: the op
    /// fails if its deadline has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if !self.is_running() || now < self.deadline {
            return;
        }
        if self.lost_dependency {
            if let Some(TransportError::PeerLost { peer, reason }) = self.first_lost.clone() {
                let e = TransportError::PeerLost {
                    peer,
                    reason: format!(
                        "{reason} (this op depends on it, and made no progress for {:?} after \
                         the loss)",
                        self.grace()
                    )
                    .into(),
                };
                return self.fail(self.transport_error(e));
            }
        }
        // Once the plan is done only sends are left: no rank to wait for.
        let waiting = if self.plan.is_done() {
            Vec::new()
        } else {
            self.plan.waiting_for()
        };
        let e = CollectiveError::Timeout {
            name: self.op.name.clone(),
            epoch: self.op.tag.epoch,
            after: self.cfg.timeout,
            waiting,
        };
        self.fail(e);
    }

    pub(super) fn progress(&mut self, now: Instant) {
        self.deadline = now + self.grace();
    }

    /// How long the op may go without progress: the op timeout, or less
    /// once a rank its output depends on was lost.
    pub(super) fn grace(&self) -> Duration {
        if self.lost_dependency {
            self.cfg.timeout.min(LOST_GRACE)
        } else {
            self.cfg.timeout
        }
    }
}
