//! `kungfu-sim`: the library's allreduce plans at scales this machine
//! cannot run, over a model of a cluster network (see `kungfu_tools::sim`).

use anyhow::Context;
use clap::{Parser, ValueEnum};
use clap_complete::aot::Shell;
use kungfu_tools::cli::{at_least, list};
use kungfu_tools::sim::{self, Model};
use kungfu_tools::{fmt_size, parse_size};
use kungfu_topology::Strategy;

// One page of help for -h and --help alike: every text is a single
// paragraph (no long help), wrapped by hand (see kungfu-bench's).
const ABOUT: &str = "\
Predicts allreduce (f32 sum) per strategy, message size and cluster size by
running every worker's plan, as the library builds it, over a model of the
network: per-host links (--link-gbps, --latency-us) into one switch or a fat
tree, hosts of --per-host workers joined by their memory (--intra-gbps),
and per-frame CPU costs (--overhead-us, --cpu-gbps). Prints, per size, the
predicted time, bus bandwidth (nccl-tests' busbw), and the bytes and frames
of the busiest host link and worker; then which strategy is fastest and
what AUTO picks.";

/// The command line: the sizes to simulate and the model.
#[derive(Debug, Parser)]
#[command(name = "kungfu-sim", about = ABOUT, long_about = None, args_override_self = true)]
struct Args {
    /// Cluster sizes
    #[arg(
        long,
        value_name = "N,N,...",
        default_value = "16,64,256,1024,4096",
        value_parser = list(at_least(1))
    )]
    workers: std::vec::Vec<usize>,
    /// Workers per host
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = at_least(1))]
    per_host: usize,
    /// Bytes per worker (K, M, G suffixes)
    #[arg(
        long,
        value_name = "S,S,...",
        default_value = "1M,64M",
        value_parser = list(message_size)
    )]
    sizes: std::vec::Vec<usize>,
    /// Strategies, by name, or all
    #[arg(long, value_name = "S,...", default_value = "all", value_parser = strategies)]
    strategies: std::vec::Vec<Strategy>,
    /// Each host's link, Gbit/s each way
    #[arg(long, value_name = "G", default_value_t = 100.0, value_parser = positive)]
    link_gbps: f64,
    /// Network latency per frame (us)
    #[arg(long, value_name = "U", default_value_t = 5.0, value_parser = non_negative)]
    latency_us: f64,
    /// Racks of R hosts, uplinks oversubscribed O:1 (without it:
    /// one non-blocking switch)
    #[arg(long, value_name = "R:O", value_parser = fat_tree, verbatim_doc_comment)]
    fat_tree: Option<(usize, f64)>,
    /// A host's memory, for frames inside it, Gbit/s
    #[arg(long, value_name = "G", default_value_t = 400.0, value_parser = positive)]
    intra_gbps: f64,
    /// Latency of a frame inside a host (us)
    #[arg(long, value_name = "U", default_value_t = 1.0, value_parser = non_negative)]
    intra_latency_us: f64,
    /// A worker's copy or reduction of what it receives,
    /// Gbit/s
    #[arg(
        long,
        value_name = "G",
        default_value_t = 80.0,
        value_parser = positive,
        verbatim_doc_comment
    )]
    cpu_gbps: f64,
    /// CPU per frame, at each end (us)
    #[arg(long, value_name = "U", default_value_t = 2.0, value_parser = non_negative)]
    overhead_us: f64,
    /// The largest frame (the library's default)
    #[arg(long, value_name = "S", default_value = "1M", value_parser = chunk)]
    chunk: usize,
    /// One link per host (default), or one per worker (as when
    /// each worker's traffic is shaped apart)
    #[arg(
        long,
        value_enum,
        value_name = "host|worker",
        default_value_t = Links::Host,
        hide_default_value = true,
        hide_possible_values = true,
        verbatim_doc_comment
    )]
    links: Links,
    /// Skip a run whose plans hold more actions
    #[arg(long, value_name = "N", default_value_t = 30_000_000)]
    max_actions: usize,
    /// Write DIR/sim-allreduce-SIZE.svg: busbw against workers
    #[arg(long, value_name = "DIR")]
    plot: Option<std::path::PathBuf>,
    /// Write the busbw tables (one per size: strategies by cluster
    /// size) as JSON in the format of benches/peers/tables.py, which
    /// docs/sim.md's tables are rendered from (scripts/doc-tables.py)
    #[arg(long, value_name = "FILE", verbatim_doc_comment)]
    json: Option<std::path::PathBuf>,
    /// Print a completion script for SHELL (bash, elvish, fish,
    /// powershell, zsh) and exit
    #[arg(
        long,
        value_name = "SHELL",
        exclusive = true,
        hide_possible_values = true,
        verbatim_doc_comment
    )]
    completions: Option<Shell>,
}

/// What a link of the model carries (`--links`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Links {
    Host,
    Worker,
}

impl Args {
    fn model(&self) -> Model {
        Model {
            per_host: self.per_host,
            link_bw: self.link_gbps * 1e9 / 8.0,
            latency: self.latency_us * 1e-6,
            intra_bw: self.intra_gbps * 1e9 / 8.0,
            intra_latency: self.intra_latency_us * 1e-6,
            cpu_bw: self.cpu_gbps * 1e9 / 8.0,
            overhead: self.overhead_us * 1e-6,
            fat_tree: self.fat_tree,
            chunk_bytes: self.chunk,
            link_per_worker: self.links == Links::Worker,
        }
    }
}

fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err("not a number of 0 or more".into()),
    }
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("not a number above 0".into()),
    }
}

fn fat_tree(s: &str) -> Result<(usize, f64), String> {
    let (r, o) = s
        .split_once(':')
        .ok_or("expected R:O, racks of R hosts with uplinks oversubscribed O:1")?;
    let racks = r.parse().map_err(|e| format!("R {r:?}: {e}"))?;
    Ok((racks, non_negative(o).map_err(|e| format!("O {o:?}: {e}"))?))
}

fn message_size(s: &str) -> anyhow::Result<usize> {
    match parse_size(s)? {
        0..4 => anyhow::bail!("at least 4 bytes (one f32)"),
        b => Ok(b),
    }
}

fn chunk(s: &str) -> anyhow::Result<usize> {
    match parse_size(s)? {
        b @ 1..=sim::MAX_FRAME => Ok(b),
        _ => anyhow::bail!("must be 1 to {} bytes", sim::MAX_FRAME),
    }
}

fn strategies(s: &str) -> Result<Vec<Strategy>, String> {
    if s == "all" {
        return Ok(Strategy::ALL.to_vec());
    }
    list(str::parse::<Strategy>)(s)
}

/// The outcome of one (strategy, workers, size), or why there is none.
type Cell = Result<sim::Outcome, String>;

fn simulate(a: &Args, m: &Model, strategy: Strategy, n: usize, bytes: usize) -> Cell {
    let peers = sim::peers(n, m.per_host);
    let spec = sim::allreduce(bytes);
    // A bound before building them all: rank 0 (the root of the rooted
    // strategies) and the last rank (a leaf of the trees, a rank of the
    // ring like any other) stand for the rest.
    let chunk = m.chunk_bytes;
    let topologies = sim::Topologies::new(&peers, strategy, &spec)?;
    let first = topologies.plan(&spec, chunk, 0)?.len();
    let last = topologies.plan(&spec, chunk, n - 1)?.len();
    let estimate = first + last * (n - 1);
    if estimate > a.max_actions {
        return Err(format!(
            "about {estimate} plan actions (more than --max-actions)"
        ));
    }
    sim::run(m, topologies.plans(&spec, chunk)?)
}

fn main() {
    let a = Args::parse();
    if let Some(shell) = a.completions {
        kungfu_tools::cli::print_completions::<Args>(shell);
        return;
    }
    if let Err(e) = report(&a) {
        eprintln!("kungfu-sim: {e:#}");
        std::process::exit(1);
    }
}

fn report(a: &Args) -> anyhow::Result<()> {
    let m = &a.model();
    let mut tables = Vec::new();
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
                let cell = simulate(a, m, s, n, bytes);
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
        tables.push(busbw_table(a, bytes, &table));
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
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "tables": tables,
        });
        let text = serde_json::to_string_pretty(&doc)? + "\n";
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("# tables: {}", path.display());
    }
    Ok(())
}

/// One size's busbw (GB/s) per strategy and cluster size, as a table of
/// benches/peers/tables.py (`-` where a cell was not simulated).
fn busbw_table(
    a: &Args,
    bytes: usize,
    table: &[(Strategy, Vec<(usize, Cell)>)],
) -> serde_json::Value {
    let columns: Vec<String> = std::iter::once("strategy".to_string())
        .chain(a.workers.iter().map(|n| n.to_string()))
        .collect();
    let formats: Vec<&str> = std::iter::once("{}")
        .chain(a.workers.iter().map(|_| "{:.3f}"))
        .collect();
    let rows: Vec<serde_json::Value> = table
        .iter()
        .map(|(s, row)| {
            let cells = row.iter().map(|(n, c)| match c {
                Ok(o) => serde_json::json!(sim::busbw(bytes, *n, o.time)),
                Err(_) => serde_json::Value::Null,
            });
            std::iter::once(serde_json::json!(s.name()))
                .chain(cells)
                .collect()
        })
        .collect();
    serde_json::json!({
        "id": format!("busbw-{}", fmt_size(bytes)),
        "title": format!("kungfu-sim: allreduce busbw (GB/s) of {} per worker, per strategy and cluster size", fmt_size(bytes)),
        "columns": columns,
        "formats": formats,
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(line: &str) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("kungfu-sim").chain(line.split_whitespace()))
    }

    #[test]
    fn sim_cli_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn sim_cli_defaults_model_a_100_gbit_cluster() {
        let a = parse("").unwrap();
        assert_eq!(a.workers, [16, 64, 256, 1024, 4096]);
        assert_eq!(a.sizes, [1 << 20, 64 << 20]);
        assert_eq!(a.strategies, Strategy::ALL);
        assert_eq!(a.max_actions, 30_000_000);
        let m = a.model();
        assert_eq!((m.per_host, m.chunk_bytes, m.fat_tree), (8, 1 << 20, None));
        assert_eq!((m.link_bw, m.intra_bw, m.cpu_bw), (12.5e9, 50e9, 10e9));
        assert_eq!(
            (a.latency_us, a.intra_latency_us, a.overhead_us),
            (5.0, 1.0, 2.0)
        );
        assert!(!m.link_per_worker);
    }

    #[test]
    fn sim_cli_reads_every_flag() {
        let a = parse(
            "--workers 4,16, --per-host 2 --sizes 64K,4M --strategies ring,star \
             --link-gbps 0.8 --latency-us 0 --fat-tree 8:2.5 --intra-gbps 40 \
             --intra-latency-us 3 --cpu-gbps 8 --overhead-us 4 --chunk 64K \
             --links worker --max-actions 10 --plot out",
        )
        .unwrap();
        assert_eq!(a.workers, [4, 16]);
        assert_eq!(a.sizes, [64 << 10, 4 << 20]);
        assert_eq!(a.strategies, [Strategy::Ring, Strategy::Star]);
        assert_eq!(
            (a.max_actions, a.plot.as_deref()),
            (10, Some("out".as_ref()))
        );
        let m = a.model();
        assert_eq!(
            (m.per_host, m.chunk_bytes, m.fat_tree),
            (2, 64 << 10, Some((8, 2.5)))
        );
        assert_eq!((m.link_bw, m.intra_bw, m.cpu_bw), (0.1e9, 5e9, 1e9));
        assert_eq!((m.latency, m.intra_latency, m.overhead), (0.0, 3e-6, 4e-6));
        assert!(m.link_per_worker);
    }

    #[test]
    fn sim_cli_refuses_a_model_it_cannot_run() {
        for (line, want) in [
            ("--fat-tree 8", "expected R:O"),
            ("--fat-tree x:2", "R \"x\""),
            ("--per-host 0", "must be at least 1"),
            ("--workers 4,0", "must be at least 1"),
            ("--link-gbps 0", "not a number above 0"),
            ("--latency-us x", "not a number of 0 or more"),
            ("--sizes 2", "at least 4 bytes"),
            ("--chunk 32M", "1 to 16777216 bytes"),
            ("--strategies ring,cube", "\"cube\""),
            ("--links switch", "invalid value 'switch'"),
            ("--nodes 4", "unexpected argument '--nodes'"),
        ] {
            let e = parse(line).map(|_| ()).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{line}");
            assert!(e.to_string().contains(want), "{line}: {e}");
        }
    }
}
