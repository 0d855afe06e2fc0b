//! The rows the op table prints, their cells, and the JSON of a run.

use std::fmt::Write as _;

use kungfu_collectives::{reference, DType, OpSpec};
use kungfu_topology::{Rank, Strategy};

use super::monitor::MonitorCost;
use super::{Args, Op};

pub(super) fn nccl_type(d: DType) -> &'static str {
    match d {
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::U16 => "uint16",
        DType::I16 => "int16",
        DType::U32 => "uint32",
        DType::I32 => "int32",
        DType::U64 => "uint64",
        DType::I64 => "int64",
        DType::F16 => "half",
        DType::BF16 => "bfloat16",
        DType::F32 => "float",
        DType::F64 => "double",
    }
}

/// Bytes of expected output made at a time by [`count_wrong_of`].
const CHECK_CHUNK: usize = 1 << 20;

/// How many elements of `got`, rank `me`'s output of `spec` among `n`
/// ranks, differ from what it must be ([`reference::expected`]). The
/// expected values are made a chunk at a time from the inputs they depend
/// on ([`reference::expected_part`]), so the check holds about a chunk
/// more, not every rank's input: what a run's peak RSS shows is the
/// library's.
pub(super) fn count_wrong_of(spec: &OpSpec, me: usize, n: usize, got: Option<&[u8]>) -> u64 {
    let w = spec.dtype.size();
    // None where the rank gets no output (off the root of reduce, gather)
    let len = spec.output_range(Rank(me as u32), n).map(|r| r.len());
    match (got, len) {
        (Some(got), Some(len)) if got.len() == len => {
            let chunk = (CHECK_CHUNK / w).max(1) * w;
            (0..len)
                .step_by(chunk)
                .map(|a| {
                    let b = (a + chunk).min(len);
                    let want = reference::expected_part(spec, me, n, a..b);
                    count_wrong(w, Some(&got[a..b]), &want)
                })
                .sum()
        }
        (None, None) => 0,
        // a missing or mis-sized output: every expected value is wrong
        (_, Some(len)) => (len / w).max(1) as u64,
        (Some(got), None) => (got.len() / w).max(1) as u64,
    }
}

/// How many elements of `got` differ from `want` (bit for bit).
pub(super) fn count_wrong(esize: usize, got: Option<&[u8]>, want: &Option<Vec<u8>>) -> u64 {
    match (got, want) {
        (Some(got), Some(want)) if got.len() == want.len() => got
            .chunks_exact(esize)
            .zip(want.chunks_exact(esize))
            .filter(|(a, b)| a != b)
            .count() as u64,
        (None, None) => 0,
        // a missing or mis-sized output: every expected value is wrong
        (_, Some(want)) => (want.len() / esize).max(1) as u64,
        (Some(got), None) => (got.len() / esize).max(1) as u64,
    }
}

#[derive(Clone, Copy, Default)]
pub(super) struct Cell {
    pub(super) time_us: f64,
    pub(super) algbw: f64,
    pub(super) busbw: f64,
    pub(super) wrong: u64,
    /// Heap allocations and bytes per timed op on this rank (all threads).
    pub(super) allocs: f64,
    pub(super) alloc_bytes: f64,
}

pub(super) struct Row {
    pub(super) size: usize,
    pub(super) count: usize,
    pub(super) oop: Cell,
    pub(super) ip: Cell,
    /// With --monitor: (time per op without, with the monitors, B_simple).
    pub(super) monitor: Option<MonitorCost>,
}

pub(super) fn cell(
    op: Op,
    n: usize,
    size: usize,
    (t, wrong, heap): (f64, u64, (f64, f64)),
) -> Cell {
    let algbw = if t > 0.0 { size as f64 / t / 1e9 } else { 0.0 };
    Cell {
        time_us: t * 1e6,
        algbw,
        busbw: algbw * op.busbw_factor(n),
        wrong,
        allocs: heap.0,
        alloc_bytes: heap.1,
    }
}

pub(super) fn json(
    args: &Args,
    n: usize,
    strategy: Strategy,
    rows: &[Row],
    avg: f64,
    wrong: u64,
) -> String {
    let c = |c: &Cell| {
        format!(
            r#"{{"time_us":{:.3},"algbw_gbps":{:.6},"busbw_gbps":{:.6},"wrong":{},"allocs_per_op":{:.2},"alloc_bytes_per_op":{:.0}}}"#,
            c.time_us, c.algbw, c.busbw, c.wrong, c.allocs, c.alloc_bytes
        )
    };
    let mut o = format!(
        r#"{{"op":"{}","ranks":{n},"strategy":"{strategy}","type":"{}","redop":"{}","iters":{},"warmup":{},"rows":["#,
        args.op().name(),
        nccl_type(args.dtype),
        args.redop,
        args.iters,
        args.warmup
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = write!(
            o,
            r#"{}{{"size":{},"count":{},"out_of_place":{},"in_place":{}}}"#,
            if i > 0 { "," } else { "" },
            r.size,
            r.count,
            c(&r.oop),
            c(&r.ip)
        );
    }
    let _ = write!(o, r#"],"avg_busbw_gbps":{avg:.6},"wrong":{wrong}}}"#);
    o.push('\n');
    o
}
