//! What a verbs wire does with its completions: a send's frees its slot,
//! credits and memory and resolves it; a receive's is a message in an
//! eager slot (a frame, or a rendezvous message), acted on and the slot
//! posted again; a failure loses its peer (a flush only says the pair is
//! in error already, which whoever put it there reported).

use std::sync::atomic::Ordering;
use std::sync::{Arc, TryLockError};

use kungfu_topology::Rank;

use super::core::{entry_key, lock, Core, Ctrl, Pending};
use super::proto::{self, Completion, Imm, Ready, WrId};
use crate::region::MemMut;
use crate::{FrameKind, Header, HEADER_LEN};

/// Completions read per call at most (then the caller yields).
const MAX_PER_CALL: usize = 256;

impl Core {
    /// Reads completions and acts on them; how many. `wait`: wait for the
    /// reader's lock if another holds it (the progress task); else return
    /// 0 at once (a receiver's pump: the other reader moves them).
    pub(super) fn progress(self: &Arc<Self>, wait: bool) -> Result<usize, String> {
        let _reading = match self.progressing.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) if wait => {
                self.progressing.lock().unwrap_or_else(|e| e.into_inner())
            }
            Err(TryLockError::WouldBlock) => return Ok(0),
        };
        let mut wcs = Vec::with_capacity(32);
        let mut n = 0;
        while n < MAX_PER_CALL {
            wcs.clear();
            self.verbs.poll_cq(&mut wcs)?;
            if wcs.is_empty() {
                break;
            }
            n += wcs.len();
            for wc in &wcs {
                self.complete(proto::classify(wc));
            }
        }
        if n > 0 {
            self.after_completions();
        }
        Ok(n)
    }

    /// Credits and slots came back: control messages first, then the
    /// sends that wait.
    fn after_completions(&self) {
        let mut failed = Vec::new();
        {
            let mut st = lock(&self.state);
            for peer in self.peers() {
                if !st.ctrl[peer.idx()].is_empty() {
                    if let Err(why) = self.drain_ctrl(&mut st, peer) {
                        failed.push((peer, why));
                    }
                }
            }
        }
        for (peer, why) in failed {
            self.lose(peer, why, true);
        }
        self.room.notify_waiters();
    }

    fn complete(self: &Arc<Self>, c: Completion) {
        match c {
            Completion::Received {
                peer,
                slot,
                msg,
                len,
            } => {
                let entry = lock(&self.state)
                    .pending
                    .remove(&WrId::Slot { peer, slot }.encode());
                if let Some(Pending::Slot { mem }) = entry {
                    self.arrived(peer, slot, mem, msg, len);
                }
            }
            Completion::Sent { peer, seq } => {
                self.finish_send(WrId::Send { peer, seq }.encode(), Ok(()))
            }
            Completion::Failed { wr, flushed, why } => {
                let peer = wr.peer();
                match wr {
                    WrId::Slot { .. } => {
                        // the slot rests: its pair is in error
                        let entry = lock(&self.state).pending.remove(&wr.encode());
                        drop(entry);
                    }
                    WrId::Send { .. } => self.finish_send(wr.encode(), Err(why.clone())),
                    WrId::Write { .. } => {
                        // its pair's send still holds the memory until its
                        // own (flushed) completion; the frame failed now
                        let done = match lock(&self.state).pending.get_mut(&entry_key(wr)) {
                            Some(Pending::Send { done, .. }) => done.take(),
                            _ => None,
                        };
                        if let Some(d) = done {
                            let _ = d.send(Err(why.clone()));
                        }
                    }
                }
                // a flush on a pair the wire did not break (a fatal error
                // of the device or port) is news too
                let ours = peer.idx() < self.layout.size && peer != self.layout.me;
                if ours && (!flushed || !lock(&self.state).dead[peer.idx()]) {
                    self.lose(peer, format!("verbs: {why}"), true);
                }
            }
            Completion::Unknown(_) => {}
        }
    }

    /// The send `id` is over: its credits and slot come back, then it
    /// resolves (its memory released outside the lock).
    fn finish_send(&self, id: u64, r: Result<(), String>) {
        let entry = {
            let mut st = lock(&self.state);
            let mut entry = st.pending.remove(&id);
            if let Some(Pending::Send { credits, slot, .. }) = &mut entry {
                let peer = WrId::decode(id).map_or(0, |w| w.peer().idx());
                if let Some(c) = st.credits.get_mut(peer) {
                    *c += *credits;
                }
                if let Some(s) = slot.take() {
                    st.free.push(s);
                }
            }
            entry
        };
        if let Some(Pending::Send {
            done: Some(done), ..
        }) = entry
        {
            let _ = done.send(r);
        }
    }

    /// A message in eager slot `slot` from `peer`.
    fn arrived(self: &Arc<Self>, peer: Rank, slot: u32, mem: MemMut, msg: Option<Imm>, len: usize) {
        if len > mem.len() {
            // the adapter fails such a receive; a fake might not
            return self.lose(peer, "protocol violation: a message over the slot", true);
        }
        let body = &mem.as_slice()[..len];
        let r = match msg {
            Some(Imm::Eager) => return self.eager(peer, slot, mem, len),
            Some(Imm::Ready(rid)) => self.ready_arrived(peer, rid, body),
            Some(Imm::Done(rid)) => self.done_arrived(peer, rid, body),
            Some(Imm::Cancel(rid)) => {
                self.cancel_arrived(peer, rid);
                Ok(())
            }
            Some(Imm::CancelAck(rid)) => self.cancel_acked(peer, rid),
            None => Err("a message without a known immediate".to_string()),
        };
        match r {
            Ok(()) => self.repost_or_lose(peer, slot, mem),
            Err(why) => self.lose(peer, format!("protocol violation: {why}"), true),
        }
    }

    pub(super) fn repost_or_lose(&self, peer: Rank, slot: u32, mem: MemMut) {
        if let Err(why) = self.repost(peer, slot, mem) {
            self.lose(peer, why, true);
        }
    }

    /// A frame in an eager slot: into a posted receive, or queued; if the
    /// matcher has no room, the slot waits (unposted) until the frame is
    /// taken, and the peer's sends wait for receives (back pressure).
    fn eager(self: &Arc<Self>, peer: Rank, slot: u32, mem: MemMut, len: usize) {
        let header = match len.checked_sub(HEADER_LEN) {
            None => Err("a frame shorter than its header".to_string()),
            Some(plen) => {
                let head: &[u8; HEADER_LEN] = mem.as_slice()[..HEADER_LEN]
                    .try_into()
                    .expect("a slot holds a header");
                match Header::decode(head, self.layout.max_frame) {
                    Ok(h) if h.len as usize == plen && plen <= self.layout.eager_max => Ok(h),
                    Ok(h) => Err(format!(
                        "an eager frame of {plen} bytes whose header says {}",
                        h.len
                    )),
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        let header = match header {
            Ok(h) => h,
            Err(why) => return self.lose(peer, format!("protocol violation: {why}"), true),
        };
        let plen = len - HEADER_LEN;
        let payload = &mem.as_slice()[HEADER_LEN..len];
        let landed = self.matcher.land_parts(peer, &header, &[payload]);
        if landed || self.matcher.has_room(plen) {
            if !landed {
                let mut b = self.pool.take(plen);
                b.as_mut().copy_from_slice(payload);
                let _ = self.matcher.deliver_now(peer, header, b.freeze());
            }
            self.received[peer.idx()].fetch_add(1, Ordering::Relaxed);
            return self.repost_or_lose(peer, slot, mem);
        }
        let mut b = self.pool.take(plen);
        b.as_mut().copy_from_slice(payload);
        let core = self.clone();
        tokio::spawn(async move {
            let _ = core.matcher.deliver(peer, header, b.freeze()).await;
            core.received[peer.idx()].fetch_add(1, Ordering::Relaxed);
            core.repost_or_lose(peer, slot, mem);
        });
    }

    /// At the sender: `peer` posted receive `rid` for one of our frames.
    fn ready_arrived(&self, peer: Rank, rid: u32, body: &[u8]) -> Result<(), String> {
        let r = Ready::decode(body, rid).ok_or("a Ready of the wrong size")?;
        if r.len > self.layout.max_frame as u64 || r.len <= self.layout.eager_max as u64 {
            return Err(format!("a Ready for {} bytes", r.len));
        }
        lock(&self.state)
            .readies
            .entry((peer, r.key))
            .or_default()
            .push_back(r);
        self.room.notify_waiters();
        Ok(())
    }

    /// At the receiver: the frame of receive `rid` is written; its header
    /// is the body.
    fn done_arrived(&self, peer: Rank, rid: u32, body: &[u8]) -> Result<(), String> {
        let rdv = {
            let mut st = lock(&self.state);
            match st.rdv.remove(&rid) {
                Some(r) if r.key.from == peer => r,
                Some(r) => {
                    st.rdv.insert(rid, r);
                    return Err(format!("a write into receive {rid} of another peer"));
                }
                None => return Err(format!("a write into unknown receive {rid}")),
            }
        };
        let head: &[u8; HEADER_LEN] = body.try_into().map_err(|_| "a Done of the wrong size")?;
        let h = Header::decode(head, self.layout.max_frame).map_err(|e| e.to_string())?;
        let k = rdv.key;
        if h.kind != FrameKind::Data
            || h.tag != k.tag
            || h.chunk != k.chunk
            || h.step != k.step
            || h.len != rdv.mem.len() as u64
        {
            return Err(format!(
                "a frame ({} bytes, chunk {} step {}) written into the receive posted for \
                 chunk {} step {} ({} bytes)",
                h.len,
                h.chunk,
                h.step,
                k.chunk,
                k.step,
                rdv.mem.len()
            ));
        }
        self.received[peer.idx()].fetch_add(1, Ordering::Relaxed);
        self.posted_landed.fetch_add(1, Ordering::Relaxed);
        // a cancelled receive whose write came first: the matcher keeps
        // the header as a stray
        self.matcher.landed(peer, h, rdv.mem);
        Ok(())
    }

    /// At the sender: `peer` withdraws receive `rid`. If its Ready is
    /// unused, it goes and the peer is told; if it was used, the `Done`
    /// already went (RC keeps them in order) and answers instead.
    fn cancel_arrived(&self, peer: Rank, rid: u32) {
        let found = {
            let mut st = lock(&self.state);
            let key = st
                .readies
                .iter()
                .find(|((p, _), q)| *p == peer && q.iter().any(|r| r.rid == rid))
                .map(|(k, _)| *k);
            if let Some(k) = key {
                let q = st.readies.get_mut(&k).expect("found");
                q.retain(|r| r.rid != rid);
                if q.is_empty() {
                    st.readies.remove(&k);
                }
            }
            key.is_some()
        };
        if found {
            self.send_ctrl(peer, Ctrl::CancelAck(rid));
        }
    }

    /// At the receiver: the sender will not write receive `rid`: its
    /// memory goes back.
    fn cancel_acked(&self, peer: Rank, rid: u32) -> Result<(), String> {
        let mut st = lock(&self.state);
        match st.rdv.get(&rid) {
            Some(r) if r.key.from == peer && r.cancelled => {
                let r = st.rdv.remove(&rid);
                drop(st);
                drop(r);
                Ok(())
            }
            _ => Err(format!("an ack of receive {rid}, which was not withdrawn")),
        }
    }
}
