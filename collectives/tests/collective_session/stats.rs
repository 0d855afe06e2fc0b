//! Op and per-peer statistics.

use super::*;

/// Completed ops are counted by the strategy they ran on (AUTO resolved),
/// so monitors can compare the rates of strategies.
#[test]
fn op_stats_count_ops_by_strategy() {
    rt().block_on(async {
        let n = 3;
        let ss = sessions(n, Strategy::Auto, 11, LONG);
        let run = |name: &'static str, count: usize| {
            let hs: Vec<_> = ss
                .iter()
                .map(|s| s.allreduce(name, &vec![1.0f32; count], ReduceOp::Sum))
                .collect();
            async move {
                for h in hs {
                    assert!(h.await.unwrap().iter().all(|&x| x == 3.0));
                }
            }
        };
        for _ in 0..5 {
            run("small", 10).await; // 40 B: recursive doubling
        }
        for _ in 0..2 {
            run("large", 1 << 16).await; // 256 KiB: ring
        }
        for s in &ss {
            let st = s.op_stats();
            let get = |x: Strategy| st.iter().find(|(k, _)| *k == x).map(|(_, o)| *o);
            let rd = get(Strategy::RecursiveDoubling).expect("small ops");
            let ring = get(Strategy::Ring).expect("large ops");
            assert_eq!((rd.ops, rd.bytes), (5, 5 * 40));
            assert_eq!((ring.ops, ring.bytes), (2, 2 << 18));
            assert!(ring.rate() > 0.0 && rd.mean_latency().is_some());
            assert_eq!(st.len(), 2, "{st:?}");
            s.reset_op_stats();
            s.set_strategy(Strategy::Star);
        }
        run("after", 10).await;
        for s in &ss {
            let st = s.op_stats();
            assert_eq!(st.len(), 1, "{st:?}");
            assert_eq!((st[0].0, st[0].1.ops), (Strategy::Star, 1));
        }
    });
}

/// Per-peer statistics show a straggler: rank 2 starts every op `LATE`
/// after rank 0 has started it (rank 0 says when, through a channel), so
/// rank 0 cannot see rank 2's last frame sooner than `LATE` into the op,
/// while rank 1's arrive as soon as the two are scheduled: a gap of an
/// order of magnitude or more, which load on the machine does not close.
#[test]
fn peer_stats_show_a_straggler() {
    const LATE: Duration = Duration::from_millis(300);
    rt().block_on(async {
        let ss = sessions(3, Strategy::Star, 5, LONG);
        let (started, start) = tokio::sync::mpsc::unbounded_channel();
        let mut start = Some(start);
        let mut tasks = Vec::new();
        for s in ss.clone() {
            let started = started.clone();
            let mut start = if s.rank() == Rank(2) {
                start.take()
            } else {
                None
            };
            tasks.push(tokio::spawn(async move {
                for i in 0..4 {
                    if let Some(start) = start.as_mut() {
                        let op = tokio::time::timeout(LONG, start.recv()).await;
                        assert_eq!(op, Ok(Some(i)), "rank 0 started op {i}");
                        tokio::time::sleep(LATE).await;
                    }
                    // the op starts (and its clock runs) at the call
                    let h = s.allreduce(&format!("g{i}"), &[1.0f32; 4096], ReduceOp::Sum);
                    if s.rank() == Rank(0) {
                        started.send(i).unwrap();
                    }
                    h.await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let ps = ss[0].peer_stats();
        assert_eq!(ps.len(), 3);
        assert_eq!(ps[0].frames, 0, "nothing from itself");
        for p in &ps[1..] {
            assert_eq!(p.ops, 4);
            assert_eq!(p.bytes, 4 * 4096 * 4);
            assert!(p.rate() > 0.0);
        }
        let (l1, l2) = (ps[1].mean_latency().unwrap(), ps[2].mean_latency().unwrap());
        assert!(l2 >= LATE, "rank 2 {l2:?}");
        assert!(l2 > 3 * l1, "rank 1 {l1:?}, rank 2 {l2:?}");
        ss[0].reset_op_stats();
        assert_eq!(ss[0].peer_stats()[2], Default::default());
    });
}
