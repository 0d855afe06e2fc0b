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
use super::scope::Scope;
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
    /// [`Session::topology`] under strategy `s` rather than the session's,
    /// over the ranks of `scope`.
    pub(super) fn topology_of(
        &self,
        s: Strategy,
        root: Root,
        bytes: usize,
        scope: Option<&Scope>,
    ) -> Arc<Topology> {
        let (peers, topologies) = match scope {
            Some(sc) => (&sc.peers, &sc.topologies),
            None => (&self.inner.peers, &self.inner.topologies),
        };
        let s = match s {
            Strategy::Auto => {
                Strategy::auto_choice_with(peers, root, bytes, &self.inner.config.auto)
            }
            s => s,
        };
        lock(topologies)
            .entry((s, root))
            .or_insert_with(|| Arc::new(s.resolve(peers, root, bytes)))
            .clone()
    }

    /// An op of `scope` (None: of the whole session), ready to run.
    pub(super) fn prepare(
        &self,
        name: Arc<str>,
        spec: OpSpec,
        mem: Memory,
        internal: bool,
        scope: Option<&Scope>,
        spare: super::driver::Spare,
    ) -> Result<RunningOp, CollectiveError> {
        let (n, pos) = self.place(scope);
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: name.clone(),
            reason,
        };
        self.check(&name, &spec, &mem, internal, (n, pos))?;
        let configured = self.strategy();
        let plans = scope.map_or(&self.inner.plans, |s| &s.plans);
        // One plan serves every check of a spec; the digest differs.
        let key = spec.unchecked();
        let cached = lock(plans).get(&key, configured);
        let Cached {
            plan,
            digest,
            strategy,
        } = match cached {
            Some(c) => c,
            None => {
                let bytes = spec.block_bytes().expect("validated");
                let topo = self.topology_of(configured, spec.kind.root(), bytes, scope);
                let plan = build(&PlanInput {
                    spec: &spec,
                    me: pos,
                    size: n,
                    chunk_bytes: self.inner.config.chunk_bytes,
                    topology: &|r| self.topology_of(configured, r, bytes, scope),
                })
                .map_err(invalid)?;
                let c = Cached {
                    plan: match scope {
                        Some(s) => plan.relabelled(&s.members),
                        None => plan,
                    },
                    digest: key.digest(&topo).short(),
                    strategy: topo.strategy(),
                };
                lock(plans).insert(key, configured, c.clone());
                c
            }
        };
        let (op, seq) = match scope {
            Some(s) => lock(&self.inner.names).begin_with_id(s.op_id(&name), &name)?,
            None => lock(&self.inner.names).begin(&name)?,
        };
        let work = self.work_of(&spec, mem, (n, pos), spare);
        let op = OpInstance {
            name,
            spec,
            tag: OpTag {
                epoch: self.epoch(),
                op,
                seq,
            },
            digest: crate::spec::with_check(digest, spec.check),
            strategy,
        };
        let cfg = MachineConfig {
            timeout: self.inner.config.op_timeout,
            max_inflight_bytes: self.inner.config.max_inflight_bytes,
        };
        let t = self.inner.transport();
        let m = OpMachine::new(
            op,
            plan,
            t.rank(),
            t.size(),
            cfg,
            kungfu_transport::Instant::now(),
        );
        let m = match scope {
            Some(s) => m.in_group(s.members.clone(), s.pos),
            None => m,
        };
        Ok(RunningOp { m, work })
    }
}
