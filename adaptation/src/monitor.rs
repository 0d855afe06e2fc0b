//! Monitors: estimators over the metrics a training loop already has, so
//! that monitoring costs little (a couple of scalars per step, reduced
//! together with the gradients or in one small allreduce).

use kungfu_collectives::{CollectiveError, ReduceOp, Session};
use kungfu_transport::Transport;

/// An exponential moving average: `v <- v + alpha (x - v)`; the first
/// sample is taken as is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ema {
    alpha: f64,
    value: Option<f64>,
}

impl Ema {
    /// `alpha` in (0, 1]: the weight of each new sample.
    pub fn new(alpha: f64) -> Ema {
        assert!(
            alpha > 0.0 && alpha <= 1.0,
            "EMA weight {alpha} outside (0, 1]"
        );
        Ema { alpha, value: None }
    }

    /// Adds a sample (non-finite samples are ignored) and returns the average.
    pub fn update(&mut self, x: f64) -> Option<f64> {
        if x.is_finite() {
            self.value = Some(match self.value {
                None => x,
                Some(v) => v + self.alpha * (x - v),
            });
        }
        self.value
    }

    pub fn value(&self) -> Option<f64> {
        self.value
    }
}

/// The gradient noise scale of McCandlish et al., "An Empirical Model of
/// Large-Batch Training" (2018), from two gradient norms that data-parallel
/// training has for free: each worker's gradient over its own batch of
/// `b_small` examples, and the allreduced mean over all `b_big` examples.
///
/// With `E|G_B|^2 = |G|^2 + tr(S) / B`, two batch sizes give the unbiased
/// estimates
/// `|G|^2 = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)` and
/// `tr(S) = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)`,
/// each smoothed by an EMA (the paper's advice: the ratio of noisy
/// estimates is biased, the ratio of smoothed ones much less), and
/// `B_simple = tr(S) / |G|^2`.
#[derive(Clone, Debug)]
pub struct NoiseScale {
    g2: Ema,
    trace: Ema,
}

/// One step's estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NoiseEstimate {
    /// Smoothed `|G|^2`.
    pub g2: f64,
    /// Smoothed `tr(Sigma)`.
    pub trace: f64,
    /// `tr(Sigma) / |G|^2` from the smoothed values (None while `|G|^2` is
    /// not positive).
    pub b_simple: Option<f64>,
}

impl NoiseScale {
    /// `alpha`: EMA weight of each step (the paper uses about 0.01-0.1).
    pub fn new(alpha: f64) -> NoiseScale {
        NoiseScale {
            g2: Ema::new(alpha),
            trace: Ema::new(alpha),
        }
    }

    /// Feeds one step: `small_sq` the squared norm of a worker's gradient
    /// (best: the mean of it over workers), `big_sq` that of the averaged
    /// gradient, over batches of `b_small` and `b_big > b_small` examples.
    /// `None` if the batch sizes cannot give an estimate.
    pub fn update(
        &mut self,
        small_sq: f64,
        big_sq: f64,
        b_small: f64,
        b_big: f64,
    ) -> Option<NoiseEstimate> {
        if !(b_small > 0.0 && b_big > b_small) {
            return None;
        }
        let g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small);
        let trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big);
        let g2 = self.g2.update(g2)?;
        let trace = self.trace.update(trace)?;
        Some(NoiseEstimate {
            g2,
            trace,
            b_simple: (g2 > 0.0).then(|| trace / g2),
        })
    }

    pub fn estimate(&self) -> Option<NoiseEstimate> {
        let (g2, trace) = (self.g2.value()?, self.trace.value()?);
        Some(NoiseEstimate {
            g2,
            trace,
            b_simple: (g2 > 0.0).then(|| trace / g2),
        })
    }
}

/// The variance of the workers' gradients around their mean,
/// `mean_i |g_i - g|^2 = mean_i |g_i|^2 - |g|^2`, from the mean of the
/// workers' squared norms and the squared norm of the mean gradient
/// (clamped at 0 against rounding).
pub fn gradient_variance(mean_local_sq: f64, mean_grad_sq: f64) -> f64 {
    (mean_local_sq - mean_grad_sq).max(0.0)
}

/// `sum x^2` of a gradient, vectorised for this CPU (32 f32 lanes per
/// block of 4096, blocks summed in f64: about memory speed).
pub fn sq_norm(g: &[f32]) -> f64 {
    kungfu_collectives::sq_norm_f32(g)
}

/// [`sq_norm`] of f32 values in bytes (any alignment; a partial trailing
/// element is ignored).
pub fn sq_norm_bytes(b: &[u8]) -> f64 {
    kungfu_collectives::sq_norm_bytes(b)
}

/// The gradient monitors of a data-parallel step, riding on its gradient
/// allreduce: no collective of their own. The caller's buffer holds the
/// gradient plus one spare element at the end. On a monitored step the
/// allreduce is [`Session::allreduce_sum_with_norms`]: on the host fast
/// path its reduction sums the squares of each worker's gradient and of
/// the summed one in the same pass as the sum; elsewhere the spare
/// carries this worker's squared norm through the same allreduce and the
/// summed gradient's is taken after it. Either way every worker gets the
/// mean of the local norms and the norm of the summed gradient: the
/// inputs of the noise scale and of the gradient variance. Monitoring
/// every `every`-th step bounds their cost (`kungfu-bench --monitor`
/// reports it).
#[derive(Clone, Debug)]
pub struct GradientMonitor {
    noise: NoiseScale,
    every: u64,
    step: u64,
    /// The latest noise estimate.
    pub noise_estimate: Option<NoiseEstimate>,
    /// The latest variance of the workers' gradients around their mean.
    pub variance: Option<f64>,
}

impl GradientMonitor {
    /// EMA weight `alpha`; monitor every `every`-th step (0: never).
    pub fn new(alpha: f64, every: u64) -> GradientMonitor {
        GradientMonitor {
            noise: NoiseScale::new(alpha),
            every,
            step: 0,
            noise_estimate: None,
            variance: None,
        }
    }

    /// Sums `buf[..len - 1]` (each worker's gradient over `b_small`
    /// examples) across workers in place, under `name`; the last element
    /// is the monitors' (its value on return is unspecified). Returns
    /// whether this step was monitored (then `noise_estimate` and
    /// `variance` are fresh). A collective, like the allreduce it is.
    pub async fn allreduce_sum<T: Transport>(
        &mut self,
        session: &Session<T>,
        name: &str,
        buf: &mut [f32],
        b_small: f64,
    ) -> Result<bool, CollectiveError> {
        let Some(slot) = buf.last_mut() else {
            return Err(CollectiveError::InvalidArgument {
                name: name.into(),
                reason: "the buffer needs the gradient and one spare element".into(),
            });
        };
        let monitored = self.every > 0 && self.step.is_multiple_of(self.every);
        self.step += 1;
        if !monitored {
            *slot = 0.0;
            session.allreduce_in_place(name, buf, ReduceOp::Sum).await?;
            return Ok(false);
        }
        let n = session.size() as f64;
        let q = session.allreduce_sum_with_norms(name, buf).await?;
        let (mean_small, big) = (q.inputs / n, q.result / (n * n));
        self.variance = Some(gradient_variance(mean_small, big));
        if let Some(e) = self.noise.update(mean_small, big, b_small, b_small * n) {
            self.noise_estimate = Some(e);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ema_follows_and_skips_non_finite() {
        let mut e = Ema::new(0.5);
        assert_eq!(e.update(4.0), Some(4.0));
        assert_eq!(e.update(f64::NAN), Some(4.0));
        assert_eq!(e.update(2.0), Some(3.0));
        assert_eq!(e.value(), Some(3.0));
    }

    /// Synthetic gradients with a known true gradient and noise: the
    /// estimator recovers |G|^2 and tr(Sigma), so B_simple, within a few
    /// percent.
    #[test]
    fn noise_scale_recovers_a_known_model() {
        // per-example gradients g = G + noise, noise ~ N(0, s^2 I_d)
        let d = 64usize;
        let s = 2.0f64;
        let true_g: Vec<f64> = (0..d)
            .map(|i| if i % 2 == 0 { 0.5 } else { -0.25 })
            .collect();
        let g2: f64 = true_g.iter().map(|x| x * x).sum();
        let trace = s * s * d as f64;
        let (workers, b) = (4usize, 32usize);
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut normal = move || {
            // Box-Muller from a xorshift
            let mut u = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 11) as f64 / (1u64 << 53) as f64
            };
            let (u1, u2) = (u().max(1e-12), u());
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        };
        let mut ns = NoiseScale::new(0.02);
        let mut last = None;
        for _ in 0..3000 {
            let mut locals = vec![vec![0.0f64; d]; workers];
            for l in locals.iter_mut() {
                for _ in 0..b {
                    for (k, x) in l.iter_mut().enumerate() {
                        *x += (true_g[k] + s * normal()) / b as f64;
                    }
                }
            }
            let mean: Vec<f64> = (0..d)
                .map(|k| locals.iter().map(|l| l[k]).sum::<f64>() / workers as f64)
                .collect();
            let small_sq = locals
                .iter()
                .map(|l| l.iter().map(|x| x * x).sum::<f64>())
                .sum::<f64>()
                / workers as f64;
            let big_sq: f64 = mean.iter().map(|x| x * x).sum();
            last = ns.update(small_sq, big_sq, b as f64, (b * workers) as f64);
        }
        let est = last.unwrap();
        let want = trace / g2;
        let got = est.b_simple.unwrap();
        assert!(
            (got - want).abs() / want < 0.15,
            "B_simple {got}, true {want}"
        );
        assert!(
            (est.trace - trace).abs() / trace < 0.1,
            "trace {}",
            est.trace
        );
    }

    #[test]
    fn degenerate_inputs_give_no_estimate() {
        let mut ns = NoiseScale::new(0.1);
        assert!(ns.update(1.0, 1.0, 8.0, 8.0).is_none());
        assert!(ns.update(1.0, 1.0, 0.0, 8.0).is_none());
        assert_eq!(gradient_variance(1.0, 1.5), 0.0);
        assert_eq!(sq_norm(&[3.0, 4.0]), 25.0);
        let v: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5).collect();
        let want: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((sq_norm(&v) - want).abs() < 1e-6 * want);
        let bytes: Vec<u8> = std::iter::once(0u8)
            .chain(v.iter().flat_map(|x| x.to_le_bytes()))
            .collect();
        assert!(
            (sq_norm_bytes(&bytes[1..]) - want).abs() < 1e-6 * want,
            "unaligned"
        );
    }
}
