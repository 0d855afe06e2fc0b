//! Host-aware endpoints (`any::connect_auto`): shared memory to the ranks
//! of this host, TCP to the others, one matcher and one buffer pool.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_collectives::{Session, SessionConfig};
use kungfu_tests::unique_cluster_id;
use kungfu_topology::{Peer, PeerList, Rank};
use kungfu_transport::any::{connect_auto, AnyTransport};
use kungfu_transport::pool::BufferPool;
use kungfu_transport::shm::ShmConfig;
use kungfu_transport::tcp::TcpConfig;
use kungfu_transport::{
    ClusterVersion, Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport,
};
use tokio::net::TcpListener;

/// Ranks 0 and 1 on host 127.0.0.1, rank 2 on 127.0.0.2 (loopback too),
/// each connected host-aware in this process; rank 0 uses `pool`.
async fn two_hosts(pool: Arc<BufferPool>) -> (Vec<Arc<AnyTransport>>, PeerList) {
    let hosts = ["127.0.0.1", "127.0.0.1", "127.0.0.2"];
    let mut listeners = Vec::new();
    let mut peers = Vec::new();
    for h in hosts {
        let l = TcpListener::bind((h, 0)).await.expect("bind loopback");
        let a = l.local_addr().expect("local addr");
        peers.push(Peer {
            host: a.ip().to_string(),
            port: a.port(),
        });
        listeners.push(l);
    }
    let peers = PeerList::new(peers).expect("distinct ports");
    assert_eq!(peers.hosts().len(), 2);
    let id = unique_cluster_id();
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let (v, e, r) = (ClusterVersion(0), Epoch(0), Rank(i as u32));
            let mut tcp = TcpConfig::new(id, v, e, r, peers.clone());
            let mut shm = ShmConfig::new(id, v, e, r, hosts.len());
            tcp.connect_timeout = Duration::from_secs(20);
            shm.connect_timeout = Duration::from_secs(20);
            if i == 0 {
                tcp.pool = Some(pool.clone());
            }
            let peers = peers.clone();
            tokio::spawn(async move { connect_auto(tcp, shm, &peers, l).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("connect task").expect("connect"));
    }
    (out, peers)
}

/// The pool given to a host-aware endpoint is the one its shared-memory
/// wire and its TCP wire fill payloads from, and the one its session takes
/// working buffers from: a frame received over each wire gives its buffer
/// back to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_aware_endpoint_has_one_pool_for_its_wires_and_session() {
    let pool = BufferPool::new(1 << 20);
    let (ts, peers) = two_hosts(pool.clone()).await;
    let t0 = &ts[0];
    assert_eq!(t0.capabilities().name, "shm+tcp");
    assert!(Arc::ptr_eq(t0.pool(), &pool), "the endpoint's pool");
    let s0 = Session::new(t0.clone(), peers, SessionConfig::default()).unwrap();
    assert!(Arc::ptr_eq(s0.transport().pool(), &pool), "the session's");
    // Rank 1 sends over shared memory, rank 2 over TCP; the sizes are of
    // different classes (8 KiB, 32 KiB), so each wire's buffer shows.
    let tag = OpTag {
        epoch: Epoch(0),
        op: OpId(7),
        seq: 0,
    };
    let h = Header {
        kind: FrameKind::Data,
        tag,
        chunk: 0,
        step: 0,
        digest: 0,
        len: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    for (from, len) in [(Rank(1), 5000), (Rank(2), 20_000)] {
        let payload = Bytes::from(vec![from.0 as u8; len]);
        ts[from.idx()].send(Rank(0), h, payload).await.unwrap();
        let only: PeerSet = [from].into_iter().collect();
        let f = t0.recv(tag, &only, deadline).await.unwrap();
        assert_eq!(f.payload.len(), len);
        assert!(f.payload.iter().all(|&x| x == from.0 as u8));
        got.push(f);
    }
    let held = pool.idle_bytes();
    drop(got);
    assert_eq!(
        pool.idle_bytes() - held,
        8192 + 32768,
        "both payloads' buffers came back to the endpoint's pool"
    );
    for t in &ts {
        t.shutdown();
    }
}
