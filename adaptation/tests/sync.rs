//! The synchronisation helpers and the point-to-point save/request
//! primitive under them, over the in-memory transport.

use std::sync::Arc;
use std::time::Duration;

use kungfu_adaptation::{model_averaging, sync_sgd, PairAveraging};
use kungfu_collectives::p2p::{P2pError, PeerStore};
use kungfu_collectives::{Session, SessionConfig};
use kungfu_topology::Rank;
use kungfu_transport::mem::{MemConfig, MemTransport};

fn sessions(n: usize) -> Vec<Session<MemTransport>> {
    let mem = MemConfig {
        delay: Some((3, Duration::from_micros(200))),
        ..MemConfig::default()
    };
    let cfg = SessionConfig {
        op_timeout: Duration::from_secs(20),
        ..SessionConfig::default()
    };
    Session::local_cluster(n, mem, cfg)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_peer_answers_requests_without_taking_part() {
    rt().block_on(async {
        let ss = sessions(3);
        let stores: Vec<_> = ss.iter().map(|s| Arc::new(PeerStore::new(s))).collect();
        // rank 1 saves and then does nothing at all
        assert_eq!(stores[1].save("m", &[1, 2, 3]).unwrap(), 1);
        let (v, b) = stores[0].request(Rank(1), "m").await.unwrap();
        assert_eq!((v, &b[..]), (1, &[1u8, 2, 3][..]));
        assert_eq!(stores[1].save("m", &[4, 5]).unwrap(), 2);
        let (v, b) = stores[2].request(Rank(1), "m").await.unwrap();
        assert_eq!((v, &b[..]), (2, &[4u8, 5][..]));
        let (v, _) = stores[2]
            .request_version(Rank(1), "m", Some(2))
            .await
            .unwrap();
        assert_eq!(v, 2);
        // many requests in flight at once, from two ranks
        let mut hs = Vec::new();
        for i in 0..20 {
            let st = stores[if i % 2 == 0 { 0 } else { 2 }].clone();
            hs.push(tokio::spawn(async move { st.request(Rank(1), "m").await }));
        }
        for h in hs {
            assert_eq!(&h.await.unwrap().unwrap().1[..], &[4u8, 5]);
        }
        let e = stores[0].request(Rank(1), "nothing").await.unwrap_err();
        assert!(matches!(e, P2pError::NotSaved { .. }), "{e}");
        let e = stores[0]
            .request_version(Rank(1), "m", Some(1))
            .await
            .unwrap_err();
        assert!(matches!(e, P2pError::NoSuchVersion { .. }), "{e}");
        for bad in [Rank(0), Rank(3)] {
            let e = stores[0].request(bad, "m").await.unwrap_err();
            assert!(matches!(e, P2pError::InvalidArgument(_)), "{e}");
        }
        let e = stores[0].save("huge", &vec![0u8; 64 << 20]).unwrap_err();
        assert!(matches!(e, P2pError::InvalidArgument(_)), "{e}");
    });
}

#[test]
fn sync_sgd_and_model_averaging_average() {
    rt().block_on(async {
        let n = 4;
        let mut tasks = Vec::new();
        for s in sessions(n) {
            tasks.push(tokio::spawn(async move {
                let r = s.rank().0 as f32;
                let mut g = vec![r; 1000];
                sync_sgd(&s, "grad", &mut g).await.unwrap();
                assert_eq!(g, vec![1.5; 1000]);
                let mut m = vec![2.0 * r, -r];
                model_averaging(&s, "model", &mut m).await.unwrap();
                assert_eq!(m, vec![3.0, -1.5]);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// Pair averaging pulls the models together: each worker averages with a
/// random peer's latest model (the peer does not wait for it).
#[test]
fn pair_averaging_converges_to_consensus() {
    rt().block_on(async {
        let n = 4;
        let mut tasks = Vec::new();
        for s in sessions(n) {
            tasks.push(tokio::spawn(async move {
                let mut pa = PairAveraging::new(&s, "model", 42);
                let mut m = vec![10.0 * s.rank().0 as f32; 64];
                pa.save(&m).unwrap();
                // every worker has saved before anyone asks
                s.barrier("saved").await.unwrap();
                let mut peers = std::collections::HashSet::new();
                for _ in 0..30 {
                    let (p, v) = pa.step(&mut m).await.unwrap();
                    assert_ne!(p, s.rank());
                    assert!(v >= 1);
                    peers.insert(p);
                }
                // nobody leaves while others may still ask
                s.barrier("done").await.unwrap();
                (m, peers.len())
            }));
        }
        let mut models = Vec::new();
        for t in tasks {
            let (m, peers) = t.await.unwrap();
            assert!(peers >= 2, "peers are drawn at random");
            models.push(m[0]);
        }
        let lo = models.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = models.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert!(hi - lo < 1.0, "spread {lo}..{hi} (started 0..30)");
        assert!(lo > 0.0 && hi < 30.0, "{models:?}");
    });
}
