//! Matching of incoming frames to receives, with a bounded byte budget.
//!
//! Every stream-like backend (TCP, in-memory; later QUIC and shared memory)
//! shares this: reader tasks [`Mailbox::deliver`] frames, ops
//! [`Mailbox::recv`] them by [`OpTag`]. A frame is removed only inside a
//! poll that returns it, so a dropped receive loses nothing.

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
pub struct Mailbox {
    inner: Mutex<Inner>,
    space: Notify,
    budget: usize,
}

impl Mailbox {
    /// A mailbox at `epoch` that holds at most `budget` bytes of unmatched
    /// payload (one frame is always admitted into an empty mailbox, so a
    /// frame larger than the budget cannot wedge a peer).
    pub fn new(epoch: Epoch, budget: usize) -> Mailbox {
        Mailbox {
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
    /// [`Mailbox::last_refusal`], and the error is returned so the reader
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
    /// checked [`Mailbox::has_room`]); otherwise as [`Mailbox::deliver`].
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
        struct Guard<'a>(&'a Mailbox, OpTag);
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

    /// [`Mailbox::recv`], after staying runnable for `spin`: in between,
    /// `pump` may move frames in (returning whether it did), and the task
    /// yields to the runtime (which then polls its IO instead of parking
    /// the thread) and, if `yield_os`, to the OS (ranks outnumber cores).
    /// A frame that arrives during the spin costs no thread wake-up.
    pub async fn recv_spinning(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
        spin: std::time::Duration,
        yield_os: bool,
        mut pump: impl FnMut() -> bool + Send,
    ) -> Result<Frame, TransportError> {
        let pump = || Pump::moved(pump());
        match self.spin_recv(tag, from, spin, yield_os, pump).await {
            Some(r) => r.map(|f| f.expect("plain pumps consume nothing")),
            None => self.recv(tag, from, deadline).await,
        }
    }

    /// The spinning phase of [`Mailbox::recv_spinning`]: `None` if nothing
    /// came within `spin`; `Some(Ok(None))` when `pump` consumed a frame of
    /// `tag` in place.
    pub async fn spin_recv(
        &self,
        tag: OpTag,
        from: &PeerSet,
        spin: std::time::Duration,
        yield_os: bool,
        mut pump: impl FnMut() -> Pump + Send,
    ) -> Option<Result<Option<Frame>, TransportError>> {
        let spin_until = std::time::Instant::now() + spin;
        let mut polls = 0u32;
        loop {
            if let Some(r) = self.try_recv(tag, from) {
                return Some(r.map(Some));
            }
            match pump() {
                Pump::Consumed => return Some(Ok(None)),
                Pump::Moved => continue,
                Pump::Idle => {}
            }
            // Yielding polls the runtime's IO (a system call), and reading
            // the clock is not free either: do both every few polls only.
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(16) {
                std::hint::spin_loop();
                continue;
            }
            if std::time::Instant::now() >= spin_until {
                return None;
            }
            if yield_os {
                std::thread::yield_now();
            }
            tokio::task::yield_now().await;
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
    /// `to`: a rank it has a route to, a frame within `max_frame`, a peer
    /// not lost.
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
        match self.lost_reason(to) {
            Some(reason) => Err(TransportError::PeerLost { peer: to, reason }),
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

/// What one poll of a backend's inbound queues did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pump {
    /// Nothing new.
    Idle,
    /// Frames moved into the mailbox.
    Moved,
    /// A frame of the awaited op was consumed in place.
    Consumed,
}

impl Pump {
    pub fn moved(moved: bool) -> Pump {
        if moved {
            Pump::Moved
        } else {
            Pump::Idle
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FrameKind, OpId};
    use std::time::Duration;

    fn tag(op: u64) -> OpTag {
        OpTag {
            epoch: Epoch(1),
            op: OpId(op),
            seq: 0,
        }
    }

    fn header(t: OpTag, len: usize) -> Header {
        Header {
            kind: FrameKind::Data,
            tag: t,
            chunk: 0,
            step: 0,
            digest: 0,
            len: len as u64,
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn early_frames_wait_for_their_receive() {
        let mb = Mailbox::new(Epoch(1), 1 << 20);
        mb.deliver(Rank(1), header(tag(5), 3), Bytes::from_static(b"abc"))
            .await
            .unwrap();
        assert_eq!(mb.queued_bytes(), 3);
        let f = mb.recv(tag(5), &PeerSet::all(4), soon()).await.unwrap();
        assert_eq!(&f.payload[..], b"abc");
        assert_eq!(mb.queued_bytes(), 0);
    }

    #[tokio::test]
    async fn receive_only_from_the_named_peers() {
        let mb = Mailbox::new(Epoch(1), 1 << 20);
        mb.deliver(Rank(2), header(tag(5), 1), Bytes::from_static(b"x"))
            .await
            .unwrap();
        let only1: PeerSet = [Rank(1)].into_iter().collect();
        let r = mb
            .recv(tag(5), &only1, Instant::now() + Duration::from_millis(20))
            .await;
        assert!(matches!(r, Err(TransportError::Timeout { .. })));
        // the frame is still there for a receive that names rank 2
        assert!(mb.recv(tag(5), &PeerSet::all(3), soon()).await.is_ok());
    }

    #[tokio::test]
    async fn stale_epoch_is_refused_and_counted() {
        let mb = Mailbox::new(Epoch(3), 1 << 20);
        let old = OpTag {
            epoch: Epoch(2),
            ..tag(1)
        };
        let r = mb.deliver(Rank(0), header(old, 0), Bytes::new()).await;
        assert!(matches!(r, Err(TransportError::StaleEpoch { .. })));
        assert_eq!(mb.refused(), 1);
        assert_eq!(mb.queued_bytes(), 0);
    }

    #[tokio::test]
    async fn advancing_the_epoch_drops_old_frames_and_keeps_early_ones() {
        let mb = Mailbox::new(Epoch(1), 1 << 20);
        let next = OpTag {
            epoch: Epoch(2),
            ..tag(7)
        };
        mb.deliver(Rank(1), header(tag(5), 3), Bytes::from_static(b"old"))
            .await
            .unwrap();
        mb.deliver(Rank(1), header(next, 5), Bytes::from_static(b"early"))
            .await
            .unwrap();
        assert_eq!(mb.queued_bytes(), 8);
        mb.advance_epoch(Epoch(2));
        assert_eq!(mb.epoch(), Epoch(2));
        assert_eq!(mb.queued_bytes(), 5, "the old frame is gone");
        let f = mb.recv(next, &PeerSet::all(2), soon()).await.unwrap();
        assert_eq!(&f.payload[..], b"early");
        let r = mb.deliver(Rank(1), header(tag(5), 0), Bytes::new()).await;
        assert!(matches!(r, Err(TransportError::StaleEpoch { .. })));
        mb.advance_epoch(Epoch(1));
        assert_eq!(mb.epoch(), Epoch(2), "an epoch never goes back");
    }

    #[tokio::test]
    async fn budget_applies_back_pressure() {
        let mb = Arc::new(Mailbox::new(Epoch(1), 10));
        mb.deliver(Rank(0), header(tag(1), 8), Bytes::from(vec![0; 8]))
            .await
            .unwrap();
        let mb2 = mb.clone();
        let blocked = tokio::spawn(async move {
            mb2.deliver(Rank(0), header(tag(2), 8), Bytes::from(vec![0; 8]))
                .await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!blocked.is_finished(), "over budget must wait");
        assert_eq!(mb.queued_bytes(), 8);
        mb.recv(tag(1), &PeerSet::all(1), soon()).await.unwrap();
        blocked.await.unwrap().unwrap();
        assert_eq!(mb.queued_bytes(), 8);
    }

    #[tokio::test]
    async fn lost_peer_fails_waiting_receive() {
        let mb = Arc::new(Mailbox::new(Epoch(1), 1 << 20));
        let mb2 = mb.clone();
        let waiter = tokio::spawn(async move { mb2.recv(tag(1), &PeerSet::all(3), soon()).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        mb.fail_peer(Rank(2), "connection reset");
        match waiter.await.unwrap() {
            Err(TransportError::PeerLost { peer, reason }) => {
                assert_eq!(peer, Rank(2));
                assert_eq!(&*reason, "connection reset");
            }
            other => panic!("{other:?}"),
        }
        let only01: PeerSet = [Rank(0), Rank(1)].into_iter().collect();
        assert!(mb.check_peers(&only01).is_ok());
    }

    #[tokio::test]
    async fn retired_frames_become_strays_without_payload() {
        let mb = Mailbox::new(Epoch(1), 1 << 20);
        mb.deliver(Rank(0), header(tag(1), 4), Bytes::from(vec![0; 4]))
            .await
            .unwrap();
        mb.retire(tag(1));
        assert_eq!(mb.queued_bytes(), 0);
        mb.deliver(Rank(2), header(tag(1), 4), Bytes::from(vec![0; 4]))
            .await
            .unwrap();
        assert_eq!(mb.queued_bytes(), 0);
        for from in [Rank(0), Rank(2)] {
            let f = mb.recv_stray(soon()).await.unwrap();
            assert_eq!((f.from, f.header.tag, f.payload.len()), (from, tag(1), 0));
        }
        let none = mb
            .recv_stray(Instant::now() + Duration::from_millis(10))
            .await;
        assert!(matches!(none, Err(TransportError::Timeout { .. })));
    }

    #[tokio::test]
    async fn non_waiting_paths() {
        let mb = Mailbox::new(Epoch(1), 10);
        let all = PeerSet::all(2);
        assert!(mb.try_recv(tag(1), &all).is_none());
        assert!(mb.has_room(100), "an empty mailbox admits any frame");
        mb.deliver_now(Rank(1), header(tag(1), 8), Bytes::from(vec![1; 8]))
            .unwrap();
        assert!(!mb.has_room(8));
        // forced past the budget
        mb.deliver_now(Rank(1), header(tag(1), 8), Bytes::from(vec![2; 8]))
            .unwrap();
        assert_eq!(mb.queued_bytes(), 16);
        assert_eq!(mb.try_recv(tag(1), &all).unwrap().unwrap().payload[0], 1);
        assert_eq!(mb.try_recv(tag(1), &all).unwrap().unwrap().payload[0], 2);
        mb.fail_peer(Rank(1), "gone");
        assert!(matches!(
            mb.try_recv(tag(1), &all),
            Some(Err(TransportError::PeerLost { .. }))
        ));
    }

    #[tokio::test]
    async fn dropped_receive_loses_nothing() {
        let mb = Mailbox::new(Epoch(1), 1 << 20);
        let from = PeerSet::all(1);
        {
            let fut = mb.recv(tag(1), &from, soon());
            tokio::pin!(fut);
            assert!(futures_poll_once(fut.as_mut()).await.is_none());
        }
        mb.deliver(Rank(0), header(tag(1), 1), Bytes::from_static(b"z"))
            .await
            .unwrap();
        assert_eq!(
            &mb.recv(tag(1), &from, soon()).await.unwrap().payload[..],
            b"z"
        );
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
        poll_fn(|cx| {
            Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                Poll::Ready(v) => Some(v),
                Poll::Pending => None,
            })
        })
        .await
    }
}
