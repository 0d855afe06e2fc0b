//! One op in flight as a sans-IO state machine, in the style of
//! quinn-proto: it does no I/O and reads no clock.
//!
//! The driver (the async session, or the seeded simulation) feeds it what
//! happened ([`OpMachine::handle_frame`], [`OpMachine::try_apply`],
//! [`OpMachine::handle_sent`], [`OpMachine::handle_peer_lost`],
//! [`OpMachine::handle_timeout`], [`OpMachine::handle_error`]), each with
//! the current time, and asks it what to do ([`OpMachine::poll_transmit`],
//! [`OpMachine::poll_timeout`], [`OpMachine::poll_event`]). Everything an op
//! decides lives here, so a test or the simulation can drive it on virtual
//! time:
//!
//! - the send window (bytes of frames handed out and not yet sent);
//! - the digest check: a data frame for another op spec is a mismatch;
//! - abort frames: decoded into the peer's error, and never echoed back;
//! - the aborts this rank sends when it fails, to every rank not known lost;
//! - the one inactivity deadline: it moves only when a frame arrives or a
//!   send completes;
//! - the rule for a lost peer: it fails the op only while the op still
//!   waits for frames from it.
//!
//! The working buffer stays the driver's: handlers that may touch it take
//! it as an argument, so the machine can later run on memory it does not
//! own (a caller's buffer, registered memory).

pub(crate) mod errors;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::{FrameKind, Header, Instant, OpTag, PeerSet, TransportError};

use crate::abort::Abort;
use crate::dtype::scale_down;
use crate::plan::{ActionId, Plan, PlanError, RecvReady, Work};
use crate::{CollectiveError, OpSpec, ReduceOp};

/// Data frames received from one peer for one op.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Arrivals {
    pub frames: u64,
    pub bytes: u64,
    /// When the last one arrived, counted from the op's start.
    pub last: Duration,
}

/// Who an op is: what every rank must agree on, and where it runs.
#[derive(Clone, Debug)]
pub struct OpInstance {
    pub name: Arc<str>,
    pub spec: OpSpec,
    pub tag: OpTag,
    /// The short digest of (spec, topology) carried in every data frame.
    pub digest: u32,
    /// The strategy the op runs on (`AUTO` resolved).
    pub strategy: Strategy,
}

/// The limits an op runs under.
#[derive(Clone, Copy, Debug)]
pub struct MachineConfig {
    /// The op fails when nothing arrives and no send completes for this long.
    pub timeout: Duration,
    /// Bytes of frames handed out and not yet sent, at most (one frame is
    /// always allowed, however large).
    pub max_inflight_bytes: usize,
}

/// How long an op goes on without progress once a rank its output depends
/// on (not one it waits for) was lost: long enough for what that rank sent
/// before it went to arrive, or for the abort of a neighbour that gave up.
pub const LOST_GRACE: Duration = Duration::from_secs(1);

/// What the driver must send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transmit {
    /// `range` of the working buffer, as one frame. The range stays the
    /// op's to read until the driver reports it with
    /// [`OpMachine::handle_copied`] or [`OpMachine::handle_sent`].
    Data {
        id: ActionId,
        to: Rank,
        header: Header,
        range: std::ops::Range<usize>,
    },
    /// Tells `to` that this op failed here. Best effort: the driver need
    /// not report its completion, and the op's error stands either way.
    Abort {
        to: Rank,
        header: Header,
        payload: Bytes,
    },
}

/// How an op ended. Polled once.
#[derive(Debug)]
pub enum OpEvent {
    /// Every action ran and every send completed; the output is in the
    /// working buffer at [`OpMachine::output_range`].
    Done,
    Failed(CollectiveError),
}

/// A send handed out and not yet completed.
#[derive(Clone, Copy, Debug)]
struct Outstanding {
    id: ActionId,
    len: usize,
    /// The range was copied (or sent from place): the plan may overwrite it.
    released: bool,
}

enum State {
    Running,
    /// Done or failed; the event is still to be polled.
    Ended(OpEvent),
    /// The event was polled.
    Finished,
}

/// One op in flight. See the module docs.
pub struct OpMachine {
    op: OpInstance,
    me: Rank,
    size: usize,
    cfg: MachineConfig,
    plan: Plan,
    /// Ranks the plan sends to or receives from.
    needed: PeerSet,
    /// Ranks whose frames the driver should wait for: every other rank
    /// (aborts may come from any), less lost ones this op does not need.
    listen: PeerSet,
    /// Ranks known lost: no abort is sent to them.
    lost: PeerSet,
    /// The first loss this op heard of: when the op fails for a lost peer,
    /// it names this one (the culprit, not a neighbour that gave up
    /// because of it).
    first_lost: Option<TransportError>,
    /// A rank this op's output depends on was lost: see
    /// [`OpMachine::handle_peer_lost`].
    lost_dependency: bool,
    started: Instant,
    deadline: Instant,
    arrivals: Vec<Arrivals>,
    outstanding: Vec<Outstanding>,
    inflight: usize,
    /// The op failed because a peer said so: not to be echoed back.
    remote_abort: bool,
    aborts: VecDeque<Transmit>,
    state: State,
}

impl OpMachine {
    /// A machine for `op`, running `plan` as rank `me` of `size`, started
    /// at `now`.
    pub fn new(
        op: OpInstance,
        plan: Plan,
        me: Rank,
        size: usize,
        cfg: MachineConfig,
        now: Instant,
    ) -> OpMachine {
        let needed = plan.peers().clone();
        let listen = (0..size as u32).map(Rank).filter(|&r| r != me).collect();
        OpMachine {
            op,
            me,
            size,
            cfg,
            plan,
            needed,
            listen,
            lost: PeerSet::new(),
            first_lost: None,
            lost_dependency: false,
            started: now,
            deadline: now + cfg.timeout,
            arrivals: vec![Arrivals::default(); size],
            outstanding: Vec::new(),
            inflight: 0,
            remote_abort: false,
            aborts: VecDeque::new(),
            state: State::Running,
        }
    }

    pub fn name(&self) -> &Arc<str> {
        &self.op.name
    }

    pub fn spec(&self) -> &OpSpec {
        &self.op.spec
    }

    pub fn tag(&self) -> OpTag {
        self.op.tag
    }

    pub fn digest(&self) -> u32 {
        self.op.digest
    }

    pub fn strategy(&self) -> Strategy {
        self.op.strategy
    }

    /// Ranks the plan sends to or receives from.
    pub fn needed(&self) -> &PeerSet {
        &self.needed
    }

    /// Ranks the plan sends to.
    pub fn targets(&self) -> &PeerSet {
        self.plan.targets()
    }

    /// Ranks whose frames (data or aborts) the driver should wait for.
    pub fn listening(&self) -> &PeerSet {
        &self.listen
    }

    /// Data frames received, by sender.
    pub fn arrivals(&self) -> &[Arrivals] {
        &self.arrivals
    }

    /// Where this rank's output lies in the working buffer (None for
    /// non-roots of reduce and gather).
    pub fn output_range(&self) -> Option<std::ops::Range<usize>> {
        self.op.spec.output_range(self.me, self.size)
    }

    /// Whether the op still runs (its end not yet polled).
    pub fn is_running(&self) -> bool {
        matches!(self.state, State::Running)
    }

    /// The ranks this op still waits for frames from.
    pub fn waiting_for(&self) -> Vec<Rank> {
        self.plan.waiting_for()
    }

    /// The next frame to send: a data frame the plan made ready (while the
    /// window has room), or, once the op failed, an abort.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if !self.is_running() {
            return self.aborts.pop_front();
        }
        if self.inflight >= self.cfg.max_inflight_bytes && !self.outstanding.is_empty() {
            return None;
        }
        let tx = self.plan.poll_transmit()?;
        let len = tx.range.len();
        self.outstanding.push(Outstanding {
            id: tx.id,
            len,
            released: false,
        });
        self.inflight += len;
        Some(Transmit::Data {
            id: tx.id,
            to: tx.to,
            header: self.header(FrameKind::Data, tx.chunk, tx.step),
            range: tx.range,
        })
    }

    /// Receives are to be posted: [`OpMachine::poll_recv`] hands them out
    /// from now on (see [`Plan::post_receives`]).
    pub fn post_receives(&mut self) {
        self.plan.post_receives();
    }

    /// A receive the driver may post into the working buffer (see
    /// [`Plan::poll_recv`]); its frame then lands there, and the driver
    /// reports [`OpMachine::handle_landed`].
    pub fn poll_recv(&mut self) -> Option<RecvReady> {
        if !self.is_running() {
            return None;
        }
        self.plan.poll_recv()
    }

    /// When the op fails unless something happens first.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.is_running().then_some(self.deadline)
    }

    /// How the op ended, once. On [`OpEvent::Done`] the output was scaled
    /// (an average) in `work`.
    pub fn poll_event<W: Work + ?Sized>(&mut self, work: &mut W) -> Option<OpEvent> {
        if self.is_running() && self.plan.is_done() && self.outstanding.is_empty() {
            self.state = State::Ended(OpEvent::Done);
            if let (Some(ReduceOp::Avg), Some(r)) =
                (self.op.spec.kind.reduce_op(), self.output_range())
            {
                let (dtype, size) = (self.op.spec.dtype, self.size);
                if !work.write(r.clone(), &mut |out| scale_down(dtype, out, size)) {
                    self.planned(self.me, Err(PlanError::Busy { range: r }));
                }
            }
        }
        match std::mem::replace(&mut self.state, State::Finished) {
            State::Ended(e) => Some(e),
            s => {
                self.state = s;
                None
            }
        }
    }

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
                    self.lost.insert(*peer);
                }
                self.first_lost.get_or_insert(e);
                self.lost_dependency = true;
                self.deadline = self.deadline.min(now + self.grace());
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
    fn planned(&mut self, from: Rank, r: Result<(), PlanError>) {
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

    /// The transport failed for this op (a lost peer at the start, a
    /// closed endpoint, a protocol error below the op).
    pub fn handle_error(&mut self, e: TransportError) {
        if self.is_running() {
            self.fail(self.transport_error(e));
        }
    }

    fn progress(&mut self, now: Instant) {
        self.deadline = now + self.grace();
    }

    /// How long the op may go without progress: the op timeout, or less
    /// once a rank its output depends on was lost.
    fn grace(&self) -> Duration {
        if self.lost_dependency {
            self.cfg.timeout.min(LOST_GRACE)
        } else {
            self.cfg.timeout
        }
    }

    fn arrived(&mut self, now: Instant, from: Rank, len: usize) {
        let since = now.saturating_duration_since(self.started);
        if let Some(a) = self.arrivals.get_mut(from.idx()) {
            a.frames += 1;
            a.bytes += len as u64;
            a.last = since;
        }
    }

    fn header(&self, kind: FrameKind, chunk: u32, step: u16) -> Header {
        Header {
            kind,
            tag: self.op.tag,
            chunk,
            step,
            digest: self.op.digest,
            len: 0,
        }
    }

    /// Ends the op with `e`, and queues an abort to every rank not known
    /// lost, unless the error came from a peer's abort or concerns no one
    /// else.
    fn fail(&mut self, e: CollectiveError) {
        if let Some(abort) = self.abort_for(&e) {
            let payload = abort.encode();
            let header = self.header(FrameKind::Abort, 0, 0);
            for to in (0..self.size as u32).map(Rank) {
                if to != self.me && !self.lost.contains(to) {
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
        errors::abort_reason(e, self.me)
            .map(|(reason, offender)| Abort::new(reason, self.me, offender, &self.op.spec))
    }
}
