//! Plans built once per op shape and reused: an op of a shape seen before
//! costs a clone of a fresh plan (a few vectors), not a build with its
//! maps, nor a topology lookup or a digest.

use std::collections::HashMap;

use kungfu_topology::Strategy;

use crate::plan::Plan;
use crate::OpSpec;

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
