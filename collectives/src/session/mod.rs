//! The scheduler: starts ops, drives their plans over a [`Transport`], and
//! reports completions.
//!
//! Each op runs as its own task: it takes frames of its [`OpTag`] from the
//! transport (so ops in flight never wait on each other, and ranks may
//! issue them in any order), hands them to its plan, and sends what the
//! plan says. Every wait is bounded by the op timeout, counted from the
//! op's last progress.
//!
//! This file holds the session's shared state, its making and its
//! accessors. The ops a caller starts are in `ops.rs` and `consensus.rs`,
//! the settings in `config.rs`; starting and completing ops in
//! `driver.rs`, their plans in `plans.rs`, one op's async driver in
//! `running.rs`, the host fast path in `fast.rs`, the swap in `swap.rs`.

mod config;
mod consensus;
mod driver;
mod fast;
mod opmem;
mod ops;
mod output;
mod plans;
mod running;
mod stall;
mod stats;
mod swap;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::lock;
use std::time::Duration;

use kungfu_topology::{PeerList, Rank, Root, Strategy, Topology};
use kungfu_transport::{Epoch, Generation, OpTag, Transport};

use crate::names::NameTable;
use crate::CollectiveError;
use kungfu_transport::pool::BufferPool;

use driver::watch_strays;
use swap::{Deferred, Tombstones};

pub use swap::{Agreement, SwapGate, SwapTo};

pub use output::{Callback, OpHandle, OpOutput};
pub use stall::{Stall, DEFAULT_STALL_TIMEOUT};
pub use stats::{OpStats, PeerStats};

use output::Memory;

pub use config::{FastLarge, SessionConfig, DEFAULT_FAST_MAX_BYTES, LARGE_ALLREDUCE_FROM};

/// A transport (by address) and the fast path over it, if it has one.
type FastFor<T> = (usize, Option<Arc<fast::Fast<T>>>);

struct Inner<T> {
    /// The transport of ops started from now on: replaced by a transport
    /// swap ([`Session::swap_transport`]); each op keeps the one it started
    /// on.
    transport: std::sync::RwLock<Arc<T>>,
    peers: PeerList,
    config: SessionConfig,
    names: Mutex<NameTable>,
    topologies: Mutex<HashMap<(Strategy, Root), Arc<Topology>>>,
    plans: Mutex<plans::PlanCache>,
    tombstones: Mutex<Tombstones>,
    runtime: tokio::runtime::Handle,
    /// The transport's: working buffers and the copies of frames that
    /// backends send later.
    pool: Arc<BufferPool>,
    /// The strategy of ops started from now on (starts as the config's).
    strategy: Mutex<Strategy>,
    /// Completed ops by the strategy they ran on.
    stats: Mutex<HashMap<Strategy, OpStats>>,
    /// What completed ops received from each peer, by rank.
    peer_stats: Mutex<Vec<PeerStats>>,
    /// Ops started and not yet completed; `drained` is told when it drops
    /// to zero.
    inflight: std::sync::atomic::AtomicUsize,
    drained: tokio::sync::Notify,
    /// While a swap is under way, the ops the caller starts wait here, in
    /// order, to start at the new epoch.
    gate: Mutex<SwapGate<Deferred>>,
    /// Ops started and not completed, by tag: their names and when they
    /// started (the stall report's).
    pending: Mutex<HashMap<OpTag, (Arc<str>, std::time::Instant)>>,
    /// How long an op waits before the stall report lists it.
    stall_after: Mutex<Duration>,
    /// The host fast path over the transport it was made for (made at the
    /// first op that could take it; remade after a transport swap).
    fast: Mutex<Option<FastFor<T>>>,
}

impl<T> Inner<T> {
    /// The transport ops start on now.
    pub(super) fn transport(&self) -> Arc<T> {
        self.transport
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Named asynchronous collectives over one transport. Cheap to clone.
///
/// # Thread safety
/// All methods take `&self` and may be called from any thread. Ops are
/// started at the call; completion is reported through the returned
/// handle or the callback.
pub struct Session<T: Transport> {
    inner: Arc<Inner<T>>,
}

impl<T: Transport> Clone for Session<T> {
    fn clone(&self) -> Self {
        Session {
            inner: self.inner.clone(),
        }
    }
}

impl<T: Transport> Session<T> {
    /// A session over `transport`, whose ranks are `peers`. Ops run on the
    /// tokio runtime this is called from.
    pub fn new(
        transport: Arc<T>,
        peers: PeerList,
        config: SessionConfig,
    ) -> Result<Session<T>, CollectiveError> {
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: "<session>".into(),
            reason,
        };
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| invalid("Session::new must be called inside a tokio runtime".into()))?;
        if peers.len() != transport.size() {
            return Err(invalid(format!(
                "peer list has {} ranks, the transport {}",
                peers.len(),
                transport.size()
            )));
        }
        if config.chunk_bytes == 0 || config.op_timeout.is_zero() {
            return Err(invalid(
                "chunk_bytes and op_timeout must be positive".into(),
            ));
        }
        let inner = Arc::new(Inner {
            pool: transport.pool().clone(),
            strategy: Mutex::new(config.strategy),
            stats: Mutex::new(HashMap::new()),
            peer_stats: Mutex::new(vec![PeerStats::default(); peers.len()]),
            transport: std::sync::RwLock::new(transport),
            peers,
            config,
            names: Mutex::new(NameTable::default()),
            topologies: Mutex::new(HashMap::new()),
            plans: Mutex::default(),
            tombstones: Mutex::new(Tombstones::default()),
            runtime,
            inflight: std::sync::atomic::AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
            gate: Mutex::new(SwapGate::default()),
            pending: Mutex::new(HashMap::new()),
            stall_after: Mutex::new(DEFAULT_STALL_TIMEOUT),
            fast: Mutex::new(None),
        });
        inner.runtime.spawn(watch_strays(Arc::downgrade(&inner)));
        Ok(Session { inner })
    }

    pub fn rank(&self) -> Rank {
        self.inner.transport().rank()
    }
}

impl Session<kungfu_transport::mem::MemTransport> {
    /// `n` sessions over an in-memory network, rank `i` at index `i`: a
    /// cluster inside one process, for tests and examples. Must be called
    /// inside a tokio runtime.
    pub fn local_cluster(
        n: usize,
        mem: kungfu_transport::mem::MemConfig,
        config: SessionConfig,
    ) -> Vec<Session<kungfu_transport::mem::MemTransport>> {
        kungfu_transport::mem::MemNetwork::new(n, mem)
            .into_iter()
            .map(|t| {
                Session::new(t, PeerList::local(n), config.clone())
                    .expect("a local cluster inside a tokio runtime")
            })
            .collect()
    }
}

impl<T: Transport> Session<T> {
    pub fn size(&self) -> usize {
        self.inner.transport().size()
    }

    /// Whether `other` is a clone of this session.
    pub fn same(&self, other: &Session<T>) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The swap epoch inside this session's cluster version.
    pub fn epoch(&self) -> Epoch {
        self.inner.transport().epoch()
    }

    /// The cluster version this session was connected at (fixed: a resize
    /// makes a new session) and its current epoch. Never goes back, across
    /// swaps and resizes alike.
    pub fn generation(&self) -> Generation {
        Generation {
            version: self.inner.transport().version(),
            epoch: self.epoch(),
        }
    }

    pub fn peers(&self) -> &PeerList {
        &self.inner.peers
    }

    pub fn config(&self) -> &SessionConfig {
        &self.inner.config
    }

    pub fn transport(&self) -> Arc<T> {
        self.inner.transport()
    }

    /// The topology an op of `bytes` bytes per rank and `root` runs on.
    pub fn topology(&self, root: Root, bytes: usize) -> Arc<Topology> {
        self.topology_of(self.strategy(), root, bytes)
    }

    /// Completed ops so far, by the strategy they ran on (`AUTO` resolved
    /// to its choice), ordered by strategy name: the rate of each strategy
    /// for monitors and policies.
    pub fn op_stats(&self) -> Vec<(Strategy, OpStats)> {
        let mut v: Vec<(Strategy, OpStats)> = lock(&self.inner.stats)
            .iter()
            .map(|(s, o)| (*s, *o))
            .collect();
        v.sort_by_key(|(s, _)| s.name());
        v
    }

    /// What completed ops received from each peer, indexed by rank (this
    /// rank's own entry stays empty): per-peer throughput and latency.
    pub fn peer_stats(&self) -> Vec<PeerStats> {
        lock(&self.inner.peer_stats).clone()
    }

    /// Forgets the statistics, per strategy and per peer (to measure a
    /// new window).
    pub fn reset_op_stats(&self) {
        lock(&self.inner.stats).clear();
        lock(&self.inner.peer_stats).fill(PeerStats::default());
    }

    /// The strategy ops started now use.
    pub fn strategy(&self) -> Strategy {
        *lock(&self.inner.strategy)
    }

    /// Makes ops started from now on use `s`; ops in flight keep theirs.
    /// Every rank must switch at the same point of its sequence of ops (an
    /// op started with different topologies on two ranks fails with a
    /// mismatch): agree first, e.g. with [`Session::consensus`], as the C
    /// ABI's `kf_set_strategy` does.
    pub fn set_strategy(&self, s: Strategy) {
        *lock(&self.inner.strategy) = s;
    }

    /// Closes the transport gracefully (see [`Transport::close`]): call it
    /// when this worker is done, so frames its peers still need arrive.
    pub async fn close(&self, linger: Duration) {
        self.inner.transport().close(linger).await;
        self.fail_fast_ops();
        if let Some(tl) = &self.inner.config.timeline {
            tl.flush();
        }
    }

    /// Fails the fast path's ops in flight (the transport is gone).
    fn fail_fast_ops(&self) {
        let fast = lock(&self.inner.fast).as_ref().and_then(|(_, f)| f.clone());
        if let Some(f) = fast {
            f.fail_all();
        }
    }

    /// Stops the transport at once: ops in flight and later fail.
    pub fn shutdown(&self) {
        self.inner.transport().shutdown();
        self.fail_fast_ops();
    }
}
