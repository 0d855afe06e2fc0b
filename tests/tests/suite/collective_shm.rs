//! The collectives over the shared-memory transport, 4 ranks in one process.

use kungfu_collectives::{DType, OpKind, OpSpec, ReduceOp, Session, SessionConfig};
use kungfu_tests::{run_exact, shm_cluster};
use kungfu_topology::{PeerList, Rank, Strategy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_every_strategy_over_shm() {
    let n = 4;
    let kinds = [
        OpKind::Allreduce(ReduceOp::Sum),
        OpKind::Reduce {
            op: ReduceOp::Max,
            root: Rank(2),
        },
        OpKind::Broadcast { root: Rank(1) },
        OpKind::Allgather,
        OpKind::Gather { root: Rank(3) },
        OpKind::ReduceScatter(ReduceOp::Sum),
        OpKind::Alltoall,
    ];
    for strategy in Strategy::ALL {
        let ts = shm_cluster(n, 64 << 10).await;
        let ss: Vec<_> = ts
            .into_iter()
            .map(|t| {
                let cfg = SessionConfig {
                    strategy,
                    chunk_bytes: 32 << 10,
                    ..SessionConfig::default()
                };
                Session::new(t, PeerList::local(n), cfg).unwrap()
            })
            .collect();
        for (k, kind) in kinds.iter().enumerate() {
            for count in [0usize, 7, 100_003] {
                let spec = OpSpec {
                    kind: *kind,
                    dtype: DType::F32,
                    count,
                    check: 0,
                };
                run_exact(&ss, &format!("{strategy}/op{k}/{count}"), spec).await;
            }
        }
        // frames were reduced or copied straight out of the rings
        let lent: u64 = ss.iter().map(|s| s.transport().frames_lent()).sum();
        assert!(lent > 0, "{strategy}: no frame was consumed in place");
    }
}

/// Frames lent in place in one or two pieces (a ring of 4 KiB wraps
/// often), of a 2-byte type at odd offsets (pieces may split an element:
/// those take the owned path): values stay exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_applied_from_wrapping_rings_stay_exact() {
    let n = 3;
    let ts = shm_cluster(n, 4096).await;
    let ss: Vec<_> = ts
        .into_iter()
        .map(|t| {
            let cfg = SessionConfig {
                strategy: Strategy::Ring,
                chunk_bytes: 1001,
                // the message path: its frames are what this tests
                fast_max_bytes: 0,
                ..SessionConfig::default()
            };
            Session::new(t, PeerList::local(n), cfg).unwrap()
        })
        .collect();
    for (i, count) in [1usize, 333, 5001, 20_011].into_iter().enumerate() {
        for dtype in [DType::BF16, DType::U8, DType::F64] {
            let spec = OpSpec {
                kind: OpKind::Allreduce(ReduceOp::Sum),
                dtype,
                count,
                check: 0,
            };
            run_exact(&ss, &format!("w{i}/{dtype}"), spec).await;
        }
    }
    let lent: u64 = ss.iter().map(|s| s.transport().frames_lent()).sum();
    assert!(lent > 0, "no frame was consumed in place");
}

/// Chunks larger than a ring (1 MiB chunks, 64 KiB rings): such a frame
/// can never go whole, so it is streamed by the writer thread instead of
/// waiting for room it will never have (these ops used to hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_larger_than_the_ring_are_streamed() {
    let n = 3;
    let ss: Vec<_> = shm_cluster(n, 64 << 10)
        .await
        .into_iter()
        .map(|t| {
            let cfg = SessionConfig {
                op_timeout: std::time::Duration::from_secs(20),
                ..SessionConfig::default()
            };
            Session::new(t, PeerList::local(n), cfg).unwrap()
        })
        .collect();
    let kinds = [
        OpKind::Broadcast { root: Rank(2) },
        OpKind::Allreduce(ReduceOp::Sum),
        OpKind::Allgather,
    ];
    for (k, kind) in kinds.into_iter().enumerate() {
        let spec = OpSpec {
            kind,
            dtype: DType::F32,
            count: 100_000,
            check: 0,
        };
        run_exact(&ss, &format!("big{k}"), spec).await;
    }
}
