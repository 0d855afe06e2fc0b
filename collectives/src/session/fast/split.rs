//! Mid-size allreduce of the host fast path: reduce-scatter, then
//! allgather, through the lanes.
//!
//! The direct allreduce (`fast.rs`) has every rank post its whole
//! contribution to every peer and reduce all of them: `n - 1` copies out and
//! `n` buffers reduced per rank, which is the least latency for small
//! messages and too much traffic for larger ones. Split in two phases:
//!
//! - **phase 0**: rank `r` posts slice `p` of its buffer (1/n of it) to each
//!   peer `p`, and reduces slice `r` of every rank straight out of the
//!   slots into its own buffer, its own values first, then the peers' in
//!   rank order (the same order on every run);
//! - **phase 1**: rank `r` posts its reduced slice to every peer and copies
//!   each peer's reduced slice into its buffer (a monitored op's slice is
//!   followed by the two sums of squares of its reduction, `norms.rs`).
//!
//! Each rank then writes about `2 (n-1)/n` of the buffer into slots, reads
//! as much out of them and reduces `1/n` of it: the traffic of a ring, with
//! two flag waits in all instead of `2 (n-1)` steps. Every slice's bits are
//! computed by one rank only, so all ranks end with the same bits. The input
//! is read where it lies: no copy of it is kept, since slice `p` is posted
//! before anything overwrites it.
//!
//! Slices are at most a slot ([`SLOT_BYTES`]): an allreduce takes this way
//! when its buffer is at least [`SPLIT_FROM`], at most
//! `SessionConfig::fast_max_bytes`, and its largest slice fits a slot.
//! Larger ones take the rings. (Rounds of a slot per rank, one after
//! another, were tried: at 2 ranks they took 2.7x the rings' time at 1
//! MiB and 3.8x at 16 MiB, since a round's copies, reduction and waits
//! run one after another where the rings overlap the sender's copy with
//! the receiver's reduction; at 4 ranks 0.8-1.0x at 4-64 MiB. Pipelined
//! rounds are the next step.)

use std::ops::Range;

use kungfu_topology::Rank;
use kungfu_transport::shm::lane::{HostLanes, SLOT_BYTES};

use super::large::{phase_tag, slice};
use super::norms::{self, NORMS_BYTES};
use super::{bits, changed, FastOp, Transport};
use crate::dtype::{reduce_into, reduce_sum_sq, scale_down};
use crate::plan::Work;
use crate::{CollectiveError, OpKind, OpSpec};

/// Allreduce buffers of at least this many bytes take the split way (when
/// their slices fit a slot): below it, one flag wait beats two. Measured
/// here (2-core machine, 100 iterations, 3 alternating runs): at 2 ranks
/// the direct way takes 3.3/4.7/8.4 us at 8/16/32 KiB against 4.1/5.9/11.0
/// split, and both about 12.5 at 64 KiB; at 4 ranks 12/19/27-39 against
/// 26-45/27-45/38-49. At 64 KiB itself (`benches/peers/alternate.sh`, 7
/// alternating rounds of 2,000 ops) split took 0.91 of the direct way's
/// time at 4 ranks (faster in 5 of 7) and 1.00 at 2; at 48 KiB it was
/// slower (1.08 and 1.16).
pub(super) const SPLIT_FROM: usize = 64 << 10;

/// Whether an allreduce of `spec` over `n` ranks splits: it is above
/// [`SPLIT_FROM`] and its largest slice fits a slot.
pub(super) fn splits(spec: &OpSpec, n: usize) -> bool {
    let Some(b) = spec.block_bytes() else {
        return false;
    };
    let largest = slice(spec.count, spec.dtype.size(), n, 0).len();
    matches!(spec.kind, OpKind::Allreduce(_)) && b >= SPLIT_FROM && largest <= SLOT_BYTES
}

/// Whether a split op of `spec` has room for its squares after its slice
/// in phase 1 (all but those whose largest slice fills a slot).
pub(super) fn fits_norms(spec: &OpSpec, n: usize) -> bool {
    slice(spec.count, spec.dtype.size(), n, 0).len() + NORMS_BYTES <= SLOT_BYTES
}

impl<T: Transport> FastOp<T> {
    /// This rank's squares, which a monitored split op posts after its
    /// reduced slice in phase 1.
    pub(super) fn norms_tail(&self) -> Option<[u8; NORMS_BYTES]> {
        let n = self.norms.as_ref().filter(|_| self.split == Some(1))?;
        Some(norms::to_bytes(n.mine))
    }

    /// The bytes of `work` this op posts to `peer` now, if not its whole
    /// contribution (`contrib`/`mine`): a slice, for a split op.
    pub(super) fn split_post(&self, peer: Rank) -> Option<Range<usize>> {
        let phase = self.split?;
        let n = self.found.len();
        let r = if phase == 0 { peer } else { self.lane_rank };
        Some(slice(self.spec.count, self.spec.dtype.size(), n, r.idx()))
    }

    /// Every slice of the phase is here: reduces (phase 0) or copies
    /// (phase 1) them, and moves on; `Some(Ok)` once phase 1 is over.
    pub(super) fn split_advance(
        &mut self,
        l: &HostLanes,
        others: u64,
    ) -> Option<Result<(), CollectiveError>> {
        let OpKind::Allreduce(op) = self.spec.kind else {
            unreachable!("only an allreduce splits");
        };
        let phase = self.split.expect("a split op");
        let (n, me) = (self.found.len(), self.lane_rank);
        let (dtype, esz) = (self.spec.dtype, self.spec.dtype.size());
        let piece = |r: usize| slice(self.spec.count, esz, n, r);
        let mine = piece(me.idx());
        // a monitored op's phase 1 carries each slice's squares after it
        let tail = if self.norms.is_some() { NORMS_BYTES } else { 0 };
        for p in bits(self.need) {
            let f = self.found[p.idx()].expect("all found");
            let want = if phase == 0 {
                mine.len()
            } else {
                piece(p.idx()).len() + tail
            };
            if f.digest() != self.digest || f.len() != want {
                let what = format!("another op ({} bytes in its slice)", f.len());
                return Some(Err(self.mismatch_with(p, &what)));
            }
        }
        let mut failed = None;
        let mut busy = false;
        let (first, last) = (bits(self.need).next(), bits(self.need).last());
        let mut squares = [0.0; 2];
        let mut theirs = None;
        for p in bits(self.need) {
            let f = self.found[p.idx()].expect("all found");
            let at = if phase == 0 {
                mine.clone()
            } else {
                piece(p.idx())
            };
            let fused = self.norms.is_some();
            let ok = self.work.write(at, &mut |w| {
                // what is read now, not what was claimed: a peer may have
                // rewritten its slot (then the op fails, it does not panic)
                let r = l.read(p, self.lane_tag, &f, |s| {
                    if s.len() != w.len() + if phase == 0 { 0 } else { tail } {
                        return Err(changed(p, s.len()));
                    }
                    if phase == 0 && fused {
                        let q = reduce_sum_sq(w, s);
                        squares[0] += q.src;
                        if Some(p) == first {
                            squares[0] += q.dst_before;
                        }
                        if Some(p) == last {
                            squares[1] += q.dst_after;
                        }
                    } else if phase == 0 {
                        reduce_into(dtype, op, w, s);
                    } else {
                        let (s, t) = s.split_at(w.len());
                        w.copy_from_slice(s);
                        theirs = norms::from_bytes(t);
                    }
                    Ok(())
                });
                if let Err(e) = r.and_then(|r| r) {
                    failed.get_or_insert((p, e));
                }
            });
            busy |= !ok;
            if failed.is_some() || busy {
                break;
            }
            if let (Some(n), Some(q)) = (self.norms.as_mut(), theirs.take()) {
                n.add(me.idx(), p.idx(), q);
            }
        }
        if let Some(n) = self.norms.as_mut().filter(|_| phase == 0) {
            n.mine = squares;
        }
        if phase == 0 && op == crate::ReduceOp::Avg && failed.is_none() && !busy {
            busy |= !self.work.write(mine, &mut |w| scale_down(dtype, w, n));
        }
        self.release(l);
        if let Some((p, e)) = failed {
            return Some(Err(self.lost(p, e)));
        }
        if busy {
            return Some(Err(self.busy()));
        }
        if phase == 1 {
            return Some(Ok(()));
        }
        self.split = Some(1);
        self.lane_tag = phase_tag(self.tag, 1);
        self.unposted = others;
        self.need = others;
        None
    }
}
