//! libfabric backend (RDMA through OFI): one reliable-datagram endpoint
//! (`FI_EP_RDM`) per rank, tagged messages, receives posted straight into
//! the op's memory (the `post` module says how frames travel, `core` what
//! holds their memory, `progress` what reads their completions).
//!
//! The parts: the settings (`config`), the bootstrap links (`bootstrap`),
//! which stay open as control links (`control`), libfabric's objects and
//! calls (`ofi`), and the wire's operations in flight (`core`, `post`,
//! `progress`).
//!
//! **Providers.** [`FabricConfig::provider`] names one (`verbs;ofi_rxm` or
//! `efa` on clusters; `tcp;ofi_rxm` and `shm` work on any Linux host), or
//! leaves the choice to libfabric, which honours `FI_PROVIDER`. The bindings
//! are our own thin `kungfu-fabric-sys` over the system library.
//!
//! **Bootstrap.** The endpoint addresses (`fi_getname`) are exchanged over
//! the job's existing bootstrap: a TCP connection per pair of ranks on the
//! peer list's addresses, opened with the shared handshake
//! ([`crate::handshake`]), as the TCP wire does. Each rank inserts every
//! address in rank order into a table AV, so rank `r` is address `r`. The
//! connections stay open as control links: a peer whose link breaks is
//! lost (libfabric itself may not notice a silent peer), and on close each
//! side writes its goodbye there: `BYE!` and how many frames it sent this
//! peer, which the peer waits for before it calls the link closed.
//! Heartbeats and loss notices ([`FrameKind::Heartbeat`](crate::FrameKind::Heartbeat),
//! [`FrameKind::Lost`](crate::FrameKind::Lost)) go on the control links too, not through the
//! fabric: `FRM!`, the frame's header and its payload (at most
//! [`MAX_BEACON`](crate::endpoint::MAX_BEACON) bytes). Through the fabric they would take the
//! receiver's eager slots, which the ops' frames need (under load a
//! barrier's last sends once waited behind them).
//!
//! **Registration.** Where the provider needs local buffers registered
//! (`FI_MR_LOCAL`, e.g. verbs), the wire declares
//! [`Caps::needs_registration`]: an op's region is registered once and the
//! registration kept in the region (the registration cache), dropped with
//! it. [`FabricConfig::register_always`] takes that path on providers that
//! do not need it, to test it without hardware.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::net::TcpListener;
use tokio::sync::Mutex as AsyncMutex;

use self::bootstrap::{accept_higher, dial_lower};
use self::control::{on_control_link, watch};
use self::core::{Core, Hold};
use self::ofi::Ofi;
use crate::connect;
use crate::endpoint::{Endpoint, EndpointConfig, Matcher, Pump, RecvKey};
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::wire::{Apply, Caps, Tasks, Wire};
use crate::{Header, Instant, OpTag, PeerSet, TransportError};

mod bootstrap;
mod config;
mod control;
mod core;
mod ofi;
mod post;
mod progress;

pub use self::config::FabricConfig;

/// The providers that mean RDMA hardware, in the order `auto` tries them.
pub const HARDWARE_PROVIDERS: [&str; 2] = ["efa", "verbs;ofi_rxm"];

/// The first of [`HARDWARE_PROVIDERS`] that libfabric offers here (it
/// honours `FI_PROVIDER`), or why none: what `auto` asks before it moves a
/// job across hosts onto the fabric.
pub fn hardware_provider() -> Result<&'static str, TransportError> {
    let mut why = Vec::new();
    for p in HARDWARE_PROVIDERS {
        match ofi::offers(Some(p)) {
            Ok(_) => return Ok(p),
            Err(e) => why.push(e),
        }
    }
    Err(unavailable(why.join("; ")))
}

/// Checks, without connecting, whether libfabric offers the endpoints the
/// wire needs from `provider` (`None`: any) here: the provider it would
/// give, or [`TransportError::Unavailable`] saying why not.
pub fn probe(provider: Option<&str>) -> Result<String, TransportError> {
    ofi::offers(provider).map_err(unavailable)
}

fn unavailable(reason: String) -> TransportError {
    TransportError::Unavailable {
        transport: "fabric".into(),
        reason,
    }
}

/// A fabric endpoint: the generic [`Endpoint`] over one [`FabricWire`].
pub type FabricTransport = Endpoint<FabricWire>;

/// The libfabric wire.
pub struct FabricWire {
    me: Rank,
    size: usize,
    core: Arc<Core>,
    /// The write halves of the control links, for the goodbyes.
    /// (Dropped on shutdown: the peers see the link end.)
    links: connect::ControlLinks,
    progress: Tasks,
    watchers: Tasks,
}

impl Endpoint<FabricWire> {
    /// Opens the fabric endpoint and connects to every peer of
    /// `config.peers` (the bootstrap listens on `listener`).
    pub async fn connect(
        config: FabricConfig,
        listener: TcpListener,
    ) -> Result<Arc<FabricTransport>, TransportError> {
        let (rank, size, version) = (config.rank, config.peers.len(), config.version);
        let (wire, matcher, pool, cfg) = FabricWire::connect(config, listener).await?;
        let e = Endpoint::new(
            rank,
            size,
            version,
            "fabric",
            matcher,
            pool,
            vec![wire],
            cfg,
        );
        Ok(Arc::new(e))
    }
}

impl FabricWire {
    /// [`FabricTransport::connect`]'s wire, with its matcher, pool and how
    /// its endpoint should receive.
    pub async fn connect(
        config: FabricConfig,
        listener: TcpListener,
    ) -> Result<(FabricWire, Arc<Matcher>, Arc<BufferPool>, EndpointConfig), TransportError> {
        let n = config.peers.len();
        config.identity_checked()?;
        let what = format!(
            "fabric{}",
            config
                .provider
                .as_ref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default()
        );
        let unavailable = |reason: String| TransportError::Unavailable {
            transport: what.clone(),
            reason,
        };
        let cq_size = (4 * config.eager_slots).max(1024);
        let ofi = Ofi::open(
            config.provider.as_deref(),
            config.domain.as_deref(),
            cq_size,
        )
        .map_err(unavailable)?;
        let name = ofi.name().map_err(unavailable)?;
        let deadline = Instant::now() + config.connect_timeout;
        let cfg = Arc::new(config);
        let (dialed, accepted) = tokio::join!(
            dial_lower(&cfg, &name, deadline),
            accept_higher(&cfg, &name, listener, deadline)
        );
        let mut links = dialed?;
        links.extend(accepted?);
        let mut names = vec![Vec::new(); n];
        names[cfg.rank.idx()] = name;
        for (peer, (_, eager, name)) in &links {
            if *eager as usize != cfg.eager_max {
                return Err(TransportError::Handshake {
                    peer: Some(*peer),
                    addr: String::new(),
                    reason: format!(
                        "eager limit {eager} there, {} here: every rank must use the same",
                        cfg.eager_max
                    ),
                });
            }
            names[peer.idx()] = name.clone();
        }
        ofi.insert_all(&names).map_err(unavailable)?;

        let matcher = Arc::new(Matcher::new(cfg.epoch, cfg.mailbox_bytes));
        let pool = cfg
            .pool
            .clone()
            .unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
        let core = Arc::new(Core::new(
            ofi,
            matcher.clone(),
            pool.clone(),
            n,
            cfg.eager_max,
            cfg.max_frame,
            cfg.register_always,
            cfg.spin,
            cfg.rank,
        ));
        core.post_slots(cfg.eager_slots).map_err(unavailable)?;
        let progress = Tasks::new(vec![tokio::spawn(progress::run(core.clone()))]);
        let (mut writers, mut watchers) = (Vec::with_capacity(n), Vec::new());
        for r in 0..n {
            let peer = Rank(r as u32);
            let Some((s, _, _)) = links.remove(&peer) else {
                writers.push(AsyncMutex::new(None));
                continue;
            };
            let (rd, wr) = s.into_split();
            watchers.push(tokio::spawn(watch(rd, peer, core.clone())));
            writers.push(AsyncMutex::new(Some(wr)));
        }
        let wire = FabricWire {
            me: cfg.rank,
            size: n,
            core,
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

    /// Frames that landed in receives posted for them (above the eager
    /// limit), so far.
    pub fn frames_posted(&self) -> u64 {
        self.core.posted_landed.load(Ordering::Relaxed)
    }

    /// The provider libfabric gave.
    pub fn provider(&self) -> &str {
        &self.core.ofi.provider
    }
}

impl Wire for FabricWire {
    fn caps(&self) -> Caps {
        Caps {
            name: "fabric",
            max_frame: self.core.max_frame,
            inject: false,
            holds_sends: false,
            // a spinning receive reads the CQ itself (manual progress),
            // sooner than the progress task would
            polled: true,
            lends: false,
            // a send resolves at its completion: libfabric is done with the
            // op's memory
            borrows_sends: true,
            eager_max: self.core.eager_max,
            needs_registration: self.core.registers(),
        }
    }

    fn reaches(&self, peer: Rank) -> bool {
        peer != self.me && peer.idx() < self.size
    }

    fn register(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        if self.core.registers() {
            self.core.register_region(region)?;
        }
        Ok(())
    }

    fn post_recv(&self, key: RecvKey, mem: MemMut) -> Result<Option<MemMut>, TransportError> {
        self.core.post(key, mem)
    }

    fn pump(&self, _tag: OpTag, _from: &PeerSet, _apply: Option<Apply<'_>>) -> Pump {
        // frames go into the matcher (none is lent in place); a failing CQ
        // is the progress task's to report
        Pump::moved(self.core.progress().is_ok_and(|n| n > 0))
    }

    fn going_to_sleep(&self) {
        // the receive stops polling: the progress task takes over at once
        self.core.wake.notify_one();
    }

    async fn send(&self, to: Rank, header: Header, payload: Bytes) -> Result<(), TransportError> {
        if on_control_link(&header) {
            return self.send_control(to, header, &payload).await;
        }
        self.core.send(to, header, Hold::Bytes(payload)).await
    }

    async fn send_mem(&self, to: Rank, header: Header, payload: Mem) -> Result<(), TransportError> {
        self.core.send(to, header, Hold::Mem(payload)).await
    }

    async fn close(&self, linger: Duration) {
        let deadline = Instant::now() + linger;
        self.core.closing.store(true, Ordering::Release);
        // every send completed, then the goodbyes
        while self.core.sends_in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        connect::say_goodbyes(&self.links, &self.core.sent, deadline).await;
        // what the peers sent, until each said goodbye too
        self.watchers.join_until(deadline).await;
        self.shutdown();
    }

    fn shutdown(&self) {
        self.core.closing.store(true, Ordering::Release);
        self.progress.abort();
        self.watchers.abort();
        // the links end: the peers see this rank gone
        connect::drop_links(&self.links);
    }
}

impl Drop for FabricWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests;
