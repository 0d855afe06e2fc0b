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
//! - **direct** (above): ops up to a slot; allreduce up to
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
//! polls every op in flight itself for [`INLINE_SPIN`] (the common case: it
//! is done before that), then hands over to one progress thread per
//! process, which polls while ops are in flight and sleeps on a condition
//! variable when none are. Ops started with a callback (the C ABI) are
//! the thread's from the start. Neither burns a core that a peer needs:
//! with more ranks than cores both yield (`sched_yield`) between polls
//! instead of spinning, and the thread stands aside (sleeps) while a
//! caller polls. This is Open MPI's "yield when idle" policy for
//! oversubscribed hosts, measured in `docs/bench`.
//!
//! # Errors
//!
//! An op fails, naming the ranks it waits for, when it makes no progress
//! for the op timeout, and at once when one of them is lost (checked every
//! [`LIVENESS_EVERY`]). A contribution whose digest (kind, type, count,
//! root) differs from this rank's fails the op as a mismatch naming both
//! ranks.

mod direct;
mod large;
mod split;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kungfu_topology::{fnv1a64, Rank, Root, Strategy};
use kungfu_transport::shm::lane::{Found, HostLanes, SLOT_BYTES};
use kungfu_transport::{Arrival, FrameKind, OpTag, PeerSet, Transport, TransportError};

use super::driver::send_aborts;
use super::opmem::OpMem;
use super::{Callback, Inner, OpOutput};
use crate::abort::Abort;
use crate::op::errors::abort_reason;
use crate::pool::PooledBuf;
use crate::timeline::peer_row;
use crate::{CollectiveError, OpKind, OpSpec};

/// How long a waiting caller polls before it hands over to the thread.
pub(super) const INLINE_SPIN: Duration = Duration::from_micros(200);
/// How often an op checks that the ranks it waits for are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(2);
/// The thread's longest idle sleep (it notices a dropped session by then).
const IDLE_NAP: Duration = Duration::from_millis(100);
/// After this long with ops in flight and nothing moving, the thread naps
/// between polls instead of spinning.
const NAP_AFTER: Duration = Duration::from_millis(2);
const NAP: Duration = Duration::from_micros(50);

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
    oversubscribed: bool,
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
    last: Instant,
    checked: Instant,
    done: Option<Callback>,
}

type Ended<T> = (FastOp<T>, Result<OpOutput, CollectiveError>);

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

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
    (h ^ (h >> 32)) as u32
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
            oversubscribed: t.size() > kungfu_transport::host_cpus(),
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
                if me.0 != 0 && !split {
                    let mut m = inner.pool.take_vec(b);
                    work.read(0..b, |w| m.vec_mut().extend_from_slice(w));
                    mine = Some(m);
                    contrib = None;
                }
                (unposted, need)
            }
            OpKind::Broadcast { root } if root == me => (unposted, 0),
            OpKind::Broadcast { root } => (0, 1 << root.0),
            _ => {
                contrib = Some(me.idx() * b..(me.idx() + 1) * b);
                (unposted, need)
            }
        };
        let now = Instant::now();
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
            last: now,
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

    /// Posts the op's contribution and runs it as far as it goes now;
    /// `waited`: a caller will poll its handle (else the thread is told).
    pub(super) fn start(&self, mut op: FastOp<T>, waited: bool) {
        op.waited = waited;
        let mut st = lock(&self.state);
        st.ops.push(op);
        let ended = self.progress(&mut st, false);
        // A contribution that found no free slot, or a later phase's, must
        // not wait for the handle to be polled: peers wait for it.
        let stuck = st
            .ops
            .iter()
            .any(|o| o.unposted != 0 || o.split.is_some() || o.large.is_some());
        let left = !st.ops.is_empty();
        drop(st);
        finish(ended, false);
        if left && (!waited || stuck) {
            self.cv.notify_one();
        }
    }

    /// Fails every op in flight as closed (the session is closing or shut
    /// down: nothing will complete them).
    pub(super) fn fail_all(&self) {
        let mut st = lock(&self.state);
        let ops = std::mem::take(&mut st.ops);
        self.live.store(0, Ordering::SeqCst);
        drop(st);
        let ended = ops
            .into_iter()
            .map(|mut op| {
                op.end(&self.lanes);
                (op, Err(CollectiveError::Closed))
            })
            .collect();
        // the caller closes the session: it holds none of the session's
        // locks, and the runtime may be about to stop
        finish(ended, true);
    }

    fn now_ns(&self) -> u64 {
        self.zero.elapsed().as_nanos() as u64
    }

    /// Polls the ops in flight from a waiting caller until `done()`, for
    /// [`INLINE_SPIN`] at most; `false`: handed over to the thread.
    pub(super) fn drive(&self, done: &mut dyn FnMut() -> bool) -> bool {
        let start = Instant::now();
        let budget = INLINE_SPIN.as_nanos() as u64;
        let mut k = 0u32;
        loop {
            // The clock is read every few rounds only: a round is much
            // shorter than a read of it.
            if k.is_multiple_of(16) {
                if start.elapsed() > INLINE_SPIN {
                    self.hand_over();
                    return false;
                }
                self.inline_until
                    .store(self.now_ns() + 2 * budget, Ordering::Relaxed);
            }
            k = k.wrapping_add(1);
            if let Ok(mut st) = self.state.try_lock() {
                let ended = self.progress(&mut st, k.is_multiple_of(64));
                drop(st);
                finish(ended, false);
            }
            if done() {
                // Other ops in flight are the thread's now (it sleeps while
                // a caller polls); none: no wake-up. Cleared first, both
                // sequentially consistent: an op started meanwhile is
                // either seen here (`live`) or its notice finds the deadline
                // cleared.
                self.inline_until.store(0, Ordering::SeqCst);
                if self.live.load(Ordering::SeqCst) > 0 {
                    self.hand_over();
                }
                return true;
            }
            self.pause();
        }
    }

    /// A polling caller stops: the thread takes over. Under the lock, so
    /// that the thread either sees it or is already waiting for the
    /// notice (it checks and waits under the lock).
    fn hand_over(&self) {
        let st = lock(&self.state);
        self.inline_until.store(0, Ordering::Relaxed);
        drop(st);
        self.cv.notify_one();
    }

    fn pause(&self) {
        if self.oversubscribed {
            std::thread::yield_now();
        } else {
            // A pause instruction takes up to ~140 cycles on recent x86: a
            // few between polls, or the wait itself becomes the latency.
            for _ in 0..2 {
                std::hint::spin_loop();
            }
        }
    }

    /// Moves every op in flight as far as it goes; returns the ended ones
    /// (to complete without the lock: their callbacks may start ops).
    /// `timed`: reads the clock for deadlines and liveness checks.
    fn progress(&self, st: &mut State<T>, timed: bool) -> Vec<Ended<T>> {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < st.ops.len() {
            match self.step(&mut st.ops[i], timed) {
                None => i += 1,
                Some(r) => {
                    let mut op = st.ops.swap_remove(i);
                    op.end(&self.lanes);
                    ended.push((op, r));
                }
            }
        }
        self.live.store(st.ops.len(), Ordering::SeqCst);
        ended
    }

    /// One op: posts what is unposted, claims what has come, and once
    /// everything is here computes the output.
    fn step(&self, op: &mut FastOp<T>, timed: bool) -> Option<Result<OpOutput, CollectiveError>> {
        let l = &self.lanes;
        let mut moved = false;
        let r = (|| {
            for p in bits(op.unposted) {
                let post = op.split_post(p).or_else(|| op.contrib.clone());
                let posted = match (&op.mine, post) {
                    (Some(m), _) => l.post(p, op.lane_tag, op.digest, m),
                    (None, Some(r)) => op
                        .work
                        .read(r, |b| l.post(p, op.lane_tag, op.digest, b))
                        .unwrap_or(Ok(false)),
                    (None, None) => Ok(true),
                };
                if posted.map_err(|e| (p, e))? {
                    op.unposted &= !(1 << p.0);
                    moved = true;
                    if let Some(tl) = &op.inner.config.timeline {
                        tl.mark(peer_row(p), "posted", "fast", Instant::now(), "");
                    }
                }
            }
            moved |= self.find_missing(op)?;
            Ok(())
        })();
        if let Err((peer, e)) = r {
            return Some(Err(op.lost(peer, e)));
        }
        let missing: u64 = bits(op.need)
            .filter(|p| op.found[p.idx()].is_none())
            .fold(0, |m, p| m | 1 << p.0);
        if missing == 0 && op.unposted == 0 && (op.large.is_some() || op.split.is_some()) {
            let t0 = Instant::now();
            let phase = op
                .large
                .as_ref()
                .map_or(op.split.unwrap_or(0), |g| u32::from(g.phase));
            let r = if op.split.is_some() {
                op.split_advance(l, self.others())
            } else {
                op.advance(l, self.others())
            };
            if let Some(tl) = &op.inner.config.timeline {
                tl.span(0, &format!("phase {phase}"), "fast", t0, Instant::now(), "");
            }
            op.moved = true;
            return match r {
                None => None,
                Some(Ok(())) => Some(Ok(op.output(self.t.version()))),
                Some(Err(e)) => Some(Err(e)),
            };
        }
        if missing == 0 && op.unposted == 0 {
            let t0 = Instant::now();
            let r = op.compute(l, self.t.version());
            if let Some(tl) = &op.inner.config.timeline {
                tl.span(0, "reduce", "fast", t0, Instant::now(), "");
            }
            return Some(r);
        }
        op.moved |= moved;
        if !timed {
            return None;
        }
        let now = Instant::now();
        if std::mem::take(&mut op.moved) {
            op.last = now;
        }
        if now.duration_since(op.checked) >= LIVENESS_EVERY {
            op.checked = now;
            let set: PeerSet = bits(missing | op.unposted).collect();
            let lost = self.t.check_peers(&set).err().map(|e| {
                let peer = match &e {
                    TransportError::PeerLost { peer, .. } => *peer,
                    _ => bits(missing | op.unposted).next().unwrap_or(Rank(0)),
                };
                op.lost(peer, e)
            });
            if let Some(e) = lost.or_else(|| self.frames_for(op, missing | op.unposted)) {
                // What a peer published before it went is still read: it may
                // have come since this step looked (then the op goes on).
                let late = !op.remote_abort
                    && matches!(e, CollectiveError::PeerLost { .. })
                    && self.find_missing(op).unwrap_or(false);
                if !late {
                    return Some(Err(e));
                }
                op.moved = true;
            }
            let after = op.inner.config.op_timeout;
            if now.duration_since(op.last) >= after {
                return Some(Err(CollectiveError::Timeout {
                    name: op.name.clone(),
                    epoch: op.tag.epoch,
                    after,
                    waiting: bits(missing | op.unposted).collect(),
                }));
            }
        }
        None
    }
}

impl<T: Transport> Fast<T> {
    /// Claims the contributions of the op's phase that have come since it
    /// last looked; whether any did.
    fn find_missing(&self, op: &mut FastOp<T>) -> Result<bool, (Rank, TransportError)> {
        let mut moved = false;
        for p in bits(op.need) {
            if op.found[p.idx()].is_none() {
                if let Some(f) = self.lanes.find(p, op.lane_tag).map_err(|e| (p, e))? {
                    op.found[p.idx()] = Some(f);
                    moved = true;
                    if let Some(tl) = &op.inner.config.timeline {
                        tl.mark(peer_row(p), "found", "fast", Instant::now(), "");
                    }
                }
            }
        }
        Ok(moved)
    }

    /// What frames of the op's tag say: a peer's abort (its error, with
    /// why), or a peer on the message path (its spec differs: a mismatch);
    /// or that the transport closed, or a rank the op waits for
    /// (`waiting`) is lost.
    fn frames_for(&self, op: &mut FastOp<T>, waiting: u64) -> Option<CollectiveError> {
        let me = self.t.rank();
        let all: PeerSet = (0..self.t.size() as u32)
            .map(Rank)
            .filter(|&r| r != me)
            .collect();
        match self.t.matcher().try_arrival(op.tag, &all)? {
            Ok(Arrival::Frame(f)) if f.header.kind == FrameKind::Abort => {
                op.remote_abort = true;
                Some(match Abort::decode(&f.payload) {
                    Ok(a) => a.to_error(&op.name, op.tag.epoch, me, &op.spec),
                    Err(why) => CollectiveError::Protocol {
                        name: op.name.clone(),
                        epoch: op.tag.epoch,
                        peer: f.from,
                        reason: format!("malformed abort frame: {why}"),
                    },
                })
            }
            Ok(Arrival::Frame(f)) => Some(CollectiveError::Mismatch {
                name: op.name.clone(),
                epoch: op.tag.epoch,
                ranks: vec![me, f.from],
                detail: format!(
                    "rank {} sent a frame of this op: it runs it on the message path, so its \
                     op is not {} (the host fast path's, here)",
                    f.from.0,
                    op.spec.describe()
                ),
            }),
            Ok(_) => None,
            Err(TransportError::Closed) => Some(CollectiveError::Closed),
            Err(e @ TransportError::PeerLost { peer, .. }) if waiting & (1 << peer.0) != 0 => {
                Some(op.lost(peer, e))
            }
            Err(_) => None,
        }
    }
}

impl<T: Transport> FastOp<T> {
    fn lost(&self, peer: Rank, e: TransportError) -> CollectiveError {
        match e {
            TransportError::Closed => CollectiveError::Closed,
            e @ TransportError::PeerLost { .. } => CollectiveError::PeerLost {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                peer,
                source: e,
            },
            e => CollectiveError::Transport {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                source: e,
            },
        }
    }

    /// The op's output, once it is complete.
    fn output(&mut self, version: kungfu_transport::ClusterVersion) -> OpOutput {
        let n = self.found.len();
        OpOutput {
            out: self.work.output(self.spec.output_range(self.lane_rank, n)),
            version,
            epoch: self.tag.epoch,
            strategy: Strategy::Clique,
        }
    }

    /// The op is over: its claimed contributions go back to their lanes
    /// and its buffer is no longer lent to peers.
    fn end(&mut self, l: &HostLanes) {
        self.release(l);
        if let Some(g) = &self.large {
            g.give_back();
        }
    }

    /// Gives every claimed contribution back to its lane.
    fn release(&mut self, l: &HostLanes) {
        for (p, f) in self.found.iter_mut().enumerate() {
            if let Some(f) = f.take() {
                l.release(Rank(p as u32), self.lane_tag, &f);
            }
        }
    }
}

/// Completes ended ops (outside the engine's lock). A failed op tells
/// every peer why, as the message path does, unless a peer told it.
///
/// A caller's callback runs on the progress thread (`on_thread`) or on the
/// session's runtime, never on a thread that happened to start or wait
/// for another op: that thread may hold locks the callback needs (the
/// swap gate, while deferred ops start). Handles (`waited`) are completed
/// in place: that only sends on a oneshot.
fn finish<T: Transport>(ended: Vec<Ended<T>>, on_thread: bool) {
    let (now, later): (Vec<_>, Vec<_>) = ended
        .into_iter()
        .partition(|(op, _)| on_thread || op.waited);
    if let Some((op, _)) = later.first() {
        let rt = op.inner.runtime.clone();
        rt.spawn(async move { complete(later) });
    }
    complete(now);
}

fn complete<T: Transport>(ended: Vec<Ended<T>>) {
    for (mut op, r) in ended {
        // A failed op may have frames of its tag coming (a rank on the
        // message path): they are strays from now on, judged by its
        // tombstone. An op that succeeded had every rank on this path, so
        // no frame of its tag exists, and retiring it costs the matcher's
        // lock and a wake-up of the stray watcher per op (1.2 -> 2-9 us).
        if r.is_err() {
            op.inner.transport().retire(op.tag);
            super::lock(&op.inner.tombstones).insert(op.tag, op.digest, op.spec);
        }
        if let (Err(e), false) = (&r, op.remote_abort) {
            let me = op.inner.transport().rank();
            if let Some((reason, offender)) = abort_reason(e, me) {
                let abort = Abort::new(reason, me, offender, &op.spec);
                send_aborts(&op.inner, op.tag, op.digest, &abort);
            }
        }
        let done = op.done.take().expect("completed once");
        let bytes = op.spec.block_bytes().unwrap_or(0);
        if let Some(tl) = &op.inner.config.timeline {
            super::driver::trace_op(
                tl,
                &op.name,
                &op.spec,
                Strategy::Clique,
                "fast",
                op.started,
                &r,
            );
        }
        let ok = r
            .is_ok()
            .then(|| (Strategy::Clique, bytes, op.started.elapsed()));
        op.inner.end_op(op.tag, ok, done, r);
    }
}

/// What a waiting handle drives (a [`Fast`] of any transport).
pub(crate) trait Drive: Send + Sync {
    /// See [`Fast::drive`].
    fn drive(&self, done: &mut dyn FnMut() -> bool) -> bool;
}

impl<T: Transport> Drive for Fast<T> {
    fn drive(&self, done: &mut dyn FnMut() -> bool) -> bool {
        Fast::drive(self, done)
    }
}

/// The progress thread of one [`Fast`]: polls while ops are in flight and
/// no caller does, sleeps otherwise; ends with the session.
fn progress_thread<T: Transport>(weak: Weak<Fast<T>>) {
    let mut idle_since: Option<Instant> = None;
    loop {
        let Some(f) = weak.upgrade() else { return };
        let mut st = lock(&f.state);
        if st.ops.is_empty() {
            idle_since = None;
            drop(f.cv.wait_timeout(st, IDLE_NAP));
            continue;
        }
        if f.inline_until.load(Ordering::SeqCst) > f.now_ns() {
            // a caller polls every op; it hands over when it stops
            // (`hand_over`), or its deadline passes
            drop(f.cv.wait_timeout(st, IDLE_NAP));
            continue;
        }
        // A panic (a bug, or a peer's bytes that slipped past a check) must
        // not end the thread that completes callback ops: it fails them.
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.progress(&mut st, true)));
        drop(st);
        let ended = match r {
            Ok(ended) => ended,
            Err(_) => {
                f.fail_all();
                Vec::new()
            }
        };
        let moved = !ended.is_empty();
        finish(ended, true);
        if moved {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() > NAP_AFTER {
            std::thread::sleep(NAP);
        } else {
            f.pause();
        }
    }
}
