//! Helpers shared by the cross-crate tests in `tests/tests/`.

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{Peer, PeerList, Rank};
use kungfu_transport::shm::{ShmConfig, ShmTransport};
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
use kungfu_transport::{Epoch, TransportError};
use tokio::net::TcpListener;

/// Binds `n` listeners on free loopback ports and returns them with the
/// peer list they form.
pub async fn bind_loopback(n: usize) -> (Vec<TcpListener>, PeerList) {
    let mut listeners = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..n {
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let a = l.local_addr().expect("local addr");
        peers.push(Peer {
            host: a.ip().to_string(),
            port: a.port(),
        });
        listeners.push(l);
    }
    (listeners, PeerList::new(peers).expect("distinct ports"))
}

/// `n` TCP endpoints in this process, fully connected over loopback.
pub async fn tcp_cluster(n: usize, cluster_id: u64) -> (Vec<Arc<TcpTransport>>, PeerList) {
    let (listeners, peers) = bind_loopback(n).await;
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let mut cfg = TcpConfig::new(cluster_id, Epoch(0), Rank(i as u32), peers.clone());
            cfg.connect_timeout = Duration::from_secs(20);
            tokio::spawn(TcpTransport::connect(cfg, l))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let r: Result<Arc<TcpTransport>, TransportError> = t.await.expect("connect task");
        out.push(r.expect("connect"));
    }
    (out, peers)
}

/// A cluster id no other test or job uses (ring files are named by it).
pub fn unique_cluster_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    kungfu_topology::fnv1a64(
        now,
        &[
            std::process::id().to_le_bytes().as_slice(),
            &NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes(),
        ]
        .concat(),
    )
}

/// `n` shared-memory endpoints in this process, with rings of `ring_bytes`.
pub async fn shm_cluster(n: usize, ring_bytes: usize) -> Vec<Arc<ShmTransport>> {
    let id = unique_cluster_id();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut cfg = ShmConfig::new(id, Epoch(0), Rank(i as u32), n);
            cfg.ring_bytes = ring_bytes;
            cfg.connect_timeout = Duration::from_secs(20);
            tokio::spawn(ShmTransport::connect(cfg))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("connect task").expect("shm connect"));
    }
    out
}
