//! Element types, reduction operators, and the reduction kernels.
//!
//! Kernels work on byte slices so the plans stay type-erased. When both
//! slices are aligned for the element type (the common case: buffers come
//! from the allocator and ranges start at element boundaries) they run on
//! typed slices, which the compiler vectorises; otherwise an unaligned
//! fallback reads and writes little-endian elements.
//!
//! Every kernel is compiled three times, for AVX-512, for AVX2 + FMA and
//! for the baseline target, and the first the CPU supports is picked at
//! run time (once; see [`kernel_isa`]). f16 and bf16 are reduced in blocks:
//! converted to f32 (f16 by `half`'s slice conversions, which use F16C
//! where present; bf16 by a shift), reduced in f32, rounded back.

use std::fmt;

use half::{bf16, f16};

/// An element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    U8 = 1,
    I8 = 2,
    U16 = 3,
    I16 = 4,
    U32 = 5,
    I32 = 6,
    U64 = 7,
    I64 = 8,
    F16 = 9,
    BF16 = 10,
    F32 = 11,
    F64 = 12,
}

impl DType {
    pub const ALL: [DType; 12] = [
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == v)
    }

    /// Parses a name as used by nccl-tests and our tools (`float`, `f32`,
    /// `half`, `bfloat16`, `int32`, ...).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" | "char" => DType::I8,
            "u16" | "uint16" => DType::U16,
            "i16" | "int16" => DType::I16,
            "u32" | "uint32" | "uint" => DType::U32,
            "i32" | "int32" | "int" => DType::I32,
            "u64" | "uint64" => DType::U64,
            "i64" | "int64" => DType::I64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 1,
    Min = 2,
    Max = 3,
    Prod = 4,
    /// Sum divided by the number of ranks; floats only.
    Avg = 5,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Prod,
        ReduceOp::Avg,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Prod => "prod",
            ReduceOp::Avg => "avg",
        }
    }

    pub fn from_u8(v: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| *o as u8 == v)
    }

    pub fn parse(s: &str) -> Option<ReduceOp> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name().eq_ignore_ascii_case(s))
    }

    /// Whether `self` applies to `dtype`.
    pub fn supports(self, dtype: DType) -> bool {
        self != ReduceOp::Avg || dtype.is_float()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is one of the [`DType`]s.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32,
    u64 => U64, i64 => I64, f16 => F16, bf16 => BF16, f32 => F32, f64 => F64);

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
trait Num: bytemuck::Pod {
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
fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// f32 -> bf16, rounding to nearest even (as `bf16::from_f32`), with NaN
/// kept quiet; written without branches so that loops vectorise.
#[inline(always)]
fn f32_to_bf16(f: f32) -> bf16 {
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

/// Which operand comes first: `dst = op(dst, src)` or `dst = op(src, dst)`.
/// Ranks that each reduce the same two values (recursive doubling) use
/// one canonical order, so float results agree to the bit even for the
/// cases where an operator is not symmetric (`max(0.0, -0.0)`, NaN
/// payloads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    DstFirst,
    SrcFirst,
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
fn pick_isa(cap: &str, runnable: &[KernelIsa]) -> KernelIsa {
    let widest = runnable.first().copied().unwrap_or(KernelIsa::Baseline);
    match cap {
        "baseline" => KernelIsa::Baseline,
        "avx2" if runnable.contains(&KernelIsa::Avx2) => KernelIsa::Avx2,
        _ => widest,
    }
}

/// Panics unless the CPU can run `isa`: the vector kernels' safety rests
/// on it (a cheap check next to a reduction).
fn assert_runnable(isa: KernelIsa) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sq_norm_matches_an_f64_reference() {
        for n in [0usize, 1, 31, 32, 33, 4095, 4096, 4097, 100_003] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
                .collect();
            let want: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let by_isa = runnable_isas()
                .iter()
                .map(|&isa| (format!("{isa:?}"), sq_norm_with_isa(isa, &x)));
            for (isa, got) in by_isa.chain([("dispatched".to_string(), sq_norm_f32(&x))]) {
                assert!(
                    (got - want).abs() <= 1e-5 * want.max(1e-30),
                    "{isa} {n}: {got} vs {want}"
                );
            }
        }
    }

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    /// Small exact values, every dtype and op, at every ISA this CPU runs:
    /// `op(4, 2)` against values worked out by hand.
    #[test]
    fn every_dtype_and_op() {
        let elem = |d: DType, v: f64| -> Vec<u8> {
            let mut out = Vec::new();
            for _ in 0..3 {
                match d {
                    DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
                    DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
                    DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
                    DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
                    _ => {
                        let mut e = vec![0u8; d.size()];
                        e[0] = v as u8;
                        out.extend_from_slice(&e);
                    }
                }
            }
            out
        };
        for &isa in runnable_isas() {
            for d in DType::ALL {
                for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(d)) {
                    let mut acc = elem(d, 4.0);
                    reduce_with_isa(isa, d, op, &mut acc, &elem(d, 2.0), Order::DstFirst);
                    let want = match op {
                        ReduceOp::Sum | ReduceOp::Avg => 6.0,
                        ReduceOp::Prod => 8.0,
                        ReduceOp::Min => 2.0,
                        ReduceOp::Max => 4.0,
                    };
                    assert_eq!(acc, elem(d, want), "{isa:?} {d} {op}");
                }
            }
        }
    }

    /// Random bit patterns of every dtype, reduced by the kernels of every
    /// instruction set this CPU runs (the baseline f16/bf16 block path, and
    /// the AVX2 and AVX-512 builds with their 16-bit vector path) and by
    /// the scalar oracle of [`crate::reference`], which shares no code with
    /// the kernels: identical bits (NaNs compared as NaN), both operand
    /// orders, aligned and not, lengths around the vector widths.
    #[test]
    fn every_isa_matches_the_scalar_oracle() {
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let same = |d: DType, x: &[u8], y: &[u8]| -> bool {
            x.chunks_exact(d.size())
                .zip(y.chunks_exact(d.size()))
                .all(|(a, b)| {
                    a == b
                        || match d {
                            DType::F16 => f16::from_le(a).is_nan() && f16::from_le(b).is_nan(),
                            DType::BF16 => bf16::from_le(a).is_nan() && bf16::from_le(b).is_nan(),
                            DType::F32 => f32::from_le(a).is_nan() && f32::from_le(b).is_nan(),
                            DType::F64 => f64::from_le(a).is_nan() && f64::from_le(b).is_nan(),
                            _ => false,
                        }
                })
        };
        let isas = runnable_isas();
        assert_eq!(isas.last(), Some(&KernelIsa::Baseline));
        for &isa in isas {
            for d in DType::ALL {
                for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(d)) {
                    for order in [Order::DstFirst, Order::SrcFirst] {
                        for (len, off) in [
                            (1usize, 0usize),
                            (15, 0),
                            (17, 1),
                            (1000, 0),
                            (1000, 1),
                            (4099, 0),
                        ] {
                            let bytes = len * d.size();
                            let mut a: Vec<u8> = (0..bytes + off).map(|_| next() as u8).collect();
                            let b: Vec<u8> = (0..bytes + off).map(|_| next() as u8).collect();
                            let (x, y) = match order {
                                Order::DstFirst => (&a[off..], &b[off..]),
                                Order::SrcFirst => (&b[off..], &a[off..]),
                            };
                            let want = crate::reference::combine(d, op, x, y);
                            let head = a[..off].to_vec();
                            reduce_with_isa(isa, d, op, &mut a[off..], &b[off..], order);
                            if a[..off] != head[..] || !same(d, &a[off..], &want) {
                                let i = (0..want.len())
                                    .find(|&i| a[off + i] != want[i])
                                    .unwrap_or(0);
                                let i = i - i % d.size();
                                let w = d.size();
                                panic!(
                                    "{isa:?} {d} {op} {order:?} len {len} offset {off}: element {} got {:x?} want {:x?}, operand {:x?}",
                                    i / w, &a[off + i..off + i + w], &want[i..i + w], &b[off + i..off + i + w]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// `KUNGFU_KERNEL_ISA` caps the instruction set, never beyond what the
    /// CPU runs, and the set the CPU runs is the one its features allow.
    #[test]
    fn the_cap_picks_the_kernel_isa() {
        use KernelIsa::*;
        let all = [Avx512, Avx2, Baseline];
        assert_eq!(pick_isa("", &all), Avx512);
        assert_eq!(pick_isa("avx512", &all), Avx512);
        assert_eq!(pick_isa("avx2", &all), Avx2);
        assert_eq!(pick_isa("baseline", &all), Baseline);
        assert_eq!(pick_isa("nonsense", &all), Avx512);
        assert_eq!(pick_isa("", &[Avx2, Baseline]), Avx2);
        assert_eq!(pick_isa("avx512", &[Avx2, Baseline]), Avx2);
        assert_eq!(pick_isa("avx2", &[Baseline]), Baseline);
        assert_eq!(pick_isa("", &[Baseline]), Baseline);
        // this process: its cap applied to what this CPU runs
        let cap = std::env::var("KUNGFU_KERNEL_ISA").unwrap_or_default();
        assert_eq!(kernel_isa(), pick_isa(&cap, runnable_isas()));
        let isas = runnable_isas();
        assert_eq!(isas.last(), Some(&Baseline));
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
            assert_eq!(isas.contains(&Avx2), avx2, "{isas:?}");
            assert_eq!(isas.contains(&Avx512), avx512, "{isas:?}");
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert_eq!(isas, [Baseline]);
    }

    #[test]
    // Heap buffers (aligned by the allocator) offset by one byte are
    // misaligned for f32; a stack array's alignment would be unknown.
    #[allow(clippy::useless_vec)]
    fn unaligned_ranges_use_the_fallback() {
        let mut a = vec![0u8; 17];
        let mut b = vec![0u8; 17];
        for i in 0..4 {
            a[1 + 4 * i..5 + 4 * i].copy_from_slice(&(i as f32).to_le_bytes());
            b[1 + 4 * i..5 + 4 * i].copy_from_slice(&10f32.to_le_bytes());
        }
        reduce_into(DType::F32, ReduceOp::Sum, &mut a[1..], &b[1..]);
        for i in 0..4 {
            let v = f32::from_le_bytes(a[1 + 4 * i..5 + 4 * i].try_into().unwrap());
            assert_eq!(v, i as f32 + 10.0);
        }
    }

    /// The branch-free bf16 conversion agrees with the `half` crate on
    /// every bf16 value and on a million f32 values (ties included).
    #[test]
    fn bf16_conversion_matches_half() {
        for bits in 0..=u16::MAX {
            let x = bf16::from_bits(bits);
            let f = bf16_to_f32(x);
            if x.is_nan() {
                // `half` quiets signalling NaNs; any NaN will do
                assert!(f.is_nan());
            } else {
                assert_eq!(f.to_bits(), x.to_f32().to_bits(), "{bits:#x}");
            }
            let back = f32_to_bf16(f);
            if x.is_nan() {
                assert!(back.is_nan());
            } else {
                assert_eq!(back.to_bits(), bits);
            }
        }
        let mut z: u32 = 12345;
        for _ in 0..1_000_000 {
            z = z.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let f = f32::from_bits(z);
            let ours = f32_to_bf16(f);
            let theirs = bf16::from_f32(f);
            if f.is_nan() {
                assert!(ours.is_nan());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{f:e}");
            }
        }
    }

    #[test]
    fn integer_overflow_wraps() {
        for &isa in runnable_isas() {
            let mut a = vec![250u8; 40];
            reduce_with_isa(
                isa,
                DType::U8,
                ReduceOp::Sum,
                &mut a,
                &[10; 40],
                Order::DstFirst,
            );
            assert_eq!(a, [4; 40], "{isa:?}");
            let mut b = bytes(&[i32::MIN; 20]);
            let five = bytes(&[5i32; 20]);
            reduce_with_isa(
                isa,
                DType::I32,
                ReduceOp::Min,
                &mut b,
                &five,
                Order::DstFirst,
            );
            assert_eq!(b, bytes(&[i32::MIN; 20]), "{isa:?}");
        }
    }

    #[test]
    fn avg_scales_floats() {
        let mut a = bytes(&[6.0f64, 9.0]);
        scale_down(DType::F64, &mut a, 3);
        assert_eq!(a, bytes(&[2.0f64, 3.0]));
        assert!(!ReduceOp::Avg.supports(DType::I32));
        assert!(ReduceOp::Avg.supports(DType::BF16));
    }

    #[test]
    fn names_parse() {
        assert_eq!(DType::parse("float"), Some(DType::F32));
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(ReduceOp::parse("SUM"), Some(ReduceOp::Sum));
        for d in DType::ALL {
            assert_eq!(DType::from_u8(d as u8), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
        }
    }
}
