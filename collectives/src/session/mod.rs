//! The scheduler: starts ops, drives their plans over a [`Transport`], and
//! reports completions.
//!
//! Each op runs as its own task: it takes frames of its [`OpTag`] from the
//! transport (so ops in flight never wait on each other, and ranks may
//! issue them in any order), hands them to its plan, and sends what the
//! plan says. Every wait is bounded by the op timeout, counted from the
//! op's last progress.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use kungfu_topology::{AutoThresholds, PeerList, Rank, Root, Strategy, Topology};
use kungfu_transport::{
    Epoch, Frame, FrameKind, Header, Instant, OpTag, PeerSet, Transport, TransportError,
};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::abort::{Abort, AbortReason};
use crate::dtype::scale_down;
use crate::names::{check_name, NameTable};
use crate::plan::build::{build, PlanInput};
use crate::plan::{Plan, Transmit};
use crate::pool::{BufPool, PooledBuf};
use crate::{CollectiveError, DType, Element, OpKind, OpSpec, ReduceOp};
use kungfu_transport::pool::FramePool;

/// Settings of a [`Session`].
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// The strategy every op uses (`AUTO` chooses per op size).
    pub strategy: Strategy,
    /// Where `AUTO` switches algorithms by message size.
    pub auto: AutoThresholds,
    /// Ops are cut into chunks of at most this many bytes, which pipeline.
    pub chunk_bytes: usize,
    /// An op fails when it makes no progress for this long.
    pub op_timeout: Duration,
    /// Bytes of one op's frames in flight at most (at least one frame is
    /// always allowed). Sends copy their bytes, so this bounds the extra
    /// memory a large op takes at once.
    pub max_inflight_bytes: usize,
    /// Idle working buffers kept for reuse, in bytes at most: ops in the
    /// steady state then allocate no buffer (0 turns the pool off).
    pub buffer_pool_bytes: usize,
}

impl Default for SessionConfig {
    /// `AUTO`, 1 MiB chunks, 60 s without progress, 64 MiB in flight, a
    /// 256 MiB buffer pool.
    fn default() -> SessionConfig {
        SessionConfig {
            strategy: Strategy::Auto,
            auto: AutoThresholds::default(),
            chunk_bytes: 1 << 20,
            op_timeout: Duration::from_secs(60),
            max_inflight_bytes: 64 << 20,
            buffer_pool_bytes: 256 << 20,
        }
    }
}

/// What the ops that completed on one strategy did, seen from this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpStats {
    pub ops: u64,
    /// Bytes of the ops' buffers (one rank's `count` elements each).
    pub bytes: u64,
    /// Time from start to completion, summed.
    pub busy: Duration,
}

impl OpStats {
    fn add(&mut self, bytes: usize, took: Duration) {
        self.ops += 1;
        self.bytes += bytes as u64;
        self.busy += took;
    }

    /// Bytes per second of busy time (0 without ops).
    pub fn rate(&self) -> f64 {
        per_second(self.bytes, self.busy)
    }

    /// Mean time per op.
    pub fn mean_latency(&self) -> Option<Duration> {
        mean(self.busy, self.ops)
    }
}

/// What this rank received from one peer in the ops that completed: a
/// slow link shows as a low [`PeerStats::rate`], a straggler as a long
/// [`PeerStats::mean_latency`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PeerStats {
    /// Ops in which frames came from this peer.
    pub ops: u64,
    pub frames: u64,
    pub bytes: u64,
    /// Per op, the time from the op's start to the last frame from this
    /// peer, summed.
    pub last_frame: Duration,
}

impl PeerStats {
    /// Bytes per second from this peer: bytes over the time, from each
    /// op's start, until its last frame arrived (0 without frames).
    pub fn rate(&self) -> f64 {
        per_second(self.bytes, self.last_frame)
    }

    /// Mean time from an op's start to the last frame from this peer.
    pub fn mean_latency(&self) -> Option<Duration> {
        mean(self.last_frame, self.ops)
    }
}

fn per_second(bytes: u64, t: Duration) -> f64 {
    let s = t.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / s
    } else {
        0.0
    }
}

fn mean(total: Duration, n: u64) -> Option<Duration> {
    (n > 0).then(|| Duration::from_secs_f64(total.as_secs_f64() / n as f64))
}

/// One op's frames from one peer: (frames, bytes, time of the last).
type Arrivals = (u64, u64, Duration);

/// The result of an op: the working buffer and where this rank's output
/// lies in it (`None` for non-roots of reduce and gather), and where the op
/// ran: its epoch and strategy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpOutput {
    work: PooledBuf,
    range: Option<Range<usize>>,
    epoch: Epoch,
    strategy: Strategy,
}

impl OpOutput {
    /// The epoch the op ran at: ops started while a swap is under way wait
    /// for it and run at the new epoch.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The strategy the op ran on (`AUTO` resolved to its choice).
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// This rank's output bytes, if it has an output.
    pub fn bytes(&self) -> Option<&[u8]> {
        self.range.as_ref().map(|r| &self.work[r.clone()])
    }

    /// The output as elements; empty where the rank has no output.
    pub fn to_vec<E: Element>(&self) -> Vec<E> {
        self.bytes()
            .map(bytemuck::pod_collect_to_vec::<u8, E>)
            .unwrap_or_default()
    }
}

/// A completion callback: runs once, on a runtime thread, with the result.
pub type Callback = Box<dyn FnOnce(Result<OpOutput, CollectiveError>) + Send + 'static>;

/// A pending op. Await it, or [`OpHandle::wait`] for it from a thread that
/// is not a runtime worker. Dropping the handle does not cancel the op (the
/// other ranks need this rank's part).
#[must_use = "an op handle does nothing unless awaited or waited on"]
pub struct OpHandle<O> {
    rx: oneshot::Receiver<Result<O, CollectiveError>>,
}

impl<O> OpHandle<O> {
    fn pair() -> (oneshot::Sender<Result<O, CollectiveError>>, OpHandle<O>) {
        let (tx, rx) = oneshot::channel();
        (tx, OpHandle { rx })
    }

    /// Blocks the calling thread until the op completes. Panics if called
    /// on a thread that drives the tokio runtime (use `.await` there).
    pub fn wait(self) -> Result<O, CollectiveError> {
        self.rx
            .blocking_recv()
            .unwrap_or(Err(CollectiveError::Closed))
    }

    /// The result, if the op has completed.
    pub fn try_result(&mut self) -> Option<Result<O, CollectiveError>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(CollectiveError::Closed)),
        }
    }
}

impl<O> Future for OpHandle<O> {
    type Output = Result<O, CollectiveError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.rx)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(CollectiveError::Closed)))
    }
}

struct Inner<T> {
    transport: Arc<T>,
    peers: PeerList,
    config: SessionConfig,
    names: Mutex<NameTable>,
    topologies: Mutex<HashMap<(Strategy, Root), Arc<Topology>>>,
    tombstones: Mutex<Tombstones>,
    runtime: tokio::runtime::Handle,
    pool: Arc<BufPool>,
    /// Buffers for the copies of frames that backends send later.
    frames: Arc<FramePool>,
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
    gate: Mutex<Option<Vec<Deferred>>>,
}

/// An op started during a swap, with its input copied.
struct Deferred {
    name: Arc<str>,
    spec: OpSpec,
    input: Vec<u8>,
    done: Callback,
    internal: bool,
}

/// How many finished ops are remembered, to judge their late frames.
const TOMBSTONES: usize = 4096;

/// The name of a swap's consensus (internal names end in NUL).
const SWAP_NAME: &str = "kf/swap\0";

/// The digest and spec of recently finished ops. A frame that arrives for
/// one of them with another digest comes from a rank that ran the op with
/// another spec after this rank was done: every rank is told.
#[derive(Default)]
struct Tombstones {
    map: HashMap<OpTag, (u32, OpSpec)>,
    order: std::collections::VecDeque<OpTag>,
}

impl Tombstones {
    fn insert(&mut self, tag: OpTag, digest: u32, spec: OpSpec) {
        if self.map.insert(tag, (digest, spec)).is_none() {
            self.order.push_back(tag);
            if self.order.len() > TOMBSTONES {
                let old = self.order.pop_front().expect("non-empty");
                self.map.remove(&old);
            }
        }
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

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    // The guarded tables stay consistent between statements; a panic
    // elsewhere must not take the session down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
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
        let pool = BufPool::new(config.buffer_pool_bytes);
        let inner = Arc::new(Inner {
            pool,
            frames: FramePool::new(config.max_inflight_bytes),
            strategy: Mutex::new(config.strategy),
            stats: Mutex::new(HashMap::new()),
            peer_stats: Mutex::new(vec![PeerStats::default(); peers.len()]),
            transport,
            peers,
            config,
            names: Mutex::new(NameTable::default()),
            topologies: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(Tombstones::default()),
            runtime,
            inflight: std::sync::atomic::AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
            gate: Mutex::new(None),
        });
        inner.runtime.spawn(watch_strays(Arc::downgrade(&inner)));
        Ok(Session { inner })
    }

    pub fn rank(&self) -> Rank {
        self.inner.transport.rank()
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
        self.inner.transport.size()
    }

    /// Whether `other` is a clone of this session.
    pub fn same(&self, other: &Session<T>) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub fn epoch(&self) -> Epoch {
        self.inner.transport.epoch()
    }

    pub fn peers(&self) -> &PeerList {
        &self.inner.peers
    }

    pub fn config(&self) -> &SessionConfig {
        &self.inner.config
    }

    pub fn transport(&self) -> &Arc<T> {
        &self.inner.transport
    }

    /// The topology an op of `bytes` bytes per rank and `root` runs on.
    pub fn topology(&self, root: Root, bytes: usize) -> Arc<Topology> {
        let s = match self.strategy() {
            Strategy::Auto => {
                Strategy::auto_choice_with(&self.inner.peers, root, bytes, &self.inner.config.auto)
            }
            s => s,
        };
        lock(&self.inner.topologies)
            .entry((s, root))
            .or_insert_with(|| Arc::new(s.resolve(&self.inner.peers, root, bytes)))
            .clone()
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

    /// Whether a swap ([`Session::swap_strategy`]) is under way here: ops
    /// started now wait for it and run at the new epoch.
    pub fn swapping(&self) -> bool {
        lock(&self.inner.gate).is_some()
    }

    /// Changes the strategy at a consistency barrier and advances the
    /// epoch; a collective: every rank calls it at the same point of its
    /// sequence of ops, with the same `s`.
    ///
    /// Ops started before the call finish on the old topology; ops started
    /// while the swap runs wait for it (in order) and start at the new
    /// epoch; then every rank checks that the others asked for the same
    /// strategy (consensus on its digest) and the epoch advances, so a
    /// late frame of the old epoch is refused. Returns the new epoch. If
    /// the ranks disagree, nothing changes and every rank gets
    /// [`CollectiveError::Mismatch`]; if the barrier fails (a lost peer, a
    /// timeout), its error, and the session stays at the old epoch.
    pub async fn swap_strategy(&self, s: Strategy) -> Result<Epoch, CollectiveError> {
        {
            let mut g = lock(&self.inner.gate);
            if g.is_some() {
                return Err(
                    self.invalid_err("<swap>", "another swap is under way on this session".into())
                );
            }
            *g = Some(Vec::new());
        }
        // Reopens the gate even if this future is dropped half-way (the
        // ranks may then disagree on the epoch, and later ops fail on
        // their timeout, but none waits here for ever).
        struct Reopen<'a, T: Transport>(&'a Session<T>);
        impl<T: Transport> Drop for Reopen<'_, T> {
            fn drop(&mut self) {
                let s = self.0;
                let mut g = lock(&s.inner.gate);
                for d in g.take().unwrap_or_default() {
                    s.start_now(d.name, d.spec, &d.input, d.done, d.internal);
                }
            }
        }
        let _reopen = Reopen(self);
        self.swap_gated(s).await
    }

    async fn swap_gated(&self, s: Strategy) -> Result<Epoch, CollectiveError> {
        use std::sync::atomic::Ordering;
        // Drain: every op in flight here ends (each within its own timeout).
        loop {
            let drained = self.inner.drained.notified();
            if self.inner.inflight.load(Ordering::SeqCst) == 0 {
                break;
            }
            drained.await;
        }
        let epoch = self.epoch();
        let next = Epoch(
            epoch
                .0
                .checked_add(1)
                .ok_or_else(|| self.invalid_err("<swap>", format!("{epoch} is the last epoch")))?,
        );
        // The digest of what every rank must agree on: the strategy, the
        // epoch it takes effect at, and the ranks it runs over.
        let digest = kungfu_topology::Digest::EMPTY
            .bytes(s.name().as_bytes())
            .u64(u64::from(next.0))
            .u64(self.inner.peers.digest().0)
            .0
            .to_le_bytes();
        let (tx, h) = OpHandle::<bool>::pair();
        self.consensus_with(SWAP_NAME, &digest, true, tx);
        if !h.await? {
            return Err(CollectiveError::Mismatch {
                name: SWAP_NAME.into(),
                epoch,
                ranks: Vec::new(),
                detail: format!(
                    "ranks asked to swap to different strategies ({} here)",
                    s.name()
                ),
            });
        }
        self.inner.transport.advance_epoch(next);
        self.set_strategy(s);
        Ok(next)
    }

    /// Starts an op on raw bytes; `input` must be `spec.input_len(size)`
    /// bytes (it is copied, so it may be reused at once).
    pub fn submit(&self, name: &str, spec: OpSpec, input: &[u8]) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        self.start(
            name.into(),
            spec,
            input,
            Box::new(move |r| drop(tx.send(r))),
            false,
        );
        h
    }

    /// Starts an op whose completion runs `callback` (once, with the final
    /// status) instead of completing a handle.
    pub fn submit_with_callback(&self, name: &str, spec: OpSpec, input: &[u8], callback: Callback) {
        self.start(name.into(), spec, input, callback, false);
    }

    fn typed<E: Element>(
        &self,
        name: &str,
        kind: OpKind,
        count: usize,
        input: &[E],
    ) -> OpHandle<Vec<E>> {
        let (tx, h) = OpHandle::pair();
        let spec = OpSpec {
            kind,
            dtype: E::DTYPE,
            count,
        };
        let cb: Callback = Box::new(move |r| drop(tx.send(r.map(|o| o.to_vec::<E>()))));
        self.start(name.into(), spec, bytemuck::cast_slice(input), cb, false);
        h
    }

    /// Every rank gets the reduction of every rank's `input`.
    pub fn allreduce<E: Element>(&self, name: &str, input: &[E], op: ReduceOp) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Allreduce(op), input.len(), input)
    }

    /// Allreduces `buf` in place (its contents are the input and become
    /// the result).
    pub async fn allreduce_in_place<E: Element>(
        &self,
        name: &str,
        buf: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.in_place(name, OpKind::Allreduce(op), buf).await
    }

    /// Broadcasts `buf` in place from `root`.
    pub async fn broadcast_in_place<E: Element>(
        &self,
        name: &str,
        buf: &mut [E],
        root: Rank,
    ) -> Result<(), CollectiveError> {
        self.in_place(name, OpKind::Broadcast { root }, buf).await
    }

    /// Runs `kind` on `buf` (count = its length) and copies the output
    /// (of the same length) back into it; the working buffer goes back to
    /// the pool.
    async fn in_place<E: Element>(
        &self,
        name: &str,
        kind: OpKind,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        let spec = OpSpec {
            kind,
            dtype: E::DTYPE,
            count: buf.len(),
        };
        let out = self.submit(name, spec, bytemuck::cast_slice(buf)).await?;
        if let Some(o) = out.bytes() {
            bytemuck::cast_slice_mut::<E, u8>(buf).copy_from_slice(o);
        }
        Ok(())
    }

    /// `root` gets the reduction; other ranks get an empty vector.
    pub fn reduce<E: Element>(
        &self,
        name: &str,
        input: &[E],
        op: ReduceOp,
        root: Rank,
    ) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Reduce { op, root }, input.len(), input)
    }

    /// Every rank gets `root`'s `data`; other ranks pass a buffer of the
    /// same length (its contents are ignored).
    pub fn broadcast<E: Element>(&self, name: &str, data: &[E], root: Rank) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Broadcast { root }, data.len(), data)
    }

    /// Every rank gets every rank's `input`, concatenated in rank order.
    pub fn allgather<E: Element>(&self, name: &str, input: &[E]) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Allgather, input.len(), input)
    }

    /// `root` gets every rank's `input` in rank order; others get nothing.
    pub fn gather<E: Element>(&self, name: &str, input: &[E], root: Rank) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Gather { root }, input.len(), input)
    }

    /// `input` is `size` blocks; rank `r` gets the reduction of block `r`.
    pub fn reduce_scatter<E: Element>(
        &self,
        name: &str,
        input: &[E],
        op: ReduceOp,
    ) -> OpHandle<Vec<E>> {
        self.blockwise(name, OpKind::ReduceScatter(op), input)
    }

    /// `input` is `size` blocks; rank `r` gets block `r` of every rank.
    pub fn alltoall<E: Element>(&self, name: &str, input: &[E]) -> OpHandle<Vec<E>> {
        self.blockwise(name, OpKind::Alltoall, input)
    }

    /// An op whose input is `size` equal blocks.
    fn blockwise<E: Element>(&self, name: &str, kind: OpKind, input: &[E]) -> OpHandle<Vec<E>> {
        let count = input.len() / self.size();
        if count * self.size() != input.len() {
            return self.invalid(
                name,
                format!(
                    "{} input of {} elements is not {} equal blocks",
                    kind.name(),
                    input.len(),
                    self.size()
                ),
            );
        }
        self.typed(name, kind, count, input)
    }

    /// Completes on every rank once every rank has called it (with the same
    /// name). Names let unrelated barriers overlap.
    pub fn barrier(&self, name: &str) -> OpHandle<()> {
        let (tx, h) = OpHandle::pair();
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Max),
            dtype: DType::U8,
            count: 0,
        };
        self.start(
            name.into(),
            spec,
            &[],
            Box::new(move |r| drop(tx.send(r.map(|_| ())))),
            false,
        );
        h
    }

    /// Whether every rank passed the same bytes (length included).
    pub fn consensus(&self, name: &str, data: &[u8]) -> OpHandle<bool> {
        let (tx, h) = OpHandle::pair();
        if let Err(reason) = check_name(name) {
            drop(tx.send(Err(self.invalid_err(name, reason))));
            return h;
        }
        self.consensus_with(name, data, false, tx);
        h
    }

    /// Runs a consensus; `gated`: the caller holds the swap gate (its ops
    /// must not wait for it).
    fn consensus_with(
        &self,
        name: &str,
        data: &[u8],
        gated: bool,
        tx: oneshot::Sender<Result<bool, CollectiveError>>,
    ) {
        // max(x) == min(x) across ranks, computed as one allreduce-max of
        // [x, !x]: the second half yields !min(x). First on the lengths,
        // then, if they agree, on the bytes. Internal names end in NUL so
        // they cannot collide with a caller's.
        let len = data.len() as u64;
        let session = self.clone();
        let data = data.to_vec();
        let name = name.to_string();
        self.inner.runtime.spawn(async move {
            let r = async {
                let spec = |count| OpSpec {
                    kind: OpKind::Allreduce(ReduceOp::Max),
                    dtype: DType::U64,
                    count,
                };
                let lens = [len, !len];
                let out = session
                    .start_internal(
                        gated,
                        &format!("{name}\0len"),
                        spec(2),
                        bytemuck::cast_slice(&lens),
                    )
                    .await?;
                let v: Vec<u64> = out.to_vec();
                if v[0] != !v[1] {
                    return Ok(false);
                }
                let mut both = data.clone();
                both.extend(data.iter().map(|b| !b));
                let spec = OpSpec {
                    kind: OpKind::Allreduce(ReduceOp::Max),
                    dtype: DType::U8,
                    count: both.len(),
                };
                let out = session
                    .start_internal(gated, &format!("{name}\0data"), spec, &both)
                    .await?;
                let b = out.bytes().unwrap_or_default();
                let (max, notmin) = b.split_at(data.len());
                Ok(max.iter().zip(notmin).all(|(a, b)| *a == !*b))
            }
            .await;
            drop(tx.send(r));
        });
    }

    /// Starts an op under an internal name (not checked); `gated`: the
    /// swap that holds the gate starts it, so it does not wait for it.
    fn start_internal(
        &self,
        gated: bool,
        name: &str,
        spec: OpSpec,
        input: &[u8],
    ) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        if gated {
            self.start_now(
                name.into(),
                spec,
                input,
                Box::new(move |r| drop(tx.send(r))),
                true,
            );
            return h;
        }
        self.start(
            name.into(),
            spec,
            input,
            Box::new(move |r| drop(tx.send(r))),
            true,
        );
        h
    }

    fn invalid_err(&self, name: &str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            name: name.into(),
            reason,
        }
    }

    fn invalid<O>(&self, name: &str, reason: String) -> OpHandle<O> {
        let (tx, h) = OpHandle::pair();
        drop(tx.send(Err(self.invalid_err(name, reason))));
        h
    }

    /// Validates, plans and spawns one op. Errors before the spawn complete
    /// the callback at once. During a swap, the caller's ops wait for it.
    fn start(&self, name: Arc<str>, spec: OpSpec, input: &[u8], done: Callback, internal: bool) {
        {
            if let Some(q) = lock(&self.inner.gate).as_mut() {
                q.push(Deferred {
                    name,
                    spec,
                    input: input.to_vec(),
                    done,
                    internal,
                });
                return;
            }
        }
        self.start_now(name, spec, input, done, internal);
    }

    fn start_now(
        &self,
        name: Arc<str>,
        spec: OpSpec,
        input: &[u8],
        done: Callback,
        internal: bool,
    ) {
        match self.prepare(name.clone(), spec, input, internal) {
            Ok(mut op) => {
                let inner = self.inner.clone();
                inner
                    .inflight
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                self.inner.runtime.spawn(async move {
                    let started = std::time::Instant::now();
                    let r = op.run(&inner).await;
                    if r.is_ok() {
                        lock(&inner.stats)
                            .entry(op.strategy)
                            .or_default()
                            .add(op.spec.block_bytes().unwrap_or(0), started.elapsed());
                        let mut ps = lock(&inner.peer_stats);
                        for (p, &(frames, bytes, last)) in ps.iter_mut().zip(&op.arrivals) {
                            if frames > 0 {
                                p.ops += 1;
                                p.frames += frames;
                                p.bytes += bytes;
                                p.last_frame += last;
                            }
                        }
                    }
                    inner.transport.retire(op.tag);
                    lock(&inner.tombstones).insert(op.tag, op.digest, op.spec);
                    lock(&inner.names).end(op.tag.op);
                    if let Err(e) = &r {
                        op.notify_failure(&inner, e);
                    }
                    done(r);
                    if inner
                        .inflight
                        .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
                        == 1
                    {
                        inner.drained.notify_waiters();
                    }
                });
            }
            Err(e) => done(Err(e)),
        }
    }

    fn prepare(
        &self,
        name: Arc<str>,
        spec: OpSpec,
        input: &[u8],
        internal: bool,
    ) -> Result<RunningOp, CollectiveError> {
        let n = self.size();
        let me = self.rank();
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: name.clone(),
            reason,
        };
        if !internal {
            check_name(&name).map_err(invalid)?;
        }
        spec.validate(n).map_err(invalid)?;
        let want = spec.input_len(n).expect("validated");
        if input.len() != want {
            return Err(invalid(format!(
                "{} needs {want} input bytes, got {}",
                spec.describe(),
                input.len()
            )));
        }
        let bytes = spec.block_bytes().expect("validated");
        let root = spec.kind.root();
        let topo = self.topology(root, bytes);
        let digest = spec.digest(&topo).short();
        let plan = build(&PlanInput {
            spec: &spec,
            me,
            size: n,
            chunk_bytes: self.inner.config.chunk_bytes,
            topology: &|r| self.topology(r, bytes),
        })
        .map_err(invalid)?;
        let (op, seq) = lock(&self.inner.names).begin(&name)?;
        let mut work = self.inner.pool.take(spec.work_len(n).expect("validated"));
        spec.init_work_into(input, me, n, work.vec_mut());
        Ok(RunningOp {
            name,
            spec,
            tag: OpTag {
                epoch: self.epoch(),
                op,
                seq,
            },
            digest,
            work,
            plan,
            remote_abort: false,
            strategy: topo.strategy(),
            started: std::time::Instant::now(),
            arrivals: vec![(0, 0, Duration::ZERO); n],
        })
    }

    /// Closes the transport gracefully (see [`Transport::close`]): call it
    /// when this worker is done, so frames its peers still need arrive.
    pub async fn close(&self, linger: Duration) {
        self.inner.transport.close(linger).await;
    }

    /// Stops the transport at once: ops in flight and later fail.
    pub fn shutdown(&self) {
        self.inner.transport.shutdown();
    }
}

/// One op in flight: its plan, buffer and identity.
struct RunningOp {
    name: Arc<str>,
    spec: OpSpec,
    tag: OpTag,
    digest: u32,
    work: PooledBuf,
    plan: Plan,
    /// The op failed because a peer said so (not to be echoed back).
    remote_abort: bool,
    /// The strategy it runs on (`AUTO` resolved).
    strategy: Strategy,
    started: std::time::Instant,
    /// Data frames received, by sender.
    arrivals: Vec<Arrivals>,
}

/// Counts a data frame from `from` of `len` bytes.
fn arrived(arrivals: &mut [Arrivals], started: std::time::Instant, from: Rank, len: usize) {
    if let Some(a) = arrivals.get_mut(from.idx()) {
        a.0 += 1;
        a.1 += len as u64;
        a.2 = started.elapsed();
    }
}

type SendResult = Result<usize, (Rank, TransportError)>;

impl RunningOp {
    async fn run<T: Transport>(&mut self, inner: &Inner<T>) -> Result<OpOutput, CollectiveError> {
        let t = &inner.transport;
        let (me, n) = (t.rank(), t.size());
        let needed = self.plan.peers().clone();
        // A lost rank fails the op now, unless we only receive from it and
        // some of its frames for this op are here (a broadcast root that
        // sent everything and closed): then the receives decide.
        t.check_peers(self.plan.targets())
            .and_then(|()| t.check_peers_for(self.tag, &needed))
            .map_err(|e| self.transport_error(e))?;
        // Aborts may come from any rank, so listen to all, and drop lost
        // ranks this op does not need as they are reported.
        let mut listen: PeerSet = (0..n as u32).map(Rank).filter(|&r| r != me).collect();
        let mut sends: JoinSet<SendResult> = JoinSet::new();
        let timeout = inner.config.op_timeout;
        let mut deadline = Instant::now() + timeout;
        let cap = inner.config.max_inflight_bytes;
        let mut inflight = 0usize;
        // Frames for backends that send from place once there is room
        // (shared memory with a full ring): kept in the working buffer, not
        // copied, and tried again between receives.
        let mut pending: VecDeque<Transmit> = VecDeque::new();
        loop {
            let mut k = 0;
            while k < pending.len() {
                let tx = &pending[k];
                let header = self.header(FrameKind::Data, tx.chunk, tx.step);
                if t.try_send_now(tx.to, header, &self.work[tx.range.clone()])
                    .map_err(|e| self.transport_error(e))?
                {
                    let tx = pending.remove(k).expect("k < len");
                    self.plan.handle_sent(tx.id, &mut self.work);
                    deadline = Instant::now() + timeout;
                } else {
                    k += 1;
                }
            }
            while inflight < cap || sends.is_empty() {
                let Some(tx) = self.plan.poll_transmit() else {
                    break;
                };
                let header = self.header(FrameKind::Data, tx.chunk, tx.step);
                // Straight from the buffer where the backend can (no copy
                // into an owned payload, no task).
                if t.try_send_now(tx.to, header, &self.work[tx.range.clone()])
                    .map_err(|e| self.transport_error(e))?
                {
                    self.plan.handle_sent(tx.id, &mut self.work);
                    continue;
                }
                if t.sends_in_place(tx.to) {
                    pending.push_back(tx);
                    continue;
                }
                let mut copy = inner.frames.take(tx.range.len());
                copy.as_mut().copy_from_slice(&self.work[tx.range.clone()]);
                let payload = copy.freeze();
                self.plan.handle_sent(tx.id, &mut self.work);
                let t = t.clone();
                let len = payload.len();
                inflight += len;
                sends.spawn(async move {
                    t.send(tx.to, header, payload)
                        .await
                        .map(|()| len)
                        .map_err(|e| (tx.to, e))
                });
            }
            if self.plan.is_done() {
                break;
            }
            // With frames pending, receive without sleeping (the backend
            // still spins, then comes back to retry them).
            let recv_deadline = if pending.is_empty() {
                deadline
            } else {
                Instant::now()
            };
            tokio::select! {
                Some(joined) = sends.join_next(), if !sends.is_empty() => {
                    inflight -= self.check_send(joined)?;
                    deadline = Instant::now() + timeout;
                }
                r = t.recv_in_place(self.tag, &listen, recv_deadline, {
                    // Frames the plan can take now are applied straight
                    // from the transport's memory (shm: the ring); anything
                    // else (aborts, other digests, frames ahead of their
                    // dependencies) comes back owned and goes the long way.
                    let (plan, work, digest) = (&mut self.plan, &mut *self.work, self.digest);
                    let (arrivals, started) = (&mut self.arrivals, self.started);
                    move |from: Rank, h: &Header, parts: &[&[u8]]| {
                        let taken = h.kind == FrameKind::Data
                            && h.digest == digest
                            && matches!(plan.try_apply(from, h.chunk, h.step, parts, work), Ok(true));
                        if taken {
                            arrived(arrivals, started, from, parts.iter().map(|p| p.len()).sum());
                        }
                        taken
                    }
                }) => match r {
                    Ok(None) => deadline = Instant::now() + timeout,
                    Ok(Some(frame)) => {
                        deadline = Instant::now() + timeout;
                        self.handle_frame(inner, frame)?;
                    }
                    // A lost peer this op does not need, or no longer needs
                    // (everything it owed us arrived before its connection
                    // closed; sends still owed to it fail on their own), is
                    // no reason to fail.
                    Err(TransportError::PeerLost { peer, .. })
                        if !needed.contains(peer) || !self.plan.waiting_for().contains(&peer) =>
                    {
                        listen.remove(peer);
                    }
                    Err(TransportError::Timeout { .. })
                        if !pending.is_empty() && Instant::now() < deadline => {}
                    Err(TransportError::Timeout { .. }) => {
                        return Err(CollectiveError::Timeout {
                            name: self.name.clone(),
                            epoch: self.tag.epoch,
                            after: timeout,
                            waiting: self.plan.waiting_for(),
                        });
                    }
                    Err(e) => return Err(self.transport_error(e)),
                }
            }
        }
        // Complete only once every frame is handed to the transport, so a
        // caller that shuts down after the last op loses nothing.
        loop {
            match tokio::time::timeout_at(deadline, sends.join_next()).await {
                Ok(Some(joined)) => {
                    self.check_send(joined)?;
                }
                Ok(None) => break,
                Err(_) => {
                    return Err(CollectiveError::Timeout {
                        name: self.name.clone(),
                        epoch: self.tag.epoch,
                        after: timeout,
                        waiting: Vec::new(),
                    })
                }
            }
        }
        let range = self.spec.output_range(me, n);
        if let (Some(ReduceOp::Avg), Some(r)) = (self.spec.kind.reduce_op(), &range) {
            scale_down(self.spec.dtype, &mut self.work[r.clone()], n);
        }
        Ok(OpOutput {
            work: std::mem::replace(&mut self.work, PooledBuf::unpooled(Vec::new())),
            range,
            epoch: self.tag.epoch,
            strategy: self.strategy,
        })
    }

    fn header(&self, kind: FrameKind, chunk: u32, step: u16) -> Header {
        Header {
            kind,
            tag: self.tag,
            chunk,
            step,
            digest: self.digest,
            len: 0,
        }
    }

    /// The bytes a finished send carried, or its error.
    fn check_send(
        &self,
        joined: Result<SendResult, tokio::task::JoinError>,
    ) -> Result<usize, CollectiveError> {
        match joined {
            Ok(Ok(len)) => Ok(len),
            Ok(Err((_, e))) => Err(self.transport_error(e)),
            Err(e) => Err(CollectiveError::Transport {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                source: TransportError::Handshake {
                    peer: None,
                    addr: String::new(),
                    reason: format!("send task failed: {e}"),
                },
            }),
        }
    }

    fn transport_error(&self, e: TransportError) -> CollectiveError {
        match e {
            TransportError::PeerLost { peer, .. } => CollectiveError::PeerLost {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                peer,
                source: e,
            },
            TransportError::Closed => CollectiveError::Closed,
            e => CollectiveError::Transport {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                source: e,
            },
        }
    }

    fn handle_frame<T: Transport>(
        &mut self,
        inner: &Inner<T>,
        f: Frame,
    ) -> Result<(), CollectiveError> {
        let me = inner.transport.rank();
        if f.header.kind == FrameKind::Data {
            arrived(&mut self.arrivals, self.started, f.from, f.payload.len());
        }
        match f.header.kind {
            FrameKind::Abort => Err(match Abort::decode(&f.payload) {
                Ok(a) => {
                    self.remote_abort = true;
                    a.to_error(&self.name, self.tag.epoch, me, &self.spec)
                }
                Err(why) => CollectiveError::Protocol {
                    name: self.name.clone(),
                    epoch: self.tag.epoch,
                    peer: f.from,
                    reason: format!("malformed abort frame: {why}"),
                },
            }),
            FrameKind::Data if f.header.digest != self.digest => {
                Err(CollectiveError::Mismatch {
                    name: self.name.clone(),
                    epoch: self.tag.epoch,
                    ranks: vec![me, f.from],
                    detail: format!(
                        "rank {} sent a frame for a different op spec (digest {:08x}); rank {} has {} (digest {:08x})",
                        f.from.0, f.header.digest, me.0, self.spec.describe(), self.digest
                    ),
                })
            }
            FrameKind::Data => {
                let (chunk, step) = (f.header.chunk, f.header.step);
                self.plan
                    .handle_frame(f.from, chunk, step, f.payload, &mut self.work)
                    .map_err(|e| CollectiveError::Protocol {
                            name: self.name.clone(),
                            epoch: self.tag.epoch,
                            peer: f.from,
                            reason: e.to_string(),
                    })
            }
        }
    }

    /// Tells every other rank that this op failed here and why, so none
    /// waits for its deadline. Errors that came from a peer's abort are not
    /// echoed; local-only errors (invalid arguments, shutdown) concern no one
    /// else.
    fn notify_failure<T: Transport>(&self, inner: &Inner<T>, e: &CollectiveError) {
        let me = inner.transport.rank();
        if self.remote_abort {
            return;
        }
        let (reason, offender) = match e {
            CollectiveError::Mismatch { ranks, .. } => {
                (AbortReason::Mismatch, ranks.get(1).copied().unwrap_or(me))
            }
            CollectiveError::Protocol { peer, .. } => (AbortReason::Protocol, *peer),
            CollectiveError::PeerLost { peer, .. } => (AbortReason::PeerLost, *peer),
            CollectiveError::Timeout { waiting, .. } => {
                (AbortReason::Timeout, waiting.first().copied().unwrap_or(me))
            }
            _ => return,
        };
        let abort = Abort::new(reason, me, offender, &self.spec);
        send_aborts(inner, self.tag, self.digest, &abort);
    }
}

/// Sends `abort` for op `tag` to every other rank. Best effort: the local
/// error stands either way; each send is bounded by the op timeout.
fn send_aborts<T: Transport>(inner: &Inner<T>, tag: OpTag, digest: u32, abort: &Abort) {
    let t = &inner.transport;
    let me = t.rank();
    let payload = abort.encode();
    let header = Header {
        kind: FrameKind::Abort,
        tag,
        chunk: 0,
        step: 0,
        digest,
        len: 0,
    };
    for r in (0..t.size() as u32).map(Rank).filter(|&r| r != me) {
        if t.check_peers(&[r].into_iter().collect()).is_err() {
            continue;
        }
        let t = t.clone();
        let payload = payload.clone();
        let budget = inner.config.op_timeout;
        inner.runtime.spawn(async move {
            let _ = tokio::time::timeout(budget, t.send(r, header, payload)).await;
        });
    }
}

/// Reads strays (frames of finished ops) and tells every rank when one
/// reveals a disagreeing peer. Ends when the session is dropped or the
/// transport closes.
async fn watch_strays<T: Transport>(weak: std::sync::Weak<Inner<T>>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let t = inner.transport.clone();
        drop(inner);
        // Wake up now and then to notice that the session is gone.
        let f = match t
            .recv_stray(Instant::now() + Duration::from_millis(500))
            .await
        {
            Ok(f) => f,
            Err(TransportError::Timeout { .. }) => continue,
            Err(_) => return,
        };
        if f.header.kind != FrameKind::Data {
            continue;
        }
        let Some(inner) = weak.upgrade() else { return };
        let tomb = lock(&inner.tombstones).map.get(&f.header.tag).copied();
        if let Some((digest, spec)) = tomb {
            if f.header.digest != digest {
                let abort = Abort::new(AbortReason::Mismatch, t.rank(), f.from, &spec);
                send_aborts(&inner, f.header.tag, digest, &abort);
            }
        }
    }
}
