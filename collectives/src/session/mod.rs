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
mod scope;
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

pub use output::{Callback, OpHandle, OpOutput, SqNorms};
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
    /// How many subgroups were made here over each set of ranks (a
    /// group's id counts them: [`Session::subgroup`]).
    groups_made: Mutex<HashMap<Vec<Rank>, u64>>,
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
///
/// A session may also stand for a subgroup of its ranks
/// ([`Session::subgroup`]): then its ranks, size, peers and ops are the
/// group's.
pub struct Session<T: Transport> {
    inner: Arc<Inner<T>>,
    /// The subgroup this session stands for; None: all of its ranks.
    scope: Option<Arc<scope::Scope>>,
}

impl<T: Transport> std::fmt::Debug for Session<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Session");
        d.field("rank", &self.rank().0).field("size", &self.size());
        if let Some(s) = &self.scope {
            d.field("group", &format_args!("{:016x}", s.id)).field(
                "members",
                &s.members.iter().map(|r| r.0).collect::<Vec<_>>(),
            );
        }
        d.finish()
    }
}

impl<T: Transport> Clone for Session<T> {
    fn clone(&self) -> Self {
        Session {
            inner: self.inner.clone(),
            scope: self.scope.clone(),
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
            groups_made: Mutex::default(),
        });
        inner.runtime.spawn(watch_strays(Arc::downgrade(&inner)));
        Ok(Session { inner, scope: None })
    }

    /// This rank (in the subgroup, for a subgroup's session).
    pub fn rank(&self) -> Rank {
        match &self.scope {
            Some(s) => s.pos,
            None => self.inner.transport().rank(),
        }
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
    /// The number of ranks (of the subgroup, for a subgroup's session).
    pub fn size(&self) -> usize {
        match &self.scope {
            Some(s) => s.members.len(),
            None => self.inner.transport().size(),
        }
    }

    /// Whether `other` is a clone of this session (the same subgroup, if
    /// either is one).
    pub fn same(&self, other: &Session<T>) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            && match (&self.scope, &other.scope) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
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

    /// The addresses of the ranks (the subgroup's, in its order, for a
    /// subgroup's session).
    pub fn peers(&self) -> &PeerList {
        match &self.scope {
            Some(s) => &s.peers,
            None => &self.inner.peers,
        }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.inner.config
    }

    pub fn transport(&self) -> Arc<T> {
        self.inner.transport()
    }

    /// The topology an op of `bytes` bytes per rank and `root` runs on.
    pub fn topology(&self, root: Root, bytes: usize) -> Arc<Topology> {
        self.topology_of(self.strategy(), root, bytes, self.scope.as_deref())
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
