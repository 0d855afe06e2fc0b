//! Sans-IO plans: what one rank does for one op.
//!
//! A plan is a small dependency graph of *actions* over byte ranges of the
//! op's working buffer: `Send { to, chunk, step, range }` and
//! `Recv { from, chunk, step, range, reduce|copy }`. An action becomes ready
//! when the actions it depends on are complete. The plan owns no buffer and
//! does no IO: the driver asks [`Plan::poll_transmit`] what to send, reports
//! with [`Plan::handle_sent`] when the bytes are taken, and feeds arriving
//! frames to [`Plan::handle_frame`], passing the working buffer each time.
//!
//! Frames may arrive in any order, also ahead of the actions they feed (a
//! ring neighbour can be a few steps ahead); such a frame is held (by
//! reference, no copy) until its dependencies complete. Each `(peer, chunk,
//! step)` is expected exactly once; anything else is a protocol error, so
//! memory per op is bounded by the op's own size.
//!
//! Every algorithm is a generator of these graphs ([`build`]), so one
//! engine runs all of them, in the real scheduler and in the deterministic
//! simulation alike.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use kungfu_topology::Rank;
use kungfu_transport::PeerSet;

use crate::dtype::{reduce_into_ordered, DType, Order, ReduceOp};

pub mod build;
mod chunk;
#[cfg(test)]
mod tests;

pub use chunk::{chunks, segment};

/// The op's working memory, as a plan writes it: one range at a time.
///
/// A plain slice for tests and the simulation; a
/// [`Region`](kungfu_transport::Region) when ranges of it may be lent to
/// wires (a posted receive holds its range until the frame lands, so the
/// plan may not write it meanwhile: such a write is refused, never racy).
pub trait Work {
    /// Runs `f` on `range`, writable; false (and `f` not run) if the range
    /// is lent out.
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool;
}

impl Work for [u8] {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        f(&mut self[range]);
        true
    }
}

impl Work for Vec<u8> {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        self.as_mut_slice().write(range, f)
    }
}

impl Work for Arc<kungfu_transport::Region> {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        match kungfu_transport::Region::write(self, range) {
            Ok(mut m) => {
                f(m.as_mut_slice());
                true
            }
            Err(_) => false,
        }
    }
}

/// Identifies an action of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActionId(u32);

#[derive(Clone, Debug)]
enum Action {
    Send {
        to: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
    },
    Recv {
        from: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
        /// Reduce in this operand order, or (None) overwrite.
        reduce: Option<Order>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    /// A receive whose frame is here but whose dependencies are not done.
    Arrived,
    /// A send handed out by `poll_transmit`, not yet reported sent.
    InFlight,
    Done,
}

/// A frame the driver must send: the bytes of `range` of the working
/// buffer, to `to`, tagged `(chunk, step)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub id: ActionId,
    pub to: Rank,
    pub chunk: u32,
    pub step: u16,
    pub range: Range<usize>,
}

/// A frame the plan cannot accept. Each is a protocol error of the sender.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("unexpected frame (chunk {chunk}, step {step}) from {from}")]
    Unexpected { from: Rank, chunk: u32, step: u16 },
    #[error("duplicate frame (chunk {chunk}, step {step}) from {from}")]
    Duplicate { from: Rank, chunk: u32, step: u16 },
    #[error("internal error: range {range:?} of the working buffer is lent out")]
    Busy { range: Range<usize> },
    #[error("frame (chunk {chunk}, step {step}) from {from} has {got} bytes, expected {want}")]
    Length {
        from: Rank,
        chunk: u32,
        step: u16,
        got: usize,
        want: usize,
    },
}

/// Collects actions; see [`build`] for the generators.
pub struct PlanBuilder {
    actions: Vec<Action>,
    deps: Vec<Vec<ActionId>>,
    recv_index: HashMap<(Rank, u32, u16), ActionId>,
}

impl PlanBuilder {
    pub fn new() -> PlanBuilder {
        PlanBuilder {
            actions: Vec::new(),
            deps: Vec::new(),
            recv_index: HashMap::new(),
        }
    }

    fn push(&mut self, a: Action, deps: &[ActionId]) -> ActionId {
        let id = ActionId(u32::try_from(self.actions.len()).expect("plan of < 2^32 actions"));
        self.actions.push(a);
        self.deps.push(deps.to_vec());
        id
    }

    /// Sends `range` to `to` once `deps` are complete.
    pub fn send(
        &mut self,
        to: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
        deps: &[ActionId],
    ) -> ActionId {
        self.push(
            Action::Send {
                to,
                chunk,
                step,
                range,
            },
            deps,
        )
    }

    /// Receives `(chunk, step)` from `from` into `range`, reducing into it
    /// or overwriting it, once `deps` are complete.
    pub fn recv(
        &mut self,
        from: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
        reduce: bool,
        deps: &[ActionId],
    ) -> ActionId {
        let reduce = reduce.then_some(Order::DstFirst);
        self.recv_with(from, chunk, step, range, reduce, deps)
    }

    /// Like [`PlanBuilder::recv`], reducing with the operands in `order`
    /// (`None`: overwrite).
    pub fn recv_with(
        &mut self,
        from: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
        reduce: Option<Order>,
        deps: &[ActionId],
    ) -> ActionId {
        let id = self.push(
            Action::Recv {
                from,
                chunk,
                step,
                range,
                reduce,
            },
            deps,
        );
        let dup = self.recv_index.insert((from, chunk, step), id);
        assert!(dup.is_none(), "generator made two receives of one tag");
        id
    }

    /// Finishes the plan; `dtype` and `op` drive reducing receives.
    pub fn finish(self, dtype: DType, op: ReduceOp) -> Plan {
        let n = self.actions.len();
        let mut dependents = vec![Vec::new(); n];
        let mut deps_left = vec![0u32; n];
        let mut ready = Vec::new();
        let mut postable = Vec::new();
        let mut peers = PeerSet::new();
        let mut targets = PeerSet::new();
        for (i, deps) in self.deps.iter().enumerate() {
            deps_left[i] = deps.len() as u32;
            for d in deps {
                dependents[d.0 as usize].push(ActionId(i as u32));
            }
            match self.actions[i] {
                Action::Send { .. } if deps.is_empty() => ready.push(ActionId(i as u32)),
                // A reducing receive goes into scratch memory, not into its
                // range: it may be posted before its dependencies are done
                // (and must be, over a rendezvous wire, where a peer's send
                // completes only once it is posted: two ranks that exchange
                // and reduce would otherwise each wait for the other).
                Action::Recv {
                    reduce: Some(_), ..
                } => postable.push(ActionId(i as u32)),
                Action::Recv { .. } if deps.is_empty() => postable.push(ActionId(i as u32)),
                _ => {}
            }
            match &self.actions[i] {
                Action::Send { to, .. } => {
                    peers.insert(*to);
                    targets.insert(*to);
                }
                Action::Recv { from, .. } => peers.insert(*from),
            }
        }
        Arc::new(PlanGraph {
            actions: self.actions,
            deps_left,
            dependents,
            ready: ready.into_iter().collect(),
            postable,
            recv_index: self.recv_index,
            dtype,
            op,
            peers,
            targets,
        })
        .start()
    }
}

impl Default for PlanBuilder {
    fn default() -> Self {
        PlanBuilder::new()
    }
}

/// The part of a plan that does not change while it runs: its actions and
/// their dependencies. Built once per (spec, topology, rank), shared by
/// every op of that shape ([`Plan::clone`] of a fresh plan costs a few
/// vectors, not a build).
#[derive(Debug)]
pub struct PlanGraph {
    actions: Vec<Action>,
    /// Dependencies left of each action at the start.
    deps_left: Vec<u32>,
    dependents: Vec<Vec<ActionId>>,
    /// Sends ready at the start.
    ready: Vec<ActionId>,
    /// Receives that may be posted at the start: copy receives without
    /// dependencies, and every reducing receive.
    postable: Vec<ActionId>,
    recv_index: HashMap<(Rank, u32, u16), ActionId>,
    dtype: DType,
    op: ReduceOp,
    peers: PeerSet,
    targets: PeerSet,
}

impl PlanGraph {
    /// A fresh run of this graph.
    pub fn start(self: Arc<Self>) -> Plan {
        Plan {
            state: vec![State::Waiting; self.actions.len()],
            deps_left: self.deps_left.clone(),
            ready: self.ready.iter().copied().collect(),
            postable: Vec::new(),
            initial_postable: 0,
            handed: Vec::new(),
            posting: false,
            arrived: HashMap::new(),
            done: 0,
            graph: self,
        }
    }

    fn apply<W: Work + ?Sized>(
        &self,
        id: ActionId,
        parts: &[&[u8]],
        work: &mut W,
    ) -> Result<(), PlanError> {
        let Action::Recv {
            ref range, reduce, ..
        } = self.actions[id.0 as usize]
        else {
            unreachable!("apply on a receive");
        };
        let written = work.write(range.clone(), &mut |dst| {
            let mut at = 0;
            for p in parts {
                let dst = &mut dst[at..at + p.len()];
                match reduce {
                    Some(order) => reduce_into_ordered(self.dtype, self.op, dst, p, order),
                    None => dst.copy_from_slice(p),
                }
                at += p.len();
            }
        });
        match written {
            true => Ok(()),
            false => Err(PlanError::Busy {
                range: range.clone(),
            }),
        }
    }
}

/// One rank's part of one op: a [`PlanGraph`] and how far it ran. See the
/// module docs. A clone of a plan that has not started is a fresh plan of
/// the same graph.
#[derive(Clone, Debug)]
pub struct Plan {
    graph: Arc<PlanGraph>,
    state: Vec<State>,
    deps_left: Vec<u32>,
    ready: VecDeque<ActionId>,
    /// Receives whose dependencies are done, not yet handed out by
    /// [`Plan::poll_recv`] (after the graph's initial ones).
    postable: Vec<ActionId>,
    /// How many of the graph's initial postable receives were handed out
    /// (read from the graph, not copied per run).
    initial_postable: usize,
    /// Receives already handed out (each goes out once); empty unless
    /// posting.
    handed: Vec<bool>,
    /// Whether receives are handed out to be posted at all (see
    /// [`Plan::post_receives`]); off, the plan keeps no list of them.
    posting: bool,
    arrived: HashMap<ActionId, Bytes>,
    done: usize,
}

impl Plan {
    /// Every rank this plan sends to or receives from.
    pub fn peers(&self) -> &PeerSet {
        &self.graph.peers
    }

    /// Every rank this plan sends to.
    pub fn targets(&self) -> &PeerSet {
        &self.graph.targets
    }

    /// How many actions the plan has (for tests and stats).
    pub fn len(&self) -> usize {
        self.graph.actions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.graph.actions.is_empty()
    }

    /// Whether every action is complete.
    pub fn is_done(&self) -> bool {
        self.done == self.graph.actions.len()
    }

    /// The next frame to send, if one is ready. The driver takes the bytes
    /// of `range` and then calls [`Plan::handle_sent`].
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        let id = self.ready.pop_front()?;
        let Action::Send {
            to,
            chunk,
            step,
            ref range,
        } = self.graph.actions[id.0 as usize]
        else {
            unreachable!("only sends are queued as ready");
        };
        self.state[id.0 as usize] = State::InFlight;
        Some(Transmit {
            id,
            to,
            chunk,
            step,
            range: range.clone(),
        })
    }

    /// Hands out receives to be posted ([`Plan::poll_recv`]); call it
    /// before the plan makes progress (receives that became ready while it
    /// was off are not handed out). Off by default: a driver whose wires
    /// all lend frames in place posts nothing, and the plan then keeps no
    /// list.
    pub fn post_receives(&mut self) {
        self.posting = true;
        self.handed = vec![false; self.state.len()];
    }

    /// A receive that may be posted now, each handed out once: a copy
    /// receive whose dependencies are done (it overwrites its range), which
    /// may be posted into its range, which nothing of the plan touches
    /// until it completes: the frame then lands there, and the driver
    /// reports [`Plan::handle_landed`]. A reducing receive (`reduce`),
    /// handed out at once whatever its dependencies, may be posted into
    /// scratch memory, its frame then given to [`Plan::handle_frame`]
    /// (several reduce into one range, so none may hold it; it waits there
    /// for its dependencies). Or the driver leaves the receive to arrive as
    /// a frame.
    pub fn poll_recv(&mut self) -> Option<RecvReady> {
        if !self.posting {
            return None;
        }
        // Some arrived (as frames) before they were asked for.
        let id = loop {
            let id = match self.graph.postable.get(self.initial_postable) {
                Some(&id) => {
                    self.initial_postable += 1;
                    id
                }
                None => self.postable.pop()?,
            };
            let i = id.0 as usize;
            if self.state[i] == State::Waiting && !std::mem::replace(&mut self.handed[i], true) {
                break id;
            }
        };
        let Action::Recv {
            from,
            chunk,
            step,
            ref range,
            reduce,
        } = self.graph.actions[id.0 as usize]
        else {
            unreachable!("only receives are postable");
        };
        Some(RecvReady {
            from,
            chunk,
            step,
            range: range.clone(),
            reduce: reduce.is_some(),
        })
    }

    /// The bytes of a transmitted range are taken (copied, or sent from
    /// place): actions that overwrite them may now run.
    pub fn handle_sent<W: Work + ?Sized>(
        &mut self,
        id: ActionId,
        work: &mut W,
    ) -> Result<(), PlanError> {
        assert_eq!(
            self.state[id.0 as usize],
            State::InFlight,
            "handle_sent for an action not handed out"
        );
        self.complete(id, work)
    }

    /// A data frame of this op arrived.
    pub fn handle_frame<W: Work + ?Sized>(
        &mut self,
        from: Rank,
        chunk: u32,
        step: u16,
        payload: Bytes,
        work: &mut W,
    ) -> Result<(), PlanError> {
        let id = self.expected(from, chunk, step, payload.len())?;
        let i = id.0 as usize;
        if self.deps_left[i] == 0 {
            self.graph.apply(id, &[&payload], work)?;
            self.complete(id, work)
        } else {
            self.state[i] = State::Arrived;
            self.arrived.insert(id, payload);
            Ok(())
        }
    }

    /// The frame of a posted receive (see [`Plan::poll_recv`]) of `len`
    /// bytes landed in its range.
    pub fn handle_landed<W: Work + ?Sized>(
        &mut self,
        from: Rank,
        chunk: u32,
        step: u16,
        len: usize,
        work: &mut W,
    ) -> Result<(), PlanError> {
        let id = self.expected(from, chunk, step, len)?;
        if self.deps_left[id.0 as usize] != 0 {
            // Only a receive handed out by poll_recv is posted.
            return Err(PlanError::Unexpected { from, chunk, step });
        }
        self.complete(id, work)
    }

    /// Applies a data frame straight from borrowed memory (`parts`, the
    /// payload in pieces, e.g. a shared-memory ring that wraps), if its
    /// receive can run now: `Ok(true)` when applied (no copy was made),
    /// `Ok(false)` when not (dependencies pending, or a piece that splits an
    /// element): the caller then passes the frame, owned, to
    /// [`Plan::handle_frame`]. Errors are those of `handle_frame`.
    pub fn try_apply<W: Work + ?Sized>(
        &mut self,
        from: Rank,
        chunk: u32,
        step: u16,
        parts: &[&[u8]],
        work: &mut W,
    ) -> Result<bool, PlanError> {
        let got: usize = parts.iter().map(|p| p.len()).sum();
        let id = self.expected(from, chunk, step, got)?;
        let i = id.0 as usize;
        let esize = self.graph.dtype.size();
        if self.deps_left[i] != 0 || parts.iter().any(|p| p.len() % esize != 0) {
            return Ok(false);
        }
        self.graph.apply(id, parts, work)?;
        self.complete(id, work)?;
        Ok(true)
    }

    /// The receive a frame `(from, chunk, step)` of `len` bytes is for, if
    /// it is one this plan still waits for.
    fn expected(
        &self,
        from: Rank,
        chunk: u32,
        step: u16,
        len: usize,
    ) -> Result<ActionId, PlanError> {
        let id = *self
            .graph
            .recv_index
            .get(&(from, chunk, step))
            .ok_or(PlanError::Unexpected { from, chunk, step })?;
        let i = id.0 as usize;
        if self.state[i] != State::Waiting {
            return Err(PlanError::Duplicate { from, chunk, step });
        }
        let Action::Recv { ref range, .. } = self.graph.actions[i] else {
            unreachable!("recv_index holds receives");
        };
        if len != range.len() {
            return Err(PlanError::Length {
                from,
                chunk,
                step,
                got: len,
                want: range.len(),
            });
        }
        Ok(id)
    }

    /// The ranks from which frames are still expected (for timeout errors).
    pub fn waiting_for(&self) -> Vec<Rank> {
        let mut v: Vec<Rank> = self
            .graph
            .actions
            .iter()
            .zip(&self.state)
            .filter_map(|(a, s)| match a {
                Action::Recv { from, .. } if *s == State::Waiting => Some(*from),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Marks `id` complete and runs whatever that unblocks (iteratively, so
    /// long chains do not recurse).
    fn complete<W: Work + ?Sized>(&mut self, id: ActionId, work: &mut W) -> Result<(), PlanError> {
        let g = &*self.graph;
        // Receives unblocked on the way (rare past the first), handled
        // iteratively so long chains do not recurse; no allocation unless
        // there is one.
        let mut stack = Vec::new();
        let mut next = Some(id);
        while let Some(id) = next.take().or_else(|| stack.pop()) {
            self.state[id.0 as usize] = State::Done;
            self.done += 1;
            for &d in &g.dependents[id.0 as usize] {
                let di = d.0 as usize;
                self.deps_left[di] -= 1;
                if self.deps_left[di] != 0 {
                    continue;
                }
                match (&g.actions[di], self.state[di]) {
                    (Action::Send { .. }, _) => self.ready.push_back(d),
                    (Action::Recv { .. }, State::Arrived) => {
                        let payload = self.arrived.remove(&d).expect("arrived payload");
                        g.apply(d, &[&payload], work)?;
                        stack.push(d);
                    }
                    (Action::Recv { .. }, State::Waiting) if self.posting => self.postable.push(d),
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// A receive the driver may post: see [`Plan::poll_recv`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvReady {
    pub from: Rank,
    pub chunk: u32,
    pub step: u16,
    pub range: Range<usize>,
    /// It reduces into `range` (post it into scratch memory, if at all).
    pub reduce: bool,
}
