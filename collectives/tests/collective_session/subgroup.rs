//! Subgroups ([`Session::subgroup`]) over the in-memory transport, frames
//! delayed at random: every collective against values worked out by hand,
//! many groups in flight in any order, and what a group refuses.

use super::*;

/// Rank `r`'s input of `len` elements (its session rank, so a group's
/// result shows which session ranks took part).
fn input(r: usize, len: usize) -> Vec<i64> {
    (0..len).map(|i| (r as i64 + 1) * 100 + i as i64).collect()
}

/// Runs `fs` as tasks of their own, all at once; their outputs in order.
async fn together<F>(fs: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let hs: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in hs {
        out.push(h.await.unwrap());
    }
    out
}

/// Makes the group `ranks` on each of its members, concurrently.
async fn make(ss: &[Session<MemTransport>], ranks: &[u32]) -> Vec<Session<MemTransport>> {
    let ranks: Vec<Rank> = ranks.iter().copied().map(Rank).collect();
    let made = ranks.iter().map(|r| {
        let s = ss[r.idx()].clone();
        let ranks = ranks.clone();
        async move { s.subgroup(&ranks).await.unwrap() }
    });
    together(made).await
}

#[test]
fn every_collective_of_a_subgroup_gives_the_members_results() {
    let rt = rt();
    // group rank i is session rank MEMBERS[i]; ranks 0 and 2 stay out
    const MEMBERS: [u32; 3] = [3, 1, 4];
    for strategy in [Strategy::Star, Strategy::Ring, Strategy::BinaryTree] {
        let ss = rt.block_on(async { sessions(5, strategy, 7, LONG) });
        rt.block_on(async {
            let gs = make(&ss, &MEMBERS).await;
            let len = 4;
            let all: Vec<Vec<i64>> = MEMBERS.iter().map(|&r| input(r as usize, len)).collect();
            let sum: Vec<i64> = (0..len).map(|i| all.iter().map(|v| v[i]).sum()).collect();
            let concat: Vec<i64> = all.concat();
            let runs = gs.iter().enumerate().map(|(i, g)| {
                let g = g.clone();
                let (all, sum, concat) = (all.clone(), sum.clone(), concat.clone());
                async move {
                    assert_eq!(g.size(), 3);
                    assert_eq!(g.rank(), Rank(i as u32));
                    assert_eq!(g.session_rank(g.rank()), Rank(MEMBERS[i]));
                    let mine = &all[i];
                    let root = Rank(2); // session rank 4
                    assert_eq!(g.allreduce("x", mine, ReduceOp::Sum).await.unwrap(), sum);
                    let b = g.broadcast("b", mine, root).await.unwrap();
                    assert_eq!(b, all[2]);
                    assert_eq!(g.allgather("g", mine).await.unwrap(), concat);
                    let r = g.reduce("r", mine, ReduceOp::Sum, root).await.unwrap();
                    assert_eq!(r, if i == 2 { sum.clone() } else { vec![] });
                    let gt = g.gather("gt", mine, root).await.unwrap();
                    assert_eq!(gt, if i == 2 { concat.clone() } else { vec![] });
                    // scatter: the root's blocks are its input three times,
                    // shifted by the block's index
                    let blocks: Vec<i64> = (0..3)
                        .flat_map(|k| all[2].iter().map(move |x| x + 10 * k))
                        .collect();
                    let give = if i == 2 { blocks } else { vec![] };
                    let sc = g.scatter("sc", &give, len, root).await.unwrap();
                    let want: Vec<i64> = all[2].iter().map(|x| x + 10 * i as i64).collect();
                    assert_eq!(sc, want);
                    // every rank gives 3 blocks: block k is its input + k
                    let three: Vec<i64> = (0..3)
                        .flat_map(|k| mine.iter().map(move |x| x + k))
                        .collect();
                    let rs = g.reduce_scatter("rs", &three, ReduceOp::Sum).await.unwrap();
                    let want: Vec<i64> = sum.iter().map(|x| x + 3 * i as i64).collect();
                    assert_eq!(rs, want);
                    let a2a = g.alltoall("a2a", &three).await.unwrap();
                    let want: Vec<i64> = all
                        .iter()
                        .flat_map(|v| v.iter().map(|x| x + i as i64))
                        .collect();
                    assert_eq!(a2a, want);
                    g.barrier("bar").await.unwrap();
                    assert!(g.consensus("c", b"same").await.unwrap());
                    let mine_bytes = [i as u8];
                    assert!(!g.consensus("d", &mine_bytes).await.unwrap());
                }
            });
            together(runs).await;
        });
    }
}

#[test]
fn a_rank_in_many_groups_may_issue_their_ops_in_any_order() {
    let rt = rt();
    let n = 4;
    for seed in 0..3 {
        let ss = rt.block_on(async { sessions(n, Strategy::Ring, seed, LONG) });
        rt.block_on(async {
            // pairs round the ring, {i, i+1}: each rank is in two of them,
            // plus a group of all four over the same ranks as the session
            let mut pairs: Vec<Vec<Session<MemTransport>>> = Vec::new();
            for i in 0..n as u32 {
                let j = (i + 1) % n as u32;
                pairs.push(make(&ss, &[i, j]).await);
            }
            let fours = make(&ss, &[0, 1, 2, 3]).await;
            let runs = (0..n).map(|me| {
                // rank me is in pair me (as its rank 0) and pair me-1 (as 1)
                let right = pairs[me][0].clone();
                let left = pairs[(me + n - 1) % n][1].clone();
                let (world, four) = (ss[me].clone(), fours[me].clone());
                async move {
                    let mut hs = Vec::new();
                    for k in 0..20i64 {
                        // the same name everywhere; even ranks go right
                        // first, odd ones left first
                        let x = [me as i64 * 1000 + k];
                        let (a, b) = if me % 2 == 0 {
                            (&right, &left)
                        } else {
                            (&left, &right)
                        };
                        let ha = a.allreduce("step", &x, ReduceOp::Sum);
                        let hw = world.allreduce("step", &x, ReduceOp::Sum);
                        let hb = b.allreduce("step", &x, ReduceOp::Sum);
                        let h4 = four.allreduce("step", &x, ReduceOp::Sum);
                        hs.push((k, ha, hw, hb, h4));
                    }
                    for (k, ha, hw, hb, h4) in hs {
                        let (a, b) = if me % 2 == 0 {
                            (me, (me + n - 1) % n)
                        } else {
                            ((me + n - 1) % n, me)
                        };
                        // pair p is {p, p+1}
                        let pair = |p: usize| (p as i64 + ((p + 1) % n) as i64) * 1000 + 2 * k;
                        assert_eq!(ha.await.unwrap(), vec![pair(a)]);
                        assert_eq!(hb.await.unwrap(), vec![pair(b)]);
                        let all = 6000 + 4 * k;
                        assert_eq!(hw.await.unwrap(), vec![all]);
                        assert_eq!(h4.await.unwrap(), vec![all]);
                    }
                }
            });
            together(runs).await;
        });
    }
}

#[test]
fn groups_over_the_same_ranks_keep_their_ops_apart() {
    let rt = rt();
    let ss = rt.block_on(async { sessions(3, Strategy::Star, 3, LONG) });
    rt.block_on(async {
        let first = make(&ss, &[0, 2]).await;
        let second = make(&ss, &[0, 2]).await;
        assert_ne!(first[0].group_id(), second[0].group_id());
        assert_eq!(first[0].group_id(), first[1].group_id());
        // rank 0 issues the second group's op first, rank 2 the first's
        let a = async {
            let h2 = second[0].allreduce("x", &[10i32], ReduceOp::Sum);
            let h1 = first[0].allreduce("x", &[1i32], ReduceOp::Sum);
            (h1.await.unwrap(), h2.await.unwrap())
        };
        let b = async {
            let h1 = first[1].allreduce("x", &[2i32], ReduceOp::Sum);
            let h2 = second[1].allreduce("x", &[20i32], ReduceOp::Sum);
            (h1.await.unwrap(), h2.await.unwrap())
        };
        let (ra, rb) = tokio::join!(a, b);
        assert_eq!(ra, (vec![3], vec![30]));
        assert_eq!(rb, (vec![3], vec![30]));
    });
}

#[test]
fn a_group_of_a_group_names_its_ranks_in_the_group() {
    let rt = rt();
    let ss = rt.block_on(async { sessions(4, Strategy::BinaryTree, 5, LONG) });
    rt.block_on(async {
        let outer = make(&ss, &[3, 2, 1]).await;
        // ranks 0 and 2 of the outer group: session ranks 3 and 1
        let inner = together([0usize, 2].map(|i| {
            let g = outer[i].clone();
            async move { g.subgroup(&[Rank(0), Rank(2)]).await.unwrap() }
        }))
        .await;
        assert_eq!(inner[0].members(), Some(&[Rank(3), Rank(1)][..]));
        let got = together(
            inner
                .iter()
                .map(|g| g.allgather("who", &[g.session_rank(g.rank()).0])),
        )
        .await;
        for g in got {
            assert_eq!(g.unwrap(), vec![3, 1]);
        }
    });
}

#[test]
fn a_group_refuses_what_it_cannot_run() {
    let rt = rt();
    let ss = rt.block_on(async { sessions(3, Strategy::Star, 1, Duration::from_secs(5)) });
    rt.block_on(async {
        let bad = |e: CollectiveError, what: &str| match e {
            CollectiveError::InvalidArgument { reason, .. } => {
                assert!(reason.contains(what), "{reason}")
            }
            e => panic!("{e}"),
        };
        bad(ss[0].subgroup(&[]).await.unwrap_err(), "at least one");
        bad(
            ss[0].subgroup(&[Rank(1), Rank(2)]).await.unwrap_err(),
            "not among",
        );
        bad(
            ss[0].subgroup(&[Rank(0), Rank(3)]).await.unwrap_err(),
            "not a rank",
        );
        bad(
            ss[0].subgroup(&[Rank(0), Rank(0)]).await.unwrap_err(),
            "twice",
        );
        // the same set in different orders
        let (a, b) = tokio::join!(
            ss[0].subgroup(&[Rank(0), Rank(1)]),
            ss[1].subgroup(&[Rank(1), Rank(0)])
        );
        for e in [a.unwrap_err(), b.unwrap_err()] {
            assert!(
                matches!(&e, CollectiveError::Mismatch { detail, .. } if detail.contains("orders")),
                "{e}"
            );
        }
        // a group of one runs alone; swaps are the session's
        let one = ss[2].subgroup(&[Rank(2)]).await.unwrap();
        assert_eq!(
            one.allreduce("x", &[5u8], ReduceOp::Sum).await.unwrap(),
            vec![5]
        );
        bad(
            one.swap_strategy(Strategy::Ring).await.unwrap_err(),
            "whole session",
        );
        // members that run different specs under one name both fail
        let gs = make(&ss, &[0, 1]).await;
        let (a, b) = tokio::join!(
            gs[0].allreduce("y", &[1u32, 2], ReduceOp::Sum),
            gs[1].allreduce("y", &[1u32, 2, 3], ReduceOp::Sum)
        );
        for e in [a.unwrap_err(), b.unwrap_err()] {
            assert!(matches!(e, CollectiveError::Mismatch { .. }), "{e}");
        }
    });
}

#[test]
fn a_lost_member_fails_the_group_and_a_lost_outsider_does_not() {
    rt().block_on(async {
        let n = 4;
        let ts = MemNetwork::new(n, MemConfig::default());
        let ss: Vec<_> = ts
            .iter()
            .map(|t| {
                let cfg = SessionConfig {
                    op_timeout: Duration::from_secs(20),
                    ..SessionConfig::default()
                };
                Session::new(t.clone(), PeerList::local(n), cfg).unwrap()
            })
            .collect();
        let gs = make(&ss, &[0, 1, 2]).await;
        // rank 3 is not a member: the group goes on without it
        ts[3].kill();
        let sums = together(gs.iter().map(|g| g.allreduce("x", &[1u32], ReduceOp::Sum))).await;
        for s in sums {
            assert_eq!(s.unwrap(), vec![3]);
        }
        // rank 2 is: ranks 0 and 1 start an op it never joins, then it dies
        let pending: Vec<_> = gs[..2]
            .iter()
            .map(|g| g.allreduce("y", &[1u32; 16], ReduceOp::Sum))
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = std::time::Instant::now();
        ts[2].kill();
        // named by its rank in the session
        all_fail_losing(pending, Rank(2), "y", started).await;
    });
}
