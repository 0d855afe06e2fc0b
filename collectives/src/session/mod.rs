//! The scheduler: starts ops, drives their plans over a [`Transport`], and
//! reports completions.
//!
//! Each op runs as its own task: it takes frames of its [`OpTag`] from the
//! transport (so ops in flight never wait on each other, and ranks may
//! issue them in any order), hands them to its plan, and sends what the
//! plan says. Every wait is bounded by the op timeout, counted from the
//! op's last progress.

mod driver;
mod fast;
mod opmem;
mod output;
mod plans;
mod running;
mod stall;
mod stats;
mod swap;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kungfu_topology::{AutoThresholds, PeerList, Rank, Root, Strategy, Topology};
use kungfu_transport::{Epoch, Generation, OpTag, Transport};
use tokio::sync::oneshot;

use crate::names::{check_name, NameTable};
use crate::op::{MachineConfig, OpInstance, OpMachine};
use crate::plan::build::{build, PlanInput};
use crate::{CollectiveError, DType, Element, OpKind, OpSpec, ReduceOp};
use kungfu_transport::pool::BufferPool;

use driver::watch_strays;
use running::RunningOp;
use swap::{Deferred, Tombstones};

pub use swap::{Agreement, SwapGate, SwapTo};

pub use output::{Callback, OpHandle, OpOutput};
pub use stall::{Stall, DEFAULT_STALL_TIMEOUT};
pub use stats::{OpStats, PeerStats};

use output::{Memory, Start};

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
    /// always allowed). Sends that a backend makes later copy their bytes,
    /// so this bounds the extra memory a large op takes at once.
    ///
    /// Memory: an op's working buffer ([`OpSpec::work_len`] bytes) and
    /// those copies come from the transport's buffer pool
    /// ([`Transport::pool`]), which the transport's received payloads come
    /// from too. Buffers go back to it when dropped (an [`OpOutput`] when
    /// the caller drops it), and it keeps at most its budget of them idle
    /// ([`kungfu_transport::pool`]; the runtime reads
    /// `KUNGFU_BUFFER_POOL_BYTES`, 256 MiB by default), so ops in the
    /// steady state allocate no buffer.
    pub max_inflight_bytes: usize,
    /// Allreduce, broadcast and allgather of at most this many bytes per
    /// rank take the host fast path when every rank is on this host and
    /// reached through shared memory (`session/fast.rs`): broadcast and
    /// allgather up to a lane's slot (256 KiB), allreduce up to a slot per
    /// rank (split, `session/fast/split.rs`); [`DEFAULT_FAST_MAX_BYTES`]
    /// by default; 0: never. Every rank must use the same value.
    pub fast_max_bytes: usize,
    /// Which larger ops (above what the lanes take) of one host move their
    /// bytes with one cross-memory copy from the peers' buffers
    /// (`session/fast/large.rs`), where the host permits it
    /// (`kungfu_transport::shm::cma::available`), instead of through the
    /// rings: broadcast and allgather by default, and allreduce from
    /// [`LARGE_ALLREDUCE_FROM`]. Every rank must use the same value.
    pub fast_large: FastLarge,
    /// Where ops record their phases ([`crate::timeline`]); `None`: off.
    pub timeline: Option<Arc<crate::timeline::Timeline>>,
}

impl Default for SessionConfig {
    /// `AUTO`, 1 MiB chunks, 60 s without progress, 64 MiB in flight,
    /// the fast path up to 1 MiB, larger ops through the rings.
    fn default() -> SessionConfig {
        SessionConfig {
            strategy: Strategy::Auto,
            auto: AutoThresholds::default(),
            chunk_bytes: 1 << 20,
            op_timeout: Duration::from_secs(60),
            max_inflight_bytes: 64 << 20,
            fast_max_bytes: DEFAULT_FAST_MAX_BYTES,
            fast_large: FastLarge::default(),
            timeline: None,
        }
    }
}

/// Which larger ops of one host take cross-memory attach
/// ([`SessionConfig::fast_large`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FastLarge {
    /// None: they go through the rings.
    Off,
    /// Broadcast and allgather, and allreduce from [`LARGE_ALLREDUCE_FROM`]
    /// (the default). One copy from the root's or the owner's buffer beats
    /// the rings' two or more per hop for the copies, measured here at 1 to
    /// 16 MiB (busbw against Open MPI 0.92-0.99 where the rings give
    /// 0.59-0.70 at 2 ranks; 0.50-0.62 against 0.25-0.41 at 4). For
    /// allreduce the one-copy reduction only wins on larger buffers; see
    /// [`LARGE_ALLREDUCE_FROM`].
    #[default]
    Copies,
    /// Allreduce of every size above the lanes too (slower than the rings
    /// below [`LARGE_ALLREDUCE_FROM`]).
    All,
}

/// Allreduce buffers of at least this many bytes take cross-memory attach
/// under [`FastLarge::Copies`]. Measured here (2-core machine, busbw of the
/// one-copy way against the rings, medians of 5 alternating rounds): at 2
/// ranks 0.95/1.03/1.02 at 2/8/32 MiB, at 4 ranks 0.92/1.13/1.06; at 1 MiB
/// 0.77 and 1.05 (3 rounds). Each `process_vm_readv` pins the pages it
/// reads and the phases do not overlap, which the rings' pipelining beats
/// on smaller buffers.
pub const LARGE_ALLREDUCE_FROM: usize = 8 << 20;

impl FastLarge {
    /// Whether ops of `kind` with `bytes` per rank's block take it.
    pub fn takes(self, kind: OpKind, bytes: usize) -> bool {
        match self {
            FastLarge::Off => false,
            FastLarge::Copies => match kind {
                OpKind::Broadcast { .. } | OpKind::Allgather => true,
                OpKind::Allreduce(_) => bytes >= LARGE_ALLREDUCE_FROM,
                _ => false,
            },
            FastLarge::All => true,
        }
    }
}

/// [`SessionConfig::fast_max_bytes`] by default: 1 MiB (an allreduce of
/// 4 ranks whose slices fill a slot each).
pub const DEFAULT_FAST_MAX_BYTES: usize = 4 * kungfu_transport::shm::lane::SLOT_BYTES;

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

    /// [`Session::topology`] under strategy `s` rather than the session's.
    fn topology_of(&self, s: Strategy, root: Root, bytes: usize) -> Arc<Topology> {
        let s = match s {
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

    /// Starts an op on raw bytes; `input` must be `spec.input_len(size)`
    /// bytes (it is copied, so it may be reused at once).
    pub fn submit(&self, name: &str, spec: OpSpec, input: &[u8]) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        let done = Box::new(move |r| drop(tx.send(r)));
        let d = self.start(Start::new(name, spec, Memory::Input(input), done));
        h.driven(d)
    }

    /// Starts an op whose completion runs `callback` (once, with the final
    /// status) instead of completing a handle.
    pub fn submit_with_callback(&self, name: &str, spec: OpSpec, input: &[u8], callback: Callback) {
        self.start(Start::new(name, spec, Memory::Input(input), callback).unwaited());
    }

    /// Starts an op that works in `work` itself, with no copy in or out:
    /// `work` holds [`OpSpec::work_len`] bytes laid out by
    /// [`OpSpec::init_work`] (for allreduce, and broadcast at the root,
    /// that is the input itself), and the output is left in it at
    /// [`OpSpec::output_range`] (for allreduce, broadcast and allgather,
    /// all of it). Frames of posted receives land in it straight from the
    /// wire.
    ///
    /// The op holds `work` until it completes, and wires may hold ranges
    /// of it a while after a failure; the returned output shares its
    /// output range. A region over the caller's memory
    /// ([`Region::foreign`](kungfu_transport::Region::foreign)) learns
    /// that everyone is done with it from its release hook (the C ABI
    /// completes its in-place ops from there).
    pub fn submit_in(
        &self,
        name: &str,
        spec: OpSpec,
        work: Arc<kungfu_transport::Region>,
    ) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        let done = Box::new(move |r| drop(tx.send(r)));
        let d = self.start(Start::new(name, spec, Memory::Region(work), done));
        h.driven(d)
    }

    /// [`Session::submit_in`], completing with `callback`.
    pub fn submit_in_with_callback(
        &self,
        name: &str,
        spec: OpSpec,
        work: Arc<kungfu_transport::Region>,
        callback: Callback,
    ) {
        self.start(Start::new(name, spec, Memory::Region(work), callback).unwaited());
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
        let input = Memory::Input(bytemuck::cast_slice(input));
        let d = self.start(Start::new(name, spec, input, cb));
        h.driven(d)
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
        let done = Box::new(move |r: Result<OpOutput, _>| drop(tx.send(r.map(|_| ()))));
        let d = self.start(Start::new(name, spec, Memory::Input(&[]), done));
        h.driven(d)
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
        let done = Box::new(move |r| drop(tx.send(r)));
        let s = Start::new(name, spec, Memory::Input(input), done).internal();
        let d = if gated {
            self.start_now(s)
        } else {
            self.start(s)
        };
        h.driven(d)
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
    /// An op on the fast path returns what its waited handle drives.
    fn start(&self, s: Start<'_>) -> Option<Arc<dyn fast::Drive>> {
        let admitted = lock(&self.inner.gate).admit(s, |s| Deferred {
            name: s.name,
            spec: s.spec,
            memory: output::HeldMemory::of(s.mem),
            done: s.done,
            internal: s.internal,
            since: std::time::Instant::now(),
        });
        admitted.and_then(|s| self.start_now(s))
    }

    fn prepare(
        &self,
        name: Arc<str>,
        spec: OpSpec,
        mem: Memory,
        internal: bool,
    ) -> Result<RunningOp, CollectiveError> {
        let n = self.size();
        let me = self.rank();
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: name.clone(),
            reason,
        };
        self.check(&name, &spec, &mem, internal)?;
        let configured = self.strategy();
        let cached = lock(&self.inner.plans).get(&spec, configured);
        let plans::Cached {
            plan,
            digest,
            strategy,
        } = match cached {
            Some(c) => c,
            None => {
                let bytes = spec.block_bytes().expect("validated");
                let topo = self.topology_of(configured, spec.kind.root(), bytes);
                let c = plans::Cached {
                    plan: build(&PlanInput {
                        spec: &spec,
                        me,
                        size: n,
                        chunk_bytes: self.inner.config.chunk_bytes,
                        topology: &|r| self.topology_of(configured, r, bytes),
                    })
                    .map_err(invalid)?,
                    digest: spec.digest(&topo).short(),
                    strategy: topo.strategy(),
                };
                lock(&self.inner.plans).insert(spec, configured, c.clone());
                c
            }
        };
        let (op, seq) = lock(&self.inner.names).begin(&name)?;
        let work = self.work_of(&spec, mem);
        let op = OpInstance {
            name,
            spec,
            tag: OpTag {
                epoch: self.epoch(),
                op,
                seq,
            },
            digest,
            strategy,
        };
        let cfg = MachineConfig {
            timeout: self.inner.config.op_timeout,
            max_inflight_bytes: self.inner.config.max_inflight_bytes,
        };
        Ok(RunningOp {
            m: OpMachine::new(op, plan, me, n, cfg, kungfu_transport::Instant::now()),
            work,
        })
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
