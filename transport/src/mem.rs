//! An in-process transport for tests and simulation.
//!
//! Endpoints share one address space: a send delivers straight into the
//! receiver's [`Matcher`]. [`MemWire`] is the wire; [`MemTransport`] is the
//! generic [`Endpoint`] over it. With [`MemConfig::delay`] set, each send first
//! sleeps a random time drawn from a seeded RNG, so frames overtake one
//! another; [`MemTransport::kill`] makes a rank vanish as a crashed process
//! would.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use crate::endpoint::{Endpoint, EndpointConfig, Matcher};
use crate::pool::BufferPool;
use crate::wire::{Caps, Wire};
use crate::{ClusterVersion, Epoch, Header, Transport, TransportError};

/// A small, seeded, reproducible RNG (SplitMix64) for fault injection and
/// simulation. Not for cryptography.
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    pub fn new(seed: u64) -> SeededRng {
        SeededRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Settings of an in-memory network.
#[derive(Clone, Debug)]
pub struct MemConfig {
    /// The cluster version every endpoint reports (a resize in a test is a
    /// new network at a newer version).
    pub version: ClusterVersion,
    /// The epoch every endpoint starts at.
    pub epoch: Epoch,
    pub max_frame: usize,
    /// Unmatched bytes each endpoint holds before senders wait.
    pub mailbox_bytes: usize,
    /// `Some((seed, max))`: every send sleeps a random time in `0..max`
    /// first, drawn from an RNG seeded with `seed`.
    pub delay: Option<(u64, Duration)>,
    /// The buffer pool of every endpoint of the network (one process, one
    /// pool); `None`: a new one of [`BufferPool::DEFAULT_BUDGET`].
    pub pool: Option<Arc<BufferPool>>,
    /// Larger payloads wait for the receiver to post their receive and
    /// land in it (a rendezvous, as RDMA wires do with large messages);
    /// smaller ones are delivered at once. The wire declares it as
    /// [`Caps::eager_max`]. Default: no limit.
    pub eager_max: usize,
}

impl Default for MemConfig {
    fn default() -> MemConfig {
        MemConfig {
            version: ClusterVersion(0),
            epoch: Epoch(0),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            delay: None,
            pool: None,
            eager_max: usize::MAX,
        }
    }
}

struct Net {
    matchers: Vec<Arc<Matcher>>,
    dead: Vec<AtomicBool>,
    rng: Mutex<SeededRng>,
    config: MemConfig,
}

/// Builds in-memory networks.
pub struct MemNetwork;

impl MemNetwork {
    /// `n` connected endpoints, endpoint `i` being rank `i`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize, config: MemConfig) -> Vec<Arc<MemTransport>> {
        let seed = config.delay.map_or(0, |(s, _)| s);
        let pool =
            (config.pool.clone()).unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
        let net = Arc::new(Net {
            matchers: (0..n)
                .map(|_| Arc::new(Matcher::new(config.epoch, config.mailbox_bytes)))
                .collect(),
            dead: (0..n).map(|_| AtomicBool::new(false)).collect(),
            rng: Mutex::new(SeededRng::new(seed)),
            config,
        });
        (0..n)
            .map(|i| {
                let rank = Rank(i as u32);
                let wire = MemWire {
                    net: net.clone(),
                    rank,
                };
                // Nothing to poll and no socket to give the runtime: a
                // receive sleeps at once.
                let cfg = EndpointConfig {
                    spin: Duration::ZERO,
                    oversubscribed: false,
                };
                let matcher = net.matchers[i].clone();
                let version = net.config.version;
                Arc::new(Endpoint::new(
                    rank,
                    n,
                    version,
                    "mem",
                    matcher,
                    pool.clone(),
                    vec![wire],
                    cfg,
                ))
            })
            .collect()
    }
}

/// One endpoint of a [`MemNetwork`].
pub type MemTransport = Endpoint<MemWire>;

/// The wire of one rank of a [`MemNetwork`].
pub struct MemWire {
    net: Arc<Net>,
    rank: Rank,
}

impl Endpoint<MemWire> {
    /// Makes this rank vanish: every other endpoint sees it lost, and this
    /// endpoint is closed.
    pub fn kill(&self) {
        self.wires()[0].vanish("killed");
        self.matcher().close();
    }

    /// Delivers a frame as if `from` had sent it, bypassing every check a
    /// well-behaved sender makes: for tests of what receivers do with
    /// hostile or stale frames.
    pub async fn inject(
        &self,
        from: Rank,
        header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        self.matcher().deliver(from, header, payload).await
    }

    /// The endpoint's matcher: unmatched bytes held and frames refused, for
    /// inspection in tests.
    pub fn mailbox_stats(&self) -> (usize, u64) {
        (self.matcher().queued_bytes(), self.matcher().refused())
    }
}

impl MemWire {
    /// This rank is gone (`why`): every other endpoint sees it lost, as a
    /// closed socket or ring tells a peer, and it sends nothing more.
    fn vanish(&self, why: &str) {
        self.net.dead[self.rank.idx()].store(true, Ordering::SeqCst);
        for (i, m) in self.net.matchers.iter().enumerate() {
            if i != self.rank.idx() {
                m.fail_peer(self.rank, why);
            }
        }
    }
}

impl Wire for MemWire {
    fn caps(&self) -> Caps {
        Caps {
            name: "mem",
            max_frame: self.net.config.max_frame,
            inject: false,
            holds_sends: false,
            polled: false,
            lends: false,
            needs_registration: false,
            borrows_sends: false,
            eager_max: self.net.config.eager_max.min(self.net.config.max_frame),
        }
    }

    fn reaches(&self, peer: Rank) -> bool {
        peer != self.rank && peer.idx() < self.net.matchers.len()
    }

    async fn send(
        &self,
        to: Rank,
        mut header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        if self.net.dead[self.rank.idx()].load(Ordering::SeqCst) {
            return Err(TransportError::Closed);
        }
        header.len = payload.len() as u64;
        if let Some((_, max)) = self.net.config.delay {
            let nanos = max.as_nanos().max(1) as u64;
            let d = {
                let mut rng = self.net.rng.lock().unwrap_or_else(|e| e.into_inner());
                rng.below(nanos)
            };
            tokio::time::sleep(Duration::from_nanos(d)).await;
        }
        if self.net.dead[to.idx()].load(Ordering::SeqCst) {
            let reason = self.net.matchers[self.rank.idx()]
                .lost_reason(to)
                .unwrap_or_else(|| "gone".into());
            return Err(TransportError::PeerLost { peer: to, reason });
        }
        let peer = &self.net.matchers[to.idx()];
        let sent = if payload.len() > self.net.config.eager_max {
            peer.rendezvous(self.rank, header, &payload).await
        } else {
            peer.deliver(self.rank, header, payload).await
        };
        match sent {
            // The receiver refusing a frame is the receiver's business, as
            // with a real network; the sender is not told.
            Ok(()) | Err(TransportError::StaleEpoch { .. }) => Ok(()),
            Err(TransportError::Closed) => Err(TransportError::PeerLost {
                peer: to,
                reason: "closed".into(),
            }),
            Err(e) => Err(e),
        }
    }

    async fn close(&self, _linger: Duration) {
        // Sends are delivered synchronously: nothing is in flight.
        self.vanish("closed");
    }

    fn shutdown(&self) {
        self.vanish("closed");
    }
}
