"""DDP communication hooks that monitor the gradients inside the exchange.

    from kungfu.torch import hooks
    state = hooks.MonitorState(device_batch_size=32)
    ddp.register_comm_hook(state, hooks.noise_scale_hook)

`noise_scale_hook` averages each of DDP's gradient buckets over the
workers, as DDP's default hook does, with one more element: the squared
norm of this worker's part of the bucket. The sum of those over the
workers and the buckets, with the squared norm of the averaged gradient,
is what the noise scale and the gradient variance need
(`kungfu.torch._monitor`): they ride on the allreduce DDP does anyway, so
monitoring adds no collective. When the step's last bucket is in, the
monitors are fed; `PolicyRunner` reads them into `ctx.metrics`.

The process group is the hook state's (`process_group=None`: the default
one), of any backend; with the "kungfu" backend the allreduce is
kungfu.h's.
"""

import threading

import torch
import torch.distributed as dist

from ._monitor import GradientMonitor


class MonitorState:
    """The hook's state: the monitors and the step's partial sums.
    `device_batch_size`: one worker's examples per step (for the noise
    scale); `monitor_interval`: monitor every that many steps (the other
    steps are DDP's plain average)."""

    def __init__(self, device_batch_size, process_group=None, monitor_interval=1, noise=True,
                 variance=True, alpha=0.1):
        if int(device_batch_size) < 1:
            raise ValueError(f"kungfu: device_batch_size {device_batch_size}: at least 1")
        self.process_group = process_group
        self.device_batch_size = int(device_batch_size)
        self.monitor = GradientMonitor(noise=noise, variance=variance, interval=monitor_interval,
                                       alpha=alpha)
        self._lock = threading.Lock()
        self._new_step()

    def _new_step(self):
        self._issued = self._done = 0
        self._total = None
        self._small = self._big = 0.0
        self._watch = None

    def _group_size(self):
        return dist.get_world_size(self.process_group)

    def _bucket_done(self, small, big):
        with self._lock:
            self._small += small
            self._big += big
            self._done += 1
            self._finish_if_done()

    def _finish_if_done(self):
        if self._total is None or self._done < self._total:
            return
        n = self._group_size()
        if self._watch:
            b = float(self.device_batch_size)
            self.monitor.update(self._small, self._big, b, b * n)
        self.monitor.tick()
        self._new_step()


def _average(bucket_buffer, out, n):
    bucket_buffer.copy_(out[:bucket_buffer.numel()].div_(n))
    return bucket_buffer


def noise_scale_hook(state, bucket):
    """A DDP comm hook: the average of the bucket over the workers, with
    the monitors of `state` (a `MonitorState`) fed from the same
    allreduce."""
    buf = bucket.buffer()
    group = state.process_group
    n = dist.get_world_size(group)
    with state._lock:
        if state._watch is None:
            state._watch = state.monitor.due()
        watch = state._watch
        state._issued += 1
        if bucket.is_last():
            state._total = state._issued
    if not watch:
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def plain(f):
            out = f.value()[0]
            state._bucket_done(0.0, 0.0)
            return _average(buf, out, n)

        return fut.then(plain)
    flat = buf.reshape(-1)
    local_sq = torch.dot(flat, flat).reshape(1)
    ext = torch.cat([flat, local_sq.to(buf.dtype)])
    fut = dist.all_reduce(ext, group=group, async_op=True).get_future()

    def monitored(f):
        out = f.value()[0]
        small = float(out[-1]) / n
        mean = _average(buf, out, n)
        m = mean.reshape(-1)
        state._bucket_done(small, float(torch.dot(m, m)))
        return mean

    return fut.then(monitored)


def gradient_variance_hook(state, bucket):
    """`noise_scale_hook` by another name: both monitors ride on the same
    element; `MonitorState(noise=False)` keeps the variance only."""
    return noise_scale_hook(state, bucket)
