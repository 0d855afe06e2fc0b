//! Shared-memory backend, for ranks on one host.
//!
//! Every ordered pair of ranks `s -> r` has a single-producer,
//! single-consumer byte ring in a file under `/dev/shm`, created by the
//! receiver and mapped by both. Frames (the same [`Header`] + payload as
//! TCP) are streamed through it, so a frame may be larger than the ring.
//! A sender copies into the ring straight from the op's buffer
//! ([`Transport::try_send_now`]; a frame that does not fit waits in that
//! buffer, not in a copy, see [`Transport::sends_in_place`]). A receiving
//! task that polls the rings takes a frame of its op in place
//! ([`Transport::recv_in_place`]): the plan reduces or copies it straight
//! out of the ring into the op's buffer, so a byte is copied once on its
//! way (the reduction reads it where the sender put it). Frames that
//! arrive while no task polls, or ahead of what the plan can take, are
//! copied out into owned buffers by a reader thread per ring, or by the
//! polling task, as before.
//!
//! Idle reader threads leave the rings to a task that polled them within
//! the last `DEFER_TO_POLLER`, and spin before sleeping only when every
//! rank has a core.
//!
//! # Waiting
//!
//! A side that finds the ring empty (or full) spins briefly, then yields,
//! then sleeps on a futex in the shared page; the other side wakes it only
//! when the sleeping flag is set, so a busy pipeline makes no system calls.
//! Sleeps are bounded (a few ms) so that a stop request, a closed ring, or a
//! peer process that died (its pid is in the ring header) is noticed.
//!
//! # Lifetime of the files
//!
//! The receiver unlinks a ring's file as soon as the sender has attached,
//! so nothing is left in `/dev/shm` after a job, even one that crashes
//! later; a job that fails before that point removes what it created.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use memmap2::MmapMut;
use tokio::sync::oneshot;

use crate::mailbox::{Mailbox, Pump};
use crate::pool::FramePool;
use crate::{
    Capabilities, Epoch, Frame, Header, Instant, OpTag, PeerSet, Transport, TransportError,
    HEADER_LEN,
};

const MAGIC: u64 = u64::from_le_bytes(*b"KFSHMv1\0");
/// Bytes before the data region (control words on their own cache lines).
const CTL: usize = 4096;
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
const OFF_HEAD: usize = 64;
const OFF_TAIL: usize = 128;
const OFF_DATA_SEQ: usize = 192;
const OFF_RECV_SLEEPING: usize = 196;
/// Non-zero while a receiving task of the receiver polls its rings itself:
/// the sender then does not wake the reader thread.
const OFF_RECV_POLLING: usize = 200;
const OFF_SPACE_SEQ: usize = 256;
const OFF_SEND_SLEEPING: usize = 260;
const SENDER_CLOSED: u32 = 1;
const RECEIVER_CLOSED: u32 = 2;

/// How a waiting side spins before it yields, and yields before it sleeps.
/// Measured with kungfu-bench on 2 cores, 2 and 4 ranks: no spinning gave
/// 113/214 us per 4-byte allreduce, 4000 spins and 16 yields 260/680 us
/// (spinners starve the ranks they wait for), 200 spins and 2 yields
/// 110/203 us and the best large-message bandwidth.
const SPINS: u32 = 200;
const YIELDS: u32 = 2;
/// A reader thread leaves frames to the receiving tasks for this long after
/// they last polled the rings.
const DEFER_TO_POLLER: Duration = Duration::from_micros(300);
/// Idle receive buffers kept for reuse (see [`FramePool`]).
const FRAME_POOL_BYTES: usize = 256 << 20;
/// Longest single sleep, so stops, closes and dead peers are noticed.
const NAP: Duration = Duration::from_millis(5);

/// Settings of a shared-memory endpoint.
#[derive(Clone)]
pub struct ShmConfig {
    pub cluster_id: u64,
    pub epoch: Epoch,
    pub rank: Rank,
    /// The number of ranks in the cluster.
    pub size: usize,
    /// The ranks reached through shared memory (this host's, this rank
    /// included); `None`: all of them.
    pub local: Option<PeerSet>,
    /// A mailbox shared with another backend (see [`crate::hybrid`]).
    pub mailbox: Option<Arc<Mailbox>>,
    /// Data bytes of each ring (rounded up to a power of two, at least 4 KiB).
    pub ring_bytes: usize,
    pub max_frame: usize,
    pub mailbox_bytes: usize,
    pub connect_timeout: Duration,
    /// Where the ring files live (`/dev/shm`).
    pub dir: PathBuf,
    /// How long a receive polls the rings itself (yielding to other tasks
    /// in between) before it sleeps until the reader thread wakes it.
    pub spin: Duration,
}

impl ShmConfig {
    /// Defaults: 4 MiB rings in `/dev/shm`, 64 MiB frames, a 256 MiB
    /// mailbox, 30 s to connect.
    pub fn new(cluster_id: u64, epoch: Epoch, rank: Rank, size: usize) -> ShmConfig {
        ShmConfig {
            cluster_id,
            epoch,
            rank,
            size,
            local: None,
            mailbox: None,
            ring_bytes: 4 << 20,
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            connect_timeout: Duration::from_secs(30),
            dir: PathBuf::from("/dev/shm"),
            spin: Duration::from_micros(50),
        }
    }
}

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

fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid == std::process::id() {
        return true;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the
    // process exists (ESRCH when it does not).
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// When a receiving task of this process last polled the inbound rings.
struct PollClock {
    start: std::time::Instant,
    /// Nanoseconds after `start`.
    at: AtomicU64,
}

impl PollClock {
    fn new() -> PollClock {
        PollClock {
            start: std::time::Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn touch(&self) {
        self.at.store(self.now(), Ordering::Relaxed);
    }

    /// No task polls any more (one went to sleep): readers take over now.
    fn clear(&self) {
        self.at.store(0, Ordering::Relaxed);
    }

    /// Time since the last poll (long if there was none).
    fn since(&self) -> Duration {
        match self.at.load(Ordering::Relaxed) {
            0 => Duration::MAX,
            at => Duration::from_nanos(self.now().saturating_sub(at)),
        }
    }
}

/// One mapped ring file.
struct Ring {
    map: MmapMut,
    cap: usize,
}

impl Ring {
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= CTL);
        // SAFETY: the mapping is page-aligned and at least CTL bytes long;
        // `off` is a multiple of 4 inside the control page, and every
        // access to these words, by either process, is atomic.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU32) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= CTL);
        // SAFETY: as for `u32_at`, with an 8-aligned offset.
        unsafe { &*(self.map.as_ptr().add(off) as *const AtomicU64) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: CTL is within the mapping (its length is CTL + cap).
        unsafe { self.map.as_ptr().add(CTL) as *mut u8 }
    }

    fn closed(&self) -> u32 {
        self.u32_at(OFF_CLOSED).load(Ordering::Acquire)
    }

    /// Marks one side closed and wakes whoever sleeps on the ring.
    fn close(&self, bit: u32) {
        self.u32_at(OFF_CLOSED).fetch_or(bit, Ordering::AcqRel);
        for seq in [OFF_DATA_SEQ, OFF_SPACE_SEQ] {
            self.u32_at(seq).fetch_add(1, Ordering::AcqRel);
            futex(self.u32_at(seq), libc::FUTEX_WAKE, i32::MAX as u32, None);
        }
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
    /// Bytes `[at, at + src.len())` must be free and owned by the caller,
    /// the sender (`tail <= at` and `at + len <= tail + cap`), and stay so
    /// until it publishes them by moving `head`.
    unsafe fn copy_in(&self, at: u64, src: &[u8]) {
        let pos = (at as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - pos);
        // SAFETY: both pieces lie inside the data region (pos < cap, first
        // <= cap - pos, the rest < cap); the caller owns those bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(pos), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(), src.len() - first);
        }
    }

    /// Copies `n` bytes out of the ring at stream offset `at` into `dst`.
    ///
    /// # Safety
    /// Bytes `[at, at + n)` must be published (`at + n <= head`, read with
    /// Acquire) and not yet consumed, and `dst` valid for `n` writes.
    unsafe fn copy_out_raw(&self, at: u64, dst: *mut u8, n: usize) {
        let pos = (at as usize) & (self.cap - 1);
        let first = n.min(self.cap - pos);
        // SAFETY: both pieces lie inside the data region; the sender does
        // not touch published bytes until `tail` passes them; `dst` is
        // valid for `n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(pos), dst, first);
            std::ptr::copy_nonoverlapping(self.data(), dst.add(first), n - first);
        }
    }

    /// Receiver: lends the `n` published bytes that start `skip` bytes
    /// past `tail` to `f`, in one or two pieces (two where they wrap
    /// around the ring's end), without consuming them.
    ///
    /// The caller holds the ring's receive lock (no one else consumes) and
    /// checked that `skip + n` bytes are published.
    fn lend<R>(&self, skip: usize, n: usize, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        debug_assert!(skip + n <= self.available());
        let pos = ((tail as usize).wrapping_add(skip)) & (self.cap - 1);
        let first = n.min(self.cap - pos);
        // SAFETY: both pieces lie inside the data region and hold published
        // bytes (`head` was read with Acquire by `available`), which the
        // sender does not write until `tail` passes them; `tail` moves only
        // after `f` returns and the slices are gone, and only by the lock
        // holder, which is us.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(self.data().add(pos), first),
                std::slice::from_raw_parts(self.data(), n - first),
            )
        };
        if b.is_empty() {
            f(&[a])
        } else {
            f(&[a, b])
        }
    }

    /// Reader thread: sleeps for `d` at most (a sender may wake it sooner).
    fn nap(&self, d: Duration) {
        let seq = self.u32_at(OFF_DATA_SEQ);
        let s = seq.load(Ordering::Acquire);
        self.u32_at(OFF_RECV_SLEEPING).store(1, Ordering::SeqCst);
        futex(seq, libc::FUTEX_WAIT, s, Some(d));
        self.u32_at(OFF_RECV_SLEEPING).store(0, Ordering::Relaxed);
    }

    /// Receiver: consumes `n` published bytes without reading them.
    fn skip(&self, n: usize) {
        let tail_w = self.u64_at(OFF_TAIL);
        let tail = tail_w.load(Ordering::Relaxed);
        debug_assert!(n <= self.available());
        tail_w.store(tail + n as u64, Ordering::Release);
        self.notify(OFF_SPACE_SEQ, OFF_SEND_SLEEPING);
    }

    /// Sender: appends all of `src`, waiting for space as needed.
    fn write_all(&self, mut src: &[u8], stop: &AtomicBool) -> Result<(), String> {
        let head_w = self.u64_at(OFF_HEAD);
        let tail_w = self.u64_at(OFF_TAIL);
        let recv_pid = self.u32_at(OFF_RECV_PID).load(Ordering::Acquire);
        while !src.is_empty() {
            let head = head_w.load(Ordering::Relaxed);
            let tail = tail_w.load(Ordering::Acquire);
            let used = head.wrapping_sub(tail) as usize;
            if used > self.cap {
                return Err(format!("ring corrupted (head {head}, tail {tail})"));
            }
            let free = self.cap - used;
            if free == 0 {
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
            // SAFETY: bytes [head, head + n) are free (the receiver consumed
            // everything below `tail`, and `n <= free`); only this side
            // writes them until `head` moves below.
            unsafe { self.copy_in(head, &src[..n]) };
            head_w.store(head + n as u64, Ordering::Release);
            self.notify(OFF_DATA_SEQ, OFF_RECV_SLEEPING);
            src = &src[n..];
        }
        Ok(())
    }

    /// Sender: appends all of `parts` if they fit now, as one publication;
    /// false (and nothing written) if they do not.
    fn try_write(&self, parts: &[&[u8]]) -> bool {
        let head_w = self.u64_at(OFF_HEAD);
        let head = head_w.load(Ordering::Relaxed);
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail) as usize;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if used > self.cap || self.cap - used < total {
            return false;
        }
        let mut at = head;
        for p in parts {
            // SAFETY: [head, head + total) is free (checked above) and only
            // this side writes it until `head` is published below.
            unsafe { self.copy_in(at, p) };
            at += p.len() as u64;
        }
        head_w.store(at, Ordering::Release);
        self.notify(OFF_DATA_SEQ, OFF_RECV_SLEEPING);
        true
    }

    /// Receiver: bytes published and not yet consumed.
    fn available(&self) -> usize {
        let head = self.u64_at(OFF_HEAD).load(Ordering::Acquire);
        let tail = self.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        head.wrapping_sub(tail) as usize
    }

    /// Receiver: copies the next `dst.len()` published bytes without
    /// consuming them (the caller checked `available()`), and consumes
    /// them too if `consume`.
    fn copy_out(&self, dst: &mut [u8], consume: bool) {
        let tail_w = self.u64_at(OFF_TAIL);
        let tail = tail_w.load(Ordering::Relaxed);
        let n = dst.len();
        debug_assert!(n <= self.available());
        // SAFETY: the caller checked that `n` bytes are published; `dst`
        // is a live slice of `n` bytes.
        unsafe { self.copy_out_raw(tail, dst.as_mut_ptr(), n) };
        if consume {
            tail_w.store(tail + n as u64, Ordering::Release);
            self.notify(OFF_SPACE_SEQ, OFF_SEND_SLEEPING);
        }
    }

    /// Receiver: waits until data is published, the sender closed, or
    /// `give_up()` says why not. `eager` spins and yields first (for the
    /// rest of a frame); otherwise it sleeps at once (an idle reader
    /// thread: receiving tasks poll the rings themselves, and a spinning
    /// reader thread would take their cores).
    fn wait_data(&self, stop: &AtomicBool, eager: bool) -> Result<(), String> {
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
    fn read_exact(&self, dst: &mut [u8], stop: &AtomicBool) -> Result<(), Option<String>> {
        let head_w = self.u64_at(OFF_HEAD);
        let tail_w = self.u64_at(OFF_TAIL);
        let mut got = 0;
        while got < dst.len() {
            let tail = tail_w.load(Ordering::Relaxed);
            let head = head_w.load(Ordering::Acquire);
            let avail = head.wrapping_sub(tail) as usize;
            if avail > self.cap {
                return Err(Some(format!("ring corrupted (head {head}, tail {tail})")));
            }
            if avail == 0 {
                if self.closed() & SENDER_CLOSED != 0 {
                    return Err(if got == 0 {
                        None
                    } else {
                        Some("ring closed in the middle of a frame".into())
                    });
                }
                self.wait_data(stop, true).map_err(Some)?;
                continue;
            }
            let n = avail.min(dst.len() - got);
            // SAFETY: `n <= head - tail` bytes are published (head read with
            // Acquire); `dst[got..got + n]` is ours.
            unsafe { self.copy_out_raw(tail, dst.as_mut_ptr().add(got), n) };
            tail_w.store(tail + n as u64, Ordering::Release);
            self.notify(OFF_SPACE_SEQ, OFF_SEND_SLEEPING);
            got += n;
        }
        Ok(())
    }
}

fn ring_path(dir: &Path, cluster: u64, epoch: Epoch, from: Rank, to: Rank) -> PathBuf {
    dir.join(format!(
        "kungfu-{cluster:016x}-{}-{}-{}",
        epoch.0, from.0, to.0
    ))
}

/// Removes the ring files this endpoint created if connecting fails.
struct Created(Vec<PathBuf>);

impl Drop for Created {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn map_file(file: &std::fs::File, len: usize) -> std::io::Result<MmapMut> {
    // SAFETY: the file is a ring of this job, mapped shared by exactly two
    // processes that access it only through atomics and the SPSC protocol
    // (see `Ring`); nobody truncates it while mapped.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(file) }?;
    Ok(map)
}

fn create_inbound(
    cfg: &ShmConfig,
    cap: usize,
    from: Rank,
    created: &mut Created,
) -> Result<Ring, String> {
    let path = ring_path(&cfg.dir, cfg.cluster_id, cfg.epoch, from, cfg.rank);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("create {}: {e}", path.display()))?;
    created.0.push(path.clone());
    file.set_len((CTL + cap) as u64)
        .map_err(|e| format!("size {}: {e}", path.display()))?;
    let map = map_file(&file, CTL + cap).map_err(|e| format!("map {}: {e}", path.display()))?;
    let ring = Ring { map, cap };
    ring.u64_at(OFF_CLUSTER)
        .store(cfg.cluster_id, Ordering::Relaxed);
    ring.u32_at(OFF_EPOCH).store(cfg.epoch.0, Ordering::Relaxed);
    ring.u32_at(OFF_FROM).store(from.0, Ordering::Relaxed);
    ring.u32_at(OFF_TO).store(cfg.rank.0, Ordering::Relaxed);
    ring.u32_at(OFF_CAP).store(cap as u32, Ordering::Relaxed);
    ring.u32_at(OFF_RECV_PID)
        .store(std::process::id(), Ordering::Relaxed);
    // The magic last: an opener that sees it sees the whole header.
    ring.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
    Ok(ring)
}

fn open_outbound(
    cfg: &ShmConfig,
    cap: usize,
    to: Rank,
    deadline: std::time::Instant,
) -> Result<Ring, String> {
    let path = ring_path(&cfg.dir, cfg.cluster_id, cfg.epoch, cfg.rank, to);
    let mut nap = Duration::from_micros(250);
    loop {
        if let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) {
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            if len == (CTL + cap) as u64 {
                let map = map_file(&file, CTL + cap)
                    .map_err(|e| format!("map {}: {e}", path.display()))?;
                let ring = Ring { map, cap };
                if ring.u64_at(OFF_MAGIC).load(Ordering::Acquire) == MAGIC {
                    let check = [
                        (
                            ring.u32_at(OFF_EPOCH).load(Ordering::Relaxed),
                            cfg.epoch.0,
                            "epoch",
                        ),
                        (
                            ring.u32_at(OFF_FROM).load(Ordering::Relaxed),
                            cfg.rank.0,
                            "sender rank",
                        ),
                        (
                            ring.u32_at(OFF_TO).load(Ordering::Relaxed),
                            to.0,
                            "receiver rank",
                        ),
                        (
                            ring.u32_at(OFF_CAP).load(Ordering::Relaxed),
                            cap as u32,
                            "ring size",
                        ),
                    ];
                    if ring.u64_at(OFF_CLUSTER).load(Ordering::Relaxed) != cfg.cluster_id {
                        return Err(format!("{}: another cluster's ring", path.display()));
                    }
                    if let Some((got, want, what)) = check.iter().find(|(g, w, _)| g != w) {
                        return Err(format!(
                            "{}: {what} is {got}, expected {want}",
                            path.display()
                        ));
                    }
                    ring.u32_at(OFF_SEND_PID)
                        .store(std::process::id(), Ordering::Relaxed);
                    ring.u32_at(OFF_ATTACHED).store(1, Ordering::Release);
                    return Ok(ring);
                }
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(format!(
                "{} did not appear before the deadline",
                path.display()
            ));
        }
        std::thread::sleep(nap);
        // Short naps: a job that resizes waits here for its new peers, and
        // each nap is latency (an open that fails costs a few us).
        nap = (nap * 2).min(Duration::from_millis(2));
    }
}

enum WriterMsg {
    Frame(
        [u8; HEADER_LEN],
        Bytes,
        oneshot::Sender<Result<(), TransportError>>,
    ),
    Finish(oneshot::Sender<()>),
}

/// A shared-memory endpoint. Build with [`ShmTransport::connect`].
pub struct ShmTransport {
    rank: Rank,
    size: usize,
    max_frame: usize,
    mailbox: Arc<Mailbox>,
    writers: Vec<Option<std_mpsc::Sender<WriterMsg>>>,
    inbound: Vec<Option<Arc<Ring>>>,
    outbound: Vec<Option<Arc<Ring>>>,
    /// Held while a frame is being written into a ring: by the writer
    /// thread for a whole (possibly waiting) frame, or by a sender that
    /// writes a frame that fits at once, without a thread hand-off.
    out_locks: Vec<Arc<std::sync::Mutex<()>>>,
    /// Held while a frame is taken out of an inbound ring: by its reader
    /// thread, or by a receiving task that polls the rings itself.
    in_locks: Vec<Arc<std::sync::Mutex<()>>>,
    /// How long a receive polls the rings itself before it sleeps.
    spin: Duration,
    /// More ranks on this host than cores.
    oversubscribed: bool,
    /// Receiving tasks polling the inbound rings now (see
    /// `OFF_RECV_POLLING`).
    polling: std::sync::atomic::AtomicUsize,
    stop: Arc<AtomicBool>,
    readers_done: Vec<Arc<AtomicBool>>,
    /// Frames consumed in place (see [`Transport::recv_in_place`]).
    lent: AtomicU64,
    polled: Arc<PollClock>,
    /// Buffers for frames copied out of the rings.
    frames: Arc<FramePool>,
}

impl ShmTransport {
    /// Creates this rank's inbound rings, attaches to every peer's, and
    /// starts one reader and one writer thread per peer. Every rank of the
    /// cluster must be on this host and call this with the same cluster id
    /// and epoch.
    pub async fn connect(cfg: ShmConfig) -> Result<Arc<ShmTransport>, TransportError> {
        let n = cfg.size;
        if cfg.rank.idx() >= n {
            return Err(TransportError::NoSuchPeer {
                peer: cfg.rank,
                size: n,
            });
        }
        let cap = cfg.ring_bytes.max(4096).next_power_of_two();
        if cap > u32::MAX as usize {
            return Err(TransportError::Handshake {
                peer: None,
                addr: cfg.dir.display().to_string(),
                reason: format!("ring of {cap} bytes is too large"),
            });
        }
        let cfg2 = cfg.clone();
        let (inbound, outbound) = tokio::task::spawn_blocking(move || setup(&cfg2, cap))
            .await
            .map_err(|e| TransportError::Handshake {
                peer: None,
                addr: cfg.dir.display().to_string(),
                reason: format!("setup task: {e}"),
            })??;
        let mailbox = cfg
            .mailbox
            .clone()
            .unwrap_or_else(|| Arc::new(Mailbox::new(cfg.epoch, cfg.mailbox_bytes)));
        let stop = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::with_capacity(n);
        let mut readers_done = Vec::with_capacity(n);
        let out_locks: Vec<Arc<std::sync::Mutex<()>>> = (0..n)
            .map(|_| Arc::new(std::sync::Mutex::new(())))
            .collect();
        for (peer, ring) in outbound.iter().enumerate() {
            let Some(ring) = ring.clone() else {
                writers.push(None);
                continue;
            };
            let (tx, rx) = std_mpsc::channel();
            writers.push(Some(tx));
            let (mb, stop, lock) = (mailbox.clone(), stop.clone(), out_locks[peer].clone());
            let peer = Rank(peer as u32);
            std::thread::Builder::new()
                .name(format!("kungfu-shm-w{}", peer.0))
                .spawn(move || write_loop(&ring, &lock, peer, &rx, &mb, &stop))
                .map_err(|e| TransportError::Handshake {
                    peer: Some(peer),
                    addr: String::new(),
                    reason: format!("writer thread: {e}"),
                })?;
        }
        let in_locks: Vec<Arc<std::sync::Mutex<()>>> = (0..n)
            .map(|_| Arc::new(std::sync::Mutex::new(())))
            .collect();
        let oversubscribed =
            cfg.local.as_ref().map_or(n, |l| l.iter().count()) > crate::host_cpus();
        // An idle reader thread spins before it sleeps only when every
        // rank has a core: then a sleeping reader costs its sender a wake-up
        // system call per frame that arrives between ops (2 ranks, 4 bytes:
        // 3-8 us with spinning, 12-20 without), while with more ranks than
        // cores spinning readers take the cores the ranks need (4 ranks:
        // 45-100 us with, 21-59 without).
        let eager = !oversubscribed;
        let polled = Arc::new(PollClock::new());
        let frames = FramePool::new(FRAME_POOL_BYTES);
        for (peer, ring) in inbound.iter().enumerate() {
            let Some(ring) = ring.clone() else { continue };
            let done = Arc::new(AtomicBool::new(false));
            readers_done.push(done.clone());
            let (mb, stop, lock) = (mailbox.clone(), stop.clone(), in_locks[peer].clone());
            let peer = Rank(peer as u32);
            let policy = ReadPolicy {
                max_frame: cfg.max_frame,
                frames: frames.clone(),
                eager,
                polled: polled.clone(),
            };
            std::thread::Builder::new()
                .name(format!("kungfu-shm-r{}", peer.0))
                .spawn(move || {
                    read_loop(&ring, &lock, peer, &mb, &stop, &policy);
                    done.store(true, Ordering::Release);
                })
                .map_err(|e| TransportError::Handshake {
                    peer: Some(peer),
                    addr: String::new(),
                    reason: format!("reader thread: {e}"),
                })?;
        }
        Ok(Arc::new(ShmTransport {
            rank: cfg.rank,
            size: n,
            max_frame: cfg.max_frame,
            mailbox,
            writers,
            inbound,
            outbound,
            out_locks,
            in_locks,
            spin: cfg.spin,
            oversubscribed,
            stop,
            readers_done,
            polling: std::sync::atomic::AtomicUsize::new(0),
            lent: AtomicU64::new(0),
            polled,
            frames,
        }))
    }
}

type Rings = Vec<Option<Arc<Ring>>>;

fn setup(cfg: &ShmConfig, cap: usize) -> Result<(Rings, Rings), TransportError> {
    let n = cfg.size;
    let deadline = std::time::Instant::now() + cfg.connect_timeout;
    let fail = |peer: Option<Rank>, reason: String| TransportError::Handshake {
        peer,
        addr: cfg.dir.display().to_string(),
        reason,
    };
    let mut created = Created(Vec::new());
    let peer = |j: usize| {
        j != cfg.rank.idx()
            && cfg
                .local
                .as_ref()
                .is_none_or(|l| l.contains(Rank(j as u32)))
    };
    let mut inbound: Rings = vec![None; n];
    for (j, slot) in inbound.iter_mut().enumerate().filter(|(j, _)| peer(*j)) {
        let ring = create_inbound(cfg, cap, Rank(j as u32), &mut created)
            .map_err(|e| fail(Some(Rank(j as u32)), e))?;
        *slot = Some(Arc::new(ring));
    }
    let mut outbound: Rings = vec![None; n];
    for (j, slot) in outbound.iter_mut().enumerate().filter(|(j, _)| peer(*j)) {
        let ring = open_outbound(cfg, cap, Rank(j as u32), deadline)
            .map_err(|e| fail(Some(Rank(j as u32)), e))?;
        *slot = Some(Arc::new(ring));
    }
    for (j, ring) in inbound.iter().enumerate() {
        let Some(ring) = ring else { continue };
        while ring.u32_at(OFF_ATTACHED).load(Ordering::Acquire) == 0 {
            if std::time::Instant::now() >= deadline {
                return Err(fail(
                    Some(Rank(j as u32)),
                    "did not attach to its ring before the deadline".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Every ring is mapped by both sides: the names are no longer needed.
    drop(created);
    populate_in_background(inbound.iter().chain(&outbound).flatten().cloned().collect());
    Ok((inbound, outbound))
}

/// Faults every page of the rings in, writably, on a thread of its own:
/// a fresh ring's pages are otherwise allocated and zeroed one fault at a
/// time during the first lap of traffic (measured: the first ~50
/// allreduces of 64 KiB on 2 ranks took 90-180 us instead of 15), while
/// doing it before returning made connecting slow (4 ranks on 2 cores:
/// 15-20 ms to zero their 4 MiB rings, most of an elastic resize). Even
/// in the background it is most of what a resize costs here: 2 -> 4 -> 3
/// -> 1 -> 3 took 9-11 ms per resize on average with it, 2-3 ms without.
fn populate_in_background(rings: Vec<Arc<Ring>>) {
    let _ = std::thread::Builder::new()
        .name("kungfu-shm-populate".into())
        .spawn(move || {
            // Lowest priority: connecting and the first ops come first.
            // SAFETY: gettid and setpriority take no pointers; this only
            // changes this thread's nice value.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, 19);
            }
            // In pieces: populating holds the process's memory-map lock,
            // which spawning a thread (its stack) also needs.
            const PIECE: usize = 256 << 10;
            for r in rings {
                let len = r.map.len();
                for off in (0..len).step_by(PIECE) {
                    let _ = r.map.advise_range(
                        memmap2::Advice::PopulateWrite,
                        off,
                        PIECE.min(len - off),
                    );
                }
            }
        });
}

/// Runs a future to completion on this (non-runtime) thread.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// How an idle reader thread behaves.
#[derive(Clone)]
struct ReadPolicy {
    max_frame: usize,
    frames: Arc<FramePool>,
    /// Spin before sleeping (ranks have a core each).
    eager: bool,
    polled: Arc<PollClock>,
}

fn read_loop(
    ring: &Ring,
    lock: &std::sync::Mutex<()>,
    peer: Rank,
    mailbox: &Mailbox,
    stop: &AtomicBool,
    policy: &ReadPolicy,
) {
    let (max_frame, eager, polled) = (policy.max_frame, policy.eager, &policy.polled);
    loop {
        // Wait without the lock, so receivers may take frames themselves.
        if ring.available() == 0 {
            if ring.closed() & SENDER_CLOSED != 0 {
                return mailbox.fail_peer(peer, "connection closed by peer");
            }
            if let Err(why) = ring.wait_data(stop, eager) {
                return mailbox.fail_peer(peer, why);
            }
            continue;
        }
        // A receiving task that polled the rings lately takes the frames
        // itself (applying them in place, with no copy): between two of its
        // receives it is busy reducing or sending, so leave them a while.
        let since = polled.since();
        if since < DEFER_TO_POLLER {
            if stop.load(Ordering::Acquire) {
                return;
            }
            ring.nap(DEFER_TO_POLLER - since);
            continue;
        }
        let frame = {
            let _taking = lock.lock().unwrap_or_else(|e| e.into_inner());
            if ring.available() == 0 {
                continue; // a receiver took it
            }
            let mut hb = [0u8; HEADER_LEN];
            if let Err(e) = ring.read_exact(&mut hb, stop) {
                return mailbox.fail_peer(
                    peer,
                    e.unwrap_or_else(|| "connection closed by peer".into()),
                );
            }
            let header = match Header::decode(&hb, max_frame) {
                Ok(h) => h,
                Err(e) => return mailbox.fail_peer(peer, format!("protocol violation: {e}")),
            };
            let mut payload = policy.frames.take(header.len as usize);
            if let Err(e) = ring.read_exact(payload.as_mut(), stop) {
                return mailbox.fail_peer(
                    peer,
                    e.unwrap_or_else(|| "ring closed in the middle of a frame".into()),
                );
            }
            (header, payload)
        };
        // The mailbox may make us wait for space (back-pressure): this
        // thread stops reading the ring, and the sender stops when it fills.
        match block_on(mailbox.deliver(peer, frame.0, frame.1.freeze())) {
            Ok(()) | Err(TransportError::StaleEpoch { .. }) => {}
            Err(_) => return,
        }
    }
}

/// Marks the inbound rings polled while a receiving task spins on them,
/// so senders skip waking the reader threads. A frame published while a
/// sender saw the flag set, and left in the ring when the poller stopped,
/// is taken by the next receive or by the reader thread after its bounded
/// nap (`DEFER_TO_POLLER`, at most `NAP`).
struct Polling<'a>(&'a ShmTransport);

impl<'a> Polling<'a> {
    fn start(t: &'a ShmTransport) -> Polling<'a> {
        t.polled.touch();
        if t.polling.fetch_add(1, Ordering::SeqCst) == 0 {
            t.set_polling(1);
        }
        Polling(t)
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        // the clock counts from the end of a spin phase (a receive that
        // goes to sleep clears it afterwards)
        self.0.polled.touch();
        if self.0.polling.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.set_polling(0);
        }
    }
}

impl ShmTransport {
    /// How many frames receivers consumed straight from the rings, with no
    /// copy into an owned buffer.
    pub fn frames_lent(&self) -> u64 {
        self.lent.load(Ordering::Relaxed)
    }

    /// As [`ShmTransport::pump`], but a frame of `tag` from a rank in
    /// `from` is first lent in place to `apply`; if it consumes the frame,
    /// it leaves the ring with no copy, and this returns at once.
    fn pump_for<F>(&self, tag: OpTag, from: &PeerSet, apply: &mut F) -> Pump
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool,
    {
        let mut res = Pump::Idle;
        for (peer, ring) in self.inbound.iter().enumerate() {
            let Some(ring) = ring else { continue };
            if ring.available() < HEADER_LEN {
                continue;
            }
            let Ok(_taking) = self.in_locks[peer].try_lock() else {
                continue;
            };
            let sender = Rank(peer as u32);
            loop {
                let avail = ring.available();
                if avail < HEADER_LEN || avail > ring.cap {
                    break;
                }
                let mut hb = [0u8; HEADER_LEN];
                ring.copy_out(&mut hb, false);
                // A bad header is left for the reader thread to report.
                let Ok(header) = Header::decode(&hb, self.max_frame) else {
                    break;
                };
                let len = header.len as usize;
                if avail < HEADER_LEN + len {
                    break;
                }
                if header.tag == tag
                    && from.contains(sender)
                    && ring.lend(HEADER_LEN, len, |parts| apply(sender, &header, parts))
                {
                    ring.skip(HEADER_LEN + len);
                    self.lent.fetch_add(1, Ordering::Relaxed);
                    return Pump::Consumed;
                }
                if !self.mailbox.has_room(len) {
                    break;
                }
                ring.skip(HEADER_LEN);
                let mut payload = self.frames.take(len);
                ring.copy_out(payload.as_mut(), true);
                match self.mailbox.deliver_now(sender, header, payload.freeze()) {
                    Ok(()) | Err(TransportError::StaleEpoch { .. }) => res = Pump::Moved,
                    Err(_) => return res,
                }
            }
        }
        res
    }

    /// A receiving task stops polling and will sleep until a reader thread
    /// delivers its frame: the readers must not wait for it any longer.
    fn going_to_sleep(&self) {
        self.polled.clear();
        for ring in self.inbound.iter().flatten() {
            if ring.available() > 0 {
                ring.u32_at(OFF_DATA_SEQ).fetch_add(1, Ordering::AcqRel);
                futex(ring.u32_at(OFF_DATA_SEQ), libc::FUTEX_WAKE, 1, None);
            }
        }
    }

    fn set_polling(&self, v: u32) {
        for ring in self.inbound.iter().flatten() {
            ring.u32_at(OFF_RECV_POLLING).store(v, Ordering::SeqCst);
        }
    }

    /// Moves every whole frame that is already in an inbound ring into the
    /// mailbox, without waiting and without the reader threads (a ring
    /// whose reader is busy is skipped). Returns whether it moved any.
    fn pump(&self) -> bool {
        let none = PeerSet::new();
        let tag = OpTag {
            epoch: self.mailbox.epoch(),
            op: crate::OpId(0),
            seq: 0,
        };
        self.pump_for(tag, &none, &mut |_, _, _| false) != Pump::Idle
    }
}

fn write_loop(
    ring: &Ring,
    lock: &std::sync::Mutex<()>,
    peer: Rank,
    rx: &std_mpsc::Receiver<WriterMsg>,
    mailbox: &Mailbox,
    stop: &AtomicBool,
) {
    let mut lost: Option<TransportError> = None;
    loop {
        let msg = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(m) => m,
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match msg {
            WriterMsg::Frame(h, payload, done) => {
                if lost.is_none() {
                    let _frame = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let r = ring
                        .write_all(&h, stop)
                        .and_then(|()| ring.write_all(&payload, stop));
                    if let Err(why) = r {
                        lost = Some(mailbox.lose_writer(peer, why));
                    }
                }
                let _ = done.send(lost.clone().map_or(Ok(()), Err));
            }
            WriterMsg::Finish(done) => {
                ring.close(SENDER_CLOSED);
                let _ = done.send(());
                return;
            }
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn epoch(&self) -> Epoch {
        self.mailbox.epoch()
    }

    fn advance_epoch(&self, epoch: Epoch) {
        self.mailbox.advance_epoch(epoch);
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "shm",
            max_frame: self.max_frame,
            zero_copy: false,
            needs_registration: false,
        }
    }

    fn try_send_now(
        &self,
        to: Rank,
        mut header: Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        let route = self.outbound.get(to.idx()).and_then(Option::as_ref);
        self.mailbox.check_send(
            to,
            self.size,
            route.is_some(),
            payload.len(),
            self.max_frame,
        )?;
        let ring = route.expect("checked");
        header.len = payload.len() as u64;
        let h = header.encode();
        let Ok(_frame) = self.out_locks[to.idx()].try_lock() else {
            return Ok(false); // a frame is half written by the writer thread
        };
        Ok(ring.closed() & RECEIVER_CLOSED == 0 && ring.try_write(&[&h, payload]))
    }

    fn sends_in_place(&self, to: Rank) -> bool {
        self.outbound.get(to.idx()).is_some_and(Option::is_some)
    }

    async fn send(
        &self,
        to: Rank,
        mut header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        let w = self.writers.get(to.idx()).and_then(Option::as_ref);
        self.mailbox
            .check_send(to, self.size, w.is_some(), payload.len(), self.max_frame)?;
        let w = w.expect("checked");
        header.len = payload.len() as u64;
        let h = header.encode();
        // Fast path: the frame fits now and no frame is half written.
        if let (Some(Some(ring)), Ok(_frame)) = (
            self.outbound.get(to.idx()),
            self.out_locks[to.idx()].try_lock(),
        ) {
            if ring.closed() & RECEIVER_CLOSED == 0 && ring.try_write(&[&h, &payload]) {
                return Ok(());
            }
        }
        let (done, wait) = oneshot::channel();
        w.send(WriterMsg::Frame(h, payload, done))
            .map_err(|_| TransportError::Closed)?;
        wait.await.map_err(|_| TransportError::Closed)?
    }

    async fn recv(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
    ) -> Result<Frame, TransportError> {
        // Poll the rings ourselves while spinning. With more ranks than
        // cores, yield to the OS between polls; measured on 2 cores, 4-byte
        // allreduce: 4 ranks 280 -> 80..120 us, while 2 ranks are fastest
        // without (5 us, against 30 us).
        {
            let _polling = Polling::start(self);
            let pump = || Pump::moved(self.pump());
            let spun = self
                .mailbox
                .spin_recv(tag, from, self.spin, self.oversubscribed, pump)
                .await;
            if let Some(r) = spun {
                return r.map(|f| f.expect("plain pumps consume nothing"));
            }
            // the guard clears the polling flags as it drops
        }
        self.going_to_sleep();
        self.mailbox.recv(tag, from, deadline).await
    }

    async fn recv_in_place<'a, F>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
        mut apply: F,
    ) -> Result<Option<Frame>, TransportError>
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool + Send + 'a,
    {
        {
            let _polling = Polling::start(self);
            let pump = || self.pump_for(tag, from, &mut apply);
            let spun = self
                .mailbox
                .spin_recv(tag, from, self.spin, self.oversubscribed, pump)
                .await;
            if let Some(r) = spun {
                return r;
            }
        }
        self.going_to_sleep();
        self.mailbox.recv(tag, from, deadline).await.map(Some)
    }

    fn recv_stray(
        &self,
        deadline: Instant,
    ) -> impl std::future::Future<Output = Result<Frame, TransportError>> + Send + '_ {
        self.mailbox.recv_stray(deadline)
    }

    fn retire(&self, tag: OpTag) {
        self.mailbox.retire(tag);
    }

    fn check_peers(&self, peers: &PeerSet) -> Result<(), TransportError> {
        self.mailbox.check_peers(peers)
    }

    fn check_peers_for(&self, tag: OpTag, peers: &PeerSet) -> Result<(), TransportError> {
        self.mailbox.check_peers_for(tag, peers)
    }

    async fn close(&self, linger: Duration) {
        let deadline = Instant::now() + linger;
        let mut acks = Vec::new();
        for w in self.writers.iter().flatten() {
            let (tx, rx) = oneshot::channel();
            if w.send(WriterMsg::Finish(tx)).is_ok() {
                acks.push(rx);
            }
        }
        for a in acks {
            let _ = tokio::time::timeout_at(deadline, a).await;
        }
        // Drain until every peer has closed its side too.
        while Instant::now() < deadline
            && !self.readers_done.iter().all(|d| d.load(Ordering::Acquire))
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.shutdown();
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        for r in self.inbound.iter().flatten() {
            r.close(RECEIVER_CLOSED);
        }
        // Peers see the end of our stream at once, as with a reset socket.
        for r in self.outbound.iter().flatten() {
            r.close(SENDER_CLOSED);
        }
        self.mailbox.close();
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}
