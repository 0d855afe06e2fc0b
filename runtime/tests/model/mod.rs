//! What the protocol models (`model_*.rs`) share: the bound, the run of
//! the checker, and what a settled state is.

use std::fmt::Debug;
use std::hash::Hash;
use std::time::Instant;

use stateright::{Checker, HasDiscoveries, Model};

/// The bound to check at: `KUNGFU_MODEL_BOUND` if set (each model says
/// what it bounds: usually the number of workers), else `small`, which
/// fits CI.
pub fn bound(small: usize) -> usize {
    std::env::var("KUNGFU_MODEL_BOUND")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(small)
}

/// Checks `model` breadth first over every reachable state and prints
/// how many there were and how long it took. It stops at the first
/// property that fails: a model that must fail ends there, and a broken
/// protocol whose states would never end (versions decided again and
/// again) cannot run until memory runs out.
pub fn check<M>(what: &str, model: M) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync,
    M::Action: Clone + Debug + PartialEq,
{
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    let t0 = Instant::now();
    let c = model
        .checker()
        .threads(threads)
        .finish_when(HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    println!(
        "{what}: {} states ({} unique), depth {}, {:.2} s",
        c.state_count(),
        c.unique_state_count(),
        c.max_depth(),
        t0.elapsed().as_secs_f64()
    );
    for (name, path) in c.discoveries() {
        println!("{what}: discovery \"{name}\": {path}");
    }
    c
}

/// Whether no action but a fault (`fault`: a crash, a freeze) changes
/// `s`: once faults stop, every run that reaches it ends there. The
/// models are bounded and every action makes progress (no state repeats
/// on a path), so "every op ends once crashes stop" is "every settled
/// state is an end" (stateright's `eventually` is checked at the states
/// without any successor, which a fault still left possible hides, and
/// it can miss a path that joins another; this cannot).
pub fn settled<M: Model>(model: &M, s: &M::State, fault: fn(&M::Action) -> bool) -> bool {
    let mut actions = Vec::new();
    model.actions(s, &mut actions);
    actions
        .into_iter()
        .filter(|a| !fault(a))
        .all(|a| model.next_state(s, a).is_none())
}
