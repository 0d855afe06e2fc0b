//! The moving parts of a fabric wire: the operations in flight (each with
//! the memory it holds until its completion), the eager receive slots,
//! and the progress task that reads completions.
//!
//! **Two paths.** A frame of at most `eager_max` bytes goes as one tagged
//! message with the tag [`EAGER`] into one of the wildcard receive slots
//! the wire keeps posted; its completion names the source (`FI_SOURCE`),
//! and the frame lands in a receive the op posted with the endpoint's
//! matcher, or is queued there. A larger frame goes only into a receive
//! posted for it ([`crate::wire::Caps::eager_max`]: the collectives post
//! those): its tag is a digest of (sender, op, epoch, seq, chunk, step), the
//! provider matches it in hardware or in its own software, and the payload
//! is written straight into the op's memory. The header travels in front
//! of the payload on both paths, and is checked against what was posted.
//!
//! **Memory.** Every buffer given to libfabric (a send's header and
//! payload, a posted receive's range, an eager slot) is held by the entry
//! of its operation until the completion is read; the entry is keyed by
//! its `fi_context2`, boxed so that it does not move. A receive posted for
//! an op that ended meanwhile (retired, an older epoch, a closed endpoint)
//! is cancelled; closing the endpoint (before the table is dropped) ends
//! the rest.
//!
//! **Progress.** Both providers here progress manually: nothing moves
//! unless the CQ is read. A task per wire reads it, spinning briefly after
//! activity, then sleeping: on the CQ's file descriptor where the provider
//! has one (`tcp`, after `fi_trywait`), else with a pause that grows to a
//! millisecond (`shm`), so an idle job does not burn a core.

use std::collections::HashMap;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use kungfu_fabric_sys::{fi_context2, FI_ECANCELED};
use kungfu_topology::Rank;
use tokio::sync::{oneshot, Notify};

use super::ofi::{Cqe, Mr, Ofi, Posted};
use crate::endpoint::{Matcher, RecvKey};
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::{Header, Instant, TransportError, HEADER_LEN};

/// The tag of eager frames (the top bit); rendezvous tags have it clear.
pub(super) const EAGER: u64 = 1 << 63;

/// The tag of a frame that only lands in a posted receive.
pub(super) fn rendezvous_tag(from: Rank, h: &Header) -> u64 {
    let mut b = [0u8; 26];
    b[..4].copy_from_slice(&from.0.to_le_bytes());
    b[4..12].copy_from_slice(&h.tag.op.0.to_le_bytes());
    b[12..16].copy_from_slice(&h.tag.epoch.0.to_le_bytes());
    b[16..20].copy_from_slice(&h.tag.seq.to_le_bytes());
    b[20..24].copy_from_slice(&h.chunk.to_le_bytes());
    b[24..26].copy_from_slice(&h.step.to_le_bytes());
    kungfu_topology::fnv1a64(0x6b66_6661_6272_6963, &b) & !EAGER
}

fn iovec(base: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: base as *mut c_void,
        iov_len: len,
    }
}

/// Bytes a send holds until its completion.
pub(super) enum Hold {
    Bytes(Bytes),
    Mem(Mem),
}

impl Hold {
    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Hold::Bytes(b) => b,
            Hold::Mem(m) => m.as_slice(),
        }
    }
}

enum Kind {
    Send {
        done: Option<oneshot::Sender<Result<(), String>>>,
        header: Box<[u8; HEADER_LEN]>,
        payload: Hold,
        _mrs: Vec<Arc<Mr>>,
    },
    Eager {
        slot: usize,
    },
    Posted {
        key: RecvKey,
        header: Box<[u8; HEADER_LEN]>,
        mem: MemMut,
        _mrs: Vec<Arc<Mr>>,
        cancelled: bool,
    },
}

struct Op {
    ctx: Box<fi_context2>,
    kind: Kind,
    /// The registrations' descriptors of the operation's two buffers.
    desc: [*mut c_void; 2],
}

// SAFETY: the context and descriptors are only handed to libfabric (whose
// domain is FI_THREAD_SAFE) and never dereferenced here; the buffers the
// entry holds are Send.
unsafe impl Send for Op {}

impl Op {
    fn new(kind: Kind) -> Op {
        Op {
            ctx: Box::default(),
            kind,
            desc: [std::ptr::null_mut(); 2],
        }
    }

    fn ctx_ptr(&mut self) -> *mut fi_context2 {
        &raw mut *self.ctx
    }
}

/// An eager receive buffer: a header and up to `eager_max` payload bytes.
struct Slot {
    buf: Box<[u8]>,
    mr: Option<Arc<Mr>>,
}

#[derive(Default)]
struct State {
    pending: HashMap<usize, Op>,
    slots: Vec<Slot>,
}

/// What a wire and its progress task share.
pub(super) struct Core {
    pub(super) ofi: Ofi,
    state: Mutex<State>,
    pub(super) matcher: Arc<Matcher>,
    pool: Arc<BufferPool>,
    /// An operation was posted: progress now.
    pub(super) wake: Notify,
    pub(super) eager_max: usize,
    pub(super) max_frame: usize,
    /// Register every buffer, even where the provider does not need it
    /// (tests the registration path on providers without `FI_MR_LOCAL`).
    register: bool,
    /// This wire's key among a region's registrations (unique per process).
    reg_id: usize,
    next_key: AtomicU64,
    pub(super) closing: AtomicBool,
    /// Frames finished per peer: sent, and received (for the goodbyes).
    pub(super) sent: Vec<AtomicU64>,
    pub(super) received: Vec<AtomicU64>,
    spin: Duration,
    me: Rank,
    /// Frames that landed in receives posted for them (the rendezvous way).
    pub(super) posted_landed: AtomicU64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        ofi: Ofi,
        matcher: Arc<Matcher>,
        pool: Arc<BufferPool>,
        size: usize,
        eager_max: usize,
        max_frame: usize,
        register: bool,
        spin: Duration,
        me: Rank,
    ) -> Core {
        static IDS: AtomicU64 = AtomicU64::new(1 << 20);
        Core {
            ofi,
            state: Mutex::default(),
            matcher,
            pool,
            wake: Notify::new(),
            eager_max,
            max_frame,
            register,
            reg_id: IDS.fetch_add(1, Ordering::Relaxed) as usize,
            next_key: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            sent: (0..size).map(|_| AtomicU64::new(0)).collect(),
            received: (0..size).map(|_| AtomicU64::new(0)).collect(),
            spin,
            me,
            posted_landed: AtomicU64::new(0),
        }
    }

    /// Whether buffers must be registered.
    pub(super) fn registers(&self) -> bool {
        self.register || self.ofi.mr_local
    }

    fn register_raw(&self, ptr: *const u8, len: usize) -> Result<Arc<Mr>, String> {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        // SAFETY: every caller keeps the memory alive for as long as the
        // returned region (held next to the buffer it covers).
        unsafe { self.ofi.register(ptr, len.max(1), key) }.map(Arc::new)
    }

    /// The registration of `region`, made once and kept in it.
    pub(super) fn register_region(&self, region: &Arc<Region>) -> Result<Arc<Mr>, TransportError> {
        if let Some(r) = region.registration(self.reg_id) {
            if let Ok(mr) = r.downcast::<Mr>() {
                return Ok(mr);
            }
        }
        // The region holds its registration (dropped with it), so the
        // memory outlives the registration.
        let mr = self
            .register_raw(region.as_ptr(), region.len())
            .map_err(|why| TransportError::Handshake {
                peer: None,
                addr: self.ofi.provider.clone(),
                reason: why,
            })?;
        region.set_registration(self.reg_id, mr.clone());
        Ok(mr)
    }

    /// Posts the eager slots (at connect).
    pub(super) fn post_slots(self: &Arc<Self>, count: usize) -> Result<(), String> {
        for _ in 0..count {
            let buf = vec![0u8; HEADER_LEN + self.eager_max].into_boxed_slice();
            let mr = if self.registers() {
                Some(self.register_raw(buf.as_ptr(), buf.len())?)
            } else {
                None
            };
            let slot = {
                let mut st = lock(&self.state);
                st.slots.push(Slot { buf, mr });
                st.slots.len() - 1
            };
            self.repost(slot)?;
        }
        Ok(())
    }

    /// Posts eager slot `slot` (again).
    fn repost(self: &Arc<Self>, slot: usize) -> Result<(), String> {
        loop {
            let mut st = lock(&self.state);
            let mut op = Op::new(Kind::Eager { slot });
            let s = &mut st.slots[slot];
            let iov = [iovec(s.buf.as_ptr(), s.buf.len())];
            let mut desc = [s.mr.as_ref().map_or(std::ptr::null_mut(), |m| m.desc)];
            let ctx = op.ctx_ptr();
            // SAFETY: the slot's buffer lives in the state for the wire's
            // life (slots are never removed), and is not touched until this
            // receive's completion comes back; `ctx` is boxed in the entry.
            match unsafe { self.ofi.trecv(&iov, &mut desc, EAGER, ctx) }? {
                Posted::Yes => {
                    st.pending.insert(ctx as usize, op);
                    return Ok(());
                }
                Posted::Again => {
                    drop(st);
                    self.progress()?;
                }
            }
        }
    }

    /// Sends a frame; resolves when libfabric is done with its memory.
    pub(super) async fn send(
        self: &Arc<Self>,
        to: Rank,
        header: Header,
        payload: Hold,
    ) -> Result<(), TransportError> {
        if self.closing.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        let lost = |why: String| TransportError::PeerLost {
            peer: to,
            reason: why.into(),
        };
        let len = payload.as_slice().len();
        let mut header = header;
        header.len = len as u64;
        let tag = if len <= self.eager_max {
            EAGER
        } else {
            rendezvous_tag(self.me, &header)
        };
        let hdr = Box::new(header.encode());
        let mut mrs = Vec::new();
        let mut desc = [std::ptr::null_mut(); 2];
        if self.registers() {
            let h = self.register_raw(hdr.as_ptr(), HEADER_LEN).map_err(lost)?;
            let p = match &payload {
                Hold::Mem(m) => self.register_region(m.region())?,
                Hold::Bytes(b) => self.register_raw(b.as_ptr(), b.len()).map_err(lost)?,
            };
            desc = [h.desc, p.desc];
            mrs = vec![h, p];
        }
        let (tx, rx) = oneshot::channel();
        let mut op = Some(Op::new(Kind::Send {
            done: Some(tx),
            header: hdr,
            payload,
            _mrs: mrs,
        }));
        if let Some(op) = &mut op {
            op.desc = desc;
        }
        loop {
            let posted = {
                let mut st = lock(&self.state);
                let o = op.as_mut().expect("not posted yet");
                let ctx = o.ctx_ptr();
                let Kind::Send {
                    header, payload, ..
                } = &o.kind
                else {
                    unreachable!("a send")
                };
                let iov = [
                    iovec(header.as_ptr(), HEADER_LEN),
                    iovec(payload.as_slice().as_ptr(), len),
                ];
                let mut desc = o.desc;
                // SAFETY: the header and payload are held by the entry,
                // which goes into the table before the lock is released (so
                // before any completion is read) and stays there until its
                // own completion; `ctx` is boxed in it.
                let r = unsafe { self.ofi.tsend(&iov, &mut desc, u64::from(to.0), tag, ctx) };
                if let Ok(Posted::Yes) = r {
                    st.pending
                        .insert(ctx as usize, op.take().expect("posted once"));
                }
                r
            };
            match posted.map_err(lost)? {
                Posted::Yes => break,
                Posted::Again => {
                    self.progress().map_err(lost)?;
                    tokio::task::yield_now().await;
                }
            }
        }
        self.wake.notify_one();
        match rx.await {
            Ok(Ok(())) => {
                self.sent[to.idx()].fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Ok(Err(why)) => Err(self.matcher.lose_writer(to, why)),
            Err(_) => Err(TransportError::Closed),
        }
    }

    /// Takes a receive posted for a frame above the eager limit: the
    /// provider writes it straight into `mem`.
    pub(super) fn post(
        self: &Arc<Self>,
        key: RecvKey,
        mem: MemMut,
    ) -> Result<Option<MemMut>, TransportError> {
        if mem.len() <= self.eager_max {
            return Ok(Some(mem));
        }
        let header = Box::new([0u8; HEADER_LEN]);
        let mut mrs = Vec::new();
        let mut desc = [std::ptr::null_mut(); 2];
        if self.registers() {
            let h = self
                .register_raw(header.as_ptr(), HEADER_LEN)
                .map_err(|why| TransportError::PeerLost {
                    peer: key.from,
                    reason: why.into(),
                })?;
            desc[0] = h.desc;
            mrs.push(h);
            let p = self.register_region(mem.region())?;
            desc[1] = p.desc;
            mrs.push(p);
        }
        let probe = Header {
            kind: crate::FrameKind::Data,
            tag: key.tag,
            chunk: key.chunk,
            step: key.step,
            digest: 0,
            len: mem.len() as u64,
        };
        let tag = rendezvous_tag(key.from, &probe);
        let mut op = Op::new(Kind::Posted {
            key,
            header,
            mem,
            _mrs: mrs,
            cancelled: false,
        });
        op.desc = desc;
        let mut op = Some(op);
        loop {
            let posted = {
                let mut st = lock(&self.state);
                let o = op.as_mut().expect("not posted yet");
                let ctx = o.ctx_ptr();
                let Kind::Posted { header, mem, .. } = &mut o.kind else {
                    unreachable!("a posted receive")
                };
                let iov = [
                    iovec(header.as_ptr(), HEADER_LEN),
                    iovec(mem.as_mut_slice().as_ptr(), mem.len()),
                ];
                let mut desc = o.desc;
                // SAFETY: the header box and the op's range (a write share
                // no other share overlaps) are held by the entry until its
                // completion; it enters the table before the lock goes.
                let r = unsafe { self.ofi.trecv(&iov, &mut desc, tag, ctx) };
                if let Ok(Posted::Yes) = r {
                    st.pending
                        .insert(ctx as usize, op.take().expect("posted once"));
                }
                r
            };
            match posted {
                Ok(Posted::Yes) => {
                    self.wake.notify_one();
                    return Ok(None);
                }
                Ok(Posted::Again) => {
                    self.progress()
                        .map(drop)
                        .map_err(|why| TransportError::PeerLost {
                            peer: key.from,
                            reason: why.into(),
                        })?
                }
                Err(why) => {
                    return Err(TransportError::PeerLost {
                        peer: key.from,
                        reason: why.into(),
                    })
                }
            }
        }
    }

    /// Reads what completed and acts on it; how many completions.
    pub(super) fn progress(self: &Arc<Self>) -> Result<usize, String> {
        let mut cqes = Vec::new();
        let mut done = Vec::new();
        {
            let mut st = lock(&self.state);
            loop {
                let n = self.ofi.read_cq(&mut cqes, 64)?;
                if n == 0 || cqes.len() >= 256 {
                    break;
                }
            }
            for c in cqes.drain(..) {
                let ctx = match &c {
                    Cqe::Done { ctx, .. } | Cqe::Failed { ctx, .. } => *ctx,
                };
                if let Some(op) = st.pending.remove(&ctx) {
                    done.push((op, c));
                }
            }
        }
        let n = done.len();
        for (op, c) in done {
            self.complete(op, c);
        }
        Ok(n)
    }

    fn complete(self: &Arc<Self>, op: Op, c: Cqe) {
        match (op.kind, c) {
            (
                Kind::Send {
                    done,
                    header,
                    payload,
                    _mrs,
                },
                c,
            ) => {
                // libfabric is done with the memory: let go of it before
                // the sender hears (it may post a receive into that range
                // at once)
                drop((header, payload, _mrs));
                if let Some(d) = done {
                    let _ = d.send(match c {
                        Cqe::Done { .. } => Ok(()),
                        Cqe::Failed { why, .. } => Err(why),
                    });
                }
            }
            (Kind::Eager { slot }, Cqe::Done { len, src, .. }) => {
                self.eager_arrived(slot, len, src)
            }
            (Kind::Eager { slot }, Cqe::Failed { err, .. }) => {
                if err != FI_ECANCELED && !self.closing.load(Ordering::Acquire) {
                    let _ = self.repost(slot);
                }
            }
            (
                Kind::Posted {
                    key, header, mem, ..
                },
                Cqe::Done { len, src, .. },
            ) => {
                self.posted_arrived(key, &header, mem, len, src);
            }
            (Kind::Posted { key, cancelled, .. }, Cqe::Failed { err, why, .. }) => {
                if err != FI_ECANCELED && !cancelled {
                    self.matcher
                        .fail_peer(key.from, format!("receive failed: {why}"));
                }
            }
        }
    }

    /// An eager frame in slot `slot`: into a posted receive, or queued.
    fn eager_arrived(self: &Arc<Self>, slot: usize, len: usize, src: Option<u64>) {
        let (header, from) = {
            let st = lock(&self.state);
            let buf = &st.slots[slot].buf;
            let from = src.and_then(|s| u32::try_from(s).ok()).map(Rank);
            let header = Header::decode(
                buf[..HEADER_LEN].try_into().expect("header"),
                self.max_frame,
            );
            (header, from)
        };
        let Some(from) = from.filter(|r| r.idx() < self.received.len()) else {
            // no source: nobody to blame; the frame is dropped
            let _ = self.repost(slot);
            return;
        };
        let header = match header {
            Ok(h) if len >= HEADER_LEN && h.len as usize == len - HEADER_LEN => h,
            Ok(_) => {
                self.matcher.fail_peer(
                    from,
                    "protocol violation: a frame's length differs from its header's",
                );
                let _ = self.repost(slot);
                return;
            }
            Err(e) => {
                self.matcher
                    .fail_peer(from, format!("protocol violation: {e}"));
                let _ = self.repost(slot);
                return;
            }
        };
        let plen = len - HEADER_LEN;
        let landed = {
            let st = lock(&self.state);
            let payload = &st.slots[slot].buf[HEADER_LEN..len];
            self.matcher.land_parts(from, &header, &[payload])
        };
        if landed || self.matcher.has_room(plen) {
            if !landed {
                let bytes = self.copy_out(slot, len);
                let _ = self.matcher.deliver_now(from, header, bytes);
            }
            self.received[from.idx()].fetch_add(1, Ordering::Relaxed);
            let _ = self.repost(slot);
            return;
        }
        // No room: the slot waits (unposted) until the frame fits, so the
        // provider holds the next ones (back pressure).
        let bytes = self.copy_out(slot, len);
        let core = self.clone();
        tokio::spawn(async move {
            let _ = core.matcher.deliver(from, header, bytes).await;
            core.received[from.idx()].fetch_add(1, Ordering::Relaxed);
            let _ = core.repost(slot);
        });
    }

    fn copy_out(&self, slot: usize, len: usize) -> Bytes {
        let st = lock(&self.state);
        let mut b = self.pool.take(len - HEADER_LEN);
        b.as_mut()
            .copy_from_slice(&st.slots[slot].buf[HEADER_LEN..len]);
        b.freeze()
    }

    /// A frame in a receive posted for it: checked, then landed.
    fn posted_arrived(
        &self,
        key: RecvKey,
        header: &[u8; HEADER_LEN],
        mem: MemMut,
        len: usize,
        src: Option<u64>,
    ) {
        let from_ok = src.is_none_or(|s| s == u64::from(key.from.0));
        let ok = Header::decode(header, self.max_frame).ok().filter(|h| {
            from_ok
                && h.tag == key.tag
                && h.chunk == key.chunk
                && h.step == key.step
                && h.len as usize == mem.len()
                && len == HEADER_LEN + mem.len()
        });
        match ok {
            Some(h) => {
                self.received[key.from.idx()].fetch_add(1, Ordering::Relaxed);
                self.posted_landed.fetch_add(1, Ordering::Relaxed);
                self.matcher.landed(key.from, h, mem);
            }
            None => self.matcher.fail_peer(
                key.from,
                "protocol violation: a frame landed in a receive posted for another",
            ),
        }
    }

    /// Cancels receives posted for ops that ended (retired, an older
    /// epoch, a closed matcher).
    pub(super) fn cancel_stale(&self) {
        let mut st = lock(&self.state);
        for op in st.pending.values_mut() {
            if let Kind::Posted { key, cancelled, .. } = &mut op.kind {
                if !*cancelled && !self.matcher.wants(key.tag) {
                    *cancelled = true;
                    self.ofi.cancel(&raw mut *op.ctx);
                }
            }
        }
    }

    /// Whether anything is in flight (sends or posted receives).
    pub(super) fn busy(&self) -> bool {
        let st = lock(&self.state);
        st.pending.len() > st.slots.len()
    }

    /// Sends posted and not completed.
    pub(super) fn sends_in_flight(&self) -> usize {
        let st = lock(&self.state);
        st.pending
            .values()
            .filter(|op| matches!(op.kind, Kind::Send { .. }))
            .count()
    }
}

/// How long the progress task keeps polling a provider without a wait
/// object while transfers are in flight, after the last completion.
const BUSY_POLL: Duration = Duration::from_millis(2);

/// The progress task: reads completions until the wire closes.
pub(super) async fn run(core: Arc<Core>) {
    let fd = core.ofi.wait_fd.and_then(|fd| {
        // SAFETY: libfabric's CQ fd stays open until the CQ is closed,
        // which happens when the last `Core` goes: `Waiter` holds one,
        // dropped after its `AsyncFd` (fields drop in order).
        let afd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                RawFd(fd),
                tokio::io::Interest::READABLE,
            )
        };
        afd.ok().map(|fd| Waiter {
            fd,
            _core: core.clone(),
        })
    });
    let min_pause = Duration::from_micros(20);
    let mut pause = min_pause;
    let mut active = Instant::now();
    let mut last_sweep = Instant::now();
    let mut errors = 0u32;
    loop {
        if core.closing.load(Ordering::Acquire) && !core.busy() {
            return;
        }
        match core.progress() {
            Ok(n) if n > 0 => {
                active = Instant::now();
                pause = min_pause;
                tokio::task::yield_now().await;
                continue;
            }
            Ok(_) => errors = 0,
            Err(why) => {
                // A CQ that keeps failing is beyond use; one failure may be
                // a peer's connection going (its sends fail on their own).
                errors += 1;
                if errors >= 100 {
                    for r in 0..core.received.len() {
                        core.matcher
                            .fail_peer(Rank(r as u32), format!("fabric: {why}"));
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        }
        if last_sweep.elapsed() >= Duration::from_millis(10) {
            core.cancel_stale();
            last_sweep = Instant::now();
        }
        if active.elapsed() < core.spin {
            tokio::task::yield_now().await;
            continue;
        }
        let wake = core.wake.notified();
        match &fd {
            Some(w) if core.ofi.try_wait() => {
                tokio::select! {
                    r = w.fd.readable() => if let Ok(mut g) = r { g.clear_ready() },
                    () = wake => {}
                    () = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
            Some(_) => tokio::task::yield_now().await,
            // a transfer in flight on a provider without a wait object
            // (shm) moves only while someone reads the CQ: keep polling (a
            // timer cannot wait less than a millisecond) for a while after
            // the last completion; a peer slower than that is waited for
            // with the pauses below
            None if core.busy() && active.elapsed() < BUSY_POLL => tokio::task::yield_now().await,
            None => {
                // idle: a pause growing to a millisecond, so an idle job
                // does not burn a core; a receive going to sleep or a new
                // operation ends it
                tokio::select! {
                    () = wake => pause = min_pause,
                    () = tokio::time::sleep(pause) => pause = (pause * 2).min(Duration::from_millis(1)),
                }
            }
        }
    }
}

/// The CQ's fd, registered with the runtime, and the core whose CQ owns it.
struct Waiter {
    fd: tokio::io::unix::AsyncFd<RawFd>,
    _core: Arc<Core>,
}

/// libfabric's wait fd, watched (never closed) by the progress task.
struct RawFd(i32);

impl std::os::fd::AsRawFd for RawFd {
    fn as_raw_fd(&self) -> i32 {
        self.0
    }
}
