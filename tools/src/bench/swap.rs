//! `kungfu-bench swap` and `swap-transport`: the latency of a strategy
//! swap and of a transport swap.

use std::time::{Duration, Instant};

use kungfu::{Worker, WorkerEnv};
use kungfu_adaptation::{Action, Adapter};
use kungfu_collectives::ReduceOp;
use kungfu_topology::Strategy;
use kungfu_transport::any::TransportKind;

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

/// `kungfu-bench swap-transport`: cycles through `kinds` (from the one in
/// use), swapping to the next at every step; the time of each swap
/// (agreement over the old transport, connecting the new one, agreement
/// that all connected, switch), on the slowest rank, is its latency. After
/// every swap an allreduce of `bytes` (int32, each rank's values from its
/// rank and the step) runs on the new transport and is checked exactly.
pub(super) async fn transport_swap_bench(
    kinds: &[TransportKind],
    iters: usize,
    warmup: usize,
    bytes: usize,
) -> anyhow::Result<bool> {
    let w = Worker::start(WorkerEnv::from_env()?).await?;
    let (me, n) = (w.rank(), w.size());
    let start = kinds.iter().position(|&k| k == w.transport_kind());
    let first = w.transport_name();
    let len = (bytes / 4).max(1);
    let mut times = Vec::with_capacity(iters);
    let mut names = Vec::with_capacity(iters);
    let mut wrong = 0u64;
    for i in 0..warmup + iters {
        let next = kinds[start.map_or(i, |s| s + 1 + i) % kinds.len()];
        let t = Instant::now();
        w.swap_transport(next).await?;
        let dt = t.elapsed().as_secs_f64();
        let s = w.session();
        let x: Vec<i32> = (0..len).map(|j| value(me, i, j)).collect();
        let got = s.allreduce("bench/after-swap", &x, ReduceOp::Sum).await?;
        let want = |j| (0..n).map(|r| value(r, i, j)).sum::<i32>();
        wrong += got
            .iter()
            .enumerate()
            .filter(|&(j, &g)| g != want(j))
            .count() as u64;
        if i >= warmup {
            times.push(dt);
            names.push(w.transport_name());
        }
    }
    let s = w.session();
    let slowest = s
        .allreduce("bench/swap-times", &times, ReduceOp::Max)
        .await?;
    let wrong = s
        .allreduce("bench/swap-wrong", &[wrong], ReduceOp::Sum)
        .await?[0];
    if me == 0 {
        println!(
            "# kungfu-bench swap-transport: {n} ranks, {iters} swaps (after {warmup} untimed) \
             through {}, from {first}; a checked allreduce of {} bytes after each",
            kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(","),
            len * 4
        );
        println!("# swap latency (agreement, connect, agreement, switch; slowest rank), by the transport swapped to:");
        println!(
            "{:>28} {:>6} {:>10} {:>10} {:>10}",
            "to", "swaps", "mean(ms)", "median(ms)", "max(ms)"
        );
        let mut seen: Vec<&String> = Vec::new();
        for name in &names {
            if seen.contains(&name) {
                continue;
            }
            seen.push(name);
            let mut t: Vec<f64> = names
                .iter()
                .zip(&slowest)
                .filter(|(m, _)| *m == name)
                .map(|(_, &t)| t * 1e3)
                .collect();
            t.sort_by(f64::total_cmp);
            let mean = t.iter().sum::<f64>() / t.len() as f64;
            println!(
                "{name:>28} {:>6} {mean:>10.2} {:>10.2} {:>10.2}",
                t.len(),
                t[t.len() / 2],
                t[t.len() - 1]
            );
        }
        println!(
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        );
    }
    s.barrier("bench/end").await?;
    w.close(Duration::from_secs(10)).await;
    Ok(wrong == 0)
}

/// Rank `r`'s element `j` at step `i`: small enough that no sum overflows.
fn value(r: usize, i: usize, j: usize) -> i32 {
    ((r * 7 + i * 3 + j) % 1000) as i32
}
