//! The sending side of a verbs wire: frames (into an eager slot of the
//! peer, copied through a send slot here; or, above the eager limit,
//! RDMA-written into the receive the peer posted, once its `Ready` came)
//! and the control messages (`Ready`, `Cancel`, `CancelAck`), queued in
//! order per peer, each posted as far as send-queue credits and send slots
//! allow.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kungfu_topology::Rank;
use tokio::sync::oneshot;

use super::core::{lock, sge_of, unavailable, Core, Ctrl, Hold, Pending, State};
use super::proto::{self, FrameKey, Imm, Ready};
use super::seam::Reg;
use crate::{Header, TransportError, HEADER_LEN};

impl Core {
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
}
