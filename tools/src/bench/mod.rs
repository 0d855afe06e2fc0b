//! The benchmark's parts, one module per kind of run: `collective` (the
//! op table, out of place and in place), `swap`, `resize` and `monitor`;
//! `report` holds the rows and their JSON.

use anyhow::{bail, Context};
use kungfu_collectives::{DType, ReduceOp};
use kungfu_tools::parse_size;
use kungfu_topology::Strategy;
use kungfu_transport::any::TransportKind;

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

mod collective;
mod monitor;
mod report;
mod resize;
mod swap;

pub(crate) use collective::bench;

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

pub(crate) struct Args {
    op: Op,
    /// `swap`: measure strategy swaps instead of an op.
    swap: bool,
    /// `swap-transport`: measure transport swaps, cycling through these.
    swap_transports: Option<Vec<TransportKind>>,
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
    /// `--timeline FILE`: as `KUNGFU_TIMELINE=FILE`.
    timeline: Option<String>,
}

pub(crate) fn parse_args(a: &[String]) -> anyhow::Result<Option<Args>> {
    if a.is_empty() || a.iter().any(|x| x == "-h" || x == "--help") {
        return Ok(None);
    }
    let swap = a[0] == "swap";
    let resize = a[0] == "resize";
    let swap_transport = a[0] == "swap-transport";
    let op = if swap || resize || swap_transport {
        Op::Allreduce
    } else {
        Op::parse(&a[0]).with_context(|| format!("unknown op {:?}", a[0]))?
    };
    let mut r = Args {
        op,
        swap,
        swap_transports: swap_transport.then(Vec::new),
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
        timeline: None,
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
            "--timeline" => r.timeline = Some(v.clone()),
            "--transports" if swap_transport => {
                r.swap_transports = Some(
                    v.split(',')
                        .map(|t| {
                            t.trim()
                                .parse::<TransportKind>()
                                .map_err(anyhow::Error::msg)
                        })
                        .collect::<anyhow::Result<Vec<_>>>()
                        .with_context(|| format!("--transports {v:?}"))?,
                )
            }
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
    if r.swap_transports.as_ref().is_some_and(|t| t.len() < 2) {
        bail!("swap-transport needs --transports with at least two, e.g. tcp,quic");
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
