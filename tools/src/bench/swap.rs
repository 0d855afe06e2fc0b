//! `kungfu-bench swap`: the latency of a strategy swap.

use std::time::{Duration, Instant};

use kungfu::{Worker, WorkerEnv};
use kungfu_adaptation::{Action, Adapter};
use kungfu_collectives::ReduceOp;
use kungfu_topology::Strategy;

/// `kungfu-bench swap`: rank 0 proposes a strategy (alternately RING and
/// STAR) at every agreement point; the time of an agreement point that
/// swaps (agreement, then the consistency barrier: drain, consensus on the
/// new strategy's digest, epoch advance), on the slowest rank, is the swap
/// latency.
pub(super) async fn swap_bench(iters: usize, warmup: usize) -> anyhow::Result<bool> {
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
            w.transport_name()
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
