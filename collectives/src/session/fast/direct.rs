//! The direct way of the host fast path: every contribution is in a slot
//! of its own; each rank computes the whole output from them (see
//! `fast.rs`).

use kungfu_topology::Rank;
use kungfu_transport::shm::lane::HostLanes;

use super::{changed, FastOp, Transport};
use crate::dtype::{reduce_into, reduce_sum_sq, scale_down};
use crate::failure::OpId;
use crate::plan::Work;
use crate::session::OpOutput;
use crate::{CollectiveError, OpKind};

impl<T: Transport> FastOp<T> {
    /// Every contribution is here: checks them and computes the output.
    pub(super) fn compute(
        &mut self,
        l: &HostLanes,
        version: kungfu_transport::ClusterVersion,
    ) -> Result<OpOutput, CollectiveError> {
        let (n, me) = (self.found.len(), l.rank());
        let b = self.spec.block_bytes().expect("validated");
        let tag = self.tag;
        // what each rank posts: a broadcast's others post nothing
        let len_of = |p: usize| match self.spec.kind {
            OpKind::Broadcast { root } if root.idx() != p => 0,
            _ => b,
        };
        for (p, f) in self.found.iter().enumerate() {
            let Some(f) = f else { continue };
            if f.digest() != self.digest || f.len() != len_of(p) {
                let detail = format!(
                    "{} here; rank {p} sent {} bytes of another op",
                    self.spec.describe(),
                    f.len()
                );
                return Err(crate::failure::mismatch(
                    OpId {
                        name: &self.name,
                        epoch: tag.epoch,
                    },
                    me,
                    Rank(p as u32),
                    detail,
                ));
            }
        }
        let mut failed = None;
        let want = self.spec.block_bytes().expect("validated");
        let mut read = |p: usize, f: &mut dyn FnMut(&[u8])| {
            let found = self.found[p].as_ref().expect("checked");
            // what is read now, not what was claimed: a peer may have
            // rewritten its slot (then the op fails, it does not panic)
            let r = l.read(Rank(p as u32), tag, found, |s| {
                if s.len() == want {
                    f(s);
                    Ok(())
                } else {
                    Err(changed(Rank(p as u32), s.len()))
                }
            });
            if let Err(e) = r.and_then(|r| r) {
                failed.get_or_insert((p, e));
            }
        };
        let ok = match self.spec.kind {
            OpKind::Allreduce(op) => {
                let dtype = self.spec.dtype;
                let mut ok = true;
                if me.0 != 0 {
                    ok &= self.work.write(0..b, &mut |w| {
                        read(0, &mut |s| w.copy_from_slice(s));
                    });
                }
                // a monitored op sums the squares on the way: every rank
                // reads every input here, so it needs nobody's share
                let fused = self.norms.is_some();
                let mut squares = [0.0; 2];
                let mut add = |p: usize, w: &mut [u8], s: &[u8]| {
                    if !fused {
                        return reduce_into(dtype, op, w, s);
                    }
                    let q = reduce_sum_sq(w, s);
                    squares[0] += q.src + if p == 1 { q.dst_before } else { 0.0 };
                    if p == n - 1 {
                        squares[1] = q.dst_after;
                    }
                };
                for p in 1..n {
                    ok &= self.work.write(0..b, &mut |w| {
                        if p == me.idx() {
                            let m = self.mine.as_ref().expect("rank > 0 keeps its input");
                            add(p, w, m);
                        } else {
                            read(p, &mut |s| add(p, w, s));
                        }
                    });
                }
                if let Some(v) = self.norms.as_mut() {
                    v.mine = squares;
                }
                if op == crate::ReduceOp::Avg {
                    ok &= self.work.write(0..b, &mut |w| scale_down(dtype, w, n));
                }
                ok
            }
            OpKind::Broadcast { root } if root != me => self.work.write(0..b, &mut |w| {
                read(root.idx(), &mut |s| w.copy_from_slice(s));
            }),
            OpKind::Broadcast { .. } => true,
            _ => (0..n).filter(|&p| p != me.idx()).all(|p| {
                self.work.write(p * b..(p + 1) * b, &mut |w| {
                    read(p, &mut |s| w.copy_from_slice(s));
                })
            }),
        };
        if let Some((p, e)) = failed {
            return Err(self.lost(Rank(p as u32), e));
        }
        if !ok {
            return Err(CollectiveError::InvalidArgument {
                name: self.name.clone(),
                reason: "the op's memory is in use by another op".into(),
            });
        }
        Ok(self.output(version))
    }
}
