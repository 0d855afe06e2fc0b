"""Elastic training from Python, over the elastic C ABI (`kf_resize*`,
`kf_sync_state`, `kf_recover`).

    state = kungfu.torch.elastic.TorchState(model, optimizer, epoch=0)

    @kungfu.torch.elastic.run
    def train(state):
        while state.step < steps:
            ...one step...
            state.step += 1
            state.commit()      # a rollback point; follows a resize

    train(state)

`commit()` saves the state in memory and, when the job has a config
server (`kungfu-run -w`), applies a cluster size proposed since
(`kungfu.propose_new_size(n)` by any worker): the cluster grows or shrinks
there, and the workers (new ones included) leave `commit()` with the same
state. `run` turns a lost peer into a recovery: the survivors shrink the
cluster (`kungfu.recover()`), roll back to the last commit and go on. A
worker the cluster no longer holds returns from `run` with None.
"""

import copy
import functools
import io

import torch

import kungfu

from .. import _capi


class Detached(Exception):
    """This worker is no longer part of the cluster (raised by `commit` and
    `resize`; `run` returns None on it)."""


class TorchState:
    """A model, an optimizer, the step and any picklable extras (keyword
    arguments, read and written as attributes), kept consistent across a
    changing cluster."""

    def __init__(self, model=None, optimizer=None, step=0, **extras):
        self.model, self.optimizer, self.step = model, optimizer, int(step)
        self._extras = dict(extras)
        self._saved = None
        self._synced = False

    def __getattr__(self, name):
        extras = self.__dict__.get("_extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if "_extras" in self.__dict__ and name in self._extras:
            self._extras[name] = value
        else:
            super().__setattr__(name, value)

    # the tensors of the model, synced in place (same names and sizes on
    # every rank); the optimizer's state and the extras as one blob
    def _tensors(self):
        if self.model is None:
            return {}
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            t = v.data if isinstance(v, torch.nn.Parameter) else v
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"kungfu: state tensor {k!r} must be a contiguous CPU tensor")
            out[f"model.{k}"] = t
        return out

    def _blob(self) -> bytes:
        buf = io.BytesIO()
        opt = self.optimizer.state_dict() if self.optimizer is not None else None
        torch.save({"optimizer": opt, "extras": self._extras}, buf)
        return buf.getvalue()

    def _load_blob(self, data: bytes) -> None:
        d = torch.load(io.BytesIO(data), weights_only=False)
        if self.optimizer is not None and d["optimizer"] is not None:
            self.optimizer.load_state_dict(d["optimizer"])
        self._extras.update(d["extras"])

    def sync(self) -> None:
        """Makes every worker's state that of the lowest-ranked worker that
        has one (a worker that joined has none). A collective."""
        blob = bytearray(self._blob())
        size = bytearray(len(blob).to_bytes(8, "little"))
        step = kungfu.sync_state(self.step, {"kungfu.elastic.blob_size": size})
        n = int.from_bytes(size, "little")
        if n != len(blob):
            blob = bytearray(n)
        bufs = self._tensors()
        bufs["kungfu.elastic.blob"] = blob
        self.step = kungfu.sync_state(step, bufs)
        self._load_blob(bytes(blob))
        self._synced = True

    def save(self) -> None:
        """The rollback point (in memory)."""
        model = copy.deepcopy(self.model.state_dict()) if self.model is not None else None
        self._saved = (self.step, model, self._blob())

    def restore(self) -> None:
        """Back to the last `save`/`commit`."""
        if self._saved is None:
            return
        step, model, blob = self._saved
        self.step = step
        if model is not None:
            self.model.load_state_dict(model)
        self._load_blob(blob)

    def commit(self) -> None:
        """Saves the state, then follows a resize the config server holds
        (when the job has one): raises `Detached` on a worker that left."""
        self.save()
        if _has_config_server():
            resize_from_config(self)

    def resize(self, new_size: int) -> None:
        """Resizes the cluster to `new_size` workers (a collective, at the
        same step everywhere) and syncs the state; raises `Detached` on a
        worker that left."""
        _follow(self, kungfu.resize(new_size))


def _has_config_server() -> bool:
    import os
    return bool(os.environ.get("KUNGFU_CONFIG_SERVER"))


def _cluster_changed() -> None:
    """Every worker of the new cluster (a joiner too) starts the Horovod
    API's per-process counters (unnamed ops, join's announcements) again,
    so that they agree."""
    from . import _common, _join

    _common.reset_names()
    _join.reset()


def _follow(state, result) -> None:
    changed, detached = result
    if detached:
        raise Detached(f"kungfu: rank {kungfu.rank()}: this worker left the cluster")
    if changed:
        _cluster_changed()
        state.sync()
        state.save()


def resize_from_config(state) -> None:
    """Applies the cluster the config server holds now (a collective)."""
    _follow(state, kungfu.resize_from_config())


def is_peer_lost(e: BaseException) -> bool:
    """Whether `e` (of a kungfu op, from C++ or Python) is a lost peer."""
    return isinstance(e, _capi.PeerLostError) or "[KF_ERR_PEER_LOST]" in str(e)


def run(fn):
    """Wraps a training function `fn(state, ...)`: syncs the state first;
    on a lost peer, the survivors shrink the cluster, roll back to the last
    commit and call `fn` again; a worker that left returns None."""

    @functools.wraps(fn)
    def wrapper(state, *args, **kwargs):
        kungfu.init()
        state.sync()
        state.save()
        while True:
            try:
                return fn(state, *args, **kwargs)
            except Detached:
                return None
            except RuntimeError as e:
                if not is_peer_lost(e):
                    raise
                try:
                    kungfu.recover()
                except _capi.MembershipChangedError:
                    return None
                _cluster_changed()
                state.restore()
                state.sync()
                state.save()

    return wrapper


class ElasticSampler:
    """A sampler for elastic training, with the semantics of horovod's
    `horovod.torch.elastic.ElasticSampler`: within an epoch, across changes
    of the batch size and of the cluster, every sample of `dataset` is seen
    exactly once by the cluster.

    The epoch's order is a permutation of the dataset's indices that
    depends only on `seed` and the epoch (`shuffle=False`: in order), so
    every worker knows it without communicating. What the cluster has
    processed is a set of indices (`record_batch`, `record_indices`), part
    of `state_dict()` (which `PolicyRunner` syncs to workers that join).
    The rest is split between the workers of the cluster now:

    * `get_indices(batch_idx, batch_size)` is this worker's part of the
      `batch_idx`-th global batch of `batch_size` samples per worker taken
      from what remains: the global batch is the next
      `batch_size * size` remaining indices, and worker `r` has every
      `size`-th from the `r`-th. A remainder too small for every worker to
      have a sample is folded into the batch before it, so that no worker
      is ever handed an empty batch (the last batch of an epoch may hold
      up to `size - 1` more samples than the others).
    * iterating yields this worker's share of all that remains (every
      `size`-th index), as horovod's does, but without padding: the
      workers' shares differ in length by at most one.

    Call `reset()` after the cluster changed (the runner does), and
    `set_epoch(e)` at the start of each epoch (it forgets what was
    processed).
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def _order(self):
        n = len(self.dataset)
        key = (n, self.shuffle, self.seed, self.epoch)
        if getattr(self, "_order_key", None) != key:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                self._order_list = torch.randperm(n, generator=g).tolist()
            else:
                self._order_list = list(range(n))
            self._order_key = key
        return self._order_list

    def reset(self):
        """Takes the cluster as it is now (rank and size) and recomputes
        what remains of the epoch."""
        self.rank = kungfu.rank() if kungfu.is_initialized() else 0
        self.num_replicas = kungfu.size() if kungfu.is_initialized() else 1
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise RuntimeError(f"kungfu: ElasticSampler: rank {self.rank} of "
                               f"{self.num_replicas} (is the library initialized?)")
        done = self.processed_indices
        self.remaining_indices = [i for i in self._order() if i not in done]
        self.indices = self.remaining_indices[self.rank::self.num_replicas]
        self.num_samples = len(self.indices)
        self._cursor = 0

    def set_epoch(self, epoch):
        """Starts epoch `epoch`: a new order, nothing processed."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def _bounds(self, batch_idx, batch_size, first=0):
        """[start, end) in `remaining_indices` of the `batch_idx`-th global
        batch from position `first` (empty past the end)."""
        if batch_size < 1:
            raise ValueError(f"kungfu: a batch size of {batch_size}: at least 1")
        if batch_idx < 0:
            raise ValueError(f"kungfu: batch index {batch_idx}: at least 0")
        total, step = len(self.remaining_indices), batch_size * self.num_replicas
        start = min(first + batch_idx * step, total)
        end = min(start + step, total)
        if 0 < total - end < self.num_replicas:
            end = total  # a remainder some worker would have none of
        if start > 0 and start < total and total - start < self.num_replicas:
            start = end  # folded into the batch before
        return start, end

    def global_batch(self, batch_idx, batch_size):
        """Every worker's indices of the `batch_idx`-th global batch."""
        start, end = self._bounds(batch_idx, batch_size)
        return self.remaining_indices[start:end]

    def get_indices(self, batch_idx, batch_size):
        """This worker's indices of the `batch_idx`-th global batch
        (empty once the epoch is done)."""
        return self.global_batch(batch_idx, batch_size)[self.rank::self.num_replicas]

    def num_batches(self, batch_size):
        """How many global batches of `batch_size` per worker remain."""
        n = 0
        while self._bounds(n, batch_size)[0] < len(self.remaining_indices):
            n += 1
        return n

    def next_batch(self, batch_size):
        """The next global batch (every worker's indices) after the ones
        `advance` moved past since the last `reset`; empty at the end."""
        start, end = self._bounds(0, batch_size, self._cursor)
        return self.remaining_indices[start:end]

    def advance(self, batch):
        """Marks `batch` (what `next_batch` gave) processed and moves past
        it, without recomputing what remains (`reset` does)."""
        self.processed_indices.update(batch)
        self._cursor += len(batch)

    def record_batch(self, batch_idx, batch_size):
        """Marks the `batch_idx`-th global batch processed by the cluster
        (every worker's part of it: each worker can compute them)."""
        self.record_indices(self.global_batch(batch_idx, batch_size))

    def record_indices(self, indices):
        """Marks `indices` processed. Takes effect at the next `reset`."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices),
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state):
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.processed_indices = set(int(i) for i in state["processed_indices"])
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
