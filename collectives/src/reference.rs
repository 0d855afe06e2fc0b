//! Exact test data and the results every op must give on it, computed
//! directly (no plans, no network): the oracle of the simulation, the
//! scheduler tests and `kungfu-bench -c 1`.
//!
//! Inputs are small integers, exact in every type (even f16 and bf16), and
//! for `prod` mostly ones with a few twos, so that a reduction over up to 16
//! ranks is exact in any order and results compare with `==`.

use crate::{reduce_into, scale_down, DType, OpKind, OpSpec, ReduceOp};

/// `v` as one element of `dtype`, appended to `out`.
pub fn push_small(dtype: DType, v: u8, out: &mut Vec<u8>) {
    let f = f32::from(v);
    match dtype {
        DType::U8 | DType::I8 => out.push(v),
        DType::U16 | DType::I16 => out.extend_from_slice(&u16::from(v).to_le_bytes()),
        DType::U32 | DType::I32 => out.extend_from_slice(&u32::from(v).to_le_bytes()),
        DType::U64 | DType::I64 => out.extend_from_slice(&u64::from(v).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&half::f16::from_f32(f).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(f).to_le_bytes()),
        DType::F32 => out.extend_from_slice(&f.to_le_bytes()),
        DType::F64 => out.extend_from_slice(&f64::from(f).to_le_bytes()),
    }
}

/// The input of `rank`: `len` elements, different per rank and position.
pub fn input(dtype: DType, op: Option<ReduceOp>, rank: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * dtype.size());
    for i in 0..len {
        let v = if op == Some(ReduceOp::Prod) {
            1 + u8::from((rank + i).is_multiple_of(4))
        } else {
            ((rank * 7 + i * 3) % 11 + 1) as u8
        };
        push_small(dtype, v, &mut out);
    }
    out
}

/// The inputs of all `n` ranks for `spec`.
pub fn inputs(spec: &OpSpec, n: usize) -> Vec<Vec<u8>> {
    let per = spec.input_len(n).expect("valid spec") / spec.dtype.size();
    (0..n)
        .map(|r| input(spec.dtype, spec.kind.reduce_op(), r, per))
        .collect()
}

/// What rank `me` must get from `inputs` (None: no output on that rank).
pub fn expected(spec: &OpSpec, me: usize, inputs: &[Vec<u8>]) -> Option<Vec<u8>> {
    let n = inputs.len();
    let b = spec.block_bytes()?;
    let reduce_all = |op: ReduceOp, range: std::ops::Range<usize>| {
        let mut acc = inputs[0][range.clone()].to_vec();
        for x in &inputs[1..] {
            reduce_into(spec.dtype, op, &mut acc, &x[range.clone()]);
        }
        if op == ReduceOp::Avg {
            scale_down(spec.dtype, &mut acc, n);
        }
        acc
    };
    match spec.kind {
        OpKind::Allreduce(op) => Some(reduce_all(op, 0..b)),
        OpKind::Reduce { op, root } => (root.idx() == me).then(|| reduce_all(op, 0..b)),
        OpKind::Broadcast { root } => Some(inputs[root.idx()].clone()),
        OpKind::Allgather => Some(inputs.concat()),
        OpKind::Gather { root } => (root.idx() == me).then(|| inputs.concat()),
        OpKind::ReduceScatter(op) => Some(reduce_all(op, me * b..(me + 1) * b)),
        OpKind::Alltoall => Some(
            inputs
                .iter()
                .flat_map(|x| x[me * b..(me + 1) * b].to_vec())
                .collect(),
        ),
    }
}
