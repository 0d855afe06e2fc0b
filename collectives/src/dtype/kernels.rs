//! The reduction kernels over byte slices, compiled once per instruction
//! set (see the module docs of `dtype`).

use half::{bf16, f16};

use super::{DType, Order, ReduceOp};

macro_rules! dispatch {
    ($dtype:expr, $f:ident, $($args:expr),*) => {
        match $dtype {
            DType::U8 => $f::<u8>($($args),*),
            DType::I8 => $f::<i8>($($args),*),
            DType::U16 => $f::<u16>($($args),*),
            DType::I16 => $f::<i16>($($args),*),
            DType::U32 => $f::<u32>($($args),*),
            DType::I32 => $f::<i32>($($args),*),
            DType::U64 => $f::<u64>($($args),*),
            DType::I64 => $f::<i64>($($args),*),
            DType::F16 => $f::<f16>($($args),*),
            DType::BF16 => $f::<bf16>($($args),*),
            DType::F32 => $f::<f32>($($args),*),
            DType::F64 => $f::<f64>($($args),*),
        }
    };
}

/// Arithmetic the kernels need, per element type.
pub(super) trait Num: bytemuck::Pod {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
    fn from_le(b: &[u8]) -> Self;
    fn store_le(self, b: &mut [u8]);
}

macro_rules! int_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            fn min(self, o: Self) -> Self { Ord::min(self, o) }
            fn max(self, o: Self) -> Self { Ord::max(self, o) }
            fn div_n(self, _n: usize) -> Self { self }
            fn from_le(b: &[u8]) -> Self { <$t>::from_le_bytes(b.try_into().expect("element width")) }
            fn store_le(self, b: &mut [u8]) { b.copy_from_slice(&self.to_le_bytes()) }
        }
    )*};
}
int_num!(u8, i8, u16, i16, u32, i32, u64, i64);

macro_rules! float_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn add(self, o: Self) -> Self { self + o }
            fn mul(self, o: Self) -> Self { self * o }
            fn min(self, o: Self) -> Self { <$t>::min(self, o) }
            fn max(self, o: Self) -> Self { <$t>::max(self, o) }
            fn div_n(self, n: usize) -> Self { self / n as $t }
            fn from_le(b: &[u8]) -> Self { <$t>::from_le_bytes(b.try_into().expect("element width")) }
            fn store_le(self, b: &mut [u8]) { b.copy_from_slice(&self.to_le_bytes()) }
        }
    )*};
}
float_num!(f32, f64);

impl Num for f16 {
    fn add(self, o: Self) -> Self {
        f16::from_f32(self.to_f32() + o.to_f32())
    }
    fn mul(self, o: Self) -> Self {
        f16::from_f32(self.to_f32() * o.to_f32())
    }
    fn min(self, o: Self) -> Self {
        f16::from_f32(self.to_f32().min(o.to_f32()))
    }
    fn max(self, o: Self) -> Self {
        f16::from_f32(self.to_f32().max(o.to_f32()))
    }
    fn div_n(self, n: usize) -> Self {
        f16::from_f32(self.to_f32() / n as f32)
    }
    fn from_le(b: &[u8]) -> Self {
        f16::from_le_bytes(b.try_into().expect("element width"))
    }
    fn store_le(self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_le_bytes())
    }
}

/// bf16 -> f32 is a shift: branch-free, so loops over it vectorise.
#[inline(always)]
pub(super) fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// f32 -> bf16, rounding to nearest even (as `bf16::from_f32`), with NaN
/// kept quiet; written without branches so that loops vectorise.
#[inline(always)]
pub(super) fn f32_to_bf16(f: f32) -> bf16 {
    bf16::from_bits(f32_to_bf16_bits(f))
}

#[inline(always)]
fn f32_to_bf16_bits(f: f32) -> u16 {
    let b = f.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x0040;
    // |f| > inf in the bits is NaN; an integer compare vectorises
    (if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

impl Num for bf16 {
    fn add(self, o: Self) -> Self {
        f32_to_bf16(bf16_to_f32(self) + bf16_to_f32(o))
    }
    fn mul(self, o: Self) -> Self {
        f32_to_bf16(bf16_to_f32(self) * bf16_to_f32(o))
    }
    fn min(self, o: Self) -> Self {
        f32_to_bf16(bf16_to_f32(self).min(bf16_to_f32(o)))
    }
    fn max(self, o: Self) -> Self {
        f32_to_bf16(bf16_to_f32(self).max(bf16_to_f32(o)))
    }
    fn div_n(self, n: usize) -> Self {
        f32_to_bf16(bf16_to_f32(self) / n as f32)
    }
    fn from_le(b: &[u8]) -> Self {
        bf16::from_le_bytes(b.try_into().expect("element width"))
    }
    fn store_le(self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_le_bytes())
    }
}

#[inline(always)]
fn reduce_typed<T: Num>(op: ReduceOp, dst: &mut [u8], src: &[u8], order: Order) {
    // One monomorphic loop per operator and order (a function pointer per
    // element would block inlining and vectorisation).
    macro_rules! by_order {
        ($f:expr) => {
            match order {
                Order::DstFirst => zip_apply(dst, src, $f),
                Order::SrcFirst => zip_apply(dst, src, |d: T, s: T| $f(s, d)),
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => by_order!(T::add),
        ReduceOp::Prod => by_order!(T::mul),
        ReduceOp::Min => by_order!(T::min),
        ReduceOp::Max => by_order!(T::max),
    }
}

#[inline(always)]
fn zip_apply<T: Num, F: Fn(T, T) -> T>(dst: &mut [u8], src: &[u8], f: F) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(d), Ok(s)) => {
            for (d, s) in d.iter_mut().zip(s) {
                *d = f(*d, *s);
            }
        }
        _ => {
            let w = std::mem::size_of::<T>();
            for (d, s) in dst.chunks_exact_mut(w).zip(src.chunks_exact(w)) {
                f(T::from_le(d), T::from_le(s)).store_le(d);
            }
        }
    }
}

/// Elements of a 16-bit float type converted per block.
const HALF_BLOCK: usize = 256;

/// A 16-bit float type reduced through f32.
trait HalfFloat: Num {
    fn widen(src: &[u8], out: &mut [f32]);
    fn narrow(src: &[f32], out: &mut [u8]);
}

impl HalfFloat for f16 {
    #[inline(always)]
    fn widen(src: &[u8], out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        match bytemuck::try_cast_slice::<u8, f16>(src) {
            Ok(h) => h.convert_to_f32_slice(out),
            Err(_) => {
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_le(c).to_f32();
                }
            }
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], out: &mut [u8]) {
        use half::slice::HalfFloatSliceExt;
        match bytemuck::try_cast_slice_mut::<u8, f16>(out) {
            Ok(h) => h.convert_from_f32_slice(src),
            Err(_) => {
                for (x, c) in src.iter().zip(out.chunks_exact_mut(2)) {
                    f16::from_f32(*x).store_le(c);
                }
            }
        }
    }
}

impl HalfFloat for bf16 {
    #[inline(always)]
    fn widen(src: &[u8], out: &mut [f32]) {
        match bytemuck::try_cast_slice::<u8, u16>(src) {
            Ok(h) => {
                for (o, h) in out.iter_mut().zip(h) {
                    *o = f32::from_bits(u32::from(*h) << 16);
                }
            }
            Err(_) => {
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                }
            }
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], out: &mut [u8]) {
        match bytemuck::try_cast_slice_mut::<u8, u16>(out) {
            Ok(h) => {
                for (x, h) in src.iter().zip(h) {
                    *h = f32_to_bf16_bits(*x);
                }
            }
            Err(_) => {
                for (x, c) in src.iter().zip(out.chunks_exact_mut(2)) {
                    c.copy_from_slice(&f32_to_bf16_bits(*x).to_le_bytes());
                }
            }
        }
    }
}

/// Reduces 16-bit floats block by block in f32 (same results as
/// element-wise: widening is exact, each result is rounded once).
#[inline(always)]
fn reduce_half<H: HalfFloat>(op: ReduceOp, dst: &mut [u8], src: &[u8], order: Order) {
    let mut a = [0f32; HALF_BLOCK];
    let mut b = [0f32; HALF_BLOCK];
    for (d, s) in dst
        .chunks_mut(2 * HALF_BLOCK)
        .zip(src.chunks(2 * HALF_BLOCK))
    {
        let k = d.len() / 2;
        H::widen(d, &mut a[..k]);
        H::widen(s, &mut b[..k]);
        reduce_typed::<f32>(
            op,
            bytemuck::cast_slice_mut(&mut a[..k]),
            bytemuck::cast_slice(&b[..k]),
            order,
        );
        H::narrow(&a[..k], d);
    }
}

#[inline(always)]
fn reduce_any(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8], order: Order) {
    match dtype {
        DType::F16 => reduce_half::<f16>(op, dst, src, order),
        DType::BF16 => reduce_half::<bf16>(op, dst, src, order),
        d => dispatch!(d, reduce_typed, op, dst, src, order),
    }
}

/// The instruction set the kernels run with on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelIsa {
    Avx512,
    Avx2,
    Baseline,
}

/// Every instruction set this CPU can run the kernels with, widest first
/// (always ending with [`KernelIsa::Baseline`]), whatever
/// `KUNGFU_KERNEL_ISA` says: the set tests compare with each other.
pub fn runnable_isas() -> &'static [KernelIsa] {
    static ISAS: std::sync::OnceLock<Vec<KernelIsa>> = std::sync::OnceLock::new();
    ISAS.get_or_init(|| {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl");
            if avx512 {
                v.push(KernelIsa::Avx512);
            }
            if avx2 {
                v.push(KernelIsa::Avx2);
            }
        }
        v.push(KernelIsa::Baseline);
        v
    })
}

/// The instruction set `cap` (a `KUNGFU_KERNEL_ISA` value) picks from
/// `runnable` (widest first): `baseline`, `avx2` if runnable, else the
/// widest.
pub(super) fn pick_isa(cap: &str, runnable: &[KernelIsa]) -> KernelIsa {
    let widest = runnable.first().copied().unwrap_or(KernelIsa::Baseline);
    match cap {
        "baseline" => KernelIsa::Baseline,
        "avx2" if runnable.contains(&KernelIsa::Avx2) => KernelIsa::Avx2,
        _ => widest,
    }
}

/// Panics unless the CPU can run `isa`: the vector kernels' safety rests
/// on it (a cheap check next to a reduction).
pub(super) fn assert_runnable(isa: KernelIsa) {
    assert!(
        runnable_isas().contains(&isa),
        "this CPU cannot run the {isa:?} kernels"
    );
}

/// Detected once. `KUNGFU_KERNEL_ISA=baseline|avx2` caps it (to compare,
/// or to rule the vector paths out when debugging).
pub fn kernel_isa() -> KernelIsa {
    static ISA: std::sync::OnceLock<KernelIsa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("KUNGFU_KERNEL_ISA").unwrap_or_default();
        pick_isa(&cap, runnable_isas())
    })
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod isa {
    use super::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) fn reduce_avx512(dtype: DType, op: ReduceOp, d: &mut [u8], s: &[u8], o: Order) {
        reduce_any(dtype, op, d, s, o)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn reduce_avx2(dtype: DType, op: ReduceOp, d: &mut [u8], s: &[u8], o: Order) {
        reduce_any(dtype, op, d, s, o)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn sq_norm_avx512(x: &[f32]) -> f64 {
        sq_norm_any(x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn sq_norm_avx2(x: &[f32]) -> f64 {
        sq_norm_any(x)
    }

    /// Panics if the CPU cannot run `isa`.
    pub(super) fn sq_norm(isa: KernelIsa, x: &[f32]) -> f64 {
        assert_runnable(isa);
        match isa {
            // SAFETY: checked above: the CPU has every feature the
            // function is compiled for.
            KernelIsa::Avx512 => unsafe { sq_norm_avx512(x) },
            // SAFETY: as above, for avx2, fma and f16c.
            KernelIsa::Avx2 => unsafe { sq_norm_avx2(x) },
            KernelIsa::Baseline => sq_norm_any(x),
        }
    }

    /// Sums or multiplies 16-bit floats 8 at a time in f32 registers
    /// (F16C for f16, shifts for bf16; both round to nearest even once),
    /// then the tail through the block path. Min and max keep the block
    /// path: their NaN rules are those of `f32::min`, not of `vminps`.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn half_sum_prod(bf: bool, prod: bool, d: &mut [u8], s: &[u8]) {
        use std::arch::x86_64::*;
        let n = d.len().min(s.len()) / 16;
        let (dp, sp) = (d.as_mut_ptr(), s.as_ptr());
        let widen = |v: __m128i| -> __m256 {
            if bf {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
            } else {
                _mm256_cvtph_ps(v)
            }
        };
        let narrow = |x: __m256| -> __m128i {
            if bf {
                let b = _mm256_castps_si256(x);
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
                let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
                let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
                let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
                let abs = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
                let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
                let r = _mm256_blendv_epi8(rounded, quiet, nan);
                let r = _mm256_and_si256(r, _mm256_set1_epi32(0xffff));
                let packed = _mm256_packus_epi32(r, r);
                _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
            } else {
                _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(x)
            }
        };
        for i in 0..n {
            // SAFETY: 16 * i + 16 <= len of both slices; unaligned loads
            // and stores of 16 bytes are allowed at any address.
            unsafe {
                let a = widen(_mm_loadu_si128(dp.add(16 * i) as *const __m128i));
                let b = widen(_mm_loadu_si128(sp.add(16 * i) as *const __m128i));
                let r = if prod {
                    _mm256_mul_ps(a, b)
                } else {
                    _mm256_add_ps(a, b)
                };
                _mm_storeu_si128(dp.add(16 * i) as *mut __m128i, narrow(r));
            }
        }
        let op = if prod { ReduceOp::Prod } else { ReduceOp::Sum };
        let (dt, st) = (&mut d[16 * n..], &s[16 * n..]);
        if bf {
            reduce_half::<half::bf16>(op, dt, st, Order::DstFirst);
        } else {
            reduce_half::<half::f16>(op, dt, st, Order::DstFirst);
        }
    }

    /// The vector 16-bit path applies (sum and product of f16 and bf16).
    fn half_fast(dtype: DType, op: ReduceOp) -> Option<(bool, bool)> {
        let bf = match dtype {
            DType::F16 => false,
            DType::BF16 => true,
            _ => return None,
        };
        match op {
            ReduceOp::Sum | ReduceOp::Avg => Some((bf, false)),
            ReduceOp::Prod => Some((bf, true)),
            ReduceOp::Min | ReduceOp::Max => None,
        }
    }

    /// Panics if the CPU cannot run `isa`.
    pub(super) fn reduce(
        isa: KernelIsa,
        dtype: DType,
        op: ReduceOp,
        d: &mut [u8],
        s: &[u8],
        o: Order,
    ) {
        assert_runnable(isa);
        if let (KernelIsa::Avx512 | KernelIsa::Avx2, Some((bf, prod))) = (isa, half_fast(dtype, op))
        {
            // SAFETY: checked above: the CPU runs these, so it has avx2,
            // fma and f16c. Sum and product are symmetric, so the
            // operand order only matters for NaN payloads (either is NaN).
            return unsafe { half_sum_prod(bf, prod, d, s) };
        }
        match isa {
            // SAFETY: checked above: the CPU has every feature the
            // function is compiled for.
            KernelIsa::Avx512 => unsafe { reduce_avx512(dtype, op, d, s, o) },
            // SAFETY: as above, for avx2, fma and f16c.
            KernelIsa::Avx2 => unsafe { reduce_avx2(dtype, op, d, s, o) },
            KernelIsa::Baseline => reduce_any(dtype, op, d, s, o),
        }
    }
}

fn scale_typed<T: Num>(buf: &mut [u8], n: usize) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(b) => b.iter_mut().for_each(|x| *x = x.div_n(n)),
        Err(_) => {
            for c in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                T::from_le(c).div_n(n).store_le(c);
            }
        }
    }
}

/// `dst[i] = op(dst[i], src[i])` for every element.
///
/// Panics if the slices differ in length or are not a whole number of
/// elements: plans only produce element-aligned ranges of equal length, and
/// frame lengths are checked before they reach a kernel.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_into_ordered(dtype, op, dst, src, Order::DstFirst)
}

/// [`reduce_into`] with the operands in `order`.
pub fn reduce_into_ordered(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8], order: Order) {
    reduce_with_isa(kernel_isa(), dtype, op, dst, src, order)
}

/// [`reduce_into_ordered`] with the kernels compiled for `isa`, so that
/// tests and benchmarks can compare every instruction set the CPU runs in
/// one process. Panics if `isa` is not in [`runnable_isas`].
pub fn reduce_with_isa(
    isa: KernelIsa,
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
    order: Order,
) {
    assert_eq!(dst.len(), src.len(), "reduce of unequal ranges");
    assert_eq!(dst.len() % dtype.size(), 0, "range not element-aligned");
    #[cfg(target_arch = "x86_64")]
    isa::reduce(isa, dtype, op, dst, src, order);
    #[cfg(not(target_arch = "x86_64"))]
    {
        assert_runnable(isa);
        reduce_any(dtype, op, dst, src, order);
    }
}

/// `sum x^2` in blocks: 32 f32 lanes within a block of 4096 elements
/// (vectorised by the compiler for the ISA it is compiled for), block sums
/// added in f64, so the relative error stays near f32's epsilon.
#[inline(always)]
fn sq_norm_any(x: &[f32]) -> f64 {
    let mut total = 0f64;
    for block in x.chunks(4096) {
        let mut acc = [0f32; 32];
        let chunks = block.chunks_exact(32);
        let rest = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += v * v;
            }
        }
        let tail: f32 = rest.iter().map(|v| v * v).sum();
        total += f64::from(acc.iter().sum::<f32>() + tail);
    }
    total
}

/// The squared L2 norm of `x` (a gradient monitor's kernel), with the
/// widest vector instructions the CPU has.
pub fn sq_norm_f32(x: &[f32]) -> f64 {
    sq_norm_with_isa(kernel_isa(), x)
}

/// [`sq_norm_f32`] with the kernel compiled for `isa`. Panics if `isa` is
/// not in [`runnable_isas`].
pub fn sq_norm_with_isa(isa: KernelIsa, x: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    return isa::sq_norm(isa, x);
    #[cfg(not(target_arch = "x86_64"))]
    {
        assert_runnable(isa);
        sq_norm_any(x)
    }
}

/// Divides every element by `n` (the last step of [`ReduceOp::Avg`]).
/// Integers are left unchanged (`Avg` is refused for them up front).
pub fn scale_down(dtype: DType, buf: &mut [u8], n: usize) {
    assert_eq!(buf.len() % dtype.size(), 0, "range not element-aligned");
    dispatch!(dtype, scale_typed, buf, n)
}
