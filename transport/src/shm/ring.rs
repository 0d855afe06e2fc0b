//! One ring: its layout in the shared file, the single-producer
//! single-consumer protocol over it, and waiting on it.
//!
//! # Layout
//!
//! A control page ([`CTL`] bytes: identity, then the indices and wake-up
//! words on cache lines of their own), then `cap` data bytes, `cap` a power
//! of two. `head` and `tail` are stream offsets: the sender has published
//! every byte below `head`, the receiver has consumed every byte below
//! `tail`, and byte `i` of the stream lives at data offset `i mod cap`.
//! They wrap at 2^64 (all arithmetic on them wraps; `cap` divides 2^64, so
//! a position stays right across the wrap).
//!
//! # Trust
//!
//! The other side is another process, and anything it writes into the
//! shared page may be wrong: indices, flags, frame headers, lengths (a bug,
//! a process that died half-way through a write, stray writes). None of it
//! may make this side read or write outside the mapping, panic, or allocate
//! without bound. So every position is reduced modulo `cap` before use,
//! every length is checked against a snapshot of the published bytes
//! ([`Published`]) that itself is at most `cap`, headers are decoded with a
//! bound on their length before anything is allocated, and what fails a
//! check becomes an error naming the ring, reported as the peer being lost.
//! The tests at the bottom run these paths over a heap buffer, so that Miri
//! can check them (see `scripts/miri-shm.sh`).

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::MmapMut;

use crate::{Header, HEADER_LEN};

/// v2: the cluster version (u64 at `OFF_VERSION`) joined the identity.
const MAGIC: u64 = u64::from_le_bytes(*b"KFSHMv2\0");
/// Bytes before the data region (control words on their own cache lines).
pub(super) const CTL: usize = 4096;
/// A ring's identity block, as its receiver wrote it at `init`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RingIdentity {
    pub(super) cluster: u64,
    pub(super) version: u64,
    pub(super) epoch: u32,
    /// The sender it expects.
    pub(super) from: u32,
    /// The receiver that made it.
    pub(super) to: u32,
    pub(super) cap: u32,
}

const OFF_MAGIC: usize = 0;
const OFF_CLUSTER: usize = 8;
const OFF_EPOCH: usize = 16;
const OFF_FROM: usize = 20;
const OFF_TO: usize = 24;
const OFF_CAP: usize = 28;
const OFF_ATTACHED: usize = 32;
const OFF_CLOSED: usize = 36;
const OFF_RECV_PID: usize = 40;
const OFF_SEND_PID: usize = 44;
const OFF_VERSION: usize = 48;
const OFF_HEAD: usize = 64;
const OFF_TAIL: usize = 128;
const OFF_DATA_SEQ: usize = 192;
const OFF_RECV_SLEEPING: usize = 196;
/// Non-zero while a receiving task of the receiver polls its rings itself:
/// the sender then does not wake the reader thread.
const OFF_RECV_POLLING: usize = 200;
const OFF_SPACE_SEQ: usize = 256;
const OFF_SEND_SLEEPING: usize = 260;
pub(super) const SENDER_CLOSED: u32 = 1;
pub(super) const RECEIVER_CLOSED: u32 = 2;

/// How a waiting side spins before it yields, and yields before it sleeps.
/// Measured with kungfu-bench on 2 cores, 2 and 4 ranks: no spinning gave
/// 113/214 us per 4-byte allreduce, 4000 spins and 16 yields 260/680 us
/// (spinners starve the ranks they wait for), 200 spins and 2 yields
/// 110/203 us and the best large-message bandwidth.
const SPINS: u32 = 200;
const YIELDS: u32 = 2;
/// Longest single sleep, so stops, closes and dead peers are noticed.
const NAP: Duration = Duration::from_millis(5);

fn futex(word: &AtomicU32, op: libc::c_int, val: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a valid, aligned 4-byte atomic in memory mapped by
    // this process for as long as the call runs (the ring outlives its
    // threads); FUTEX_WAIT only reads it and FUTEX_WAKE does not touch it.
    // The timeout pointer is null or points to a live timespec. A shared
    // (not private) futex, since the other side is another process.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op,
            val,
            ts_ptr,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether process `pid` (read from the shared page: any value) may still
/// be running. 0 and this process count as alive.
fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid == std::process::id() {
        return true;
    }
    // A value no process can have (it would name a process group, or every
    // process, to kill): the peer wrote garbage, but that alone is not its
    // death; the ring's other checks catch a corrupt peer.
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    // SAFETY: kill with signal 0 sends nothing; it only checks that the
    // process exists (ESRCH when it does not).
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The memory a ring lives in.
enum Backing {
    /// The shared file (the only kind outside tests).
    Map(#[allow(dead_code)] MmapMut),
    /// A heap buffer, so that tests can run the protocol under Miri, which
    /// cannot map files.
    #[cfg(test)]
    Heap(std::alloc::Layout),
}

/// One ring, mapped (or, in tests, on the heap).
pub(super) struct Ring {
    /// Start of the control page; `CTL + cap` bytes are valid from here
    /// for as long as `mem` lives.
    base: NonNull<u8>,
    pub(super) cap: usize,
    mem: Backing,
}

// SAFETY: `base` points into `mem`, which the ring owns and never moves or
// frees before it is dropped; every access through it is an atomic (the
// control words) or a copy of a byte range that the SPSC protocol gives to
// one side at a time (the data region). A mapping may be used from any
// thread.
unsafe impl Send for Ring {}
// SAFETY: as for `Send`: shared access goes through atomics and the SPSC
// protocol, whose two sides each hold a lock of their own in
// `ShmTransport` (`out_locks`, `in_locks`).
unsafe impl Sync for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        #[cfg(test)]
        if let Backing::Heap(layout) = self.mem {
            // SAFETY: allocated in `Ring::heap` with this layout; the ring
            // is the only owner and is going away.
            unsafe { std::alloc::dealloc(self.base.as_ptr(), layout) };
        }
    }
}

/// A receiver's snapshot of the published bytes: `avail` bytes from
/// `tail`, with `head` read once (Acquire). Only the receiver, holding the
/// ring's receive lock, consumes, and an honest sender only adds bytes, so
/// the snapshot stays true until the receiver consumes. `avail <= cap`,
/// which bounds every copy below to the data region, whatever the peer
/// wrote.
#[derive(Clone, Copy, Debug)]
pub(super) struct Published {
    tail: u64,
    avail: usize,
}

impl Published {
    /// Whether `n` bytes are published.
    pub(super) fn holds(&self, n: usize) -> bool {
        n <= self.avail
    }

    /// How many bytes are published.
    pub(super) fn len(&self) -> usize {
        self.avail
    }
}

impl Ring {
    /// A ring over `map`, which must be `CTL + cap` bytes.
    pub(super) fn new(mut map: MmapMut, cap: usize) -> Ring {
        // What makes every access below in bounds: checked, not assumed.
        assert!(cap.is_power_of_two() && map.len() == CTL + cap);
        let base = NonNull::new(map.as_mut_ptr()).expect("mappings are not null");
        Ring {
            base,
            cap,
            mem: Backing::Map(map),
        }
    }

    /// A zeroed ring on the heap (Miri cannot map files).
    #[cfg(test)]
    pub(super) fn heap(cap: usize) -> Ring {
        assert!(cap.is_power_of_two());
        let layout = std::alloc::Layout::from_size_align(CTL + cap, 4096).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Ring {
            base,
            cap,
            mem: Backing::Heap(layout),
        }
    }

    /// The whole mapping, for `madvise`.
    pub(super) fn map(&self) -> Option<&MmapMut> {
        match &self.mem {
            Backing::Map(m) => Some(m),
            #[cfg(test)]
            Backing::Heap(_) => None,
        }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off.is_multiple_of(4) && off + 4 <= CTL);
        // SAFETY: the control page is CTL bytes at a page-aligned `base`;
        // `off` is a multiple of 4 inside it (checked: the offsets are
        // constants, so this folds away), and every access to these words,
        // by either process, is atomic.
        unsafe { &*(self.base.as_ptr().add(off) as *const AtomicU32) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= CTL);
        // SAFETY: as for `u32_at`, with an 8-aligned offset.
        unsafe { &*(self.base.as_ptr().add(off) as *const AtomicU64) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: CTL is within the memory (its length is CTL + cap).
        unsafe { self.base.as_ptr().add(CTL) }
    }

    /// Receiver, at creation: writes the ring's identity, the magic last
    /// (an opener that sees it sees the rest).
    pub(super) fn init(&self, cluster: u64, version: u64, epoch: u32, from: u32, to: u32) {
        self.u64_at(OFF_CLUSTER).store(cluster, Ordering::Relaxed);
        self.u64_at(OFF_VERSION).store(version, Ordering::Relaxed);
        self.u32_at(OFF_EPOCH).store(epoch, Ordering::Relaxed);
        self.u32_at(OFF_FROM).store(from, Ordering::Relaxed);
        self.u32_at(OFF_TO).store(to, Ordering::Relaxed);
        self.u32_at(OFF_CAP)
            .store(self.cap as u32, Ordering::Relaxed);
        self.u32_at(OFF_RECV_PID)
            .store(std::process::id(), Ordering::Relaxed);
        self.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
    }

    /// Sender: who made the ring, as its receiver wrote it; `None` while
    /// the receiver has not finished `init`.
    pub(super) fn identity(&self) -> Option<RingIdentity> {
        if self.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return None;
        }
        Some(RingIdentity {
            cluster: self.u64_at(OFF_CLUSTER).load(Ordering::Relaxed),
            version: self.u64_at(OFF_VERSION).load(Ordering::Relaxed),
            epoch: self.u32_at(OFF_EPOCH).load(Ordering::Relaxed),
            from: self.u32_at(OFF_FROM).load(Ordering::Relaxed),
            to: self.u32_at(OFF_TO).load(Ordering::Relaxed),
            cap: self.u32_at(OFF_CAP).load(Ordering::Relaxed),
        })
    }

    /// Sender: tells the receiver it has mapped the ring.
    pub(super) fn attach(&self) {
        self.u32_at(OFF_SEND_PID)
            .store(std::process::id(), Ordering::Relaxed);
        self.u32_at(OFF_ATTACHED).store(1, Ordering::Release);
    }

    pub(super) fn attached(&self) -> bool {
        self.u32_at(OFF_ATTACHED).load(Ordering::Acquire) != 0
    }

    pub(super) fn closed(&self) -> u32 {
        self.u32_at(OFF_CLOSED).load(Ordering::Acquire)
    }

    /// Marks one side closed and wakes whoever sleeps on the ring.
    pub(super) fn close(&self, bit: u32) {
        self.u32_at(OFF_CLOSED).fetch_or(bit, Ordering::AcqRel);
        for seq in [OFF_DATA_SEQ, OFF_SPACE_SEQ] {
            self.u32_at(seq).fetch_add(1, Ordering::AcqRel);
            futex(self.u32_at(seq), libc::FUTEX_WAKE, i32::MAX as u32, None);
        }
    }

    /// Receiver: a task of this process polls the ring (the sender need
    /// not wake the reader thread).
    pub(super) fn set_polling(&self, v: u32) {
        self.u32_at(OFF_RECV_POLLING).store(v, Ordering::SeqCst);
    }

    /// Receiver: wakes this side's own reader thread.
    pub(super) fn wake_reader(&self) {
        self.u32_at(OFF_DATA_SEQ).fetch_add(1, Ordering::AcqRel);
        futex(self.u32_at(OFF_DATA_SEQ), libc::FUTEX_WAKE, 1, None);
    }

    /// Wakes the other side if it sleeps on `seq`.
    fn notify(&self, seq: usize, sleeping: usize) {
        fence(Ordering::SeqCst);
        if self.u32_at(sleeping).load(Ordering::SeqCst) != 0
            && (seq != OFF_DATA_SEQ || self.u32_at(OFF_RECV_POLLING).load(Ordering::SeqCst) == 0)
        {
            self.u32_at(seq).fetch_add(1, Ordering::AcqRel);
            futex(self.u32_at(seq), libc::FUTEX_WAKE, 1, None);
        }
    }

    /// Waits until `ready()`; `Err` with the reason when `give_up()` says so.
    fn wait(
        &self,
        seq: usize,
        sleeping: usize,
        eager: bool,
        ready: impl Fn() -> bool,
        give_up: impl Fn() -> Option<String>,
    ) -> Result<(), String> {
        let (spins, yields) = if eager { (SPINS, YIELDS) } else { (0, 0) };
        for _ in 0..spins {
            if ready() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        for _ in 0..yields {
            if ready() {
                return Ok(());
            }
            std::thread::yield_now();
        }
        loop {
            let s = self.u32_at(seq).load(Ordering::Acquire);
            self.u32_at(sleeping).store(1, Ordering::SeqCst);
            if ready() {
                self.u32_at(sleeping).store(0, Ordering::Relaxed);
                return Ok(());
            }
            futex(self.u32_at(seq), libc::FUTEX_WAIT, s, Some(NAP));
            self.u32_at(sleeping).store(0, Ordering::Relaxed);
            if ready() {
                return Ok(());
            }
            if let Some(why) = give_up() {
                return Err(why);
            }
        }
    }

    /// Copies `src` into the ring at stream offset `at`, wrapping around.
    ///
    /// # Safety
    /// `src.len() <= cap`, and bytes `[at, at + src.len())` must be free
    /// and owned by the caller, the sender (`tail <= at` and `at + len <=
    /// tail + cap`), and stay so until it publishes them by moving `head`.
    unsafe fn copy_in(&self, at: u64, src: &[u8]) {
        let pos = (at as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - pos);
        // SAFETY: both pieces lie inside the data region (pos < cap, first
        // <= cap - pos, the rest <= cap - first); the caller owns those
        // bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(pos), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(), src.len() - first);
        }
    }

    /// Receiver: copies `dst.len()` bytes out of the ring, `skip` bytes
    /// past the snapshot's tail, without consuming them. False (nothing
    /// copied) if they are not all published.
    pub(super) fn peek(&self, p: &Published, skip: usize, dst: &mut [u8]) -> bool {
        let n = dst.len();
        if !skip.checked_add(n).is_some_and(|end| p.holds(end)) {
            return false;
        }
        let pos = (p.tail as usize).wrapping_add(skip) & (self.cap - 1);
        let first = n.min(self.cap - pos);
        // SAFETY: `n <= avail <= cap`, so both pieces lie inside the data
        // region; they are published (head was read with Acquire) and the
        // sender does not write them until `tail` passes them, which only
        // this side moves; `dst` is a live slice of `n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(pos), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data(), dst.as_mut_ptr().add(first), n - first);
        }
        true
    }

    /// Receiver: lends the `n` published bytes that start `skip` bytes
    /// past the snapshot's tail to `f`, in one or two pieces (two where
    /// they wrap around the ring's end), without consuming them. `None`
    /// (and `f` not called) if they are not all published.
    pub(super) fn lend<R>(
        &self,
        p: &Published,
        skip: usize,
        n: usize,
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        if !skip.checked_add(n).is_some_and(|end| p.holds(end)) {
            return None;
        }
        let pos = (p.tail as usize).wrapping_add(skip) & (self.cap - 1);
        let first = n.min(self.cap - pos);
        // SAFETY: as in `peek`: both pieces lie inside the data region and
        // hold published bytes, which the sender does not write until
        // `tail` passes them; `tail` moves only after `f` returns and the
        // slices are gone, and only by the holder of the receive lock.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(self.data().add(pos), first),
                std::slice::from_raw_parts(self.data(), n - first),
            )
        };
        Some(if b.is_empty() { f(&[a]) } else { f(&[a, b]) })
    }

    /// Receiver: the published bytes now, or why the indices are corrupt
    /// (more than the ring holds: `head` ahead of `tail + cap`, or behind
    /// `tail`).
    pub(super) fn published(&self) -> Result<Published, String> {
        let head = self.u64_at(OFF_HEAD).load(Ordering::Acquire);
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        let avail = head.wrapping_sub(tail);
        if avail > self.cap as u64 {
            return Err(format!("ring corrupted (head {head}, tail {tail})"));
        }
        Ok(Published {
            tail,
            avail: avail as usize,
        })
    }

    /// Receiver: whether any byte is waiting (a corrupt ring counts: the
    /// reader that looks finds out).
    pub(super) fn has_data(&self) -> bool {
        self.published().map_or(true, |p| p.avail > 0)
    }

    /// Receiver: consumes `n` bytes of the snapshot. False (nothing
    /// consumed) if they are not all published.
    pub(super) fn consume(&self, p: &Published, n: usize) -> bool {
        if !p.holds(n) {
            return false;
        }
        self.u64_at(OFF_TAIL)
            .store(p.tail.wrapping_add(n as u64), Ordering::Release);
        self.notify(OFF_SPACE_SEQ, OFF_SEND_SLEEPING);
        true
    }

    /// The indices `(head, tail)` as they are now (for the testing hook).
    pub(super) fn indices(&self) -> (u64, u64) {
        (
            self.u64_at(OFF_HEAD).load(Ordering::Acquire),
            self.u64_at(OFF_TAIL).load(Ordering::Acquire),
        )
    }

    /// Overwrites both indices, as a corrupt peer could (for the testing
    /// hook): `tail`, then `head` with Release, then wakes a sleeper.
    pub(super) fn set_indices(&self, head: u64, tail: u64) {
        self.u64_at(OFF_TAIL).store(tail, Ordering::Release);
        self.u64_at(OFF_HEAD).store(head, Ordering::Release);
        self.wake_reader();
    }

    /// Reader thread: sleeps for `d` at most (a sender may wake it sooner).
    pub(super) fn nap(&self, d: Duration) {
        let seq = self.u32_at(OFF_DATA_SEQ);
        let s = seq.load(Ordering::Acquire);
        self.u32_at(OFF_RECV_SLEEPING).store(1, Ordering::SeqCst);
        futex(seq, libc::FUTEX_WAIT, s, Some(d));
        self.u32_at(OFF_RECV_SLEEPING).store(0, Ordering::Relaxed);
    }

    /// Sender: `(head, tail, free bytes from head)`, or why the indices
    /// are corrupt.
    fn free(&self) -> Result<(u64, u64, usize), String> {
        let head = self.u64_at(OFF_HEAD).load(Ordering::Relaxed);
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if used > self.cap as u64 {
            return Err(format!("ring corrupted (head {head}, tail {tail})"));
        }
        Ok((head, tail, self.cap - used as usize))
    }

    /// Sender: appends all of `src`, waiting for space as needed.
    pub(super) fn write_all(&self, mut src: &[u8], stop: &AtomicBool) -> Result<(), String> {
        let head_w = self.u64_at(OFF_HEAD);
        let tail_w = self.u64_at(OFF_TAIL);
        let recv_pid = self.u32_at(OFF_RECV_PID).load(Ordering::Acquire);
        while !src.is_empty() {
            let (head, tail, free) = self.free()?;
            if free == 0 {
                // Wait for `tail` to move from the value that made the ring
                // full (a fresh load here could already be the receiver's
                // last move, and wait for one that never comes; Miri found
                // it).
                self.wait(
                    OFF_SPACE_SEQ,
                    OFF_SEND_SLEEPING,
                    true,
                    || tail_w.load(Ordering::Acquire) != tail,
                    || {
                        if stop.load(Ordering::Acquire) {
                            Some("endpoint stopped".into())
                        } else if self.closed() & RECEIVER_CLOSED != 0 {
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
            // free`); only this side writes them until `head` moves below.
            unsafe { self.copy_in(head, &src[..n]) };
            head_w.store(head.wrapping_add(n as u64), Ordering::Release);
            self.notify(OFF_DATA_SEQ, OFF_RECV_SLEEPING);
            src = &src[n..];
        }
        Ok(())
    }

    /// Sender: appends all of `parts` if they fit now, as one publication;
    /// false (and nothing written) if they do not, or the ring is corrupt
    /// (the caller then sends through `write_all`, which says so).
    pub(super) fn try_write(&self, parts: &[&[u8]]) -> bool {
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
            // free <= cap) and only this side writes it until `head` is
            // published below.
            unsafe { self.copy_in(at, p) };
            at = at.wrapping_add(p.len() as u64);
        }
        self.u64_at(OFF_HEAD).store(at, Ordering::Release);
        self.notify(OFF_DATA_SEQ, OFF_RECV_SLEEPING);
        true
    }

    /// Receiver: waits until data is published, the sender closed, or
    /// `give_up()` says why not. `eager` spins and yields first (for the
    /// rest of a frame); otherwise it sleeps at once (an idle reader
    /// thread: receiving tasks poll the rings themselves, and a spinning
    /// reader thread would take their cores).
    pub(super) fn wait_data(&self, stop: &AtomicBool, eager: bool) -> Result<(), String> {
        let head_w = self.u64_at(OFF_HEAD);
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        let send_pid = || self.u32_at(OFF_SEND_PID).load(Ordering::Acquire);
        self.wait(
            OFF_DATA_SEQ,
            OFF_RECV_SLEEPING,
            eager,
            || head_w.load(Ordering::Acquire) != tail || self.closed() & SENDER_CLOSED != 0,
            || {
                if stop.load(Ordering::Acquire) {
                    Some("endpoint stopped".into())
                } else if !pid_alive(send_pid()) {
                    Some(format!("sending process {} is gone", send_pid()))
                } else {
                    None
                }
            },
        )
    }

    /// Receiver: fills `dst`, waiting for data as needed. `Err(None)` is a
    /// clean end of stream (the sender closed after its last frame).
    pub(super) fn read_exact(
        &self,
        dst: &mut [u8],
        stop: &AtomicBool,
    ) -> Result<(), Option<String>> {
        let mut got = 0;
        while got < dst.len() {
            // The close flag before the head: the sender closes after its
            // last byte, so a close seen here means that byte is seen
            // below. (Head first lost a frame published just before the
            // close; Miri found it, see the tests.)
            let closed = self.closed() & SENDER_CLOSED != 0;
            let p = self.published().map_err(Some)?;
            if p.avail == 0 {
                if closed {
                    return Err(if got == 0 {
                        None
                    } else {
                        Some("ring closed in the middle of a frame".into())
                    });
                }
                self.wait_data(stop, true).map_err(Some)?;
                continue;
            }
            let n = p.avail.min(dst.len() - got);
            let copied = self.peek(&p, 0, &mut dst[got..got + n]) && self.consume(&p, n);
            debug_assert!(copied, "n <= avail");
            got += n;
        }
        Ok(())
    }

    /// Receiver: reads the next whole frame, waiting for its bytes; its
    /// payload goes into a buffer from `take(len)` (allocated only once the
    /// header, `len` included, has been checked against `max_frame`).
    /// `Err(None)` is a clean end of stream.
    pub(super) fn read_frame<B: AsMut<[u8]>>(
        &self,
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

    /// Receiver, without waiting: the next frame's header and the
    /// snapshot it was read from, if its header is published and valid.
    /// `Ok(None)`: not a whole header yet. The payload may not all be
    /// published yet (`p.holds(HEADER_LEN + len)` says).
    pub(super) fn peek_frame(
        &self,
        max_frame: usize,
    ) -> Result<Option<(Header, Published)>, String> {
        let p = self.published()?;
        let mut hb = [0u8; HEADER_LEN];
        if !self.peek(&p, 0, &mut hb) {
            return Ok(None);
        }
        let h = Header::decode(&hb, max_frame).map_err(|e| format!("protocol violation: {e}"))?;
        Ok(Some((h, p)))
    }
}

#[cfg(test)]
mod tests;
