//! What the driver reports about frames: data and abort frames that
//! arrived (owned, offered in place, or landed in a posted receive), and
//! the copies and completions of this op's sends. Each goes to the plan,
//! after the digest check, and moves the deadline.

use bytes::Bytes;
use kungfu_topology::Rank;
use kungfu_transport::{FrameKind, Header, Instant, TransportError};

use super::OpMachine;
use crate::plan::{ActionId, PlanError, Work};

impl OpMachine {
    /// The bytes of a handed-out data frame were copied: the plan may
    /// overwrite its range. The send itself is still in flight (it counts
    /// against the window until [`OpMachine::handle_sent`]).
    pub fn handle_copied<W: Work + ?Sized>(&mut self, id: ActionId, work: &mut W) {
        if let Some(o) = self.outstanding.iter_mut().find(|o| o.id == id) {
            if !o.released {
                o.released = true;
                let r = self.plan.handle_sent(id, work);
                self.planned(self.me, r);
            }
        }
    }

    /// A handed-out data frame was sent (handed whole to the transport),
    /// or its send failed.
    pub fn handle_sent<W: Work + ?Sized>(
        &mut self,
        now: Instant,
        id: ActionId,
        result: Result<(), TransportError>,
        work: &mut W,
    ) {
        if !self.is_running() {
            return;
        }
        let Some(i) = self.outstanding.iter().position(|o| o.id == id) else {
            return;
        };
        let o = self.outstanding.swap_remove(i);
        self.inflight -= o.len;
        match result {
            // The op cannot complete without this frame, but the peer may
            // be gone because of another rank's loss, whose abort is then
            // on its way (or already queued behind the send's failure):
            // fail after the grace, naming the first rank lost, unless
            // that abort comes first with the cause.
            Err(e @ TransportError::PeerLost { .. }) => {
                if let TransportError::PeerLost { peer, .. } = &e {
                    let peer = *peer;
                    self.lost.insert(peer);
                    self.live.peer_lost(now, peer, e, false, true);
                }
                return;
            }
            Err(e) => {
                self.fail(self.transport_error(e));
                return;
            }
            Ok(()) => {}
        }
        if !o.released {
            let r = self.plan.handle_sent(id, work);
            self.planned(self.me, r);
        }
        self.progress(now);
    }

    /// A frame of this op arrived, owned.
    pub fn handle_frame<W: Work + ?Sized>(
        &mut self,
        now: Instant,
        from: Rank,
        header: &Header,
        payload: Bytes,
        work: &mut W,
    ) {
        if !self.is_running() {
            return;
        }
        self.progress(now);
        match header.kind {
            FrameKind::Abort => {
                let e = self.decode_abort(from, &payload);
                self.fail(e);
            }
            FrameKind::Data if header.digest != self.op.digest => {
                let e = self.mismatch(from, header.digest);
                self.fail(e);
            }
            FrameKind::Data => {
                self.arrived(now, from, payload.len());
                let r = self
                    .plan
                    .handle_frame(from, header.chunk, header.step, payload, work);
                self.planned(from, r);
            }
            // the transport's own, never matched to an op
            FrameKind::Heartbeat | FrameKind::Lost => {}
        }
    }

    /// The frame of a receive posted for [`OpMachine::poll_recv`] landed
    /// in the working buffer (`header` is the frame's).
    pub fn handle_landed<W: Work + ?Sized>(
        &mut self,
        now: Instant,
        from: Rank,
        header: &Header,
        work: &mut W,
    ) {
        if !self.is_running() {
            return;
        }
        self.progress(now);
        if header.digest != self.op.digest {
            let e = self.mismatch(from, header.digest);
            return self.fail(e);
        }
        let len = usize::try_from(header.len).unwrap_or(usize::MAX);
        self.arrived(now, from, len);
        let r = self
            .plan
            .handle_landed(from, header.chunk, header.step, len, work);
        self.planned(from, r);
    }

    /// The driver could not lend or take a range of the working memory (a
    /// plan that uses one range twice at once): the op fails.
    pub fn handle_internal(&mut self, e: PlanError) {
        self.planned(self.me, Err(e));
    }

    /// Fails the op if the plan refused what `from` sent (or, from this
    /// rank, an internal error).
    pub(super) fn planned(&mut self, from: Rank, r: Result<(), PlanError>) {
        if let Err(e) = r {
            if self.is_running() {
                let e = self.protocol(from, e.to_string());
                self.fail(e);
            }
        }
    }

    /// A frame of this op offered in place (in one or more pieces, e.g. a
    /// shared-memory ring that wraps): true when it was applied, so the
    /// caller may drop it; false when the caller must pass it, owned, to
    /// [`OpMachine::handle_frame`] (an abort, another digest, a frame
    /// ahead of its dependencies, a piece that splits an element, a frame
    /// the plan does not expect).
    pub fn try_apply<W: Work + ?Sized>(
        &mut self,
        now: Instant,
        from: Rank,
        header: &Header,
        parts: &[&[u8]],
        work: &mut W,
    ) -> bool {
        if !self.is_running() || header.kind != FrameKind::Data || header.digest != self.op.digest {
            return false;
        }
        let taken = matches!(
            self.plan
                .try_apply(from, header.chunk, header.step, parts, work),
            Ok(true)
        );
        if taken {
            self.progress(now);
            self.arrived(now, from, parts.iter().map(|p| p.len()).sum());
        }
        taken
    }

    fn arrived(&mut self, now: Instant, from: Rank, len: usize) {
        let since = now.saturating_duration_since(self.started);
        if let Some(a) = self.arrivals.get_mut(from.idx()) {
            a.frames += 1;
            a.bytes += len as u64;
            a.last = since;
        }
    }
}
