//! What an op is: its kind, element type, count, and the buffer layout it
//! works in.

use std::ops::Range;

use kungfu_topology::{Digest, Rank, Root, Topology};

use crate::{DType, ReduceOp};

/// The collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Every rank gets the reduction of every rank's `count` elements.
    Allreduce(ReduceOp),
    /// The root gets the reduction.
    Reduce { op: ReduceOp, root: Rank },
    /// Every rank gets the root's `count` elements.
    Broadcast { root: Rank },
    /// Every rank gets the `count` elements of every rank, in rank order.
    Allgather,
    /// The root gets the `count` elements of every rank, in rank order.
    Gather { root: Rank },
    /// Each rank gives `size * count` elements; rank `r` gets the reduction
    /// of block `r` (`count` elements).
    ReduceScatter(ReduceOp),
    /// Each rank gives `size` blocks of `count`; rank `r` gets block `r` of
    /// every rank, in rank order.
    Alltoall,
    /// The root gives `size` blocks of `count`; rank `r` gets block `r`
    /// (the other ranks give nothing).
    Scatter { root: Rank },
}

impl OpKind {
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Allreduce(_) => "allreduce",
            OpKind::Reduce { .. } => "reduce",
            OpKind::Broadcast { .. } => "broadcast",
            OpKind::Allgather => "allgather",
            OpKind::Gather { .. } => "gather",
            OpKind::ReduceScatter(_) => "reduce-scatter",
            OpKind::Alltoall => "alltoall",
            OpKind::Scatter { .. } => "scatter",
        }
    }

    /// The kind's number on the wire.
    pub(crate) fn code(&self) -> u8 {
        match self {
            OpKind::Allreduce(_) => 1,
            OpKind::Reduce { .. } => 2,
            OpKind::Broadcast { .. } => 3,
            OpKind::Allgather => 4,
            OpKind::Gather { .. } => 5,
            OpKind::ReduceScatter(_) => 6,
            OpKind::Alltoall => 7,
            OpKind::Scatter { .. } => 8,
        }
    }

    /// The name of the kind whose number on the wire is `code`
    /// ([`OpKind::code`]), if any.
    pub(crate) fn name_of_code(code: u8) -> Option<&'static str> {
        let r = Rank(0);
        let op = ReduceOp::Sum;
        [
            OpKind::Allreduce(op),
            OpKind::Reduce { op, root: r },
            OpKind::Broadcast { root: r },
            OpKind::Allgather,
            OpKind::Gather { root: r },
            OpKind::ReduceScatter(op),
            OpKind::Alltoall,
            OpKind::Scatter { root: r },
        ]
        .into_iter()
        .find(|k| k.code() == code)
        .map(|k| k.name())
    }

    pub fn reduce_op(&self) -> Option<ReduceOp> {
        match *self {
            OpKind::Allreduce(op) | OpKind::ReduceScatter(op) | OpKind::Reduce { op, .. } => {
                Some(op)
            }
            _ => None,
        }
    }

    /// Whether the output of rank `me` depends on what rank `peer` gives
    /// (directly or through others): every rank's, for the all-to-all
    /// kinds; the root's, for a broadcast and a scatter; everyone's at the root of a
    /// reduce or gather, no one's elsewhere. An op whose rank depends on a
    /// lost peer cannot complete.
    pub fn depends_on(&self, me: Rank, peer: Rank) -> bool {
        match *self {
            OpKind::Allreduce(_)
            | OpKind::Allgather
            | OpKind::ReduceScatter(_)
            | OpKind::Alltoall => true,
            OpKind::Broadcast { root } | OpKind::Scatter { root } => peer == root,
            OpKind::Reduce { root, .. } | OpKind::Gather { root } => me == root,
        }
    }

    pub fn root(&self) -> Root {
        match *self {
            OpKind::Reduce { root, .. }
            | OpKind::Broadcast { root }
            | OpKind::Gather { root }
            | OpKind::Scatter { root } => Root::At(root),
            _ => Root::Any,
        }
    }
}

/// `digest`, the short digest of a spec without its check, with `check`
/// mixed in: what the op's frames carry. `digest` itself for check 0, so
/// unchecked ops keep the digests they always had.
pub(crate) fn with_check(digest: u32, check: u64) -> u32 {
    if check == 0 {
        return digest;
    }
    Digest(u64::from(digest)).u64(check).short()
}

/// One op as every rank must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpSpec {
    pub kind: OpKind,
    pub dtype: DType,
    /// Elements per rank (per block for the block-wise ops).
    pub count: usize,
    /// A value every rank must give alike, 0 for none: what the caller
    /// wants checked beyond the kind, type and count, such as a tensor's
    /// shape or its scale factors. It goes into the digest every frame
    /// carries, so ranks that differ fail the op with a mismatch on every
    /// rank, where otherwise ops of equal counts would meet and mix.
    pub check: u64,
}

impl OpSpec {
    /// Checks the spec against a cluster of `size` ranks.
    pub fn validate(&self, size: usize) -> Result<(), String> {
        if let Some(op) = self.kind.reduce_op() {
            if !op.supports(self.dtype) {
                return Err(format!(
                    "{op} is only defined for floating-point types, not {}",
                    self.dtype
                ));
            }
        }
        if let Root::At(r) = self.kind.root() {
            if r.idx() >= size {
                return Err(format!("root {} outside a cluster of {size}", r.0));
            }
        }
        self.work_len(size)
            .map(|_| ())
            .ok_or_else(|| format!("count {} overflows the address space", self.count))
    }

    /// Bytes of one rank's contribution (`count` elements).
    pub fn block_bytes(&self) -> Option<usize> {
        self.count.checked_mul(self.dtype.size())
    }

    /// Bytes rank `me` passes in (the same on every rank but for a
    /// scatter, whose root alone gives anything).
    pub fn input_len(&self, me: Rank, size: usize) -> Option<usize> {
        let b = self.block_bytes()?;
        match self.kind {
            OpKind::ReduceScatter(_) | OpKind::Alltoall => b.checked_mul(size),
            OpKind::Scatter { root } if root == me => b.checked_mul(size),
            OpKind::Scatter { .. } => Some(0),
            _ => Some(b),
        }
    }

    /// Bytes of the working buffer a plan runs in.
    pub fn work_len(&self, size: usize) -> Option<usize> {
        let b = self.block_bytes()?;
        match self.kind {
            OpKind::Allreduce(_) | OpKind::Reduce { .. } | OpKind::Broadcast { .. } => Some(b),
            OpKind::Allgather
            | OpKind::Gather { .. }
            | OpKind::ReduceScatter(_)
            | OpKind::Scatter { .. } => b.checked_mul(size),
            OpKind::Alltoall => b.checked_mul(size)?.checked_mul(2),
        }
    }

    /// Builds the working buffer of rank `me` from its input (which must be
    /// [`OpSpec::input_len`] bytes).
    pub fn init_work(&self, input: &[u8], me: Rank, size: usize) -> Vec<u8> {
        let mut work = Vec::new();
        self.init_work_into(input, me, size, &mut work);
        work
    }

    /// [`OpSpec::init_work`] into `work` (cleared first), reusing its
    /// allocation.
    pub fn init_work_into(&self, input: &[u8], me: Rank, size: usize, work: &mut Vec<u8>) {
        let len = self.work_len(size).expect("validated");
        work.clear();
        match self.kind {
            // the input is the whole buffer: one pass, no zeroing first
            OpKind::Allreduce(_) | OpKind::Reduce { .. } | OpKind::ReduceScatter(_) => {
                work.extend_from_slice(input)
            }
            OpKind::Broadcast { root } | OpKind::Scatter { root } if root == me => {
                work.extend_from_slice(input)
            }
            _ => {
                work.resize(len, 0);
                self.init_work_in(input, me, size, work);
            }
        }
    }

    /// [`OpSpec::init_work`] into `work`, which holds
    /// [`OpSpec::work_len`] bytes (the caller's memory, for
    /// [`Session::submit_in`](crate::Session::submit_in)). Bytes the op
    /// overwrites before it reads them (all of a non-root's broadcast, the
    /// other ranks' blocks of a gather) are left as they are.
    pub fn init_work_in(&self, input: &[u8], me: Rank, size: usize, work: &mut [u8]) {
        let b = self.block_bytes().expect("validated");
        let mine = me.idx() * b..(me.idx() + 1) * b;
        match self.kind {
            OpKind::Allreduce(_) | OpKind::Reduce { .. } | OpKind::ReduceScatter(_) => {
                work.copy_from_slice(input)
            }
            OpKind::Broadcast { root } | OpKind::Scatter { root } if root == me => {
                work.copy_from_slice(input)
            }
            OpKind::Broadcast { .. } | OpKind::Scatter { .. } => {}
            OpKind::Allgather | OpKind::Gather { .. } => work[mine].copy_from_slice(input),
            OpKind::Alltoall => {
                let half = b * size;
                work[..half].copy_from_slice(input);
                work.copy_within(mine.clone(), half + mine.start);
            }
        }
    }

    /// Where rank `me`'s result lies in its working buffer; `None` where the
    /// rank gets no result (non-roots of reduce and gather).
    pub fn output_range(&self, me: Rank, size: usize) -> Option<Range<usize>> {
        let b = self.block_bytes().expect("validated");
        let w = self.work_len(size).expect("validated");
        match self.kind {
            OpKind::Allreduce(_) | OpKind::Broadcast { .. } | OpKind::Allgather => Some(0..w),
            OpKind::Reduce { root, .. } | OpKind::Gather { root } => (root == me).then_some(0..w),
            OpKind::ReduceScatter(_) | OpKind::Scatter { .. } => {
                Some(me.idx() * b..(me.idx() + 1) * b)
            }
            OpKind::Alltoall => Some(w / 2..w),
        }
    }

    /// A digest of everything ranks must agree on, including the topology
    /// the op runs on, but not the [check](OpSpec::check): the short form
    /// of this goes through `with_check` into the frames.
    pub fn digest(&self, topology: &Topology) -> Digest {
        let (op, root) = (
            self.kind.reduce_op().map_or(0, |o| o as u64),
            match self.kind.root() {
                Root::At(r) => u64::from(r.0) + 1,
                Root::Any => 0,
            },
        );
        Digest::EMPTY
            .u64(u64::from(self.kind.code()))
            .u64(op)
            .u64(root)
            .u64(self.dtype as u64)
            .u64(self.count as u64)
            .u64(topology.digest().0)
    }

    /// The spec without its [check](OpSpec::check): what its plan
    /// depends on.
    pub fn unchecked(&self) -> OpSpec {
        OpSpec { check: 0, ..*self }
    }

    /// A one-line description for error messages.
    pub fn describe(&self) -> String {
        let mut s = format!("{} {} count={}", self.kind.name(), self.dtype, self.count);
        if let Some(op) = self.kind.reduce_op() {
            s.push_str(&format!(" op={op}"));
        }
        if let Root::At(r) = self.kind.root() {
            s.push_str(&format!(" root={}", r.0));
        }
        if self.check != 0 {
            s.push_str(&format!(" check={:016x}", self.check));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let n = 3;
        let s = OpSpec {
            kind: OpKind::Alltoall,
            dtype: DType::U16,
            count: 2,
            check: 0,
        };
        assert_eq!(s.input_len(Rank(1), n), Some(12));
        let input: Vec<u8> = (0..12).collect();
        let w = s.init_work(&input, Rank(1), n);
        assert_eq!(w.len(), 24);
        assert_eq!(&w[12 + 4..12 + 8], &input[4..8]);
        assert_eq!(s.output_range(Rank(1), n), Some(12..24));

        let g = OpSpec {
            kind: OpKind::Gather { root: Rank(2) },
            dtype: DType::F32,
            count: 1,
            check: 0,
        };
        assert_eq!(g.output_range(Rank(0), n), None);
        assert_eq!(g.output_range(Rank(2), n), Some(0..12));

        let sc = OpSpec {
            kind: OpKind::Scatter { root: Rank(1) },
            dtype: DType::F32,
            count: 2,
            check: 0,
        };
        assert_eq!(sc.input_len(Rank(1), n), Some(24));
        assert_eq!(sc.input_len(Rank(0), n), Some(0));
        let input: Vec<u8> = (0..24).collect();
        assert_eq!(sc.init_work(&input, Rank(1), n), input);
        assert_eq!(sc.init_work(&[], Rank(2), n), vec![0; 24]);
        assert_eq!(sc.output_range(Rank(2), n), Some(16..24));
    }

    #[test]
    fn every_kind_is_known_by_its_wire_number() {
        for k in 0..crate::reference::OP_KINDS {
            let (_, spec) = crate::reference::op_shape(4, 4, k, 1, 0, 0, 1);
            let code = spec.kind.code();
            assert_eq!(OpKind::name_of_code(code), Some(spec.kind.name()));
        }
        assert_eq!(OpKind::name_of_code(0), None);
        assert_eq!(
            OpKind::name_of_code(crate::reference::OP_KINDS as u8 + 1),
            None
        );
    }

    #[test]
    fn validation() {
        let bad = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Avg),
            dtype: DType::I32,
            count: 1,
            check: 0,
        };
        assert!(bad.validate(2).is_err());
        let root = OpSpec {
            kind: OpKind::Broadcast { root: Rank(4) },
            dtype: DType::I32,
            count: 1,
            check: 0,
        };
        assert!(root.validate(4).is_err());
        let huge = OpSpec {
            kind: OpKind::Allgather,
            dtype: DType::F64,
            count: usize::MAX / 4,
            check: 0,
        };
        assert!(huge.validate(2).is_err());
    }
}
