//! The two sides of a ring, each held by one thread of this process at a
//! time (see "Sides" in the parent module): all access to the data region
//! is here, in methods of a held side.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use super::{
    pid_alive, Ring, OFF_DATA_SEQ, OFF_HEAD, OFF_RECV_PID, OFF_RECV_SLEEPING, OFF_SEND_SLEEPING,
    OFF_SPACE_SEQ, OFF_TAIL, RECEIVER_CLOSED, SENDER_CLOSED,
};
use crate::{Header, HEADER_LEN};

/// Takes a side's lock. The lock guards no data (the ring's state is in
/// its indices, which a panic never leaves half moved), so a poisoned lock
/// is taken as it is.
fn take(lock: &Mutex<()>) -> MutexGuard<'_, ()> {
    lock.lock().unwrap_or_else(|e| e.into_inner())
}

/// As [`take`], without waiting: `None` if another holds the lock.
fn try_take(lock: &Mutex<()>) -> Option<MutexGuard<'_, ()>> {
    match lock.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl Ring {
    /// The receiving side, waiting for whoever holds it now (a reader
    /// thread in `read_frame`, a polling task lending a frame).
    pub(in crate::shm) fn consumer(&self) -> Consumer<'_> {
        Consumer {
            ring: self,
            _held: take(&self.consumer),
        }
    }

    /// The receiving side if nobody holds it now.
    pub(in crate::shm) fn try_consumer(&self) -> Option<Consumer<'_>> {
        Some(Consumer {
            ring: self,
            _held: try_take(&self.consumer)?,
        })
    }

    /// The sending side, waiting for a frame half written to finish.
    pub(in crate::shm) fn producer(&self) -> Producer<'_> {
        Producer {
            ring: self,
            _held: take(&self.producer),
        }
    }

    /// The sending side if nobody holds it now (no frame half written).
    pub(in crate::shm) fn try_producer(&self) -> Option<Producer<'_>> {
        Some(Producer {
            ring: self,
            _held: try_take(&self.producer)?,
        })
    }
}

/// The receiving side of a ring, held (see [`Ring::consumer`]): only it
/// reads the data region and moves `tail`.
pub(in crate::shm) struct Consumer<'r> {
    ring: &'r Ring,
    _held: MutexGuard<'r, ()>,
}

/// A consumer's snapshot of the published bytes: `avail` bytes from
/// `tail`, with `head` read once (Acquire). Only its consumer moves
/// `tail`, which it borrows mutably until [`Published::consume`] ends it,
/// and an honest sender only adds bytes, so the snapshot stays true while
/// it lives. `avail <= cap`, which bounds every copy below to the data
/// region, whatever the peer wrote.
pub(in crate::shm) struct Published<'c> {
    ring: &'c Ring,
    tail: u64,
    avail: usize,
}

impl Consumer<'_> {
    /// The published bytes now, or why the indices are corrupt.
    pub(in crate::shm) fn published(&mut self) -> Result<Published<'_>, String> {
        let (tail, avail) = self.ring.snapshot()?;
        Ok(Published {
            ring: self.ring,
            tail,
            avail,
        })
    }

    /// Fills `dst`, waiting for data as needed. `Err(None)` is a clean end
    /// of stream (the sender closed after its last frame).
    fn read_exact(&mut self, dst: &mut [u8], stop: &AtomicBool) -> Result<(), Option<String>> {
        let mut got = 0;
        while got < dst.len() {
            // The close flag before the head: the sender closes after its
            // last byte, so a close seen here means that byte is seen
            // below. (Head first lost a frame published just before the
            // close; Miri found it, see the tests.)
            let closed = self.ring.closed() & SENDER_CLOSED != 0;
            let p = self.published().map_err(Some)?;
            if p.avail == 0 {
                if closed {
                    return Err(if got == 0 {
                        None
                    } else {
                        Some("ring closed in the middle of a frame".into())
                    });
                }
                self.ring.wait_data(stop, true).map_err(Some)?;
                continue;
            }
            let n = p.avail.min(dst.len() - got);
            // Cannot fail (`n <= avail`), but checked, not assumed: had it
            // failed, `dst` would be handed back with bytes never read.
            if !(p.peek(0, &mut dst[got..got + n]) && p.consume(n)) {
                return Err(Some(format!("ring snapshot did not hold {n} bytes")));
            }
            got += n;
        }
        Ok(())
    }

    /// Reads the next whole frame, waiting for its bytes; its payload goes
    /// into a buffer from `take(len)` (allocated only once the header,
    /// `len` included, has been checked against `max_frame`). `Err(None)`
    /// is a clean end of stream.
    pub(in crate::shm) fn read_frame<B: AsMut<[u8]>>(
        &mut self,
        max_frame: usize,
        stop: &AtomicBool,
        take: impl FnOnce(usize) -> B,
    ) -> Result<(Header, B), Option<String>> {
        let mut hb = [0u8; HEADER_LEN];
        self.read_exact(&mut hb, stop)?;
        let header =
            Header::decode(&hb, max_frame).map_err(|e| Some(format!("protocol violation: {e}")))?;
        let mut payload = take(header.len as usize);
        self.read_exact(payload.as_mut(), stop).map_err(|e| {
            Some(e.unwrap_or_else(|| "ring closed in the middle of a frame".into()))
        })?;
        Ok((header, payload))
    }

    /// Without waiting: the next frame's header and the snapshot it was
    /// read from, if its header is published and valid. `Ok(None)`: not a
    /// whole header yet. The payload may not all be published yet
    /// (`p.holds(HEADER_LEN + len)` says).
    pub(in crate::shm) fn peek_frame(
        &mut self,
        max_frame: usize,
    ) -> Result<Option<(Header, Published<'_>)>, String> {
        let p = self.published()?;
        let mut hb = [0u8; HEADER_LEN];
        if !p.peek(0, &mut hb) {
            return Ok(None);
        }
        let h = Header::decode(&hb, max_frame).map_err(|e| format!("protocol violation: {e}"))?;
        Ok(Some((h, p)))
    }
}

impl Published<'_> {
    /// Whether `n` bytes are published.
    pub(in crate::shm) fn holds(&self, n: usize) -> bool {
        n <= self.avail
    }

    /// How many bytes are published.
    pub(in crate::shm) fn len(&self) -> usize {
        self.avail
    }

    /// Where the byte `skip` past the snapshot's tail lives, and how many
    /// of `n` bytes from there lie before the ring's end; `None` unless
    /// all `n` are published.
    fn span(&self, skip: usize, n: usize) -> Option<(usize, usize)> {
        if !skip.checked_add(n).is_some_and(|end| self.holds(end)) {
            return None;
        }
        let cap = self.ring.cap;
        let pos = (self.tail as usize).wrapping_add(skip) & (cap - 1);
        Some((pos, n.min(cap - pos)))
    }

    /// Copies `dst.len()` bytes out of the ring, `skip` bytes past the
    /// snapshot's tail, without consuming them. False (nothing copied) if
    /// they are not all published.
    pub(in crate::shm) fn peek(&self, skip: usize, dst: &mut [u8]) -> bool {
        let n = dst.len();
        let Some((pos, first)) = self.span(skip, n) else {
            return false;
        };
        let data = self.ring.data();
        // SAFETY: `n <= avail <= cap`, `pos < cap` and `first <= cap -
        // pos`, so both pieces lie inside the data region; they are
        // published (head was read with Acquire) and the sender does not
        // write them until `tail` passes them, which only this snapshot's
        // consumer moves, after the snapshot is gone; `dst` is a live slice
        // of `n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(data.add(pos), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(data, dst.as_mut_ptr().add(first), n - first);
        }
        true
    }

    /// Lends the `n` published bytes that start `skip` bytes past the
    /// snapshot's tail to `f`, in one or two pieces (two where they wrap
    /// around the ring's end), without consuming them. `None` (and `f` not
    /// called) if they are not all published.
    pub(in crate::shm) fn lend<R>(
        &self,
        skip: usize,
        n: usize,
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        let (pos, first) = self.span(skip, n)?;
        let data = self.ring.data();
        // SAFETY: as in `peek`: both pieces lie inside the data region and
        // hold published bytes, which the sender does not write until
        // `tail` passes them; `tail` moves only through `consume`, which
        // takes the snapshot, so after `f` has returned and the slices
        // (which `f` cannot keep: `R` does not borrow them) are gone.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(data.add(pos), first),
                std::slice::from_raw_parts(data, n - first),
            )
        };
        Some(if b.is_empty() { f(&[a]) } else { f(&[a, b]) })
    }

    /// Consumes `n` bytes of the snapshot, which ends it. False (nothing
    /// consumed) if they are not all published.
    pub(in crate::shm) fn consume(self, n: usize) -> bool {
        if !self.holds(n) {
            return false;
        }
        let ring = self.ring;
        ring.u64_at(OFF_TAIL)
            .store(self.tail.wrapping_add(n as u64), Ordering::Release);
        ring.notify(OFF_SPACE_SEQ, OFF_SEND_SLEEPING);
        true
    }
}

/// The sending side of a ring, held (see [`Ring::producer`]): only it
/// writes the data region and moves `head`.
pub(in crate::shm) struct Producer<'r> {
    ring: &'r Ring,
    _held: MutexGuard<'r, ()>,
}

impl Producer<'_> {
    /// `(head, tail, free bytes from head)`, or why the indices are
    /// corrupt.
    fn free(&self) -> Result<(u64, u64, usize), String> {
        let ring = self.ring;
        let head = ring.u64_at(OFF_HEAD).load(Ordering::Relaxed);
        let tail = ring.u64_at(OFF_TAIL).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if used > ring.cap as u64 {
            return Err(format!("ring corrupted (head {head}, tail {tail})"));
        }
        Ok((head, tail, ring.cap - used as usize))
    }

    /// Copies `src` into the ring at stream offset `at`, wrapping around.
    ///
    /// # Safety
    ///
    /// Bytes `[at, at + src.len())` of the stream must be free: at or past
    /// the `tail` the consumer last published and before that `tail + cap`
    /// (so `src.len() <= cap`). Nobody reads them until this producer
    /// publishes them by moving `head`, and this producer writes nothing
    /// else meanwhile: a consumer reading them at once would race the copy.
    unsafe fn copy_in(&self, at: u64, src: &[u8]) {
        let cap = self.ring.cap;
        let pos = (at as usize) & (cap - 1);
        let first = src.len().min(cap - pos);
        let data = self.ring.data();
        // SAFETY: both pieces lie inside the data region (pos < cap, first
        // <= cap - pos, the rest <= cap - first since src.len() <= cap, as
        // the caller promises); the caller owns those bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(pos), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), data, src.len() - first);
        }
    }

    /// Appends all of `src`, waiting for space as needed.
    pub(in crate::shm) fn write_all(
        &self,
        mut src: &[u8],
        stop: &AtomicBool,
    ) -> Result<(), String> {
        let ring = self.ring;
        let head_w = ring.u64_at(OFF_HEAD);
        let tail_w = ring.u64_at(OFF_TAIL);
        let recv_pid = ring.u32_at(OFF_RECV_PID).load(Ordering::Acquire);
        while !src.is_empty() {
            let (head, tail, free) = self.free()?;
            if free == 0 {
                // Wait for `tail` to move from the value that made the ring
                // full (a fresh load here could already be the receiver's
                // last move, and wait for one that never comes; Miri found
                // it).
                ring.wait(
                    OFF_SPACE_SEQ,
                    OFF_SEND_SLEEPING,
                    true,
                    || tail_w.load(Ordering::Acquire) != tail,
                    || {
                        if stop.load(Ordering::Acquire) {
                            Some("endpoint stopped".into())
                        } else if ring.closed() & RECEIVER_CLOSED != 0 {
                            Some("receiver closed the ring".into())
                        } else if !pid_alive(recv_pid) {
                            Some(format!("receiving process {recv_pid} is gone"))
                        } else {
                            None
                        }
                    },
                )?;
                continue;
            }
            let n = free.min(src.len());
            // SAFETY: `n <= free <= cap`; bytes [head, head + n) are free
            // (the receiver consumed everything below `tail`, and `n <=
            // free`); only this producer writes them, and nobody reads
            // them, until `head` moves below.
            unsafe { self.copy_in(head, &src[..n]) };
            head_w.store(head.wrapping_add(n as u64), Ordering::Release);
            ring.notify(OFF_DATA_SEQ, OFF_RECV_SLEEPING);
            src = &src[n..];
        }
        Ok(())
    }

    /// Appends all of `parts` if they fit now, as one publication; false
    /// (and nothing written) if they do not, or the ring is corrupt (the
    /// caller then sends through `write_all`, which says so).
    pub(in crate::shm) fn try_write(&self, parts: &[&[u8]]) -> bool {
        let Ok((head, _, free)) = self.free() else {
            return false;
        };
        let total = parts.iter().try_fold(0usize, |t, p| t.checked_add(p.len()));
        if total.is_none_or(|t| t > free) {
            return false;
        }
        let mut at = head;
        for p in parts {
            // SAFETY: [head, head + total) is free (checked above, total <=
            // free <= cap), and [at, at + p.len()) lies in it; only this
            // producer writes it, and nobody reads it, until `head` is
            // published below.
            unsafe { self.copy_in(at, p) };
            at = at.wrapping_add(p.len() as u64);
        }
        self.ring.u64_at(OFF_HEAD).store(at, Ordering::Release);
        self.ring.notify(OFF_DATA_SEQ, OFF_RECV_SLEEPING);
        true
    }

    /// Overwrites both indices, as a corrupt peer could (for the testing
    /// hook): `tail`, then `head` with Release, then wakes a sleeper. It
    /// takes both sides, so that in this process no snapshot is lent out
    /// and no frame is half written while the indices jump.
    pub(in crate::shm) fn set_indices(&self, consumer: &Consumer<'_>, head: u64, tail: u64) {
        let ring = self.ring;
        assert!(std::ptr::eq(ring, consumer.ring), "both sides of one ring");
        ring.u64_at(OFF_TAIL).store(tail, Ordering::Release);
        ring.u64_at(OFF_HEAD).store(head, Ordering::Release);
        ring.wake_reader();
    }
}
