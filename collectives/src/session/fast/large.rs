//! Large ops of the host fast path: one copy through cross-memory attach
//! ([`kungfu_transport::shm::cma`]).
//!
//! The lanes carry only small messages here, in phases: first where each
//! rank's working buffer is (its pid, address and length), then "my part
//! is ready", then "I am done reading yours". The bytes themselves move
//! with one `process_vm_readv` straight from a peer's buffer:
//!
//! - **allreduce**: rank `r` reduces into slice `r` (1/n) of its own
//!   buffer, which holds its own values, the same slice of every peer's,
//!   in rank order, a cache-sized chunk copied at a time (phase 0); once
//!   every slice is reduced it
//!   copies the other slices out of their owners' buffers (phase 1; a
//!   monitored op's "ready" carries the two sums of squares of its
//!   reduction, `norms.rs`); it gives its buffer back once every peer has
//!   copied its slice (phase 2).
//!   Each byte is read about twice and written about twice: the two memory
//!   passes of the bound, where a ring through shared memory takes four.
//! - **broadcast**: every rank posts its descriptor to every other, so
//!   that each checks every rank's digest, and copies the root's buffer
//!   (phase 0); the root waits until all have (phase 1).
//! - **allgather**: every rank copies every peer's block (phase 0), then
//!   waits until every peer has copied its own (phase 1).
//!
//! A phase's work runs inside the engine's progress (under its lock): other
//! fast ops of the session wait for it, for the time of one copy.
//!
//! Broadcast and allgather take it by default, allreduce from
//! [`crate::LARGE_ALLREDUCE_FROM`] (`SessionConfig::fast_large`,
//! [`crate::FastLarge`]): measured on this project's 2-core machines, one
//! copy from the owner's buffer beats the rings of the message path (a
//! 1 to 4 MiB allreduce in 0.68-0.88 of their time, see there). Each
//! `process_vm_readv` pins the pages it reads, and the phases run one
//! after another where the ring pipelines. Buffers in shared memory (a
//! window every rank maps) would read with plain loads.
//!
//! A rank whose op fails (a timeout, a lost peer) gives its buffer back at
//! once, while a peer that found its descriptor may still be reading it:
//! each copy is followed by a read of the owner's alive word
//! ([`Large::alive`]), which the owner clears before it gives the buffer
//! back, so such a copy fails the peer's op instead of delivering stale
//! or reused bytes.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use kungfu_topology::{fnv1a64, Rank};
use kungfu_transport::shm::cma;
use kungfu_transport::{OpId, OpTag};

use super::norms;
use super::{bits, FastOp, Transport};
use crate::dtype::{reduce_into, reduce_sum_sq, scale_down};
use crate::plan::Work;
use crate::{CollectiveError, OpKind, ReduceOp};

/// Bytes of a chunk of the reduction (two of them stay in the cache).
const CHUNK: usize = 256 << 10;
/// Bytes of a buffer descriptor: pid, address, length, and the address
/// of the owner's [`Large::alive`] word.
const DESC: usize = 28;

/// A large op's state beside its [`FastOp`].
pub(super) struct Large {
    pub(super) phase: u8,
    /// Every rank's (pid, address, length, alive word), from phase 0.
    peers: Vec<Option<(u32, u64, u64, u64)>>,
    /// [`sentinel`] of the op while this rank's buffer is lent, 0 once it
    /// is given back: a peer reads it after each copy out of the buffer,
    /// so that a copy that raced with the op's failure here (the buffer
    /// handed back to the caller, maybe reused) fails instead of
    /// delivering what the buffer held by then.
    alive: Box<AtomicU64>,
}

/// The value of a lent buffer's alive word for the op `tag` (never 0).
fn sentinel(tag: OpTag) -> u64 {
    let h = fnv1a64(0x6b66_616c_6976_6521, &tag.op.0.to_le_bytes());
    let h = fnv1a64(h, &tag.seq.to_le_bytes());
    fnv1a64(h, &tag.epoch.0.to_le_bytes()) | 1
}

/// The lane tag of phase `k` of the op `tag` (phase 0 is the tag itself).
pub(super) fn phase_tag(tag: OpTag, k: u32) -> OpTag {
    OpTag {
        op: OpId(tag.op.0 ^ (u64::from(k) << 40)),
        ..tag
    }
}

/// Elements `[start, end)` of the slice rank `r` reduces, in bytes.
pub(super) fn slice(count: usize, esz: usize, n: usize, r: usize) -> Range<usize> {
    let (q, rem) = (count / n, count % n);
    let start = r * q + r.min(rem);
    let len = q + usize::from(r < rem);
    start * esz..(start + len) * esz
}

/// Who posts to whom, and whose message each rank needs, in phase `k`:
/// `None` once the op is over.
fn schedule(kind: OpKind, me: Rank, others: u64, k: u8) -> Option<(u64, u64)> {
    let root_bit = |r: Rank| 1u64 << r.0;
    match (kind, k) {
        (OpKind::Allreduce(_), 0..=2) => Some((others, others)),
        (OpKind::Allgather, 0..=1) => Some((others, others)),
        // every rank's descriptor to every other: each checks every
        // rank's digest, so a disagreement fails on every rank
        (OpKind::Broadcast { .. }, 0) => Some((others, others)),
        (OpKind::Broadcast { root }, 1) if root == me => Some((0, others)),
        (OpKind::Broadcast { root }, 1) => Some((root_bit(root), 0)),
        _ => None,
    }
}

impl Large {
    /// Sets `op` up for phase 0: its descriptor is what it posts.
    pub(super) fn start<T: Transport>(op: &mut FastOp<T>, others: u64) {
        let len = op.spec.work_len(op.found.len()).expect("validated");
        let addr = op.work.read(0..len, |w| w.as_ptr() as u64).unwrap_or(0);
        let alive = Box::new(AtomicU64::new(sentinel(op.tag)));
        let mut d = op.inner.pool.take_vec(DESC);
        d.vec_mut()
            .extend_from_slice(&std::process::id().to_le_bytes());
        d.vec_mut().extend_from_slice(&addr.to_le_bytes());
        d.vec_mut().extend_from_slice(&(len as u64).to_le_bytes());
        let word = &*alive as *const AtomicU64 as u64;
        d.vec_mut().extend_from_slice(&word.to_le_bytes());
        op.mine = Some(d);
        op.contrib = None;
        let (post, need) = schedule(op.spec.kind, op.lane_rank, others, 0).expect("phase 0");
        op.unposted = post;
        op.need = need;
        op.large = Some(Large {
            phase: 0,
            peers: vec![None; op.found.len()],
            alive,
        });
    }

    /// The op is over here (done or failed): its buffer is no longer lent.
    /// Before the buffer goes back to the caller.
    pub(super) fn give_back(&self) {
        self.alive.store(0, Ordering::SeqCst);
    }
}

impl<T: Transport> FastOp<T> {
    /// Every message of the phase is here: reads the descriptors (phase
    /// 0), does the phase's copies, and moves on; the output once the last
    /// phase is over.
    pub(super) fn advance(
        &mut self,
        l: &kungfu_transport::shm::lane::HostLanes,
        others: u64,
    ) -> Option<Result<(), CollectiveError>> {
        let me = self.lane_rank;
        let n = self.found.len();
        let phase = self.large.as_ref().expect("a large op").phase;
        for p in bits(self.need) {
            let f = self.found[p.idx()].expect("all found");
            if f.digest() != self.digest {
                return Some(Err(
                    self.mismatch_with(p, "another op (kind, type, count or root)")
                ));
            }
        }
        if phase == 0 {
            let want = self.spec.work_len(n).expect("validated") as u64;
            for p in bits(self.need) {
                let f = self.found[p.idx()].expect("all found");
                let d = l.read(p, self.lane_tag, &f, |b| {
                    (b.len() == DESC).then(|| {
                        let u8s = |r: Range<usize>| -> [u8; 8] { b[r].try_into().expect("sized") };
                        (
                            u32::from_le_bytes(b[0..4].try_into().expect("sized")),
                            u64::from_le_bytes(u8s(4..12)),
                            u64::from_le_bytes(u8s(12..20)),
                            u64::from_le_bytes(u8s(20..28)),
                        )
                    })
                });
                match d {
                    Ok(Some(d)) if d.2 == want => {
                        self.large.as_mut().expect("large").peers[p.idx()] = Some(d);
                    }
                    Ok(_) => return Some(Err(self.mismatch_with(p, "a buffer of another size"))),
                    Err(e) => return Some(Err(self.lost(p, e))),
                }
            }
        }
        // later phases' messages are empty, but a monitored allreduce's
        // "ready" carries each slice's squares: a rank that disagrees on
        // which it is fails, whichever side it is on
        let said = if phase == 1 && self.norms.is_some() {
            norms::NORMS_BYTES
        } else {
            0
        };
        for p in bits(self.need).filter(|_| phase > 0) {
            let f = self.found[p.idx()].expect("all found");
            if f.len() != said {
                let what = format!("another op ({} bytes in its phase {phase})", f.len());
                return Some(Err(self.mismatch_with(p, &what)));
            }
        }
        if let (1, true) = (phase, self.norms.is_some()) {
            for p in bits(self.need) {
                let f = self.found[p.idx()].expect("all found");
                let q = l.read(p, self.lane_tag, &f, norms::from_bytes);
                match q {
                    Ok(Some(q)) => {
                        self.norms
                            .as_mut()
                            .expect("monitored")
                            .add(me.idx(), p.idx(), q)
                    }
                    Ok(None) => {
                        return Some(Err(self.mismatch_with(p, "an op without the squared norms")))
                    }
                    Err(e) => return Some(Err(self.lost(p, e))),
                }
            }
        }
        self.release(l);
        if let Err(e) = self.copy(phase, others) {
            return Some(Err(e));
        }
        let next = phase + 1;
        match schedule(self.spec.kind, me, others, next) {
            None => Some(Ok(())),
            Some((post, need)) => {
                let large = self.large.as_mut().expect("large");
                large.phase = next;
                self.lane_tag = phase_tag(self.tag, u32::from(next));
                let tail = self.norms.as_ref().filter(|_| next == 1);
                let tail = tail.map(|v| norms::to_bytes(v.mine));
                if let Some(m) = self.mine.as_mut() {
                    // later phases say only "ready" (with a monitored
                    // allreduce's squares) and "done"
                    m.vec_mut().clear();
                    m.vec_mut()
                        .extend_from_slice(tail.as_ref().map_or(&[], |t| t));
                }
                self.unposted = post;
                self.need = need;
                None
            }
        }
    }

    pub(super) fn mismatch_with(&self, p: Rank, what: &str) -> CollectiveError {
        let detail = format!("{} here; rank {} has {what}", self.spec.describe(), p.0);
        crate::failure::mismatch(self.id(), self.lane_rank, p, detail)
    }

    /// The copies of `phase` (`others`: every rank but this one).
    fn copy(&mut self, phase: u8, others: u64) -> Result<(), CollectiveError> {
        let (n, me) = (self.found.len(), self.lane_rank.idx());
        let b = self.spec.block_bytes().expect("validated");
        let esz = self.spec.dtype.size();
        let peers: Vec<(u32, u64, u64)> = self
            .large
            .as_ref()
            .map(|l| {
                l.peers
                    .iter()
                    .map(|d| d.map_or((0, 0, 0), |d| (d.0, d.1, d.3)))
                    .collect()
            })
            .unwrap_or_default();
        let (name, epoch, want) = (self.name.clone(), self.tag.epoch, sentinel(self.tag));
        let id = crate::failure::OpId { name: &name, epoch };
        let lost = |p: usize, e: std::io::Error| {
            // refused, not gone: say what the host must allow
            let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                format!(
                    " (not permitted: under Yama's ptrace_scope 1, {} must name a process \
                     that every worker of this host descends from; or set \
                     KUNGFU_FAST_LARGE=0 for the rings)",
                    cma::LAUNCHER_PID_VAR
                )
            } else {
                String::new()
            };
            let e = kungfu_transport::TransportError::PeerLost {
                peer: Rank(p as u32),
                reason: format!("cross-memory read of its buffer: {e}{hint}").into(),
            };
            crate::failure::transport_error(id, e)
        };
        let read = |p: usize, off: u64, dst: &mut [u8]| {
            let (pid, addr, _) = peers[p];
            cma::read(pid, addr.wrapping_add(off), dst).map_err(|e| lost(p, e))
        };
        // After a phase's copies out of `p`'s buffer: it was still lent
        // when they ended (the owner clears its word before it gives the
        // buffer back, and a later op's word has another value).
        let still_lent = |p: usize| {
            let (pid, _, alive) = peers[p];
            let mut word = [0u8; 8];
            cma::read(pid, alive, &mut word).map_err(|e| lost(p, e))?;
            if u64::from_le_bytes(word) != want {
                return Err(CollectiveError::Aborted {
                    name: name.clone(),
                    epoch,
                    by: Rank(p as u32),
                    reason: "its op ended (failed) and took its buffer back while this rank \
                             copied from it"
                        .into(),
                });
            }
            Ok(())
        };
        let mut failed = None;
        match (self.spec.kind, phase) {
            (OpKind::Allreduce(op), 0) => {
                // Slice `me` of the working buffer holds this rank's values
                // (no peer reads it before phase 1): the peers' chunks are
                // reduced into it, own values first, then the peers' in
                // rank order (one rank computes each slice, so every rank
                // gets the same bits).
                let s = slice(self.spec.count, esz, n, me);
                let mut tmp = self.inner.pool.take_vec(CHUNK);
                tmp.vec_mut().resize(CHUNK, 0);
                let dtype = self.spec.dtype;
                let mut off = s.start;
                let mut busy = false;
                // the peers in rank order: the first and last but this rank
                let first = usize::from(me == 0);
                let last = if me == n - 1 { n - 2 } else { n - 1 };
                let fused = self.norms.is_some();
                let mut squares = [0.0; 2];
                'chunks: while off < s.end {
                    let len = CHUNK.min(s.end - off);
                    let t = &mut tmp[..len];
                    for p in (0..n).filter(|&p| p != me) {
                        if let Err(e) = read(p, off as u64, t) {
                            failed = Some(e);
                            break 'chunks;
                        }
                        let t = &*t;
                        let ok = self.work.write(off..off + len, &mut |w| {
                            if !fused {
                                return reduce_into(dtype, op, w, t);
                            }
                            let q = reduce_sum_sq(w, t);
                            squares[0] += q.src;
                            if p == first {
                                squares[0] += q.dst_before;
                            }
                            if p == last {
                                squares[1] += q.dst_after;
                            }
                        });
                        if !ok {
                            busy = true;
                            break 'chunks;
                        }
                    }
                    if op == ReduceOp::Avg
                        && !self
                            .work
                            .write(off..off + len, &mut |w| scale_down(dtype, w, n))
                    {
                        busy = true;
                        break;
                    }
                    off += len;
                }
                if busy {
                    failed = Some(self.busy());
                }
                if let Some(v) = self.norms.as_mut() {
                    v.mine = squares;
                }
            }
            (OpKind::Allreduce(_), 1) => {
                for p in (0..n).filter(|&p| p != me) {
                    let s = slice(self.spec.count, esz, n, p);
                    let mut r = Ok(());
                    let ok = self
                        .work
                        .write(s.clone(), &mut |w| r = read(p, s.start as u64, w));
                    if let Err(e) = r {
                        failed = Some(e);
                        break;
                    }
                    if !ok {
                        failed = Some(self.busy());
                        break;
                    }
                }
            }
            (OpKind::Broadcast { root }, 0) if root.idx() != me => {
                let mut r = Ok(());
                if !self.work.write(0..b, &mut |w| r = read(root.idx(), 0, w)) {
                    r = Err(self.busy());
                }
                failed = r.err();
            }
            (OpKind::Allgather, 0) => {
                for p in (0..n).filter(|&p| p != me) {
                    let mut r = Ok(());
                    let at = p * b..(p + 1) * b;
                    if !self
                        .work
                        .write(at.clone(), &mut |w| r = read(p, at.start as u64, w))
                    {
                        r = Err(self.busy());
                    }
                    if let Err(e) = r {
                        failed = Some(e);
                        break;
                    }
                }
            }
            _ => {}
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let read_from: u64 = match (self.spec.kind, phase) {
            (OpKind::Allreduce(_), 0 | 1) | (OpKind::Allgather, 0) => others,
            (OpKind::Broadcast { root }, 0) if root.idx() != me => 1 << root.0,
            _ => 0,
        };
        bits(read_from).try_for_each(|p| still_lent(p.idx()))
    }

    pub(super) fn busy(&self) -> CollectiveError {
        CollectiveError::InvalidArgument {
            name: self.name.clone(),
            reason: "the op's memory is in use by another op".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_buffer_once() {
        for (count, n) in [(0, 2), (1, 4), (10, 3), (1 << 20, 4), (7, 8)] {
            let mut at = 0;
            for r in 0..n {
                let s = slice(count, 4, n, r);
                assert_eq!(s.start, at);
                at = s.end;
            }
            assert_eq!(at, count * 4);
        }
    }
}
