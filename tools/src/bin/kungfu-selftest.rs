//! `kungfu-selftest`: a small stand-in for a training loop, to check a
//! setup end to end and to test the launcher's failure handling.
//!
//! ```text
//! kungfu-run -np 4 kungfu-selftest [--steps N] [--size ELEMS]
//!            [--exit RANK:STEP:CODE] [--hang RANK:STEP]
//! ```
//! Each step allreduces a gradient-sized buffer of exact values and checks
//! the result. `--exit` makes one rank exit with CODE at STEP; `--hang`
//! makes one rank stop taking part (the others must fail by their
//! deadline). Every rank prints its pid first, so tests can kill one.

use anyhow::{bail, Context};
use kungfu::{Worker, WorkerEnv};
use kungfu_collectives::ReduceOp;

struct Args {
    steps: usize,
    size: usize,
    exit: Option<(usize, usize, i32)>,
    hang: Option<(usize, usize)>,
}

fn parse(a: &[String]) -> anyhow::Result<Args> {
    let mut r = Args {
        steps: 10,
        size: 1 << 16,
        exit: None,
        hang: None,
    };
    let mut i = 0;
    while i < a.len() {
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
            f => bail!("unknown option {f:?}"),
        }
        i += 2;
    }
    Ok(r)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let w = Worker::start(WorkerEnv::from_env()?).await?;
    let s = w.session();
    let (rank, n) = (w.rank(), w.size());
    println!(
        "pid {} rank {rank}/{n} local {}/{} launcher {:?}",
        std::process::id(),
        w.local_rank(),
        w.local_size(),
        w.env().launcher
    );
    for step in 0..args.steps {
        if args.exit.is_some_and(|(r, st, _)| r == rank && st == step) {
            let code = args.exit.expect("checked").2;
            println!("step {step}: exiting with status {code} as asked");
            std::process::exit(code);
        }
        if args.hang.is_some_and(|(r, st)| r == rank && st == step) {
            println!("step {step}: hanging as asked");
            std::future::pending::<()>().await;
        }
        let grad: Vec<f32> = (0..args.size)
            .map(|i| ((rank + i + step) % 5) as f32)
            .collect();
        let sum = s.allreduce("grad", &grad, ReduceOp::Sum).await?;
        for (i, v) in sum.iter().enumerate() {
            let want: f32 = (0..n).map(|r| ((r + i + step) % 5) as f32).sum();
            if *v != want {
                bail!("step {step}: element {i} is {v}, expected {want}");
            }
        }
        if step % 10 == 0 || step + 1 == args.steps {
            println!("step {step} ok");
        }
    }
    s.barrier("selftest/end").await?;
    w.close(std::time::Duration::from_secs(10)).await;
    println!("done");
    Ok(())
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
