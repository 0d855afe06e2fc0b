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

mod kernels;
mod norms;

pub use norms::{reduce_sum_sq, reduce_sum_sq_with_isa, sq_norm_bytes, SumSquares};

pub use kernels::{
    kernel_isa, reduce_into, reduce_into_ordered, reduce_with_isa, runnable_isas, scale_down,
    sq_norm_f32, sq_norm_with_isa, KernelIsa,
};

#[cfg(test)]
mod tests {
    use super::kernels::{bf16_to_f32, f32_to_bf16, pick_isa, Num};
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
