"""KungFu's synchronisation strategies for PyTorch, as optimizer wrappers.

Each wraps any `torch.optim` optimizer; the arguments are `(optimizer,
named_parameters, ...)`, and the result is an optimizer of the same class
(lr schedulers and `state_dict` work as before) whose `step()`
synchronises the workers first:

* `SynchronousSGDOptimizer`: S-SGD. The gradients are summed over the
  workers in buckets of at most `fusion_bytes` (each bucket one flat
  tensor, the buckets issued together as one group of named allreduces),
  then divided by the cluster size; then the wrapped optimizer steps.
* `SynchronousAveragingOptimizer(..., alpha=0.1)`: SMA. Each step first
  moves every worker's model towards the cluster's mean model,
  `x <- (1 - alpha) x + alpha mean(x)`, then applies the worker's own
  gradient.
* `PairAveragingOptimizer`: asynchronous. Each step averages the model
  with one peer's, `x <- (x + x_peer) / 2`, then applies the worker's own
  gradient and publishes the result (`kungfu.save`). The peer's model is
  fetched from its store (`kungfu.request`): the peer does not take part,
  so no worker waits for another's step. Peers are drawn at random
  (`seed`), or given by `peer_selector(step) -> rank`.
* `AdaptiveSGDOptimizer(..., change_step=N)`: S-SGD for N steps, then SMA.
* `MonitorGradientNoiseScaleOptimizer(..., device_batch_size,
  monitor_interval=1)` and `MonitorGradientVarianceOptimizer(...)`: S-SGD
  with the monitors of `kungfu.torch._monitor` fed every `monitor_interval`
  steps. The squared norm a monitor needs travels as one more element of
  the first bucket: monitoring adds no collective.

Every wrapper can change its synchronisation at run time with
`set_sync("ssgd" | "sma" | "pair")` (what `ctx.set_sync` of a policy does,
at the same step on every worker). Creating one with (or switching to)
pair averaging publishes the worker's model; a request for a model a peer
has not published yet waits for it (within the library's op timeout).

Ops are named after the wrapper's number in this process (`kf.opt0...`),
so every worker must create the same wrappers in the same order.
"""

import itertools
import random

import torch

import kungfu

from . import _C
from ._monitor import GradientMonitor

SYNC_KINDS = ("ssgd", "sma", "pair")
KF_SUM = 0
_numbers = itertools.count()


def _buckets(tensors, limit):
    """`tensors` in consecutive runs of one dtype of at most `limit` bytes
    (a larger tensor alone)."""
    out, run, nbytes = [], [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if run and (t.dtype != run[0].dtype or nbytes + size > limit):
            out.append(run)
            run, nbytes = [], 0
        run.append(t)
        nbytes += size
    if run:
        out.append(run)
    return out


class _KungFuOptimizer:
    """Placed before the wrapped optimizer's class in a class made for it,
    so that `super()` is the wrapped optimizer."""

    def _kf_setup(self, named_parameters, sync, alpha, fusion_bytes, monitor, device_batch_size,
                  change_step, peer_selector, seed):
        named = list(named_parameters) if named_parameters is not None else None
        params = [p for g in self.param_groups for p in g["params"]]
        if named is not None:
            if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
                raise ValueError("kungfu: named_parameters: (name, parameter) pairs, as "
                                 "model.named_parameters() gives")
            names = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in names]
            if missing:
                raise ValueError(f"kungfu: parameters {missing} of the optimizer are not in "
                                 "named_parameters")
        if not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"kungfu: alpha {alpha}: in (0, 1]")
        if int(fusion_bytes) < 1:
            raise ValueError(f"kungfu: fusion_bytes {fusion_bytes}: at least 1")
        if monitor is not None and monitor.noise and not device_batch_size:
            raise ValueError("kungfu: the noise-scale monitor needs device_batch_size")
        kungfu.init()
        self._kf_prefix = f"kf.opt{next(_numbers)}"
        self._kf_params = params
        self._kf_alpha = float(alpha)
        self._kf_fusion = int(fusion_bytes)
        self._kf_monitor = monitor
        self._kf_batch = float(device_batch_size or 0)
        self._kf_change = change_step
        self._kf_selector = peer_selector
        self._kf_rng = random.Random(int(seed) * 7919 + kungfu.rank())
        self._kf_steps = 0
        self._kf_sync = None
        self.set_sync(sync)

    # ---- what the policies change ----

    @property
    def sync(self):
        """The synchronisation in use: "ssgd", "sma" or "pair"."""
        return self._kf_sync

    def set_sync(self, kind, republish=False):
        """Switches the synchronisation from the next step (every worker at
        the same step). Switching to "pair" publishes this worker's model
        (`republish`: also when it is "pair" already, as after a resize,
        whose cluster has new stores)."""
        if kind not in SYNC_KINDS:
            raise ValueError(f"kungfu: unknown sync {kind!r}: one of {', '.join(SYNC_KINDS)}")
        if kind == "pair" and (self._kf_sync != "pair" or republish):
            self._kf_publish()
        self._kf_sync = kind

    def set_device_batch_size(self, n):
        """The examples of one worker's step (for the noise scale)."""
        self._kf_batch = float(n)

    # ---- the step ----

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kind = self._kf_sync
        if kungfu.size() > 1 or self._kf_monitor is not None:
            if kind == "ssgd":
                self._kf_allreduce_grads()
            elif kind == "sma":
                self._kf_average_models()
            else:
                self._kf_pair_average()
        super().step()
        if kind == "pair":
            self._kf_publish()
        self._kf_steps += 1
        if self._kf_monitor is not None:
            self._kf_monitor.tick()
        if self._kf_change is not None and self._kf_steps == self._kf_change and kind == "ssgd":
            self._kf_sync = "sma"
        return loss

    def _kf_sum(self, tensors, tag, extra=None):
        """Sums `tensors` over the workers in place, bucket by bucket (one
        group); `extra`, a float, rides at the end of the first bucket and
        its sum is returned."""
        buckets = _buckets(tensors, self._kf_fusion)
        if extra is not None and not (buckets and buckets[0][0].is_floating_point()):
            raise RuntimeError("kungfu: a monitor needs floating-point gradients")
        flats = []
        for i, b in enumerate(buckets):
            parts = [t.reshape(-1) for t in b]
            if i == 0 and extra is not None:
                parts.append(torch.tensor([extra], dtype=b[0].dtype))
            flats.append(torch.cat(parts))
        works = []
        _C.group_start()
        try:
            for i, f in enumerate(flats):
                works.append(_C.allreduce(f, f, KF_SUM, f"{self._kf_prefix}.{tag}.{i}"))
        finally:
            _C.group_end()
        for w in works:
            w.wait()
        for b, f in zip(buckets, flats):
            at = 0
            for t in b:
                n = t.numel()
                t.copy_(f[at:at + n].view_as(t))
                at += n
        return float(flats[0][-1]) if extra is not None else None

    def _kf_allreduce_grads(self):
        grads = []
        for p in self._kf_params:
            if not p.requires_grad:
                continue
            if p.grad is None:  # no gradient here this step: zeros, as the others expect
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        m = self._kf_monitor
        watch = m is not None and m.due()
        local_sq = sum(float(g.double().pow(2).sum()) for g in grads) if watch else None
        total = self._kf_sum(grads, "grad", extra=local_sq)
        n = kungfu.size()
        for g in grads:
            g.div_(n)
        if watch:
            big_sq = sum(float(g.double().pow(2).sum()) for g in grads)
            m.update(total / n, big_sq, self._kf_batch, self._kf_batch * n)

    def _kf_model(self):
        return [p.data for p in self._kf_params]

    def _kf_average_models(self):
        model = self._kf_model()
        mean = [t.clone() for t in model]
        self._kf_sum(mean, "model")
        n, a = kungfu.size(), self._kf_alpha
        with torch.no_grad():
            for x, s in zip(model, mean):
                x.mul_(1.0 - a).add_(s, alpha=a / n)

    def _kf_flat_model(self):
        return [torch.cat([t.reshape(-1) for t in b]) for b in _buckets(self._kf_model(), 1 << 62)]

    def _kf_publish(self):
        for i, flat in enumerate(self._kf_flat_model()):
            kungfu.save(f"{self._kf_prefix}.model.{i}", flat)

    def _kf_peer(self):
        n, me = kungfu.size(), kungfu.rank()
        if self._kf_selector is not None:
            peer = int(self._kf_selector(self._kf_steps))
            if not 0 <= peer < n or peer == me:
                raise ValueError(f"kungfu: peer_selector gave {peer} on rank {me} of {n}")
            return peer
        peer = self._kf_rng.randrange(n - 1)
        return peer + 1 if peer >= me else peer

    def _kf_pair_average(self):
        if kungfu.size() < 2:
            return
        peer = self._kf_peer()
        self._kf_got = []  # (peer, version) of each part of the model averaged with
        for i, b in enumerate(_buckets(self._kf_model(), 1 << 62)):
            theirs = torch.empty(sum(t.numel() for t in b), dtype=b[0].dtype)
            v = kungfu.request(peer, f"{self._kf_prefix}.model.{i}", theirs)
            self._kf_got.append((peer, v))
            at = 0
            with torch.no_grad():
                for t in b:
                    k = t.numel()
                    t.add_(theirs[at:at + k].view_as(t)).mul_(0.5)
                    at += k


def _wrap(optimizer, named_parameters, sync="ssgd", alpha=0.1, fusion_bytes=4 << 20,
          monitor=None, device_batch_size=None, change_step=None, peer_selector=None, seed=0):
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"kungfu: wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    cls = type(optimizer.__class__.__name__, (_KungFuOptimizer, optimizer.__class__), {})
    opt = cls.__new__(cls)
    optimizer.__class__.__init__(opt, optimizer.param_groups)
    opt.load_state_dict(optimizer.state_dict())
    opt._kf_setup(named_parameters, sync, alpha, fusion_bytes, monitor, device_batch_size,
                  change_step, peer_selector, seed)
    return opt


def SynchronousSGDOptimizer(optimizer, named_parameters=None, fusion_bytes=4 << 20):
    """S-SGD: the gradients averaged over the workers, in fused buckets."""
    return _wrap(optimizer, named_parameters, "ssgd", fusion_bytes=fusion_bytes)


def SynchronousAveragingOptimizer(optimizer, named_parameters=None, alpha=0.1,
                                  fusion_bytes=4 << 20):
    """SMA: each step, `x <- (1 - alpha) x + alpha mean(x)`, then the
    worker's own gradient."""
    return _wrap(optimizer, named_parameters, "sma", alpha=alpha, fusion_bytes=fusion_bytes)


def PairAveragingOptimizer(optimizer, named_parameters=None, peer_selector=None, seed=0):
    """Each step averages the model with one peer's (fetched from the
    peer's store, without the peer taking part), then applies the
    worker's own gradient and publishes the result."""
    return _wrap(optimizer, named_parameters, "pair", peer_selector=peer_selector, seed=seed)


def AdaptiveSGDOptimizer(optimizer, named_parameters=None, change_step=1000, alpha=0.1,
                         fusion_bytes=4 << 20):
    """S-SGD for `change_step` steps, then SMA."""
    if int(change_step) < 0:
        raise ValueError(f"kungfu: change_step {change_step}: at least 0")
    opt = _wrap(optimizer, named_parameters, "ssgd", alpha=alpha, fusion_bytes=fusion_bytes,
                change_step=int(change_step))
    if int(change_step) == 0:
        opt.set_sync("sma")
    return opt


def MonitorGradientNoiseScaleOptimizer(optimizer, named_parameters=None, device_batch_size=None,
                                       monitor_interval=1, alpha=0.1, fusion_bytes=4 << 20):
    """S-SGD that feeds the gradient noise scale monitor every
    `monitor_interval` steps (`device_batch_size`: one worker's examples
    per step)."""
    mon = GradientMonitor(noise=True, variance=False, interval=monitor_interval, alpha=alpha)
    return _wrap(optimizer, named_parameters, "ssgd", fusion_bytes=fusion_bytes, monitor=mon,
                 device_batch_size=device_batch_size)


def MonitorGradientVarianceOptimizer(optimizer, named_parameters=None, monitor_interval=1,
                                     fusion_bytes=4 << 20):
    """S-SGD that feeds the gradient variance monitor every
    `monitor_interval` steps."""
    mon = GradientMonitor(noise=False, variance=True, interval=monitor_interval)
    return _wrap(optimizer, named_parameters, "ssgd", fusion_bytes=fusion_bytes, monitor=mon)


def monitor_of(optimizer):
    """The wrapper's GradientMonitor (None without one)."""
    return getattr(optimizer, "_kf_monitor", None)


def is_kungfu_optimizer(optimizer) -> bool:
    return isinstance(optimizer, _KungFuOptimizer)


__all__ = [
    "SynchronousSGDOptimizer", "SynchronousAveragingOptimizer", "PairAveragingOptimizer",
    "AdaptiveSGDOptimizer", "MonitorGradientNoiseScaleOptimizer",
    "MonitorGradientVarianceOptimizer", "SYNC_KINDS", "monitor_of", "is_kungfu_optimizer",
]
