//! Byte movers for KungFu-rs.
//!
//! The collectives use one trait, [`Transport`]: send a framed message
//! ([`Header`] + payload) to a rank, and receive the next frame of an op
//! instance ([`OpTag`]) from a set of peers, with a deadline. They never see
//! sockets, shared memory or completion queues.
//!
//! [`Transport`] is implemented once, by the generic
//! [`endpoint::Endpoint`], which owns matching, epochs, strays, the
//! back-pressure budget, lost peers and the receive loop, and routes each
//! peer to a *wire*. A backend implements only the small [`wire::Wire`]
//! trait. Wires here:
//! - [`tcp::TcpWire`] ([`tcp::TcpTransport`]): tokio, one connection per
//!   peer pair, `TCP_NODELAY`, a handshake that checks cluster id, cluster
//!   version, epoch, ranks and the peer list.
//! - [`shm::ShmWire`] ([`shm::ShmTransport`]): shared memory between the
//!   ranks of one host, a ring per ordered pair with spin-then-futex
//!   waiting.
//! - [`mem::MemWire`] ([`mem::MemNetwork`]): in-process, for tests; it can
//!   delay and reorder frames with a seeded RNG and kill ranks.
//! - `verbs::VerbsWire` (feature `verbs`): ibverbs, an RC queue pair per
//!   peer, large frames RDMA-written into posted receives; without an
//!   RDMA device it says what is missing.
//!
//! Shared memory inside a host and TCP across is one endpoint over both
//! wires ([`any::connect_auto`]), not a backend of its own.
//!
//! # Quick start
//!
//! ```
//! use bytes::Bytes;
//! use kungfu_transport::{mem::{MemConfig, MemNetwork}, Epoch, FrameKind, Header, OpId, OpTag,
//!     PeerSet, Transport};
//! use kungfu_topology::Rank;
//! use tokio::time::{Duration, Instant};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let eps = MemNetwork::new(2, MemConfig::default());
//! let tag = OpTag { epoch: Epoch(0), op: OpId(1), seq: 0 };
//! let h = Header { kind: FrameKind::Data, tag, chunk: 0, step: 0, digest: 0, len: 0 };
//! eps[0].send(Rank(1), h, Bytes::from_static(b"hello")).await.unwrap();
//! let from = PeerSet::all(2);
//! let f = eps[1].recv(tag, &from, Instant::now() + Duration::from_secs(5)).await.unwrap();
//! assert_eq!((f.from, &f.payload[..]), (Rank(0), &b"hello"[..]));
//! # });
//! ```
//!
//! # Matching and memory
//!
//! Frames are matched on their [`OpTag`] (epoch, op id, per-name sequence
//! number); the collective plan matches chunk and step inside an op and
//! checks the spec digest. A frame that arrives before its op is posted is
//! kept in a per-endpoint [`endpoint::Matcher`] whose byte budget is bounded:
//! when it is full the backend stops reading from that peer (back-pressure)
//! instead of allocating. Frames of an older epoch are refused; frames of a
//! retired op instance are dropped.
//!
//! Buffers come from one [`pool::BufferPool`] per endpoint
//! ([`Transport::pool`]; the runtime gives every endpoint of a process the
//! same one): the wires' received payloads, and the collectives' working
//! buffers and copies of frames sent later. It keeps at most its budget of
//! idle bytes ([`pool::BufferPool::DEFAULT_BUDGET`], 256 MiB, unless the
//! configs' `pool` says otherwise). The memory of an endpoint is then at
//! most: that budget idle, plus the matcher's budget of unmatched payloads
//! (`mailbox_bytes`), plus what the layer above holds (for the collectives:
//! the working buffers of ops in flight and their send windows).
//!
//! # Errors
//!
//! A lost peer (closed connection, protocol violation, killed endpoint)
//! fails every pending and later receive that names it, and every send to
//! it; other peers stay usable. [`TransportError::Closed`] poisons the whole
//! endpoint.
//!
//! # Features
//!
//! - `verbs-fake`: `verbs::fake`, an in-process fake of an RC fabric
//!   and `VerbsTransport::connect_fake` over it, for the conformance suite
//!   (`kungfu-tests`) where there is no RDMA device (test code: normal
//!   builds leave it out).
//! - `verbs`: the ibverbs wire, through sideway (libibverbs is loaded at
//!   run time; building needs cmake and libclang).
//!
//! # Thread safety and cleanup
//!
//! Endpoints are `Send + Sync` and used through `Arc`. Dropping the last
//! handle (or calling [`Transport::shutdown`]) stops the background tasks
//! and closes the connections.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use kungfu_topology::Rank;

use crate::endpoint::Matcher;
use crate::pool::BufferPool;

mod peerset;
pub use peerset::PeerSet;
pub mod any;
pub mod auth;
mod connect;
pub mod endpoint;
// libfabric's objects and the memory they write, behind the pending table.
#[cfg(feature = "fabric")]
#[allow(unsafe_code)]
pub mod fabric;
#[doc(hidden)]
pub mod fuzzing;
pub mod handshake;
pub mod header;
pub mod mem;
pub mod pool;
pub mod quic;
// Raw pointers into op memory, behind the share table.
#[allow(unsafe_code)]
pub mod region;
// The other module with unsafe code: mapped memory, atomics in it, futexes.
#[allow(unsafe_code)]
pub mod shm;
pub mod tcp;
// ibverbs: queue pairs, registered memory and remote writes, every call
// into libibverbs behind one seam (`verbs::seam`).
#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;
pub mod wire;

pub use endpoint::{Arrival, RecvKey};
pub use header::{
    ClusterVersion, Epoch, FrameKind, Generation, Header, HeaderError, OpId, OpTag, HEADER_LEN,
};
pub use region::{Mem, MemMut, Region};
pub use tokio::time::Instant;

/// A received frame.
#[derive(Clone, Debug)]
pub struct Frame {
    pub from: Rank,
    pub header: Header,
    pub payload: Bytes,
}

/// What a backend can do, so algorithms and the scheduler can adapt
/// without asking which backend it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// The backend's name (`"tcp"`, `"mem"`, ...).
    pub name: &'static str,
    /// The largest payload one frame may carry.
    pub max_frame: usize,
    /// Whether a send moves the caller's bytes without copying them
    /// (shared memory, RDMA).
    pub zero_copy: bool,
    /// Whether buffers must be registered before use (RDMA). Backends that
    /// need it register and cache internally; it is never a method another
    /// backend must fake.
    pub needs_registration: bool,
}

/// Why a transport operation failed.
///
/// [`TransportError::PeerLost`] concerns one peer: the others stay usable.
/// [`TransportError::Closed`] means the endpoint is shut down. Timeouts
/// leave the endpoint usable.
#[derive(Clone, Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{peer} is lost: {reason}")]
    PeerLost { peer: Rank, reason: Arc<str> },
    #[error("handshake with {addr}{}: {reason}", peer.map(|p| format!(" ({p})")).unwrap_or_default())]
    Handshake {
        peer: Option<Rank>,
        addr: String,
        reason: String,
    },
    #[error("timed out waiting for {what}")]
    Timeout { what: String },
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: usize, max: usize },
    #[error("refused a frame of {frame} from {peer}: this endpoint is at {current}")]
    StaleEpoch {
        peer: Rank,
        frame: Epoch,
        current: Epoch,
    },
    #[error("{peer} is not a peer of this cluster of {size}")]
    NoSuchPeer { peer: Rank, size: usize },
    #[error("transport is shut down")]
    Closed,
    /// A transport this machine cannot run (no RDMA device, no provider):
    /// says what is missing.
    #[error("transport {transport} is not available here: {reason}")]
    Unavailable { transport: String, reason: String },
    /// Certificates or keys that cannot be used (QUIC's mutual TLS).
    #[error("TLS: {0}")]
    Tls(String),
}

/// A byte mover between the ranks of one cluster version.
///
/// Implementations are cheap to share (`Arc`) and every method may be called
/// from many tasks at once. Frames between one pair of ranks may arrive in
/// any order (the collectives do not rely on order).
///
/// A backend implements the methods that move bytes and gives its
/// [`Matcher`]; the methods that only read or change the matcher's state
/// (epochs, retiring, strays, lost peers, and a receive that does not
/// spin) are provided on top of it (see [`endpoint`]).
pub trait Transport: Send + Sync + 'static {
    /// This endpoint's rank.
    fn rank(&self) -> Rank;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// The matcher that this endpoint's readers deliver into and its
    /// receives take from: its epoch, unmatched frames, strays and lost
    /// peers.
    fn matcher(&self) -> &Matcher;

    /// The buffer pool of this endpoint's process (see [`pool`]): its
    /// wires' received payloads come from it, and the collectives take
    /// their working buffers and the copies of frames sent later from it,
    /// so one budget bounds the idle buffers of all of them.
    fn pool(&self) -> &Arc<BufferPool>;

    /// The cluster version this endpoint was connected at; fixed for its
    /// life (a resize connects a new endpoint).
    fn version(&self) -> ClusterVersion;

    /// The epoch of this endpoint: the one it was connected at, or the
    /// last it advanced to.
    fn epoch(&self) -> Epoch {
        self.matcher().epoch()
    }

    /// Advances to `epoch` (a consistency barrier passed: no op of an
    /// older epoch is in flight here). Frames of older epochs are refused
    /// from now on and queued ones dropped; frames of `epoch` that arrived
    /// early are kept. Never goes back.
    fn advance_epoch(&self, epoch: Epoch) {
        self.matcher().advance_epoch(epoch);
    }

    fn capabilities(&self) -> Capabilities;

    /// Sends one frame. `header.len` is set from `payload`. Resolves when
    /// the payload has been handed to the backend (it may be reused at
    /// once, as `Bytes` is immutable). Dropping the future does not cut a
    /// frame in half: a frame is sent whole or not at all.
    fn send(
        &self,
        to: Rank,
        header: Header,
        payload: Bytes,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Sends one frame from a range of the op's memory, lent until the send
    /// resolves (see [`wire::Caps::borrows_sends`]: only a wire that lets
    /// go of the payload by then may be given one; the driver asks
    /// [`Transport::peer_caps`]). The default sends it as
    /// [`Bytes::from_owner`].
    fn send_mem(
        &self,
        to: Rank,
        header: Header,
        payload: Mem,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        self.send(to, header, Bytes::from_owner(payload))
    }

    /// Receives the next frame of op instance `tag` from any rank in
    /// `from`. Fails with [`TransportError::PeerLost`] once a rank in `from`
    /// is lost and no frame of `tag` is queued, and with
    /// [`TransportError::Timeout`] at `deadline`. Cancel-safe: dropping the
    /// future loses no frame. The default waits on the matcher at once; a
    /// backend that can move frames in while the receive spins overrides it.
    fn recv<'a>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
    ) -> impl Future<Output = Result<Frame, TransportError>> + Send + 'a {
        self.matcher().recv(tag, from, deadline)
    }

    /// The receive of an op that posts receives and takes frames in
    /// place: like [`Transport::recv`], but it also returns
    /// [`Arrival::Landed`] for a receive posted with
    /// [`Transport::post_recv`], and a backend that holds frames in memory
    /// it can lend (shared memory: the ring) first offers the payload of a
    /// frame of `tag` in place to `apply`, in one or two pieces; if `apply`
    /// returns true it has consumed the frame, which then costs no copy and
    /// no allocation, and this resolves to [`Arrival::Applied`]. Otherwise
    /// the frame comes back owned, as [`Arrival::Frame`]. `apply` must not
    /// block. The default lends nothing.
    fn recv_in_place<'a, F>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
        apply: F,
    ) -> impl Future<Output = Result<Arrival, TransportError>> + Send + 'a
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool + Send + 'a,
    {
        drop(apply);
        self.matcher().recv_arrival(tag, from, deadline)
    }

    /// Posts a receive: the data frame `key` names is written into `mem`,
    /// a range of the op's memory, by whichever wire carries it (or copied
    /// in, if it came before this). `Ok(Some(header))` when it is there
    /// already; `Ok(None)` when posted: a receive then returns
    /// [`Arrival::Landed`] for it. A frame of that key with another length
    /// is not landed: it arrives as a frame, for the op to refuse.
    ///
    /// The share `mem` is held until the frame lands or the op is retired
    /// ([`Transport::retire`]); a wire that is writing it keeps it (and
    /// with it the region) alive past that, so memory is never freed
    /// under a write.
    fn post_recv(&self, key: RecvKey, mem: MemMut) -> Result<Option<Header>, TransportError> {
        self.matcher().post(key, mem)
    }

    /// What the wire that carries frames to and from `peer` can do (see
    /// [`wire::Caps`]): the op driver reads it to choose how to send (inject,
    /// hold, lend the range, or copy) and which receives to post. `None`
    /// for this rank and unreachable ones.
    fn peer_caps(&self, peer: Rank) -> Option<wire::Caps> {
        let _ = peer;
        None
    }

    /// Ends op instance `tag` (done or failed): its queued and later frames
    /// no longer hold memory. Their headers become *strays*, readable with
    /// [`Transport::recv_stray`] (a bounded number of them).
    fn retire(&self, tag: OpTag) {
        self.matcher().retire(tag);
    }

    /// The next stray: the header of a frame (payload dropped) that arrived
    /// for a retired op instance. A late frame is how a rank learns that a
    /// peer ran an op with another spec after it had finished its own.
    fn recv_stray(
        &self,
        deadline: Instant,
    ) -> impl Future<Output = Result<Frame, TransportError>> + Send + '_ {
        self.matcher().recv_stray(deadline)
    }

    /// The losses found here and not told yet, as [`FrameKind::Lost`]
    /// frames for every peer (taken: the liveness watchdog, which tells
    /// them otherwise, will not). A failed op sends them with its aborts
    /// before its caller hears of the failure, so that a worker that exits
    /// on the error has told its peers whom it lost (else they blame it).
    fn take_loss_notices(&self) -> Vec<(Header, bytes::Bytes)> {
        self.matcher()
            .take_notices()
            .into_iter()
            .map(|(lost, why)| self.loss_notice(lost, &why))
            .collect()
    }

    /// The [`FrameKind::Lost`] frame that tells a peer that `lost` is lost
    /// here, and why (a peer takes it as hearsay: see [`Matcher::hearsay`]).
    fn loss_notice(&self, lost: Rank, why: &str) -> (Header, bytes::Bytes) {
        endpoint::loss_notice(self.matcher().epoch(), lost, why)
    }

    /// The first lost rank in `peers`, with the reason, if any.
    fn check_peers(&self, peers: &PeerSet) -> Result<(), TransportError> {
        self.matcher().check_peers(peers)
    }

    /// Like [`Transport::check_peers`], for receiving op instance `tag`: a
    /// lost rank from which frames of `tag` are still queued is no reason
    /// to fail yet (a broadcast root may send everything and leave).
    fn check_peers_for(&self, tag: OpTag, peers: &PeerSet) -> Result<(), TransportError> {
        self.matcher().check_peers_for(tag, peers)
    }

    /// Every lost rank in `peers` from which no frame of `tag` is queued,
    /// the first lost first (a [`TransportError::PeerLost`] each), or
    /// [`TransportError::Closed`].
    fn lost_for(&self, tag: OpTag, peers: &PeerSet) -> Result<Vec<TransportError>, TransportError> {
        self.matcher().lost_for(tag, peers)
    }

    /// Sends a frame at once straight from the caller's bytes, if the
    /// backend can without waiting (shared memory with room in the ring):
    /// `Ok(true)` when sent, `Ok(false)` when the caller must use
    /// [`Transport::send`]. Saves the copy into an owned buffer.
    fn try_send_now(
        &self,
        to: Rank,
        header: Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        let _ = (to, header, payload);
        Ok(false)
    }

    /// Closes gracefully: every frame already sent reaches its peer, the
    /// peers are told this endpoint is done, and the endpoint waits up to
    /// `linger` for them to finish with it too; then as [`Transport::shutdown`].
    /// Call it when a worker is done, before the process exits.
    fn close(&self, linger: std::time::Duration) -> impl Future<Output = ()> + Send + '_;

    /// Stops the endpoint at once: pending and later operations fail with
    /// [`TransportError::Closed`], frames in flight may be lost. Idempotent.
    fn shutdown(&self);

    /// A capability of type `ty` that one of this transport's wires offers
    /// beyond moving frames ([`wire::Extension`]), e.g. the shared-memory
    /// lanes of the host fast path ([`shm::lane::HostLanes`]). `None` when
    /// no wire offers one.
    fn extension(&self, ty: std::any::TypeId) -> Option<wire::Extension> {
        let _ = ty;
        None
    }

    /// [`Transport::extension`] of type `E`, typed.
    fn extension_of<E: std::any::Any + Send + Sync>(&self) -> Option<Arc<E>>
    where
        Self: Sized,
    {
        self.extension(std::any::TypeId::of::<E>())?
            .downcast::<E>()
            .ok()
    }
}

/// CPUs of this host that the job may use: the cgroup's cpuset if there is
/// one, else the online CPUs. Not this process's affinity, which a
/// launcher that pins each rank to a core narrows to one.
pub fn host_cpus() -> usize {
    let count = |list: &str| -> usize {
        list.trim()
            .split(',')
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once('-') {
                Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                    (Ok(a), Ok(b)) if b >= a => b - a + 1,
                    _ => 1,
                },
                None => 1,
            })
            .sum()
    };
    for path in [
        "/sys/fs/cgroup/cpuset.cpus.effective",
        "/sys/devices/system/cpu/online",
    ] {
        if let Ok(list) = std::fs::read_to_string(path) {
            let c = count(&list);
            if c > 0 {
                return c;
            }
        }
    }
    std::thread::available_parallelism().map_or(1, |c| c.get())
}
