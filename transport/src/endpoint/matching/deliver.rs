//! Frames coming in from the readers: queued under the byte budget (a
//! reader waits while it is spent), copied into a receive posted for them,
//! refused when of an older epoch, kept as strays when their op is
//! retired; heartbeats and loss notices go to the beacons and the notices.

use bytes::Bytes;
use kungfu_topology::Rank;

use super::posted::claim_in;
use super::strays::push_stray;
use super::Matcher;
use crate::{Frame, FrameKind, Header, Instant, TransportError};

impl Matcher {
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
}
