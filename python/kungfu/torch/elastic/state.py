"""The elastic state (`TorchState`) and the training loop that keeps it
through changes of the cluster (`run`); see the package's docs."""

import copy
import functools
import io
import time

import torch

import kungfu

from ... import _capi
from .fsdp import full_state, is_fsdp, load_full_state
from .groups import refresh_torch_groups, reset_ddp
from .sampler import ElasticSampler


class HostsUpdatedInterrupt(RuntimeError):
    """The cluster changed at a `commit` (workers were added or removed):
    the state is synced already; `run` calls the training function again
    with it, as Horovod's elastic `run` does (`skip_sync`: no sync is
    needed before that, as here)."""

    def __init__(self, skip_sync=True):
        super().__init__("kungfu: the cluster changed at a commit")
        self.skip_sync = skip_sync


class Detached(Exception):
    """This worker is no longer part of the cluster (raised by `commit` and
    `resize`; `run` returns None on it)."""


class TorchState:
    """A model, an optimizer, the step and any other state (keyword
    arguments, read and written as attributes), kept consistent across a
    changing cluster.

    The model may be a `DistributedDataParallel` module over the kungfu
    backend: when the cluster changes, its reducer starts afresh (as a
    DDP made then would), so that survivors and joiners bucket alike. A
    keyword argument that is an `ElasticSampler` is synced, saved and
    restored in place, through its `state_dict`; any other is pickled.
    The state at construction is the first rollback point. A change of
    the cluster is taken at a `commit`; new workers are connected in the
    background meanwhile (`wait_for_new_workers=True`: the commit that
    sees the change waits for them).

    An FSDP2 model (`fully_shard`) needs `rebuild`: a function that makes
    the model and its optimizer again for the cluster as it is now (a new
    mesh of `kungfu.size()` workers, `fully_shard`, the optimizer) and
    returns `(model, optimizer)`. Its rollback point is the whole state,
    gathered at each `commit` (a collective); after a change of the cluster
    `rebuild` runs and the whole state is loaded into the new model, each
    worker keeping its shards. The training loop then uses `state.model`
    and `state.optimizer`, which are the new ones. A worker that joins
    makes its model with `rebuild` too and gets the state at `run`'s first
    sync.
    """

    def __init__(self, model=None, optimizer=None, step=0, rebuild=None,
                 wait_for_new_workers=False, **kwargs):
        self.model, self.optimizer, self.step = model, optimizer, int(step)
        self.rebuild = rebuild
        self.wait_for_new_workers = bool(wait_for_new_workers)
        self._fsdp = is_fsdp(model)
        if self._fsdp and rebuild is None:
            raise ValueError("kungfu: TorchState of an FSDP2 model needs rebuild=, a function "
                             "that makes the model and its optimizer again for a new cluster")
        # a worker that joined a running job has no state yet (and makes
        # no collective of its own before run's first sync)
        self._joined = kungfu.is_initialized() and kungfu.version() > 0
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        self._extras = {k: v for k, v in kwargs.items() if k not in self._samplers}
        self._reset_callbacks = []
        self._saved = None
        self._synced = False
        # what `run` recovered from: {"error", "failed_at", "recovered_at",
        # "size"} each (times from time.time(); this worker's, not synced)
        self.recoveries = []
        # the last sync's {"seconds", "bytes"} (what the broadcast moved)
        self.last_sync = None
        if not self._fsdp:
            self.save()  # (an FSDP model's is gathered at run's first sync)

    def __getattr__(self, name):
        for part in ("_extras", "_samplers"):
            d = self.__dict__.get(part, {})
            if name in d:
                return d[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if "_extras" in self.__dict__ and name in self._extras:
            self._extras[name] = value
        elif "_samplers" in self.__dict__ and name in self._samplers:
            self._samplers[name] = value
        else:
            super().__setattr__(name, value)

    # the tensors of the model, synced in place (same names and sizes on
    # every rank); the optimizer's state, the samplers' and the extras as
    # one blob
    def _tensors(self):
        if self.model is None or self._fsdp:
            return {}
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            t = v.data if isinstance(v, torch.nn.Parameter) else v
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"kungfu: state tensor {k!r} must be a contiguous CPU tensor")
            out[f"model.{k}"] = t
        return out

    def _blob(self, with_model=True) -> bytes:
        """The state but the (unsharded) model's tensors; an FSDP model's
        whole state with it, gathered now (a collective), if `with_model`."""
        buf = io.BytesIO()
        d = {"extras": self._extras,
             "samplers": {k: s.state_dict() for k, s in self._samplers.items()}}
        if self._fsdp:
            d["fsdp"] = full_state(self.model, self.optimizer) if with_model else None
        else:
            d["optimizer"] = self.optimizer.state_dict() if self.optimizer is not None else None
        torch.save(d, buf)
        return buf.getvalue()

    def _load_blob(self, data: bytes) -> None:
        d = torch.load(io.BytesIO(data), weights_only=False)
        if d.get("fsdp") is not None:
            load_full_state(self.model, self.optimizer, *d["fsdp"])
        elif self.optimizer is not None and d.get("optimizer") is not None:
            self.optimizer.load_state_dict(d["optimizer"])
        self._extras.update(d["extras"])
        for k, st in d.get("samplers", {}).items():
            if k in self._samplers:
                self._samplers[k].load_state_dict(st)

    def sync(self) -> None:
        """Makes every worker's state that of the lowest-ranked worker that
        has one (a worker that joined has none), and the rollback point. A
        collective."""
        if not self._fsdp:
            blob = bytearray(self._blob())
        elif self._saved is not None:
            # what was saved before the change, on the mesh of then (the
            # model was made again since)
            blob = bytearray(self._saved[2])
        else:
            # at the start: gathered now, but by a joiner, which has none
            blob = bytearray(self._blob(with_model=not self._joined))
        size = bytearray(len(blob).to_bytes(8, "little"))
        step = kungfu.sync_state(self.step, {"kungfu.elastic.blob_size": size})
        n = int.from_bytes(size, "little")
        if n != len(blob):
            blob = bytearray(n)
        bufs = self._tensors()
        bufs["kungfu.elastic.blob"] = blob
        t0 = time.time()
        self.step = kungfu.sync_state(step, bufs)
        # what moved, for a benchmark of the state transfer
        self.last_sync = {"seconds": time.time() - t0,
                          "bytes": sum(t.numel() * t.element_size() if torch.is_tensor(t)
                                       else len(t) for t in bufs.values())}
        self._load_blob(bytes(blob))
        self._synced = True
        self._joined = False
        if self._fsdp:
            self._saved = (self.step, None, bytes(blob))  # the state just loaded
        else:
            self.save()

    def save(self) -> None:
        """The rollback point (in memory); of an FSDP model, gathered (a
        collective)."""
        model = None
        if self.model is not None and not self._fsdp:
            model = copy.deepcopy(self.model.state_dict())
        self._saved = (self.step, model, self._blob())

    def restore(self) -> None:
        """Back to the last `save`/`commit`/`sync`."""
        if self._saved is None:
            return
        step, model, blob = self._saved
        self.step = step
        if model is not None:
            self.model.load_state_dict(model)
        self._load_blob(blob)

    def commit(self) -> None:
        """Saves the state, then follows a change the config server holds
        (when the job has one): raises `Detached` on a worker that left,
        and `HostsUpdatedInterrupt` where the cluster changed (the state
        synced; `run` calls the training function again with it).
        New workers (a grow, a replacement) are connected in the
        background while training goes on, and taken in at the first
        commit after every worker connected them (`kungfu.poll_resize`);
        with `wait_for_new_workers=True`, at the first commit that sees
        the change, which waits for them to start."""
        self.save()
        if _has_config_server():
            if self.wait_for_new_workers:
                resize_from_config(self)
            else:
                _follow(self, kungfu.poll_resize())

    def resize(self, new_size: int) -> None:
        """Resizes the cluster to `new_size` workers (a collective, at the
        same step everywhere) and syncs the state; raises `Detached` on a
        worker that left, `HostsUpdatedInterrupt` when it changed."""
        _follow(self, kungfu.resize(new_size))

    def check_host_updates(self) -> None:
        """Horovod's: follows a change the config server holds (as `commit`
        does, without saving); raises `HostsUpdatedInterrupt` when the
        cluster changed, the state synced."""
        if _has_config_server():
            _follow(self, kungfu.poll_resize())

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (without arguments) on every worker after each
        change of the cluster, once the state is synced (e.g. to scale the
        learning rate with `kungfu.size()`)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs the reset callbacks."""
        for cb in self._reset_callbacks:
            cb()

    def _cluster_changed(self) -> None:
        """The torch objects this state holds follow a new cluster: a DDP
        model gets a fresh reducer, an FSDP model is made again (`rebuild`;
        the state is loaded into it by `restore` or `sync`), the samplers
        take this worker's new share."""
        if self._fsdp:
            self.model, self.optimizer = self.rebuild()
        elif self.model is not None:
            reset_ddp(self.model)
        for s in self._samplers.values():
            s.reset()


def _has_config_server() -> bool:
    import os
    return bool(os.environ.get("KUNGFU_CONFIG_SERVER"))


def _cluster_changed(state=None) -> None:
    """Every worker of the new cluster (a joiner too) starts the Horovod
    API's per-process counters (unnamed ops, join's announcements) again,
    so that they agree; torch's groups of every rank on the kungfu backend
    take the new rank and size, and the torch objects of `state` follow."""
    from .. import _common, _join

    _common.reset_names()
    # the ops of the old cluster will never complete: their names are free
    _common.release_all()
    _join.reset()
    refresh_torch_groups()
    if state is not None:
        state._cluster_changed()


def _follow(state, result) -> None:
    changed, detached = result
    if detached:
        raise Detached(f"kungfu: rank {kungfu.rank()}: this worker left the cluster")
    if changed:
        _cluster_changed(state)
        state.sync()
        state.on_reset()
        raise HostsUpdatedInterrupt(skip_sync=True)


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
        while True:
            try:
                return fn(state, *args, **kwargs)
            except Detached:
                return None
            except HostsUpdatedInterrupt:
                continue  # synced at the commit that changed: go on from there
            except RuntimeError as e:
                if not is_peer_lost(e):
                    raise
                failed_at = time.time()
                try:
                    kungfu.recover()
                except _capi.MembershipChangedError:
                    return None
                _cluster_changed(state)
                state.restore()
                state.sync()
                state.on_reset()
                state.recoveries.append({"error": str(e), "failed_at": failed_at,
                                         "recovered_at": time.time(), "size": kungfu.size()})

    return wrapper
