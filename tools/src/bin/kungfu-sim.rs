//! `kungfu-sim`: the library's allreduce plans at scales this machine
//! cannot run, over a model of a cluster network (see `kungfu_tools::sim`).

use anyhow::{bail, Context};
use kungfu_tools::sim::{self, Model};
use kungfu_tools::{fmt_size, parse_size};
use kungfu_topology::Strategy;

const USAGE: &str = "\
usage: kungfu-sim [options]

Predicts allreduce (f32 sum) per strategy, message size and cluster size by
running every worker's plan, as the library builds it, over a model of the
network: per-host links (--link-gbps, --latency-us) into one switch or a fat
tree, hosts of --per-host workers joined by their memory (--intra-gbps),
and per-frame CPU costs (--overhead-us, --cpu-gbps). Prints, per size, the
predicted time, bus bandwidth (nccl-tests' busbw), and the bytes and frames
of the busiest host link and worker; then which strategy is fastest and
what AUTO picks.

options:
  --workers N,N,...     cluster sizes (16,64,256,1024,4096)
  --per-host N          workers per host (8)
  --sizes S,S,...       bytes per worker (1M,64M)
  --strategies S,...    strategies (all)
  --link-gbps G         each host's link, Gbit/s each way (100)
  --latency-us U        network latency per frame (5)
  --fat-tree R:O        racks of R hosts, uplinks oversubscribed O:1 (none:
                        one non-blocking switch)
  --intra-gbps G        a host's memory, for frames inside it (400)
  --intra-latency-us U  latency of a frame inside a host (1)
  --cpu-gbps G          a worker's copy or reduction of what it receives (80)
  --overhead-us U       CPU per frame, at each end (2)
  --chunk S             the largest frame (1M, the library's default)
  --links host|worker   one link per host (default), or one per worker (as
                        when each worker's traffic is shaped apart)
  --max-actions N       skip a run whose plans hold more actions (30000000)
  --plot DIR            write DIR/sim-allreduce-SIZE.svg: busbw against workers
  -h, --help            this text
";

struct Args {
    workers: Vec<usize>,
    sizes: Vec<usize>,
    strategies: Vec<Strategy>,
    model: Model,
    max_actions: usize,
    plot: Option<std::path::PathBuf>,
}

fn list<T>(s: &str, f: impl Fn(&str) -> anyhow::Result<T>) -> anyhow::Result<Vec<T>> {
    s.split(',').filter(|p| !p.is_empty()).map(f).collect()
}

fn num(s: &str, flag: &str) -> anyhow::Result<f64> {
    let v: f64 = s
        .parse()
        .with_context(|| format!("{flag} needs a number"))?;
    if !v.is_finite() || v < 0.0 {
        bail!("{flag} {s}: not a number of 0 or more");
    }
    Ok(v)
}

fn parse(args: &[String]) -> anyhow::Result<Option<Args>> {
    let mut a = Args {
        workers: vec![16, 64, 256, 1024, 4096],
        sizes: vec![1 << 20, 64 << 20],
        strategies: Strategy::ALL.to_vec(),
        model: Model {
            per_host: 8,
            link_bw: 100e9 / 8.0,
            latency: 5e-6,
            intra_bw: 400e9 / 8.0,
            intra_latency: 1e-6,
            cpu_bw: 80e9 / 8.0,
            overhead: 2e-6,
            fat_tree: None,
            chunk_bytes: 1 << 20,
            link_per_worker: false,
        },
        max_actions: 30_000_000,
        plot: None,
    };
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "-h" || flag == "--help" {
            return Ok(None);
        }
        let v = args
            .get(i + 1)
            .with_context(|| format!("{flag} needs a value"))?;
        let m = &mut a.model;
        match flag {
            "--workers" => a.workers = list(v, |s| s.parse().context("--workers"))?,
            "--per-host" => m.per_host = v.parse().context("--per-host needs a number")?,
            "--sizes" => a.sizes = list(v, parse_size)?,
            "--strategies" if v == "all" => a.strategies = Strategy::ALL.to_vec(),
            "--strategies" => a.strategies = list(v, |s| Ok(s.parse::<Strategy>()?))?,
            "--link-gbps" => m.link_bw = num(v, flag)? * 1e9 / 8.0,
            "--latency-us" => m.latency = num(v, flag)? * 1e-6,
            "--intra-gbps" => m.intra_bw = num(v, flag)? * 1e9 / 8.0,
            "--intra-latency-us" => m.intra_latency = num(v, flag)? * 1e-6,
            "--cpu-gbps" => m.cpu_bw = num(v, flag)? * 1e9 / 8.0,
            "--overhead-us" => m.overhead = num(v, flag)? * 1e-6,
            "--fat-tree" => {
                let (r, o) = v.split_once(':').context("--fat-tree R:O")?;
                m.fat_tree = Some((r.parse().context("--fat-tree R")?, num(o, flag)?));
            }
            "--chunk" => m.chunk_bytes = parse_size(v)?,
            "--links" => {
                m.link_per_worker = match v.as_str() {
                    "host" => false,
                    "worker" => true,
                    _ => bail!("--links host|worker, not {v:?}"),
                }
            }
            "--max-actions" => a.max_actions = v.parse().context("--max-actions")?,
            "--plot" => a.plot = Some(v.into()),
            _ => bail!("unknown option {flag:?}"),
        }
        i += 2;
    }
    let m = &a.model;
    if m.per_host == 0 || a.workers.contains(&0) {
        bail!("--workers and --per-host must be at least 1");
    }
    if [m.link_bw, m.intra_bw, m.cpu_bw].iter().any(|&b| b <= 0.0) {
        bail!("bandwidths must be positive");
    }
    if m.chunk_bytes == 0 || m.chunk_bytes > sim::MAX_FRAME {
        bail!("--chunk must be 1 to {} bytes", sim::MAX_FRAME);
    }
    if a.sizes.iter().any(|&s| s < 4) {
        bail!("--sizes: at least 4 bytes (one f32)");
    }
    Ok(Some(a))
}

/// The outcome of one (strategy, workers, size), or why there is none.
type Cell = Result<sim::Outcome, String>;

fn simulate(a: &Args, strategy: Strategy, n: usize, bytes: usize) -> Cell {
    let peers = sim::peers(n, a.model.per_host);
    let spec = sim::allreduce(bytes);
    // A bound before building them all: rank 0 (the root of the rooted
    // strategies) and the last rank (a leaf of the trees, a rank of the
    // ring like any other) stand for the rest.
    let chunk = a.model.chunk_bytes;
    let topologies = sim::Topologies::new(&peers, strategy, &spec)?;
    let first = topologies.plan(&spec, chunk, 0)?.len();
    let last = topologies.plan(&spec, chunk, n - 1)?.len();
    let estimate = first + last * (n - 1);
    if estimate > a.max_actions {
        return Err(format!(
            "about {estimate} plan actions (more than --max-actions)"
        ));
    }
    sim::run(&a.model, topologies.plans(&spec, chunk)?)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a = match parse(&args) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("kungfu-sim: {e:#}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = report(&a) {
        eprintln!("kungfu-sim: {e:#}");
        std::process::exit(1);
    }
}

fn report(a: &Args) -> anyhow::Result<()> {
    let m = &a.model;
    println!(
        "# model: {} workers per host; links {:.0} Gbit/s, {:.1} us{}; host memory {:.0} Gbit/s, \
         {:.1} us; per frame {:.1} us CPU at each end, receive at {:.0} Gbit/s; frames of at most {}",
        m.per_host,
        m.link_bw * 8e-9,
        m.latency * 1e6,
        m.fat_tree
            .map_or(", one switch".into(), |(r, o)| format!(", fat tree of {r}-host racks at {o}:1")),
        m.intra_bw * 8e-9,
        m.intra_latency * 1e6,
        m.overhead * 1e6,
        m.cpu_bw * 8e-9,
        fmt_size(m.chunk_bytes)
    );
    for &bytes in &a.sizes {
        println!("\n## allreduce {} per worker", fmt_size(bytes));
        println!(
            "{:>22} {:>7} {:>12} {:>9} {:>12} {:>10} {:>12} {:>10}",
            "strategy",
            "workers",
            "time us",
            "busbw",
            "link MB",
            "link msgs",
            "worker MB",
            "wkr msgs"
        );
        let mut table: Vec<(Strategy, Vec<(usize, Cell)>)> = Vec::new();
        for &s in &a.strategies {
            let mut row = Vec::new();
            for &n in &a.workers {
                let cell = simulate(a, s, n, bytes);
                match &cell {
                    Ok(o) => println!(
                        "{:>22} {n:>7} {:>12.1} {:>9.3} {:>12.2} {:>10} {:>12.2} {:>10}",
                        s.name(),
                        o.time * 1e6,
                        sim::busbw(bytes, n, o.time),
                        o.link_bytes_max as f64 / 1e6,
                        o.link_msgs_max,
                        o.worker_bytes_max as f64 / 1e6,
                        o.worker_msgs_max
                    ),
                    Err(e) => println!("{:>22} {n:>7}   not simulated: {e}", s.name()),
                }
                row.push((n, cell));
            }
            table.push((s, row));
        }
        println!(
            "\n# fastest per cluster size ({}), and AUTO's time against it:",
            fmt_size(bytes)
        );
        for (i, &n) in a.workers.iter().enumerate() {
            let times = table
                .iter()
                .filter_map(|(s, row)| row[i].1.as_ref().ok().map(|o| (*s, o.time)));
            let best = times
                .clone()
                .filter(|(s, _)| *s != Strategy::Auto)
                .min_by(|x, y| x.1.total_cmp(&y.1));
            let auto = times.clone().find(|(s, _)| *s == Strategy::Auto);
            match (best, auto) {
                (Some((b, tb)), Some((_, ta))) => println!(
                    "{n:>7} workers: {} ({:.1} us); AUTO {:.1} us ({:.2}x the fastest)",
                    b.name(),
                    tb * 1e6,
                    ta * 1e6,
                    ta / tb
                ),
                (Some((b, tb)), None) => {
                    println!("{n:>7} workers: {} ({:.1} us)", b.name(), tb * 1e6)
                }
                _ => println!("{n:>7} workers: none simulated"),
            }
        }
        if let Some(dir) = &a.plot {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let series: Vec<kungfu_tools::plot::Series> = table
                .iter()
                .map(|(s, row)| kungfu_tools::plot::Series {
                    label: s.name().into(),
                    points: row
                        .iter()
                        .filter_map(|(n, c)| {
                            c.as_ref().ok().map(|o| (*n, sim::busbw(bytes, *n, o.time)))
                        })
                        .collect(),
                })
                .collect();
            let title = format!(
                "kungfu-sim: allreduce {} per worker, {} per host, {:.0} Gbit/s links",
                fmt_size(bytes),
                m.per_host,
                m.link_bw * 8e-9
            );
            let svg = kungfu_tools::plot::svg_axes(&title, "workers", &|n| n.to_string(), &series);
            let path = dir.join(format!("sim-allreduce-{}.svg", fmt_size(bytes)));
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            println!("# plot: {}", path.display());
        }
    }
    Ok(())
}
