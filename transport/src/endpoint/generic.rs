//! [`Endpoint`]: the one [`Transport`] implementation, over any wires.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use super::{recv_spinning, spin_recv, Arrival, Matcher, Pump, RecvKey};
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut};
use crate::wire::{Caps, Wire};
use crate::{
    Capabilities, ClusterVersion, Frame, Header, Instant, OpTag, PeerSet, Transport, TransportError,
};

/// How an endpoint receives.
#[derive(Clone, Copy, Debug)]
pub struct EndpointConfig {
    /// How long a receive stays runnable (polling wires that need it, and
    /// letting the runtime poll sockets) before it sleeps.
    pub spin: Duration,
    /// More ranks on this host than cores: spinning yields to the OS.
    pub oversubscribed: bool,
}

/// One rank's endpoint: a matcher, a buffer pool, and one or more wires
/// with a route per peer (the first wire that reaches it). Shared memory
/// inside a host and TCP across is an endpoint over two wires, not a third
/// backend.
pub struct Endpoint<W> {
    pub(super) me: Rank,
    pub(super) size: usize,
    version: ClusterVersion,
    name: &'static str,
    pub(super) matcher: Arc<Matcher>,
    /// The pool the wires fill payloads from (see [`Transport::pool`]).
    pool: Arc<BufferPool>,
    wires: Vec<W>,
    /// The wire index of each rank; None for this rank and unreachable ones.
    route: Vec<Option<usize>>,
    /// Wires whose frames move only while a receiver polls.
    polled: Vec<usize>,
    cfg: EndpointConfig,
    /// The heartbeats and watchdog, once started ([`Endpoint::watch_peers`]).
    pub(super) watcher: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl<W: Wire> Endpoint<W> {
    /// The endpoint of rank `me` of `size` over `wires`, which deliver into
    /// `matcher` payloads taken from `pool`, at cluster version `version`.
    /// `name` is what [`Transport::capabilities`] reports.
    #[allow(clippy::too_many_arguments)] // each is one of the parts an endpoint joins
    pub fn new(
        me: Rank,
        size: usize,
        version: ClusterVersion,
        name: &'static str,
        matcher: Arc<Matcher>,
        pool: Arc<BufferPool>,
        wires: Vec<W>,
        cfg: EndpointConfig,
    ) -> Endpoint<W> {
        let route = (0..size as u32)
            .map(Rank)
            .map(|r| {
                (r != me)
                    .then(|| wires.iter().position(|w| w.reaches(r)))
                    .flatten()
            })
            .collect();
        let polled = (0..wires.len())
            .filter(|&i| wires[i].caps().polled)
            .collect();
        Endpoint {
            me,
            size,
            version,
            name,
            matcher,
            pool,
            wires,
            route,
            polled,
            cfg,
            watcher: std::sync::Mutex::new(None),
        }
    }

    /// The endpoint's name (its wires: `tcp`, `shm+tcp`, `quic`, ...).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The wires, in routing order.
    pub fn wires(&self) -> &[W] {
        &self.wires
    }

    /// The wire that carries frames to `peer`, if any.
    pub fn wire_to(&self, peer: Rank) -> Option<&W> {
        let i = (*self.route.get(peer.idx())?)?;
        Some(&self.wires[i])
    }

    fn caps_to(&self, peer: Rank) -> Option<Caps> {
        self.wire_to(peer).map(Wire::caps)
    }

    /// The wire to `to` and its caps, after the checks every send makes.
    fn checked(&self, to: Rank, len: usize) -> Result<(&W, Caps), TransportError> {
        let route = self.wire_to(to).map(|w| (w, w.caps()));
        let max = route.map_or(usize::MAX, |(_, c)| c.max_frame);
        self.matcher
            .check_send(to, self.size, route.is_some(), len, max)?;
        Ok(route.expect("checked"))
    }
}

/// Marks the polled wires as polled while it lives (also when the receive
/// that made it is dropped mid-spin).
struct Polling<'a, W: Wire>(&'a Endpoint<W>);

impl<'a, W: Wire> Polling<'a, W> {
    fn start(e: &'a Endpoint<W>) -> Polling<'a, W> {
        for &i in &e.polled {
            e.wires[i].set_polling(true);
        }
        Polling(e)
    }
}

impl<W: Wire> Drop for Polling<'_, W> {
    fn drop(&mut self) {
        for &i in &self.0.polled {
            self.0.wires[i].set_polling(false);
        }
    }
}

impl<W: Wire> Transport for Endpoint<W> {
    fn rank(&self) -> Rank {
        self.me
    }

    fn size(&self) -> usize {
        self.size
    }

    fn matcher(&self) -> &Matcher {
        &self.matcher
    }

    fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    fn version(&self) -> ClusterVersion {
        self.version
    }

    fn capabilities(&self) -> Capabilities {
        let caps = || self.wires.iter().map(Wire::caps);
        Capabilities {
            name: self.name,
            max_frame: caps().map(|c| c.max_frame).min().unwrap_or(usize::MAX),
            zero_copy: !self.wires.is_empty() && caps().all(|c| c.lends),
            needs_registration: caps().any(|c| c.needs_registration),
        }
    }

    async fn send(&self, to: Rank, header: Header, payload: Bytes) -> Result<(), TransportError> {
        self.checked(to, payload.len())?
            .0
            .send(to, header, payload)
            .await
    }

    async fn send_mem(&self, to: Rank, header: Header, payload: Mem) -> Result<(), TransportError> {
        let (w, caps) = self.checked(to, payload.len())?;
        if caps.needs_registration {
            w.register(payload.region())?;
        }
        w.send_mem(to, header, payload).await
    }

    fn try_send_now(
        &self,
        to: Rank,
        header: Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        // A wire that never injects costs no check here (tcp: every
        // transmit asks); its send makes them.
        if self.caps_to(to).is_some_and(|c| !c.inject) {
            return Ok(false);
        }
        let (w, _) = self.checked(to, payload.len())?;
        w.inject(to, header, payload)
    }

    fn peer_caps(&self, peer: Rank) -> Option<Caps> {
        self.caps_to(peer)
    }

    async fn recv(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
    ) -> Result<Frame, TransportError> {
        if self.polled.is_empty() {
            let (spin, os) = (self.cfg.spin, self.cfg.oversubscribed);
            return recv_spinning(&self.matcher, tag, from, deadline, spin, os, || false).await;
        }
        let none = None::<fn(Rank, &Header, &[&[u8]]) -> bool>;
        match self.recv_polling(tag, from, deadline, none).await? {
            Arrival::Frame(f) => Ok(f),
            other => unreachable!("nothing is lent without apply, got {other:?}"),
        }
    }

    async fn recv_in_place<'a, F>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
        apply: F,
    ) -> Result<Arrival, TransportError>
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool + Send + 'a,
    {
        if self.polled.is_empty() {
            drop(apply);
            let (spin, os) = (self.cfg.spin, self.cfg.oversubscribed);
            let take = || self.matcher.try_arrival(tag, from);
            return match spin_recv(take, spin, os, || Pump::Idle).await {
                Some(r) => r,
                None => self.matcher.recv_arrival(tag, from, deadline).await,
            };
        }
        self.recv_polling(tag, from, deadline, Some(apply)).await
    }

    fn post_recv(&self, key: RecvKey, mem: MemMut) -> Result<Option<Header>, TransportError> {
        // No check that the peer is alive: what it sent before it was lost
        // may be queued, and lands now.
        let size = self.size;
        let w = self.wire_to(key.from).ok_or(TransportError::NoSuchPeer {
            peer: key.from,
            size,
        })?;
        if w.caps().needs_registration {
            w.register(mem.region())?;
        }
        match w.post_recv(key, mem)? {
            Some(mem) => self.matcher.post(key, mem),
            None => Ok(None),
        }
    }

    async fn close(&self, linger: Duration) {
        self.stop_watching();
        // All wires at once, each within the same linger.
        let mut closes: Vec<std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>>> = self
            .wires
            .iter()
            .map(|w| Box::pin(w.close(linger)) as _)
            .collect();
        std::future::poll_fn(|cx| {
            closes.retain_mut(|c| c.as_mut().poll(cx).is_pending());
            if closes.is_empty() {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        self.matcher.close();
    }

    fn shutdown(&self) {
        self.stop_watching();
        self.matcher.close();
        for w in &self.wires {
            w.shutdown();
        }
    }

    fn extension(&self, ty: std::any::TypeId) -> Option<crate::wire::Extension> {
        self.wires.iter().find_map(|w| w.extension(ty))
    }
}

impl<W: Wire> Endpoint<W> {
    /// A receive that polls the polled wires itself while it spins (a
    /// frame of `tag` first lent to `apply`, if given:
    /// [`Arrival::Applied`] when it consumed one), then sleeps until a
    /// frame is delivered or `deadline`. With `apply`, landed receives are
    /// arrivals too; without, only frames are.
    async fn recv_polling<F>(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
        mut apply: Option<F>,
    ) -> Result<Arrival, TransportError>
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool + Send,
    {
        let landed = apply.is_some();
        {
            let _polling = Polling::start(self);
            let pump = || {
                let mut moved = false;
                for &i in &self.polled {
                    let a = apply
                        .as_mut()
                        .map(|f| f as &mut (dyn FnMut(Rank, &Header, &[&[u8]]) -> bool + Send));
                    match self.wires[i].pump(tag, from, a) {
                        Pump::Consumed => return Pump::Consumed,
                        Pump::Moved => moved = true,
                        Pump::Idle => {}
                    }
                }
                Pump::moved(moved)
            };
            let (spin, os) = (self.cfg.spin, self.cfg.oversubscribed);
            let take = || match landed {
                true => self.matcher.try_arrival(tag, from),
                false => self
                    .matcher
                    .try_recv(tag, from)
                    .map(|r| r.map(Arrival::Frame)),
            };
            if let Some(r) = spin_recv(take, spin, os, pump).await {
                return r;
            }
        }
        for &i in &self.polled {
            self.wires[i].going_to_sleep();
        }
        match landed {
            true => self.matcher.recv_arrival(tag, from, deadline).await,
            false => self
                .matcher
                .recv(tag, from, deadline)
                .await
                .map(Arrival::Frame),
        }
    }
}
