"""KungFu's example policy in PyTorch: the batch size grows with the
gradient noise scale, which is monitored inside the gradient exchange.

    kungfu-run -np 2 python examples/torch/adaptive_batch.py [--epochs N]

The task is generated (no download): 20 features, the class is whether
the first five sum to more than zero. Every rank prints, per epoch, the
loss, the noise scale and the batch size the cluster agreed on.
"""

import argparse

import torch
import torch.nn.functional as F

import kungfu
from kungfu.torch.optimizers import MonitorGradientNoiseScaleOptimizer
from kungfu.torch.policy import BasePolicy, PolicyRunner


class NoiseScaleBatch(BasePolicy):
    """Doubles the batch while the noise scale exceeds the global batch."""

    def __init__(self, max_batch=256):
        self.max_batch = max_batch

    def after_epoch(self, ctx):
        noise, global_batch = ctx.metrics["noise_scale"], ctx.batch_size * ctx.size
        if noise > global_batch and 2 * ctx.batch_size <= self.max_batch:
            ctx.set_batch_size(2 * ctx.batch_size)


class Report(BasePolicy):
    def after_epoch(self, ctx):
        m = ctx.metrics
        print(f"rank {ctx.rank}: epoch {ctx.epoch} step {ctx.step}: loss {m['loss']:.3f}, "
              f"noise scale {m['noise_scale']:.1f}, batch {ctx.batch_size} x {ctx.size}",
              flush=True)


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
args = parser.parse_args()
torch.manual_seed(0)
x = torch.randn(8192, 20)
data = torch.utils.data.TensorDataset(x, (x[:, :5].sum(1) > 0).long())
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
opt = MonitorGradientNoiseScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), device_batch_size=16)
runner = PolicyRunner([NoiseScaleBatch(), Report()], model=model, optimizer=opt, dataset=data,
                      batch_size=16, epochs=args.epochs)
for xb, yb in runner:
    loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    runner.record("loss", loss.item())
print(f"rank {kungfu.rank()}: done after {runner.state.step} steps", flush=True)
