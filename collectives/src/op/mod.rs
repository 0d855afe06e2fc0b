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
//!
//! This file holds the machine's state and its outputs (`poll_*`); its
//! inputs are in `frames.rs` (frames and sends) and `liveness.rs` (the
//! deadline and lost peers), its failures in `errors.rs`.

pub(crate) mod errors;
mod frames;
mod liveness;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::failure::Liveness;
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::{FrameKind, Header, Instant, OpTag, PeerSet};

use crate::dtype::scale_down;
use crate::plan::{ActionId, Plan, PlanError, RecvReady, Work};
use crate::{CollectiveError, OpSpec, ReduceOp};

pub use crate::failure::LOST_GRACE;

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

/// The ranks of an op of a subgroup (see [`OpMachine::in_group`]).
#[derive(Clone, Debug)]
struct Group {
    /// This rank's place in the group (its session rank when the op runs
    /// on the whole session).
    pos: Rank,
    /// The session rank of each group rank; None: the whole session.
    members: Option<Arc<[Rank]>>,
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
    /// This rank in the session, and the session's size.
    me: Rank,
    size: usize,
    /// Where this op's ranks are: the session's, or a subgroup's.
    group: Group,
    cfg: MachineConfig,
    plan: Plan,
    /// Ranks the plan sends to or receives from.
    needed: PeerSet,
    /// Ranks whose frames the driver should wait for: every other rank
    /// (aborts may come from any), less lost ones this op does not need.
    listen: PeerSet,
    /// Ranks known lost: no abort is sent to them.
    lost: PeerSet,
    /// The inactivity deadline and the first loss heard of (shared with
    /// the fast path: [`crate::failure`]).
    live: Liveness<Instant>,
    started: Instant,
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
            group: Group {
                pos: me,
                members: None,
            },
            cfg,
            plan,
            needed,
            listen,
            lost: PeerSet::new(),
            live: Liveness::new(now, cfg.timeout),
            started: now,
            arrivals: vec![Arrivals::default(); size],
            outstanding: Vec::new(),
            inflight: 0,
            remote_abort: false,
            aborts: VecDeque::new(),
            state: State::Running,
        }
    }

    /// This machine, for an op of a subgroup: `members[i]` is the session
    /// rank of the group's rank `i`, and this rank is the group's `pos`.
    /// The spec and the plan's layout speak in the group's ranks (its
    /// roots, its blocks); the plan must have been relabelled to the
    /// session's ranks ([`Plan::relabelled`]), and frames, aborts and lost
    /// peers speak in the session's ranks too. Only members are listened
    /// to and told of a failure.
    pub fn in_group(mut self, members: Arc<[Rank]>, pos: Rank) -> OpMachine {
        debug_assert_eq!(members.get(pos.idx()), Some(&self.me));
        let me = self.me;
        self.listen = members.iter().copied().filter(|&r| r != me).collect();
        self.group = Group {
            pos,
            members: Some(members),
        };
        self
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
        self.op.spec.output_range(self.group.pos, self.group_size())
    }

    /// How many ranks run this op: the session's, or the subgroup's.
    fn group_size(&self) -> usize {
        self.group.members.as_ref().map_or(self.size, |m| m.len())
    }

    /// The ranks this op runs on, other than this one (the ones told of a
    /// failure).
    fn others(&self) -> Vec<Rank> {
        match &self.group.members {
            Some(m) => m.iter().copied().filter(|&r| r != self.me).collect(),
            None => (0..self.size as u32)
                .map(Rank)
                .filter(|&r| r != self.me)
                .collect(),
        }
    }

    /// Whether this rank's output depends on session rank `peer`.
    fn depends_on(&self, peer: Rank) -> bool {
        let peer = match &self.group.members {
            Some(m) => match m.iter().position(|&r| r == peer) {
                Some(i) => Rank(i as u32),
                None => return false,
            },
            None => peer,
        };
        self.op.spec.kind.depends_on(self.group.pos, peer)
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
        self.is_running().then_some(self.live.deadline())
    }

    /// How the op ended, once. On [`OpEvent::Done`] the output was scaled
    /// (an average) in `work`.
    pub fn poll_event<W: Work + ?Sized>(&mut self, work: &mut W) -> Option<OpEvent> {
        if self.is_running() && self.plan.is_done() && self.outstanding.is_empty() {
            self.state = State::Ended(OpEvent::Done);
            if let (Some(ReduceOp::Avg), Some(r)) =
                (self.op.spec.kind.reduce_op(), self.output_range())
            {
                let (dtype, size) = (self.op.spec.dtype, self.group_size());
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
}
