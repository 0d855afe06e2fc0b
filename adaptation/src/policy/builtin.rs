//! The policies this crate provides: adaptive batch size from the noise
//! scale, the fastest of some strategies, and two ways of resizing (at
//! given steps, and while scaling out pays).

use std::time::Duration;

use kungfu_topology::Strategy;

use super::{Action, Context, Policy};

/// Adaptive batch size from the gradient noise scale: every `every` steps,
/// proposes the noise scale (rounded to a multiple of the cluster size,
/// clamped to `[min, max]`) when it differs from the batch size in use by
/// more than `tolerance` (a fraction).
#[derive(Clone, Debug)]
pub struct AdaptiveBatchSize {
    pub min: u32,
    pub max: u32,
    pub every: u64,
    pub tolerance: f64,
}

impl Policy for AdaptiveBatchSize {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        let p = cx.progress;
        let Some(b) = p.metrics.noise_scale else {
            return Vec::new();
        };
        if self.every == 0 || !p.step.is_multiple_of(self.every) || !b.is_finite() {
            return Vec::new();
        }
        let n = cx.size.max(1) as f64;
        let target = ((b / n).round().max(1.0) * n).clamp(f64::from(self.min), f64::from(self.max));
        let cur = f64::from(p.batch_size.max(1));
        if (target - cur).abs() / cur > self.tolerance {
            vec![Action::SetBatchSize(target as u32)]
        } else {
            Vec::new()
        }
    }
}

/// Switches to the fastest of `candidates`: every `window` steps it
/// measures the rate of the strategy in use (bytes per second of op time
/// over the window, from [`Context::ops`]), proposes each candidate not yet
/// measured in turn, and then the fastest one when it beats the strategy
/// in use by more than `margin` (a fraction). Rates are re-measured while a
/// strategy is in use, so one that becomes slower (a slow link, a
/// straggler) is left.
#[derive(Clone, Debug)]
pub struct FastestStrategy {
    pub candidates: Vec<Strategy>,
    pub window: u64,
    pub margin: f64,
    rates: Vec<Option<f64>>,
    last: (u64, Duration),
}

impl FastestStrategy {
    pub fn new(candidates: Vec<Strategy>, window: u64, margin: f64) -> FastestStrategy {
        FastestStrategy {
            rates: vec![None; candidates.len()],
            candidates,
            window,
            margin,
            last: (0, Duration::ZERO),
        }
    }

    /// The rate measured for each candidate so far (bytes per second).
    pub fn rates(&self) -> Vec<(Strategy, Option<f64>)> {
        self.candidates
            .iter()
            .copied()
            .zip(self.rates.iter().copied())
            .collect()
    }
}

impl Policy for FastestStrategy {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        if self.window == 0 || !cx.progress.step.is_multiple_of(self.window) {
            return Vec::new();
        }
        let now = cx.op_totals();
        let (bytes, busy) = (
            now.0.saturating_sub(self.last.0),
            now.1.saturating_sub(self.last.1),
        );
        self.last = now;
        if busy.is_zero() || bytes == 0 {
            return Vec::new();
        }
        let rate = bytes as f64 / busy.as_secs_f64();
        let cur = self.candidates.iter().position(|&c| c == cx.strategy);
        if let Some(i) = cur {
            self.rates[i] = Some(rate);
        }
        if let Some(i) = self.rates.iter().position(Option::is_none) {
            return vec![Action::SetStrategy(self.candidates[i])];
        }
        let (best, best_rate) = self
            .rates
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, (*r)?)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("every candidate measured");
        if Some(best) != cur && best_rate > rate * (1.0 + self.margin) {
            vec![Action::SetStrategy(self.candidates[best])]
        } else {
            Vec::new()
        }
    }
}

/// Resizes the cluster at given steps: `(step, size)` pairs.
#[derive(Clone, Debug)]
pub struct ScaleSchedule {
    pub at: Vec<(u64, u32)>,
}

impl Policy for ScaleSchedule {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        self.at
            .iter()
            .find(|(step, _)| *step == cx.progress.step)
            .map(|&(_, n)| vec![Action::Resize(n)])
            .unwrap_or_default()
    }
}

/// Scales out while it pays: every `every` steps it records the cluster's
/// throughput ([`Metrics::throughput`]) at the current size; it proposes
/// `step_size` more workers (up to `max_size`) while each scale-out raised
/// the throughput by at least `min_gain` (a fraction), and when one did
/// not (a plateau), goes back to the previous size and stays.
///
/// [`Metrics::throughput`]: super::Metrics::throughput
#[derive(Clone, Debug)]
pub struct ScaleOnPlateau {
    pub every: u64,
    pub step_size: u32,
    pub max_size: u32,
    pub min_gain: f64,
    seen: Vec<(u32, f64)>,
    settled: bool,
}

impl ScaleOnPlateau {
    pub fn new(every: u64, step_size: u32, max_size: u32, min_gain: f64) -> ScaleOnPlateau {
        ScaleOnPlateau {
            every,
            step_size,
            max_size,
            min_gain,
            seen: Vec::new(),
            settled: false,
        }
    }

    /// Whether a plateau was found (no more proposals).
    pub fn settled(&self) -> bool {
        self.settled
    }
}

impl Policy for ScaleOnPlateau {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        let p = cx.progress;
        let Some(t) = p.metrics.throughput.filter(|t| t.is_finite()) else {
            return Vec::new();
        };
        if self.settled || self.every == 0 || !p.step.is_multiple_of(self.every) {
            return Vec::new();
        }
        let n = cx.size as u32;
        if let Some(&(prev_n, prev_t)) = self.seen.last() {
            if prev_n < n && t < prev_t * (1.0 + self.min_gain) {
                self.settled = true;
                return vec![Action::Resize(prev_n)];
            }
        }
        self.seen.push((n, t));
        let next = n.saturating_add(self.step_size);
        if next <= self.max_size && self.step_size > 0 {
            vec![Action::Resize(next)]
        } else {
            self.settled = true;
            Vec::new()
        }
    }
}
