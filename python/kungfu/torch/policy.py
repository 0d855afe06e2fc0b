"""Adaptation policies for PyTorch training, as KungFu's `BasePolicy` and
`PolicyHook` were for TensorFlow.

    class GrowBatch(BasePolicy):
        def after_epoch(self, ctx):
            if ctx.metrics["noise_scale"] > 2 * ctx.batch_size * ctx.size:
                ctx.set_batch_size(2 * ctx.batch_size)

    runner = PolicyRunner([GrowBatch()], model=model, optimizer=opt,
                          dataset=data, batch_size=32, epochs=10)
    for x, y in runner:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        runner.record("loss", loss.item())

The runner yields this worker's batches, epoch after epoch, through an
`ElasticSampler`, and calls the policies' hooks: `before_train` once,
`before_epoch` and `after_epoch` around each epoch, `after_step` when the
next batch is asked for. After each hook point the workers agree
(`kungfu.agree`, one small allgather): an action proposed by a policy on
any worker is applied by every worker at the same step, or by none.
Agreed actions are applied between steps, in this order: strategy (as
part of the agreement), transport, learning rate, synchronisation, batch
size, and last the cluster size.

The agreement rule (kungfu.h's `kf_agree`): per kind of action, the value
proposed by the most workers wins; a tie goes to the value of the most
senior proposer: the one in the cluster since the earliest cluster
version, then the lowest rank. So a worker that just joined (its policies
start afresh) cannot override what the workers that were there propose.

`ctx.metrics` holds, after each step: `"noise_scale"` and
`"gradient_variance"` (the last values of the monitors that ride on the
gradient exchange: `kungfu.torch.optimizers`' Monitor wrappers or
`kungfu.torch.hooks`; NaN without one), `"step_time"` (seconds from one
batch to the next on this worker), `"throughput"` (the cluster's samples
of that step per second of it), `"peer_rates"` (rank -> bytes/s received
from that peer during the step, from the library's per-peer counters),
and what `runner.record(name, value)` added.

`runner.state` (a `kungfu.torch.elastic.TorchState`: the model, the
optimizer, the step and the runner's position) is what survives a resize:
workers that join get it before their first batch, and continue where
the cluster is.
"""

import math
import time
import types

import torch

import kungfu

from . import _monitor
from .elastic import ElasticSampler, TorchState, _cluster_changed

# the custom action kinds of the runner (kungfu.h's KF_ACTION_CUSTOM)
CUSTOM_LEARNING_RATE = 0xF001
CUSTOM_SYNC = 0xF002
_SYNC_CODES = {"ssgd": 1, "sma": 2, "pair": 3}


class BasePolicy:
    """Override any of the hooks; each gets the runner's `Context`."""

    def before_train(self, ctx):
        pass

    def before_epoch(self, ctx):
        pass

    def after_step(self, ctx):
        pass

    def after_epoch(self, ctx):
        pass


class Context:
    """What a policy reads (`step`, `epoch`, `rank`, `size`, `batch_size`
    per worker, `metrics`) and the actions it may propose."""

    def __init__(self, runner):
        self._r = runner

    step = property(lambda self: self._r.state.step, doc="Steps done by the cluster.")
    epoch = property(lambda self: self._r.state.epoch)
    rank = property(lambda self: kungfu.rank())
    size = property(lambda self: kungfu.size())
    batch_size = property(lambda self: self._r.state.batch_size, doc="Per worker.")

    @property
    def metrics(self):
        return types.MappingProxyType(self._r._metrics)

    def _propose(self, kind, value, custom_kind=0):
        kungfu.propose(kungfu.Action(kind, value, custom_kind))

    def set_batch_size(self, n):
        """This worker's batch size from the next step on (every worker's)."""
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"kungfu: batch size {n!r}: a positive integer")
        self._propose("set_batch_size", int(n))

    def set_learning_rate(self, lr):
        """The learning rate of every parameter group of the optimizer."""
        lr = float(lr)
        if not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"kungfu: learning rate {lr}: a positive finite number")
        self._propose("custom", _f64_bits(lr), CUSTOM_LEARNING_RATE)

    def resize(self, n):
        """The cluster size (the job must be elastic: `kungfu-run -w`)."""
        if isinstance(n, bool) or int(n) != n or n < 1:
            raise ValueError(f"kungfu: cluster size {n!r}: a positive integer")
        self._propose("resize", int(n))

    def set_strategy(self, name):
        """The communication strategy: a name of `kungfu.STRATEGIES`."""
        self._propose("set_strategy", kungfu._enum(kungfu.STRATEGIES, name, "strategy"))

    def set_sync(self, kind):
        """The synchronisation: "ssgd", "sma" or "pair" (the optimizer must
        be one of `kungfu.torch.optimizers`)."""
        if kind not in _SYNC_CODES:
            raise ValueError(f"kungfu: unknown sync {kind!r}: one of {', '.join(_SYNC_CODES)}")
        if not hasattr(self._r.optimizer, "set_sync"):
            raise ValueError("kungfu: set_sync needs an optimizer of kungfu.torch.optimizers")
        self._propose("custom", _SYNC_CODES[kind], CUSTOM_SYNC)

    def set_transport(self, name):
        """The transport: a name of `kungfu.TRANSPORTS`."""
        self._propose("set_transport", kungfu._enum(kungfu.TRANSPORTS, name, "transport"))


def _f64_bits(x):
    return int.from_bytes(torch.tensor([x], dtype=torch.float64).numpy().tobytes(), "little")


def _f64_of(bits):
    return float(torch.frombuffer(bytearray(int(bits).to_bytes(8, "little")),
                                  dtype=torch.float64)[0])


def _default_collate(samples):
    return torch.utils.data.default_collate(samples)


class PolicyRunner:
    """Runs `policies` over a training loop; iterate over it for this
    worker's batches (see the module's doc)."""

    def __init__(self, policies, *, model, optimizer, dataset, batch_size, epochs, shuffle=True,
                 seed=0, collate_fn=None):
        self.policies = list(policies)
        for p in self.policies:
            if not isinstance(p, BasePolicy):
                raise TypeError(f"kungfu: a policy is a BasePolicy, not {type(p).__name__}")
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"kungfu: batch size {batch_size!r}: a positive integer")
        if int(epochs) < 0:
            raise ValueError(f"kungfu: epochs {epochs}: at least 0")
        if len(dataset) == 0:
            raise ValueError("kungfu: an empty dataset")
        self.model, self.optimizer, self.dataset = model, optimizer, dataset
        self.epochs = int(epochs)
        self.collate_fn = collate_fn or _default_collate
        kungfu.init()
        self.sampler = ElasticSampler(dataset, shuffle=shuffle, seed=seed)
        self.state = TorchState(model, optimizer, step=0, epoch=0, batch_size=int(batch_size),
                                started=False, in_epoch=False, sampler=None,
                                sync_kind=getattr(optimizer, "sync", None))
        self.context = Context(self)
        self.detached = False
        self.history = []  # (step, Action) of every agreed action
        self.resizes = []  # (step, size before, size after, seconds) of each resize
        self._metrics = {"noise_scale": math.nan, "gradient_variance": math.nan,
                         "throughput": math.nan, "step_time": math.nan, "peer_rates": {}}
        self._user = {}

    def record(self, name, value):
        """Adds a metric of the user's (e.g. the loss) to `ctx.metrics`."""
        self._user[str(name)] = value
        self._metrics[str(name)] = value

    # ---- the loop ----

    def __iter__(self):
        st = self.state
        self._sync()
        if not st.started:
            st.started = True
            if not self._hooks("before_train"):
                return
        while st.epoch < self.epochs:
            if not st.in_epoch:
                self.sampler.set_epoch(st.epoch)
                st.in_epoch = True
                if not self._hooks("before_epoch"):
                    return
            kungfu.reset_stats()
            t_prev = time.perf_counter()
            while True:
                chunk = self.sampler.next_batch(st.batch_size)
                if not chunk:
                    break
                mine = chunk[kungfu.rank()::kungfu.size()]
                yield self._batch(mine)
                self.sampler.advance(chunk)
                st.step += 1
                now = time.perf_counter()
                self._step_metrics(now - t_prev, len(chunk))
                if not self._hooks("after_step"):
                    return
                t_prev = time.perf_counter()
            self._run("after_epoch")
            # where a worker that joins at this agreement starts: the next epoch
            st.in_epoch = False
            st.epoch += 1
            if not self._agree():
                return

    def _batch(self, indices):
        if not indices:
            # fewer samples left than workers: this worker's part is empty
            first = self.collate_fn([self.dataset[0]])
            return _empty_like(first)
        return self.collate_fn([self.dataset[i] for i in indices])

    def _step_metrics(self, dt, samples):
        m = self._metrics
        m["step_time"] = dt
        m["throughput"] = samples / dt if dt > 0 else math.nan
        m["noise_scale"] = _monitor.latest["noise_scale"]
        m["gradient_variance"] = _monitor.latest["gradient_variance"]
        rates = {}
        for r, s in enumerate(kungfu.peer_stats()):
            # a peer no op of the step heard from (the fast path does not
            # count per peer) is unknown, not slow: no entry
            if r != kungfu.rank() and s["ops"] > 0:
                rates[r] = s["rate"]
        m["peer_rates"] = rates
        kungfu.reset_stats()

    def _run(self, hook):
        for p in self.policies:
            getattr(p, hook)(self.context)

    def _agree(self):
        """Agrees on the proposals and applies them; False when this
        worker left the cluster."""
        return self._apply(kungfu.agree(self.state.step))

    def _hooks(self, hook):
        self._run(hook)
        return self._agree()

    def _apply(self, agreed):
        st = self.state
        resize = None
        order = {"set_strategy": 0, "set_transport": 1, "custom": 2, "set_batch_size": 3,
                 "resize": 4}
        for a in sorted(agreed, key=lambda a: (order[a.kind], a.custom_kind)):
            self.history.append((st.step, a))
            if a.kind == "set_transport":
                kungfu.set_transport(a.value)
            elif a.kind == "custom" and a.custom_kind == CUSTOM_LEARNING_RATE:
                lr = _f64_of(a.value)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
            elif a.kind == "custom" and a.custom_kind == CUSTOM_SYNC:
                kind = {v: k for k, v in _SYNC_CODES.items()}.get(a.value)
                if kind is not None and hasattr(self.optimizer, "set_sync"):
                    self.optimizer.set_sync(kind)
                    st.sync_kind = kind
            elif a.kind == "set_batch_size":
                st.batch_size = int(a.value)
                if hasattr(self.optimizer, "set_device_batch_size"):
                    self.optimizer.set_device_batch_size(st.batch_size)
            elif a.kind == "resize":
                resize = int(a.value)
        if resize is not None and resize != kungfu.size():
            t0, before = time.perf_counter(), kungfu.size()
            changed, detached = kungfu.resize(resize)
            if detached:
                self.detached = True
                return False
            if changed:
                _cluster_changed()
                self._sync()
                self.resizes.append((st.step, before, kungfu.size(), time.perf_counter() - t0))
        return True

    def _sync(self):
        """Brings every worker (new ones too) to the cluster's state."""
        st = self.state
        st.sampler = self.sampler.state_dict()
        st.sync()
        self.sampler.load_state_dict(st.sampler)
        kind = st.sync_kind
        if kind is not None and hasattr(self.optimizer, "set_sync"):
            # (a cluster that changed has new, empty stores: "pair" publishes again)
            self.optimizer.set_sync(kind, republish=True)
        if hasattr(self.optimizer, "set_device_batch_size"):
            self.optimizer.set_device_batch_size(st.batch_size)


def _empty_like(batch):
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_like(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    return batch
