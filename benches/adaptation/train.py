"""One training run of the adaptation experiments (run under kungfu-run by
benches/adaptation/run.py; every rank runs this).

The task is generated here, never downloaded: 16x16 images of a grating
in heavy noise, the class (of 10) being its orientation and frequency;
the model is a small CNN (two convolutions, one linear layer). Rank 0 writes one JSON
line per evaluation to --out: seconds since the start, step, epoch,
held-out accuracy, batch per worker, cluster size, the cluster's samples
per second since the last line, and the metrics the policies saw.

    --sync ssgd|sma|pair|adasgd   the optimizer of kungfu.torch.optimizers
    --batch B --lr LR             per worker, at the start
    --policy none|gns|peer-rates|scale
        gns         the batch grows (x2, up to --max-batch, the learning
                    rate by --lr-grow) while the noise scale exceeds the
                    cluster's batch (checked every --every steps)
        peer-rates  switches to --switch-to when a peer's rate stays below
                    --slow-frac of its usual rate for 3 steps (experiment 2)
        scale       grows the cluster 1 -> 2 -> 4 while each added worker
                    adds --min-gain of the throughput, else goes back one
                    size and stays (experiment 5; kungfu-run -w)
    --ddp [--monitor] [--width W] DDP on the "kungfu" backend instead, with
                                  the noise-scale comm hook (experiment 3),
                                  of the CNN with W times its channels
"""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import kungfu
import kungfu.torch  # noqa: F401  (the "kungfu" backend)
from kungfu.torch import optimizers as O
from kungfu.torch.policy import BasePolicy, PolicyRunner

CLASSES, SIDE = 10, 16


def gratings(n, seed, noise=0.8):
    """n images and labels: a sinusoidal grating in heavy noise, the class
    (of 10) being its orientation (5, each give or take 9 degrees) and its
    frequency (2, give or take 10%); the phase is random."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    theta = (y % 5).float() * math.pi / 5 + 0.15 * torch.randn(n, generator=g)
    freq = torch.where(y < 5, 0.6, 1.1) * (1 + 0.1 * torch.randn(n, generator=g))
    phase = 2 * math.pi * torch.rand(n, generator=g)
    ii = torch.arange(SIDE, dtype=torch.float32)
    rows, cols = ii.view(1, SIDE, 1), ii.view(1, 1, SIDE)
    along = rows * torch.cos(theta).view(n, 1, 1) + cols * torch.sin(theta).view(n, 1, 1)
    x = 0.5 * torch.sin(freq.view(n, 1, 1) * along + phase.view(n, 1, 1))
    x = x + noise * torch.randn(n, SIDE, SIDE, generator=g)
    return x.unsqueeze(1), y


class Net(nn.Module):
    """The small CNN; `width` multiplies its channels (experiment 3 times
    the monitors on a wider one too)."""

    def __init__(self, width=1):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8 * width, 3, padding=1)
        self.conv2 = nn.Conv2d(8 * width, 16 * width, 3, padding=1)
        self.fc = nn.Linear(16 * width * 4 * 4, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


class GrowBatch(BasePolicy):
    """Experiment 1: the batch follows the gradient noise scale."""

    def __init__(self, every, max_batch, lr_grow):
        self.every, self.max_batch, self.lr_grow = every, max_batch, lr_grow

    def after_step(self, ctx):
        if ctx.step % self.every or 2 * ctx.batch_size > self.max_batch:
            return
        noise = ctx.metrics["noise_scale"]
        if noise > ctx.batch_size * ctx.size:
            ctx.set_batch_size(2 * ctx.batch_size)
            ctx.set_learning_rate(ctx.metrics["lr"] * self.lr_grow)


class AvoidSlowPeer(BasePolicy):
    """Experiment 2: when a peer's rate stays below `frac` of its usual
    rate (its median over steps `warm` to `2 * warm`) for `window` steps
    in a row, the cluster switches strategy, once. In a row, and against
    the median: on 2 cores with 4 workers a single step's rate swings from
    a fifth to ten times the median (a peer descheduled, or one whose data
    was there first); through a slowed link it stays low every step."""

    def __init__(self, to, frac, window=3, warm=40):
        self.to, self.frac, self.window, self.warm = to, frac, window, warm
        self.seen, self.usual, self.recent = {}, {}, {}
        self.done, self.proposed_at = False, None

    def after_step(self, ctx):
        if self.done or ctx.step < self.warm:  # (start-up: connections, caches)
            return
        for r, rate in ctx.metrics["peer_rates"].items():
            if ctx.step < 2 * self.warm:
                self.seen.setdefault(r, []).append(rate)
                continue
            if r not in self.usual and self.seen.get(r):
                self.usual[r] = statistics.median(self.seen[r])
            hist = self.recent.setdefault(r, [])
            hist.append(rate)
            del hist[:-self.window]
            if (r in self.usual and len(hist) == self.window
                    and max(hist) < self.frac * self.usual[r]):
                ctx.set_strategy(self.to)
                self.proposed_at = ctx.step
                self.done = True
                return


class ScaleByGain(BasePolicy):
    """Experiment 5: grows the cluster while each added worker adds
    `min_gain` of the throughput; else back to the best size, and stays."""

    def __init__(self, window, min_gain, sizes=(1, 2, 4)):
        self.window, self.min_gain, self.sizes = window, min_gain, list(sizes)
        self.rates, self.samples, self.settled = {}, [], False
        self.size, self.warm = None, 0

    def after_step(self, ctx):
        if self.settled:
            return
        if ctx.size != self.size:  # a new size: its first steps are a warm-up
            self.size, self.warm, self.samples = ctx.size, self.window // 2 + 3, []
        if self.warm > 0:
            self.warm -= 1
            return
        self.samples.append(ctx.metrics["throughput"])
        if len(self.samples) < self.window:
            return
        rate = sorted(self.samples)[len(self.samples) // 2]
        self.samples = []
        n = ctx.size
        self.rates[n] = rate
        smaller = [s for s in self.rates if s < n]
        if smaller:
            prev = max(smaller)
            gain = (rate - self.rates[prev]) / (self.rates[prev] * (n - prev))
            if gain < self.min_gain:
                self.settled = True
                ctx.resize(prev)
                return
        bigger = [s for s in self.sizes if s > n]
        if bigger:
            ctx.resize(bigger[0])
        else:
            self.settled = True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sync", default="ssgd", choices=["ssgd", "sma", "pair", "adasgd"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train", type=int, default=8192)
    p.add_argument("--policy", default="none", choices=["none", "gns", "peer-rates", "scale"])
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--lr-grow", type=float, default=math.sqrt(2),
                   help="gns: the learning rate's factor per doubling of the batch (the "
                        "square-root rule by default; 2 is the linear rule)")
    p.add_argument("--eval-every", type=int, default=4096, help="samples of the cluster")
    p.add_argument("--eval-steps", type=int, default=0,
                   help="evaluate every that many steps instead (the same on a worker that "
                        "joins: its sample count starts at 0)")
    p.add_argument("--target", type=float, default=0.0, help="stop at this accuracy")
    p.add_argument("--time-limit", type=float, default=120.0)
    p.add_argument("--switch-to", default="binary_tree")
    p.add_argument("--slow-frac", type=float, default=0.3)
    p.add_argument("--min-gain", type=float, default=0.3)
    p.add_argument("--strategy", default=None)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--monitor", action="store_true")
    p.add_argument("--steps", type=int, default=0, help="DDP: steps to time")
    p.add_argument("--width", type=int, default=1, help="DDP: the CNN's channels times this")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-after-s", type=float, default=10.0)
    p.add_argument("--slow-mb", type=float, default=20.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("KUNGFU_RANK") == str(a.slow_rank):
        # this worker's TCP egress slows down mid-run (the fault wrapper)
        os.environ["KUNGFU_FAULTS"] = f"rate_mb={a.slow_mb},rate_after_ms={int(a.slow_after_s * 1000)}"
    if a.ddp:
        return ddp_run(a)
    kungfu.torch.init()
    # (the fault wrapper's clock for rate_after_ms starts about here)
    t_init = time.perf_counter()
    if a.strategy:
        kungfu.set_strategy(a.strategy)
    x, y = gratings(a.train, seed=1)
    tx, ty = gratings(2000, seed=2)
    data = torch.utils.data.TensorDataset(x, y)
    torch.manual_seed(0)
    model = Net()
    base = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    named = model.named_parameters()
    if a.sync == "adasgd":
        opt = O.AdaptiveSGDOptimizer(base, named, change_step=200)
    elif a.sync == "sma":
        opt = O.SynchronousAveragingOptimizer(base, named, alpha=0.1)
    elif a.sync == "pair":
        opt = O.PairAveragingOptimizer(base, named)
    elif a.policy == "gns":
        opt = O.MonitorGradientNoiseScaleOptimizer(base, named, device_batch_size=a.batch,
                                                   alpha=0.05)
    else:
        opt = O.SynchronousSGDOptimizer(base, named)
    policies = []
    if a.policy == "gns":
        policies.append(GrowBatch(a.every, a.max_batch, a.lr_grow))
    elif a.policy == "peer-rates":
        policies.append(AvoidSlowPeer(a.switch_to, a.slow_frac))
    elif a.policy == "scale":
        policies.append(ScaleByGain(window=a.every, min_gain=a.min_gain))
    runner = PolicyRunner(policies, model=model, optimizer=opt, dataset=data,
                          batch_size=a.batch, epochs=a.epochs, seed=0)
    out = open(a.out, "a") if kungfu.rank() == 0 else None
    t0 = time.perf_counter()
    step_times = []  # (step, seconds since t0 at its end)
    last_t, last_samples, samples, since_eval = t0, 0, 0, 0
    for xb, yb in runner:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        runner.record("lr", opt.param_groups[0]["lr"])
        # the same count on every rank (the agreed batch and size), so that
        # every rank evaluates at the same steps
        samples += runner.state.batch_size * kungfu.size()
        since_eval += runner.state.batch_size * kungfu.size()
        step = runner.state.step + 1
        now = time.perf_counter()
        step_times.append((step, now - t0))
        if (step % a.eval_steps == 0) if a.eval_steps else since_eval >= a.eval_every:
            since_eval = 0
            acc = accuracy(model, tx, ty)
            if out:
                m = runner.context.metrics
                out.write(json.dumps({
                    "t": now - t0, "step": step, "epoch": runner.state.epoch, "acc": acc,
                    "loss": float(loss), "batch": runner.state.batch_size,
                    "size": kungfu.size(), "lr": opt.param_groups[0]["lr"],
                    "throughput": (samples - last_samples) / max(now - last_t, 1e-9),
                    "noise_scale": _num(m.get("noise_scale")),
                    "switch_proposed": getattr(policies[0], "proposed_at", None)
                    if policies else None,
                    "history": [[s, a_.kind, a_.value] for s, a_ in runner.history],
                    "resizes": runner.resizes,
                }) + "\n")
                out.flush()
            last_t, last_samples = now, samples
            stop = torch.tensor([1.0 if (a.target and acc >= a.target)
                                 or now - t0 > a.time_limit else 0.0])
            # rank 0's verdict for everyone (its model is the one evaluated)
            kungfu.torch.broadcast_(stop, 0, name=f"stop.{step}")
            if stop.item():
                break
    if out:
        out.close()
        # when each step ended, and where the wrapper's clock started on
        # this timeline (experiment 2 counts the steps from the slowdown)
        with open(a.out + ".steps", "w") as f:
            json.dump({"init_at": t_init - t0, "steps": step_times}, f)
    print(f"rank {kungfu.rank()}: {runner.state.step} steps, {time.perf_counter() - t0:.1f} s",
          flush=True)
    os._exit(0)  # (a detached worker too: nothing left to say)


def _num(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def ddp_run(a):
    """Experiment 3: the time of a DDP step with and without the monitors."""
    import torch.distributed as dist

    from kungfu.torch import hooks

    dist.init_process_group("kungfu")
    x, y = gratings(a.batch * (a.steps + 20), seed=1 + dist.get_rank())
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(a.width))
    if a.monitor:
        model.register_comm_hook(hooks.MonitorState(device_batch_size=a.batch),
                                 hooks.noise_scale_hook)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    times = []
    for i in range(a.steps + 20):
        xb, yb = x[i * a.batch:(i + 1) * a.batch], y[i * a.batch:(i + 1) * a.batch]
        t = time.perf_counter()
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= 20:  # warm-up left out
            times.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        times.sort()
        with open(a.out, "a") as f:
            params = sum(p.numel() for p in model.parameters())
            f.write(json.dumps({"monitor": a.monitor, "median_step_s": times[len(times) // 2],
                                "steps": len(times), "params": params}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
