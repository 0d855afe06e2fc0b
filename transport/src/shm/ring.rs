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
//! (`Published`) that itself is at most `cap`, headers are decoded with a
//! bound on their length before anything is allocated, and what fails a
//! check becomes an error naming the ring, reported as the peer being lost.
//! The tests at the bottom run these paths over a heap buffer, so that Miri
//! can check them (see `scripts/miri-shm.sh`).
//!
//! # Sides
//!
//! In this process at most one thread at a time may take bytes out of a
//! ring and one put bytes in: two consumers would both read the bytes
//! below `head` and both move `tail`, two producers would write the same
//! free bytes. The types say who may (`sides.rs`): `Ring::consumer`
//! returns a `Consumer` that holds the ring's consumer lock for as long as
//! it lives, and only a `Consumer` reads, lends or consumes; likewise a
//! `Producer` for writing. A `Published` snapshot borrows its `Consumer`
//! mutably and is gone once it consumes, so bytes it lends are never ones
//! the producer may already be overwriting. What needs no lock (whether
//! data is waiting, the flags, the wake-ups) stays on [`Ring`].

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use memmap2::MmapMut;

/// v2: the cluster version (u64 at `OFF_VERSION`) joined the identity.
/// v3: the seal (a nonce and a MAC keyed by the job secret, at
/// `OFF_SEAL`). v4: the lane (`lane.rs`) after the data region. v5: lane
/// slots of 256 KiB.
const MAGIC: u64 = u64::from_le_bytes(*b"KFSHMv5\0");
/// Bytes of a ring's seal: a nonce, then the creator's MAC over the
/// identity and the nonce (all zeros: unsealed, a job without a secret).
pub(super) const SEAL_LEN: usize = 64;
/// Bytes before the data region (control words on their own cache lines).
pub(super) const CTL: usize = 4096;

/// Bytes of a ring's file: the control page, `cap` data bytes, then the
/// lane of small contributions (`lane.rs`).
pub(super) const fn file_len(cap: usize) -> usize {
    CTL + cap + super::lane::LANE_LEN
}
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
    /// The creator's seal (see `files::seal`).
    pub(super) seal: [u8; SEAL_LEN],
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
const OFF_SEAL: usize = 512;
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
    Map(MmapMut),
    /// A heap buffer, so that tests can run the protocol under Miri, which
    /// cannot map files.
    #[cfg(test)]
    Heap(std::alloc::Layout),
}

/// One ring, mapped (or, in tests, on the heap).
pub(super) struct Ring {
    /// Start of the control page; `file_len(cap)` bytes are valid from here
    /// for as long as `mem` lives.
    base: NonNull<u8>,
    /// Private: every bound below is computed from it.
    cap: usize,
    /// Held by the one `Consumer`: the ring's reader thread, or a
    /// receiving task that polls the ring itself.
    consumer: Mutex<()>,
    /// Held by the one `Producer`: the ring's writer thread for a whole
    /// (possibly waiting) frame, or a sender that writes a frame that fits
    /// at once, without a thread hand-off.
    producer: Mutex<()>,
    mem: Backing,
}

// SAFETY: `base` points into `mem`, which the ring owns and never moves or
// frees before it is dropped; every access through it is an atomic (the
// control words) or a copy of a byte range that the SPSC protocol gives to
// one side at a time (the data region). A mapping may be used from any
// thread.
unsafe impl Send for Ring {}
// SAFETY: as for `Send`: shared access goes through atomics, and the data
// region is touched only by a `Producer` or a `Consumer` (and their
// `Published` snapshots), each of which holds its side's lock, so in this
// process one thread at a time plays each side of the SPSC protocol.
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

impl Ring {
    /// A ring over `map`, which must be `file_len(cap)` bytes.
    pub(super) fn new(mut map: MmapMut, cap: usize) -> Ring {
        // What makes every access below in bounds: checked, not assumed.
        assert!(cap.is_power_of_two() && map.len() == file_len(cap));
        let base = NonNull::new(map.as_mut_ptr()).expect("mappings are not null");
        // SAFETY: `base` is the start of `map`, `file_len(cap)` bytes (checked
        // above), which the ring will own.
        unsafe { Ring::over(base, cap, Backing::Map(map)) }
    }

    /// # Safety
    ///
    /// `base` is the start of `file_len(cap)` bytes of `mem`, aligned to a page,
    /// that stay valid and in place until the ring is dropped; `cap` is a
    /// power of two.
    unsafe fn over(base: NonNull<u8>, cap: usize, mem: Backing) -> Ring {
        Ring {
            base,
            cap,
            consumer: Mutex::new(()),
            producer: Mutex::new(()),
            mem,
        }
    }

    /// A zeroed ring on the heap (Miri cannot map files).
    #[cfg(test)]
    pub(super) fn heap(cap: usize) -> Ring {
        assert!(cap.is_power_of_two());
        let layout = std::alloc::Layout::from_size_align(file_len(cap), 4096).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: `p` is `file_len(cap)` bytes, 4096-aligned, freed only in
        // `drop` with this layout; `cap` is a power of two (checked above).
        unsafe { Ring::over(base, cap, Backing::Heap(layout)) }
    }

    /// Faults the mapping's pages in, writably, `piece` bytes per call
    /// (see `files::populate_on_thread`). Only the kernel touches the
    /// memory (`MADV_POPULATE_WRITE` keeps its contents), so this needs no
    /// side. The mapping itself stays private: as a `&MmapMut` it would
    /// give safe code a plain `&[u8]` of memory the other side writes.
    pub(super) fn populate(&self, piece: usize) {
        match &self.mem {
            Backing::Map(m) => {
                let len = m.len();
                for off in (0..len).step_by(piece.max(1)) {
                    let _ =
                        m.advise_range(memmap2::Advice::PopulateWrite, off, piece.min(len - off));
                }
            }
            #[cfg(test)]
            Backing::Heap(_) => {}
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
        // SAFETY: CTL is within the memory (its length is file_len(cap)).
        unsafe { self.base.as_ptr().add(CTL) }
    }

    /// Data bytes of the ring: a frame (header included) larger than this
    /// never goes whole; the writer thread streams it.
    pub(super) fn capacity(&self) -> usize {
        self.cap
    }

    /// Start of the lane: `lane::LANE_LEN` bytes, 4096-aligned (`CTL` and
    /// `cap` are multiples of a page), valid as long as the ring.
    pub(super) fn lane(&self) -> NonNull<u8> {
        // SAFETY: CTL + cap is within the memory (its length is
        // file_len(cap) = CTL + cap + LANE_LEN).
        unsafe { NonNull::new_unchecked(self.base.as_ptr().add(CTL + self.cap)) }
    }

    /// Receiver, at creation: writes the ring's identity, the magic last
    /// (an opener that sees it sees the rest).
    pub(super) fn init(&self, id: &RingIdentity) {
        let RingIdentity {
            cluster,
            version,
            epoch,
            from,
            to,
            cap: _,
            seal,
        } = *id;
        for (i, word) in seal.chunks_exact(8).enumerate() {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            self.u64_at(OFF_SEAL + 8 * i).store(w, Ordering::Relaxed);
        }
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
            seal: std::array::from_fn(|i| {
                let w = self.u64_at(OFF_SEAL + 8 * (i / 8)).load(Ordering::Relaxed);
                w.to_le_bytes()[i % 8]
            }),
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

    /// `(tail, published bytes from tail)` now, or why the indices are
    /// corrupt (more than the ring holds: `head` ahead of `tail + cap`, or
    /// behind `tail`). Lock-free: only a `Consumer` acts on it.
    fn snapshot(&self) -> Result<(u64, usize), String> {
        let head = self.u64_at(OFF_HEAD).load(Ordering::Acquire);
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        let avail = head.wrapping_sub(tail);
        if avail > self.cap as u64 {
            return Err(format!("ring corrupted (head {head}, tail {tail})"));
        }
        Ok((tail, avail as usize))
    }

    /// Receiver: whether any byte is waiting (a corrupt ring counts: the
    /// reader that looks finds out). Needs no side: it only looks.
    pub(super) fn has_data(&self) -> bool {
        self.snapshot().map_or(true, |(_, avail)| avail > 0)
    }

    /// The indices `(head, tail)` as they are now (for the testing hook).
    pub(super) fn indices(&self) -> (u64, u64) {
        (
            self.u64_at(OFF_HEAD).load(Ordering::Acquire),
            self.u64_at(OFF_TAIL).load(Ordering::Acquire),
        )
    }

    /// Reader thread: sleeps for `d` at most (a sender may wake it sooner).
    pub(super) fn nap(&self, d: Duration) {
        let seq = self.u32_at(OFF_DATA_SEQ);
        let s = seq.load(Ordering::Acquire);
        self.u32_at(OFF_RECV_SLEEPING).store(1, Ordering::SeqCst);
        futex(seq, libc::FUTEX_WAIT, s, Some(d));
        self.u32_at(OFF_RECV_SLEEPING).store(0, Ordering::Relaxed);
    }

    /// Receiver: waits until data is published, the sender closed, or
    /// `give_up()` says why not. `eager` spins and yields first (for the
    /// rest of a frame); otherwise it sleeps at once (an idle reader
    /// thread: receiving tasks poll the rings themselves, and a spinning
    /// reader thread would take their cores). Needs no side: it only
    /// looks, and a reader thread waits here without the consumer lock, so
    /// that receiving tasks may take frames meanwhile.
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
}

mod sides;

#[cfg(test)]
mod tests;
