//! The benchmark's parts, one module per kind of run: `collective` (the
//! op table, out of place and in place), `swap`, `resize` and `monitor`;
//! `report` holds the rows and their JSON.

use clap::error::ErrorKind;
use clap::{ArgAction, CommandFactory, Parser, ValueEnum};
use clap_complete::aot::Shell;
use kungfu_collectives::{DType, ReduceOp};
use kungfu_tools::cli::{at_least, list, on_off};
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

/// The collective an op row times.
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

/// What a run measures: the command line's OP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Run {
    #[value(alias = "all_reduce")]
    Allreduce,
    Broadcast,
    #[value(alias = "all_gather")]
    Allgather,
    #[value(alias = "reduce_scatter", alias = "reducescatter")]
    ReduceScatter,
    Reduce,
    #[value(alias = "all_to_all")]
    Alltoall,
    Swap,
    SwapTransport,
    Resize,
}

impl Run {
    /// The collective timed: swap, swap-transport and resize check
    /// allreduces.
    fn op(self) -> Op {
        match self {
            Run::Broadcast => Op::Broadcast,
            Run::Allgather => Op::Allgather,
            Run::ReduceScatter => Op::ReduceScatter,
            Run::Reduce => Op::Reduce,
            Run::Alltoall => Op::Alltoall,
            Run::Allreduce | Run::Swap | Run::SwapTransport | Run::Resize => Op::Allreduce,
        }
    }
}

// The help is one page for -h and --help alike, as nccl-tests' is: every
// text is a single paragraph (no long help), wrapped by hand
// (`verbatim_doc_comment`): clap's `wrap_help` would bring in
// terminal_size and rustix for it.
const ABOUT: &str = "\
The collective benchmark, in the manner of nccl-tests; run it under kungfu-run:

  kungfu-run -np 4 kungfu-bench allreduce -b 1K -e 64M -f 2 -n 20 -w 5 -c 1";

const AFTER_HELP: &str = "\
Output (rank 0): per size, time algbw busbw #wrong out of place and in
place; #wrong counts the wrong elements of a checked op, in the column's
own buffer, over all ranks (non-zero fails the run). The footer's \"Heap
per op (rank 0)\" line gives the heap allocations and bytes of one timed
out-of-place op on rank 0 (every thread), at the largest size and, in
parentheses, at the smallest.";

/// A run of the benchmark: its command line.
#[derive(Debug, Parser)]
#[command(
    name = "kungfu-bench",
    about = ABOUT,
    long_about = None,
    after_help = AFTER_HELP,
    arg_required_else_help = true,
    args_override_self = true
)]
pub(crate) struct Args {
    /// allreduce | broadcast | allgather | reduce-scatter | reduce | alltoall
    /// | swap (the latency of a strategy swap: agreement and switch; -n, -w)
    /// | swap-transport --transports T,T,... (the latency of a transport
    ///   swap: agreement, connecting the next transport of the list in
    ///   turn, switch; each followed by a checked allreduce of -b bytes on
    ///   it; -n, -w)
    /// | resize --sizes N,N,... (elastic, under kungfu-run -w: a training
    ///   loop of -n steps between resizes over a model of -b bytes; checks
    ///   the model after every change, prints each resize's latency)
    // An `Option` only so that `--completions` can go without it.
    #[arg(
        value_enum,
        value_name = "OP",
        required = true,
        hide_possible_values = true,
        verbatim_doc_comment
    )]
    run: Option<Run>,
    /// Smallest size in bytes (K, M, G suffixes)
    #[arg(short = 'b', value_name = "SIZE", default_value = "1K", value_parser = parse_size)]
    min: usize,
    /// Largest size
    #[arg(short = 'e', value_name = "SIZE", default_value = "64M", value_parser = parse_size)]
    max: usize,
    /// Size multiplier between rows
    #[arg(short = 'f', value_name = "FACTOR", default_value_t = 2, value_parser = at_least(2))]
    factor: usize,
    /// Timed iterations per size
    #[arg(short = 'n', value_name = "ITERS", default_value_t = 20, value_parser = at_least(1))]
    iters: usize,
    /// Untimed iterations per size
    #[arg(short = 'w', value_name = "WARMUP", default_value_t = 5)]
    warmup: usize,
    /// Check every result exactly
    #[arg(
        short = 'c',
        value_name = "0|1",
        default_value = "1",
        value_parser = on_off,
        action = ArgAction::Set
    )]
    check: bool,
    /// float, half, bfloat16, double, int8, uint8,
    /// int32, ...
    #[arg(
        short = 'd',
        value_name = "TYPE",
        default_value = "float",
        value_parser = dtype,
        verbatim_doc_comment
    )]
    dtype: DType,
    /// sum, prod, min, max, avg
    #[arg(short = 'o', value_name = "REDOP", default_value = "sum", value_parser = redop)]
    redop: ReduceOp,
    /// Root of broadcast and reduce
    #[arg(short = 'r', value_name = "ROOT", default_value_t = 0)]
    root: usize,
    /// Also measure in place: one buffer is the op's input and
    /// its output, as in nccl-tests
    #[arg(
        long,
        value_name = "0|1",
        default_value = "1",
        value_parser = on_off,
        action = ArgAction::Set,
        verbatim_doc_comment
    )]
    in_place: bool,
    /// Test only (`KUNGFU_BENCH_CORRUPT_IN_PLACE` set): flip a byte of the
    /// in-place result before it is checked, so a test can see that the
    /// in-place column checks its own buffer. Only builds with the
    /// `testing` feature (the tests') read the variable.
    #[arg(skip = corrupt_in_place())]
    corrupt_in_place: bool,
    /// Allreduce of floats: also time each size with the gradient
    /// monitors on every K-th op (the local norm rides in a spare
    /// element of the gradient allreduce; the summed gradient's norm
    /// after it; noise scale and variance) and print their
    /// overhead (0: off)
    #[arg(long, value_name = "K", default_value_t = 0, verbatim_doc_comment)]
    monitor: usize,
    /// Override KUNGFU_STRATEGY
    #[arg(long, value_name = "S")]
    strategy: Option<Strategy>,
    /// Write the results as JSON (rank 0)
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
    /// Draw busbw against size as SVG (rank 0)
    #[arg(long, value_name = "FILE")]
    plot: Option<String>,
    /// Write every rank's op phases as a Chrome trace, as
    /// KUNGFU_TIMELINE=F does (F.rankR.json per rank, or %r in F
    /// replaced by the rank); open in ui.perfetto.dev
    #[arg(long, value_name = "F", verbatim_doc_comment)]
    timeline: Option<String>,
    /// swap-transport: the transports to swap through, in turn
    /// (at least two, e.g. tcp,quic)
    #[arg(
        long,
        value_name = "T,T,...",
        value_parser = list(str::parse::<TransportKind>),
        verbatim_doc_comment
    )]
    transports: Option<std::vec::Vec<TransportKind>>,
    /// resize: the cluster sizes to resize to, in order
    #[arg(long, value_name = "N,N,...", value_parser = list(at_least(1)))]
    sizes: Option<std::vec::Vec<usize>>,
    /// Print a completion script for SHELL (bash, elvish, fish,
    /// powershell, zsh) and exit
    #[arg(
        long,
        value_name = "SHELL",
        exclusive = true,
        hide_possible_values = true,
        verbatim_doc_comment
    )]
    pub(crate) completions: Option<Shell>,
}

fn dtype(s: &str) -> Result<DType, &'static str> {
    DType::parse(s).ok_or("not a type: float, half, bfloat16, double, int8, uint8, int32, ...")
}

fn redop(s: &str) -> Result<ReduceOp, &'static str> {
    ReduceOp::parse(s).ok_or("not a reduction: sum, prod, min, max, avg")
}

impl Args {
    /// Parses a command line (the program's name first), and checks what
    /// one flag alone cannot.
    pub(crate) fn parse_checked<I, T>(argv: I) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let a = Args::try_parse_from(argv)?;
        a.check()
            .map_err(|m| Args::command().error(ErrorKind::ArgumentConflict, m))?;
        Ok(a)
    }

    fn check(&self) -> Result<(), String> {
        if self.transports.is_some() && self.run != Some(Run::SwapTransport) {
            return Err("--transports is for swap-transport".into());
        }
        if self.sizes.is_some() && self.run != Some(Run::Resize) {
            return Err("--sizes is for resize".into());
        }
        if self.run == Some(Run::SwapTransport)
            && self.transports.as_ref().is_none_or(|t| t.len() < 2)
        {
            return Err(
                "swap-transport needs --transports with at least two, e.g. tcp,quic".into(),
            );
        }
        let op = self.op();
        if self.monitor > 0 && !(op == Op::Allreduce && self.dtype == DType::F32) {
            return Err("--monitor measures allreduces of float (f32) gradients".into());
        }
        if self.min > self.max {
            return Err(format!("-b {} is larger than -e {}", self.min, self.max));
        }
        if op.reduces() && !self.redop.supports(self.dtype) {
            return Err(format!("{} is not defined for {}", self.redop, self.dtype));
        }
        Ok(())
    }

    /// The collective timed (with `--completions`, no OP: allreduce).
    fn op(&self) -> Op {
        self.run.map_or(Op::Allreduce, Run::op)
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

/// The test switch `KUNGFU_BENCH_CORRUPT_IN_PLACE` (see
/// `Args::corrupt_in_place`), read only by test builds.
#[cfg(feature = "testing")]
fn corrupt_in_place() -> bool {
    std::env::var_os("KUNGFU_BENCH_CORRUPT_IN_PLACE").is_some()
}

/// Without the `testing` feature (every `cargo build`): never.
#[cfg(not(feature = "testing"))]
fn corrupt_in_place() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Args, clap::Error> {
        Args::parse_checked(std::iter::once("kungfu-bench").chain(line.split_whitespace()))
    }

    #[test]
    fn bench_cli_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn bench_cli_defaults_are_nccl_tests_ones() {
        let a = parse("allreduce").unwrap();
        assert_eq!(a.run, Some(Run::Allreduce));
        assert_eq!((a.min, a.max, a.factor), (1024, 64 << 20, 2));
        assert_eq!((a.iters, a.warmup, a.root, a.monitor), (20, 5, 0, 0));
        assert!(a.check && a.in_place);
        assert_eq!((a.dtype, a.redop), (DType::F32, ReduceOp::Sum));
        assert!(a.strategy.is_none() && a.json.is_none() && a.transports.is_none());
    }

    #[test]
    fn bench_cli_reads_nccl_tests_flags() {
        let a = parse(
            "reduce_scatter -b 12 -e 12K -f 8 -n 2 -w 0 -c 0 -d half -o max -r 1 \
             --in-place 0 --strategy ring --json r.json --plot r.svg --timeline t",
        )
        .unwrap();
        assert_eq!(a.op(), Op::ReduceScatter);
        assert_eq!((a.min, a.max, a.factor), (12, 12 << 10, 8));
        assert_eq!((a.iters, a.warmup, a.root), (2, 0, 1));
        assert!(!a.check && !a.in_place);
        assert_eq!((a.dtype, a.redop), (DType::F16, ReduceOp::Max));
        assert_eq!(a.strategy, Some(Strategy::Ring));
        assert_eq!(a.json.as_deref(), Some("r.json"));
        assert_eq!(a.plot.as_deref(), Some("r.svg"));
        assert_eq!(a.timeline.as_deref(), Some("t"));
        // scripts append their own flags to a default line: the last wins
        let a = parse("allreduce -e 64M -d float -e 16M -d half").unwrap();
        assert_eq!((a.max, a.dtype), (16 << 20, DType::F16));
    }

    #[test]
    fn bench_cli_reads_swaps_and_resizes() {
        let a = parse("swap-transport --transports tcp,quic,fabric -n 6").unwrap();
        assert_eq!(a.run, Some(Run::SwapTransport));
        assert_eq!(
            a.transports,
            Some(vec![
                TransportKind::Tcp,
                TransportKind::Quic,
                TransportKind::Fabric
            ])
        );
        let a = parse("resize --sizes 4,3,1,3").unwrap();
        assert_eq!((a.run, a.op()), (Some(Run::Resize), Op::Allreduce));
        assert_eq!(a.sizes, Some(vec![4, 3, 1, 3]));
        assert_eq!(parse("swap").unwrap().run, Some(Run::Swap));
    }

    #[test]
    fn bench_cli_refuses_what_it_cannot_run() {
        for (line, want) in [
            ("allreduce -f 1", "must be at least 2"),
            ("allreduce -n 0", "must be at least 1"),
            ("allreduce -b 2K -e 1K", "-b 2048 is larger than -e 1024"),
            ("allreduce -d int32 -o avg", "avg is not defined for i32"),
            (
                "allreduce -d int32 --monitor 1",
                "--monitor measures allreduces",
            ),
            (
                "swap-transport --transports tcp",
                "needs --transports with at least two",
            ),
            ("swap-transport", "needs --transports with at least two"),
            (
                "allreduce --transports tcp,quic",
                "--transports is for swap-transport",
            ),
            ("allreduce --sizes 2,1", "--sizes is for resize"),
            ("resize --sizes 2,0", "must be at least 1"),
            ("allreduce -d quad", "not a type"),
            ("allreduce -b 1Q", "bad size"),
            ("allreduce -x 1", "unexpected argument '-x'"),
            ("scatter", "invalid value 'scatter'"),
            ("allreduce -b", "a value is required for '-b <SIZE>'"),
        ] {
            let e = parse(line).map(|_| ()).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{line}");
            assert!(e.to_string().contains(want), "{line}: {e}");
        }
    }

    #[test]
    fn bench_cli_prints_completions_without_an_op() {
        let a = parse("--completions bash").unwrap();
        assert_eq!((a.run, a.completions), (None, Some(Shell::Bash)));
        assert!(parse("allreduce --completions bash").is_err());
    }
}
