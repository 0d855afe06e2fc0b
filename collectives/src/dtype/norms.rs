//! The gradient monitors' kernel fused into the reduction: one pass that
//! sums `dst += src` (f32) and, in the same loads, the squares of `dst`'s
//! old values, of `src` and of `dst`'s new values. Where an allreduce
//! reduces a slice of every rank's values (the host fast path's split and
//! large ways), these give the slice's share of the sum over ranks of the
//! squared input norms and of the squared norm of the result, with no pass
//! of their own over the buffer.

use super::kernels::{assert_runnable, kernel_isa, KernelIsa};

/// Squares summed by [`reduce_sum_sq`]: of `dst` before, of `src`, and of
/// `dst` after (f64 sums of f32 blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SumSquares {
    pub dst_before: f64,
    pub src: f64,
    pub dst_after: f64,
}

/// `dst[i] += src[i]` over f32 values in bytes (the same bits as
/// [`super::reduce_into`] with [`super::ReduceOp::Sum`]), returning the
/// sums of squares of `dst` before and after and of `src`. Panics if the
/// ranges differ in length or are not whole f32s.
pub fn reduce_sum_sq(dst: &mut [u8], src: &[u8]) -> SumSquares {
    reduce_sum_sq_with_isa(kernel_isa(), dst, src)
}

/// [`reduce_sum_sq`] compiled for `isa`. Panics if the CPU cannot run it.
pub fn reduce_sum_sq_with_isa(isa: KernelIsa, dst: &mut [u8], src: &[u8]) -> SumSquares {
    assert_eq!(dst.len(), src.len(), "reduce of unequal ranges");
    assert_eq!(dst.len() % 4, 0, "range not element-aligned");
    assert_runnable(isa);
    let aligned = |p: *const u8| (p as usize).is_multiple_of(std::mem::align_of::<f32>());
    if aligned(dst.as_ptr()) && aligned(src.as_ptr()) {
        dispatch(
            isa,
            bytemuck::cast_slice_mut::<u8, f32>(dst),
            bytemuck::cast_slice::<u8, f32>(src),
        )
    } else {
        unaligned(dst, src)
    }
}

/// The squared L2 norm of f32 values in bytes (any alignment; a partial
/// trailing element is ignored).
pub fn sq_norm_bytes(b: &[u8]) -> f64 {
    match bytemuck::try_cast_slice::<u8, f32>(&b[..b.len() / 4 * 4]) {
        Ok(g) => super::sq_norm_f32(g),
        Err(_) => b
            .chunks_exact(4)
            .map(|c| {
                let x = f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                x * x
            })
            .sum(),
    }
}

// the one unsafe call: a kernel compiled for features the CPU was checked for
#[allow(unsafe_code)]
fn dispatch(isa: KernelIsa, d: &mut [f32], s: &[f32]) -> SumSquares {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `assert_runnable` checked that the CPU has every
        // feature the function is compiled for.
        KernelIsa::Avx512 => unsafe { x86::sum_sq_avx512(d, s) },
        // SAFETY: as above, for avx2 and fma.
        KernelIsa::Avx2 => unsafe { x86::sum_sq_avx2(d, s) },
        KernelIsa::Baseline => sum_sq_any::<false>(d, s),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        sum_sq_any::<false>(d, s)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{sum_sq_any, SumSquares};

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) fn sum_sq_avx512(d: &mut [f32], s: &[f32]) -> SumSquares {
        sum_sq_any::<true>(d, s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn sum_sq_avx2(d: &mut [f32], s: &[f32]) -> SumSquares {
        sum_sq_any::<true>(d, s)
    }
}

/// Lanes of the accumulators (vectorised by the compiler: two chains of
/// AVX-512 registers, four of AVX2 ones, so that the adds of one do not
/// wait for the last) and elements per block, whose f32 sums are added
/// in f64 (as `sq_norm_f32` does).
const LANES: usize = 32;
const BLOCK: usize = 4096;

/// With `FMA`, each square is added by a fused multiply-add (one
/// instruction, one rounding: the squares may differ from the baseline's
/// in their last bits; the sum `dst + src` never does).
#[inline(always)]
fn sum_sq_any<const FMA: bool>(d: &mut [f32], s: &[f32]) -> SumSquares {
    let sq_add = |acc: f32, x: f32| if FMA { x.mul_add(x, acc) } else { acc + x * x };
    let mut out = SumSquares::default();
    for (db, sb) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
        let (mut a, mut b, mut c) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
        let mut dc = db.chunks_exact_mut(LANES);
        let mut sc = sb.chunks_exact(LANES);
        for (dv, sv) in (&mut dc).zip(&mut sc) {
            let dv: &mut [f32; LANES] = dv.try_into().expect("LANES elements");
            let sv: &[f32; LANES] = sv.try_into().expect("LANES elements");
            for i in 0..LANES {
                let (x, y) = (dv[i], sv[i]);
                let z = x + y;
                a[i] = sq_add(a[i], x);
                b[i] = sq_add(b[i], y);
                c[i] = sq_add(c[i], z);
                dv[i] = z;
            }
        }
        let (mut ta, mut tb, mut tc) = (0f32, 0f32, 0f32);
        for (x, &y) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
            let z = *x + y;
            ta += *x * *x;
            tb += y * y;
            tc += z * z;
            *x = z;
        }
        out.dst_before += f64::from(halves(a) + ta);
        out.src += f64::from(halves(b) + tb);
        out.dst_after += f64::from(halves(c) + tc);
    }
    out
}

/// The sum of the lanes by halves (a few vector adds, where a running
/// sum would be `LANES` adds each waiting for the last).
#[inline(always)]
fn halves(mut a: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

fn unaligned(d: &mut [u8], s: &[u8]) -> SumSquares {
    let mut out = SumSquares::default();
    for (dc, sc) in d.chunks_exact_mut(4).zip(s.chunks_exact(4)) {
        let x = f32::from_le_bytes([dc[0], dc[1], dc[2], dc[3]]);
        let y = f32::from_le_bytes([sc[0], sc[1], sc[2], sc[3]]);
        let z = x + y;
        out.dst_before += f64::from(x) * f64::from(x);
        out.src += f64::from(y) * f64::from(y);
        out.dst_after += f64::from(z) * f64::from(z);
        dc.copy_from_slice(&z.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{reduce_into, runnable_isas};
    use crate::{DType, ReduceOp};

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Every ISA (and the unaligned path) sums to the same bits as the
    /// reduction kernel, and its squares match an f64 reference.
    #[test]
    fn fused_sum_matches_the_kernel_and_its_squares_a_reference() {
        for len in [0usize, 1, 15, 16, 17, 4095, 4096, 4097, 10_000] {
            let d: Vec<f32> = (0..len).map(|i| (i % 97) as f32 * 0.25 - 7.0).collect();
            let s: Vec<f32> = (0..len).map(|i| (i % 31) as f32 * -0.5 + 3.0).collect();
            let mut want = bytes(&d);
            reduce_into(DType::F32, ReduceOp::Sum, &mut want, &bytes(&s));
            let sq = |v: &[f32]| v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
            let after: Vec<f32> = d.iter().zip(&s).map(|(x, y)| x + y).collect();
            let close = |got: f64, want: f64| (got - want).abs() <= 1e-5 * want.max(1.0);
            let check = |what: &str, got: &[u8], q: SumSquares| {
                assert_eq!(got, &want[..], "{what}, {len} elements: sum");
                assert!(close(q.dst_before, sq(&d)), "{what}, {len}: {q:?}");
                assert!(close(q.src, sq(&s)), "{what}, {len}: {q:?}");
                assert!(close(q.dst_after, sq(&after)), "{what}, {len}: {q:?}");
            };
            for &isa in runnable_isas() {
                let mut got = bytes(&d);
                let q = reduce_sum_sq_with_isa(isa, &mut got, &bytes(&s));
                check(&format!("{isa:?}"), &got, q);
            }
            // one byte off alignment, both sides
            let mut dd = vec![0u8; 4 * len + 1];
            dd[1..].copy_from_slice(&bytes(&d));
            let mut ss = vec![0u8; 4 * len + 1];
            ss[1..].copy_from_slice(&bytes(&s));
            let q = reduce_sum_sq(&mut dd[1..], &ss[1..]);
            check("unaligned", &dd[1..], q);
        }
    }
}
