//! `kungfu-selftest`: a small stand-in for a training loop, to check a
//! setup end to end and to test the launcher's failure handling.
//!
//! ```text
//! kungfu-run -np 4 kungfu-selftest [--steps N] [--size ELEMS]
//!            [--exit RANK:STEP:CODE] [--hang RANK:STEP]
//!            [--check-port] [--wait-for PATH] [--swap-transports T,T,...]
//!            [--recover] [--follow-config] [--stop-file PATH] [--stamp]
//! ```
//!
//! `kungfu-selftest --help` says what each flag does (the doc comments of
//! `Args`). Every rank prints its pid (and its address) first, so tests
//! can kill one or throw bytes at its port.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Parser;
use clap_complete::aot::Shell;
use kungfu::{Discovery, Worker, WorkerEnv};
use kungfu_collectives::{CollectiveError, ReduceOp};
use kungfu_tools::cli::list;
use kungfu_topology::Rank;
use kungfu_transport::any::TransportKind;

// One page of help for -h and --help alike: every text is a single
// paragraph (no long help), wrapped by hand (see kungfu-bench's).
const ABOUT: &str = "\
A small stand-in for a training loop, to check a setup end to end and to
test the launcher's failure handling; run it under kungfu-run:

  kungfu-run -np 4 kungfu-selftest --steps 100

Each step allreduces a gradient-sized buffer of exact values and checks the
result. Every rank prints its pid (and its address) first, so tests can
kill one or throw bytes at its port.";

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "kungfu-selftest",
    about = ABOUT,
    long_about = None,
    args_override_self = true
)]
struct Args {
    /// Training steps
    #[arg(long, value_name = "N", default_value_t = 10)]
    steps: usize,
    /// Elements (f32) of the gradient (and the model)
    #[arg(long, value_name = "ELEMS", default_value_t = 1 << 16)]
    size: usize,
    /// Make one rank (its rank at start) exit with CODE at STEP
    #[arg(long, value_name = "RANK:STEP:CODE", value_parser = exit_at)]
    exit: Option<(usize, usize, i32)>,
    /// Make one rank stop taking part at STEP (the others must
    /// fail by their deadline)
    #[arg(long, value_name = "RANK:STEP", value_parser = hang_at, verbatim_doc_comment)]
    hang: Option<(usize, usize)>,
    /// Fail unless this worker's address is already bound when
    /// it starts (kungfu-run binds it and passes the socket
    /// down; a port the launcher had released could be taken by
    /// any process)
    #[arg(long, verbatim_doc_comment)]
    check_port: bool,
    /// Hold every worker, connected, until PATH exists (at most
    /// two minutes), so that many jobs can be alive at once
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    wait_for: Option<std::path::PathBuf>,
    /// Swap the transport to each in turn at evenly spaced steps
    /// (a collective: every rank does), checking every step
    /// before and after
    #[arg(
        long,
        value_name = "T,T,...",
        value_parser = list(str::parse::<TransportKind>),
        verbatim_doc_comment
    )]
    swap_transports: Option<std::vec::Vec<TransportKind>>,
    /// Keep training when a worker is lost (under kungfu-run
    /// --on-failure shrink): the survivors call Worker::recover,
    /// then Worker::sync_state, and go on from the step they
    /// agree on. Every step adds the (exact) sum to a model and
    /// checks with a consensus that every worker's model is the
    /// same. After a recovery, the first step that succeeds says
    /// how long after the loss it came, with the model's digest,
    /// so that a test can compare the survivors' models itself
    #[arg(long, verbatim_doc_comment)]
    recover: bool,
    /// Call Worker::resize_from_config every step, so that
    /// workers that the launcher starts (--on-failure replace,
    /// -w) join
    #[arg(long, verbatim_doc_comment)]
    follow_config: bool,
    /// Every 10 steps the workers agree (an allreduce) whether
    /// any of them sees PATH, and all stop at that step; a test
    /// ends an endless run cleanly with it
    #[arg(long, value_name = "PATH", verbatim_doc_comment)]
    stop_file: Option<std::path::PathBuf>,
    /// Start every line with the unix time in milliseconds and
    /// the pid (1712345678901 pid 4242: step 10 ok), for a test
    /// that times what the workers report and tells workers
    /// apart whose launcher labels collide (a replacement gets
    /// its rank's label)
    #[arg(long, verbatim_doc_comment)]
    stamp: bool,
    /// Sleep MS milliseconds after every step, so that a test can
    /// count on the job still running while something slower
    /// (a launcher starting a replacement) happens
    #[arg(long, value_name = "MS", default_value_t = 0, verbatim_doc_comment)]
    step_ms: u64,
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

fn exit_at(s: &str) -> Result<(usize, usize, i32), String> {
    let bad = || "expected RANK:STEP:CODE, three numbers".to_string();
    let [rank, step, code] = s.split(':').collect::<Vec<_>>()[..] else {
        return Err(bad());
    };
    Ok((
        rank.parse().map_err(|_| bad())?,
        step.parse().map_err(|_| bad())?,
        code.parse().map_err(|_| bad())?,
    ))
}

fn hang_at(s: &str) -> Result<(usize, usize), String> {
    let bad = || "expected RANK:STEP, two numbers".to_string();
    let [rank, step] = s.split(':').collect::<Vec<_>>()[..] else {
        return Err(bad());
    };
    Ok((
        rank.parse().map_err(|_| bad())?,
        step.parse().map_err(|_| bad())?,
    ))
}

/// Whether lines start with the time and the pid (`--stamp`).
static STAMP: AtomicBool = AtomicBool::new(false);

/// The start of every line: empty, or with `--stamp` the unix time in
/// milliseconds and the pid.
fn stamp() -> String {
    if !STAMP.load(Ordering::Relaxed) {
        return String::new();
    }
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{ms} pid {}: ", std::process::id())
}

/// `println!` after the [`stamp`].
macro_rules! say {
    ($($arg:tt)*) => {
        println!("{}{}", stamp(), format_args!($($arg)*))
    };
}

/// Fails if this worker's own address can be bound: nothing holds it yet.
fn check_port_held(env: &WorkerEnv) -> anyhow::Result<()> {
    let Discovery::Peers(peers) = &env.discovery else {
        bail!("--check-port needs a peer list (kungfu-run)");
    };
    let me = peers.peer(Rank(env.rank as u32)).context("own rank")?;
    match std::net::TcpListener::bind((me.host.as_str(), me.port)) {
        Ok(_) => bail!("{me} was free before this worker listened on it: nothing held the port"),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Ok(()),
        Err(e) => bail!("probing {me}: {e}"),
    }
}

/// Waits until `path` exists, polling (bounded: a test that never creates
/// it must not leave workers behind).
async fn wait_for(path: &std::path::Path) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    while !path.exists() {
        if tokio::time::Instant::now() > deadline {
            bail!("{} did not appear within two minutes", path.display());
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let env = WorkerEnv::from_env()?;
    if args.check_port {
        check_port_held(&env)?;
    }
    let mut w = Worker::start(env).await?;
    let (rank, n) = (w.rank(), w.size());
    let me = w
        .peers()
        .peer(Rank(rank as u32))
        .context("own rank")?
        .clone();
    say!(
        "pid {} rank {rank}/{n} local {}/{} launcher {:?} address {me}",
        std::process::id(),
        w.local_rank(),
        w.local_size(),
        w.env().launcher
    );
    if let Some(path) = &args.wait_for {
        say!("address {me}: waiting for {}", path.display());
        wait_for(path).await?;
    }
    let mut model = vec![0f32; args.size];
    let mut step = 0;
    if w.is_fresh() {
        // a worker that joined a running job: where is training?
        step = w.sync_state(0, &mut [("model", &mut model)]).await? as usize;
        say!("joined at step {step} as rank {}/{}", w.rank(), w.size());
    }
    let swaps = args.swap_transports.as_deref().unwrap_or_default();
    let every = args.steps / (swaps.len() + 1).max(1);
    let mut joined_at = Some(step);
    // when this worker saw the loss it is recovering from
    let mut lost_at: Option<Instant> = None;
    while step < args.steps {
        if every > 0 && step > 0 && step % every == 0 {
            if let Some(&to) = swaps.get(step / every - 1) {
                let epoch = w.swap_transport(to).await?;
                say!("step {step}: swapped to {} ({epoch})", w.transport_name());
            }
        }
        // by the rank at start (a recovery renumbers the workers)
        if args.exit.is_some_and(|(r, st, _)| r == rank && st == step) {
            let code = args.exit.expect("checked").2;
            say!("step {step}: exiting with status {code} as asked");
            std::process::exit(code);
        }
        if args.hang.is_some_and(|(r, st)| r == rank && st == step) {
            say!("step {step}: hanging as asked");
            std::future::pending::<()>().await;
        }
        // the step's collectives, any of which may find a worker lost:
        // the digest of the model after it, or None to stop
        let res: anyhow::Result<Option<u64>> = async {
            if args.follow_config
                && joined_at != Some(step)
                && w.resize_from_config().await?.changed
            {
                step = w
                    .sync_state(step as u64, &mut [("model", &mut model)])
                    .await? as usize;
                say!(
                    "step {step}: resized to {} workers, now rank {}",
                    w.size(),
                    w.rank()
                );
            }
            if let Some(path) = args.stop_file.as_ref().filter(|_| step % 10 == 0) {
                if stop_agreed(&w, path).await? {
                    return Ok(None);
                }
            }
            Ok(Some(train(&w, step, &mut model).await?))
        }
        .await;
        joined_at = None;
        let digest = match res {
            Ok(Some(d)) => d,
            Ok(None) => break,
            Err(e) if args.recover && lost_peer(&e) => {
                // with the cause: where the lost worker ran
                say!("step {step}: {e:#}; recovering");
                lost_at.get_or_insert_with(Instant::now);
                step = recover(&mut w, step, &mut model).await?;
                // the step that failed runs again
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Some(t) = lost_at.take() {
            say!(
                "step {step}: the first good step since the loss, {:.0} ms after it; \
                 model {digest:016x} at rank {}/{}",
                t.elapsed().as_secs_f64() * 1e3,
                w.rank(),
                w.size()
            );
        }
        if step % 10 == 0 || step + 1 == args.steps {
            say!("step {step} ok");
        }
        step += 1;
        if args.step_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(args.step_ms)).await;
        }
    }
    w.session().barrier("selftest/end").await?;
    w.close(std::time::Duration::from_secs(10)).await;
    say!("done");
    Ok(())
}

/// Whether `e` comes of a lost worker (an op's, or a resize's or state
/// sync's collective's): a recovery goes on without it.
fn lost_peer(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<CollectiveError>(),
            Some(CollectiveError::PeerLost { .. })
        )
    })
}

/// After an op of `step` failed for a lost peer: recovers
/// ([`Worker::recover`]), brings every survivor to one state (again after
/// another recovery if a worker is lost meanwhile), and says so; returns
/// the step to go on from.
async fn recover(w: &mut Worker, step: usize, model: &mut [f32]) -> anyhow::Result<usize> {
    loop {
        let t0 = Instant::now();
        let r = w.recover().await?;
        let lost: Vec<String> = r.lost.iter().map(|(r, p)| format!("{r} ({p})")).collect();
        let step = match w
            .sync_state(step as u64, &mut [("model", &mut *model)])
            .await
        {
            Ok(s) => s as usize,
            Err(e) => {
                let e = anyhow::Error::new(e);
                if !lost_peer(&e) {
                    return Err(e);
                }
                say!("step {step}: {e:#} after recovering; recovering again");
                continue;
            }
        };
        say!(
            "step {step}: recovered in {:.0} ms: lost {}; now rank {}/{} at version {}",
            t0.elapsed().as_secs_f64() * 1e3,
            lost.join(", "),
            w.rank(),
            w.size(),
            r.version
        );
        return Ok(step);
    }
}

/// Whether the workers stop now: any of them sees `path` (a collective,
/// so that all stop at the same step).
async fn stop_agreed(w: &Worker, path: &std::path::Path) -> Result<bool, CollectiveError> {
    let mine = [f32::from(u8::from(path.exists()))];
    let any = w
        .session()
        .allreduce("selftest/stop", &mine, ReduceOp::Max)
        .await?;
    Ok(any.first().is_some_and(|&v| v > 0.0))
}

/// One step: allreduce exact gradients, check the sum, add it to the
/// model, and check that every worker's model is the same; returns the
/// model's digest. The model changes only once the step succeeded, so
/// that a step that failed leaves the state a recovery syncs consistent
/// (the step and the model before it).
async fn train(w: &Worker, step: usize, model: &mut [f32]) -> Result<u64, CollectiveError> {
    let s = w.session();
    let (rank, n) = (w.rank(), w.size());
    let grad: Vec<f32> = (0..model.len())
        .map(|i| ((rank + i + step) % 5) as f32)
        .collect();
    let sum = s.allreduce("grad", &grad, ReduceOp::Sum).await?;
    for (i, v) in sum.iter().enumerate() {
        let want: f32 = (0..n).map(|r| ((r + i + step) % 5) as f32).sum();
        if *v != want {
            // a wrong value is never recovered from
            eprintln!("kungfu-selftest: step {step}: element {i} is {v}, expected {want}");
            std::process::exit(4);
        }
    }
    // integer-valued, exact; wraps before 2^24 so it stays exact
    let next: Vec<f32> = model
        .iter()
        .zip(&sum)
        .map(|(m, g)| (m + g) % 4096.0)
        .collect();
    let bytes: Vec<u8> = next.iter().flat_map(|m| m.to_le_bytes()).collect();
    let digest = kungfu_topology::fnv1a64(kungfu_topology::Digest::EMPTY.0, &bytes);
    if !s.consensus("model", &digest.to_le_bytes()).await? {
        eprintln!("kungfu-selftest: step {step}: the workers' models differ");
        std::process::exit(4);
    }
    model.copy_from_slice(&next);
    Ok(digest)
}

fn main() {
    let args = Args::parse();
    if let Some(shell) = args.completions {
        kungfu_tools::cli::print_completions::<Args>(shell);
        return;
    }
    STAMP.store(args.stamp, Ordering::Relaxed);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    // On a runtime worker, beside the ops' tasks (see kungfu-bench).
    let res = rt.block_on(async {
        tokio::spawn(run(args))
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("self-test task failed: {e}")))
    });
    if let Err(e) = res {
        eprintln!("kungfu-selftest: error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(line: &str) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("kungfu-selftest").chain(line.split_whitespace()))
    }

    #[test]
    fn selftest_cli_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn selftest_cli_reads_every_flag() {
        let a = parse("").unwrap();
        assert_eq!((a.steps, a.size, a.exit, a.hang), (10, 1 << 16, None, None));
        assert_eq!(a.step_ms, 0);
        assert!(!(a.check_port || a.recover || a.follow_config || a.stamp));
        assert!(a.wait_for.is_none() && a.stop_file.is_none() && a.swap_transports.is_none());
        let a = parse(
            "--steps 60 --size 1024 --exit 2:20:-3 --hang 1:5 --check-port --wait-for w \
             --swap-transports quic,tcp --recover --follow-config --stop-file s --stamp \
             --step-ms 30",
        )
        .unwrap();
        assert_eq!((a.steps, a.size, a.step_ms), (60, 1024, 30));
        assert_eq!((a.exit, a.hang), (Some((2, 20, -3)), Some((1, 5))));
        assert!(a.check_port && a.recover && a.follow_config && a.stamp);
        assert_eq!(a.wait_for.as_deref(), Some("w".as_ref()));
        assert_eq!(a.stop_file.as_deref(), Some("s".as_ref()));
        assert_eq!(
            a.swap_transports,
            Some(vec![TransportKind::Quic, TransportKind::Tcp])
        );
    }

    #[test]
    fn selftest_cli_refuses_bad_lines() {
        for (line, want) in [
            ("--exit 2:20", "expected RANK:STEP:CODE"),
            ("--hang 1:x", "expected RANK:STEP"),
            ("--steps many", "invalid value 'many' for '--steps <N>'"),
            ("--swap-transports tcp,smoke", "\"smoke\""),
            ("--recovr", "unexpected argument '--recovr'"),
        ] {
            let e = parse(line).map(|_| ()).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{line}");
            assert!(e.to_string().contains(want), "{line}: {e}");
        }
    }
}
