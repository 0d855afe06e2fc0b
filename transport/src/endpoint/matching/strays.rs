//! Retired op instances and their strays: a retired op's queued and late
//! frames keep only their headers (a bounded number), for the layer above
//! to check, and a bounded number of retired tags is remembered.

use std::future::poll_fn;
use std::task::Poll;

use bytes::Bytes;
use kungfu_topology::Rank;

use super::posted::take_posted;
use super::{Inner, Matcher};
use crate::{Frame, Header, Instant, OpTag, TransportError};

/// How many retired op instances are remembered (their late frames become
/// strays).
const RETIRED_MEMORY: usize = 4096;
/// How many stray headers are kept for the layer above; more are dropped.
const STRAY_MEMORY: usize = 4096;

impl Matcher {
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
}

pub(super) fn push_stray(inner: &mut Inner, from: Rank, mut header: Header) {
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
