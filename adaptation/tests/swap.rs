//! Runtime strategy swaps at agreement points: 1000 named allreduces, a
//! few in flight at any time, while random workers propose random
//! strategies every few ops. No wrong value, no deadlock (every op is
//! bounded by the op timeout), and every worker goes through the same
//! sequence of strategies, each swap at a consistency barrier that
//! advances the epoch. And a resize after swaps: a later generation, its
//! epoch back at 0.

use std::collections::VecDeque;
use std::time::Duration;

use kungfu_adaptation::{Action, Adapter};
use kungfu_collectives::{DType, OpHandle, OpKind, OpSpec, ReduceOp, Session, SessionConfig};
use kungfu_topology::Strategy;
use kungfu_transport::mem::{MemConfig, SeededRng};
use kungfu_transport::{ClusterVersion, Epoch, Generation};

const OPS: usize = 1000;
const EVERY: usize = 5;

fn count(i: usize) -> usize {
    1 + (i * 37) % 3001
}

fn input(rank: usize, i: usize) -> Vec<f32> {
    (0..count(i))
        .map(|j| (rank * 3 + (i + j) % 11) as f32)
        .collect()
}

#[test]
fn random_strategy_swaps_keep_every_worker_consistent() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let n = 4;
        let cfg = MemConfig {
            delay: Some((7, Duration::from_micros(200))),
            ..MemConfig::default()
        };
        let config = SessionConfig {
            chunk_bytes: 2048,
            op_timeout: Duration::from_secs(30),
            ..SessionConfig::default()
        };
        let mut tasks = Vec::new();
        for (rank, s) in Session::local_cluster(n, cfg, config)
            .into_iter()
            .enumerate()
        {
            tasks.push(tokio::spawn(async move {
                let mut rng = SeededRng::new(1000 + rank as u64);
                let mut ad = Adapter::new(s.clone(), Vec::new());
                let mut seen = vec![(s.strategy(), s.epoch())];
                let mut proposed = 0;
                let mut inflight: VecDeque<(usize, OpHandle<Vec<f32>>)> = VecDeque::new();
                let check = |i: usize, got: Vec<f32>| {
                    let want: Vec<f32> = (0..count(i))
                        .map(|j| (0..n).map(|r| (r * 3 + (i + j) % 11) as f32).sum())
                        .collect();
                    assert_eq!(got, want, "rank {rank} op {i}");
                };
                for i in 0..OPS {
                    let h = s.allreduce(&format!("grad/{}", i % 7), &input(rank, i), ReduceOp::Sum);
                    inflight.push_back((i, h));
                    if inflight.len() > 3 {
                        let (k, h) = inflight.pop_front().unwrap();
                        check(k, h.await.expect("op"));
                    }
                    if i % EVERY == EVERY - 1 {
                        if rng.below(4) == 0 {
                            let st = Strategy::ALL[rng.below(Strategy::ALL.len() as u64) as usize];
                            ad.propose(Action::SetStrategy(st));
                            proposed += 1;
                        }
                        ad.progress.step = i as u64;
                        ad.agree().await.expect("agreement");
                        seen.push((s.strategy(), s.epoch()));
                    }
                }
                for (k, h) in inflight {
                    check(k, h.await.expect("op"));
                }
                (seen, ad.history().to_vec(), proposed)
            }));
        }
        let mut results = Vec::new();
        for t in tasks {
            results.push(
                tokio::time::timeout(Duration::from_secs(240), t)
                    .await
                    .expect("no deadlock")
                    .unwrap(),
            );
        }
        let (seq0, hist0, _) = &results[0];
        for (r, (seq, hist, _)) in results.iter().enumerate() {
            assert_eq!(seq, seq0, "rank {r} went through other strategies");
            assert_eq!(hist, hist0, "rank {r} agreed on other actions");
        }
        let proposals: usize = results.iter().map(|r| r.2).sum();
        let distinct: std::collections::HashSet<_> = seq0.iter().map(|(s, _)| s).collect();
        // the epoch advances at every swap, and only then
        for w in seq0.windows(2) {
            let step = w[1].1 .0 - w[0].1 .0;
            assert_eq!(step, u32::from(w[0].0 != w[1].0), "{w:?}");
        }
        assert!(
            proposals > 20 && distinct.len() > 4,
            "the test must swap often: {proposals} proposals, {distinct:?}"
        );
        assert_eq!(seq0.len(), OPS / EVERY + 1);
    });
}

/// A resize after swaps: the session of the new cluster version starts at
/// epoch 0, and its generation is still later than every one before it
/// (the version counts first), for the session and for its ops' outputs.
#[test]
fn a_resize_after_three_swaps_starts_a_later_generation_at_epoch_0() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = SessionConfig {
            op_timeout: Duration::from_secs(30),
            ..SessionConfig::default()
        };
        let at = |version| MemConfig {
            version: ClusterVersion(version),
            ..MemConfig::default()
        };
        let gen = |v, e| Generation {
            version: ClusterVersion(v),
            epoch: Epoch(e),
        };
        // version 1, two workers: three swaps, each to a new strategy
        let old = Session::local_cluster(2, at(1), config.clone());
        let mut tasks = Vec::new();
        for s in old {
            tasks.push(tokio::spawn(async move {
                let mut ad = Adapter::new(s.clone(), Vec::new());
                assert_eq!(s.generation(), gen(1, 0));
                for st in [Strategy::Ring, Strategy::Tree, Strategy::Clique] {
                    ad.propose(Action::SetStrategy(st));
                    ad.agree().await.expect("agreement");
                    assert_eq!(s.strategy(), st);
                }
                let out = s
                    .submit(
                        "grad",
                        OpSpec {
                            kind: OpKind::Allreduce(ReduceOp::Sum),
                            dtype: DType::F32,
                            count: 4,
                            check: 0,
                        },
                        bytemuck::cast_slice(&[1.0f32; 4]),
                    )
                    .await
                    .expect("allreduce");
                assert_eq!(out.to_vec::<f32>(), vec![2.0; 4]);
                (ad, s.generation(), out.generation())
            }));
        }
        let mut adapters = Vec::new();
        for t in tasks {
            let (ad, g, op) = tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("no deadlock")
                .unwrap();
            assert_eq!((g, op), (gen(1, 3), gen(1, 3)));
            adapters.push(ad);
        }
        // the resize: version 2, three workers, new connections (as the
        // runtime makes them); the two old workers' adapters move over
        let new = Session::local_cluster(3, at(2), config);
        let mut tasks = Vec::new();
        for (rank, s) in new.into_iter().enumerate() {
            let mut ad = match adapters.pop() {
                Some(mut ad) => {
                    ad.set_session(s.clone());
                    ad
                }
                None => Adapter::new(s.clone(), Vec::new()),
            };
            tasks.push(tokio::spawn(async move {
                let fresh = ad.session().generation();
                if rank == 0 {
                    ad.propose(Action::SetStrategy(Strategy::Ring));
                }
                ad.agree().await.expect("agreement after the resize");
                (fresh, ad.session().generation())
            }));
        }
        for t in tasks {
            let (fresh, swapped) = tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("no deadlock")
                .unwrap();
            assert_eq!(fresh, gen(2, 0), "the new version starts at epoch 0");
            assert!(fresh > gen(1, 3), "{fresh} is later than v1/e3");
            assert_eq!(swapped, gen(2, 1));
        }
    });
}
