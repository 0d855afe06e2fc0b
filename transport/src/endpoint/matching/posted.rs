//! Posted receives (see the matcher's module docs): a receive lends a
//! range of the op's memory, and the frame it names lands there.

use kungfu_topology::Rank;

use super::strays::push_stray;
use super::{Inner, Matcher, RecvKey};
use crate::region::MemMut;
use crate::{Header, Instant, TransportError};

impl Matcher {
    /// Posts a receive: the frame `key` names lands in `mem` (see the
    /// module docs). `Ok(Some(header))` when it had already come (it is
    /// copied in now, and no [`Arrival::Landed`](super::Arrival::Landed) follows); `Ok(None)` when
    /// it is posted, to be taken as [`Arrival::Landed`](super::Arrival::Landed). A queued frame of
    /// that key with another length stays queued (the op finds it wrong
    /// when it takes it). Refused when closed or for an older epoch;
    /// a receive of a retired op, or a second one for a key, is dropped.
    pub fn post(&self, key: RecvKey, mut mem: MemMut) -> Result<Option<Header>, TransportError> {
        let mut inner = self.lock();
        if inner.closed {
            return Err(TransportError::Closed);
        }
        if key.tag.epoch < inner.epoch {
            return Err(TransportError::StaleEpoch {
                peer: key.from,
                frame: key.tag.epoch,
                current: inner.epoch,
            });
        }
        if inner.retired.contains(&key.tag) {
            return Ok(None);
        }
        let queued = inner.slots.get_mut(&key.tag).and_then(|slot| {
            let i = slot.frames.iter().position(|f| {
                RecvKey::of(f.from, &f.header) == Some(key) && f.payload.len() == mem.len()
            })?;
            slot.frames.remove(i)
        });
        match queued {
            Some(f) => {
                inner.queued_bytes -= f.payload.len();
                drop(inner);
                self.space.notify_waiters();
                mem.as_mut_slice().copy_from_slice(&f.payload);
                Ok(Some(f.header))
            }
            None => {
                if let std::collections::hash_map::Entry::Vacant(e) = inner.posted.entry(key) {
                    e.insert(mem);
                    self.count_posted(&inner);
                }
                // else `mem` (a second post of a key) is released, after
                // the lock (see `take_posted`)
                Ok(None)
            }
        }
    }

    /// Takes the posted range the frame `header` from `from` lands in, if
    /// a receive is posted for it with its length: the caller writes the
    /// payload into it and then calls [`Matcher::landed`] (or drops it, if
    /// the payload never came: the receive then waits for nothing, and the
    /// op's deadline or a lost peer ends it).
    pub fn claim(&self, from: Rank, header: &Header) -> Option<MemMut> {
        let len = usize::try_from(header.len).ok()?;
        self.claim_len(from, header, len)
    }

    /// Copies a payload given in pieces (a ring that wraps) into its
    /// posted range, if one is posted for it: true when it landed.
    pub fn land_parts(&self, from: Rank, header: &Header, parts: &[&[u8]]) -> bool {
        let len = parts.iter().map(|p| p.len()).sum();
        let Some(mut mem) = self.claim_len(from, header, len) else {
            return false;
        };
        let dst = mem.as_mut_slice();
        let mut at = 0;
        for p in parts {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        self.landed(from, *header, mem);
        true
    }

    /// The posted range of the frame `header` from `from` with a payload
    /// of `len` bytes, taken out of the posted receives.
    fn claim_len(&self, from: Rank, header: &Header, len: usize) -> Option<MemMut> {
        if !self.has_posted() {
            return None;
        }
        let mut inner = self.lock();
        let mem = claim_in(&mut inner, from, header, len);
        self.count_posted(&inner);
        mem
    }

    /// A claimed range holds its frame: the op receives
    /// [`Arrival::Landed`](super::Arrival::Landed). The share is released first, so the op owns
    /// all of its memory again when it sees the arrival.
    pub fn landed(&self, from: Rank, header: Header, mem: MemMut) {
        drop(mem);
        let mut inner = self.lock();
        if inner.closed || header.tag.epoch < inner.epoch {
            return;
        }
        if let Some(t) = inner.heard.get_mut(&from) {
            *t = Instant::now();
        }
        if inner.retired.contains(&header.tag) {
            push_stray(&mut inner, from, header);
            return;
        }
        let slot = inner.slots.entry(header.tag).or_default();
        slot.landed.push_back((from, header));
        for w in slot.wakers.drain(..) {
            w.wake();
        }
    }

    /// Delivers a frame that may only land in a posted receive (a payload
    /// above the wire's eager limit): waits until its receive is posted,
    /// then writes it there. A frame of a retired op becomes a stray; one
    /// of an older epoch is refused; a closed matcher refuses everything.
    /// The caller bounds the wait (the op's deadline).
    pub async fn rendezvous(
        &self,
        from: Rank,
        header: Header,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        /// Counts this sender as waiting (so posts notify) while it waits,
        /// also if the send is dropped meanwhile.
        struct Waiting<'a>(&'a Matcher, bool);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                if self.1 {
                    self.0.lock().rendezvous -= 1;
                }
            }
        }
        let mut waiting = Waiting(self, false);
        loop {
            let posted = self.posts.notified();
            {
                let mut inner = self.lock();
                if std::mem::take(&mut waiting.1) {
                    inner.rendezvous -= 1;
                }
                if inner.closed {
                    return Err(TransportError::Closed);
                }
                if header.tag.epoch < inner.epoch {
                    return Err(TransportError::StaleEpoch {
                        peer: from,
                        frame: header.tag.epoch,
                        current: inner.epoch,
                    });
                }
                if inner.retired.contains(&header.tag) {
                    push_stray(&mut inner, from, header);
                    return Ok(());
                }
                if let Some(mut mem) = claim_in(&mut inner, from, &header, payload.len()) {
                    self.count_posted(&inner);
                    drop(inner);
                    mem.as_mut_slice().copy_from_slice(payload);
                    self.landed(from, header, mem);
                    return Ok(());
                }
                inner.rendezvous += 1;
                waiting.1 = true;
            }
            posted.await;
        }
    }
}

/// Takes the posted range for a frame `header` from `from`, if one is
/// posted for it with its length.
pub(super) fn claim_in(
    inner: &mut Inner,
    from: Rank,
    header: &Header,
    len: usize,
) -> Option<MemMut> {
    let key = RecvKey::of(from, header)?;
    match inner.posted.get(&key) {
        Some(m) if m.len() == len => inner.posted.remove(&key),
        _ => None,
    }
}

/// Removes the posted receives `which` selects, to be dropped by the
/// caller once it let go of the lock: releasing a share may release the
/// region, whose hook (the C ABI's completion callback) may call back into
/// this endpoint.
pub(super) fn take_posted(inner: &mut Inner, which: impl Fn(&RecvKey) -> bool) -> Vec<MemMut> {
    if inner.posted.is_empty() {
        return Vec::new();
    }
    let keys: Vec<RecvKey> = inner.posted.keys().filter(|k| which(k)).copied().collect();
    keys.iter().filter_map(|k| inner.posted.remove(k)).collect()
}
