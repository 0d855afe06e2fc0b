//! `kungfu-bench`: the collective benchmark, in the manner of nccl-tests.
//! Run it under kungfu-run (or any launcher the runtime understands):
//!
//! ```text
//! kungfu-run -np 4 kungfu-bench allreduce -b 1K -e 64M -f 2 -n 20 -w 5 -c 1
//! ```
//!
//! Rank 0 prints one row per size: `size count type redop root`, then
//! `time algbw busbw #wrong` out of place and in place. `time` is the
//! slowest rank's mean time per op. `algbw` = size / time; `busbw` scales
//! it by the nccl-tests factor of the op (2(n-1)/n for allreduce, (n-1)/n
//! for allgather, reduce-scatter and alltoall, 1 for broadcast and reduce),
//! where `size` is the per-rank buffer for allreduce, broadcast and reduce
//! and the whole (n-block) buffer for the others.
//!
//! Out of place, an op reads one buffer and its result is another. In
//! place (`--in-place 1`, the default), as in nccl-tests, one buffer is
//! both: allreduce and broadcast use the session's in-place calls;
//! allgather reads this rank's block of its output buffer; reduce-scatter
//! leaves its result in this rank's block of its input buffer; reduce and
//! alltoall read and write the whole buffer. The timed in-place ops each
//! work on the result of the one before.
//!
//! `-c 1` (the default) fills the buffers anew after the timed ops, runs
//! one more op of each column and checks every element of its output
//! exactly, in that column's own buffer; `#wrong` is the count of wrong
//! elements over all ranks, and any makes the exit status non-zero.
//!
//! The footer's `Heap per op (rank 0)` line is what one timed
//! out-of-place op allocated on the heap of rank 0's process (every
//! thread: the caller, the library and the runtime), as allocations and
//! bytes per op, at the largest size and, in parentheses, at the smallest.
//! A buffer allocated per op would show as a byte count near the op's
//! size.

use std::fmt::Write as _;
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kungfu::{Worker, WorkerEnv};
use kungfu_adaptation::{Action, Adapter, GradientMonitor};
use kungfu_collectives::{reference, DType, Element, OpKind, OpSpec, ReduceOp, Session};
use kungfu_tools::plot::{svg, Series};
use kungfu_tools::{fmt_size, parse_size};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::any::AnyTransport;

/// Counts heap allocations, so the bench can report what an op allocates
/// in the steady state (the JSON rows and the footer carry it).
mod heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    pub struct Counting;
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static BYTES: AtomicU64 = AtomicU64::new(0);

    #[allow(unsafe_code)]
    // SAFETY: every method forwards to the system allocator with the
    // caller's arguments unchanged; the counters have no effect on memory.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            CALLS.fetch_add(1, Relaxed);
            BYTES.fetch_add(layout.size() as u64, Relaxed);
            // SAFETY: the caller upholds `alloc`'s contract, passed on as is.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            CALLS.fetch_add(1, Relaxed);
            BYTES.fetch_add(layout.size() as u64, Relaxed);
            // SAFETY: as for `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            CALLS.fetch_add(1, Relaxed);
            BYTES.fetch_add(new_size as u64, Relaxed);
            // SAFETY: as for `alloc`; `ptr` came from this allocator.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: `ptr` came from this allocator with `layout`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    /// (allocations, bytes allocated) so far, by every thread.
    pub fn snapshot() -> (u64, u64) {
        (CALLS.load(Relaxed), BYTES.load(Relaxed))
    }
}

#[global_allocator]
static HEAP: heap::Counting = heap::Counting;

const USAGE: &str = "\
usage: kungfu-bench OP [options]     (run under kungfu-run)

OP: allreduce | broadcast | allgather | reduce-scatter | reduce | alltoall
    | swap (the latency of a strategy swap: agreement and switch; -n, -w)
    | resize --sizes N,N,... (elastic, under kungfu-run -w: a training loop
      of -n steps between resizes over a model of -b bytes; checks the
      model after every change, prints each resize's latency)

  -b SIZE        smallest size in bytes (default 1K; K, M, G suffixes)
  -e SIZE        largest size (default 64M)
  -f FACTOR      size multiplier between rows (default 2)
  -n ITERS       timed iterations per size (default 20)
  -w WARMUP      untimed iterations per size (default 5)
  -c 0|1         check every result exactly (default 1)
  -d TYPE        float, half, bfloat16, double, int8, uint8, int32, ... (float)
  -o OP          sum, prod, min, max, avg (default sum)
  -r ROOT        root of broadcast and reduce (default 0)
  --in-place 0|1 also measure in place (default 1): one buffer is the op's
                 input and its output, as in nccl-tests
  --monitor K    allreduce of floats: also time each size with the gradient
                 monitors on every K-th op (the local norm rides in a spare
                 element of the gradient allreduce; the summed gradient's
                 norm after it; noise scale and variance) and print their
                 overhead (default 0: off)
  --strategy S   override KUNGFU_STRATEGY
  --json FILE    write the results as JSON (rank 0)
  --plot FILE    draw busbw against size as SVG (rank 0)

Output (rank 0): per size, time algbw busbw #wrong out of place and in
place; #wrong counts the wrong elements of a checked op, in the column's
own buffer, over all ranks (non-zero fails the run). The footer's \"Heap
per op (rank 0)\" line gives the heap allocations and bytes of one timed
out-of-place op on rank 0 (every thread), at the largest size and, in
parentheses, at the smallest.
";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Allreduce,
    Broadcast,
    Allgather,
    ReduceScatter,
    Reduce,
    Alltoall,
}

impl Op {
    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "allreduce" | "all_reduce" => Op::Allreduce,
            "broadcast" => Op::Broadcast,
            "allgather" | "all_gather" => Op::Allgather,
            "reduce-scatter" | "reduce_scatter" | "reducescatter" => Op::ReduceScatter,
            "reduce" => Op::Reduce,
            "alltoall" | "all_to_all" => Op::Alltoall,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Op::Allreduce => "allreduce",
            Op::Broadcast => "broadcast",
            Op::Allgather => "allgather",
            Op::ReduceScatter => "reduce-scatter",
            Op::Reduce => "reduce",
            Op::Alltoall => "alltoall",
        }
    }

    /// Whether `size` counts all n blocks (nccl-tests' convention).
    fn blockwise(self) -> bool {
        matches!(self, Op::Allgather | Op::ReduceScatter | Op::Alltoall)
    }

    fn busbw_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::Allreduce => 2.0 * (n - 1.0) / n,
            Op::Allgather | Op::ReduceScatter | Op::Alltoall => (n - 1.0) / n,
            Op::Broadcast | Op::Reduce => 1.0,
        }
    }

    fn rooted(self) -> bool {
        matches!(self, Op::Broadcast | Op::Reduce)
    }

    fn reduces(self) -> bool {
        matches!(self, Op::Allreduce | Op::ReduceScatter | Op::Reduce)
    }
}

struct Args {
    op: Op,
    /// `swap`: measure strategy swaps instead of an op.
    swap: bool,
    /// `resize`: the sizes to resize to, in order.
    resize: Option<Vec<usize>>,
    min: usize,
    max: usize,
    factor: usize,
    iters: usize,
    warmup: usize,
    check: bool,
    dtype: DType,
    redop: ReduceOp,
    root: usize,
    in_place: bool,
    /// Test only (`KUNGFU_BENCH_CORRUPT_IN_PLACE` set): flip a byte of the
    /// in-place result before it is checked, so a test can see that the
    /// in-place column checks its own buffer.
    corrupt_in_place: bool,
    /// Run the monitors every this many ops (0: off).
    monitor: usize,
    strategy: Option<Strategy>,
    json: Option<String>,
    plot: Option<String>,
}

fn parse_args(a: &[String]) -> anyhow::Result<Option<Args>> {
    if a.is_empty() || a.iter().any(|x| x == "-h" || x == "--help") {
        return Ok(None);
    }
    let swap = a[0] == "swap";
    let resize = a[0] == "resize";
    let op = if swap || resize {
        Op::Allreduce
    } else {
        Op::parse(&a[0]).with_context(|| format!("unknown op {:?}", a[0]))?
    };
    let mut r = Args {
        op,
        swap,
        resize: resize.then(Vec::new),
        min: 1024,
        max: 64 << 20,
        factor: 2,
        iters: 20,
        warmup: 5,
        check: true,
        dtype: DType::F32,
        redop: ReduceOp::Sum,
        root: 0,
        in_place: true,
        corrupt_in_place: std::env::var_os("KUNGFU_BENCH_CORRUPT_IN_PLACE").is_some(),
        monitor: 0,
        strategy: None,
        json: None,
        plot: None,
    };
    let mut i = 1;
    while i < a.len() {
        let flag = a[i].as_str();
        let v = a
            .get(i + 1)
            .with_context(|| format!("{flag} needs a value"))?;
        match flag {
            "-b" => r.min = parse_size(v)?,
            "-e" => r.max = parse_size(v)?,
            "-f" => r.factor = v.parse().context("-f needs a number")?,
            "-n" => r.iters = v.parse().context("-n needs a number")?,
            "-w" => r.warmup = v.parse().context("-w needs a number")?,
            "-c" => r.check = v != "0",
            "-d" => r.dtype = DType::parse(v).with_context(|| format!("unknown type {v:?}"))?,
            "-o" => {
                r.redop = ReduceOp::parse(v).with_context(|| format!("unknown reduction {v:?}"))?
            }
            "-r" => r.root = v.parse().context("-r needs a rank")?,
            "--in-place" => r.in_place = v != "0",
            "--monitor" => r.monitor = v.parse().context("--monitor needs a number")?,
            "--strategy" => r.strategy = Some(v.parse()?),
            "--json" => r.json = Some(v.clone()),
            "--plot" => r.plot = Some(v.clone()),
            "--sizes" if resize => {
                r.resize = Some(
                    v.split(',')
                        .map(|n| n.trim().parse::<usize>().ok().filter(|&n| n > 0))
                        .collect::<Option<Vec<usize>>>()
                        .with_context(|| format!("--sizes {v:?}: expected positive numbers"))?,
                )
            }
            _ => bail!("unknown option {flag:?}"),
        }
        i += 2;
    }
    if r.factor < 2 {
        bail!("-f must be at least 2");
    }
    if r.monitor > 0 && !(r.op == Op::Allreduce && r.dtype == DType::F32) {
        bail!("--monitor measures allreduces of float (f32) gradients");
    }
    if r.iters == 0 {
        bail!("-n must be at least 1");
    }
    if r.min > r.max {
        bail!("-b {} is larger than -e {}", r.min, r.max);
    }
    if r.op.reduces() && !r.redop.supports(r.dtype) {
        bail!("{} is not defined for {}", r.redop, r.dtype);
    }
    Ok(Some(r))
}

fn nccl_type(d: DType) -> &'static str {
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

fn sizes(min: usize, max: usize, factor: usize, esize: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    if s == 0 {
        v.push(0);
        s = esize;
    }
    while s <= max {
        v.push(s);
        s = match s.checked_mul(factor) {
            Some(x) => x,
            None => break,
        };
    }
    v
}

/// How many elements of `got` differ from `want` (bit for bit).
fn count_wrong(esize: usize, got: Option<&[u8]>, want: &Option<Vec<u8>>) -> u64 {
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
struct Cell {
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
    /// Heap allocations and bytes per timed op on this rank (all threads).
    allocs: f64,
    alloc_bytes: f64,
}

struct Row {
    size: usize,
    count: usize,
    oop: Cell,
    ip: Cell,
    /// With --monitor: (time per op without, with the monitors, B_simple).
    monitor: Option<MonitorCost>,
}

/// Runs `iters` ops of `spec` out of place (the input is left as it is,
/// the result is a new buffer); returns the mean time per op on this rank
/// and the heap allocations and bytes per op.
async fn time_out_of_place(
    s: &Session<AnyTransport>,
    name: &str,
    spec: OpSpec,
    input: &[u8],
    iters: usize,
) -> anyhow::Result<(f64, (f64, f64))> {
    let h0 = heap::snapshot();
    let t0 = Instant::now();
    for _ in 0..iters {
        s.submit(name, spec, input).await?;
    }
    let dt = t0.elapsed().as_secs_f64() / iters.max(1) as f64;
    Ok((dt, heap_per_op(h0, iters)))
}

/// Heap allocations and bytes per op since `h0`, over `iters` ops.
fn heap_per_op(h0: (u64, u64), iters: usize) -> (f64, f64) {
    let h1 = heap::snapshot();
    let per = |a: u64, b: u64| (b - a) as f64 / iters.max(1) as f64;
    (per(h0.0, h1.0), per(h0.1, h1.1))
}

/// Where an op reads and writes in its one in-place buffer, in elements,
/// laid out as nccl-tests lays it out: allgather (and gather) read this
/// rank's block of the output buffer, reduce-scatter writes this rank's
/// block of the input buffer, the others read and write the whole buffer.
/// Ranks without an output (reduce and gather off the root) write nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
struct InPlace {
    len: usize,
    input: Range<usize>,
    output: Option<Range<usize>>,
}

fn in_place_layout(spec: &OpSpec, n: usize, me: usize) -> InPlace {
    let c = spec.count;
    let (all, mine) = (0..n * c, me * c..(me + 1) * c);
    let (len, input, output) = match spec.kind {
        OpKind::Allreduce(_) | OpKind::Broadcast { .. } => (c, 0..c, Some(0..c)),
        OpKind::Reduce { root, .. } => (c, 0..c, (root.idx() == me).then_some(0..c)),
        OpKind::Allgather => (n * c, mine, Some(all)),
        OpKind::Gather { root } => (n * c, mine, (root.idx() == me).then_some(all)),
        OpKind::ReduceScatter(_) => (n * c, all, Some(mine)),
        OpKind::Alltoall => (n * c, all.clone(), Some(all)),
    };
    InPlace { len, input, output }
}

/// Runs one op in place on `buf`. Allreduce and broadcast use the
/// session's in-place calls; the other ops have none, so the op is given
/// its input slice of `buf` and its output is written back into `buf`.
async fn op_in_place<E: Element>(
    s: &Session<AnyTransport>,
    name: &str,
    spec: OpSpec,
    lay: &InPlace,
    buf: &mut [E],
) -> anyhow::Result<()> {
    match spec.kind {
        OpKind::Allreduce(op) => s.allreduce_in_place(name, buf, op).await?,
        OpKind::Broadcast { root } => s.broadcast_in_place(name, buf, root).await?,
        _ => {
            let out = s
                .submit(name, spec, bytemuck::cast_slice(&buf[lay.input.clone()]))
                .await?;
            match (lay.output.clone(), out.bytes()) {
                (Some(r), Some(o)) if o.len() == std::mem::size_of_val(&buf[r.clone()]) => {
                    bytemuck::cast_slice_mut::<E, u8>(&mut buf[r]).copy_from_slice(o)
                }
                (None, None) => {}
                (r, o) => bail!(
                    "{name}: an output of {:?} bytes for an in-place output of {:?} elements",
                    o.map(<[u8]>::len),
                    r.map(|r| r.len())
                ),
            }
        }
    }
    Ok(())
}

/// The in-place column: one buffer per rank (see [`InPlace`]), the timed
/// ops each working on the result of the one before, as in nccl-tests;
/// then, with `-c 1`, the buffer is filled anew, one op runs on it, and
/// its output part is checked. Returns (seconds per op, wrong values,
/// heap per op) for this rank.
async fn measure_in_place<E: Element>(
    s: &Session<AnyTransport>,
    args: &Args,
    spec: OpSpec,
    inputs: &[Vec<u8>],
    name: &str,
) -> anyhow::Result<(f64, u64, (f64, f64))> {
    let (n, me) = (s.size(), s.rank().idx());
    let lay = in_place_layout(&spec, n, me);
    let mut buf: Vec<E> = Vec::new();
    let fill = |buf: &mut Vec<E>| {
        buf.clear();
        buf.resize(lay.len, bytemuck::Zeroable::zeroed());
        bytemuck::cast_slice_mut::<E, u8>(&mut buf[lay.input.clone()]).copy_from_slice(&inputs[me]);
    };
    fill(&mut buf);
    for _ in 0..args.warmup {
        op_in_place(s, name, spec, &lay, &mut buf).await?;
    }
    fill(&mut buf);
    let h0 = heap::snapshot();
    let t0 = Instant::now();
    for _ in 0..args.iters {
        op_in_place(s, name, spec, &lay, &mut buf).await?;
    }
    let dt = t0.elapsed().as_secs_f64() / args.iters.max(1) as f64;
    let heap = heap_per_op(h0, args.iters);
    let mut wrong = 0;
    if args.check {
        fill(&mut buf);
        op_in_place(s, name, spec, &lay, &mut buf).await?;
        let out = lay.output.clone().map(|r| &mut buf[r]);
        if args.corrupt_in_place {
            if let Some(x) = out.and_then(|o| o.first_mut()) {
                bytemuck::bytes_of_mut(x)[0] ^= 0x5a;
            }
        }
        let got = lay
            .output
            .clone()
            .map(|r| bytemuck::cast_slice::<E, u8>(&buf[r]));
        wrong = count_wrong(
            spec.dtype.size(),
            got,
            &reference::expected(&spec, me, inputs),
        );
    }
    Ok((dt, wrong, heap))
}

/// Calls the generic `$f::<E>(args)` for the element type of `$dtype`.
macro_rules! for_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::U8 => $f::<u8>($($arg),*).await,
            DType::I8 => $f::<i8>($($arg),*).await,
            DType::U16 => $f::<u16>($($arg),*).await,
            DType::I16 => $f::<i16>($($arg),*).await,
            DType::U32 => $f::<u32>($($arg),*).await,
            DType::I32 => $f::<i32>($($arg),*).await,
            DType::U64 => $f::<u64>($($arg),*).await,
            DType::I64 => $f::<i64>($($arg),*).await,
            DType::F16 => $f::<half::f16>($($arg),*).await,
            DType::BF16 => $f::<half::bf16>($($arg),*).await,
            DType::F32 => $f::<f32>($($arg),*).await,
            DType::F64 => $f::<f64>($($arg),*).await,
        }
    };
}

/// Times `iters` ops plain, then `iters` with the monitors a trainer runs
/// beside its gradient allreduce every `every`-th op: the squared norm of
/// its own gradient, a 1-element allreduce of it overlapped with the
/// gradient's, the squared norm of the result, and the noise-scale update.
/// Returns (plain, monitored) seconds per op on the slowest rank, and the
/// last B_simple.
async fn monitor_overhead(
    s: &Session<AnyTransport>,
    spec: OpSpec,
    input: &[u8],
    iters: usize,
    every: usize,
) -> anyhow::Result<MonitorCost> {
    let name = "bench/monitored";
    let _ = spec;
    // the trainer's buffer: the gradient and the monitors' spare element
    let mut grad: Vec<f32> = input
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    grad.push(0.0);
    let fresh = grad.clone();
    // the same loop twice: monitors off (every 0), then on every K-th op;
    // each op starts from the same input (the allreduce is in place)
    // Alternate rounds without and with the monitors (the machine's noise
    // hits both alike) and compare medians; a round is a whole number of
    // monitoring periods.
    let per_round = iters.div_ceil(ROUNDS).div_ceil(every) * every;
    let (mut plain, mut monitored) = (Vec::new(), Vec::new());
    let mut mon = GradientMonitor::new(0.1, every as u64);
    let mut off = GradientMonitor::new(0.1, 0);
    for _ in 0..ROUNDS {
        plain.push(monitored_loop(s, name, &mut grad, &fresh, per_round, &mut off).await?);
        monitored.push(monitored_loop(s, name, &mut grad, &fresh, per_round, &mut mon).await?);
    }
    // the slowest rank's time of each round
    let times = s
        .allreduce(
            "bench/monitor-times",
            &[plain.as_slice(), monitored.as_slice()].concat(),
            ReduceOp::Max,
        )
        .await?;
    let (plain, monitored) = times.split_at(ROUNDS);
    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v
    };
    // overhead of each round against the plain round before it
    let ratios = sorted(
        &plain
            .iter()
            .zip(monitored)
            .map(|(p, m)| m / p - 1.0)
            .collect::<Vec<_>>(),
    );
    let q = |f: f64| ratios[((ratios.len() - 1) as f64 * f).round() as usize];
    let b_simple = mon.noise_estimate.and_then(|e| e.b_simple);
    Ok(MonitorCost {
        plain: sorted(plain)[ROUNDS / 2],
        monitored: sorted(monitored)[ROUNDS / 2],
        overhead: (q(0.25), q(0.5), q(0.75)),
        b_simple,
    })
}

/// Rounds of ops without and with the monitors, each round timed on the
/// slowest rank.
const ROUNDS: usize = 15;

/// What the monitors cost at one size.
struct MonitorCost {
    /// Median seconds per op without and with them.
    plain: f64,
    monitored: f64,
    /// Quartiles of the per-round overhead (fractions).
    overhead: (f64, f64, f64),
    b_simple: Option<f64>,
}

/// `iters` allreduces of `grad` (reset to `fresh` before each, as the
/// op is in place) through `mon`; seconds per op.
async fn monitored_loop(
    s: &Session<AnyTransport>,
    name: &str,
    grad: &mut [f32],
    fresh: &[f32],
    iters: usize,
    mon: &mut GradientMonitor,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    for _ in 0..iters {
        grad.copy_from_slice(fresh);
        mon.allreduce_sum(s, name, grad, 1.0).await?;
    }
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// The model's value at `step`: every step adds the average of the ranks'
/// gradients, which is `1 + j % 7` whatever the cluster size.
fn model_at(step: u64, j: usize) -> f32 {
    step as f32 * (1 + j % 7) as f32
}

/// `kungfu-bench resize`: a data-parallel loop whose cluster goes through
/// `sizes`, `steps` steps apart. Every step allreduces a gradient and
/// checks the model; after each resize the model and step are synced
/// from a worker that has them (new workers learn both) and checked, and
/// the resize latency (last session ready minus last join begun: the
/// process start of new workers is excluded) is printed by rank 0.
async fn resize_bench(sizes: &[usize], steps: usize, bytes: usize) -> anyhow::Result<bool> {
    let mut w = Worker::start(WorkerEnv::from_env()?).await?;
    let len = (bytes / 4).max(1);
    let mut model = vec![0f32; len];
    let mut grad = vec![0f32; len];
    let joined_late = w.is_fresh();
    let mut step = w.sync_state(0, &mut [("model", &mut model)]).await?;
    let mut ok = check_model(&w, step, &model, "start");
    let mut latencies = Vec::new();
    // the step at which this worker last went through a resize
    let mut resized_at = None;
    if joined_late {
        latencies.push(report_resize(&w, None).await?);
        resized_at = Some(step);
    }
    loop {
        if step > 0 && step % steps as u64 == 0 && resized_at != Some(step) {
            resized_at = Some(step);
            let k = (step / steps as u64 - 1) as usize;
            let Some(&n) = sizes.get(k) else { break };
            let before = w.size();
            let r = w.resize(n).await?;
            if r.detached {
                println!("# detached at step {step} (the cluster shrank to {n})");
                return Ok(ok);
            }
            if r.changed {
                step = w.sync_state(step, &mut [("model", &mut model)]).await?;
                ok &= check_model(&w, step, &model, "resize");
                latencies.push(report_resize(&w, Some(before)).await?);
            }
        }
        let (n, me) = (w.size() as f32, w.rank() as f32);
        for (j, g) in grad.iter_mut().enumerate() {
            *g = (1 + j % 7) as f32 + me - (n - 1.0) / 2.0;
        }
        let s = w.session();
        s.allreduce_in_place("grad", &mut grad, ReduceOp::Sum)
            .await?;
        for (m, g) in model.iter_mut().zip(&grad) {
            *m += g / n;
        }
        step += 1;
        ok &= check_model(&w, step, &model, "step");
    }
    let s = w.session();
    let wrong = s
        .allreduce("bench/resize-ok", &[u32::from(!ok)], ReduceOp::Max)
        .await?[0];
    if w.rank() == 0 {
        let ms: Vec<f64> = latencies.iter().flatten().map(|l| l * 1e3).collect();
        println!(
            "# kungfu-bench resize: {} steps, sizes {sizes:?}, model {} bytes, final size {}, version {}, model checked {}",
            step,
            len * 4,
            w.size(),
            w.version(),
            if wrong == 0 { "on every worker" } else { "WRONG on some worker" }
        );
        if !ms.is_empty() {
            let mean = ms.iter().sum::<f64>() / ms.len() as f64;
            let max = ms.iter().copied().fold(0.0, f64::max);
            println!("# resize latency (process start excluded): mean {mean:.1} ms, max {max:.1} ms over {} resizes", ms.len());
        }
    }
    w.close(Duration::from_secs(10)).await;
    Ok(ok && wrong == 0)
}

fn check_model(w: &Worker, step: u64, model: &[f32], at: &str) -> bool {
    let bad = model
        .iter()
        .enumerate()
        .find(|(j, m)| **m != model_at(step, *j));
    if let Some((j, m)) = bad {
        eprintln!(
            "rank {}: model[{j}] = {m} at step {step} ({at}), expected {}",
            w.rank(),
            model_at(step, j)
        );
    }
    bad.is_none()
}

/// After a change: every worker's join times; rank 0 prints the latency.
/// Returns it on rank 0 (`None` elsewhere).
async fn report_resize(w: &Worker, before: Option<usize>) -> anyhow::Result<Option<f64>> {
    let secs = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let (began, ready) = w.joined();
    let t = w
        .session()
        .allreduce(
            "bench/resize-times",
            &[secs(began), secs(ready)],
            ReduceOp::Max,
        )
        .await?;
    if w.rank() != 0 {
        return Ok(None);
    }
    let latency = t[1] - t[0];
    let from = before.map_or("?".to_string(), |b| b.to_string());
    println!(
        "# resize {from} -> {} (version {}): latency {:.1} ms",
        w.size(),
        w.version(),
        latency * 1e3
    );
    Ok(Some(latency))
}

/// `kungfu-bench swap`: rank 0 proposes a strategy (alternately RING and
/// STAR) at every agreement point; the time of an agreement point that
/// swaps (agreement, then the consistency barrier: drain, consensus on the
/// new strategy's digest, epoch advance), on the slowest rank, is the swap
/// latency.
async fn swap_bench(iters: usize, warmup: usize) -> anyhow::Result<bool> {
    let w = Worker::start(WorkerEnv::from_env()?).await?;
    let s = w.session();
    let me = s.rank().idx();
    let mut ad = Adapter::new(s.clone(), Vec::new());
    let mut times = Vec::with_capacity(iters);
    let mut switched = 0usize;
    for i in 0..warmup + iters {
        let want = if i % 2 == 0 {
            Strategy::Ring
        } else {
            Strategy::Star
        };
        if me == 0 {
            ad.propose(Action::SetStrategy(want));
        }
        let t = Instant::now();
        ad.agree().await?;
        let dt = t.elapsed().as_secs_f64();
        // the next op runs on the new strategy (a wrong switch would fail
        // it with a mismatch on some rank)
        s.barrier("bench/swap").await?;
        switched += usize::from(s.strategy() == want);
        if i >= warmup {
            times.push(dt);
        }
    }
    let slowest = s
        .allreduce("bench/swap-times", &times, ReduceOp::Max)
        .await?;
    let mut sorted = slowest.clone();
    sorted.sort_by(f64::total_cmp);
    if me == 0 {
        let mean = sorted.iter().sum::<f64>() / sorted.len().max(1) as f64;
        println!(
            "# kungfu-bench swap: {} ranks, {} swaps (after {} untimed), transport {}",
            s.size(),
            iters,
            warmup,
            w.env().transport
        );
        println!(
            "# swap latency (agreement, drain, consensus on the digest, epoch advance; slowest rank): mean {:.1} us, median {:.1} us, max {:.1} us",
            mean * 1e6,
            sorted.get(sorted.len() / 2).copied().unwrap_or(0.0) * 1e6,
            sorted.last().copied().unwrap_or(0.0) * 1e6
        );
    }
    s.barrier("bench/end").await?;
    w.close(Duration::from_secs(10)).await;
    Ok(switched == warmup + iters)
}

async fn measure(
    s: &Session<AnyTransport>,
    args: &Args,
    spec: OpSpec,
    in_place: bool,
) -> anyhow::Result<(f64, u64, (f64, f64))> {
    let n = s.size();
    let me = s.rank().idx();
    // Every rank's input is needed only to compute the expected result.
    let inputs = if args.check {
        reference::inputs(&spec, n)
    } else {
        let per = spec.input_len(n).context("size overflows")? / spec.dtype.size();
        let mut v = vec![Vec::new(); n];
        v[me] = reference::input(spec.dtype, spec.kind.reduce_op(), me, per);
        v
    };
    let name = format!(
        "bench/{}/{}",
        args.op.name(),
        if in_place { "ip" } else { "oop" }
    );
    let (dt, wrong, heap) = if in_place {
        for_dtype!(spec.dtype, measure_in_place(s, args, spec, &inputs, &name))?
    } else {
        let inp = &inputs[me];
        if args.warmup > 0 {
            time_out_of_place(s, &name, spec, inp, args.warmup).await?;
        }
        let (dt, heap) = time_out_of_place(s, &name, spec, inp, args.iters).await?;
        let mut wrong = 0;
        if args.check {
            // one more op, checked element by element
            let out = s.submit(&name, spec, inp).await?;
            let want = reference::expected(&spec, me, &inputs);
            wrong = count_wrong(spec.dtype.size(), out.bytes(), &want);
        }
        (dt, wrong, heap)
    };
    // the slowest rank's time, and the wrong values of all ranks
    let t = s.allreduce("bench/time", &[dt], ReduceOp::Max).await?[0];
    let w = s.allreduce("bench/wrong", &[wrong], ReduceOp::Sum).await?[0];
    Ok((t, w, heap))
}

fn cell(op: Op, n: usize, size: usize, (t, wrong, heap): (f64, u64, (f64, f64))) -> Cell {
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

async fn bench(args: Args) -> anyhow::Result<bool> {
    if args.swap {
        return swap_bench(args.iters.max(1), args.warmup).await;
    }
    if let Some(sizes) = &args.resize {
        return resize_bench(sizes, args.iters.max(1), args.min).await;
    }
    let mut env = WorkerEnv::from_env()?;
    if let Some(st) = args.strategy {
        env.strategy = st;
    }
    let strategy = env.strategy;
    let w = Worker::start(env).await?;
    let s = w.session();
    let (n, me) = (s.size(), s.rank().idx());
    if args.op.rooted() && args.root >= n {
        bail!("root {} outside a cluster of {n}", args.root);
    }
    let es = args.dtype.size();
    let kind = match args.op {
        Op::Allreduce => OpKind::Allreduce(args.redop),
        Op::Broadcast => OpKind::Broadcast {
            root: Rank(args.root as u32),
        },
        Op::Allgather => OpKind::Allgather,
        Op::ReduceScatter => OpKind::ReduceScatter(args.redop),
        Op::Reduce => OpKind::Reduce {
            op: args.redop,
            root: Rank(args.root as u32),
        },
        Op::Alltoall => OpKind::Alltoall,
    };
    if me == 0 {
        println!(
            "# kungfu-bench {}: {n} ranks, strategy {strategy}, transport {}, iters {}, warmup {}, check {}",
            args.op.name(),
            w.env().transport,
            args.iters,
            args.warmup,
            u8::from(args.check)
        );
        println!("#");
        println!("# {:>58}{:>34}", "out-of-place", "in-place");
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>6} {:>9} {:>7} {:>7} {:>6} {:>9} {:>7} {:>7} {:>6}",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "time",
            "algbw",
            "busbw",
            "#wrong"
        );
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>6} {:>9} {:>7} {:>7} {:>6} {:>9} {:>7} {:>7} {:>6}",
            "(B)",
            "(elements)",
            "",
            "",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            ""
        );
    }
    let all = sizes(args.min, args.max, args.factor, es);
    let started = Instant::now();
    let mut rows = Vec::new();
    for (k, &size) in all.iter().enumerate() {
        let total = size / es;
        let count = if args.op.blockwise() {
            total / n
        } else {
            total
        };
        let shown = if args.op.blockwise() {
            count * n
        } else {
            count
        };
        if size > 0 && shown == 0 {
            continue; // too small to give every rank an element
        }
        let spec = OpSpec {
            kind,
            dtype: args.dtype,
            count,
        };
        let bytes = shown * es;
        let oop = measure(s, &args, spec, false).await?;
        let ip = if args.in_place {
            measure(s, &args, spec, true).await?
        } else {
            (0.0, 0, (0.0, 0.0))
        };
        let monitor = if args.monitor > 0 {
            let inp = reference::input(spec.dtype, spec.kind.reduce_op(), me, count);
            Some(monitor_overhead(s, spec, &inp, args.iters.max(1), args.monitor).await?)
        } else {
            None
        };
        let row = Row {
            size: bytes,
            count: shown,
            oop: cell(args.op, n, bytes, oop),
            ip: cell(args.op, n, bytes, ip),
            monitor,
        };
        if me == 0 {
            let redop = if args.op.reduces() {
                args.redop.name()
            } else {
                "none"
            };
            let root = if args.op.rooted() {
                args.root as i64
            } else {
                -1
            };
            println!(
                "  {:>10} {:>12} {:>8} {:>6} {:>6} {:>9.2} {:>7.2} {:>7.2} {:>6} {:>9.2} {:>7.2} {:>7.2} {:>6}",
                row.size, row.count, nccl_type(args.dtype), redop, root,
                row.oop.time_us, row.oop.algbw, row.oop.busbw, row.oop.wrong,
                row.ip.time_us, row.ip.algbw, row.ip.busbw, row.ip.wrong
            );
            if started.elapsed() > Duration::from_secs(2) && k + 1 < all.len() {
                eprintln!(
                    "kungfu-bench: {} done ({}/{} sizes, {:.0?})",
                    fmt_size(bytes),
                    k + 1,
                    all.len(),
                    started.elapsed()
                );
            }
        }
        rows.push(row);
    }
    let wrong: u64 = rows.iter().map(|r| r.oop.wrong + r.ip.wrong).sum();
    if me == 0 {
        let bw: Vec<f64> = rows.iter().map(|r| r.oop.busbw).collect();
        let avg = if bw.is_empty() {
            0.0
        } else {
            bw.iter().sum::<f64>() / bw.len() as f64
        };
        println!(
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {avg:.4}");
        for r in rows.iter() {
            if let Some(m) = &r.monitor {
                println!(
                    "# Monitors at {:>9}  : {:.2} us -> {:.2} us per op ({:+.1}%; quartiles of {ROUNDS} rounds {:+.1}% {:+.1}%), noise scale {}",
                    fmt_size(r.size),
                    m.plain * 1e6,
                    m.monitored * 1e6,
                    m.overhead.1 * 100.0,
                    m.overhead.0 * 100.0,
                    m.overhead.2 * 100.0,
                    m.b_simple.map_or("-".to_string(), |b| format!("{b:.3}"))
                );
            }
        }
        if let Some(big) = rows.last() {
            println!(
                "# Heap per op (rank 0) : {:.1} allocations, {} at {} ({:.1} allocations, {} at {})",
                big.oop.allocs,
                fmt_size(big.oop.alloc_bytes as usize),
                fmt_size(big.size),
                rows[0].oop.allocs,
                fmt_size(rows[0].oop.alloc_bytes as usize),
                fmt_size(rows[0].size),
            );
        }
        println!("#");
        if let Some(path) = &args.json {
            std::fs::write(path, json(&args, n, strategy, &rows, avg, wrong))
                .with_context(|| format!("writing {path}"))?;
        }
        if let Some(path) = &args.plot {
            let mut series = vec![Series {
                label: "out-of-place".into(),
                points: rows.iter().map(|r| (r.size, r.oop.busbw)).collect(),
            }];
            if args.in_place {
                series.push(Series {
                    label: "in-place".into(),
                    points: rows.iter().map(|r| (r.size, r.ip.busbw)).collect(),
                });
            }
            let title = format!(
                "kungfu-bench {} ({} ranks, {strategy}, {})",
                args.op.name(),
                n,
                nccl_type(args.dtype)
            );
            std::fs::write(path, svg(&title, &series))
                .with_context(|| format!("writing {path}"))?;
        }
    }
    s.barrier("bench/end").await?;
    w.close(Duration::from_secs(10)).await;
    Ok(wrong == 0)
}

fn json(args: &Args, n: usize, strategy: Strategy, rows: &[Row], avg: f64, wrong: u64) -> String {
    let c = |c: &Cell| {
        format!(
            r#"{{"time_us":{:.3},"algbw_gbps":{:.6},"busbw_gbps":{:.6},"wrong":{},"allocs_per_op":{:.2},"alloc_bytes_per_op":{:.0}}}"#,
            c.time_us, c.algbw, c.busbw, c.wrong, c.allocs, c.alloc_bytes
        )
    };
    let mut o = format!(
        r#"{{"op":"{}","ranks":{n},"strategy":"{strategy}","type":"{}","redop":"{}","iters":{},"warmup":{},"rows":["#,
        args.op.name(),
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

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("kungfu-bench: {e:#}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    let threads = std::env::var("KUNGFU_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("tokio runtime");
    // Run on a runtime worker, not on this thread: with the ops' tasks and
    // the IO driver on the same worker, an op completes without a
    // cross-thread wake-up (about 20 us each on a busy 2-core machine).
    let res = rt.block_on(async {
        tokio::spawn(bench(args))
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("benchmark task failed: {e}")))
    });
    match res {
        Ok(true) => {}
        Ok(false) => {
            eprintln!("kungfu-bench: wrong values found");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("kungfu-bench: error: {e:#}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: OpKind) -> OpSpec {
        OpSpec {
            kind,
            dtype: DType::F32,
            count: 4,
        }
    }

    /// nccl-tests' in-place buffers: rank 1 of 3, 4 elements per block.
    #[test]
    fn in_place_layouts() {
        let lay = |kind| {
            let l = in_place_layout(&spec(kind), 3, 1);
            (l.len, l.input, l.output)
        };
        assert_eq!(lay(OpKind::Allreduce(ReduceOp::Sum)), (4, 0..4, Some(0..4)));
        assert_eq!(lay(OpKind::Allgather), (12, 4..8, Some(0..12)));
        assert_eq!(
            lay(OpKind::ReduceScatter(ReduceOp::Sum)),
            (12, 0..12, Some(4..8))
        );
        assert_eq!(lay(OpKind::Alltoall), (12, 0..12, Some(0..12)));
        let root = Rank(0);
        assert_eq!(
            lay(OpKind::Reduce {
                op: ReduceOp::Sum,
                root
            }),
            (4, 0..4, None)
        );
        assert_eq!(lay(OpKind::Gather { root }), (12, 4..8, None));
    }
}
