//! Rendezvous receives of a verbs wire, the receiver's half: a receive
//! posted for a frame above the eager limit is registered and announced to
//! its sender (`Ready`: where to write, and the receive's id), and
//! withdrawn (`Cancel`) once its op ended; its memory is released when the
//! sender answers.

use std::sync::atomic::Ordering;

use kungfu_topology::Rank;

use super::core::{lock, unavailable, Core, Ctrl, Rdv, State};
use super::proto::{FrameKey, Ready, RID_BITS};
use crate::endpoint::RecvKey;
use crate::region::MemMut;
use crate::TransportError;

impl Core {
    fn next_rid(st: &mut State) -> u32 {
        loop {
            st.next_rid = (st.next_rid + 1) & ((1 << RID_BITS) - 1);
            if !st.rdv.contains_key(&st.next_rid) {
                return st.next_rid;
            }
        }
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
}
