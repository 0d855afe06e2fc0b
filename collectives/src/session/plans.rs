//! Plans built once per op shape and reused: an op of a shape seen before
//! costs a clone of a fresh plan (a few vectors), not a build with its
//! maps, nor a topology lookup or a digest. Also what an op is made of
//! ([`Session::prepare`]): its plan, from here or built on the topology
//! the strategy resolves to, its tag and its machine.

use std::collections::HashMap;
use std::sync::Arc;

use kungfu_topology::{Root, Strategy, Topology};
use kungfu_transport::{OpTag, Transport};

use super::output::Memory;
use super::running::RunningOp;
use super::{lock, Session};
use crate::op::{MachineConfig, OpInstance, OpMachine};
use crate::plan::build::{build, PlanInput};
use crate::plan::Plan;
use crate::{CollectiveError, OpSpec};

/// Shapes remembered at most; past it the cache starts over (a job cycles
/// through few shapes; one that does not only pays today's build).
const PLANS: usize = 256;

/// A fresh plan with what the op needs besides it.
#[derive(Clone)]
pub(super) struct Cached {
    pub(super) plan: Plan,
    /// The short digest of (spec, topology) that every frame carries.
    pub(super) digest: u32,
    /// The strategy the plan runs (`AUTO` resolved).
    pub(super) strategy: Strategy,
}

/// Fresh plans by (spec, the session's strategy). The rest of what a plan
/// depends on (the peers, this rank, the chunk size, the `AUTO`
/// thresholds) is fixed for a session.
#[derive(Default)]
pub(super) struct PlanCache {
    map: HashMap<(OpSpec, Strategy), Cached>,
}

impl PlanCache {
    pub(super) fn get(&self, spec: &OpSpec, strategy: Strategy) -> Option<Cached> {
        self.map.get(&(*spec, strategy)).cloned()
    }

    pub(super) fn insert(&mut self, spec: OpSpec, strategy: Strategy, c: Cached) {
        if self.map.len() >= PLANS {
            self.map.clear();
        }
        self.map.insert((spec, strategy), c);
    }
}

impl<T: Transport> Session<T> {
    /// [`Session::topology`] under strategy `s` rather than the session's.
    pub(super) fn topology_of(&self, s: Strategy, root: Root, bytes: usize) -> Arc<Topology> {
        let s = match s {
            Strategy::Auto => {
                Strategy::auto_choice_with(&self.inner.peers, root, bytes, &self.inner.config.auto)
            }
            s => s,
        };
        lock(&self.inner.topologies)
            .entry((s, root))
            .or_insert_with(|| Arc::new(s.resolve(&self.inner.peers, root, bytes)))
            .clone()
    }

    pub(super) fn prepare(
        &self,
        name: Arc<str>,
        spec: OpSpec,
        mem: Memory,
        internal: bool,
    ) -> Result<RunningOp, CollectiveError> {
        let n = self.size();
        let me = self.rank();
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: name.clone(),
            reason,
        };
        self.check(&name, &spec, &mem, internal)?;
        let configured = self.strategy();
        let cached = lock(&self.inner.plans).get(&spec, configured);
        let Cached {
            plan,
            digest,
            strategy,
        } = match cached {
            Some(c) => c,
            None => {
                let bytes = spec.block_bytes().expect("validated");
                let topo = self.topology_of(configured, spec.kind.root(), bytes);
                let c = Cached {
                    plan: build(&PlanInput {
                        spec: &spec,
                        me,
                        size: n,
                        chunk_bytes: self.inner.config.chunk_bytes,
                        topology: &|r| self.topology_of(configured, r, bytes),
                    })
                    .map_err(invalid)?,
                    digest: spec.digest(&topo).short(),
                    strategy: topo.strategy(),
                };
                lock(&self.inner.plans).insert(spec, configured, c.clone());
                c
            }
        };
        let (op, seq) = lock(&self.inner.names).begin(&name)?;
        let work = self.work_of(&spec, mem);
        let op = OpInstance {
            name,
            spec,
            tag: OpTag {
                epoch: self.epoch(),
                op,
                seq,
            },
            digest,
            strategy,
        };
        let cfg = MachineConfig {
            timeout: self.inner.config.op_timeout,
            max_inflight_bytes: self.inner.config.max_inflight_bytes,
        };
        Ok(RunningOp {
            m: OpMachine::new(op, plan, me, n, cfg, kungfu_transport::Instant::now()),
            work,
        })
    }
}
