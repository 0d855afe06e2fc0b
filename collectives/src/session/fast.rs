//! The host fast path: small allreduce, broadcast and allgather when every
//! rank of the session is on this host, through the shared-memory lanes
//! ([`kungfu_transport::shm::lane`]).
//!
//! Each rank publishes its whole contribution into a slot of its lane to
//! every peer at issue time; an op completes when every contribution it
//! needs is published, and each rank computes the result from the slots
//! in place (an allreduce reduces in rank order, so every rank gets the
//! same bits). There is no task, plan, frame or oneshot wake-up on this
//! path, and no allocation for ops of the same size (buffers come from the
//! pool): an op costs a few stores and a poll of a flag per peer.
//!
//! Three ways, chosen from the spec alone:
//! - **direct** (above): ops up to a slot; allreduce below
//!   `split::SPLIT_FROM` (64 KiB);
//! - **split** (`split.rs`): a larger allreduce whose 1/n slices fit a
//!   slot, as a reduce-scatter then an allgather through the lanes;
//! - **large** (`large.rs`): larger broadcast and allgather (and allreduce
//!   if asked) copy once from the owner's buffer by cross-memory attach.
//!
//! Ops are matched by tag, so any order of issue works (the lanes spill
//! contributions of ops not started yet, see there), and many may be in
//! flight. Every path decides alike from the spec alone
//! ([`Fast::takes`]), so that all ranks take the same path for an op.
//!
//! # Progress and waiting
//!
//! Nothing moves unless somebody polls. A caller that waits on its handle
//! polls every op in flight itself for [`INLINE_SPIN`](progress::INLINE_SPIN)
//! (the common case: it
//! is done before that), then hands over to one progress thread per
//! process, which polls while ops are in flight and sleeps on a condition
//! variable when none are. Ops started with a callback (the C ABI) are
//! the thread's from the start. Neither burns a core that a peer needs:
//! with more ranks than cores both yield (`sched_yield`) between polls
//! instead of spinning, and the thread stands aside (sleeps) while a
//! caller polls. This is Open MPI's "yield when idle" policy for
//! oversubscribed hosts, measured in `docs/bench`. When nothing has moved
//! for as long as a caller would spin, the thread sleeps on the lanes'
//! door bells (futex words that a peer rings when it posts to this rank or
//! releases one of its slots, and this process when it hands the thread an
//! op: `kungfu_transport::shm::bell`), for 1 ms at most, so that an op
//! waiting for a late peer costs little CPU while it waits (where the
//! kernel has no `futex_waitv`, it naps 100 us at a time instead).
//!
//! # Errors
//!
//! An op fails, naming the ranks it waits for, when it makes no progress
//! for the op timeout, and at once when one of them is lost (checked every
//! [`LIVENESS_EVERY`](step::LIVENESS_EVERY)), by the op machine's rules and
//! code ([`crate::failure`]: the deadline, the culprit named, a peer's
//! abort, a mismatch). A contribution whose digest (kind, type, count,
//! root) differs from this rank's fails the op as a mismatch naming both
//! ranks. Every rank of a broadcast hears from every other (the others
//! than the root post an empty contribution), so a disagreement fails it
//! on every rank, never only on those that receive.
//!
//! # Layout
//!
//! This file holds the engine's types, the choice of way and the making of
//! an op; `step.rs` moves one op (posting, claiming, deadlines, peers'
//! aborts) and ends it; `progress.rs` holds who polls (a waiting caller,
//! the progress thread) and how ended ops complete; `direct.rs`,
//! `split.rs` and `large.rs` compute each way's output.

mod direct;
mod large;
mod norms;
mod progress;
mod split;
mod step;

use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex};

use crate::lock;
use std::time::Instant;

use kungfu_topology::{fnv1a64, Rank, Root};
use kungfu_transport::shm::lane::{Found, HostLanes, SLOT_BYTES};
use kungfu_transport::{OpTag, Transport, TransportError};

use super::opmem::OpMem;
use super::{Callback, Inner, OpOutput};
use crate::failure::Liveness;
use crate::pool::PooledBuf;
use crate::{CollectiveError, OpKind, OpSpec};

use progress::progress_thread;
pub(crate) use progress::Drive;

/// The fast path of one session over one transport.
pub(super) struct Fast<T> {
    lanes: Arc<HostLanes>,
    t: Arc<T>,
    state: Mutex<State<T>>,
    cv: Condvar,
    /// A caller polls inline until this instant (ns since `zero`): the
    /// thread stands aside.
    inline_until: AtomicU64,
    zero: Instant,
    /// Ops in flight (`State::ops.len()`, read without the lock).
    live: AtomicUsize,
    /// Ops ended and taken out of the state whose completion (callback)
    /// has not run yet: [`Fast::fail_all`] waits for them, so that a
    /// closed session has run every callback.
    completing: Arc<AtomicUsize>,
    oversubscribed: bool,
    /// Rung (with a wake-up if the thread sleeps on the lanes' bells)
    /// whenever the thread is told something (see `progress.rs`).
    bell: AtomicU32,
    bell_sleepers: AtomicU32,
    max_bytes: usize,
    /// Which larger ops go through cross-memory attach (see `large.rs`).
    large: super::FastLarge,
}

/// The three ways of the fast path (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Direct,
    Split,
    Large,
}

/// A contribution whose length changed after its claim (a peer rewrote
/// its slot): the op fails, naming it.
fn changed(p: Rank, len: usize) -> TransportError {
    TransportError::PeerLost {
        peer: p,
        reason: format!("its contribution changed to {len} bytes").into(),
    }
}

struct State<T> {
    ops: Vec<FastOp<T>>,
}

/// One op in flight on the fast path.
pub(super) struct FastOp<T> {
    inner: Arc<Inner<T>>,
    name: Arc<str>,
    spec: OpSpec,
    tag: OpTag,
    /// The tag its lane messages carry now (a large op's phase's).
    lane_tag: OpTag,
    lane_rank: Rank,
    /// A large op (cross-memory attach): its phase and the peers' buffers.
    large: Option<large::Large>,
    /// A split allreduce's phase (`split.rs`).
    split: Option<u32>,
    /// A monitored allreduce's squares ([`Fast::fuses_norms`]).
    norms: Option<norms::Norms>,
    digest: u32,
    work: OpMem,
    /// An allreduce's own input on a rank other than 0 (the work buffer
    /// is overwritten, in rank order, from rank 0's).
    mine: Option<PooledBuf>,
    /// Where this rank's contribution is in `work` (unless in `mine`).
    contrib: Option<Range<usize>>,
    /// Peers this rank still has to post to (bit per rank).
    unposted: u64,
    /// Peers whose contribution the op needs.
    need: u64,
    found: Vec<Option<Found>>,
    /// Something moved since the clock was last read.
    moved: bool,
    /// The op failed on a peer's abort: no abort of its own is sent.
    remote_abort: bool,
    /// A handle waits for it (else a callback does).
    waited: bool,
    started: Instant,
    /// Its inactivity deadline and the first loss it heard of, by the op
    /// machine's rules ([`crate::failure`]).
    live: Liveness<Instant>,
    checked: Instant,
    done: Option<Callback>,
}

type Ended<T> = (FastOp<T>, Result<OpOutput, CollectiveError>);

fn bits(mask: u64) -> impl Iterator<Item = Rank> {
    (0..64u32).filter(move |i| mask & (1 << i) != 0).map(Rank)
}

/// The digest every rank puts beside its contribution: the spec alone
/// (the path has no topology).
fn digest(spec: &OpSpec) -> u32 {
    let (op, root) = (
        spec.kind.reduce_op().map_or(0, |o| o as u64),
        match spec.kind.root() {
            Root::At(r) => u64::from(r.0) + 1,
            Root::Any => 0,
        },
    );
    let words = [
        u64::from(spec.kind.code()),
        op,
        root,
        spec.dtype as u64,
        spec.count as u64,
    ];
    let mut h = 0x9e37_79b9_7f4a_7c15;
    for w in words {
        h = fnv1a64(h, &w.to_le_bytes());
    }
    crate::spec::with_check((h ^ (h >> 32)) as u32, spec.check)
}

impl<T: Transport> Fast<T> {
    /// The fast path over `t`, if every rank is reached through its
    /// lanes; `max_bytes` caps the ops it takes (0: none).
    pub(super) fn new(
        t: &Arc<T>,
        max_bytes: usize,
        large: super::FastLarge,
    ) -> Option<Arc<Fast<T>>> {
        // the lanes of a shared-memory wire that reaches every other rank
        let lanes = t
            .extension_of::<HostLanes>()
            .filter(|l| l.complete() && l.size() == t.size())?;
        if max_bytes == 0 || t.size() < 2 || t.size() > 64 {
            return None;
        }
        let f = Arc::new(Fast {
            lanes,
            t: t.clone(),
            state: Mutex::new(State { ops: Vec::new() }),
            cv: Condvar::new(),
            inline_until: AtomicU64::new(0),
            zero: Instant::now(),
            live: AtomicUsize::new(0),
            completing: Arc::new(AtomicUsize::new(0)),
            oversubscribed: t.size() > kungfu_transport::host_cpus(),
            bell: AtomicU32::new(0),
            bell_sleepers: AtomicU32::new(0),
            max_bytes,
            large: if kungfu_transport::shm::cma::available() {
                large
            } else {
                super::FastLarge::Off
            },
        });
        let weak = Arc::downgrade(&f);
        let spawned = std::thread::Builder::new()
            .name("kungfu-fast".into())
            .spawn(move || progress_thread(weak));
        spawned.ok().map(|_| f)
    }

    pub(super) fn transport(&self) -> &Arc<T> {
        &self.t
    }

    /// Whether an op of `spec` goes this way: a function of the spec and
    /// the session alone, the same on every rank.
    pub(super) fn takes(&self, spec: &OpSpec) -> bool {
        let kind = matches!(
            spec.kind,
            OpKind::Allreduce(_) | OpKind::Broadcast { .. } | OpKind::Allgather
        );
        kind && self.way(spec).is_some()
    }

    /// How an op of `spec` goes, if this way at all: the lanes whole
    /// (`Direct`) or in slices (`Split`) up to `max_bytes`, else by
    /// cross-memory attach (`Large`) where configured.
    fn way(&self, spec: &OpSpec) -> Option<Way> {
        let b = spec.block_bytes()?;
        if b <= self.max_bytes && split::splits(spec, self.t.size()) {
            Some(Way::Split)
        } else if b <= self.max_bytes && b <= SLOT_BYTES {
            Some(Way::Direct)
        } else {
            self.large.takes(spec.kind, b).then_some(Way::Large)
        }
    }

    /// Whether an op of `spec` computes the gradient monitors' squared
    /// norms in its reduction when asked ([`FastOp::norms`]): a sum of f32
    /// on the direct way (each rank reduces every input), the large way
    /// and the split way where a slice leaves room for them in its slot
    /// (each rank reduces a slice and sends its squares with it).
    pub(super) fn fuses_norms(&self, spec: &OpSpec) -> bool {
        let way = match self.way(spec) {
            Some(Way::Split) => split::fits_norms(spec, self.t.size()),
            Some(Way::Large | Way::Direct) => true,
            None => false,
        };
        way && spec.kind == OpKind::Allreduce(crate::ReduceOp::Sum)
            && spec.dtype == crate::DType::F32
    }

    fn others(&self) -> u64 {
        ((1u128 << self.t.size()) - 1) as u64 & !(1 << self.t.rank().0)
    }

    /// An op for [`Fast::start`]; `work` is laid out by
    /// [`OpSpec::init_work`].
    pub(super) fn op(
        &self,
        inner: Arc<Inner<T>>,
        name: Arc<str>,
        spec: OpSpec,
        tag: OpTag,
        work: OpMem,
        done: Callback,
    ) -> FastOp<T> {
        let (n, me) = (self.t.size(), self.t.rank());
        let b = spec.block_bytes().expect("validated");
        let others = ((1u128 << n) - 1) as u64 & !(1 << me.0);
        let way = self.way(&spec).expect("taken");
        let split = way == Way::Split;
        let (mut mine, mut contrib, unposted, need) = (None, Some(0..b), others, others);
        let (unposted, need) = match spec.kind {
            OpKind::Allreduce(_) => {
                // the direct way's posted copy (split and large ops read
                // the working buffer where it lies)
                if me.0 != 0 && way == Way::Direct {
                    let mut m = inner.pool.take_vec(b);
                    work.read(0..b, |w| m.vec_mut().extend_from_slice(w));
                    mine = Some(m);
                    contrib = None;
                }
                (unposted, need)
            }
            // Every rank posts to every other and waits for all (the
            // root its data, the others an empty contribution), so each
            // sees every rank's digest: a rank that disagrees (another
            // root, type or count) fails the op on every rank, the root
            // included, where a root that only sent would have completed.
            OpKind::Broadcast { root } => {
                if root != me {
                    contrib = Some(0..0);
                }
                (unposted, need)
            }
            _ => {
                contrib = Some(me.idx() * b..(me.idx() + 1) * b);
                (unposted, need)
            }
        };
        let now = Instant::now();
        let op_timeout = inner.config.op_timeout;
        let mut op = FastOp {
            inner,
            name,
            digest: digest(&spec),
            spec,
            tag,
            lane_tag: tag,
            lane_rank: me,
            large: None,
            split: None,
            norms: None,
            work,
            mine,
            contrib,
            unposted,
            need,
            found: vec![None; n],
            moved: false,
            remote_abort: false,
            waited: false,
            started: now,
            live: Liveness::new(now, op_timeout),
            checked: now,
            done: Some(done),
        };
        if split {
            // the input is read where it lies, slice by slice
            op.contrib = None;
            op.split = Some(0);
        } else if way == Way::Large {
            large::Large::start(&mut op, others);
        }
        op
    }
}

impl<T> FastOp<T> {
    /// Makes a monitored op of it ([`FastOp::norms`]), if `on`: only an op
    /// whose way [`Fast::fuses_norms`].
    pub(super) fn monitored(mut self, on: bool) -> FastOp<T> {
        if on {
            self.norms = Some(norms::Norms::default());
        }
        self
    }
}
