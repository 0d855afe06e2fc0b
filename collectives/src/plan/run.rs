//! One run of a plan: a shared [`PlanGraph`] and how far this op got in
//! it. The driver's inputs (`handle_*`) complete actions and release what
//! depends on them; its outputs (`poll_*`) hand out sends and receives.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use kungfu_topology::Rank;
use kungfu_transport::PeerSet;

use super::graph::PlanGraph;
use super::{Action, ActionId, PlanError, RecvReady, State, Transmit, Work};

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
}

/// One rank's part of one op: a [`PlanGraph`] and how far it ran. See the
/// [module docs](super). A clone of a plan that has not started is a fresh plan of
/// the same graph.
#[derive(Clone, Debug)]
pub struct Plan {
    pub(super) graph: Arc<PlanGraph>,
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
    /// A fresh run of this plan's graph with every rank `r` named `to[r]`
    /// (a subgroup's plan, built over its members' places, made to speak
    /// in the session's ranks). Call it on a plan that has not started.
    pub fn relabelled(&self, to: &[Rank]) -> Plan {
        Arc::new(self.graph.relabel(to)).start()
    }

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
