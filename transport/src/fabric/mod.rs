//! libfabric backend (RDMA through OFI): one reliable-datagram endpoint
//! (`FI_EP_RDM`) per rank, tagged messages, receives posted straight into
//! the op's memory (the `core` module says how frames travel and what holds their
//! memory).
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
//! Heartbeats and loss notices ([`FrameKind::Heartbeat`],
//! [`FrameKind::Lost`]) go on the control links too, not through the
//! fabric: `FRM!`, the frame's header and its payload (at most
//! [`MAX_BEACON`] bytes). Through the fabric they would take the
//! receiver's eager slots, which the ops' frames need (under load a
//! barrier's last sends once waited behind them).
//!
//! **Registration.** Where the provider needs local buffers registered
//! (`FI_MR_LOCAL`, e.g. verbs), the wire declares
//! [`Caps::needs_registration`]: an op's region is registered once and the
//! registration kept in the region (the registration cache), dropped with
//! it. [`FabricConfig::register_always`] takes that path on providers that
//! do not need it, to test it without hardware.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex as AsyncMutex;

use self::core::{Core, Hold};
use self::ofi::Ofi;
use crate::connect::{self, Incoming};
use crate::endpoint::{
    Endpoint, EndpointConfig, Matcher, Pump, RecvKey, CLOSED_BY_PEER, MAX_BEACON,
};
use crate::handshake::Identity;
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::wire::{Apply, Caps, Tasks, Wire};
use crate::{
    ClusterVersion, Epoch, FrameKind, Header, Instant, OpTag, PeerSet, TransportError, HEADER_LEN,
};

mod core;
mod ofi;

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

/// Settings of a fabric endpoint.
#[derive(Clone)]
pub struct FabricConfig {
    pub cluster_id: u64,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub rank: Rank,
    pub peers: PeerList,
    /// The job's secret: every peer must prove it holds it (see
    /// [`crate::handshake`]); `None`: links are not authenticated.
    pub secret: Option<crate::auth::JobSecret>,
    /// The libfabric provider (`tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`,
    /// `efa`); `None`: libfabric's first choice (see `FI_PROVIDER`).
    pub provider: Option<String>,
    /// The provider's domain (for `tcp`, the network interface, e.g. `lo`);
    /// `None`: its first.
    pub domain: Option<String>,
    pub connect_timeout: Duration,
    pub max_frame: usize,
    pub mailbox_bytes: usize,
    pub pool: Option<Arc<BufferPool>>,
    /// How long the progress task keeps polling after activity before it
    /// sleeps.
    pub spin: Duration,
    /// Frames up to this size go eagerly into the wire's receive slots;
    /// larger ones only into receives posted for them. Every rank must
    /// use the same (checked at connect).
    pub eager_max: usize,
    /// Eager receive slots kept posted.
    pub eager_slots: usize,
    /// Register every buffer even where the provider does not ask for it.
    pub register_always: bool,
}

impl FabricConfig {
    /// This rank's identity, once its rank is checked against the peers.
    fn identity_checked(&self) -> Result<Identity, TransportError> {
        Identity::of(
            self.cluster_id,
            self.version,
            self.epoch,
            self.rank,
            &self.peers,
            self.secret.as_ref(),
        )
    }

    /// Defaults: 30 s to connect, 64 MiB frames, a 256 MiB mailbox, 64 KiB
    /// eager frames into 64 slots, 50 us of polling after activity.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: PeerList,
        provider: Option<String>,
    ) -> FabricConfig {
        FabricConfig {
            cluster_id,
            version,
            epoch,
            rank,
            peers,
            secret: None,
            provider,
            domain: None,
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            pool: None,
            spin: Duration::from_micros(50),
            eager_max: 64 << 10,
            eager_slots: 64,
            register_always: false,
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

/// What a rank tells each peer at connect: its eager limit and its address.
async fn exchange(
    s: &mut TcpStream,
    eager_max: usize,
    name: &[u8],
    dialer: bool,
) -> Result<(u32, Vec<u8>), String> {
    let mut out = Vec::with_capacity(6 + name.len());
    out.extend_from_slice(&(eager_max as u32).to_le_bytes());
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name);
    if dialer {
        s.write_all(&out)
            .await
            .map_err(|e| format!("send address: {e}"))?;
        read_address(s).await
    } else {
        let got = read_address(s).await?;
        s.write_all(&out)
            .await
            .map_err(|e| format!("send address: {e}"))?;
        Ok(got)
    }
}

async fn read_address(s: &mut TcpStream) -> Result<(u32, Vec<u8>), String> {
    let mut head = [0u8; 6];
    s.read_exact(&mut head)
        .await
        .map_err(|e| format!("read address: {e}"))?;
    let eager = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let len = u16::from_le_bytes(head[4..].try_into().expect("2 bytes"));
    let mut name = vec![0u8; usize::from(len)];
    s.read_exact(&mut name)
        .await
        .map_err(|e| format!("read address: {e}"))?;
    Ok((eager, name))
}

type Link = (TcpStream, u32, Vec<u8>);

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
        let progress = Tasks::new(vec![tokio::spawn(core::run(core.clone()))]);
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

async fn dial_lower(
    cfg: &Arc<FabricConfig>,
    name: &[u8],
    deadline: Instant,
) -> Result<HashMap<Rank, Link>, TransportError> {
    let lower = (0..cfg.rank.0).map(Rank);
    connect::dial_all(lower, |peer| {
        let (cfg, name) = (cfg.clone(), name.to_vec());
        async move {
            let p = cfg.peers.peer(peer).expect("peer below our rank");
            let me = cfg.identity();
            connect::dial(peer, p.to_string(), deadline, || async {
                let mut s = connect::tcp_hello(p, &me, peer).await?;
                let (eager, addr) = exchange(&mut s, cfg.eager_max, &name, true)
                    .await
                    .map_err(|e| (true, e))?;
                Ok((s, eager, addr))
            })
            .await
        }
    })
    .await
}

async fn accept_higher(
    cfg: &Arc<FabricConfig>,
    name: &[u8],
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
        let (cfg, name) = (cfg.clone(), name.to_vec());
        async move {
            let may_dial = |r: Rank| r > cfg.rank;
            let from = connect::tcp_answer(&mut s, &cfg.identity(), may_dial).await?;
            let (eager, addr) = exchange(&mut s, cfg.eager_max, &name, false).await?;
            Ok((from, (s, eager, addr)))
        }
    };
    connect::accept(&wanted, &local, deadline, Some(cfg.rank), incoming, answer).await
}

/// The largest payload of a frame on a control link.
const MAX_CONTROL_FRAME: usize = MAX_BEACON;

/// Whether `header` travels on the control link rather than the fabric.
fn on_control_link(header: &Header) -> bool {
    matches!(header.kind, FrameKind::Heartbeat | FrameKind::Lost)
}

/// Reads the control frames of `peer` (heartbeats, loss notices: see the
/// module docs) into the matcher until the link ends; returns the first
/// four bytes of what is not one, or the read's error.
async fn control_frames(
    rd: &mut OwnedReadHalf,
    peer: Rank,
    matcher: &Matcher,
) -> Result<[u8; 4], String> {
    loop {
        let mut magic = [0u8; 4];
        rd.read_exact(&mut magic)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => CLOSED_BY_PEER.to_string(),
                _ => format!("control link: {e}"),
            })?;
        if magic != *b"FRM!" {
            return Ok(magic);
        }
        let mut hb = [0u8; HEADER_LEN];
        rd.read_exact(&mut hb)
            .await
            .map_err(|e| format!("control link: {e}"))?;
        let header = Header::decode(&hb, MAX_CONTROL_FRAME)
            .map_err(|e| format!("protocol violation on the control link: {e}"))?;
        if !on_control_link(&header) {
            return Err(format!(
                "protocol violation on the control link: a {:?} frame",
                header.kind
            ));
        }
        let mut payload = vec![0u8; header.len as usize]; // at most MAX_CONTROL_FRAME
        rd.read_exact(&mut payload)
            .await
            .map_err(|e| format!("control link: {e}"))?;
        // heartbeats and notices never wait for room
        let _ = matcher.deliver_now(peer, header, payload.into());
    }
}

/// Watches the control link of `peer`: its goodbye (then waits until its
/// frames all arrived), or its end, is the end of the peer; heartbeats and
/// loss notices on the way go to the matcher.
async fn watch(mut rd: OwnedReadHalf, peer: Rank, core: Arc<Core>) {
    let magic = control_frames(&mut rd, peer, &core.matcher).await;
    let mut b = [0u8; 12];
    let read = match magic {
        Ok(m) => {
            b[..4].copy_from_slice(&m);
            rd.read_exact(&mut b[4..]).await.map(drop)
        }
        Err(why) => return core.matcher.fail_peer(peer, why),
    };
    let why = match read {
        Ok(_) if b[..4] == *b"BYE!" => {
            let sent = u64::from_le_bytes(b[4..].try_into().expect("8 bytes"));
            // its frames may still be in flight: wait for them (the close
            // that reads this bounds the wait)
            while core.received[peer.idx()].load(Ordering::Relaxed) < sent {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            CLOSED_BY_PEER.to_string()
        }
        Ok(_) => "protocol violation: bad goodbye on the control link".to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => CLOSED_BY_PEER.to_string(),
        Err(e) => format!("control link: {e}"),
    };
    core.matcher.fail_peer(peer, why);
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

impl FabricWire {
    /// Writes a heartbeat or a loss notice on `to`'s control link.
    async fn send_control(
        &self,
        to: Rank,
        mut header: Header,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let lost = |why: String| TransportError::PeerLost {
            peer: to,
            reason: why.into(),
        };
        if payload.len() > MAX_CONTROL_FRAME {
            return Err(TransportError::FrameTooLarge {
                len: payload.len(),
                max: MAX_CONTROL_FRAME,
            });
        }
        header.len = payload.len() as u64;
        let mut msg = Vec::with_capacity(4 + HEADER_LEN + payload.len());
        msg.extend_from_slice(b"FRM!");
        msg.extend_from_slice(&header.encode());
        msg.extend_from_slice(payload);
        let link = self.links.get(to.idx()).ok_or(TransportError::NoSuchPeer {
            peer: to,
            size: self.size,
        })?;
        let mut w = link.lock().await;
        let w = w
            .as_mut()
            .ok_or_else(|| lost("its control link is closed".into()))?;
        w.write_all(&msg)
            .await
            .map_err(|e| lost(format!("control link: {e}")))
    }
}

impl Drop for FabricWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `auto` finds: a hardware provider, or a reason that names each
    /// one tried (this machine has no RDMA device: the latter here).
    #[test]
    fn hardware_provider_names_what_it_found_or_each_reason() {
        match hardware_provider() {
            Ok(p) => assert!(HARDWARE_PROVIDERS.contains(&p)),
            Err(TransportError::Unavailable { transport, reason }) => {
                assert_eq!(transport, "fabric");
                // each provider's reason, or that libfabric did not load
                let each = HARDWARE_PROVIDERS.iter().all(|p| reason.contains(p));
                assert!(each || reason.contains("libfabric"), "{reason}");
            }
            Err(e) => panic!("{e}"),
        }
    }
}
