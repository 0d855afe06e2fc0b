//! ibverbs backend: a reliable-connected (RC) queue pair per peer, frames
//! sent from registered memory, the large ones RDMA-written straight into
//! the receiver's op memory. Built with the feature `verbs`, through
//! [sideway](https://docs.rs/sideway), which loads libibverbs at run time
//! (a build needs cmake and libclang, not rdma-core; a run needs
//! rdma-core's libibverbs1 and a provider, and an RDMA device).
//!
//! # Why sideway, not the `ibverbs` crate
//!
//! The `ibverbs` crate (0.9) posts work requests only from memory regions
//! it allocated itself (an op's buffer, which rendezvous writes into,
//! cannot be registered in place), has no RDMA write with immediate, no
//! completion channel (its users spin on the CQ, burning a core while
//! idle), and links libibverbs into the program. sideway registers any
//! buffer, has both, and loads libibverbs at run time, so a build with the
//! feature still starts on a machine without rdma-core.
//!
//! # Without a device
//!
//! [`VerbsTransport::connect`] (and [`probe`]) fail with
//! [`TransportError::Unavailable`] and say what is missing: libibverbs,
//! kernel support (`/sys/class/infiniband_verbs`), any device, the device
//! named in [`VerbsConfig::device`], or an active port: the error on
//! which a job that asked for `auto` falls back to another wire, and logs
//! the reason.
//!
//! # Protocol
//!
//! **Bootstrap.** A TCP connection per pair of ranks on the peer list's
//! addresses, opened with the shared handshake ([`crate::handshake`]):
//! each side sends a `QpInfo` for the queue pair it made for the other
//! (QP number, first PSN, LID, GID, MTU, eager limit), moves its pair
//! INIT -> RTR -> RTS, then writes `RTS!` and waits for the peer's, so
//! that nothing is sent to a pair that cannot receive yet. The
//! connection stays open as the control link: its end is the end of the
//! peer, and on close each side writes its goodbye there (`BYE!` and how
//! many frames it sent), which the peer waits for before it calls the
//! link closed.
//!
//! **Eager frames** (at most [`VerbsConfig::eager_max`] bytes) are copied
//! with their header into a registered send slot and sent
//! (`SEND_WITH_IMM`) into one of the [`VerbsConfig::eager_slots`] receive
//! slots each pair keeps posted; the receiver lands the frame in a posted
//! receive or queues it in its matcher, and posts the slot again. When
//! the matcher is full the slot stays unposted until the frame is taken,
//! and the sender's adapter retries (RNR, without end): back pressure.
//!
//! **Rendezvous** (larger frames, which the collectives receive only into
//! posted memory, [`Caps::eager_max`]): the receiver's
//! [`Wire::post_recv`] registers the op's region (once: the registration
//! is kept in the region) and sends the sender `Ready(rid)`: the frame's
//! key, its length, the address and `rkey` to write to. The sender, once
//! its frame and a matching `Ready` meet, posts an `RDMA_WRITE` of the
//! payload straight from the op's memory (registered likewise), then
//! `SEND_WITH_IMM` of the header with the immediate `Done(rid)`. RC
//! executes a pair's requests in order, so the receiver's completion of
//! `Done` means the payload is in place: it checks the header against
//! what it posted and lands the frame. (An `RDMA_WRITE_WITH_IMM` would
//! carry the receive id, but not the 40-byte header, whose spec digest
//! the receiver must check: hence the write and a small send.)
//!
//! **Withdrawn receives.** A receive posted for an op that ended
//! (retired, an older epoch) cannot simply be dropped: the sender may be
//! writing into it. The receiver sends `Cancel(rid)`; the sender answers
//! `CancelAck(rid)` if it had not used the `Ready`, else its `Done` is
//! already on the way; either releases the memory.
//!
//! **Memory.** Every buffer handed to the adapter (a send slot, an eager
//! slot, a payload and its registration, a rendezvous receive's range) is
//! held by the entry of its work request until its completion, or until
//! its queue pair is in the error state (a lost peer, shutdown) and, at
//! the latest, destroyed with the wire. Messages and work requests are
//! built by the pure functions of `proto`; every call into libibverbs
//! goes through the `seam::Verbs` trait, which the tests implement with
//! an in-process fake (a simulated RC fabric), so the protocol is tested
//! without a device.
//!
//! **Failures.** A completion in error (other than a flush) or a protocol
//! violation loses its peer: the pair is moved to the error state, its
//! receives and sends fail with [`TransportError::PeerLost`]; other peers
//! are unaffected.
//!
//! # SoftRoCE: running it without an RDMA NIC
//!
//! The kernel's `rdma_rxe` driver emulates RoCE v2 over any Ethernet
//! interface (not `lo`). As root, on a host (or a privileged container
//! that sees the host's `/dev/infiniband`):
//!
//! ```text
//! apt-get install rdma-core ibverbs-providers ibverbs-utils iproute2
//! modprobe rdma_rxe
//! rdma link add rxe0 type rxe netdev eth0     # the interface with the job's IPs
//! rdma link show                              # rxe0/1 state ACTIVE
//! ibv_devinfo -d rxe0                         # port 1: PORT_ACTIVE
//! ulimit -l unlimited                         # registered memory is locked
//! KUNGFU_TEST_IB_DEVICE=rxe0 cargo test -p kungfu-transport --features verbs verbs::
//! ```
//!
//! The tests that need a device are ignored unless `KUNGFU_TEST_IB_DEVICE`
//! names one (read when the crate is built); everything else (queue pair transitions, work requests,
//! completion handling, and the whole wire over the fake, also through
//! the conformance suite with `-p kungfu-tests --features verbs`) runs
//! anywhere.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex as AsyncMutex;

use self::core::{Core, Hold, Layout};
use self::proto::QpInfo;
use self::seam::Verbs;
use crate::connect::{self, Incoming};
use crate::endpoint::{Endpoint, EndpointConfig, Matcher, Pump, RecvKey, CLOSED_BY_PEER};
use crate::handshake::Identity;
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::wire::{Apply, Caps, Tasks, Wire};
use crate::{ClusterVersion, Epoch, Header, Instant, OpTag, PeerSet, TransportError};

mod arrive;
mod core;
#[cfg(any(test, feature = "verbs-fake"))]
pub mod fake;
mod progress;
mod proto;
mod seam;
mod sys;
#[cfg(test)]
mod tests;

/// Settings of a verbs endpoint.
#[derive(Clone)]
pub struct VerbsConfig {
    pub cluster_id: u64,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub rank: Rank,
    pub peers: PeerList,
    /// The job's secret: every peer must prove it holds it (see
    /// [`crate::handshake`]); `None`: links are not authenticated.
    pub secret: Option<crate::auth::JobSecret>,
    /// The RDMA device (`mlx5_0`, `rxe0`); `None`: the first.
    pub device: Option<String>,
    /// The GID index of port 1; `None`: a RoCE v2 GID (IPv4-mapped first),
    /// else 0.
    pub gid_index: Option<u8>,
    pub connect_timeout: Duration,
    pub max_frame: usize,
    pub mailbox_bytes: usize,
    pub pool: Option<Arc<BufferPool>>,
    /// How long the progress task keeps polling after activity before it
    /// sleeps on the completion channel.
    pub spin: Duration,
    /// Frames up to this size go eagerly into the receive slots; larger
    /// ones only into receives posted for them (rendezvous). Every rank
    /// must use the same (checked at connect).
    pub eager_max: usize,
    /// Receive slots kept posted per peer (of `eager_max` bytes and a
    /// header each); twice as many send slots are shared by all peers.
    pub eager_slots: usize,
}

impl VerbsConfig {
    /// Defaults: 30 s to connect, 64 MiB frames, a 256 MiB mailbox, 16 KiB
    /// eager frames into 32 slots per peer, 50 us of polling after
    /// activity.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: PeerList,
        device: Option<String>,
    ) -> VerbsConfig {
        VerbsConfig {
            cluster_id,
            version,
            epoch,
            rank,
            peers,
            secret: None,
            device,
            gid_index: None,
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            pool: None,
            spin: Duration::from_micros(50),
            eager_max: 16 << 10,
            eager_slots: 32,
        }
    }

    fn identity(&self) -> Identity {
        Identity::of(
            self.cluster_id,
            self.version,
            self.epoch,
            self.rank,
            &self.peers,
            self.secret.as_ref(),
        )
        .expect("the rank is checked at connect")
    }

    fn layout(&self) -> Layout {
        Layout {
            me: self.rank,
            size: self.peers.len(),
            eager_max: self.eager_max,
            slots: self.eager_slots,
            send_slots: 2 * self.eager_slots,
            sq_depth: (2 * self.eager_slots).max(16),
            max_frame: self.max_frame,
            spin: self.spin,
        }
    }

    /// Limits the wire's encodings put on a config.
    fn check(&self) -> Result<(), String> {
        if self.peers.len() >= 1 << 24 {
            return Err(format!("{} ranks: at most 2^24", self.peers.len()));
        }
        if self.max_frame > i32::MAX as usize {
            return Err(format!("max_frame {}: at most 2 GiB", self.max_frame));
        }
        if self.eager_max > 64 << 20 {
            return Err(format!("eager_max {}: at most 64 MiB", self.eager_max));
        }
        if self.eager_slots == 0 {
            return Err("eager_slots must be at least 1".into());
        }
        Ok(())
    }
}

/// Checks whether RDMA device `device` (or any) can be used here, without
/// connecting: its name, or [`TransportError::Unavailable`] saying what is
/// missing (what `auto` logs when it falls back).
pub fn probe(device: Option<&str>) -> Result<String, TransportError> {
    sys::probe(device).map_err(unavailable)
}

fn unavailable(reason: String) -> TransportError {
    TransportError::Unavailable {
        transport: "verbs".into(),
        reason,
    }
}

/// A verbs endpoint: the generic [`Endpoint`] over one [`VerbsWire`].
pub type VerbsTransport = Endpoint<VerbsWire>;

/// The ibverbs wire. See the module docs.
pub struct VerbsWire {
    me: Rank,
    size: usize,
    core: Arc<Core>,
    device: String,
    /// The write halves of the control links, for the goodbyes (dropped
    /// on shutdown: the peers see the link end).
    links: connect::ControlLinks,
    progress: Tasks,
    watchers: Tasks,
}

impl Endpoint<VerbsWire> {
    /// Opens the RDMA device and connects to every peer of `config.peers`
    /// (the bootstrap listens on `listener`).
    pub async fn connect(
        config: VerbsConfig,
        listener: TcpListener,
    ) -> Result<Arc<VerbsTransport>, TransportError> {
        let (rank, size, version) = (config.rank, config.peers.len(), config.version);
        let (wire, matcher, pool, cfg) = VerbsWire::connect(config, listener).await?;
        let wires = vec![wire];
        let e = Endpoint::new(rank, size, version, "verbs", matcher, pool, wires, cfg);
        Ok(Arc::new(e))
    }
}

#[cfg(any(test, feature = "verbs-fake"))]
impl Endpoint<VerbsWire> {
    /// As [`VerbsTransport::connect`], over the in-process fake fabric
    /// `net` instead of a device (tests; the bootstrap is the real one).
    pub async fn connect_fake(
        config: VerbsConfig,
        listener: TcpListener,
        net: Arc<fake::FakeNet>,
    ) -> Result<Arc<VerbsTransport>, TransportError> {
        let (rank, size, version) = (config.rank, config.peers.len(), config.version);
        let open = move |l: &Layout| Ok(Box::new(net.open(l.me, l.size)) as Box<dyn Verbs>);
        let (wire, matcher, pool, cfg) = VerbsWire::connect_with(config, listener, open).await?;
        let wires = vec![wire];
        let e = Endpoint::new(rank, size, version, "verbs", matcher, pool, wires, cfg);
        Ok(Arc::new(e))
    }
}

/// What the wire's parts are, once connected.
type Connected = (VerbsWire, Arc<Matcher>, Arc<BufferPool>, EndpointConfig);

impl VerbsWire {
    /// [`VerbsTransport::connect`]'s wire, with its matcher, pool and how
    /// its endpoint should receive.
    pub async fn connect(
        config: VerbsConfig,
        listener: TcpListener,
    ) -> Result<Connected, TransportError> {
        let (device, gid) = (config.device.clone(), config.gid_index);
        Self::connect_with(config, listener, move |layout| {
            sys::Sys::open(device.as_deref(), gid, layout).map(|s| Box::new(s) as Box<dyn Verbs>)
        })
        .await
    }

    /// As [`VerbsWire::connect`], over the verbs `open` gives.
    pub(crate) async fn connect_with(
        config: VerbsConfig,
        listener: TcpListener,
        open: impl FnOnce(&Layout) -> Result<Box<dyn Verbs>, String>,
    ) -> Result<Connected, TransportError> {
        Identity::of(
            config.cluster_id,
            config.version,
            config.epoch,
            config.rank,
            &config.peers,
            config.secret.as_ref(),
        )?;
        config.check().map_err(|reason| TransportError::Handshake {
            peer: None,
            addr: String::new(),
            reason,
        })?;
        let layout = config.layout();
        let verbs = open(&layout).map_err(unavailable)?;
        let device = verbs.device();
        let matcher = Arc::new(Matcher::new(config.epoch, config.mailbox_bytes));
        let pool = config
            .pool
            .clone()
            .unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
        let core = Core::new(verbs, matcher.clone(), pool.clone(), layout).map_err(unavailable)?;
        let core = Arc::new(core);
        let n = config.peers.len();
        let psns: Vec<u32> = (0..n).map(|_| random_psn()).collect();
        // (this rank's own entry is never sent)
        let infos: Vec<QpInfo> = (0..n).map(|r| core.info(Rank(r as u32), psns[r])).collect();
        let deadline = Instant::now() + config.connect_timeout;
        let cfg = Arc::new(config);
        let infos = Arc::new(infos);
        let (dialed, accepted) = tokio::join!(
            dial_lower(&cfg, &infos, deadline),
            accept_higher(&cfg, &infos, listener, deadline)
        );
        let mut links = dialed?;
        links.extend(accepted?);
        for (peer, (_, remote)) in &links {
            let handshake = |reason: String| TransportError::Handshake {
                peer: Some(*peer),
                addr: String::new(),
                reason,
            };
            if remote.eager_max as usize != cfg.eager_max {
                return Err(handshake(format!(
                    "eager limit {} there, {} here: every rank must use the same",
                    remote.eager_max, cfg.eager_max
                )));
            }
            core.connect_qp(*peer, psns[peer.idx()], remote)
                .map_err(handshake)?;
        }
        ready_all(&mut links, deadline).await?;
        let progress = Tasks::new(vec![tokio::spawn(progress::run(core.clone()))]);
        let (mut writers, mut watchers) = (Vec::with_capacity(n), Vec::new());
        for r in 0..n {
            let peer = Rank(r as u32);
            let Some((s, _)) = links.remove(&peer) else {
                writers.push(AsyncMutex::new(None));
                continue;
            };
            let (rd, wr) = s.into_split();
            watchers.push(tokio::spawn(watch(rd, peer, core.clone())));
            writers.push(AsyncMutex::new(Some(wr)));
        }
        let wire = VerbsWire {
            me: cfg.rank,
            size: n,
            core,
            device,
            links: writers,
            progress,
            watchers: Tasks::new(watchers),
        };
        let ecfg = EndpointConfig {
            spin: cfg.spin,
            oversubscribed: cfg.peers.local_size(cfg.rank) > crate::host_cpus(),
        };
        Ok((wire, matcher, pool, ecfg))
    }

    /// The RDMA device.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Frames written straight into receives posted for them (above the
    /// eager limit), so far.
    pub fn frames_posted(&self) -> u64 {
        self.core.posted_landed.load(Ordering::Relaxed)
    }
}

/// A random first packet sequence number (24 bits).
fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    (h.finish() & 0xff_ffff) as u32
}

type Link = (TcpStream, QpInfo);

/// Sends `mine` and reads the peer's (the dialer writes first). A link
/// that breaks may be tried again; a peer that is not a verbs wire may not.
async fn exchange(
    s: &mut TcpStream,
    mine: &QpInfo,
    dialer: bool,
) -> Result<QpInfo, (bool, String)> {
    let out = mine.encode();
    let mut got = [0u8; QpInfo::LEN];
    let send = |e: std::io::Error| (true, format!("send queue pair info: {e}"));
    let read = |e: std::io::Error| (true, format!("read queue pair info: {e}"));
    if dialer {
        s.write_all(&out).await.map_err(send)?;
        s.read_exact(&mut got).await.map_err(read)?;
    } else {
        s.read_exact(&mut got).await.map_err(read)?;
        s.write_all(&out).await.map_err(send)?;
    }
    QpInfo::decode(&got).map_err(|e| (false, e))
}

/// Tells every peer this rank's pair to it is ready to send (so it can
/// receive), and waits for each to say the same.
async fn ready_all(
    links: &mut HashMap<Rank, Link>,
    deadline: Instant,
) -> Result<(), TransportError> {
    const READY: &[u8; 4] = b"RTS!";
    let fail = |peer: Rank, reason: String| TransportError::Handshake {
        peer: Some(peer),
        addr: String::new(),
        reason,
    };
    for (peer, (s, _)) in links.iter_mut() {
        s.write_all(READY)
            .await
            .map_err(|e| fail(*peer, format!("send ready: {e}")))?;
    }
    for (peer, (s, _)) in links.iter_mut() {
        let mut b = [0u8; 4];
        match tokio::time::timeout_at(deadline, s.read_exact(&mut b)).await {
            Ok(Ok(_)) if &b == READY => {}
            Ok(Ok(_)) => return Err(fail(*peer, "bad ready".into())),
            Ok(Err(e)) => return Err(fail(*peer, format!("read ready: {e}"))),
            Err(_) => return Err(fail(*peer, "not ready before the deadline".into())),
        }
    }
    Ok(())
}

async fn dial_lower(
    cfg: &Arc<VerbsConfig>,
    infos: &Arc<Vec<QpInfo>>,
    deadline: Instant,
) -> Result<HashMap<Rank, Link>, TransportError> {
    let lower = (0..cfg.rank.0).map(Rank);
    connect::dial_all(lower, |peer| {
        let (cfg, infos) = (cfg.clone(), infos.clone());
        async move {
            let p = cfg.peers.peer(peer).expect("peer below our rank");
            let me = cfg.identity();
            connect::dial(peer, p.to_string(), deadline, || async {
                let mut s = connect::tcp_hello(p, &me, peer).await?;
                let remote = exchange(&mut s, &infos[peer.idx()], true).await?;
                Ok((s, remote))
            })
            .await
        }
    })
    .await
}

async fn accept_higher(
    cfg: &Arc<VerbsConfig>,
    infos: &Arc<Vec<QpInfo>>,
    listener: TcpListener,
    deadline: Instant,
) -> Result<HashMap<Rank, Link>, TransportError> {
    let wanted: Vec<Rank> = (cfg.rank.0 + 1..cfg.peers.len() as u32).map(Rank).collect();
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let incoming = || async {
        match listener.accept().await {
            Ok((s, addr)) => Incoming::Conn(s, addr.to_string()),
            Err(e) => Incoming::Failed(format!("accept: {e}")),
        }
    };
    let answer = |mut s: TcpStream| {
        let (cfg, infos) = (cfg.clone(), infos.clone());
        async move {
            let may_dial = |r: Rank| r > cfg.rank;
            let from = connect::tcp_answer(&mut s, &cfg.identity(), may_dial).await?;
            let remote = exchange(&mut s, &infos[from.idx()], false)
                .await
                .map_err(|(_, e)| e)?;
            Ok((from, (s, remote)))
        }
    };
    connect::accept(&wanted, &local, deadline, Some(cfg.rank), incoming, answer).await
}

/// Watches the control link of `peer`: its goodbye (then waits until its
/// frames all arrived), or its end, is the end of the peer.
async fn watch(mut rd: OwnedReadHalf, peer: Rank, core: Arc<Core>) {
    let mut b = [0u8; 12];
    let (why, broken) = match rd.read_exact(&mut b).await {
        Ok(_) if b[..4] == *b"BYE!" => {
            let sent = u64::from_le_bytes(b[4..].try_into().expect("8 bytes"));
            // its frames may still be in flight: wait for them (the close
            // that reads this bounds the wait)
            while core.received[peer.idx()].load(Ordering::Relaxed) < sent {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (CLOSED_BY_PEER.to_string(), false)
        }
        Ok(_) => (
            "protocol violation: bad goodbye on the control link".to_string(),
            true,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            (CLOSED_BY_PEER.to_string(), true)
        }
        Err(e) => (format!("control link: {e}"), true),
    };
    core.lose(peer, why, broken);
}

impl Wire for VerbsWire {
    fn caps(&self) -> Caps {
        Caps {
            name: "verbs",
            max_frame: self.core.layout.max_frame,
            inject: false,
            holds_sends: false,
            // a spinning receive reads the completion queue itself
            polled: true,
            lends: false,
            // a send resolves at its completion: the adapter is done with
            // the op's memory
            borrows_sends: true,
            eager_max: self.core.layout.eager_max,
            needs_registration: true,
        }
    }

    fn reaches(&self, peer: Rank) -> bool {
        peer != self.me && peer.idx() < self.size
    }

    /// Registers regions that can hold a frame above the eager limit
    /// (smaller frames are copied through the wire's own slots).
    fn register(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        if region.len() > self.core.layout.eager_max {
            self.core
                .region_reg(region, false)
                .map_err(|why| core::unavailable(format!("registering memory: {why}")))?;
        }
        Ok(())
    }

    fn post_recv(&self, key: RecvKey, mem: MemMut) -> Result<Option<MemMut>, TransportError> {
        self.core.post(key, mem)
    }

    fn pump(&self, _tag: OpTag, _from: &PeerSet, _apply: Option<Apply<'_>>) -> Pump {
        Pump::moved(self.core.progress(false).is_ok_and(|n| n > 0))
    }

    fn going_to_sleep(&self) {
        self.core.wake.notify_one();
    }

    async fn send(&self, to: Rank, header: Header, payload: Bytes) -> Result<(), TransportError> {
        self.core.send(to, header, Hold::Bytes(payload)).await
    }

    async fn send_mem(&self, to: Rank, header: Header, payload: Mem) -> Result<(), TransportError> {
        self.core.send(to, header, Hold::Mem(payload)).await
    }

    async fn close(&self, linger: Duration) {
        let deadline = Instant::now() + linger;
        self.core.closing.store(true, Ordering::Release);
        // every send completed, then the goodbyes (the progress task keeps
        // reading what the peers send until they say theirs)
        while self.core.sends_in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        connect::say_goodbyes(&self.links, &self.core.sent, deadline).await;
        // what the peers sent, until each said goodbye too
        self.watchers.join_until(deadline).await;
        self.shutdown();
    }

    fn shutdown(&self) {
        self.core.shutdown();
        self.progress.abort();
        self.watchers.abort();
        connect::drop_links(&self.links);
    }
}

impl Drop for VerbsWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}
