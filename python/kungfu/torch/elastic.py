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
