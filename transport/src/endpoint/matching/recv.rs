//! Receives: an op takes the next frame of its [`OpTag`] from a set of
//! peers (or, if it posts receives, a landed one), or learns that none
//! will come (closed, a peer lost); a receive that waits does so until its
//! deadline, and a dropped one loses no frame.

use std::future::poll_fn;
use std::task::{Poll, Waker};

use super::lost::lost_in;
use super::{Arrival, Matcher};
use crate::{Frame, Instant, OpTag, PeerSet, TransportError};

impl Matcher {
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
}

fn frame_only(r: Result<Arrival, TransportError>) -> Result<Frame, TransportError> {
    match r? {
        Arrival::Frame(f) => Ok(f),
        other => unreachable!("asked for frames only, got {other:?}"),
    }
}
