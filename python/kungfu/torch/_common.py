"""What the ops of the Horovod-compatible API share: the initialized
state, the reduction constants, tensor checks, Horovod's scaling rules,
op names (and the table of names in flight), the per-op metadata that
catches cross-rank mismatches the library cannot see, and handles.

Every op is asynchronous and named; the library matches ops across ranks
by name, so ranks may issue them in any order. An op of the API is one or
more library ops:

* its data op, named `<kind>.<name>` (`<kind>.noname.<N>` without a name:
  N counts the unnamed ops of that kind in this process, so ranks that issue
  the same unnamed ops agree on the names);
* for checked ops, a fixed-size allgather of every rank's metadata (type,
  shape, reduction, root, scale factors) named `meta:<kind>.<name>`, so a
  mismatch the library does not catch (the same element count in another
  shape, a different root) fails on every rank, in `synchronize`;
* an announcement for `hvd.join` (see _join.py).
"""

import struct
import threading
import warnings
from collections import OrderedDict

import torch

import kungfu

from . import _C

# horovod/common/message.h's numbers
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}
# kungfu.h's reductions
KF_SUM, KF_MIN, KF_MAX, KF_PROD, KF_AVG = 0, 1, 2, 3, 4

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8, torch.int8, torch.int16, torch.bool]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}

lock = threading.RLock()


class HorovodInternalError(RuntimeError):
    """An op failed (on every rank that took part): a mismatch between the
    ranks, a lost peer, a timeout. As horovod's, a RuntimeError."""


class _State:
    initialized = False


state = _State()


def check_initialized():
    if not state.initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def prefix():
    return f"kungfu: rank {kungfu.rank()}: "


def check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{prefix()}{what}: expected a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{prefix()}{what}: a tensor on {tensor.device}: kungfu.torch moves "
                         "CPU tensors only (move it with .cpu())")
    if tensor.layout != torch.strided:
        raise ValueError(f"{prefix()}{what}: only dense tensors are supported, not {tensor.layout}")
    if tensor.dtype not in DTYPE_CODE:
        raise ValueError(f"{prefix()}{what}: tensors of type {tensor.dtype} are not supported")


def check_process_set(process_set):
    """Only the global process set: horovod's process sets are not
    supported."""
    from .mpi_ops import global_process_set
    if process_set is None or process_set is global_process_set:
        return
    ranks = getattr(process_set, "ranks", None)
    if ranks is not None and list(ranks) == list(range(kungfu.size())):
        return
    raise NotImplementedError("kungfu.torch: process sets are not supported: ops span every "
                              "rank (use the global process set)")


def average_op(average, op):
    """horovod's reconciliation of the deprecated `average` with `op`
    (default Average)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def kf_op(op, dtype, what):
    """The library's reduction for a horovod op (Average: AVG for floats,
    SUM for integers, which are then divided with truncation)."""
    if op == Adasum:
        raise NotImplementedError(f"{prefix()}{what}: Adasum is not supported by kungfu.torch")
    if op == Average:
        return KF_AVG if dtype.is_floating_point else KF_SUM
    table = {Sum: KF_SUM, Min: KF_MIN, Max: KF_MAX, Product: KF_PROD}
    if op not in table:
        raise ValueError(f"{prefix()}{what}: unknown reduction op {op!r}")
    if dtype == torch.bool and op in (Sum, Product):
        raise ValueError(f"{prefix()}{what}: {OP_NAMES[op]} of bool tensors is not supported")
    return table[op]


def scaled(tensor, factor):
    """`factor * tensor` in horovod's arithmetic (ScaleBuffer): float16 and
    bfloat16 in float32, float32 in float32, integers in float64 and
    truncated back."""
    dt = tensor.dtype
    if dt in (torch.float16, torch.bfloat16):
        return (tensor.float() * torch.tensor(factor, dtype=torch.float32)).to(dt)
    if dt == torch.float32:
        return tensor * torch.tensor(factor, dtype=torch.float32)
    if dt == torch.float64:
        return tensor * float(factor)
    if dt == torch.bool:
        raise ValueError(f"{prefix()}cannot scale a bool tensor")
    return (tensor.double() * float(factor)).to(dt)


def finish_reduction(out, op, size, postscale):
    """What follows the library's reduction: the integer division of an
    integer Average, then the postscale factor (in place)."""
    if op == Average and not out.dtype.is_floating_point:
        out.copy_(torch.div(out, size, rounding_mode="trunc"))
    if postscale != 1.0:
        out.copy_(scaled(out, postscale))
    return out


# ---- names ----

_counters = {}
# names in flight: full name -> the Handle using it
_inflight = {}


def reset_names():
    """Unnamed ops count from 0 again (after the cluster changed: every
    worker, a new one too, does it at the same point)."""
    with lock:
        _counters.clear()


def full_name(kind, name):
    if name is None:
        with lock:
            n = _counters.get(kind, 0)
            _counters[kind] = n + 1
        return f"{kind}.noname.{n}"
    return f"{kind}.{name}"


def claim(names, handle):
    """Registers `names` for `handle`; a name still in use raises ValueError
    (here, when the op is issued, as horovod does). A name is in use from
    its op's start until its handle is synchronized (not merely until the
    op completes, which would make the error depend on timing)."""
    with lock:
        for n in names:
            h = _inflight.get(n)
            if h is not None and h is not handle:
                raise ValueError(f"{prefix()}an op named {n!r} is already in flight: names must "
                                 "be unique among ops not synchronized yet (synchronize the "
                                 "first one, or use another name)")
        for n in names:
            _inflight[n] = handle
        handle.names.extend(names)


def release(handle):
    with lock:
        for n in handle.names:
            if _inflight.get(n) is handle:
                del _inflight[n]


def release_all():
    with lock:
        _inflight.clear()


# ---- metadata ----

META_LEN = 24
META_KINDS = {"allreduce": 1, "broadcast": 2, "alltoall": 3, "reducescatter": 4}
_KIND_NAMES = {v: k for k, v in META_KINDS.items()}


def _bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _unbits(x):
    return struct.unpack("<d", struct.pack("<q", int(x)))[0]


def meta_row(kind, tensor, op=-1, root=-1, pre=1.0, post=1.0, joined=False):
    """One rank's description of one tensor of an op (META_LEN int64)."""
    row = [0] * META_LEN
    row[0] = META_KINDS[kind]
    row[1] = 1 if joined else 0
    if tensor is not None:
        row[2] = DTYPE_CODE[tensor.dtype]
        shape = list(tensor.shape)
        row[3] = len(shape)
        if len(shape) > 8:
            folded = 1
            for d in shape[7:]:
                folded *= d
            shape = shape[:7] + [folded]
        row[4:4 + len(shape)] = shape
        row[12] = tensor.numel()
    row[13], row[14], row[15], row[16] = op, root, _bits(pre), _bits(post)
    return row


def joined_rows(count):
    rows = []
    for _ in range(count):
        row = [0] * META_LEN
        row[1] = 1
        rows.extend(row)
    return rows


def _describe(row):
    if row[1]:
        return "nothing (it has joined)"
    dt = DTYPES[row[2]] if 0 <= row[2] < len(DTYPES) else "?"
    shape = row[4:4 + min(row[3], 8)]
    s = f"{str(dt).replace('torch.', '')} {list(shape)}"
    kind = _KIND_NAMES.get(row[0], "?")
    if kind in ("allreduce", "reducescatter"):
        s += f" op={OP_NAMES.get(row[13], row[13])}"
        if row[15] != _bits(1.0) or row[16] != _bits(1.0):
            s += f" prescale={_unbits(row[15]):g} postscale={_unbits(row[16]):g}"
    if kind == "broadcast":
        s += f" root={row[14]}"
    return s


def _key(row, kind):
    if kind == "alltoall":  # the first dimension may differ
        return (row[0], row[2], row[3], tuple(row[5:12]))
    return tuple(row[:1] + row[2:])


def meta_issue(name, rows):
    """Starts the allgather of this rank's metadata rows (a list of ints);
    returns (work, gathered)."""
    mine = torch.tensor(rows, dtype=torch.int64)
    gathered = torch.empty(mine.numel() * kungfu.size(), dtype=torch.int64)
    return _C.allgather(mine, gathered, "meta:" + name), gathered


def meta_check(name, gathered, members=1, extra=0):
    """Raises HorovodInternalError on every rank if the ranks' rows
    differ (ranks that joined are left out)."""
    n = kungfu.size()
    per = members * META_LEN + extra
    g = gathered.view(n, per).tolist()
    base = None
    for r in range(n):
        rows = g[r]
        if rows[1]:
            continue
        if base is None:
            base = (r, rows)
            continue
        b = base[1]
        for m in range(members):
            x, y = b[m * META_LEN:(m + 1) * META_LEN], rows[m * META_LEN:(m + 1) * META_LEN]
            kind = _KIND_NAMES.get(x[0], "?")
            if _key(x, kind) != _key(y, kind):
                what = f" (tensor {m} of {members})" if members > 1 else ""
                raise HorovodInternalError(
                    f"{prefix()}{kind} \"{name}\"{what}: the ranks disagree: rank {base[0]} has "
                    f"{_describe(x)}, rank {r} has {_describe(y)}")


# ---- handles ----

class Stage:
    """The second part of a two-step op, issued by a callback once the
    first completed (on the extension's completion thread)."""

    def __init__(self):
        self.event = threading.Event()
        self.work = None
        self.error = None

    def done(self):
        return self.event.is_set() and (self.work is None or self.work.is_completed())


def then(first, stage, fn):
    """Runs `fn()` (which returns the next Work, or raises) when `first`
    succeeded; records a failure in `stage`."""
    def cb(fut):
        try:
            fut.wait()
            stage.work = fn()
        except BaseException as e:  # noqa: B902 (recorded, raised in synchronize)
            stage.error = e
        finally:
            stage.event.set()
    first.get_future().add_done_callback(cb)


class Handle:
    """An op of the API in flight: its library Works, an optional second
    stage, and `finish() -> output`, run by `synchronize`."""

    def __init__(self, what):
        self.what = what
        self.works = []
        self.stage = None
        self.finish = None
        self.names = []
        self.inst = 0

    def done(self):
        return all(w.is_completed() for w in self.works) and (
            self.stage is None or self.stage.done())

    def wait(self):
        try:
            for w in self.works:
                w.wait()
            if self.stage is not None:
                self.stage.event.wait()
                if self.stage.error is not None:
                    raise self.stage.error
                self.stage.work.wait()
        except HorovodInternalError:
            raise
        except RuntimeError as e:
            raise HorovodInternalError(str(e)) from e
        finally:
            release(self)
        return self.finish() if self.finish is not None else None


class Bounded(OrderedDict):
    """A dict that forgets its least recently set entries past `limit`."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)
