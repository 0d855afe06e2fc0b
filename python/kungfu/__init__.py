"""KungFu-rs from Python, through its C ABI (kungfu.h).

The framework-independent part: identity, adaptation (strategy, transport,
elastic resizing, recovery) and monitors. `kungfu.torch` adds the
torch.distributed backend "kungfu" and a Horovod-compatible API.

Under `kungfu-run -np N python train.py`, torchrun, `srun` or `mpirun` the
library finds its peers itself (see the README's launcher table).
"""

import ctypes as C

from . import _capi
from ._capi import (  # noqa: F401  (re-exported)
    KungFuError,
    MembershipChangedError,
    MismatchError,
    PeerLostError,
    STRATEGIES,
    TRANSPORTS,
)

_lib = _capi.lib

__all__ = [
    "KungFuError", "PeerLostError", "MembershipChangedError", "MismatchError",
    "init", "finalize", "is_initialized", "rank", "size", "local_rank", "local_size",
    "version", "cluster_version", "barrier", "set_strategy", "set_transport",
    "propose_new_size", "resize", "resize_from_config", "sync_state", "recover",
    "stall_report", "NoiseScale", "gradient_variance", "Action", "propose", "agree",
    "peer_stats", "reset_stats", "save", "request",
]

_initialized = False


def init() -> None:
    """Starts the library (idempotent)."""
    global _initialized
    _capi.check("kf_init")
    _initialized = True


def finalize() -> None:
    """Stops the library; later calls raise (`KF_ERR_FINALIZED`)."""
    global _initialized
    _capi.check("kf_finalize")
    _initialized = False


def is_initialized() -> bool:
    return _initialized


def rank() -> int:
    """This worker's rank (-1 before init)."""
    return _lib.kf_rank()


def size() -> int:
    return _lib.kf_size()


def local_rank() -> int:
    return _lib.kf_local_rank()


def local_size() -> int:
    return _lib.kf_local_size()


def version() -> int:
    """The cluster version: 0 at start, +1 per resize or recovery."""
    return _lib.kf_version()


def cluster_version() -> int:
    return _lib.kf_cluster_version()


def barrier() -> None:
    """Blocks until every rank called it."""
    _capi.wait("kf_barrier", lambda h: _lib.kf_barrier(None, None, h))


def _enum(table, value, what):
    if isinstance(value, int):
        return value
    try:
        return table[str(value).lower().replace("-", "_")]
    except KeyError:
        raise ValueError(f"kungfu: unknown {what} {value!r}: one of {', '.join(table)}") from None


def set_strategy(strategy) -> None:
    """Switches the communication strategy of later ops on every rank (a
    collective: every rank calls it at the same point with the same one).
    `strategy`: a name of `kungfu.STRATEGIES` ("ring", "binary_tree_star",
    ...) or its number."""
    _capi.check("kf_set_strategy", _enum(STRATEGIES, strategy, "strategy"))


def set_transport(transport) -> None:
    """Switches the transport of later ops on every rank (a collective):
    "tcp", "shm", "quic", "fabric", "verbs" or "auto"."""
    _capi.check("kf_set_transport", _enum(TRANSPORTS, transport, "transport"))


def propose_new_size(new_size: int) -> None:
    """Asks the config server (`kungfu-run -w`) for a cluster of
    `new_size` workers; every worker switches at its next
    `resize_from_config()`."""
    _capi.check("kf_propose_new_size", int(new_size))


def resize(new_size: int):
    """Resizes an elastic job to `new_size` workers (a collective).
    Returns `(changed, detached)`: call `sync_state` when changed; a
    detached worker should finalize and exit."""
    changed, detached = C.c_int32(0), C.c_int32(0)
    _capi.check("kf_resize", int(new_size), C.byref(changed), C.byref(detached))
    return bool(changed.value), bool(detached.value)


def resize_from_config():
    """Like `resize`, to the cluster the config server holds now."""
    changed, detached = C.c_int32(0), C.c_int32(0)
    _capi.check("kf_resize_from_config", C.byref(changed), C.byref(detached))
    return bool(changed.value), bool(detached.value)


def poll_resize():
    """Like `resize_from_config`, without waiting for new workers: a newer
    cluster is connected in the background, and every worker switches at
    the first call after all of them connected it (`(changed, detached)`
    until then `(False, False)`). A collective: call it at each commit."""
    changed, detached = C.c_int32(0), C.c_int32(0)
    _capi.check("kf_poll_resize", C.byref(changed), C.byref(detached))
    return bool(changed.value), bool(detached.value)


def _buffer(obj):
    """(address, bytes) of a writable buffer: a torch tensor (contiguous,
    on the CPU), or anything with the writable buffer protocol."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if getattr(obj, "device", None) is not None and obj.device.type != "cpu":
            raise ValueError(f"kungfu: a tensor on {obj.device}: only CPU tensors")
        if not obj.is_contiguous():
            raise ValueError("kungfu: a non-contiguous tensor")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    view = memoryview(obj)
    if view.readonly:
        raise ValueError("kungfu: a read-only buffer")
    view = view.cast("B")
    addr = C.addressof(C.c_char.from_buffer(view)) if len(view) else 0
    return addr, len(view)


def sync_state(step: int, buffers: dict) -> int:
    """Brings every worker to the same state: `step` and the named buffers
    (name -> tensor or writable buffer, the same names and sizes on every
    rank) are overwritten with those of the lowest-ranked worker that has
    state. Returns that step. A collective: call it at start and after
    every resize that changed the cluster."""
    names = sorted(buffers)
    n = len(names)
    cnames = (C.c_char_p * max(n, 1))(*[s.encode() for s in names])
    addrs = (C.c_void_p * max(n, 1))()
    sizes = (C.c_uint64 * max(n, 1))()
    keep = []
    for i, name in enumerate(names):
        addr, nbytes = _buffer(buffers[name])
        keep.append(buffers[name])
        addrs[i], sizes[i] = addr, nbytes
    s = C.c_uint64(int(step))
    _capi.check("kf_sync_state", C.byref(s), cnames, addrs, sizes, n)
    return s.value


class Action:
    """An adaptation action, as proposed or agreed (`kind`: "set_strategy",
    "resize", "set_batch_size", "custom" or "set_transport")."""

    KINDS = {"set_strategy": _capi.ACTION_SET_STRATEGY, "resize": _capi.ACTION_RESIZE,
             "set_batch_size": _capi.ACTION_SET_BATCH_SIZE, "custom": _capi.ACTION_CUSTOM,
             "set_transport": _capi.ACTION_SET_TRANSPORT}

    def __init__(self, kind: str, value: int, custom_kind: int = 0):
        if kind not in self.KINDS:
            raise ValueError(f"kungfu: unknown action kind {kind!r}: one of {', '.join(self.KINDS)}")
        self.kind, self.value, self.custom_kind = kind, int(value), int(custom_kind)

    def __repr__(self):
        extra = f", custom_kind={self.custom_kind}" if self.kind == "custom" else ""
        return f"Action({self.kind!r}, {self.value}{extra})"

    def __eq__(self, other):
        return isinstance(other, Action) and (self.kind, self.value, self.custom_kind) == (
            other.kind, other.value, other.custom_kind)


def propose(action: Action) -> None:
    """Proposes `action` for the next `agree` (a local call)."""
    if action.kind in ("set_strategy", "set_transport") and not isinstance(action.value, int):
        raise ValueError("kungfu: the value of a strategy or transport action is its number")
    a = _capi.Action(Action.KINDS[action.kind], action.custom_kind, action.value)
    _capi.check("kf_propose", C.byref(a))


def agree(step: int) -> list:
    """An agreement point at training step `step` (a collective): every
    worker gets the same actions. Per kind (per custom kind for "custom"),
    the value proposed by the most workers wins, a tie going to the most
    senior proposer's (in the cluster since the earliest version, then the
    lowest rank). Strategy changes are applied here; resize with
    `resize(a.value)`, switch transports with `set_transport(a.value)`."""
    out = (_capi.Action * 16)()
    n = C.c_int32(0)
    _capi.check("kf_agree", int(step), out, 16, C.byref(n))
    names = {v: k for k, v in Action.KINDS.items()}
    return [Action(names[a.kind], a.value, a.custom_kind) for a in out[: n.value]]


def recover() -> None:
    """After a `PeerLostError`: the survivors agree on who is left and go on
    as a smaller cluster (then call `sync_state`). Needs the job's config
    server (`kungfu-run --on-failure shrink`)."""
    _capi.check("kf_recover")


def stall_report() -> str:
    """One line per op some worker has waited on for
    `KUNGFU_STALL_TIMEOUT_MS`, naming the ranks that have not posted it."""
    n = C.c_int32(0)
    _capi.check("kf_stall_report", None, 0, C.byref(n))
    buf = C.create_string_buffer(n.value + 1)
    _capi.check("kf_stall_report", buf, n.value + 1, C.byref(n))
    return buf.value.decode(errors="replace")


class NoiseScale:
    """The gradient noise scale monitor (McCandlish et al.): feed it each
    step's squared gradient norms; `update` returns the smoothed
    `B_simple` (NaN while there is no estimate)."""

    def __init__(self, name: str = "noise_scale", alpha: float = 0.6):
        self.name, self.alpha = name, float(alpha)
        self.value = float("nan")

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float:
        """`small_sq`: the squared norm of a worker's gradient over `b_small`
        examples (best averaged over the workers); `big_sq`: that of the
        allreduced gradient over `b_big > b_small` examples."""
        out = C.c_double(0.0)
        _capi.check("kf_noise_scale", self.name.encode(), self.alpha, float(small_sq),
                    float(big_sq), float(b_small), float(b_big), C.byref(out))
        self.value = out.value
        return out.value


def gradient_variance(mean_local_sq: float, mean_grad_sq: float) -> float:
    """The variance of the workers' gradients around their mean, from the
    mean of their squared norms and the squared norm of the mean gradient."""
    return _lib.kf_gradient_variance(float(mean_local_sq), float(mean_grad_sq))


def peer_stats() -> list:
    """Per peer (indexed by rank; this worker's own entry is zeros), what
    completed ops received from it since the start or `reset_stats()`:
    dicts of `ops`, `frames`, `bytes`, `rate` (bytes/s) and
    `mean_latency` (s)."""
    cap = max(size(), 1)
    out = (_capi.PeerStats * cap)()
    n = C.c_int32(0)
    _capi.check("kf_get_peer_stats", out, cap, C.byref(n))
    return [{f: getattr(s, f) for f, _ in _capi.PeerStats._fields_} for s in out[: min(n.value, cap)]]


def reset_stats() -> None:
    """Starts a new window of `peer_stats` (and of the strategy stats)."""
    _capi.check("kf_reset_stats")


def save(name: str, buffer) -> int:
    """Publishes a copy of `buffer` (a CPU tensor or any bytes-like object)
    as this worker's latest `name`; returns its version (1, 2, ...). Peers
    fetch it with `request`, without this worker taking part."""
    if hasattr(buffer, "data_ptr"):
        addr, nbytes = _buffer(buffer)
        data = None
    else:
        data = bytes(memoryview(buffer).cast("B"))  # kept alive during the call
        addr, nbytes = C.cast(C.c_char_p(data), C.c_void_p), len(data)
    v = C.c_uint64(0)
    _capi.check("kf_save", name.encode(), addr, nbytes, C.byref(v))
    del data
    return v.value


def request(peer: int, name: str, out) -> int:
    """Fetches `peer`'s latest `name` into `out` (a writable buffer of
    exactly its size); returns its version. Waits, within the op timeout,
    for a peer that has not published `name` yet."""
    addr, nbytes = _buffer(out)
    v = C.c_uint64(0)
    _capi.wait("kf_request", lambda h: _lib.kf_request(int(peer), name.encode(), addr, nbytes,
                                                        C.byref(v), None, None, h))
    return v.value
