//! Deterministic simulation: N plans over an in-memory network whose
//! delivery order is drawn from a seeded RNG (so frames are delayed and
//! reordered arbitrarily), with a bounded drive that fails on deadlock or
//! livelock. Inputs are small integers, so float results are exact in any
//! reduction order and compare with `==`.

// Ranks index parallel per-rank tables.
#![allow(clippy::needless_range_loop)]

use std::sync::Arc;

use bytes::Bytes;
use kungfu_collectives::plan::build::{build, PlanInput};
use kungfu_collectives::plan::Plan;
use kungfu_collectives::{reference, scale_down, DType, OpKind, OpSpec, ReduceOp};
use kungfu_topology::{PeerList, Rank, Root, Strategy};
use kungfu_transport::mem::SeededRng;

struct Msg {
    from: Rank,
    to: Rank,
    chunk: u32,
    step: u16,
    payload: Bytes,
}

/// Runs one op on every rank; returns each rank's output (None where the
/// rank has none).
fn simulate(
    peers: &PeerList,
    strategy: Strategy,
    spec: &OpSpec,
    inputs: &[Vec<u8>],
    chunk_bytes: usize,
    seed: u64,
) -> Vec<Option<Vec<u8>>> {
    let n = peers.len();
    let bytes = spec.block_bytes().unwrap();
    let topo = |root: Root| Arc::new(strategy.resolve(peers, root, bytes));
    let mut plans: Vec<Plan> = Vec::new();
    let mut works: Vec<Vec<u8>> = Vec::new();
    for r in 0..n {
        let me = Rank(r as u32);
        plans.push(
            build(&PlanInput {
                spec,
                me,
                size: n,
                chunk_bytes,
                topology: &topo,
            })
            .unwrap(),
        );
        works.push(spec.init_work(&inputs[r], me, n));
    }
    let mut rng = SeededRng::new(seed);
    let mut net: Vec<Msg> = Vec::new();
    let total_actions: usize = plans.iter().map(|p| p.len()).sum();
    let mut steps = 0usize;
    loop {
        for r in 0..n {
            while let Some(tx) = plans[r].poll_transmit() {
                let payload = Bytes::copy_from_slice(&works[r][tx.range.clone()]);
                plans[r].handle_sent(tx.id, &mut works[r]);
                net.push(Msg {
                    from: Rank(r as u32),
                    to: tx.to,
                    chunk: tx.chunk,
                    step: tx.step,
                    payload,
                });
            }
        }
        if net.is_empty() {
            let stuck: Vec<usize> = (0..n).filter(|&r| !plans[r].is_done()).collect();
            assert!(
                stuck.is_empty(),
                "deadlock: {strategy} {spec:?} n={n}: ranks {stuck:?} wait for {:?}",
                stuck
                    .iter()
                    .map(|&r| plans[r].waiting_for())
                    .collect::<Vec<_>>()
            );
            break;
        }
        steps += 1;
        assert!(
            steps <= total_actions + 1,
            "livelock: more deliveries than actions ({strategy} {spec:?})"
        );
        let m = net.swap_remove(rng.below(net.len() as u64) as usize);
        let to = m.to.idx();
        plans[to]
            .handle_frame(m.from, m.chunk, m.step, m.payload, &mut works[to])
            .unwrap_or_else(|e| panic!("{strategy} {spec:?} n={n}: {e}"));
    }
    (0..n)
        .map(|r| {
            let range = spec.output_range(Rank(r as u32), n)?;
            let out = &mut works[r][range];
            if spec.kind.reduce_op() == Some(ReduceOp::Avg) {
                scale_down(spec.dtype, out, n);
            }
            Some(out.to_vec())
        })
        .collect()
}

fn check(peers: &PeerList, strategy: Strategy, spec: OpSpec, chunk_bytes: usize, seed: u64) {
    let n = peers.len();
    let inputs = reference::inputs(&spec, n);
    let got = simulate(peers, strategy, &spec, &inputs, chunk_bytes, seed);
    for r in 0..n {
        assert!(
            got[r] == reference::expected(&spec, r, &inputs),
            "{strategy} {spec:?} n={n} hosts={}: rank {r} got a wrong result",
            peers.hosts().len()
        );
    }
}

fn layouts(n: usize) -> Vec<PeerList> {
    let mut v = vec![PeerList::local(n)];
    if n >= 3 {
        // hosts of three workers (the last one smaller), for host-aware strategies
        let mut per = vec![3; n / 3];
        if !n.is_multiple_of(3) {
            per.push(n % 3);
        }
        v.push(PeerList::with_hosts(&per));
    }
    v
}

const COUNTS: [usize; 5] = [0, 1, 7, 1000, 100_003];

fn matrix(kind_of: impl Fn(usize, usize) -> OpKind) {
    let mut seed = 1;
    for n in 1..=16 {
        for peers in layouts(n) {
            for strategy in Strategy::ALL {
                for count in COUNTS {
                    seed += 1;
                    let spec = OpSpec {
                        kind: kind_of(n, count),
                        dtype: DType::F32,
                        count,
                    };
                    check(&peers, strategy, spec, 16 * 1024, seed);
                }
            }
        }
    }
}

fn root_for(n: usize, count: usize) -> Rank {
    Rank(((count + n / 2) % n) as u32)
}

#[test]
fn allreduce_matrix() {
    matrix(|_, _| OpKind::Allreduce(ReduceOp::Sum));
}

#[test]
fn reduce_matrix() {
    matrix(|n, c| OpKind::Reduce {
        op: ReduceOp::Sum,
        root: root_for(n, c),
    });
}

#[test]
fn broadcast_matrix() {
    matrix(|n, c| OpKind::Broadcast {
        root: root_for(n, c),
    });
}

#[test]
fn allgather_matrix() {
    matrix(|_, _| OpKind::Allgather);
}

#[test]
fn gather_matrix() {
    matrix(|n, c| OpKind::Gather {
        root: root_for(n, c),
    });
}

#[test]
fn reduce_scatter_matrix() {
    matrix(|_, _| OpKind::ReduceScatter(ReduceOp::Sum));
}

#[test]
fn alltoall_matrix() {
    matrix(|_, _| OpKind::Alltoall);
}

/// Every dtype with every reduction it supports, on every strategy.
#[test]
fn dtype_matrix() {
    let mut seed = 1000;
    for n in [1, 2, 3, 5, 8, 16] {
        for peers in layouts(n) {
            for strategy in Strategy::ALL {
                for dtype in DType::ALL {
                    for op in ReduceOp::ALL.into_iter().filter(|o| o.supports(dtype)) {
                        for kind in [
                            OpKind::Allreduce(op),
                            OpKind::ReduceScatter(op),
                            OpKind::Reduce {
                                op,
                                root: Rank((n - 1) as u32),
                            },
                        ] {
                            seed += 1;
                            let spec = OpSpec {
                                kind,
                                dtype,
                                count: 77,
                            };
                            check(&peers, strategy, spec, 40, seed);
                        }
                    }
                }
            }
        }
    }
}

/// The same seed gives the same run; other seeds deliver in other orders
/// but agree on the result.
#[test]
fn many_seeds_one_result() {
    let peers = PeerList::with_hosts(&[2, 3, 2]);
    for seed in 0..64 {
        for strategy in [
            Strategy::Ring,
            Strategy::MultiBinaryTreeStar,
            Strategy::Clique,
        ] {
            let spec = OpSpec {
                kind: OpKind::Allreduce(ReduceOp::Sum),
                dtype: DType::I32,
                count: 333,
            };
            check(&peers, strategy, spec, 64, seed);
        }
    }
}

/// Plans of more than 4 GiB: offsets are `usize`, nothing wraps. Only the
/// plans are built and walked (no buffers): every byte of the op is sent
/// and received by the ring exactly as often as a ring requires.
#[test]
fn plans_beyond_four_gib() {
    let count = (4usize << 30) + 12_345;
    let peers = PeerList::local(2);
    for kind in [
        OpKind::Allreduce(ReduceOp::Sum),
        OpKind::Broadcast { root: Rank(1) },
    ] {
        let spec = OpSpec {
            kind,
            dtype: DType::U8,
            count,
        };
        let topo = |root: Root| Arc::new(Strategy::Ring.resolve(&peers, root, count));
        let mut plan = build(&PlanInput {
            spec: &spec,
            me: Rank(if matches!(kind, OpKind::Broadcast { .. }) {
                1
            } else {
                0
            }),
            size: 2,
            chunk_bytes: 256 << 20,
            topology: &topo,
        })
        .unwrap();
        let mut sent = 0usize;
        let mut max_end = 0usize;
        let mut empty: Vec<u8> = Vec::new();
        while let Some(tx) = plan.poll_transmit() {
            sent += tx.range.len();
            max_end = max_end.max(tx.range.end);
            // the plan never looks at the buffer for sends; an empty one is
            // enough as long as no receive is applied
            plan.handle_sent(tx.id, &mut empty);
        }
        assert_eq!(max_end, count, "{kind:?}");
        match kind {
            // rank 0 of a 2-ring sends segment 1 of each chunk (the
            // reduce-scatter step) and nothing more before receiving
            OpKind::Allreduce(_) => {
                let want: usize = kungfu_collectives::plan::chunks(count, 256 << 20)
                    .map(|c| c.len() / 2)
                    .sum();
                assert_eq!(sent, want);
            }
            _ => assert_eq!(sent, count),
        }
    }
}

/// Hostile frames never panic a plan: random (from, chunk, step, length)
/// frames are refused with an error or accepted only where the plan
/// expects exactly that frame, and the plan stays consistent.
#[test]
fn random_frames_never_panic_a_plan() {
    let mut rng = SeededRng::new(77);
    let peers = PeerList::with_hosts(&[2, 3]);
    for strategy in Strategy::ALL {
        for kind in [
            OpKind::Allreduce(ReduceOp::Sum),
            OpKind::Gather { root: Rank(3) },
            OpKind::Alltoall,
        ] {
            let spec = OpSpec {
                kind,
                dtype: DType::F32,
                count: 50,
            };
            let n = peers.len();
            let topo = |root: Root| Arc::new(strategy.resolve(&peers, root, 200));
            let me = Rank(1);
            let mut plan = build(&PlanInput {
                spec: &spec,
                me,
                size: n,
                chunk_bytes: 64,
                topology: &topo,
            })
            .unwrap();
            let mut work = spec.init_work(&reference::inputs(&spec, n)[1], me, n);
            for _ in 0..2000 {
                let from = Rank(rng.below(n as u64 + 2) as u32);
                let chunk = rng.below(40) as u32;
                let step = rng.below(12) as u16;
                let len = rng.below(300) as usize;
                let _ =
                    plan.handle_frame(from, chunk, step, Bytes::from(vec![7u8; len]), &mut work);
                while let Some(tx) = plan.poll_transmit() {
                    assert!(tx.range.end <= work.len());
                    plan.handle_sent(tx.id, &mut work);
                }
            }
            assert!(!plan.waiting_for().contains(&me));
        }
    }
}

/// Ranks that reduce the same values themselves (recursive doubling) must
/// still agree to the bit, signed zeros included (`max(0.0, -0.0)` is not
/// symmetric), except for the payload and sign of NaNs: the compiler
/// treats float `+` as commutative, and x86 keeps the payload of whichever
/// operand comes first, so only NaN-ness is guaranteed (as in MPI).
#[test]
fn every_rank_gets_the_same_bits() {
    let specials = [
        0.0f32,
        -0.0,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fc0_1234),
        1.0,
    ];
    for n in [2usize, 3, 4, 5, 8] {
        let peers = PeerList::local(n);
        for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum] {
            let spec = OpSpec {
                kind: OpKind::Allreduce(op),
                dtype: DType::F32,
                count: 36,
            };
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    let v: Vec<f32> = (0..36)
                        .map(|i| specials[(i + r * (i / 6 + 1)) % 6])
                        .collect();
                    bytemuck::cast_slice(&v).to_vec()
                })
                .collect();
            for strategy in Strategy::ALL {
                for seed in 0..4 {
                    let outs = simulate(&peers, strategy, &spec, &inputs, 40, seed);
                    let bits = |o: &Option<Vec<u8>>| -> Vec<u32> {
                        let v: Vec<f32> = bytemuck::pod_collect_to_vec(o.as_ref().unwrap());
                        v.iter()
                            .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
                            .collect()
                    };
                    let first = bits(&outs[0]);
                    for (r, o) in outs.iter().enumerate() {
                        assert_eq!(bits(o), first, "{strategy} {op} n={n} rank {r}");
                    }
                }
            }
        }
    }
}
