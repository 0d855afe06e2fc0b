//! An op's side of liveness: what a lost peer does to it (fail at once
//! while the op waits for the peer, or shorten the deadline to
//! [`LOST_GRACE`](crate::failure::LOST_GRACE) while only the output depends
//! on it) and its one inactivity deadline, both by the rules of
//! [`crate::failure::Liveness`], which the fast path follows too.

use kungfu_topology::Rank;
use kungfu_transport::{Instant, TransportError};

use super::OpMachine;

impl OpMachine {
    /// `peer` was lost (`e` says how). The op fails at once while it waits
    /// for frames from the peer. When this rank's output depends on the
    /// peer only through others ([`crate::OpKind::depends_on`]), what the
    /// peer owed may already be on its way (the op then completes), or a
    /// neighbour gave up because of the loss, and its abort should follow:
    /// the op goes on, but from now on fails after
    /// [`LOST_GRACE`](crate::failure::LOST_GRACE) without progress, not
    /// after the op timeout. Either way the error names the first rank
    /// this op heard was lost: the culprit, not the neighbour. A send owed
    /// to the peer fails on its own.
    pub fn handle_peer_lost(&mut self, now: Instant, peer: Rank, e: TransportError) {
        if !self.is_running() {
            return;
        }
        self.lost.insert(peer);
        let waiting = self.plan.waiting_for();
        let waits = waiting.contains(&peer);
        if !waits {
            self.listen.remove(peer);
        }
        let depends = !waiting.is_empty() && self.depends_on(peer);
        if let Some(e) = self.live.peer_lost(now, peer, e, waits, depends) {
            self.fail(self.transport_error(e));
        }
    }

    /// The driver's wait ended at `now` with nothing to report: the op
    /// fails if its deadline has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if !self.is_running() || !self.live.expired(now) {
            return;
        }
        // Once the plan is done only sends are left: no rank to wait for.
        let waiting = if self.plan.is_done() {
            Vec::new()
        } else {
            self.plan.waiting_for()
        };
        let e = self.live.timeout_error(self.id(), waiting);
        self.fail(e);
    }

    pub(super) fn progress(&mut self, now: Instant) {
        self.live.progress(now);
    }
}
