//! The state of a verbs wire: the work requests in flight (each with the
//! memory it holds until its completion), the eager slots, the send slots
//! and send-queue credits, and the two halves of the rendezvous (readies
//! waiting for their frames at the sender, posted receives waiting for
//! their writes at the receiver); and what acts on all of it: setting up
//! the queue pairs, registering memory, losing a peer, shutting down.
//! Sending is in `send`, posting rendezvous receives in `posted`; what
//! completions do is in `arrive`; the task that reads them in `progress`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::sync::{oneshot, Notify};

use super::proto::{self, FrameKey, QpInfo, QpStep, Ready, Sge, WrId};
use super::seam::{Reg, Verbs};
use crate::endpoint::{Matcher, RecvKey};
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::{TransportError, HEADER_LEN};

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
    pub(super) next_rid: u32,
    pub(super) next_seq: u32,
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
    pub(super) send_reg: Reg,
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

pub(super) fn sge_of(mem: &[u8], reg: &Reg) -> Sge {
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
