"""The monitors of the gradient exchange: the gradient noise scale and the
gradient variance, from two scalars that travel with the gradients.

A worker adds the squared norm of its own gradient to the gradients it
allreduces (one more element in a bucket it sends anyway), so after the
sum every worker holds both the sum of the gradients and the sum of the
workers' squared norms, with no extra round:

* `small_sq`: the workers' mean squared norm of a gradient over
  `b_small` examples (one worker's batch);
* `big_sq`: the squared norm of the mean gradient, over `b_big` examples
  (the cluster's batch).

From them, `B_simple` (McCandlish et al., 2018, the noise scale KungFu's
`MonitorGradientNoiseScaleOptimizer` reports) and the variance of the
workers' gradients around their mean (`kf_gradient_variance`).

`latest` holds each monitor's last value on this worker: `PolicyRunner`
reads it into `ctx.metrics` after every step.
"""

import itertools
import math

import kungfu

latest = {"noise_scale": math.nan, "gradient_variance": math.nan}
_numbers = itertools.count()


class GradientMonitor:
    """Feeds the noise scale (`noise=True`) and the gradient variance
    (`variance=True`) from one step's scalars, every `interval` steps."""

    def __init__(self, noise=True, variance=True, interval=1, alpha=0.1, name=None):
        if int(interval) < 1:
            raise ValueError(f"kungfu: monitor interval {interval}: at least 1")
        self.noise, self.variance, self.interval = bool(noise), bool(variance), int(interval)
        self.scale = kungfu.NoiseScale(name or f"torch.noise_scale.{next(_numbers)}", alpha)
        self.steps = 0
        self.noise_scale = math.nan
        self.gradient_variance = math.nan

    def due(self) -> bool:
        """Whether this step is monitored (then its exchange carries the
        squared norm)."""
        return (self.noise or self.variance) and self.steps % self.interval == 0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> None:
        """One monitored step: `small_sq` the mean over the workers of
        their gradients' squared norms, `big_sq` that of the mean
        gradient."""
        if self.noise and b_big > b_small > 0:
            self.noise_scale = self.scale.update(small_sq, big_sq, b_small, b_big)
            latest["noise_scale"] = self.noise_scale
        if self.variance:
            self.gradient_variance = kungfu.gradient_variance(small_sq, big_sq)
            latest["gradient_variance"] = self.gradient_variance

    def tick(self) -> None:
        self.steps += 1
