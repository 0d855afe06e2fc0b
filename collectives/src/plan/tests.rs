//! Property tests of the generators: for random cluster shapes, strategies,
//! ops, types, counts and chunk sizes, the plans of all ranks together are
//! valid, checked on the plans' own tables (no network): each `(peer,
//! chunk, step)` is expected once, every send has exactly one receive of
//! the same length and no receive lacks its send, every byte range lies in
//! the working buffer on element boundaries, and dependencies only point
//! back (so the graph has no cycle). `collective_sim` runs such plans.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kungfu_topology::{PeerList, Rank, Root, Strategy};
use proptest::prelude::{
    prop_assert, prop_assert_eq, prop_oneof, proptest, Just, ProptestConfig, TestCaseError,
};
use proptest::strategy::Strategy as _;
use proptest::test_runner::RngSeed;

use super::build::{build, PlanInput};
use super::{Action, ActionId};
use crate::{DType, OpKind, OpSpec, ReduceOp};

/// One op on one cluster.
#[derive(Clone, Debug)]
struct Case {
    /// Workers per host (the last host may have fewer).
    hosts: Vec<usize>,
    strategy: Strategy,
    spec: OpSpec,
    chunk_bytes: usize,
}

fn case() -> impl proptest::strategy::Strategy<Value = Case> {
    (1usize..=16)
        .prop_flat_map(|n| {
            (
                Just(n),
                1..=n,
                0..Strategy::ALL.len(),
                0..crate::reference::OP_KINDS,
                0..n,
                0..ReduceOp::ALL.len(),
                0..DType::ALL.len(),
                prop_oneof![0usize..20, 0usize..2000],
                1usize..300,
            )
        })
        .prop_map(|(n, per, s, kind, root, op, dtype, count, chunk_bytes)| {
            let (hosts, spec) = crate::reference::op_shape(n, per, kind, root, op, dtype, count);
            Case {
                hosts,
                strategy: Strategy::ALL[s],
                spec,
                chunk_bytes,
            }
        })
}

/// A send or receive as both ends see it: (from, to, chunk, step).
type Tag = (Rank, Rank, u32, u16);

fn check(c: &Case) -> Result<(), TestCaseError> {
    let peers = PeerList::with_hosts(&c.hosts);
    let n = peers.len();
    let spec = &c.spec;
    prop_assert!(spec.validate(n).is_ok());
    let bytes = spec.block_bytes().unwrap();
    let work = spec.work_len(n).unwrap();
    let esize = spec.dtype.size();
    let topo = |root: Root| Arc::new(c.strategy.resolve(&peers, root, bytes));
    // tag -> bytes, over all ranks
    let mut sends: HashMap<Tag, usize> = HashMap::new();
    let mut recvs: HashMap<Tag, usize> = HashMap::new();
    for r in 0..n {
        let me = Rank(r as u32);
        let plan = build(&PlanInput {
            spec,
            me,
            size: n,
            chunk_bytes: c.chunk_bytes,
            topology: &topo,
        });
        let plan = match plan {
            Ok(p) => p,
            Err(e) => return Err(TestCaseError::fail(format!("rank {r}: {e}"))),
        };
        prop_assert!(n == 1 || !plan.is_empty(), "rank {} takes no part", r);
        let mut tag_of: HashMap<ActionId, (Rank, u32, u16)> = HashMap::new();
        for (&(from, chunk, step), &id) in &plan.graph.recv_index {
            prop_assert!(
                tag_of.insert(id, (from, chunk, step)).is_none(),
                "rank {}: one receive under two tags",
                r
            );
        }
        for (i, a) in plan.graph.actions.iter().enumerate() {
            for d in &plan.graph.dependents[i] {
                prop_assert!(
                    d.0 as usize > i,
                    "rank {}: action {} waits for a later one",
                    r,
                    i
                );
            }
            let (range, tag) = match a {
                Action::Send {
                    to,
                    chunk,
                    step,
                    range,
                } => {
                    let tag = (me, *to, *chunk, *step);
                    prop_assert!(
                        sends.insert(tag, range.len()).is_none(),
                        "rank {} sends {:?} twice",
                        r,
                        tag
                    );
                    (range, tag)
                }
                Action::Recv { range, .. } => {
                    let Some(&(from, chunk, step)) = tag_of.get(&ActionId(i as u32)) else {
                        return Err(TestCaseError::fail(format!(
                            "rank {r}: receive {i} has no tag"
                        )));
                    };
                    let tag = (from, me, chunk, step);
                    recvs.insert(tag, range.len());
                    (range, tag)
                }
            };
            prop_assert!(tag.0 != tag.1, "rank {} talks to itself: {:?}", r, tag);
            prop_assert!(
                tag.0.idx() < n && tag.1.idx() < n,
                "{:?} outside {} ranks",
                tag,
                n
            );
            prop_assert!(
                range.start <= range.end && range.end <= work,
                "rank {}: {:?} {:?} outside the {} bytes",
                r,
                tag,
                range,
                work
            );
            prop_assert!(
                range.start % esize == 0 && range.end % esize == 0,
                "rank {}: {:?} {:?} splits {}-byte elements",
                r,
                tag,
                range,
                esize
            );
        }
        prop_assert_eq!(
            tag_of.len(),
            plan.graph
                .actions
                .iter()
                .filter(|a| matches!(a, Action::Recv { .. }))
                .count()
        );
    }
    let keys: HashSet<&Tag> = sends.keys().chain(recvs.keys()).collect();
    for t in keys {
        prop_assert_eq!(
            sends.get(t),
            recvs.get(t),
            "{:?}: bytes sent vs bytes expected",
            t
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 400,
        rng_seed: RngSeed::Fixed(0x4b46_0003),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn plans_of_all_ranks_fit_together(c in case()) {
        check(&c)?;
    }
}

/// The fixed cases next to the random ones: every strategy, op and a few
/// shapes, counts and chunk sizes.
#[test]
fn plans_fit_together_on_a_fixed_grid() {
    for n in [1usize, 2, 3, 4, 5, 7, 8, 16] {
        for strategy in Strategy::ALL {
            for kind in 0..8 {
                for (count, chunk_bytes) in [(0usize, 4usize), (1, 4), (7, 8), (100, 12)] {
                    let root = Rank(((count + kind) % n) as u32);
                    let kind = match kind {
                        0 => OpKind::Allreduce(ReduceOp::Sum),
                        1 => OpKind::Reduce {
                            op: ReduceOp::Max,
                            root,
                        },
                        2 => OpKind::Broadcast { root },
                        3 => OpKind::Allgather,
                        4 => OpKind::Gather { root },
                        5 => OpKind::ReduceScatter(ReduceOp::Min),
                        6 => OpKind::Alltoall,
                        _ => OpKind::Scatter { root },
                    };
                    let c = Case {
                        hosts: if n >= 3 {
                            vec![3; n / 3]
                                .into_iter()
                                .chain((n % 3 != 0).then_some(n % 3))
                                .collect()
                        } else {
                            vec![n]
                        },
                        strategy,
                        spec: OpSpec {
                            kind,
                            dtype: DType::F32,
                            count,
                            check: 0,
                        },
                        chunk_bytes,
                    };
                    check(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
                }
            }
        }
    }
}

/// A ring allreduce sends frames of a chunk / n (at most 16 workers at the
/// default 1 MiB chunk), and on larger rings frames of RING_MIN_FRAME
/// bytes, not 2(n-1) tiny frames per chunk.
#[test]
fn large_rings_send_frames_of_at_least_the_ring_minimum() {
    use super::build::RING_MIN_FRAME;
    let frames = |n: usize, bytes: usize| -> HashSet<usize> {
        ring_sends(n, OpKind::Allreduce(ReduceOp::Sum), bytes)
            .into_iter()
            .collect()
    };
    assert_eq!(frames(4, 8 << 20), HashSet::from([256 << 10]));
    assert_eq!(frames(16, 8 << 20), HashSet::from([RING_MIN_FRAME]));
    assert_eq!(frames(64, 8 << 20), HashSet::from([RING_MIN_FRAME]));
    // a buffer smaller than the ring's minimum pieces: its n segments
    assert_eq!(frames(64, 1 << 20), HashSet::from([16 << 10]));
}

/// A broadcast of a few chunks' worth is cut into quarters (at least
/// `PIPELINE_MIN_CHUNK`), so that its hops pipeline; other ops keep the
/// configured chunk.
#[test]
fn broadcasts_pipeline_in_quarters() {
    use super::build::PIPELINE_MIN_CHUNK;
    let sends = |kind: OpKind, bytes: usize| ring_sends(2, kind, bytes);
    let bcast = OpKind::Broadcast { root: Rank(0) };
    assert_eq!(sends(bcast, 1 << 20), vec![256 << 10; 4]);
    assert_eq!(sends(bcast, 2 << 20), vec![512 << 10; 4]);
    assert_eq!(sends(bcast, 8 << 20), vec![1 << 20; 8]);
    assert_eq!(sends(bcast, 256 << 10), vec![PIPELINE_MIN_CHUNK]);
    assert_eq!(sends(bcast, 4 << 10), vec![4 << 10]);
}

/// Rank 0's non-empty sends (their lengths, in plan order) of an op of
/// `bytes` f32 bytes among `n` ranks on the ring, in 1 MiB chunks (the
/// empty sends are the op's confirmation).
fn ring_sends(n: usize, kind: OpKind, bytes: usize) -> Vec<usize> {
    let peers = PeerList::local(n);
    let spec = OpSpec {
        kind,
        dtype: DType::F32,
        count: bytes / 4,
        check: 0,
    };
    let topo = |root: Root| Arc::new(Strategy::Ring.resolve(&peers, root, bytes));
    let plan = build(&PlanInput {
        spec: &spec,
        me: Rank(0),
        size: n,
        chunk_bytes: 1 << 20,
        topology: &topo,
    })
    .unwrap();
    plan.graph
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { range, .. } if !range.is_empty() => Some(range.len()),
            _ => None,
        })
        .collect()
}
