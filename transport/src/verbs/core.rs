//! The state of a verbs wire and its sending side: the work requests in
//! flight (each with the memory it holds until its completion), the eager
//! slots, the send slots and send-queue credits, and the two halves of
//! the rendezvous (readies waiting for their frames at the sender, posted
//! receives waiting for their writes at the receiver). What completions
//! do is in `arrive`; the task that reads them in `progress`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::sync::{oneshot, Notify};

use super::proto::{self, FrameKey, Imm, QpInfo, QpStep, Ready, Sge, WrId, RID_BITS};
use super::seam::{Reg, Verbs};
use crate::endpoint::{Matcher, RecvKey};
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::{Header, TransportError, HEADER_LEN};

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

/// A receive posted for a frame above the eager limit, at its receiver.
pub(super) struct Rdv {
    pub(super) key: RecvKey,
    pub(super) mem: MemMut,
    pub(super) _reg: Arc<Reg>,
    /// A `Cancel` was sent: the peer answers `CancelAck` (or `Done`).
    pub(super) cancelled: bool,
}

/// A message that waits for a send slot or a credit, in order per peer.
pub(super) enum Ctrl {
    Ready(Ready),
    Cancel(u32),
    CancelAck(u32),
}

/// What a work request in flight holds, keyed by its id.
pub(super) enum Pending {
    /// An eager slot posted on the pair to its peer.
    Slot { mem: MemMut },
    /// A signaled send (a frame, a rendezvous pair, a control message).
    Send {
        done: Option<oneshot::Sender<Result<(), String>>>,
        credits: usize,
        slot: Option<MemMut>,
        _payload: Option<Hold>,
        _reg: Option<Arc<Reg>>,
    },
}

#[derive(Default)]
pub(super) struct State {
    pub(super) pending: HashMap<u64, Pending>,
    /// Send slots not in use.
    pub(super) free: Vec<MemMut>,
    /// Free send-queue entries, per peer.
    pub(super) credits: Vec<usize>,
    pub(super) ctrl: Vec<VecDeque<Ctrl>>,
    /// At the sender: where each peer is ready for which frame.
    pub(super) readies: HashMap<(Rank, FrameKey), VecDeque<Ready>>,
    /// At the receiver: posted rendezvous receives by id.
    pub(super) rdv: HashMap<u32, Rdv>,
    next_rid: u32,
    next_seq: u32,
    /// Pairs moved to the error state: nothing is posted on them again.
    pub(super) dead: Vec<bool>,
}

/// How a core is sized.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub me: Rank,
    pub size: usize,
    pub eager_max: usize,
    /// Eager slots posted per peer.
    pub slots: usize,
    /// Send slots (shared by all peers).
    pub send_slots: usize,
    /// Send-queue entries per peer.
    pub sq_depth: usize,
    pub max_frame: usize,
    pub spin: Duration,
}

impl Layout {
    /// Bytes of an eager or send slot: a header and the largest eager
    /// payload, or a `Ready`.
    pub fn slot_len(&self) -> usize {
        HEADER_LEN + self.eager_max.max(Ready::LEN)
    }

    /// Completion queue entries: every work request that may be in flight.
    pub fn cq_depth(&self) -> usize {
        self.size.saturating_sub(1) * (self.slots + self.sq_depth) + 16
    }
}

/// What a wire, its progress task and its watchers share.
pub(super) struct Core {
    /// First, so that it is dropped first: the queue pairs are destroyed
    /// (no more DMA) before the memory below is freed.
    pub(super) verbs: Box<dyn Verbs>,
    pub(super) state: Mutex<State>,
    /// One reader of the completion queue at a time, so that each pair's
    /// completions are acted on in order.
    pub(super) progressing: Mutex<()>,
    recv_reg: Reg,
    send_reg: Reg,
    recv_region: Arc<Region>,
    /// (Also held by the send slots' shares.)
    _send_region: Arc<Region>,
    pub(super) matcher: Arc<Matcher>,
    pub(super) pool: Arc<BufferPool>,
    /// Told when a send may find what it waits for: a credit, a slot, a
    /// ready, a lost peer, the close.
    pub(super) room: Notify,
    /// Work was posted: the progress task polls now.
    pub(super) wake: Notify,
    pub(super) layout: Layout,
    /// This wire's key among a region's registrations.
    reg_id: usize,
    pub(super) closing: AtomicBool,
    /// Frames finished per peer: sent, and received (for the goodbyes).
    pub(super) sent: Vec<AtomicU64>,
    pub(super) received: Vec<AtomicU64>,
    /// Frames written straight into posted receives.
    pub(super) posted_landed: AtomicU64,
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn sge_of(mem: &[u8], reg: &Reg) -> Sge {
    Sge {
        addr: mem.as_ptr() as u64,
        len: mem.len() as u32,
        lkey: reg.lkey,
    }
}

impl Core {
    /// A core over `verbs` (queue pairs in RESET): registers the slots,
    /// moves every pair to INIT and posts its eager slots.
    pub(super) fn new(
        verbs: Box<dyn Verbs>,
        matcher: Arc<Matcher>,
        pool: Arc<BufferPool>,
        layout: Layout,
    ) -> Result<Core, String> {
        static IDS: AtomicU64 = AtomicU64::new(1 << 40);
        let (n, slot) = (layout.size, layout.slot_len());
        let peers = n.saturating_sub(1);
        let recv_region = Region::from_vec(vec![0u8; (peers * layout.slots * slot).max(1)]);
        let send_region = Region::from_vec(vec![0u8; (layout.send_slots * slot).max(1)]);
        let locked =
            |e: String| format!("registering the slots: {e} (is `ulimit -l` high enough?)");
        // SAFETY: the regions are the core's, and outlive the registrations
        // (fields drop in order: the registrations first).
        let (recv_reg, send_reg) = unsafe {
            (
                verbs
                    .register(recv_region.as_ptr(), recv_region.len(), true)
                    .map_err(locked)?,
                verbs
                    .register(send_region.as_ptr(), send_region.len(), false)
                    .map_err(locked)?,
            )
        };
        let free = (0..layout.send_slots)
            .map(|i| send_region.write(i * slot..(i + 1) * slot))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let core = Core {
            verbs,
            state: Mutex::new(State {
                free,
                credits: vec![layout.sq_depth; n],
                ctrl: (0..n).map(|_| VecDeque::new()).collect(),
                dead: vec![false; n],
                ..State::default()
            }),
            progressing: Mutex::new(()),
            recv_reg,
            send_reg,
            recv_region,
            _send_region: send_region,
            matcher,
            pool,
            room: Notify::new(),
            wake: Notify::new(),
            layout,
            reg_id: IDS.fetch_add(1, Ordering::Relaxed) as usize,
            closing: AtomicBool::new(false),
            sent: (0..n).map(|_| AtomicU64::new(0)).collect(),
            received: (0..n).map(|_| AtomicU64::new(0)).collect(),
            posted_landed: AtomicU64::new(0),
        };
        for peer in core.peers() {
            core.verbs
                .modify_qp(peer, &proto::init_step(proto::PORT))
                .map_err(|e| format!("queue pair to {peer}: INIT: {e}"))?;
            for s in 0..layout.slots {
                let i = core.slot_index(peer, s);
                let mem = core
                    .recv_region
                    .write(i * slot..(i + 1) * slot)
                    .map_err(|e| e.to_string())?;
                core.repost(peer, s as u32, mem)?;
            }
        }
        Ok(core)
    }

    /// The other ranks.
    pub(super) fn peers(&self) -> impl Iterator<Item = Rank> {
        let me = self.layout.me;
        (0..self.layout.size as u32)
            .map(Rank)
            .filter(move |&r| r != me)
    }

    fn slot_index(&self, peer: Rank, slot: usize) -> usize {
        let p = if peer > self.layout.me {
            peer.idx() - 1
        } else {
            peer.idx()
        };
        p * self.layout.slots + slot
    }

    /// The info to send `peer` for the pair to it.
    pub(super) fn info(&self, peer: Rank, psn: u32) -> QpInfo {
        let port = self.verbs.port();
        QpInfo {
            qpn: self.verbs.qp_num(peer),
            psn,
            lid: port.lid,
            mtu: port.mtu,
            gid: port.gid,
            eager_max: self.layout.eager_max as u32,
        }
    }

    /// Moves the pair to `peer` to RTR and RTS with its info.
    pub(super) fn connect_qp(&self, peer: Rank, psn: u32, remote: &QpInfo) -> Result<(), String> {
        for step in proto::connect_steps(&self.verbs.port(), psn, remote) {
            self.verbs
                .modify_qp(peer, &step)
                .map_err(|e| format!("queue pair to {peer}: {e}"))?;
        }
        Ok(())
    }

    /// (Re)posts eager slot `slot` of `peer`, held by its entry.
    pub(super) fn repost(&self, peer: Rank, slot: u32, mut mem: MemMut) -> Result<(), String> {
        let wr = proto::slot_recv(peer, slot, sge_of(mem.as_mut_slice(), &self.recv_reg));
        let mut st = lock(&self.state);
        if st.dead[peer.idx()] {
            return Ok(()); // the slot rests: the pair is gone
        }
        st.pending.insert(wr.wr_id, Pending::Slot { mem });
        // SAFETY: the slot's memory is held by its entry (inserted above,
        // under the lock that completions take) until its completion.
        if let Err(e) = unsafe { self.verbs.post_recv(peer, &wr) } {
            st.pending.remove(&wr.wr_id);
            return Err(e);
        }
        Ok(())
    }

    /// The registration of `region` (made once, kept in it), for remote
    /// writes if `write`.
    pub(super) fn region_reg(&self, region: &Arc<Region>, write: bool) -> Result<Arc<Reg>, String> {
        if let Some(r) = region.registration(self.reg_id) {
            if let Ok(reg) = r.downcast::<Reg>() {
                if reg.remote_write || !write {
                    return Ok(reg);
                }
            }
        }
        // SAFETY: the region keeps the registration (dropped with it), and
        // every request that names its memory holds a share of it, so the
        // memory is allocated while a request may use it.
        let rw = unsafe { self.verbs.register(region.as_ptr(), region.len(), true) };
        let reg = match rw {
            Ok(r) => r,
            // a read-only region (immutable bytes) cannot be pinned for
            // writing: registered for sends only
            Err(_) if !write => {
                // SAFETY: as above.
                unsafe { self.verbs.register(region.as_ptr(), region.len(), false) }?
            }
            Err(e) => return Err(e),
        };
        let reg = Arc::new(reg);
        region.set_registration(self.reg_id, reg.clone());
        Ok(reg)
    }

    /// A registration for a send's payload above the eager limit.
    fn payload_reg(&self, payload: &Hold) -> Result<Arc<Reg>, String> {
        match payload {
            Hold::Mem(m) => self.region_reg(m.region(), false),
            Hold::Bytes(b) => {
                // SAFETY: the registration is held next to the bytes, in
                // the send's entry, and dropped with them.
                unsafe { self.verbs.register(b.as_ptr(), b.len(), false) }.map(Arc::new)
            }
        }
    }

    fn next_seq(st: &mut State) -> u32 {
        st.next_seq = st.next_seq.wrapping_add(1);
        st.next_seq
    }

    fn next_rid(st: &mut State) -> u32 {
        loop {
            st.next_rid = (st.next_rid + 1) & ((1 << RID_BITS) - 1);
            if !st.rdv.contains_key(&st.next_rid) {
                return st.next_rid;
            }
        }
    }

    /// Posts `wrs` on the pair to `peer` with `entry` holding their memory
    /// (keyed by the last, signaled one); gives the entry's slot back and
    /// says why if the post failed.
    fn post_locked(
        &self,
        st: &mut State,
        peer: Rank,
        wrs: &[proto::SendWr],
        entry: Pending,
    ) -> Result<(), String> {
        let id = wrs.last().expect("one request at least").wr_id;
        st.credits[peer.idx()] -= wrs.len();
        st.pending.insert(id, entry);
        // SAFETY: every buffer named is held by the entry just inserted,
        // under the lock completions take, until its completion: a send
        // slot, a payload with its registration, or none.
        match unsafe { self.verbs.post_send(peer, wrs) } {
            Ok(()) => Ok(()),
            Err(e) => {
                st.credits[peer.idx()] += wrs.len();
                if let Some(Pending::Send {
                    slot: Some(slot), ..
                }) = st.pending.remove(&id)
                {
                    st.free.push(slot);
                }
                Err(format!("post to {peer}: {e}"))
            }
        }
    }

    /// Posts what waits in `peer`'s control queue, as far as credits and
    /// slots allow.
    pub(super) fn drain_ctrl(&self, st: &mut State, peer: Rank) -> Result<(), String> {
        let p = peer.idx();
        loop {
            let Some(c) = st.ctrl[p].front() else {
                return Ok(());
            };
            let slot_needed = matches!(c, Ctrl::Ready(_));
            if st.dead[p] || st.credits[p] == 0 || (slot_needed && st.free.is_empty()) {
                return Ok(());
            }
            let c = st.ctrl[p].pop_front().expect("front seen");
            let seq = Self::next_seq(st);
            let (imm, slot) = match c {
                Ctrl::Ready(r) => {
                    let mut slot = st.free.pop().expect("checked");
                    slot.as_mut_slice()[..Ready::LEN].copy_from_slice(&r.encode());
                    (Imm::Ready(r.rid), Some(slot))
                }
                Ctrl::Cancel(rid) => (Imm::Cancel(rid), None),
                Ctrl::CancelAck(rid) => (Imm::CancelAck(rid), None),
            };
            let sge = slot
                .as_ref()
                .map(|s| sge_of(&s.as_slice()[..Ready::LEN], &self.send_reg));
            let wr = proto::message(peer, seq, imm, sge);
            let entry = Pending::Send {
                done: None,
                credits: 1,
                slot,
                _payload: None,
                _reg: None,
            };
            self.post_locked(st, peer, &[wr], entry)?;
        }
    }

    /// Queues a control message to `peer` and posts what can go.
    pub(super) fn send_ctrl(&self, peer: Rank, c: Ctrl) {
        let r = {
            let mut st = lock(&self.state);
            if st.dead[peer.idx()] {
                return;
            }
            st.ctrl[peer.idx()].push_back(c);
            self.drain_ctrl(&mut st, peer)
        };
        if let Err(why) = r {
            self.lose(peer, why, true);
        }
        self.wake.notify_one();
    }

    /// Whether a send to `to` may go on.
    fn usable(&self, st: &State, to: Rank) -> Result<(), TransportError> {
        if self.closing.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        if let Some(reason) = self.matcher.lost_reason(to) {
            return Err(TransportError::PeerLost { peer: to, reason });
        }
        if st.dead[to.idx()] {
            return Err(TransportError::PeerLost {
                peer: to,
                reason: "the queue pair is in the error state".into(),
            });
        }
        Ok(())
    }

    /// Sends a frame: into an eager slot of the peer (copied into a send
    /// slot here), or, above the eager limit, straight from `payload` into
    /// the receive the peer posted for it, once its `Ready` came.
    /// Resolves at the send's completion: the peer's adapter has it.
    pub(super) async fn send(
        self: &Arc<Self>,
        to: Rank,
        header: Header,
        payload: Hold,
    ) -> Result<(), TransportError> {
        let len = payload.as_slice().len();
        let mut header = header;
        header.len = len as u64;
        let lost = |why: String| TransportError::PeerLost {
            peer: to,
            reason: why.into(),
        };
        let reg = if len > self.layout.eager_max {
            let reg = self
                .payload_reg(&payload)
                .map_err(|why| unavailable(format!("registering a send's memory: {why}")))?;
            if !reg.covers(payload.as_slice().as_ptr() as u64, len) {
                return Err(lost(format!("payload outside its registration {reg:?}")));
            }
            Some(reg)
        } else {
            None
        };
        let key = FrameKey {
            tag: header.tag,
            chunk: header.chunk,
            step: header.step,
        };
        let mut payload = Some(payload);
        let rx = loop {
            let room = self.room.notified();
            let tried = {
                let mut st = lock(&self.state);
                self.usable(&st, to)?;
                self.try_send(&mut st, to, &header, key, &mut payload, &reg)
            };
            match tried {
                Ok(Some(rx)) => break rx,
                Ok(None) => room.await,
                Err(why) => {
                    self.lose(to, why.clone(), true);
                    return Err(lost(why));
                }
            }
        };
        self.wake.notify_one();
        match rx.await {
            Ok(Ok(())) => {
                self.sent[to.idx()].fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            _ if self.closing.load(Ordering::Acquire) => Err(TransportError::Closed),
            Ok(Err(why)) => {
                self.lose(to, format!("write: {why}"), true);
                let reason = self.matcher.lost_reason(to).unwrap_or(why.into());
                Err(TransportError::PeerLost { peer: to, reason })
            }
            Err(_) => Err(TransportError::Closed),
        }
    }

    /// Posts the frame if what it needs is there (`Ok(None)`: wait).
    fn try_send(
        &self,
        st: &mut State,
        to: Rank,
        header: &Header,
        key: FrameKey,
        payload: &mut Option<Hold>,
        reg: &Option<Arc<Reg>>,
    ) -> Result<Option<oneshot::Receiver<Result<(), String>>>, String> {
        let p = to.idx();
        let len = header.len as usize;
        let rendezvous = reg.is_some();
        let ready_there = !rendezvous || st.readies.contains_key(&(to, key));
        let credits = if rendezvous { 2 } else { 1 };
        if !st.ctrl[p].is_empty() || st.credits[p] < credits || st.free.is_empty() || !ready_there {
            return Ok(None);
        }
        let mut slot = st.free.pop().expect("checked");
        let buf = slot.as_mut_slice();
        buf[..HEADER_LEN].copy_from_slice(&header.encode());
        let seq = Self::next_seq(st);
        let (tx, rx) = oneshot::channel();
        let (wrs, kept, kept_reg) = match reg {
            None => {
                let data = payload.take().expect("not sent yet");
                buf[HEADER_LEN..HEADER_LEN + len].copy_from_slice(data.as_slice());
                let sge = sge_of(&slot.as_slice()[..HEADER_LEN + len], &self.send_reg);
                (
                    vec![proto::message(to, seq, Imm::Eager, Some(sge))],
                    None,
                    None,
                )
            }
            Some(reg) => {
                let q = st.readies.get_mut(&(to, key)).expect("checked");
                let ready = q.pop_front().expect("queues are never empty");
                if q.is_empty() {
                    st.readies.remove(&(to, key));
                }
                let data = payload.take().expect("not sent yet");
                let head = sge_of(&slot.as_slice()[..HEADER_LEN], &self.send_reg);
                let body = sge_of(data.as_slice(), reg);
                let wrs = if ready.len == len as u64 {
                    proto::rendezvous(to, seq, body, &ready, head).to_vec()
                } else {
                    // the peer posted another length: the header alone
                    // tells it so (it fails the frame as a violation)
                    vec![proto::message(to, seq, Imm::Done(ready.rid), Some(head))]
                };
                (wrs, Some(data), Some(reg.clone()))
            }
        };
        let entry = Pending::Send {
            done: Some(tx),
            credits: wrs.len(),
            slot: Some(slot),
            _payload: kept,
            _reg: kept_reg,
        };
        self.post_locked(st, to, &wrs, entry)?;
        Ok(Some(rx))
    }

    /// Takes a receive posted for a frame above the eager limit: registers
    /// its memory and tells the sender where to write it. Smaller ones go
    /// back to the matcher, and so do those it refuses or drops (a lost
    /// peer, an older epoch, a retired op, a closed endpoint).
    pub(super) fn post(&self, key: RecvKey, mem: MemMut) -> Result<Option<MemMut>, TransportError> {
        let from = key.from;
        if mem.len() <= self.layout.eager_max
            || from.idx() >= self.layout.size
            || from == self.layout.me
            || self.closing.load(Ordering::Acquire)
            || self.matcher.lost_reason(from).is_some()
            || !self.matcher.wants(key.tag)
        {
            return Ok(Some(mem));
        }
        let reg = self
            .region_reg(mem.region(), true)
            .map_err(|why| unavailable(format!("registering receive memory: {why}")))?;
        let addr = mem.region().as_ptr() as u64 + mem.range().start as u64;
        if !reg.covers(addr, mem.len()) {
            return Err(unavailable(format!(
                "a receive outside its registration {reg:?}"
            )));
        }
        let r = {
            let mut st = lock(&self.state);
            if st.dead[from.idx()] {
                return Ok(Some(mem));
            }
            let rid = Self::next_rid(&mut st);
            let ready = Ready {
                key: FrameKey {
                    tag: key.tag,
                    chunk: key.chunk,
                    step: key.step,
                },
                len: mem.len() as u64,
                addr,
                rkey: reg.rkey,
                rid,
            };
            st.rdv.insert(
                rid,
                Rdv {
                    key,
                    mem,
                    _reg: reg,
                    cancelled: false,
                },
            );
            st.ctrl[from.idx()].push_back(Ctrl::Ready(ready));
            self.drain_ctrl(&mut st, from)
        };
        if let Err(why) = r {
            self.lose(from, why, true);
        }
        self.wake.notify_one();
        Ok(None)
    }

    /// `peer` is lost: its receives fail, its rendezvous state goes, and,
    /// if `error_qp` (anything but a goodbye), its pair is moved to the
    /// error state first, so that nothing more lands in memory released
    /// here; its work requests then complete as flushed.
    pub(super) fn lose(&self, peer: Rank, why: impl Into<Arc<str>>, error_qp: bool) {
        self.matcher.fail_peer(peer, why);
        let released: Vec<Rdv> = {
            let mut st = lock(&self.state);
            let p = peer.idx();
            let mut safe = !error_qp;
            if error_qp && !st.dead[p] {
                st.dead[p] = true;
                safe = self.verbs.modify_qp(peer, &QpStep::Error).is_ok();
            }
            st.ctrl[p].clear();
            st.readies.retain(|(r, _), _| *r != peer);
            if safe {
                let rids: Vec<u32> = st
                    .rdv
                    .iter()
                    .filter(|(_, r)| r.key.from == peer)
                    .map(|(id, _)| *id)
                    .collect();
                rids.iter().filter_map(|id| st.rdv.remove(id)).collect()
            } else {
                Vec::new()
            }
        };
        drop(released);
        self.room.notify_waiters();
    }

    /// Asks senders to withdraw the receives of ops that ended (retired,
    /// an older epoch, a closed matcher): their memory is released once
    /// the sender answers.
    pub(super) fn cancel_stale(&self) {
        let mut st = lock(&self.state);
        let stale: Vec<(u32, Rank)> = st
            .rdv
            .iter()
            .filter(|(_, r)| !r.cancelled && !self.matcher.wants(r.key.tag))
            .map(|(id, r)| (*id, r.key.from))
            .collect();
        let mut failed = Vec::new();
        for (rid, from) in stale {
            if let Some(r) = st.rdv.get_mut(&rid) {
                r.cancelled = true;
            }
            st.ctrl[from.idx()].push_back(Ctrl::Cancel(rid));
            if let Err(why) = self.drain_ctrl(&mut st, from) {
                failed.push((from, why));
            }
        }
        drop(st);
        for (from, why) in failed {
            self.lose(from, why, true);
        }
    }

    /// Stops: every pair to the error state, sends still waiting fail.
    /// Memory the adapter may still touch stays held until the core (and
    /// with it the queue pairs) is dropped.
    pub(super) fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        let dones: Vec<_> = {
            let mut st = lock(&self.state);
            for peer in self.peers() {
                if !st.dead[peer.idx()] {
                    st.dead[peer.idx()] = true;
                    let _ = self.verbs.modify_qp(peer, &QpStep::Error);
                }
                st.ctrl[peer.idx()].clear();
            }
            st.readies.clear();
            st.pending
                .values_mut()
                .filter_map(|p| match p {
                    Pending::Send { done, .. } => done.take(),
                    Pending::Slot { .. } => None,
                })
                .collect()
        };
        for d in dones {
            let _ = d.send(Err("the wire is shut down".into()));
        }
        self.room.notify_waiters();
        self.wake.notify_one();
    }

    /// Frame sends posted and not completed.
    pub(super) fn sends_in_flight(&self) -> usize {
        let st = lock(&self.state);
        st.pending
            .values()
            .filter(|p| matches!(p, Pending::Send { done: Some(_), .. }))
            .count()
    }
}

/// The error of memory that cannot be registered (locked-memory limits).
pub(super) fn unavailable(reason: String) -> TransportError {
    TransportError::Unavailable {
        transport: "verbs".into(),
        reason: format!("{reason} (is `ulimit -l` high enough?)"),
    }
}

/// A WrId's entry key: a failed write is looked up by its pair's send.
pub(super) fn entry_key(wr: WrId) -> u64 {
    match wr {
        WrId::Write { peer, seq } => WrId::Send { peer, seq }.encode(),
        other => other.encode(),
    }
}
