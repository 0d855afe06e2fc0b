//! Swapping the peer list: draining, deferring, agreeing, the epoch, and
//! a swap given up half-way.

use super::*;

/// Polls `f` once (with this task's waker): whatever it does up to its
/// first wait has happened when this returns.
async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
}

/// Waits on a test barrier, with a deadline.
async fn meet(b: &tokio::sync::Barrier) {
    tokio::time::timeout(LONG, b.wait())
        .await
        .expect("every rank reaches the barrier");
}

#[test]
fn swap_drains_defers_agrees_and_advances_the_epoch() {
    rt().block_on(async {
        let n = 3;
        let ss = sessions(n, Strategy::Star, 11, LONG);
        let ts: Vec<_> = ss.iter().map(|s| s.transport().clone()).collect();
        // Two barriers of the test order the ranks so that every rank's
        // swap is provably under way while it starts the `during` ops (no
        // sleeps): ranks 1 and 2 start `before` and their swap, whose drain
        // waits for `before`, which needs rank 0, which starts only after
        // barrier A; rank 0's swap cannot finish before barrier B, since
        // the others' swaps only reach their consensus when polled again,
        // after B, and every rank starts its `during` ops before B.
        let a = Arc::new(tokio::sync::Barrier::new(n));
        let b = Arc::new(tokio::sync::Barrier::new(n));
        let spec = |count| OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count,
            check: 0,
        };
        let input = |v: f32, count: usize| bytemuck::cast_slice(&vec![v; count]).to_vec();
        let mut tasks = Vec::new();
        for s in ss.clone() {
            let (a, b) = (a.clone(), b.clone());
            tasks.push(tokio::spawn(async move {
                let r = s.rank();
                let me = r.0 as f32;
                if r == Rank(0) {
                    meet(&a).await;
                }
                // in flight when the swap starts: finishes on the old topology
                let before = s.submit("g", spec(1000), &input(me, 1000));
                let mut swap = Box::pin({
                    let s = s.clone();
                    async move { s.swap_strategy(Strategy::Ring).await }
                });
                assert!(!s.swapping());
                assert!(poll_once(&mut swap).await.is_pending(), "{r}");
                assert!(s.swapping(), "{r}: the swap is under way");
                // started while the swap is under way: they wait, then run
                // on the new epoch and strategy, in the order started
                let during: Vec<_> = (0..4)
                    .map(|i| s.submit("g", spec(100), &input(me + i as f32, 100)))
                    .collect();
                if r != Rank(0) {
                    meet(&a).await;
                }
                meet(&b).await;
                let epoch = swap.await.expect("swap");
                assert!(!s.swapping());
                let before = before.await.unwrap();
                assert_eq!(before.to_vec::<f32>(), vec![3.0; 1000]);
                assert_eq!(
                    (before.epoch(), before.strategy()),
                    (Epoch(0), Strategy::Star),
                    "{r}: `before` ran on the old topology"
                );
                for (i, h) in during.into_iter().enumerate() {
                    let out = h.await.unwrap();
                    assert_eq!(out.to_vec::<f32>(), vec![3.0 + 3.0 * i as f32; 100]);
                    assert_eq!(
                        (out.epoch(), out.strategy()),
                        (Epoch(1), Strategy::Ring),
                        "{r}: op {i} started during the swap ran on"
                    );
                }
                (epoch, s.epoch(), s.strategy())
            }));
        }
        for t in tasks {
            let (got, now, strategy) = t.await.unwrap();
            assert_eq!(got, Epoch(1));
            assert_eq!(now, Epoch(1));
            assert_eq!(strategy, Strategy::Ring);
        }
        // a frame of the old epoch is refused now
        let h = Header {
            kind: FrameKind::Data,
            tag: OpTag {
                epoch: Epoch(0),
                op: kungfu_collectives::names::op_id("g"),
                seq: 9,
            },
            chunk: 0,
            step: 0,
            digest: 0,
            len: 0,
        };
        let r = ts[0].inject(Rank(1), h, Bytes::new()).await;
        assert!(
            matches!(r, Err(kungfu_transport::TransportError::StaleEpoch { .. })),
            "{r:?}"
        );

        // ranks that ask for different strategies: nobody swaps, all hear why
        let mut tasks = Vec::new();
        for s in ss.clone() {
            tasks.push(tokio::spawn(async move {
                let want = if s.rank().0 == 2 {
                    Strategy::Clique
                } else {
                    Strategy::BinaryTree
                };
                let r = s.swap_strategy(want).await;
                (r, s.epoch(), s.strategy())
            }));
        }
        for t in tasks {
            let (r, epoch, strategy) = t.await.unwrap();
            assert!(matches!(r, Err(CollectiveError::Mismatch { .. })), "{r:?}");
            assert_eq!((epoch, strategy), (Epoch(1), Strategy::Ring));
        }
        // and the session still works
        let hs: Vec<_> = ss
            .iter()
            .map(|s| s.allreduce("after", &[1u32; 10], ReduceOp::Sum))
            .collect();
        for h in hs {
            assert_eq!(h.await.unwrap(), vec![3u32; 10]);
        }
    });
}

/// A swap whose future is dropped half-way (here: only rank 0 swaps, and
/// gives up) does not leave later ops waiting for it: the op it held is
/// released when it is dropped, and runs where nothing changed.
#[test]
fn a_cancelled_swap_does_not_hold_later_ops() {
    rt().block_on(async {
        let ss = sessions(3, Strategy::Star, 13, LONG);
        let mut swap = Box::pin(ss[0].swap_strategy(Strategy::Ring));
        // the others never join: it closes the gate and waits
        assert!(poll_once(&mut swap).await.is_pending());
        assert!(ss[0].swapping());
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::U32,
            count: 8,
            check: 0,
        };
        let held = ss[0].submit("after", spec, bytemuck::cast_slice(&[1u32; 8]));
        drop(swap);
        assert!(!ss[0].swapping(), "dropping the swap reopens the gate");
        let mut hs = vec![held];
        hs.extend(
            ss[1..]
                .iter()
                .map(|s| s.submit("after", spec, bytemuck::cast_slice(&[1u32; 8]))),
        );
        for h in hs {
            let got = tokio::time::timeout(LONG, h)
                .await
                .expect("not held by the cancelled swap")
                .unwrap();
            assert_eq!(got.to_vec::<u32>(), vec![3u32; 8]);
            assert_eq!((got.epoch(), got.strategy()), (Epoch(0), Strategy::Star));
        }
    });
}
