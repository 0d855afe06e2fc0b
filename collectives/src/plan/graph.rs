//! A plan's graph: [`PlanBuilder`] collects the actions a generator makes
//! and their dependencies, and finishes them into a [`PlanGraph`], the
//! part of a plan that does not change while it runs; it also applies a
//! received frame to the working buffer.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use kungfu_topology::Rank;
use kungfu_transport::PeerSet;

use super::{Action, ActionId, Plan, PlanError, Work};
use crate::dtype::{reduce_into_ordered, DType, Order, ReduceOp};

/// Collects actions; see [`build`](super::build) for the generators.
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
                // (an empty frame, a rooted op's confirmation, is never
                // posted: it lands nowhere)
                Action::Recv { ref range, .. } if range.is_empty() => {}
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
    pub(super) actions: Vec<Action>,
    /// Dependencies left of each action at the start.
    pub(super) deps_left: Vec<u32>,
    pub(super) dependents: Vec<Vec<ActionId>>,
    /// Sends ready at the start.
    pub(super) ready: Vec<ActionId>,
    /// Receives that may be posted at the start: copy receives without
    /// dependencies, and every reducing receive.
    pub(super) postable: Vec<ActionId>,
    pub(super) recv_index: HashMap<(Rank, u32, u16), ActionId>,
    pub(super) dtype: DType,
    pub(super) op: ReduceOp,
    pub(super) peers: PeerSet,
    pub(super) targets: PeerSet,
}

impl PlanGraph {
    pub(super) fn apply<W: Work + ?Sized>(
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

impl PlanGraph {
    /// This graph with every rank `r` named `to[r]`: a plan built over
    /// the members of a subgroup (ranks `0..n` of the group) made to speak
    /// in the session's ranks. `to` covers every rank the graph names.
    pub(super) fn relabel(&self, to: &[Rank]) -> PlanGraph {
        let map = |r: Rank| to[r.idx()];
        let actions = self
            .actions
            .iter()
            .map(|a| match a {
                Action::Send {
                    to: r,
                    chunk,
                    step,
                    range,
                } => Action::Send {
                    to: map(*r),
                    chunk: *chunk,
                    step: *step,
                    range: range.clone(),
                },
                Action::Recv {
                    from,
                    chunk,
                    step,
                    range,
                    reduce,
                } => Action::Recv {
                    from: map(*from),
                    chunk: *chunk,
                    step: *step,
                    range: range.clone(),
                    reduce: *reduce,
                },
            })
            .collect();
        let set = |s: &PeerSet| s.iter().map(map).collect::<PeerSet>();
        PlanGraph {
            actions,
            deps_left: self.deps_left.clone(),
            dependents: self.dependents.clone(),
            ready: self.ready.clone(),
            postable: self.postable.clone(),
            recv_index: self
                .recv_index
                .iter()
                .map(|(&(r, c, s), &id)| ((map(r), c, s), id))
                .collect(),
            dtype: self.dtype,
            op: self.op,
            peers: set(&self.peers),
            targets: set(&self.targets),
        }
    }
}
