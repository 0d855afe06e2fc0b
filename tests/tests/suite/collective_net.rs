//! The collectives over real networks on loopback (TCP, QUIC), 4 ranks in
//! one process: every op of every strategy with exact values, and a lost
//! rank failing the others fast.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kungfu_collectives::{CollectiveError, ReduceOp, Session, SessionConfig};
use kungfu_tests::conformance::clusters::{bind_udp, quic_config};
use kungfu_tests::conformance::ConformanceConfig;
use kungfu_tests::{bind_loopback, tcp_cluster, unique_cluster_id};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::fabric::{FabricConfig, FabricTransport};
use kungfu_transport::quic::{JobCa, QuicTransport};
use kungfu_transport::{ClusterVersion, Epoch, Transport};

/// A network: `n` connected endpoints and their peer list.
trait Net {
    type T: Transport;
    fn connect(n: usize) -> impl Future<Output = (Vec<Arc<Self::T>>, PeerList)>;
}

struct Tcp;
impl Net for Tcp {
    type T = kungfu_transport::tcp::TcpTransport;
    async fn connect(n: usize) -> (Vec<Arc<Self::T>>, PeerList) {
        tcp_cluster(n, unique_cluster_id()).await
    }
}

struct Quic;
impl Net for Quic {
    type T = QuicTransport;
    async fn connect(n: usize) -> (Vec<Arc<QuicTransport>>, PeerList) {
        let (sockets, peers) = bind_udp(n);
        let (ca, id) = (JobCa::new().unwrap(), unique_cluster_id());
        let tasks: Vec<_> = sockets
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let tls = ca.issue(&i.to_string()).unwrap();
                let cfg = ConformanceConfig::default();
                let c = quic_config(&cfg, id, Rank(i as u32), &peers, tls);
                tokio::spawn(QuicTransport::connect(c, s))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap().unwrap());
        }
        (out, peers)
    }
}

/// libfabric over `provider`, with its default eager limit (64 KiB): the
/// larger frames go only into receives the ops post (a rendezvous).
async fn fabric(n: usize, provider: &str) -> (Vec<Arc<FabricTransport>>, PeerList) {
    let (listeners, peers) = bind_loopback(n).await;
    let id = unique_cluster_id();
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let r = Rank(i as u32);
            let mut c = FabricConfig::new(
                id,
                ClusterVersion(0),
                Epoch(0),
                r,
                peers.clone(),
                Some(provider.into()),
            );
            if provider.starts_with("tcp") {
                c.domain = Some("lo".into());
            }
            tokio::spawn(FabricTransport::connect(c, l))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    (out, peers)
}

struct FabricTcp;
impl Net for FabricTcp {
    type T = FabricTransport;
    async fn connect(n: usize) -> (Vec<Arc<FabricTransport>>, PeerList) {
        fabric(n, "tcp;ofi_rxm").await
    }
}

struct FabricShm;
impl Net for FabricShm {
    type T = FabricTransport;
    async fn connect(n: usize) -> (Vec<Arc<FabricTransport>>, PeerList) {
        fabric(n, "shm").await
    }
}

async fn sessions<N: Net>(n: usize, strategy: Strategy, chunk_bytes: usize) -> Vec<Session<N::T>> {
    let (ts, peers) = N::connect(n).await;
    ts.into_iter()
        .map(|t| {
            let cfg = SessionConfig {
                strategy,
                chunk_bytes,
                op_timeout: Duration::from_secs(30),
                ..SessionConfig::default()
            };
            Session::new(t, peers.clone(), cfg).unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_every_strategy_over_tcp() {
    every_op_every_strategy::<Tcp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_every_strategy_over_quic() {
    every_op_every_strategy::<Quic>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_every_strategy_over_fabric_tcp() {
    every_op_every_strategy::<FabricTcp>().await;
    // chunks over the eager limit: they land only in receives the ops post
    every_op_every_strategy_in::<FabricTcp>(1 << 20, rendezvous_used).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_every_strategy_over_fabric_shm() {
    every_op_every_strategy::<FabricShm>().await;
    every_op_every_strategy_in::<FabricShm>(1 << 20, rendezvous_used).await;
}

/// Some frame went the rendezvous way (into a receive an op posted).
fn rendezvous_used(ss: &[Session<FabricTransport>]) {
    let posted: u64 = ss
        .iter()
        .map(|s| s.transport().wires()[0].frames_posted())
        .sum();
    assert!(posted > 0, "no frame landed in a posted receive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_rank_fails_the_others_fast_over_fabric_tcp() {
    lost_rank_fails_the_others_fast::<FabricTcp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_rank_fails_the_others_fast_over_tcp() {
    lost_rank_fails_the_others_fast::<Tcp>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_rank_fails_the_others_fast_over_quic() {
    lost_rank_fails_the_others_fast::<Quic>().await;
}

/// Every op of every strategy, in chunks of `chunk_bytes`; the sessions
/// are handed to `after` when their ops are done.
async fn every_op_every_strategy<N: Net>() {
    every_op_every_strategy_in::<N>(4096, |_| {}).await;
}

async fn every_op_every_strategy_in<N: Net>(chunk_bytes: usize, after: impl Fn(&[Session<N::T>])) {
    let n = 4;
    for strategy in Strategy::ALL {
        let ss = sessions::<N>(n, strategy, chunk_bytes).await;
        let kept = ss.clone();
        let mut tasks = Vec::new();
        for s in ss {
            tasks.push(tokio::spawn(async move {
                let r = s.rank().0 as usize;
                let big: Vec<f32> = (0..100_003).map(|i| ((i + r) % 7) as f32).collect();
                let x: Vec<i32> = (0..12).map(|i| (r * 100 + i) as i32).collect();
                let ar = s.allreduce("big", &big, ReduceOp::Sum);
                let avg = s.allreduce("avg", &[r as f64 * 4.0; 3], ReduceOp::Avg);
                let red = s.reduce("red", &x, ReduceOp::Max, Rank(1));
                let bc = s.broadcast("bc", &x, Rank(3));
                let ag = s.allgather("ag", &x[..2]);
                let ga = s.gather("ga", &x[..2], Rank(0));
                let rs = s.reduce_scatter("rs", &x[..8], ReduceOp::Sum);
                let a2a = s.alltoall("a2a", &x[..4]);
                let cons = s.consensus("cons", b"same");
                let want_big: Vec<f32> = (0..100_003)
                    .map(|i| (0..4).map(|q| ((i + q) % 7) as f32).sum())
                    .collect();
                assert_eq!(ar.await.unwrap(), want_big);
                assert_eq!(avg.await.unwrap(), vec![6.0; 3]);
                let red = red.await.unwrap();
                if r == 1 {
                    assert_eq!(red, (0..12).map(|i| 300 + i).collect::<Vec<i32>>());
                } else {
                    assert!(red.is_empty());
                }
                assert_eq!(
                    bc.await.unwrap(),
                    (0..12).map(|i| 300 + i).collect::<Vec<i32>>()
                );
                let ag_want: Vec<i32> = (0..4).flat_map(|q| [q * 100, q * 100 + 1]).collect();
                assert_eq!(ag.await.unwrap(), ag_want);
                let ga = ga.await.unwrap();
                if r == 0 {
                    assert_eq!(ga, ag_want);
                } else {
                    assert!(ga.is_empty());
                }
                let b = 2 * r as i32;
                assert_eq!(rs.await.unwrap(), vec![600 + 4 * b, 600 + 4 * (b + 1)]);
                assert_eq!(
                    a2a.await.unwrap(),
                    (0..4).map(|q| q * 100 + r as i32).collect::<Vec<_>>()
                );
                assert!(cons.await.unwrap());
                s.barrier("end").await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap_or_else(|e| panic!("{strategy}: {e}"));
        }
        after(&kept);
    }
}

/// A rank whose transport goes away in the middle of a stream of
/// allreduces: the others fail with an error naming it, within seconds.
async fn lost_rank_fails_the_others_fast<N: Net>() {
    let ss = sessions::<N>(4, Strategy::Ring, 1 << 16).await;
    let victim = ss[3].clone();
    let mut tasks = Vec::new();
    for s in ss.into_iter().take(3) {
        tasks.push(tokio::spawn(async move {
            for i in 0.. {
                if let Err(e) = s
                    .allreduce(&format!("step{i}"), &[1.0f32; 4096], ReduceOp::Sum)
                    .await
                {
                    // keep the session (and its connections) until every
                    // survivor has its error: a survivor that left at once
                    // would be a second lost rank
                    return (e, s);
                }
            }
            unreachable!()
        }));
    }
    for i in 0..5 {
        victim
            .allreduce(&format!("step{i}"), &[1.0f32; 4096], ReduceOp::Sum)
            .await
            .unwrap();
    }
    let started = std::time::Instant::now();
    victim.transport().shutdown();
    let mut kept = Vec::new();
    for t in tasks {
        let (e, s) = t.await.unwrap();
        kept.push(s);
        match e {
            CollectiveError::PeerLost { peer, .. } => assert_eq!(peer, Rank(3)),
            other => panic!("{other}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}
