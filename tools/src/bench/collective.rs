//! The op table: each size measured out of place and in place, checked,
//! printed, and written as JSON and SVG.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kungfu::{Worker, WorkerEnv};
use kungfu_collectives::{reference, DType, Element, OpKind, OpSpec, ReduceOp, Session};
use kungfu_tools::fmt_size;
use kungfu_tools::plot::{svg, Series};
use kungfu_topology::Rank;
use kungfu_transport::any::AnyTransport;
use kungfu_transport::Region;

use super::monitor::{monitor_overhead, ROUNDS};
use super::report::{cell, count_wrong_of, json, nccl_type, Row};
use super::resize::resize_bench;
use super::swap::{swap_bench, transport_swap_bench};
use super::{sizes, Args, Op, Run};
use crate::heap;

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
/// block of the input buffer, scatter reads the whole buffer at the root
/// (nothing elsewhere) and writes this rank's block, the others read and
/// write the whole buffer. Ranks without an output (reduce and gather off
/// the root) write nothing.
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
        // the root reads the whole buffer, the others nothing
        OpKind::Scatter { root } if root.idx() == me => (n * c, all, Some(mine)),
        OpKind::Scatter { .. } => (n * c, mine.start..mine.start, Some(mine)),
    };
    InPlace { len, input, output }
}

/// Runs one op in place on `buf`: in the buffer itself
/// ([`Session::submit_in`]: frames land in it, nothing is copied in or
/// out) where it is the op's working buffer, which is every op but
/// alltoall; alltoall is given its input from `buf` and its output is
/// written back.
async fn op_in_place(
    s: &Session<AnyTransport>,
    name: &str,
    spec: OpSpec,
    lay: &InPlace,
    buf: &Arc<Region>,
) -> anyhow::Result<()> {
    if spec.work_len(s.size()) == Some(buf.len()) {
        drop(s.submit_in(name, spec, buf.clone()).await?);
        return Ok(());
    }
    let e = spec.dtype.size();
    let bytes = |r: Range<usize>| r.start * e..r.end * e;
    let input = buf.read(bytes(lay.input.clone()))?;
    let out = s.submit(name, spec, input.as_slice()).await?;
    drop(input);
    match (lay.output.clone(), out.bytes()) {
        (Some(r), Some(o)) if o.len() == r.len() * e => {
            buf.write(bytes(r))?.as_mut_slice().copy_from_slice(o)
        }
        (None, None) => {}
        (r, o) => bail!(
            "{name}: an output of {:?} bytes for an in-place output of {:?} elements",
            o.map(<[u8]>::len),
            r.map(|r| r.len())
        ),
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
    let e = std::mem::size_of::<E>();
    let buf = Region::from_vec(vec![0; lay.len * e]);
    let fill = || -> anyhow::Result<()> {
        let mut all = buf.write(0..buf.len())?;
        let all = all.as_mut_slice();
        all.fill(0);
        all[lay.input.start * e..lay.input.end * e].copy_from_slice(&inputs[me]);
        Ok(())
    };
    fill()?;
    for _ in 0..args.warmup {
        op_in_place(s, name, spec, &lay, &buf).await?;
    }
    fill()?;
    let h0 = heap::snapshot();
    let t0 = Instant::now();
    for _ in 0..args.iters {
        op_in_place(s, name, spec, &lay, &buf).await?;
    }
    let dt = t0.elapsed().as_secs_f64() / args.iters.max(1) as f64;
    let heap = heap_per_op(h0, args.iters);
    let mut wrong = 0;
    if args.check {
        fill()?;
        op_in_place(s, name, spec, &lay, &buf).await?;
        let out = lay.output.clone().map(|r| r.start * e..r.end * e);
        if args.corrupt_in_place {
            if let Some(r) = out.clone().filter(|r| !r.is_empty()) {
                buf.write(r.start..r.start + 1)?.as_mut_slice()[0] ^= 0x5a;
            }
        }
        let got = out.map(|r| buf.read(r)).transpose()?;
        wrong = count_wrong_of(&spec, me, n, got.as_ref().map(|m| m.as_slice()));
    }
    Ok((dt, wrong, heap))
}

async fn measure(
    s: &Session<AnyTransport>,
    args: &Args,
    spec: OpSpec,
    in_place: bool,
) -> anyhow::Result<(f64, u64, (f64, f64))> {
    let n = s.size();
    let me = s.rank().idx();
    // this rank's input only: the check makes the others' a chunk at a
    // time (count_wrong_of)
    let per = spec.input_len(s.rank(), n).context("size overflows")? / spec.dtype.size();
    let mut inputs = vec![Vec::new(); n];
    inputs[me] = reference::input(spec.dtype, spec.kind.reduce_op(), me, per);
    let name = format!(
        "bench/{}/{}",
        args.op().name(),
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
            wrong = count_wrong_of(&spec, me, n, out.bytes());
        }
        (dt, wrong, heap)
    };
    // the slowest rank's time, and the wrong values of all ranks
    let t = s.allreduce("bench/time", &[dt], ReduceOp::Max).await?[0];
    let w = s.allreduce("bench/wrong", &[wrong], ReduceOp::Sum).await?[0];
    Ok((t, w, heap))
}

pub(crate) async fn bench(args: Args) -> anyhow::Result<bool> {
    match args.run {
        Some(Run::Swap) => return swap_bench(args.iters.max(1), args.warmup).await,
        Some(Run::SwapTransport) => {
            let kinds = args.transports.as_deref().unwrap_or_default();
            return transport_swap_bench(kinds, args.iters.max(1), args.warmup, args.min).await;
        }
        Some(Run::Resize) => {
            let sizes = args.sizes.as_deref().unwrap_or_default();
            return resize_bench(sizes, args.iters.max(1), args.min).await;
        }
        _ => {}
    }
    let mut env = WorkerEnv::from_env()?;
    if let Some(st) = args.strategy {
        env.strategy = st;
    }
    if let Some(t) = &args.timeline {
        env.timeline = Some(t.clone());
    }
    let strategy = env.strategy;
    let w = Worker::start(env).await?;
    let s = w.session();
    let (n, me) = (s.size(), s.rank().idx());
    if args.op().rooted() && args.root >= n {
        bail!("root {} outside a cluster of {n}", args.root);
    }
    let es = args.dtype.size();
    let kind = match args.op() {
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
            args.op().name(),
            w.transport_name(),
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
        let count = if args.op().blockwise() {
            total / n
        } else {
            total
        };
        let shown = if args.op().blockwise() {
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
            check: 0,
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
            oop: cell(args.op(), n, bytes, oop),
            ip: cell(args.op(), n, bytes, ip),
            monitor,
        };
        if me == 0 {
            let redop = if args.op().reduces() {
                args.redop.name()
            } else {
                "none"
            };
            let root = if args.op().rooted() {
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
    // every rank's peak, so that one rank's growth cannot hide
    let rss = s
        .allreduce("kungfu-bench/peak-rss", &[peak_rss_kib()], ReduceOp::Max)
        .await?[0];
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
        // the same line as benches/peers/mpi_bench.c's
        println!("# Peak RSS (largest rank): {:.1} MiB", rss as f64 / 1024.0);
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
                args.op().name(),
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

/// This process's peak resident set so far (`VmHWM` of /proc/self/status),
/// in KiB; 0 where the kernel does not say.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: OpKind) -> OpSpec {
        OpSpec {
            kind,
            dtype: DType::F32,
            count: 4,
            check: 0,
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
        assert_eq!(lay(OpKind::Scatter { root }), (12, 4..4, Some(4..8)));
        assert_eq!(
            lay(OpKind::Scatter { root: Rank(1) }),
            (12, 0..12, Some(4..8))
        );
    }
}
