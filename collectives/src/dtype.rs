//! Element types, reduction operators, and the reduction kernels.
//!
//! Kernels work on byte slices so the plans stay type-erased. When both
//! slices are aligned for the element type (the common case: buffers come
//! from the allocator and ranges start at element boundaries) they run on
//! typed slices, which the compiler vectorises; otherwise an unaligned
//! fallback reads and writes little-endian elements.

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
    let b = f.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    bf16::from_bits(if f.is_nan() { nan } else { rounded })
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

fn reduce_typed<T: Num>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    // One monomorphic loop per operator (a function pointer per element
    // would block inlining and vectorisation).
    match op {
        ReduceOp::Sum | ReduceOp::Avg => zip_apply(dst, src, T::add),
        ReduceOp::Prod => zip_apply(dst, src, T::mul),
        ReduceOp::Min => zip_apply(dst, src, T::min),
        ReduceOp::Max => zip_apply(dst, src, T::max),
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

/// `dst[i] = op(dst[i], src[i])` for every element.
///
/// Panics if the slices differ in length or are not a whole number of
/// elements: plans only produce element-aligned ranges of equal length, and
/// frame lengths are checked before they reach a kernel.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce of unequal ranges");
    assert_eq!(dst.len() % dtype.size(), 0, "range not element-aligned");
    dispatch!(dtype, reduce_typed, op, dst, src)
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

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn every_dtype_and_op() {
        for d in DType::ALL {
            for op in ReduceOp::ALL {
                if !op.supports(d) {
                    continue;
                }
                // values 2 and 3 are exact in every type
                let two: Vec<u8> = match d {
                    DType::F16 => bytes(&[f16::from_f32(2.0); 3]),
                    DType::BF16 => bytes(&[bf16::from_f32(2.0); 3]),
                    DType::F32 => bytes(&[2.0f32; 3]),
                    DType::F64 => bytes(&[2.0f64; 3]),
                    _ => {
                        let mut v = vec![0u8; 3 * d.size()];
                        for c in v.chunks_exact_mut(d.size()) {
                            c[0] = 2;
                        }
                        v
                    }
                };
                let mut three = two.clone();
                reduce_into(d, ReduceOp::Sum, &mut three, &two[..]);
                // three now holds 4; reduce 2 into it
                let mut acc = three.clone();
                reduce_into(d, op, &mut acc, &two);
                let expect_val = match op {
                    ReduceOp::Sum | ReduceOp::Avg => 6.0,
                    ReduceOp::Prod => 8.0,
                    ReduceOp::Min => 2.0,
                    ReduceOp::Max => 4.0,
                };
                let got: f64 = match d {
                    DType::F16 => f16::from_le_bytes([acc[0], acc[1]]).to_f64(),
                    DType::BF16 => bf16::from_le_bytes([acc[0], acc[1]]).to_f64(),
                    DType::F32 => f64::from(f32::from_le_bytes(acc[0..4].try_into().unwrap())),
                    DType::F64 => f64::from_le_bytes(acc[0..8].try_into().unwrap()),
                    _ => f64::from(acc[0]),
                };
                assert_eq!(got, expect_val, "{d} {op}");
            }
        }
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
        let mut a = vec![250u8];
        reduce_into(DType::U8, ReduceOp::Sum, &mut a, &[10]);
        assert_eq!(a, [4]);
        let mut b = bytes(&[i32::MIN]);
        reduce_into(DType::I32, ReduceOp::Min, &mut b, &bytes(&[5i32]));
        assert_eq!(b, bytes(&[i32::MIN]));
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
