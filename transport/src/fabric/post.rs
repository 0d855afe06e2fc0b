//! Posting on a fabric wire: the eager receive slots, sends, and receives
//! posted for one frame, each entered in the pending table with the memory
//! it holds.
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

use std::os::raw::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kungfu_topology::Rank;
use tokio::sync::oneshot;

use super::core::{lock, Core, Hold, Kind, Op, Slot};
use super::ofi::Posted;
use crate::endpoint::RecvKey;
use crate::region::MemMut;
use crate::{Header, TransportError, HEADER_LEN};

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

impl Core {
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
    pub(super) fn repost(self: &Arc<Self>, slot: usize) -> Result<(), String> {
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
}
