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
* an announcement for `hvd.join` (see _join.py), for ops of the global
  process set only.

An op runs in a scope (`Scope`, from `check_process_set`): the global
process set (every rank, library group 0) or a process set that every
rank added (`hvd.add_process_set`) and whose members made a library group
of their own. The library matches a group's ops only with the same group's
ops on its other members, so names need only be unique within a set: a
set keeps its own counters of unnamed ops, and the names in flight are
told apart per set.
"""

import numbers
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


# ---- process sets ----

class ProcessSet:
    """Horovod's process set: ranks (sorted) that run ops among
    themselves. It gets an id when every rank adds it, in the same order
    (`hvd.add_process_set`, or `hvd.init(process_sets=[...])`): 1, 2, ...
    (the ids of removed sets are given again first). Its members then make
    one library group for it; other ranks make nothing."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks "
                             "(kungfu.torch has no MPI communicators)") from None
        if any(not isinstance(r, numbers.Integral) or isinstance(r, bool) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks "
                             f"(integers), not {ranks_or_comm!r}")
        self.ranks = sorted(int(r) for r in ranks)

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """The number of its ranks, None until it is added."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self):
        """This rank's index among its ranks (None until it is added;
        ValueError where this rank is not one of them). Ops take global
        ranks (roots) all the same."""
        if self.process_set_id is None:
            return None
        me = _global_rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self):
        """Whether this rank is one of its ranks."""
        if self.ranks is None:
            return None
        return _global_rank() in self.ranks

    def __str__(self):
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                "mpi_comm=None)")

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank (id 0); its ranks follow the cluster (empty before
    `hvd.init()`)."""

    process_set_id = 0

    def __init__(self):
        pass

    @property
    def ranks(self):
        return list(range(kungfu.size())) if state.initialized else []

    def size(self):
        check_initialized()
        return kungfu.size()

    def rank(self):
        check_initialized()
        return kungfu.rank()

    def included(self):
        return True


global_process_set = _GlobalProcessSet()


def _global_rank():
    check_initialized()
    return kungfu.rank()


class Scope:
    """Where an op runs: `group` (the library group; 0 for every rank),
    `ranks` (the members' global ranks, in set order), `rank` (this rank's
    index among them), `size`. A set's scope also holds its id, its
    ProcessSet, its counters of unnamed ops and `key`, which tells its
    names in flight from other sets' in this process."""

    def __init__(self, group, ranks, rank, counters, pid=0, key="", process_set=None):
        self.group, self.ranks, self.rank = group, ranks, rank
        self.size = len(ranks)
        self.pid, self.counters, self.key, self.process_set = pid, counters, key, process_set
        self.is_global = group == 0

    def where(self):
        """" in process set <id>" for messages ("" for the global one)."""
        return "" if self.is_global else f" in process set {self.pid}"

    def set_rank(self, root, what):
        """The set rank of global rank `root`; ValueError if it is not a
        member."""
        root = int(root)
        if root not in self.ranks:
            where = (f"one of the {self.size} ranks" if self.is_global else
                     f"in process set {self.pid} (ranks {list(self.ranks)})")
            raise ValueError(f"{prefix()}{what}: root rank {root} is not {where}")
        return self.ranks.index(root)


# process set id -> its Scope (group None where this rank is not a member)
process_sets = {}
_serial = [0]


def new_set_scope(ps, pid, group):
    """The scope of process set `ps`, just added as `pid` (`group`: its
    library group here, None if this rank is not a member)."""
    _serial[0] += 1
    me = kungfu.rank()
    return Scope(group, list(ps.ranks), ps.ranks.index(me) if group is not None else None, {},
                 pid=pid, key=f"set{_serial[0]}/", process_set=ps)


def check_process_set(process_set):
    """The Scope of an op on `process_set` (None or `global_process_set`:
    every rank). ValueError for a set not added (or removed), or one this
    rank is not a member of."""
    if isinstance(process_set, Scope):
        return process_set
    check_initialized()
    if process_set is None or process_set is global_process_set or (
            isinstance(process_set, ProcessSet) and process_set.process_set_id == 0):
        return Scope(0, range(kungfu.size()), kungfu.rank(), _counters)
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{prefix()}process_set must be a ProcessSet, not "
                         f"{type(process_set).__name__}")
    pid = process_set.process_set_id
    scope = process_sets.get(pid) if pid is not None else None
    if scope is None:
        raise ValueError(f"{prefix()}{process_set} has not been added (or was removed): every "
                         "rank adds it with hvd.add_process_set first")
    if scope.group is None:
        raise ValueError(f"{prefix()}this rank is not in process set {pid} (ranks "
                         f"{scope.ranks}): only its members run its ops")
    return scope


def world():
    """The scope of the global process set."""
    return check_process_set(None)


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
        for scope in process_sets.values():
            scope.counters.clear()


def full_name(kind, name, scope=None):
    """`<kind>.<name>`, or `<kind>.noname.<N>` counting the unnamed ops of
    that kind in `scope` (default: the global set)."""
    if name is None:
        counters = _counters if scope is None else scope.counters
        with lock:
            n = counters.get(kind, 0)
            counters[kind] = n + 1
        return f"{kind}.noname.{n}"
    return f"{kind}.{name}"


def claim(names, handle, scope=None):
    """Registers `names` (of ops in `scope`, default the global set) for
    `handle`; a name still in use raises ValueError (here, when the op is
    issued, as horovod does). A name is in use from its op's start until
    its handle is synchronized (not merely until the op completes, which
    would make the error depend on timing)."""
    key = "" if scope is None else scope.key
    where = "" if scope is None else scope.where()
    with lock:
        for n in names:
            h = _inflight.get(key + n)
            if h is not None and h is not handle:
                raise ValueError(f"{prefix()}an op named {n!r}{where} is already in flight: "
                                 "names must be unique among ops not synchronized yet "
                                 "(synchronize the first one, or use another name)")
        for n in names:
            _inflight[key + n] = handle
        handle.names.extend(key + n for n in names)


def release(handle):
    with lock:
        for n in handle.names:
            if _inflight.get(n) is handle:
                del _inflight[n]


def release_all():
    with lock:
        _inflight.clear()


# ---- what the ranks of an op must agree on ----

_MASK = (1 << 64) - 1
# appended to a library mismatch of an op with a check
CHECK_HINT = ("every rank must give a tensor of the same type and shape, and the same "
              "reduction, root and scale factors")


def describe_checked(kind, tensors, op=-1, root=-1, pre=1.0, post=1.0):
    """What op_check covers of `tensors`, in words (for Handle.checked)."""
    return "; ".join(_describe(meta_row(kind, t, op, root, pre, post)) for t in tensors)


def op_check(kind, tensor, op=-1, root=-1, pre=1.0, post=1.0):
    """The check (kf_set_check) of an op on `tensor`: what its ranks must
    agree on beyond the type, count, reduction and root, which the library
    checks itself: the shape and the scale factors. It travels in the
    digest of the op's frames, so it costs no message. Python's hash of a
    tuple of ints is the same in every process (PYTHONHASHSEED only
    changes those of str and bytes)."""
    key = (META_KINDS[kind], DTYPE_CODE[tensor.dtype], tuple(tensor.shape), op, root,
           _bits(pre), _bits(post))
    return hash(key) & _MASK


# ---- metadata (alltoall: the splits) ----

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


def meta_issue(name, rows, scope=None):
    """Starts the allgather of this rank's metadata rows (a list of ints)
    among the ranks of `scope` (default: every rank); returns (work,
    gathered)."""
    scope = scope or world()
    mine = torch.tensor(rows, dtype=torch.int64)
    gathered = torch.empty(mine.numel() * scope.size, dtype=torch.int64)
    return _C.allgather(mine, gathered, "meta:" + name, group=scope.group), gathered


def meta_check(name, gathered, members=1, extra=0, scope=None):
    """Raises HorovodInternalError on every rank of `scope` if their rows
    differ (ranks that joined are left out); names global ranks."""
    scope = scope or world()
    n = scope.size
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
                    f"{prefix()}{kind} \"{name}\"{scope.where()}{what}: the ranks disagree: "
                    f"rank {scope.ranks[base[0]]} has {_describe(x)}, rank {scope.ranks[r]} has "
                    f"{_describe(y)}")


# ---- handles ----

class Stage:
    """The second part of a two-step op, issued by a callback once the
    first completed (on the thread that completed it: the extension's
    completion thread, or one in its Work's wait())."""

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
        # its ops carry checks (op_check): what this rank gave, as said
        # when they fail with a mismatch
        self.checked = None

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
            msg = str(e)
            if self.checked and "mismatch" in msg.lower():
                msg = f"{msg}; {self.what}: this rank has {self.checked} ({CHECK_HINT})"
            raise HorovodInternalError(msg) from e
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
