//! Exact test data and the results every op must give on it, computed
//! directly (no plans, no network): the oracle of the simulation, the
//! scheduler tests and `kungfu-bench -c 1`.
//!
//! Inputs are small integers, exact in every type (even f16 and bf16), and
//! for `prod` mostly ones with a few twos, so that a reduction over up to 16
//! ranks is exact in any order and results compare with `==`.
//!
//! The reductions here are plain scalar code, one element at a time, and
//! call none of the production kernels (`reduce_into`, `scale_down`): an
//! oracle that shares the code it checks agrees with it when both are
//! wrong. f16 and bf16 go through `half`'s scalar conversions (to f32, the
//! operation in f32, rounded back once), which is what the kernels promise.

use half::{bf16, f16};

use crate::{DType, OpKind, OpSpec, ReduceOp};

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
    input_part(dtype, op, rank, 0, len)
}

/// Elements `start..start + len` of `rank`'s [`input`] (of any length
/// past them), made without the rest.
pub fn input_part(
    dtype: DType,
    op: Option<ReduceOp>,
    rank: usize,
    start: usize,
    len: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(len * dtype.size());
    for i in start..start + len {
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
    (0..n)
        .map(|r| {
            let me = kungfu_topology::Rank(r as u32);
            let per = spec.input_len(me, n).expect("valid spec") / spec.dtype.size();
            input(spec.dtype, spec.kind.reduce_op(), r, per)
        })
        .collect()
}

/// What rank `me` must get from `inputs` (None: no output on that rank).
pub fn expected(spec: &OpSpec, me: usize, inputs: &[Vec<u8>]) -> Option<Vec<u8>> {
    let n = inputs.len();
    let b = spec.block_bytes()?;
    let reduce_all = |op: ReduceOp, range: std::ops::Range<usize>| {
        let mut acc = inputs[0][range.clone()].to_vec();
        for x in &inputs[1..] {
            acc = combine(spec.dtype, op, &acc, &x[range.clone()]);
        }
        if op == ReduceOp::Avg {
            acc = divide(spec.dtype, &acc, n);
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
        OpKind::Scatter { root } => Some(inputs[root.idx()][me * b..(me + 1) * b].to_vec()),
    }
}

/// Bytes `range` of what rank `me` of `n` must get for `spec` with every
/// rank's [`input`]: `expected(spec, me, &inputs(spec, n))`, cut to
/// `range` (element-aligned, within the output), but made from the input
/// elements that range depends on alone. So a checker holds memory in
/// proportion to the range, not to `n` ops' inputs. None where the rank
/// gets no output.
pub fn expected_part(
    spec: &OpSpec,
    me: usize,
    n: usize,
    range: std::ops::Range<usize>,
) -> Option<Vec<u8>> {
    let (w, count, op) = (spec.dtype.size(), spec.count, spec.kind.reduce_op());
    let (first, len) = (range.start / w, range.len() / w);
    let part = |rank: usize, start: usize, len: usize| input_part(spec.dtype, op, rank, start, len);
    let reduce_at = |op: ReduceOp, start: usize| {
        let mut acc = part(0, start, len);
        for r in 1..n {
            acc = combine(spec.dtype, op, &acc, &part(r, start, len));
        }
        if op == ReduceOp::Avg {
            acc = divide(spec.dtype, &acc, n);
        }
        acc
    };
    // output element j comes from rank j / count, at element `at(j % count)`
    let blocks = |at: &dyn Fn(usize) -> usize| {
        let mut out = Vec::with_capacity(range.len());
        let mut j = first;
        while j < first + len {
            let (r, k) = (j / count, j % count);
            let take = (count - k).min(first + len - j);
            out.extend(part(r, at(k), take));
            j += take;
        }
        out
    };
    match spec.kind {
        OpKind::Allreduce(op) => Some(reduce_at(op, first)),
        OpKind::Reduce { op, root } => (root.idx() == me).then(|| reduce_at(op, first)),
        OpKind::Broadcast { root } => Some(part(root.idx(), first, len)),
        OpKind::ReduceScatter(op) => Some(reduce_at(op, me * count + first)),
        OpKind::Scatter { root } => Some(part(root.idx(), me * count + first, len)),
        OpKind::Allgather => Some(blocks(&|k| k)),
        OpKind::Gather { root } => (root.idx() == me).then(|| blocks(&|k| k)),
        OpKind::Alltoall => Some(blocks(&|k| me * count + k)),
    }
}

/// `op(a[i], b[i])` for every element, `a` the first operand: the
/// definition the kernels implement (integers wrap; float `min`/`max` are
/// Rust's `f32::min`/`max`, which return the other operand of a NaN;
/// `avg` sums). Both slices must be the same whole number of elements.
pub fn combine(dtype: DType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    assert_eq!(a.len(), b.len(), "operands of unequal length");
    let w = dtype.size();
    assert_eq!(a.len() % w, 0, "operands not element-aligned");
    let mut out = Vec::with_capacity(a.len());
    for (x, y) in a.chunks_exact(w).zip(b.chunks_exact(w)) {
        macro_rules! int {
            ($t:ty) => {{
                let x = <$t>::from_le_bytes(x.try_into().expect("element width"));
                let y = <$t>::from_le_bytes(y.try_into().expect("element width"));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => x.wrapping_add(y),
                    ReduceOp::Prod => x.wrapping_mul(y),
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                };
                out.extend_from_slice(&r.to_le_bytes());
            }};
        }
        macro_rules! float {
            ($t:ty, $to:expr, $from:expr) => {{
                let x = $to(<$t>::from_le_bytes(x.try_into().expect("element width")));
                let y = $to(<$t>::from_le_bytes(y.try_into().expect("element width")));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                };
                out.extend_from_slice(&$from(r).to_le_bytes());
            }};
        }
        match dtype {
            DType::U8 => int!(u8),
            DType::I8 => int!(i8),
            DType::U16 => int!(u16),
            DType::I16 => int!(i16),
            DType::U32 => int!(u32),
            DType::I32 => int!(i32),
            DType::U64 => int!(u64),
            DType::I64 => int!(i64),
            DType::F16 => float!(f16, f16::to_f32, f16::from_f32),
            DType::BF16 => float!(bf16, bf16::to_f32, bf16::from_f32),
            DType::F32 => float!(f32, |v| v, |v| v),
            DType::F64 => float!(f64, |v| v, |v| v),
        }
    }
    out
}

/// Every element divided by `n` (the last step of `avg`); integers, for
/// which `avg` is refused up front, are returned unchanged.
pub fn divide(dtype: DType, a: &[u8], n: usize) -> Vec<u8> {
    let w = dtype.size();
    assert_eq!(a.len() % w, 0, "operand not element-aligned");
    let mut out = Vec::with_capacity(a.len());
    for x in a.chunks_exact(w) {
        macro_rules! float {
            ($t:ty, $to:expr, $from:expr) => {{
                let v = $to(<$t>::from_le_bytes(x.try_into().expect("element width")));
                out.extend_from_slice(&$from(v / n as f32).to_le_bytes());
            }};
        }
        match dtype {
            DType::F16 => float!(f16, f16::to_f32, f16::from_f32),
            DType::BF16 => float!(bf16, bf16::to_f32, bf16::from_f32),
            DType::F32 => float!(f32, |v| v, |v| v),
            DType::F64 => {
                let v = f64::from_le_bytes(x.try_into().expect("element width"));
                out.extend_from_slice(&(v / n as f64).to_le_bytes());
            }
            _ => out.extend_from_slice(x),
        }
    }
    out
}

/// The number of [`OpKind`]s that [`op_shape`] picks from.
pub const OP_KINDS: usize = 8;

/// One op on one cluster, from indices (as property tests draw them): `n`
/// workers on hosts of `per` (the last host may have fewer), the
/// `kind`-th of the [`OP_KINDS`] op kinds with root `root`, the `op`-th
/// reduction of [`ReduceOp::ALL`] (`Sum` where the type has no such
/// reduction) and the `dtype`-th type of [`DType::ALL`].
///
/// # Panics
/// If `per` is 0 or an index is out of range (a test's own mistake).
pub fn op_shape(
    n: usize,
    per: usize,
    kind: usize,
    root: usize,
    op: usize,
    dtype: usize,
    count: usize,
) -> (Vec<usize>, OpSpec) {
    let dtype = DType::ALL[dtype];
    let op = Some(ReduceOp::ALL[op])
        .filter(|o| o.supports(dtype))
        .unwrap_or(ReduceOp::Sum);
    let root = kungfu_topology::Rank(u32::try_from(root).expect("a rank"));
    let kind = match kind {
        0 => OpKind::Allreduce(op),
        1 => OpKind::Reduce { op, root },
        2 => OpKind::Broadcast { root },
        3 => OpKind::Allgather,
        4 => OpKind::Gather { root },
        5 => OpKind::ReduceScatter(op),
        6 => OpKind::Alltoall,
        7 => OpKind::Scatter { root },
        _ => panic!("op kind {kind} of {OP_KINDS}"),
    };
    let mut hosts = vec![per; n / per];
    if !n.is_multiple_of(per) {
        hosts.push(n % per);
    }
    (
        hosts,
        OpSpec {
            kind,
            dtype,
            count,
            check: 0,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(dtype: DType, v: u8) -> Vec<u8> {
        let mut out = Vec::new();
        push_small(dtype, v, &mut out);
        out
    }

    /// The oracle itself, on values worked out by hand.
    #[test]
    fn combine_and_divide_by_hand() {
        // integers wrap, in their own width and signedness
        assert_eq!(combine(DType::U8, ReduceOp::Sum, &[250], &[10]), [4]);
        assert_eq!(combine(DType::U8, ReduceOp::Prod, &[16], &[17]), [16]);
        assert_eq!(combine(DType::I8, ReduceOp::Min, &[0xff], &[1]), [0xff]);
        assert_eq!(combine(DType::U8, ReduceOp::Min, &[0xff], &[1]), [1]);
        let i16s = |v: i16| v.to_le_bytes().to_vec();
        assert_eq!(
            combine(DType::I16, ReduceOp::Max, &i16s(-3), &i16s(2)),
            i16s(2)
        );
        // floats: min/max skip a NaN, as `f32::min` does
        let f = |v: f32| v.to_le_bytes().to_vec();
        assert_eq!(
            combine(DType::F32, ReduceOp::Min, &f(f32::NAN), &f(2.0)),
            f(2.0)
        );
        assert_eq!(
            combine(DType::F32, ReduceOp::Prod, &f(1.5), &f(-2.0)),
            f(-3.0)
        );
        // f16 rounds once: 2048 + 1 is a tie, rounded to even (2048)
        let h = |v: f32| f16::from_f32(v).to_le_bytes().to_vec();
        assert_eq!(
            combine(DType::F16, ReduceOp::Sum, &h(2048.0), &h(1.0)),
            h(2048.0)
        );
        assert_eq!(
            combine(DType::F16, ReduceOp::Sum, &h(2048.0), &h(3.0)),
            h(2052.0)
        );
        // bf16 keeps 8 significant bits: 256 + 1 rounds to 256
        let b = |v: f32| bf16::from_f32(v).to_le_bytes().to_vec();
        assert_eq!(
            combine(DType::BF16, ReduceOp::Sum, &b(256.0), &b(1.0)),
            b(256.0)
        );
        assert_eq!(
            combine(DType::BF16, ReduceOp::Max, &b(-1.0), &b(3.0)),
            b(3.0)
        );
        // avg divides floats only
        assert_eq!(
            divide(DType::F64, &6f64.to_le_bytes(), 4),
            1.5f64.to_le_bytes()
        );
        assert_eq!(
            divide(DType::F16, &one(DType::F16, 9), 3),
            one(DType::F16, 3)
        );
        assert_eq!(
            divide(DType::BF16, &one(DType::BF16, 9), 3),
            one(DType::BF16, 3)
        );
        assert_eq!(
            divide(DType::I32, &one(DType::I32, 9), 3),
            one(DType::I32, 9)
        );
    }

    #[test]
    fn expected_reduces_every_rank() {
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Avg),
            dtype: DType::F32,
            count: 2,
            check: 0,
        };
        let inputs: Vec<Vec<u8>> = [[1f32, 2.0], [3.0, 4.0], [5.0, 9.0]]
            .iter()
            .map(|v| bytemuck::cast_slice(v).to_vec())
            .collect();
        let want: Vec<u8> = bytemuck::cast_slice(&[3f32, 5.0]).to_vec();
        for r in 0..3 {
            assert_eq!(expected(&spec, r, &inputs), Some(want.clone()));
        }
        let rs = OpSpec {
            kind: OpKind::ReduceScatter(ReduceOp::Max),
            dtype: DType::F32,
            count: 1,
            check: 0,
        };
        assert_eq!(expected(&rs, 1, &inputs), Some(9f32.to_le_bytes().to_vec()));
    }

    /// `expected_part` over any range is that range of `expected`, for
    /// every kind, rank and cluster size, whole or in pieces.
    #[test]
    fn expected_part_is_expected_in_pieces() {
        use kungfu_topology::Rank;
        let r = |x| Rank(x);
        for n in 1..=4usize {
            for count in [0usize, 1, 5] {
                for dtype in [DType::F32, DType::I16] {
                    let root = r(n as u32 - 1);
                    let kinds = [
                        OpKind::Allreduce(ReduceOp::Sum),
                        OpKind::Allreduce(ReduceOp::Max),
                        OpKind::Reduce {
                            op: ReduceOp::Sum,
                            root,
                        },
                        OpKind::Broadcast { root },
                        OpKind::Allgather,
                        OpKind::Gather { root },
                        OpKind::ReduceScatter(ReduceOp::Sum),
                        OpKind::Alltoall,
                        OpKind::Scatter { root },
                    ];
                    for kind in kinds {
                        let spec = OpSpec {
                            kind,
                            dtype,
                            count,
                            check: 0,
                        };
                        let all = inputs(&spec, n);
                        for me in 0..n {
                            let want = expected(&spec, me, &all);
                            let len = want.as_ref().map_or(0, Vec::len);
                            let whole = expected_part(&spec, me, n, 0..len);
                            assert_eq!(whole, want, "{kind:?} n={n} count={count} rank {me}");
                            let Some(want) = want else { continue };
                            let w = dtype.size();
                            for step in [1, 2, 3] {
                                let mut got = Vec::new();
                                for a in (0..len).step_by(step * w) {
                                    let b = (a + step * w).min(len);
                                    got.extend(expected_part(&spec, me, n, a..b).unwrap());
                                }
                                assert_eq!(got, want, "{kind:?} n={n} count={count} step {step}");
                            }
                        }
                    }
                }
            }
        }
    }
}
