//! The host fast path (small ops through the shared-memory lanes): exact
//! results, any order of issue past the lanes' window, callbacks with no
//! waiter, and clear errors for mismatched, missing and lost ranks.

use std::time::Duration;

use kungfu_collectives::{
    reference, CollectiveError, DType, FastLarge, OpKind, OpSpec, ReduceOp, Session, SessionConfig,
    LARGE_ALLREDUCE_FROM,
};
use kungfu_tests::{run_exact, shm_cluster};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::shm::cma;
use kungfu_transport::shm::lane::{SLOTS, SLOT_BYTES};
use kungfu_transport::shm::ShmTransport;

/// Rings of 4 MiB, the default (frames of the message path must fit).
async fn sessions(n: usize, cfg: SessionConfig) -> Vec<Session<ShmTransport>> {
    shm_cluster(n, 4 << 20)
        .await
        .into_iter()
        .map(|t| Session::new(t, PeerList::local(n), cfg.clone()).unwrap())
        .collect()
}

/// The fast path on, up to a whole slot, and larger ops by cross-memory
/// attach.
fn fast() -> SessionConfig {
    SessionConfig {
        fast_max_bytes: SLOT_BYTES,
        fast_large: FastLarge::All,
        ..SessionConfig::default()
    }
}

fn ring() -> SessionConfig {
    SessionConfig {
        strategy: Strategy::Ring,
        ..fast()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_ops_are_exact_and_take_the_fast_path() {
    let n = 3;
    let ss = sessions(n, ring()).await;
    let kinds = [
        OpKind::Allreduce(ReduceOp::Sum),
        OpKind::Allreduce(ReduceOp::Max),
        OpKind::Broadcast { root: Rank(2) },
        OpKind::Allgather,
    ];
    for (k, kind) in kinds.iter().enumerate() {
        for (dtype, count) in [(DType::F32, 0), (DType::F32, 1), (DType::F64, 1000)]
            .into_iter()
            .chain([(DType::BF16, SLOT_BYTES / 2), (DType::U8, SLOT_BYTES + 1)])
        {
            let spec = OpSpec {
                kind: *kind,
                dtype,
                count,
                check: 0,
            };
            let name = format!("k{k}/{dtype}/{count}");
            for out in run_exact(&ss, &name, spec).await {
                // the fast path runs every rank's block to every rank
                // (larger ops by cross-memory attach, where permitted)
                let fast = count * dtype.size() <= SLOT_BYTES || cma::available();
                let want = if fast {
                    Strategy::Clique
                } else {
                    Strategy::Ring
                };
                assert_eq!(out.strategy(), want, "{name}");
            }
        }
    }
}

/// Allreduce above the direct path's size and up to a slot per slice
/// splits (reduce-scatter, then allgather, through the lanes): exact for
/// every op and uneven counts, with several in flight issued in a
/// different order on every rank; one slice over a slot, or a buffer over
/// `fast_max_bytes`, takes the message path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mid_size_allreduce_splits_and_is_exact() {
    let cfg = SessionConfig {
        fast_max_bytes: 4 * SLOT_BYTES,
        fast_large: FastLarge::Off,
        ..ring()
    };
    for n in [2, 3, 4] {
        let ss = sessions(n, cfg.clone()).await;
        let specs = [
            (ReduceOp::Sum, DType::F32, 24 * 1024 + 1, true),
            (ReduceOp::Avg, DType::F64, n * SLOT_BYTES / 8 - 1, true),
            (ReduceOp::Max, DType::BF16, n * SLOT_BYTES / 2, true),
            (ReduceOp::Prod, DType::I32, 30_001, true),
            (ReduceOp::Min, DType::U8, n * SLOT_BYTES + 1, false),
            (ReduceOp::Avg, DType::F32, n * SLOT_BYTES / 4 - 3, true),
            (ReduceOp::Sum, DType::F16, 2 * SLOT_BYTES + 1, false),
        ]
        .map(|(op, dtype, count, fast)| {
            let spec = OpSpec {
                kind: OpKind::Allreduce(op),
                dtype,
                count,
                check: 0,
            };
            (spec, reference::inputs(&spec, n), fast)
        });
        let mut hs: Vec<Vec<_>> = (0..n).map(|_| Vec::new()).collect();
        for (r, s) in ss.iter().enumerate() {
            for k in 0..specs.len() {
                let i = (k + r) % specs.len();
                let (spec, inputs, _) = &specs[i];
                hs[r].push((i, s.submit(&format!("mid{i}"), *spec, &inputs[r])));
            }
        }
        for (r, hs) in hs.into_iter().enumerate() {
            for (i, h) in hs {
                let (spec, inputs, fast) = &specs[i];
                let name = format!("n={n} {}", spec.describe());
                let out = h.await.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(
                    out.bytes().map(<[u8]>::to_vec) == reference::expected(spec, r, inputs),
                    "{name}: rank {r} wrong"
                );
                let want = if *fast {
                    Strategy::Clique
                } else {
                    Strategy::Ring
                };
                assert_eq!(out.strategy(), want, "{name}");
            }
        }
    }
}

/// Rank 0 issues 4 windows' worth of ops in one order, rank 1 in the
/// reverse order, waiting on each before the next: the lanes spill and
/// every op completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reversed_issue_order_past_the_window_completes() {
    let ss = sessions(2, fast()).await;
    let m = 4 * SLOTS;
    let mut first = Vec::new();
    for i in 0..m {
        first.push(ss[0].allreduce(&format!("o{i}"), &[i as f32, 1.0], ReduceOp::Sum));
    }
    for i in (0..m).rev() {
        let v = ss[1]
            .allreduce(&format!("o{i}"), &[i as f32, 2.0], ReduceOp::Sum)
            .await
            .unwrap();
        assert_eq!(v, vec![2.0 * i as f32, 3.0]);
    }
    for (i, h) in first.into_iter().enumerate() {
        assert_eq!(h.await.unwrap(), vec![2.0 * i as f32, 3.0]);
    }
}

/// Ops started with a callback and never waited on complete through the
/// progress thread, interleaved with large ops on the message path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_complete_without_a_waiter_beside_large_ops() {
    let n = 2;
    let ss = sessions(n, fast()).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let big = vec![1.0f32; 100_000];
    let mut larges = Vec::new();
    for round in 0..20 {
        for (r, s) in ss.iter().enumerate() {
            let tx = tx.clone();
            let spec = OpSpec {
                kind: OpKind::Allreduce(ReduceOp::Sum),
                dtype: DType::U32,
                count: 1,
                check: 0,
            };
            let input = (r as u32 + round).to_le_bytes();
            s.submit_with_callback(
                &format!("cb{round}"),
                spec,
                &input,
                Box::new(move |out| drop(tx.send((round, out.map(|o| o.to_vec::<u32>()))))),
            );
            larges.push(s.allreduce(&format!("big{round}"), &big, ReduceOp::Sum));
        }
    }
    drop(tx);
    let mut got = 0;
    while let Some((round, out)) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a callback within 30 s")
    {
        assert_eq!(out.unwrap(), vec![1 + 2 * round]);
        got += 1;
    }
    assert_eq!(got, 2 * 20);
    for h in larges {
        assert!(h.await.unwrap().iter().all(|&x| x == 2.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_missing_and_lost_ranks_are_clear_errors() {
    let cfg = SessionConfig {
        op_timeout: Duration::from_millis(600),
        ..fast()
    };
    let ss = sessions(3, cfg).await;
    // the same name with another count: a mismatch on both sides
    let a = ss[0].allreduce("m", &[1.0f32; 4], ReduceOp::Sum);
    let b = ss[1].allreduce("m", &[1.0f32; 5], ReduceOp::Sum);
    let c = ss[2].allreduce("m", &[1.0f32; 4], ReduceOp::Sum);
    let (a, b, c) = (a.await, b.await, c.await);
    assert!(matches!(b, Err(CollectiveError::Mismatch { .. })), "{b:?}");
    for r in [a, c] {
        assert!(matches!(r, Err(CollectiveError::Mismatch { .. })), "{r:?}");
    }
    // the same spec under another check (a shape [2, 2] against [4])
    let spec = |check| OpSpec {
        kind: OpKind::Allreduce(ReduceOp::Sum),
        dtype: DType::U8,
        count: 4,
        check,
    };
    let hs: Vec<_> = (0..3)
        .map(|r| ss[r].submit("checked", spec(if r == 1 { 9 } else { 8 }), &[1; 4]))
        .collect();
    for h in hs {
        let r = h.await;
        assert!(matches!(r, Err(CollectiveError::Mismatch { .. })), "{r:?}");
    }
    let hs: Vec<_> = (0..3)
        .map(|r| ss[r].submit("agreed", spec(8), &[1; 4]))
        .collect();
    for h in hs {
        assert_eq!(h.await.unwrap().bytes().unwrap(), &[3; 4]);
    }
    // a rank that never joins: a timeout naming it, or the abort of the
    // rank that timed out first, saying why
    let a = ss[0].barrier("late");
    let b = ss[1].barrier("late");
    let mut timed_out = 0;
    for r in [a.await, b.await] {
        match r {
            Err(CollectiveError::Timeout { waiting, .. }) => {
                assert_eq!(waiting, vec![Rank(2)]);
                timed_out += 1;
            }
            Err(CollectiveError::Aborted { reason, .. }) => {
                assert!(reason.contains("timed out waiting for rank 2"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(timed_out >= 1);
    // a rank that is gone: its peers fail at once, naming it
    ss[2].shutdown();
    let t = std::time::Instant::now();
    let r = ss[0].allreduce("gone", &[1u8], ReduceOp::Max).await;
    assert!(
        matches!(
            &r,
            Err(CollectiveError::PeerLost { peer: Rank(2), .. })
                | Err(CollectiveError::Transport { .. })
        ),
        "{r:?}"
    );
    assert!(
        t.elapsed() < Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
}

/// Broadcasts on which the ranks disagree about the root (each its own,
/// or one odd rank), in a slot and by cross-memory attach: every rank
/// fails with a mismatch, the roots too (a root that only posted would
/// complete, and one that names itself alone would keep its own data).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreeing_broadcast_roots_fail_on_every_rank() {
    assert!(cma::available(), "process_vm_readv is not permitted here");
    let n = 3;
    let cfg = SessionConfig {
        op_timeout: Duration::from_secs(20),
        ..fast()
    };
    let ss = sessions(n, cfg).await;
    let t = std::time::Instant::now();
    // (what, each rank's root)
    let cases: [(&str, [u32; 3]); 2] = [("own", [0, 1, 2]), ("odd", [0, 0, 2])];
    for count in [16, SLOT_BYTES + 1] {
        for (what, roots) in cases {
            let name = format!("roots/{what}/{count}");
            let hs: Vec<_> = ss
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    let spec = OpSpec {
                        kind: OpKind::Broadcast {
                            root: Rank(roots[r]),
                        },
                        dtype: DType::U8,
                        count,
                        check: 0,
                    };
                    s.submit(&name, spec, &vec![r as u8 + 1; count])
                })
                .collect();
            for (r, h) in futures_join(hs).await.into_iter().enumerate() {
                assert!(
                    matches!(&h, Err(CollectiveError::Mismatch { .. })),
                    "{name}: rank {r}: {h:?}"
                );
            }
        }
    }
    // long before the op deadline: the mismatch is seen, not waited out
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// `fast_max_bytes: 0` keeps every op on the message path, with the same
/// results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_path_can_be_turned_off() {
    let cfg = SessionConfig {
        fast_max_bytes: 0,
        strategy: Strategy::Star,
        ..SessionConfig::default()
    };
    let ss = sessions(2, cfg).await;
    let (a, b) = (
        ss[0].allreduce("x", &[1.5f64], ReduceOp::Sum),
        ss[1].allreduce("x", &[2.0f64], ReduceOp::Sum),
    );
    assert_eq!(a.await.unwrap(), vec![3.5]);
    assert_eq!(b.await.unwrap(), vec![3.5]);
    let spec = OpSpec {
        kind: OpKind::Allreduce(ReduceOp::Sum),
        dtype: DType::F32,
        count: 1,
        check: 0,
    };
    let h = ss[0].submit("y", spec, &[0; 4]);
    let h1 = ss[1].submit("y", spec, &[0; 4]);
    assert_eq!(h.await.unwrap().strategy(), Strategy::Star);
    drop(h1.await);
}

/// A rank on the message path and one on the fast path for the same op
/// (their settings differ): the frame that reaches the fast rank names the
/// mismatch, and its abort tells the other rank; neither hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_on_the_other_path_is_a_mismatch() {
    let ts = shm_cluster(2, 4 << 20).await;
    let cfgs = [
        fast(),
        SessionConfig {
            fast_max_bytes: 0,
            ..SessionConfig::default()
        },
    ];
    let ss: Vec<_> = ts
        .into_iter()
        .zip(cfgs)
        .map(|(t, c)| Session::new(t, PeerList::local(2), c).unwrap())
        .collect();
    let t = std::time::Instant::now();
    let a = ss[0].allreduce("split", &[1.0f32; 8], ReduceOp::Sum);
    let b = ss[1].allreduce("split", &[1.0f32; 8], ReduceOp::Sum);
    for r in [a.await, b.await] {
        assert!(matches!(r, Err(CollectiveError::Mismatch { .. })), "{r:?}");
    }
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// The defaults: an allreduce that splits into a slot per rank takes the
/// lanes, larger ones the rings up to `LARGE_ALLREDUCE_FROM`; that and
/// larger broadcast and allgather take cross-memory attach where the host
/// permits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_large_ops_take_cross_memory_attach_and_mid_allreduce_the_rings() {
    let n = 2;
    let ss = sessions(n, SessionConfig::default()).await;
    let copies = if cma::available() {
        Strategy::Clique
    } else {
        Strategy::Ring
    };
    for (k, kind, count, want) in [
        (
            0,
            OpKind::Allreduce(ReduceOp::Sum),
            2 * SLOT_BYTES / 4,
            Strategy::Clique,
        ),
        (
            1,
            OpKind::Allreduce(ReduceOp::Sum),
            2 * SLOT_BYTES / 4 + 1,
            Strategy::Ring,
        ),
        (2, OpKind::Broadcast { root: Rank(1) }, 3 << 18, copies),
        (3, OpKind::Allgather, 3 << 18, copies),
        (
            4,
            OpKind::Allreduce(ReduceOp::Sum),
            LARGE_ALLREDUCE_FROM / 4 - 1,
            Strategy::Ring,
        ),
        (
            5,
            OpKind::Allreduce(ReduceOp::Sum),
            LARGE_ALLREDUCE_FROM / 4,
            copies,
        ),
    ] {
        let spec = OpSpec {
            kind,
            dtype: DType::F32,
            count,
            check: 0,
        };
        for out in run_exact(&ss, &format!("d{k}"), spec).await {
            assert_eq!(out.strategy(), want, "{}", spec.describe());
        }
    }
}

/// Large ops by cross-memory attach: every kind, sizes that do not split
/// evenly, several in flight in different orders, the caller's own memory
/// (in place), against the reference and the message path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_ops_by_cross_memory_attach_are_exact() {
    assert!(cma::available(), "process_vm_readv is not permitted here");
    let n = 3;
    let ss = sessions(n, fast()).await;
    let kinds = [
        OpKind::Allreduce(ReduceOp::Sum),
        OpKind::Allreduce(ReduceOp::Avg),
        OpKind::Allreduce(ReduceOp::Min),
        OpKind::Broadcast { root: Rank(1) },
        OpKind::Allgather,
    ];
    for (k, kind) in kinds.iter().enumerate() {
        for count in [SLOT_BYTES / 4 + 1, 300_001] {
            let spec = OpSpec {
                kind: *kind,
                dtype: DType::F32,
                count,
                check: 0,
            };
            let inputs = reference::inputs(&spec, n);
            // two ops in flight, issued in opposite orders on odd ranks
            let names = [format!("L{k}/{count}/a"), format!("L{k}/{count}/b")];
            let mut hs = Vec::new();
            for (r, s) in ss.iter().enumerate() {
                let order: Vec<usize> = if r % 2 == 0 { vec![0, 1] } else { vec![1, 0] };
                for i in order {
                    hs.push((r, i, s.submit(&names[i], spec, &inputs[r])));
                }
            }
            for (r, i, h) in hs {
                let out = h.await.unwrap_or_else(|e| panic!("{}: {e}", names[i]));
                assert_eq!(out.strategy(), Strategy::Clique);
                assert!(
                    out.bytes().map(<[u8]>::to_vec) == reference::expected(&spec, r, &inputs),
                    "{}: rank {r} wrong",
                    names[i]
                );
            }
        }
    }
    // in place, in the callers' memory
    let mut bufs: Vec<Vec<f64>> = (0..n).map(|r| vec![r as f64 + 0.5; 100_000]).collect();
    let futs: Vec<_> = ss
        .iter()
        .zip(bufs.iter_mut())
        .map(|(s, b)| s.allreduce_in_place("inplace", b, ReduceOp::Sum))
        .collect();
    for r in futures_join(futs).await {
        r.unwrap();
    }
    for b in &bufs {
        assert!(b.iter().all(|&x| x == 0.5 + 1.5 + 2.5));
    }
}

/// The gradient monitors' squares (`allreduce_sum_with_norms`): summed
/// in the reduction on the direct and split ways and by cross-memory
/// attach, by the spare element and a pass after the op where a split
/// op's slices fill a slot and on the message path; at 2 and 3 ranks and
/// uneven counts the sum has the plain allreduce's bits, the squares
/// match an f64 reference and have the same bits on every rank. On the
/// split and large ways a rank that asks for them beside one that does
/// not fails with a mismatch (on the direct way both succeed: nothing
/// differs on the wire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reductions_compute_the_monitors_squares() {
    let split = SessionConfig {
        fast_max_bytes: 4 * SLOT_BYTES,
        fast_large: FastLarge::Off,
        ..fast()
    };
    let mut cases = vec![
        (2, split.clone(), 40_000, true),
        (3, split.clone(), 100_003, true),
        (2, fast(), 1000, true),
        (3, fast(), 1001, true),
        // slices that fill a slot leave no room for the squares
        (2, split.clone(), 2 * SLOT_BYTES / 4, false),
        // the message path has none
        (
            2,
            SessionConfig {
                fast_max_bytes: 0,
                ..fast()
            },
            1000,
            false,
        ),
    ];
    if cma::available() {
        cases.push((2, fast(), 300_001, true));
        cases.push((3, fast(), 300_001, true));
    }
    for (n, cfg, count, fused) in cases {
        let what = format!("n={n} count={count}");
        let ss = sessions(n, cfg).await;
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count,
            check: 0,
        };
        assert!(ss.iter().all(|s| s.fuses_norms(&spec) == fused), "{what}");
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                (0..count)
                    .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.01 - 0.5)
                    .collect()
            })
            .collect();
        let mut plain = inputs.clone();
        let futs = ss
            .iter()
            .zip(plain.iter_mut())
            .map(|(s, b)| s.allreduce_in_place("plain", b, ReduceOp::Sum));
        for r in futures_join(futs.collect()).await {
            r.unwrap();
        }
        let mut bufs = inputs.clone();
        let futs = ss
            .iter()
            .zip(bufs.iter_mut())
            .map(|(s, b)| s.allreduce_sum_with_norms("monitored", b));
        let got: Vec<_> = futures_join(futs.collect())
            .await
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{what}: {e}")))
            .collect();
        // the last element is the monitors' spare: 0 where the reduction
        // summed the squares, else the sum of the ranks' squared norms
        let last = count - 1;
        for b in &bufs {
            assert!(b[..last] == plain[0][..last], "{what}: the sum differs");
            assert_eq!(b[last] == 0.0, fused, "{what}: spare {}", b[last]);
        }
        let sq = |v: &[f32]| v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
        let want_inputs: f64 = inputs.iter().map(|v| sq(&v[..last])).sum();
        let want_result = sq(&plain[0][..last]);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b;
        for q in &got {
            assert!(close(q.inputs, want_inputs), "{what}: {q:?}, {want_inputs}");
            assert!(close(q.result, want_result), "{what}: {q:?}, {want_result}");
            assert_eq!(*q, got[0], "{what}: ranks disagree");
        }
    }
    // one rank asks for them, the other does not: both fail, at once (on
    // the split way and by cross-memory attach)
    let mut odd = vec![(split, 40_000)];
    if cma::available() {
        odd.push((fast(), 300_001));
    }
    for (cfg, count) in odd {
        let ss = sessions(2, cfg).await;
        let mut a = vec![1.0f32; count];
        let mut b = vec![1.0f32; count];
        let (ra, rb) = tokio::join!(
            tokio::time::timeout(
                Duration::from_secs(20),
                ss[0].allreduce_sum_with_norms("odd", &mut a)
            ),
            tokio::time::timeout(
                Duration::from_secs(20),
                ss[1].allreduce_in_place("odd", &mut b, ReduceOp::Sum)
            ),
        );
        let ra = ra.expect("rank 0 hung");
        let rb = rb.expect("rank 1 hung");
        assert!(
            matches!(ra, Err(CollectiveError::Mismatch { .. })),
            "{count}: {ra:?}"
        );
        assert!(
            matches!(rb, Err(CollectiveError::Mismatch { .. })),
            "{count}: {rb:?}"
        );
    }
}

/// `GradientMonitor` takes the squares from the reduction where it can:
/// its estimates over a few steps match those of the two passes over the
/// gradient (the fast path off), at 2 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gradient_monitor_reads_the_fused_squares() {
    use kungfu_adaptation::GradientMonitor;
    let split = SessionConfig {
        fast_max_bytes: 4 * SLOT_BYTES,
        fast_large: FastLarge::Off,
        ..fast()
    };
    let passes = SessionConfig {
        fast_max_bytes: 0,
        ..fast()
    };
    let count = 50_001; // the gradient and the monitors' spare element
    let mut estimates = Vec::new();
    for (cfg, fused) in [(split, true), (passes, false)] {
        let ss = sessions(2, cfg).await;
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count,
            check: 0,
        };
        assert_eq!(ss[0].fuses_norms(&spec), fused);
        let mut mons = [GradientMonitor::new(0.5, 1), GradientMonitor::new(0.5, 1)];
        for step in 0..4usize {
            let mut bufs: Vec<Vec<f32>> = (0..2)
                .map(|r| {
                    (0..count)
                        .map(|i| ((i * 3 + r * 11 + step * 5) % 37) as f32 * 0.1 - 1.7)
                        .collect()
                })
                .collect();
            let futs = ss
                .iter()
                .zip(mons.iter_mut())
                .zip(bufs.iter_mut())
                .map(|((s, m), b)| m.allreduce_sum(s, "grad", b, 8.0));
            for r in futures_join(futs.collect()).await {
                assert!(r.unwrap(), "every step is monitored");
            }
        }
        let e = mons[0].noise_estimate.expect("an estimate");
        assert_eq!(Some(e), mons[1].noise_estimate, "ranks disagree");
        estimates.push((e, mons[0].variance.expect("a variance")));
    }
    let ((a, va), (b, vb)) = (estimates[0], estimates[1]);
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-4 * y.abs().max(1e-9);
    assert!(close(a.g2, b.g2) && close(a.trace, b.trace), "{a:?} {b:?}");
    assert!(close(va, vb), "{va} {vb}");
}

async fn futures_join<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let mut pinned: Vec<_> = fs.into_iter().map(Box::pin).collect();
    // all must run together: poll them round-robin until each is done
    let mut done: Vec<Option<F::Output>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (f, d) in pinned.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *d = Some(v),
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(done.into_iter().map(|d| d.expect("done")));
    out
}
