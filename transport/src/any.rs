//! The job's choice of wires as one type, so that the layers above (the
//! runtime, the C ABI) need not be generic over it: [`AnyTransport`] is the
//! generic [`Endpoint`] over [`AnyWire`], an enum with a variant per wire.
//! Calls dispatch with a `match`, never through a boxed future.
//!
//! Host-aware ("auto") is not a backend of its own: it is an endpoint over
//! two wires, shared memory to the ranks of this host and TCP to the
//! others, with one matcher, routed per peer ([`connect_auto`]).
//! Hierarchical strategies (`BINARY_TREE_STAR`, ...) then use both at
//! once: the star inside a host over shared memory, the tree across hosts
//! over TCP.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use tokio::net::TcpListener;

use crate::endpoint::{Endpoint, Matcher, Pump, RecvKey};
#[cfg(feature = "fabric")]
use crate::fabric::{FabricConfig, FabricWire};
use crate::pool::BufferPool;
use crate::quic::{QuicConfig, QuicWire};
use crate::region::{Mem, MemMut, Region};
use crate::shm::{ShmConfig, ShmWire};
use crate::tcp::{TcpConfig, TcpWire};
#[cfg(feature = "verbs")]
use crate::verbs::{VerbsConfig, VerbsWire};
use crate::wire::{Apply, Caps, Wire};
use crate::{Header, OpTag, PeerSet, TransportError};

/// The transports a job may ask for (`--transport`, `KUNGFU_TRANSPORT`,
/// `kf_transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Shared memory inside a host; across hosts, fabric when a hardware
    /// provider is present, else TCP.
    Auto,
    Tcp,
    Shm,
    Quic,
    /// RDMA through libfabric.
    Fabric,
    /// RDMA through ibverbs.
    Verbs,
}

impl TransportKind {
    pub const ALL: [TransportKind; 6] = [
        TransportKind::Auto,
        TransportKind::Tcp,
        TransportKind::Shm,
        TransportKind::Quic,
        TransportKind::Fabric,
        TransportKind::Verbs,
    ];

    /// The name `--transport` and `KUNGFU_TRANSPORT` take.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Quic => "quic",
            TransportKind::Fabric => "fabric",
            TransportKind::Verbs => "verbs",
        }
    }

    /// Whether this build can connect it at all (a backend not built in
    /// is refused with a clear error wherever it is asked for).
    // a table per feature, which reads the same whichever features are on
    #[allow(clippy::match_like_matches_macro)]
    pub fn built(self) -> bool {
        match self {
            TransportKind::Fabric => cfg!(feature = "fabric"),
            TransportKind::Verbs => cfg!(feature = "verbs"),
            _ => true,
        }
    }

    /// The kinds this build can connect, for messages.
    pub fn available() -> String {
        let names: Vec<&str> = Self::ALL
            .iter()
            .filter(|k| k.built())
            .map(|k| k.name())
            .collect();
        names.join(", ")
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<TransportKind, String> {
        let s = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
                format!("unknown transport {s:?} (one of: {})", names.join(", "))
            })
    }
}

/// A TCP, QUIC, shared-memory, libfabric or ibverbs wire.
// One or two per process, in the endpoint's vector: boxing the larger one
// would only add a pointer chase to every send.
#[allow(clippy::large_enum_variant)]
pub enum AnyWire {
    Tcp(TcpWire),
    Shm(ShmWire),
    Quic(QuicWire),
    #[cfg(feature = "fabric")]
    Fabric(FabricWire),
    #[cfg(feature = "verbs")]
    Verbs(VerbsWire),
}

/// An endpoint over the wires the job chose.
pub type AnyTransport = Endpoint<AnyWire>;

macro_rules! each {
    ($self:ident, $w:ident => $e:expr) => {
        match $self {
            AnyWire::Tcp($w) => $e,
            AnyWire::Shm($w) => $e,
            AnyWire::Quic($w) => $e,
            #[cfg(feature = "fabric")]
            AnyWire::Fabric($w) => $e,
            #[cfg(feature = "verbs")]
            AnyWire::Verbs($w) => $e,
        }
    };
}

impl Wire for AnyWire {
    fn caps(&self) -> Caps {
        each!(self, w => w.caps())
    }

    fn reaches(&self, peer: Rank) -> bool {
        each!(self, w => w.reaches(peer))
    }

    fn register(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        each!(self, w => w.register(region))
    }

    fn post_recv(&self, key: RecvKey, mem: MemMut) -> Result<Option<MemMut>, TransportError> {
        each!(self, w => w.post_recv(key, mem))
    }

    fn inject(&self, to: Rank, header: Header, payload: &[u8]) -> Result<bool, TransportError> {
        each!(self, w => w.inject(to, header, payload))
    }

    async fn send(&self, to: Rank, header: Header, payload: Bytes) -> Result<(), TransportError> {
        each!(self, w => w.send(to, header, payload).await)
    }

    async fn send_mem(&self, to: Rank, header: Header, payload: Mem) -> Result<(), TransportError> {
        each!(self, w => w.send_mem(to, header, payload).await)
    }

    fn pump(&self, tag: OpTag, from: &PeerSet, apply: Option<Apply<'_>>) -> Pump {
        each!(self, w => w.pump(tag, from, apply))
    }

    fn set_polling(&self, on: bool) {
        each!(self, w => w.set_polling(on))
    }

    fn going_to_sleep(&self) {
        each!(self, w => w.going_to_sleep())
    }

    fn extension(&self, ty: std::any::TypeId) -> Option<crate::wire::Extension> {
        each!(self, w => w.extension(ty))
    }

    async fn close(&self, linger: Duration) {
        each!(self, w => w.close(linger).await)
    }

    fn shutdown(&self) {
        each!(self, w => w.shutdown())
    }
}

/// TCP to every peer.
pub async fn connect_tcp(
    cfg: TcpConfig,
    listener: TcpListener,
) -> Result<Arc<AnyTransport>, TransportError> {
    let (rank, size, version) = (cfg.rank, cfg.peers.len(), cfg.version);
    let (wire, matcher, pool, ecfg) = TcpWire::connect(cfg, listener).await?;
    let wires = vec![AnyWire::Tcp(wire)];
    let e = Endpoint::new(rank, size, version, "tcp", matcher, pool, wires, ecfg);
    Ok(Arc::new(e))
}

/// QUIC to every peer, receiving on `socket`.
pub async fn connect_quic(
    cfg: QuicConfig,
    socket: std::net::UdpSocket,
) -> Result<Arc<AnyTransport>, TransportError> {
    let (rank, size, version) = (cfg.rank, cfg.peers.len(), cfg.version);
    let (wire, matcher, pool, ecfg) = QuicWire::connect(cfg, socket).await?;
    let wires = vec![AnyWire::Quic(wire)];
    let e = Endpoint::new(rank, size, version, "quic", matcher, pool, wires, ecfg);
    Ok(Arc::new(e))
}

/// libfabric to every peer (its addresses exchanged over the bootstrap
/// connections accepted on `listener`).
#[cfg(feature = "fabric")]
pub async fn connect_fabric(
    cfg: FabricConfig,
    listener: TcpListener,
) -> Result<Arc<AnyTransport>, TransportError> {
    let (rank, size, version) = (cfg.rank, cfg.peers.len(), cfg.version);
    let (wire, matcher, pool, ecfg) = FabricWire::connect(cfg, listener).await?;
    let wires = vec![AnyWire::Fabric(wire)];
    let e = Endpoint::new(rank, size, version, "fabric", matcher, pool, wires, ecfg);
    Ok(Arc::new(e))
}

/// ibverbs to every peer (queue pair info exchanged over the bootstrap
/// connections accepted on `listener`). Without a usable RDMA device:
/// [`TransportError::Unavailable`], saying what is missing.
#[cfg(feature = "verbs")]
pub async fn connect_verbs(
    cfg: VerbsConfig,
    listener: TcpListener,
) -> Result<Arc<AnyTransport>, TransportError> {
    let (rank, size, version) = (cfg.rank, cfg.peers.len(), cfg.version);
    let (wire, matcher, pool, ecfg) = VerbsWire::connect(cfg, listener).await?;
    let wires = vec![AnyWire::Verbs(wire)];
    let e = Endpoint::new(rank, size, version, "verbs", matcher, pool, wires, ecfg);
    Ok(Arc::new(e))
}

/// What the endpoint's wires are, for headers and logs: its name, and the
/// libfabric provider or RDMA device where there is one
/// (`fabric (tcp;ofi_rxm)`, `verbs (mlx5_0)`).
pub fn describe(t: &AnyTransport) -> String {
    match t.wires() {
        #[cfg(feature = "fabric")]
        [AnyWire::Fabric(f)] => format!("fabric ({})", f.provider()),
        #[cfg(feature = "verbs")]
        [AnyWire::Verbs(v)] => format!("verbs ({})", v.device()),
        _ => t.name().to_string(),
    }
}

/// Shared memory to every peer (all on this host).
pub async fn connect_shm(cfg: ShmConfig) -> Result<Arc<AnyTransport>, TransportError> {
    let (rank, size, version) = (cfg.rank, cfg.size, cfg.version);
    let (wire, matcher, pool, ecfg) = ShmWire::connect(cfg).await?;
    let wires = vec![AnyWire::Shm(wire)];
    let e = Endpoint::new(rank, size, version, "shm", matcher, pool, wires, ecfg);
    Ok(Arc::new(e))
}

/// Shared memory to the ranks on this rank's host, TCP to the others, one
/// matcher and one buffer pool for both. `tcp` and `shm` give every
/// setting but the peer split and the matcher, which this fills in from
/// `peers`, and the cluster version, starting epoch and pool, which are
/// `tcp`'s for both (one matcher, one epoch, one pool: `tcp.pool`, else
/// `shm.pool`, else a new one). Receives poll the rings as over shared
/// memory alone (its spin); the runtime polls the sockets whenever they
/// yield.
pub async fn connect_auto(
    mut tcp: TcpConfig,
    mut shm: ShmConfig,
    peers: &PeerList,
    listener: TcpListener,
) -> Result<Arc<AnyTransport>, TransportError> {
    let me = tcp.rank;
    let local: PeerSet = peers.hosts()[peers.host_of(me)].iter().copied().collect();
    let matcher = Arc::new(Matcher::new(tcp.epoch, tcp.mailbox_bytes));
    let pool = (tcp.pool.take().or(shm.pool.take()))
        .unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
    tcp.pool = Some(pool.clone());
    shm.pool = Some(pool.clone());
    shm.version = tcp.version;
    shm.epoch = tcp.epoch;
    tcp.skip = local.clone();
    tcp.matcher = Some(matcher.clone());
    shm.local = Some(local);
    shm.matcher = Some(matcher.clone());
    let (size, version) = (peers.len(), tcp.version);
    let (t, s) = tokio::join!(TcpWire::connect(tcp, listener), ShmWire::connect(shm));
    let ((tcp, _, _, _), (shm, _, _, ecfg)) = (t?, s?);
    // Shared memory first: a rank reached by both goes through the ring.
    let wires = vec![AnyWire::Shm(shm), AnyWire::Tcp(tcp)];
    let e = Endpoint::new(me, size, version, "shm+tcp", matcher, pool, wires, ecfg);
    Ok(Arc::new(e))
}

#[cfg(test)]
mod tests {
    use super::TransportKind;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for k in TransportKind::ALL {
            assert_eq!(k.name().parse::<TransportKind>(), Ok(k));
        }
        assert_eq!(" QUIC ".parse::<TransportKind>(), Ok(TransportKind::Quic));
        let e = "carrier-pigeon".parse::<TransportKind>().unwrap_err();
        assert!(
            e.contains("carrier-pigeon") && e.contains("tcp, shm, quic"),
            "{e}"
        );
    }

    #[test]
    fn verbs_is_built_with_its_feature() {
        assert_eq!(TransportKind::Verbs.built(), cfg!(feature = "verbs"));
        assert_eq!(
            TransportKind::available().contains("verbs"),
            cfg!(feature = "verbs")
        );
    }
}
