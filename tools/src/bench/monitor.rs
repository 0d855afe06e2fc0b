//! `--monitor K`: what the gradient monitors add to an allreduce.

use std::time::Instant;

use kungfu_adaptation::GradientMonitor;
use kungfu_collectives::{OpSpec, ReduceOp, Session};
use kungfu_transport::any::AnyTransport;

/// Times `iters` ops plain, then `iters` with the monitors a trainer runs
/// on its gradient allreduce every `every`-th op (`GradientMonitor`: the
/// squared norms of each worker's gradient and of the sum, summed in the
/// reduction or carried by a spare element, and the noise-scale update).
/// Returns (plain, monitored) seconds per op on the slowest rank, and the
/// last B_simple.
pub(super) async fn monitor_overhead(
    s: &Session<AnyTransport>,
    spec: OpSpec,
    input: &[u8],
    iters: usize,
    every: usize,
) -> anyhow::Result<MonitorCost> {
    let name = "bench/monitored";
    let _ = spec;
    // the trainer's buffer: the gradient and the monitors' spare element
    let mut grad: Vec<f32> = input
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    grad.push(0.0);
    let fresh = grad.clone();
    // the same loop twice: monitors off (every 0), then on every K-th op;
    // each op starts from the same input (the allreduce is in place)
    // Alternate rounds without and with the monitors (the machine's noise
    // hits both alike) and compare medians; a round is a whole number of
    // monitoring periods.
    let per_round = iters.div_ceil(ROUNDS).div_ceil(every) * every;
    let (mut plain, mut monitored) = (Vec::new(), Vec::new());
    let mut mon = GradientMonitor::new(0.1, every as u64);
    let mut off = GradientMonitor::new(0.1, 0);
    for _ in 0..ROUNDS {
        plain.push(monitored_loop(s, name, &mut grad, &fresh, per_round, &mut off).await?);
        monitored.push(monitored_loop(s, name, &mut grad, &fresh, per_round, &mut mon).await?);
    }
    // the slowest rank's time of each round
    let times = s
        .allreduce(
            "bench/monitor-times",
            &[plain.as_slice(), monitored.as_slice()].concat(),
            ReduceOp::Max,
        )
        .await?;
    let (plain, monitored) = times.split_at(ROUNDS);
    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v
    };
    // overhead of each round against the plain round before it
    let ratios = sorted(
        &plain
            .iter()
            .zip(monitored)
            .map(|(p, m)| m / p - 1.0)
            .collect::<Vec<_>>(),
    );
    let q = |f: f64| ratios[((ratios.len() - 1) as f64 * f).round() as usize];
    let b_simple = mon.noise_estimate.and_then(|e| e.b_simple);
    Ok(MonitorCost {
        plain: sorted(plain)[ROUNDS / 2],
        monitored: sorted(monitored)[ROUNDS / 2],
        overhead: (q(0.25), q(0.5), q(0.75)),
        b_simple,
    })
}

/// Rounds of ops without and with the monitors, each round timed on the
/// slowest rank.
pub(super) const ROUNDS: usize = 15;

/// What the monitors cost at one size.
pub(super) struct MonitorCost {
    /// Median seconds per op without and with them.
    pub(super) plain: f64,
    pub(super) monitored: f64,
    /// Quartiles of the per-round overhead (fractions).
    pub(super) overhead: (f64, f64, f64),
    pub(super) b_simple: Option<f64>,
}

/// `iters` allreduces of `grad` (reset to `fresh` before each, as the
/// op is in place) through `mon`; seconds per op.
async fn monitored_loop(
    s: &Session<AnyTransport>,
    name: &str,
    grad: &mut [f32],
    fresh: &[f32],
    iters: usize,
    mon: &mut GradientMonitor,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    for _ in 0..iters {
        grad.copy_from_slice(fresh);
        mon.allreduce_sum(s, name, grad, 1.0).await?;
    }
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}
