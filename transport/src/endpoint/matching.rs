//! Matching of incoming frames to receives, with a bounded byte budget.
//!
//! Every backend (TCP, shared memory, in-memory) shares this: reader tasks
//! [`Matcher::deliver`] frames, ops [`Matcher::recv`] them by [`OpTag`]. A
//! frame is removed only inside a poll that returns it, so a dropped
//! receive loses nothing.
//!
//! # Posted receives
//!
//! An op may also [`Matcher::post`] a receive: one frame, named exactly by
//! a [`RecvKey`], lands in a range of the op's own memory (a [`MemMut`]).
//! A reader that can write a payload where it belongs (TCP reads the
//! socket straight into it) first [`Matcher::claim`]s the range, fills it
//! and reports [`Matcher::landed`]; any other delivery of that frame is
//! copied into the range here. Either way the op then receives
//! [`Arrival::Landed`] (header only) instead of the payload. A frame that
//! came before its receive was posted is unexpected (eager): it waits
//! queued, and [`Matcher::post`] copies it in at once.
//!
//! The range stays the op's memory throughout: the matcher or a reader
//! holds the share until the frame landed or the op was retired, so a
//! dropped op never frees memory that a reader is still writing (the
//! region outlives every share). Landed frames hold no budget.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::sync::Notify;

use crate::region::MemMut;

mod beacons;
mod heard;
pub(crate) mod notices;
mod posted;

use crate::{Epoch, Frame, FrameKind, Header, Instant, OpTag, PeerSet, TransportError};
pub use beacons::MAX_BEACON;
pub use notices::CLOSED_BY_PEER;
use posted::{claim_in, take_posted};

/// How many retired op instances are remembered (their late frames become
/// strays).
const RETIRED_MEMORY: usize = 4096;
/// How many stray headers are kept for the layer above; more are dropped.
const STRAY_MEMORY: usize = 4096;

/// The one frame a posted receive is for: a data frame of op instance
/// `tag` from `from`, tagged `(chunk, step)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecvKey {
    pub tag: OpTag,
    pub from: Rank,
    pub chunk: u32,
    pub step: u16,
}

impl RecvKey {
    /// The key of a data frame with `header` from `from` (None for other
    /// kinds, which are never posted for).
    pub fn of(from: Rank, header: &Header) -> Option<RecvKey> {
        (header.kind == FrameKind::Data).then_some(RecvKey {
            tag: header.tag,
            from,
            chunk: header.chunk,
            step: header.step,
        })
    }
}

/// What a receive of an op takes from the matcher.
#[derive(Debug)]
pub enum Arrival {
    /// A frame, payload and all (unexpected, or not posted for).
    Frame(Frame),
    /// The frame of a posted receive is in the op's memory.
    Landed { from: Rank, header: Header },
    /// A frame was consumed in place by the receive's `apply` (see
    /// [`crate::Transport::recv_in_place`]).
    Applied,
}

#[derive(Default)]
struct Slot {
    frames: VecDeque<Frame>,
    /// Posted receives that completed, not yet taken.
    landed: VecDeque<(Rank, Header)>,
    wakers: Vec<Waker>,
}

impl Slot {
    fn is_idle(&self) -> bool {
        self.frames.is_empty() && self.landed.is_empty() && self.wakers.is_empty()
    }
}

struct Inner {
    epoch: Epoch,
    slots: HashMap<OpTag, Slot>,
    queued_bytes: usize,
    /// Receives posted and not yet landed (nor claimed by a reader).
    posted: HashMap<RecvKey, MemMut>,
    /// Rendezvous senders waiting for a post.
    rendezvous: usize,
    lost: HashMap<Rank, Arc<str>>,
    /// The order ranks were lost in (the first is the likeliest cause of
    /// the others: a neighbour that gave up because of it).
    lost_order: Vec<Rank>,
    /// Where each rank runs, when known ([`Matcher::name_peers`]): added
    /// to the reason of a loss.
    names: Vec<Arc<str>>,
    /// When each peer was last heard from (any frame, a heartbeat, bytes
    /// of a long frame), while liveness is watched.
    heard: HashMap<Rank, Instant>,
    /// Time excused per peer since it was last heard ([`Matcher::excuse`]).
    excused: HashMap<Rank, std::time::Duration>,
    closed: bool,
    retired: HashSet<OpTag>,
    retired_order: VecDeque<OpTag>,
    refused: u64,
    last_refusal: Option<TransportError>,
    /// Frames of retired ops, payload dropped: the layer above checks them
    /// (a late frame with another spec digest reveals a disagreeing rank).
    strays: VecDeque<Frame>,
    stray_wakers: Vec<Waker>,
}

/// Per-endpoint matching store. See the module docs.
pub struct Matcher {
    inner: Mutex<Inner>,
    /// `inner.posted.len()`, readable without the lock: readers skip
    /// looking for a posted range when there is none.
    posted_n: AtomicUsize,
    /// Told when a receive is posted or the state of posts changes
    /// (retire, epoch, close): what a rendezvous sender waits for.
    posts: Notify,
    space: Notify,
    budget: usize,
    beacons: beacons::Beacons,
    notices: notices::Notices,
}

impl Matcher {
    /// A matcher at `epoch` that holds at most `budget` bytes of unmatched
    /// payload (one frame is always admitted into an empty matcher, so a
    /// frame larger than the budget cannot wedge a peer).
    pub fn new(epoch: Epoch, budget: usize) -> Matcher {
        Matcher {
            inner: Mutex::new(Inner {
                epoch,
                slots: HashMap::new(),
                queued_bytes: 0,
                posted: HashMap::new(),
                rendezvous: 0,
                lost: HashMap::new(),
                lost_order: Vec::new(),
                names: Vec::new(),
                heard: HashMap::new(),
                excused: HashMap::new(),
                closed: false,
                retired: HashSet::new(),
                retired_order: VecDeque::new(),
                refused: 0,
                last_refusal: None,
                strays: VecDeque::new(),
                stray_wakers: Vec::new(),
            }),
            posted_n: AtomicUsize::new(0),
            posts: Notify::new(),
            space: Notify::new(),
            budget,
            beacons: beacons::Beacons::default(),
            notices: notices::Notices::default(),
        }
    }

    /// Publishes `inner.posted.len()` to readers that skip the lock.
    fn count_posted(&self, inner: &Inner) {
        if self.posted_n.load(Ordering::Relaxed) != inner.posted.len() {
            self.posted_n.store(inner.posted.len(), Ordering::Release);
        }
        // Under the lock, as every rendezvous checks and registers.
        if inner.rendezvous > 0 {
            self.posts.notify_waiters();
        }
    }

    /// Whether any receive is posted (readers skip looking when not).
    pub fn has_posted(&self) -> bool {
        self.posted_n.load(Ordering::Acquire) != 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked while holding
        // it; the state is a plain store that stays consistent between
        // statements, so keep serving rather than propagate the panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a frame from `from`, waiting while the budget is exhausted
    /// (the caller, a reader task, thereby stops reading that peer).
    ///
    /// Frames of an older epoch are refused: they are counted, remembered as
    /// [`Matcher::last_refusal`], and the error is returned so the reader
    /// can log or act on it. Frames of retired ops are dropped.
    pub async fn deliver(
        &self,
        from: Rank,
        header: Header,
        mut payload: Bytes,
    ) -> Result<(), TransportError> {
        loop {
            let notified = self.space.notified();
            match self.offer(from, header, payload, false)? {
                None => return Ok(()),
                Some(back) => payload = back,
            }
            notified.await;
        }
    }

    /// The epoch frames must be at (older ones are refused).
    pub fn epoch(&self) -> Epoch {
        self.lock().epoch
    }

    /// Moves to `epoch`: frames of older epochs are refused from now on,
    /// and those still queued are dropped (their ops are over: the caller
    /// advances only at a consistency barrier). An epoch never goes back;
    /// an older or equal `epoch` is ignored.
    pub fn advance_epoch(&self, epoch: Epoch) {
        let mut inner = self.lock();
        if epoch <= inner.epoch {
            return;
        }
        inner.epoch = epoch;
        let released = take_posted(&mut inner, |k| k.tag.epoch < epoch);
        self.count_posted(&inner);
        let mut freed = 0;
        inner.slots.retain(|tag, slot| {
            let keep = tag.epoch >= epoch;
            if !keep {
                freed += slot.frames.iter().map(|f| f.payload.len()).sum::<usize>();
            }
            keep
        });
        inner.queued_bytes -= freed;
        drop(inner);
        drop(released);
        if freed > 0 {
            self.space.notify_waiters();
        }
    }

    /// Whether frames of `tag` are still wanted here: the matcher is open,
    /// the tag's epoch is current and its op not retired (a wire that
    /// holds receives posted for it cancels them otherwise).
    pub fn wants(&self, tag: OpTag) -> bool {
        let inner = self.lock();
        !inner.closed && tag.epoch >= inner.epoch && !inner.retired.contains(&tag)
    }

    /// Whether a payload of `len` bytes fits the budget now.
    pub fn has_room(&self, len: usize) -> bool {
        let inner = self.lock();
        inner.queued_bytes == 0 || inner.queued_bytes + len <= self.budget
    }

    /// Queues a frame without waiting, over budget or not (the caller
    /// checked [`Matcher::has_room`]); otherwise as [`Matcher::deliver`].
    pub fn deliver_now(
        &self,
        from: Rank,
        header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        self.offer(from, header, payload, true).map(|_| ())
    }

    /// Queues the frame if the budget allows (or `force`); gives the
    /// payload back if it must wait.
    fn offer(
        &self,
        from: Rank,
        header: Header,
        payload: Bytes,
        force: bool,
    ) -> Result<Option<Bytes>, TransportError> {
        let len = payload.len();
        let mut inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        if !inner.heard.is_empty() {
            inner.heard.insert(from, Instant::now());
            inner.excused.remove(&from);
        }
        match header.kind {
            FrameKind::Heartbeat => {
                drop(inner);
                self.beacons.received(from, payload);
                return Ok(None);
            }
            FrameKind::Lost => {
                drop(inner);
                self.hearsay(from, &payload);
                return Ok(None);
            }
            FrameKind::Data | FrameKind::Abort => {}
        }
        if header.tag.epoch < inner.epoch {
            let err = TransportError::StaleEpoch {
                peer: from,
                frame: header.tag.epoch,
                current: inner.epoch,
            };
            inner.refused += 1;
            inner.last_refusal = Some(err.clone());
            return Err(err);
        }
        if inner.retired.contains(&header.tag) {
            push_stray(&mut inner, from, header);
            return Ok(None);
        }
        if let Some(mut mem) = claim_in(&mut inner, from, &header, len) {
            self.count_posted(&inner);
            drop(inner);
            mem.as_mut_slice().copy_from_slice(&payload);
            self.landed(from, header, mem);
            return Ok(None);
        }
        if !(force || inner.queued_bytes == 0 || inner.queued_bytes + len <= self.budget) {
            return Ok(Some(payload));
        }
        inner.queued_bytes += len;
        let slot = inner.slots.entry(header.tag).or_default();
        slot.frames.push_back(Frame {
            from,
            header,
            payload,
        });
        for w in slot.wakers.drain(..) {
            w.wake();
        }
        Ok(None)
    }

    /// The next frame of `tag` from a rank in `from`, or the reason none
    /// will come, if either is known now; never waits.
    pub fn try_recv(&self, tag: OpTag, from: &PeerSet) -> Option<Result<Frame, TransportError>> {
        self.take(tag, from, None, false).map(frame_only)
    }

    /// As [`Matcher::try_recv`], for an op that posts receives: a landed
    /// receive is an arrival too.
    pub fn try_arrival(
        &self,
        tag: OpTag,
        from: &PeerSet,
    ) -> Option<Result<Arrival, TransportError>> {
        self.take(tag, from, None, true)
    }

    /// Takes a matching frame (or, with `landed`, a landed receive), or
    /// reports closure or a lost peer; else registers `waker` (if any) and
    /// returns `None`.
    fn take(
        &self,
        tag: OpTag,
        from: &PeerSet,
        waker: Option<&Waker>,
        landed: bool,
    ) -> Option<Result<Arrival, TransportError>> {
        let mut inner = self.lock();
        if let Some(slot) = inner.slots.get_mut(&tag) {
            if landed {
                if let Some(i) = slot.landed.iter().position(|(r, _)| from.contains(*r)) {
                    let (from, header) = slot.landed.remove(i).expect("index just found");
                    if slot.is_idle() {
                        inner.slots.remove(&tag);
                    }
                    return Some(Ok(Arrival::Landed { from, header }));
                }
            }
            if let Some(i) = slot.frames.iter().position(|f| from.contains(f.from)) {
                let frame = slot.frames.remove(i).expect("index just found");
                if slot.is_idle() {
                    inner.slots.remove(&tag);
                }
                inner.queued_bytes -= frame.payload.len();
                drop(inner);
                self.space.notify_waiters();
                return Some(Ok(Arrival::Frame(frame)));
            }
        }
        if inner.closed {
            return Some(Err(TransportError::Closed));
        }
        if let Some(err) = lost_in(&inner, from) {
            return Some(Err(err));
        }
        if let Some(w) = waker {
            let slot = inner.slots.entry(tag).or_default();
            if !slot.wakers.iter().any(|x| x.will_wake(w)) {
                slot.wakers.push(w.clone());
            }
        }
        None
    }

    fn forget_waiter(&self, tag: OpTag) {
        let mut inner = self.lock();
        if let Some(slot) = inner.slots.get_mut(&tag) {
            // Wakers of other receivers of the same tag (rare) are woken so
            // that none is left registered for a future that is gone.
            for w in slot.wakers.drain(..) {
                w.wake();
            }
            if slot.is_idle() {
                inner.slots.remove(&tag);
            }
        }
    }

    /// See [`crate::Transport::recv`]. Landed receives are not taken.
    pub async fn recv(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
    ) -> Result<Frame, TransportError> {
        frame_only(self.wait(tag, from, deadline, false).await)
    }

    /// As [`Matcher::recv`], for an op that posts receives: a landed
    /// receive is an arrival too.
    pub async fn recv_arrival(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
    ) -> Result<Arrival, TransportError> {
        self.wait(tag, from, deadline, true).await
    }

    async fn wait(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
        landed: bool,
    ) -> Result<Arrival, TransportError> {
        struct Guard<'a>(&'a Matcher, OpTag);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                self.0.forget_waiter(self.1);
            }
        }
        let _guard = Guard(self, tag);
        let poll = poll_fn(|cx| match self.take(tag, from, Some(cx.waker()), landed) {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        });
        match tokio::time::timeout_at(deadline, poll).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout {
                what: format!("a frame of op {} seq {} ({})", tag.op, tag.seq, tag.epoch),
            }),
        }
    }

    /// How many receives are posted and not landed (for tests).
    pub fn posted(&self) -> usize {
        self.lock().posted.len()
    }

    /// Says where each rank runs (`host:port`, by rank): the reason of a
    /// loss names it, so that an error tells which machine to look at.
    pub fn name_peers(&self, names: impl IntoIterator<Item = String>) {
        self.lock().names = names.into_iter().map(Arc::from).collect();
    }

    /// `reason`, a loss of `peer`, with where `peer` runs when that is
    /// known and not said yet.
    pub fn locate(&self, peer: Rank, reason: Arc<str>) -> Arc<str> {
        locate(&self.lock(), peer, reason)
    }

    /// Whether the endpoint closed (or shut down).
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The ranks lost so far, the first lost first.
    pub fn lost_in_order(&self) -> Vec<Rank> {
        self.lock().lost_order.clone()
    }

    /// The checks every backend makes before it sends `len` bytes to
    /// `to`: a rank it has a route to, a frame within `max_frame`, an
    /// endpoint not closed, a peer not lost.
    pub(crate) fn check_send(
        &self,
        to: Rank,
        size: usize,
        has_route: bool,
        len: usize,
        max_frame: usize,
    ) -> Result<(), TransportError> {
        if !has_route {
            return Err(TransportError::NoSuchPeer { peer: to, size });
        }
        if len > max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                max: max_frame,
            });
        }
        let inner = self.lock();
        // A closed endpoint sends nothing, whatever its readers made of
        // the peers as they stopped.
        if inner.closed {
            return Err(TransportError::Closed);
        }
        match inner.lost.get(&to) {
            Some(reason) => Err(TransportError::PeerLost {
                peer: to,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Marks `peer` lost because writing to it failed, and returns the
    /// error its pending and later sends report.
    pub(crate) fn lose_writer(&self, peer: Rank, why: impl std::fmt::Display) -> TransportError {
        let reason: Arc<str> = format!("write: {why}").into();
        self.fail_peer(peer, reason.clone());
        TransportError::PeerLost { peer, reason }
    }

    /// See [`crate::Transport::check_peers`].
    pub fn check_peers(&self, peers: &PeerSet) -> Result<(), TransportError> {
        let inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        match lost_in(&inner, peers) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// See [`crate::Transport::check_peers_for`].
    pub fn check_peers_for(&self, tag: OpTag, peers: &PeerSet) -> Result<(), TransportError> {
        match self.lost_for(tag, peers)?.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// See [`crate::Transport::lost_for`].
    pub fn lost_for(
        &self,
        tag: OpTag,
        peers: &PeerSet,
    ) -> Result<Vec<TransportError>, TransportError> {
        let inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        let mut silent = peers.clone();
        if let Some(slot) = inner.slots.get(&tag) {
            for f in &slot.frames {
                silent.remove(f.from);
            }
            for (from, _) in &slot.landed {
                silent.remove(*from);
            }
        }
        Ok(inner
            .lost_order
            .iter()
            .filter(|r| silent.contains(**r))
            .filter_map(|r| {
                inner.lost.get(r).map(|why| TransportError::PeerLost {
                    peer: *r,
                    reason: why.clone(),
                })
            })
            .collect())
    }

    /// The reason `peer` was lost, if it was.
    pub fn lost_reason(&self, peer: Rank) -> Option<Arc<str>> {
        self.lock().lost.get(&peer).cloned()
    }

    /// See [`crate::Transport::retire`].
    pub fn retire(&self, tag: OpTag) {
        let mut inner = self.lock();
        let released = take_posted(&mut inner, |k| k.tag == tag);
        self.count_posted(&inner);
        if let Some(slot) = inner.slots.remove(&tag) {
            let freed: usize = slot.frames.iter().map(|f| f.payload.len()).sum();
            inner.queued_bytes -= freed;
            for w in slot.wakers {
                w.wake();
            }
            for f in slot.frames {
                push_stray(&mut inner, f.from, f.header);
            }
        }
        if inner.retired.insert(tag) {
            inner.retired_order.push_back(tag);
            if inner.retired_order.len() > RETIRED_MEMORY {
                let old = inner.retired_order.pop_front().expect("non-empty");
                inner.retired.remove(&old);
            }
        }
        drop(inner);
        drop(released);
        self.space.notify_waiters();
    }

    /// Fails everything pending and later. Idempotent.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        let released = take_posted(&mut inner, |_| true);
        self.count_posted(&inner);
        inner.slots.retain(|_, s| {
            for w in s.wakers.drain(..) {
                w.wake();
            }
            false
        });
        inner.queued_bytes = 0;
        for w in inner.stray_wakers.drain(..) {
            w.wake();
        }
        drop(inner);
        drop(released);
        self.space.notify_waiters();
    }

    /// The next frame (header only, empty payload) that arrived for a
    /// retired op, or was queued when it was retired.
    pub async fn recv_stray(&self, deadline: Instant) -> Result<Frame, TransportError> {
        let poll = poll_fn(|cx| {
            let mut inner = self.lock();
            if let Some(f) = inner.strays.pop_front() {
                return Poll::Ready(Ok(f));
            }
            if inner.closed {
                return Poll::Ready(Err(TransportError::Closed));
            }
            if !inner.stray_wakers.iter().any(|w| w.will_wake(cx.waker())) {
                inner.stray_wakers.push(cx.waker().clone());
            }
            Poll::Pending
        });
        match tokio::time::timeout_at(deadline, poll).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout {
                what: "a stray frame".into(),
            }),
        }
    }

    /// Bytes of unmatched payload held now.
    pub fn queued_bytes(&self) -> usize {
        self.lock().queued_bytes
    }

    /// How many frames were refused (older epoch).
    pub fn refused(&self) -> u64 {
        self.lock().refused
    }

    /// The last refusal, if any.
    pub fn last_refusal(&self) -> Option<TransportError> {
        self.lock().last_refusal.clone()
    }
}

const WORKER_AT: &str = "the worker at ";

fn locate(inner: &Inner, peer: Rank, reason: Arc<str>) -> Arc<str> {
    match inner.names.get(peer.idx()) {
        Some(at) if !reason.contains(WORKER_AT) => format!("{reason} ({WORKER_AT}{at})").into(),
        _ => reason,
    }
}

fn lost_in(inner: &Inner, from: &PeerSet) -> Option<TransportError> {
    // Report the first of them lost: the culprit, not a neighbour whose
    // connection failed later because of it (and reproducible).
    inner
        .lost_order
        .iter()
        .find(|r| from.contains(**r))
        .and_then(|r| inner.lost.get(r).map(|why| (*r, why)))
        .map(|(r, why)| TransportError::PeerLost {
            peer: r,
            reason: why.clone(),
        })
}

fn frame_only(r: Result<Arrival, TransportError>) -> Result<Frame, TransportError> {
    match r? {
        Arrival::Frame(f) => Ok(f),
        other => unreachable!("asked for frames only, got {other:?}"),
    }
}

fn push_stray(inner: &mut Inner, from: Rank, mut header: Header) {
    if inner.strays.len() < STRAY_MEMORY {
        header.len = 0;
        inner.strays.push_back(Frame {
            from,
            header,
            payload: Bytes::new(),
        });
        for w in inner.stray_wakers.drain(..) {
            w.wake();
        }
    }
}

fn wake_all(inner: &mut Inner) {
    for slot in inner.slots.values_mut() {
        for w in slot.wakers.drain(..) {
            w.wake();
        }
    }
}
