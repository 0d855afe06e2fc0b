//! Reduction kernel throughput against memcpy of the same bytes.
//!
//! `cargo bench -p kungfu-benches --bench reduce_kernels`; the ratio of a
//! kernel's throughput to memcpy's is the figure to watch (a sum reads two
//! streams and writes one, memcpy reads one and writes one). The kernels
//! run with the instruction set `kernel_isa()` picks; run again with
//! `KUNGFU_KERNEL_ISA=baseline` (or `avx2`) to compare the paths.
//! `f32_sum_sq` is the sum that also adds up the squares the gradient
//! monitors need (`reduce_sum_sq`); against `f32_sum` it is their cost.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use kungfu_collectives::{kernel_isa, reduce_into, reduce_sum_sq, DType, ReduceOp};

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group(format!("reduce_kernels/{:?}", kernel_isa()));
    for &bytes in &[64 << 10, 4 << 20] {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_with_input(BenchmarkId::new("memcpy", bytes), &bytes, |b, _| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
        let f32s: Vec<u8> = (0..bytes / 4)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        g.bench_with_input(BenchmarkId::new("f32_sum", bytes), &bytes, |b, _| {
            b.iter(|| reduce_into(DType::F32, ReduceOp::Sum, &mut dst, black_box(&f32s)))
        });
        // the sum with the gradient monitors' squares in the same pass
        g.bench_with_input(BenchmarkId::new("f32_sum_sq", bytes), &bytes, |b, _| {
            b.iter(|| reduce_sum_sq(&mut dst, black_box(&f32s)))
        });
        g.bench_with_input(BenchmarkId::new("f32_max", bytes), &bytes, |b, _| {
            b.iter(|| reduce_into(DType::F32, ReduceOp::Max, &mut dst, black_box(&f32s)))
        });
        let bf16s: Vec<u8> = (0..bytes / 2)
            .flat_map(|i| bf16::from_f32((i % 256) as f32).to_le_bytes())
            .collect();
        dst.copy_from_slice(&bf16s);
        g.bench_with_input(BenchmarkId::new("bf16_sum", bytes), &bytes, |b, _| {
            b.iter(|| reduce_into(DType::BF16, ReduceOp::Sum, &mut dst, black_box(&bf16s)))
        });
        let f16s: Vec<u8> = (0..bytes / 2)
            .flat_map(|i| f16::from_f32((i % 256) as f32).to_le_bytes())
            .collect();
        dst.copy_from_slice(&f16s);
        g.bench_with_input(BenchmarkId::new("f16_sum", bytes), &bytes, |b, _| {
            b.iter(|| reduce_into(DType::F16, ReduceOp::Sum, &mut dst, black_box(&f16s)))
        });
    }
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
