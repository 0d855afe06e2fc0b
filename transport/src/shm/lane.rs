//! The lane: a small-contribution channel beside each ring, for the host
//! fast path of the collectives (`kungfu_collectives`' `session/fast.rs`).
//!
//! A ring's file ends in a lane: [`SLOTS`] fixed slots of at most
//! [`SLOT_BYTES`] each. The sender writes an op's whole contribution into
//! the next slot and publishes it with one store; the receiver finds it by
//! its [`OpTag`], reads it where it lies (a reduction straight out of the
//! slot) and releases it. No frame header is parsed, no thread is woken,
//! nothing is copied into an owned buffer: a flag polled by the receiver is
//! the whole protocol, as in Open MPI's shared-memory component.
//!
//! # Layout (offsets from the lane's start)
//!
//! - `0`: `acked`, u64, written by the receiver: every slot below it (in
//!   the order the sender published them) is released.
//! - `64`: the data bell (u32), rung by the sender after each publish,
//!   and at `68` the count of the receiver's threads asleep on it; `72`:
//!   the release bell, rung by the receiver when `acked` moves, and at
//!   `76` the count of the sender's threads asleep on it (see
//!   [`super::bell`]).
//! - `CTL_LEN + i * SLOT_LEN`: slot `i`: a header line, then the payload.
//!   The header's `seq` (u64) is `k + 1` once the sender published its
//!   `k`-th contribution there (`k mod SLOTS == i`); the other words (tag,
//!   digest, length) are written before it and read after it.
//!
//! # Order and liveness
//!
//! The sender fills slots in order and may reuse slot `k mod SLOTS` once
//! `acked > k - SLOTS`. The receiver may take slots in any order (ops are
//! matched by tag, not position) and releases them in any order; `acked`
//! moves over the released prefix. A slot the receiver has no op for yet
//! holds the window; when every slot is published and none is the one it
//! looks for, the receiver copies them all out into its stash (bounded,
//! [`STASH_BYTES`]), claimed ones too (their ops then read them there), so
//! that a sender is never kept waiting by ops its receiver issues later or
//! by ops that wait for a third rank: no order of ops deadlocks.
//!
//! # Trust
//!
//! As for the ring: the other side may write anything. `seq` must be
//! exactly the expected count, lengths are checked against [`SLOT_BYTES`],
//! `acked` against what was published, and the stash is bounded; what
//! fails is an error naming the peer, never a read outside the mapping.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kungfu_topology::Rank;

use super::bell;
use super::ring::{Ring, RECEIVER_CLOSED, SENDER_CLOSED};
use crate::{Epoch, OpId, OpTag, TransportError};

/// Slots per lane. At most 64 (the receiver's masks are u64).
pub const SLOTS: usize = 8;
/// Largest contribution a slot holds (a split allreduce's slice: the
/// collectives' fast path takes allreduce up to about `n` slots).
pub const SLOT_BYTES: usize = 256 << 10;
/// Bytes a receiver copies out of its lanes at most (ops it has not
/// started yet), per peer.
pub const STASH_BYTES: usize = 64 << 20;
const CTL_LEN: usize = 128;
const HDR: usize = 64;
const SLOT_LEN: usize = HDR + SLOT_BYTES;
/// Bytes of a lane.
pub const LANE_LEN: usize = CTL_LEN + SLOTS * SLOT_LEN;

const OFF_ACKED: usize = 0;
const OFF_BELL: usize = 64;
const OFF_RX_SLEEPERS: usize = 68;
const OFF_ACK_BELL: usize = 72;
const OFF_TX_SLEEPERS: usize = 76;
const H_SEQ: usize = 0;
const H_OP: usize = 8;
const H_EPOCH: usize = 16;
const H_TAG_SEQ: usize = 20;
const H_DIGEST: usize = 24;
const H_LEN: usize = 28;

/// A view of one ring's lane (pointer arithmetic and atomics only).
struct Lane {
    ring: Arc<Ring>,
}

// SAFETY: every access through the lane's pointer is an atomic word or a
// copy of a slot's payload that the protocol gives to one side at a time;
// the ring keeps the mapping alive.
unsafe impl Send for Lane {}
// SAFETY: as for `Send`; the sides are serialised by `HostLanes`' locks.
unsafe impl Sync for Lane {}

impl Lane {
    fn base(&self) -> NonNull<u8> {
        self.ring.lane()
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= LANE_LEN);
        // SAFETY: the lane is LANE_LEN bytes at a page-aligned address;
        // `off` is 8-aligned inside it (checked), and both processes
        // access these words only atomically.
        unsafe { &*(self.base().as_ptr().add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off.is_multiple_of(4) && off + 4 <= LANE_LEN);
        // SAFETY: as for `u64_at`, 4-aligned.
        unsafe { &*(self.base().as_ptr().add(off) as *const AtomicU32) }
    }

    fn slot(k: u64) -> usize {
        CTL_LEN + (k % SLOTS as u64) as usize * SLOT_LEN
    }

    fn payload(&self, k: u64) -> *mut u8 {
        // SAFETY: slot(k) + HDR + SLOT_BYTES <= LANE_LEN for every k.
        unsafe { self.base().as_ptr().add(Lane::slot(k) + HDR) }
    }

    /// The published header of contribution `k`, if published.
    fn header(&self, k: u64) -> Option<(OpTag, u32, u32)> {
        let s = Lane::slot(k);
        if self.u64_at(s + H_SEQ).load(Ordering::Acquire) != k.wrapping_add(1) {
            return None;
        }
        let tag = OpTag {
            epoch: Epoch(self.u32_at(s + H_EPOCH).load(Ordering::Relaxed)),
            op: OpId(self.u64_at(s + H_OP).load(Ordering::Relaxed)),
            seq: self.u32_at(s + H_TAG_SEQ).load(Ordering::Relaxed),
        };
        let digest = self.u32_at(s + H_DIGEST).load(Ordering::Relaxed);
        let len = self.u32_at(s + H_LEN).load(Ordering::Relaxed);
        Some((tag, digest, len))
    }
}

/// Where a receiver found a contribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// In the lane, contribution number `k` (claimed until released).
    Slot { k: u64, digest: u32, len: usize },
    /// Copied out earlier into the stash.
    Stash { digest: u32, len: usize },
}

impl Found {
    /// The digest the sender put beside it.
    pub fn digest(&self) -> u32 {
        match *self {
            Found::Slot { digest, .. } | Found::Stash { digest, .. } => digest,
        }
    }

    pub fn len(&self) -> usize {
        match *self {
            Found::Slot { len, .. } | Found::Stash { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Tx {
    lane: Lane,
    /// Contributions published so far.
    posted: u64,
}

struct Rx {
    lane: Lane,
    /// The first contribution not yet released (`acked`).
    next: u64,
    /// Released, and claimed, contributions `next + i` (bit `i`).
    released: u64,
    claimed: u64,
    stash: HashMap<OpTag, (u32, Vec<u8>)>,
    stash_bytes: usize,
}

/// This rank's lanes to and from every other rank of the host: what the
/// collectives' fast path posts into and takes from. Every method is
/// non-blocking.
pub struct HostLanes {
    rank: Rank,
    tx: Vec<Option<Mutex<Tx>>>,
    rx: Vec<Option<Mutex<Rx>>>,
    /// Every lane both ways, for their bells (atomics only, no lock): the
    /// first `inbound` are this rank's inbound lanes.
    bells: Vec<Lane>,
    inbound: usize,
}

fn lost(peer: Rank, why: String) -> TransportError {
    TransportError::PeerLost {
        peer,
        reason: format!("shared-memory lane: {why}").into(),
    }
}

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostLanes {
    /// Lanes over every outbound and inbound ring (`None` at this rank).
    pub(super) fn new(
        rank: Rank,
        outbound: &[Option<Arc<Ring>>],
        inbound: &[Option<Arc<Ring>>],
    ) -> HostLanes {
        let tx = outbound
            .iter()
            .map(|r| {
                r.clone().map(|ring| {
                    Mutex::new(Tx {
                        lane: Lane { ring },
                        posted: 0,
                    })
                })
            })
            .collect();
        let rx = inbound
            .iter()
            .map(|r| {
                r.clone().map(|ring| {
                    Mutex::new(Rx {
                        lane: Lane { ring },
                        next: 0,
                        released: 0,
                        claimed: 0,
                        stash: HashMap::new(),
                        stash_bytes: 0,
                    })
                })
            })
            .collect();
        let bells = inbound
            .iter()
            .chain(outbound)
            .flatten()
            .map(|ring| Lane { ring: ring.clone() })
            .collect();
        HostLanes {
            rank,
            tx,
            rx,
            bells,
            inbound: inbound.iter().flatten().count(),
        }
    }
}

impl HostLanes {
    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.tx.len()
    }

    /// Whether every other rank has a lane both ways.
    pub fn complete(&self) -> bool {
        (0..self.size()).all(|r| {
            r == self.rank.idx()
                || (self.tx.get(r).is_some_and(Option::is_some)
                    && self.rx.get(r).is_some_and(Option::is_some))
        })
    }

    fn tx(&self, to: Rank) -> Result<&Mutex<Tx>, TransportError> {
        let size = self.size();
        self.tx
            .get(to.idx())
            .and_then(Option::as_ref)
            .ok_or(TransportError::NoSuchPeer { peer: to, size })
    }

    fn rx(&self, from: Rank) -> Result<&Mutex<Rx>, TransportError> {
        let size = self.size();
        self.rx
            .get(from.idx())
            .and_then(Option::as_ref)
            .ok_or(TransportError::NoSuchPeer { peer: from, size })
    }

    /// Publishes `payload` (at most [`SLOT_BYTES`]) for op `tag` to `to`;
    /// `Ok(false)`: every slot is taken, try again later.
    pub fn post(
        &self,
        to: Rank,
        tag: OpTag,
        digest: u32,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        self.post_parts(to, tag, digest, &[payload])
    }

    /// [`HostLanes::post`] of the parts one after another, as one
    /// contribution (copied straight into the slot).
    pub fn post_parts(
        &self,
        to: Rank,
        tag: OpTag,
        digest: u32,
        parts: &[&[u8]],
    ) -> Result<bool, TransportError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > SLOT_BYTES {
            return Err(TransportError::FrameTooLarge {
                len,
                max: SLOT_BYTES,
            });
        }
        let mut tx = lock(self.tx(to)?);
        let closed = tx.lane.ring.closed();
        if closed & SENDER_CLOSED != 0 {
            return Err(TransportError::Closed); // this side shut down
        }
        if closed & RECEIVER_CLOSED != 0 {
            return Err(lost(to, "the peer closed its end".into()));
        }
        let k = tx.posted;
        let acked = tx.lane.u64_at(OFF_ACKED).load(Ordering::Acquire);
        let out = k.wrapping_sub(acked);
        if out > SLOTS as u64 {
            return Err(lost(
                to,
                format!("released {acked} contributions of {k} sent"),
            ));
        }
        if out == SLOTS as u64 {
            return Ok(false);
        }
        let s = Lane::slot(k);
        let l = &tx.lane;
        l.u64_at(s + H_OP).store(tag.op.0, Ordering::Relaxed);
        l.u32_at(s + H_EPOCH).store(tag.epoch.0, Ordering::Relaxed);
        l.u32_at(s + H_TAG_SEQ).store(tag.seq, Ordering::Relaxed);
        l.u32_at(s + H_DIGEST).store(digest, Ordering::Relaxed);
        l.u32_at(s + H_LEN).store(len as u32, Ordering::Relaxed);
        let mut at = 0;
        for p in parts {
            // SAFETY: the slot's payload is SLOT_BYTES (>= the parts'
            // total, checked) inside the mapping, and `at + p.len()` is at
            // most that total; the receiver released the slot
            // (acked > k - SLOTS) and reads it only after the store below.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), l.payload(k).add(at), p.len());
            }
            at += p.len();
        }
        l.u64_at(s + H_SEQ)
            .store(k.wrapping_add(1), Ordering::Release);
        bell::ring(l.u32_at(OFF_BELL), l.u32_at(OFF_RX_SLEEPERS), true);
        tx.posted = k.wrapping_add(1);
        Ok(true)
    }

    /// Looks for `from`'s contribution to op `tag` and claims it; `None`
    /// while it has not come. A claimed contribution stays readable
    /// ([`HostLanes::read`]) until [`HostLanes::release`].
    pub fn find(&self, from: Rank, tag: OpTag) -> Result<Option<Found>, TransportError> {
        let mut rx = lock(self.rx(from)?);
        if let Some((digest, v)) = rx.stash.get(&tag) {
            return Ok(Some(Found::Stash {
                digest: *digest,
                len: v.len(),
            }));
        }
        let mut published = 0;
        for i in 0..SLOTS {
            let k = rx.next.wrapping_add(i as u64);
            if rx.released & (1 << i) != 0 {
                published += 1;
                continue;
            }
            let Some((t, digest, len)) = rx.lane.header(k) else {
                break; // published in order: nothing after it either
            };
            published += 1;
            if len as usize > SLOT_BYTES {
                return Err(lost(
                    from,
                    format!("contribution of {len} bytes, at most {SLOT_BYTES}"),
                ));
            }
            if t == tag && rx.claimed & (1 << i) == 0 {
                rx.claimed |= 1 << i;
                return Ok(Some(Found::Slot {
                    k,
                    digest,
                    len: len as usize,
                }));
            }
        }
        if published == SLOTS {
            rx.spill(from)?;
        }
        // Nothing here: what was published before a close is still read.
        let closed = rx.lane.ring.closed();
        if closed & RECEIVER_CLOSED != 0 {
            return Err(TransportError::Closed); // this side shut down
        }
        if closed & SENDER_CLOSED != 0 {
            return Err(lost(from, "the peer closed its end".into()));
        }
        Ok(None)
    }

    /// Runs `f` on the bytes of a contribution [`HostLanes::find`] claimed.
    pub fn read<R>(
        &self,
        from: Rank,
        tag: OpTag,
        found: &Found,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TransportError> {
        let rx = lock(self.rx(from)?);
        match *found {
            Found::Slot { k, .. } if rx.spilled(k) => match rx.stash.get(&tag) {
                Some((_, v)) => Ok(f(v)),
                None => Err(lost(from, "a stashed contribution went missing".into())),
            },
            Found::Stash { .. } => match rx.stash.get(&tag) {
                Some((_, v)) => Ok(f(v)),
                None => Err(lost(from, "a stashed contribution went missing".into())),
            },
            Found::Slot { k, len, .. } => {
                let p = rx.lane.payload(k);
                // SAFETY: `len <= SLOT_BYTES` (checked in `find`) bytes of
                // the slot's payload, inside the mapping; the slot is
                // claimed and unreleased, so the sender does not reuse it
                // (a peer that does anyway changes only the values read).
                let bytes = unsafe { std::slice::from_raw_parts(p, len.min(SLOT_BYTES)) };
                Ok(f(bytes))
            }
        }
    }

    /// Gives a claimed contribution back: its slot may be reused.
    pub fn release(&self, from: Rank, tag: OpTag, found: &Found) {
        let Ok(rx) = self.rx(from) else { return };
        let mut rx = lock(rx);
        match *found {
            Found::Slot { k, .. } if rx.spilled(k) => {
                if let Some((_, v)) = rx.stash.remove(&tag) {
                    rx.stash_bytes -= v.len();
                }
            }
            Found::Stash { .. } => {
                if let Some((_, v)) = rx.stash.remove(&tag) {
                    rx.stash_bytes -= v.len();
                }
            }
            Found::Slot { k, .. } => {
                let i = k.wrapping_sub(rx.next);
                if i < SLOTS as u64 {
                    rx.released |= 1 << i;
                    rx.claimed &= !(1 << i);
                    rx.advance();
                }
            }
        }
    }
}

impl Rx {
    /// Whether claimed contribution `k` was copied into the stash since
    /// (its slot is no longer in the window, or released).
    fn spilled(&self, k: u64) -> bool {
        let i = k.wrapping_sub(self.next);
        i >= SLOTS as u64 || self.released & (1 << i) != 0
    }

    /// Moves `acked` over the released prefix.
    fn advance(&mut self) {
        let n = self.released.trailing_ones();
        if n == 0 {
            return;
        }
        self.released = self.released.checked_shr(n).unwrap_or(0);
        self.claimed = self.claimed.checked_shr(n).unwrap_or(0);
        self.next = self.next.wrapping_add(u64::from(n));
        self.lane
            .u64_at(OFF_ACKED)
            .store(self.next, Ordering::Release);
        bell::ring(
            self.lane.u32_at(OFF_ACK_BELL),
            self.lane.u32_at(OFF_TX_SLEEPERS),
            true,
        );
    }

    /// Every slot is published and none is wanted now: copies them into
    /// the stash (claimed ones too), so that the sender can go on.
    fn spill(&mut self, from: Rank) -> Result<(), TransportError> {
        for i in 0..SLOTS {
            let bit = 1u64 << i;
            if self.released & bit != 0 {
                continue;
            }
            let k = self.next.wrapping_add(i as u64);
            let Some((tag, digest, len)) = self.lane.header(k) else {
                break;
            };
            let len = (len as usize).min(SLOT_BYTES);
            if self.stash_bytes + len > STASH_BYTES {
                return Err(lost(
                    from,
                    format!(
                        "more than {STASH_BYTES} bytes of contributions to ops not started here"
                    ),
                ));
            }
            // SAFETY: as in `HostLanes::read`: `len` bytes of a published,
            // unreleased slot.
            let v = unsafe { std::slice::from_raw_parts(self.lane.payload(k), len) }.to_vec();
            if self.stash.contains_key(&tag) {
                return Err(lost(from, format!("two contributions to op {tag:?}")));
            }
            self.stash.insert(tag, (digest, v));
            self.stash_bytes += len;
            self.released |= bit;
            self.claimed &= !bit;
        }
        self.advance();
        Ok(())
    }
}

mod doors;
#[cfg(test)]
mod tests;

pub use doors::Armed;
