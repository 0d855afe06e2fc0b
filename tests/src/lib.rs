//! Helpers shared by the cross-crate tests in `tests/tests/`.

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{Peer, PeerList, Rank};
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
