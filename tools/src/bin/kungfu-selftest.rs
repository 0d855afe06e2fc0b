//! `kungfu-selftest`: a small stand-in for a training loop, to check a
//! setup end to end and to test the launcher's failure handling.
//!
//! ```text
//! kungfu-run -np 4 kungfu-selftest [--steps N] [--size ELEMS]
//!            [--exit RANK:STEP:CODE] [--hang RANK:STEP]
//!            [--check-port] [--wait-for PATH] [--swap-transports T,T,...]
//!            [--recover] [--follow-config] [--stop-file PATH] [--stamp]
//! ```
//! Each step allreduces a gradient-sized buffer of exact values and checks
//! the result. `--exit` makes one rank (its rank at start) exit with CODE at STEP; `--hang`
//! makes one rank stop taking part (the others must fail by their
//! deadline). Every rank prints its pid (and its address) first, so tests
//! can kill one or throw bytes at its port.
//!
//! `--recover` keeps training when a worker is lost: the survivors call
//! [`Worker::recover`], then [`Worker::sync_state`], and go on from the
//! step they agree on (run it under `kungfu-run --on-failure shrink`).
//! Every step adds the (exact) sum to a model and checks with a consensus
//! that every worker's model is the same. `--follow-config` calls
//! [`Worker::resize_from_config`] every step, so that workers that the
//! launcher starts (`--on-failure replace`, `-w`) join. After a recovery,
//! the first step that succeeds says how long after the loss it came, with
//! the model's digest, so that a test can compare the survivors' models
//! itself.
//!
//! `--stop-file PATH`: every 10 steps the workers agree (an allreduce)
//! whether any of them sees PATH, and all stop at that step; a test ends an
//! endless run cleanly with it. `--stamp` starts every line with the unix
//! time in milliseconds and the pid (`1712345678901 pid 4242: step 10
//! ok`), for a test that times what the workers report and tells workers
//! apart whose launcher labels collide (a replacement gets its rank's
//! label).
//!
//! `--swap-transports quic,fabric,tcp` swaps the transport to each in
//! turn at evenly spaced steps (a collective: every rank does), checking
//! every step before and after.
//!
//! For the launcher's port tests: `--check-port` fails unless this
//! worker's address is already bound when it starts (kungfu-run binds it
//! and passes the socket down; a port the launcher had released could be
//! taken by any process). `--wait-for PATH` holds every worker, connected,
//! until PATH exists (at most two minutes), so that many jobs can be
//! alive at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use kungfu::{Discovery, Worker, WorkerEnv};
use kungfu_collectives::{CollectiveError, ReduceOp};
use kungfu_topology::Rank;

struct Args {
    steps: usize,
    size: usize,
    exit: Option<(usize, usize, i32)>,
    hang: Option<(usize, usize)>,
    check_port: bool,
    wait_for: Option<std::path::PathBuf>,
    swaps: Vec<kungfu_transport::any::TransportKind>,
    recover: bool,
    follow: bool,
    stop_file: Option<std::path::PathBuf>,
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

fn parse(a: &[String]) -> anyhow::Result<Args> {
    let mut r = Args {
        steps: 10,
        size: 1 << 16,
        exit: None,
        hang: None,
        check_port: false,
        wait_for: None,
        swaps: Vec::new(),
        recover: false,
        follow: false,
        stop_file: None,
    };
    let mut stamp = false;
    let mut i = 0;
    while i < a.len() {
        let flag = match a[i].as_str() {
            "--check-port" => Some(&mut r.check_port),
            "--recover" => Some(&mut r.recover),
            "--follow-config" => Some(&mut r.follow),
            "--stamp" => Some(&mut stamp),
            _ => None,
        };
        if let Some(f) = flag {
            *f = true;
            i += 1;
            continue;
        }
        let v = a
            .get(i + 1)
            .with_context(|| format!("{} needs a value", a[i]))?;
        let nums = |v: &str| -> anyhow::Result<Vec<i64>> {
            v.split(':')
                .map(|x| x.parse::<i64>().context("expected numbers"))
                .collect()
        };
        match a[i].as_str() {
            "--steps" => r.steps = v.parse()?,
            "--size" => r.size = v.parse()?,
            "--exit" => match nums(v)?[..] {
                [rank, step, code] => r.exit = Some((rank as usize, step as usize, code as i32)),
                _ => bail!("--exit RANK:STEP:CODE"),
            },
            "--hang" => match nums(v)?[..] {
                [rank, step] => r.hang = Some((rank as usize, step as usize)),
                _ => bail!("--hang RANK:STEP"),
            },
            "--wait-for" => r.wait_for = Some(v.into()),
            "--stop-file" => r.stop_file = Some(v.into()),
            "--swap-transports" => {
                r.swaps = v
                    .split(',')
                    .map(|t| t.parse().map_err(anyhow::Error::msg))
                    .collect::<anyhow::Result<_>>()?
            }
            f => bail!("unknown option {f:?}"),
        }
        i += 2;
    }
    STAMP.store(stamp, Ordering::Relaxed);
    Ok(r)
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
    let every = args.steps / (args.swaps.len() + 1).max(1);
    let mut joined_at = Some(step);
    // when this worker saw the loss it is recovering from
    let mut lost_at: Option<Instant> = None;
    while step < args.steps {
        if every > 0 && step > 0 && step % every == 0 {
            if let Some(&to) = args.swaps.get(step / every - 1) {
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
            if args.follow && joined_at != Some(step) && w.resize_from_config().await?.changed {
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
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kungfu-selftest: {e:#}");
            std::process::exit(2);
        }
    };
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
