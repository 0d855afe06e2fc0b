//! The backends of this crate as [`Cluster`]s, each connected in this
//! process: the in-memory network (plain, and with seeded delays that
//! reorder frames), TCP and QUIC over loopback, shared memory, and the host-aware
//! routing (one endpoint over a shared-memory wire inside a host and a TCP
//! wire across: two hosts on loopback, 127.0.0.1 and 127.0.0.2).

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{Peer, PeerList, Rank};
use tokio::net::TcpListener;

use super::{Cluster, ConformanceConfig};
use kungfu_transport::any::{connect_auto, AnyTransport};
use kungfu_transport::fabric::{FabricConfig, FabricTransport};
use kungfu_transport::mem::{MemConfig, MemNetwork, MemTransport};
use kungfu_transport::quic::{JobCa, QuicConfig, QuicTls, QuicTransport};
use kungfu_transport::shm::{ShmConfig, ShmTransport};
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
#[cfg(feature = "verbs")]
use kungfu_transport::verbs::{fake::FakeNet, VerbsConfig, VerbsTransport};
use kungfu_transport::ClusterVersion;

const CONNECT: Duration = Duration::from_secs(20);

/// The in-memory network.
pub struct Mem;

impl Cluster for Mem {
    type T = MemTransport;

    fn name() -> &'static str {
        "mem"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<MemTransport>> {
        MemNetwork::new(n, mem_config(&cfg, None))
    }

    fn holds_sent_frames() -> bool {
        false
    }

    fn abandon(t: &MemTransport) {
        t.kill();
    }
}

/// The in-memory network, every send first delayed by a seeded random
/// time below 200 us, so frames overtake one another.
pub struct MemDelayed;

impl Cluster for MemDelayed {
    type T = MemTransport;

    fn name() -> &'static str {
        "mem (delayed)"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<MemTransport>> {
        let delay = Some((0x5eed, Duration::from_micros(200)));
        MemNetwork::new(n, mem_config(&cfg, delay))
    }

    fn holds_sent_frames() -> bool {
        false
    }

    fn abandon(t: &MemTransport) {
        t.kill();
    }
}

fn mem_config(cfg: &ConformanceConfig, delay: Option<(u64, Duration)>) -> MemConfig {
    MemConfig {
        version: ClusterVersion(1),
        epoch: cfg.epoch,
        max_frame: cfg.max_frame,
        mailbox_bytes: cfg.mailbox_bytes,
        delay,
        pool: None,
        eager_max: usize::MAX,
    }
}

/// TCP over loopback, on free ports.
pub struct Tcp;

impl Cluster for Tcp {
    type T = TcpTransport;

    fn name() -> &'static str {
        "tcp"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<TcpTransport>> {
        let (listeners, peers) = bind(&vec!["127.0.0.1"; n]).await;
        let id = unique_cluster_id();
        let tasks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let c = tcp_config(&cfg, id, Rank(i as u32), &peers);
                tokio::spawn(TcpTransport::connect(c, l))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("connect task").expect("tcp connect"));
        }
        out
    }
}

fn tcp_config(cfg: &ConformanceConfig, id: u64, rank: Rank, peers: &PeerList) -> TcpConfig {
    let mut c = TcpConfig::new(id, ClusterVersion(1), cfg.epoch, rank, peers.clone());
    c.secret = Some(job_secret(id));
    c.connect_timeout = CONNECT;
    c.max_frame = cfg.max_frame;
    c.mailbox_bytes = cfg.mailbox_bytes;
    c.spin = cfg.spin;
    c
}

/// QUIC over loopback, on free UDP ports, with a fresh job CA per
/// cluster.
pub struct Quic;

impl Cluster for Quic {
    type T = QuicTransport;

    fn name() -> &'static str {
        "quic"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<QuicTransport>> {
        let (sockets, peers) = bind_udp(n);
        let ca = JobCa::new().expect("a job CA");
        let id = unique_cluster_id();
        let tasks: Vec<_> = sockets
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let tls = ca.issue(&i.to_string()).expect("a worker certificate");
                let c = quic_config(&cfg, id, Rank(i as u32), &peers, tls);
                tokio::spawn(QuicTransport::connect(c, s))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("connect task").expect("quic connect"));
        }
        out
    }
}

/// A QUIC endpoint's settings for a conformance cluster.
pub fn quic_config(
    cfg: &ConformanceConfig,
    id: u64,
    rank: Rank,
    peers: &PeerList,
    tls: QuicTls,
) -> QuicConfig {
    let mut c = QuicConfig::new(id, ClusterVersion(1), cfg.epoch, rank, peers.clone(), tls);
    c.connect_timeout = CONNECT;
    c.max_frame = cfg.max_frame;
    c.mailbox_bytes = cfg.mailbox_bytes;
    c.spin = cfg.spin;
    c
}

/// A UDP socket on a free port of 127.0.0.1 per rank, and their peer list.
pub fn bind_udp(n: usize) -> (Vec<std::net::UdpSocket>, PeerList) {
    let sockets: Vec<_> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind loopback"))
        .collect();
    let peers = sockets
        .iter()
        .map(|s| Peer {
            host: "127.0.0.1".into(),
            port: s.local_addr().expect("local address").port(),
        })
        .collect();
    (sockets, PeerList::new(peers).expect("distinct ports"))
}

/// libfabric over its `tcp;ofi_rxm` provider (loopback).
pub struct FabricTcp;

/// libfabric over its `shm` provider.
pub struct FabricShm;

/// libfabric over `tcp;ofi_rxm`, registering every buffer (the path of
/// providers that need `FI_MR_LOCAL`, such as verbs).
pub struct FabricRegistered;

macro_rules! fabric_cluster {
    ($t:ty, $name:expr, $provider:expr, $register:expr) => {
        impl Cluster for $t {
            type T = FabricTransport;

            fn name() -> &'static str {
                $name
            }

            async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<FabricTransport>> {
                let (listeners, peers) = bind(&vec!["127.0.0.1"; n]).await;
                let id = unique_cluster_id();
                let tasks: Vec<_> = listeners
                    .into_iter()
                    .enumerate()
                    .map(|(i, l)| {
                        let mut c = fabric_config(&cfg, id, Rank(i as u32), &peers, $provider);
                        c.register_always = $register;
                        tokio::spawn(FabricTransport::connect(c, l))
                    })
                    .collect();
                let mut out = Vec::new();
                for t in tasks {
                    out.push(t.await.expect("connect task").expect("fabric connect"));
                }
                out
            }
        }
    };
}

fabric_cluster!(FabricTcp, "fabric (tcp;ofi_rxm)", "tcp;ofi_rxm", false);
fabric_cluster!(FabricShm, "fabric (shm)", "shm", false);
fabric_cluster!(
    FabricRegistered,
    "fabric (tcp;ofi_rxm, registered)",
    "tcp;ofi_rxm",
    true
);

/// A fabric endpoint's settings for a conformance cluster: every frame
/// eager (the suite receives without posting), in few slots.
pub fn fabric_config(
    cfg: &ConformanceConfig,
    id: u64,
    rank: Rank,
    peers: &PeerList,
    provider: &str,
) -> FabricConfig {
    let mut c = FabricConfig::new(
        id,
        ClusterVersion(1),
        cfg.epoch,
        rank,
        peers.clone(),
        Some(provider.into()),
    );
    c.secret = Some(job_secret(id));
    c.connect_timeout = CONNECT;
    c.max_frame = cfg.max_frame;
    c.mailbox_bytes = cfg.mailbox_bytes;
    c.spin = cfg.spin;
    c.eager_max = cfg.max_frame;
    c.eager_slots = 8;
    if provider.starts_with("tcp") {
        c.domain = Some("lo".into()); // the loopback, never another interface
    }
    c
}

/// The verbs wire over an in-process fake of an RC fabric (no device:
/// the protocol, the bootstrap and the wire's handling of completions are
/// real, the adapter is simulated).
#[cfg(feature = "verbs")]
pub struct VerbsFake;

#[cfg(feature = "verbs")]
impl Cluster for VerbsFake {
    type T = VerbsTransport;

    fn name() -> &'static str {
        "verbs (fake fabric)"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<VerbsTransport>> {
        let (listeners, peers) = bind(&vec!["127.0.0.1"; n]).await;
        let id = unique_cluster_id();
        let net = FakeNet::new();
        let tasks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let c = verbs_config(&cfg, id, Rank(i as u32), &peers, None);
                tokio::spawn(VerbsTransport::connect_fake(c, l, net.clone()))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("connect task").expect("verbs connect"));
        }
        out
    }
}

/// A verbs endpoint's settings for a conformance cluster: every frame of
/// the suite eager (it sends up to 1 MiB without posting), in 8 slots per
/// peer (what a receiver with no room holds).
#[cfg(feature = "verbs")]
pub fn verbs_config(
    cfg: &ConformanceConfig,
    id: u64,
    rank: Rank,
    peers: &PeerList,
    device: Option<String>,
) -> VerbsConfig {
    let mut c = VerbsConfig::new(
        id,
        ClusterVersion(1),
        cfg.epoch,
        rank,
        peers.clone(),
        device,
    );
    c.secret = Some(job_secret(id));
    c.connect_timeout = CONNECT;
    c.max_frame = cfg.max_frame;
    c.mailbox_bytes = cfg.mailbox_bytes;
    c.spin = cfg.spin;
    c.eager_max = cfg.max_frame.min(1 << 20);
    c.eager_slots = 8;
    c
}

/// Shared memory, with rings of [`ConformanceConfig::ring_bytes`].
pub struct Shm;

impl Cluster for Shm {
    type T = ShmTransport;

    fn name() -> &'static str {
        "shm"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<ShmTransport>> {
        let id = unique_cluster_id();
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                tokio::spawn(ShmTransport::connect(shm_config(
                    &cfg,
                    id,
                    Rank(i as u32),
                    n,
                )))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("connect task").expect("shm connect"));
        }
        out
    }

    fn lends(_: usize, _: Rank, _: Rank) -> bool {
        true
    }
}

fn shm_config(cfg: &ConformanceConfig, id: u64, rank: Rank, n: usize) -> ShmConfig {
    let mut c = ShmConfig::new(id, ClusterVersion(1), cfg.epoch, rank, n);
    c.secret = Some(job_secret(id));
    c.ring_bytes = cfg.ring_bytes;
    c.max_frame = cfg.max_frame;
    c.mailbox_bytes = cfg.mailbox_bytes;
    c.connect_timeout = CONNECT;
    c.spin = cfg.spin;
    c
}

/// Shared memory inside a host, TCP across: the first `ceil(n / 2)` ranks
/// on host 127.0.0.1, the others on 127.0.0.2.
pub struct Hybrid;

impl Hybrid {
    fn host(n: usize, r: Rank) -> usize {
        usize::from(r.idx() >= n.div_ceil(2))
    }
}

impl Cluster for Hybrid {
    type T = AnyTransport;

    fn name() -> &'static str {
        "hybrid"
    }

    async fn connect(n: usize, cfg: ConformanceConfig) -> Vec<Arc<AnyTransport>> {
        let hosts: Vec<&str> = (0..n)
            .map(|i| ["127.0.0.1", "127.0.0.2"][Hybrid::host(n, Rank(i as u32))])
            .collect();
        let (listeners, peers) = bind(&hosts).await;
        let id = unique_cluster_id();
        let tasks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let r = Rank(i as u32);
                let (tcp, shm) = (tcp_config(&cfg, id, r, &peers), shm_config(&cfg, id, r, n));
                let peers = peers.clone();
                tokio::spawn(async move { connect_auto(tcp, shm, &peers, l).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("connect task").expect("hybrid connect"));
        }
        out
    }

    fn lends(n: usize, from: Rank, to: Rank) -> bool {
        Hybrid::host(n, from) == Hybrid::host(n, to)
    }
}

/// A listener on a free port of each host given, and the peer list they
/// form.
async fn bind(hosts: &[&str]) -> (Vec<TcpListener>, PeerList) {
    let mut listeners = Vec::new();
    let mut peers = Vec::new();
    for h in hosts {
        let l = TcpListener::bind((*h, 0)).await.expect("bind loopback");
        let port = l.local_addr().expect("local address").port();
        peers.push(Peer {
            host: h.to_string(),
            port,
        });
        listeners.push(l);
    }
    (listeners, PeerList::new(peers).expect("distinct ports"))
}

/// The job secret of cluster `id`: every cluster of the suite but QUIC's
/// (mutual TLS) runs authenticated, as kungfu-run's jobs do.
fn job_secret(id: u64) -> kungfu_transport::auth::JobSecret {
    kungfu_transport::auth::JobSecret::new(format!("conformance {id:x}").as_bytes())
        .expect("a secret")
}

/// A cluster id no other cluster of this process or another uses (shared
/// memory rings are named by it).
fn unique_cluster_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let salt = [
        std::process::id().to_le_bytes().as_slice(),
        &NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes(),
        b"conformance",
    ]
    .concat();
    kungfu_topology::fnv1a64(now, &salt)
}
