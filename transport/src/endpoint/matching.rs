//! Matching of incoming frames to receives, with a bounded byte budget.
//!
//! Every backend (TCP, shared memory, in-memory) shares this: reader tasks
//! [`Matcher::deliver`] frames, ops [`Matcher::recv`] them by [`OpTag`]. A
//! frame is removed only inside a poll that returns it, so a dropped
//! receive loses nothing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::sync::Notify;

use crate::{Epoch, Frame, Header, Instant, OpTag, PeerSet, TransportError};

/// How many retired op instances are remembered (their late frames become
/// strays).
const RETIRED_MEMORY: usize = 4096;
/// How many stray headers are kept for the layer above; more are dropped.
const STRAY_MEMORY: usize = 4096;

#[derive(Default)]
struct Slot {
    frames: VecDeque<Frame>,
    wakers: Vec<Waker>,
}

struct Inner {
    epoch: Epoch,
    slots: HashMap<OpTag, Slot>,
    queued_bytes: usize,
    lost: HashMap<Rank, Arc<str>>,
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
    space: Notify,
    budget: usize,
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
                lost: HashMap::new(),
                closed: false,
                retired: HashSet::new(),
                retired_order: VecDeque::new(),
                refused: 0,
                last_refusal: None,
                strays: VecDeque::new(),
                stray_wakers: Vec::new(),
            }),
            space: Notify::new(),
            budget,
        }
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
        if freed > 0 {
            self.space.notify_waiters();
        }
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
        self.take(tag, from, None)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        tag: OpTag,
        from: &PeerSet,
    ) -> Poll<Result<Frame, TransportError>> {
        match self.take(tag, from, Some(cx.waker())) {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }

    /// Takes a matching frame, or reports closure or a lost peer; else
    /// registers `waker` (if any) and returns `None`.
    fn take(
        &self,
        tag: OpTag,
        from: &PeerSet,
        waker: Option<&Waker>,
    ) -> Option<Result<Frame, TransportError>> {
        let mut inner = self.lock();
        if let Some(slot) = inner.slots.get_mut(&tag) {
            if let Some(i) = slot.frames.iter().position(|f| from.contains(f.from)) {
                let frame = slot.frames.remove(i).expect("index just found");
                if slot.frames.is_empty() && slot.wakers.is_empty() {
                    inner.slots.remove(&tag);
                }
                inner.queued_bytes -= frame.payload.len();
                drop(inner);
                self.space.notify_waiters();
                return Some(Ok(frame));
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
            if slot.frames.is_empty() {
                inner.slots.remove(&tag);
            }
        }
    }

    /// See [`crate::Transport::recv`].
    pub async fn recv(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
    ) -> Result<Frame, TransportError> {
        struct Guard<'a>(&'a Matcher, OpTag);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                self.0.forget_waiter(self.1);
            }
        }
        let _guard = Guard(self, tag);
        match tokio::time::timeout_at(deadline, poll_fn(|cx| self.poll_recv(cx, tag, from))).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::Timeout {
                what: format!("a frame of op {} seq {} ({})", tag.op, tag.seq, tag.epoch),
            }),
        }
    }

    /// Marks `peer` lost: receives that name it fail once nothing of theirs
    /// is queued. The first reason is kept.
    pub fn fail_peer(&self, peer: Rank, reason: impl Into<Arc<str>>) {
        let mut inner = self.lock();
        inner.lost.entry(peer).or_insert_with(|| reason.into());
        wake_all(&mut inner);
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
        let inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        let mut silent = peers.clone();
        if let Some(slot) = inner.slots.get(&tag) {
            for f in &slot.frames {
                silent.remove(f.from);
            }
        }
        match lost_in(&inner, &silent) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The reason `peer` was lost, if it was.
    pub fn lost_reason(&self, peer: Rank) -> Option<Arc<str>> {
        self.lock().lost.get(&peer).cloned()
    }

    /// See [`crate::Transport::retire`].
    pub fn retire(&self, tag: OpTag) {
        let mut inner = self.lock();
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
        self.space.notify_waiters();
    }

    /// Fails everything pending and later. Idempotent.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
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

fn lost_in(inner: &Inner, from: &PeerSet) -> Option<TransportError> {
    // Report the lowest lost rank so errors are reproducible.
    inner
        .lost
        .iter()
        .filter(|(r, _)| from.contains(**r))
        .min_by_key(|(r, _)| **r)
        .map(|(r, why)| TransportError::PeerLost {
            peer: *r,
            reason: why.clone(),
        })
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
