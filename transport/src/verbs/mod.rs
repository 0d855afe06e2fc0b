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

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::net::TcpListener;
use tokio::sync::Mutex as AsyncMutex;

use self::bootstrap::{accept_higher, dial_lower, random_psn, ready_all, watch};
use self::core::{Core, Hold, Layout};
use self::proto::QpInfo;
use self::seam::Verbs;
use crate::connect;
use crate::endpoint::{Endpoint, EndpointConfig, Matcher, Pump, RecvKey};
use crate::handshake::Identity;
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::wire::{Apply, Caps, Tasks, Wire};
use crate::{Header, Instant, OpTag, PeerSet, TransportError};

mod arrive;
mod bootstrap;
mod config;
mod core;
#[cfg(any(test, feature = "verbs-fake"))]
pub mod fake;
mod posted;
mod progress;
mod proto;
mod seam;
mod send;
mod sys;
#[cfg(test)]
mod tests;

pub use self::config::VerbsConfig;

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
