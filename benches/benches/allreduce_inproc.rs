//! A 4-rank allreduce in one process over the in-memory transport: the cost
//! of the scheduler and plans without a network.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kungfu_collectives::{ReduceOp, Session, SessionConfig};
use kungfu_topology::{PeerList, Strategy};
use kungfu_transport::mem::{MemConfig, MemNetwork, MemTransport};

fn allreduce(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let n = 4;
    let mut g = c.benchmark_group("allreduce_inproc_4");
    g.sample_size(20);
    for strategy in [Strategy::Ring, Strategy::Star, Strategy::BinaryTree] {
        let sessions: Vec<Session<MemTransport>> = rt.block_on(async {
            MemNetwork::new(n, MemConfig::default())
                .into_iter()
                .map(|t| {
                    let cfg = SessionConfig {
                        strategy,
                        ..SessionConfig::default()
                    };
                    Session::new(t, PeerList::local(n), cfg).unwrap()
                })
                .collect()
        });
        for &count in &[1usize, 256 << 10] {
            let data = vec![1.0f32; count];
            g.throughput(Throughput::Bytes((count * 4) as u64));
            let id = BenchmarkId::new(strategy.name(), count * 4);
            g.bench_with_input(id, &count, |b, _| {
                b.iter(|| {
                    rt.block_on(async {
                        let hs: Vec<_> = sessions
                            .iter()
                            .map(|s| s.allreduce("bench", &data, ReduceOp::Sum))
                            .collect();
                        for h in hs {
                            let out = h.await.unwrap();
                            assert_eq!(out[0], n as f32);
                        }
                    })
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, allreduce);
criterion_main!(benches);
